//! Kubernetes NetworkPolicy (networking.k8s.io/v1) decisions: whether a connection from a
//! peer to a pod is allowed by the ingress policies of the destination pod, and by the
//! egress policies of the source pod, as the API defines them.
//!
//! - A policy selects the pods of its own namespace that its `podSelector` matches (the
//!   empty selector: all of them). Its `policyTypes` default to `Ingress`, plus `Egress`
//!   when it has `egress` rules.
//! - A pod no policy selects for a direction is not isolated in that direction: all is
//!   allowed. A pod some policy selects for it is isolated: a connection is allowed when
//!   at least one rule of one of those policies allows it (policies add up; a policy with
//!   no rule for the direction denies all of it).
//! - A rule allows when one of its peers matches (no `from`/`to`: every peer) and one of
//!   its ports matches (no `ports`: every port).
//! - A peer is a `podSelector` (pods of the policy's namespace), a `namespaceSelector`
//!   (every pod of the namespaces it matches), both (pods it matches in namespaces it
//!   matches), or an `ipBlock` (a CIDR less its `except` CIDRs, matched against the
//!   peer's IP, a pod's or not).
//! - A port is a protocol (default TCP) and a number, a range (`endPort`), a name
//!   (resolved against the destination pod's container ports: a named port never matches
//!   a destination that is not a pod) or absent (every port of that protocol).
//! - Label selectors: `matchLabels` and `matchExpressions` (`In`, `NotIn`, `Exists`,
//!   `DoesNotExist`), all of them; the empty selector matches everything.
//!
//! Pure: the caller gives the pods and namespaces it knows; this module does no I/O.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::tuple::Protocol;

/// Labels of a pod or namespace.
pub type Labels = BTreeMap<String, String>;

/// A pod as policies see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    pub namespace: String,
    pub name: String,
    pub labels: Labels,
    pub ips: Vec<IpAddr>,
    /// Named container ports: (name, number, protocol).
    pub named_ports: Vec<(String, u16, Protocol)>,
}

/// The other end of a connection: a pod known to the cluster (with its namespace's
/// labels), or an address that is no pod's.
#[derive(Debug, Clone, Copy)]
pub enum Peer<'a> {
    Pod {
        pod: &'a Pod,
        namespace_labels: &'a Labels,
        ip: IpAddr,
    },
    External(IpAddr),
}

impl Peer<'_> {
    fn ip(&self) -> IpAddr {
        match self {
            Peer::Pod { ip, .. } | Peer::External(ip) => *ip,
        }
    }
}

/// Which way a policy rule looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Ingress,
    Egress,
}

/// Why a connection is allowed or denied, for `kxp trace` and counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No policy selects the pod for this direction.
    NotIsolated,
    /// The connection comes from the pod's own node (a host process), which an isolated
    /// pod always admits ("the only allowed connections into the pod are those from the
    /// pod's node and those allowed by the ingress list").
    FromItsNode,
    /// Rule `rule` (0-based) of this policy (`namespace/name`) allows it.
    AllowedBy { policy: String, rule: usize },
    /// Policies select the pod for this direction and none of their rules allows it.
    Denied { policies: Vec<String> },
}

impl Decision {
    pub fn allowed(&self) -> bool {
        !matches!(self, Decision::Denied { .. })
    }
}

/// Why a policy could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("NetworkPolicy {policy}: {field}: {message}")]
pub struct PolicyError {
    pub policy: String,
    pub field: String,
    pub message: String,
}

/// A label selector, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    labels: Vec<(String, String)>,
    exprs: Vec<Expr>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Expr {
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

impl Selector {
    /// Reads `s`; an unknown operator is an error (the API server refuses it too).
    fn read(s: &LabelSelector, field: &str, policy: &str) -> Result<Selector, PolicyError> {
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

    /// Whether `labels` match (the empty selector matches all).
    pub fn matches(&self, labels: &Labels) -> bool {
        self.labels.iter().all(|(k, v)| labels.get(k) == Some(v))
            && self.exprs.iter().all(|e| match e {
                Expr::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
                Expr::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
                Expr::Exists(k) => labels.contains_key(k),
                Expr::DoesNotExist(k) => !labels.contains_key(k),
            })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum PeerRule {
    Pods {
        pods: Option<Selector>,
        namespaces: Option<Selector>,
    },
    Block {
        cidr: IpNet,
        except: Vec<IpNet>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum PortRule {
    Any(Protocol),
    Range(Protocol, u16, u16),
    Named(Protocol, String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    /// Empty: every peer.
    peers: Vec<PeerRule>,
    /// Empty: every port.
    ports: Vec<PortRule>,
}

/// A rule as the object has it: its peers (`from` or `to`) and ports.
type RawRule<'a> = (
    Option<&'a [NetworkPolicyPeer]>,
    Option<&'a [NetworkPolicyPort]>,
);

/// A NetworkPolicy, read and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub namespace: String,
    pub name: String,
    selector: Selector,
    ingress: Option<Vec<Rule>>,
    egress: Option<Vec<Rule>>,
}

impl Policy {
    /// Reads a NetworkPolicy object.
    ///
    /// # Errors
    /// A field the API would refuse (a bad CIDR, operator, protocol or port), named.
    pub fn read(np: &NetworkPolicy) -> Result<Policy, PolicyError> {
        let namespace = np.metadata.namespace.clone().unwrap_or_default();
        let name = np.metadata.name.clone().unwrap_or_default();
        let id = format!("{namespace}/{name}");
        let spec: NetworkPolicySpec = np.spec.clone().unwrap_or_default();
        let selector = Selector::read(
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

    fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Whether this policy isolates `pod` in direction `d`.
    pub fn selects(&self, pod: &Pod, d: Direction) -> bool {
        let rules = match d {
            Direction::Ingress => &self.ingress,
            Direction::Egress => &self.egress,
        };
        rules.is_some() && pod.namespace == self.namespace && self.selector.matches(&pod.labels)
    }

    /// The first rule of direction `d` that allows `peer` on `port`/`proto` of `dest`
    /// (the pod the port belongs to: the selected pod for ingress, the peer for egress).
    fn allowing_rule(
        &self,
        d: Direction,
        peer: &Peer<'_>,
        dest: Option<&Pod>,
        port: u16,
        proto: Protocol,
    ) -> Option<usize> {
        let rules = match d {
            Direction::Ingress => self.ingress.as_ref()?,
            Direction::Egress => self.egress.as_ref()?,
        };
        rules.iter().position(|r| {
            (r.peers.is_empty() || r.peers.iter().any(|p| self.peer_matches(p, peer)))
                && (r.ports.is_empty()
                    || r.ports.iter().any(|p| port_matches(p, dest, port, proto)))
        })
    }

    fn peer_matches(&self, rule: &PeerRule, peer: &Peer<'_>) -> bool {
        match rule {
            PeerRule::Block { cidr, except } => {
                let ip = peer.ip();
                cidr.contains(&ip) && !except.iter().any(|e| e.contains(&ip))
            }
            PeerRule::Pods { pods, namespaces } => {
                let Peer::Pod {
                    pod,
                    namespace_labels,
                    ..
                } = peer
                else {
                    return false;
                };
                let ns_ok = match namespaces {
                    Some(ns) => ns.matches(namespace_labels),
                    None => pod.namespace == self.namespace,
                };
                ns_ok && pods.as_ref().is_none_or(|s| s.matches(&pod.labels))
            }
        }
    }
}

fn port_matches(rule: &PortRule, dest: Option<&Pod>, port: u16, proto: Protocol) -> bool {
    match rule {
        PortRule::Any(p) => *p == proto,
        PortRule::Range(p, lo, hi) => *p == proto && (*lo..=*hi).contains(&port),
        PortRule::Named(p, name) => {
            *p == proto
                && dest.is_some_and(|pod| {
                    pod.named_ports
                        .iter()
                        .any(|(n, num, pr)| n == name && *num == port && *pr == proto)
                })
        }
    }
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
            .map(|s| Selector::read(s, &format!("{f}.podSelector"), id))
            .transpose()?;
        let namespaces = p
            .namespace_selector
            .as_ref()
            .map(|s| Selector::read(s, &format!("{f}.namespaceSelector"), id))
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

/// Every policy of the cluster, read.
#[derive(Debug, Clone, Default)]
pub struct Policies {
    pub policies: Vec<Policy>,
}

impl Policies {
    /// The decision for a connection in direction `d` of `pod` (the destination for
    /// ingress, the source for egress) with `peer` at the other end, to `port`/`proto`
    /// (the destination's port, after DNAT). `dest` is the destination pod (`pod` for
    /// ingress; the peer's pod, if any, for egress), for named ports.
    pub fn decide(
        &self,
        d: Direction,
        pod: &Pod,
        peer: &Peer<'_>,
        port: u16,
        proto: Protocol,
    ) -> Decision {
        let dest = match d {
            Direction::Ingress => Some(pod),
            Direction::Egress => match peer {
                Peer::Pod { pod, .. } => Some(*pod),
                Peer::External(_) => None,
            },
        };
        let mut isolating = Vec::new();
        for p in self.policies.iter().filter(|p| p.selects(pod, d)) {
            if let Some(rule) = p.allowing_rule(d, peer, dest, port, proto) {
                return Decision::AllowedBy {
                    policy: p.id(),
                    rule,
                };
            }
            isolating.push(p.id());
        }
        if isolating.is_empty() {
            Decision::NotIsolated
        } else {
            Decision::Denied {
                policies: isolating,
            }
        }
    }

    /// Whether a connection from `src` to `dst` (pods or not) on `port`/`proto` is
    /// allowed: by the source pod's egress policies and the destination pod's ingress
    /// policies (each side only when it is a pod).
    pub fn allows(&self, src: &Peer<'_>, dst: &Peer<'_>, port: u16, proto: Protocol) -> bool {
        let egress = match src {
            Peer::Pod { pod, .. } => self.decide(Direction::Egress, pod, dst, port, proto),
            Peer::External(_) => Decision::NotIsolated,
        };
        let ingress = match dst {
            Peer::Pod { pod, .. } => self.decide(Direction::Ingress, pod, src, port, proto),
            Peer::External(_) => Decision::NotIsolated,
        };
        egress.allowed() && ingress.allowed()
    }
}

/// One pod as a [`PolicyView`] keeps it.
#[derive(Debug, Clone)]
struct PodEntry {
    pod: Pod,
    namespace_labels: Arc<Labels>,
    /// Scheduled on this node (its egress policies are this node's to enforce).
    on_node: bool,
    /// The policies of its namespace that isolate it, per direction (indexes into the
    /// namespace's [`Policies`]), found once when the view is built: a connection looks
    /// at these only.
    ingress_by: Vec<u32>,
    egress_by: Vec<u32>,
}

/// Everything a node needs to decide NetworkPolicy for the connections it carries: the
/// policies by namespace and the pods by IP (with their namespaces' labels).
#[derive(Debug, Clone, Default)]
pub struct PolicyView {
    by_namespace: HashMap<String, Policies>,
    pods: HashMap<IpAddr, Arc<PodEntry>>,
    /// (namespace, name) → the pod's IPs in `pods`, to take them out when it changes.
    by_key: HashMap<(String, String), Vec<IpAddr>>,
    /// namespace → its pods' names in `by_key` (what a change of the namespace's labels
    /// or policies revisits).
    by_ns: HashMap<String, std::collections::BTreeSet<String>>,
    ns_labels: HashMap<String, Arc<Labels>>,
    node: String,
}

/// A connection's NetworkPolicy verdict: both directions' decisions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The destination pod's ingress decision (`NotIsolated` when it is no pod).
    pub ingress: Decision,
    /// The source pod's egress decision (`NotIsolated` when it is no pod of this node).
    pub egress: Decision,
}

impl Verdict {
    pub fn allowed(&self) -> bool {
        self.ingress.allowed() && self.egress.allowed()
    }
}

impl PolicyView {
    /// Reads the cluster's pods, namespaces and policies for node `node`; `None` when
    /// there is no policy (nothing is isolated). A policy that cannot be read is left out
    /// and its error returned (the API server would have refused it).
    pub fn build<'a>(
        pods: impl IntoIterator<Item = &'a k8s_openapi::api::core::v1::Pod>,
        namespaces: impl IntoIterator<Item = &'a k8s_openapi::api::core::v1::Namespace>,
        policies: impl IntoIterator<Item = &'a NetworkPolicy>,
        node: &str,
    ) -> (Option<PolicyView>, Vec<PolicyError>) {
        let mut errors = Vec::new();
        let mut by_namespace: HashMap<String, Policies> = HashMap::new();
        for np in policies {
            match Policy::read(np) {
                Ok(p) => by_namespace
                    .entry(p.namespace.clone())
                    .or_default()
                    .policies
                    .push(p),
                Err(e) => errors.push(e),
            }
        }
        if by_namespace.is_empty() {
            return (None, errors);
        }
        let ns_labels: HashMap<String, Arc<Labels>> = namespaces
            .into_iter()
            .filter_map(namespace_labels)
            .collect();
        let mut view = PolicyView {
            by_namespace,
            pods: HashMap::new(),
            by_key: HashMap::new(),
            by_ns: HashMap::new(),
            ns_labels,
            node: node.to_string(),
        };
        for p in pods {
            view.set_pod(p);
        }
        (Some(view), errors)
    }

    /// Takes pod `namespace/name` out of the view (it was deleted, or is about to be
    /// set again).
    pub fn remove_pod(&mut self, namespace: &str, name: &str) {
        let key = (namespace.to_string(), name.to_string());
        if let Some(names) = self.by_ns.get_mut(namespace) {
            names.remove(name);
            if names.is_empty() {
                self.by_ns.remove(namespace);
            }
        }
        for ip in self.by_key.remove(&key).unwrap_or_default() {
            // Only if the address is still this pod's (a new pod may have taken it).
            if self
                .pods
                .get(&ip)
                .is_some_and(|e| e.pod.namespace == key.0 && e.pod.name == key.1)
            {
                self.pods.remove(&ip);
            }
        }
    }

    /// Puts pod `p` in the view (replacing what it held before): its addresses, named
    /// ports, namespace labels and the policies of its namespace that isolate it. The
    /// cost of one pod's change: its namespace's policies, once.
    pub fn set_pod(&mut self, p: &k8s_openapi::api::core::v1::Pod) {
        let namespace = p.metadata.namespace.clone().unwrap_or_default();
        let name = p.metadata.name.clone().unwrap_or_default();
        self.remove_pod(&namespace, &name);
        let spec = p.spec.as_ref();
        let status = p.status.as_ref();
        // Host-network pods have the node's address: not pods to policies.
        if spec.and_then(|s| s.host_network).unwrap_or(false) {
            return;
        }
        let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("");
        if phase == "Succeeded" || phase == "Failed" {
            return; // its IP may be another pod's by now
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
        let mut entry = PodEntry {
            pod: Pod {
                namespace: namespace.clone(),
                name: name.clone(),
                labels: p.metadata.labels.clone().unwrap_or_default(),
                ips: ips.clone(),
                named_ports,
            },
            namespace_labels: self.labels_of(&namespace),
            on_node: spec.and_then(|s| s.node_name.as_deref()) == Some(self.node.as_str()),
            ingress_by: Vec::new(),
            egress_by: Vec::new(),
        };
        self.find_isolating(&mut entry);
        let entry = Arc::new(entry);
        for &ip in &ips {
            self.pods.insert(ip, entry.clone());
        }
        if !ips.is_empty() {
            self.by_ns
                .entry(namespace.clone())
                .or_default()
                .insert(name.clone());
            self.by_key.insert((namespace, name), ips);
        }
    }

    /// Whether any policy is held (with none, nothing is isolated).
    pub fn has_policies(&self) -> bool {
        !self.by_namespace.is_empty()
    }

    /// Makes namespace `namespace`'s policies `policies` (all of them; none: it has no
    /// more) and finds again which of its pods they isolate. The cost of one policy's
    /// change: its namespace's policies and pods, nothing else (policies select pods of
    /// their own namespace only; peers are matched when a connection is checked). A
    /// policy that cannot be read is left out and its error returned.
    pub fn set_policies<'a>(
        &mut self,
        namespace: &str,
        policies: impl IntoIterator<Item = &'a NetworkPolicy>,
    ) -> Vec<PolicyError> {
        let mut errors = Vec::new();
        let mut read = Policies::default();
        for np in policies {
            match Policy::read(np) {
                Ok(p) if p.namespace == namespace => read.policies.push(p),
                Ok(_) => {}
                Err(e) => errors.push(e),
            }
        }
        if read.policies.is_empty() {
            self.by_namespace.remove(namespace);
        } else {
            self.by_namespace.insert(namespace.to_string(), read);
        }
        self.revisit(namespace, |_| {});
        errors
    }

    /// Namespace `name`'s labels are `ns`'s (`None`: it is gone); its pods take them.
    pub fn set_namespace(
        &mut self,
        name: &str,
        ns: Option<&k8s_openapi::api::core::v1::Namespace>,
    ) {
        match ns.and_then(namespace_labels) {
            Some((_, labels)) => self.ns_labels.insert(name.to_string(), labels),
            None => self.ns_labels.remove(name),
        };
        let labels = self.labels_of(name);
        self.revisit(name, |e| e.namespace_labels = labels.clone());
    }

    fn labels_of(&self, namespace: &str) -> Arc<Labels> {
        self.ns_labels.get(namespace).cloned().unwrap_or_else(|| {
            Arc::new(Labels::from([(
                "kubernetes.io/metadata.name".to_string(),
                namespace.to_string(),
            )]))
        })
    }

    /// Sets `entry`'s isolating policies: those of its namespace that select it, per
    /// direction.
    fn find_isolating(&self, entry: &mut PodEntry) {
        entry.ingress_by.clear();
        entry.egress_by.clear();
        let Some(ps) = self.by_namespace.get(&entry.pod.namespace) else {
            return;
        };
        for (i, pol) in ps.policies.iter().enumerate() {
            if pol.selects(&entry.pod, Direction::Ingress) {
                entry.ingress_by.push(i as u32);
            }
            if pol.selects(&entry.pod, Direction::Egress) {
                entry.egress_by.push(i as u32);
            }
        }
    }

    /// Every pod of `namespace` changed by `change`, then given the policies of its
    /// namespace that isolate it again.
    fn revisit(&mut self, namespace: &str, change: impl Fn(&mut PodEntry)) {
        let names: Vec<String> = self
            .by_ns
            .get(namespace)
            .map(|n| n.iter().cloned().collect())
            .unwrap_or_default();
        for name in names {
            let key = (namespace.to_string(), name);
            let Some(ips) = self.by_key.get(&key) else {
                continue;
            };
            // Its addresses that are still its own (a newer pod may have taken one).
            let own = |e: &&Arc<PodEntry>| e.pod.namespace == key.0 && e.pod.name == key.1;
            let Some(old) = ips.iter().filter_map(|ip| self.pods.get(ip)).find(own) else {
                continue;
            };
            let mut entry = PodEntry::clone(old);
            change(&mut entry);
            self.find_isolating(&mut entry);
            let entry = Arc::new(entry);
            for ip in ips {
                if self.pods.get(ip).is_some_and(|e| own(&e)) {
                    self.pods.insert(*ip, entry.clone());
                }
            }
        }
    }

    fn peer(&self, ip: IpAddr) -> Peer<'_> {
        match self.pods.get(&ip) {
            Some(e) => Peer::Pod {
                pod: &e.pod,
                namespace_labels: &e.namespace_labels,
                ip,
            },
            None => Peer::External(ip),
        }
    }

    /// Whether a connection from `src` to `dst` is allowed, as [`PolicyView::check`]
    /// decides, without saying why (no allocation: the packet path's form).
    pub fn allows(
        &self,
        src: IpAddr,
        dst: std::net::SocketAddr,
        proto: Protocol,
        from_node: bool,
    ) -> bool {
        let to = self.pods.get(&dst.ip()).map(|e| &**e);
        let from = self.pods.get(&src).map(|e| &**e);
        fn peer_of(e: Option<&PodEntry>, ip: IpAddr) -> Peer<'_> {
            match e {
                Some(e) => Peer::Pod {
                    pod: &e.pod,
                    namespace_labels: &e.namespace_labels,
                    ip,
                },
                None => Peer::External(ip),
            }
        }
        let side = |e: &PodEntry, by: &[u32], d: Direction, peer: &Peer<'_>, dest: Option<&Pod>| {
            let Some(ps) = self.by_namespace.get(&e.pod.namespace) else {
                return true;
            };
            by.is_empty()
                || by.iter().any(|&i| {
                    ps.policies[i as usize]
                        .allowing_rule(d, peer, dest, dst.port(), proto)
                        .is_some()
                })
        };
        if let Some(t) = to
            && !(from_node && t.on_node)
            && !side(
                t,
                &t.ingress_by,
                Direction::Ingress,
                &peer_of(from, src),
                Some(&t.pod),
            )
        {
            return false;
        }
        match from {
            Some(f) if f.on_node => side(
                f,
                &f.egress_by,
                Direction::Egress,
                &peer_of(to, dst.ip()),
                to.map(|t| &t.pod),
            ),
            _ => true,
        }
    }

    /// The verdict for a connection from `src` to `dst` (the endpoint, after DNAT; the
    /// client's own address, before SNAT): the destination pod's ingress policies, and
    /// the source pod's egress policies when it runs on this node. `from_node`: the
    /// connection is the node's own (a host process), admitted by a pod of this node.
    pub fn check(
        &self,
        src: IpAddr,
        dst: std::net::SocketAddr,
        proto: Protocol,
        from_node: bool,
    ) -> Verdict {
        let (from, to) = (self.peer(src), self.peer(dst.ip()));
        let ingress = match (&to, self.pods.get(&dst.ip())) {
            (_, Some(e)) if from_node && e.on_node => Decision::FromItsNode,
            (Peer::Pod { pod, .. }, Some(_)) => self
                .by_namespace
                .get(&pod.namespace)
                .map_or(Decision::NotIsolated, |p| {
                    p.decide(Direction::Ingress, pod, &from, dst.port(), proto)
                }),
            _ => Decision::NotIsolated,
        };
        let egress = match self.pods.get(&src) {
            Some(e) if e.on_node => self
                .by_namespace
                .get(&e.pod.namespace)
                .map_or(Decision::NotIsolated, |p| {
                    p.decide(Direction::Egress, &e.pod, &to, dst.port(), proto)
                }),
            _ => Decision::NotIsolated,
        };
        Verdict { ingress, egress }
    }
}

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;

/// A namespace's name and labels, with the label the API server sets on every namespace
/// since 1.22.
fn namespace_labels(n: &k8s_openapi::api::core::v1::Namespace) -> Option<(String, Arc<Labels>)> {
    let name = n.metadata.name.clone()?;
    let mut labels: Labels = n.metadata.labels.clone().unwrap_or_default();
    labels
        .entry("kubernetes.io/metadata.name".into())
        .or_insert_with(|| name.clone());
    Some((name, Arc::new(labels)))
}
