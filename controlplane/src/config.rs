//! The KubeProxyConfiguration file (`kubeproxy.config.k8s.io/v1alpha1`), read the way
//! kube-proxy reads it: strict (an unknown field is an error naming it), with kube-proxy's
//! defaults, plus kxp's own settings in one extension section, `kxp:`.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// kube-proxy's configuration file. Every field of v1alpha1 is accepted (so an existing
/// file loads as it is); the ones that mean something to kxp are honoured.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubeProxyConfiguration {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub feature_gates: Option<std::collections::BTreeMap<String, bool>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_connection: Option<ClientConnection>,
    /// component-base logging options (format, verbosity, …): accepted as they are
    /// (YAML tags dropped, see [`untagged`]).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "untagged"
    )]
    pub logging: Option<serde_yaml::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hostname_override: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bind_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub healthz_bind_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_bind_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bind_address_hard_fail: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enable_profiling: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub show_hidden_metrics_for_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_proxy_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iptables: Option<IpTables>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipvs: Option<Ipvs>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nftables: Option<NfTables>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "untagged"
    )]
    pub winkernel: Option<serde_yaml::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detect_local_mode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detect_local: Option<DetectLocal>,
    #[serde(rename = "clusterCIDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_cidr: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_port_addresses: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oom_score_adj: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<Conntrack>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config_sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port_range: Option<String>,
    /// v1alpha2 moved these to the top level; accepted in either place.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub windows_run_as_service: Option<bool>,
    /// kxp's own settings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kxp: Option<KxpSection>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientConnection {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubeconfig: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accept_content_types: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<i32>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IpTables {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade_bit: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade_all: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub localhost_node_ports: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<GoDuration>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Ipvs {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<String>,
    #[serde(rename = "excludeCIDRs")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict_arp: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_timeout: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_fin_timeout: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp_timeout: Option<GoDuration>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NfTables {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade_bit: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade_all: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub table_name: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DetectLocal {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bridge_interface: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interface_name_prefix: Option<String>,
    /// v1alpha2's list form of clusterCIDR.
    #[serde(rename = "clusterCIDRs")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_cidrs: Option<Vec<String>>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Conntrack {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_per_core: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_established_timeout: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_close_wait_timeout: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_be_liberal: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp_timeout: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp_stream_timeout: Option<GoDuration>,
}

/// kxp's extension section (`kxp:` at the top level of the file).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KxpSection {
    /// Endpoint scheduler for Services without a `kxp.dev/scheduler` annotation:
    /// random (default), rr, wrr, lc, wlc, sh, dh, sed, nq or maglev.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<String>,
    /// Interfaces the dataplane attaches to: names and shell-style patterns (`eth0`,
    /// `veth*`, `cali*`); links that appear later and match are attached then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interfaces: Option<Vec<String>>,
    /// Host-side name of kxp's service device (default `kxp0`; the other end is
    /// `NAME-dp`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_device: Option<String>,
    /// Number of dataplane workers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers: Option<u32>,
    /// CPUs to pin the workers to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpus: Option<Vec<u32>>,
    /// The workers' nice value, -20 to 19 (default -20 for workers pinned by `cpus`,
    /// else the process's; `--worker-nice` wins).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_nice: Option<i32>,
    /// Most ClientIP session-affinity entries (client, Service port) the node keeps
    /// (default 262144); when full, the least recently refreshed client is forgotten and
    /// counted in `kxp_session_affinity_evictions_total`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_affinity_max_entries: Option<u32>,
    /// Where connection tracking and affinity are kept across restarts (default
    /// `/run/kxp`; in a network namespace other than the host's, `/run/kxp/netns-INODE`);
    /// `""` keeps them in memory only (a restart then loses every connection).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_directory: Option<std::path::PathBuf>,
    /// The admin socket `kxp service list` / `kxp conntrack` use (default the state
    /// directory's `kxp.sock`; `""` for none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_socket: Option<std::path::PathBuf>,
    /// `enforce` (default): NetworkPolicy is checked on every connection kxp
    /// translates; `off`: not (clusters whose CNI enforces no policy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<String>,
}

/// A value as a generated configuration writes an unset field: null, false, 0, "", "0",
/// "0s", or a mapping of only such values.
/// A free-form section with its YAML tags (`!foo value`) dropped, keys included: as
/// kube-proxy reads it (through JSON, which has no tags), and so that kxp writes back
/// (`--write-config-to`) what it read (the YAML emitter refuses some tagged keys; found
/// by fuzzing).
///
/// A key that is a mapping or a list (YAML's `? {a: b}: c`) is an error: kube-proxy's
/// YAML-to-JSON reading refuses it (JSON keys are strings), and the YAML emitter cannot
/// write it back (found by fuzzing).
fn untagged<'de, D: Deserializer<'de>>(d: D) -> Result<Option<serde_yaml::Value>, D::Error> {
    fn strip<E: serde::de::Error>(v: serde_yaml::Value) -> Result<serde_yaml::Value, E> {
        use serde_yaml::Value;
        Ok(match v {
            Value::Tagged(t) => strip(t.value)?,
            Value::Sequence(s) => {
                Value::Sequence(s.into_iter().map(strip).collect::<Result<_, _>>()?)
            }
            Value::Mapping(m) => Value::Mapping(
                m.into_iter()
                    .map(|(k, v)| match strip(k)? {
                        k @ (Value::Mapping(_) | Value::Sequence(_)) => Err(E::custom(format!(
                            "a key must be a string, number or boolean, not {}",
                            if k.is_mapping() {
                                "a mapping"
                            } else {
                                "a list"
                            }
                        ))),
                        k => Ok((k, strip(v)?)),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            other => other,
        })
    }
    // A section that is null once its tag is dropped (`logging: !t`) is unset, as a plain
    // `logging: null` reads (and as kxp writes it back).
    Ok(Option::<serde_yaml::Value>::deserialize(d)?
        .map(strip)
        .transpose()?
        .filter(|v| !v.is_null()))
}

fn zeroish(v: &serde_yaml::Value) -> bool {
    use serde_yaml::Value;
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => matches!(s.as_str(), "" | "0" | "0s"),
        Value::Mapping(m) => m.values().all(zeroish),
        Value::Sequence(s) => s.is_empty(),
        Value::Tagged(t) => zeroish(&t.value),
    }
}

/// A Go `time.Duration` string as metav1.Duration writes it (`1h0m0s`, `30s`, `250ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GoDuration(pub Duration);

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_go_duration(self.0))
    }
}

/// Go's `time.Duration.String()`: `1h0m0s`, `30s`, `1m30.5s`, `250ms`, `0s`.
pub fn format_go_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".into();
    }
    if nanos < 1_000_000_000 {
        return if nanos.is_multiple_of(1_000_000) {
            format!("{}ms", nanos / 1_000_000)
        } else if nanos.is_multiple_of(1_000) {
            format!("{}µs", nanos / 1_000)
        } else {
            format!("{nanos}ns")
        };
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
    let frac = d.subsec_nanos();
    let sec = if frac == 0 {
        format!("{s}s")
    } else {
        let f = format!("{frac:09}");
        format!("{s}.{}s", f.trim_end_matches('0'))
    };
    if h > 0 {
        format!("{h}h{m}m{sec}")
    } else if m > 0 {
        format!("{m}m{sec}")
    } else {
        sec
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_go_duration(&s)
            .map(GoDuration)
            .map_err(serde::de::Error::custom)
    }
}

/// Parses Go's duration syntax: a sequence of decimal numbers with units
/// ns, us (µs), ms, s, m, h; "0" alone is zero. Negative durations are refused.
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    if t.is_empty() {
        return Err("empty duration".into());
    }
    let bad = || format!("{s:?} is not a duration (e.g. 30s, 15m, 1h30m, 250ms)");
    let mut rest = t.strip_prefix('+').unwrap_or(t);
    if rest.starts_with('-') {
        return Err(format!("{s:?}: negative durations are not allowed"));
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        if num_len == 0 {
            return Err(bad());
        }
        let n: f64 = rest[..num_len].parse().map_err(|_| bad())?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        total += n * scale;
        rest = &rest[unit_len..];
    }
    if !total.is_finite() || total > 1e12 {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(total))
}

/// A configuration file kxp cannot use.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {field}: {message}")]
    Invalid {
        path: String,
        field: String,
        message: String,
    },
}

/// The API group/version kxp reads.
pub const API_VERSIONS: [&str; 2] = [
    "kubeproxy.config.k8s.io/v1alpha1",
    "kubeproxy.config.k8s.io/v1alpha2",
];

impl KubeProxyConfiguration {
    /// Reads and checks a configuration file.
    ///
    /// # Errors
    /// The file cannot be read, is not YAML, has a field kxp does not know (named by its
    /// path, e.g. `conntrack.tcpTimeout`), or a value of the wrong type or out of range.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses configuration text; `origin` names it in errors.
    ///
    /// # Errors
    /// As [`KubeProxyConfiguration::load`].
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let invalid = |field: String, message: String| ConfigError::Invalid {
            path: origin.to_string(),
            field,
            message,
        };
        let de = serde_yaml::Deserializer::from_str(text);
        let cfg: KubeProxyConfiguration = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            let inner = e.into_inner().to_string();
            let message = match inner.find("unknown field") {
                Some(_) => format!("{inner}; kxp reads KubeProxyConfiguration v1alpha1 fields and its own under `kxp:`"),
                None => inner,
            };
            invalid(if field == "." { "(document)".into() } else { field }, message)
        })?;
        match cfg.api_version.as_deref() {
            Some(v) if API_VERSIONS.contains(&v) => {}
            Some(v) => {
                return Err(invalid(
                    "apiVersion".into(),
                    format!("{v:?} is not {}", API_VERSIONS[0]),
                ));
            }
            None => {
                return Err(invalid(
                    "apiVersion".into(),
                    format!("missing; expected {}", API_VERSIONS[0]),
                ));
            }
        }
        if cfg.kind.as_deref() != Some("KubeProxyConfiguration") {
            return Err(invalid(
                "kind".into(),
                format!(
                    "{:?} is not KubeProxyConfiguration",
                    cfg.kind.as_deref().unwrap_or("")
                ),
            ));
        }
        if let Some(mode) = cfg.detect_local_mode.as_deref()
            && ![
                "",
                "ClusterCIDR",
                "NodeCIDR",
                "BridgeInterface",
                "InterfaceNamePrefix",
            ]
            .contains(&mode)
        {
            return Err(invalid(
                "detectLocalMode".into(),
                format!(
                    "{mode:?} is not ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix"
                ),
            ));
        }
        if let Some(np) = cfg.kxp.as_ref().and_then(|k| k.network_policy.as_deref())
            && !["", "enforce", "kernel", "off"].contains(&np)
        {
            return Err(invalid(
                "kxp.networkPolicy".into(),
                format!("{np:?} is not enforce, kernel or off"),
            ));
        }
        Ok(cfg)
    }

    /// Whether kxp enforces Kubernetes NetworkPolicy (`kxp.networkPolicy`, default
    /// `enforce`; `kernel` too).
    pub fn network_policy(&self) -> bool {
        self.kxp.as_ref().and_then(|k| k.network_policy.as_deref()) != Some("off")
    }

    /// `kxp.networkPolicy: kernel`: translated packets for this node's pods are handed
    /// to the kernel, so the CNI's own policy (of any kind) applies to them too.
    pub fn kernel_policy(&self) -> bool {
        self.kxp.as_ref().and_then(|k| k.network_policy.as_deref()) == Some("kernel")
    }

    /// `iptables.masqueradeAll` or `nftables.masqueradeAll`.
    pub fn masquerade_all(&self) -> bool {
        self.iptables
            .as_ref()
            .and_then(|t| t.masquerade_all)
            .unwrap_or(false)
            || self
                .nftables
                .as_ref()
                .and_then(|t| t.masquerade_all)
                .unwrap_or(false)
    }

    /// Fields set to something kxp does not do, each with its JSON path and why. (Fields
    /// with no meaning without iptables/IPVS/nftables — masqueradeBit, tableName — and
    /// the Windows ones are accepted silently; the mode is kxp's own.)
    pub fn not_honoured(&self) -> Vec<(String, &'static str)> {
        let mut out = Vec::new();
        let mut note = |set: bool, field: &str, why: &'static str| {
            if set {
                out.push((field.to_string(), why));
            }
        };
        note(
            self.feature_gates.as_ref().is_some_and(|g| !g.is_empty()),
            "featureGates",
            "kxp has no feature gates; it implements kube-proxy's current defaults",
        );
        if let Some(c) = &self.client_connection {
            let protobuf =
                |v: &Option<String>| v.as_deref().is_some_and(|t| t.contains("protobuf"));
            note(
                protobuf(&c.content_type),
                "clientConnection.contentType",
                "kxp's client speaks JSON",
            );
            note(
                protobuf(&c.accept_content_types),
                "clientConnection.acceptContentTypes",
                "kxp's client speaks JSON",
            );
        }
        note(
            self.enable_profiling == Some(true),
            "enableProfiling",
            "kxp serves no pprof endpoints",
        );
        note(
            self.show_hidden_metrics_for_version
                .as_deref()
                .is_some_and(|v| !v.is_empty()),
            "showHiddenMetricsForVersion",
            "kxp has no hidden metrics",
        );
        note(
            self.config_sync_period.is_some_and(|d| !d.0.is_zero()),
            "configSyncPeriod",
            "an informer's resync; kxp's watches deliver every change, and its periodic full sync is the sync period",
        );
        note(
            self.port_range.as_deref().is_some_and(|v| !v.is_empty()),
            "portRange",
            "deprecated and unused (kube-proxy ignores it too)",
        );
        if let Some(i) = &self.ipvs {
            note(
                i.exclude_cidrs.as_ref().is_some_and(|v| !v.is_empty()),
                "ipvs.excludeCIDRs",
                "kxp programs no IPVS",
            );
            note(
                i.strict_arp == Some(true),
                "ipvs.strictARP",
                "kxp programs no IPVS (no kube-ipvs0 addresses to hide)",
            );
            let set = |d: &Option<GoDuration>| d.is_some_and(|d| !d.0.is_zero());
            note(
                set(&i.tcp_timeout) || set(&i.tcp_fin_timeout) || set(&i.udp_timeout),
                "ipvs.tcpTimeout/tcpFinTimeout/udpTimeout",
                "kxp's flow timeouts come from conntrack.*",
            );
        }
        let other_logging: Vec<String> = self
            .logging
            .as_ref()
            .and_then(|l| l.as_mapping())
            .map(|m| {
                m.iter()
                    .filter(|(_, v)| !zeroish(v))
                    .filter_map(|(k, _)| k.as_str())
                    .filter(|k| !matches!(*k, "format" | "verbosity" | "options"))
                    .map(|k| format!("logging.{k}"))
                    .collect()
            })
            .unwrap_or_default();
        for field in other_logging {
            out.push((
                field,
                "kxp honours logging.format, logging.verbosity and logging.options.*.splitStream; it writes each line unbuffered",
            ));
        }
        out
    }

    /// The IPVS scheduler or kxp's own scheduler setting (kxp's wins).
    pub fn scheduler(&self) -> Option<&str> {
        self.kxp
            .as_ref()
            .and_then(|k| k.scheduler.as_deref())
            .or_else(|| self.ipvs.as_ref().and_then(|i| i.scheduler.as_deref()))
            .filter(|s| !s.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing (`fuzz/regressions/config/`): a tagged key in a free-form section
    /// read, and then could not be written back (`--write-config-to` failed).
    #[test]
    fn tags_in_free_form_sections_are_dropped_and_what_reads_is_written_back() {
        let text = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
                    logging: {!t0 format: json, verbosity: !!int 4, options: {!x text: {}}}\n\
                    winkernel: !w {networkName: !n x}\n";
        let cfg = KubeProxyConfiguration::parse(text, "test").unwrap();
        let logging = serde_yaml::to_string(&cfg.logging).unwrap();
        assert_eq!(
            logging,
            "format: json\nverbosity: 4\noptions:\n  text: {}\n"
        );
        let written = serde_yaml::to_string(&cfg).unwrap();
        assert_eq!(
            KubeProxyConfiguration::parse(&written, "written").unwrap(),
            cfg
        );
        // A section that is only a tag reads as unset, as `logging: null` does.
        let text = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nlogging: !t\nwinkernel: !w ~\n";
        let cfg = KubeProxyConfiguration::parse(text, "test").unwrap();
        assert_eq!((&cfg.logging, &cfg.winkernel), (&None, &None));
        // A key that is a mapping: refused, naming the section.
        let text = "kind: KubeProxyConfiguration\nlogging:\n  options:\n    ? {a: b}\n    : c\n";
        let e = KubeProxyConfiguration::parse(text, "test")
            .unwrap_err()
            .to_string();
        assert!(e.contains("logging") && e.contains("not a mapping"), "{e}");
        for f in std::fs::read_dir(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fuzz/regressions/config"
        ))
        .unwrap()
        {
            let text = std::fs::read_to_string(f.unwrap().path()).unwrap();
            if let Ok(cfg) = KubeProxyConfiguration::parse(&text, "found") {
                let written = serde_yaml::to_string(&cfg).unwrap();
                assert_eq!(
                    KubeProxyConfiguration::parse(&written, "written").unwrap(),
                    cfg
                );
            }
        }
    }

    #[test]
    fn fields_kxp_does_not_do_are_named() {
        let cfg = KubeProxyConfiguration::parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             clientConnection: {contentType: application/vnd.kubernetes.protobuf, qps: 5}\n\
             iptables: {localhostNodePorts: true, masqueradeBit: 14}\nenableProfiling: false\n\
             ipvs: {strictARP: true, scheduler: rr}\n",
            "test",
        )
        .unwrap();
        let fields: Vec<String> = cfg.not_honoured().into_iter().map(|(f, _)| f).collect();
        assert_eq!(fields, ["clientConnection.contentType", "ipvs.strictARP"]);
    }

    const FULL: &str = r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 10
  contentType: application/vnd.kubernetes.protobuf
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 5
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 15m0s
conntrack:
  maxPerCore: 32768
  min: 131072
  tcpCloseWaitTimeout: 1h0m0s
  tcpEstablishedTimeout: 24h0m0s
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 1s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: nftables
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

    #[test]
    fn kubeadm_style_file_loads() {
        let c = KubeProxyConfiguration::parse(FULL, "test").unwrap();
        assert_eq!(c.cluster_cidr.as_deref(), Some("10.244.0.0/16"));
        assert_eq!(
            c.conntrack.as_ref().unwrap().tcp_established_timeout,
            Some(GoDuration(Duration::from_secs(86_400)))
        );
        assert!(!c.masquerade_all());
    }

    #[test]
    fn unknown_field_is_named() {
        let text = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nconntrack:\n  tcpTimeout: 1s\n";
        let e = KubeProxyConfiguration::parse(text, "f.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("conntrack"), "{e}");
        assert!(e.contains("tcpTimeout"), "{e}");
        let text = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nbogus: 1\n";
        let e = KubeProxyConfiguration::parse(text, "f.yaml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("bogus"), "{e}");
    }

    #[test]
    fn wrong_kind_or_version_is_refused() {
        let e =
            KubeProxyConfiguration::parse("apiVersion: v1\nkind: KubeProxyConfiguration\n", "f")
                .unwrap_err()
                .to_string();
        assert!(e.contains("apiVersion"), "{e}");
        let e = KubeProxyConfiguration::parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: Pod\n",
            "f",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("kind"), "{e}");
    }

    #[test]
    fn masquerade_all_from_either_section() {
        let base = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        for extra in [
            "iptables:\n  masqueradeAll: true\n",
            "nftables:\n  masqueradeAll: true\n",
        ] {
            let c = KubeProxyConfiguration::parse(&format!("{base}{extra}"), "f").unwrap();
            assert!(c.masquerade_all());
        }
    }

    #[test]
    fn go_durations_format_like_go() {
        for (d, s) in [
            (Duration::ZERO, "0s"),
            (Duration::from_secs(3600), "1h0m0s"),
            (Duration::from_secs(86_400), "24h0m0s"),
            (Duration::from_secs(90), "1m30s"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_millis(250), "250ms"),
        ] {
            assert_eq!(format_go_duration(d), s);
            assert_eq!(parse_go_duration(s).unwrap(), d);
        }
    }

    #[test]
    fn written_config_reads_back() {
        let c = KubeProxyConfiguration::parse(FULL, "test").unwrap();
        let text = serde_yaml::to_string(&c).unwrap();
        assert_eq!(KubeProxyConfiguration::parse(&text, "again").unwrap(), c);
    }

    #[test]
    fn go_durations() {
        let d = |s| parse_go_duration(s).unwrap();
        assert_eq!(d("0"), Duration::ZERO);
        assert_eq!(d("0s"), Duration::ZERO);
        assert_eq!(d("1h0m0s"), Duration::from_secs(3600));
        assert_eq!(d("1m30s"), Duration::from_secs(90));
        assert_eq!(d("250ms"), Duration::from_millis(250));
        assert_eq!(d("1.5s"), Duration::from_millis(1500));
        for bad in ["", "1", "1x", "-1s", "s", "1h-", "nan"] {
            assert!(parse_go_duration(bad).is_err(), "{bad}");
        }
    }
}
