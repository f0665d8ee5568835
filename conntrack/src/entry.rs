//! One tracked flow: its two tuples (which are also its NAT binding), protocol state and
//! expiry, packed to stay small because a worker holds up to millions of them.
//!
//! The NAT binding needs no fields of its own: `orig` is the flow as the client sent it
//! and `reply` as the endpoint will answer it, so the rewrite for either direction is the
//! other tuple reversed ([`Entry::rewrite_to`]).

use std::fmt;
use std::net::SocketAddr;

use wire::{Protocol, Tuple};

use crate::tcp::TcpState;

pub use crate::direction::Direction;

/// How far a UDP or SCTP flow has got; these protocols have no handshake kxp tracks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlowState {
    /// Only the client has sent.
    Unreplied,
    /// The endpoint has answered, but the flow is not (yet) assured: a UDP
    /// request/response such as a DNS lookup stays here.
    Replied,
    /// Traffic both ways that lasted (UDP: still active 2s after it began; SCTP: the
    /// client spoke again after a reply). Assured flows are never evicted early.
    Assured,
}

/// A flow's protocol state, as listed by `kxp conntrack list`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// A TCP connection.
    Tcp(TcpState),
    /// A UDP flow.
    Udp(FlowState),
    /// An SCTP association (chunks are not parsed).
    Sctp(FlowState),
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (proto, s) = match self {
            State::Tcp(t) => return write!(f, "TCP {t}"),
            State::Udp(s) => ("UDP", s),
            State::Sctp(s) => ("SCTP", s),
        };
        let s = match s {
            FlowState::Unreplied => "UNREPLIED",
            FlowState::Replied => "REPLIED",
            FlowState::Assured => "ASSURED",
        };
        write!(f, "{proto} {s}")
    }
}

/// Bits of [`Entry::flags`].
pub(crate) mod flag {
    /// The slot holds a flow (else it is on the free list).
    pub const LIVE: u8 = 1;
    /// A packet was seen in the reply direction.
    pub const SEEN_REPLY: u8 = 2;
    /// The flow proved itself; it is no longer on the unassured list.
    pub const ASSURED: u8 = 4;
    /// Changed since the journal was last drained (see `crate::persist`).
    pub const DIRTY: u8 = 8;
    /// Its record in the journal holds this flow (see `crate::persist`).
    pub const JOURNALED: u8 = 16;
    /// Counted in the node's endpoint load (see `crate::load`).
    pub const LOADED: u8 = 32;
}

/// "No slot", the end of an intrusive list.
pub(crate) const NIL: u32 = u32::MAX;

/// One flow. Read it through a [`crate::Hit`], [`crate::ConnTable::get`] or
/// [`crate::ConnTable::iter`].
///
/// Aligned to a cache line: its 128 bytes are two lines, not three. The slab is a
/// `Vec<Entry>`, and the allocator's large blocks start 16 bytes into a page, so with
/// the fields' own alignment every entry straddled three lines, and a flow's lookup in
/// a table larger than the cache (its tuple, then its state and counters) missed three
/// times.
#[derive(Debug, Clone)]
#[repr(align(64))]
pub struct Entry {
    pub(crate) orig: Tuple,
    pub(crate) reply: Tuple,
    /// `now` when inserted, nanoseconds.
    pub(crate) created: u64,
    /// The flow is expired when `now >= expires`.
    pub(crate) expires: u64,
    pub(crate) tag: u32,
    /// Links in the unassured list (oldest first), or `next` in the free list.
    pub(crate) prev: u32,
    pub(crate) next: u32,
    /// Meaningful for TCP only.
    pub(crate) tcp: TcpState,
    pub(crate) flags: u8,
    /// Packets and bytes (IP length) of the flow, both directions, since it was tracked
    /// by this process (not journaled: a restored flow starts again from zero).
    pub(crate) packets: u64,
    pub(crate) bytes: u64,
}

impl Entry {
    /// The flow as the client sent its first packet (e.g. client:40000 -> VIP:80).
    pub fn orig(&self) -> &Tuple {
        &self.orig
    }

    /// The flow as the endpoint answers (e.g. endpoint:8080 -> client:40000, or
    /// -> snat_ip:port when SNATed).
    pub fn reply(&self) -> &Tuple {
        &self.reply
    }

    /// The tuple a packet travelling in `dir` has on the wire.
    pub fn tuple(&self, dir: Direction) -> &Tuple {
        match dir {
            Direction::Original => &self.orig,
            Direction::Reply => &self.reply,
        }
    }

    /// The tuple a packet travelling in `dir` must be rewritten to: an original packet
    /// goes to the endpoint (`reply.reversed()`), a reply goes back to the client looking
    /// as if the VIP sent it (`orig.reversed()`).
    pub fn rewrite_to(&self, dir: Direction) -> Tuple {
        match dir {
            Direction::Original => self.reply.reversed(),
            Direction::Reply => self.orig.reversed(),
        }
    }

    /// The endpoint the flow was sent to (the reply tuple's source).
    pub fn endpoint(&self) -> SocketAddr {
        self.reply.src_addr()
    }

    /// Whether the client's source was rewritten (masquerade / SNAT).
    pub fn is_snat(&self) -> bool {
        self.reply.dst_addr() != self.orig.src_addr()
    }

    /// Packets of the flow, both directions (the first included).
    pub fn packets(&self) -> u64 {
        self.packets
    }

    /// Bytes of the flow's packets from their IP header on, both directions.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The caller's tag (e.g. a service id), as given to [`crate::ConnTable::insert`].
    pub fn tag(&self) -> u32 {
        self.tag
    }

    /// The transport protocol.
    pub fn protocol(&self) -> Protocol {
        self.orig.proto
    }

    /// The protocol state.
    pub fn state(&self) -> State {
        let fs = if self.is_assured() {
            FlowState::Assured
        } else if self.seen_reply() {
            FlowState::Replied
        } else {
            FlowState::Unreplied
        };
        match self.orig.proto {
            Protocol::Tcp => State::Tcp(self.tcp),
            Protocol::Udp => State::Udp(fs),
            Protocol::Sctp => State::Sctp(fs),
        }
    }

    /// Assured flows (TCP that reached ESTABLISHED with replies, UDP streams, SCTP that
    /// went both ways) are never evicted to make room. Once set, it stays set.
    pub fn is_assured(&self) -> bool {
        self.flags & flag::ASSURED != 0
    }

    /// Whether the endpoint has sent anything back.
    pub fn seen_reply(&self) -> bool {
        self.flags & flag::SEEN_REPLY != 0
    }

    /// `now` at insertion, nanoseconds.
    pub fn created_at(&self) -> u64 {
        self.created
    }

    /// The instant (same clock as `now`) from which the flow counts as gone.
    pub fn expires_at(&self) -> u64 {
        self.expires
    }

    /// Nanoseconds left before expiry, 0 if expired.
    pub fn remaining(&self, now: u64) -> u64 {
        self.expires.saturating_sub(now)
    }

    /// Whether the flow has timed out at `now`.
    pub fn is_expired(&self, now: u64) -> bool {
        now >= self.expires
    }

    pub(crate) fn is_live(&self) -> bool {
        self.flags & flag::LIVE != 0
    }

    pub(crate) fn set(&mut self, bit: u8) {
        self.flags |= bit;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str, d: &str) -> Tuple {
        Tuple::new(s.parse().unwrap(), d.parse().unwrap(), Protocol::Tcp)
    }

    fn entry(orig: Tuple, reply: Tuple) -> Entry {
        Entry {
            orig,
            reply,
            created: 0,
            expires: 10,
            tag: 7,
            prev: NIL,
            next: NIL,
            tcp: TcpState::SynSent,
            flags: flag::LIVE,
            packets: 0,
            bytes: 0,
        }
    }

    #[test]
    fn rewrite_is_the_other_tuple_reversed() {
        let orig = t("198.18.0.1:40000", "198.19.0.10:80");
        let reply = t("198.18.5.5:8080", "198.18.0.1:40000");
        let e = entry(orig, reply);
        assert_eq!(
            e.rewrite_to(Direction::Original),
            t("198.18.0.1:40000", "198.18.5.5:8080")
        );
        assert_eq!(
            e.rewrite_to(Direction::Reply),
            t("198.19.0.10:80", "198.18.0.1:40000")
        );
        assert_eq!(e.endpoint(), "198.18.5.5:8080".parse().unwrap());
        assert!(!e.is_snat());
        let snat = entry(orig, t("198.18.5.5:8080", "198.18.0.254:61000"));
        assert!(snat.is_snat());
        assert_eq!(
            snat.rewrite_to(Direction::Original),
            t("198.18.0.254:61000", "198.18.5.5:8080")
        );
    }

    #[test]
    fn states_print_like_conntrack() {
        let mut e = entry(
            t("198.18.0.1:1", "198.18.0.2:2"),
            t("198.18.0.2:2", "198.18.0.1:1"),
        );
        assert_eq!(e.state().to_string(), "TCP SYN_SENT");
        e.orig.proto = Protocol::Udp;
        assert_eq!(e.state().to_string(), "UDP UNREPLIED");
        e.set(flag::SEEN_REPLY);
        assert_eq!(e.state(), State::Udp(FlowState::Replied));
        e.set(flag::ASSURED);
        assert_eq!(e.state().to_string(), "UDP ASSURED");
        assert_eq!(e.remaining(4), 6);
        assert_eq!(e.remaining(11), 0);
        assert!(e.is_expired(10));
    }
}
