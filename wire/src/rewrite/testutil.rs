//! Test helpers: real packets built with etherparse (SCTP by hand, etherparse has none),
//! checksum verification by full recomputation, and a deterministic PRNG.

use std::net::{IpAddr, SocketAddr};

use etherparse::{
    IpHeaders, IpNumber, Ipv4Header, Ipv6Header, NetSlice, PacketBuilder, PacketBuilderStep,
    SlicedPacket, TcpHeader, TransportSlice, icmpv4, icmpv6,
};

use super::{
    FlowPacket, Parsed, build_icmp_port_unreachable, build_tcp_rst, decrement_ttl, parse, rewrite,
    rewrite_fragment, rewrite_icmp_error, tcp_flags,
};
use crate::tuple::{Protocol, Tuple};

/// The protocols kxp translates.
pub const PROTOS: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];
/// A payload for test packets.
pub const PAYLOAD: &[u8] = b"GET / HTTP/1.1\r\nHost: svc\r\n\r\n";

/// What a test fills output buffers with, so that bytes left unwritten show.
pub const PATTERN: u8 = 0xA5;

/// The parties of a Service connection, in one family (test ranges only).
#[derive(Debug, Clone, Copy)]
pub struct Endpoints {
    pub client: SocketAddr,
    pub vip: SocketAddr,
    pub backend: SocketAddr,
    /// The node's address and port, when the flow is masqueraded.
    pub node: SocketAddr,
    /// A router on the path, which sends ICMP errors of its own.
    pub router: IpAddr,
}

impl Endpoints {
    pub fn v4() -> Endpoints {
        Endpoints {
            client: "198.18.0.1:40000".parse().unwrap(),
            vip: "198.19.0.10:80".parse().unwrap(),
            backend: "198.18.5.20:8080".parse().unwrap(),
            node: "198.18.0.254:61000".parse().unwrap(),
            router: "198.18.0.100".parse().unwrap(),
        }
    }

    pub fn v6() -> Endpoints {
        Endpoints {
            client: "[2001:db8::1]:40000".parse().unwrap(),
            vip: "[2001:db8:ffff::10]:80".parse().unwrap(),
            backend: "[2001:db8:5::20]:8080".parse().unwrap(),
            node: "[2001:db8::fe]:61000".parse().unwrap(),
            router: "2001:db8::100".parse().unwrap(),
        }
    }

    /// Client to Service, as the client sends it.
    pub fn original(&self, proto: Protocol) -> Tuple {
        Tuple::new(self.client, self.vip, proto)
    }

    /// After DNAT to the backend.
    pub fn dnat(&self, proto: Protocol) -> Tuple {
        Tuple::new(self.client, self.backend, proto)
    }

    /// After SNAT to the node only.
    pub fn snat(&self, proto: Protocol) -> Tuple {
        Tuple::new(self.node, self.vip, proto)
    }

    /// After DNAT and masquerade.
    pub fn masquerade(&self, proto: Protocol) -> Tuple {
        Tuple::new(self.node, self.backend, proto)
    }
}

fn ip(src: IpAddr, dst: IpAddr) -> PacketBuilderStep<IpHeaders> {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => PacketBuilder::ipv4(s.octets(), d.octets(), 64),
        (IpAddr::V6(s), IpAddr::V6(d)) => PacketBuilder::ipv6(s.octets(), d.octets(), 64),
        _ => panic!("mixed families"),
    }
}

/// A packet from client to Service (a TCP SYN with sequence number 1000).
pub fn build(e: &Endpoints, proto: Protocol, payload: &[u8]) -> Vec<u8> {
    build_tuple(&e.original(proto), payload)
}

/// A packet carrying `t` (a TCP SYN with sequence number 1000).
pub fn build_tuple(t: &Tuple, payload: &[u8]) -> Vec<u8> {
    match t.proto {
        Protocol::Tcp => build_tcp(t, 1000, None, tcp_flags::SYN, payload),
        Protocol::Udp => {
            let b = ip(t.src, t.dst).udp(t.sport, t.dport);
            let mut v = Vec::with_capacity(b.size(payload.len()));
            b.write(&mut v, payload).unwrap();
            v
        }
        Protocol::Sctp => build_sctp(t, payload),
    }
}

/// A TCP segment with the given flags (`ack` is the acknowledgment number).
pub fn build_tcp(t: &Tuple, seq: u32, ack: Option<u32>, flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut h = TcpHeader::new(t.sport, t.dport, seq, 64240);
    h.fin = flags & tcp_flags::FIN != 0;
    h.syn = flags & tcp_flags::SYN != 0;
    h.rst = flags & tcp_flags::RST != 0;
    h.psh = flags & tcp_flags::PSH != 0;
    h.ack = flags & tcp_flags::ACK != 0;
    h.acknowledgment_number = ack.unwrap_or(0);
    let b = ip(t.src, t.dst).tcp_header(h);
    let mut v = Vec::with_capacity(b.size(payload.len()));
    b.write(&mut v, payload).unwrap();
    v
}

/// An SCTP packet with one DATA chunk carrying `payload`, its CRC32c computed directly
/// with the crc32c crate (stored least significant byte first).
fn build_sctp(t: &Tuple, payload: &[u8]) -> Vec<u8> {
    let mut sctp = Vec::new();
    sctp.extend_from_slice(&t.sport.to_be_bytes());
    sctp.extend_from_slice(&t.dport.to_be_bytes());
    sctp.extend_from_slice(&0xC0FF_EE01u32.to_be_bytes()); // verification tag
    sctp.extend_from_slice(&[0; 4]); // CRC32c, filled below
    sctp.extend_from_slice(&[0, 0x03]); // DATA, beginning and end of a message
    sctp.extend_from_slice(&((16 + payload.len()) as u16).to_be_bytes());
    sctp.extend_from_slice(&7u32.to_be_bytes()); // TSN
    sctp.extend_from_slice(&[0, 0, 0, 0]); // stream id, stream sequence number
    sctp.extend_from_slice(&0u32.to_be_bytes()); // payload protocol id
    sctp.extend_from_slice(payload);
    while sctp.len() % 4 != 0 {
        sctp.push(0);
    }
    let crc = crc32c::crc32c(&sctp);
    sctp[8..12].copy_from_slice(&crc.to_le_bytes());

    let mut v = Vec::new();
    match (t.src, t.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let h = Ipv4Header::new(sctp.len() as u16, 64, IpNumber(132), s.octets(), d.octets())
                .unwrap();
            h.write(&mut v).unwrap();
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let h = Ipv6Header {
                traffic_class: 0,
                flow_label: Default::default(),
                payload_length: sctp.len() as u16,
                next_header: IpNumber(132),
                hop_limit: 64,
                source: s.octets(),
                destination: d.octets(),
            };
            h.write(&mut v).unwrap();
        }
        _ => panic!("mixed families"),
    }
    v.extend_from_slice(&sctp);
    v
}

/// A port-unreachable from `src` to `dst` quoting `quote`, as etherparse builds it.
pub fn icmp_error(src: IpAddr, dst: IpAddr, quote: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    match src {
        IpAddr::V4(_) => ip(src, dst)
            .icmpv4(etherparse::Icmpv4Type::DestinationUnreachable(
                icmpv4::DestUnreachableHeader::Port,
            ))
            .write(&mut v, quote)
            .unwrap(),
        IpAddr::V6(_) => ip(src, dst)
            .icmpv6(etherparse::Icmpv6Type::DestinationUnreachable(
                icmpv6::DestUnreachableCode::Port,
            ))
            .write(&mut v, quote)
            .unwrap(),
    }
    v
}

/// An echo request (ping).
pub fn icmp_echo(src: IpAddr, dst: IpAddr) -> Vec<u8> {
    let mut v = Vec::new();
    match src {
        IpAddr::V4(_) => ip(src, dst)
            .icmpv4_echo_request(1, 1)
            .write(&mut v, b"ping")
            .unwrap(),
        IpAddr::V6(_) => ip(src, dst)
            .icmpv6_echo_request(1, 1)
            .write(&mut v, b"ping")
            .unwrap(),
    }
    v
}

/// `pkt` (IPv6) with 8-byte extension headers of the given kinds (0 hop-by-hop, 43
/// routing, 44 fragment, 60 destination options) inserted after the fixed header.
pub fn insert_v6_ext(pkt: &[u8], kinds: &[u8]) -> Vec<u8> {
    let upper = pkt[6];
    let mut out = pkt[..40].to_vec();
    out[6] = kinds.first().copied().unwrap_or(upper);
    for (i, &kind) in kinds.iter().enumerate() {
        let next = kinds.get(i + 1).copied().unwrap_or(upper);
        let body: [u8; 6] = match kind {
            43 => [0, 0, 0, 0, 0, 0],  // type 0, no segments left, reserved
            44 => [0, 1, 0, 0, 0, 42], // offset 0, more fragments, identification
            _ => [1, 4, 0, 0, 0, 0],   // one PadN option
        };
        out.extend_from_slice(&[next, 0]);
        out.extend_from_slice(&body);
    }
    out.extend_from_slice(&pkt[40..]);
    let payload_len = (out.len() - 40) as u16;
    out[4..6].copy_from_slice(&payload_len.to_be_bytes());
    out
}

/// Turns the TCP or UDP checksum of the IP packet `pkt` (no IPv4 options, no IPv6
/// extension headers) into what a sender with checksum offload leaves there, as Linux
/// does for a `CHECKSUM_PARTIAL` skb (`~tcp_v4_check(len, saddr, daddr, 0)`): the
/// pseudo-header's sum, folded, not complemented. Computed here on its own, not with the
/// code under test.
pub fn make_partial(pkt: &mut [u8]) {
    let v4 = pkt[0] >> 4 == 4;
    let (l4, proto, addrs) = if v4 {
        (20, pkt[9], &pkt[12..20])
    } else {
        (40, pkt[6], &pkt[8..40])
    };
    let len = pkt.len() - l4;
    let mut sum: u32 = addrs
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    sum += u32::from(proto) + (len as u32 >> 16) + (len as u32 & 0xFFFF);
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    let at = l4 + if proto == 6 { 16 } else { 6 };
    pkt[at..at + 2].copy_from_slice(&(sum as u16).to_be_bytes());
}

/// Checks every checksum of `pkt` by recomputing it: with etherparse for the IPv4 header,
/// TCP, UDP and ICMP, with the crc32c crate for SCTP.
/// Recomputes the IPv4 header checksum of `p` after a test changed the header.
pub fn fix_ipv4_checksum(p: &mut [u8]) {
    let len = usize::from(p[0] & 0x0F) * 4;
    p[10] = 0;
    p[11] = 0;
    let mut sum: u32 = p[..len.min(p.len())]
        .chunks_exact(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    p[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
}

pub fn verify_checksums(pkt: &[u8]) {
    let sliced = SlicedPacket::from_ip(pkt).expect("etherparse accepts the packet");
    let (src, dst, payload) = match &sliced.net {
        Some(NetSlice::Ipv4(ip)) => {
            let h = ip.header().to_header();
            assert_eq!(
                h.header_checksum,
                h.calc_header_checksum(),
                "IPv4 header checksum"
            );
            let (s, d) = (h.source.to_vec(), h.destination.to_vec());
            (s, d, ip.payload().clone())
        }
        Some(NetSlice::Ipv6(ip)) => {
            let h = ip.header();
            (
                h.source().to_vec(),
                h.destination().to_vec(),
                ip.payload().clone(),
            )
        }
        other => panic!("not IP: {other:?}"),
    };
    let v4 = |a: &[u8]| -> [u8; 4] { a.try_into().unwrap() };
    let v6 = |a: &[u8]| -> [u8; 16] { a.try_into().unwrap() };
    match &sliced.transport {
        Some(TransportSlice::Tcp(t)) => {
            let c = match src.len() {
                4 => t.calc_checksum_ipv4(v4(&src), v4(&dst)),
                _ => t.calc_checksum_ipv6(v6(&src), v6(&dst)),
            };
            assert_eq!(t.checksum(), c.unwrap(), "TCP checksum");
        }
        Some(TransportSlice::Udp(u)) => {
            let h = u.to_header();
            if src.len() == 4 && h.checksum == 0 {
                return; // no checksum
            }
            let c = match src.len() {
                4 => h.calc_checksum_ipv4_raw(v4(&src), v4(&dst), u.payload()),
                _ => h.calc_checksum_ipv6_raw(v6(&src), v6(&dst), u.payload()),
            };
            assert_eq!(h.checksum, c.unwrap(), "UDP checksum");
        }
        Some(TransportSlice::Icmpv4(i)) => {
            let mut m = i.slice().to_vec();
            m[2..4].fill(0);
            let c = etherparse::checksum::Sum16BitWords::new()
                .add_slice(&m)
                .ones_complement();
            // etherparse sums in native byte order: its result's bytes are the wire bytes.
            assert_eq!(
                i.checksum(),
                u16::from_be_bytes(c.to_ne_bytes()),
                "ICMPv4 checksum"
            );
        }
        Some(TransportSlice::Icmpv6(i)) => {
            assert!(i.is_checksum_valid(v6(&src), v6(&dst)), "ICMPv6 checksum");
        }
        None if payload.ip_number == IpNumber(132) => {
            let mut m = payload.payload.to_vec();
            let stored = [m[8], m[9], m[10], m[11]];
            m[8..12].fill(0);
            assert_eq!(crc32c::crc32c(&m).to_le_bytes(), stored, "SCTP CRC32c");
        }
        other => panic!("unexpected transport: {other:?}"),
    }
}

/// `pkt` (IPv4) with `opts` (a multiple of 4 bytes) appended to its header.
pub fn with_ipv4_options(pkt: &[u8], opts: &[u8]) -> Vec<u8> {
    let mut out = pkt[..20].to_vec();
    out.extend_from_slice(opts);
    out.extend_from_slice(&pkt[20..]);
    out[0] = 0x40 | ((out[0] & 0x0F) + (opts.len() / 4) as u8);
    let total = out.len() as u16;
    out[2..4].copy_from_slice(&total.to_be_bytes());
    out[10..12].fill(0);
    let c = super::checksum::finish(super::checksum::sum(&out[..20 + opts.len()]));
    out[10..12].copy_from_slice(&c.to_be_bytes());
    out
}

/// Valid packets of every kind the module handles.
pub fn corpus() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for e in [Endpoints::v4(), Endpoints::v6()] {
        for proto in PROTOS {
            let sent = build_tuple(&e.original(proto), PAYLOAD);
            let forwarded = build_tuple(&e.masquerade(proto), PAYLOAD);
            let l4 = if e.client.is_ipv4() { 20 } else { 40 };
            out.push(icmp_error(e.backend.ip(), e.node.ip(), &forwarded));
            out.push(icmp_error(e.router, e.node.ip(), &forwarded[..l4 + 8]));
            out.push(sent);
        }
        out.push(icmp_echo(e.client.ip(), e.vip.ip()));
    }
    let v6 = build_tuple(&Endpoints::v6().original(Protocol::Tcp), PAYLOAD);
    out.push(insert_v6_ext(&v6, &[0, 43, 60]));
    let v4 = build_tuple(&Endpoints::v4().original(Protocol::Udp), PAYLOAD);
    out.push(with_ipv4_options(&v4, &[1, 1, 1, 0, 1, 1, 1, 0]));
    out
}

/// The checksum words that RFC 1624 eqn. 3 cannot bring back when they start as 0xFFFF
/// (a value a correct sender never computes for TCP or an IPv4 header), and whether an
/// SCTP CRC is valid (a recomputed CRC repairs a corrupted one).
pub fn round_trips_exactly(pkt: &[u8], f: &FlowPacket) -> bool {
    let word = |at: usize| u16::from_be_bytes([pkt[at], pkt[at + 1]]);
    let l4 = f.l4_offset();
    let ipv4_ok = pkt[0] >> 4 != 4 || word(10) != 0xFFFF;
    let t = f.tuple();
    let seg = &pkt[l4..f.ip_len()];
    // A checksum equal to the pseudo-header's sum is taken for a partial one and
    // completed, not patched (see `checksum_is_partial`; found by fuzzing).
    let completed = super::l4::checksum_is_partial(seg, t.proto, t.src, t.dst);
    let l4_ok = !completed
        && match t.proto {
            Protocol::Tcp => word(l4 + 16) != 0xFFFF,
            Protocol::Udp => true,
            Protocol::Sctp => super::checksum::sctp_crc(seg).to_le_bytes() == seg[8..12],
        };
    ipv4_ok && l4_ok
}

/// Which way [`check_packet`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checked {
    Flow,
    IcmpError,
    Fragment,
    Other,
}

/// Everything the rewrite module promises about one packet, whatever its bytes (panics
/// where a promise is broken): nothing panics; whatever parses as a flow can be
/// rewritten, re-parses as the target, and (outside [`round_trips_exactly`]'s cases)
/// comes back exactly; an ICMP error and a fragment are translated and back; whatever
/// reply (RST, port unreachable) is built is a valid packet. Returns the way it went and
/// how many replies were built. Shared by the random-mutation test and the fuzzer.
pub fn check_packet(pkt: &[u8]) -> (Checked, usize) {
    let e = match pkt.first().map(|b| b >> 4) {
        Some(6) => Endpoints::v6(),
        _ => Endpoints::v4(),
    };
    let mut path = Checked::Other;
    let mut replies = 0;
    let mut out = [0u8; 1500];
    let pkt = pkt.to_vec();
    match parse(&pkt) {
        Ok(Parsed::Flow(f)) => {
            path = Checked::Flow;
            let from = f.tuple();
            let to = Tuple {
                sport: from.sport.wrapping_add(1),
                ..e.masquerade(from.proto)
            };
            let mut buf = pkt.clone();
            rewrite(&mut buf, &f, &to).unwrap();
            let Ok(Parsed::Flow(back)) = parse(&buf) else {
                panic!("a rewritten flow packet does not parse back")
            };
            assert_eq!(back.tuple(), to);
            // A wrong checksum patched into one equal to the new pseudo-header's sum is
            // completed on the way back, not patched (found by fuzzing).
            let seg = &buf[back.l4_offset()..back.ip_len()];
            let completed_back = super::l4::checksum_is_partial(seg, to.proto, to.src, to.dst);
            rewrite(&mut buf, &back, &from).unwrap();
            if round_trips_exactly(&pkt, &f) && !completed_back {
                assert_eq!(buf, pkt);
            }
        }
        Ok(Parsed::IcmpError(i)) => {
            path = Checked::IcmpError;
            let to = e.original(i.inner().proto);
            let mut buf = pkt.clone();
            rewrite_icmp_error(&mut buf, &i, &to, Some(e.vip.ip()), e.client.ip()).unwrap();
            match parse(&buf) {
                Ok(Parsed::IcmpError(j)) => assert_eq!(j.inner(), to),
                other => panic!("{other:?}"),
            }
        }
        Ok(Parsed::Fragment(fp)) => {
            path = Checked::Fragment;
            let mut buf = pkt.clone();
            let k = fp.key();
            rewrite_fragment(&mut buf, &fp, e.backend.ip(), e.client.ip()).unwrap();
            match parse(&buf) {
                Ok(Parsed::Fragment(g)) => {
                    assert_eq!((g.key().src, g.key().dst), (e.backend.ip(), e.client.ip()));
                    rewrite_fragment(&mut buf, &g, k.src, k.dst).unwrap();
                    // As for a flow: an IPv4 header checksum of 0xFFFF (which no sender
                    // computes) comes back as 0x0000, equally wrong (found by fuzzing).
                    let v4_ffff = pkt[0] >> 4 == 4 && pkt[10..12] == [0xFF, 0xFF];
                    if v4_ffff {
                        assert_eq!((&buf[..10], &buf[12..]), (&pkt[..10], &pkt[12..]));
                    } else {
                        assert_eq!(buf, pkt);
                    }
                }
                other => panic!("{other:?}"),
            }
        }
        Ok(Parsed::NotTranslatable(_)) | Err(_) => {}
    }
    let _ = decrement_ttl(&mut pkt.clone());
    for build in [build_tcp_rst, build_icmp_port_unreachable] {
        out.fill(PATTERN);
        if let Ok(n) = build(&pkt, &mut out) {
            replies += 1;
            verify_checksums(&out[..n]);
            assert!(parse(&out[..n]).is_ok());
        }
    }
    (path, replies)
}

/// xorshift64: deterministic, good enough to pick bytes to mutate.
#[derive(Debug)]
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> XorShift {
        XorShift(seed.max(1))
    }

    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform enough in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}
