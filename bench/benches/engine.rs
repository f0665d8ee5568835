//! A worker's engine on batches of 64 new connections (TCP SYNs to one ClusterIP Service
//! of three endpoints, from inside the cluster CIDR) into a full table of kxp's default
//! size per worker (262,144 flows: each new one evicts the oldest), as the macro
//! benchmark's new-connection mode drives it: each packet parsed, prepared as the
//! worker's batch warming does (`Engine::prepare_new`: the decision and the endpoint
//! made ahead), then handled (`Engine::process_parsed`). Two ways:
//! - `prepared`: the packet is handled on the snapshot it was prepared on, so the engine
//!   uses the prepared choice (a worker's case);
//! - `decided_again`: handled on another snapshot of the same cluster, so the engine
//!   decides and picks again with the prepared draw (what every new connection cost
//!   before the choice was kept, and still costs after a new snapshot is published
//!   between the warming and the packet).
//!
//! Times are per packet.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use conntrack::{ConnTable, SnatPorts, Timeouts};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use engine::{Engine, FixedSource, Ingress, Verdict};
use kxp_bench::{cluster, cluster_ip, node_settings};
use nat::rewrite::testutil::build_tcp;
use nat::rewrite::{Parsed, parse};
use nat::tuple::{Protocol, Tuple};

const SYN: u8 = 0x02;
const BATCH: usize = 64;
const CAPACITY: usize = 262_144;
/// Distinct connections cycled through: four times the table, so that a tuple comes
/// back only long after its flow was evicted.
const POOL: usize = 4 * CAPACITY;

/// Connection `i`: a client in the cluster CIDR (10.0.0.0/8, outside the endpoints'
/// 10.0.0.0/16) to the Service's ClusterIP, port 80.
fn connection(i: usize) -> Tuple {
    let client = SocketAddr::new(
        IpAddr::V4(Ipv4Addr::from(0x0A40_0000u32 + (i >> 14) as u32)),
        1024 + (i & 0x3fff) as u16,
    );
    Tuple::new(client, SocketAddr::new(cluster_ip(0), 80), Protocol::Tcp)
}

fn engine(c: &mut Criterion) {
    let build = || {
        translate::tracker::build(&cluster(1, 3), &node_settings(), 1)
            .expect("a valid cluster")
            .snapshot
    };
    let (snap, other) = (build(), build());
    let masq = FixedSource {
        v4: Some("192.0.2.10".parse().unwrap()),
        v6: None,
    };
    let table = |capacity| {
        let mut t = ConnTable::new(
            capacity,
            Timeouts::default(),
            SnatPorts::new(32768..=65535).expect("a valid port range"),
        )
        .expect("a valid capacity");
        // As a worker's table has it (dataplane's plane gives it before the engine).
        t.set_prefetch(dataplane::sys::prefetch);
        t
    };
    let pool: Vec<Vec<u8>> = (0..POOL)
        .map(|i| build_tcp(&connection(i), 1, None, SYN, b""))
        .collect();
    // Every packet of the pool has the same length (a SYN without options or payload).
    let len = pool[0].len();
    let mut g = c.benchmark_group("engine_new_connection");
    g.sample_size(20)
        .noise_threshold(0.03)
        .measurement_time(Duration::from_secs(4))
        .throughput(Throughput::Elements(BATCH as u64));
    for (name, handled_on) in [("prepared", &snap), ("decided_again", &other)] {
        let mut e = Engine::new(table(CAPACITY), 7);
        let mut out = vec![0u8; 1500];
        let mut bufs = vec![[0u8; 128]; BATCH];
        let mut next = 0usize;
        // One batch of 64 new connections, as a worker's round: the next packets of the
        // pool copied into frames, each parsed and prepared, then each handled.
        let mut batch = |e: &mut Engine, next: &mut usize, bufs: &mut [[u8; 128]]| {
            let mut forwarded = 0usize;
            let mut prepared = Vec::with_capacity(BATCH);
            for b in bufs.iter_mut() {
                let p = &pool[*next % POOL];
                *next += 1;
                b[..p.len()].copy_from_slice(p);
            }
            for b in bufs.iter() {
                let Ok(Parsed::Flow(fl)) = parse(&b[..len]) else {
                    unreachable!("a TCP SYN parses as a flow")
                };
                prepared.push((fl, e.prepare_new(&snap, &fl, None).map(|(p, _)| p)));
            }
            for (b, (fl, prep)) in bufs.iter_mut().zip(prepared) {
                let v = e.process_parsed(
                    handled_on,
                    &mut b[..len],
                    Ok(Parsed::Flow(fl)),
                    prep,
                    1,
                    Ingress::default(),
                    &masq,
                    &mut out,
                );
                forwarded += usize::from(matches!(v, Verdict::Forward { .. }));
            }
            forwarded
        };
        // The table filled first: every connection measured evicts one.
        while e.table.len() < CAPACITY {
            batch(&mut e, &mut next, &mut bufs);
        }
        g.bench_function(name, |b| {
            b.iter(|| black_box(batch(&mut e, &mut next, &mut bufs)))
        });
        assert_eq!(
            e.counters.new_flows, next as u64,
            "every connection was forwarded as new"
        );
    }
    g.finish();
}

criterion_group!(benches, engine);
criterion_main!(benches);
