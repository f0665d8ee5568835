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
//! Pure, and free of Kubernetes types: the control plane reads the objects into these
//! (`translate::policy`); this module does no I/O.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

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

/// A label selector, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    /// `matchLabels`.
    pub labels: Vec<(String, String)>,
    /// `matchExpressions`.
    pub exprs: Vec<Expr>,
}

/// One of a selector's `matchExpressions`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expr {
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

impl Selector {
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

/// A rule's peer: pods (by selectors) or an IP block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerRule {
    /// `podSelector` (`None`: the policy's namespace's pods, or every pod of the matched
    /// namespaces) and/or `namespaceSelector` (`None`: the policy's namespace).
    Pods {
        pods: Option<Selector>,
        namespaces: Option<Selector>,
    },
    Block {
        cidr: IpNet,
        except: Vec<IpNet>,
    },
}

/// A rule's port: every port of a protocol, a range (one port: `lo == hi`), or a named
/// container port of the destination pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortRule {
    Any(Protocol),
    Range(Protocol, u16, u16),
    Named(Protocol, String),
}

/// One rule of a direction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Empty: every peer.
    pub peers: Vec<PeerRule>,
    /// Empty: every port.
    pub ports: Vec<PortRule>,
}

/// A NetworkPolicy, read and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub namespace: String,
    pub name: String,
    /// `spec.podSelector`.
    pub selector: Selector,
    /// The ingress rules when the policy has type `Ingress` (`None`: it does not).
    pub ingress: Option<Vec<Rule>>,
    /// The egress rules when the policy has type `Egress`.
    pub egress: Option<Vec<Rule>>,
}

impl Policy {
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
    /// The view of node `node` over the cluster's pods (each with the node it runs on),
    /// namespaces (name and labels, as [`namespace_labels`] makes them) and policies;
    /// `None` when there is no policy (nothing is isolated).
    pub fn build(
        pods: impl IntoIterator<Item = (Pod, Option<String>)>,
        namespaces: impl IntoIterator<Item = (String, Arc<Labels>)>,
        policies: impl IntoIterator<Item = Policy>,
        node: &str,
    ) -> Option<PolicyView> {
        let mut by_namespace: HashMap<String, Policies> = HashMap::new();
        for p in policies {
            by_namespace
                .entry(p.namespace.clone())
                .or_default()
                .policies
                .push(p);
        }
        if by_namespace.is_empty() {
            return None;
        }
        let mut view = PolicyView {
            by_namespace,
            pods: HashMap::new(),
            by_key: HashMap::new(),
            by_ns: HashMap::new(),
            ns_labels: namespaces.into_iter().collect(),
            node: node.to_string(),
        };
        for (pod, on) in pods {
            view.set_pod(pod, on.as_deref());
        }
        Some(view)
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

    /// Puts `pod`, running on node `on`, in the view (replacing what it held before):
    /// its addresses, named ports, namespace labels and the policies of its namespace
    /// that isolate it. The cost of one pod's change: its namespace's policies, once. (A
    /// pod that is no pod to policies, host-network or finished, is removed instead.)
    pub fn set_pod(&mut self, pod: Pod, on: Option<&str>) {
        self.remove_pod(&pod.namespace, &pod.name);
        let (namespace, name, ips) = (pod.namespace.clone(), pod.name.clone(), pod.ips.clone());
        let mut entry = PodEntry {
            namespace_labels: self.labels_of(&namespace),
            pod,
            on_node: on == Some(self.node.as_str()),
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
    /// more; another namespace's are left out) and finds again which of its pods they
    /// isolate. The cost of one policy's change: its namespace's policies and pods,
    /// nothing else (policies select pods of their own namespace only; peers are matched
    /// when a connection is checked).
    pub fn set_policies(&mut self, namespace: &str, policies: impl IntoIterator<Item = Policy>) {
        let read = Policies {
            policies: policies
                .into_iter()
                .filter(|p| p.namespace == namespace)
                .collect(),
        };
        if read.policies.is_empty() {
            self.by_namespace.remove(namespace);
        } else {
            self.by_namespace.insert(namespace.to_string(), read);
        }
        self.revisit(namespace, |_| {});
    }

    /// Namespace `name`'s labels are `labels` (as [`namespace_labels`] makes them;
    /// `None`: it is gone); its pods take them.
    pub fn set_namespace(&mut self, name: &str, labels: Option<Arc<Labels>>) {
        match labels {
            Some(labels) => self.ns_labels.insert(name.to_string(), labels),
            None => self.ns_labels.remove(name),
        };
        let labels = self.labels_of(name);
        self.revisit(name, |e| e.namespace_labels = labels.clone());
    }

    fn labels_of(&self, namespace: &str) -> Arc<Labels> {
        self.ns_labels
            .get(namespace)
            .cloned()
            .unwrap_or_else(|| namespace_labels(namespace, None))
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

/// A namespace's labels as policies see them: its own, with the label the API server
/// sets on every namespace since 1.22.
pub fn namespace_labels(name: &str, own: Option<&Labels>) -> Arc<Labels> {
    let mut labels: Labels = own.cloned().unwrap_or_default();
    labels
        .entry("kubernetes.io/metadata.name".into())
        .or_insert_with(|| name.to_string());
    Arc::new(labels)
}
