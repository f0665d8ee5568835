//! Per-packet header work: parse, DNAT+SNAT rewrite with incremental checksums, and the
//! reverse, on 64-byte-class packets (IPv4/IPv6 × TCP/UDP).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use nat::rewrite::testutil::{Endpoints, build};
use nat::rewrite::{Parsed, parse, rewrite};
use nat::tuple::Protocol;

fn rewrite_bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("rewrite");
    g.sample_size(30)
        .noise_threshold(0.03)
        .measurement_time(Duration::from_secs(3));
    for (fam, e) in [("v4", Endpoints::v4()), ("v6", Endpoints::v6())] {
        for proto in [Protocol::Tcp, Protocol::Udp] {
            let mut pkt = build(&e, proto, &[0u8; 18]);
            let there = e.masquerade(proto);
            let back = e.original(proto);
            g.bench_with_input(
                BenchmarkId::new(format!("{fam}_{proto}"), pkt.len()),
                &(),
                |b, _| {
                    let mut flip = false;
                    b.iter(|| {
                        let Ok(Parsed::Flow(f)) = parse(black_box(&pkt)) else {
                            panic!("test packet parses")
                        };
                        let to = if flip { &back } else { &there };
                        flip = !flip;
                        rewrite(&mut pkt, &f, to).unwrap();
                        black_box(pkt[10])
                    })
                },
            );
        }
    }
    g.finish();
}

criterion_group!(benches, rewrite_bench);
criterion_main!(benches);
