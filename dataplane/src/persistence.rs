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
        let sd = StateDir::lock(dir, LOCK_WAIT)?;
        let boot = boot_id()?;
        let workers = tables.len();
        let mut r = Restored::default();

        // Connection tables.
        for (_, path) in sd.conntrack_files() {
            let old = match OldFile::read(&path, boot) {
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
        let mut files = Vec::with_capacity(workers);
        for (i, t) in tables.iter_mut().enumerate() {
            let path = sd.conntrack(i);
            let h = Header {
                kind: Kind::Conntrack,
                records: t.capacity() as u64,
                worker: i as u32,
                workers: workers as u32,
                boot_id: boot,
                seed: 0,
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

        // The affinity table: same shard seed as before, so that clients fit as they did.
        let path = sd.affinity();
        let old = match OldFile::read(&path, boot) {
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
            .map_or_else(|| AffinityTable::new(1).seed(), |f| f.header.seed);
        let capacity = AffinityTable::new(affinity_capacity).capacity();
        let h = Header {
            kind: Kind::Affinity,
            records: capacity as u64,
            worker: 0,
            workers: 1,
            boot_id: boot,
            seed,
        };
        let file =
            Arc::new(StateFile::create(&path, &h).map_err(|e| io_err("creating", &path, e))?);
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
