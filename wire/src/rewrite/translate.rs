//! In-place translation of a TCP/UDP/SCTP packet, and the TTL / hop-limit decrement.
//!
//! This is the per-packet fast path: it writes the addresses and ports that change and
//! patches the IPv4 header checksum and the TCP/UDP checksum incrementally (RFC 1624),
//! without reading the payload, except for a packet whose checksum was left partial by
//! its sender (checksum offload): that one is summed in full, once. SCTP's CRC32c is not a sum and covers no pseudo-header:
//! it is recomputed, only when a port changes.

use std::net::IpAddr;

use super::parse::FlowPacket;
use super::{ParseError, ipv4, ipv6, l4};
use crate::tuple::{Protocol, Tuple};

/// Why a rewrite was refused. All are caller bugs rather than bad packets: the NAT
/// binding and the packet disagree. The buffer is left unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RewriteError {
    /// An address of the target is of the other family than the packet (kxp does not do
    /// NAT64), or the target mixes families.
    #[error(
        "target address family differs from the packet's: a translation keeps the family \
         (check the NAT binding)"
    )]
    FamilyMismatch,
    /// The target tuple has another protocol than the packet.
    #[error("target protocol {to} differs from the packet's {packet} (check the NAT binding)")]
    ProtocolMismatch { packet: Protocol, to: Protocol },
    /// The buffer is shorter than the packet the parse result describes.
    #[error("buffer holds {have} bytes but the parsed packet has {need}: pass the parsed buffer")]
    BufferTooShort { need: usize, have: usize },
}

/// Translates the packet in `buf` (as parsed into `pkt`) so that it carries `to`: its
/// addresses and ports are written, the IPv4 header checksum and the TCP/UDP checksum
/// (pseudo-header included, both families) are patched incrementally, a UDP checksum of 0
/// (none) stays 0, and an SCTP packet whose ports change gets its CRC32c recomputed.
///
/// A TCP/UDP checksum that holds only the pseudo-header sum (the sender left it to the
/// hardware: every pod's veth does) is completed instead: summed in full over the
/// translated packet, since nothing downstream of an AF_XDP transmit will finish it. See
/// `l4::checksum_is_partial` for when that test could be fooled.
///
/// `pkt` keeps describing the packet as it arrived; its offsets stay valid.
///
/// # Errors
/// [`RewriteError`]; the buffer is unchanged on error.
pub fn rewrite(buf: &mut [u8], pkt: &FlowPacket, to: &Tuple) -> Result<(), RewriteError> {
    let from = pkt.tuple;
    if to.proto != from.proto {
        return Err(RewriteError::ProtocolMismatch {
            packet: from.proto,
            to: to.proto,
        });
    }
    let v6 = from.src.is_ipv6();
    check_family(v6, [Some(to.src), Some(to.dst), None, None])?;
    let buf = parsed_bytes(buf, pkt.ip_len)?;
    let (ip, seg) = buf.split_at_mut(pkt.l4_offset);
    // A fragment's checksum is never partial (the sender's stack completes it before it
    // fragments), and covers bytes other fragments carry: patch it only.
    let partial =
        pkt.frag.is_none() && l4::checksum_is_partial(seg, from.proto, from.src, from.dst);
    let change = set_addrs(ip, Some(to.src), Some(to.dst), v6);
    if partial {
        l4::rewrite_complete(seg, to.proto, to.sport, to.dport, to.src, to.dst);
    } else {
        l4::rewrite(seg, to.proto, to.sport, to.dport, change.pseudo);
    }
    Ok(())
}

/// Completes the TCP/UDP checksum of a packet that kxp forwards without translating it (an
/// endpoint answering a connection kxp did not translate, handed to kxp by the steering
/// program), when its sender left the checksum partial (`l4::checksum_is_partial`): the
/// kernel would have completed it on transmit, an AF_XDP transmit will not. Returns
/// whether it did; any other packet (a complete checksum, UDP's 0, SCTP, a fragment) is
/// left as it is.
///
/// # Errors
/// [`RewriteError::BufferTooShort`] when `buf` is not the buffer that was parsed; the
/// buffer is then unchanged.
pub fn complete_checksum(buf: &mut [u8], pkt: &FlowPacket) -> Result<bool, RewriteError> {
    let buf = parsed_bytes(buf, pkt.ip_len)?;
    let t = pkt.tuple;
    let seg = &mut buf[pkt.l4_offset..];
    if pkt.frag.is_some() || !l4::checksum_is_partial(seg, t.proto, t.src, t.dst) {
        return Ok(false);
    }
    l4::rewrite_complete(seg, t.proto, t.sport, t.dport, t.src, t.dst);
    Ok(true)
}

/// Translates a fragment after the first (`pkt`, as parsed from `buf`) the way the first
/// fragment of its datagram was: its addresses become `src` and `dst` (the IPv4 header
/// checksum patched). Nothing else changes: the ports and the transport checksum are in
/// the first fragment.
///
/// # Errors
/// [`RewriteError::FamilyMismatch`], [`RewriteError::BufferTooShort`]; the buffer is
/// then unchanged.
pub fn rewrite_fragment(
    buf: &mut [u8],
    pkt: &super::FragmentPacket,
    src: IpAddr,
    dst: IpAddr,
) -> Result<(), RewriteError> {
    let v6 = pkt.key.src.is_ipv6();
    check_family(v6, [Some(src), Some(dst), None, None])?;
    let buf = parsed_bytes(buf, pkt.ip_len)?;
    set_addrs(buf, Some(src), Some(dst), v6);
    Ok(())
}

/// Decrements the IPv4 TTL (patching the header checksum incrementally) or the IPv6 hop
/// limit of the packet at the start of `buf`, as a router does before forwarding.
///
/// Returns `false`, leaving the packet unchanged, when it arrived with 0 or 1: it must not
/// be forwarded (a router would answer time-exceeded).
///
/// # Errors
/// `Truncated` when `buf` is shorter than the fixed header, `BadVersion`.
pub fn decrement_ttl(buf: &mut [u8]) -> Result<bool, ParseError> {
    match buf.first().map(|b| b >> 4) {
        Some(4) if buf.len() >= ipv4::MIN_HEADER_LEN => Ok(ipv4::decrement_ttl(buf)),
        Some(6) if buf.len() >= ipv6::HEADER_LEN => Ok(ipv6::decrement_hop_limit(buf)),
        None | Some(4 | 6) => Err(ParseError::Truncated),
        Some(v) => Err(ParseError::BadVersion(v)),
    }
}

/// The parsed packet's bytes, `buf[..ip_len]` (link padding after it left alone).
///
/// # Errors
/// [`RewriteError::BufferTooShort`] when `buf` is not the buffer that was parsed.
pub(super) fn parsed_bytes(buf: &mut [u8], ip_len: usize) -> Result<&mut [u8], RewriteError> {
    let have = buf.len();
    buf.get_mut(..ip_len)
        .ok_or(RewriteError::BufferTooShort { need: ip_len, have })
}

/// Checks that every given address is of the packet's family, before anything is written.
pub(super) fn check_family(v6: bool, addrs: [Option<IpAddr>; 4]) -> Result<(), RewriteError> {
    match addrs.iter().flatten().all(|a| a.is_ipv6() == v6) {
        true => Ok(()),
        false => Err(RewriteError::FamilyMismatch),
    }
}

/// Writes the addresses that are `Some` into the IP header at the start of `hdr`; see
/// [`ipv4::Change`]. The caller has checked the families and that `hdr` holds the parsed
/// header.
pub(super) fn set_addrs(
    hdr: &mut [u8],
    src: Option<IpAddr>,
    dst: Option<IpAddr>,
    v6: bool,
) -> ipv4::Change {
    if v6 {
        let d = ipv6::set_addrs(hdr, src.and_then(as_v6), dst.and_then(as_v6));
        ipv4::Change {
            pseudo: d,
            bytes: d,
        }
    } else {
        ipv4::set_addrs(hdr, src.and_then(as_v4), dst.and_then(as_v4))
    }
}

fn as_v4(a: IpAddr) -> Option<std::net::Ipv4Addr> {
    match a {
        IpAddr::V4(a) => Some(a),
        IpAddr::V6(_) => None,
    }
}

fn as_v6(a: IpAddr) -> Option<std::net::Ipv6Addr> {
    match a {
        IpAddr::V6(a) => Some(a),
        IpAddr::V4(_) => None,
    }
}

#[cfg(test)]
mod tests;
