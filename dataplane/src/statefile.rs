//! kxp's state files on disk (format: [`conntrack::persist`]): what lets a restarted or
//! upgraded kxp carry on every connection where the previous process left it.
//!
//! A directory (`/run/kxp` by default: tmpfs, gone at reboot, which is right since the
//! times in it are `CLOCK_MONOTONIC`) holds one file per worker's connection table and
//! one for the node's affinity table, and a `lock` file. The running process holds an
//! exclusive lock on `lock` (released by the kernel however the process ends) and maps
//! its files shared; every change is stored into the mapping as it happens, so a process
//! killed with SIGKILL leaves everything up to its last change, with at most the record
//! it was writing torn (and then discarded by the next reader).
//!
//! Start-up reads the previous files with plain reads, restores what is valid, writes it
//! into new files (`NAME.PID.new`) and renames them over the old ones, so a crash during
//! start-up leaves either the old files or complete new ones.
//!
//! The only unsafe code is the mapping itself, seen as a slice of `AtomicU64`: every
//! access is an atomic load or store, so a concurrent writer (another process, or two
//! workers on the affinity file's different shards) cannot make it undefined behaviour.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use conntrack::persist::{self, HEADER_WORDS, Header, RECORD_WORDS, StateError};

/// The state directory, locked for this process.
#[derive(Debug)]
pub struct StateDir {
    pub path: PathBuf,
    _lock: File,
}

impl StateDir {
    /// Creates `path` (mode 0700) if needed and takes its lock, waiting up to `wait` for
    /// a previous kxp that is still stopping.
    ///
    /// # Errors
    /// The directory cannot be created, or another process holds it after `wait`.
    pub fn lock(path: &Path, wait: std::time::Duration) -> io::Result<StateDir> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path.join("lock"))?;
        let deadline = std::time::Instant::now() + wait;
        loop {
            match lock.try_lock() {
                Ok(()) => break,
                Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WouldBlock,
                        format!(
                            "another kxp holds {} (its state directory); stop it, or give this one \
                             another --state-dir",
                            path.display()
                        ),
                    ));
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(e),
            }
        }
        Ok(StateDir {
            path: path.to_path_buf(),
            _lock: lock,
        })
    }

    /// The file of worker `i`'s connection table.
    pub fn conntrack(&self, worker: usize) -> PathBuf {
        conntrack_path(&self.path, worker)
    }

    /// The node's affinity table file.
    pub fn affinity(&self) -> PathBuf {
        affinity_path(&self.path)
    }

    /// Connection-table files present, by worker number.
    pub fn conntrack_files(&self) -> Vec<(usize, PathBuf)> {
        conntrack_files_in(&self.path)
    }
}

/// The connection-table files in state directory `dir` (locked or not), by worker.
pub fn conntrack_files_in(dir: &Path) -> Vec<(usize, PathBuf)> {
    let Ok(dir) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<(usize, PathBuf)> = dir
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = name.strip_prefix("conntrack-")?.strip_suffix(".state")?;
            Some((n.parse().ok()?, e.path()))
        })
        .collect();
    v.sort();
    v
}

/// The file of worker `i`'s connection table in state directory `dir`.
pub fn conntrack_path(dir: &Path, worker: usize) -> PathBuf {
    dir.join(format!("conntrack-{worker}.state"))
}

/// The node's affinity table file in state directory `dir`.
pub fn affinity_path(dir: &Path) -> PathBuf {
    dir.join("affinity.state")
}

/// Removes the new files (`NAME.PID.new`) that a kxp which is no longer running left in
/// `dir` (it died between creating them and making them the directory's), and those of
/// the format before the PID (`NAME.new`). Called by the lock's holder.
pub fn remove_stale_temps(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let me = std::process::id();
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".new") else {
            continue;
        };
        let pid = stem.rsplit('.').next().and_then(|p| p.parse::<u32>().ok());
        let alive =
            pid.is_some_and(|p| p == me || std::path::Path::new(&format!("/proc/{p}")).exists());
        if !alive {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

pub use crate::sys::netns_suffix;

/// `/run/kxp` on the host, `/run/kxp/netns-COOKIE` in another network namespace.
pub fn default_state_dir() -> PathBuf {
    let base = PathBuf::from("/run/kxp");
    match netns_suffix() {
        Some(s) => base.join(s),
        None => base,
    }
}

/// Removes the state directories of other network namespaces under `/run/kxp` that no
/// kxp holds and that nothing has written for `max_age`: the namespace is gone (a test's,
/// a deleted pod's), or its kxp has been stopped so long that its connections are over.
/// Returns how many were removed.
pub fn remove_stale_dirs(max_age: std::time::Duration) -> usize {
    let Ok(entries) = std::fs::read_dir("/run/kxp") else {
        return 0;
    };
    let mine = default_state_dir();
    let mut n = 0;
    for e in entries.filter_map(Result::ok) {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("netns-") || path == mine || !path.is_dir() {
            continue;
        }
        let newest = std::fs::read_dir(&path)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .filter_map(|f| f.metadata().ok()?.modified().ok())
            .max();
        let old = newest.is_none_or(|t| t.elapsed().is_ok_and(|a| a > max_age));
        if old && let Ok(held) = StateDir::lock(&path, std::time::Duration::ZERO) {
            remove_state(&held.path);
            drop(held);
            let _ = std::fs::remove_dir(&path);
            n += 1;
        }
    }
    n
}

/// The kernel's boot id (`/proc/sys/kernel/random/boot_id`), 16 bytes.
///
/// # Errors
/// The file cannot be read or parsed.
pub fn boot_id() -> io::Result<[u8; 16]> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    let hex: String = text.trim().chars().filter(|c| *c != '-').collect();
    let mut id = [0u8; 16];
    if hex.len() != 32 {
        return Err(io::Error::other(format!("boot_id {text:?}")));
    }
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
            .map_err(|_| io::Error::other(format!("boot_id {text:?}")))?;
    }
    Ok(id)
}

/// A previous process's file, mapped read-only: its header and its records (a sparse
/// file of mostly empty records costs only the pages that hold something).
#[derive(Debug)]
pub struct OldFile {
    pub header: Header,
    file: File,
    map: Mapping,
    /// The file's byte ranges that hold data (the rest are holes: records never written).
    data: Vec<(usize, usize)>,
}

/// The byte ranges of `file` (of `len` bytes) that are not holes (`SEEK_DATA` and
/// `SEEK_HOLE`): a state file is created sparse and only the pages of records written
/// are allocated, so a table of a few thousand flows in a file of 262,144 slots is read
/// in the pages that hold them instead of a load from every slot (tens of milliseconds
/// of a restart). The whole file where the filesystem cannot tell.
fn data_ranges(file: &File, len: usize) -> Vec<(usize, usize)> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let mut ranges = Vec::new();
    let mut at = 0usize;
    while at < len {
        // SAFETY: lseek on a descriptor `file` keeps open; no memory is passed.
        let start = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        if start < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                break; // No data past `at`.
            }
            return vec![(0, len)];
        }
        // SAFETY: as above.
        let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
        if end <= start {
            return vec![(0, len)];
        }
        ranges.push((start as usize, (end as usize).min(len)));
        at = end as usize;
    }
    ranges
}

impl OldFile {
    /// Maps `path`; `Ok(None)` if there is none.
    ///
    /// # Errors
    /// The file exists but cannot be read, or is not a usable state file (the caller
    /// logs it and starts clean).
    pub fn read(path: &Path, boot_id: [u8; 16], netns: u64) -> Result<Option<OldFile>, String> {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        let len = file.metadata().map_err(|e| e.to_string())?.len() as usize;
        if len < HEADER_WORDS * 8 {
            return Err(StateError::Truncated {
                have: len,
                need: HEADER_WORDS * 8,
            }
            .to_string());
        }
        let map = Mapping::new(&file, len & !7, false).map_err(|e| e.to_string())?;
        let head: Vec<u64> = map.words()[..HEADER_WORDS]
            .iter()
            .map(|w| w.load(Ordering::Relaxed))
            .collect();
        let header = Header::decode(&head, boot_id, netns).map_err(|e| e.to_string())?;
        if len < header.file_len() {
            return Err(StateError::Truncated {
                have: len,
                need: header.file_len(),
            }
            .to_string());
        }
        let data = data_ranges(&file, len);
        Ok(Some(OldFile {
            header,
            file,
            map,
            data,
        }))
    }

    /// Every record: its payload if whole, `Err` if torn or corrupt, skipping empty ones.
    pub fn records(
        &self,
    ) -> impl Iterator<Item = Result<[u64; RECORD_WORDS - 1], StateError>> + '_ {
        self.slots()
            // Slots in a page with data that were never written: one load to skip each.
            .filter(|&(_, seq)| seq != 0)
            .filter_map(|(i, _)| self.record(i))
    }

    /// The index and first word (its sequence, 0 if never written) of every record in
    /// the pages that held data when the file was read or last [`OldFile::refreshed`].
    pub fn slots(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        let words = self.map.words();
        let records = self.header.records as usize;
        // The records that overlap a range with data (in whole records).
        self.data
            .iter()
            .flat_map(move |&(start, end)| {
                let first = (start / 8).saturating_sub(HEADER_WORDS) / RECORD_WORDS;
                let last = (end / 8)
                    .saturating_sub(HEADER_WORDS)
                    .div_ceil(RECORD_WORDS);
                first..last.min(records)
            })
            .map(move |i| {
                (
                    i,
                    words[HEADER_WORDS + i * RECORD_WORDS].load(Ordering::Acquire),
                )
            })
    }

    /// Record `index`: its payload if whole, `Err` if torn or corrupt, `None` if empty,
    /// cleared or out of range.
    pub fn record(&self, index: usize) -> Option<Result<[u64; RECORD_WORDS - 1], StateError>> {
        if index >= self.header.records as usize {
            return None;
        }
        let at = HEADER_WORDS + index * RECORD_WORDS;
        let r = &self.map.words()[at..at + RECORD_WORDS];
        let mut rec = [0u64; RECORD_WORDS];
        for (d, w) in rec.iter_mut().zip(r) {
            *d = w.load(Ordering::Acquire);
        }
        persist::open_record(&rec)
            .map(|p| {
                p.map(|p| {
                    let mut out = [0u64; RECORD_WORDS - 1];
                    out.copy_from_slice(p);
                    out
                })
            })
            .transpose()
    }

    /// The file as mapped now, its pages with data looked up again (the process that
    /// writes it may have filled holes since): `None` when the path no longer names the
    /// file that was read (removed, or replaced by another process's).
    pub fn refreshed(mut self, path: &Path) -> Option<OldFile> {
        use std::os::unix::fs::MetadataExt;
        let now = std::fs::metadata(path).ok()?;
        let was = self.file.metadata().ok()?;
        if (now.dev(), now.ino()) != (was.dev(), was.ino()) {
            return None;
        }
        self.data = data_ranges(&self.file, self.map.words.saturating_mul(8));
        Some(self)
    }
}

/// A shared mapping of a whole file, seen as `AtomicU64`s.
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<AtomicU64>,
    words: usize,
}

// SAFETY: a `Mapping` is the sole owner of its mapping (made in `new`, unmapped once in
// `drop`), which belongs to the process, not to a thread: it may be used and unmapped
// from any thread.
unsafe impl Send for Mapping {}
// SAFETY: `&Mapping` gives only `&[AtomicU64]` (`words`), which is `Sync`: threads
// sharing it can only load and store atomically.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes (a multiple of 8) of `file`, read-write or read-only.
    fn new(file: &File, len: usize, writable: bool) -> io::Result<Mapping> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: with a NULL address and no MAP_FIXED, `mmap` only adds a mapping where
        // the kernel finds room, so it cannot replace memory in use; `file` is an open
        // descriptor for the call, opened for reading (and writing when `writable`, as
        // MAP_SHARED with PROT_WRITE needs); offset 0 is page-aligned; failure
        // (MAP_FAILED, e.g. for `len` 0) is checked below. The mapping outlives `file`
        // being closed, until `munmap` in `drop`.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<AtomicU64>()).ok_or_else(io::Error::last_os_error)?;
        Ok(Mapping {
            ptr,
            words: len / 8,
        })
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: `from_raw_parts` requires `ptr` non-null (`NonNull`) and aligned for
        // `AtomicU64` (an mmap address is page-aligned); valid for reads of `words * 8`
        // bytes in one allocation, for the borrow of `self`: the one mapping made in
        // `new`, of exactly that many bytes (`len` is a multiple of 8 at both callers),
        // unmapped only in `drop`, which cannot run while `self` is borrowed, and no
        // larger than the file (`create` sizes it first; `OldFile::read` maps at most
        // its length; the state directory is this process's, locked, so nothing
        // shrinks a file while mapped); initialised (file bytes, any u64 valid);
        // `words * 8` <= isize::MAX (a successful mapping); and no mutation except
        // through `UnsafeCell`: `AtomicU64` is one, and every access is atomic. A
        // read-only mapping (`OldFile`) only gets 8-byte `Relaxed` loads, which std
        // documents as allowed on read-only memory on 64-bit targets.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.words) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `munmap` is given exactly the mapping made in `new`: its page-aligned
        // start and its length (`words * 8` == `len`, a multiple of 8). Nothing uses it
        // afterwards: every `words()` slice borrows `self`, so none outlives this
        // `&mut self`, and `ptr` is not used again.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.words * 8) };
    }
}

/// A state file mapped for writing.
#[derive(Debug)]
pub struct StateFile {
    map: Mapping,
    records: usize,
    tmp: PathBuf,
    path: PathBuf,
    _file: File,
}

impl StateFile {
    /// Creates `PATH.PID.new` for `header` (all records empty) and maps it; [`commit`]
    /// renames it to `path` once it holds what it must.
    ///
    /// [`commit`]: StateFile::commit
    ///
    /// # Errors
    /// The file cannot be created, sized or mapped.
    pub fn create(path: &Path, header: &Header) -> io::Result<StateFile> {
        // A name of this process's own: a kxp starting beside a running one (a hand-over)
        // creates its files before it holds the directory's lock.
        let tmp = path.with_extension(format!("{}.new", std::process::id()));
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&tmp)?;
        let len = header.file_len();
        file.set_len(len as u64)?;
        let f = StateFile {
            map: Mapping::new(&file, len, true)?,
            records: header.records as usize,
            tmp,
            path: path.to_path_buf(),
            _file: file,
        };
        for (i, w) in header.encode().into_iter().enumerate() {
            f.words()[i].store(w, Ordering::Relaxed);
        }
        Ok(f)
    }

    fn words(&self) -> &[AtomicU64] {
        self.map.words()
    }

    /// Records the file holds.
    pub fn records(&self) -> usize {
        self.records
    }

    /// Writes record `index` (ignored if out of range): odd sequence, payload, then the
    /// sealed even sequence (see [`conntrack::persist`]).
    pub fn write(&self, index: usize, payload: &[u64; RECORD_WORDS - 1]) {
        if index >= self.records {
            return;
        }
        let at = HEADER_WORDS + index * RECORD_WORDS;
        let rec = &self.words()[at..at + RECORD_WORDS];
        let seq = (rec[0].load(Ordering::Relaxed) as u32) | 1;
        rec[0].store(u64::from(seq), Ordering::Relaxed);
        fence(Ordering::Release);
        for (w, v) in rec[1..].iter().zip(payload) {
            w.store(*v, Ordering::Relaxed);
        }
        rec[0].store(
            persist::seal(seq.wrapping_add(1).max(2), payload),
            Ordering::Release,
        );
    }

    /// The path the file is made at by [`StateFile::commit`].
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes this file the one at its path (replacing the previous process's).
    ///
    /// # Errors
    /// The rename failed.
    pub fn commit(&self) -> io::Result<()> {
        std::fs::rename(&self.tmp, &self.path)
    }
}

/// The node's affinity table writes through this (one record per entry).
impl conntrack::affinity::AffinitySink for StateFile {
    fn put(&self, index: usize, entry: Option<&conntrack::persist::AffinityRecord>) {
        self.write(index, &entry.map_or(persist::CLEARED, |e| e.encode()));
    }
}

/// Removes kxp's state files (and the directory, if nothing else is in it), and the pins
/// of the programs it left for the next kxp in that namespace (see [`crate::xdp::pins`]).
pub fn remove_state(dir: &std::path::Path) {
    if let Some(pins) = crate::xdp::pins::dir_for_state(dir) {
        crate::xdp::pins::remove_dir(&pins);
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.filter_map(Result::ok) {
            let name = e.file_name().to_string_lossy().into_owned();
            if name == "lock"
                || name == "kxp.sock"
                || name.ends_with(".state")
                || name.ends_with(".new")
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

#[cfg(test)]
mod tests {
    use super::*;
    use conntrack::persist::{FlowRecord, Kind};

    #[test]
    fn written_records_are_read_back_by_the_next_process_and_the_lock_is_exclusive() {
        let dir = std::env::temp_dir().join(format!("kxp-statefile-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let sd = StateDir::lock(&dir, std::time::Duration::ZERO).unwrap();
        let again = StateDir::lock(&dir, std::time::Duration::from_millis(50));
        assert!(again.is_err(), "a second holder must be refused");
        assert!(again.unwrap_err().to_string().contains("another kxp"));
        let boot = boot_id().unwrap();
        let h = Header {
            kind: Kind::Conntrack,
            records: 8,
            worker: 0,
            workers: 1,
            boot_id: boot,
            seed: 0,
            netns: 5,
        };
        let f = StateFile::create(&sd.conntrack(0), &h).unwrap();
        let r = FlowRecord {
            orig: nat::Tuple::new(
                "198.18.1.2:1".parse().unwrap(),
                "198.19.0.10:80".parse().unwrap(),
                nat::Protocol::Tcp,
            ),
            reply: nat::Tuple::new(
                "198.18.2.2:8080".parse().unwrap(),
                "198.18.1.2:1".parse().unwrap(),
                nat::Protocol::Tcp,
            ),
            tag: 0,
            created: 1,
            expires: 2,
            tcp: conntrack::TcpState::Established,
            seen_reply: true,
            assured: true,
            counted: false,
        };
        f.write(3, &r.encode());
        f.write(5, &r.encode());
        f.write(5, &persist::CLEARED);
        f.write(99, &r.encode()); // out of range: ignored
        f.commit().unwrap();
        assert_eq!(sd.conntrack_files(), vec![(0, sd.conntrack(0))]);
        let old = OldFile::read(&sd.conntrack(0), boot, 5).unwrap().unwrap();
        assert_eq!(old.header, h);
        let got: Vec<_> = old.records().collect();
        assert_eq!(got.len(), 1);
        assert_eq!(FlowRecord::decode(&got[0].clone().unwrap()), Ok(r));
        // Another boot's file is refused, with a reason.
        let e = OldFile::read(&sd.conntrack(0), [9; 16], 5).unwrap_err();
        assert!(e.contains("reboot"), "{e}");
        let e = OldFile::read(&sd.conntrack(0), boot, 6).unwrap_err();
        assert!(e.contains("namespace"), "{e}");
        assert!(OldFile::read(&dir.join("none"), boot, 5).unwrap().is_none());
        std::fs::write(dir.join("junk.state"), b"hello").unwrap();
        assert!(OldFile::read(&dir.join("junk.state"), boot, 5).is_err());
        drop(f);
        drop(sd);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A large file with a few records scattered over it (holes between them) is read
    /// back whole: every record written, wherever it is, none twice.
    #[test]
    fn records_scattered_over_a_sparse_file_are_all_read_back() {
        let dir = std::env::temp_dir().join(format!("kxp-sparse-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let sd = StateDir::lock(&dir, std::time::Duration::ZERO).unwrap();
        let boot = boot_id().unwrap();
        let h = Header {
            kind: Kind::Affinity,
            records: 100_000,
            worker: 0,
            workers: 1,
            boot_id: boot,
            seed: 0,
            netns: 5,
        };
        let f = StateFile::create(&sd.affinity(), &h).unwrap();
        let slots = [0usize, 1, 31, 32, 5_000, 50_000, 50_001, 99_999];
        for (n, &i) in slots.iter().enumerate() {
            let mut payload = [0u64; RECORD_WORDS - 1];
            payload[0] = n as u64 + 1;
            payload[1] = i as u64;
            f.write(i, &payload);
        }
        f.commit().unwrap();
        let old = OldFile::read(&sd.affinity(), boot, 5).unwrap().unwrap();
        let mut got: Vec<u64> = old.records().map(|r| r.unwrap()[1]).collect();
        got.sort_unstable();
        assert_eq!(got, slots.map(|i| i as u64).to_vec());
        drop(f);
        drop(sd);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// New files a dead kxp left are removed by the lock's holder; a live process's
    /// (this one's) stay.
    #[test]
    fn new_files_of_processes_gone_are_removed() {
        let dir = std::env::temp_dir().join(format!("kxp-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ours = format!("conntrack-0.{}.new", std::process::id());
        for name in [
            "conntrack-0.4000000000.new",
            "affinity.new",
            ours.as_str(),
            "conntrack-0.state",
        ] {
            std::fs::write(dir.join(name), b"x").unwrap();
        }
        remove_stale_temps(&dir);
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, vec![ours, "conntrack-0.state".to_string()]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
