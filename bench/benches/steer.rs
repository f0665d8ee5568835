//! The XDP steering program's cost per packet, as the kernel times it
//! (BPF_PROG_TEST_RUN, one run per frame; its own clock, not the system call's), with the
//! macro benchmark's 10,000 Services loaded: 10,000 ClusterIP frontends in
//! 198.19.0.0/16 and their 99,990 endpoints on 32,768 addresses. Frames go to one
//! ClusterIP or to all 10,000 in turn (each frontend lookup then a cache miss in a
//! 262,144-bucket hash table), and replies come from the endpoints. `frontends first`:
//! no ServiceCIDR known, so a ClusterIP is found in `frontends` as before 2026-12-04;
//! `service CIDR first`: the cluster's ServiceCIDR synced, so a destination inside it is
//! taken after one compare, and every other packet pays that compare on top.
//!
//! Needs root (it loads a BPF program); `sudo cargo bench -p kxp-bench --bench steer`.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use dataplane::xdp::{SteerKey, Steering};
use ipnet::IpNet;
use nat::tuple::Protocol;

const SERVICES: u32 = 10_000;
const ENDPOINTS_EACH: u32 = 10;
const PORT: u16 = 9000;
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);

fn vip(k: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 10)) + k)
}

fn endpoint(k: u32, j: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 128, 0)) + (k * ENDPOINTS_EACH + j) % 32_768)
}

fn steer(c: &mut Criterion) {
    let mut s =
        Steering::load().expect("loading the steering program (the steer bench needs root)");
    let key = |a: Ipv4Addr| SteerKey::new(IpAddr::V4(a), PORT, Protocol::Udp);
    let frontends: HashSet<SteerKey> = (0..SERVICES).map(|k| key(vip(k))).collect();
    let endpoints: HashSet<SteerKey> = (0..SERVICES)
        .flat_map(|k| (0..ENDPOINTS_EACH).map(move |j| key(endpoint(k, j))))
        .collect();
    s.sync_frontends(&frontends).expect("frontends");
    s.sync_endpoints(&endpoints).expect("endpoints");
    s.sync_cluster_ips(&(0..SERVICES).map(|k| IpAddr::V4(vip(k))).collect())
        .expect("cluster_ips");
    s.sync_local_addrs(&HashSet::from([IpAddr::V4(NODE)]))
        .expect("local_addrs");
    s.set_snat_range(61_000, 61_999).expect("snat range");
    let mac = |b| [2, 0, 0, 0, 0, b];
    let to_vips: Vec<[u8; 60]> = (0..SERVICES)
        .map(|k| kxp_bench::udp_frame(mac(1), mac(2), (CLIENT, 10_000 + k as u16), (vip(k), PORT)))
        .collect();
    let replies: Vec<[u8; 60]> = (0..SERVICES)
        .map(|k| {
            kxp_bench::udp_frame(
                mac(3),
                mac(2),
                (endpoint(k, k % ENDPOINTS_EACH), PORT),
                (CLIENT, 10_000 + k as u16),
            )
        })
        .collect();
    let cidr: IpNet = "198.19.0.0/16".parse().expect("CIDR");
    let sets: [(&str, &[[u8; 60]]); 3] = [
        ("to_clusterip", &to_vips[..1]),
        ("to_clusterip", &to_vips[..]),
        ("dnat_reply", &replies[..]),
    ];
    let mut g = c.benchmark_group("steer");
    g.sample_size(30)
        .noise_threshold(0.03)
        .measurement_time(Duration::from_secs(3));
    for (order, cidrs) in [
        ("frontends first", HashSet::new()),
        ("service CIDR first", HashSet::from([cidr])),
    ] {
        s.sync_service_cidrs(&cidrs).expect("service CIDRs");
        for (name, frames) in sets {
            let before = s.stats().expect("stats");
            for f in frames {
                s.test_run(f).expect("test run");
            }
            let after = s.stats().expect("stats").since(&before);
            // No socket in the program's map: a steered frame is counted, then passed.
            let steered = after.frontend + after.cluster_ip + after.dnat_reply;
            assert_eq!(
                steered,
                frames.len() as u64,
                "{name}: every frame is steered"
            );
            assert_eq!(after.no_socket, frames.len() as u64);
            let id = BenchmarkId::new(format!("{name}, {order}"), frames.len());
            g.bench_function(id, |b| {
                let mut k = 0;
                b.iter_custom(|iters| {
                    let mut ns = 0u64;
                    for _ in 0..iters {
                        k = (k + 1) % frames.len();
                        let (_, took) = s.test_run_timed(&frames[k]).expect("test run");
                        ns += u64::from(took);
                    }
                    Duration::from_nanos(ns)
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, steer);
criterion_main!(benches);
