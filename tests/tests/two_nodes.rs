//! End to end on a cluster of two nodes, each running its own `kxp run`, joined by a link
//! that stands for the wire (checksums complete on it, as a NIC leaves them): Service
//! traffic between pods of different nodes in both directions, masqueraded and not, a
//! NodePort whose endpoint is on the other node, and traffic straight to pods (from a pod
//! on the same node, from another node's pod, from outside the cluster and from the node
//! itself) while the same pods serve the Services. Run once with the nodes' conntrack off
//! (kxp forwards what it does not translate itself, partial checksums completed) and once
//! with a forward chain that drops conntrack-INVALID packets on both nodes, as Calico,
//! kube-proxy's KUBE-FORWARD and many host firewalls do (the kernel's own connections
//! must then stay on the kernel's path, both directions).
//!
//! ```text
//!  pod a1 198.18.10.2 ─vpa1─┐                           ┌─vpb1─ pod b1 198.18.20.2 (web-b1)
//!  pod a2 198.18.10.6 ─vpa2─┤ node-a ══wire0══ node-b   ├─vpb2─ pod b2 198.18.20.6
//!       (web-a2)            │ 198.18.30.1    198.18.30.2│
//!  ext 198.18.40.2 ─uplink──┘ 198.18.40.1
//! ```
//!
//! Services: web-b (ClusterIP 198.19.0.10, NodePort 30080/30009) → web-b1 on node-b;
//! web-a (198.19.0.11, NodePort 30081/30010) → web-a2 on node-a. Cluster CIDR
//! 198.18.0.0/19: the pods and the nodes' wire addresses are inside, `ext` is not.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use controlplane::demo::{Backend, KxpProcess, http_get, spawn_in, wait_healthy};
use controlplane::netns::{Topology, in_ns};
use kxp_tests::kxp_bin;

const NODE_A_IP: &str = "198.18.30.1";
const NODE_B_IP: &str = "198.18.30.2";
const WEB_B1: &str = "198.18.20.2";
const WEB_A2: &str = "198.18.10.6";
const VIP_B: &str = "198.19.0.10";
const VIP_A: &str = "198.19.0.11";

const STATE: &str = r#"apiVersion: v1
kind: Service
metadata: {name: web-b, namespace: demo}
spec:
  type: NodePort
  clusterIP: 198.19.0.10
  clusterIPs: [198.19.0.10]
  ipFamilies: [IPv4]
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30080}
  - {name: sink, port: 9, targetPort: 9000, protocol: UDP, nodePort: 30009}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-b-1
  namespace: demo
  labels: {kubernetes.io/service-name: web-b}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
- {name: sink, port: 9000, protocol: UDP}
endpoints:
- addresses: [198.18.20.2]
  nodeName: node-b
  conditions: {ready: true}
---
apiVersion: v1
kind: Service
metadata: {name: web-a, namespace: demo}
spec:
  type: NodePort
  clusterIP: 198.19.0.11
  clusterIPs: [198.19.0.11]
  ipFamilies: [IPv4]
  ports:
  - {name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30081}
  - {name: sink, port: 9, targetPort: 9000, protocol: UDP, nodePort: 30010}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-a-1
  namespace: demo
  labels: {kubernetes.io/service-name: web-a}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
- {name: sink, port: 9000, protocol: UDP}
endpoints:
- addresses: [198.18.10.6]
  nodeName: node-a
  conditions: {ready: true}
---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {name: kubernetes}
spec: {cidrs: [198.19.0.0/16]}
"#;

/// The nftables forward chain of a node whose firewall drops conntrack-INVALID packets.
const CT_INVALID_DROP: &str = "add table inet kxp-test-fw; add chain inet kxp-test-fw forward \
     { type filter hook forward priority 0; policy accept; ct state invalid counter drop; }";

struct Cluster {
    // Field order = drop order: kxp first, then servers, then namespaces.
    kxp: Vec<KxpProcess>,
    servers: Vec<Backend>,
    stop: Arc<AtomicBool>,
    topo: Topology,
    dir: PathBuf,
    /// node-a, node-b.
    nodes: [String; 2],
    /// Pod name (a1, a2, b1, b2) → namespace.
    pods: BTreeMap<&'static str, String>,
    /// A client outside the cluster, behind node-a's uplink.
    ext: String,
}

impl Cluster {
    fn new(prefix: &str) -> Cluster {
        assert!(
            dataplane::sys::is_root(),
            "the end-to-end tests create network namespaces and attach XDP programs: run them as root"
        );
        let mut topo = Topology::new(prefix);
        let a = topo.add_ns("node-a").unwrap();
        let b = topo.add_ns("node-b").unwrap();
        let ext = topo.add_ns("ext").unwrap();
        for n in [&a, &b] {
            topo.forwarding(n).unwrap();
        }
        // The wire: a NIC completes checksums before the wire, so nothing partial
        // crosses it (the one offload a test may turn off).
        topo.link(
            (&a, "wire0", &format!("{NODE_A_IP}/24")),
            (&b, "wire0", &format!("{NODE_B_IP}/24")),
        )
        .unwrap();
        for n in [&a, &b] {
            in_ns(n, &["ethtool", "-K", "wire0", "tx", "off"]).unwrap();
        }
        topo.link(
            (&a, "uplink", "198.18.40.1/24"),
            (&ext, "eth0", "198.18.40.2/24"),
        )
        .unwrap();
        in_ns(
            &ext,
            &["ip", "route", "add", "default", "via", "198.18.40.1"],
        )
        .unwrap();
        let mut pods = BTreeMap::new();
        for (pod, node, dev, host, addr) in [
            ("a1", &a, "vpa1", "198.18.10.1/30", "198.18.10.2/30"),
            ("a2", &a, "vpa2", "198.18.10.5/30", "198.18.10.6/30"),
            ("b1", &b, "vpb1", "198.18.20.1/30", "198.18.20.2/30"),
            ("b2", &b, "vpb2", "198.18.20.5/30", "198.18.20.6/30"),
        ] {
            let ns = topo.add_ns(&format!("pod-{pod}")).unwrap();
            topo.link((node, dev, host), (&ns, "eth0", addr)).unwrap();
            let gw = host.split('/').next().unwrap();
            in_ns(&ns, &["ip", "route", "add", "default", "via", gw]).unwrap();
            pods.insert(pod, ns);
        }
        for (node, dst, via) in [
            (&a, "198.18.20.0/24", NODE_B_IP),
            (&b, "198.18.10.0/24", NODE_A_IP),
            (&b, "198.18.40.0/24", NODE_A_IP),
        ] {
            in_ns(node, &["ip", "route", "add", dst, "via", via]).unwrap();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let servers = vec![
            Backend::start(&pods["b1"], "web-b1", stop.clone()).unwrap(),
            Backend::start(&pods["a2"], "web-a2", stop.clone()).unwrap(),
        ];
        let dir = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let state = dir.join("state.yaml");
        std::fs::write(&state, STATE).unwrap();
        let mut kxp = Vec::new();
        for (node, name, node_ip, pods_glob) in [
            (&a, "node-a", NODE_A_IP, "vpa*"),
            (&b, "node-b", NODE_B_IP, "vpb*"),
        ] {
            let config = dir.join(format!("{name}.yaml"));
            std::fs::write(
                &config,
                format!(
                    "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
                     mode: nftables\nclusterCIDR: 198.18.0.0/19\nhostnameOverride: {name}\n"
                ),
            )
            .unwrap();
            let mut args: Vec<String> = [
                "--interface",
                pods_glob,
                "--interface",
                "wire0",
                "--state-file",
                state.to_str().unwrap(),
                "--config",
                config.to_str().unwrap(),
                "--healthz-bind-address",
                "127.0.0.1:10256",
                "--node-ip",
                node_ip,
                "--workers",
                "1",
            ]
            .map(String::from)
            .to_vec();
            if name == "node-a" {
                args.extend(["--interface".to_string(), "uplink".to_string()]);
            }
            let log = dir.join(format!("kxp-{name}.log"));
            let mut p = KxpProcess::spawn_exe(&kxp_bin(), node, &args, &log).unwrap();
            wait_healthy(
                node,
                "127.0.0.1:10256".parse().unwrap(),
                Duration::from_secs(30),
                &mut p,
            )
            .unwrap();
            kxp.push(p);
        }
        Cluster {
            kxp,
            servers,
            stop,
            topo,
            dir,
            nodes: [a, b],
            pods,
            ext,
        }
    }

    fn logs(&self) -> String {
        self.kxp
            .iter()
            .zip(["node-a", "node-b"])
            .map(|(k, n)| format!("--- kxp on {n}:\n{}", k.log_text()))
            .collect()
    }

    /// `n` HTTP requests from namespace `from` to `to`, each on a new connection: how many
    /// were answered, and the peer addresses the server saw.
    fn http(&self, from: &str, to: SocketAddr, n: usize) -> (usize, Vec<String>) {
        spawn_in(from, move || {
            let mut ok = 0;
            let mut peers = Vec::new();
            for _ in 0..n {
                if let Ok(body) = http_get(to, Duration::from_secs(3)) {
                    let mut w = body.split_whitespace();
                    if w.next().is_some() {
                        ok += 1;
                        peers.push(w.next().unwrap_or("").to_string());
                    }
                }
            }
            (ok, peers)
        })
        .join()
        .unwrap()
        .unwrap()
    }

    /// `n` UDP datagrams from namespace `from` to `to`, each from a new socket: how many
    /// were answered from `to` itself.
    fn udp(&self, from: &str, to: SocketAddr, n: usize) -> usize {
        spawn_in(from, move || {
            let mut ok = 0;
            for _ in 0..n {
                let s = UdpSocket::bind("0.0.0.0:0").unwrap();
                s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                let _ = s.send_to(b"?", to);
                let mut buf = [0u8; 64];
                if let Ok((len, peer)) = s.recv_from(&mut buf)
                    && peer == to
                    && len > 0
                {
                    ok += 1;
                }
            }
            ok
        })
        .join()
        .unwrap()
        .unwrap()
    }

    /// kxp's metrics on node `i` (0: node-a, 1: node-b), once kxp has refreshed them
    /// after what the test just did (it does every second).
    fn metrics(&self, i: usize) -> String {
        std::thread::sleep(Duration::from_millis(1100));
        spawn_in(&self.nodes[i], || {
            let mut s = TcpStream::connect(("127.0.0.1", 10249)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            write!(s, "GET /metrics HTTP/1.0\r\n\r\n").unwrap();
            let mut r = String::new();
            let _ = s.read_to_string(&mut r);
            r
        })
        .join()
        .unwrap()
        .unwrap()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.kxp.clear();
        for s in self.servers.drain(..) {
            s.join();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = &self.topo;
    }
}

/// The value of a counter line `name{labels} value` of a metrics text (0 when absent).
fn counter(metrics: &str, name_and_labels: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn sa(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), port)
}

/// Every kind of traffic a node carries, through both kxp: (what, answered, sent).
fn every_kind_of_traffic(c: &Cluster) -> Vec<(String, usize, usize)> {
    let (a1, b2, ext) = (&c.pods["a1"], &c.pods["b2"], &c.ext);
    let node_a = &c.nodes[0];
    let mut out = Vec::new();
    let mut tcp = |what: &str, from: &str, to: SocketAddr, peer: Option<&str>| {
        let (ok, peers) = c.http(from, to, 20);
        let seen_ok = peer.is_none_or(|p| peers.iter().all(|x| x == p));
        out.push((
            format!("{what} (TCP {to}, peers {:?})", dedup(&peers)),
            if seen_ok { ok } else { 0 },
            20,
        ));
    };
    // Service traffic between nodes, both directions, not masqueraded: the endpoint
    // sees the client pod.
    tcp(
        "pod a1 -> ClusterIP -> web-b1 on node-b",
        a1,
        sa(VIP_B, 80),
        Some("198.18.10.2"),
    );
    tcp(
        "pod b2 -> ClusterIP -> web-a2 on node-a",
        b2,
        sa(VIP_A, 80),
        Some("198.18.20.6"),
    );
    // From outside the cluster: masqueraded by node-a.
    tcp(
        "ext -> ClusterIP via node-a -> web-b1",
        ext,
        sa(VIP_B, 80),
        Some(NODE_A_IP),
    );
    tcp(
        "ext -> NodePort on node-a -> web-b1 on node-b",
        ext,
        sa(NODE_A_IP, 30080),
        Some(NODE_A_IP),
    );
    // Straight to the pods, while they serve the Services.
    tcp(
        "pod a1 -> web-b1 directly (other node)",
        a1,
        sa(WEB_B1, 8080),
        Some("198.18.10.2"),
    );
    tcp(
        "pod a1 -> web-a2 directly (same node)",
        a1,
        sa(WEB_A2, 8080),
        Some("198.18.10.2"),
    );
    tcp(
        "ext -> web-a2 directly",
        ext,
        sa(WEB_A2, 8080),
        Some("198.18.40.2"),
    );
    tcp(
        "ext -> web-b1 directly (through node-a)",
        ext,
        sa(WEB_B1, 8080),
        Some("198.18.40.2"),
    );
    tcp(
        "node-a itself -> web-a2 directly",
        node_a,
        sa(WEB_A2, 8080),
        None,
    );
    tcp(
        "node-a itself -> web-b1 directly",
        node_a,
        sa(WEB_B1, 8080),
        None,
    );
    let mut udp = |what: &str, from: &str, to: SocketAddr| {
        let ok = c.udp(from, to, 10);
        out.push((format!("{what} (UDP {to})"), ok, 10));
    };
    udp("pod a1 -> ClusterIP -> web-b1", a1, sa(VIP_B, 9));
    udp("pod b2 -> ClusterIP -> web-a2", b2, sa(VIP_A, 9));
    udp(
        "ext -> NodePort on node-a -> web-b1",
        ext,
        sa(NODE_A_IP, 30009),
    );
    udp("pod a1 -> web-b1 directly", a1, sa(WEB_B1, 9000));
    udp("pod a1 -> web-a2 directly", a1, sa(WEB_A2, 9000));
    udp("ext -> web-b1 directly", ext, sa(WEB_B1, 9000));
    udp("ext -> web-a2 directly", ext, sa(WEB_A2, 9000));
    out
}

fn dedup(v: &[String]) -> Vec<String> {
    let mut v = v.to_vec();
    v.sort();
    v.dedup();
    v
}

fn assert_all_answered(c: &Cluster, phase: &str, results: &[(String, usize, usize)]) {
    let bad: Vec<_> = results.iter().filter(|(_, ok, n)| ok != n).collect();
    assert!(
        bad.is_empty(),
        "{phase}: not every connection was answered:\n{}\n{}",
        bad.iter()
            .map(|(w, ok, n)| format!("  {w}: {ok} of {n}"))
            .collect::<Vec<_>>()
            .join("\n"),
        c.logs()
    );
}

#[test]
fn two_nodes_running_kxp_carry_service_and_direct_pod_traffic_with_and_without_conntrack() {
    let c = Cluster::new("kx2n");
    // 1. No rule asks for conntrack in the nodes' namespaces: the kernel tracks nothing,
    //    so the endpoints' answers that kxp did not translate reach kxp's pass path,
    //    which forwards them as the kernel would (partial checksums completed).
    let results = every_kind_of_traffic(&c);
    assert_all_answered(&c, "conntrack off", &results);
    let kernel_flow = r#"kxp_xdp_packets_total{interface="vpb1",outcome="kernel_flow"}"#;
    let m = c.metrics(1);
    assert_eq!(counter(&m, kernel_flow), 0.0, "{m}");
    assert!(
        counter(&m, "kxp_pass_checksums_completed_total") > 0.0,
        "node-b's kxp completed no partial checksum on its pass path:\n{m}"
    );

    // 2. Both nodes drop conntrack-INVALID packets in forward: the kernel's own
    //    connections (direct pod traffic, Service traffic the other node translated)
    //    stay on the kernel's path, both directions, so its conntrack sees the answers.
    for n in &c.nodes {
        in_ns(n, &["nft", CT_INVALID_DROP]).unwrap();
    }
    let results = every_kind_of_traffic(&c);
    assert_all_answered(&c, "ct state invalid drop", &results);
    let m = c.metrics(1);
    assert!(
        counter(&m, kernel_flow) > 0.0,
        "node-b left no answer of web-b1 to its kernel:\n{m}"
    );
    let ruleset = in_ns(
        &c.nodes[1],
        &["nft", "list", "table", "inet", "kxp-test-fw"],
    )
    .unwrap();
    let text = String::from_utf8_lossy(&ruleset.stdout).into_owned();
    assert!(
        text.contains("counter packets 0 "),
        "node-b's firewall dropped conntrack-INVALID packets:\n{text}"
    );
}
