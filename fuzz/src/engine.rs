//! A worker's whole pipeline over a sequence of packets on a fake clock: the fuzzer's
//! bytes are operations (a raw packet, a client's packet to a Service, an endpoint's
//! answer or ICMP error about a flow the engine forwarded, time passing), run through one
//! [`Engine`] with a small connection table and SNAT range, so that a short input fills
//! them.
//!
//! Invariants, against a model of the flows the engine forwarded (each client tuple and
//! the tuple it was translated to):
//! - no panic, whatever the packet;
//! - what is forwarded or answered has valid checksums;
//! - an answer on a tracked flow is un-NATed to exactly the tuple the client sent, and an
//!   ICMP error about it quotes exactly that tuple and goes to the client;
//! - no two live flows share a translated tuple;
//! - the table never holds more than its capacity.

use std::net::IpAddr;
use std::sync::OnceLock;

use conntrack::{ConnTable, SnatPorts, Timeouts};
use engine::{Engine, FixedSource, Ingress, NodeState, Verdict};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use nat::rewrite::testutil::{build_tcp, build_tuple, icmp_echo, icmp_error, verify_checksums};
use nat::rewrite::{Parsed, parse};
use nat::snapshot::Snapshot;
use nat::tuple::{Protocol, Tuple};
use translate::k8s::{ClusterState, NodeSettings};
use translate::tracker::build;

use crate::Input;

const NODE_V4: &str = "198.18.0.254";
const NODE_V6: &str = "fd00:18::fe";
const MS: u64 = 1_000_000;

const SERVICES: &str = r#"
- {apiVersion: v1, kind: Service, metadata: {name: web, namespace: demo},
   spec: {type: NodePort, clusterIP: 198.19.0.10, ports: [
     {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP},
     {name: dns, port: 53, targetPort: 5353, nodePort: 30053, protocol: UDP},
     {name: sctp, port: 9, targetPort: 9999, nodePort: 30009, protocol: SCTP}]}}
- {apiVersion: v1, kind: Service, metadata: {name: sticky, namespace: demo},
   spec: {clusterIP: 198.19.0.11, sessionAffinity: ClientIP,
          ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]}}
- {apiVersion: v1, kind: Service, metadata: {name: empty, namespace: demo},
   spec: {clusterIP: 198.19.0.12, ports: [{name: http, port: 80, protocol: TCP}]}}
- {apiVersion: v1, kind: Service, metadata: {name: local, namespace: demo},
   spec: {type: LoadBalancer, clusterIP: 198.19.0.13, externalIPs: [203.0.113.100],
          externalTrafficPolicy: Local, ports: [{name: https, port: 443, nodePort: 30443, protocol: TCP}]}}
- {apiVersion: v1, kind: Service, metadata: {name: six, namespace: demo},
   spec: {clusterIP: "fd00:96::10", ipFamilies: [IPv6], ports: [
     {name: http, port: 80, targetPort: 8080, protocol: TCP},
     {name: dns, port: 53, targetPort: 5353, protocol: UDP}]}}
"#;

const SLICES: &str = r#"
- {apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, addressType: IPv4,
   metadata: {name: web-1, namespace: demo, labels: {kubernetes.io/service-name: web}},
   ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP},
           {name: sctp, port: 9999, protocol: SCTP}],
   endpoints: [{addresses: [198.18.128.1], nodeName: node-a}, {addresses: [198.18.128.2], nodeName: node-a},
               {addresses: [198.18.128.3], nodeName: node-b}]}
- {apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, addressType: IPv4,
   metadata: {name: sticky-1, namespace: demo, labels: {kubernetes.io/service-name: sticky}},
   ports: [{name: http, port: 8080, protocol: TCP}],
   endpoints: [{addresses: [198.18.128.4], nodeName: node-a}, {addresses: [198.18.128.5], nodeName: node-b}]}
- {apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, addressType: IPv4,
   metadata: {name: empty-1, namespace: demo, labels: {kubernetes.io/service-name: empty}},
   ports: [{name: http, port: 80, protocol: TCP}], endpoints: []}
- {apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, addressType: IPv4,
   metadata: {name: local-1, namespace: demo, labels: {kubernetes.io/service-name: local}},
   ports: [{name: https, port: 443, protocol: TCP}],
   endpoints: [{addresses: [198.18.128.6], nodeName: node-a}, {addresses: [198.18.128.7], nodeName: node-b}]}
- {apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, addressType: IPv6,
   metadata: {name: six-1, namespace: demo, labels: {kubernetes.io/service-name: six}},
   ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}],
   endpoints: [{addresses: ["fd01::1"], nodeName: node-a}, {addresses: ["fd01::2"], nodeName: node-b}]}
"#;

fn snapshot() -> &'static Snapshot {
    static SNAP: OnceLock<Snapshot> = OnceLock::new();
    SNAP.get_or_init(|| {
        let state = ClusterState {
            services: serde_yaml::from_str::<Vec<Service>>(SERVICES).unwrap(),
            endpoint_slices: serde_yaml::from_str::<Vec<EndpointSlice>>(SLICES).unwrap(),
            ..Default::default()
        };
        let settings = NodeSettings {
            node_name: "node-a".into(),
            node_ips: vec![NODE_V4.parse().unwrap(), NODE_V6.parse().unwrap()],
            cluster_cidrs: vec![
                "198.18.128.0/17".parse().unwrap(),
                "fd01::/64".parse().unwrap(),
            ],
            ..Default::default()
        };
        build(&state, &settings, 1).unwrap().snapshot
    })
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A client: a pod (sometimes an endpoint itself: hairpin), a host outside, the node.
fn client(inp: &mut Input, v6: bool) -> IpAddr {
    let n = inp.byte();
    if v6 {
        return match n % 3 {
            0 => ip(&format!("fd01::{}", 1 + n % 4)),
            1 => ip(&format!("2001:db8::{}", n % 8)),
            _ => ip(NODE_V6),
        };
    }
    match n % 4 {
        0 => ip(&format!("198.18.128.{}", 1 + n % 8)),
        1 => ip(&format!("198.18.129.{}", n % 8)),
        2 => ip(&format!("203.0.113.{}", n % 8)),
        _ => ip(NODE_V4),
    }
}

/// A destination: the Services' frontends, node ports, and nothing in particular.
fn destination(inp: &mut Input, v6: bool) -> (IpAddr, u16, Protocol) {
    use Protocol::*;
    let n = inp.byte();
    if v6 {
        return match n % 3 {
            0 => (ip("fd00:96::10"), 80, Tcp),
            1 => (ip("fd00:96::10"), 53, Udp),
            _ => (ip("fd00:96::10"), u16::from(n), Tcp),
        };
    }
    match n % 12 {
        0 => (ip("198.19.0.10"), 80, Tcp),
        1 => (ip("198.19.0.10"), 53, Udp),
        2 => (ip("198.19.0.10"), 9, Sctp),
        3 => (ip("198.19.0.11"), 80, Tcp),
        4 => (ip("198.19.0.12"), 80, Tcp),
        5 => (ip("203.0.113.100"), 443, Tcp),
        6 => (ip(NODE_V4), 30080, Tcp),
        7 => (ip(NODE_V4), 30053, Udp),
        8 => (ip(NODE_V4), 30443, Tcp),
        9 => (ip(NODE_V4), 30009, Sctp),
        10 => (ip("198.19.0.10"), u16::from(n), Udp),
        _ => (ip("198.19.0.99"), 80, Tcp),
    }
}

/// A packet carrying `t`; TCP with `flags`.
fn packet(t: &Tuple, flags: u8, payload: &[u8]) -> Vec<u8> {
    match t.proto {
        Protocol::Tcp => build_tcp(t, 1000, Some(1), flags, payload),
        _ => build_tuple(t, payload),
    }
}

fn tuple_of(pkt: &[u8]) -> Option<Tuple> {
    match parse(pkt) {
        Ok(Parsed::Flow(f)) => Some(f.tuple()),
        _ => None,
    }
}

/// The flows the engine forwarded: (client tuple, translated tuple), each tuple at most
/// once on its side.
#[derive(Default)]
struct Model {
    flows: Vec<(Tuple, Tuple)>,
}

impl Model {
    fn record(&mut self, from: Tuple, to: Tuple) {
        // A client tuple opened again, or a translated tuple reused: the old flow must be
        // gone from the table (expired, closed or evicted) for the engine to do either.
        self.flows.retain(|&(f, t)| f != from && t != to);
        self.flows.push((from, to));
    }
    fn nth(&self, k: u8) -> Option<(Tuple, Tuple)> {
        if self.flows.is_empty() {
            return None;
        }
        let (f, t) = self.flows[usize::from(k) % self.flows.len()];
        Some((t, f))
    }
}

struct Run {
    engine: Engine,
    model: Model,
    now: u64,
    out: Vec<u8>,
}

impl Run {
    /// One packet through the engine; returns the verdict and the packet as it left.
    fn process(&mut self, pkt: &[u8]) -> (Verdict, Vec<u8>) {
        let mut buf = pkt.to_vec();
        self.out.fill(0);
        let masq = FixedSource {
            v4: Some(ip(NODE_V4)),
            v6: Some(ip(NODE_V6)),
        };
        let v = self.engine.process(
            snapshot(),
            &mut buf,
            self.now,
            Ingress::default(),
            &masq,
            &mut self.out,
        );
        match v {
            Verdict::Respond { len, .. } => {
                assert!(len <= self.out.len());
                verify_checksums(&self.out[..len]);
                assert!(
                    parse(&self.out[..len]).is_ok(),
                    "an answer that does not parse"
                );
            }
            Verdict::Forward { new_flow, from, .. } => {
                if let (true, Some(from), Some(to)) = (new_flow, from, tuple_of(&buf)) {
                    self.model.record(from, to);
                }
            }
            _ => {}
        }
        let t = &self.engine.table;
        assert!(
            t.len() <= t.capacity(),
            "{} flows in {}",
            t.len(),
            t.capacity()
        );
        (v, buf)
    }
}

pub fn run(data: &[u8]) {
    let _ = checked(data);
}

/// What a run checked: answers un-NATed, ICMP errors translated, flows opened.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    pub flows: usize,
    pub answers: usize,
    pub errors: usize,
}

/// [`run`], saying what it checked (so that tests can see the invariants are reached).
pub fn checked(data: &[u8]) -> Checked {
    let mut c = Checked::default();
    let table = ConnTable::new(
        64,
        Timeouts::default(),
        SnatPorts::new(40000..=40015).unwrap(),
    )
    .unwrap();
    let mut r = Run {
        engine: Engine::on_node(table, 42, NodeState::new(8)),
        model: Model::default(),
        now: 1000 * 1_000_000_000,
        out: vec![0u8; 1500],
    };
    let mut inp = Input::new(data);
    let mut ops = 0;
    while !inp.is_empty() && ops < 256 {
        ops += 1;
        match inp.below(8) {
            // Anything at all.
            0 => {
                let n = usize::from(inp.byte());
                let mut pkt = inp.bytes(n).to_vec();
                // An IPv4 header checksum made right, mostly: what is behind it is reached.
                if pkt.len() >= 20 && pkt[0] >> 4 == 4 && !n.is_multiple_of(4) {
                    nat::rewrite::testutil::fix_ipv4_checksum(&mut pkt);
                }
                r.process(&pkt);
            }
            // A client's packet to a Service (or not).
            1..=3 => {
                // One byte: the family (IPv6 one time in five), sometimes an echo request.
                let kind = inp.byte();
                let v6 = kind.is_multiple_of(5);
                let src = client(&mut inp, v6);
                let (dst, dport, proto) = destination(&mut inp, v6);
                let sport = inp.u16();
                let t = Tuple {
                    src,
                    dst,
                    sport,
                    dport,
                    proto,
                };
                let flags = inp.byte();
                let payload = vec![b'x'; payload_len(inp.byte())];
                let pkt = if kind >= 240 {
                    icmp_echo(src, dst)
                } else {
                    packet(&t, flags, &payload)
                };
                let (v, buf) = r.process(&pkt);
                if let Verdict::Forward { .. } = v {
                    verify_checksums(&buf);
                }
            }
            // An endpoint's answer on a flow the engine forwarded.
            4 | 5 => {
                let k = inp.byte();
                let flags = inp.byte();
                let Some((to, from)) = r.model.nth(k) else {
                    continue;
                };
                let pkt = packet(&to.reversed(), flags, b"answer");
                let (v, buf) = r.process(&pkt);
                if let Verdict::Forward {
                    new_flow: false, ..
                } = v
                {
                    c.answers += 1;
                    verify_checksums(&buf);
                    assert_eq!(
                        tuple_of(&buf),
                        Some(from.reversed()),
                        "the answer to {from} (sent on as {to}) is not un-NATed to the client's tuple"
                    );
                }
            }
            // An ICMP error from the endpoint (or a router before it) about such a flow.
            6 => {
                let k = inp.byte();
                let router = inp.below(2) == 0;
                let Some((to, from)) = r.model.nth(k) else {
                    continue;
                };
                let quote = packet(&to, 0x10, b"quoted");
                let src = if router {
                    match to.dst {
                        IpAddr::V4(_) => ip("198.18.0.1"),
                        IpAddr::V6(_) => ip("fd00:18::1"),
                    }
                } else {
                    to.dst
                };
                let pkt = icmp_error(src, to.src, &quote);
                let (v, buf) = r.process(&pkt);
                if let Verdict::Forward { dst, .. } = v {
                    c.errors += 1;
                    verify_checksums(&buf);
                    match parse(&buf) {
                        Ok(Parsed::IcmpError(e)) => {
                            assert_eq!(e.inner(), from, "the ICMP error about {to} quotes");
                            assert_eq!(e.dst(), from.src, "the ICMP error about {to} goes to");
                            assert_eq!(dst, from.src);
                        }
                        other => panic!("a forwarded ICMP error is {other:?}"),
                    }
                }
            }
            // Time passes: up to about 11 minutes, in steps that reach every timeout.
            _ => {
                let b = u64::from(inp.byte());
                r.now += b * b * 10 * MS;
            }
        }
    }
    c.flows = r.engine.counters.new_flows as usize;
    c
}

/// A payload length from one byte: mostly short, sometimes up to a full frame.
fn payload_len(b: u8) -> usize {
    match b {
        0..192 => usize::from(b % 64),
        _ => 1200 + usize::from(b - 192) * 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeds reach the invariants: flows are opened, answered and errored about.
    #[test]
    fn the_seeds_check_answers_and_errors() {
        let mut total = Checked::default();
        for (target, name, data) in crate::seeds::all() {
            if target == "engine" {
                let c = checked(&data);
                eprintln!("{name}: {c:?}");
                total.flows += c.flows;
                total.answers += c.answers;
                total.errors += c.errors;
            }
        }
        assert!(
            total.flows >= 6 && total.answers >= 4 && total.errors >= 2,
            "{total:?}"
        );
    }
}
