//! The dataplane as a whole: the XDP steering program on every attached interface, the
//! FIB mirror, one worker per queue, and the publication of snapshots.
//!
//! Publication is an RCU-style pointer swap ([`arc_swap::ArcSwap`]): workers load the
//! current snapshot once per batch and never wait; an old snapshot is freed when the last
//! worker that loaded it lets go. After the swap the XDP program's maps are brought in
//! line by difference (only what changed touches the kernel), UDP flows to endpoints that
//! went away are cleared in every worker, and the next hops of new endpoints are resolved
//! ahead of their first packet.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use arc_swap::ArcSwap;
use conntrack::{SnatPorts, Timeouts};
use crossbeam::queue::ArrayQueue;
use nat::model::NodePortAddresses;
use nat::snapshot::Snapshot;
use nat::tuple::Protocol;

use crate::engine::Engine;
use crate::fib::FibMirror;
use crate::worker::{Command, FlowInfo, Shared, Worker, WorkerStats};
use crate::xdp::{AttachMode, SteerKey, Steering};
use crate::xsk::{WorkerIo, XskConfig};

/// How to run the dataplane.
#[derive(Debug, Clone)]
pub struct DataplaneConfig {
    pub interfaces: Vec<String>,
    pub workers: usize,
    /// CPU of each worker (`None`: not pinned).
    pub cpus: Option<Vec<usize>>,
    pub xsk: XskConfig,
    pub attach: AttachMode,
    /// Connection-table capacity of each worker.
    pub conntrack_per_worker: usize,
    pub timeouts: Timeouts,
    /// Masquerade source ports (outside the kernel's ephemeral range and the NodePorts).
    pub snat_ports: (u16, u16),
}

impl Default for DataplaneConfig {
    fn default() -> Self {
        DataplaneConfig {
            interfaces: Vec::new(),
            workers: 1,
            cpus: None,
            xsk: XskConfig::default(),
            attach: AttachMode::Link,
            conntrack_per_worker: 262_144,
            timeouts: Timeouts::default(),
            snat_ports: (61_000, 65_535),
        }
    }
}

/// Starting or driving the dataplane failed.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("kxp's dataplane needs root (CAP_NET_ADMIN, CAP_BPF, CAP_NET_RAW); run it as root")]
    NotRoot,
    #[error("no interface given; kxp attaches to: --interface NAME (repeat for each)")]
    NoInterface,
    #[error("interface {0} not found; kxp attaches to: --interface NAME (see `ip link`)")]
    NoSuchInterface(String),
    #[error(
        "interface {ifname} has {queues} receive queue(s) but {workers} workers need one each; \
         give --workers {queues} or raise the queue count (ethtool -L {ifname} combined {workers})"
    )]
    Queues {
        ifname: String,
        queues: usize,
        workers: usize,
    },
    #[error("invalid dataplane settings: {0}")]
    Config(String),
    #[error(transparent)]
    Xdp(#[from] crate::xdp::XdpError),
    #[error(transparent)]
    Xsk(#[from] crate::xsk::XskError),
    #[error(transparent)]
    Fib(#[from] crate::fib::FibError),
    #[error("conntrack table: {0}")]
    Conntrack(String),
}

/// A running dataplane.
#[derive(Debug)]
pub struct Dataplane {
    pub shared: Arc<Shared>,
    steering: Vec<Steering>,
    fib: FibMirror,
    threads: Vec<JoinHandle<()>>,
    /// What the XDP maps hold now (to diff the next snapshot against).
    endpoints_udp: HashSet<SocketAddr>,
    /// sysfs knobs changed for busy polling, with their old values (restored on stop).
    restore: Vec<(String, String)>,
}

/// With preferred busy polling the device must defer its interrupts so that the worker's
/// polling, not softirq, drives receive processing: `napi_defer_hard_irqs` and
/// `gro_flush_timeout` (the values the kernel documentation and DPDK's AF_XDP driver use).
fn busy_poll_knobs(ifnames: &[String]) -> Vec<(String, String)> {
    let mut old = Vec::new();
    for ifname in ifnames {
        for (knob, value) in [
            ("napi_defer_hard_irqs", "2"),
            ("gro_flush_timeout", "200000"),
        ] {
            let path = format!("/sys/class/net/{ifname}/{knob}");
            let Ok(prev) = std::fs::read_to_string(&path) else {
                continue;
            };
            if std::fs::write(&path, value).is_ok() {
                old.push((path, prev.trim().to_string()));
            } else {
                eprintln!(
                    "kxp: cannot set {path} for busy polling; receive processing stays in softirq"
                );
            }
        }
    }
    old
}

/// Sums of every worker's counters.
#[derive(Debug, Clone, Default)]
pub struct Totals {
    /// Drops by cause, summed.
    pub drops: std::collections::BTreeMap<&'static str, u64>,
    pub no_route: u64,
    pub passed: u64,
    pub forwarded_bytes: u64,
    pub conntrack_inserts: u64,
    pub conntrack_evictions: u64,
    /// Share of each worker's loop iterations that found work.
    pub busy_ratio: Vec<f64>,
    /// Lowest snapshot generation a worker runs.
    pub generation: u64,
    pub rx_packets: u64,
    pub tx_packets: u64,
    pub forwarded: u64,
    pub new_flows: u64,
    pub rejected: u64,
    pub dropped: u64,
    pub handoffs: u64,
    pub conntrack_entries: u64,
    pub neighbour_pending: u64,
}

fn rx_queues(ifname: &str) -> Option<usize> {
    let dir = std::fs::read_dir(format!("/sys/class/net/{ifname}/queues")).ok()?;
    Some(
        dir.filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("rx-"))
            .count(),
    )
}

impl Dataplane {
    /// Attaches to the interfaces, opens the sockets, starts the FIB mirror and the
    /// workers, and publishes `initial`.
    ///
    /// # Errors
    /// A [`DataplaneError`] that says what is wrong and what to do.
    pub fn start(cfg: &DataplaneConfig, initial: Snapshot) -> Result<Dataplane, DataplaneError> {
        if !crate::sys::is_root() {
            return Err(DataplaneError::NotRoot);
        }
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
        for ifname in &cfg.interfaces {
            let queues =
                rx_queues(ifname).ok_or_else(|| DataplaneError::NoSuchInterface(ifname.clone()))?;
            if queues < cfg.workers {
                return Err(DataplaneError::Queues {
                    ifname: ifname.clone(),
                    queues,
                    workers: cfg.workers,
                });
            }
        }
        let (lo, hi) = cfg.snat_ports;
        let ranges = SnatPorts::split(lo..=hi, cfg.workers)
            .map_err(|e| DataplaneError::Config(format!("SNAT port range {lo}-{hi}: {e}")))?;

        let mut steering = Vec::new();
        for ifname in &cfg.interfaces {
            let s = Steering::load_and_attach(ifname, cfg.attach)?;
            s.set_snat_range(lo, hi)?;
            steering.push(s);
        }
        let ifindexes: Vec<u32> = steering.iter().map(Steering::ifindex).collect();
        let fib = FibMirror::start(&ifindexes)?;
        fib.wait_ready(Duration::from_secs(5))?;

        let (txs, rxs): (Vec<_>, Vec<_>) = (0..cfg.workers)
            .map(|_| crossbeam::channel::unbounded())
            .unzip();
        let shared = Arc::new(Shared {
            snapshot: ArcSwap::from_pointee(initial),
            stop: AtomicBool::new(false),
            stats: (0..cfg.workers).map(|_| WorkerStats::default()).collect(),
            inbox: (0..cfg.workers).map(|_| ArrayQueue::new(4096)).collect(),
            commands: txs,
            snat_lo: lo,
            snat_hi: hi,
        });

        let mut workers = Vec::new();
        for (id, (rx, snat)) in rxs.into_iter().zip(ranges).enumerate() {
            let io = WorkerIo::open(&cfg.xsk, &cfg.interfaces, id as u32)?;
            for (port, s) in steering.iter().enumerate() {
                s.set_socket(id as u32, io.fd(port))?;
            }
            let table = conntrack::ConnTable::new(cfg.conntrack_per_worker, cfg.timeouts, snat)
                .map_err(|e| DataplaneError::Conntrack(e.to_string()))?;
            let mut w = Worker::new(
                id,
                cfg.cpus.as_ref().map(|c| c[id]),
                io,
                Engine::new(table, 0x9E37_79B9_7F4A_7C15 ^ id as u64),
                fib.view(),
                ifindexes.clone(),
                shared.clone(),
                rx,
            );
            w.busy_poll = cfg.xsk.busy_poll.is_some();
            workers.push(w);
        }
        let mut dp = Dataplane {
            shared: shared.clone(),
            steering,
            fib,
            threads: Vec::new(),
            endpoints_udp: HashSet::new(),
            restore: if cfg.xsk.busy_poll.is_some() {
                busy_poll_knobs(&cfg.interfaces)
            } else {
                Vec::new()
            },
        };
        let initial = shared.snapshot.load_full();
        dp.program(&initial)?;
        for w in workers {
            let name = format!("kxp-worker-{}", w.id);
            let h = std::thread::Builder::new()
                .name(name)
                .spawn(move || w.run())
                .map_err(|e| {
                    DataplaneError::Config(format!("cannot start a worker thread: {e}"))
                })?;
            dp.threads.push(h);
        }
        Ok(dp)
    }

    /// Swaps in a new snapshot and brings the XDP maps, conntrack and neighbours in line.
    ///
    /// # Errors
    /// Updating the XDP maps failed (the snapshot is published anyway; the next publish
    /// retries the difference).
    pub fn publish(&mut self, snap: Snapshot) -> Result<(), DataplaneError> {
        let snap = Arc::new(snap);
        self.shared.snapshot.store(snap.clone());
        self.program(&snap)
    }

    fn program(&mut self, snap: &Snapshot) -> Result<(), DataplaneError> {
        let view = self.fib.view();
        let mut local: HashSet<IpAddr> = view.local_addrs().into_iter().collect();
        local.extend(snap.node.local_addrs.iter().copied());
        let mut frontends = HashSet::new();
        let mut endpoints = HashSet::new();
        let mut udp_endpoints = HashSet::new();
        for sp in &snap.ports {
            let proto = sp.name.protocol;
            let key = |ip: IpAddr, port: u16| SteerKey::new(ip, port, proto);
            frontends.insert(key(sp.cluster_ip, sp.port));
            for &ip in sp.external_ips.iter().chain(&sp.lb_vips) {
                frontends.insert(key(ip, sp.port));
            }
            if sp.node_port != 0 {
                let addrs: Vec<IpAddr> = match &snap.node.node_port_addresses {
                    NodePortAddresses::All => local
                        .iter()
                        .copied()
                        .filter(|ip| !ip.is_loopback())
                        .collect(),
                    NodePortAddresses::Addrs(a) => a.clone(),
                };
                for ip in addrs {
                    if ip.is_ipv4() == sp.cluster_ip.is_ipv4() {
                        frontends.insert(key(ip, sp.node_port));
                    }
                }
            }
            for ep in &sp.endpoints {
                endpoints.insert(key(ep.addr.ip(), ep.addr.port()));
                if proto == Protocol::Udp {
                    udp_endpoints.insert(ep.addr);
                }
                // Resolve next hops before the first packet needs them.
                let _ = view.route(ep.addr.ip());
            }
        }
        let cluster_ips: HashSet<IpAddr> = snap.ports.iter().map(|sp| sp.cluster_ip).collect();
        let service_cidrs: HashSet<ipnet::IpNet> =
            snap.node.service_cidrs.iter().copied().collect();
        let mut first_err = None;
        for s in &mut self.steering {
            for r in [
                s.sync_local_addrs(&local).map(|_| ()),
                s.sync_frontends(&frontends).map(|_| ()),
                s.sync_endpoints(&endpoints).map(|_| ()),
                s.sync_cluster_ips(&cluster_ips).map(|_| ()),
                s.sync_service_cidrs(&service_cidrs).map(|_| ()),
            ] {
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
            }
        }
        // kube-proxy's conntrack cleanup: UDP flows to endpoints that are gone.
        for gone in self.endpoints_udp.difference(&udp_endpoints) {
            for tx in &self.shared.commands {
                let _ = tx.send(Command::RemoveUdpTo(gone.ip(), gone.port()));
            }
        }
        self.endpoints_udp = udp_endpoints;
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Every address of the host (as the FIB mirror sees them).
    pub fn local_addrs(&self) -> Vec<IpAddr> {
        self.fib.view().local_addrs()
    }

    /// The snapshot workers use now.
    pub fn current(&self) -> Arc<Snapshot> {
        self.shared.snapshot.load_full()
    }

    /// Every worker's flows.
    pub fn list_flows(&self, timeout: Duration) -> Vec<FlowInfo> {
        let mut out = Vec::new();
        let mut replies = Vec::new();
        for tx in &self.shared.commands {
            let (rtx, rrx) = crossbeam::channel::bounded(1);
            if tx.send(Command::ListFlows(rtx)).is_ok() {
                replies.push(rrx);
            }
        }
        for r in replies {
            if let Ok(mut v) = r.recv_timeout(timeout) {
                out.append(&mut v);
            }
        }
        out
    }

    /// Sums of the workers' counters.
    pub fn totals(&self) -> Totals {
        let mut t = Totals::default();
        for s in &self.shared.stats {
            let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            t.rx_packets += g(&s.rx_packets);
            t.tx_packets += g(&s.tx_packets);
            t.forwarded += g(&s.forwarded);
            t.new_flows += g(&s.new_flows);
            t.rejected += g(&s.rejected);
            t.dropped += g(&s.dropped);
            t.handoffs += g(&s.handoffs_out);
            t.conntrack_entries += g(&s.conntrack_entries);
            t.neighbour_pending += g(&s.neighbour_pending);
            t.no_route += g(&s.no_route);
            t.passed += g(&s.passed);
            t.forwarded_bytes += g(&s.rx_bytes);
            t.conntrack_inserts += g(&s.conntrack_inserts);
            t.conntrack_evictions += g(&s.conntrack_evictions);
            let it = g(&s.iterations);
            t.busy_ratio.push(if it == 0 {
                0.0
            } else {
                g(&s.busy_iterations) as f64 / it as f64
            });
            let gen_ = g(&s.snapshot_generation);
            t.generation = if t.generation == 0 {
                gen_
            } else {
                t.generation.min(gen_)
            };
            if let Ok(d) = s.drop_detail.lock() {
                for (k, v) in d.iter() {
                    *t.drops.entry(k).or_default() += v;
                }
            }
        }
        t
    }

    /// Stops the workers and detaches the XDP programs.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
        for s in self.steering.drain(..) {
            if let Err(e) = s.detach() {
                eprintln!("kxp: {e}");
            }
        }
        for (path, value) in self.restore.drain(..) {
            let _ = std::fs::write(&path, value);
        }
    }
}

impl Drop for Dataplane {
    fn drop(&mut self) {
        self.shutdown();
    }
}
