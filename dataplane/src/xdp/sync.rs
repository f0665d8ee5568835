//! Incremental mirroring of a wanted key set into a BPF map: the kernel sees only
//! the difference from what was installed last, so one Service changing among 10k costs
//! a handful of syscalls, not a rewrite.

use std::collections::HashSet;
use std::fmt;
use std::hash::{BuildHasher, Hash};

use std::os::fd::{AsFd, AsRawFd};

use libbpf_rs::{ErrorKind, MapCore, MapFlags, MapHandle, MapType};

use super::XdpError;

/// What one `sync_*` call changed in the kernel map.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncStats {
    /// Keys inserted.
    pub added: usize,
    /// Stale keys deleted.
    pub removed: usize,
    /// Keys already present and left alone.
    pub unchanged: usize,
}

/// A key as stored in one of the program's maps.
pub(super) trait MapKey: Eq + Hash + Clone + fmt::Display + Sync {
    type Bytes: AsRef<[u8]>;
    fn to_bytes(&self) -> Self::Bytes;
}

/// A set of keys as the sets are kept (foldhash, seeded at random: SipHash was a tenth of
/// a first programming at 100,000 Services).
pub type KeySet<K> = HashSet<K, foldhash::fast::RandomState>;

/// A BPF hash map or LPM trie (values: one byte, 1) and the key set this process
/// installed in it.
#[derive(Debug)]
pub(super) struct SyncedMap<K> {
    map: MapHandle,
    name: &'static str,
    installed: KeySet<K>,
    /// A set that grows with the cluster: the one-slot array of maps the program reads
    /// it through (`map` is the inner map in its slot), and the inner map's key size.
    outer: Option<(MapHandle, u32)>,
    /// Taken up from a previous kxp (see [`Self::fixed`]): the keys it left (as bytes),
    /// which the first [`Self::sync`] removes where no longer wanted.
    previous: Option<Vec<Vec<u8>>>,
}

/// The first size of a growing set's inner map; it doubles past what is needed when it
/// must grow (a hash map without preallocation costs memory per entry, plus a bucket per
/// slot of its size).
pub const INITIAL_SET: u32 = 4096;

/// Keys per batched update when a set is filled.
const BATCH: usize = 4096;

/// Why a growing set is made anew (see [`SyncedMap::grow`]).
#[derive(Debug, Clone, Copy)]
enum Grow {
    /// Its keys no longer fit.
    Full,
    /// Taken up from a previous kxp: what it holds is not known.
    TakenUp,
}

impl<K: MapKey> SyncedMap<K> {
    /// A set of fixed size. `taken_up`: a previous kxp filled it (its program taken up):
    /// its keys are read now, and the first [`Self::sync`] deletes those no longer
    /// wanted.
    pub(super) fn fixed(map: MapHandle, name: &'static str, taken_up: bool) -> Self {
        let previous = taken_up.then(|| map.keys().collect());
        SyncedMap {
            map,
            name,
            installed: KeySet::default(),
            outer: None,
            previous,
        }
    }

    /// A set that grows with the cluster, read by the program through `outer` (a
    /// one-slot array of maps): an empty inner map of [`INITIAL_SET`] entries is made
    /// and put in its slot. `taken_up`: a previous kxp filled the map in that slot, which
    /// the program reads until the first [`Self::sync`] fills a new one and swaps it in.
    ///
    /// # Errors
    /// The map cannot be made or put in the slot.
    pub(super) fn growing(
        outer: MapHandle,
        name: &'static str,
        key_size: u32,
        taken_up: bool,
    ) -> Result<Self, XdpError> {
        let map = new_set(name, key_size, INITIAL_SET)?;
        if !taken_up {
            swap_in(&outer, &map, name)?;
        }
        Ok(SyncedMap {
            map,
            name,
            installed: KeySet::default(),
            outer: Some((outer, key_size)),
            previous: taken_up.then(Vec::new),
        })
    }

    /// The map to pin for the next kxp: a growing set's one-slot array, else the map.
    pub(super) fn pinnable(&self) -> (&'static str, std::os::fd::BorrowedFd<'_>) {
        match &self.outer {
            Some((outer, _)) => (self.name, outer.as_fd()),
            None => (self.name, self.map.as_fd()),
        }
    }

    /// How many keys the map holds now, and how many it can hold before it must grow
    /// (or, for a set of fixed size, at all).
    pub(super) fn fill(&self) -> (usize, usize) {
        (self.installed.len(), self.map.max_entries() as usize)
    }

    /// The keys this process installed (and did not remove).
    pub(super) fn installed(&self) -> &KeySet<K> {
        &self.installed
    }

    #[cfg(test)]
    pub(super) fn map(&self) -> &MapHandle {
        &self.map
    }

    /// Makes the map hold exactly `want`: deletes stale keys first (so a full map can
    /// take replacements), then inserts missing ones.
    ///
    /// # Errors
    /// [`XdpError::MapFull`] before touching the map if `want` cannot fit;
    /// [`XdpError::Map`] if a syscall fails. What was done before the failure stays
    /// recorded, so the next call retries only what is still missing.
    pub(super) fn sync<S: BuildHasher>(
        &mut self,
        want: &HashSet<K, S>,
    ) -> Result<SyncStats, XdpError> {
        let capacity = self.map.max_entries() as usize;
        if let Some(previous) = self.previous.take() {
            if self.outer.is_some() {
                // A new map, filled and swapped in whole.
                return self
                    .grow(want.iter().cloned().collect(), Grow::TakenUp)
                    .inspect_err(|_| {
                        self.previous = Some(previous);
                    });
            }
            if want.len() <= capacity {
                // Room first: the previous kxp's keys no longer wanted go (every wanted
                // key is written below, as nothing is recorded as installed yet).
                let wanted: HashSet<Vec<u8>> = want
                    .iter()
                    .map(|k| k.to_bytes().as_ref().to_vec())
                    .collect();
                for raw in previous.iter().filter(|r| !wanted.contains(*r)) {
                    let _ = self.map.delete(raw);
                }
            } else {
                self.previous = Some(previous);
            }
        }
        if want.len() > capacity && self.outer.is_some() {
            return self.grow(want.iter().cloned().collect(), Grow::Full);
        }
        if want.len() > capacity {
            return Err(XdpError::MapFull {
                map: self.name,
                capacity,
                wanted: want.len(),
            });
        }
        let stale: Vec<K> = self
            .installed
            .iter()
            .filter(|k| !want.contains(*k))
            .cloned()
            .collect();
        let missing: Vec<K> = want
            .iter()
            .filter(|k| !self.installed.contains(*k))
            .cloned()
            .collect();
        let mut stats = SyncStats {
            unchanged: self.installed.len() - stale.len(),
            ..SyncStats::default()
        };
        for key in stale {
            match self.map.delete(key.to_bytes().as_ref()) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(source) => return Err(self.map_error("delete", &key, source)),
            }
            self.installed.remove(&key);
            stats.removed += 1;
        }
        for key in missing {
            if let Err(source) = self
                .map
                .update(key.to_bytes().as_ref(), &[1], MapFlags::ANY)
            {
                return Err(self.map_error("update", &key, source));
            }
            self.installed.insert(key);
            stats.added += 1;
        }
        Ok(stats)
    }

    /// As [`Self::sync`], taking `want` whole: a growing set that is made anew (taken up
    /// from a previous kxp, or too small) keeps it as what it installed, with no copy of
    /// the keys (two million endpoint keys at 100,000 Services).
    ///
    /// # Errors
    /// As [`Self::sync`].
    pub(super) fn sync_owned(&mut self, want: KeySet<K>) -> Result<SyncStats, XdpError> {
        let anew = self.previous.is_some() || want.len() > self.map.max_entries() as usize;
        if self.outer.is_none() || !anew {
            return self.sync(&want);
        }
        let why = if self.previous.is_some() {
            Grow::TakenUp
        } else {
            Grow::Full
        };
        let previous = self.previous.take();
        self.grow(want, why)
            .inspect_err(|_| self.previous = previous)
    }

    /// Inserts `add` and deletes `remove` (keys already in / already out are left
    /// alone): the incremental form of [`Self::sync`], for callers that know the change.
    ///
    /// # Errors
    /// As [`Self::sync`].
    pub(super) fn change(&mut self, add: &[K], remove: &[K]) -> Result<SyncStats, XdpError> {
        if self.previous.is_some() {
            // What the map holds is not known yet: a full sync comes first.
            return Err(XdpError::Map {
                map: self.name,
                op: "change",
                key: None,
                source: std::io::Error::other(
                    "taken up from a previous kxp, not yet synced in full",
                )
                .into(),
            });
        }
        let capacity = self.map.max_entries() as usize;
        let gone = remove
            .iter()
            .filter(|k| self.installed.contains(*k))
            .count();
        let fresh = add.iter().filter(|k| !self.installed.contains(*k)).count();
        if self.installed.len() - gone + fresh > capacity && self.outer.is_some() {
            let mut next = self.installed.clone();
            for k in remove {
                next.remove(k);
            }
            next.extend(add.iter().cloned());
            return self.grow(next, Grow::Full);
        }
        if self.installed.len() - gone + fresh > capacity {
            return Err(XdpError::MapFull {
                map: self.name,
                capacity,
                wanted: self.installed.len() - gone + fresh,
            });
        }
        let mut stats = SyncStats::default();
        for key in remove {
            if !self.installed.contains(key) {
                continue;
            }
            match self.map.delete(key.to_bytes().as_ref()) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(source) => return Err(self.map_error("delete", key, source)),
            }
            self.installed.remove(key);
            stats.removed += 1;
        }
        for key in add {
            if self.installed.contains(key) {
                continue;
            }
            if let Err(source) = self
                .map
                .update(key.to_bytes().as_ref(), &[1], MapFlags::ANY)
            {
                return Err(self.map_error("update", key, source));
            }
            self.installed.insert(key.clone());
            stats.added += 1;
        }
        stats.unchanged = self.installed.len() - stats.added;
        Ok(stats)
    }

    /// Makes the set `next` in a new inner map twice the size it needs, and swaps it in
    /// for the current one: the program reads the old set until the swap, the new one
    /// after, never a half-filled one.
    fn grow(&mut self, next: KeySet<K>, why: Grow) -> Result<SyncStats, XdpError> {
        let Some((outer, key_size)) = &self.outer else {
            unreachable!("grow is called for growing sets only");
        };
        let size = u32::try_from((next.len() * 2).next_power_of_two())
            .unwrap_or(u32::MAX / 2)
            .max(INITIAL_SET);
        let map = new_set(self.name, *key_size, size)?;
        let keys: Vec<&K> = next.iter().collect();
        fill(&map, self.name, *key_size, &keys)?;
        swap_in(outer, &map, self.name)?;
        let kept = next.intersection(&self.installed).count();
        let stats = SyncStats {
            added: next.len() - kept,
            removed: self.installed.len() - kept,
            unchanged: kept,
        };
        match why {
            Grow::Full => tracing::info!(
                map = self.name,
                entries = next.len(),
                size,
                "steering set grown: {} keys in a map of {size} (was {})",
                next.len(),
                self.map.max_entries()
            ),
            Grow::TakenUp => tracing::info!(
                map = self.name,
                entries = next.len(),
                size,
                "steering set of the previous kxp made anew: {} keys in a map of {size}",
                next.len()
            ),
        }
        self.map = map;
        self.installed = next;
        Ok(stats)
    }

    fn map_error(&self, op: &'static str, key: &K, source: libbpf_rs::Error) -> XdpError {
        XdpError::Map {
            map: self.name,
            op,
            key: Some(key.to_string()),
            source,
        }
    }
}

/// Writes `keys` (value 1) into `map`, in batches, from a thread per CPU (up to 4) when
/// there are many: the kernel's insertions into a hash map without preallocation (an
/// allocation each) took 3 s of a first programming at 1,000,000 endpoints on one thread,
/// and its buckets have locks of their own.
fn fill<K: MapKey + Sync>(
    map: &MapHandle,
    name: &'static str,
    key_size: u32,
    keys: &[&K],
) -> Result<(), XdpError> {
    let write = |part: &[&K]| -> Result<(), XdpError> {
        for chunk in part.chunks(BATCH) {
            let mut bytes = Vec::with_capacity(chunk.len() * key_size as usize);
            for k in chunk {
                bytes.extend_from_slice(k.to_bytes().as_ref());
            }
            let values = vec![1u8; chunk.len()];
            map.update_batch(
                &bytes,
                &values,
                chunk.len() as u32,
                MapFlags::ANY,
                MapFlags::ANY,
            )
            .map_err(|source| XdpError::Map {
                map: name,
                op: "fill",
                key: None,
                source,
            })?;
        }
        Ok(())
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(4)
        .min(keys.len() / (4 * BATCH))
        .max(1);
    if threads == 1 {
        return write(keys);
    }
    let per = keys.len().div_ceil(threads);
    std::thread::scope(|sc| {
        let handles: Vec<_> = keys
            .chunks(per)
            .map(|part| sc.spawn(move || write(part)))
            .collect();
        // (The scope joins the others if one failed.)
        handles
            .into_iter()
            .try_for_each(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })
}

/// An empty inner map for a growing set: a hash map of `size` entries (no
/// preallocation) of `key_size`-byte keys and one-byte values, as the program's template.
fn new_set(name: &'static str, key_size: u32, size: u32) -> Result<MapHandle, XdpError> {
    let opts = libbpf_sys::bpf_map_create_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as libbpf_sys::size_t,
        map_flags: libbpf_sys::BPF_F_NO_PREALLOC,
        ..Default::default()
    };
    MapHandle::create(MapType::Hash, Some(name), key_size, 1, size, &opts).map_err(|source| {
        XdpError::Map {
            map: name,
            op: "create",
            key: None,
            source,
        }
    })
}

/// Puts `map` in `outer`'s one slot, where the program reads it from the next packet on.
fn swap_in(outer: &MapHandle, map: &MapHandle, name: &'static str) -> Result<(), XdpError> {
    let fd = map.as_fd().as_raw_fd() as u32;
    outer
        .update(&0u32.to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY)
        .map_err(|source| XdpError::Map {
            map: name,
            op: "swap",
            key: None,
            source,
        })
}
