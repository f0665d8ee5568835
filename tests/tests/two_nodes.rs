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
//! Every link is dual-stack: 2001:db8:P::/64 beside 198.18.P.0, pods 2001:db8:10:1::2
//! (a1), 2001:db8:10:2::2 (a2), 2001:db8:20:1::2 (b1), 2001:db8:20:2::2 (b2), the wire
//! 2001:db8:30::1/::2, ext 2001:db8:40::2. Services (dual-stack): web-b (ClusterIPs
//! 198.19.0.10 and 2001:db8:ffff::10, NodePort 30080/30009) → web-b1 on node-b; web-a
//! (198.19.0.11, 2001:db8:ffff::11, NodePort 30081/30010) → web-a2 on node-a. Cluster
//! CIDRs 198.18.0.0/19 and 2001:db8::/42: the pods and the nodes' wire addresses are
//! inside, `ext` is not. No `--node-ip`: each kxp finds its node's addresses in its Node
//! object (InternalIP, both families), as a DaemonSet's does.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kxp_tests::{CT_INVALID_DROP, add6, metric};
use lab::{Backend, KxpProcess, http_get, spawn_in};
use lab::{Topology, in_ns};
use socket2::{Domain, Protocol, Socket, Type};

const NODE_A_IP: &str = "198.18.30.1";
const NODE_B_IP: &str = "198.18.30.2";

/// The addresses one family gives the cluster.
struct Plan {
    node_a: &'static str,
    node_b: &'static str,
    a1: &'static str,
    b2: &'static str,
    ext: &'static str,
    web_b1: &'static str,
    web_a2: &'static str,
    vip_b: &'static str,
    vip_a: &'static str,
}

const V4: Plan = Plan {
    node_a: NODE_A_IP,
    node_b: NODE_B_IP,
    a1: "198.18.10.2",
    b2: "198.18.20.6",
    ext: "198.18.40.2",
    web_b1: "198.18.20.2",
    web_a2: "198.18.10.6",
    vip_b: "198.19.0.10",
    vip_a: "198.19.0.11",
};

const V6: Plan = Plan {
    node_a: "2001:db8:30::1",
    node_b: "2001:db8:30::2",
    a1: "2001:db8:10:1::2",
    b2: "2001:db8:20:2::2",
    ext: "2001:db8:40::2",
    web_b1: "2001:db8:20:1::2",
    web_a2: "2001:db8:10:2::2",
    vip_b: "2001:db8:ffff::10",
    vip_a: "2001:db8:ffff::11",
};

/// One dual-stack NodePort Service `name` (ClusterIPs `vip4`, `vip6`; port 80 → 8080 TCP
/// on NodePort `np`, 9 → 9000 UDP on NodePort `np` - 71, 10 → 9001 UDP, a port the pod
/// does not listen on: it answers with ICMP port unreachable) with one endpoint pod on
/// `node`, as the API has it: a Service and an EndpointSlice per family.
fn service(
    name: &str,
    vip4: &str,
    vip6: &str,
    np: u16,
    ep4: &str,
    ep6: &str,
    node: &str,
) -> String {
    let sink = np - 71;
    let slice = |family: &str, suffix: &str, ep: &str| {
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-{suffix}\n  \
             namespace: demo\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: {family}\n\
             ports:\n- {{name: http, port: 8080, protocol: TCP}}\n- {{name: sink, port: 9000, protocol: UDP}}\n\
             - {{name: closed, port: {CLOSED}, protocol: UDP}}\nendpoints:\n- addresses: [\"{ep}\"]\n  nodeName: {node}\n  conditions: {{ready: true}}\n---\n"
        )
    };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: demo}}\nspec:\n  type: NodePort\n  \
         clusterIP: {vip4}\n  clusterIPs: [{vip4}, \"{vip6}\"]\n  ipFamilies: [IPv4, IPv6]\n  \
         ipFamilyPolicy: RequireDualStack\n  ports:\n  \
         - {{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: {np}}}\n  \
         - {{name: sink, port: 9, targetPort: 9000, protocol: UDP, nodePort: {sink}}}\n  \
         - {{name: closed, port: 10, targetPort: {CLOSED}, protocol: UDP}}\n---\n{}{}",
        slice("IPv4", "1", ep4),
        slice("IPv6", "6", ep6)
    )
}

/// An endpoint port (UDP) no pod listens on.
const CLOSED: u16 = 9001;

/// The Node object of `name` with its two InternalIPs.
fn node(name: &str, v4: &str, v6: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {name}}}\nstatus:\n  addresses: \
         [{{type: InternalIP, address: {v4}}}, {{type: InternalIP, address: \"{v6}\"}}, \
         {{type: Hostname, address: {name}}}]\n---\n"
    )
}

/// The cluster's objects: web-b and web-a, the ServiceCIDRs, both Nodes.
fn cluster_state() -> String {
    [
        service(
            "web-b", V4.vip_b, V6.vip_b, 30080, V4.web_b1, V6.web_b1, "node-b",
        ),
        service(
            "web-a", V4.vip_a, V6.vip_a, 30081, V4.web_a2, V6.web_a2, "node-a",
        ),
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\n\
         spec: {cidrs: [198.19.0.0/16, \"2001:db8:ffff::/112\"]}\n---\n"
            .to_string(),
        node("node-a", V4.node_a, V6.node_a),
        node("node-b", V4.node_b, V6.node_b),
    ]
    .concat()
}

struct Cluster {
    // Field order = drop order: kxp first, then servers, then namespaces.
    kxp: Vec<KxpProcess>,
    servers: Vec<Backend>,
    servers6: Vec<std::thread::JoinHandle<()>>,
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
        add6(&a, "wire0", "2001:db8:30::1/64");
        add6(&b, "wire0", "2001:db8:30::2/64");
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
        add6(&a, "uplink", "2001:db8:40::1/64");
        add6(&ext, "eth0", "2001:db8:40::2/64");
        in_ns(
            &ext,
            &[
                "ip",
                "-6",
                "route",
                "add",
                "default",
                "via",
                "2001:db8:40::1",
            ],
        )
        .unwrap();
        let mut pods = BTreeMap::new();
        for (pod, node, dev, host, addr, net6) in [
            (
                "a1",
                &a,
                "vpa1",
                "198.18.10.1/30",
                "198.18.10.2/30",
                "2001:db8:10:1",
            ),
            (
                "a2",
                &a,
                "vpa2",
                "198.18.10.5/30",
                "198.18.10.6/30",
                "2001:db8:10:2",
            ),
            (
                "b1",
                &b,
                "vpb1",
                "198.18.20.1/30",
                "198.18.20.2/30",
                "2001:db8:20:1",
            ),
            (
                "b2",
                &b,
                "vpb2",
                "198.18.20.5/30",
                "198.18.20.6/30",
                "2001:db8:20:2",
            ),
        ] {
            let ns = topo.add_ns(&format!("pod-{pod}")).unwrap();
            topo.link((node, dev, host), (&ns, "eth0", addr)).unwrap();
            let gw = host.split('/').next().unwrap();
            in_ns(&ns, &["ip", "route", "add", "default", "via", gw]).unwrap();
            add6(node, dev, &format!("{net6}::1/64"));
            add6(&ns, "eth0", &format!("{net6}::2/64"));
            let gw6 = format!("{net6}::1");
            in_ns(&ns, &["ip", "-6", "route", "add", "default", "via", &gw6]).unwrap();
            pods.insert(pod, ns);
        }
        for (node, dst, via) in [
            (&a, "198.18.20.0/24", NODE_B_IP),
            (&b, "198.18.10.0/24", NODE_A_IP),
            (&b, "198.18.40.0/24", NODE_A_IP),
            (&a, "2001:db8:20::/48", "2001:db8:30::2"),
            (&b, "2001:db8:10::/48", "2001:db8:30::1"),
            (&b, "2001:db8:40::/64", "2001:db8:30::1"),
        ] {
            in_ns(node, &["ip", "route", "add", dst, "via", via]).unwrap();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let servers = vec![
            Backend::start(&pods["b1"], "web-b1", stop.clone()).unwrap(),
            Backend::start(&pods["a2"], "web-a2", stop.clone()).unwrap(),
        ];
        let servers6 = vec![
            V6Server::start(&pods["b1"], "web-b1", stop.clone()),
            V6Server::start(&pods["a2"], "web-a2", stop.clone()),
        ];
        let dir = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let state = dir.join("state.yaml");
        std::fs::write(&state, cluster_state()).unwrap();
        let mut kxp = Vec::new();
        for (node, name, pods_glob) in [(&a, "node-a", "vpa*"), (&b, "node-b", "vpb*")] {
            let config = dir.join(format!("{name}.yaml"));
            std::fs::write(
                &config,
                format!(
                    "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
                     mode: nftables\nclusterCIDR: 198.18.0.0/19,2001:db8::/42\nhostnameOverride: {name}\n"
                ),
            )
            .unwrap();
            let interfaces: &[&str] = if name == "node-a" {
                &[pods_glob, "wire0", "uplink"]
            } else {
                &[pods_glob, "wire0"]
            };
            let log = dir.join(format!("kxp-{name}.log"));
            let p = kxp_tests::start_node_kxp(node, interfaces, &state, &config, 1, &log);
            kxp.push(p);
        }
        Cluster {
            kxp,
            servers,
            servers6,
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
    /// were answered from `to` itself. With `echo` bytes, each datagram is `!` and that
    /// many bytes (3,000: fragments both ways on 1,500-MTU links), and its answer must be
    /// the server's name, `:`, and the datagram.
    fn udp(&self, from: &str, to: SocketAddr, n: usize, echo: usize) -> usize {
        spawn_in(from, move || {
            let mut ok = 0;
            for i in 0..n {
                let any = if to.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" };
                let s = UdpSocket::bind(any).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                let msg: Vec<u8> = if echo == 0 {
                    b"?".to_vec()
                } else {
                    std::iter::once(b'!')
                        .chain((0..echo).map(|j| (i + j) as u8))
                        .collect()
                };
                let _ = s.send_to(&msg, to);
                let mut buf = vec![0u8; 8192];
                if let Ok((len, peer)) = s.recv_from(&mut buf)
                    && peer == to
                    && len > 0
                {
                    let answer = &buf[..len];
                    let colon = answer.iter().position(|&b| b == b':');
                    if echo == 0 || colon.is_some_and(|c| answer[c + 1..] == msg[..]) {
                        ok += 1;
                    }
                }
            }
            ok
        })
        .join()
        .unwrap()
        .unwrap()
    }

    /// `n` UDP datagrams from namespace `from` to `to` (a port nobody listens on), each
    /// from a new connected socket: how many were answered with an ICMP port unreachable
    /// that the client's kernel matched to its socket (`ECONNREFUSED`).
    fn refused(&self, from: &str, to: SocketAddr, n: usize) -> usize {
        spawn_in(from, move || {
            let mut ok = 0;
            for _ in 0..n {
                let any = if to.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" };
                let s = UdpSocket::bind(any).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                s.connect(to).unwrap();
                let _ = s.send(b"?");
                let mut buf = [0u8; 64];
                if let Err(e) = s.recv(&mut buf)
                    && e.kind() == std::io::ErrorKind::ConnectionRefused
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
        for t in self.servers6.drain(..) {
            let _ = t.join();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = &self.topo;
    }
}

/// The IPv6 side of a pod's servers (the demo's `Backend` listens on IPv4): on
/// [::]:8080 an HTTP answer `NAME PEER`, on [::]:9000 UDP `?` answered with `NAME`, both
/// IPv6-only beside the IPv4 listeners on the same ports.
struct V6Server;

impl V6Server {
    fn start(ns: &str, name: &'static str, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
        let ns = ns.to_string();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || {
            lab::enter_netns(&ns).unwrap();
            let bind = |ty: Type, proto: Protocol| {
                let s = Socket::new(Domain::IPV6, ty, Some(proto)).unwrap();
                s.set_only_v6(true).unwrap();
                s.set_reuse_address(true).unwrap();
                let port = if ty == Type::STREAM { 8080 } else { 9000 };
                s.bind(&SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)).into())
                    .unwrap();
                s
            };
            let tcp = bind(Type::STREAM, Protocol::TCP);
            tcp.listen(128).unwrap();
            let tcp: std::net::TcpListener = tcp.into();
            tcp.set_nonblocking(true).unwrap();
            let udp: UdpSocket = bind(Type::DGRAM, Protocol::UDP).into();
            udp.set_read_timeout(Some(Duration::from_millis(5)))
                .unwrap();
            ready_tx.send(()).unwrap();
            let mut buf = [0u8; 8192];
            while !stop.load(Ordering::Relaxed) {
                if let Ok((mut c, peer)) = tcp.accept() {
                    let _ = c.set_nonblocking(false);
                    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
                    let _ = c.read(&mut buf);
                    let body = format!("{name} {}\n", peer.ip());
                    let _ = write!(
                        c,
                        "HTTP/1.0 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                }
                if let Ok((n, peer)) = udp.recv_from(&mut buf)
                    && n > 0
                {
                    if buf[0] == b'?' {
                        let _ = udp.send_to(name.as_bytes(), peer);
                    } else if buf[0] == b'!' {
                        // Echo, behind the name (large datagrams come back large).
                        let mut reply = format!("{name}:").into_bytes();
                        reply.extend_from_slice(&buf[..n]);
                        let _ = udp.send_to(&reply, peer);
                    }
                }
            }
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the IPv6 servers started");
        h
    }
}

fn sa(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), port)
}

/// Every kind of traffic a node carries, through both kxp, in both families: (what,
/// answered, sent).
fn every_kind_of_traffic(c: &Cluster) -> Vec<(String, usize, usize)> {
    let (a1, b2, ext) = (&c.pods["a1"], &c.pods["b2"], &c.ext);
    let node_a = &c.nodes[0];
    let mut out = Vec::new();
    for (family, p) in [("IPv4", &V4), ("IPv6", &V6)] {
        let mut tcp = |what: &str, from: &str, to: SocketAddr, peer: Option<&str>| {
            let (ok, peers) = c.http(from, to, 20);
            let seen_ok = peer.is_none_or(|p| peers.iter().all(|x| x == p));
            out.push((
                format!("{family} {what} (TCP {to}, peers {:?})", dedup(&peers)),
                if seen_ok { ok } else { 0 },
                20,
            ));
        };
        // Service traffic between nodes, both directions, not masqueraded: the endpoint
        // sees the client pod.
        let (vip_a, vip_b) = (sa(p.vip_a, 80), sa(p.vip_b, 80));
        tcp(
            "pod a1 -> ClusterIP -> web-b1 on node-b",
            a1,
            vip_b,
            Some(p.a1),
        );
        tcp(
            "pod b2 -> ClusterIP -> web-a2 on node-a",
            b2,
            vip_a,
            Some(p.b2),
        );
        // From outside the cluster: masqueraded by node-a.
        tcp(
            "ext -> ClusterIP via node-a -> web-b1",
            ext,
            vip_b,
            Some(p.node_a),
        );
        let np = sa(p.node_a, 30080);
        tcp(
            "ext -> NodePort on node-a -> web-b1 on node-b",
            ext,
            np,
            Some(p.node_a),
        );
        let np_b = sa(p.node_b, 30081);
        tcp(
            "pod b2 -> NodePort on node-b -> web-a2 on node-a",
            b2,
            np_b,
            None,
        );
        // Straight to the pods, while they serve the Services.
        let (web_b1, web_a2) = (sa(p.web_b1, 8080), sa(p.web_a2, 8080));
        tcp(
            "pod a1 -> web-b1 directly (other node)",
            a1,
            web_b1,
            Some(p.a1),
        );
        tcp(
            "pod a1 -> web-a2 directly (same node)",
            a1,
            web_a2,
            Some(p.a1),
        );
        tcp("ext -> web-a2 directly", ext, web_a2, Some(p.ext));
        tcp(
            "ext -> web-b1 directly (through node-a)",
            ext,
            web_b1,
            Some(p.ext),
        );
        tcp("node-a itself -> web-a2 directly", node_a, web_a2, None);
        tcp("node-a itself -> web-b1 directly", node_a, web_b1, None);
        let mut udp = |what: &str, from: &str, to: SocketAddr| {
            let ok = c.udp(from, to, 10, 0);
            out.push((format!("{family} {what} (UDP {to})"), ok, 10));
            // 3,000-byte datagrams: fragments both ways (the answers' later fragments
            // follow their first fragment's path, the kernel's or kxp's).
            let ok = c.udp(from, to, 5, 3000);
            out.push((format!("{family} {what} (UDP {to}, 3,000 bytes)"), ok, 5));
        };
        udp("pod a1 -> ClusterIP -> web-b1", a1, sa(p.vip_b, 9));
        udp("pod b2 -> ClusterIP -> web-a2", b2, sa(p.vip_a, 9));
        udp(
            "ext -> NodePort on node-a -> web-b1",
            ext,
            sa(p.node_a, 30009),
        );
        udp("pod a1 -> web-b1 directly", a1, sa(p.web_b1, 9000));
        udp("pod a1 -> web-a2 directly", a1, sa(p.web_a2, 9000));
        udp("ext -> web-b1 directly", ext, sa(p.web_b1, 9000));
        udp("ext -> web-a2 directly", ext, sa(p.web_a2, 9000));
        // ICMP errors: a pod's port unreachable, about traffic straight to it (the
        // kernel's, to be carried as the kernel would) and about Service traffic (kxp's,
        // translated back to the VIP).
        // Two each: a host sends a burst of 6 ICMP errors to one destination, then one a
        // second (icmp_ratelimit, per destination), and web-b1 answers a1 four times here.
        let mut refused = |what: &str, from: &str, to: SocketAddr| {
            let ok = c.refused(from, to, 2);
            out.push((
                format!("{family} {what} (UDP {to}: port unreachable)"),
                ok,
                2,
            ));
        };
        refused("ext -> web-b1 directly", ext, sa(p.web_b1, CLOSED));
        refused("ext -> web-a2 directly", ext, sa(p.web_a2, CLOSED));
        refused("pod a1 -> web-b1 directly", a1, sa(p.web_b1, CLOSED));
        refused("pod a1 -> web-a2 directly", a1, sa(p.web_a2, CLOSED));
        refused("pod a1 -> ClusterIP -> web-b1", a1, sa(p.vip_b, 10));
        refused(
            "ext -> ClusterIP via node-a -> web-b1",
            ext,
            sa(p.vip_b, 10),
        );
    }
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
    assert_eq!(metric(&m, kernel_flow), 0.0, "{m}");
    assert!(
        metric(&m, "kxp_pass_checksums_completed_total") > 0.0,
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
        metric(&m, kernel_flow) > 0.0,
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
