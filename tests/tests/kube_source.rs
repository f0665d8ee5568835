//! `controlplane::kube_source` against the fake API server: kube-proxy's selectors, live
//! changes, relists after 410, API outages and bursts. Every wait is bounded.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use controlplane::kube_source::{
    KubeSource, RateLimit, SourceConfig, Watched, client_from, foreign_policy_groups,
};
use kxp_tests::fakeapi::{FakeApi, Kind};
use serde_json::{Value, json};

const PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
const HEADLESS: &str = "service.kubernetes.io/headless";

fn svc(name: &str, cluster_ip: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {"clusterIP": cluster_ip, "clusterIPs": [cluster_ip], "type": "ClusterIP",
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]},
    })
}

fn slice(name: &str, addr: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [addr], "conditions": {"ready": true}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    })
}

fn node(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
           "spec": {"podCIDRs": ["10.244.0.0/24"]}})
}

fn cidr(name: &str, net: &str) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
           "metadata": {"name": name}, "spec": {"cidrs": [net]}})
}

fn kubeconfig(api: &FakeApi) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kxp-kube-source-{}-{}",
        std::process::id(),
        api.addr().port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let kc = dir.join("kubeconfig");
    api.write_kubeconfig(&kc).unwrap();
    kc
}

async fn start(api: &FakeApi, proxy_name: Option<&str>) -> KubeSource {
    let kc = kubeconfig(api);
    let client = client_from(Some(&kc), None, None).await.unwrap();
    // The client has read it: nothing of the test stays behind in the temp dir.
    let _ = std::fs::remove_dir_all(kc.parent().unwrap());
    let src = KubeSource::start(
        client,
        SourceConfig {
            node_name: "node-a".into(),
            service_proxy_name: proxy_name.map(str::to_string),
            network_policy: true,
        },
    );
    assert!(
        src.wait_synced(Duration::from_secs(10)).await,
        "initial sync: {:?}",
        src.status()
    );
    src
}

async fn wait_for(what: &str, within: Duration, cond: impl Fn() -> bool) {
    let waited = tokio::time::timeout(within, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "timed out ({within:?}) waiting for {what}");
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn svc_names(st: &Watched) -> BTreeSet<String> {
    st.services
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect()
}

/// An endpoint's first address as text.
fn address(ep: &translate::slice::SliceEndpoint) -> String {
    match &ep.address {
        Some(translate::slice::Address::Ip(ip)) => ip.to_string(),
        other => format!("{other:?}"),
    }
}

fn slice_names(st: &Watched) -> BTreeSet<String> {
    st.endpoint_slices
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect()
}

fn node_names(st: &Watched) -> BTreeSet<String> {
    st.nodes
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect()
}

fn cidr_names(st: &Watched) -> BTreeSet<String> {
    st.service_cidrs
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect()
}

fn seed(api: &FakeApi) {
    api.create(&svc("web", "10.96.0.10", json!({}))).unwrap();
    api.create(&svc("other", "10.96.0.11", json!({PROXY_NAME: "x"})))
        .unwrap();
    api.create(&svc("headless", "None", json!({}))).unwrap();
    api.create(&slice(
        "web-1",
        "10.0.0.1",
        json!({"kubernetes.io/service-name": "web"}),
    ))
    .unwrap();
    api.create(&slice("hl-1", "10.0.0.2", json!({HEADLESS: ""})))
        .unwrap();
    api.create(&node("node-a")).unwrap();
    api.create(&node("node-b")).unwrap();
    api.create(&cidr("kubernetes", "10.96.0.0/16")).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_sync_honours_selectors() {
    let api = FakeApi::start();
    seed(&api);
    let src = start(&api, None).await;
    let st = src.state();
    assert_eq!(svc_names(&st), set(&["web"]));
    assert_eq!(slice_names(&st), set(&["web-1"]));
    assert_eq!(node_names(&st), set(&["node-a"]));
    assert_eq!(cidr_names(&st), set(&["kubernetes"]));
    assert!(src.synced());
    let status = src.status();
    for r in &status.resources {
        assert!(r.synced, "{r:?}");
        assert_eq!(r.relists, 0, "{r:?}");
    }
    assert_eq!(status.get("services").unwrap().objects, 1);
    // What the watches hold builds a snapshot, handed over as `kxp run` hands it.
    let mut tracker = translate::tracker::Tracker::new(translate::k8s::NodeSettings {
        node_name: "node-a".into(),
        ..Default::default()
    });
    src.take_changes().apply(&mut tracker);
    let synced = tracker.sync(1);
    assert!(synced.errors.is_empty(), "{:?}", synced.errors);
    assert!(synced.update.snapshot.port_count() > 0);
    src.stop();

    // With serviceProxyName, only the Services labelled with it.
    let src = start(&api, Some("x")).await;
    assert_eq!(svc_names(&src.state()), set(&["other"]));
    src.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_are_visible_and_bump_subscribers() {
    let api = FakeApi::start();
    seed(&api);
    let src = start(&api, None).await;
    let within = Duration::from_secs(2);
    let mut rx = src.subscribe();
    let before = *rx.borrow_and_update();

    api.create(&svc("new", "10.96.0.20", json!({}))).unwrap();
    wait_for("add", within, || {
        svc_names(&src.state()) == set(&["new", "web"])
    })
    .await;
    assert!(
        tokio::time::timeout(within, rx.changed()).await.is_ok(),
        "subscribe() bumps"
    );
    assert!(*rx.borrow_and_update() > before);

    // Modify an EndpointSlice.
    api.apply(&slice(
        "web-1",
        "10.0.0.9",
        json!({"kubernetes.io/service-name": "web"}),
    ))
    .unwrap();
    let addr = |st: &Watched| st.endpoint_slices.first().map(|s| address(&s.endpoints[0]));
    wait_for("modify", within, || {
        addr(&src.state()).as_deref() == Some("10.0.0.9")
    })
    .await;

    // Delete, and a Node change.
    api.delete_named(Kind::Service, "default", "web").unwrap();
    wait_for("delete", within, || {
        svc_names(&src.state()) == set(&["new"])
    })
    .await;
    let mut n = node("node-a");
    n["metadata"]["labels"] = json!({"topology.kubernetes.io/zone": "z1"});
    api.apply(&n).unwrap();
    wait_for("node label", within, || {
        src.state().nodes[0]
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key("topology.kubernetes.io/zone"))
    })
    .await;
    // Leaving the label selector is a delete.
    api.apply(&svc("new", "10.96.0.20", json!({PROXY_NAME: "y"})))
        .unwrap();
    wait_for("leave selector", within, || src.state().services.is_empty()).await;
    assert!(src.status().get("services").unwrap().events >= 3);
    src.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relists_after_410() {
    let api = FakeApi::start();
    seed(&api);
    let src = start(&api, None).await;
    api.silence_watches(true);
    api.create(&svc("e", "10.96.0.5", json!({}))).unwrap();
    api.delete_named(Kind::Service, "default", "web").unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(svc_names(&src.state()), set(&["web"]), "silenced");
    api.compact(api.resource_version());
    api.drop_watches();
    api.silence_watches(false);
    wait_for("relist after 410", Duration::from_secs(15), || {
        svc_names(&src.state()) == set(&["e"])
    })
    .await;
    let status = src.status();
    let services = status.get("services").unwrap();
    assert!(services.relists >= 1, "{services:?}");
    assert!(src.synced());
    src.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_keeps_last_good_state() {
    let api = FakeApi::start();
    seed(&api);
    let src = start(&api, None).await;
    let good = src.state();
    api.fail_next(5, 500);
    api.drop_watches();
    for _ in 0..10 {
        let st = src.state();
        assert_eq!(svc_names(&st), svc_names(&good), "kept during the outage");
        assert_eq!(slice_names(&st), slice_names(&good));
        assert_eq!(node_names(&st), node_names(&good));
        assert_eq!(cidr_names(&st), cidr_names(&good));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    api.create(&svc("after", "10.96.0.30", json!({}))).unwrap();
    api.create(&slice("after-1", "10.0.0.3", json!({})))
        .unwrap();
    wait_for("recovery after 500s", Duration::from_secs(20), || {
        let st = src.state();
        svc_names(&st) == set(&["after", "web"]) && slice_names(&st) == set(&["after-1", "web-1"])
    })
    .await;
    // Every injected failure was met by some request (a watcher still in its backoff
    // may meet the last ones after the others recovered).
    wait_for(
        "the injected failures consumed",
        Duration::from_secs(20),
        || api.pending_failures() == 0,
    )
    .await;
    let status = src.status();
    let errors: u64 = status.resources.iter().map(|r| r.errors).sum();
    assert!(errors >= 1, "{status:?}");
    assert!(
        status.resources.iter().any(|r| r.last_error.is_some()),
        "{status:?}"
    );
    // Every watch is up again, also those that had no event to show it.
    wait_for("no resource failing", Duration::from_secs(20), || {
        src.status().resources.iter().all(|r| !r.failing)
    })
    .await;
    src.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_of_slice_changes_converges() {
    let api = FakeApi::start();
    seed(&api);
    let src = start(&api, None).await;
    // 1,000 changes over 100 slices: creates, updates, and deletes of every 10th.
    for i in 0..1000u32 {
        let n = i % 100;
        let addr = format!("10.1.{}.{}", i / 250, i % 250 + 1);
        api.apply(&slice(&format!("burst-{n}"), &addr, json!({})))
            .unwrap();
    }
    for n in (0..100).step_by(10) {
        api.delete_named(Kind::EndpointSlice, "default", &format!("burst-{n}"))
            .unwrap();
    }
    let expect = |n: u32| {
        let i = 900 + n;
        format!("10.1.{}.{}", i / 250, i % 250 + 1)
    };
    wait_for("burst converges", Duration::from_secs(20), || {
        let st = src.state();
        let burst: Vec<_> = st
            .endpoint_slices
            .iter()
            .filter_map(|s| {
                let name = s.metadata.name.as_deref()?;
                let n: u32 = name.strip_prefix("burst-")?.parse().ok()?;
                Some((n, address(&s.endpoints[0])))
            })
            .collect();
        burst.len() == 90 && burst.iter().all(|(n, a)| n % 10 != 0 && *a == expect(*n))
    })
    .await;
    assert!(src.status().get("endpointslices").unwrap().events >= 100);
    src.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_from_errors_are_clear() {
    let Err(err) = client_from(Some(std::path::Path::new("/nonexistent/kc")), None, None).await
    else {
        panic!("a missing kubeconfig is an error");
    };
    let err = err.to_string();
    assert!(
        err.contains("cannot read kubeconfig /nonexistent/kc"),
        "{err}"
    );
    assert!(err.contains("--kubeconfig PATH or --master URL"), "{err}");
    // --master alone works (and overrides a kubeconfig's server).
    let api = FakeApi::start();
    seed(&api);
    let client = client_from(None, Some(&api.url()), None).await.unwrap();
    let src = KubeSource::start(
        client,
        SourceConfig {
            node_name: "node-b".into(),
            service_proxy_name: None,
            network_policy: false,
        },
    );
    assert!(src.wait_synced(Duration::from_secs(10)).await);
    assert_eq!(node_names(&src.state()), set(&["node-b"]));
}

/// `clientConnection.qps` / `burst`: the client holds requests back beyond the burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_requests_are_rate_limited_as_configured() {
    use kube::api::{Api, ListParams};
    assert_eq!(RateLimit::from_config(Some(5.0), Some(0)), None);
    assert_eq!(RateLimit::from_config(None, Some(10)), None);
    let limit = RateLimit::from_config(Some(4.0), Some(2)).unwrap();
    assert_eq!(limit.period(), Duration::from_millis(500));

    let api = FakeApi::start();
    seed(&api);
    let client = client_from(None, Some(&api.url()), Some(limit))
        .await
        .unwrap();
    let services: Api<k8s_openapi::api::core::v1::Service> = Api::all(client.client);
    let started = std::time::Instant::now();
    for _ in 0..6 {
        services.list(&ListParams::default()).await.unwrap();
    }
    // 2 at once, then 2 per 500 ms: the 6th cannot leave before 1 s.
    assert!(
        started.elapsed() >= Duration::from_millis(1000),
        "6 requests in {:?} with burst 2 at 4/s",
        started.elapsed()
    );
    assert_eq!(api.requests("services", "list"), 6);
}

/// A real API server speaks TLS and wants a token (a ServiceAccount's, in cluster): the
/// client (rustls) trusts only the kubeconfig's CA and presents the token. A wrong token
/// and an untrusted server fail with errors that say so, and nothing is synced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_bearer_token() {
    let api = FakeApi::start_tls(Some("s3cret-token"));
    assert!(api.url().starts_with("https://127.0.0.1:"));
    seed(&api);
    let src = start(&api, None).await;
    assert!(!src.state().services.is_empty());
    src.stop();

    let kc = kubeconfig(&api);
    let good = std::fs::read_to_string(&kc).unwrap();
    let attempt = |text: String| {
        let kc = kc.clone();
        async move {
            std::fs::write(&kc, text).unwrap();
            let client = client_from(Some(&kc), None, None).await.unwrap();
            let src = KubeSource::start(
                client,
                SourceConfig {
                    node_name: "node-a".into(),
                    service_proxy_name: None,
                    network_policy: false,
                },
            );
            assert!(!src.wait_synced(Duration::from_secs(2)).await);
            let err = src.status().get("services").unwrap().last_error.clone();
            src.stop();
            err.unwrap_or_default()
        }
    };
    let err = attempt(good.replace("s3cret-token", "wrong")).await;
    assert!(err.contains("401"), "{err}");
    // Without the CA the server's certificate is not trusted.
    let no_ca: String = good
        .lines()
        .filter(|l| !l.contains("certificate-authority-data"))
        .map(|l| format!("{l}\n"))
        .collect();
    let err = attempt(no_ca).await;
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    let _ = std::fs::remove_dir_all(kc.parent().unwrap());
}

/// Policy objects that are not Kubernetes NetworkPolicy (a CNI's CRDs) are found by API
/// discovery, for kxp's warning at start.
#[tokio::test]
async fn policy_objects_kxp_does_not_enforce_are_found_by_discovery() {
    let api = FakeApi::start();
    let client = client_from(None, Some(&api.url()), None).await.unwrap();
    assert!(foreign_policy_groups(&client).await.is_empty());
    api.add_api_group(
        "crd.projectcalico.org",
        &["GlobalNetworkPolicy", "NetworkPolicy"],
    );
    api.add_api_group("example.com", &["Widget"]);
    api.add_api_group("cilium.io", &["CiliumNetworkPolicy"]);
    let found = foreign_policy_groups(&client).await;
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(
        found[0].starts_with("crd.projectcalico.org (Calico"),
        "{found:?}"
    );
    assert!(
        found[1].starts_with("cilium.io (CiliumNetworkPolicy"),
        "{found:?}"
    );
}

/// Pods for NetworkPolicy: the finished ones are left out by the API server (a field
/// selector on `status.phase`), and a pod that finishes leaves the watch as deleted; the
/// others, whichever node they run on, are in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_pods_are_not_watched_for_network_policy() {
    let api = FakeApi::start();
    seed(&api);
    let pod = |name: &str, node: &str, phase: &str, ip: &str| {
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": "default", "labels": {"app": "web"}},
               "spec": {"nodeName": node, "containers": [{"name": "c"}]},
               "status": {"phase": phase, "podIP": ip}})
    };
    api.create(&pod("running", "node-a", "Running", "10.0.0.5"))
        .unwrap();
    api.create(&pod("elsewhere", "node-b", "Pending", "10.0.1.5"))
        .unwrap();
    api.create(&pod("done", "node-a", "Succeeded", "10.0.0.6"))
        .unwrap();
    api.create(&pod("failed", "node-a", "Failed", "10.0.0.7"))
        .unwrap();
    let src = start(&api, None).await;
    let names = |src: &KubeSource| -> BTreeSet<String> {
        src.everything()
            .policy
            .map(|p| {
                p.pods
                    .iter()
                    .map(|p| p.metadata.name.clone().unwrap())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(names(&src), set(&["running", "elsewhere"]));
    api.replace(&pod("running", "node-a", "Succeeded", "10.0.0.5"))
        .unwrap();
    wait_for("the finished pod to leave", Duration::from_secs(5), || {
        names(&src) == set(&["elsewhere"])
    })
    .await;
    assert!(
        api.requests("pods", "list") + api.requests("pods", "watch") > 0,
        "{:?}",
        api.request_counts()
    );
}

/// Namespaces for NetworkPolicy come as their metadata only (the API server's
/// PartialObjectMetadata projection): their labels, followed as they change, and nothing
/// of their spec or status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaces_are_watched_as_their_metadata() {
    let api = FakeApi::start();
    seed(&api);
    let ns = |team: &str| {
        json!({"apiVersion": "v1", "kind": "Namespace",
               "metadata": {"name": "shop", "labels": {"team": team}},
               "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}})
    };
    api.create(&ns("a")).unwrap();
    let src = start(&api, None).await;
    let shop = |src: &KubeSource| {
        src.everything().policy.and_then(|p| {
            p.namespaces
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some("shop"))
                .cloned()
        })
    };
    let first = shop(&src).expect("the namespace");
    assert_eq!(
        first.metadata.labels.as_ref().and_then(|l| l.get("team")),
        Some(&"a".to_string())
    );
    assert!(first.spec.is_none() && first.status.is_none(), "{first:?}");
    assert!(
        api.requests("namespaces", "list-metadata") > 0 && api.requests("namespaces", "list") == 0,
        "{:?}",
        api.request_counts()
    );
    // Unchanged: the same object as before (made once per change).
    assert!(std::sync::Arc::ptr_eq(&first, &shop(&src).unwrap()));
    api.replace(&ns("b")).unwrap();
    wait_for("the new label", Duration::from_secs(5), || {
        shop(&src)
            .and_then(|n| n.metadata.labels.clone())
            .and_then(|l| l.get("team").cloned())
            == Some("b".into())
    })
    .await;
}
