//! Routes and their longest-prefix-match tables (one per routing table and family), as
//! the mirror holds them: what the FIB table and its IPv4 trie (`dir4`) are both built
//! from.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

pub(super) type FastMap<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

/// What a route does with a matching packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Unicast,
    /// local, broadcast, anycast: the kernel delivers to this host.
    Local,
    /// blackhole, unreachable, prohibit, multicast and kinds not modelled.
    Reject,
    /// Not in this table: go on with the next one.
    Throw,
}

/// The first live nexthop of a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Hop {
    pub ifindex: u32,
    /// `None` for an on-link route (the destination itself is the neighbour).
    pub gateway: Option<IpAddr>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RouteEntry {
    pub kind: Kind,
    pub metric: u32,
    pub tos: u8,
    /// IPv6 source-specific route (`from` prefix): not modelled, never matched.
    pub src_len: u8,
    pub hop: Option<Hop>,
    pub prefsrc: Option<IpAddr>,
    /// Nexthop object or encapsulation: the lookup answers Unreachable.
    pub unsupported: bool,
}

impl RouteEntry {
    /// Whether the entry takes part in lookups (the kernel would match TOS and source
    /// prefixes against packet fields the mirror does not see).
    fn matches_any_packet(&self) -> bool {
        self.tos == 0 && self.src_len == 0
    }
}

/// Longest-prefix match over one table of one family: one hash map per prefix length
/// present, longest first. A host has a handful of lengths (/32, /24, /0 ...), so a
/// lookup is a few hash probes.
#[derive(Debug, Clone, Default)]
pub(super) struct Lpm {
    levels: Vec<Level>,
}

#[derive(Debug, Clone)]
struct Level {
    len: u8,
    /// Masked address → entries of that prefix, best (lowest metric) first.
    prefixes: FastMap<u128, Vec<RouteEntry>>,
}

pub(super) fn ip_bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

pub(super) fn width(ip: IpAddr) -> u8 {
    if ip.is_ipv4() { 32 } else { 128 }
}

/// `bits` (an address of `width` bits) with everything past `len` cleared.
pub(super) fn mask(bits: u128, len: u8, width: u8) -> u128 {
    if len == 0 {
        return 0;
    }
    let len = len.min(width);
    let host = u32::from(width - len);
    let ones = if width == 128 {
        u128::MAX
    } else {
        (1u128 << width) - 1
    };
    bits & (ones >> host << host)
}

impl Lpm {
    /// The best entry of the longest matching prefix, if any.
    pub fn lookup(&self, bits: u128, width: u8) -> Option<&RouteEntry> {
        self.levels.iter().find_map(|level| {
            let entries = level.prefixes.get(&mask(bits, level.len, width))?;
            entries.iter().find(|e| e.matches_any_packet())
        })
    }

    /// Entries of one exact prefix, mutable (creating the level on demand).
    pub fn entries_mut(&mut self, prefix: u128, len: u8) -> &mut Vec<RouteEntry> {
        let at = match self.levels.binary_search_by(|l| len.cmp(&l.len)) {
            Ok(at) => at,
            Err(at) => {
                self.levels.insert(
                    at,
                    Level {
                        len,
                        prefixes: FastMap::default(),
                    },
                );
                at
            }
        };
        self.levels[at].prefixes.entry(prefix).or_default()
    }

    /// Drops empty prefixes and levels after removals.
    pub fn prune(&mut self, prefix: u128, len: u8) {
        if let Ok(at) = self.levels.binary_search_by(|l| len.cmp(&l.len)) {
            let level = &mut self.levels[at];
            if level.prefixes.get(&prefix).is_some_and(Vec::is_empty) {
                level.prefixes.remove(&prefix);
            }
            if level.prefixes.is_empty() {
                self.levels.remove(at);
            }
        }
    }

    /// Every prefix with an entry that takes part in lookups, with that entry (the one
    /// [`Lpm::lookup`] answers).
    pub fn visible(&self) -> impl Iterator<Item = (u128, u8, &RouteEntry)> {
        self.levels.iter().flat_map(|l| {
            l.prefixes.iter().filter_map(move |(&p, entries)| {
                Some((p, l.len, entries.iter().find(|e| e.matches_any_packet())?))
            })
        })
    }

    pub fn len(&self) -> usize {
        self.levels
            .iter()
            .map(|l| l.prefixes.values().map(Vec::len).sum::<usize>())
            .sum()
    }
}

/// The entry of the first of `tables` (in [`TABLES`] order) whose longest matching
/// prefix is not a `throw`: what the kernel's default rules pick for `bits`.
pub(super) fn lookup_tables(tables: &[Arc<Lpm>; 3], bits: u128, width: u8) -> Option<&RouteEntry> {
    tables
        .iter()
        .filter_map(|lpm| lpm.lookup(bits, width))
        .find(|e| e.kind != Kind::Throw)
}
