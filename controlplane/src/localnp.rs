//! NodePorts on 127.0.0.1, as kube-proxy's iptables mode has them
//! (`iptables.localhostNodePorts`, true by default; IPv4 only): a connection from the
//! node to `127.0.0.1:NODEPORT` reaches the Service.
//!
//! kube-proxy does it with `route_localnet` and a DNAT rule; kxp's dataplane sees no
//! loopback traffic, so a small userspace forwarder does it (kube-proxy 1.37 moved to a
//! userspace forwarder for the same reason): one listener per IPv4 NodePort on
//! 127.0.0.1, each connection (TCP) or client (UDP) relayed to the Service's ClusterIP
//! and port. That relay is the node's own connection to the ClusterIP, which kxp
//! translates (masqueraded to the node's address, as kube-proxy masquerades localhost
//! NodePort traffic), and it reaches the Service's cluster-wide endpoints, as kube-proxy
//! sends traffic from the node itself to the Service chain whatever the
//! `externalTrafficPolicy`.
//!
//! Bounded: at most [`MAX_CONNECTIONS`] TCP connections and [`MAX_UDP_CLIENTS`] UDP
//! clients per NodePort at once (more are refused, or their datagrams dropped, and
//! counted in the log); a UDP client idle for [`UDP_IDLE`] is forgotten.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nat::Protocol;
use nat::snapshot::{Snapshot, Update};

/// TCP connections relayed at once per NodePort.
pub const MAX_CONNECTIONS: usize = 256;
/// UDP clients relayed at once per NodePort.
pub const MAX_UDP_CLIENTS: usize = 256;
/// A UDP client that sent nothing for this long is forgotten.
pub const UDP_IDLE: Duration = Duration::from_secs(30);
/// How often a listener looks at its stop flag.
const TICK: Duration = Duration::from_millis(200);

/// The running forwarders, one per (protocol, NodePort).
#[derive(Debug, Default)]
pub struct LocalhostNodePorts {
    running: BTreeMap<(Protocol, u16), Forwarder>,
    /// A NodePort could not be served at the last sync: look again at the next.
    retry: bool,
}

#[derive(Debug)]
struct Forwarder {
    target: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the forwarders should be for `snap`: every IPv4 NodePort to its ClusterIP and
/// port (TCP and UDP; SCTP has no userspace socket here).
pub fn wanted(snap: &Snapshot) -> BTreeMap<(Protocol, u16), SocketAddr> {
    snap.ports()
        .filter(|sp| sp.node_port != 0 && sp.cluster_ip.is_ipv4())
        .filter(|sp| matches!(sp.name.protocol, Protocol::Tcp | Protocol::Udp))
        .map(|sp| {
            (
                (sp.name.protocol, sp.node_port),
                SocketAddr::new(sp.cluster_ip, sp.port),
            )
        })
        .collect()
}

impl LocalhostNodePorts {
    /// Brings the forwarders in line with `u`'s snapshot; returns one line per NodePort
    /// that could not be served on 127.0.0.1 (its port taken), retried at the next sync.
    /// A sync that changed no NodePort (and has nothing to retry) costs nothing.
    pub fn sync(&mut self, u: &Update) -> Vec<String> {
        let node_ports_changed =
            u.full || u.added.iter().chain(&u.removed).any(|sp| sp.node_port != 0);
        if !node_ports_changed && !self.retry {
            return Vec::new();
        }
        let want = wanted(&u.snapshot);
        self.running
            .retain(|k, f| want.get(k).is_some_and(|t| *t == f.target));
        let mut errors = Vec::new();
        for (&(proto, port), &target) in &want {
            if self.running.contains_key(&(proto, port)) {
                continue;
            }
            match Forwarder::start(proto, port, target) {
                Ok(f) => {
                    self.running.insert((proto, port), f);
                }
                Err(e) => errors.push(format!(
                    "NodePort {port}/{proto} on 127.0.0.1 (iptables.localhostNodePorts): {e}"
                )),
            }
        }
        self.retry = !errors.is_empty();
        errors
    }

    /// The NodePorts served on 127.0.0.1.
    pub fn serving(&self) -> Vec<(Protocol, u16)> {
        self.running.keys().copied().collect()
    }
}

impl Forwarder {
    fn start(proto: Protocol, port: u16, target: SocketAddr) -> std::io::Result<Forwarder> {
        let at = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port);
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = match proto {
            Protocol::Udp => {
                let sock = UdpSocket::bind(at)?;
                sock.set_read_timeout(Some(TICK))?;
                std::thread::Builder::new()
                    .name(format!("kxp-localnp-u{port}"))
                    .spawn(move || serve_udp(sock, target, &s))?
            }
            _ => {
                let l = TcpListener::bind(at)?;
                l.set_nonblocking(true)?;
                std::thread::Builder::new()
                    .name(format!("kxp-localnp-t{port}"))
                    .spawn(move || serve_tcp(l, target, &s))?
            }
        };
        Ok(Forwarder {
            target,
            stop,
            thread: Some(thread),
        })
    }
}

fn serve_tcp(l: TcpListener, target: SocketAddr, stop: &Arc<AtomicBool>) {
    let open = Arc::new(AtomicUsize::new(0));
    let mut refused = 0u64;
    while !stop.load(Ordering::Relaxed) {
        match l.accept() {
            Ok((client, _)) => {
                if open.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
                    refused += 1;
                    if refused.is_power_of_two() {
                        tracing::warn!(
                            "localhost NodePort to {target}: {refused} connection(s) refused, {MAX_CONNECTIONS} open"
                        );
                    }
                    continue;
                }
                open.fetch_add(1, Ordering::Relaxed);
                let (open, stop) = (open.clone(), stop.clone());
                let spawned = std::thread::Builder::new()
                    .name("kxp-localnp-c".into())
                    .spawn(move || {
                        relay_tcp(client, target, &stop);
                        open.fetch_sub(1, Ordering::Relaxed);
                    });
                if spawned.is_err() {
                    // The closure (and its count) went with the failed spawn.
                    tracing::warn!("localhost NodePort to {target}: cannot start a relay thread");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(TICK / 4),
            Err(e) => {
                tracing::debug!("localhost NodePort to {target}: accept: {e}");
                std::thread::sleep(TICK / 4);
            }
        }
    }
}

/// Copies both ways between `client` and a new connection to `target` until both sides
/// closed, or `stop`.
fn relay_tcp(client: TcpStream, target: SocketAddr, stop: &Arc<AtomicBool>) {
    let Ok(upstream) = TcpStream::connect_timeout(&target, Duration::from_secs(5)) else {
        // As a refused or unanswered connection to the NodePort: the client sees a reset.
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (Ok(c2), Ok(u2)) = (client.try_clone(), upstream.try_clone()) else {
        return;
    };
    let stop2 = stop.clone();
    let back = std::thread::Builder::new()
        .name("kxp-localnp-r".into())
        .spawn(move || copy(u2, c2, &stop2));
    copy(client, upstream, stop);
    if let Ok(t) = back {
        let _ = t.join();
    }
}

fn copy(mut from: TcpStream, mut to: TcpStream, stop: &Arc<AtomicBool>) {
    let _ = from.set_read_timeout(Some(TICK));
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

struct UdpClient {
    upstream: Arc<UdpSocket>,
    last: Instant,
    reader: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
}

fn serve_udp(sock: UdpSocket, target: SocketAddr, stop: &Arc<AtomicBool>) {
    let sock = Arc::new(sock);
    let mut clients: HashMap<SocketAddr, UdpClient> = HashMap::new();
    let mut buf = vec![0u8; 65_536];
    let mut dropped = 0u64;
    let mut swept = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if swept.elapsed() >= TICK {
            swept = Instant::now();
            clients.retain(|_, c| {
                let keep = c.last.elapsed() < UDP_IDLE;
                if !keep {
                    c.stop.store(true, Ordering::Relaxed);
                }
                keep
            });
        }
        let (n, from) = match sock.recv_from(&mut buf) {
            Ok(r) => r,
            Err(_) => continue,
        };
        if !clients.contains_key(&from) {
            if clients.len() >= MAX_UDP_CLIENTS {
                dropped += 1;
                if dropped.is_power_of_two() {
                    tracing::warn!(
                        "localhost NodePort to {target}: {dropped} datagram(s) of new clients dropped, {MAX_UDP_CLIENTS} clients"
                    );
                }
                continue;
            }
            let Ok(up) = UdpSocket::bind("0.0.0.0:0").and_then(|u| {
                u.connect(target)?;
                u.set_read_timeout(Some(TICK))?;
                Ok(u)
            }) else {
                continue;
            };
            let upstream = Arc::new(up);
            let cstop = Arc::new(AtomicBool::new(false));
            let (u, s, back, st) = (upstream.clone(), sock.clone(), cstop.clone(), stop.clone());
            let reader = std::thread::Builder::new()
                .name("kxp-localnp-ur".into())
                .spawn(move || {
                    let mut buf = vec![0u8; 65_536];
                    while !back.load(Ordering::Relaxed) && !st.load(Ordering::Relaxed) {
                        if let Ok(n) = u.recv(&mut buf) {
                            let _ = s.send_to(&buf[..n], from);
                        }
                    }
                })
                .ok();
            clients.insert(
                from,
                UdpClient {
                    upstream,
                    last: Instant::now(),
                    reader,
                    stop: cstop,
                },
            );
        }
        if let Some(c) = clients.get_mut(&from) {
            c.last = Instant::now();
            let _ = c.upstream.send(&buf[..n]);
        }
    }
    for (_, mut c) in clients {
        c.stop.store(true, Ordering::Relaxed);
        if let Some(t) = c.reader.take() {
            let _ = t.join();
        }
    }
}
