//! The 5-tuple that names one direction of a flow.
//!
//! Shared by the decision logic, the header rewrite and the connection table, so that a
//! packet parsed by `rewrite` can be looked up in `conntrack` without conversion.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

/// Transport protocols kxp translates (kube-proxy's Service protocols).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// IANA protocol number, as carried in the IPv4 protocol / IPv6 next-header field.
    pub const fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    /// The protocol for an IANA number, if kxp translates it.
    pub const fn from_number(n: u8) -> Option<Protocol> {
        match n {
            6 => Some(Protocol::Tcp),
            17 => Some(Protocol::Udp),
            132 => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// Kubernetes spelling: `TCP`, `UDP`, `SCTP`.
    pub const fn as_k8s(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }

    /// Parses the Kubernetes spelling (case-insensitive).
    pub fn parse(s: &str) -> Option<Protocol> {
        match s.to_ascii_uppercase().as_str() {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_k8s())
    }
}

/// One direction of a flow: source and destination address and port, and protocol.
///
/// Both addresses are always of the same family in a well-formed tuple.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tuple {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub proto: Protocol,
}

impl Tuple {
    pub const fn new(src: SocketAddr, dst: SocketAddr, proto: Protocol) -> Tuple {
        Tuple {
            src: src.ip(),
            dst: dst.ip(),
            sport: src.port(),
            dport: dst.port(),
            proto,
        }
    }

    /// The same flow seen from the other end (source and destination swapped).
    pub const fn reversed(&self) -> Tuple {
        Tuple {
            src: self.dst,
            dst: self.src,
            sport: self.dport,
            dport: self.sport,
            proto: self.proto,
        }
    }

    pub const fn src_addr(&self) -> SocketAddr {
        SocketAddr::new(self.src, self.sport)
    }

    pub const fn dst_addr(&self) -> SocketAddr {
        SocketAddr::new(self.dst, self.dport)
    }
}

impl fmt::Display for Tuple {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} -> {}",
            self.proto,
            self.src_addr(),
            self.dst_addr()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reversed_twice_is_identity() {
        let t = Tuple::new(
            "198.18.0.1:40000".parse().unwrap(),
            "198.19.0.10:80".parse().unwrap(),
            Protocol::Tcp,
        );
        assert_eq!(t.reversed().reversed(), t);
        assert_eq!(t.reversed().src_addr(), t.dst_addr());
    }

    #[test]
    fn protocol_numbers_round_trip() {
        for p in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
            assert_eq!(Protocol::from_number(p.number()), Some(p));
            assert_eq!(Protocol::parse(&p.as_k8s().to_lowercase()), Some(p));
        }
        assert_eq!(Protocol::from_number(1), None);
    }
}
