//! Throw-away network topologies for `kxp demo` and the end-to-end tests: named network
//! namespaces joined by veth pairs, with addresses from 198.18.0.0/15 only, never routed
//! out of the machine, and removed when the [`Topology`] is dropped (also on a failed
//! assertion). Names carry a per-run suffix so parallel runs do not collide; stale ones
//! whose owner process is gone are swept first.

use std::io;
use std::process::{Command, Output};

/// Runs `ip ARGS`; an error carries ip's own message.
pub fn ip(args: &[&str]) -> io::Result<Output> {
    run("ip", args)
}

/// Runs a command and fails with its stderr if it fails.
pub fn run(prog: &str, args: &[&str]) -> io::Result<Output> {
    let out = Command::new(prog).args(args).output().map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("{prog}: {e} (is iproute2 installed? bash tests/install-deps.sh)"),
        )
    })?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{prog} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(out)
}

/// Runs `CMD...` inside namespace `ns`.
pub fn in_ns(ns: &str, cmd: &[&str]) -> io::Result<Output> {
    let mut args = vec!["netns", "exec", ns];
    args.extend_from_slice(cmd);
    ip(&args)
}

/// A set of namespaces owned by this process.
#[derive(Debug)]
pub struct Topology {
    prefix: String,
    namespaces: Vec<String>,
}

impl Topology {
    /// A new, empty topology; namespace names are `{prefix}-{role}-{pid}`.
    pub fn new(prefix: &str) -> Topology {
        sweep_stale(prefix);
        Topology {
            prefix: prefix.to_string(),
            namespaces: Vec::new(),
        }
    }

    /// Full name of the namespace playing `role`.
    pub fn name(&self, role: &str) -> String {
        format!("{}-{role}-{}", self.prefix, std::process::id())
    }

    /// Creates a namespace with its loopback up.
    pub fn add_ns(&mut self, role: &str) -> io::Result<String> {
        let name = self.name(role);
        ip(&["netns", "add", &name])?;
        self.namespaces.push(name.clone());
        ip(&["-n", &name, "link", "set", "lo", "up"])?;
        Ok(name)
    }

    /// A veth pair between two namespaces, up, with an address on each end (CIDR form;
    /// empty for none), with the kernel's default offloads (transmit checksum offload,
    /// TSO/GSO, scatter-gather as created): a pod's veth is like that, so its packets
    /// reach the node with partial checksums, and kxp has to cope.
    pub fn link(&self, a: (&str, &str, &str), b: (&str, &str, &str)) -> io::Result<()> {
        self.link_multiqueue(a, b, 1)
    }

    /// Like [`Topology::link`] with `queues` RX/TX queues on both ends.
    pub fn link_multiqueue(
        &self,
        a: (&str, &str, &str),
        b: (&str, &str, &str),
        queues: u32,
    ) -> io::Result<()> {
        let (ns_a, dev_a, _) = a;
        let (ns_b, dev_b, _) = b;
        let q = queues.max(1).to_string();
        ip(&[
            "link",
            "add",
            dev_a,
            "netns",
            ns_a,
            "numrxqueues",
            &q,
            "numtxqueues",
            &q,
            "type",
            "veth",
            "peer",
            "name",
            dev_b,
            "netns",
            ns_b,
            "numrxqueues",
            &q,
            "numtxqueues",
            &q,
        ])?;
        for (ns, dev, addr) in [a, b] {
            if !addr.is_empty() {
                ip(&["-n", ns, "addr", "add", addr, "dev", dev])?;
            }
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(())
    }

    /// Deletes one of this topology's namespaces now (a pod going away): its interfaces
    /// and their peers go with it.
    pub fn remove_ns(&mut self, name: &str) -> io::Result<()> {
        ip(&["netns", "del", name])?;
        self.namespaces.retain(|n| n != name);
        Ok(())
    }

    /// Enables IPv4 (and IPv6) forwarding in a namespace (it is a router).
    pub fn forwarding(&self, ns: &str) -> io::Result<()> {
        in_ns(
            ns,
            &[
                "sh",
                "-c",
                "echo 1 > /proc/sys/net/ipv4/ip_forward; echo 1 > /proc/sys/net/ipv6/conf/all/forwarding",
            ],
        )
        .map(|_| ())
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // Deleting a namespace removes its veth ends, their peers, and any XDP program.
        for ns in self.namespaces.drain(..).rev() {
            let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        }
    }
}

/// Deletes `{prefix}-*-{pid}` namespaces whose process is gone.
fn sweep_stale(prefix: &str) {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(&format!("{prefix}-")) else {
            continue;
        };
        let Some(pid) = rest.rsplit('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "del", name]).output();
        }
    }
}
