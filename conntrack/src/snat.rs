//! SNAT (masquerade) source ports, from a range that belongs to one worker.
//!
//! Why per-worker ranges: a reply to a masqueraded flow comes back to the SNAT address,
//! on whatever NIC queue the hardware picks. Its destination port is the one the owner
//! allocated, so any worker can compute the owner from it ([`SnatPorts::owner`]) and hand
//! the packet over, without a shared table.
//!
//! A port is free for a flow when no live entry has the reply tuple
//! `endpoint -> snat_ip:port`, so the same port can serve many endpoints at once, and a
//! port comes back by itself when its entry goes: there is no separate bitmap to keep in
//! step. Ports are picked at random (as kube-proxy's `MASQUERADE --random-fully`), so that
//! a masqueraded DNS query keeps an unpredictable source port. The search is bounded
//! like Linux's `nf_nat_l4proto_unique_tuple`: a range of at most [`SnatPorts::MAX_PROBES`]
//! ports is scanned in full; a larger one is probed that many times at random, so on a
//! nearly exhausted large range an allocation may fail although a few ports are free.

use std::hash::BuildHasher;
use std::ops::RangeInclusive;

use hashbrown::DefaultHashBuilder;

/// Why a SNAT port range was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnatRangeError {
    /// `lo > hi`, or the range includes port 0.
    #[error(
        "SNAT port range {lo}-{hi} is empty or includes port 0; give LOW-HIGH with 1 <= LOW <= HIGH, e.g. 32768-60999"
    )]
    Invalid {
        /// First port asked for.
        lo: u16,
        /// Last port asked for.
        hi: u16,
    },
    /// Zero workers, or fewer ports than workers.
    #[error(
        "SNAT port range {lo}-{hi} ({ports} ports) cannot be split between {workers} workers; widen the range or run fewer workers"
    )]
    TooFewPorts {
        /// First port of the range.
        lo: u16,
        /// Last port of the range.
        hi: u16,
        /// Ports in the range.
        ports: usize,
        /// Workers asked for.
        workers: usize,
    },
}

/// One worker's SNAT source ports and its random state.
#[derive(Debug, Clone)]
pub struct SnatPorts {
    lo: u16,
    hi: u16,
    rng: u64,
}

impl SnatPorts {
    /// Most ports looked at for one allocation.
    pub const MAX_PROBES: usize = 128;

    /// The ports `range`, with a random seed.
    ///
    /// # Errors
    /// [`SnatRangeError::Invalid`] if the range is empty or includes port 0.
    pub fn new(range: RangeInclusive<u16>) -> Result<SnatPorts, SnatRangeError> {
        SnatPorts::with_seed(range, DefaultHashBuilder::default().hash_one(0u8))
    }

    /// The ports `range`, with a fixed seed (reproducible port choices, for tests).
    ///
    /// # Errors
    /// [`SnatRangeError::Invalid`] if the range is empty or includes port 0.
    pub fn with_seed(range: RangeInclusive<u16>, seed: u64) -> Result<SnatPorts, SnatRangeError> {
        let (lo, hi) = (*range.start(), *range.end());
        if lo == 0 || lo > hi {
            return Err(SnatRangeError::Invalid { lo, hi });
        }
        Ok(SnatPorts { lo, hi, rng: seed })
    }

    /// Splits `range` into `workers` contiguous ranges of equal size (the last one takes
    /// the remainder); worker `i` gets element `i`. [`SnatPorts::owner`] inverts it.
    ///
    /// # Errors
    /// [`SnatRangeError::Invalid`] for a bad range, [`SnatRangeError::TooFewPorts`] if
    /// `workers` is 0 or larger than the number of ports.
    pub fn split(
        range: RangeInclusive<u16>,
        workers: usize,
    ) -> Result<Vec<SnatPorts>, SnatRangeError> {
        let whole = SnatPorts::new(range)?;
        let chunk = whole.chunk(workers)?;
        let (lo, hi) = (usize::from(whole.lo), usize::from(whole.hi));
        (0..workers)
            .map(|i| {
                let first = lo + i * chunk;
                let last = if i + 1 == workers {
                    hi
                } else {
                    first + chunk - 1
                };
                // Both fit: lo <= first <= last <= hi.
                let to16 = |p: usize| u16::try_from(p).unwrap_or(u16::MAX);
                SnatPorts::new(to16(first)..=to16(last))
            })
            .collect()
    }

    /// Which of `workers` owns `port` when `range` was [`split`](SnatPorts::split)
    /// between them; `None` if the port is outside the range or the split is impossible.
    pub fn owner(range: RangeInclusive<u16>, workers: usize, port: u16) -> Option<usize> {
        let whole = SnatPorts::with_seed(range, 0).ok()?;
        let chunk = whole.chunk(workers).ok()?;
        if !whole.contains(port) {
            return None;
        }
        Some((usize::from(port - whole.lo) / chunk).min(workers - 1))
    }

    fn chunk(&self, workers: usize) -> Result<usize, SnatRangeError> {
        let ports = self.port_count();
        if workers == 0 || workers > ports {
            return Err(SnatRangeError::TooFewPorts {
                lo: self.lo,
                hi: self.hi,
                ports,
                workers,
            });
        }
        Ok(ports / workers)
    }

    /// The ports, as given.
    pub fn range(&self) -> RangeInclusive<u16> {
        self.lo..=self.hi
    }

    /// How many ports (at least 1).
    pub fn port_count(&self) -> usize {
        usize::from(self.hi - self.lo) + 1
    }

    /// Whether `port` is one of these, i.e. whether a reply to it belongs to this worker.
    pub fn contains(&self, port: u16) -> bool {
        (self.lo..=self.hi).contains(&port)
    }

    /// splitmix64: small, fast, and good enough to make ports unpredictable off-path.
    fn next_random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn port_at(&self, offset: u64) -> u16 {
        let off = offset % self.port_count() as u64;
        // off < port_count, so lo + off <= hi.
        self.lo + u16::try_from(off).unwrap_or(0)
    }

    /// A port for which `taken` is false, or `None` after the bounded search (see the
    /// module docs).
    pub(crate) fn pick(&mut self, mut taken: impl FnMut(u16) -> bool) -> Option<u16> {
        let n = self.port_count();
        if n <= SnatPorts::MAX_PROBES {
            let start = self.next_random();
            (0..n as u64)
                .map(|i| self.port_at(start.wrapping_add(i)))
                .find(|&p| !taken(p))
        } else {
            (0..SnatPorts::MAX_PROBES)
                .map(|_| {
                    let r = self.next_random();
                    self.port_at(r)
                })
                .find(|&p| !taken(p))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn rejects_bad_ranges() {
        let (lo, hi) = (10, 9);
        assert!(matches!(
            SnatPorts::new(lo..=hi),
            Err(SnatRangeError::Invalid { lo: 10, hi: 9 })
        ));
        assert!(SnatPorts::new(0..=9).is_err());
        assert!(SnatPorts::split(1000..=1002, 4).is_err());
        assert!(SnatPorts::split(1000..=1002, 0).is_err());
        let e = SnatPorts::split(1000..=1002, 4).unwrap_err().to_string();
        assert!(e.contains("fewer workers"), "{e}");
    }

    #[test]
    fn split_and_owner_agree() {
        for (range, workers) in [(32768..=60999, 3), (1000..=1009, 4), (1..=65535, 1)] {
            let parts = SnatPorts::split(range.clone(), workers).unwrap();
            assert_eq!(parts.len(), workers);
            assert_eq!(parts[0].range().start(), range.start());
            assert_eq!(parts[workers - 1].range().end(), range.end());
            let total: usize = parts.iter().map(SnatPorts::port_count).sum();
            assert_eq!(total, usize::from(range.end() - range.start()) + 1);
            for port in range.clone() {
                let owner = SnatPorts::owner(range.clone(), workers, port).unwrap();
                assert!(parts[owner].contains(port), "port {port} owner {owner}");
            }
            assert_eq!(SnatPorts::owner(range.clone(), workers, 0), None);
        }
    }

    #[test]
    fn small_range_is_searched_in_full() {
        let mut p = SnatPorts::with_seed(2000..=2009, 1).unwrap();
        let mut used = HashSet::new();
        for _ in 0..10 {
            let port = p.pick(|x| used.contains(&x)).unwrap();
            assert!(p.contains(port));
            assert!(used.insert(port));
        }
        assert_eq!(p.pick(|x| used.contains(&x)), None);
        used.remove(&2004);
        assert_eq!(p.pick(|x| used.contains(&x)), Some(2004));
    }

    #[test]
    fn large_range_probes_a_bounded_number_of_ports() {
        let mut p = SnatPorts::with_seed(1024..=65535, 7).unwrap();
        let mut probes = 0;
        assert_eq!(
            p.pick(|_| {
                probes += 1;
                true
            }),
            None
        );
        assert_eq!(probes, SnatPorts::MAX_PROBES);
        let a = p.pick(|_| false).unwrap();
        let b = p.pick(|_| false).unwrap();
        assert!(p.contains(a) && p.contains(b));
    }
}
