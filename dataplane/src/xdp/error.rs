//! [`XdpError`]: what can go wrong loading, attaching and feeding the steering program,
//! each with what to do about it.

use std::io;

use super::AttachMode;

/// An error of [`super::Steering`] or [`super::cleanup_interface`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum XdpError {
    #[error(
        "interface name {ifname:?} is not valid: Linux names are 1 to 15 bytes, without '/', ':', NUL or whitespace"
    )]
    InvalidInterfaceName { ifname: String },

    #[error(
        "interface {ifname} not found in this network namespace; check `ip link`, and give kxp an existing one (--interface NAME)"
    )]
    InterfaceNotFound { ifname: String },

    #[error("looking up interface {ifname} failed")]
    InterfaceLookup {
        ifname: String,
        #[source]
        source: io::Error,
    },

    #[error(
        "{action} needs root (CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON, or CAP_SYS_ADMIN); run kxp as root or grant it these capabilities"
    )]
    NeedsPrivileges {
        action: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    #[error(
        "the kernel refused the XDP program (a kxp build or kernel incompatibility; kxp needs Linux >= 5.10 with BPF and XDP); verifier log tail:\n{log}"
    )]
    Verifier {
        log: String,
        #[source]
        source: libbpf_rs::Error,
    },

    #[error("loading the XDP steering program failed")]
    Load {
        #[source]
        source: libbpf_rs::Error,
    },

    /// The embedded object lacks something the loader expects: a build bug.
    #[error("the embedded XDP object has no {what} named {name} (kxp build error)")]
    MissingInObject {
        what: &'static str,
        name: &'static str,
    },

    #[error("attaching XDP to {ifname} ({mode}) failed: {hint}")]
    Attach {
        ifname: String,
        mode: AttachMode,
        hint: String,
        #[source]
        source: io::Error,
    },

    #[error("detaching XDP from {ifname} ({mode}) failed: {hint}")]
    Detach {
        ifname: String,
        mode: AttachMode,
        hint: String,
        #[source]
        source: io::Error,
    },

    #[error("querying the XDP programs of {ifname} failed")]
    Query {
        ifname: String,
        #[source]
        source: io::Error,
    },

    #[error(
        "{ifname} carries kxp's XDP program through a bpf_link held by a running process (kxp?): stop that process, which detaches it"
    )]
    HeldByLink {
        ifname: String,
        #[source]
        source: io::Error,
    },

    #[error("reading the loaded BPF programs failed")]
    ProgInfo {
        #[source]
        source: libbpf_rs::Error,
    },

    #[error("{op} on BPF map {map} failed{}", key.as_deref().map(|k| format!(" for {k}")).unwrap_or_default())]
    Map {
        map: &'static str,
        op: &'static str,
        key: Option<String>,
        #[source]
        source: libbpf_rs::Error,
    },

    #[error(
        "BPF map {map} holds at most {capacity} entries, {wanted} were asked for (local_addrs: the node's own addresses; service_cidrs: the cluster's ServiceCIDRs; the sets of Services and endpoints grow instead)"
    )]
    MapFull {
        map: &'static str,
        capacity: usize,
        wanted: usize,
    },

    #[error(
        "receive queue {queue} is out of range: the xsks map has {capacity} entries (queues 0..{capacity})"
    )]
    QueueOutOfRange { queue: u32, capacity: u32 },

    #[error(
        "the steering program serves at most {capacity} interfaces at once: detach some (fewer --interface matches)"
    )]
    TooManyInterfaces { capacity: u32 },

    #[error("{fd} is not a valid file descriptor for an AF_XDP socket")]
    BadSocketFd { fd: i32 },

    #[error("invalid SNAT port range {lo}-{hi}: need 1 <= lo <= hi (e.g. 61000-65000)")]
    InvalidSnatRange { lo: u16, hi: u16 },

    #[error("a test run needs a frame of at least 14 bytes (an Ethernet header), got {len}")]
    TestRunFrameSize { len: usize },

    #[error("BPF_PROG_TEST_RUN of the steering program failed")]
    TestRun {
        #[source]
        source: io::Error,
    },
}

/// What to do about a failed attach, from its errno.
pub(super) fn attach_hint(e: &io::Error, ifname: &str, mode: AttachMode) -> String {
    match e.raw_os_error() {
        Some(libc::EPERM | libc::EACCES) => {
            "attaching XDP needs root (CAP_NET_ADMIN and CAP_BPF); run kxp as root".into()
        }
        Some(libc::EEXIST | libc::EBUSY) => format!(
            "another XDP program is already attached (`ip link show {ifname}`); if it is a stale kxp one run `kxp cleanup`, else detach it (`ip link set dev {ifname} xdp off`) or choose another interface"
        ),
        Some(libc::EOPNOTSUPP) if mode == AttachMode::Native => {
            "the driver has no native XDP; use the generic or link mode".into()
        }
        Some(libc::ERANGE) => {
            "the MTU is too large for XDP on this device; lower it (e.g. 1500) or use the generic mode".into()
        }
        Some(libc::ENODEV) => "the interface disappeared".into(),
        Some(libc::EINVAL) => format!(
            "the kernel refused the attach flags (a program in another mode already on {ifname}? see `ip link show {ifname}`)"
        ),
        _ => "see the kernel's error below".into(),
    }
}

/// What to do about a failed detach, from its errno.
pub(super) fn detach_hint(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EPERM | libc::EACCES) => "detaching XDP needs root (CAP_NET_ADMIN)".into(),
        _ => "check `ip link show`; `ip link set dev NAME xdp off` removes any XDP program".into(),
    }
}
