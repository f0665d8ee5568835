//! `kxp demo`: kxp's main job on an embedded default, end to end, on this machine.
//!
//! Builds a throw-away topology of network namespaces — a client, a node running
//! `kxp run`, and three `web` backends like the seeds' (ClusterIP port 80 → targetPort
//! 8080) — sends 300 real HTTP connections through the VIP, prints how they were spread,
//! scales the Service to zero and shows the immediate refusal, prints a short throughput
//! figure, and removes everything it made. Addresses come from 198.18.0.0/15 only, inside
//! its own namespaces.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use lab::{
    Backend, KxpProcess, Topology, VIP, http_get, in_ns, join, run, spawn_in, state_yaml,
    wait_healthy,
};

/// The three backends: name, the node's side and the pod's side of their veths.
const BACKENDS: [(&str, &str, &str); 3] = [
    ("web-1", "198.18.2.1/30", "198.18.2.2/30"),
    ("web-2", "198.18.2.5/30", "198.18.2.6/30"),
    ("web-3", "198.18.2.9/30", "198.18.2.10/30"),
];

fn host(cidr: &str) -> &str {
    cidr.split('/').next().unwrap_or(cidr)
}

const CONFIG: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nclusterCIDR: 198.18.2.0/24\n";

/// The demo.
pub fn demo() -> anyhow::Result<()> {
    if !lab::is_root() {
        bail!("kxp demo creates network namespaces and attaches XDP programs: run it as root");
    }
    run("ip", &["-V"]).context("kxp demo needs iproute2 (bash tests/install-deps.sh)")?;
    let lab = DemoLab::build()?;
    println!(
        "topology: client {} -> node {} (kxp) -> 3 backends (web-1..3), addresses from 198.18.0.0/15",
        lab.client, lab.node
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
    for (ns, (name, ..)) in lab.backends.iter().zip(BACKENDS) {
        backends.push(Backend::start(ns, name, stop.clone())?);
    }
    let mut kxp = start_kxp(&lab, &state, &config, &dir)?;

    let vip: SocketAddr = format!("{VIP}:80").parse()?;
    http_through_the_vip(&lab.client, vip)?;
    throughput(&lab.client, &backends)?;
    scale_to_zero(&lab.client, vip, &state, &kxp)?;

    let code = kxp.terminate();
    stop.store(true, Ordering::Relaxed);
    for b in backends {
        b.join();
    }
    stop_and_clean_up(&lab.node, code, &mut kxp)?;
    drop(lab);
    println!("removed the namespaces; done");
    Ok(())
}

/// The demo's namespaces: a client, the node, three backends.
struct DemoLab {
    client: String,
    node: String,
    backends: Vec<String>,
    /// The node's interfaces kxp attaches to.
    interfaces: Vec<String>,
    /// Removes them all when dropped.
    _topo: Topology,
}

impl DemoLab {
    fn build() -> anyhow::Result<DemoLab> {
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
        let mut backends = Vec::new();
        for (i, (_, node_side, pod_side)) in BACKENDS.iter().enumerate() {
            let ns = topo.add_ns(&format!("web{}", i + 1))?;
            let dev = format!("n-web{}", i + 1);
            topo.link((&node, &dev, node_side), (&ns, "eth0", pod_side))?;
            in_ns(
                &ns,
                &["ip", "route", "add", "default", "via", host(node_side)],
            )?;
            interfaces.push(dev);
            backends.push(ns);
        }
        Ok(DemoLab {
            client,
            node,
            backends,
            interfaces,
            _topo: topo,
        })
    }
}

/// `kxp run` on the node, on the state file and configuration, until healthy.
fn start_kxp(lab: &DemoLab, state: &Path, config: &Path, dir: &Path) -> anyhow::Result<KxpProcess> {
    let healthz: SocketAddr = "127.0.0.1:10256".parse()?;
    let mut args: Vec<String> = Vec::new();
    for i in &lab.interfaces {
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
    let mut kxp = KxpProcess::spawn(&lab.node, &args, &dir.join("kxp.log"))?;
    wait_healthy(&lab.node, healthz, Duration::from_secs(20), &mut kxp)?;
    println!(
        "kxp run is up: {} interfaces attached, /healthz 200",
        lab.interfaces.len()
    );
    Ok(kxp)
}

/// 300 HTTP connections through the VIP, and how they were spread.
fn http_through_the_vip(client: &str, vip: SocketAddr) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let results = join(spawn_in(client, move || {
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
    Ok(())
}

/// Throughput: 64-byte UDP datagrams through the VIP for 2 s (bounded in count too).
fn throughput(client: &str, backends: &[Backend]) -> anyhow::Result<()> {
    let sink: SocketAddr = format!("{VIP}:9").parse()?;
    let (sent, secs) = join(spawn_in(client, move || {
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
    Ok(())
}

/// Scale to zero: new connections are refused at once.
fn scale_to_zero(
    client: &str,
    vip: SocketAddr,
    state: &Path,
    kxp: &KxpProcess,
) -> anyhow::Result<()> {
    std::fs::write(state, state_yaml(&[]))?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while !kxp.log_text().contains("generation 3") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let refused = join(spawn_in(client, move || {
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
    Ok(())
}

/// After kxp stopped (exit `code`): what it kept for a next kxp, then `kxp cleanup`.
fn stop_and_clean_up(node: &str, code: Option<i32>, kxp: &mut KxpProcess) -> anyhow::Result<()> {
    let programs = || {
        in_ns(node, &["ip", "-d", "link", "show"])
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
    Ok(())
}

struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
