//! kube-proxy's metrics (`kubeproxy_*`, the names, types and labels of kube-proxy's
//! pkg/proxy/metrics) and kxp's dataplane metrics (`kxp_*`), plus the metrics server:
//! `/metrics` (OpenMetrics text), `/proxyMode` and `/configz`, as kube-proxy serves them
//! on its metrics address.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets, linear_buckets};
use prometheus_client::registry::Registry;

/// Content type of the `/metrics` body (prometheus-client encodes OpenMetrics text).
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;
type F64Gauge = Gauge<f64, AtomicU64>;

/// Totals read from the dataplane; counters among them are cumulative since start.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DataplaneCounters {
    pub forwarded: u64,
    pub forwarded_bytes: u64,
    pub rejected: u64,
    pub dropped: u64,
    pub passed: u64,
    /// Drops by reason (cumulative per reason).
    pub drops: Vec<(String, u64)>,
    pub conntrack_entries: u64,
    pub conntrack_inserts: u64,
    pub conntrack_evictions: u64,
    /// ClientIP affinity entries held, and those expired / evicted since start.
    pub affinity_entries: u64,
    pub affinity_expired: u64,
    pub affinity_evictions: u64,
    pub handoffs: u64,
    /// Packets forwarded untranslated whose partial checksum kxp completed.
    pub pass_checksums_completed: u64,
    /// Frames that came with an 802.1Q tag (taken off), and frames tagged back.
    pub vlan_untagged: u64,
    pub vlan_tagged: u64,
    /// Packets handed to the kernel for the CNI's policy (`kxp.networkPolicy: kernel`).
    pub policy_handover: u64,
    /// Generation of the snapshot the workers run.
    pub generation: u64,
    pub snapshot_age_secs: f64,
    /// Busy ratio (0..=1) per worker, indexed by worker.
    pub busy_ratio: Vec<f64>,
    /// Stalls per worker (cumulative), indexed by worker.
    pub stalls: Vec<dataplane::worker::Stalls>,
}

/// Turns dataplane totals into counter increments: a counter only goes up, by the
/// difference from the last total seen (a total lower than the last one, e.g. after a
/// dataplane restart, is taken as the new base).
#[derive(Debug, Default)]
struct Totals {
    last: HashMap<String, u64>,
}

impl Totals {
    fn advance(&mut self, key: &str, total: u64, counter: &Counter) {
        let last = self.last.entry(key.to_string()).or_insert(0);
        if total > *last {
            counter.inc_by(total - *last);
        }
        *last = total;
    }

    /// As [`Totals::advance`], for a counter in other units: `total` counts units of
    /// `1 / per_unit` (clock ticks, nanoseconds) and the counter advances in whole ones.
    fn advance_scaled(
        &mut self,
        key: &str,
        total: u64,
        per_unit: f64,
        counter: &Counter<f64, AtomicU64>,
    ) {
        let last = self.last.entry(key.to_string()).or_insert(0);
        if total > *last {
            counter.inc_by((total - *last) as f64 / per_unit);
        }
        *last = total;
    }
}

/// The metrics kxp exposes, in one registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    sync_duration: Histogram,
    sync_full: Histogram,
    sync_partial: Histogram,
    service_pending: Gauge,
    endpoint_pending: Gauge,
    rest_requests: Family<Labels, Counter>,
    cpu_seconds: Counter<f64, AtomicU64>,
    resident_memory: Gauge,
    virtual_memory: Gauge,
    open_fds: Gauge,
    max_fds: Gauge,
    start_time: F64Gauge,
    network_programming: Histogram,
    last_sync: F64Gauge,
    last_queued: F64Gauge,
    service_changes: Counter,
    endpoint_changes: Counter,
    no_local_endpoints: Family<Labels, Gauge>,
    healthz: Family<Labels, Counter>,
    livez: Family<Labels, Counter>,
    packets: Family<Labels, Counter>,
    bytes: Family<Labels, Counter>,
    drops: Family<Labels, Counter>,
    conntrack_entries: Gauge,
    conntrack_inserts: Counter,
    conntrack_evictions: Counter,
    affinity_entries: Gauge,
    affinity_expired: Counter,
    affinity_evictions: Counter,
    handoffs: Counter,
    pass_checksums_completed: Counter,
    vlan_frames: Family<Labels, Counter>,
    policy_handover: Counter,
    generation: Gauge,
    snapshot_age: F64Gauge,
    busy: Family<Labels, F64Gauge>,
    steering_set_entries: Family<Labels, Gauge>,
    steering_set_size: Family<Labels, Gauge>,
    stalls: Family<Labels, Counter>,
    stall_seconds: Family<Labels, Counter<f64, AtomicU64>>,
    longest_stall: Family<Labels, F64Gauge>,
    xdp: Family<Labels, Counter>,
    xsk_drops: Family<Labels, Counter>,
    xsk_packets: Family<Labels, Counter>,
    api_events: Family<Labels, Counter>,
    api_errors: Family<Labels, Counter>,
    api_relists: Family<Labels, Counter>,
    api_failing: Family<Labels, Gauge>,
    api_objects: Family<Labels, Gauge>,
    totals: Mutex<Totals>,
}

/// What the Kubernetes source reports for one watched resource.
#[derive(Debug, Clone, Default)]
pub struct ApiCounters {
    pub resource: String,
    pub events: u64,
    pub errors: u64,
    pub relists: u64,
    pub failing: bool,
    pub objects: usize,
    /// Objects changed and not synced yet.
    pub pending: usize,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn label(k: &str, v: &str) -> Labels {
    vec![(k.to_string(), v.to_string())]
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// kube-proxy's network programming buckets: 0, 0.25s, 0.5s, 1..59s, 60..115s by 5s,
/// 120..300s by 30s.
fn network_programming_buckets() -> Vec<f64> {
    std::iter::once(0.0)
        .chain(linear_buckets(0.25, 0.25, 2))
        .chain(linear_buckets(1.0, 1.0, 59))
        .chain(linear_buckets(60.0, 5.0, 12))
        .chain(linear_buckets(120.0, 30.0, 7))
        .collect()
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let m = Metrics {
            sync_duration: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            sync_full: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            sync_partial: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            service_pending: Gauge::default(),
            endpoint_pending: Gauge::default(),
            rest_requests: Family::default(),
            cpu_seconds: Counter::default(),
            resident_memory: Gauge::default(),
            virtual_memory: Gauge::default(),
            open_fds: Gauge::default(),
            max_fds: Gauge::default(),
            start_time: F64Gauge::default(),
            network_programming: Histogram::new(network_programming_buckets()),
            last_sync: F64Gauge::default(),
            last_queued: F64Gauge::default(),
            service_changes: Counter::default(),
            endpoint_changes: Counter::default(),
            no_local_endpoints: Family::default(),
            healthz: Family::default(),
            livez: Family::default(),
            packets: Family::default(),
            bytes: Family::default(),
            drops: Family::default(),
            conntrack_entries: Gauge::default(),
            conntrack_inserts: Counter::default(),
            conntrack_evictions: Counter::default(),
            affinity_entries: Gauge::default(),
            affinity_expired: Counter::default(),
            affinity_evictions: Counter::default(),
            handoffs: Counter::default(),
            pass_checksums_completed: Counter::default(),
            vlan_frames: Family::default(),
            policy_handover: Counter::default(),
            generation: Gauge::default(),
            snapshot_age: F64Gauge::default(),
            busy: Family::default(),
            steering_set_entries: Family::default(),
            steering_set_size: Family::default(),
            stalls: Family::default(),
            stall_seconds: Family::default(),
            longest_stall: Family::default(),
            xdp: Family::default(),
            xsk_drops: Family::default(),
            xsk_packets: Family::default(),
            api_events: Family::default(),
            api_errors: Family::default(),
            api_relists: Family::default(),
            api_failing: Family::default(),
            api_objects: Family::default(),
            totals: Mutex::new(Totals::default()),
            registry: Registry::default(),
        };
        m.register_kube_proxy(&mut registry);
        m.register_process(&mut registry);
        m.register_kxp(&mut registry);
        Metrics { registry, ..m }
    }

    /// kube-proxy's own metrics, by their names (`kubeproxy_*`).
    fn register_kube_proxy(&self, registry: &mut Registry) {
        let m = self;
        let kp = registry.sub_registry_with_prefix("kubeproxy");
        kp.register(
            "sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            m.sync_duration.clone(),
        );
        kp.register(
            "sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            m.sync_full.clone(),
        );
        kp.register(
            "sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            m.sync_partial.clone(),
        );
        kp.register(
            "sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            m.service_pending.clone(),
        );
        kp.register(
            "sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            m.endpoint_pending.clone(),
        );
        kp.register(
            "network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            m.network_programming.clone(),
        );
        kp.register(
            "sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            m.last_sync.clone(),
        );
        kp.register(
            "sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            m.last_queued.clone(),
        );
        // prometheus-client appends `_total` to counter samples.
        kp.register(
            "sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            m.service_changes.clone(),
        );
        kp.register(
            "sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            m.endpoint_changes.clone(),
        );
        kp.register(
            "sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            m.no_local_endpoints.clone(),
        );
        kp.register(
            "proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            m.healthz.clone(),
        );
        kp.register(
            "proxy_livez",
            "Cumulative proxy livez HTTP status",
            m.livez.clone(),
        );
    }

    /// client-go's and the Prometheus client's standard metrics, by their names.
    fn register_process(&self, registry: &mut Registry) {
        let m = self;
        registry.register(
            "rest_client_requests",
            "Number of HTTP requests, partitioned by status code, method, and host",
            m.rest_requests.clone(),
        );
        registry.register(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            m.cpu_seconds.clone(),
        );
        registry.register(
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            m.resident_memory.clone(),
        );
        registry.register(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            m.virtual_memory.clone(),
        );
        registry.register(
            "process_open_fds",
            "Number of open file descriptors",
            m.open_fds.clone(),
        );
        registry.register(
            "process_max_fds",
            "Maximum number of open file descriptors",
            m.max_fds.clone(),
        );
        registry.register(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
            m.start_time.clone(),
        );
    }

    /// kxp's own metrics (`kxp_*`).
    fn register_kxp(&self, registry: &mut Registry) {
        let kxp = registry.sub_registry_with_prefix("kxp");
        self.register_packet_path(kxp);
        self.register_sync(kxp);
        self.register_sockets_and_workers(kxp);
    }

    /// kxp's packet-path counters: verdicts, drops, connection tracking, affinity.
    fn register_packet_path(&self, kxp: &mut Registry) {
        let m = self;
        kxp.register(
            "packets",
            "Packets handled by the dataplane, by verdict",
            m.packets.clone(),
        );
        kxp.register(
            "bytes",
            "Bytes handled by the dataplane, by verdict",
            m.bytes.clone(),
        );
        kxp.register("drops", "Packets dropped, by reason", m.drops.clone());
        kxp.register(
            "conntrack_entries",
            "Connection tracking entries in use",
            m.conntrack_entries.clone(),
        );
        kxp.register(
            "conntrack_insertions",
            "Connection tracking entries inserted",
            m.conntrack_inserts.clone(),
        );
        kxp.register(
            "conntrack_evictions",
            "Connection tracking entries evicted",
            m.conntrack_evictions.clone(),
        );
        kxp.register(
            "session_affinity_entries",
            "ClientIP session affinity entries held by the node",
            m.affinity_entries.clone(),
        );
        kxp.register(
            "session_affinity_expired",
            "ClientIP session affinity entries removed at their timeout",
            m.affinity_expired.clone(),
        );
        kxp.register(
            "session_affinity_evictions",
            "Live ClientIP session affinity entries evicted because the table was full",
            m.affinity_evictions.clone(),
        );
        kxp.register(
            "handoffs",
            "Packets handed to the worker that owns their flow",
            m.handoffs.clone(),
        );
        kxp.register(
            "pass_checksums_completed",
            "Packets kxp forwarded without translating them (an endpoint's answer in a \
             connection no one translated, with the kernel's conntrack off) whose partial \
             checksum it completed",
            m.pass_checksums_completed.clone(),
        );
        kxp.register(
            "vlan_frames",
            "Frames with one 802.1Q/802.1ad tag on an interface kxp drives (a trunk): \
             untagged, the tag taken off a frame that came with one (its flow keeps the \
             VLAN id); tagged, the tag put on a frame going back to such a client",
            m.vlan_frames.clone(),
        );
        kxp.register(
            "policy_handover_packets",
            "Packets of connections to this node's pods that kxp translated and handed to \
             the kernel, which carries them through the CNI's filtering \
             (kxp.networkPolicy: kernel)",
            m.policy_handover.clone(),
        );
    }

    /// The snapshot the dataplane runs and the API server's watches.
    fn register_sync(&self, kxp: &mut Registry) {
        let m = self;
        kxp.register(
            "snapshot_generation",
            "Generation of the snapshot the dataplane runs",
            m.generation.clone(),
        );
        kxp.register(
            "snapshot_age_seconds",
            "Age of the snapshot the dataplane runs",
            m.snapshot_age.clone(),
        );
        kxp.register(
            "api_watch_events",
            "Watch events applied from the API server, by resource",
            m.api_events.clone(),
        );
        kxp.register(
            "api_watch_errors",
            "Failed list/watch requests and error events, by resource",
            m.api_errors.clone(),
        );
        kxp.register(
            "api_relists",
            "Lists after the first (410 Expired, a watch that could not resume), by resource",
            m.api_relists.clone(),
        );
        kxp.register(
            "api_watch_failing",
            "1 while a resource's watch is failing (the last good state is in force)",
            m.api_failing.clone(),
        );
        kxp.register(
            "api_objects",
            "Objects held from the API server, by resource",
            m.api_objects.clone(),
        );
    }

    /// The steering program, the AF_XDP sockets and the workers' loops.
    fn register_sockets_and_workers(&self, kxp: &mut Registry) {
        let m = self;
        kxp.register(
            "steering_set_entries",
            "Keys in each of the steering program's sets (frontends, endpoints, cluster_ips \
             grow with the cluster; local_addrs and service_cidrs have a fixed size)",
            m.steering_set_entries.clone(),
        );
        kxp.register(
            "steering_set_size",
            "How many keys each steering set holds before it grows (frontends, endpoints, \
             cluster_ips: a map twice the size needed is filled and swapped in), or at all \
             (local_addrs: 1024, service_cidrs: 256)",
            m.steering_set_size.clone(),
        );
        kxp.register(
            "xdp_packets",
            "Packets the XDP steering program saw, per interface and outcome: redirected to kxp; passed to the kernel (not kxp's traffic); unparsed (IP headers it cannot read, passed: the kernel drops what is malformed); vlan (tagged frames not looked inside, passed: looking inside is off, or the tag is cut short); dropped (held while kxp restarts, or on the service device and not for the node)",
            m.xdp.clone(),
        );
        kxp.register(
            "xsk_rx_drops",
            "Packets the kernel redirected to kxp's AF_XDP sockets and dropped, per interface and reason: fill_ring_empty (no receive buffer: kxp's rings held what its queue budget allows, or it fell behind), rx_ring_full (the receive ring was full), other",
            m.xsk_drops.clone(),
        );
        kxp.register(
            "xsk_rx_packets",
            "Frames kxp received per interface and receive queue (one AF_XDP socket each; \
             queue q is served by worker q % workers): how RSS spreads the traffic",
            m.xsk_packets.clone(),
        );
        kxp.register(
            "worker_busy_ratio",
            "Fraction of time each worker spent processing packets",
            m.busy.clone(),
        );
        kxp.register(
            "worker_stalls",
            "Gaps of a millisecond or more between two rounds of a worker's polling loop with no sleep between them: its CPU was taken (another task or kernel thread, the hypervisor) or a round of its own ran long; what arrived meanwhile waited in the rings, or was dropped when they filled (kxp_xsk_rx_drops_total). Give the workers' CPUs to kxp alone (isolcpus, a cpuset) if these come with drops",
            m.stalls.clone(),
        );
        kxp.register(
            "worker_stall_seconds",
            "Total length of the worker_stalls",
            m.stall_seconds.clone(),
        );
        kxp.register(
            "worker_longest_stall_seconds",
            "The longest of the worker_stalls since kxp started",
            m.longest_stall.clone(),
        );
    }

    /// One sync of the dataplane took `d`; `full`: a full resync (the first, a periodic
    /// one, a retry), else partial (the changed Services only).
    pub fn observe_sync(&self, d: Duration, full: bool) {
        self.sync_duration.observe(d.as_secs_f64());
        if full {
            self.sync_full.observe(d.as_secs_f64());
        } else {
            self.sync_partial.observe(d.as_secs_f64());
        }
    }

    /// The API client's requests so far, by (code, host, method).
    pub fn update_rest_requests(&self, requests: &[(crate::kube_source::RequestKey, u64)]) {
        let Ok(mut t) = self.totals.lock() else {
            return;
        };
        for ((code, host, method), n) in requests {
            let l = vec![
                ("code".to_string(), code.clone()),
                ("host".to_string(), host.clone()),
                ("method".to_string(), method.clone()),
            ];
            t.advance(
                &format!("rest/{code}/{host}/{method}"),
                *n,
                &self.rest_requests.get_or_create(&l),
            );
        }
    }

    /// Reads this process's CPU time, memory, descriptors and start time from /proc.
    pub fn update_process(&self) {
        let Some(p) = ProcessStats::read() else {
            return;
        };
        let Ok(mut t) = self.totals.lock() else {
            return;
        };
        // CPU time in clock ticks is a total; the counter advances by whole ticks.
        let hz = dataplane::sys::clock_ticks_per_sec().max(1);
        t.advance_scaled(
            "process/cpu_ticks",
            p.cpu_ticks,
            hz as f64,
            &self.cpu_seconds,
        );
        self.resident_memory.set(to_i64(p.resident_bytes));
        self.virtual_memory.set(to_i64(p.virtual_bytes));
        self.open_fds.set(to_i64(p.open_fds));
        self.max_fds.set(to_i64(p.max_fds));
        self.start_time.set(p.start_time);
    }

    /// A change reached the dataplane `d` after it was made in the cluster.
    pub fn observe_network_programming(&self, d: Duration) {
        self.network_programming.observe(d.as_secs_f64());
    }

    /// The dataplane was just programmed with the current state.
    pub fn set_last_sync_now(&self) {
        self.last_sync.set(unix_now());
    }

    /// A sync was just requested.
    pub fn set_queued_now(&self) {
        self.last_queued.set(unix_now());
    }

    pub fn add_service_changes(&self, n: u64) {
        self.service_changes.inc_by(n);
    }

    pub fn add_endpoint_changes(&self, n: u64) {
        self.endpoint_changes.inc_by(n);
    }

    /// Services with a Local internal / external traffic policy and no local endpoint.
    pub fn set_no_local_endpoints(&self, internal: u64, external: u64) {
        self.no_local_endpoints
            .get_or_create(&label("traffic_policy", "internal"))
            .set(to_i64(internal));
        self.no_local_endpoints
            .get_or_create(&label("traffic_policy", "external"))
            .set(to_i64(external));
    }

    /// `/healthz` answered with HTTP status `code`.
    pub fn healthz_served(&self, code: u16) {
        self.healthz
            .get_or_create(&label("code", &code.to_string()))
            .inc();
    }

    /// `/livez` answered with HTTP status `code`.
    pub fn livez_served(&self, code: u16) {
        self.livez
            .get_or_create(&label("code", &code.to_string()))
            .inc();
    }

    /// Takes the Kubernetes source's counters.
    pub fn update_api(&self, resources: &[ApiCounters]) {
        let Ok(mut t) = self.totals.lock() else {
            return;
        };
        for r in resources {
            let l = label("resource", &r.resource);
            t.advance(
                &format!("api_events/{}", r.resource),
                r.events,
                &self.api_events.get_or_create(&l),
            );
            t.advance(
                &format!("api_errors/{}", r.resource),
                r.errors,
                &self.api_errors.get_or_create(&l),
            );
            t.advance(
                &format!("api_relists/{}", r.resource),
                r.relists,
                &self.api_relists.get_or_create(&l),
            );
            self.api_failing.get_or_create(&l).set(i64::from(r.failing));
            match r.resource.as_str() {
                "services" => {
                    self.service_pending.set(to_i64(r.pending as u64));
                }
                "endpointslices" => {
                    self.endpoint_pending.set(to_i64(r.pending as u64));
                }
                _ => {}
            }
            self.api_objects
                .get_or_create(&l)
                .set(to_i64(r.objects as u64));
        }
    }

    /// Takes the dataplane's current totals and gauges.
    pub fn update_dataplane(&self, c: &DataplaneCounters) {
        let Ok(mut t) = self.totals.lock() else {
            return;
        };
        for (verdict, packets) in [
            ("forwarded", c.forwarded),
            ("rejected", c.rejected),
            ("dropped", c.dropped),
            ("passed", c.passed),
        ] {
            let l = label("verdict", verdict);
            t.advance(
                &format!("packets/{verdict}"),
                packets,
                &self.packets.get_or_create(&l),
            );
        }
        t.advance(
            "bytes/forwarded",
            c.forwarded_bytes,
            &self.bytes.get_or_create(&label("verdict", "forwarded")),
        );
        for (reason, n) in &c.drops {
            t.advance(
                &format!("drops/{reason}"),
                *n,
                &self.drops.get_or_create(&label("reason", reason)),
            );
        }
        t.advance("ct/inserts", c.conntrack_inserts, &self.conntrack_inserts);
        t.advance(
            "ct/evictions",
            c.conntrack_evictions,
            &self.conntrack_evictions,
        );
        t.advance("aff/expired", c.affinity_expired, &self.affinity_expired);
        t.advance(
            "aff/evictions",
            c.affinity_evictions,
            &self.affinity_evictions,
        );
        self.affinity_entries.set(to_i64(c.affinity_entries));
        t.advance("handoffs", c.handoffs, &self.handoffs);
        t.advance(
            "pass_csum",
            c.pass_checksums_completed,
            &self.pass_checksums_completed,
        );
        t.advance("policy_handover", c.policy_handover, &self.policy_handover);
        for (key, total) in [("untagged", c.vlan_untagged), ("tagged", c.vlan_tagged)] {
            t.advance(
                &format!("vlan/{key}"),
                total,
                &self.vlan_frames.get_or_create(&label("action", key)),
            );
        }
        self.conntrack_entries.set(to_i64(c.conntrack_entries));
        self.generation.set(to_i64(c.generation));
        self.snapshot_age.set(c.snapshot_age_secs);
        for (i, r) in c.busy_ratio.iter().enumerate() {
            self.busy
                .get_or_create(&label("worker", &i.to_string()))
                .set(*r);
        }
        for (i, s) in c.stalls.iter().enumerate() {
            let w = label("worker", &i.to_string());
            t.advance(
                &format!("stalls/{i}"),
                s.count,
                &self.stalls.get_or_create(&w),
            );
            t.advance_scaled(
                &format!("stall_ns/{i}"),
                s.total_ns,
                1e9,
                &self.stall_seconds.get_or_create(&w),
            );
            self.longest_stall
                .get_or_create(&w)
                .set(s.longest_ns as f64 / 1e9);
        }
    }

    /// Takes how full the steering program's sets are: (map, keys, size).
    pub fn update_steering_sets(&self, sets: &[(&'static str, usize, usize)]) {
        for &(map, keys, size) in sets {
            let l = vec![("map".to_string(), map.to_string())];
            self.steering_set_entries.get_or_create(&l).set(keys as i64);
            self.steering_set_size.get_or_create(&l).set(size as i64);
        }
    }

    /// Takes the steering programs' counters, per interface.
    pub fn update_xdp(&self, per_interface: &[(String, dataplane::xdp::SteerStats)]) {
        let Ok(mut t) = self.totals.lock() else {
            return;
        };
        for (ifname, st) in per_interface {
            // The outcomes partition what the program saw: passed for the kernel's own
            // traffic, unparsed, vlan and kernel_flow (passed too, counted apart: the last
            // are the kernel's own connections from an endpoint), dropped (held
            // while kxp restarts, or on the service device and not for the node).
            let dropped = st.seen.saturating_sub(st.redirected + st.passed);
            for (outcome, n) in [
                ("redirected", st.redirected),
                (
                    "passed",
                    st.passed
                        .saturating_sub(st.unparsed + st.vlan + st.kernel_flow),
                ),
                ("kernel_flow", st.kernel_flow),
                ("unparsed", st.unparsed),
                ("vlan", st.vlan),
                ("dropped", dropped),
            ] {
                let l = vec![
                    ("interface".to_string(), ifname.clone()),
                    ("outcome".to_string(), outcome.to_string()),
                ];
                t.advance(
                    &format!("xdp/{ifname}/{outcome}"),
                    n,
                    &self.xdp.get_or_create(&l),
                );
            }
        }
    }

    /// Takes the AF_XDP sockets' counters, per interface.
    pub fn update_xsk(&self, per_queue: &[(String, dataplane::xsk::PortStats)]) {
        let Ok(mut t) = self.totals.lock() else {
            return;
        };
        let mut per_interface: Vec<(&String, dataplane::xsk::PortStats)> = Vec::new();
        for (ifname, st) in per_queue {
            let q = st.queue.to_string();
            let l = vec![
                ("interface".to_string(), ifname.clone()),
                ("queue".to_string(), q.clone()),
            ];
            t.advance(
                &format!("xskq/{ifname}/{q}"),
                st.rx_packets,
                &self.xsk_packets.get_or_create(&l),
            );
            match per_interface.iter_mut().find(|(n, _)| *n == ifname) {
                Some((_, a)) => {
                    a.rx_dropped += st.rx_dropped;
                    a.rx_ring_full += st.rx_ring_full;
                    a.rx_fill_ring_empty += st.rx_fill_ring_empty;
                }
                None => per_interface.push((ifname, *st)),
            }
        }
        for (ifname, st) in per_interface {
            // The kernel counts a packet dropped for want of a buffer in both rx_dropped
            // and the fill ring's empty count.
            for (reason, n) in [
                ("fill_ring_empty", st.rx_fill_ring_empty),
                ("rx_ring_full", st.rx_ring_full),
                ("other", st.rx_dropped.saturating_sub(st.rx_fill_ring_empty)),
            ] {
                let l = vec![
                    ("interface".to_string(), ifname.clone()),
                    ("reason".to_string(), reason.to_string()),
                ];
                t.advance(
                    &format!("xsk/{ifname}/{reason}"),
                    n,
                    &self.xsk_drops.get_or_create(&l),
                );
            }
        }
    }

    /// The OpenMetrics text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// What /proc says of this process.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProcessStats {
    /// utime + stime, in clock ticks.
    pub cpu_ticks: u64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub open_fds: u64,
    pub max_fds: u64,
    /// Seconds since the epoch.
    pub start_time: f64,
}

impl ProcessStats {
    /// From /proc/self (None if /proc cannot be read).
    pub fn read() -> Option<ProcessStats> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot = std::fs::read_to_string("/proc/stat").ok()?;
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
        let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
        let mut p = Self::parse(
            &stat,
            &boot,
            &limits,
            dataplane::sys::clock_ticks_per_sec(),
            dataplane::sys::page_size(),
        )?;
        p.open_fds = open;
        Some(p)
    }

    /// `/proc/self/stat`, `/proc/stat` (for btime) and `/proc/self/limits`.
    pub fn parse(stat: &str, proc_stat: &str, limits: &str, hz: u64, page: u64) -> Option<Self> {
        // The command name may hold spaces and parentheses: fields start after the last ')'.
        let rest = &stat[stat.rfind(')')? + 1..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        // After the name: state is field 3, so field N is f[N - 3].
        let num = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
        let utime = num(14)?;
        let stime = num(15)?;
        let start_ticks = num(22)?;
        let vsize = num(23)?;
        let rss_pages = num(24)?;
        let btime: u64 = proc_stat
            .lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse().ok())?;
        let max_fds = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .and_then(|l| l.split_whitespace().nth(3))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Some(ProcessStats {
            cpu_ticks: utime + stime,
            resident_bytes: rss_pages * page,
            virtual_bytes: vsize,
            open_fds: 0,
            max_fds,
            start_time: btime as f64 + start_ticks as f64 / hz.max(1) as f64,
        })
    }
}

/// Produces the `/configz` JSON.
pub type ConfigzFn = Arc<dyn Fn() -> String + Send + Sync>;

/// kube-proxy's metrics server: `/metrics`, `/proxyMode`, `/configz`.
#[derive(Debug)]
pub struct MetricsServer(crate::http::HttpServer);

impl MetricsServer {
    /// Binds and serves in a background thread.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start(
        addr: SocketAddr,
        metrics: Arc<Metrics>,
        proxy_mode: &'static str,
        configz: ConfigzFn,
    ) -> std::io::Result<MetricsServer> {
        crate::http::HttpServer::start(addr, "kxp-metrics", move |method, path| {
            answer(method, path, &metrics, proxy_mode, &configz)
        })
        .map(MetricsServer)
    }

    /// As [`MetricsServer::start`]; without `hard_fail`, an address that cannot be bound
    /// now is tried again every 5 s (kube-proxy's `bindAddressHardFail`).
    ///
    /// # Errors
    /// With `hard_fail`, the address cannot be bound.
    pub fn start_or_retry(
        addr: SocketAddr,
        metrics: Arc<Metrics>,
        proxy_mode: &'static str,
        configz: ConfigzFn,
        hard_fail: bool,
    ) -> std::io::Result<MetricsServer> {
        crate::http::HttpServer::start_or_retry(
            addr,
            "kxp-metrics",
            hard_fail,
            move |method, path| answer(method, path, &metrics, proxy_mode, &configz),
        )
        .map(MetricsServer)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.0.local_addr()
    }

    pub fn stop(self) {
        self.0.stop();
    }
}

fn answer(
    method: &str,
    path: &str,
    metrics: &Metrics,
    proxy_mode: &str,
    configz: &ConfigzFn,
) -> crate::http::Response {
    let text = "text/plain; charset=utf-8";
    let ok = |content_type, body| crate::http::Response {
        status: "200 OK",
        content_type,
        body,
        headers: Vec::new(),
    };
    if method != "GET" && method != "HEAD" {
        return crate::http::Response {
            status: "405 Method Not Allowed",
            content_type: text,
            body: "Method Not Allowed\n".to_string(),
            headers: Vec::new(),
        };
    }
    match path {
        "/metrics" => ok(METRICS_CONTENT_TYPE, metrics.render()),
        "/proxyMode" => ok(text, proxy_mode.to_string()),
        "/configz" => ok("application/json", configz()),
        _ => crate::http::Response::not_found(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;
    use std::net::TcpStream;

    fn sample(text: &str, name: &str) -> Option<f64> {
        text.lines()
            .find(|l| !l.starts_with('#') && l.split(' ').next() == Some(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    #[test]
    fn full_and_partial_syncs_pending_changes_requests_and_the_process() {
        let m = Metrics::new();
        m.observe_sync(Duration::from_millis(3), true);
        m.observe_sync(Duration::from_millis(3), false);
        m.observe_sync(Duration::from_millis(3), false);
        m.update_api(&[
            ApiCounters {
                resource: "services".into(),
                pending: 2,
                ..Default::default()
            },
            ApiCounters {
                resource: "endpointslices".into(),
                pending: 7,
                ..Default::default()
            },
        ]);
        let req = |n| {
            vec![(
                (
                    "200".to_string(),
                    "198.18.0.1:6443".to_string(),
                    "GET".to_string(),
                ),
                n,
            )]
        };
        m.update_rest_requests(&req(3));
        m.update_rest_requests(&req(5));
        m.update_process();
        let t = m.render();
        for needle in [
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count 1",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count 2",
            "kubeproxy_sync_proxy_rules_duration_seconds_count 3",
            "kubeproxy_sync_proxy_rules_service_changes_pending 2",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending 7",
            "rest_client_requests_total{code=\"200\",host=\"198.18.0.1:6443\",method=\"GET\"} 5",
            "# TYPE process_cpu_seconds counter",
        ] {
            assert!(t.contains(needle), "missing {needle:?} in\n{t}");
        }
        assert!(
            sample(&t, "process_resident_memory_bytes").unwrap() > 1e5,
            "{t}"
        );
        assert!(sample(&t, "process_open_fds").unwrap() >= 3.0, "{t}");
        let start = sample(&t, "process_start_time_seconds").unwrap();
        let now = unix_now();
        assert!(
            start <= now + 1.0 && start > now - 86400.0 * 365.0,
            "{start} vs {now}"
        );
    }

    #[test]
    fn proc_stat_is_read_after_the_command_name() {
        // A name with spaces and a parenthesis, as a thread can be named.
        let stat = "1234 (kxp (x) y) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 5000 123456789 2000 18446744073709551615";
        let p = ProcessStats::parse(
            stat,
            "cpu 1 2\nbtime 1700000000\n",
            "Max open files            1024                 524288               files\n",
            100,
            4096,
        )
        .unwrap();
        assert_eq!(p.cpu_ticks, 300);
        assert_eq!(p.resident_bytes, 2000 * 4096);
        assert_eq!(p.virtual_bytes, 123_456_789);
        assert_eq!(p.max_fds, 1024);
        assert_eq!(p.start_time, 1_700_000_050.0);
        assert!(ProcessStats::parse("garbage", "", "", 100, 4096).is_none());
    }

    #[test]
    fn renders_kube_proxy_names() {
        let m = Metrics::new();
        m.observe_sync(Duration::from_millis(3), false);
        m.observe_network_programming(Duration::from_secs(2));
        m.set_last_sync_now();
        m.set_queued_now();
        m.add_service_changes(2);
        m.add_endpoint_changes(5);
        m.set_no_local_endpoints(1, 3);
        m.healthz_served(200);
        m.healthz_served(503);
        m.livez_served(200);
        let t = m.render();
        for needle in [
            "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.001\"} 0",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.004\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"16.384\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_count 1",
            "# TYPE kubeproxy_network_programming_duration_seconds histogram",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.25\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"2.0\"} 1",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"300.0\"} 1",
            "# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge",
            "# TYPE kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds gauge",
            "kubeproxy_sync_proxy_rules_service_changes_total 2",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 5",
            "# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"} 1",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"external\"} 3",
            "kubeproxy_proxy_healthz_total{code=\"200\"} 1",
            "kubeproxy_proxy_healthz_total{code=\"503\"} 1",
            "kubeproxy_proxy_livez_total{code=\"200\"} 1",
            "# EOF",
        ] {
            assert!(t.contains(needle), "missing {needle:?} in\n{t}");
        }
        let last = sample(&t, "kubeproxy_sync_proxy_rules_last_timestamp_seconds").unwrap();
        assert!(last > 1.7e9, "{last}");
    }

    #[test]
    fn counters_follow_totals_and_never_go_down() {
        let m = Metrics::new();
        let mut c = DataplaneCounters {
            forwarded: 10,
            forwarded_bytes: 1000,
            dropped: 2,
            drops: vec![("no_endpoints".into(), 2)],
            conntrack_entries: 7,
            conntrack_inserts: 9,
            handoffs: 1,
            pass_checksums_completed: 0,
            vlan_untagged: 3,
            vlan_tagged: 2,
            policy_handover: 0,
            generation: 4,
            snapshot_age_secs: 1.5,
            busy_ratio: vec![0.25, 0.5],
            stalls: vec![
                dataplane::worker::Stalls::default(),
                dataplane::worker::Stalls {
                    count: 3,
                    total_ns: 45_000_000,
                    longest_ns: 30_000_000,
                    by_part: [1, 2, 0, 0],
                },
            ],
            ..Default::default()
        };
        m.update_dataplane(&c);
        m.update_dataplane(&c);
        let t = m.render();
        let get = |t: &str, n: &str| sample(t, n).unwrap_or_else(|| panic!("{n} in\n{t}"));
        assert_eq!(get(&t, "kxp_packets_total{verdict=\"forwarded\"}"), 10.0);
        assert_eq!(get(&t, "kxp_bytes_total{verdict=\"forwarded\"}"), 1000.0);
        assert_eq!(get(&t, "kxp_packets_total{verdict=\"dropped\"}"), 2.0);
        assert_eq!(get(&t, "kxp_drops_total{reason=\"no_endpoints\"}"), 2.0);
        assert_eq!(get(&t, "kxp_conntrack_entries"), 7.0);
        assert_eq!(get(&t, "kxp_conntrack_insertions_total"), 9.0);
        assert_eq!(get(&t, "kxp_handoffs_total"), 1.0);
        assert_eq!(get(&t, "kxp_snapshot_generation"), 4.0);
        assert_eq!(get(&t, "kxp_snapshot_age_seconds"), 1.5);
        assert_eq!(get(&t, "kxp_worker_busy_ratio{worker=\"1\"}"), 0.5);
        assert_eq!(get(&t, "kxp_worker_stalls_total{worker=\"1\"}"), 3.0);
        assert_eq!(get(&t, "kxp_worker_stalls_total{worker=\"0\"}"), 0.0);
        assert_eq!(
            get(&t, "kxp_worker_stall_seconds_total{worker=\"1\"}"),
            0.045
        );
        assert_eq!(
            get(&t, "kxp_worker_longest_stall_seconds{worker=\"1\"}"),
            0.03
        );

        c.forwarded = 15;
        c.conntrack_entries = 3;
        m.update_dataplane(&c);
        let t = m.render();
        assert_eq!(get(&t, "kxp_packets_total{verdict=\"forwarded\"}"), 15.0);
        assert_eq!(get(&t, "kxp_conntrack_entries"), 3.0, "gauges may go down");

        // A lower total (dataplane restarted) does not lower the counter; growth from
        // the new base is added.
        c.forwarded = 4;
        m.update_dataplane(&c);
        c.forwarded = 6;
        m.update_dataplane(&c);
        let t = m.render();
        assert_eq!(get(&t, "kxp_packets_total{verdict=\"forwarded\"}"), 17.0);
    }

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut c = TcpStream::connect(addr).unwrap();
        write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut resp = String::new();
        std::io::Read::read_to_string(&mut c, &mut resp).unwrap();
        resp
    }

    #[test]
    fn socket_drops_are_counted_per_interface_and_reason() {
        let m = Metrics::new();
        let st = |empty: u64, full: u64, dropped: u64| dataplane::xsk::PortStats {
            rx_dropped: dropped,
            rx_ring_full: full,
            rx_fill_ring_empty: empty,
            ..Default::default()
        };
        m.update_xsk(&[("eth0".into(), st(5, 1, 7)), ("veth1".into(), st(0, 0, 0))]);
        m.update_xsk(&[("eth0".into(), st(9, 1, 12))]);
        let t = m.render();
        let get = |n: &str| sample(&t, n).unwrap_or_else(|| panic!("{n} in\n{t}"));
        assert_eq!(
            get("kxp_xsk_rx_drops_total{interface=\"eth0\",reason=\"fill_ring_empty\"}"),
            9.0
        );
        assert_eq!(
            get("kxp_xsk_rx_drops_total{interface=\"eth0\",reason=\"rx_ring_full\"}"),
            1.0
        );
        assert_eq!(
            get("kxp_xsk_rx_drops_total{interface=\"eth0\",reason=\"other\"}"),
            3.0
        );
        assert_eq!(
            get("kxp_xsk_rx_drops_total{interface=\"veth1\",reason=\"fill_ring_empty\"}"),
            0.0
        );
    }

    #[test]
    fn serves_metrics_proxy_mode_and_configz() {
        let m = Arc::new(Metrics::new());
        m.add_service_changes(3);
        let configz: ConfigzFn =
            Arc::new(|| r#"{"kubeproxy.config.k8s.io":{"mode":"kxp"}}"#.to_string());
        let s = MetricsServer::start("127.0.0.1:0".parse().unwrap(), m, "kxp", configz).unwrap();

        let r = get(s.local_addr(), "/metrics");
        assert!(r.starts_with("HTTP/1.1 200 OK"), "{r}");
        assert!(r.contains("application/openmetrics-text"), "{r}");
        assert!(
            r.contains("kubeproxy_sync_proxy_rules_service_changes_total 3"),
            "{r}"
        );

        let r = get(s.local_addr(), "/proxyMode");
        assert!(r.starts_with("HTTP/1.1 200 OK"), "{r}");
        assert!(r.ends_with("\r\n\r\nkxp"), "{r}");

        let r = get(s.local_addr(), "/configz?x=1");
        assert!(r.contains("Content-Type: application/json"), "{r}");
        assert!(
            r.ends_with(r#"{"kubeproxy.config.k8s.io":{"mode":"kxp"}}"#),
            "{r}"
        );

        let r = get(s.local_addr(), "/nope");
        assert!(r.starts_with("HTTP/1.1 404 Not Found"), "{r}");
        s.stop();
    }
}
