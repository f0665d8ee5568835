//! NetworkPolicy objects read into [`nat::policy`]'s model, and a node's
//! [`PolicyView`] kept from the objects: policies, pods and namespaces as the API
//! serves them. The decisions themselves are `nat`'s.

use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Namespace, Pod as KPod};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use nat::policy::{
    Expr, Labels, PeerRule, Pod, Policy, PolicyView, PortRule, Rule, Selector, namespace_labels,
};
use nat::tuple::Protocol;

/// Why a policy could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("NetworkPolicy {policy}: {field}: {message}")]
pub struct PolicyError {
    pub policy: String,
    pub field: String,
    pub message: String,
}

/// A rule as the object has it: its peers (`from` or `to`) and ports.
type RawRule<'a> = (
    Option<&'a [NetworkPolicyPeer]>,
    Option<&'a [NetworkPolicyPort]>,
);

/// Reads a NetworkPolicy object.
///
/// # Errors
/// A field the API would refuse (a bad CIDR, operator, protocol or port), named.
pub fn read_policy(np: &NetworkPolicy) -> Result<Policy, PolicyError> {
    let namespace = np.metadata.namespace.clone().unwrap_or_default();
    let name = np.metadata.name.clone().unwrap_or_default();
    let id = format!("{namespace}/{name}");
    let spec: NetworkPolicySpec = np.spec.clone().unwrap_or_default();
    let selector = read_selector(
        &spec.pod_selector.clone().unwrap_or_default(),
        "spec.podSelector",
        &id,
    )?;
    let types: Vec<String> = spec.policy_types.clone().unwrap_or_else(|| {
        let mut t = vec!["Ingress".to_string()];
        if spec.egress.is_some() {
            t.push("Egress".into());
        }
        t
    });
    for (i, t) in types.iter().enumerate() {
        if t != "Ingress" && t != "Egress" {
            return Err(PolicyError {
                policy: id,
                field: format!("spec.policyTypes[{i}]"),
                message: format!("{t:?} is not Ingress or Egress"),
            });
        }
    }
    // The rules of one direction (`field`: spec.ingress / spec.egress, its peers
    // under `peers_field`), when the policy has that type.
    let read_rules = |on: &str,
                      field: &str,
                      peers_field: &str,
                      rules: Vec<RawRule<'_>>|
     -> Result<Option<Vec<Rule>>, PolicyError> {
        if !types.iter().any(|t| t == on) {
            return Ok(None);
        }
        let mut out = Vec::new();
        for (i, (peers, ports)) in rules.into_iter().enumerate() {
            let f = format!("{field}[{i}]");
            out.push(Rule {
                peers: read_peers(peers, &format!("{f}.{peers_field}"), &id)?,
                ports: read_ports(ports, &format!("{f}.ports"), &id)?,
            });
        }
        Ok(Some(out))
    };
    let ingress = read_rules(
        "Ingress",
        "spec.ingress",
        "from",
        spec.ingress
            .iter()
            .flatten()
            .map(|r| (r.from.as_deref(), r.ports.as_deref()))
            .collect(),
    )?;
    let egress = read_rules(
        "Egress",
        "spec.egress",
        "to",
        spec.egress
            .iter()
            .flatten()
            .map(|r| (r.to.as_deref(), r.ports.as_deref()))
            .collect(),
    )?;
    Ok(Policy {
        namespace,
        name,
        selector,
        ingress,
        egress,
    })
}

/// Reads `s`; an unknown operator is an error (the API server refuses it too).
fn read_selector(s: &LabelSelector, field: &str, policy: &str) -> Result<Selector, PolicyError> {
    let labels = s
        .match_labels
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let mut exprs = Vec::new();
    for (i, e) in s.match_expressions.iter().flatten().enumerate() {
        let values = e.values.clone().unwrap_or_default();
        exprs.push(match e.operator.as_str() {
            "In" => Expr::In(e.key.clone(), values),
            "NotIn" => Expr::NotIn(e.key.clone(), values),
            "Exists" => Expr::Exists(e.key.clone()),
            "DoesNotExist" => Expr::DoesNotExist(e.key.clone()),
            other => {
                return Err(PolicyError {
                    policy: policy.to_string(),
                    field: format!("{field}.matchExpressions[{i}].operator"),
                    message: format!("{other:?} is not In, NotIn, Exists or DoesNotExist"),
                });
            }
        });
    }
    Ok(Selector { labels, exprs })
}

fn read_peers(
    peers: Option<&[NetworkPolicyPeer]>,
    field: &str,
    id: &str,
) -> Result<Vec<PeerRule>, PolicyError> {
    let mut out = Vec::new();
    for (i, p) in peers.into_iter().flatten().enumerate() {
        let f = format!("{field}[{i}]");
        if let Some(b) = &p.ip_block {
            let bad = |field: String, v: &str| PolicyError {
                policy: id.to_string(),
                field,
                message: format!("{v:?} is not a CIDR"),
            };
            let cidr: IpNet = b
                .cidr
                .trim()
                .parse()
                .map_err(|_| bad(format!("{f}.ipBlock.cidr"), &b.cidr))?;
            let mut except = Vec::new();
            for (j, e) in b.except.iter().flatten().enumerate() {
                except.push(
                    e.trim()
                        .parse()
                        .map_err(|_| bad(format!("{f}.ipBlock.except[{j}]"), e))?,
                );
            }
            out.push(PeerRule::Block { cidr, except });
            continue;
        }
        let pods = p
            .pod_selector
            .as_ref()
            .map(|s| read_selector(s, &format!("{f}.podSelector"), id))
            .transpose()?;
        let namespaces = p
            .namespace_selector
            .as_ref()
            .map(|s| read_selector(s, &format!("{f}.namespaceSelector"), id))
            .transpose()?;
        if pods.is_none() && namespaces.is_none() {
            return Err(PolicyError {
                policy: id.to_string(),
                field: f,
                message: "a peer needs podSelector, namespaceSelector or ipBlock".into(),
            });
        }
        out.push(PeerRule::Pods { pods, namespaces });
    }
    Ok(out)
}

fn read_ports(
    ports: Option<&[NetworkPolicyPort]>,
    field: &str,
    id: &str,
) -> Result<Vec<PortRule>, PolicyError> {
    let mut out = Vec::new();
    for (i, p) in ports.into_iter().flatten().enumerate() {
        let f = format!("{field}[{i}]");
        let err = |field: String, message: String| PolicyError {
            policy: id.to_string(),
            field,
            message,
        };
        let proto = match p.protocol.as_deref().unwrap_or("TCP") {
            "TCP" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            "SCTP" => Protocol::Sctp,
            other => {
                return Err(err(
                    format!("{f}.protocol"),
                    format!("{other:?} is not TCP, UDP or SCTP"),
                ));
            }
        };
        out.push(match &p.port {
            None => PortRule::Any(proto),
            Some(IntOrString::Int(n)) => {
                let lo = u16::try_from(*n)
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| err(format!("{f}.port"), format!("{n} is not a port")))?;
                let hi = match p.end_port {
                    None => lo,
                    Some(e) => u16::try_from(e).ok().filter(|&e| e >= lo).ok_or_else(|| {
                        err(
                            format!("{f}.endPort"),
                            format!("{e} is not a port at or above {lo}"),
                        )
                    })?,
                };
                PortRule::Range(proto, lo, hi)
            }
            Some(IntOrString::String(s)) => match s.parse::<u16>() {
                // "80" in a string: the API server takes it as the number.
                Ok(n) if n > 0 => PortRule::Range(proto, n, n),
                _ => PortRule::Named(proto, s.clone()),
            },
        });
    }
    Ok(out)
}

/// Pod `p` as policies see it, with the node it runs on; `None` when it is no pod to
/// policies: host-network pods (they have the node's address) and finished ones (their
/// IP may be another pod's by now).
pub fn read_pod(p: &KPod) -> Option<(Pod, Option<String>)> {
    let spec = p.spec.as_ref();
    let status = p.status.as_ref();
    if spec.and_then(|s| s.host_network).unwrap_or(false) {
        return None;
    }
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("");
    if phase == "Succeeded" || phase == "Failed" {
        return None;
    }
    let mut ips: Vec<IpAddr> = status
        .and_then(|s| s.pod_ips.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|i| i.ip.parse().ok())
        .collect();
    if let Some(ip) = status
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|i| i.parse().ok())
        && !ips.contains(&ip)
    {
        ips.push(ip);
    }
    let named_ports = spec
        .map(|s| s.containers.iter())
        .into_iter()
        .flatten()
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|cp| {
            let name = cp.name.clone()?;
            let port = u16::try_from(cp.container_port).ok()?;
            let proto = match cp.protocol.as_deref().unwrap_or("TCP") {
                "UDP" => Protocol::Udp,
                "SCTP" => Protocol::Sctp,
                _ => Protocol::Tcp,
            };
            Some((name, port, proto))
        })
        .collect();
    let pod = Pod {
        namespace: p.metadata.namespace.clone().unwrap_or_default(),
        name: p.metadata.name.clone().unwrap_or_default(),
        labels: p.metadata.labels.clone().unwrap_or_default(),
        ips,
        named_ports,
    };
    Some((pod, spec.and_then(|s| s.node_name.clone())))
}

/// A namespace's name and its labels as policies see them.
pub fn read_namespace(n: &Namespace) -> Option<(String, Arc<Labels>)> {
    let name = n.metadata.name.clone()?;
    let labels = namespace_labels(&name, n.metadata.labels.as_ref());
    Some((name, labels))
}

/// Reads the cluster's pods, namespaces and policies for node `node`; `None` when
/// there is no policy (nothing is isolated). A policy that cannot be read is left out
/// and its error returned (the API server would have refused it).
pub fn build_view<'a>(
    pods: impl IntoIterator<Item = &'a KPod>,
    namespaces: impl IntoIterator<Item = &'a Namespace>,
    policies: impl IntoIterator<Item = &'a NetworkPolicy>,
    node: &str,
) -> (Option<PolicyView>, Vec<PolicyError>) {
    let (read, errors) = read_all(policies);
    let view = PolicyView::build(
        pods.into_iter().filter_map(read_pod),
        namespaces.into_iter().filter_map(read_namespace),
        read,
        node,
    );
    (view, errors)
}

/// Pod `p` set in `view` as it is now (or taken out when it is no pod to policies).
pub fn set_pod(view: &mut PolicyView, p: &KPod) {
    match read_pod(p) {
        Some((pod, on)) => view.set_pod(pod, on.as_deref()),
        None => view.remove_pod(
            p.metadata.namespace.as_deref().unwrap_or_default(),
            p.metadata.name.as_deref().unwrap_or_default(),
        ),
    }
}

/// Namespace `namespace`'s policies in `view` made `policies` (see
/// [`PolicyView::set_policies`]); the errors of those that cannot be read.
pub fn set_policies<'a>(
    view: &mut PolicyView,
    namespace: &str,
    policies: impl IntoIterator<Item = &'a NetworkPolicy>,
) -> Vec<PolicyError> {
    let (read, errors) = read_all(policies);
    view.set_policies(namespace, read);
    errors
}

/// Namespace `name`'s labels in `view` made `ns`'s (`None`: it is gone).
pub fn set_namespace(view: &mut PolicyView, name: &str, ns: Option<&Namespace>) {
    view.set_namespace(name, ns.and_then(read_namespace).map(|(_, l)| l));
}

fn read_all<'a>(
    policies: impl IntoIterator<Item = &'a NetworkPolicy>,
) -> (Vec<Policy>, Vec<PolicyError>) {
    let mut read = Vec::new();
    let mut errors = Vec::new();
    for np in policies {
        match read_policy(np) {
            Ok(p) => read.push(p),
            Err(e) => errors.push(e),
        }
    }
    (read, errors)
}

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;
