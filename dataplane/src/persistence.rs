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

use conntrack::persist::{AffinityRecord, FlowRecord, Header, Kind, RECORD_WORDS, StateError};
use conntrack::{AffinityTable, ConnTable, flow_owner};
use nat::Tuple;

use crate::statefile::{OldFile, StateDir, StateFile, boot_id, conntrack_files_in};

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
    /// affinity table (its file and its entries). Reading the flows is catching up with
    /// the records changed since they were read ahead ([`Restored::read_ahead`]).
    pub took: [std::time::Duration; 3],
    /// Time taken reading the previous process's flows ahead, before the lock (while it
    /// may still forward: see [`Persistence::prepare`]).
    pub read_ahead: std::time::Duration,
    /// Records that changed between the read ahead and the lock (read again then).
    pub caught_up: usize,
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
        let prepared = Persistence::prepare(&sd.path, tables, affinity_capacity, now)?;
        Persistence::start_prepared(sd, prepared, tables, now)
    }

    /// What a start does in state directory `dir` before it holds the lock (so a kxp
    /// taking over from a running one does it while that one forwards): this process's
    /// new files created under names of its own (`NAME.PID.new`), the affinity table
    /// made with the previous one's shard seed, the tables' journals on, and the
    /// previous process's flows read ahead into `tables` (empty) and written into the
    /// new files. At the lock, [`Persistence::start_prepared`] reads again only the
    /// records that changed since: at a hand-over, the switch no longer waits for every
    /// flow to be read (128-172 ms at 100,000 flows), only for those the running kxp
    /// opened, changed or closed meanwhile. `now` is `CLOCK_MONOTONIC`.
    ///
    /// # Errors
    /// The directory or the files cannot be created.
    pub fn prepare(
        dir: &Path,
        tables: &mut [ConnTable],
        affinity_capacity: usize,
        now: u64,
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
        let ahead = read_ahead(dir, id, tables, now);
        write_journals(tables, &conntrack);
        Ok(PreparedFiles {
            id,
            conntrack,
            affinity_file: file,
            affinity,
            ahead,
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
            ahead,
        } = prepared;
        let mut r = Restored::default();
        let mut lap = std::time::Instant::now();
        let mut took = |i: usize, r: &mut Restored| {
            r.took[i] = lap.elapsed();
            lap = std::time::Instant::now();
        };
        catch_up(&sd, id, ahead, tables, now, &mut r);
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
    ahead: ReadAhead,
}

/// What a state file is valid for: this boot, this network namespace.
#[derive(Debug, Clone, Copy)]
struct FileId {
    boot: [u8; 16],
    netns: u64,
}

/// The previous process's connection tables as read ahead (see [`Persistence::prepare`]):
/// each file still mapped, with what each of its records was and became, and the
/// counts of [`Restored`] for them.
#[derive(Debug, Default)]
struct ReadAhead {
    files: Vec<AheadFile>,
    /// Files found but not usable (said in `counts`), not read again.
    unusable: Vec<std::path::PathBuf>,
    counts: Restored,
}

#[derive(Debug)]
struct AheadFile {
    path: std::path::PathBuf,
    old: OldFile,
    /// The first word (sequence and checksum) of every record as read; 0: empty.
    seqs: Vec<u64>,
    /// What each record read became.
    placed: std::collections::HashMap<usize, Placed, foldhash::fast::RandomState>,
}

/// What a record read became.
#[derive(Debug, Clone, Copy)]
enum Placed {
    /// A flow, restored into table `.0` (its original tuple `.1`).
    Flow(usize, Tuple),
    /// A flow not restored: split across workers, clashing, or no room.
    Dropped,
    /// Torn, corrupt or invalid.
    Bad,
}

/// A previous file of `kind` at `path` (`what` it is, for the reason it is not used,
/// in `r`).
fn read_old(path: &Path, id: FileId, kind: Kind, what: &str, r: &mut Restored) -> Option<OldFile> {
    match OldFile::read(path, id.boot, id.netns) {
        Ok(Some(f)) if f.header.kind == kind => Some(f),
        Ok(Some(_)) => {
            r.bad_files.push(format!("{}: not {what}", path.display()));
            None
        }
        Ok(None) => None,
        Err(e) => {
            r.bad_files.push(format!("{}: {e}", path.display()));
            None
        }
    }
}

/// A previous connection-table file at `path`, if it is one.
fn read_conntrack(path: &Path, id: FileId, r: &mut Restored) -> Option<OldFile> {
    read_old(path, id, Kind::Conntrack, "a connection table", r)
}

/// Puts what a record holds into `tables` (its flow to the worker that owns both its
/// directions); what it became, `None` for an empty or cleared record.
fn place(
    rec: Option<Result<[u64; RECORD_WORDS - 1], StateError>>,
    tables: &mut [ConnTable],
    now: u64,
) -> Option<Placed> {
    let Ok(f) = rec?.and_then(|p| FlowRecord::decode(&p)) else {
        return Some(Placed::Bad);
    };
    let workers = tables.len();
    let a = flow_owner(f.orig.src, f.orig.sport, workers);
    let b = flow_owner(f.reply.dst, f.reply.dport, workers);
    if a != b || tables[a].restore(&f, now).is_err() {
        return Some(Placed::Dropped);
    }
    Some(Placed::Flow(a, f.orig))
}

/// Counts `p` in `r` (`add`) or out of it.
fn count(r: &mut Restored, p: Placed, add: bool) {
    let n = match p {
        Placed::Flow(..) => &mut r.flows,
        Placed::Dropped => &mut r.flows_dropped,
        Placed::Bad => &mut r.bad_records,
    };
    *n = if add { *n + 1 } else { n.saturating_sub(1) };
}

/// Takes out of `tables` what a record had become (and out of the counts).
fn unplace(tables: &mut [ConnTable], p: Placed, r: &mut Restored) {
    if let Placed::Flow(t, orig) = p {
        tables[t].remove(&orig);
    }
    count(r, p, false);
}

/// Reads a whole previous file into `tables`.
fn read_file(
    path: std::path::PathBuf,
    old: OldFile,
    tables: &mut [ConnTable],
    now: u64,
    r: &mut Restored,
) -> AheadFile {
    let mut seqs = vec![0u64; old.header.records as usize];
    let mut placed = std::collections::HashMap::default();
    for (i, seq) in old.slots() {
        seqs[i] = seq;
        if seq == 0 {
            continue;
        }
        if let Some(p) = place(old.record(i), tables, now) {
            count(r, p, true);
            placed.insert(i, p);
        }
    }
    AheadFile {
        path,
        old,
        seqs,
        placed,
    }
}

/// The previous process's connection tables (in state directory `dir`, not locked: it
/// may be running), read into `tables`.
fn read_ahead(dir: &Path, id: FileId, tables: &mut [ConnTable], now: u64) -> ReadAhead {
    let started = std::time::Instant::now();
    let mut ahead = ReadAhead::default();
    for (_, path) in conntrack_files_in(dir) {
        match read_conntrack(&path, id, &mut ahead.counts) {
            Some(old) => {
                let f = read_file(path, old, tables, now, &mut ahead.counts);
                ahead.files.push(f);
            }
            None => ahead.unusable.push(path),
        }
    }
    ahead.counts.read_ahead = started.elapsed();
    ahead
}

/// Brings `tables` (holding what was read ahead) to what the previous process's files
/// hold now that this one has the lock (that process no longer writes them): the records
/// whose first word changed are read again (their previous flow taken out first, so a
/// flow that moved to another slot is not taken for a clash), a file removed or replaced
/// since has its flows taken out (and the new one, as any file not read ahead, is read
/// whole). The counts go to `r`.
fn catch_up(
    sd: &StateDir,
    id: FileId,
    ahead: ReadAhead,
    tables: &mut [ConnTable],
    now: u64,
    r: &mut Restored,
) {
    let ReadAhead {
        files,
        unusable,
        counts,
    } = ahead;
    *r = counts;
    let mut read: std::collections::HashSet<std::path::PathBuf> = unusable.into_iter().collect();
    for mut f in files {
        let Some(old) = f.old.refreshed(&f.path) else {
            for (_, p) in f.placed.drain() {
                unplace(tables, p, r);
            }
            continue;
        };
        let changed: Vec<usize> = old
            .slots()
            .filter(|&(i, seq)| seq != f.seqs[i])
            .map(|(i, _)| i)
            .collect();
        r.caught_up += changed.len();
        for &i in &changed {
            if let Some(p) = f.placed.remove(&i) {
                unplace(tables, p, r);
            }
        }
        for &i in &changed {
            if let Some(p) = place(old.record(i), tables, now) {
                count(r, p, true);
            }
        }
        read.insert(f.path);
    }
    for (_, path) in sd.conntrack_files() {
        if !read.contains(&path)
            && let Some(old) = read_conntrack(&path, id, r)
        {
            read_file(path, old, tables, now, r);
        }
    }
}

/// Writes what the tables' journals hold into `files` (worker by worker).
fn write_journals(tables: &mut [ConnTable], files: &[StateFile]) {
    for (t, f) in tables.iter_mut().zip(files) {
        t.drain_journal(|slot, rec| {
            f.write(
                slot,
                &rec.map_or(conntrack::persist::CLEARED, |r| r.encode()),
            );
        });
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
    write_journals(tables, &files);
    let mut out = Vec::with_capacity(workers);
    for f in files {
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
    let old = read_old(&path, id, Kind::Affinity, "an affinity table", r);
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

    /// Answered flows `ids` (`flow(i)`) put into `ts` as a worker would, journaled to
    /// `files`.
    fn open_answered(
        ts: &mut [ConnTable],
        files: &[StateFile],
        ids: impl Iterator<Item = u16>,
        now: u64,
    ) {
        for i in ids {
            let (o, r) = flow(i);
            let w = flow_owner(o.src, o.sport, ts.len());
            ts[w].insert(o, r, 1, SYN, now).unwrap();
            ts[w].on_packet(&r, SYN | ACK, now);
        }
        write_journals(ts, files);
    }

    /// The flows `ts` hold, by original tuple, with their reply tuples.
    fn held(ts: &[ConnTable], now: u64) -> std::collections::BTreeMap<String, String> {
        ts.iter()
            .flat_map(|t| t.iter(now))
            .map(|e| (format!("{:?}", e.orig()), format!("{:?}", e.reply())))
            .collect()
    }

    /// A kxp taking over from a running one reads its flows ahead, while that one goes on
    /// opening, closing and moving flows; at the lock it reads again only the records
    /// that changed, and ends holding what the running one held last, exactly as if it
    /// had read the files whole then. A file removed after the read ahead takes its
    /// flows with it.
    #[test]
    fn flows_read_ahead_catch_up_with_the_running_process() {
        let dir = std::env::temp_dir().join(format!("kxp-ahead-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let now = 100 * S;
        let mut old = tables(2);
        let (p, _aff) = Persistence::start(&dir, &mut old, 1024, now).unwrap();
        let files: Vec<StateFile> = p.conntrack.into_iter().map(Option::unwrap).collect();
        open_answered(&mut old, &files, 0..60, now);

        // The successor reads ahead while the running kxp holds the lock.
        let mut next = tables(2);
        let prepared = Persistence::prepare(&dir, &mut next, 1024, now + S).unwrap();
        assert_eq!(held(&next, now + S), held(&old, now + S));
        // The running kxp goes on: closes 20 flows, opens 30 (some in the slots freed),
        // and one flow's record is rewritten (its state changes).
        for i in 0..20 {
            let (o, _) = flow(i);
            let w = flow_owner(o.src, o.sport, 2);
            assert!(old[w].remove(&o));
        }
        open_answered(&mut old, &files, 100..130, now + S);
        let (o, _) = flow(30);
        let w = flow_owner(o.src, o.sport, 2);
        old[w].on_packet(&o, conntrack::tcp::flags::FIN | ACK, now + S);
        write_journals(&mut old, &files);
        let want = held(&old, now + 2 * S);
        assert_eq!(want.len(), 70);
        drop(files);
        drop(p.dir);

        let sd = Persistence::lock(&dir).unwrap();
        let (p2, _) = Persistence::start_prepared(sd, prepared, &mut next, now + 2 * S).unwrap();
        assert_eq!(held(&next, now + 2 * S), want);
        let r = &p2.restored;
        assert_eq!(
            (r.flows, r.flows_dropped, r.bad_records),
            (70, 0, 0),
            "{r:?}"
        );
        // The slots of the 30 flows opened (some freed by the 20 closed) and of the one
        // changed.
        assert!((31..=51).contains(&r.caught_up), "{r:?}");
        drop(p2);

        // Whole, from the files it wrote: the same flows.
        let mut whole = tables(2);
        let (p3, _) = Persistence::start(&dir, &mut whole, 1024, now + 3 * S).unwrap();
        assert_eq!(held(&whole, now + 3 * S), want);
        assert_eq!(p3.restored.caught_up, 0);

        // Read ahead, then the files go (a `kxp cleanup` meanwhile): nothing is kept.
        let mut after = tables(2);
        let prepared = Persistence::prepare(&dir, &mut after, 1024, now + 3 * S).unwrap();
        assert_eq!(held(&after, now + 3 * S).len(), 70);
        drop(p3);
        for (_, path) in conntrack_files_in(&dir) {
            std::fs::remove_file(path).unwrap();
        }
        let sd = Persistence::lock(&dir).unwrap();
        let (p4, _) = Persistence::start_prepared(sd, prepared, &mut after, now + 3 * S).unwrap();
        assert!(held(&after, now + 3 * S).is_empty());
        assert_eq!(p4.restored.flows, 0, "{:?}", p4.restored);
        drop(p4);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
