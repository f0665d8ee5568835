//! Endpoint selection for a new connection: kube-proxy's uniform random choice (nftables'
//! `numgen random`), ClientIP session affinity, and, as options, Maglev consistent
//! hashing and the IPVS schedulers (rr, wrr, lc, wlc, sh, dh, sed, nq).
//!
//! Pure: randomness, connection counts and round-robin positions come from the caller, so
//! every choice is reproducible in tests. ClientIP affinity is remembered per node by
//! the caller (`conntrack::AffinityTable`).

use std::net::SocketAddr;

use crate::model::Endpoint;

pub use crate::model::Scheduler;

/// What a scheduler may look at for one new connection.
pub struct PickInput<'a> {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub proto: u8,
    /// A fresh random number from the caller.
    pub random: u64,
    /// Active connections per endpoint, for the least-connection family.
    pub active: &'a dyn Fn(SocketAddr) -> u32,
}

impl std::fmt::Debug for PickInput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PickInput")
            .field("src", &self.src)
            .field("dst", &self.dst)
            .field("proto", &self.proto)
            .finish_non_exhaustive()
    }
}

/// Round-robin position of one candidate list (one per node, shared by the workers).
#[derive(Debug, Clone, Copy, Default)]
pub struct RrCursor {
    index: usize,
    current_weight: u32,
}

/// Picks one of `candidates` (indices into `endpoints`). `equal_weights` says that the
/// candidates' weights are all the same ([`crate::model::Categorized::equal_weights`]):
/// the random scheduler then reads no endpoint, which at thousands of Services saves a
/// cache miss per candidate. `table` is the candidates' consistent-hash table (see
/// [`maglev_table`]) for the hashing schedulers.
///
/// Returns `None` only when `candidates` is empty.
pub fn pick(
    scheduler: Scheduler,
    endpoints: &[Endpoint],
    candidates: &[u32],
    equal_weights: bool,
    table: Option<&[u16]>,
    input: &PickInput<'_>,
    cursor: &mut RrCursor,
) -> Option<u32> {
    if candidates.is_empty() {
        return None;
    }
    let n = candidates.len();
    let weight = |i: usize| endpoints[candidates[i] as usize].weight;
    let addr = |i: usize| endpoints[candidates[i] as usize].addr;
    let chosen = match scheduler {
        Scheduler::Random if equal_weights => (input.random % n as u64) as usize,
        Scheduler::Random => weighted_random(n, &weight, input.random),
        Scheduler::RoundRobin => {
            let i = cursor.index % n;
            cursor.index = (i + 1) % n;
            i
        }
        Scheduler::WeightedRoundRobin => weighted_rr(n, &weight, cursor),
        Scheduler::LeastConnection => min_by_ratio(n, |i| ((input.active)(addr(i)) as u64, 1)),
        Scheduler::WeightedLeastConnection => {
            min_by_ratio(n, |i| ((input.active)(addr(i)) as u64, weight(i) as u64))
        }
        Scheduler::ShortestExpectedDelay => min_by_ratio(n, |i| {
            ((input.active)(addr(i)) as u64 + 1, weight(i) as u64)
        }),
        Scheduler::NeverQueue => (0..n)
            .find(|&i| weight(i) > 0 && (input.active)(addr(i)) == 0)
            .unwrap_or_else(|| {
                min_by_ratio(n, |i| {
                    ((input.active)(addr(i)) as u64 + 1, weight(i) as u64)
                })
            }),
        Scheduler::SourceHash | Scheduler::DestinationHash | Scheduler::Maglev => {
            let h = match scheduler {
                Scheduler::SourceHash => hash_ip(input.src.ip(), 0),
                Scheduler::DestinationHash => hash_ip(input.dst.ip(), 0),
                _ => hash_flow(input),
            };
            match table {
                Some(t) if !t.is_empty() => t[(h % t.len() as u64) as usize] as usize,
                _ => (h % n as u64) as usize,
            }
        }
    };
    Some(candidates[chosen.min(n - 1)])
}

fn weighted_random(n: usize, weight: &dyn Fn(usize) -> u32, random: u64) -> usize {
    let total: u64 = (0..n).map(|i| weight(i) as u64).sum();
    if total == 0 || (0..n).all(|i| weight(i) == weight(0)) {
        return (random % n as u64) as usize;
    }
    let mut r = random % total;
    for i in 0..n {
        let w = weight(i) as u64;
        if r < w {
            return i;
        }
        r -= w;
    }
    n - 1
}

/// IPVS's `ip_vs_wrr_schedule`: interleaved weighted round robin stepping the current
/// weight down by the weights' gcd.
fn weighted_rr(n: usize, weight: &dyn Fn(usize) -> u32, cur: &mut RrCursor) -> usize {
    let max = (0..n).map(weight).max().unwrap_or(0);
    if max == 0 {
        let i = cur.index % n;
        cur.index = (i + 1) % n;
        return i;
    }
    let g = (0..n).map(weight).filter(|&w| w > 0).fold(0, gcd).max(1);
    // At most one full sweep per weight step; bounded by n * (max / g + 1) iterations.
    for _ in 0..(n * (max / g + 1) as usize + 1) {
        cur.index = (cur.index + 1) % n;
        if cur.index == 0 {
            cur.current_weight = cur.current_weight.saturating_sub(g);
            if cur.current_weight == 0 {
                cur.current_weight = max;
            }
        }
        if weight(cur.index) >= cur.current_weight {
            return cur.index;
        }
    }
    cur.index % n
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The index minimising `num / den` (endpoints of weight 0 are skipped unless all are).
fn min_by_ratio(n: usize, f: impl Fn(usize) -> (u64, u64)) -> usize {
    let mut best: Option<(usize, u64, u64)> = None;
    for i in 0..n {
        let (num, den) = f(i);
        if den == 0 {
            continue;
        }
        match best {
            Some((_, bn, bd)) if num * bd >= bn * den => {}
            _ => best = Some((i, num, den)),
        }
    }
    best.map_or(0, |(i, _, _)| i)
}

/// Size of the Maglev lookup table: a prime well above 100 × the endpoint count, as the
/// Maglev paper recommends for < 1% imbalance.
pub fn maglev_size(endpoints: usize) -> usize {
    if endpoints <= 160 { 16_381 } else { 65_521 }
}

/// Builds the Maglev lookup table (Eisenbud et al., NSDI'16, section 3.4) for
/// `candidates`; each entry is a position in `candidates`. An endpoint of weight `w` takes
/// `w` turns per round. Keyed on the endpoints' addresses, so every node builds the same
/// table for the same endpoint set.
pub fn maglev_table(endpoints: &[Endpoint], candidates: &[u32]) -> Vec<u16> {
    let n = candidates.len().min(u16::MAX as usize);
    if n == 0 {
        return Vec::new();
    }
    let m = maglev_size(n);
    let mut offset = Vec::with_capacity(n);
    let mut skip = Vec::with_capacity(n);
    for &c in &candidates[..n] {
        let key = endpoints[c as usize].addr;
        offset.push((hash_sockaddr(key, 0x6d61_676c) % m as u64) as usize);
        skip.push((hash_sockaddr(key, 0x6576_3031) % (m as u64 - 1)) as usize + 1);
    }
    let weights: Vec<u32> = candidates[..n]
        .iter()
        .map(|&c| endpoints[c as usize].weight.max(1))
        .collect();
    let mut next = vec![0usize; n];
    let mut table = vec![u16::MAX; m];
    let mut filled = 0;
    'fill: loop {
        for i in 0..n {
            for _ in 0..weights[i] {
                let mut slot = (offset[i] + next[i] * skip[i]) % m;
                while table[slot] != u16::MAX {
                    next[i] += 1;
                    slot = (offset[i] + next[i] * skip[i]) % m;
                }
                table[slot] = i as u16;
                next[i] += 1;
                filled += 1;
                if filled == m {
                    break 'fill;
                }
            }
        }
    }
    table
}

use wire::hash::ip_bytes;
pub use wire::hash::{hash_bytes, hash_ip};

fn hash_sockaddr(a: SocketAddr, seed: u64) -> u64 {
    let mut b = [0u8; 18];
    let mut ipb = [0u8; 16];
    let n = ip_bytes(a.ip(), &mut ipb);
    b[..n].copy_from_slice(&ipb[..n]);
    b[n..n + 2].copy_from_slice(&a.port().to_be_bytes());
    hash_bytes(&b[..n + 2], seed)
}

fn hash_flow(input: &PickInput<'_>) -> u64 {
    hash_sockaddr(input.src, input.proto as u64) ^ hash_sockaddr(input.dst, 0x5eed).rotate_left(17)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eps(n: usize, weights: &[u32]) -> Vec<Endpoint> {
        (0..n)
            .map(|i| Endpoint {
                addr: format!("198.18.1.{}:8080", i + 1).parse().unwrap(),
                is_local: false,
                ready: true,
                serving: true,
                terminating: false,
                zone_hints: vec![],
                node_hints: vec![],
                weight: weights.get(i).copied().unwrap_or(1),
            })
            .collect()
    }

    fn input(random: u64, src_port: u16, active: &dyn Fn(SocketAddr) -> u32) -> PickInput<'_> {
        PickInput {
            src: SocketAddr::new("198.18.0.1".parse().unwrap(), src_port),
            dst: "198.19.0.10:80".parse().unwrap(),
            proto: 6,
            random,
            active,
        }
    }

    fn xorshift(s: &mut u64) -> u64 {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    #[test]
    fn equal_weights_pick_what_reading_the_weights_picks() {
        let zero = |_| 0;
        let mut cur = RrCursor::default();
        let mut s = 0x9e37_79b9u64;
        for n in 1..12u32 {
            let e = eps(n as usize, &[]);
            let cand: Vec<u32> = (0..n).collect();
            for _ in 0..200 {
                let r = xorshift(&mut s);
                let inp = input(r, 1, &zero);
                let read = pick(Scheduler::Random, &e, &cand, false, None, &inp, &mut cur);
                let known = pick(Scheduler::Random, &e, &cand, true, None, &inp, &mut cur);
                assert_eq!(read, known, "{n} endpoints, random {r}");
            }
        }
    }

    #[test]
    fn random_is_uniform_enough() {
        let e = eps(3, &[]);
        let cand = [0, 1, 2];
        let zero = |_| 0;
        let mut counts = [0u32; 3];
        let mut s = 0x1234_5678u64;
        let mut cur = RrCursor::default();
        for _ in 0..30_000 {
            let r = xorshift(&mut s);
            let i = pick(
                Scheduler::Random,
                &e,
                &cand,
                false,
                None,
                &input(r, 1, &zero),
                &mut cur,
            );
            counts[i.unwrap() as usize] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn round_robin_cycles() {
        let e = eps(3, &[]);
        let zero = |_| 0;
        let mut cur = RrCursor::default();
        let got: Vec<u32> = (0..6)
            .map(|_| {
                pick(
                    Scheduler::RoundRobin,
                    &e,
                    &[0, 1, 2],
                    false,
                    None,
                    &input(0, 1, &zero),
                    &mut cur,
                )
                .unwrap()
            })
            .collect();
        assert_eq!(got, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn weighted_round_robin_follows_weights() {
        let e = eps(3, &[4, 3, 2]);
        let zero = |_| 0;
        let mut cur = RrCursor::default();
        let mut counts = [0; 3];
        for _ in 0..90 {
            let i = pick(
                Scheduler::WeightedRoundRobin,
                &e,
                &[0, 1, 2],
                false,
                None,
                &input(0, 1, &zero),
                &mut cur,
            );
            counts[i.unwrap() as usize] += 1;
        }
        assert_eq!(counts, [40, 30, 20]);
    }

    #[test]
    fn least_connection_family() {
        let e = eps(3, &[1, 3, 1]);
        let a = [e[0].addr, e[1].addr, e[2].addr];
        let active = move |x: SocketAddr| -> u32 {
            if x == a[0] {
                5
            } else if x == a[1] {
                9
            } else {
                6
            }
        };
        let c = [0, 1, 2];
        let by = |sched, active: &dyn Fn(SocketAddr) -> u32| {
            pick(
                sched,
                &e,
                &c,
                false,
                None,
                &input(0, 1, active),
                &mut RrCursor::default(),
            )
        };
        assert_eq!(by(Scheduler::LeastConnection, &active), Some(0));
        // 9/3 = 3 < 5/1 and 6/1.
        assert_eq!(by(Scheduler::WeightedLeastConnection, &active), Some(1));
        // (9+1)/3 = 3.3 < (5+1)/1.
        assert_eq!(by(Scheduler::ShortestExpectedDelay, &active), Some(1));
        let idle = move |x: SocketAddr| if x == a[2] { 0 } else { 7 };
        assert_eq!(by(Scheduler::NeverQueue, &idle), Some(2));
    }

    #[test]
    fn maglev_is_balanced_and_consistent() {
        let e = eps(10, &[]);
        let all: Vec<u32> = (0..10).collect();
        let t = maglev_table(&e, &all);
        assert_eq!(t.len(), 16_381);
        let mut counts = [0usize; 10];
        for &s in &t {
            counts[s as usize] += 1;
        }
        let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(*hi - *lo <= t.len() / 100, "{counts:?}");
        // Removing one endpoint moves few of the others' slots.
        let fewer: Vec<u32> = (0..9).collect();
        let t2 = maglev_table(&e, &fewer);
        let moved = t
            .iter()
            .zip(&t2)
            .filter(|(a, b)| **a != 9 && a != b)
            .count();
        assert!(moved < t.len() / 10, "moved {moved}");
    }

    #[test]
    fn hashing_schedulers_are_sticky() {
        let e = eps(5, &[]);
        let all: Vec<u32> = (0..5).collect();
        let t = maglev_table(&e, &all);
        let zero = |_| 0;
        let mut cur = RrCursor::default();
        for sched in [
            Scheduler::Maglev,
            Scheduler::SourceHash,
            Scheduler::DestinationHash,
        ] {
            let a = pick(
                sched,
                &e,
                &all,
                false,
                Some(&t),
                &input(1, 40000, &zero),
                &mut cur,
            );
            let b = pick(
                sched,
                &e,
                &all,
                false,
                Some(&t),
                &input(99, 40000, &zero),
                &mut cur,
            );
            assert_eq!(a, b, "{sched:?}");
        }
        // sh ignores the source port; maglev does not need to.
        let a = pick(
            Scheduler::SourceHash,
            &e,
            &all,
            false,
            Some(&t),
            &input(1, 1, &zero),
            &mut cur,
        );
        let b = pick(
            Scheduler::SourceHash,
            &e,
            &all,
            false,
            Some(&t),
            &input(1, 2, &zero),
            &mut cur,
        );
        assert_eq!(a, b);
    }

    #[test]
    fn empty_candidates_pick_nothing() {
        let e = eps(1, &[]);
        let zero = |_| 0;
        let mut cur = RrCursor::default();
        assert_eq!(
            pick(
                Scheduler::Random,
                &e,
                &[],
                false,
                None,
                &input(1, 1, &zero),
                &mut cur
            ),
            None
        );
    }

    #[test]
    fn scheduler_names_round_trip() {
        for s in [
            Scheduler::Random,
            Scheduler::RoundRobin,
            Scheduler::WeightedRoundRobin,
            Scheduler::LeastConnection,
            Scheduler::WeightedLeastConnection,
            Scheduler::SourceHash,
            Scheduler::DestinationHash,
            Scheduler::ShortestExpectedDelay,
            Scheduler::NeverQueue,
            Scheduler::Maglev,
        ] {
            assert_eq!(Scheduler::parse(s.name()), Some(s));
        }
        assert_eq!(Scheduler::parse("bogus"), None);
    }
}
