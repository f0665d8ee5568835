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
//!
//! The first three are required; without the others kxp starts and says what will not
//! work.

/// Capability numbers (`linux/capability.h`).
pub const CAP_NET_ADMIN: u32 = 12;
pub const CAP_NET_RAW: u32 = 13;
pub const CAP_IPC_LOCK: u32 = 14;
pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_SYS_RESOURCE: u32 = 24;
pub const CAP_PERFMON: u32 = 38;
pub const CAP_BPF: u32 = 39;

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
        let hex = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))?
            .trim();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_cap_eff_and_names_what_is_missing() {
        let full = Caps::parse("Name:\tkxp\nCapInh:\t0\nCapEff:\t000001ffffffffff\n").unwrap();
        assert_eq!(full.missing(), (vec![], vec![]));
        // NET_ADMIN, NET_RAW, BPF only (DaemonSet without PERFMON, IPC_LOCK, SYS_RESOURCE).
        let some = Caps((1 << CAP_NET_ADMIN) | (1 << CAP_NET_RAW) | (1 << CAP_BPF));
        let (req, opt) = some.missing();
        assert!(req.is_empty());
        assert_eq!(
            opt.iter().map(|o| o.0).collect::<Vec<_>>(),
            ["CAP_PERFMON", "CAP_IPC_LOCK", "CAP_SYS_RESOURCE"]
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
