//! Where a translated packet goes next: a worker's route lookup against the mirrored
//! FIB of a real network namespace, through its route cache (`FibView::route`, what the
//! worker calls per packet since 2026-12-03) and without it (`FibSnapshot::route`: the
//! IPv4 trie of tables local, main and default, or for IPv6 their prefix levels, then
//! the neighbour table), for
//! packets to 1, 64 and 256 destinations in turn. The namespace has 1,000 routes and 250
//! permanent neighbours (on-link endpoints and a gateway).
//!
//! Needs root (it creates a network namespace, `kxpbf-…`, removed at the end);
//! `sudo cargo bench -p kxp-bench --bench fib`.

use std::hint::black_box;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use dataplane::fib::{FibMirror, Route};
use lab::Topology;

const ROUTES: u32 = 1_000;
const NEIGHBOURS: u32 = 250;

/// Runs `ip -n NS -batch -` on `cmds`.
fn ip_batch(ns: &str, cmds: &str) {
    let mut child = Command::new("ip")
        .args(["-n", ns, "-batch", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running ip");
    child
        .stdin
        .take()
        .expect("ip's stdin")
        .write_all(cmds.as_bytes())
        .expect("writing ip's commands");
    let out = child.wait_with_output().expect("waiting for ip");
    assert!(
        out.status.success(),
        "ip -batch: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn fib(c: &mut Criterion) {
    let mut lab = Topology::new("kxpbf");
    let a = lab
        .add_ns("a")
        .expect("creating a network namespace (the fib bench needs root)");
    lab.link((&a, "a0", "198.18.0.1/16"), (&a, "a1", ""))
        .expect("veth a0-a1");
    let mut cmds = String::new();
    for i in 0..NEIGHBOURS {
        let host = 2 + i;
        cmds += &format!(
            "neigh add 198.18.{}.{} lladdr 02:00:00:00:{:02x}:{:02x} dev a0 nud permanent\n",
            host >> 8,
            host & 0xff,
            host >> 8,
            host & 0xff
        );
    }
    for i in 0..ROUTES {
        cmds += &format!(
            "route add 198.19.{}.{}/30 via 198.18.0.2 dev a0\n",
            i >> 6,
            (i & 63) * 4
        );
    }
    ip_batch(&a, &cmds);
    let a0 = lab.ifindex(&a, "a0").expect("ifindex of a0");
    let mirror = lab
        .run_in(&a, || FibMirror::start(&[a0]))
        .expect("entering the namespace")
        .expect("FibMirror::start");
    mirror
        .wait_ready(Duration::from_secs(10))
        .expect("the mirror's first dump");
    let view = mirror.view();
    // The namespace's addresses: neighbour `i` (on the link) and address `h` of the /30
    // of route `r` (behind the gateway).
    let neighbour = |i: u32| {
        let host = 2 + i % NEIGHBOURS;
        IpAddr::V4(Ipv4Addr::new(198, 18, (host >> 8) as u8, host as u8))
    };
    let routed = |r: u32, h: u32| {
        IpAddr::V4(Ipv4Addr::new(
            198,
            19,
            (r >> 6) as u8,
            ((r & 63) * 4 + h) as u8,
        ))
    };
    // Endpoints on the link (neighbours) and clients behind the gateway, mixed.
    let dsts: Vec<IpAddr> = (0..256u32)
        .map(|i| {
            if i % 2 == 0 {
                neighbour(i / 2)
            } else {
                routed((i * 7) % ROUTES, 1)
            }
        })
        .collect();
    // Every routed address: the neighbours and the four addresses of each /30, in an
    // order that is neither theirs nor the cache's.
    let ordered: Vec<IpAddr> = (0..NEIGHBOURS)
        .map(neighbour)
        .chain((0..ROUTES * 4).map(|i| routed(i / 4, i % 4)))
        .collect();
    let all: Vec<IpAddr> = (0..ordered.len())
        .map(|i| ordered[(i * 2_477) % ordered.len()])
        .collect();
    let mut seen = std::collections::HashSet::new();
    for d in &all {
        assert!(seen.insert(*d), "{d} twice");
    }
    for d in dsts.iter().chain(&all) {
        assert!(
            matches!(view.route(*d), Route::Forward(_)),
            "{d} has a route and a neighbour"
        );
    }
    let sets = [&dsts[..1], &dsts[..64], &dsts[..], &all[..]];
    let mut g = c.benchmark_group("fib");
    g.sample_size(30)
        .noise_threshold(0.03)
        .measurement_time(Duration::from_secs(3));
    for set in sets {
        let n = set.len();
        g.bench_with_input(BenchmarkId::new("route_cached", n), &n, |b, _| {
            let mut k = 0;
            b.iter(|| {
                k = (k + 1) % n;
                black_box(view.route(black_box(set[k])))
            })
        });
        g.bench_with_input(BenchmarkId::new("route_uncached", n), &n, |b, _| {
            let mut k = 0;
            b.iter(|| {
                k = (k + 1) % n;
                black_box(view.load().route(black_box(set[k])))
            })
        });
    }
    g.finish();
    mirror.stop();
    drop(lab);
}

criterion_group!(benches, fib);
criterion_main!(benches);
