//! Kubernetes objects read into kxp's Service model ([`nat`]), and kube-proxy's change
//! tracking. This is the control plane's side of the model: the packet path (`nat`'s
//! decisions, `conntrack`, the dataplane) compiles no Kubernetes type.
//!
//! - [`k8s`]: Services, EndpointSlices, Nodes and ServiceCIDRs read into Service ports
//!   and endpoints, as kube-proxy reads them (`ServiceChangeTracker`,
//!   `EndpointsChangeTracker`), with the node's settings;
//! - [`slice`]: an EndpointSlice as kxp holds it (what kube-proxy reads, decoded from
//!   the API's JSON);
//! - [`sloppy`]: kube-proxy's lenient address parsing;
//! - [`tracker`]: kube-proxy's change tracking: rebuild only what changed, RCU snapshots;
//! - [`policy`]: NetworkPolicy objects read into `nat::policy`'s model.
#![forbid(unsafe_code)]

pub mod k8s;
pub mod policy;
pub mod slice;
pub mod sloppy;
pub mod tracker;

/// kube-proxy's decisions, one test per rule, on Kubernetes objects written as YAML
/// (read here, decided by `nat`).
#[cfg(test)]
mod decide_tests;
