//! The steps of [`Dataplane::start`], in the order it takes them: the checks of the
//! settings, the service device's program and the node's own traffic, the connection
//! tables and what a previous kxp kept of them, the workers, and the link thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use conntrack::{ConnTable, SnatPorts};
use crossbeam::channel::Receiver;
use crossbeam::queue::ArrayQueue;
use nat::snapshot::Snapshot;

use super::{
    Dataplane, DataplaneConfig, DataplaneError, FRAG_DATAGRAMS, FRAG_PARKED_BYTES, FRAG_TIMEOUT_NS,
    LinkCtl, Programming, WorkerParts, keep_off_worker_cpus, matching_links, os_seed, other_cpus,
    rx_queues,
};
use crate::fib::FibMirror;
use crate::persistence::Persistence;
use crate::servicedev::{KernelPolicy, NodePortRules, Routes, ServiceDevice};
use crate::statefile::StateDir;
use crate::worker::{Command, Shared, WorkerStats};
use crate::xdp::{AttachMode, Origin, Steering};
use crate::xsk::{Sockets, XskConfig};
use engine::{Engine, NodeState};

/// Checks that kxp has the capabilities it needs and that the settings hold together
/// (the interfaces named without a wildcard included, see [`check_interfaces`]); returns
/// each worker's share of the SNAT ports.
pub(super) fn check(cfg: &DataplaneConfig) -> Result<Vec<SnatPorts>, DataplaneError> {
    crate::caps::check_required().map_err(DataplaneError::Capabilities)?;
    if cfg.interfaces.is_empty() {
        return Err(DataplaneError::NoInterface);
    }
    if cfg.workers == 0 || cfg.workers > 64 {
        return Err(DataplaneError::Config(format!(
            "{} workers: give 1 to 64",
            cfg.workers
        )));
    }
    if let Some(cpus) = &cfg.cpus
        && cpus.len() != cfg.workers
    {
        return Err(DataplaneError::Config(format!(
            "{} CPUs listed for {} workers",
            cpus.len(),
            cfg.workers
        )));
    }
    check_interfaces(cfg)?;
    let (lo, hi) = cfg.snat_ports;
    SnatPorts::for_workers(lo..=hi, cfg.workers)
        .map_err(|e| DataplaneError::Config(format!("SNAT port range {lo}-{hi}: {e}")))
}

/// Checks each interface pattern, and each interface named without a wildcard: it must
/// exist now, not be a bond, and have a receive queue for every worker.
fn check_interfaces(cfg: &DataplaneConfig) -> Result<(), DataplaneError> {
    for pattern in &cfg.interfaces {
        crate::ifmatch::check(pattern).map_err(DataplaneError::BadPattern)?;
        if crate::ifmatch::is_pattern(pattern) {
            continue;
        }
        // A name without a wildcard must exist now: a typo is an error.
        let queues =
            rx_queues(pattern).ok_or_else(|| DataplaneError::NoSuchInterface(pattern.clone()))?;
        if let Some(ports) = crate::ifmatch::bond_ports(pattern) {
            return Err(DataplaneError::Bond {
                ifname: pattern.clone(),
                ports,
            });
        }
        if queues < cfg.workers {
            return Err(DataplaneError::Queues {
                ifname: pattern.clone(),
                queues,
                workers: cfg.workers,
            });
        }
    }
    Ok(())
}

/// What start-up derives from the settings before it touches the system.
#[derive(Debug)]
pub(super) struct Settings {
    /// The sockets' settings, multi-buffer turned on if an interface needs it.
    pub(super) xsk: XskConfig,
    /// The largest MTU a single frame holds.
    pub(super) frame_mtu: usize,
    /// Steering outlives the process (a state directory).
    pub(super) keep: bool,
    /// How the programs are attached.
    pub(super) attach: AttachMode,
}

impl Settings {
    /// Derives the settings from `cfg` (and the MTUs of the interfaces that match now).
    pub(super) fn of(cfg: &DataplaneConfig) -> Settings {
        // Multi-buffer costs on every packet in copy mode: on only when an interface that
        // matches has an MTU larger than a UMEM frame holds (or when asked).
        let mut xsk = cfg.xsk.clone();
        let frame_mtu = (xsk.frame_size as usize).saturating_sub(256 + 14);
        let big = matching_links(&cfg.interfaces)
            .into_iter()
            .filter(|(_, mtu)| *mtu > frame_mtu)
            .collect::<Vec<_>>();
        if !xsk.multi_buffer && !big.is_empty() {
            tracing::info!(interfaces = ?big, "MTU larger than a frame: AF_XDP multi-buffer on");
            xsk.multi_buffer = true;
        }
        // With a state directory, kxp's steering outlives the process: programs attached
        // over netlink (native mode; a bpf_link would go with the process), the service
        // device, its routes and rules are kept at stop and taken over at start (see
        // crate::statefile).
        let keep = cfg.state_dir.is_some();
        let attach = if keep && cfg.attach == AttachMode::Link {
            AttachMode::Native
        } else {
            cfg.attach
        };
        Settings {
            xsk,
            frame_mtu,
            keep,
            attach,
        }
    }
}

/// Starts the mirror of the host's routing and neighbour tables and waits (up to 5 s)
/// until it holds them.
pub(super) fn fib_mirror() -> Result<Arc<FibMirror>, DataplaneError> {
    let fib = Arc::new(FibMirror::start(&[])?);
    fib.wait_ready(Duration::from_secs(5))?;
    Ok(fib)
}

/// What the workers share, `initial` published in it, and each worker's end of its
/// command channel.
pub(super) fn shared_state(
    cfg: &DataplaneConfig,
    initial: &Arc<Snapshot>,
) -> Result<(Vec<Receiver<Command>>, Arc<Shared>), DataplaneError> {
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..cfg.workers)
        .map(|_| crossbeam::channel::unbounded())
        .unzip();
    let shared = Arc::new(Shared {
        snapshot: ArcSwap::new(initial.clone()),
        stop: AtomicBool::new(false),
        stats: (0..cfg.workers).map(|_| WorkerStats::default()).collect(),
        inbox: (0..cfg.workers).map(|_| ArrayQueue::new(4096)).collect(),
        commands: txs
            .into_iter()
            .map(|tx| {
                crate::sys::Wake::new().map(|w| crate::worker::CommandSender::new(tx, Arc::new(w)))
            })
            .collect::<Result<_, _>>()
            .map_err(|e| DataplaneError::Config(format!("cannot create an eventfd: {e}")))?,
        attached: ArcSwap::from_pointee(Vec::new()),
        frags: std::sync::Mutex::new(conntrack::FragTable::new(
            FRAG_DATAGRAMS,
            FRAG_PARKED_BYTES,
            FRAG_TIMEOUT_NS,
        )),
        holder: cfg.socket_holder.as_deref().and_then(|exe| {
            crate::holder::SocketHolder::spawn(exe)
                .inspect(|h| tracing::debug!(pid = h.pid(), "socket holder started"))
                .inspect_err(|e| {
                    tracing::warn!(
                        "cannot start the socket holder ({}): a kxp that dies has its \
                         sockets released one after another: {e}",
                        exe.display()
                    );
                })
                .ok()
        }),
        hand_over: Default::default(),
    });
    Ok((rxs, shared))
}

/// With a state directory, this process's new state files and affinity table, made
/// before the lock, and the previous process's flows read ahead into `tables` (see
/// [`Persistence::prepare`]).
pub(super) fn prepare_state(
    cfg: &DataplaneConfig,
    tables: &mut [ConnTable],
) -> Result<Option<crate::persistence::PreparedFiles>, DataplaneError> {
    cfg.state_dir
        .as_deref()
        .map(|dir| {
            let now = crate::sys::monotonic_ns();
            Persistence::prepare(dir, tables, cfg.affinity_capacity, now)
        })
        .transpose()
        .map_err(|e| DataplaneError::State(e.to_string()))
}

/// With a state directory, locks it (waiting for a previous kxp still stopping): before
/// anything of the node is touched, since what the previous kxp left (the steering
/// program, its maps, the service device) is taken up next.
pub(super) fn lock_state(cfg: &DataplaneConfig) -> Result<Option<StateDir>, DataplaneError> {
    cfg.state_dir
        .as_deref()
        .map(Persistence::lock)
        .transpose()
        .map_err(|e| DataplaneError::State(e.to_string()))
}

/// Takes up the steering program a previous kxp of this build left pinned, or else loads
/// it (the kernel verifies it), and logs which and how long that took since `since`.
pub(super) fn load_steering(since: Instant, keep: bool) -> Result<Steering, DataplaneError> {
    let (service_prog, origin) = Steering::load_or_adopt(keep)?;
    tracing::info!(
        took_ms = since.elapsed().as_millis() as u64,
        prog_id = service_prog.prog_id(),
        "{}",
        match origin {
            Origin::Loaded => "steering program loaded",
            Origin::Adopted =>
                "steering program taken up from the previous kxp (the same build, pinned): no load",
        }
    );
    Ok(service_prog)
}

/// The service device and the steering program: those taken up ahead of a hand-over
/// ([`super::Prepared::take_up_ahead`]), or else taken up (or made, loaded) now. The
/// steering program is loaded (and verified) once: every interface attached later shares
/// it and its maps (see crate::xdp).
pub(super) fn take_up(
    cfg: &DataplaneConfig,
    settings: &Settings,
    service: Option<ServiceDevice>,
    steering: Option<Steering>,
    times: &mut super::StartTimes,
    lap: &mut Instant,
) -> Result<(ServiceDevice, Steering), DataplaneError> {
    let service = match service {
        Some(mut s) => {
            s.own();
            s
        }
        None => ServiceDevice::create(&cfg.service_device, cfg.workers as u32, settings.keep)?,
    };
    times.lap("service device", lap);
    *lap = Instant::now();
    let steering = match steering {
        Some(s) => s,
        None => load_steering(*lap, settings.keep)?,
    };
    times.lap("steering program", lap);
    Ok((service, steering))
}

/// Readies the program for the service device's kxp side: its SNAT ports, 802.1Q
/// steering and the service device's mode; with a state directory, it holds packets while
/// no socket takes them, and the rules a previous kxp kept are put back in order.
pub(super) fn prepare_service_program(
    service_prog: &mut Steering,
    service: &ServiceDevice,
    cfg: &DataplaneConfig,
    keep: bool,
) -> Result<(), DataplaneError> {
    let (lo, hi) = cfg.snat_ports;
    service_prog.prepare_for(&service.dp, service.dp_ifindex)?;
    service_prog.set_snat_range(lo, hi)?;
    // Frames with one 802.1Q tag (a trunk) are looked into: a tagged client's
    // Service traffic is kxp's like an untagged one's, its tag taken off by the
    // worker and put back on what goes back to it.
    service_prog.set_vlan_steering(true)?;
    service_prog.set_service_device()?;
    if keep {
        service_prog.set_hold(cfg.workers as u32)?;
        // The rules a previous kxp kept, back in order before this one adds its own.
        crate::servicedev::cleanup_rules()?;
    }
    Ok(())
}

/// The node's own traffic on the service device's host side: the routes of the Service
/// addresses into it, the policy rules for the node's NodePorts, and the rules of
/// `kxp.networkPolicy: kernel` (see [`kernel_policy`]).
pub(super) fn node_traffic(
    cfg: &DataplaneConfig,
    service: &ServiceDevice,
) -> Result<(Routes, NodePortRules, Option<KernelPolicy>), DataplaneError> {
    let routes = Routes::new(&service.host, service.host_ifindex)?;
    let nodeport_rules = NodePortRules::new(&service.host, service.host_ifindex)?;
    let kernel_policy = kernel_policy(cfg, service)?;
    Ok((routes, nodeport_rules, kernel_policy))
}

/// With `kxp.networkPolicy: kernel`, installs its rules and says what they do; without,
/// removes those a previous kxp left in that mode.
fn kernel_policy(
    cfg: &DataplaneConfig,
    service: &ServiceDevice,
) -> Result<Option<KernelPolicy>, DataplaneError> {
    if cfg.kernel_policy {
        // The kernel's masquerade ports: its ephemeral range below kxp's own SNAT
        // ports (never a NodePort: an answer to one would look like a connection).
        let lo = cfg.snat_ports.0;
        let masq = (
            if lo > 33_792 { 32_768 } else { 1_024 },
            lo.saturating_sub(1),
        );
        let p = KernelPolicy::install(&service.host, service.host_ifindex, masq)?;
        tracing::info!(
            table = crate::servicedev::HANDOVER_TABLE,
            "kxp.networkPolicy: kernel: connections to this node's pods are translated \
             by kxp and carried by the kernel through {} (its connection tracking, the \
             CNI's filtering in FORWARD, its masquerade into ports {}-{}); their answers \
             come back through routing table {}",
            service.host,
            masq.0,
            masq.1,
            crate::servicedev::HANDOVER_ROUTE_TABLE
        );
        Ok(Some(p))
    } else {
        // A previous kxp's, in that mode.
        if crate::servicedev::remove_kernel_policy()? {
            tracing::info!("removed the rules of kxp.networkPolicy: kernel (a previous kxp's)");
        }
        Ok(None)
    }
}

/// A connection table per worker (its share of the SNAT ports in `ranges`), on huge
/// pages where the kernel has them and resident from now.
pub(super) fn connection_tables(
    cfg: &DataplaneConfig,
    ranges: Vec<SnatPorts>,
) -> Result<Vec<ConnTable>, DataplaneError> {
    let tables = ranges
        .into_iter()
        .map(|snat| {
            ConnTable::new(cfg.conntrack_per_worker, cfg.timeouts, snat)
                .map_err(|e| DataplaneError::Conntrack(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // The tables on huge pages (at hundreds of thousands of flows a lookup misses the
    // TLB as well as the cache) and resident from now: a page fault on the packet
    // path, a huge page's above all, stalled the worker for milliseconds.
    let mut advised = Ok(());
    let mut bytes = 0;
    for (addr, len) in tables.iter().flat_map(ConnTable::regions) {
        advised = advised.and(crate::sys::populate_huge(addr, len));
        bytes += len;
    }
    match advised {
        Ok(()) => tracing::info!(
            "connection tables resident, on huge pages where the kernel has them: {} MiB",
            bytes >> 20
        ),
        Err(e) => tracing::info!(
            "connection tables ({} MiB) not all on huge pages or resident: {e}",
            bytes >> 20
        ),
    }
    Ok(tables)
}

/// With a state directory (`locked`), restores into `tables` and the node's state the
/// flows and affinity a previous kxp kept there (the files it holds are the workers'
/// journals from now); without one, the node's state starts empty.
pub(super) fn restore_state(
    cfg: &DataplaneConfig,
    locked: Option<StateDir>,
    files: Option<crate::persistence::PreparedFiles>,
    tables: &mut [ConnTable],
) -> Result<(Option<Persistence>, Arc<NodeState>), DataplaneError> {
    match locked {
        Some(sd) => {
            let now = crate::sys::monotonic_ns();
            let started = match files {
                Some(f) => Persistence::start_prepared(sd, f, tables, now),
                None => Persistence::start_locked(sd, tables, cfg.affinity_capacity, now),
            };
            let (p, affinity) = started.map_err(|e| DataplaneError::State(e.to_string()))?;
            let r = &p.restored;
            tracing::info!(
                dir = %p.dir.path.display(),
                flows = r.flows,
                affinity = r.affinity,
                bad_records = r.bad_records,
                flows_dropped = r.flows_dropped,
                read_ahead_ms = r.read_ahead.as_millis() as u64,
                caught_up = r.caught_up,
                read_ms = r.took[0].as_millis() as u64,
                files_ms = r.took[1].as_millis() as u64,
                affinity_ms = r.took[2].as_millis() as u64,
                "state restored"
            );
            for f in &r.bad_files {
                tracing::warn!("state file not used, starting without what it held: {f}");
            }
            Ok((Some(p), NodeState::with_affinity(affinity)))
        }
        None => Ok((None, NodeState::new(cfg.affinity_capacity))),
    }
}

/// What every worker is given, borrowed from start-up (see [`WorkerKit::parts`]).
pub(super) struct WorkerKit<'a> {
    pub(super) cfg: &'a DataplaneConfig,
    pub(super) xsk: &'a XskConfig,
    pub(super) service: &'a ServiceDevice,
    pub(super) fib: &'a FibMirror,
    pub(super) shared: &'a Arc<Shared>,
    pub(super) node: &'a Arc<NodeState>,
}

impl WorkerKit<'_> {
    /// Worker `id`'s sockets: those the previous kxp handed over, if any and made as this
    /// one makes them, else new ones, the UMEM's own on the service device (see
    /// crate::servicedev).
    fn sockets(
        &self,
        id: usize,
        handed: Option<crate::xsk::Handed>,
        premapped: &mut crate::xsk::Premapped,
    ) -> Result<Sockets, DataplaneError> {
        let dp = (self.service.dp_ifindex, id as u32);
        if let Some(h) = handed {
            let first = h.state.ports.first().map(|p| (p.ifindex, p.queue));
            let adopted = if first == Some(dp) {
                Sockets::adopt(self.xsk, h, premapped).map_err(|e| e.to_string())
            } else {
                Err(format!(
                    "its first socket is on ifindex {:?}, not on kxp's service device queue {id}",
                    first
                ))
            };
            match adopted {
                Ok(s) => return Ok(s),
                Err(e) => tracing::warn!(
                    "worker {id}: the sockets the previous kxp handed over cannot be taken up \
                     ({e}): opening new ones"
                ),
            }
        }
        // The sockets mapped ahead go (their references with them): new ones are bound to
        // the same queues. (Another worker's, if any, are mapped at its take-up then.)
        *premapped = crate::xsk::Premapped::default();
        // A socket handed over and let go a moment ago is released in the background.
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            match Sockets::open(self.xsk, std::slice::from_ref(&self.service.dp), id as u32) {
                Err(e) if e.is_busy() && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                r => return Ok(r?),
            }
        }
    }

    /// Puts each worker together (not started): its command channel's end from `rxs`, its
    /// table from `tables`, its journal from `persistence`, and its UMEM's own socket,
    /// opened here on the service device and entered in `service_prog`'s socket map.
    /// Returns them, with the channel each worker's thread id comes by once it runs.
    pub(super) fn parts(
        &self,
        rxs: Vec<Receiver<Command>>,
        tables: Vec<ConnTable>,
        service_prog: &mut Steering,
        persistence: &mut Option<Persistence>,
        handed: Vec<crate::xsk::Handed>,
        mut premapped: crate::xsk::Premapped,
    ) -> Result<(Vec<WorkerParts>, std::sync::mpsc::Receiver<libc::pid_t>), DataplaneError> {
        let (cfg, xsk, service) = (self.cfg, self.xsk, self.service);
        let mut handed: std::collections::HashMap<usize, crate::xsk::Handed> = handed
            .into_iter()
            .map(|h| (h.state.queue as usize, h))
            .collect();
        // Each worker is put together in its own thread, around its sockets branded
        // there (see crate::xsk): what it needs is gathered here.
        let mut workers = Vec::new();
        let (started_tx, started) = std::sync::mpsc::channel();
        for (id, (rx, mut table)) in rxs.into_iter().zip(tables).enumerate() {
            // A hint, no I/O: the table prefetches the flows it will evict next.
            table.set_prefetch(crate::sys::prefetch);
            let sockets = self.sockets(id, handed.remove(&id), &mut premapped)?;
            service_prog.set_socket(id as u32, sockets.fd(0))?;
            let mut engine = Engine::on_node(
                table,
                os_seed() ^ (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                self.node.clone(),
            );
            engine.host_interface = Some(service.dp.clone());
            engine.kernel_policy = cfg.kernel_policy;
            workers.push(WorkerParts {
                id,
                cpu: cfg.cpus.as_ref().map(|c| c[id]),
                nice: cfg.effective_worker_nice(),
                sockets,
                engine,
                fib: self.fib.view(),
                shared: self.shared.clone(),
                commands: rx,
                busy_poll: xsk.busy_poll.is_some(),
                idle_spin_us: xsk.idle_spin_us.unwrap_or(if cfg.cpus.is_some() {
                    10_000
                } else {
                    0
                }),
                queue_budget_us: xsk.queue_budget_us,
                journal: persistence
                    .as_mut()
                    .and_then(|p| p.conntrack.get_mut(id))
                    .and_then(Option::take),
                local_delivery: crate::worker::LocalDelivery {
                    ifindex: service.dp_ifindex,
                    src_mac: service.dp_mac,
                    dst_mac: service.host_mac,
                },
                handover: cfg.kernel_policy,
                started: started_tx.clone(),
            });
        }
        drop(started_tx);
        Ok((workers, started))
    }
}

/// Attaches `service_prog` to the service device's kxp side, unless a previous kxp's
/// program (kept with a state directory) steers it: that one stays until
/// [`Dataplane::take_over`]. Returns whether there is nothing left to take over.
pub(super) fn steer_service_device(
    service_prog: &mut Steering,
    service: &ServiceDevice,
    settings: &Settings,
) -> Result<bool, DataplaneError> {
    let (keep, attach) = (settings.keep, settings.attach);
    let taken_over = !(keep && Steering::kept_on(&service.dp, attach));
    if taken_over {
        service_prog.attach(&service.dp, attach, keep)?;
    }
    Ok(taken_over)
}

impl Programming {
    /// What the programs hold at start: the service device's program, routes and rules,
    /// no interface yet, the maps to be filled in full.
    pub(super) fn at_start(
        cfg: &DataplaneConfig,
        taken_over: bool,
        service_prog: Steering,
        node_traffic: Option<(Routes, NodePortRules, Option<KernelPolicy>)>,
    ) -> Programming {
        let (routes, nodeport_rules, kernel_policy) = match node_traffic {
            Some((r, n, k)) => (Some(r), Some(n), k),
            None => (None, None, None),
        };
        Programming {
            taken_over,
            needs_full: true,
            service: Some(service_prog),
            routes,
            nodeport_rules,
            kernel_policy,
            snat: cfg.snat_ports,
            ..Programming::default()
        }
    }
}

impl LinkCtl {
    /// The link manager, around `prog`.
    pub(super) fn at_start(
        cfg: &DataplaneConfig,
        settings: &Settings,
        service: &ServiceDevice,
        shared: &Arc<Shared>,
        fib: &Arc<FibMirror>,
        prog: Programming,
    ) -> Arc<LinkCtl> {
        Arc::new(LinkCtl {
            prog: Mutex::new(prog),
            patterns: cfg.interfaces.clone(),
            attach: settings.attach,
            workers: cfg.workers,
            busy_poll: cfg.xsk.busy_poll.is_some(),
            shared: shared.clone(),
            fib: fib.clone(),
            reserved: vec![service.host.clone(), service.dp.clone()],
            multi_buffer: settings.xsk.multi_buffer,
            frame_mtu: settings.frame_mtu,
            keep: settings.keep,
        })
    }
}

impl Dataplane {
    /// Starts a thread for each worker (`kxp-worker-N`).
    pub(super) fn spawn_workers(
        &mut self,
        workers: Vec<WorkerParts>,
    ) -> Result<(), DataplaneError> {
        for p in workers {
            let name = format!("kxp-worker-{}", p.id);
            let h = std::thread::Builder::new()
                .name(name)
                .spawn(move || p.run())
                .map_err(|e| {
                    DataplaneError::Config(format!("cannot start a worker thread: {e}"))
                })?;
            self.threads.push(h);
        }
        Ok(())
    }

    /// Starts the link thread (`kxp-links`), which attaches to links coming and going
    /// through `links` (woken by the FIB mirror), and with pinned workers keeps the
    /// interfaces' NAPI kthreads off their CPUs and their CPUs' ksoftirqd at their nice.
    pub(super) fn follow_links(
        &mut self,
        cfg: &DataplaneConfig,
        links: Arc<LinkCtl>,
    ) -> Result<(), DataplaneError> {
        let stop = self.link_stop.clone();
        let published = self.fib.published();
        let view = self.fib.view();
        // With pinned workers, the attached interfaces' threaded NAPI kthreads are kept
        // off their CPUs (crate::napi), checked once a second.
        let mut napi = cfg.cpus.as_ref().map(|cpus| {
            crate::napi::NapiGuard::new(cpus.clone(), other_cpus(cpus).unwrap_or_default())
        });
        // And their CPUs' ksoftirqd kept at the workers' nice (crate::priority), put
        // back when the thread ends.
        let mut softirq = cfg
            .cpus
            .as_ref()
            .zip(cfg.effective_worker_nice())
            .filter(|&(_, nice)| nice < 0)
            .map(|(cpus, nice)| crate::priority::SoftirqNice::new(cpus.clone(), nice));
        let h = std::thread::Builder::new()
            .name("kxp-links".into())
            .spawn(move || {
                let mut napi_checked: Option<Instant> = None;
                while !stop.load(Ordering::Relaxed) {
                    if let Some(g) = napi.as_mut()
                        && napi_checked.is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
                    {
                        napi_checked = Some(Instant::now());
                        if let Some(s) = softirq.as_mut() {
                            s.check();
                        }
                        let names: Vec<String> = links
                            .lock()
                            .steering
                            .iter()
                            .filter_map(|s| s.ifname().map(str::to_string))
                            .collect();
                        g.check(&names);
                    }
                    // Woken by every change of the host's tables (links included), and
                    // at least ten times a second (a stop is seen within 0.1 s).
                    let _ = published.recv_timeout(Duration::from_millis(100));
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let _ = links.reconcile(&view.links(), false);
                }
            })
            .map_err(|e| DataplaneError::Config(format!("cannot start the link thread: {e}")))?;
        self.link_thread = Some(h);
        Ok(())
    }
}

/// With pinned workers, waits for each worker's thread id (up to 2 s for each) on
/// `started` and moves kxp's other threads off the workers' CPUs. The workers' thread
/// ids (none when they are not pinned).
pub(super) fn keep_others_off(
    cfg: &DataplaneConfig,
    started: &std::sync::mpsc::Receiver<libc::pid_t>,
) -> Vec<libc::pid_t> {
    let Some(cpus) = &cfg.cpus else {
        return Vec::new();
    };
    let worker_tids: Vec<libc::pid_t> = (0..cpus.len())
        .map_while(|_| started.recv_timeout(Duration::from_secs(2)).ok())
        .collect();
    keep_off_worker_cpus(cpus, &worker_tids);
    worker_tids
}
