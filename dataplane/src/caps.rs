//! The capabilities kxp runs with, read from `/proc/self/status` (`CapEff`), checked at
//! start so that a missing one is named instead of surfacing as an `EPERM` halfway
//! through setting up.
//!
//! | capability | for |
//! |---|---|
//! | `CAP_NET_ADMIN` | attaching XDP programs, netlink (links, routes, rules, neighbours), the service device, busy-poll socket options |
//! | `CAP_NET_RAW` | AF_XDP sockets |
//! | `CAP_BPF` (or `CAP_SYS_ADMIN`) | loading the steering program, creating and updating its maps |
//! | `CAP_PERFMON` (or `CAP_SYS_ADMIN`) | what the verifier allows the steering program with it |
//! | `CAP_IPC_LOCK` | the UMEMs' pinned memory beyond `RLIMIT_MEMLOCK` |
//! | `CAP_SYS_RESOURCE` | a negative `oomScoreAdj` (kube-proxy's -999) |
//! | `CAP_SYS_NICE` | moving threaded NAPI kthreads off pinned workers' CPUs ([`crate::napi`]); the workers' nice -20 and their CPUs' ksoftirqd's ([`crate::priority`]) |
//!
//! The first three are required; without the others kxp starts and says what will not
//! work.
//!
//! Once set up (programs attached, the previous kxp's taken over, servers bound),
//! [`drop_after_setup`] reduces every thread of the process to [`RUNTIME`] (what the link
//! watcher, new interfaces and map updates need): effective, permitted, inheritable,
//! ambient and bounding sets, with no_new_privs, so that nothing kxp runs regains the
//! rest. `CAP_SYS_ADMIN` and `CAP_SYS_RESOURCE` (and everything else root holds) go.

/// Capability numbers (`linux/capability.h`).
pub const CAP_NET_ADMIN: u32 = 12;
pub const CAP_NET_RAW: u32 = 13;
pub const CAP_IPC_LOCK: u32 = 14;
pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_SYS_NICE: u32 = 23;
pub const CAP_SYS_RESOURCE: u32 = 24;
pub const CAP_PERFMON: u32 = 38;
pub const CAP_BPF: u32 = 39;
pub const CAP_NET_BIND_SERVICE: u32 = 10;

/// What kxp keeps once set up (of what it holds): netlink and XDP attach for interfaces
/// that come later (`CAP_NET_ADMIN`), their AF_XDP sockets (`CAP_NET_RAW`), their
/// programs and maps (`CAP_BPF`, `CAP_PERFMON`), their UMEMs (`CAP_IPC_LOCK`), and
/// health-check ports below 1024 if a node port range reaches there
/// (`CAP_NET_BIND_SERVICE`), and the NAPI kthreads of those interfaces, kept off the
/// workers' CPUs (`CAP_SYS_NICE`).
pub const RUNTIME: [u32; 7] = [
    CAP_NET_ADMIN,
    CAP_NET_RAW,
    CAP_BPF,
    CAP_PERFMON,
    CAP_IPC_LOCK,
    CAP_NET_BIND_SERVICE,
    CAP_SYS_NICE,
];

/// `linux/capability.h`'s names, by number.
const NAMES: [&str; 41] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

/// The name of capability `cap` (`CAP_42` past the ones kxp knows).
pub fn name(cap: u32) -> String {
    NAMES
        .get(cap as usize)
        .map_or_else(|| format!("CAP_{cap}"), |n| (*n).to_string())
}

/// The names of the capabilities in `set`.
pub fn names(set: u64) -> Vec<String> {
    (0..64).filter(|c| set & (1 << c) != 0).map(name).collect()
}

/// A set of capabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps(pub u64);

impl Caps {
    /// The effective set of this thread (`None` if /proc cannot tell).
    pub fn effective() -> Option<Caps> {
        let status = std::fs::read_to_string("/proc/thread-self/status")
            .or_else(|_| std::fs::read_to_string("/proc/self/status"))
            .ok()?;
        Self::parse(&status)
    }

    /// `CapEff:` of a `/proc/PID/status` text.
    pub fn parse(status: &str) -> Option<Caps> {
        Self::parse_field(status, "CapEff:")
    }

    /// A capability field (`CapEff:`, `CapPrm:`, `CapBnd:`, …) of a `/proc/PID/status`
    /// text.
    pub fn parse_field(status: &str, field: &str) -> Option<Caps> {
        let hex = status.lines().find_map(|l| l.strip_prefix(field))?.trim();
        u64::from_str_radix(hex, 16).ok().map(Caps)
    }

    pub fn has(self, cap: u32) -> bool {
        cap < 64 && self.0 & (1 << cap) != 0
    }

    /// What kxp lacks: (required, optional with what fails without it).
    pub fn missing(self) -> (Vec<&'static str>, Vec<(&'static str, &'static str)>) {
        let admin = self.has(CAP_SYS_ADMIN);
        let mut required = Vec::new();
        for (cap, name) in [
            (CAP_NET_ADMIN, "CAP_NET_ADMIN"),
            (CAP_NET_RAW, "CAP_NET_RAW"),
        ] {
            if !self.has(cap) {
                required.push(name);
            }
        }
        if !self.has(CAP_BPF) && !admin {
            required.push("CAP_BPF");
        }
        let mut optional = Vec::new();
        if !self.has(CAP_PERFMON) && !admin {
            optional.push(("CAP_PERFMON", "the kernel may refuse the steering program"));
        }
        if !self.has(CAP_IPC_LOCK) {
            optional.push(("CAP_IPC_LOCK", "the UMEMs must fit in RLIMIT_MEMLOCK"));
        }
        if !self.has(CAP_SYS_RESOURCE) {
            optional.push(("CAP_SYS_RESOURCE", "a negative oomScoreAdj cannot be set"));
        }
        if !self.has(CAP_SYS_NICE) {
            optional.push((
                "CAP_SYS_NICE",
                "threaded NAPI kthreads cannot be moved off pinned workers' CPUs",
            ));
        }
        (required, optional)
    }
}

/// Checks the capabilities kxp needs; an error names the missing ones, and a warning is
/// logged for each optional one.
///
/// # Errors
/// A required capability is missing (the text says which, and how to grant them).
pub fn check() -> Result<(), String> {
    check_required()?;
    if let Some(caps) = Caps::effective() {
        for (cap, why) in caps.missing().1 {
            tracing::warn!(
                "without {cap}: {why} (deploy/kxp.yaml and deploy/kxp.service grant it)"
            );
        }
    }
    Ok(())
}

/// [`check`] without the warnings: only whether the required capabilities are there.
///
/// # Errors
/// As [`check`].
pub fn check_required() -> Result<(), String> {
    let Some(caps) = Caps::effective() else {
        return Ok(());
    };
    let required = caps.missing().0;
    if !required.is_empty() {
        return Err(format!(
            "kxp's dataplane needs CAP_NET_ADMIN, CAP_NET_RAW and CAP_BPF; missing: {} (run it as root, or grant them as deploy/kxp.yaml and deploy/kxp.service do)",
            required.join(", ")
        ));
    }
    Ok(())
}

/// What [`drop_after_setup`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dropped {
    /// Kept (of [`RUNTIME`], those the process held).
    pub kept: u64,
    /// Dropped from the permitted set.
    pub dropped: u64,
    /// Threads reduced, this one included.
    pub threads: usize,
    /// Threads still holding more than `kept` (`tid name`), if any did not answer.
    pub stragglers: Vec<String>,
}

/// The highest capability number the kernel knows.
fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// Threads of this process not reduced to `keep` yet (tid, name): holding more in a set
/// (the bounding one too if `bounding`), or without no_new_privs.
fn over(keep: u64, bounding: bool, me: i32) -> Vec<(i32, String)> {
    crate::sys::thread_ids()
        .into_iter()
        .filter_map(|tid| {
            let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).ok()?;
            let sets: &[&str] = if bounding {
                &["CapEff:", "CapPrm:", "CapInh:", "CapAmb:", "CapBnd:"]
            } else {
                &["CapEff:", "CapPrm:", "CapInh:", "CapAmb:"]
            };
            let nnp = status
                .lines()
                .find_map(|l| l.strip_prefix("NoNewPrivs:"))
                .is_some_and(|v| v.trim() == "1");
            let more = !nnp
                || sets
                    .iter()
                    .filter_map(|f| Caps::parse_field(&status, f))
                    .any(|c| c.0 & !keep != 0);
            let name = status
                .lines()
                .find_map(|l| l.strip_prefix("Name:"))
                .unwrap_or("")
                .trim()
                .to_string();
            (more && tid != me).then_some((tid, name))
        })
        .collect()
}

/// Reduces every thread of kxp to the capabilities of [`RUNTIME`] it holds (with
/// `CAP_SYS_ADMIN` kept only where it stands in for a `CAP_BPF` the kernel or the process
/// lacks). Threads are signalled to reduce themselves (capabilities are per thread), then
/// checked in `/proc/self/task`; threads started meanwhile are signalled in turn.
///
/// # Errors
/// The calling thread could not reduce its own sets.
pub fn drop_after_setup() -> Result<Dropped, String> {
    let before = crate::sys::capget().map_err(|e| format!("capget: {e}"))?;
    let last = last_cap();
    let mut keep: u64 = RUNTIME.iter().map(|&c| 1u64 << c).sum();
    let bpf_works = last >= CAP_BPF && before.effective & (1 << CAP_BPF) != 0;
    if !bpf_works {
        keep |= 1 << CAP_SYS_ADMIN;
    }
    keep &= before.permitted;
    // Without CAP_SETPCAP the bounding set cannot shrink (a container's already is the
    // granted set).
    let bounding = before.effective & (1 << 8) != 0;
    let me = crate::sys::gettid();
    // Each thread over the set is signalled, again if it has not answered in 100 ms (a
    // signal to a thread that was exiting is lost); until none is left, or 2 s.
    let mut signalled: std::collections::HashMap<i32, std::time::Instant> = Default::default();
    let start = std::time::Instant::now();
    crate::sys::reduce_threads(keep, last, &[])
        .map_err(|e| format!("reducing capabilities: {e}"))?;
    let stragglers = loop {
        let pending = over(keep, bounding, me);
        if pending.is_empty() || start.elapsed() >= std::time::Duration::from_secs(2) {
            break pending;
        }
        let now = std::time::Instant::now();
        let todo: Vec<i32> = pending
            .iter()
            .map(|p| p.0)
            .filter(|t| {
                signalled
                    .get(t)
                    .is_none_or(|at| now - *at >= std::time::Duration::from_millis(100))
            })
            .collect();
        if !todo.is_empty() {
            for t in &todo {
                signalled.insert(*t, now);
            }
            crate::sys::reduce_threads(keep, last, &todo)
                .map_err(|e| format!("reducing capabilities: {e}"))?;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    Ok(Dropped {
        kept: keep,
        dropped: before.permitted & !keep,
        threads: 1 + signalled.len(),
        stragglers: stragglers.iter().map(|(t, n)| format!("{t} {n}")).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_cap_eff_and_names_what_is_missing() {
        let full = Caps::parse("Name:\tkxp\nCapInh:\t0\nCapEff:\t000001ffffffffff\n").unwrap();
        assert_eq!(full.missing(), (vec![], vec![]));
        // NET_ADMIN, NET_RAW, BPF only (a DaemonSet without the optional ones).
        let some = Caps((1 << CAP_NET_ADMIN) | (1 << CAP_NET_RAW) | (1 << CAP_BPF));
        let (req, opt) = some.missing();
        assert!(req.is_empty());
        assert_eq!(
            opt.iter().map(|o| o.0).collect::<Vec<_>>(),
            [
                "CAP_PERFMON",
                "CAP_IPC_LOCK",
                "CAP_SYS_RESOURCE",
                "CAP_SYS_NICE"
            ]
        );
        // SYS_ADMIN stands in for BPF and PERFMON.
        let old = Caps((1 << CAP_NET_ADMIN) | (1 << CAP_NET_RAW) | (1 << CAP_SYS_ADMIN));
        assert!(old.missing().0.is_empty());
        assert_eq!(
            Caps(0).missing().0,
            ["CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_BPF"]
        );
        assert!(Caps::parse("no caps here").is_none());
    }
}
