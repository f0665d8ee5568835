//! The deployment files say what kxp accepts: the DaemonSet's configuration parses as
//! kxp parses it, its probes hit kxp's health endpoints, RBAC covers what the watchers
//! list and watch, and the systemd unit's command line is one `kxp run` accepts.

use std::path::PathBuf;
use std::process::Command;

use kxp_tests::kxp_bin;

fn deploy(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(name)
}

fn docs() -> Vec<serde_yaml::Value> {
    let text = std::fs::read_to_string(deploy("kxp.yaml")).unwrap();
    text.split("\n---\n")
        .map(|d| serde_yaml::from_str::<serde_yaml::Value>(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn kind<'a>(docs: &'a [serde_yaml::Value], k: &str) -> &'a serde_yaml::Value {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(k))
        .unwrap_or_else(|| panic!("no {k} in deploy/kxp.yaml"))
}

#[test]
fn daemonset_config_parses_as_kxp_reads_it() {
    let docs = docs();
    let cm = kind(&docs, "ConfigMap");
    let config = cm["data"]["config.yaml"].as_str().unwrap();
    controlplane::config::KubeProxyConfiguration::parse(config, "deploy/kxp.yaml ConfigMap")
        .unwrap();
    // kxp run accepts it, with the DaemonSet's flags.
    let dir = std::env::temp_dir().join(format!("kxp-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.yaml");
    std::fs::write(&cfg, config).unwrap();
    let out = Command::new(kxp_bin())
        .args(["run", "--config"])
        .arg(&cfg)
        .args(["--hostname-override=node-a", "--write-config-to"])
        .arg(dir.join("effective.yaml"))
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn daemonset_probes_and_privileges() {
    let docs = docs();
    let ds = kind(&docs, "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"].as_bool(), Some(true));
    // kxp reaches the API server without the cluster's DNS or any ClusterIP (which only
    // kxp itself serves): the host's resolver, and the API server's own address.
    assert_eq!(
        pod["dnsPolicy"].as_str(),
        Some("Default"),
        "ClusterFirst(WithHostNet) resolves through the cluster's DNS, a Service kxp serves"
    );
    let c = &pod["containers"][0];
    let env = c["env"].as_sequence().unwrap();
    assert!(
        env.iter()
            .any(|e| e["name"].as_str() == Some("KUBERNETES_SERVICE_HOST")),
        "the API server's real address, not the kubernetes Service's ClusterIP the kubelet sets"
    );
    assert_eq!(
        c["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/livez")
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert_eq!(c["livenessProbe"]["httpGet"]["port"].as_u64(), Some(10256));
    assert_eq!(c["securityContext"]["privileged"].as_bool(), Some(false));
    let caps: Vec<&str> = c["securityContext"]["capabilities"]["add"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    for need in ["NET_ADMIN", "NET_RAW", "BPF"] {
        assert!(caps.contains(&need), "{need} missing: {caps:?}");
    }
    let cmd: Vec<&str> = c["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert_eq!(cmd[1], "run");
}

#[test]
fn rbac_covers_what_kxp_watches() {
    let docs = docs();
    let role = kind(&docs, "ClusterRole");
    let rules = role["rules"].as_sequence().unwrap();
    for (group, resource) in [
        ("", "services"),
        ("", "nodes"),
        ("discovery.k8s.io", "endpointslices"),
        ("networking.k8s.io", "servicecidrs"),
        // NetworkPolicy (kxp.networkPolicy: enforce, the default).
        ("", "pods"),
        ("", "namespaces"),
        ("networking.k8s.io", "networkpolicies"),
    ] {
        let ok = rules.iter().any(|r| {
            let has = |key: &str, want: &str| {
                r[key]
                    .as_sequence()
                    .is_some_and(|s| s.iter().any(|v| v.as_str() == Some(want)))
            };
            has("apiGroups", group)
                && has("resources", resource)
                && ["get", "list", "watch"].iter().all(|v| has("verbs", v))
        });
        assert!(ok, "no get/list/watch on {group}/{resource}");
    }
}

#[test]
fn systemd_unit_runs_a_command_kxp_accepts() {
    let unit = std::fs::read_to_string(deploy("kxp.service")).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart");
    let mut words = exec.split_whitespace();
    assert_eq!(words.next(), Some("/usr/local/bin/kxp"));
    let args: Vec<&str> = words.collect();
    assert_eq!(args[0], "run");
    // Parse the same arguments (paths aside) with the real binary: --help after them
    // makes clap accept or reject the flags without running.
    let out = Command::new(kxp_bin())
        .args(&args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Restarts keep every connection: nothing may clean up around them.
    assert!(!unit.contains("ExecStopPost=-/usr/local/bin/kxp cleanup"));
    assert!(!unit.contains("ExecStartPre=-/usr/local/bin/kxp cleanup"));
    assert!(unit.contains("Restart=always"));
}

/// The DaemonSet and the systemd unit grant the same capabilities, exactly, and nothing
/// blanket: the set kxp checks for at start (`dataplane::caps`), no CAP_SYS_ADMIN.
#[test]
fn daemonset_and_unit_grant_exactly_kxps_capabilities() {
    let docs = docs();
    let ds = kind(&docs, "DaemonSet");
    let sc = &ds["spec"]["template"]["spec"]["containers"][0]["securityContext"];
    assert_eq!(sc["privileged"].as_bool(), Some(false));
    assert_eq!(sc["allowPrivilegeEscalation"].as_bool(), Some(false));
    let list = |v: &serde_yaml::Value| -> Vec<String> {
        let mut l: Vec<String> = v
            .as_sequence()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap().to_string())
            .collect();
        l.sort();
        l
    };
    assert_eq!(list(&sc["capabilities"]["drop"]), ["ALL"]);
    let granted = list(&sc["capabilities"]["add"]);
    let unit = std::fs::read_to_string(deploy("kxp.service")).unwrap();
    let mut bounding: Vec<String> = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("CapabilityBoundingSet")
        .split_whitespace()
        .map(|c| c.strip_prefix("CAP_").unwrap().to_string())
        .collect();
    bounding.sort();
    assert_eq!(granted, bounding, "the DaemonSet and the unit differ");
    let mut expected: Vec<String> = [
        "NET_ADMIN",
        "NET_RAW",
        "BPF",
        "PERFMON",
        "IPC_LOCK",
        "SYS_RESOURCE",
        "SYS_NICE",
    ]
    .map(String::from)
    .to_vec();
    expected.sort();
    assert_eq!(granted, expected);
    // What kxp requires is granted; what it keeps after setup is a subset.
    let caps = dataplane::caps::Caps(
        granted
            .iter()
            .map(|c| {
                let n = (0..64)
                    .find(|&i| dataplane::caps::name(i) == format!("CAP_{c}"))
                    .unwrap();
                1u64 << n
            })
            .sum(),
    );
    assert_eq!(caps.missing(), (vec![], vec![]));
    assert!(unit.contains("NoNewPrivileges=yes"));
    assert!(unit.contains("ProtectSystem=strict"));
}

/// systemd reads the unit without a complaint (every directive known, every value valid).
#[test]
fn systemd_accepts_the_unit() {
    let dir = std::env::temp_dir().join(format!("kxp-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let unit = std::fs::read_to_string(deploy("kxp.service"))
        .unwrap()
        .replace("/usr/local/bin/kxp", "/bin/true");
    let path = dir.join("kxp.service");
    std::fs::write(&path, unit).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze (Debian's systemd package; tests/install-deps.sh installs it)");
    let _ = std::fs::remove_dir_all(&dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.trim().is_empty(), "{err}");
}

#[test]
fn daemonset_keeps_the_state_directory_across_pods_and_hands_the_node_over() {
    let docs = docs();
    let ds = kind(&docs, "DaemonSet");
    let spec = &ds["spec"]["template"]["spec"];
    let mounts = spec["containers"][0]["volumeMounts"].as_sequence().unwrap();
    let run = mounts
        .iter()
        .find(|m| m["mountPath"].as_str() == Some("/run/kxp"))
        .expect("/run/kxp mounted");
    let vol = spec["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == run["name"])
        .unwrap();
    assert_eq!(vol["hostPath"]["path"].as_str(), Some("/run/kxp"));
    // A rolling update starts the new pod beside the old one (a surge, none unavailable):
    // the new kxp, of a newer generation (the pod template's), announces itself and
    // takes the node over once it has the cluster's state; the old one forwards until
    // then, also when told to stop, for up to 45 s of its grace period.
    let ru = &ds["spec"]["updateStrategy"]["rollingUpdate"];
    assert_eq!(ru["maxSurge"].as_u64(), Some(1));
    assert_eq!(ru["maxUnavailable"].as_u64(), Some(0));
    assert_eq!(
        ds["spec"]["updateStrategy"]["type"].as_str(),
        Some("RollingUpdate")
    );
    assert!(spec["terminationGracePeriodSeconds"].as_u64() >= Some(50));
    let env = spec["containers"][0]["env"].as_sequence().unwrap();
    let generation = env
        .iter()
        .find(|e| e["name"].as_str() == Some("KXP_GENERATION"))
        .expect("KXP_GENERATION set");
    assert_eq!(
        generation["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        Some("metadata.labels['pod-template-generation']")
    );
}

#[test]
fn daemonset_reaches_the_api_server_without_a_cluster_ip_and_attaches_by_pattern() {
    let docs = docs();
    let ds = kind(&docs, "DaemonSet");
    let env = &ds["spec"]["template"]["spec"]["containers"][0]["env"];
    let value = |name: &str| {
        env.as_sequence()
            .unwrap()
            .iter()
            .find(|e| e["name"].as_str() == Some(name))
            .and_then(|e| e["value"].as_str())
            .map(str::to_string)
    };
    // Set explicitly: the kubelet's own values point at the `kubernetes` ClusterIP.
    assert!(value("KUBERNETES_SERVICE_HOST").is_some());
    assert!(value("KUBERNETES_SERVICE_PORT").is_some());

    let cm = kind(&docs, "ConfigMap");
    let config: serde_yaml::Value =
        serde_yaml::from_str(cm["data"]["config.yaml"].as_str().unwrap()).unwrap();
    let ifs: Vec<&str> = config["kxp"]["interfaces"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for want in ["veth*", "cali*", "lxc*"] {
        assert!(ifs.contains(&want), "{want} missing from {ifs:?}");
    }
    // Patterns only: a DaemonSet runs on nodes whose uplinks are named differently, and a
    // name without a wildcard that a node lacks would stop kxp there.
    for i in &ifs {
        assert!(dataplane::ifmatch::is_pattern(i), "{i} is not a pattern");
        dataplane::ifmatch::check(i).unwrap();
    }
}

#[test]
fn image_answers_to_kube_proxys_command() {
    let text = std::fs::read_to_string(deploy("Containerfile")).unwrap();
    assert!(
        text.contains("ln -s kxp /usr/local/bin/kube-proxy"),
        "a kube-proxy DaemonSet's command (/usr/local/bin/kube-proxy) must exist in the image"
    );
    // What that link does: kxp named kube-proxy takes kube-proxy's arguments as `kxp run`.
    let dir = std::env::temp_dir().join(format!("kxp-image-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let link = dir.join("kube-proxy");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(kxp_bin(), &link).unwrap();
    let out = Command::new(&link)
        .args(["--hostname-override=n", "--write-config-to=/dev/null"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
