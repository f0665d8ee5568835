//! The lab's web Service: its state file (a NodePort Service `web` with its
//! EndpointSlice and the ServiceCIDR) and its backends' servers (HTTP, TCP echo, UDP).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context as _;

use crate::process::spawn_in;

/// The Service's virtual IP.
pub const VIP: &str = "198.19.0.10";

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
        let (stop_h, tx2) = (stop.clone(), tx.clone());
        let http = spawn_in(ns, move || serve_http(name, &stop_h, &tx2));
        let (count, stop_u, tx_u) = (udp_received.clone(), stop.clone(), tx.clone());
        let udp = spawn_in(ns, move || serve_udp(name, &stop_u, &tx_u, &count));
        let echo = spawn_in(ns, move || serve_echo(name, &stop, &tx));
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

/// Whether the server started (its socket bound) or why not.
type Started = std::sync::mpsc::Sender<std::io::Result<()>>;

/// A listening TCP socket on `addr`, non-blocking, said on `started`.
fn listen(addr: &str, started: &Started) -> Option<TcpListener> {
    match TcpListener::bind(addr).and_then(|l| l.set_nonblocking(true).map(|_| l)) {
        Ok(l) => {
            let _ = started.send(Ok(()));
            Some(l)
        }
        Err(e) => {
            let _ = started.send(Err(e));
            None
        }
    }
}

/// HTTP on 8080: every request answered with `NAME PEER-ADDRESS`, until `stop`.
fn serve_http(name: &str, stop: &AtomicBool, started: &Started) {
    let Some(l) = listen("0.0.0.0:8080", started) else {
        return;
    };
    while !stop.load(Ordering::Relaxed) {
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
}

/// UDP on 9000: datagrams counted in `count`; `?` answered with `NAME`, `!` echoed
/// behind `NAME:`, until `stop`.
fn serve_udp(name: &str, stop: &AtomicBool, started: &Started, count: &AtomicU64) {
    let s = match UdpSocket::bind("0.0.0.0:9000") {
        Ok(s) => {
            let _ = started.send(Ok(()));
            s
        }
        Err(e) => {
            let _ = started.send(Err(e));
            return;
        }
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(50)));
    let mut buf = vec![0u8; 65_536];
    while !stop.load(Ordering::Relaxed) {
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
}

/// A TCP echo on 7000 for long-lived connections (each message back behind `NAME:`),
/// until `stop`.
fn serve_echo(name: &str, stop: &AtomicBool, started: &Started) {
    let Some(l) = listen("0.0.0.0:7000", started) else {
        return;
    };
    let mut conns: Vec<TcpStream> = Vec::new();
    let mut buf = [0u8; 1024];
    while !stop.load(Ordering::Relaxed) {
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
}
