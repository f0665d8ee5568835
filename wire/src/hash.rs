//! Stable hashes of bytes and addresses: FNV-1a folded through a SplitMix64 finaliser,
//! the same on every node and every run (unlike std's randomised hasher), for endpoint
//! choice and flow ownership.

use std::net::IpAddr;

/// A stable 64-bit hash (FNV-1a folded through a SplitMix64 finaliser): the same on every
/// node and every run, unlike std's randomised hasher.
pub fn hash_bytes(bytes: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// `ip`'s bytes (4 or 16) at the start of `out`; returns how many.
pub fn ip_bytes(ip: IpAddr, out: &mut [u8; 16]) -> usize {
    match ip {
        IpAddr::V4(v4) => {
            out[..4].copy_from_slice(&v4.octets());
            4
        }
        IpAddr::V6(v6) => {
            out.copy_from_slice(&v6.octets());
            16
        }
    }
}

pub fn hash_ip(ip: IpAddr, seed: u64) -> u64 {
    let mut b = [0u8; 16];
    let n = ip_bytes(ip, &mut b);
    hash_bytes(&b[..n], seed)
}
