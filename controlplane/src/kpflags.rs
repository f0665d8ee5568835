//! kube-proxy's command line (1.34, Linux): every flag its `--help` lists parses, with
//! pflag's syntax, so a kube-proxy DaemonSet's container arguments start kxp unchanged.
//!
//! - Flags build a KubeProxyConfiguration the way kube-proxy's do; with `--config` the
//!   file wins over them, except `--hostname-override` and the logging flags.
//! - The flags that mean something to kxp take effect; the others are accepted and named
//!   once at start as not applicable ([`KubeProxyFlags::not_applicable`]).
//! - pflag's syntax: `--flag=value` or `--flag value`, a bool as `--flag` or
//!   `--flag=false`, `_` and `-` alike in names, the last occurrence of a flag wins.
//! - Invoked as `kube-proxy` (a symlink or a renamed binary), or with flags and no
//!   subcommand, kxp behaves as `kxp run`.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};

use crate::config::{
    ClientConnection, Conntrack, DetectLocal, GoDuration, IpTables, Ipvs, KubeProxyConfiguration,
    NfTables,
};

/// kube-proxy 1.34's flags on Linux, as its `--help` lists them (without `-h`), plus the
/// two deprecated ones it hides (`--healthz-port`, `--metrics-port`).
pub const KUBE_PROXY_FLAGS: &[&str] = &[
    "bind-address",
    "bind-address-hard-fail",
    "boot-id-file",
    "cleanup",
    "cluster-cidr",
    "config",
    "config-sync-period",
    "conntrack-max-per-core",
    "conntrack-min",
    "conntrack-tcp-be-liberal",
    "conntrack-tcp-timeout-close-wait",
    "conntrack-tcp-timeout-established",
    "conntrack-udp-timeout",
    "conntrack-udp-timeout-stream",
    "detect-local-mode",
    "feature-gates",
    "healthz-bind-address",
    "healthz-port",
    "hostname-override",
    "init-only",
    "iptables-localhost-nodeports",
    "iptables-masquerade-bit",
    "iptables-min-sync-period",
    "iptables-sync-period",
    "ipvs-exclude-cidrs",
    "ipvs-min-sync-period",
    "ipvs-scheduler",
    "ipvs-strict-arp",
    "ipvs-sync-period",
    "ipvs-tcp-timeout",
    "ipvs-tcpfin-timeout",
    "ipvs-udp-timeout",
    "kube-api-burst",
    "kube-api-content-type",
    "kube-api-qps",
    "kubeconfig",
    "log-flush-frequency",
    "log-json-info-buffer-size",
    "log-json-split-stream",
    "log-text-info-buffer-size",
    "log-text-split-stream",
    "logging-format",
    "machine-id-file",
    "masquerade-all",
    "master",
    "metrics-bind-address",
    "metrics-port",
    "nodeport-addresses",
    "oom-score-adj",
    "pod-bridge-interface",
    "pod-interface-name-prefix",
    "profiling",
    "proxy-mode",
    "show-hidden-metrics-for-version",
    "v",
    "version",
    "vmodule",
    "write-config-to",
];

/// kube-proxy's default health and metrics addresses.
pub const HEALTHZ_DEFAULT: &str = "0.0.0.0:10256";
pub const METRICS_DEFAULT: &str = "127.0.0.1:10249";

/// kube-proxy's own command-line flags, with the same names and meanings. As in
/// kube-proxy, they are ignored when `--config` is given (the file wins), except
/// `--hostname-override` and the logging flags.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "kube-proxy's flags")]
pub struct KubeProxyFlags {
    /// Feature gates (key=true|false,...). kxp has none of its own; each is named at start.
    #[arg(long, value_name = "KEY=BOOL,...", value_parser = parse_feature_gates)]
    pub feature_gates: Option<BTreeMap<String, bool>>,
    /// Content type of requests to the API server (kxp's client speaks JSON).
    #[arg(long, value_name = "TYPE")]
    pub kube_api_content_type: Option<String>,
    /// Burst of requests to the API server (with --kube-api-qps).
    #[arg(long, value_name = "N")]
    pub kube_api_burst: Option<i32>,
    /// Requests per second to the API server.
    #[arg(long, value_name = "QPS")]
    pub kube_api_qps: Option<f32>,
    /// The node's primary IP (kube-proxy's name is historical: nothing binds to it).
    #[arg(long, value_name = "IP", value_parser = parse_ip_or_empty)]
    pub bind_address: Option<String>,
    /// Where /healthz and /livez are served (IP or IP:PORT, default 0.0.0.0:10256; ""
    /// for none).
    #[arg(long, value_name = "IP[:PORT]", value_parser = parse_ip_port_or_empty)]
    pub healthz_bind_address: Option<String>,
    /// Where /metrics, /proxyMode and /configz are served (IP or IP:PORT, default
    /// 127.0.0.1:10249; "" for none).
    #[arg(long, value_name = "IP[:PORT]", value_parser = parse_ip_port_or_empty)]
    pub metrics_bind_address: Option<String>,
    /// Exit when the health or metrics address cannot be bound (else retry every 5 s).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub bind_address_hard_fail: Option<bool>,
    /// pprof endpoints (not applicable: kxp is no Go program).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub profiling: Option<bool>,
    /// Hidden metrics of a previous version (kxp hides none).
    #[arg(long, value_name = "MAJOR.MINOR")]
    pub show_hidden_metrics_for_version: Option<String>,
    /// Do the initialisation that needs full privileges, then exit (kxp has none apart:
    /// it checks its configuration and exits).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub init_only: Option<bool>,
    /// iptables, ipvs or nftables: the mode kxp stands in for (its dataplane is the
    /// same; ipvs picks --ipvs-scheduler and the ipvs sync periods).
    #[arg(long, value_name = "MODE", value_parser = parse_proxy_mode)]
    pub proxy_mode: Option<String>,
    /// The fwmark bit iptables marks packets to masquerade with (kxp marks nothing).
    #[arg(long, value_name = "BIT", value_parser = clap::value_parser!(i32).range(0..=31))]
    pub iptables_masquerade_bit: Option<i32>,
    /// Masquerade all traffic sent to Service ClusterIPs.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub masquerade_all: Option<bool>,
    /// NodePorts on 127.0.0.1 (kxp, as kube-proxy's nftables and ipvs modes, has none).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub iptables_localhost_nodeports: Option<bool>,
    /// Full resync period (not in ipvs mode).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub iptables_sync_period: Option<GoDuration>,
    /// Minimum time between syncs (not in ipvs mode).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub iptables_min_sync_period: Option<GoDuration>,
    /// Full resync period (ipvs mode).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub ipvs_sync_period: Option<GoDuration>,
    /// Minimum time between syncs (ipvs mode).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub ipvs_min_sync_period: Option<GoDuration>,
    /// The IPVS scheduler (rr, wrr, lc, wlc, sh, dh, sed, nq; kxp's dataplane runs it).
    #[arg(long, value_name = "NAME")]
    pub ipvs_scheduler: Option<String>,
    /// CIDRs IPVS cleanup leaves alone (kxp programs no IPVS).
    #[arg(long, value_name = "CIDR,...", value_delimiter = ',')]
    pub ipvs_exclude_cidrs: Option<Vec<String>>,
    /// arp_ignore/arp_announce for kube-ipvs0 (kxp programs no IPVS).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub ipvs_strict_arp: Option<bool>,
    /// IPVS's TCP idle timeout (kxp's come from --conntrack-*).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub ipvs_tcp_timeout: Option<GoDuration>,
    /// IPVS's timeout after FIN (kxp's come from --conntrack-*).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub ipvs_tcpfin_timeout: Option<GoDuration>,
    /// IPVS's UDP timeout (kxp's come from --conntrack-*).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub ipvs_udp_timeout: Option<GoDuration>,
    /// ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix.
    #[arg(long, value_name = "MODE")]
    pub detect_local_mode: Option<String>,
    /// The pods' bridge (detect-local-mode BridgeInterface).
    #[arg(long, value_name = "IF")]
    pub pod_bridge_interface: Option<String>,
    /// The pods' interface name prefix (detect-local-mode InterfaceNamePrefix).
    #[arg(long, value_name = "PREFIX")]
    pub pod_interface_name_prefix: Option<String>,
    /// The pods' CIDR range(s), comma-separated for dual-stack.
    #[arg(long, value_name = "CIDR[,CIDR]")]
    pub cluster_cidr: Option<String>,
    /// Node addresses (CIDRs, or "primary") that accept NodePort traffic.
    #[arg(long, value_name = "CIDR,...", value_delimiter = ',')]
    pub nodeport_addresses: Option<Vec<String>>,
    /// The process's oom_score_adj (default -999).
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-1000..=1000))]
    pub oom_score_adj: Option<i32>,
    /// Connection-tracking entries per CPU (default 32768).
    #[arg(long, value_name = "N")]
    pub conntrack_max_per_core: Option<i32>,
    /// Minimum connection-tracking entries (default 131072).
    #[arg(long, value_name = "N")]
    pub conntrack_min: Option<i32>,
    /// Liberal TCP tracking (kxp never drops a segment for its window: always liberal).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub conntrack_tcp_be_liberal: Option<bool>,
    /// Idle timeout of established TCP flows (e.g. 24h0m0s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub conntrack_tcp_timeout_established: Option<GoDuration>,
    /// Timeout of TCP flows in CLOSE_WAIT (e.g. 1h0m0s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub conntrack_tcp_timeout_close_wait: Option<GoDuration>,
    /// Timeout of unreplied UDP flows (0 = Linux's 30s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub conntrack_udp_timeout: Option<GoDuration>,
    /// Timeout of UDP streams (0 = Linux's 120s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub conntrack_udp_timeout_stream: Option<GoDuration>,
    /// Informer resync period (not applicable: kxp's full sync is the sync period).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub config_sync_period: Option<GoDuration>,
    /// Deprecated: the health port (0 = no health server) when --healthz-bind-address
    /// has none.
    #[arg(long, hide = true, value_name = "PORT")]
    pub healthz_port: Option<i32>,
    /// Deprecated: the metrics port (0 = no metrics server) when --metrics-bind-address
    /// has none.
    #[arg(long, hide = true, value_name = "PORT")]
    pub metrics_port: Option<i32>,
    /// Per-file verbosity of Go's klog (not applicable).
    #[arg(long, value_name = "PATTERN=N,...")]
    pub vmodule: Option<String>,
    /// Longest time between log flushes (kxp writes each line as it is logged).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub log_flush_frequency: Option<GoDuration>,
    /// Text format: errors to stderr, the rest to stdout.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub log_text_split_stream: Option<bool>,
    /// JSON format: errors to stderr, the rest to stdout.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub log_json_split_stream: Option<bool>,
    /// Buffer of info lines with split streams (kxp does not buffer).
    #[arg(long, value_name = "QUANTITY")]
    pub log_text_info_buffer_size: Option<String>,
    /// Buffer of info lines with split streams (kxp does not buffer).
    #[arg(long, value_name = "QUANTITY")]
    pub log_json_info_buffer_size: Option<String>,
    /// cAdvisor's boot id files (kxp reads the kernel's boot id for its state files).
    #[arg(long, value_name = "PATH,...")]
    pub boot_id_file: Option<String>,
    /// cAdvisor's machine id files (not applicable).
    #[arg(long, value_name = "PATH,...")]
    pub machine_id_file: Option<String>,
    /// Print the version and exit (--version=raw for more).
    #[arg(long, value_name = "true|raw", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub version: Option<String>,
}

fn parse_duration(s: &str) -> Result<GoDuration, String> {
    crate::config::parse_go_duration(s).map(GoDuration)
}

/// Go's `strconv.ParseBool`.
pub fn parse_go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err(format!("{s:?} is not a bool (true or false)")),
    }
}

fn parse_feature_gates(s: &str) -> Result<BTreeMap<String, bool>, String> {
    let mut out = BTreeMap::new();
    for kv in s.split(',').map(str::trim).filter(|kv| !kv.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("{kv:?} is not KEY=BOOL"))?;
        out.insert(k.trim().to_string(), parse_go_bool(v.trim())?);
    }
    Ok(out)
}

fn parse_ip_or_empty(s: &str) -> Result<String, String> {
    if s.is_empty() || s.parse::<IpAddr>().is_ok() {
        Ok(s.to_string())
    } else {
        Err(format!("{s:?} is not an IP address"))
    }
}

fn parse_ip_port_or_empty(s: &str) -> Result<String, String> {
    if s.is_empty() || s.parse::<IpAddr>().is_ok() || s.parse::<SocketAddr>().is_ok() {
        Ok(s.to_string())
    } else {
        Err(format!(
            "{s:?} is not IP or IP:PORT (e.g. 0.0.0.0:10256, [::]:10256)"
        ))
    }
}

fn parse_proxy_mode(s: &str) -> Result<String, String> {
    match s {
        "" | "iptables" | "ipvs" | "nftables" => Ok(s.to_string()),
        "kernelspace" => {
            Err("kernelspace is the Windows mode; on Linux: iptables, ipvs or nftables".into())
        }
        _ => Err(format!(
            "{s:?} is not a proxy mode (iptables, ipvs or nftables)"
        )),
    }
}

/// An address as kube-proxy's defaulting leaves it: `""` stays (no server), an IP alone
/// gets `port`.
pub fn bind_address(s: &str, port: u16) -> Result<Option<SocketAddr>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(Some(SocketAddr::new(ip, port)));
    }
    s.parse()
        .map(Some)
        .map_err(|_| format!("{s:?} is not IP or IP:PORT"))
}

/// kube-proxy's `addressFromDeprecatedFlags`: port 0 turns the server off; another port
/// is appended to an address that has none.
fn with_deprecated_port(addr: String, port: Option<i32>) -> String {
    match port {
        None => addr,
        Some(0) => String::new(),
        Some(p) => match (addr.parse::<IpAddr>(), u16::try_from(p)) {
            (Ok(ip), Ok(port)) => SocketAddr::new(ip, port).to_string(),
            // Out of range: kept as given, so that the address is refused with its value.
            (Ok(_), Err(_)) => format!("{addr}:{p}"),
            (Err(_), _) => addr,
        },
    }
}

impl KubeProxyFlags {
    /// The flags as a KubeProxyConfiguration — what kube-proxy builds when there is no
    /// `--config`: its defaults, then every flag given — and the names of the flags given.
    pub fn to_config(&self) -> (KubeProxyConfiguration, Vec<&'static str>) {
        let mut c = self.top_level();
        c.client_connection = self.client_connection();
        // kube-proxy applies the iptables periods unless the mode is ipvs, and the ipvs
        // ones only in ipvs mode.
        let ipvs_mode = c.mode.as_deref() == Some("ipvs");
        let (sync, min_sync) = if ipvs_mode {
            (self.ipvs_sync_period, self.ipvs_min_sync_period)
        } else {
            (self.iptables_sync_period, self.iptables_min_sync_period)
        };
        c.sync_period = sync;
        c.min_sync_period = min_sync;
        let ipt = IpTables {
            masquerade_bit: self.iptables_masquerade_bit,
            localhost_node_ports: self.iptables_localhost_nodeports,
            ..Default::default()
        };
        c.iptables = (ipt != IpTables::default()).then_some(ipt);
        c.nftables = self.masquerade_all.map(|m| NfTables {
            masquerade_all: Some(m),
            ..Default::default()
        });
        let ipvs = Ipvs {
            scheduler: self.ipvs_scheduler.clone().filter(|s| !s.is_empty()),
            exclude_cidrs: self.ipvs_exclude_cidrs.clone(),
            strict_arp: self.ipvs_strict_arp,
            tcp_timeout: self.ipvs_tcp_timeout,
            tcp_fin_timeout: self.ipvs_tcpfin_timeout,
            udp_timeout: self.ipvs_udp_timeout,
            ..Default::default()
        };
        c.ipvs = (ipvs != Ipvs::default()).then_some(ipvs);
        let dl = DetectLocal {
            bridge_interface: self.pod_bridge_interface.clone(),
            interface_name_prefix: self.pod_interface_name_prefix.clone(),
            ..Default::default()
        };
        c.detect_local = (dl != DetectLocal::default()).then_some(dl);
        c.conntrack = self.conntrack();
        (c, self.given())
    }

    /// The configuration's top-level fields: kube-proxy's defaults and the flags that
    /// set them.
    fn top_level(&self) -> KubeProxyConfiguration {
        let mode = self.proxy_mode.clone().filter(|m| !m.is_empty());
        let healthz = with_deprecated_port(
            self.healthz_bind_address
                .clone()
                .unwrap_or_else(|| HEALTHZ_DEFAULT.to_string()),
            self.healthz_port,
        );
        let metrics = with_deprecated_port(
            self.metrics_bind_address
                .clone()
                .unwrap_or_else(|| METRICS_DEFAULT.to_string()),
            self.metrics_port,
        );
        KubeProxyConfiguration {
            api_version: Some(crate::config::API_VERSIONS[0].to_string()),
            kind: Some("KubeProxyConfiguration".to_string()),
            mode: Some(mode.unwrap_or_else(|| "nftables".to_string())),
            healthz_bind_address: Some(healthz),
            metrics_bind_address: Some(metrics),
            feature_gates: self.feature_gates.clone(),
            bind_address: self.bind_address.clone().filter(|b| !b.is_empty()),
            bind_address_hard_fail: self.bind_address_hard_fail,
            enable_profiling: self.profiling,
            show_hidden_metrics_for_version: self.show_hidden_metrics_for_version.clone(),
            cluster_cidr: self.cluster_cidr.clone(),
            node_port_addresses: self.nodeport_addresses.clone(),
            detect_local_mode: self.detect_local_mode.clone(),
            oom_score_adj: self.oom_score_adj,
            config_sync_period: self.config_sync_period,
            ..Default::default()
        }
    }

    /// `clientConnection`, when a `--kube-api-*` flag is given.
    fn client_connection(&self) -> Option<ClientConnection> {
        let any = self.kube_api_content_type.is_some()
            || self.kube_api_burst.is_some()
            || self.kube_api_qps.is_some();
        any.then(|| ClientConnection {
            content_type: self.kube_api_content_type.clone(),
            burst: self.kube_api_burst,
            qps: self.kube_api_qps.map(f64::from),
            ..Default::default()
        })
    }

    /// `conntrack`, when a `--conntrack-*` flag is given.
    fn conntrack(&self) -> Option<Conntrack> {
        let ct = Conntrack {
            max_per_core: self.conntrack_max_per_core,
            min: self.conntrack_min,
            tcp_established_timeout: self.conntrack_tcp_timeout_established,
            tcp_close_wait_timeout: self.conntrack_tcp_timeout_close_wait,
            tcp_be_liberal: self.conntrack_tcp_be_liberal,
            udp_timeout: self.conntrack_udp_timeout,
            udp_stream_timeout: self.conntrack_udp_timeout_stream,
        };
        (ct != Conntrack::default()).then_some(ct)
    }

    /// The names of the flags given, in kube-proxy's order. (`--healthz-bind-address` is
    /// not among them: kxp applies it over the file too.)
    fn given(&self) -> Vec<&'static str> {
        let kube_api = self.client_connection().is_some();
        [
            (self.proxy_mode.is_some(), "--proxy-mode"),
            (self.healthz_port.is_some(), "--healthz-port"),
            (
                self.metrics_bind_address.is_some(),
                "--metrics-bind-address",
            ),
            (self.metrics_port.is_some(), "--metrics-port"),
            (self.feature_gates.is_some(), "--feature-gates"),
            (self.bind_address.is_some(), "--bind-address"),
            (
                self.bind_address_hard_fail.is_some(),
                "--bind-address-hard-fail",
            ),
            (self.profiling.is_some(), "--profiling"),
            (
                self.show_hidden_metrics_for_version.is_some(),
                "--show-hidden-metrics-for-version",
            ),
            (self.cluster_cidr.is_some(), "--cluster-cidr"),
            (self.nodeport_addresses.is_some(), "--nodeport-addresses"),
            (self.detect_local_mode.is_some(), "--detect-local-mode"),
            (self.oom_score_adj.is_some(), "--oom-score-adj"),
            (self.config_sync_period.is_some(), "--config-sync-period"),
            (kube_api, "--kube-api-*"),
            (self.masquerade_all.is_some(), "--masquerade-all"),
            (self.conntrack().is_some(), "--conntrack-*"),
            (
                self.iptables_masquerade_bit.is_some(),
                "--iptables-masquerade-bit",
            ),
            (
                self.iptables_localhost_nodeports.is_some(),
                "--iptables-localhost-nodeports",
            ),
            (
                self.iptables_sync_period.is_some(),
                "--iptables-sync-period",
            ),
            (
                self.iptables_min_sync_period.is_some(),
                "--iptables-min-sync-period",
            ),
            (self.ipvs_sync_period.is_some(), "--ipvs-sync-period"),
            (
                self.ipvs_min_sync_period.is_some(),
                "--ipvs-min-sync-period",
            ),
            (self.ipvs_scheduler.is_some(), "--ipvs-scheduler"),
            (self.ipvs_exclude_cidrs.is_some(), "--ipvs-exclude-cidrs"),
            (self.ipvs_strict_arp.is_some(), "--ipvs-strict-arp"),
            (
                self.ipvs_tcp_timeout.is_some()
                    || self.ipvs_tcpfin_timeout.is_some()
                    || self.ipvs_udp_timeout.is_some(),
                "--ipvs-*-timeout",
            ),
            (
                self.pod_bridge_interface.is_some(),
                "--pod-bridge-interface",
            ),
            (
                self.pod_interface_name_prefix.is_some(),
                "--pod-interface-name-prefix",
            ),
        ]
        .into_iter()
        .filter_map(|(set, name)| set.then_some(name))
        .collect()
    }

    /// The flags given that kxp accepts and does not apply, each with why (named once at
    /// start; with `--config` the file's fields are checked instead).
    pub fn not_applicable(&self) -> Vec<(&'static str, &'static str)> {
        let mut out = Vec::new();
        let mut n = |set: bool, flag: &'static str, why: &'static str| {
            if set {
                out.push((flag, why));
            }
        };
        n(
            self.feature_gates.as_ref().is_some_and(|g| !g.is_empty()),
            "--feature-gates",
            "kxp has no feature gates; it implements kube-proxy's current defaults",
        );
        n(
            self.kube_api_content_type
                .as_deref()
                .is_some_and(|t| t.contains("protobuf")),
            "--kube-api-content-type",
            "kxp's client speaks JSON",
        );
        n(
            self.profiling == Some(true),
            "--profiling",
            "kxp serves no pprof endpoints",
        );
        n(
            self.show_hidden_metrics_for_version
                .as_deref()
                .is_some_and(|v| !v.is_empty()),
            "--show-hidden-metrics-for-version",
            "kxp has no hidden metrics",
        );
        n(
            self.iptables_masquerade_bit.is_some(),
            "--iptables-masquerade-bit",
            "kxp marks no packets (it masquerades in its own dataplane)",
        );
        n(
            self.ipvs_exclude_cidrs.is_some(),
            "--ipvs-exclude-cidrs",
            "kxp programs no IPVS",
        );
        n(
            self.ipvs_strict_arp.is_some(),
            "--ipvs-strict-arp",
            "kxp programs no IPVS (no kube-ipvs0 addresses to hide)",
        );
        n(
            self.ipvs_tcp_timeout.is_some()
                || self.ipvs_tcpfin_timeout.is_some()
                || self.ipvs_udp_timeout.is_some(),
            "--ipvs-tcp-timeout/--ipvs-tcpfin-timeout/--ipvs-udp-timeout",
            "kxp's flow timeouts come from --conntrack-*",
        );
        n(
            self.config_sync_period.is_some(),
            "--config-sync-period",
            "an informer's resync; kxp's watches deliver every change, and its periodic full sync is the sync period",
        );
        n(
            self.vmodule.is_some(),
            "--vmodule",
            "klog's per-file verbosity; RUST_LOG takes per-module levels",
        );
        n(
            self.log_flush_frequency.is_some(),
            "--log-flush-frequency",
            "kxp writes each log line as it is logged",
        );
        n(
            self.log_text_info_buffer_size.is_some() || self.log_json_info_buffer_size.is_some(),
            "--log-*-info-buffer-size",
            "kxp does not buffer log lines",
        );
        n(
            self.boot_id_file.is_some(),
            "--boot-id-file",
            "cAdvisor's; kxp reads the kernel's boot id for its state files",
        );
        n(
            self.machine_id_file.is_some(),
            "--machine-id-file",
            "cAdvisor's; kxp has no use for the machine id",
        );
        out
    }

    /// Whether error lines go to stderr and the others to stdout
    /// (`--log-text-split-stream` / `--log-json-split-stream` for the format in use).
    pub fn split_stream(&self, json: bool) -> bool {
        if json {
            self.log_json_split_stream.unwrap_or(false)
        } else {
            self.log_text_split_stream.unwrap_or(false)
        }
    }
}

/// The command line as kxp's parser takes it: pflag's `_` in flag names becomes `-`; run
/// as `kube-proxy`, or with flags and no subcommand, it is `kxp run`.
pub fn normalize_args(args: Vec<OsString>) -> Vec<OsString> {
    let mut args = args.into_iter();
    let argv0 = args.next().unwrap_or_else(|| OsString::from("kxp"));
    let mut rest: Vec<OsString> = Vec::new();
    let mut literal = false;
    for a in args {
        if literal {
            rest.push(a);
            continue;
        }
        match a.to_str() {
            Some("--") => {
                literal = true;
                rest.push(a);
            }
            Some(s) if s.starts_with("--") => {
                let (name, value) = match s.split_once('=') {
                    Some((n, v)) => (n, Some(v)),
                    None => (s, None),
                };
                let name = format!("--{}", name[2..].replace('_', "-"));
                rest.push(OsString::from(match value {
                    Some(v) => format!("{name}={v}"),
                    None => name,
                }));
            }
            _ => rest.push(a),
        }
    }
    let as_kube_proxy = std::path::Path::new(&argv0)
        .file_name()
        .is_some_and(|n| n == "kube-proxy");
    let first = rest.first().and_then(|a| a.to_str()).unwrap_or("");
    let top_level = matches!(first, "-h" | "--help" | "-V");
    let flags_only = first.starts_with('-') && !top_level && first != "--version";
    // Through the link, kxp's own subcommands still work (`kube-proxy cleanup`, as a
    // kube-proxy image's users may call kxp's tools by the name they know).
    let subcommand = matches!(
        first,
        "run" | "cleanup" | "trace" | "service" | "conntrack" | "stats" | "demo" | "help"
    );
    if (as_kube_proxy && !subcommand) || flags_only {
        let mut out = vec![argv0, OsString::from("run")];
        out.extend(rest);
        return out;
    }
    let mut out = vec![argv0];
    out.extend(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn kube_proxy_invocations_become_kxp_run() {
        assert_eq!(
            normalize_args(os(&[
                "/usr/local/bin/kube-proxy",
                "--config=/c",
                "--hostname_override=n"
            ])),
            os(&[
                "/usr/local/bin/kube-proxy",
                "run",
                "--config=/c",
                "--hostname-override=n"
            ])
        );
        assert_eq!(
            normalize_args(os(&["kxp", "--v=2", "--proxy-mode", "ipvs"])),
            os(&["kxp", "run", "--v=2", "--proxy-mode", "ipvs"])
        );
        assert_eq!(
            normalize_args(os(&["kxp", "--help"])),
            os(&["kxp", "--help"])
        );
        assert_eq!(
            normalize_args(os(&["/x/kube-proxy", "cleanup"])),
            os(&["/x/kube-proxy", "cleanup"])
        );
        assert_eq!(
            normalize_args(os(&["kube-proxy"])),
            os(&["kube-proxy", "run"])
        );
        assert_eq!(normalize_args(os(&["kxp", "demo"])), os(&["kxp", "demo"]));
        // Values keep their underscores; only names are normalised.
        assert_eq!(
            normalize_args(os(&[
                "kxp",
                "run",
                "--feature_gates=A_B=true",
                "--",
                "--x_y"
            ])),
            os(&["kxp", "run", "--feature-gates=A_B=true", "--", "--x_y"])
        );
    }

    #[test]
    fn deprecated_ports_follow_kube_proxy() {
        assert_eq!(
            with_deprecated_port("0.0.0.0:10256".into(), Some(9)),
            "0.0.0.0:10256"
        );
        assert_eq!(
            with_deprecated_port("10.0.0.1".into(), Some(9)),
            "10.0.0.1:9"
        );
        assert_eq!(with_deprecated_port("10.0.0.1:5".into(), Some(0)), "");
        assert_eq!(bind_address("", 1).unwrap(), None);
        assert_eq!(
            bind_address("::", 10256).unwrap(),
            Some("[::]:10256".parse().unwrap())
        );
        assert!(bind_address("nope", 1).is_err());
    }

    #[test]
    fn go_bools_and_gates() {
        assert_eq!(parse_go_bool("T"), Ok(true));
        assert_eq!(parse_go_bool("0"), Ok(false));
        assert!(parse_go_bool("yes").is_err());
        let g = parse_feature_gates("A=true, B=false").unwrap();
        assert_eq!(g.get("A"), Some(&true));
        assert_eq!(g.get("B"), Some(&false));
        assert!(parse_feature_gates("A").is_err());
    }

    #[test]
    fn ipvs_periods_apply_only_in_ipvs_mode() {
        let d = |s| Some(GoDuration(std::time::Duration::from_secs(s)));
        let f = KubeProxyFlags {
            iptables_sync_period: d(10),
            ipvs_sync_period: d(20),
            ..Default::default()
        };
        assert_eq!(f.to_config().0.sync_period, d(10));
        let f = KubeProxyFlags {
            proxy_mode: Some("ipvs".into()),
            ..f
        };
        let (c, _) = f.to_config();
        assert_eq!(c.sync_period, d(20));
        assert_eq!(c.mode.as_deref(), Some("ipvs"));
    }
}
