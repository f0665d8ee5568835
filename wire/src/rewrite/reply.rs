//! Replies kxp generates itself when a Service has no endpoints and its policy is to
//! reject: a TCP reset or an ICMP port-unreachable, from the Service address back to
//! the client, as kube-proxy's `REJECT` rules make the kernel send.
//!
//! These are built once per refused packet, not per forwarded packet, so their checksums
//! are summed in full.

use std::net::IpAddr;

use super::checksum::{finish, pseudo_sum, sum};
use super::l4::{self, tcp_flags};
use super::parse::icmp::{self, ICMPV4, ICMPV6};
use super::{ParseError, Parsed, ipv4, ipv6, parse};
use crate::tuple::Protocol;

/// Why no reply was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// The original packet does not parse.
    #[error("original packet is malformed: {0}")]
    Parse(#[from] ParseError),
    /// The original is not a TCP/UDP/SCTP packet (never answer an ICMP message with an
    /// ICMP error, RFC 1122 section 3.2.2).
    #[error("original packet is not TCP, UDP or SCTP: kxp only answers Service traffic")]
    NotAFlow,
    /// A reset answers TCP only.
    #[error("original packet is not TCP: only TCP is answered with a reset")]
    NotTcp,
    /// The original is itself a reset, which is never answered (RFC 9293 section 3.10.7.1).
    #[error("original packet is a TCP reset, which is never answered")]
    AnswersReset,
    /// An address of the original is multicast, broadcast or unspecified (RFC 1122
    /// section 3.2.2, RFC 4443 section 2.4).
    #[error("original packet has a multicast, broadcast or unspecified address: no reply")]
    NotUnicast,
    /// `out` cannot hold the reply.
    #[error("output buffer holds {have} bytes but the reply needs {need}")]
    BufferTooSmall { need: usize, have: usize },
}

/// TTL / hop limit of generated replies (Linux's default).
const TTL: u8 = 64;
/// RFC 1812 section 4.3.2.3: an ICMPv4 error is at most 576 bytes.
const ICMPV4_MAX: usize = 576;
/// RFC 4443 section 2.4 (c): an ICMPv6 error fits in the minimum MTU.
const ICMPV6_MAX: usize = 1280;

/// Builds into `out` the TCP reset answering the TCP segment `orig`, from its destination
/// (the Service address) back to its source, and returns its length.
///
/// Per RFC 9293 section 3.10.7.1: if `orig` has ACK set, the reset is a bare RST with
/// `seq = orig.ack`; otherwise (a SYN, typically) it is RST+ACK with `seq = 0` and
/// `ack = orig.seq + payload length + SYN + FIN`. Window 0, no options, TTL 64.
///
/// # Errors
/// [`BuildError`]: `orig` malformed, not TCP, itself a RST, not unicast, or `out`
/// shorter than 40 (IPv4) / 60 (IPv6) bytes. Nothing is written on error.
pub fn build_tcp_rst(orig: &[u8], out: &mut [u8]) -> Result<usize, BuildError> {
    let Parsed::Flow(flow) = parse(orig)? else {
        return Err(BuildError::NotAFlow);
    };
    let t = flow.tuple();
    if t.proto != Protocol::Tcp {
        return Err(BuildError::NotTcp);
    }
    let flags = flow.tcp_flags();
    if flags & tcp_flags::RST != 0 {
        return Err(BuildError::AnswersReset);
    }
    check_unicast(t.src, t.dst)?;
    let (seq, ack) = l4::tcp_seq_ack(&orig[flow.l4_offset()..]);
    let (seq, ack, flags) = if flags & tcp_flags::ACK != 0 {
        (ack, 0, tcp_flags::RST)
    } else {
        let len = flow.payload_len() as u32
            + u32::from(flags & tcp_flags::SYN != 0)
            + u32::from(flags & tcp_flags::FIN != 0);
        (0, seq.wrapping_add(len), tcp_flags::RST | tcp_flags::ACK)
    };

    let ip_len = ip_header_len(t.src);
    let need = ip_len + l4::TCP_HEADER_LEN;
    check_room(out, need)?;
    write_ip_header(
        out,
        t.dst,
        t.src,
        Protocol::Tcp.number(),
        l4::TCP_HEADER_LEN,
    );
    let pseudo = pseudo_sum(t.dst, t.src, Protocol::Tcp.number(), l4::TCP_HEADER_LEN);
    l4::write_tcp(
        &mut out[ip_len..],
        (t.dport, t.sport),
        seq,
        ack,
        flags,
        pseudo,
    );
    Ok(need)
}

/// Builds into `out` the ICMP port-unreachable answering the TCP/UDP/SCTP packet `orig`
/// (ICMPv4 type 3 code 3, ICMPv6 type 1 code 4), from its destination (the Service
/// address) back to its source, and returns its length.
///
/// It quotes as much of `orig` as fits in 576 bytes (IPv4, RFC 1812) or 1280 bytes
/// (IPv6, RFC 4443) and in `out`, at least its IP header and 8 transport bytes.
///
/// # Errors
/// [`BuildError`]: `orig` malformed, not a flow, not unicast, or `out` too small for the
/// minimal quote. Nothing is written on error.
pub fn build_icmp_port_unreachable(orig: &[u8], out: &mut [u8]) -> Result<usize, BuildError> {
    build_icmp_error(orig, None, [3, 3], [1, 4], [0; 4], out)
}

/// Builds into `out` what a router answers a packet too big for the next link when it
/// must not fragment it (IPv4 with DF; every IPv6 packet): ICMPv4 "fragmentation needed"
/// (type 3 code 4, the next-hop MTU in the header, RFC 1191) or ICMPv6 "packet too big"
/// (type 2, RFC 4443), from `router` (an address of this node) back to the source of
/// `orig`, quoting `orig` as it arrived. Returns its length.
///
/// # Errors
/// As [`build_icmp_port_unreachable`].
pub fn build_icmp_too_big(
    orig: &[u8],
    mtu: u32,
    router: IpAddr,
    out: &mut [u8],
) -> Result<usize, BuildError> {
    let rest = match router {
        IpAddr::V4(_) => {
            let m = (mtu.min(u32::from(u16::MAX)) as u16).to_be_bytes();
            [0, 0, m[0], m[1]]
        }
        IpAddr::V6(_) => mtu.to_be_bytes(),
    };
    build_icmp_error(orig, Some(router), [3, 4], [2, 0], rest, out)
}

/// An ICMP error about `orig` (type/code for each family, the 4 bytes after the
/// checksum), from `from` or else `orig`'s destination, to `orig`'s source.
fn build_icmp_error(
    orig: &[u8],
    from: Option<IpAddr>,
    v4: [u8; 2],
    v6: [u8; 2],
    rest: [u8; 4],
    out: &mut [u8],
) -> Result<usize, BuildError> {
    let Parsed::Flow(flow) = parse(orig)? else {
        return Err(BuildError::NotAFlow);
    };
    let mut t = flow.tuple();
    if let Some(f) = from.filter(|f| f.is_ipv4() == t.src.is_ipv4()) {
        t.dst = f;
    }
    check_unicast(t.src, t.dst)?;
    let (max, [icmp_type, code], proto) = match t.src {
        IpAddr::V4(_) => (ICMPV4_MAX, v4, ICMPV4),
        IpAddr::V6(_) => (ICMPV6_MAX, v6, ICMPV6),
    };
    let ip_len = ip_header_len(t.src);
    let headers = ip_len + icmp::HEADER_LEN;
    let min_quote = flow.l4_offset() + l4::QUOTED_LEN;
    let quote_len = flow
        .ip_len()
        .min(max - headers)
        .min(out.len().saturating_sub(headers));
    check_room(out, headers + min_quote)?;
    let msg_len = icmp::HEADER_LEN + quote_len;

    let msg = &mut out[ip_len..ip_len + msg_len];
    msg[..icmp::HEADER_LEN]
        .copy_from_slice(&[icmp_type, code, 0, 0, rest[0], rest[1], rest[2], rest[3]]);
    msg[icmp::HEADER_LEN..].copy_from_slice(&orig[..quote_len]);
    let pseudo = match t.src {
        IpAddr::V4(_) => 0, // ICMPv4's checksum covers the message only
        IpAddr::V6(_) => pseudo_sum(t.dst, t.src, ICMPV6, msg_len),
    };
    let c = finish(pseudo + sum(msg));
    msg[2..4].copy_from_slice(&c.to_be_bytes());
    write_ip_header(out, t.dst, t.src, proto, msg_len);
    Ok(ip_len + msg_len)
}

fn ip_header_len(a: IpAddr) -> usize {
    match a {
        IpAddr::V4(_) => ipv4::MIN_HEADER_LEN,
        IpAddr::V6(_) => ipv6::HEADER_LEN,
    }
}

fn write_ip_header(out: &mut [u8], src: IpAddr, dst: IpAddr, proto: u8, payload_len: usize) {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => ipv4::write_header(out, s, d, proto, payload_len, TTL),
        (IpAddr::V6(s), IpAddr::V6(d)) => ipv6::write_header(out, s, d, proto, payload_len, TTL),
        // A parsed packet's addresses are of one family.
        _ => {}
    }
}

fn check_room(out: &[u8], need: usize) -> Result<(), BuildError> {
    match out.len() >= need {
        true => Ok(()),
        false => Err(BuildError::BufferTooSmall {
            need,
            have: out.len(),
        }),
    }
}

fn check_unicast(src: IpAddr, dst: IpAddr) -> Result<(), BuildError> {
    let unicast = |a: IpAddr| match a {
        IpAddr::V4(a) => !(a.is_unspecified() || a.is_multicast() || a.is_broadcast()),
        IpAddr::V6(a) => !(a.is_unspecified() || a.is_multicast()),
    };
    match unicast(src) && unicast(dst) {
        true => Ok(()),
        false => Err(BuildError::NotUnicast),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewrite::testutil::{
        Endpoints, PATTERN, build, build_tcp, build_tuple, icmp_error, verify_checksums,
    };
    use crate::rewrite::{IcmpErrorPacket, parse};
    use etherparse::{NetSlice, SlicedPacket, TransportSlice};

    fn tcp_of(pkt: &[u8]) -> etherparse::TcpSlice<'_> {
        match SlicedPacket::from_ip(pkt).unwrap().transport {
            Some(TransportSlice::Tcp(t)) => t,
            other => panic!("not TCP: {other:?}"),
        }
    }

    fn ip_ttl(pkt: &[u8]) -> u8 {
        match SlicedPacket::from_ip(pkt).unwrap().net {
            Some(NetSlice::Ipv4(ip)) => ip.header().ttl(),
            Some(NetSlice::Ipv6(ip)) => ip.header().hop_limit(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rst_answers_a_syn_from_the_service_address() {
        for e in [Endpoints::v4(), Endpoints::v6()] {
            let t = e.original(Protocol::Tcp);
            for payload in [&b""[..], b"fast open data"] {
                let syn = build_tcp(&t, 1000, None, tcp_flags::SYN, payload);
                let mut out = [PATTERN; 128];
                let n = build_tcp_rst(&syn, &mut out).unwrap();
                assert_eq!(n, if e.client.is_ipv4() { 40 } else { 60 });
                assert!(
                    out[n..].iter().all(|&b| b == PATTERN),
                    "wrote past the reply"
                );
                let rst = &out[..n];
                verify_checksums(rst);
                let tcp = tcp_of(rst);
                assert!(tcp.rst() && tcp.ack() && !tcp.syn());
                assert_eq!(tcp.sequence_number(), 0);
                assert_eq!(tcp.acknowledgment_number(), 1001 + payload.len() as u32);
                assert_eq!(tcp.window_size(), 0);
                assert_eq!(ip_ttl(rst), 64);
                let Ok(Parsed::Flow(f)) = parse(rst) else {
                    panic!()
                };
                assert_eq!(f.tuple(), t.reversed());
            }
        }
    }

    #[test]
    fn rst_answers_a_segment_with_ack_from_its_ack_number() {
        let t = Endpoints::v4().original(Protocol::Tcp);
        let seg = build_tcp(
            &t,
            5000,
            Some(0xFFFF_FFF0),
            tcp_flags::ACK | tcp_flags::FIN,
            b"z",
        );
        let mut out = [PATTERN; 40];
        let n = build_tcp_rst(&seg, &mut out).unwrap();
        verify_checksums(&out[..n]);
        let tcp = tcp_of(&out[..n]);
        assert!(tcp.rst() && !tcp.ack());
        assert_eq!(tcp.sequence_number(), 0xFFFF_FFF0);
        assert_eq!(tcp.acknowledgment_number(), 0);
        // Without ACK, FIN counts in the acknowledged length, wrapping around.
        let seg = build_tcp(&t, u32::MAX, None, tcp_flags::FIN, b"ab");
        let n = build_tcp_rst(&seg, &mut out).unwrap();
        assert_eq!(tcp_of(&out[..n]).acknowledgment_number(), 2);
    }

    #[test]
    fn rst_is_refused_when_it_must_not_be_sent() {
        let e = Endpoints::v4();
        let t = e.original(Protocol::Tcp);
        let mut out = [PATTERN; 64];
        let rst = build_tcp(&t, 1, None, tcp_flags::RST, b"");
        assert_eq!(build_tcp_rst(&rst, &mut out), Err(BuildError::AnswersReset));
        let udp = build(&e, Protocol::Udp, b"");
        assert_eq!(build_tcp_rst(&udp, &mut out), Err(BuildError::NotTcp));
        let err = icmp_error(e.router, e.client.ip(), &udp);
        assert_eq!(build_tcp_rst(&err, &mut out), Err(BuildError::NotAFlow));
        let mut bcast = t;
        bcast.dst = "255.255.255.255".parse().unwrap();
        let syn = build_tcp(&bcast, 1, None, tcp_flags::SYN, b"");
        assert_eq!(build_tcp_rst(&syn, &mut out), Err(BuildError::NotUnicast));
        let syn = build_tcp(&t, 1, None, tcp_flags::SYN, b"");
        assert_eq!(
            build_tcp_rst(&syn, &mut out[..39]),
            Err(BuildError::BufferTooSmall { need: 40, have: 39 })
        );
        assert!(
            out.iter().all(|&b| b == PATTERN),
            "nothing written on error"
        );
        assert_eq!(
            build_tcp_rst(&syn[..30], &mut out),
            Err(BuildError::Parse(ParseError::Truncated))
        );
    }

    fn as_icmp_error(pkt: &[u8]) -> IcmpErrorPacket {
        match parse(pkt).unwrap() {
            Parsed::IcmpError(e) => e,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn too_big_carries_the_mtu_and_comes_from_the_router() {
        for e in [Endpoints::v4(), Endpoints::v6()] {
            let t = e.original(Protocol::Udp);
            let orig = build_tuple(&t, &[7u8; 1400]);
            let mut out = [PATTERN; 1500];
            let n = build_icmp_too_big(&orig, 1280, e.router, &mut out).unwrap();
            let reply = &out[..n];
            verify_checksums(reply);
            let err = as_icmp_error(reply);
            assert_eq!(err.inner(), t, "quotes the packet as sent");
            assert_eq!((err.src(), err.dst()), (e.router, t.src));
            let icmp = &reply[err.l4_offset()..];
            if e.client.is_ipv4() {
                // Type 3 code 4, next-hop MTU in the second half of the rest of header.
                assert_eq!((icmp[0], icmp[1]), (3, 4));
                assert_eq!(u16::from_be_bytes([icmp[6], icmp[7]]), 1280);
                assert!(n <= 576);
            } else {
                // Packet Too Big, the MTU in the whole 32-bit field.
                assert_eq!((icmp[0], icmp[1]), (2, 0));
                assert_eq!(
                    u32::from_be_bytes([icmp[4], icmp[5], icmp[6], icmp[7]]),
                    1280
                );
                assert!(n <= 1280);
            }
        }
    }

    #[test]
    fn port_unreachable_quotes_the_original() {
        for e in [Endpoints::v4(), Endpoints::v6()] {
            for proto in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
                let t = e.original(proto);
                let orig = build_tuple(&t, b"hello");
                let mut out = [PATTERN; 1500];
                let n = build_icmp_port_unreachable(&orig, &mut out).unwrap();
                let reply = &out[..n];
                assert!(out[n..].iter().all(|&b| b == PATTERN));
                verify_checksums(reply);
                // Exactly what etherparse builds for the same error.
                assert_eq!(reply, icmp_error(t.dst, t.src, &orig));
                let err = as_icmp_error(reply);
                assert_eq!(err.inner(), t);
                assert_eq!((err.src(), err.dst()), (t.dst, t.src));
                assert_eq!(ip_ttl(reply), 64);
            }
        }
    }

    #[test]
    fn port_unreachable_is_capped_at_576_and_1280_bytes() {
        for (e, max) in [(Endpoints::v4(), 576), (Endpoints::v6(), 1280)] {
            let t = e.original(Protocol::Udp);
            let orig = build_tuple(&t, &[7u8; 1400]);
            let mut out = [PATTERN; 2000];
            let n = build_icmp_port_unreachable(&orig, &mut out).unwrap();
            assert_eq!(n, max);
            verify_checksums(&out[..n]);
            let hdrs = if max == 576 { 28 } else { 48 };
            assert_eq!(out[hdrs..n], orig[..max - hdrs]);
            assert_eq!(as_icmp_error(&out[..n]).inner(), t);

            // A smaller output buffer shortens the quote, down to header + 8 bytes.
            let min = hdrs + (hdrs - 8) + 8;
            let n = build_icmp_port_unreachable(&orig, &mut out[..min]).unwrap();
            assert_eq!(n, min);
            verify_checksums(&out[..n]);
            assert_eq!(
                build_icmp_port_unreachable(&orig, &mut out[..min - 1]),
                Err(BuildError::BufferTooSmall {
                    need: min,
                    have: min - 1
                })
            );
        }
    }

    #[test]
    fn port_unreachable_is_not_sent_about_icmp_or_multicast() {
        let e = Endpoints::v6();
        let t = e.original(Protocol::Udp);
        let orig = build_tuple(&t, b"x");
        let mut out = [PATTERN; 1500];
        let n = build_icmp_port_unreachable(&orig, &mut out).unwrap();
        let err = out[..n].to_vec();
        assert_eq!(
            build_icmp_port_unreachable(&err, &mut out),
            Err(BuildError::NotAFlow)
        );
        let mut mcast = t;
        mcast.dst = "ff02::fb".parse().unwrap();
        let orig = build_tuple(&mcast, b"x");
        assert_eq!(
            build_icmp_port_unreachable(&orig, &mut out),
            Err(BuildError::NotUnicast)
        );
    }
}
