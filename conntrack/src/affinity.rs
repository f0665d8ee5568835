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

use hashbrown::{DefaultHashBuilder, HashMap};

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
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<Key, Value>,
    /// Keys in the order they were refreshed, oldest first; a record whose stamp is not
    /// its key's current one is stale and skipped.
    order: VecDeque<(Key, u64)>,
    next_stamp: u64,
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
    hasher: DefaultHashBuilder,
    /// Next shard [`AffinityTable::sweep`] looks at.
    hand: AtomicUsize,
    remembered: AtomicU64,
    expired: AtomicU64,
    evictions: AtomicU64,
}

impl AffinityTable {
    /// A table for at most about `capacity` clients (at least one per shard).
    pub fn new(capacity: usize) -> AffinityTable {
        AffinityTable {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
            hasher: DefaultHashBuilder::default(),
            hand: AtomicUsize::new(0),
            remembered: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// Most clients held.
    pub fn capacity(&self) -> usize {
        self.per_shard * SHARDS
    }

    fn shard(&self, key: &Key) -> std::sync::MutexGuard<'_, Shard> {
        let i = (self.hasher.hash_one(key) % SHARDS as u64) as usize;
        // A worker that panicked while holding a shard left a map that is still a valid
        // map: go on with it.
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The endpoint `client` last used for the Service port `service`, if its timeout has
    /// not passed at `now`.
    pub fn recall(&self, service: u64, client: IpAddr, now: u64) -> Option<SocketAddr> {
        let key = (service, client);
        let mut s = self.shard(&key);
        let v = *s.map.get(&key)?;
        if now < v.expires {
            return Some(v.endpoint);
        }
        s.map.remove(&key);
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
        let key = (service, client);
        let mut guard = self.shard(&key);
        let s = &mut *guard;
        let stamp = s.next_stamp;
        s.next_stamp += 1;
        let value = Value {
            endpoint,
            expires: now.saturating_add(timeout_ns),
            stamp,
        };
        let is_new = s.map.insert(key, value).is_none();
        s.order.push_back((key, stamp));
        self.remembered.fetch_add(1, Ordering::Relaxed);
        if is_new && s.map.len() > self.per_shard {
            while let Some((k, st)) = s.order.pop_front() {
                match s.map.get(&k) {
                    Some(v) if v.stamp == st => {
                        let counter = if now >= v.expires {
                            &self.expired
                        } else {
                            &self.evictions
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        s.map.remove(&k);
                        break;
                    }
                    _ => {} // stale record
                }
            }
        }
        // Refreshes leave stale records behind: compact once they outnumber the live.
        if s.order.len() > 2 * s.map.len() + 16 {
            let Shard { map, order, .. } = s;
            order.retain(|(k, st)| map.get(k).is_some_and(|v| v.stamp == *st));
        }
    }

    /// Removes expired entries from the front of one shard's refresh order (the next
    /// shard in turn), looking at up to `budget` records. Returns how many were removed.
    /// Workers call it now and then, so that a client that never comes back does not
    /// hold memory until the shard fills.
    pub fn sweep(&self, now: u64, budget: usize) -> usize {
        let i = self.hand.fetch_add(1, Ordering::Relaxed) % SHARDS;
        let mut guard = self.shards[i].lock().unwrap_or_else(|e| e.into_inner());
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
                    s.map.remove(&k);
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
            out.extend(
                s.map
                    .iter()
                    .filter(|(_, v)| now < v.expires)
                    .map(|(&(service, client), v)| AffinityEntry {
                        service,
                        client,
                        endpoint: v.endpoint,
                        expires: v.expires,
                    }),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests;
