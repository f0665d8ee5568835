//! kxp's Service model and the decisions kube-proxy makes for a new connection.
//!
//! Pure logic in the manner of quinn-proto: no I/O, no clock (time is an argument), no
//! threads, no unsafe, no Kubernetes types. The dataplane feeds it packets and a
//! snapshot; the control plane builds the snapshot from Kubernetes objects (the
//! `translate` crate: kube-proxy's change tracking, the objects read into this model).
//!
//! - [`model`]: Service ports, endpoints and the node, per IP family, as kube-proxy holds them;
//! - [`topology`]: which endpoints each traffic policy may use (`CategorizeEndpoints`);
//! - [`snapshot`]: the immutable, indexed view a worker decides with;
//! - [`snapshot`]'s [`Indexer`](snapshot::Indexer): what a change rebuilds, RCU snapshots;
//! - [`decide`]: forward / reject / drop / pass and masquerade, check by check;
//! - [`select`]: random, affinity, Maglev and the IPVS schedulers;
//! - [`policy`]: NetworkPolicy decisions;
//! - [`rewrite`]: the header rewrite with incremental checksums (the `wire` crate's,
//!   re-exported).
#![forbid(unsafe_code)]

pub mod decide;
pub mod model;
pub mod policy;
pub mod select;
pub mod snapshot;
pub mod topology;

pub use decide::{Decision, DropReason, Forward, NewPacket, Policy, RejectReason, decide};
pub use snapshot::{FrontendKind, Snapshot};
pub use wire::{Protocol, Tuple, rewrite, tuple};
