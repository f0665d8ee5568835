//! IPv4 fragmentation, as a router does it for a packet larger than the next link's MTU
//! whose sender allowed it (DF clear; RFC 791 section 3.2, RFC 1812 section 5.2.6).
//!
//! Each fragment repeats the IP header (options included: the ones a sender puts on
//! Service traffic are none), carries a multiple of 8 bytes of the payload (the last one
//! the rest), and has its offset and more-fragments flag set relative to the original,
//! which may itself be a fragment. Headers are summed in full: fragments are built once.

use super::checksum::{finish, get16, sum};
use super::ipv4;

/// Why a packet cannot be split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FragmentError {
    #[error("not an IPv4 packet with a valid header")]
    NotIpv4,
    #[error("don't-fragment is set: answer fragmentation-needed instead")]
    DontFragment,
    #[error("an MTU of {0} leaves no room for 8 bytes of payload after the header")]
    MtuTooSmall(usize),
    #[error("output buffer holds {have} bytes but the fragment needs {need}")]
    BufferTooSmall { need: usize, have: usize },
}

struct Layout {
    header_len: usize,
    total_len: usize,
    chunk: usize,
}

fn layout(pkt: &[u8], mtu: usize) -> Result<Layout, FragmentError> {
    let h = ipv4::parse(pkt, false).map_err(|_| FragmentError::NotIpv4)?;
    if get16(pkt, 6) & 0x4000 != 0 {
        return Err(FragmentError::DontFragment);
    }
    let chunk = mtu.saturating_sub(h.header_len) & !7;
    if chunk == 0 {
        return Err(FragmentError::MtuTooSmall(mtu));
    }
    Ok(Layout {
        header_len: h.header_len,
        total_len: h.total_len,
        chunk,
    })
}

/// How many fragments of at most `mtu` bytes the IPv4 packet `pkt` makes.
///
/// # Errors
/// [`FragmentError`]: not IPv4, DF set, or an MTU too small.
pub fn ipv4_fragment_count(pkt: &[u8], mtu: usize) -> Result<usize, FragmentError> {
    let l = layout(pkt, mtu)?;
    Ok((l.total_len - l.header_len).div_ceil(l.chunk).max(1))
}

/// Writes fragment `index` (from 0) of `pkt` for a link of `mtu` bytes into `out` and
/// returns its length.
///
/// # Errors
/// As [`ipv4_fragment_count`], or `out` too small.
pub fn write_ipv4_fragment(
    pkt: &[u8],
    mtu: usize,
    index: usize,
    out: &mut [u8],
) -> Result<usize, FragmentError> {
    let l = layout(pkt, mtu)?;
    let payload = &pkt[l.header_len..l.total_len];
    let start = (index * l.chunk).min(payload.len());
    let end = (start + l.chunk).min(payload.len());
    let part = &payload[start..end];
    let need = l.header_len + part.len();
    if out.len() < need {
        return Err(FragmentError::BufferTooSmall {
            need,
            have: out.len(),
        });
    }
    let word = get16(pkt, 6);
    let (orig_offset, orig_more) = (usize::from(word & 0x1FFF) * 8, word & 0x2000 != 0);
    let more = orig_more || end < payload.len();
    let offset = ((orig_offset + start) / 8) as u16;
    let hdr = &mut out[..l.header_len];
    hdr.copy_from_slice(&pkt[..l.header_len]);
    hdr[2..4].copy_from_slice(&(need as u16).to_be_bytes());
    hdr[6..8].copy_from_slice(&(offset | if more { 0x2000 } else { 0 }).to_be_bytes());
    hdr[10..12].fill(0);
    let c = finish(sum(hdr));
    hdr[10..12].copy_from_slice(&c.to_be_bytes());
    out[l.header_len..need].copy_from_slice(part);
    Ok(need)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewrite::testutil::{Endpoints, build_tuple};
    use crate::rewrite::{Parsed, parse};
    use crate::tuple::Protocol;

    #[test]
    fn a_big_datagram_becomes_fragments_that_reassemble_to_it() {
        let e = Endpoints::v4();
        let payload: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let mut pkt = build_tuple(&e.dnat(Protocol::Udp), &payload);
        pkt[6] = 0; // DF off
        pkt[10..12].fill(0);
        let c = finish(sum(&pkt[..20]));
        pkt[10..12].copy_from_slice(&c.to_be_bytes());
        let n = ipv4_fragment_count(&pkt, 1280).unwrap();
        assert_eq!(n, 3);
        let mut body = Vec::new();
        for i in 0..n {
            let mut out = vec![0xA5; 1500];
            let len = write_ipv4_fragment(&pkt, 1280, i, &mut out).unwrap();
            assert!(len <= 1280);
            let f = &out[..len];
            assert_eq!(finish(sum(&f[..20])), 0, "header checksum");
            let w = get16(f, 6);
            assert_eq!(usize::from(w & 0x1FFF) * 8, body.len());
            assert_eq!(w & 0x2000 != 0, i + 1 < n);
            match (i, parse(f).unwrap()) {
                (0, Parsed::Flow(fl)) => assert!(fl.fragment().is_some()),
                (_, Parsed::Fragment(_)) => {}
                other => panic!("{other:?}"),
            }
            body.extend_from_slice(&f[20..]);
        }
        assert_eq!(body, pkt[20..]);
    }

    #[test]
    fn dont_fragment_and_tiny_mtus_are_refused() {
        let pkt = build_tuple(&Endpoints::v4().dnat(Protocol::Udp), &[0; 2000]);
        assert_eq!(
            ipv4_fragment_count(&pkt, 1280),
            Err(FragmentError::DontFragment)
        );
        let mut p = pkt.clone();
        p[6] = 0;
        crate::rewrite::testutil::fix_ipv4_checksum(&mut p);
        assert_eq!(
            ipv4_fragment_count(&p, 24),
            Err(FragmentError::MtuTooSmall(24))
        );
        assert_eq!(
            ipv4_fragment_count(
                &build_tuple(&Endpoints::v6().dnat(Protocol::Udp), b"x"),
                1280
            ),
            Err(FragmentError::NotIpv4)
        );
    }
}
