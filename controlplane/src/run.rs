//! `kxp run`: the dataplane fed from a state file, with kube-proxy's health endpoints.
//!
//! The state file is watched: a change is parsed, turned into a snapshot and published
//! while traffic flows; an edit that cannot be read is logged with the reason and the last
//! good state stays in force. SIGTERM / SIGINT detach everything kxp attached and exit 0.

mod handover;
mod input;
mod reload;
mod sync;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use dataplane::plane::{Dataplane, DataplaneConfig};
use nat::snapshot::Snapshot;
use translate::k8s::NodeSettings;
use translate::tracker::Tracker;

use crate::admin::AdminServer;
use crate::config::KubeProxyConfiguration;
use crate::hcnp::ServiceHealthServers;
use crate::health::{Health, HealthServer};
use crate::localnp::LocalhostNodePorts;
use crate::metrics::{Metrics, MetricsServer};
use crate::settings::{NodeFlags, node_settings};
use input::Input;
use sync::{Parts, report, sync_loop, totals_line};

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
/// Each step is a function of its own, below in the order `run` takes them: the
/// configuration, the process, the source of the cluster's objects and its first read,
/// /healthz, the dataplane, the first sync, /metrics, the sync loop and the shutdown.
///
/// # Errors
/// Anything that keeps kxp from starting, with what to do about it.
pub fn run(opts: RunOptions) -> anyhow::Result<()> {
    let Configured {
        cfg,
        serving,
        dp_cfg,
        kxp,
        mut settings,
    } = read_configuration(&opts)?;
    if init_only(&opts) {
        return Ok(());
    }
    let stop = prepare_process(&cfg)?;
    // A kxp running beside this one (a rolling update with a surge): this one announces
    // itself as its successor; it forwards until this one has the cluster's lists.
    let generation = handover::generation();
    // `systemctl reload`: a successor started beside this kxp takes the node over.
    reload::on_sighup(generation, dp_cfg.state_dir.is_some());
    let Ok(successor) = announce(&dp_cfg, generation) else {
        return Ok(());
    };
    let mut input = start_source(&opts, &cfg, &settings, &stop)?;
    let (min_sync, resync) = sync_periods(Some(&cfg));
    let (mut tracker, listed, listing) = read_state(&input, &settings)?;
    // Started empty (nothing is redirected yet); the first sync follows once the node's
    // addresses and the host's are known (generation 2). What touches nothing of the node
    // is done while the running kxp, if any, still forwards.
    let mut prepared = Dataplane::prepare(&dp_cfg, Snapshot::empty(0, Default::default()))?;
    // The first sync's translation too: at 100,000 Services it is most of the first sync.
    find_host_addresses(&mut settings, &mut tracker, &prepared.local_addrs());
    let translating = Instant::now();
    let first = tracker.sync(FIRST_GENERATION);
    let translated = translating.elapsed();
    let (released, handed) = match successor {
        Some(s) => take_over(s, &mut prepared, &dp_cfg),
        None => (false, Default::default()),
    };
    let paused_at = handed.stopped_ns;
    let received_at = dataplane::sys::monotonic_ns();
    // On sockets handed over, forwarding waits for the dataplane: /healthz is served
    // once it forwards again.
    let handed_over = !handed.workers.is_empty();
    let (metrics, health) = health_state(resync);
    let early = (!handed_over)
        .then(|| serve_health(&serving, &health))
        .transpose()?
        .flatten();
    let (mut dp, admin) = start_dataplane(&dp_cfg, &opts, &kxp, prepared, handed.workers)?;
    let started_at = dataplane::sys::monotonic_ns();
    let release = listen_for_successor(&dp_cfg, generation, &stop, &dp);
    // (The first sync's time counts its translation, done above.)
    let first_started = Instant::now()
        .checked_sub(translated)
        .unwrap_or_else(Instant::now);
    let (mut hc, mut localnp) = first_sync(first, &input, &mut dp, &health, &cfg)?;
    // The workers forward from the first sync's publication on; on sockets handed over,
    // the interfaces' own program instances are attached from then.
    handover::log_pause(paused_at, received_at, started_at, dp.first_published_ns());
    let server = match handed_over {
        true => serve_health(&serving, &health)?,
        false => early,
    };
    dp.attach_interfaces()?;
    take_over_interfaces(&dp, listing, (translated, first_started.elapsed()));
    mark_programmed(&tracker, &dp, &health, &metrics, first_started, listed);
    // systemd's `Type=notify`; after a reload, this kxp is the service's main process now.
    reload::ready(released);
    // What the first lists and programming freed goes back to the kernel (glibc keeps
    // it otherwise; 29 MiB of 1.3 GiB at 100,000 Services).
    dataplane::sys::release_free_heap();
    let metrics_server = serve_metrics(serving, &metrics)?;
    drop_capabilities();
    log_running(&dp_cfg, &dp, server.as_ref());
    let parts = Parts {
        input: &mut input,
        tracker: &mut tracker,
        dp: &mut dp,
        hc: &mut hc,
        localnp: &mut localnp,
        health: &health,
        metrics: &metrics,
    };
    sync_loop(parts, settings, FIRST_GENERATION, (min_sync, resync), &stop);
    if let Some(r) = &release {
        r.wait_for_successor(handover::SUCCESSOR_WAIT);
    }
    // The localhost NodePorts' sockets go first: a successor binds them at its first
    // sync, and this kxp stands by after releasing the node.
    drop(localnp);
    let servers = Servers {
        admin,
        hc,
        health: server,
        metrics: metrics_server,
    };
    if shutdown(&dp_cfg, dp, servers, release) {
        handover::stand_by("released this node to a newer kxp");
    }
    Ok(())
}

/// Takes the node over from the running kxp that took this one as its successor (`s`):
/// its program, service device and sockets taken up ahead while it still forwards, then
/// the release and the sockets it hands over. Returns whether it released the node, and
/// the sockets.
fn take_over(
    mut s: handover::Successor,
    prepared: &mut dataplane::plane::Prepared,
    dp_cfg: &DataplaneConfig,
) -> (bool, dataplane::plane::HandedOver) {
    prepared.take_up_ahead(dp_cfg);
    match s.premap() {
        Ok(p) => prepared.set_premapped(p),
        Err(e) => tracing::warn!(
            "the sockets the running kxp lent did not arrive whole ({e}); asking for the \
             node all the same"
        ),
    }
    // This thread only waits until the running kxp's workers have stopped; from then on
    // their CPUs are idle until this kxp's workers start, and forwarding waits for it.
    dataplane::plane::use_workers_cpus_until_they_start();
    dataplane::priority::boost_start(urgent_nice(dp_cfg));
    // Room for the sockets that arrive in the pause (twice what was lent).
    if let Err(e) = dataplane::sys::reserve_fds(2 * prepared.premapped_sockets() + 256) {
        tracing::debug!("cannot grow the descriptor table ahead: {e}");
    }
    let (asked, handed) = s.ask_release();
    (matches!(asked, handover::Asked::Released(_)), handed)
}

/// Announces this kxp to the one running with the same state directory (see
/// [`handover`]): its successor, or nobody's. `Err` if that one outranks this one,
/// which then stood by until stopped.
fn announce(
    dp_cfg: &DataplaneConfig,
    generation: Option<u64>,
) -> Result<Option<handover::Successor>, ()> {
    let announced = match dp_cfg.state_dir.as_deref() {
        Some(dir) => handover::Successor::announce(dir, generation),
        None => handover::Announced::Nobody,
    };
    match announced {
        handover::Announced::Successor(s) => {
            // Off the workers' CPUs from here: the running kxp's workers use them while
            // this one reads the lists and prepares.
            dataplane::plane::keep_off_workers_cpus_ahead(dp_cfg);
            Ok(Some(s))
        }
        handover::Announced::Nobody => {
            // No kxp forwards: the node's Service traffic waits for this one's start.
            dataplane::priority::boost_start(urgent_nice(dp_cfg));
            Ok(None)
        }
        handover::Announced::Outranked(why) => {
            handover::stand_by(&format!("this node is another kxp's ({why})"));
            Err(())
        }
    }
}

/// The nice kxp's threads run at while the node's Service traffic waits for them (a
/// start, either side of a hand-over's switch; see
/// [`dataplane::priority::boost_start`]): the workers'.
fn urgent_nice(dp_cfg: &DataplaneConfig) -> i32 {
    dp_cfg
        .effective_worker_nice()
        .unwrap_or(dataplane::priority::PINNED_WORKER_NICE)
}

/// Listens for a newer kxp (see [`handover`]), which `dp` lends its sockets to ahead of
/// the release; `stop` is set when it asks for the node.
fn listen_for_successor(
    dp_cfg: &DataplaneConfig,
    generation: Option<u64>,
    stop: &Arc<AtomicBool>,
    dp: &Dataplane,
) -> Option<handover::ReleaseListener> {
    let dir = dp_cfg.state_dir.as_deref()?;
    let shared = dp.shared.clone();
    let lender: handover::Lender = Arc::new(move || shared.lend(Duration::from_secs(2)));
    handover::ReleaseListener::start(dir, generation, stop.clone(), Some(lender))
}

/// The first sync's generation: the dataplane starts with an empty snapshot, and the
/// first sync follows once the node's addresses and the host's are known.
const FIRST_GENERATION: u64 = 2;

/// What `kxp run` runs with: its configuration, read and checked.
struct Configured {
    /// kube-proxy's configuration, from the file or from the flags.
    cfg: KubeProxyConfiguration,
    serving: Serving,
    dp_cfg: DataplaneConfig,
    /// kxp's section of the file.
    kxp: crate::config::KxpSection,
    /// The node's settings for the tracker (the host's addresses come later).
    settings: NodeSettings,
}

/// Where /healthz and /metrics are served, and what /configz answers.
struct Serving {
    metrics: Option<SocketAddr>,
    healthz: Option<SocketAddr>,
    /// kube-proxy's bindAddressHardFail: an address that cannot be bound is an error,
    /// not tried again.
    hard_fail: bool,
    /// /configz's answer: the configuration in force, as JSON.
    configz: String,
}

/// Reads the configuration (the file `--config` names, else the flags) and checks it: a
/// value kxp cannot run with is an error, what it does not honour is warned about.
///
/// # Errors
/// A file that cannot be read, or a value kxp cannot run with.
fn read_configuration(opts: &RunOptions) -> anyhow::Result<Configured> {
    let (cfg, origin) = load_configuration(opts)?;
    let from_file = opts.config.is_some();
    let serving = serving_from(&cfg, opts, from_file)?;
    log_caveats(&cfg, opts, &origin, from_file);
    let (dp_cfg, kxp) = dataplane_config(&cfg, opts)?;
    let settings = node_settings(Some(&cfg), &opts.flags, &origin)?;
    Ok(Configured {
        cfg,
        serving,
        dp_cfg,
        kxp,
        settings,
    })
}

/// kube-proxy's configuration and where it comes from: the file `--config` names (the
/// flags that are configuration are then ignored, as in kube-proxy, with a warning), else
/// the flags.
fn load_configuration(opts: &RunOptions) -> anyhow::Result<(KubeProxyConfiguration, String)> {
    Ok(match &opts.config {
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
    })
}

/// Where /healthz and /metrics are served (`from_file`: the configuration is a file's),
/// and /configz's answer.
///
/// # Errors
/// An address that cannot be read, named by its field or flag.
fn serving_from(
    cfg: &KubeProxyConfiguration,
    opts: &RunOptions,
    from_file: bool,
) -> anyhow::Result<Serving> {
    // kube-proxy's defaulting of a file: an empty address is the default, an IP alone
    // gets the default port. From flags, "" turns the server off (as in kube-proxy).
    let bind = |value: Option<&str>, default: &str, port: u16, what: &str| {
        let v = match value {
            Some(v) if !(from_file && v.is_empty()) => v,
            _ => default,
        };
        crate::kpflags::bind_address(v, port).map_err(|e| anyhow::anyhow!("{what}: {e}"))
    };
    let metrics = bind(
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
    Ok(Serving {
        metrics,
        healthz,
        hard_fail: cfg.bind_address_hard_fail.unwrap_or(false),
        configz: serde_json::json!({ "kubeproxy.config.k8s.io": cfg }).to_string(),
    })
}

/// Warns about what kxp does not honour in the file (`from_file`) or does not apply of
/// the flags, and about deprecated flags; says which proxy mode was asked for.
fn log_caveats(cfg: &KubeProxyConfiguration, opts: &RunOptions, origin: &str, from_file: bool) {
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
}

/// Whether this is `--init-only` (kube-proxy's privileged initialisation alone), which
/// kxp has nothing to do for: it says so, and the run ends with the configuration checked.
fn init_only(opts: &RunOptions) -> bool {
    let init_only = opts.kube_proxy.init_only == Some(true);
    if init_only {
        tracing::info!(
            "--init-only: kxp has no separate privileged initialisation (its dataplane needs its capabilities while it runs); the configuration is valid, exiting"
        );
    }
    init_only
}

/// Prepares the process: checks its capabilities, sets its oomScoreAdj and installs the
/// handlers of SIGTERM and SIGINT, which set the flag returned (the sync loop stops on
/// it).
///
/// # Errors
/// A capability missing, or the handlers cannot be installed.
fn prepare_process(cfg: &KubeProxyConfiguration) -> anyhow::Result<Arc<AtomicBool>> {
    // Before anything is set up: a missing capability is named, not met halfway.
    dataplane::caps::check().map_err(|e| anyhow::anyhow!(e))?;
    // kube-proxy's oomScoreAdj (default -999): the node's proxy is the last to be killed.
    let oom = cfg.oom_score_adj.unwrap_or(-999).clamp(-1000, 1000);
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", oom.to_string()) {
        tracing::warn!("cannot set oomScoreAdj {oom}: {e}");
    }

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }
    Ok(stop)
}

/// Starts the source of the cluster's objects: the state file if one is given, else the
/// API server (connected, its first lists waited for while not stopped); then says
/// whether NetworkPolicy is enforced.
///
/// # Errors
/// The API server cannot be reached or listed, or kxp is stopped before its first lists.
fn start_source(
    opts: &RunOptions,
    cfg: &KubeProxyConfiguration,
    settings: &NodeSettings,
    stop: &AtomicBool,
) -> anyhow::Result<Input> {
    let kubeconfig = opts.kubeconfig.clone().or_else(|| {
        cfg.client_connection
            .as_ref()
            .and_then(|c| c.kubeconfig.clone())
            .filter(|k| !k.is_empty())
            .map(PathBuf::from)
    });
    let service_proxy_name = cfg.service_proxy_name.clone().filter(|n| !n.is_empty());
    let input = match &opts.state_file {
        Some(path) => Input::file(path),
        None => Input::kube(
            kubeconfig.as_deref(),
            opts.master.as_deref(),
            cfg.client_connection
                .as_ref()
                .and_then(|c| crate::kube_source::RateLimit::from_config(c.qps, c.burst)),
            &settings.node_name,
            service_proxy_name,
            settings.network_policy,
            cfg.kernel_policy(),
            stop,
        )?,
    };
    if cfg.kernel_policy() {
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
    Ok(input)
}

/// Reads the whole state once into a new tracker; returns the tracker, when the read
/// started and how long it took.
///
/// # Errors
/// A state that cannot be read, named by where it comes from.
fn read_state(
    input: &Input,
    settings: &NodeSettings,
) -> anyhow::Result<(Tracker, Instant, Duration)> {
    let mut tracker = Tracker::new(settings.clone());
    let listed = Instant::now();
    input
        .feed(&mut tracker, true)
        .map_err(|e| anyhow::anyhow!("{}: {e:#}", input.describe()))?;
    let listing = listed.elapsed();
    Ok((tracker, listed, listing))
}

/// Serves /healthz and /livez.
///
/// # Errors
/// /healthz's address cannot be bound, with bindAddressHardFail.
fn serve_health(serving: &Serving, health: &Arc<Health>) -> anyhow::Result<Option<HealthServer>> {
    let healthz = serving.healthz;
    healthz
        .map(|a| HealthServer::start_or_retry(a, health.clone(), serving.hard_fail))
        .transpose()
        .with_context(|| {
            format!(
                "cannot serve /healthz on {}; give --healthz-bind-address ADDR:PORT",
                healthz.map_or_else(String::new, |a| a.to_string())
            )
        })
}

/// The metrics and kube-proxy's health (a change waiting longer than twice `resync`,
/// syncPeriod, is unhealthy).
fn health_state(resync: Duration) -> (Arc<Metrics>, Arc<Health>) {
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let health = Arc::new(Health::with_timeout(resync * 2));
    health.set_metrics(metrics.clone());
    (metrics, health)
}

/// Starts the dataplane, empty, and serves its admin socket.
///
/// # Errors
/// The dataplane cannot start, or the admin socket cannot be served.
fn start_dataplane(
    dp_cfg: &DataplaneConfig,
    opts: &RunOptions,
    kxp: &crate::config::KxpSection,
    prepared: dataplane::plane::Prepared,
    handed: Vec<dataplane::xsk::Handed>,
) -> anyhow::Result<(Dataplane, Option<AdminServer>)> {
    // With the sockets the previous kxp handed over, if any.
    let dp = Dataplane::start_prepared(dp_cfg, prepared, handed)?;
    let admin_path = path_setting(
        &opts.admin_socket,
        &kxp.admin_socket,
        crate::admin::default_socket,
    );
    let admin = admin_path
        .map(|p| crate::admin::AdminServer::start(&p, dp.shared.clone(), dp.node.clone()))
        .transpose()?;
    Ok((dp, admin))
}

/// Gives the tracker the host's addresses, as the dataplane sees them.
fn find_host_addresses(settings: &mut NodeSettings, tracker: &mut Tracker, local: &[IpAddr]) {
    // The Node object (or --node-ip) gives the node's primary addresses (kube-proxy's
    // way); the host's are local to the node beside them, its NodePort addresses in
    // iptables mode, and the fallback when nothing else gives any (followed as they
    // change, in the sync loop).
    settings.host_addrs = host_addresses_of(local);
    tracker.set_settings(settings.clone());
}

/// The first sync ([`FIRST_GENERATION`]): the whole state translated, the Services'
/// health servers and the localhost NodePorts started with it, and the dataplane
/// programmed.
///
/// # Errors
/// The Services' health servers cannot start, or the dataplane cannot be programmed.
fn first_sync(
    first: translate::tracker::Synced,
    input: &Input,
    dp: &mut Dataplane,
    health: &Arc<Health>,
    cfg: &KubeProxyConfiguration,
) -> anyhow::Result<(ServiceHealthServers, Option<LocalhostNodePorts>)> {
    report(&first, input);
    // Published first: the workers forward from here (a hand-over's pause ends).
    dp.publish(first.update.clone())?;
    let mut hc = ServiceHealthServers::start(health.clone())
        .context("starting the service health servers")?;
    for e in hc.sync(&first.update) {
        tracing::warn!("{e}");
    }
    // kube-proxy's iptables.localhostNodePorts: NodePorts on 127.0.0.1, relayed.
    let mut localnp = crate::settings::localhost_node_ports(Some(cfg))
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
    Ok((hc, localnp))
}

/// Takes the interfaces over from the programs a previous kxp left, and removes
/// kube-proxy's leftovers; then logs how long start-up took (`listing`: reading the
/// state; `first_sync`: the first sync's translation and the whole of it) and what was
/// restored.
fn take_over_interfaces(dp: &Dataplane, listing: Duration, first_sync: (Duration, Duration)) {
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
        "start-up: reading the state {} ms, {}, first sync {} ms (translation {} ms), \
         take-over {} ms, kube-proxy's leftovers {} ms",
        listing.as_millis(),
        dp.start_times.describe(),
        first_sync.1.as_millis(),
        first_sync.0.as_millis(),
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
}

/// Marks the first sync programmed: the health endpoints report it (with the node's
/// eligibility), the sync metrics count it (from `first_started`), and a log line says
/// what was programmed and how long it took since `listed`, the start of the first read.
fn mark_programmed(
    tracker: &Tracker,
    dp: &Dataplane,
    health: &Health,
    metrics: &Metrics,
    first_started: Instant,
    listed: Instant,
) {
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
}

/// Serves /metrics (and /configz), once the first sync is programmed.
///
/// # Errors
/// /metrics's address cannot be bound, with bindAddressHardFail.
fn serve_metrics(
    serving: Serving,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<Option<MetricsServer>> {
    let Serving {
        metrics: metrics_addr,
        hard_fail,
        configz: configz_text,
        ..
    } = serving;
    metrics_addr
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
        })
}

/// Set up: every thread keeps only what the rest of the run needs.
fn drop_capabilities() {
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
}

/// Says what kxp runs on: its interfaces (and those attached now), the service device,
/// the workers, and where /healthz is served.
fn log_running(dp_cfg: &DataplaneConfig, dp: &Dataplane, server: Option<&HealthServer>) {
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
        server.map_or_else(
            || "no address".to_string(),
            |s| format!("http://{}/healthz", s.local_addr())
        )
    );
}

/// What kxp serves beside the dataplane.
struct Servers {
    admin: Option<AdminServer>,
    hc: ServiceHealthServers,
    health: Option<HealthServer>,
    metrics: Option<MetricsServer>,
}

/// Stops, once a signal or a successor ended the sync loop: logs the totals and what
/// stays for the next kxp, then stops the admin socket, the dataplane, the Services'
/// health servers, and the /healthz and /metrics servers, in this order. A successor
/// that asked for the node (`release`) gets the dataplane's sockets as soon as its
/// workers have stopped (the rest of the dataplane stops after: forwarding waits for
/// them), with every server stopped before, so that it can bind their ports. Returns
/// whether this kxp should stand by (see [`handover::ReleaseListener::finish`]).
fn shutdown(
    dp_cfg: &DataplaneConfig,
    dp: Dataplane,
    servers: Servers,
    release: Option<handover::ReleaseListener>,
) -> bool {
    tracing::info!("{}", totals_line(&dp));
    match &dp_cfg.state_dir {
        Some(dir) => tracing::info!(
            "stopping: connections and steering kept for the next kxp ({}); `kxp cleanup` removes them",
            dir.display()
        ),
        None => tracing::info!("stopping: detaching from {}", dp_cfg.interfaces.join(", ")),
    }
    let Servers {
        admin,
        hc,
        health,
        metrics,
    } = servers;
    drop(admin);
    let hand_over = release
        .as_ref()
        .is_some_and(handover::ReleaseListener::asked);
    let stop_servers = |health: Option<HealthServer>, metrics: Option<MetricsServer>| {
        if let Some(s) = health {
            s.stop();
        }
        if let Some(s) = metrics {
            s.stop();
        }
    };
    if hand_over {
        // Their ports are free before the successor binds them, just after forwarding
        // resumes.
        hc.stop();
        stop_servers(health, metrics);
        // From the workers' stop until the sockets are sent, forwarding waits for this
        // thread: at the workers' priority.
        let (handed, stand_by) = dataplane::priority::at_nice(urgent_nice(dp_cfg), || {
            let handed = dp.hand_over();
            let stand_by = release.is_some_and(|r| r.finish(&handed));
            (handed, stand_by)
        });
        // The successor has its own references to the sockets now: this kxp's go, so
        // that one that cannot take them up can bind new sockets on the same queues.
        drop(handed);
        stand_by
    } else {
        dp.stop();
        hc.stop();
        stop_servers(health, metrics);
        release.is_some_and(|r| r.finish(&Default::default()))
    }
}

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
        interfaces: interfaces(opts, &kxp),
        ..Default::default()
    };
    if let Some(d) = kxp.service_device.clone() {
        dp_cfg.service_device = d;
    }
    dp_cfg.kernel_policy = cfg.kernel_policy();
    (dp_cfg.workers, dp_cfg.cpus) = workers(opts, &kxp)?;
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
    // With state kept for the next kxp, a kxp that dies has its sockets released in
    // parallel by the socket holder, so the next one can bind them sooner.
    if dp_cfg.state_dir.is_some() {
        dp_cfg.socket_holder = Some("/proc/self/exe".into());
    }
    if let Some(n) = kxp.session_affinity_max_entries {
        anyhow::ensure!(
            n > 0,
            "kxp.sessionAffinityMaxEntries must be at least 1 (default 262144)"
        );
        dp_cfg.affinity_capacity = n as usize;
    }
    if let Some(ct) = cfg.conntrack.as_ref() {
        dp_cfg.timeouts = timeouts_from(ct);
        if let Some(n) = conntrack_per_worker(ct, dp_cfg.workers) {
            dp_cfg.conntrack_per_worker = n;
        }
    }

    Ok((dp_cfg, kxp))
}

/// The interfaces to attach to: `--interface`, else `kxp.interfaces`, else every
/// Ethernet link as it comes (`*`).
fn interfaces(opts: &RunOptions, kxp: &crate::config::KxpSection) -> Vec<String> {
    if !opts.interfaces.is_empty() {
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
    }
}

/// The number of workers and the CPUs they are pinned to: `--workers` / `--cpus`, else
/// `kxp.workers` / `kxp.cpus`; with CPUs and no number, one worker per CPU.
///
/// # Errors
/// Fewer than 1 or more than 64 workers.
fn workers(
    opts: &RunOptions,
    kxp: &crate::config::KxpSection,
) -> anyhow::Result<(usize, Option<Vec<usize>>)> {
    let cpus = opts.cpus.clone().or_else(|| {
        kxp.cpus
            .as_ref()
            .map(|c| c.iter().map(|&x| x as usize).collect())
    });
    let workers = match (opts.workers, &cpus) {
        (Some(w), _) => w,
        (None, Some(c)) => c.len(),
        (None, None) => kxp.workers.map_or(1, |w| w as usize),
    };
    anyhow::ensure!(
        (1..=64).contains(&workers),
        "{} workers: give 1 to 64 (--workers, --cpus or kxp.workers/kxp.cpus)",
        workers
    );
    Ok((workers, cpus))
}

/// Each worker's connection table, from kube-proxy's conntrack sizing (maxPerCore per
/// core, at least min) shared by `workers`, and at least 1024; `None` with maxPerCore 0
/// (the default stays).
fn conntrack_per_worker(ct: &crate::config::Conntrack, workers: usize) -> Option<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_core = ct.max_per_core.unwrap_or(32_768).max(0) as usize;
    let min = ct.min.unwrap_or(131_072).max(0) as usize;
    if per_core > 0 {
        let total = (per_core * cores).max(min);
        return Some((total / workers).max(1024));
    }
    None
}

/// kube-proxy's minSyncPeriod (default 1 s) and syncPeriod (default 30 s), from the
/// top level (v1alpha2) or the nftables / iptables sections.
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

fn host_addresses(dp: &Dataplane) -> Vec<IpAddr> {
    host_addresses_of(&dp.local_addrs())
}

/// The host's addresses among the node's local ones (`local`): not loopback, not
/// link-local, sorted.
fn host_addresses_of(local: &[IpAddr]) -> Vec<IpAddr> {
    let mut v: Vec<IpAddr> = local
        .iter()
        .copied()
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
