//! The macro benchmark: one generator, one topology, three kinds of router, in one run.
//!
//! ```text
//!  gen netns ──veth── router netns ──veth── back netns
//!  trafgen (CPU0)     plain forwarding,     3 endpoint addresses, a netdev-ingress
//!  + latency probes   kube-proxy nftables   counter that counts and drops the sink
//!                     or kxp (CPU1)         traffic, a UDP socket for the probes
//! ```
//!
//! Every case sends the same trafgen packets (64-byte frames on the wire: 60 bytes + FCS,
//! UDP to the Service VIP 198.19.0.10:9000) in two traffic modes: 1,024 established flows
//! (source ports 10000–11023) and a new connection every packet (source address and port
//! both change, 16 M distinct tuples). The rate is what arrives at the backend's
//! interface per second, measured over a window after a warm-up; the median of the runs
//! is reported. Latency is one-way, from a low-rate probe through the VIP: the sender
//! stamps CLOCK_REALTIME into the payload, the backend's kernel stamps the arrival
//! (SO_TIMESTAMPNS), and an hdrhistogram collects the difference — once with no load and
//! once under each traffic mode (separate runs, so the timestamping does not cost the
//! throughput runs anything).
//!
//! Everything lives in namespaces named `kxm-{role}-{pid}` with addresses from
//! 198.18.0.0/15 only; the namespaces (with their veths, rules, XDP programs and
//! conntrack entries) are deleted when the program ends, also on an error or Ctrl-C.
//! See `bench/MACRO.md`.
#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use clap::Parser;
use hdrhistogram::Histogram;
use kxp_bench::SCALE_EP_NET;
use lab::{Topology, in_ns, ip};

const VIP: &str = "198.19.0.10";
const SINK_PORT: u16 = 9000;
const PROBE_PORT: u16 = 7000;
const PROBE_SPORT: u16 = 40000;
const GEN_IP: &str = "198.18.1.2";
const R_GEN_IP: &str = "198.18.1.1";
const R_BACK_IP: &str = "198.18.2.1";
const ENDPOINTS: [&str; 3] = ["198.18.2.2", "198.18.2.3", "198.18.2.4"];
const CLUSTER_CIDR: &str = "198.18.0.0/16";
const GEN_CPU: usize = 0;
const ROUTER_CPU: usize = 1;
const HEALTHZ: &str = "127.0.0.1:10256";

/// `--kxp-arg`s.
static KXP_ARGS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// kxp's macro benchmark against the kernel (run as root; see bench/MACRO.md).
#[derive(Debug, Parser)]
#[command(name = "macro-bench")]
struct Args {
    /// Smoke test: one run per case, short durations.
    #[arg(long)]
    quick: bool,
    /// Throughput runs per case and mode (the median is reported) [default: 3, --quick 1].
    #[arg(long)]
    runs: Option<usize>,
    /// Rounds of the throughput phase: each round runs every case once (its `--runs`
    /// runs per mode), in the given order, then reversed, and so on (A B, B A, A B …),
    /// and a case's runs of all rounds make its median. Interleaving spreads what drifts
    /// during a run (the machine warming, a neighbour's load) over the cases instead of
    /// giving it to whichever ran first: for A/B comparisons such as kxp-base vs kxp.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Measured seconds per run [default: 3, --quick 1].
    #[arg(long)]
    secs: Option<f64>,
    /// Cases: plain, nft, kxp, kxp-threaded, kxp-busypoll (comma separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "plain,nft,kxp,kxp-busypoll,kxp-threaded"
    )]
    cases: Vec<String>,
    /// Traffic modes: est (1,024 established flows), new (a new connection every packet).
    #[arg(long, value_delimiter = ',', default_value = "est,new")]
    modes: Vec<String>,
    /// The kxp binary [default: `kxp` next to this program, built with cargo if missing].
    #[arg(long)]
    kxp: Option<PathBuf>,
    /// More arguments for `kxp run` in the kxp cases (not the `-base` ones), e.g.
    /// `--kxp-arg=--queue-budget=500`.
    #[arg(long = "kxp-arg", value_name = "ARG", allow_hyphen_values = true)]
    kxp_args: Vec<String>,
    /// An earlier kxp binary, measured as cases `kxp-base`, `kxp-10k-base`, `kxp-100k-base`, `kxp-1m-base` and `kxp-8q-base` in the same run: a change on
    /// the packet path reports its ratios before and after side by side.
    #[arg(long)]
    kxp_baseline: Option<PathBuf>,
    /// Latency probes per second.
    #[arg(long, default_value_t = 1000)]
    probe_rate: u32,
    /// Skip the latency phases.
    #[arg(long)]
    no_latency: bool,
    /// Offered loads of the latency phase (after every case's rate runs): N% of the
    /// slowest router's median rate in that mode in this run (the same load for every
    /// router), N (Mpps), or max (unpaced).
    #[arg(long, value_delimiter = ',', default_value = "50%,90%,max")]
    lat_loads: Vec<String>,
    /// `kxp run --busy-poll` value of the kxp-busypoll case (USECS,BUDGET).
    #[arg(long, default_value = "50,64")]
    busy_poll: String,
    /// Before each run, wait up to this many seconds for other processes to use less
    /// than --quiet-pct of a CPU [default: 30, --quick 0].
    #[arg(long)]
    quiet_wait: Option<f64>,
    /// See --quiet-wait.
    #[arg(long, default_value_t = 10.0)]
    quiet_pct: f64,
    /// Keep the working directory (trafgen configs, nft ruleset, kxp logs) and print it.
    #[arg(long)]
    keep: bool,
    /// Also set RPS (to CPU1) on the backend's interface, as runs before 2026-12-03
    /// did. Off by default: a pod's veth has no RPS on a node (the kernel's default), and
    /// it steers nothing here (the router's CPU transmits into the backend, so the
    /// backlog is that CPU's anyway), but it makes the backend's kernel hash every packet
    /// whose skb carries no hash: kxp's (an AF_XDP transmit makes a fresh skb), not the
    /// kernel routers' (their skb keeps the hash the router's own RPS computed on CPU0).
    #[arg(long)]
    backend_rps: bool,
    /// The generator: trafgen (`-t 0`, one sendto per packet: the issue's setup) or xsk
    /// (the same packets in batches on an AF_XDP socket: `xsk-gen`, built alongside).
    #[arg(long, default_value = "trafgen")]
    generator: String,
    /// Instead of the throughput cases: restart kxp under the generator's established
    /// flows (kill -9, SIGTERM, a new binary) and report, per restart, how long no
    /// packet reached the backend and how many were lost.
    #[arg(long)]
    restart: bool,
    /// Instead of the throughput cases: fill kxp's table with this many flows (the
    /// generator's new-connection mode, the table sized for them) and time the admin
    /// commands (`kxp conntrack list` filtered, `service list`, `conntrack stats`,
    /// `trace --live`) against it, 5 times each.
    #[arg(long, value_name = "FLOWS")]
    admin_at: Option<u64>,
    /// Where the run's result file (JSON) and chart (SVG) go, as
    /// macro-YYYYmmddTHHMMSSZ.{json,svg}.
    #[arg(long, value_name = "DIR", default_value = "target/macro-bench")]
    out: PathBuf,
    /// Instead of running: compare two result files (rates and their ratio, latency per
    /// load), B against A.
    #[arg(long, num_args = 2, value_names = ["A.json", "B.json"])]
    compare: Option<Vec<PathBuf>>,
    /// Instead of running: draw the chart of a result file again (to PATH.svg).
    #[arg(long, value_name = "RESULT.json")]
    chart: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Est,
    New,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Est => "est",
            Mode::New => "new",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    Plain,
    Nft,
    Kxp,
    KxpBase,
    KxpThreaded,
    KxpBusyPoll,
    /// kube-proxy's iptables mode (the rules it writes, loaded with iptables-restore).
    Ipt,
    /// The scale cases: 10,000 Services (99,993 endpoints), traffic spread over all.
    Nft10k,
    Ipt10k,
    Kxp10k,
    /// kxp with 1,000,000 established flows.
    Kxp1m,
    /// Kxp1m with the --kxp-baseline binary.
    Kxp1mBase,
    /// Kxp10k with the --kxp-baseline binary.
    Kxp10kBase,
    /// kxp at 100,000 Services (999,993 endpoints), traffic spread over all (no kernel
    /// case: kube-proxy's ruleset would hold a million endpoint chains).
    Kxp100k,
    /// Kxp100k with the --kxp-baseline binary.
    Kxp100kBase,
    /// kxp with 110 idle pod veths attached beside its two links (a kubelet's pods).
    KxpPods,
    /// kxp, 1 worker, the generator's link with 8 queues each way (flows spread over
    /// them, as RSS spreads them over a NIC's).
    Kxp8q,
    /// Kxp8q with the --kxp-baseline binary.
    Kxp8qBase,
    /// kxp with 1,000 NetworkPolicies in the endpoints' namespace (one admits the
    /// generator's traffic to the endpoint pods, the others select other pods): the
    /// check every new connection makes.
    KxpPol,
    /// kxp with `kxp.networkPolicy: kernel`, the endpoints on kxp's node: every packet to
    /// them goes through the kernel (its conntrack and FORWARD), and their answers too.
    KxpKernelPol,
    /// Plain forwarding on the generator's link with 8 queues (RPS: CPU1 on every
    /// queue): what 8 queues cost the lab's generator side, whatever the router.
    Plain8q,
}

/// Queues of the generator's link in the `kxp-8q` case.
const UPLINK_QUEUES: u32 = 8;

/// Idle pod veths of the `kxp-110pods` case.
const IDLE_PODS: usize = 110;

/// Services of the scale cases.
const SCALE_SERVICES: u32 = 10_000;
/// Endpoints of each extra Service of the scale cases (the first keeps its 3).
const SCALE_ENDPOINTS: u32 = 10;

impl Case {
    /// Every case, in the order the error message lists them.
    const ALL: [Case; 21] = [
        Case::Plain,
        Case::Nft,
        Case::Ipt,
        Case::Kxp,
        Case::KxpBase,
        Case::KxpThreaded,
        Case::KxpBusyPoll,
        Case::Nft10k,
        Case::Ipt10k,
        Case::Kxp10k,
        Case::Kxp10kBase,
        Case::Kxp100k,
        Case::Kxp100kBase,
        Case::Kxp1m,
        Case::Kxp1mBase,
        Case::KxpPods,
        Case::Kxp8q,
        Case::Kxp8qBase,
        Case::Plain8q,
        Case::KxpPol,
        Case::KxpKernelPol,
    ];

    fn parse(s: &str) -> anyhow::Result<Case> {
        let s = s.trim();
        match Case::ALL.into_iter().find(|c| c.name() == s) {
            Some(c) => Ok(c),
            None => {
                let names: Vec<&str> = Case::ALL.iter().map(|c| c.name()).collect();
                bail!("unknown case {s:?} ({})", names.join(", "))
            }
        }
    }
    fn name(self) -> &'static str {
        match self {
            Case::Plain => "plain",
            Case::Nft => "nft",
            Case::Kxp => "kxp",
            Case::KxpBase => "kxp-base",
            Case::KxpThreaded => "kxp-threaded",
            Case::KxpBusyPoll => "kxp-busypoll",
            Case::Ipt => "iptables",
            Case::Nft10k => "nft-10k",
            Case::Ipt10k => "iptables-10k",
            Case::Kxp10k => "kxp-10k",
            Case::Kxp1m => "kxp-1m",
            Case::Kxp1mBase => "kxp-1m-base",
            Case::Kxp10kBase => "kxp-10k-base",
            Case::Kxp100k => "kxp-100k",
            Case::Kxp100kBase => "kxp-100k-base",
            Case::KxpPods => "kxp-110pods",
            Case::Kxp8q => "kxp-8q",
            Case::Kxp8qBase => "kxp-8q-base",
            Case::KxpPol => "kxp-1kpol",
            Case::KxpKernelPol => "kxp-kernelpol",
            Case::Plain8q => "plain-8q",
        }
    }
    /// The router the case sets up (the scale cases are their router's at scale).
    fn kind(self) -> Case {
        match self {
            Case::Nft10k => Case::Nft,
            Case::Ipt10k => Case::Ipt,
            Case::Kxp10k
            | Case::Kxp10kBase
            | Case::Kxp100k
            | Case::Kxp100kBase
            | Case::Kxp1m
            | Case::Kxp1mBase
            | Case::KxpPods
            | Case::Kxp8q
            | Case::Kxp8qBase
            | Case::KxpPol
            | Case::KxpKernelPol => Case::Kxp,
            Case::Plain8q => Case::Plain,
            c => c,
        }
    }
    /// Services in the state / ruleset.
    fn services(self) -> u32 {
        match self {
            Case::Nft10k | Case::Ipt10k | Case::Kxp10k | Case::Kxp10kBase => SCALE_SERVICES,
            Case::Kxp100k | Case::Kxp100kBase => 10 * SCALE_SERVICES,
            _ => 1,
        }
    }
    /// Established flows the generator's `est` mode cycles through.
    fn flows(self) -> u32 {
        match self {
            Case::Kxp1m | Case::Kxp1mBase => 1_000_000,
            Case::Nft10k | Case::Ipt10k | Case::Kxp10k | Case::Kxp10kBase => 10_240,
            Case::Kxp100k | Case::Kxp100kBase => 102_400,
            _ => 1024,
        }
    }
    fn describe(self) -> &'static str {
        match self {
            Case::Plain => "plain forwarding, no NAT (RPS: CPU1)",
            Case::Nft => "kube-proxy nftables DNAT, 1 Service, 3 endpoints (RPS: CPU1)",
            Case::Kxp => "kxp, 1 worker on CPU1; veth NAPI where the kernel puts it",
            Case::KxpBase => "kxp --kxp-baseline binary (before), as kxp",
            Case::KxpThreaded => {
                "kxp, 1 worker on CPU1; threaded veth NAPI, its kthreads pinned to CPU1 (kxp moves them)"
            }
            Case::KxpBusyPoll => "kxp --busy-poll, 1 worker on CPU1; napi_defer_hard_irqs=2",
            Case::Ipt => "kube-proxy iptables DNAT, 1 Service, 3 endpoints (RPS: CPU1)",
            Case::Nft10k => {
                "kube-proxy nftables, 10,000 Services / 99,993 endpoints, traffic to all (RPS: CPU1)"
            }
            Case::Ipt10k => {
                "kube-proxy iptables, 10,000 Services / 99,993 endpoints, traffic to all (RPS: CPU1)"
            }
            Case::Kxp10k => "kxp, 10,000 Services / 99,993 endpoints, traffic to all",
            Case::Kxp1m => "kxp, 1,000,000 established flows (table sized 1.2M)",
            Case::Kxp1mBase => "kxp-1m with the --kxp-baseline binary (before)",
            Case::Kxp10kBase => "kxp-10k with the --kxp-baseline binary (before)",
            Case::Kxp100k => "kxp, 100,000 Services / 999,993 endpoints, traffic to all",
            Case::Kxp100kBase => "kxp-100k with the --kxp-baseline binary (before)",
            Case::KxpPods => "kxp with 110 idle pod veths attached beside its two links",
            Case::Kxp8q => {
                "kxp, 1 worker, the generator's link with 8 queues (flows spread over them)"
            }
            Case::Kxp8qBase => "kxp-8q with the --kxp-baseline binary (before)",
            Case::KxpPol => "kxp with 1,000 NetworkPolicies (one admits the traffic)",
            Case::KxpKernelPol => {
                "kxp with networkPolicy: kernel (the kernel carries the endpoints' traffic)"
            }
            Case::Plain8q => "plain forwarding, the generator's link with 8 queues (RPS: CPU1)",
        }
    }
    fn is_kxp(self) -> bool {
        matches!(
            self,
            Case::Kxp
                | Case::KxpBase
                | Case::KxpThreaded
                | Case::KxpBusyPoll
                | Case::Kxp10k
                | Case::Kxp1m
                | Case::Kxp1mBase
                | Case::Kxp10kBase
                | Case::Kxp100k
                | Case::Kxp100kBase
                | Case::KxpPods
                | Case::Kxp8q
                | Case::Kxp8qBase
                | Case::KxpPol
                | Case::KxpKernelPol
        )
    }
    /// A case of the --kxp-baseline binary.
    fn is_base(self) -> bool {
        matches!(
            self,
            Case::KxpBase
                | Case::Kxp1mBase
                | Case::Kxp10kBase
                | Case::Kxp100kBase
                | Case::Kxp8qBase
        )
    }
}

// ---------------------------------------------------------------------------------------
// Stop flag, bounded sleeps, processes we start.

#[derive(Debug, Clone)]
struct Stop(Arc<AtomicBool>);

impl Stop {
    fn check(&self) -> anyhow::Result<()> {
        if self.0.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        Ok(())
    }
    /// Sleeps `d` in short slices; an error as soon as a signal asked us to stop.
    fn sleep(&self, d: Duration) -> anyhow::Result<()> {
        let end = Instant::now() + d;
        loop {
            self.check()?;
            let now = Instant::now();
            if now >= end {
                return Ok(());
            }
            std::thread::sleep((end - now).min(Duration::from_millis(20)));
        }
    }
}

/// A child process in its own process group; signalled (group) and reaped on drop.
#[derive(Debug)]
struct Proc {
    child: Child,
    name: String,
    log: PathBuf,
}

impl Proc {
    fn spawn(mut cmd: Command, name: &str, log: &Path) -> anyhow::Result<Proc> {
        let out = std::fs::File::create(log)?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        Ok(Proc {
            child,
            name: name.to_string(),
            log: log.to_path_buf(),
        })
    }

    fn signal(&self, sig: libc::c_int) {
        // process_group(0) made the child's pid its group id.
        let _ = dataplane::sys::signal_group(self.child.id(), sig);
    }

    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// `sig` to the group, then up to `grace` for it to exit, then SIGKILL.
    fn stop(&mut self, sig: libc::c_int, grace: Duration) -> Option<ExitStatus> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Some(st);
        }
        self.signal(sig);
        let end = Instant::now() + grace;
        while Instant::now() < end {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        eprintln!("macro-bench: {} did not exit; SIGKILL", self.name);
        self.signal(libc::SIGKILL);
        self.child.wait().ok()
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL to the process alone (as a crash or the OOM killer), then waits, as a
    /// supervisor does before it starts the next one (systemd for the unit's cgroup, the
    /// kubelet for the container's PID namespace), until no process of its group is
    /// left (its helpers, which end by themselves), up to `grace`.
    fn crash(&mut self, grace: Duration) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let end = Instant::now() + grace;
        // process_group(0) made the child's pid its group id; signal 0 only asks.
        while dataplane::sys::signal_group(self.child.id(), 0).is_ok() && Instant::now() < end {
            // As the supervisor's subreaper (see main), its orphans are ours to reap.
            dataplane::sys::reap_group(self.child.id());
            std::thread::sleep(Duration::from_millis(2));
        }
        if dataplane::sys::signal_group(self.child.id(), 0).is_ok() {
            eprintln!(
                "macro-bench: {}'s group outlived it by {grace:?}; SIGKILL",
                self.name
            );
            self.signal(libc::SIGKILL);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop(libc::SIGTERM, Duration::from_secs(5));
    }
}

struct RemoveDir(PathBuf, bool);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        if self.1 {
            eprintln!("macro-bench: kept {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn sh_in(ns: &str, script: &str) -> io::Result<std::process::Output> {
    in_ns(ns, &["sh", "-c", script])
}

fn stdout_of(o: io::Result<std::process::Output>) -> io::Result<String> {
    o.map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
}

// ---------------------------------------------------------------------------------------
// The lab: namespaces, links, addresses, counters.

/// Field order is drop order: the topology (namespaces) goes last.
struct Lab {
    genns: String,
    router: String,
    back: String,
    /// Router-side device names (carry the pid so that kthreads can be found by name).
    rg: String,
    rb: String,
    rg_mac: String,
    gen_mac: String,
    dir: PathBuf,
    stop: Stop,
    /// (Services, est flows) of the router set up now: what the generator sends to.
    scale: std::sync::Mutex<(u32, u32)>,
    /// Queues in use on the generator's link (both ends): the generator sends on each.
    uplink_queues: std::sync::Mutex<u32>,
    _dir_guard: RemoveDir,
    _topo: Topology,
}

fn mac_of(ns: &str, dev: &str) -> anyhow::Result<String> {
    let out = stdout_of(ip(&["-n", ns, "-br", "link", "show", dev]))?;
    out.split_whitespace()
        .nth(2)
        .map(str::to_string)
        .with_context(|| format!("no MAC address for {dev} in {ns}: {out:?}"))
}

impl Lab {
    /// Creates (or deletes) the `kxp-110pods` case's idle pod veths in the router's
    /// namespace: `vpN`, as a CNI creates them (kernel defaults), their peers `vqN` up
    /// beside them, no address, no traffic.
    fn idle_pods(&self, create: bool) -> anyhow::Result<()> {
        let batch = self.dir.join("idle-pods.batch");
        let text: String = (0..IDLE_PODS)
            .map(|i| {
                if create {
                    format!("link add vp{i} type veth peer name vq{i}\nlink set vp{i} up\nlink set vq{i} up\n")
                } else {
                    format!("link del vp{i}\n")
                }
            })
            .collect();
        std::fs::write(&batch, text)?;
        let r = ip(&[
            "-n",
            &self.router,
            "-force",
            "-batch",
            &batch.display().to_string(),
        ]);
        if create {
            r.context("creating the idle pod veths")?;
        }
        Ok(())
    }

    /// Sets the queues in use on the generator's link, both ends (kxp stopped: the
    /// kernel keeps a queue an AF_XDP socket is bound to), with RPS as on its first
    /// queue (router's end: CPU1, generator's: CPU0) on every one.
    fn set_uplink_queues(&self, n: u32) -> anyhow::Result<()> {
        let n_s = n.to_string();
        for (ns, dev, cpu) in [
            (&self.router, &self.rg, ROUTER_CPU),
            (&self.genns, &"eth0".to_string(), GEN_CPU),
        ] {
            in_ns(ns, &["ethtool", "-L", dev, "rx", &n_s, "tx", &n_s])
                .with_context(|| format!("ethtool -L {dev} rx {n} tx {n}"))?;
            sh_in(
                ns,
                &format!(
                    "for q in /sys/class/net/{dev}/queues/rx-*; do echo {:x} > $q/rps_cpus; done",
                    1u32 << cpu
                ),
            )?;
        }
        *self.uplink_queues.lock().unwrap_or_else(|e| e.into_inner()) = n;
        Ok(())
    }

    fn new(stop: Stop, keep: bool, backend_rps: bool) -> anyhow::Result<Lab> {
        let pid = std::process::id();
        let mut topo = Topology::new("kxm");
        let genns = topo.add_ns("gen")?;
        let router = topo.add_ns("router")?;
        let back = topo.add_ns("back")?;
        topo.forwarding(&router)?;
        let rg = format!("rg{pid}");
        let rb = format!("rb{pid}");
        // Made with UPLINK_QUEUES queues, one in use but in the kxp-8q case.
        topo.link_multiqueue(
            (&router, &rg, &format!("{R_GEN_IP}/24")),
            (&genns, "eth0", &format!("{GEN_IP}/24")),
            UPLINK_QUEUES,
        )?;
        for (ns, dev) in [(&router, &rg), (&genns, &"eth0".to_string())] {
            in_ns(ns, &["ethtool", "-L", dev, "rx", "1", "tx", "1"])?;
        }
        topo.link(
            (&router, &rb, &format!("{R_BACK_IP}/24")),
            (&back, "eth0", &format!("{}/24", ENDPOINTS[0])),
        )?;
        for ep in &ENDPOINTS[1..] {
            ip(&[
                "-n",
                &back,
                "addr",
                "add",
                &format!("{ep}/24"),
                "dev",
                "eth0",
            ])?;
        }
        ip(&["-n", &genns, "route", "add", "default", "via", R_GEN_IP])?;
        ip(&["-n", &back, "route", "add", "default", "via", R_BACK_IP])?;

        let rg_mac = mac_of(&router, &rg)?;
        let rb_mac = mac_of(&router, &rb)?;
        let gen_mac = mac_of(&genns, "eth0")?;
        let back_mac = mac_of(&back, "eth0")?;
        // Static neighbours: no ARP during a run, for the kernel nor for kxp.
        let perm = |ns: &str, addr: &str, mac: &str, dev: &str| {
            ip(&[
                "-n",
                ns,
                "neigh",
                "replace",
                addr,
                "lladdr",
                mac,
                "dev",
                dev,
                "nud",
                "permanent",
            ])
        };
        perm(&genns, R_GEN_IP, &rg_mac, "eth0")?;
        perm(&router, GEN_IP, &gen_mac, &rg)?;
        for ep in ENDPOINTS {
            perm(&router, ep, &back_mac, &rb)?;
        }
        perm(&back, R_BACK_IP, &rb_mac, "eth0")?;
        // The scale cases' endpoints (198.18.96.0/20) are behind the backend.
        ip(&[
            "-n",
            &router,
            "route",
            "add",
            SCALE_EP_NET,
            "via",
            ENDPOINTS[0],
            "dev",
            &rb,
        ])?;

        // The router accepts the new-connection sources (198.18.64.0/19, not on its link).
        sh_in(
            &router,
            &format!(
                "for d in all default {rg} {rb}; do echo 0 > /proc/sys/net/ipv4/conf/$d/rp_filter; done"
            ),
        )?;
        // Kernel packet processing of the router on CPU1, of the generator's side on CPU0:
        // packets trafgen sends take the backlog path, so RPS on the receiving veth
        // decides the CPU (veths have no IRQ to steer). The backend's receive runs where
        // the router transmits into it, CPU1, with the kernel's default (no RPS) on its
        // interface; `--backend-rps` sets it as earlier runs did (see `Args`).
        let r_mask = format!("{:x}", 1u32 << ROUTER_CPU);
        let g_mask = format!("{:x}", 1u32 << GEN_CPU);
        sh_in(
            &router,
            &format!(
                "echo {r_mask} > /sys/class/net/{rg}/queues/rx-0/rps_cpus; echo {r_mask} > /sys/class/net/{rb}/queues/rx-0/rps_cpus"
            ),
        )?;
        if backend_rps {
            sh_in(
                &back,
                &format!("echo {r_mask} > /sys/class/net/eth0/queues/rx-0/rps_cpus"),
            )?;
        }
        sh_in(
            &genns,
            &format!("echo {g_mask} > /sys/class/net/eth0/queues/rx-0/rps_cpus"),
        )?;

        // The backend counts the sink traffic at its interface and drops it there (no
        // socket to wake, no ICMP port-unreachable back through the router).
        let rules = format!(
            "table netdev kxmbench {{\n  counter delivered {{ }}\n  chain ingress {{\n    type filter hook ingress device \"eth0\" priority 0; policy accept;\n    udp dport {SINK_PORT} counter name \"delivered\" drop\n  }}\n}}\n"
        );
        let dir = std::env::temp_dir().join(format!("kxp-macro-{pid}"));
        std::fs::create_dir_all(&dir)?;
        let guard = RemoveDir(dir.clone(), keep);
        let f = dir.join("backend.nft");
        std::fs::write(&f, rules)?;
        in_ns(&back, &["nft", "-f", &f.display().to_string()])
            .context("loading the backend's counter (is nftables installed?)")?;

        Ok(Lab {
            genns,
            router,
            back,
            rg,
            rb,
            rg_mac,
            gen_mac,
            dir,
            stop,
            scale: std::sync::Mutex::new((1, 1024)),
            uplink_queues: std::sync::Mutex::new(1),
            _dir_guard: guard,
            _topo: topo,
        })
    }

    /// Packets counted at the backend so far, and when.
    fn delivered(&self) -> anyhow::Result<(u64, Instant)> {
        let t0 = Instant::now();
        let out = stdout_of(in_ns(
            &self.back,
            &["nft", "list", "counter", "netdev", "kxmbench", "delivered"],
        ))?;
        let t1 = Instant::now();
        let n = out
            .split_whitespace()
            .skip_while(|w| *w != "packets")
            .nth(1)
            .and_then(|w| w.parse().ok())
            .with_context(|| format!("cannot read the backend counter: {out:?}"))?;
        Ok((n, t0 + (t1 - t0) / 2))
    }

    /// Packets dropped on the way in so far: the generator veth's TX drops (its peer's
    /// queue was full), the router veths' RX drops (XDP drops and failed redirects, e.g. a
    /// full AF_XDP ring), the backend veth's RX drops, and the backlog drops of every CPU
    /// (/proc/net/softnet_stat, system-wide).
    fn drops(&self) -> u64 {
        let read = |ns: &str, files: &[String]| -> u64 {
            let mut cmd = vec!["cat"];
            cmd.extend(files.iter().map(String::as_str));
            stdout_of(in_ns(ns, &cmd))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|w| w.parse::<u64>().ok())
                .sum()
        };
        let st = |dev: &str, what: &str| format!("/sys/class/net/{dev}/statistics/{what}");
        let mut n = read(&self.genns, &[st("eth0", "tx_dropped")]);
        n += read(
            &self.router,
            &[st(&self.rg, "rx_dropped"), st(&self.rb, "tx_dropped")],
        );
        n += read(&self.back, &[st("eth0", "rx_dropped")]);
        let softnet = std::fs::read_to_string("/proc/net/softnet_stat").unwrap_or_default();
        n += softnet
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter_map(|h| u64::from_str_radix(h, 16).ok())
            .sum::<u64>();
        n
    }

    fn trafgen_cfg(&self, mode: Mode) -> anyhow::Result<PathBuf> {
        let src = match mode {
            // 1,024 flows: one client address, 1,024 source ports.
            Mode::Est => format!(
                "ipv4(sa={GEN_IP}, da={VIP}, ttl=64),\n  udp(sp=dinc(10000, 11023), dp={SINK_PORT}),"
            ),
            // A new tuple every packet: 198.18.[64-95].[1-251] x ports 1024-65535
            // (periods 64, 251 and 64512: 16.2 M distinct tuples before one repeats).
            Mode::New => format!(
                "ipv4(sa=198.18.64.1, sa[2]=dinc(64, 95), sa[3]=dinc(1, 251), da={VIP}, ttl=64),\n  udp(sp=dinc(1024, 65535), dp={SINK_PORT}),"
            ),
        };
        let cfg = format!(
            "{{\n  eth(da={}, sa={}),\n  {src}\n  fill(0x2e, 18)\n}}\n",
            self.rg_mac, self.gen_mac
        );
        let p = self.dir.join(format!("trafgen-{}.cfg", mode.name()));
        std::fs::write(&p, cfg)?;
        Ok(p)
    }

    fn start_trafgen(
        &self,
        cfg: &Path,
        mode: Mode,
        plan: &Plan,
        max_packets: u64,
        tag: &str,
        rate: Option<f64>,
    ) -> anyhow::Result<Proc> {
        if let Some(gen_bin) = &plan.xsk_gen {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", &self.genns, "taskset", "-c"])
                .arg(GEN_CPU.to_string())
                .arg(gen_bin)
                .args(["--dev", "eth0", "--mode", mode.name()])
                .args(["--src-mac", &self.gen_mac, "--dst-mac", &self.rg_mac])
                .args(["--src-ip", GEN_IP, "--dst-ip", VIP])
                .args(["--dport", &SINK_PORT.to_string()])
                .arg("--max")
                .arg(max_packets.to_string());
            if let Some(r) = rate {
                cmd.arg("--rate").arg(format!("{}", r.round() as u64));
            }
            let (vips, flows) = *self.scale.lock().unwrap_or_else(|e| e.into_inner());
            cmd.arg("--vips").arg(vips.to_string());
            cmd.arg("--flows").arg(flows.to_string());
            let queues = *self.uplink_queues.lock().unwrap_or_else(|e| e.into_inner());
            cmd.arg("--queues").arg(queues.to_string());
            return Proc::spawn(cmd, "xsk-gen", &self.dir.join(format!("xsk-gen-{tag}.log")));
        }
        if *self.scale.lock().unwrap_or_else(|e| e.into_inner()) != (1, 1024) {
            bail!("the scale cases (-10k, -100k, -1m) need --generator xsk");
        }
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.genns, "taskset", "-c"])
            .arg(GEN_CPU.to_string())
            .args(["trafgen", "-o", "eth0", "-i"])
            .arg(cfg)
            // -t 0: one sendto per packet (TX_RING fails with EAGAIN on this kernel), or
            // -b: paced to a rate; -P 1: one process (pinned to CPU0); --no-sock-mem -Q:
            // leave the host's socket memory sysctls and IRQ affinities alone.
            .args(match rate {
                Some(r) => vec!["-b".to_string(), format!("{}pps", r.round() as u64)],
                None => vec!["-t".to_string(), "0".to_string()],
            })
            .args(["-P", "1", "--no-sock-mem", "-Q", "-n"])
            .arg(max_packets.to_string());
        Proc::spawn(cmd, "trafgen", &self.dir.join(format!("trafgen-{tag}.log")))
    }
}

fn cpu_times() -> Vec<[u64; 8]> {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    s.lines()
        .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
        .map(|l| {
            let mut a = [0u64; 8];
            for (i, v) in l.split_whitespace().skip(1).take(8).enumerate() {
                a[i] = v.parse().unwrap_or(0);
            }
            a
        })
        .collect()
}

/// Per CPU over a window: (busy %, softirq %, steal %). Busy includes the steal: time
/// the hypervisor ran something else on the vCPU.
fn cpu_usage(a: &[[u64; 8]], b: &[[u64; 8]]) -> Vec<(f64, f64, f64)> {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let d: Vec<f64> = (0..8).map(|i| y[i].saturating_sub(x[i]) as f64).collect();
            let total: f64 = d.iter().sum::<f64>().max(1.0);
            let idle = d[3] + d[4];
            (
                100.0 * (total - idle) / total,
                100.0 * d[6] / total,
                100.0 * d[7] / total,
            )
        })
        .collect()
}

/// CPU time (clock ticks) of every user-space process that is not ours: not this
/// program, not in a process group we started (trafgen, kxp). Kernel threads (children
/// of kthreadd) are left out: ksoftirqd and the NAPI threads do our packets' work.
fn foreign_ticks(ours: &[u32]) -> std::collections::HashMap<u32, u64> {
    let me = std::process::id();
    let mut m = std::collections::HashMap::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return m;
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == me || pid == 2 {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        // After the comm: state ppid pgrp ... utime(14th field) stime(15th).
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let (ppid, pgrp) = (num(1) as u32, num(2) as u32);
        if ppid == 2 || ours.contains(&pgrp) {
            continue;
        }
        m.insert(pid, num(11) + num(12));
    }
    m
}

/// Share of one CPU (percent) other processes used between two [`foreign_ticks`].
fn foreign_pct(
    a: &std::collections::HashMap<u32, u64>,
    b: &std::collections::HashMap<u32, u64>,
    secs: f64,
) -> f64 {
    let hz = dataplane::sys::clock_ticks_per_sec() as f64;
    let ticks: u64 = b
        .iter()
        .map(|(pid, t)| t.saturating_sub(a.get(pid).copied().unwrap_or(0)))
        .sum();
    100.0 * ticks as f64 / hz / secs.max(1e-3)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

// ---------------------------------------------------------------------------------------
// Routers.

/// kube-proxy's chain-name suffix hash (it uses base32(sha256(name))[:8]; any stable
/// 8-character hash gives the same rules to the kernel).
fn chain_hash(name: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    (0..8)
        .map(|i| A[((h >> (i * 5)) & 31) as usize] as char)
        .collect()
}

/// A Service of the benchmark's cluster.
struct BenchService {
    name: String,
    vip: std::net::Ipv4Addr,
    /// (port name, port = target port)
    ports: Vec<(&'static str, u16)>,
    endpoints: Vec<String>,
}

/// The benchmark's cluster of `n` Services: `sink` (VIP 198.19.0.10, ports sink 9000/UDP
/// and probe 7000/UDP, the backend's three addresses), then `svc-1`… on the next
/// ClusterIPs (`kxp_bench::service_vip`), port 9000/UDP, 10 endpoints each in
/// 198.18.96.0/20 (an address serves several Services: 4,096 addresses for 99,990
/// endpoints at 10,000 Services, 999,990 at 100,000).
fn bench_services(n: u32) -> Vec<BenchService> {
    debug_assert_eq!(kxp_bench::service_vip(0).to_string(), VIP);
    let (ep0, len) = SCALE_EP_NET.split_once('/').expect("SCALE_EP_NET");
    let ep0 = u32::from(ep0.parse::<std::net::Ipv4Addr>().expect("SCALE_EP_NET"));
    let ep_count = 1u32 << (32 - len.parse::<u32>().expect("SCALE_EP_NET"));
    let mut v = vec![BenchService {
        name: "sink".into(),
        vip: kxp_bench::service_vip(0),
        ports: vec![("sink", SINK_PORT), ("probe", PROBE_PORT)],
        endpoints: ENDPOINTS.iter().map(|e| e.to_string()).collect(),
    }];
    for k in 1..n {
        v.push(BenchService {
            name: format!("svc-{k}"),
            vip: kxp_bench::service_vip(k),
            ports: vec![("sink", SINK_PORT)],
            endpoints: (0..SCALE_ENDPOINTS)
                .map(|j| {
                    std::net::Ipv4Addr::from(ep0 + (k * SCALE_ENDPOINTS + j) % ep_count).to_string()
                })
                .collect(),
        });
    }
    v
}

/// The ruleset kube-proxy's nftables mode writes for the benchmark's ClusterIP Services
/// (see [`bench_services`]), following
/// pkg/proxy/nftables/proxier.go (the base chains, sets and maps of its
/// TestOverallNFTablesRules, then per service port a `service-…` chain with the
/// masquerade check and `numgen random mod N vmap`, and per endpoint an `endpoint-…`
/// chain with the hairpin check and `dnat to`).
fn kube_proxy_ruleset(services: u32) -> String {
    let mut r = String::new();
    let service_cidrs = kxp_bench::service_cidrs(services).join(", ");
    let _ = write!(
        r,
        r#"add table ip kube-proxy {{ comment "rules for kube-proxy" ; }}
add set ip kube-proxy cluster-ips {{ type ipv4_addr ; comment "Active ClusterIPs" ; }}
add set ip kube-proxy nodeport-ips {{ type ipv4_addr ; comment "IPs that accept NodePort traffic" ; }}
add map ip kube-proxy firewall-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment "destinations that are subject to LoadBalancerSourceRanges" ; }}
add map ip kube-proxy no-endpoint-nodeports {{ type inet_proto . inet_service : verdict ; comment "vmap to drop or reject packets to service nodeports with no endpoints" ; }}
add map ip kube-proxy no-endpoint-services {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment "vmap to drop or reject packets to services with no endpoints" ; }}
add map ip kube-proxy service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }}
add map ip kube-proxy service-nodeports {{ type inet_proto . inet_service : verdict ; comment "NodePort traffic" ; }}
add chain ip kube-proxy cluster-ips-check
add chain ip kube-proxy filter-prerouting-pre-dnat {{ type filter hook prerouting priority -110 ; }}
add chain ip kube-proxy filter-output-pre-dnat {{ type filter hook output priority -110 ; }}
add chain ip kube-proxy filter-forward {{ type filter hook forward priority 0 ; }}
add chain ip kube-proxy filter-input {{ type filter hook input priority 0 ; }}
add chain ip kube-proxy filter-output {{ type filter hook output priority 0 ; }}
add chain ip kube-proxy firewall-check
add chain ip kube-proxy mark-for-masquerade
add chain ip kube-proxy masquerading
add chain ip kube-proxy nat-output {{ type nat hook output priority -100 ; }}
add chain ip kube-proxy nat-postrouting {{ type nat hook postrouting priority 100 ; }}
add chain ip kube-proxy nat-prerouting {{ type nat hook prerouting priority -100 ; }}
add chain ip kube-proxy nodeport-endpoints-check
add chain ip kube-proxy reject-chain {{ comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ; }}
add chain ip kube-proxy services
add chain ip kube-proxy service-endpoints-check
add rule ip kube-proxy cluster-ips-check ip daddr @cluster-ips reject comment "Reject traffic to invalid ports of ClusterIPs"
add rule ip kube-proxy cluster-ips-check ip daddr {{ {service_cidrs} }} drop comment "Drop traffic to unallocated ClusterIPs"
add rule ip kube-proxy filter-prerouting-pre-dnat ct state new jump firewall-check
add rule ip kube-proxy filter-forward ct state new jump service-endpoints-check
add rule ip kube-proxy filter-forward ct state new jump cluster-ips-check
add rule ip kube-proxy filter-input ct state new jump nodeport-endpoints-check
add rule ip kube-proxy filter-input ct state new jump service-endpoints-check
add rule ip kube-proxy filter-output ct state new jump service-endpoints-check
add rule ip kube-proxy filter-output-pre-dnat ct state new jump firewall-check
add rule ip kube-proxy filter-output ct state new jump cluster-ips-check
add rule ip kube-proxy firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips
add rule ip kube-proxy mark-for-masquerade mark set mark or 0x4000
add rule ip kube-proxy masquerading mark and 0x4000 == 0 return
add rule ip kube-proxy masquerading mark set mark xor 0x4000
add rule ip kube-proxy masquerading masquerade fully-random
add rule ip kube-proxy nat-output jump services
add rule ip kube-proxy nat-postrouting jump masquerading
add rule ip kube-proxy nat-prerouting jump services
add rule ip kube-proxy nodeport-endpoints-check ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports
add rule ip kube-proxy reject-chain reject
add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips
add rule ip kube-proxy services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports
add element ip kube-proxy nodeport-ips {{ {R_GEN_IP} }}
add rule ip kube-proxy service-endpoints-check ip daddr . meta l4proto . th dport vmap @no-endpoint-services
"#
    );
    for svc in bench_services(services) {
        let vip = svc.vip;
        let _ = writeln!(r, "add element ip kube-proxy cluster-ips {{ {vip} }}");
        for &(port_name, port) in &svc.ports {
            let spn = format!("bench/{}/udp/{port_name}", svc.name);
            let svc_chain = format!("service-{}-{spn}", chain_hash(&spn));
            let mut vmap = Vec::new();
            let mut ep_rules = String::new();
            for (i, ep) in svc.endpoints.iter().enumerate() {
                let epn = format!("{spn}__{ep}/{port}");
                let ep_chain = format!("endpoint-{}-{epn}", chain_hash(&epn));
                let _ = writeln!(ep_rules, "add chain ip kube-proxy {ep_chain}");
                let _ = writeln!(
                    ep_rules,
                    "add rule ip kube-proxy {ep_chain} ip saddr {ep} jump mark-for-masquerade"
                );
                let _ = writeln!(
                    ep_rules,
                    "add rule ip kube-proxy {ep_chain} meta l4proto udp dnat to {ep}:{port}"
                );
                vmap.push(format!("{i} : goto {ep_chain}"));
            }
            // Chains first (a vmap's goto needs its target), then their rules.
            let _ = writeln!(r, "add chain ip kube-proxy {svc_chain}");
            r.push_str(&ep_rules);
            let _ = writeln!(
                r,
                "add rule ip kube-proxy {svc_chain} ip daddr {vip} ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade"
            );
            let _ = writeln!(
                r,
                "add rule ip kube-proxy {svc_chain} numgen random mod {} vmap {{ {} }}",
                svc.endpoints.len(),
                vmap.join(" , ")
            );
            let _ = writeln!(
                r,
                "add element ip kube-proxy service-ips {{ {vip} . udp . {port} : goto {svc_chain} }}"
            );
        }
    }
    r
}

/// The rules kube-proxy's iptables mode writes for the same Services, following
/// pkg/proxy/iptables/proxier.go: `KUBE-SERVICES` with one rule per Service port (the
/// linear chain every new connection walks), per Service port a `KUBE-SVC-…` chain with
/// the masquerade check and `statistic --mode random` rules, per endpoint a `KUBE-SEP-…`
/// chain with the hairpin check and the DNAT; `KUBE-POSTROUTING` masquerades what is
/// marked, and the filter table's `KUBE-FORWARD` accepts marked and established traffic.
/// Chain-name hashes are FNV, as in the nft ruleset. Services are written in a shuffled
/// order, as kube-proxy's map iteration does.
fn kube_proxy_iptables(services: u32) -> String {
    let mut chains = String::new();
    let mut rules = String::new();
    let mut portals = Vec::new();
    for svc in bench_services(services) {
        let vip = svc.vip;
        for &(port_name, port) in &svc.ports {
            let spn = format!("bench/{}:{port_name}", svc.name);
            let svc_chain = format!(
                "KUBE-SVC-{}{}",
                chain_hash(&spn),
                chain_hash(&format!("{spn}/udp"))
            );
            let _ = writeln!(chains, ":{svc_chain} - [0:0]");
            portals.push(format!(
                "-A KUBE-SERVICES -d {vip}/32 -p udp -m comment --comment \"{spn} cluster IP\" -m udp --dport {port} -j {svc_chain}"
            ));
            let _ = writeln!(
                rules,
                "-A {svc_chain} -d {vip}/32 ! -s {CLUSTER_CIDR} -p udp -m comment --comment \"{spn} cluster IP\" -m udp --dport {port} -j KUBE-MARK-MASQ"
            );
            let n = svc.endpoints.len();
            for (i, ep) in svc.endpoints.iter().enumerate() {
                let epn = format!("{spn}/{ep}:{port}");
                let sep = format!(
                    "KUBE-SEP-{}{}",
                    chain_hash(&epn),
                    chain_hash(&format!("{epn}/udp"))
                );
                let _ = writeln!(chains, ":{sep} - [0:0]");
                let left = n - i;
                if left > 1 {
                    let _ = writeln!(
                        rules,
                        "-A {svc_chain} -m comment --comment \"{spn} -> {ep}:{port}\" -m statistic --mode random --probability {:.11} -j {sep}",
                        1.0 / left as f64
                    );
                } else {
                    let _ = writeln!(
                        rules,
                        "-A {svc_chain} -m comment --comment \"{spn} -> {ep}:{port}\" -j {sep}"
                    );
                }
                let _ = writeln!(
                    rules,
                    "-A {sep} -s {ep}/32 -m comment --comment \"{spn}\" -j KUBE-MARK-MASQ"
                );
                let _ = writeln!(
                    rules,
                    "-A {sep} -p udp -m comment --comment \"{spn}\" -m udp -j DNAT --to-destination {ep}:{port}"
                );
            }
        }
    }
    // kube-proxy writes the Services in its map's order: a fixed shuffle (so the sink
    // Service is somewhere in the chain, not first).
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in (1..portals.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        portals.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let mut r = String::new();
    r.push_str("*filter\n:KUBE-FORWARD - [0:0]\n:KUBE-PROXY-FIREWALL - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-EXTERNAL-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\n");
    r.push_str("-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n");
    r.push_str("-A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\n");
    r.push_str("-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n");
    r.push_str("-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n");
    r.push_str("-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n");
    r.push_str("-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    r.push_str("-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n");
    r.push_str("-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n");
    r.push_str("-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    r.push_str("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n");
    r.push_str("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT\n");
    r.push_str("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n");
    r.push_str("COMMIT\n*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n");
    r.push_str(&chains);
    r.push_str(
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n",
    );
    r.push_str("-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n");
    r.push_str("-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n");
    r.push_str("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n");
    r.push_str("-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n");
    r.push_str("-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0\n");
    r.push_str("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n");
    for p in &portals {
        r.push_str(p);
        r.push('\n');
    }
    r.push_str("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n");
    r.push_str(&rules);
    r.push_str("COMMIT\n");
    r
}

/// The endpoints as Pods of namespace `bench` (labels `app: sink`), and `n`
/// NetworkPolicies there: the first admits 198.18.0.0/16 to them on the sink port, the
/// others select pods that do not exist (each with a rule of its own).
fn policy_yaml(n: u32) -> String {
    let mut out = String::from("---\napiVersion: v1\nkind: Namespace\nmetadata: {name: bench}\n");
    for (i, ep) in ENDPOINTS.iter().enumerate() {
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: sink-{i}, namespace: bench, labels: {{app: sink}}}}\n\
             spec: {{containers: [{{name: s}}]}}\nstatus: {{phase: Running, podIP: {ep}}}\n"
        );
    }
    for i in 0..n {
        let (selector, from) = if i == 0 {
            (
                "{matchLabels: {app: sink}}".to_string(),
                "198.18.0.0/16".to_string(),
            )
        } else {
            (
                format!("{{matchLabels: {{app: other-{i}}}}}"),
                format!("10.{}.{}.0/24", i / 256, i % 256),
            )
        };
        let _ = write!(
            out,
            "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: p{i}, namespace: bench}}\n\
             spec:\n  podSelector: {selector}\n  ingress: [{{from: [{{ipBlock: {{cidr: {from}}}}}], \
             ports: [{{port: {SINK_PORT}, protocol: UDP}}]}}]\n"
        );
    }
    out
}

fn state_yaml(services: u32) -> String {
    let mut out = String::new();
    for svc in bench_services(services) {
        let (name, vip) = (&svc.name, svc.vip);
        let sports: Vec<String> = svc
            .ports
            .iter()
            .map(|(n, p)| format!("  - {{name: {n}, port: {p}, targetPort: {p}, protocol: UDP}}"))
            .collect();
        let eports: Vec<String> = svc
            .ports
            .iter()
            .map(|(n, p)| format!("- {{name: {n}, port: {p}, protocol: UDP}}"))
            .collect();
        let mut eps = String::new();
        for ep in &svc.endpoints {
            let _ = writeln!(eps, "- addresses: [{ep}]\n  conditions: {{ready: true}}");
        }
        let _ = write!(
            out,
            r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: bench}}
spec:
  type: ClusterIP
  clusterIP: {vip}
  clusterIPs: [{vip}]
  ipFamilies: [IPv4]
  ports:
{}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: bench
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
ports:
{}
endpoints:
{eps}---
"#,
            sports.join("\n"),
            eports.join("\n")
        );
    }
    // One ServiceCIDR per range (the API allows one per family in each): the API
    // server's default `kubernetes`, then `bench-1`…
    for (i, cidr) in kxp_bench::service_cidrs(services).iter().enumerate() {
        let (sep, name) = match i {
            0 => ("", "kubernetes".to_string()),
            _ => ("---\n", format!("bench-{i}")),
        };
        out.push_str(&format!(
            "{sep}apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {{name: {name}}}\nspec: {{cidrs: [{cidr}]}}\n"
        ));
    }
    out
}

/// A router case set up in the lab; undone on drop.
struct Router<'a> {
    lab: &'a Lab,
    case: Case,
    kxp: Option<Proc>,
    /// kxp's binary and `kxp run` arguments (to restart it).
    kxp_cmd: Option<(PathBuf, Vec<String>)>,
    /// The running kxp's `KXP_GENERATION`.
    generation: u64,
    /// The log of the kxp the last hand-over took the node from.
    handed_from_log: Option<String>,
}

impl<'a> Router<'a> {
    /// The PID of the kxp this router runs, if any (its CPU is not "other processes").
    fn kxp_pids(&self) -> Vec<u32> {
        self.kxp.iter().map(|p| p.child.id()).collect()
    }

    fn setup(
        lab: &'a Lab,
        case: Case,
        kxp_bin: &Path,
        busy_poll: &str,
        tag: &str,
    ) -> anyhow::Result<Router<'a>> {
        let mut r = Router {
            generation: 1,
            handed_from_log: None,
            lab,
            case,
            kxp: None,
            kxp_cmd: None,
        };
        *lab.scale.lock().unwrap_or_else(|e| e.into_inner()) = (case.services(), case.flows());
        if case == Case::Plain8q {
            lab.set_uplink_queues(UPLINK_QUEUES)?;
        }
        match case.kind() {
            Case::Plain => {
                // The VIP is the backend's own address; the router just routes it there.
                ip(&[
                    "-n",
                    &lab.router,
                    "route",
                    "add",
                    &format!("{VIP}/32"),
                    "via",
                    ENDPOINTS[0],
                ])?;
                ip(&[
                    "-n",
                    &lab.back,
                    "addr",
                    "add",
                    &format!("{VIP}/32"),
                    "dev",
                    "lo",
                ])?;
            }
            Case::Nft => {
                let f = lab.dir.join("kube-proxy.nft");
                std::fs::write(&f, kube_proxy_ruleset(case.services()))?;
                in_ns(&lab.router, &["nft", "-f", &f.display().to_string()])
                    .context("loading the kube-proxy ruleset")?;
            }
            Case::Ipt => {
                let f = lab.dir.join("kube-proxy.iptables");
                std::fs::write(&f, kube_proxy_iptables(case.services()))?;
                in_ns(&lab.router, &["iptables-restore", &f.display().to_string()])
                    .context("loading the kube-proxy iptables rules")?;
            }
            _ => {
                let state = lab.dir.join("state.yaml");
                let config = lab.dir.join("kube-proxy.yaml");
                let mut text = state_yaml(case.services());
                if case == Case::KxpPol {
                    text.push_str(&policy_yaml(1000));
                }
                // The endpoints on kxp's node, whose traffic the kernel carries.
                let kernel_pol = case == Case::KxpKernelPol;
                if kernel_pol {
                    text = text.replace(
                        "  conditions: {ready: true}",
                        "  nodeName: bench-node\n  conditions: {ready: true}",
                    );
                }
                std::fs::write(&state, text)?;
                // A table for the flows (one worker) when they outgrow the default.
                let conntrack = if case.flows() > 200_000 {
                    format!(
                        "conntrack:\n  maxPerCore: 32768\n  min: {}\n",
                        u64::from(case.flows()) * 6 / 5
                    )
                } else {
                    String::new()
                };
                std::fs::write(
                    &config,
                    format!(
                        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nclusterCIDR: {CLUSTER_CIDR}\n{conntrack}{}",
                        if kernel_pol {
                            "kxp:\n  networkPolicy: kernel\n"
                        } else {
                            ""
                        }
                    ),
                )?;
                if case == Case::KxpBusyPoll {
                    lab.napi_knobs(2, 200_000)?;
                }
                let mut args: Vec<String> = ["run", "--interface", &lab.rg, "--interface", &lab.rb]
                    .map(String::from)
                    .to_vec();
                args.extend([
                    "--state-file".into(),
                    state.display().to_string(),
                    "--config".into(),
                    config.display().to_string(),
                    "--cpus".into(),
                    ROUTER_CPU.to_string(),
                    "--healthz-bind-address".into(),
                    HEALTHZ.into(),
                ]);
                if case == Case::KxpBusyPoll {
                    args.extend(["--busy-poll".into(), busy_poll.to_string()]);
                }
                if kernel_pol {
                    args.extend(["--hostname-override".into(), "bench-node".into()]);
                }
                if case == Case::KxpPods {
                    lab.idle_pods(true)?;
                    args.extend(["--interface".into(), "vp*".into()]);
                }
                if matches!(case, Case::Kxp8q | Case::Kxp8qBase) {
                    lab.set_uplink_queues(UPLINK_QUEUES)?;
                }
                if !case.is_base() {
                    args.extend(KXP_ARGS.get().into_iter().flatten().cloned());
                }
                let mut p = spawn_kxp(lab, kxp_bin, &args, &format!("kxp-{tag}"))?;
                wait_healthy(lab, &mut p)?;
                r.kxp = Some(p);
                r.kxp_cmd = Some((kxp_bin.to_path_buf(), args));
                if case == Case::KxpThreaded {
                    lab.threaded_napi()?;
                }
            }
        }
        Ok(r)
    }

    /// Stops kxp (SIGKILL, or SIGTERM and a wait) and starts it again, from `bin` if
    /// given (an upgrade), with the same arguments; returns once it is healthy.
    /// Stops kxp (`kill`: SIGKILL, else SIGTERM) and starts `bin` (or the same binary)
    /// with the same arguments, and waits until it is healthy. Returns how long the old
    /// process took to be gone (reaped), which a supervisor waits for before a start.
    fn restart_kxp(
        &mut self,
        kill: bool,
        bin: Option<&Path>,
        tag: &str,
    ) -> anyhow::Result<Duration> {
        let (old_bin, args) = self.kxp_cmd.clone().context("no kxp to restart")?;
        let stopping = Instant::now();
        if let Some(mut p) = self.kxp.take() {
            if kill {
                p.crash(Duration::from_secs(10));
            } else {
                p.stop(libc::SIGTERM, Duration::from_secs(10));
            }
        }
        let gone_in = stopping.elapsed();
        let bin = bin.map_or(old_bin, Path::to_path_buf);
        let mut p = spawn_kxp(self.lab, &bin, &args, tag)?;
        wait_healthy(self.lab, &mut p)?;
        self.kxp = Some(p);
        self.kxp_cmd = Some((bin, args));
        Ok(gone_in)
    }

    /// A rolling update with a surge: starts a kxp of the next generation beside the
    /// running one and waits until it has taken the node over (its `start-up:` line; the
    /// running one answers /healthz until then), then stops the old one, which stood by.
    /// Returns how long the old one took to release the node (from the new one's log).
    fn hand_over(&mut self, tag: &str) -> anyhow::Result<Duration> {
        let (bin, args) = self.kxp_cmd.clone().context("no kxp to hand over from")?;
        let mut p = spawn_kxp_of(self.lab, &bin, &args, tag, self.generation + 1)?;
        let end = Instant::now() + Duration::from_secs(30);
        while !p.log_text().contains("start-up:") {
            self.lab.stop.check()?;
            if !p.running() {
                bail!("the newer kxp exited:\n{}", p.log_text());
            }
            if Instant::now() > end {
                bail!("the newer kxp did not take over in 30 s:\n{}", p.log_text());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.generation += 1;
        if let Some(mut old) = self.kxp.replace(p) {
            old.stop(libc::SIGTERM, Duration::from_secs(10));
            self.handed_from_log = Some(old.log_text());
        }
        let text = self.kxp.as_ref().map(Proc::log_text).unwrap_or_default();
        let released = text
            .lines()
            .find(|l| l.contains("released the node to this one"))
            .and_then(|l| l.split("took_ms=").nth(1))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .context("the newer kxp's log says nothing of a release")?;
        Ok(Duration::from_millis(released))
    }

    /// kxp's last totals line, if it runs.
    fn kxp_totals(&self) -> Option<String> {
        let t = self.kxp.as_ref()?.log_text();
        t.lines()
            .rev()
            .find(|l| l.contains("totals:"))
            .and_then(|l| l.find("totals:").map(|i| l[i..].to_string()))
    }

    /// Stops kxp (its exit prints the final totals) and returns that line.
    fn finish(mut self) -> Option<String> {
        let mut p = self.kxp.take()?;
        p.stop(libc::SIGTERM, Duration::from_secs(10));
        let t = p.log_text();
        let line = t
            .lines()
            .rev()
            .find(|l| l.contains("totals:"))
            .and_then(|l| l.find("totals:").map(|i| l[i..].to_string()));
        self.kxp = Some(p);
        line
    }
}

impl Drop for Router<'_> {
    fn drop(&mut self) {
        let lab = self.lab;
        *lab.scale.lock().unwrap_or_else(|e| e.into_inner()) = (1, 1024);
        if self.case == Case::Plain8q {
            let _ = lab.set_uplink_queues(1);
        }
        match self.case.kind() {
            Case::Plain => {
                let _ = ip(&["-n", &lab.router, "route", "del", &format!("{VIP}/32")]);
                let _ = ip(&[
                    "-n",
                    &lab.back,
                    "addr",
                    "del",
                    &format!("{VIP}/32"),
                    "dev",
                    "lo",
                ]);
            }
            Case::Nft => {
                let _ = in_ns(&lab.router, &["nft", "delete", "table", "ip", "kube-proxy"]);
            }
            Case::Ipt => {
                let _ = sh_in(
                    &lab.router,
                    "iptables -t nat -F; iptables -t nat -X; iptables -F; iptables -X",
                );
            }
            _ => {
                if let Some(mut p) = self.kxp.take() {
                    p.stop(libc::SIGTERM, Duration::from_secs(10));
                }
                if self.case == Case::KxpPods {
                    let _ = lab.idle_pods(false);
                }
                if matches!(self.case, Case::Kxp8q | Case::Kxp8qBase) {
                    let _ = lab.set_uplink_queues(1);
                }
                // A stopped kxp keeps its steering and connections for the next one: the
                // next case or mode starts afresh instead.
                if let Some((bin, _)) = &self.kxp_cmd {
                    let _ = lab::node_command(&lab.router)
                        .arg(bin)
                        .arg("cleanup")
                        .stdin(Stdio::null())
                        .output();
                }
                if self.case == Case::KxpBusyPoll {
                    let _ = lab.napi_knobs(0, 0);
                }
            }
        }
    }
}

fn spawn_kxp(lab: &Lab, bin: &Path, args: &[String], tag: &str) -> anyhow::Result<Proc> {
    spawn_kxp_of(lab, bin, args, tag, 1)
}

/// As [`spawn_kxp`], of DaemonSet template generation `generation` (`KXP_GENERATION`:
/// a newer one started beside a running kxp takes the node over).
fn spawn_kxp_of(
    lab: &Lab,
    bin: &Path,
    args: &[String],
    tag: &str,
    generation: u64,
) -> anyhow::Result<Proc> {
    let mut cmd = lab::node_command(&lab.router);
    cmd.args(["env", "KXP_LOG_STATS=1"])
        .arg(format!("KXP_GENERATION={generation}"))
        .arg(bin)
        .args(args);
    Proc::spawn(cmd, "kxp", &lab.dir.join(format!("{tag}.log")))
}

fn wait_healthy(lab: &Lab, p: &mut Proc) -> anyhow::Result<()> {
    // 30 s, and a second more per 1,000 Services (reading the state file).
    let services = lab.scale.lock().unwrap_or_else(|e| e.into_inner()).0;
    let limit = Duration::from_secs(30 + u64::from(services) / 1000);
    let end = Instant::now() + limit;
    let addr: SocketAddr = HEALTHZ.parse()?;
    loop {
        lab.stop.check()?;
        if !p.running() {
            bail!("kxp run exited before becoming healthy:\n{}", p.log_text());
        }
        let ok = lab::healthz_ok(&lab.router, addr)?;
        if ok {
            return Ok(());
        }
        if Instant::now() > end {
            bail!("kxp run not healthy after {limit:?}:\n{}", p.log_text());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Lab {
    /// napi_defer_hard_irqs / gro_flush_timeout of the router's veths (for busy polling).
    fn napi_knobs(&self, defer: u32, gro_ns: u32) -> anyhow::Result<()> {
        let (rg, rb) = (&self.rg, &self.rb);
        sh_in(
            &self.router,
            &format!(
                "for d in {rg} {rb}; do echo {defer} > /sys/class/net/$d/napi_defer_hard_irqs; echo {gro_ns} > /sys/class/net/$d/gro_flush_timeout; done"
            ),
        )?;
        Ok(())
    }

    /// Threaded NAPI on the router's veths, the NAPI kthreads pinned to the router CPU.
    fn threaded_napi(&self) -> anyhow::Result<()> {
        let (rg, rb) = (&self.rg, &self.rb);
        sh_in(
            &self.router,
            &format!(
                "echo 1 > /sys/class/net/{rg}/threaded; echo 1 > /sys/class/net/{rb}/threaded"
            ),
        )?;
        std::thread::sleep(Duration::from_millis(100));
        let mut pinned = 0;
        for t in dataplane::napi::threads_of(&[rg.clone(), rb.clone()]) {
            let o = Command::new("taskset")
                .args(["-pc", &ROUTER_CPU.to_string(), &t.pid.to_string()])
                .output()?;
            if o.status.success() {
                pinned += 1;
            }
        }
        if pinned == 0 {
            bail!("threaded NAPI: no napi/{rg}-* kthread found");
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Latency probes.

fn realtime_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

#[derive(Debug, Clone)]
struct Latency {
    hist: Histogram<u64>,
    sent: u64,
    got: u64,
    /// Probes without a kernel timestamp (user-space receive time used instead).
    no_kernel_ts: u64,
    /// The most time the hypervisor took from either CPU while the probes ran (steal,
    /// % of that CPU's time): a VM's vCPU preempted stalls every router alike.
    steal_pct: f64,
}

impl Latency {
    fn empty() -> Latency {
        Latency {
            hist: Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds"),
            sent: 0,
            got: 0,
            no_kernel_ts: 0,
            steal_pct: 0.0,
        }
    }
    fn loss_pct(&self) -> f64 {
        if self.sent == 0 {
            return 0.0;
        }
        100.0 * (self.sent.saturating_sub(self.got)) as f64 / self.sent as f64
    }
    fn us(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1e3
    }
    fn summary(&self) -> String {
        if self.hist.is_empty() {
            return format!("no probe arrived ({} sent)", self.sent);
        }
        format!(
            "p50 {:.0} p90 {:.0} p99 {:.0} p99.9 {:.0} max {:.0} µs; {}/{} probes ({:.1}% lost); {:.1}% stolen",
            self.us(0.5),
            self.us(0.9),
            self.us(0.99),
            self.us(0.999),
            self.hist.max() as f64 / 1e3,
            self.got,
            self.sent,
            self.loss_pct(),
            self.steal_pct
        )
    }
}

/// A running probe: a sender in the generator namespace (CPU0) sending timestamped
/// datagrams to VIP:7000 at `rate`, a receiver in the backend namespace. Both threads
/// end by themselves after `max` (plus a short drain) even if nobody stops them.
struct Probe {
    stop: Arc<AtomicBool>,
    /// The CPUs' times when it started (for the steal over its window).
    cpu_at_start: Vec<[u64; 8]>,
    tx: Option<JoinHandle<anyhow::Result<anyhow::Result<u64>>>>,
    rx: Option<JoinHandle<anyhow::Result<anyhow::Result<Latency>>>>,
}

fn join_probe<T>(h: Option<JoinHandle<anyhow::Result<anyhow::Result<T>>>>) -> anyhow::Result<T> {
    let h = h.context("probe thread missing")?;
    h.join()
        .map_err(|_| anyhow::anyhow!("probe thread panicked"))??
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

const PROBE_MAGIC: u32 = 0x6b78_6d62;

impl Probe {
    fn start(lab: &Lab, rate: u32, max: Duration) -> anyhow::Result<Probe> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<io::Result<()>>();
        let stop_rx = stop.clone();
        let rx = lab::spawn_in(&lab.back, move || -> anyhow::Result<Latency> {
            let _ = dataplane::sys::pin_to_cpu(GEN_CPU);
            let sock = match UdpSocket::bind(("0.0.0.0", PROBE_PORT)).and_then(|s| {
                dataplane::sys::enable_rx_timestamps(s.as_raw_fd())?;
                s.set_read_timeout(Some(Duration::from_millis(20)))?;
                Ok(s)
            }) {
                Ok(s) => {
                    let _ = ready_tx.send(Ok(()));
                    s
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    bail!("probe receiver cannot listen");
                }
            };
            let mut lat = Latency::empty();
            let mut buf = [0u8; 64];
            let hard_end = Instant::now() + max + Duration::from_secs(1);
            let mut drain_until: Option<Instant> = None;
            loop {
                let now = Instant::now();
                if drain_until.is_none() && stop_rx.load(Ordering::Relaxed) {
                    drain_until = Some(now + Duration::from_millis(200));
                }
                if drain_until.is_some_and(|d| now > d) || now > hard_end {
                    break;
                }
                if let Ok((n, ts)) = dataplane::sys::recv_with_timestamp(sock.as_raw_fd(), &mut buf)
                    && n >= 16
                    && u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) == PROBE_MAGIC
                {
                    let mut t = [0u8; 8];
                    t.copy_from_slice(&buf[8..16]);
                    let sent_at = u64::from_be_bytes(t);
                    let arrived = ts.unwrap_or_else(|| {
                        lat.no_kernel_ts += 1;
                        realtime_ns()
                    });
                    lat.got += 1;
                    let _ = lat.hist.record(arrived.saturating_sub(sent_at).max(1));
                }
            }
            Ok(lat)
        });
        let mut probe = Probe {
            stop: stop.clone(),
            cpu_at_start: cpu_times(),
            tx: None,
            rx: Some(rx),
        };
        match ready_rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => bail!("probe receiver: {e}"),
            Err(_) => bail!("probe receiver did not start"),
        }
        let stop_tx = stop;
        probe.tx = Some(lab::spawn_in(&lab.genns, move || -> anyhow::Result<u64> {
            let _ = dataplane::sys::pin_to_cpu(GEN_CPU);
            let s = UdpSocket::bind((GEN_IP, PROBE_SPORT)).context("probe sender bind")?;
            s.connect((VIP, PROBE_PORT))?;
            let interval = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
            let start = Instant::now();
            let limit = (max.as_secs_f64() * f64::from(rate)) as u64 + 1;
            let mut sent = 0u64;
            let mut next = start;
            while !stop_tx.load(Ordering::Relaxed) && sent < limit && start.elapsed() < max {
                let mut p = [0u8; 18];
                p[..4].copy_from_slice(&PROBE_MAGIC.to_be_bytes());
                p[4..8].copy_from_slice(&(sent as u32).to_be_bytes());
                p[8..16].copy_from_slice(&realtime_ns().to_be_bytes());
                if s.send(&p).is_ok() {
                    sent += 1;
                }
                next += interval;
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                }
            }
            Ok(sent)
        }));
        Ok(probe)
    }

    fn finish(mut self) -> anyhow::Result<Latency> {
        self.stop.store(true, Ordering::Relaxed);
        let sent = join_probe(self.tx.take());
        let lat = join_probe(self.rx.take());
        let mut lat = lat?;
        lat.sent = sent?;
        lat.steal_pct = cpu_usage(&self.cpu_at_start, &cpu_times())
            .iter()
            .map(|u| u.2)
            .fold(0.0, f64::max);
        Ok(lat)
    }
}

// ---------------------------------------------------------------------------------------
// Runs.

#[derive(Debug, Clone)]
struct RunResult {
    pps: f64,
    /// What trafgen sent per second of its run (the offered load).
    offered: Option<f64>,
    /// (busy %, softirq %, steal %) of CPU0 and CPU1 over the measured window.
    cpu: Vec<(f64, f64, f64)>,
    /// CPU other processes used during the window (% of one CPU).
    foreign: f64,
    /// Packets per second dropped on the way (see [`Lab::drops`]).
    drop_pps: f64,
    /// How long a cache line took to go from CPU0 to CPU1 just before and just after
    /// the run (ns, [`kxp_bench::line_transfer_ns`]): where the hypervisor had put the
    /// two vCPUs.
    line_ns: [Option<f64>; 2],
}

/// Round trips of [`kxp_bench::line_transfer_ns`] before and after each run (a few ms).
const LINE_ROUND_TRIPS: u32 = 20_000;

/// Below this, a line moves between CPU0 and CPU1 within one core's caches: the two
/// vCPUs were on the two threads of one physical core (~15 ns here), sharing its
/// execution units; above, on two cores (55-130 ns here).
const SAME_CORE_NS: f64 = 40.0;

fn line_ns() -> Option<f64> {
    kxp_bench::line_transfer_ns((GEN_CPU, ROUTER_CPU), LINE_ROUND_TRIPS)
}

#[derive(Debug, Default)]
struct ModeResult {
    runs: Vec<RunResult>,
    kxp_totals: Option<String>,
    kernel_conntrack: Option<u64>,
    error: Option<String>,
}

#[derive(Debug)]
struct CaseResult {
    case: Case,
    idle: Option<Latency>,
    modes: Vec<(Mode, ModeResult)>,
    /// The latency phase: one point per mode and offered load.
    loaded: Vec<LoadPoint>,
    error: Option<String>,
}

/// An offered load of the latency phase.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Load {
    /// A share of the slowest router's median rate in that mode, in this run.
    Pct(f64),
    /// Packets per second.
    Pps(f64),
    /// Unpaced: as fast as the generator goes (every router saturated).
    Max,
}

impl Load {
    fn parse(s: &str) -> anyhow::Result<Load> {
        let s = s.trim();
        if s == "max" {
            return Ok(Load::Max);
        }
        if let Some(p) = s.strip_suffix('%') {
            let v: f64 = p.parse().with_context(|| format!("bad load {s:?}"))?;
            if !(v > 0.0 && v <= 1000.0) {
                bail!("load {s:?}: a share must be in (0, 1000]%");
            }
            return Ok(Load::Pct(v));
        }
        let v: f64 = s
            .strip_suffix("Mpps")
            .unwrap_or(s)
            .parse()
            .with_context(|| format!("bad load {s:?} (N%, N Mpps, or max)"))?;
        if !(v > 0.0 && v < 100.0) {
            bail!("load {s:?}: Mpps must be in (0, 100)");
        }
        Ok(Load::Pps(v * 1e6))
    }
    fn label(self) -> String {
        match self {
            Load::Pct(p) => format!("{p}%"),
            Load::Pps(p) => format!("{:.3} Mpps", p / 1e6),
            Load::Max => "max".into(),
        }
    }
}

/// Latency under one offered load.
#[derive(Debug, Clone)]
struct LoadPoint {
    mode: Mode,
    load: Load,
    /// The rate asked of the generator (None: unpaced).
    target: Option<f64>,
    offered: Option<f64>,
    delivered: f64,
    lat: Latency,
}

impl LoadPoint {
    /// The router forwarded less than was offered (2% slack for counting windows).
    fn saturated(&self) -> bool {
        self.offered.is_some_and(|o| self.delivered < 0.98 * o)
    }
}

#[derive(Debug, Clone)]
struct Plan {
    /// `None`: trafgen; `Some(path)`: the AF_XDP generator at `path`.
    xsk_gen: Option<PathBuf>,
    runs: usize,
    rounds: usize,
    secs: f64,
    warm: f64,
    lat_secs: f64,
    probe_rate: u32,
    latency: bool,
    lat_loads: Vec<Load>,
    busy_poll: String,
    kxp: PathBuf,
    kxp_base: Option<PathBuf>,
    quiet_wait: f64,
    quiet_pct: f64,
}

/// trafgen's own account at exit: packets sent per second of its run.
fn trafgen_rate(log: &str) -> Option<f64> {
    let words: Vec<&str> = log.split_whitespace().collect();
    let mut packets = None;
    let mut secs = None;
    for (i, w) in words.iter().enumerate() {
        if *w == "packets" && words.get(i + 1) == Some(&"outgoing") && i > 0 {
            packets = words[i - 1].parse::<f64>().ok();
        }
        if *w == "sec," && i > 0 && words.get(i + 2).is_some_and(|u| u.starts_with("usec")) {
            let s = words[i - 1].parse::<f64>().ok();
            let us = words[i + 1].parse::<f64>().ok();
            if let (Some(s), Some(us)) = (s, us) {
                secs = Some(s + us / 1e6);
            }
        }
    }
    match (packets, secs) {
        (Some(p), Some(s)) if s > 0.0 => Some(p / s),
        _ => None,
    }
}

/// Waits (up to `plan.quiet_wait`) until other processes use less than
/// `plan.quiet_pct` of a CPU over half a second; returns what they used last.
fn wait_quiet(lab: &Lab, plan: &Plan, ours: &[u32]) -> anyhow::Result<f64> {
    let end = Instant::now() + Duration::from_secs_f64(plan.quiet_wait);
    let mut waited = false;
    loop {
        let a = foreign_ticks(ours);
        lab.stop.sleep(Duration::from_millis(500))?;
        let pct = foreign_pct(&a, &foreign_ticks(ours), 0.5);
        if pct < plan.quiet_pct || Instant::now() >= end {
            if waited {
                eprintln!("  (waited for other work: now {pct:.0}% of a CPU)");
            }
            return Ok(pct);
        }
        waited = true;
    }
}

/// How a run is measured: with latency probes or not, at a paced rate (packets/s) or
/// unpaced.
#[derive(Debug, Clone, Copy)]
struct Probed {
    probe: bool,
    rate: Option<f64>,
}

fn run_once(
    lab: &Lab,
    cfg: &Path,
    mode: Mode,
    plan: &Plan,
    tag: &str,
    ours: &[u32],
    probed: Probed,
) -> anyhow::Result<(RunResult, Option<Latency>)> {
    let Probed { probe, rate } = probed;
    wait_quiet(lab, plan, ours)?;
    // The placement is kept for the rate runs (the latency phases report none).
    let placed = !probe;
    let line_before = if placed { line_ns() } else { None };
    // Many established flows: the first pass through them is new connections; the
    // window starts once every flow exists (at 0.25 Mpps, a conservative pace).
    let flows = lab.scale.lock().unwrap_or_else(|e| e.into_inner()).1;
    let warm = if mode == Mode::Est && flows > 100_000 {
        plan.warm + f64::from(flows) / 250_000.0
    } else {
        plan.warm
    };
    let max_packets = ((warm + plan.secs + 5.0) * 5e6) as u64;
    let mut tg = lab.start_trafgen(cfg, mode, plan, max_packets, tag, rate)?;
    let mut ours = ours.to_vec();
    ours.push(tg.child.id());
    lab.stop.sleep(Duration::from_secs_f64(warm))?;
    if !tg.running() {
        bail!("trafgen exited early:\n{}", tg.log_text());
    }
    let probe = if probe {
        Some(Probe::start(
            lab,
            plan.probe_rate,
            Duration::from_secs_f64(plan.secs + 1.0),
        )?)
    } else {
        None
    };
    let d0 = lab.drops();
    let (c0, t0) = lab.delivered()?;
    let cpu0 = cpu_times();
    let f0 = foreign_ticks(&ours);
    lab.stop.sleep(Duration::from_secs_f64(plan.secs))?;
    let (c1, t1) = lab.delivered()?;
    let cpu1 = cpu_times();
    let d1 = lab.drops();
    let foreign = foreign_pct(&f0, &foreign_ticks(&ours), (t1 - t0).as_secs_f64());
    let lat = probe.map(Probe::finish).transpose()?;
    tg.stop(libc::SIGINT, Duration::from_secs(5));
    let offered = trafgen_rate(&tg.log_text());
    // Let the queues drain before the next run.
    lab.stop.sleep(Duration::from_millis(300))?;
    let line_after = if placed { line_ns() } else { None };
    let pps = c1.saturating_sub(c0) as f64 / (t1 - t0).as_secs_f64();
    Ok((
        RunResult {
            pps,
            offered,
            cpu: cpu_usage(&cpu0, &cpu1),
            foreign,
            drop_pps: d1.saturating_sub(d0) as f64 / (t1 - t0).as_secs_f64(),
            line_ns: [line_before, line_after],
        },
        lat,
    ))
}

fn run_mode(
    lab: &Lab,
    router: &Router<'_>,
    mode: Mode,
    plan: &Plan,
    out: &mut ModeResult,
) -> anyhow::Result<()> {
    let cfg = lab.trafgen_cfg(mode)?;
    let name = router.case.name();
    let ours = router.kxp_pids();
    for i in 0..plan.runs {
        let (r, _) = run_once(
            lab,
            &cfg,
            mode,
            plan,
            &format!("{name}-{}-{i}", mode.name()),
            &ours,
            Probed {
                probe: false,
                rate: None,
            },
        )?;
        eprintln!(
            "  {name:<13} {} run {}: {:.3} Mpps delivered (trafgen offered {}, {:.3} Mpps dropped on the way), CPU0 {:.0}% CPU1 {:.0}% busy ({:.0}% {:.0}% stolen), others {:.0}% of a CPU, a line CPU0 -> CPU1 in {} ns before/after",
            mode.name(),
            i + 1,
            r.pps / 1e6,
            r.offered
                .map_or("?".to_string(), |o| format!("{:.3} Mpps", o / 1e6)),
            r.drop_pps / 1e6,
            r.cpu.first().map_or(0.0, |c| c.0),
            r.cpu.get(1).map_or(0.0, |c| c.0),
            r.cpu.first().map_or(0.0, |c| c.2),
            r.cpu.get(1).map_or(0.0, |c| c.2),
            r.foreign,
            r.line_ns
                .map(|x| x.map_or("?".into(), |ns| format!("{ns:.0}")))
                .join("/"),
        );
        out.runs.push(r);
    }
    if matches!(router.case.kind(), Case::Nft | Case::Ipt) {
        out.kernel_conntrack = stdout_of(in_ns(
            &lab.router,
            &["cat", "/proc/sys/net/netfilter/nf_conntrack_count"],
        ))
        .ok()
        .and_then(|s| s.trim().parse().ok());
    }
    Ok(())
}

fn run_case(lab: &Lab, case: Case, modes: &[Mode], plan: &Plan) -> CaseResult {
    let mut res = CaseResult {
        case,
        idle: None,
        modes: Vec::new(),
        loaded: Vec::new(),
        error: None,
    };
    eprintln!("case {}: {}", case.name(), case.describe());
    for &mode in modes {
        if lab.stop.check().is_err() {
            break;
        }
        if case.flows() == 1_000_000 && mode == Mode::New {
            // New connections do not depend on the table's fill: that is kxp's `new`.
            continue;
        }
        let mut out = ModeResult::default();
        // Set up per mode: kxp starts afresh (empty connection table, its own totals).
        let bin = match (case, &plan.kxp_base) {
            (c, Some(b)) if c.is_base() => b,
            _ => &plan.kxp,
        };
        let router = match Router::setup(
            lab,
            case,
            bin,
            &plan.busy_poll,
            &format!("{}-{}", case.name(), mode.name()),
        ) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("  {}: setup failed: {e:#}", case.name());
                res.error = Some(format!("{e:#}"));
                break;
            }
        };
        if let Err(e) = run_mode(lab, &router, mode, plan, &mut out) {
            eprintln!("  {} {}: {e:#}", case.name(), mode.name());
            out.error = Some(format!("{e:#}"));
        }
        if case.is_kxp() {
            let _ = router.kxp_totals();
            out.kxp_totals = router.finish();
            if let Some(t) = &out.kxp_totals {
                eprintln!("  {:<13} {} kxp {t}", case.name(), mode.name());
            }
        } else {
            drop(router);
        }
        res.modes.push((mode, out));
    }
    res
}

/// Adds a later round's runs of a case to its earlier ones (per mode; the last round's
/// kxp totals; the first error).
fn merge_rounds(into: &mut CaseResult, later: CaseResult) {
    for (mode, mr) in later.modes {
        match into.modes.iter_mut().find(|(m, _)| *m == mode) {
            Some((_, have)) => {
                have.runs.extend(mr.runs);
                if mr.kxp_totals.is_some() {
                    have.kxp_totals = mr.kxp_totals;
                }
                have.kernel_conntrack = mr.kernel_conntrack.or(have.kernel_conntrack);
                if have.error.is_none() {
                    have.error = mr.error;
                }
            }
            None => into.modes.push((mode, mr)),
        }
    }
    if into.error.is_none() {
        into.error = later.error;
    }
}

/// The latency phase of one case: with no load (once), then under each offered load
/// of `plan.lat_loads` in each mode; `reference` is, per mode, the rate the `N%` loads
/// are shares of.
fn run_latency(
    lab: &Lab,
    res: &mut CaseResult,
    modes: &[Mode],
    plan: &Plan,
    reference: &[(Mode, f64)],
) {
    let case = res.case;
    eprintln!("case {}: latency", case.name());
    for (mi, &mode) in modes.iter().enumerate() {
        if lab.stop.check().is_err() {
            return;
        }
        if case.flows() == 1_000_000 && mode == Mode::New {
            continue;
        }
        let bin = match (case, &plan.kxp_base) {
            (c, Some(b)) if c.is_base() => b,
            _ => &plan.kxp,
        };
        let tag = format!("{}-{}-lat", case.name(), mode.name());
        let router = match Router::setup(lab, case, bin, &plan.busy_poll, &tag) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("  {}: setup failed: {e:#}", case.name());
                res.error.get_or_insert(format!("{e:#}"));
                return;
            }
        };
        if mi == 0 {
            let idle = Probe::start(lab, plan.probe_rate, Duration::from_secs_f64(plan.lat_secs))
                .and_then(|p| {
                    lab.stop.sleep(Duration::from_secs_f64(plan.lat_secs))?;
                    p.finish()
                });
            match idle {
                Ok(l) => {
                    eprintln!("  {:<13} latency, no load: {}", case.name(), l.summary());
                    res.idle = Some(l);
                }
                Err(e) => eprintln!("  {}: idle latency failed: {e:#}", case.name()),
            }
        }
        let ours = router.kxp_pids();
        let cfg = match lab.trafgen_cfg(mode) {
            Ok(c) => c,
            Err(e) => {
                res.error.get_or_insert(format!("{e:#}"));
                return;
            }
        };
        let lat_plan = Plan {
            secs: plan.lat_secs,
            ..plan.clone()
        };
        let base = reference.iter().find(|(m, _)| *m == mode).map(|r| r.1);
        for &load in &plan.lat_loads {
            let target = match load {
                Load::Max => None,
                Load::Pps(p) => Some(p),
                Load::Pct(p) => match base {
                    Some(b) => Some(b * p / 100.0),
                    None => continue,
                },
            };
            let r = run_once(
                lab,
                &cfg,
                mode,
                &lat_plan,
                &format!("{tag}-{}", load.label().replace([' ', '%'], "")),
                &ours,
                Probed {
                    probe: true,
                    rate: target,
                },
            );
            match r {
                Ok((r, Some(lat))) => {
                    let point = LoadPoint {
                        mode,
                        load,
                        target,
                        offered: r.offered,
                        delivered: r.pps,
                        lat,
                    };
                    eprintln!(
                        "  {:<13} {} latency at {} (offered {}, delivered {:.3} Mpps, {:.0} packets/s dropped on the way{}): {}",
                        case.name(),
                        mode.name(),
                        load.label(),
                        r.offered.map_or("?".into(), |o| format!("{:.3}", o / 1e6)),
                        r.pps / 1e6,
                        r.drop_pps,
                        if point.saturated() { ", saturated" } else { "" },
                        point.lat.summary()
                    );
                    res.loaded.push(point);
                }
                Ok((_, None)) => {}
                Err(e) => {
                    eprintln!(
                        "  {} {} at {}: {e:#}",
                        case.name(),
                        mode.name(),
                        load.label()
                    );
                    res.error.get_or_insert(format!("{e:#}"));
                }
            }
        }
        if case.is_kxp() {
            if let Some(t) = router.finish() {
                eprintln!(
                    "  {:<13} {} latency phase, kxp {t}",
                    case.name(),
                    mode.name()
                );
            }
        } else {
            drop(router);
        }
    }
}

/// Per mode, the slowest router's median rate among `results`, the scale cases left out
/// (what `N%` loads are shares of).
fn reference_rates(results: &[CaseResult], modes: &[Mode]) -> Vec<(Mode, f64)> {
    modes
        .iter()
        .filter_map(|&m| {
            results
                .iter()
                .filter(|c| c.case.services() == 1 && c.case.flows() == 1024)
                .filter_map(|c| med_pps(c, m))
                .filter(|&p| p > 0.0)
                .min_by(|a, b| a.total_cmp(b))
                .map(|p| (m, p))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Report.

/// The median: of an even count, the mean of the two middle values (until 2026-12-03 the
/// upper of them, which favoured whichever case had the bigger lead in a few runs).
fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let mid = s.len() / 2;
    Some(if s.len().is_multiple_of(2) {
        (s[mid - 1] + s[mid]) / 2.0
    } else {
        s[mid]
    })
}

fn mode_of(c: &CaseResult, m: Mode) -> Option<&ModeResult> {
    c.modes.iter().find(|(mm, _)| *mm == m).map(|(_, r)| r)
}

/// Where the hypervisor had the two vCPUs during a run, from the line transfers measured
/// before and after it: the two threads of one core (sharing its execution units), two
/// cores, or moved during the run (or not measured).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    OneCore,
    TwoCores,
    Moved,
}

fn placement(r: &RunResult) -> Placement {
    match r.line_ns {
        [Some(a), Some(b)] if a < SAME_CORE_NS && b < SAME_CORE_NS => Placement::OneCore,
        [Some(a), Some(b)] if a >= SAME_CORE_NS && b >= SAME_CORE_NS => Placement::TwoCores,
        _ => Placement::Moved,
    }
}

/// Each case's median rate per mode over the runs of each vCPU placement: on a VM the
/// placement changes now and then, and two binaries compared on runs of different
/// placements may differ by it.
fn print_placement(results: &[CaseResult], modes: &[Mode]) {
    let runs = results
        .iter()
        .flat_map(|c| c.modes.iter().flat_map(|(_, r)| r.runs.iter()));
    let one_core = runs
        .clone()
        .filter(|r| placement(r) == Placement::OneCore)
        .count();
    if runs.count() == 0 {
        return;
    }
    println!();
    println!(
        "vCPU placement: {one_core} run(s) had CPU0 and CPU1 on the two threads of one core (a line moved between them in under {SAME_CORE_NS:.0} ns before and after the run), the others on two cores or moved during the run; median Mpps (runs) per placement:"
    );
    let mut head = format!("{:<13}", "router");
    for m in modes {
        head += &format!(
            " | {:<40}",
            format!("{}: one core / two cores / moved", m.name())
        );
    }
    println!("{head}");
    for c in results {
        let mut row = format!("{:<13}", c.case.name());
        for &m in modes {
            let cells: Vec<String> = [Placement::OneCore, Placement::TwoCores, Placement::Moved]
                .iter()
                .map(|&p| {
                    let v: Vec<f64> = mode_of(c, m)
                        .map(|r| {
                            r.runs
                                .iter()
                                .filter(|x| placement(x) == p)
                                .map(|x| x.pps / 1e6)
                                .collect()
                        })
                        .unwrap_or_default();
                    median(&v).map_or("-".into(), |med| format!("{med:.3} ({})", v.len()))
                })
                .collect();
            row += &format!(" | {:<40}", cells.join(" / "));
        }
        println!("{row}");
    }
}

fn med_pps(c: &CaseResult, m: Mode) -> Option<f64> {
    mode_of(c, m).and_then(|r| median(&r.runs.iter().map(|x| x.pps).collect::<Vec<_>>()))
}

fn cell(c: &CaseResult, m: Mode) -> String {
    let Some(r) = mode_of(c, m) else {
        return "-".into();
    };
    let v: Vec<f64> = r.runs.iter().map(|x| x.pps / 1e6).collect();
    match median(&v) {
        None => "failed".into(),
        Some(med) if v.len() > 1 => {
            let lo = v.iter().copied().fold(f64::MAX, f64::min);
            let hi = v.iter().copied().fold(0.0, f64::max);
            format!("{med:.3} [{lo:.3}-{hi:.3}]")
        }
        Some(med) => format!("{med:.3}"),
    }
}

fn offered_cell(c: &CaseResult, m: Mode) -> String {
    let Some(r) = mode_of(c, m) else {
        return "-".into();
    };
    let off = median(&r.runs.iter().filter_map(|x| x.offered).collect::<Vec<_>>());
    let drop = median(&r.runs.iter().map(|x| x.drop_pps).collect::<Vec<_>>());
    match (off, drop) {
        (Some(o), Some(d)) => format!("{:.2}/{:.2}", o / 1e6, d / 1e6),
        (None, Some(d)) => format!("?/{:.2}", d / 1e6),
        _ => "-".into(),
    }
}

fn cpu_cell(c: &CaseResult, m: Mode) -> String {
    let Some(r) = mode_of(c, m).and_then(|r| r.runs.last()) else {
        return "-".into();
    };
    r.cpu
        .iter()
        .take(2)
        .map(|(b, si, st)| format!("{b:.0}/{si:.0}/{st:.0}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn foreign_cell(c: &CaseResult) -> String {
    let v: Vec<f64> = c
        .modes
        .iter()
        .flat_map(|(_, r)| r.runs.iter().map(|x| x.foreign))
        .collect();
    if v.is_empty() {
        return "-".into();
    }
    format!("{:.0}", v.iter().copied().fold(0.0, f64::max))
}

fn lat_cell(l: Option<&Latency>) -> String {
    match l {
        Some(l) if !l.hist.is_empty() => format!(
            "{:.0}/{:.0}/{:.0} ({:.0}%){}",
            l.us(0.5),
            l.us(0.99),
            l.us(0.999),
            l.loss_pct(),
            if l.steal_pct >= 1.0 {
                format!(" st{:.0}%", l.steal_pct)
            } else {
                String::new()
            }
        ),
        Some(l) => format!("none of {}", l.sent),
        None => "-".into(),
    }
}

fn report(results: &[CaseResult], modes: &[Mode], plan: &Plan, load: (&str, &str)) {
    println!();
    println!(
        "macro-bench: {} x {:.1} s per case and mode (median [min-max]); 64-byte UDP (60 B + FCS) to {VIP}:{SINK_PORT};",
        if plan.rounds > 1 {
            format!(
                "{} run(s) in each of {} interleaved rounds",
                plan.runs, plan.rounds
            )
        } else {
            format!("{} run(s)", plan.runs)
        },
        plan.secs
    );
    println!(
        "generator {} on CPU{GEN_CPU}, router on CPU{ROUTER_CPU}; Mpps = packets/s counted at the backend's interface",
        if plan.xsk_gen.is_some() {
            "xsk-gen (AF_XDP, batches of 64)"
        } else {
            "trafgen -t 0"
        }
    );
    println!(
        "load average before {} / after {}; offered = trafgen's own count, dropped = lost before the backend (Mpps); CPU busy/softirq/steal % over the last est. run (busy includes steal: time the hypervisor gave the vCPU to another guest); others = most CPU (% of one) other processes used in any run",
        load.0, load.1
    );
    println!();
    println!(
        "{:<13} | {:<24} | {:<24} | {:<21} | {:<21} | others",
        "router",
        "est. flows (1,024) Mpps",
        "new conn/packet Mpps",
        "offered/dropped e; n",
        "CPU0 CPU1 busy/si/st%",
    );
    println!("{}", "-".repeat(120));
    for c in results {
        let est = if modes.contains(&Mode::Est) {
            cell(c, Mode::Est)
        } else {
            "-".into()
        };
        let new = if modes.contains(&Mode::New) {
            cell(c, Mode::New)
        } else {
            "-".into()
        };
        println!(
            "{:<13} | {:<24} | {:<24} | {:<21} | {:<21} | {}",
            c.case.name(),
            est,
            new,
            format!(
                "{}; {}",
                offered_cell(c, Mode::Est),
                offered_cell(c, Mode::New)
            ),
            cpu_cell(c, Mode::Est),
            foreign_cell(c)
        );
    }
    let find = |k: Case| results.iter().find(|c| c.case == k);
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    };
    println!();
    for k in results.iter().filter(|c| c.case.is_kxp()) {
        // The kernel's cases with as many Services (none at 100,000).
        let kernel = |one: Case, at_10k: Case| match k.case.services() {
            1 => Some(one),
            SCALE_SERVICES => Some(at_10k),
            _ => None,
        };
        for (base, bname) in [
            (kernel(Case::Nft, Case::Nft10k), "kernel nft DNAT"),
            (kernel(Case::Ipt, Case::Ipt10k), "kernel iptables DNAT"),
            (Some(Case::Plain), "plain forwarding"),
            (
                // A baseline case against the baseline binary's one-Service case.
                Some(if k.case.is_base() {
                    Case::KxpBase
                } else {
                    Case::Kxp
                }),
                "kxp, 1 Service",
            ),
        ] {
            let Some(base) = base else { continue };
            if base == k.case {
                continue;
            }
            if let Some(b) = find(base) {
                println!(
                    "ratio {:<13} / {:<20}: est {}  new {}",
                    k.case.name(),
                    bname,
                    ratio(med_pps(k, Mode::Est), med_pps(b, Mode::Est)),
                    ratio(med_pps(k, Mode::New), med_pps(b, Mode::New))
                );
            }
        }
    }
    // What 8 queues cost the lab itself (the generator's side, CPU0: eight NAPI
    // instances, eight sockets' fill rings): the kxp-8q case's ratio beside the kernel's.
    for (a, b) in [
        (Case::Plain8q, Case::Plain),
        (Case::Kxp8q, Case::Plain8q),
        (Case::Kxp8q, Case::Kxp8qBase),
        (Case::Kxp, Case::KxpBase),
        (Case::Kxp10k, Case::Kxp10kBase),
        (Case::Kxp100k, Case::Kxp100kBase),
        (Case::KxpPol, Case::Kxp),
        (Case::KxpKernelPol, Case::Kxp),
        (Case::KxpKernelPol, Case::Nft),
    ] {
        if let (Some(x), Some(y)) = (find(a), find(b)) {
            println!(
                "ratio {:<13} / {:<20}: est {}  new {}",
                a.name(),
                b.name(),
                ratio(med_pps(x, Mode::Est), med_pps(y, Mode::Est)),
                ratio(med_pps(x, Mode::New), med_pps(y, Mode::New))
            );
        }
    }
    print_placement(results, modes);
    if plan.latency {
        println!();
        println!(
            "one-way latency generator -> backend through the VIP, µs p50/p99/p99.9 (probe loss) and stN% when the hypervisor stole N% (the most of either CPU) while the probes ran, {} probes/s; loads offered (Mpps) as shares of the slowest router's rate per mode (* = the router forwarded less than offered):",
            plan.probe_rate
        );
        println!("{:<13} | {:<24}", "router", "no load");
        for c in results {
            println!("{:<13} | {}", c.case.name(), lat_cell(c.idle.as_ref()));
        }
        for &m in modes {
            let points: Vec<&LoadPoint> = results
                .iter()
                .flat_map(|c| c.loaded.iter())
                .filter(|p| p.mode == m)
                .collect();
            if points.is_empty() {
                continue;
            }
            let loads: Vec<Load> = plan.lat_loads.clone();
            println!();
            let mut head = format!("{:<13}", format!("{} load", m.name()));
            // A load given more than once has a column per time it ran.
            let nth = |k: usize| loads[..k].iter().filter(|x| **x == loads[k]).count();
            for (k, l) in loads.iter().enumerate() {
                let tgt = points
                    .iter()
                    .filter(|p| p.load == *l)
                    .nth(nth(k))
                    .and_then(|p| p.target)
                    .map_or(String::new(), |t| format!(" ({:.3})", t / 1e6));
                head += &format!(" | {:<30}", format!("{}{tgt}", l.label()));
            }
            println!("{head}");
            for c in results {
                let mut row = format!("{:<13}", c.case.name());
                for (k, l) in loads.iter().enumerate() {
                    let cell = c
                        .loaded
                        .iter()
                        .filter(|p| p.mode == m && p.load == *l)
                        .nth(nth(k))
                        .map_or("-".into(), |p| {
                            format!(
                                "{}{} @{:.3}",
                                lat_cell(Some(&p.lat)),
                                if p.saturated() { "*" } else { "" },
                                p.delivered / 1e6
                            )
                        });
                    row += &format!(" | {cell:<30}");
                }
                println!("{row}");
            }
        }
    }
    println!();
    for c in results {
        for (m, r) in &c.modes {
            if let Some(t) = &r.kxp_totals {
                println!("{} {}: {t}", c.case.name(), m.name());
            }
            if let Some(n) = r.kernel_conntrack {
                println!(
                    "{} {}: kernel conntrack entries at the end: {n}",
                    c.case.name(),
                    m.name()
                );
            }
            if let Some(e) = &r.error {
                println!("{} {}: ERROR {e}", c.case.name(), m.name());
            }
        }
        if let Some(e) = &c.error {
            println!("{}: ERROR {e}", c.case.name());
        }
    }
}

// ---------------------------------------------------------------------------------------

fn have(prog: &str, arg: &str) -> bool {
    Command::new(prog)
        .arg(arg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

fn read_results(p: &Path) -> anyhow::Result<kxp_bench::results::Results> {
    let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{} is not a macro-bench result file", p.display()))
}

fn lat_out(l: &Latency) -> kxp_bench::results::Latency {
    let q = |x: f64| if l.hist.is_empty() { 0.0 } else { l.us(x) };
    kxp_bench::results::Latency {
        sent: l.sent,
        got: l.got,
        loss_pct: l.loss_pct(),
        p50_us: q(0.5),
        p90_us: q(0.9),
        p99_us: q(0.99),
        p999_us: q(0.999),
        max_us: if l.hist.is_empty() {
            0.0
        } else {
            l.hist.max() as f64 / 1e3
        },
        quantiles: if l.hist.is_empty() {
            Vec::new()
        } else {
            kxp_bench::results::QUANTILES
                .iter()
                .map(|&x| (x, q(x)))
                .collect()
        },
        steal_pct: l.steal_pct,
    }
}

/// The run as a result file.
fn results_of(
    results: &[CaseResult],
    plan: &Plan,
    load: (&str, &str),
) -> kxp_bench::results::Results {
    use kxp_bench::results as r;
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    r::Results {
        version: r::VERSION,
        date,
        command: std::env::args().collect(),
        machine: r::Machine {
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
            cpu_model,
            // (this thread is pinned to one CPU by now: count them all)
            cpus: std::fs::read_to_string("/proc/cpuinfo")
                .unwrap_or_default()
                .lines()
                .filter(|l| l.starts_with("processor"))
                .count(),
            load_before: load.0.to_string(),
            load_after: load.1.to_string(),
        },
        generator: if plan.xsk_gen.is_some() {
            "xsk"
        } else {
            "trafgen"
        }
        .into(),
        runs: plan.runs,
        rounds: plan.rounds,
        secs: plan.secs,
        probe_rate: plan.probe_rate,
        cases: results
            .iter()
            .map(|c| r::Case {
                name: c.case.name().into(),
                describe: c.case.describe().into(),
                modes: c
                    .modes
                    .iter()
                    .map(|(m, mr)| r::Mode {
                        mode: m.name().into(),
                        median_pps: med_pps(c, *m),
                        runs: mr
                            .runs
                            .iter()
                            .map(|x| r::Run {
                                pps: x.pps,
                                offered_pps: x.offered,
                                drop_pps: x.drop_pps,
                                cpu: x.cpu.iter().map(|c| (c.0, c.1)).collect(),
                                steal_pct: x.cpu.iter().map(|c| c.2).collect(),
                                foreign_pct: x.foreign,
                                line_ns: x.line_ns.to_vec(),
                            })
                            .collect(),
                        kxp_totals: mr.kxp_totals.clone(),
                        kernel_conntrack: mr.kernel_conntrack,
                        error: mr.error.clone(),
                    })
                    .collect(),
                idle: c.idle.as_ref().map(lat_out),
                loaded: c
                    .loaded
                    .iter()
                    .map(|p| r::LoadPoint {
                        mode: p.mode.name().into(),
                        load: p.load.label(),
                        target_pps: p.target,
                        offered_pps: p.offered,
                        delivered_pps: p.delivered,
                        saturated: p.saturated(),
                        latency: lat_out(&p.lat),
                    })
                    .collect(),
                error: c.error.clone(),
            })
            .collect(),
    }
}

/// Writes the result file and its chart into `dir`; returns their paths.
fn write_results(
    res: &kxp_bench::results::Results,
    dir: &Path,
) -> anyhow::Result<(PathBuf, PathBuf)> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let stem = format!("macro-{}", res.date.replace(['-', ':'], ""));
    let json = dir.join(format!("{stem}.json"));
    std::fs::write(&json, serde_json::to_string_pretty(res)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let svg = dir.join(format!("{stem}.svg"));
    kxp_bench::chart::render(res, &svg).map_err(|e| anyhow::anyhow!(e))?;
    Ok((json, svg))
}

fn real_main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(ab) = &args.compare {
        let (a, b) = (read_results(&ab[0])?, read_results(&ab[1])?);
        print!("{}", kxp_bench::results::compare(&a, &b));
        return Ok(());
    }
    if let Some(p) = &args.chart {
        let res = read_results(p)?;
        let svg = p.with_extension("svg");
        kxp_bench::chart::render(&res, &svg).map_err(|e| anyhow::anyhow!(e))?;
        println!("chart: {}", svg.display());
        return Ok(());
    }
    let _ = KXP_ARGS.set(args.kxp_args.clone());
    if !dataplane::sys::is_root() {
        bail!("macro-bench creates network namespaces and attaches XDP programs: run it as root");
    }
    for (p, a) in [
        ("trafgen", "-v"),
        ("nft", "-v"),
        ("taskset", "-V"),
        ("ip", "-V"),
    ] {
        if !have(p, a) {
            bail!(
                "{p} not found: run bash tests/install-deps.sh (Debian: netsniff-ng, nftables, util-linux, iproute2)"
            );
        }
    }
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    if ncpu <= ROUTER_CPU {
        bail!("need at least 2 CPUs (generator on CPU{GEN_CPU}, router on CPU{ROUTER_CPU})");
    }
    // The benchmark's own work (reading the counters with `ip netns exec nft ...`, its
    // threads) stays on the generator's CPU, and so does every process it starts unless
    // pinned elsewhere: a counter read that lands on the router's CPU takes it from the
    // router for a millisecond or more, which shows as latency of whatever router runs.
    dataplane::sys::pin_to_cpu(GEN_CPU).context("pinning the benchmark to the generator's CPU")?;
    let mut cases: Vec<Case> = args
        .cases
        .iter()
        .map(|c| Case::parse(c))
        .collect::<anyhow::Result<_>>()?;
    // Threaded NAPI cannot be switched off again on the router's veths (the kernel
    // answers EIO while kxp's XDP program gives them a NAPI, EOPNOTSUPP once it is gone,
    // and the setting stays on the device): the threaded case runs last so that it
    // does not leak into the others.
    cases.sort_by_key(|c| *c == Case::KxpThreaded);
    if cases.iter().any(|c| c.is_base()) && args.kxp_baseline.is_none() {
        bail!(
            "cases kxp-base, kxp-10k-base, kxp-100k-base, kxp-1m-base and kxp-8q-base measure an earlier binary: give --kxp-baseline PATH"
        );
    }
    let modes: Vec<Mode> = args
        .modes
        .iter()
        .map(|m| match m.trim() {
            "est" => Ok(Mode::Est),
            "new" => Ok(Mode::New),
            o => bail!("unknown mode {o:?} (est, new)"),
        })
        .collect::<anyhow::Result<_>>()?;
    let stop = Stop(Arc::new(AtomicBool::new(false)));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.0.clone())?;
    }
    let kxp = if cases.iter().any(|c| c.is_kxp()) {
        kxp_bench::locate_kxp(args.kxp.as_ref())?
    } else {
        PathBuf::new()
    };
    let xsk_gen = match args.generator.as_str() {
        "trafgen" => None,
        "xsk" => {
            let p = std::env::current_exe()?.with_file_name("xsk-gen");
            if !p.exists() {
                bail!(
                    "{} missing: cargo build --release -p kxp-bench --bin xsk-gen",
                    p.display()
                );
            }
            Some(p)
        }
        g => bail!("unknown generator {g:?} (trafgen, xsk)"),
    };
    let plan = Plan {
        xsk_gen,
        runs: args.runs.unwrap_or(if args.quick { 1 } else { 3 }).max(1),
        rounds: args.rounds.max(1),
        secs: args.secs.unwrap_or(if args.quick { 1.0 } else { 3.0 }),
        warm: if args.quick { 0.5 } else { 1.0 },
        lat_secs: if args.quick { 1.0 } else { 2.0 },
        probe_rate: args.probe_rate.clamp(1, 20_000),
        latency: !args.no_latency,
        lat_loads: args
            .lat_loads
            .iter()
            .map(|l| Load::parse(l))
            .collect::<anyhow::Result<_>>()?,
        busy_poll: args.busy_poll.clone(),
        kxp,
        kxp_base: args.kxp_baseline.clone(),
        quiet_wait: args
            .quiet_wait
            .unwrap_or(if args.quick { 0.0 } else { 30.0 }),
        quiet_pct: args.quiet_pct,
    };
    let load_before = loadavg();
    eprintln!(
        "macro-bench: {} CPUs, kernel {}, load average {load_before}; kxp {}",
        ncpu,
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim(),
        plan.kxp.display()
    );
    let lab = Lab::new(stop.clone(), args.keep, args.backend_rps)?;
    eprintln!(
        "topology: {} (trafgen, CPU{GEN_CPU}) -> {} (router, CPU{ROUTER_CPU}) -> {} (3 endpoints)",
        lab.genns, lab.router, lab.back
    );
    if args.restart {
        // Beside its two links, and with 110 idle pod veths attached (a kubelet's pods).
        let r = restart_gaps(&lab, &plan, Case::Kxp)
            .and_then(|()| restart_gaps(&lab, &plan, Case::KxpPods));
        stop.check()?;
        drop(lab);
        return r;
    }
    if let Some(flows) = args.admin_at {
        let r = admin_at_scale(&lab, &plan, flows);
        stop.check()?;
        drop(lab);
        return r;
    }
    let mut results: Vec<CaseResult> = Vec::new();
    // Every case's rates first, then the latency phase, whose paced loads are shares of
    // the slowest router's rate; the threaded case (last: it cannot be undone) does both
    // after the others.
    let (late, early): (Vec<Case>, Vec<Case>) =
        cases.iter().partition(|c| **c == Case::KxpThreaded);
    for group in [early, late] {
        let first = results.len();
        for round in 0..plan.rounds {
            let order: Vec<Case> = if round % 2 == 0 {
                group.clone()
            } else {
                group.iter().rev().copied().collect()
            };
            if plan.rounds > 1 && !group.is_empty() {
                eprintln!("round {} of {}", round + 1, plan.rounds);
            }
            for case in order {
                if stop.check().is_err() {
                    break;
                }
                let r = run_case(&lab, case, &modes, &plan);
                match results[first..].iter_mut().find(|c| c.case == case) {
                    Some(c) => merge_rounds(c, r),
                    None => results.push(r),
                }
            }
        }
        if plan.latency {
            let reference = reference_rates(&results, &modes);
            for res in &mut results[first..] {
                if stop.check().is_err() {
                    break;
                }
                run_latency(&lab, res, &modes, &plan, &reference);
            }
        }
    }
    let load_after = loadavg();
    report(&results, &modes, &plan, (&load_before, &load_after));
    let res = results_of(&results, &plan, (&load_before, &load_after));
    match write_results(&res, &args.out) {
        Ok((json, svg)) => println!("\nresults: {}\nchart:   {}", json.display(), svg.display()),
        Err(e) => eprintln!("macro-bench: cannot write the results: {e:#}"),
    }
    stop.check()?;
    drop(lab);
    Ok(())
}

/// Fills kxp's table with `flows` flows and times the admin commands a user runs
/// against it: the kxp CLI's wall time, process start included.
fn admin_at_scale(lab: &Lab, plan: &Plan, flows: u64) -> anyhow::Result<()> {
    let mut router = Router::setup(lab, Case::Kxp, &plan.kxp, &plan.busy_poll, "admin")?;
    // A table for the flows (one worker), then kxp again with that configuration.
    std::fs::write(
        lab.dir.join("kube-proxy.yaml"),
        format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nclusterCIDR: {CLUSTER_CIDR}\nconntrack:\n  maxPerCore: 32768\n  min: {}\n",
            flows + flows / 10
        ),
    )?;
    router.restart_kxp(false, None, "kxp-admin")?;
    let cfg = lab.trafgen_cfg(Mode::New)?;
    // More packets than flows: the generator offers more than kxp takes.
    let mut tg = lab.start_trafgen(&cfg, Mode::New, plan, flows * 4, "admin", None)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let cli = |args: &[&str]| -> anyhow::Result<(Duration, String)> {
        let t0 = Instant::now();
        let out = Command::new("ip")
            .args(["netns", "exec", &lab.router])
            .arg(&plan.kxp)
            .args(args)
            .output()?;
        let d = t0.elapsed();
        anyhow::ensure!(
            out.status.success(),
            "kxp {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok((d, String::from_utf8_lossy(&out.stdout).into_owned()))
    };
    let entries = || -> u64 {
        cli(&["conntrack", "stats", "-o", "json"])
            .ok()
            .and_then(|(_, o)| serde_json::from_str::<serde_json::Value>(&o).ok())
            .and_then(|v| v[0]["entries"].as_u64())
            .unwrap_or(0)
    };
    while tg.running() && Instant::now() < deadline && entries() < flows {
        lab.stop.sleep(Duration::from_millis(500))?;
    }
    tg.stop(libc::SIGINT, Duration::from_secs(5));
    let held = entries();
    eprintln!("kxp holds {held} flows (asked for {flows})");
    let vip_dport = SINK_PORT.to_string();
    let queries: [(&str, Vec<&str>); 5] = [
        (
            "conntrack list --client IP:PORT (one flow)",
            vec![
                "conntrack",
                "list",
                "--client",
                "198.18.64.7:5000",
                "-o",
                "json",
            ],
        ),
        (
            "conntrack list --protocol TCP (none match)",
            vec!["conntrack", "list", "--protocol", "TCP", "-o", "json"],
        ),
        ("service list", vec!["service", "list", "-o", "json"]),
        ("conntrack stats", vec!["conntrack", "stats", "-o", "json"]),
        (
            "trace --live --sport",
            vec![
                "trace",
                "--live",
                "--src",
                GEN_IP,
                "--sport",
                "5000",
                "--dst",
                VIP,
                "--dport",
                &vip_dport,
                "--protocol",
                "UDP",
                "--output",
                "json",
            ],
        ),
    ];
    println!(
        "\nadmin commands against {held} flows (kxp CLI wall time, process start included; 5 runs):\n"
    );
    println!("{:<46} | median ms | max ms", "command");
    println!("{}", "-".repeat(68));
    for (name, args) in &queries {
        let mut times = Vec::new();
        for _ in 0..5 {
            lab.stop.check()?;
            times.push(cli(args)?.0);
        }
        times.sort();
        println!(
            "{name:<46} | {:>9.1} | {:>6.1}",
            times[2].as_secs_f64() * 1e3,
            times[4].as_secs_f64() * 1e3
        );
    }
    drop(router);
    Ok(())
}

/// One restart under load, measured at the backend.
#[derive(Debug)]
struct Gap {
    kind: &'static str,
    /// From the signal to the old process reaped and, after a kill -9, its process group
    /// gone (its sockets closed by the kernel), which a supervisor waits for.
    gone_in: Duration,
    /// From the signal to kxp answering /healthz again.
    back_in: Duration,
    /// The longest time the backend's counter did not move.
    stall: Duration,
    /// Packets that a steady rate would have delivered in the window, minus those that
    /// were (the window: from the signal to 1 s after kxp is back).
    lost: f64,
    rate_before: f64,
}

/// The restart kind where a newer kxp is started beside the running one.
const HAND_OVER: &str = "hand-over (a newer kxp started beside)";

/// `--restart`: kxp (`case`: alone, or with 110 idle pod veths) under the generator's
/// 1,024 established flows, restarted three ways and handed over once; the backend's counter is read every few
/// milliseconds throughout.
fn restart_gaps(lab: &Lab, plan: &Plan, case: Case) -> anyhow::Result<()> {
    // A supervisor (systemd, a container runtime's shim) reaps what a dead kxp leaves
    // (its socket holder) as soon as it exits; this process stands for one.
    if let Err(e) = dataplane::sys::become_subreaper() {
        eprintln!("macro-bench: cannot become a subreaper: {e}");
    }
    let mut router = Router::setup(lab, case, &plan.kxp, &plan.busy_poll, "restart")?;
    let cfg = lab.trafgen_cfg(Mode::Est)?;
    let upgrade = lab.dir.join("kxp-new");
    std::fs::copy(&plan.kxp, &upgrade).context("copying kxp for the upgrade")?;
    let kinds: [(&'static str, bool, Option<&Path>); 4] = [
        ("kill -9, restart", true, None),
        ("SIGTERM, restart", false, None),
        ("new binary (SIGTERM, start)", false, Some(&upgrade)),
        (HAND_OVER, false, Some(&upgrade)),
    ];
    let total = 1.0 + kinds.len() as f64 * 5.0 + 2.0;
    let mut tg = lab.start_trafgen(&cfg, Mode::Est, plan, (total * 5e6) as u64, "restart", None)?;
    lab.stop.sleep(Duration::from_secs(1))?;
    if !tg.running() {
        bail!(
            "the generator exited early:
{}",
            tg.log_text()
        );
    }
    let probe = Probe::start(lab, plan.probe_rate, Duration::from_secs_f64(total))?;
    let done = AtomicBool::new(false);
    let (samples, marks) = std::thread::scope(|sc| -> anyhow::Result<_> {
        let sampler = sc.spawn(|| {
            let mut v: Vec<(Instant, u64)> = Vec::new();
            while !done.load(Ordering::Relaxed) {
                if let Ok(x) = lab.delivered() {
                    v.push((x.1, x.0));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            v
        });
        let mut marks = Vec::new();
        let mut result = Ok(());
        for (i, (kind, kill, bin)) in kinds.iter().enumerate() {
            if let Err(e) = lab.stop.sleep(Duration::from_millis(1500)) {
                result = Err(e);
                break;
            }
            let t0 = Instant::now();
            let tag = format!("kxp-restart-{i}");
            let done = if *kind == HAND_OVER {
                router.hand_over(&tag)
            } else {
                router.restart_kxp(*kill, *bin, &tag)
            };
            match done {
                Ok(gone_in) => marks.push((*kind, t0, Instant::now(), gone_in)),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            let _ = lab.stop.sleep(Duration::from_millis(2500));
        }
        done.store(true, Ordering::Relaxed);
        let samples = sampler
            .join()
            .map_err(|_| anyhow::anyhow!("sampler panicked"))?;
        result.map(|()| (samples, marks))
    })?;
    let lat = probe.finish()?;
    tg.stop(libc::SIGINT, Duration::from_secs(5));
    let count_at = |t: Instant| {
        samples
            .iter()
            .take_while(|(st, _)| *st <= t)
            .last()
            .map_or(0, |x| x.1)
    };
    let mut gaps = Vec::new();
    for (kind, t0, ready, gone_in) in marks {
        let before = t0 - Duration::from_secs(1);
        let rate = (count_at(t0) - count_at(before)) as f64;
        let end = ready + Duration::from_secs(1);
        let got = count_at(end).saturating_sub(count_at(t0)) as f64;
        let lost = (rate * (end - t0).as_secs_f64() - got).max(0.0);
        let mut stall = Duration::ZERO;
        let mut since: Option<(Instant, u64)> = None;
        for &(t, n) in samples.iter().filter(|(t, _)| *t >= before && *t <= end) {
            match since {
                Some((t1, n1)) if n1 == n => stall = stall.max(t - t1),
                _ => since = Some((t, n)),
            }
        }
        gaps.push(Gap {
            kind,
            gone_in,
            back_in: ready - t0,
            stall,
            lost,
            rate_before: rate,
        });
    }
    let median_gap = {
        let mut d: Vec<f64> = samples
            .windows(2)
            .map(|w| (w[1].0 - w[0].0).as_secs_f64())
            .collect();
        d.sort_by(f64::total_cmp);
        d.get(d.len() / 2).copied().unwrap_or(0.0)
    };
    println!(
        "\n### kxp restarted under load (`macro-bench --restart --generator {}`), {}\n",
        if plan.xsk_gen.is_some() {
            "xsk"
        } else {
            "trafgen"
        },
        if case == Case::KxpPods {
            "110 idle pod veths attached"
        } else {
            "no pod veth"
        }
    );
    println!(
        "| restart | old kxp gone in | kxp back in | longest stall at the backend | packets lost | rate before (Mpps) |"
    );
    println!("|---|---|---|---|---|---|");
    for g in &gaps {
        println!(
            "| {} | {:.2} s | {:.2} s | {:.2} s | {:.0} | {:.3} |",
            g.kind,
            g.gone_in.as_secs_f64(),
            g.back_in.as_secs_f64(),
            g.stall.as_secs_f64(),
            g.lost,
            g.rate_before / 1e6
        );
    }
    println!(
        "\nFor the hand-over, \"old kxp gone in\" is how long the running kxp took to release the node once asked, \"back in\" until the newer one had taken it over (it started beside the running one, which forwarded meanwhile).\nBackend counter read every {:.1} ms (median); latency probes over the whole run (the restarts and the hand-over): {}",
        median_gap * 1e3,
        lat.summary()
    );
    if let (Some(old), Some(new)) = (&router.handed_from_log, router.kxp.as_ref()) {
        println!("{}", handover_drops(old, &new.log_text()));
    }
    drop(router);
    Ok(())
}

/// What the AF_XDP sockets' kernel counters say the hand-over dropped: they count per
/// socket since it was made, across the two kxp that held it, so the new kxp's first
/// `totals:` line after it resumed forwarding, less the old kxp's last one before it
/// handed the sockets over, is what the kernel dropped for want of a fill ring frame or
/// of room in an RX ring in between (up to a second either side of the switch).
fn handover_drops(old_log: &str, new_log: &str) -> String {
    let drops = |line: &str| -> u64 {
        let Some(list) = line.split("xsk_drops [").nth(1) else {
            return 0;
        };
        list.split(['[', ']', ',', ' ', ':'])
            .filter_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                matches!(k, "fill_ring_empty" | "rx_ring_full" | "other")
                    .then(|| v.parse::<u64>().ok())?
            })
            .sum()
    };
    let before = old_log
        .lines()
        .take_while(|l| !l.contains("handed the sockets over to the newer kxp"))
        .filter(|l| l.contains("totals:"))
        .last();
    let after = new_log
        .lines()
        .skip_while(|l| !l.contains("hand-over: forwarding resumed"))
        .find(|l| l.contains("totals:"));
    let paused = new_log
        .lines()
        .find_map(|l| l.split("paused_ms=").nth(1)?.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or_else(|| "not logged".to_string(), |ms| format!("{ms:.1} ms"));
    match (before, after) {
        (Some(b), Some(a)) => format!(
            "Hand-over, the sockets' kernel drop counters (fill ring empty, RX ring full, \
             other): {} before, {} after, so {} dropped across the switch; forwarding paused \
             {paused} by the new kxp's log.",
            drops(b),
            drops(a),
            drops(a).saturating_sub(drops(b))
        ),
        _ => "Hand-over: no totals line on one side to compare the sockets' drop counters."
            .to_string(),
    }
}

fn main() -> std::process::ExitCode {
    match real_main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("macro-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Case, median};

    /// Every case parses from its name, and no two share one.
    #[test]
    fn each_case_is_found_by_its_name() {
        for c in Case::ALL {
            assert_eq!(Case::parse(c.name()).unwrap(), c);
        }
        let mut names: Vec<&str> = Case::ALL.iter().map(|c| c.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Case::ALL.len());
        assert!(Case::parse("kxp-2m").is_err());
    }

    #[test]
    fn the_hand_overs_drops_are_the_counters_difference_across_the_switch() {
        let old = "x totals: rx 5 xsk_drops [kxp0-dp:fill_ring_empty=0,rx_ring_full=0,other=0 rg1:fill_ring_empty=3306,rx_ring_full=2,other=1]\n\
                   x handed the sockets over to the newer kxp\n\
                   x totals: rx 9 xsk_drops [kxp0-dp:fill_ring_empty=0,rx_ring_full=0,other=0]";
        let new = "x totals: rx 1 xsk_drops [rg1:fill_ring_empty=1,rx_ring_full=0,other=0]\n\
                   x hand-over: forwarding resumed paused_ms=9\n\
                   x totals: rx 7 xsk_drops [kxp0-dp:fill_ring_empty=0,rx_ring_full=0,other=0 rg1:fill_ring_empty=3400,rx_ring_full=3,other=1]";
        let s = super::handover_drops(old, new);
        assert!(s.contains("3309 before, 3404 after, so 95 dropped"), "{s}");
        assert!(s.contains("paused 9.0 ms"), "{s}");
        assert!(super::handover_drops("", new).contains("no totals line"));
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(median(&[4.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(median(&[0.4, 0.9, 0.5, 0.6]), Some(0.55));
    }
}
