//! An EndpointSlice as kxp holds it: what kube-proxy reads of one and nothing else.
//!
//! The API's `EndpointSlice` (k8s-openapi's type) keeps every field of every endpoint:
//! 352 bytes each before its strings, most of them never read (its Pod reference,
//! hostname, zone, deprecated topology). A node watching a million endpoints held
//! some 450 MB of them. A [`Slice`] is decoded straight from the API's JSON (unknown
//! fields skipped, never stored) and keeps of each endpoint its first address, parsed
//! once, its node, its three conditions and its hints: 56 bytes. It is the type the
//! watch stores and the [`crate::tracker::Tracker`] hold; objects read as k8s-openapi's
//! type (state files, tests) are converted by [`Slice::from`], through the same code as
//! the decoding.

use std::net::IpAddr;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Deserializer};

use crate::sloppy::parse_ip_sloppy;

/// A null or missing field read as its default, as Go reads a nil list.
fn nullable<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// An EndpointSlice (see the module docs). Lenient where the API's type is strict about
/// presence (a missing `endpoints` or `addressType` is empty, and read as such later):
/// one odd object must not fail the decoding of a whole list.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Slice {
    #[serde(default, deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    /// `IPv4`, `IPv6` or `FQDN`.
    #[serde(default, deserialize_with = "nullable")]
    pub address_type: String,
    #[serde(default, deserialize_with = "nullable")]
    pub endpoints: Vec<SliceEndpoint>,
    #[serde(default, deserialize_with = "nullable")]
    pub ports: Vec<SlicePort>,
}

impl k8s_openapi::Resource for Slice {
    const API_VERSION: &'static str = <EndpointSlice as k8s_openapi::Resource>::API_VERSION;
    const GROUP: &'static str = <EndpointSlice as k8s_openapi::Resource>::GROUP;
    const KIND: &'static str = <EndpointSlice as k8s_openapi::Resource>::KIND;
    const VERSION: &'static str = <EndpointSlice as k8s_openapi::Resource>::VERSION;
    const URL_PATH_SEGMENT: &'static str =
        <EndpointSlice as k8s_openapi::Resource>::URL_PATH_SEGMENT;
    type Scope = k8s_openapi::NamespaceResourceScope;
}

impl k8s_openapi::Metadata for Slice {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// A port of a slice (`ports[]`).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
pub struct SlicePort {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub port: Option<i32>,
    #[serde(default)]
    pub protocol: Option<String>,
}

/// An endpoint's first address: parsed (kube-proxy's `ParseIPSloppy`), or the text that
/// is not an address, kept for the error that names it.
#[derive(Debug, Clone, PartialEq)]
pub enum Address {
    Ip(IpAddr),
    Invalid(Box<str>),
}

/// One endpoint (`endpoints[]`), its conditions resolved as kube-proxy resolves them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(from = "RawEndpoint")]
pub struct SliceEndpoint {
    /// `addresses[0]`; none when the list is empty (the endpoint is then skipped).
    pub address: Option<Address>,
    pub node_name: Option<Box<str>>,
    /// `conditions.ready` (nil = true).
    pub ready: bool,
    /// `conditions.serving` (nil = true).
    pub serving: bool,
    /// `conditions.terminating` (nil = false).
    pub terminating: bool,
    /// Its topology hints; none when it has none.
    pub hints: Option<Box<Hints>>,
}

/// `hints.forZones[].name` and `hints.forNodes[].name`, sorted.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Hints {
    pub zones: Vec<String>,
    pub nodes: Vec<String>,
}

/// An endpoint as the API writes it, only the fields read; decoded, then made a
/// [`SliceEndpoint`] (and freed).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RawEndpoint {
    #[serde(default, deserialize_with = "nullable")]
    addresses: Vec<String>,
    #[serde(default)]
    node_name: Option<String>,
    #[serde(default)]
    conditions: Option<RawConditions>,
    #[serde(default)]
    hints: Option<RawHints>,
}

#[derive(Deserialize, Default)]
struct RawConditions {
    #[serde(default)]
    ready: Option<bool>,
    #[serde(default)]
    serving: Option<bool>,
    #[serde(default)]
    terminating: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RawHints {
    #[serde(default, deserialize_with = "nullable")]
    for_zones: Vec<Named>,
    #[serde(default, deserialize_with = "nullable")]
    for_nodes: Vec<Named>,
}

#[derive(Deserialize, Default)]
struct Named {
    #[serde(default)]
    name: String,
}

impl From<RawEndpoint> for SliceEndpoint {
    fn from(raw: RawEndpoint) -> SliceEndpoint {
        let address = raw.addresses.into_iter().next().map(|s| {
            parse_ip_sloppy(&s).map_or_else(|| Address::Invalid(s.into_boxed_str()), Address::Ip)
        });
        let c = raw.conditions.unwrap_or_default();
        let hints = raw.hints.unwrap_or_default();
        let sorted = |v: Vec<Named>| {
            let mut names: Vec<String> = v.into_iter().map(|n| n.name).collect();
            names.sort();
            names
        };
        let hints = Hints {
            zones: sorted(hints.for_zones),
            nodes: sorted(hints.for_nodes),
        };
        SliceEndpoint {
            address,
            node_name: raw.node_name.map(String::into_boxed_str),
            ready: c.ready.unwrap_or(true),
            serving: c.serving.unwrap_or(true),
            terminating: c.terminating.unwrap_or(false),
            hints: (!hints.zones.is_empty() || !hints.nodes.is_empty()).then(|| Box::new(hints)),
        }
    }
}

impl From<&k8s_openapi::api::discovery::v1::Endpoint> for SliceEndpoint {
    fn from(ep: &k8s_openapi::api::discovery::v1::Endpoint) -> SliceEndpoint {
        let named = |name: &String| Named { name: name.clone() };
        let hints = ep.hints.as_ref().map(|h| RawHints {
            for_zones: h
                .for_zones
                .iter()
                .flatten()
                .map(|z| named(&z.name))
                .collect(),
            for_nodes: h
                .for_nodes
                .iter()
                .flatten()
                .map(|n| named(&n.name))
                .collect(),
        });
        SliceEndpoint::from(RawEndpoint {
            addresses: ep.addresses.first().cloned().into_iter().collect(),
            node_name: ep.node_name.clone(),
            conditions: ep.conditions.as_ref().map(|c| RawConditions {
                ready: c.ready,
                serving: c.serving,
                terminating: c.terminating,
            }),
            hints,
        })
    }
}

impl From<&EndpointSlice> for Slice {
    fn from(s: &EndpointSlice) -> Slice {
        Slice {
            metadata: s.metadata.clone(),
            address_type: s.address_type.clone(),
            endpoints: s.endpoints.iter().map(SliceEndpoint::from).collect(),
            ports: s
                .ports
                .iter()
                .flatten()
                .map(|p| SlicePort {
                    name: p.name.clone(),
                    port: p.port,
                    protocol: p.protocol.clone(),
                })
                .collect(),
        }
    }
}

impl From<EndpointSlice> for Slice {
    fn from(s: EndpointSlice) -> Slice {
        Slice::from(&s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slices as the API writes them, with what kube-proxy reads in every form it takes
    /// (missing, null, empty, several) and what it does not read.
    const SLICES: &str = r#"
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: web-1
    namespace: ns
    labels: {kubernetes.io/service-name: web, endpointslice.kubernetes.io/managed-by: x}
    annotations: {endpoints.kubernetes.io/last-change-trigger-time: "2026-12-01T10:00:00Z"}
    ownerReferences: [{apiVersion: v1, kind: Service, name: web, uid: "1"}]
  addressType: IPv4
  ports: [{name: http, port: 8080, protocol: TCP, appProtocol: http}, {port: 53, protocol: UDP}, {}]
  endpoints:
  - addresses: [10.0.0.1, 10.0.0.9]
    conditions: {ready: true, serving: true, terminating: false}
    nodeName: node-a
    zone: z1
    hostname: web-0
    targetRef: {kind: Pod, name: web-0, namespace: ns, uid: "2"}
    hints: {forZones: [{name: z2}, {name: z1}], forNodes: [{name: node-b}, {name: node-a}]}
  - addresses: [010.000.000.002]
    conditions: {ready: false, terminating: true}
  - addresses: [not-an-ip]
    conditions: {}
    hints: {forZones: []}
  - addresses: []
  - addresses: ["fd00::1"]
    hints: {forNodes: [{name: n}]}
    deprecatedTopology: {a: b}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: empty, namespace: ns}
  addressType: FQDN
  endpoints: []
"#;

    /// Decoding the API's text gives what converting the API's type gives, from YAML
    /// and from JSON alike.
    #[test]
    fn decoding_the_text_and_converting_the_api_type_agree() {
        let api: Vec<EndpointSlice> = serde_yaml::from_str(SLICES).unwrap();
        let slim: Vec<Slice> = serde_yaml::from_str(SLICES).unwrap();
        let converted: Vec<Slice> = api.iter().map(Slice::from).collect();
        assert_eq!(slim, converted);
        let json = serde_json::to_string(&api).unwrap();
        let from_json: Vec<Slice> = serde_json::from_str(&json).unwrap();
        assert_eq!(from_json, converted);
    }

    /// Each endpoint keeps what kube-proxy reads, its conditions resolved as kube-proxy
    /// resolves nil ones and its hints sorted; the rest is not stored.
    #[test]
    fn an_endpoint_keeps_what_kube_proxy_reads() {
        let slim: Vec<Slice> = serde_yaml::from_str(SLICES).unwrap();
        let s = &slim[0];
        assert_eq!(s.address_type, "IPv4");
        assert_eq!(s.ports.len(), 3);
        assert_eq!(s.ports[1].name, None);
        assert_eq!(s.ports[1].port, Some(53));
        assert_eq!(s.ports[2], SlicePort::default());
        let e = &s.endpoints;
        assert_eq!(e[0].address, Some(Address::Ip("10.0.0.1".parse().unwrap())));
        assert_eq!(e[0].node_name.as_deref(), Some("node-a"));
        assert_eq!(
            (e[0].ready, e[0].serving, e[0].terminating),
            (true, true, false)
        );
        let h = e[0].hints.as_deref().unwrap();
        assert_eq!(h.zones, ["z1", "z2"]);
        assert_eq!(h.nodes, ["node-a", "node-b"]);
        // Leading zeros read as decimal, as ParseIPSloppy reads them.
        assert_eq!(e[1].address, Some(Address::Ip("10.0.0.2".parse().unwrap())));
        assert_eq!(
            (e[1].ready, e[1].serving, e[1].terminating),
            (false, true, true)
        );
        assert_eq!(e[2].address, Some(Address::Invalid("not-an-ip".into())));
        assert_eq!(e[2].hints, None, "empty hints are no hints");
        assert_eq!(e[3].address, None);
        assert_eq!(e[4].address, Some(Address::Ip("fd00::1".parse().unwrap())));
        assert_eq!(slim[1].address_type, "FQDN");
        assert!(slim[1].endpoints.is_empty() && slim[1].ports.is_empty());
    }

    /// Nulls and missing lists read as empty, so one odd object does not fail a list.
    #[test]
    fn nulls_and_missing_fields_read_as_empty() {
        let s: Slice = serde_json::from_str(
            r#"{"metadata":{"name":"a"},"addressType":null,"ports":null,
                "endpoints":[{"addresses":null,"conditions":null,"hints":{"forZones":null}}]}"#,
        )
        .unwrap();
        assert_eq!(s.address_type, "");
        assert!(s.ports.is_empty());
        assert_eq!(s.endpoints[0].address, None);
        assert!(s.endpoints[0].ready && s.endpoints[0].serving);
        assert_eq!(s.endpoints[0].hints, None);
        let s: Slice = serde_json::from_str("{}").unwrap();
        assert_eq!(s, Slice::default());
    }

    /// The slim endpoint is a fraction of the API's (the point of this type).
    #[test]
    fn a_slim_endpoint_is_a_fraction_of_the_api_one() {
        let slim = std::mem::size_of::<SliceEndpoint>();
        let api = std::mem::size_of::<k8s_openapi::api::discovery::v1::Endpoint>();
        assert!(slim * 4 <= api, "{slim} bytes against the API type's {api}");
    }
}
