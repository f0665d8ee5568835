//! `kxp run` and `kxp cleanup` refuse what they cannot do with a clear message and exit
//! status 2, before touching anything.

use std::path::PathBuf;

use kxp_tests::kxp_bin;
use std::process::Command;

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
        .display()
        .to_string()
}

/// Runs kxp; (exit code, stderr).
fn kxp(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(kxp_bin()).args(args).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn unknown_interface_is_named() {
    let state = fixture("web.yaml");
    let (code, err) = kxp(&[
        "run",
        "--interface",
        "kxp-no-such-if0",
        "--state-file",
        &state,
        "--healthz-bind-address",
        "127.0.0.1:0",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("interface kxp-no-such-if0 not found"), "{err}");
    assert!(err.contains("--interface NAME"), "{err}");
}

#[test]
fn too_many_workers_for_the_queues_says_what_to_do() {
    let state = fixture("web.yaml");
    // The loopback interface has one receive queue.
    let (code, err) = kxp(&[
        "run",
        "--interface",
        "lo",
        "--state-file",
        &state,
        "--workers",
        "2",
        "--healthz-bind-address",
        "127.0.0.1:0",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("receive queue"), "{err}");
    assert!(err.contains("--workers 1"), "{err}");
}

#[test]
fn invalid_state_file_at_start_is_refused() {
    let dir = std::env::temp_dir().join(format!("kxp-run-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec:\n  ports: [{port: many}]\n",
    )
    .unwrap();
    let (code, err) = kxp(&[
        "run",
        "--interface",
        "lo",
        "--state-file",
        bad.to_str().unwrap(),
        "--healthz-bind-address",
        "127.0.0.1:0",
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("spec.ports[0].port"), "{err}");
}

#[test]
fn no_source_says_how_to_give_one() {
    // No state file, no kubeconfig, not in a cluster.
    let out = Command::new(kxp_bin())
        .args([
            "run",
            "--interface",
            "lo",
            "--healthz-bind-address",
            "127.0.0.1:0",
        ])
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--kubeconfig PATH"), "{err}");
    assert!(err.contains("--state-file"), "{err}");
}

#[test]
fn state_file_and_kubeconfig_are_exclusive() {
    let (code, err) = kxp(&["run", "--state-file", "a.yaml", "--kubeconfig", "k"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("cannot be used with"), "{err}");
}

#[test]
fn cleanup_of_a_clean_interface_reports_nothing_removed() {
    let out = Command::new(kxp_bin())
        .args(["cleanup", "--interface", "lo"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("0 interface(s) cleaned"));
}

#[test]
fn kube_proxy_flags_make_a_configuration_and_the_file_wins() {
    let dir = std::env::temp_dir().join(format!("kxp-run-flags-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let written = dir.join("from-flags.yaml");
    let (code, err) = kxp(&[
        "run",
        "--cluster-cidr",
        "10.0.0.0/8",
        "--masquerade-all",
        "--nodeport-addresses",
        "primary,10.1.0.0/16",
        "--conntrack-tcp-timeout-established",
        "12h",
        "--hostname-override",
        "node-x",
        "--write-config-to",
        written.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{err}");
    let text = std::fs::read_to_string(&written).unwrap();
    for want in [
        "kind: KubeProxyConfiguration",
        "clusterCIDR: 10.0.0.0/8",
        "masqueradeAll: true",
        "- 10.1.0.0/16",
        "tcpEstablishedTimeout: 12h0m0s",
        "hostnameOverride: node-x",
    ] {
        assert!(text.contains(want), "{want} missing from:\n{text}");
    }
    // With --config, the file wins over the other flags; --hostname-override still wins.
    let again = dir.join("from-file.yaml");
    let (code, err) = kxp(&[
        "run",
        "--config",
        written.to_str().unwrap(),
        "--cluster-cidr",
        "192.168.0.0/16",
        "--hostname-override",
        "node-y",
        "--write-config-to",
        again.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{err}");
    let text = std::fs::read_to_string(&again).unwrap();
    assert!(text.contains("clusterCIDR: 10.0.0.0/8"), "{text}");
    assert!(text.contains("hostnameOverride: node-y"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_flag_values_are_usage_errors() {
    let (code, err) = kxp(&[
        "run",
        "--conntrack-udp-timeout",
        "soon",
        "--write-config-to",
        "/dev/null",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("is not a duration"), "{err}");
}

/// The README's first command: `kxp demo` builds its namespaces, spreads 300 HTTP
/// connections over three backends, shows the refusal once scaled to zero, and leaves
/// nothing behind.
#[test]
fn demo_runs_end_to_end_and_cleans_up() {
    let child = Command::new(kxp_bin())
        .arg("demo")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let o = child.wait_with_output().unwrap();
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(o.status.code(), Some(0), "{out}");
    let spread = out
        .lines()
        .find(|l| l.starts_with("300 HTTP connections"))
        .unwrap_or_else(|| panic!("no spread line:\n{out}"));
    assert!(spread.contains("(0 failed)"), "{spread}");
    for backend in ["web-1", "web-2", "web-3"] {
        assert!(spread.contains(backend), "{spread}");
    }
    assert!(out.contains("the next connection was refused"), "{out}");
    assert!(
        out.contains("after `kxp cleanup`, XDP programs left on the interfaces: none"),
        "{out}"
    );
    assert!(out.contains("removed the namespaces"), "{out}");
    let ns = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let suffix = format!("-{pid}");
    let left: Vec<String> = String::from_utf8_lossy(&ns.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("kxd-") && n.ends_with(&suffix))
        .map(str::to_string)
        .collect();
    assert!(left.is_empty(), "demo namespaces left behind: {left:?}");
}

#[test]
fn logs_go_through_one_subscriber_as_text_or_json_at_the_verbosity_asked() {
    let dir = std::env::temp_dir().join(format!("kxp-run-logs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.yaml");
    let (code, err) = kxp(&["run", "--write-config-to", cfg.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    let state = fixture("web.yaml");
    // A flag ignored because --config is given: a warning, before the start fails on
    // the missing interface (the CLI's own error line stays plain).
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--config",
            cfg.to_str().unwrap(),
            "--cluster-cidr",
            "198.18.0.0/16",
            "--interface",
            "kxp-no-such-if0",
            "--state-file",
            &state,
            "--healthz-bind-address",
            "127.0.0.1:0",
        ];
        args.extend_from_slice(extra);
        kxp(&args)
    };
    let (code, err) = run(&["--log-format", "json", "--v=4"]);
    assert_eq!(code, Some(2), "{err}");
    let warn = err
        .lines()
        .find(|l| l.contains("ignored"))
        .unwrap_or_else(|| panic!("{err}"));
    let v: serde_json::Value = serde_json::from_str(warn).unwrap_or_else(|e| panic!("{e}: {warn}"));
    assert_eq!(v["level"], "WARN", "{warn}");
    assert!(
        v["message"].as_str().unwrap().contains("--cluster-cidr"),
        "{warn}"
    );
    assert!(err.contains("interface kxp-no-such-if0 not found"), "{err}");
    let (_, err) = run(&["-v", "2"]);
    let warn = err.lines().find(|l| l.contains("ignored")).unwrap();
    assert!(warn.contains(" WARN ") && !warn.starts_with('{'), "{warn}");
    let (code, err) = kxp(&["run", "--log-format", "xml"]);
    assert_eq!(code, Some(2), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// kube-proxy 1.34's `--help` on Linux, flag by flag, each with a value of the kind it
/// takes (and its two hidden deprecated flags): all of them parse, in pflag's forms
/// (`--flag=value`, `--flag value`, a bare bool, `_` for `-`), and make a configuration.
#[test]
fn every_kube_proxy_1_34_flag_parses() {
    let dir = std::env::temp_dir().join(format!("kxp-every-flag-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("config.yaml");
    let args: Vec<String> = [
        "--bind-address=198.18.0.1",
        "--bind-address-hard-fail",
        "--boot-id-file=/proc/sys/kernel/random/boot_id",
        "--cleanup=false",
        "--cluster-cidr=10.244.0.0/16,fd00:10:244::/56",
        "--config-sync-period=15m0s",
        "--conntrack-max-per-core=0",
        "--conntrack-min=131072",
        "--conntrack-tcp-be-liberal",
        "--conntrack-tcp-timeout-close-wait=1h0m0s",
        "--conntrack-tcp-timeout-established=24h0m0s",
        "--conntrack-udp-timeout=30s",
        "--conntrack-udp-timeout-stream=2m0s",
        "--detect-local-mode=ClusterCIDR",
        "--feature-gates=AllAlpha=false,AllBeta=false",
        "--healthz-bind-address=0.0.0.0:10256",
        "--healthz-port=10256",
        "--hostname-override=node-1",
        "--init-only=false",
        "--iptables-localhost-nodeports=false",
        "--iptables-masquerade-bit=14",
        "--iptables-min-sync-period=1s",
        "--iptables-sync-period=30s",
        "--ipvs-exclude-cidrs=10.0.0.0/8,192.168.0.0/16",
        "--ipvs-min-sync-period=0s",
        "--ipvs-scheduler=wrr",
        "--ipvs-strict-arp=true",
        "--ipvs-sync-period=30s",
        "--ipvs-tcp-timeout=0s",
        "--ipvs-tcpfin-timeout=0s",
        "--ipvs-udp-timeout=0s",
        "--kube-api-burst=10",
        "--kube-api-content-type=application/vnd.kubernetes.protobuf",
        "--kube-api-qps=5",
        "--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf",
        "--log-flush-frequency=5s",
        "--log-json-info-buffer-size=0",
        "--log-json-split-stream=false",
        "--log-text-info-buffer-size=0",
        "--log-text-split-stream=false",
        "--logging-format=text",
        "--machine-id-file=/etc/machine-id,/var/lib/dbus/machine-id",
        "--masquerade_all",
        "--master=https://198.18.0.1:6443",
        "--metrics-bind-address=0.0.0.0:10249",
        "--metrics-port=10249",
        "--nodeport-addresses=primary",
        "--oom-score-adj=-999",
        "--pod-bridge-interface=cni0",
        "--pod-interface-name-prefix=veth",
        "--profiling=false",
        "--proxy-mode",
        "nftables",
        "--show-hidden-metrics-for-version=1.33",
        "-v",
        "4",
        "--vmodule=proxier*=5",
        "--version=false",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(["--write-config-to".into(), out.display().to_string()])
    .collect();
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    // Invoked as kube-proxy, without kxp's `run`.
    let link = dir.join("kube-proxy");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(kxp_tests::kxp_bin(), &link).unwrap();
    let o = Command::new(&link).args(&refs).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let text = std::fs::read_to_string(&out).unwrap();
    for want in [
        "bindAddress: 198.18.0.1",
        "bindAddressHardFail: true",
        "clusterCIDR: 10.244.0.0/16,fd00:10:244::/56",
        "configSyncPeriod: 15m0s",
        "tcpBeLiberal: true",
        "udpStreamTimeout: 2m0s",
        "AllBeta: false",
        "hostnameOverride: node-1",
        "masqueradeBit: 14",
        "scheduler: wrr",
        "strictARP: true",
        "burst: 10",
        "masqueradeAll: true",
        "metricsBindAddress: 0.0.0.0:10249",
        "oomScoreAdj: -999",
        "bridgeInterface: cni0",
        "interfaceNamePrefix: veth",
        "mode: nftables",
        "syncPeriod: 30s",
    ] {
        assert!(text.contains(want), "{want} missing from:\n{text}");
    }
    // `kxp FLAGS` without a subcommand is `kxp run FLAGS` too.
    let o = Command::new(kxp_tests::kxp_bin())
        .args(["--proxy-mode=kernelspace", "--write-config-to=/dev/null"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("kernelspace is the Windows mode"), "{err}");
    let o = Command::new(&link).arg("--version").output().unwrap();
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).contains("kube-proxy v1.34"));
    let _ = std::fs::remove_dir_all(&dir);
}
