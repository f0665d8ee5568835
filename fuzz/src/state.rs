//! The restore of the state files a previous process left: the fuzzer's bytes are one
//! file (a connection table's or the affinity table's), which `Persistence::start` reads
//! from a real state directory as kxp's start does. Whatever the file holds, the start
//! succeeds, restores only flows that fit (each in the table of the worker that owns it,
//! within its capacity), and counts the rest.
//!
//! The first byte chooses the worker count (1–3), the file (which worker's, or the
//! affinity table's), and whether to make the header and the records' checksums valid
//! (so that the fuzzer reaches what lies behind them; it finds CRCs slowly).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use conntrack::persist::{HEADER_WORDS, Header, Kind, RECORD_WORDS, seal};
use conntrack::{ConnTable, SnatPorts, Timeouts};
use dataplane::persistence::Persistence;

const CAPACITY: usize = 64;
const SEC: u64 = 1_000_000_000;

/// This thread's state directory (tests replay corpora from several threads at once).
fn dir() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static DIR: PathBuf = {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let d = std::env::temp_dir()
                .join(format!("kxp-fuzz-state-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            d
        };
    }
    DIR.with(Clone::clone)
}

pub fn run(data: &[u8]) {
    let _ = restored(data);
}

/// [`run`], returning what was restored (flows, affinity entries), so that tests can see
/// the seeds reach the restore.
pub fn restored(data: &[u8]) -> (usize, usize) {
    let Some((&mode, rest)) = data.split_first() else {
        return (0, 0);
    };
    let workers = 1 + usize::from(mode & 3) % 3;
    let affinity = mode & 4 != 0;
    let fix_header = mode & 8 != 0;
    let seal_records = mode & 16 != 0;
    let count_records = mode & 32 != 0;
    let worker = usize::from(mode >> 6) % workers;

    // The file: the input's first 80 bytes are the header's meaningful words, the rest of
    // the header is zero, then the input's records.
    let word = |b: &[u8]| {
        let mut w = [0u8; 8];
        w[..b.len()].copy_from_slice(b);
        u64::from_le_bytes(w)
    };
    let (head, body) = rest.split_at(rest.len().min(80));
    let mut words = vec![0u64; HEADER_WORDS];
    for (i, c) in head.chunks(8).enumerate() {
        words[i] = word(c);
    }
    words.extend(body.chunks(8).map(word));
    let records = (words.len() - HEADER_WORDS).div_ceil(RECORD_WORDS);
    words.resize(HEADER_WORDS + records * RECORD_WORDS, 0);
    if seal_records {
        for r in words[HEADER_WORDS..].chunks_exact_mut(RECORD_WORDS) {
            if r[0] != 0 {
                let seq = (r[0] as u32 & !1).max(2);
                r[0] = seal(seq, &r[1..]);
            }
        }
    }
    if fix_header {
        let h = Header {
            kind: if affinity {
                Kind::Affinity
            } else {
                Kind::Conntrack
            },
            records: if count_records {
                records as u64
            } else {
                words[2]
            },
            worker: words[3] as u32,
            workers: (words[3] >> 32) as u32,
            boot_id: dataplane::statefile::boot_id().expect("this machine's boot id"),
            seed: words[7],
            netns: 0,
        };
        words[..10].copy_from_slice(&h.encode());
    }
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();

    let dir = &dir();
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("a state directory");
    let file = if affinity {
        dir.join("affinity.state")
    } else {
        dir.join(format!("conntrack-{worker}.state"))
    };
    std::fs::write(&file, &bytes).expect("the old file written");

    let mut tables: Vec<ConnTable> = (0..workers)
        .map(|_| {
            ConnTable::new(
                CAPACITY,
                Timeouts::default(),
                SnatPorts::new(40000..=40063).unwrap(),
            )
            .unwrap()
        })
        .collect();
    let now = 1000 * SEC;
    let (p, aff) = Persistence::start(dir, &mut tables, 8, now)
        .unwrap_or_else(|e| panic!("the start fails on an old file: {e}"));
    let r = &p.restored;
    let held: usize = tables.iter().map(ConnTable::len).sum();
    assert_eq!(r.flows, held, "{r:?}");
    for t in &tables {
        assert!(t.len() <= t.capacity());
    }
    assert!(
        r.flows + r.flows_dropped + r.bad_records <= records,
        "{r:?}"
    );
    let entries = aff.stats().entries as usize;
    assert!(
        entries <= aff.capacity(),
        "affinity {entries} > {}",
        aff.capacity()
    );
    let got = (r.flows, r.affinity);
    drop(p);
    let _ = std::fs::remove_dir_all(dir);
    got
}

#[cfg(test)]
mod tests {
    /// The seeds get past the checks: their flows and affinity entries are restored.
    #[test]
    fn the_seeds_restore_flows_and_affinity() {
        let got: Vec<(String, (usize, usize))> = crate::seeds::all()
            .into_iter()
            .filter(|(t, _, _)| *t == "state")
            .map(|(_, name, data)| (name, super::restored(&data)))
            .collect();
        let find = |n: &str| got.iter().find(|(name, _)| name == n).unwrap().1;
        assert_eq!(find("conntrack"), (5, 0), "{got:?}");
        assert_eq!(find("conntrack-other-boot"), (0, 0), "{got:?}");
        assert_eq!(find("affinity"), (0, 1), "{got:?}");
        assert!(find("conntrack-two-workers").0 < 5, "{got:?}");
    }
}
