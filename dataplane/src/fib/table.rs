//! The immutable tables a worker reads: routes (an LPM per table and family), usable
//! neighbours, links and addresses. Each part sits behind its own `Arc`, so a batch of
//! neighbour events copies the neighbour map only, never the routes.

use std::net::IpAddr;
use std::sync::Arc;

use super::dir4::Dir4;
pub(super) use super::lpm::{
    FastMap, Hop, Kind, Lpm, RouteEntry, ip_bits, lookup_tables, mask, width,
};
use super::{NextHop, Route};

/// Tables in lookup order: local (255), main (254), default (253), as the kernel's
/// default policy rules (priorities 0, 32766, 32767) consult them.
pub(super) const TABLES: [u32; 3] = [255, 254, 253];

/// The mirrored forwarding state at one generation.
#[derive(Debug, Clone, Default)]
pub struct FibTable {
    pub(super) generation: u64,
    pub(super) attached: Arc<[u32]>,
    pub(super) links: Arc<FastMap<u32, Link>>,
    pub(super) addrs: Arc<Vec<Addr>>,
    /// Only neighbours whose MAC may be used, keyed by (ifindex, address).
    pub(super) neigh: Arc<FastMap<(u32, IpAddr), [u8; 6]>>,
    /// Linux bridges' forwarding databases, learned entries only: (bridge ifindex, MAC)
    /// → the port the MAC was seen on.
    pub(super) fdb: Arc<FastMap<(u32, [u8; 6]), u32>>,
    /// `routes[family][table]`, family 0 = IPv4, 1 = IPv6, table as in [`TABLES`].
    pub(super) routes: [[Arc<Lpm>; 3]; 2],
    /// The IPv4 routes as one trie, when built for these `routes[0]` (see
    /// [`FibTable::index_routes`]).
    pub(super) v4: Option<Arc<Dir4>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Link {
    pub name: String,
    pub mac: Option<[u8; 6]>,
    pub up: bool,
    /// The bridge (or bond) this link is a port of (`IFLA_MASTER`).
    pub master: Option<u32>,
    /// `IFLA_MTU`.
    pub mtu: u32,
    /// An 802.1Q/802.1ad VLAN device (`IFLA_INFO_KIND` "vlan"): the kernel puts the
    /// tag on what it sends.
    pub vlan: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Addr {
    pub ifindex: u32,
    pub addr: IpAddr,
    pub prefix_len: u8,
    /// IPv4 secondary address (`ip addr` lists it after the primary one).
    pub secondary: bool,
    /// Not tentative, DAD-failed or deprecated: the kernel would pick it as a source.
    pub preferred: bool,
}

/// A lookup's answer before the view turns "unresolved" into a resolution request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Resolved {
    Route(Route),
    Unresolved { ifindex: u32, next_hop: IpAddr },
}

impl FibTable {
    /// Bumped on every publication; 0 until the first full dump is applied.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Builds the IPv4 trie again if the IPv4 routes changed since it was built (the
    /// mirror, before it publishes). Returns its blocks when it built one.
    pub(super) fn index_routes(&mut self) -> Option<Option<usize>> {
        if self.v4.as_ref().is_some_and(|d| d.is_of(&self.routes[0])) {
            return None;
        }
        self.v4 = Dir4::build(&self.routes[0]).map(Arc::new);
        Some(self.v4.as_ref().map(|d| d.blocks()))
    }

    /// Number of mirrored routes (every table and family).
    pub fn route_count(&self) -> usize {
        self.routes.iter().flatten().map(|lpm| lpm.len()).sum()
    }

    /// Number of neighbours with a usable MAC.
    pub fn neighbour_count(&self) -> usize {
        self.neigh.len()
    }

    /// Every address of the host, deduplicated, in kernel order.
    pub fn local_addrs(&self) -> Vec<IpAddr> {
        let mut out: Vec<IpAddr> = Vec::with_capacity(self.addrs.len());
        for a in self.addrs.iter() {
            if !out.contains(&a.addr) {
                out.push(a.addr);
            }
        }
        out
    }

    /// The route entry the kernel's default rules would pick for `dst`.
    pub(super) fn lookup(&self, dst: IpAddr) -> Option<&RouteEntry> {
        if let IpAddr::V4(a) = dst
            && let Some(dir) = &self.v4
            && dir.is_of(&self.routes[0])
        {
            return dir.lookup(a.to_bits());
        }
        let family = usize::from(dst.is_ipv6());
        lookup_tables(&self.routes[family], ip_bits(dst), width(dst))
    }

    pub(super) fn resolve(&self, dst: IpAddr) -> Resolved {
        let reject = Resolved::Route(Route::Unreachable);
        if is_multicast_or_unspecified(dst) {
            return reject;
        }
        let Some(entry) = self.lookup(dst) else {
            return reject;
        };
        match entry.kind {
            Kind::Local => return Resolved::Route(Route::Local),
            Kind::Reject | Kind::Throw => return reject,
            Kind::Unicast => {}
        }
        let Some(hop) = entry.hop.filter(|_| !entry.unsupported) else {
            return reject;
        };
        if !self.attached.contains(&hop.ifindex) {
            // A Linux bridge kxp is not attached to, whose pods' veths it is (a bridged
            // CNI's cni0): the frame goes to the port the bridge learned the MAC on, as
            // the bridge would forward it.
            if let Some(r) = self.via_bridge(hop, dst) {
                return r;
            }
            return Resolved::Route(Route::NotAttached {
                ifindex: hop.ifindex,
            });
        }
        let Some(src_mac) = self
            .links
            .get(&hop.ifindex)
            .filter(|l| l.up)
            .and_then(|l| l.mac)
        else {
            return reject;
        };
        let next_hop = hop.gateway.unwrap_or(dst);
        match self.neigh.get(&(hop.ifindex, next_hop)) {
            Some(&dst_mac) => Resolved::Route(Route::Forward(NextHop {
                ifindex: hop.ifindex,
                src_mac,
                dst_mac,
            })),
            None => Resolved::Unresolved {
                ifindex: hop.ifindex,
                next_hop,
            },
        }
    }

    /// Routes through the bridge `hop.ifindex` when it has a port kxp is attached to:
    /// the neighbour's MAC (on the bridge), then the port that MAC was learned on. `None`
    /// when `hop` is not a bridge with an attached port.
    fn via_bridge(&self, hop: Hop, dst: IpAddr) -> Option<Resolved> {
        let bridge = hop.ifindex;
        let has_port = self
            .links
            .iter()
            .any(|(i, l)| l.master == Some(bridge) && self.attached.contains(i));
        if !has_port {
            return None;
        }
        let link = self.links.get(&bridge).filter(|l| l.up)?;
        let src_mac = link.mac?;
        let next_hop = hop.gateway.unwrap_or(dst);
        let Some(&dst_mac) = self.neigh.get(&(bridge, next_hop)) else {
            return Some(Resolved::Unresolved {
                ifindex: bridge,
                next_hop,
            });
        };
        match self.fdb.get(&(bridge, dst_mac)) {
            Some(&port) if self.attached.contains(&port) => {
                Some(Resolved::Route(Route::Forward(NextHop {
                    ifindex: port,
                    src_mac,
                    dst_mac,
                })))
            }
            Some(&port) => Some(Resolved::Route(Route::NotAttached { ifindex: port })),
            // Known neighbour, MAC not (or no longer) in the bridge's table: the bridge
            // would flood; kxp asks the kernel to probe, which makes the pod answer
            // and the bridge learn its port.
            None => Some(Resolved::Unresolved {
                ifindex: bridge,
                next_hop,
            }),
        }
    }

    pub(super) fn source_for(&self, dst: IpAddr) -> Option<IpAddr> {
        let entry = self.lookup(dst)?;
        if let Some(src) = entry.prefsrc {
            return Some(src);
        }
        match entry.kind {
            Kind::Local => return Some(dst),
            Kind::Reject | Kind::Throw => return None,
            Kind::Unicast => {}
        }
        let hop = entry.hop?;
        // IPv4 picks an address on the gateway's subnet (inet_select_addr); IPv6 compares
        // with the destination (RFC 6724 longest matching prefix, simplified).
        let target = match hop.gateway {
            Some(gw) if dst.is_ipv4() && gw.is_ipv4() => gw,
            _ => dst,
        };
        let usable = |a: &&Addr| {
            a.addr.is_ipv4() == dst.is_ipv4()
                && a.preferred
                // Link-local sources only towards link-local destinations.
                && (!is_link_local(a.addr) || is_link_local(dst))
        };
        let on_link = |a: &&Addr| {
            let w = width(a.addr);
            mask(ip_bits(a.addr), a.prefix_len, w) == mask(ip_bits(target), a.prefix_len, w)
        };
        let egress = || {
            self.addrs
                .iter()
                .filter(|a| a.ifindex == hop.ifindex)
                .filter(usable)
        };
        egress()
            .filter(|a| on_link(a) && !a.secondary)
            .chain(egress().filter(on_link))
            .chain(egress().filter(|a| !a.secondary))
            .chain(egress())
            .chain(
                self.addrs
                    .iter()
                    .filter(usable)
                    .filter(|a| !a.addr.is_loopback()),
            )
            .map(|a| a.addr)
            .next()
    }
}

fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    }
}

fn is_multicast_or_unspecified(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_multicast() || v4.is_unspecified() || v4.is_broadcast(),
        IpAddr::V6(v6) => v6.is_multicast() || v6.is_unspecified(),
    }
}
