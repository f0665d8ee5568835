//! Shared set-up for kxp's benchmarks: synthetic clusters of any size, built from real
//! Kubernetes objects so that benchmarks exercise the same path as `kxp`.
#![forbid(unsafe_code)]

pub mod chart;
pub mod results;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::core::v1::{ObjectReference, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    FieldsV1, ManagedFieldsEntry, ObjectMeta, OwnerReference,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use translate::k8s::{ClusterState, NodeSettings};

fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn sum16(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}

/// The macro benchmark's first ClusterIP block: 198.19.0.10 up to 198.19.255.255 (in the
/// Service CIDR 198.19.0.0/16).
const VIPS_FIRST: (u32, u32) = (0xC613_000A, 0xC614_0000);
/// Its second: 198.18.112.0 up to 198.18.255.255 (198.18.112.0/20 and 198.18.128.0/17).
const VIPS_SECOND: (u32, u32) = (0xC612_7000, 0xC613_0000);

/// How many ClusterIPs [`service_vip`] has.
pub const SERVICE_VIPS: u32 = (VIPS_FIRST.1 - VIPS_FIRST.0) + (VIPS_SECOND.1 - VIPS_SECOND.0);

/// Where the macro benchmark's scale cases put their endpoints (routed to its backend).
pub const SCALE_EP_NET: &str = "198.18.96.0/20";
/// Where its new-connection sources are (198.18.64-95).
pub const NEW_SOURCES_NET: &str = "198.18.64.0/19";

/// The macro benchmark's ClusterIPs, Service `k`'s: the first block's 65,526, then the
/// second's 36,864, [`SERVICE_VIPS`] in all: so that 100,000 Services fit in
/// 198.18.0.0/15 beside the lab's links (198.18.1.0/24, 198.18.2.0/24), the
/// new connections' sources ([`NEW_SOURCES_NET`]) and the scale cases' endpoints
/// ([`SCALE_EP_NET`]). `k` past the last wraps around.
pub fn service_vip(k: u32) -> std::net::Ipv4Addr {
    let k = k % SERVICE_VIPS;
    let in_first = VIPS_FIRST.1 - VIPS_FIRST.0;
    std::net::Ipv4Addr::from(if k < in_first {
        VIPS_FIRST.0 + k
    } else {
        VIPS_SECOND.0 + (k - in_first)
    })
}

/// The Service CIDRs [`service_vip`]'s first `n` addresses are in.
pub fn service_cidrs(n: u32) -> &'static [&'static str] {
    if n <= VIPS_FIRST.1 - VIPS_FIRST.0 {
        &["198.19.0.0/16"]
    } else {
        &["198.19.0.0/16", "198.18.112.0/20", "198.18.128.0/17"]
    }
}

/// One 60-byte frame, as the benchmark's generators send: Ethernet, IPv4 (no options),
/// UDP from `src` to `dst`, 18 bytes of payload, both checksums right.
pub fn udp_frame(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    (src, sport): (Ipv4Addr, u16),
    (dst, dport): (Ipv4Addr, u16),
) -> [u8; 60] {
    let mut f = [0x2eu8; 60];
    f[0..6].copy_from_slice(&dst_mac);
    f[6..12].copy_from_slice(&src_mac);
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip = &mut f[14..34];
    ip[0] = 0x45;
    ip[1] = 0;
    ip[2..4].copy_from_slice(&46u16.to_be_bytes());
    ip[4..8].copy_from_slice(&[0, 0, 0x40, 0]);
    ip[8] = 64;
    ip[9] = 17;
    ip[10..12].copy_from_slice(&[0, 0]);
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let c = fold(sum16(ip));
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f[34..36].copy_from_slice(&sport.to_be_bytes());
    f[36..38].copy_from_slice(&dport.to_be_bytes());
    f[38..40].copy_from_slice(&26u16.to_be_bytes());
    f[40..42].copy_from_slice(&[0, 0]);
    // UDP checksum over the pseudo-header, header and payload.
    let mut s = sum16(&f[26..34]) + 17 + 26;
    s += sum16(&f[34..60]);
    let c = match fold(s) {
        0 => 0xffff,
        c => c,
    };
    f[40..42].copy_from_slice(&c.to_be_bytes());
    f
}

/// The ClusterIP of synthetic Service `i` (inside 172.16.0.0/12).
pub fn cluster_ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0xAC10_0000u32 + 1 + i))
}

/// The Service CIDR [`cluster_ip`]'s addresses are in (up to a million Services), as an
/// API server's default ServiceCIDR `kubernetes` has it.
pub const CLUSTER_SERVICE_CIDR: &str = "172.16.0.0/12";

/// The address of endpoint `j` of Service `i` (inside 10.0.0.0/8).
pub fn endpoint_ip(i: u32, j: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0A00_0000u32 + 1 + i * 16 + j))
}

/// `services` ClusterIP Services on port 80, each with `endpoints_each` ready endpoints on
/// port 8080 in one EndpointSlice (spread over three nodes and zones), each object with
/// what an API server serves besides what kube-proxy reads: managed fields, labels,
/// owner references, kubectl's last applied configuration (a Service `kubectl apply`
/// made), and for each endpoint its conditions, zone and reference to its Pod.
pub fn cluster(services: u32, endpoints_each: u32) -> ClusterState {
    assert!(endpoints_each <= 16);
    let mut state = ClusterState::default();
    for i in 0..services {
        let name = format!("svc-{i}");
        state.services.push(service(i, &name));
        state.endpoint_slices.push(EndpointSlice {
            metadata: ObjectMeta {
                name: Some(format!("{name}-abcde")),
                generate_name: Some(format!("{name}-")),
                namespace: Some("bench".into()),
                labels: Some(BTreeMap::from([
                    ("kubernetes.io/service-name".to_string(), name.clone()),
                    (
                        "endpointslice.kubernetes.io/managed-by".to_string(),
                        "endpointslice-controller.k8s.io".to_string(),
                    ),
                    ("app".to_string(), name.clone()),
                ])),
                annotations: Some(BTreeMap::from([(
                    "endpoints.kubernetes.io/last-change-trigger-time".to_string(),
                    "2026-12-01T10:00:00Z".to_string(),
                )])),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Service".into(),
                    name: name.clone(),
                    uid: uid(i, 0xffff),
                    controller: Some(true),
                    block_owner_deletion: Some(true),
                }]),
                managed_fields: Some(vec![managed(
                    "kube-controller-manager",
                    "discovery.k8s.io/v1",
                    r#"{"f:addressType":{},"f:endpoints":{},"f:metadata":{"f:annotations":{".":{},"f:endpoints.kubernetes.io/last-change-trigger-time":{}},"f:generateName":{},"f:labels":{".":{},"f:app":{},"f:endpointslice.kubernetes.io/managed-by":{},"f:kubernetes.io/service-name":{}},"f:ownerReferences":{".":{},"k:{\"uid\":\"0\"}":{}}},"f:ports":{}}"#,
                )]),
                ..Default::default()
            },
            address_type: "IPv4".into(),
            ports: Some(vec![EndpointPort {
                name: Some(String::new()),
                port: Some(8080),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            endpoints: (0..endpoints_each)
                .map(|j| Endpoint {
                    addresses: vec![endpoint_ip(i, j).to_string()],
                    conditions: Some(EndpointConditions {
                        ready: Some(true),
                        serving: Some(true),
                        terminating: Some(false),
                    }),
                    node_name: Some(format!("node-{}", j % 3)),
                    zone: Some(format!("z{}", j % 3 + 1)),
                    target_ref: Some(ObjectReference {
                        kind: Some("Pod".into()),
                        namespace: Some("bench".into()),
                        name: Some(format!("{name}-7d9f8b6c5-{j:05}")),
                        uid: Some(uid(i, j)),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
        });
    }
    state
}

/// Service `i` named `name`, as `kubectl apply` makes it.
fn service(i: u32, name: &str) -> Service {
    let last_applied = format!(
        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"annotations":{{}},"labels":{{"app":"{name}"}},"name":"{name}","namespace":"bench"}},"spec":{{"ports":[{{"port":80,"protocol":"TCP","targetPort":8080}}],"selector":{{"app":"{name}"}}}}}}"#
    );
    Service {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some("bench".into()),
            labels: Some(BTreeMap::from([("app".to_string(), name.to_string())])),
            annotations: Some(BTreeMap::from([(
                "kubectl.kubernetes.io/last-applied-configuration".to_string(),
                last_applied,
            )])),
            managed_fields: Some(vec![managed(
                "kubectl-client-side-apply",
                "v1",
                r#"{"f:metadata":{"f:annotations":{".":{},"f:kubectl.kubernetes.io/last-applied-configuration":{}},"f:labels":{".":{},"f:app":{}}},"f:spec":{"f:internalTrafficPolicy":{},"f:ports":{".":{},"k:{\"port\":80,\"protocol\":\"TCP\"}":{".":{},"f:port":{},"f:protocol":{},"f:targetPort":{}}},"f:selector":{},"f:sessionAffinity":{},"f:type":{}}}"#,
            )]),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some(cluster_ip(i).to_string()),
            cluster_ips: Some(vec![cluster_ip(i).to_string()]),
            ip_families: Some(vec!["IPv4".into()]),
            ip_family_policy: Some("SingleStack".into()),
            internal_traffic_policy: Some("Cluster".into()),
            session_affinity: Some("None".into()),
            type_: Some("ClusterIP".into()),
            selector: Some(BTreeMap::from([("app".to_string(), name.to_string())])),
            ports: Some(vec![ServicePort {
                port: 80,
                protocol: Some("TCP".into()),
                target_port: Some(IntOrString::Int(8080)),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A managed-fields entry of `manager` (an Update) with these fields.
fn managed(manager: &str, api_version: &str, fields: &str) -> ManagedFieldsEntry {
    ManagedFieldsEntry {
        manager: Some(manager.into()),
        operation: Some("Update".into()),
        api_version: Some(api_version.into()),
        time: None,
        fields_type: Some("FieldsV1".into()),
        fields_v1: serde_json::from_str(fields).ok().map(FieldsV1),
        subresource: None,
    }
}

/// A UID for object `j` of Service `i` (0xffff: the Service itself).
fn uid(i: u32, j: u32) -> String {
    format!(
        "{i:08x}-{j:04x}-4000-8000-{:012x}",
        u64::from(i) * 31 + u64::from(j)
    )
}

/// Node settings for the synthetic cluster: node-0, 192.0.2.10, cluster CIDR 10.0.0.0/8.
pub fn node_settings() -> NodeSettings {
    NodeSettings {
        node_name: "node-0".into(),
        node_ips: vec!["192.0.2.10".parse().unwrap()],
        cluster_cidrs: vec!["10.0.0.0/8".parse().unwrap()],
        ..Default::default()
    }
}

/// Synthetic flows and connection tables for the conntrack benchmarks (criterion's
/// `benches/conntrack.rs` and the interleaved `examples/new-flows-ab.rs`).
pub mod flows {
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};

    use conntrack::{ConnTable, SnatPorts, Timeouts};
    use nat::tuple::{Protocol, Tuple};

    /// TCP flags of a SYN.
    pub const SYN: u8 = 0x02;

    /// Flow `i`: client 198.18.x.y:port -> VIP 198.19.0.1:80, DNAT to one of 16 endpoints
    /// (original and reply tuples).
    pub fn flow(i: u32) -> (Tuple, Tuple) {
        let client = SocketAddr::new(
            IpAddr::V4(Ipv4Addr::from(0xC612_0000u32 + (i >> 14))),
            1024 + (i & 0x3fff) as u16,
        );
        let vip = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(198, 19, 0, 1)), 80);
        let ep = SocketAddr::new(
            IpAddr::V4(Ipv4Addr::new(198, 19, 1, (i % 16) as u8 + 1)),
            8080,
        );
        (
            Tuple::new(client, vip, Protocol::Tcp),
            Tuple::new(ep, client, Protocol::Tcp),
        )
    }

    /// A table for `capacity` flows holding flows `0..n` (unanswered: SYN only).
    ///
    /// # Panics
    /// If `n` exceeds `capacity` (a benchmark's set-up error).
    pub fn holding(capacity: usize, n: u32) -> ConnTable {
        let mut t = ConnTable::new(
            capacity,
            Timeouts::default(),
            SnatPorts::new(32768..=65535).expect("a valid port range"),
        )
        .expect("a valid capacity");
        for i in 0..n {
            let (o, r) = flow(i);
            t.insert(o, r, 0, SYN, 1).expect("room for the flow");
        }
        t
    }
}

/// How long a cache line written on one CPU takes to reach another: two threads pinned
/// to `cpus` pass a counter back and forth `round_trips` times (at least 100); the
/// result is the median one-way time (ns) of chunks of 100 round trips. On a VM it tells
/// where the hypervisor has the two vCPUs at the moment, which it changes now and then:
/// the two threads of one core (a shared cache, ~15 ns on the 2-core VM of this
/// project) or two cores (55-130 ns there); in copy-mode AF_XDP every received frame
/// crosses from the receiving interface's CPU to the worker's. `None` if a thread
/// cannot be pinned or a pass takes over a second (the other CPU was not given time).
pub fn line_transfer_ns(cpus: (usize, usize), round_trips: u32) -> Option<f64> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};
    // The counter on a line of its own.
    #[repr(align(128))]
    struct Line(AtomicU64);
    let line = Arc::new(Line(AtomicU64::new(0)));
    let limit = Duration::from_secs(1);
    // Waits until the counter reads `want`; false after `limit` without.
    let wait = move |line: &Line, want: u64| {
        let start = Instant::now();
        let mut spins = 0u32;
        // No `spin_loop()` hint: a PAUSE takes up to ~140 cycles, more than the
        // transfer being measured.
        while line.0.load(Ordering::Acquire) != want {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) && start.elapsed() > limit {
                return false;
            }
        }
        true
    };
    let other = {
        let line = Arc::clone(&line);
        std::thread::spawn(move || {
            if dataplane::sys::pin_to_cpu(cpus.1).is_err() {
                line.0.store(u64::MAX, Ordering::Release);
                return;
            }
            for i in 0..u64::from(round_trips) {
                if !wait(&line, 2 * i + 1) {
                    return;
                }
                line.0.store(2 * i + 2, Ordering::Release);
            }
        })
    };
    let here = std::thread::spawn(move || {
        dataplane::sys::pin_to_cpu(cpus.0).ok()?;
        // Timed in chunks of 100 round trips, and the median chunk taken: a vCPU
        // preempted for a while (milliseconds) spoils a chunk, not the result.
        let mut chunks = Vec::with_capacity(round_trips as usize / 100 + 1);
        let mut start = Instant::now();
        for i in 0..u64::from(round_trips) {
            if line.0.load(Ordering::Acquire) == u64::MAX {
                return None;
            }
            line.0.store(2 * i + 1, Ordering::Release);
            if !wait(&line, 2 * i + 2) {
                return None;
            }
            if (i + 1).is_multiple_of(100) {
                chunks.push(start.elapsed().as_nanos() as f64 / 200.0);
                start = Instant::now();
            }
        }
        chunks.sort_by(f64::total_cmp);
        chunks.get(chunks.len() / 2).copied()
    });
    let ns = here.join().ok().flatten();
    let _ = other.join();
    ns
}

/// Prints, for each way of an example that takes turns batch by batch (`times[i]`: the
/// batch times of `names[i]`, in ns), the median and quartiles, and the median per item
/// of a batch of 64 (`per`: what an item is).
pub fn print_turns(times: &mut [Vec<u64>], names: &[&str], per: &str) {
    let width = names.iter().map(|n| n.len()).max().unwrap_or(0);
    for (v, name) in times.iter_mut().zip(names) {
        if v.is_empty() {
            continue;
        }
        v.sort_unstable();
        let q = |f: usize| v[(v.len() - 1) * f / 4];
        println!(
            "  {name:width$} median {:6} ns per batch ({:.0} ns per {per}), quartiles {}-{}",
            q(2),
            q(2) as f64 / 64.0,
            q(1),
            q(3)
        );
    }
}

/// A small deterministic PRNG for benchmark inputs.
#[derive(Debug, Clone)]
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// The `kxp` binary next to this one (building it in release if missing), or `given`.
///
/// # Errors
/// kxp is missing and cannot be built.
pub fn locate_kxp(given: Option<&std::path::PathBuf>) -> anyhow::Result<std::path::PathBuf> {
    if let Some(p) = given {
        return Ok(p.clone());
    }
    let me = std::env::current_exe()?;
    let p = me.with_file_name("kxp");
    if p.exists() {
        return Ok(p);
    }
    eprintln!("macro-bench: {} missing; building it", p.display());
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let st = std::process::Command::new(cargo)
        .args([
            "build",
            "--release",
            "-p",
            "controlplane",
            "--bin",
            "kxp",
            "--manifest-path",
        ])
        .arg(manifest)
        .status()?;
    if !st.success() || !p.exists() {
        anyhow::bail!("cannot build kxp; give --kxp PATH (a release build of `kxp`)");
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    /// Every ClusterIP distinct, inside the Service CIDRs said, and outside the lab's
    /// other ranges.
    #[test]
    fn the_cluster_ips_fit_beside_the_labs_addresses() {
        use ipnet::Ipv4Net;
        assert_eq!(super::service_vip(0).to_string(), "198.19.0.10");
        const { assert!(super::SERVICE_VIPS >= 100_000) };
        let cidrs: Vec<Ipv4Net> = super::service_cidrs(super::SERVICE_VIPS)
            .iter()
            .map(|c| c.parse().unwrap())
            .collect();
        let others: Vec<Ipv4Net> = [
            "198.18.1.0/24",
            "198.18.2.0/24",
            super::NEW_SOURCES_NET,
            super::SCALE_EP_NET,
        ]
        .iter()
        .map(|c| c.parse().unwrap())
        .collect();
        let mut seen = std::collections::HashSet::new();
        for k in 0..super::SERVICE_VIPS {
            let v = super::service_vip(k);
            assert!(seen.insert(v), "{v} twice");
            assert!(cidrs.iter().any(|c| c.contains(&v)), "{v}");
            assert!(!others.iter().any(|c| c.contains(&v)), "{v}");
        }
        assert_eq!(super::service_cidrs(10_000), ["198.19.0.0/16"]);
        assert!(super::service_cidrs(65_526).len() == 1 && super::service_cidrs(65_527).len() == 3);
        assert_eq!(
            super::service_vip(super::SERVICE_VIPS),
            super::service_vip(0)
        );
    }

    #[test]
    fn the_cluster_ips_are_in_the_clusters_service_cidr() {
        let cidr: ipnet::IpNet = super::CLUSTER_SERVICE_CIDR.parse().unwrap();
        for i in [0, 1, 99_999, 999_999] {
            assert!(cidr.contains(&super::cluster_ip(i)), "{i}");
        }
    }

    #[test]
    fn a_line_transfer_between_two_cpus_is_timed() {
        if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
            // One CPU: the two threads cannot be on two; nothing to time.
            assert_eq!(super::line_transfer_ns((0, 1), 1_000), None);
            return;
        }
        let ns = super::line_transfer_ns((0, 1), 1_000).expect("both threads pinned");
        // A transfer is tens to hundreds of ns; a test machine busy with other tests may
        // preempt the threads, so only the order of magnitude is checked.
        assert!(ns > 1.0 && ns < 10_000_000.0, "{ns} ns");
    }
}
