//! Internet checksums (RFC 1071), their incremental update (RFC 1624), and SCTP's CRC32c
//! (RFC 9260 appendix A).
//!
//! The fast path never sums a payload again: a rewrite records every 16-bit word it
//! changes in a [`Delta`] and patches each checksum that covers those words with
//! RFC 1624 eqn. 3, `HC' = ~(~HC + ~m + m')`. Eqn. 3 (not eqn. 2) is the one that never
//! turns a valid checksum into the other ones'-complement zero.

use std::net::IpAddr;

/// The ones'-complement sum of the changes made to some 16-bit words: `Σ (~m + m')`.
///
/// Words must sit at even offsets from the start of the checksummed data; every field kxp
/// rewrites does (addresses, ports, checksums).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Delta(u64);

impl Delta {
    /// Records that the word `old` became `new`.
    #[inline]
    pub(super) fn word(&mut self, old: u16, new: u16) {
        self.0 += u64::from(!old) + u64::from(new);
    }

    /// Writes `new` (even length) over `buf[off..]` and records the change.
    ///
    /// The caller has checked that `buf[off..off + new.len()]` exists.
    #[inline]
    pub(super) fn write(&mut self, buf: &mut [u8], off: usize, new: &[u8]) {
        let dst = &mut buf[off..off + new.len()];
        for (old, new) in dst.chunks_exact_mut(2).zip(new.chunks_exact(2)) {
            self.word(
                u16::from_be_bytes([old[0], old[1]]),
                u16::from_be_bytes([new[0], new[1]]),
            );
            old.copy_from_slice(new);
        }
    }

    /// Like [`Delta::write`] for a field that the end of `buf` may cut (a quote): writes
    /// what fits, a lone last byte counting as the high byte of a zero-padded word, as
    /// the checksum over `buf` sees it (RFC 1071).
    pub(super) fn write_clipped(&mut self, buf: &mut [u8], off: usize, new: &[u8]) {
        let n = new.len().min(buf.len().saturating_sub(off));
        let (whole, tail) = new[..n].split_at(n & !1);
        self.write(buf, off, whole);
        if let [b] = tail {
            let at = off + whole.len();
            self.word(u16::from(buf[at]) << 8, u16::from(*b) << 8);
            buf[at] = *b;
        }
    }

    /// Writes the big-endian word `new` at `buf[off..off + 2]` and records the change.
    #[inline]
    pub(super) fn write16(&mut self, buf: &mut [u8], off: usize, new: u16) {
        self.write(buf, off, &new.to_be_bytes());
    }

    /// Adds another set of changes (to words covered by the same checksum).
    #[inline]
    pub(super) fn add(&mut self, other: Delta) {
        self.0 += other.0;
    }

    /// The checksum `hc` after the recorded changes (RFC 1624 eqn. 3).
    #[inline]
    pub(super) fn apply(self, hc: u16) -> u16 {
        !fold(u64::from(!hc) + self.0)
    }

    /// Patches the big-endian checksum at `buf[off..off + 2]`, recording the change of
    /// the checksum field itself in `outer` (for a checksum that covers this one).
    #[inline]
    pub(super) fn patch(self, buf: &mut [u8], off: usize, outer: &mut Delta) {
        let old = get16(buf, off);
        outer.write16(buf, off, self.apply(old));
    }

    /// Like [`Delta::patch`] for UDP: 0 means "no checksum" and stays 0, and a result
    /// of 0 is sent as 0xFFFF (RFC 768).
    #[inline]
    pub(super) fn patch_udp(self, buf: &mut [u8], off: usize, outer: &mut Delta) {
        let old = get16(buf, off);
        if old != 0 {
            let new = match self.apply(old) {
                0 => 0xFFFF,
                c => c,
            };
            outer.write16(buf, off, new);
        }
    }
}

/// Folds a wide ones'-complement sum into 16 bits (end-around carry).
#[inline]
pub(super) fn fold(mut sum: u64) -> u16 {
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    sum as u16
}

/// The big-endian word at `buf[off..off + 2]`; the caller has checked the bounds.
#[inline]
pub(super) fn get16(buf: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([buf[off], buf[off + 1]])
}

/// The big-endian word at `buf[off..off + 4]`; the caller has checked the bounds.
#[inline]
pub(super) fn get32(buf: &[u8], off: usize) -> u32 {
    u32::from_be_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]])
}

/// The unfolded ones'-complement sum of `data` as 16-bit big-endian words, an odd last
/// byte padded with zero (RFC 1071). For building packets, not for the fast path.
pub(super) fn sum(data: &[u8]) -> u64 {
    let mut chunks = data.chunks_exact(2);
    let mut acc: u64 = chunks
        .by_ref()
        .map(|w| u64::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    if let [last] = chunks.remainder() {
        acc += u64::from(*last) << 8;
    }
    acc
}

/// Like [`sum`], congruent to it modulo 0xFFFF (so the same once folded), four bytes at a
/// time: 2^16 ≡ 1 (mod 0xFFFF), so big-endian 32-bit words add up to the same folded sum
/// as their 16-bit halves. For payloads summed on the packet path (a partial checksum
/// completed in software).
pub(super) fn sum_fast(data: &[u8]) -> u64 {
    let mut chunks = data.chunks_exact(4);
    let mut acc: u64 = chunks
        .by_ref()
        .map(|w| u64::from(u32::from_be_bytes([w[0], w[1], w[2], w[3]])))
        .sum();
    acc += sum(chunks.remainder());
    acc
}

/// The sum of a TCP/UDP/ICMPv6 pseudo-header (RFC 793, RFC 8200 section 8.1).
///
/// Congruent modulo 0xFFFF to the sum of its 16-bit words (so the same once folded),
/// computed on 32-bit words: this runs for every translated TCP/UDP packet (the
/// partial-checksum check).
#[inline]
pub(super) fn pseudo_sum(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> u64 {
    let words = |x: u128| {
        (x >> 96) as u32 as u64
            + (x >> 64) as u32 as u64
            + (x >> 32) as u32 as u64
            + x as u32 as u64
    };
    let addrs = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => u64::from(u32::from(s)) + u64::from(u32::from(d)),
        (IpAddr::V6(s), IpAddr::V6(d)) => words(u128::from(s)) + words(u128::from(d)),
        _ => 0,
    };
    addrs + u64::from(proto) + len as u64
}

/// The checksum to store for a sum: its ones' complement.
pub(super) fn finish(sum: u64) -> u16 {
    !fold(sum)
}

/// Offset of the CRC32c in the SCTP common header.
const SCTP_CRC: usize = 8;

/// The CRC32c of an SCTP packet (common header and chunks), computed with the checksum
/// field as zero. It is stored in the packet least significant byte first (RFC 9260
/// appendix A; Linux `sctp_csum_finalize` stores it `cpu_to_le32`).
///
/// The caller has checked that `pkt` holds at least the 12-byte common header.
pub(super) fn sctp_crc(pkt: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&pkt[..SCTP_CRC]);
    let crc = crc32c::crc32c_append(crc, &[0; 4]);
    crc32c::crc32c_append(crc, &pkt[SCTP_CRC + 4..])
}

/// Recomputes and stores the CRC32c of the SCTP packet `pkt`.
pub(super) fn sctp_fill(pkt: &mut [u8]) {
    let crc = sctp_crc(pkt);
    pkt[SCTP_CRC..SCTP_CRC + 4].copy_from_slice(&crc.to_le_bytes());
}

/// The CRC32c of an SCTP packet of `len` bytes whose first four bytes (the ports) changed
/// from `old` to `new`, given its previous CRC `crc`, without reading the packet.
///
/// CRC32c is affine: for messages of one length, `crc(a ^ b ^ c) = crc(a) ^ crc(b) ^
/// crc(c)`. With `Δ = old ^ new` followed by `len - 4` zero bytes, `crc(new packet) =
/// crc(old packet) ^ crc(Δ) ^ crc(zeros)`, and the last two terms reduce to shifting
/// `crc(Δ[..4]) ^ crc([0; 4])` over `len - 4` zero bytes. Used for the SCTP header quoted
/// in an ICMP error, where the rest of the packet is not there to sum again.
pub(super) fn sctp_crc_update_ports(crc: u32, old: [u8; 4], new: [u8; 4], len: usize) -> u32 {
    let delta = [
        old[0] ^ new[0],
        old[1] ^ new[1],
        old[2] ^ new[2],
        old[3] ^ new[3],
    ];
    let head = crc32c::crc32c(&delta) ^ crc32c::crc32c(&[0; 4]);
    crc ^ crc32c::crc32c_combine(head, 0, len.saturating_sub(4))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewrite::testutil::XorShift;

    #[test]
    fn sum_matches_rfc1071_example() {
        // RFC 1071 section 3: 00 01 f2 03 f4 f5 f6 f7 sums to ddf2.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(fold(sum(&data)), 0xddf2);
        assert_eq!(finish(sum(&data)), !0xddf2);
        // An odd trailing byte is padded on the right.
        assert_eq!(fold(sum(&[0x12])), 0x1200);
    }

    #[test]
    fn incremental_update_equals_full_recompute() {
        let mut rng = XorShift::new(0x1624);
        for _ in 0..2000 {
            let len = 2 * (3 + rng.below(40));
            let mut data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            data[0] = 0x45; // a nonzero word: a real header's sum is never zero
            data[2] = 0;
            data[3] = 0;
            let c = finish(sum(&data));
            data[2..4].copy_from_slice(&c.to_be_bytes());
            let mut d = Delta::default();
            for _ in 0..1 + rng.below(4) {
                let off = 4 + 2 * rng.below((len - 4) / 2);
                d.write16(&mut data, off, rng.next() as u16);
            }
            let mut unused = Delta::default();
            d.patch(&mut data, 2, &mut unused);
            let stored = get16(&data, 2);
            data[2] = 0;
            data[3] = 0;
            assert_eq!(stored, finish(sum(&data)));
        }
    }

    #[test]
    fn pseudo_sum_folds_like_the_sum_of_its_words() {
        let mut rng = XorShift::new(793);
        for _ in 0..500 {
            let v6 = rng.next() & 1 == 1;
            let (s, d): (IpAddr, IpAddr) = if v6 {
                let a = (u128::from(rng.next()) << 64) | u128::from(rng.next());
                let b = (u128::from(rng.next()) << 64) | u128::from(rng.next());
                (
                    std::net::Ipv6Addr::from(a).into(),
                    std::net::Ipv6Addr::from(b).into(),
                )
            } else {
                (
                    std::net::Ipv4Addr::from(rng.next() as u32).into(),
                    std::net::Ipv4Addr::from(rng.next() as u32).into(),
                )
            };
            let len = rng.below(70_000);
            let octets = |a: IpAddr| match a {
                IpAddr::V4(a) => a.octets().to_vec(),
                IpAddr::V6(a) => a.octets().to_vec(),
            };
            let words = sum(&octets(s)) + sum(&octets(d)) + 17 + sum(&(len as u32).to_be_bytes());
            assert_eq!(fold(pseudo_sum(s, d, 17, len)), fold(words));
        }
    }

    #[test]
    fn fast_sum_folds_like_the_plain_sum() {
        let mut rng = XorShift::new(1071);
        for len in (0..70).chain([1499, 1500, 8972, 9000]) {
            let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            assert_eq!(fold(sum_fast(&data)), fold(sum(&data)), "{len} bytes");
        }
        assert_eq!(fold(sum_fast(&[0xFF; 4096])), fold(sum(&[0xFF; 4096])));
    }

    #[test]
    fn udp_patch_keeps_zero_and_never_writes_zero() {
        let mut buf = [0u8; 2];
        let mut d = Delta::default();
        d.word(0x1234, 0x4321);
        d.patch_udp(&mut buf, 0, &mut Delta::default());
        assert_eq!(buf, [0, 0], "no checksum stays no checksum");

        // ~HC + ~m + m' = 0xFFFF: eqn. 3 yields 0, which UDP must send as 0xFFFF.
        let hc = 0x1111u16;
        let mut d = Delta::default();
        d.word(0, hc);
        let mut buf = hc.to_be_bytes();
        d.patch_udp(&mut buf, 0, &mut Delta::default());
        assert_eq!(buf, [0xFF, 0xFF]);
    }

    #[test]
    fn sctp_crc_matches_captured_packets() {
        // SCTP packets captured from Linux (the dpkt test corpus): INIT and ABORT. The
        // stored bytes are the crc32c crate's value, least significant byte first.
        let init = [
            0x0f, 0xe4, 0x0f, 0x1c, 0x00, 0x00, 0x00, 0x00, 0x9f, 0x78, 0xa7, 0x04, 0x01, 0x00,
            0x00, 0x14, 0xbb, 0x7b, 0x0f, 0x9c, 0x00, 0x00, 0xfa, 0x00, 0x00, 0x0a, 0x00, 0x0a,
            0xbb, 0x7b, 0x0f, 0x9c,
        ];
        let abort = [
            0x30, 0x39, 0x30, 0x39, 0xbe, 0x65, 0xa7, 0xef, 0x7d, 0xc1, 0xb2, 0xfc, 0x06, 0x00,
            0x00, 0x04,
        ];
        for pkt in [&init[..], &abort[..]] {
            assert_eq!(sctp_crc(pkt).to_le_bytes(), pkt[8..12]);
            let mut copy = pkt.to_vec();
            copy[8..12].fill(0xAA);
            sctp_fill(&mut copy);
            assert_eq!(copy, pkt);
        }
        // The CRC-32C check value (RFC 3720 B.4 / the Castagnoli "123456789" vector).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn sctp_incremental_port_update_equals_recompute() {
        let mut rng = XorShift::new(9260);
        for _ in 0..200 {
            let len = 12 + rng.below(300);
            let mut pkt: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            sctp_fill(&mut pkt);
            let old: [u8; 4] = [pkt[0], pkt[1], pkt[2], pkt[3]];
            let new = (rng.next() as u32).to_be_bytes();
            let crc = u32::from_le_bytes([pkt[8], pkt[9], pkt[10], pkt[11]]);
            pkt[..4].copy_from_slice(&new);
            assert_eq!(sctp_crc_update_ports(crc, old, new, len), sctp_crc(&pkt));
        }
    }
}
