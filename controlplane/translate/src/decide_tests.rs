//! Decision tests, one per kube-proxy rule, on real Kubernetes objects written as YAML.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;

use crate::k8s::{ClusterState, DetectLocalMode, NodeSettings};
use crate::tracker::build;
use nat::decide::{Decision, DropReason, NewPacket, Policy, RejectReason, decide};
use nat::snapshot::{FrontendKind, Snapshot};
use nat::tuple::Protocol;

/// Parses `---`-separated objects into a cluster state.
fn state(yaml: &str) -> ClusterState {
    let mut s = ClusterState::default();
    for doc in yaml.split("\n---\n") {
        let v: serde_yaml::Value = serde_yaml::from_str(doc).unwrap();
        match v.get("kind").and_then(|k| k.as_str()).unwrap() {
            "Service" => s
                .services
                .push(serde_yaml::from_value::<Service>(v).unwrap()),
            "EndpointSlice" => s
                .endpoint_slices
                .push(serde_yaml::from_value::<EndpointSlice>(v).unwrap()),
            "Node" => s.nodes.push(serde_yaml::from_value::<Node>(v).unwrap()),
            "ServiceCIDR" => s
                .service_cidrs
                .push(serde_yaml::from_value::<ServiceCIDR>(v).unwrap()),
            k => panic!("kind {k}"),
        }
    }
    s
}

fn settings() -> NodeSettings {
    NodeSettings {
        node_name: "node-a".into(),
        node_ips: vec![
            "192.0.2.10".parse().unwrap(),
            "2001:db8::10".parse().unwrap(),
        ],
        cluster_cidrs: vec![
            "10.0.0.0/8".parse().unwrap(),
            "fd00:10::/64".parse().unwrap(),
        ],
        ..Default::default()
    }
}

fn snap(yaml: &str, s: &NodeSettings) -> Snapshot {
    build(&state(yaml), s, 1).unwrap().snapshot
}

/// What a trace reports: verdict, sorted endpoints, masquerade (incl. hairpin).
#[derive(Debug, PartialEq)]
enum V {
    Dnat(Vec<String>, bool),
    Reject(RejectReason),
    Drop(DropReason),
    Pass,
}

fn go(s: &Snapshot, src: &str, dst: &str, port: u16, proto: Protocol) -> V {
    let src: IpAddr = src.parse().unwrap();
    let pkt = NewPacket {
        src,
        dst: dst.parse().unwrap(),
        dport: port,
        proto,
        in_interface: None,
    };
    match decide(s, &pkt) {
        Decision::Pass => V::Pass,
        Decision::Drop { reason, .. } => V::Drop(reason),
        Decision::Reject { reason, .. } => V::Reject(reason),
        Decision::Forward(f) => {
            let mut eps: Vec<String> = f.candidate_endpoints().map(|e| e.key()).collect();
            eps.sort();
            let masq = f.masquerade || f.candidate_endpoints().any(|e| e.addr.ip() == src);
            V::Dnat(eps, masq)
        }
    }
}

fn tcp(s: &Snapshot, src: &str, dst: &str, port: u16) -> V {
    go(s, src, dst, port, Protocol::Tcp)
}

fn dnat(eps: &[&str], masq: bool) -> V {
    V::Dnat(eps.iter().map(|s| s.to_string()).collect(), masq)
}

const WEB: &str = r#"apiVersion: v1
kind: Service
metadata: {name: web, namespace: ns}
spec:
  clusterIP: 172.30.0.10
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: ns, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.1.0.1], nodeName: node-a}
- {addresses: [10.2.0.1], nodeName: node-b}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-2, namespace: ns, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.3.0.1], nodeName: node-c}
---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {name: kubernetes}
spec: {cidrs: [172.30.0.0/16, "fd00:30::/112"]}"#;

const WEB_EPS: [&str; 3] = ["10.1.0.1:8080", "10.2.0.1:8080", "10.3.0.1:8080"];

#[test]
fn cluster_ip_spreads_over_every_slice() {
    let s = snap(WEB, &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        dnat(&WEB_EPS, false)
    );
}

#[test]
fn cluster_ip_masquerades_sources_outside_the_cluster_cidr() {
    let s = snap(WEB, &settings());
    assert_eq!(
        tcp(&s, "203.0.113.1", "172.30.0.10", 80),
        dnat(&WEB_EPS, true)
    );
    // Without a cluster CIDR there is no detector: no masquerade.
    let mut st = settings();
    st.cluster_cidrs.clear();
    let s = snap(WEB, &st);
    assert_eq!(
        tcp(&s, "203.0.113.1", "172.30.0.10", 80),
        dnat(&WEB_EPS, false)
    );
}

#[test]
fn masquerade_all_masquerades_pod_traffic_too() {
    let mut st = settings();
    st.masquerade_all = true;
    let s = snap(WEB, &st);
    assert_eq!(tcp(&s, "10.9.0.1", "172.30.0.10", 80), dnat(&WEB_EPS, true));
}

#[test]
fn hairpin_masquerades() {
    let s = snap(WEB, &settings());
    assert_eq!(tcp(&s, "10.2.0.1", "172.30.0.10", 80), dnat(&WEB_EPS, true));
}

#[test]
fn cluster_ip_wrong_port_or_protocol_rejects_and_unallocated_drops() {
    let s = snap(WEB, &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 81),
        V::Reject(RejectReason::ClusterIpPort)
    );
    assert_eq!(
        go(&s, "10.9.0.1", "172.30.0.10", 80, Protocol::Udp),
        V::Reject(RejectReason::ClusterIpPort)
    );
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.9.9", 80),
        V::Drop(DropReason::UnallocatedServiceIp)
    );
    assert_eq!(tcp(&s, "10.9.0.1", "198.51.100.1", 80), V::Pass);
}

#[test]
fn no_endpoints_rejects() {
    let yaml = r#"apiVersion: v1
kind: Service
metadata: {name: empty, namespace: ns}
spec:
  type: LoadBalancer
  clusterIP: 172.30.0.11
  externalIPs: [192.0.2.200]
  ports: [{port: 80, nodePort: 30011}]
status:
  loadBalancer: {ingress: [{ip: 198.51.100.11}]}"#;
    let s = snap(yaml, &settings());
    let r = V::Reject(RejectReason::NoEndpoints);
    assert_eq!(tcp(&s, "10.9.0.1", "172.30.0.11", 80), r);
    assert_eq!(tcp(&s, "203.0.113.1", "192.0.2.200", 80), r);
    assert_eq!(tcp(&s, "203.0.113.1", "198.51.100.11", 80), r);
    assert_eq!(tcp(&s, "203.0.113.1", "192.0.2.10", 30011), r);
}

#[test]
fn unready_endpoints_do_not_count_but_terminating_serving_ones_are_a_fallback() {
    let yaml = r#"apiVersion: v1
kind: Service
metadata: {name: t, namespace: ns}
spec: {clusterIP: 172.30.0.12, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: t-1, namespace: ns, labels: {kubernetes.io/service-name: t}}
addressType: IPv4
ports: [{name: "", port: 80}]
endpoints:
- {addresses: [10.1.0.1], conditions: {ready: false, serving: false, terminating: false}}
- {addresses: [10.1.0.2], conditions: {ready: false, serving: true, terminating: true}}
- {addresses: [10.1.0.3], conditions: {ready: false, serving: false, terminating: true}}"#;
    let s = snap(yaml, &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.12", 80),
        dnat(&["10.1.0.2:80"], false)
    );
    let only_unready = yaml.replace(
        "serving: true, terminating: true",
        "serving: false, terminating: true",
    );
    let s = snap(&only_unready, &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.12", 80),
        V::Reject(RejectReason::NoEndpoints)
    );
}

#[test]
fn internal_traffic_policy_local() {
    let yaml = WEB.replace(
        "  clusterIP: 172.30.0.10\n",
        "  clusterIP: 172.30.0.10\n  internalTrafficPolicy: Local\n",
    );
    let s = snap(&yaml, &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        dnat(&["10.1.0.1:8080"], false)
    );
    let mut st = settings();
    st.node_name = "node-z".into();
    let s = snap(&yaml, &st);
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        V::Drop(DropReason::NoLocalEndpointsInternal)
    );
}

fn etp_local() -> String {
    WEB.replace(
        "  clusterIP: 172.30.0.10\n  ports: [{name: http, port: 80, targetPort: 8080}]\n",
        "  type: LoadBalancer\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n  clusterIP: 172.30.0.10\n  externalIPs: [192.0.2.100]\n  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080}]\nstatus:\n  loadBalancer: {ingress: [{ip: 198.51.100.10}]}\n",
    )
}

#[test]
fn external_traffic_policy_local_keeps_the_client_address() {
    let s = snap(&etp_local(), &settings());
    for dst in ["192.0.2.100", "198.51.100.10"] {
        assert_eq!(
            tcp(&s, "203.0.113.1", dst, 80),
            dnat(&["10.1.0.1:8080"], false),
            "{dst}"
        );
    }
    assert_eq!(
        tcp(&s, "203.0.113.1", "192.0.2.10", 30080),
        dnat(&["10.1.0.1:8080"], false)
    );
    // ClusterIP traffic of the same Service still uses every endpoint.
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        dnat(&WEB_EPS, false)
    );
    assert_eq!(s.ports_sorted()[0].health_check_node_port, 32000);
}

#[test]
fn external_traffic_policy_local_short_circuits_pods_and_the_node() {
    let s = snap(&etp_local(), &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "198.51.100.10", 80),
        dnat(&WEB_EPS, false)
    );
    assert_eq!(
        tcp(&s, "192.0.2.10", "198.51.100.10", 80),
        dnat(&WEB_EPS, true)
    );
    assert_eq!(
        tcp(&s, "192.0.2.10", "192.0.2.10", 30080),
        dnat(&WEB_EPS, true)
    );
}

#[test]
fn external_traffic_policy_local_without_local_endpoints_drops_external_clients_only() {
    let mut st = settings();
    st.node_name = "node-z".into();
    let s = snap(&etp_local(), &st);
    let d = V::Drop(DropReason::NoLocalEndpointsExternal);
    assert_eq!(tcp(&s, "203.0.113.1", "198.51.100.10", 80), d);
    assert_eq!(tcp(&s, "203.0.113.1", "192.0.2.100", 80), d);
    assert_eq!(tcp(&s, "203.0.113.1", "192.0.2.10", 30080), d);
    assert_eq!(
        tcp(&s, "10.9.0.1", "198.51.100.10", 80),
        dnat(&WEB_EPS, false)
    );
}

#[test]
fn external_traffic_policy_cluster_masquerades_external_traffic() {
    let yaml = etp_local().replace(
        "externalTrafficPolicy: Local",
        "externalTrafficPolicy: Cluster",
    );
    let s = snap(&yaml, &settings());
    assert_eq!(
        tcp(&s, "203.0.113.1", "198.51.100.10", 80),
        dnat(&WEB_EPS, true)
    );
    assert_eq!(
        tcp(&s, "10.9.0.1", "192.0.2.10", 30080),
        dnat(&WEB_EPS, true)
    );
}

#[test]
fn external_policy_local_only_applies_to_nodeport_and_loadbalancer_types() {
    let yaml = WEB.replace(
        "  clusterIP: 172.30.0.10\n",
        "  clusterIP: 172.30.0.10\n  externalTrafficPolicy: Local\n  externalIPs: [192.0.2.100]\n",
    );
    let s = snap(&yaml, &settings());
    assert_eq!(
        tcp(&s, "203.0.113.1", "192.0.2.100", 80),
        dnat(&WEB_EPS, true)
    );
}

#[test]
fn node_ports_only_on_node_port_addresses() {
    let yaml = etp_local().replace(
        "externalTrafficPolicy: Local",
        "externalTrafficPolicy: Cluster",
    );
    let mut st = settings();
    st.node_ips = vec!["192.0.2.10".parse().unwrap(), "192.0.2.11".parse().unwrap()];
    let s = snap(&yaml, &st);
    // Default: the primary IP only.
    assert_eq!(
        tcp(&s, "203.0.113.1", "192.0.2.10", 30080),
        dnat(&WEB_EPS, true)
    );
    assert_eq!(tcp(&s, "203.0.113.1", "192.0.2.11", 30080), V::Pass);
    // 0.0.0.0/0: every local address.
    st.node_port_addresses = vec!["0.0.0.0/0".into()];
    let s = snap(&yaml, &st);
    assert_eq!(
        tcp(&s, "203.0.113.1", "192.0.2.11", 30080),
        dnat(&WEB_EPS, true)
    );
    assert_eq!(tcp(&s, "203.0.113.1", "192.0.2.99", 30080), V::Pass);
    // A CIDR selects the local addresses inside it.
    st.node_port_addresses = vec!["192.0.2.11/32".into()];
    let s = snap(&yaml, &st);
    assert_eq!(tcp(&s, "203.0.113.1", "192.0.2.10", 30080), V::Pass);
    assert_eq!(
        tcp(&s, "203.0.113.1", "192.0.2.11", 30080),
        dnat(&WEB_EPS, true)
    );
}

/// kube-proxy's iptables and IPVS modes: with no nodePortAddresses, NodePorts on every
/// local address, the host's (docker0's) beside the Node's; loopback never.
#[test]
fn iptables_mode_node_ports_on_every_local_address() {
    let yaml = etp_local().replace(
        "externalTrafficPolicy: Local",
        "externalTrafficPolicy: Cluster",
    );
    let mut st = settings();
    st.node_ips = vec!["192.0.2.10".parse().unwrap()];
    st.host_addrs = vec![
        "10.99.0.1".parse().unwrap(),
        "127.0.0.1".parse().unwrap(),
        "192.0.2.10".parse().unwrap(),
    ];
    st.node_ports_on_every_address = true;
    let s = snap(&yaml, &st);
    for dst in ["192.0.2.10", "10.99.0.1"] {
        assert_eq!(
            tcp(&s, "203.0.113.1", dst, 30080),
            dnat(&WEB_EPS, true),
            "{dst}"
        );
    }
    for dst in ["127.0.0.1", "192.0.2.99"] {
        assert_eq!(tcp(&s, "203.0.113.1", dst, 30080), V::Pass, "{dst}");
    }
    // nftables mode: the primary IP only, the host's other addresses are not NodePorts.
    st.node_ports_on_every_address = false;
    let s = snap(&yaml, &st);
    assert_eq!(tcp(&s, "203.0.113.1", "10.99.0.1", 30080), V::Pass);
}

#[test]
fn load_balancer_source_ranges() {
    let yaml = etp_local()
        .replace("externalTrafficPolicy: Local", "externalTrafficPolicy: Cluster")
        .replace(
            "  externalIPs: [192.0.2.100]\n",
            "  externalIPs: [192.0.2.100]\n  loadBalancerSourceRanges: [' 203.0.113.0/25 ', 'bogus', '2001:db8:1::/48']\n",
        );
    let s = snap(&yaml, &settings());
    assert_eq!(
        tcp(&s, "203.0.113.1", "198.51.100.10", 80),
        dnat(&WEB_EPS, true)
    );
    assert_eq!(
        tcp(&s, "203.0.113.200", "198.51.100.10", 80),
        V::Drop(DropReason::SourceRange)
    );
    // Source ranges guard the LoadBalancer IP only, not the NodePort or externalIPs.
    assert_eq!(
        tcp(&s, "203.0.113.200", "192.0.2.10", 30080),
        dnat(&WEB_EPS, true)
    );
    assert_eq!(
        tcp(&s, "203.0.113.200", "192.0.2.100", 80),
        dnat(&WEB_EPS, true)
    );
    // A range holding the node's IP admits the VIP itself as a source.
    assert_eq!(
        tcp(&s, "198.51.100.10", "198.51.100.10", 80),
        V::Drop(DropReason::SourceRange)
    );
    let yaml = yaml.replace("' 203.0.113.0/25 '", "'192.0.2.0/24'");
    let s = snap(&yaml, &settings());
    assert_eq!(
        tcp(&s, "198.51.100.10", "198.51.100.10", 80),
        dnat(&WEB_EPS, true)
    );
}

#[test]
fn proxy_mode_load_balancer_ips_are_not_programmed() {
    let yaml = etp_local().replace("{ip: 198.51.100.10}", "{ip: 198.51.100.10, ipMode: Proxy}");
    let s = snap(&yaml, &settings());
    assert_eq!(tcp(&s, "203.0.113.1", "198.51.100.10", 80), V::Pass);
}

#[test]
fn ignored_services() {
    for (what, patch) in [
        ("headless", "  clusterIP: None\n"),
        (
            "external name",
            "  type: ExternalName\n  externalName: example.com\n  clusterIP: 172.30.0.10\n",
        ),
    ] {
        let yaml = WEB.replace("  clusterIP: 172.30.0.10\n", patch);
        let s = snap(&yaml, &settings());
        assert_eq!(
            tcp(&s, "10.9.0.1", "172.30.0.10", 80),
            V::Drop(DropReason::UnallocatedServiceIp),
            "{what}"
        );
    }
    let yaml = WEB.replace(
        "metadata: {name: web, namespace: ns}",
        "metadata: {name: web, namespace: ns, labels: {service.kubernetes.io/service-proxy-name: other}}",
    );
    let s = snap(&yaml, &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        V::Drop(DropReason::UnallocatedServiceIp)
    );
}

#[test]
fn service_proxy_name_serves_exactly_the_services_labelled_with_it() {
    let labelled = |name: &str| {
        WEB.replace(
            "metadata: {name: web, namespace: ns}",
            &format!(
                "metadata: {{name: web, namespace: ns, labels: {{service.kubernetes.io/service-proxy-name: {name}}}}}"
            ),
        )
    };
    let mine = NodeSettings {
        service_proxy_name: Some("kxp".into()),
        ..settings()
    };
    // Labelled with our name: served, as kube-proxy with serviceProxyName serves it.
    let s = snap(&labelled("kxp"), &mine);
    assert!(matches!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        V::Dnat(..)
    ));
    // Another proxy's, or unlabelled: not ours when a name is set.
    for yaml in [labelled("other"), WEB.to_string()] {
        let s = snap(&yaml, &mine);
        assert_eq!(
            tcp(&s, "10.9.0.1", "172.30.0.10", 80),
            V::Drop(DropReason::UnallocatedServiceIp)
        );
    }
    // Without a name, the unlabelled one is served and a labelled one is not.
    let s = snap(WEB, &settings());
    assert!(matches!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        V::Dnat(..)
    ));
    let s = snap(&labelled("kxp"), &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        V::Drop(DropReason::UnallocatedServiceIp)
    );
}

#[test]
fn endpoint_slices_join_by_label_port_name_and_protocol() {
    let yaml = format!(
        "{WEB}\n---\n{}\n---\n{}\n---\n{}",
        // Another port name: not this Service port's.
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-3, namespace: ns, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: metrics, port: 9090}]\nendpoints: [{addresses: [10.4.0.1]}]",
        // Same name, other protocol.
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-4, namespace: ns, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080, protocol: UDP}]\nendpoints: [{addresses: [10.5.0.1]}]",
        // FQDN slices are ignored; so are slices without the label.
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-5, namespace: ns, labels: {kubernetes.io/service-name: web}}\naddressType: FQDN\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [example.com]}]",
    );
    let s = snap(&yaml, &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        dnat(&WEB_EPS, false)
    );
}

#[test]
fn named_target_ports_resolve_per_endpoint() {
    // Pods of one Service listening on different numbers for the same named port land in
    // different slices: each endpoint keeps its own port.
    let yaml = WEB.replace(
        "ports: [{name: http, port: 8080, protocol: TCP}]\nendpoints:\n- {addresses: [10.3.0.1], nodeName: node-c}",
        "ports: [{name: http, port: 9000, protocol: TCP}]\nendpoints:\n- {addresses: [10.3.0.1], nodeName: node-c}",
    );
    let s = snap(&yaml, &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        dnat(&["10.1.0.1:8080", "10.2.0.1:8080", "10.3.0.1:9000"], false)
    );
}

#[test]
fn duplicate_endpoints_prefer_the_non_terminating_one() {
    let yaml = format!(
        "{WEB}\n---\n{}",
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-0, namespace: ns, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.1.0.1], conditions: {ready: false, serving: true, terminating: true}}]"
    );
    let s = snap(&yaml, &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        dnat(&WEB_EPS, false)
    );
}

#[test]
fn ipv6_and_dual_stack() {
    let yaml = r#"apiVersion: v1
kind: Service
metadata: {name: ds, namespace: ns}
spec:
  clusterIP: 172.30.0.20
  clusterIPs: [172.30.0.20, "fd00:30::20"]
  ipFamilies: [IPv4, IPv6]
  ports: [{port: 443}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: ds-4, namespace: ns, labels: {kubernetes.io/service-name: ds}}
addressType: IPv4
ports: [{name: "", port: 8443}]
endpoints: [{addresses: [10.1.0.9]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: ds-6, namespace: ns, labels: {kubernetes.io/service-name: ds}}
addressType: IPv6
ports: [{name: "", port: 8443}]
endpoints: [{addresses: ["fd00:10::9"]}, {addresses: ["fd00:10::a"]}]"#;
    let s = snap(yaml, &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.20", 443),
        dnat(&["10.1.0.9:8443"], false)
    );
    assert_eq!(
        tcp(&s, "fd00:10::1", "fd00:30::20", 443),
        dnat(&["[fd00:10::9]:8443", "[fd00:10::a]:8443"], false)
    );
    assert_eq!(
        tcp(&s, "2001:db8:9::1", "fd00:30::20", 443),
        dnat(&["[fd00:10::9]:8443", "[fd00:10::a]:8443"], true)
    );
    // A cluster CIDR of IPv4 only leaves IPv6 without a detector.
    let mut st = settings();
    st.cluster_cidrs = vec!["10.0.0.0/8".parse().unwrap()];
    let s = snap(yaml, &st);
    assert_eq!(
        tcp(&s, "2001:db8:9::1", "fd00:30::20", 443),
        dnat(&["[fd00:10::9]:8443", "[fd00:10::a]:8443"], false)
    );
}

#[test]
fn single_stack_service_without_ip_families_uses_cluster_ip() {
    let s = snap(WEB, &settings());
    assert_eq!(s.port_count(), 1);
    assert_eq!(
        s.ports_sorted()[0].cluster_ip,
        "172.30.0.10".parse::<IpAddr>().unwrap()
    );
}

#[test]
fn zone_hints_restrict_cluster_endpoints() {
    let yaml = WEB
        .replace(
            "- {addresses: [10.1.0.1], nodeName: node-a}",
            "- {addresses: [10.1.0.1], nodeName: node-a, hints: {forZones: [{name: z1}]}}",
        )
        .replace(
            "- {addresses: [10.2.0.1], nodeName: node-b}",
            "- {addresses: [10.2.0.1], nodeName: node-b, hints: {forZones: [{name: z2}]}}",
        )
        .replace(
            "- {addresses: [10.3.0.1], nodeName: node-c}",
            "- {addresses: [10.3.0.1], nodeName: node-c, hints: {forZones: [{name: z1}]}}",
        );
    let with_node = format!(
        "{yaml}\n---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-a, labels: {{topology.kubernetes.io/zone: z1}}}}"
    );
    let s = snap(&with_node, &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        dnat(&["10.1.0.1:8080", "10.3.0.1:8080"], false)
    );
    // The Node without a zone label: hints are ignored.
    let s = snap(&yaml, &settings());
    assert_eq!(
        tcp(&s, "10.9.0.1", "172.30.0.10", 80),
        dnat(&WEB_EPS, false)
    );
}

#[test]
fn node_addresses_come_from_the_node_object_without_node_ips() {
    let yaml = format!(
        "{}\n---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-a}}\nstatus:\n  addresses: [{{type: Hostname, address: node-a}}, {{type: ExternalIP, address: 198.51.100.7}}, {{type: InternalIP, address: 192.0.2.7}}]",
        etp_local().replace(
            "externalTrafficPolicy: Local",
            "externalTrafficPolicy: Cluster"
        )
    );
    let mut st = settings();
    st.node_ips.clear();
    let s = snap(&yaml, &st);
    assert_eq!(s.node.primary_v4, Some("192.0.2.7".parse().unwrap()));
    assert_eq!(
        tcp(&s, "203.0.113.1", "192.0.2.7", 30080),
        dnat(&WEB_EPS, true)
    );
    assert_eq!(tcp(&s, "203.0.113.1", "198.51.100.7", 30080), V::Pass);
}

#[test]
fn the_hosts_addresses_are_the_fallback_when_the_node_object_gives_none() {
    // kube-proxy 1.34: bindAddress / --node-ip, else the Node's InternalIP (then
    // ExternalIP), else a fallback it warns about. The host's addresses (docker0's,
    // flannel.1's and the InternalIP among them) are that fallback, never the first.
    let cluster = etp_local().replace(
        "externalTrafficPolicy: Local",
        "externalTrafficPolicy: Cluster",
    );
    let node = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus:\n  addresses: [{type: InternalIP, address: 192.0.2.7}]";
    let mut st = settings();
    st.node_ips.clear();
    st.host_addrs = vec![
        "10.99.0.1".parse().unwrap(),
        "10.244.0.0".parse().unwrap(),
        "192.0.2.7".parse().unwrap(),
    ];
    let with_node = snap(&format!("{cluster}\n---\n{node}"), &st);
    assert_eq!(
        with_node.node.primary_v4,
        Some("192.0.2.7".parse().unwrap())
    );
    assert_eq!(
        tcp(&with_node, "203.0.113.1", "192.0.2.7", 30080),
        dnat(&WEB_EPS, true)
    );
    assert_eq!(tcp(&with_node, "203.0.113.1", "10.99.0.1", 30080), V::Pass);

    // No Node object: the host's addresses, the lowest primary, and a note that says
    // what was missing and what to set.
    let built = build(&state(&cluster), &st, 1).unwrap();
    assert_eq!(
        built.snapshot.node.primary_v4,
        Some("10.99.0.1".parse().unwrap())
    );
    let noted = |notes: &[String], what: &str| {
        assert!(
            notes
                .iter()
                .any(|n| n.contains(what) && n.contains("bindAddress")),
            "{notes:?}"
        );
    };
    noted(&built.notes, "no Node named \"node-a\"");
    // A Node without addresses: the same fallback, saying so.
    let bare = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}";
    let built = build(&state(&format!("{cluster}\n---\n{bare}")), &st, 1).unwrap();
    assert_eq!(
        built.snapshot.node.primary_v4,
        Some("10.99.0.1".parse().unwrap())
    );
    noted(&built.notes, "has no InternalIP or ExternalIP");
    // --node-ip / bindAddress win over both.
    st.node_ips = vec!["192.0.2.99".parse().unwrap()];
    let explicit = snap(&format!("{cluster}\n---\n{node}"), &st);
    assert_eq!(
        explicit.node.primary_v4,
        Some("192.0.2.99".parse().unwrap())
    );
}

#[test]
fn node_cidr_detection() {
    let yaml = format!(
        "{WEB}\n---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-a}}\nspec: {{podCIDRs: [10.1.0.0/24]}}"
    );
    let mut st = settings();
    st.detect_local = DetectLocalMode::NodeCidr;
    let s = snap(&yaml, &st);
    assert_eq!(
        tcp(&s, "10.1.0.7", "172.30.0.10", 80),
        dnat(&WEB_EPS, false)
    );
    assert_eq!(tcp(&s, "10.9.0.1", "172.30.0.10", 80), dnat(&WEB_EPS, true));
}

#[test]
fn forward_reports_frontend_and_policy() {
    let s = snap(&etp_local(), &settings());
    let pkt = NewPacket {
        src: "203.0.113.1".parse().unwrap(),
        dst: "198.51.100.10".parse().unwrap(),
        dport: 80,
        proto: Protocol::Tcp,
        in_interface: None,
    };
    match decide(&s, &pkt) {
        Decision::Forward(f) => {
            assert_eq!(f.frontend, FrontendKind::LoadBalancer);
            assert_eq!(f.policy, Policy::Local);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_fields_are_errors_naming_object_and_field() {
    let yaml = WEB.replace("clusterIP: 172.30.0.10", "clusterIP: 172.30.0.999");
    let e = build(&state(&yaml), &settings(), 1).unwrap_err();
    assert_eq!(e.object, "ns/web");
    assert_eq!(e.field, "spec.clusterIP");
    let yaml = WEB.replace(
        "{name: http, port: 80, targetPort: 8080}",
        "{name: http, port: 80, protocol: ICMP}",
    );
    let e = build(&state(&yaml), &settings(), 1).unwrap_err();
    assert_eq!(e.field, "spec.ports[0].protocol");
}
