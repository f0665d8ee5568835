//! The tracker against the one-shot build: whatever the order and granularity of
//! changes, the snapshot it produces answers every lookup like a snapshot built from
//! scratch, and a sync touches only the Services that changed.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::json;

use super::testutil::{Lcg, node, random_changes_match_a_fresh_build, settings, slice, svc};
use super::*;
use nat::tuple::Protocol;

#[test]
fn random_changes_match_a_fresh_build_after_every_sync() {
    let walk = random_changes_match_a_fresh_build(&mut Lcg(7), 300);
    assert_eq!(walk.syncs, 300);
    assert!(
        walk.reuses > 50 && walk.copies > 20,
        "reuses {} copies {}",
        walk.reuses,
        walk.copies
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
            Some(Arc::new(
                slice(
                    "ns",
                    &format!("s{i}-x"),
                    &format!("s{i}"),
                    &["10.1.0.1", "10.1.0.2"],
                    "node-b",
                )
                .into(),
            )),
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
        Some(Arc::new(
            slice("ns", "s7-x", "s7", &["10.1.0.9"], "node-b").into(),
        )),
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
    t.apply_slice(("ns".into(), "a-1".into()), Some(Arc::new(sl.into())));
    assert_eq!(t.sync(1).trigger_times, vec!["2026-11-30T01:00:00Z"]);
    assert!(t.sync(2).trigger_times.is_empty());
}
