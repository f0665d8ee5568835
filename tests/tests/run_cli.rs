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
    // The list above covers kxp's record of kube-proxy's flags (and so stays complete).
    // (--config is left out: the file would win over every other flag; the test above
    // and the kubeadm end-to-end test give it.)
    for flag in controlplane::kpflags::KUBE_PROXY_FLAGS
        .iter()
        .filter(|f| **f != "config")
    {
        let long = format!("--{flag}");
        assert!(
            refs.iter().map(|a| a.replace('_', "-")).any(|a| a == long
                || a.starts_with(&format!("{long}="))
                || (*flag == "v" && a == "-v")),
            "{long} is not exercised"
        );
    }
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

/// Random command lines and configuration files, valid and not: `kxp run --init-only`
/// (everything checked, nothing started) ends with 0 or 2 and a message, never a panic
/// (exit 101).
#[test]
fn random_command_lines_and_configs_exit_0_or_2_never_panic() {
    let flags: &[(&str, &[&str])] = &[
        (
            "--workers",
            &["0", "1", "2", "65", "-1", "x", "99999999999999999999"],
        ),
        ("--cpus", &["", "0", "0,0", "999", "a", "0,1,2"]),
        ("--conntrack-min", &["-5", "0", "2147483647", "x", "131072"]),
        (
            "--conntrack-max-per-core",
            &["-1", "0", "2147483647", "32768"],
        ),
        (
            "--snat-port-range",
            &["0-1", "65535-1", "1-65535", "x", "61000-65535", "5"],
        ),
        ("--busy-poll", &["0", "1,0", "50,64", "x,y", "50"]),
        ("--queue-budget", &["0", "250", "-1", "x", "1000001", ""]),
        ("--idle-spin", &["0", "10000", "-5", "y", "10000001"]),
        ("--worker-nice", &["-20", "19", "0", "-21", "20", "x", ""]),
        (
            "--healthz-bind-address",
            &["", "198.18.0.1", "[::]:1", "nope", "1.1.1.1:99999"],
        ),
        (
            "--metrics-bind-address",
            &["", "0.0.0.0:10249", "x:y", "::"],
        ),
        ("--oom-score-adj", &["-1001", "1000", "x", "-999"]),
        (
            "--proxy-mode",
            &["ipvs", "x", "", "nftables", "kernelspace"],
        ),
        ("--v", &["0", "9", "300", "-1", "x"]),
        ("--node-ip", &["198.18.0.1", "x", "::1", "0.0.0.0"]),
        (
            "--nodeport-addresses",
            &["primary", "10.0.0.0/8", "x/99", "", "primary,10.0.0.0/8"],
        ),
        (
            "--cluster-cidr",
            &["", "10.0.0.0/8,fd00::/64", "garbage", "10.0.0.0/33"],
        ),
        (
            "--detect-local-mode",
            &[
                "ClusterCIDR",
                "NodeCIDR",
                "BridgeInterface",
                "InterfaceNamePrefix",
                "x",
                "",
            ],
        ),
        ("--pod-bridge-interface", &["cni0", ""]),
        ("--feature-gates", &["A=true", "A", "=x", "A=maybe"]),
        ("--interface", &["x[", "*", "veth*", "[!a]*"]),
        (
            "--iptables-sync-period",
            &["0s", "-5s", "1h", "x", "99999999h", "1.5m"],
        ),
        ("--conntrack-udp-timeout", &["0", "1ns", "-1s", "x"]),
        ("--kube-api-qps", &["-1", "0", "NaN", "inf", "5", "x"]),
        ("--kube-api-burst", &["-1", "0", "10", "x"]),
        ("--hostname-override", &["", " ", "NODE-A", "a/b"]),
        ("--masquerade-all", &["=true", "=false", "=x", ""]),
        ("--bind-address", &["0.0.0.0", "::", "x", ""]),
        ("--log-format", &["text", "json", "xml"]),
        ("--state-dir", &["", "/nonexistent/kxp-state"]),
        ("--admin-socket", &["", "/nonexistent/kxp.sock"]),
    ];
    let fields: &[&str] = &[
        "conntrack:\n  maxPerCore: -1\n",
        "conntrack:\n  maxPerCore: 2147483647\n  min: 2147483647\n",
        "conntrack:\n  min: x\n",
        "conntrack:\n  tcpEstablishedTimeout: -1s\n",
        "kxp:\n  workers: 0\n",
        "kxp:\n  workers: 65\n  cpus: [0]\n",
        "kxp:\n  cpus: []\n",
        "kxp:\n  sessionAffinityMaxEntries: 0\n",
        "kxp:\n  scheduler: nope\n",
        "kxp:\n  interfaces: ['x[']\n",
        "clusterCIDR: 10.0.0.0/99\n",
        "minSyncPeriod: -1s\n",
        "syncPeriod: 0s\n",
        "healthzBindAddress: 'x:1'\n",
        "metricsBindAddress: '1.2.3.4'\n",
        "nodePortAddresses: [primary, 'x']\n",
        "mode: ipvs\nipvs:\n  scheduler: maglev\n",
        "detectLocalMode: BridgeInterface\n",
        "detectLocalMode: Nope\n",
        "bogus: 1\n",
        "oomScoreAdj: 5000\n",
        "logging:\n  verbosity: 99999\n  format: json\n",
        "clientConnection:\n  qps: -1\n  burst: -1\n",
        "featureGates: {A: true}\n",
        "bindAddress: x\n",
        ": :\n",
    ];
    let dir = std::env::temp_dir().join(format!("kxp-fuzz-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = fixture("web.yaml");
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut rand = move |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as usize
    };
    let mut outcomes = [0usize; 2];
    // Combinations that once reached a division by the worker count: first, as they are.
    let known: &[&[&str]] = &[
        &["--workers=0", "--conntrack-min=5"],
        &["--workers=0", "--conntrack-max-per-core=1"],
    ];
    for (case, extra) in known
        .iter()
        .map(|k| (None, *k))
        .chain((0..400).map(|c| (Some(c), &[][..])))
    {
        let mut args: Vec<String> = vec!["run".into(), "--init-only".into()];
        args.extend(extra.iter().map(|s| s.to_string()));
        let Some(case) = case else {
            let out = Command::new(kxp_bin()).args(&args).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "kxp {}:\n{err}", args.join(" "));
            assert!(err.contains("workers"), "{err}");
            continue;
        };
        if rand(2) == 0 {
            args.extend(["--state-file".into(), state.clone()]);
        }
        if rand(3) != 0 {
            let mut text = String::new();
            if rand(8) != 0 {
                text.push_str(
                    "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n",
                );
            }
            let mut used = std::collections::BTreeSet::new();
            for _ in 0..rand(4) {
                let f = fields[rand(fields.len())];
                // One of each top-level key (a repeated key is its own, tested, error).
                if used.insert(f.split(':').next().unwrap()) {
                    text.push_str(f);
                }
            }
            let path = dir.join(format!("c{case}.yaml"));
            std::fs::write(&path, text).unwrap();
            args.extend(["--config".into(), path.display().to_string()]);
        }
        for _ in 0..rand(5) {
            let (flag, values) = flags[rand(flags.len())];
            let v = values[rand(values.len())];
            if flag == "--masquerade-all" {
                args.push(format!("{flag}{v}"));
            } else {
                args.push(format!("{flag}={v}"));
            }
        }
        let out = Command::new(kxp_bin()).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let code = out.status.code();
        assert!(
            matches!(code, Some(0) | Some(2)) && !err.contains("panicked"),
            "kxp {}: {code:?}\n{err}",
            args.join(" ")
        );
        if code == Some(2) {
            assert!(!err.trim().is_empty(), "exit 2 without a message: {args:?}");
        }
        outcomes[usize::from(code == Some(2))] += 1;
    }
    // Both outcomes happen: the generator is not all errors.
    assert!(outcomes[0] > 10 && outcomes[1] > 10, "{outcomes:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without a capability it needs, kxp says which before setting anything up (exit 2).
#[test]
fn missing_capabilities_are_named() {
    let state = fixture("web.yaml");
    let out = Command::new("setpriv")
        .args(["--bounding-set=-net_raw,-bpf,-sys_admin", "--inh-caps=-all"])
        .arg(kxp_bin())
        .args([
            "run",
            "--interface",
            "lo",
            "--state-file",
            &state,
            "--healthz-bind-address",
            "127.0.0.1:0",
            "--metrics-bind-address",
            "127.0.0.1:0",
            "--state-dir=",
            "--admin-socket=",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("missing: CAP_NET_RAW, CAP_BPF"), "{err}");
}

#[test]
fn trace_names_the_endpoints_network_policy_denies_and_why() {
    // Two endpoints in namespace demo; a policy admits only 10.0.0.0/8 to web-1. A client
    // outside is denied web-1 (named, with the policy), not web-2; when both are under
    // the policy, the trace's verdict is a drop.
    let dir = std::env::temp_dir().join(format!("kxp-trace-np-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state.yaml");
    let mut text = lab::state_yaml_with(&["10.1.0.2", "10.1.0.3"], "");
    for (n, ip) in [(1, "10.1.0.2"), (2, "10.1.0.3")] {
        text.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: web-{n}, namespace: demo, labels: {{name: web-{n}, app: web}}}}\n\
             spec: {{nodeName: node-a, containers: [{{name: w}}]}}\nstatus: {{podIP: {ip}}}\n"
        ));
    }
    let policy = |selector: &str| {
        format!(
            "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: inside-only, namespace: demo}}\n\
             spec:\n  podSelector: {selector}\n  ingress: [{{from: [{{ipBlock: {{cidr: 10.0.0.0/8}}}}]}}]\n"
        )
    };
    let run = |extra: &str, out: &str| {
        std::fs::write(&state, format!("{text}{extra}")).unwrap();
        let o = Command::new(kxp_bin())
            .args(["trace", "--state"])
            .arg(&state)
            .args(["--hostname-override", "node-a", "--src", "192.0.2.7"])
            .args(["--dst", "198.19.0.10", "--dport", "80", "--output", out])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let json: serde_json::Value =
        serde_json::from_str(&run(&policy("{matchLabels: {name: web-1}}"), "json")).unwrap();
    let trace = &json;
    assert_eq!(trace["verdict"], "dnat", "{json}");
    let denied = trace["network_policy_denied"].as_array().unwrap();
    assert_eq!(denied.len(), 1, "{json}");
    let d = denied[0].as_str().unwrap();
    assert!(
        d.starts_with("10.1.0.2:8080") && d.contains("demo/inside-only"),
        "{d}"
    );
    let text_out = run(&policy("{matchLabels: {name: web-1}}"), "text");
    assert!(text_out.contains("denied:     10.1.0.2:8080"), "{text_out}");
    let json: serde_json::Value =
        serde_json::from_str(&run(&policy("{matchLabels: {app: web}}"), "json")).unwrap();
    assert_eq!(json["verdict"], "drop", "{json}");
    // No policy: nothing denied, the field left out.
    let json: serde_json::Value = serde_json::from_str(&run("", "json")).unwrap();
    assert!(json.get("network_policy_denied").is_none(), "{json}");
    assert_eq!(json["verdict"], "dnat");
    let _ = std::fs::remove_dir_all(&dir);
}
