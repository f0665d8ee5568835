//! [`SteerStats`]: the program's per-CPU counters (`stats`, a PERCPU_ARRAY of u64
//! indexed as the `ST_*` enum in steer.bpf.c), summed over CPUs.

use libbpf_rs::{MapCore, MapFlags, MapHandle};

use super::XdpError;

/// The program's counters, summed over CPUs. `seen == redirected + passed + held`, where
/// `held` are the `no_socket` packets dropped while kxp restarts (see
/// [`super::Steering::set_hold`]); a packet that matched a rule counts once in exactly
/// one of the rule counters (or in `kernel_flow`, passed), and in `no_socket` too if the queue had no socket (it
/// was then passed, or held).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SteerStats {
    pub seen: u64,
    pub redirected: u64,
    pub passed: u64,
    pub no_socket: u64,
    /// Rule (a): to a Service frontend outside the Service CIDRs (NodePorts, external
    /// and LoadBalancer IPs; ClusterIPs when no ServiceCIDR is known).
    pub frontend: u64,
    /// Rule (b): to a node address, in the SNAT port range.
    pub masq_reply: u64,
    /// Rule (c): from an endpoint, not to a node address.
    pub dnat_reply: u64,
    /// Rule (d): an ICMP error about a translated flow.
    pub icmp_error: u64,
    /// Rule (e), checked first: to an address inside a Service CIDR (ClusterIPs
    /// included, whichever port; kxp translates, rejects or drops them); or to a
    /// ClusterIP outside the CIDRs on a port no Service serves (kxp rejects it).
    pub cluster_ip: u64,
    /// IPv4 or IPv6 whose headers the program cannot read (truncated, IHL below 5, a
    /// transport header cut short, too long an IPv6 extension chain): passed, and the
    /// kernel drops what is malformed.
    pub unparsed: u64,
    /// VLAN-tagged frames not looked inside (passed).
    pub vlan: u64,
    /// A reply rule ((b), (c), (d), or a later fragment from an endpoint) matched, but the
    /// kernel's conntrack tracks the flow: the kernel's own connection (traffic straight
    /// to a pod, Service traffic another node translated), passed to it.
    pub kernel_flow: u64,
    /// Rule (f): a later fragment of a datagram whose first fragment a rule took.
    pub fragment: u64,
}

impl SteerStats {
    /// The counts since `earlier` (counters only grow; saturating, never panics).
    pub fn since(&self, earlier: &SteerStats) -> SteerStats {
        SteerStats {
            seen: self.seen.saturating_sub(earlier.seen),
            redirected: self.redirected.saturating_sub(earlier.redirected),
            passed: self.passed.saturating_sub(earlier.passed),
            no_socket: self.no_socket.saturating_sub(earlier.no_socket),
            frontend: self.frontend.saturating_sub(earlier.frontend),
            masq_reply: self.masq_reply.saturating_sub(earlier.masq_reply),
            dnat_reply: self.dnat_reply.saturating_sub(earlier.dnat_reply),
            icmp_error: self.icmp_error.saturating_sub(earlier.icmp_error),
            cluster_ip: self.cluster_ip.saturating_sub(earlier.cluster_ip),
            unparsed: self.unparsed.saturating_sub(earlier.unparsed),
            vlan: self.vlan.saturating_sub(earlier.vlan),
            kernel_flow: self.kernel_flow.saturating_sub(earlier.kernel_flow),
            fragment: self.fragment.saturating_sub(earlier.fragment),
        }
    }
}

/// Counters per interface slot (`ST_MAX`): one `stats` entry (per CPU) holds them all.
pub(super) const PER_SLOT: usize = 13;

/// Reads and sums the counters of interface slot `slot` in the `stats` map.
pub(super) fn read(stats: &MapHandle, slot: u32) -> Result<SteerStats, XdpError> {
    let per_cpu = stats
        .lookup_percpu(&slot.to_ne_bytes(), MapFlags::ANY)
        .map_err(|source| XdpError::Map {
            map: "stats",
            op: "lookup",
            key: Some(format!("slot {slot}")),
            source,
        })?
        .unwrap_or_default();
    let mut c = [0u64; PER_SLOT];
    for cpu in &per_cpu {
        for (counter, b) in c.iter_mut().zip(cpu.chunks_exact(8)) {
            let v = u64::from_ne_bytes(b.try_into().unwrap_or([0; 8]));
            *counter = counter.wrapping_add(v);
        }
    }
    let [
        seen,
        redirected,
        passed,
        no_socket,
        frontend,
        masq_reply,
        dnat_reply,
        icmp_error,
        cluster_ip,
        unparsed,
        vlan,
        kernel_flow,
        fragment,
    ] = c;
    Ok(SteerStats {
        seen,
        redirected,
        passed,
        no_socket,
        frontend,
        masq_reply,
        dnat_reply,
        icmp_error,
        cluster_ip,
        unparsed,
        vlan,
        kernel_flow,
        fragment,
    })
}

/// Sets the counters of `slot` to zero on every CPU (a slot given to another interface
/// starts from zero).
pub(super) fn clear(stats: &MapHandle, slot: u32) -> Result<(), XdpError> {
    let cpus = libbpf_rs::num_possible_cpus().map_err(|source| XdpError::Map {
        map: "stats",
        op: "count CPUs",
        key: None,
        source,
    })?;
    let zeros = vec![vec![0u8; 8 * PER_SLOT]; cpus];
    stats
        .update_percpu(&slot.to_ne_bytes(), &zeros, MapFlags::ANY)
        .map_err(|source| XdpError::Map {
            map: "stats",
            op: "update",
            key: Some(format!("slot {slot}")),
            source,
        })
}
