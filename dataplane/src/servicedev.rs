//! kxp's service device: a veth pair that kxp creates in its own network namespace and
//! removes when it stops.
//!
//! Its dataplane side (`NAME-dp`, one receive queue per worker) carries the first AF_XDP
//! socket of every worker. That socket is the UMEM's own (it registers the UMEM, see
//! crate::afxdp), and every other socket shares the UMEM through it. Interfaces kxp attaches to come and go with the pods, so the
//! UMEM's socket must sit on a device that lives exactly as long as kxp: this one.
//!
//! The host side (`NAME`, default `kxp0`) is where the node's own connections to Service
//! addresses go: kxp routes the Service CIDRs, ClusterIPs, externalIPs and LoadBalancer
//! IPs to it ([`Routes`]), so a host process, a hostNetwork pod or the kubelet connecting
//! to a ClusterIP sends its packets through the pair to kxp's sockets, where they are
//! translated like any other (kube-proxy catches them in netfilter's OUTPUT hook). The
//! host side is NOARP: the kernel sends to the device's own MAC without asking, and kxp's
//! answers come back the same way, delivered to the host as received on `NAME`.
//!
//! A kxp killed with SIGKILL leaves the pair behind; the next start replaces it, and
//! `kxp cleanup` removes it.

use std::collections::HashSet;
use std::io;
use std::net::IpAddr;

use futures::TryStreamExt;
use ipnet::IpNet;
use rtnetlink::packet_route::link::{
    AfSpecInet, AfSpecUnspec, InetDevConf, InfoData, InfoKind, InfoVeth, LinkAttribute,
};
use rtnetlink::packet_route::route::{RouteProtocol, RouteScope};
use rtnetlink::{Handle, LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder};

/// The routing protocol number on kxp's routes (`ip route show proto 201`).
pub const ROUTE_PROTO: u8 = 201;

/// The suffix of the dataplane side's name.
pub const DP_SUFFIX: &str = "-dp";

/// Creating or removing the service device failed.
#[derive(Debug, thiserror::Error)]
pub enum ServiceDeviceError {
    #[error(
        "service device name {name:?} is not usable: give 1 to {max} characters, no '/', ':' or \
         spaces (kxp.serviceDevice)"
    )]
    BadName { name: String, max: usize },
    #[error("cannot {op}: {detail}")]
    Nft { op: &'static str, detail: String },
    #[error("cannot {op} kxp's service device {name}: {source}")]
    Netlink {
        op: &'static str,
        name: String,
        #[source]
        source: io::Error,
    },
}

/// The veth pair, deleted on drop.
#[derive(Debug)]
pub struct ServiceDevice {
    /// The host side (routes may point here).
    pub host: String,
    /// The dataplane side (kxp's sockets sit here).
    pub dp: String,
    pub host_ifindex: u32,
    pub dp_ifindex: u32,
    pub host_mac: [u8; 6],
    pub dp_mac: [u8; 6],
    /// Left in place on drop (see [`ServiceDevice::keep`]).
    keep: bool,
}

fn mac_of(name: &str) -> [u8; 6] {
    let text =
        std::fs::read_to_string(format!("/sys/class/net/{name}/address")).unwrap_or_default();
    let mut mac = [0u8; 6];
    for (m, part) in mac.iter_mut().zip(text.trim().split(':')) {
        *m = u8::from_str_radix(part, 16).unwrap_or(0);
    }
    mac
}

fn runtime() -> io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

async fn index_of(handle: &Handle, name: &str) -> Option<u32> {
    let mut links = handle.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(m)) => Some(m.header.index),
        _ => None,
    }
}

fn netlink_err(
    op: &'static str,
    name: &str,
) -> impl FnOnce(rtnetlink::Error) -> ServiceDeviceError {
    let name = name.to_string();
    move |e| ServiceDeviceError::Netlink {
        op,
        name,
        source: io::Error::other(e.to_string()),
    }
}

/// A runtime of its own and a netlink handle on it, for something kept about `dev`.
fn session(dev: &str) -> Result<(tokio::runtime::Runtime, Handle), ServiceDeviceError> {
    let io_err = |op: &'static str| {
        let name = dev.to_string();
        move |source: io::Error| ServiceDeviceError::Netlink { op, name, source }
    };
    let rt = runtime().map_err(io_err("start a netlink runtime for"))?;
    let handle = rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(io_err("open netlink for"))?;
        tokio::spawn(conn);
        Ok::<_, ServiceDeviceError>(handle)
    })?;
    Ok((rt, handle))
}

/// Runs `f` with a netlink handle in the calling thread's network namespace.
fn with_handle<T>(
    name: &str,
    f: impl AsyncFnOnce(&Handle) -> Result<T, ServiceDeviceError>,
) -> Result<T, ServiceDeviceError> {
    let io_err = |op: &'static str| {
        let name = name.to_string();
        move |source: io::Error| ServiceDeviceError::Netlink { op, name, source }
    };
    let rt = runtime().map_err(io_err("start a runtime for"))?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(io_err("open netlink for"))?;
        tokio::spawn(conn);
        f(&handle).await
    })
}

impl ServiceDevice {
    /// Creates the pair `host` / `host-dp` (replacing one a dead kxp left), with `queues`
    /// receive and transmit queues on the dataplane side, both ends up. With `adopt`, a
    /// pair the previous kxp left with that many queues is kept as it is (with its routes,
    /// which the node's own connections to Services keep using across a restart).
    ///
    /// # Errors
    /// A bad name, or what netlink answered.
    pub fn create(
        host: &str,
        queues: u32,
        adopt: bool,
    ) -> Result<ServiceDevice, ServiceDeviceError> {
        let dp = format!("{host}{DP_SUFFIX}");
        let max = libc::IFNAMSIZ - 1 - DP_SUFFIX.len();
        if host.is_empty()
            || host.len() > max
            || host
                .bytes()
                .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace())
        {
            return Err(ServiceDeviceError::BadName {
                name: host.to_string(),
                max,
            });
        }
        let q = queues.max(1);
        if adopt && let Some(dev) = ServiceDevice::adopt(host, &dp, q) {
            return Ok(dev);
        }
        let (host_ifindex, dp_ifindex) = with_handle(host, async |h| {
            if let Some(old) = index_of(h, host).await {
                h.link()
                    .del(old)
                    .execute()
                    .await
                    .map_err(netlink_err("remove the stale", host))?;
            }
            // Both ends with `q` queues: native XDP on a veth wants at least as many
            // receive queues as its peer has transmit queues.
            let peer = LinkMessageBuilder::<LinkUnspec>::new()
                .name(host.to_string())
                .append_extra_attribute(LinkAttribute::NumRxQueues(q))
                .append_extra_attribute(LinkAttribute::NumTxQueues(q))
                .build();
            let msg = LinkMessageBuilder::<LinkVeth>::new_with_info_kind(InfoKind::Veth)
                .name(dp.clone())
                .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
                .append_extra_attribute(LinkAttribute::NumRxQueues(q))
                .append_extra_attribute(LinkAttribute::NumTxQueues(q))
                .up()
                .build();
            h.link()
                .add(msg)
                .execute()
                .await
                .map_err(netlink_err("create", host))?;
            let host_ifindex = index_of(h, host).await.unwrap_or(0);
            let dp_ifindex = index_of(h, &dp).await.unwrap_or(0);
            h.link()
                .set(
                    LinkUnspec::new_with_index(host_ifindex)
                        .arp(false)
                        .up()
                        .build(),
                )
                .execute()
                .await
                .map_err(netlink_err("bring up", host))?;
            Ok((host_ifindex, dp_ifindex))
        })?;
        ServiceDevice::accept_local(host, &dp);
        Ok(ServiceDevice {
            host_mac: mac_of(host),
            dp_mac: mac_of(&dp),
            host: host.to_string(),
            dp,
            host_ifindex,
            dp_ifindex,
            keep: false,
        })
    }

    /// The pair a previous kxp left, if both ends are there, peers of each other, with
    /// `queues` queues, and up.
    fn adopt(host: &str, dp: &str, queues: u32) -> Option<ServiceDevice> {
        let read = |dev: &str, what: &str| {
            std::fs::read_to_string(format!("/sys/class/net/{dev}/{what}"))
                .ok()
                .and_then(|v| v.trim().parse::<u32>().ok())
        };
        let (host_ifindex, dp_ifindex) = (read(host, "ifindex")?, read(dp, "ifindex")?);
        let rx = std::fs::read_dir(format!("/sys/class/net/{dp}/queues"))
            .ok()?
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("rx-"))
            .count();
        let up = |dev: &str| {
            std::fs::read_to_string(format!("/sys/class/net/{dev}/flags"))
                .ok()
                .and_then(|v| u32::from_str_radix(v.trim().trim_start_matches("0x"), 16).ok())
                .is_some_and(|f| f & libc::IFF_UP as u32 != 0)
        };
        if read(host, "iflink")? != dp_ifindex || rx != queues as usize || !up(host) || !up(dp) {
            return None;
        }
        ServiceDevice::accept_local(host, dp);
        tracing::info!(
            device = host,
            "kept the service device the previous kxp left"
        );
        Some(ServiceDevice {
            host_mac: mac_of(host),
            dp_mac: mac_of(dp),
            host: host.to_string(),
            dp: dp.to_string(),
            host_ifindex,
            dp_ifindex,
            keep: false,
        })
    }

    /// Leaves the pair (and its routes) in place when this value goes, for the next kxp.
    pub fn keep(&mut self) {
        self.keep = true;
    }

    /// The pair a running kxp uses, taken up ahead of a hand-over without changing it:
    /// only if it is there as this kxp would make it (see [`ServiceDevice::create`]); kept
    /// when this value goes, until [`ServiceDevice::own`].
    pub fn existing(host: &str, queues: u32) -> Option<ServiceDevice> {
        let dp = format!("{host}{DP_SUFFIX}");
        if host.is_empty() || dp.len() >= libc::IFNAMSIZ {
            return None;
        }
        let mut dev = ServiceDevice::adopt(host, &dp, queues.max(1))?;
        dev.keep = true;
        Some(dev)
    }

    /// Once this kxp forwards: the pair is its own (removed when this value goes, unless
    /// kept again).
    pub fn own(&mut self) {
        self.keep = false;
    }

    /// The node's own connections to its NodePorts come back to it through the pair
    /// with a node address as source: accept them (`accept_local`) on both ends, kxp's
    /// own devices. Set over netlink (`IFLA_INET_CONF`, `CAP_NET_ADMIN`), not through
    /// `/proc/sys`, which a container that is not privileged has read-only.
    fn accept_local(host: &str, dp: &str) {
        for dev in [host, dp] {
            let r = with_handle(dev, async |h| {
                let Some(index) = index_of(h, dev).await else {
                    return Ok(());
                };
                let mut conf = InetDevConf::default();
                conf.accept_local = 1;
                let msg = LinkUnspec::new_with_index(index)
                    .append_extra_attribute(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet(
                        vec![AfSpecInet::DevConfRequest(conf)],
                    )]))
                    .build();
                h.link()
                    .set(msg)
                    .execute()
                    .await
                    .map_err(netlink_err("set accept_local on", dev))
            });
            if let Err(e) = r {
                tracing::warn!(device = dev, error = %e, "cannot set accept_local; the node's own connections to its NodePorts will fail");
            }
        }
    }

    /// Whether `name` is one of the pair's two ends (never attached as a pod interface).
    pub fn owns(&self, name: &str) -> bool {
        name == self.host || name == self.dp
    }
}

/// Removes the service device `host` (and its peer) if it exists; returns whether it did.
///
/// # Errors
/// What netlink answered.
pub fn remove(host: &str) -> Result<bool, ServiceDeviceError> {
    with_handle(host, async |h| match index_of(h, host).await {
        Some(i) => h
            .link()
            .del(i)
            .execute()
            .await
            .map(|()| true)
            .map_err(netlink_err("remove", host)),
        None => Ok(false),
    })
}

impl Drop for ServiceDevice {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        if let Err(e) = remove(&self.host) {
            tracing::warn!(error = %e, "kxp's service device was not removed");
        }
    }
}

/// The routes that send the node's own traffic for Service addresses into the service
/// device, kept equal to a wanted set by difference. They go with the device.
#[derive(Debug)]
pub struct Routes {
    rt: tokio::runtime::Runtime,
    handle: Handle,
    dev: String,
    ifindex: u32,
    have: HashSet<IpNet>,
}

impl Routes {
    /// Routes through `dev` (the host side, index `ifindex`).
    ///
    /// # Errors
    /// Netlink cannot be opened.
    pub fn new(dev: &str, ifindex: u32) -> Result<Routes, ServiceDeviceError> {
        let (rt, handle) = session(dev)?;
        Ok(Routes {
            rt,
            handle,
            dev: dev.to_string(),
            ifindex,
            have: HashSet::new(),
        })
    }

    fn message(&self, net: IpNet) -> rtnetlink::packet_route::route::RouteMessage {
        let b = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(net.network(), net.prefix_len())
            .unwrap_or_else(|_| RouteMessageBuilder::<IpAddr>::new());
        b.output_interface(self.ifindex)
            .protocol(RouteProtocol::Other(ROUTE_PROTO))
            .scope(RouteScope::Link)
            .build()
    }

    /// Adds the routes `want` lacks and removes those it no longer has. Returns the first
    /// failure (the others are still tried; the next sync retries what failed).
    ///
    /// # Errors
    /// What netlink answered for a route.
    pub fn sync(&mut self, want: &HashSet<IpNet>) -> Result<(), ServiceDeviceError> {
        let add: Vec<IpNet> = want.difference(&self.have).copied().collect();
        let del: Vec<IpNet> = self.have.difference(want).copied().collect();
        let mut first = None;
        for net in del {
            let msg = self.message(net);
            let r = self.rt.block_on(self.handle.route().del(msg).execute());
            match r {
                Ok(()) => {
                    self.have.remove(&net);
                }
                Err(e) => {
                    // Gone already (e.g. with its device): not wanted either way.
                    self.have.remove(&net);
                    tracing::debug!(route = %net, error = %e, "removing a service route");
                }
            }
        }
        for net in add {
            let msg = self.message(net);
            match self
                .rt
                .block_on(self.handle.route().add(msg).replace().execute())
            {
                Ok(()) => {
                    self.have.insert(net);
                }
                Err(e) => {
                    first.get_or_insert(ServiceDeviceError::Netlink {
                        op: "route a Service address through",
                        name: self.dev.clone(),
                        source: io::Error::other(format!("{net}: {e}")),
                    });
                }
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The routes in place.
    pub fn installed(&self) -> &HashSet<IpNet> {
        &self.have
    }
}

fn is_link_local(a: IpAddr) -> bool {
    match a {
        IpAddr::V4(v) => v.is_link_local(),
        IpAddr::V6(v) => (v.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// The prefixes to route into the service device: the Service CIDRs, and the addresses
/// none of them covers.
pub fn wanted_routes(
    cidrs: &HashSet<IpNet>,
    addrs: impl Iterator<Item = IpAddr>,
) -> HashSet<IpNet> {
    let mut out: HashSet<IpNet> = cidrs.iter().map(IpNet::trunc).collect();
    for a in addrs {
        if !cidrs.iter().any(|c| c.contains(&a)) {
            out.insert(IpNet::from(a));
        }
    }
    out
}

/// The routing table kxp's NodePort rules look up (`ip route show table 201`).
pub const NODEPORT_TABLE: u32 = 201;

/// The node's own connections to a NodePort on one of its addresses. Those are local
/// destinations, which the kernel's first policy rule (`0: from all lookup local`)
/// delivers before any route is looked at. So kxp moves that rule to priority 1 (adding
/// the copy before removing the original, so local delivery never stops) and puts
/// before it, for locally generated TCP/UDP/SCTP to the NodePorts' port span, a lookup
/// in table 201, which routes only the NodePort addresses, through the service device.
/// Anything else falls through to the local table as before. When kxp stops, the
/// original rule is put back and kxp's are removed; a killed kxp leaves them (local
/// delivery keeps working through the copy at priority 1) and the next start or
/// `kxp cleanup` puts things back.
#[derive(Debug)]
pub struct NodePortRules {
    rt: tokio::runtime::Runtime,
    handle: Handle,
    dev: String,
    ifindex: u32,
    /// What is installed: the addresses routed in table 201 and the rules' port spans.
    addrs: Vec<IpAddr>,
    spans: Vec<Span>,
    /// Families whose local rule kxp moved to priority 1.
    moved: Vec<AddressFamilyKind>,
    /// Left in place on drop (see [`NodePortRules::keep`]).
    keep: bool,
}

/// One rule: family, protocol, port span, and whether it is for the node's own
/// (locally generated) packets only.
type Span = (AddressFamilyKind, u8, u16, u16, bool);

fn span_rule(s: &Span) -> rtnetlink::packet_route::rule::RuleMessage {
    rule_message_iif(s.0, 0, NODEPORT_TABLE, Some((s.1, s.2, s.3)), s.4)
}

/// IPv4 or IPv6, for rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressFamilyKind {
    V4,
    V6,
}

fn family_of(a: IpAddr) -> AddressFamilyKind {
    if a.is_ipv4() {
        AddressFamilyKind::V4
    } else {
        AddressFamilyKind::V6
    }
}

/// A rule `pref: [iif lo] ipproto P dport LO-HI lookup TABLE proto 201`, or without a
/// span `pref: lookup TABLE`.
fn rule_message(
    family: AddressFamilyKind,
    pref: u32,
    table: u32,
    span: Option<(u8, u16, u16)>,
) -> rtnetlink::packet_route::rule::RuleMessage {
    rule_message_iif(family, pref, table, span, true)
}

fn rule_message_iif(
    family: AddressFamilyKind,
    pref: u32,
    table: u32,
    span: Option<(u8, u16, u16)>,
    local_only: bool,
) -> rtnetlink::packet_route::rule::RuleMessage {
    use rtnetlink::packet_route::AddressFamily;
    use rtnetlink::packet_route::IpProtocol;
    use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute, RuleMessage, RulePortRange};
    let mut m = RuleMessage::default();
    m.header.family = match family {
        AddressFamilyKind::V4 => AddressFamily::Inet,
        AddressFamilyKind::V6 => AddressFamily::Inet6,
    };
    m.header.action = RuleAction::ToTable;
    m.header.table = if table < 256 { table as u8 } else { 0 };
    m.attributes.push(RuleAttribute::Priority(pref));
    m.attributes.push(RuleAttribute::Table(table));
    if let Some((proto, lo, hi)) = span {
        if local_only {
            m.attributes.push(RuleAttribute::Iifname("lo".into()));
        }
        m.attributes
            .push(RuleAttribute::IpProtocol(IpProtocol::from(proto)));
        m.attributes
            .push(RuleAttribute::DestinationPortRange(RulePortRange {
                start: lo,
                end: hi,
            }));
        m.attributes
            .push(RuleAttribute::Protocol(RouteProtocol::Other(ROUTE_PROTO)));
    }
    m
}

const LOCAL_TABLE: u32 = 255;

impl NodePortRules {
    /// Rules and routes through `dev` (the host side, index `ifindex`).
    ///
    /// # Errors
    /// Netlink cannot be opened.
    pub fn new(dev: &str, ifindex: u32) -> Result<NodePortRules, ServiceDeviceError> {
        let (rt, handle) = session(dev)?;
        Ok(NodePortRules {
            rt,
            handle,
            dev: dev.to_string(),
            ifindex,
            addrs: Vec::new(),
            spans: Vec::new(),
            moved: Vec::new(),
            keep: false,
        })
    }

    fn err(&self, op: &'static str, e: impl std::fmt::Display) -> ServiceDeviceError {
        ServiceDeviceError::Netlink {
            op,
            name: self.dev.clone(),
            source: io::Error::other(e.to_string()),
        }
    }

    fn add_rule(
        &self,
        m: rtnetlink::packet_route::rule::RuleMessage,
    ) -> Result<(), rtnetlink::Error> {
        let mut req = self.handle.rule().add();
        *req.message_mut() = m;
        self.rt.block_on(req.execute())
    }

    fn del_rule(
        &self,
        m: rtnetlink::packet_route::rule::RuleMessage,
    ) -> Result<(), rtnetlink::Error> {
        self.rt.block_on(self.handle.rule().del(m).execute())
    }

    fn route(&self, a: IpAddr) -> rtnetlink::packet_route::route::RouteMessage {
        let b = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(a, if a.is_ipv4() { 32 } else { 128 })
            .unwrap_or_else(|_| RouteMessageBuilder::<IpAddr>::new());
        let b = b
            .output_interface(self.ifindex)
            .table_id(NODEPORT_TABLE)
            .protocol(RouteProtocol::Other(ROUTE_PROTO))
            .scope(RouteScope::Link);
        b.pref_source(a)
            .unwrap_or_else(|_| RouteMessageBuilder::<IpAddr>::new())
            .build()
    }

    /// Whether the installed rules catch answers to the SNAT port range.
    pub fn catches_snat(&self) -> bool {
        self.spans.iter().any(|s| !s.4)
    }

    /// Routes `addrs` (the node's addresses) through the service device in table 201,
    /// and looks that table up for the node's own connections to the NodePorts `ports`
    /// (protocol number, port) and for any packet to the SNAT port range `snat` (answers
    /// of masqueraded flows that reach the node by an interface kxp is not attached to,
    /// such as an overlay device). By difference.
    ///
    /// # Errors
    /// What netlink answered; the previous state stays in force for what failed.
    pub fn sync(
        &mut self,
        addrs: &[IpAddr],
        ports: &[(u8, u16)],
        snat: Option<(u16, u16)>,
    ) -> Result<(), ServiceDeviceError> {
        let mut want_addrs: Vec<IpAddr> = addrs
            .iter()
            .copied()
            .filter(|a| !a.is_loopback() && !is_link_local(*a))
            .collect();
        want_addrs.sort();
        want_addrs.dedup();
        let mut spans: Vec<Span> = Vec::new();
        for fam in [AddressFamilyKind::V4, AddressFamilyKind::V6] {
            if !want_addrs.iter().any(|&a| family_of(a) == fam) {
                continue;
            }
            for proto in [6u8, 17, 132] {
                let ps = ports.iter().filter(|(p, _)| *p == proto).map(|(_, n)| *n);
                if let (Some(lo), Some(hi)) = (ps.clone().min(), ps.max()) {
                    spans.push((fam, proto, lo, hi, true));
                }
                // The kernel refuses a rule port range ending at 65535 (`end < 0xffff`):
                // an answer to SNAT port 65535 by an unattached interface is not caught.
                if let Some((lo, hi)) = snat
                    && lo <= hi.min(65_534)
                {
                    spans.push((fam, proto, lo, hi.min(65_534), false));
                }
            }
        }
        if spans == self.spans && want_addrs == self.addrs {
            return Ok(());
        }
        // Routes first, so that a rule never points at an empty table.
        for &a in want_addrs.iter().filter(|a| !self.addrs.contains(a)) {
            let r = self
                .rt
                .block_on(self.handle.route().add(self.route(a)).replace().execute());
            r.map_err(|e| self.err("route a node address through", format!("{a}: {e}")))?;
        }
        for fam in [AddressFamilyKind::V4, AddressFamilyKind::V6] {
            let needed = spans.iter().any(|s| s.0 == fam);
            if needed && !self.moved.contains(&fam) {
                // The copy first: local delivery never stops.
                match self.add_rule(rule_message(fam, 1, LOCAL_TABLE, None)) {
                    Ok(()) => {}
                    Err(e) if e.to_string().contains("File exists") => {}
                    Err(e) => return Err(self.err("add the local rule at priority 1 for", e)),
                }
                self.moved.push(fam);
            }
        }
        for s in spans.iter().filter(|s| !self.spans.contains(s)) {
            if let Err(e) = self.add_rule(span_rule(s))
                && !e.to_string().contains("File exists")
            {
                return Err(self.err("add a policy rule for", e));
            }
        }
        let old: Vec<Span> = self
            .spans
            .iter()
            .copied()
            .filter(|s| !spans.contains(s))
            .collect();
        for s in old {
            let _ = self.del_rule(span_rule(&s));
        }
        // Now that kxp's rules come first, the original local rule goes.
        for &fam in &self.moved {
            let _ = self.del_rule(rule_message(fam, 0, LOCAL_TABLE, None));
        }
        for &a in self.addrs.iter().filter(|a| !want_addrs.contains(a)) {
            let _ = self
                .rt
                .block_on(self.handle.route().del(self.route(a)).execute());
        }
        self.spans = spans;
        self.addrs = want_addrs;
        Ok(())
    }

    /// Puts the local rule back at priority 0 and removes kxp's rules and routes.
    pub fn clear(&mut self) {
        for &fam in &self.moved {
            let _ = self.add_rule(rule_message(fam, 0, LOCAL_TABLE, None));
        }
        for s in std::mem::take(&mut self.spans) {
            let _ = self.del_rule(span_rule(&s));
        }
        for fam in std::mem::take(&mut self.moved) {
            let _ = self.del_rule(rule_message(fam, 1, LOCAL_TABLE, None));
        }
        for a in std::mem::take(&mut self.addrs) {
            let _ = self
                .rt
                .block_on(self.handle.route().del(self.route(a)).execute());
        }
    }
}

impl NodePortRules {
    /// Leaves the rules in place when this value goes, for the next kxp (which starts by
    /// putting them back in order with [`cleanup_rules`]).
    pub fn keep(&mut self) {
        self.keep = true;
    }
}

impl Drop for NodePortRules {
    fn drop(&mut self) {
        if !self.keep {
            self.clear();
        }
    }
}

/// What a killed kxp left in the policy rules: its NodePort rules (table 201) are
/// removed and the local rule is put back at priority 0 (its copy at 1 removed).
/// Returns how many rules were changed.
///
/// # Errors
/// What netlink answered.
pub fn cleanup_rules() -> Result<usize, ServiceDeviceError> {
    use rtnetlink::IpVersion;
    use rtnetlink::packet_route::rule::RuleAttribute;
    with_handle("kxp0", async |h| {
        let mut changed = 0;
        for (ver, fam) in [
            (IpVersion::V4, AddressFamilyKind::V4),
            (IpVersion::V6, AddressFamilyKind::V6),
        ] {
            let rules: Vec<_> = h
                .rule()
                .get(ver)
                .execute()
                .try_collect()
                .await
                .map_err(netlink_err("list the policy rules of", "kxp0"))?;
            let table = |m: &rtnetlink::packet_route::rule::RuleMessage| {
                m.attributes
                    .iter()
                    .find_map(|a| match a {
                        RuleAttribute::Table(t) => Some(*t),
                        _ => None,
                    })
                    .unwrap_or(u32::from(m.header.table))
            };
            let pref = |m: &rtnetlink::packet_route::rule::RuleMessage| {
                m.attributes
                    .iter()
                    .find_map(|a| match a {
                        RuleAttribute::Priority(p) => Some(*p),
                        _ => None,
                    })
                    .unwrap_or(0)
            };
            let mut local_at_0 = rules
                .iter()
                .any(|m| table(m) == LOCAL_TABLE && pref(m) == 0);
            let local_at_1 = rules
                .iter()
                .any(|m| table(m) == LOCAL_TABLE && pref(m) == 1);
            if !local_at_0 && local_at_1 {
                let mut req = h.rule().add();
                *req.message_mut() = rule_message(fam, 0, LOCAL_TABLE, None);
                req.execute()
                    .await
                    .map_err(netlink_err("restore the local rule of", "kxp0"))?;
                local_at_0 = true;
                changed += 1;
            }
            for m in rules {
                let ours = table(&m) == NODEPORT_TABLE;
                let copy = local_at_0 && table(&m) == LOCAL_TABLE && pref(&m) == 1;
                if (ours || copy) && h.rule().del(m).execute().await.is_ok() {
                    changed += 1;
                }
            }
        }
        Ok(changed)
    })
}

/// The source MAC of the packets a worker hands to the kernel for the CNI's policy
/// (`kxp.networkPolicy: kernel`): the kernel's rules ([`KernelPolicy`])
/// know them by it, and masquerade those from [`HANDOVER_MASQ_MAC`].
pub const HANDOVER_MAC: [u8; 6] = [0x02, 0x6b, 0x78, 0x70, 0x00, 0x01];
/// See [`HANDOVER_MAC`].
pub const HANDOVER_MASQ_MAC: [u8; 6] = [0x02, 0x6b, 0x78, 0x70, 0x00, 0x02];

/// The nftables table of `kxp.networkPolicy: kernel` ([`KernelPolicy`]).
pub const HANDOVER_TABLE: &str = "kxp_policy_handover";
/// The routing table, and the policy rule's priority, that send the answers of handed-over
/// connections back to kxp.
pub const HANDOVER_ROUTE_TABLE: u32 = 202;
const HANDOVER_RULE_PREF: u32 = 2;
/// Connection mark bits of handed-over connections (masqueraded by the kernel, or not),
/// and the packet mark bit their answers get (looked up in [`HANDOVER_ROUTE_TABLE`]). Bits
/// neither kube-proxy (0x4000, 0x8000), Calico (0xffff0000) nor Cilium (0x0f00) use.
const CT_HANDOVER: u32 = 0x1000;
const CT_HANDOVER_MASQ: u32 = 0x2000;
const MARK_ANSWER: u32 = 0x1000;

/// `kxp.networkPolicy: kernel`: what makes the kernel carry the connections kxp
/// translates to this node's pods, so that the CNI's own policy (any kind of object)
/// applies to them as it does under kube-proxy. Removed on drop, unless kept for the next
/// kxp.
///
/// kxp translates the destination of such a connection (DNAT) and hands its packets to
/// the kernel through the service device, from [`HANDOVER_MAC`] (or
/// [`HANDOVER_MASQ_MAC`] when kube-proxy would masquerade it). The kernel
/// sees what it sees under kube-proxy after PREROUTING's DNAT: it tracks the connection,
/// forwards its packets to the pod through FORWARD, where the CNI filters them, and
/// masquerades them in POSTROUTING when asked (nftables rules in [`HANDOVER_TABLE`], which
/// mark these connections). The pod's answers reach the kernel (the steering program
/// leaves the flows the kernel tracks to it), which un-masquerades them and, by their
/// connection's mark, routes them into the service device (a policy rule at priority
/// [`HANDOVER_RULE_PREF`] to [`HANDOVER_ROUTE_TABLE`]), where kxp gives them the Service's
/// address back. The kernel sees both directions: its connection tracking and the CNI's
/// stateful rules (`ct state established`, `invalid drop`) hold.
#[derive(Debug)]
pub struct KernelPolicy {
    rt: tokio::runtime::Runtime,
    handle: Handle,
    dev: String,
    ifindex: u32,
    keep: bool,
}

/// Runs an nftables script.
fn nft(script: &str) -> Result<(), String> {
    match crate::tool::run("nft", &["-f", "-"], Some(script)) {
        Some(r) => r.map(drop),
        None => Err("nft (nftables) is not installed".into()),
    }
}

fn mac_text(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The policy rule `pref 2: fwmark 0x1000/0x1000 lookup 202`.
fn answer_rule(family: AddressFamilyKind) -> rtnetlink::packet_route::rule::RuleMessage {
    use rtnetlink::packet_route::rule::RuleAttribute;
    let mut m = rule_message(family, HANDOVER_RULE_PREF, HANDOVER_ROUTE_TABLE, None);
    m.attributes.push(RuleAttribute::FwMark(MARK_ANSWER));
    m.attributes.push(RuleAttribute::FwMask(MARK_ANSWER));
    m
}

impl KernelPolicy {
    /// Installs (or replaces) the rules and routes for kxp's service device `dev`
    /// (the host side, index `ifindex`); the kernel masquerades into the source ports
    /// `masq_ports` (kept apart from kxp's own SNAT range).
    ///
    /// # Errors
    /// [`ServiceDeviceError::Nft`] when `nft` is missing or refuses the rules,
    /// [`ServiceDeviceError::Netlink`] for the routes and policy rules.
    pub fn install(
        dev: &str,
        ifindex: u32,
        masq_ports: (u16, u16),
    ) -> Result<KernelPolicy, ServiceDeviceError> {
        let (plain, masq) = (mac_text(HANDOVER_MAC), mac_text(HANDOVER_MASQ_MAC));
        let (lo, hi) = masq_ports;
        let script = format!(
            "add table inet {HANDOVER_TABLE}\n\
             delete table inet {HANDOVER_TABLE}\n\
             table inet {HANDOVER_TABLE} {{\n\
             \x20 chain prerouting {{\n\
             \x20   type filter hook prerouting priority mangle; policy accept;\n\
             \x20   iifname \"{dev}\" ether saddr {plain} ct mark set ct mark | {CT_HANDOVER:#x}\n\
             \x20   iifname \"{dev}\" ether saddr {masq} ct mark set ct mark | {both:#x}\n\
             \x20   ct direction reply ct mark & {CT_HANDOVER:#x} == {CT_HANDOVER:#x} meta mark set meta mark | {MARK_ANSWER:#x}\n\
             \x20 }}\n\
             \x20 chain postrouting {{\n\
             \x20   type nat hook postrouting priority srcnat; policy accept;\n\
             \x20   ct direction original ct mark & {CT_HANDOVER_MASQ:#x} == {CT_HANDOVER_MASQ:#x} meta l4proto {{ tcp, udp, sctp }} masquerade to :{lo}-{hi} fully-random\n\
             \x20   ct direction original ct mark & {CT_HANDOVER_MASQ:#x} == {CT_HANDOVER_MASQ:#x} masquerade\n\
             \x20 }}\n\
             }}\n",
            both = CT_HANDOVER | CT_HANDOVER_MASQ,
        );
        nft(&script).map_err(|detail| ServiceDeviceError::Nft {
            op: "add the nftables rules of kxp.networkPolicy: kernel",
            detail,
        })?;
        let (rt, handle) = session(dev)?;
        let p = KernelPolicy {
            rt,
            handle,
            dev: dev.to_string(),
            ifindex,
            keep: false,
        };
        let err = |op, e: rtnetlink::Error| ServiceDeviceError::Netlink {
            op,
            name: dev.to_string(),
            source: io::Error::other(e.to_string()),
        };
        // The route first, so that the rule never points at an empty table.
        for fam in [AddressFamilyKind::V4, AddressFamilyKind::V6] {
            p.rt.block_on(
                p.handle
                    .route()
                    .add(p.default_route(fam))
                    .replace()
                    .execute(),
            )
            .map_err(|e| err("route the answers of handed-over connections through", e))?;
            let mut req = p.handle.rule().add();
            *req.message_mut() = answer_rule(fam);
            match p.rt.block_on(req.execute()) {
                Ok(()) => {}
                Err(e) if e.to_string().contains("File exists") => {}
                Err(e) => return Err(err("add the policy rule of handed-over answers for", e)),
            }
        }
        Ok(p)
    }

    fn default_route(
        &self,
        fam: AddressFamilyKind,
    ) -> rtnetlink::packet_route::route::RouteMessage {
        let any: IpAddr = match fam {
            AddressFamilyKind::V4 => std::net::Ipv4Addr::UNSPECIFIED.into(),
            AddressFamilyKind::V6 => std::net::Ipv6Addr::UNSPECIFIED.into(),
        };
        RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(any, 0)
            .unwrap_or_else(|_| RouteMessageBuilder::<IpAddr>::new())
            .output_interface(self.ifindex)
            .table_id(HANDOVER_ROUTE_TABLE)
            .protocol(RouteProtocol::Other(ROUTE_PROTO))
            .scope(RouteScope::Link)
            .build()
    }

    /// Leaves everything in place on drop (the next kxp replaces it).
    pub fn keep(&mut self) {
        self.keep = true;
    }
}

impl Drop for KernelPolicy {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        for fam in [AddressFamilyKind::V4, AddressFamilyKind::V6] {
            let _ = self
                .rt
                .block_on(self.handle.rule().del(answer_rule(fam)).execute());
            let _ = self
                .rt
                .block_on(self.handle.route().del(self.default_route(fam)).execute());
        }
        if let Err(e) = remove_kernel_policy() {
            tracing::warn!(device = %self.dev, "{e}");
        }
    }
}

/// Removes what [`KernelPolicy`] installs, if it is there (the nftables table and the
/// policy rules; the routes go with the service device); `true` if anything was.
///
/// # Errors
/// [`ServiceDeviceError::Nft`] when `nft` refuses.
pub fn remove_kernel_policy() -> Result<bool, ServiceDeviceError> {
    let mut removed = false;
    if let Ok((rt, handle)) = session("kxp0") {
        for fam in [AddressFamilyKind::V4, AddressFamilyKind::V6] {
            removed |= rt
                .block_on(handle.rule().del(answer_rule(fam)).execute())
                .is_ok();
        }
    }
    // No nft, or no such table: nothing of kxp's there.
    let listed = crate::tool::run("nft", &["list", "table", "inet", HANDOVER_TABLE], None);
    if !matches!(listed, Some(Ok(_))) {
        return Ok(removed);
    }
    nft(&format!("delete table inet {HANDOVER_TABLE}\n")).map_err(|detail| {
        ServiceDeviceError::Nft {
            op: "remove the nftables rules of kxp.networkPolicy: kernel",
            detail,
        }
    })?;
    Ok(true)
}
