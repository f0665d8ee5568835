//! Which endpoints each traffic policy may use on this node: kube-proxy's
//! `CategorizeEndpoints` (`pkg/proxy/topology.go`), rule for rule.
//!
//! "Usable" means Ready by default, falling back to Serving+Terminating endpoints
//! (independently for Cluster and Local policy) when nothing is Ready. Topology comes from
//! the endpoints' hints, which the EndpointSlice controller sets for
//! `trafficDistribution: PreferSameZone/PreferSameNode` (and the older topology-aware
//! hints): kube-proxy reads only the hints, never the Service field, and so does kxp.

use crate::model::{Categorized, Endpoint, Topology};

/// The inputs of categorisation besides the endpoints themselves.
#[derive(Debug, Clone, Copy)]
pub struct PolicyUse {
    pub uses_cluster: bool,
    pub uses_local: bool,
}

/// Categorises `endpoints` (already sorted) for a node named `node_name` in `zone`.
pub fn categorize(
    endpoints: &[Endpoint],
    policy: PolicyUse,
    node_name: &str,
    zone: Option<&str>,
) -> Categorized {
    let mut out = Categorized {
        equal_weights: endpoints.windows(2).all(|w| w[0].weight == w[1].weight),
        ..Categorized::default()
    };
    let zone = zone.unwrap_or("");

    if policy.uses_cluster {
        out.topology = topology_mode(endpoints, node_name, zone);
        out.cluster = indices(endpoints, |ep| {
            ep.ready && available_for_topology(ep, out.topology, node_name, zone)
        });
        // No ready endpoint anywhere (topology would have been dropped otherwise):
        // fall back to the serving, terminating ones.
        if out.cluster.is_empty() {
            out.cluster = indices(endpoints, |ep| ep.serving && ep.terminating);
        }
        if !out.cluster.is_empty() {
            out.has_endpoints = true;
        }
    }

    if !policy.uses_local {
        return out;
    }

    let mut local_ready = false;
    let mut local_serving_terminating = false;
    for ep in endpoints {
        if ep.ready {
            out.has_endpoints = true;
            local_ready |= ep.is_local;
        } else if ep.serving && ep.terminating {
            out.has_endpoints = true;
            local_serving_terminating |= ep.is_local;
        }
    }
    if local_ready {
        out.local = indices(endpoints, |ep| ep.is_local && ep.ready);
    } else if local_serving_terminating {
        out.local = indices(endpoints, |ep| ep.is_local && ep.serving && ep.terminating);
    }
    out
}

fn indices(endpoints: &[Endpoint], keep: impl Fn(&Endpoint) -> bool) -> Vec<u32> {
    endpoints
        .iter()
        .enumerate()
        .filter(|(_, ep)| keep(ep))
        .map(|(i, _)| i as u32)
        .collect()
}

/// kube-proxy's `topologyModeFromHints` with the PreferSameTrafficDistribution gate on
/// (beta and enabled by default since Kubernetes 1.34).
fn topology_mode(endpoints: &[Endpoint], node_name: &str, zone: &str) -> Topology {
    let mut has_for_node = false;
    let mut all_have_node_hints = true;
    let mut has_for_zone = false;
    let mut all_have_zone_hints = true;
    for ep in endpoints.iter().filter(|ep| ep.ready) {
        if ep.node_hints.is_empty() {
            all_have_node_hints = false;
        } else if ep.node_hints.iter().any(|n| n == node_name) {
            has_for_node = true;
        }
        if ep.zone_hints.is_empty() {
            all_have_zone_hints = false;
        } else if ep.zone_hints.iter().any(|z| z == zone) {
            has_for_zone = true;
        }
    }
    if all_have_node_hints && has_for_node {
        return Topology::PreferSameNode;
    }
    if all_have_zone_hints && has_for_zone {
        return Topology::PreferSameZone;
    }
    Topology::None
}

fn available_for_topology(ep: &Endpoint, mode: Topology, node_name: &str, zone: &str) -> bool {
    match mode {
        Topology::None => true,
        Topology::PreferSameNode => ep.node_hints.iter().any(|n| n == node_name),
        Topology::PreferSameZone => ep.zone_hints.iter().any(|z| z == zone),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(ip: &str, local: bool, ready: bool, serving: bool, terminating: bool) -> Endpoint {
        Endpoint {
            addr: format!("{ip}:80").parse().unwrap(),
            is_local: local,
            ready,
            serving,
            terminating,
            zone_hints: vec![],
            node_hints: vec![],
            weight: 1,
        }
    }

    fn zoned(mut e: Endpoint, zones: &[&str]) -> Endpoint {
        e.zone_hints = zones.iter().map(|z| z.to_string()).collect();
        e
    }

    fn noded(mut e: Endpoint, nodes: &[&str]) -> Endpoint {
        e.node_hints = nodes.iter().map(|z| z.to_string()).collect();
        e
    }

    const CLUSTER: PolicyUse = PolicyUse {
        uses_cluster: true,
        uses_local: false,
    };
    const LOCAL: PolicyUse = PolicyUse {
        uses_cluster: false,
        uses_local: true,
    };
    const BOTH: PolicyUse = PolicyUse {
        uses_cluster: true,
        uses_local: true,
    };

    #[test]
    fn cluster_uses_ready_endpoints_only() {
        let eps = [
            ep("10.0.0.1", false, true, true, false),
            ep("10.0.0.2", false, false, false, false),
            ep("10.0.0.3", false, false, true, true),
        ];
        let c = categorize(&eps, CLUSTER, "n", None);
        assert_eq!(c.cluster, vec![0]);
        assert!(c.has_endpoints);
        assert!(c.local.is_empty());
        assert!(c.equal_weights);
    }

    #[test]
    fn one_other_weight_makes_the_weights_unequal() {
        let mut eps = [
            ep("10.0.0.1", false, true, true, false),
            ep("10.0.0.2", false, true, true, false),
        ];
        eps[1].weight = 3;
        assert!(!categorize(&eps, CLUSTER, "n", None).equal_weights);
        assert!(categorize(&eps[..1], CLUSTER, "n", None).equal_weights);
    }

    #[test]
    fn cluster_falls_back_to_serving_terminating() {
        let eps = [
            ep("10.0.0.1", false, false, true, true),
            ep("10.0.0.2", false, false, false, true),
            ep("10.0.0.3", false, false, false, false),
        ];
        let c = categorize(&eps, CLUSTER, "n", None);
        assert_eq!(c.cluster, vec![0]);
        assert!(c.has_endpoints);
    }

    #[test]
    fn nothing_usable_means_no_endpoints() {
        let eps = [ep("10.0.0.1", false, false, false, true)];
        let c = categorize(&eps, BOTH, "n", None);
        assert!(c.cluster.is_empty() && c.local.is_empty());
        assert!(!c.has_endpoints);
    }

    #[test]
    fn local_prefers_ready_then_terminating() {
        let eps = [
            ep("10.0.0.1", true, false, true, true),
            ep("10.0.0.2", true, true, true, false),
            ep("10.0.0.3", false, true, true, false),
        ];
        let c = categorize(&eps, LOCAL, "n", None);
        assert_eq!(c.local, vec![1]);
        let eps = [
            ep("10.0.0.1", true, false, true, true),
            ep("10.0.0.3", false, true, true, false),
        ];
        let c = categorize(&eps, LOCAL, "n", None);
        assert_eq!(c.local, vec![0]);
        assert!(c.has_endpoints);
    }

    #[test]
    fn local_policy_without_local_endpoints_still_knows_remote_ones() {
        let eps = [ep("10.0.0.3", false, true, true, false)];
        let c = categorize(&eps, LOCAL, "n", None);
        assert!(c.local.is_empty());
        assert!(c.has_endpoints);
    }

    #[test]
    fn zone_hints_used_only_when_every_ready_endpoint_has_one() {
        let eps = [
            zoned(ep("10.0.0.1", false, true, true, false), &["a"]),
            zoned(ep("10.0.0.2", false, true, true, false), &["b"]),
        ];
        let c = categorize(&eps, CLUSTER, "n", Some("a"));
        assert_eq!(c.topology, Topology::PreferSameZone);
        assert_eq!(c.cluster, vec![0]);

        let eps = [
            zoned(ep("10.0.0.1", false, true, true, false), &["a"]),
            ep("10.0.0.2", false, true, true, false),
        ];
        let c = categorize(&eps, CLUSTER, "n", Some("a"));
        assert_eq!(c.topology, Topology::None);
        assert_eq!(c.cluster, vec![0, 1]);
    }

    #[test]
    fn zone_hints_ignored_when_none_for_our_zone_or_no_zone_label() {
        let eps = [
            zoned(ep("10.0.0.1", false, true, true, false), &["a"]),
            zoned(ep("10.0.0.2", false, true, true, false), &["b"]),
        ];
        assert_eq!(
            categorize(&eps, CLUSTER, "n", Some("c")).cluster,
            vec![0, 1]
        );
        assert_eq!(categorize(&eps, CLUSTER, "n", None).cluster, vec![0, 1]);
    }

    #[test]
    fn unready_endpoints_do_not_need_hints() {
        let eps = [
            zoned(ep("10.0.0.1", false, true, true, false), &["a"]),
            ep("10.0.0.2", false, false, false, false),
        ];
        let c = categorize(&eps, CLUSTER, "n", Some("a"));
        assert_eq!(c.topology, Topology::PreferSameZone);
        assert_eq!(c.cluster, vec![0]);
    }

    #[test]
    fn node_hints_win_over_zone_hints() {
        let eps = [
            noded(
                zoned(ep("10.0.0.1", true, true, true, false), &["a"]),
                &["n"],
            ),
            noded(
                zoned(ep("10.0.0.2", false, true, true, false), &["a"]),
                &["m"],
            ),
        ];
        let c = categorize(&eps, CLUSTER, "n", Some("a"));
        assert_eq!(c.topology, Topology::PreferSameNode);
        assert_eq!(c.cluster, vec![0]);
        // No endpoint for this node: fall back to zone hints.
        let c = categorize(&eps, CLUSTER, "x", Some("a"));
        assert_eq!(c.topology, Topology::PreferSameZone);
        assert_eq!(c.cluster, vec![0, 1]);
    }
}
