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
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use conntrack::Timeouts;
use nat::model::NodePortAddresses;
use nat::model::ServicePort;
use nat::snapshot::{Snapshot, Update};
use nat::tuple::Protocol;

use crate::fib::{FibMirror, LinkInfo};
use crate::servicedev::ServiceDevice;
use crate::worker::{Command, Shared, Worker, WorkerStats};
use crate::xdp::{AttachMode, SteerKey, Steering};
use crate::xsk::{Sockets, XskConfig};
use engine::{Engine, NodeState};

mod start;

/// How to run the dataplane.
#[derive(Debug, Clone)]
pub struct DataplaneConfig {
    /// Interface names and shell-style patterns (`eth0`, `veth*`): see [`crate::ifmatch`].
    pub interfaces: Vec<String>,
    /// Host-side name of kxp's service device (see [`crate::servicedev`]).
    pub service_device: String,
    pub workers: usize,
    /// CPU of each worker (`None`: not pinned).
    pub cpus: Option<Vec<usize>>,
    /// The workers' nice value (`None`: [`crate::priority::PINNED_WORKER_NICE`] when
    /// pinned, else the process's).
    pub worker_nice: Option<i32>,
    pub xsk: XskConfig,
    pub attach: AttachMode,
    /// Connection-table capacity of each worker.
    pub conntrack_per_worker: usize,
    pub timeouts: Timeouts,
    /// Masquerade source ports (outside the kernel's ephemeral range and the NodePorts).
    pub snat_ports: (u16, u16),
    /// Most ClientIP affinity entries the node holds (see [`conntrack::affinity`]).
    pub affinity_capacity: usize,
    /// Where connection tracking and affinity are kept for the next process (see
    /// [`crate::statefile`]); `None`: in memory only, lost at exit.
    pub state_dir: Option<std::path::PathBuf>,
    /// `kxp.networkPolicy: kernel`: translated packets for this node's pods are handed to
    /// the kernel (through the service device, exempt from its connection tracking by a
    /// raw-table rule kxp adds), which forwards them to the pod through the node's
    /// netfilter, so the CNI's own policy applies to them.
    pub kernel_policy: bool,
    /// The program to run as the socket holder (`PROGRAM hold-sockets FD`, see
    /// [`crate::holder`]); `None`: no holder, a dying process's sockets are released
    /// one after another.
    pub socket_holder: Option<std::path::PathBuf>,
}

impl DataplaneConfig {
    /// The nice the workers set themselves to: `worker_nice`, else
    /// [`crate::priority::PINNED_WORKER_NICE`] when pinned; `None`: the process's.
    pub fn effective_worker_nice(&self) -> Option<i32> {
        self.worker_nice.or(self
            .cpus
            .is_some()
            .then_some(crate::priority::PINNED_WORKER_NICE))
    }
}

impl Default for DataplaneConfig {
    fn default() -> Self {
        DataplaneConfig {
            interfaces: Vec::new(),
            service_device: "kxp0".into(),
            workers: 1,
            cpus: None,
            worker_nice: None,
            xsk: XskConfig::default(),
            attach: AttachMode::Link,
            conntrack_per_worker: 262_144,
            timeouts: Timeouts::default(),
            snat_ports: (61_000, 65_535),
            affinity_capacity: NodeState::AFFINITY_CAPACITY,
            state_dir: None,
            kernel_policy: false,
            socket_holder: None,
        }
    }
}

/// Starting or driving the dataplane failed.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("{0}")]
    Capabilities(String),
    #[error("no interface given; kxp attaches to: --interface NAME (repeat for each)")]
    NoInterface,
    #[error("interface pattern {0}; kxp attaches to: --interface NAME or PATTERN (e.g. veth*)")]
    BadPattern(String),
    #[error(transparent)]
    ServiceDevice(#[from] crate::servicedev::ServiceDeviceError),
    #[error("state directory: {0}")]
    State(String),
    #[error("interface {0} not found; kxp attaches to: --interface NAME (see `ip link`)")]
    NoSuchInterface(String),
    #[error(
        "interface {ifname} is a bond: kxp attaches to a bond's ports, not to the bond (an XDP \
         program on a bond runs on its ports, and each port's receive queues need AF_XDP \
         sockets of their own); give its ports instead: {}",
        if ports.is_empty() { "(it has none now)".to_string() } else {
            ports.iter().map(|p| format!("--interface {p}")).collect::<Vec<_>>().join(" ")
        }
    )]
    Bond { ifname: String, ports: Vec<String> },
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

/// What a worker thread is made of, before its sockets are branded in the thread.
struct WorkerParts {
    id: usize,
    cpu: Option<usize>,
    /// The nice the worker's thread sets itself to (`None`: the process's).
    nice: Option<i32>,
    sockets: Sockets,
    engine: Engine,
    fib: crate::fib::FibView,
    shared: Arc<Shared>,
    commands: crossbeam::channel::Receiver<crate::worker::Command>,
    busy_poll: bool,
    idle_spin_us: u32,
    queue_budget_us: u32,
    journal: Option<crate::statefile::StateFile>,
    local_delivery: crate::worker::LocalDelivery,
    /// Hand translated packets for this node's pods to the kernel (`kernel_policy`).
    handover: bool,
    /// Where the worker's thread id goes once it runs.
    started: std::sync::mpsc::Sender<libc::pid_t>,
}

impl WorkerParts {
    /// The worker's loop, until the dataplane stops.
    fn run(self) {
        let WorkerParts {
            id,
            cpu,
            nice,
            sockets,
            engine,
            fib,
            shared,
            commands,
            busy_poll,
            idle_spin_us,
            queue_budget_us,
            journal,
            local_delivery,
            handover,
            started,
        } = self;
        let tid = crate::sys::gettid();
        if let Some(n) = nice {
            match crate::sys::set_nice(0, n) {
                Ok(()) => tracing::info!(
                    "worker {id} (thread {tid}){} runs at nice {n}",
                    cpu.map(|c| format!(" on CPU {c}")).unwrap_or_default()
                ),
                Err(e) => tracing::warn!(
                    "worker {id} (thread {tid}): cannot set nice {n}: {e} (needs CAP_SYS_NICE, or --worker-nice 0); tasks woken on its CPU share it with the worker by equal weight, for milliseconds at a time"
                ),
            }
        }
        let _ = started.send(tid);
        drop(started);
        sockets.with(move |io| {
            let mut w = Worker::new(id, cpu, io, engine, fib, shared, commands);
            w.busy_poll = busy_poll;
            w.idle_spin_ns = u64::from(idle_spin_us) * 1000;
            w.queue_budget_ns = u64::from(queue_budget_us) * 1000;
            w.journal = journal;
            w.local_delivery = Some(local_delivery);
            w.handover = handover.then_some(crate::worker::LocalDelivery {
                src_mac: crate::servicedev::HANDOVER_MAC,
                ..local_delivery
            });
            w.run();
        });
    }
}

/// The CPUs kxp may use that the workers (pinned to `cpus`) leave free.
fn other_cpus(cpus: &[usize]) -> std::io::Result<Vec<usize>> {
    Ok(crate::sys::allowed_cpus()?
        .into_iter()
        .filter(|c| !cpus.contains(c))
        .collect())
}

/// Moves every thread of the process but the workers (`worker_tids`) off the workers'
/// pinned CPUs, the calling thread too, so that threads started later (inheriting its
/// affinity) keep off them: a control-plane thread woken on a worker's CPU would take
/// the CPU from its poll loop for a time slice, a standing queue of milliseconds in its
/// rings. Nothing is moved when the workers take every CPU the process may use.
fn keep_off_worker_cpus(cpus: &[usize], worker_tids: &[libc::pid_t]) {
    let Some((moved, failed, rest)) = move_off_worker_cpus(cpus, worker_tids) else {
        return;
    };
    tracing::info!(
        "workers pinned to CPUs {cpus:?}; kxp's {moved} other thread(s) run on CPUs {rest:?}{}",
        if failed > 0 {
            format!(" ({failed} could not be moved)")
        } else {
            String::new()
        }
    );
}

/// Before the dataplane starts: moves kxp's threads (and so those started later) off the
/// CPUs its workers are pinned to (`cfg.cpus`), where a running kxp's workers may be
/// forwarding while this one prepares to take the node over: its lists, tables and
/// mirror are built beside them, not on their CPUs.
pub fn keep_off_workers_cpus_ahead(cfg: &DataplaneConfig) {
    if let Ok(all) = crate::sys::allowed_cpus() {
        let _ = ALL_CPUS.set(all);
    }
    if let Some(cpus) = &cfg.cpus
        && let Some((moved, _, rest)) = move_off_worker_cpus(cpus, &[])
    {
        tracing::debug!("kxp's {moved} thread(s) run on CPUs {rest:?}, off the workers' {cpus:?}");
    }
}

/// The CPUs kxp was allowed before [`keep_off_workers_cpus_ahead`].
static ALL_CPUS: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();

/// At a hand-over, once the running kxp's workers have stopped: lets the calling thread
/// run on the workers' CPUs too (they are idle until this kxp's workers start), for the
/// start that forwarding waits for. Its threads are moved off them again after the
/// first publication ([`Dataplane::attach_interfaces`]).
pub fn use_workers_cpus_until_they_start() {
    if let Some(all) = ALL_CPUS.get() {
        let _ = crate::sys::set_affinity(0, all);
    }
}

/// See [`keep_off_worker_cpus`]: (threads moved, threads that could not be, the CPUs
/// they run on).
fn move_off_worker_cpus(
    cpus: &[usize],
    worker_tids: &[libc::pid_t],
) -> Option<(usize, usize, Vec<usize>)> {
    let rest = match other_cpus(cpus) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("cannot read the CPUs kxp may use: {e}");
            return None;
        }
    };
    if rest.is_empty() {
        tracing::info!(
            "the workers take every CPU kxp may use ({cpus:?}): its other threads share them"
        );
        return None;
    }
    let mut moved = 0;
    let mut failed = 0;
    for tid in crate::sys::thread_ids() {
        if worker_tids.contains(&tid) {
            continue;
        }
        match crate::sys::set_affinity(tid, &rest) {
            Ok(()) => moved += 1,
            // A thread that ended meanwhile.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => {
                failed += 1;
                tracing::warn!("cannot move thread {tid} off the workers' CPUs: {e}");
            }
        }
    }
    Some((moved, failed, rest))
}

/// How long each part of [`Dataplane::start`] took (the log's start-up line).
#[derive(Debug, Clone, Default)]
pub struct StartTimes {
    /// (part, duration), in order.
    pub parts: Vec<(&'static str, Duration)>,
    /// Interfaces attached at start.
    pub interfaces: usize,
}

impl StartTimes {
    fn lap(&mut self, part: &'static str, since: &mut Instant) {
        let now = Instant::now();
        self.parts.push((part, now - *since));
        *since = now;
    }

    /// "part N ms, part N ms, ...".
    pub fn describe(&self) -> String {
        self.parts
            .iter()
            .map(|(p, d)| format!("{p} {} ms", d.as_millis()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The sockets a previous kxp handed over, if this one can take them up by worker: each
/// interface queue goes to worker `queue % workers`, so sockets handed over by a kxp with
/// another worker count would sit on the wrong workers (closed, and opened anew).
fn usable(cfg: &DataplaneConfig, handed: Vec<crate::xsk::Handed>) -> Vec<crate::xsk::Handed> {
    if handed.is_empty() || handed.len() == cfg.workers {
        return handed;
    }
    tracing::warn!(
        "the previous kxp handed over the sockets of {} worker(s), this one runs {}: they \
         are closed and opened anew",
        handed.len(),
        cfg.workers
    );
    Vec::new()
}

/// The sockets handed over that this kxp can take up ([`usable`]), the sockets mapped
/// ahead (none if nothing is to be taken up: their references go before new sockets are
/// bound to the same queues), and the interfaces the handed sockets are on.
fn handed_parts(
    cfg: &DataplaneConfig,
    handed: Vec<crate::xsk::Handed>,
    premapped: crate::xsk::Premapped,
) -> (Vec<crate::xsk::Handed>, crate::xsk::Premapped, HashSet<u32>) {
    let handed = usable(cfg, handed);
    let premapped = if handed.is_empty() {
        crate::xsk::Premapped::default()
    } else {
        premapped
    };
    let ifindexes = handed
        .iter()
        .flat_map(|h| h.state.ports.iter().skip(1).map(|p| p.ifindex))
        .collect();
    (handed, premapped, ifindexes)
}

/// What a dataplane hands the next kxp ([`Dataplane::hand_over`]).
#[derive(Debug, Default)]
pub struct HandedOver {
    /// Each worker's sockets, in worker order.
    pub workers: Vec<crate::xsk::Handed>,
    /// When its workers stopped forwarding (`CLOCK_MONOTONIC`, ns; 0: unknown).
    pub stopped_ns: u64,
}

impl HandedOver {
    /// Sockets handed over, every worker's.
    pub fn sockets(&self) -> usize {
        self.workers.iter().map(|h| h.sockets.len()).sum()
    }
}

/// Started on sockets handed over, what is left for after the first publication, out of
/// forwarding's pause ([`Dataplane::attach_interfaces`]): the previous kxp's routes and
/// rules taken up, and kxp's other threads moved off the workers' CPUs once they run.
#[derive(Debug)]
struct AfterFirst {
    cfg: DataplaneConfig,
    started: std::sync::mpsc::Receiver<libc::pid_t>,
}

/// A dataplane's start up to where it touches the node ([`Dataplane::prepare`]).
#[derive(Debug)]
pub struct Prepared {
    initial: Arc<Snapshot>,
    times: StartTimes,
    fib: Arc<FibMirror>,
    rxs: Vec<crossbeam::channel::Receiver<crate::worker::Command>>,
    shared: Arc<Shared>,
    tables: Vec<conntrack::ConnTable>,
    files: Option<crate::persistence::PreparedFiles>,
    /// Derived from the configuration and the interfaces' MTUs (read from sysfs: 8 ms
    /// with 110 pod veths, out of a hand-over's pause).
    settings: start::Settings,
    /// The running kxp's sockets, lent and mapped ahead of a hand-over.
    premapped: crate::xsk::Premapped,
    /// Its steering program and service device, taken up ahead of a hand-over
    /// ([`Prepared::take_up_ahead`]).
    steering: Option<crate::xdp::Steering>,
    service: Option<ServiceDevice>,
}

impl Prepared {
    /// Ahead of a hand-over: the running kxp's sockets, lent and mapped
    /// ([`crate::xsk::Premapped`]); those handed over at the hand-over are taken up
    /// without a mapping.
    pub fn set_premapped(&mut self, premapped: crate::xsk::Premapped) {
        self.premapped = premapped;
    }

    /// Ahead of a hand-over, while the running kxp still forwards (with a state
    /// directory): takes up the steering program it pinned (or loads this build's, the
    /// kernel verifying it now) and its service device (if it is as this kxp makes it),
    /// changing nothing the running kxp uses. At the hand-over they are not looked for.
    pub fn take_up_ahead(&mut self, cfg: &DataplaneConfig) {
        if !self.settings.keep {
            return;
        }
        match start::load_steering(Instant::now(), true) {
            Ok(s) => self.steering = Some(s),
            Err(e) => tracing::warn!(
                error = %e,
                "cannot take the steering program up ahead of the hand-over: at the hand-over then"
            ),
        }
        self.service = ServiceDevice::existing(&cfg.service_device, cfg.workers as u32);
    }

    /// Sockets mapped ahead ([`Prepared::set_premapped`]).
    pub fn premapped_sockets(&self) -> usize {
        self.premapped.sockets()
    }

    /// The node's local addresses, as the FIB mirror has them now.
    pub fn local_addrs(&self) -> Vec<IpAddr> {
        self.fib.view().local_addrs()
    }
}

/// A running dataplane.
#[derive(Debug)]
pub struct Dataplane {
    pub shared: Arc<Shared>,
    /// Start-up, part by part.
    pub start_times: StartTimes,
    /// The locked state directory (released last, when the files are written).
    persistence: Option<crate::persistence::Persistence>,
    /// What the workers share per node (affinity, endpoint load, round-robin).
    pub node: Arc<NodeState>,
    links: Arc<LinkCtl>,
    fib: Arc<FibMirror>,
    threads: Vec<JoinHandle<()>>,
    link_thread: Option<JoinHandle<()>>,
    link_stop: Arc<AtomicBool>,
    /// Started on sockets handed over: their interfaces (see
    /// [`Dataplane::attach_interfaces`]).
    handed: Option<HashSet<u32>>,
    /// The workers' thread ids once known (none when they are not pinned), for the end
    /// of the start's priority ([`crate::priority::boost_start`]).
    worker_tids: Option<Vec<libc::pid_t>>,
    /// See [`Dataplane::first_published_ns`].
    first_published_ns: u64,
    /// Started on sockets handed over: what is done after the first publication.
    after_first: Option<AfterFirst>,
    /// Last: removed once every socket on it is closed.
    service: Option<ServiceDevice>,
}

/// What the XDP programs on the attached interfaces hold, and the interfaces themselves.
#[derive(Debug, Default)]
struct Programming {
    /// A handle per attached interface, all on the service device's program (one
    /// program and one set of maps, see crate::xdp).
    steering: Vec<Steering>,
    /// The instance on kxp's service device (the node's own traffic).
    service: Option<Steering>,
    /// Routes of Service addresses into the service device.
    routes: Option<crate::servicedev::Routes>,
    /// Policy rules for the node's own connections to its NodePorts and for masqueraded
    /// answers arriving by interfaces kxp is not attached to.
    nodeport_rules: Option<crate::servicedev::NodePortRules>,
    /// `kxp.networkPolicy: kernel`'s raw-table rule.
    kernel_policy: Option<crate::servicedev::KernelPolicy>,
    /// The SNAT port range.
    snat: (u16, u16),
    /// What the XDP maps must hold, counted per Service port (to apply updates by
    /// difference, and to fill the maps of an interface attached later).
    wanted: Wanted,
    /// The last programming failed: redo the maps in full next time.
    needs_full: bool,
    /// sysfs knobs changed for busy polling, with their old values (restored on stop).
    restore: Vec<(String, String)>,
    /// Interfaces whose attach failed, with when (retried after [`ATTACH_RETRY`]).
    failed: HashMap<u32, Instant>,
    /// Receive queues served per attached interface (a socket on each), to follow a
    /// change of the count (`ethtool -L`), and when it was last compared.
    queues: HashMap<u32, usize>,
    queues_checked: Option<Instant>,
    /// The links a previous kxp pinned are this process's now (see
    /// [`Dataplane::take_over`]); until then instances for them are filled, not attached.
    taken_over: bool,
}

/// Fragmented datagrams tracked at once, bytes of early fragments parked, and how long
/// a datagram's fragments are waited for (Linux's `ipfrag_time`).
const FRAG_DATAGRAMS: usize = 16_384;
const FRAG_PARKED_BYTES: usize = 4 << 20;
const FRAG_TIMEOUT_NS: u64 = 30_000_000_000;

/// How long a failed attach waits before it is tried again.
const ATTACH_RETRY: Duration = Duration::from_secs(10);
/// How long a worker may take to open or close a socket.
const WORKER_REPLY: Duration = Duration::from_secs(5);

/// What the link manager and the publisher share.
#[derive(Debug)]
struct LinkCtl {
    prog: Mutex<Programming>,
    patterns: Vec<String>,
    attach: AttachMode,
    workers: usize,
    busy_poll: bool,
    shared: Arc<Shared>,
    fib: Arc<FibMirror>,
    /// Names never attached as pod interfaces (kxp's service device).
    reserved: Vec<String>,
    /// AF_XDP multi-buffer is on; the largest MTU a single frame holds.
    multi_buffer: bool,
    frame_mtu: usize,
    /// Steering outlives the process (a state directory): programs are kept attached at
    /// stop and taken over at start.
    keep: bool,
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
                tracing::warn!(
                    "cannot set {path} for busy polling; receive processing stays in softirq"
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
    counts: HashMap<K, u32, foldhash::fast::RandomState>,
    touched: HashMap<K, u32, foldhash::fast::RandomState>,
    /// Changes are recorded in `touched` (not while a refill counts everything afresh).
    tracking: bool,
}

impl<K> Default for Counted<K> {
    fn default() -> Self {
        Counted {
            counts: HashMap::default(),
            touched: HashMap::default(),
            tracking: true,
        }
    }
}

impl<K: std::hash::Hash + Eq + Copy> Counted<K> {
    /// Counts afresh, without recording changes, room made for `keys` keys: for a
    /// refill, whose sets are then written in full.
    fn fresh(keys: usize) -> Self {
        Counted {
            counts: HashMap::with_capacity_and_hasher(keys, Default::default()),
            touched: HashMap::default(),
            tracking: false,
        }
    }

    fn bump(&mut self, k: K, by: i32) {
        let n = self.counts.entry(k).or_default();
        if self.tracking {
            self.touched.entry(k).or_insert(*n);
        }
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

/// UDP endpoints and Service addresses a programming took away.
#[derive(Debug, Default)]
struct GoneUdp {
    endpoints: Vec<SocketAddr>,
    frontends: Vec<SocketAddr>,
}

/// What the steering maps and the UDP cleanup are derived from.
#[derive(Debug, Default)]
struct Wanted {
    frontends: Counted<SteerKey>,
    endpoints: Counted<SteerKey>,
    cluster_ips: Counted<IpAddr>,
    /// Service addresses the node's own connections are routed to kxp for (ClusterIPs,
    /// externalIPs, LoadBalancer IPs).
    routed: Counted<IpAddr>,
    /// (IP protocol number, NodePort) of every NodePort.
    node_ports: Counted<(u8, u16)>,
    /// UDP endpoints that serve (kube-proxy's conntrack cleanup keeps flows to these
    /// only: an endpoint that stops serving, still listed, loses its flows).
    udp: Counted<SocketAddr>,
    /// UDP Service addresses and ports (ClusterIP, externalIPs, LoadBalancer IPs,
    /// NodePorts on their addresses): flows to one that goes away are cleared.
    udp_frontends: Counted<SocketAddr>,
    /// The addresses NodePorts were expanded with (sorted).
    np_addrs: Vec<IpAddr>,
    /// The node's addresses and the Service CIDRs, as last programmed.
    local: HashSet<IpAddr>,
    service_cidrs: HashSet<ipnet::IpNet>,
    /// `routed` or `node_ports` gained or lost a key since the service device's routes
    /// and the NodePort rules were last brought in line (a change of one Service's
    /// endpoints touches neither: no walk over every Service address then).
    routes_changed: bool,
    node_ports_changed: bool,
}

impl Wanted {
    /// Counts (`by` = 1) or uncounts (-1) what one Service port wants.
    fn count(&mut self, sp: &ServicePort, by: i32) {
        let proto = sp.name.protocol;
        let key = |ip: IpAddr, port: u16| SteerKey::new(ip, port, proto);
        self.frontends.bump(key(sp.cluster_ip, sp.port), by);
        self.routed.bump(sp.cluster_ip, by);
        let udp = proto == Protocol::Udp;
        if udp {
            self.udp_frontends
                .bump(SocketAddr::new(sp.cluster_ip, sp.port), by);
            for &ip in sp.external_ips.iter().chain(&sp.lb_vips) {
                self.udp_frontends.bump(SocketAddr::new(ip, sp.port), by);
            }
        }
        // Port 0: the XDP program's key for fragments after the first (no ports), to and
        // from the Service's addresses (NodePorts' node addresses excepted: the node's
        // own fragmented traffic is not kxp's).
        self.frontends.bump(key(sp.cluster_ip, 0), by);
        for &ip in sp.external_ips.iter().chain(&sp.lb_vips) {
            self.frontends.bump(key(ip, sp.port), by);
            self.frontends.bump(key(ip, 0), by);
            self.routed.bump(ip, by);
        }
        if sp.node_port != 0 {
            self.node_ports.bump((proto.number(), sp.node_port), by);
            for i in 0..self.np_addrs.len() {
                self.count_node_port_on(sp, self.np_addrs[i], by);
            }
        }
        self.cluster_ips.bump(sp.cluster_ip, by);
        for ep in &sp.endpoints {
            self.endpoints.bump(key(ep.addr.ip(), ep.addr.port()), by);
            self.endpoints.bump(key(ep.addr.ip(), 0), by);
            if udp && ep.serving {
                self.udp.bump(ep.addr, by);
            }
        }
    }
}

impl Wanted {
    /// Counts (`by` = 1) or uncounts (-1) a port's NodePort on node address `ip` (one of
    /// its family).
    fn count_node_port_on(&mut self, sp: &ServicePort, ip: IpAddr, by: i32) {
        if ip.is_ipv4() != sp.cluster_ip.is_ipv4() {
            return;
        }
        let proto = sp.name.protocol;
        self.frontends
            .bump(SteerKey::new(ip, sp.node_port, proto), by);
        if proto == Protocol::Udp {
            self.udp_frontends
                .bump(SocketAddr::new(ip, sp.node_port), by);
        }
    }

    /// The node's addresses NodePorts are expanded with became `np_addrs` (an address
    /// came or went: a pod's veth, or kxp's service device, getting its IPv6 link-local
    /// one): only the NodePort keys of the addresses that came or went are counted in or
    /// out, for the Service ports of `snap` (those counted). Programming every Service
    /// anew for it took 1.6 s at 100,000 Services.
    fn move_node_ports(&mut self, snap: &Snapshot, np_addrs: Vec<IpAddr>) {
        let came: Vec<IpAddr> = np_addrs
            .iter()
            .filter(|a| !self.np_addrs.contains(a))
            .copied()
            .collect();
        let gone: Vec<IpAddr> = self
            .np_addrs
            .iter()
            .filter(|a| !np_addrs.contains(a))
            .copied()
            .collect();
        for sp in snap.ports().filter(|sp| sp.node_port != 0) {
            for &ip in &came {
                self.count_node_port_on(sp, ip, 1);
            }
            for &ip in &gone {
                self.count_node_port_on(sp, ip, -1);
            }
        }
        self.np_addrs = np_addrs;
        self.node_ports_changed = true;
    }

    /// Changes are recorded from now on (after a refill).
    fn track_changes(&mut self) {
        self.frontends.tracking = true;
        self.endpoints.tracking = true;
        self.cluster_ips.tracking = true;
        self.routed.tracking = true;
        self.node_ports.tracking = true;
        self.udp.tracking = true;
        self.udp_frontends.tracking = true;
    }

    /// Forgets which keys moved (after a full programming).
    fn settle(&mut self) {
        self.frontends.touched.clear();
        self.endpoints.touched.clear();
        self.cluster_ips.touched.clear();
        self.routed.touched.clear();
        self.node_ports.touched.clear();
        self.udp.touched.clear();
        self.udp_frontends.touched.clear();
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
    /// The node's ClientIP affinity table.
    pub affinity: conntrack::AffinityStats,
    /// Drops by cause, summed.
    pub drops: std::collections::BTreeMap<&'static str, u64>,
    pub no_route: u64,
    pub passed: u64,
    pub forwarded_bytes: u64,
    pub conntrack_inserts: u64,
    pub conntrack_evictions: u64,
    /// Share of each worker's loop iterations that found work.
    pub busy_ratio: Vec<f64>,
    /// Each worker's stalls (its CPU taken, or a round of its own running long).
    pub stalls: Vec<crate::worker::Stalls>,
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
    /// Fragments after the first given their datagram's translation.
    pub fragments_translated: u64,
    /// Packets split into fragments for a smaller next link (IPv4 without DF).
    pub fragmented_out: u64,
    /// "Fragmentation needed" / "packet too big" answers sent.
    pub too_big_icmp: u64,
    /// Packets handed to the kernel to leave by an interface kxp does not drive.
    pub to_kernel: u64,
    /// Packets forwarded untranslated whose partial checksum kxp completed.
    pub pass_checksums_completed: u64,
    /// Frames untagged (arrived with an 802.1Q tag) and tagged (back to such a client).
    pub vlan_untagged: u64,
    pub vlan_tagged: u64,
    /// Packets handed to the kernel for the CNI's policy (`kxp.networkPolicy: kernel`).
    pub policy_handover: u64,
}

impl Totals {
    /// Adds one worker's counters.
    fn add_worker(&mut self, s: &WorkerStats) {
        let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        self.rx_packets += g(&s.rx_packets);
        self.tx_packets += g(&s.tx_packets);
        self.forwarded += g(&s.forwarded);
        self.new_flows += g(&s.new_flows);
        self.rejected += g(&s.rejected);
        self.dropped += g(&s.dropped);
        self.handoffs += g(&s.handoffs_out);
        self.conntrack_entries += g(&s.conntrack_entries);
        self.neighbour_pending += g(&s.neighbour_pending);
        self.no_route += g(&s.no_route);
        self.fragmented_out += g(&s.fragmented_out);
        self.too_big_icmp += g(&s.too_big_icmp);
        self.to_kernel += g(&s.to_kernel);
        self.pass_checksums_completed += g(&s.pass_checksums_completed);
        self.vlan_untagged += g(&s.vlan_untagged);
        self.vlan_tagged += g(&s.vlan_tagged);
        self.policy_handover += g(&s.policy_handover);
        *self.drops.entry("too_big_unanswerable").or_default() += g(&s.too_big_dropped);
        // Dropped after waiting for their next hop's MAC (the queue full, or 1 s
        // passed), and with no route at all: drops like the others.
        *self.drops.entry("neighbour_unresolved").or_default() += g(&s.neighbour_pending);
        *self.drops.entry("no_route").or_default() += g(&s.no_route);
        self.passed += g(&s.passed);
        self.forwarded_bytes += g(&s.forwarded_bytes);
        self.conntrack_inserts += g(&s.conntrack_inserts);
        self.conntrack_evictions += g(&s.conntrack_evictions);
        let it = g(&s.iterations);
        self.busy_ratio.push(if it == 0 {
            0.0
        } else {
            g(&s.busy_iterations) as f64 / it as f64
        });
        self.stalls.push(crate::worker::Stalls {
            count: g(&s.stalls),
            total_ns: g(&s.stalled_ns),
            longest_ns: g(&s.longest_stall_ns),
            by_part: [0, 1, 2, 3].map(|i| g(&s.stall_parts[i])),
        });
        let gen_ = g(&s.snapshot_generation);
        self.generation = if self.generation == 0 {
            gen_
        } else {
            self.generation.min(gen_)
        };
        if let Ok(d) = s.drop_detail.lock() {
            for (k, v) in d.iter() {
                *self.drops.entry(k).or_default() += v;
            }
        }
    }
}

/// A seed for a worker's random endpoint choice from the OS, so that nodes and restarts
/// do not all draw the same sequence (kube-proxy's `numgen random` is the kernel's
/// per-boot random too). Falls back to the clock if `/dev/urandom` cannot be read.
fn os_seed() -> u64 {
    use std::io::Read;
    let mut b = [0u8; 8];
    match std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)) {
        Ok(()) => u64::from_ne_bytes(b),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
    }
}

/// The links of this namespace whose names match `patterns`, with their MTUs.
fn matching_links(patterns: &[String]) -> Vec<(String, usize)> {
    let Ok(dir) = std::fs::read_dir("/sys/class/net") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| crate::ifmatch::wanted(patterns, n))
        .map(|n| {
            let mtu = link_mtu(&n).unwrap_or(1500);
            (n, mtu)
        })
        .collect()
}

/// The MTU of interface `ifname`, if it exists.
fn link_mtu(ifname: &str) -> Option<usize> {
    std::fs::read_to_string(format!("/sys/class/net/{ifname}/mtu"))
        .ok()
        .and_then(|m| m.trim().parse().ok())
}

/// The most receive queues of one interface kxp serves (its XSKMAP's size).
const MAX_QUEUES: usize = crate::xdp::MAX_QUEUES as usize;

fn rx_queues(ifname: &str) -> Option<usize> {
    let dir = std::fs::read_dir(format!("/sys/class/net/{ifname}/queues")).ok()?;
    Some(
        dir.filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("rx-"))
            .count(),
    )
}

/// The receive queues of `ifname` kxp serves: all of them (at least one), up to
/// [`MAX_QUEUES`]; more are warned about.
fn served_queues(ifname: &str) -> usize {
    let queues = rx_queues(ifname).unwrap_or(1).max(1);
    if queues > MAX_QUEUES {
        tracing::warn!(
            interface = %ifname,
            queues,
            "more receive queues than kxp serves ({}): Service traffic that RSS puts on \
             the others is passed to the kernel untranslated; lower the count (ethtool -L \
             {} combined {})",
            MAX_QUEUES,
            ifname,
            MAX_QUEUES
        );
    }
    queues.min(MAX_QUEUES)
}

impl Dataplane {
    /// Creates kxp's service device, starts the FIB mirror and the workers, publishes
    /// `initial`, attaches to every interface that matches `cfg.interfaces`, and follows
    /// links coming and going from then on.
    ///
    /// # Errors
    /// A [`DataplaneError`] that says what is wrong and what to do.
    pub fn start(
        cfg: &DataplaneConfig,
        initial: impl Into<Arc<Snapshot>>,
    ) -> Result<Dataplane, DataplaneError> {
        Self::start_handed(cfg, initial, Vec::new())
    }

    /// [`Dataplane::start`] with the sockets a previous kxp handed over
    /// ([`Dataplane::hand_over`]): taken up instead of opened, where they were made as
    /// this kxp makes them; those on interfaces this one does not attach to are closed.
    ///
    /// # Errors
    /// As [`Dataplane::start`].
    pub fn start_handed(
        cfg: &DataplaneConfig,
        initial: impl Into<Arc<Snapshot>>,
        handed: Vec<crate::xsk::Handed>,
    ) -> Result<Dataplane, DataplaneError> {
        Self::start_prepared(cfg, Self::prepare(cfg, initial)?, handed)
    }

    /// The part of a start that touches nothing of the node, so that a kxp taking over
    /// from a running one ([`Dataplane::hand_over`]) does it while that one still
    /// forwards: the configuration checked, the FIB mirror, the workers' shared state
    /// (`initial` published in it) and their connection tables.
    ///
    /// # Errors
    /// As [`Dataplane::start`].
    pub fn prepare(
        cfg: &DataplaneConfig,
        initial: impl Into<Arc<Snapshot>>,
    ) -> Result<Prepared, DataplaneError> {
        let initial: Arc<Snapshot> = initial.into();
        let ranges = start::check(cfg)?;
        let mut times = StartTimes::default();
        let mut lap = Instant::now();
        let fib = start::fib_mirror()?;
        times.lap("FIB mirror", &mut lap);
        let (rxs, shared) = start::shared_state(cfg, &initial)?;
        let mut tables = start::connection_tables(cfg, ranges)?;
        times.lap("connection tables", &mut lap);
        let files = start::prepare_state(cfg, &mut tables)?;
        times.lap("state files", &mut lap);
        Ok(Prepared {
            initial,
            times,
            fib,
            rxs,
            shared,
            tables,
            files,
            settings: start::Settings::of(cfg),
            premapped: crate::xsk::Premapped::default(),
            steering: None,
            service: None,
        })
    }

    /// The rest of [`Dataplane::start_handed`], after [`Dataplane::prepare`]: from the
    /// state directory's lock on.
    ///
    /// # Errors
    /// As [`Dataplane::start`].
    pub fn start_prepared(
        cfg: &DataplaneConfig,
        prepared: Prepared,
        handed: Vec<crate::xsk::Handed>,
    ) -> Result<Dataplane, DataplaneError> {
        let Prepared {
            initial,
            mut times,
            fib,
            rxs,
            shared,
            mut tables,
            files,
            settings,
            premapped,
            steering,
            service,
        } = prepared;
        let (handed, premapped, handed_ifindexes) = handed_parts(cfg, handed, premapped);
        let locked = start::lock_state(cfg)?;
        let mut lap = Instant::now();
        let (service, mut service_prog) =
            start::take_up(cfg, &settings, service, steering, &mut times, &mut lap)?;
        start::prepare_service_program(&mut service_prog, &service, cfg, settings.keep)?;
        // On sockets handed over, the previous kxp's routes and rules go on carrying the
        // node's traffic until the first publication: they are taken up after it, out of
        // forwarding's pause ([`Dataplane::attach_interfaces`]).
        let node_traffic = handed_ifindexes
            .is_empty()
            .then(|| start::node_traffic(cfg, &service))
            .transpose()?;

        let (mut persistence, node) = start::restore_state(cfg, locked, files, &mut tables)?;
        times.lap("state restore", &mut lap);
        let kit = start::WorkerKit {
            cfg,
            xsk: &settings.xsk,
            service: &service,
            fib: &fib,
            shared: &shared,
            node: &node,
        };
        let (workers, started) = kit.parts(
            rxs,
            tables,
            &mut service_prog,
            &mut persistence,
            handed,
            premapped,
        )?;
        let taken_over = start::steer_service_device(&mut service_prog, &service, &settings)?;
        let prog = Programming::at_start(cfg, taken_over, service_prog, node_traffic);
        let links = LinkCtl::at_start(cfg, &settings, &service, &shared, &fib, prog);
        let mut dp = Dataplane {
            shared: shared.clone(),
            start_times: StartTimes::default(),
            persistence,
            node,
            links: links.clone(),
            fib,
            threads: Vec::new(),
            link_thread: None,
            link_stop: Arc::new(AtomicBool::new(false)),
            handed: None,
            after_first: None,
            worker_tids: None,
            first_published_ns: 0,
            service: Some(service),
        };
        dp.spawn_workers(workers)?;
        times.lap("workers", &mut lap);
        // A previous kxp's steering, kept until the take-over, goes on holding with what
        // its maps and routes have until the first state with Services is published: an
        // empty start (`kxp run` starts before its first sync) would empty them.
        if taken_over || initial.port_count() > 0 {
            dp.program(&Update::full(initial))?;
        }
        dp.start_times = times;
        dp.attach_or_wait(cfg, links, handed_ifindexes, started)?;
        Ok(dp)
    }

    /// The end of a start: attaches to the interfaces there now, or, on sockets handed
    /// over (`handed_ifindexes`), leaves that for after the first publication; follows
    /// the links from then on, and moves kxp's other threads off the workers' CPUs once
    /// they run (`started`: their thread ids), now or after the first publication.
    fn attach_or_wait(
        &mut self,
        cfg: &DataplaneConfig,
        links: Arc<LinkCtl>,
        handed_ifindexes: HashSet<u32>,
        started: std::sync::mpsc::Receiver<libc::pid_t>,
    ) -> Result<(), DataplaneError> {
        let mut started = Some(started);
        if handed_ifindexes.is_empty() {
            // The interfaces there now; one named without a wildcard must attach.
            self.attach_now()?;
        } else {
            // On sockets handed over, the previous kxp's program goes on redirecting into
            // them, and the workers serve them from the first sync: attaching the
            // interfaces' own instances waits until then ([`Dataplane::attach_interfaces`]),
            // out of forwarding's pause. Where the workers transmit is the handed
            // interfaces that match until then.
            links.publish_handed(&self.fib.view().links(), &handed_ifindexes);
            self.handed = Some(handed_ifindexes);
            self.after_first = started.take().map(|started| AfterFirst {
                cfg: cfg.clone(),
                started,
            });
        }
        self.follow_links(cfg, links)?;
        if let Some(started) = started {
            self.worker_tids = Some(start::keep_others_off(cfg, &started));
        }
        Ok(())
    }

    /// Started on sockets a previous kxp handed over ([`Dataplane::start_handed`]): to
    /// call once the first sync is published. Attaches to every interface there now that
    /// matches (as the start does otherwise) and closes the sockets handed over on the
    /// others. Nothing otherwise.
    ///
    /// # Errors
    /// An interface named without a wildcard cannot be attached.
    pub fn attach_interfaces(&mut self) -> Result<(), DataplaneError> {
        if self.handed.is_none() {
            return Ok(());
        }
        self.after_first_publication()?;
        self.attach_now()
    }

    /// Started on sockets handed over, once the first state is published
    /// ([`AfterFirst`]): moves kxp's other threads off the workers' CPUs, and takes up
    /// the routes and rules of the node's own traffic that the previous kxp kept,
    /// brought in line with what is published.
    fn after_first_publication(&mut self) -> Result<(), DataplaneError> {
        let (Some(after), Some(service)) = (self.after_first.take(), self.service.as_ref()) else {
            return Ok(());
        };
        let cfg = &after.cfg;
        let workers = start::keep_others_off(cfg, &after.started);
        crate::priority::end_start_boost(&workers, self.holder_pid());
        let (routes, nodeport_rules, kernel_policy) = start::node_traffic(cfg, service)?;
        let mut prog = self.links.lock();
        prog.routes = Some(routes);
        prog.nodeport_rules = Some(nodeport_rules);
        prog.kernel_policy = kernel_policy;
        let (local, cidrs) = (prog.wanted.local.clone(), prog.wanted.service_cidrs.clone());
        prog.sync_node_traffic(&local, &cidrs).map_or(Ok(()), Err)
    }

    /// Attaches to every interface there now that matches (those that come later are
    /// attached as they come), closes the sockets handed over on the others, and adds the
    /// time to `start_times`.
    fn attach_now(&mut self) -> Result<(), DataplaneError> {
        let mut lap = Instant::now();
        self.links.reconcile(&self.fib.view().links(), true)?;
        if let Some(handed) = self.handed.take() {
            self.links.close_unclaimed(handed);
        }
        self.start_times.lap("interfaces", &mut lap);
        self.start_times.interfaces = self.links.lock().steering.len();
        Ok(())
    }

    /// The interfaces kxp is attached to now (name, ifindex).
    pub fn attached(&self) -> Vec<(String, u32)> {
        let prog = self.links.lock();
        prog.steering
            .iter()
            .map(|s| (s.ifname().unwrap_or_default().to_string(), s.ifindex()))
            .collect()
    }

    /// The steering programs' counters, per interface (the service device's included).
    pub fn steer_stats(&self) -> Vec<(String, crate::xdp::SteerStats)> {
        let prog = self.links.lock();
        prog.steering
            .iter()
            .chain(prog.service.iter())
            .filter_map(|s| Some((s.ifname()?.to_string(), s.stats().ok()?)))
            .collect()
    }

    /// How full the steering program's key sets are: (map, keys, size). The program
    /// and its maps are shared by every interface.
    pub fn steering_sets(&self) -> Vec<(&'static str, usize, usize)> {
        let prog = self.links.lock();
        prog.service
            .iter()
            .chain(prog.steering.iter())
            .next()
            .map(|s| s.set_fill())
            .unwrap_or_default()
    }

    /// The service device's host-side name.
    pub fn service_device(&self) -> Option<&str> {
        self.service.as_ref().map(|s| s.host.as_str())
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
        if self.first_published_ns == 0 {
            self.first_published_ns = crate::sys::monotonic_ns();
            // The workers forward: the start's priority ends (on sockets handed over,
            // once the workers' thread ids are known, after this publication).
            if let Some(workers) = &self.worker_tids {
                crate::priority::end_start_boost(workers, self.holder_pid());
            }
        }
        self.program(&update)
    }

    /// The socket holder's process id, if one runs.
    fn holder_pid(&self) -> Option<libc::pid_t> {
        let pid = self.shared.holder.as_ref()?.pid()?;
        libc::pid_t::try_from(pid).ok()
    }

    /// When the first state was published (`CLOCK_MONOTONIC`, ns; 0: not yet): the
    /// workers forward from then on (see [`crate::worker::Worker::run`]).
    pub fn first_published_ns(&self) -> u64 {
        self.first_published_ns
    }

    fn program(&mut self, update: &Update) -> Result<(), DataplaneError> {
        let (gone_udp, err) = {
            let mut prog = self.links.lock();
            let r = prog.program(update, &self.fib.view());
            prog.needs_full = r.1.is_some();
            r
        };
        // kube-proxy's conntrack cleanup: UDP flows to endpoints that are gone or no
        // longer serve, and to Service addresses that are gone.
        for gone in gone_udp.endpoints {
            for tx in &self.shared.commands {
                let _ = tx.send(Command::RemoveUdpTo(gone.ip(), gone.port()));
            }
        }
        if !gone_udp.frontends.is_empty() {
            let gone: Arc<HashSet<SocketAddr>> = Arc::new(gone_udp.frontends.into_iter().collect());
            for tx in &self.shared.commands {
                let gone = gone.clone();
                let filter: crate::worker::FlowFilter = Arc::new(move |e: &conntrack::Entry| {
                    let o = e.orig();
                    o.proto == Protocol::Udp
                        && gone.contains(&SocketAddr::new(o.dst.to_canonical(), o.dport))
                });
                // Nobody waits for the count.
                let (reply, _) = crossbeam::channel::bounded(1);
                let _ = tx.send(Command::Flows {
                    filter,
                    delete: true,
                    reply,
                });
            }
        }
        match err {
            Some(e) => Err(e),
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

    /// What start-up restored from the state directory (`None` without one).
    pub fn restored(&self) -> Option<&crate::persistence::Restored> {
        self.persistence.as_ref().map(|p| &p.restored)
    }

    /// Sums of the workers' counters.
    pub fn totals(&self) -> Totals {
        let mut t = Totals {
            affinity: self.node.affinity.stats(),
            ..Totals::default()
        };
        if let Ok(f) = self.shared.frags.lock() {
            let st = f.stats();
            t.fragments_translated = st.translated;
            t.drops.insert("fragment_unmatched", st.dropped);
            t.drops.insert("fragment_table_full", st.full);
        }
        for s in &self.shared.stats {
            t.add_worker(s);
        }
        t
    }

    /// Takes over the programs a previous kxp left attached: each interface's new
    /// program, filled with what was published so far, replaces the old one atomically.
    /// Call it after the first full publication (until then the old programs steer,
    /// holding packets while no socket takes them). kxp programs left on interfaces that
    /// no longer match are detached.
    ///
    /// # Errors
    /// An interface that cannot be taken over (it is then detached and retried like a
    /// failed attach).
    pub fn take_over(&self) -> Result<(), DataplaneError> {
        let mut prog = self.links.lock();
        if prog.taken_over {
            return Ok(());
        }
        prog.taken_over = true;
        let mode = self.links.attach;
        let mut first = None;
        let mut failed = Vec::new();
        for s in prog.steering.iter_mut().filter(|s| !s.is_attached()) {
            let name = s.ifname().unwrap_or_default().to_string();
            if let Err(e) = s.attach(&name, mode, true) {
                failed.push(s.ifindex());
                first.get_or_insert(e);
            }
        }
        for ifindex in failed {
            self.links.detach(&mut prog, ifindex);
            prog.failed.insert(ifindex, Instant::now());
        }
        if let Some(s) = prog.service.as_mut().filter(|s| !s.is_attached()) {
            let name = s.ifname().unwrap_or_default().to_string();
            if let Err(e) = s.attach(&name, mode, true) {
                first.get_or_insert(e);
            }
        }
        let ours: Vec<u32> = prog
            .steering
            .iter()
            .chain(prog.service.as_ref())
            .map(Steering::ifindex)
            .collect();
        for l in self.fib.view().links() {
            if !ours.contains(&l.ifindex)
                && matches!(crate::xdp::cleanup_interface(&l.name), Ok(true))
            {
                tracing::info!(interface = %l.name, "detached the program a previous kxp left (no longer matching)");
            }
        }
        // Pins of interfaces gone while no kxp ran, and of other builds' programs.
        crate::xdp::pins::prune(&ours);
        if let Some(s) = prog.service.as_ref() {
            let forgotten = s.forget_previous();
            if forgotten > 0 {
                tracing::info!(
                    interfaces = forgotten,
                    "forgot the interfaces the previous kxp steered that are gone or no longer match"
                );
            }
        }
        Steering::prune_pinned_programs();
        match first {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Stops the workers. With a state directory the steering stays for the next kxp:
    /// pinned programs (holding kxp's packets while no socket takes them), the service
    /// device, its routes and rules, and the state files; without one, everything is
    /// removed as by [`Dataplane::remove`].
    pub fn stop(mut self) {
        let keep = self.links.keep;
        self.shutdown(keep);
    }

    /// Stops as [`Dataplane::stop`] (with a state directory: steering kept), but instead
    /// of closing the workers' sockets hands them over: returns, per worker, its UMEM,
    /// its sockets and the frames userspace held, for the next kxp
    /// ([`Dataplane::start_handed`]). The kernel goes on receiving into the rings
    /// meanwhile. A worker that could not hand over closed its sockets (it is missing).
    pub fn hand_over(mut self) -> HandedOver {
        self.shared.hand_over.asked.store(true, Ordering::Relaxed);
        let keep = self.links.keep;
        self.stop_programming(keep);
        self.shared.stop.store(true, Ordering::Relaxed);
        // Each worker's sockets as soon as it has handed them over: its teardown, and the
        // rest of the shutdown, go on in the background (`drop` below).
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.shared.hand_over.answered.load(Ordering::Acquire) < self.threads.len()
            && !self.threads.iter().all(JoinHandle::is_finished)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_micros(50));
        }
        let mut handed = std::mem::take(
            &mut *self
                .shared
                .hand_over
                .handed
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        handed.sort_by_key(|(id, _)| *id);
        let handed = HandedOver {
            workers: handed.into_iter().map(|(_, h)| h).collect(),
            stopped_ns: self.shared.hand_over.stopped_ns.load(Ordering::Relaxed),
        };
        // The state directory is the next kxp's now; the rest (the FIB mirror's thread,
        // the socket holder) is let go in the background: the next kxp waits for the
        // sockets, and forwarding waits with it.
        drop(self.persistence.take());
        let _ = std::thread::Builder::new()
            .name("kxp-handed".into())
            .spawn(move || drop(self));
        handed
    }

    /// Stops and removes everything: programs (pins included), the service device, its
    /// routes and rules, and the state files. For an uninstall, or a demo.
    pub fn remove(mut self) {
        self.shutdown(false);
        if let Some(p) = self.persistence.take() {
            remove_state(&p.dir.path);
        }
    }

    fn shutdown(&mut self, keep: bool) {
        self.stop_programming(keep);
        self.shared.stop.store(true, Ordering::Relaxed);
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
        // The workers' references are gone; the holder's go with it, in parallel. (When
        // the sockets were handed over, they live on: the holder goes later, with the
        // last reference to the workers' shared state.)
        if let Some(h) = &self.shared.holder
            && !self.shared.hand_over.asked.load(Ordering::Relaxed)
            && !h.finish(Duration::from_secs(10))
        {
            tracing::warn!("the socket holder did not exit within 10 s: killed");
        }
        // The workers' sockets are closed: the service device can go (or stay).
        if let Some(mut dev) = self.service.take()
            && keep
        {
            dev.keep();
        }
    }

    /// Stops following the links, and keeps (`keep`) or removes the programs, routes and
    /// rules: the first part of a stop, before the workers'.
    fn stop_programming(&mut self, keep: bool) {
        self.link_stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.link_thread.take() {
            let _ = h.join();
        }
        {
            let mut prog = self.links.lock();
            let service = prog.service.take();
            if keep {
                // The programs stay attached; the routes and rules stay with the device.
                for mut s in prog.steering.drain(..).chain(service) {
                    s.keep_attached();
                }
                if let Some(mut rules) = prog.nodeport_rules.take() {
                    rules.keep();
                }
                if let Some(mut p) = prog.kernel_policy.take() {
                    p.keep();
                }
                prog.routes.take();
            } else {
                // Programs first: from here on the interfaces' traffic is the kernel's.
                for s in prog.steering.drain(..).chain(service) {
                    if let Err(e) = s.detach() {
                        tracing::warn!(error = %e, "detaching an XDP program");
                    }
                }
                if let Some(mut routes) = prog.routes.take() {
                    let _ = routes.sync(&HashSet::new());
                }
                if let Some(mut rules) = prog.nodeport_rules.take() {
                    rules.clear();
                }
                prog.kernel_policy.take();
            }
            for (path, value) in prog.restore.drain(..) {
                let _ = std::fs::write(&path, value);
            }
        }
    }
}

impl LinkCtl {
    fn lock(&self) -> std::sync::MutexGuard<'_, Programming> {
        self.prog.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wanted_name(&self, name: &str) -> bool {
        !self.reserved.iter().any(|r| r == name)
            && self
                .patterns
                .iter()
                .any(|p| crate::ifmatch::matches(p, name))
    }

    /// Attaches to every link that matches and is not attached yet, and forgets the
    /// attached ones that are gone or no longer match (renamed). With `strict`, an
    /// interface named without a wildcard that fails to attach is an error (at start).
    fn reconcile(&self, links: &[LinkInfo], strict: bool) -> Result<(), DataplaneError> {
        let mut prog = self.lock();
        let gone: Vec<u32> = prog
            .steering
            .iter()
            .filter(|s| {
                !links
                    .iter()
                    .any(|l| l.ifindex == s.ifindex() && self.wanted_name(&l.name))
            })
            .map(Steering::ifindex)
            .collect();
        let mut changed = !gone.is_empty();
        for ifindex in gone {
            self.detach(&mut prog, ifindex);
        }
        changed |= self.recount_queues(&mut prog);
        prog.failed
            .retain(|i, at| at.elapsed() < ATTACH_RETRY && links.iter().any(|l| l.ifindex == *i));
        changed |= self.attach_new(&mut prog, links, strict)?;
        if changed {
            self.publish_attached(&prog);
        }
        Ok(())
    }

    /// Detaches each attached interface whose receive queue count changed, to be attached
    /// again; returns whether any was.
    fn recount_queues(&self, prog: &mut Programming) -> bool {
        let mut changed = false;
        // A queue count changed (`ethtool -L`, no netlink event says so): attached again
        // below, a socket on every queue. Compared once a second.
        if prog
            .queues_checked
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        {
            prog.queues_checked = Some(Instant::now());
            let moved: Vec<(u32, String, usize, usize)> = prog
                .steering
                .iter()
                .filter_map(|s| {
                    let name = s.ifname()?.to_string();
                    let had = *prog.queues.get(&s.ifindex())?;
                    // As `attach` counts them (within what the XSKMAP holds), or an
                    // interface with more would be attached again every second.
                    let now = rx_queues(&name)?.clamp(1, MAX_QUEUES);
                    (now != had).then_some((s.ifindex(), name, had, now))
                })
                .collect();
            for (ifindex, name, had, now) in moved {
                tracing::info!(
                    interface = %name,
                    from = had,
                    to = now,
                    "receive queue count changed: attaching again with a socket on every queue"
                );
                self.detach(prog, ifindex);
                changed = true;
            }
        }
        changed
    }

    /// Attaches to every link of `links` that is wanted, not attached, and has not
    /// failed in the last [`ATTACH_RETRY`]; returns whether it tried any. With `strict`,
    /// an interface named without a wildcard that fails to attach is an error.
    fn attach_new(
        &self,
        prog: &mut Programming,
        links: &[LinkInfo],
        strict: bool,
    ) -> Result<bool, DataplaneError> {
        let mut changed = false;
        let todo: Vec<&LinkInfo> = links
            .iter()
            .filter(|l| {
                self.wanted_name(&l.name)
                    && !prog.steering.iter().any(|s| s.ifindex() == l.ifindex)
                    && !prog.failed.contains_key(&l.ifindex)
                    && crate::ifmatch::wanted(&self.patterns, &l.name)
            })
            .collect();
        // Every socket asked for at once: the workers open them in one go, instead of a
        // round trip each (112 of them at a start with 110 pod veths).
        let mut asked = self.ask_sockets(&todo);
        for l in todo {
            changed = true;
            let r = self.attach(prog, l, &mut asked);
            if r.is_err() {
                // Its sockets, opened or only asked for.
                self.close_ports_everywhere(l.ifindex);
            }
            match r {
                Ok((queues, mode, tx_per_sendto)) => tracing::info!(
                    interface = %l.name,
                    ifindex = l.ifindex,
                    sockets = queues,
                    mode,
                    tx_per_sendto,
                    "attached"
                ),
                Err(e) => {
                    prog.failed.insert(l.ifindex, Instant::now());
                    let literal = self
                        .patterns
                        .iter()
                        .any(|p| !crate::ifmatch::is_pattern(p) && *p == l.name);
                    if strict && literal {
                        // The sockets asked for the links not attached yet go too.
                        let left: HashSet<u32> = asked.keys().map(|(i, _)| *i).collect();
                        for ifindex in left {
                            self.close_ports_everywhere(ifindex);
                        }
                        return Err(e);
                    }
                    crate::warn_limited!(format!("attach {}", l.name), interface = %l.name, error = %e, "cannot attach; retrying every 10 s");
                }
            }
        }
        Ok(changed)
    }

    /// Tells the FIB mirror and the workers which interfaces are attached now.
    /// Before the interfaces are attached on sockets handed over: the interfaces of
    /// `handed` there now that this kxp attaches to are where the workers transmit.
    fn publish_handed(&self, links: &[LinkInfo], handed: &HashSet<u32>) {
        self.publish_list(
            links
                .iter()
                .filter(|l| handed.contains(&l.ifindex) && self.wanted_name(&l.name))
                .map(|l| (l.ifindex, l.name.clone()))
                .collect(),
        );
    }

    fn publish_attached(&self, prog: &Programming) {
        self.publish_list(
            prog.steering
                .iter()
                .map(|s| (s.ifindex(), s.ifname().unwrap_or_default().to_string()))
                .collect(),
        );
    }

    /// Where the workers transmit: `list` (ifindex, name), to the FIB mirror and to them.
    fn publish_list(&self, list: Vec<(u32, String)>) {
        self.fib
            .set_attached(&list.iter().map(|(i, _)| *i).collect::<Vec<_>>());
        self.shared.attached.store(Arc::new(list));
    }

    /// Attaches the shared steering program to `link` (a new handle, a slot in its maps,
    /// which already hold what is wanted), and opens a socket on every receive queue of
    /// the interface: queue `q`
    /// is served by worker `q % workers` (a worker serves several queues when the
    /// interface has more than there are workers: RSS spreads flows over every queue,
    /// and a queue without a socket would pass Service traffic untranslated).
    /// Returns the number of sockets, their AF_XDP mode, and the fewest frames one
    /// sendto() on them transmits in copy mode (0: zero-copy).
    fn attach(
        &self,
        prog: &mut Programming,
        link: &LinkInfo,
        asked: &mut Asked,
    ) -> Result<(usize, &'static str, u32), DataplaneError> {
        let queues = served_queues(&link.name);
        self.warn_frame_mtu(link);
        // The service device's program, shared: its maps already hold what is wanted.
        let mut s = prog
            .service
            .as_ref()
            .ok_or_else(|| DataplaneError::Config("the steering program is not loaded".into()))?
            .share()?;
        s.prepare_for(&link.name, link.ifindex)?;
        if self.keep {
            s.set_hold(queues as u32)?;
        }
        let (opened, mut result) = self.open_sockets(&s, link, queues, asked);
        // Filled and with its sockets: attach it, or, if a previous kxp's link steers
        // this interface, leave that one in place until `take_over`.
        let kept = self.keep && !prog.taken_over && Steering::kept_on(&link.name, self.attach);
        if result.is_ok() && !kept {
            result = s
                .attach(&link.name, self.attach, self.keep)
                .map_err(DataplaneError::from);
        }
        // On an error the caller closes the interface's sockets.
        result?;
        if self.busy_poll {
            prog.restore
                .extend(busy_poll_knobs(std::slice::from_ref(&link.name)));
        }
        prog.steering.push(s);
        prog.queues.insert(link.ifindex, queues);
        Ok((queues, opened.mode(), opened.tx_per_sendto()))
    }

    /// Warns that packets from `link` larger than a frame are dropped, if its MTU is
    /// larger than a frame holds and kxp started without multi-buffer.
    fn warn_frame_mtu(&self, link: &LinkInfo) {
        if !self.multi_buffer
            && let Some(mtu) = link_mtu(&link.name)
            && mtu > self.frame_mtu
        {
            tracing::warn!(
                interface = %link.name,
                mtu,
                "MTU larger than a frame and kxp started without AF_XDP multi-buffer: packets \
                 larger than {} bytes from it are dropped; restart kxp (it turns multi-buffer \
                 on when an interface needs it at start)",
                self.frame_mtu
            );
        }
    }

    /// Has the workers open a socket on each of `link`'s first `queues` receive queues
    /// (queue `q` by worker `q % workers`) and enters each in `s`'s socket map, up to the
    /// first failure. Returns what the sockets opened are (their mode and budget) and
    /// that failure, if any.
    fn open_sockets(
        &self,
        s: &Steering,
        link: &LinkInfo,
        queues: usize,
        asked: &mut Asked,
    ) -> (Opened, Result<(), DataplaneError>) {
        let mut opened = Opened {
            zero_copy: Vec::new(),
            tx_budget: u32::MAX,
        };
        for queue in 0..queues {
            let worker = queue % self.workers;
            let r = match self.open_socket(worker, link, queue, asked) {
                Ok(Ok((fd, zc, budget))) => {
                    opened.zero_copy.push(zc);
                    opened.tx_budget = opened.tx_budget.min(budget);
                    s.set_socket(queue as u32, fd).map_err(DataplaneError::from)
                }
                Ok(Err(e)) => Err(DataplaneError::Config(e.to_string())),
                Err(_) => Err(DataplaneError::Config(format!(
                    "worker {worker} did not open its socket on {} queue {queue}",
                    link.name
                ))),
            };
            if let Err(e) = r {
                return (opened, Err(e));
            }
        }
        (opened, Ok(()))
    }

    /// Asks the workers for a socket on every receive queue of each of `links` (queue
    /// `q` of worker `q % workers`) without waiting: where each answer will come.
    fn ask_sockets(&self, links: &[&LinkInfo]) -> Asked {
        let mut asked = Asked::new();
        for link in links {
            for queue in 0..served_queues(&link.name) {
                let worker = queue % self.workers;
                asked.insert((link.ifindex, queue), self.ask_socket(worker, link, queue));
            }
        }
        asked
    }

    /// Asks `worker` for a socket on `link`'s receive queue `queue`; where its answer
    /// will come.
    fn ask_socket(
        &self,
        worker: usize,
        link: &LinkInfo,
        queue: usize,
    ) -> crossbeam::channel::Receiver<PortAnswer> {
        let (rtx, rrx) = crossbeam::channel::bounded(1);
        let _ = self.shared.commands[worker].send(Command::AddPort {
            ifname: link.name.clone(),
            ifindex: link.ifindex,
            queue: queue as u32,
            reply: rtx,
        });
        rrx
    }

    /// Has `worker` open a socket on `link`'s receive queue `queue` (the answer to what
    /// was `asked` already, if it was); its reply (the socket, or why not), or the
    /// timeout's error if it did not answer in time.
    fn open_socket(
        &self,
        worker: usize,
        link: &LinkInfo,
        queue: usize,
        asked: &mut Asked,
    ) -> PortReply {
        let open = || {
            self.ask_socket(worker, link, queue)
                .recv_timeout(WORKER_REPLY)
        };
        // A socket closed on this queue a moment ago (attaching again after a queue
        // count change, or by a kxp that just died) may still hold it (see
        // XskError::is_busy): tried again for up to a second.
        let mut reply = match asked.remove(&(link.ifindex, queue)) {
            Some(rx) => rx.recv_timeout(WORKER_REPLY),
            None => open(),
        };
        let busy_since = Instant::now();
        while matches!(&reply, Ok(Err(e)) if e.is_busy())
            && busy_since.elapsed() < Duration::from_secs(1)
        {
            std::thread::sleep(Duration::from_millis(10));
            reply = open();
        }
        reply
    }

    /// Detaches from `ifindex` and has the workers close their sockets there.
    fn detach(&self, prog: &mut Programming, ifindex: u32) {
        let Some(i) = prog.steering.iter().position(|s| s.ifindex() == ifindex) else {
            return;
        };
        let s = prog.steering.remove(i);
        prog.queues.remove(&ifindex);
        let name = s.ifname().unwrap_or_default().to_string();
        if let Err(e) = s.detach() {
            tracing::warn!(interface = %name, error = %e, "detaching an XDP program");
        }
        self.close_ports_everywhere(ifindex);
        tracing::info!(interface = %name, ifindex, "detached (gone or no longer matching)");
    }

    /// Closes the sockets handed over by a previous kxp on interfaces (`handed`) this one
    /// did not attach to.
    fn close_unclaimed(&self, handed: HashSet<u32>) {
        let attached: HashSet<u32> = self.lock().steering.iter().map(Steering::ifindex).collect();
        for ifindex in handed.difference(&attached) {
            tracing::info!(
                ifindex,
                "closing the sockets handed over on an interface this kxp does not attach to"
            );
            self.close_ports_everywhere(*ifindex);
        }
    }

    /// Has every worker close its sockets on `ifindex`.
    fn close_ports_everywhere(&self, ifindex: u32) {
        let replies: Vec<_> = (self.shared.commands.iter())
            .filter_map(|c| {
                let (rtx, rrx) = crossbeam::channel::bounded(1);
                c.send(Command::RemovePort {
                    ifindex,
                    reply: rtx,
                })
                .ok()
                .map(|()| rrx)
            })
            .collect();
        for r in replies {
            let _ = r.recv_timeout(WORKER_REPLY);
        }
    }
}

/// Where the workers' answers to sockets asked for in advance come, by (interface,
/// queue).
type Asked = HashMap<(u32, usize), crossbeam::channel::Receiver<PortAnswer>>;

/// A worker's answer to [`Command::AddPort`]: the socket's descriptor, whether it is in
/// zero-copy mode and its TX budget per sendto(), or why not.
type PortAnswer = Result<(std::os::fd::RawFd, bool, u32), crate::xsk::XskError>;

/// A worker's answer, or no answer in time.
type PortReply = Result<PortAnswer, crossbeam::channel::RecvTimeoutError>;

/// The sockets opened on an interface's receive queues (see [`LinkCtl::attach`]).
struct Opened {
    /// Whether each socket is in zero-copy mode.
    zero_copy: Vec<bool>,
    /// The fewest frames one sendto() on them transmits (`u32::MAX`: none opened).
    tx_budget: u32,
}

impl Opened {
    /// The sockets' AF_XDP mode.
    fn mode(&self) -> &'static str {
        let zero_copy = &self.zero_copy;
        match (zero_copy.iter().all(|z| *z), zero_copy.iter().any(|z| *z)) {
            (true, _) => "zero-copy",
            (false, true) => "zero-copy on some queues, copy on others",
            (false, false) => "copy",
        }
    }

    /// The fewest frames one sendto() on them transmits in copy mode (0: zero-copy).
    fn tx_per_sendto(&self) -> u32 {
        if self.tx_budget == u32::MAX {
            0
        } else {
            self.tx_budget
        }
    }
}

impl Programming {
    /// Brings every attached program's maps in line with `update`; returns the UDP
    /// endpoints and Service addresses that went away and the first error, if any.
    fn program(
        &mut self,
        update: &Update,
        view: &crate::fib::FibView,
    ) -> (GoneUdp, Option<DataplaneError>) {
        let snap = &*update.snapshot;
        let (local, np_addrs) = node_addresses(snap, view);
        let full = update.full || self.needs_full;
        if full && !update.full {
            tracing::info!("programming every Service anew: the last programming failed");
        }
        let service_cidrs: HashSet<ipnet::IpNet> =
            snap.node.service_cidrs.iter().copied().collect();
        let mut first_err = None;
        let mut note = |r: Result<crate::xdp::SyncStats, crate::xdp::XdpError>| {
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        };
        // Every handle of one program shares its maps: written once, through the first.
        let mut programs: Vec<&mut Steering> = Vec::new();
        for s in self.service.iter_mut().chain(self.steering.iter_mut()) {
            if !programs.iter().any(|p| p.prog_id() == s.prog_id()) {
                programs.push(s);
            }
        }
        for s in programs.iter_mut() {
            note(s.sync_local_addrs(&local));
            note(s.sync_service_cidrs(&service_cidrs));
        }
        let gone_udp = if full {
            self.wanted
                .refill(snap, np_addrs, &mut programs, view, &mut note)
        } else {
            self.wanted
                .apply(update, np_addrs, &mut programs, view, &mut note)
        };
        let route_err = self.sync_node_traffic(&local, &service_cidrs);
        self.wanted.local = local;
        self.wanted.service_cidrs = service_cidrs;
        (gone_udp, first_err.map(DataplaneError::from).or(route_err))
    }

    /// Brings the routes of Service addresses into the service device and the NodePort
    /// rules in line with what is wanted (`local`: the node's addresses); returns the
    /// first error, if any.
    fn sync_node_traffic(
        &mut self,
        local: &HashSet<IpAddr>,
        service_cidrs: &HashSet<ipnet::IpNet>,
    ) -> Option<DataplaneError> {
        let mut route_err = None;
        let cidrs_changed = *service_cidrs != self.wanted.service_cidrs;
        if let Some(routes) = &mut self.routes
            && (self.wanted.routes_changed || cidrs_changed)
        {
            let want =
                crate::servicedev::wanted_routes(service_cidrs, self.wanted.routed.keys().copied());
            match routes.sync(&want) {
                Ok(()) => self.wanted.routes_changed = false,
                Err(e) => route_err = Some(DataplaneError::from(e)),
            }
        }
        let nodeports_due = self.wanted.node_ports_changed || *local != self.wanted.local;
        // Or the SNAT range is to appear or go in the rules (it is there while some
        // Service has a frontend).
        let with_snat = !self.wanted.frontends.counts.is_empty();
        if let Some(rules) = &mut self.nodeport_rules
            && (nodeports_due || rules.catches_snat() != with_snat)
        {
            let ports: Vec<(u8, u16)> = self.wanted.node_ports.keys().copied().collect();
            let mut addrs: Vec<IpAddr> = local.iter().copied().collect();
            addrs.extend(self.wanted.np_addrs.iter().copied());
            let snat = with_snat.then_some(self.snat);
            match rules.sync(&addrs, &ports, snat) {
                Ok(()) => self.wanted.node_ports_changed = false,
                Err(e) => {
                    route_err.get_or_insert(DataplaneError::from(e));
                }
            }
        }
        route_err
    }
}

/// The node's addresses (the host's, as `view` sees them, and those `snap` gives), and
/// the addresses its NodePorts are expanded with, sorted.
fn node_addresses(snap: &Snapshot, view: &crate::fib::FibView) -> (HashSet<IpAddr>, Vec<IpAddr>) {
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
    (local, np_addrs)
}

impl Wanted {
    /// Counts afresh what every Service port of `snap` wants (NodePorts on `np_addrs`),
    /// writes the maps of `programs` in full (errors to `note`) and resolves the
    /// endpoints' next hops; returns the UDP endpoints and Service addresses no longer
    /// wanted.
    fn refill(
        &mut self,
        snap: &Snapshot,
        np_addrs: Vec<IpAddr>,
        programs: &mut [&mut Steering],
        view: &crate::fib::FibView,
        note: &mut impl FnMut(Result<crate::xdp::SyncStats, crate::xdp::XdpError>),
    ) -> GoneUdp {
        let old_udp = std::mem::take(&mut self.udp);
        let old_frontends = std::mem::take(&mut self.udp_frontends);
        // Counted afresh (no changes recorded), with room for every key: at 100,000
        // Services, growing the tables and recording changes took a third of a refill.
        let (ports, eps) = snap
            .ports()
            .fold((0, 0), |(p, e), sp| (p + 1, e + sp.endpoints.len()));
        *self = Wanted {
            np_addrs,
            routes_changed: true,
            node_ports_changed: true,
            frontends: Counted::fresh(ports * 2),
            endpoints: Counted::fresh(eps * 2),
            cluster_ips: Counted::fresh(ports),
            routed: Counted::fresh(ports),
            node_ports: Counted::fresh(0),
            udp: Counted::fresh(0),
            udp_frontends: Counted::fresh(0),
            ..Wanted::default()
        };
        for sp in snap.ports() {
            self.count(sp, 1);
        }
        self.track_changes();
        let keys =
            |c: &Counted<SteerKey>| -> crate::xdp::KeySet<SteerKey> { c.keys().copied().collect() };
        let cluster_ips: crate::xdp::KeySet<IpAddr> = self.cluster_ips.keys().copied().collect();
        // Each program (one for every interface) takes its sets whole: no other copy.
        for s in programs.iter_mut() {
            for r in s.refill(keys(&self.frontends), keys(&self.endpoints), &cluster_ips) {
                note(r);
            }
        }
        for sp in snap.ports() {
            resolve_next_hops(view, sp);
        }
        self.settle();
        GoneUdp {
            endpoints: old_udp
                .into_keys()
                .filter(|a| !self.udp.contains_key(a))
                .collect(),
            frontends: old_frontends
                .into_keys()
                .filter(|a| !self.udp_frontends.contains_key(a))
                .collect(),
        }
    }

    /// Counts in the Service ports `update` adds (resolving their endpoints' next hops)
    /// and out those it removes, and changes in the maps of `programs` only the keys that
    /// appeared or vanished (errors to `note`); returns the UDP endpoints and Service
    /// addresses no longer wanted.
    fn apply(
        &mut self,
        update: &Update,
        np_addrs: Vec<IpAddr>,
        programs: &mut [&mut Steering],
        view: &crate::fib::FibView,
        note: &mut impl FnMut(Result<crate::xdp::SyncStats, crate::xdp::XdpError>),
    ) -> GoneUdp {
        // Additions first, so that a port that is removed and added again (changed)
        // never drops its keys to zero on the way.
        for sp in &update.added {
            self.count(sp, 1);
            resolve_next_hops(view, sp);
        }
        for sp in &update.removed {
            self.count(sp, -1);
        }
        // Then the NodePorts moved, over what is counted now: the snapshot's ports.
        if np_addrs != self.np_addrs {
            self.move_node_ports(&update.snapshot, np_addrs);
        }
        let (fa, fr) = self.frontends.changes();
        let (ea, er) = self.endpoints.changes();
        let (ca, cr) = self.cluster_ips.changes();
        let (ra, rr) = self.routed.changes();
        self.routes_changed |= !ra.is_empty() || !rr.is_empty();
        let (na, nr) = self.node_ports.changes();
        self.node_ports_changed |= !na.is_empty() || !nr.is_empty();
        for s in programs.iter_mut() {
            note(s.change_frontends(&fa, &fr));
            note(s.change_endpoints(&ea, &er));
            note(s.change_cluster_ips(&ca, &cr));
        }
        GoneUdp {
            endpoints: self.udp.changes().1,
            frontends: self.udp_frontends.changes().1,
        }
    }
}

impl Drop for Dataplane {
    fn drop(&mut self) {
        let keep = self.links.keep;
        self.shutdown(keep);
    }
}

pub use crate::statefile::remove_state;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_choice_seeds_come_from_the_os() {
        // Two draws of 64 random bits are equal once in 2^64: a fixed seed would be.
        assert_ne!(os_seed(), os_seed());
    }

    #[test]
    fn counted_keys_appear_once_and_vanish_with_their_last_claim() {
        let mut c = Counted::<u32>::default();
        c.bump(7, 1);
        c.bump(7, 1);
        assert_eq!(c.changes(), (vec![7], vec![]));
        c.bump(7, -1);
        assert_eq!(c.changes(), (vec![], vec![]));
        c.bump(7, -1);
        assert_eq!(c.changes(), (vec![], vec![7]));
    }
}
