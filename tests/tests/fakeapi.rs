//! The fake API server (`kxp_tests::fakeapi`) checked against real clients: the
//! preinstalled `kubectl`, and `kube::Client` + `kube::runtime::watcher` with kube-proxy's
//! selectors. Every wait is bounded.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kxp_tests::fakeapi::{FakeApi, Kind};
use serde_json::{Value, json};

const PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";

fn svc(ns: &str, name: &str, cluster_ip: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"clusterIP": cluster_ip, "clusterIPs": [cluster_ip], "type": "ClusterIP",
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]},
    })
}

fn scratch(api: &FakeApi) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kxp-fakeapi-{}-{}",
        std::process::id(),
        api.addr().port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let kc = dir.join("kubeconfig");
    api.write_kubeconfig(&kc).unwrap();
    kc
}

/// Runs kubectl (killed after 30 s); returns (success, stdout, stderr).
fn kubectl(kc: &Path, args: &[&str]) -> (bool, String, String) {
    let cache = kc.with_file_name("cache");
    let child = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kc)
        .arg("--cache-dir")
        .arg(&cache)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl is preinstalled");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(out) => {
            let out = out.unwrap();
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            (out.status.success(), text(&out.stdout), text(&out.stderr))
        }
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("kubectl {args:?} did not finish in 30 s");
        }
    }
}

fn kubectl_json(kc: &Path, args: &[&str]) -> Value {
    let (ok, out, err) = kubectl(kc, args);
    assert!(ok, "kubectl {args:?} failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("kubectl {args:?}: {e}: {out}"))
}

fn names(items: &Value) -> Vec<String> {
    items
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn kubectl_lists_paginates_and_watches() {
    let api = FakeApi::start();
    api.create(&svc("default", "a", "10.96.0.1", json!({})))
        .unwrap();
    api.create(&svc("default", "b", "None", json!({}))).unwrap();
    api.create(&svc(
        "kube-system",
        "c",
        "10.96.0.3",
        json!({PROXY_NAME: "other"}),
    ))
    .unwrap();
    api.create(&json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}))
        .unwrap();
    let kc = scratch(&api);

    // Pagination with --raw, following continue tokens.
    let mut seen = Vec::new();
    let mut url = "/api/v1/services?limit=1".to_string();
    let mut first_token = None;
    loop {
        let page = kubectl_json(&kc, &["get", "--raw", &url]);
        assert_eq!(page["kind"], "ServiceList");
        assert_eq!(page["apiVersion"], "v1");
        assert_eq!(page["items"].as_array().unwrap().len(), 1, "{page}");
        assert!(
            page["items"][0].get("kind").is_none(),
            "list items carry no kind"
        );
        assert_eq!(page["metadata"]["resourceVersion"], "4");
        seen.extend(names(&page["items"]));
        match page["metadata"]["continue"].as_str() {
            Some(tok) => {
                first_token.get_or_insert(tok.to_string());
                url = format!("/api/v1/services?limit=1&continue={tok}");
            }
            None => break,
        }
    }
    assert_eq!(seen, ["a", "b", "c"]);
    assert_eq!(api.requests("services", "list"), 3);

    // Full list the way kubectl get does it (discovery first).
    let all = kubectl_json(&kc, &["get", "svc", "-A", "-o", "json"]);
    assert_eq!(names(&all["items"]), ["a", "b", "c"]);
    let nodes = kubectl_json(&kc, &["get", "nodes", "-o", "json"]);
    assert_eq!(names(&nodes["items"]), ["n1"]);

    // kube-proxy's selectors.
    let sel = "/api/v1/services?labelSelector=%21service.kubernetes.io%2Fservice-proxy-name\
               &fieldSelector=spec.clusterIP%21%3DNone";
    assert_eq!(
        names(&kubectl_json(&kc, &["get", "--raw", sel])["items"]),
        ["a"]
    );
    let (ok, _, err) = kubectl(
        &kc,
        &[
            "get",
            "--raw",
            "/api/v1/services?fieldSelector=spec.bogus%3D1",
        ],
    );
    assert!(!ok && err.contains("field label not supported"), "{err}");

    // Injected failures: client-go retries a 429 after Retry-After; a 403 is final.
    let lists = api.requests("nodes", "list");
    api.fail_next(1, 429);
    assert_eq!(
        names(&kubectl_json(&kc, &["get", "--raw", "/api/v1/nodes"])["items"]),
        ["n1"]
    );
    assert_eq!(api.requests("nodes", "list"), lists + 2);
    api.fail_next(1, 403);
    let (ok, _, err) = kubectl(&kc, &["get", "--raw", "/api/v1/nodes"]);
    assert!(
        !ok && err.contains("Forbidden") && err.contains("cannot list resource"),
        "{err}"
    );
    api.fail_next(1, 500);
    let (ok, _, err) = kubectl(&kc, &["get", "--raw", "/api/v1/nodes/n1"]);
    assert!(!ok && err.contains("InternalError"), "{err}");
    assert_eq!(api.requests("nodes", "get"), 1);
    let node = kubectl_json(&kc, &["get", "--raw", "/api/v1/nodes/n1"]);
    assert_eq!(
        (node["kind"].as_str(), node["metadata"]["name"].as_str()),
        (Some("Node"), Some("n1"))
    );
    assert!(
        node["metadata"]["uid"].is_string() && node["metadata"]["creationTimestamp"].is_string()
    );

    // A watch without resourceVersion: ADDED for what exists, then the stream ends.
    let t0 = Instant::now();
    let (ok, out, err) = kubectl(
        &kc,
        &["get", "--raw", "/api/v1/services?watch=1&timeoutSeconds=2"],
    );
    assert!(ok, "{err}");
    let events: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 3, "{out}");
    assert!(
        events
            .iter()
            .all(|e| e["type"] == "ADDED" && e["object"]["kind"] == "Service")
    );
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(10),
        "{took:?}"
    );

    // A watch from an old resourceVersion replays history.
    api.delete_named(Kind::Service, "default", "b").unwrap();
    let (_, out, _) = kubectl(
        &kc,
        &[
            "get",
            "--raw",
            "/api/v1/services?watch=1&resourceVersion=2&timeoutSeconds=1",
        ],
    );
    let types: Vec<String> = out
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["type"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(types, ["ADDED", "DELETED"], "{out}");

    // Bookmarks carry only kind/apiVersion/metadata.resourceVersion.
    let rv = api.resource_version().to_string();
    let url = format!(
        "/api/v1/services?watch=1&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=2"
    );
    let (_, out, _) = kubectl(&kc, &["get", "--raw", &url]);
    let marks: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!marks.is_empty(), "{out}");
    for m in &marks {
        assert_eq!(m["type"], "BOOKMARK");
        assert_eq!(
            m["object"],
            json!({"kind": "Service", "apiVersion": "v1", "metadata": {"resourceVersion": rv}})
        );
    }
    let (ok, _, err) = kubectl(
        &kc,
        &[
            "get",
            "--raw",
            "/api/v1/services?watch=1&sendInitialEvents=true",
        ],
    );
    assert!(
        !ok && err.contains("BadRequest"),
        "sendInitialEvents needs resourceVersionMatch: {err}"
    );

    // Compaction: old continue tokens and watches get 410 Expired.
    api.compact(api.resource_version());
    let (ok, _, err) = kubectl(
        &kc,
        &[
            "get",
            "--raw",
            &format!("/api/v1/services?limit=1&continue={}", first_token.unwrap()),
        ],
    );
    assert!(!ok && err.contains("Expired"), "{err}");
    let (ok, out, err) = kubectl(
        &kc,
        &["get", "--raw", "/api/v1/services?watch=1&resourceVersion=2"],
    );
    assert!(ok, "{err}");
    let ev: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(ev["type"], "ERROR");
    assert_eq!(ev["object"]["code"], 410);
    assert_eq!(ev["object"]["reason"], "Expired");
    let _ = std::fs::remove_dir_all(kc.parent().unwrap());
}

async fn client(api: &FakeApi) -> kube::Client {
    let kc = scratch(api);
    let conf = kube::config::Kubeconfig::read_from(&kc).unwrap();
    let conf = kube::Config::from_custom_kubeconfig(conf, &Default::default())
        .await
        .unwrap();
    let _ = std::fs::remove_dir_all(kc.parent().unwrap());
    kube::Client::try_from(conf).unwrap()
}

fn store_names<K: kube::Resource<DynamicType = ()> + Clone>(store: &Store<K>) -> BTreeSet<String> {
    store
        .state()
        .iter()
        .map(|o| o.meta().name.clone().unwrap_or_default())
        .collect()
}

async fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "timed out waiting for {what}");
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_watcher_follows_services_through_faults() {
    let api = FakeApi::start();
    api.create(&svc("default", "a", "10.96.0.1", json!({})))
        .unwrap();
    api.create(&svc("default", "headless", "None", json!({})))
        .unwrap();
    api.create(&svc(
        "default",
        "other-proxy",
        "10.96.0.3",
        json!({PROXY_NAME: "x"}),
    ))
    .unwrap();
    let client = client(&api).await;
    let cfg = watcher::Config::default()
        .labels(&format!("!{PROXY_NAME}"))
        .fields("spec.clusterIP!=None");
    let (store, writer) = reflector::store::<Service>();
    let errors = Arc::new(AtomicUsize::new(0));
    let errs = errors.clone();
    let stream =
        reflector::reflector(writer, watcher(Api::<Service>::all(client), cfg)).default_backoff();
    let task = tokio::spawn(stream.for_each(move |ev| {
        if ev.is_err() {
            errs.fetch_add(1, Ordering::SeqCst);
        }
        std::future::ready(())
    }));
    let names = || store_names(&store);

    wait_for("initial sync", || names() == set(&["a"])).await;
    api.create(&svc("ns2", "d", "10.96.0.4", json!({})))
        .unwrap();
    wait_for("add", || names() == set(&["a", "d"])).await;
    let mut a = api.get(Kind::Service, "default", "a").unwrap();
    a["spec"]["ports"][0]["port"] = json!(8080);
    api.replace(&a).unwrap();
    let port = |s: &Store<Service>| {
        s.state()
            .iter()
            .find(|o| o.metadata.name.as_deref() == Some("a"))
            .and_then(|o| Some(o.spec.as_ref()?.ports.as_ref()?[0].port))
    };
    wait_for("modify", || port(&store) == Some(8080)).await;
    api.delete_named(Kind::Service, "ns2", "d").unwrap();
    wait_for("delete", || names() == set(&["a"])).await;

    // Leaving the label selector is a delete, re-entering it an add.
    let mut a = api.get(Kind::Service, "default", "a").unwrap();
    a["metadata"]["labels"] = json!({PROXY_NAME: "x"});
    api.replace(&a).unwrap();
    wait_for("leave selector", || names().is_empty()).await;
    a["metadata"]["labels"] = json!({});
    api.apply(&a).unwrap();
    wait_for("re-enter selector", || names() == set(&["a"])).await;
    // Becoming headless leaves the field selector.
    let mut h = api.get(Kind::Service, "default", "other-proxy").unwrap();
    h["metadata"]["labels"] = json!({});
    api.apply(&h).unwrap();
    wait_for("enter selector", || names() == set(&["a", "other-proxy"])).await;
    h["spec"]["clusterIP"] = json!("None");
    api.apply(&h).unwrap();
    wait_for("leave field selector", || names() == set(&["a"])).await;

    // 410: changes the watch never sees, compaction, a dropped stream -> relist.
    let lists = api.requests("services", "list");
    api.silence_watches(true);
    api.create(&svc("default", "e", "10.96.0.5", json!({})))
        .unwrap();
    api.delete_named(Kind::Service, "default", "a").unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(names(), set(&["a"]), "silenced watches deliver nothing");
    api.compact(api.resource_version());
    api.drop_watches();
    api.silence_watches(false);
    wait_for("relist after 410", || names() == set(&["e"])).await;
    assert!(
        api.requests("services", "list") > lists,
        "a 410 makes the watcher relist"
    );

    // A dropped stream: the watcher re-watches from its resourceVersion, no relist.
    let (lists, watches) = (
        api.requests("services", "list"),
        api.requests("services", "watch"),
    );
    api.drop_watches();
    api.create(&svc("default", "f", "10.96.0.6", json!({})))
        .unwrap();
    wait_for("recovery after drop", || names() == set(&["e", "f"])).await;
    assert!(api.requests("services", "watch") > watches);
    assert_eq!(
        api.requests("services", "list"),
        lists,
        "bookmarks keep the watch resumable"
    );

    // A burst of 500s and a 429 on re-watch.
    let errs_before = errors.load(Ordering::SeqCst);
    api.fail_next(2, 500);
    api.fail_next(1, 429);
    api.drop_watches();
    api.create(&svc("default", "g", "10.96.0.7", json!({})))
        .unwrap();
    wait_for("recovery after 500/429", || {
        names() == set(&["e", "f", "g"])
    })
    .await;
    assert_eq!(api.pending_failures(), 0);
    assert!(errors.load(Ordering::SeqCst) > errs_before);
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_lists_slices_and_streams_nodes() {
    let api = FakeApi::start();
    let slice = |name: &str, labels: Value| {
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "default", "labels": labels},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": true}}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        })
    };
    for i in 0..5 {
        api.create(&slice(
            &format!("s{i}"),
            json!({"kubernetes.io/service-name": "a"}),
        ))
        .unwrap();
    }
    api.create(&slice("hl", json!({"service.kubernetes.io/headless": ""})))
        .unwrap();
    for n in ["node-a", "node-b"] {
        api.create(&json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}}))
            .unwrap();
    }
    api.create(&json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": "kubernetes"}, "spec": {"cidrs": ["10.96.0.0/12"]},
    }))
    .unwrap();
    let client = client(&api).await;

    // Paged list of slices with kube-proxy's label selector.
    let slices = Api::<EndpointSlice>::all(client.clone());
    let lp = ListParams::default()
        .labels("!service.kubernetes.io/headless")
        .limit(2);
    let page = slices.list(&lp).await.unwrap();
    assert_eq!(page.items.len(), 2);
    let mut all: Vec<String> = page
        .items
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    let mut token = page.metadata.continue_;
    while let Some(t) = token.filter(|t| !t.is_empty()) {
        let page = slices.list(&lp.clone().continue_token(&t)).await.unwrap();
        all.extend(page.items.iter().map(|s| s.metadata.name.clone().unwrap()));
        token = page.metadata.continue_;
    }
    assert_eq!(all, ["s0", "s1", "s2", "s3", "s4"]);

    let cidrs = Api::<k8s_openapi::api::networking::v1::ServiceCIDR>::all(client.clone());
    assert_eq!(
        cidrs
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );

    // Writes over HTTP.
    let svcs = Api::<Service>::namespaced(client.clone(), "default");
    let pp = kube::api::PostParams::default();
    let made: Service =
        serde_json::from_value(svc("default", "w", "10.96.0.9", json!({}))).unwrap();
    let made = svcs.create(&pp, &made).await.unwrap();
    let rv1 = made.metadata.resource_version.clone().unwrap();
    assert_eq!(rv1, api.resource_version().to_string());
    let mut changed = made.clone();
    changed.metadata.labels = Some([("x".to_string(), "y".to_string())].into());
    let changed = svcs.replace("w", &pp, &changed).await.unwrap();
    assert_eq!(changed.metadata.uid, made.metadata.uid);
    let stale = svcs.replace("w", &pp, &made).await.unwrap_err();
    assert!(
        matches!(&stale, kube::Error::Api(s) if s.code == 409),
        "{stale:?}"
    );
    let dup = svcs.create(&pp, &made).await.unwrap_err();
    assert!(
        matches!(&dup, kube::Error::Api(s) if s.code == 409),
        "{dup:?}"
    );
    svcs.delete("w", &Default::default()).await.unwrap();
    let gone = svcs.get("w").await.unwrap_err();
    assert!(
        matches!(&gone, kube::Error::Api(s) if s.code == 404),
        "{gone:?}"
    );
    assert_eq!(api.requests("services", "create"), 2);

    // Nodes with metadata.name=NODE over a streaming list (sendInitialEvents).
    let cfg = watcher::Config::default()
        .fields("metadata.name=node-a")
        .streaming_lists();
    let (store, writer) = reflector::store::<Node>();
    let stream =
        reflector::reflector(writer, watcher(Api::<Node>::all(client), cfg)).default_backoff();
    let task = tokio::spawn(stream.for_each(|_| std::future::ready(())));
    wait_for("node-a", || store_names(&store) == set(&["node-a"])).await;
    let mut n = api.get(Kind::Node, "", "node-a").unwrap();
    n["metadata"]["labels"] = json!({"zone": "z1"});
    api.replace(&n).unwrap();
    wait_for("node-a labels", || {
        store.state().first().is_some_and(|n| {
            n.metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key("zone"))
        })
    })
    .await;
    assert_eq!(
        api.requests("nodes", "list"),
        0,
        "streaming lists need no list call"
    );
    task.abort();
}
