//! The flow index: hash → `u32` values (slot and direction), one cache line per bucket.
//!
//! A general-purpose hash table keeps its tags and its values in two arrays, so a lookup
//! of a cold key misses the cache twice before it even reaches the flow; with a full
//! table of random flows (a new connection per packet) those misses are most of the
//! lookup. Here a bucket is one 64-byte line with ten 16-bit tags (from the hash's top
//! bits; 0 = empty), their ten values and an overflow count, so a lookup misses once.
//!
//! Collisions probe the following buckets (linear, bucket by bucket). Each bucket
//! counts the entries that had to move past it; a lookup stops at the first bucket whose
//! count is zero, and a removal decrements the counts it had incremented. The table
//! is sized when it is made (the connection table's capacity) and never grows, so it
//! never allocates on the packet path. No `unsafe`.

/// Entries per bucket.
const WAYS: usize = 10;

#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(64))]
struct Bucket {
    tags: [u16; WAYS],
    vals: [u32; WAYS],
    /// Entries homed at an earlier bucket that are stored at or after the next one.
    overflow: u32,
}

const _: () = assert!(size_of::<Bucket>() == 64);

/// Bit `k` set where way `k` holds `x`. Written without branches so that the compiler
/// compares all ten at once (SSE2 on x86-64): a loop that stops at the first match
/// mispredicts its exit at a random way, and the scans of `find`, `place` and `remove`
/// took most of a new connection's index time that way (perf annotate, new-connection
/// profile of 2026-12-05).
#[inline]
fn ways_equal<T: Copy + PartialEq>(ways: &[T; WAYS], x: T) -> u32 {
    let mut m = 0;
    for (k, &w) in ways.iter().enumerate() {
        m |= u32::from(w == x) << k;
    }
    m
}

impl Bucket {
    /// The ways whose tag is `t` (`t` = 0: the free ways).
    #[inline]
    fn tags_equal(&self, t: u16) -> u32 {
        ways_equal(&self.tags, t)
    }

    /// The ways whose value is `v` (free ways included: mask with a tag).
    #[inline]
    fn vals_equal(&self, v: u32) -> u32 {
        ways_equal(&self.vals, v)
    }
}

/// See the module docs.
#[derive(Debug, Clone)]
pub(crate) struct FlowIndex {
    buckets: Vec<Bucket>,
    len: usize,
}

#[inline]
fn tag(hash: u64) -> u16 {
    ((hash >> 48) as u16).max(1)
}

impl FlowIndex {
    /// An index for `entries` (`None` if that memory cannot be had), at most half full
    /// when it holds them all: a lookup of a key that is not there (every new flow's)
    /// reads buckets until one has no overflow, and with ten ways per bucket that is
    /// 1.0 buckets at 40% full against 1.8 at 80% (measured with 524,288 entries, kxp's
    /// default table of 262,144 flows, which the earlier 90% sizing made 80% full); each
    /// bucket more is a cache miss in a large table.
    pub(crate) fn try_with_capacity(entries: usize) -> Option<FlowIndex> {
        let buckets = (entries * 2).div_ceil(WAYS).next_power_of_two().max(2);
        let mut v = Vec::new();
        v.try_reserve_exact(buckets).ok()?;
        v.resize(buckets, Bucket::default());
        Some(FlowIndex { buckets: v, len: 0 })
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Where the buckets are: (address, bytes).
    pub(crate) fn region(&self) -> (usize, usize) {
        (self.buckets.as_ptr() as usize, self.allocation_size())
    }

    pub(crate) fn allocation_size(&self) -> usize {
        self.buckets.len() * size_of::<Bucket>()
    }

    #[inline]
    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    /// The value with this hash for which `eq` holds.
    #[inline]
    pub(crate) fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let t = tag(hash);
        let mask = self.mask();
        let mut i = hash as usize & mask;
        for _ in 0..self.buckets.len() {
            let b = &self.buckets[i];
            let mut m = b.tags_equal(t);
            while m != 0 {
                let k = m.trailing_zeros() as usize;
                if eq(b.vals[k]) {
                    return Some(b.vals[k]);
                }
                m &= m - 1;
            }
            if b.overflow == 0 {
                return None;
            }
            i = (i + 1) & mask;
        }
        None
    }

    /// Where `hash`'s home bucket is (its one line), for a prefetch (see
    /// [`crate::ConnTable::warm`]).
    #[inline]
    pub(crate) fn home(&self, hash: u64) -> *const u8 {
        (&raw const self.buckets[hash as usize & self.mask()]).cast()
    }

    /// The first value in `hash`'s home bucket whose tag matches: a candidate, its key not
    /// compared (for [`crate::ConnTable::warm`]).
    #[inline]
    pub(crate) fn candidate(&self, hash: u64) -> Option<u32> {
        let t = tag(hash);
        let b = &self.buckets[hash as usize & self.mask()];
        let m = b.tags_equal(t);
        (m != 0).then(|| b.vals[m.trailing_zeros() as usize])
    }

    /// Entries the index holds at most (90% of its room).
    pub(crate) fn capacity(&self) -> usize {
        self.buckets.len() * WAYS * 9 / 10
    }

    /// Adds `v` under `hash` (the caller knows it is not there). Never allocates: the
    /// index is sized when made; `false` (nothing added) when it holds
    /// [`FlowIndex::capacity`] entries already.
    pub(crate) fn insert(&mut self, hash: u64, v: u32) -> bool {
        if self.len >= self.capacity() {
            return false;
        }
        self.place(hash, v);
        self.len += 1;
        true
    }

    fn place(&mut self, hash: u64, v: u32) {
        let t = tag(hash);
        let mask = self.mask();
        let mut i = hash as usize & mask;
        loop {
            let b = &mut self.buckets[i];
            let free = b.tags_equal(0);
            if free != 0 {
                let k = free.trailing_zeros() as usize;
                b.tags[k] = t;
                b.vals[k] = v;
                return;
            }
            b.overflow += 1;
            i = (i + 1) & mask;
        }
    }

    /// Removes `v` stored under `hash`; returns whether it was there.
    pub(crate) fn remove(&mut self, hash: u64, v: u32) -> bool {
        let t = tag(hash);
        let mask = self.mask();
        let home = hash as usize & mask;
        let mut i = home;
        for _ in 0..self.buckets.len() {
            let b = &mut self.buckets[i];
            let m = b.tags_equal(t) & b.vals_equal(v);
            if m != 0 {
                b.tags[m.trailing_zeros() as usize] = 0;
                let mut j = home;
                while j != i {
                    self.buckets[j].overflow -= 1;
                    j = (j + 1) & mask;
                }
                self.len -= 1;
                return true;
            }
            if b.overflow == 0 {
                return false;
            }
            i = (i + 1) & mask;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// A hash that piles keys onto few buckets, to exercise overflow chains.
    fn clustered(v: u32) -> u64 {
        let h = u64::from(v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (h & 0xFFFF_0000_0000_0000) | u64::from(v % 7)
    }

    #[test]
    fn random_operations_agree_with_a_map() {
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        let mut rand = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for hash in [clustered as fn(u32) -> u64, |v| {
            u64::from(v)
                .wrapping_mul(0xD6E8_FEB8_6659_FD93)
                .rotate_left(17)
        }] {
            let mut ix = FlowIndex::try_with_capacity(600).unwrap();
            let mut model: HashMap<u32, ()> = HashMap::new();
            for _ in 0..20_000 {
                let v = rand(600) as u32;
                match rand(3) {
                    0 | 1 if !model.contains_key(&v) => {
                        assert!(ix.insert(hash(v), v));
                        model.insert(v, ());
                    }
                    _ => {
                        assert_eq!(ix.remove(hash(v), v), model.remove(&v).is_some());
                    }
                }
                let probe = rand(600) as u32;
                assert_eq!(
                    ix.find(hash(probe), |x| x == probe),
                    model.contains_key(&probe).then_some(probe)
                );
                assert_eq!(ix.len(), model.len());
            }
            // Every overflow count is exactly the entries that passed the bucket.
            let mask = ix.mask();
            let mut want = vec![0u32; ix.buckets.len()];
            for (i, b) in ix.buckets.iter().enumerate() {
                for k in 0..WAYS {
                    if b.tags[k] != 0 {
                        let mut j = hash(b.vals[k]) as usize & mask;
                        while j != i {
                            want[j] += 1;
                            j = (j + 1) & mask;
                        }
                    }
                }
            }
            let have: Vec<u32> = ix.buckets.iter().map(|b| b.overflow).collect();
            assert_eq!(have, want);
        }
    }

    #[test]
    fn holds_what_it_was_sized_for_and_refuses_more_without_allocating() {
        let h = |v: u32| u64::from(v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        // Sized for 18: at most half full with them, so 4 buckets; it takes up to 90%.
        let mut ix = FlowIndex::try_with_capacity(18).unwrap();
        assert_eq!(ix.buckets.len(), 4);
        assert_eq!(ix.capacity(), 36);
        for v in 0..36 {
            assert!(ix.insert(h(v), v));
        }
        let before = ix.allocation_size();
        assert!(!ix.insert(h(36), 36));
        assert_eq!(ix.allocation_size(), before);
        for v in 0..36 {
            assert_eq!(ix.find(h(v), |x| x == v), Some(v));
        }
        assert!(ix.remove(h(3), 3));
        assert!(ix.insert(h(36), 36));
    }
}
