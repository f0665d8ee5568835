//! What kube-proxy (nftables mode) does with the first packet of a connection.
//!
//! The order of the checks is the order of kube-proxy's hooks:
//! 1. `filter-prerouting` → `firewall-check`: LoadBalancer VIPs with
//!    `loadBalancerSourceRanges` drop sources outside the ranges;
//! 2. `nat-prerouting` → `services`: ClusterIP / externalIP / LoadBalancer VIP by
//!    `ip daddr . proto . port`, then NodePorts on the NodePort addresses; the
//!    `external-*` chain's short-circuits and masquerade marks; the policy chain's
//!    endpoints (plus the endpoint chain's hairpin masquerade);
//! 3. `filter-forward` / `filter-input` on a packet that was not DNATed:
//!    `no-endpoint-services` / `no-endpoint-nodeports` (reject: no endpoints at all;
//!    drop: Local policy with no local endpoint), then `cluster-ips-check` (reject
//!    traffic to a ClusterIP on a port no Service serves; drop anything else inside a
//!    Service CIDR).
//!
//! Anything else is not kxp's: pass.

use std::fmt;
use std::net::IpAddr;

use crate::model::{Endpoint, NodeContext, ServicePort};
use crate::snapshot::{FrontendKind, Snapshot};
use crate::tuple::Protocol;

/// Which policy's endpoints a forwarded connection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Cluster,
    Local,
}

/// Why a packet is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Source outside the LoadBalancer's `loadBalancerSourceRanges`.
    SourceRange,
    /// `internalTrafficPolicy: Local` and no local endpoint.
    NoLocalEndpointsInternal,
    /// `externalTrafficPolicy: Local` and no local endpoint.
    NoLocalEndpointsExternal,
    /// Inside a Service CIDR, but no Service has this ClusterIP.
    UnallocatedServiceIp,
}

/// Why a packet is refused (ICMP port unreachable / TCP RST).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The Service has no usable endpoint anywhere.
    NoEndpoints,
    /// A ClusterIP, but no Service port for this port and protocol.
    ClusterIpPort,
}

/// A connection to be forwarded to one of `candidates`.
#[derive(Debug, Clone, Copy)]
pub struct Forward<'s> {
    /// Index of the Service port in the snapshot.
    pub port_index: u32,
    pub port: &'s ServicePort,
    pub frontend: FrontendKind,
    pub policy: Policy,
    /// Indices into `port.endpoints`.
    pub candidates: &'s [u32],
    /// Masquerade marked before the endpoint chain (whatever the endpoint).
    pub masquerade: bool,
    /// Why this policy and masquerade: one line for `kxp trace`.
    pub why: &'static str,
}

impl<'s> Forward<'s> {
    /// The consistent-hash table of the candidates (for the hashing schedulers): the
    /// local endpoints' under the Local policy, else the cluster's.
    pub fn hash_table(&self) -> &'s [u16] {
        if self.policy == Policy::Local {
            &self.port.local_table
        } else {
            &self.port.cluster_table
        }
    }

    /// Whether a connection from `src` to `endpoint` is masqueraded: the marks above plus
    /// the endpoint chain's hairpin rule ([`masquerades`]).
    pub fn masquerade_for(&self, src: IpAddr, endpoint: &Endpoint) -> bool {
        masquerades(self.masquerade, src, endpoint)
    }

    pub fn candidate_endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.candidates
            .iter()
            .map(|&i| &self.port.endpoints[i as usize])
    }
}

/// Whether a connection from `src` to `endpoint` is masqueraded, given whether the
/// service chains marked it before the endpoint was chosen (`marked`,
/// [`Forward::masquerade`]): the mark, or the endpoint chain's hairpin rule (`ip saddr
/// <endpoint> jump mark-for-masquerade`).
pub fn masquerades(marked: bool, src: IpAddr, endpoint: &Endpoint) -> bool {
    marked || endpoint.addr.ip() == src
}

/// The decision for the first packet of a connection.
#[derive(Debug, Clone, Copy)]
pub enum Decision<'s> {
    /// Not a Service's packet: the kernel handles it.
    Pass,
    Drop {
        reason: DropReason,
        port: Option<&'s ServicePort>,
    },
    Reject {
        reason: RejectReason,
        port: Option<&'s ServicePort>,
    },
    Forward(Forward<'s>),
}

/// The first packet of a connection, as far as decisions go.
#[derive(Debug, Clone, Copy)]
pub struct NewPacket<'a> {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub dport: u16,
    pub proto: Protocol,
    /// Interface the packet arrived on (for interface-based local detection).
    pub in_interface: Option<&'a str>,
}

/// Decides what kube-proxy would do with `pkt`.
pub fn decide<'s>(snap: &'s Snapshot, pkt: &NewPacket<'_>) -> Decision<'s> {
    let (index, kind) = match frontend(snap, pkt) {
        Ok(f) => f,
        Err(d) => return d,
    };
    let sp = snap.port(index);

    // filter-prerouting: firewall-check (only programmed while the Service has endpoints).
    if kind == FrontendKind::LoadBalancer
        && sp.uses_firewall()
        && !source_allowed(sp, snap, pkt.src)
    {
        return Decision::Drop {
            reason: DropReason::SourceRange,
            port: Some(sp),
        };
    }

    if !sp.cat.has_endpoints {
        return Decision::Reject {
            reason: RejectReason::NoEndpoints,
            port: Some(sp),
        };
    }
    let to = Target { index, sp, kind };
    let local_pod = snap.node.local_detector.is_local(pkt.src, pkt.in_interface);
    if kind == FrontendKind::ClusterIp {
        cluster_ip(&to, &snap.node, local_pod)
    } else {
        external(&to, &snap.node, local_pod, pkt.src)
    }
}

/// The Service port and frontend `pkt` is for; else what becomes of a packet to no
/// frontend: a ClusterIP's other port is rejected, an unallocated Service IP dropped,
/// anything else passed.
#[inline]
fn frontend<'s>(
    snap: &'s Snapshot,
    pkt: &NewPacket<'_>,
) -> Result<(u32, FrontendKind), Decision<'s>> {
    let node = &*snap.node;
    if let Some(f) = snap.lookup_addr(pkt.dst, pkt.proto, pkt.dport) {
        Ok((f.port, f.kind))
    } else if let Some(i) = snap
        .lookup_node_port(pkt.dst, pkt.proto, pkt.dport)
        .filter(|_| node.node_port_addresses.accepts(pkt.dst, &node.local_addrs))
    {
        Ok((i, FrontendKind::NodePort))
    } else if snap.is_cluster_ip(pkt.dst) {
        Err(Decision::Reject {
            reason: RejectReason::ClusterIpPort,
            port: None,
        })
    } else if node.service_cidrs.iter().any(|n| n.contains(&pkt.dst)) {
        Err(Decision::Drop {
            reason: DropReason::UnallocatedServiceIp,
            port: None,
        })
    } else {
        Err(Decision::Pass)
    }
}

/// The Service port a connection is for, and through which frontend.
struct Target<'s> {
    index: u32,
    sp: &'s ServicePort,
    kind: FrontendKind,
}

impl<'s> Target<'s> {
    /// Forward to the endpoints `policy` allows.
    #[inline]
    fn forward(&self, policy: Policy, masquerade: bool, why: &'static str) -> Decision<'s> {
        let candidates: &[u32] = match policy {
            Policy::Cluster => &self.sp.cat.cluster,
            Policy::Local => &self.sp.cat.local,
        };
        Decision::Forward(Forward {
            port_index: self.index,
            port: self.sp,
            frontend: self.kind,
            policy,
            candidates,
            masquerade,
            why,
        })
    }
}

/// A ClusterIP: internalTrafficPolicy, and masquerade for sources outside the cluster.
#[inline]
fn cluster_ip<'s>(to: &Target<'s>, node: &NodeContext, local_pod: Option<bool>) -> Decision<'s> {
    let sp = to.sp;
    if sp.internal_policy_local && sp.cat.local.is_empty() {
        return Decision::Drop {
            reason: DropReason::NoLocalEndpointsInternal,
            port: Some(sp),
        };
    }
    let policy = if sp.internal_policy_local {
        Policy::Local
    } else {
        Policy::Cluster
    };
    if node.masquerade_all {
        to.forward(policy, true, "masqueradeAll")
    } else {
        match local_pod {
            Some(false) => to.forward(policy, true, "source outside the cluster CIDR"),
            Some(true) => to.forward(policy, false, "source inside the cluster CIDR"),
            None => to.forward(policy, false, "no local-traffic detector"),
        }
    }
}

/// External destinations (NodePort, LoadBalancer, externalIP): the Service's external-*
/// chain, externalTrafficPolicy and its short-circuits.
#[inline]
fn external<'s>(
    to: &Target<'s>,
    node: &NodeContext,
    local_pod: Option<bool>,
    src: IpAddr,
) -> Decision<'s> {
    let sp = to.sp;
    if !sp.external_policy_local {
        return to.forward(
            Policy::Cluster,
            true,
            "external traffic with externalTrafficPolicy Cluster",
        );
    }
    if local_pod == Some(true) {
        return to.forward(
            Policy::Cluster,
            false,
            "pod traffic to an external destination short-circuits to Cluster policy",
        );
    }
    if node.is_local_addr(src) {
        return to.forward(
            Policy::Cluster,
            true,
            "traffic from the node itself short-circuits to Cluster policy",
        );
    }
    if sp.cat.local.is_empty() {
        return Decision::Drop {
            reason: DropReason::NoLocalEndpointsExternal,
            port: Some(sp),
        };
    }
    to.forward(
        Policy::Local,
        false,
        "externalTrafficPolicy Local keeps the client address",
    )
}

/// The firewall chain's `ip saddr != { ranges } drop`, where the ranges also admit the
/// LoadBalancer VIPs themselves when a range contains the node's primary IP.
fn source_allowed(sp: &ServicePort, snap: &Snapshot, src: IpAddr) -> bool {
    if sp.lb_source_ranges.iter().any(|n| n.contains(&src)) {
        return true;
    }
    let family = crate::model::Family::of(&sp.cluster_ip);
    let allow_from_node = snap
        .node
        .primary(family)
        .is_some_and(|ip| sp.lb_source_ranges.iter().any(|n| n.contains(&ip)));
    allow_from_node && sp.lb_vips.contains(&src)
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DropReason::SourceRange => "source is outside the loadBalancerSourceRanges",
            DropReason::NoLocalEndpointsInternal => {
                "internalTrafficPolicy Local and no endpoint on this node"
            }
            DropReason::NoLocalEndpointsExternal => {
                "externalTrafficPolicy Local and no endpoint on this node"
            }
            DropReason::UnallocatedServiceIp => {
                "destination is inside a Service CIDR but no Service has this ClusterIP"
            }
        })
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RejectReason::NoEndpoints => "the Service has no usable endpoints",
            RejectReason::ClusterIpPort => {
                "no Service port on this ClusterIP for this port and protocol"
            }
        })
    }
}
