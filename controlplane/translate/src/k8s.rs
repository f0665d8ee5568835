//! From Kubernetes objects (k8s-openapi types) to the Service model, with kube-proxy's
//! filtering: `ServiceChangeTracker`, `newBaseServiceInfo` and `EndpointSliceCache`
//! (`pkg/proxy/{servicechangetracker,serviceport,endpointslicecache}.go`).
//!
//! Objects kube-proxy would not even receive (the `service-proxy-name` label, headless
//! EndpointSlices) or silently skips (ExternalName, headless Services, FQDN slices) are
//! skipped here too, with a note. Fields that cannot be read at all (an address that is
//! not one, a port out of range) are errors naming the object and the field.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node, Service, ServiceSpec};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;

use nat::model::{
    Affinity, Endpoint, Family, LocalDetector, NodeContext, NodePortAddresses, ServicePort,
    ServicePortName,
};
use nat::select::{Scheduler, maglev_table};
use nat::topology::{PolicyUse, categorize};
use nat::tuple::Protocol;

use crate::slice::{Address, Slice, SliceEndpoint};
use crate::sloppy::{parse_cidr_sloppy, parse_ip_sloppy};

/// Label that hands a Service to another proxy (kube-proxy's informer excludes it).
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Label marking the EndpointSlices of headless Services.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label joining an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Node label with the node's zone.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// The prefix of kxp's own annotations, the only ones it reads on a Service.
pub const KXP_ANNOTATION_PREFIX: &str = "kxp.dev/";
/// kxp's per-Service scheduler choice.
pub const ANNOTATION_SCHEDULER: &str = "kxp.dev/scheduler";
/// kxp's per-Service endpoint weights: `IP=WEIGHT,IP=WEIGHT`.
pub const ANNOTATION_WEIGHTS: &str = "kxp.dev/endpoint-weights";

/// Default `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;

/// An object or field kxp cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind} {object}: field {field}: {message}")]
pub struct ModelError {
    pub kind: &'static str,
    /// `namespace/name` or `name`.
    pub object: String,
    /// JSON path of the field, e.g. `spec.ports[1].protocol`.
    pub field: String,
    pub message: String,
}

/// How the node's pods are told from other sources (`detectLocalMode`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DetectLocalMode {
    /// `clusterCIDR` (empty = no detector).
    #[default]
    ClusterCidr,
    /// The Node's `spec.podCIDRs`.
    NodeCidr,
    BridgeInterface(String),
    InterfaceNamePrefix(String),
}

/// The node's settings that shape decisions (from the KubeProxyConfiguration and flags).
#[derive(Debug, Clone, Default)]
pub struct NodeSettings {
    /// This node's name (`hostnameOverride` or the host name).
    pub node_name: String,
    /// `--node-ip` values, or `bindAddress` when it is not `0.0.0.0`/`::`: when given,
    /// the node's local and primary addresses.
    pub node_ips: Vec<IpAddr>,
    /// The host's own addresses (lowest first), followed as they change: local to the
    /// node whatever else gives its addresses (kube-proxy's `fib daddr type local` and
    /// `--dst-type LOCAL`), and the node's primary addresses only when neither
    /// `node_ips` nor this node's Node object (InternalIP, ExternalIP) gives any, as
    /// kube-proxy falls back when it cannot find its node's IP (with a note saying so).
    pub host_addrs: Vec<IpAddr>,
    /// `clusterCIDR`, split on commas.
    pub cluster_cidrs: Vec<IpNet>,
    pub detect_local: DetectLocalMode,
    /// `nodePortAddresses` (CIDRs or `primary`); empty = primary, or every local address
    /// with `node_ports_on_every_address`.
    pub node_port_addresses: Vec<String>,
    /// kube-proxy's iptables and IPVS modes (an empty `mode` is iptables on Linux) answer
    /// NodePorts on every local address when `nodePortAddresses` is empty; its nftables
    /// mode on the primary IPs only.
    pub node_ports_on_every_address: bool,
    pub masquerade_all: bool,
    /// Scheduler for Services without a `kxp.dev/scheduler` annotation.
    pub default_scheduler: Scheduler,
    /// `serviceProxyName`: when set, kxp serves only the Services whose
    /// `service.kubernetes.io/service-proxy-name` label holds it; when not, only the
    /// Services without that label (kube-proxy's label selector, either way).
    pub service_proxy_name: Option<String>,
    /// Enforce NetworkPolicy on the connections kxp carries (`kxp.networkPolicy:
    /// enforce`, the default); off, policies are not read.
    pub network_policy: bool,
}

/// Everything read from the cluster.
#[derive(Debug, Clone, Default)]
pub struct ClusterState {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
    pub service_cidrs: Vec<ServiceCIDR>,
    /// What NetworkPolicy decisions need (see [`crate::policy`]).
    pub pods: Vec<k8s_openapi::api::core::v1::Pod>,
    pub namespaces: Vec<k8s_openapi::api::core::v1::Namespace>,
    pub network_policies: Vec<k8s_openapi::api::networking::v1::NetworkPolicy>,
}

pub(crate) fn obj_name(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> String {
    match (&meta.namespace, &meta.name) {
        (Some(ns), Some(n)) => format!("{ns}/{n}"),
        (None, Some(n)) => n.clone(),
        _ => "(unnamed)".to_string(),
    }
}

fn parse_ip(kind: &'static str, object: &str, field: &str, s: &str) -> Result<IpAddr, ModelError> {
    parse_ip_sloppy(s).ok_or_else(|| ModelError {
        kind,
        object: object.to_string(),
        field: field.to_string(),
        message: format!("{s:?} is not an IP address"),
    })
}

/// The node's addresses, zone and local-traffic detector.
pub(crate) fn node_context<'a>(
    node: Option<&Node>,
    cidr_objects: impl IntoIterator<Item = &'a ServiceCIDR>,
    settings: &NodeSettings,
    notes: &mut Vec<String>,
) -> Result<NodeContext, ModelError> {
    let zone = node
        .and_then(|n| n.metadata.labels.as_ref())
        .and_then(|l| l.get(LABEL_ZONE))
        .cloned();
    let addrs = node_addresses(node, settings, notes)?;
    let node_port_addresses = node_port_addresses(&addrs, settings)?;
    Ok(NodeContext {
        name: settings.node_name.clone(),
        zone,
        local_addrs: addrs.local,
        primary_v4: addrs.primary_v4,
        primary_v6: addrs.primary_v6,
        node_port_addresses,
        local_detector: local_detector(node, settings, notes),
        masquerade_all: settings.masquerade_all,
        service_cidrs: service_cidrs(cidr_objects)?,
    })
}

/// The node's local addresses and its primary address per family.
struct NodeAddrs {
    local: Vec<IpAddr>,
    primary_v4: Option<IpAddr>,
    primary_v6: Option<IpAddr>,
}

/// Local addresses: the --node-ip / bindAddress values, else every address of the Node
/// object, else the host's. Primary per family: the first --node-ip, else InternalIP
/// before ExternalIP (kube-proxy 1.34), else the host's lowest address.
fn node_addresses(
    node: Option<&Node>,
    settings: &NodeSettings,
    notes: &mut Vec<String>,
) -> Result<NodeAddrs, ModelError> {
    let mut local = settings.node_ips.clone();
    let mut primary_v4 = local.iter().copied().find(IpAddr::is_ipv4);
    let mut primary_v6 = local.iter().copied().find(IpAddr::is_ipv6);
    if local.is_empty() {
        if let Some(n) = node {
            let name = obj_name(&n.metadata);
            let addrs = n
                .status
                .as_ref()
                .and_then(|s| s.addresses.as_ref())
                .cloned()
                .unwrap_or_default();
            let mut ranked: Vec<(u8, IpAddr)> = Vec::new();
            for (i, a) in addrs.iter().enumerate() {
                let rank = match a.type_.as_str() {
                    "InternalIP" => 0,
                    "ExternalIP" => 1,
                    _ => continue,
                };
                let field = format!("status.addresses[{i}].address");
                let ip = parse_ip("Node", &name, &field, &a.address)?;
                local.push(ip);
                ranked.push((rank, ip));
            }
            ranked.sort_by_key(|(r, _)| *r);
            primary_v4 = ranked.iter().map(|(_, ip)| *ip).find(IpAddr::is_ipv4);
            primary_v6 = ranked.iter().map(|(_, ip)| *ip).find(IpAddr::is_ipv6);
        }
        if local.is_empty() && !settings.host_addrs.is_empty() {
            let missing = match node {
                Some(_) => format!(
                    "the Node {:?} has no InternalIP or ExternalIP",
                    settings.node_name
                ),
                None => format!("no Node named {:?}", settings.node_name),
            };
            notes.push(format!(
                "{missing} and neither --node-ip nor bindAddress is set: the node's addresses \
                 are taken from the host's ({}), the lowest of each family primary; set \
                 bindAddress (or --node-ip) to the node's IP",
                settings
                    .host_addrs
                    .iter()
                    .map(IpAddr::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            local = settings.host_addrs.clone();
            primary_v4 = local.iter().copied().filter(IpAddr::is_ipv4).min();
            primary_v6 = local.iter().copied().filter(IpAddr::is_ipv6).min();
        } else if local.is_empty() && !settings.node_name.is_empty() {
            notes.push(format!(
                "no Node named {:?} and no --node-ip: the node has no local addresses \
                 (NodePorts and local-source rules match nothing)",
                settings.node_name
            ));
        }
    }

    // Every address of the host is local to the node too, whatever gave the node's
    // addresses (a docker0 or flannel.1 address beside the InternalIP).
    local.extend(settings.host_addrs.iter().copied());
    local.sort();
    local.dedup();
    Ok(NodeAddrs {
        local,
        primary_v4,
        primary_v6,
    })
}

/// Where NodePorts answer: `nodePortAddresses` (CIDRs of local addresses, or
/// "primary"), else the primary addresses, or every local address where the mode says
/// so (iptables and IPVS modes).
fn node_port_addresses(
    addrs: &NodeAddrs,
    settings: &NodeSettings,
) -> Result<NodePortAddresses, ModelError> {
    let mut node_port_addresses = Vec::new();
    let mut match_all = false;
    let primaries: Vec<IpAddr> = addrs
        .primary_v4
        .into_iter()
        .chain(addrs.primary_v6)
        .collect();
    if settings.node_port_addresses.is_empty() {
        if settings.node_ports_on_every_address {
            match_all = true;
        } else {
            node_port_addresses = primaries.clone();
        }
    }
    for (i, s) in settings.node_port_addresses.iter().enumerate() {
        if s.trim() == "primary" {
            node_port_addresses.extend(primaries.iter().copied());
            continue;
        }
        let Some(net) = parse_cidr_sloppy(s) else {
            return Err(ModelError {
                kind: "KubeProxyConfiguration",
                object: "config".into(),
                field: format!("nodePortAddresses[{i}]"),
                message: format!("{s:?} is neither a CIDR nor \"primary\""),
            });
        };
        if net.prefix_len() == 0 {
            match_all = true;
        }
        node_port_addresses.extend(addrs.local.iter().copied().filter(|ip| net.contains(ip)));
    }
    node_port_addresses.retain(|ip| !ip.is_loopback());
    node_port_addresses.sort();
    node_port_addresses.dedup();
    Ok(if match_all {
        NodePortAddresses::All
    } else {
        NodePortAddresses::Addrs(node_port_addresses)
    })
}

/// What tells traffic from this node's pods apart (`detectLocalMode`).
fn local_detector(
    node: Option<&Node>,
    settings: &NodeSettings,
    notes: &mut Vec<String>,
) -> LocalDetector {
    match &settings.detect_local {
        DetectLocalMode::ClusterCidr if settings.cluster_cidrs.is_empty() => LocalDetector::None,
        DetectLocalMode::ClusterCidr => LocalDetector::Cidrs(settings.cluster_cidrs.clone()),
        DetectLocalMode::NodeCidr => {
            let cidrs: Vec<IpNet> = node
                .and_then(|n| n.spec.as_ref())
                .map(|s| {
                    s.pod_cidrs
                        .clone()
                        .or_else(|| s.pod_cidr.clone().map(|c| vec![c]))
                        .unwrap_or_default()
                })
                .unwrap_or_default()
                .iter()
                .filter_map(|c| parse_cidr_sloppy(c))
                .collect();
            if cidrs.is_empty() {
                notes.push(
                    "detectLocalMode NodeCIDR but the Node has no spec.podCIDRs: no detector"
                        .into(),
                );
                LocalDetector::None
            } else {
                LocalDetector::Cidrs(cidrs)
            }
        }
        DetectLocalMode::BridgeInterface(b) => LocalDetector::Bridge(b.clone()),
        DetectLocalMode::InterfaceNamePrefix(p) => LocalDetector::InterfacePrefix(p.clone()),
    }
}

/// The cluster's Service CIDRs, from its ServiceCIDR objects.
fn service_cidrs<'a>(
    cidr_objects: impl IntoIterator<Item = &'a ServiceCIDR>,
) -> Result<Vec<IpNet>, ModelError> {
    let mut service_cidrs = Vec::new();
    for sc in cidr_objects {
        let name = obj_name(&sc.metadata);
        let cidrs = sc
            .spec
            .as_ref()
            .and_then(|s| s.cidrs.clone())
            .unwrap_or_default();
        for (i, c) in cidrs.iter().enumerate() {
            service_cidrs.push(parse_cidr_sloppy(c).ok_or_else(|| ModelError {
                kind: "ServiceCIDR",
                object: name.clone(),
                field: format!("spec.cidrs[{i}]"),
                message: format!("{c:?} is not a CIDR"),
            })?);
        }
    }
    Ok(service_cidrs)
}

/// One Service's slices, by port: each slice's endpoints (as they are held, read in
/// place when joined) at each of its ports, in the slices' order.
#[derive(Debug, Default)]
pub(crate) struct SliceIndex<'a> {
    entries: Vec<SlicePortEntry<'a>>,
}

#[derive(Debug)]
struct SlicePortEntry<'a> {
    port_name: &'a str,
    protocol: Protocol,
    family: Family,
    port: u16,
    endpoints: &'a [SliceEndpoint],
}

impl<'a> SliceIndex<'a> {
    /// The (port number, endpoints) of every slice port of this name, protocol and
    /// family, in the slices' order.
    fn ports<'s>(
        &'s self,
        port_name: &'s str,
        protocol: Protocol,
        family: Family,
    ) -> impl Iterator<Item = (u16, &'a [SliceEndpoint])> + 's {
        self.entries
            .iter()
            .filter(move |e| {
                e.port_name == port_name && e.protocol == protocol && e.family == family
            })
            .map(|e| (e.port, e.endpoints))
    }
}

/// Indexes the slices of one Service (those its `kubernetes.io/service-name` joins to
/// it), as kube-proxy's `EndpointSliceCache` reads them.
pub(crate) fn index_slices<'a>(
    slices: impl IntoIterator<Item = &'a Slice>,
    notes: &mut Vec<String>,
) -> Result<SliceIndex<'a>, ModelError> {
    let mut index = SliceIndex::default();
    for slice in slices {
        let name = || obj_name(&slice.metadata);
        let labels = slice.metadata.labels.as_ref();
        if labels.is_some_and(|l| l.contains_key(LABEL_HEADLESS)) {
            continue;
        }
        if labels
            .and_then(|l| l.get(LABEL_SERVICE_NAME))
            .is_none_or(|s| s.is_empty())
        {
            notes.push(format!(
                "EndpointSlice {}: no {LABEL_SERVICE_NAME} label, ignored",
                name()
            ));
            continue;
        }
        let family = match slice.address_type.as_str() {
            "IPv4" => Family::V4,
            "IPv6" => Family::V6,
            "FQDN" => continue,
            other => {
                return Err(ModelError {
                    kind: "EndpointSlice",
                    object: name(),
                    field: "addressType".into(),
                    message: format!("{other:?} is not IPv4, IPv6 or FQDN"),
                });
            }
        };
        check_endpoints(slice, &name, family, notes)?;
        for (i, p) in slice.ports.iter().enumerate() {
            let Some(port_name) = p.name.as_deref() else {
                continue;
            };
            let port = match p.port {
                None | Some(0) => continue,
                Some(n) => u16::try_from(n).map_err(|_| ModelError {
                    kind: "EndpointSlice",
                    object: name(),
                    field: format!("ports[{i}].port"),
                    message: format!("{n} is not a port number"),
                })?,
            };
            let proto_s = p.protocol.as_deref().unwrap_or("TCP");
            let protocol = Protocol::parse(proto_s).ok_or_else(|| ModelError {
                kind: "EndpointSlice",
                object: name(),
                field: format!("ports[{i}].protocol"),
                message: format!("{proto_s:?} is not TCP, UDP or SCTP"),
            })?;
            index.entries.push(SlicePortEntry {
                port_name,
                protocol,
                family,
                port,
                endpoints: &slice.endpoints,
            });
        }
    }
    Ok(index)
}

/// Whether a slice's endpoints can be read: each first address is an address (else the
/// slice is in error); one of another family than the slice's is said in `notes`, and
/// left out when joined ([`slice_ip`]).
fn check_endpoints(
    slice: &Slice,
    name: &dyn Fn() -> String,
    family: Family,
    notes: &mut Vec<String>,
) -> Result<(), ModelError> {
    for (i, ep) in slice.endpoints.iter().enumerate() {
        match &ep.address {
            None => {}
            Some(Address::Invalid(text)) => {
                return Err(ModelError {
                    kind: "EndpointSlice",
                    object: name(),
                    field: format!("endpoints[{i}].addresses[0]"),
                    message: format!("{text:?} is not an IP address"),
                });
            }
            Some(Address::Ip(ip)) if Family::of(ip) != family => notes.push(format!(
                "EndpointSlice {}: endpoints[{i}] address {ip} is not {}, ignored",
                name(),
                family.as_k8s()
            )),
            Some(Address::Ip(_)) => {}
        }
    }
    Ok(())
}

/// An endpoint's address when it is one of `family` (the endpoints joined).
fn slice_ip(ep: &SliceEndpoint, family: Family) -> Option<IpAddr> {
    match ep.address {
        Some(Address::Ip(ip)) if Family::of(&ip) == family => Some(ip),
        _ => None,
    }
}

/// kube-proxy's `GetClusterIPByFamily`.
fn cluster_ip_for(
    spec: &k8s_openapi::api::core::v1::ServiceSpec,
    family: Family,
    name: &str,
) -> Result<Option<IpAddr>, ModelError> {
    let families = spec.ip_families.clone().unwrap_or_default();
    if families.is_empty() {
        let Some(ip) = spec
            .cluster_ip
            .as_deref()
            .filter(|s| !s.is_empty() && *s != "None")
        else {
            return Ok(None);
        };
        let ip = parse_ip("Service", name, "spec.clusterIP", ip)?;
        return Ok((Family::of(&ip) == family).then_some(ip));
    }
    let ips = spec.cluster_ips.clone().unwrap_or_default();
    for (idx, f) in families.iter().enumerate() {
        if f == family.as_k8s() {
            return match ips.get(idx) {
                Some(s) => {
                    let ip = parse_ip("Service", name, &format!("spec.clusterIPs[{idx}]"), s)?;
                    if Family::of(&ip) != family {
                        return Err(ModelError {
                            kind: "Service",
                            object: name.to_string(),
                            field: format!("spec.clusterIPs[{idx}]"),
                            message: format!("{ip} is not {} as spec.ipFamilies[{idx}] says", f),
                        });
                    }
                    Ok(Some(ip))
                }
                None => Ok(None),
            };
        }
    }
    Ok(None)
}

/// A Service read into its ports, per IP family, with their endpoints from `slices`:
/// none when another proxy owns it (its `service.kubernetes.io/service-proxy-name`), when
/// it is headless or an ExternalName, or has no spec.
pub(crate) fn service_ports(
    svc: &Service,
    slices: &SliceIndex,
    node: &NodeContext,
    default_scheduler: Scheduler,
    proxy_name: Option<&str>,
    notes: &mut Vec<String>,
) -> Result<Vec<ServicePort>, ModelError> {
    let name = obj_name(&svc.metadata);
    if !proxied_here(svc, &name, proxy_name, notes) {
        return Ok(vec![]);
    }
    let Some(spec) = svc.spec.as_ref() else {
        return Ok(vec![]);
    };
    let svc_type = spec.type_.as_deref().unwrap_or("ClusterIP");
    match spec.cluster_ip.as_deref() {
        None | Some("") | Some("None") => return Ok(vec![]),
        _ => {}
    }
    if svc_type == "ExternalName" {
        return Ok(vec![]);
    }
    let wide = ServiceWide::read(svc, spec, svc_type, &name, default_scheduler)?;
    let mut out = Vec::new();
    for family in [Family::V4, Family::V6] {
        let Some(addrs) = FamilyAddrs::read(svc, spec, family, &name, notes)? else {
            continue;
        };
        for (i, p) in spec.ports.iter().flatten().enumerate() {
            let (proto, port, node_port) = read_port(p, i, &name)?;
            let spn = ServicePortName {
                namespace: svc.metadata.namespace.clone().unwrap_or_default(),
                name: svc.metadata.name.clone().unwrap_or_default(),
                port: p.name.clone().unwrap_or_default(),
                protocol: proto,
            };
            let endpoints = join_endpoints(slices, &spn, family, &node.name, &wide.weights);
            let mut sp = ServicePort {
                name: spn,
                cluster_ip: addrs.cluster_ip,
                port,
                node_port,
                external_ips: addrs.external_ips.clone(),
                lb_vips: addrs.lb_vips.clone(),
                lb_source_ranges: addrs.lb_source_ranges.clone(),
                external_policy_local: wide.external_policy_local,
                internal_policy_local: wide.internal_policy_local,
                affinity: wide.affinity,
                health_check_node_port: wide.health_check_node_port,
                scheduler: wide.scheduler,
                endpoints,
                cat: Default::default(),
                cluster_table: Vec::new(),
                local_table: Vec::new(),
                name_hash: 0,
            };
            finish_port(&mut sp, node);
            out.push(sp);
        }
    }
    Ok(out)
}

/// Whether this proxy serves Service `svc` (named `name`): with `proxy_name` set, the
/// Services labelled with it; else those with no proxy-name label. A Service left to
/// another proxy is said in `notes`.
fn proxied_here(
    svc: &Service,
    name: &str,
    proxy_name: Option<&str>,
    notes: &mut Vec<String>,
) -> bool {
    let label = svc
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_SERVICE_PROXY_NAME))
        .map(String::as_str);
    let ours = match proxy_name.filter(|n| !n.is_empty()) {
        Some(mine) => label == Some(mine),
        None => label.is_none(),
    };
    if !ours {
        notes.push(match label {
            Some(other) => format!(
                "Service {name}: labelled {LABEL_SERVICE_PROXY_NAME}={other}, left to that proxy"
            ),
            None => format!(
                "Service {name}: not labelled {LABEL_SERVICE_PROXY_NAME}={}, left to the default proxy",
                proxy_name.unwrap_or_default()
            ),
        });
    }
    ours
}

/// What a Service's ports share, whatever their family: traffic policies, affinity, the
/// scheduler and endpoint weights (kxp's annotations), the health-check NodePort.
struct ServiceWide {
    external_policy_local: bool,
    internal_policy_local: bool,
    affinity: Affinity,
    scheduler: Scheduler,
    weights: BTreeMap<IpAddr, u32>,
    health_check_node_port: u16,
}

impl ServiceWide {
    fn read(
        svc: &Service,
        spec: &ServiceSpec,
        svc_type: &str,
        name: &str,
        default_scheduler: Scheduler,
    ) -> Result<ServiceWide, ModelError> {
        let nodeportish = svc_type == "NodePort" || svc_type == "LoadBalancer";
        let external_policy_local =
            nodeportish && spec.external_traffic_policy.as_deref() == Some("Local");
        let affinity = if spec.session_affinity.as_deref() == Some("ClientIP") {
            let t = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds)
                .unwrap_or(DEFAULT_AFFINITY_TIMEOUT as i32);
            Affinity::ClientIp {
                timeout_secs: t.clamp(1, 86_400) as u32,
            }
        } else {
            Affinity::None
        };
        let annotations = svc.metadata.annotations.clone().unwrap_or_default();
        let scheduler = match annotations.get(ANNOTATION_SCHEDULER) {
            Some(s) => Scheduler::parse(s).ok_or_else(|| ModelError {
                kind: "Service",
                object: name.to_string(),
                field: format!("metadata.annotations[{ANNOTATION_SCHEDULER}]"),
                message: format!(
                    "{s:?} is not a scheduler (random, rr, wrr, lc, wlc, sh, dh, sed, nq, maglev)"
                ),
            })?,
            None => default_scheduler,
        };
        let health_check_node_port = if svc_type == "LoadBalancer" && external_policy_local {
            spec.health_check_node_port.unwrap_or(0).clamp(0, 65535) as u16
        } else {
            0
        };
        Ok(ServiceWide {
            external_policy_local,
            internal_policy_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
            affinity,
            scheduler,
            weights: parse_weights(&annotations, name)?,
            health_check_node_port,
        })
    }
}

/// A Service's addresses of one IP family: its ClusterIP, externalIPs, load-balancer
/// source ranges and ingress IPs (those of `ipMode: Proxy` left to the load balancer).
struct FamilyAddrs {
    cluster_ip: IpAddr,
    external_ips: Vec<IpAddr>,
    lb_source_ranges: Vec<IpNet>,
    lb_vips: Vec<IpAddr>,
}

impl FamilyAddrs {
    /// `None` when the Service has no ClusterIP of `family`.
    fn read(
        svc: &Service,
        spec: &ServiceSpec,
        family: Family,
        name: &str,
        notes: &mut Vec<String>,
    ) -> Result<Option<FamilyAddrs>, ModelError> {
        let Some(cluster_ip) = cluster_ip_for(spec, family, name)? else {
            return Ok(None);
        };
        let mut external_ips = Vec::new();
        for (i, s) in spec.external_ips.iter().flatten().enumerate() {
            let ip = parse_ip("Service", name, &format!("spec.externalIPs[{i}]"), s)?;
            if Family::of(&ip) == family {
                external_ips.push(ip);
            }
        }
        let lb_source_ranges: Vec<IpNet> = spec
            .load_balancer_source_ranges
            .iter()
            .flatten()
            .filter_map(|s| {
                let net = parse_cidr_sloppy(s);
                if net.is_none() {
                    notes.push(format!(
                        "Service {name}: loadBalancerSourceRanges entry {s:?} is not a CIDR, ignored"
                    ));
                }
                net
            })
            .filter(|n| Family::of_net(n) == family)
            .collect();
        let mut lb_vips = Vec::new();
        let ingress = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|l| l.ingress.clone())
            .unwrap_or_default();
        for (i, ing) in ingress.iter().enumerate() {
            let Some(ip) = ing.ip.as_deref().filter(|s| !s.is_empty()) else {
                continue;
            };
            if ing.ip_mode.as_deref() == Some("Proxy") {
                continue;
            }
            let ip = parse_ip(
                "Service",
                name,
                &format!("status.loadBalancer.ingress[{i}].ip"),
                ip,
            )?;
            if Family::of(&ip) == family {
                lb_vips.push(ip);
            }
        }
        Ok(Some(FamilyAddrs {
            cluster_ip,
            external_ips,
            lb_source_ranges,
            lb_vips,
        }))
    }
}

/// Port `i` of Service `name`: its protocol, port and NodePort (0: none), checked.
fn read_port(
    p: &k8s_openapi::api::core::v1::ServicePort,
    i: usize,
    name: &str,
) -> Result<(Protocol, u16, u16), ModelError> {
    let err = |field: String, message: String| ModelError {
        kind: "Service",
        object: name.to_string(),
        field,
        message,
    };
    let proto_s = p.protocol.as_deref().unwrap_or("TCP");
    let proto = Protocol::parse(proto_s).ok_or_else(|| {
        err(
            format!("spec.ports[{i}].protocol"),
            format!("{proto_s:?} is not TCP, UDP or SCTP"),
        )
    })?;
    let port = u16::try_from(p.port)
        .ok()
        .filter(|&p| p != 0)
        .ok_or_else(|| {
            err(
                format!("spec.ports[{i}].port"),
                format!("{} is not a port number", p.port),
            )
        })?;
    let node_port = u16::try_from(p.node_port.unwrap_or(0)).map_err(|_| {
        err(
            format!("spec.ports[{i}].nodePort"),
            format!("{} is not a port number", p.node_port.unwrap_or(0)),
        )
    })?;
    Ok((proto, port, node_port))
}

/// Categorises endpoints and builds the consistent-hash tables a port's scheduler needs.
pub fn finish_port(sp: &mut ServicePort, node: &NodeContext) {
    sp.cat = categorize(
        &sp.endpoints,
        PolicyUse {
            uses_cluster: sp.uses_cluster_endpoints(),
            uses_local: sp.uses_local_endpoints(),
        },
        &node.name,
        node.zone.as_deref(),
    );
    if sp.scheduler.uses_hash_table() {
        sp.cluster_table = maglev_table(&sp.endpoints, &sp.cat.cluster);
        sp.local_table = maglev_table(&sp.endpoints, &sp.cat.local);
    } else {
        sp.cluster_table.clear();
        sp.local_table.clear();
    }
    sp.name_hash = nat::select::hash_bytes(
        sp.name.to_string().as_bytes(),
        sp.name.protocol.number() as u64,
    );
}

fn parse_weights(
    annotations: &BTreeMap<String, String>,
    name: &str,
) -> Result<BTreeMap<IpAddr, u32>, ModelError> {
    let mut out = BTreeMap::new();
    let Some(s) = annotations.get(ANNOTATION_WEIGHTS) else {
        return Ok(out);
    };
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let parsed = item.split_once('=').and_then(|(ip, w)| {
            Some((
                ip.trim().parse::<IpAddr>().ok()?,
                w.trim().parse::<u32>().ok()?,
            ))
        });
        let Some((ip, w)) = parsed else {
            return Err(ModelError {
                kind: "Service",
                object: name.to_string(),
                field: format!("metadata.annotations[{ANNOTATION_WEIGHTS}]"),
                message: format!("{item:?} is not IP=WEIGHT"),
            });
        };
        out.insert(ip, w);
    }
    Ok(out)
}

/// kube-proxy's `EndpointSliceCache`: every slice of the Service with a port of this name
/// and protocol contributes its endpoints at that slice's port number; duplicates
/// (`IP:PORT`) prefer a non-terminating one; the result is sorted by `IP:PORT`.
fn join_endpoints(
    slices: &SliceIndex,
    spn: &ServicePortName,
    family: Family,
    node_name: &str,
    weights: &BTreeMap<IpAddr, u32>,
) -> Vec<Endpoint> {
    // Sorted by `IP:PORT` as text and deduplicated (kube-proxy's map keyed by
    // `Endpoint.String()`): of one key, the first, replaced by any later one that is not
    // terminating. The sort is stable, so a key's endpoints keep their slices' order.
    let mut all: Vec<(TextKey, Endpoint)> = Vec::new();
    for (port, eps) in slices.ports(&spn.port, spn.protocol, family) {
        for e in eps {
            let Some(ip) = slice_ip(e, family) else {
                continue;
            };
            let addr = std::net::SocketAddr::new(ip, port);
            let hints = e.hints.as_deref();
            let ep = Endpoint {
                addr,
                is_local: !node_name.is_empty() && e.node_name.as_deref() == Some(node_name),
                ready: e.ready,
                serving: e.serving,
                terminating: e.terminating,
                zone_hints: hints.map(|h| h.zones.clone()).unwrap_or_default(),
                node_hints: hints.map(|h| h.nodes.clone()).unwrap_or_default(),
                weight: weights.get(&ip).copied().unwrap_or(1),
            };
            all.push((TextKey::of(addr), ep));
        }
    }
    all.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out: Vec<Endpoint> = Vec::with_capacity(all.len());
    let mut last: Option<TextKey> = None;
    for (k, ep) in all {
        match out.last_mut() {
            Some(prev) if last.as_ref() == Some(&k) => {
                if !ep.terminating {
                    *prev = ep;
                }
            }
            _ => {
                out.push(ep);
                last = Some(k);
            }
        }
    }
    out
}

/// An endpoint's `IP:PORT` ([`Endpoint::key`]) as bytes on the stack, compared as the
/// text is: sorting a million endpoints by it allocates nothing.
#[derive(Clone, PartialEq, Eq)]
struct TextKey {
    /// The longest is an IPv6 address with a zone index: `[` 39 `%` 10 `]:` 5 = 58.
    bytes: [u8; 64],
    len: u8,
}

impl TextKey {
    fn of(addr: std::net::SocketAddr) -> TextKey {
        use std::io::Write as _;
        let mut bytes = [0u8; 64];
        let len = match addr {
            // Digits written directly: a million of them through `fmt` were a twentieth
            // of a full sync.
            std::net::SocketAddr::V4(a) => {
                let mut n = 0;
                for (i, o) in a.ip().octets().into_iter().enumerate() {
                    if i > 0 {
                        bytes[n] = b'.';
                        n += 1;
                    }
                    n += put_decimal(&mut bytes[n..], u32::from(o));
                }
                bytes[n] = b':';
                n += 1;
                n + put_decimal(&mut bytes[n..], u32::from(a.port()))
            }
            std::net::SocketAddr::V6(_) => {
                let mut w = std::io::Cursor::new(&mut bytes[..]);
                // Cannot fail: 64 bytes hold any socket address's text.
                let _ = write!(w, "{addr}");
                w.position() as usize
            }
        };
        TextKey {
            bytes,
            len: len as u8,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

/// Writes `v` in decimal at the start of `out` (room for its digits); how many bytes.
fn put_decimal(out: &mut [u8], mut v: u32) -> usize {
    let mut digits = [0u8; 10];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    let n = digits.len() - i;
    out[..n].copy_from_slice(&digits[i..]);
    n
}

impl Ord for TextKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_bytes().cmp(other.as_bytes())
    }
}

impl PartialOrd for TextKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

#[cfg(test)]
mod text_key_tests {
    use super::TextKey;
    use std::net::SocketAddr;

    /// Endpoints sort as their `IP:PORT` texts do (kube-proxy's order), whatever the
    /// family, the lengths and the zone index.
    #[test]
    fn text_keys_order_as_the_texts_do() {
        let addrs: Vec<SocketAddr> = [
            "10.0.0.10:80",
            "10.0.0.2:80",
            "10.0.0.2:8080",
            "10.0.0.2:8",
            "9.255.255.255:65535",
            "0.0.0.0:0",
            "100.20.3.0:10",
            "[fd00::1]:80",
            "[fd00::10]:80",
            "[::ffff:10.0.0.1]:443",
            "[fe80::1%4294967295]:65535",
            "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:1",
        ]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
        for a in &addrs {
            assert_eq!(TextKey::of(*a).as_bytes(), a.to_string().as_bytes());
            for b in &addrs {
                assert_eq!(
                    TextKey::of(*a).cmp(&TextKey::of(*b)),
                    a.to_string().cmp(&b.to_string()),
                    "{a} {b}"
                );
            }
        }
    }
}
