//! Helpers for kxp's end-to-end tests.
#![forbid(unsafe_code)]

pub mod fakeapi;

use std::path::{Path, PathBuf};
use std::time::Duration;

use lab::{KxpProcess, wait_healthy};

/// The `kxp` binary the tests run: `KXP_BIN`, else `target/debug/kxp` of this workspace
/// (the tests build nothing themselves: `cargo build -p controlplane` first).
pub fn kxp_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("KXP_BIN") {
        let bin = PathBuf::from(bin);
        assert!(bin.is_file(), "KXP_BIN={} is not a file", bin.display());
        return bin;
    }
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/kxp");
    assert!(
        bin.is_file(),
        "the kxp binary is not at {}: run `cargo build -p controlplane` first \
         (or set KXP_BIN to a kxp binary, e.g. when CARGO_TARGET_DIR is elsewhere)",
        bin.display()
    );
    bin
}

/// The kxp of an earlier build (`tests/build-previous.sh`, which `tests/run.sh` runs), for
/// the hand-over between two builds: its path, or why this clone cannot build it (its
/// history lacks the commit).
///
/// # Panics
/// When it was not built (the script was not run): the test cannot go on without it.
pub fn previous_kxp_bin() -> Result<PathBuf, String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/kxp-previous");
    if let Ok(why) = std::fs::read_to_string(dir.join("absent")) {
        return Err(why.trim().to_string());
    }
    let bin = dir.join("kxp");
    assert!(
        bin.is_file(),
        "the previous build's kxp is not at {}: run `bash tests/build-previous.sh` first",
        bin.display()
    );
    Ok(bin)
}

/// The nftables forward chain of a node whose firewall drops conntrack-INVALID packets,
/// as Calico, kube-proxy's KUBE-FORWARD and many host firewalls have it: a connection whose
/// answers kxp took from the kernel would be dropped by it.
pub const CT_INVALID_DROP: &str = "add table inet kxp-test-fw; add chain inet kxp-test-fw forward \
     { type filter hook forward priority 0; policy accept; ct state invalid counter drop; }";

/// An IPv6 address on a device in namespace `ns`, without duplicate-address detection
/// (usable at once).
///
/// # Panics
/// When `ip` fails (the test cannot go on without the address).
pub fn add6(ns: &str, dev: &str, cidr: &str) {
    let out = std::process::Command::new("ip")
        .args(["-n", ns, "-6", "addr", "add", cidr, "dev", dev, "nodad"])
        .output()
        .expect("running ip (iproute2)");
    assert!(
        out.status.success(),
        "ip -n {ns} -6 addr add {cidr} dev {dev}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The value of the metric line of an OpenMetrics text that starts with `name_and_labels`
/// (e.g. `kxp_xdp_packets_total{interface="eth0",outcome="redirected"}`); 0 when absent.
pub fn metric(metrics: &str, name_and_labels: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Starts `kxp run` in namespace `ns` as a node of a test cluster: attached to
/// `interfaces`, reading `state` (a `--state-file`) and `config`, its health on
/// 127.0.0.1:10256, with `workers` workers, logging to `log`; returns once it is healthy.
///
/// # Panics
/// When kxp cannot be started or does not become healthy within 30 s (the test cannot go
/// on).
pub fn start_node_kxp(
    ns: &str,
    interfaces: &[&str],
    state: &Path,
    config: &Path,
    workers: usize,
    log: &Path,
) -> KxpProcess {
    let mut args: Vec<String> = interfaces
        .iter()
        .flat_map(|i| ["--interface".to_string(), i.to_string()])
        .collect();
    args.extend(
        [
            "--state-file",
            state.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
            "--healthz-bind-address",
            "127.0.0.1:10256",
            "--workers",
            &workers.to_string(),
        ]
        .map(String::from),
    );
    let mut k = KxpProcess::spawn_exe(&kxp_bin(), ns, &args, log).unwrap();
    wait_healthy(
        ns,
        "127.0.0.1:10256".parse().unwrap(),
        Duration::from_secs(30),
        &mut k,
    )
    .unwrap();
    k
}
