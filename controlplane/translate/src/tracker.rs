//! kube-proxy's change trackers (`ServiceChangeTracker`, `EndpointsChangeTracker`) and
//! the sync that follows: objects come in one by one (or as a whole state, diffed), the
//! Services they touch are marked, and [`Tracker::sync`] rebuilds only those Services'
//! ports and turns the difference into a new [`Snapshot`].
//!
//! The snapshot itself is double-buffered, RCU style: the tracker keeps the snapshot it
//! published before the current one and, once no worker holds it any more (its `Arc` is
//! unique again), brings it up to date with the operations of the last two syncs instead
//! of copying the current one. A sync after one Service changed therefore costs that
//! Service's rebuild plus a handful of index operations, whatever the cluster's size.
//! A node change (labels, addresses, ServiceCIDRs, settings) rebuilds every Service, as
//! in kube-proxy.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

// Seeded at random per process: keys are the cluster's names, hashed a million times
// in a full sync (SipHash was a tenth of it).
use foldhash::{HashMap, HashSet};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::networking::v1::ServiceCIDR;

use crate::k8s::{
    ClusterState, LABEL_SERVICE_NAME, ModelError, NodeSettings, index_slices, node_context,
    obj_name, service_ports,
};
use crate::slice::Slice;
use nat::model::{NodeContext, ServicePort};
use nat::snapshot::{Indexer, Op, Snapshot, Update};

/// EndpointSlice annotation with the time of the change that triggered it.
pub const ANNOTATION_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// `(namespace, name)`.
pub type ObjKey = (String, String);

fn key_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> ObjKey {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// Whether `new` is what is held already (the same `Arc`, or an equal object).
fn unchanged<T: PartialEq>(held: Option<&Arc<T>>, new: Option<&Arc<T>>) -> bool {
    match (held, new) {
        (Some(a), Some(b)) => Arc::ptr_eq(a, b) || a == b,
        (None, None) => true,
        _ => false,
    }
}

/// The changes that make a kind's objects `objs`: each of them (applying an unchanged
/// one is a no-op), then a deletion for every `held` key not among them.
fn replacement<'h, K: std::hash::Hash + Eq + Clone + 'h, T>(
    objs: impl IntoIterator<Item = Arc<T>>,
    key: impl Fn(&T) -> K,
    held: impl Iterator<Item = &'h K>,
) -> Vec<(K, Option<Arc<T>>)> {
    let mut out: Vec<(K, Option<Arc<T>>)> = objs.into_iter().map(|o| (key(&o), Some(o))).collect();
    let mut held = held.peekable();
    if held.peek().is_some() {
        let seen: HashSet<&K> = out.iter().map(|(k, _)| k).collect();
        let gone: Vec<K> = held.filter(|k| !seen.contains(k)).cloned().collect();
        out.extend(gone.into_iter().map(|k| (k, None)));
    }
    out
}

/// What a sync produced.
#[derive(Debug)]
pub struct Synced {
    /// The new snapshot and which Service ports it adds and drops.
    pub update: Update,
    /// Objects or values skipped the way kube-proxy skips them (for rebuilt Services).
    pub notes: Vec<String>,
    /// Objects that could not be read: a Service in error keeps its previous ports; a
    /// node error keeps the previous node context.
    pub errors: Vec<ModelError>,
    /// Distinct Services and EndpointSlices changed since the last sync.
    pub service_changes: u64,
    pub endpoint_changes: u64,
    /// Services whose ports were rebuilt.
    pub rebuilt: usize,
    /// The `last-change-trigger-time` annotations of the EndpointSlices changed since the
    /// last sync (for `network_programming_duration_seconds`).
    pub trigger_times: Vec<String>,
}

/// The change tracker (see the module docs).
#[derive(Debug)]
pub struct Tracker {
    settings: NodeSettings,
    services: HashMap<ObjKey, Arc<Service>>,
    slices: HashMap<ObjKey, Arc<Slice>>,
    /// Slice → the Service it belongs to (its `kubernetes.io/service-name`).
    slice_owner: HashMap<ObjKey, ObjKey>,
    /// Service → its slices (same namespace), sorted by name: the order kube-proxy's
    /// endpoint join reads them in.
    service_slices: HashMap<ObjKey, Vec<(String, Arc<Slice>)>>,
    nodes: BTreeMap<String, Arc<Node>>,
    cidrs: BTreeMap<String, Arc<ServiceCIDR>>,
    node: Arc<NodeContext>,
    node_dirty: bool,
    /// Services to rebuild (in the order of their keys, at the sync).
    dirty: HashSet<ObjKey>,
    /// Slots of each Service's ports.
    built: HashMap<ObjKey, Vec<u32>>,
    indexer: Indexer,
    current: Option<Arc<Snapshot>>,
    /// The snapshot published before `current`, and the ops it lacks.
    spare: Option<(Arc<Snapshot>, Vec<Op>)>,
    changed_services: HashSet<ObjKey>,
    changed_slices: HashSet<ObjKey>,
    trigger_times: Vec<String>,
    pending_notes: Vec<String>,
    /// What NetworkPolicy decisions are made of, and the view built from them: built
    /// whole when policies appear or the settings change (`policy_dirty`), else brought
    /// up to date by what changed: a namespace's policies (`dirty_policy_ns`), a
    /// namespace's labels (`dirty_namespaces`), a pod (`dirty_pods`).
    pods: HashMap<ObjKey, Arc<k8s_openapi::api::core::v1::Pod>>,
    namespaces: HashMap<String, Arc<k8s_openapi::api::core::v1::Namespace>>,
    policies: HashMap<ObjKey, Arc<k8s_openapi::api::networking::v1::NetworkPolicy>>,
    policy_dirty: bool,
    dirty_policy_ns: BTreeSet<String>,
    dirty_namespaces: BTreeSet<String>,
    dirty_pods: BTreeSet<ObjKey>,
    policy: Option<Arc<nat::policy::PolicyView>>,
    /// Snapshots made by copying (the previous one was still in use) and by catching up.
    pub copies: u64,
    pub reuses: u64,
}

impl Tracker {
    pub fn new(settings: NodeSettings) -> Tracker {
        Tracker {
            node: Arc::new(NodeContext {
                name: settings.node_name.clone(),
                masquerade_all: settings.masquerade_all,
                ..Default::default()
            }),
            settings,
            services: HashMap::default(),
            slices: HashMap::default(),
            slice_owner: HashMap::default(),
            service_slices: HashMap::default(),
            nodes: BTreeMap::new(),
            cidrs: BTreeMap::new(),
            node_dirty: true,
            dirty: HashSet::default(),
            built: HashMap::default(),
            indexer: Indexer::default(),
            current: None,
            spare: None,
            changed_services: HashSet::default(),
            changed_slices: HashSet::default(),
            trigger_times: Vec::new(),
            pending_notes: Vec::new(),
            pods: HashMap::default(),
            namespaces: HashMap::default(),
            policies: HashMap::default(),
            policy_dirty: false,
            dirty_policy_ns: BTreeSet::new(),
            dirty_namespaces: BTreeSet::new(),
            dirty_pods: BTreeSet::new(),
            policy: None,
            copies: 0,
            reuses: 0,
        }
    }

    /// New node settings (e.g. the host's addresses once known): every Service is rebuilt.
    pub fn set_settings(&mut self, settings: NodeSettings) {
        self.policy_dirty |= settings.network_policy != self.settings.network_policy
            || settings.node_name != self.settings.node_name;
        self.settings = settings;
        self.node_dirty = true;
    }

    pub fn settings(&self) -> &NodeSettings {
        &self.settings
    }

    /// This node's Node object, if seen.
    pub fn node_object(&self) -> Option<&Arc<Node>> {
        self.nodes.get(&self.settings.node_name)
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    pub fn slice_count(&self) -> usize {
        self.slices.len()
    }

    /// A Service added or changed (`Some`) or deleted (`None`).
    pub fn apply_service(&mut self, key: ObjKey, svc: Option<Arc<Service>>) {
        if unchanged(self.services.get(&key), svc.as_ref()) {
            return;
        }
        match svc {
            Some(s) => self.services.insert(key.clone(), s),
            None => self.services.remove(&key),
        };
        self.changed_services.insert(key.clone());
        self.dirty.insert(key);
    }

    /// An EndpointSlice added or changed (`Some`) or deleted (`None`).
    pub fn apply_slice(&mut self, key: ObjKey, slice: Option<Arc<Slice>>) {
        if unchanged(self.slices.get(&key), slice.as_ref()) {
            return;
        }
        self.changed_slices.insert(key.clone());
        if let Some(old) = self.slice_owner.remove(&key) {
            if let Some(list) = self.service_slices.get_mut(&old) {
                list.retain(|(name, _)| *name != key.1);
                if list.is_empty() {
                    self.service_slices.remove(&old);
                }
            }
            self.dirty.insert(old);
        }
        match slice {
            Some(s) => {
                let owner = s
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(LABEL_SERVICE_NAME))
                    .filter(|n| !n.is_empty())
                    .cloned();
                if let Some(t) = s
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(ANNOTATION_TRIGGER_TIME))
                {
                    self.trigger_times.push(t.clone());
                }
                match owner {
                    Some(svc) => {
                        let owner = (key.0.clone(), svc);
                        let list = self.service_slices.entry(owner.clone()).or_default();
                        let at = list.partition_point(|(name, _)| *name < key.1);
                        list.insert(at, (key.1.clone(), s.clone()));
                        self.slice_owner.insert(key.clone(), owner.clone());
                        self.dirty.insert(owner);
                    }
                    None => self.pending_notes.push(format!(
                        "EndpointSlice {}: no {LABEL_SERVICE_NAME} label, ignored",
                        obj_name(&s.metadata)
                    )),
                }
                self.slices.insert(key, s);
            }
            None => {
                self.slices.remove(&key);
            }
        }
    }

    /// A Node added or changed (`Some`) or deleted (`None`).
    pub fn apply_node(&mut self, name: String, node: Option<Arc<Node>>) {
        if unchanged(self.nodes.get(&name), node.as_ref()) {
            return;
        }
        match node {
            Some(n) => self.nodes.insert(name.clone(), n),
            None => self.nodes.remove(&name),
        };
        if name == self.settings.node_name {
            self.node_dirty = true;
        }
    }

    /// A ServiceCIDR added or changed (`Some`) or deleted (`None`).
    pub fn apply_service_cidr(&mut self, name: String, cidr: Option<Arc<ServiceCIDR>>) {
        if unchanged(self.cidrs.get(&name), cidr.as_ref()) {
            return;
        }
        match cidr {
            Some(c) => self.cidrs.insert(name, c),
            None => self.cidrs.remove(&name),
        };
        self.node_dirty = true;
    }

    /// Makes the tracked Services what `objs` holds: new and changed ones applied,
    /// missing ones deleted. Unchanged objects (same `Arc`, or equal) cost a comparison.
    pub fn replace_services(&mut self, objs: impl IntoIterator<Item = Arc<Service>>) {
        let held = self.services.keys();
        for (k, o) in replacement(objs, |o| key_of(&o.metadata), held) {
            self.apply_service(k, o);
        }
    }

    /// As [`Self::replace_services`], for EndpointSlices.
    pub fn replace_slices(&mut self, objs: impl IntoIterator<Item = Arc<Slice>>) {
        let held = self.slices.keys();
        for (k, o) in replacement(objs, |o| key_of(&o.metadata), held) {
            self.apply_slice(k, o);
        }
    }

    /// As [`Self::replace_services`], for Nodes.
    pub fn replace_nodes(&mut self, objs: impl IntoIterator<Item = Arc<Node>>) {
        let held = self.nodes.keys();
        for (k, o) in replacement(objs, |o| o.metadata.name.clone().unwrap_or_default(), held) {
            self.apply_node(k, o);
        }
    }

    /// As [`Self::replace_services`], for ServiceCIDRs.
    pub fn replace_service_cidrs(&mut self, objs: impl IntoIterator<Item = Arc<ServiceCIDR>>) {
        let held = self.cidrs.keys();
        for (k, o) in replacement(objs, |o| o.metadata.name.clone().unwrap_or_default(), held) {
            self.apply_service_cidr(k, o);
        }
    }

    /// Makes the tracked objects those of `state` (copies them).
    pub fn replace_all(&mut self, state: &ClusterState) {
        self.replace_services(state.services.iter().cloned().map(Arc::new));
        self.replace_slices(
            state
                .endpoint_slices
                .iter()
                .map(|s| Arc::new(Slice::from(s))),
        );
        self.replace_nodes(state.nodes.iter().cloned().map(Arc::new));
        self.replace_service_cidrs(state.service_cidrs.iter().cloned().map(Arc::new));
        self.replace_policy_inputs(
            state.pods.iter().cloned().map(Arc::new).collect(),
            state.namespaces.iter().cloned().map(Arc::new).collect(),
            state
                .network_policies
                .iter()
                .cloned()
                .map(Arc::new)
                .collect(),
        );
    }

    /// The Pods, Namespaces and NetworkPolicies NetworkPolicy decisions are made of, all
    /// of them. At the next sync a changed pod costs its own entry, a changed namespace
    /// or policy its namespace's pods (see [`nat::policy::PolicyView::set_policies`]).
    pub fn replace_policy_inputs(
        &mut self,
        pods: Vec<Arc<k8s_openapi::api::core::v1::Pod>>,
        namespaces: Vec<Arc<k8s_openapi::api::core::v1::Namespace>>,
        policies: Vec<Arc<k8s_openapi::api::networking::v1::NetworkPolicy>>,
    ) {
        let namespaces: HashMap<String, Arc<k8s_openapi::api::core::v1::Namespace>> = namespaces
            .into_iter()
            .map(|n| (n.metadata.name.clone().unwrap_or_default(), n))
            .collect();
        for (name, _) in changed(&self.namespaces, &namespaces) {
            self.dirty_namespaces.insert(name.clone());
        }
        self.namespaces = namespaces;
        let policies: HashMap<ObjKey, Arc<k8s_openapi::api::networking::v1::NetworkPolicy>> =
            policies
                .into_iter()
                .map(|p| (key_of(&p.metadata), p))
                .collect();
        for (key, _) in changed(&self.policies, &policies) {
            self.dirty_policy_ns.insert(key.0.clone());
        }
        self.policies = policies;
        let mut next: HashMap<ObjKey, Arc<k8s_openapi::api::core::v1::Pod>> = pods
            .into_iter()
            .map(|p| {
                let key = (
                    p.metadata.namespace.clone().unwrap_or_default(),
                    p.metadata.name.clone().unwrap_or_default(),
                );
                (key, p)
            })
            .collect();
        for (key, old) in &self.pods {
            match next.get(key) {
                Some(new) if same(new, old) => {}
                _ => {
                    self.dirty_pods.insert(key.clone());
                }
            }
        }
        for key in next.keys() {
            if !self.pods.contains_key(key) {
                self.dirty_pods.insert(key.clone());
            }
        }
        std::mem::swap(&mut self.pods, &mut next);
    }

    /// Whether anything changed since the last sync.
    pub fn has_changes(&self) -> bool {
        self.node_dirty
            || self.policy_dirty
            || !self.dirty_policy_ns.is_empty()
            || !self.dirty_namespaces.is_empty()
            || !self.dirty_pods.is_empty()
            || !self.dirty.is_empty()
    }

    /// Rebuilds what changed and produces the next snapshot (see the module docs): the
    /// node's context, the NetworkPolicy view, the Services a change touched, then the
    /// snapshot with those changes applied.
    pub fn sync(&mut self, generation: u64) -> Synced {
        let mut notes = std::mem::take(&mut self.pending_notes);
        let mut errors = Vec::new();
        let full = self.sync_node(&mut notes, &mut errors) || self.current.is_none();
        self.sync_policy(&mut notes);
        let rebuilt = self.dirty.len();
        let (removed, added) = self.rebuild_services(&mut notes, &mut errors);
        let snapshot = self.next_snapshot(generation);
        Synced {
            update: Update {
                snapshot,
                removed,
                added,
                full,
            },
            notes,
            errors,
            service_changes: std::mem::take(&mut self.changed_services).len() as u64,
            endpoint_changes: std::mem::take(&mut self.changed_slices).len() as u64,
            rebuilt,
            trigger_times: std::mem::take(&mut self.trigger_times),
        }
    }

    /// Reads the node's context again when its Node or the ServiceCIDRs changed; true
    /// when it is different (every Service is then rebuilt: a full update).
    fn sync_node(&mut self, notes: &mut Vec<String>, errors: &mut Vec<ModelError>) -> bool {
        if !self.node_dirty {
            return false;
        }
        self.node_dirty = false;
        let node = self.nodes.get(&self.settings.node_name).map(|n| &**n);
        match node_context(
            node,
            self.cidrs.values().map(|c| &**c),
            &self.settings,
            notes,
        ) {
            Ok(ctx) if ctx != *self.node => {
                self.node = Arc::new(ctx);
                self.dirty.extend(self.services.keys().cloned());
                self.dirty.extend(self.built.keys().cloned());
                true
            }
            Ok(_) => false,
            Err(e) => {
                errors.push(e);
                false
            }
        }
    }

    /// Brings the NetworkPolicy view up to date: built whole when asked or when policies
    /// appear, else changed pod by pod, namespace by namespace.
    fn sync_policy(&mut self, notes: &mut Vec<String>) {
        let dirty_pods = std::mem::take(&mut self.dirty_pods);
        let dirty_namespaces = std::mem::take(&mut self.dirty_namespaces);
        let dirty_policy_ns = std::mem::take(&mut self.dirty_policy_ns);
        // Whole: when asked, and when policies appear (none held, nothing isolated).
        let whole = std::mem::take(&mut self.policy_dirty)
            || (self.policy.is_none() && !dirty_policy_ns.is_empty());
        if !self.settings.network_policy {
            self.policy = None;
        } else if whole {
            let (view, errs) = crate::policy::build_view(
                self.pods.values().map(|p| &**p),
                self.namespaces.values().map(|n| &**n),
                self.policies.values().map(|p| &**p),
                &self.settings.node_name,
            );
            notes.extend(errs.iter().map(|e| format!("{e}: left out")));
            self.policy = view.map(Arc::new);
        } else if let Some(view) = &mut self.policy
            && !(dirty_pods.is_empty() && dirty_namespaces.is_empty() && dirty_policy_ns.is_empty())
        {
            // Only what changed (a copy of the view's index when a snapshot still holds
            // it: pointers, not pods).
            let view = Arc::make_mut(view);
            for name in &dirty_namespaces {
                crate::policy::set_namespace(view, name, self.namespaces.get(name).map(|n| &**n));
            }
            for ns in &dirty_policy_ns {
                let errs = crate::policy::set_policies(
                    view,
                    ns,
                    self.policies
                        .iter()
                        .filter(|(k, _)| &k.0 == ns)
                        .map(|(_, p)| &**p),
                );
                notes.extend(errs.iter().map(|e| format!("{e}: left out")));
            }
            for key in &dirty_pods {
                match self.pods.get(key) {
                    Some(p) => crate::policy::set_pod(view, p),
                    None => view.remove_pod(&key.0, &key.1),
                }
            }
            if !view.has_policies() {
                self.policy = None;
            }
        }
    }

    /// Rebuilds the ports of every Service a change touched, in the indexer; the ports
    /// removed and added. A Service that cannot be read keeps what was working.
    fn rebuild_services(
        &mut self,
        notes: &mut Vec<String>,
        errors: &mut Vec<ModelError>,
    ) -> (Vec<Arc<ServicePort>>, Vec<Arc<ServicePort>>) {
        let mut removed = Vec::new();
        let mut added = Vec::new();
        let mut dirty: Vec<ObjKey> = std::mem::take(&mut self.dirty).into_iter().collect();
        dirty.sort_unstable();
        for key in dirty {
            let ports = match self.services.get(&key) {
                None => Ok(Vec::new()),
                Some(svc) => self.ports_of(&key, svc, notes),
            };
            let ports = match ports {
                Ok(p) => p,
                Err(e) => {
                    // Keep what was working for this Service.
                    errors.push(e);
                    continue;
                }
            };
            for slot in self.built.remove(&key).unwrap_or_default() {
                if let Some(old) = self.indexer.remove(slot) {
                    removed.push(old);
                }
            }
            let mut slots = Vec::with_capacity(ports.len());
            for sp in ports {
                let sp = Arc::new(sp);
                slots.push(self.indexer.insert(sp.clone()));
                added.push(sp);
            }
            if !slots.is_empty() {
                self.built.insert(key, slots);
            }
        }
        (removed, added)
    }

    /// The next snapshot: the spare one (two syncs old, no longer read by anyone) with
    /// the last two syncs' operations applied, else a copy of the current one.
    fn next_snapshot(&mut self, generation: u64) -> Arc<Snapshot> {
        let ops = self.indexer.take_ops();
        let reused = match self.spare.take() {
            Some((mut spare, lag)) => match Arc::get_mut(&mut spare) {
                Some(s) => {
                    s.apply(&lag);
                    s.apply(&ops);
                    self.reuses += 1;
                    Some(spare)
                }
                None => None,
            },
            None => None,
        };
        let mut next = match reused {
            Some(s) => s,
            None => {
                self.copies += 1;
                let mut s = match &self.current {
                    Some(c) => (**c).clone(),
                    None => Snapshot::empty(generation, self.node.clone()),
                };
                s.apply(&ops);
                Arc::new(s)
            }
        };
        if let Some(s) = Arc::get_mut(&mut next) {
            s.generation = generation;
            s.node = self.node.clone();
            s.conflicts = self.indexer.conflicts();
            s.policy = self.policy.clone();
        }
        if let Some(prev) = self.current.replace(next.clone()) {
            self.spare = Some((prev, ops));
        }
        next
    }

    fn ports_of(
        &self,
        key: &ObjKey,
        svc: &Service,
        notes: &mut Vec<String>,
    ) -> Result<Vec<ServicePort>, ModelError> {
        let slices = self
            .service_slices
            .get(key)
            .into_iter()
            .flatten()
            .map(|(_, s)| &**s);
        let index = index_slices(slices, notes)?;
        service_ports(
            svc,
            &index,
            &self.node,
            self.settings.default_scheduler,
            self.settings.service_proxy_name.as_deref(),
            notes,
        )
    }
}

/// The same object: the same `Arc` (a watch store's, unchanged), or equal.
fn same<T: PartialEq>(a: &Arc<T>, b: &Arc<T>) -> bool {
    Arc::ptr_eq(a, b) || a == b
}

/// A snapshot and what was noticed while building it.
#[derive(Debug)]
pub struct Built {
    pub snapshot: Snapshot,
    /// Objects or values skipped the way kube-proxy skips them.
    pub notes: Vec<String>,
}

/// Builds the node context and every Service port, and indexes them: the strict,
/// one-shot form of [`Tracker`] (`kxp trace`, state-file validation).
///
/// # Errors
/// A [`ModelError`] for the first field that cannot be read.
pub fn build(
    state: &ClusterState,
    settings: &NodeSettings,
    generation: u64,
) -> Result<Built, ModelError> {
    let mut t = Tracker::new(settings.clone());
    t.replace_all(state);
    let mut synced = t.sync(generation);
    if !synced.errors.is_empty() {
        return Err(synced.errors.swap_remove(0));
    }
    let mut notes = synced.notes;
    notes.extend(synced.update.snapshot.conflicts.iter().cloned());
    drop(t);
    let snapshot =
        Arc::try_unwrap(synced.update.snapshot).unwrap_or_else(|shared| (*shared).clone());
    Ok(Built { snapshot, notes })
}

#[cfg(any(test, feature = "test-util"))]
pub mod testutil;

#[cfg(test)]
#[path = "tracker_tests.rs"]
mod tests;

/// The entries of `old` and `new` that differ (added, removed or changed), keyed by
/// their key (unchanged: the same `Arc`, or equal).
fn changed<'a, K: std::hash::Hash + Eq, V: PartialEq>(
    old: &'a HashMap<K, Arc<V>>,
    new: &'a HashMap<K, Arc<V>>,
) -> impl Iterator<Item = (&'a K, ())> + 'a {
    let gone_or_changed = old
        .iter()
        .filter(move |(k, o)| !new.get(*k).is_some_and(|n| same(n, o)))
        .map(|(k, _)| (k, ()));
    let added = new
        .keys()
        .filter(move |k| !old.contains_key(*k))
        .map(|k| (k, ()));
    gone_or_changed.chain(added)
}
