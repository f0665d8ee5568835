//! The control plane's sync: kube-proxy's change tracking in kxp ([`translate::tracker`]) on a
//! cluster of 10,000 Services with 100,000 endpoints (10 each, one EndpointSlice per
//! Service).
//!
//! - `full`: every object handed to a new tracker and synced into a snapshot (what a
//!   start or a relist costs);
//! - `one_endpoint_slice_changed`: one Service's slice replaced (an endpoint moves), then
//!   a sync, with the snapshot let go as workers do (so the double buffer is reused);
//! - `one_endpoint_slice_changed_snapshot_held`: the same while the previous snapshot is
//!   still held (a worker mid-batch), which forces a copy of the index;
//! - `resync_unchanged`: the periodic re-sync, every store handed over again unchanged.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use k8s_openapi::api::core::v1::Service;
use kxp_bench::{cluster, endpoint_ip, node_settings};
use translate::slice::{Address, Slice};
use translate::tracker::Tracker;

const SERVICES: u32 = 10_000;
const ENDPOINTS_EACH: u32 = 10;

struct Objects {
    services: Vec<Arc<Service>>,
    slices: Vec<Arc<Slice>>,
}

fn objects() -> Objects {
    let c = cluster(SERVICES, ENDPOINTS_EACH);
    Objects {
        services: c.services.into_iter().map(Arc::new).collect(),
        slices: c
            .endpoint_slices
            .into_iter()
            .map(|s| Arc::new(Slice::from(s)))
            .collect(),
    }
}

fn loaded(o: &Objects) -> Tracker {
    let mut t = Tracker::new(node_settings());
    t.replace_services(o.services.iter().cloned());
    t.replace_slices(o.slices.iter().cloned());
    let s = t.sync(1);
    assert!(s.errors.is_empty());
    assert_eq!(s.update.snapshot.port_count(), SERVICES as usize);
    t
}

/// Slice `i` with its first endpoint moved to another address (a different one at each
/// visit of the same slice).
fn changed_slice(o: &Objects, i: usize, n: u32) -> Arc<Slice> {
    let mut s = (*o.slices[i]).clone();
    let visit = n as usize / o.slices.len();
    s.endpoints[0].address = Some(Address::Ip(endpoint_ip(i as u32, 10 + (visit % 6) as u32)));
    Arc::new(s)
}

/// The next slice to change (spread over all of them) and its changed version.
fn next_change(o: &Objects, n: &std::cell::Cell<u32>) -> ((String, String), Arc<Slice>) {
    n.set(n.get() + 1);
    let i = (n.get() as usize * 7919) % o.slices.len();
    let s = changed_slice(o, i, n.get());
    (key(&s), s)
}

fn key(s: &Slice) -> (String, String) {
    (
        s.metadata.namespace.clone().unwrap_or_default(),
        s.metadata.name.clone().unwrap_or_default(),
    )
}

fn sync(c: &mut Criterion) {
    let o = objects();
    let mut g = c.benchmark_group("sync_10k_services_100k_endpoints");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(10))
        .noise_threshold(0.05);
    g.bench_function("full", |b| {
        b.iter_batched(|| (), |()| black_box(loaded(&o)), BatchSize::PerIteration)
    });

    let mut t = loaded(&o);
    let n = std::cell::Cell::new(0u32);
    g.sample_size(50).measurement_time(Duration::from_secs(5));
    g.bench_function("one_endpoint_slice_changed", |b| {
        b.iter_batched(
            || next_change(&o, &n),
            |(k, s)| {
                t.apply_slice(k, Some(s));
                let synced = t.sync(u64::from(n.get()) + 1);
                assert!(synced.rebuilt <= 1);
                synced.update.snapshot.generation
            },
            BatchSize::SmallInput,
        )
    });
    let mut held = None;
    g.bench_function("one_endpoint_slice_changed_snapshot_held", |b| {
        b.iter_batched(
            || next_change(&o, &n),
            |(k, s)| {
                t.apply_slice(k, Some(s));
                let synced = t.sync(u64::from(n.get()) + 1);
                // Keep the previous snapshot alive until the next sync has run.
                held.replace(synced.update.snapshot)
            },
            BatchSize::SmallInput,
        )
    });
    drop(held);
    g.bench_function("resync_unchanged", |b| {
        b.iter(|| {
            n.set(n.get() + 1);
            t.replace_services(o.services.iter().cloned());
            t.replace_slices(o.slices.iter().cloned());
            t.sync(u64::from(n.get()) + 1).rebuilt
        })
    });
    g.finish();
    eprintln!(
        "snapshots reused in place: {}, copied: {}",
        t.reuses, t.copies
    );
}

criterion_group!(benches, sync);
criterion_main!(benches);
