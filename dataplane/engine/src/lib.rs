//! What one worker does with one packet, minus the I/O: parse, look the flow up in the
//! worker's connection table, and either translate it as the table says or decide a new
//! connection against the current snapshot, then rewrite the headers in place.
//!
//! Pure like `nat` and `conntrack` (no clock, no sockets, no unsafe): the worker passes
//! `now`, the packet bytes and the snapshot it loaded for this batch, so the whole
//! pipeline runs in tests on a fake clock. The dataplane crate holds the system side
//! (AF_XDP sockets, the XDP program, the FIB mirror, state files) and drives this one,
//! in the manner of quinn-proto beside quinn-udp. (The dataplane gives the connection
//! table its prefetch instruction, `ConnTable::set_prefetch`, before handing it here.)
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use conntrack::{AffinityTable, ConnTable, Direction, EndpointLoad, InsertError, Update};
use dashmap::DashMap;
use nat::decide::{Decision, DropReason, Forward, NewPacket, Policy, decide, masquerades};
use nat::model::{Affinity, Endpoint};
use nat::rewrite::{self, ParseError, Parsed};
use nat::select::{PickInput, RrCursor, pick};
use nat::snapshot::Snapshot;
use nat::tuple::{Protocol, Tuple};

/// Where masqueraded traffic gets its source address: the address the node would use
/// towards the endpoint (the route's preferred source or the egress interface's
/// address), as `masquerade` picks it.
pub trait MasqueradeSource {
    fn source_for(&self, endpoint: IpAddr) -> Option<IpAddr>;
}

/// A fixed masquerade address per family (tests, single-homed nodes).
#[derive(Debug, Clone, Copy)]
pub struct FixedSource {
    pub v4: Option<IpAddr>,
    pub v6: Option<IpAddr>,
}

impl MasqueradeSource for FixedSource {
    fn source_for(&self, endpoint: IpAddr) -> Option<IpAddr> {
        if endpoint.is_ipv4() { self.v4 } else { self.v6 }
    }
}

/// Why the engine dropped a packet (each one is counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropCause {
    /// The packet could not be parsed (reason label from `ParseError::reason`).
    Malformed(&'static str),
    /// kube-proxy's policy drops it.
    Policy(DropReason),
    /// TCP flags that make no sense for the flow's state.
    InvalidState,
    /// A first packet that cannot open a connection (e.g. a lone FIN to a VIP).
    NotNew,
    /// The connection table is full of assured flows.
    TableFull,
    /// The reply tuple of a new flow is already in use.
    Clash,
    /// No free SNAT port for a masqueraded flow.
    NoSnatPort,
    /// No address to masquerade with towards the endpoint.
    NoSnatSource,
    /// TTL / hop limit ran out.
    TtlExceeded,
    /// A REJECT whose answer cannot be sent (e.g. answering a RST).
    RejectUnanswerable,
    /// An ICMP error about a packet from a Service frontend that no tracked flow sent.
    IcmpErrorUntracked,
    /// A NetworkPolicy denies the connection (the endpoint pod's ingress, or the client
    /// pod's egress): its first packet is dropped, as the CNI drops it.
    NetworkPolicy,
}

impl DropCause {
    pub fn label(&self) -> &'static str {
        match self {
            DropCause::Malformed(r) => r,
            DropCause::Policy(DropReason::SourceRange) => "source_range",
            DropCause::Policy(DropReason::NoLocalEndpointsInternal) => {
                "no_local_endpoints_internal"
            }
            DropCause::Policy(DropReason::NoLocalEndpointsExternal) => {
                "no_local_endpoints_external"
            }
            DropCause::Policy(DropReason::UnallocatedServiceIp) => "unallocated_service_ip",
            DropCause::InvalidState => "invalid_state",
            DropCause::NotNew => "not_new",
            DropCause::TableFull => "table_full",
            DropCause::Clash => "clash",
            DropCause::NoSnatPort => "no_snat_port",
            DropCause::NoSnatSource => "no_snat_source",
            DropCause::TtlExceeded => "ttl_exceeded",
            DropCause::RejectUnanswerable => "reject_unanswerable",
            DropCause::IcmpErrorUntracked => "icmp_error_untracked",
            DropCause::NetworkPolicy => "network_policy",
        }
    }
}

/// What to do with the packet after [`Engine::process`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Rewritten in place: send it towards its (new) destination address.
    Forward {
        new_flow: bool,
        dst: IpAddr,
        /// The packet's tuple as it arrived (to quote it in an ICMP error, e.g. when it
        /// is too big for the next link); `None` for a translated ICMP error.
        from: Option<Tuple>,
        /// The 802.1Q VLAN id to tag it with (0: none): a packet going back to a client
        /// that came tagged leaves with its tag, unless its route names a VLAN device
        /// (which tags it itself).
        vlan: u16,
        /// Whether the worker hands it to the kernel, so that the CNI's filtering
        /// towards the pod applies (`kxp.networkPolicy: kernel`: a packet of the original
        /// direction of a flow to an endpoint on this node).
        handover: Handover,
    },
    /// REJECT: an answer (TCP RST / ICMP port unreachable) was written to `out[..len]`;
    /// send it back towards `dst` (the client). The packet itself is dropped.
    Respond {
        len: usize,
        dst: IpAddr,
    },
    Drop(DropCause),
    /// Not kxp's: hand it to the kernel untouched.
    Pass,
}

/// Per-worker counters (plain integers, summed by the scraper).
#[derive(Debug, Clone, Default)]
pub struct Counters {
    pub forwarded: u64,
    pub forwarded_bytes: u64,
    pub new_flows: u64,
    pub rejected: u64,
    pub passed: u64,
    pub icmp_errors_translated: u64,
    pub drops: HashMap<DropCause, u64>,
}

impl Counters {
    pub fn dropped(&self) -> u64 {
        self.drops.values().sum()
    }
}

/// What kube-proxy keeps once per node, shared by every worker's engine, so that a
/// Service behaves the same whichever worker a connection lands on: ClientIP affinity,
/// flows per endpoint for the least-connection schedulers, round-robin positions. Only
/// new connections touch it (and only those of Services that use each part).
#[derive(Debug)]
pub struct NodeState {
    pub affinity: AffinityTable,
    pub load: Arc<EndpointLoad>,
    /// Round-robin position per (Service port, local candidates only).
    cursors: DashMap<(u64, bool), RrCursor>,
}

/// Which endpoint a new connection would go to, when that does not depend on chance
/// or on the moment (`kxp trace --live --sport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prediction {
    /// The client's ClientIP affinity entry names this endpoint (still a candidate).
    Affinity(SocketAddr),
    /// A hashing scheduler (`sh`, `dh`, `maglev`) maps the connection to this endpoint.
    Hash(SocketAddr),
    /// The scheduler picks at connection time (random, round robin, least
    /// connections): no single answer now.
    AtConnection,
    /// The packet is not forwarded to an endpoint (pass, drop, reject).
    NotForwarded,
}

impl NodeState {
    /// What [`Engine`]'s choice for a new connection `src` → `dst` (with ports) would be,
    /// without making it: the same decision, affinity recall and scheduler as a worker's,
    /// with nothing recorded.
    pub fn predict(
        &self,
        snap: &Snapshot,
        src: SocketAddr,
        dst: SocketAddr,
        proto: Protocol,
        in_interface: Option<&str>,
        now: u64,
    ) -> Prediction {
        let Decision::Forward(fwd) = decide(
            snap,
            &NewPacket {
                src: src.ip(),
                dst: dst.ip(),
                dport: dst.port(),
                proto,
                in_interface,
            },
        ) else {
            return Prediction::NotForwarded;
        };
        let sp = fwd.port;
        if let Affinity::ClientIp { .. } = sp.affinity
            && let Some(ep) = self.affinity.recall(sp.name_hash, src.ip(), now)
            && fwd
                .candidates
                .iter()
                .any(|&i| sp.endpoints[i as usize].addr == ep)
        {
            return Prediction::Affinity(ep);
        }
        if !sp.scheduler.uses_hash_table() {
            return Prediction::AtConnection;
        }
        match pick_stateless(&fwd, src, dst, proto, 0) {
            Some(i) => Prediction::Hash(sp.endpoints[i as usize].addr),
            None => Prediction::NotForwarded,
        }
    }

    /// Most ClientIP affinity entries a node holds by default (see
    /// [`conntrack::affinity`] for the bound).
    pub const AFFINITY_CAPACITY: usize = 262_144;

    pub fn new(affinity_capacity: usize) -> Arc<NodeState> {
        NodeState::with_affinity(AffinityTable::new(affinity_capacity))
    }

    /// A node state around an affinity table already made (e.g. restored).
    pub fn with_affinity(affinity: AffinityTable) -> Arc<NodeState> {
        Arc::new(NodeState {
            affinity,
            load: Arc::new(EndpointLoad::new()),
            cursors: DashMap::new(),
        })
    }
}

/// Where a new connection goes: the Service port (its index in the snapshot), the
/// endpoint (an index into that port's endpoints), and whether the decision marked it for
/// masquerade before the endpoint was known ([`Forward::masquerade`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Choice {
    port_index: u32,
    endpoint: u32,
    masquerade: bool,
}

impl Choice {
    /// [`Forward::masquerade_for`] of the chosen connection.
    fn masquerade_for(&self, src: IpAddr, endpoint: &Endpoint) -> bool {
        masquerades(self.masquerade, src, endpoint)
    }
}

/// What [`Engine::prepare_new`] made ahead for a likely new connection: the draw, and the
/// choice it gave on one snapshot, which [`Engine::process_parsed`] uses on that
/// snapshot only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prepared {
    random: u64,
    /// The snapshot the choice was made on: its address and generation.
    snapshot: (usize, u64),
    choice: Option<Choice>,
}

impl Prepared {
    /// The prepared choice, if it was made on `snap`.
    fn choice_on(&self, snap: &Snapshot) -> Option<Choice> {
        let here = (std::ptr::from_ref(snap) as usize, snap.generation);
        self.choice.filter(|_| self.snapshot == here)
    }
}

/// Where a packet came in, besides its bytes: what the engine needs of its arrival.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ingress<'a> {
    /// The interface's name at layer 3 (a port's bridge or bond, else its own), for
    /// interface-based local-traffic detection and the node's own connections (the
    /// service device); `None`: unknown.
    pub interface: Option<&'a str>,
    /// The VLAN id it came with (0: untagged): a flow opened by a tagged packet keeps
    /// it, and the packets that go back to its client leave with it
    /// ([`Verdict::Forward`]'s `vlan`).
    pub vlan: u16,
}

impl<'a> Ingress<'a> {
    /// Arrived untagged on `interface`.
    pub fn on(interface: Option<&'a str>) -> Ingress<'a> {
        Ingress { interface, vlan: 0 }
    }
}

/// One worker's packet pipeline and everything it owns.
#[derive(Debug)]
pub struct Engine {
    pub table: ConnTable,
    pub counters: Counters,
    pub node: Arc<NodeState>,
    rng: u64,
    /// The interface the node's own connections arrive on (kxp's service device): their
    /// source is already a node address, and they are always given a SNAT port so that
    /// the endpoints' answers, addressed to the node, come back to kxp.
    pub host_interface: Option<String>,
    /// `kxp.networkPolicy: kernel`: connections to this node's pods (but the node's own)
    /// are translated here (DNAT) and carried by the kernel (their masquerade too), so
    /// that the CNI's policy applies to them ([`Handover`]).
    pub kernel_policy: bool,
}

/// Whether the packets of a flow's original direction go to the kernel, for the CNI's
/// policy (`kxp.networkPolicy: kernel`, a connection to a pod of this node; see
/// `dataplane::servicedev::KernelPolicy`), and whether the kernel masquerades them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handover {
    No,
    Plain,
    Masquerade,
}

/// A flow's conntrack tag: the Service port's index (informational) in its low
/// [`TAG_PORT_BITS`] bits, then its [`Handover`] (two bits), then the client side's VLAN
/// id. The tag is journaled with the flow, so all survive a restart.
const TAG_PORT_BITS: u32 = 18;
const TAG_HANDOVER: u32 = 1 << TAG_PORT_BITS;
const TAG_HANDOVER_MASQ: u32 = 2 << TAG_PORT_BITS;
const TAG_VLAN_SHIFT: u32 = TAG_PORT_BITS + 2;

fn flow_tag(port_index: u32, handover: Handover, vlan: u16) -> u32 {
    (port_index & (TAG_HANDOVER - 1))
        | match handover {
            Handover::No => 0,
            Handover::Plain => TAG_HANDOVER,
            Handover::Masquerade => TAG_HANDOVER | TAG_HANDOVER_MASQ,
        }
        | (u32::from(vlan & 0xfff) << TAG_VLAN_SHIFT)
}

/// The [`Handover`] of the flow with conntrack tag `tag`.
pub fn tag_handover(tag: u32) -> Handover {
    match (tag & TAG_HANDOVER != 0, tag & TAG_HANDOVER_MASQ != 0) {
        (false, _) => Handover::No,
        (true, false) => Handover::Plain,
        (true, true) => Handover::Masquerade,
    }
}

/// The client side's VLAN id of a flow with conntrack tag `tag` (0: untagged).
pub fn tag_vlan(tag: u32) -> u16 {
    (tag >> TAG_VLAN_SHIFT) as u16 & 0xfff
}

const SEC: u64 = 1_000_000_000;

impl Engine {
    /// An engine around `table` with a node state of its own (a single-worker node);
    /// `seed` drives the random endpoint choice.
    pub fn new(table: ConnTable, seed: u64) -> Engine {
        Engine::on_node(table, seed, NodeState::new(NodeState::AFFINITY_CAPACITY))
    }

    /// An engine around `table` sharing `node` with the node's other workers; `table`
    /// counts its flows in the node's endpoint load from now on.
    pub fn on_node(mut table: ConnTable, seed: u64, node: Arc<NodeState>) -> Engine {
        table.set_load(node.load.clone());
        Engine {
            table,
            counters: Counters::default(),
            node,
            rng: seed | 1,
            host_interface: None,
            kernel_policy: false,
        }
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64*
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Processes one packet (`pkt` starts at the IP header). May write an answer into
    /// `out` (see [`Verdict::Respond`]).
    pub fn process(
        &mut self,
        snap: &Snapshot,
        pkt: &mut [u8],
        now: u64,
        ingress: Ingress<'_>,
        masq: &dyn MasqueradeSource,
        out: &mut [u8],
    ) -> Verdict {
        let parsed = rewrite::parse(pkt);
        self.process_parsed(snap, pkt, parsed, None, now, ingress, masq, out)
    }

    /// [`Engine::process`] of a packet whose parse (`rewrite::parse` of these very bytes)
    /// is at hand: the worker parsed it already to warm the cache for its batch.
    /// `prepared` is what [`Engine::prepare_new`] chose for it, if anything: should the
    /// packet open a connection, it goes where that choice said (made on this very
    /// snapshot; else the decision is made again, with the draw prepared).
    #[allow(clippy::too_many_arguments)]
    pub fn process_parsed(
        &mut self,
        snap: &Snapshot,
        pkt: &mut [u8],
        parsed: Result<Parsed, ParseError>,
        prepared: Option<Prepared>,
        now: u64,
        ingress: Ingress<'_>,
        masq: &dyn MasqueradeSource,
        out: &mut [u8],
    ) -> Verdict {
        let v = self.process_inner(snap, pkt, parsed, prepared, now, ingress, masq, out);
        match v {
            Verdict::Forward { new_flow, .. } => {
                self.counters.forwarded += 1;
                self.counters.forwarded_bytes += pkt.len() as u64;
                self.counters.new_flows += new_flow as u64;
            }
            Verdict::Respond { .. } => self.counters.rejected += 1,
            Verdict::Drop(c) => *self.counters.drops.entry(c).or_default() += 1,
            Verdict::Pass => self.counters.passed += 1,
        }
        v
    }

    #[allow(clippy::too_many_arguments)]
    fn process_inner(
        &mut self,
        snap: &Snapshot,
        pkt: &mut [u8],
        parsed: Result<Parsed, ParseError>,
        prepared: Option<Prepared>,
        now: u64,
        ingress: Ingress<'_>,
        masq: &dyn MasqueradeSource,
        out: &mut [u8],
    ) -> Verdict {
        let parsed = match parsed {
            Ok(p) => p,
            Err(e) => return Verdict::Drop(DropCause::Malformed(e.reason())),
        };
        match parsed {
            Parsed::NotTranslatable(_) => Verdict::Pass,
            // Later fragments are the worker's (they follow their first fragment).
            Parsed::Fragment(_) => Verdict::Drop(DropCause::Malformed("fragment")),
            Parsed::IcmpError(e) => self.icmp_error(snap, pkt, &e, now),
            Parsed::Flow(f) => {
                let t = f.tuple();
                let len = u32::try_from(pkt.len()).unwrap_or(u32::MAX);
                if let Some(hit) = self.table.on_packet_bytes(&t, f.tcp_flags(), now, len) {
                    if hit.update == Update::Invalid {
                        return Verdict::Drop(DropCause::InvalidState);
                    }
                    let to = hit.rewrite_to();
                    let tag = hit.entry.tag();
                    let (vlan, handover) = match hit.dir {
                        Direction::Reply => (tag_vlan(tag), Handover::No),
                        Direction::Original => (0, tag_handover(tag)),
                    };
                    return forward(pkt, &f, &to, false, vlan, handover);
                }
                self.new_flow(snap, pkt, &f, prepared, now, ingress, masq, out)
            }
        }
    }

    /// The first packet of a connection: kube-proxy's decision and endpoint choice (or
    /// the choice `prepared` for it on this snapshot), then the flow tracked and the
    /// packet translated.
    #[allow(clippy::too_many_arguments)]
    fn new_flow(
        &mut self,
        snap: &Snapshot,
        pkt: &mut [u8],
        f: &rewrite::FlowPacket,
        prepared: Option<Prepared>,
        now: u64,
        ingress: Ingress<'_>,
        masq: &dyn MasqueradeSource,
        out: &mut [u8],
    ) -> Verdict {
        let t = f.tuple();
        let choice = match prepared.and_then(|p| p.choice_on(snap)) {
            Some(c) => c,
            None => {
                let random = prepared.map(|p| p.random);
                match self.choose(snap, pkt, &t, random, now, ingress.interface, out) {
                    Ok(c) => c,
                    Err(v) => return v,
                }
            }
        };
        self.open(snap, pkt, f, &t, choice, now, ingress, masq)
    }

    /// kube-proxy's decision for a new connection `t` and, if it is forwarded, the
    /// endpoint: ClientIP affinity's, else the scheduler's (drawing `random`, or a fresh
    /// draw). `Err` is the packet's verdict when it is not forwarded.
    #[allow(clippy::too_many_arguments)]
    fn choose(
        &mut self,
        snap: &Snapshot,
        pkt: &[u8],
        t: &Tuple,
        random: Option<u64>,
        now: u64,
        in_interface: Option<&str>,
        out: &mut [u8],
    ) -> Result<Choice, Verdict> {
        let fwd = match decide_tuple(snap, t, in_interface) {
            Decision::Pass => return Err(Verdict::Pass),
            Decision::Drop { reason, .. } => return Err(Verdict::Drop(DropCause::Policy(reason))),
            Decision::Reject { .. } => {
                let built = if t.proto == Protocol::Tcp {
                    rewrite::build_tcp_rst(pkt, out)
                } else {
                    rewrite::build_icmp_port_unreachable(pkt, out)
                };
                return Err(match built {
                    Ok(len) => Verdict::Respond { len, dst: t.src },
                    Err(_) => Verdict::Drop(DropCause::RejectUnanswerable),
                });
            }
            Decision::Forward(fwd) => fwd,
        };
        let sp = fwd.port;
        let local = fwd.policy == Policy::Local;

        // Session affinity: the endpoint this client used last, if still a candidate.
        let mut chosen = None;
        if let Affinity::ClientIp { .. } = sp.affinity
            && let Some(ep) = self.node.affinity.recall(sp.name_hash, t.src, now)
        {
            chosen = fwd
                .candidates
                .iter()
                .copied()
                .find(|&i| sp.endpoints[i as usize].addr == ep);
        }
        let chosen = match chosen {
            Some(i) => i,
            None => {
                let table = fwd.hash_table();
                let random = random.unwrap_or_else(|| self.next_random());
                let load = &self.node.load;
                let active = |ep: SocketAddr| load.get(ep);
                let input = PickInput {
                    src: t.src_addr(),
                    dst: t.dst_addr(),
                    proto: t.proto.number(),
                    random,
                    active: &active,
                };
                // The node's cursor, locked (its dashmap shard) only for schedulers that
                // move it.
                let mut own = RrCursor::default();
                let mut shared;
                let cursor = if sp.scheduler.uses_cursor() {
                    shared = self.node.cursors.entry((sp.name_hash, local)).or_default();
                    &mut *shared
                } else {
                    &mut own
                };
                match pick(
                    sp.scheduler,
                    &sp.endpoints,
                    fwd.candidates,
                    sp.cat.equal_weights,
                    Some(table),
                    &input,
                    cursor,
                ) {
                    Some(i) => i,
                    // Categorisation guarantees candidates; treat an empty list as REJECT.
                    None => return Err(Verdict::Drop(DropCause::RejectUnanswerable)),
                }
            }
        };
        if let Affinity::ClientIp { timeout_secs } = sp.affinity {
            self.node.affinity.remember(
                sp.name_hash,
                t.src,
                sp.endpoints[chosen as usize].addr,
                now,
                u64::from(timeout_secs) * SEC,
            );
        }
        Ok(Choice {
            port_index: fwd.port_index,
            endpoint: chosen,
            masquerade: fwd.masquerade,
        })
    }

    /// Tracks the connection `t` to the endpoint `choice` names (with a SNAT port when it
    /// is masqueraded or the node's own) and translates its first packet.
    #[allow(clippy::too_many_arguments)]
    fn open(
        &mut self,
        snap: &Snapshot,
        pkt: &mut [u8],
        f: &rewrite::FlowPacket,
        t: &Tuple,
        choice: Choice,
        now: u64,
        ingress: Ingress<'_>,
        masq: &dyn MasqueradeSource,
    ) -> Verdict {
        let sp = snap.port(choice.port_index);
        let Some(ep) = sp.endpoints.get(choice.endpoint as usize) else {
            return Verdict::Drop(DropCause::RejectUnanswerable);
        };
        let from_host = self.is_host_interface(ingress.interface);
        // NetworkPolicy, as the CNI would check the packet after DNAT (the endpoint's
        // address and port) and before SNAT (the client's own address). The node's own
        // connections are admitted by its pods.
        if let Some(policy) = &snap.policy
            && !policy.allows(
                t.src,
                ep.addr,
                t.proto,
                from_host || snap.node.is_local_addr(t.src),
            )
        {
            return Verdict::Drop(DropCause::NetworkPolicy);
        }
        let masquerade = choice.masquerade_for(t.src, ep);
        // Carried by the kernel: its own masquerade, after the CNI's filtering.
        let handover = match (self.kernel_policy && ep.is_local && !from_host, masquerade) {
            (false, _) => Handover::No,
            (true, false) => Handover::Plain,
            (true, true) => Handover::Masquerade,
        };
        let reply_dst = if from_host || (masquerade && handover == Handover::No) {
            // The node's own connection keeps the address the node chose for it (its own);
            // only its port comes from the SNAT range.
            let source = if from_host {
                Some(t.src)
            } else {
                masq.source_for(ep.addr.ip())
            };
            let Some(snat_ip) = source else {
                return Verdict::Drop(DropCause::NoSnatSource);
            };
            let Some(port) = self
                .table
                .allocate_snat_port(snat_ip, ep.addr, t.proto, now)
            else {
                return Verdict::Drop(DropCause::NoSnatPort);
            };
            SocketAddr::new(snat_ip, port)
        } else {
            t.src_addr()
        };
        let reply = Tuple::new(ep.addr, reply_dst, t.proto);
        let len = u32::try_from(pkt.len()).unwrap_or(u32::MAX);
        let inserted = self.table.insert_first(
            *t,
            reply,
            flow_tag(choice.port_index, handover, ingress.vlan),
            f.tcp_flags(),
            now,
            len,
            sp.scheduler.uses_load(),
        );
        match inserted {
            Ok(_) => {}
            Err(InsertError::Full { .. }) => return Verdict::Drop(DropCause::TableFull),
            Err(InsertError::Clash { .. }) => return Verdict::Drop(DropCause::Clash),
            Err(_) => return Verdict::Drop(DropCause::NotNew),
        }
        forward(pkt, f, &reply.reversed(), true, 0, handover)
    }

    /// For a packet of a received batch that likely opens a connection (the worker's
    /// warming found no candidate flow for it): decides now where the connection would
    /// go, drawing the random number its endpoint choice uses, so that the choice, and
    /// with it the new flow's reply tuple, are known before the batch's packets are
    /// handled. Returns the choice, for [`Engine::process_parsed`] (which then neither
    /// decides nor picks again), and the reply tuple, whose index bucket the worker
    /// brings into the cache with the batch's others ([`ConnTable::warm_tuples`]): in a
    /// large table the insert's lookup of the reply tuple is otherwise a cache miss per
    /// new connection.
    ///
    /// Only a prediction: a packet that turns out not to be new (its flow was found)
    /// leaves it unused, and it holds for this snapshot only. `None` (nothing drawn)
    /// where the choice depends on more than the packet and the draw: ClientIP affinity,
    /// the round-robin and least-connection schedulers, and for what is not forwarded.
    /// The reply tuple is `None` for a masqueraded flow (its SNAT port is allocated at
    /// insertion).
    pub fn prepare_new(
        &mut self,
        snap: &Snapshot,
        f: &rewrite::FlowPacket,
        in_interface: Option<&str>,
    ) -> Option<(Prepared, Option<Tuple>)> {
        let prepared = self.choose_ahead(snap, f, in_interface)?;
        let reply = self.reply_ahead(snap, f, &prepared, in_interface);
        Some((prepared, reply))
    }

    /// The first half of [`Engine::prepare_new`]: the decision and the draw, which read
    /// the Service port and its candidates but no endpoint. A worker makes them for the
    /// whole batch, brings the chosen endpoints into the cache ([`warm_endpoint`]), then
    /// asks for the reply tuples ([`Engine::reply_ahead`]): with thousands of Services
    /// each chosen endpoint is a cache miss, and the batch's misses then overlap.
    pub fn choose_ahead(
        &mut self,
        snap: &Snapshot,
        f: &rewrite::FlowPacket,
        in_interface: Option<&str>,
    ) -> Option<Prepared> {
        let t = f.tuple();
        let Decision::Forward(fwd) = decide_tuple(snap, &t, in_interface) else {
            return None;
        };
        let sp = fwd.port;
        if sp.affinity != Affinity::None || sp.scheduler.uses_cursor() || sp.scheduler.uses_load() {
            return None;
        }
        let random = self.next_random();
        let endpoint = pick_stateless(&fwd, t.src_addr(), t.dst_addr(), t.proto, random);
        let choice = endpoint.map(|endpoint| Choice {
            port_index: fwd.port_index,
            endpoint,
            masquerade: fwd.masquerade,
        });
        Some(Prepared {
            random,
            snapshot: (std::ptr::from_ref(snap) as usize, snap.generation),
            choice,
        })
    }

    /// The second half of [`Engine::prepare_new`]: the reply tuple of the connection
    /// `prepared` (made by [`Engine::choose_ahead`] for `f` on `snap`) would open, `None`
    /// when it is masqueraded or there is no choice.
    pub fn reply_ahead(
        &self,
        snap: &Snapshot,
        f: &rewrite::FlowPacket,
        prepared: &Prepared,
        in_interface: Option<&str>,
    ) -> Option<Tuple> {
        let c = prepared.choice_on(snap)?;
        let ep = snap.port(c.port_index).endpoints.get(c.endpoint as usize)?;
        let t = f.tuple();
        (!self.is_host_interface(in_interface) && !c.masquerade_for(t.src, ep))
            .then(|| Tuple::new(ep.addr, t.src_addr(), t.proto))
    }

    /// Whether a packet that arrived on `in_interface` is one of the node's own
    /// connections (it came through kxp's service device).
    fn is_host_interface(&self, in_interface: Option<&str>) -> bool {
        in_interface.is_some() && in_interface == self.host_interface.as_deref()
    }

    /// An ICMP error about a translated flow: translate the quote and the outer header
    /// so the error reaches the other end about the packet it actually sent.
    fn icmp_error(
        &mut self,
        snap: &Snapshot,
        pkt: &mut [u8],
        e: &rewrite::IcmpErrorPacket,
        now: u64,
    ) -> Verdict {
        let quoted = e.inner();
        let Some((dir, entry)) = self.table.get(&quoted.reversed(), now) else {
            // About a packet from a Service frontend that no tracked flow sent (kernel
            // conntrack: INVALID): nothing to translate it for, and handed to the kernel
            // it would be routed back to kxp (Service addresses are routed into the
            // service device) until its TTL ran out.
            if snap
                .port_for(quoted.src, quoted.proto, quoted.sport)
                .is_some()
            {
                return Verdict::Drop(DropCause::IcmpErrorUntracked);
            }
            return Verdict::Pass;
        };
        let (orig, reply, tag) = (*entry.orig(), *entry.reply(), entry.tag());
        // The error travels in `dir`; its quote is a packet of the opposite direction.
        let (inner_to, outer_dst, outer_src) = match dir {
            Direction::Reply => (orig, orig.src, (e.src() == reply.src).then_some(orig.dst)),
            Direction::Original => (reply, reply.src, (e.src() == orig.src).then_some(reply.dst)),
        };
        match rewrite::rewrite_icmp_error(pkt, e, &inner_to, outer_src, outer_dst) {
            Ok(()) => {}
            Err(_) => return Verdict::Drop(DropCause::Malformed("icmp_rewrite")),
        }
        let handover = match dir {
            Direction::Original => tag_handover(tag),
            Direction::Reply => Handover::No,
        };
        // Handed to the kernel, the kernel's forwarding decrements the TTL.
        if handover == Handover::No {
            match rewrite::decrement_ttl(pkt) {
                Ok(true) => {}
                Ok(false) => return Verdict::Drop(DropCause::TtlExceeded),
                Err(err) => return Verdict::Drop(DropCause::Malformed(err.reason())),
            }
        }
        self.counters.icmp_errors_translated += 1;
        Verdict::Forward {
            new_flow: false,
            dst: outer_dst,
            from: None,
            // Towards the client: with its VLAN's tag; towards the endpoint: as its
            // flow's packets go.
            vlan: match dir {
                Direction::Reply => tag_vlan(tag),
                Direction::Original => 0,
            },
            handover,
        }
    }
}

/// The scheduler's choice among `fwd`'s candidates for a connection `src` → `dst`, as
/// far as it depends only on the connection and `random`: no endpoint counted busy, a
/// fresh round-robin position. An index into `fwd.port.endpoints`.
fn pick_stateless(
    fwd: &Forward<'_>,
    src: SocketAddr,
    dst: SocketAddr,
    proto: Protocol,
    random: u64,
) -> Option<u32> {
    let sp = fwd.port;
    let none = |_: SocketAddr| 0;
    let input = PickInput {
        src,
        dst,
        proto: proto.number(),
        random,
        active: &none,
    };
    pick(
        sp.scheduler,
        &sp.endpoints,
        fwd.candidates,
        sp.cat.equal_weights,
        Some(fwd.hash_table()),
        &input,
        &mut RrCursor::default(),
    )
}

/// Brings the endpoint `prepared` chose into the cache ([`Engine::choose_ahead`]): its
/// first and last bytes' lines (an endpoint is 88 bytes, so one in three straddles two
/// lines, and which fields the reply reads is the compiler's layout).
pub fn warm_endpoint(snap: &Snapshot, prepared: &Prepared, prefetch: impl Fn(*const u8)) {
    if let Some(c) = prepared.choice_on(snap)
        && let Some(ep) = snap.port(c.port_index).endpoints.get(c.endpoint as usize)
    {
        let at: *const u8 = std::ptr::from_ref(ep).cast();
        prefetch(at);
        prefetch(at.wrapping_add(std::mem::size_of::<nat::model::Endpoint>() - 1));
    }
}

/// Warms what deciding and picking an endpoint for a batch's likely new connections
/// will read ([`Engine::prepare_new`]): `keys` are the batch's flow packets' tuples and
/// bit k of `fresh` says the k-th found no flow. With thousands of Services, a new
/// connection's Service port, its endpoint lists and its endpoints are cache misses, one
/// after another for each packet; asked for in stages over the whole batch (the frontend
/// lookups, then the ports, then their lists), the misses of different packets overlap.
/// `prefetch` is the dataplane's hint instruction (this crate does no I/O and has no
/// unsafe; a function item, so that it is inlined).
pub fn warm_choices(snap: &Snapshot, keys: &[Tuple], fresh: u64, prefetch: impl Fn(*const u8)) {
    let mut ports = [0u32; 64];
    let mut n = 0;
    let mut bits = fresh;
    for t in keys {
        if bits == 0 || n == ports.len() {
            break;
        }
        if bits & 1 == 1
            && let Some(i) = snap.port_for(t.dst, t.proto, t.dport)
        {
            ports[n] = i;
            n += 1;
        }
        bits >>= 1;
    }
    let ports = &ports[..n];
    // Every line of the port: deciding reads fields all over it (its size is the
    // compiler's layout, over 320 bytes).
    let size = std::mem::size_of::<nat::model::ServicePort>();
    for &i in ports {
        let sp: *const u8 = std::ptr::from_ref(snap.port(i)).cast();
        for off in (0..size).step_by(64).chain([size - 1]) {
            prefetch(sp.wrapping_add(off));
        }
    }
    for &i in ports {
        let sp = snap.port(i);
        prefetch(sp.cat.cluster.as_ptr().cast());
        prefetch(sp.cat.local.as_ptr().cast());
        prefetch(sp.endpoints.as_ptr().cast());
        prefetch(sp.endpoints.as_ptr().cast::<u8>().wrapping_add(64));
    }
}

/// kube-proxy's decision for a new connection with tuple `t` arriving on `in_interface`.
fn decide_tuple<'s>(snap: &'s Snapshot, t: &Tuple, in_interface: Option<&str>) -> Decision<'s> {
    decide(
        snap,
        &NewPacket {
            src: t.src,
            dst: t.dst,
            dport: t.dport,
            proto: t.proto,
            in_interface,
        },
    )
}

fn forward(
    pkt: &mut [u8],
    f: &rewrite::FlowPacket,
    to: &Tuple,
    new_flow: bool,
    vlan: u16,
    handover: Handover,
) -> Verdict {
    if let Err(e) = rewrite::rewrite(pkt, f, to) {
        let _ = e;
        return Verdict::Drop(DropCause::Malformed("rewrite"));
    }
    // A packet handed to the kernel has its TTL decremented by the kernel, which forwards
    // it from the service device: one hop, counted once (and expiring where the kernel
    // says so).
    let hop = if handover == Handover::No {
        rewrite::decrement_ttl(pkt)
    } else {
        Ok(true)
    };
    match hop {
        Ok(true) => Verdict::Forward {
            new_flow,
            dst: to.dst,
            from: Some(f.tuple()),
            vlan,
            handover,
        },
        Ok(false) => Verdict::Drop(DropCause::TtlExceeded),
        Err(e) => Verdict::Drop(DropCause::Malformed(ParseError::reason(&e))),
    }
}

#[cfg(test)]
mod tests;
