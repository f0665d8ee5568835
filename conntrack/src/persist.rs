//! What a table must leave behind for the next process: the format of kxp's state files
//! and the table's side of writing and reading them. Pure: bytes in, bytes out; the
//! dataplane maps the files and owns the clock.
//!
//! # Files
//! A state file is a [`Header`] (the first [`HEADER_WORDS`] 64-bit words) followed by
//! fixed-size records of [`RECORD_WORDS`] words, one per connection-table slot (or per
//! affinity entry). All words are little-endian `u64`s, written one at a time, so the
//! layout does not depend on the compiler that built kxp: a newer binary reads an older
//! one's file as long as [`VERSION`] is the same, and refuses (and starts clean) when it
//! is not.
//!
//! # Records and crashes
//! Word 0 of a record is `seq | crc << 32`. A writer first stores an odd `seq` (the
//! record is being written), then the payload words, then the next even `seq` with the
//! payload's CRC-32C. A process killed in the middle leaves an odd `seq` or a CRC that
//! does not match: [`open_record`] reports the record as torn or corrupt, and the reader
//! discards that one record, never trusting it. A payload is then decoded strictly
//! (protocol, address families, TCP state, times): anything else is refused too.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use wire::{Protocol, Tuple};

use crate::entry::{Entry, NIL, flag};
use crate::table::{ConnTable, InsertError};
use crate::tcp::TcpState;
use crate::track;

/// `KXPSTATE`, the first word of every state file.
pub const MAGIC: u64 = u64::from_le_bytes(*b"KXPSTATE");
/// Layout version; a file of another version is not read.
pub const VERSION: u32 = 1;
/// Words in the header (4 KiB, so records start page-aligned).
pub const HEADER_WORDS: usize = 512;
/// Words per record (128 bytes): one of framing, fifteen of payload.
pub const RECORD_WORDS: usize = 16;
/// The most records a header may announce: 2^40 (128 TiB of records), far past any table
/// and far from overflowing a file length.
pub const MAX_RECORDS: u64 = 1 << 40;
/// Payload bytes per record.
pub const PAYLOAD_BYTES: usize = (RECORD_WORDS - 1) * 8;

/// What a state file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// One worker's connection table.
    Conntrack = 1,
    /// The node's ClientIP affinity table.
    Affinity = 2,
}

/// A state file's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the records are.
    pub kind: Kind,
    /// How many records follow.
    pub records: u64,
    /// Which worker wrote it, of how many (0 of 1 for node-wide files).
    pub worker: u32,
    /// Workers of the process that wrote it.
    pub workers: u32,
    /// The kernel's boot id: times are `CLOCK_MONOTONIC`, meaningful only within a boot.
    pub boot_id: [u8; 16],
    /// A value the writer needs back (the affinity table's shard seed).
    pub seed: u64,
    /// The network namespace's cookie: connections of one namespace mean nothing in
    /// another (0: unknown, not checked).
    pub netns: u64,
}

/// Why a file or a record was not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// Not a kxp state file.
    #[error("not a kxp state file (bad magic)")]
    BadMagic,
    /// Written by a kxp with another layout.
    #[error("state file layout version {found}, this kxp reads version {VERSION}")]
    Version {
        /// The file's version.
        found: u32,
    },
    /// The header's checksum or fields are wrong.
    #[error("state file header is corrupt ({0})")]
    Header(&'static str),
    /// Written during another boot: its times mean nothing now.
    #[error("state file was written before the last reboot")]
    OtherBoot,
    /// Written in another network namespace.
    #[error("state file was written in another network namespace")]
    OtherNamespace,
    /// Shorter than its header says.
    #[error("state file is truncated ({have} of {need} bytes)")]
    Truncated {
        /// Bytes present.
        have: usize,
        /// Bytes the header announces.
        need: usize,
    },
    /// A record being written when its writer stopped.
    #[error("record torn by a crash while it was written")]
    Torn,
    /// A record whose checksum does not match.
    #[error("record checksum mismatch")]
    Checksum,
    /// A record whose contents make no sense.
    #[error("record is invalid ({0})")]
    Invalid(&'static str),
}

fn crc_words(words: &[u64]) -> u32 {
    let mut bytes = [0u8; RECORD_WORDS * 8];
    let n = words.len().min(RECORD_WORDS);
    for (i, w) in words[..n].iter().enumerate() {
        bytes[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    crc32c::crc32c(&bytes[..n * 8])
}

impl Header {
    /// The header's words (the rest of [`HEADER_WORDS`] is zero).
    pub fn encode(&self) -> [u64; 10] {
        let mut w = [0u64; 10];
        w[0] = MAGIC;
        w[1] = u64::from(VERSION) | (self.kind as u64) << 32;
        w[2] = self.records;
        w[3] = u64::from(self.worker) | u64::from(self.workers) << 32;
        w[4] = u64::from_le_bytes(self.boot_id[..8].try_into().unwrap_or([0; 8]));
        w[5] = u64::from_le_bytes(self.boot_id[8..].try_into().unwrap_or([0; 8]));
        w[6] = RECORD_WORDS as u64;
        w[7] = self.seed;
        w[8] = self.netns;
        w[9] = u64::from(crc_words(&w[..9]));
        w
    }

    /// Reads a header, checking it belongs to this boot and this network namespace.
    ///
    /// # Errors
    /// [`StateError`] saying what is wrong.
    pub fn decode(words: &[u64], boot_id: [u8; 16], netns: u64) -> Result<Header, StateError> {
        if words.len() < 10 {
            return Err(StateError::Truncated {
                have: words.len() * 8,
                need: HEADER_WORDS * 8,
            });
        }
        if words[0] != MAGIC {
            return Err(StateError::BadMagic);
        }
        let version = words[1] as u32;
        if version != VERSION {
            return Err(StateError::Version { found: version });
        }
        if words[9] != u64::from(crc_words(&words[..9])) {
            return Err(StateError::Header("checksum"));
        }
        if words[6] != RECORD_WORDS as u64 {
            return Err(StateError::Header("record size"));
        }
        let kind = match words[1] >> 32 {
            1 => Kind::Conntrack,
            2 => Kind::Affinity,
            _ => return Err(StateError::Header("kind")),
        };
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&words[4].to_le_bytes());
        id[8..].copy_from_slice(&words[5].to_le_bytes());
        if id != boot_id {
            return Err(StateError::OtherBoot);
        }
        let h = Header {
            kind,
            records: words[2],
            worker: words[3] as u32,
            workers: (words[3] >> 32) as u32,
            boot_id: id,
            seed: words[7],
            netns: words[8],
        };
        if h.netns != 0 && netns != 0 && h.netns != netns {
            return Err(StateError::OtherNamespace);
        }
        if h.workers == 0 || h.worker >= h.workers {
            return Err(StateError::Header("worker"));
        }
        // A record count no file can hold (its length would overflow; found by fuzzing).
        if h.records > MAX_RECORDS {
            return Err(StateError::Header("record count"));
        }
        Ok(h)
    }

    /// Bytes a file with this header has (saturating: [`Header::decode`] refuses counts
    /// past [`MAX_RECORDS`]).
    pub fn file_len(&self) -> usize {
        (self.records as usize)
            .saturating_mul(RECORD_WORDS)
            .saturating_add(HEADER_WORDS)
            .saturating_mul(8)
    }
}

/// Word 0 of a record: sequence number and payload checksum.
pub fn seal(seq: u32, payload: &[u64]) -> u64 {
    u64::from(seq) | u64::from(crc_words(payload)) << 32
}

/// The payload of a record if it is whole: `Ok(None)` for a slot never written or
/// cleared, errors for torn or corrupt records.
///
/// # Errors
/// [`StateError::Torn`], [`StateError::Checksum`].
pub fn open_record(record: &[u64]) -> Result<Option<&[u64]>, StateError> {
    let (head, payload) = record.split_first().ok_or(StateError::Invalid("empty"))?;
    let seq = *head as u32;
    if seq == 0 {
        return Ok(None);
    }
    if seq & 1 == 1 {
        return Err(StateError::Torn);
    }
    if (*head >> 32) as u32 != crc_words(payload) {
        return Err(StateError::Checksum);
    }
    // A cleared slot: payload tag 0.
    if payload.first().is_none_or(|w| *w as u8 == 0) {
        return Ok(None);
    }
    Ok(Some(payload))
}

/// Payload tags (low byte of payload word 0).
const TAG_FLOW: u8 = 1;
const TAG_AFFINITY: u8 = 2;

fn put_ip(b: &mut [u8], ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => b[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => b[..16].copy_from_slice(&v6.octets()),
    }
}

fn get_ip(b: &[u8], v6: bool) -> Result<IpAddr, StateError> {
    if v6 {
        let mut o = [0u8; 16];
        o.copy_from_slice(&b[..16]);
        Ok(IpAddr::V6(Ipv6Addr::from(o)))
    } else {
        if b[4..16].iter().any(|&x| x != 0) {
            return Err(StateError::Invalid("IPv4 address with IPv6 bytes"));
        }
        Ok(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3])))
    }
}

fn to_words(b: &[u8; PAYLOAD_BYTES]) -> [u64; RECORD_WORDS - 1] {
    let mut w = [0u64; RECORD_WORDS - 1];
    for (i, c) in b.chunks_exact(8).enumerate() {
        w[i] = u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
    }
    w
}

fn to_bytes(w: &[u64]) -> Result<[u8; PAYLOAD_BYTES], StateError> {
    if w.len() != RECORD_WORDS - 1 {
        return Err(StateError::Invalid("payload length"));
    }
    let mut b = [0u8; PAYLOAD_BYTES];
    for (i, x) in w.iter().enumerate() {
        b[i * 8..i * 8 + 8].copy_from_slice(&x.to_le_bytes());
    }
    Ok(b)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]))
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// A flow as a state file holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowRecord {
    /// As the client sent it.
    pub orig: Tuple,
    /// As the endpoint answers.
    pub reply: Tuple,
    /// The caller's tag (kxp: the Service port's index; informational after a restart).
    pub tag: u32,
    /// When the flow began and when it was last known to expire (`CLOCK_MONOTONIC`).
    pub created: u64,
    /// See `created`.
    pub expires: u64,
    /// TCP state (meaningless for UDP and SCTP).
    pub tcp: TcpState,
    /// Whether the endpoint answered, and whether the flow is assured.
    pub seen_reply: bool,
    /// See `seen_reply`.
    pub assured: bool,
    /// Counted in the node's endpoint load (a least-connection Service's flow).
    pub counted: bool,
}

impl FlowRecord {
    /// The record of a table entry.
    pub fn of(e: &Entry) -> FlowRecord {
        FlowRecord {
            orig: e.orig,
            reply: e.reply,
            tag: e.tag,
            created: e.created,
            expires: e.expires,
            tcp: e.tcp,
            seen_reply: e.seen_reply(),
            assured: e.is_assured(),
            counted: e.flags & flag::LOADED != 0,
        }
    }

    /// Payload words.
    pub fn encode(&self) -> [u64; RECORD_WORDS - 1] {
        let mut b = [0u8; PAYLOAD_BYTES];
        b[0] = TAG_FLOW;
        b[1] = self.orig.proto.number();
        b[2] = u8::from(self.orig.src.is_ipv6());
        b[3] = self.tcp as u8;
        b[4] =
            u8::from(self.seen_reply) | u8::from(self.assured) << 1 | u8::from(self.counted) << 2;
        b[8..16].copy_from_slice(&self.created.to_le_bytes());
        b[16..24].copy_from_slice(&self.expires.to_le_bytes());
        b[24..28].copy_from_slice(&self.tag.to_le_bytes());
        for (i, p) in [
            self.orig.sport,
            self.orig.dport,
            self.reply.sport,
            self.reply.dport,
        ]
        .into_iter()
        .enumerate()
        {
            b[28 + 2 * i..30 + 2 * i].copy_from_slice(&p.to_le_bytes());
        }
        for (i, ip) in [self.orig.src, self.orig.dst, self.reply.src, self.reply.dst]
            .into_iter()
            .enumerate()
        {
            put_ip(&mut b[36 + 16 * i..52 + 16 * i], ip);
        }
        to_words(&b)
    }

    /// Reads payload words, strictly.
    ///
    /// # Errors
    /// [`StateError::Invalid`] saying which field is wrong.
    pub fn decode(words: &[u64]) -> Result<FlowRecord, StateError> {
        let b = to_bytes(words)?;
        if b[0] != TAG_FLOW {
            return Err(StateError::Invalid("not a flow"));
        }
        let proto = match b[1] {
            6 => Protocol::Tcp,
            17 => Protocol::Udp,
            132 => Protocol::Sctp,
            _ => return Err(StateError::Invalid("protocol")),
        };
        let v6 = match b[2] {
            0 => false,
            1 => true,
            _ => return Err(StateError::Invalid("address family")),
        };
        let tcp = *TcpState::ALL
            .get(usize::from(b[3]))
            .ok_or(StateError::Invalid("TCP state"))?;
        if b[4] & !7 != 0 || b[5..8].iter().any(|&x| x != 0) {
            return Err(StateError::Invalid("flags"));
        }
        let (created, expires) = (u64_at(&b, 8), u64_at(&b, 16));
        if expires < created {
            return Err(StateError::Invalid("expires before it was created"));
        }
        let port = |i: usize| u16_at(&b, 28 + 2 * i);
        let ip = |i: usize| get_ip(&b[36 + 16 * i..52 + 16 * i], v6);
        let sa = |i: usize, p: usize| -> Result<SocketAddr, StateError> {
            Ok(SocketAddr::new(ip(i)?, port(p)))
        };
        if b[100..].iter().any(|&x| x != 0) {
            return Err(StateError::Invalid("trailing bytes"));
        }
        Ok(FlowRecord {
            orig: Tuple::new(sa(0, 0)?, sa(1, 1)?, proto),
            reply: Tuple::new(sa(2, 2)?, sa(3, 3)?, proto),
            tag: u32::from_le_bytes([b[24], b[25], b[26], b[27]]),
            created,
            expires,
            tcp,
            seen_reply: b[4] & 1 != 0,
            assured: b[4] & 2 != 0,
            counted: b[4] & 4 != 0,
        })
    }
}

/// A ClientIP affinity entry as a state file holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AffinityRecord {
    /// The Service port (stable hash of its name).
    pub service: u64,
    /// The client.
    pub client: IpAddr,
    /// The endpoint it is held to.
    pub endpoint: SocketAddr,
    /// When it expires (`CLOCK_MONOTONIC`).
    pub expires: u64,
}

impl AffinityRecord {
    /// Payload words.
    pub fn encode(&self) -> [u64; RECORD_WORDS - 1] {
        let mut b = [0u8; PAYLOAD_BYTES];
        b[0] = TAG_AFFINITY;
        b[1] = u8::from(self.client.is_ipv6());
        b[2] = u8::from(self.endpoint.is_ipv6());
        b[8..16].copy_from_slice(&self.service.to_le_bytes());
        b[16..24].copy_from_slice(&self.expires.to_le_bytes());
        b[24..26].copy_from_slice(&self.endpoint.port().to_le_bytes());
        put_ip(&mut b[26..42], self.client);
        put_ip(&mut b[42..58], self.endpoint.ip());
        to_words(&b)
    }

    /// Reads payload words, strictly.
    ///
    /// # Errors
    /// [`StateError::Invalid`] saying which field is wrong.
    pub fn decode(words: &[u64]) -> Result<AffinityRecord, StateError> {
        let b = to_bytes(words)?;
        if b[0] != TAG_AFFINITY {
            return Err(StateError::Invalid("not an affinity entry"));
        }
        let fam = |x: u8| match x {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(StateError::Invalid("address family")),
        };
        let (c6, e6) = (fam(b[1])?, fam(b[2])?);
        if b[3..8].iter().any(|&x| x != 0) || b[58..].iter().any(|&x| x != 0) {
            return Err(StateError::Invalid("padding"));
        }
        Ok(AffinityRecord {
            service: u64_at(&b, 8),
            client: get_ip(&b[26..42], c6)?,
            endpoint: SocketAddr::new(get_ip(&b[42..58], e6)?, u16_at(&b, 24)),
            expires: u64_at(&b, 16),
        })
    }
}

/// Payload words of a cleared record.
pub const CLEARED: [u64; RECORD_WORDS - 1] = [0; RECORD_WORDS - 1];

impl ConnTable {
    /// Turns journaling on: from now on every slot whose flow is inserted, changes
    /// protocol state or goes is listed for [`ConnTable::drain_journal`]. Every live
    /// slot is listed now.
    pub fn enable_journal(&mut self) {
        self.journal = Some(Vec::new());
        for slot in 0..self.slots.len() {
            self.slots[slot].flags &= !(flag::DIRTY | flag::JOURNALED);
            self.mark_dirty(slot);
        }
    }

    /// Lists `slot` for the journal if its record must change: a flow the endpoint has
    /// answered (a new one, or one whose state changed), or a record that holds a flow
    /// no longer there. Flows nobody answered are not journaled: after a restart their
    /// next packet simply opens them again (the client's retransmitted SYN, its next
    /// datagram), so a flood of new flows costs the journal nothing.
    pub(crate) fn mark_dirty(&mut self, slot: usize) {
        let Some(j) = &mut self.journal else {
            return;
        };
        let e = &mut self.slots[slot];
        let answered = e.is_live() && e.seen_reply();
        if e.flags & flag::DIRTY == 0 && (answered || e.flags & flag::JOURNALED != 0) {
            e.flags |= flag::DIRTY;
            j.push(slot as u32);
        }
    }

    /// Hands every slot whose record must change to `write`: the flow now in it, or
    /// `None` to clear it. Expiry refreshes are not journaled (see
    /// [`ConnTable::restore`]), nor flows nobody answered (see `mark_dirty`).
    pub fn drain_journal(&mut self, mut write: impl FnMut(usize, Option<FlowRecord>)) {
        let Some(mut j) = self.journal.take() else {
            return;
        };
        for &slot in &j {
            let e = &mut self.slots[slot as usize];
            if e.flags & flag::DIRTY == 0 {
                continue; // listed twice
            }
            e.flags &= !flag::DIRTY;
            if e.is_live() && e.seen_reply() {
                e.flags |= flag::JOURNALED;
                write(slot as usize, Some(FlowRecord::of(e)));
            } else if e.flags & flag::JOURNALED != 0 {
                e.flags &= !flag::JOURNALED;
                write(slot as usize, None);
            }
        }
        j.clear();
        self.journal = Some(j);
    }

    /// Slots the journal has waiting.
    pub fn journal_pending(&self) -> usize {
        self.journal.as_ref().map_or(0, Vec::len)
    }

    /// Puts back a flow a previous process tracked. Its expiry is the later of the one
    /// recorded and a full timeout of its state from `now`: refreshes by packets are not
    /// journaled, so a flow that was busy until the restart must not be taken for idle.
    ///
    /// # Errors
    /// As [`ConnTable::insert`]: a tuple already tracked, a full table, mismatched
    /// protocols.
    pub fn restore(&mut self, r: &FlowRecord, now: u64) -> Result<(), InsertError> {
        if r.orig.proto != r.reply.proto {
            return Err(InsertError::ProtocolMismatch {
                orig: r.orig,
                reply: r.reply,
            });
        }
        let hashes = self.claim(&r.orig, &r.reply, now)?;
        let mut flags = flag::LIVE;
        if r.seen_reply {
            flags |= flag::SEEN_REPLY;
        }
        if r.assured {
            flags |= flag::ASSURED;
        }
        if r.counted {
            flags |= flag::LOADED;
        }
        let mut e = Entry {
            orig: r.orig,
            reply: r.reply,
            created: r.created.min(now),
            expires: r.expires,
            tag: r.tag,
            prev: NIL,
            next: NIL,
            tcp: r.tcp,
            flags,
            packets: 0,
            bytes: 0,
        };
        e.expires = e
            .expires
            .max(now.saturating_add(track::timeout_of(&e, &self.timeouts)));
        self.place(e, hashes, now).map(|_| ())
    }
}

#[cfg(test)]
mod tests;
