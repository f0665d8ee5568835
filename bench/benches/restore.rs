//! What a kxp taking over the node does with the connection tables once it holds the
//! state directory's lock, that is while neither kxp forwards (issue 36's hand-over
//! pause), with 100,000 answered flows in one worker's table of 262,144 slots:
//!
//! - `whole`: the previous process's files read whole at the lock (what every start did
//!   before the read ahead, and what a start with no read ahead still does):
//!   `Persistence::start`;
//! - `after_read_ahead_100_changed`: the files read ahead before the lock
//!   (`Persistence::prepare`, not timed), then the running kxp closing 50 flows and
//!   opening 50 (not timed), then at the lock only the changed records read again
//!   (`Persistence::start_prepared`).
//!
//! Both include making the new files the directory's and the (empty) affinity table.
//! Each iteration builds its own previous process (not timed), so the measurement time
//! is short and the samples few.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use conntrack::persist::CLEARED;
use conntrack::tcp::flags::{ACK, SYN};
use conntrack::{ConnTable, SnatPorts, Timeouts};
use criterion::{Criterion, criterion_group, criterion_main};
use dataplane::persistence::Persistence;
use dataplane::statefile::StateFile;
use nat::{Protocol, Tuple};

const FLOWS: u32 = 100_000;
const CAPACITY: usize = 262_144;
const S: u64 = 1_000_000_000;

fn table() -> Vec<ConnTable> {
    let ports = SnatPorts::for_workers(61000..=65535, 1).expect("a valid range");
    ports
        .into_iter()
        .map(|p| ConnTable::new(CAPACITY, Timeouts::default(), p).expect("a valid capacity"))
        .collect()
}

/// Flow `i`: a client of 203.0.112.0/22 to a ClusterIP, DNATed to an endpoint.
fn flow(i: u32) -> (Tuple, Tuple) {
    let client = std::net::SocketAddr::new(
        std::net::Ipv4Addr::from(0xCB00_7000 + (i >> 14)).into(),
        1024 + (i & 0x3fff) as u16,
    );
    (
        Tuple::new(client, "198.19.0.10:80".parse().unwrap(), Protocol::Tcp),
        Tuple::new("198.18.2.2:8080".parse().unwrap(), client, Protocol::Tcp),
    )
}

/// Answered flows `ids` into `t`, journaled to `f`.
fn open(t: &mut ConnTable, f: &StateFile, ids: impl Iterator<Item = u32>, now: u64) {
    for i in ids {
        let (o, r) = flow(i);
        t.insert(o, r, 1, SYN, now).expect("room for the flow");
        t.on_packet(&r, SYN | ACK, now);
    }
    journal(t, f);
}

fn journal(t: &mut ConnTable, f: &StateFile) {
    t.drain_journal(|slot, rec| f.write(slot, &rec.map_or(CLEARED, |r| r.encode())));
}

/// A previous process in a new directory: its 100,000 flows journaled to its file, its
/// lock let go (its table and file returned, to change them later).
fn previous(n: u32) -> (PathBuf, Vec<ConnTable>, StateFile) {
    let dir = std::env::temp_dir().join(format!("kxp-restore-bench-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut t = table();
    let (p, _) = Persistence::start(&dir, &mut t, 1024, 100 * S).expect("a state directory");
    let f = p
        .conntrack
        .into_iter()
        .next()
        .flatten()
        .expect("worker 0's file");
    open(&mut t[0], &f, 0..FLOWS, 100 * S);
    (dir, t, f)
}

fn timed(iters: u64, mut one: impl FnMut(u32) -> Duration) -> Duration {
    (0..iters).map(|n| one(n as u32)).sum()
}

fn clean(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
}

fn restore(c: &mut Criterion) {
    let mut g = c.benchmark_group("restore_at_the_lock");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_millis(100));
    g.bench_function("whole", |b| {
        b.iter_custom(|iters| {
            timed(iters, |n| {
                let (dir, _old, _f) = previous(n);
                let mut next = table();
                let t = Instant::now();
                let started = Persistence::start(&dir, &mut next, 1024, 101 * S);
                let took = t.elapsed();
                assert_eq!(started.expect("a start").0.restored.flows, FLOWS as usize);
                clean(&dir);
                took
            })
        });
    });
    g.bench_function("after_read_ahead_100_changed", |b| {
        b.iter_custom(|iters| {
            timed(iters, |n| {
                let (dir, mut old, f) = previous(n);
                let mut next = table();
                let prepared =
                    Persistence::prepare(&dir, &mut next, 1024, 101 * S).expect("prepared");
                for i in 0..50 {
                    old[0].remove(&flow(i).0);
                }
                open(&mut old[0], &f, FLOWS..FLOWS + 50, 101 * S);
                let t = Instant::now();
                let sd = Persistence::lock(&dir).expect("the lock");
                let started = Persistence::start_prepared(sd, prepared, &mut next, 102 * S);
                let took = t.elapsed();
                let r = started.expect("a start").0.restored;
                assert_eq!((r.flows, r.caught_up > 0), (FLOWS as usize, true), "{r:?}");
                clean(&dir);
                took
            })
        });
    });
    g.finish();
}

criterion_group!(benches, restore);
criterion_main!(benches);
