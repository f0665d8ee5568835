//! The IPv4 routes of the three tables flattened into one multibit trie (strides 16, 8,
//! 8, as DIR-24-8 but smaller), so that a lookup is one to three array reads instead of
//! a hash probe per prefix length per table.
//!
//! It holds the answer [`FibTable::lookup`](super::FibTable) would give: per address,
//! the best entry of the longest matching prefix of the first table (local, main,
//! default) whose match is not a `throw`. It is built from the [`Lpm`]s themselves when
//! the mirror publishes changed IPv4 routes, and used only while the table still holds
//! those same `Lpm`s (it keeps them, so a route change always makes new ones).
//!
//! A slot of the first stage covers a /16 and a slot of a second-stage block a /24;
//! either is an answer when every address it covers matches the same prefixes (no
//! longer prefix starts inside it), else the index of a block of the next stage. Where
//! it is uniform, its answer is the existing lookup's at its first address, so the trie
//! cannot disagree with the hash levels; the first stage is painted from the prefixes
//! up to /16 instead (65,536 lookups would take milliseconds).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use super::lpm::{Kind, Lpm, RouteEntry, lookup_tables};

/// A slot holding the index of a next-stage block rather than an answer.
const CHILD: u32 = 1 << 31;
/// Next-stage blocks at most (1 KiB each); a host with more fine-grained routes keeps the
/// hash lookup.
const MAX_BLOCKS: usize = 4096;

pub(super) struct Dir4 {
    /// The tables it was built from, in [`super::table::TABLES`] order.
    from: [Arc<Lpm>; 3],
    /// By the top 16 bits: 0 no route, `i` answer `answers[i - 1]`, `CHILD | b` block `b`.
    stage1: Box<[u32]>,
    /// 256-slot blocks, second and third stage alike.
    blocks: Vec<u32>,
    answers: Vec<RouteEntry>,
}

impl std::fmt::Debug for Dir4 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dir4")
            .field("blocks", &self.blocks())
            .field("answers", &self.answers.len())
            .finish()
    }
}

/// The answer of the three tables for `a`, as [`super::FibTable::lookup`] gives it.
fn slow(lpms: &[Arc<Lpm>; 3], a: u32) -> Option<&RouteEntry> {
    lookup_tables(lpms, u128::from(a), 32)
}

impl Dir4 {
    /// The trie of `routes` (IPv4, tables in lookup order); `None` when they would need
    /// more than [`MAX_BLOCKS`] blocks.
    pub(super) fn build(routes: &[Arc<Lpm>; 3]) -> Option<Dir4> {
        let prefixes: Vec<Vec<(u32, u8, &RouteEntry)>> = routes
            .iter()
            .map(|lpm| {
                lpm.visible()
                    .filter(|&(_, len, _)| len <= 32)
                    .map(|(p, len, e)| (p as u32, len, e))
                    .collect()
            })
            .collect();
        // The /16s and /24s where a longer prefix starts.
        let fine = |bits: u8| -> BTreeSet<u32> {
            prefixes
                .iter()
                .flatten()
                .filter(|&&(_, len, _)| len > bits)
                .map(|&(p, _, _)| p >> (32 - bits))
                .collect()
        };
        let (fine16, fine24) = (fine(16), fine(24));
        if fine16.len() + fine24.len() > MAX_BLOCKS {
            return None;
        }
        let mut dir = Dir4 {
            from: routes.clone(),
            stage1: vec![0; 1 << 16].into(),
            blocks: Vec::with_capacity((fine16.len() + fine24.len()) << 8),
            answers: Vec::new(),
        };
        let mut index: HashMap<*const RouteEntry, u32> = HashMap::new();
        let mut answer = |e: Option<&RouteEntry>, answers: &mut Vec<RouteEntry>| -> u32 {
            let Some(e) = e else { return 0 };
            *index.entry(std::ptr::from_ref(e)).or_insert_with(|| {
                answers.push(e.clone());
                answers.len() as u32
            })
        };
        // First stage: each table's longest prefix up to /16 per slot, painted shortest
        // first, then the first table whose answer is not a throw.
        let mut painted: Vec<Vec<Option<&RouteEntry>>> = Vec::with_capacity(3);
        for table in &prefixes {
            let mut paint = vec![None; 1 << 16];
            let mut short: Vec<_> = table.iter().filter(|&&(_, len, _)| len <= 16).collect();
            short.sort_by_key(|&&(_, len, _)| len);
            for &&(p, len, e) in &short {
                let first = (p >> 16) as usize;
                paint[first..first + (1 << (16 - len))].fill(Some(e));
            }
            painted.push(paint);
        }
        for slot in 0..1usize << 16 {
            let e = painted
                .iter()
                .filter_map(|p| p[slot])
                .find(|e| e.kind != Kind::Throw);
            dir.stage1[slot] = answer(e, &mut dir.answers);
        }
        for &hi in &fine16 {
            let b2 = dir.new_block();
            dir.stage1[hi as usize] = CHILD | b2;
            for mid in 0..256u32 {
                let base = hi << 16 | mid << 8;
                let v = if fine24.contains(&(base >> 8)) {
                    let b3 = dir.new_block();
                    for lo in 0..256u32 {
                        let v = answer(slow(routes, base | lo), &mut dir.answers);
                        dir.blocks[(b3 as usize) << 8 | lo as usize] = v;
                    }
                    CHILD | b3
                } else {
                    answer(slow(routes, base), &mut dir.answers)
                };
                dir.blocks[(b2 as usize) << 8 | mid as usize] = v;
            }
        }
        Some(dir)
    }

    fn new_block(&mut self) -> u32 {
        let b = self.blocks.len() >> 8;
        self.blocks.resize(self.blocks.len() + 256, 0);
        b as u32
    }

    /// Whether it was built from exactly these tables.
    pub(super) fn is_of(&self, routes: &[Arc<Lpm>; 3]) -> bool {
        self.from.iter().zip(routes).all(|(a, b)| Arc::ptr_eq(a, b))
    }

    pub(super) fn lookup(&self, a: u32) -> Option<&RouteEntry> {
        let mut s = self.stage1[(a >> 16) as usize];
        if s & CHILD != 0 {
            s = self.blocks[((s & !CHILD) as usize) << 8 | (a >> 8 & 0xff) as usize];
            if s & CHILD != 0 {
                s = self.blocks[((s & !CHILD) as usize) << 8 | (a & 0xff) as usize];
            }
        }
        s.checked_sub(1).map(|i| &self.answers[i as usize])
    }

    /// Next-stage blocks (for the mirror's log).
    pub(super) fn blocks(&self) -> usize {
        self.blocks.len() >> 8
    }
}

#[cfg(test)]
mod tests {
    use super::super::table::{Hop, Kind, Lpm, RouteEntry};
    use super::*;

    fn entry(kind: Kind, metric: u32, tos: u8) -> RouteEntry {
        RouteEntry {
            kind,
            metric,
            tos,
            src_len: 0,
            hop: Some(Hop {
                ifindex: metric,
                gateway: None,
            }),
            prefsrc: None,
            unsupported: false,
        }
    }

    /// A small xorshift: the test's tables are random but the same on every run.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    fn add(lpm: &mut Lpm, p: u32, len: u8, e: RouteEntry) {
        let p = super::super::table::mask(u128::from(p), len, 32);
        lpm.entries_mut(p, len).push(e);
    }

    /// Random tables over a few /8s (so prefixes nest and overlap): every kind, throws,
    /// TOS routes (invisible) alone and over visible ones, a default route sometimes.
    fn random_tables(rng: &mut Rng, n: usize) -> [Arc<Lpm>; 3] {
        let mut t: [Lpm; 3] = Default::default();
        let mut metric = 1;
        for (i, lpm) in t.iter_mut().enumerate() {
            if rng.below(2) == 0 {
                add(lpm, 0, 0, entry(Kind::Unicast, 1000 + i as u32, 0));
            }
            for _ in 0..n {
                let p = (10 + rng.below(3) as u32) << 24 | (rng.next() as u32 & 0x03ff_ffff);
                let len = match rng.below(4) {
                    0 => rng.below(33) as u8,
                    1 => 24 + rng.below(9) as u8,
                    2 => 16 + rng.below(9) as u8,
                    _ => 8 + rng.below(9) as u8,
                };
                let kind = match rng.below(6) {
                    0 => Kind::Throw,
                    1 => Kind::Local,
                    2 => Kind::Reject,
                    _ => Kind::Unicast,
                };
                let tos = if rng.below(8) == 0 { 4 } else { 0 };
                metric += 1;
                add(lpm, p, len, entry(kind, metric, tos));
            }
        }
        t.map(Arc::new)
    }

    /// Addresses to check: random ones and both ends (and the neighbours) of every
    /// prefix.
    fn probes(rng: &mut Rng, t: &[Arc<Lpm>; 3]) -> Vec<u32> {
        let mut v: Vec<u32> = (0..20_000).map(|_| rng.next() as u32).collect();
        v.extend((0..20_000).map(|_| (10 + rng.below(3) as u32) << 24 | rng.next() as u32 >> 8));
        for lpm in t {
            for (p, len, _) in lpm.visible() {
                let first = p as u32;
                let last = first | (u32::MAX.checked_shr(u32::from(len)).unwrap_or(0));
                v.extend([first, last, first.wrapping_sub(1), last.wrapping_add(1)]);
            }
        }
        v
    }

    #[test]
    fn answers_as_the_hash_levels_on_random_tables() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..40 {
            let t = random_tables(&mut rng, 5 + round * 4);
            let dir = Dir4::build(&t).expect("within the block limit");
            assert!(dir.is_of(&t));
            for a in probes(&mut rng, &t) {
                assert_eq!(
                    dir.lookup(a),
                    slow(&t, a),
                    "round {round}, address {}",
                    std::net::Ipv4Addr::from(a)
                );
            }
        }
    }

    #[test]
    fn empty_tables_have_no_route_and_other_tables_are_not_its_own() {
        let t: [Arc<Lpm>; 3] = Default::default();
        let dir = Dir4::build(&t).expect("built");
        assert_eq!(dir.lookup(0x0a00_0001), None);
        assert_eq!(dir.blocks(), 0);
        let other: [Arc<Lpm>; 3] = Default::default();
        assert!(!dir.is_of(&other));
    }

    #[test]
    fn too_many_fine_prefixes_are_left_to_the_hash_levels() {
        let mut lpm = Lpm::default();
        for i in 0..MAX_BLOCKS as u32 + 1 {
            add(&mut lpm, i << 16, 32, entry(Kind::Unicast, 1, 0));
        }
        let t = [Arc::new(lpm), Arc::default(), Arc::default()];
        assert!(Dir4::build(&t).is_none());
    }
}
