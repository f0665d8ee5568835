//! kxp's wire code, a leaf that the connection table and the dataplane depend on without
//! the Service model or any Kubernetes type:
//!
//! - [`tuple`]: a flow's five-tuple and its protocol;
//! - [`rewrite`]: parsing a packet once and rewriting its headers with incremental
//!   checksums (NAT, ICMP errors, fragments, REJECT answers);
//! - [`hash`]: stable hashes of addresses (the same on every node and every run).
//!
//! Pure: no I/O, no clock, no unsafe.
#![forbid(unsafe_code)]

pub mod hash;
pub mod rewrite;
pub mod tuple;

pub use tuple::{Protocol, Tuple};
