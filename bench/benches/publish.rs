//! Snapshot publication, the read side: what a worker pays once per batch to see the
//! current snapshot, with arc-swap (what kxp uses) and with crossbeam-epoch (the other
//! candidate of the design), alone and while a publisher thread swaps in a new snapshot
//! every 100 µs (far more often than any control plane does).
//!
//! - arc-swap: `load()` (a guard; the snapshot stays alive while it is held);
//! - crossbeam-epoch: `pin()` then `Atomic::load` (the snapshot stays alive while pinned).
//!   Reading through the pointer needs `unsafe`, which kxp keeps out of this crate; the
//!   benchmark touches the pointer only, which is the synchronisation cost. The old
//!   snapshots are leaked rather than handed to `defer_destroy` (also `unsafe`): the
//!   publisher's reclamation cost is not what a worker pays.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use criterion::{Criterion, criterion_group, criterion_main};
use crossbeam::epoch::{self, Atomic, Owned};

/// A stand-in for a snapshot (its size does not matter to a pointer swap).
struct Snap {
    generation: u64,
    _payload: [u64; 8],
}

fn snap(generation: u64) -> Snap {
    Snap {
        generation,
        _payload: [generation; 8],
    }
}

fn publish(c: &mut Criterion) {
    let mut g = c.benchmark_group("snapshot_load");
    g.sample_size(50)
        .noise_threshold(0.03)
        .measurement_time(Duration::from_secs(3));
    for contended in [false, true] {
        let label = if contended {
            "publisher_running"
        } else {
            "alone"
        };
        let swap = Arc::new(ArcSwap::from_pointee(snap(0)));
        let atomic = Arc::new(Atomic::new(snap(0)));
        let stop = Arc::new(AtomicBool::new(false));
        let writer = contended.then(|| {
            let (swap, atomic, stop) = (swap.clone(), atomic.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 1;
                while !stop.load(Ordering::Relaxed) {
                    swap.store(Arc::new(snap(n)));
                    let guard = epoch::pin();
                    // Leaked: see the module docs.
                    let _old = atomic.swap(Owned::new(snap(n)), Ordering::AcqRel, &guard);
                    n += 1;
                    std::thread::sleep(Duration::from_micros(100));
                }
            })
        });
        g.bench_function(format!("arc_swap/{label}"), |b| {
            b.iter(|| {
                let s = swap.load();
                black_box(s.generation)
            })
        });
        g.bench_function(format!("crossbeam_epoch/{label}"), |b| {
            b.iter(|| {
                let guard = epoch::pin();
                let p = atomic.load(Ordering::Acquire, &guard);
                black_box(p.as_raw())
            })
        });
        stop.store(true, Ordering::Relaxed);
        if let Some(w) = writer {
            let _ = w.join();
        }
    }
    g.finish();
}

criterion_group!(benches, publish);
criterion_main!(benches);
