//! The mirror thread: a current-thread tokio runtime that owns one netlink route socket
//! (subscribed before anything is dumped), keeps the tables current and serves
//! resolution requests from the workers.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use futures::channel::mpsc::UnboundedReceiver;
use futures::{FutureExt, StreamExt};
use rtnetlink::packet_core::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::address::AddressMessage;
use rtnetlink::packet_route::link::LinkMessage;
use rtnetlink::packet_route::neighbour::{NeighbourFlags, NeighbourMessage, NeighbourState};
use rtnetlink::packet_route::route::RouteMessage;
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::sys::SocketAddr;
use rtnetlink::{Handle, MulticastGroup};
use tokio::sync::{Notify, oneshot};

use super::table::FibTable;
use super::{FibError, FibView, Published, RESOLVE_INTERVAL};

/// A worker's request to resolve the neighbour `ip` on `ifindex`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct ResolveRequest {
    pub ifindex: u32,
    pub ip: IpAddr,
}

/// Capacity of the resolution request queue (workers never block on it).
const REQUEST_QUEUE: usize = 1024;
/// Requests served per wake-up, so that events are never starved.
const REQUESTS_PER_ROUND: usize = 64;
/// Events applied before a publication, at most (a dump's backlog is applied whole).
const EVENTS_PER_BATCH: usize = 4096;
/// Netlink receive buffer: events arriving faster than this are lost (ENOBUFS) and the
/// mirror re-dumps everything.
const RCVBUF: usize = 8 << 20;
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

const GROUPS: [MulticastGroup; 6] = [
    MulticastGroup::Link,
    MulticastGroup::Ipv4Ifaddr,
    MulticastGroup::Ipv6Ifaddr,
    MulticastGroup::Ipv4Route,
    MulticastGroup::Ipv6Route,
    MulticastGroup::Neigh,
];

type Events = UnboundedReceiver<(NetlinkMessage<RouteNetlinkMessage>, SocketAddr)>;

/// Mirrors the host's links, addresses, routes and neighbours (of the network namespace
/// of the thread that calls [`FibMirror::start`]) and publishes them to [`FibView`]s.
/// Stopping it (or dropping it) ends and joins its thread; views keep the last tables.
pub struct FibMirror {
    table: Arc<Published>,
    attached: Arc<Mutex<Arc<[u32]>>>,
    published: crossbeam::channel::Receiver<()>,
    requests: crossbeam::channel::Sender<ResolveRequest>,
    wake: Arc<Notify>,
    ready: Arc<Ready>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// Readiness of the first full dump, for [`FibMirror::wait_ready`].
#[derive(Default)]
struct Ready {
    state: Mutex<ReadyState>,
    changed: Condvar,
}

#[derive(Debug, Clone, Default)]
enum ReadyState {
    #[default]
    Starting,
    Ready,
    Failed(String),
}

impl Ready {
    fn set(&self, state: ReadyState) {
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // Once ready, later failures are logged, not reported (views keep working).
        if !matches!(*guard, ReadyState::Ready) {
            *guard = state;
            self.changed.notify_all();
        }
    }
}

impl FibMirror {
    /// Starts the mirror in the calling thread's network namespace. `attached` lists the
    /// interfaces kxp transmits on; routes through any other give
    /// [`Route::NotAttached`](super::Route::NotAttached). Returns once the netlink socket
    /// is open and subscribed; the first dump then runs in the background
    /// ([`wait_ready`](Self::wait_ready)).
    ///
    /// # Errors
    /// [`FibError::Thread`] if the thread or its runtime cannot start, [`FibError::Netlink`]
    /// if the netlink socket cannot be opened, sized or subscribed.
    pub fn start(attached: &[u32]) -> Result<FibMirror, FibError> {
        let table = Arc::new(Published::new(FibTable::new_with_attached(attached)));
        let attached = Arc::new(Mutex::new(Arc::<[u32]>::from(attached)));
        let (published_tx, published) = crossbeam::channel::bounded(1);
        let (requests, requests_rx) = crossbeam::channel::bounded(REQUEST_QUEUE);
        let wake = Arc::new(Notify::new());
        let ready = Arc::new(Ready::default());
        let (stop, stop_rx) = oneshot::channel();
        let (started_tx, started_rx) = mpsc::sync_channel(1);
        let ctx = Context {
            table: table.clone(),
            attached: attached.clone(),
            published: published_tx,
            requests: requests_rx,
            wake: wake.clone(),
            ready: ready.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("kxp-fib".into())
            .spawn(move || ctx.run(stop_rx, started_tx))
            .map_err(|source| FibError::Thread {
                op: "spawn",
                source,
            })?;
        let mut mirror = FibMirror {
            table,
            attached,
            published,
            requests,
            wake,
            ready,
            stop: Some(stop),
            thread: Some(thread),
        };
        match started_rx.recv() {
            Ok(Ok(())) => Ok(mirror),
            Ok(Err(e)) => {
                mirror.shutdown();
                Err(e)
            }
            Err(_) => {
                mirror.shutdown();
                Err(FibError::Stopped {
                    reason: "the mirror thread exited during start".into(),
                })
            }
        }
    }

    /// Replaces the list of interfaces kxp transmits on (an interface was attached or
    /// went away); views see it at once.
    pub fn set_attached(&self, ifindexes: &[u32]) {
        let mut attached = self.attached.lock().unwrap_or_else(|e| e.into_inner());
        *attached = ifindexes.into();
        let new = attached.clone();
        self.table.rcu(|t| {
            let mut t = FibTable::clone(t);
            t.attached = new.clone();
            t
        });
    }

    /// A receiver told after each publication of new tables (at most one pending): for
    /// whoever follows links coming and going.
    pub fn published(&self) -> crossbeam::channel::Receiver<()> {
        self.published.clone()
    }

    /// A new view for one worker.
    pub fn view(&self) -> FibView {
        FibView::new(self.table.clone(), self.requests.clone(), self.wake.clone())
    }

    /// Blocks until the first full dump is applied and published.
    ///
    /// # Errors
    /// [`FibError::NotReady`] after `timeout`; [`FibError::Stopped`] if the first dump
    /// failed (the thread keeps retrying with back-off).
    pub fn wait_ready(&self, timeout: Duration) -> Result<(), FibError> {
        let deadline = Instant::now() + timeout;
        let mut guard = self.ready.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &*guard {
                ReadyState::Ready => return Ok(()),
                ReadyState::Failed(reason) => {
                    return Err(FibError::Stopped {
                        reason: reason.clone(),
                    });
                }
                ReadyState::Starting => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FibError::NotReady { waited: timeout });
            }
            guard = self
                .ready
                .changed
                .wait_timeout(guard, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Stops the thread and waits for it (also done on drop).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the FIB mirror thread panicked");
        }
    }
}

impl Drop for FibMirror {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl fmt::Debug for FibMirror {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FibMirror")
            .field("generation", &self.table.load().generation())
            .finish_non_exhaustive()
    }
}

struct Context {
    table: Arc<Published>,
    /// The interfaces kxp transmits on, as of now (see [`FibMirror::set_attached`]).
    attached: Arc<Mutex<Arc<[u32]>>>,
    /// Told (without blocking) after every publication.
    published: crossbeam::channel::Sender<()>,
    requests: crossbeam::channel::Receiver<ResolveRequest>,
    wake: Arc<Notify>,
    ready: Arc<Ready>,
}

/// Why a session ended.
enum End {
    Stop,
    Lost(String),
}

struct Session {
    handle: Handle,
    events: Events,
    /// The tables being maintained (published copies share their unchanged parts).
    state: FibTable,
    /// Last resolution request sent per next hop (deduplicates the workers' requests).
    asked: HashMap<ResolveRequest, Instant>,
}

impl Context {
    fn run(self, mut stop: oneshot::Receiver<()>, started: mpsc::SyncSender<Result<(), FibError>>) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(source) => {
                let _ = started.send(Err(FibError::Thread {
                    op: "build the runtime of",
                    source,
                }));
                return;
            }
        };
        rt.block_on(async move {
            let mut started = Some(started);
            let mut backoff = BACKOFF_MIN;
            loop {
                let (conn, handle, events) = match connect() {
                    Ok(c) => c,
                    Err(e) => {
                        if let Some(started) = started.take() {
                            let _ = started.send(Err(e));
                            return;
                        }
                        crate::error_limited!("fib reconnect", error = %e, "FIB mirror: reconnecting failed");
                        if sleep_or_stop(&mut stop, backoff).await {
                            return;
                        }
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                        continue;
                    }
                };
                if let Some(started) = started.take() {
                    let _ = started.send(Ok(()));
                }
                let conn = tokio::spawn(conn);
                let state = self.table.load().empty_like();
                let mut session = Session { handle, events, state, asked: HashMap::new() };
                let end = session.run(&self, &mut stop).await;
                conn.abort();
                match end {
                    End::Stop => return,
                    End::Lost(reason) => {
                        tracing::error!(%reason, "FIB mirror: netlink session lost, resynchronising");
                        self.ready.set(ReadyState::Failed(reason));
                    }
                }
                if sleep_or_stop(&mut stop, backoff).await {
                    return;
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        });
    }

    fn publish(&self, state: &mut FibTable) {
        state.generation += 1;
        let started = Instant::now();
        match state.index_routes() {
            Some(Some(blocks)) => tracing::debug!(
                blocks,
                took_us = started.elapsed().as_micros() as u64,
                "IPv4 routes indexed into a trie"
            ),
            Some(None) => tracing::debug!(
                "IPv4 routes left to the per-length hash lookup: more fine-grained prefixes \
                 than the trie holds"
            ),
            None => {}
        }
        // Under the lock, so that a concurrent set_attached is never undone.
        let attached = self.attached.lock().unwrap_or_else(|e| e.into_inner());
        state.attached = attached.clone();
        self.table.store(Arc::new(state.clone()));
        drop(attached);
        let _ = self.published.try_send(());
    }
}

/// True if stopped while sleeping.
async fn sleep_or_stop(stop: &mut oneshot::Receiver<()>, delay: Duration) -> bool {
    tokio::select! {
        _ = stop => true,
        _ = tokio::time::sleep(delay) => false,
    }
}

#[allow(clippy::type_complexity)]
fn connect() -> Result<
    (
        rtnetlink::proto::Connection<RouteNetlinkMessage>,
        Handle,
        Events,
    ),
    FibError,
> {
    let (mut conn, handle, events) =
        rtnetlink::new_multicast_connection(&GROUPS).map_err(|source| FibError::Netlink {
            op: "open and subscribe",
            source,
        })?;
    let socket = rtnetlink::sys::AsyncSocket::socket_mut(conn.socket_mut());
    if let Err(source) = socket.set_rx_buf_sz(RCVBUF) {
        return Err(FibError::Netlink {
            op: "size the receive buffer of",
            source,
        });
    }
    Ok((conn, handle, events))
}

impl Session {
    async fn run(&mut self, ctx: &Context, stop: &mut oneshot::Receiver<()>) -> End {
        if let Err(e) = self.full_dump().await {
            return End::Lost(e.to_string());
        }
        self.drain_events(usize::MAX);
        ctx.publish(&mut self.state);
        ctx.ready.set(ReadyState::Ready);
        tracing::info!(
            routes = self.state.route_count(),
            neighbours = self.state.neighbour_count(),
            "FIB mirror ready"
        );
        loop {
            tokio::select! {
                _ = &mut *stop => return End::Stop,
                ev = self.events.next() => {
                    let Some((msg, _)) = ev else { return End::Lost("netlink socket closed".into()) };
                    let mut outcome = self.apply_event(msg);
                    outcome.merge(self.drain_events(EVENTS_PER_BATCH));
                    if outcome.overrun {
                        crate::warn_limited!("fib enobufs", "FIB mirror: netlink events lost (ENOBUFS), dumping everything again");
                        if let Err(e) = self.full_dump().await {
                            return End::Lost(e.to_string());
                        }
                        self.drain_events(usize::MAX);
                        outcome.effect.changed = true;
                    } else if outcome.effect.resync_routes {
                        if let Err(e) = self.route_dump().await {
                            return End::Lost(e.to_string());
                        }
                        self.drain_events(usize::MAX);
                        outcome.effect.changed = true;
                    }
                    if outcome.effect.changed {
                        ctx.publish(&mut self.state);
                    }
                }
                _ = ctx.wake.notified() => {
                    self.serve_requests(ctx).await;
                }
            }
        }
    }

    fn apply_event(&mut self, msg: NetlinkMessage<RouteNetlinkMessage>) -> Outcome {
        match msg.payload {
            NetlinkPayload::InnerMessage(inner) => Outcome {
                effect: self.state.apply(&inner, msg.header.flags),
                overrun: false,
            },
            NetlinkPayload::Overrun(_) => Outcome {
                overrun: true,
                ..Outcome::default()
            },
            _ => Outcome::default(),
        }
    }

    /// Applies the events already queued, up to `max`.
    fn drain_events(&mut self, max: usize) -> Outcome {
        let mut outcome = Outcome::default();
        for _ in 0..max {
            match self.events.next().now_or_never() {
                Some(Some((msg, _))) => outcome.merge(self.apply_event(msg)),
                // Closed (Some(None)) is noticed by the select loop; None = nothing queued.
                Some(None) | None => break,
            }
        }
        outcome
    }

    /// Rebuilds every table from dumps. Events queued meanwhile are applied afterwards by
    /// the caller: replaying them over a newer dump converges (each carries a whole object).
    async fn full_dump(&mut self) -> Result<(), FibError> {
        let mut fresh = self.state.empty_like();
        let link = RouteNetlinkMessage::GetLink(LinkMessage::default());
        for msg in dump(&self.handle, "link", link).await? {
            fresh.apply(&msg, 0);
        }
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut m = AddressMessage::default();
            m.header.family = family;
            for msg in dump(&self.handle, "address", RouteNetlinkMessage::GetAddress(m)).await? {
                fresh.apply(&msg, 0);
            }
            let mut m = NeighbourMessage::default();
            m.header.family = family;
            for msg in dump(
                &self.handle,
                "neighbour",
                RouteNetlinkMessage::GetNeighbour(m),
            )
            .await?
            {
                fresh.apply(&msg, 0);
            }
        }
        // Bridges' forwarding databases (their own family: not in the dumps above).
        let mut m = NeighbourMessage::default();
        m.header.family = AddressFamily::Bridge;
        for msg in dump(
            &self.handle,
            "bridge fdb",
            RouteNetlinkMessage::GetNeighbour(m),
        )
        .await?
        {
            fresh.apply(&msg, 0);
        }
        let routes = self.dump_routes(&fresh).await?;
        fresh.take_routes(routes);
        self.state = fresh;
        Ok(())
    }

    async fn route_dump(&mut self) -> Result<(), FibError> {
        let routes = self.dump_routes(&self.state).await?;
        self.state.take_routes(routes);
        Ok(())
    }

    async fn dump_routes(&self, like: &FibTable) -> Result<FibTable, FibError> {
        let mut fresh = like.empty_like();
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut m = RouteMessage::default();
            m.header.address_family = family;
            for msg in dump(&self.handle, "route", RouteNetlinkMessage::GetRoute(m)).await? {
                fresh.apply(&msg, 0);
            }
        }
        Ok(fresh)
    }

    /// Asks the kernel to resolve the requested next hops: RTM_NEWNEIGH with NTF_USE runs
    /// `neigh_event_send()`, which creates the entry if needed and sends an ARP request or
    /// neighbour solicitation (INCOMPLETE → REACHABLE, or FAILED), as a transmit would.
    async fn serve_requests(&mut self, ctx: &Context) {
        let now = Instant::now();
        if self.asked.len() > REQUEST_QUEUE {
            self.asked
                .retain(|_, at| now.duration_since(*at) < RESOLVE_INTERVAL);
        }
        for _ in 0..REQUESTS_PER_ROUND {
            let Ok(req) = ctx.requests.try_recv() else {
                return;
            };
            if self
                .asked
                .get(&req)
                .is_some_and(|at| now.duration_since(*at) < RESOLVE_INTERVAL)
            {
                continue;
            }
            self.asked.insert(req, now);
            let result = self
                .handle
                .neighbours()
                .add(req.ifindex, req.ip)
                .state(NeighbourState::None)
                .flags(NeighbourFlags::Use)
                .replace()
                .execute()
                .await;
            if let Err(e) = result {
                tracing::debug!(ifindex = req.ifindex, ip = %req.ip, error = %e, "FIB mirror: resolution request failed");
            }
        }
        // More queued: come back after the events (the select loop polls fairly).
        if !ctx.requests.is_empty() {
            ctx.wake.notify_one();
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Outcome {
    effect: super::state::Effect,
    overrun: bool,
}

impl Outcome {
    fn merge(&mut self, other: Outcome) {
        self.effect.merge(other.effect);
        self.overrun |= other.overrun;
    }
}

/// One dump request; the answers in order.
async fn dump(
    handle: &Handle,
    what: &'static str,
    request: RouteNetlinkMessage,
) -> Result<Vec<RouteNetlinkMessage>, FibError> {
    let mut req = NetlinkMessage::from(request);
    req.header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let mut answers = handle.clone().request(req).map_err(|e| FibError::Dump {
        what,
        detail: e.to_string(),
    })?;
    let mut out = Vec::new();
    while let Some(msg) = answers.next().await {
        match msg.payload {
            NetlinkPayload::InnerMessage(inner) => out.push(inner),
            NetlinkPayload::Error(e) if e.code.is_some() => {
                return Err(FibError::Dump {
                    what,
                    detail: e.to_string(),
                });
            }
            NetlinkPayload::Overrun(_) => {
                return Err(FibError::Dump {
                    what,
                    detail: "overrun".into(),
                });
            }
            _ => {}
        }
    }
    Ok(out)
}
