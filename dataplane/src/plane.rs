//! The dataplane as a whole: the XDP steering program on every attached interface, the
//! FIB mirror, one worker per queue, and the publication of snapshots.
//!
//! Publication is an RCU-style pointer swap ([`arc_swap::ArcSwap`]): workers load the
//! current snapshot once per batch and never wait; an old snapshot is freed when the last
//! worker that loaded it lets go. After the swap the XDP program's maps are brought in
//! line by difference (only what changed touches the kernel), UDP flows to endpoints that
//! went away are cleared in every worker, and the next hops of new endpoints are resolved
//! ahead of their first packet.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use arc_swap::ArcSwap;
use conntrack::{SnatPorts, Timeouts};
use crossbeam::queue::ArrayQueue;
use nat::model::NodePortAddresses;
use nat::model::ServicePort;
use nat::snapshot::{Snapshot, Update};
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
    /// What the XDP maps must hold, counted per Service port (to apply updates by
    /// difference).
    wanted: Wanted,
    /// The last programming failed: redo the maps in full next time.
    needs_full: bool,
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

/// Keys wanted in a map, with how many Service ports want each, and the keys whose
/// count moved since the last [`Counted::changes`] (with their count before).
#[derive(Debug)]
struct Counted<K> {
    counts: HashMap<K, u32>,
    touched: HashMap<K, u32>,
}

impl<K> Default for Counted<K> {
    fn default() -> Self {
        Counted {
            counts: HashMap::new(),
            touched: HashMap::new(),
        }
    }
}

impl<K: std::hash::Hash + Eq + Copy> Counted<K> {
    fn bump(&mut self, k: K, by: i32) {
        let n = self.counts.entry(k).or_default();
        self.touched.entry(k).or_insert(*n);
        *n = n.saturating_add_signed(by);
        if *n == 0 {
            self.counts.remove(&k);
        }
    }

    fn contains_key(&self, k: &K) -> bool {
        self.counts.contains_key(k)
    }

    fn keys(&self) -> impl Iterator<Item = &K> {
        self.counts.keys()
    }

    fn into_keys(self) -> impl Iterator<Item = K> {
        self.counts.into_keys()
    }

    /// Keys that appeared and keys that vanished since the last call.
    fn changes(&mut self) -> (Vec<K>, Vec<K>) {
        let mut added = Vec::new();
        let mut removed = Vec::new();
        for (k, before) in self.touched.drain() {
            match (before > 0, self.counts.contains_key(&k)) {
                (false, true) => added.push(k),
                (true, false) => removed.push(k),
                _ => {}
            }
        }
        (added, removed)
    }
}

/// What the steering maps and the UDP cleanup are derived from.
#[derive(Debug, Default)]
struct Wanted {
    frontends: Counted<SteerKey>,
    endpoints: Counted<SteerKey>,
    cluster_ips: Counted<IpAddr>,
    udp: Counted<SocketAddr>,
    /// The addresses NodePorts were expanded with (sorted).
    np_addrs: Vec<IpAddr>,
}

impl Wanted {
    /// Counts (`by` = 1) or uncounts (-1) what one Service port wants.
    fn count(&mut self, sp: &ServicePort, by: i32) {
        let proto = sp.name.protocol;
        let key = |ip: IpAddr, port: u16| SteerKey::new(ip, port, proto);
        self.frontends.bump(key(sp.cluster_ip, sp.port), by);
        for &ip in sp.external_ips.iter().chain(&sp.lb_vips) {
            self.frontends.bump(key(ip, sp.port), by);
        }
        if sp.node_port != 0 {
            for i in 0..self.np_addrs.len() {
                let ip = self.np_addrs[i];
                if ip.is_ipv4() == sp.cluster_ip.is_ipv4() {
                    self.frontends.bump(key(ip, sp.node_port), by);
                }
            }
        }
        self.cluster_ips.bump(sp.cluster_ip, by);
        for ep in &sp.endpoints {
            self.endpoints.bump(key(ep.addr.ip(), ep.addr.port()), by);
            if proto == Protocol::Udp {
                self.udp.bump(ep.addr, by);
            }
        }
    }
}

impl Wanted {
    /// Forgets which keys moved (after a full programming).
    fn settle(&mut self) {
        self.frontends.touched.clear();
        self.endpoints.touched.clear();
        self.cluster_ips.touched.clear();
        self.udp.touched.clear();
    }
}

/// Resolves the next hops of a port's endpoints before their first packet needs them.
fn resolve_next_hops(view: &crate::fib::FibView, sp: &ServicePort) {
    for ep in &sp.endpoints {
        let _ = view.route(ep.addr.ip());
    }
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
    pub fn start(
        cfg: &DataplaneConfig,
        initial: impl Into<Arc<Snapshot>>,
    ) -> Result<Dataplane, DataplaneError> {
        let initial: Arc<Snapshot> = initial.into();
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
            snapshot: ArcSwap::new(initial.clone()),
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
            wanted: Wanted::default(),
            needs_full: true,
            restore: if cfg.xsk.busy_poll.is_some() {
                busy_poll_knobs(&cfg.interfaces)
            } else {
                Vec::new()
            },
        };
        dp.program(&Update::full(initial))?;
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

    /// Swaps in a new snapshot and brings the XDP maps, conntrack and neighbours in line,
    /// by the update's difference (only the Service ports it adds and removes are looked
    /// at) unless it is a full one or the node's NodePort addresses changed.
    ///
    /// # Errors
    /// Updating the XDP maps failed (the snapshot is published anyway; the next publish
    /// redoes the maps in full).
    pub fn publish(&mut self, update: Update) -> Result<(), DataplaneError> {
        self.shared.snapshot.store(update.snapshot.clone());
        let r = self.program(&update);
        self.needs_full = r.is_err();
        r
    }

    fn program(&mut self, update: &Update) -> Result<(), DataplaneError> {
        let snap = &*update.snapshot;
        let view = self.fib.view();
        let mut local: HashSet<IpAddr> = view.local_addrs().into_iter().collect();
        local.extend(snap.node.local_addrs.iter().copied());
        let mut np_addrs: Vec<IpAddr> = match &snap.node.node_port_addresses {
            NodePortAddresses::All => local
                .iter()
                .copied()
                .filter(|ip| !ip.is_loopback())
                .collect(),
            NodePortAddresses::Addrs(a) => a.clone(),
        };
        np_addrs.sort();
        let full = update.full || self.needs_full || np_addrs != self.wanted.np_addrs;
        let service_cidrs: HashSet<ipnet::IpNet> =
            snap.node.service_cidrs.iter().copied().collect();
        let mut first_err = None;
        let mut note = |r: Result<crate::xdp::SyncStats, crate::xdp::XdpError>| {
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        };
        for s in &mut self.steering {
            note(s.sync_local_addrs(&local));
            note(s.sync_service_cidrs(&service_cidrs));
        }
        let gone_udp = if full {
            let old_udp = std::mem::take(&mut self.wanted.udp);
            self.wanted = Wanted {
                np_addrs,
                ..Wanted::default()
            };
            for sp in snap.ports() {
                self.wanted.count(sp, 1);
            }
            let frontends: HashSet<SteerKey> = self.wanted.frontends.keys().copied().collect();
            let endpoints: HashSet<SteerKey> = self.wanted.endpoints.keys().copied().collect();
            let cluster_ips: HashSet<IpAddr> = self.wanted.cluster_ips.keys().copied().collect();
            for s in &mut self.steering {
                note(s.sync_frontends(&frontends));
                note(s.sync_endpoints(&endpoints));
                note(s.sync_cluster_ips(&cluster_ips));
            }
            for sp in snap.ports() {
                resolve_next_hops(&view, sp);
            }
            self.wanted.settle();
            old_udp
                .into_keys()
                .filter(|a| !self.wanted.udp.contains_key(a))
                .collect()
        } else {
            // Additions first, so that a port that is removed and added again (changed)
            // never drops its keys to zero on the way.
            for sp in &update.added {
                self.wanted.count(sp, 1);
                resolve_next_hops(&view, sp);
            }
            for sp in &update.removed {
                self.wanted.count(sp, -1);
            }
            let (fa, fr) = self.wanted.frontends.changes();
            let (ea, er) = self.wanted.endpoints.changes();
            let (ca, cr) = self.wanted.cluster_ips.changes();
            for s in &mut self.steering {
                note(s.change_frontends(&fa, &fr));
                note(s.change_endpoints(&ea, &er));
                note(s.change_cluster_ips(&ca, &cr));
            }
            self.wanted.udp.changes().1
        };
        // kube-proxy's conntrack cleanup: UDP flows to endpoints that are gone.
        for gone in gone_udp {
            for tx in &self.shared.commands {
                let _ = tx.send(Command::RemoveUdpTo(gone.ip(), gone.port()));
            }
        }
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
