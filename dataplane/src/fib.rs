//! The host's forwarding state, mirrored from netlink: where a translated packet goes
//! next, and with which source and destination MAC.
//!
//! After a worker rewrites a packet it transmits the frame itself on an AF_XDP socket, so
//! it must do what the kernel's `ip_finish_output2` would have done: a FIB lookup, then a
//! neighbour lookup. kxp does not keep forwarding state of its own; it follows the host's
//! routing and neighbour tables (`ip route`, `ip neigh`), so operators keep their tools.
//!
//! A background thread ([`FibMirror`]) with its own current-thread tokio runtime
//! subscribes to the link, address, route and neighbour netlink groups first, then dumps
//! links, addresses, routes (tables local, main and default, in the order of the default
//! policy rules) and neighbours, and applies events idempotently. After each batch it
//! publishes an immutable [`FibTable`] with one pointer swap (arc-swap). Workers read it
//! through a [`FibView`]: no locks, no allocation, no syscalls per packet.
//!
//! The rule that matters: **a frame is never sent with a MAC the kernel would not use**.
//! Only neighbours in REACHABLE, STALE, DELAY, PROBE, PERMANENT or NOARP state give a MAC
//! (the kernel also transmits on STALE and moves it to DELAY). For any other state the
//! lookup answers [`Route::Pending`] and asks the kernel to resolve the next hop
//! (RTM_NEWNEIGH with `NTF_USE`, which runs `neigh_event_send`: ARP or neighbour
//! solicitation, exactly as if the kernel had a packet to send). The answer arrives as a
//! neighbour event and the next lookup forwards.
//!
//! Limits (the lookup answers [`Route::Unreachable`] rather than guess): policy routing
//! rules other than the default ones, TOS- and source-specific routes, routes using
//! nexthop objects (`ip nexthop`) or lightweight tunnel encapsulation, multicast
//! destinations. ECMP routes use their first live nexthop.
//!
//! The kernel does not send RTM_DELROUTE for IPv4 routes it flushes when a link goes
//! down or an address disappears; the mirror re-dumps the routes after such events.

mod dir4;
mod lpm;
mod mirror;
mod state;
mod table;
#[cfg(test)]
mod tests_netns;
#[cfg(test)]
mod tests_unit;

use std::cell::{Cell, RefCell};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, Guard};

pub use mirror::FibMirror;
pub use table::FibTable;

/// How to put a frame on the wire: the egress interface and the Ethernet addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NextHop {
    /// The egress interface (one kxp drives).
    pub ifindex: u32,
    /// The egress interface's MAC.
    pub src_mac: [u8; 6],
    /// The next hop's MAC (gateway or destination), from a usable neighbour entry.
    pub dst_mac: [u8; 6],
}

/// A link of the host, as the mirror last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkInfo {
    pub ifindex: u32,
    pub name: String,
    pub up: bool,
    pub mac: Option<[u8; 6]>,
}

/// What the host's tables say about one destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// Send it: the next hop's MAC is known.
    Forward(NextHop),
    /// The next hop's MAC is not known (no entry, INCOMPLETE or FAILED). Resolution was
    /// requested from the kernel (rate-limited); try again later, drop or hand the packet
    /// to the kernel.
    Pending,
    /// The route leaves through an interface kxp does not drive (hand the packet to the
    /// kernel instead).
    NotAttached { ifindex: u32 },
    /// The destination is an address of this host.
    Local,
    /// No usable route (none, blackhole/unreachable/prohibit, egress down or without a
    /// MAC, or a route kind the mirror does not model).
    Unreachable,
}

/// Setup and run-time errors of the mirror.
#[derive(Debug, thiserror::Error)]
pub enum FibError {
    #[error(
        "cannot {op} the netlink route socket (kxp needs CAP_NET_ADMIN in the host network namespace)"
    )]
    Netlink {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot {op} the FIB mirror's thread")]
    Thread {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("netlink {what} dump failed: {detail}")]
    Dump { what: &'static str, detail: String },
    #[error("the FIB mirror has not applied its first full dump after {waited:?}")]
    NotReady { waited: Duration },
    #[error("the FIB mirror thread stopped: {reason}")]
    Stopped { reason: String },
}

/// The tables as last published, and how many times they were: a view checks the count
/// (one load of a line written only when tables are published) before it trusts its
/// route cache, instead of pinning the tables themselves for every packet.
pub(crate) struct Published {
    tables: ArcSwap<FibTable>,
    count: AtomicU64,
}

impl Published {
    pub(crate) fn new(tables: FibTable) -> Published {
        Published {
            tables: ArcSwap::from_pointee(tables),
            count: AtomicU64::new(0),
        }
    }

    pub(crate) fn load(&self) -> Guard<Arc<FibTable>> {
        self.tables.load()
    }

    /// Publishes `tables`: stored first, then counted, so that a view which sees the new
    /// count loads these tables (or newer).
    pub(crate) fn store(&self, tables: Arc<FibTable>) {
        self.tables.store(tables);
        self.count.fetch_add(1, Ordering::Release);
    }

    /// Publishes `f` of the current tables (see [`ArcSwap::rcu`]).
    pub(crate) fn rcu(&self, f: impl FnMut(&Arc<FibTable>) -> FibTable) {
        self.tables.rcu(f);
        self.count.fetch_add(1, Ordering::Release);
    }

    fn count(&self) -> u64 {
        self.count.load(Ordering::Acquire)
    }
}

/// One worker's handle on the mirrored tables. Cheap to clone (each clone has its own
/// resolution rate limiter and route cache); `Send` but not `Sync`: give one to each
/// worker.
pub struct FibView {
    table: Arc<Published>,
    requests: crossbeam::channel::Sender<mirror::ResolveRequest>,
    wake: Arc<tokio::sync::Notify>,
    throttle: Throttle,
    cache: RefCell<RouteCache>,
}

/// The answers [`FibView::route`] gave for the tables `of`, by destination
/// (direct-mapped): a worker sends most packets to a few destinations (the endpoints of
/// busy flows, their clients), and a lookup walks the prefix levels of three tables and
/// the neighbour table. Emptied when other tables are published (a route, address, link
/// or neighbour changed, or the attached interfaces), which the publication count tells
/// (`of` is the tables of publication `count`). [`Route::Pending`] is never kept (it
/// asks for a resolution, and the next lookup must look again).
struct RouteCache {
    count: u64,
    of: Option<Arc<FibTable>>,
    slots: Box<[Option<(IpAddr, Route)>]>,
}

/// Destinations a worker's route cache holds (a power of two).
const ROUTE_CACHE_SLOTS: usize = 256;

impl RouteCache {
    fn new() -> Self {
        RouteCache {
            count: 0,
            of: None,
            slots: vec![None; ROUTE_CACHE_SLOTS].into(),
        }
    }

    fn slot(dst: IpAddr) -> usize {
        let folded = match dst {
            IpAddr::V4(a) => u64::from(a.to_bits()),
            IpAddr::V6(a) => {
                let b = a.to_bits();
                (b as u64) ^ ((b >> 64) as u64)
            }
        };
        (folded.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % ROUTE_CACHE_SLOTS
    }
}

/// A snapshot of the tables pinned for one batch of packets: load once per batch with
/// [`FibView::load`], then look up every packet of the batch against it.
pub struct FibSnapshot<'a> {
    table: Guard<Arc<FibTable>>,
    view: &'a FibView,
}

impl FibView {
    fn new(
        table: Arc<Published>,
        requests: crossbeam::channel::Sender<mirror::ResolveRequest>,
        wake: Arc<tokio::sync::Notify>,
    ) -> Self {
        FibView {
            table,
            requests,
            wake,
            throttle: Throttle::new(),
            cache: RefCell::new(RouteCache::new()),
        }
    }

    /// Pins the current tables (one atomic load), for a batch of lookups.
    pub fn load(&self) -> FibSnapshot<'_> {
        FibSnapshot {
            table: self.table.load(),
            view: self,
        }
    }

    /// Where to send a packet for `dst`: see [`FibSnapshot::route`]. The answer for the
    /// current tables is remembered (see `RouteCache`), so a worker's next packet to the
    /// same destination costs one load of the publication count and one comparison.
    pub fn route(&self, dst: IpAddr) -> Route {
        let count = self.table.count();
        let mut cache = self.cache.borrow_mut();
        let cache = &mut *cache;
        let of = match &cache.of {
            Some(of) if cache.count == count => of,
            _ => {
                cache.count = count;
                cache.slots.fill(None);
                cache.of.insert(self.table.tables.load_full())
            }
        };
        let slot = RouteCache::slot(dst);
        if let Some((d, route)) = cache.slots[slot]
            && d == dst
        {
            return route;
        }
        let route = self.resolve(of, dst);
        if route != Route::Pending {
            cache.slots[slot] = Some((dst, route));
        }
        route
    }

    /// `dst`'s route in `table` (see [`FibSnapshot::route`]).
    fn resolve(&self, table: &FibTable, dst: IpAddr) -> Route {
        match table.resolve(dst) {
            table::Resolved::Route(route) => route,
            table::Resolved::Unresolved { ifindex, next_hop } => {
                self.request_resolution(ifindex, next_hop);
                Route::Pending
            }
        }
    }

    /// The source address masquerade uses towards `dst`: see [`FibSnapshot::source_for`].
    pub fn source_for(&self, dst: IpAddr) -> Option<IpAddr> {
        self.table.load().source_for(dst)
    }

    /// Every address of the host, every family and scope, loopback included (the set the
    /// XDP program treats as "to this host").
    pub fn local_addrs(&self) -> Vec<IpAddr> {
        self.table.load().local_addrs()
    }

    /// The MTU of link `ifindex`, if known.
    pub fn mtu(&self, ifindex: u32) -> Option<u32> {
        self.table
            .load()
            .links
            .get(&ifindex)
            .map(|l| l.mtu)
            .filter(|&m| m > 0)
    }

    /// The name of the link `ifindex` is a port of (its bridge or bond: `IFLA_MASTER`),
    /// if it is one: the interface its packets arrive on at layer 3, where kube-proxy's
    /// rules match `iifname`.
    pub fn master_name(&self, ifindex: u32) -> Option<String> {
        let t = self.table.load();
        let master = t.links.get(&ifindex)?.master?;
        t.links.get(&master).map(|l| l.name.clone())
    }

    /// Whether `ifindex` is a VLAN device (the kernel tags what is sent on it).
    pub fn is_vlan_device(&self, ifindex: u32) -> bool {
        self.table
            .load()
            .links
            .get(&ifindex)
            .is_some_and(|l| l.vlan)
    }

    /// Every link of the host (this network namespace), as netlink last said.
    pub fn links(&self) -> Vec<LinkInfo> {
        let t = self.table.load();
        let mut v: Vec<LinkInfo> = t
            .links
            .iter()
            .map(|(&ifindex, l)| LinkInfo {
                ifindex,
                name: l.name.clone(),
                up: l.up,
                mac: l.mac,
            })
            .collect();
        v.sort_by_key(|l| l.ifindex);
        v
    }

    /// Bumped on every publication; 0 until the first full dump is applied.
    pub fn generation(&self) -> u64 {
        self.table.load().generation()
    }

    fn request_resolution(&self, ifindex: u32, ip: IpAddr) {
        if !self.throttle.allow(ifindex, ip) {
            return;
        }
        // Full queue: the mirror is behind; the next Pending lookup asks again.
        if self
            .requests
            .try_send(mirror::ResolveRequest { ifindex, ip })
            .is_ok()
        {
            self.wake.notify_one();
        }
    }
}

impl Clone for FibView {
    fn clone(&self) -> Self {
        FibView::new(self.table.clone(), self.requests.clone(), self.wake.clone())
    }
}

impl fmt::Debug for FibView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FibView")
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

impl engine::MasqueradeSource for FibView {
    fn source_for(&self, endpoint: IpAddr) -> Option<IpAddr> {
        FibView::source_for(self, endpoint)
    }
}

impl FibSnapshot<'_> {
    /// Longest-prefix match in tables local, main, default (the default rules' order),
    /// then the neighbour of the gateway (or of `dst` for an on-link route) on the egress
    /// interface. No allocation and no syscall, except that [`Route::Pending`] queues a
    /// resolution request (non-blocking, at most once per 100 ms per next hop and view).
    pub fn route(&self, dst: IpAddr) -> Route {
        self.view.resolve(&self.table, dst)
    }

    /// The preferred source of the route towards `dst`, else an address of the egress
    /// interface of `dst`'s family (one on the next hop's subnet first, primary before
    /// secondary), else any such address of the host. `None` without a route.
    pub fn source_for(&self, dst: IpAddr) -> Option<IpAddr> {
        self.table.source_for(dst)
    }

    /// The pinned tables themselves.
    pub fn table(&self) -> &FibTable {
        &self.table
    }
}

impl fmt::Debug for FibSnapshot<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FibSnapshot")
            .field("generation", &self.table.generation())
            .finish()
    }
}

/// Per-view, per-next-hop rate limit for resolution requests: a direct-mapped array of
/// (next-hop hash, last request time). A collision only costs an extra request, which
/// the mirror thread deduplicates again.
struct Throttle {
    epoch: Instant,
    slots: Box<[Cell<(u64, u64)>]>,
}

const THROTTLE_SLOTS: usize = 256;
/// At most one resolution request per next hop and view in this interval.
pub const RESOLVE_INTERVAL: Duration = Duration::from_millis(100);

impl Throttle {
    fn new() -> Self {
        Throttle {
            epoch: Instant::now(),
            slots: vec![Cell::new((0, 0)); THROTTLE_SLOTS].into(),
        }
    }

    fn allow(&self, ifindex: u32, ip: IpAddr) -> bool {
        let key = state::next_hop_hash(ifindex, ip) | 1;
        let slot = &self.slots[(key >> 32) as usize % THROTTLE_SLOTS];
        // +1 so that a request at the epoch is distinguishable from "never".
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX) + 1;
        let (last_key, last) = slot.get();
        let interval = RESOLVE_INTERVAL.as_nanos() as u64;
        if last_key == key && last != 0 && now.saturating_sub(last) < interval {
            return false;
        }
        slot.set((key, now));
        true
    }
}
