//! Flows per endpoint across the whole node, for the least-connection schedulers (IPVS's
//! `lc`, `wlc`, `sed`, `nq`), which weigh an endpoint by its connections on the node,
//! not on one worker.
//!
//! Kept up to date by the connection tables themselves (a table given a load with
//! [`crate::ConnTable::set_load`] adds one when it inserts a flow and takes one away
//! when the flow goes, whatever removes it), so reading an endpoint's count is one hash
//! lookup: O(1) per candidate, O(endpoints) per new connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};

use dashmap::DashMap;

/// Live flows per endpoint, shared by every worker's table.
#[derive(Debug, Default)]
pub struct EndpointLoad {
    flows: DashMap<SocketAddr, AtomicU32>,
}

impl EndpointLoad {
    /// An empty load.
    pub fn new() -> EndpointLoad {
        EndpointLoad::default()
    }

    /// Flows to `endpoint` now.
    pub fn get(&self, endpoint: SocketAddr) -> u32 {
        self.flows
            .get(&endpoint)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    pub(crate) fn add(&self, endpoint: SocketAddr) {
        if let Some(c) = self.flows.get(&endpoint) {
            c.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.flows
            .entry(endpoint)
            .or_default()
            .fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn sub(&self, endpoint: SocketAddr) {
        let now_zero = match self.flows.get(&endpoint) {
            Some(c) => c
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1))
                .is_ok_and(|v| v == 1),
            None => false,
        };
        if now_zero {
            // Under the shard's write lock: an `add` that came in between keeps it.
            self.flows
                .remove_if(&endpoint, |_, c| c.load(Ordering::Relaxed) == 0);
        }
    }

    /// Endpoints with at least one flow.
    pub fn endpoints(&self) -> usize {
        self.flows.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn counts_across_threads_and_forgets_idle_endpoints() {
        let load = Arc::new(EndpointLoad::new());
        let a: SocketAddr = "198.18.1.1:80".parse().unwrap();
        let b: SocketAddr = "198.18.1.2:80".parse().unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let load = load.clone();
                std::thread::spawn(move || {
                    for i in 0..10_000 {
                        load.add(a);
                        load.add(b);
                        if i % 2 == 0 {
                            load.sub(b);
                        }
                        load.sub(a);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(load.get(a), 0);
        assert_eq!(load.get(b), 20_000);
        assert_eq!(load.endpoints(), 1, "an endpoint at zero is dropped");
        load.sub(a); // never below zero
        assert_eq!(load.get(a), 0);
    }
}
