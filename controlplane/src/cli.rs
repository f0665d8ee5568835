//! The `kxp` command line: subcommands, their flags, and exit statuses (0 success, 2 any
//! error the user can fix, with a message saying what was wrong).

use std::net::IpAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use nat::tuple::Protocol;

use crate::config::KubeProxyConfiguration;
use crate::kpflags::KubeProxyFlags;
use crate::settings::{NodeFlags, node_settings};
use crate::state::load_state;
use crate::trace::{TraceInput, render_text, trace};

/// kxp: kube-proxy's Service semantics on a userspace AF_XDP dataplane.
#[derive(Debug, Parser)]
#[command(name = "kxp", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the dataplane on interfaces, fed from the API server or a state file (takes
    /// every kube-proxy flag; `kube-proxy ARGS` and `kxp ARGS` without a subcommand are
    /// this too).
    #[command(args_override_self = true)]
    Run(Box<RunArgs>),
    /// Explain what kxp does with the first packet of a connection.
    Trace(TraceArgs),
    /// Remove everything kxp leaves for its next start: XDP programs, the service device,
    /// its routes and rules, the state directory (an uninstall; refused while kxp runs).
    Cleanup(CleanupArgs),
    /// Build a throw-away topology and show kxp carrying real connections.
    Demo,
    /// What the running kxp serves (its admin socket).
    #[command(subcommand)]
    Service(ServiceCmd),
    /// The running kxp's connection tracking (its admin socket).
    #[command(subcommand)]
    Conntrack(ConntrackCmd),
    /// Per worker: packets/s in and out, new flows/s, drops, hand-offs, busy ratio,
    /// conntrack fill (its admin socket).
    Stats {
        /// Refresh every second, in place, until interrupted.
        #[arg(long)]
        watch: bool,
        #[command(flatten)]
        admin: AdminArgs,
    },
}

#[derive(Debug, Subcommand)]
pub enum ServiceCmd {
    /// One entry per frontend, with its endpoints and their connections now.
    List {
        /// Only this Service.
        #[arg(long, value_name = "NS/NAME")]
        service: Option<String>,
        #[command(flatten)]
        admin: AdminArgs,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConntrackCmd {
    /// The flows of every worker, filtered.
    List {
        #[command(flatten)]
        filter: FlowFilterArgs,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Remove the matching flows (at least one filter) from every worker.
    Delete {
        #[command(flatten)]
        filter: FlowFilterArgs,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Per worker: entries, capacity, insertions, evictions, failed insertions.
    Stats {
        #[command(flatten)]
        admin: AdminArgs,
    },
}

/// How to reach the running kxp, and how to print its answer.
#[derive(Debug, Clone, clap::Args)]
pub struct AdminArgs {
    /// The running kxp's admin socket (default /run/kxp/kxp.sock, or the state
    /// directory's kxp.sock outside the host's network namespace).
    #[arg(long, value_name = "PATH")]
    pub admin_socket: Option<PathBuf>,
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

#[derive(Debug, Clone, clap::Args)]
pub struct FlowFilterArgs {
    /// Flows to a frontend of this Service.
    #[arg(long, value_name = "NS/NAME")]
    pub service: Option<String>,
    /// Flows to this endpoint.
    #[arg(long, value_name = "IP[:PORT]")]
    pub endpoint: Option<String>,
    /// Flows from this client (as it sent them).
    #[arg(long, value_name = "IP[:PORT]")]
    pub client: Option<String>,
    /// TCP, UDP or SCTP.
    #[arg(long, value_name = "P")]
    pub protocol: Option<String>,
}

impl FlowFilterArgs {
    fn filter(&self) -> crate::admin::Filter {
        crate::admin::Filter {
            service: self.service.clone(),
            endpoint: self.endpoint.clone(),
            client: self.client.clone(),
            protocol: self.protocol.clone(),
        }
    }
}

/// Flags that say which node kxp is on (shared by `run` and `trace`).
#[derive(Debug, Clone, clap::Args)]
pub struct NodeArgs {
    /// A KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1).
    #[arg(long, value_name = "KUBE-PROXY-CONFIG.yaml")]
    pub config: Option<PathBuf>,
    /// This node's name (wins over the config file's hostnameOverride).
    #[arg(long, value_name = "NODE")]
    pub hostname_override: Option<String>,
    /// A local address of the node (repeat for each; the first of each family is the
    /// primary). `trace` without any uses the Node object's status.addresses; `run`
    /// without any uses the host's addresses.
    #[arg(long = "node-ip", value_name = "IP")]
    pub node_ips: Vec<IpAddr>,
}

impl NodeArgs {
    fn flags(&self) -> NodeFlags {
        NodeFlags {
            hostname_override: self.hostname_override.clone(),
            node_ips: self.node_ips.clone(),
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// An interface to attach to, or a shell pattern (`veth*`, `cali*`): links that appear
    /// later and match are attached then. Repeat: the uplinks and the pods' veths.
    #[arg(long = "interface", value_name = "IF|PATTERN", required = false)]
    pub interfaces: Vec<String>,
    /// Services, EndpointSlices, Nodes and ServiceCIDRs as YAML, watched for changes.
    #[arg(long, value_name = "STATE.yaml", conflicts_with_all = ["kubeconfig", "master"])]
    pub state_file: Option<PathBuf>,
    /// A kubeconfig to reach the API server (default: the config's
    /// clientConnection.kubeconfig, else the in-cluster service account).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// The API server's URL (overrides the kubeconfig's).
    #[arg(long, value_name = "URL")]
    pub master: Option<String>,
    #[command(flatten)]
    pub node: NodeArgs,
    /// Number of workers (one per queue, queues 0..N-1 of every interface).
    #[arg(long, value_name = "N", conflicts_with = "cpus")]
    pub workers: Option<usize>,
    /// CPUs to pin the workers to (one worker each), e.g. 1 or 0,1.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub cpus: Option<Vec<usize>>,
    /// The workers' nice value, -20 (highest priority) to 19 [default: -20 for workers
    /// pinned by --cpus, which then also raises their CPUs' ksoftirqd to it while kxp
    /// runs; else the process's]: at nice 0 a task woken on a worker's CPU shares it by
    /// equal weight for milliseconds at a time, a standing queue in the worker's rings.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub worker_nice: Option<i32>,
    /// Source ports for masquerade (keep outside the kernel's ephemeral range).
    #[arg(long, value_name = "LO-HI", value_parser = parse_port_range)]
    pub snat_port_range: Option<(u16, u16)>,
    #[command(flatten)]
    pub kube_proxy: KubeProxyFlags,
    /// Write the effective configuration (file or flags) as a KubeProxyConfiguration to
    /// PATH and exit, as `kube-proxy --write-config-to` does.
    #[arg(long, value_name = "PATH")]
    pub write_config_to: Option<PathBuf>,
    /// Remove everything kxp leaves for its next start and exit (`kxp cleanup`), as
    /// `kube-proxy --cleanup` does.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = crate::kpflags::parse_go_bool)]
    pub cleanup: Option<bool>,
    /// Preferred busy polling on the AF_XDP sockets: USECS[,BUDGET] (SO_BUSY_POLL,
    /// SO_PREFER_BUSY_POLL, SO_BUSY_POLL_BUDGET, default budget 64); pair it with the
    /// interfaces' napi_defer_hard_irqs and gro_flush_timeout. Off by default.
    #[arg(long, value_name = "USECS[,BUDGET]", value_parser = parse_busy_poll)]
    pub busy_poll: Option<(u32, u32)>,
    /// The longest a received packet may wait in a worker's rings when the worker is
    /// saturated: each interface's fill ring holds what the worker drains in this time,
    /// and a load beyond that is dropped by the interface at once rather than queued
    /// (0: no bound but the UMEM's share).
    #[arg(long, value_name = "USECS", default_value_t = 250, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub queue_budget: u32,
    /// How long a worker keeps polling after its last packet before it sleeps (waking
    /// costs the next packet tens of µs) [default: 10000 for workers pinned by --cpus,
    /// else 0: 64 empty rounds].
    #[arg(long, value_name = "USECS", value_parser = clap::value_parser!(u32).range(0..=10_000_000))]
    pub idle_spin: Option<u32>,
    /// Where connections, SNAT ports and affinity are kept so that a restart or an
    /// upgrade loses none (default /run/kxp, or /run/kxp/netns-INODE outside the host's
    /// network namespace; "" for memory only).
    #[arg(long, value_name = "DIR", value_parser = path_or_empty)]
    pub state_dir: Option<PathBuf>,
    /// Log verbosity, as kube-proxy's: up to 2 info (the default), 3-4 debug, 5 and above
    /// trace (`RUST_LOG` wins when set).
    #[arg(short = 'v', long = "v", value_name = "N")]
    pub verbosity: Option<u8>,
    /// Log lines as text or JSON objects (kube-proxy's --logging-format is the same).
    #[arg(
        long = "log-format",
        alias = "logging-format",
        value_enum,
        value_name = "text|json"
    )]
    pub log_format: Option<LogFormat>,
    /// Where to serve the admin API that `kxp service list` and `kxp conntrack ...` use
    /// (a Unix socket, mode 0600; default the state directory's kxp.sock, i.e.
    /// /run/kxp/kxp.sock on the host; "" for none).
    #[arg(long, value_name = "PATH", value_parser = path_or_empty)]
    pub admin_socket: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct CleanupArgs {
    /// Interfaces to clean (default: every interface of this network namespace).
    #[arg(long = "interface", value_name = "IF")]
    pub interfaces: Vec<String>,
    /// The state directory to remove (default as for `kxp run`).
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Remove kube-proxy's leftovers instead of kxp's: its iptables chains (both
    /// backends, both families), its nftables tables, IPVS mode's kube-ipvs0 device,
    /// virtual servers and ipsets, as `kube-proxy --cleanup` does (`kxp run` does it at
    /// start). kxp may be running.
    #[arg(long)]
    pub kube_proxy: bool,
}

/// A path, where `""` is a value of its own ("none"), which clap's path parser refuses.
fn path_or_empty(s: &str) -> Result<PathBuf, String> {
    Ok(PathBuf::from(s))
}

fn parse_port_range(s: &str) -> Result<(u16, u16), String> {
    let (lo, hi) = s
        .split_once('-')
        .ok_or_else(|| format!("{s:?} is not LO-HI (e.g. 61000-65535)"))?;
    let lo: u16 = lo
        .trim()
        .parse()
        .map_err(|_| format!("{lo:?} is not a port"))?;
    let hi: u16 = hi
        .trim()
        .parse()
        .map_err(|_| format!("{hi:?} is not a port"))?;
    if lo == 0 || lo > hi {
        return Err(format!("{s:?}: need 1 <= LO <= HI"));
    }
    Ok((lo, hi))
}

fn parse_busy_poll(s: &str) -> Result<(u32, u32), String> {
    let (us, budget) = s.split_once(',').unwrap_or((s, "64"));
    let us: u32 = us
        .trim()
        .parse()
        .map_err(|_| format!("{us:?} is not a number of microseconds"))?;
    let budget: u32 = budget
        .trim()
        .parse()
        .map_err(|_| format!("{budget:?} is not a budget (packets)"))?;
    if us == 0 || budget == 0 {
        return Err(format!("{s:?}: need USECS >= 1 and BUDGET >= 1"));
    }
    Ok((us, budget))
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Output {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
#[value(rename_all = "UPPER")]
pub enum ProtoArg {
    Tcp,
    Udp,
    Sctp,
}

#[derive(Debug, clap::Args)]
pub struct TraceArgs {
    /// Services, EndpointSlices, Nodes and ServiceCIDRs as YAML (several documents or a
    /// `kind: List`, e.g. `kubectl get svc,endpointslices,nodes,servicecidrs -A -o yaml`).
    #[arg(long, value_name = "STATE.yaml", required_unless_present = "live")]
    pub state: Option<PathBuf>,
    /// Ask the running kxp instead (its admin socket): its current snapshot, and the
    /// tracked flow of the packet if one exists (give --sport).
    #[arg(long, conflicts_with = "state")]
    pub live: bool,
    /// Source port of the packet (with --live: finds its tracked flow).
    #[arg(long, value_name = "PORT")]
    pub sport: Option<u16>,
    /// With --live: the running kxp's admin socket.
    #[arg(long, value_name = "PATH")]
    pub admin_socket: Option<PathBuf>,
    #[command(flatten)]
    pub node: NodeArgs,
    /// Source address of the packet.
    #[arg(long, value_name = "IP")]
    pub src: IpAddr,
    /// Destination address of the packet.
    #[arg(long, value_name = "IP")]
    pub dst: IpAddr,
    /// Destination port of the packet.
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    pub dport: u16,
    /// Transport protocol.
    #[arg(long, value_enum, ignore_case = true, default_value = "TCP")]
    pub protocol: ProtoArg,
    /// Interface the packet arrives on (for detectLocalMode BridgeInterface or
    /// InterfaceNamePrefix).
    #[arg(long, value_name = "IFNAME")]
    pub in_interface: Option<String>,
    /// Output format (as every subcommand: `-o json`).
    #[arg(short = 'o', long = "output", value_enum, default_value = "text")]
    pub output: Output,
}

/// How log lines are written (`--log-format`, kube-proxy's `--logging-format`).
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// kube-proxy's verbosity (`--v`) as a level: up to 2 (kube-proxy's usual) info, 3–4
/// debug, 5 and above trace.
fn level_of(v: u8) -> &'static str {
    match v {
        0..=2 => "info",
        3..=4 => "debug",
        _ => "trace",
    }
}

/// How the process logs: verbosity, format, and whether errors go apart to stderr.
#[derive(Debug, Clone, Copy, Default)]
struct Logging {
    verbosity: Option<u8>,
    format: LogFormat,
    split_stream: bool,
}

impl Logging {
    /// `kxp run`'s: the flags, else the config file's `logging` section (as kube-proxy,
    /// the command line wins field by field).
    fn of_run(a: &RunArgs) -> Logging {
        let file = a
            .node
            .config
            .as_deref()
            .and_then(|p| KubeProxyConfiguration::load(p).ok())
            .and_then(|c| c.logging)
            .unwrap_or(serde_yaml::Value::Null);
        let format =
            a.log_format
                .unwrap_or_else(|| match file.get("format").and_then(|f| f.as_str()) {
                    Some("json") => LogFormat::Json,
                    _ => LogFormat::Text,
                });
        let json = format == LogFormat::Json;
        let verbosity = a.verbosity.or_else(|| {
            file.get("verbosity")
                .and_then(serde_yaml::Value::as_u64)
                .map(|v| v.min(255) as u8)
        });
        let section = if json { "json" } else { "text" };
        let split_file = file
            .get("options")
            .and_then(|o| o.get(section))
            .and_then(|o| o.get("splitStream"))
            .and_then(serde_yaml::Value::as_bool);
        let flag = if json {
            a.kube_proxy.log_json_split_stream
        } else {
            a.kube_proxy.log_text_split_stream
        };
        Logging {
            verbosity,
            format,
            split_stream: flag.or(split_file).unwrap_or(false),
        }
    }
}

/// Installs the process's one log subscriber: `RUST_LOG` if set, else the level `--v`
/// gives (info by default); text lines or JSON objects; on stderr, or with split streams
/// errors on stderr and the rest on stdout.
fn init_logging(l: Logging) {
    use tracing_subscriber::fmt::writer::MakeWriterExt as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level_of(l.verbosity.unwrap_or(0))));
    use tracing_subscriber::fmt::writer::BoxMakeWriter;
    let writer = if l.split_stream {
        BoxMakeWriter::new(
            std::io::stderr
                .with_max_level(tracing::Level::ERROR)
                .or_else(std::io::stdout),
        )
    } else {
        BoxMakeWriter::new(std::io::stderr)
    };
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(false)
        .with_target(false);
    let _ = match l.format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b.json().flatten_event(true).try_init(),
    };
}

/// Runs the command line; returns the process exit status.
pub fn main() -> i32 {
    let raw: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // `kxp hold-sockets FD`: the socket holder `kxp run` starts (dataplane::holder), not
    // a command for users: no flags, no logging.
    if raw.len() == 3 && raw[1] == dataplane::holder::HOLD_ARG {
        return match raw[2].to_str().and_then(|s| s.parse().ok()) {
            Some(fd) => dataplane::holder::serve_fd(fd),
            None => {
                eprintln!("kxp hold-sockets: expected a descriptor number");
                2
            }
        };
    }
    let args = crate::kpflags::normalize_args(raw);
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            init_logging(Logging::default());
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    match &cli.command {
        Command::Run(a) => init_logging(Logging::of_run(a)),
        _ => init_logging(Logging::default()),
    }
    match run(cli) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kxp: {e:#}");
            2
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Trace(args) => run_trace(args),
        Command::Run(args)
            if args
                .kube_proxy
                .version
                .as_deref()
                .is_some_and(|v| v != "false") =>
        {
            print_version(args.kube_proxy.version.as_deref() == Some("raw"));
            Ok(())
        }
        // kube-proxy's --cleanup: kube-proxy's leftovers, and kxp's.
        Command::Run(args) if args.cleanup == Some(true) => {
            run_cleanup(CleanupArgs {
                interfaces: Vec::new(),
                state_dir: None,
                kube_proxy: true,
            })?;
            run_cleanup(CleanupArgs {
                interfaces: args.interfaces,
                state_dir: args.state_dir,
                kube_proxy: false,
            })
        }
        Command::Run(args) if args.write_config_to.is_some() => write_config(&args),
        Command::Run(args) => {
            let flag_config = args.kube_proxy.to_config();
            crate::run::run(crate::run::RunOptions {
                interfaces: args.interfaces,
                state_file: args.state_file,
                kubeconfig: args.kubeconfig,
                master: args.master,
                config: args.node.config.clone(),
                flag_config,
                kube_proxy: args.kube_proxy.clone(),
                flags: args.node.flags(),
                workers: args.workers,
                cpus: args.cpus,
                worker_nice: args.worker_nice,
                snat_ports: args.snat_port_range,
                busy_poll: args.busy_poll,
                queue_budget_us: args.queue_budget,
                idle_spin_us: args.idle_spin,
                state_dir: args.state_dir,
                admin_socket: args.admin_socket,
            })
        }
        Command::Cleanup(args) => run_cleanup(args),
        Command::Service(cmd) => run_admin_service(cmd),
        Command::Conntrack(cmd) => run_admin_conntrack(cmd),
        Command::Stats { watch, admin } => run_admin_stats(watch, &admin),
        Command::Demo => crate::demo::demo(),
    }
}

/// `--version` (kube-proxy's, on `kxp run` and when invoked as `kube-proxy`).
fn print_version(raw: bool) {
    let v = env!("CARGO_PKG_VERSION");
    if raw {
        println!(
            "kxp version: {v}\nkube-proxy flags and configuration: v1.34\nplatform: {}/{}",
            std::env::consts::OS,
            std::env::consts::ARCH
        );
    } else {
        println!("kxp v{v} (kube-proxy v1.34 flags and configuration)");
    }
}

/// `--write-config-to`: the configuration kxp would run with, as YAML.
fn write_config(args: &RunArgs) -> anyhow::Result<()> {
    let (from_flags, _) = args.kube_proxy.to_config();
    let mut cfg = match &args.node.config {
        Some(p) => KubeProxyConfiguration::load(p)?,
        None => from_flags,
    };
    if let Some(h) = &args.node.hostname_override {
        cfg.hostname_override = Some(h.clone());
    }
    let text = serde_yaml::to_string(&cfg)?;
    let path = args
        .write_config_to
        .as_ref()
        .expect("checked by the caller");
    std::fs::write(path, text)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    println!("wrote the effective configuration to {}", path.display());
    Ok(())
}

fn run_trace(args: TraceArgs) -> anyhow::Result<()> {
    if args.src.is_ipv4() != args.dst.is_ipv4() {
        anyhow::bail!(
            "--src {} and --dst {} are of different IP families",
            args.src,
            args.dst
        );
    }
    let cfg = args
        .node
        .config
        .as_deref()
        .map(KubeProxyConfiguration::load)
        .transpose()?;
    let origin = args
        .node
        .config
        .as_ref()
        .map_or_else(|| "flags".to_string(), |p| p.display().to_string());
    if args.live {
        return run_trace_live(&args);
    }
    let settings = node_settings(cfg.as_ref(), &args.node.flags(), &origin)?;
    let state_path = args.state.clone().unwrap_or_default();
    let state = load_state(&state_path)?;
    let built = translate::tracker::build(&state, &settings, 1)
        .map_err(|e| anyhow::anyhow!("state file {}: {e}", state_path.display()))?;
    let input = TraceInput {
        src: args.src,
        dst: args.dst,
        dport: args.dport,
        proto: match args.protocol {
            ProtoArg::Tcp => Protocol::Tcp,
            ProtoArg::Udp => Protocol::Udp,
            ProtoArg::Sctp => Protocol::Sctp,
        },
        in_interface: args.in_interface.clone(),
    };
    let (result, detail) = trace(&built.snapshot, &input);
    match args.output {
        Output::Json => println!("{}", serde_json::to_string(&result)?),
        Output::Text => {
            print!("{}", render_text(&input, &result, &detail));
            for n in &built.notes {
                println!("  note:       {n}");
            }
        }
    }
    Ok(())
}

/// `kxp trace --live`: the running kxp's answer.
fn run_trace_live(args: &TraceArgs) -> anyhow::Result<()> {
    let admin = AdminArgs {
        admin_socket: args.admin_socket.clone(),
        output: args.output,
    };
    let proto = match args.protocol {
        ProtoArg::Tcp => "TCP",
        ProtoArg::Udp => "UDP",
        ProtoArg::Sctp => "SCTP",
    };
    let v = admin_ask(
        &admin,
        &crate::admin::Request::Trace {
            src: args.src,
            sport: args.sport,
            dst: args.dst,
            dport: args.dport,
            protocol: proto.to_string(),
            in_interface: args.in_interface.clone(),
        },
    )?;
    print_answer(&admin, &v, |v| {
        let mut t = v["text"].as_str().unwrap_or_default().to_string();
        match (&v["flow"], args.sport) {
            (serde_json::Value::Null, Some(p)) => {
                t.push_str(&format!("  tracked:    no flow from port {p} (a new connection would be decided as above)\n"));
            }
            (serde_json::Value::Null, None) => {}
            (f, _) => t.push_str(&format!(
                "  tracked:    {} flow to {} ({}{}), worker {}\n",
                f["state"].as_str().unwrap_or("?"),
                f["endpoint"].as_str().unwrap_or("?"),
                match f["snat"].as_str() {
                    Some(s) => format!("SNAT {s}, "),
                    None => String::new(),
                },
                format_args!("expires in {} s", f["expires_in_s"]),
                f["worker"]
            )),
        }
        match v["pick"]["by"].as_str() {
            Some("affinity") => t.push_str(&format!(
                "  would pick: {} (the client's ClientIP affinity)\n",
                v["pick"]["endpoint"].as_str().unwrap_or("?")
            )),
            Some("hash") => t.push_str(&format!(
                "  would pick: {} (the scheduler hashes the connection)\n",
                v["pick"]["endpoint"].as_str().unwrap_or("?")
            )),
            Some("at-connection") => t.push_str(
                "  would pick: decided at connection time (the scheduler is not a hash, no affinity entry)\n",
            ),
            _ => {}
        }
        t.push_str(&format!(
            "  snapshot:   generation {} of the running kxp\n",
            v["generation"]
        ));
        t
    });
    Ok(())
}

fn admin_ask(a: &AdminArgs, req: &crate::admin::Request) -> anyhow::Result<serde_json::Value> {
    let path = a
        .admin_socket
        .clone()
        .unwrap_or_else(crate::admin::default_socket);
    crate::admin::ask(&path, req)
}

fn print_answer(
    a: &AdminArgs,
    v: &serde_json::Value,
    text: impl FnOnce(&serde_json::Value) -> String,
) {
    match a.output {
        Output::Json => println!("{}", serde_json::to_string_pretty(v).unwrap_or_default()),
        Output::Text => print!("{}", text(v)),
    }
}

fn run_admin_service(cmd: ServiceCmd) -> anyhow::Result<()> {
    let ServiceCmd::List { service, admin } = cmd;
    let v = admin_ask(&admin, &crate::admin::Request::ServiceList { service })?;
    print_answer(&admin, &v, crate::admin::service_table);
    Ok(())
}

fn run_admin_stats(watch: bool, admin: &AdminArgs) -> anyhow::Result<()> {
    use crate::admin::Request;
    let mut before = admin_ask(admin, &Request::Stats)?;
    let mut t0 = std::time::Instant::now();
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
        let after = admin_ask(admin, &Request::Stats)?;
        let secs = t0.elapsed().as_secs_f64();
        match admin.output {
            Output::Json => println!("{}", serde_json::to_string(&after)?),
            Output::Text => {
                if watch {
                    // Clear the screen and home the cursor, as `watch`/`top` do.
                    print!("\x1b[2J\x1b[H");
                }
                print!("{}", crate::admin::stats_table(&before, &after, secs));
            }
        }
        if !watch {
            return Ok(());
        }
        before = after;
        t0 = std::time::Instant::now();
    }
}

fn run_admin_conntrack(cmd: ConntrackCmd) -> anyhow::Result<()> {
    use crate::admin::{Request, table};
    match cmd {
        ConntrackCmd::List { filter, admin } => {
            let v = admin_ask(&admin, &Request::ConntrackList(filter.filter()))?;
            print_answer(&admin, &v, |v| {
                let rows = v.as_array().cloned().unwrap_or_default();
                table(
                    &rows,
                    &[
                        "protocol",
                        "client",
                        "frontend",
                        "endpoint",
                        "snat",
                        "state",
                        "expires_in_s",
                        "worker",
                        "service",
                        "packets",
                        "bytes",
                    ],
                )
            });
        }
        ConntrackCmd::Delete { filter, admin } => {
            let v = admin_ask(&admin, &Request::ConntrackDelete(filter.filter()))?;
            print_answer(&admin, &v, |v| {
                format!("deleted {} flow(s)\n", v["deleted"])
            });
        }
        ConntrackCmd::Stats { admin } => {
            let v = admin_ask(&admin, &Request::ConntrackStats)?;
            print_answer(&admin, &v, |v| {
                let rows = v.as_array().cloned().unwrap_or_default();
                table(
                    &rows,
                    &[
                        "worker",
                        "entries",
                        "capacity",
                        "insertions",
                        "evictions",
                        "insert_failed_full",
                        "expired",
                        "removed",
                    ],
                )
            });
        }
    }
    Ok(())
}

fn run_cleanup(args: CleanupArgs) -> anyhow::Result<()> {
    if args.kube_proxy {
        let r = crate::leftovers::remove_all();
        for w in &r.removed {
            println!("removed kube-proxy's leftovers: {w}");
        }
        for w in &r.failed {
            eprintln!("kube-proxy's leftovers not removed: {w}");
        }
        if r.removed.is_empty() && r.failed.is_empty() {
            println!("kxp cleanup --kube-proxy: no kube-proxy leftovers found");
        }
        if !r.missing_tools.is_empty() {
            println!(
                "not installed, nothing of their kind looked for: {}",
                r.missing_tools.join(", ")
            );
        }
        anyhow::ensure!(
            r.failed.is_empty(),
            "{} kube-proxy leftover(s) could not be removed",
            r.failed.len()
        );
        return Ok(());
    }
    let names: Vec<String> = if args.interfaces.is_empty() {
        std::fs::read_dir("/sys/class/net")?
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    } else {
        args.interfaces
    };
    let state = args
        .state_dir
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or_else(dataplane::statefile::default_state_dir);
    // A running kxp holds its state directory's lock: refuse to pull the rug.
    let held = state
        .join("lock")
        .exists()
        .then(|| dataplane::statefile::StateDir::lock(&state, std::time::Duration::ZERO))
        .transpose()
        .map_err(|e| anyhow::anyhow!("{e}: kxp is running; stop it before `kxp cleanup`"))?;
    let mut removed = 0;
    for n in &names {
        if dataplane::xdp::cleanup_interface(n)? {
            println!("detached kxp's XDP program from {n}");
            removed += 1;
        }
    }
    println!("kxp cleanup: {removed} interface(s) cleaned");
    // After the interfaces: their programs' pins say which are kxp's.
    if held.is_some() {
        dataplane::plane::remove_state(&state);
        println!("removed kxp's state directory {}", state.display());
    }
    if let Some(pins) = dataplane::xdp::pins::dir() {
        dataplane::xdp::pins::remove_dir(&pins);
    }
    drop(held);
    for dev in ["kxp0"] {
        if dataplane::servicedev::remove(dev)? {
            println!("removed kxp's service device {dev} ({dev}-dp)");
        }
    }
    if dataplane::servicedev::remove_kernel_policy()? {
        println!(
            "removed the rules of kxp.networkPolicy: kernel (nftables table inet {}, the policy rule to table {})",
            dataplane::servicedev::HANDOVER_TABLE,
            dataplane::servicedev::HANDOVER_ROUTE_TABLE
        );
    }
    let rules = dataplane::servicedev::cleanup_rules()?;
    if rules > 0 {
        println!(
            "restored the local policy rule and removed kxp's NodePort rules ({rules} changed)"
        );
    }
    Ok(())
}
