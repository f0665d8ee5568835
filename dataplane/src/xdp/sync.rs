//! Incremental mirroring of a wanted key set into a BPF map: the kernel sees only
//! the difference from what was installed last, so one Service changing among 10k costs
//! a handful of syscalls, not a rewrite.

use std::collections::HashSet;
use std::fmt;
use std::hash::Hash;

use libbpf_rs::{ErrorKind, MapCore, MapFlags, MapHandle};

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
pub(super) trait MapKey: Eq + Hash + Clone + fmt::Display {
    type Bytes: AsRef<[u8]>;
    fn to_bytes(&self) -> Self::Bytes;
}

/// A BPF hash map or LPM trie (values: one byte, 1) and the key set this process
/// installed in it.
#[derive(Debug)]
pub(super) struct SyncedMap<K> {
    map: MapHandle,
    name: &'static str,
    installed: HashSet<K>,
}

impl<K: MapKey> SyncedMap<K> {
    pub(super) fn new(map: MapHandle, name: &'static str) -> Self {
        SyncedMap {
            map,
            name,
            installed: HashSet::new(),
        }
    }

    /// The keys this process installed (and did not remove).
    pub(super) fn installed(&self) -> &HashSet<K> {
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
    pub(super) fn sync(&mut self, want: &HashSet<K>) -> Result<SyncStats, XdpError> {
        let capacity = self.map.max_entries() as usize;
        if want.len() > capacity {
            return Err(XdpError::MapFull {
                map: self.name,
                capacity,
                wanted: want.len(),
            });
        }
        let stale: Vec<K> = self.installed.difference(want).cloned().collect();
        let missing: Vec<K> = want.difference(&self.installed).cloned().collect();
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

    /// Inserts `add` and deletes `remove` (keys already in / already out are left
    /// alone): the incremental form of [`Self::sync`], for callers that know the change.
    ///
    /// # Errors
    /// As [`Self::sync`].
    pub(super) fn change(&mut self, add: &[K], remove: &[K]) -> Result<SyncStats, XdpError> {
        let capacity = self.map.max_entries() as usize;
        let gone = remove
            .iter()
            .filter(|k| self.installed.contains(*k))
            .count();
        let fresh = add.iter().filter(|k| !self.installed.contains(*k)).count();
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

    fn map_error(&self, op: &'static str, key: &K, source: libbpf_rs::Error) -> XdpError {
        XdpError::Map {
            map: self.name,
            op,
            key: Some(key.to_string()),
            source,
        }
    }
}
