//! Fragments of translated datagrams.
//!
//! Only the first fragment of a datagram carries the ports, so only it can be looked up
//! in the connection table; the others (same source, destination, protocol and
//! identification) must be given the same addresses. The first fragment's translation is
//! learned here ([`FragTable::learn`]) and applied to the others ([`FragTable::lookup`]).
//! A fragment that arrives before its first fragment (networks reorder) is parked, as a
//! copy, until the first arrives or its entry expires ([`FragTable::park`]).
//!
//! Bounded: at most `capacity` datagrams tracked and `max_parked_bytes` of parked
//! fragments; a full table refuses (the caller drops and counts) rather than evicting
//! datagrams in flight. Entries live `timeout` after their last fragment (Linux's
//! `ipfrag_time` is 30 s). No locks, no clock: `now` is an argument.

use std::collections::HashMap;
use std::net::IpAddr;

use wire::rewrite::FragKey;

/// What a later fragment should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragVerdict {
    /// Rewrite its addresses to these (source, destination); the third is the tag
    /// learned with them (the caller's: kxp keeps the VLAN id it leaves with).
    Translate(IpAddr, IpAddr, u16),
    /// Its first fragment has not been seen: park it (or drop it).
    Unknown,
}

/// Counters, cumulative.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FragStats {
    /// Later fragments given their datagram's translation.
    pub translated: u64,
    /// Fragments parked until their first fragment.
    pub parked: u64,
    /// Parked fragments dropped: their first fragment never came, or no room.
    pub dropped: u64,
    /// Datagrams not tracked because the table was full.
    pub full: u64,
}

#[derive(Debug)]
struct Entry {
    to: Option<(IpAddr, IpAddr, u16)>,
    expires: u64,
    parked: Vec<Vec<u8>>,
}

/// The fragment table (see the module docs).
#[derive(Debug)]
pub struct FragTable {
    map: HashMap<FragKey, Entry>,
    capacity: usize,
    max_parked_bytes: usize,
    parked_bytes: usize,
    timeout: u64,
    /// When [`FragTable::expire`] looks at the entries next (a quarter of the timeout
    /// after it last did: it walks them all).
    next_sweep: u64,
    stats: FragStats,
}

impl FragTable {
    /// A table for `capacity` datagrams and `max_parked_bytes` of parked fragments, whose
    /// entries live `timeout` (ns) after their last fragment.
    pub fn new(capacity: usize, max_parked_bytes: usize, timeout: u64) -> FragTable {
        FragTable {
            map: HashMap::new(),
            capacity,
            max_parked_bytes,
            parked_bytes: 0,
            timeout,
            next_sweep: 0,
            stats: FragStats::default(),
        }
    }

    /// The first fragment of datagram `key` was translated to (`src`, `dst`), and left
    /// with `tag` (the caller's, given back to its later fragments). Returns the
    /// fragments parked for it, to translate and send now. `false` in the second place
    /// when the table is full (the later fragments will be dropped).
    pub fn learn(
        &mut self,
        key: FragKey,
        src: IpAddr,
        dst: IpAddr,
        tag: u16,
        now: u64,
    ) -> (Vec<Vec<u8>>, bool) {
        self.expire(now);
        if !self.map.contains_key(&key) && self.map.len() >= self.capacity {
            self.stats.full += 1;
            return (Vec::new(), false);
        }
        let e = self.map.entry(key).or_insert(Entry {
            to: None,
            expires: 0,
            parked: Vec::new(),
        });
        e.to = Some((src, dst, tag));
        e.expires = now + self.timeout;
        let parked = std::mem::take(&mut e.parked);
        let bytes: usize = parked.iter().map(Vec::len).sum();
        self.parked_bytes -= bytes;
        self.stats.translated += parked.len() as u64;
        (parked, true)
    }

    /// What to do with a later fragment of `key`.
    pub fn lookup(&mut self, key: &FragKey, now: u64) -> FragVerdict {
        match self.map.get_mut(key) {
            Some(e) if e.expires > now => match e.to {
                Some((s, d, tag)) => {
                    e.expires = now + self.timeout;
                    self.stats.translated += 1;
                    FragVerdict::Translate(s, d, tag)
                }
                None => FragVerdict::Unknown,
            },
            _ => FragVerdict::Unknown,
        }
    }

    /// Keeps a copy of a later fragment of `key` until its first fragment is learned.
    /// `false` (and nothing kept) when that would pass the table's bounds.
    pub fn park(&mut self, key: FragKey, frame: &[u8], now: u64) -> bool {
        self.expire(now);
        let fits = self.parked_bytes + frame.len() <= self.max_parked_bytes
            && (self.map.contains_key(&key) || self.map.len() < self.capacity);
        if !fits {
            self.stats.dropped += 1;
            return false;
        }
        let e = self.map.entry(key).or_insert(Entry {
            to: None,
            expires: now + self.timeout,
            parked: Vec::new(),
        });
        e.parked.push(frame.to_vec());
        self.parked_bytes += frame.len();
        self.stats.parked += 1;
        true
    }

    /// Forgets the datagrams whose time is up (their parked fragments are dropped).
    pub fn expire(&mut self, now: u64) {
        if self.map.is_empty() || now < self.next_sweep {
            return;
        }
        self.next_sweep = now + self.timeout / 4;
        let mut dropped = 0u64;
        let mut freed = 0usize;
        self.map.retain(|_, e| {
            let keep = e.expires > now;
            if !keep {
                dropped += e.parked.len() as u64;
                freed += e.parked.iter().map(Vec::len).sum::<usize>();
            }
            keep
        });
        self.stats.dropped += dropped;
        self.parked_bytes -= freed;
    }

    /// Datagrams tracked now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no datagram is tracked.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The counters.
    pub fn stats(&self) -> FragStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn key(id: u32) -> FragKey {
        FragKey {
            src: "198.18.1.2".parse().unwrap(),
            dst: "198.19.0.10".parse().unwrap(),
            proto: 17,
            id,
        }
    }

    fn addrs() -> (IpAddr, IpAddr) {
        ("198.18.2.1".parse().unwrap(), "198.18.2.2".parse().unwrap())
    }

    #[test]
    fn later_fragments_follow_the_first_and_early_ones_wait_for_it() {
        let mut t = FragTable::new(16, 1 << 20, 30 * S);
        let (s, d) = addrs();
        // The last fragment comes first: parked.
        assert_eq!(t.lookup(&key(1), 0), FragVerdict::Unknown);
        assert!(t.park(key(1), b"last", 0));
        // The first fragment is translated: the parked one comes back.
        let (parked, ok) = t.learn(key(1), s, d, 7, S);
        assert!(ok);
        assert_eq!(parked, vec![b"last".to_vec()]);
        // The middle one is translated at once.
        assert_eq!(t.lookup(&key(1), 2 * S), FragVerdict::Translate(s, d, 7));
        assert_eq!(t.lookup(&key(2), 2 * S), FragVerdict::Unknown);
        let st = t.stats();
        assert_eq!((st.translated, st.parked, st.dropped), (2, 1, 0));
    }

    #[test]
    fn entries_expire_and_parked_fragments_are_dropped_with_them() {
        let mut t = FragTable::new(16, 1 << 20, 30 * S);
        let (s, d) = addrs();
        t.learn(key(1), s, d, 0, 0);
        assert!(t.park(key(2), b"orphan", 0));
        assert_eq!(t.lookup(&key(1), 29 * S), FragVerdict::Translate(s, d, 0));
        // Refreshed by that fragment: still there at 58 s, not at 60 s; the sweep (every
        // quarter of the timeout) then frees it.
        t.expire(58 * S);
        assert_eq!(t.len(), 1);
        assert_eq!(t.lookup(&key(1), 60 * S), FragVerdict::Unknown);
        t.expire(90 * S);
        assert!(t.is_empty());
        assert_eq!(t.stats().dropped, 1);
    }

    #[test]
    fn bounds_hold_and_refusals_are_counted() {
        let mut t = FragTable::new(2, 10, 30 * S);
        let (s, d) = addrs();
        assert!(t.learn(key(1), s, d, 0, 0).1);
        assert!(t.learn(key(2), s, d, 0, 0).1);
        assert!(
            !t.learn(key(3), s, d, 0, 0).1,
            "full: a third datagram is refused"
        );
        assert_eq!(t.stats().full, 1);
        assert!(t.park(key(1), &[0; 8], 0));
        assert!(!t.park(key(1), &[0; 8], 0), "past 10 parked bytes");
        assert!(!t.park(key(4), &[0; 1], 0), "no room for a new datagram");
        assert_eq!(t.stats().dropped, 2);
        assert_eq!(t.len(), 2);
    }
}
