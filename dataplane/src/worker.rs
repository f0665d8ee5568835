//! A poll-mode worker: one thread, pinned, owning the AF_XDP sockets of one queue on every
//! attached interface, its connection table and its counters.
//!
//! Per iteration: load the current snapshot once (an `ArcSwap` load: no lock, no wait for
//! the control plane), take packets handed over by other workers, receive a batch from
//! each port, process every packet through the [`Engine`], route what it forwards with
//! the FIB mirror, transmit, recycle, and expire a few conntrack entries. With nothing to
//! do it spins briefly, then sleeps in `poll()` with a growing timeout, so an idle worker
//! does not starve the rest of a small machine.
//!
//! Packets of a flow another worker owns are copied to that worker's inbox (a lock-free
//! `ArrayQueue`) and counted: ownership follows the flow's client side, the address and
//! port both directions carry (the client's own, or the SNAT address and a port the owner
//! allocated so that it maps back to it: see [`conntrack::flow_owner`]).

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use arc_swap::ArcSwap;
use crossbeam::queue::ArrayQueue;
use nat::rewrite::{self, Parsed};
use nat::snapshot::Snapshot;
use nat::tuple::Tuple;

use crate::fib::{FibView, Route};
use crate::servicedev::{HANDOVER_MAC, HANDOVER_MASQ_MAC};
use crate::xsk::{Frame, WorkerIo};
use engine::{DropCause, Engine, Handover, Ingress, MasqueradeSource, Prepared, Verdict};

/// From how many tracked flows a worker warms the cache for each received batch
/// ([`Worker::warm`]): below, the table's lines (half a MiB of entries and as much of
/// index buckets) stay in a core's cache, and warming would only cost its hashing and
/// probing. Above, they do not reliably: with 10,240 flows (the macro benchmark's 10k
/// Services case, 2.6 MiB of lines) `find` took 10-11.5% of the worker's CPU unwarmed
/// and 1% warmed (`warm` 3%). It was 32,768 until 2026-12-03.
const WARM_FROM: usize = 4_096;

const ETH_HLEN: usize = 14;
/// Busy time over which the loop's drain rate is measured.
const DRAIN_WINDOW_NS: u64 = 2_000_000;
/// How long a pause of the worker's CPU the fill rings hold what arrives in, below
/// saturation (see [`crate::xsk::WorkerIo::hold_for`]): kernel threads were measured
/// taking a poll-mode worker's CPU for up to 12 ms (`perf sched`, bench/HISTORY.md).
const PAUSE_HOLD_NS: u64 = 16_000_000;
/// The share of a window's time in busy rounds from which the worker counts as near
/// the bottleneck (see [`keeps_up`]).
const SATURATED_BUSY: f64 = 0.75;
/// The most packets a busy round takes on average, over a drain window, for the worker
/// to count as keeping up with its traffic (see [`keeps_up`]).
const HOLD_MAX_BATCH: u64 = 8;
/// The share of a window's time in busy rounds below which the worker keeps up with its
/// traffic whatever the size of its batches (see [`keeps_up`]).
const SPARE_BUSY: f64 = 0.5;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const ETH_P_IPV6: u16 = 0x86DD;

/// A packet copied to another worker: to the one that owns its flow (to process it), or,
/// already processed, to one that has a socket on the interface it must leave by (worker
/// 0 has one on every attached interface: every interface has a queue 0, while a pod's
/// veth usually has only that one).
#[derive(Debug)]
pub struct Handoff {
    pub frame: Vec<u8>,
    /// Where it arrived (to process) or where it must leave (to transmit).
    pub ifindex: u32,
    pub transmit: bool,
    /// The VLAN id it arrived with (its tag already taken off; 0: untagged).
    pub vlan: u16,
}

/// A request from the control plane to a worker.
pub enum Command {
    /// Remove UDP flows to an endpoint that went away (kube-proxy's conntrack cleanup).
    RemoveUdpTo(IpAddr, u16),
    /// Send back a description of every flow `filter` accepts (for `kxp conntrack
    /// list`), or remove them and send back how many (`delete`).
    Flows {
        filter: FlowFilter,
        delete: bool,
        reply: crossbeam::channel::Sender<(Vec<FlowInfo>, usize)>,
    },
    /// Send back the connection table's counters.
    TableStats(crossbeam::channel::Sender<TableStats>),
    /// The kernel's statistics of each of this worker's sockets (interface name, stats).
    SocketStats(crossbeam::channel::Sender<Vec<(String, crate::xsk::PortStats)>>),
    /// Send back the live flows, packets and bytes per endpoint (for `kxp service list`).
    EndpointCounts(crossbeam::channel::Sender<EndpointMap>),
    /// Open a socket on a newly attached interface at its receive queue `queue` (one of
    /// those this worker serves) and send back its descriptor (for the interface's
    /// XSKMAP) or why it failed.
    AddPort {
        ifname: String,
        ifindex: u32,
        queue: u32,
        /// The socket's descriptor, whether it is in zero-copy mode, and its TX budget
        /// per sendto() ([`crate::xsk::WorkerIo::tx_budget`]).
        reply: crossbeam::channel::Sender<
            Result<(std::os::fd::RawFd, bool, u32), crate::xsk::XskError>,
        >,
    },
    /// Close the socket on an interface that went away (or no longer matches), taking
    /// back the frames its rings held; answers when done.
    RemovePort {
        ifindex: u32,
        reply: crossbeam::channel::Sender<bool>,
    },
    /// Send back copies of the UMEM's and the sockets' descriptors, for a newer kxp to
    /// map ahead of a hand-over (see [`crate::xsk::Lent`]); forwarding goes on.
    Lend(crossbeam::channel::Sender<Result<crate::xsk::Lent, crate::xsk::XskError>>),
}

/// Per (endpoint, protocol): its flows now, and the packets and bytes of its flows.
pub type EndpointMap =
    std::collections::HashMap<(std::net::SocketAddr, nat::Protocol), EndpointTotals>;

/// One endpoint's flows now, and packets and bytes (both directions) of every flow to it
/// since kxp started (gone ones included, restored ones from their restoration).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndpointTotals {
    pub flows: u64,
    pub packets: u64,
    pub bytes: u64,
}

/// Endpoints whose gone flows' totals a worker remembers before it forgets those no
/// longer in any Service.
const RETIRED_MAX: usize = 65_536;

/// The expiry clock hand goes over a worker's whole table once a second, however fast
/// the loop turns, and at most `EXPIRE_MAX_PER_ROUND` slots in one poll round.
const EXPIRE_SWEEP_NS: u64 = 1_000_000_000;
const EXPIRE_MAX_PER_ROUND: usize = 256;

/// Where a packet came from, as the worker knows it.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    /// The interface it arrived on.
    ifindex: u32,
    /// Its VLAN id (0: untagged; before [`Worker::receive`], the one another worker took
    /// off a packet it handed over).
    vlan: u16,
    /// Handed over by the worker that received it: this one owns its flow.
    handed: bool,
}

/// What a round of the worker's loop gives every packet it handles.
struct Round<'r> {
    /// The snapshot loaded for the round.
    snap: &'r Snapshot,
    /// The round's clock.
    now: u64,
    /// How many workers the node has (to find a flow's owner).
    workers: usize,
}

/// Where a forwarded packet goes, and how its sender is answered should it not fit the
/// next link.
#[derive(Debug, Clone, Copy)]
struct Out {
    dst: IpAddr,
    /// Its tuple as it arrived (before translation), to quote in a "too big" answer.
    from: Option<Tuple>,
    /// The VLAN it leaves on (0: untagged).
    vlan: u16,
    /// The VLAN it came from: a "too big" answer goes back on it.
    back: u16,
}

/// The loop's buffers, made once.
struct Buffers<'id> {
    batch: Vec<Frame<'id>>,
    keys: Vec<Tuple>,
    replies: Vec<Tuple>,
    /// The batch's packets as warming parsed them (one per frame, in order).
    parsed: Vec<Option<Warmed>>,
    /// Where the engine writes an answer (a REJECT, a "too big").
    answer: Vec<u8>,
}

impl Buffers<'_> {
    fn new() -> Self {
        Buffers {
            batch: Vec::with_capacity(crate::xsk::BATCH),
            keys: Vec::with_capacity(crate::xsk::BATCH),
            replies: Vec::with_capacity(crate::xsk::BATCH),
            parsed: Vec::with_capacity(crate::xsk::BATCH),
            answer: vec![0u8; 2048],
        }
    }
}

/// The loop's own clock and counts: when each part of the previous round ended (for the
/// parts of a stall), the busy rounds of the current drain window, idleness.
struct LoopClock {
    /// The previous round's start, and the packets it took.
    prev_start: u64,
    prev_work: usize,
    /// When the previous round had handled its packets, kicked the transmission and
    /// swept.
    handled: u64,
    sent: u64,
    swept: u64,
    /// The drain window: busy time, packets and rounds since `window_start`.
    busy_ns: u64,
    busy_packets: u64,
    busy_rounds: u64,
    window_start: u64,
    /// The previous round ended in a sleep (no traffic): the gap to this one is not a
    /// stall.
    slept: bool,
    iterations: u64,
    busy: u64,
    idle: u32,
    last_work: u64,
}

impl LoopClock {
    fn new(now: u64) -> Self {
        LoopClock {
            prev_start: now,
            prev_work: 0,
            handled: now,
            sent: now,
            swept: now,
            busy_ns: 0,
            busy_packets: 0,
            busy_rounds: 0,
            window_start: now,
            slept: true,
            iterations: 0,
            busy: 0,
            idle: 0,
            last_work: now,
        }
    }
}

/// A received packet as its batch's warming left it ([`Worker::warm`]): its parse, from
/// its bytes unchanged since, and for a likely new connection where it goes, chosen on
/// the round's snapshot ([`Engine::prepare_new`]).
#[derive(Debug, Clone, Copy)]
struct Warmed {
    flow: rewrite::FlowPacket,
    prepared: Option<Prepared>,
}

/// Which flows a [`Command::Flows`] is about (evaluated by each worker on its own table).
pub type FlowFilter = Arc<dyn Fn(&conntrack::Entry) -> bool + Send + Sync>;

/// One conntrack entry, for display.
#[derive(Debug, Clone)]
pub struct FlowInfo {
    pub worker: usize,
    pub orig: Tuple,
    pub reply: Tuple,
    pub state: conntrack::State,
    pub expires_in_ms: u64,
    /// Both directions, since this process tracked it.
    pub packets: u64,
    pub bytes: u64,
}

/// One worker's connection table, for `kxp conntrack stats`.
#[derive(Debug, Clone, Copy, Default)]
pub struct TableStats {
    pub worker: usize,
    pub entries: usize,
    pub capacity: usize,
    pub stats: conntrack::Stats,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::RemoveUdpTo(ip, port) => write!(f, "RemoveUdpTo({ip}, {port})"),
            Command::Flows { delete, .. } => write!(f, "Flows {{ delete: {delete} }}"),
            Command::TableStats(_) => f.write_str("TableStats"),
            Command::SocketStats(_) => f.write_str("SocketStats"),
            Command::EndpointCounts(_) => f.write_str("EndpointCounts"),
            Command::AddPort { ifname, queue, .. } => write!(f, "AddPort({ifname}, {queue})"),
            Command::RemovePort { ifindex, .. } => write!(f, "RemovePort({ifindex})"),
            Command::Lend(_) => f.write_str("Lend"),
        }
    }
}

/// Counters of one worker, written by it (Relaxed stores once per batch) and summed by
/// whoever scrapes.
#[derive(Debug, Default)]
pub struct WorkerStats {
    pub rx_packets: AtomicU64,
    pub rx_bytes: AtomicU64,
    /// Bytes of the packets forwarded (each counted once, by the worker that
    /// translated it).
    pub forwarded_bytes: AtomicU64,
    pub tx_packets: AtomicU64,
    pub forwarded: AtomicU64,
    pub new_flows: AtomicU64,
    pub rejected: AtomicU64,
    pub passed: AtomicU64,
    pub dropped: AtomicU64,
    pub neighbour_pending: AtomicU64,
    pub no_route: AtomicU64,
    pub handoffs_out: AtomicU64,
    pub handoffs_in: AtomicU64,
    pub handoff_full: AtomicU64,
    /// Packets too big for the next link: split into fragments, answered with an ICMP
    /// "too big", or dropped (no tuple to quote, no source address).
    pub fragmented_out: AtomicU64,
    pub too_big_icmp: AtomicU64,
    pub too_big_dropped: AtomicU64,
    /// Packets handed to the kernel (through the service device) to leave by an
    /// interface kxp does not drive.
    pub to_kernel: AtomicU64,
    /// Packets forwarded untranslated (passed) whose partial checksum kxp completed.
    pub pass_checksums_completed: AtomicU64,
    /// Packets handed to the kernel for the CNI's policy (`kxp.networkPolicy: kernel`).
    pub policy_handover: AtomicU64,
    /// Frames whose 802.1Q tag kxp took off (they came tagged on a trunk) and frames it
    /// tagged (going back to a client that came tagged).
    pub vlan_untagged: AtomicU64,
    pub vlan_tagged: AtomicU64,
    pub conntrack_entries: AtomicU64,
    pub conntrack_evictions: AtomicU64,
    pub conntrack_inserts: AtomicU64,
    pub busy_iterations: AtomicU64,
    pub iterations: AtomicU64,
    /// [`Stalls`] of the loop.
    pub stalls: AtomicU64,
    pub stalled_ns: AtomicU64,
    pub longest_stall_ns: AtomicU64,
    pub stall_parts: [AtomicU64; 4],
    pub snapshot_generation: AtomicU64,
    /// Drops by engine cause, `label=count` lines, refreshed every few batches.
    pub drop_detail: std::sync::Mutex<Vec<(&'static str, u64)>>,
}

/// What the workers share with the control plane.
#[derive(Debug)]
pub struct Shared {
    pub snapshot: ArcSwap<Snapshot>,
    pub stop: AtomicBool,
    pub stats: Vec<WorkerStats>,
    pub inbox: Vec<ArrayQueue<Handoff>>,
    pub commands: Vec<CommandSender>,
    /// Names of the attached interfaces by ifindex (for a packet handed over from an
    /// interface this worker has no socket on).
    pub attached: ArcSwap<Vec<(u32, String)>>,
    /// Translations of fragmented datagrams, shared: a datagram's first fragment goes to
    /// the worker that owns its flow, its other fragments (no ports) to whichever worker
    /// received them. Only fragments take this lock.
    pub frags: std::sync::Mutex<conntrack::FragTable>,
    /// The socket holder, which keeps a second reference to every socket (see
    /// [`crate::holder`]).
    pub holder: Option<crate::holder::SocketHolder>,
    /// The workers' sockets go to the next kxp when they stop (see [`HandOver`]).
    pub hand_over: HandOver,
}

/// Workers stopping to hand their sockets to the next kxp instead of closing them: each
/// puts its [`crate::xsk::Handed`] here as it ends.
#[derive(Debug, Default)]
pub struct HandOver {
    pub asked: AtomicBool,
    pub handed: std::sync::Mutex<Vec<(usize, crate::xsk::Handed)>>,
    /// Workers that have handed their sockets over (or failed to): the hand-over waits
    /// for these, not for the workers' ends (their teardown, the rings unmapped, comes
    /// after).
    pub answered: std::sync::atomic::AtomicUsize,
    /// When the last worker stopped forwarding (`CLOCK_MONOTONIC`, ns): the hand-over's
    /// pause starts there.
    pub stopped_ns: AtomicU64,
}

impl Shared {
    /// Has the holder, if any, keep a reference to each of `sockets`.
    fn hold(&self, sockets: &[(u32, u32, std::os::fd::BorrowedFd<'_>)]) {
        let Some(h) = &self.holder else { return };
        for (ifindex, queue, fd) in sockets {
            if let Err(e) = h.hold(crate::holder::key(*ifindex, *queue), *fd)
                && crate::logrl::global().allow("socket holder").is_some()
            {
                tracing::warn!("the socket holder cannot take a socket: {e}");
            }
        }
    }

    /// Has the holder, if any, drop its references to the sockets on `ifindex`'s
    /// `queues`.
    fn forget(&self, ifindex: u32, queues: &[u32]) {
        if let Some(h) = &self.holder {
            for &q in queues {
                let _ = h.forget(crate::holder::key(ifindex, q));
            }
        }
    }
}

/// A worker's command channel, which also wakes the worker if it sleeps.
#[derive(Debug, Clone)]
pub struct CommandSender {
    tx: crossbeam::channel::Sender<Command>,
    wake: Arc<crate::sys::Wake>,
}

impl CommandSender {
    pub fn new(tx: crossbeam::channel::Sender<Command>, wake: Arc<crate::sys::Wake>) -> Self {
        CommandSender { tx, wake }
    }

    /// Sends `cmd` and wakes the worker.
    ///
    /// # Errors
    /// The worker is gone.
    pub fn send(&self, cmd: Command) -> Result<(), crossbeam::channel::SendError<Command>> {
        self.tx.send(cmd)?;
        self.wake.ring();
        Ok(())
    }

    /// What the worker polls (and clears) to be woken.
    pub fn wake(&self) -> &crate::sys::Wake {
        &self.wake
    }
}

impl Shared {
    /// Sends every worker the command `make` builds around a reply channel and collects
    /// the answers; a worker that does not answer within `timeout` is left out.
    fn ask_all<T>(
        &self,
        make: impl Fn(crossbeam::channel::Sender<T>) -> Command,
        timeout: std::time::Duration,
    ) -> Vec<T> {
        let replies: Vec<_> = self
            .commands
            .iter()
            .filter_map(|tx| {
                let (rtx, rrx) = crossbeam::channel::bounded(1);
                tx.send(make(rtx)).ok().map(|()| rrx)
            })
            .collect();
        replies
            .into_iter()
            .filter_map(|r| r.recv_timeout(timeout).ok())
            .collect()
    }

    /// Every worker's UMEM and sockets, lent for a newer kxp to map ahead of a hand-over
    /// ([`Command::Lend`]), in worker order; `None` if a worker did not answer within
    /// `timeout` or could not lend them.
    pub fn lend(&self, timeout: std::time::Duration) -> Option<Vec<crate::xsk::Lent>> {
        let lent = self.ask_all(Command::Lend, timeout);
        if lent.len() != self.commands.len() {
            return None;
        }
        lent.into_iter().collect::<Result<_, _>>().ok()
    }

    /// The flows of every worker that `filter` accepts (or, with `delete`, removes them):
    /// the flows and how many.
    pub fn flows(
        &self,
        filter: FlowFilter,
        delete: bool,
        timeout: std::time::Duration,
    ) -> (Vec<FlowInfo>, usize) {
        let answers = self.ask_all(
            |reply| Command::Flows {
                filter: filter.clone(),
                delete,
                reply,
            },
            timeout,
        );
        let n = answers.iter().map(|(_, k)| k).sum();
        (answers.into_iter().flat_map(|(v, _)| v).collect(), n)
    }

    /// Live flows, packets and bytes per endpoint, all workers (counted where they are,
    /// not moved).
    pub fn endpoint_totals(&self, timeout: std::time::Duration) -> EndpointMap {
        let mut all = EndpointMap::new();
        for m in self.ask_all(Command::EndpointCounts, timeout) {
            for (k, t) in m {
                let a = all.entry(k).or_default();
                a.flows += t.flows;
                a.packets += t.packets;
                a.bytes += t.bytes;
            }
        }
        all
    }

    /// Every worker's connection-table counters.
    pub fn table_stats(&self, timeout: std::time::Duration) -> Vec<TableStats> {
        self.ask_all(Command::TableStats, timeout)
    }

    /// The statistics of worker `worker`'s sockets, one per (interface, queue) it serves;
    /// `None` if it did not answer in `timeout`.
    pub fn socket_stats_of(
        &self,
        worker: usize,
        timeout: std::time::Duration,
    ) -> Option<Vec<(String, crate::xsk::PortStats)>> {
        let (rtx, rrx) = crossbeam::channel::bounded(1);
        self.commands
            .get(worker)?
            .send(Command::SocketStats(rtx))
            .ok()?;
        rrx.recv_timeout(timeout).ok()
    }

    /// The statistics of every worker's sockets, one per (interface, queue).
    pub fn socket_stats_per_queue(
        &self,
        timeout: std::time::Duration,
    ) -> Vec<(String, crate::xsk::PortStats)> {
        self.ask_all(Command::SocketStats, timeout)
            .into_iter()
            .flatten()
            .collect()
    }

    /// The kernel's statistics of every worker's sockets, summed per interface.
    pub fn socket_stats(
        &self,
        timeout: std::time::Duration,
    ) -> Vec<(String, crate::xsk::PortStats)> {
        let mut sum: Vec<(String, crate::xsk::PortStats)> = Vec::new();
        for (ifname, st) in self
            .ask_all(Command::SocketStats, timeout)
            .into_iter()
            .flatten()
        {
            match sum.iter_mut().find(|(n, _)| *n == ifname) {
                Some((_, a)) => {
                    a.rx_dropped += st.rx_dropped;
                    a.rx_ring_full += st.rx_ring_full;
                    a.rx_fill_ring_empty += st.rx_fill_ring_empty;
                    a.tx_invalid += st.tx_invalid;
                    a.tx_ring_empty += st.tx_ring_empty;
                    a.rx_packets += st.rx_packets;
                }
                None => sum.push((ifname, st)),
            }
        }
        sum
    }
}

/// Everything a worker thread needs.
#[derive(Debug)]
pub struct Worker<'id> {
    pub id: usize,
    pub cpu: Option<usize>,
    pub io: WorkerIo<'id>,
    pub engine: Engine,
    pub fib: FibView,
    pub shared: Arc<Shared>,
    pub commands: crossbeam::channel::Receiver<Command>,
    /// The interface each port's packets arrive on at layer 3 (for interface-based
    /// local-traffic detection): its bridge or bond for a port of one (kube-proxy's
    /// `iifname` is the bridge's, for `detectLocalMode: BridgeInterface`), else its own.
    pub port_names: Vec<String>,
    /// The FIB mirror's generation `port_names` was made at (a port joins a bridge
    /// after kxp attached it: a CNI enslaves a pod's veth once it exists).
    names_fib_generation: u64,
    /// The ports changed: poll on the new set of sockets.
    ports_changed: bool,
    /// How to hand a packet to the node's own stack (kxp's service device).
    pub local_delivery: Option<LocalDelivery>,
    /// `kxp.networkPolicy: kernel`: translated packets for this node's pods go to the
    /// kernel this way (the service device, from [`HANDOVER_MAC`]), which forwards them
    /// to the pod through the node's netfilter, where the CNI filters them.
    pub handover: Option<LocalDelivery>,
    /// Packets waiting for their next hop's MAC (destination, since when).
    waiting: std::collections::VecDeque<(Frame<'id>, IpAddr, u16, u64)>,
    /// The loop's clock, for `waiting`.
    now: u64,
    /// Kick the sockets' receive processing every iteration (preferred busy polling).
    pub busy_poll: bool,
    /// How long to keep polling after the last packet before sleeping (see
    /// [`crate::xsk::XskConfig::idle_spin_us`]).
    pub idle_spin_ns: u64,
    /// The longest a packet should wait in the rings at saturation (see
    /// [`crate::xsk::XskConfig::queue_budget_us`]); 0: unbounded.
    pub queue_budget_ns: u64,
    /// Nanoseconds per packet of the loop, as last measured (0: not yet).
    pub drain_ns_per_packet: f64,
    /// Where the connection table's changes go for the next process (see
    /// [`crate::statefile`]).
    pub journal: Option<crate::statefile::StateFile>,
    local: Local,
}

/// The dataplane side of kxp's service device: a packet for a node address (the answer
/// to one of the node's own connections, or a connection to a hostNetwork endpoint) is
/// sent there, to the host side's MAC, and the node receives it on the host side.
/// A fragment table tag's bits: the datagram goes to the kernel for the CNI's policy,
/// and is masqueraded there (below them, the VLAN id).
const FRAG_HANDOVER: u16 = 0x8000;
const FRAG_HANDOVER_MASQ: u16 = 0x4000;

#[derive(Debug, Clone, Copy)]
pub struct LocalDelivery {
    pub ifindex: u32,
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
}

/// Counters the worker keeps as plain integers and publishes once per few batches.
#[derive(Debug, Default, Clone, Copy)]
struct Local {
    rx_packets: u64,
    rx_bytes: u64,
    tx_packets: u64,
    handoffs_out: u64,
    handoffs_in: u64,
    handoff_full: u64,
    neighbour_pending: u64,
    no_route: u64,
    fragmented_out: u64,
    too_big_icmp: u64,
    too_big_dropped: u64,
    to_kernel: u64,
    pass_checksums_completed: u64,
    vlan_untagged: u64,
    vlan_tagged: u64,
    policy_handover: u64,
    stalls: Stalls,
}

/// Gaps between two rounds of a worker's loop that did not sleep in between, longer than
/// [`Stalls::MIN_NS`]: the worker's CPU was taken (another task, a kernel thread, the
/// hypervisor) or one of its own rounds ran long, and what arrived meanwhile waited in
/// the rings, or was dropped once they were full.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stalls {
    /// How many.
    pub count: u64,
    /// Their total length.
    pub total_ns: u64,
    /// The longest.
    pub longest_ns: u64,
    /// How many stalls each part of the round was the longest part of, in
    /// [`Stalls::PARTS`] order.
    pub by_part: [u64; 4],
}

impl Stalls {
    /// Shorter gaps are a round's work: a batch of 64 takes tens of microseconds.
    pub const MIN_NS: u64 = 1_000_000;

    /// The parts of a round a stall is put down to: receiving and handling the packets
    /// (handed-over ones included), writing the journal and the transmit kick (in copy
    /// mode the kernel delivers the frames inside it), the expiry and affinity sweeps,
    /// and the rest until the next round (the loop's own bookkeeping, or its CPU taken
    /// away).
    pub const PARTS: [&str; 4] = ["packets", "transmit", "expiry", "between"];

    /// One gap between two rounds' starts, `parts` its lengths by [`Stalls::PARTS`].
    pub fn note(&mut self, gap_ns: u64, parts: [u64; 4]) {
        if gap_ns >= Self::MIN_NS {
            self.count += 1;
            self.total_ns += gap_ns;
            self.longest_ns = self.longest_ns.max(gap_ns);
            let longest = (0..4).max_by_key(|&i| parts[i]).unwrap_or(3);
            self.by_part[longest] += 1;
        }
    }
}

struct FibSource<'a>(&'a FibView);

impl MasqueradeSource for FibSource<'_> {
    fn source_for(&self, endpoint: IpAddr) -> Option<IpAddr> {
        self.0.source_for(endpoint)
    }
}

impl<'id> Worker<'id> {
    /// What the worker sleeps on: its sockets, and the eventfd that a command rings.
    fn poll_fds(&self) -> Vec<std::os::fd::RawFd> {
        let mut fds = self.io.fds();
        if let Some(c) = self.shared.commands.get(self.id) {
            fds.push(c.wake().fd());
        }
        fds
    }

    /// A worker for queue `id`; `io` holds its sockets (more come and go by
    /// [`Command::AddPort`] and [`Command::RemovePort`]).
    pub fn new(
        id: usize,
        cpu: Option<usize>,
        io: WorkerIo<'id>,
        engine: Engine,
        fib: FibView,
        shared: Arc<Shared>,
        commands: crossbeam::channel::Receiver<Command>,
    ) -> Worker<'id> {
        let mut w = Worker {
            id,
            cpu,
            io,
            engine,
            fib,
            shared,
            commands,
            port_names: Vec::new(),
            names_fib_generation: 0,
            ports_changed: false,
            local_delivery: None,
            handover: None,
            waiting: std::collections::VecDeque::new(),
            now: 0,
            busy_poll: false,
            idle_spin_ns: 0,
            queue_budget_ns: 0,
            drain_ns_per_packet: 0.0,
            journal: None,
            local: Local::default(),
        };
        w.name_ports();
        w.shared.hold(&w.io.sockets());
        w
    }

    /// Names each port by the interface its packets arrive on at layer 3 (see
    /// `port_names`), as the FIB mirror has the links now.
    fn name_ports(&mut self) {
        self.names_fib_generation = self.fib.generation();
        self.port_names = (0..self.io.port_count())
            .map(|p| {
                self.fib
                    .master_name(self.io.ifindex(p))
                    .unwrap_or_else(|| self.io.ifname(p).to_string())
            })
            .collect();
    }

    /// Runs until `shared.stop` is set: each round takes the current snapshot, hands
    /// out commands, handles the packets other workers handed over and those its
    /// sockets received, writes the journal, sends, expires flows, then spins, or sleeps
    /// when there has been no traffic for a while.
    pub fn run(mut self) {
        if let Some(cpu) = self.cpu
            && let Err(e) = crate::sys::pin_to_cpu(cpu)
        {
            tracing::warn!("worker {}: cannot pin to CPU {cpu}: {e}", self.id);
        }
        let mut fds = self.poll_fds();
        let mut bufs = Buffers::new();
        let mut clock = LoopClock::new(crate::sys::monotonic_ns());
        let workers = self.shared.stats.len();
        let mut generation = 0;
        while !self.shared.stop.load(Ordering::Relaxed) {
            let snap = self.shared.snapshot.load();
            if snap.generation != generation {
                generation = snap.generation;
                self.on_new_snapshot(&snap);
            }
            let now = crate::sys::monotonic_ns();
            self.now = now;
            self.round_starts(&mut clock, now);
            if !self.waiting.is_empty() {
                self.retry_waiting();
            }
            while let Ok(cmd) = self.commands.try_recv() {
                self.command(cmd, now);
            }
            if self.ports_changed {
                self.ports_changed = false;
                fds = self.poll_fds();
                self.name_ports();
            } else if self.fib.generation() != self.names_fib_generation {
                // A port may have joined or left a bridge.
                self.name_ports();
            }
            let round = Round {
                snap: &snap,
                now,
                workers,
            };
            let mut work = self.handle_inbox(&round, &mut bufs.answer);
            if self.busy_poll {
                self.io.busy_poll_kick();
            }
            // `kxp run` starts the dataplane with an empty snapshot (generation 0) and
            // publishes the cluster's state once the node's addresses are known: until
            // then what the sockets receive (the previous kxp's steering still sends
            // its Services' packets, into sockets it handed over) waits in the rings,
            // instead of being taken for traffic to no Service.
            if snap.generation != 0 {
                work += self.handle_received(&round, &mut bufs);
            }
            clock.handled = crate::sys::monotonic_ns();
            // Every flow a packet of this batch created or changed is in the state file
            // before the packet leaves (the transmit kick below).
            self.write_journal();
            self.io.flush();
            clock.sent = crate::sys::monotonic_ns();
            self.engine
                .table
                .expire_paced(now, EXPIRE_SWEEP_NS, EXPIRE_MAX_PER_ROUND);
            if clock.iterations.is_multiple_of(64) {
                self.engine.node.affinity.sweep(now, 64);
            }
            clock.swept = crate::sys::monotonic_ns();
            self.round_ends(&mut clock, now, work, &fds);
            if clock.iterations.is_multiple_of(256) || clock.idle == 65 {
                self.publish(clock.iterations, clock.busy, snap.generation);
            }
        }
        self.write_journal();
        self.publish(clock.iterations, clock.busy, 0);
        if self.shared.hand_over.asked.load(Ordering::Relaxed) {
            self.hand_sockets_over();
            return;
        }
        if self.shared.holder.is_some() {
            // The holder's references are the last: its exit releases them, in parallel
            // (Dataplane::shutdown finishes it once every worker is done).
            drop(self);
            return;
        }
        // The sockets' releases overlapped (see crate::xsk::close_in_parallel).
        let copies = self.io.socket_copies();
        drop(self);
        crate::xsk::close_in_parallel(copies);
    }

    /// Gives back the frames the worker holds (packets waiting for a neighbour) and
    /// hands its sockets over (see [`HandOver`]); on failure they are closed as at a
    /// stop, and the next kxp opens its own.
    fn hand_sockets_over(mut self) {
        (self.shared.hand_over.stopped_ns).fetch_max(crate::sys::monotonic_ns(), Ordering::Relaxed);
        for (f, ..) in std::mem::take(&mut self.waiting) {
            self.io.recycle(f);
        }
        let (id, shared) = (self.id, self.shared.clone());
        match self.io.hand_over() {
            Ok(h) => shared
                .hand_over
                .handed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((id, h)),
            Err(e) => tracing::warn!("worker {id}: cannot hand its sockets over: {e}"),
        }
        shared.hand_over.answered.fetch_add(1, Ordering::Release);
        // The rest of this worker (its rings unmapped, its table freed) goes after, off
        // this CPU (where the next kxp starts now: where kxp's other threads run), at the
        // other threads' priority. Not lower: unmapping holds the process's mmap lock,
        // which every other thread's page faults and allocations wait for (a thread at
        // nice 19 or SCHED_IDLE holding it on a busy CPU stalled this kxp for seconds).
        if let Ok(rest) = crate::sys::affinity(std::process::id() as libc::pid_t) {
            let _ = crate::sys::set_affinity(0, &rest);
        }
        let _ = crate::sys::set_nice(0, 0);
        drop(self);
    }

    /// A new snapshot: the connection table's totals of endpoints no Service has any
    /// more pruned (when many are kept), and room made for those of every endpoint now
    /// in a Service.
    fn on_new_snapshot(&mut self, snap: &Snapshot) {
        if self.engine.table.retired_len() > RETIRED_MAX {
            let live: std::collections::HashSet<(std::net::SocketAddr, nat::Protocol)> = snap
                .ports()
                .flat_map(|sp| sp.endpoints.iter().map(|e| (e.addr, sp.name.protocol)))
                .collect();
            self.engine
                .table
                .prune_retired(|ep, p| live.contains(&(*ep, p)));
        }
        // Room for the totals of every endpoint now in a Service, made here and
        // not when a flow to a new endpoint goes: growing a map of tens of
        // thousands of endpoints rehashes it, milliseconds on the packet path.
        let endpoints: usize = snap.ports().map(|sp| sp.endpoints.len()).sum();
        self.engine
            .table
            .reserve_retired(endpoints.min(RETIRED_MAX));
    }

    /// The start of a round at `now`: the gap since the previous one noted as a stall
    /// (unless the loop slept), and the drain rate measured over a window of busy rounds.
    fn round_starts(&mut self, clock: &mut LoopClock, now: u64) {
        if !clock.slept {
            let parts = [
                clock.handled.saturating_sub(clock.prev_start),
                clock.sent.saturating_sub(clock.handled),
                clock.swept.saturating_sub(clock.sent),
                now.saturating_sub(clock.swept),
            ];
            self.local
                .stalls
                .note(now.saturating_sub(clock.prev_start), parts);
        }
        clock.slept = false;
        if clock.prev_work > 0 {
            clock.busy_ns += now.saturating_sub(clock.prev_start);
            clock.busy_packets += clock.prev_work as u64;
            clock.busy_rounds += 1;
            if clock.busy_ns >= DRAIN_WINDOW_NS {
                let wall = now.saturating_sub(clock.window_start);
                self.drain_measured(clock.busy_ns, clock.busy_packets, clock.busy_rounds, wall);
                self.io.hold_for(wall, PAUSE_HOLD_NS);
                (clock.busy_ns, clock.busy_packets, clock.busy_rounds) = (0, 0, 0);
                clock.window_start = now;
            }
        }
        clock.prev_start = now;
    }

    /// The end of a round that handled `work` packets: after a while without traffic,
    /// back off into a sleep an arriving packet (or command) wakes.
    fn round_ends(
        &mut self,
        clock: &mut LoopClock,
        now: u64,
        work: usize,
        fds: &[std::os::fd::RawFd],
    ) {
        clock.iterations += 1;
        clock.prev_work = work;
        if work > 0 {
            clock.busy += 1;
            clock.idle = 0;
            clock.last_work = now;
            return;
        }
        clock.idle = clock.idle.saturating_add(1);
        if clock.idle > 64 && now.saturating_sub(clock.last_work) > self.idle_spin_ns {
            // Back off: 1 ms, doubling to 16 ms; an arriving packet wakes us.
            let ms = if self.waiting.is_empty() {
                1i32 << ((clock.idle - 64) / 64).min(4)
            } else {
                1 // a neighbour being resolved: look again soon
            };
            crate::sys::poll_readable(fds, ms);
            if let Some(c) = self.shared.commands.get(self.id) {
                c.wake().clear();
            }
            clock.slept = true;
        } else {
            std::hint::spin_loop();
        }
    }

    /// The packets other workers handed over (up to 256): those to send out of an
    /// interface of this worker, and those of flows it owns. How many there were.
    fn handle_inbox(&mut self, round: &Round<'_>, answer: &mut [u8]) -> usize {
        let mut work = 0;
        for _ in 0..256 {
            let Some(h) = self.shared.inbox[self.id].pop() else {
                break;
            };
            work += 1;
            self.local.handoffs_in += 1;
            let Some(mut f) = self.io.frame_from(&h.frame) else {
                break;
            };
            if h.transmit {
                match self.io.port_of(h.ifindex) {
                    Some(port) => {
                        self.local.tx_packets += 1;
                        self.io.send(port, f);
                    }
                    None => {
                        self.local.no_route += 1;
                        self.io.recycle(f);
                    }
                }
                continue;
            }
            f.port = self.io.port_of(h.ifindex).unwrap_or(usize::MAX);
            let at = Arrival {
                ifindex: h.ifindex,
                vlan: h.vlan,
                handed: true,
            };
            self.handle(f, at, round, answer, None);
        }
        work
    }

    /// A batch from each port's socket, prefetched, warmed and handled. How many
    /// packets there were.
    fn handle_received(&mut self, round: &Round<'_>, bufs: &mut Buffers<'id>) -> usize {
        let mut work = 0;
        for port in 0..self.io.port_count() {
            bufs.batch.clear();
            let n = self.io.recv(port, &mut bufs.batch);
            work += n;
            if n > 1 {
                self.prefetch_frames(&mut bufs.batch);
            }
            let ifindex = self.io.ifindex(port);
            bufs.parsed.clear();
            if n > 1 && self.engine.table.len() >= WARM_FROM {
                self.warm(
                    &mut bufs.batch,
                    port,
                    round.snap,
                    &mut bufs.keys,
                    &mut bufs.replies,
                    &mut bufs.parsed,
                );
            }
            let at = Arrival {
                ifindex,
                vlan: 0,
                handed: false,
            };
            for (i, f) in bufs.batch.drain(..).enumerate() {
                let pre = bufs.parsed.get(i).copied().flatten();
                self.handle(f, at, round, &mut bufs.answer, pre);
            }
        }
        work
    }

    /// A window of `rounds` busy rounds took `ns` for `packets`, in `wall_ns`. While
    /// the worker keeps up with its traffic ([`keeps_up`]), the fill rings are bounded
    /// only by the UMEM's share: a pause of the worker's CPU builds a queue that drains
    /// once it is back, and the rings hold it (`hold_for`). Otherwise the worker is, or
    /// is near, the bottleneck, and the fill rings are bounded to what the loop drains
    /// within the queue budget at its pace: the interface drops the rest instead of
    /// queueing it.
    fn drain_measured(&mut self, ns: u64, packets: u64, rounds: u64, wall_ns: u64) {
        let per = ns as f64 / packets.max(1) as f64;
        self.drain_ns_per_packet = if self.drain_ns_per_packet == 0.0 {
            per
        } else {
            0.75 * self.drain_ns_per_packet + 0.25 * per
        };
        if self.queue_budget_ns > 0 {
            let frames = if keeps_up(ns, packets, rounds, wall_ns) {
                usize::MAX
            } else {
                (self.queue_budget_ns as f64 / self.drain_ns_per_packet) as usize
            };
            self.io.set_fill_limit(frames);
        }
    }

    fn write_journal(&mut self) {
        if let Some(j) = &self.journal {
            self.engine.table.drain_journal(|slot, rec| {
                j.write(
                    slot,
                    &rec.map_or(conntrack::persist::CLEARED, |r| r.encode()),
                );
            });
        }
    }

    fn publish(&self, iterations: u64, busy: u64, generation: u64) {
        let s = &self.shared.stats[self.id];
        let l = self.local;
        // The verdicts first, the packets received last (Release, paired with the
        // Acquire load of `rx_packets` in a reader that reads it before the verdicts):
        // a reader that sees a round's packets sees their verdicts too.
        let c = &self.engine.counters;
        s.forwarded.store(c.forwarded, Ordering::Relaxed);
        s.forwarded_bytes
            .store(c.forwarded_bytes, Ordering::Relaxed);
        s.new_flows.store(c.new_flows, Ordering::Relaxed);
        s.rejected.store(c.rejected, Ordering::Relaxed);
        s.passed.store(c.passed, Ordering::Relaxed);
        s.dropped.store(c.dropped(), Ordering::Relaxed);
        for (a, v) in [
            (&s.rx_bytes, l.rx_bytes),
            (&s.tx_packets, l.tx_packets),
            (&s.handoffs_out, l.handoffs_out),
            (&s.handoffs_in, l.handoffs_in),
            (&s.handoff_full, l.handoff_full),
            (&s.neighbour_pending, l.neighbour_pending),
            (&s.no_route, l.no_route),
            (&s.fragmented_out, l.fragmented_out),
            (&s.too_big_icmp, l.too_big_icmp),
            (&s.too_big_dropped, l.too_big_dropped),
            (&s.to_kernel, l.to_kernel),
            (&s.pass_checksums_completed, l.pass_checksums_completed),
            (&s.vlan_untagged, l.vlan_untagged),
            (&s.vlan_tagged, l.vlan_tagged),
            (&s.policy_handover, l.policy_handover),
        ] {
            a.store(v, Ordering::Relaxed);
        }
        s.rx_packets.store(l.rx_packets, Ordering::Release);
        s.conntrack_entries
            .store(self.engine.table.len() as u64, Ordering::Relaxed);
        let st = self.engine.table.stats();
        s.conntrack_evictions.store(st.evictions, Ordering::Relaxed);
        s.conntrack_inserts.store(st.inserts, Ordering::Relaxed);
        s.iterations.store(iterations, Ordering::Relaxed);
        s.busy_iterations.store(busy, Ordering::Relaxed);
        s.stalls.store(l.stalls.count, Ordering::Relaxed);
        s.stalled_ns.store(l.stalls.total_ns, Ordering::Relaxed);
        s.longest_stall_ns
            .store(l.stalls.longest_ns, Ordering::Relaxed);
        for (a, v) in s.stall_parts.iter().zip(l.stalls.by_part) {
            a.store(v, Ordering::Relaxed);
        }
        if generation != 0 {
            s.snapshot_generation.store(generation, Ordering::Relaxed);
        }
        if let Ok(mut d) = s.drop_detail.try_lock() {
            d.clear();
            d.extend(c.drops.iter().map(|(k, v)| (k.label(), *v)));
        }
    }

    fn command(&mut self, cmd: Command, now: u64) {
        match cmd {
            Command::RemoveUdpTo(ip, port) => {
                self.engine.table.remove_udp_to_endpoint(ip, port);
            }
            Command::Flows {
                filter,
                delete,
                reply,
            } => {
                if delete {
                    let n = self
                        .engine
                        .table
                        .remove_if(|e| !e.is_expired(now) && filter(e));
                    let _ = reply.send((Vec::new(), n));
                } else {
                    let flows: Vec<FlowInfo> = self
                        .engine
                        .table
                        .iter(now)
                        .filter(|e| filter(e))
                        .map(|e| FlowInfo {
                            worker: self.id,
                            orig: *e.orig(),
                            reply: *e.reply(),
                            state: e.state(),
                            expires_in_ms: e.remaining(now) / 1_000_000,
                            packets: e.packets(),
                            bytes: e.bytes(),
                        })
                        .collect();
                    let n = flows.len();
                    let _ = reply.send((flows, n));
                }
            }
            Command::EndpointCounts(reply) => {
                let m: EndpointMap = self
                    .engine
                    .table
                    .endpoint_counts(now)
                    .into_iter()
                    .map(|(k, (flows, c))| {
                        (
                            k,
                            EndpointTotals {
                                flows,
                                packets: c.packets,
                                bytes: c.bytes,
                            },
                        )
                    })
                    .collect();
                let _ = reply.send(m);
            }
            Command::Lend(reply) => {
                let _ = reply.send(self.io.lend());
            }
            Command::SocketStats(reply) => {
                let v = (0..self.io.port_count())
                    .map(|p| (self.io.ifname(p).to_string(), self.io.stats(p)))
                    .collect();
                let _ = reply.send(v);
            }
            Command::TableStats(reply) => {
                let t = &self.engine.table;
                let _ = reply.send(TableStats {
                    worker: self.id,
                    entries: t.len(),
                    capacity: t.capacity(),
                    stats: *t.stats(),
                });
            }
            Command::AddPort {
                ifname,
                ifindex,
                queue,
                reply,
            } => {
                let _ = reply.send(self.add_port(&ifname, ifindex, queue));
            }
            Command::RemovePort { ifindex, reply } => {
                let _ = reply.send(self.remove_port(ifindex));
            }
        }
    }

    /// Opens a socket on `ifname`'s receive queue `queue` (given to the holder too);
    /// its descriptor, whether it is zero-copy, and its transmit budget per sendto.
    fn add_port(
        &mut self,
        ifname: &str,
        ifindex: u32,
        queue: u32,
    ) -> Result<(std::os::fd::RawFd, bool, u32), crate::xsk::XskError> {
        let r = self.io.add_port(ifname, ifindex, queue).map(|fd| {
            // The new port is the last one.
            let port = self.io.port_count() - 1;
            (fd, self.io.zero_copy(port), self.io.tx_budget(port))
        });
        if r.is_ok() {
            let sockets = self.io.sockets();
            self.shared.hold(&sockets[sockets.len() - 1..]);
        }
        self.ports_changed = true;
        r
    }

    /// Closes this worker's sockets on `ifindex` (the holder's references dropped first,
    /// so that the close releases them); whether it had any.
    fn remove_port(&mut self, ifindex: u32) -> bool {
        let queues: Vec<u32> = (self.io.sockets().iter().skip(1))
            .filter(|(i, _, _)| *i == ifindex)
            .map(|(_, q, _)| *q)
            .collect();
        self.shared.forget(ifindex, &queues);
        let removed = self.io.remove_port(ifindex);
        self.ports_changed = true;
        removed
    }

    /// Sends `f` out of interface `ifindex`: on this worker's socket there, or through
    /// worker 0, which has one on every attached interface.
    fn transmit(&mut self, mut f: Frame<'id>, ifindex: u32) {
        if let Some(port) = self.io.port_of(ifindex) {
            self.local.tx_packets += 1;
            self.io.send(port, f);
            return;
        }
        if self.id != 0 {
            let h = Handoff {
                frame: self.io.bytes(&mut f).to_vec(),
                ifindex,
                transmit: true,
                vlan: 0,
            };
            if self.shared.inbox[0].push(h).is_ok() {
                self.local.handoffs_out += 1;
            } else {
                self.local.handoff_full += 1;
            }
        } else {
            self.local.no_route += 1;
        }
        self.io.recycle(f);
    }

    /// Prefetches the headers of every frame of a received batch before any is parsed.
    /// In copy mode the kernel wrote each frame into the UMEM on the CPU that received
    /// it, so a frame's first line is a miss on the worker's CPU, and parsing the packets
    /// one by one waits for each miss in turn (the first load of `parse` took 80% of its
    /// time in the new-connection profile). Asked for together, the misses overlap.
    fn prefetch_frames(&self, batch: &mut [Frame<'id>]) {
        for f in batch.iter_mut() {
            let b = self.io.bytes(f);
            // The Ethernet and IP headers, and past the first line the ports of an IPv4
            // header with options or of IPv6 (the data starts line-aligned).
            for at in [0, 64] {
                if let Some(byte) = b.get(at) {
                    crate::sys::prefetch(byte);
                }
            }
        }
    }

    /// Has the connection table bring the flows of a received batch (from `port`) into
    /// the cache before its packets are handled one by one
    /// ([`conntrack::ConnTable::warm`]): with more flows than the cache holds, the
    /// batch's misses overlap instead of each packet waiting for its own. Packets that
    /// are not flows (fragments, ICMP errors, other protocols) are left out.
    ///
    /// The packets that found no candidate flow, likely new connections, have their
    /// decision and endpoint made now ([`Engine::choose_ahead`]), the chosen endpoints
    /// brought into the cache, and then the index buckets of the reply tuples those
    /// choices give ([`Engine::reply_ahead`], [`conntrack::ConnTable::warm_tuples`]):
    /// each stage over the whole batch, so that its misses overlap.
    ///
    /// Keeps each packet's parse and choice in `parsed` (one per frame, `None` for what
    /// is not a flow's packet), which `handle` then uses instead of parsing, deciding and
    /// picking again (same snapshot: the round's).
    fn warm(
        &mut self,
        batch: &mut [Frame<'id>],
        port: usize,
        snap: &Snapshot,
        keys: &mut Vec<Tuple>,
        replies: &mut Vec<Tuple>,
        parsed: &mut Vec<Option<Warmed>>,
    ) {
        keys.clear();
        for f in batch.iter_mut() {
            let frame = self.io.bytes(f);
            // Tagged frames (and what is not IP) are parsed by `handle` alone.
            let ip = frame.len() > ETH_HLEN
                && matches!(
                    u16::from_be_bytes([frame[12], frame[13]]),
                    ETH_P_IP | ETH_P_IPV6
                );
            let fl = match ip.then(|| rewrite::parse(&frame[ETH_HLEN..])) {
                Some(Ok(Parsed::Flow(fl))) => Some(fl),
                _ => None,
            };
            if let Some(fl) = &fl {
                keys.push(fl.tuple());
            }
            parsed.push(fl.map(|flow| Warmed {
                flow,
                prepared: None,
            }));
        }
        let mut fresh = self.engine.table.warm(keys, crate::sys::prefetch);
        if fresh == 0 {
            return;
        }
        engine::warm_choices(snap, keys, fresh, crate::sys::prefetch);
        replies.clear();
        let in_name = self.port_names.get(port).map(String::as_str);
        // Bit k of `fresh` is the k-th flow packet's (keys were pushed in batch order).
        for w in parsed.iter_mut().flatten() {
            if fresh & 1 == 1 {
                w.prepared = self.engine.choose_ahead(snap, &w.flow, in_name);
                if let Some(p) = &w.prepared {
                    engine::warm_endpoint(snap, p, crate::sys::prefetch);
                }
            }
            fresh >>= 1;
            if fresh == 0 {
                break;
            }
        }
        for w in parsed.iter().flatten() {
            if let Some(p) = &w.prepared {
                replies.extend(self.engine.reply_ahead(snap, &w.flow, p, in_name));
            }
        }
        self.engine.table.warm_tuples(replies, crate::sys::prefetch);
    }

    /// One packet, received on this worker's socket or handed over by another: taken
    /// off its VLAN tag, parsed once, sent on to the worker owning its flow or
    /// translated here, then forwarded, answered or dropped as the engine says.
    fn handle(
        &mut self,
        f: Frame<'id>,
        at: Arrival,
        round: &Round<'_>,
        answer: &mut [u8],
        pre: Option<Warmed>,
    ) {
        let Some((mut f, vlan)) = self.receive(f, at.vlan) else {
            return;
        };
        let at = Arrival { vlan, ..at };
        // The one parse of the packet (its batch's warming's, from these bytes, unchanged
        // since), used below by the fragment check, the flow's owner and the engine.
        let parsed = match pre {
            Some(w) => Ok(Parsed::Flow(w.flow)),
            None => rewrite::parse(&self.io.bytes(&mut f)[ETH_HLEN..]),
        };
        // Fragments: a later one follows its first fragment's translation; a first one
        // goes through the engine like any packet and teaches the others.
        let first_fragment = match parsed {
            Ok(Parsed::Fragment(fp)) => {
                self.later_fragment(f, &fp, round.now);
                return;
            }
            Ok(Parsed::Flow(fl)) => fl.fragment(),
            _ => None,
        };
        if round.workers > 1 && !at.handed {
            let owner = owner_of_parsed(round.snap, &parsed, round.workers);
            if owner != self.id {
                self.hand_off(f, owner, at);
                return;
            }
        }
        let prepared = pre.and_then(|w| w.prepared);
        match self.translate(&mut f, at, round, parsed, prepared, answer) {
            Verdict::Forward {
                dst,
                from,
                vlan,
                handover,
                ..
            } => {
                if let Some(key) = first_fragment {
                    let tag = vlan
                        | match handover {
                            Handover::No => 0,
                            Handover::Plain => FRAG_HANDOVER,
                            Handover::Masquerade => FRAG_HANDOVER | FRAG_HANDOVER_MASQ,
                        };
                    self.learn_fragments(&mut f, key, tag, round.now);
                }
                if handover == Handover::No {
                    let out = Out {
                        dst,
                        from,
                        vlan,
                        back: at.vlan,
                    };
                    self.route_out_checked(f, out, answer)
                } else {
                    self.hand_over(f, handover == Handover::Masquerade);
                }
            }
            // The engine leaves a packet it passes as it came: `parsed` is still its.
            Verdict::Pass => self.pass(f, parsed, first_fragment, at, round.now, answer),
            Verdict::Respond { len, .. } => self.respond(f, len, at, answer),
            Verdict::Drop(_) => self.io.recycle(f),
        }
    }

    /// A packet received: counted, and its VLAN tag taken off (`vlan` is the one another
    /// worker took off before handing it over). `None` (the frame recycled) for what is
    /// neither IP nor IP in one tag.
    fn receive(&mut self, mut f: Frame<'id>, vlan: u16) -> Option<(Frame<'id>, u16)> {
        let frame = self.io.bytes(&mut f);
        self.local.rx_packets += 1;
        self.local.rx_bytes += frame.len() as u64;
        if frame.len() <= ETH_HLEN {
            self.io.recycle(f);
            return None;
        }
        let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
        if ethertype == ETH_P_IP || ethertype == ETH_P_IPV6 {
            return Some((f, vlan));
        }
        match self.untag(&mut f) {
            Some(v) => Some((f, v)),
            None => {
                self.io.recycle(f);
                None
            }
        }
    }

    /// Hands `f` to worker `owner`, which owns its flow (counted when its inbox is full).
    fn hand_off(&mut self, mut f: Frame<'id>, owner: usize, at: Arrival) {
        let h = Handoff {
            frame: self.io.bytes(&mut f).to_vec(),
            ifindex: at.ifindex,
            transmit: false,
            vlan: at.vlan,
        };
        if self.shared.inbox[owner].push(h).is_ok() {
            self.local.handoffs_out += 1;
        } else {
            self.local.handoff_full += 1;
        }
        self.io.recycle(f);
    }

    /// The engine's verdict on `f` (parsed as `parsed`), which it translates in place.
    fn translate(
        &mut self,
        f: &mut Frame<'id>,
        at: Arrival,
        round: &Round<'_>,
        parsed: Result<Parsed, rewrite::ParseError>,
        prepared: Option<Prepared>,
        answer: &mut [u8],
    ) -> Verdict {
        // The interface's name at layer 3 (for interface-based local detection): this
        // worker's port's, or, for a packet handed over from a port it has not, its
        // bridge's or the attached list's.
        let attached;
        let master;
        let interface = match self.port_names.get(f.port) {
            Some(n) => Some(n.as_str()),
            None => {
                master = self.fib.master_name(at.ifindex);
                attached = self.shared.attached.load();
                master.as_deref().or_else(|| {
                    attached
                        .iter()
                        .find(|(i, _)| *i == at.ifindex)
                        .map(|(_, n)| n.as_str())
                })
            }
        };
        let ingress = Ingress {
            interface,
            vlan: at.vlan,
        };
        let l3 = &mut self.io.bytes(f)[ETH_HLEN..];
        let fib = FibSource(&self.fib);
        self.engine.process_parsed(
            round.snap, l3, parsed, prepared, round.now, ingress, &fib, answer,
        )
    }

    /// A packet the steering program redirected that is not part of a translated flow
    /// (an endpoint answering a connection that the kernel does not track either, e.g.
    /// with conntrack off in this namespace; the steering program leaves the flows the
    /// kernel tracks to it): forwarded as the kernel would, its partial checksum
    /// completed, its TTL decremented, fragmented or refused when too big for the next
    /// link.
    fn pass(
        &mut self,
        mut f: Frame<'id>,
        parsed: Result<Parsed, rewrite::ParseError>,
        first_fragment: Option<rewrite::FragKey>,
        at: Arrival,
        now: u64,
        answer: &mut [u8],
    ) {
        let l3 = &mut self.io.bytes(&mut f)[ETH_HLEN..];
        let (dst, from) = match parsed {
            Ok(Parsed::Flow(p)) => {
                if rewrite::complete_checksum(l3, &p) == Ok(true) {
                    self.local.pass_checksums_completed += 1;
                }
                (p.tuple().dst, Some(p.tuple()))
            }
            Ok(p) => (p.dst(), None),
            Err(_) => {
                self.io.recycle(f);
                return;
            }
        };
        // The datagram's later fragments (steered here too, as from an endpoint)
        // follow it unchanged.
        if let Some(key) = first_fragment {
            self.learn_fragments(&mut f, key, 0, now);
        }
        let l3 = &mut self.io.bytes(&mut f)[ETH_HLEN..];
        match rewrite::decrement_ttl(l3) {
            Ok(true) => {
                let out = Out {
                    dst,
                    from,
                    vlan: 0,
                    back: at.vlan,
                };
                self.route_out_checked(f, out, answer)
            }
            _ => self.io.recycle(f),
        }
    }

    /// The engine's answer (`len` bytes of `answer`: a REJECT's RST or ICMP error) sent
    /// back to the sender of `f`, in its frame, on the interface and VLAN it came from.
    fn respond(&mut self, mut f: Frame<'id>, len: usize, at: Arrival, answer: &[u8]) {
        let frame = self.io.bytes(&mut f);
        let mut macs = [0u8; 12];
        macs.copy_from_slice(&frame[..12]);
        let total = ETH_HLEN + len;
        if total > self.io.frame_capacity() {
            self.io.recycle(f);
            return;
        }
        self.io.set_len(&mut f, total);
        let frame = self.io.bytes(&mut f);
        // Back to the sender: its MAC becomes the destination.
        frame[..6].copy_from_slice(&macs[6..12]);
        frame[6..12].copy_from_slice(&macs[..6]);
        frame[ETH_HLEN..total].copy_from_slice(&answer[..len]);
        frame[12..14].copy_from_slice(
            &(if answer[0] >> 4 == 6 {
                ETH_P_IPV6
            } else {
                ETH_P_IP
            })
            .to_be_bytes(),
        );
        // On the VLAN it came from.
        let f = if at.vlan != 0 {
            match self.push_vlan(f, at.vlan) {
                Some(f) => f,
                None => return,
            }
        } else {
            f
        };
        self.transmit(f, at.ifindex);
    }

    /// A fragment after the first: given its datagram's translation, or parked until the
    /// first fragment comes (or dropped and counted when there is no room or it never
    /// does).
    fn later_fragment(&mut self, mut f: Frame<'id>, fp: &rewrite::FragmentPacket, now: u64) {
        let verdict = {
            let mut t = self.shared.frags.lock().unwrap_or_else(|e| e.into_inner());
            match t.lookup(&fp.key(), now) {
                conntrack::FragVerdict::Unknown => {
                    let frame = self.io.bytes(&mut f);
                    t.park(fp.key(), frame, now);
                    None
                }
                conntrack::FragVerdict::Translate(src, dst, vlan) => Some((src, dst, vlan)),
            }
        };
        match verdict {
            Some((src, dst, vlan)) => self.send_fragment(f, fp, src, dst, vlan),
            None => self.io.recycle(f),
        }
    }

    fn send_fragment(
        &mut self,
        mut f: Frame<'id>,
        fp: &rewrite::FragmentPacket,
        src: IpAddr,
        dst: IpAddr,
        vlan: u16,
    ) {
        let frame = self.io.bytes(&mut f);
        let l3 = &mut frame[ETH_HLEN..];
        let len = l3.len() as u64;
        let c = &mut self.engine.counters;
        if rewrite::rewrite_fragment(l3, fp, src, dst).is_err() {
            *c.drops
                .entry(DropCause::Malformed("fragment_rewrite"))
                .or_default() += 1;
            self.io.recycle(f);
            return;
        }
        // Handed to the kernel (as its first fragment was), the kernel's forwarding
        // decrements the TTL.
        if vlan & FRAG_HANDOVER == 0 && !matches!(rewrite::decrement_ttl(l3), Ok(true)) {
            *c.drops.entry(DropCause::TtlExceeded).or_default() += 1;
            self.io.recycle(f);
            return;
        }
        // Forwarded as its first fragment was: counted the same way.
        c.forwarded += 1;
        c.forwarded_bytes += len;
        if vlan & FRAG_HANDOVER != 0 {
            self.hand_over(f, vlan & FRAG_HANDOVER_MASQ != 0);
        } else {
            self.route_out(f, dst, vlan & 0xfff);
        }
    }

    /// After the first fragment of `key` was translated (in `f`, leaving with `vlan`):
    /// records its addresses for the datagram's other fragments and sends those that
    /// came before it.
    fn learn_fragments(&mut self, f: &mut Frame<'id>, key: rewrite::FragKey, vlan: u16, now: u64) {
        let frame = self.io.bytes(f);
        let Ok(p) = rewrite::parse(&frame[ETH_HLEN..]) else {
            return;
        };
        let (src, dst) = (p.src(), p.dst());
        let (parked, _) = self
            .shared
            .frags
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .learn(key, src, dst, vlan, now);
        for bytes in parked {
            let Some(mut g) = self.io.frame_from(&bytes) else {
                break;
            };
            match rewrite::parse(&self.io.bytes(&mut g)[ETH_HLEN..]) {
                Ok(Parsed::Fragment(fp)) => self.send_fragment(g, &fp, src, dst, vlan),
                _ => self.io.recycle(g),
            }
        }
    }

    /// Like [`Worker::route_out`], doing what a router does with a packet larger than
    /// the next link's MTU: fragments it (IPv4 without DF), or sends "fragmentation
    /// needed" / "packet too big" with that MTU to its sender, quoting the packet as it
    /// arrived (`from`: its tuple before translation), so path-MTU discovery works
    /// through a Service address.
    fn route_out_checked(&mut self, mut f: Frame<'id>, out: Out, scratch: &mut [u8]) {
        let len = self.io.bytes(&mut f).len() - ETH_HLEN;
        let route = self.fib.route(out.dst);
        // Below IPv4's minimum MTU no link is too small.
        if len > 576
            && let Route::Forward(nh) = route
            && let Some(mtu) = self.fib.mtu(nh.ifindex)
            && len > mtu as usize
        {
            self.too_big(f, mtu, out, scratch);
            return;
        }
        self.send_routed(f, out.dst, route, out.vlan);
    }

    fn too_big(&mut self, mut f: Frame<'id>, mtu: u32, out: Out, scratch: &mut [u8]) {
        let Out {
            from, vlan, back, ..
        } = out;
        let frame = self.io.bytes(&mut f);
        let l3 = &frame[ETH_HLEN..];
        if let Ok(n) = rewrite::ipv4_fragment_count(l3, mtu as usize) {
            let Ok(dst) = rewrite::parse(l3).map(|p| p.dst()) else {
                self.io.recycle(f);
                return;
            };
            let whole = frame.to_vec();
            self.io.recycle(f);
            let mut out = Vec::with_capacity(n);
            for i in 0..n {
                let Some(mut g) = self.io.alloc_len(ETH_HLEN + mtu as usize) else {
                    break;
                };
                let buf = self.io.bytes(&mut g);
                buf[..ETH_HLEN].copy_from_slice(&whole[..ETH_HLEN]);
                let written = rewrite::write_ipv4_fragment(
                    &whole[ETH_HLEN..],
                    mtu as usize,
                    i,
                    &mut buf[ETH_HLEN..],
                );
                match written {
                    Ok(len) => {
                        self.io.set_len(&mut g, ETH_HLEN + len);
                        out.push(g);
                    }
                    Err(_) => self.io.recycle(g),
                }
            }
            self.local.fragmented_out += 1;
            for g in out {
                self.route_out(g, dst, vlan);
            }
            return;
        }
        // Don't-fragment (or IPv6): tell the sender, about the packet it sent.
        let Some(from) = from else {
            self.local.too_big_dropped += 1;
            self.io.recycle(f);
            return;
        };
        let frame = self.io.bytes(&mut f);
        let l3 = &mut frame[ETH_HLEN..];
        let restored = match rewrite::parse(l3) {
            Ok(Parsed::Flow(p)) => rewrite::rewrite(l3, &p, &from).is_ok(),
            _ => false,
        };
        let router = self.fib.source_for(from.src);
        let built = match (restored, router) {
            (true, Some(router)) => rewrite::build_icmp_too_big(l3, mtu, router, scratch).ok(),
            _ => None,
        };
        let Some(n) = built else {
            self.local.too_big_dropped += 1;
            self.io.recycle(f);
            return;
        };
        self.io.set_len(&mut f, ETH_HLEN + n);
        let frame = self.io.bytes(&mut f);
        frame[ETH_HLEN..ETH_HLEN + n].copy_from_slice(&scratch[..n]);
        self.local.too_big_icmp += 1;
        // To the sender, on the VLAN the packet came from.
        self.route_out(f, from.src, back);
    }

    fn route_out(&mut self, f: Frame<'id>, dst: IpAddr, vlan: u16) {
        let route = self.fib.route(dst);
        self.send_routed(f, dst, route, vlan);
    }

    /// Sends `f` (for `dst`) as `route`, the FIB's answer for it, says; tagged with
    /// `vlan` (unless 0) when it leaves through an interface kxp drives that is not a
    /// VLAN device (the trunk a tagged client came through).
    fn send_routed(&mut self, mut f: Frame<'id>, dst: IpAddr, route: Route, vlan: u16) {
        match route {
            Route::Forward(nh) => self.send_to(f, nh, vlan),
            Route::Local if self.local_delivery.is_some() => {
                let Some(d) = self.local_delivery else { return };
                let frame = self.io.bytes(&mut f);
                frame[..6].copy_from_slice(&d.dst_mac);
                frame[6..12].copy_from_slice(&d.src_mac);
                self.transmit(f, d.ifindex);
            }
            // Out of an interface kxp does not drive (an overlay device, a link that did
            // not match): the kernel sends it, handed over through the service device
            // (it routes the packet again and decrements the TTL once more).
            Route::NotAttached { .. } if self.local_delivery.is_some() => {
                let Some(d) = self.local_delivery else { return };
                let frame = self.io.bytes(&mut f);
                frame[..6].copy_from_slice(&d.dst_mac);
                frame[6..12].copy_from_slice(&d.src_mac);
                self.local.to_kernel += 1;
                self.transmit(f, d.ifindex);
            }
            Route::Pending => {
                // As the kernel queues packets for a neighbour being resolved (unres_qlen),
                // a few wait here, bounded in number and time; the rest are dropped.
                if self.waiting.len() < WAITING_MAX {
                    self.waiting.push_back((f, dst, vlan, self.now));
                } else {
                    self.local.neighbour_pending += 1;
                    self.io.recycle(f);
                }
            }
            _ => {
                self.local.no_route += 1;
                self.io.recycle(f);
            }
        }
    }

    /// Sends the packets that waited for a neighbour whose MAC is now known; drops those
    /// that waited longer than [`WAITING_NS`] (counted).
    fn retry_waiting(&mut self) {
        for _ in 0..self.waiting.len() {
            let Some((f, dst, vlan, since)) = self.waiting.pop_front() else {
                break;
            };
            match self.fib.route(dst) {
                Route::Pending if self.now.saturating_sub(since) < WAITING_NS => {
                    self.waiting.push_back((f, dst, vlan, since));
                }
                Route::Pending => {
                    self.local.neighbour_pending += 1;
                    self.io.recycle(f);
                }
                Route::Forward(nh) => self.send_to(f, nh, vlan),
                _ => {
                    self.local.no_route += 1;
                    self.io.recycle(f);
                }
            }
        }
    }

    /// Sends `f` to the next hop `nh`, tagged with `vlan` (unless 0) when `nh`'s
    /// interface is not a VLAN device.
    fn send_to(&mut self, mut f: Frame<'id>, nh: crate::fib::NextHop, vlan: u16) {
        let frame = self.io.bytes(&mut f);
        frame[..6].copy_from_slice(&nh.dst_mac);
        frame[6..12].copy_from_slice(&nh.src_mac);
        let f = if vlan != 0 && !self.fib.is_vlan_device(nh.ifindex) {
            match self.push_vlan(f, vlan) {
                Some(f) => f,
                None => return,
            }
        } else {
            f
        };
        self.transmit(f, nh.ifindex);
    }

    /// Takes one 802.1Q / 802.1ad tag off `f` when an IP packet follows it (the
    /// steering program looks inside one) and returns its VLAN id, which the flow keeps
    /// so that the packets back to this client are tagged again (`send_to`); `None` for
    /// anything else (not kxp's).
    #[cold]
    fn untag(&mut self, f: &mut Frame<'id>) -> Option<u16> {
        let frame = self.io.bytes(f);
        let len = frame.len();
        let tpid = u16::from_be_bytes([frame[12], frame[13]]);
        if (tpid != ETH_P_8021Q && tpid != ETH_P_8021AD) || len <= ETH_HLEN + 4 {
            return None;
        }
        let inner = u16::from_be_bytes([frame[16], frame[17]]);
        if inner != ETH_P_IP && inner != ETH_P_IPV6 {
            return None;
        }
        let vlan = u16::from_be_bytes([frame[14], frame[15]]) & 0xfff;
        frame.copy_within(ETH_HLEN + 2..len, 12);
        self.io.set_len(f, len - 4);
        self.local.vlan_untagged += 1;
        Some(vlan)
    }

    /// Hands a translated packet for a pod of this node to the kernel
    /// (`kxp.networkPolicy: kernel`), to be masqueraded there or not: it forwards it to
    /// the pod, through the CNI's filtering, and fragments it or answers "too big"
    /// itself.
    fn hand_over(&mut self, mut f: Frame<'id>, masquerade: bool) {
        let Some(d) = self.handover else {
            self.io.recycle(f);
            return;
        };
        let frame = self.io.bytes(&mut f);
        frame[..6].copy_from_slice(&d.dst_mac);
        frame[6..12].copy_from_slice(if masquerade {
            &HANDOVER_MASQ_MAC
        } else {
            &HANDOVER_MAC
        });
        self.local.policy_handover += 1;
        self.transmit(f, d.ifindex);
    }

    /// `f` with an 802.1Q tag with VLAN id `vlan` after its MAC addresses. `None` (the
    /// frame dropped and counted) when no frame was free for a packet that no longer
    /// fits its own.
    #[cold]
    fn push_vlan(&mut self, mut f: Frame<'id>, vlan: u16) -> Option<Frame<'id>> {
        let len = self.io.bytes(&mut f).len();
        let tag = |b: &mut [u8]| {
            b[12..14].copy_from_slice(&ETH_P_8021Q.to_be_bytes());
            b[14..16].copy_from_slice(&(vlan & 0xfff).to_be_bytes());
        };
        self.local.vlan_tagged += 1;
        if f.is_umem() && len + 4 > self.io.frame_capacity() {
            // No longer fits one frame: a copy, sent as a chain.
            let b = self.io.bytes(&mut f);
            let mut bytes = Vec::with_capacity(len + 4);
            bytes.extend_from_slice(&b[..12]);
            bytes.extend_from_slice(&[0; 4]);
            bytes.extend_from_slice(&b[12..]);
            tag(&mut bytes);
            self.io.recycle(f);
            let g = self.io.frame_from(&bytes);
            if g.is_none() {
                self.local.no_route += 1;
            }
            return g;
        }
        self.io.set_len(&mut f, len + 4);
        let b = self.io.bytes(&mut f);
        b.copy_within(12..len, 16);
        tag(b);
        Some(f)
    }
}

/// Packets a worker keeps while their next hop is resolved, and for how long: as long as
/// the kernel keeps them, until the resolution fails (3 solicitations a second apart,
/// `mcast_solicit` × `retrans_time_ms`). A second was too short where the first
/// solicitation went unanswered (an IPv6 address still tentative, doing duplicate
/// address detection): the packet the kernel would have delivered a second later was
/// dropped.
const WAITING_MAX: usize = 256;
const WAITING_NS: u64 = 3_000_000_000;

/// The worker that owns the flow of `l3` (an IP packet): [`conntrack::flow_owner`] of
/// the flow's client side, which is
/// - for a packet to a Service frontend (ClusterIP, NodePort, ...): its source;
/// - for anything else (an endpoint's answer): its destination, the client's address and
///   port, or the SNAT address and port the owner allocated for a masqueraded flow;
/// - for an ICMP error: as the packet its quote answers (the quote reversed).
///
/// Exact for every flow, whatever ports the client uses.
pub fn owner(snap: &Snapshot, l3: &[u8], workers: usize) -> usize {
    owner_of_parsed(snap, &rewrite::parse(l3), workers)
}

/// [`owner`] of a packet parsed as `parsed`.
fn owner_of_parsed(
    snap: &Snapshot,
    parsed: &Result<Parsed, rewrite::ParseError>,
    workers: usize,
) -> usize {
    let t = match parsed {
        Ok(Parsed::Flow(f)) => f.tuple(),
        Ok(Parsed::IcmpError(e)) => e.inner().reversed(),
        _ => return 0,
    };
    owner_of_tuple(snap, &t, workers)
}

fn owner_of_tuple(snap: &Snapshot, t: &Tuple, workers: usize) -> usize {
    let is_frontend = snap.port_for(t.dst, t.proto, t.dport).is_some();
    let (ip, port) = if is_frontend {
        (t.src, t.sport)
    } else {
        (t.dst, t.dport)
    };
    conntrack::flow_owner(ip, port, workers)
}

/// Whether a drain window (`rounds` busy rounds that took `ns` for `packets`, in
/// `wall_ns`) shows a worker that keeps up with its traffic: small batches (it catches
/// up with what arrived every round) and time to spare, or idle more than half the
/// time whatever its batches. A worker that is the bottleneck finds a full batch
/// waiting most rounds, or is busy nearly all the time.
///
/// Full batches with long idle gaps between them are a bursty source, not a
/// bottleneck: a threaded NAPI kthread delivers what it received in its own time slice,
/// hundreds of packets at once, and a fill ring bounded to the queue budget (a few
/// hundred frames at most) drops the rest of each burst though the worker drains it in
/// a fraction of the time to the next.
fn keeps_up(ns: u64, packets: u64, rounds: u64, wall_ns: u64) -> bool {
    let busy = ns as f64 / wall_ns.max(1) as f64;
    busy < SPARE_BUSY || (packets <= rounds * HOLD_MAX_BATCH && busy < SATURATED_BUSY)
}

#[cfg(test)]
mod tests {
    use super::{Stalls, keeps_up};

    #[test]
    fn stalls_are_gaps_of_a_millisecond_or_more() {
        let mut s = Stalls::default();
        for gap in [0, 50_000, 999_999] {
            s.note(gap, [gap, 0, 0, 0]);
        }
        assert_eq!(s, Stalls::default(), "a round's work is not a stall");
        for (gap, parts) in [
            (1_000_000, [10, 999_990, 0, 0]),
            (30_000_000, [0, 0, 0, 30_000_000]),
            (2_000_000, [1_500_000, 400_000, 100_000, 0]),
            (10, [10, 0, 0, 0]),
        ] {
            s.note(gap, parts);
        }
        assert_eq!(
            s,
            Stalls {
                count: 3,
                total_ns: 33_000_000,
                longest_ns: 30_000_000,
                by_part: [1, 1, 0, 1],
            }
        );
    }

    #[test]
    fn a_worker_keeps_up_with_small_batches_and_time_to_spare() {
        const MS: u64 = 1_000_000;
        // 0.1 Mpps in twos, 2 ms busy in 8 ms: a pause's queue would drain.
        assert!(keeps_up(2 * MS, 800, 400, 8 * MS));
        // Saturated: full batches, busy throughout.
        assert!(!keeps_up(2 * MS, 2_000, 32, 2 * MS));
        // Full batches with idle time between them, busy more than half the time: near
        // the bottleneck.
        assert!(!keeps_up(2 * MS, 2_000, 50, 3 * MS));
        // Full batches with more idle time than busy: a bursty source (a NAPI kthread
        // delivering its time slice's packets at once), kept up with.
        assert!(keeps_up(2 * MS, 2_000, 50, 5 * MS));
        // Small batches but no time to spare: near the bottleneck.
        assert!(!keeps_up(2 * MS, 800, 400, 2 * MS + MS / 4));
        // A first window after seconds of idling (its wall time counts them).
        assert!(keeps_up(2 * MS, 400, 400, 5_000 * MS));
    }
}
