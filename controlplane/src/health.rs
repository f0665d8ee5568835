//! kube-proxy's health endpoints: `/healthz` (200 while the dataplane holds the current
//! state, 503 when an update has waited longer than the health timeout) and `/livez`
//! (the same, without node state), with kube-proxy's JSON body.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// kube-proxy's health timeout with the default syncPeriod (2 × syncPeriod): an update
/// queued and not programmed for longer than this makes the proxy unhealthy.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
struct Times {
    /// Last time the dataplane was programmed with the current state.
    last_updated: Option<SystemTime>,
    /// Oldest update waiting to be programmed.
    queued_since: Option<SystemTime>,
}

/// What the health endpoints report.
#[derive(Debug)]
pub struct Health {
    times: Mutex<Times>,
    node_eligible: AtomicBool,
    /// How long a queued update may wait before the health endpoints answer 503.
    timeout: Duration,
    /// Counts answers in kube-proxy's `kubeproxy_proxy_healthz_total` / `_livez_total`.
    metrics: std::sync::OnceLock<Arc<crate::metrics::Metrics>>,
}

impl Default for Health {
    fn default() -> Self {
        Health::new()
    }
}

impl Health {
    pub fn new() -> Health {
        Health::with_timeout(HEALTH_TIMEOUT)
    }

    /// With kube-proxy's timeout for a given syncPeriod: twice it.
    pub fn with_timeout(timeout: Duration) -> Health {
        Health {
            timeout,
            times: Mutex::new(Times::default()),
            node_eligible: AtomicBool::new(true),
            metrics: std::sync::OnceLock::new(),
        }
    }

    /// An update arrived and is not programmed yet.
    pub fn queued(&self) {
        if let Ok(mut t) = self.times.lock() {
            t.queued_since.get_or_insert_with(SystemTime::now);
        }
    }

    /// The dataplane now holds the current state.
    pub fn programmed(&self) {
        if let Ok(mut t) = self.times.lock() {
            t.last_updated = Some(SystemTime::now());
            t.queued_since = None;
        }
    }

    /// Counts every answer in these metrics from now on.
    pub fn set_metrics(&self, m: Arc<crate::metrics::Metrics>) {
        let _ = self.metrics.set(m);
    }

    pub fn set_node_eligible(&self, eligible: bool) {
        self.node_eligible.store(eligible, Ordering::Relaxed);
    }

    /// Whether kxp is healthy, node state aside (what kube-proxy's service health
    /// servers report as `serviceProxyHealthy`).
    pub fn is_healthy(&self) -> bool {
        self.report(false, SystemTime::now()).0
    }

    /// (healthy, body) for `/healthz` (`node` = true) or `/livez`.
    pub fn report(&self, node: bool, now: SystemTime) -> (bool, String) {
        let (last, queued) = match self.times.lock() {
            Ok(t) => (t.last_updated, t.queued_since),
            Err(_) => (None, None),
        };
        let fresh = match (last, queued) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(_), Some(q)) => now.duration_since(q).unwrap_or_default() <= self.timeout,
        };
        let eligible = self.node_eligible.load(Ordering::Relaxed);
        let healthy = fresh && (!node || eligible);
        let body = if node {
            format!(
                "{{\"lastUpdated\": \"{}\",\"currentTime\": \"{}\", \"nodeEligible\": {}}}",
                last.map(rfc3339).unwrap_or_default(),
                rfc3339(now),
                eligible
            )
        } else {
            format!(
                "{{\"lastUpdated\": \"{}\",\"currentTime\": \"{}\"}}",
                last.map(rfc3339).unwrap_or_default(),
                rfc3339(now)
            )
        };
        (healthy, body)
    }
}

/// UTC RFC 3339 with nanoseconds, as Go's time.Time marshals it.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = if month <= 2 { y + 1 } else { y };
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60,
        d.subsec_nanos()
    )
}

/// The `/healthz` and `/livez` server.
#[derive(Debug)]
pub struct HealthServer(crate::http::HttpServer);

impl HealthServer {
    /// Binds and serves in a background thread.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start(addr: SocketAddr, health: Arc<Health>) -> std::io::Result<HealthServer> {
        crate::http::HttpServer::start(addr, "kxp-healthz", move |_, path| answer(&health, path))
            .map(HealthServer)
    }

    /// Serves, or (without `hard_fail`) keeps trying to bind every 5 s in the background
    /// (kube-proxy's `bindAddressHardFail`).
    ///
    /// # Errors
    /// With `hard_fail`, the address cannot be bound.
    pub fn start_or_retry(
        addr: SocketAddr,
        health: Arc<Health>,
        hard_fail: bool,
    ) -> std::io::Result<HealthServer> {
        crate::http::HttpServer::start_or_retry(addr, "kxp-healthz", hard_fail, move |_, path| {
            answer(&health, path)
        })
        .map(HealthServer)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.0.local_addr()
    }

    pub fn stop(self) {
        self.0.stop();
    }
}

fn answer(health: &Health, path: &str) -> crate::http::Response {
    let node = match path {
        "/healthz" => true,
        "/livez" => false,
        _ => return crate::http::Response::not_found(),
    };
    let (ok, body) = health.report(node, SystemTime::now());
    let code = if ok { 200 } else { 503 };
    if let Some(m) = health.metrics.get() {
        if node {
            m.healthz_served(code);
        } else {
            m.livez_served(code);
        }
    }
    crate::http::Response {
        status: if ok {
            "200 OK"
        } else {
            "503 Service Unavailable"
        },
        content_type: "application/json",
        body,
        headers: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;
    use std::net::TcpStream;

    #[test]
    fn rfc3339_known_dates() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000000Z");
        let t = UNIX_EPOCH + Duration::new(1_764_460_800, 5);
        assert_eq!(rfc3339(t), "2025-11-30T00:00:00.000000005Z");
    }

    #[test]
    fn unhealthy_until_programmed_and_when_an_update_waits_too_long() {
        let h = Health::new();
        let now = SystemTime::now();
        assert!(!h.report(true, now).0);
        h.programmed();
        assert!(h.report(true, now).0);
        h.queued();
        assert!(h.report(true, SystemTime::now()).0);
        assert!(!h.report(true, SystemTime::now() + HEALTH_TIMEOUT * 2).0);
        h.set_node_eligible(false);
        h.programmed();
        assert!(
            !h.report(true, SystemTime::now()).0,
            "healthz follows node state"
        );
        assert!(h.report(false, SystemTime::now()).0, "livez ignores it");
    }

    #[test]
    fn serves_http() {
        let h = Arc::new(Health::new());
        h.programmed();
        let s = HealthServer::start("127.0.0.1:0".parse().unwrap(), h).unwrap();
        let mut c = TcpStream::connect(s.local_addr()).unwrap();
        c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut resp = String::new();
        std::io::Read::read_to_string(&mut c, &mut resp).unwrap();
        assert!(resp.starts_with("HTTP/1.1 200 OK"), "{resp}");
        assert!(resp.contains("\"nodeEligible\": true"), "{resp}");
        s.stop();
    }
}
