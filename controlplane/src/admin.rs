//! The running kxp's admin interface: a Unix socket (default `/run/kxp/kxp.sock`, or in
//! the state directory of another network namespace; mode 0600, root's), never on the
//! network, and the `kxp service list` / `kxp conntrack list|delete|stats` commands that
//! ask it.
//!
//! One request per connection: a JSON object on one line (`{"op": "service_list", ...}`),
//! answered by one JSON value (`{"ok": ...}` or `{"error": "..."}`), then the connection
//! closes. The filters run inside each worker, on its own table, so a filtered query
//! over a million flows moves only what matches.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context as _;
use conntrack::{FlowState, State};
use dataplane::worker::{FlowFilter, FlowInfo, Shared};
use nat::snapshot::Snapshot;
use nat::tuple::Protocol;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// How long a worker may take to answer the admin interface.
const WORKER_WAIT: Duration = Duration::from_secs(2);

/// The socket's default path: the state directory's `kxp.sock` (`/run/kxp/kxp.sock` on
/// the host).
pub fn default_socket() -> PathBuf {
    dataplane::statefile::default_state_dir().join("kxp.sock")
}

/// Which flows a conntrack request is about.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Filter {
    /// `NS/NAME`: flows to any frontend of that Service.
    pub service: Option<String>,
    /// `IP` or `IP:PORT` of the endpoint.
    pub endpoint: Option<String>,
    /// `IP` or `IP:PORT` of the client, as it sent its packets.
    pub client: Option<String>,
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: Option<String>,
}

impl Filter {
    fn is_empty(&self) -> bool {
        self == &Filter::default()
    }
}

/// A request on the socket.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    ServiceList {
        service: Option<String>,
    },
    ConntrackList(Filter),
    ConntrackDelete(Filter),
    ConntrackStats,
    /// Every worker's counters now (cumulative; `kxp stats` turns two into rates).
    Stats,
    /// `kxp trace --live`: the decision for a first packet on the running snapshot, and
    /// the flow it would belong to if one is tracked (given `sport`).
    Trace {
        src: IpAddr,
        sport: Option<u16>,
        dst: IpAddr,
        dport: u16,
        protocol: String,
        in_interface: Option<String>,
    },
}

/// `IP` or `IP:PORT` (IPv6 as `[IP]:PORT` or a bare address).
fn parse_addr(s: &str) -> anyhow::Result<(IpAddr, Option<u16>)> {
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Ok((sa.ip(), Some(sa.port())));
    }
    let ip = s
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .with_context(|| format!("{s:?} is not IP or IP:PORT"))?;
    Ok((ip, None))
}

fn parse_proto(s: &str) -> anyhow::Result<Protocol> {
    match s.to_ascii_uppercase().as_str() {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        "SCTP" => Ok(Protocol::Sctp),
        _ => anyhow::bail!("{s:?} is not a protocol (TCP, UDP, SCTP)"),
    }
}

/// The Service port a flow was sent to (by its frontend), as `ns/name:port`.
fn service_of(snap: &Snapshot, f: &FlowInfo) -> Option<String> {
    let port = snap.port_for(f.orig.dst, f.orig.proto, f.orig.dport)?;
    Some(snap.port(port).name.to_string())
}

fn matches_addr(want: Option<(IpAddr, Option<u16>)>, ip: IpAddr, port: u16) -> bool {
    want.is_none_or(|(wip, wport)| wip == ip && wport.is_none_or(|p| p == port))
}

/// The filter as a predicate the workers run.
fn predicate(f: &Filter, snap: Arc<Snapshot>) -> anyhow::Result<FlowFilter> {
    let endpoint = f.endpoint.as_deref().map(parse_addr).transpose()?;
    let client = f.client.as_deref().map(parse_addr).transpose()?;
    let proto = f.protocol.as_deref().map(parse_proto).transpose()?;
    let service = f.service.clone();
    if let Some(s) = &service {
        anyhow::ensure!(
            s.split_once('/')
                .is_some_and(|(a, b)| !a.is_empty() && !b.is_empty()),
            "--service {s:?}: give NAMESPACE/NAME"
        );
    }
    Ok(Arc::new(move |e: &conntrack::Entry| {
        let (o, r) = (e.orig(), e.reply());
        proto.is_none_or(|p| p == o.proto)
            && matches_addr(endpoint, r.src, r.sport)
            && matches_addr(client, o.src, o.sport)
            && service.as_ref().is_none_or(|s| {
                snap.port_for(o.dst, o.proto, o.dport).is_some_and(|p| {
                    let n = &snap.port(p).name;
                    format!("{}/{}", n.namespace, n.name) == *s
                })
            })
    }))
}

fn state_name(s: State) -> String {
    match s {
        State::Tcp(t) => t.to_string(),
        State::Udp(FlowState::Unreplied) | State::Sctp(FlowState::Unreplied) => "UNREPLIED".into(),
        State::Udp(FlowState::Replied) | State::Sctp(FlowState::Replied) => "REPLIED".into(),
        State::Udp(FlowState::Assured) => "STREAM".into(),
        State::Sctp(FlowState::Assured) => "ESTABLISHED".into(),
    }
}

fn flow_json(snap: &Snapshot, f: &FlowInfo) -> Value {
    let client = f.orig.src_addr();
    let snat = f.reply.dst_addr();
    json!({
        "protocol": f.orig.proto.to_string(),
        "client": client.to_string(),
        "frontend": f.orig.dst_addr().to_string(),
        "endpoint": f.reply.src_addr().to_string(),
        "snat": (snat != client).then(|| snat.to_string()),
        "state": state_name(f.state),
        "expires_in_s": f.expires_in_ms / 1000,
        "worker": f.worker,
        "service": service_of(snap, f),
        "packets": f.packets,
        "bytes": f.bytes,
    })
}

fn frontend(ip: IpAddr, port: u16, proto: Protocol) -> String {
    format!("{}/{proto}", SocketAddr::new(ip, port))
}

fn service_list(shared: &Shared, want: Option<&str>) -> anyhow::Result<Value> {
    let snap = shared.snapshot.load_full();
    // Flows, packets and bytes per endpoint, all workers (one pass over every table).
    let totals = shared.endpoint_totals(WORKER_WAIT);
    let mut out = Vec::new();
    for sp in snap.ports_sorted() {
        let n = &sp.name;
        if want.is_some_and(|w| format!("{}/{}", n.namespace, n.name) != w) {
            continue;
        }
        let proto = n.protocol;
        let mut fronts = vec![("ClusterIP", frontend(sp.cluster_ip, sp.port, proto))];
        if sp.node_port != 0 {
            let node = &snap.node;
            for ip in node.primary_v4.iter().chain(node.primary_v6.iter()) {
                if ip.is_ipv4() == sp.cluster_ip.is_ipv4() {
                    fronts.push(("NodePort", frontend(*ip, sp.node_port, proto)));
                }
            }
        }
        fronts.extend(
            sp.external_ips
                .iter()
                .map(|ip| ("ExternalIP", frontend(*ip, sp.port, proto))),
        );
        fronts.extend(
            sp.lb_vips
                .iter()
                .map(|ip| ("LoadBalancer", frontend(*ip, sp.port, proto))),
        );
        let endpoints: Vec<Value> = sp
            .endpoints
            .iter()
            .map(|e| {
                let t = totals.get(&(e.addr, proto)).copied().unwrap_or_default();
                json!({
                    "address": e.addr.to_string(),
                    "ready": e.ready,
                    "serving": e.serving,
                    "terminating": e.terminating,
                    "local": e.is_local,
                    "weight": e.weight,
                    "active_connections": t.flows,
                    "packets": t.packets,
                    "bytes": t.bytes,
                })
            })
            .collect();
        let affinity = match sp.affinity {
            nat::model::Affinity::ClientIp { timeout_secs } => json!(timeout_secs),
            nat::model::Affinity::None => Value::Null,
        };
        for (kind, fe) in fronts {
            out.push(json!({
                "service": n.to_string(),
                "frontend": fe,
                "kind": kind,
                "scheduler": sp.scheduler.name(),
                "affinity_timeout_s": affinity,
                "endpoints": endpoints,
            }));
        }
    }
    Ok(Value::Array(out))
}

fn answer(shared: &Shared, node: &engine::NodeState, req: Request) -> anyhow::Result<Value> {
    match req {
        Request::ServiceList { service } => service_list(shared, service.as_deref()),
        Request::ConntrackList(f) => {
            let snap = shared.snapshot.load_full();
            let pred = predicate(&f, snap.clone())?;
            let (flows, _) = shared.flows(pred, false, WORKER_WAIT);
            Ok(Value::Array(
                flows.iter().map(|fl| flow_json(&snap, fl)).collect(),
            ))
        }
        Request::ConntrackDelete(f) => {
            anyhow::ensure!(
                !f.is_empty(),
                "give at least one filter (--service, --endpoint, --client, --protocol)"
            );
            let pred = predicate(&f, shared.snapshot.load_full())?;
            let (_, n) = shared.flows(pred, true, WORKER_WAIT);
            Ok(json!({ "deleted": n }))
        }
        Request::Trace {
            src,
            sport,
            dst,
            dport,
            protocol,
            in_interface,
        } => {
            let input = crate::trace::TraceInput {
                src,
                dst,
                dport,
                proto: parse_proto(&protocol)?,
                in_interface,
            };
            live_trace(shared, node, input, sport)
        }
        Request::Stats => Ok(worker_stats(shared)),
        Request::ConntrackStats => Ok(table_stats(shared)),
    }
}

/// `kxp trace --live`: the decision for `input` on the running snapshot, the endpoint a
/// deterministic choice would make given the source port `sport`, and the flow the
/// packet belongs to if one is tracked.
fn live_trace(
    shared: &Shared,
    node: &engine::NodeState,
    input: crate::trace::TraceInput,
    sport: Option<u16>,
) -> anyhow::Result<Value> {
    let (src, dst, dport) = (input.src, input.dst, input.dport);
    let snap = shared.snapshot.load_full();
    let (result, detail) = crate::trace::trace(&snap, &input);
    let text = crate::trace::render_text(&input, &result, &detail);
    // Given the source port: the endpoint a deterministic choice would make.
    let pick = sport.map(|sport| {
        use engine::Prediction;
        let p = node.predict(
            &snap,
            SocketAddr::new(src, sport),
            SocketAddr::new(dst, dport),
            input.proto,
            input.in_interface.as_deref(),
            dataplane::sys::monotonic_ns(),
        );
        match p {
            Prediction::Affinity(ep) => json!({"endpoint": ep.to_string(), "by": "affinity"}),
            Prediction::Hash(ep) => json!({"endpoint": ep.to_string(), "by": "hash"}),
            Prediction::AtConnection => json!({"endpoint": null, "by": "at-connection"}),
            Prediction::NotForwarded => json!({"endpoint": null, "by": "not-forwarded"}),
        }
    });
    // The tracked flow of this packet, if any: by its tuple as the client sends it.
    let flow = match sport {
        Some(sport) => {
            let proto = input.proto;
            let pred: FlowFilter = Arc::new(move |e: &conntrack::Entry| {
                let o = e.orig();
                o.proto == proto
                    && o.src == src
                    && o.sport == sport
                    && o.dst == dst
                    && o.dport == dport
            });
            let (flows, _) = shared.flows(pred, false, WORKER_WAIT);
            flows.first().map(|f| flow_json(&snap, f))
        }
        None => None,
    };
    Ok(json!({
        "trace": serde_json::to_value(&result)?,
        "text": text,
        "flow": flow,
        "pick": pick,
        "generation": snap.generation,
    }))
}

/// Every worker's counters now, with the (interface, queue) sockets it serves.
fn worker_stats(shared: &Shared) -> Value {
    Value::Array(
    shared
        .stats
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            let drops: serde_json::Map<String, Value> = w
                .drop_detail
                .lock()
                .map(|d| {
                    d.iter()
                        .filter(|(_, n)| *n > 0)
                        .map(|(k, n)| (k.to_string(), json!(n)))
                        .collect()
                })
                .unwrap_or_default();
            let it = g(&w.iterations);
            // The (interface, queue) sockets this worker serves, and what each
            // received: how RSS spreads the traffic.
            let queues: Vec<Value> = shared
                .socket_stats_of(i, WORKER_WAIT)
                .unwrap_or_default()
                .into_iter()
                .map(|(ifname, st)| {
                    json!({"interface": ifname, "queue": st.queue, "rx_packets": st.rx_packets})
                })
                .collect();
            json!({
                "worker": i,
                // Acquire, before the verdicts (see `Worker::publish`).
                "rx_packets": w.rx_packets.load(Ordering::Acquire),
                "tx_packets": g(&w.tx_packets),
                "forwarded": g(&w.forwarded),
                "new_flows": g(&w.new_flows),
                "rejected": g(&w.rejected),
                "passed": g(&w.passed),
                "dropped": g(&w.dropped),
                "drops": drops,
                "handoffs_out": g(&w.handoffs_out),
                "handoffs_in": g(&w.handoffs_in),
                "busy_ratio": if it == 0 { 0.0 } else { g(&w.busy_iterations) as f64 / it as f64 },
                "conntrack_entries": g(&w.conntrack_entries),
                "queues": queues,
            })
        })
        .collect(),
    )
}

/// Every worker's connection table: entries, capacity and its counters.
fn table_stats(shared: &Shared) -> Value {
    Value::Array(
        shared
            .table_stats(WORKER_WAIT)
            .into_iter()
            .map(|t| {
                json!({
                    "worker": t.worker,
                    "entries": t.entries,
                    "capacity": t.capacity,
                    "insertions": t.stats.inserts,
                    "evictions": t.stats.evictions,
                    "insert_failed_full": t.stats.insert_failed_full,
                    "expired": t.stats.expired,
                    "removed": t.stats.removed + t.stats.removed_stale,
                    "clashes": t.stats.clashes,
                })
            })
            .collect(),
    )
}

/// The admin socket of a running kxp; removed when dropped.
#[derive(Debug)]
pub struct AdminServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl AdminServer {
    /// Serves `shared` (and the node's shared state, for predictions) on a new socket at `path` (a stale one is replaced; a live one is
    /// an error), mode 0600.
    ///
    /// # Errors
    /// The socket cannot be created, or another kxp answers on it.
    pub fn start(
        path: &Path,
        shared: Arc<Shared>,
        node: Arc<engine::NodeState>,
    ) -> anyhow::Result<AdminServer> {
        if path.exists() {
            anyhow::ensure!(
                UnixStream::connect(path).is_err(),
                "another kxp serves its admin socket at {}; give --admin-socket PATH",
                path.display()
            );
            let _ = std::fs::remove_file(path);
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let listener = UnixListener::bind(path)
            .with_context(|| format!("cannot create the admin socket {}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kxp-admin".into())
            .spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((conn, _)) => serve(conn, &shared, &node),
                        Err(_) => std::thread::sleep(Duration::from_millis(20)),
                    }
                }
            })?;
        Ok(AdminServer {
            path: path.to_path_buf(),
            stop,
            thread: Some(thread),
        })
    }
}

fn serve(conn: UnixStream, shared: &Shared, node: &engine::NodeState) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let mut line = String::new();
    let mut reader = BufReader::new(&conn);
    let out = match reader.read_line(&mut line) {
        Ok(_) => match serde_json::from_str::<Request>(&line) {
            Ok(req) => match answer(shared, node, req) {
                Ok(v) => json!({ "ok": v }),
                Err(e) => json!({ "error": format!("{e:#}") }),
            },
            Err(e) => json!({ "error": format!("bad request: {e}") }),
        },
        Err(e) => json!({ "error": format!("reading the request: {e}") }),
    };
    let mut w = &conn;
    let _ = writeln!(w, "{out}");
}

impl Drop for AdminServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Asks the kxp at `path`; its answer, or an error that says why there is none.
///
/// # Errors
/// No kxp there, no permission, or kxp's own error for the request.
pub fn ask(path: &Path, req: &Request) -> anyhow::Result<Value> {
    let mut conn = UnixStream::connect(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::PermissionDenied => anyhow::anyhow!(
            "permission denied on {}: the admin socket is root's (run as root)",
            path.display()
        ),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => anyhow::anyhow!(
            "no kxp is running with its admin socket at {} (start `kxp run`, or give --admin-socket PATH)",
            path.display()
        ),
        _ => anyhow::anyhow!("cannot reach kxp at {}: {e}", path.display()),
    })?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    writeln!(conn, "{}", serde_json::to_string(req)?)?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line)?;
    let v: Value = serde_json::from_str(&line)
        .with_context(|| format!("kxp's answer is not JSON: {line:?}"))?;
    if let Some(e) = v.get("error").and_then(Value::as_str) {
        anyhow::bail!("{e}");
    }
    Ok(v.get("ok").cloned().unwrap_or(Value::Null))
}

fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A plain-text table of `rows` (objects) with `cols`.
pub fn table(rows: &[Value], cols: &[&str]) -> String {
    let mut grid: Vec<Vec<String>> = vec![cols.iter().map(|c| c.to_uppercase()).collect()];
    for r in rows {
        grid.push(cols.iter().map(|c| cell(&r[*c])).collect());
    }
    let widths: Vec<usize> = (0..cols.len())
        .map(|i| grid.iter().map(|row| row[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in grid {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// The text form of `kxp stats`: per worker, the rates between two samples `secs` apart
/// and the state at the second.
pub fn stats_table(before: &Value, after: &Value, secs: f64) -> String {
    let rate = |a: &Value, b: &Value, k: &str| {
        let d = b[k]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(a[k].as_u64().unwrap_or(0));
        format!("{:.0}", d as f64 / secs.max(1e-3))
    };
    let mut rows = Vec::new();
    for (a, b) in before
        .as_array()
        .into_iter()
        .flatten()
        .zip(after.as_array().into_iter().flatten())
    {
        let drops: Vec<String> = b["drops"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        rows.push(json!({
            "worker": b["worker"],
            "rx_pps": rate(a, b, "rx_packets"),
            "tx_pps": rate(a, b, "tx_packets"),
            "new_flows_s": rate(a, b, "new_flows"),
            "drops_s": rate(a, b, "dropped"),
            "handoffs_s": rate(a, b, "handoffs_out"),
            "busy": format!("{:.0}%", b["busy_ratio"].as_f64().unwrap_or(0.0) * 100.0),
            "conntrack": b["conntrack_entries"],
            "drops_total": if drops.is_empty() { "-".to_string() } else { drops.join(" ") },
        }));
    }
    let workers = table(
        &rows,
        &[
            "worker",
            "rx_pps",
            "tx_pps",
            "new_flows_s",
            "drops_s",
            "handoffs_s",
            "busy",
            "conntrack",
            "drops_total",
        ],
    );
    // Per receive queue (an AF_XDP socket each), those that received in the window.
    let mut queues = Vec::new();
    for b in after.as_array().into_iter().flatten() {
        for q in b["queues"].as_array().into_iter().flatten() {
            let earlier = before
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|w| w["queues"].as_array().into_iter().flatten())
                .find(|e| e["interface"] == q["interface"] && e["queue"] == q["queue"])
                .cloned()
                .unwrap_or(Value::Null);
            let rx = rate(&earlier, q, "rx_packets");
            if rx != "0" {
                queues.push(json!({
                    "interface": q["interface"],
                    "queue": q["queue"],
                    "worker": b["worker"],
                    "rx_pps": rx,
                }));
            }
        }
    }
    if queues.is_empty() {
        return workers;
    }
    format!(
        "{workers}\n{}",
        table(&queues, &["interface", "queue", "worker", "rx_pps"])
    )
}

/// The text form of `kxp service list`: one line per frontend and endpoint.
pub fn service_table(v: &Value) -> String {
    let mut rows = Vec::new();
    for fe in v.as_array().into_iter().flatten() {
        let eps = fe["endpoints"].as_array().cloned().unwrap_or_default();
        if eps.is_empty() {
            rows.push(json!({"service": fe["service"], "frontend": fe["frontend"], "kind": fe["kind"], "scheduler": fe["scheduler"], "endpoint": "(none)"}));
        }
        for e in eps {
            let state = if e["ready"] == json!(true) {
                "ready"
            } else if e["terminating"] == json!(true) {
                "terminating"
            } else {
                "not ready"
            };
            rows.push(json!({
                "service": fe["service"], "frontend": fe["frontend"], "kind": fe["kind"],
                "scheduler": fe["scheduler"], "endpoint": e["address"], "state": state,
                "local": e["local"], "active": e["active_connections"],
                "packets": e["packets"], "bytes": e["bytes"],
            }));
        }
    }
    table(
        &rows,
        &[
            "service",
            "frontend",
            "kind",
            "scheduler",
            "endpoint",
            "state",
            "local",
            "active",
            "packets",
            "bytes",
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_addresses_parse() {
        let r = Request::ConntrackList(Filter {
            endpoint: Some("198.18.2.2:8080".into()),
            ..Filter::default()
        });
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains(r#""op":"conntrack_list""#), "{text}");
        assert!(matches!(
            serde_json::from_str::<Request>(&text).unwrap(),
            Request::ConntrackList(f) if f.endpoint.as_deref() == Some("198.18.2.2:8080")
        ));
        assert_eq!(
            parse_addr("198.18.2.2").unwrap(),
            ("198.18.2.2".parse().unwrap(), None)
        );
        assert_eq!(
            parse_addr("[2001:db8::1]:80").unwrap(),
            ("2001:db8::1".parse().unwrap(), Some(80))
        );
        assert!(parse_addr("nope").is_err());
        assert!(parse_proto("udp").is_ok() && parse_proto("icmp").is_err());
        let t = table(&[json!({"a": "x", "b": null})], &["a", "b"]);
        assert_eq!(t, "A  B\nx  -\n");
    }

    #[test]
    fn no_kxp_is_a_clear_error() {
        let e = ask(Path::new("/nonexistent/kxp.sock"), &Request::ConntrackStats)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no kxp is running"), "{e}");
    }
}
