//! Throw-away network topologies for `kxp demo`, the end-to-end tests and the macro
//! benchmark: the dataplane's one lab, [`dataplane::lab`], re-exported here so that they
//! all build the same kind of namespaces and veths (kernel defaults, removed on drop,
//! stale ones of dead runs swept).

pub use dataplane::lab::{Topology, in_ns, ip, run};
