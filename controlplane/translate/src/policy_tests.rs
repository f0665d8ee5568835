//! NetworkPolicy decisions against upstream's truth tables.
//!
//! The corpus below is written from Kubernetes' own NetworkPolicy e2e suite,
//! `test/e2e/network/netpol/network_policy.go` (kubernetes/kubernetes), whose cases each
//! create pods `x/a`, `x/b`, ... (label `pod: NAME`, namespaces labelled
//! `kubernetes.io/metadata.name: NS`), serving ports 80 and 81 TCP and UDP under the
//! container port names `serve-80-tcp`, `serve-81-tcp`, `serve-80-udp`, `serve-81-udp`,
//! apply policies, and check every pair of pods against an expected reachability matrix
//! (loopback pairs ignored, as upstream's `ignoreLoopback`). Each case here names its
//! upstream test and gives its policies and matrix (as a rule over `from`, `to`).
//! Upstream's helpers (`SetSpecIngressRules`, `SetSpecEgressRules`) set `policyTypes` to
//! the directions given; the specs below say the same where the default would differ.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::*;
use nat::policy::{Decision, Direction, Peer, Policies};

/// `ns/pod` pods with upstream's labels, ports and made-up addresses.
fn pods(names: &[&str]) -> Vec<(Pod, Labels)> {
    names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let (ns, name) = n.split_once('/').unwrap();
            let mut named_ports = Vec::new();
            for port in [80, 81] {
                named_ports.push((format!("serve-{port}-tcp"), port, Protocol::Tcp));
                named_ports.push((format!("serve-{port}-udp"), port, Protocol::Udp));
            }
            let pod = Pod {
                namespace: ns.to_string(),
                name: name.to_string(),
                labels: BTreeMap::from([("pod".to_string(), name.to_string())]),
                ips: vec![IpAddr::from([10, 0, 0, i as u8 + 1])],
                named_ports,
            };
            let ns_labels =
                BTreeMap::from([("kubernetes.io/metadata.name".to_string(), ns.to_string())]);
            (pod, ns_labels)
        })
        .collect()
}

/// A NetworkPolicy `name` in `ns` with this spec (YAML).
fn policy(ns: &str, name: &str, spec: &str) -> Policy {
    let text = format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n{spec}"
    );
    let np: NetworkPolicy = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    read_policy(&np).unwrap()
}

/// Whether `from` may reach `to` (pods as `ns/name`).
type Reach = fn(&str, &str) -> bool;

struct Case {
    /// Upstream's test name.
    name: &'static str,
    pods: &'static [&'static str],
    /// (namespace, name, spec).
    policies: &'static [(&'static str, &'static str, &'static str)],
    /// Port and protocol checked, and whether `from` may reach `to` there.
    checks: &'static [(u16, Protocol, Reach)],
}

fn to_x(t: &str) -> bool {
    t.starts_with("x/")
}

const CASES: &[Case] = &[
    Case {
        name: "should support a 'default-deny-ingress' policy",
        pods: &["x/a", "x/b", "y/a", "y/b"],
        policies: &[(
            "x",
            "deny-ingress",
            "  podSelector: {}\n  policyTypes: [Ingress]\n",
        )],
        checks: &[(80, Protocol::Tcp, |_, t| !to_x(t))],
    },
    Case {
        name: "should support a 'default-deny-all' policy",
        pods: &["x/a", "x/b", "y/a"],
        policies: &[(
            "x",
            "deny-all",
            "  podSelector: {}\n  policyTypes: [Ingress, Egress]\n",
        )],
        checks: &[(80, Protocol::Tcp, |f, t| !to_x(t) && !to_x(f))],
    },
    Case {
        name: "should enforce policy to allow traffic from pods within server namespace based on PodSelector",
        pods: &["x/a", "x/b", "x/c", "y/a"],
        policies: &[(
            "x",
            "x-a-allows-x-b",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{podSelector: {matchLabels: {pod: b}}}]}]\n",
        )],
        checks: &[(80, Protocol::Tcp, |f, t| t != "x/a" || f == "x/b")],
    },
    Case {
        name: "should enforce policy to allow ingress traffic for a target",
        pods: &["x/a", "x/b", "y/a"],
        policies: &[
            (
                "x",
                "deny-all",
                "  podSelector: {}\n  policyTypes: [Ingress]\n",
            ),
            (
                "x",
                "allow-all-to-a",
                "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{podSelector: {}, namespaceSelector: {}}]}]\n",
            ),
        ],
        checks: &[(80, Protocol::Tcp, |_, t| t != "x/b")],
    },
    Case {
        name: "should enforce policy to allow ingress traffic from pods in all namespaces",
        pods: &["x/a", "x/b", "y/a", "z/a"],
        policies: &[(
            "x",
            "allow-from-another-ns",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {}}}]}]\n",
        )],
        checks: &[(80, Protocol::Tcp, |_, _| true)],
    },
    Case {
        name: "should enforce policy to allow traffic only from a different namespace, based on NamespaceSelector",
        pods: &["x/a", "x/b", "y/a", "z/a"],
        policies: &[(
            "x",
            "allow-client-a-via-ns-selector",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}]}]\n",
        )],
        checks: &[(80, Protocol::Tcp, |f, t| t != "x/a" || f.starts_with("y/"))],
    },
    Case {
        name: "should enforce policy based on PodSelector with MatchExpressions",
        pods: &["x/a", "x/b", "y/a"],
        policies: &[(
            "x",
            "x-a-allows-x-b",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{podSelector: {matchExpressions: [{key: pod, operator: In, values: [b]}]}}]}]\n",
        )],
        checks: &[(80, Protocol::Tcp, |f, t| t != "x/a" || f == "x/b")],
    },
    Case {
        name: "should enforce policy based on NamespaceSelector with MatchExpressions",
        pods: &["x/a", "x/b", "y/a", "z/a"],
        policies: &[(
            "x",
            "allow-ns-y-match-selector",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: In, values: [y]}]}}]}]\n",
        )],
        checks: &[(80, Protocol::Tcp, |f, t| t != "x/a" || f.starts_with("y/"))],
    },
    Case {
        name: "should enforce policy based on PodSelector or NamespaceSelector",
        pods: &["x/a", "x/b", "x/c", "y/a"],
        policies: &[(
            "x",
            "allow-ns-y-match-selector",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [x]}]}}, {podSelector: {matchLabels: {pod: b}}}]}]\n",
        )],
        checks: &[(80, Protocol::Tcp, |f, t| !(t == "x/a" && f == "x/c"))],
    },
    Case {
        name: "should enforce policy based on PodSelector and NamespaceSelector",
        pods: &["x/a", "x/b", "y/a", "y/b", "z/b"],
        policies: &[(
            "x",
            "allow-ns-y-podselector-and-nsselector",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [x]}]}, podSelector: {matchLabels: {pod: b}}}]}]\n",
        )],
        checks: &[(80, Protocol::Tcp, |f, t| {
            t != "x/a" || f == "y/b" || f == "z/b"
        })],
    },
    Case {
        name: "should enforce policy based on Multiple PodSelectors and NamespaceSelectors",
        pods: &["x/a", "x/b", "y/a", "y/b", "y/c"],
        policies: &[(
            "x",
            "allow-ns-y-z-pod-b-c",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [x]}]}, podSelector: {matchExpressions: [{key: pod, operator: In, values: [b, c]}]}}]}]\n",
        )],
        checks: &[(80, Protocol::Tcp, |f, t| {
            t != "x/a" || !(f.starts_with("x/") || f == "y/a")
        })],
    },
    Case {
        name: "should enforce policy based on any PodSelectors",
        pods: &["x/a", "x/b", "x/c"],
        policies: &[(
            "x",
            "allow-ns-x-pod-b-c",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{podSelector: {matchLabels: {pod: b}}}, {podSelector: {matchLabels: {pod: c}}}]}]\n",
        )],
        checks: &[(80, Protocol::Tcp, |f, t| {
            t != "x/a" || f == "x/b" || f == "x/c"
        })],
    },
    Case {
        name: "should enforce policy to allow traffic only from a pod in a different namespace based on PodSelector and NamespaceSelector",
        pods: &["x/a", "x/b", "y/a", "y/b", "z/a"],
        policies: &[(
            "x",
            "allow-ns-y-pod-a-via-namespace-pod-selector",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}, podSelector: {matchLabels: {pod: a}}}]}]\n",
        )],
        checks: &[(80, Protocol::Tcp, |f, t| t != "x/a" || f == "y/a")],
    },
    Case {
        name: "should enforce policy based on Ports",
        pods: &["x/a", "x/b", "y/a", "y/b", "z/a"],
        policies: &[(
            "x",
            "allow-client-a-via-ns-selector",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}], ports: [{port: 81, protocol: TCP}]}]\n",
        )],
        checks: &[(81, Protocol::Tcp, |f, t| t != "x/a" || f.starts_with("y/"))],
    },
    Case {
        name: "should enforce multiple, stacked policies with overlapping podSelectors (first policy only)",
        pods: &["x/a", "x/b", "y/a", "y/b", "z/a"],
        policies: &[(
            "x",
            "allow-client-a-via-ns-selector",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}], ports: [{port: 81, protocol: TCP}]}]\n",
        )],
        checks: &[
            (81, Protocol::Tcp, |f, t| t != "x/a" || f.starts_with("y/")),
            (80, Protocol::Tcp, |_, t| t != "x/a"),
        ],
    },
    Case {
        name: "should enforce multiple, stacked policies with overlapping podSelectors (both policies)",
        pods: &["x/a", "x/b", "y/a", "y/b", "z/a"],
        policies: &[
            (
                "x",
                "allow-client-a-via-ns-selector",
                "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}], ports: [{port: 81, protocol: TCP}]}]\n",
            ),
            (
                "x",
                "allow-client-a-via-ns-selector-80",
                "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}], ports: [{port: 80, protocol: TCP}]}]\n",
            ),
        ],
        checks: &[
            (81, Protocol::Tcp, |f, t| t != "x/a" || f.starts_with("y/")),
            (80, Protocol::Tcp, |f, t| t != "x/a" || f.starts_with("y/")),
        ],
    },
    Case {
        name: "should support allow-all policy",
        pods: &["x/a", "x/b", "y/a"],
        policies: &[("x", "allow-all", "  podSelector: {}\n  ingress: [{}]\n")],
        checks: &[
            (80, Protocol::Tcp, |_, _| true),
            (81, Protocol::Tcp, |_, _| true),
        ],
    },
    Case {
        name: "should allow ingress access on one named port",
        pods: &["x/a", "x/b", "y/a"],
        policies: &[(
            "x",
            "allow-all",
            "  podSelector: {}\n  ingress: [{ports: [{port: serve-81-tcp}]}]\n",
        )],
        checks: &[
            (81, Protocol::Tcp, |_, _| true),
            (80, Protocol::Tcp, |_, t| !to_x(t)),
        ],
    },
    Case {
        name: "should allow ingress access from namespace on one named port",
        pods: &["x/a", "x/b", "y/a", "z/a"],
        policies: &[(
            "x",
            "allow-client-a-via-ns-selector-80",
            "  podSelector: {matchLabels: {pod: a}}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}], ports: [{port: serve-80-tcp, protocol: TCP}]}]\n",
        )],
        checks: &[
            (80, Protocol::Tcp, |f, t| t != "x/a" || f.starts_with("y/")),
            (81, Protocol::Tcp, |_, t| t != "x/a"),
        ],
    },
    Case {
        name: "should allow egress access on one named port",
        pods: &["x/a", "y/a"],
        policies: &[(
            "x",
            "allow-egress",
            "  podSelector: {}\n  policyTypes: [Egress]\n  egress: [{ports: [{port: serve-80-tcp}]}]\n",
        )],
        checks: &[
            (80, Protocol::Tcp, |_, _| true),
            (81, Protocol::Tcp, |f, _| !to_x(f)),
        ],
    },
];

#[test]
fn upstream_truth_tables() {
    let mut failures = Vec::new();
    for case in CASES {
        let all = pods(case.pods);
        let policies = Policies {
            policies: case
                .policies
                .iter()
                .map(|(ns, name, spec)| policy(ns, name, spec))
                .collect(),
        };
        let id = |p: &Pod| format!("{}/{}", p.namespace, p.name);
        for &(port, proto, want) in case.checks {
            for (from, from_ns) in &all {
                for (to, to_ns) in &all {
                    if from == to {
                        continue; // upstream's ignoreLoopback
                    }
                    let src = Peer::Pod {
                        pod: from,
                        namespace_labels: from_ns,
                        ip: from.ips[0],
                    };
                    let dst = Peer::Pod {
                        pod: to,
                        namespace_labels: to_ns,
                        ip: to.ips[0],
                    };
                    let got = policies.allows(&src, &dst, port, proto);
                    let expected = want(&id(from), &id(to));
                    if got != expected {
                        failures.push(format!(
                            "{}: {} -> {} port {port}/{proto}: got {got}, upstream expects {expected}",
                            case.name,
                            id(from),
                            id(to)
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn ip_block_with_except_and_end_port_against_outside_addresses() {
    let all = pods(&["x/a"]);
    let (a, a_ns) = &all[0];
    let policies = Policies {
        policies: vec![policy(
            "x",
            "outside",
            "  podSelector: {}\n  ingress: [{from: [{ipBlock: {cidr: 192.0.2.0/24, except: [192.0.2.128/25]}}], \
             ports: [{port: 8000, endPort: 8010, protocol: UDP}]}]\n",
        )],
    };
    let dst = Peer::Pod {
        pod: a,
        namespace_labels: a_ns,
        ip: a.ips[0],
    };
    let from = |ip: [u8; 4]| Peer::External(IpAddr::from(ip));
    assert!(policies.allows(&from([192, 0, 2, 5]), &dst, 8005, Protocol::Udp));
    assert!(policies.allows(&from([192, 0, 2, 5]), &dst, 8010, Protocol::Udp));
    assert!(!policies.allows(&from([192, 0, 2, 5]), &dst, 8011, Protocol::Udp));
    assert!(!policies.allows(&from([192, 0, 2, 5]), &dst, 8005, Protocol::Tcp));
    assert!(
        !policies.allows(&from([192, 0, 2, 200]), &dst, 8005, Protocol::Udp),
        "except"
    );
    assert!(!policies.allows(&from([198, 51, 100, 1]), &dst, 8005, Protocol::Udp));
    let d = policies.decide(
        Direction::Ingress,
        a,
        &from([198, 51, 100, 1]),
        8005,
        Protocol::Udp,
    );
    assert_eq!(
        d,
        Decision::Denied {
            policies: vec!["x/outside".into()]
        }
    );
    let d = policies.decide(
        Direction::Ingress,
        a,
        &from([192, 0, 2, 1]),
        8000,
        Protocol::Udp,
    );
    assert_eq!(
        d,
        Decision::AllowedBy {
            policy: "x/outside".into(),
            rule: 0
        }
    );
    // An outside address is never a pod: a namespaceSelector or podSelector peer does not
    // match it, and a named port of an egress rule never matches a destination that is
    // not a pod.
    let p = Policies {
        policies: vec![policy(
            "x",
            "pods-only",
            "  podSelector: {}\n  policyTypes: [Ingress, Egress]\n  ingress: [{from: [{namespaceSelector: {}}]}]\n  egress: [{ports: [{port: serve-80-tcp}]}]\n",
        )],
    };
    assert!(!p.allows(&from([192, 0, 2, 5]), &dst, 80, Protocol::Tcp));
    let src = Peer::Pod {
        pod: a,
        namespace_labels: a_ns,
        ip: a.ips[0],
    };
    assert!(!p.allows(&src, &from([192, 0, 2, 5]), 80, Protocol::Tcp));
}

#[test]
fn bad_fields_are_errors_naming_the_field() {
    for (spec, field) in [
        (
            "  podSelector: {matchExpressions: [{key: a, operator: Maybe}]}\n",
            "spec.podSelector.matchExpressions[0].operator",
        ),
        (
            "  podSelector: {}\n  ingress: [{from: [{ipBlock: {cidr: 10.0.0.0/33}}]}]\n",
            "spec.ingress[0].from[0].ipBlock.cidr",
        ),
        (
            "  podSelector: {}\n  ingress: [{ports: [{port: 80, endPort: 70}]}]\n",
            "spec.ingress[0].ports[0].endPort",
        ),
        (
            "  podSelector: {}\n  egress: [{ports: [{protocol: ICMP}]}]\n",
            "spec.egress[0].ports[0].protocol",
        ),
        (
            "  podSelector: {}\n  policyTypes: [Sideways]\n",
            "spec.policyTypes[0]",
        ),
    ] {
        let text = format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: p, namespace: x}}\nspec:\n{spec}"
        );
        let np: NetworkPolicy = serde_yaml::from_str(&text).unwrap();
        let e = read_policy(&np).unwrap_err();
        assert_eq!(e.field, field, "{e}");
        assert_eq!(e.policy, "x/p");
    }
}

#[test]
fn policy_types_default_to_ingress_and_to_egress_when_there_are_egress_rules() {
    let all = pods(&["x/a", "y/a"]);
    let peer = |i: usize| Peer::Pod {
        pod: &all[i].0,
        namespace_labels: &all[i].1,
        ip: all[i].0.ips[0],
    };
    // Egress rules and no policyTypes: Ingress and Egress, so x/a takes nothing in.
    let both = Policies {
        policies: vec![policy(
            "x",
            "p",
            "  podSelector: {}\n  egress: [{ports: [{port: 80}]}]\n",
        )],
    };
    assert!(!both.allows(&peer(1), &peer(0), 80, Protocol::Tcp));
    assert!(both.allows(&peer(0), &peer(1), 80, Protocol::Tcp));
    assert!(!both.allows(&peer(0), &peer(1), 81, Protocol::Tcp));
    // No rules and no policyTypes: Ingress only.
    let ingress = Policies {
        policies: vec![policy("x", "p", "  podSelector: {}\n")],
    };
    assert!(!ingress.allows(&peer(1), &peer(0), 80, Protocol::Tcp));
    assert!(ingress.allows(&peer(0), &peer(1), 81, Protocol::Tcp));
    // No policy in y: y/a is not isolated either way.
    assert_eq!(
        ingress.decide(Direction::Ingress, &all[1].0, &peer(0), 80, Protocol::Tcp),
        Decision::NotIsolated
    );
}

/// The node's view (pods by IP, each with the policies that isolate it) agrees with the
/// truth tables, in its fast form and in its explained one, every client pod on the node.
#[test]
fn the_nodes_view_agrees_with_upstream_truth_tables() {
    use k8s_openapi::api::core::v1::{Namespace, Pod as K8sPod};
    for case in CASES {
        let all = pods(case.pods);
        let k8s_pods: Vec<K8sPod> = all
            .iter()
            .map(|(p, _)| {
                serde_yaml::from_str(&format!(
                    "apiVersion: v1\nkind: Pod\nmetadata: {{name: {}, namespace: {}, labels: {{pod: {}}}}}\n\
                     spec:\n  nodeName: node-a\n  containers:\n  - name: c\n    ports: [{{name: serve-80-tcp, containerPort: 80}}, \
                     {{name: serve-81-tcp, containerPort: 81}}, {{name: serve-80-udp, containerPort: 80, protocol: UDP}}, \
                     {{name: serve-81-udp, containerPort: 81, protocol: UDP}}]\nstatus: {{podIP: \"{}\"}}\n",
                    p.name, p.namespace, p.name, p.ips[0]
                ))
                .unwrap()
            })
            .collect();
        let namespaces: Vec<Namespace> = ["x", "y", "z"]
            .iter()
            .map(|n| {
                serde_yaml::from_str(&format!(
                    "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {n}}}\n"
                ))
                .unwrap()
            })
            .collect();
        let nps: Vec<NetworkPolicy> = case
            .policies
            .iter()
            .map(|(ns, name, spec)| {
                serde_yaml::from_str(&format!(
                    "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n{spec}"
                ))
                .unwrap()
            })
            .collect();
        let (view, errors) = build_view(&k8s_pods, &namespaces, &nps, "node-a");
        assert!(errors.is_empty(), "{errors:?}");
        let view = view.expect("policies exist");
        let id = |p: &Pod| format!("{}/{}", p.namespace, p.name);
        for &(port, proto, want) in case.checks {
            for (from, _) in &all {
                for (to, _) in &all {
                    if from == to {
                        continue;
                    }
                    let dst = std::net::SocketAddr::new(to.ips[0], port);
                    let expected = want(&id(from), &id(to));
                    assert_eq!(
                        view.allows(from.ips[0], dst, proto, false),
                        expected,
                        "{}: {} -> {} port {port}",
                        case.name,
                        id(from),
                        id(to)
                    );
                    assert_eq!(
                        view.check(from.ips[0], dst, proto, false).allowed(),
                        expected,
                        "{}: {} -> {} port {port} (explained)",
                        case.name,
                        id(from),
                        id(to)
                    );
                }
            }
        }
    }
}

/// "When the pod is isolated for ingress, the only allowed connections into the pod are
/// those from the pod's node and those allowed by the ingress list": the node's own
/// connection reaches a pod of this node whatever the policy, not one of another node.
#[test]
fn the_pods_node_is_admitted() {
    use k8s_openapi::api::core::v1::Pod as K8sPod;
    let pod = |name: &str, node: &str, ip: &str| -> K8sPod {
        serde_yaml::from_str(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: x}}\nspec: {{nodeName: {node}, containers: [{{name: c}}]}}\nstatus: {{podIP: {ip}}}\n"
        ))
        .unwrap()
    };
    let pods = [
        pod("here", "node-a", "10.0.0.1"),
        pod("there", "node-b", "10.0.0.2"),
    ];
    let deny: NetworkPolicy = serde_yaml::from_str(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny, namespace: x}\nspec: {podSelector: {}}\n",
    )
    .unwrap();
    let (view, _) = build_view(&pods, &[], &[deny], "node-a");
    let view = view.unwrap();
    let node: IpAddr = "192.0.2.1".parse().unwrap();
    let to = |ip: &str| std::net::SocketAddr::new(ip.parse().unwrap(), 80);
    assert!(view.allows(node, to("10.0.0.1"), Protocol::Tcp, true));
    assert_eq!(
        view.check(node, to("10.0.0.1"), Protocol::Tcp, true)
            .ingress,
        Decision::FromItsNode
    );
    assert!(
        !view.allows(node, to("10.0.0.2"), Protocol::Tcp, true),
        "another node's pod"
    );
    assert!(
        !view.allows(node, to("10.0.0.1"), Protocol::Tcp, false),
        "not the node"
    );
}

/// Pods that change are brought up to date one by one (a namespace or policy change
/// rebuilds everything): labels that come and go, a pod deleted, its address reused.
#[test]
fn pods_that_change_are_followed_one_by_one() {
    use crate::k8s::NodeSettings;
    use crate::tracker::Tracker;
    use k8s_openapi::api::core::v1::Pod as K8sPod;
    let pod = |name: &str, app: &str, ip: &str| -> Arc<K8sPod> {
        Arc::new(
            serde_yaml::from_str(&format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: x, labels: {{app: {app}}}}}\n\
                 spec: {{nodeName: node-a, containers: [{{name: c}}]}}\nstatus: {{podIP: {ip}}}\n"
            ))
            .unwrap(),
        )
    };
    let np = |cidr: &str| -> Arc<NetworkPolicy> {
        Arc::new(
            serde_yaml::from_str(&format!(
                "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: p, namespace: x}}\n\
                 spec:\n  podSelector: {{matchLabels: {{app: guarded}}}}\n  ingress: [{{from: [{{ipBlock: {{cidr: {cidr}}}}}]}}]\n"
            ))
            .unwrap(),
        )
    };
    let mut t = Tracker::new(NodeSettings {
        node_name: "node-a".into(),
        network_policy: true,
        ..Default::default()
    });
    let client: IpAddr = "192.0.2.9".parse().unwrap();
    let to = |ip: &str| std::net::SocketAddr::new(ip.parse().unwrap(), 80);
    let mut generation = 1;
    let mut allowed = |t: &mut Tracker, ip: &str| {
        generation += 1;
        let s = t.sync(generation);
        s.update
            .snapshot
            .policy
            .as_ref()
            .expect("a policy exists")
            .allows(client, to(ip), Protocol::Tcp, false)
    };
    let a = pod("a", "guarded", "10.0.0.1");
    let b = pod("b", "open", "10.0.0.2");
    t.replace_policy_inputs(vec![a.clone(), b.clone()], vec![], vec![np("10.9.0.0/16")]);
    assert!(!allowed(&mut t, "10.0.0.1"));
    assert!(allowed(&mut t, "10.0.0.2"));
    // b becomes guarded (a new object, same name): only b is looked at again.
    let b2 = pod("b", "guarded", "10.0.0.2");
    t.replace_policy_inputs(vec![a.clone(), b2.clone()], vec![], vec![np("10.9.0.0/16")]);
    assert!(!allowed(&mut t, "10.0.0.2"));
    // a goes; its address is no pod's: not isolated. Then another pod takes it.
    t.replace_policy_inputs(vec![b2.clone()], vec![], vec![np("10.9.0.0/16")]);
    assert!(allowed(&mut t, "10.0.0.1"));
    let c = pod("c", "open", "10.0.0.1");
    t.replace_policy_inputs(vec![b2.clone(), c.clone()], vec![], vec![np("10.9.0.0/16")]);
    assert!(allowed(&mut t, "10.0.0.1"));
    // The policy changes: everything rebuilt, the client admitted.
    t.replace_policy_inputs(vec![b2, c], vec![], vec![np("192.0.2.0/24")]);
    assert!(allowed(&mut t, "10.0.0.2"));
}

/// A changed Namespace or NetworkPolicy costs its namespace's pods only; after every
/// change the decisions are those of a view built whole from the same objects (every
/// pod to every pod, ingress and egress), and with the last policy gone nothing is
/// isolated.
#[test]
fn namespaces_and_policies_that_change_give_the_decisions_of_a_whole_build() {
    use crate::k8s::NodeSettings;
    use crate::tracker::Tracker;
    use k8s_openapi::api::core::v1::Namespace;
    let pod = |ns: &str, name: &str, app: &str, ip: &str| k8s_pod(ns, name, app, ip, "node-a");
    let namespace = team_namespace;
    let np = |ns: &str, name: &str, spec: &str| -> Arc<NetworkPolicy> {
        Arc::new(
            serde_yaml::from_str(&format!(
                "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n{spec}"
            ))
            .unwrap(),
        )
    };
    let pods = vec![
        pod("x", "x-web", "web", "10.0.0.1"),
        pod("x", "x-db", "db", "10.0.0.2"),
        pod("y", "y-web", "web", "10.0.1.1"),
        pod("y", "y-cli", "cli", "10.0.1.2"),
        pod("z", "z-cli", "cli", "10.0.2.1"),
    ];
    let ips: Vec<IpAddr> = [
        "10.0.0.1",
        "10.0.0.2",
        "10.0.1.1",
        "10.0.1.2",
        "10.0.2.1",
        "192.0.2.9",
    ]
    .iter()
    .map(|s| s.parse().unwrap())
    .collect();
    // x's db admits only namespaces of team a; y's pods send only to x.
    let db_from_team_a = np(
        "x",
        "db",
        "  podSelector: {matchLabels: {app: db}}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {team: a}}}]}]\n",
    );
    let y_egress_to_x = np(
        "y",
        "out",
        "  podSelector: {}\n  policyTypes: [Egress]\n  egress: [{to: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: x}}}]}]\n",
    );
    let x_web_closed = np(
        "x",
        "web",
        "  podSelector: {matchLabels: {app: web}}\n  ingress: []\n",
    );
    type Step<'a> = (&'a str, Vec<Arc<Namespace>>, Vec<Arc<NetworkPolicy>>);
    let steps: Vec<Step> = vec![
        (
            "first policy",
            vec![
                namespace("x", "a"),
                namespace("y", "a"),
                namespace("z", "b"),
            ],
            vec![db_from_team_a.clone()],
        ),
        (
            "y leaves team a",
            vec![
                namespace("x", "a"),
                namespace("y", "b"),
                namespace("z", "b"),
            ],
            vec![db_from_team_a.clone()],
        ),
        (
            "z joins team a, a policy in y",
            vec![
                namespace("x", "a"),
                namespace("y", "b"),
                namespace("z", "a"),
            ],
            vec![db_from_team_a.clone(), y_egress_to_x.clone()],
        ),
        (
            "another policy in x, y's namespace gone",
            vec![namespace("x", "a"), namespace("z", "a")],
            vec![
                db_from_team_a.clone(),
                y_egress_to_x.clone(),
                x_web_closed.clone(),
            ],
        ),
        (
            "x's policies gone",
            vec![namespace("x", "a"), namespace("z", "a")],
            vec![y_egress_to_x.clone()],
        ),
        ("every policy gone", vec![namespace("x", "a")], vec![]),
        (
            "a policy again",
            vec![namespace("x", "a"), namespace("y", "a")],
            vec![x_web_closed.clone()],
        ),
    ];
    let settings = NodeSettings {
        node_name: "node-a".into(),
        network_policy: true,
        ..Default::default()
    };
    let mut t = Tracker::new(settings.clone());
    let decisions = |snap: &nat::snapshot::Snapshot| -> Vec<bool> {
        let mut out = Vec::new();
        for &src in &ips {
            for &dst in &ips {
                out.push(snap.policy.as_ref().is_none_or(|v| {
                    v.allows(
                        src,
                        std::net::SocketAddr::new(dst, 80),
                        Protocol::Tcp,
                        false,
                    )
                }));
            }
        }
        out
    };
    for (i, (what, namespaces, policies)) in steps.into_iter().enumerate() {
        t.replace_policy_inputs(pods.clone(), namespaces.clone(), policies.clone());
        let step = t.sync(i as u64 + 2).update.snapshot;
        let mut fresh = Tracker::new(settings.clone());
        fresh.replace_policy_inputs(pods.clone(), namespaces, policies.clone());
        let whole = fresh.sync(1).update.snapshot;
        assert_eq!(decisions(&step), decisions(&whole), "{what}");
        assert_eq!(step.policy.is_some(), !policies.is_empty(), "{what}");
    }
}

/// Property: whatever the sequence of changes to pods (labels, addresses, namespaces),
/// namespaces (labels, presence) and policies (selectors of pods and namespaces, ipBlocks,
/// ports, both directions), the decisions the tracker keeps up to date change by change
/// are those of a view built whole from the same objects, for every pair of addresses
/// and both ports. Random sequences from fixed seeds (reproducible).
#[test]
fn random_changes_give_the_decisions_of_a_whole_build() {
    use crate::k8s::NodeSettings;
    use crate::tracker::Tracker;
    use crate::tracker::testutil::{Choices, Lcg};
    use k8s_openapi::api::core::v1::{Namespace, Pod as K8sPod};
    fn pick<'a>(r: &mut Lcg, of: &[&'a str]) -> &'a str {
        of[r.next(of.len() as u64) as usize]
    }
    const NS: [&str; 3] = ["a", "b", "c"];
    const APPS: [&str; 3] = ["web", "db", "cli"];
    const TEAMS: [&str; 2] = ["red", "blue"];
    let pod = |ns: &str, i: u64, app: &str, ip: u64, node: &str| {
        k8s_pod(ns, &format!("p{i}"), app, &format!("10.0.0.{ip}"), node)
    };
    let namespace = team_namespace;
    let policy = |r: &mut Lcg, ns: &str, i: u64| -> Arc<NetworkPolicy> {
        let peer = match r.next(4) {
            0 => format!(
                "{{podSelector: {{matchLabels: {{app: {}}}}}}}",
                pick(r, &APPS)
            ),
            1 => format!(
                "{{namespaceSelector: {{matchLabels: {{team: {}}}}}}}",
                pick(r, &TEAMS)
            ),
            2 => format!(
                "{{namespaceSelector: {{matchLabels: {{team: {}}}}}, podSelector: {{matchExpressions: [{{key: app, operator: NotIn, values: [{}]}}]}}}}",
                pick(r, &TEAMS),
                pick(r, &APPS)
            ),
            _ => "{ipBlock: {cidr: 10.0.0.0/29, except: [10.0.0.4/31]}}".to_string(),
        };
        let port = ["", ", ports: [{port: http}]", ", ports: [{port: 81}]"][r.next(3) as usize];
        let (types, rules) = match r.next(3) {
            0 => (
                "[Ingress]",
                format!("  ingress: [{{from: [{peer}]{port}}}]\n"),
            ),
            1 => ("[Egress]", format!("  egress: [{{to: [{peer}]{port}}}]\n")),
            _ => (
                "[Ingress, Egress]",
                "  ingress: []\n  egress: []\n".to_string(),
            ),
        };
        Arc::new(
            serde_yaml::from_str(&format!(
                "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: np{i}, namespace: {ns}}}\n\
                 spec:\n  podSelector: {{matchLabels: {{app: {}}}}}\n  policyTypes: {types}\n{rules}",
                pick(r, &APPS)
            ))
            .unwrap(),
        )
    };
    let settings = NodeSettings {
        node_name: "node-a".into(),
        network_policy: true,
        ..Default::default()
    };
    let ips: Vec<IpAddr> = (1..=13)
        .map(|i| format!("10.0.0.{i}").parse().unwrap())
        .collect();
    let decisions = |snap: &nat::snapshot::Snapshot| -> Vec<bool> {
        let mut out = Vec::new();
        for &src in &ips {
            for &dst in &ips {
                for port in [80, 81] {
                    out.push(snap.policy.as_ref().is_none_or(|v| {
                        v.allows(
                            src,
                            std::net::SocketAddr::new(dst, port),
                            Protocol::Tcp,
                            false,
                        )
                    }));
                }
            }
        }
        out
    };
    for seed in 1..=20u64 {
        let mut r = Lcg(seed);
        let mut pods: Vec<Arc<K8sPod>> = Vec::new();
        let mut namespaces: Vec<Arc<Namespace>> = NS.iter().map(|n| namespace(n, "red")).collect();
        let mut policies: Vec<Arc<NetworkPolicy>> = Vec::new();
        let mut t = Tracker::new(settings.clone());
        let mut next = 0u64;
        for step in 0..40u64 {
            next += 1;
            match r.next(6) {
                0 | 1 => {
                    // A pod added or replaced (same name, new labels or address).
                    let i = r.next(6);
                    pods.retain(|p| p.metadata.name.as_deref() != Some(&format!("p{i}")));
                    let node = if r.next(2) == 0 { "node-a" } else { "node-b" };
                    // Its address one of its own two (two live pods never share one).
                    let ip = if r.next(2) == 0 { 1 + i } else { 7 + i };
                    pods.push(pod(pick(&mut r, &NS), i, pick(&mut r, &APPS), ip, node));
                }
                2 if !pods.is_empty() => {
                    let i = r.next(pods.len() as u64) as usize;
                    pods.remove(i);
                }
                3 => {
                    let name = pick(&mut r, &NS);
                    namespaces.retain(|n| n.metadata.name.as_deref() != Some(name));
                    if r.next(4) != 0 {
                        namespaces.push(namespace(name, pick(&mut r, &TEAMS)));
                    }
                }
                4 => {
                    let ns = pick(&mut r, &NS);
                    policies.push(policy(&mut r, ns, next));
                }
                _ if !policies.is_empty() => {
                    let i = r.next(policies.len() as u64) as usize;
                    policies.remove(i);
                }
                _ => {}
            }
            t.replace_policy_inputs(pods.clone(), namespaces.clone(), policies.clone());
            let incremental = t.sync(step + 2).update.snapshot;
            let mut fresh = Tracker::new(settings.clone());
            fresh.replace_policy_inputs(pods.clone(), namespaces.clone(), policies.clone());
            let whole = fresh.sync(1).update.snapshot;
            assert_eq!(
                decisions(&incremental),
                decisions(&whole),
                "seed {seed} step {step}"
            );
        }
    }
}

/// Pod `ns/name` labelled `app: APP`, on `node`, at `ip`, with a container port named
/// `http` (80).
fn k8s_pod(
    ns: &str,
    name: &str,
    app: &str,
    ip: &str,
    node: &str,
) -> Arc<k8s_openapi::api::core::v1::Pod> {
    Arc::new(
        serde_yaml::from_str(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {ns}, labels: {{app: {app}}}}}\n\
             spec: {{nodeName: {node}, containers: [{{name: c, ports: [{{name: http, containerPort: 80}}]}}]}}\n\
             status: {{podIP: {ip}}}\n"
        ))
        .unwrap(),
    )
}

/// Namespace `name` labelled `team: TEAM`.
fn team_namespace(name: &str, team: &str) -> Arc<k8s_openapi::api::core::v1::Namespace> {
    Arc::new(
        serde_yaml::from_str(&format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}, labels: {{team: {team}}}}}\n"
        ))
        .unwrap(),
    )
}
