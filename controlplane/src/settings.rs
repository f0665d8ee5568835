//! From a KubeProxyConfiguration and command-line flags to the node settings the Service
//! model needs, with kube-proxy's precedence: the file's values, then
//! `--hostname-override`, which always wins.

use std::net::IpAddr;

use ipnet::IpNet;

use nat::select::Scheduler;
use translate::k8s::{DetectLocalMode, NodeSettings};

use crate::config::{ConfigError, KubeProxyConfiguration};

/// Flags that shape the node's settings.
#[derive(Debug, Clone, Default)]
pub struct NodeFlags {
    pub hostname_override: Option<String>,
    pub node_ips: Vec<IpAddr>,
}

/// kube-proxy's `GetHostname`: the override, else the host's name; trimmed, lower case.
///
/// # Errors
/// When neither gives a name.
pub fn hostname(override_: Option<&str>) -> Result<String, String> {
    let raw = match override_.map(str::trim).filter(|s| !s.is_empty()) {
        Some(h) => h.to_string(),
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_default(),
    };
    let h = raw.trim().to_lowercase();
    if h.is_empty() {
        return Err("empty hostname; give --hostname-override NODE".into());
    }
    Ok(h)
}

/// Builds the node settings from the configuration file (if any) and flags.
///
/// # Errors
/// A field with a value kxp cannot use, named as in the file.
pub fn node_settings(
    cfg: Option<&KubeProxyConfiguration>,
    flags: &NodeFlags,
    origin: &str,
) -> Result<NodeSettings, ConfigError> {
    let invalid = |field: &str, message: String| ConfigError::Invalid {
        path: origin.to_string(),
        field: field.to_string(),
        message,
    };
    let default_cfg = KubeProxyConfiguration::default();
    let cfg = cfg.unwrap_or(&default_cfg);
    let override_ = flags
        .hostname_override
        .as_deref()
        .or(cfg.hostname_override.as_deref());
    let node_name = hostname(override_).map_err(|m| invalid("hostnameOverride", m))?;
    let cluster_cidrs = cluster_cidrs(cfg, &invalid)?;
    let detect_local = detect_local(cfg, &invalid)?;
    let default_scheduler = match cfg.scheduler() {
        None => Scheduler::Random,
        Some(s) => Scheduler::parse(s).ok_or_else(|| {
            invalid(
                "kxp.scheduler",
                format!(
                    "{s:?} is not a scheduler (random, rr, wrr, lc, wlc, sh, dh, sed, nq, maglev)"
                ),
            )
        })?,
    };
    let mut node_ips = flags.node_ips.clone();
    if node_ips.is_empty()
        && let Some(b) = cfg
            .bind_address
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
    {
        let ip: IpAddr = b
            .parse()
            .map_err(|_| invalid("bindAddress", format!("{b:?} is not an IP address")))?;
        if !ip.is_unspecified() {
            node_ips.push(ip);
        }
    }
    Ok(NodeSettings {
        node_name,
        node_ips,
        host_addrs: Vec::new(),
        cluster_cidrs,
        detect_local,
        node_port_addresses: cfg.node_port_addresses.clone().unwrap_or_default(),
        // kube-proxy's iptables mode (its default on Linux: `mode: ""`, as kubeadm
        // writes it) and IPVS mode answer NodePorts on every local address; nftables on
        // the primary IPs.
        node_ports_on_every_address: cfg.mode.as_deref().map(str::trim) != Some("nftables"),
        network_policy: cfg.network_policy(),
        masquerade_all: cfg.masquerade_all(),
        default_scheduler,
        service_proxy_name: cfg.service_proxy_name.clone().filter(|n| !n.is_empty()),
    })
}

/// An error about field `field` of the configuration, with its message.
type Invalid<'a> = dyn Fn(&str, String) -> ConfigError + 'a;

/// The cluster's pod CIDRs: `clusterCIDR` (comma-separated), else
/// `detectLocal.clusterCIDRs`.
fn cluster_cidrs(
    cfg: &KubeProxyConfiguration,
    invalid: &Invalid<'_>,
) -> Result<Vec<IpNet>, ConfigError> {
    let cidr_texts: Vec<(String, String)> = match (
        &cfg.cluster_cidr,
        cfg.detect_local
            .as_ref()
            .and_then(|d| d.cluster_cidrs.clone()),
    ) {
        (Some(s), _) if !s.trim().is_empty() => s
            .split(',')
            .map(|c| ("clusterCIDR".to_string(), c.to_string()))
            .collect(),
        (_, Some(list)) => list
            .into_iter()
            .enumerate()
            .map(|(i, c)| (format!("detectLocal.clusterCIDRs[{i}]"), c))
            .collect(),
        _ => vec![],
    };
    let mut cluster_cidrs = Vec::new();
    for (field, c) in cidr_texts {
        let c = c.trim();
        if c.is_empty() {
            continue;
        }
        let net = translate::sloppy::parse_cidr_sloppy(c)
            .filter(|_| c.contains('/'))
            .ok_or_else(|| invalid(&field, format!("{c:?} is not a CIDR")))?;
        cluster_cidrs.push(net);
    }
    Ok(cluster_cidrs)
}

/// `detectLocalMode` with the `detectLocal` field it needs.
fn detect_local(
    cfg: &KubeProxyConfiguration,
    invalid: &Invalid<'_>,
) -> Result<DetectLocalMode, ConfigError> {
    let dl = cfg.detect_local.clone().unwrap_or_default();
    Ok(match cfg.detect_local_mode.as_deref().unwrap_or("") {
        "" | "ClusterCIDR" => DetectLocalMode::ClusterCidr,
        "NodeCIDR" => DetectLocalMode::NodeCidr,
        "BridgeInterface" => DetectLocalMode::BridgeInterface(
            dl.bridge_interface
                .filter(|s| !s.is_empty())
                .ok_or_else(|| {
                    invalid(
                        "detectLocal.bridgeInterface",
                        "required with detectLocalMode BridgeInterface".into(),
                    )
                })?,
        ),
        "InterfaceNamePrefix" => DetectLocalMode::InterfaceNamePrefix(
            dl.interface_name_prefix
                .filter(|s| !s.is_empty())
                .ok_or_else(|| {
                    invalid(
                        "detectLocal.interfaceNamePrefix",
                        "required with detectLocalMode InterfaceNamePrefix".into(),
                    )
                })?,
        ),
        other => {
            return Err(invalid(
                "detectLocalMode",
                format!("{other:?} is not a local-detection mode"),
            ));
        }
    })
}

/// Whether kube-proxy would answer NodePorts on 127.0.0.1 (IPv4) with `cfg`: its
/// iptables mode (`mode` unset or `iptables`) with `iptables.localhostNodePorts` (true by
/// default), when `nodePortAddresses` is empty or holds a CIDR with 127.0.0.1
/// (kube-proxy's `ContainsIPv4Loopback`). IPVS and nftables modes have none.
pub fn localhost_node_ports(cfg: Option<&KubeProxyConfiguration>) -> bool {
    let default_cfg = KubeProxyConfiguration::default();
    let cfg = cfg.unwrap_or(&default_cfg);
    let iptables_mode = matches!(
        cfg.mode.as_deref().map(str::trim),
        None | Some("" | "iptables")
    );
    let on = cfg
        .iptables
        .as_ref()
        .and_then(|t| t.localhost_node_ports)
        .unwrap_or(true);
    let addrs = cfg.node_port_addresses.as_deref().unwrap_or_default();
    let loopback = addrs.is_empty()
        || addrs.iter().any(|a| {
            translate::sloppy::parse_cidr_sloppy(a)
                .is_some_and(|n| n.contains(&std::net::IpAddr::from([127, 0, 0, 1])))
        });
    iptables_mode && on && loopback
}
