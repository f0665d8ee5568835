//! ICMPv4 (RFC 792) and ICMPv6 (RFC 4443) errors that quote a translated flow.
//!
//! A backend's "port unreachable", or a router's "time exceeded" or "fragmentation
//! needed" (PMTU discovery depends on it), quotes the packet as translated. The client
//! only recognises it once the quote is translated back: addresses, ports, and the
//! checksums inside the quote, then the outer header and the ICMP checksum. All of it is
//! patched incrementally: every word changed inside the ICMP message is recorded and the
//! ICMP checksum (plus, for ICMPv6, its pseudo-header's address change) is patched once.

use std::net::IpAddr;

use super::checksum::Delta;
use super::l4;
use super::parse::IcmpErrorPacket;
use super::translate::{RewriteError, check_family, set_addrs};
use crate::tuple::Tuple;

use super::parse::icmp::{HEADER_LEN, field};

/// Translates an ICMP error about a translated flow, in place.
///
/// The quoted packet's addresses and ports become `inner_to`'s; the quoted IPv4 header
/// checksum and the quoted transport checksum (when the quote holds it: UDP's always,
/// TCP's from 18 quoted bytes, SCTP's CRC32c even when cut) are patched. The outer destination
/// becomes `outer_dst`, and the outer source `outer_src` when it is `Some` (the error came
/// from the endpoint itself and must appear to come from the Service address; a router's
/// error keeps the router's address). The outer IPv4 header checksum and the ICMP
/// checksum are patched incrementally: ICMPv4's covers the message, ICMPv6's also the
/// pseudo-header. Nothing is summed again.
///
/// # Errors
/// [`RewriteError::ProtocolMismatch`] when `inner_to` has another protocol than the quote,
/// [`RewriteError::FamilyMismatch`] when any address is of another family than the packet,
/// [`RewriteError::BufferTooShort`] when `buf` is shorter than the packet `pkt` describes.
/// The buffer is unchanged on error.
pub fn rewrite_icmp_error(
    buf: &mut [u8],
    pkt: &IcmpErrorPacket,
    inner_to: &Tuple,
    outer_src: Option<IpAddr>,
    outer_dst: IpAddr,
) -> Result<(), RewriteError> {
    if inner_to.proto != pkt.inner.proto {
        return Err(RewriteError::ProtocolMismatch {
            packet: pkt.inner.proto,
            to: inner_to.proto,
        });
    }
    let v6 = pkt.src.is_ipv6();
    check_family(
        v6,
        [
            Some(inner_to.src),
            Some(inner_to.dst),
            outer_src,
            Some(outer_dst),
        ],
    )?;
    let buf = super::translate::parsed_bytes(buf, pkt.ip_len)?;

    let (ip, msg) = buf.split_at_mut(pkt.l4_offset);
    let (icmp, quote) = msg.split_at_mut(HEADER_LEN);
    let (inner_ip, inner_l4) = quote.split_at_mut(pkt.inner_l4_offset - pkt.inner_l3_offset());

    let inner = set_addrs(inner_ip, Some(inner_to.src), Some(inner_to.dst), v6);
    let mut covered = inner.bytes;
    covered.add(l4::rewrite_quoted(
        inner_l4,
        inner_to.proto,
        inner_to.sport,
        inner_to.dport,
        inner.pseudo,
        pkt.inner_sctp_len,
    ));
    let outer = set_addrs(ip, outer_src, Some(outer_dst), v6);
    if v6 {
        covered.add(outer.pseudo);
    }
    covered.patch(icmp, field::CHECKSUM, &mut Delta::default());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewrite::testutil::{
        Endpoints, build, build_tuple, icmp_echo, icmp_error, verify_checksums,
    };
    use crate::rewrite::{ParseError, Parsed};
    use crate::tuple::Protocol;

    fn icmp_err(pkt: &[u8]) -> IcmpErrorPacket {
        match crate::rewrite::parse(pkt).unwrap() {
            Parsed::IcmpError(e) => e,
            other => panic!("not an ICMP error: {other:?}"),
        }
    }

    /// Transport bytes to quote besides the whole packet: the RFC 792 minimum, cutting the
    /// SCTP CRC (odd lengths too), all of it, the TCP checksum, an odd length past it.
    const QUOTED_L4: [usize; 7] = [8, 9, 10, 11, 12, 18, 21];

    /// An error about `translated` (the first `qlen` bytes quoted), sent by the endpoint
    /// itself or by a router, is translated back to an error about `original`: byte for
    /// byte what etherparse builds for that, and translating again gives back what arrived.
    fn check_error_round_trip(
        e: &Endpoints,
        original: &Tuple,
        translated: &Tuple,
        qlen: usize,
        from_endpoint: bool,
    ) {
        let sent = build_tuple(original, b"some payload bytes");
        let forwarded = build_tuple(translated, b"some payload bytes");
        let (err_src, new_src) = match from_endpoint {
            true => (translated.dst, Some(original.dst)),
            false => (e.router, None),
        };
        let mut pkt = icmp_error(err_src, translated.src, &forwarded[..qlen]);
        let arrived = pkt.clone();
        let parsed = icmp_err(&pkt);
        assert_eq!(parsed.inner(), *translated);
        assert_eq!(parsed.payload_len(), qlen);

        rewrite_icmp_error(&mut pkt, &parsed, original, new_src, original.src).unwrap();
        let expected = icmp_error(new_src.unwrap_or(err_src), original.src, &sent[..qlen]);
        assert_eq!(pkt, expected, "{translated}, {qlen} bytes quoted");
        verify_checksums(&pkt);

        let back = icmp_err(&pkt);
        let old_src = from_endpoint.then_some(err_src);
        rewrite_icmp_error(&mut pkt, &back, translated, old_src, translated.src).unwrap();
        assert_eq!(pkt, arrived);
    }

    #[test]
    fn error_about_translated_flow_round_trips() {
        for e in [Endpoints::v4(), Endpoints::v6()] {
            let l4 = if e.client.is_ipv4() { 20 } else { 40 };
            for proto in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
                let original = e.original(proto);
                for translated in [e.dnat(proto), e.masquerade(proto)] {
                    let full = build_tuple(&translated, b"some payload bytes").len();
                    let lens = QUOTED_L4.iter().map(|n| l4 + n).chain([full]);
                    for qlen in lens {
                        check_error_round_trip(&e, &original, &translated, qlen, true);
                        check_error_round_trip(&e, &original, &translated, qlen, false);
                    }
                }
            }
        }
    }

    #[test]
    fn quoted_udp_without_checksum_keeps_none() {
        let e = Endpoints::v4();
        let mut forwarded = build_tuple(&e.dnat(Protocol::Udp), b"x");
        forwarded[26] = 0;
        forwarded[27] = 0;
        let mut pkt = icmp_error(e.backend.ip(), e.client.ip(), &forwarded);
        let parsed = icmp_err(&pkt);
        let to = e.original(Protocol::Udp);
        rewrite_icmp_error(&mut pkt, &parsed, &to, Some(e.vip.ip()), e.client.ip()).unwrap();
        verify_checksums(&pkt);
        assert_eq!(pkt[28 + 26..28 + 28], [0, 0]);
    }

    #[test]
    fn echo_and_errors_about_echo_are_not_translatable() {
        for e in [Endpoints::v4(), Endpoints::v6()] {
            let ping = icmp_echo(e.client.ip(), e.vip.ip());
            match crate::rewrite::parse(&ping).unwrap() {
                Parsed::NotTranslatable(u) => {
                    assert!(u.is_echo());
                    assert_eq!(u.protocol(), if e.client.is_ipv4() { 1 } else { 58 });
                    assert_eq!((u.src(), u.dst()), (e.client.ip(), e.vip.ip()));
                }
                other => panic!("{other:?}"),
            }
            let err = icmp_error(e.router, e.client.ip(), &ping);
            match crate::rewrite::parse(&err).unwrap() {
                Parsed::NotTranslatable(u) => assert!(!u.is_echo()),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn malformed_quotes_are_errors() {
        let e = Endpoints::v4();
        let inner = build(&e, Protocol::Tcp, b"");
        // 7 bytes of transport header: the ports are there, RFC 792's 8 are not.
        let pkt = icmp_error(e.router, e.client.ip(), &inner[..27]);
        assert_eq!(crate::rewrite::parse(&pkt), Err(ParseError::BadIcmpQuote));
        // An IPv6 packet quoted in ICMPv4.
        let inner6 = build(&Endpoints::v6(), Protocol::Udp, b"");
        let pkt = icmp_error(e.router, e.client.ip(), &inner6);
        assert_eq!(crate::rewrite::parse(&pkt), Err(ParseError::BadIcmpQuote));
        // A quoted IPv4 header cut short.
        let pkt = icmp_error(e.router, e.client.ip(), &inner[..12]);
        assert_eq!(crate::rewrite::parse(&pkt), Err(ParseError::BadIcmpQuote));
        // An ICMP message shorter than its header.
        let mut pkt = icmp_echo(e.client.ip(), e.vip.ip());
        pkt.truncate(27);
        pkt[3] = 27;
        crate::rewrite::testutil::fix_ipv4_checksum(&mut pkt);
        assert_eq!(crate::rewrite::parse(&pkt), Err(ParseError::BadL4Header));
    }

    #[test]
    fn errors_about_fragments_are_not_translatable() {
        let e = Endpoints::v4();
        let mut inner = build(&e, Protocol::Udp, b"abc");
        inner[6] = 0x20; // more fragments
        let pkt = icmp_error(e.router, e.client.ip(), &inner);
        assert!(matches!(
            crate::rewrite::parse(&pkt),
            Ok(Parsed::NotTranslatable(_))
        ));
    }

    #[test]
    fn mismatched_targets_leave_the_packet_alone() {
        let e = Endpoints::v4();
        let forwarded = build_tuple(&e.dnat(Protocol::Tcp), b"");
        let mut pkt = icmp_error(e.backend.ip(), e.client.ip(), &forwarded);
        let before = pkt.clone();
        let parsed = icmp_err(&pkt);
        let to = e.original(Protocol::Tcp);
        let v6 = Endpoints::v6().client.ip();
        assert_eq!(
            rewrite_icmp_error(&mut pkt, &parsed, &to, Some(v6), e.client.ip()),
            Err(RewriteError::FamilyMismatch)
        );
        assert_eq!(
            rewrite_icmp_error(&mut pkt, &parsed, &to, None, v6),
            Err(RewriteError::FamilyMismatch)
        );
        let udp = e.original(Protocol::Udp);
        assert!(matches!(
            rewrite_icmp_error(&mut pkt, &parsed, &udp, None, e.client.ip()),
            Err(RewriteError::ProtocolMismatch { .. })
        ));
        assert!(matches!(
            rewrite_icmp_error(&mut pkt[..30], &parsed, &to, None, e.client.ip()),
            Err(RewriteError::BufferTooShort { .. })
        ));
        assert_eq!(pkt, before);
    }
}
