//! Checked parsing of an untrusted packet into what the NAT needs: the flow's tuple and
//! the offsets the rewrite patches.
//!
//! Every length is checked once, here; the rewrite then indexes only inside the offsets a
//! [`Parsed`] records, all of which lie within its [`FlowPacket::ip_len`].

use std::net::IpAddr;

use super::{ipv4, ipv6, l4};
use crate::tuple::{Protocol, Tuple};

/// Why a packet could not be parsed. The dataplane drops it and counts it under
/// [`ParseError::reason`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum ParseError {
    /// The buffer ends before the headers, or the length they declare.
    #[error("packet truncated: the buffer ends before the length its headers declare")]
    Truncated,
    /// The IP version nibble is neither 4 nor 6.
    #[error("IP version {0} is neither 4 nor 6")]
    BadVersion(u8),
    /// The IPv4 header length is below the minimum of 5 words.
    #[error("IPv4 header length of {0} words is below the minimum of 5")]
    BadIhl(u8),
    /// An IP length field is impossible (IPv4 total length below the header length, or an
    /// IPv6 jumbogram's zero payload length).
    #[error("IP length field is impossible (shorter than the header, or a jumbogram)")]
    BadLength,
    /// A fragment kxp does not translate: of ICMP or SCTP, or a first fragment too
    /// short to hold its transport header's ports and checksum.
    #[error(
        "fragment of a protocol kxp does not translate in fragments, or too short a first fragment"
    )]
    Fragment,
    /// The transport protocol is not TCP, UDP, SCTP or the family's ICMP.
    #[error("IP protocol {0} is not TCP, UDP, SCTP or ICMP")]
    UnsupportedProtocol(u8),
    /// IPv6 extension headers are out of order, run past the payload, or are too many.
    #[error("IPv6 extension headers are misordered, too many, or run past the payload")]
    BadExtensionHeader,
    /// The transport header does not fit in the IP payload, or its own length field (TCP
    /// data offset, UDP length) is impossible.
    #[error("transport header is shorter than its minimum or its length field is impossible")]
    BadL4Header,
    /// An ICMP error quotes something that is not an IP header of the same family
    /// followed by 8 bytes of transport header.
    #[error("ICMP error quotes a malformed packet")]
    BadIcmpQuote,
    /// The IPv4 header checksum does not verify.
    #[error("IPv4 header checksum does not verify")]
    BadChecksum,
}

impl ParseError {
    /// A stable label, for a drop counter (`reason="truncated"`).
    pub const fn reason(&self) -> &'static str {
        match self {
            ParseError::Truncated => "truncated",
            ParseError::BadVersion(_) => "bad_version",
            ParseError::BadIhl(_) => "bad_ihl",
            ParseError::BadLength => "bad_length",
            ParseError::Fragment => "fragment",
            ParseError::UnsupportedProtocol(_) => "unsupported_protocol",
            ParseError::BadExtensionHeader => "bad_extension_header",
            ParseError::BadL4Header => "bad_l4_header",
            ParseError::BadIcmpQuote => "bad_icmp_quote",
            ParseError::BadChecksum => "bad_checksum",
        }
    }
}

/// A well-formed packet, sorted by what the NAT does with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// A TCP, UDP or SCTP packet: look its tuple up, then [`super::rewrite`] it.
    Flow(FlowPacket),
    /// An ICMP error quoting a TCP, UDP or SCTP packet: look the quoted tuple up, then
    /// [`super::rewrite_icmp_error`] it.
    IcmpError(IcmpErrorPacket),
    /// Well-formed but outside what Services carry (ICMP echo and other informational
    /// ICMP, or an ICMP error quoting such a packet or a fragment): not translated.
    NotTranslatable(Untranslatable),
    /// A TCP or UDP fragment other than the first: no ports, only addresses to rewrite,
    /// as the first fragment of its datagram ([`FlowPacket::fragment`]) was.
    Fragment(FragmentPacket),
}

pub use super::ip::FragInfo;

/// What identifies the fragments of one datagram (RFC 791: source, destination,
/// protocol, identification; RFC 8200 the same with its 32-bit identification).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    pub id: u32,
}

/// A fragment after the first of a TCP or UDP datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FragmentPacket {
    pub(super) key: FragKey,
    pub(super) frag: FragInfo,
    pub(super) ip_len: usize,
}

impl FragmentPacket {
    /// The datagram it belongs to.
    pub fn key(&self) -> FragKey {
        self.key
    }
    pub fn info(&self) -> FragInfo {
        self.frag
    }
    pub fn ip_len(&self) -> usize {
        self.ip_len
    }
}

impl Parsed {
    /// The outer source address.
    pub fn src(&self) -> IpAddr {
        match self {
            Parsed::Flow(f) => f.tuple.src,
            Parsed::IcmpError(e) => e.src,
            Parsed::NotTranslatable(u) => u.src,
            Parsed::Fragment(f) => f.key.src,
        }
    }

    /// The outer destination address.
    pub fn dst(&self) -> IpAddr {
        match self {
            Parsed::Flow(f) => f.tuple.dst,
            Parsed::IcmpError(e) => e.dst,
            Parsed::NotTranslatable(u) => u.dst,
            Parsed::Fragment(f) => f.key.dst,
        }
    }
}

/// A TCP, UDP or SCTP packet. Offsets count from the start of the buffer (the IP header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowPacket {
    pub(super) tuple: Tuple,
    pub(super) tcp_flags: u8,
    pub(super) l4_offset: usize,
    pub(super) payload_offset: usize,
    pub(super) payload_len: usize,
    pub(super) ip_len: usize,
    /// The first fragment of a datagram: its fragment identification.
    pub(super) frag: Option<FragInfo>,
}

impl FlowPacket {
    /// For the first fragment of a fragmented datagram, what identifies the datagram's
    /// other fragments (which carry no ports and follow this one's translation).
    pub fn fragment(&self) -> Option<FragKey> {
        self.frag.map(|f| FragKey {
            src: self.tuple.src,
            dst: self.tuple.dst,
            proto: self.tuple.proto.number(),
            id: f.id,
        })
    }
    /// The packet's tuple, as it arrived.
    pub fn tuple(&self) -> Tuple {
        self.tuple
    }
    /// The TCP flags byte (see [`super::tcp_flags`]); 0 for UDP and SCTP.
    pub fn tcp_flags(&self) -> u8 {
        self.tcp_flags
    }
    /// Where the IP header starts: always 0, buffers start there.
    pub fn l3_offset(&self) -> usize {
        0
    }
    /// Where the transport header starts (after IPv4 options / IPv6 extension headers).
    pub fn l4_offset(&self) -> usize {
        self.l4_offset
    }
    /// Where the transport payload starts (TCP options, UDP and SCTP common headers
    /// skipped; SCTP chunks are its payload).
    pub fn payload_offset(&self) -> usize {
        self.payload_offset
    }
    /// Transport payload length (UDP: from the UDP length field).
    pub fn payload_len(&self) -> usize {
        self.payload_len
    }
    /// Length of the IP packet; bytes past it in the buffer (link padding) are not read or
    /// written.
    pub fn ip_len(&self) -> usize {
        self.ip_len
    }
}

/// An ICMPv4 (types 3, 11, 12) or ICMPv6 (types 1 to 4) error quoting a TCP, UDP or SCTP
/// packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcmpErrorPacket {
    pub(super) src: IpAddr,
    pub(super) dst: IpAddr,
    pub(super) icmp_type: u8,
    pub(super) icmp_code: u8,
    pub(super) inner: Tuple,
    pub(super) l4_offset: usize,
    pub(super) inner_l4_offset: usize,
    pub(super) ip_len: usize,
    /// The quoted SCTP packet's original length (from the quoted IP header), to update
    /// its quoted CRC32c.
    pub(super) inner_sctp_len: Option<usize>,
}

impl IcmpErrorPacket {
    /// Outer source: whoever sent the error (an endpoint or a router on the path).
    pub fn src(&self) -> IpAddr {
        self.src
    }
    /// Outer destination: whoever sent the quoted packet.
    pub fn dst(&self) -> IpAddr {
        self.dst
    }
    pub fn icmp_type(&self) -> u8 {
        self.icmp_type
    }
    pub fn icmp_code(&self) -> u8 {
        self.icmp_code
    }
    /// The quoted packet's tuple: a packet that went *to* the error's sender, so its
    /// reverse is the direction this error travels.
    pub fn inner(&self) -> Tuple {
        self.inner
    }
    /// Where the ICMP header starts.
    pub fn l4_offset(&self) -> usize {
        self.l4_offset
    }
    /// Where the quoted IP header starts (ICMP header + 8).
    pub fn inner_l3_offset(&self) -> usize {
        self.l4_offset + icmp::HEADER_LEN
    }
    /// Where the quoted transport header starts.
    pub fn inner_l4_offset(&self) -> usize {
        self.inner_l4_offset
    }
    /// Length of the quote (the ICMP payload).
    pub fn payload_len(&self) -> usize {
        self.ip_len - self.inner_l3_offset()
    }
    /// Length of the IP packet.
    pub fn ip_len(&self) -> usize {
        self.ip_len
    }
}

/// A well-formed ICMP message kxp does not translate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Untranslatable {
    pub(super) src: IpAddr,
    pub(super) dst: IpAddr,
    pub(super) icmp_type: u8,
    pub(super) icmp_code: u8,
}

impl Untranslatable {
    pub fn src(&self) -> IpAddr {
        self.src
    }
    pub fn dst(&self) -> IpAddr {
        self.dst
    }
    /// IP protocol: 1 (ICMPv4) or 58 (ICMPv6).
    pub fn protocol(&self) -> u8 {
        if self.src.is_ipv6() {
            icmp::ICMPV6
        } else {
            icmp::ICMPV4
        }
    }
    pub fn icmp_type(&self) -> u8 {
        self.icmp_type
    }
    pub fn icmp_code(&self) -> u8 {
        self.icmp_code
    }
    /// An echo request or reply (ping), as opposed to other ICMP.
    pub fn is_echo(&self) -> bool {
        match self.src {
            IpAddr::V4(_) => matches!(self.icmp_type, 0 | 8),
            IpAddr::V6(_) => matches!(self.icmp_type, 128 | 129),
        }
    }
}

/// A cheap first look: whether the IP packet in `buf` may be a fragment (IPv4 with
/// more-fragments or an offset; IPv6 with a fragment header or extension headers before
/// the upper layer), so that only those need [`parse`] to tell.
pub fn may_be_fragment(buf: &[u8]) -> bool {
    match buf.first().map(|b| b >> 4) {
        Some(4) => buf.len() >= 8 && u16::from_be_bytes([buf[6], buf[7]]) & 0x3FFF != 0,
        Some(6) => buf.len() >= 40 && matches!(buf[6], 0 | 43 | 44 | 60),
        _ => false,
    }
}

/// Parses the packet at the start of `buf` (no link header).
///
/// Bytes past the IP length (link padding) are ignored.
///
/// # Errors
/// One [`ParseError`] per reason a packet is dropped; never panics, whatever `buf` holds.
pub fn parse(buf: &[u8]) -> Result<Parsed, ParseError> {
    let ip = ip_header(buf, false)?;
    let (l4_offset, ip_len) = (ip.header_len, ip.total_len);
    let icmp_number = if ip.src.is_ipv6() {
        icmp::ICMPV6
    } else {
        icmp::ICMPV4
    };
    // The first fragment of a fragmented datagram (the others carry no ports).
    let mut first = None;
    if let Some(frag) = ip.frag {
        match Protocol::from_number(ip.proto) {
            Some(Protocol::Tcp | Protocol::Udp) => {}
            // SCTP's CRC covers the whole datagram and cannot be patched from one
            // fragment; ICMP is never a Service's.
            Some(Protocol::Sctp) => return Err(ParseError::Fragment),
            None if ip.proto == icmp_number => return Err(ParseError::Fragment),
            None => return Err(ParseError::UnsupportedProtocol(ip.proto)),
        }
        if frag.offset != 0 {
            return Ok(Parsed::Fragment(FragmentPacket {
                key: FragKey {
                    src: ip.src,
                    dst: ip.dst,
                    proto: ip.proto,
                    id: frag.id,
                },
                frag,
                ip_len,
            }));
        }
        // Offset 0 and no more fragments: a whole datagram (an IPv6 atomic fragment).
        first = frag.more.then_some(frag);
    }
    if ip.proto == icmp_number {
        return icmp::parse(&buf[..ip_len], &ip);
    }
    let proto = Protocol::from_number(ip.proto).ok_or(ParseError::UnsupportedProtocol(ip.proto))?;
    let seg = match first {
        Some(_) => l4::parse_first_fragment(&buf[l4_offset..ip_len], proto)?,
        None => l4::parse(&buf[l4_offset..ip_len], proto)?,
    };
    Ok(Parsed::Flow(FlowPacket {
        tuple: Tuple {
            src: ip.src,
            dst: ip.dst,
            sport: seg.sport,
            dport: seg.dport,
            proto,
        },
        tcp_flags: seg.tcp_flags,
        l4_offset,
        payload_offset: l4_offset + seg.header_len,
        payload_len: seg.payload_len,
        ip_len,
        frag: first,
    }))
}

/// An IPv4 or IPv6 header, as the rest of the parser sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct IpHeader {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    /// Where the upper layer starts.
    pub header_len: usize,
    pub total_len: usize,
    pub fragment: bool,
    pub frag: Option<FragInfo>,
}

/// Parses the IPv4 or IPv6 header at the start of `buf` (see `ipv4::parse` for `quoted`).
pub(super) fn ip_header(buf: &[u8], quoted: bool) -> Result<IpHeader, ParseError> {
    match buf.first().map(|b| b >> 4) {
        None => Err(ParseError::Truncated),
        Some(4) => ipv4::parse(buf, quoted).map(|h| IpHeader {
            src: h.src.into(),
            dst: h.dst.into(),
            proto: h.proto,
            header_len: h.header_len,
            total_len: h.total_len,
            fragment: h.fragment,
            frag: h.frag,
        }),
        Some(6) => ipv6::parse(buf, quoted).map(|h| IpHeader {
            src: h.src.into(),
            dst: h.dst.into(),
            proto: h.proto,
            header_len: h.header_len,
            total_len: h.total_len,
            fragment: h.fragment,
            frag: h.frag,
        }),
        Some(v) => Err(ParseError::BadVersion(v)),
    }
}

/// The ICMP header and the sorting of ICMP messages (the errors are what kxp translates;
/// see `icmp` for their rewrite).
pub(super) mod icmp {
    use super::super::{ParseError, l4};
    use super::{IcmpErrorPacket, IpHeader, Parsed, Untranslatable, ip_header};
    use crate::tuple::{Protocol, Tuple};

    /// Byte offsets of the ICMP header fields kxp reads or writes (same in v4 and v6).
    pub(in super::super) mod field {
        pub const TYPE: usize = 0;
        pub const CODE: usize = 1;
        pub const CHECKSUM: usize = 2;
    }

    /// ICMP header length (type, code, checksum, 4 type-specific bytes), both versions.
    pub(in super::super) const HEADER_LEN: usize = 8;
    pub(in super::super) const ICMPV4: u8 = 1;
    pub(in super::super) const ICMPV6: u8 = 58;

    /// Sorts the ICMP message of the packet `buf` (cut at its IP length) whose IP header is
    /// `ip`.
    pub(in super::super) fn parse(buf: &[u8], ip: &IpHeader) -> Result<Parsed, ParseError> {
        let msg = &buf[ip.header_len..];
        if msg.len() < HEADER_LEN {
            return Err(ParseError::BadL4Header);
        }
        let (icmp_type, icmp_code) = (msg[field::TYPE], msg[field::CODE]);
        let v6 = ip.src.is_ipv6();
        let untranslatable = Parsed::NotTranslatable(Untranslatable {
            src: ip.src,
            dst: ip.dst,
            icmp_type,
            icmp_code,
        });
        let is_error = if v6 {
            matches!(icmp_type, 1..=4)
        } else {
            matches!(icmp_type, 3 | 11 | 12)
        };
        if !is_error {
            return Ok(untranslatable);
        }

        let quote = &msg[HEADER_LEN..];
        let inner = match ip_header(quote, true) {
            Ok(inner) if inner.src.is_ipv6() == v6 => inner,
            _ => return Err(ParseError::BadIcmpQuote),
        };
        // kxp never forwards fragments, so an error about one is not about a translated flow.
        let Some(proto) = Protocol::from_number(inner.proto).filter(|_| !inner.fragment) else {
            return Ok(untranslatable);
        };
        let inner_l4 = &quote[inner.header_len..];
        if inner_l4.len() < l4::QUOTED_LEN {
            return Err(ParseError::BadIcmpQuote);
        }
        let (sport, dport) = l4::quoted_ports(inner_l4);
        let inner_sctp_len = (proto == Protocol::Sctp)
            .then(|| inner.total_len.checked_sub(inner.header_len))
            .flatten()
            .filter(|&len| len >= l4::SCTP_HEADER_LEN);
        Ok(Parsed::IcmpError(IcmpErrorPacket {
            src: ip.src,
            dst: ip.dst,
            icmp_type,
            icmp_code,
            inner: Tuple {
                src: inner.src,
                dst: inner.dst,
                sport,
                dport,
                proto,
            },
            l4_offset: ip.header_len,
            inner_l4_offset: ip.header_len + HEADER_LEN + inner.header_len,
            ip_len: buf.len(),
            inner_sctp_len,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewrite::testutil::{Endpoints, build, fix_ipv4_checksum, insert_v6_ext};

    fn flow(pkt: &[u8]) -> FlowPacket {
        match parse(pkt).unwrap() {
            Parsed::Flow(f) => f,
            other => panic!("not a flow: {other:?}"),
        }
    }

    #[test]
    fn flows_in_both_families_and_all_protocols() {
        for e in [Endpoints::v4(), Endpoints::v6()] {
            for proto in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
                let pkt = build(&e, proto, b"0123456789");
                let f = flow(&pkt);
                assert_eq!(f.tuple(), e.original(proto));
                assert_eq!(f.ip_len(), pkt.len());
                assert_eq!(f.l3_offset(), 0);
                let l3 = if e.client.is_ipv4() { 20 } else { 40 };
                assert_eq!(f.l4_offset(), l3);
                let (hdr, payload) = match proto {
                    Protocol::Tcp => (20, 10),
                    Protocol::Udp => (8, 10),
                    // the DATA chunk (16 + 10, padded to 28) is SCTP's payload
                    Protocol::Sctp => (12, 28),
                };
                assert_eq!(f.payload_offset(), l3 + hdr, "{proto}");
                assert_eq!(f.payload_len(), payload, "{proto}");
                let flags = if proto == Protocol::Tcp {
                    l4::tcp_flags::SYN
                } else {
                    0
                };
                assert_eq!(f.tcp_flags(), flags);
            }
        }
    }

    #[test]
    fn link_padding_is_ignored() {
        let mut pkt = build(&Endpoints::v4(), Protocol::Udp, b"");
        let len = pkt.len();
        pkt.extend_from_slice(&[0; 18]); // Ethernet minimum-frame padding
        assert_eq!(flow(&pkt).ip_len(), len);
    }

    #[test]
    fn ipv6_extension_headers_are_skipped() {
        let pkt = build(&Endpoints::v6(), Protocol::Udp, b"x");
        let pkt = insert_v6_ext(&pkt, &[0, 43, 60]);
        let f = flow(&pkt);
        assert_eq!(f.l4_offset(), 64);
        assert_eq!(f.tuple(), Endpoints::v6().original(Protocol::Udp));
    }

    #[test]
    fn fragments_are_first_fragments_or_address_only_fragments() {
        let pkt = build(&Endpoints::v4(), Protocol::Udp, b"x");
        // More-fragments at offset 0: the first fragment, ports and all.
        let mut p = pkt.clone();
        p[4..6].copy_from_slice(&0x0102u16.to_be_bytes());
        p[6] = 0x20;
        fix_ipv4_checksum(&mut p);
        let f = flow(&p);
        assert_eq!(f.tuple(), Endpoints::v4().original(Protocol::Udp));
        let key = f.fragment().unwrap();
        assert_eq!((key.id, key.proto), (0x0102, 17));
        // A later fragment: only addresses, protocol and identification.
        let mut p = pkt.clone();
        p[4..6].copy_from_slice(&0x0102u16.to_be_bytes());
        p[7] = 0x10;
        fix_ipv4_checksum(&mut p);
        match parse(&p) {
            Ok(Parsed::Fragment(g)) => {
                assert_eq!(g.key(), key);
                assert_eq!(g.info().offset, 0x10);
            }
            other => panic!("{other:?}"),
        }
        // An unfragmented packet is no fragment.
        assert_eq!(flow(&pkt).fragment(), None);
        // IPv6: a fragment header at offset 0 with M set is a first fragment.
        let pkt = build(&Endpoints::v6(), Protocol::Udp, b"x");
        let mut p = insert_v6_ext(&pkt, &[44]);
        p[42..44].copy_from_slice(&1u16.to_be_bytes()); // offset 0, M
        assert!(flow(&p).fragment().is_some());
        p[42..44].copy_from_slice(&(3u16 << 3).to_be_bytes()); // offset 3, last
        assert!(matches!(parse(&p), Ok(Parsed::Fragment(_))));
        // Offset 0 without M (an atomic fragment) is a whole datagram.
        p[42..44].fill(0);
        assert!(flow(&p).fragment().is_none());
    }

    #[test]
    fn unsupported_protocols_and_versions() {
        let mut p = build(&Endpoints::v4(), Protocol::Udp, b"x");
        p[9] = 47; // GRE
        fix_ipv4_checksum(&mut p);
        assert_eq!(parse(&p), Err(ParseError::UnsupportedProtocol(47)));
        p[9] = 58; // ICMPv6 inside IPv4
        fix_ipv4_checksum(&mut p);
        assert_eq!(parse(&p), Err(ParseError::UnsupportedProtocol(58)));
        let mut p = build(&Endpoints::v6(), Protocol::Udp, b"x");
        p[6] = 1; // ICMPv4 inside IPv6
        assert_eq!(parse(&p), Err(ParseError::UnsupportedProtocol(1)));
        p[0] = 0x70;
        assert_eq!(parse(&p), Err(ParseError::BadVersion(7)));
        assert_eq!(parse(&[]), Err(ParseError::Truncated));
    }

    #[test]
    fn reasons_are_distinct() {
        let all = [
            ParseError::Truncated,
            ParseError::BadVersion(0),
            ParseError::BadIhl(0),
            ParseError::BadLength,
            ParseError::Fragment,
            ParseError::UnsupportedProtocol(0),
            ParseError::BadExtensionHeader,
            ParseError::BadL4Header,
            ParseError::BadIcmpQuote,
        ];
        let reasons: std::collections::HashSet<_> = all.iter().map(|e| e.reason()).collect();
        assert_eq!(reasons.len(), all.len());
    }
}
