//! The IPv6 header (RFC 8200) and the extension headers kxp steps over.

use std::net::Ipv6Addr;

use super::ParseError;
use super::checksum::{Delta, get16};

/// Byte offsets of the IPv6 header fields kxp reads or writes.
mod field {
    pub const VERSION: usize = 0;
    pub const PAYLOAD_LEN: usize = 4;
    pub const NEXT_HEADER: usize = 6;
    pub const HOP_LIMIT: usize = 7;
    pub const SRC: usize = 8;
    pub const DST: usize = 24;
}

/// Length of the fixed header.
pub(super) const HEADER_LEN: usize = 40;

const HOP_BY_HOP: u8 = 0;
const ROUTING: u8 = 43;
const FRAGMENT: u8 = 44;
const DEST_OPTIONS: u8 = 60;
/// A longer chain is not something a Service client sends; stop walking, and count it.
const MAX_EXT_HEADERS: usize = 8;

/// What the rest of the parser needs from an IPv6 header and its extension headers.
#[derive(Debug, Clone, Copy)]
pub(super) struct Header {
    /// Fixed header plus the extension headers stepped over: where the upper layer starts.
    pub header_len: usize,
    /// Fixed header plus payload length.
    pub total_len: usize,
    /// The upper-layer protocol (or 44 when `fragment`).
    pub proto: u8,
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    /// A fragment header was found.
    pub fragment: bool,
    /// The fragment header's identification, offset (8-byte units) and M flag. For a
    /// packet (not a quote) `header_len` and `proto` are then those after it.
    pub frag: Option<super::ip::FragInfo>,
}

/// Checks and reads the IPv6 header at the start of `buf`, stepping over hop-by-hop,
/// routing and destination-options headers.
///
/// For a packet (`quoted == false`) the payload length must fit in `buf` and the
/// extension headers in the payload. For a header quoted in an ICMP error, the extension
/// headers must fit in the quote.
///
/// # Errors
/// `Truncated`, `BadVersion`, `BadLength` (a jumbogram's zero payload length included),
/// `BadExtensionHeader`.
pub(super) fn parse(buf: &[u8], quoted: bool) -> Result<Header, ParseError> {
    if buf.len() < HEADER_LEN {
        return Err(ParseError::Truncated);
    }
    let version = buf[field::VERSION] >> 4;
    if version != 6 {
        return Err(ParseError::BadVersion(version));
    }
    let payload_len = usize::from(get16(buf, field::PAYLOAD_LEN));
    if payload_len == 0 {
        return Err(ParseError::BadLength);
    }
    let total_len = HEADER_LEN + payload_len;
    let limit = if quoted {
        buf.len()
    } else if buf.len() < total_len {
        return Err(ParseError::Truncated);
    } else {
        total_len
    };

    let mut next = buf[field::NEXT_HEADER];
    let mut off = HEADER_LEN;
    let mut seen = 0;
    while matches!(next, HOP_BY_HOP | ROUTING | DEST_OPTIONS) {
        // Hop-by-hop options must come first (RFC 8200 section 4.1).
        if (next == HOP_BY_HOP && off != HEADER_LEN) || seen == MAX_EXT_HEADERS {
            return Err(ParseError::BadExtensionHeader);
        }
        if limit < off + 2 {
            return Err(ParseError::BadExtensionHeader);
        }
        let len = (usize::from(buf[off + 1]) + 1) * 8;
        if limit < off + len {
            return Err(ParseError::BadExtensionHeader);
        }
        next = buf[off];
        off += len;
        seen += 1;
    }
    let fragment = next == FRAGMENT;
    let mut frag = None;
    if fragment && !quoted {
        // The fragment header (RFC 8200 section 4.5): next header, reserved, offset and
        // M flag, identification. What follows it is the fragment's payload.
        if limit < off + 8 {
            return Err(ParseError::BadExtensionHeader);
        }
        let w = get16(buf, off + 2);
        frag = Some(super::ip::FragInfo {
            id: u32::from_be_bytes([buf[off + 4], buf[off + 5], buf[off + 6], buf[off + 7]]),
            offset: w >> 3,
            more: w & 1 != 0,
        });
        next = buf[off];
        off += 8;
        if matches!(next, HOP_BY_HOP | ROUTING | DEST_OPTIONS | FRAGMENT) {
            // Headers after the fragment header: not what a Service client sends.
            return Err(ParseError::BadExtensionHeader);
        }
    }
    Ok(Header {
        header_len: off,
        total_len,
        proto: next,
        src: addr(buf, field::SRC),
        dst: addr(buf, field::DST),
        fragment,
        frag,
    })
}

fn addr(buf: &[u8], off: usize) -> Ipv6Addr {
    let mut a = [0u8; 16];
    a.copy_from_slice(&buf[off..off + 16]);
    Ipv6Addr::from(a)
}

/// Writes the addresses that are `Some` into the header at the start of `hdr`; returns
/// the change (IPv6 has no header checksum; the pseudo-headers above it see this).
///
/// The caller has checked that `hdr` holds at least 40 bytes.
pub(super) fn set_addrs(hdr: &mut [u8], src: Option<Ipv6Addr>, dst: Option<Ipv6Addr>) -> Delta {
    let mut d = Delta::default();
    if let Some(src) = src {
        d.write(hdr, field::SRC, &src.octets());
    }
    if let Some(dst) = dst {
        d.write(hdr, field::DST, &dst.octets());
    }
    d
}

/// Decrements the hop limit; `false` (and no change) when it is already 0 or 1.
///
/// The caller has checked that `hdr` holds at least 40 bytes.
pub(super) fn decrement_hop_limit(hdr: &mut [u8]) -> bool {
    match hdr[field::HOP_LIMIT] {
        0 | 1 => false,
        h => {
            hdr[field::HOP_LIMIT] = h - 1;
            true
        }
    }
}

/// Writes a 40-byte header (traffic class and flow label 0) into `out[..40]`.
pub(super) fn write_header(
    out: &mut [u8],
    src: Ipv6Addr,
    dst: Ipv6Addr,
    next_header: u8,
    payload_len: usize,
    hop_limit: u8,
) {
    let hdr = &mut out[..HEADER_LEN];
    hdr.fill(0);
    hdr[field::VERSION] = 0x60;
    hdr[field::PAYLOAD_LEN..field::PAYLOAD_LEN + 2]
        .copy_from_slice(&(payload_len as u16).to_be_bytes());
    hdr[field::NEXT_HEADER] = next_header;
    hdr[field::HOP_LIMIT] = hop_limit;
    hdr[field::SRC..field::SRC + 16].copy_from_slice(&src.octets());
    hdr[field::DST..field::DST + 16].copy_from_slice(&dst.octets());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewrite::testutil::{Endpoints, build, insert_v6_ext};
    use crate::tuple::Protocol;

    fn tcp6() -> Vec<u8> {
        build(&Endpoints::v6(), Protocol::Tcp, b"payload")
    }

    #[test]
    fn parses_a_plain_header() {
        let pkt = tcp6();
        let h = parse(&pkt, false).unwrap();
        assert_eq!((h.header_len, h.total_len, h.proto), (40, pkt.len(), 6));
        assert_eq!(h.dst, Endpoints::v6().vip.ip());
        assert!(!h.fragment);
    }

    #[test]
    fn steps_over_extension_headers() {
        let pkt = insert_v6_ext(&tcp6(), &[HOP_BY_HOP, ROUTING, DEST_OPTIONS]);
        let h = parse(&pkt, false).unwrap();
        assert_eq!(
            (h.header_len, h.proto, h.total_len),
            (40 + 24, 6, pkt.len())
        );
    }

    #[test]
    fn rejects_misplaced_hop_by_hop_and_long_chains() {
        let pkt = insert_v6_ext(&tcp6(), &[DEST_OPTIONS, HOP_BY_HOP]);
        assert_eq!(
            parse(&pkt, false).unwrap_err(),
            ParseError::BadExtensionHeader
        );
        let pkt = insert_v6_ext(&tcp6(), &[DEST_OPTIONS; MAX_EXT_HEADERS + 1]);
        assert_eq!(
            parse(&pkt, false).unwrap_err(),
            ParseError::BadExtensionHeader
        );
        let pkt = insert_v6_ext(&tcp6(), &[DEST_OPTIONS; MAX_EXT_HEADERS]);
        assert!(parse(&pkt, false).is_ok());
    }

    #[test]
    fn extension_header_past_the_payload_is_malformed() {
        let mut pkt = insert_v6_ext(&tcp6(), &[DEST_OPTIONS]);
        pkt[41] = 200; // claims 1608 bytes
        assert_eq!(
            parse(&pkt, false).unwrap_err(),
            ParseError::BadExtensionHeader
        );
    }

    #[test]
    fn finds_fragment_header() {
        let pkt = insert_v6_ext(&tcp6(), &[HOP_BY_HOP, FRAGMENT]);
        let h = parse(&pkt, false).unwrap();
        assert!(h.fragment);
    }

    #[test]
    fn rejects_bad_version_and_lengths() {
        let pkt = tcp6();
        let mut p = pkt.clone();
        p[0] = 0x40;
        assert_eq!(parse(&p, false).unwrap_err(), ParseError::BadVersion(4));
        let mut p = pkt.clone();
        p[4] = 0;
        p[5] = 0;
        assert_eq!(parse(&p, false).unwrap_err(), ParseError::BadLength);
        assert_eq!(
            parse(&pkt[..pkt.len() - 1], false).unwrap_err(),
            ParseError::Truncated
        );
        assert!(parse(&pkt[..48], true).is_ok());
    }

    #[test]
    fn hop_limit() {
        let mut p = tcp6();
        p[7] = 2;
        assert!(decrement_hop_limit(&mut p));
        assert_eq!(p[7], 1);
        assert!(!decrement_hop_limit(&mut p));
        assert_eq!(p[7], 1);
    }
}
