//! The Service model: what kube-proxy's `ServicePortMap` and `EndpointsMap` hold, for one
//! IP family, after kube-proxy's own filtering.
//!
//! kube-proxy runs one proxier per IP family and every rule it writes is per Service
//! *port* and family; the model follows that shape so that each decision can be read
//! straight off kube-proxy's nftables rules (`pkg/proxy/nftables/proxier.go`).

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;

use crate::tuple::Protocol;

/// IP family of a proxier (kube-proxy runs one per family).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: &IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    pub fn of_net(net: &IpNet) -> Family {
        match net {
            IpNet::V4(_) => Family::V4,
            IpNet::V6(_) => Family::V6,
        }
    }

    /// Kubernetes spelling (`IPv4`, `IPv6`).
    pub fn as_k8s(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }
}

/// `namespace/name:port-name` and protocol: kube-proxy's `ServicePortName`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub namespace: String,
    pub name: String,
    /// The Service port's `name` (empty for a single unnamed port).
    pub port: String,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    /// kube-proxy's `ServicePortName.String()`: `ns/name:port`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}:{}", self.namespace, self.name, self.port)
    }
}

/// One endpoint of a Service port, as kube-proxy's `BaseEndpointInfo` holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: SocketAddr,
    /// `nodeName` equals this node's name.
    pub is_local: bool,
    /// `conditions.ready` (nil = true).
    pub ready: bool,
    /// `conditions.serving` (nil = true).
    pub serving: bool,
    /// `conditions.terminating` (nil = false).
    pub terminating: bool,
    /// `hints.forZones[].name`, sorted.
    pub zone_hints: Vec<String>,
    /// `hints.forNodes[].name`, sorted.
    pub node_hints: Vec<String>,
    /// Scheduler weight (IPVS-style); 1 unless the Service says otherwise.
    pub weight: u32,
}

impl Endpoint {
    /// `IP:PORT`, IPv6 as `[IP]:PORT`: kube-proxy's `Endpoint.String()`.
    pub fn key(&self) -> String {
        self.addr.to_string()
    }
}

/// Session affinity of a Service (`spec.sessionAffinity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Affinity {
    None,
    /// `ClientIP` with `sessionAffinityConfig.clientIP.timeoutSeconds` (default 10800).
    ClientIp {
        timeout_secs: u32,
    },
}

/// One Service port in one IP family, with its endpoints already categorised for this
/// node (kube-proxy's `CategorizeEndpoints`, done once per sync rather than per packet).
#[derive(Debug, Clone)]
pub struct ServicePort {
    pub name: ServicePortName,
    pub cluster_ip: IpAddr,
    pub port: u16,
    /// 0 when the Service has no NodePort for this port.
    pub node_port: u16,
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` of this family in VIP mode.
    pub lb_vips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges` of this family (whitespace trimmed, invalid ones
    /// ignored as kube-proxy does).
    pub lb_source_ranges: Vec<IpNet>,
    /// `externalTrafficPolicy: Local` on a NodePort or LoadBalancer Service.
    pub external_policy_local: bool,
    /// `internalTrafficPolicy: Local`.
    pub internal_policy_local: bool,
    pub affinity: Affinity,
    /// `spec.healthCheckNodePort` for LoadBalancer + externalTrafficPolicy Local.
    pub health_check_node_port: u16,
    /// How a new connection picks among the candidate endpoints.
    pub scheduler: Scheduler,
    /// Every endpoint of this port (sorted by `IP:PORT`, deduplicated).
    pub endpoints: Vec<Endpoint>,
    /// The result of categorising `endpoints` for this node.
    pub cat: Categorized,
    /// Consistent-hash tables over `cat.cluster` / `cat.local` (positions in those
    /// lists), for the hashing schedulers only; empty otherwise.
    pub cluster_table: Vec<u16>,
    pub local_table: Vec<u16>,
    /// Stable hash of `name`, the session-affinity key.
    pub name_hash: u64,
}

impl ServicePort {
    /// NodePort, LoadBalancer VIPs or externalIPs make the port reachable from outside.
    pub fn externally_accessible(&self) -> bool {
        self.node_port != 0 || !self.lb_vips.is_empty() || !self.external_ips.is_empty()
    }

    /// kube-proxy's `UsesClusterEndpoints`.
    pub fn uses_cluster_endpoints(&self) -> bool {
        !self.internal_policy_local || self.externally_accessible()
    }

    /// kube-proxy's `UsesLocalEndpoints`.
    pub fn uses_local_endpoints(&self) -> bool {
        self.internal_policy_local || (self.external_policy_local && self.externally_accessible())
    }

    /// `usesFWChain`: LoadBalancer source ranges are enforced.
    pub fn uses_firewall(&self) -> bool {
        self.cat.has_endpoints && !self.lb_vips.is_empty() && !self.lb_source_ranges.is_empty()
    }
}

/// Indices into `ServicePort::endpoints` of the endpoints each traffic policy may use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Categorized {
    /// Cluster-policy endpoints (topology applied, terminating fallback).
    pub cluster: Vec<u32>,
    /// Local-policy endpoints (ready local ones, or serving+terminating local ones).
    pub local: Vec<u32>,
    /// The Service has a usable endpoint somewhere in the cluster.
    pub has_endpoints: bool,
    /// Every endpoint of the port has the same weight (kube-proxy's case): the random
    /// scheduler then picks among the candidates without reading an endpoint.
    pub equal_weights: bool,
    /// Which topology mode kube-proxy chose (for `trace`).
    pub topology: Topology,
}

/// The topology mode kube-proxy derives from the endpoints' hints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Topology {
    #[default]
    None,
    PreferSameZone,
    PreferSameNode,
}

/// How kube-proxy tells a pod's traffic from anything else (`detectLocalMode`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LocalDetector {
    /// No detector: `clusterCIDR` empty in ClusterCIDR mode.
    #[default]
    None,
    /// ClusterCIDR or NodeCIDR mode: a source inside one of these is a local pod.
    Cidrs(Vec<IpNet>),
    /// BridgeInterface mode: traffic arriving on this interface is from a local pod.
    Bridge(String),
    /// InterfaceNamePrefix mode: traffic arriving on an interface with this prefix.
    InterfacePrefix(String),
}

impl LocalDetector {
    /// Whether a packet from `src` that arrived on `in_interface` comes from a local pod.
    /// `None` when the detector is not implemented for `src`'s family (kube-proxy's
    /// `IsImplemented()` is per proxier, so per family: a cluster CIDR of IPv4 only
    /// leaves IPv6 without a detector).
    pub fn is_local(&self, src: IpAddr, in_interface: Option<&str>) -> Option<bool> {
        match self {
            LocalDetector::None => None,
            LocalDetector::Cidrs(nets) => {
                let family = Family::of(&src);
                let mut implemented = false;
                for net in nets.iter().filter(|n| Family::of_net(n) == family) {
                    implemented = true;
                    if net_contains(net, src) {
                        return Some(true);
                    }
                }
                implemented.then_some(false)
            }
            LocalDetector::Bridge(name) => Some(in_interface == Some(name.as_str())),
            LocalDetector::InterfacePrefix(p) => {
                Some(in_interface.is_some_and(|i| i.starts_with(p.as_str())))
            }
        }
    }
}

/// Whether `ip` is inside `net`: `IpNet::contains` as a mask comparison, without the
/// network and broadcast addresses it computes for every call (a new connection asks for
/// each CIDR of the local-traffic detector).
#[inline]
pub(crate) fn net_contains(net: &IpNet, ip: IpAddr) -> bool {
    match (net, ip) {
        (IpNet::V4(n), IpAddr::V4(a)) => {
            let mask = u32::MAX
                .checked_shl(32 - u32::from(n.prefix_len()))
                .unwrap_or(0);
            (a.to_bits() ^ n.addr().to_bits()) & mask == 0
        }
        (IpNet::V6(n), IpAddr::V6(a)) => {
            let mask = u128::MAX
                .checked_shl(128 - u32::from(n.prefix_len()))
                .unwrap_or(0);
            (a.to_bits() ^ n.addr().to_bits()) & mask == 0
        }
        _ => false,
    }
}

/// Which of the node's addresses accept NodePort traffic (`nodePortAddresses`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every local address except loopback (`0.0.0.0/0` / `::/0` given).
    All,
    /// These addresses only (the node's primary IPs by default, or the local addresses
    /// inside the configured CIDRs).
    Addrs(Vec<IpAddr>),
}

impl Default for NodePortAddresses {
    fn default() -> Self {
        NodePortAddresses::Addrs(Vec::new())
    }
}

impl NodePortAddresses {
    pub fn accepts(&self, dst: IpAddr, node_local: &[IpAddr]) -> bool {
        match self {
            NodePortAddresses::All => !dst.is_loopback() && node_local.contains(&dst),
            NodePortAddresses::Addrs(a) => a.contains(&dst),
        }
    }
}

/// What the node itself contributes to decisions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeContext {
    pub name: String,
    /// `topology.kubernetes.io/zone` of this node's Node object.
    pub zone: Option<String>,
    /// Every address that is local to the node (`fib saddr/daddr type local`).
    pub local_addrs: Vec<IpAddr>,
    /// The node's primary IP of each family (kube-proxy's `nodeIP`).
    pub primary_v4: Option<IpAddr>,
    pub primary_v6: Option<IpAddr>,
    pub node_port_addresses: NodePortAddresses,
    pub local_detector: LocalDetector,
    pub masquerade_all: bool,
    /// The cluster's Service CIDRs (from ServiceCIDR objects).
    pub service_cidrs: Vec<IpNet>,
}

impl NodeContext {
    pub fn primary(&self, family: Family) -> Option<IpAddr> {
        match family {
            Family::V4 => self.primary_v4,
            Family::V6 => self.primary_v6,
        }
    }

    pub fn is_local_addr(&self, ip: IpAddr) -> bool {
        self.local_addrs.contains(&ip)
    }
}

/// Shared handle to an immutable Service port.
pub type ServicePortRef = Arc<ServicePort>;

/// How a Service port picks an endpoint for a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Scheduler {
    /// kube-proxy's default: uniform random (weights honoured when not all equal).
    #[default]
    Random,
    /// IPVS `rr`.
    RoundRobin,
    /// IPVS `wrr`.
    WeightedRoundRobin,
    /// IPVS `lc`: fewest active connections.
    LeastConnection,
    /// IPVS `wlc`: fewest active connections per unit of weight.
    WeightedLeastConnection,
    /// IPVS `sh`: by source address.
    SourceHash,
    /// IPVS `dh`: by destination address.
    DestinationHash,
    /// IPVS `sed`: shortest expected delay, (active + 1) / weight.
    ShortestExpectedDelay,
    /// IPVS `nq`: an idle endpoint if there is one, else `sed`.
    NeverQueue,
    /// Maglev consistent hashing of the 5-tuple.
    Maglev,
}

impl Scheduler {
    /// Parses kxp's and IPVS's names (`random`, `rr`, `wrr`, `lc`, `wlc`, `sh`, `dh`,
    /// `sed`, `nq`, `maglev`); the empty string is the default.
    pub fn parse(s: &str) -> Option<Scheduler> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "" | "random" => Scheduler::Random,
            "rr" | "round-robin" => Scheduler::RoundRobin,
            "wrr" => Scheduler::WeightedRoundRobin,
            "lc" => Scheduler::LeastConnection,
            "wlc" => Scheduler::WeightedLeastConnection,
            "sh" => Scheduler::SourceHash,
            "dh" => Scheduler::DestinationHash,
            "sed" => Scheduler::ShortestExpectedDelay,
            "nq" => Scheduler::NeverQueue,
            "maglev" => Scheduler::Maglev,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Scheduler::Random => "random",
            Scheduler::RoundRobin => "rr",
            Scheduler::WeightedRoundRobin => "wrr",
            Scheduler::LeastConnection => "lc",
            Scheduler::WeightedLeastConnection => "wlc",
            Scheduler::SourceHash => "sh",
            Scheduler::DestinationHash => "dh",
            Scheduler::ShortestExpectedDelay => "sed",
            Scheduler::NeverQueue => "nq",
            Scheduler::Maglev => "maglev",
        }
    }

    /// Schedulers that weigh endpoints by their connections on the node.
    pub fn uses_load(self) -> bool {
        matches!(
            self,
            Scheduler::LeastConnection
                | Scheduler::WeightedLeastConnection
                | Scheduler::ShortestExpectedDelay
                | Scheduler::NeverQueue
        )
    }

    /// Schedulers that keep a position between connections ([`crate::select::RrCursor`]).
    pub fn uses_cursor(self) -> bool {
        matches!(self, Scheduler::RoundRobin | Scheduler::WeightedRoundRobin)
    }

    /// Schedulers that look endpoints up in a consistent-hash table.
    pub fn uses_hash_table(self) -> bool {
        matches!(
            self,
            Scheduler::Maglev | Scheduler::SourceHash | Scheduler::DestinationHash
        )
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use ipnet::IpNet;

    use super::net_contains;

    #[test]
    fn a_mask_comparison_says_what_ipnet_contains_says() {
        let nets: Vec<IpNet> = [
            "0.0.0.0/0",
            "10.0.0.0/8",
            "10.244.3.0/24",
            "10.244.3.7/32",
            "10.244.3.7/24",
            "198.18.0.0/15",
            "::/0",
            "fd00::/8",
            "2001:db8:1::/48",
            "2001:db8::7/128",
            "2001:db8::7/64",
        ]
        .iter()
        .map(|n| n.parse().expect("a CIDR"))
        .collect();
        let ips: Vec<IpAddr> = [
            "0.0.0.0",
            "10.0.0.1",
            "10.244.3.7",
            "10.244.3.8",
            "10.244.4.1",
            "11.0.0.0",
            "198.18.255.255",
            "198.20.0.0",
            "255.255.255.255",
            "::",
            "::ffff:10.0.0.1",
            "fd12::1",
            "2001:db8:1:ffff::1",
            "2001:db8::7",
            "2001:db8::8",
            "2001:db8:0:1::7",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ]
        .iter()
        .map(|a| a.parse().expect("an address"))
        .collect();
        for net in &nets {
            for ip in &ips {
                assert_eq!(net_contains(net, *ip), net.contains(ip), "{net} {ip}");
            }
        }
    }
}
