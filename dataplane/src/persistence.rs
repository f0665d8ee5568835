//! Start-up with the previous process's state (see [`crate::statefile`]): every worker's
//! connection table and the node's affinity table are restored from the state directory
//! and journaled to new files from then on.
//!
//! What is not restored, and said so in one log line: files of another layout version
//! or another boot, or otherwise unreadable (the whole file); torn or corrupt records,
//! and records that do not decode (that record); flows whose two directions would belong
//! to different workers under a new worker count (they cannot be tracked by one table);
//! flows or clients that no longer fit the (smaller) tables.

use std::io;
use std::path::Path;
use std::sync::Arc;

use conntrack::persist::{AffinityRecord, FlowRecord, Header, Kind};
use conntrack::{AffinityTable, ConnTable, flow_owner};

use crate::statefile::{OldFile, StateDir, StateFile, boot_id};

/// How long start-up waits for a previous kxp to let go of the state directory.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// What start-up found and did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Restored {
    pub flows: usize,
    pub affinity: usize,
    /// Records that were torn, corrupt or invalid.
    pub bad_records: usize,
    /// Flows not restored: split across workers, clashing, or no room.
    pub flows_dropped: usize,
    /// Whole files not used, with why.
    pub bad_files: Vec<String>,
}

/// The state directory and this process's files in it.
#[derive(Debug)]
pub struct Persistence {
    pub dir: StateDir,
    /// One per worker, moved into the workers.
    pub conntrack: Vec<Option<StateFile>>,
    pub restored: Restored,
}

/// Shares the affinity file between the table (its sink) and start-up (to commit it).
#[derive(Debug)]
struct SharedFile(Arc<StateFile>);

impl conntrack::affinity::AffinitySink for SharedFile {
    fn put(&self, index: usize, entry: Option<&AffinityRecord>) {
        self.0.put(index, entry);
    }
}

fn io_err(what: &str, path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

impl Persistence {
    /// Locks `dir`, restores what the previous process left into `tables` (one per
    /// worker, empty) and a new affinity table of `affinity_capacity`, and starts the
    /// new files. `now` is `CLOCK_MONOTONIC`.
    ///
    /// # Errors
    /// The directory cannot be created or locked, or the new files cannot be written.
    /// (Unusable old files are not errors: they are reported in [`Restored`].)
    pub fn start(
        dir: &Path,
        tables: &mut [ConnTable],
        affinity_capacity: usize,
        now: u64,
    ) -> io::Result<(Persistence, AffinityTable)> {
        let sd = Persistence::lock(dir)?;
        Persistence::start_locked(sd, tables, affinity_capacity, now)
    }

    /// Locks the state directory `dir` (created if missing), waiting for a previous kxp
    /// that still holds it (up to 15 s).
    ///
    /// # Errors
    /// The directory cannot be created, or another kxp holds it past the wait.
    pub fn lock(dir: &Path) -> io::Result<StateDir> {
        StateDir::lock(dir, LOCK_WAIT)
    }

    /// [`Persistence::start`] in a directory already locked ([`Persistence::lock`]).
    ///
    /// # Errors
    /// As [`Persistence::start`].
    pub fn start_locked(
        sd: StateDir,
        tables: &mut [ConnTable],
        affinity_capacity: usize,
        now: u64,
    ) -> io::Result<(Persistence, AffinityTable)> {
        let id = FileId {
            boot: boot_id()?,
            netns: crate::sys::netns_cookie().unwrap_or(0),
        };
        let mut r = Restored::default();
        restore_flows(&sd, id, tables, now, &mut r);
        let files = start_flow_files(&sd, id, tables)?;
        let table = start_affinity(&sd, id, affinity_capacity, now, &mut r)?;
        Ok((
            Persistence {
                dir: sd,
                conntrack: files,
                restored: r,
            },
            table,
        ))
    }
}

/// What a state file is valid for: this boot, this network namespace.
#[derive(Debug, Clone, Copy)]
struct FileId {
    boot: [u8; 16],
    netns: u64,
}

/// The previous process's connection tables, into `tables` (each flow to the worker that
/// owns both its directions; the others dropped and counted in `r`).
fn restore_flows(sd: &StateDir, id: FileId, tables: &mut [ConnTable], now: u64, r: &mut Restored) {
    let workers = tables.len();
    for (_, path) in sd.conntrack_files() {
        let old = match OldFile::read(&path, id.boot, id.netns) {
            Ok(Some(f)) if f.header.kind == Kind::Conntrack => f,
            Ok(Some(_)) => {
                r.bad_files
                    .push(format!("{}: not a connection table", path.display()));
                continue;
            }
            Ok(None) => continue,
            Err(e) => {
                r.bad_files.push(format!("{}: {e}", path.display()));
                continue;
            }
        };
        for rec in old.records() {
            let Ok(f) = rec.and_then(|p| FlowRecord::decode(&p)) else {
                r.bad_records += 1;
                continue;
            };
            let a = flow_owner(f.orig.src, f.orig.sport, workers);
            let b = flow_owner(f.reply.dst, f.reply.dport, workers);
            if a != b || tables[a].restore(&f, now).is_err() {
                r.flows_dropped += 1;
                continue;
            }
            r.flows += 1;
        }
    }
}

/// Each worker's new connection-table file, holding what its table holds now, its
/// journal on from now; the files of workers that no longer exist removed.
fn start_flow_files(
    sd: &StateDir,
    id: FileId,
    tables: &mut [ConnTable],
) -> io::Result<Vec<Option<StateFile>>> {
    let workers = tables.len();
    let mut files = Vec::with_capacity(workers);
    for (i, t) in tables.iter_mut().enumerate() {
        let path = sd.conntrack(i);
        let h = Header {
            kind: Kind::Conntrack,
            records: t.capacity() as u64,
            worker: i as u32,
            workers: workers as u32,
            boot_id: id.boot,
            seed: 0,
            netns: id.netns,
        };
        let f = StateFile::create(&path, &h).map_err(|e| io_err("creating", &path, e))?;
        t.enable_journal();
        t.drain_journal(|slot, rec| {
            f.write(
                slot,
                &rec.map_or(conntrack::persist::CLEARED, |r| r.encode()),
            );
        });
        f.commit().map_err(|e| io_err("renaming", &path, e))?;
        files.push(Some(f));
    }
    for (i, path) in sd.conntrack_files() {
        if i >= workers {
            let _ = std::fs::remove_file(path);
        }
    }
    Ok(files)
}

/// The node's affinity table, restored from the previous one, with its new file: same
/// shard seed as before, so that clients fit as they did.
fn start_affinity(
    sd: &StateDir,
    id: FileId,
    affinity_capacity: usize,
    now: u64,
    r: &mut Restored,
) -> io::Result<AffinityTable> {
    let path = sd.affinity();
    let old = match OldFile::read(&path, id.boot, id.netns) {
        Ok(Some(f)) if f.header.kind == Kind::Affinity => Some(f),
        Ok(Some(_)) => {
            r.bad_files
                .push(format!("{}: not an affinity table", path.display()));
            None
        }
        Ok(None) => None,
        Err(e) => {
            r.bad_files.push(format!("{}: {e}", path.display()));
            None
        }
    };
    let seed = old
        .as_ref()
        .map_or_else(AffinityTable::random_seed, |f| f.header.seed);
    let capacity = AffinityTable::capacity_for(affinity_capacity);
    let h = Header {
        kind: Kind::Affinity,
        records: capacity as u64,
        worker: 0,
        workers: 1,
        boot_id: id.boot,
        seed,
        netns: id.netns,
    };
    let file = Arc::new(StateFile::create(&path, &h).map_err(|e| io_err("creating", &path, e))?);
    let table = AffinityTable::with_sink(
        affinity_capacity,
        seed,
        Some(Box::new(SharedFile(file.clone()))),
    );
    if let Some(old) = &old {
        for rec in old.records() {
            match rec.and_then(|p| AffinityRecord::decode(&p)) {
                Ok(a) => r.affinity += usize::from(table.restore(&a, now)),
                Err(_) => r.bad_records += 1,
            }
        }
    }
    file.commit().map_err(|e| io_err("renaming", &path, e))?;
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use conntrack::persist::RECORD_WORDS;
    use conntrack::tcp::flags::{ACK, SYN};
    use conntrack::{SnatPorts, Timeouts};
    use nat::{Protocol, Tuple};

    const S: u64 = 1_000_000_000;

    fn tables(n: usize) -> Vec<ConnTable> {
        SnatPorts::for_workers(61000..=65535, n)
            .unwrap()
            .into_iter()
            .map(|p| ConnTable::new(256, Timeouts::default(), p).unwrap())
            .collect()
    }

    fn flow(i: u16) -> (Tuple, Tuple) {
        let c = format!("203.0.113.7:{}", 40000 + i);
        (
            Tuple::new(
                c.parse().unwrap(),
                "198.19.0.10:80".parse().unwrap(),
                Protocol::Tcp,
            ),
            Tuple::new(
                "198.18.2.2:8080".parse().unwrap(),
                c.parse().unwrap(),
                Protocol::Tcp,
            ),
        )
    }

    /// A process that journals flows, dies (its files are left as they are), and the next
    /// one: every whole record is restored, a torn one is dropped and counted, a file of
    /// another layout is reported and not read, and a smaller worker count keeps the
    /// flows whose two directions still land on one worker.
    #[test]
    fn the_next_process_restores_what_is_whole_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("kxp-persist-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let now = 100 * S;
        let mut ts = tables(2);
        let (p, aff) = Persistence::start(&dir, &mut ts, 1024, now).unwrap();
        assert_eq!(p.restored, Restored::default());
        let files: Vec<StateFile> = p.conntrack.into_iter().map(Option::unwrap).collect();
        let mut placed = 0;
        for i in 0..40 {
            let (o, r) = flow(i);
            let w = flow_owner(o.src, o.sport, 2);
            ts[w].insert(o, r, 1, SYN, now).unwrap();
            ts[w].on_packet(&r, SYN | ACK, now);
            placed += 1;
        }
        aff.remember(
            9,
            "203.0.113.7".parse().unwrap(),
            "198.18.2.2:8080".parse().unwrap(),
            now,
            60 * S,
        );
        for (t, f) in ts.iter_mut().zip(&files) {
            t.drain_journal(|slot, rec| {
                f.write(
                    slot,
                    &rec.map_or(conntrack::persist::CLEARED, |r| r.encode()),
                );
            });
        }
        // Killed in the middle of writing worker 0's slot 0: an odd sequence number.
        let path0 = p.dir.conntrack(0);
        drop(files);
        drop(aff);
        drop(p.dir);
        let mut bytes = std::fs::read(&path0).unwrap();
        let at = conntrack::persist::HEADER_WORDS * 8;
        bytes[at] |= 1;
        std::fs::write(&path0, &bytes).unwrap();
        // A file from a kxp with another layout.
        let mut other = vec![0u8; 4096 + RECORD_WORDS * 8];
        other[..8].copy_from_slice(b"KXPSTATE");
        other[8] = 99;
        std::fs::write(dir.join("conntrack-7.state"), other).unwrap();

        let mut next = tables(2);
        let (p2, aff2) = Persistence::start(&dir, &mut next, 1024, now + S).unwrap();
        let r = &p2.restored;
        assert_eq!(r.flows, placed - 1, "{r:?}");
        assert_eq!(r.bad_records, 1, "{r:?}");
        assert_eq!(r.affinity, 1);
        assert_eq!(r.bad_files.len(), 1, "{r:?}");
        assert!(r.bad_files[0].contains("version 99"), "{r:?}");
        let held: usize = next.iter().map(ConnTable::len).sum();
        assert_eq!(held, placed - 1);
        // The flows are where a packet of either direction will look for them.
        for i in 0..40 {
            let (o, rep) = flow(i);
            let w = flow_owner(o.src, o.sport, 2);
            assert_eq!(w, flow_owner(rep.dst, rep.dport, 2));
            if let Some((_, e)) = next[w].get(&o, now + S) {
                assert_eq!(e.reply(), &rep);
            }
        }
        assert_eq!(
            aff2.recall(9, "203.0.113.7".parse().unwrap(), now + S),
            Some("198.18.2.2:8080".parse().unwrap())
        );
        drop(p2);
        drop(aff2);
        // One worker instead of two: every flow fits on it (both directions map to 0).
        let mut one = tables(1);
        let (p3, _) = Persistence::start(&dir, &mut one, 1024, now + 2 * S).unwrap();
        assert_eq!(p3.restored.flows, placed - 1, "{:?}", p3.restored);
        assert!(
            !dir.join("conntrack-1.state").exists(),
            "files of workers gone are removed"
        );
        drop(p3);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
