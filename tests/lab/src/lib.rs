//! kxp's one test lab, a test-support crate used by `kxp demo`, the tests of every crate
//! and the benchmarks (no production crate's API holds it):
//!
//! - [`topology`]: throw-away network namespaces joined by veth pairs, with the kernel's
//!   defaults, removed on drop;
//! - [`web`]: the lab's `web` Service (its state file) and its backends' servers;
//! - [`process`]: a `kxp run` process in a namespace, its health, threads run there.
#![forbid(unsafe_code)]

pub mod process;
pub mod topology;
pub mod web;

pub use process::{KxpProcess, healthz_ok, join, spawn_in, wait_healthy};
pub use topology::{Topology, enter_netns, in_ns, ip, is_root, node_command, run};
pub use web::{Backend, VIP, http_get, http_get_on, state_yaml, state_yaml_with};
