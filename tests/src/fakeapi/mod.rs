//! A fake kube-apiserver for tests: the real list/watch HTTP protocol over plain HTTP on
//! 127.0.0.1 for Services, EndpointSlices, Nodes and ServiceCIDRs, with fault injection.
//!
//! ```no_run
//! let api = kxp_tests::fakeapi::FakeApi::start();
//! api.create(&serde_json::json!({
//!     "apiVersion": "v1", "kind": "Service",
//!     "metadata": {"name": "web", "namespace": "default"},
//!     "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]},
//! })).unwrap();
//! api.write_kubeconfig("/tmp/kubeconfig").unwrap();
//! ```
//!
//! Protocol points it keeps: one resourceVersion counter for all kinds; lists with
//! `limit`/`continue` (410 once the token's resourceVersion is compacted) and
//! `resourceVersion` ""/"0"/N (+`resourceVersionMatch`); list items without kind/apiVersion;
//! chunked watches replaying history after `resourceVersion`, synthetic ADDED events for
//! ""/"0"/`sendInitialEvents=true`, BOOKMARKs every second when allowed, an ERROR event
//! with a 410 Expired Status for a compacted resourceVersion, `timeoutSeconds`; label and
//! field selectors, with objects entering/leaving a watch's selectors sent as ADDED/DELETED.

mod request;
mod selector;
mod server;
mod store;
mod tls;
mod watch;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use serde::Serialize;
use serde_json::{Value, json};

pub use selector::{FieldSelector, LabelSelector};
use store::{State, WriteMode};

/// The kinds the fake serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// v1 Service (namespaced).
    Service,
    /// discovery.k8s.io/v1 EndpointSlice (namespaced).
    EndpointSlice,
    /// v1 Node (cluster-scoped).
    Node,
    /// networking.k8s.io/v1 ServiceCIDR (cluster-scoped).
    ServiceCidr,
    /// v1 Pod (namespaced).
    Pod,
    /// v1 Namespace (cluster-scoped).
    Namespace,
    /// networking.k8s.io/v1 NetworkPolicy (namespaced).
    NetworkPolicy,
}

impl Kind {
    /// Every kind served.
    pub const ALL: [Kind; 7] = [
        Kind::Service,
        Kind::EndpointSlice,
        Kind::Node,
        Kind::ServiceCidr,
        Kind::Pod,
        Kind::Namespace,
        Kind::NetworkPolicy,
    ];

    /// The `kind` string.
    pub fn kind(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCidr => "ServiceCIDR",
            Kind::Pod => "Pod",
            Kind::Namespace => "Namespace",
            Kind::NetworkPolicy => "NetworkPolicy",
        }
    }

    /// The API group ("" for core).
    pub fn group(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node | Kind::Pod | Kind::Namespace => "",
            Kind::EndpointSlice => "discovery.k8s.io",
            Kind::ServiceCidr | Kind::NetworkPolicy => "networking.k8s.io",
        }
    }

    fn group_or_core(self) -> &'static str {
        match self.group() {
            "" => "core",
            g => g,
        }
    }

    /// The `apiVersion` string.
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node | Kind::Pod | Kind::Namespace => "v1",
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            Kind::ServiceCidr | Kind::NetworkPolicy => "networking.k8s.io/v1",
        }
    }

    /// The resource name in URLs (and in request counters).
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Service => "services",
            Kind::EndpointSlice => "endpointslices",
            Kind::Node => "nodes",
            Kind::ServiceCidr => "servicecidrs",
            Kind::Pod => "pods",
            Kind::Namespace => "namespaces",
            Kind::NetworkPolicy => "networkpolicies",
        }
    }

    /// Whether objects live in namespaces.
    pub fn namespaced(self) -> bool {
        matches!(
            self,
            Kind::Service | Kind::EndpointSlice | Kind::Pod | Kind::NetworkPolicy
        )
    }

    /// Field paths the real apiserver accepts in a fieldSelector for this kind.
    pub fn supports_field(self, field: &str) -> bool {
        match field {
            "metadata.name" => true,
            "metadata.namespace" => self.namespaced(),
            "spec.clusterIP" | "spec.type" => self == Kind::Service,
            "spec.unschedulable" => self == Kind::Node,
            "spec.nodeName" | "status.phase" => self == Kind::Pod,
            "addressType" => self == Kind::EndpointSlice,
            _ => false,
        }
    }

    fn from_path(group: &str, version: &str, plural: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.group() == group && version == "v1" && k.plural() == plural)
    }

    fn of_object(obj: &Value) -> Result<Kind, FakeError> {
        let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("");
        let av = obj.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        Kind::ALL
            .into_iter()
            .find(|k| k.kind() == kind && k.api_version() == av)
            .ok_or_else(|| {
                FakeError::new(
                    400,
                    "BadRequest",
                    format!("no kind {kind:?} in {av:?} is served"),
                )
            })
    }
}

/// An API error, as a `Status` would carry it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeError {
    /// HTTP status code.
    pub code: u16,
    /// The Status reason (NotFound, AlreadyExists, Conflict, Expired, ...).
    pub reason: String,
    /// The human message.
    pub message: String,
}

impl FakeError {
    fn new(code: u16, reason: &str, message: String) -> Self {
        Self {
            code,
            reason: reason.to_string(),
            message,
        }
    }

    /// The `v1 Status` object the apiserver sends for this error.
    pub fn status(&self) -> Value {
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": self.message, "reason": self.reason,
            "details": {}, "code": self.code,
        })
    }
}

impl std::fmt::Display for FakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for FakeError {}

/// State shared by the test-facing handle and the server.
#[derive(Debug)]
pub(crate) struct Shared {
    state: Mutex<State>,
    /// When set, every request must carry `Authorization: Bearer <token>` (else 401).
    pub(crate) token: Option<String>,
    /// Bumped on every change watches must look at (writes, drops, silence, compaction).
    poke: tokio::sync::watch::Sender<u64>,
    /// API groups listed by discovery besides the served kinds' (as a cluster's CRDs
    /// add theirs), with the kinds each lists.
    pub(crate) extra_groups: Mutex<Vec<(String, Vec<String>)>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn poke(&self) {
        self.poke.send_modify(|n| *n += 1);
    }
}

/// A running fake API server; stops when dropped.
#[derive(Debug)]
pub struct FakeApi {
    addr: SocketAddr,
    tls: Option<tls::Tls>,
    token: Option<String>,
    shared: Arc<Shared>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl FakeApi {
    /// Starts the server on 127.0.0.1 (a free port) in its own thread and tokio runtime,
    /// so it works from plain and from `#[tokio::test]` tests alike. Plain HTTP, no
    /// authentication.
    pub fn start() -> FakeApi {
        Self::start_with(false, None)
    }

    /// As [`FakeApi::start`], over HTTPS (a CA made for this server, trusted by the
    /// kubeconfig it writes) and, with `token`, requiring that bearer token as a real API
    /// server requires a ServiceAccount's.
    pub fn start_tls(token: Option<&str>) -> FakeApi {
        Self::start_with(true, token.map(str::to_string))
    }

    fn start_with(tls: bool, token: Option<String>) -> FakeApi {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            token: token.clone(),
            poke: tokio::sync::watch::Sender::new(0),
            extra_groups: Mutex::new(Vec::new()),
        });
        let tls = tls.then(tls::make);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let addr = listener.local_addr().expect("local addr");
        let (tx, rx) = tokio::sync::oneshot::channel();
        let server_shared = shared.clone();
        let acceptor = tls.as_ref().map(|t| t.acceptor.clone());
        let thread = std::thread::Builder::new()
            .name("fakeapi".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("fakeapi runtime");
                rt.block_on(server::serve(listener, server_shared, acceptor, rx));
            })
            .expect("spawn fakeapi thread");
        FakeApi {
            addr,
            tls,
            token,
            shared,
            shutdown: Some(tx),
            thread: Some(thread),
        }
    }

    /// The CA certificate (PEM) of a TLS server.
    /// Lists API group `group` (version v1) with these kinds in discovery, as a CRD's
    /// group appears on a real cluster (nothing of it is served).
    pub fn add_api_group(&self, group: &str, kinds: &[&str]) {
        self.shared
            .extra_groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((
                group.to_string(),
                kinds.iter().map(|k| k.to_string()).collect(),
            ));
    }

    pub fn ca_pem(&self) -> Option<&str> {
        self.tls.as_ref().map(|t| t.ca_pem.as_str())
    }

    /// `http://127.0.0.1:PORT` (`https://` with TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Writes a kubeconfig for this server (namespace "default"): with TLS it trusts the
    /// server's CA (`certificate-authority-data`), with a token it presents it.
    pub fn write_kubeconfig(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        let ca = match self.ca_pem() {
            Some(pem) => {
                // Standard base64, padded.
                let mut b64 = server::b64_encode(pem.as_bytes());
                while !b64.len().is_multiple_of(4) {
                    b64.push('=');
                }
                format!("\n    certificate-authority-data: {b64}")
            }
            None => String::new(),
        };
        let user = match &self.token {
            Some(t) => format!("\n    token: {t}"),
            None => " {}".to_string(),
        };
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}{ca}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    \
             namespace: default\ncurrent-context: fake\nusers:\n- name: fake\n  user:{user}\n\
             preferences: {{}}\n",
            self.url()
        );
        std::fs::write(path, text)
    }

    fn write(&self, obj: &impl Serialize, mode: WriteMode) -> Result<Value, FakeError> {
        let obj = serde_json::to_value(obj)
            .map_err(|e| FakeError::new(400, "BadRequest", e.to_string()))?;
        let out = self.shared.lock().write(obj, mode).map(|(_, o)| o);
        self.shared.poke();
        out
    }

    /// Creates an object (JSON or a k8s-openapi type; kind/apiVersion name its kind;
    /// namespace defaults to "default"). Returns it as stored.
    pub fn create(&self, obj: &impl Serialize) -> Result<Value, FakeError> {
        self.write(obj, WriteMode::Create)
    }

    /// Replaces an existing object (409 Conflict if its resourceVersion is set and stale).
    pub fn replace(&self, obj: &impl Serialize) -> Result<Value, FakeError> {
        self.write(obj, WriteMode::Replace)
    }

    /// Creates or replaces, ignoring resourceVersion (a forced server-side apply).
    pub fn apply(&self, obj: &impl Serialize) -> Result<Value, FakeError> {
        self.write(obj, WriteMode::Apply)
    }

    /// Deletes the object `obj` names (kind/apiVersion/metadata.namespace/name).
    pub fn delete(&self, obj: &impl Serialize) -> Result<Value, FakeError> {
        let obj = serde_json::to_value(obj)
            .map_err(|e| FakeError::new(400, "BadRequest", e.to_string()))?;
        let kind = Kind::of_object(&obj)?;
        let (ns, name) = store::key_of(kind, &obj);
        self.delete_named(kind, &ns, &name)
    }

    /// Deletes `kind` `ns`/`name` (`ns` ignored for cluster-scoped kinds).
    pub fn delete_named(&self, kind: Kind, ns: &str, name: &str) -> Result<Value, FakeError> {
        let out = self.shared.lock().delete(kind, ns, name);
        self.shared.poke();
        out
    }

    /// The stored object, if any.
    pub fn get(&self, kind: Kind, ns: &str, name: &str) -> Option<Value> {
        let ns = if kind.namespaced() { ns } else { "" };
        let st = self.shared.lock();
        st.objects
            .get(&kind)?
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
    }

    /// The current resourceVersion (of the last write, any kind).
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }

    /// Answers the next `n` resource requests (list/watch/get/writes; not discovery) with
    /// `status`: 429 comes with `Retry-After: 1`, every failure with a Status body.
    /// Calls queue up: `fail_next(2, 500); fail_next(1, 429)` fails three requests.
    pub fn fail_next(&self, n: usize, status: u16) {
        self.shared
            .lock()
            .faults
            .extend(std::iter::repeat_n(status, n));
    }

    /// Failures still queued by `fail_next`.
    pub fn pending_failures(&self) -> usize {
        self.shared.lock().faults.len()
    }

    /// Aborts every open watch stream (the connection is cut without the final chunk).
    pub fn drop_watches(&self) {
        self.shared.lock().drop_gen += 1;
        self.shared.poke();
    }

    /// While true, open and new watches send nothing (no events, no bookmarks) but stay
    /// open; on false they catch up from where they were.
    pub fn silence_watches(&self, silent: bool) {
        self.shared.lock().silenced = silent;
        self.shared.poke();
    }

    /// Compacts history older than `rv`: a new watch from an older resourceVersion gets HTTP
    /// 200 then an ERROR event with a 410 Expired Status; lists at an older exact
    /// resourceVersion or continue token get 410. Open watches keep streaming.
    pub fn compact(&self, rv: u64) {
        self.shared.lock().compact(rv);
        self.shared.poke();
    }

    /// HTTP requests received for `plural` ("services", ...) and `verb` ("list", "watch",
    /// "get", "create", "update", "delete"), failed and injected-failure ones included
    /// (writes made through this Rust API are not requests).
    pub fn requests(&self, plural: &str, verb: &str) -> u64 {
        let st = self.shared.lock();
        st.counts
            .get(&(plural.to_string(), verb.to_string()))
            .copied()
            .unwrap_or(0)
    }

    /// All request counters, keyed by (plural, verb).
    pub fn request_counts(&self) -> BTreeMap<(String, String), u64> {
        self.shared.lock().counts.clone()
    }

    /// Stops the server: closes the listener and every connection. Idempotent.
    pub fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.stop();
    }
}
