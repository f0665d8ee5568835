//! The tables and the message application, on hand-built netlink messages (no kernel).

use std::net::IpAddr;

use rtnetlink::packet_core::NLM_F_REPLACE;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressMessage};
use rtnetlink::packet_route::link::{LinkAttribute, LinkFlags, LinkMessage};
use rtnetlink::packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteNextHop, RouteNextHopFlags, RouteType,
};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage as M};

use super::table::{FibTable, Resolved, mask};
use super::{NextHop, Route, Throttle};

const ETH0: u32 = 2;
const ETH1: u32 = 3;
const MAC0: [u8; 6] = [2, 0, 0, 0, 0, 0xa0];
const GW_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn family(a: IpAddr) -> AddressFamily {
    if a.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}

fn link(ifindex: u32, mac: Option<[u8; 6]>, up: bool) -> M {
    let mut m = LinkMessage::default();
    m.header.index = ifindex;
    if up {
        m.header.flags = LinkFlags::Up;
    }
    m.attributes
        .push(LinkAttribute::IfName(format!("eth{ifindex}")));
    if let Some(mac) = mac {
        m.attributes.push(LinkAttribute::Address(mac.to_vec()));
    }
    M::NewLink(m)
}

fn addr(ifindex: u32, cidr: &str, flags: AddressFlags) -> AddressMessage {
    let (a, len) = cidr.split_once('/').unwrap();
    let a = ip(a);
    let mut m = AddressMessage::default();
    m.header.family = family(a);
    m.header.index = ifindex;
    m.header.prefix_len = len.parse().unwrap();
    m.attributes.push(AddressAttribute::Address(a));
    if a.is_ipv4() {
        m.attributes.push(AddressAttribute::Local(a));
    }
    m.attributes.push(AddressAttribute::Flags(flags));
    m
}

fn neigh(ifindex: u32, a: &str, state: NeighbourState, mac: Option<[u8; 6]>) -> NeighbourMessage {
    let a = ip(a);
    let mut m = NeighbourMessage::default();
    m.header.family = family(a);
    m.header.ifindex = ifindex;
    m.header.state = state;
    m.attributes.push(NeighbourAttribute::Destination(match a {
        IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
        IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
    }));
    if let Some(mac) = mac {
        m.attributes
            .push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
    }
    m
}

/// `dst` as "a.b.c.d/len"; table 254 unless changed.
fn route(
    dst: &str,
    kind: RouteType,
    gw: Option<&str>,
    oif: Option<u32>,
    metric: u32,
) -> RouteMessage {
    let (a, len) = dst.split_once('/').unwrap();
    let a = ip(a);
    let mut m = RouteMessage::default();
    m.header.address_family = family(a);
    m.header.destination_prefix_length = len.parse().unwrap();
    m.header.table = 254;
    m.header.kind = kind;
    if len != "0" {
        m.attributes.push(RouteAttribute::Destination(a.into()));
    }
    if let Some(gw) = gw {
        m.attributes
            .push(RouteAttribute::Gateway(RouteAddress::from(ip(gw))));
    }
    if let Some(oif) = oif {
        m.attributes.push(RouteAttribute::Oif(oif));
    }
    m.attributes.push(RouteAttribute::Priority(metric));
    m
}

fn unicast(dst: &str, gw: Option<&str>, oif: u32, metric: u32) -> M {
    M::NewRoute(route(dst, RouteType::Unicast, gw, Some(oif), metric))
}

/// eth0 (attached, up, MAC0, 198.18.0.1/24), eth1 (not attached), a gateway
/// 198.18.0.254 with a usable MAC, default route via it.
fn base() -> FibTable {
    let mut t = FibTable::new_with_attached(&[ETH0]);
    t.apply(&link(ETH0, Some(MAC0), true), 0);
    t.apply(&link(ETH1, Some([2, 0, 0, 0, 0, 0xa1]), true), 0);
    t.apply(
        &M::NewAddress(addr(ETH0, "198.18.0.1/24", AddressFlags::Permanent)),
        0,
    );
    t.apply(
        &M::NewNeighbour(neigh(
            ETH0,
            "198.18.0.254",
            NeighbourState::Reachable,
            Some(GW_MAC),
        )),
        0,
    );
    t.apply(&unicast("198.18.0.0/24", None, ETH0, 0), 0);
    t.apply(&unicast("0.0.0.0/0", Some("198.18.0.254"), ETH0, 100), 0);
    t
}

/// `dst`'s answer in `t`, checked to be the same with its IPv4 routes indexed into the
/// trie the mirror publishes.
fn resolve(t: &FibTable, dst: IpAddr) -> Resolved {
    let plain = t.resolve(dst);
    let mut indexed = t.clone();
    indexed.v4 = None;
    indexed.index_routes();
    assert!(dst.is_ipv6() || indexed.v4.is_some(), "the trie is built");
    assert_eq!(indexed.resolve(dst), plain, "{dst} through the trie");
    plain
}

fn fwd(dst_mac: [u8; 6]) -> Resolved {
    Resolved::Route(Route::Forward(NextHop {
        ifindex: ETH0,
        src_mac: MAC0,
        dst_mac,
    }))
}

#[test]
fn mask_edges() {
    assert_eq!(mask(0xc612_0001, 0, 32), 0);
    assert_eq!(mask(0xc612_00ff, 24, 32), 0xc612_0000);
    assert_eq!(mask(0xc612_00ff, 32, 32), 0xc612_00ff);
    assert_eq!(mask(u128::MAX, 128, 128), u128::MAX);
    assert_eq!(mask(u128::MAX, 1, 128), 1 << 127);
}

#[test]
fn longest_prefix_then_lowest_metric() {
    let mut t = base();
    assert_eq!(resolve(&t, ip("198.19.1.1")), fwd(GW_MAC));
    t.apply(
        &M::NewNeighbour(neigh(
            ETH0,
            "198.18.0.7",
            NeighbourState::Permanent,
            Some([7; 6]),
        )),
        0,
    );
    t.apply(&unicast("198.19.1.0/24", Some("198.18.0.7"), ETH0, 0), 0);
    assert_eq!(resolve(&t, ip("198.19.1.1")), fwd([7; 6]));
    assert_eq!(resolve(&t, ip("198.19.2.1")), fwd(GW_MAC));
    // A second default with a lower metric wins; deleting it restores the first.
    t.apply(&unicast("0.0.0.0/0", Some("198.18.0.7"), ETH0, 50), 0);
    assert_eq!(resolve(&t, ip("198.19.2.1")), fwd([7; 6]));
    t.apply(
        &M::DelRoute(route(
            "0.0.0.0/0",
            RouteType::Unicast,
            Some("198.18.0.7"),
            Some(ETH0),
            50,
        )),
        0,
    );
    assert_eq!(resolve(&t, ip("198.19.2.1")), fwd(GW_MAC));
}

#[test]
fn replace_flag_replaces_and_plain_add_keeps_the_first() {
    let mut t = base();
    t.apply(
        &M::NewNeighbour(neigh(
            ETH0,
            "198.18.0.7",
            NeighbourState::Stale,
            Some([7; 6]),
        )),
        0,
    );
    t.apply(&unicast("198.19.0.0/16", Some("198.18.0.254"), ETH0, 0), 0);
    // Same key from a dump and an event: idempotent.
    t.apply(&unicast("198.19.0.0/16", Some("198.18.0.254"), ETH0, 0), 0);
    assert_eq!(t.route_count(), 3);
    t.apply(&unicast("198.19.0.0/16", Some("198.18.0.7"), ETH0, 0), 0); // append
    assert_eq!(resolve(&t, ip("198.19.0.1")), fwd(GW_MAC));
    t.apply(
        &unicast("198.19.0.0/16", Some("198.18.0.7"), ETH0, 0),
        NLM_F_REPLACE,
    );
    assert_eq!(resolve(&t, ip("198.19.0.1")), fwd([7; 6]));
    assert_eq!(t.route_count(), 3);
}

#[test]
fn tables_in_rule_order_and_route_kinds() {
    let mut t = base();
    let mut local = route("198.18.0.1/32", RouteType::Local, None, Some(ETH0), 0);
    local.header.table = 255;
    t.apply(&M::NewRoute(local), 0);
    assert_eq!(resolve(&t, ip("198.18.0.1")), Resolved::Route(Route::Local));
    t.apply(
        &M::NewRoute(route("198.20.0.0/16", RouteType::BlackHole, None, None, 0)),
        0,
    );
    assert_eq!(
        resolve(&t, ip("198.20.0.1")),
        Resolved::Route(Route::Unreachable)
    );
    // throw in main: go on to table default (253).
    t.apply(
        &M::NewRoute(route("198.21.0.0/16", RouteType::Throw, None, None, 0)),
        0,
    );
    assert_eq!(
        resolve(&t, ip("198.21.0.1")),
        Resolved::Route(Route::Unreachable)
    );
    let mut dflt = route(
        "198.21.0.0/16",
        RouteType::Unicast,
        Some("198.18.0.254"),
        Some(ETH0),
        0,
    );
    dflt.header.table = 253;
    t.apply(&M::NewRoute(dflt), 0);
    assert_eq!(resolve(&t, ip("198.21.0.1")), fwd(GW_MAC));
    // Other tables are not mirrored.
    let mut other = route("198.22.0.0/16", RouteType::Unspec, None, Some(ETH0), 0);
    other.attributes.push(RouteAttribute::Table(1000));
    t.apply(&M::NewRoute(other), 0);
    assert_eq!(t.route_count(), 6);
    assert_eq!(resolve(&t, ip("198.22.0.1")), fwd(GW_MAC), "default route");
    assert_eq!(
        resolve(&t, ip("224.0.0.5")),
        Resolved::Route(Route::Unreachable)
    );
}

#[test]
fn unmodelled_routes_are_unreachable_or_ignored() {
    let mut t = base();
    let mut nhid = route("198.23.0.0/16", RouteType::Unicast, None, None, 0);
    nhid.attributes.push(RouteAttribute::NhId(7));
    t.apply(&M::NewRoute(nhid), 0);
    assert_eq!(
        resolve(&t, ip("198.23.0.1")),
        Resolved::Route(Route::Unreachable)
    );
    // A TOS-specific route never matches: the default route does.
    let mut tos = route("198.24.0.0/16", RouteType::Unicast, None, Some(ETH1), 0);
    tos.header.tos = 0x10;
    t.apply(&M::NewRoute(tos), 0);
    assert_eq!(resolve(&t, ip("198.24.0.1")), fwd(GW_MAC));
}

#[test]
fn ecmp_uses_the_first_live_nexthop() {
    let mut t = base();
    t.apply(
        &M::NewNeighbour(neigh(
            ETH0,
            "198.18.0.7",
            NeighbourState::Delay,
            Some([7; 6]),
        )),
        0,
    );
    let mut m = route("198.19.0.0/16", RouteType::Unicast, None, None, 0);
    let hop = |gw: &str, dead: bool| {
        let mut nh = RouteNextHop::default();
        nh.interface_index = ETH0;
        if dead {
            nh.flags = RouteNextHopFlags::Dead;
        }
        nh.attributes
            .push(RouteAttribute::Gateway(RouteAddress::from(ip(gw))));
        nh
    };
    m.attributes.push(RouteAttribute::MultiPath(vec![
        hop("198.18.0.9", true),
        hop("198.18.0.7", false),
        hop("198.18.0.254", false),
    ]));
    t.apply(&M::NewRoute(m), 0);
    assert_eq!(resolve(&t, ip("198.19.0.1")), fwd([7; 6]));
}

#[test]
fn only_usable_neighbour_states_give_a_mac() {
    let mut t = base();
    t.apply(&unicast("198.19.0.0/16", Some("198.18.0.7"), ETH0, 0), 0);
    let want_pending = Resolved::Unresolved {
        ifindex: ETH0,
        next_hop: ip("198.18.0.7"),
    };
    assert_eq!(resolve(&t, ip("198.19.0.1")), want_pending, "no entry");
    use NeighbourState as S;
    for (state, usable) in [
        (S::Incomplete, false),
        (S::Reachable, true),
        (S::Failed, false),
        (S::Stale, true),
        (S::None, false),
        (S::Delay, true),
        (S::Probe, true),
        (S::Noarp, true),
        (S::Permanent, true),
    ] {
        t.apply(
            &M::NewNeighbour(neigh(ETH0, "198.18.0.7", state, Some([7; 6]))),
            0,
        );
        let want = if usable { fwd([7; 6]) } else { want_pending };
        assert_eq!(resolve(&t, ip("198.19.0.1")), want, "{state:?}");
    }
    // A usable state without a 6-byte address is not usable.
    t.apply(
        &M::NewNeighbour(neigh(ETH0, "198.18.0.7", S::Reachable, None)),
        0,
    );
    assert_eq!(resolve(&t, ip("198.19.0.1")), want_pending);
    t.apply(
        &M::NewNeighbour(neigh(ETH0, "198.18.0.7", S::Reachable, Some([7; 6]))),
        0,
    );
    t.apply(
        &M::DelNeighbour(neigh(ETH0, "198.18.0.7", S::Reachable, Some([7; 6]))),
        0,
    );
    assert_eq!(resolve(&t, ip("198.19.0.1")), want_pending, "deleted");
    // Same neighbour on another interface does not count.
    t.apply(
        &M::NewNeighbour(neigh(ETH1, "198.18.0.7", S::Reachable, Some([7; 6]))),
        0,
    );
    assert_eq!(resolve(&t, ip("198.19.0.1")), want_pending, "other ifindex");
}

#[test]
fn unchanged_announcements_do_not_change_the_tables() {
    let mut t = base();
    let again = M::NewNeighbour(neigh(
        ETH0,
        "198.18.0.254",
        NeighbourState::Stale,
        Some(GW_MAC),
    ));
    assert!(!t.apply(&again, 0).changed, "REACHABLE -> STALE, same MAC");
    assert!(!t.apply(&link(ETH0, Some(MAC0), true), 0).changed);
    assert!(
        !t.apply(
            &M::NewAddress(addr(ETH0, "198.18.0.1/24", AddressFlags::Permanent)),
            0
        )
        .changed
    );
}

#[test]
fn links_gate_forwarding_and_trigger_route_resyncs() {
    let mut t = base();
    let dst = ip("198.19.0.1");
    let e = t.apply(&link(ETH0, Some(MAC0), false), 0);
    assert!(
        e.changed && e.resync_routes,
        "down: the kernel flushes IPv4 routes silently"
    );
    assert_eq!(resolve(&t, dst), Resolved::Route(Route::Unreachable));
    t.apply(&link(ETH0, None, true), 0);
    assert_eq!(
        resolve(&t, dst),
        Resolved::Route(Route::Unreachable),
        "no MAC"
    );
    t.apply(&link(ETH0, Some(MAC0), true), 0);
    assert_eq!(resolve(&t, dst), fwd(GW_MAC));
    // AF_BRIDGE port messages on the link group are not links.
    let M::NewLink(mut bridge) = link(ETH0, None, false) else {
        unreachable!()
    };
    bridge.header.interface_family = AddressFamily::Bridge;
    assert!(!t.apply(&M::DelLink(bridge), 0).changed);
    // Not attached.
    t.apply(&unicast("198.25.0.0/16", None, ETH1, 0), 0);
    assert_eq!(
        resolve(&t, ip("198.25.0.1")),
        Resolved::Route(Route::NotAttached { ifindex: ETH1 })
    );
    // Deleting a link drops its addresses and neighbours.
    let M::NewLink(gone) = link(ETH0, None, false) else {
        unreachable!()
    };
    let e = t.apply(&M::DelLink(gone), 0);
    assert!(e.changed && e.resync_routes);
    assert!(t.local_addrs().is_empty());
    assert_eq!(t.neighbour_count(), 0);
    // Removing an IPv4 address also asks for a route re-dump.
    let mut t = base();
    let e = t.apply(
        &M::DelAddress(addr(ETH0, "198.18.0.1/24", AddressFlags::Permanent)),
        0,
    );
    assert!(e.changed && e.resync_routes);
}

#[test]
fn source_selection() {
    let mut t = base();
    t.apply(
        &M::NewAddress(addr(ETH0, "198.18.0.9/24", AddressFlags::Secondary)),
        0,
    );
    t.apply(
        &M::NewAddress(addr(ETH0, "198.18.7.1/24", AddressFlags::Permanent)),
        0,
    );
    t.apply(
        &M::NewAddress(addr(ETH0, "fe80::1/64", AddressFlags::Permanent)),
        0,
    );
    t.apply(
        &M::NewAddress(addr(ETH0, "2001:db8::5/64", AddressFlags::Tentative)),
        0,
    );
    t.apply(
        &M::NewAddress(addr(ETH0, "2001:db8::1/64", AddressFlags::Permanent)),
        0,
    );
    t.apply(&unicast("::/0", Some("fe80::fe"), ETH0, 1024), 0);
    t.apply(&unicast("fe80::/64", None, ETH0, 256), 0);
    assert_eq!(
        t.source_for(ip("198.19.0.1")),
        Some(ip("198.18.0.1")),
        "gateway subnet, primary"
    );
    assert_eq!(
        t.source_for(ip("2001:db8:9::1")),
        Some(ip("2001:db8::1")),
        "global, not tentative"
    );
    assert_eq!(
        t.source_for(ip("fe80::2")),
        Some(ip("fe80::1")),
        "link-local to link-local"
    );
    let mut pref = route(
        "198.26.0.0/16",
        RouteType::Unicast,
        Some("198.18.0.254"),
        Some(ETH0),
        0,
    );
    pref.attributes
        .push(RouteAttribute::PrefSource(RouteAddress::from(ip(
            "198.18.0.9",
        ))));
    t.apply(&M::NewRoute(pref), 0);
    assert_eq!(
        t.source_for(ip("198.26.0.1")),
        Some(ip("198.18.0.9")),
        "prefsrc"
    );
    let mut local = t.local_addrs();
    local.sort();
    assert_eq!(local.len(), 6);
}

#[test]
fn throttle_allows_one_request_per_interval() {
    let th = Throttle::new();
    assert!(th.allow(ETH0, ip("198.18.0.7")));
    assert!(!th.allow(ETH0, ip("198.18.0.7")));
    assert!(th.allow(ETH0, ip("198.18.0.8")));
    assert!(
        th.allow(ETH1, ip("198.18.0.7")),
        "another interface is another next hop"
    );
    std::thread::sleep(super::RESOLVE_INTERVAL);
    assert!(th.allow(ETH0, ip("198.18.0.7")));
}

/// A view remembers its answers for the tables it looked them up in, and answers anew
/// once other tables are published, also when their generation did not move (the
/// attached interfaces are swapped in without one); it never remembers a pending
/// next hop, which asks for a resolution each time (rate-limited).
#[test]
fn a_view_remembers_routes_until_other_tables_are_published() {
    use std::sync::Arc;

    use super::{FibView, Published};

    let mut t = base();
    t.apply(&unicast("198.19.0.0/16", Some("198.18.0.7"), ETH0, 0), 0);
    let tables = Arc::new(Published::new(t.clone()));
    let (tx, rx) = crossbeam::channel::unbounded();
    let view = FibView::new(tables.clone(), tx, Arc::new(tokio::sync::Notify::new()));
    let vip = ip("198.19.0.1");
    assert_eq!(view.route(vip), Route::Pending);
    assert_eq!(rx.try_iter().count(), 1, "a resolution was asked for");
    assert_eq!(
        view.route(vip),
        Route::Pending,
        "pending is looked up again"
    );

    // Many destinations, more than the cache holds, twice: the same answers as the table.
    let dsts: Vec<IpAddr> = (0..1_000u32)
        .map(|i| IpAddr::V4(std::net::Ipv4Addr::from(0xC614_0000 + i * 7)))
        .collect();
    for _ in 0..2 {
        for &d in &dsts {
            let Resolved::Route(want) = resolve(&t, d) else {
                panic!("{d} is routed via the gateway")
            };
            assert_eq!(view.route(d), want, "{d}");
        }
    }

    // An IPv4 destination and its IPv4-mapped IPv6 address are two destinations: each
    // gets its own family's answer (the IPv6 one has no route here).
    let v4 = ip("198.20.0.1");
    let mapped = IpAddr::V6(std::net::Ipv4Addr::new(198, 20, 0, 1).to_ipv6_mapped());
    let Resolved::Route(want) = resolve(&t, v4) else {
        panic!("{v4} is routed via the gateway")
    };
    let Resolved::Route(want_mapped) = resolve(&t, mapped) else {
        panic!("{mapped} has an answer")
    };
    assert_ne!(want, want_mapped);
    for _ in 0..2 {
        assert_eq!(view.route(v4), want);
        assert_eq!(view.route(mapped), want_mapped);
    }

    // The gateway's MAC as the kernel announces it, published.
    let learn = |t: &mut FibTable, mac: [u8; 6]| {
        let m = neigh(ETH0, "198.18.0.7", NeighbourState::Reachable, Some(mac));
        t.apply(&M::NewNeighbour(m), 0);
        tables.store(Arc::new(t.clone()));
    };
    // The neighbour is learnt: new tables, a new answer.
    learn(&mut t, [7; 6]);
    let Resolved::Route(learnt) = fwd([7; 6]) else {
        unreachable!()
    };
    assert_eq!(view.route(vip), learnt);
    assert_eq!(view.route(vip), learnt);
    // Its MAC changes.
    learn(&mut t, [8; 6]);
    let Resolved::Route(moved) = fwd([8; 6]) else {
        unreachable!()
    };
    assert_eq!(view.route(vip), moved);
    // The interface is no longer attached: same generation, other tables.
    let generation = t.generation();
    let mut detached = t.clone();
    detached.attached = Arc::from(Vec::<u32>::new());
    assert_eq!(detached.generation(), generation);
    tables.store(Arc::new(detached));
    assert_eq!(view.route(vip), Route::NotAttached { ifindex: ETH0 });
}

#[test]
fn vlan_devices_are_known_by_their_kind() {
    use rtnetlink::packet_route::link::{InfoData, InfoKind, InfoVlan, LinkInfo};
    let mut t = base();
    let mut m = LinkMessage::default();
    m.header.index = 7;
    m.header.flags = LinkFlags::Up;
    m.attributes.push(LinkAttribute::IfName("eth2.100".into()));
    m.attributes.push(LinkAttribute::Link(ETH0));
    m.attributes.push(LinkAttribute::LinkInfo(vec![
        LinkInfo::Kind(InfoKind::Vlan),
        LinkInfo::Data(InfoData::Vlan(vec![InfoVlan::Id(100)])),
    ]));
    t.apply(&M::NewLink(m), 0);
    assert!(t.links.get(&7).is_some_and(|l| l.vlan), "eth2.100");
    assert!(
        t.links.get(&ETH0).is_some_and(|l| !l.vlan),
        "its lower link"
    );
    // Its kind changing (the index reused by another device) is followed.
    t.apply(&link(7, Some(MAC0), true), 0);
    assert!(t.links.get(&7).is_some_and(|l| !l.vlan));
}
