//! The table itself: a slab of entries plus one hash index over both tuples of each.
//!
//! Layout, for a million entries per worker without a million allocations:
//! - `slots: Vec<Entry>` reserved once at the full capacity (untouched pages cost no
//!   memory); freed slots are chained through `Entry::next` and reused.
//! - `index` ([`crate::index`]) holds, per tuple, `slot << 1 | direction`: 4 bytes, not a
//!   copy of the 40-byte tuple, next to a 16-bit tag in one cache line per bucket.
//!   Equality is checked against the slab. It starts small and doubles as flows arrive,
//!   so a few hot flows stay in a few cache lines.
//! - Unassured live entries are also on a doubly linked list through `prev`/`next`, oldest
//!   first, so early drop finds its victim in O(1) (see [`crate`] docs for the policy).
//!
//! The hasher is foldhash with a per-table random seed: tuples are chosen by remote
//! peers, and a fixed hash would let them aim for one bucket chain.

use std::hash::{BuildHasher, Hash, Hasher};
use std::mem::{align_of, size_of};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use hashbrown::{DefaultHashBuilder, HashMap};
use wire::{Protocol, Tuple};

use crate::entry::{Direction, Entry, NIL, flag};
use crate::index::FlowIndex;
use crate::load::EndpointLoad;
use crate::snat::SnatPorts;
use crate::timeouts::{Timeouts, TimeoutsNs};
use crate::track::{self, Outcome, Update};

/// Counters, plain `u64`s: the table has one owner, who reads them for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Flows inserted.
    pub inserts: u64,
    /// Insertions refused because the table was full of assured flows.
    pub insert_failed_full: u64,
    /// Insertions refused because a tuple was already tracked (e.g. a SNAT port clash).
    pub clashes: u64,
    /// Unassured flows dropped early to make room for a new one.
    pub evictions: u64,
    /// Flows removed because they timed out (by [`ConnTable::expire`], on lookup, or to
    /// make room).
    pub expired: u64,
    /// UDP (or any) flows removed because their endpoint went away.
    pub removed_stale: u64,
    /// Flows removed by [`ConnTable::remove`] / [`ConnTable::remove_if`], or ended by a
    /// packet (a RST answering a SYN, a SYN reopening a closed connection).
    pub removed: u64,
}

/// Why [`ConnTable::insert`] refused a flow. The caller drops the packet and counts it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InsertError {
    /// One of the new flow's tuples belongs to a live flow already.
    #[error(
        "{tuple} ({which:?} direction of the new flow) is already tracked; allocate another SNAT port or drop the packet"
    )]
    Clash {
        /// Which of the new flow's tuples clashed.
        which: Direction,
        /// That tuple.
        tuple: Tuple,
    },
    /// The table is at capacity and holds only assured flows.
    #[error(
        "connection table full ({capacity} flows, all assured); raise conntrack maxPerCore/min or wait for flows to end"
    )]
    Full {
        /// The table's capacity.
        capacity: usize,
    },
    /// The first TCP segment of a flow was neither a SYN nor a bare ACK.
    #[error(
        "TCP flags {flags:#04x} cannot open a connection (a SYN, or an ACK picked up mid-stream)"
    )]
    NotNew {
        /// The segment's flags.
        flags: u8,
    },
    /// `orig` and `reply` name different protocols.
    #[error("orig {orig} and reply {reply} have different protocols")]
    ProtocolMismatch {
        /// The original tuple given.
        orig: Tuple,
        /// The reply tuple given.
        reply: Tuple,
    },
}

/// Why [`ConnTable::new`] failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapacityError {
    /// Zero, or beyond what a `u32` slot index addresses.
    #[error(
        "connection table capacity {capacity} is out of range 1..={max}; check conntrack maxPerCore/min and the worker count"
    )]
    OutOfRange {
        /// Capacity asked for.
        capacity: usize,
        /// Largest capacity supported.
        max: usize,
    },
    /// The memory could not be reserved.
    #[error(
        "cannot reserve memory for a connection table of {capacity} flows; lower conntrack maxPerCore/min"
    )]
    OutOfMemory {
        /// Capacity asked for.
        capacity: usize,
    },
}

/// A packet's flow, found by [`ConnTable::on_packet`].
#[derive(Debug, Clone, Copy)]
pub struct Hit<'a> {
    /// Which way the packet travels.
    pub dir: Direction,
    /// The flow, after this packet's update.
    pub entry: &'a Entry,
    /// What the packet did to the flow.
    pub update: Update,
}

impl Hit<'_> {
    /// The tuple to rewrite the packet to ([`Entry::rewrite_to`] for `dir`).
    pub fn rewrite_to(&self) -> Tuple {
        self.entry.rewrite_to(self.dir)
    }
}

/// One worker's connection table. See the [crate docs](crate) for the policies.
#[derive(Debug)]
pub struct ConnTable {
    pub(crate) slots: Vec<Entry>,
    pub(crate) index: FlowIndex,
    pub(crate) hasher: DefaultHashBuilder,
    pub(crate) capacity: usize,
    pub(crate) len: usize,
    /// Head of the free-slot list.
    pub(crate) free: u32,
    /// Oldest and newest unassured entries.
    pub(crate) unassured_head: u32,
    pub(crate) unassured_tail: u32,
    /// An unassured flow some way after the head, up to [`ConnTable::LOOKAHEAD`] places
    /// (`NIL`: none yet), and how many places after it is (an upper bound: a flow leaving
    /// the list between the two is not counted off). See [`ConnTable::look_ahead`].
    pub(crate) ahead: u32,
    pub(crate) ahead_by: u32,
    /// The dataplane's prefetch instruction ([`ConnTable::set_prefetch`]); by default
    /// nothing.
    pub(crate) prefetch: fn(*const u8),
    /// Next slot [`ConnTable::expire`] looks at.
    pub(crate) hand: usize,
    /// When [`ConnTable::expire_paced`] last ran (0: never), and the slot visits it owes
    /// (in slot-nanoseconds: slots × ns, divided by the period when spent).
    pub(crate) paced_at: u64,
    pub(crate) paced_credit: u64,
    pub(crate) config: Timeouts,
    pub(crate) timeouts: TimeoutsNs,
    pub(crate) snat: SnatPorts,
    pub(crate) stats: Stats,
    /// The node's flows per endpoint, kept up to date by insert and `remove_slot`.
    pub(crate) load: Option<Arc<EndpointLoad>>,
    /// Slots changed since the last [`ConnTable::drain_journal`], when journaling is on
    /// (see [`crate::persist`]).
    pub(crate) journal: Option<Vec<u32>>,
    /// Packets and bytes of the flows that left the table, per endpoint and protocol
    /// (so an endpoint's totals do not drop when its flows end).
    pub(crate) retired: HashMap<EndpointKey, Counts>,
    /// Those of the flows that left since `retired` was last brought up to date, in the
    /// order they left: a flow that goes appends here (a write to a line in cache), and
    /// [`RETIRED_BATCH`] of them are added to `retired` together, whose independent
    /// lookups then overlap their cache misses (with endpoints by the hundred thousand,
    /// one lookup per evicted flow on the packet path cost a miss each: 15% of a
    /// worker's time at 10,000 Services).
    pub(crate) retiring: Vec<(EndpointKey, Counts)>,
    /// A tuple the index does not hold, and its hash: the key of the last lookup that
    /// found no flow ([`ConnTable::on_packet_bytes`]). A packet that finds no flow is
    /// usually inserted next ([`ConnTable::insert_first`]), whose check that the tuple
    /// is free ([`ConnTable::claim`]) then neither hashes it nor looks it up again.
    /// Taken by `claim`; cleared by every insertion into the index (`place`), the only
    /// way a tuple gets in.
    pub(crate) absent: Option<(Tuple, u64)>,
}

/// An endpoint and a protocol: the key of the totals of flows gone. Hashed as one word
/// for IPv4 (one hasher round; the derived `Hash` of `(SocketAddr, Protocol)` took five,
/// and an evicted flow's totals are added on the new-connection path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EndpointKey(pub(crate) SocketAddr, pub(crate) Protocol);

impl Hash for EndpointKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let rest = (u64::from(self.0.port()) << 8) | u64::from(self.1.number());
        match self.0.ip() {
            IpAddr::V4(a) => state.write_u64((u64::from(a.to_bits()) << 24) | rest),
            IpAddr::V6(a) => {
                state.write_u128(a.to_bits());
                state.write_u64(rest);
            }
        }
    }
}

/// Packets and bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Packets, both directions.
    pub packets: u64,
    /// Bytes from the IP header on, both directions.
    pub bytes: u64,
}

// Two 40-byte tuples, 32 bytes of state and 16 of counters: two cache lines, kept so
// (bytes per entry is benchmarked), and aligned to them (`Entry` is `align(64)`).
const _: () = assert!(size_of::<Entry>() == 128 && align_of::<Entry>() == 64);

const fn pack(slot: usize, dir: Direction) -> u32 {
    ((slot as u32) << 1) | dir as u32
}

const fn unpack(v: u32) -> (usize, Direction) {
    ((v >> 1) as usize, Direction::from_bit(v))
}

/// The index's hash of a tuple. An IPv4 tuple is packed into one `u128`, so it costs
/// one hasher round instead of the derived `Hash`'s seven.
fn hash_tuple(hasher: &DefaultHashBuilder, t: &Tuple) -> u64 {
    let rest = (u64::from(t.sport) << 24) | (u64::from(t.dport) << 8) | u64::from(t.proto.number());
    match (t.src, t.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => hasher.hash_one(
            (u128::from(s.to_bits()) << 96) | (u128::from(d.to_bits()) << 64) | u128::from(rest),
        ),
        (s, d) => hasher.hash_one((s, d, rest)),
    }
}

/// Has both cache lines of an entry asked for (`prefetch`: the dataplane's hint).
fn prefetch_entry(e: &Entry, prefetch: &impl Fn(*const u8)) {
    let line: *const u8 = (&raw const *e).cast();
    prefetch(line);
    prefetch(line.wrapping_add(64));
}

/// Looks a tuple up; a free function so callers can borrow other fields meanwhile.
fn find(index: &FlowIndex, slots: &[Entry], hash: u64, key: &Tuple) -> Option<u32> {
    index.find(hash, |v| {
        let (slot, dir) = unpack(v);
        slots.get(slot).is_some_and(|e| e.tuple(dir) == key)
    })
}

/// Flows that left the table whose totals are added to their endpoints' together (see
/// `ConnTable::retiring`).
pub const RETIRED_BATCH: usize = 256;

impl ConnTable {
    /// Largest capacity: slot numbers must fit in 31 bits.
    pub const MAX_CAPACITY: usize = (1 << 31) - 2;

    /// Size of one entry in the slab, bytes.
    pub const ENTRY_SIZE: usize = size_of::<Entry>();

    /// A table for at most `capacity` flows: the entries' memory is reserved now, the
    /// index grows with the flows.
    ///
    /// # Errors
    /// [`CapacityError`] if `capacity` is 0 or above [`ConnTable::MAX_CAPACITY`], or the
    /// memory cannot be reserved.
    pub fn new(
        capacity: usize,
        timeouts: Timeouts,
        snat: SnatPorts,
    ) -> Result<ConnTable, CapacityError> {
        if capacity == 0 || capacity > ConnTable::MAX_CAPACITY {
            return Err(CapacityError::OutOfRange {
                capacity,
                max: ConnTable::MAX_CAPACITY,
            });
        }
        let oom = CapacityError::OutOfMemory { capacity };
        let mut slots = Vec::new();
        slots.try_reserve_exact(capacity).map_err(|_| oom.clone())?;
        let hasher = DefaultHashBuilder::default();
        // The index is sized for the full capacity now (two entries per flow, at most
        // 90% full), so it never allocates nor rehashes on the packet path; a worker
        // with few flows touches only their buckets, which stay in cache.
        let index = FlowIndex::try_with_capacity(2 * capacity).ok_or(oom)?;
        Ok(ConnTable {
            slots,
            index,
            hasher,
            capacity,
            len: 0,
            free: NIL,
            unassured_head: NIL,
            unassured_tail: NIL,
            ahead: NIL,
            ahead_by: 0,
            prefetch: |_| {},
            hand: 0,
            paced_at: 0,
            paced_credit: 0,
            config: timeouts,
            timeouts: TimeoutsNs::new(&timeouts),
            snat,
            stats: Stats::default(),
            load: None,
            journal: None,
            retired: HashMap::new(),
            retiring: Vec::with_capacity(RETIRED_BATCH),
            absent: None,
        })
    }

    /// Counts this table's flows inserted with [`ConnTable::insert_counted`] in `load`
    /// from now on (share one load between the tables of a node). Such flows already
    /// held are added to it.
    pub fn set_load(&mut self, load: Arc<EndpointLoad>) {
        for e in self
            .slots
            .iter()
            .filter(|e| e.is_live() && e.flags & flag::LOADED != 0)
        {
            load.add(e.reply.src_addr());
        }
        self.load = Some(load);
    }

    /// As [`ConnTable::insert`], and the flow counts in the node's endpoint load while it
    /// lives (for a Service with a least-connection scheduler: IPVS counts connections
    /// per destination of a virtual service, so only those Services' flows count).
    ///
    /// # Errors
    /// As [`ConnTable::insert`].
    pub fn insert_counted(
        &mut self,
        orig: Tuple,
        reply: Tuple,
        tag: u32,
        tcp_flags: u8,
        now: u64,
    ) -> Result<&Entry, InsertError> {
        self.insert_flags(orig, reply, tag, tcp_flags, now, flag::LOADED, 0)
    }

    /// [`ConnTable::insert`] (or, `counted`, [`ConnTable::insert_counted`]) of a flow
    /// whose first packet is `bytes` long (from its IP header on): the flow's counters
    /// start with it.
    ///
    /// # Errors
    /// As [`ConnTable::insert`].
    #[allow(clippy::too_many_arguments)]
    pub fn insert_first(
        &mut self,
        orig: Tuple,
        reply: Tuple,
        tag: u32,
        tcp_flags: u8,
        now: u64,
        bytes: u32,
        counted: bool,
    ) -> Result<&Entry, InsertError> {
        let extra = if counted { flag::LOADED } else { 0 };
        self.insert_flags(orig, reply, tag, tcp_flags, now, extra, bytes)
    }

    /// Most flows the table holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Flows held, expired ones not yet reclaimed included.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no flow is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The timeouts in force.
    pub fn timeouts(&self) -> &Timeouts {
        &self.config
    }

    /// This worker's SNAT ports.
    pub fn snat_ports(&self) -> &SnatPorts {
        &self.snat
    }

    /// The table's two large allocations, as (address, bytes): the entries (reserved in
    /// full, touched as flows arrive) and the flow index. For the dataplane to ask the
    /// kernel for huge pages there; nothing here reads or writes through them.
    pub fn regions(&self) -> [(usize, usize); 2] {
        [
            (
                self.slots.as_ptr() as usize,
                self.slots.capacity() * ConnTable::ENTRY_SIZE,
            ),
            self.index.region(),
        ]
    }

    /// Bytes reserved by the table (slab plus index, both sized at creation).
    pub fn memory_bytes(&self) -> usize {
        self.slots.capacity() * ConnTable::ENTRY_SIZE + self.index.allocation_size()
    }

    /// [`memory_bytes`](ConnTable::memory_bytes) per flow of capacity: what one more flow
    /// of capacity costs.
    pub fn bytes_per_entry_estimate(&self) -> usize {
        self.memory_bytes().div_ceil(self.capacity)
    }

    fn hash(&self, t: &Tuple) -> u64 {
        hash_tuple(&self.hasher, t)
    }

    /// Has the index buckets and the entries the flows of `keys` would be found at
    /// brought into the cache, for a batch of packets about to be looked up one by one.
    /// In a table much larger than the cache (a million flows: 100+ MiB) each lookup
    /// misses twice, the index bucket and then the entry, and one packet's lookup waits
    /// for its misses; here the whole batch's lines are asked for together. `prefetch` is
    /// handed the address of each line: the dataplane's prefetch instruction (conntrack
    /// does no I/O and has no `unsafe`), which, unlike a read, does not hold the
    /// processor up until the line arrives, so the misses overlap with one another and
    /// with the work that follows.
    ///
    /// First every key's home bucket; then, reading those buckets (the first read waits
    /// for its line, the others are on their way), the two lines of each bucket's first
    /// candidate entry. In a full table, a key with no candidate is most likely a new
    /// flow, which will evict the oldest unassured flow ([`ConnTable::insert`]): as many
    /// of those, from the oldest on, have the buckets of their two tuples asked for as
    /// well (the removal's misses; their entries are read, the unassured list being a
    /// chain). Changes nothing; at most the first [`ConnTable::WARM_BATCH`] keys are
    /// looked at.
    ///
    /// Returns which keys had no candidate (bit `i` for `keys[i]`): most likely new
    /// flows, whose reply tuples the caller may know ahead ([`ConnTable::warm_tuples`]).
    pub fn warm(&self, keys: &[Tuple], prefetch: impl Fn(*const u8)) -> u64 {
        let mut hashes = [0u64; Self::WARM_BATCH];
        let n = keys.len().min(Self::WARM_BATCH);
        for (h, k) in hashes.iter_mut().zip(&keys[..n]) {
            *h = self.hash(k);
            prefetch(self.index.home(*h));
        }
        let mut fresh = 0u64;
        for (i, &h) in hashes[..n].iter().enumerate() {
            match self.index.candidate(h).map(unpack) {
                Some((slot, _)) => {
                    if let Some(e) = self.slots.get(slot) {
                        prefetch_entry(e, &prefetch);
                    }
                }
                None => fresh |= 1 << i,
            }
        }
        let new = fresh.count_ones();
        if self.len >= self.capacity {
            let mut victim = self.unassured_head;
            for _ in 0..new {
                let Some(e) = self.slots.get(victim as usize) else {
                    break;
                };
                for t in [&e.orig, &e.reply] {
                    prefetch(self.index.home(self.hash(t)));
                }
                victim = e.next;
            }
        }
        fresh
    }

    /// Has the index buckets `tuples` would be found at brought into the cache
    /// (`prefetch`, as for [`ConnTable::warm`]): for the reply tuples of a batch's new
    /// flows, known once their endpoints are chosen and before they are inserted (an
    /// insert looks both tuples up, and in a large table the reply's bucket is a miss).
    /// Changes nothing; at most [`ConnTable::WARM_BATCH`] tuples.
    pub fn warm_tuples(&self, tuples: &[Tuple], prefetch: impl Fn(*const u8)) {
        for t in tuples.iter().take(Self::WARM_BATCH) {
            prefetch(self.index.home(self.hash(t)));
        }
    }

    /// The most keys [`ConnTable::warm`] reads for.
    pub const WARM_BATCH: usize = 64;

    /// How far ahead of the eviction point the table brings the unassured flows into the
    /// cache ([`ConnTable::look_ahead`]): two of [`ConnTable::warm`]'s batches.
    pub const LOOKAHEAD: u32 = 2 * Self::WARM_BATCH as u32;

    /// Gives the table the dataplane's prefetch instruction (a hint that asks for a cache
    /// line without waiting for it; conntrack does no I/O and has no `unsafe`), which it
    /// then uses on its own: for the flows a full table will evict next
    /// ([`ConnTable::look_ahead`]).
    pub fn set_prefetch(&mut self, prefetch: fn(*const u8)) {
        self.prefetch = prefetch;
    }

    /// After an eviction: moves the look-ahead point one place further along the
    /// unassured list (two while it is less than [`ConnTable::LOOKAHEAD`] ahead of the
    /// head), and has the entry it reaches prefetched.
    ///
    /// The unassured list is a chain: the next flow to evict is known only from the one
    /// before it. [`ConnTable::warm`] reads a batch's victims to prefetch their index
    /// buckets, and walking the chain there cost a cache miss per victim, one after the
    /// other (the victims' tuple loads were most of `ConnTable::hash`'s 3.8% of the
    /// worker's CPU in the new-connection profile of 2026-12-05). Here the chain is
    /// walked one step per eviction, each step reading the entry the previous step
    /// prefetched, a whole packet earlier: by the time a batch's victims are read, they
    /// are in the cache.
    pub(crate) fn look_ahead(&mut self) {
        for _ in 0..2 {
            if self.ahead_by >= Self::LOOKAHEAD {
                return;
            }
            let next = match self.ahead {
                NIL => self.unassured_head,
                a => self.slots[a as usize].next,
            };
            let Some(e) = self.slots.get(next as usize) else {
                return;
            };
            prefetch_entry(e, &self.prefetch);
            self.ahead = next;
            self.ahead_by += 1;
        }
    }

    /// Tracks a new flow: `orig` as the client sent it, `reply` as the endpoint will
    /// answer. `tcp_flags` are the first segment's (ignored for UDP and SCTP); `tag` is
    /// kept for the caller. Makes room if full (see the crate docs).
    ///
    /// # Errors
    /// [`InsertError::Clash`] if either tuple is tracked (an expired holder is reclaimed
    /// instead), [`InsertError::Full`], [`InsertError::NotNew`] for a TCP segment that
    /// cannot open a flow, [`InsertError::ProtocolMismatch`].
    pub fn insert(
        &mut self,
        orig: Tuple,
        reply: Tuple,
        tag: u32,
        tcp_flags: u8,
        now: u64,
    ) -> Result<&Entry, InsertError> {
        self.insert_flags(orig, reply, tag, tcp_flags, now, 0, 0)
    }

    #[allow(clippy::too_many_arguments)]
    fn insert_flags(
        &mut self,
        orig: Tuple,
        reply: Tuple,
        tag: u32,
        tcp_flags: u8,
        now: u64,
        extra: u8,
        bytes: u32,
    ) -> Result<&Entry, InsertError> {
        if orig.proto != reply.proto {
            return Err(InsertError::ProtocolMismatch { orig, reply });
        }
        let (tcp, timeout) = track::start(orig.proto, tcp_flags, &self.timeouts)
            .ok_or(InsertError::NotNew { flags: tcp_flags })?;
        let hashes = self.claim(&orig, &reply, now)?;
        self.place(
            Entry {
                orig,
                reply,
                created: now,
                expires: now.saturating_add(timeout),
                tag,
                prev: NIL,
                next: NIL,
                tcp,
                flags: flag::LIVE | extra,
                packets: 1,
                bytes: u64::from(bytes),
            },
            hashes,
            now,
        )
    }

    /// The index hashes of a new flow's tuples, once neither is held by a live flow (an
    /// expired holder is removed).
    pub(crate) fn claim(
        &mut self,
        orig: &Tuple,
        reply: &Tuple,
        now: u64,
    ) -> Result<[u64; 2], InsertError> {
        // The original tuple's last lookup may have found it absent (see `absent`).
        let known = self
            .absent
            .take()
            .filter(|(t, _)| t == orig)
            .map(|(_, h)| h);
        let hashes = [known.unwrap_or_else(|| self.hash(orig)), self.hash(reply)];
        let dirs = [Direction::Original, Direction::Reply];
        if orig == reply {
            self.stats.clashes += 1;
            return Err(InsertError::Clash {
                which: Direction::Reply,
                tuple: *reply,
            });
        }
        for ((dir, hash), key) in dirs.into_iter().zip(hashes).zip([orig, reply]) {
            if dir == Direction::Original && known.is_some() {
                continue;
            }
            if let Some(v) = find(&self.index, &self.slots, hash, key) {
                let (slot, _) = unpack(v);
                if !self.slots[slot].is_expired(now) {
                    self.stats.clashes += 1;
                    return Err(InsertError::Clash {
                        which: dir,
                        tuple: *key,
                    });
                }
                self.remove_slot(slot);
                self.stats.expired += 1;
            }
        }
        Ok(hashes)
    }

    /// Puts a checked entry (no live holder of either tuple) into a slot, making room if
    /// the table is full.
    pub(crate) fn place(
        &mut self,
        entry: Entry,
        hashes: [u64; 2],
        now: u64,
    ) -> Result<&Entry, InsertError> {
        let dirs = [Direction::Original, Direction::Reply];
        if self.len >= self.capacity && !self.make_room(now) {
            self.stats.insert_failed_full += 1;
            return Err(InsertError::Full {
                capacity: self.capacity,
            });
        }
        self.absent = None;
        let endpoint = entry.reply.src_addr();
        let assured = entry.is_assured();
        let loaded = entry.flags & flag::LOADED != 0;
        let slot = if self.free != NIL {
            let slot = self.free as usize;
            self.free = self.slots[slot].next;
            // A removal not yet journaled stays pending for this slot.
            let pending = self.slots[slot].flags & (flag::DIRTY | flag::JOURNALED);
            self.slots[slot] = entry;
            self.slots[slot].flags |= pending;
            slot
        } else {
            self.slots.push(entry);
            self.slots.len() - 1
        };
        for (dir, hash) in dirs.into_iter().zip(hashes) {
            // Sized for two entries per flow of capacity (see `new`), so never full here.
            let placed = self.index.insert(hash, pack(slot, dir));
            debug_assert!(placed, "the flow index is sized for the table's capacity");
        }
        if !assured {
            self.push_unassured(slot);
        }
        self.len += 1;
        self.stats.inserts += 1;
        if loaded && let Some(load) = &self.load {
            load.add(endpoint);
        }
        self.mark_dirty(slot);
        Ok(&self.slots[slot])
    }

    /// The flow a packet with tuple `key` belongs to, updated by that packet: protocol
    /// state from `tcp_flags` (ignored for UDP and SCTP), expiry refreshed. `None` if
    /// untracked, or expired (then removed), or a SYN reopening a closed TCP connection
    /// (the old entry is removed: insert a new one).
    ///
    /// The packet counts in the flow's packets, with no bytes: a packet path uses
    /// [`ConnTable::on_packet_bytes`].
    pub fn on_packet(&mut self, key: &Tuple, tcp_flags: u8, now: u64) -> Option<Hit<'_>> {
        self.on_packet_bytes(key, tcp_flags, now, 0)
    }

    /// [`ConnTable::on_packet`] for a packet `bytes` long (from its IP header on), counted
    /// in the flow's packets and bytes.
    pub fn on_packet_bytes(
        &mut self,
        key: &Tuple,
        tcp_flags: u8,
        now: u64,
        bytes: u32,
    ) -> Option<Hit<'_>> {
        let hash = self.hash(key);
        let Some(found) = find(&self.index, &self.slots, hash, key) else {
            self.absent = Some((*key, hash));
            return None;
        };
        let (slot, dir) = unpack(found);
        if self.slots[slot].is_expired(now) {
            self.remove_slot(slot);
            self.stats.expired += 1;
            self.absent = Some((*key, hash));
            return None;
        }
        let e = &mut self.slots[slot];
        e.packets += 1;
        e.bytes += u64::from(bytes);
        let before = (e.tcp, e.flags);
        let update = match track::packet(&mut self.slots[slot], dir, tcp_flags, now, &self.timeouts)
        {
            Outcome::Reopen => {
                self.remove_slot(slot);
                self.stats.removed += 1;
                self.absent = Some((*key, hash));
                return None;
            }
            Outcome::Done { update, assured } => {
                if assured {
                    self.unlink_unassured(slot);
                }
                if (self.slots[slot].tcp, self.slots[slot].flags) != before {
                    self.mark_dirty(slot);
                }
                if update == Update::Closed {
                    // The slot keeps its contents until reused, which `Hit`'s borrow
                    // prevents.
                    self.remove_slot(slot);
                    self.stats.removed += 1;
                }
                update
            }
        };
        Some(Hit {
            dir,
            entry: &self.slots[slot],
            update,
        })
    }

    /// The live flow with tuple `key` in either direction, without updating it.
    pub fn get(&self, key: &Tuple, now: u64) -> Option<(Direction, &Entry)> {
        let (slot, dir) = unpack(find(&self.index, &self.slots, self.hash(key), key)?);
        let e = &self.slots[slot];
        (!e.is_expired(now)).then_some((dir, e))
    }

    /// Removes the flow with tuple `key` (either direction). Returns whether there was one.
    pub fn remove(&mut self, key: &Tuple) -> bool {
        let hash = self.hash(key);
        match find(&self.index, &self.slots, hash, key) {
            Some(v) => {
                self.remove_slot(unpack(v).0);
                self.stats.removed += 1;
                true
            }
            None => false,
        }
    }

    /// A SNAT source port of this worker's share of the range for a flow to `endpoint` masqueraded
    /// as `snat_ip`, such that the reply tuple `endpoint -> snat_ip:port` is not held by a
    /// live flow. Insert the flow before allocating again: the port is "taken" only once
    /// the entry exists, and is free again when the entry goes. `None` when no free port
    /// was found (see [`SnatPorts`]); the caller drops the packet.
    pub fn allocate_snat_port(
        &mut self,
        snat_ip: IpAddr,
        endpoint: SocketAddr,
        proto: Protocol,
        now: u64,
    ) -> Option<u16> {
        let Self {
            index,
            slots,
            hasher,
            snat,
            ..
        } = self;
        snat.pick(snat_ip, |port| {
            let reply = Tuple::new(endpoint, SocketAddr::new(snat_ip, port), proto);
            find(index, slots, hash_tuple(hasher, &reply), &reply)
                .is_some_and(|v| !slots[unpack(v).0].is_expired(now))
        })
    }

    /// Per (endpoint, protocol): the flows live at `now`, and the packets and bytes of
    /// every flow held (expired ones not yet reclaimed included) plus those that left.
    /// One walk over the slab.
    pub fn endpoint_counts(&self, now: u64) -> HashMap<(SocketAddr, Protocol), (u64, Counts)> {
        let mut m: HashMap<(SocketAddr, Protocol), (u64, Counts)> = self
            .retired
            .iter()
            .map(|(k, c)| ((k.0, k.1), (0, *c)))
            .collect();
        for (k, c) in &self.retiring {
            let (_, t) = m.entry((k.0, k.1)).or_default();
            t.packets += c.packets;
            t.bytes += c.bytes;
        }
        for e in self.slots.iter().filter(|e| e.is_live()) {
            let (flows, c) = m.entry((e.endpoint(), e.protocol())).or_default();
            *flows += u64::from(!e.is_expired(now));
            c.packets += e.packets;
            c.bytes += e.bytes;
        }
        m
    }

    /// Endpoints whose gone flows' totals are remembered (the totals of the flows that
    /// left since the last fold are added first).
    pub fn retired_len(&mut self) -> usize {
        self.fold_retired();
        self.retired.len()
    }

    /// Adds the totals of the flows that left since the last fold to their endpoints'.
    pub fn fold_retired(&mut self) {
        for (k, c) in self.retiring.drain(..) {
            let t = self.retired.entry(k).or_default();
            t.packets += c.packets;
            t.bytes += c.bytes;
        }
    }

    /// Makes room for the totals of `endpoints` endpoints in all, so that the flows that
    /// go (evicted, expired, deleted) add their endpoint's without growing the map: a
    /// map that grows rehashes all it holds at once, on the packet path.
    ///
    /// The room is also written once, here: memory that is only reserved is faulted in
    /// page by page as entries land in it, and when a full table starts evicting flows
    /// to tens of thousands of endpoints that is hundreds of page faults in a few
    /// milliseconds of the packet path (measured: 780 in the worker of the 10,000-Service
    /// benchmark, as its table filled). A map that must grow is built anew: filled to its
    /// capacity with placeholders, emptied (which keeps its memory and leaves no
    /// tombstones), then given the totals it holds.
    pub fn reserve_retired(&mut self, endpoints: usize) {
        if endpoints <= self.retired.capacity() {
            return;
        }
        let mut m: HashMap<EndpointKey, Counts> = HashMap::with_capacity(endpoints);
        for i in 0..m.capacity() {
            // Distinct keys no endpoint has ([::N]:0).
            let ip = IpAddr::V6(std::net::Ipv6Addr::from(i as u128));
            m.insert(
                EndpointKey(SocketAddr::new(ip, 0), Protocol::Udp),
                Counts::default(),
            );
        }
        m.clear();
        m.extend(self.retired.drain());
        self.retired = m;
    }

    /// How many endpoints' totals the map holds without growing.
    pub fn retired_capacity(&self) -> usize {
        self.retired.capacity()
    }

    /// Forgets the totals of flows gone to endpoints `keep` rejects (endpoints no longer
    /// in any Service).
    pub fn prune_retired(&mut self, keep: impl Fn(&SocketAddr, Protocol) -> bool) {
        self.fold_retired();
        self.retired.retain(|k, _| keep(&k.0, k.1));
    }

    /// Live flows at `now`, in slot order, for listing. Walks the whole slab.
    pub fn iter(&self, now: u64) -> impl Iterator<Item = &Entry> + '_ {
        self.slots
            .iter()
            .filter(move |e| e.is_live() && !e.is_expired(now))
    }

    /// Unhooks a live slot from the index and the unassured list and frees it. Its
    /// contents stay until the slot is reused.
    pub(crate) fn remove_slot(&mut self, slot: usize) {
        let e = &self.slots[slot];
        self.retiring.push((
            EndpointKey(e.reply.src_addr(), e.orig.proto),
            Counts {
                packets: e.packets,
                bytes: e.bytes,
            },
        ));
        if self.retiring.len() >= RETIRED_BATCH {
            self.fold_retired();
        }
        let e = &self.slots[slot];
        for dir in [Direction::Original, Direction::Reply] {
            let hash = hash_tuple(&self.hasher, e.tuple(dir));
            self.index.remove(hash, pack(slot, dir));
        }
        if e.flags & flag::LOADED != 0
            && let Some(load) = &self.load
        {
            load.sub(e.reply.src_addr());
        }
        if !e.is_assured() {
            self.unlink_unassured(slot);
        }
        let free = self.free;
        let e = &mut self.slots[slot];
        e.flags &= !flag::LIVE;
        e.next = free;
        self.free = slot as u32;
        self.len -= 1;
        self.mark_dirty(slot);
    }

    fn push_unassured(&mut self, slot: usize) {
        let tail = self.unassured_tail;
        self.slots[slot].prev = tail;
        self.slots[slot].next = NIL;
        match tail {
            NIL => self.unassured_head = slot as u32,
            t => self.slots[t as usize].next = slot as u32,
        }
        self.unassured_tail = slot as u32;
    }

    fn unlink_unassured(&mut self, slot: usize) {
        let (prev, next) = (self.slots[slot].prev, self.slots[slot].next);
        // The look-ahead point: one place nearer the head when the head goes; back one
        // place when it goes itself.
        if slot as u32 == self.ahead {
            self.ahead = prev;
            self.ahead_by = match prev {
                NIL => 0,
                _ => self.ahead_by.saturating_sub(1),
            };
        } else if prev == NIL {
            self.ahead_by = self.ahead_by.saturating_sub(1);
        }
        match prev {
            NIL => self.unassured_head = next,
            p => self.slots[p as usize].next = next,
        }
        match next {
            NIL => self.unassured_tail = prev,
            n => self.slots[n as usize].prev = prev,
        }
        self.slots[slot].prev = NIL;
        self.slots[slot].next = NIL;
    }
}

#[cfg(test)]
mod tests;
