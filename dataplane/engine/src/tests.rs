//! Packet-level round trips through parse → conntrack → decide → rewrite, on a fake
//! clock: client → VIP and back, hairpin, NodePort with SNAT, ICMP errors about a
//! translated flow, REJECT answers, expiry and stale UDP flows.

use std::net::{IpAddr, SocketAddr};

use conntrack::{ConnTable, SnatPorts, Timeouts};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use nat::rewrite::tcp_flags::{ACK, RST, SYN};
use nat::rewrite::testutil::{build_tcp, build_tuple, icmp_error, verify_checksums};
use nat::rewrite::{Parsed, parse};
use nat::snapshot::Snapshot;
use nat::tuple::{Protocol, Tuple};
use translate::k8s::{ClusterState, NodeSettings};
use translate::tracker::build;

use super::*;

const NODE: &str = "198.18.0.254";
const VIP: &str = "198.19.0.10";

fn snapshot(endpoints: &[&str], extra_service: &str) -> Snapshot {
    snapshot_meta(endpoints, "", extra_service)
}

/// `web` with `extra_meta` in its metadata (e.g. annotations) and `extra_service` in its
/// spec.
fn snapshot_meta(endpoints: &[&str], extra_meta: &str, extra_service: &str) -> Snapshot {
    let eps: String = endpoints
        .iter()
        .map(|e| format!("- {{addresses: [{e}], nodeName: node-a}}\n"))
        .collect();
    let svc = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: demo{extra_meta}}}\nspec:\n  type: NodePort\n  clusterIP: {VIP}\n  ports: [{{port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP, name: http}}, {{port: 53, nodePort: 30053, protocol: UDP, name: dns}}]\n{extra_service}"
    );
    let slice = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-1, namespace: demo, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}, {{name: dns, port: 5353, protocol: UDP}}]\nendpoints:{}",
        if eps.is_empty() {
            " []\n".to_string()
        } else {
            format!("\n{eps}")
        }
    );
    let state = ClusterState {
        services: vec![serde_yaml::from_str::<Service>(&svc).unwrap()],
        endpoint_slices: vec![serde_yaml::from_str::<EndpointSlice>(&slice).unwrap()],
        ..Default::default()
    };
    let settings = NodeSettings {
        node_name: "node-a".into(),
        node_ips: vec![NODE.parse().unwrap()],
        cluster_cidrs: vec!["198.18.128.0/17".parse().unwrap()],
        ..Default::default()
    };
    build(&state, &settings, 1).unwrap().snapshot
}

fn engine() -> Engine {
    let table = ConnTable::new(
        1024,
        Timeouts::default(),
        SnatPorts::new(32768..=32768 + 1023).unwrap(),
    )
    .unwrap();
    Engine::new(table, 42)
}

const MASQ: FixedSource = FixedSource {
    v4: Some(IpAddr::V4(std::net::Ipv4Addr::new(198, 18, 0, 254))),
    v6: None,
};

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn tuple_of(pkt: &[u8]) -> Tuple {
    match parse(pkt).unwrap() {
        Parsed::Flow(f) => f.tuple(),
        other => panic!("{other:?}"),
    }
}

struct Run {
    e: Engine,
    snap: Snapshot,
    now: u64,
    /// The VLAN the next packets come in on (0: untagged).
    vlan: u16,
}

impl Run {
    fn new(snap: Snapshot) -> Run {
        Run {
            e: engine(),
            snap,
            now: 1_000 * SEC,
            vlan: 0,
        }
    }

    fn send(&mut self, pkt: &mut Vec<u8>) -> Verdict {
        let mut out = vec![0u8; 1500];
        let v = self.e.process(
            &self.snap,
            pkt,
            self.now,
            Ingress {
                interface: None,
                vlan: self.vlan,
            },
            &MASQ,
            &mut out,
        );
        if let Verdict::Respond { len, .. } = v {
            *pkt = out[..len].to_vec();
        }
        v
    }
}

#[test]
fn client_to_vip_and_back_without_snat() {
    let mut r = Run::new(snapshot(&["198.18.128.11"], ""));
    let client = sa("198.18.128.50:40000");
    let orig = Tuple::new(client, sa("198.19.0.10:80"), Protocol::Tcp);
    let mut syn = build_tcp(&orig, 1000, None, SYN, b"");
    assert!(matches!(
        r.send(&mut syn),
        Verdict::Forward { new_flow: true, .. }
    ));
    verify_checksums(&syn);
    // DNAT only: a pod inside the cluster CIDR keeps its address.
    assert_eq!(
        tuple_of(&syn),
        Tuple::new(client, sa("198.18.128.11:8080"), Protocol::Tcp)
    );
    assert_eq!(syn[8], 63, "TTL decremented");

    let back = Tuple::new(sa("198.18.128.11:8080"), client, Protocol::Tcp);
    let mut synack = build_tcp(&back, 5000, Some(1001), SYN | ACK, b"");
    assert!(matches!(
        r.send(&mut synack),
        Verdict::Forward {
            new_flow: false,
            ..
        }
    ));
    verify_checksums(&synack);
    assert_eq!(
        tuple_of(&synack),
        orig.reversed(),
        "the answer comes from the VIP"
    );

    let mut ack = build_tcp(&orig, 1001, Some(5001), ACK, b"GET / HTTP/1.0\r\n\r\n");
    assert!(matches!(
        r.send(&mut ack),
        Verdict::Forward {
            new_flow: false,
            ..
        }
    ));
    verify_checksums(&ack);
    assert_eq!(r.e.table.len(), 1);
    assert_eq!(r.e.counters.new_flows, 1);
    let (_, entry) = r.e.table.get(&orig, r.now).unwrap();
    assert_eq!(entry.state().to_string(), "TCP ESTABLISHED");
}

#[test]
fn outside_client_is_masqueraded_and_replies_find_their_way_back() {
    let mut r = Run::new(snapshot(&["198.18.128.11"], ""));
    let client = sa("198.18.1.1:40000");
    let orig = Tuple::new(client, sa("198.19.0.10:80"), Protocol::Tcp);
    let mut syn = build_tcp(&orig, 1000, None, SYN, b"");
    r.send(&mut syn);
    let fwd = tuple_of(&syn);
    assert_eq!(fwd.src, NODE.parse::<IpAddr>().unwrap(), "SNAT to the node");
    assert!(
        (32768..32768 + 1024).contains(&fwd.sport),
        "port from this worker's range"
    );
    assert_eq!(fwd.dst_addr(), sa("198.18.128.11:8080"));
    let mut synack = build_tcp(&fwd.reversed(), 7, Some(1001), SYN | ACK, b"");
    r.send(&mut synack);
    verify_checksums(&synack);
    assert_eq!(tuple_of(&synack), orig.reversed());
}

#[test]
fn hairpin_is_masqueraded() {
    let mut r = Run::new(snapshot(&["198.18.128.11"], ""));
    let me = sa("198.18.128.11:45000");
    let orig = Tuple::new(me, sa("198.19.0.10:80"), Protocol::Tcp);
    let mut syn = build_tcp(&orig, 1, None, SYN, b"");
    r.send(&mut syn);
    let fwd = tuple_of(&syn);
    assert_eq!(fwd.dst_addr(), sa("198.18.128.11:8080"));
    assert_eq!(
        fwd.src,
        NODE.parse::<IpAddr>().unwrap(),
        "the endpoint must not see itself"
    );
    let mut synack = build_tcp(&fwd.reversed(), 9, Some(2), SYN | ACK, b"");
    r.send(&mut synack);
    assert_eq!(tuple_of(&synack), orig.reversed());
    verify_checksums(&synack);
}

#[test]
fn node_port_with_snat_round_trip_udp() {
    let mut r = Run::new(snapshot(&["198.18.128.11", "198.18.128.12"], ""));
    let client = sa("198.18.1.1:5000");
    let orig = Tuple::new(client, sa("198.18.0.254:30053"), Protocol::Udp);
    let mut q = build_tuple(&orig, b"query");
    assert!(matches!(
        r.send(&mut q),
        Verdict::Forward { new_flow: true, .. }
    ));
    verify_checksums(&q);
    let fwd = tuple_of(&q);
    assert_eq!(fwd.src, NODE.parse::<IpAddr>().unwrap());
    assert_eq!(fwd.dport, 5353);
    let mut a = build_tuple(&fwd.reversed(), b"answer");
    r.send(&mut a);
    verify_checksums(&a);
    assert_eq!(
        tuple_of(&a),
        orig.reversed(),
        "the answer comes from the NodePort"
    );
    // The same client's next datagram uses the same flow.
    let mut q2 = build_tuple(&orig, b"again");
    assert!(matches!(
        r.send(&mut q2),
        Verdict::Forward {
            new_flow: false,
            ..
        }
    ));
    assert_eq!(tuple_of(&q2), fwd);
}

#[test]
fn icmp_error_from_the_endpoint_reaches_the_client_about_its_own_packet() {
    let mut r = Run::new(snapshot(&["198.18.128.11"], ""));
    let client = sa("198.18.1.1:5000");
    let orig = Tuple::new(client, sa("198.19.0.10:53"), Protocol::Udp);
    let mut q = build_tuple(&orig, b"query");
    r.send(&mut q);
    let fwd = tuple_of(&q);
    // The endpoint answers "port unreachable", quoting the packet it received.
    let ep_ip: IpAddr = "198.18.128.11".parse().unwrap();
    let mut err = icmp_error(ep_ip, fwd.src, &q);
    assert!(matches!(r.send(&mut err), Verdict::Forward { .. }));
    verify_checksums(&err);
    match parse(&err).unwrap() {
        Parsed::IcmpError(e) => {
            assert_eq!(e.inner(), orig, "the quote is the client's own packet");
            assert_eq!(e.dst(), client.ip());
            assert_eq!(e.src(), VIP.parse::<IpAddr>().unwrap(), "from the VIP");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(r.e.counters.icmp_errors_translated, 1);
    // A router's error keeps the router as its source.
    let router: IpAddr = "198.18.0.1".parse().unwrap();
    let mut q = build_tuple(&orig, b"query");
    r.send(&mut q);
    let mut err = icmp_error(router, fwd.src, &q);
    r.send(&mut err);
    match parse(&err).unwrap() {
        Parsed::IcmpError(e) => {
            assert_eq!(e.src(), router);
            assert_eq!(e.inner(), orig);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn no_endpoints_answers_rst_and_port_unreachable_at_once() {
    let mut r = Run::new(snapshot(&[], ""));
    let client = sa("198.18.128.50:40000");
    let orig = Tuple::new(client, sa("198.19.0.10:80"), Protocol::Tcp);
    let mut syn = build_tcp(&orig, 1000, None, SYN, b"");
    match r.send(&mut syn) {
        Verdict::Respond { dst, .. } => assert_eq!(dst, client.ip()),
        v => panic!("{v:?}"),
    }
    verify_checksums(&syn);
    match parse(&syn).unwrap() {
        Parsed::Flow(f) => {
            assert_eq!(f.tuple(), orig.reversed());
            assert_eq!(f.tcp_flags() & RST, RST);
        }
        other => panic!("{other:?}"),
    }
    let udp = Tuple::new(client, sa("198.19.0.10:53"), Protocol::Udp);
    let mut q = build_tuple(&udp, b"q");
    assert!(matches!(r.send(&mut q), Verdict::Respond { .. }));
    verify_checksums(&q);
    assert!(matches!(parse(&q).unwrap(), Parsed::IcmpError(e) if e.inner() == udp));
    assert_eq!(r.e.counters.rejected, 2);
    assert!(r.e.table.is_empty(), "a refused connection leaves no state");
}

#[test]
fn not_a_service_passes_and_garbage_is_counted() {
    let mut r = Run::new(snapshot(&["198.18.128.11"], ""));
    let t = Tuple::new(sa("198.18.1.1:1"), sa("198.18.0.254:22"), Protocol::Tcp);
    let mut p = build_tcp(&t, 1, None, SYN, b"");
    let before = p.clone();
    assert_eq!(r.send(&mut p), Verdict::Pass);
    assert_eq!(p, before, "passed packets are untouched");
    let mut junk = vec![0x45, 0, 0, 10, 1, 2];
    assert!(matches!(
        r.send(&mut junk),
        Verdict::Drop(DropCause::Malformed(_))
    ));
    assert_eq!(r.e.counters.dropped(), 1);
}

#[test]
fn udp_flow_expires_and_the_next_datagram_decides_again() {
    let mut r = Run::new(snapshot(&["198.18.128.11"], ""));
    let orig = Tuple::new(
        sa("198.18.128.50:5000"),
        sa("198.19.0.10:53"),
        Protocol::Udp,
    );
    let mut q = build_tuple(&orig, b"q");
    r.send(&mut q);
    assert_eq!(r.e.table.len(), 1);
    r.now += 31 * SEC; // past the unreplied UDP timeout (30s)
    r.e.table.expire(r.now, 1024);
    assert!(r.e.table.is_empty());
    let mut q = build_tuple(&orig, b"q");
    assert!(matches!(
        r.send(&mut q),
        Verdict::Forward { new_flow: true, .. }
    ));
}

#[test]
fn endpoint_removed_stale_udp_flows_cleared_and_new_flows_avoid_it() {
    let mut r = Run::new(snapshot(&["198.18.128.11"], ""));
    let orig = Tuple::new(
        sa("198.18.128.50:5000"),
        sa("198.19.0.10:53"),
        Protocol::Udp,
    );
    let mut q = build_tuple(&orig, b"q");
    r.send(&mut q);
    assert_eq!(tuple_of(&q).dst_addr(), sa("198.18.128.11:5353"));
    // The endpoint goes away: the control plane publishes a new snapshot and clears the
    // UDP flows to it (kube-proxy's conntrack cleanup).
    r.snap = snapshot(&["198.18.128.12"], "");
    assert_eq!(
        r.e.table
            .remove_udp_to_endpoint("198.18.128.11".parse().unwrap(), 5353),
        1
    );
    let mut q = build_tuple(&orig, b"q");
    r.send(&mut q);
    assert_eq!(tuple_of(&q).dst_addr(), sa("198.18.128.12:5353"));
}

#[test]
fn session_affinity_sticks_to_one_endpoint() {
    let affinity =
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n";
    let mut r = Run::new(snapshot(
        &["198.18.128.11", "198.18.128.12", "198.18.128.13"],
        affinity,
    ));
    let mut seen = std::collections::HashSet::new();
    for port in 0..30u16 {
        let orig = Tuple::new(
            SocketAddr::new("198.18.128.50".parse().unwrap(), 40000 + port),
            sa("198.19.0.10:80"),
            Protocol::Tcp,
        );
        let mut syn = build_tcp(&orig, 1, None, SYN, b"");
        r.send(&mut syn);
        seen.insert(tuple_of(&syn).dst_addr());
    }
    assert_eq!(seen.len(), 1, "one client, one endpoint: {seen:?}");
    // Without affinity, 30 connections spread.
    let mut r = Run::new(snapshot(
        &["198.18.128.11", "198.18.128.12", "198.18.128.13"],
        "",
    ));
    let mut seen = std::collections::HashSet::new();
    for port in 0..30u16 {
        let orig = Tuple::new(
            SocketAddr::new("198.18.128.50".parse().unwrap(), 40000 + port),
            sa("198.19.0.10:80"),
            Protocol::Tcp,
        );
        let mut syn = build_tcp(&orig, 1, None, SYN, b"");
        r.send(&mut syn);
        seen.insert(tuple_of(&syn).dst_addr());
    }
    assert_eq!(seen.len(), 3);
}

#[test]
fn random_choice_spreads_like_uniform() {
    let mut r = Run::new(snapshot(
        &["198.18.128.11", "198.18.128.12", "198.18.128.13"],
        "",
    ));
    let mut counts = std::collections::HashMap::<SocketAddr, u32>::new();
    for i in 0..900u32 {
        let orig = Tuple::new(
            SocketAddr::new("198.18.128.50".parse().unwrap(), 10_000 + i as u16),
            sa("198.19.0.10:80"),
            Protocol::Tcp,
        );
        let mut syn = build_tcp(&orig, 1, None, SYN, b"");
        r.send(&mut syn);
        *counts.entry(tuple_of(&syn).dst_addr()).or_default() += 1;
    }
    // 300 expected each; 5 sigma of a binomial(900, 1/3) is ~71.
    for (ep, c) in &counts {
        assert!((229..=371).contains(c), "{ep}: {c} of 900 ({counts:?})");
    }
}

/// Two workers of one node: each has its own table, SNAT share and random state, and the
/// node's state in common.
fn node_of_two(snat: std::ops::RangeInclusive<u16>) -> (Engine, Engine) {
    let node = NodeState::new(1024);
    let mut shares = SnatPorts::for_workers(snat, 2).unwrap().into_iter();
    let mut eng = |seed| {
        let t = ConnTable::new(1024, Timeouts::default(), shares.next().unwrap()).unwrap();
        Engine::on_node(t, seed, node.clone())
    };
    let a = eng(1);
    (a, eng(2))
}

fn syn_from(e: &mut Engine, snap: &Snapshot, client: &str, port: u16, now: u64) -> SocketAddr {
    let orig = Tuple::new(
        SocketAddr::new(client.parse().unwrap(), port),
        sa("198.19.0.10:80"),
        Protocol::Tcp,
    );
    let mut syn = build_tcp(&orig, 1, None, SYN, b"");
    let mut out = vec![0u8; 1500];
    let v = e.process(snap, &mut syn, now, Ingress::default(), &MASQ, &mut out);
    assert!(
        matches!(v, Verdict::Forward { new_flow: true, .. }),
        "{v:?}"
    );
    tuple_of(&syn).dst_addr()
}

#[test]
fn affinity_round_robin_and_least_connection_are_per_node_not_per_worker() {
    let eps = ["198.18.128.11", "198.18.128.12", "198.18.128.13"];
    // ClientIP affinity: connections alternate between the workers, one endpoint.
    let affinity =
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n";
    let snap = snapshot(&eps, affinity);
    let (mut a, mut b) = node_of_two(61000..=65535);
    let mut seen = std::collections::HashSet::new();
    for port in 0..30u16 {
        let e = if port % 2 == 0 { &mut a } else { &mut b };
        seen.insert(syn_from(e, &snap, "198.18.128.50", 40000 + port, SEC));
    }
    assert_eq!(seen.len(), 1, "{seen:?}");
    // ... until the timeout has passed since the last new connection.
    assert_eq!(a.node.affinity.stats().entries, 1);
    let later = SEC + 61 * SEC;
    assert_eq!(
        a.node.affinity.recall(
            snap_port_hash(&snap),
            "198.18.128.50".parse().unwrap(),
            later
        ),
        None
    );

    // rr: one cursor per node, so alternating workers still go round the endpoints.
    let snap = snapshot_with_annotation(&eps, "rr");
    let (mut a, mut b) = node_of_two(61000..=65535);
    let mut order = Vec::new();
    for port in 0..9u16 {
        let e = if port % 2 == 0 { &mut a } else { &mut b };
        order.push(syn_from(e, &snap, "198.18.128.50", 41000 + port, SEC));
    }
    for w in order.windows(3) {
        let distinct: std::collections::HashSet<_> = w.iter().collect();
        assert_eq!(distinct.len(), 3, "round robin across workers: {order:?}");
    }

    // lc: counts the node's flows. Worker a opens 4 flows; worker b's next 3 must go to
    // the endpoints a did not load (a per-worker count would see b's table empty).
    let snap = snapshot_with_annotation(&eps, "lc");
    let (mut a, mut b) = node_of_two(61000..=65535);
    let mut by_a = std::collections::HashMap::<SocketAddr, u32>::new();
    for port in 0..4u16 {
        *by_a
            .entry(syn_from(&mut a, &snap, "198.18.128.50", 42000 + port, SEC))
            .or_default() += 1;
    }
    let counts: Vec<u32> = by_a.values().copied().collect();
    assert_eq!(counts.iter().sum::<u32>(), 4);
    for port in 0..2u16 {
        let ep = syn_from(&mut b, &snap, "198.18.128.51", 43000 + port, SEC);
        let load = a.node.load.get(ep);
        assert!(
            load <= 2,
            "{ep} had {load} flows: lc picked a loaded endpoint"
        );
    }
    let loads: Vec<u32> = eps
        .iter()
        .map(|ip| a.node.load.get(SocketAddr::new(ip.parse().unwrap(), 8080)))
        .collect();
    assert_eq!(loads, vec![2, 2, 2], "balanced over the node's 6 flows");
}

/// The key affinity is remembered under for `web`'s `http` port.
fn snap_port_hash(snap: &Snapshot) -> u64 {
    let f = snap
        .lookup_addr("198.19.0.10".parse().unwrap(), Protocol::Tcp, 80)
        .unwrap();
    snap.port(f.port).name_hash
}

/// `web` with the `kxp.dev/scheduler` annotation.
fn snapshot_with_annotation(endpoints: &[&str], scheduler: &str) -> Snapshot {
    snapshot_meta(
        endpoints,
        &format!(", annotations: {{kxp.dev/scheduler: {scheduler}}}"),
        "",
    )
}

/// Masqueraded flows get SNAT ports that map back to the worker that opened them, and
/// un-masqueraded ones keep the client's port: either way the reply's destination names
/// the owner, for client ports inside the SNAT range too.
#[test]
fn every_reply_names_its_owner() {
    let snap = snapshot(&["198.18.128.11"], "");
    let (mut a, mut b) = node_of_two(61000..=65535);
    for (client, masq) in [("198.18.128.50", false), ("203.0.113.9", true)] {
        for port in 61000..61040u16 {
            let ip: IpAddr = client.parse().unwrap();
            let owner = conntrack::flow_owner(ip, port, 2);
            let e = if owner == 0 { &mut a } else { &mut b };
            let orig = Tuple::new(
                SocketAddr::new(ip, port),
                sa("198.19.0.10:80"),
                Protocol::Tcp,
            );
            let mut syn = build_tcp(&orig, 1, None, SYN, b"");
            let mut out = vec![0u8; 1500];
            e.process(&snap, &mut syn, SEC, Ingress::default(), &MASQ, &mut out);
            let fwd = tuple_of(&syn);
            assert_eq!(fwd.src != ip, masq);
            // The endpoint answers to the packet's source.
            let reply_dst = fwd.src_addr();
            assert_eq!(
                conntrack::flow_owner(reply_dst.ip(), reply_dst.port(), 2),
                owner,
                "{client}:{port} -> reply to {reply_dst}"
            );
        }
    }
}

/// A TCP connection from `client` to the `http` port of `web`'s ClusterIP.
fn to_web(client: &str) -> Tuple {
    Tuple::new(sa(client), sa("198.19.0.10:80"), Protocol::Tcp)
}

/// A packet handed over with its parse (as the worker's batch warming parsed it) is
/// translated exactly as one the engine parses itself: same verdict, same bytes, same
/// flow found by the next packet.
#[test]
fn a_pre_parsed_packet_is_translated_as_a_parsed_one() {
    let snap = snapshot(&["198.18.128.11"], "");
    let (mut a, mut b) = (engine(), engine());
    let mut out = vec![0u8; 1500];
    for (port, flags) in [(40000, SYN), (40000, ACK), (40001, SYN)] {
        let orig = to_web(&format!("198.18.128.50:{port}"));
        let mut p1 = build_tcp(&orig, 1000, None, flags, b"x");
        let mut p2 = p1.clone();
        let v1 = a.process(&snap, &mut p1, SEC, Ingress::default(), &MASQ, &mut out);
        let parsed = parse(&p2);
        let v2 = b.process_parsed(
            &snap,
            &mut p2,
            parsed,
            None,
            SEC,
            Ingress::default(),
            &MASQ,
            &mut out,
        );
        assert_eq!(format!("{v1:?}"), format!("{v2:?}"));
        assert_eq!(p1, p2);
    }
    assert_eq!(b.counters.new_flows, 2);
    assert_eq!(
        (a.counters.forwarded, a.counters.dropped()),
        (b.counters.forwarded, b.counters.dropped())
    );
}

/// `pkt` prepared as the worker's batch warming prepares a likely new connection
/// ([`Engine::prepare_new`]), then processed with the draw made: the verdict and the
/// predicted reply tuple.
fn prepared(
    e: &mut Engine,
    snap: &Snapshot,
    pkt: &mut [u8],
    out: &mut [u8],
) -> (Verdict, Option<Tuple>) {
    let Ok(Parsed::Flow(fl)) = parse(pkt) else {
        panic!("a TCP segment parses as a flow")
    };
    let (prep, reply) = e.prepare_new(snap, &fl, None).expect("random scheduler");
    (with_choice(e, snap, pkt, fl, prep, out), reply)
}

/// `pkt` (parsed as `fl`) processed on `snap` with the choice `prep` made ahead.
fn with_choice(
    e: &mut Engine,
    snap: &Snapshot,
    pkt: &mut [u8],
    fl: rewrite::FlowPacket,
    prep: Prepared,
    out: &mut [u8],
) -> Verdict {
    e.process_parsed(
        snap,
        pkt,
        Ok(Parsed::Flow(fl)),
        Some(prep),
        SEC,
        Ingress::default(),
        &MASQ,
        out,
    )
}

/// A likely new connection prepared ahead (its draw made and its reply tuple predicted,
/// as the worker's batch warming does) goes to the endpoint the prediction named, and
/// exactly where an engine drawing at connection time sends it: same bytes, same flows.
/// A prepared packet of a tracked flow follows its flow; what depends on more than the
/// draw (ClientIP affinity) is not prepared; a masqueraded flow has no predicted reply.
#[test]
fn a_prepared_connection_goes_where_the_preparation_said() {
    let snap = snapshot(&["198.18.128.11", "198.18.128.12", "198.18.128.13"], "");
    let (mut a, mut b) = (engine(), engine());
    let mut out = vec![0u8; 1500];
    let mut endpoints = std::collections::HashSet::new();
    let mut flows = Vec::new();
    for port in 40000..40064u16 {
        let orig = to_web(&format!("198.18.128.50:{port}"));
        let mut p1 = build_tcp(&orig, 1000, None, SYN, b"x");
        let mut p2 = p1.clone();
        let v1 = a.process(&snap, &mut p1, SEC, Ingress::default(), &MASQ, &mut out);
        let (v2, reply) = prepared(&mut b, &snap, &mut p2, &mut out);
        let reply = reply.expect("not masqueraded");
        assert_eq!(format!("{v1:?}"), format!("{v2:?}"));
        assert_eq!(p1, p2);
        assert_eq!(tuple_of(&p2).dst_addr(), reply.src_addr());
        let (dir, e) = b
            .table
            .get(&reply, SEC)
            .expect("the predicted reply is tracked");
        assert_eq!((dir, *e.orig()), (Direction::Reply, orig));
        endpoints.insert(reply.src);
        flows.push((orig, reply));
    }
    assert_eq!(endpoints.len(), 3, "the draws still spread the connections");
    assert_eq!(b.counters.new_flows, 64);
    for (orig, reply) in flows {
        // The SYN again (a retransmission), prepared as if new, follows the flow.
        let mut again = build_tcp(&orig, 1000, None, SYN, b"x");
        prepared(&mut b, &snap, &mut again, &mut out);
        assert_eq!(tuple_of(&again).dst_addr(), reply.src_addr());
    }
    assert_eq!(b.counters.new_flows, 64);

    // From outside the cluster CIDR: masqueraded, so no reply tuple before its SNAT port.
    let outside = to_web("198.18.0.50:40000");
    let Ok(Parsed::Flow(fl)) = parse(&build_tcp(&outside, 1, None, SYN, b"")) else {
        panic!()
    };
    assert!(matches!(b.prepare_new(&snap, &fl, None), Some((_, None))));

    // ClientIP affinity: the choice depends on the client's history, not prepared.
    let sticky = snapshot(
        &["198.18.128.11", "198.18.128.12"],
        "  sessionAffinity: ClientIP\n",
    );
    let client = to_web("198.18.128.50:40000");
    let Ok(Parsed::Flow(fl)) = parse(&build_tcp(&client, 1, None, SYN, b"")) else {
        panic!()
    };
    assert_eq!(b.prepare_new(&sticky, &fl, None), None);
}

/// A choice prepared on one snapshot is not used on another: the endpoints changed in
/// between (a new snapshot published between the warming and the packet) and the
/// connection goes where the snapshot it is handled on says.
#[test]
fn a_choice_prepared_on_another_snapshot_is_made_again() {
    let before = snapshot(&["198.18.128.11", "198.18.128.12", "198.18.128.13"], "");
    let after = snapshot(&["198.18.128.21"], "");
    let mut e = engine();
    let mut out = vec![0u8; 1500];
    for port in 40000..40032u16 {
        let orig = to_web(&format!("198.18.128.50:{port}"));
        let mut pkt = build_tcp(&orig, 1000, None, SYN, b"x");
        let Ok(Parsed::Flow(fl)) = parse(&pkt) else {
            panic!("a TCP segment parses as a flow")
        };
        let (prep, _) = e.prepare_new(&before, &fl, None).expect("random scheduler");
        let v = with_choice(&mut e, &after, &mut pkt, fl, prep, &mut out);
        assert!(
            matches!(v, Verdict::Forward { new_flow: true, .. }),
            "{v:?}"
        );
        assert_eq!(tuple_of(&pkt).dst_addr(), sa("198.18.128.21:8080"));
    }
    assert_eq!(e.counters.new_flows, 32);
}

/// A flow opened by a tagged packet keeps its VLAN id: what goes back to the client
/// (answers, ICMP errors about its packets) carries it, what goes to the endpoint does
/// not, and another client's untagged flow has none; the id survives in the flow's
/// journaled tag.
#[test]
fn a_tagged_clients_flow_sends_its_answers_back_on_its_vlan() {
    let mut r = Run::new(snapshot(&["198.18.128.11"], ""));
    let client = sa("198.18.1.1:5000");
    let orig = Tuple::new(client, sa("198.19.0.10:53"), Protocol::Udp);
    let vlan_of = |v: &Verdict| match v {
        Verdict::Forward { vlan, .. } => *vlan,
        other => panic!("{other:?}"),
    };
    r.vlan = 61;
    let mut q = build_tuple(&orig, b"query");
    assert_eq!(vlan_of(&r.send(&mut q)), 0, "to the endpoint: untagged");
    let fwd = tuple_of(&q);
    assert_eq!(
        fwd.src,
        "198.18.0.254".parse::<IpAddr>().unwrap(),
        "masqueraded"
    );
    let (_, entry) = r.e.table.get(&orig, r.now).unwrap();
    assert_eq!(tag_vlan(entry.tag()), 61);
    assert_eq!(
        conntrack::persist::FlowRecord::decode(&conntrack::persist::FlowRecord::of(entry).encode())
            .map(|f| tag_vlan(f.tag)),
        Ok(61),
        "journaled with the flow"
    );
    // The endpoint's answer arrives untagged, from a pod.
    r.vlan = 0;
    let mut a = build_tuple(&fwd.reversed(), b"answer");
    assert_eq!(vlan_of(&r.send(&mut a)), 61, "back to the client: its VLAN");
    assert_eq!(tuple_of(&a), orig.reversed());
    // An ICMP error from the endpoint about the forwarded query goes back tagged too.
    let mut err = icmp_error(fwd.dst, fwd.src, &q);
    assert_eq!(vlan_of(&r.send(&mut err)), 61);
    // The client's next datagram (tagged) goes to the endpoint untagged.
    r.vlan = 61;
    let mut q2 = build_tuple(&orig, b"again");
    assert_eq!(vlan_of(&r.send(&mut q2)), 0);
    // Another client, untagged: nothing tags its answers.
    r.vlan = 0;
    let other = Tuple::new(sa("198.18.1.2:5000"), sa("198.19.0.10:53"), Protocol::Udp);
    let mut q = build_tuple(&other, b"query");
    r.send(&mut q);
    let mut a = build_tuple(&tuple_of(&q).reversed(), b"answer");
    assert_eq!(vlan_of(&r.send(&mut a)), 0);
}

/// `kxp.networkPolicy: kernel`: a connection to a pod of this node is translated (DNAT
/// only) and handed over, with the masquerade left to the kernel when kube-proxy would
/// masquerade it; its answers (which the kernel un-masquerades) come back to the client's
/// own address; the node's own connections are not handed over.
#[test]
fn with_kernel_policy_connections_to_local_pods_are_handed_to_the_kernel() {
    let mut r = Run::new(snapshot(&["198.18.128.11"], ""));
    r.e.kernel_policy = true;
    let verdict = |v: &Verdict| match v {
        Verdict::Forward { handover, .. } => *handover,
        other => panic!("{other:?}"),
    };
    // From outside the cluster CIDR: kube-proxy masquerades; the kernel will.
    let client = sa("198.18.1.1:5000");
    let orig = Tuple::new(client, sa("198.19.0.10:53"), Protocol::Udp);
    let mut q = build_tuple(&orig, b"query");
    let ttl = q[8];
    assert_eq!(verdict(&r.send(&mut q)), Handover::Masquerade);
    assert_eq!(
        q[8], ttl,
        "handed over: the kernel's forwarding decrements the TTL"
    );
    let fwd = tuple_of(&q);
    assert_eq!(
        fwd,
        Tuple::new(client, sa("198.18.128.11:5353"), Protocol::Udp)
    );
    let mut q2 = build_tuple(&orig, b"again");
    assert_eq!(verdict(&r.send(&mut q2)), Handover::Masquerade);
    let mut a = build_tuple(&fwd.reversed(), b"answer");
    assert_eq!(verdict(&r.send(&mut a)), Handover::No);
    assert_eq!(tuple_of(&a), orig.reversed());
    assert_eq!(a[8], ttl - 1, "forwarded by kxp: one hop");
    // From a pod: DNAT only, handed over as it is.
    let pod = Tuple::new(
        sa("198.18.128.50:6000"),
        sa("198.19.0.10:53"),
        Protocol::Udp,
    );
    let mut q = build_tuple(&pod, b"query");
    assert_eq!(verdict(&r.send(&mut q)), Handover::Plain);
    assert_eq!(q[8], ttl);
    // The node's own connection (through the service device) keeps kxp's SNAT port.
    r.e.host_interface = Some("kxp0-dp".into());
    let own = Tuple::new(sa("198.18.0.254:7000"), sa("198.19.0.10:53"), Protocol::Udp);
    let mut q = build_tuple(&own, b"query");
    let mut out = vec![0u8; 1500];
    let v = r.e.process(
        &r.snap,
        &mut q,
        r.now,
        Ingress::on(Some("kxp0-dp")),
        &MASQ,
        &mut out,
    );
    assert_eq!(verdict(&v), Handover::No);
    // Without the mode, nothing is.
    r.e.kernel_policy = false;
    let other = Tuple::new(sa("198.18.1.9:5000"), sa("198.19.0.10:53"), Protocol::Udp);
    let mut q = build_tuple(&other, b"query");
    assert_eq!(verdict(&r.send(&mut q)), Handover::No);
    assert_eq!(tuple_of(&q).src, "198.18.0.254".parse::<IpAddr>().unwrap());
}

thread_local! {
    static PREFETCHED: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn record(p: *const u8) {
    PREFETCHED.with(|v| v.borrow_mut().push(p as usize));
}

/// A batch's likely new connections have their Service port (all of it) and its
/// endpoint lists prefetched; packets that found a flow, or are for no frontend, have nothing.
#[test]
fn warm_choices_asks_for_the_ports_and_lists_of_fresh_packets_to_frontends() {
    let snap = snapshot(&["198.18.128.11", "198.18.128.12"], "");
    let to_vip = Tuple::new(sa("198.18.1.1:5000"), sa("198.19.0.10:80"), Protocol::Tcp);
    let elsewhere = Tuple::new(sa("198.18.1.1:5001"), sa("192.0.2.1:80"), Protocol::Tcp);
    let index = snap
        .port_for(to_vip.dst, to_vip.proto, to_vip.dport)
        .unwrap();
    let sp = snap.port(index);
    let taken = || PREFETCHED.with(|v| std::mem::take(&mut *v.borrow_mut()));

    // Bit 0: the packet to the VIP is fresh; bit 1: the other one is too, for no frontend.
    warm_choices(&snap, &[to_vip, elsewhere], 0b11, record);
    let got = taken();
    let port = std::ptr::from_ref(sp) as usize;
    assert!(got.contains(&port), "the port's struct");
    assert!(
        got.contains(&(sp.endpoints.as_ptr() as usize)),
        "its endpoints"
    );
    assert!(
        got.contains(&(sp.cat.cluster.as_ptr() as usize)),
        "its cluster list"
    );
    // Every cache line of the port's struct (deciding reads fields all over it).
    let size = std::mem::size_of::<nat::model::ServicePort>();
    let lines = |ps: &[usize]| {
        ps.iter()
            .map(|p| p / 64)
            .collect::<std::collections::BTreeSet<_>>()
    };
    let asked = lines(&got);
    for line in (port / 64)..=((port + size - 1) / 64) {
        assert!(asked.contains(&line), "line {line} of the port: {got:?}");
    }
    let in_port = got
        .iter()
        .filter(|&&p| (port..port + size).contains(&p))
        .count();
    assert_eq!(
        got.len() - in_port,
        4,
        "the port's lists, nothing for the other packet: {got:?}"
    );

    // The packet to the VIP found its flow (bit 0 clear): nothing.
    warm_choices(&snap, &[to_vip, elsewhere], 0b10, record);
    assert!(taken().is_empty());
}

/// The batch warming's two halves: the choice made ahead names an endpoint, which
/// `warm_endpoint` asks for, and the reply tuple from it is the connection's; a choice
/// made on another snapshot warms nothing and predicts nothing.
#[test]
fn a_choice_ahead_warms_its_endpoint_then_gives_its_reply() {
    let snap = snapshot(&["198.18.128.11", "198.18.128.12"], "");
    let other = snapshot(&["198.18.128.11", "198.18.128.12"], "");
    let mut e = engine();
    let syn = to_web("198.18.128.50:40000");
    let mut pkt = build_tcp(&syn, 1000, None, SYN, b"");
    let Ok(Parsed::Flow(fl)) = parse(&pkt) else {
        panic!("a TCP segment parses as a flow")
    };
    let prep = e.choose_ahead(&snap, &fl, None).expect("random scheduler");
    let taken = || PREFETCHED.with(|v| std::mem::take(&mut *v.borrow_mut()));
    taken();
    warm_endpoint(&snap, &prep, record);
    let got = taken();
    let sp = snap.port(snap.port_for(syn.dst, syn.proto, syn.dport).unwrap());
    let size = std::mem::size_of::<nat::model::Endpoint>();
    let chosen = sp
        .endpoints
        .iter()
        .find(|ep| {
            let at = std::ptr::from_ref(*ep) as usize;
            got == [at, at + size - 1]
        })
        .expect("the chosen endpoint's first and last bytes, alone");
    assert_eq!(
        e.reply_ahead(&snap, &fl, &prep, None),
        Some(Tuple::new(chosen.addr, syn.src_addr(), Protocol::Tcp))
    );
    // The packet, handled with that choice, goes to that endpoint.
    let mut out = [0u8; 256];
    let v = with_choice(&mut e, &snap, &mut pkt, fl, prep, &mut out);
    assert!(matches!(v, Verdict::Forward { .. }), "{v:?}");
    assert_eq!(tuple_of(&pkt).dst_addr(), chosen.addr);

    warm_endpoint(&other, &prep, record);
    assert!(taken().is_empty());
    assert_eq!(e.reply_ahead(&other, &fl, &prep, None), None);
}
