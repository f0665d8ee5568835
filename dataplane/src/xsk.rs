//! AF_XDP sockets of one worker ([`crate::afxdp`]): one UMEM shared by a socket on each queue the
//! worker serves of each attached interface (one per interface when there are no more
//! queues than workers), so a frame received on one interface can be sent on another
//! without a copy.
//!
//! Frame ownership is what makes AF_XDP sound: a frame is owned either by the kernel (on
//! the fill or TX ring) or by userspace, never both. Here userspace ownership is a
//! [`Frame`] token — not `Clone`, not `Copy` — so a frame can be handed to one ring at a
//! time and its bytes borrowed only through the token. Every `unsafe` call of `afxdp` in
//! the dataplane (tests aside) is in this module, each justified by that invariant.
//!
//! Where a frame is, at any time, is exactly one of: on a fill, RX, TX or completion
//! ring (the kernel's); once in `free` or in a port's `tx_pending` (userspace's, no
//! token); in one [`Frame`] (userspace's, that token's); nowhere (its token dropped).
//! Moving a frame between these is done only here, and every descriptor involved comes
//! from this worker's one UMEM ([`Area`]): from `Area::descs`, or from a ring of a
//! socket created on it. Each frame is marked with the port whose fill or TX ring holds it and
//! unmarked when it comes off the RX or completion ring, so [`WorkerIo::remove_port`]
//! takes back exactly the frames still on the removed port's rings, never one a token
//! holds.
//!
//! Closing a socket is taken as the end of the kernel's use of its rings: true of copy
//! mode on veth (what the tests run). With zero-copy, or in copy mode on drivers that
//! transmit straight from UMEM pages (`IFF_TX_SKB_NO_LINEAR`, e.g. virtio_net), the
//! device's teardown may still be in flight; that case is not handled yet.
//!
//! A token is also tied, by type, to the sockets whose UMEM holds its frame: the
//! sockets are used through [`Sockets::with`], which hands the closure a
//! `WorkerIo<'id>` with a brand `'id` of its own (an invariant lifetime no other
//! `WorkerIo` has), and every [`Frame`] it makes is a `Frame<'id>`. So safe code cannot
//! give one worker's frame to another worker's `bytes`, `recycle` or `send` — the
//! program does not compile — and no frame outlives the UMEM it points into.

use std::marker::PhantomData;
use std::os::fd::{AsRawFd, RawFd};

use crate::afxdp::{Area, Bind, Desc, Socket, XDP_HEADROOM};

mod handover;
pub use handover::{Handed, HandedPort, HandedState, Lent, LentGeometry, Premapped};

/// A packet owned by userspace: a UMEM frame, or (for a packet larger than one frame,
/// received as several with `XDP_USE_SG`, or built for a large MTU) a heap buffer that
/// is cut into a chain of frames again when sent. Dropping it without giving it back
/// ([`WorkerIo::recycle`], [`WorkerIo::send`]) leaks a UMEM frame, never corrupts it.
#[derive(Debug)]
pub struct Frame<'id> {
    buf: Buf,
    /// Port the frame was received on (for generated frames: 0).
    pub port: usize,
    _brand: Brand<'id>,
}

impl Frame<'_> {
    /// Whether the packet is in one UMEM frame (else a heap buffer, sent as a chain).
    pub fn is_umem(&self) -> bool {
        matches!(self.buf, Buf::Umem(_))
    }
}

/// An invariant lifetime: `'id` can be neither shortened nor lengthened, so two brands
/// are never confused (see the module docs).
type Brand<'id> = PhantomData<fn(&'id ()) -> &'id ()>;

#[derive(Debug)]
enum Buf {
    Umem(Desc),
    Heap(Vec<u8>),
}

/// `xdp_desc.options` bit: the packet goes on in the next descriptor (AF_XDP
/// multi-buffer, `XDP_PKT_CONTD`).
const XDP_PKT_CONTD: u32 = 1;
/// The largest packet kept (an IPv4 datagram plus its Ethernet header).
const MAX_PACKET: usize = 65_535 + 14;

/// Sizes and modes of a worker's sockets.
#[derive(Debug, Clone)]
pub struct XskConfig {
    /// Frames in the worker's UMEM (shared by all its ports).
    pub frames: u32,
    pub frame_size: u32,
    /// Entries of each of a port's rings (fill, RX, TX, completion). Below saturation a
    /// fill ring holds what its interface receives in 16 ms, within this and the UMEM's
    /// share, so that a pause of the worker's CPU waits in the rings instead of being
    /// dropped. With the default UMEM a busy port may be given up to 5,872 frames (16 fewer
    /// for each further port, kept for its idle floor), within this ring: 4,096 entries let it hold 10 ms at 0.3 Mpps, where 2,048 held 7 (2026-12-03, three
    /// same-run A/Bs below saturation: 4,531 packets dropped against 32,753).
    pub ring_size: u32,
    /// Force copy mode; otherwise the UMEM's own socket asks for zero-copy and the
    /// kernel falls back to copy mode where the driver has none (veths, kxp's service
    /// device among them). Every socket sharing the UMEM has the mode of its first, so
    /// with kxp's service device first the mode is copy; [`WorkerIo::zero_copy`] says
    /// which a port got.
    pub copy_mode: bool,
    /// Preferred busy polling: (busy-poll µs, budget).
    pub busy_poll: Option<(u32, u32)>,
    /// The longest a received packet should wait in a port's rings when the worker is
    /// saturated, in µs (0: no bound but the UMEM's share). The worker keeps each fill
    /// ring at what it drains in this time, so a load beyond what it forwards is dropped
    /// by the interface at once instead of standing in a queue that delays every packet.
    pub queue_budget_us: u32,
    /// How long a worker keeps polling after its last packet before it sleeps in
    /// `poll()`, in µs (`None`: 10 ms for a worker pinned to a CPU, which it then has to
    /// itself, and none for one that is not, which only spins 64 empty rounds). Waking
    /// from `poll()` costs tens of µs of latency on the first packet after a pause.
    pub idle_spin_us: Option<u32>,
    /// AF_XDP multi-buffer (`XDP_USE_SG`): packets larger than a frame (jumbo MTUs)
    /// arrive and leave as chains of frames. It costs on every packet in copy mode, so
    /// it is on only when an interface needs it.
    pub multi_buffer: bool,
}

impl XskError {
    /// The queue is still bound: a socket closed on it a moment ago is released by the
    /// kernel in the background (its memory pool is let go from a work queue), so a new
    /// socket on the same queue right after can find it busy. Worth trying again.
    pub fn is_busy(&self) -> bool {
        matches!(self, XskError::Socket { errno: Some(e), .. } if *e == libc::EBUSY)
    }
}

impl Default for XskConfig {
    fn default() -> Self {
        XskConfig {
            frames: 8192,
            frame_size: 2048,
            ring_size: 4096,
            copy_mode: false,
            busy_poll: None,
            queue_budget_us: 250,
            idle_spin_us: None,
            multi_buffer: false,
        }
    }
}

/// Opening a socket failed.
#[derive(Debug, thiserror::Error)]
pub enum XskError {
    #[error(
        "cannot create the AF_XDP memory area ({frames} frames of {frame_size} bytes): {reason}"
    )]
    Umem {
        frames: u32,
        frame_size: u32,
        reason: String,
    },
    #[error(
        "cannot open an AF_XDP socket on {ifname} queue {queue}: {reason}; check that the \
         kernel has CONFIG_XDP_SOCKETS, that kxp runs as root (CAP_NET_ADMIN, CAP_NET_RAW, \
         CAP_BPF) and that the interface has that many queues (ethtool -l {ifname})"
    )]
    Socket {
        ifname: String,
        queue: u32,
        reason: String,
        /// The kernel's error number, when it gave one.
        errno: Option<i32>,
    },
    #[error("invalid AF_XDP configuration: {0}")]
    Config(String),
    #[error("setting busy-poll socket options on {ifname}: {source}")]
    BusyPoll {
        ifname: String,
        #[source]
        source: std::io::Error,
    },
}

struct Port {
    ifname: String,
    ifindex: u32,
    /// The interface's receive queue the socket is bound to.
    queue: u32,
    /// Packets received on this socket since it was opened.
    rx_packets: u64,
    /// A port of this interface has received (see [`IDLE_FILL`]).
    warm: bool,
    sock: Socket,
    /// The socket is in zero-copy mode (`XDP_OPTIONS`), not copy mode.
    zero_copy: bool,
    /// In copy mode, the most frames one sendto() has the kernel transmit.
    tx_budget: u32,
    /// Frames waiting for room on the TX ring.
    tx_pending: Vec<Desc>,
    /// Frames on the TX ring not yet back on the completion ring: `reap` reads the
    /// completion ring only of ports that have some.
    tx_in_flight: usize,
    /// A multi-buffer packet being received (its first descriptors came in an earlier
    /// batch).
    partial: Option<Vec<u8>>,
    /// Frames this port's fill ring holds (given, not yet received back).
    in_fill: usize,
    /// Descriptors received since the last refill, and the fill depth that traffic
    /// asks for (decaying): an idle port keeps its floor (`idle_fill`), a busy one more.
    received: usize,
    demand: usize,
    /// Descriptors received since the last [`WorkerIo::hold_for`], and the fill depth
    /// that call set from them: what the port receives while the worker is away.
    window_received: usize,
    hold: usize,
    /// TX ring size (all free = nothing left for the kernel to send).
    tx_size: u32,
    /// sendto() calls made to have the kernel transmit (copy mode).
    tx_kicks: u64,
}

/// Per-port socket statistics from the kernel, and the port's queue and packets received.
#[derive(Debug, Clone, Copy, Default)]
pub struct PortStats {
    /// The interface's receive queue the socket is bound to.
    pub queue: u32,
    /// Packets this socket received (counted by kxp).
    pub rx_packets: u64,
    pub rx_dropped: u64,
    pub rx_ring_full: u64,
    pub rx_fill_ring_empty: u64,
    pub tx_invalid: u64,
    pub tx_ring_empty: u64,
}

/// One worker's sockets and frames.
///
/// The first port is the UMEM's own socket: it registers the UMEM, and every later socket
/// shares the UMEM through it (`XDP_SHARED_UMEM`). It must be on an interface that lives
/// as long as the worker (kxp's own service device); the others come and go with
/// [`WorkerIo::add_port`] and [`WorkerIo::remove_port`].
pub struct WorkerIo<'id> {
    // Ports first: sockets must go before the UMEM they use.
    ports: Vec<Port>,
    area: Area,
    /// Per frame (address / frame size): the ifindex of the port whose fill or TX ring
    /// it was last put on, so that a port that goes away gives back the frames its
    /// rings held (see [`WorkerIo::remove_port`]).
    ring_of: Vec<u32>,
    frame_size: usize,
    /// Bind flags of the UMEM's own socket.
    bind_flags: u16,
    queue: u32,
    busy_poll: Option<(u32, u32)>,
    frames_total: usize,
    ring_size: usize,
    /// Free frames, by address.
    free: Vec<u64>,
    scratch: Vec<Desc>,
    scratch_addrs: Vec<u64>,
    /// Each port's want of fill frames in a round (kept to reuse its allocation).
    wants: Vec<usize>,
    /// Frames kept back from the fill rings for transmitting generated packets.
    reserve: usize,
    /// The most frames a port's fill ring is given (see `reshare`): the UMEM less the
    /// reserve and every other port's idle floor, so that no interface starves the others
    /// of receive buffers.
    fill_target: usize,
    /// Receive frames an idle port keeps (see `reshare`).
    idle_fill: usize,
    /// See [`WorkerIo::set_fill_limit`].
    fill_limit: usize,
    frame_capacity: usize,
    _brand: Brand<'id>,
}

/// A worker's sockets, opened and not yet in use: [`Sockets::with`] hands them, branded,
/// to the code that receives, sends and owns frames.
///
/// Frames stay with the sockets that made them:
///
/// ```no_run
/// # use dataplane::xsk::{Sockets, XskConfig};
/// # let a = Sockets::open(&XskConfig::default(), &["eth0".into()], 0).unwrap();
/// a.with(|mut io| {
///     let f = io.alloc().unwrap();
///     io.recycle(f);
/// });
/// ```
///
/// Another worker's sockets cannot take them:
///
/// ```compile_fail,E0521
/// # use dataplane::xsk::{Sockets, XskConfig};
/// # let a = Sockets::open(&XskConfig::default(), &["eth0".into()], 0).unwrap();
/// # let b = Sockets::open(&XskConfig::default(), &["eth1".into()], 1).unwrap();
/// a.with(|mut ia| {
///     b.with(|mut ib| {
///         let f = ia.alloc().unwrap();
///         ib.recycle(f);
///     })
/// });
/// ```
///
/// and a frame cannot leave them:
///
/// ```compile_fail
/// # use dataplane::xsk::{Sockets, XskConfig};
/// # let a = Sockets::open(&XskConfig::default(), &["eth0".into()], 0).unwrap();
/// let f = a.with(|mut io| io.alloc());
/// ```
pub struct Sockets(WorkerIo<'static>);

impl std::fmt::Debug for Sockets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl Sockets {
    /// Opens one socket per interface at `queue`, all on one new UMEM, and fills the fill
    /// rings. The first interface holds the UMEM's own socket for the life of the
    /// sockets. The XDP program must redirect to these sockets (see [`Sockets::fd`]).
    ///
    /// # Errors
    /// The UMEM or a socket cannot be created (the error says why and what to check).
    pub fn open(cfg: &XskConfig, ifnames: &[String], queue: u32) -> Result<Sockets, XskError> {
        WorkerIo::open(cfg, ifnames, queue).map(Sockets)
    }

    /// The socket descriptor of `port`.
    pub fn fd(&self, port: usize) -> RawFd {
        self.0.fd(port)
    }

    /// Runs `f` with the sockets under a brand of their own: every frame `f` gets from
    /// them is typed to them (see the module docs) and cannot leave `f`.
    pub fn with<R>(self, f: impl for<'id> FnOnce(WorkerIo<'id>) -> R) -> R {
        let WorkerIo {
            ports,
            area,
            ring_of,
            frame_size,
            bind_flags,
            queue,
            busy_poll,
            frames_total,
            ring_size,
            free,
            scratch,
            scratch_addrs,
            wants,
            reserve,
            fill_target,
            idle_fill,
            fill_limit,
            frame_capacity,
            _brand,
        } = self.0;
        f(WorkerIo {
            ports,
            area,
            ring_of,
            frame_size,
            bind_flags,
            queue,
            busy_poll,
            frames_total,
            ring_size,
            free,
            scratch,
            scratch_addrs,
            wants,
            reserve,
            fill_target,
            idle_fill,
            fill_limit,
            frame_capacity,
            _brand: PhantomData,
        })
    }
}

impl std::fmt::Debug for WorkerIo<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerIo")
            .field(
                "ports",
                &self.ports.iter().map(|p| &p.ifname).collect::<Vec<_>>(),
            )
            .field("free", &self.free.len())
            .finish_non_exhaustive()
    }
}

/// Most frames moved per ring call.
pub const BATCH: usize = 64;

/// Frames one sendto() transmits in copy mode on a kernel without
/// `XDP_MAX_TX_SKB_BUDGET` (`TX_BATCH_SIZE` in `net/xdp/xsk.c`).
pub const KERNEL_TX_BUDGET: u32 = 32;
/// Receive frames kept on the first port's fill ring (kxp's service device).
const FIRST_PORT_FILL: usize = 256;
/// Receive frames an idle port's fill ring keeps (every port but the first), at least and
/// at most: a burst of a new connection's first packets; from its first round of traffic
/// a port is given what it receives (`refill`). A port of an interface that never
/// received (a pod's veth that only ever idles) keeps `IDLE_FILL`; one of an interface
/// that has received (on any of its queues: an uplink whose other queues carry traffic
/// takes bursts on this one too) keeps half of the UMEM's pool less the cold ports'
/// floors, shared between the warm ports, within these: 64 with a few, 16 with 250.
/// Frames on a fill ring come back only as the port receives: a port that never does
/// keeps, for good, what it was given; when every port's floor was the share of the
/// ports attached so far, the ones attached first at start held more than the final
/// share (140 ports attached one by one took 6,300 frames, the uplink's queues then
/// ran out).
pub const IDLE_FILL: usize = 16;
pub const IDLE_FILL_MAX: usize = BATCH;

/// The bind flags of a worker's UMEM's own socket (every socket sharing the UMEM has its
/// mode).
fn bind_flags(cfg: &XskConfig) -> u16 {
    // Multi-buffer (XDP_USE_SG): packets larger than a frame (jumbo MTUs) arrive and
    // leave as chains of frames.
    let mut flags = libc::XDP_USE_NEED_WAKEUP;
    if cfg.multi_buffer {
        flags |= libc::XDP_USE_SG;
    }
    // Neither flag: zero-copy if the driver has it, else copy mode (the kernel's
    // fallback); XDP_COPY when asked for.
    if cfg.copy_mode {
        flags |= libc::XDP_COPY;
    }
    flags
}

impl WorkerIo<'static> {
    /// See [`Sockets::open`] (the only caller: a `WorkerIo<'static>` never leaves
    /// [`Sockets`]).
    fn open(cfg: &XskConfig, ifnames: &[String], queue: u32) -> Result<Self, XskError> {
        if !cfg.ring_size.is_power_of_two() {
            return Err(XskError::Config(format!(
                "ring size {} is not a power of two",
                cfg.ring_size
            )));
        }
        let area = Area::new(cfg.frames, cfg.frame_size).map_err(|e| XskError::Umem {
            frames: cfg.frames,
            frame_size: cfg.frame_size,
            reason: e.to_string(),
        })?;
        let free = area.descs().iter().map(|d| d.addr).collect();
        let mut io = Self::with_area(cfg, area, queue, free);
        for ifname in ifnames {
            let ifindex = crate::xdp::ifindex_of(ifname).unwrap_or(0);
            io.add_port(ifname, ifindex, queue)?;
        }
        Ok(io)
    }

    /// No ports yet, on `area`, `free` its free frames.
    fn with_area(cfg: &XskConfig, area: Area, queue: u32, free: Vec<u64>) -> Self {
        let frames_total = area.len() / area.frame_size() as usize;
        WorkerIo {
            ports: Vec::new(),
            area,
            ring_of: vec![0; frames_total],
            frame_size: cfg.frame_size as usize,
            bind_flags: bind_flags(cfg),
            queue,
            busy_poll: cfg.busy_poll,
            frames_total,
            ring_size: cfg.ring_size as usize,
            fill_target: 0,
            idle_fill: IDLE_FILL_MAX,
            fill_limit: usize::MAX,
            reserve: (frames_total / 4).max(BATCH),
            free,
            scratch: vec![Desc::default(); BATCH],
            scratch_addrs: vec![0; BATCH],
            wants: Vec::new(),
            frame_capacity: (cfg.frame_size as usize).saturating_sub(256),
            _brand: PhantomData,
        }
    }
}

impl Port {
    fn new(ifname: &str, ifindex: u32, queue: u32, sock: Socket, zero_copy: bool) -> Port {
        Port {
            ifname: ifname.to_string(),
            ifindex,
            queue,
            rx_packets: 0,
            warm: false,
            zero_copy,
            tx_budget: 0,
            tx_size: sock.ring_size(),
            sock,
            tx_pending: Vec::with_capacity(BATCH),
            tx_in_flight: 0,
            partial: None,
            in_fill: 0,
            received: 0,
            demand: 0,
            window_received: 0,
            hold: 0,
            tx_kicks: 0,
        }
    }
}

impl<'id> WorkerIo<'id> {
    /// Opens a socket on `ifname` (index `ifindex`) at its receive queue `queue`, on the
    /// shared UMEM, gives it its share of receive frames, and returns its descriptor for the XDP
    /// program's XSKMAP. The ports' most is computed again (`reshare`).
    ///
    /// # Errors
    /// The socket cannot be created or bound (no such queue, already bound, …).
    pub fn add_port(&mut self, ifname: &str, ifindex: u32, queue: u32) -> Result<RawFd, XskError> {
        let sock_err = |reason: String| XskError::Socket {
            ifname: ifname.to_string(),
            queue,
            reason,
            errno: None,
        };
        if ifindex == 0 {
            return Err(sock_err("no such interface".into()));
        }
        // Already open (handed over by the previous kxp).
        if let Some(p) = self.port_at(ifindex, queue) {
            return Ok(self.fd(p));
        }
        let bind = Bind {
            ifindex,
            queue,
            ring_size: self.ring_size as u32,
            flags: self.bind_flags,
        };
        let sock =
            Socket::new(&self.area, self.ports.first().map(|p| &p.sock), bind).map_err(|e| {
                XskError::Socket {
                    ifname: ifname.to_string(),
                    queue,
                    reason: e.to_string(),
                    errno: e.raw_os_error(),
                }
            })?;
        let fd = sock.fd().as_raw_fd();
        if let Some((usecs, budget)) = self.busy_poll {
            crate::sys::set_busy_poll(fd, usecs, budget).map_err(|source| XskError::BusyPoll {
                ifname: ifname.to_string(),
                source,
            })?;
        }
        let zero_copy = sock.zero_copy().unwrap_or(false);
        let mut tx_budget = 0;
        if !zero_copy {
            // Copy mode: one sendto() may send the whole TX ring (Linux 6.17; older
            // kernels keep 32 per call, and `flush_port` kicks again).
            tx_budget = match sock.set_tx_budget(self.ring_size as u32) {
                Ok(()) => self.ring_size as u32,
                Err(e) => {
                    tracing::debug!(interface = %ifname, error = %e, "the TX budget per sendto stays the kernel's default");
                    KERNEL_TX_BUDGET
                }
            };
        }
        let mut port = Port::new(ifname, ifindex, queue, sock, zero_copy);
        port.warm = self.ports.iter().any(|p| p.ifindex == ifindex && p.warm);
        port.tx_budget = tx_budget;
        self.ports.push(port);
        self.reshare();
        self.refill_all(false);
        Ok(fd)
    }

    /// Closes the sockets of the ports on `ifindex`, one per queue this worker serves
    /// there (the interface went away, no longer matches, or changed its queue count),
    /// and takes back every frame their rings held. Returns whether there was such a
    /// port.
    ///
    /// A frame is marked with the port whose fill or TX ring it is put on, and unmarked
    /// when it comes back from the RX or completion ring: the frames of the removed port
    /// are exactly those still marked with it, none of which a [`Frame`] holds (a write
    /// per packet to an array of a few kilobytes, the price of not depending on the
    /// caller to say which frames it holds).
    ///
    /// The first port (the UMEM's own socket) is never removed.
    pub fn remove_port(&mut self, ifindex: u32) -> bool {
        let mut removed = false;
        // Not the first port (index 0).
        while let Some(i) = self
            .ports
            .iter()
            .skip(1)
            .position(|p| p.ifindex == ifindex)
            .map(|i| i + 1)
        {
            let p = self.ports.remove(i);
            self.free.extend(p.tx_pending.iter().map(|d| d.addr));
            // Closing the socket first: the kernel stops using its rings, then what they
            // held is userspace's again.
            drop(p);
            removed = true;
        }
        if !removed {
            return false;
        }
        for (n, owner) in self.ring_of.iter_mut().enumerate() {
            if *owner == ifindex {
                *owner = 0;
                self.free
                    .push(n as u64 * self.frame_size as u64 + XDP_HEADROOM);
            }
        }
        self.reshare();
        true
    }

    /// The most a port's fill ring is given: the UMEM less the reserve, the first port's
    /// [`FIRST_PORT_FILL`] (kxp's own service device) and every other port's
    /// floor, within its ring. Each port's depth follows its traffic (`refill`):
    /// an idle port (a pod's veth between connections) holds its floor, a busy
    /// one what it receives, so frames go where the traffic is, however many ports there
    /// are, instead of an even share that starves a busy uplink beside a hundred idle
    /// pod veths.
    fn reshare(&mut self) {
        let others = self.ports.len().saturating_sub(1);
        let cold = self.ports.iter().skip(1).filter(|p| !p.warm).count();
        let warm = others - cold;
        let pool = self
            .frames_total
            .saturating_sub(self.reserve + FIRST_PORT_FILL + cold * IDLE_FILL);
        self.idle_fill = (pool / (2 * warm.max(1))).clamp(IDLE_FILL, IDLE_FILL_MAX);
        self.fill_target = pool
            .saturating_sub(self.idle_fill * warm.saturating_sub(1))
            .clamp(self.idle_fill, self.ring_size);
    }

    /// The interface of `port` received for the first time: its ports keep the floor
    /// of ports that receive from now on (see [`IDLE_FILL`]).
    fn warm_up(&mut self, port: usize) {
        let ifindex = self.ports[port].ifindex;
        for p in self.ports.iter_mut().filter(|p| p.ifindex == ifindex) {
            p.warm = true;
        }
        self.reshare();
    }

    /// Bounds every port's fill ring (but the first's, kxp's service device) to `frames`
    /// (at least two batches): the most received packets that can wait in the port's
    /// rings, since the kernel receives only into frames it was given. The worker sets it
    /// from its latency budget and the rate it drains packets at, so that at saturation
    /// the interface drops what the budget cannot hold instead of queueing it (see
    /// [`XskConfig::queue_budget_us`]).
    pub fn set_fill_limit(&mut self, frames: usize) {
        self.fill_limit = frames.max(2 * BATCH);
    }

    /// Keeps each port's fill ring, until the next call, at least at what the port
    /// receives in `hold_ns` at the rate it received since the last call (`wall_ns`
    /// ago): the worker's CPU is taken from it for milliseconds at a time (kernel
    /// threads, a vCPU preempted), and what arrives meanwhile waits in frames it was
    /// given instead of being dropped for want of one. Within the fill limit, so that at
    /// saturation the queue budget is what holds.
    pub fn hold_for(&mut self, wall_ns: u64, hold_ns: u64) {
        for p in &mut self.ports {
            let n = std::mem::take(&mut p.window_received) as u128;
            p.hold = (n * u128::from(hold_ns) / u128::from(wall_ns.max(1))) as usize;
        }
    }

    /// See [`WorkerIo::set_fill_limit`].
    pub fn fill_limit(&self) -> usize {
        self.fill_limit
    }

    /// Whether `port`'s socket is in zero-copy mode (else copy mode).
    pub fn zero_copy(&self, port: usize) -> bool {
        self.ports[port].zero_copy
    }

    /// In copy mode, the most frames one sendto() on `port` has the kernel transmit: the
    /// TX ring's size where the kernel takes `XDP_MAX_TX_SKB_BUDGET`, else its default
    /// ([`KERNEL_TX_BUDGET`]); 0 in zero-copy mode (the driver takes what the ring holds).
    pub fn tx_budget(&self, port: usize) -> u32 {
        self.ports[port].tx_budget
    }

    /// The ifindex of `port`.
    pub fn ifindex(&self, port: usize) -> u32 {
        self.ports[port].ifindex
    }

    /// The port on `ifindex`'s receive queue `queue`, if any.
    pub fn port_at(&self, ifindex: u32, queue: u32) -> Option<usize> {
        self.ports
            .iter()
            .position(|p| p.ifindex == ifindex && p.queue == queue)
    }

    /// The port on `ifindex`, if any.
    pub fn port_of(&self, ifindex: u32) -> Option<usize> {
        self.ports.iter().position(|p| p.ifindex == ifindex)
    }

    fn frame_no(frame_size: usize, addr: u64) -> usize {
        addr as usize / frame_size
    }

    pub fn port_count(&self) -> usize {
        self.ports.len()
    }

    pub fn ifname(&self, port: usize) -> &str {
        &self.ports[port].ifname
    }

    /// The socket of `port`, to put in the XDP program's XSKMAP.
    pub fn fd(&self, port: usize) -> RawFd {
        self.ports[port].sock.fd().as_raw_fd()
    }

    /// Every socket: its interface, receive queue and descriptor.
    pub fn sockets(&self) -> Vec<(u32, u32, std::os::fd::BorrowedFd<'_>)> {
        self.ports
            .iter()
            .map(|p| (p.ifindex, p.queue, p.sock.fd()))
            .collect()
    }

    /// A copy of every socket's descriptor, for [`close_in_parallel`] once these sockets
    /// are dropped (then the copies hold the last references).
    pub fn socket_copies(&self) -> Vec<std::os::fd::OwnedFd> {
        self.ports
            .iter()
            .filter_map(|p| p.sock.fd().try_clone_to_owned().ok())
            .collect()
    }

    /// Receives up to [`BATCH`] frames from `port` into `out`; returns how many.
    pub fn recv(&mut self, port: usize, out: &mut Vec<Frame<'id>>) -> usize {
        let p = &mut self.ports[port];
        // SAFETY: `Socket::recv` makes the frames received userspace's: `p.sock` was
        // created on `self.area` (`add_port`), and each descriptor written into `scratch`
        // goes into exactly one Frame, or (a multi-buffer piece) is copied and put in
        // `free`, so none has two owners.
        let n = unsafe { p.sock.recv(&mut self.scratch) };
        p.in_fill = p.in_fill.saturating_sub(n);
        p.rx_packets += n as u64;
        if n > 0 && !p.warm {
            self.warm_up(port);
        }
        let p = &mut self.ports[port];
        p.received += n;
        p.window_received += n;
        let mut packets = 0;
        for i in 0..n {
            let d = self.scratch[i];
            // Off the ring: userspace's (see `remove_port`).
            if let Some(o) = self
                .ring_of
                .get_mut(Self::frame_no(self.frame_size, d.addr))
            {
                *o = 0;
            }
            let more = d.options & XDP_PKT_CONTD != 0;
            let p = &mut self.ports[port];
            if p.partial.is_none() && !more {
                out.push(Frame {
                    buf: Buf::Umem(d),
                    port,
                    _brand: PhantomData,
                });
                packets += 1;
                continue;
            }
            // A piece of a multi-buffer packet: gathered into one buffer, the frame given
            // back at once.
            // SAFETY: `Area::bytes` requires no other access to the frame while the slice
            // lives: it came from the RX ring of a socket on `self.area`, just consumed,
            // so the kernel let go of it (it gets it back only through a fill or TX
            // ring), and no Frame for it exists (it is pushed to `free` only after
            // `piece`'s last use).
            let piece = unsafe { self.area.bytes(&d) };
            let buf = p.partial.get_or_insert_with(|| Vec::with_capacity(16_384));
            if buf.len() + piece.len() <= MAX_PACKET {
                buf.extend_from_slice(piece);
            }
            self.free.push(d.addr);
            if !more && let Some(whole) = p.partial.take() {
                out.push(Frame {
                    buf: Buf::Heap(whole),
                    port,
                    _brand: PhantomData,
                });
                packets += 1;
            }
        }
        packets
    }

    /// The packet bytes of a frame (its current length).
    pub fn bytes<'a>(&'a self, f: &'a mut Frame<'id>) -> &'a mut [u8] {
        let desc = match &mut f.buf {
            Buf::Umem(d) => d,
            Buf::Heap(v) => return v.as_mut_slice(),
        };
        // SAFETY: `Area::bytes` requires no other access to the frame while the slice
        // lives: `f` is a `Frame<'id>`, which only this `WorkerIo<'id>` makes, from its
        // own area's frames (module docs); `f` is its only token (Frame is neither Clone
        // nor Copy), borrowed mutably for 'a, so no other `bytes`/`set_len`/`send`/
        // `recycle` on it meanwhile; and a frame with a token is on no ring, so the
        // kernel does not touch it. Other tokens' frames are disjoint from this one.
        unsafe { self.area.bytes(desc) }
    }

    /// Sets a frame's packet length (up to the frame's data room).
    pub fn set_len(&self, f: &mut Frame<'id>, len: usize) {
        let desc = match &mut f.buf {
            Buf::Umem(d) => d,
            Buf::Heap(v) => {
                v.resize(len.min(MAX_PACKET), 0);
                return;
            }
        };
        desc.len = len.min(self.frame_capacity).min(self.area.room(desc)) as u32;
    }

    /// A frame holding a copy of `bytes`: a UMEM frame when they fit in one, else a
    /// heap buffer (sent as a chain). `None` when no UMEM frame is free.
    pub fn frame_from(&mut self, bytes: &[u8]) -> Option<Frame<'id>> {
        if bytes.len() > self.frame_capacity {
            return Some(Frame {
                buf: Buf::Heap(bytes[..bytes.len().min(MAX_PACKET)].to_vec()),
                port: 0,
                _brand: PhantomData,
            });
        }
        let mut f = self.alloc()?;
        self.set_len(&mut f, bytes.len());
        self.bytes(&mut f).copy_from_slice(bytes);
        Some(f)
    }

    /// A zeroed frame of `len` bytes to build a packet in (UMEM when it fits).
    pub fn alloc_len(&mut self, len: usize) -> Option<Frame<'id>> {
        if len > self.frame_capacity {
            return Some(Frame {
                buf: Buf::Heap(vec![0; len.min(MAX_PACKET)]),
                port: 0,
                _brand: PhantomData,
            });
        }
        let mut f = self.alloc()?;
        self.set_len(&mut f, len);
        Some(f)
    }

    /// Room for packet data in a frame.
    pub fn frame_capacity(&self) -> usize {
        self.frame_capacity
    }

    /// A free frame for a generated packet (an answer, a handed-off packet), if any.
    pub fn alloc(&mut self) -> Option<Frame<'id>> {
        if self.free.is_empty() {
            self.reap();
        }
        let fs = self.frame_size as u64;
        self.free.pop().map(|addr| Frame {
            buf: Buf::Umem(Desc {
                addr: addr / fs * fs + XDP_HEADROOM,
                len: 0,
                options: 0,
            }),
            port: 0,
            _brand: PhantomData,
        })
    }

    /// Gives a frame back (its packet is dropped).
    pub fn recycle(&mut self, f: Frame<'id>) {
        if let Buf::Umem(d) = f.buf {
            self.free.push(d.addr);
        }
    }

    /// Queues a frame for transmission on `port` (sent by [`WorkerIo::flush`]). A packet
    /// larger than a frame leaves as a chain of frames (`XDP_PKT_CONTD`); returns `false`
    /// when there were not enough free frames for it (it is dropped).
    pub fn send(&mut self, port: usize, f: Frame<'id>) -> bool {
        match f.buf {
            Buf::Umem(mut d) => {
                // A frame that was a piece of a received chain may still say "more".
                d.options = 0;
                self.ports[port].tx_pending.push(d)
            }
            Buf::Heap(v) => {
                let cap = self.frame_capacity.max(1);
                let pieces = v.len().div_ceil(cap).max(1);
                if self.free.len() < pieces {
                    self.reap();
                }
                if self.free.len() < pieces {
                    return false;
                }
                for (i, chunk) in v.chunks(cap).enumerate() {
                    let Some(mut g) = self.alloc() else {
                        return false;
                    };
                    self.set_len(&mut g, chunk.len());
                    self.bytes(&mut g).copy_from_slice(chunk);
                    let Buf::Umem(mut d) = g.buf else { continue };
                    d.options = if i + 1 < pieces { XDP_PKT_CONTD } else { 0 };
                    self.ports[port].tx_pending.push(d);
                }
            }
        }
        if self.ports[port].tx_pending.len() >= BATCH {
            self.flush_port(port);
        }
        true
    }

    fn flush_port(&mut self, port: usize) {
        let p = &mut self.ports[port];
        if p.tx_pending.is_empty() {
            return;
        }
        let room = p.sock.tx_free(p.tx_pending.len() as u32) as usize;
        let n = room.min(p.tx_pending.len());
        if n > 0 {
            // SAFETY: `Socket::send` requires (1) frames of the UMEM of `p.sock`,
            // `self.area`: `tx_pending` holds only descriptors of `Frame<'id>`s (`send`),
            // of this worker's UMEM by the brand; (2) frames the caller owns: each came
            // out of a token consumed by value, is in no other list, and leaves
            // `tx_pending` only once the ring took it (`drain`).
            let done = unsafe { p.sock.send(&p.tx_pending[..n]) };
            p.tx_in_flight += done;
            for d in p.tx_pending.drain(..done) {
                if let Some(o) = self
                    .ring_of
                    .get_mut(Self::frame_no(self.frame_size, d.addr))
                {
                    *o = p.ifindex;
                }
            }
        }
        // Copy mode: each sendto() makes the kernel transmit at most its budget (the TX
        // ring on Linux 6.17 and later, see `add_port`; 32 before), so kick until the
        // ring is drained (bounded; transient errors such as EAGAIN or ENOBUFS
        // leave the rest for the next flush).
        for _ in 0..16 {
            if !p.sock.tx_needs_wakeup() {
                break;
            }
            p.tx_kicks += 1;
            if p.sock.tx_wakeup().is_err() {
                break;
            }
            if p.sock.tx_free_exact() >= p.tx_size {
                break;
            }
        }
    }

    /// Sends everything queued, reaps completed transmissions and tops the fill rings up.
    pub fn flush(&mut self) {
        for i in 0..self.ports.len() {
            self.flush_port(i);
        }
        self.reap();
        self.refill_all(true);
    }

    /// Tops up the fill rings: each port to its target (see `target`), the first port
    /// (kxp's service device) first. When the free frames cannot cover every port's
    /// want, they are shared in proportion to the wants: an uplink's queues that carry
    /// one rate each hold the same time's worth of packets (first come, the first queues
    /// took their whole hold and the last ones ran dry within a millisecond of a pause
    /// of the worker, losing most of their packets). With `skip_idle`, a port that
    /// received nothing, asks for nothing more and holds its idle floor (a pod's idle
    /// veth) is not looked at.
    fn refill_all(&mut self, skip_idle: bool) {
        let mut wants = std::mem::take(&mut self.wants);
        wants.clear();
        for i in 0..self.ports.len() {
            let p = &self.ports[i];
            let idle = i > 0
                && p.received == 0
                && p.demand == 0
                && p.hold == 0
                && p.in_fill >= self.floor(p);
            let want = if skip_idle && idle {
                0
            } else {
                self.target(i).saturating_sub(self.ports[i].in_fill)
            };
            wants.push(want);
        }
        if let Some(&first) = wants.first() {
            self.give(0, first);
        }
        let share = self.free.len().saturating_sub(self.reserve);
        let total: usize = wants.iter().skip(1).sum();
        for (i, &want) in wants.iter().enumerate().skip(1) {
            let n = if total <= share {
                want
            } else {
                // Within `share`: the sum of the rounded-down parts is at most `share`.
                (want as u128 * share as u128 / total as u128) as usize
            };
            self.give(i, n);
        }
        self.wants = wants;
    }

    fn reap(&mut self) {
        for p in self.ports.iter_mut().filter(|p| p.tx_in_flight > 0) {
            loop {
                // SAFETY: `Socket::completed` makes the frames userspace's: the completed
                // frames (ones this worker put on `p.sock`'s TX ring, which the kernel has
                // finished reading) go to `free`, once each.
                let n = unsafe { p.sock.completed(&mut self.scratch_addrs) };
                if n == 0 {
                    break;
                }
                p.tx_in_flight = p.tx_in_flight.saturating_sub(n);
                for &a in &self.scratch_addrs[..n] {
                    if let Some(o) = self.ring_of.get_mut(Self::frame_no(self.frame_size, a)) {
                        *o = 0;
                    }
                }
                self.free.extend_from_slice(&self.scratch_addrs[..n]);
            }
        }
    }

    /// What `p`'s fill ring keeps when it is idle (see [`IDLE_FILL`]).
    fn floor(&self, p: &Port) -> usize {
        if p.warm { self.idle_fill } else { IDLE_FILL }
    }

    /// The fill depth `port` is given this round (and its demand, updated from what it
    /// received since the last round).
    fn target(&mut self, port: usize) -> usize {
        let cap = self.fill_target;
        let floor = self.floor(&self.ports[port]);
        let p = &mut self.ports[port];
        // Fill depth follows traffic: frames in an idle port's fill ring are out of use
        // until it receives, so no port hoards the UMEM that ports attached later need.
        p.demand = (p.demand - p.demand.div_ceil(8)).max(p.received * 64);
        p.received = 0;
        if port == 0 {
            FIRST_PORT_FILL
        } else {
            (floor + p.demand).max(p.hold).min(cap).min(self.fill_limit)
        }
    }

    /// Puts up to `want` free frames (never the reserve) on `port`'s fill ring.
    fn give(&mut self, port: usize, want: usize) {
        let share = self.free.len().saturating_sub(self.reserve);
        let p = &mut self.ports[port];
        if share == 0 || want == 0 {
            return;
        }
        let room = p.sock.fill_free(want as u32) as usize;
        let n = room.min(share).min(want);
        if n == 0 {
            return;
        }
        let start = self.free.len() - n;
        // SAFETY: `Socket::fill` requires (1) frames of the UMEM of `p.sock`,
        // `self.area`: `free` holds only its frames (module docs); (2) frames the caller
        // owns: a frame in `free` is there once, has no token and is on no ring, and only
        // the `done` taken leave it (`drain`).
        let done = unsafe { p.sock.fill(&self.free[start..]) };
        if done > 0 {
            // produce() takes the slice from its start.
            for a in self.free.drain(start..start + done) {
                if let Some(o) = self.ring_of.get_mut(Self::frame_no(self.frame_size, a)) {
                    *o = p.ifindex;
                }
            }
            p.in_fill += done;
        }
        if p.sock.fill_needs_wakeup() {
            p.sock.fill_wakeup();
        }
    }

    /// Kernel statistics of `port`'s socket.
    pub fn stats(&self, port: usize) -> PortStats {
        match self.ports[port].sock.statistics() {
            Ok(s) => PortStats {
                queue: self.ports[port].queue,
                rx_packets: self.ports[port].rx_packets,
                rx_dropped: s.rx_dropped,
                rx_ring_full: s.rx_ring_full,
                rx_fill_ring_empty: s.rx_fill_ring_empty_descs,
                tx_invalid: s.tx_invalid_descs,
                tx_ring_empty: s.tx_ring_empty_descs,
            },
            Err(_) => PortStats {
                queue: self.ports[port].queue,
                rx_packets: self.ports[port].rx_packets,
                ..PortStats::default()
            },
        }
    }

    /// Frames owned by userspace and not queued anywhere.
    pub fn free_frames(&self) -> usize {
        self.free.len()
    }

    /// With preferred busy polling: a non-blocking zero-length receive on every socket,
    /// which makes the kernel run the devices' receive processing on this CPU now.
    pub fn busy_poll_kick(&self) {
        for p in &self.ports {
            p.sock.kick_rx();
        }
    }

    /// All sockets' descriptors (for `poll`).
    pub fn fds(&self) -> Vec<RawFd> {
        (0..self.ports.len()).map(|i| self.fd(i)).collect()
    }
}

/// Closes `fds`, sockets whose other descriptors and ring mappings are gone, from many
/// threads at once. Releasing a bound AF_XDP socket waits for a network RCU grace period
/// (`synchronize_net` in the kernel's `xsk_unbind_dev`): a worker with 112 sockets took
/// 1.3 s to stop closing them one after another, a kxp restart's gap; in parallel the
/// waits overlap.
pub fn close_in_parallel(mut fds: Vec<std::os::fd::OwnedFd>) {
    const THREADS: usize = 64;
    let per = fds.len().div_ceil(THREADS).max(1);
    std::thread::scope(|s| {
        while !fds.is_empty() {
            let chunk: Vec<_> = fds.drain(..per.min(fds.len())).collect();
            // (Where no thread can start, the chunk is dropped here: closed in turn.)
            let _ = std::thread::Builder::new()
                .name("kxp-close".into())
                .spawn_scoped(s, move || drop(chunk));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use lab::Topology;

    /// A namespace for the sockets with two veths, `anchor` (the UMEM's first socket, as
    /// kxp's service device) and `pod`, to a peer namespace; the namespace's name.
    fn two_links(prefix: &str) -> (Topology, String) {
        let mut topo = Topology::new(prefix);
        let ns = topo.add_ns_unique("io").unwrap();
        let peer = topo.add_ns_unique("peer").unwrap();
        topo.link((&ns, "anchor", ""), (&peer, "a0", "")).unwrap();
        topo.link((&ns, "pod", ""), (&peer, "p0", "")).unwrap();
        (topo, ns)
    }

    /// Runs `f` on a worker's sockets in a [`two_links`] namespace, `pod` added as a
    /// port (its index passed), the fill limit set to `fill_limit` before it is.
    fn with_pod<T: Send>(
        prefix: &str,
        fill_limit: usize,
        f: impl for<'id> FnOnce(&mut WorkerIo<'id>, usize) -> T + Send,
    ) -> T {
        assert!(
            crate::sys::is_root(),
            "needs root: it opens AF_XDP sockets in a netns"
        );
        let (topo, ns) = two_links(prefix);
        topo.run_in(&ns, || {
            let sockets = Sockets::open(&XskConfig::default(), &["anchor".to_string()], 0).unwrap();
            sockets.with(|mut io| {
                io.set_fill_limit(fill_limit);
                let ifindex = crate::xdp::ifindex_of("pod").unwrap();
                io.add_port("pod", ifindex, 0).unwrap();
                let port = io.port_of(ifindex).unwrap();
                f(&mut io, port)
            })
        })
        .unwrap()
    }

    /// The fill limit bounds what a busy port is given (the kernel can then hold no more
    /// received packets than that), and raising it lets the port take more again.
    #[test]
    fn a_fill_limit_bounds_what_a_busy_port_is_given() {
        let given = with_pod("kxqf", 200, |io, port| {
            // veths have no AF_XDP zero-copy: asked for first, copy mode it is.
            assert!(!io.zero_copy(0) && !io.zero_copy(port));
            let mut given = Vec::new();
            for limit in [200, 10, usize::MAX] {
                io.set_fill_limit(limit);
                // A port that received a lot asks for up to its share.
                io.ports[port].demand = 100_000;
                for _ in 0..4 {
                    io.flush();
                }
                given.push((io.fill_limit(), io.ports[port].in_fill));
            }
            given
        });
        assert_eq!(given[0], (200, 200), "{given:?}");
        // At least two batches; lowering the limit takes no frame back (the ring drains
        // to it as the port receives).
        assert_eq!(given[1], (2 * BATCH, 200), "{given:?}");
        assert!(given[2].1 > 1000, "unbounded, the port's share: {given:?}");
    }

    /// A port keeps, until the next window, what it received in the hold time at the
    /// last window's rate, within its share and the fill limit; an idle port goes back
    /// to its floor.
    #[test]
    fn a_receiving_port_holds_a_pause_worth_of_frames() {
        let (cold, held, limited, idle) = with_pod("kxqh", usize::MAX, |io, port| {
            let depth = |io: &mut WorkerIo<'_>, received: usize, limit: usize| {
                io.set_fill_limit(limit);
                // 1 ms at `received` a ms, held for 0.8 ms of it.
                io.ports[port].window_received = received;
                io.hold_for(1_000_000, 800_000);
                for _ in 0..4 {
                    io.flush();
                }
                (io.ports[port].hold, io.ports[port].in_fill)
            };
            // A port that never received keeps the least floor.
            let cold = io.ports[port].in_fill;
            io.ports[port].warm = true;
            let held = depth(io, 1_000, usize::MAX);
            // Taken back as the port receives (here: by hand).
            io.ports[port].in_fill = 0;
            let limited = depth(io, 1_000, 300);
            io.ports[port].in_fill = 0;
            let idle = depth(io, 0, usize::MAX);
            (cold, held, limited, idle)
        });
        assert_eq!(cold, IDLE_FILL);
        assert_eq!(held, (800, 800));
        assert_eq!(limited, (800, 300), "the fill limit holds");
        assert_eq!(idle, (0, IDLE_FILL_MAX), "an idle port keeps its floor");
    }

    /// When the free frames cannot cover what every port should hold, the ports share
    /// them in proportion: four queues of one link carrying one rate each hold the same,
    /// none left with its floor alone (first come, the first two took their whole hold
    /// and the last one kept 16 frames: a millisecond's pause of the worker lost most of
    /// its packets).
    #[test]
    fn queues_that_want_more_than_the_umem_share_it_evenly() {
        assert!(
            crate::sys::is_root(),
            "needs root: it opens AF_XDP sockets in a netns"
        );
        let mut topo = Topology::new("kxqe");
        let ns = topo.add_ns_unique("io").unwrap();
        let peer = topo.add_ns_unique("peer").unwrap();
        topo.link((&ns, "anchor", ""), (&peer, "a0", "")).unwrap();
        topo.link_multiqueue((&ns, "uplink", ""), (&peer, "u0", ""), 4)
            .unwrap();
        let (fills, free) = topo
            .run_in(&ns, || {
                let sockets =
                    Sockets::open(&XskConfig::default(), &["anchor".to_string()], 0).unwrap();
                sockets.with(|mut io| {
                    let ifindex = crate::xdp::ifindex_of("uplink").unwrap();
                    let ports: Vec<usize> = (0..4)
                        .map(|q| {
                            io.add_port("uplink", ifindex, q).unwrap();
                            io.ports.len() - 1
                        })
                        .collect();
                    io.warm_up(ports[0]);
                    // Each queue received 3,000 packets in a millisecond: each should
                    // hold 2,400 for a 0.8 ms pause, 9,600 in all, more than the UMEM
                    // has beside its reserve.
                    for &p in &ports {
                        io.ports[p].window_received = 3_000;
                    }
                    io.hold_for(1_000_000, 800_000);
                    for _ in 0..4 {
                        io.flush();
                    }
                    let fills: Vec<usize> = ports.iter().map(|&p| io.ports[p].in_fill).collect();
                    (fills, io.free.len())
                })
            })
            .unwrap();
        let (min, max) = (fills.iter().min().unwrap(), fills.iter().max().unwrap());
        assert!(max - min <= 1, "an even share: {fills:?}");
        let reserve = XskConfig::default().frames as usize / 4;
        assert!(
            free <= reserve + 4,
            "every frame but the reserve given: {free} free, {fills:?}"
        );
    }

    /// In copy mode one sendto() sends a whole batch (the TX budget is the ring, not the
    /// kernel's default 32 per call), and every frame leaves.
    #[test]
    fn one_kick_sends_a_whole_batch() {
        // This thread's network namespace's counters (sysfs shows the mounter's).
        let tx_packets = || -> u64 {
            let dev = std::fs::read_to_string("/proc/thread-self/net/dev").unwrap();
            let line = dev
                .lines()
                .find_map(|l| l.trim_start().strip_prefix("pod:"))
                .unwrap();
            // Receive: bytes packets errs drop fifo frame compressed multicast; then
            // transmit: bytes packets …
            line.split_whitespace().nth(9).unwrap().parse().unwrap()
        };
        let (kicks, sent, budget) = with_pod("kxqk", usize::MAX, |io, port| {
            let before = tx_packets();
            let mut frame = [0u8; 60];
            frame[..6].copy_from_slice(&[0xff; 6]);
            frame[12..14].copy_from_slice(&[0x88, 0xb5]);
            // `send` flushes by itself when a batch is queued.
            for _ in 0..BATCH {
                let f = io.frame_from(&frame).unwrap();
                assert!(io.send(port, f));
            }
            (
                io.ports[port].tx_kicks,
                tx_packets() - before,
                io.tx_budget(port),
            )
        });
        // Every frame left. The interface's count may also hold a frame or two of the
        // kernel's own, sent in the same window after the link came up (IPv6 MLD
        // reports, router solicitations): CI saw 65 for 64 twice.
        let batch = BATCH as u64;
        assert!(
            (batch..batch + 8).contains(&sent),
            "{sent} sent for {batch}"
        );
        // Linux 6.17 and later take the budget; before, the kernel's 32 per call stay.
        let want = if budget == KERNEL_TX_BUDGET { 2 } else { 1 };
        assert!(
            budget == KERNEL_TX_BUDGET || budget == XskConfig::default().ring_size,
            "{budget}"
        );
        assert_eq!(
            kicks, want,
            "sendto() calls for one batch of {BATCH}, budget {budget}"
        );
    }

    #[test]
    fn a_removed_port_gives_back_every_frame_its_rings_held() {
        assert!(
            crate::sys::is_root(),
            "needs root: it opens AF_XDP sockets in a netns"
        );
        let (topo, ns) = two_links("kxpq");
        let (before, during, after) = topo
            .run_in(&ns, || {
                let cfg = XskConfig::default();
                let sockets = Sockets::open(&cfg, &["anchor".to_string()], 0).unwrap();
                sockets.with(|mut io| {
                    let before = io.free_frames();
                    let ifindex = crate::xdp::ifindex_of("pod").unwrap();
                    io.add_port("pod", ifindex, 0).unwrap();
                    io.flush();
                    let during = io.free_frames();
                    assert!(io.remove_port(ifindex));
                    (before, during, io.free_frames())
                })
            })
            .unwrap();
        assert!(
            during < before,
            "the new port's fill ring took frames: {during} / {before}"
        );
        assert_eq!(after, before, "every frame of the removed port came back");
    }

    impl WorkerIo<'_> {
        /// Frames accounted for: free, on fill rings, on TX rings, waiting for them.
        fn accounted(&self) -> usize {
            self.free.len()
                + self
                    .ports
                    .iter()
                    .map(|p| p.in_fill + p.tx_in_flight + p.tx_pending.len())
                    .sum::<usize>()
        }
    }

    /// A worker's sockets handed over (as to the next kxp) are taken up where they were
    /// left: the same ports, every frame accounted for (free, on a ring, or waiting to be
    /// sent), and sending goes on, the frames sent before the hand-over coming back to
    /// the new owner.
    #[test]
    fn handed_over_sockets_are_taken_up_where_they_were_left() {
        assert!(
            crate::sys::is_root(),
            "needs root: it opens AF_XDP sockets in a netns"
        );
        let (topo, ns) = two_links("kxph");
        let frame = [0x02u8; 60];
        topo.run_in(&ns, || {
            let cfg = XskConfig::default();
            let total = cfg.frames as usize;
            let ifindex = crate::xdp::ifindex_of("pod").unwrap();
            // The rings are mapped ahead by the next process (lent while this one goes on
            // sending), and taken up where they are at the hand-over.
            let (handed, mut premapped) = Sockets::open(&cfg, &["anchor".to_string()], 0)
                .unwrap()
                .with(|mut io| {
                    io.add_port("pod", ifindex, 0).unwrap();
                    io.flush();
                    let (premapped, failed) = Premapped::map(vec![io.lend().unwrap()]);
                    assert_eq!((premapped.sockets(), failed), (2, 0));
                    for i in 0..200 {
                        let f = io.frame_from(&frame).unwrap();
                        assert!(io.send(1, f));
                        if i == 100 {
                            io.flush();
                        }
                    }
                    assert_eq!(io.accounted(), total);
                    (io.hand_over().unwrap(), premapped)
                });
            assert_eq!(handed.sockets.len(), 2);
            let state = handed.state.clone();
            assert_eq!(HandedState::decode(&state.encode()).unwrap(), state);
            // A kxp that makes its UMEM otherwise refuses them, saying why.
            let copy = Handed {
                memfd: handed.memfd.try_clone().unwrap(),
                sockets: handed
                    .sockets
                    .iter()
                    .map(|s| s.try_clone().unwrap())
                    .collect(),
                state: state.clone(),
            };
            let other = XskConfig {
                ring_size: 2048,
                ..cfg.clone()
            };
            let e = Sockets::adopt(&other, copy, &mut Premapped::default())
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("rings of 4096") && e.contains("rings of 2048"),
                "{e}"
            );
            let sockets = Sockets::adopt(&cfg, handed, &mut premapped).unwrap();
            assert_eq!(premapped.sockets(), 0, "every socket mapped ahead taken up");
            sockets.with(|mut io| {
                assert_eq!(io.port_count(), 2);
                assert_eq!(io.port_at(ifindex, 0), Some(1));
                assert_eq!(io.accounted(), total, "every frame accounted for");
                for _ in 0..50 {
                    let f = io.frame_from(&frame).unwrap();
                    assert!(io.send(1, f));
                }
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
                while io
                    .ports
                    .iter()
                    .any(|p| p.tx_in_flight + p.tx_pending.len() > 0)
                    && std::time::Instant::now() < deadline
                {
                    io.flush();
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                assert!(
                    io.ports.iter().all(|p| p.tx_in_flight == 0),
                    "every frame sent, before and after the hand-over, came back"
                );
                assert_eq!(io.accounted(), total);
            });
        })
        .unwrap();
    }
}
