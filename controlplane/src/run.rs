//! `kxp run`: the dataplane fed from a state file, with kube-proxy's health endpoints.
//!
//! The state file is watched: a change is parsed, turned into a snapshot and published
//! while traffic flows; an edit that cannot be read is logged with the reason and the last
//! good state stays in force. SIGTERM / SIGINT detach everything kxp attached and exit 0.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use dataplane::plane::{Dataplane, DataplaneConfig};
use nat::snapshot::{Snapshot, Update};
use translate::tracker::build;
use translate::tracker::{Synced, Tracker};

use crate::config::KubeProxyConfiguration;
use crate::hcnp::ServiceHealthServers;
use crate::health::{Health, HealthServer};
use crate::settings::{NodeFlags, node_settings};
use crate::state::load_state;

/// Everything `kxp run` was asked to do.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub interfaces: Vec<String>,
    /// A state file; without one, the Kubernetes API (kubeconfig / master / in-cluster).
    pub state_file: Option<PathBuf>,
    pub kubeconfig: Option<PathBuf>,
    pub master: Option<String>,
    pub config: Option<PathBuf>,
    /// kube-proxy's flags as a configuration, and which were given (used without
    /// `--config`; ignored with it, as kube-proxy does).
    pub flag_config: (KubeProxyConfiguration, Vec<&'static str>),
    /// kube-proxy's flags as given (for the ones that are not configuration).
    pub kube_proxy: crate::kpflags::KubeProxyFlags,
    pub flags: NodeFlags,
    pub workers: Option<usize>,
    pub cpus: Option<Vec<usize>>,
    /// `--worker-nice` (see [`dataplane::plane::DataplaneConfig::worker_nice`]).
    pub worker_nice: Option<i32>,
    pub snat_ports: Option<(u16, u16)>,
    /// Preferred busy polling on the AF_XDP sockets: (µs, budget).
    pub busy_poll: Option<(u32, u32)>,
    /// See [`dataplane::xsk::XskConfig::queue_budget_us`].
    pub queue_budget_us: u32,
    /// See [`dataplane::xsk::XskConfig::idle_spin_us`].
    pub idle_spin_us: Option<u32>,
    /// `--state-dir`: `Some("")` turns persistence off; `None`: the config's, else the
    /// default.
    pub state_dir: Option<PathBuf>,
    /// `--admin-socket`: `Some("")` serves none; `None`: the config's, else the default.
    pub admin_socket: Option<PathBuf>,
}

/// Reads the configuration, starts the dataplane and serves until a signal.
///
/// # Errors
/// Anything that keeps kxp from starting, with what to do about it.
pub fn run(opts: RunOptions) -> anyhow::Result<()> {
    let (cfg, origin) = match &opts.config {
        Some(path) => {
            let (_, given) = &opts.flag_config;
            if !given.is_empty() {
                tracing::warn!(
                    "{} ignored: --config is given, and as in kube-proxy the file wins",
                    given.join(", ")
                );
            }
            (
                KubeProxyConfiguration::load(path)?,
                path.display().to_string(),
            )
        }
        None => (opts.flag_config.0.clone(), "flags".to_string()),
    };
    let from_file = opts.config.is_some();
    // kube-proxy's defaulting of a file: an empty address is the default, an IP alone
    // gets the default port. From flags, "" turns the server off (as in kube-proxy).
    let bind = |value: Option<&str>, default: &str, port: u16, what: &str| {
        let v = match value {
            Some(v) if !(from_file && v.is_empty()) => v,
            _ => default,
        };
        crate::kpflags::bind_address(v, port).map_err(|e| anyhow::anyhow!("{what}: {e}"))
    };
    let metrics_addr = bind(
        cfg.metrics_bind_address.as_deref(),
        crate::kpflags::METRICS_DEFAULT,
        10249,
        "metricsBindAddress",
    )?;
    // --healthz-bind-address wins over the file (kxp's one exception, for tests and
    // several kxp on one host).
    let healthz = match &opts.kube_proxy.healthz_bind_address {
        Some(h) if from_file => crate::kpflags::bind_address(h, 10256)
            .map_err(|e| anyhow::anyhow!("--healthz-bind-address: {e}"))?,
        _ => bind(
            cfg.healthz_bind_address.as_deref(),
            crate::kpflags::HEALTHZ_DEFAULT,
            10256,
            "healthzBindAddress",
        )?,
    };
    let hard_fail = cfg.bind_address_hard_fail.unwrap_or(false);
    let configz_text = serde_json::json!({ "kubeproxy.config.k8s.io": &cfg }).to_string();
    if from_file {
        for (field, why) in cfg.not_honoured() {
            tracing::warn!("{origin}: {field} is not honoured: {why}");
        }
    } else {
        for (flag, why) in opts.kube_proxy.not_applicable() {
            tracing::warn!("{flag} is not applicable to kxp: {why}");
        }
    }
    if opts.kube_proxy.healthz_port.is_some() || opts.kube_proxy.metrics_port.is_some() {
        tracing::warn!(
            "--healthz-port and --metrics-port are deprecated (as in kube-proxy): give --healthz-bind-address / --metrics-bind-address"
        );
    }
    if let Some(mode) = cfg.mode.as_deref().filter(|m| !m.is_empty()) {
        tracing::info!("proxy mode {mode:?}: kxp's AF_XDP dataplane carries its Service semantics");
    }
    let (dp_cfg, kxp) = dataplane_config(&cfg, &opts)?;
    let cfg = Some(cfg);
    let mut settings = node_settings(cfg.as_ref(), &opts.flags, &origin)?;
    if opts.kube_proxy.init_only == Some(true) {
        tracing::info!(
            "--init-only: kxp has no separate privileged initialisation (its dataplane needs its capabilities while it runs); the configuration is valid, exiting"
        );
        return Ok(());
    }
    // Before anything is set up: a missing capability is named, not met halfway.
    dataplane::caps::check().map_err(|e| anyhow::anyhow!(e))?;
    // kube-proxy's oomScoreAdj (default -999): the node's proxy is the last to be killed.
    let oom = cfg
        .as_ref()
        .and_then(|c| c.oom_score_adj)
        .unwrap_or(-999)
        .clamp(-1000, 1000);
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", oom.to_string()) {
        tracing::warn!("cannot set oomScoreAdj {oom}: {e}");
    }

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }
    let kubeconfig = opts.kubeconfig.clone().or_else(|| {
        cfg.as_ref()
            .and_then(|c| c.client_connection.as_ref())
            .and_then(|c| c.kubeconfig.clone())
            .filter(|k| !k.is_empty())
            .map(PathBuf::from)
    });
    let service_proxy_name = cfg
        .as_ref()
        .and_then(|c| c.service_proxy_name.clone())
        .filter(|n| !n.is_empty());
    let mut input = match &opts.state_file {
        Some(path) => Input::file(path),
        None => Input::kube(
            kubeconfig.as_deref(),
            opts.master.as_deref(),
            cfg.as_ref()
                .and_then(|c| c.client_connection.as_ref())
                .and_then(|c| crate::kube_source::RateLimit::from_config(c.qps, c.burst)),
            &settings.node_name,
            service_proxy_name,
            settings.network_policy,
            cfg.as_ref()
                .is_some_and(KubeProxyConfiguration::kernel_policy),
            &stop,
        )?,
    };
    if cfg
        .as_ref()
        .is_some_and(KubeProxyConfiguration::kernel_policy)
    {
        tracing::info!(
            "NetworkPolicy enforced on the connections kxp translates (NetworkPolicies, Pods \
             and Namespaces watched), and the CNI's own policy too: translated packets for \
             this node's pods go through the kernel (kxp.networkPolicy: kernel)"
        );
    } else if settings.network_policy {
        tracing::info!(
            "NetworkPolicy enforced on the connections kxp translates (NetworkPolicies, Pods \
             and Namespaces watched)"
        );
    } else {
        tracing::info!("NetworkPolicy is not enforced (kxp.networkPolicy: off)");
    }
    let (min_sync, resync) = sync_periods(cfg.as_ref());
    let mut tracker = Tracker::new(settings.clone());
    let listed = Instant::now();
    input
        .feed(&mut tracker, true)
        .map_err(|e| anyhow::anyhow!("{}: {e:#}", input.describe()))?;
    let listing = listed.elapsed();

    let metrics = Arc::new(crate::metrics::Metrics::new());
    let health = Arc::new(Health::with_timeout(resync * 2));
    health.set_metrics(metrics.clone());
    let server = healthz
        .map(|a| HealthServer::start_or_retry(a, health.clone(), hard_fail))
        .transpose()
        .with_context(|| {
            format!(
                "cannot serve /healthz on {}; give --healthz-bind-address ADDR:PORT",
                healthz.map_or_else(String::new, |a| a.to_string())
            )
        })?;

    // Started empty (nothing is redirected yet); the first sync follows once the node's
    // addresses and the host's are known (generation 2).
    let mut dp = Dataplane::start(&dp_cfg, Snapshot::empty(0, Default::default()))?;
    let admin_path = path_setting(
        &opts.admin_socket,
        &kxp.admin_socket,
        crate::admin::default_socket,
    );
    let admin = admin_path
        .map(|p| crate::admin::AdminServer::start(&p, dp.shared.clone(), dp.node.clone()))
        .transpose()?;
    let mut generation = 1;
    // The Node object (or --node-ip) gives the node's primary addresses (kube-proxy's
    // way); the host's are local to the node beside them, its NodePort addresses in
    // iptables mode, and the fallback when nothing else gives any (followed as they
    // change, below).
    settings.host_addrs = host_addresses(&dp);
    tracker.set_settings(settings.clone());
    generation += 1;
    let first_started = Instant::now();
    let first = tracker.sync(generation);
    report(&first, &input);
    let mut hc = ServiceHealthServers::start(health.clone())
        .context("starting the service health servers")?;
    for e in hc.sync(&first.update) {
        tracing::warn!("{e}");
    }
    // kube-proxy's iptables.localhostNodePorts: NodePorts on 127.0.0.1, relayed.
    let mut localnp = crate::settings::localhost_node_ports(cfg.as_ref())
        .then(crate::localnp::LocalhostNodePorts::default);
    if let Some(l) = &mut localnp {
        for e in l.sync(&first.update) {
            tracing::warn!("{e}");
        }
        tracing::info!(
            "NodePorts on 127.0.0.1 (iptables.localhostNodePorts, iptables mode): {} served",
            l.serving().len()
        );
    }
    dp.publish(first.update)?;
    let first_sync = first_started.elapsed();
    // Filled with the first state: the new programs replace the ones a previous kxp left
    // steering (and holding) the interfaces.
    let taking_over = Instant::now();
    if let Err(e) = dp.take_over() {
        tracing::warn!(error = %e, "taking over the previous kxp's XDP links");
    }
    let taken_over = taking_over.elapsed();
    // kube-proxy's leftovers: a kube-proxy DaemonSet whose image became kxp's never ran
    // `kube-proxy --cleanup`, and its rules would keep DNATing the node's own
    // connections to the endpoints of the day it stopped.
    let leftovers = Instant::now();
    crate::leftovers::log(&crate::leftovers::remove_all());
    tracing::info!(
        interfaces = dp.start_times.interfaces,
        "start-up: reading the state {} ms, {}, first sync {} ms, take-over {} ms, \
         kube-proxy's leftovers {} ms",
        listing.as_millis(),
        dp.start_times.describe(),
        first_sync.as_millis(),
        taken_over.as_millis(),
        leftovers.elapsed().as_millis()
    );
    if let Some(r) = dp.restored() {
        tracing::info!(
            "restored {} flow(s) and {} affinity entries from the previous process",
            r.flows,
            r.affinity
        );
    }
    health.set_node_eligible(node_eligible(tracker.node_object().map(|n| &**n)));
    health.programmed();
    metrics.observe_sync(first_started.elapsed(), true);
    metrics.set_last_sync_now();
    tracing::info!(
        "initial sync: {} Services, {} EndpointSlices, {} Service ports programmed in {:.1} ms",
        tracker.service_count(),
        tracker.slice_count(),
        dp.current().port_count(),
        listed.elapsed().as_secs_f64() * 1e3
    );
    let metrics_server = metrics_addr
        .map(|a| {
            crate::metrics::MetricsServer::start_or_retry(
                a,
                metrics.clone(),
                "kxp",
                Arc::new(move || configz_text.clone()),
                hard_fail,
            )
        })
        .transpose()
        .with_context(|| {
            format!(
                "cannot serve /metrics on {}; give --metrics-bind-address ADDR:PORT",
                metrics_addr.map_or_else(String::new, |a| a.to_string())
            )
        })?;
    // Set up: every thread keeps only what the rest of the run needs.
    match dataplane::caps::drop_after_setup() {
        Ok(d) if d.stragglers.is_empty() => tracing::info!(
            "capabilities after setup: kept {}; dropped {} others ({}) in {} thread(s)",
            dataplane::caps::names(d.kept).join(", "),
            d.dropped.count_ones(),
            dataplane::caps::names(d.dropped).join(", "),
            d.threads
        ),
        Ok(d) => tracing::warn!(
            "capabilities after setup: kept {}, but thread(s) {} did not drop the others",
            dataplane::caps::names(d.kept).join(", "),
            d.stragglers.join(", ")
        ),
        Err(e) => tracing::warn!("capabilities not dropped after setup: {e}"),
    }
    let mut last_metrics = Instant::now();
    let attached: Vec<String> = dp.attached().into_iter().map(|(n, _)| n).collect();
    tracing::info!(
        "running on {} (attached now: {}; service device {}) with {} worker(s); health on {}",
        dp_cfg.interfaces.join(", "),
        if attached.is_empty() {
            "none yet".to_string()
        } else {
            attached.join(", ")
        },
        dp.service_device().unwrap_or("-"),
        dp_cfg.workers,
        server.as_ref().map_or_else(
            || "no address".to_string(),
            |s| format!("http://{}/healthz", s.local_addr())
        )
    );

    let stats_every = std::env::var("KXP_LOG_STATS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs);
    let mut last_stats = Instant::now();
    let mut last_sync = Instant::now();
    let mut pending = false;
    let mut last_host_check = Instant::now();
    let mut retry_at: Option<Instant> = None;
    let mut no_local = NoLocal::default();
    no_local.apply(&Update::full(dp.current()));
    while !stop.load(Ordering::Relaxed) {
        // Wake up for a change (then wait out minSyncPeriod), or every 100 ms.
        let tick = Duration::from_millis(100);
        input.wait(if pending {
            min_sync.saturating_sub(last_sync.elapsed()).min(tick)
        } else {
            tick
        });
        if let Some(every) = stats_every
            && last_stats.elapsed() >= every
        {
            last_stats = Instant::now();
            tracing::info!("{}", totals_line(&dp));
        }
        if last_metrics.elapsed() >= Duration::from_secs(1) {
            last_metrics = Instant::now();
            update_metrics(&metrics, &dp, last_sync);
            metrics.update_process();
            metrics.update_xdp(&dp.steer_stats());
            metrics.update_xsk(&dp.shared.socket_stats_per_queue(Duration::from_millis(200)));
            if let Input::Kube { source, .. } = &input {
                let api: Vec<crate::metrics::ApiCounters> = source
                    .status()
                    .resources
                    .into_iter()
                    .map(|r| crate::metrics::ApiCounters {
                        resource: r.resource.to_string(),
                        events: r.events,
                        errors: r.errors,
                        relists: r.relists,
                        failing: r.failing,
                        objects: r.objects,
                        pending: r.pending,
                    })
                    .collect();
                metrics.update_api(&api);
                metrics.update_rest_requests(&source.rest_requests());
            }
        }
        if input.changed() {
            pending = true;
            health.queued();
            metrics.set_queued_now();
        }
        // The host's addresses, followed as they change (an address added to or removed
        // from a link).
        if last_host_check.elapsed() >= Duration::from_secs(1) {
            last_host_check = Instant::now();
            let now = host_addresses(&dp);
            if now != settings.host_addrs {
                tracing::info!(
                    from = ?settings.host_addrs,
                    to = ?now,
                    "the host's addresses changed"
                );
                settings.host_addrs = now;
                tracker.set_settings(settings.clone());
                pending = true;
            }
        }
        // kube-proxy's sync loop: changes are batched by minSyncPeriod, and the whole
        // state is re-synced every syncPeriod even without changes.
        let periodic = input.resyncs() && last_sync.elapsed() >= resync;
        // A failed programming is retried after syncPeriod, as kube-proxy does.
        let retry = retry_at.is_some_and(|t| Instant::now() >= t);
        let due = periodic || retry || (pending && last_sync.elapsed() >= min_sync);
        if !due {
            continue;
        }
        pending = false;
        last_sync = Instant::now();
        let started = Instant::now();
        let fed = input.feed(&mut tracker, periodic);
        let t_feed = started.elapsed();
        if let Err(e) = fed {
            tracing::warn!("{}: {e:#}; keeping the last good state", input.describe());
            health.programmed();
            continue;
        }
        generation += 1;
        let synced = tracker.sync(generation);
        let t_track = started.elapsed();
        report(&synced, &input);
        health.set_node_eligible(node_eligible(tracker.node_object().map(|n| &**n)));
        metrics.add_service_changes(synced.service_changes);
        metrics.add_endpoint_changes(synced.endpoint_changes);
        no_local.apply(&synced.update);
        metrics.set_no_local_endpoints(no_local.internal, no_local.external);
        let mut update = synced.update;
        // The periodic re-sync also redoes the XDP maps in full (repairs any drift).
        update.full |= periodic;
        let rebuilt = synced.rebuilt;
        for e in hc.sync(&update) {
            let text = e.to_string();
            dataplane::warn_limited!(text, "{text}");
        }
        if let Some(l) = &mut localnp {
            for text in l.sync(&update) {
                dataplane::warn_limited!(text, "{text}");
            }
        }
        let published = dp.publish(update);
        let done = started.elapsed();
        if let Err(e) = published {
            dataplane::error_limited!(
                "publish",
                "programming the XDP maps: {e:#}; retrying every {} s",
                resync.as_secs()
            );
            retry_at = Some(Instant::now() + resync);
            continue;
        }
        retry_at = None;
        health.programmed();
        metrics.observe_sync(started.elapsed(), periodic || retry);
        metrics.set_last_sync_now();
        // kube-proxy's network programming latency: from the change that triggered an
        // EndpointSlice update to the sync that programmed it.
        let now = SystemTime::now();
        for t in &synced.trigger_times {
            if let Some(d) = since_trigger(t, now) {
                metrics.observe_network_programming(d);
            }
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        tracing::info!(
            "{} applied (generation {generation}, {rebuilt} Service(s) rebuilt; \
             changes {:.3} + tracker {:.3} + dataplane {:.3} = {:.3} ms)",
            input.describe(),
            ms(t_feed),
            ms(t_track - t_feed),
            ms(done - t_track),
            ms(done)
        );
    }
    tracing::info!("{}", totals_line(&dp));
    match &dp_cfg.state_dir {
        Some(dir) => tracing::info!(
            "stopping: connections and steering kept for the next kxp ({}); `kxp cleanup` removes them",
            dir.display()
        ),
        None => tracing::info!("stopping: detaching from {}", dp_cfg.interfaces.join(", ")),
    }
    drop(admin);
    dp.stop();
    hc.stop();
    if let Some(s) = server {
        s.stop();
    }
    if let Some(s) = metrics_server {
        s.stop();
    }
    Ok(())
}

/// How long ago `t` (RFC 3339, the `last-change-trigger-time` annotation) was; `None`
/// for an unreadable time or one in the future (clock skew), as kube-proxy skips them.
fn since_trigger(t: &str, now: SystemTime) -> Option<Duration> {
    let ts: k8s_openapi::jiff::Timestamp = t.parse().ok()?;
    let then = SystemTime::from(ts);
    now.duration_since(then).ok()
}

/// Logs what a sync noticed: objects skipped as kube-proxy skips them, and objects in
/// error (each keeps its last good version).
fn report(s: &Synced, input: &Input) {
    for n in &s.notes {
        tracing::info!("note: {n}");
    }
    for e in &s.errors {
        let text = e.to_string();
        dataplane::warn_limited!(
            text,
            "{}: {text}; its last good version stays in force",
            input.describe()
        );
    }
}

/// Services whose traffic policy is Local and that have endpoints, but none on this node
/// (kube-proxy's `sync_proxy_rules_no_local_endpoints_total`, internal / external), kept
/// by difference.
#[derive(Debug, Default)]
struct NoLocal {
    internal: u64,
    external: u64,
}

impl NoLocal {
    fn apply(&mut self, u: &Update) {
        if u.full {
            *self = NoLocal::default();
            for sp in u.snapshot.ports() {
                self.count(sp, true);
            }
            return;
        }
        for sp in &u.added {
            self.count(sp, true);
        }
        for sp in &u.removed {
            self.count(sp, false);
        }
    }

    fn count(&mut self, sp: &nat::model::ServicePort, add: bool) {
        if !sp.cat.has_endpoints || !sp.cat.local.is_empty() {
            return;
        }
        let step = |n: &mut u64, yes: bool| {
            if yes {
                *n = if add { *n + 1 } else { n.saturating_sub(1) };
            }
        };
        step(&mut self.internal, sp.internal_policy_local);
        step(
            &mut self.external,
            sp.external_policy_local && sp.externally_accessible(),
        );
    }
}

fn update_metrics(m: &crate::metrics::Metrics, dp: &Dataplane, last_sync: Instant) {
    let t = dp.totals();
    m.update_dataplane(&crate::metrics::DataplaneCounters {
        forwarded: t.forwarded,
        forwarded_bytes: t.forwarded_bytes,
        rejected: t.rejected,
        dropped: t.dropped,
        passed: t.passed,
        drops: t.drops.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        conntrack_entries: t.conntrack_entries,
        conntrack_inserts: t.conntrack_inserts,
        conntrack_evictions: t.conntrack_evictions,
        affinity_entries: t.affinity.entries,
        affinity_expired: t.affinity.expired,
        affinity_evictions: t.affinity.evictions,
        handoffs: t.handoffs,
        pass_checksums_completed: t.pass_checksums_completed,
        vlan_untagged: t.vlan_untagged,
        vlan_tagged: t.vlan_tagged,
        policy_handover: t.policy_handover,
        generation: t.generation,
        snapshot_age_secs: last_sync.elapsed().as_secs_f64(),
        busy_ratio: t.busy_ratio,
        stalls: t.stalls,
    });
}

/// Where the cluster's objects come from.
enum Input {
    File {
        path: PathBuf,
        watch: FileWatch,
    },
    Kube {
        // Field order = drop order: the watchers before their runtime.
        source: crate::kube_source::KubeSource,
        changes: tokio::sync::watch::Receiver<u64>,
        /// A change arrived while [`Input::wait`] waited.
        signalled: bool,
        _rt: tokio::runtime::Runtime,
    },
}

impl Input {
    fn file(path: &Path) -> Input {
        Input::File {
            path: path.to_path_buf(),
            watch: FileWatch::new(path),
        }
    }

    /// Connects to the API server and waits (while not stopped) for the first lists.
    #[allow(clippy::too_many_arguments)]
    fn kube(
        kubeconfig: Option<&Path>,
        master: Option<&str>,
        limit: Option<crate::kube_source::RateLimit>,
        node_name: &str,
        service_proxy_name: Option<String>,
        network_policy: bool,
        kernel_policy: bool,
        stop: &AtomicBool,
    ) -> anyhow::Result<Input> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kxp-kube")
            .enable_all()
            .build()
            .context("starting the Kubernetes client's runtime")?;
        let client = rt.block_on(crate::kube_source::client_from(kubeconfig, master, limit))?;
        // Policy objects kxp does not enforce: the CNI enforces them in the kernel, which
        // never sees the connections kxp translates.
        let foreign = rt.block_on(crate::kube_source::foreign_policy_groups(&client));
        if !foreign.is_empty() && kernel_policy {
            tracing::info!(
                "the API server serves policy objects of the CNI's: {}; the CNI enforces them \
                 on the connections kxp translates to this node's pods, handed to the kernel \
                 (kxp.networkPolicy: kernel; docs/network-policy.md)",
                foreign.join(", ")
            );
        } else if !foreign.is_empty() {
            tracing::warn!(
                "the API server serves policy objects kxp does not enforce on the connections \
                 it translates: {}; kxp enforces Kubernetes NetworkPolicy only, and the CNI, \
                 which enforces these in the kernel, does not see those connections: set \
                 kxp.networkPolicy: kernel to hand them to it (docs/network-policy.md)",
                foreign.join(", ")
            );
        }
        let source = {
            let _guard = rt.enter();
            crate::kube_source::KubeSource::start(
                client,
                crate::kube_source::SourceConfig {
                    node_name: node_name.to_string(),
                    service_proxy_name,
                    network_policy,
                },
            )
        };
        let mut waited = 0;
        let listing = Instant::now();
        while !rt.block_on(source.wait_synced(Duration::from_secs(1))) {
            if stop.load(Ordering::Relaxed) {
                anyhow::bail!("stopped before the first sync with the API server");
            }
            waited += 1;
            if waited % 10 == 0 {
                // Which lists are missing, and why (a 403 names the RBAC rule to add).
                let missing: Vec<String> = source
                    .status()
                    .resources
                    .iter()
                    .filter(|r| !r.synced)
                    .map(|r| match &r.last_error {
                        Some(e) => format!("{} ({e})", r.resource),
                        None => r.resource.to_string(),
                    })
                    .collect();
                let policy_hint = if missing.iter().any(|m| {
                    m.starts_with("pods")
                        || m.starts_with("namespaces")
                        || m.starts_with("networkpolicies")
                }) {
                    "; NetworkPolicy enforcement needs list and watch on pods, namespaces and \
                     networking.k8s.io networkpolicies (deploy/kxp.yaml's ClusterRole), or \
                     kxp.networkPolicy: off"
                } else {
                    ""
                };
                tracing::warn!(
                    "still waiting for the first lists from the API server ({waited} s): {}{policy_hint}",
                    missing.join(", ")
                );
            }
        }
        let objects: usize = source.status().resources.iter().map(|r| r.objects).sum();
        tracing::info!(
            "first lists from the API server: {objects} objects in {:.1} ms",
            listing.elapsed().as_secs_f64() * 1e3
        );
        let changes = source.subscribe();
        Ok(Input::Kube {
            source,
            changes,
            signalled: false,
            _rt: rt,
        })
    }

    fn describe(&self) -> String {
        match self {
            Input::File { path, .. } => format!("state file {}", path.display()),
            Input::Kube { .. } => "the API server's state".to_string(),
        }
    }

    /// Hands what changed to the tracker (`everything`: the whole state, for the first
    /// and the periodic sync). A state file is read whole and must be valid as a whole:
    /// an invalid edit changes nothing.
    fn feed(&self, tracker: &mut Tracker, everything: bool) -> anyhow::Result<()> {
        match self {
            Input::File { path, .. } => {
                let state = load_state(path)?;
                build(&state, tracker.settings(), 0)?;
                tracker.replace_all(&state);
            }
            Input::Kube { source, .. } => {
                let changes = if everything {
                    source.everything()
                } else {
                    source.take_changes()
                };
                changes.apply(tracker);
            }
        }
        Ok(())
    }

    fn changed(&mut self) -> bool {
        match self {
            Input::File { watch, .. } => watch.changed(),
            Input::Kube {
                changes, signalled, ..
            } => {
                let c = std::mem::take(signalled) || changes.has_changed().unwrap_or(false);
                changes.borrow_and_update();
                c
            }
        }
    }

    /// Sleeps up to `d`; the Kubernetes source wakes up as soon as a change arrives.
    fn wait(&mut self, d: Duration) {
        match self {
            Input::File { .. } => std::thread::sleep(d),
            Input::Kube {
                changes,
                signalled,
                _rt,
                ..
            } => {
                if *signalled {
                    return;
                }
                let got = _rt.block_on(async { tokio::time::timeout(d, changes.changed()).await });
                match got {
                    Ok(Ok(())) => *signalled = true,
                    Ok(Err(_)) => std::thread::sleep(d),
                    Err(_) => {}
                }
            }
        }
    }

    /// Whether the periodic full re-sync (syncPeriod) applies.
    fn resyncs(&self) -> bool {
        matches!(self, Input::Kube { .. })
    }
}

/// kube-proxy's minSyncPeriod (default 1 s) and syncPeriod (default 30 s), from the
/// top level (v1alpha2) or the nftables / iptables sections.
/// The dataplane's configuration from the command line and the file (no side effect but
/// removing state directories of namespaces long gone), and kxp's section of the file.
///
/// # Errors
/// A value kxp cannot run with (0 workers, an empty affinity table, …).
fn dataplane_config(
    cfg: &KubeProxyConfiguration,
    opts: &RunOptions,
) -> anyhow::Result<(DataplaneConfig, crate::config::KxpSection)> {
    let kxp = cfg.kxp.clone().unwrap_or_default();
    let mut dp_cfg = DataplaneConfig {
        interfaces: if !opts.interfaces.is_empty() {
            opts.interfaces.clone()
        } else if let Some(i) = kxp.interfaces.clone().filter(|i| !i.is_empty()) {
            i
        } else {
            // A kube-proxy configuration without kxp's section: the node's traffic, all of
            // it, as kube-proxy's rules see it.
            tracing::info!(
                "no --interface or kxp.interfaces: attaching to every Ethernet link as it comes (not loopback, bridges or bond ports)"
            );
            vec!["*".to_string()]
        },
        ..Default::default()
    };
    if let Some(d) = kxp.service_device.clone() {
        dp_cfg.service_device = d;
    }
    dp_cfg.kernel_policy = cfg.kernel_policy();
    let cpus = opts.cpus.clone().or_else(|| {
        kxp.cpus
            .as_ref()
            .map(|c| c.iter().map(|&x| x as usize).collect())
    });
    dp_cfg.workers = match (opts.workers, &cpus) {
        (Some(w), _) => w,
        (None, Some(c)) => c.len(),
        (None, None) => kxp.workers.map_or(1, |w| w as usize),
    };
    anyhow::ensure!(
        (1..=64).contains(&dp_cfg.workers),
        "{} workers: give 1 to 64 (--workers, --cpus or kxp.workers/kxp.cpus)",
        dp_cfg.workers
    );
    dp_cfg.cpus = cpus;
    dp_cfg.worker_nice = opts.worker_nice.or(kxp.worker_nice);
    if let Some(n) = dp_cfg.worker_nice {
        anyhow::ensure!(
            (-20..=19).contains(&n),
            "kxp.workerNice {n}: give a nice value from -20 (highest priority) to 19"
        );
    }
    if let Some(r) = opts.snat_ports {
        dp_cfg.snat_ports = r;
    }
    dp_cfg.xsk.busy_poll = opts.busy_poll;
    dp_cfg.xsk.queue_budget_us = opts.queue_budget_us;
    dp_cfg.xsk.idle_spin_us = opts.idle_spin_us;
    dp_cfg.state_dir = path_setting(&opts.state_dir, &kxp.state_directory, || {
        let gone = dataplane::statefile::remove_stale_dirs(Duration::from_secs(600));
        if gone > 0 {
            tracing::info!(
                "removed {gone} state director(ies) of other network namespaces, unused for 10 minutes"
            );
        }
        dataplane::statefile::default_state_dir()
    });
    if let Some(n) = kxp.session_affinity_max_entries {
        anyhow::ensure!(
            n > 0,
            "kxp.sessionAffinityMaxEntries must be at least 1 (default 262144)"
        );
        dp_cfg.affinity_capacity = n as usize;
    }
    if let Some(ct) = cfg.conntrack.as_ref() {
        dp_cfg.timeouts = timeouts_from(ct);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per_core = ct.max_per_core.unwrap_or(32_768).max(0) as usize;
        let min = ct.min.unwrap_or(131_072).max(0) as usize;
        if per_core > 0 {
            let total = (per_core * cores).max(min);
            dp_cfg.conntrack_per_worker = (total / dp_cfg.workers).max(1024);
        }
    }

    Ok((dp_cfg, kxp))
}

fn sync_periods(cfg: Option<&KubeProxyConfiguration>) -> (Duration, Duration) {
    let pick = |top: Option<crate::config::GoDuration>,
                nft: Option<crate::config::GoDuration>,
                ipt: Option<crate::config::GoDuration>,
                default: Duration| {
        [top, nft, ipt]
            .into_iter()
            .flatten()
            .map(|g| g.0)
            .find(|d| !d.is_zero())
            .unwrap_or(default)
    };
    let Some(c) = cfg else {
        return (Duration::from_secs(1), Duration::from_secs(30));
    };
    let nft = c.nftables.as_ref();
    let ipt = c.iptables.as_ref();
    (
        pick(
            c.min_sync_period,
            nft.and_then(|n| n.min_sync_period),
            ipt.and_then(|i| i.min_sync_period),
            Duration::from_secs(1),
        ),
        pick(
            c.sync_period,
            nft.and_then(|n| n.sync_period),
            ipt.and_then(|i| i.sync_period),
            Duration::from_secs(30),
        ),
    )
}

/// kube-proxy's node eligibility for /healthz: not being deleted and not tainted
/// `ToBeDeletedByClusterAutoscaler`. A node kxp has no object for is eligible.
fn node_eligible(node: Option<&k8s_openapi::api::core::v1::Node>) -> bool {
    let Some(node) = node else {
        return true;
    };
    if node.metadata.deletion_timestamp.is_some() {
        return false;
    }
    !node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == "ToBeDeletedByClusterAutoscaler"))
}

/// A path from its flag, else the config's `kxp:` field, else `default()`; `""` in
/// either turns the feature off (`None`).
fn path_setting(
    flag: &Option<PathBuf>,
    config: &Option<PathBuf>,
    default: impl FnOnce() -> PathBuf,
) -> Option<PathBuf> {
    match flag.clone().or_else(|| config.clone()) {
        Some(p) if p.as_os_str().is_empty() => None,
        Some(p) => Some(p),
        None => Some(default()),
    }
}

fn totals_line(dp: &Dataplane) -> String {
    let t = dp.totals();
    let drops: Vec<String> = t.drops.iter().map(|(k, v)| format!("{k}={v}")).collect();
    // What the interfaces dropped before kxp saw it (the kernel's AF_XDP counters, as
    // kxp_xsk_rx_drops_total): a fill ring kept to the queue budget runs empty.
    let xsk: Vec<String> = dp
        .shared
        .socket_stats(Duration::from_millis(200))
        .iter()
        .map(|(ifname, st)| {
            format!(
                "{ifname}:fill_ring_empty={},rx_ring_full={},other={}",
                st.rx_fill_ring_empty,
                st.rx_ring_full,
                st.rx_dropped.saturating_sub(st.rx_fill_ring_empty)
            )
        })
        .collect();
    // Gaps of over a millisecond in a worker's polling (its CPU taken by another task,
    // or a long round of its own): what arrived meanwhile waited in the rings.
    let stalls: Vec<String> = t
        .stalls
        .iter()
        .enumerate()
        .map(|(w, s)| {
            let parts: Vec<String> = dataplane::worker::Stalls::PARTS
                .iter()
                .zip(s.by_part)
                .filter(|&(_, n)| n > 0)
                .map(|(p, n)| format!("{p} {n}"))
                .collect();
            format!(
                "worker{w}:{} ({:.1} ms, longest {:.1} ms{}{})",
                s.count,
                s.total_ns as f64 / 1e6,
                s.longest_ns as f64 / 1e6,
                if parts.is_empty() {
                    ""
                } else {
                    "; longest part: "
                },
                parts.join(", ")
            )
        })
        .collect();
    format!(
        "totals: rx {} tx {} forwarded {} new_flows {} rejected {} dropped {} [{}] handoffs {} conntrack {} neighbour_pending {} no_route {} xsk_drops [{}] stalls [{}]",
        t.rx_packets,
        t.tx_packets,
        t.forwarded,
        t.new_flows,
        t.rejected,
        t.dropped,
        drops.join(" "),
        t.handoffs,
        t.conntrack_entries,
        t.neighbour_pending,
        t.no_route,
        xsk.join(" "),
        stalls.join(" ")
    )
}

fn host_addresses(dp: &Dataplane) -> Vec<IpAddr> {
    let mut v: Vec<IpAddr> = dp
        .local_addrs()
        .into_iter()
        .filter(|ip| !ip.is_loopback() && !is_link_local(ip))
        .collect();
    v.sort();
    v.dedup();
    v
}

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

fn timeouts_from(ct: &crate::config::Conntrack) -> conntrack::Timeouts {
    let d = |g: Option<crate::config::GoDuration>| g.map(|g| g.0).unwrap_or_default();
    conntrack::Timeouts::from_kube_proxy(
        ct.tcp_established_timeout
            .map_or(Duration::from_secs(86_400), |g| g.0),
        ct.tcp_close_wait_timeout
            .map_or(Duration::from_secs(3_600), |g| g.0),
        d(ct.udp_timeout),
        d(ct.udp_stream_timeout),
    )
}

/// Notices changes of a file by modification time, size and inode (an editor that
/// writes a new file and renames it over the old one changes the inode).
#[derive(Debug)]
struct FileWatch {
    path: PathBuf,
    last: Option<(SystemTime, u64, u64)>,
}

impl FileWatch {
    fn new(path: &Path) -> FileWatch {
        let mut w = FileWatch {
            path: path.to_path_buf(),
            last: None,
        };
        w.last = w.probe();
        w
    }

    fn probe(&self) -> Option<(SystemTime, u64, u64)> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(&self.path).ok()?;
        Some((meta.modified().ok()?, meta.len(), meta.ino()))
    }

    fn changed(&mut self) -> bool {
        let now = self.probe();
        if now.is_some() && now != self.last {
            self.last = now;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn svc(name: &str, ip: &str) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            spec: Some(k8s_openapi::api::core::v1::ServiceSpec {
                cluster_ip: Some(ip.into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn changes_are_counted_per_object() {
        let old = translate::k8s::ClusterState {
            services: vec![
                svc("a", "10.0.0.1"),
                svc("b", "10.0.0.2"),
                svc("c", "10.0.0.3"),
            ],
            ..Default::default()
        };
        let new = translate::k8s::ClusterState {
            // a unchanged, b changed, c removed, d added
            services: vec![
                svc("a", "10.0.0.1"),
                svc("b", "10.0.0.9"),
                svc("d", "10.0.0.4"),
            ],
            ..Default::default()
        };
        let mut t = Tracker::new(translate::k8s::NodeSettings::default());
        t.replace_all(&old);
        assert_eq!(t.sync(1).service_changes, 3);
        t.replace_all(&new);
        let s = t.sync(2);
        assert_eq!((s.service_changes, s.endpoint_changes), (3, 0));
        t.replace_all(&new);
        assert_eq!(t.sync(3).service_changes, 0);
    }

    #[test]
    fn trigger_times_give_programming_latency() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(
            since_trigger("2027-01-15T08:00:00Z", now),
            Some(Duration::ZERO)
        );
        assert_eq!(
            since_trigger("2027-01-15T07:59:58.5Z", now),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(since_trigger("2027-01-15T08:00:01Z", now), None);
        assert_eq!(since_trigger("yesterday", now), None);
    }

    #[test]
    fn sync_periods_follow_kube_proxy() {
        assert_eq!(
            sync_periods(None),
            (Duration::from_secs(1), Duration::from_secs(30))
        );
        let c = KubeProxyConfiguration::parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nnftables:\n  minSyncPeriod: 250ms\n  syncPeriod: 1m0s\n",
            "t",
        )
        .unwrap();
        assert_eq!(
            sync_periods(Some(&c)),
            (Duration::from_millis(250), Duration::from_secs(60))
        );
    }
}
