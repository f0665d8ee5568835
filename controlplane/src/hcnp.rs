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
//! matches all) and are served with kxp's other HTTP servers (`crate::http`: each
//! connection concurrently, with limits). The set of Services is kept by difference
//! from each published update, so a sync costs what changed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use nat::model::{NodePortAddresses, ServicePort};
use nat::snapshot::Update;
use translate::tracker::ObjKey;

use crate::health::Health;
use crate::http::{HttpServer, Response};

#[derive(Debug)]
struct Instance {
    port: u16,
    /// One per listening address; each connection is served concurrently (see
    /// [`crate::http`]). Held for their life: dropped, they close.
    _servers: Vec<HttpServer>,
    /// Local ready endpoints, read by the servers at every request.
    endpoints: Arc<AtomicUsize>,
}

/// The running health servers.
#[derive(Debug)]
pub struct ServiceHealthServers {
    health: Arc<Health>,
    services: BTreeMap<ObjKey, Instance>,
    /// Service ports that have a healthCheckNodePort, by Service.
    ports: HashMap<ObjKey, Vec<Arc<ServicePort>>>,
    /// The addresses listeners are bound to (empty: all).
    addrs: Vec<IpAddr>,
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
    /// No listeners yet; [`ServiceHealthServers::sync`] opens them.
    ///
    /// # Errors
    /// None today (kept for the callers' error path).
    pub fn start(health: Arc<Health>) -> std::io::Result<ServiceHealthServers> {
        Ok(ServiceHealthServers {
            health,
            services: BTreeMap::new(),
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
        if addrs != self.addrs {
            // Rebind everything on the new addresses.
            self.addrs = addrs;
            touched.extend(self.services.keys().cloned());
            self.services.clear();
        }
        let mut errors = Vec::new();
        for key in touched {
            let want = self
                .ports
                .get(&key)
                .and_then(|v| v.iter().map(|p| p.health_check_node_port).find(|&p| p != 0));
            let endpoints = self.ports.get(&key).map_or(0, |v| local_ready_ips(v));
            match (want, self.services.get_mut(&key)) {
                (None, _) => {
                    self.services.remove(&key);
                }
                (Some(port), Some(inst)) if inst.port == port => {
                    inst.endpoints.store(endpoints, Ordering::Relaxed);
                }
                (Some(port), _) => {
                    // The old listeners close before the new ones bind.
                    self.services.remove(&key);
                    match self.open(&key, port, endpoints) {
                        Ok(inst) => {
                            self.services.insert(key, inst);
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

    fn open(&self, key: &ObjKey, port: u16, endpoints: usize) -> std::io::Result<Instance> {
        let count = Arc::new(AtomicUsize::new(endpoints));
        let servers = listen(&self.addrs, port)?
            .into_iter()
            .map(|l| {
                let (ns, name) = key.clone();
                let (count, health) = (count.clone(), self.health.clone());
                let handler: crate::http::Handler = Arc::new(move |_method, _path| {
                    let endpoints = count.load(Ordering::Relaxed);
                    let healthy = health.is_healthy();
                    Response {
                        status: if endpoints != 0 && healthy {
                            "200 OK"
                        } else {
                            "503 Service Unavailable"
                        },
                        content_type: "application/json",
                        body: body(&ns, &name, endpoints, healthy),
                        headers: vec![("X-Load-Balancing-Endpoint-Weight", endpoints.to_string())],
                    }
                });
                HttpServer::on(l, "a healthCheckNodePort", handler)
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Instance {
            port,
            _servers: servers,
            endpoints: count,
        })
    }

    fn add(&mut self, sp: &Arc<ServicePort>, touched: &mut BTreeSet<ObjKey>) {
        if sp.health_check_node_port == 0 {
            return;
        }
        let key = key(sp);
        self.ports.entry(key.clone()).or_default().push(sp.clone());
        touched.insert(key);
    }

    /// Closes every listener.
    pub fn stop(mut self) {
        self.services.clear();
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
