//! Applying netlink messages (dump answers and events alike) to a [`FibTable`].
//!
//! Every message carries the whole object, so applying is idempotent: a dump followed by
//! the events queued while it ran converges to the kernel's state, whatever the overlap.

use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::Arc;

use rtnetlink::packet_core::NLM_F_REPLACE;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressMessage};
use rtnetlink::packet_route::link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use rtnetlink::packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteMessage, RouteNextHopFlags, RouteType, RouteVia,
};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};

use super::table::{Addr, FibTable, Hop, Kind, Link, Lpm, RouteEntry, TABLES, ip_bits, mask};

/// What applying a message did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Effect {
    /// The tables changed: publish a new generation.
    pub changed: bool,
    /// The kernel may have flushed IPv4 routes without telling (link down, address or
    /// link removed): dump the routes again.
    pub resync_routes: bool,
}

impl Effect {
    pub fn merge(&mut self, other: Effect) {
        self.changed |= other.changed;
        self.resync_routes |= other.resync_routes;
    }
}

/// Hash of a next hop, for rate limiting resolution requests.
pub(super) fn next_hop_hash(ifindex: u32, ip: IpAddr) -> u64 {
    foldhash::fast::FixedState::with_seed(0x6b78_7066).hash_one((ifindex, ip))
}

/// Whether the kernel itself would transmit to a neighbour in this state.
pub(super) fn usable_state(state: NeighbourState) -> bool {
    matches!(
        state,
        NeighbourState::Reachable
            | NeighbourState::Stale
            | NeighbourState::Delay
            | NeighbourState::Probe
            | NeighbourState::Permanent
            | NeighbourState::Noarp
    )
}

impl FibTable {
    /// An empty table for a fresh dump, keeping the attached interface list.
    pub(super) fn empty_like(&self) -> FibTable {
        FibTable {
            generation: self.generation,
            attached: self.attached.clone(),
            ..FibTable::default()
        }
    }

    pub(super) fn new_with_attached(attached: &[u32]) -> FibTable {
        FibTable {
            attached: attached.into(),
            ..FibTable::default()
        }
    }

    /// Replaces the routes with those of `fresh` (after a route-only re-dump).
    pub(super) fn take_routes(&mut self, fresh: FibTable) {
        self.routes = fresh.routes;
    }

    /// Applies one message; `nl_flags` is the netlink header's flags (NLM_F_REPLACE).
    pub(super) fn apply(&mut self, msg: &RouteNetlinkMessage, nl_flags: u16) -> Effect {
        match msg {
            RouteNetlinkMessage::NewLink(m) => self.new_link(m),
            RouteNetlinkMessage::DelLink(m) => self.del_link(m),
            RouteNetlinkMessage::NewAddress(m) => self.set_addr(m, true),
            RouteNetlinkMessage::DelAddress(m) => self.set_addr(m, false),
            RouteNetlinkMessage::NewNeighbour(m) => self.set_neigh(m, true),
            RouteNetlinkMessage::DelNeighbour(m) => self.set_neigh(m, false),
            RouteNetlinkMessage::NewRoute(m) => {
                self.set_route(m, Some(nl_flags & NLM_F_REPLACE != 0))
            }
            RouteNetlinkMessage::DelRoute(m) => self.set_route(m, None),
            _ => Effect::default(),
        }
    }

    fn new_link(&mut self, m: &LinkMessage) -> Effect {
        // Bridge port messages (AF_BRIDGE) share the group; they are not links.
        if m.header.interface_family != AddressFamily::Unspec {
            return Effect::default();
        }
        let mut link = Link {
            name: String::new(),
            mac: None,
            up: m.header.flags.contains(LinkFlags::Up),
            master: None,
            mtu: 0,
            vlan: false,
        };
        for attr in &m.attributes {
            match attr {
                LinkAttribute::IfName(name) => link.name.clone_from(name),
                LinkAttribute::Controller(i) => link.master = Some(*i).filter(|&i| i != 0),
                LinkAttribute::Mtu(m) => link.mtu = *m,
                LinkAttribute::Address(a) => link.mac = <[u8; 6]>::try_from(a.as_slice()).ok(),
                LinkAttribute::LinkInfo(info) => {
                    link.vlan = info
                        .iter()
                        .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Vlan)));
                }
                _ => {}
            }
        }
        let old = self.links.get(&m.header.index);
        if old == Some(&link) {
            return Effect::default();
        }
        let resync_routes = old.is_some_and(|o| o.up != link.up);
        Arc::make_mut(&mut self.links).insert(m.header.index, link);
        Effect {
            changed: true,
            resync_routes,
        }
    }

    fn del_link(&mut self, m: &LinkMessage) -> Effect {
        if m.header.interface_family != AddressFamily::Unspec {
            return Effect::default();
        }
        let ifindex = m.header.index;
        if Arc::make_mut(&mut self.links).remove(&ifindex).is_none() {
            return Effect::default();
        }
        if self.addrs.iter().any(|a| a.ifindex == ifindex) {
            Arc::make_mut(&mut self.addrs).retain(|a| a.ifindex != ifindex);
        }
        if self.neigh.keys().any(|(i, _)| *i == ifindex) {
            Arc::make_mut(&mut self.neigh).retain(|(i, _), _| *i != ifindex);
        }
        if self
            .fdb
            .iter()
            .any(|(&(b, _), &p)| b == ifindex || p == ifindex)
        {
            Arc::make_mut(&mut self.fdb).retain(|&(b, _), &mut p| b != ifindex && p != ifindex);
        }
        Effect {
            changed: true,
            resync_routes: true,
        }
    }

    fn set_addr(&mut self, m: &AddressMessage, present: bool) -> Effect {
        let (mut local, mut address, mut flags) = (None, None, None);
        for attr in &m.attributes {
            match attr {
                AddressAttribute::Local(ip) => local = Some(*ip),
                AddressAttribute::Address(ip) => address = Some(*ip),
                AddressAttribute::Flags(f) => flags = Some(*f),
                _ => {}
            }
        }
        // IFA_LOCAL is this host's address; IFA_ADDRESS is the peer on point-to-point links.
        let Some(ip) = local.or(address) else {
            return Effect::default();
        };
        let flags = flags
            .unwrap_or_else(|| AddressFlags::from_bits_retain(u32::from(m.header.flags.bits())));
        let addr = Addr {
            ifindex: m.header.index,
            addr: ip,
            prefix_len: m.header.prefix_len,
            secondary: flags.contains(AddressFlags::Secondary),
            preferred: !flags.intersects(
                AddressFlags::Tentative | AddressFlags::Dadfailed | AddressFlags::Deprecated,
            ),
        };
        let same = |a: &Addr| {
            a.ifindex == addr.ifindex && a.addr == addr.addr && a.prefix_len == addr.prefix_len
        };
        let at = self.addrs.iter().position(same);
        match (at, present) {
            (Some(i), true) if self.addrs[i] == addr => Effect::default(),
            (Some(i), true) => {
                Arc::make_mut(&mut self.addrs)[i] = addr;
                Effect {
                    changed: true,
                    resync_routes: false,
                }
            }
            (None, true) => {
                Arc::make_mut(&mut self.addrs).push(addr);
                Effect {
                    changed: true,
                    resync_routes: false,
                }
            }
            (Some(i), false) => {
                Arc::make_mut(&mut self.addrs).remove(i);
                Effect {
                    changed: true,
                    resync_routes: ip.is_ipv4(),
                }
            }
            (None, false) => Effect::default(),
        }
    }

    /// A bridge forwarding-database entry (`bridge fdb`): a MAC learned on a port of a
    /// bridge. Entries of the bridge's own or its ports' MACs (permanent), static ones
    /// and those of a port device itself (no master) are not where pods are.
    fn set_fdb(&mut self, m: &NeighbourMessage, present: bool) -> Effect {
        let (mut mac, mut master) = (None, None);
        for attr in &m.attributes {
            match attr {
                NeighbourAttribute::LinkLayerAddress(a) => {
                    mac = <[u8; 6]>::try_from(a.as_slice()).ok()
                }
                NeighbourAttribute::Controller(b) => master = Some(*b),
                _ => {}
            }
        }
        let (Some(mac), Some(bridge)) = (mac, master) else {
            return Effect::default();
        };
        let key = (bridge, mac);
        let port = m.header.ifindex;
        let learned = present
            && !matches!(
                m.header.state,
                NeighbourState::Permanent | NeighbourState::Noarp
            );
        match (learned, self.fdb.get(&key)) {
            (true, Some(&p)) if p == port => Effect::default(),
            (true, _) => {
                Arc::make_mut(&mut self.fdb).insert(key, port);
                Effect {
                    changed: true,
                    resync_routes: false,
                }
            }
            (false, Some(&p)) if p == port => {
                Arc::make_mut(&mut self.fdb).remove(&key);
                Effect {
                    changed: true,
                    resync_routes: false,
                }
            }
            (false, _) => Effect::default(),
        }
    }

    fn set_neigh(&mut self, m: &NeighbourMessage, present: bool) -> Effect {
        let family = m.header.family;
        if family == AddressFamily::Bridge {
            return self.set_fdb(m, present);
        }
        if !matches!(family, AddressFamily::Inet | AddressFamily::Inet6)
            || m.header.flags.contains(NeighbourFlags::Proxy)
        {
            return Effect::default();
        }
        let (mut ip, mut mac) = (None, None);
        for attr in &m.attributes {
            match attr {
                NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => {
                    ip = Some(IpAddr::V4(*v4))
                }
                NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => {
                    ip = Some(IpAddr::V6(*v6))
                }
                NeighbourAttribute::LinkLayerAddress(a) => {
                    mac = <[u8; 6]>::try_from(a.as_slice()).ok()
                }
                _ => {}
            }
        }
        let Some(ip) = ip else {
            return Effect::default();
        };
        let key = (m.header.ifindex, ip);
        let usable = if present && usable_state(m.header.state) {
            mac
        } else {
            None
        };
        match usable {
            Some(mac) if self.neigh.get(&key) == Some(&mac) => Effect::default(),
            Some(mac) => {
                Arc::make_mut(&mut self.neigh).insert(key, mac);
                Effect {
                    changed: true,
                    resync_routes: false,
                }
            }
            None if self.neigh.contains_key(&key) => {
                Arc::make_mut(&mut self.neigh).remove(&key);
                Effect {
                    changed: true,
                    resync_routes: false,
                }
            }
            None => Effect::default(),
        }
    }

    /// `replace`: `Some(flag)` for RTM_NEWROUTE (with NLM_F_REPLACE or not), `None` for
    /// RTM_DELROUTE.
    fn set_route(&mut self, m: &RouteMessage, replace: Option<bool>) -> Effect {
        let Some(parsed) = parse_route(m) else {
            return Effect::default();
        };
        let ParsedRoute {
            family,
            table,
            prefix,
            len,
            entry,
        } = parsed;
        let lpm: &mut Lpm = Arc::make_mut(&mut self.routes[family][table]);
        let entries = lpm.entries_mut(prefix, len);
        let same_slot = |e: &RouteEntry| {
            e.tos == entry.tos && e.metric == entry.metric && e.src_len == entry.src_len
        };
        match replace {
            Some(true) => entries.retain(|e| !same_slot(e)),
            _ => entries.retain(|e| !(same_slot(e) && e.hop == entry.hop)),
        }
        if replace.is_some() {
            let at = entries.partition_point(|e| e.metric <= entry.metric);
            entries.insert(at, entry);
        }
        lpm.prune(prefix, len);
        Effect {
            changed: true,
            resync_routes: false,
        }
    }
}

pub(super) struct ParsedRoute {
    pub family: usize,
    pub table: usize,
    pub prefix: u128,
    pub len: u8,
    pub entry: RouteEntry,
}

fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

fn via_ip(v: &RouteVia) -> Option<IpAddr> {
    match v {
        RouteVia::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteVia::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

/// A route message in the mirror's terms; `None` for routes the mirror ignores (other
/// tables and families, cloned/cache entries).
pub(super) fn parse_route(m: &RouteMessage) -> Option<ParsedRoute> {
    let h = &m.header;
    let (family, width) = match h.address_family {
        AddressFamily::Inet => (0, 32),
        AddressFamily::Inet6 => (1, 128),
        _ => return None,
    };
    if h.flags.contains(RouteFlags::Cloned) || h.destination_prefix_length > width {
        return None;
    }
    let mut table_id = u32::from(h.table);
    let (mut dst, mut gateway, mut oif, mut prefsrc, mut metric) = (None, None, None, None, 0);
    let mut unsupported = false;
    let mut multipath = None;
    for attr in &m.attributes {
        match attr {
            RouteAttribute::Table(t) => table_id = *t,
            RouteAttribute::Destination(a) => dst = route_ip(a),
            RouteAttribute::Gateway(a) => gateway = route_ip(a),
            RouteAttribute::Via(v) => gateway = via_ip(v),
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::PrefSource(a) => prefsrc = route_ip(a),
            RouteAttribute::Priority(p) => metric = *p,
            RouteAttribute::MultiPath(hops) => multipath = Some(hops),
            RouteAttribute::NhId(_) | RouteAttribute::Encap(_) | RouteAttribute::EncapType(_) => {
                unsupported = true
            }
            _ => {}
        }
    }
    let table = TABLES.iter().position(|t| *t == table_id)?;
    let kind = match h.kind {
        RouteType::Unicast => Kind::Unicast,
        RouteType::Local | RouteType::Broadcast | RouteType::Anycast => Kind::Local,
        RouteType::Throw => Kind::Throw,
        _ => Kind::Reject,
    };
    let hop = match multipath {
        // ECMP: the first live nexthop.
        Some(hops) => hops
            .iter()
            .find(|nh| !nh.flags.contains(RouteNextHopFlags::Dead))
            .map(|nh| {
                let mut gw = None;
                for attr in &nh.attributes {
                    match attr {
                        RouteAttribute::Gateway(a) => gw = route_ip(a),
                        RouteAttribute::Via(v) => gw = via_ip(v),
                        RouteAttribute::Encap(_) | RouteAttribute::EncapType(_) => {
                            unsupported = true
                        }
                        _ => {}
                    }
                }
                Hop {
                    ifindex: nh.interface_index,
                    gateway: gw,
                }
            }),
        None if h.flags.contains(RouteFlags::Dead) => None,
        None => oif.map(|ifindex| Hop { ifindex, gateway }),
    };
    let prefix = dst.map_or(0, |d| mask(ip_bits(d), h.destination_prefix_length, width));
    let entry = RouteEntry {
        kind,
        metric,
        tos: h.tos,
        src_len: h.source_prefix_length,
        hop,
        prefsrc,
        unsupported,
    };
    Some(ParsedRoute {
        family,
        table,
        prefix,
        len: h.destination_prefix_length,
        entry,
    })
}
