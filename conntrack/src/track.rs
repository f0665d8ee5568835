//! What one packet does to an existing flow: protocol state, the "assured" mark, and the
//! refreshed expiry. Kept apart from the table so the rules read in one place and are
//! tested without one.
//!
//! The rules are Linux's (`nf_conntrack_tcp_packet`, `nf_conntrack_udp_packet`), because
//! they decide both how long a flow lives and which flows may be evicted early:
//! - TCP is assured when it reaches ESTABLISHED after a reply; a RST shortens the timeout
//!   to `tcp_close`; a RST that is the endpoint's first answer ends the flow at once (the
//!   client's next SYN then gets a fresh endpoint choice); a SYN from the client on a
//!   TIME_WAIT or CLOSE flow starts a new flow; a retransmitted SYN does not extend an
//!   unanswered one; ESTABLISHED without any reply (picked up mid-stream) is capped at
//!   `tcp_unacknowledged`.
//! - UDP uses `udp` until it has been answered and is still active 2s after it began; it
//!   is then a stream, assured, on `udp_stream`. A request/response exchange such as a DNS
//!   lookup therefore stays unassured (evictable) on the short timeout.
//! - SCTP (chunks not parsed) uses `sctp_unreplied` until answered, then
//!   `sctp_established`; it is assured when the client speaks again after a reply.

use wire::Protocol;

use crate::entry::{Direction, Entry, flag};
use crate::tcp::{self, TcpState, Transition, flags};
use crate::timeouts::TimeoutsNs;

/// How long a UDP flow must have lived, with a reply, before it counts as a stream
/// (Linux: `stream_ts`, 2 seconds).
pub(crate) const UDP_STREAM_AFTER_NS: u64 = 2_000_000_000;

/// What a packet did to its flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Update {
    /// State updated and expiry refreshed.
    Tracked,
    /// Harmless but not state-changing (e.g. a retransmitted SYN or SYN/ACK); expiry not
    /// refreshed. Forward the packet.
    Ignored,
    /// TCP flags that make no sense in the flow's state (Linux marks such a packet
    /// INVALID and kube-proxy drops it); state and expiry untouched.
    Invalid,
    /// The packet ended the flow (the endpoint's first answer was a RST) and the entry
    /// is already removed. Translate this packet with the entry returned alongside.
    Closed,
}

/// [`Update`] plus what the table must do about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// As `Update`; `assured` if the flow became assured with this packet.
    Done { update: Update, assured: bool },
    /// A new connection on an old tuple: forget the entry, treat the packet as new.
    Reopen,
}

const fn done(update: Update) -> Outcome {
    Outcome::Done {
        update,
        assured: false,
    }
}

/// The TCP state and timeout (ns) of a new flow from its first segment, `None` if that
/// segment cannot open a flow (see [`tcp::initial`]). UDP and SCTP always open one.
pub(crate) fn start(proto: Protocol, tcp_flags: u8, t: &TimeoutsNs) -> Option<(TcpState, u64)> {
    match proto {
        Protocol::Tcp => {
            let s = tcp::initial(tcp_flags)?;
            let timeout = match s {
                TcpState::Established => t.tcp(s).min(t.tcp_unacknowledged),
                _ => t.tcp(s),
            };
            Some((s, timeout))
        }
        // The TCP state of a UDP or SCTP entry is never read.
        Protocol::Udp => Some((TcpState::Close, t.udp)),
        Protocol::Sctp => Some((TcpState::Close, t.sctp_unreplied)),
    }
}

/// The timeout the next packet of `e` would give it in its current state (for a flow
/// restored from a previous process).
pub(crate) fn timeout_of(e: &Entry, t: &TimeoutsNs) -> u64 {
    match e.orig.proto {
        Protocol::Tcp => {
            let base = t.tcp(e.tcp);
            if e.seen_reply() {
                base
            } else {
                base.min(t.tcp_unacknowledged)
            }
        }
        Protocol::Udp if e.is_assured() => t.udp_stream,
        Protocol::Udp => t.udp,
        Protocol::Sctp if e.seen_reply() => t.sctp_established,
        Protocol::Sctp => t.sctp_unreplied,
    }
}

/// Applies one packet travelling in `dir` to `e`, at `now`.
pub(crate) fn packet(
    e: &mut Entry,
    dir: Direction,
    tcp_flags: u8,
    now: u64,
    t: &TimeoutsNs,
) -> Outcome {
    let out = match e.orig.proto {
        Protocol::Tcp => tcp_packet(e, dir, tcp_flags, now, t),
        Protocol::Udp => datagram(e, dir, now, t.udp, t.udp_stream, true),
        Protocol::Sctp => datagram(e, dir, now, t.sctp_unreplied, t.sctp_established, false),
    };
    // Linux marks SEEN_REPLY for every accepted reply, ignored ones included.
    if let (
        Direction::Reply,
        Outcome::Done {
            update: Update::Tracked | Update::Ignored,
            ..
        },
    ) = (dir, out)
    {
        e.set(flag::SEEN_REPLY);
    }
    out
}

fn tcp_packet(e: &mut Entry, dir: Direction, f: u8, now: u64, t: &TimeoutsNs) -> Outcome {
    let old = e.tcp;
    let new = match tcp::transition(old, dir, f) {
        Transition::To(s) => s,
        Transition::Ignore => return done(Update::Ignored),
        Transition::Invalid => return done(Update::Invalid),
    };
    let syn = tcp::is_syn(f);
    if syn && dir == Direction::Original && matches!(old, TcpState::TimeWait | TcpState::Close) {
        return Outcome::Reopen;
    }
    let rst = f & flags::RST != 0;
    let mut timeout = if rst {
        t.tcp(TcpState::Close)
    } else {
        t.tcp(new)
    };
    let mut assured = false;
    if !e.seen_reply() {
        if rst && dir == Direction::Reply {
            e.tcp = TcpState::Close;
            return done(Update::Closed);
        }
        if syn && old == TcpState::SynSent {
            // A retransmitted SYN must not keep an unanswered flow (and its NAT) alive.
            return done(Update::Ignored);
        }
        if new == TcpState::Established {
            timeout = timeout.min(t.tcp_unacknowledged);
        }
    } else if !e.is_assured()
        && matches!(old, TcpState::SynRecv | TcpState::Established)
        && new == TcpState::Established
    {
        e.set(flag::ASSURED);
        assured = true;
    }
    e.tcp = new;
    e.expires = now.saturating_add(timeout);
    Outcome::Done {
        update: Update::Tracked,
        assured,
    }
}

/// UDP (`udp` = true: the 2s stream rule applies) and SCTP, which have no handshake kxp can see.
fn datagram(e: &mut Entry, dir: Direction, now: u64, first: u64, later: u64, udp: bool) -> Outcome {
    let mut timeout = first;
    let mut assured = false;
    if e.seen_reply() {
        let lasted = !udp || now >= e.created.saturating_add(UDP_STREAM_AFTER_NS);
        if lasted {
            timeout = later;
            // SCTP: the client speaking after a reply (COOKIE ECHO at the latest).
            if !e.is_assured() && (udp || dir == Direction::Original) {
                e.set(flag::ASSURED);
                assured = true;
            }
        }
    }
    e.expires = now.saturating_add(timeout);
    Outcome::Done {
        update: Update::Tracked,
        assured,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::NIL;
    use crate::timeouts::Timeouts;
    use Direction::{Original as O, Reply as R};
    use flags::*;
    use wire::Tuple;

    const S: u64 = 1_000_000_000;

    fn new_entry(proto: Protocol, f: u8, t: &TimeoutsNs, now: u64) -> Entry {
        let orig = Tuple::new(
            "198.18.0.1:40000".parse().unwrap(),
            "198.19.0.10:80".parse().unwrap(),
            proto,
        );
        let (tcp, timeout) = start(proto, f, t).unwrap();
        Entry {
            orig,
            reply: orig.reversed(),
            created: now,
            expires: now + timeout,
            tag: 0,
            prev: NIL,
            next: NIL,
            tcp,
            flags: flag::LIVE,
            packets: 0,
            bytes: 0,
        }
    }

    fn tracked(assured: bool) -> Outcome {
        Outcome::Done {
            update: Update::Tracked,
            assured,
        }
    }

    #[test]
    fn tcp_pickup_is_capped_until_replied_then_assured() {
        let t = TimeoutsNs::new(&Timeouts::default());
        let mut e = new_entry(Protocol::Tcp, ACK, &t, 0);
        assert_eq!(e.tcp, TcpState::Established);
        assert_eq!(e.expires, 300 * S);
        assert_eq!(packet(&mut e, R, ACK, S, &t), tracked(false));
        assert_eq!(e.expires, S + 300 * S);
        assert_eq!(packet(&mut e, O, ACK, 2 * S, &t), tracked(true));
        assert_eq!(e.expires, 2 * S + 86_400 * S);
    }

    #[test]
    fn tcp_syn_retransmit_and_ignored_segments_do_not_refresh() {
        let t = TimeoutsNs::new(&Timeouts::default());
        let mut e = new_entry(Protocol::Tcp, SYN, &t, 0);
        assert_eq!(packet(&mut e, O, SYN, 5 * S, &t), done(Update::Ignored));
        assert_eq!(packet(&mut e, R, ACK, 5 * S, &t), done(Update::Ignored));
        assert_eq!(packet(&mut e, O, ACK, 5 * S, &t), done(Update::Invalid));
        assert_eq!(e.expires, 120 * S);
        assert!(e.seen_reply(), "an ignored reply still counts as a reply");
    }

    #[test]
    fn sctp_assured_when_client_speaks_after_reply() {
        let t = TimeoutsNs::new(&Timeouts::default());
        let mut e = new_entry(Protocol::Sctp, 0, &t, 0);
        assert_eq!(e.expires, 30 * S);
        assert_eq!(packet(&mut e, R, 0, S, &t), tracked(false));
        assert_eq!(e.expires, S + 30 * S);
        assert_eq!(packet(&mut e, O, 0, S, &t), tracked(true));
        assert_eq!(e.expires, S + 210 * S);
    }
}
