//! `kxp run`: the dataplane fed from a state file, with kube-proxy's health endpoints.
//!
//! The state file is watched: a change is parsed, turned into a snapshot and published
//! while traffic flows; an edit that cannot be read is logged with the reason and the last
//! good state stays in force. SIGTERM / SIGINT detach everything kxp attached and exit 0.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use dataplane::plane::{Dataplane, DataplaneConfig};
use nat::k8s::build;

use crate::config::KubeProxyConfiguration;
use crate::health::{Health, HealthServer};
use crate::settings::{NodeFlags, node_settings};
use crate::state::load_state;

/// Everything `kxp run` was asked to do.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub interfaces: Vec<String>,
    pub state_file: PathBuf,
    pub config: Option<PathBuf>,
    /// kube-proxy's flags as a configuration, and which were given (used without
    /// `--config`; ignored with it, as kube-proxy does).
    pub flag_config: (KubeProxyConfiguration, Vec<&'static str>),
    pub flags: NodeFlags,
    pub workers: Option<usize>,
    pub cpus: Option<Vec<usize>>,
    pub healthz_bind_address: Option<SocketAddr>,
    pub snat_ports: Option<(u16, u16)>,
    /// Preferred busy polling on the AF_XDP sockets: (µs, budget).
    pub busy_poll: Option<(u32, u32)>,
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
                eprintln!(
                    "kxp: {} ignored: --config is given, and as in kube-proxy the file wins",
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
    if cfg
        .metrics_bind_address
        .as_deref()
        .is_some_and(|m| !m.is_empty())
    {
        eprintln!("kxp: note: metricsBindAddress is read but /metrics is not served yet");
    }
    let cfg = Some(cfg);
    let mut settings = node_settings(cfg.as_ref(), &opts.flags, &origin)?;

    let healthz = match opts.healthz_bind_address {
        Some(a) => a,
        None => cfg
            .as_ref()
            .and_then(|c| c.healthz_bind_address.as_deref())
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse()
                    .with_context(|| format!("healthzBindAddress {s:?} is not ADDR:PORT"))
            })
            .transpose()?
            .unwrap_or_else(|| {
                "0.0.0.0:10256"
                    .parse()
                    .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 10256)))
            }),
    };

    let state = load_state(&opts.state_file)?;
    let explicit_node_ips = !settings.node_ips.is_empty();
    let built = build(&state, &settings, 1)
        .map_err(|e| anyhow::anyhow!("state file {}: {e}", opts.state_file.display()))?;
    let mut notes = built.notes.clone();

    let kxp = cfg.as_ref().and_then(|c| c.kxp.clone()).unwrap_or_default();
    let mut dp_cfg = DataplaneConfig {
        interfaces: if opts.interfaces.is_empty() {
            kxp.interfaces.clone().unwrap_or_default()
        } else {
            opts.interfaces.clone()
        },
        ..Default::default()
    };
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
    dp_cfg.cpus = cpus;
    if let Some(r) = opts.snat_ports {
        dp_cfg.snat_ports = r;
    }
    dp_cfg.xsk.busy_poll = opts.busy_poll;
    if let Some(ct) = cfg.as_ref().and_then(|c| c.conntrack.as_ref()) {
        dp_cfg.timeouts = timeouts_from(ct);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per_core = ct.max_per_core.unwrap_or(32_768).max(0) as usize;
        let min = ct.min.unwrap_or(131_072).max(0) as usize;
        if per_core > 0 {
            let total = (per_core * cores).max(min);
            dp_cfg.conntrack_per_worker = (total / dp_cfg.workers).max(1024);
        }
    }

    let health = Arc::new(Health::new());
    let server = HealthServer::start(healthz, health.clone()).with_context(|| {
        format!("cannot serve /healthz on {healthz}; give --healthz-bind-address ADDR:PORT")
    })?;

    let mut dp = Dataplane::start(&dp_cfg, built.snapshot)?;
    let mut generation = 1;
    // Without --node-ip, the node's local addresses are the host's own.
    if !explicit_node_ips {
        settings.node_ips = host_addresses(&dp);
        generation += 1;
        let b = build(&state, &settings, generation)
            .map_err(|e| anyhow::anyhow!("state file {}: {e}", opts.state_file.display()))?;
        notes = b.notes;
        dp.publish(b.snapshot)?;
    }
    for n in &notes {
        eprintln!("kxp: note: {n}");
    }
    health.programmed();
    eprintln!(
        "kxp: running on {} with {} worker(s); health on http://{}/healthz",
        dp_cfg.interfaces.join(", "),
        dp_cfg.workers,
        server.local_addr()
    );

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }

    let stats_every = std::env::var("KXP_LOG_STATS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs);
    let mut last_stats = Instant::now();
    let mut watcher = FileWatch::new(&opts.state_file);
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        if let Some(every) = stats_every
            && last_stats.elapsed() >= every
        {
            last_stats = Instant::now();
            eprintln!("kxp: {}", totals_line(&dp));
        }
        if !watcher.changed() {
            continue;
        }
        health.queued();
        let started = Instant::now();
        match load_state(&opts.state_file)
            .map_err(anyhow::Error::from)
            .and_then(|s| {
                build(&s, &settings, generation + 1)
                    .map_err(|e| anyhow::anyhow!("state file {}: {e}", opts.state_file.display()))
            }) {
            Ok(b) => {
                generation += 1;
                if let Err(e) = dp.publish(b.snapshot) {
                    eprintln!(
                        "kxp: programming the XDP maps: {e:#}; will retry on the next change"
                    );
                } else {
                    health.programmed();
                    eprintln!(
                        "kxp: state file {} applied (generation {generation}, {:.1} ms)",
                        opts.state_file.display(),
                        started.elapsed().as_secs_f64() * 1e3
                    );
                }
            }
            Err(e) => {
                eprintln!("kxp: {e:#}; keeping the last good state");
                health.programmed();
            }
        }
    }
    eprintln!("kxp: {}", totals_line(&dp));
    eprintln!(
        "kxp: stopping: detaching from {}",
        dp_cfg.interfaces.join(", ")
    );
    dp.stop();
    server.stop();
    Ok(())
}

fn totals_line(dp: &Dataplane) -> String {
    let t = dp.totals();
    let drops: Vec<String> = t.drops.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!(
        "totals: rx {} tx {} forwarded {} new_flows {} rejected {} dropped {} [{}] handoffs {} conntrack {} neighbour_pending {} no_route {}",
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
        t.no_route
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
