//! The steering program on single frames (BPF_PROG_TEST_RUN, no interface): each rule's
//! hits and near misses, header edge cases, and the incremental map sync. Needs root.

use std::collections::HashSet;
use std::hash::Hash;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use libbpf_rs::MapCore;
use nat::rewrite::testutil::{self as pkt, Endpoints};
use nat::tuple::{Protocol, Tuple};

use super::testutil::{
    ETH_8021AD, ETH_8021Q, ETH_ARP, ETH_IPV4, Rule, classify, eth, eth_ip, eth_vlan, steering,
};
use super::*;

const PROTOS: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];
const SNAT: (u16, u16) = (61000, 61999); // Endpoints::node uses port 61000

fn key(a: SocketAddr, p: Protocol) -> SteerKey {
    SteerKey::new(a.ip(), a.port(), p)
}

fn set<T: Hash + Eq>(items: impl IntoIterator<Item = T>) -> HashSet<T> {
    items.into_iter().collect()
}

fn port(a: SocketAddr, port: u16) -> SocketAddr {
    SocketAddr::new(a.ip(), port)
}

fn tuple(src: SocketAddr, dst: SocketAddr, p: Protocol) -> Tuple {
    Tuple::new(src, dst, p)
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn sock(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// A frame from a client to frontend `k`.
fn to_key(k: SteerKey) -> Vec<u8> {
    let client: SocketAddr = "198.18.0.1:40000".parse().unwrap();
    frame(&tuple(
        client,
        SocketAddr::new(k.addr(), k.port()),
        k.proto(),
    ))
}

fn frame(t: &Tuple) -> Vec<u8> {
    eth_ip(&pkt::build_tuple(t, b"payload"))
}

/// What an ICMP error quotes: the IP header and the first 8 bytes of L4.
fn quote(t: &Tuple) -> Vec<u8> {
    let p = pkt::build_tuple(t, b"12345678");
    let ip_len = if p[0] >> 4 == 6 {
        40
    } else {
        usize::from(p[0] & 0xf) * 4
    };
    p[..ip_len + 8].to_vec()
}

fn icmp_error(src: IpAddr, dst: IpAddr, about: &Tuple) -> Vec<u8> {
    eth_ip(&pkt::icmp_error(src, dst, &quote(about)))
}

/// Offset of the L4 header in an untagged frame with a plain IP header.
fn l4_offset(f: &[u8]) -> usize {
    if f[14] >> 4 == 6 {
        14 + 40
    } else {
        14 + usize::from(f[14] & 0xf) * 4
    }
}

#[test]
fn steer_key_is_the_20_byte_c_layout() {
    let k = SteerKey::new("198.18.0.10".parse().unwrap(), 0x1f90, Protocol::Sctp);
    let mut want = [0u8; 20];
    want[10..16].copy_from_slice(&[0xff, 0xff, 198, 18, 0, 10]);
    want[16..19].copy_from_slice(&[0x1f, 0x90, 132]);
    assert_eq!(k.to_bytes(), want);
    let mapped = SteerKey::new(
        "::ffff:198.18.0.10".parse().unwrap(),
        0x1f90,
        Protocol::Sctp,
    );
    assert_eq!(mapped, k, "v4-mapped v6 is the v4 key");
    assert_eq!(k.to_string(), "198.18.0.10:8080/SCTP");
    let v6 = SteerKey::new("2001:db8::1".parse().unwrap(), 443, Protocol::Tcp);
    assert_eq!(v6.to_string(), "[2001:db8::1]:443/TCP");
    assert_eq!(v6.to_bytes()[..2], [0x20, 0x01]);
    assert_eq!(v6.to_bytes()[16..], [0x01, 0xbb, 6, 0]);
}

#[test]
fn frontends_match_on_dst_port_and_protocol() {
    let mut s = steering();
    for e in [Endpoints::v4(), Endpoints::v6()] {
        s.sync_frontends(&set(PROTOS.map(|p| key(e.vip, p))))
            .unwrap();
        for p in PROTOS {
            assert_eq!(
                classify(&s, &frame(&e.original(p))),
                Some(Rule::Frontend),
                "{p} {e:?}"
            );
            // near misses: another port, another address, the VIP as source
            let other_port = tuple(e.client, port(e.vip, 81), p);
            assert_eq!(classify(&s, &frame(&other_port)), None);
            let other_addr = tuple(e.client, e.backend, p);
            assert_eq!(classify(&s, &frame(&other_addr)), None);
            assert_eq!(classify(&s, &frame(&tuple(e.vip, e.client, p))), None);
        }
        // only TCP left: UDP and SCTP to the same address and port are not steered
        s.sync_frontends(&set([key(e.vip, Protocol::Tcp)])).unwrap();
        assert_eq!(
            classify(&s, &frame(&e.original(Protocol::Tcp))),
            Some(Rule::Frontend)
        );
        assert_eq!(classify(&s, &frame(&e.original(Protocol::Udp))), None);
        assert_eq!(classify(&s, &frame(&e.original(Protocol::Sctp))), None);
        // ping to the VIP is the kernel's
        assert_eq!(
            classify(&s, &eth_ip(&pkt::icmp_echo(e.client.ip(), e.vip.ip()))),
            None
        );
    }
}

#[test]
fn masquerade_replies_need_a_node_address_and_a_port_in_the_snat_range() {
    let mut s = steering();
    let e = Endpoints::v4();
    s.sync_local_addrs(&set([e.node.ip()])).unwrap();
    let reply = tuple(e.backend, e.node, Protocol::Udp);
    assert_eq!(classify(&s, &frame(&reply)), None, "no SNAT range set yet");
    s.set_snat_range(SNAT.0, SNAT.1).unwrap();
    for e in [Endpoints::v4(), Endpoints::v6()] {
        s.sync_local_addrs(&set([e.node.ip()])).unwrap();
        let reply = |dport| frame(&tuple(e.backend, port(e.node, dport), Protocol::Udp));
        for p in PROTOS {
            let t = tuple(e.backend, e.node, p);
            assert_eq!(classify(&s, &frame(&t)), Some(Rule::MasqReply), "{p}");
        }
        assert_eq!(classify(&s, &reply(SNAT.1)), Some(Rule::MasqReply));
        assert_eq!(classify(&s, &reply(SNAT.0 - 1)), None, "below the range");
        assert_eq!(classify(&s, &reply(SNAT.1 + 1)), None, "above the range");
        assert_eq!(classify(&s, &reply(22)), None, "the node's own ssh");
        let not_local = tuple(e.backend, port(e.client, SNAT.0), Protocol::Udp);
        assert_eq!(
            classify(&s, &frame(&not_local)),
            None,
            "dst is not a node address"
        );
    }
}

#[test]
fn dnat_replies_come_from_an_endpoint_to_a_non_node_address() {
    let mut s = steering();
    s.set_snat_range(SNAT.0, SNAT.1).unwrap();
    for e in [Endpoints::v4(), Endpoints::v6()] {
        s.sync_endpoints(&set([key(e.backend, Protocol::Tcp)]))
            .unwrap();
        s.sync_local_addrs(&set([e.node.ip()])).unwrap();
        let reply = tuple(e.backend, e.client, Protocol::Tcp);
        assert_eq!(classify(&s, &frame(&reply)), Some(Rule::DnatReply));
        let wrong_proto = tuple(e.backend, e.client, Protocol::Udp);
        assert_eq!(classify(&s, &frame(&wrong_proto)), None);
        let wrong_port = tuple(port(e.backend, 8081), e.client, Protocol::Tcp);
        assert_eq!(classify(&s, &frame(&wrong_port)), None);
        // the node talking to the pod itself (kubelet probes): dst is a node address
        let to_node = tuple(e.backend, port(e.node, 40000), Protocol::Tcp);
        assert_eq!(
            classify(&s, &frame(&to_node)),
            None,
            "dst local: the kernel's flow"
        );
        // the client's packets to the endpoint directly are not replies
        assert_eq!(classify(&s, &frame(&e.dnat(Protocol::Tcp))), None);
    }
}

#[test]
fn replies_of_flows_the_kernel_tracks_are_left_to_it() {
    // Traffic straight to a pod, or Service traffic another node translated: the kernel
    // forwarded the request and tracks the flow, so the endpoint's answers are its own
    // (its conntrack must see them). Here the kernel's entries are the namespace's own
    // connections over loopback, with conntrack on (an nftables `ct state` rule).
    let mut topo = lab::Topology::new("kxpct");
    let ns = topo.add_ns("ct").unwrap();
    lab::in_ns(&ns, &["ip", "link", "set", "lo", "up"]).unwrap();
    lab::in_ns(
        &ns,
        &[
            "nft",
            "add table inet kxpct; add chain inet kxpct out { type filter hook output \
             priority 0; ct state invalid drop; }",
        ],
    )
    .unwrap();
    let ns2 = ns.clone();
    std::thread::spawn(move || {
        lab::enter_netns(&ns2).unwrap();
        let lo = |p: u16| SocketAddr::new(IpAddr::from([127, 0, 0, 1]), p);
        // The kernel's flows: 127.0.0.1:X -> :9 (UDP) and -> :7 (TCP, refused: the
        // entry stays a while in CLOSE).
        let udp = std::net::UdpSocket::bind(lo(0)).unwrap();
        udp.send_to(b"x", lo(9)).unwrap();
        let x = udp.local_addr().unwrap().port();
        let tcp = std::net::TcpStream::connect(lo(7));
        assert!(tcp.is_err(), "nothing listens on 127.0.0.1:7");
        let mut s = steering();
        s.set_snat_range(SNAT.0, SNAT.1).unwrap();
        s.sync_endpoints(&set([
            key(lo(9), Protocol::Udp),
            key(lo(0), Protocol::Udp),
            key(lo(7), Protocol::Tcp),
        ]))
        .unwrap();
        let reply = tuple(lo(9), lo(x), Protocol::Udp);
        assert_eq!(classify(&s, &frame(&reply)), Some(Rule::KernelFlow));
        let untracked = tuple(lo(9), lo(x.wrapping_add(1)), Protocol::Udp);
        assert_eq!(classify(&s, &frame(&untracked)), Some(Rule::DnatReply));
        // TCP: whichever port the refused connect used, no entry has port 1 as client.
        let tcp_untracked = tuple(lo(7), lo(1), Protocol::Tcp);
        assert_eq!(classify(&s, &frame(&tcp_untracked)), Some(Rule::DnatReply));

        // A fragmented answer: the first fragment is the kernel's, and so are the later
        // ones of the same datagram (not those of another).
        let mut first = frame(&reply);
        first[14 + 4..14 + 6].copy_from_slice(&0x4242u16.to_be_bytes()); // id
        first[14 + 6..14 + 8].copy_from_slice(&0x2000u16.to_be_bytes()); // MF
        let first = eth_ip(&fixed_ipv4(&first[14..]));
        assert_eq!(classify(&s, &first), Some(Rule::KernelFlow));
        let mut later = first.clone();
        later[14 + 6..14 + 8].copy_from_slice(&0x0010u16.to_be_bytes()); // offset 128
        let later = eth_ip(&fixed_ipv4(&later[14..]));
        assert_eq!(classify(&s, &later), Some(Rule::KernelFlow));
        let mut other = later.clone();
        other[14 + 4..14 + 6].copy_from_slice(&0x4243u16.to_be_bytes());
        let other = eth_ip(&fixed_ipv4(&other[14..]));
        assert_eq!(classify(&s, &other), Some(Rule::DnatReply));

        // An ICMP error quoting the kernel's flow (client -> endpoint) is the kernel's.
        let router = IpAddr::from([127, 0, 0, 2]);
        let about = tuple(lo(x), lo(9), Protocol::Udp);
        let err = icmp_error(router, lo(x).ip(), &about);
        assert_eq!(classify(&s, &err), Some(Rule::KernelFlow));
        let about_other = tuple(lo(x.wrapping_add(1)), lo(9), Protocol::Udp);
        let err = icmp_error(router, lo(x).ip(), &about_other);
        assert_eq!(classify(&s, &err), Some(Rule::IcmpError));

        // To a node address in the SNAT port range (rule (b)): the kernel's when it
        // tracks it (the node's own connection from such a port) ...
        let node = std::net::UdpSocket::bind(lo(61500)).unwrap();
        node.send_to(b"x", lo(9)).unwrap();
        s.sync_local_addrs(&set([IpAddr::from([127, 0, 0, 1])]))
            .unwrap();
        let masq_reply = tuple(lo(9), lo(61500), Protocol::Udp);
        assert_eq!(classify(&s, &frame(&masq_reply)), Some(Rule::KernelFlow));
        let masq_untracked = tuple(lo(9), lo(61501), Protocol::Udp);
        assert_eq!(classify(&s, &frame(&masq_untracked)), Some(Rule::MasqReply));
        // ... but on kxp's service device everything was routed to kxp: no lookup.
        s.set_service_device().unwrap();
        assert_eq!(classify(&s, &frame(&masq_reply)), Some(Rule::MasqReply));
        drop((udp, node));
    })
    .join()
    .unwrap();
}

/// An IPv4 packet with its header checksum recomputed.
fn fixed_ipv4(ip: &[u8]) -> Vec<u8> {
    let mut p = ip.to_vec();
    pkt::fix_ipv4_checksum(&mut p);
    p
}

#[test]
fn icmp_errors_quoting_translated_flows() {
    let mut s = steering();
    s.set_snat_range(SNAT.0, SNAT.1).unwrap();
    for e in [Endpoints::v4(), Endpoints::v6()] {
        let (router, client, node) = (e.router, e.client.ip(), e.node.ip());
        let p = Protocol::Udp;
        s.sync_local_addrs(&set([node])).unwrap();
        s.sync_endpoints(&set([key(e.backend, p)])).unwrap();
        s.sync_frontends(&set([key(e.vip, p)])).unwrap();

        // about a masqueraded flow: the quoted packet went node:61000 -> backend
        let masq = icmp_error(router, node, &e.masquerade(p));
        assert_eq!(classify(&s, &masq), Some(Rule::IcmpError));
        let outside = icmp_error(
            router,
            node,
            &tuple(port(e.node, 50000), port(e.backend, 9), p),
        );
        assert_eq!(
            classify(&s, &outside),
            None,
            "quoted sport outside the SNAT range"
        );
        // about a DNAT-only flow: client -> backend
        assert_eq!(
            classify(&s, &icmp_error(router, client, &e.dnat(p))),
            Some(Rule::IcmpError)
        );
        let other = tuple(e.client, port(e.backend, 9), p);
        assert_eq!(classify(&s, &icmp_error(router, client, &other)), None);
        // from a client, about a reply kxp sent from the VIP
        let about_reply = tuple(e.vip, e.client, p);
        let from_client = icmp_error(client, e.vip.ip(), &about_reply);
        assert_eq!(classify(&s, &from_client), Some(Rule::IcmpError));
        let wrong_proto = tuple(e.vip, e.client, Protocol::Tcp);
        assert_eq!(
            classify(&s, &icmp_error(client, e.vip.ip(), &wrong_proto)),
            None
        );

        // not an error type: v4 redirect (5) / v6 echo request (128); same quote
        let mut not_error = masq.clone();
        let off = l4_offset(&not_error);
        not_error[off] = if node.is_ipv4() { 5 } else { 128 };
        assert_eq!(classify(&s, &not_error), None);
        // the quote cut short of the ports
        let short = &masq[..masq.len() - 6];
        assert_eq!(classify(&s, short), None);
        assert_eq!(classify(&s, &eth_ip(&pkt::icmp_echo(router, node))), None);
    }
    // an IPv6 quote with extension headers is walked too
    let e = Endpoints::v6();
    let inner = pkt::insert_v6_ext(&quote(&e.masquerade(Protocol::Udp)), &[0, 60]);
    let f = eth_ip(&pkt::icmp_error(e.router, e.node.ip(), &inner));
    assert_eq!(classify(&s, &f), Some(Rule::IcmpError));
}

#[test]
fn only_first_fragments_carry_ports() {
    let mut s = steering();
    let e4 = Endpoints::v4();
    s.sync_frontends(&set([key(e4.vip, Protocol::Udp)]))
        .unwrap();
    let mut f = frame(&e4.original(Protocol::Udp));
    f[20..22].copy_from_slice(&0x2000u16.to_be_bytes()); // MF, offset 0
    assert_eq!(classify(&s, &f), Some(Rule::Frontend), "first fragment");
    f[20..22].copy_from_slice(&0x2010u16.to_be_bytes()); // MF, offset 128 bytes
    assert_eq!(classify(&s, &f), Some(Rule::Fragment), "its next fragment");
    // Another datagram's later fragments: what looks like ports there is payload.
    f[18..20].copy_from_slice(&0x0badu16.to_be_bytes()); // another id
    assert_eq!(classify(&s, &f), None, "non-first fragment");
    f[20..22].copy_from_slice(&0x0010u16.to_be_bytes()); // last fragment
    assert_eq!(classify(&s, &f), None, "last fragment");

    let e6 = Endpoints::v6();
    s.sync_frontends(&set([key(e6.vip, Protocol::Udp)]))
        .unwrap();
    let first = pkt::insert_v6_ext(&pkt::build(&e6, Protocol::Udp, b"x"), &[44]);
    assert_eq!(
        classify(&s, &eth_ip(&first)),
        Some(Rule::Frontend),
        "v6 first fragment"
    );
    let mut later = first.clone();
    later[42..44].copy_from_slice(&(16u16 << 3 | 1).to_be_bytes()); // offset 16, M
    assert_eq!(
        classify(&s, &eth_ip(&later)),
        Some(Rule::Fragment),
        "its v6 next fragment"
    );
    later[44..48].copy_from_slice(&0x0badu32.to_be_bytes()); // another identification
    assert_eq!(classify(&s, &eth_ip(&later)), None, "v6 non-first fragment");
}

#[test]
fn later_fragments_follow_a_first_fragment_that_was_taken() {
    // A NodePort's datagram in fragments: only the first carries the port, the others
    // follow it (they are not to a Service address nor from an endpoint).
    let mut s = steering();
    let e = Endpoints::v4();
    s.sync_frontends(&set([key(port(e.node, 30009), Protocol::Udp)]))
        .unwrap();
    let mut first = frame(&tuple(e.client, port(e.node, 30009), Protocol::Udp));
    first[14 + 4..14 + 6].copy_from_slice(&0x1234u16.to_be_bytes()); // id
    first[14 + 6..14 + 8].copy_from_slice(&0x2000u16.to_be_bytes()); // MF
    let first = eth_ip(&fixed_ipv4(&first[14..]));
    let mut later = first.clone();
    later[14 + 6..14 + 8].copy_from_slice(&0x0010u16.to_be_bytes()); // offset 128
    let later = eth_ip(&fixed_ipv4(&later[14..]));
    assert_eq!(classify(&s, &later), None, "no first fragment seen yet");
    assert_eq!(classify(&s, &first), Some(Rule::Frontend));
    assert_eq!(classify(&s, &later), Some(Rule::Fragment));
    let mut other = later.clone();
    other[14 + 4..14 + 6].copy_from_slice(&0x1235u16.to_be_bytes());
    let other = eth_ip(&fixed_ipv4(&other[14..]));
    assert_eq!(classify(&s, &other), None, "another datagram");
    // IPv6: the fragment header's identification.
    let e6 = Endpoints::v6();
    s.sync_frontends(&set([key(port(e6.node, 30009), Protocol::Udp)]))
        .unwrap();
    let first6 = pkt::insert_v6_ext(
        &pkt::build_tuple(&tuple(e6.client, port(e6.node, 30009), Protocol::Udp), b"x"),
        &[44],
    );
    let mut first6 = first6;
    first6[42..44].copy_from_slice(&1u16.to_be_bytes()); // offset 0, M
    assert_eq!(classify(&s, &eth_ip(&first6)), Some(Rule::Frontend));
    let mut later6 = first6.clone();
    later6[42..44].copy_from_slice(&(16u16 << 3).to_be_bytes()); // offset 16, last
    assert_eq!(classify(&s, &eth_ip(&later6)), Some(Rule::Fragment));
}

#[test]
fn ipv6_extension_headers_are_skipped_up_to_six() {
    let mut s = steering();
    let e = Endpoints::v6();
    s.sync_frontends(&set([key(e.vip, Protocol::Tcp)])).unwrap();
    let plain = pkt::build(&e, Protocol::Tcp, b"x");
    for kinds in [&[0u8][..], &[0, 43, 60], &[0, 60, 43, 44, 60], &[60; 6]] {
        let f = eth_ip(&pkt::insert_v6_ext(&plain, kinds));
        assert_eq!(classify(&s, &f), Some(Rule::Frontend), "{kinds:?}");
    }
    let seven = eth_ip(&pkt::insert_v6_ext(&plain, &[60; 7]));
    assert_eq!(classify(&s, &seven), None, "more than the program walks");
    // a header length pointing past the end of the frame
    let mut long = pkt::insert_v6_ext(&plain, &[60]);
    long[41] = 255;
    assert_eq!(classify(&s, &eth_ip(&long)), None);
    // no next header (59), and the frame cut inside an extension header
    let mut none = pkt::insert_v6_ext(&plain, &[60]);
    none[40] = 59;
    assert_eq!(classify(&s, &eth_ip(&none)), None);
    let cut = eth_ip(&pkt::insert_v6_ext(&plain, &[0, 60]));
    assert_eq!(classify(&s, &cut[..14 + 40 + 8 + 1]), None);
}

#[test]
fn ipv4_options_shift_the_ports_and_bad_headers_pass() {
    let mut s = steering();
    let e = Endpoints::v4();
    s.sync_frontends(&set([key(e.vip, Protocol::Udp)])).unwrap();
    let ip = pkt::build(&e, Protocol::Udp, b"x");
    // IHL 6: four bytes of options (NOP NOP NOP EOL) before the UDP header
    let mut with_opts = ip[..20].to_vec();
    with_opts.extend_from_slice(&[1, 1, 1, 0]);
    with_opts.extend_from_slice(&ip[20..]);
    with_opts[0] = 0x46;
    let total = u16::try_from(with_opts.len()).unwrap();
    with_opts[2..4].copy_from_slice(&total.to_be_bytes());
    assert_eq!(classify(&s, &eth_ip(&with_opts)), Some(Rule::Frontend));
    // the same bytes read with IHL 5 would take the options as ports
    let mut ihl4 = ip.clone();
    ihl4[0] = 0x44;
    assert_eq!(classify(&s, &eth_ip(&ihl4)), None, "IHL < 5");
    let mut v6_in_v4 = ip.clone();
    v6_in_v4[0] = 0x65;
    assert_eq!(
        classify(&s, &eth(ETH_IPV4, &v6_in_v4)),
        None,
        "version 6 under 0x0800"
    );
}

#[test]
fn vlan_tagged_frames_only_when_enabled() {
    let mut s = steering();
    let e = Endpoints::v4();
    s.sync_frontends(&set([key(e.vip, Protocol::Tcp)])).unwrap();
    let ip = pkt::build(&e, Protocol::Tcp, b"x");
    let tagged = eth_vlan(ETH_8021Q, &ip);
    assert_eq!(classify(&s, &tagged), None, "off by default");
    s.set_vlan_steering(true).unwrap();
    assert_eq!(classify(&s, &tagged), Some(Rule::Frontend));
    assert_eq!(
        classify(&s, &eth_vlan(ETH_8021AD, &ip)),
        Some(Rule::Frontend)
    );
    let e6 = Endpoints::v6();
    s.sync_frontends(&set([key(e6.vip, Protocol::Tcp)]))
        .unwrap();
    let ip6 = pkt::build(&e6, Protocol::Tcp, b"x");
    assert_eq!(
        classify(&s, &eth_vlan(ETH_8021Q, &ip6)),
        Some(Rule::Frontend)
    );
    // two tags (QinQ): not looked into
    let mut qinq = eth_vlan(ETH_8021Q, &ip6);
    qinq.splice(12..12, [0x88, 0xa8, 0, 200]);
    assert_eq!(classify(&s, &qinq), None);
    // the snat range set later keeps the flag
    s.set_snat_range(SNAT.0, SNAT.1).unwrap();
    assert_eq!(
        classify(&s, &eth_vlan(ETH_8021Q, &ip6)),
        Some(Rule::Frontend)
    );
    s.set_vlan_steering(false).unwrap();
    assert_eq!(classify(&s, &eth_vlan(ETH_8021Q, &ip6)), None);
}

/// A packet from an interface with no slot (the program reaches a bond's ports when it
/// is on the bond) is passed, never taken as another interface's: loopback alone (the
/// test runs) stands for the first handle.
#[test]
fn a_packet_from_an_interface_without_a_slot_is_passed_as_nobodys() {
    let mut s = steering();
    let e = Endpoints::v4();
    s.sync_frontends(&set([key(e.vip, Protocol::Tcp)])).unwrap();
    let frame = eth_ip(&pkt::build(&e, Protocol::Tcp, b"x"));
    assert_eq!(classify(&s, &frame), Some(Rule::Frontend), "from loopback");
    let mut topo = lab::Topology::new("kxqs");
    let ns = topo.add_ns_unique("p").unwrap();
    let peer = topo.add_ns_unique("q").unwrap();
    topo.link((&ns, "kxport", ""), (&peer, "kxpeer", ""))
        .unwrap();
    let ifindex = topo.ifindex(&ns, "kxport").unwrap();
    let before = s.stats().unwrap();
    let action = topo
        .run_in(&ns, || s.test_run_on(&frame, ifindex).unwrap())
        .unwrap();
    let d = s.stats().unwrap().since(&before);
    assert_eq!(action, XDP_PASS);
    assert_eq!(
        (d.seen, d.frontend, d.no_socket, d.passed),
        (0, 0, 0, 0),
        "not counted as the handle's interface: {d:?}"
    );
}

#[test]
fn other_traffic_passes() {
    let mut s = steering();
    let e = Endpoints::v4();
    s.sync_frontends(&set([key(e.vip, Protocol::Udp)])).unwrap();
    s.sync_local_addrs(&set([e.vip.ip()])).unwrap();
    s.set_snat_range(1, 65535).unwrap();
    // ARP for the VIP
    let mut arp = vec![0, 1, 8, 0, 6, 4, 0, 1, 2, 0, 0, 0, 0, 1, 198, 18, 0, 1];
    arp.extend_from_slice(&[0; 6]);
    arp.extend_from_slice(&[198, 19, 0, 10]);
    assert_eq!(classify(&s, &eth(ETH_ARP, &arp)), None);
    // GRE (47) to a node address, LLDP, and a bare Ethernet header
    let mut gre = pkt::build(&e, Protocol::Udp, b"x");
    gre[9] = 47;
    assert_eq!(classify(&s, &eth_ip(&gre)), None);
    assert_eq!(classify(&s, &eth(0x88cc, &[0; 46])), None);
    assert_eq!(classify(&s, &eth(ETH_IPV4, &[])), None);
}

#[test]
fn truncated_frames_pass_without_reading_past_the_end() {
    let mut s = steering();
    for e in [Endpoints::v4(), Endpoints::v6()] {
        s.sync_frontends(&set([key(e.vip, Protocol::Udp)])).unwrap();
        let f = frame(&e.original(Protocol::Udp));
        let ports_end = l4_offset(&f) + 4;
        for len in 14..f.len() {
            let want = (len >= ports_end).then_some(Rule::Frontend);
            assert_eq!(classify(&s, &f[..len]), want, "{len} bytes of {}", f.len());
        }
    }
    let err = s.test_run(&[0u8; 13]).unwrap_err();
    assert!(
        matches!(err, XdpError::TestRunFrameSize { len: 13 }),
        "{err}"
    );
}

#[test]
fn cluster_ips_are_steered_on_every_port_but_pings_pass() {
    let mut s = steering();
    s.set_snat_range(SNAT.0, SNAT.1).unwrap();
    for e in [Endpoints::v4(), Endpoints::v6()] {
        s.sync_frontends(&set([key(e.vip, Protocol::Tcp)])).unwrap();
        s.sync_endpoints(&set([key(e.backend, Protocol::Tcp)]))
            .unwrap();
        s.sync_cluster_ips(&set([e.vip.ip()])).unwrap();
        // the frontend itself is still rule (a): (e) only catches what (a)-(c) leave
        assert_eq!(
            classify(&s, &frame(&e.original(Protocol::Tcp))),
            Some(Rule::Frontend)
        );
        for p in PROTOS {
            for dport in [81, 1, 65535] {
                let t = tuple(e.client, port(e.vip, dport), p);
                assert_eq!(classify(&s, &frame(&t)), Some(Rule::ClusterIp), "{p} {t}");
            }
            // the ClusterIP as source, and another address of the same range
            assert_eq!(classify(&s, &frame(&tuple(e.vip, e.client, p))), None);
            let other = SocketAddr::new(e.router, 81);
            assert_eq!(classify(&s, &frame(&tuple(e.client, other, p))), None);
        }
        // replies from an endpoint stay rule (c)
        let reply = tuple(e.backend, e.client, Protocol::Tcp);
        assert_eq!(classify(&s, &frame(&reply)), Some(Rule::DnatReply));
        // ping and other protocols to the ClusterIP are the kernel's
        let ping = pkt::icmp_echo(e.client.ip(), e.vip.ip());
        assert_eq!(classify(&s, &eth_ip(&ping)), None, "ping {e:?}");
        if e.vip.is_ipv4() {
            let mut gre = pkt::build_tuple(&tuple(e.client, port(e.vip, 81), Protocol::Udp), b"x");
            gre[9] = 47;
            assert_eq!(classify(&s, &eth_ip(&gre)), None, "GRE");
        }
        // gone from the set: passed again (the frontend stays)
        s.sync_cluster_ips(&HashSet::new()).unwrap();
        let t = tuple(e.client, port(e.vip, 81), Protocol::Udp);
        assert_eq!(classify(&s, &frame(&t)), None);
        assert_eq!(
            classify(&s, &frame(&e.original(Protocol::Tcp))),
            Some(Rule::Frontend)
        );
    }
    // v4-mapped IPv6 is the IPv4 address
    let e = Endpoints::v4();
    let mapped: IpAddr = "::ffff:198.19.0.10".parse().unwrap();
    s.sync_cluster_ips(&set([mapped, e.vip.ip()])).unwrap();
    assert_eq!(s.sets().cluster_ips.map().keys().count(), 1);
    let t = tuple(e.client, port(e.vip, 81), Protocol::Tcp);
    assert_eq!(classify(&s, &frame(&t)), Some(Rule::ClusterIp));
}

#[test]
fn service_cidrs_steer_unallocated_addresses_of_their_family_only() {
    let mut s = steering();
    s.sync_service_cidrs(&set([net("198.19.0.0/16"), net("2001:db8:ffff::/112")]))
        .unwrap();
    let v4 = sock("198.18.0.1:40000");
    let v6 = sock("[2001:db8::1]:40000");
    for (client, dst, want) in [
        (v4, "198.19.0.99:80", true),
        (v4, "198.19.0.0:80", true),
        (v4, "198.19.255.255:53", true),
        (v4, "198.18.255.255:80", false),
        (v4, "198.20.0.0:80", false),
        (v4, "10.0.0.1:80", false),
        (v6, "[2001:db8:ffff::99]:80", true),
        (v6, "[2001:db8:ffff::ffff]:80", true),
        (v6, "[2001:db8:ffff::1:0]:80", false),
        (v6, "[2001:db8:fffe::99]:80", false),
    ] {
        for p in PROTOS {
            let t = tuple(client, sock(dst), p);
            let got = classify(&s, &frame(&t));
            assert_eq!(got, want.then_some(Rule::ClusterIp), "{p} to {dst}");
        }
    }
    // pings into the range pass
    for dst in ["198.19.0.99", "2001:db8:ffff::99"] {
        let dst: IpAddr = dst.parse().unwrap();
        let src = if dst.is_ipv4() { v4.ip() } else { v6.ip() };
        let ping = eth_ip(&pkt::icmp_echo(src, dst));
        assert_eq!(classify(&s, &ping), None, "ping {dst}");
    }
    // IPv4 /0 covers every IPv4 address and no IPv6 one; exact /32 and /128
    s.sync_service_cidrs(&set([net("0.0.0.0/0"), net("2001:db8:ffff::7/128")]))
        .unwrap();
    for (client, dst, want) in [
        (v4, "203.0.113.9:443", true),
        (v6, "[2001:db8:5::1]:443", false),
        (v6, "[2001:db8:ffff::7]:443", true),
        (v6, "[2001:db8:ffff::8]:443", false),
    ] {
        let t = tuple(client, sock(dst), Protocol::Tcp);
        assert_eq!(
            classify(&s, &frame(&t)),
            want.then_some(Rule::ClusterIp),
            "{dst}"
        );
    }
    s.sync_service_cidrs(&set([net("198.19.0.10/32")])).unwrap();
    let t = |dst| tuple(v4, sock(dst), Protocol::Udp);
    assert_eq!(
        classify(&s, &frame(&t("198.19.0.10:9"))),
        Some(Rule::ClusterIp)
    );
    assert_eq!(classify(&s, &frame(&t("198.19.0.11:9"))), None);
}

#[test]
fn service_cidrs_are_looked_up_first_inside_their_cover_only() {
    let mut s = steering();
    let v4 = sock("198.18.0.1:40000");
    let v6 = sock("[2001:db8::1]:40000");
    let to = |client, dst: &str| frame(&tuple(client, sock(dst), Protocol::Tcp));
    // Before kxp writes a cover (all zero): every address is looked up.
    s.sets()
        .service_cidrs
        .sync(&set([net("203.0.113.0/24")]))
        .unwrap();
    assert_eq!(
        classify(&s, &to(v4, "203.0.113.5:80")),
        Some(Rule::ClusterIp)
    );
    // A frontend inside a Service CIDR counts under (e), one outside under (a).
    s.sync_frontends(&set([
        key(sock("198.19.0.10:80"), Protocol::Tcp),
        key(sock("198.18.0.2:30080"), Protocol::Tcp),
    ]))
    .unwrap();
    s.sync_service_cidrs(&set([net("198.19.0.0/16")])).unwrap();
    assert_eq!(
        classify(&s, &to(v4, "198.19.0.10:80")),
        Some(Rule::ClusterIp)
    );
    assert_eq!(
        classify(&s, &to(v4, "198.18.0.2:30080")),
        Some(Rule::Frontend)
    );
    assert_eq!(
        classify(&s, &to(v4, "203.0.113.5:80")),
        None,
        "CIDR removed"
    );
    // Far-apart CIDRs: the cover is wide, the trie still decides; each family its own.
    s.sync_service_cidrs(&set([
        net("10.96.0.0/12"),
        net("198.19.0.0/16"),
        net("fd00:10:96::/112"),
        net("2001:db8:ffff::/112"),
    ]))
    .unwrap();
    for (client, dst, want) in [
        (v4, "10.96.0.1:443", true),
        (v4, "10.111.255.255:443", true),
        (v4, "10.112.0.0:443", false),
        (v4, "100.64.0.1:443", false),
        (v4, "198.19.200.1:443", true),
        (v6, "[fd00:10:96::a]:443", true),
        (v6, "[2001:db8:ffff::a]:443", true),
        (v6, "[2001:db8:fffe::a]:443", false),
        (v6, "[fd00:10:97::a]:443", false),
    ] {
        assert_eq!(
            classify(&s, &to(client, dst)),
            want.then_some(Rule::ClusterIp),
            "{dst}"
        );
    }
    // No IPv6 CIDR left: IPv6 destinations are not looked up, IPv4 ones still are.
    s.sync_service_cidrs(&set([net("10.96.0.0/12")])).unwrap();
    assert_eq!(classify(&s, &to(v6, "[fd00:10:96::a]:443")), None);
    assert_eq!(
        classify(&s, &to(v4, "10.96.0.1:443")),
        Some(Rule::ClusterIp)
    );
    assert_eq!(classify(&s, &to(v4, "198.19.200.1:443")), None);
    s.sync_service_cidrs(&HashSet::new()).unwrap();
    assert_eq!(classify(&s, &to(v4, "10.96.0.1:443")), None);
}

#[test]
fn cidr_covers_are_the_smallest_common_prefix_per_family() {
    let covers = |nets: &[&str]| {
        let nets: Vec<IpNet> = nets.iter().map(|n| net(n)).collect();
        let (v4, v6) = super::key::covers(&nets);
        (v4.map(|n| n.to_string()), v6.map(|n| n.to_string()))
    };
    let s = |x: &str| Some(x.to_string());
    assert_eq!(covers(&[]), (None, None));
    assert_eq!(covers(&["198.19.0.0/16"]), (s("198.19.0.0/16"), None));
    assert_eq!(
        covers(&["198.19.0.0/16", "198.19.5.0/24"]),
        (s("198.19.0.0/16"), None)
    );
    assert_eq!(
        covers(&["198.19.0.0/16", "198.18.0.0/16"]),
        (s("198.18.0.0/15"), None)
    );
    assert_eq!(
        covers(&["10.96.0.0/12", "198.19.0.0/16"]),
        (s("0.0.0.0/0"), None)
    );
    assert_eq!(
        covers(&["10.96.0.1/12"]),
        (s("10.96.0.0/12"), None),
        "host bits"
    );
    assert_eq!(
        covers(&[
            "2001:db8:ffff::/112",
            "2001:db8:fffe::/112",
            "198.19.0.0/16"
        ]),
        (s("198.19.0.0/16"), s("2001:db8:fffe::/47"))
    );
}

#[test]
fn cluster_ip_and_service_cidr_sync_is_incremental_and_canonical() {
    let mut s = steering();
    let v4 = sock("198.18.0.1:40000");
    let to = |dst: &str| frame(&tuple(v4, sock(dst), Protocol::Tcp));

    // service_cidrs: nested prefixes, host bits, v4-mapped, the key layout
    let st = s
        .sync_service_cidrs(&set([
            net("198.19.0.0/16"),
            net("198.19.5.0/24"),
            net("2001:db8:ffff::/112"),
        ]))
        .unwrap();
    assert_eq!(
        st,
        SyncStats {
            added: 3,
            removed: 0,
            unchanged: 0
        }
    );
    let st = s
        .sync_service_cidrs(&set([
            net("198.19.0.1/16"),         // host bits: the same prefix
            net("::ffff:198.19.5.0/120"), // v4-mapped: 198.19.5.0/24
            net("2001:db8:ffff::/112"),
        ]))
        .unwrap();
    assert_eq!(
        st,
        SyncStats {
            added: 0,
            removed: 0,
            unchanged: 3
        }
    );
    let mut want_key = [0u8; 20];
    want_key[..4].copy_from_slice(&(16u32 + 96).to_ne_bytes());
    want_key[14..18].copy_from_slice(&[0xff, 0xff, 198, 19]);
    let in_kernel: HashSet<Vec<u8>> = s.sets().service_cidrs.map().keys().collect();
    assert_eq!(in_kernel.len(), 3);
    assert!(in_kernel.contains(&want_key[..]), "{in_kernel:?}");

    // the /16 goes: the /24 inside it still matches, the rest of the /16 no more
    let st = s
        .sync_service_cidrs(&set([net("198.19.5.0/24"), net("2001:db8:ffff::/112")]))
        .unwrap();
    assert_eq!(
        st,
        SyncStats {
            added: 0,
            removed: 1,
            unchanged: 2
        }
    );
    assert_eq!(classify(&s, &to("198.19.5.1:80")), Some(Rule::ClusterIp));
    assert_eq!(classify(&s, &to("198.19.6.1:80")), None);

    let too_many = set((0..=MAX_SERVICE_CIDRS as u32)
        .map(|i| IpNet::new(IpAddr::from((0x0a00_0000 + (i << 8)).to_be_bytes()), 24).unwrap()));
    let err = s.sync_service_cidrs(&too_many).unwrap_err();
    assert!(
        matches!(
            err,
            XdpError::MapFull {
                map: "service_cidrs",
                capacity: 256,
                wanted: 257
            }
        ),
        "{err}"
    );
    assert_eq!(
        s.sets().service_cidrs.map().keys().count(),
        2,
        "nothing touched"
    );
    let exactly = set(too_many.into_iter().take(MAX_SERVICE_CIDRS));
    let st = s.sync_service_cidrs(&exactly).unwrap();
    assert_eq!((st.added, st.removed), (256, 2));
    assert_eq!(classify(&s, &to("10.0.7.7:80")), Some(Rule::ClusterIp));
    assert_eq!(classify(&s, &to("198.19.5.1:80")), None);
    assert_eq!(s.sync_service_cidrs(&HashSet::new()).unwrap().removed, 256);
    assert_eq!(s.sets().service_cidrs.map().keys().count(), 0);
    assert_eq!(classify(&s, &to("10.0.7.7:80")), None);

    // cluster_ips: only the difference
    let ips: Vec<IpAddr> = (1..=3u8).map(|i| IpAddr::from([198, 19, 0, i])).collect();
    assert_eq!(s.sync_cluster_ips(&set(ips.clone())).unwrap().added, 3);
    let st = s
        .sync_cluster_ips(&set([ips[0], ips[1], "2001:db8:ffff::10".parse().unwrap()]))
        .unwrap();
    assert_eq!(
        st,
        SyncStats {
            added: 1,
            removed: 1,
            unchanged: 2
        }
    );
    assert_eq!(s.sets().cluster_ips.map().keys().count(), 3);
    assert_eq!(classify(&s, &to("198.19.0.2:8080")), Some(Rule::ClusterIp));
    assert_eq!(classify(&s, &to("198.19.0.3:8080")), None);
    assert_eq!(
        s.sets().cluster_ips.map().max_entries(),
        super::sync::INITIAL_SET
    );
    assert_eq!(
        s.sets().service_cidrs.map().max_entries() as usize,
        MAX_SERVICE_CIDRS
    );
}

#[test]
fn sync_touches_only_the_difference() {
    let mut s = steering();
    let keys: Vec<SteerKey> = (0..1000u16)
        .map(|i| {
            let addr = IpAddr::from([198, 19, (i >> 8) as u8, i as u8]);
            SteerKey::new(addr, 80, Protocol::Tcp)
        })
        .collect();
    let mut want = set(keys.iter().copied());
    let st = s.sync_frontends(&want).unwrap();
    assert_eq!(
        st,
        SyncStats {
            added: 1000,
            removed: 0,
            unchanged: 0
        }
    );
    assert_eq!(
        s.sync_frontends(&want).unwrap(),
        SyncStats {
            added: 0,
            removed: 0,
            unchanged: 1000
        }
    );

    let gone = keys[17];
    let new = SteerKey::new("198.19.200.1".parse().unwrap(), 443, Protocol::Tcp);
    want.remove(&gone);
    want.insert(new);
    let st = s.sync_frontends(&want).unwrap();
    assert_eq!(
        st,
        SyncStats {
            added: 1,
            removed: 1,
            unchanged: 999
        }
    );
    let in_kernel: HashSet<Vec<u8>> = s.sets().frontends.map().keys().collect();
    assert_eq!(
        in_kernel,
        want.iter().map(|k| k.to_bytes().to_vec()).collect()
    );

    // The incremental form: only the named keys, present ones left alone.
    let other = SteerKey::new("198.19.200.2".parse().unwrap(), 443, Protocol::Tcp);
    let st = s.change_frontends(&[other, new], &[new, keys[3]]).unwrap();
    assert_eq!((st.added, st.removed, st.unchanged), (2, 2, 998));
    let in_kernel: HashSet<Vec<u8>> = s.sets().frontends.map().keys().collect();
    assert!(in_kernel.contains(other.to_bytes().as_slice()));
    assert!(in_kernel.contains(new.to_bytes().as_slice()));
    assert!(!in_kernel.contains(keys[3].to_bytes().as_slice()));
    s.change_frontends(&[keys[3]], &[other]).unwrap();
    let in_kernel: HashSet<Vec<u8>> = s.sets().frontends.map().keys().collect();
    assert_eq!(
        in_kernel,
        want.iter().map(|k| k.to_bytes().to_vec()).collect()
    );

    let to = to_key;
    assert_eq!(classify(&s, &to(gone)), None);
    assert_eq!(classify(&s, &to(new)), Some(Rule::Frontend));

    let st = s.sync_frontends(&HashSet::new()).unwrap();
    assert_eq!(
        st,
        SyncStats {
            added: 0,
            removed: 1000,
            unchanged: 0
        }
    );
    assert_eq!(s.sets().frontends.map().keys().count(), 0);
}

#[test]
fn local_addrs_are_canonical_and_capacity_is_checked_first() {
    let mut s = steering();
    let v4: IpAddr = "198.18.0.254".parse().unwrap();
    let mapped: IpAddr = "::ffff:198.18.0.254".parse().unwrap();
    let st = s.sync_local_addrs(&set([v4, mapped])).unwrap();
    assert_eq!(st.added, 1);
    assert_eq!(s.sync_local_addrs(&set([mapped])).unwrap().unchanged, 1);

    let too_many =
        set((0..=MAX_LOCAL_ADDRS as u32).map(|i| IpAddr::from((0xC612_0000 + i).to_be_bytes())));
    let err = s.sync_local_addrs(&too_many).unwrap_err();
    assert!(
        matches!(
            err,
            XdpError::MapFull {
                map: "local_addrs",
                capacity: 1024,
                wanted: 1025
            }
        ),
        "{err}"
    );
    assert_eq!(
        s.sets().local_addrs.map().keys().count(),
        1,
        "nothing touched"
    );

    assert_eq!(
        s.sets().local_addrs.map().max_entries() as usize,
        MAX_LOCAL_ADDRS
    );
    assert_eq!(s.program.xsks.max_entries(), MAX_QUEUES * MAX_SLOTS);
    assert!(s.sync_endpoints(&HashSet::new()).is_ok());
}

#[test]
fn bad_arguments_are_errors_that_say_what_to_do() {
    let s = steering();
    for (lo, hi) in [(0, 10), (2000, 1000)] {
        let err = s.set_snat_range(lo, hi).unwrap_err();
        assert!(err.to_string().contains("need 1 <= lo <= hi"), "{err}");
    }
    let err = s.set_socket(MAX_QUEUES, 3).unwrap_err();
    assert!(
        matches!(
            err,
            XdpError::QueueOutOfRange {
                queue: 256,
                capacity: 256
            }
        ),
        "{err}"
    );
    assert!(matches!(
        s.set_socket(0, -1).unwrap_err(),
        XdpError::BadSocketFd { fd: -1 }
    ));
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let err = s
        .set_socket(0, std::os::fd::AsRawFd::as_raw_fd(&udp))
        .unwrap_err();
    assert!(
        matches!(err, XdpError::Map { map: "xsks", .. }),
        "not an AF_XDP socket: {err}"
    );
    s.clear_socket(0).unwrap(); // nothing there: fine
    assert_eq!(s.ifindex(), 0);
    assert_eq!(s.attached_as().unwrap(), None);

    let err = Steering::load_and_attach("no/such", AttachMode::Link).unwrap_err();
    assert!(
        matches!(err, XdpError::InvalidInterfaceName { .. }),
        "{err}"
    );
    let err = Steering::load_and_attach("kxp-missing0", AttachMode::Link).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("interface kxp-missing0 not found"),
        "{err}"
    );
    let err = cleanup_interface("kxp-missing0").unwrap_err();
    assert!(matches!(err, XdpError::InterfaceNotFound { .. }), "{err}");
    s.detach().unwrap(); // not attached: no-op
}

#[test]
fn held_packets_are_dropped_on_served_queues_and_other_traffic_still_passes() {
    let mut s = steering();
    let e = Endpoints::v4();
    s.sync_frontends(&set([key(e.vip, Protocol::Tcp)])).unwrap();
    let to_vip = frame(&e.original(Protocol::Tcp));
    let ping = eth_ip(&pkt::icmp_echo(e.client.ip(), e.vip.ip()));
    // Not held: fail-open, as when kxp runs without a state directory.
    assert_eq!(s.test_run(&to_vip).unwrap(), XDP_PASS);
    // Held on queue 0 (the test run's): kxp's packet waits for the next kxp.
    s.set_hold(1).unwrap();
    let before = s.stats().unwrap();
    assert_eq!(s.test_run(&to_vip).unwrap(), XDP_DROP);
    let d = s.stats().unwrap().since(&before);
    assert_eq!((d.frontend, d.no_socket), (1, 1), "{d:?}");
    assert_eq!(
        s.test_run(&ping).unwrap(),
        XDP_PASS,
        "not kxp's: the kernel's"
    );
    // Held on no queue (a queue kxp does not serve): the kernel's path stays.
    s.set_hold(0).unwrap();
    assert_eq!(s.test_run(&to_vip).unwrap(), XDP_PASS);
}

#[test]
fn the_growing_sets_grow_past_any_size_keeping_every_key() {
    // frontends, endpoints and cluster_ips start at INITIAL_SET entries and have no
    // ceiling: past it, a map twice the size needed is filled and swapped in.
    let mut s = steering();
    let initial = super::sync::INITIAL_SET as usize;
    let key = |i: u32| {
        SteerKey::new(
            IpAddr::from((0xC613_0000 + i).to_be_bytes()),
            80,
            Protocol::Tcp,
        )
    };
    let first: HashSet<SteerKey> = (0..initial as u32).map(key).collect();
    assert_eq!(s.sync_frontends(&first).unwrap().added, initial);
    assert_eq!(s.sets().frontends.fill(), (initial, initial));

    // One more than it holds: grown (to twice what is needed), every key in, the
    // difference counted as usual.
    let more: HashSet<SteerKey> = (0..=initial as u32).map(key).collect();
    let st = s.sync_frontends(&more).unwrap();
    assert_eq!((st.added, st.removed, st.unchanged), (1, 0, initial));
    let (keys, size) = s.sets().frontends.fill();
    assert_eq!(
        (keys, size),
        (initial + 1, (2 * (initial + 1)).next_power_of_two())
    );
    assert_eq!(s.sets().frontends.map().keys().count(), initial + 1);
    let to = to_key;
    assert_eq!(classify(&s, &to(key(initial as u32))), Some(Rule::Frontend));
    assert_eq!(classify(&s, &to(key(0))), Some(Rule::Frontend));
    assert_eq!(classify(&s, &to(key(initial as u32 + 1))), None);

    // A change past the size grows it too; 100,000 keys (the old ceiling was 262,144
    // for all of them together) in one call.
    let add: Vec<SteerKey> = (0..100_000u32).map(|i| key(100_000 + i)).collect();
    let st = s.change_frontends(&add, &[key(1)]).unwrap();
    assert_eq!((st.added, st.removed), (100_000, 1));
    assert_eq!(s.sets().frontends.fill().0, initial + 100_000);
    assert!(s.sets().frontends.fill().1 >= 2 * (initial + 100_000));
    // Every key in the kernel's map (filled from a thread per CPU at this size).
    assert_eq!(s.sets().frontends.map().keys().count(), initial + 100_000);
    assert_eq!(classify(&s, &to(key(199_999))), Some(Rule::Frontend));
    assert_eq!(classify(&s, &to(key(1))), None);

    // ClusterIPs and endpoints grow the same way.
    let ips: HashSet<IpAddr> = (0..70_000u32)
        .map(|i| IpAddr::from((0xC613_0000 + i).to_be_bytes()))
        .collect();
    assert_eq!(s.sync_cluster_ips(&ips).unwrap().added, 70_000);
    assert_eq!(classify(&s, &to(key(69_999))), Some(Rule::ClusterIp));
    let eps: HashSet<SteerKey> = (0..10_000u32).map(|i| key(500_000 + i)).collect();
    assert_eq!(s.sync_endpoints(&eps).unwrap().added, 10_000);
    assert_eq!(s.sets().endpoints.fill().0, 10_000);
}
