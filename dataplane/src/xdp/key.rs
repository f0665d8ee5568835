//! [`SteerKey`]: the `(address, port, protocol)` keys of `frontends` and `endpoints`, and
//! the byte layouts of every key the loader writes.

use std::fmt;
use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use nat::tuple::Protocol;

use super::sync::MapKey;

/// One `(address, port, protocol)` entry of `frontends` or `endpoints`.
///
/// IPv4-mapped IPv6 addresses are stored as IPv4, so that `::ffff:a.b.c.d` and
/// `a.b.c.d` are the same key (they are the same bytes in the map).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SteerKey {
    addr: IpAddr,
    port: u16,
    proto: Protocol,
}

impl SteerKey {
    pub fn new(addr: IpAddr, port: u16, proto: Protocol) -> SteerKey {
        SteerKey {
            addr: addr.to_canonical(),
            port,
            proto,
        }
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn proto(&self) -> Protocol {
        self.proto
    }

    /// The 20-byte `struct steer_key`: 16 address bytes (IPv6, or `::ffff:a.b.c.d`), the
    /// port in network byte order, the protocol number, one zero pad byte.
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut k = [0u8; 20];
        k[..16].copy_from_slice(&addr_bytes(self.addr));
        k[16..18].copy_from_slice(&self.port.to_be_bytes());
        k[18] = self.proto.number();
        k
    }
}

impl fmt::Display for SteerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.addr {
            IpAddr::V4(a) => write!(f, "{a}:{}/{}", self.port, self.proto),
            IpAddr::V6(a) => write!(f, "[{a}]:{}/{}", self.port, self.proto),
        }
    }
}

impl MapKey for SteerKey {
    type Bytes = [u8; 20];
    fn to_bytes(&self) -> [u8; 20] {
        SteerKey::to_bytes(self)
    }
}

impl MapKey for IpAddr {
    type Bytes = [u8; 16];
    fn to_bytes(&self) -> [u8; 16] {
        addr_bytes(*self)
    }
}

/// The 20-byte `struct lpm_key` of `service_cidrs`: the prefix length (host byte order),
/// then the address as in [`addr_bytes`]; an IPv4 prefix is stored v4-mapped, its length
/// plus 96.
impl MapKey for IpNet {
    type Bytes = [u8; 20];
    fn to_bytes(&self) -> [u8; 20] {
        let prefix_len = match self {
            IpNet::V4(n) => u32::from(n.prefix_len()) + 96,
            IpNet::V6(n) => u32::from(n.prefix_len()),
        };
        let mut k = [0u8; 20];
        k[..4].copy_from_slice(&prefix_len.to_ne_bytes());
        k[4..].copy_from_slice(&addr_bytes(self.addr()));
        k
    }
}

/// `net` as `service_cidrs` holds it: host bits cleared (the trie would take
/// `10.0.0.1/8` and `10.0.0.0/8` for the same entry), and an IPv4-mapped IPv6 prefix of
/// length 96 or more as its IPv4 prefix (the same bytes in the map).
pub(super) fn canonical_net(net: IpNet) -> IpNet {
    if let IpNet::V6(n) = net
        && let Some(v4) = n.addr().to_ipv4_mapped()
        && let Some(len) = n.prefix_len().checked_sub(96)
        && let Ok(n4) = Ipv4Net::new(v4, len)
    {
        return IpNet::V4(n4.trunc());
    }
    net.trunc()
}

/// The smallest IPv4 and IPv6 prefixes holding every net of `nets` of their family
/// (`None`: no net of that family). IPv4-mapped IPv6 nets must be canonical (IPv4).
pub(super) fn covers(nets: &[IpNet]) -> (Option<Ipv4Net>, Option<Ipv6Net>) {
    let cover = |v6: bool| {
        nets.iter()
            .filter(|n| matches!(n, IpNet::V6(_)) == v6)
            .map(IpNet::trunc)
            .reduce(|c, n| {
                // Both of one family: the bits they share, counted in a 128-bit word.
                let bits = |net: IpNet| match net.network() {
                    IpAddr::V4(a) => u128::from(a.to_bits()) << 96,
                    IpAddr::V6(a) => a.to_bits(),
                };
                let shared = (bits(c) ^ bits(n)).leading_zeros() as u8;
                let len = c.prefix_len().min(n.prefix_len()).min(shared);
                IpNet::new(c.network(), len).map_or(c, |m| m.trunc())
            })
    };
    let v4 = match cover(false) {
        Some(IpNet::V4(n)) => Some(n),
        _ => None,
    };
    let v6 = match cover(true) {
        Some(IpNet::V6(n)) => Some(n),
        _ => None,
    };
    (v4, v6)
}

pub(super) fn addr_bytes(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}
