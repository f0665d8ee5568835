//! The tracker against the one-shot build, as a property over random changes: shared by
//! the tracker's unit tests (a seeded generator) and the `snapshot` fuzz target (choices
//! read from the fuzzer's bytes).

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::json;

use super::Tracker;
use crate::k8s::{ClusterState, NodeSettings};
use crate::tracker::build;
use nat::model::Family;
use nat::snapshot::Snapshot;

/// The node the tests build for.
pub fn settings() -> NodeSettings {
    NodeSettings {
        node_name: "node-a".into(),
        node_ips: vec!["192.0.2.10".parse().unwrap()],
        cluster_cidrs: vec!["10.0.0.0/8".parse().unwrap()],
        ..Default::default()
    }
}

/// A Service with one TCP port named `p`, `extra` merged into its spec.
pub fn svc(ns: &str, name: &str, ip: &str, port: i32, extra: serde_json::Value) -> Service {
    let mut v = json!({
        "metadata": {"namespace": ns, "name": name},
        "spec": {"clusterIP": ip, "ports": [{"name": "p", "port": port, "protocol": "TCP"}]}
    });
    if let (Some(spec), Some(extra)) = (v["spec"].as_object_mut(), extra.as_object()) {
        for (k, x) in extra {
            spec.insert(k.clone(), x.clone());
        }
    }
    serde_json::from_value(v).unwrap()
}

/// An IPv4 EndpointSlice of `svc` with ready endpoints at `ips` on `node`, port `p`.
pub fn slice(ns: &str, name: &str, svc: &str, ips: &[&str], node: &str) -> EndpointSlice {
    serde_json::from_value(json!({
        "metadata": {"namespace": ns, "name": name,
                     "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "endpoints": ips.iter().map(|ip| json!({"addresses": [ip], "nodeName": node})).collect::<Vec<_>>(),
        "ports": [{"name": "p", "port": 8080, "protocol": "TCP"}]
    }))
    .unwrap()
}

/// The node object of `node-a`, in `zone`.
pub fn node(zone: &str) -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": zone}}
    }))
    .unwrap()
}

/// Everything a decision can read, in a canonical order: every port (by name) with its
/// endpoints and categorisation, and which port owns each frontend.
pub fn describe(s: &Snapshot) -> Vec<String> {
    let mut out = Vec::new();
    for sp in s.ports_sorted() {
        out.push(format!(
            "{} {} {:?} {:?} {:?} {:?}",
            sp.name, sp.cluster_ip, sp.external_ips, sp.endpoints, sp.cat, sp.cluster_table
        ));
        let proto = sp.name.protocol;
        for ip in std::iter::once(sp.cluster_ip).chain(sp.external_ips.iter().copied()) {
            let owner = s.lookup_addr(ip, proto, sp.port).map(|f| {
                let p = s.port(f.port);
                format!("{}/{:?}/{:?}", p.name, Family::of(&p.cluster_ip), f.kind)
            });
            out.push(format!("  {ip}:{} -> {owner:?}", sp.port));
        }
        if sp.node_port != 0 {
            let owner = s
                .lookup_node_port(sp.cluster_ip, proto, sp.node_port)
                .map(|i| s.port(i).name.to_string());
            out.push(format!("  nodePort {} -> {owner:?}", sp.node_port));
        }
        out.push(format!("  clusterIP {}", s.is_cluster_ip(sp.cluster_ip)));
    }
    out.push(format!("frontends {}", s.frontend_count()));
    out.push(format!("zone {:?}", s.node.zone));
    let mut c = s.conflicts.clone();
    c.sort();
    out.extend(c);
    out
}

/// A fresh one-shot build of `state`, described.
pub fn fresh(state: &ClusterState) -> Vec<String> {
    describe(&build(state, &settings(), 1).unwrap().snapshot)
}

/// Where the random changes come from.
pub trait Choices {
    /// A number in `0..n` (`n > 0`).
    fn next(&mut self, n: u64) -> u64;
    /// No more choices to make (the generator stops at the next sync).
    fn done(&self) -> bool {
        false
    }
}

/// A small deterministic generator (no external crates, no clock).
#[derive(Debug)]
pub struct Lcg(pub u64);

impl Choices for Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// Choices read from bytes, one byte per choice (0 once they run out): a fuzzer's input.
#[derive(Debug)]
pub struct ByteChoices<'a> {
    pub data: &'a [u8],
}

impl Choices for ByteChoices<'_> {
    fn next(&mut self, n: u64) -> u64 {
        match self.data.split_first() {
            Some((b, rest)) => {
                self.data = rest;
                u64::from(*b) % n
            }
            None => 0,
        }
    }
    fn done(&self) -> bool {
        self.data.is_empty()
    }
}

/// What [`random_changes_match_a_fresh_build`] did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Walk {
    pub syncs: usize,
    pub reuses: u64,
    pub copies: u64,
}

/// Up to `rounds` syncs of one to three random changes each (Services, with the spec
/// fields that change which ports and endpoints a node programs; EndpointSlices of both
/// families, with conditions and zone hints, sometimes moving to another Service; the
/// node's zone), workers sometimes holding the previous snapshot. After every sync the
/// tracker's snapshot must describe exactly as a fresh build of the same objects does
/// (panics otherwise).
pub fn random_changes_match_a_fresh_build(rng: &mut dyn Choices, rounds: usize) -> Walk {
    let mut state = ClusterState::default();
    let mut t = Tracker::new(settings());
    let mut held = Vec::new();
    let mut walk = Walk::default();
    for round in 0..rounds {
        if rng.done() {
            break;
        }
        // One to three changes per sync.
        for _ in 0..=rng.next(3) {
            let i = rng.next(12);
            let name = format!("s{i}");
            match rng.next(7) {
                0 | 1 => {
                    // Services share addresses on purpose: conflicts must settle the same.
                    let v6 = rng.next(6) == 0;
                    let ip = if v6 {
                        format!("fd00::{}", 1 + rng.next(6))
                    } else {
                        format!("10.96.0.{}", 1 + rng.next(6))
                    };
                    let mut extra = serde_json::Map::new();
                    if rng.next(3) == 0 {
                        let e = if v6 {
                            format!("fd00::{}", 1 + rng.next(6))
                        } else {
                            format!("10.96.0.{}", 1 + rng.next(6))
                        };
                        extra.insert("externalIPs".into(), json!([e]));
                    }
                    match rng.next(4) {
                        0 => {}
                        1 => {
                            extra.insert("type".into(), json!("NodePort"));
                        }
                        2 => {
                            extra.insert("type".into(), json!("LoadBalancer"));
                            extra.insert("externalTrafficPolicy".into(), json!("Local"));
                        }
                        _ => {
                            extra.insert("internalTrafficPolicy".into(), json!("Local"));
                        }
                    }
                    if rng.next(4) == 0 {
                        extra.insert("sessionAffinity".into(), json!("ClientIP"));
                    }
                    if rng.next(4) == 0 {
                        extra.insert("trafficDistribution".into(), json!("PreferClose"));
                    }
                    let port = 80 + rng.next(2) as i32;
                    let mut s = svc("ns", &name, &ip, port, serde_json::Value::Object(extra));
                    if let Some(spec) = s.spec.as_mut() {
                        if rng.next(2) == 0 {
                            spec.ip_families = Some(vec![if v6 { "IPv6" } else { "IPv4" }.into()]);
                        }
                        if let Some(ports) = spec.ports.as_mut()
                            && spec.type_.as_deref().is_some_and(|t| t != "ClusterIP")
                        {
                            // Node ports shared on purpose too.
                            ports[0].node_port = Some(30000 + rng.next(3) as i32);
                        }
                    }
                    state
                        .services
                        .retain(|o| o.metadata.name.as_deref() != Some(&name));
                    state.services.push(s.clone());
                    t.apply_service(("ns".into(), name), Some(Arc::new(s)));
                }
                2 => {
                    state
                        .services
                        .retain(|o| o.metadata.name.as_deref() != Some(&name));
                    t.apply_service(("ns".into(), name), None);
                }
                3 | 4 => {
                    let sl = format!("{name}-{}", rng.next(2));
                    let n = rng.next(4) as usize;
                    let v6 = rng.next(6) == 0;
                    let ips: Vec<String> = (0..n)
                        .map(|k| {
                            let host = k + rng.next(3) as usize;
                            if v6 {
                                format!("fd01::{i}:{host}")
                            } else {
                                format!("10.1.{i}.{host}")
                            }
                        })
                        .collect();
                    let refs: Vec<&str> = ips.iter().map(String::as_str).collect();
                    // Sometimes a slice moves to another Service.
                    let owner = if rng.next(5) == 0 {
                        format!("s{}", rng.next(12))
                    } else {
                        name.clone()
                    };
                    let mut o = slice(
                        "ns",
                        &sl,
                        &owner,
                        &refs,
                        if rng.next(2) == 0 { "node-a" } else { "node-b" },
                    );
                    if v6 {
                        o.address_type = "IPv6".into();
                    }
                    for ep in &mut o.endpoints {
                        let mut c = k8s_openapi::api::discovery::v1::EndpointConditions::default();
                        match rng.next(5) {
                            0 => c.ready = Some(false),
                            1 => {
                                c.ready = Some(false);
                                c.serving = Some(true);
                                c.terminating = Some(true);
                            }
                            _ => {}
                        }
                        ep.conditions = Some(c);
                        if rng.next(3) == 0 {
                            ep.zone = Some(if rng.next(2) == 0 { "z1" } else { "z2" }.into());
                            ep.hints = Some(k8s_openapi::api::discovery::v1::EndpointHints {
                                for_zones: Some(vec![k8s_openapi::api::discovery::v1::ForZone {
                                    name: if rng.next(2) == 0 { "z1" } else { "z2" }.into(),
                                }]),
                                ..Default::default()
                            });
                        }
                    }
                    state
                        .endpoint_slices
                        .retain(|x| x.metadata.name.as_deref() != Some(&sl));
                    state.endpoint_slices.push(o.clone());
                    t.apply_slice(("ns".into(), sl), Some(Arc::new(o.into())));
                }
                5 => {
                    let sl = format!("{name}-{}", rng.next(2));
                    state
                        .endpoint_slices
                        .retain(|x| x.metadata.name.as_deref() != Some(&sl));
                    t.apply_slice(("ns".into(), sl), None);
                }
                _ => {
                    let n = node(if rng.next(2) == 0 { "z1" } else { "z2" });
                    state.nodes = vec![n.clone()];
                    t.apply_node("node-a".into(), Some(Arc::new(n)));
                }
            }
        }
        let synced = t.sync(round as u64 + 1);
        assert!(synced.errors.is_empty(), "{:?}", synced.errors);
        assert_eq!(
            describe(&synced.update.snapshot),
            fresh(&state),
            "round {round}"
        );
        walk.syncs += 1;
        // Workers sometimes still hold the previous snapshot: both paths are exercised.
        if rng.next(3) == 0 {
            held.push(synced.update.snapshot.clone());
        } else {
            held.clear();
        }
    }
    walk.reuses = t.reuses;
    walk.copies = t.copies;
    walk
}
