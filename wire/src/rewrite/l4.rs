//! TCP (RFC 9293), UDP (RFC 768) and SCTP (RFC 9260) headers: ports, TCP flags, and the
//! transport checksums that a port or address change invalidates.

use super::ParseError;
use super::checksum::{self, Delta, get16};
use std::net::IpAddr;

use crate::tuple::Protocol;

/// Byte offsets of the transport header fields kxp reads or writes.
mod field {
    pub const SPORT: usize = 0;
    pub const DPORT: usize = 2;
    pub const TCP_SEQ: usize = 4;
    pub const TCP_ACK: usize = 8;
    pub const TCP_DATA_OFFSET: usize = 12;
    pub const TCP_FLAGS: usize = 13;
    pub const TCP_CHECKSUM: usize = 16;
    pub const UDP_LEN: usize = 4;
    pub const UDP_CHECKSUM: usize = 6;
    pub const SCTP_CHECKSUM: usize = 8;
}

pub(super) const TCP_HEADER_LEN: usize = 20;
pub(super) const UDP_HEADER_LEN: usize = 8;
pub(super) const SCTP_HEADER_LEN: usize = 12;
/// What an ICMP error is guaranteed to quote of the transport header (RFC 792).
pub(super) const QUOTED_LEN: usize = 8;

/// TCP flag bits, as in the flags byte (offset 13).
pub mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
    pub const URG: u8 = 0x20;
    pub const ECE: u8 = 0x40;
    pub const CWR: u8 = 0x80;
}

/// What the rest of the parser needs from a transport header.
#[derive(Debug, Clone, Copy)]
pub(super) struct Segment {
    pub sport: u16,
    pub dport: u16,
    /// TCP flags byte; 0 for UDP and SCTP.
    pub tcp_flags: u8,
    pub header_len: usize,
    pub payload_len: usize,
}

/// Checks and reads the transport header of `seg`, the whole IP payload.
///
/// # Errors
/// `BadL4Header` when the payload is shorter than the header or the header's own length
/// field (TCP data offset, UDP length) is impossible.
pub(super) fn parse(seg: &[u8], proto: Protocol) -> Result<Segment, ParseError> {
    let min = match proto {
        Protocol::Tcp => TCP_HEADER_LEN,
        Protocol::Udp => UDP_HEADER_LEN,
        Protocol::Sctp => SCTP_HEADER_LEN,
    };
    if seg.len() < min {
        return Err(ParseError::BadL4Header);
    }
    let (sport, dport) = (get16(seg, field::SPORT), get16(seg, field::DPORT));
    let (tcp_flags, header_len, end) = match proto {
        Protocol::Tcp => {
            let header_len = usize::from(seg[field::TCP_DATA_OFFSET] >> 4) * 4;
            if header_len < TCP_HEADER_LEN || seg.len() < header_len {
                return Err(ParseError::BadL4Header);
            }
            (seg[field::TCP_FLAGS], header_len, seg.len())
        }
        Protocol::Udp => {
            let len = usize::from(get16(seg, field::UDP_LEN));
            if len < UDP_HEADER_LEN || seg.len() < len {
                return Err(ParseError::BadL4Header);
            }
            (0, UDP_HEADER_LEN, len)
        }
        Protocol::Sctp => (0, SCTP_HEADER_LEN, seg.len()),
    };
    Ok(Segment {
        sport,
        dport,
        tcp_flags,
        header_len,
        payload_len: end - header_len,
    })
}

/// Reads the transport header at the start of the first fragment of a datagram: the
/// fragment holds the header (ports, and the checksum that covers the whole datagram)
/// but not all of the payload, so lengths are not checked against it.
///
/// # Errors
/// `Fragment` when the fragment is too short to hold the header up to its checksum.
pub(super) fn parse_first_fragment(seg: &[u8], proto: Protocol) -> Result<Segment, ParseError> {
    let min = match proto {
        Protocol::Tcp => TCP_HEADER_LEN,
        Protocol::Udp => UDP_HEADER_LEN,
        Protocol::Sctp => return Err(ParseError::Fragment),
    };
    if seg.len() < min {
        return Err(ParseError::Fragment);
    }
    let (tcp_flags, header_len) = match proto {
        Protocol::Tcp => {
            let header_len = usize::from(seg[field::TCP_DATA_OFFSET] >> 4) * 4;
            if header_len < TCP_HEADER_LEN || seg.len() < header_len {
                return Err(ParseError::Fragment);
            }
            (seg[field::TCP_FLAGS], header_len)
        }
        _ => (0, UDP_HEADER_LEN),
    };
    Ok(Segment {
        sport: get16(seg, field::SPORT),
        dport: get16(seg, field::DPORT),
        tcp_flags,
        header_len,
        payload_len: seg.len() - header_len,
    })
}

/// The ports of a quoted transport header; the caller has checked it holds 8 bytes.
pub(super) fn quoted_ports(quote: &[u8]) -> (u16, u16) {
    (get16(quote, field::SPORT), get16(quote, field::DPORT))
}

/// TCP sequence and acknowledgment numbers; the caller has checked the 20-byte header.
pub(super) fn tcp_seq_ack(seg: &[u8]) -> (u32, u32) {
    (
        checksum::get32(seg, field::TCP_SEQ),
        checksum::get32(seg, field::TCP_ACK),
    )
}

/// Writes the ports of the complete transport packet `seg` (the IP payload, as parsed) and
/// fixes its checksum: incrementally for TCP and UDP, with `pseudo` the change of the
/// pseudo-header's addresses; by recomputing the CRC32c for SCTP, whose checksum covers no
/// pseudo-header, only when a port changed.
pub(super) fn rewrite(seg: &mut [u8], proto: Protocol, sport: u16, dport: u16, pseudo: Delta) {
    let mut unused = Delta::default();
    let mut d = pseudo;
    match proto {
        Protocol::Tcp => {
            d.write16(seg, field::SPORT, sport);
            d.write16(seg, field::DPORT, dport);
            d.patch(seg, field::TCP_CHECKSUM, &mut unused);
        }
        Protocol::Udp => {
            d.write16(seg, field::SPORT, sport);
            d.write16(seg, field::DPORT, dport);
            d.patch_udp(seg, field::UDP_CHECKSUM, &mut unused);
        }
        Protocol::Sctp => {
            if (get16(seg, field::SPORT), get16(seg, field::DPORT)) != (sport, dport) {
                d.write16(seg, field::SPORT, sport);
                d.write16(seg, field::DPORT, dport);
                checksum::sctp_fill(seg);
            }
        }
    }
}

/// Whether the TCP or UDP checksum of `seg` (the IP payload of a packet sent from `src` to
/// `dst`) holds only the pseudo-header's sum, folded and not complemented: the state of a
/// packet whose sender left the checksum to the hardware (Linux `CHECKSUM_PARTIAL`, the
/// default on every veth, so on every pod's traffic). The skb's flag that says so does not
/// travel through an AF_XDP ring, so the field itself is the only witness.
///
/// When can it misfire? A complete, valid checksum equal to the pseudo-header sum means
/// the rest of the segment sums to zero (ones' complement): the segment is then
/// checksummed in full by [`complete`], which yields that same valid checksum, so nothing
/// changes. A *wrong* checksum that happens to equal the pseudo-header sum (about one
/// corrupted segment in 65,536) is made valid: the receiver then accepts a segment it
/// would have dropped. That is the same trust the kernel places in a `CHECKSUM_PARTIAL`
/// skb on a veth, and links deliver frames that passed their own CRC, so it is accepted.
/// SCTP (CRC32c, no pseudo-header) is never partial here.
pub(super) fn checksum_is_partial(seg: &[u8], proto: Protocol, src: IpAddr, dst: IpAddr) -> bool {
    let (at, len) = match proto {
        Protocol::Tcp => (field::TCP_CHECKSUM, seg.len()),
        Protocol::Udp => (field::UDP_CHECKSUM, usize::from(get16(seg, field::UDP_LEN))),
        Protocol::Sctp => return false,
    };
    let stored = get16(seg, at);
    if stored == 0 {
        // UDP's "no checksum"; a folded pseudo-header sum is never 0.
        return false;
    }
    let folded = checksum::fold(checksum::pseudo_sum(src, dst, proto.number(), len));
    // 0x0000 and 0xFFFF are the same ones'-complement number (stored is not 0 here).
    stored == folded || (stored == 0xFFFF && folded == 0)
}

/// Writes the ports of `seg` (a TCP or UDP packet now sent from `src` to `dst`) and fills
/// in its whole checksum, pseudo-header and payload summed again: for a packet whose
/// checksum was partial ([`checksum_is_partial`]), which no one after kxp will complete
/// (an AF_XDP transmit carries no offload request in copy mode).
pub(super) fn rewrite_complete(
    seg: &mut [u8],
    proto: Protocol,
    sport: u16,
    dport: u16,
    src: IpAddr,
    dst: IpAddr,
) {
    seg[field::SPORT..field::SPORT + 2].copy_from_slice(&sport.to_be_bytes());
    seg[field::DPORT..field::DPORT + 2].copy_from_slice(&dport.to_be_bytes());
    let (at, len) = match proto {
        Protocol::Tcp => (field::TCP_CHECKSUM, seg.len()),
        Protocol::Udp => (field::UDP_CHECKSUM, usize::from(get16(seg, field::UDP_LEN))),
        Protocol::Sctp => return,
    };
    seg[at..at + 2].fill(0);
    let c = checksum::finish(
        checksum::pseudo_sum(src, dst, proto.number(), len) + checksum::sum_fast(&seg[..len]),
    );
    let c = match (proto, c) {
        (Protocol::Udp, 0) => 0xFFFF,
        (_, c) => c,
    };
    seg[at..at + 2].copy_from_slice(&c.to_be_bytes());
}

/// Writes the ports of a transport header quoted in an ICMP error and fixes its checksum
/// when the quote holds it (TCP's at offset 16 only in a long enough quote; UDP's always;
/// the bytes of SCTP's CRC32c that the quote holds, when `sctp_len`, the quoted packet's
/// original length, is known). Returns every change made, for the ICMP checksum that covers the quote.
///
/// The caller has checked that `quote` holds at least 8 bytes.
pub(super) fn rewrite_quoted(
    quote: &mut [u8],
    proto: Protocol,
    sport: u16,
    dport: u16,
    pseudo: Delta,
    sctp_len: Option<usize>,
) -> Delta {
    let old_ports = [quote[0], quote[1], quote[2], quote[3]];
    let mut covered = Delta::default();
    covered.write16(quote, field::SPORT, sport);
    covered.write16(quote, field::DPORT, dport);
    let mut d = pseudo;
    d.add(covered);
    match proto {
        Protocol::Tcp if quote.len() >= field::TCP_CHECKSUM + 2 => {
            d.patch(quote, field::TCP_CHECKSUM, &mut covered);
        }
        Protocol::Udp => d.patch_udp(quote, field::UDP_CHECKSUM, &mut covered),
        Protocol::Sctp if quote.len() > field::SCTP_CHECKSUM => {
            if let Some(len) = sctp_len {
                // The CRC changes by an XOR mask that does not depend on it: even the
                // bytes of a CRC the quote cuts can be patched.
                let new_ports = [quote[0], quote[1], quote[2], quote[3]];
                let mask = checksum::sctp_crc_update_ports(0, old_ports, new_ports, len);
                let at = field::SCTP_CHECKSUM;
                let mut crc = [0u8; 4];
                for (i, (c, m)) in crc.iter_mut().zip(mask.to_le_bytes()).enumerate() {
                    *c = quote.get(at + i).map_or(0, |q| q ^ m);
                }
                covered.write_clipped(quote, at, &crc);
            }
        }
        _ => {}
    }
    covered
}

/// Writes a 20-byte TCP header with no options and window 0, checksum included, into
/// `out[..20]`. `pseudo` is the pseudo-header's sum.
pub(super) fn write_tcp(
    out: &mut [u8],
    ports: (u16, u16),
    seq: u32,
    ack: u32,
    flags: u8,
    pseudo: u64,
) {
    let hdr = &mut out[..TCP_HEADER_LEN];
    hdr.fill(0);
    hdr[field::SPORT..field::SPORT + 2].copy_from_slice(&ports.0.to_be_bytes());
    hdr[field::DPORT..field::DPORT + 2].copy_from_slice(&ports.1.to_be_bytes());
    hdr[field::TCP_SEQ..field::TCP_SEQ + 4].copy_from_slice(&seq.to_be_bytes());
    hdr[field::TCP_ACK..field::TCP_ACK + 4].copy_from_slice(&ack.to_be_bytes());
    hdr[field::TCP_DATA_OFFSET] = 5 << 4;
    hdr[field::TCP_FLAGS] = flags;
    let c = checksum::finish(pseudo + checksum::sum(hdr));
    hdr[field::TCP_CHECKSUM..field::TCP_CHECKSUM + 2].copy_from_slice(&c.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewrite::testutil::{Endpoints, build};

    fn l4(pkt: &[u8]) -> &[u8] {
        let off = if pkt[0] >> 4 == 4 { 20 } else { 40 };
        &pkt[off..]
    }

    #[test]
    fn reads_ports_flags_and_lengths() {
        let e = Endpoints::v4();
        let pkt = build(&e, Protocol::Tcp, b"abc");
        let s = parse(l4(&pkt), Protocol::Tcp).unwrap();
        assert_eq!((s.sport, s.dport), (e.client.port(), e.vip.port()));
        assert_eq!(s.tcp_flags, tcp_flags::SYN);
        assert_eq!((s.header_len, s.payload_len), (20, 3));

        let pkt = build(&e, Protocol::Udp, b"abcd");
        let s = parse(l4(&pkt), Protocol::Udp).unwrap();
        assert_eq!((s.tcp_flags, s.header_len, s.payload_len), (0, 8, 4));

        let pkt = build(&Endpoints::v6(), Protocol::Sctp, b"abcd");
        let s = parse(l4(&pkt), Protocol::Sctp).unwrap();
        assert_eq!((s.sport, s.header_len), (e.client.port(), 12));
        assert_eq!(s.payload_len, l4(&pkt).len() - 12);
    }

    #[test]
    fn rejects_impossible_lengths() {
        let e = Endpoints::v4();
        let pkt = build(&e, Protocol::Tcp, b"");
        let mut seg = l4(&pkt).to_vec();
        seg[12] = 4 << 4;
        assert_eq!(
            parse(&seg, Protocol::Tcp).unwrap_err(),
            ParseError::BadL4Header
        );
        seg[12] = 6 << 4; // 24 bytes of header in a 20-byte segment
        assert_eq!(
            parse(&seg, Protocol::Tcp).unwrap_err(),
            ParseError::BadL4Header
        );
        assert_eq!(
            parse(&seg[..19], Protocol::Tcp).unwrap_err(),
            ParseError::BadL4Header
        );

        let pkt = build(&e, Protocol::Udp, b"xy");
        let mut seg = l4(&pkt).to_vec();
        seg[5] = 11; // UDP length past the IP payload
        assert_eq!(
            parse(&seg, Protocol::Udp).unwrap_err(),
            ParseError::BadL4Header
        );
        seg[5] = 7;
        assert_eq!(
            parse(&seg, Protocol::Udp).unwrap_err(),
            ParseError::BadL4Header
        );
        assert_eq!(
            parse(&[0; 11], Protocol::Sctp).unwrap_err(),
            ParseError::BadL4Header
        );
    }

    #[test]
    fn sctp_crc_is_left_alone_when_ports_do_not_change() {
        let pkt = build(&Endpoints::v4(), Protocol::Sctp, b"data");
        let mut seg = l4(&pkt).to_vec();
        seg[8] ^= 0xFF; // a corrupt CRC stays corrupt: nothing was translated
        let before = seg.clone();
        let (sport, dport) = quoted_ports(&seg);
        rewrite(&mut seg, Protocol::Sctp, sport, dport, Delta::default());
        assert_eq!(seg, before);
    }
}
