//! The header rewrite: parse an untrusted IP packet, translate it in place, and build the
//! replies kxp sends itself.
//!
//! Buffers start at the IP header (the dataplane strips or keeps Ethernet itself).
//!
//! - [`parse`] checks every length once, smoltcp style: the IPv4 / IPv6 header
//!   (extension headers stepped over), then TCP, UDP, SCTP, or an ICMP error quoting one
//!   of them. Fields are read at byte offsets kept in private `field` modules, never
//!   through `#[repr(C)]` casts. A bad packet is an [`ParseError`] to count, never a
//!   panic.
//! - [`rewrite`] is the per-packet fast path: it writes only the addresses and ports
//!   that change and patches the IPv4 header and TCP/UDP checksums incrementally
//!   (RFC 1624) instead of summing the payload again. SCTP's CRC32c is not a sum: it is
//!   recomputed when a port changes (its addresses are not covered).
//! - [`rewrite_icmp_error`] translates an ICMP error about a translated flow, quote
//!   included, so that path-MTU discovery and "connection refused" reach the client.
//! - [`decrement_ttl`] is the router's TTL / hop-limit step.
//! - [`build_tcp_rst`] and [`build_icmp_port_unreachable`] build the replies of a
//!   Service whose policy is to reject.
//!
//! Nothing here allocates, does I/O or reads a clock.

mod checksum;
mod fragment;
mod icmp;
mod ip;
mod ipv4;
mod ipv6;
mod l4;
mod parse;
mod reply;
mod translate;

/// Real packets for tests (built with etherparse) and checksum checks; also for other
/// crates' tests through the `test-util` feature.
#[cfg(any(test, feature = "test-util"))]
pub mod testutil;

pub use fragment::{FragmentError, ipv4_fragment_count, write_ipv4_fragment};
pub use icmp::rewrite_icmp_error;
pub use l4::tcp_flags;
pub use parse::{
    FlowPacket, FragInfo, FragKey, FragmentPacket, IcmpErrorPacket, ParseError, Parsed,
    Untranslatable, may_be_fragment, parse,
};
pub use reply::{BuildError, build_icmp_port_unreachable, build_icmp_too_big, build_tcp_rst};
pub use translate::{RewriteError, complete_checksum, decrement_ttl, rewrite, rewrite_fragment};
