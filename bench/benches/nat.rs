//! Frontend lookup and new-connection decisions against clusters of 1 to 100k Services.
//!
//! Two lookup patterns per size: a hot working set (the same 64 Services, as a busy node
//! sees its few heavy hitters) measures the algorithm; 65,536 lookups spread uniformly
//! over every Service measure what the memory hierarchy adds once the index outgrows the
//! caches.

use std::hint::black_box;
use std::net::SocketAddr;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kxp_bench::{XorShift, cluster, cluster_ip, node_settings};
use nat::decide::{Decision, NewPacket, decide};
use nat::select::{PickInput, RrCursor, pick};
use nat::tuple::Protocol;

const SIZES: [u32; 4] = [1, 1_000, 10_000, 100_000];

fn targets(services: u32, n: usize, hot: bool, rng: &mut XorShift) -> Vec<std::net::IpAddr> {
    (0..n)
        .map(|k| {
            let i = if hot {
                (k as u32 * 7919) % services.min(64)
            } else {
                (rng.next_u64() % services as u64) as u32
            };
            cluster_ip(i)
        })
        .collect()
}

fn frontend_lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("frontend_lookup");
    g.sample_size(30)
        .noise_threshold(0.03)
        .measurement_time(Duration::from_secs(3));
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    for &n in &SIZES {
        let snap = translate::tracker::build(&cluster(n, 3), &node_settings(), 1)
            .unwrap()
            .snapshot;
        for (label, hot) in [("hot64", true), ("uniform", false)] {
            let t = targets(n, 65_536, hot, &mut rng);
            let mut k = 0usize;
            g.bench_with_input(BenchmarkId::new(label, n), &n, |b, _| {
                b.iter(|| {
                    k = (k + 1) & 65_535;
                    black_box(snap.lookup_addr(black_box(t[k]), Protocol::Tcp, 80))
                })
            });
        }
    }
    g.finish();
}

fn new_connection(c: &mut Criterion) {
    let mut g = c.benchmark_group("new_connection");
    g.sample_size(30)
        .noise_threshold(0.03)
        .measurement_time(Duration::from_secs(3));
    let mut rng = XorShift(0xD1B5_4A32_D192_ED03);
    for &n in &[1u32, 100_000] {
        let snap = translate::tracker::build(&cluster(n, 3), &node_settings(), 1)
            .unwrap()
            .snapshot;
        let t = targets(n, 4096, true, &mut rng);
        let zero = |_: SocketAddr| 0u32;
        let mut cursor = RrCursor::default();
        let mut k = 0usize;
        let src: std::net::IpAddr = "10.200.0.1".parse().unwrap();
        g.bench_with_input(BenchmarkId::new("decide_and_pick", n), &n, |b, _| {
            b.iter(|| {
                k = (k + 1) & 4095;
                let pkt = NewPacket {
                    src,
                    dst: t[k],
                    dport: 80,
                    proto: Protocol::Tcp,
                    in_interface: None,
                };
                match decide(&snap, black_box(&pkt)) {
                    Decision::Forward(f) => {
                        let input = PickInput {
                            src: SocketAddr::new(pkt.src, 40_000 + k as u16),
                            dst: SocketAddr::new(pkt.dst, 80),
                            proto: 6,
                            random: rng.next_u64(),
                            active: &zero,
                        };
                        let ep = pick(
                            f.port.scheduler,
                            &f.port.endpoints,
                            f.candidates,
                            f.port.cat.equal_weights,
                            None,
                            &input,
                            &mut cursor,
                        );
                        black_box(
                            ep.map(|i| f.masquerade_for(pkt.src, &f.port.endpoints[i as usize])),
                        )
                    }
                    _ => black_box(None),
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, frontend_lookup, new_connection);
criterion_main!(benches);
