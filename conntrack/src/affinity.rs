//! ClientIP session affinity for a whole node: which endpoint a client last used for a
//! Service port, shared by every worker, bounded, and expiring.
//!
//! kube-proxy keeps this in the kernel (an nftables set per endpoint, `recent` lists with
//! iptables, IPVS persistence templates): one memory per node, whatever CPU a connection
//! lands on. Here it is one table shared by the workers, split into [`SHARDS`] shards,
//! each under its own lock. Only a new connection to a Service with ClientIP affinity
//! takes a shard's lock, for the time of a hash-map lookup and insert, so workers seldom
//! meet there and established flows never do.
//!
//! # Expiry
//! An entry lives `timeoutSeconds` after the client's last new connection to the Service
//! port (kube-proxy refreshes its sets on every new connection, not on every packet). An
//! expired entry is never returned; it is removed when met, by [`AffinityTable::sweep`],
//! or to make room.
//!
//! # Bound
//! Each shard holds at most `capacity / SHARDS` clients (rounded up). Each shard keeps
//! its entries in the order they were last refreshed; a new client in a full shard
//! evicts the least recently refreshed one (counted as an eviction if it was still
//! live). A flood of new source addresses can therefore push out real clients' affinity
//! (their next connection picks an endpoint afresh, as after a timeout) but cannot grow
//! memory.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use foldhash::fast::FixedState;
use hashbrown::{DefaultHashBuilder, HashMap};

use crate::persist::AffinityRecord;

/// Shards of an [`AffinityTable`].
pub const SHARDS: usize = 64;

/// A Service port (a stable hash of its name) and a client address.
type Key = (u64, IpAddr);

#[derive(Debug, Clone, Copy)]
struct Value {
    endpoint: SocketAddr,
    expires: u64,
    /// Position in the shard's refresh order.
    stamp: u64,
    /// Record number within the shard (for the sink).
    slot: u32,
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<Key, Value>,
    /// Keys in the order they were refreshed, oldest first; a record whose stamp is not
    /// its key's current one is stale and skipped.
    order: VecDeque<(Key, u64)>,
    next_stamp: u64,
    /// Record numbers freed, and the next never used.
    free: Vec<u32>,
    next_slot: u32,
}

/// Where an [`AffinityTable`] writes every change, for the next process (kxp: a state
/// file, see [`crate::persist`]). Called under the shard's lock, so two calls for one
/// record never overlap; records of different shards are written concurrently.
pub trait AffinitySink: Send + Sync + std::fmt::Debug {
    /// Record `index` (below [`AffinityTable::capacity`]) now holds `entry`, or nothing.
    fn put(&self, index: usize, entry: Option<&AffinityRecord>);
}

/// Counters of an [`AffinityTable`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AffinityStats {
    /// Clients held now.
    pub entries: u64,
    /// Clients recorded (new or refreshed).
    pub remembered: u64,
    /// Entries removed because their timeout passed.
    pub expired: u64,
    /// Live entries evicted to make room for a new client.
    pub evictions: u64,
}

/// One entry, as listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AffinityEntry {
    /// The Service port (stable hash of its name).
    pub service: u64,
    /// The client.
    pub client: IpAddr,
    /// The endpoint it is held to.
    pub endpoint: SocketAddr,
    /// When it expires, on the caller's clock.
    pub expires: u64,
}

/// The node's ClientIP affinity memory. See the [module docs](self).
#[derive(Debug)]
pub struct AffinityTable {
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
    /// Shard choice: seeded at random per node and kept across restarts (with the
    /// records), so that restored clients land in the shards they came from.
    seed: u64,
    hasher: FixedState,
    /// Next shard [`AffinityTable::sweep`] looks at.
    hand: AtomicUsize,
    remembered: AtomicU64,
    expired: AtomicU64,
    evictions: AtomicU64,
    sink: Option<Box<dyn AffinitySink>>,
}

impl AffinityTable {
    /// A table for at most about `capacity` clients (at least one per shard).
    pub fn new(capacity: usize) -> AffinityTable {
        AffinityTable::with_sink(capacity, AffinityTable::random_seed(), None)
    }

    /// A shard seed drawn at random (for a table with no predecessor).
    pub fn random_seed() -> u64 {
        DefaultHashBuilder::default().hash_one(0u8)
    }

    /// Clients a table made for `capacity` holds (at least one per shard): the number of
    /// records its sink needs.
    pub fn capacity_for(capacity: usize) -> usize {
        capacity.div_ceil(SHARDS).max(1) * SHARDS
    }

    /// As [`AffinityTable::new`] with the shard seed `seed` (a previous table's
    /// [`AffinityTable::seed`] to restore its entries), writing every change to `sink`.
    pub fn with_sink(
        capacity: usize,
        seed: u64,
        sink: Option<Box<dyn AffinitySink>>,
    ) -> AffinityTable {
        AffinityTable {
            sink,
            seed,
            hasher: FixedState::with_seed(seed),
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            per_shard: AffinityTable::capacity_for(capacity) / SHARDS,
            hand: AtomicUsize::new(0),
            remembered: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// The shard seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Most clients held.
    pub fn capacity(&self) -> usize {
        self.per_shard * SHARDS
    }

    fn shard_of(&self, key: &Key) -> usize {
        (self.hasher.hash_one(key) % SHARDS as u64) as usize
    }

    fn lock(&self, i: usize) -> std::sync::MutexGuard<'_, Shard> {
        // A worker that panicked while holding a shard left a map that is still a valid
        // map: go on with it.
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(&self, shard: usize, slot: u32, rec: Option<&AffinityRecord>) {
        if let Some(sink) = &self.sink {
            sink.put(shard * self.per_shard + slot as usize, rec);
        }
    }

    /// Removes `key` from shard `i` (locked as `s`), freeing its record.
    fn drop_key(&self, i: usize, s: &mut Shard, key: &Key) {
        if let Some(v) = s.map.remove(key) {
            s.free.push(v.slot);
            self.put(i, v.slot, None);
        }
    }

    /// The endpoint `client` last used for the Service port `service`, if its timeout has
    /// not passed at `now`.
    pub fn recall(&self, service: u64, client: IpAddr, now: u64) -> Option<SocketAddr> {
        let key = (service, client);
        let i = self.shard_of(&key);
        let mut s = self.lock(i);
        let v = *s.map.get(&key)?;
        if now < v.expires {
            return Some(v.endpoint);
        }
        self.drop_key(i, &mut s, &key);
        self.expired.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Records (or refreshes) `client` → `endpoint` for `service`, expiring
    /// `timeout_ns` after `now`; evicts the least recently refreshed client of a full
    /// shard.
    pub fn remember(
        &self,
        service: u64,
        client: IpAddr,
        endpoint: SocketAddr,
        now: u64,
        timeout_ns: u64,
    ) {
        self.remember_until(
            service,
            client,
            endpoint,
            now,
            now.saturating_add(timeout_ns),
        );
    }

    fn remember_until(
        &self,
        service: u64,
        client: IpAddr,
        endpoint: SocketAddr,
        now: u64,
        expires: u64,
    ) {
        let key = (service, client);
        let i = self.shard_of(&key);
        let mut guard = self.lock(i);
        let s = &mut *guard;
        let stamp = s.next_stamp;
        s.next_stamp += 1;
        let slot = match s.map.get_mut(&key) {
            Some(v) => {
                v.endpoint = endpoint;
                v.expires = expires;
                v.stamp = stamp;
                v.slot
            }
            None => {
                if s.map.len() >= self.per_shard {
                    self.evict_one(i, s, now);
                }
                let slot = s.free.pop().unwrap_or_else(|| {
                    s.next_slot += 1;
                    s.next_slot - 1
                });
                s.map.insert(
                    key,
                    Value {
                        endpoint,
                        expires,
                        stamp,
                        slot,
                    },
                );
                slot
            }
        };
        s.order.push_back((key, stamp));
        self.remembered.fetch_add(1, Ordering::Relaxed);
        self.put(
            i,
            slot,
            Some(&AffinityRecord {
                service,
                client,
                endpoint,
                expires,
            }),
        );
        // Refreshes leave stale records behind: compact once they outnumber the live.
        if s.order.len() > 2 * s.map.len() + 16 {
            let Shard { map, order, .. } = s;
            order.retain(|(k, st)| map.get(k).is_some_and(|v| v.stamp == *st));
        }
    }

    /// Frees the least recently refreshed entry of shard `i`.
    fn evict_one(&self, i: usize, s: &mut Shard, now: u64) {
        while let Some((k, st)) = s.order.pop_front() {
            match s.map.get(&k) {
                Some(v) if v.stamp == st => {
                    let counter = if now >= v.expires {
                        &self.expired
                    } else {
                        &self.evictions
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    self.drop_key(i, s, &k);
                    return;
                }
                _ => {} // stale record
            }
        }
    }

    /// Puts back an entry a previous process held (if it has not expired at `now`).
    pub fn restore(&self, r: &AffinityRecord, now: u64) -> bool {
        if now >= r.expires {
            return false;
        }
        self.remember_until(r.service, r.client, r.endpoint, now, r.expires);
        true
    }

    /// Removes expired entries from the front of one shard's refresh order (the next
    /// shard in turn), looking at up to `budget` records. Returns how many were removed.
    /// Workers call it now and then, so that a client that never comes back does not
    /// hold memory until the shard fills.
    pub fn sweep(&self, now: u64, budget: usize) -> usize {
        let i = self.hand.fetch_add(1, Ordering::Relaxed) % SHARDS;
        let mut guard = self.lock(i);
        let s = &mut *guard;
        let mut removed = 0;
        for _ in 0..budget {
            let Some(&(k, st)) = s.order.front() else {
                break;
            };
            match s.map.get(&k) {
                Some(v) if v.stamp == st => {
                    if now < v.expires {
                        break;
                    }
                    self.drop_key(i, s, &k);
                    removed += 1;
                }
                _ => {}
            }
            s.order.pop_front();
        }
        self.expired.fetch_add(removed as u64, Ordering::Relaxed);
        removed
    }

    /// The counters (locks every shard briefly, for the entry count).
    pub fn stats(&self) -> AffinityStats {
        let entries = self
            .shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).map.len() as u64)
            .sum();
        AffinityStats {
            entries,
            remembered: self.remembered.load(Ordering::Relaxed),
            expired: self.expired.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
        }
    }

    /// Every live entry at `now` (for listing and for saving the table).
    pub fn entries(&self, now: u64) -> Vec<AffinityEntry> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let s = shard.lock().unwrap_or_else(|e| e.into_inner());
            out.extend(s.map.iter().filter(|(_, v)| now < v.expires).map(
                |(&(service, client), v)| AffinityEntry {
                    service,
                    client,
                    endpoint: v.endpoint,
                    expires: v.expires,
                },
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests;
