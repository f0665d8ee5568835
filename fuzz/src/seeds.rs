//! The seed corpora: valid inputs of every kind each target reads, from which the fuzzer
//! starts. `fuzz-seeds` writes them to `fuzz/corpus/<target>/`; a test checks the
//! committed files are these.

use std::net::SocketAddr;

use conntrack::persist::{AffinityRecord, Header, Kind, RECORD_WORDS, seal};
use conntrack::{ConnTable, SnatPorts, Timeouts};
use nat::rewrite::tcp_flags::{ACK, SYN};
use nat::tuple::{Protocol, Tuple};

/// (target, file name, bytes).
pub fn all() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, p) in nat::rewrite::testutil::corpus().into_iter().enumerate() {
        out.push(("packet", format!("corpus-{i:02}"), p));
    }
    for (name, ops) in engine() {
        out.push(("engine", name.to_string(), ops));
    }
    for (name, data) in state() {
        out.push(("state", name.to_string(), data));
    }
    for (name, text) in config() {
        out.push(("config", name.to_string(), text.into_bytes()));
    }
    // The tracker's choices: the unit test's first choices, and a few patterns.
    let mut lcg = translate::tracker::testutil::Lcg(7);
    let walk: Vec<u8> = (0..512)
        .map(|_| translate::tracker::testutil::Choices::next(&mut lcg, 256) as u8)
        .collect();
    out.push(("snapshot", "lcg-7".into(), walk));
    out.push(("snapshot", "services-then-slices".into(), {
        let mut v = Vec::new();
        for i in 0..12u8 {
            v.extend_from_slice(&[0, i, 0, 0, 1, 0, 0, 0, 0, 0]);
            v.extend_from_slice(&[0, i, 3, 0, 3, 2, 1, 0, 0]);
        }
        v
    }));
    out
}

/// Engine operations (see `engine::run`): op, then its bytes.
fn engine() -> Vec<(&'static str, Vec<u8>)> {
    // A TCP handshake to web:80 from a pod, the answer, data, an ICMP error, time.
    let tcp = vec![
        1,
        1,
        0,
        0,
        0x9c,
        0x40,
        SYN,
        1, // client SYN (v4, pod, web:80, port 40000)
        4,
        0,
        SYN | ACK, // endpoint's SYN-ACK
        1,
        1,
        0,
        0,
        0x9c,
        0x40,
        ACK,
        8, // client ACK with data
        4,
        0,
        ACK, // endpoint's ACK
        6,
        0,
        1, // ICMP error about it
        7,
        30, // 9 s pass
        4,
        0,
        ACK, // and more
    ];
    let udp = vec![
        1, 1, 2, 1, 0x30, 0x39, 0, 3, // outside client → web:53 (UDP)
        4, 0, 0, // answer
        1, 1, 2, 7, 0x30, 0x3a, 0, 3, // outside client → node port 30053 (SNAT)
        4, 1, 0, 6, 1, 0, 7, 250, 4, 0, 0, // answer, error, 10 min, stale answer
    ];
    let mixed = vec![
        1,
        1,
        0,
        3,
        0x10,
        0x00,
        SYN,
        0, // → sticky (ClientIP)
        1,
        1,
        0,
        3,
        0x10,
        0x01,
        SYN,
        0,
        1,
        1,
        0,
        4,
        0x10,
        0x02,
        SYN,
        0, // → empty: RST
        1,
        0,
        1,
        0,
        0x20,
        0x00,
        SYN,
        0, // v6 → six:80
        4,
        2,
        SYN | ACK,
        1,
        1,
        2,
        5,
        0x30,
        0x00,
        SYN,
        0, // external IP, Local policy
        1,
        1,
        0,
        2,
        0x40,
        0x00,
        0,
        1,
        4,
        3,
        0, // SCTP
        0,
        20,
        0x45,
        0,
        0,
        20,
        0,
        0,
        0,
        0,
        64,
        6,
        0,
        0,
        198,
        18,
        128,
        9,
        198,
        19,
        0,
        10, // raw
    ];
    vec![
        ("tcp-handshake", tcp),
        ("udp-and-node-port", udp),
        ("mixed", mixed),
    ]
}

fn state() -> Vec<(&'static str, Vec<u8>)> {
    let sa = |s: &str| -> SocketAddr { s.parse().unwrap() };
    let now = 100 * 1_000_000_000u64;
    let mut t = ConnTable::new(
        16,
        Timeouts::default(),
        SnatPorts::new(40000..=40063).unwrap(),
    )
    .unwrap();
    t.enable_journal();
    for i in 0..4u16 {
        let c = sa(&format!("203.0.113.7:{}", 40000 + 2 * i));
        let o = Tuple::new(c, sa("198.19.0.10:80"), Protocol::Tcp);
        let r = Tuple::new(sa("198.18.128.1:8080"), c, Protocol::Tcp);
        t.insert(o, r, 1, SYN, now).unwrap();
        t.on_packet(&r, SYN | ACK, now);
    }
    let o = Tuple::new(sa("198.18.128.9:5000"), sa("198.19.0.10:53"), Protocol::Udp);
    let r = Tuple::new(
        sa("198.18.128.2:5353"),
        sa("198.18.0.254:40001"),
        Protocol::Udp,
    );
    t.insert(o, r, 2, 0, now).unwrap();
    t.on_packet(&r, 0, now);
    let mut flows = Vec::new();
    t.drain_journal(|_, rec| {
        if let Some(r) = rec {
            flows.push(r.encode());
        }
    });
    let aff = [AffinityRecord {
        service: 7,
        client: "203.0.113.7".parse().unwrap(),
        endpoint: sa("198.18.128.4:8080"),
        expires: now + 10_800 * 1_000_000_000,
    }
    .encode()];
    let file = |kind: Kind, payloads: &[[u64; RECORD_WORDS - 1]], mode: u8| {
        let h = Header {
            kind,
            records: payloads.len() as u64,
            worker: 0,
            workers: 1,
            boot_id: [0; 16],
            seed: 0x5eed,
            netns: 0,
        };
        let mut words: Vec<u64> = h.encode().to_vec();
        for p in payloads {
            words.push(seal(2, p));
            words.extend_from_slice(p);
        }
        let mut v = vec![mode];
        v.extend(words.iter().flat_map(|w| w.to_le_bytes()));
        v
    };
    vec![
        // Valid header and records, one worker.
        ("conntrack", file(Kind::Conntrack, &flows, 8 | 16 | 32)),
        // Two workers, worker 1's file: flows of worker 0 in it are refused.
        (
            "conntrack-two-workers",
            file(Kind::Conntrack, &flows, 1 | 8 | 16 | 32 | 64),
        ),
        // The header as written (another boot's id: refused as a whole).
        ("conntrack-other-boot", file(Kind::Conntrack, &flows, 0)),
        ("affinity", file(Kind::Affinity, &aff, 4 | 8 | 16 | 32)),
    ]
}

fn config() -> Vec<(&'static str, String)> {
    // The configuration kubeadm generates (the e2e tests' fixture), filled in.
    let kubeadm = include_str!("../../tests/fixtures/kubeadm-kube-proxy.conf")
        .replace("@KUBECONFIG@", "/var/lib/kube-proxy/kubeconfig.conf")
        .replace("@CLUSTER_CIDR@", "10.244.0.0/16");
    let kxp = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: ipvs
ipvs: {scheduler: mh, syncPeriod: 30s, minSyncPeriod: 1s}
conntrack: {maxPerCore: 32768, min: 131072, tcpEstablishedTimeout: 24h0m0s, tcpCloseWaitTimeout: 1h, udpTimeout: 250ms}
detectLocalMode: NodeCIDR
nodePortAddresses: [primary, 198.18.0.0/15]
kxp:
  interfaces: [eth0, \"ens*\"]
  workers: 2
  cpus: [0, 1]
  sessionAffinityMaxEntries: 1000
  stateDirectory: /run/kxp
";
    let v2 = "apiVersion: kubeproxy.config.k8s.io/v1alpha2
kind: KubeProxyConfiguration
syncPeriod: 1m30s
minSyncPeriod: 0.5s
detectLocal: {clusterCIDRs: [10.0.0.0/8, fd00::/48]}
logging: {format: json, verbosity: 4}
";
    vec![
        ("kubeadm", kubeadm),
        ("kxp", kxp.to_string()),
        ("v1alpha2", v2.to_string()),
    ]
}
