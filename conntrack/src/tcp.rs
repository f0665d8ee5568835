//! TCP state, tracked only as far as timeouts need.
//!
//! The table is Linux's `tcp_conntracks` (net/netfilter/nf_conntrack_proto_tcp.c) without
//! its sequence-window checks and without the simultaneous-open state SYN_SENT2: a Service
//! endpoint answers SYNs, it does not send them to its clients. Which timeout applies, when
//! a flow counts as assured and when a closed flow may be reopened all follow Linux, so a
//! flow lives under kxp as long as it would under kube-proxy. Sequence numbers are not
//! checked: an in-window RST forged by a third party is out of scope, as it is for
//! kube-proxy with `--conntrack-tcp-be-liberal`.

use std::fmt;

use crate::direction::Direction;

/// TCP header flag bits, in the layout of the header's flags byte.
pub mod flags {
    /// No more data from sender.
    pub const FIN: u8 = 0x01;
    /// Synchronize sequence numbers.
    pub const SYN: u8 = 0x02;
    /// Reset the connection.
    pub const RST: u8 = 0x04;
    /// Acknowledgment field is significant.
    pub const ACK: u8 = 0x10;
}

/// A TCP flow's state, at the granularity of Linux's conntrack (one state for both ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum TcpState {
    /// SYN seen from the client.
    SynSent,
    /// SYN/ACK seen from the endpoint.
    SynRecv,
    /// Handshake completed (or picked up mid-stream).
    Established,
    /// A FIN seen.
    FinWait,
    /// The FIN acknowledged; the other direction may still send.
    CloseWait,
    /// FINs seen in both directions; waiting for the last ACK.
    LastAck,
    /// Closed; lingering for retransmissions.
    TimeWait,
    /// Reset.
    Close,
}

impl TcpState {
    pub(crate) const COUNT: usize = 8;
    pub(crate) const ALL: [TcpState; TcpState::COUNT] = [
        TcpState::SynSent,
        TcpState::SynRecv,
        TcpState::Established,
        TcpState::FinWait,
        TcpState::CloseWait,
        TcpState::LastAck,
        TcpState::TimeWait,
        TcpState::Close,
    ];

    /// The name `conntrack -L` prints (`ESTABLISHED`, `TIME_WAIT`, …).
    pub const fn as_str(self) -> &'static str {
        match self {
            TcpState::SynSent => "SYN_SENT",
            TcpState::SynRecv => "SYN_RECV",
            TcpState::Established => "ESTABLISHED",
            TcpState::FinWait => "FIN_WAIT",
            TcpState::CloseWait => "CLOSE_WAIT",
            TcpState::LastAck => "LAST_ACK",
            TcpState::TimeWait => "TIME_WAIT",
            TcpState::Close => "CLOSE",
        }
    }
}

impl fmt::Display for TcpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which of Linux's flag classes a segment is in (`get_conntrack_index`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Segment {
    Syn,
    SynAck,
    Fin,
    Ack,
    Rst,
    None,
}

impl Segment {
    /// RST wins, then SYN (with or without ACK), then FIN, then ACK. A combination
    /// Linux's conntrack calls invalid (`tcp_valid_flags`: SYN+FIN, SYN+RST, FIN without
    /// ACK, no flag, …; PSH, ECE and CWR aside) is `None`, which opens no flow and is
    /// invalid in every state.
    pub(crate) const fn of(f: u8) -> Segment {
        const URG: u8 = 0x20;
        let core = f & (flags::FIN | flags::SYN | flags::RST | flags::ACK | URG);
        let valid = matches!(
            core,
            0x02 // SYN
                | 0x22 // SYN|URG
                | 0x12 // SYN|ACK
                | 0x04 // RST
                | 0x14 // RST|ACK
                | 0x11 // FIN|ACK
                | 0x31 // FIN|ACK|URG
                | 0x10 // ACK
                | 0x30 // ACK|URG
        );
        if !valid {
            Segment::None
        } else if f & flags::RST != 0 {
            Segment::Rst
        } else if f & flags::SYN != 0 {
            if f & flags::ACK != 0 {
                Segment::SynAck
            } else {
                Segment::Syn
            }
        } else if f & flags::FIN != 0 {
            Segment::Fin
        } else if f & flags::ACK != 0 {
            Segment::Ack
        } else {
            Segment::None
        }
    }
}

/// What a segment does to a flow in a given state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transition {
    /// Move to this state (possibly the same) and refresh the timeout.
    To(TcpState),
    /// Harmless but not state-changing (e.g. a retransmitted SYN/ACK): no refresh.
    Ignore,
    /// Makes no sense in this state (Linux marks the packet INVALID): no refresh.
    Invalid,
}

/// The state a new flow starts in, from its first (client) segment, or `None` if that
/// segment cannot open a flow: a SYN opens one, a bare ACK is picked up mid-stream as
/// ESTABLISHED (Linux with `nf_conntrack_tcp_loose=1`, its default); anything else is
/// INVALID.
pub(crate) const fn initial(f: u8) -> Option<TcpState> {
    match Segment::of(f) {
        Segment::Syn => Some(TcpState::SynSent),
        Segment::Ack => Some(TcpState::Established),
        _ => None,
    }
}

/// Linux's state table, in its own words (`sIG` ignore, `sIV` invalid), less SYN_SENT2.
pub(crate) const fn transition(old: TcpState, dir: Direction, f: u8) -> Transition {
    use Segment as G;
    use TcpState::*;
    use Transition::{Ignore as IG, Invalid as IV, To};
    match (dir, Segment::of(f)) {
        (_, G::None) => IV,
        (_, G::Rst) => To(Close),
        (_, G::Fin) => match old {
            SynSent => IV,
            SynRecv | Established => To(FinWait),
            FinWait | CloseWait | LastAck => To(LastAck),
            TimeWait => To(TimeWait),
            Close => To(Close),
        },
        (_, G::Ack) if matches!(old, FinWait | CloseWait) => To(CloseWait),
        (_, G::Ack) if matches!(old, LastAck | TimeWait) => To(TimeWait),
        (_, G::Ack) if matches!(old, Close) => To(Close),
        (Direction::Original, g) => match (g, old) {
            // A retransmitted SYN; or a new connection on a closed tuple (RFC 1122).
            (G::Syn, SynSent | TimeWait | Close) => To(SynSent),
            (G::Syn, _) => IG,
            (G::SynAck, _) => IV,
            (G::Ack, SynSent) => IV,
            (_, _) => To(Established),
        },
        (Direction::Reply, g) => match (g, old) {
            (G::Syn, _) => IV,
            (G::SynAck, SynSent) => To(SynRecv),
            (G::SynAck, _) => IG,
            (G::Ack, SynSent) => IG,
            (G::Ack, SynRecv) => To(SynRecv),
            (_, _) => To(Established),
        },
    }
}

/// A bare SYN (no ACK, no RST): the segment that opens, or re-opens, a connection.
pub(crate) const fn is_syn(f: u8) -> bool {
    matches!(Segment::of(f), Segment::Syn)
}

#[cfg(test)]
mod tests {
    use super::flags::*;
    use super::*;
    use Direction::{Original as O, Reply as R};
    use TcpState::*;
    use Transition::*;

    #[test]
    fn classifies_like_linux() {
        assert_eq!(Segment::of(SYN), Segment::Syn);
        assert_eq!(Segment::of(SYN | ACK), Segment::SynAck);
        assert_eq!(Segment::of(FIN | ACK), Segment::Fin);
        assert_eq!(Segment::of(RST | ACK), Segment::Rst);
        assert_eq!(Segment::of(ACK | 0x08), Segment::Ack); // PSH
        assert_eq!(Segment::of(0), Segment::None);
    }

    #[test]
    fn handshake_and_close() {
        assert_eq!(initial(SYN), Some(SynSent));
        assert_eq!(transition(SynSent, R, SYN | ACK), To(SynRecv));
        assert_eq!(transition(SynRecv, O, ACK), To(Established));
        assert_eq!(transition(Established, O, FIN | ACK), To(FinWait));
        assert_eq!(transition(FinWait, R, ACK), To(CloseWait));
        assert_eq!(transition(CloseWait, R, FIN | ACK), To(LastAck));
        assert_eq!(transition(LastAck, O, ACK), To(TimeWait));
        // Both FINs back to back.
        assert_eq!(transition(FinWait, R, FIN | ACK), To(LastAck));
    }

    #[test]
    fn odd_segments() {
        assert_eq!(initial(ACK), Some(Established));
        assert_eq!(initial(SYN | ACK), None);
        assert_eq!(initial(RST), None);
        assert_eq!(initial(FIN), None);
        assert_eq!(transition(SynSent, O, ACK), Invalid);
        assert_eq!(transition(SynSent, O, SYN), To(SynSent));
        assert_eq!(transition(SynSent, R, ACK), Ignore);
        assert_eq!(transition(Established, O, SYN), Ignore);
        assert_eq!(transition(Established, R, SYN | ACK), Ignore);
        assert_eq!(transition(Established, O, SYN | ACK), Invalid);
        assert_eq!(transition(Established, R, SYN), Invalid);
        assert_eq!(transition(SynSent, O, FIN), Invalid);
        assert_eq!(transition(TimeWait, O, SYN), To(SynSent));
        assert_eq!(transition(Established, O, 0), Invalid);
        for s in TcpState::ALL {
            assert_eq!(transition(s, R, RST | ACK), To(Close));
            assert_eq!(transition(s, O, RST), To(Close));
        }
    }
}
