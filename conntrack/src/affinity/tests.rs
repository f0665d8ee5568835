use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use super::*;
use crate::persist::AffinityRecord;

const SEC: u64 = 1_000_000_000;

fn client(i: u32) -> IpAddr {
    IpAddr::V4(std::net::Ipv4Addr::from(0xC612_0000 + i)) // 198.18.x.y
}

fn ep(i: u16) -> SocketAddr {
    SocketAddr::new("198.19.1.1".parse().unwrap(), 8000 + i)
}

#[test]
fn remembers_until_the_timeout_after_the_last_refresh() {
    let t = AffinityTable::new(1000);
    t.remember(7, client(1), ep(1), 10 * SEC, 5 * SEC);
    assert_eq!(t.recall(7, client(1), 14 * SEC), Some(ep(1)));
    assert_eq!(t.recall(8, client(1), 14 * SEC), None, "per Service port");
    assert_eq!(t.recall(7, client(2), 14 * SEC), None, "per client");
    // A new connection refreshes it.
    t.remember(7, client(1), ep(1), 14 * SEC, 5 * SEC);
    assert_eq!(t.recall(7, client(1), 18 * SEC), Some(ep(1)));
    assert_eq!(
        t.recall(7, client(1), 19 * SEC),
        None,
        "expired at 14 + 5 s"
    );
    let s = t.stats();
    assert_eq!((s.entries, s.expired, s.evictions), (0, 1, 0));
}

#[test]
fn is_bounded_and_evicts_the_least_recently_refreshed() {
    let cap = SHARDS * 4;
    let t = AffinityTable::new(cap);
    assert_eq!(t.capacity(), cap);
    let long = 3600 * SEC;
    // Client 0 is refreshed all along; the others come once each.
    for i in 0..(cap as u32 * 10) {
        t.remember(1, client(0), ep(0), u64::from(i), long);
        t.remember(1, client(i + 1), ep(1), u64::from(i), long);
    }
    let s = t.stats();
    assert!(s.entries as usize <= cap, "{s:?}");
    assert!(s.entries as usize >= cap / 2, "shards fill up: {s:?}");
    assert_eq!(s.evictions + s.entries, cap as u64 * 10 + 1, "{s:?}");
    assert_eq!(
        t.recall(1, client(0), 1),
        Some(ep(0)),
        "a busy client stays"
    );
    // Refresh records do not pile up: the shard's order stays near its map.
    for shard in t.shards.iter() {
        let s = shard.lock().unwrap();
        assert!(s.order.len() <= 2 * s.map.len() + 17, "{}", s.order.len());
    }
}

#[test]
fn sweep_frees_clients_that_never_come_back() {
    let t = AffinityTable::new(100_000);
    for i in 0..1000 {
        t.remember(1, client(i), ep(1), 0, 10 * SEC);
    }
    assert_eq!(t.stats().entries, 1000);
    let mut removed = 0;
    for _ in 0..SHARDS {
        removed += t.sweep(5 * SEC, 1000);
    }
    assert_eq!(removed, 0, "nothing expired yet");
    for _ in 0..SHARDS {
        removed += t.sweep(10 * SEC, 1000);
    }
    assert_eq!(removed, 1000);
    assert_eq!(t.stats().entries, 0);
    assert_eq!(t.stats().expired, 1000);
}

/// Workers share it: concurrent connections of one client see one endpoint, and the
/// table stays consistent under contention.
#[test]
fn concurrent_workers_agree() {
    let t = Arc::new(AffinityTable::new(SHARDS * 64));
    let threads: Vec<_> = (0..4)
        .map(|w| {
            let t = t.clone();
            std::thread::spawn(move || {
                let mut chosen = Vec::new();
                for i in 0..20_000u32 {
                    let c = client(i % 500);
                    let now = u64::from(i);
                    // What a worker does for a new connection: recall, else pick and
                    // remember.
                    let e = match t.recall(9, c, now) {
                        Some(e) => e,
                        None => {
                            let e = ep(w);
                            t.remember(9, c, e, now, 3600 * SEC);
                            e
                        }
                    };
                    chosen.push((i % 500, e));
                }
                chosen
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|h| h.join().unwrap()).collect();
    let s = t.stats();
    assert_eq!(s.entries, 500);
    assert_eq!(s.evictions, 0);
    // Once the race for a client's first connection is over, every thread sees the
    // table's endpoint for it.
    for c in 0..500u32 {
        let fin = t.recall(9, client(c), 0).unwrap();
        for r in &results {
            let tail: Vec<_> = r.iter().rev().filter(|(x, _)| *x == c).take(5).collect();
            assert!(tail.iter().all(|(_, e)| *e == fin), "client {c}");
        }
    }
}

/// A sink that keeps the records, as a state file would.
#[derive(Debug, Default)]
struct VecSink(std::sync::Mutex<Vec<Option<AffinityRecord>>>);

impl AffinitySink for Arc<VecSink> {
    fn put(&self, index: usize, entry: Option<&AffinityRecord>) {
        let mut v = self.0.lock().unwrap();
        if v.len() <= index {
            v.resize(index + 1, None);
        }
        v[index] = entry.copied();
    }
}

#[test]
fn every_change_reaches_the_sink_and_a_new_table_restores_from_it() {
    let sink = Arc::new(VecSink::default());
    let t = AffinityTable::with_sink(SHARDS * 2, 77, Some(Box::new(sink.clone())));
    for i in 0..(SHARDS as u32 * 4) {
        t.remember(1, client(i), ep((i % 3) as u16), 0, 100 * SEC);
    }
    t.remember(2, client(0), ep(9), 0, 5 * SEC);
    t.recall(2, client(0), 6 * SEC); // expired: its record goes
    let records: Vec<AffinityRecord> = sink.0.lock().unwrap().iter().flatten().copied().collect();
    assert!(sink.0.lock().unwrap().len() <= t.capacity());
    let live = t.entries(6 * SEC);
    assert_eq!(
        records.len(),
        live.len(),
        "one record per entry, no leftovers"
    );
    // The next process uses the seed it finds with the records.
    let fresh = AffinityTable::with_sink(SHARDS * 2, t.seed(), None);
    for r in &records {
        assert!(fresh.restore(r, 6 * SEC));
    }
    for e in live {
        assert_eq!(fresh.recall(e.service, e.client, 6 * SEC), Some(e.endpoint));
    }
    assert!(
        !fresh.restore(&records[0], 200 * SEC),
        "expired entries are not restored"
    );
}
