//! The immutable snapshot a worker decides with: every Service port of both families and
//! the frontend indexes that find one from a packet's destination in O(1).
//!
//! Built by the control plane, published by one pointer swap, read by workers once per
//! batch. Service ports are held behind `Arc`, so a rebuild after one Service changed
//! shares every other port with the previous snapshot.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use foldhash::fast::FixedState;

use crate::model::{Family, NodeContext, ServicePort};
use crate::tuple::Protocol;

/// Which kind of Service address a packet was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrontendKind {
    ClusterIp,
    ExternalIp,
    LoadBalancer,
    NodePort,
}

impl FrontendKind {
    pub fn name(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "ClusterIP",
            FrontendKind::ExternalIp => "externalIP",
            FrontendKind::LoadBalancer => "LoadBalancer IP",
            FrontendKind::NodePort => "NodePort",
        }
    }
}

/// An entry of the frontend index: the Service port (index into `Snapshot::ports`) and
/// how it was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frontend {
    pub port: u32,
    pub kind: FrontendKind,
}

type FastMap<K, V> = HashMap<K, V, FixedState>;
type FastSet<K> = HashSet<K, FixedState>;

/// IPv4 frontend key packed into 8 bytes (address; port and protocol), so that an index
/// of 100k Services stays small enough (12 bytes an entry) to mostly live in L2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct V4Key([u32; 2]);

impl V4Key {
    #[inline]
    fn new(ip: std::net::Ipv4Addr, proto: Protocol, port: u16) -> V4Key {
        V4Key([u32::from(ip), (port as u32) << 8 | proto.number() as u32])
    }
}

/// A [`Frontend`] packed into 4 bytes: the port index and the kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Packed(u32);

impl Packed {
    fn new(f: Frontend) -> Packed {
        let kind = match f.kind {
            FrontendKind::ClusterIp => 0,
            FrontendKind::ExternalIp => 1,
            FrontendKind::LoadBalancer => 2,
            FrontendKind::NodePort => 3,
        };
        Packed(f.port << 2 | kind)
    }

    #[inline]
    fn get(self) -> Frontend {
        let kind = match self.0 & 3 {
            0 => FrontendKind::ClusterIp,
            1 => FrontendKind::ExternalIp,
            2 => FrontendKind::LoadBalancer,
            _ => FrontendKind::NodePort,
        };
        Frontend {
            port: self.0 >> 2,
            kind,
        }
    }
}

/// A consistent view of every Service port, for one publication.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Increases by one with every publication.
    pub generation: u64,
    pub node: Arc<NodeContext>,
    /// Every Service port of both families, sorted by name then family.
    pub ports: Vec<Arc<ServicePort>>,
    /// `(ip, protocol, port)` of ClusterIPs, externalIPs and LoadBalancer VIPs: IPv4 in a
    /// compact index, IPv6 in a general one.
    addrs_v4: FastMap<V4Key, Packed>,
    addrs_v6: FastMap<(IpAddr, Protocol, u16), Frontend>,
    /// `(family, protocol, nodePort)`.
    node_ports: FastMap<(Family, Protocol, u16), u32>,
    /// Every ClusterIP (any port), for kube-proxy's "invalid port of a ClusterIP" reject.
    cluster_ips: FastSet<IpAddr>,
    /// Frontends claimed by two Service ports: the first (in name order) keeps it.
    pub conflicts: Vec<String>,
}

impl Snapshot {
    /// Builds the indexes over `ports`.
    pub fn new(generation: u64, node: Arc<NodeContext>, mut ports: Vec<Arc<ServicePort>>) -> Self {
        ports.sort_by(|a, b| {
            (&a.name, Family::of(&a.cluster_ip)).cmp(&(&b.name, Family::of(&b.cluster_ip)))
        });
        let mut s = Snapshot {
            generation,
            node,
            addrs_v4: FastMap::with_capacity_and_hasher(ports.len(), FixedState::default()),
            addrs_v6: FastMap::default(),
            node_ports: FastMap::default(),
            cluster_ips: FastSet::with_capacity_and_hasher(ports.len(), FixedState::default()),
            conflicts: Vec::new(),
            ports: Vec::new(),
        };
        for (i, sp) in ports.iter().enumerate() {
            let i = i as u32;
            let proto = sp.name.protocol;
            s.cluster_ips.insert(sp.cluster_ip);
            s.claim(
                (sp.cluster_ip, proto, sp.port),
                i,
                FrontendKind::ClusterIp,
                &ports,
            );
            for &ip in &sp.external_ips {
                s.claim((ip, proto, sp.port), i, FrontendKind::ExternalIp, &ports);
            }
            for &ip in &sp.lb_vips {
                s.claim((ip, proto, sp.port), i, FrontendKind::LoadBalancer, &ports);
            }
            if sp.node_port != 0 {
                let key = (Family::of(&sp.cluster_ip), proto, sp.node_port);
                if let Some(&other) = s.node_ports.get(&key) {
                    s.conflicts.push(format!(
                        "nodePort {}/{} of {} is already used by {}",
                        sp.node_port, proto, sp.name, ports[other as usize].name
                    ));
                } else {
                    s.node_ports.insert(key, i);
                }
            }
        }
        s.ports = ports;
        s
    }

    fn claim(
        &mut self,
        key: (IpAddr, Protocol, u16),
        port: u32,
        kind: FrontendKind,
        ports: &[Arc<ServicePort>],
    ) {
        if let Some(prev) = self.lookup_addr(key.0, key.1, key.2) {
            if prev.port != port {
                self.conflicts.push(format!(
                    "{} {}:{}/{} of {} is already the {} of {}",
                    kind.name(),
                    key.0,
                    key.2,
                    key.1,
                    ports[port as usize].name,
                    prev.kind.name(),
                    ports[prev.port as usize].name
                ));
            }
            return;
        }
        let f = Frontend { port, kind };
        match key.0 {
            IpAddr::V4(v4) => {
                self.addrs_v4
                    .insert(V4Key::new(v4, key.1, key.2), Packed::new(f));
            }
            IpAddr::V6(_) => {
                self.addrs_v6.insert(key, f);
            }
        }
    }

    /// The frontend a ClusterIP, externalIP or LoadBalancer VIP packet is for.
    #[inline]
    pub fn lookup_addr(&self, dst: IpAddr, proto: Protocol, dport: u16) -> Option<Frontend> {
        match dst {
            IpAddr::V4(v4) => self
                .addrs_v4
                .get(&V4Key::new(v4, proto, dport))
                .map(|p| p.get()),
            IpAddr::V6(_) => self.addrs_v6.get(&(dst, proto, dport)).copied(),
        }
    }

    /// The Service port owning a NodePort of `dst`'s family.
    #[inline]
    pub fn lookup_node_port(&self, dst: IpAddr, proto: Protocol, dport: u16) -> Option<u32> {
        self.node_ports
            .get(&(Family::of(&dst), proto, dport))
            .copied()
    }

    #[inline]
    pub fn is_cluster_ip(&self, ip: IpAddr) -> bool {
        self.cluster_ips.contains(&ip)
    }

    pub fn port(&self, index: u32) -> &ServicePort {
        &self.ports[index as usize]
    }

    /// Number of frontends (addresses × ports, plus NodePorts).
    pub fn frontend_count(&self) -> usize {
        self.addrs_v4.len() + self.addrs_v6.len() + self.node_ports.len()
    }
}
