//! kube-proxy's leftovers on a node kxp now serves: its iptables chains (both backends,
//! both families), its nftables tables, IPVS mode's `kube-ipvs0` device, virtual servers
//! and ipsets. A kube-proxy DaemonSet whose image is swapped for kxp's never runs
//! `kube-proxy --cleanup`, and what it left keeps DNATing the node's own connections to a
//! ClusterIP to the endpoints of the day it stopped (and, for IPVS, holds every Service
//! IP as a local address). kxp removes them at start and with `kxp cleanup --kube-proxy`,
//! as `kube-proxy --cleanup` does, and says what it removed.
//!
//! The work is done by the node's own tools, as kube-proxy does it: `iptables-save` /
//! `iptables-restore --noflush` of each backend and family, `nft`, `ip`, `ipvsadm` and
//! `ipset`; a tool that is not installed means nothing of its kind is looked for (said
//! at debug level). kubelet's chains (`KUBE-IPTABLES-HINT`, `KUBE-KUBELET-CANARY`,
//! `KUBE-FIREWALL`, `KUBE-MARK-DROP`) are kubelet's and stay.

use dataplane::tool::run;

/// Chains named `KUBE-*` that kubelet makes, not kube-proxy.
const KUBELET_CHAINS: [&str; 4] = [
    "KUBE-IPTABLES-HINT",
    "KUBE-KUBELET-CANARY",
    "KUBE-FIREWALL",
    "KUBE-MARK-DROP",
];

/// The iptables tools kxp looks in, each `(label, save, restore)`: both backends of both
/// families (a node that switched backends may have rules in either).
const IPTABLES: [(&str, &str, &str); 4] = [
    ("iptables-nft", "iptables-nft-save", "iptables-nft-restore"),
    (
        "ip6tables-nft",
        "ip6tables-nft-save",
        "ip6tables-nft-restore",
    ),
    (
        "iptables-legacy",
        "iptables-legacy-save",
        "iptables-legacy-restore",
    ),
    (
        "ip6tables-legacy",
        "ip6tables-legacy-save",
        "ip6tables-legacy-restore",
    ),
];

/// Where the tools are not split by backend (one `iptables-save` per family).
const IPTABLES_PLAIN: [(&str, &str, &str); 2] = [
    ("iptables", "iptables-save", "iptables-restore"),
    ("ip6tables", "ip6tables-save", "ip6tables-restore"),
];

/// What was found and removed, and what could not be.
#[derive(Debug, Default)]
pub struct Report {
    /// One line per kind of leftover removed (e.g. `iptables-nft nat: 9 chains ...`).
    pub removed: Vec<String>,
    /// One line per leftover found and not removed, with the reason.
    pub failed: Vec<String>,
    /// Tools not installed (nothing of their kind looked for).
    pub missing_tools: Vec<&'static str>,
}

/// Finds and removes every kube-proxy leftover of this network namespace.
pub fn remove_all() -> Report {
    let mut r = Report::default();
    let split = IPTABLES.iter().any(|(_, save, _)| tool_exists(save));
    let tools: &[(&str, &str, &str)] = if split { &IPTABLES } else { &IPTABLES_PLAIN };
    for &(label, save, restore) in tools {
        iptables(&mut r, label, save, restore);
    }
    nftables(&mut r);
    ipvs(&mut r);
    r
}

/// Logs `r`: what was removed (info), what could not be (warn), which tools are missing
/// (debug). Returns whether anything was found.
pub fn log(r: &Report) -> bool {
    for w in &r.removed {
        tracing::info!("removed kube-proxy's leftovers: {w}");
    }
    for w in &r.failed {
        tracing::warn!("kube-proxy's leftovers not removed: {w}");
    }
    if !r.missing_tools.is_empty() {
        tracing::debug!(
            "not installed, nothing of their kind looked for: {}",
            r.missing_tools.join(", ")
        );
    }
    !r.removed.is_empty() || !r.failed.is_empty()
}

fn tool_exists(name: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
        .unwrap_or(false)
        || ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
            .iter()
            .any(|d| std::path::Path::new(d).join(name).is_file())
}

/// kube-proxy's chains in one table of an `iptables-save` output, and the rules of other
/// chains that jump to them.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TablePlan {
    pub table: String,
    pub chains: Vec<String>,
    /// `-A CHAIN ...` rules (as saved) of chains that are not kube-proxy's, jumping to one
    /// that is.
    pub jumps: Vec<String>,
}

impl TablePlan {
    /// The `iptables-restore --noflush` input that removes them: kube-proxy's chains
    /// declared (which flushes them), the jumps to them deleted, the chains deleted.
    pub fn restore_script(&self) -> String {
        let mut s = format!("*{}\n", self.table);
        for c in &self.chains {
            s += &format!(":{c} - [0:0]\n");
        }
        for j in &self.jumps {
            s += &format!("-D{}\n", &j[2..]);
        }
        for c in &self.chains {
            s += &format!("-X {c}\n");
        }
        s += "COMMIT\n";
        s
    }
}

fn is_kube_proxy_chain(name: &str) -> bool {
    name.starts_with("KUBE-") && !KUBELET_CHAINS.contains(&name)
}

/// Reads an `iptables-save` output: per table, kube-proxy's chains and the jumps to them.
pub fn plan(saved: &str) -> Vec<TablePlan> {
    let mut plans: Vec<TablePlan> = Vec::new();
    for line in saved.lines() {
        if let Some(t) = line.strip_prefix('*') {
            plans.push(TablePlan {
                table: t.trim().to_string(),
                ..TablePlan::default()
            });
            continue;
        }
        let Some(p) = plans.last_mut() else { continue };
        if let Some(decl) = line.strip_prefix(':') {
            let name = decl.split_whitespace().next().unwrap_or("");
            if is_kube_proxy_chain(name) {
                p.chains.push(name.to_string());
            }
            continue;
        }
        if let Some(rule) = line.strip_prefix("-A ") {
            let chain = rule.split_whitespace().next().unwrap_or("");
            if is_kube_proxy_chain(chain) {
                continue;
            }
            let words: Vec<&str> = rule.split_whitespace().collect();
            let jumps = words
                .windows(2)
                .any(|w| (w[0] == "-j" || w[0] == "-g") && is_kube_proxy_chain(w[1]));
            if jumps {
                p.jumps.push(line.to_string());
            }
        }
    }
    plans.retain(|p| !p.chains.is_empty());
    plans
}

fn iptables(r: &mut Report, label: &'static str, save: &'static str, restore: &'static str) {
    let saved = match run(save, &[], None) {
        None => {
            r.missing_tools.push(save);
            return;
        }
        // A backend the kernel does not have (legacy without its modules): nothing there.
        Some(Err(e)) => {
            tracing::debug!("{e}: no {label} rules looked for");
            return;
        }
        Some(Ok(s)) => s,
    };
    for p in plan(&saved) {
        let what = format!(
            "{label} {}: {} chain(s) ({}{}), {} jump(s) to them",
            p.table,
            p.chains.len(),
            p.chains
                .iter()
                .take(4)
                .cloned()
                .collect::<Vec<_>>()
                .join(", "),
            if p.chains.len() > 4 { ", ..." } else { "" },
            p.jumps.len()
        );
        match run(restore, &["--noflush"], Some(&p.restore_script())) {
            Some(Ok(_)) => r.removed.push(what),
            Some(Err(e)) => r.failed.push(format!("{what}: {e}")),
            None => r.failed.push(format!("{what}: {restore} is not installed")),
        }
    }
}

/// kube-proxy's nftables tables (`ip kube-proxy`, `ip6 kube-proxy`) from `nft list
/// tables` output: (family, name).
pub fn nft_tables(listed: &str) -> Vec<(String, String)> {
    listed
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            match (w.next(), w.next(), w.next()) {
                (Some("table"), Some(family), Some("kube-proxy")) => {
                    Some((family.to_string(), "kube-proxy".to_string()))
                }
                _ => None,
            }
        })
        .collect()
}

fn nftables(r: &mut Report) {
    let listed = match run("nft", &["list", "tables"], None) {
        None => {
            r.missing_tools.push("nft");
            return;
        }
        Some(Err(e)) => {
            tracing::debug!("{e}: no nftables tables looked for");
            return;
        }
        Some(Ok(s)) => s,
    };
    for (family, name) in nft_tables(&listed) {
        let what = format!("nftables table {family} {name}");
        match run("nft", &["delete", "table", &family, &name], None) {
            Some(Ok(_)) => r.removed.push(what),
            Some(Err(e)) => r.failed.push(format!("{what}: {e}")),
            None => r.failed.push(format!("{what}: nft is not installed")),
        }
    }
}

fn ipvs(r: &mut Report) {
    // The device IPVS mode binds every Service IP to.
    if std::path::Path::new("/sys/class/net/kube-ipvs0").exists() {
        let addrs = run("ip", &["-o", "addr", "show", "dev", "kube-ipvs0"], None)
            .and_then(Result::ok)
            .map(|s| {
                s.lines()
                    .filter_map(|l| {
                        let w: Vec<&str> = l.split_whitespace().collect();
                        w.iter()
                            .position(|x| *x == "inet" || *x == "inet6")
                            .and_then(|i| w.get(i + 1))
                            .map(|a| a.to_string())
                    })
                    .count()
            })
            .unwrap_or(0);
        let what = format!("IPVS mode's device kube-ipvs0 ({addrs} Service address(es))");
        match run("ip", &["link", "del", "kube-ipvs0"], None) {
            Some(Ok(_)) => r.removed.push(what),
            Some(Err(e)) => r.failed.push(format!("{what}: {e}")),
            None => r
                .failed
                .push(format!("{what}: ip (iproute2) is not installed")),
        }
    }
    // Virtual servers: /proc/net/ip_vs lists them when the module is loaded.
    let servers = std::fs::read_to_string("/proc/net/ip_vs")
        .map(|t| {
            t.lines()
                .filter(|l| l.starts_with("TCP") || l.starts_with("UDP") || l.starts_with("SCTP"))
                .count()
        })
        .unwrap_or(0);
    if servers > 0 {
        let what = format!("{servers} IPVS virtual server(s)");
        match run("ipvsadm", &["--clear"], None) {
            Some(Ok(_)) => r.removed.push(what),
            Some(Err(e)) => r.failed.push(format!("{what}: {e}")),
            None => r.failed.push(format!(
                "{what}: ipvsadm is not installed (remove them with `ipvsadm --clear`)"
            )),
        }
    }
    // ipsets, after the iptables rules that used them.
    if let Some(Ok(list)) = run("ipset", &["list", "-n"], None) {
        let sets: Vec<&str> = list.lines().filter(|l| l.starts_with("KUBE-")).collect();
        let mut gone = 0;
        for s in &sets {
            match run("ipset", &["destroy", s], None) {
                Some(Ok(_)) => gone += 1,
                Some(Err(e)) => r.failed.push(format!("ipset {s}: {e}")),
                None => {}
            }
        }
        if gone > 0 {
            r.removed.push(format!("{gone} ipset(s) KUBE-*"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAVED: &str = "# Generated by iptables-nft-save v1.8.9
*mangle
:PREROUTING ACCEPT [0:0]
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:CNI-FORWARD - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD
-A CNI-FORWARD -g KUBE-FORWARD
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-ABC - [0:0]
:KUBE-SEP-XYZ - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A KUBE-SERVICES -d 198.19.0.10/32 -p tcp -j KUBE-SVC-ABC
-A KUBE-SVC-ABC -j KUBE-SEP-XYZ
-A KUBE-SEP-XYZ -p tcp -j DNAT --to-destination 198.18.2.2:8080
COMMIT
";

    #[test]
    fn kube_proxy_chains_and_the_jumps_to_them_kubelets_left_alone() {
        let plans = plan(SAVED);
        assert_eq!(plans.len(), 2, "{plans:?}");
        let filter = &plans[0];
        assert_eq!(filter.table, "filter");
        assert_eq!(
            filter.chains,
            ["KUBE-FORWARD", "KUBE-NODEPORTS", "KUBE-PROXY-FIREWALL"]
        );
        // The jump to kubelet's KUBE-FIREWALL stays; a CNI chain's goto goes.
        assert_eq!(filter.jumps.len(), 4, "{:?}", filter.jumps);
        assert!(filter.jumps.iter().all(|j| !j.contains("-j KUBE-FIREWALL")));
        let script = plans[1].restore_script();
        assert_eq!(
            script,
            "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-ABC - [0:0]\n:KUBE-SEP-XYZ - [0:0]\n\
             -D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             -X KUBE-SERVICES\n-X KUBE-SVC-ABC\n-X KUBE-SEP-XYZ\nCOMMIT\n"
        );
    }

    #[test]
    fn only_kube_proxys_nftables_tables() {
        let listed = "table inet filter\ntable ip kube-proxy\ntable ip6 kube-proxy\ntable inet kube-proxy-other\n";
        assert_eq!(
            nft_tables(listed),
            [
                ("ip".to_string(), "kube-proxy".to_string()),
                ("ip6".to_string(), "kube-proxy".to_string())
            ]
        );
    }
}
