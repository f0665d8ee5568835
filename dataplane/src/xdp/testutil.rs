//! Test support: the root check, Ethernet framing of the IP packets `nat`'s test helpers
//! build, and classification of a frame by the program's counters. Network namespaces
//! come from the crate's lab ([`crate::lab`]).

use super::{SteerStats, Steering, XDP_PASS, sys};

pub const ETH_IPV4: u16 = 0x0800;
pub const ETH_IPV6: u16 = 0x86dd;
pub const ETH_ARP: u16 = 0x0806;
pub const ETH_8021Q: u16 = 0x8100;
pub const ETH_8021AD: u16 = 0x88a8;

/// Fails the calling test unless it runs as root: loading BPF programs, attaching XDP
/// and creating network namespaces need it, and a test that skipped would look passed.
pub fn require_root() {
    assert!(
        sys::is_root(),
        "this test loads BPF programs and creates network namespaces: it needs root \
         (run `sudo -E cargo test -p dataplane xdp`)"
    );
}

/// A freshly loaded, unattached program (its own empty maps).
pub fn steering() -> Steering {
    require_root();
    Steering::load().unwrap_or_else(|e| panic!("loading the steering program: {e}"))
}

/// `payload` behind an Ethernet header of type `ethertype`.
pub fn eth(ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01];
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An IP packet (version from its first nibble) in an Ethernet frame.
pub fn eth_ip(ip: &[u8]) -> Vec<u8> {
    let ethertype = if ip.first().is_some_and(|b| b >> 4 == 6) {
        ETH_IPV6
    } else {
        ETH_IPV4
    };
    eth(ethertype, ip)
}

/// An IP packet behind one VLAN tag (`tpid` 0x8100 or 0x88a8, VLAN id 100).
pub fn eth_vlan(tpid: u16, ip: &[u8]) -> Vec<u8> {
    let untagged = eth_ip(ip);
    let mut f = untagged[..12].to_vec(); // MAC addresses
    f.extend_from_slice(&tpid.to_be_bytes());
    f.extend_from_slice(&100u16.to_be_bytes()); // TCI: VLAN 100
    f.extend_from_slice(&untagged[12..]); // inner ethertype and packet
    f
}

/// Which rule counter a frame moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    Frontend,
    MasqReply,
    DnatReply,
    IcmpError,
    ClusterIp,
    /// A reply rule matched, but the kernel's conntrack tracks the flow: passed.
    KernelFlow,
    /// A later fragment of a datagram whose first fragment a rule took.
    Fragment,
}

/// Runs `frame` through the program (no socket in `xsks`) and returns the rule that
/// matched, if any, checking the counters' invariants on the way.
pub fn classify(s: &Steering, frame: &[u8]) -> Option<Rule> {
    let before = s.stats().expect("reading stats");
    let action = s.test_run(frame).expect("test run");
    let d: SteerStats = s.stats().expect("reading stats").since(&before);
    assert_eq!(
        action, XDP_PASS,
        "with no socket everything is passed (fail-open)"
    );
    assert_eq!((d.seen, d.passed, d.redirected), (1, 1, 0), "{d:?}");
    let hits: Vec<Rule> = [
        (d.frontend, Rule::Frontend),
        (d.masq_reply, Rule::MasqReply),
        (d.dnat_reply, Rule::DnatReply),
        (d.icmp_error, Rule::IcmpError),
        (d.cluster_ip, Rule::ClusterIp),
        (d.kernel_flow, Rule::KernelFlow),
        (d.fragment, Rule::Fragment),
    ]
    .into_iter()
    .filter(|(n, _)| *n > 0)
    .map(|(_, r)| r)
    .collect();
    assert!(hits.len() <= 1, "one packet, one rule: {d:?}");
    let redirectable = hits.iter().filter(|&&r| r != Rule::KernelFlow).count();
    assert_eq!(
        d.no_socket, redirectable as u64,
        "a match without a socket is counted (not one left to the kernel): {d:?}"
    );
    hits.first().copied()
}
