//! The IPv4 header (RFC 791): checked parsing, address rewrite, TTL.

use std::net::Ipv4Addr;

use super::ParseError;
use super::checksum::{Delta, finish, get16, sum, sum_fast};

/// Byte offsets of the IPv4 header fields kxp reads or writes.
mod field {
    pub const VER_IHL: usize = 0;
    pub const TOTAL_LEN: usize = 2;
    pub const ID: usize = 4;
    pub const FLAGS_FRAG: usize = 6;
    pub const TTL: usize = 8;
    pub const PROTO: usize = 9;
    pub const CHECKSUM: usize = 10;
    pub const SRC: usize = 12;
    pub const DST: usize = 16;
}

/// Length of a header without options.
pub(super) const MIN_HEADER_LEN: usize = 20;
/// More-fragments flag and fragment offset, in the flags/offset word.
const MF_OR_OFFSET: u16 = 0x3FFF;

/// What the rest of the parser needs from an IPv4 header.
#[derive(Debug, Clone, Copy)]
pub(super) struct Header {
    pub header_len: usize,
    pub total_len: usize,
    pub proto: u8,
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    /// More-fragments set or a nonzero fragment offset.
    pub fragment: bool,
    /// Identification, fragment offset (8-byte units) and more-fragments, when `fragment`.
    pub frag: Option<super::ip::FragInfo>,
}

/// Checks and reads the IPv4 header at the start of `buf`.
///
/// For a packet (`quoted == false`) the total length must fit in `buf`. For a header quoted
/// in an ICMP error the quote is cut short by design, so only the header itself must be
/// there; `total_len` is then the length of the packet the header came from.
///
/// # Errors
/// `Truncated`, `BadVersion`, `BadIhl`, `BadLength`, `BadChecksum`.
pub(super) fn parse(buf: &[u8], quoted: bool) -> Result<Header, ParseError> {
    if buf.len() < MIN_HEADER_LEN {
        return Err(ParseError::Truncated);
    }
    let version = buf[field::VER_IHL] >> 4;
    if version != 4 {
        return Err(ParseError::BadVersion(version));
    }
    let ihl = buf[field::VER_IHL] & 0x0F;
    if ihl < 5 {
        return Err(ParseError::BadIhl(ihl));
    }
    let header_len = usize::from(ihl) * 4;
    if buf.len() < header_len {
        return Err(ParseError::Truncated);
    }
    let total_len = usize::from(get16(buf, field::TOTAL_LEN));
    if total_len < header_len {
        return Err(ParseError::BadLength);
    }
    if !quoted && buf.len() < total_len {
        return Err(ParseError::Truncated);
    }
    // As the kernel's `ip_rcv_core`: a header whose checksum does not verify is dropped
    // (a quoted header is not checked: routers quote what they received).
    if !quoted && !checksum_verifies(&buf[..header_len]) {
        return Err(ParseError::BadChecksum);
    }
    Ok(Header {
        header_len,
        total_len,
        proto: buf[field::PROTO],
        src: addr(buf, field::SRC),
        dst: addr(buf, field::DST),
        fragment: get16(buf, field::FLAGS_FRAG) & MF_OR_OFFSET != 0,
        frag: (get16(buf, field::FLAGS_FRAG) & MF_OR_OFFSET != 0).then(|| {
            let w = get16(buf, field::FLAGS_FRAG);
            super::ip::FragInfo {
                id: u32::from(get16(buf, field::ID)),
                offset: w & 0x1FFF,
                more: w & 0x2000 != 0,
            }
        }),
    })
}

/// Whether the header `hdr` (20 bytes or more, a multiple of 4) sums to 0xFFFF: its
/// 32-bit words summed are congruent to its 16-bit words' sum modulo 0xFFFF (2^16 ≡ 1),
/// and a nonzero sum (the version nibble is 4) folds to 0xFFFF exactly when it is a
/// multiple of 0xFFFF. Five loads and adds for a header without options.
#[inline]
fn checksum_verifies(hdr: &[u8]) -> bool {
    let word = |i: usize| {
        u64::from(u32::from_be_bytes([
            hdr[i],
            hdr[i + 1],
            hdr[i + 2],
            hdr[i + 3],
        ]))
    };
    let mut s = word(0) + word(4) + word(8) + word(12) + word(16);
    if hdr.len() > MIN_HEADER_LEN {
        s += sum_fast(&hdr[MIN_HEADER_LEN..]);
    }
    s % 0xFFFF == 0
}

fn addr(buf: &[u8], off: usize) -> Ipv4Addr {
    Ipv4Addr::new(buf[off], buf[off + 1], buf[off + 2], buf[off + 3])
}

/// The change made by an address rewrite, for the checksums that cover it.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Change {
    /// The address words: what a TCP/UDP/ICMPv6 pseudo-header sees.
    pub pseudo: Delta,
    /// Every word written, header checksum included: what an enclosing checksum (the
    /// ICMP checksum over a quoted header) sees.
    pub bytes: Delta,
}

/// Writes the addresses that are `Some` into the header at the start of `hdr` and patches
/// its header checksum incrementally.
///
/// The caller has checked that `hdr` holds a parsed header (at least 20 bytes).
pub(super) fn set_addrs(hdr: &mut [u8], src: Option<Ipv4Addr>, dst: Option<Ipv4Addr>) -> Change {
    let mut pseudo = Delta::default();
    if let Some(src) = src {
        pseudo.write(hdr, field::SRC, &src.octets());
    }
    if let Some(dst) = dst {
        pseudo.write(hdr, field::DST, &dst.octets());
    }
    let mut bytes = pseudo;
    pseudo.patch(hdr, field::CHECKSUM, &mut bytes);
    Change { pseudo, bytes }
}

/// Decrements the TTL of the header at the start of `hdr` and patches the checksum;
/// `false` (and no change) when the TTL is already 0 or 1.
///
/// The caller has checked that `hdr` holds at least 20 bytes.
pub(super) fn decrement_ttl(hdr: &mut [u8]) -> bool {
    let ttl = hdr[field::TTL];
    if ttl <= 1 {
        return false;
    }
    let mut d = Delta::default();
    let word = u16::from_be_bytes([ttl - 1, hdr[field::PROTO]]);
    d.write16(hdr, field::TTL, word);
    d.patch(hdr, field::CHECKSUM, &mut Delta::default());
    true
}

/// Writes a 20-byte header (no options, DF set, identification 0 as RFC 6864 allows for
/// atomic datagrams) with its checksum into `out[..20]`.
pub(super) fn write_header(
    out: &mut [u8],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    payload_len: usize,
    ttl: u8,
) {
    let total = (MIN_HEADER_LEN + payload_len) as u16;
    let hdr = &mut out[..MIN_HEADER_LEN];
    hdr.fill(0);
    hdr[field::VER_IHL] = 0x45;
    hdr[field::TOTAL_LEN..field::TOTAL_LEN + 2].copy_from_slice(&total.to_be_bytes());
    hdr[field::FLAGS_FRAG] = 0x40;
    hdr[field::TTL] = ttl;
    hdr[field::PROTO] = proto;
    hdr[field::SRC..field::SRC + 4].copy_from_slice(&src.octets());
    hdr[field::DST..field::DST + 4].copy_from_slice(&dst.octets());
    let c = finish(sum(hdr));
    hdr[field::CHECKSUM..field::CHECKSUM + 2].copy_from_slice(&c.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewrite::testutil::{Endpoints, build, fix_ipv4_checksum, verify_checksums};
    use crate::tuple::Protocol;

    fn udp4() -> Vec<u8> {
        build(&Endpoints::v4(), Protocol::Udp, b"hello")
    }

    #[test]
    fn parses_a_plain_header() {
        let pkt = udp4();
        let h = parse(&pkt, false).unwrap();
        assert_eq!(h.header_len, 20);
        assert_eq!(h.total_len, pkt.len());
        assert_eq!(h.proto, 17);
        assert_eq!(h.src, Endpoints::v4().client.ip());
        assert!(!h.fragment);
    }

    #[test]
    fn rejects_bad_version_ihl_and_lengths() {
        let pkt = udp4();
        let mut p = pkt.clone();
        p[0] = 0x55;
        assert_eq!(parse(&p, false).unwrap_err(), ParseError::BadVersion(5));
        let mut p = pkt.clone();
        p[0] = 0x44;
        assert_eq!(parse(&p, false).unwrap_err(), ParseError::BadIhl(4));
        let mut p = pkt.clone();
        p[0] = 0x4F; // 60-byte header in a 33-byte packet
        assert_eq!(parse(&p, false).unwrap_err(), ParseError::Truncated);
        let mut p = pkt.clone();
        p[2..4].copy_from_slice(&19u16.to_be_bytes());
        assert_eq!(parse(&p, false).unwrap_err(), ParseError::BadLength);
        let mut p = pkt.clone();
        p[2..4].copy_from_slice(&((pkt.len() + 1) as u16).to_be_bytes());
        assert_eq!(parse(&p, false).unwrap_err(), ParseError::Truncated);
        // ... but a quoted header may claim more than the quote holds.
        assert!(parse(&p, true).is_ok());
    }

    #[test]
    fn a_header_checksum_that_does_not_verify_is_refused_except_in_a_quote() {
        let pkt = udp4();
        for at in [10, 11, 8, 15] {
            let mut p = pkt.clone();
            p[at] ^= 0x40;
            assert_eq!(
                parse(&p, false).unwrap_err(),
                ParseError::BadChecksum,
                "{at}"
            );
            assert!(parse(&p, true).is_ok(), "quoted: {at}");
            fix_ipv4_checksum(&mut p);
            assert!(parse(&p, false).is_ok(), "fixed: {at}");
        }
        // A header with options is covered whole.
        let mut p = pkt[..20].to_vec();
        p.extend_from_slice(&[1, 1, 1, 0]);
        p.extend_from_slice(&pkt[20..]);
        p[0] = 0x46;
        let len = p.len() as u16;
        p[2..4].copy_from_slice(&len.to_be_bytes());
        fix_ipv4_checksum(&mut p);
        assert!(parse(&p, false).is_ok());
        p[22] = 7;
        assert_eq!(parse(&p, false).unwrap_err(), ParseError::BadChecksum);
    }

    #[test]
    fn flags_fragments() {
        let pkt = udp4();
        for (hi, lo) in [(0x20, 0x00), (0x00, 0x01), (0x1F, 0xFF), (0x60, 0x00)] {
            let mut p = pkt.clone();
            p[6] = hi;
            p[7] = lo;
            fix_ipv4_checksum(&mut p);
            assert!(parse(&p, false).unwrap().fragment, "{hi:#x} {lo:#x}");
        }
        let mut p = pkt.clone();
        p[6] = 0x40; // DF alone is not a fragment
        p[7] = 0;
        fix_ipv4_checksum(&mut p);
        assert!(!parse(&p, false).unwrap().fragment);
    }

    #[test]
    fn ttl_decrement_fixes_the_checksum() {
        let mut p = udp4();
        p[8] = 2;
        fix_ipv4_checksum(&mut p);
        assert!(decrement_ttl(&mut p));
        assert_eq!(p[8], 1);
        verify_checksums(&p);
        let before = p.clone();
        assert!(!decrement_ttl(&mut p));
        assert_eq!(p, before);
        p[8] = 0;
        assert!(!decrement_ttl(&mut p));
    }

    #[test]
    fn written_header_is_accepted_by_etherparse() {
        let mut out = [0xA5u8; 28];
        write_header(
            &mut out,
            Ipv4Addr::new(198, 18, 0, 1),
            Ipv4Addr::new(198, 19, 0, 2),
            17,
            8,
            64,
        );
        let h = etherparse::Ipv4HeaderSlice::from_slice(&out)
            .unwrap()
            .to_header();
        assert_eq!(h.header_checksum, h.calc_header_checksum());
        assert_eq!(h.total_len, 28);
        assert!(h.dont_fragment);
        assert_eq!(out[20..], [0xA5; 8], "only the header is written");
    }
}
