//! Connection table: lookup of an established flow (alone, and a batch of 64 with and
//! without warming the cache first) and insert of a new one, in a table holding 1M flows
//! (and 1k for comparison). Memory per entry is printed once. The
//! per-node state a new connection may touch: ClientIP affinity (alone and with another
//! thread hammering the table, as a second worker would), and the state file written for
//! every new flow (insert + journal + remove + journal, against the mapped file).

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use conntrack::ConnTable;
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use dataplane::sys::prefetch;
use kxp_bench::XorShift;
use kxp_bench::flows::{SYN, flow, holding};
use nat::tuple::Tuple;

const ACK: u8 = 0x10;
fn filled(n: u32) -> ConnTable {
    holding(n as usize + 1024, n)
}

fn conntrack(c: &mut Criterion) {
    let mut g = c.benchmark_group("conntrack");
    g.sample_size(20)
        .noise_threshold(0.03)
        .measurement_time(Duration::from_secs(4));
    for &n in &[1_000u32, 1_000_000] {
        let mut t = filled(n);
        println!(
            "conntrack: {n} flows, {} bytes per entry (entry {} B + index), {:.1} MiB reserved",
            t.bytes_per_entry_estimate(),
            std::mem::size_of::<conntrack::Entry>(),
            t.memory_bytes() as f64 / (1 << 20) as f64
        );
        let mut rng = XorShift(0x1234_5678_9abc_def1);
        let keys: Vec<Tuple> = (0..65_536)
            .map(|_| flow((rng.next_u64() % n as u64) as u32).0)
            .collect();
        let mut k = 0usize;
        g.bench_with_input(BenchmarkId::new("lookup_established", n), &n, |b, _| {
            b.iter(|| {
                k = (k + 1) & 65_535;
                black_box(
                    t.on_packet(black_box(&keys[k]), ACK, 2)
                        .map(|h| h.rewrite_to()),
                )
            })
        });
        // A received batch of 64 packets looked up one by one, as a worker does, with and
        // without warming the cache for the batch first (`ConnTable::warm`).
        for warmed in [false, true] {
            let name = if warmed {
                "lookup_batch_64_warmed"
            } else {
                "lookup_batch_64"
            };
            let mut k = 0usize;
            g.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter(|| {
                    k = (k + 64) & 65_535;
                    let batch = &keys[k..k + 64];
                    if warmed {
                        t.warm(batch, prefetch);
                    }
                    let mut found = 0u32;
                    for key in batch {
                        found += u32::from(t.on_packet(black_box(key), ACK, 2).is_some());
                    }
                    black_box(found)
                })
            });
        }
        if n == 1_000_000 {
            // A batch of 64 new connections into a full table of kxp's default size per
            // worker (262,144 unanswered flows: each new one evicts the oldest), as in
            // the macro benchmark's new-connection mode: lookup (a miss), then insert.
            // Warmed: the batch's keys (`warm`), and with `_replies` the reply tuples too
            // (`warm_tuples`, as a worker does once the new flows' endpoints are chosen).
            // With `_ahead`, the table also prefetches the flows it will evict next
            // (`ConnTable::set_prefetch`, as a worker's engine has it since 2026-12-05).
            for (warmed, replies, ahead) in [
                (false, false, false),
                (true, false, false),
                (true, true, false),
                (true, true, true),
            ] {
                let name = match (warmed, replies, ahead) {
                    (true, true, true) => "new_flows_batch_64_full_262144_warmed_replies_ahead",
                    (true, true, false) => "new_flows_batch_64_full_262144_warmed_replies",
                    (true, false, _) => "new_flows_batch_64_full_262144_warmed",
                    _ => "new_flows_batch_64_full_262144",
                };
                let cap = 262_144u32;
                let mut full = holding(cap as usize, cap);
                if ahead {
                    full.set_prefetch(prefetch);
                }
                let mut next = cap;
                let mut batch = Vec::with_capacity(64);
                g.bench_function(name, |b| {
                    b.iter(|| {
                        batch.clear();
                        batch.extend((0..64).map(|j| flow(next.wrapping_add(j))));
                        next = next.wrapping_add(64);
                        if warmed {
                            let keys: [Tuple; 64] = std::array::from_fn(|j| batch[j].0);
                            full.warm(&keys, prefetch);
                        }
                        if replies {
                            let keys: [Tuple; 64] = std::array::from_fn(|j| batch[j].1);
                            full.warm_tuples(&keys, prefetch);
                        }
                        let mut made = 0u32;
                        for (o, r) in &batch {
                            if full.on_packet(o, SYN, 3).is_none() {
                                made += u32::from(full.insert(*o, *r, 0, SYN, 3).is_ok());
                            }
                        }
                        black_box(made)
                    })
                });
            }
        }
        if n == 1_000 {
            // The same 1,000 hot flows in a table sized as kxp sizes a worker's (262,144
            // flows): what the index's sizing costs a worker with few flows.
            let mut big = holding(262_144, n);
            g.bench_with_input(
                BenchmarkId::new("lookup_established_in_262144", n),
                &n,
                |b, _| {
                    b.iter(|| {
                        k = (k + 1) & 65_535;
                        black_box(
                            big.on_packet(black_box(&keys[k]), ACK, 2)
                                .map(|h| h.rewrite_to()),
                        )
                    })
                },
            );
        }
        // Insert + remove of fresh flows, so the table stays at n entries.
        let mut next = n;
        g.bench_with_input(BenchmarkId::new("insert_remove", n), &n, |b, _| {
            b.iter(|| {
                let (o, r) = flow(next);
                next = next.wrapping_add(1);
                black_box(t.insert(o, r, 0, SYN, 3).is_ok());
                t.remove(&o)
            })
        });
    }
    g.finish();
}

fn node_state(c: &mut Criterion) {
    use conntrack::AffinityTable;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut g = c.benchmark_group("node");
    g.sample_size(20)
        .noise_threshold(0.03)
        .measurement_time(Duration::from_secs(4));
    let t = Arc::new(AffinityTable::new(262_144));
    let ep: SocketAddr = "198.19.1.1:8080".parse().unwrap();
    let client = |i: u32| IpAddr::V4(Ipv4Addr::from(0xC612_0000u32 + (i % 100_000)));
    for i in 0..100_000 {
        t.remember(7, client(i), ep, 0, 3600 * 1_000_000_000);
    }
    // What a new connection to an affine Service does: recall, and refresh.
    let new_conn = move |t: &AffinityTable, i: u32| {
        let c = client(i);
        let e = t.recall(7, black_box(c), 1).unwrap_or(ep);
        t.remember(7, c, e, 1, 3600 * 1_000_000_000);
    };
    let mut i = 0u32;
    g.bench_function("affinity_recall_remember", |b| {
        b.iter(|| {
            i = i.wrapping_add(7919);
            new_conn(&t, i);
        })
    });
    let stop = Arc::new(AtomicBool::new(false));
    let other = {
        let (t, stop) = (t.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut j = 1u32;
            while !stop.load(Ordering::Relaxed) {
                j = j.wrapping_add(104_729);
                new_conn(&t, j);
            }
        })
    };
    g.bench_function("affinity_recall_remember_while_another_worker_does", |b| {
        b.iter(|| {
            i = i.wrapping_add(7919);
            new_conn(&t, i);
        })
    });
    stop.store(true, Ordering::Relaxed);
    let _ = other.join();

    // A new flow and its end, each journaled to the mapped state file (the records a
    // worker writes before the packet leaves).
    let dir = std::env::temp_dir().join(format!("kxp-bench-state-{}", std::process::id()));
    let sd = dataplane::statefile::StateDir::lock(&dir, Duration::ZERO).unwrap();
    let mut table = filled(1_000);
    let header = conntrack::persist::Header {
        kind: conntrack::persist::Kind::Conntrack,
        records: table.capacity() as u64,
        worker: 0,
        workers: 1,
        boot_id: [0; 16],
        seed: 0,
        netns: 0,
    };
    let file = dataplane::statefile::StateFile::create(&sd.conntrack(0), &header).unwrap();
    table.enable_journal();
    let mut write = |slot: usize, r: Option<conntrack::persist::FlowRecord>| {
        file.write(slot, &r.map_or(conntrack::persist::CLEARED, |r| r.encode()));
    };
    table.drain_journal(&mut write);
    // A flow is journaled once its endpoint answers: insert, the answer, the end. The
    // same without a journal for comparison.
    let mut plain = filled(1_000);
    let mut next = 1_000_000u32;
    g.bench_function("insert_answer_remove", |b| {
        b.iter(|| {
            let (o, r) = flow(next);
            next = next.wrapping_add(1);
            black_box(plain.insert(o, r, 0, SYN, 3).is_ok());
            black_box(plain.on_packet(&r, SYN | ACK, 3).is_some());
            plain.remove(&o)
        })
    });
    g.bench_function("insert_answer_remove_journaled", |b| {
        b.iter(|| {
            let (o, r) = flow(next);
            next = next.wrapping_add(1);
            black_box(table.insert(o, r, 0, SYN, 3).is_ok());
            black_box(table.on_packet(&r, SYN | ACK, 3).is_some());
            table.drain_journal(&mut write);
            table.remove(&o);
            table.drain_journal(&mut write);
        })
    });
    g.finish();
    drop(file);
    drop(sd);
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, conntrack, node_state);
criterion_main!(benches);
