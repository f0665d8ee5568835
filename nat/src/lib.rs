//! kxp's Service model and the decisions kube-proxy makes for a new connection.
//!
//! Pure logic in the manner of quinn-proto: no I/O, no clock (time is an argument), no
//! threads, no unsafe. The dataplane feeds it packets and a snapshot; the control plane
//! builds the snapshot from Kubernetes objects.
#![forbid(unsafe_code)]

pub mod rewrite;
pub mod tuple;

pub use tuple::{Protocol, Tuple};
