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
#[derive(Debug, Default, Clone)]
pub struct Restored {
    pub flows: usize,
    pub affinity: usize,
    /// Records that were torn, corrupt or invalid.
    pub bad_records: usize,
    /// Flows not restored: split across workers, clashing, or no room.
    pub flows_dropped: usize,
    /// Whole files not used, with why.
    pub bad_files: Vec<String>,
    /// Time taken: reading the flows, writing the new connection-table files, the
    /// affinity table (its file and its entries).
    pub took: [std::time::Duration; 3],
}

/// What was restored is equal; how long it took does not count.
impl PartialEq for Restored {
    fn eq(&self, o: &Restored) -> bool {
        (
            self.flows,
            self.affinity,
            self.bad_records,
            self.flows_dropped,
            &self.bad_files,
        ) == (
            o.flows,
            o.affinity,
            o.bad_records,
            o.flows_dropped,
            &o.bad_files,
        )
    }
}

impl Eq for Restored {}

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
        let prepared = Persistence::prepare(&sd.path, tables, affinity_capacity)?;
        Persistence::start_prepared(sd, prepared, tables, now)
    }

    /// What a start does in state directory `dir` before it holds the lock (so a kxp
    /// taking over from a running one does it while that one forwards): this process's
    /// new files created under names of its own (`NAME.PID.new`), the affinity table
    /// made with the previous one's shard seed, and the tables' journals on (empty
    /// tables: every flow restored into them later is journaled).
    ///
    /// # Errors
    /// The directory or the files cannot be created.
    pub fn prepare(
        dir: &Path,
        tables: &mut [ConnTable],
        affinity_capacity: usize,
    ) -> io::Result<PreparedFiles> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| io_err("creating", dir, e))?;
        let id = FileId {
            boot: boot_id()?,
            netns: crate::sys::netns_cookie().unwrap_or(0),
        };
        let workers = tables.len();
        let mut conntrack = Vec::with_capacity(workers);
        for (i, t) in tables.iter_mut().enumerate() {
            let path = crate::statefile::conntrack_path(dir, i);
            let h = Header {
                kind: Kind::Conntrack,
                records: t.capacity() as u64,
                worker: i as u32,
                workers: workers as u32,
                boot_id: id.boot,
                seed: 0,
                netns: id.netns,
            };
            conntrack.push(StateFile::create(&path, &h).map_err(|e| io_err("creating", &path, e))?);
            t.enable_journal();
        }
        let path = crate::statefile::affinity_path(dir);
        // The shard seed is the previous table's (its header does not change while it
        // runs), so that restored clients land in the shards they came from.
        let seed = match OldFile::read(&path, id.boot, id.netns) {
            Ok(Some(f)) if f.header.kind == Kind::Affinity => f.header.seed,
            _ => AffinityTable::random_seed(),
        };
        let h = Header {
            kind: Kind::Affinity,
            records: AffinityTable::capacity_for(affinity_capacity) as u64,
            worker: 0,
            workers: 1,
            boot_id: id.boot,
            seed,
            netns: id.netns,
        };
        let file =
            Arc::new(StateFile::create(&path, &h).map_err(|e| io_err("creating", &path, e))?);
        let affinity = AffinityTable::with_sink(
            affinity_capacity,
            seed,
            Some(Box::new(SharedFile(file.clone()))),
        );
        Ok(PreparedFiles {
            id,
            conntrack,
            affinity_file: file,
            affinity,
        })
    }

    /// The rest of [`Persistence::start_locked`] after [`Persistence::prepare`] (given
    /// the same `tables`): restores what the previous process left into them and the
    /// affinity table, writes it into the new files and makes them the directory's.
    ///
    /// # Errors
    /// The new files cannot be renamed into place.
    pub fn start_prepared(
        sd: StateDir,
        prepared: PreparedFiles,
        tables: &mut [ConnTable],
        now: u64,
    ) -> io::Result<(Persistence, AffinityTable)> {
        crate::statefile::remove_stale_temps(&sd.path);
        let PreparedFiles {
            id,
            conntrack,
            affinity_file,
            affinity,
        } = prepared;
        let mut r = Restored::default();
        let mut lap = std::time::Instant::now();
        let mut took = |i: usize, r: &mut Restored| {
            r.took[i] = lap.elapsed();
            lap = std::time::Instant::now();
        };
        restore_flows(&sd, id, tables, now, &mut r);
        took(0, &mut r);
        let files = start_flow_files(&sd, tables, conntrack)?;
        took(1, &mut r);
        start_affinity(&sd, id, &affinity, &affinity_file, now, &mut r)?;
        took(2, &mut r);
        Ok((
            Persistence {
                dir: sd,
                conntrack: files,
                restored: r,
            },
            affinity,
        ))
    }
}

/// This process's new state files and affinity table, made before the lock (see
/// [`Persistence::prepare`]).
#[derive(Debug)]
pub struct PreparedFiles {
    id: FileId,
    conntrack: Vec<StateFile>,
    affinity_file: Arc<StateFile>,
    affinity: AffinityTable,
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

/// Each worker's new connection-table file (`files`, made by [`Persistence::prepare`]),
/// holding what its table holds now (its journal on since), made the directory's; the
/// files of workers that no longer exist removed.
fn start_flow_files(
    sd: &StateDir,
    tables: &mut [ConnTable],
    files: Vec<StateFile>,
) -> io::Result<Vec<Option<StateFile>>> {
    let workers = tables.len();
    let mut out = Vec::with_capacity(workers);
    for (t, f) in tables.iter_mut().zip(files) {
        t.drain_journal(|slot, rec| {
            f.write(
                slot,
                &rec.map_or(conntrack::persist::CLEARED, |r| r.encode()),
            );
        });
        f.commit().map_err(|e| io_err("renaming", f.path(), e))?;
        out.push(Some(f));
    }
    for (i, path) in sd.conntrack_files() {
        if i >= workers {
            let _ = std::fs::remove_file(path);
        }
    }
    Ok(out)
}

/// The node's affinity table (made with its new file by [`Persistence::prepare`]), with
/// the previous one's entries restored, its file made the directory's.
fn start_affinity(
    sd: &StateDir,
    id: FileId,
    table: &AffinityTable,
    file: &StateFile,
    now: u64,
    r: &mut Restored,
) -> io::Result<()> {
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
    if let Some(old) = &old {
        if old.header.seed == table.seed() {
            for rec in old.records() {
                match rec.and_then(|p| AffinityRecord::decode(&p)) {
                    Ok(a) => r.affinity += usize::from(table.restore(&a, now)),
                    Err(_) => r.bad_records += 1,
                }
            }
        } else {
            r.bad_files.push(format!(
                "{}: replaced since this kxp read its shard seed",
                path.display()
            ));
        }
    }
    file.commit().map_err(|e| io_err("renaming", &path, e))
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
