//! kube-proxy's service health servers (`pkg/proxy/healthcheck/service_health.go`): one
//! HTTP listener per LoadBalancer Service with `externalTrafficPolicy: Local`, on its
//! `healthCheckNodePort`, that cloud load balancers probe to learn which nodes have
//! endpoints of the Service.
//!
//! Any request gets `200` while this node has a ready local endpoint of the Service and
//! kxp is healthy, else `503`, with kube-proxy's headers (`X-Load-Balancing-Endpoint-
//! Weight`: the local endpoint count) and body (indented with tabs by kube-proxy):
//!
//! ```text
//! {
//!     "service": {
//!         "namespace": "ns",
//!         "name": "name"
//!     },
//!     "localEndpoints": 1,
//!     "serviceProxyHealthy": true
//! }
//! ```
//!
//! The listeners bind the NodePort addresses (every address when `nodePortAddresses`
//! matches all) and are served by one thread. The set of Services is kept by difference
//! from each published update, so a sync costs what changed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use nat::model::{NodePortAddresses, ServicePort};
use nat::snapshot::Update;
use nat::tracker::ObjKey;

use crate::health::Health;
use crate::http::Response;

#[derive(Debug)]
struct Instance {
    port: u16,
    listeners: Vec<TcpListener>,
    endpoints: usize,
}

#[derive(Debug, Default)]
struct State {
    services: BTreeMap<ObjKey, Instance>,
}

/// The running health servers.
#[derive(Debug)]
pub struct ServiceHealthServers {
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Service ports that have a healthCheckNodePort, by Service.
    ports: HashMap<ObjKey, Vec<Arc<ServicePort>>>,
    /// The addresses listeners are bound to (empty: all).
    addrs: Vec<IpAddr>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// kube-proxy's body, byte for byte (tabs from its dedented template).
pub fn body(ns: &str, name: &str, endpoints: usize, healthy: bool) -> String {
    let q = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {endpoints},\n\t\"serviceProxyHealthy\": {healthy}\n}}",
        q(ns),
        q(name)
    )
}

impl ServiceHealthServers {
    /// Starts the serving thread (no listeners yet).
    ///
    /// # Errors
    /// The thread cannot be started.
    pub fn start(health: Arc<Health>) -> std::io::Result<ServiceHealthServers> {
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("kxp-hcnp".into())
            .spawn(move || serve_loop(&st, &sp, &health))?;
        Ok(ServiceHealthServers {
            state,
            stop,
            thread: Some(thread),
            ports: HashMap::new(),
            addrs: Vec::new(),
        })
    }

    /// Brings the listeners and counts in line with a published update; returns one
    /// line per listener that could not be opened (kube-proxy logs these and retries at
    /// the next sync).
    pub fn sync(&mut self, u: &Update) -> Vec<String> {
        let mut touched = BTreeSet::new();
        if u.full {
            touched.extend(self.ports.keys().cloned());
            self.ports.clear();
            for sp in u.snapshot.ports() {
                self.add(sp, &mut touched);
            }
        } else {
            for sp in &u.removed {
                let key = key(sp);
                if let Some(v) = self.ports.get_mut(&key) {
                    v.retain(|p| !Arc::ptr_eq(p, sp));
                    if v.is_empty() {
                        self.ports.remove(&key);
                    }
                    touched.insert(key);
                }
            }
            for sp in &u.added {
                self.add(sp, &mut touched);
            }
        }
        let addrs = match &u.snapshot.node.node_port_addresses {
            NodePortAddresses::All => Vec::new(),
            NodePortAddresses::Addrs(a) => a.clone(),
        };
        let mut st = lock(&self.state);
        if addrs != self.addrs {
            // Rebind everything on the new addresses.
            self.addrs = addrs;
            touched.extend(st.services.keys().cloned());
            st.services.clear();
        }
        let mut errors = Vec::new();
        for key in touched {
            let want = self
                .ports
                .get(&key)
                .and_then(|v| v.iter().map(|p| p.health_check_node_port).find(|&p| p != 0));
            let endpoints = self.ports.get(&key).map_or(0, |v| local_ready_ips(v));
            match (want, st.services.get_mut(&key)) {
                (None, _) => {
                    st.services.remove(&key);
                }
                (Some(port), Some(inst)) if inst.port == port => inst.endpoints = endpoints,
                (Some(port), _) => {
                    st.services.remove(&key);
                    match listen(&self.addrs, port) {
                        Ok(listeners) => {
                            st.services.insert(
                                key,
                                Instance {
                                    port,
                                    listeners,
                                    endpoints,
                                },
                            );
                        }
                        Err(e) => errors.push(format!(
                            "cannot open healthCheckNodePort {port} of Service {}/{}: {e}",
                            key.0, key.1
                        )),
                    }
                }
            }
        }
        errors
    }

    fn add(&mut self, sp: &Arc<ServicePort>, touched: &mut BTreeSet<ObjKey>) {
        if sp.health_check_node_port == 0 {
            return;
        }
        let key = key(sp);
        self.ports.entry(key.clone()).or_default().push(sp.clone());
        touched.insert(key);
    }

    /// Closes every listener and stops the thread.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ServiceHealthServers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn key(sp: &ServicePort) -> ObjKey {
    (sp.name.namespace.clone(), sp.name.name.clone())
}

/// kube-proxy's `LocalReadyEndpoints`: distinct IPs of ready endpoints on this node, over
/// every port and family of the Service.
fn local_ready_ips(ports: &[Arc<ServicePort>]) -> usize {
    let ips: BTreeSet<IpAddr> = ports
        .iter()
        .flat_map(|p| p.endpoints.iter())
        .filter(|e| e.is_local && e.ready)
        .map(|e| e.addr.ip())
        .collect();
    ips.len()
}

fn listen(addrs: &[IpAddr], port: u16) -> std::io::Result<Vec<TcpListener>> {
    let bind = |ip: IpAddr| -> std::io::Result<TcpListener> {
        let l = TcpListener::bind(SocketAddr::new(ip, port))?;
        l.set_nonblocking(true)?;
        Ok(l)
    };
    if addrs.is_empty() {
        // Every address: `[::]` takes IPv4 too (dual stack); without IPv6, `0.0.0.0`.
        return match bind(IpAddr::V6(Ipv6Addr::UNSPECIFIED)) {
            Ok(l) => Ok(vec![l]),
            Err(_) => Ok(vec![bind(IpAddr::V4(Ipv4Addr::UNSPECIFIED))?]),
        };
    }
    addrs.iter().map(|&ip| bind(ip)).collect()
}

fn serve_loop(state: &Mutex<State>, stop: &AtomicBool, health: &Health) {
    while !stop.load(Ordering::Relaxed) {
        let mut accepted = Vec::new();
        {
            let st = lock(state);
            for (key, inst) in &st.services {
                for l in &inst.listeners {
                    while let Ok((stream, _)) = l.accept() {
                        accepted.push((stream, key.clone(), inst.endpoints));
                    }
                }
            }
        }
        if accepted.is_empty() {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        let healthy = health.is_healthy();
        for (stream, (ns, name), endpoints) in accepted {
            let _ = crate::http::serve(stream, &|_method, _path| Response {
                status: if endpoints != 0 && healthy {
                    "200 OK"
                } else {
                    "503 Service Unavailable"
                },
                content_type: "application/json",
                body: body(&ns, &name, endpoints, healthy),
                headers: vec![("X-Load-Balancing-Endpoint-Weight", endpoints.to_string())],
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_kube_proxys() {
        assert_eq!(
            body("demo", "web", 2, true),
            "{\n\t\"service\": {\n\t\t\"namespace\": \"demo\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 2,\n\t\"serviceProxyHealthy\": true\n}"
        );
        let v: serde_json::Value = serde_json::from_str(&body("a\"b", "c", 0, false)).unwrap();
        assert_eq!(v["service"]["namespace"], "a\"b");
        assert_eq!(v["serviceProxyHealthy"], false);
    }
}
