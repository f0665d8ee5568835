//! The Kubernetes source: list+watch of Services, EndpointSlices, ServiceCIDRs and this
//! node's Node with kube-runtime watchers feeding reflector stores, with kube-proxy's
//! selectors (`pkg/proxy` informers):
//!
//! - Services: `!service.kubernetes.io/service-proxy-name` (or `=NAME` when
//!   `serviceProxyName` is set), field selector `spec.clusterIP!=None`;
//! - EndpointSlices: `!service.kubernetes.io/headless`;
//! - ServiceCIDRs: all;
//! - Node: `metadata.name=<node name>`;
//! - for NetworkPolicy (when enforced): Pods (those not finished: a field selector on
//!   `status.phase`), Namespaces and NetworkPolicies.
//!
//! [`KubeSource`] is driven by the caller's tokio runtime: [`KubeSource::start`] must be
//! called from inside one (it spawns one task per resource), and [`KubeSource::stop`] (or
//! dropping the source) aborts those tasks. Watch errors (a dropped stream, 410 Expired
//! then a relist, 429/5xx) are retried with kube-runtime's default backoff; each error
//! streak is logged once on stderr and every error is counted. The stores keep the last
//! good state meanwhile (a relist replaces them atomically once it is complete).
//!
//! Besides the stores, each watcher records which objects its events touched, so that a
//! sync hands the change tracker only those ([`KubeSource::take_changes`]): the work of
//! a sync follows the number of changes, not the number of objects.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Debug;
use std::hash::Hash;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};

/// The Pods watched for NetworkPolicy: those not finished.
pub const POD_FIELDS: &str = "status.phase!=Succeeded,status.phase!=Failed";
use k8s_openapi::api::networking::v1::{NetworkPolicy, ServiceCIDR};
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use translate::k8s::{
    KXP_ANNOTATION_PREFIX, LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME,
};
use translate::slice::Slice;
use translate::tracker::ANNOTATION_TRIGGER_TIME;
use translate::tracker::{ObjKey, Tracker};

/// What the source watches for.
#[derive(Debug, Clone, Default)]
pub struct SourceConfig {
    /// This node's name (`hostnameOverride` or the host name): the one Node watched.
    pub node_name: String,
    /// `KubeProxyConfiguration.serviceProxyName`: watch only Services labelled with it.
    pub service_proxy_name: Option<String>,
    /// Also watch Pods, Namespaces and NetworkPolicies (NetworkPolicy is enforced).
    pub network_policy: bool,
}

/// The resources watched, in [`SourceStatus::resources`] order.
pub const RESOURCES: [&str; 7] = [
    "services",
    "endpointslices",
    "servicecidrs",
    "nodes",
    "pods",
    "namespaces",
    "networkpolicies",
];

/// The resources NetworkPolicy decisions are made of (indexes in [`RESOURCES`]).
const POLICY_RESOURCES: std::ops::Range<usize> = 4..7;

/// Counters of one watched resource.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResourceStatus {
    /// `services`, `endpointslices`, `servicecidrs` or `nodes`.
    pub resource: &'static str,
    /// Whether the initial list completed.
    pub synced: bool,
    /// Watch events applied (objects from lists included).
    pub events: u64,
    /// Watch errors (every failed request or error event).
    pub errors: u64,
    /// Initial lists after the first one (a 410 Expired, or a watch that could not resume).
    pub relists: u64,
    /// Objects in the store now.
    pub objects: usize,
    /// The last error's text.
    pub last_error: Option<String>,
    /// Whether the API server's last answer to a list or watch of this resource was an
    /// error (or none came): an error streak is going on.
    pub failing: bool,
    /// Objects changed since the last [`KubeSource::take_changes`] (all of the store
    /// after a relist): kube-proxy's pending changes.
    pub pending: usize,
}

/// Counters of every watched resource.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceStatus {
    pub resources: Vec<ResourceStatus>,
}

impl SourceStatus {
    /// The counters of one resource by name (see [`RESOURCES`]).
    pub fn get(&self, resource: &str) -> Option<&ResourceStatus> {
        self.resources.iter().find(|r| r.resource == resource)
    }
}

/// Errors building a client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot read kubeconfig {path}: {message}; give --kubeconfig PATH or --master URL")]
    Kubeconfig { path: String, message: String },
    #[error("bad --master URL {url:?}: {message}")]
    Master { url: String, message: String },
    #[error(
        "no kubeconfig and not running in a cluster ({message}); give --kubeconfig PATH or --master URL (or --state-file STATE.yaml)"
    )]
    InCluster { message: String },
    #[error("cannot build a Kubernetes client: {0}")]
    Client(String),
}

/// What the API server answered last, per resource: kube-runtime's watchers report
/// errors but not a watch that started again quietly, so the client itself records the
/// outcome of every list and watch request (a tower layer in front of the transport).
#[derive(Debug, Clone, Default)]
pub struct ApiObserver {
    last: Arc<Mutex<std::collections::HashMap<String, Outcomes>>>,
    /// Requests by (code, host, method), as client-go's `rest_client_requests_total`
    /// counts them (`<error>` when no answer came).
    requests: Arc<Mutex<std::collections::BTreeMap<RequestKey, u64>>>,
}

/// A request's (status code, host, method).
pub type RequestKey = (String, String, String);

/// When a request last succeeded and last failed.
type Outcomes = (Option<Instant>, Option<Instant>);

impl ApiObserver {
    fn record(&self, path: &str, ok: bool) {
        let resource = path.rsplit('/').next().unwrap_or("").to_string();
        let mut m = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let e = m.entry(resource).or_default();
        if ok {
            e.0 = Some(Instant::now());
        } else {
            e.1 = Some(Instant::now());
        }
    }

    fn count(&self, code: String, host: String, method: String) {
        let mut m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((code, host, method)).or_insert(0) += 1;
    }

    /// Requests made so far, by (code, host, method).
    pub fn requests(&self) -> Vec<(RequestKey, u64)> {
        let m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        m.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// Whether the last request for `resource` (`services`, …) failed.
    pub fn failing(&self, resource: &str) -> bool {
        let m = self.last.lock().unwrap_or_else(|p| p.into_inner());
        m.get(resource)
            .is_some_and(|&(ok, err)| err.is_some() && err > ok)
    }

    /// When a request for `resource` last succeeded.
    pub fn last_ok(&self, resource: &str) -> Option<Instant> {
        let m = self.last.lock().unwrap_or_else(|p| p.into_inner());
        m.get(resource).and_then(|e| e.0)
    }
}

/// The tower layer that feeds an [`ApiObserver`].
#[derive(Debug, Clone)]
struct ObserveLayer(ApiObserver);

impl<S> tower::Layer<S> for ObserveLayer {
    type Service = Observe<S>;
    fn layer(&self, inner: S) -> Observe<S> {
        Observe {
            inner,
            observer: self.0.clone(),
        }
    }
}

#[derive(Debug, Clone)]
struct Observe<S> {
    inner: S,
    observer: ApiObserver,
}

impl<S, B> tower::Service<http::Request<kube::client::Body>> for Observe<S>
where
    S: tower::Service<http::Request<kube::client::Body>, Response = http::Response<B>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    B: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<kube::client::Body>) -> Self::Future {
        let path = req.uri().path().to_string();
        let host = req
            .uri()
            .authority()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let method = req.method().to_string();
        let observer = self.observer.clone();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await;
            let ok = r.as_ref().is_ok_and(|resp| resp.status().is_success());
            observer.record(&path, ok);
            let code = r.as_ref().map_or_else(
                |_| "<error>".to_string(),
                |resp| resp.status().as_u16().to_string(),
            );
            observer.count(code, host, method);
            r
        })
    }
}

/// A client and the observer of its answers.
#[derive(Clone)]
pub struct ApiClient {
    pub client: Client,
    pub observer: ApiObserver,
}

/// API groups of policy objects that are not Kubernetes NetworkPolicy, and what they
/// hold: kxp does not enforce them.
const FOREIGN_POLICY_GROUPS: [(&str, &str); 5] = [
    (
        "crd.projectcalico.org",
        "Calico's NetworkPolicy and GlobalNetworkPolicy",
    ),
    (
        "projectcalico.org",
        "Calico's NetworkPolicy and GlobalNetworkPolicy",
    ),
    (
        "cilium.io",
        "CiliumNetworkPolicy and CiliumClusterwideNetworkPolicy",
    ),
    (
        "policy.networking.k8s.io",
        "AdminNetworkPolicy and BaselineAdminNetworkPolicy",
    ),
    (
        "crd.antrea.io",
        "Antrea's NetworkPolicy and ClusterNetworkPolicy",
    ),
];

/// The policy object kinds the API server serves besides Kubernetes NetworkPolicy (by
/// API group, from discovery), each as `group (kinds)`; empty when none, or when
/// discovery fails (logged at debug level).
pub async fn foreign_policy_groups(api: &ApiClient) -> Vec<String> {
    match api.client.list_api_groups().await {
        Ok(list) => list
            .groups
            .iter()
            .filter_map(|g| {
                FOREIGN_POLICY_GROUPS
                    .iter()
                    .find(|(name, _)| *name == g.name)
                    .map(|(name, what)| format!("{name} ({what})"))
            })
            .collect(),
        Err(e) => {
            tracing::debug!("API discovery: {e}");
            Vec::new()
        }
    }
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClient")
            .field("observer", &self.observer)
            .finish_non_exhaustive()
    }
}

/// `clientConnection.qps` and `burst`: at most `burst` requests at once and `qps` per
/// second on average (kube-proxy's client-side limit).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    pub qps: f64,
    pub burst: u32,
}

impl RateLimit {
    /// From the configuration's values; `None` when either is zero or absent. (kube-proxy
    /// then applies client-go's 5 qps / burst 10; kxp's watchers list in pages, which such
    /// a default would slow down on big clusters, so kxp limits only when asked to.)
    pub fn from_config(qps: Option<f64>, burst: Option<i32>) -> Option<RateLimit> {
        let qps = qps.filter(|q| q.is_finite() && *q > 0.0)?;
        let burst = u32::try_from(burst?).ok().filter(|b| *b > 0)?;
        Some(RateLimit { qps, burst })
    }

    /// The window in which `burst` requests are allowed.
    pub fn period(&self) -> Duration {
        Duration::from_secs_f64(f64::from(self.burst) / self.qps)
    }
}

/// A client from a kubeconfig file (its current context), with `master` overriding the
/// server URL; from `master` alone; or from the in-cluster service account when neither
/// is given; with `limit` on its request rate. Must run inside a tokio runtime. TLS is
/// rustls (with the `ring` provider): the CA and client certificates come from the
/// kubeconfig or the in-cluster account.
pub async fn client_from(
    kubeconfig: Option<&Path>,
    master: Option<&str>,
    limit: Option<RateLimit>,
) -> Result<ApiClient, ClientError> {
    let master_uri = match master {
        Some(url) => Some(url.parse::<http::Uri>().map_err(|e| ClientError::Master {
            url: url.to_string(),
            message: e.to_string(),
        })?),
        None => None,
    };
    let mut config = match (kubeconfig, master_uri.clone()) {
        (Some(path), _) => {
            let kerr = |message: String| ClientError::Kubeconfig {
                path: path.display().to_string(),
                message,
            };
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| kerr(e.to_string()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| kerr(e.to_string()))?
        }
        (None, Some(uri)) => kube::Config::new(uri),
        (None, None) => kube::Config::incluster().map_err(|e| ClientError::InCluster {
            message: e.to_string(),
        })?,
    };
    if let Some(uri) = master_uri {
        config.cluster_url = uri;
    }
    let observer = ApiObserver::default();
    let builder = kube::client::ClientBuilder::try_from(config)
        .map_err(|e| ClientError::Client(e.to_string()))?
        .with_layer(&ObserveLayer(observer.clone()));
    let client = match limit {
        Some(l) => builder
            .with_layer(&tower::limit::RateLimitLayer::new(
                u64::from(l.burst),
                l.period(),
            ))
            .build(),
        None => builder.build(),
    };
    Ok(ApiClient { client, observer })
}

#[derive(Debug, Default)]
struct Counters {
    st: ResourceStatus,
    listed_once: bool,
    /// A list completed since the last [`KubeSource::take_changes`]: diff the store.
    dirty_full: bool,
    /// Objects applied or deleted since then.
    dirty: HashSet<ObjKey>,
    /// When the current error streak was logged.
    logged_at: Option<Instant>,
}

/// What changed in one resource since the last look.
#[derive(Debug)]
pub enum Change<K> {
    /// A (re)list happened: the whole store, to diff against.
    Full(Vec<Arc<K>>),
    /// These objects changed: their current version, or `None` once deleted.
    Keys(Vec<(ObjKey, Option<Arc<K>>)>),
}

impl<K> Change<K> {
    pub fn len(&self) -> usize {
        match self {
            Change::Full(v) => v.len(),
            Change::Keys(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A copy of what the watches hold ([`KubeSource::state`]): the objects of
/// [`translate::k8s::ClusterState`], the EndpointSlices as kxp holds them.
#[derive(Debug, Clone, Default)]
pub struct Watched {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<Slice>,
    pub nodes: Vec<Node>,
    pub service_cidrs: Vec<ServiceCIDR>,
    pub pods: Vec<Pod>,
    pub namespaces: Vec<Namespace>,
    pub network_policies: Vec<NetworkPolicy>,
}

/// What changed in every resource since the last look.
#[derive(Debug)]
pub struct Changes {
    pub services: Change<Service>,
    pub slices: Change<Slice>,
    pub cidrs: Change<ServiceCIDR>,
    pub nodes: Change<Node>,
    /// Every Pod, Namespace and NetworkPolicy, when one of them changed (NetworkPolicy
    /// decisions are rebuilt whole).
    pub policy: Option<PolicyInputs>,
}

/// The objects NetworkPolicy decisions are made of.
#[derive(Debug, Default)]
pub struct PolicyInputs {
    pub pods: Vec<Arc<Pod>>,
    pub namespaces: Vec<Arc<Namespace>>,
    pub policies: Vec<Arc<NetworkPolicy>>,
}

impl Changes {
    /// Hands the changes to kube-proxy's change tracker.
    pub fn apply(self, t: &mut Tracker) {
        match self.services {
            Change::Full(v) => t.replace_services(v),
            Change::Keys(v) => v.into_iter().for_each(|(k, o)| t.apply_service(k, o)),
        }
        match self.slices {
            Change::Full(v) => t.replace_slices(v),
            Change::Keys(v) => v.into_iter().for_each(|(k, o)| t.apply_slice(k, o)),
        }
        match self.cidrs {
            Change::Full(v) => t.replace_service_cidrs(v),
            Change::Keys(v) => v
                .into_iter()
                .for_each(|(k, o)| t.apply_service_cidr(k.1, o)),
        }
        match self.nodes {
            Change::Full(v) => t.replace_nodes(v),
            Change::Keys(v) => v.into_iter().for_each(|(k, o)| t.apply_node(k.1, o)),
        }
        if let Some(p) = self.policy {
            t.replace_policy_inputs(p.pods, p.namespaces, p.policies);
        }
    }
}

#[derive(Debug)]
struct Shared {
    counters: [Mutex<Counters>; 7],
    observer: ApiObserver,
    bump: watch::Sender<u64>,
}

impl Shared {
    fn counters(&self, i: usize) -> MutexGuard<'_, Counters> {
        self.counters[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.bump.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// A Namespace's metadata as watched, and the Namespace made of it.
type NamespaceOf = (Arc<PartialObjectMeta<Namespace>>, Arc<Namespace>);

/// The stores NetworkPolicy decisions are made of.
#[derive(Debug)]
struct PolicyStores {
    pods: Store<Pod>,
    namespaces: Store<PartialObjectMeta<Namespace>>,
    policies: Store<NetworkPolicy>,
    /// Namespaces as the tracker takes them, made from their metadata once per change:
    /// name → (the store's object, the Namespace made of it).
    made: Mutex<std::collections::HashMap<String, NamespaceOf>>,
}

/// The running Kubernetes source (see the module docs).
#[derive(Debug)]
pub struct KubeSource {
    services: Store<Service>,
    slices: Store<Slice>,
    cidrs: Store<ServiceCIDR>,
    nodes: Store<Node>,
    /// Pods, Namespaces, NetworkPolicies: watched when NetworkPolicy is enforced.
    policy: Option<Box<PolicyStores>>,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl KubeSource {
    /// Starts the watchers on the current tokio runtime (panics outside one).
    pub fn start(api: ApiClient, cfg: SourceConfig) -> KubeSource {
        let ApiClient { client, observer } = api;
        let (bump, _) = watch::channel(0u64);
        let shared = Arc::new(Shared {
            counters: Default::default(),
            observer,
            bump,
        });
        for (i, name) in RESOURCES.iter().enumerate() {
            shared.counters(i).st.resource = name;
        }
        let svc_labels = match &cfg.service_proxy_name {
            Some(name) if !name.is_empty() => format!("{LABEL_SERVICE_PROXY_NAME}={name}"),
            _ => format!("!{LABEL_SERVICE_PROXY_NAME}"),
        };
        let svc_cfg = watcher::Config::default()
            .labels(&svc_labels)
            .fields("spec.clusterIP!=None");
        let slice_cfg = watcher::Config::default().labels(&format!("!{LABEL_HEADLESS}"));
        let node_cfg =
            watcher::Config::default().fields(&format!("metadata.name={}", cfg.node_name));

        let mut tasks = Vec::new();
        let services = spawn(
            &mut tasks,
            Api::<Service>::all(client.clone()),
            svc_cfg,
            0,
            &shared,
            trim_service,
        );
        let slices = spawn(
            &mut tasks,
            Api::<Slice>::all(client.clone()),
            slice_cfg,
            1,
            &shared,
            trim_slice,
        );
        let cidrs = spawn(
            &mut tasks,
            Api::<ServiceCIDR>::all(client.clone()),
            watcher::Config::default(),
            2,
            &shared,
            trim_meta,
        );
        let policy = cfg
            .network_policy
            .then(|| policy_stores(&mut tasks, &client, &shared));
        if policy.is_none() {
            // Not watched: nothing to wait for.
            for i in POLICY_RESOURCES {
                shared.counters(i).st.synced = true;
            }
        }
        let nodes = spawn(
            &mut tasks,
            Api::<Node>::all(client),
            node_cfg,
            3,
            &shared,
            trim_meta,
        );
        KubeSource {
            services,
            slices,
            cidrs,
            nodes,
            policy,
            shared,
            tasks,
        }
    }

    /// The Namespaces watched (their metadata), as Namespaces sorted by name: one made
    /// per changed object, the others the same `Arc`s as last time (unchanged to the
    /// tracker at a pointer's cost).
    fn namespaces_now(&self) -> Vec<Arc<Namespace>> {
        let Some(p) = &self.policy else {
            return Vec::new();
        };
        let store = &p.namespaces;
        let mut made = p.made.lock().unwrap_or_else(|e| e.into_inner());
        let mut next = std::collections::HashMap::new();
        for meta in store.state() {
            let name = meta.metadata.name.clone().unwrap_or_default();
            let ns = match made.remove(&name) {
                Some((m, ns)) if Arc::ptr_eq(&m, &meta) => ns,
                _ => Arc::new(Namespace {
                    metadata: meta.metadata.clone(),
                    ..Namespace::default()
                }),
            };
            next.insert(name, (meta, ns));
        }
        *made = next;
        let mut out: Vec<Arc<Namespace>> = made.values().map(|(_, ns)| ns.clone()).collect();
        out.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        out
    }

    /// Whether every resource finished its initial list.
    pub fn synced(&self) -> bool {
        (0..RESOURCES.len()).all(|i| self.shared.counters(i).st.synced)
    }

    /// Waits until [`Self::synced`] or `timeout`; returns whether synced.
    pub async fn wait_synced(&self, timeout: Duration) -> bool {
        let mut rx = self.subscribe();
        let wait = async {
            loop {
                if self.synced() {
                    return;
                }
                if rx.changed().await.is_err() {
                    // Never: the sender lives in `self`.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.is_ok()
    }

    /// A copy of the stores, each kind sorted by namespace and name.
    pub fn state(&self) -> Watched {
        Watched {
            services: copy(&self.services),
            endpoint_slices: copy(&self.slices),
            nodes: copy(&self.nodes),
            service_cidrs: copy(&self.cidrs),
            pods: self
                .policy
                .as_ref()
                .map(|p| copy(&p.pods))
                .unwrap_or_default(),
            namespaces: self
                .namespaces_now()
                .iter()
                .map(|n| (**n).clone())
                .collect(),
            network_policies: self
                .policy
                .as_ref()
                .map(|p| copy(&p.policies))
                .unwrap_or_default(),
        }
    }

    /// What changed since the last call (the first call after a list gets the whole
    /// store). The objects are the stores' own (`Arc`s, not copies).
    pub fn take_changes(&self) -> Changes {
        Changes {
            services: self.take(0, &self.services),
            slices: self.take(1, &self.slices),
            cidrs: self.take(2, &self.cidrs),
            nodes: self.take(3, &self.nodes),
            policy: self.take_policy(false),
        }
    }

    /// Every Pod, Namespace and NetworkPolicy when one of them changed since the last
    /// call (or `all`).
    fn take_policy(&self, all: bool) -> Option<PolicyInputs> {
        let p = self.policy.as_ref()?;
        let mut changed = all;
        for i in POLICY_RESOURCES {
            let mut c = self.shared.counters(i);
            changed |= std::mem::take(&mut c.dirty_full) || !c.dirty.is_empty();
            c.dirty.clear();
        }
        changed.then(|| PolicyInputs {
            pods: sorted(p.pods.state()),
            namespaces: self.namespaces_now(),
            policies: sorted(p.policies.state()),
        })
    }

    /// Every store in full (for the periodic re-sync; unchanged objects cost a pointer
    /// comparison in the tracker).
    pub fn everything(&self) -> Changes {
        for i in 0..RESOURCES.len() {
            let mut c = self.shared.counters(i);
            c.dirty.clear();
            c.dirty_full = false;
        }
        Changes {
            services: Change::Full(self.services.state()),
            slices: Change::Full(self.slices.state()),
            cidrs: Change::Full(self.cidrs.state()),
            nodes: Change::Full(self.nodes.state()),
            policy: self.take_policy(true),
        }
    }

    fn take<K>(&self, i: usize, store: &Store<K>) -> Change<K>
    where
        K: Clone + Resource + 'static,
        K::DynamicType: Eq + Hash + Clone + Default,
    {
        let (full, keys) = {
            let mut c = self.shared.counters(i);
            let full = std::mem::take(&mut c.dirty_full);
            (full, std::mem::take(&mut c.dirty))
        };
        if full {
            return Change::Full(store.state());
        }
        let mut keys: Vec<ObjKey> = keys.into_iter().collect();
        keys.sort();
        Change::Keys(
            keys.into_iter()
                .map(|k| {
                    let mut r = ObjectRef::<K>::new(&k.1);
                    if !k.0.is_empty() {
                        r = r.within(&k.0);
                    }
                    let obj = store.get(&r);
                    (k, obj)
                })
                .collect(),
        )
    }

    /// A counter bumped after every applied event (and completed list).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.shared.bump.subscribe()
    }

    /// The API client's requests so far, by (code, host, method).
    pub fn rest_requests(&self) -> Vec<(RequestKey, u64)> {
        self.shared.observer.requests()
    }

    /// Per-resource counters.
    pub fn status(&self) -> SourceStatus {
        let (pods, namespaces, policies) = self.policy.as_ref().map_or((0, 0, 0), |p| {
            (p.pods.len(), p.namespaces.len(), p.policies.len())
        });
        let stores = [
            self.services.len(),
            self.slices.len(),
            self.cidrs.len(),
            self.nodes.len(),
            pods,
            namespaces,
            policies,
        ];
        SourceStatus {
            resources: (0..RESOURCES.len())
                .map(|i| {
                    let c = self.shared.counters(i);
                    let mut st = c.st.clone();
                    st.pending = if c.dirty_full {
                        stores[i]
                    } else {
                        c.dirty.len()
                    };
                    drop(c);
                    st.objects = stores[i];
                    st.failing = self.shared.observer.failing(RESOURCES[i]);
                    st
                })
                .collect(),
        }
    }

    /// Stops the watchers.
    pub fn stop(self) {
        // Drop aborts the tasks.
    }
}

impl Drop for KubeSource {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn copy<K>(store: &Store<K>) -> Vec<K>
where
    K: Clone + Resource + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    let mut objs: Vec<K> = store.state().iter().map(|o| (**o).clone()).collect();
    objs.sort_by(|a, b| {
        let (a, b) = (a.meta(), b.meta());
        (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name))
    });
    objs
}

/// A store's objects sorted by namespace and name (so that an unchanged set compares
/// equal whatever order the store keeps).
fn sorted<K>(mut objs: Vec<Arc<K>>) -> Vec<Arc<K>>
where
    K: Resource,
{
    objs.sort_by(|a, b| {
        let (a, b) = (a.meta(), b.meta());
        (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name))
    });
    objs
}

/// The watchers NetworkPolicy decisions are made of (pods, namespaces, policies).
fn policy_stores(
    tasks: &mut Vec<JoinHandle<()>>,
    client: &kube::Client,
    shared: &Arc<Shared>,
) -> Box<PolicyStores> {
    Box::new(PolicyStores {
        pods: spawn(
            tasks,
            Api::<Pod>::all(client.clone()),
            // Finished pods hold no address a policy could mean (theirs may be
            // another pod's by now): the API server leaves them out, and a pod
            // that finishes leaves the watch as deleted.
            watcher::Config::default().fields(POD_FIELDS),
            4,
            shared,
            trim_meta,
        ),
        // Their metadata only (the API server's PartialObjectMetadata
        // projection): what NetworkPolicy needs of a Namespace is its labels.
        namespaces: spawn(
            tasks,
            Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
            watcher::Config::default(),
            5,
            shared,
            trim_meta,
        ),
        policies: spawn(
            tasks,
            Api::<NetworkPolicy>::all(client.clone()),
            watcher::Config::default(),
            6,
            shared,
            trim_meta,
        ),
        made: Mutex::default(),
    })
}

/// What no decision of kxp's reads, dropped from every object before it is stored: its
/// managed fields (the API server's record of who set which field, as large as the
/// object itself) and kubectl's copy of the last applied configuration.
fn trim_meta<K: Resource>(obj: &mut K) {
    let meta = obj.meta_mut();
    meta.managed_fields = None;
    if let Some(a) = meta.annotations.as_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

/// Keeps of `map` the keys `keep` says, and none at all when none is left (an empty map
/// allocates nothing).
fn retain_keys(map: &mut Option<BTreeMap<String, String>>, keep: impl Fn(&str) -> bool) {
    if let Some(m) = map.as_mut() {
        m.retain(|k, _| keep(k));
        if m.is_empty() {
            *map = None;
        }
    }
}

/// As [`trim_meta`], and what kube-proxy's decisions do not read of a Service: its
/// labels but the proxy-name and headless ones, its annotations but kxp's own
/// (`kxp.dev/`), its owners, its selector (the EndpointSlice controller's business) and
/// its status conditions. Helm and kubectl give every Service labels and annotations
/// that each cost a map node and a few strings: at 100,000 Services some 100 MB.
fn trim_service(svc: &mut Service) {
    trim_meta(svc);
    let meta = &mut svc.metadata;
    retain_keys(&mut meta.labels, |k| {
        k == LABEL_SERVICE_PROXY_NAME || k == LABEL_HEADLESS
    });
    retain_keys(&mut meta.annotations, |k| {
        k.starts_with(KXP_ANNOTATION_PREFIX)
    });
    meta.owner_references = None;
    if let Some(spec) = svc.spec.as_mut() {
        spec.selector = None;
    }
    if let Some(status) = svc.status.as_mut() {
        status.conditions = None;
    }
}

/// As [`trim_meta`], and what kube-proxy does not read of an EndpointSlice's metadata:
/// its labels but the Service's name (and the headless mark), its annotations but the
/// trigger time, its owners. Of its endpoints, a [`Slice`] decodes only what is read.
fn trim_slice(slice: &mut Slice) {
    trim_meta(slice);
    let meta = &mut slice.metadata;
    retain_keys(&mut meta.labels, |k| {
        k == LABEL_SERVICE_NAME || k == LABEL_HEADLESS
    });
    retain_keys(&mut meta.annotations, |k| k == ANNOTATION_TRIGGER_TIME);
    meta.owner_references = None;
}

/// Watches `api` (the objects `cfg` selects) into a store, each object `trim`med first,
/// counting under `index` what the watch does.
fn spawn<K>(
    tasks: &mut Vec<JoinHandle<()>>,
    api: Api<K>,
    cfg: watcher::Config,
    index: usize,
    shared: &Arc<Shared>,
    trim: fn(&mut K),
) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
{
    let (store, writer) = reflector::store();
    let shared = Arc::clone(shared);
    let stream = watcher(api, cfg)
        .default_backoff()
        .modify(trim)
        .reflect(writer);
    tasks.push(tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            let applied = {
                let mut c = shared.counters(index);
                match item {
                    Ok(ev) => match ev {
                        watcher::Event::Init => {
                            if c.listed_once {
                                c.st.relists += 1;
                            }
                            c.listed_once = true;
                            false
                        }
                        watcher::Event::InitApply(_) => {
                            c.st.events += 1;
                            false
                        }
                        watcher::Event::InitDone => {
                            c.st.synced = true;
                            c.dirty_full = true;
                            c.dirty.clear();
                            true
                        }
                        watcher::Event::Apply(o) | watcher::Event::Delete(o) => {
                            c.st.events += 1;
                            let m = o.meta();
                            c.dirty.insert((
                                m.namespace.clone().unwrap_or_default(),
                                m.name.clone().unwrap_or_default(),
                            ));
                            true
                        }
                    },
                    Err(e) => {
                        let text = error_text(&e);
                        c.st.errors += 1;
                        // Log once per streak: a request succeeded since the last log.
                        let resource = c.st.resource;
                        let recovered = shared.observer.last_ok(resource) > c.logged_at;
                        if c.logged_at.is_none() || recovered {
                            c.logged_at = Some(Instant::now());
                            let then = match &e {
                                watcher::Error::WatchError(s) if s.code == 410 => "relisting",
                                _ => "retrying with backoff",
                            };
                            tracing::warn!(
                                "watch {}: {text} ({then}; the last good state is kept)",
                                c.st.resource
                            );
                        }
                        c.st.last_error = Some(text);
                        false
                    }
                }
            };
            if applied {
                shared.bump();
            }
        }
    }));
    store
}

/// An error and its chain of causes on one line ("client error (Connect)" says little;
/// its causes say "invalid peer certificate: UnknownIssuer").
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !text.contains(&t) {
            text.push_str(": ");
            text.push_str(&t);
        }
        cur = c.source();
    }
    text
}

/// A one-line error text: the HTTP code and message of API errors (not the whole Status).
fn error_text(e: &watcher::Error) -> String {
    let (what, inner) = match e {
        watcher::Error::InitialListFailed(k) => ("list failed", k),
        watcher::Error::WatchStartFailed(k) => ("watch failed", k),
        watcher::Error::WatchFailed(k) => ("watch stream failed", k),
        watcher::Error::WatchError(s) => {
            return format!("watch error {} {}: {}", s.code, s.reason, s.message);
        }
        watcher::Error::NoResourceVersion => return e.to_string(),
    };
    match inner {
        kube::Error::Api(s) => format!("{what}: HTTP {} {}: {}", s.code, s.reason, s.message),
        other => format!("{what}: {}", with_causes(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, ObjectMeta};
    use std::collections::BTreeMap;

    /// What is trimmed is what no decision reads: managed fields, kubectl's copy of the
    /// applied configuration, owners, the labels and annotations kxp does not read; the
    /// Service's name label, the trigger time and the endpoints' read fields stay.
    #[test]
    fn trimming_a_slice_keeps_what_decisions_read() {
        let annotations = BTreeMap::from([
            (
                "kubectl.kubernetes.io/last-applied-configuration".to_string(),
                "{}".to_string(),
            ),
            ("example.com/note".to_string(), "x".to_string()),
            (
                "endpoints.kubernetes.io/last-change-trigger-time".to_string(),
                "2026-12-01T10:00:00Z".to_string(),
            ),
        ]);
        let meta = ObjectMeta {
            name: Some("web-abcde".into()),
            labels: Some(BTreeMap::from([
                ("kubernetes.io/service-name".to_string(), "web".to_string()),
                (
                    "endpointslice.kubernetes.io/managed-by".to_string(),
                    "endpointslice-controller.k8s.io".to_string(),
                ),
                ("app.kubernetes.io/name".to_string(), "web".to_string()),
            ])),
            annotations: Some(annotations),
            managed_fields: Some(vec![ManagedFieldsEntry::default()]),
            owner_references: Some(vec![Default::default()]),
            ..Default::default()
        };
        let mut slice = Slice::from(EndpointSlice {
            metadata: meta,
            address_type: "IPv4".into(),
            endpoints: vec![Endpoint {
                addresses: vec!["10.0.0.1".into()],
                node_name: Some("node-a".into()),
                zone: Some("z1".into()),
                hostname: Some("web-1".into()),
                target_ref: Some(ObjectReference {
                    kind: Some("Pod".into()),
                    name: Some("web-1".into()),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ports: None,
        });
        trim_slice(&mut slice);
        let meta = &slice.metadata;
        assert!(meta.managed_fields.is_none() && meta.owner_references.is_none());
        let keys = |m: &Option<BTreeMap<String, String>>| -> Vec<String> {
            m.iter().flat_map(|m| m.keys().cloned()).collect()
        };
        assert_eq!(
            keys(&meta.annotations),
            ["endpoints.kubernetes.io/last-change-trigger-time"]
        );
        assert_eq!(keys(&meta.labels), ["kubernetes.io/service-name"]);
        let ep = &slice.endpoints[0];
        assert_eq!(
            (ep.address.clone(), ep.node_name.as_deref()),
            (
                Some(translate::slice::Address::Ip("10.0.0.1".parse().unwrap())),
                Some("node-a")
            )
        );
    }

    /// A Service keeps its proxy-name label, kxp's annotations, its spec but the
    /// selector and its LoadBalancer ingress; the rest of its labels and annotations
    /// go, and an emptied map goes whole.
    #[test]
    fn trimming_a_service_keeps_what_decisions_read() {
        let yaml = r#"
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
  labels: {app.kubernetes.io/name: web, helm.sh/chart: web-1.0.0, service.kubernetes.io/service-proxy-name: kxp}
  annotations: {meta.helm.sh/release-name: web, kxp.dev/scheduler: maglev}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  selector: {app: web}
  ports: [{port: 80, protocol: TCP}]
status:
  loadBalancer: {ingress: [{ip: 192.0.2.10}]}
  conditions: [{type: Ready, status: "True", lastTransitionTime: "2026-12-01T10:00:00Z", reason: R, message: M}]
"#;
        let mut svc: Service = serde_yaml::from_str(yaml).unwrap();
        let before = svc.clone();
        trim_service(&mut svc);
        let meta = &svc.metadata;
        assert_eq!(
            meta.labels,
            Some(BTreeMap::from([(
                LABEL_SERVICE_PROXY_NAME.to_string(),
                "kxp".to_string()
            )]))
        );
        assert_eq!(
            meta.annotations,
            Some(BTreeMap::from([(
                translate::k8s::ANNOTATION_SCHEDULER.to_string(),
                "maglev".to_string()
            )]))
        );
        let spec = svc.spec.as_ref().unwrap();
        assert!(spec.selector.is_none());
        assert_eq!(
            (
                spec.ports.clone(),
                spec.cluster_ip.clone(),
                spec.type_.clone()
            ),
            {
                let b = before.spec.as_ref().unwrap();
                (b.ports.clone(), b.cluster_ip.clone(), b.type_.clone())
            }
        );
        let status = svc.status.as_ref().unwrap();
        assert!(status.conditions.is_none());
        assert_eq!(
            status.load_balancer,
            before.status.as_ref().unwrap().load_balancer
        );

        // Nothing of kxp's left in a map: no map.
        let mut plain = before.clone();
        plain.metadata.labels = Some(BTreeMap::from([("app".to_string(), "web".to_string())]));
        plain.metadata.annotations = None;
        trim_service(&mut plain);
        assert!(plain.metadata.labels.is_none());
    }
}
