//! Throw-away network labs: named network namespaces joined by veth pairs, for `kxp demo`,
//! the macro benchmark and the tests of every crate. There is one lab so that all of
//! them test against the same kind of interface: created with the kernel's defaults
//! (offloads such as TX checksum, TSO/GSO and scatter-gather as the kernel sets them;
//! no ethtool, no sysctl), changed only where a caller asks (addresses, up, queue count,
//! [`Topology::forwarding`]). A pod's veth is like that, so kxp has to cope with what it
//! sends.
//!
//! Cleanup: a [`Topology`] deletes its namespaces when dropped, also while a failed test
//! unwinds, and deleting a namespace takes its interfaces, their peers and their XDP
//! programs with it. Names end in the owner's PID (`{prefix}-{role}-{pid}`, or
//! `{prefix}-{role}{n}-{pid}` from [`Topology::add_ns_unique`] when several namespaces of
//! one role exist in one process), so parallel runs do not collide, and a new topology
//! first sweeps its prefix's namespaces whose process is gone (a killed run).
//! Callers keep to 198.18.0.0/15 and documentation ranges for addresses.

use std::io;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

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

/// Runs `CMD...` inside namespace `ns` (`ip netns exec`, which also mounts the
/// namespace's own /sys for the command).
pub fn in_ns(ns: &str, cmd: &[&str]) -> io::Result<Output> {
    let mut args = vec!["netns", "exec", ns];
    args.extend_from_slice(cmd);
    ip(&args)
}

/// A command that runs a program in namespace `ns` as a node's kxp sees the world:
/// the namespace's own `/sys` (as `ip netns exec` mounts it) with the host's bpffs still
/// at `/sys/fs/bpf`, as kxp's DaemonSet mounts it (`ip netns exec` hides it, and the pins
/// that let a restarted kxp take over without `CAP_SYS_ADMIN` live there). Append the
/// program and its arguments. The program is the child itself (nothing forks).
pub fn node_command(ns: &str) -> Command {
    const SCRIPT: &str = r#"set -e
d=
if mountpoint -q /sys/fs/bpf; then d=$(mktemp -d /tmp/kxp-bpffs.XXXXXX); mount --bind /sys/fs/bpf "$d"; fi
mount -t sysfs sysfs /sys
if [ -n "$d" ]; then mount --bind "$d" /sys/fs/bpf; umount "$d"; rmdir "$d"; fi
exec "$@""#;
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{ns}"))
        .args(["--", "unshare", "--mount", "--propagation", "slave", "--"])
        .args(["sh", "-c", SCRIPT, "kxp-node"]);
    c
}

/// A set of network namespaces owned by this process, deleted on drop.
#[derive(Debug)]
pub struct Topology {
    prefix: String,
    namespaces: Vec<String>,
}

impl Topology {
    /// A new, empty topology; namespace names are `{prefix}-{role}-{pid}`. Namespaces of
    /// `prefix` left by runs whose process is gone are deleted first.
    pub fn new(prefix: &str) -> Topology {
        sweep_stale(prefix);
        Topology {
            prefix: prefix.to_string(),
            namespaces: Vec::new(),
        }
    }

    /// Full name of the namespace playing `role` (as [`Topology::add_ns`] names it).
    pub fn name(&self, role: &str) -> String {
        format!("{}-{role}-{}", self.prefix, std::process::id())
    }

    /// Creates the namespace playing `role`, with its loopback up; returns its name.
    pub fn add_ns(&mut self, role: &str) -> io::Result<String> {
        let name = self.name(role);
        self.create(name)
    }

    /// Like [`Topology::add_ns`], named `{prefix}-{role}{n}-{pid}` with `n` counted per
    /// process: for topologies of one process that exist at the same time with the same
    /// prefix and roles (tests running in parallel threads).
    pub fn add_ns_unique(&mut self, role: &str) -> io::Result<String> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}-{role}{n}-{}", self.prefix, std::process::id());
        self.create(name)
    }

    fn create(&mut self, name: String) -> io::Result<String> {
        ip(&["netns", "add", &name])?;
        self.namespaces.push(name.clone());
        ip(&["-n", &name, "link", "set", "lo", "up"])?;
        Ok(name)
    }

    /// A veth pair between two ends given as `(namespace, device, address)`, one RX/TX
    /// queue each, up, with the address on each end (CIDR form; empty for none). Both
    /// ends may be in the same namespace. Offloads are the kernel's defaults (transmit
    /// checksum offload, TSO/GSO, scatter-gather as created): a pod's veth is like that,
    /// so its packets reach the node with partial checksums, and kxp has to cope.
    pub fn link(&self, a: (&str, &str, &str), b: (&str, &str, &str)) -> io::Result<()> {
        self.link_multiqueue(a, b, 1)
    }

    /// Like [`Topology::link`] with `queues` RX/TX queues on both ends (at least one).
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

    /// Runs `f` on a thread of its own that entered namespace `ns` ([`enter_netns`];
    /// setns(2) is per thread), and returns its result. Sockets, netlink requests and
    /// threads made there stay in the namespace; a panic in `f` is resumed in the caller.
    pub fn run_in<R: Send>(&self, ns: &str, f: impl FnOnce() -> R + Send) -> io::Result<R> {
        std::thread::scope(|scope| {
            let thread = scope.spawn(|| {
                enter_netns(ns).map_err(|e| {
                    io::Error::new(e.kind(), format!("entering network namespace {ns}: {e}"))
                })?;
                Ok(f())
            });
            thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    /// `/sys/class/net/DEV/FILE` inside namespace `ns`, trimmed.
    pub fn sys(&self, ns: &str, dev: &str, file: &str) -> io::Result<String> {
        let out = in_ns(ns, &["cat", &format!("/sys/class/net/{dev}/{file}")])?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// The ifindex of `dev` in namespace `ns`.
    pub fn ifindex(&self, ns: &str, dev: &str) -> io::Result<u32> {
        let s = self.sys(ns, dev, "ifindex")?;
        s.parse()
            .map_err(|_| invalid(format!("{dev}: ifindex {s:?}")))
    }

    /// The MAC address of `dev` in namespace `ns`.
    pub fn mac(&self, ns: &str, dev: &str) -> io::Result<[u8; 6]> {
        let s = self.sys(ns, dev, "address")?;
        parse_mac(&s).ok_or_else(|| invalid(format!("{dev}: MAC address {s:?}")))
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

/// Moves the calling thread into the network namespace `/var/run/netns/NAME` (setns(2) is
/// per thread).
///
/// # Errors
/// No such namespace, or setns(2) refused (not root).
pub fn enter_netns(name: &str) -> io::Result<()> {
    let f = std::fs::File::open(format!("/var/run/netns/{name}"))?;
    nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)
}

/// Whether this process runs as root (the lab needs it).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let bytes = s
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    bytes.try_into().ok()
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
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "del", name]).output();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_macs() {
        assert_eq!(parse_mac("02:00:00:00:00:fe"), Some([2, 0, 0, 0, 0, 0xfe]));
        assert_eq!(parse_mac("02:00:00:00:00"), None);
        assert_eq!(parse_mac("02:00:00:00:00:zz"), None);
        assert_eq!(parse_mac(""), None);
    }

    fn listed(name: &str) -> bool {
        let out = ip(&["netns", "list"]).expect("ip netns list");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.split_whitespace().next() == Some(name))
    }

    #[test]
    fn namespaces_are_linked_entered_and_removed_on_drop_and_panic() {
        assert!(
            is_root(),
            "this test creates network namespaces: it needs root"
        );
        // What a killed run leaves: a namespace whose PID is gone.
        let mut child = Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = format!("kxpl-stale-{dead}");
        ip(&["netns", "add", &stale]).unwrap();
        let mut topo = Topology::new("kxpl");
        assert!(!listed(&stale), "swept");
        let a = topo.add_ns_unique("a").unwrap();
        let b = topo.add_ns_unique("a").unwrap();
        assert_ne!(a, b, "one role, two namespaces");
        assert!(a.ends_with(&format!("-{}", std::process::id())), "{a}");
        topo.link((&a, "kxl0", "198.18.0.1/24"), (&b, "kxl1", ""))
            .unwrap();
        let ifindex = topo.ifindex(&a, "kxl0").unwrap();
        let mac = topo.mac(&a, "kxl0").unwrap();
        assert_eq!(topo.sys(&a, "kxl0", "operstate").unwrap(), "up");
        let seen = topo
            .run_in(&a, || {
                let out = ip(&["-o", "link", "show", "kxl0"]).unwrap();
                String::from_utf8_lossy(&out.stdout).into_owned()
            })
            .unwrap();
        assert!(seen.starts_with(&format!("{ifindex}: kxl0@")), "{seen}");
        let m = mac.map(|b| format!("{b:02x}")).join(":");
        assert!(seen.contains(&m), "{seen} has {m}");
        assert!(topo.run_in("kxpl-none-0", || ()).is_err());
        drop(topo);
        assert!(!listed(&a) && !listed(&b), "deleted on drop");

        let mut name = String::new();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut topo = Topology::new("kxpl");
            name = topo.add_ns_unique("p").unwrap();
            topo.run_in(&name, || panic!("a failed assertion")).unwrap();
        }));
        assert!(unwound.is_err());
        assert!(
            !name.is_empty() && !listed(&name),
            "deleted while unwinding"
        );
    }
}
