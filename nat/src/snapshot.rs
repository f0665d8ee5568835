//! The immutable snapshot a worker decides with: every Service port of both families and
//! the frontend indexes that find one from a packet's destination in O(1).
//!
//! Built by the control plane, published by one pointer swap, read by workers once per
//! batch. Service ports are held behind `Arc` in stable slots, so the snapshot after one
//! Service changed shares every other port with the previous one, and an [`Indexer`]
//! turns a change into a short list of [`Op`]s that bring a copy of the previous
//! snapshot up to date: the work per update follows what changed, not the cluster size.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, LazyLock};

use foldhash::fast::FixedState;

use crate::model::{Family, NodeContext, ServicePort};
use crate::tuple::Protocol;

/// Which kind of Service address a packet was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrontendKind {
    ClusterIp,
    ExternalIp,
    LoadBalancer,
    NodePort,
}

impl FrontendKind {
    pub fn name(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "ClusterIP",
            FrontendKind::ExternalIp => "externalIP",
            FrontendKind::LoadBalancer => "LoadBalancer IP",
            FrontendKind::NodePort => "NodePort",
        }
    }
}

/// An entry of the frontend index: the Service port (index into `Snapshot::ports`) and
/// how it was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frontend {
    pub port: u32,
    pub kind: FrontendKind,
}

type FastMap<K, V> = HashMap<K, V, FixedState>;
type FastSet<K> = HashSet<K, FixedState>;

/// IPv4 frontend key packed into 8 bytes (address; port and protocol), so that an index
/// of 100k Services stays small enough (12 bytes an entry) to mostly live in L2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct V4Key([u32; 2]);

impl V4Key {
    #[inline]
    fn new(ip: std::net::Ipv4Addr, proto: Protocol, port: u16) -> V4Key {
        V4Key([u32::from(ip), (port as u32) << 8 | proto.number() as u32])
    }
}

/// A [`Frontend`] packed into 4 bytes: the port index and the kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Packed(u32);

impl Packed {
    fn new(f: Frontend) -> Packed {
        let kind = match f.kind {
            FrontendKind::ClusterIp => 0,
            FrontendKind::ExternalIp => 1,
            FrontendKind::LoadBalancer => 2,
            FrontendKind::NodePort => 3,
        };
        Packed(f.port << 2 | kind)
    }

    #[inline]
    fn get(self) -> Frontend {
        let kind = match self.0 & 3 {
            0 => FrontendKind::ClusterIp,
            1 => FrontendKind::ExternalIp,
            2 => FrontendKind::LoadBalancer,
            _ => FrontendKind::NodePort,
        };
        Frontend {
            port: self.0 >> 2,
            kind,
        }
    }
}

/// A consistent view of every Service port, for one publication.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Increases by one with every publication.
    pub generation: u64,
    pub node: Arc<NodeContext>,
    /// Every Service port of both families, in stable slots (a vacant slot is `None`).
    slots: Vec<Option<Arc<ServicePort>>>,
    live: usize,
    /// `(ip, protocol, port)` of ClusterIPs, externalIPs and LoadBalancer VIPs: IPv4 in a
    /// compact index, IPv6 in a general one.
    addrs_v4: FastMap<V4Key, Packed>,
    addrs_v6: FastMap<(IpAddr, Protocol, u16), Frontend>,
    /// `(family, protocol, nodePort)`.
    node_ports: FastMap<(Family, Protocol, u16), u32>,
    /// Every ClusterIP (any port), for kube-proxy's "invalid port of a ClusterIP" reject.
    cluster_ips: FastSet<IpAddr>,
    /// Frontends claimed by two Service ports: the first in name order keeps it.
    pub conflicts: Vec<String>,
    /// The cluster's NetworkPolicies and the pods they select, when any policy exists
    /// and enforcement is on (see [`crate::policy`]).
    pub policy: Option<Arc<crate::policy::PolicyView>>,
}

/// A snapshot to publish and how it differs from the previous one.
#[derive(Debug, Clone)]
pub struct Update {
    pub snapshot: Arc<Snapshot>,
    /// Service ports no longer there (a changed port is removed and added).
    pub removed: Vec<Arc<ServicePort>>,
    /// Service ports new in this snapshot.
    pub added: Vec<Arc<ServicePort>>,
    /// The first snapshot, or the node context changed: consumers re-derive everything.
    pub full: bool,
}

impl Update {
    /// An update that asks consumers to re-derive everything from `snapshot`.
    pub fn full(snapshot: Arc<Snapshot>) -> Update {
        Update {
            added: snapshot.ports().cloned().collect(),
            snapshot,
            removed: Vec::new(),
            full: true,
        }
    }
}

/// One change to a [`Snapshot`], produced by an [`Indexer`].
#[derive(Debug, Clone)]
pub enum Op {
    /// Fill or vacate a slot.
    Slot(u32, Option<Arc<ServicePort>>),
    /// Point an address frontend at a slot, or remove it.
    Addr((IpAddr, Protocol, u16), Option<Frontend>),
    /// Point a NodePort at a slot, or remove it.
    NodePort((Family, Protocol, u16), Option<u32>),
    /// An address becomes (true) or stops being (false) a ClusterIP.
    ClusterIp(IpAddr, bool),
}

static VACANT: LazyLock<ServicePort> = LazyLock::new(|| ServicePort {
    name: crate::model::ServicePortName {
        namespace: String::new(),
        name: "(vacant)".into(),
        port: String::new(),
        protocol: Protocol::Tcp,
    },
    cluster_ip: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
    port: 0,
    node_port: 0,
    external_ips: Vec::new(),
    lb_vips: Vec::new(),
    lb_source_ranges: Vec::new(),
    external_policy_local: false,
    internal_policy_local: false,
    affinity: crate::model::Affinity::None,
    health_check_node_port: 0,
    scheduler: crate::select::Scheduler::Random,
    endpoints: Vec::new(),
    cat: Default::default(),
    cluster_table: Vec::new(),
    local_table: Vec::new(),
    name_hash: 0,
});

impl Snapshot {
    /// A snapshot without Service ports.
    pub fn empty(generation: u64, node: Arc<NodeContext>) -> Self {
        Snapshot {
            generation,
            node,
            slots: Vec::new(),
            live: 0,
            addrs_v4: FastMap::default(),
            addrs_v6: FastMap::default(),
            node_ports: FastMap::default(),
            cluster_ips: FastSet::default(),
            conflicts: Vec::new(),
            policy: None,
        }
    }

    /// Applies an [`Indexer`]'s changes in order.
    pub fn apply(&mut self, ops: &[Op]) {
        for op in ops {
            match op {
                Op::Slot(i, sp) => {
                    let i = *i as usize;
                    if self.slots.len() <= i {
                        self.slots.resize(i + 1, None);
                    }
                    self.live =
                        self.live + sp.is_some() as usize - self.slots[i].is_some() as usize;
                    self.slots[i] = sp.clone();
                }
                Op::Addr(key, f) => match (key.0, f) {
                    (IpAddr::V4(v4), Some(f)) => {
                        self.addrs_v4
                            .insert(V4Key::new(v4, key.1, key.2), Packed::new(*f));
                    }
                    (IpAddr::V4(v4), None) => {
                        self.addrs_v4.remove(&V4Key::new(v4, key.1, key.2));
                    }
                    (IpAddr::V6(_), Some(f)) => {
                        self.addrs_v6.insert(*key, *f);
                    }
                    (IpAddr::V6(_), None) => {
                        self.addrs_v6.remove(key);
                    }
                },
                Op::NodePort(key, Some(i)) => {
                    self.node_ports.insert(*key, *i);
                }
                Op::NodePort(key, None) => {
                    self.node_ports.remove(key);
                }
                Op::ClusterIp(ip, true) => {
                    self.cluster_ips.insert(*ip);
                }
                Op::ClusterIp(ip, false) => {
                    self.cluster_ips.remove(ip);
                }
            }
        }
    }

    /// The frontend a ClusterIP, externalIP or LoadBalancer VIP packet is for.
    #[inline]
    pub fn lookup_addr(&self, dst: IpAddr, proto: Protocol, dport: u16) -> Option<Frontend> {
        match dst {
            IpAddr::V4(v4) => self
                .addrs_v4
                .get(&V4Key::new(v4, proto, dport))
                .map(|p| p.get()),
            IpAddr::V6(_) => self.addrs_v6.get(&(dst, proto, dport)).copied(),
        }
    }

    /// The Service port a packet to `dst:dport` is for: by its frontend address, else by
    /// a NodePort of `dst`'s family.
    #[inline]
    pub fn port_for(&self, dst: IpAddr, proto: Protocol, dport: u16) -> Option<u32> {
        self.lookup_addr(dst, proto, dport)
            .map(|f| f.port)
            .or_else(|| self.lookup_node_port(dst, proto, dport))
    }

    /// The Service port owning a NodePort of `dst`'s family.
    #[inline]
    pub fn lookup_node_port(&self, dst: IpAddr, proto: Protocol, dport: u16) -> Option<u32> {
        self.node_ports
            .get(&(Family::of(&dst), proto, dport))
            .copied()
    }

    #[inline]
    pub fn is_cluster_ip(&self, ip: IpAddr) -> bool {
        self.cluster_ips.contains(&ip)
    }

    /// The Service port in slot `index` (as the lookups return it). A vacant slot, which
    /// no lookup returns, reads as a port without endpoints.
    #[inline]
    pub fn port(&self, index: u32) -> &ServicePort {
        match self.slots.get(index as usize) {
            Some(Some(sp)) => sp,
            _ => &VACANT,
        }
    }

    /// Every Service port, in slot order.
    pub fn ports(&self) -> impl Iterator<Item = &Arc<ServicePort>> {
        self.slots.iter().flatten()
    }

    /// Every Service port, sorted by name then family (for listings).
    pub fn ports_sorted(&self) -> Vec<&Arc<ServicePort>> {
        let mut v: Vec<_> = self.ports().collect();
        v.sort_by(|a, b| {
            (&a.name, Family::of(&a.cluster_ip)).cmp(&(&b.name, Family::of(&b.cluster_ip)))
        });
        v
    }

    /// Number of Service ports.
    pub fn port_count(&self) -> usize {
        self.live
    }

    /// Number of frontends (addresses × ports, plus NodePorts).
    pub fn frontend_count(&self) -> usize {
        self.addrs_v4.len() + self.addrs_v6.len() + self.node_ports.len()
    }
}

/// A frontend as claimed by Service ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum FrontKey {
    Addr(IpAddr, Protocol, u16),
    NodePort(Family, Protocol, u16),
}

fn claims_of(sp: &ServicePort) -> Vec<(FrontKey, FrontendKind)> {
    let proto = sp.name.protocol;
    let mut out = Vec::with_capacity(1 + sp.external_ips.len() + sp.lb_vips.len());
    out.push((
        FrontKey::Addr(sp.cluster_ip, proto, sp.port),
        FrontendKind::ClusterIp,
    ));
    for &ip in &sp.external_ips {
        out.push((FrontKey::Addr(ip, proto, sp.port), FrontendKind::ExternalIp));
    }
    for &ip in &sp.lb_vips {
        out.push((
            FrontKey::Addr(ip, proto, sp.port),
            FrontendKind::LoadBalancer,
        ));
    }
    if sp.node_port != 0 {
        out.push((
            FrontKey::NodePort(Family::of(&sp.cluster_ip), proto, sp.node_port),
            FrontendKind::NodePort,
        ));
    }
    out
}

fn kind_rank(k: FrontendKind) -> u8 {
    match k {
        FrontendKind::ClusterIp => 0,
        FrontendKind::ExternalIp => 1,
        FrontendKind::LoadBalancer => 2,
        FrontendKind::NodePort => 3,
    }
}

/// The control plane's side of the snapshot: slot allocation, and every claim on every
/// frontend so that a conflict is settled the same way whatever the order of updates
/// (the Service port first by name, then family, keeps the frontend; ClusterIP before
/// externalIP before LoadBalancer VIP), and a frontend passes to the next claimant when
/// its owner goes. Each insert and remove records the [`Op`]s a snapshot needs.
#[derive(Debug, Default, Clone)]
pub struct Indexer {
    slots: Vec<Option<Arc<ServicePort>>>,
    free: Vec<u32>,
    /// Claimants of each frontend, best first.
    claims: FastMap<FrontKey, Vec<(u32, FrontendKind)>>,
    /// Frontends with claimants from more than one slot.
    contested: FastSet<FrontKey>,
    cluster_ips: FastMap<IpAddr, u32>,
    ops: Vec<Op>,
}

impl Indexer {
    /// Adds a Service port; returns its slot.
    pub fn insert(&mut self, sp: Arc<ServicePort>) -> u32 {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        };
        self.slots[slot as usize] = Some(sp.clone());
        self.ops.push(Op::Slot(slot, Some(sp.clone())));
        let n = self.cluster_ips.entry(sp.cluster_ip).or_default();
        *n += 1;
        if *n == 1 {
            self.ops.push(Op::ClusterIp(sp.cluster_ip, true));
        }
        for (key, kind) in claims_of(&sp) {
            let mut list = self.claims.remove(&key).unwrap_or_default();
            let before = list.first().copied();
            let rank = self.rank(slot, kind);
            let pos = list
                .iter()
                .position(|&(s, k)| self.rank(s, k) > rank)
                .unwrap_or(list.len());
            list.insert(pos, (slot, kind));
            self.settle(key, before, &list);
            self.claims.insert(key, list);
        }
        slot
    }

    /// Removes the Service port in `slot`; returns it.
    pub fn remove(&mut self, slot: u32) -> Option<Arc<ServicePort>> {
        let sp = self.slots.get_mut(slot as usize)?.take()?;
        self.free.push(slot);
        self.ops.push(Op::Slot(slot, None));
        if let Some(n) = self.cluster_ips.get_mut(&sp.cluster_ip) {
            *n -= 1;
            if *n == 0 {
                self.cluster_ips.remove(&sp.cluster_ip);
                self.ops.push(Op::ClusterIp(sp.cluster_ip, false));
            }
        }
        for (key, _) in claims_of(&sp) {
            let Some(mut list) = self.claims.remove(&key) else {
                continue;
            };
            let before = list.first().copied();
            list.retain(|&(s, _)| s != slot);
            self.settle(key, before, &list);
            if !list.is_empty() {
                self.claims.insert(key, list);
            }
        }
        Some(sp)
    }

    /// The Service port in `slot`.
    pub fn get(&self, slot: u32) -> Option<&Arc<ServicePort>> {
        self.slots.get(slot as usize)?.as_ref()
    }

    /// The changes recorded since the last call.
    pub fn take_ops(&mut self) -> Vec<Op> {
        std::mem::take(&mut self.ops)
    }

    /// One line per losing claim on a contested frontend, sorted.
    pub fn conflicts(&self) -> Vec<String> {
        let mut out = Vec::new();
        for key in &self.contested {
            let Some(list) = self.claims.get(key) else {
                continue;
            };
            let (ws, wk) = list[0];
            let winner = self.name(ws);
            for &(s, k) in &list[1..] {
                if s == ws {
                    continue;
                }
                out.push(match *key {
                    FrontKey::Addr(ip, proto, port) => format!(
                        "{} {ip}:{port}/{proto} of {} is already the {} of {winner}",
                        k.name(),
                        self.name(s),
                        wk.name(),
                    ),
                    FrontKey::NodePort(_, proto, port) => format!(
                        "nodePort {port}/{proto} of {} is already used by {winner}",
                        self.name(s)
                    ),
                });
            }
        }
        out.sort();
        out.dedup();
        out
    }

    fn name(&self, slot: u32) -> String {
        self.get(slot)
            .map(|sp| sp.name.to_string())
            .unwrap_or_default()
    }

    fn rank(
        &self,
        slot: u32,
        kind: FrontendKind,
    ) -> (Option<(&crate::model::ServicePortName, Family)>, u8) {
        (
            self.get(slot)
                .map(|sp| (&sp.name, Family::of(&sp.cluster_ip))),
            kind_rank(kind),
        )
    }

    /// Records the op for `key` if its owner changed, and whether it is contested.
    fn settle(
        &mut self,
        key: FrontKey,
        before: Option<(u32, FrontendKind)>,
        list: &[(u32, FrontendKind)],
    ) {
        let after = list.first().copied();
        if before != after {
            self.ops.push(match key {
                FrontKey::Addr(ip, proto, port) => Op::Addr(
                    (ip, proto, port),
                    after.map(|(port, kind)| Frontend { port, kind }),
                ),
                FrontKey::NodePort(f, proto, port) => {
                    Op::NodePort((f, proto, port), after.map(|(s, _)| s))
                }
            });
        }
        let contested = list.iter().any(|&(s, _)| Some(s) != after.map(|a| a.0));
        if contested {
            self.contested.insert(key);
        } else {
            self.contested.remove(&key);
        }
    }
}
