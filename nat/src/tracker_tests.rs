//! The tracker against the one-shot build: whatever the order and granularity of
//! changes, the snapshot it produces answers every lookup like a snapshot built from
//! scratch, and a sync touches only the Services that changed.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::json;

use super::*;
use crate::k8s::{ClusterState, NodeSettings, build};
use crate::model::Family;
use crate::snapshot::Snapshot;
use crate::tuple::Protocol;

fn settings() -> NodeSettings {
    NodeSettings {
        node_name: "node-a".into(),
        node_ips: vec!["192.0.2.10".parse().unwrap()],
        cluster_cidrs: vec!["10.0.0.0/8".parse().unwrap()],
        ..Default::default()
    }
}

fn svc(ns: &str, name: &str, ip: &str, port: i32, extra: serde_json::Value) -> Service {
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

fn slice(ns: &str, name: &str, svc: &str, ips: &[&str], node: &str) -> EndpointSlice {
    serde_json::from_value(json!({
        "metadata": {"namespace": ns, "name": name,
                     "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "endpoints": ips.iter().map(|ip| json!({"addresses": [ip], "nodeName": node})).collect::<Vec<_>>(),
        "ports": [{"name": "p", "port": 8080, "protocol": "TCP"}]
    }))
    .unwrap()
}

fn node(zone: &str) -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": zone}}
    }))
    .unwrap()
}

/// Everything a decision can read, in a canonical order: every port (by name) with its
/// endpoints and categorisation, and which port owns each frontend.
fn describe(s: &Snapshot) -> Vec<String> {
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

fn fresh(state: &ClusterState) -> Vec<String> {
    describe(&build(state, &settings(), 1).unwrap().snapshot)
}

/// A small deterministic generator (no external crates, no clock).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[test]
fn random_changes_match_a_fresh_build_after_every_sync() {
    let mut rng = Lcg(7);
    let mut state = ClusterState::default();
    let mut t = Tracker::new(settings());
    let mut held = Vec::new();
    for round in 0..300 {
        // One to three changes per sync.
        for _ in 0..=rng.next(3) {
            let i = rng.next(12);
            let name = format!("s{i}");
            match rng.next(7) {
                0 | 1 => {
                    // Services share addresses on purpose: conflicts must settle the same.
                    let ip = format!("10.96.0.{}", 1 + rng.next(6));
                    let ext = if rng.next(3) == 0 {
                        json!({"externalIPs": [format!("10.96.0.{}", 1 + rng.next(6))]})
                    } else {
                        json!({})
                    };
                    let s = svc("ns", &name, &ip, 80 + rng.next(2) as i32, ext);
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
                    let ips: Vec<String> = (0..n)
                        .map(|k| format!("10.1.{i}.{}", k + rng.next(3) as usize))
                        .collect();
                    let refs: Vec<&str> = ips.iter().map(String::as_str).collect();
                    // Sometimes a slice moves to another Service.
                    let owner = if rng.next(5) == 0 {
                        format!("s{}", rng.next(12))
                    } else {
                        name.clone()
                    };
                    let o = slice(
                        "ns",
                        &sl,
                        &owner,
                        &refs,
                        if rng.next(2) == 0 { "node-a" } else { "node-b" },
                    );
                    state
                        .endpoint_slices
                        .retain(|x| x.metadata.name.as_deref() != Some(&sl));
                    state.endpoint_slices.push(o.clone());
                    t.apply_slice(("ns".into(), sl), Some(Arc::new(o)));
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
        let synced = t.sync(round + 1);
        assert!(synced.errors.is_empty(), "{:?}", synced.errors);
        assert_eq!(
            describe(&synced.update.snapshot),
            fresh(&state),
            "round {round}"
        );
        // Workers sometimes still hold the previous snapshot: both paths are exercised.
        if rng.next(3) == 0 {
            held.push(synced.update.snapshot.clone());
        } else {
            held.clear();
        }
    }
    assert!(
        t.reuses > 50 && t.copies > 20,
        "reuses {} copies {}",
        t.reuses,
        t.copies
    );
}

#[test]
fn one_changed_service_rebuilds_only_that_service() {
    let mut t = Tracker::new(settings());
    for i in 0..200 {
        t.apply_service(
            ("ns".into(), format!("s{i}")),
            Some(Arc::new(svc(
                "ns",
                &format!("s{i}"),
                &format!("10.96.{}.{}", i / 250, i % 250 + 1),
                80,
                json!({}),
            ))),
        );
        t.apply_slice(
            ("ns".into(), format!("s{i}-x")),
            Some(Arc::new(slice(
                "ns",
                &format!("s{i}-x"),
                &format!("s{i}"),
                &["10.1.0.1", "10.1.0.2"],
                "node-b",
            ))),
        );
    }
    let first = t.sync(1);
    assert!(first.update.full);
    assert_eq!(first.update.added.len(), 200);
    assert_eq!(first.rebuilt, 200);
    drop(first);
    assert!(!t.has_changes());

    t.apply_slice(
        ("ns".into(), "s7-x".into()),
        Some(Arc::new(slice("ns", "s7-x", "s7", &["10.1.0.9"], "node-b"))),
    );
    let s = t.sync(2);
    assert!(!s.update.full);
    assert_eq!(
        (s.rebuilt, s.update.removed.len(), s.update.added.len()),
        (1, 1, 1)
    );
    assert_eq!((s.service_changes, s.endpoint_changes), (0, 1));
    assert_eq!(s.update.added[0].endpoints.len(), 1);
    let f = s
        .update
        .snapshot
        .lookup_addr("10.96.0.8".parse().unwrap(), Protocol::Tcp, 80)
        .unwrap();
    assert_eq!(
        s.update.snapshot.port(f.port).endpoints[0].addr.to_string(),
        "10.1.0.9:8080"
    );
    drop(s);

    // Unchanged objects applied again (a relist) change nothing.
    t.apply_service(
        ("ns".into(), "s3".into()),
        Some(Arc::new(svc("ns", "s3", "10.96.0.4", 80, json!({})))),
    );
    assert!(!t.has_changes());
    let s = t.sync(3);
    assert_eq!((s.rebuilt, s.update.added.len()), (0, 0));
    assert_eq!(s.update.snapshot.port_count(), 200);

    // A node label change re-derives every Service, as kube-proxy does.
    t.apply_node("node-a".into(), Some(Arc::new(node("z9"))));
    let s = t.sync(4);
    assert!(s.update.full);
    assert_eq!(s.rebuilt, 200);
    assert_eq!(s.update.snapshot.node.zone.as_deref(), Some("z9"));
}

#[test]
fn the_previous_snapshot_is_reused_once_no_one_holds_it() {
    let mut t = Tracker::new(settings());
    t.apply_service(
        ("ns".into(), "a".into()),
        Some(Arc::new(svc("ns", "a", "10.96.0.1", 80, json!({})))),
    );
    let s1 = t.sync(1).update.snapshot;
    t.apply_service(
        ("ns".into(), "b".into()),
        Some(Arc::new(svc("ns", "b", "10.96.0.2", 80, json!({})))),
    );
    let s2 = t.sync(2).update.snapshot;
    // s1 is still held (a worker mid-batch): the next one must be a copy, s1 untouched.
    t.apply_service(
        ("ns".into(), "c".into()),
        Some(Arc::new(svc("ns", "c", "10.96.0.3", 80, json!({})))),
    );
    let copies = t.copies;
    let s3 = t.sync(3).update.snapshot;
    assert_eq!(t.copies, copies + 1);
    assert_eq!(
        (s1.port_count(), s2.port_count(), s3.port_count()),
        (1, 2, 3)
    );
    assert_eq!(s1.generation, 1);
    drop((s1, s2));
    // Now the one before s3 is free: caught up in place with the last two syncs' ops.
    t.apply_service(("ns".into(), "a".into()), None);
    let reuses = t.reuses;
    let s4 = t.sync(4).update.snapshot;
    assert_eq!(t.reuses, reuses + 1);
    assert_eq!((s3.port_count(), s4.port_count()), (3, 2));
    assert!(
        s4.lookup_addr("10.96.0.1".parse().unwrap(), Protocol::Tcp, 80)
            .is_none()
    );
    assert!(
        s4.lookup_addr("10.96.0.3".parse().unwrap(), Protocol::Tcp, 80)
            .is_some()
    );
    assert_eq!(s4.generation, 4);
}

#[test]
fn a_frontend_passes_to_the_next_claimant_when_its_owner_goes() {
    let mut t = Tracker::new(settings());
    // "b" is added first but "a" sorts first: "a" owns the shared externalIP.
    t.apply_service(
        ("ns".into(), "b".into()),
        Some(Arc::new(svc(
            "ns",
            "b",
            "10.96.0.2",
            80,
            json!({"externalIPs": ["198.51.100.7"]}),
        ))),
    );
    t.sync(1);
    t.apply_service(
        ("ns".into(), "a".into()),
        Some(Arc::new(svc(
            "ns",
            "a",
            "10.96.0.1",
            80,
            json!({"externalIPs": ["198.51.100.7"]}),
        ))),
    );
    let s = t.sync(2);
    let snap = &s.update.snapshot;
    let f = snap
        .lookup_addr("198.51.100.7".parse().unwrap(), Protocol::Tcp, 80)
        .unwrap();
    assert_eq!(snap.port(f.port).name.name, "a");
    assert_eq!(snap.conflicts.len(), 1, "{:?}", snap.conflicts);
    assert!(snap.conflicts[0].contains("ns/b:p"), "{:?}", snap.conflicts);
    t.apply_service(("ns".into(), "a".into()), None);
    let s = t.sync(3);
    let snap = &s.update.snapshot;
    let f = snap
        .lookup_addr("198.51.100.7".parse().unwrap(), Protocol::Tcp, 80)
        .unwrap();
    assert_eq!(snap.port(f.port).name.name, "b");
    assert!(snap.conflicts.is_empty());
}

#[test]
fn a_service_in_error_keeps_its_previous_ports() {
    let mut t = Tracker::new(settings());
    let key: ObjKey = ("ns".into(), "a".into());
    t.apply_service(
        key.clone(),
        Some(Arc::new(svc("ns", "a", "10.96.0.1", 80, json!({})))),
    );
    assert!(t.sync(1).errors.is_empty());
    let mut bad = svc("ns", "a", "10.96.0.1", 80, json!({}));
    bad.metadata.annotations = Some(BTreeMap::from([(
        crate::k8s::ANNOTATION_SCHEDULER.to_string(),
        "fastest".to_string(),
    )]));
    t.apply_service(key.clone(), Some(Arc::new(bad)));
    t.apply_service(
        ("ns".into(), "b".into()),
        Some(Arc::new(svc("ns", "b", "10.96.0.2", 80, json!({})))),
    );
    let s = t.sync(2);
    assert_eq!(s.errors.len(), 1);
    assert!(
        s.errors[0].to_string().contains("fastest"),
        "{}",
        s.errors[0]
    );
    // The good change went in; the bad one left "a" as it was.
    assert_eq!(s.update.snapshot.port_count(), 2);
    assert!(
        s.update
            .snapshot
            .lookup_addr("10.96.0.1".parse().unwrap(), Protocol::Tcp, 80)
            .is_some()
    );
    // Fixed: rebuilt from the fixed object.
    t.apply_service(
        key,
        Some(Arc::new(svc("ns", "a", "10.96.0.1", 81, json!({})))),
    );
    let s = t.sync(3);
    assert!(s.errors.is_empty());
    assert!(
        s.update
            .snapshot
            .lookup_addr("10.96.0.1".parse().unwrap(), Protocol::Tcp, 81)
            .is_some()
    );
    assert!(
        s.update
            .snapshot
            .lookup_addr("10.96.0.1".parse().unwrap(), Protocol::Tcp, 80)
            .is_none()
    );
}

#[test]
fn trigger_times_of_changed_slices_are_reported_once() {
    let mut t = Tracker::new(settings());
    let mut sl = slice("ns", "a-1", "a", &["10.1.0.1"], "node-b");
    sl.metadata.annotations = Some(BTreeMap::from([(
        ANNOTATION_TRIGGER_TIME.to_string(),
        "2026-11-30T01:00:00Z".to_string(),
    )]));
    t.apply_slice(("ns".into(), "a-1".into()), Some(Arc::new(sl)));
    assert_eq!(t.sync(1).trigger_times, vec!["2026-11-30T01:00:00Z"]);
    assert!(t.sync(2).trigger_times.is_empty());
}
