//! SNAT (masquerade) source ports, and which worker owns a flow.
//!
//! Ownership: a flow belongs to the worker [`flow_owner`] names for its client side, the
//! address and port that both directions of the flow carry: the source of the client's
//! packets, and the destination of the endpoint's answers. For an un-masqueraded flow
//! that is the client's own address and port; for a masqueraded one the answers carry the
//! SNAT address and port instead, so each worker allocates only ports that
//! [`flow_owner`] maps back to itself ([`SnatPorts::for_workers`]). Any worker can then
//! compute the owner of any packet from its headers alone, exactly, whatever port the
//! client chose and whether or not the flow was masqueraded, without a shared table.
//!
//! A port is free for a flow when no live entry has the reply tuple
//! `endpoint -> snat_ip:port`, so the same port can serve many endpoints at once, and a
//! port comes back by itself when its entry goes: there is no separate bitmap to keep in
//! step. Ports are picked at random (as kube-proxy's `MASQUERADE --random-fully`), so that
//! a masqueraded DNS query keeps an unpredictable source port. The search is bounded
//! like Linux's `nf_nat_l4proto_unique_tuple`: a worker's share of at most
//! [`SnatPorts::MAX_PROBES`] ports is scanned in full; a larger one is probed that many
//! times at random, so on a nearly exhausted large range an allocation may fail although
//! a few ports are free.

use std::hash::BuildHasher;
use std::net::IpAddr;
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

/// Which of `workers` workers owns the flows whose client side is `ip:port` (see the
/// module docs). Stable: the same on every run and every node, so a restarted process
/// with the same worker count finds each flow where it left it.
pub fn flow_owner(ip: IpAddr, port: u16, workers: usize) -> usize {
    if workers <= 1 {
        return 0;
    }
    let w = workers as u64;
    ((ip_share(ip, w) + u64::from(port)) % w) as usize
}

/// The address's contribution to [`flow_owner`], `< w`.
fn ip_share(ip: IpAddr, w: u64) -> u64 {
    wire::hash::hash_ip(ip, 0x6f77_6e65) % w
}

/// One worker's SNAT source ports (the ports of the range that [`flow_owner`] maps to
/// it, for the SNAT address in use) and its random state.
#[derive(Debug, Clone)]
pub struct SnatPorts {
    lo: u16,
    hi: u16,
    worker: usize,
    workers: usize,
    rng: u64,
}

impl SnatPorts {
    /// Most ports looked at for one allocation.
    pub const MAX_PROBES: usize = 128;

    /// The ports `range` for a single worker, with a random seed.
    ///
    /// # Errors
    /// [`SnatRangeError::Invalid`] if the range is empty or includes port 0.
    pub fn new(range: RangeInclusive<u16>) -> Result<SnatPorts, SnatRangeError> {
        SnatPorts::with_seed(range, DefaultHashBuilder::default().hash_one(0u8))
    }

    /// The ports `range` for a single worker, with a fixed seed (reproducible port
    /// choices, for tests).
    ///
    /// # Errors
    /// [`SnatRangeError::Invalid`] if the range is empty or includes port 0.
    pub fn with_seed(range: RangeInclusive<u16>, seed: u64) -> Result<SnatPorts, SnatRangeError> {
        let (lo, hi) = (*range.start(), *range.end());
        if lo == 0 || lo > hi {
            return Err(SnatRangeError::Invalid { lo, hi });
        }
        Ok(SnatPorts {
            lo,
            hi,
            worker: 0,
            workers: 1,
            rng: seed,
        })
    }

    /// One [`SnatPorts`] per worker over the whole of `range`: worker `i` (element `i`)
    /// allocates only ports that [`flow_owner`] maps to `i`, about `1/workers` of them.
    ///
    /// # Errors
    /// [`SnatRangeError::Invalid`] for a bad range, [`SnatRangeError::TooFewPorts`] if
    /// `workers` is 0 or larger than the number of ports.
    pub fn for_workers(
        range: RangeInclusive<u16>,
        workers: usize,
    ) -> Result<Vec<SnatPorts>, SnatRangeError> {
        let whole = SnatPorts::new(range)?;
        let ports = whole.port_count();
        if workers == 0 || workers > ports {
            return Err(SnatRangeError::TooFewPorts {
                lo: whole.lo,
                hi: whole.hi,
                ports,
                workers,
            });
        }
        Ok((0..workers)
            .map(|worker| SnatPorts {
                worker,
                workers,
                rng: DefaultHashBuilder::default().hash_one(worker),
                ..whole.clone()
            })
            .collect())
    }

    /// The worker these ports belong to, and how many workers share the range.
    pub fn worker(&self) -> (usize, usize) {
        (self.worker, self.workers)
    }

    /// The ports, as given.
    pub fn range(&self) -> RangeInclusive<u16> {
        self.lo..=self.hi
    }

    /// How many ports in the whole range (at least 1).
    pub fn port_count(&self) -> usize {
        usize::from(self.hi - self.lo) + 1
    }

    /// Whether `port` is in the range.
    pub fn contains(&self, port: u16) -> bool {
        (self.lo..=self.hi).contains(&port)
    }

    /// Whether this worker may allocate `port` for the SNAT address `ip`.
    pub fn owns(&self, ip: IpAddr, port: u16) -> bool {
        self.contains(port) && flow_owner(ip, port, self.workers) == self.worker
    }

    /// splitmix64: small, fast, and good enough to make ports unpredictable off-path.
    fn next_random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A port for the SNAT address `ip`, of this worker's share, for which `taken` is
    /// false, or `None` after the bounded search (see the module docs).
    pub(crate) fn pick(&mut self, ip: IpAddr, mut taken: impl FnMut(u16) -> bool) -> Option<u16> {
        // This worker's ports for `ip` are first, first + w, first + 2w, ... <= hi.
        let w = self.workers.max(1) as u64;
        let lo = u64::from(self.lo);
        let want = (self.worker as u64 % w + w - ip_share(ip, w)) % w;
        let first = lo + (want + w - lo % w) % w;
        if first > u64::from(self.hi) {
            return None;
        }
        let n = (u64::from(self.hi) - first) / w + 1;
        // first + k * w <= hi < 65536 for every k < n.
        let port = |k: u64| u16::try_from(first + (k % n) * w).unwrap_or(0);
        if n <= SnatPorts::MAX_PROBES as u64 {
            let start = self.next_random();
            (0..n)
                .map(|i| port(start.wrapping_add(i)))
                .find(|&p| !taken(p))
        } else {
            (0..SnatPorts::MAX_PROBES)
                .map(|_| {
                    let r = self.next_random();
                    port(r)
                })
                .find(|&p| !taken(p))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    const IP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(198, 18, 0, 1));

    #[test]
    fn rejects_bad_ranges() {
        let (lo, hi) = (10, 9);
        assert!(matches!(
            SnatPorts::new(lo..=hi),
            Err(SnatRangeError::Invalid { lo: 10, hi: 9 })
        ));
        assert!(SnatPorts::new(0..=9).is_err());
        assert!(SnatPorts::for_workers(1000..=1002, 4).is_err());
        assert!(SnatPorts::for_workers(1000..=1002, 0).is_err());
        let e = SnatPorts::for_workers(1000..=1002, 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("fewer workers"), "{e}");
    }

    /// Every port a worker allocates maps back to it, for any address and range, and
    /// together the workers can allocate every port of the range.
    #[test]
    fn workers_allocate_only_ports_they_own() {
        let ips: Vec<IpAddr> = vec![
            IP,
            "198.18.7.9".parse().unwrap(),
            "2001:db8::1".parse().unwrap(),
        ];
        for (range, workers) in [(32768..=60999, 3), (1000..=1009, 4), (61000..=65535, 2)] {
            let mut parts = SnatPorts::for_workers(range.clone(), workers).unwrap();
            for &ip in &ips {
                let mut all = HashSet::new();
                for (w, p) in parts.iter_mut().enumerate() {
                    // Exhaust this worker's share: every port found is owned by `w`.
                    let mut used = HashSet::new();
                    while let Some(port) = p.pick(ip, |x| used.contains(&x)) {
                        assert!(range.contains(&port));
                        assert_eq!(flow_owner(ip, port, workers), w, "{ip} {port}");
                        assert!(p.owns(ip, port));
                        assert!(used.insert(port));
                        if used.len() > 2 * SnatPorts::MAX_PROBES {
                            break;
                        }
                    }
                    all.extend(used);
                }
                let ports = usize::from(range.end() - range.start()) + 1;
                if ports / workers <= SnatPorts::MAX_PROBES {
                    assert_eq!(all.len(), ports, "{range:?} {ip}");
                }
            }
        }
    }

    #[test]
    fn ownership_spreads_clients_and_is_stable() {
        let mut per = [0usize; 4];
        for port in 40000..40400 {
            per[flow_owner(IP, port, 4)] += 1;
        }
        assert_eq!(per, [100; 4], "consecutive ports go round the workers");
        assert_eq!(flow_owner(IP, 5, 1), 0);
        // The same on every run: a restarted process finds its flows' owners unchanged.
        assert_eq!(flow_owner(IP, 40000, 4), flow_owner(IP, 40000, 4));
        let v6: IpAddr = "2001:db8::7".parse().unwrap();
        assert!(flow_owner(v6, 1, 64) < 64);
    }

    #[test]
    fn small_range_is_searched_in_full() {
        let mut p = SnatPorts::with_seed(2000..=2009, 1).unwrap();
        let mut used = HashSet::new();
        for _ in 0..10 {
            let port = p.pick(IP, |x| used.contains(&x)).unwrap();
            assert!(p.contains(port));
            assert!(used.insert(port));
        }
        assert_eq!(p.pick(IP, |x| used.contains(&x)), None);
        used.remove(&2004);
        assert_eq!(p.pick(IP, |x| used.contains(&x)), Some(2004));
    }

    #[test]
    fn large_range_probes_a_bounded_number_of_ports() {
        let mut p = SnatPorts::with_seed(1024..=65535, 7).unwrap();
        let mut probes = 0;
        assert_eq!(
            p.pick(IP, |_| {
                probes += 1;
                true
            }),
            None
        );
        assert_eq!(probes, SnatPorts::MAX_PROBES);
        let a = p.pick(IP, |_| false).unwrap();
        let b = p.pick(IP, |_| false).unwrap();
        assert!(p.contains(a) && p.contains(b));
    }
}
