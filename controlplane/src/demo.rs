//! `kxp demo`: kxp's main job on an embedded default, end to end, on this machine.
//!
//! Builds a throw-away topology of network namespaces — a client, a node running
//! `kxp run`, and three `web` backends like the seeds' (ClusterIP port 80 → targetPort
//! 8080) — sends 300 real HTTP connections through the VIP, prints how they were spread,
//! scales the Service to zero and shows the immediate refusal, prints a short throughput
//! figure, and removes everything it made. Addresses come from 198.18.0.0/15 only, inside
//! its own namespaces.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::netns::{Topology, in_ns, run};

/// The Service's virtual IP.
pub const VIP: &str = "198.19.0.10";
const BACKENDS: [(&str, &str, &str); 3] = [
    ("web-1", "198.18.2.1/30", "198.18.2.2/30"),
    ("web-2", "198.18.2.5/30", "198.18.2.6/30"),
    ("web-3", "198.18.2.9/30", "198.18.2.10/30"),
];

fn host(cidr: &str) -> &str {
    cidr.split('/').next().unwrap_or(cidr)
}

/// The state file: the `web` Service (NodePort type: ports 80/TCP, 9/UDP and 7/TCP, on
/// NodePorts 30080, 30009, 30007) and its endpoints, all on node `node-a`.
pub fn state_yaml(endpoints: &[&str]) -> String {
    state_yaml_with(endpoints, "")
}

/// The state file with extra Service spec lines (e.g. `  externalTrafficPolicy: Local`;
/// a `  type:` line replaces the default NodePort).
pub fn state_yaml_with(endpoints: &[&str], extra_spec: &str) -> String {
    let service_type = if extra_spec.contains("  type:") {
        ""
    } else {
        "  type: NodePort\n"
    };
    let mut eps = String::new();
    for ip in endpoints {
        eps.push_str(&format!(
            "  - addresses: [{ip}]\n    nodeName: node-a\n    conditions: {{ready: true}}\n"
        ));
    }
    if eps.is_empty() {
        eps.push_str("  []\n");
    }
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: web, namespace: demo}}
spec:
{service_type}  clusterIP: {VIP}
  clusterIPs: [{VIP}]
  ipFamilies: [IPv4]
{extra_spec}  ports:
  - {{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30080}}
  - {{name: sink, port: 9, targetPort: 9000, protocol: UDP, nodePort: 30009}}
  - {{name: echo, port: 7, targetPort: 7000, protocol: TCP, nodePort: 30007}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-demo
  namespace: demo
  labels: {{kubernetes.io/service-name: web}}
addressType: IPv4
ports:
- {{name: http, port: 8080, protocol: TCP}}
- {{name: sink, port: 9000, protocol: UDP}}
- {{name: echo, port: 7000, protocol: TCP}}
endpoints:
{eps}---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {{name: kubernetes}}
spec: {{cidrs: [198.19.0.0/16]}}
"#
    )
}

const CONFIG: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nclusterCIDR: 198.18.2.0/24\n";

/// Runs `f` on a thread inside network namespace `ns`.
pub fn spawn_in<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<anyhow::Result<T>> {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        dataplane::sys::enter_netns(&ns).with_context(|| format!("entering namespace {ns}"))?;
        Ok(f())
    })
}

fn join<T>(h: JoinHandle<anyhow::Result<T>>) -> anyhow::Result<T> {
    h.join()
        .map_err(|_| anyhow::anyhow!("a helper thread panicked"))?
}

/// A tiny HTTP server on 8080 answering every request with `NAME PEER-ADDRESS` (so tests
/// can see whether the source was masqueraded), a TCP echo server on 7000 for long-lived
/// connections, and a UDP socket on 9000 that counts datagrams and answers each with
/// `NAME`; all stop when `stop` is set.
#[derive(Debug)]
pub struct Backend {
    pub udp_received: Arc<AtomicU64>,
    threads: Vec<JoinHandle<anyhow::Result<()>>>,
}

impl Backend {
    pub fn start(ns: &str, name: &'static str, stop: Arc<AtomicBool>) -> anyhow::Result<Backend> {
        let udp_received = Arc::new(AtomicU64::new(0));
        let (tx, rx) = std::sync::mpsc::channel::<std::io::Result<()>>();
        let stop_h = stop.clone();
        let tx2 = tx.clone();
        let http = spawn_in(ns, move || {
            let l = match TcpListener::bind("0.0.0.0:8080")
                .and_then(|l| l.set_nonblocking(true).map(|_| l))
            {
                Ok(l) => {
                    let _ = tx2.send(Ok(()));
                    l
                }
                Err(e) => {
                    let _ = tx2.send(Err(e));
                    return;
                }
            };
            while !stop_h.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((mut s, peer)) => {
                        let _ = s.set_nonblocking(false);
                        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                        let mut buf = [0u8; 1024];
                        let _ = s.read(&mut buf);
                        let body = format!("{name} {}\n", peer.ip());
                        let _ = write!(
                            s,
                            "HTTP/1.0 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        );
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(1)),
                }
            }
        });
        let count = udp_received.clone();
        let stop_u = stop.clone();
        let tx3 = tx.clone();
        let udp = spawn_in(ns, move || {
            let s = match UdpSocket::bind("0.0.0.0:9000") {
                Ok(s) => {
                    let _ = tx.send(Ok(()));
                    s
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let _ = s.set_read_timeout(Some(Duration::from_millis(50)));
            let mut buf = vec![0u8; 65_536];
            while !stop_u.load(Ordering::Relaxed) {
                if let Ok((n, peer)) = s.recv_from(&mut buf) {
                    count.fetch_add(1, Ordering::Relaxed);
                    if n > 0 && buf[0] == b'?' {
                        let _ = s.send_to(name.as_bytes(), peer);
                    } else if n > 0 && buf[0] == b'!' {
                        // Echo, behind the backend's name: large datagrams come back large.
                        let mut reply = format!("{name}:").into_bytes();
                        reply.extend_from_slice(&buf[..n]);
                        let _ = s.send_to(&reply, peer);
                    }
                }
            }
        });
        let stop_e = stop.clone();
        let echo = spawn_in(ns, move || {
            let l = match TcpListener::bind("0.0.0.0:7000")
                .and_then(|l| l.set_nonblocking(true).map(|_| l))
            {
                Ok(l) => {
                    let _ = tx3.send(Ok(()));
                    l
                }
                Err(e) => {
                    let _ = tx3.send(Err(e));
                    return;
                }
            };
            let mut conns: Vec<TcpStream> = Vec::new();
            let mut buf = [0u8; 1024];
            while !stop_e.load(Ordering::Relaxed) {
                if let Ok((s, _)) = l.accept() {
                    let _ = s.set_nonblocking(true);
                    conns.push(s);
                }
                conns.retain_mut(|c| match c.read(&mut buf) {
                    Ok(0) => false,
                    Ok(n) => {
                        let mut reply = format!("{name}:").into_bytes();
                        reply.extend_from_slice(&buf[..n]);
                        c.write_all(&reply).is_ok()
                    }
                    Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                });
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        for _ in 0..3 {
            rx.recv_timeout(Duration::from_secs(5))
                .context("backend did not start")?
                .context("backend cannot listen")?;
        }
        Ok(Backend {
            udp_received,
            threads: vec![http, udp, echo],
        })
    }

    pub fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// One HTTP GET on a new connection; the body (the backend's name).
pub fn http_get(addr: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    http_get_on(TcpStream::connect_timeout(&addr, timeout)?, timeout)
}

/// One HTTP GET on a connected stream; the body.
pub fn http_get_on(mut s: TcpStream, timeout: Duration) -> std::io::Result<String> {
    s.set_read_timeout(Some(timeout))?;
    s.write_all(b"GET / HTTP/1.0\r\nHost: web\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    Ok(resp
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or("")
        .trim()
        .to_string())
}

/// `exe run ARGS` in namespace `ns`, its output to `out`.
fn run_in(exe: &Path, ns: &str, args: &[String], out: std::fs::File) -> anyhow::Result<Child> {
    let err = out.try_clone()?;
    // Invoked as `kube-proxy`, kxp is `kxp run` already.
    let as_kube_proxy = exe.file_name().is_some_and(|n| n == "kube-proxy");
    dataplane::lab::node_command(ns)
        .arg(exe)
        .args((!as_kube_proxy).then_some("run"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .context("starting kxp run")
}

/// A `kxp run` child process in a namespace. On drop: SIGTERM, wait, then `kxp
/// cleanup` in the namespace (a stopped kxp keeps its steering and state for the next
/// one, see `dataplane::statefile`; this one is not coming back).
#[derive(Debug)]
pub struct KxpProcess {
    pub child: Child,
    pub log: PathBuf,
    exe: PathBuf,
    ns: String,
    /// `kxp cleanup` ran.
    cleaned: bool,
}

impl KxpProcess {
    pub fn spawn(ns: &str, args: &[String], log: &Path) -> anyhow::Result<KxpProcess> {
        let exe = std::env::current_exe().context("locating the kxp binary")?;
        Self::spawn_exe(&exe, ns, args, log)
    }

    pub fn spawn_exe(
        exe: &Path,
        ns: &str,
        args: &[String],
        log: &Path,
    ) -> anyhow::Result<KxpProcess> {
        let child = run_in(exe, ns, args, std::fs::File::create(log)?)?;
        Ok(KxpProcess {
            child,
            log: log.to_path_buf(),
            exe: exe.to_path_buf(),
            ns: ns.to_string(),
            cleaned: false,
        })
    }

    /// Starts another `kxp run` (the same binary, or `exe`) in the same namespace with
    /// `args`, logging to the same file (appended), after this one has stopped: a restart.
    pub fn restart(&mut self, exe: Option<&Path>, args: &[String]) -> anyhow::Result<()> {
        let exe = exe.map_or_else(|| self.exe.clone(), Path::to_path_buf);
        let out = std::fs::OpenOptions::new().append(true).open(&self.log)?;
        self.child = run_in(&exe, &self.ns, args, out)?;
        self.exe = exe;
        self.cleaned = false;
        Ok(())
    }

    /// SIGKILL, and wait.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// `kxp cleanup` in the namespace (after the process has stopped); once.
    pub fn cleanup(&mut self) -> anyhow::Result<String> {
        self.cleaned = true;
        let out = dataplane::lab::node_command(&self.ns)
            .arg(&self.exe)
            .arg("cleanup")
            .stdin(Stdio::null())
            .output()
            .context("running kxp cleanup")?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        anyhow::ensure!(out.status.success(), "kxp cleanup failed: {text}");
        Ok(text)
    }

    /// SIGTERM, then wait up to 10 s (SIGKILL after). Returns the exit status code.
    pub fn terminate(&mut self) -> Option<i32> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).output();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        self.child.wait().ok().and_then(|s| s.code())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for KxpProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.terminate();
        }
        // A namespace already gone took everything kxp had in it (its state directory
        // goes at a later kxp's start, see dataplane::statefile::remove_stale_dirs).
        let gone = !Path::new("/run/netns").join(&self.ns).exists();
        if !self.cleaned
            && !gone
            && let Err(e) = self.cleanup()
        {
            tracing::warn!(error = %e, namespace = %self.ns, "kxp cleanup after the run");
        }
    }
}

/// Whether `http://addr/healthz` answers 200 now, asked from inside `ns`.
///
/// # Errors
/// The namespace cannot be entered.
pub fn healthz_ok(ns: &str, addr: SocketAddr) -> anyhow::Result<bool> {
    join(spawn_in(ns, move || -> bool {
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let _ = s.write_all(b"GET /healthz HTTP/1.0\r\n\r\n");
        let mut r = String::new();
        let _ = s.read_to_string(&mut r);
        r.starts_with("HTTP/1.1 200")
    }))
}

/// Waits until `http://addr/healthz` answers 200 from inside `ns`.
pub fn wait_healthy(
    ns: &str,
    addr: SocketAddr,
    timeout: Duration,
    kxp: &mut KxpProcess,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(st)) = kxp.child.try_wait() {
            bail!(
                "kxp run exited ({st}) before becoming healthy:\n{}",
                kxp.log_text()
            );
        }
        if healthz_ok(ns, addr)? {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "kxp run did not become healthy in {timeout:?}:\n{}",
                kxp.log_text()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The demo.
pub fn demo() -> anyhow::Result<()> {
    if !dataplane::sys::is_root() {
        bail!("kxp demo creates network namespaces and attaches XDP programs: run it as root");
    }
    run("ip", &["-V"]).context("kxp demo needs iproute2 (bash tests/install-deps.sh)")?;
    let mut topo = Topology::new("kxd");
    let client = topo.add_ns("client")?;
    let node = topo.add_ns("node")?;
    topo.forwarding(&node)?;
    topo.link(
        (&node, "n-client", "198.18.1.1/24"),
        (&client, "eth0", "198.18.1.2/24"),
    )?;
    in_ns(
        &client,
        &["ip", "route", "add", "default", "via", "198.18.1.1"],
    )?;
    let mut interfaces = vec!["n-client".to_string()];
    let mut backend_ns = Vec::new();
    for (i, (_, node_side, pod_side)) in BACKENDS.iter().enumerate() {
        let ns = topo.add_ns(&format!("web{}", i + 1))?;
        let dev = format!("n-web{}", i + 1);
        topo.link((&node, &dev, node_side), (&ns, "eth0", pod_side))?;
        in_ns(
            &ns,
            &["ip", "route", "add", "default", "via", host(node_side)],
        )?;
        interfaces.push(dev);
        backend_ns.push(ns);
    }
    println!(
        "topology: client {client} -> node {node} (kxp) -> 3 backends (web-1..3), addresses from 198.18.0.0/15"
    );

    let dir = std::env::temp_dir().join(format!("kxp-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let _cleanup_dir = RemoveDir(dir.clone());
    let state = dir.join("state.yaml");
    let config = dir.join("kube-proxy.yaml");
    let eps: Vec<&str> = BACKENDS.iter().map(|b| host(b.2)).collect();
    std::fs::write(&state, state_yaml(&eps))?;
    std::fs::write(&config, CONFIG)?;

    let stop = Arc::new(AtomicBool::new(false));
    let mut backends = Vec::new();
    for (ns, (name, ..)) in backend_ns.iter().zip(BACKENDS) {
        backends.push(Backend::start(ns, name, stop.clone())?);
    }

    let healthz: SocketAddr = "127.0.0.1:10256".parse()?;
    let mut args: Vec<String> = Vec::new();
    for i in &interfaces {
        args.push("--interface".into());
        args.push(i.clone());
    }
    args.extend(
        [
            "--state-file",
            &state.display().to_string(),
            "--config",
            &config.display().to_string(),
            "--healthz-bind-address",
            &healthz.to_string(),
            "--workers",
            "1",
        ]
        .map(String::from),
    );
    let mut kxp = KxpProcess::spawn(&node, &args, &dir.join("kxp.log"))?;
    wait_healthy(&node, healthz, Duration::from_secs(20), &mut kxp)?;
    println!(
        "kxp run is up: {} interfaces attached, /healthz 200",
        interfaces.len()
    );

    // 300 HTTP connections through the VIP.
    let vip: SocketAddr = format!("{VIP}:80").parse()?;
    let t0 = Instant::now();
    let results = join(spawn_in(&client, move || {
        let mut spread: BTreeMap<String, u32> = BTreeMap::new();
        let mut failed = 0u32;
        for _ in 0..300 {
            match http_get(vip, Duration::from_secs(3)) {
                Ok(body) if !body.is_empty() => {
                    let name = body.split_whitespace().next().unwrap_or("").to_string();
                    *spread.entry(name).or_default() += 1
                }
                _ => failed += 1,
            }
        }
        (spread, failed)
    }))?;
    let elapsed = t0.elapsed();
    let (spread, failed) = results;
    let spread_text: Vec<String> = spread.iter().map(|(k, v)| format!("{k} {v}")).collect();
    println!(
        "300 HTTP connections to {vip}: {} ({failed} failed) in {:.2} s, {:.0} connections/s",
        spread_text.join(", "),
        elapsed.as_secs_f64(),
        300.0 / elapsed.as_secs_f64()
    );

    // Throughput: 64-byte UDP datagrams through the VIP for 2 s (bounded in count too).
    let sink: SocketAddr = format!("{VIP}:9").parse()?;
    let (sent, secs) = join(spawn_in(&client, move || {
        let s = UdpSocket::bind("0.0.0.0:0").ok()?;
        let payload = [b'.'; 18];
        let start = Instant::now();
        let mut sent = 0u64;
        while start.elapsed() < Duration::from_secs(2) && sent < 2_000_000 {
            for _ in 0..64 {
                if s.send_to(&payload, sink).is_ok() {
                    sent += 1;
                }
            }
        }
        Some((sent, start.elapsed().as_secs_f64()))
    }))?
    .context("UDP sender failed")?;
    std::thread::sleep(Duration::from_millis(300));
    let got: u64 = backends
        .iter()
        .map(|b| b.udp_received.load(Ordering::Relaxed))
        .sum();
    println!(
        "throughput: {sent} UDP datagrams sent in {secs:.1} s, {got} delivered to the backends: {:.0} packets/s through kxp (one worker, copy-mode AF_XDP on veth)",
        got as f64 / secs
    );

    // Scale to zero: new connections are refused at once.
    std::fs::write(&state, state_yaml(&[]))?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while !kxp.log_text().contains("generation 3") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let refused = join(spawn_in(&client, move || {
        let t = Instant::now();
        let r = TcpStream::connect_timeout(&vip, Duration::from_secs(3));
        (r.err().map(|e| e.kind()), t.elapsed())
    }))?;
    match refused {
        (Some(std::io::ErrorKind::ConnectionRefused), t) => println!(
            "scaled to zero: the next connection was refused in {:.1} ms (TCP RST from kxp), as kube-proxy's REJECT does",
            t.as_secs_f64() * 1e3
        ),
        (other, t) => {
            println!("scaled to zero: connection result {other:?} after {t:?} (expected a refusal)")
        }
    }

    let code = kxp.terminate();
    stop.store(true, Ordering::Relaxed);
    for b in backends {
        b.join();
    }
    let programs = || {
        in_ns(&node, &["ip", "-d", "link", "show"])
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .matches("prog/xdp")
                    .count()
            })
            .unwrap_or(0)
    };
    // A stopped kxp keeps its programs (holding Service traffic) and connections for the
    // next one; this one is not coming back: `kxp cleanup` removes them.
    let kept = programs();
    kxp.cleanup()?;
    let left = programs();
    println!(
        "kxp stopped (exit {}), keeping its steering for a next kxp ({kept} XDP programs); \
         after `kxp cleanup`, XDP programs left on the interfaces: {}",
        code.map_or("signal".to_string(), |c| c.to_string()),
        if left > 0 {
            "some (unexpected)"
        } else {
            "none"
        }
    );
    drop(topo);
    println!("removed the namespaces; done");
    Ok(())
}

struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
