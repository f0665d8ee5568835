//! The control plane end to end: from API events to a programmed dataplane, on a cluster
//! of 10,000 Services with 100,000 endpoints served by the repository's fake API server
//! (the real list/watch protocol over HTTPS with a bearer token), with the real `kxp run` (kube-rs watchers,
//! change tracker, snapshot publication, XDP map updates) attached to a veth in a
//! throw-away network namespace.
//!
//! Reports, per cluster size (an empty cluster first, as the baseline):
//! - the time from starting `kxp run` to `/healthz` 200 (lists over HTTP included) and
//!   kxp's own figure for the initial sync;
//! - kxp's resident memory (VmRSS), and the difference from the empty cluster: what the
//!   control plane holds for that many objects;
//! - for single EndpointSlice changes written to the API server one at a time: the sync
//!   work kxp reports (changes taken from the watchers, Services rebuilt, snapshot,
//!   XDP maps) and the latency from the write to the sync's log line.
//!
//! `sudo cargo run --release -p kxp-bench --bin sync-bench [-- --services N --changes K]`
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use kxp_bench::{cluster, endpoint_ip, locate_kxp};
use kxp_tests::fakeapi::FakeApi;
use lab::Topology;
use lab::{KxpProcess, spawn_in, wait_healthy};

#[derive(Debug, Parser)]
struct Args {
    /// Services in the big cluster (10 endpoints each).
    #[arg(long, default_value_t = 10_000)]
    services: u32,
    /// EndpointSlice changes to time.
    #[arg(long, default_value_t = 30)]
    changes: u32,
    /// The kxp binary (default: next to this one, built in release if missing).
    #[arg(long)]
    kxp: Option<PathBuf>,
    /// Idle pods' veths in the node (`vpN`, kernel defaults, up), which kxp attaches to
    /// (`--interface 'vp*'`) besides its uplink: a kubelet runs up to 110 pods.
    #[arg(long, default_value_t = 0)]
    pod_veths: u32,
    /// Keep the big cluster's kxp log at this path (it goes with the run's directory
    /// otherwise).
    #[arg(long)]
    keep_log: Option<PathBuf>,
    /// Serve no ServiceCIDR, as an API server before Kubernetes 1.33 (or with
    /// MultiCIDRServiceAllocator off) does: kxp then routes each ClusterIP into its
    /// service device one by one, 100,000 routes at 100,000 Services. By default the
    /// API server serves its default ServiceCIDR `kubernetes` with the cluster's range,
    /// as one of 1.33 or later does.
    #[arg(long)]
    no_service_cidr: bool,
}

struct Outcome {
    services: u32,
    ready: Duration,
    initial_line: String,
    rss_kib: u64,
    /// Total, then changes / tracker / dataplane.
    work_ms: Vec<[f64; 4]>,
    latency_ms: Vec<f64>,
}

fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no VmRSS in /proc/PID/status")
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Creates `n` idle pod veths in namespace `node`: `vpN`, their peers `vqN`, both up,
/// no address (as a CNI leaves them before the pod sends anything).
fn idle_pod_veths(node: &str, n: u32, dir: &std::path::Path) -> anyhow::Result<()> {
    if n == 0 {
        return Ok(());
    }
    let batch = dir.join("pod-veths.batch");
    let text: String = (0..n)
        .map(|i| {
            format!(
                "link add vp{i} type veth peer name vq{i}\nlink set vp{i} up\nlink set vq{i} up\n"
            )
        })
        .collect();
    std::fs::write(&batch, text)?;
    let out = std::process::Command::new("ip")
        .args(["-n", node, "-batch"])
        .arg(&batch)
        .output()?;
    if !out.status.success() {
        bail!(
            "creating {n} pod veths: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn run_one(
    kxp_bin: &std::path::Path,
    services: u32,
    changes: u32,
    pod_veths: u32,
    service_cidr: Option<&str>,
    keep_log: Option<&std::path::Path>,
) -> anyhow::Result<Outcome> {
    let mut topo = Topology::new("kxs");
    let node = topo.add_ns("node")?;
    let peer = topo.add_ns("peer")?;
    topo.link(
        (&node, "s-eth0", "198.18.100.1/24"),
        (&peer, "eth0", "198.18.100.2/24"),
    )?;
    let api = spawn_in(&node, || FakeApi::start_tls(Some("sync-bench-token")))
        .join()
        .map_err(|_| anyhow::anyhow!("fake API thread panicked"))??;
    let state = cluster(services, 10);
    let node_obj = serde_json::json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "node-0", "labels": {"topology.kubernetes.io/zone": "z1"}},
        "status": {"addresses": [{"type": "InternalIP", "address": "198.18.100.1"}]}
    });
    api.apply(&node_obj).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    if let Some(cidr) = service_cidr {
        let obj = serde_json::json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
            "metadata": {"name": "kubernetes"},
            "spec": {"cidrs": [cidr]}
        });
        api.apply(&obj).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    }
    for s in &state.services {
        api.create(s).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    }
    for s in &state.endpoint_slices {
        api.create(s).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    }
    let dir = std::env::temp_dir().join(format!("kxp-sync-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let kc = dir.join("kubeconfig");
    api.write_kubeconfig(&kc)?;
    let cfg = dir.join("kube-proxy.yaml");
    // minSyncPeriod 1 ms: a change is synced as soon as it arrives (kube-proxy's default
    // of 1 s would dominate the latency; 0 means that default, as in kube-proxy).
    std::fs::write(
        &cfg,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         hostnameOverride: node-0\nclusterCIDR: 10.0.0.0/8\n\
         metricsBindAddress: 127.0.0.1:10249\nnftables:\n  minSyncPeriod: 1ms\n",
    )?;
    idle_pod_veths(&node, pod_veths, &dir)?;
    let mut args: Vec<String> = [
        "--interface",
        "s-eth0",
        "--kubeconfig",
        kc.to_str().unwrap_or_default(),
        "--config",
        cfg.to_str().unwrap_or_default(),
        "--healthz-bind-address",
        "127.0.0.1:10256",
    ]
    .map(String::from)
    .to_vec();
    if pod_veths > 0 {
        args.extend(["--interface".to_string(), "vp*".to_string()]);
    }
    let started = Instant::now();
    let mut kxp = KxpProcess::spawn_exe(kxp_bin, &node, &args, &dir.join("kxp.log"))?;
    wait_healthy(
        &node,
        "127.0.0.1:10256".parse()?,
        Duration::from_secs(120),
        &mut kxp,
    )?;
    let ready = started.elapsed();
    let log = kxp.log_text();
    // The message itself, without the log line's timestamp and level.
    let find = |what: &str| {
        log.lines()
            .find_map(|l| l.find(what).map(|i| &l[i..]))
            .unwrap_or("")
            .to_string()
    };
    let initial_line = format!("{}; {}", find("first lists"), find("initial sync"));
    // Let the allocator settle after the lists.
    std::thread::sleep(Duration::from_secs(1));
    let rss = rss_kib(kxp.child.id())?;

    let mut work_ms = Vec::new();
    let mut latency_ms = Vec::new();
    for k in 0..changes.min(services) {
        let i = (k as usize * 7919) % services as usize;
        let mut slice = state.endpoint_slices[i].clone();
        slice.endpoints[0].addresses = vec![endpoint_ip(i as u32, 11 + k % 4).to_string()];
        let before = kxp.log_text().matches("Service(s) rebuilt").count();
        let t = Instant::now();
        api.replace(&slice).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let line = loop {
            let text = kxp.log_text();
            if let Some(l) = text
                .lines()
                .filter(|l| l.contains("Service(s) rebuilt"))
                .nth(before)
            {
                break l.to_string();
            }
            if t.elapsed() > Duration::from_secs(10) {
                bail!("no sync 10 s after an EndpointSlice change:\n{text}");
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        latency_ms.push(t.elapsed().as_secs_f64() * 1e3);
        // "... applied (generation N, R Service(s) rebuilt; changes A + tracker B +
        // dataplane C = X ms)"
        let num = |after: &str| -> Option<f64> {
            line.split(after)
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        };
        if let (Some(a), Some(b), Some(c), Some(x)) = (
            num("changes "),
            num("tracker "),
            num("dataplane "),
            num("= "),
        ) {
            work_ms.push([x, a, b, c]);
        }
    }
    kxp.terminate();
    if let Some(to) = keep_log {
        std::fs::copy(dir.join("kxp.log"), to)
            .with_context(|| format!("keeping kxp's log at {}", to.display()))?;
    }
    // A stopped kxp leaves its programs (pinned) and state for a successor; none comes.
    if let Err(e) = kxp.cleanup() {
        eprintln!("sync-bench: {e:#}");
    }
    drop(api);
    drop(topo);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Outcome {
        services,
        ready,
        initial_line,
        rss_kib: rss,
        work_ms,
        latency_ms,
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !dataplane::sys::is_root() {
        bail!("sync-bench creates network namespaces and runs kxp: run it as root");
    }
    let kxp = locate_kxp(args.kxp.as_ref())?;
    let cidr = (!args.no_service_cidr).then_some(kxp_bench::CLUSTER_SERVICE_CIDR);
    let base = run_one(&kxp, 0, 0, args.pod_veths, cidr, None)?;
    let big = run_one(
        &kxp,
        args.services,
        args.changes,
        args.pod_veths,
        cidr,
        args.keep_log.as_deref(),
    )?;
    println!(
        "cluster: {} Services × 10 endpoints; {} idle pod veths attached; ServiceCIDR {}",
        args.services,
        args.pod_veths,
        cidr.unwrap_or("none")
    );
    for o in [&base, &big] {
        println!(
            "  {:>6} Services: healthy after {:.0} ms; RSS {:.1} MiB; {}",
            o.services,
            o.ready.as_secs_f64() * 1e3,
            o.rss_kib as f64 / 1024.0,
            o.initial_line
        );
    }
    println!(
        "  control-plane memory for {} Services / {} endpoints: {:.1} MiB (RSS difference)",
        args.services,
        args.services * 10,
        (big.rss_kib as f64 - base.rss_kib as f64) / 1024.0
    );
    let col = |i: usize| big.work_ms.iter().map(|w| w[i]).collect::<Vec<f64>>();
    println!(
        "  one EndpointSlice changed ({} times): sync work median {:.3} ms, p90 {:.3} ms, max {:.3} ms \
         (medians: changes {:.3} + tracker {:.3} + dataplane {:.3} ms); \
         API write → programmed median {:.2} ms, p90 {:.2} ms, p99 {:.2} ms",
        big.work_ms.len(),
        percentile(&col(0), 0.5),
        percentile(&col(0), 0.9),
        percentile(&col(0), 1.0),
        percentile(&col(1), 0.5),
        percentile(&col(2), 0.5),
        percentile(&col(3), 0.5),
        percentile(&big.latency_ms, 0.5),
        percentile(&big.latency_ms, 0.9),
        percentile(&big.latency_ms, 0.99),
    );
    Ok(())
}
