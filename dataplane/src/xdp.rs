//! The XDP steering program and its loader.
//!
//! kxp must see only the traffic it translates: everything else (ARP, the node's own
//! connections, other ports) has to reach the kernel untouched, so the node keeps
//! working. A small XDP program (`bpf/steer.bpf.c`, built by `build.rs` and embedded
//! here) runs on every attached interface and redirects to the AF_XDP socket of the
//! receive queue only:
//!
//! - (a) packets to a Service frontend: `(dst, dport, proto)` in `frontends`
//!   (ClusterIPs, externalIPs, LoadBalancer IPs, NodePorts × node addresses);
//! - (b) replies of masqueraded flows: dst in `local_addrs` and dport in the SNAT
//!   port range;
//! - (c) replies of DNAT-only flows: `(src, sport, proto)` in `endpoints` and dst
//!   not a node address (the node's own traffic to a pod is left to the kernel);
//! - (d) ICMP/ICMPv6 errors quoting a packet of such a flow;
//! - (e) any other TCP/UDP/SCTP packet to a ClusterIP (`cluster_ips`, any port) or to
//!   an address inside a Service CIDR (`service_cidrs`, an LPM trie): kube-proxy
//!   rejects the first (no Service on that port) and drops the second (no Service owns
//!   the address), and so does kxp's engine, which must see them for that. Pings and
//!   other protocols to those addresses stay the kernel's.
//!
//! The Service CIDRs are looked up first, and only for a destination inside the
//! smallest prefix of its family that holds them all (`config`, kept by
//! [`Steering::sync_service_cidrs`]; with one CIDR per family, the usual case, that
//! prefix is the CIDR and no trie is looked up): most of what kxp takes goes to
//! ClusterIPs, and with thousands of Services the `frontends` lookup misses the cache
//! where a compare does not; every other packet pays the compare only (`cargo bench
//! --bench steer`, three runs in `bench/results/steer-20261204.txt`: a packet to
//! one of 10,000 ClusterIPs took 130-170 ns, 70-74 now; an endpoint's reply 177-215 vs
//! 183-202).
//!
//! It is fail-open: with no socket in `xsks` for the queue (kxp starting, restarting or
//! gone), matching packets go to the kernel too. Each [`Steering`] is its own program
//! instance with its own maps, so several interfaces with the same queue numbers work;
//! the control plane feeds each one the same sets through the incremental `sync_*`
//! methods (only the difference reaches the kernel).
//!
//! [`AttachMode::Link`] (the default) attaches through a bpf_link, which the kernel
//! removes when its fd closes, so a crashed kxp leaves nothing behind. The netlink modes
//! ([`AttachMode::Native`], [`AttachMode::Generic`]) outlive the process; they are
//! detached on drop, and [`cleanup_interface`] removes leftovers (`kxp cleanup`).

mod cleanup;
mod error;
mod key;
pub mod pins;
mod stats;
mod sync;
#[allow(unsafe_code)]
mod sys;
#[cfg(test)]
#[allow(unsafe_code)]
mod tests_attach;
#[cfg(test)]
mod tests_prog;
#[cfg(test)]
mod testutil;

use std::collections::HashSet;
use std::fmt;
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsFd, OwnedFd, RawFd};

use ipnet::IpNet;
use libbpf_rs::{ErrorKind, MapCore, MapFlags, MapHandle, Object, Program};

pub use cleanup::cleanup_interface;
pub use error::XdpError;
use error::{attach_hint, detach_hint};
pub use key::SteerKey;
pub use stats::SteerStats;
pub use sync::SyncStats;
use sync::SyncedMap;

/// The program's name in the kernel (`bpftool prog`, [`cleanup_interface`]).
pub const PROG_NAME: &str = "kxp_steer";
/// Receive queues per interface the program can redirect (`xsks` entries).
pub const MAX_QUEUES: u32 = 256;
/// Capacity of `frontends`.
pub const MAX_FRONTENDS: usize = 262_144;
/// Capacity of `endpoints`.
pub const MAX_ENDPOINTS: usize = 262_144;
/// Capacity of `local_addrs`.
pub const MAX_LOCAL_ADDRS: usize = 1024;
/// Capacity of `cluster_ips`.
pub const MAX_CLUSTER_IPS: usize = 65_536;
/// Capacity of `service_cidrs`.
pub const MAX_SERVICE_CIDRS: usize = 256;

/// XDP action values (`enum xdp_action`).
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_REDIRECT: u32 = 4;

/// `config.flags` bit: look inside one 802.1Q / 802.1ad tag (off by default: the
/// workers must then handle tagged frames).
const CFG_STEER_VLAN: u32 = 1;
/// `config.flags` bit: this is kxp's service device; drop instead of passing.
const CFG_SERVICE_DEVICE: u32 = 2;
/// `config.flags` bit: drop, do not pass, a matching packet with no socket on its queue.
const CFG_HOLD: u32 = 4;
/// Size of `struct steer_config`.
const CONFIG_LEN: usize = 32;
/// `config.cover4_len` / `cover6_len`: the family has no Service CIDR.
const COVER_NONE: u8 = 0xff;

// include_bytes! is 1-aligned; libelf wants the ELF image 8-aligned.
#[repr(C, align(8))]
struct Aligned<B: ?Sized>(B);
static OBJ: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/steer.bpf.o")));

/// How to attach the program to an interface.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttachMode {
    /// A bpf_link: the kernel picks native XDP if the driver has it, else generic, and
    /// detaches it when the link's fd closes (also when kxp dies).
    #[default]
    Link,
    /// Netlink, XDP_FLAGS_DRV_MODE: native XDP or an error; outlives the process.
    Native,
    /// Netlink, XDP_FLAGS_SKB_MODE: generic XDP (any device, slower); outlives the process.
    Generic,
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttachMode::Link => "bpf_link",
            AttachMode::Native => "native",
            AttachMode::Generic => "generic",
        })
    }
}

/// Where the kernel runs an attached program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachedAs {
    Native,
    Generic,
}

#[derive(Debug)]
struct Attachment {
    ifname: String,
    ifindex: u32,
    mode: AttachMode,
    /// The bpf_link in [`AttachMode::Link`]; closing it detaches.
    link: Option<OwnedFd>,
}

/// One loaded instance of the steering program (its own maps), attached to at most one
/// interface. Detaches on drop (best effort; see [`Steering::detach`] for errors).
///
/// Interface names resolve, and netlink attach/detach happen, in the network namespace of
/// the calling thread: attach and detach (or drop) a netlink-mode instance from the same
/// namespace. (A detach from elsewhere removes nothing: it only ever removes this very
/// program.) Map updates work from any thread.
pub struct Steering {
    prog: OwnedFd,
    prog_id: u32,
    attachment: Option<Attachment>,
    /// The interface an instance not attached yet is being filled for (name, index).
    intended: Option<(String, u32)>,
    /// Not detached on drop (see [`Steering::keep_attached`]).
    keep: bool,
    xsks: MapHandle,
    config: MapHandle,
    stats: MapHandle,
    frontends: SyncedMap<SteerKey>,
    endpoints: SyncedMap<SteerKey>,
    local_addrs: SyncedMap<IpAddr>,
    cluster_ips: SyncedMap<IpAddr>,
    service_cidrs: SyncedMap<IpNet>,
}

impl fmt::Debug for Steering {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Steering")
            .field("prog_id", &self.prog_id)
            .field("attachment", &self.attachment)
            .finish_non_exhaustive()
    }
}

struct Loaded {
    prog: OwnedFd,
    maps: [MapHandle; 8],
}

const MAP_NAMES: [&str; 8] = [
    "xsks",
    "config",
    "stats",
    "frontends",
    "endpoints",
    "local_addrs",
    "cluster_ips",
    "service_cidrs",
];

fn take_parts(obj: &Object) -> Result<Loaded, XdpError> {
    let prog = obj
        .progs()
        .find(|p| p.name() == PROG_NAME)
        .ok_or(XdpError::MissingInObject {
            what: "program",
            name: PROG_NAME,
        })?;
    let prog = prog
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| XdpError::Load { source: e.into() })?;
    let dup = |name: &'static str| -> Result<MapHandle, XdpError> {
        let map = obj
            .maps()
            .find(|m| m.name() == name)
            .ok_or(XdpError::MissingInObject { what: "map", name })?;
        // dup()s the fd: the handle lives on after the object is closed.
        MapHandle::try_from(&map).map_err(|source| XdpError::Map {
            map: name,
            op: "dup",
            key: None,
            source,
        })
    };
    let [a, b, c, d, e, f, g, h] = MAP_NAMES.map(dup);
    let maps = [a?, b?, c?, d?, e?, f?, g?, h?];
    Ok(Loaded { prog, maps })
}

impl Steering {
    /// Loads a fresh instance of the program (new, empty maps) without attaching it:
    /// for tests and for checking that the kernel accepts it.
    ///
    /// # Errors
    /// [`XdpError::NeedsPrivileges`] without root, [`XdpError::Verifier`] (with the tail
    /// of the verifier log) if the kernel refuses the program, [`XdpError::Load`] else.
    pub fn load() -> Result<Steering, XdpError> {
        let loaded = match sys::load_object(&OBJ.0, take_parts) {
            Ok(parts) => parts?,
            Err(f) if !f.log.is_empty() => {
                return Err(XdpError::Verifier {
                    log: f.log,
                    source: f.error,
                });
            }
            Err(f) if f.error.kind() == ErrorKind::PermissionDenied => {
                return Err(XdpError::NeedsPrivileges {
                    action: "loading the XDP program",
                    source: f.error.into(),
                });
            }
            Err(f) => return Err(XdpError::Load { source: f.error }),
        };
        let prog_id = Program::id_from_fd(loaded.prog.as_fd())
            .map_err(|source| XdpError::ProgInfo { source })?;
        let [
            xsks,
            config,
            stats,
            frontends,
            endpoints,
            local_addrs,
            cluster_ips,
            service_cidrs,
        ] = loaded.maps;
        Ok(Steering {
            prog: loaded.prog,
            prog_id,
            attachment: None,
            intended: None,
            keep: false,
            xsks,
            config,
            stats,
            frontends: SyncedMap::new(frontends, "frontends"),
            endpoints: SyncedMap::new(endpoints, "endpoints"),
            local_addrs: SyncedMap::new(local_addrs, "local_addrs"),
            cluster_ips: SyncedMap::new(cluster_ips, "cluster_ips"),
            service_cidrs: SyncedMap::new(service_cidrs, "service_cidrs"),
        })
    }

    /// Loads a fresh instance and attaches it to `ifname` (in the calling thread's network
    /// namespace). With the netlink modes, an XDP program already on the interface is
    /// never replaced: that is an error.
    ///
    /// # Errors
    /// As [`Steering::load`], plus [`XdpError::InvalidInterfaceName`],
    /// [`XdpError::InterfaceNotFound`] and [`XdpError::Attach`] (with what to do).
    pub fn load_and_attach(ifname: &str, mode: AttachMode) -> Result<Steering, XdpError> {
        let mut s = Steering::load()?;
        s.attach(ifname, mode, false)?;
        Ok(s)
    }

    /// Attaches this (loaded, unattached) instance to `ifname`. With `replace` (netlink
    /// modes only), a kxp program a previous process left attached there is replaced
    /// atomically (it steers until this one, filled, takes over); any other program is
    /// never replaced.
    ///
    /// # Errors
    /// As [`Steering::load_and_attach`].
    pub fn attach(
        &mut self,
        ifname: &str,
        mode: AttachMode,
        replace: bool,
    ) -> Result<(), XdpError> {
        let ifindex = resolve_ifindex(ifname)?;
        let prog = self.prog.as_fd();
        let attach_err = |source: io::Error| XdpError::Attach {
            ifname: ifname.to_owned(),
            mode,
            hint: attach_hint(&source, ifname, mode),
            source,
        };
        let noexist = libbpf_sys::XDP_FLAGS_UPDATE_IF_NOEXIST;
        let netlink = |flags: u32| -> Result<(), XdpError> {
            match replace
                .then(|| cleanup::kept_program(ifindex, flags))
                .flatten()
            {
                Some(old) => sys::xdp_replace(ifindex, prog, flags, old.as_fd()),
                None => sys::xdp_attach(ifindex, prog, flags | noexist),
            }
            .map_err(attach_err)
        };
        let mut mode = mode;
        let netlink_mode = mode != AttachMode::Link;
        let link = match mode {
            AttachMode::Link => Some(sys::xdp_link_create(ifindex, prog).map_err(attach_err)?),
            AttachMode::Native => {
                match netlink(sys::XDP_FLAGS_DRV_MODE) {
                    // A device without native XDP (vxlan, some NICs): generic, as a
                    // bpf_link would have chosen.
                    Err(XdpError::Attach { source, .. })
                        if source.raw_os_error() == Some(libc::EOPNOTSUPP) =>
                    {
                        netlink(sys::XDP_FLAGS_SKB_MODE)?;
                        mode = AttachMode::Generic;
                    }
                    r => r?,
                }
                None
            }
            AttachMode::Generic => {
                netlink(sys::XDP_FLAGS_SKB_MODE)?;
                None
            }
        };
        self.attachment = Some(Attachment {
            ifname: ifname.to_owned(),
            ifindex,
            mode,
            link,
        });
        // Left for the next kxp: pinned, so that it can recognise and replace it without
        // CAP_SYS_ADMIN (see `pins`).
        if replace
            && netlink_mode
            && let Err(e) = pins::pin(ifindex, self.prog.as_fd())
        {
            crate::warn_limited!(
                "xdp-pin",
                interface = ifname,
                error = %e,
                "cannot pin the steering program: a restarted kxp will need CAP_SYS_ADMIN to take this interface over"
            );
        }
        Ok(())
    }

    /// Whether a kxp program a previous process left is attached to `ifname` in `mode`
    /// (netlink modes), i.e. whether [`Steering::attach`] with `replace` would take one
    /// over.
    pub fn kept_on(ifname: &str, mode: AttachMode) -> bool {
        // Native falls back to generic where the driver has no native XDP.
        let modes: &[u32] = match mode {
            AttachMode::Link => return false,
            AttachMode::Native => &[sys::XDP_FLAGS_DRV_MODE, sys::XDP_FLAGS_SKB_MODE],
            AttachMode::Generic => &[sys::XDP_FLAGS_SKB_MODE],
        };
        resolve_ifindex(ifname)
            .is_ok_and(|i| modes.iter().any(|&f| cleanup::kept_program(i, f).is_some()))
    }

    /// Leaves the program attached when this instance is dropped (netlink modes: for the
    /// next kxp to take over). A bpf_link still goes with its fd.
    pub fn keep_attached(&mut self) {
        self.keep = true;
    }

    /// The interface index, or 0 if not attached.
    pub fn ifindex(&self) -> u32 {
        match (&self.attachment, &self.intended) {
            (Some(a), _) => a.ifindex,
            (None, Some((_, i))) => *i,
            (None, None) => 0,
        }
    }

    /// The interface name, if attached (or being prepared for one, see
    /// [`Steering::prepare_for`]).
    pub fn ifname(&self) -> Option<&str> {
        match (&self.attachment, &self.intended) {
            (Some(a), _) => Some(a.ifname.as_str()),
            (None, Some((n, _))) => Some(n.as_str()),
            (None, None) => None,
        }
    }

    /// Names the interface this unattached instance is filled for, before
    /// [`Steering::attach`] (which then takes it over).
    pub fn prepare_for(&mut self, ifname: &str, ifindex: u32) {
        self.intended = Some((ifname.to_owned(), ifindex));
    }

    /// Whether the program is attached (not just prepared).
    pub fn is_attached(&self) -> bool {
        self.attachment.is_some()
    }

    /// The kernel's id of this program instance (`bpftool prog show id N`).
    pub fn prog_id(&self) -> u32 {
        self.prog_id
    }

    /// Where the kernel runs this program on its interface, `None` if it is not attached
    /// there (any more).
    ///
    /// # Errors
    /// [`XdpError::Query`] if the netlink query fails (e.g. the interface is gone).
    pub fn attached_as(&self) -> Result<Option<AttachedAs>, XdpError> {
        let Some(a) = &self.attachment else {
            return Ok(None);
        };
        let q = sys::xdp_query(a.ifindex).map_err(|source| XdpError::Query {
            ifname: a.ifname.clone(),
            source,
        })?;
        Ok(if q.drv_prog_id == self.prog_id {
            Some(AttachedAs::Native)
        } else if q.skb_prog_id == self.prog_id {
            Some(AttachedAs::Generic)
        } else {
            None
        })
    }

    /// Puts the AF_XDP socket `xsk_fd` (bound to this interface and `queue`) in `xsks`:
    /// from now on matching packets received on `queue` go to it.
    ///
    /// # Errors
    /// [`XdpError::QueueOutOfRange`], [`XdpError::BadSocketFd`], or [`XdpError::Map`] if
    /// the kernel refuses (e.g. `xsk_fd` is not an AF_XDP socket).
    pub fn set_socket(&self, queue: u32, xsk_fd: RawFd) -> Result<(), XdpError> {
        self.check_queue(queue)?;
        let fd = u32::try_from(xsk_fd).map_err(|_| XdpError::BadSocketFd { fd: xsk_fd })?;
        self.xsks
            .update(&queue.to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: "xsks",
                op: "update",
                key: Some(format!("queue {queue} (fd {xsk_fd})")),
                source,
            })
    }

    /// Removes the socket of `queue` (its packets go to the kernel again). The kernel
    /// also does this by itself when the socket closes. No error if there was none.
    ///
    /// # Errors
    /// [`XdpError::QueueOutOfRange`], or [`XdpError::Map`].
    pub fn clear_socket(&self, queue: u32) -> Result<(), XdpError> {
        self.check_queue(queue)?;
        match self.xsks.delete(&queue.to_ne_bytes()) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(source) => Err(XdpError::Map {
                map: "xsks",
                op: "delete",
                key: Some(format!("queue {queue}")),
                source,
            }),
        }
    }

    fn check_queue(&self, queue: u32) -> Result<(), XdpError> {
        let capacity = self.xsks.max_entries();
        if queue >= capacity {
            return Err(XdpError::QueueOutOfRange { queue, capacity });
        }
        Ok(())
    }

    /// Sets the masquerade source port range (inclusive) used by rules (b) and (d).
    /// Until it is set, rule (b) matches nothing.
    ///
    /// # Errors
    /// [`XdpError::InvalidSnatRange`] unless `1 <= lo <= hi`; [`XdpError::Map`].
    pub fn set_snat_range(&self, lo: u16, hi: u16) -> Result<(), XdpError> {
        if lo == 0 || lo > hi {
            return Err(XdpError::InvalidSnatRange { lo, hi });
        }
        self.update_config(|c| {
            c[0..2].copy_from_slice(&lo.to_ne_bytes());
            c[2..4].copy_from_slice(&hi.to_ne_bytes());
        })
    }

    /// Whether frames with one 802.1Q / 802.1ad tag are looked into (and so may be
    /// redirected, tag included). Off by default.
    ///
    /// # Errors
    /// [`XdpError::Map`].
    pub fn set_vlan_steering(&self, on: bool) -> Result<(), XdpError> {
        self.update_config(|c| {
            let mut flags = u32::from_ne_bytes([c[4], c[5], c[6], c[7]]);
            if on {
                flags |= CFG_STEER_VLAN;
            } else {
                flags &= !CFG_STEER_VLAN;
            }
            c[4..8].copy_from_slice(&flags.to_ne_bytes());
        })
    }

    /// Marks this instance as the one on kxp's service device: frames no rule takes (or
    /// with no socket to take them) are dropped instead of passed to the kernel, which
    /// would route them back into the device.
    ///
    /// # Errors
    /// [`XdpError::Map`].
    pub fn set_service_device(&self) -> Result<(), XdpError> {
        self.update_config(|c| {
            let flags = u32::from_ne_bytes([c[4], c[5], c[6], c[7]]) | CFG_SERVICE_DEVICE;
            c[4..8].copy_from_slice(&flags.to_ne_bytes());
        })
    }

    /// Holds kxp's packets while no socket is there to take them (a restart): on the
    /// first `queues` queues (those kxp serves), a packet that a rule matches is dropped
    /// instead of passed to the kernel when its queue has no socket. For a program that
    /// stays attached across kxp's restarts.
    ///
    /// # Errors
    /// [`XdpError::Map`].
    pub fn set_hold(&self, queues: u32) -> Result<(), XdpError> {
        self.update_config(|c| {
            let flags = u32::from_ne_bytes([c[4], c[5], c[6], c[7]]) & 0xffff
                | CFG_HOLD
                | queues.min(0xffff) << 16;
            c[4..8].copy_from_slice(&flags.to_ne_bytes());
        })
    }

    /// Read-modify-write of `config[0]` (`struct steer_config`, [`CONFIG_LEN`] bytes).
    fn update_config(&self, change: impl FnOnce(&mut [u8; CONFIG_LEN])) -> Result<(), XdpError> {
        let key = 0u32.to_ne_bytes();
        let map_err = |op, source| XdpError::Map {
            map: "config",
            op,
            key: None,
            source,
        };
        let current = self
            .config
            .lookup(&key, MapFlags::ANY)
            .map_err(|e| map_err("lookup", e))?;
        let mut value = [0u8; CONFIG_LEN];
        if let Some(v) = current {
            let n = v.len().min(CONFIG_LEN);
            value[..n].copy_from_slice(&v[..n]);
        }
        change(&mut value);
        self.config
            .update(&key, &value, MapFlags::ANY)
            .map_err(|e| map_err("update", e))
    }

    /// Makes `frontends` hold exactly `want` (rule (a)); only the difference from the last
    /// successful sync reaches the kernel.
    ///
    /// # Errors
    /// [`XdpError::MapFull`] (nothing changed) or [`XdpError::Map`]; after an error the
    /// next sync finishes the job.
    pub fn sync_frontends(&mut self, want: &HashSet<SteerKey>) -> Result<SyncStats, XdpError> {
        self.frontends.sync(want)
    }

    /// Adds and removes frontends (rule (a)) when the caller knows the change; keys
    /// already present / absent are left alone.
    ///
    /// # Errors
    /// As [`Steering::sync_frontends`].
    pub fn change_frontends(
        &mut self,
        add: &[SteerKey],
        remove: &[SteerKey],
    ) -> Result<SyncStats, XdpError> {
        self.frontends.change(add, remove)
    }

    /// As [`Steering::change_frontends`], for endpoints (rules (c), (d)).
    ///
    /// # Errors
    /// As [`Steering::sync_frontends`].
    pub fn change_endpoints(
        &mut self,
        add: &[SteerKey],
        remove: &[SteerKey],
    ) -> Result<SyncStats, XdpError> {
        self.endpoints.change(add, remove)
    }

    /// As [`Steering::change_frontends`], for ClusterIPs (rule (e)).
    ///
    /// # Errors
    /// As [`Steering::sync_frontends`].
    pub fn change_cluster_ips(
        &mut self,
        add: &[IpAddr],
        remove: &[IpAddr],
    ) -> Result<SyncStats, XdpError> {
        let c = |v: &[IpAddr]| v.iter().map(|a| a.to_canonical()).collect::<Vec<_>>();
        self.cluster_ips.change(&c(add), &c(remove))
    }

    /// Makes `endpoints` hold exactly `want` (rules (c), (d)); incremental, as
    /// [`Steering::sync_frontends`].
    ///
    /// # Errors
    /// As [`Steering::sync_frontends`].
    pub fn sync_endpoints(&mut self, want: &HashSet<SteerKey>) -> Result<SyncStats, XdpError> {
        self.endpoints.sync(want)
    }

    /// Makes `local_addrs` hold exactly the node addresses `want` (rules (b)-(d));
    /// incremental, as [`Steering::sync_frontends`]. IPv4-mapped IPv6 addresses count as
    /// their IPv4 address.
    ///
    /// # Errors
    /// As [`Steering::sync_frontends`].
    pub fn sync_local_addrs(&mut self, want: &HashSet<IpAddr>) -> Result<SyncStats, XdpError> {
        let canonical: HashSet<IpAddr> = want.iter().map(|a| a.to_canonical()).collect();
        self.local_addrs.sync(&canonical)
    }

    /// Makes `cluster_ips` hold exactly the ClusterIPs `want` (rule (e): TCP, UDP and SCTP
    /// to them on any port, so that kxp rejects ports no Service serves); incremental, as
    /// [`Steering::sync_frontends`]. IPv4-mapped IPv6 addresses count as their IPv4
    /// address.
    ///
    /// # Errors
    /// As [`Steering::sync_frontends`].
    pub fn sync_cluster_ips(&mut self, want: &HashSet<IpAddr>) -> Result<SyncStats, XdpError> {
        let canonical: HashSet<IpAddr> = want.iter().map(|a| a.to_canonical()).collect();
        self.cluster_ips.sync(&canonical)
    }

    /// Makes `service_cidrs` hold exactly the Service CIDRs `want` (rule (e): TCP, UDP
    /// and SCTP to any address inside one, so that kxp drops traffic to unallocated
    /// ClusterIPs); incremental, as [`Steering::sync_frontends`]. Host bits are ignored
    /// (`198.19.0.1/16` is `198.19.0.0/16`) and an IPv4-mapped IPv6 prefix of length 96
    /// or more counts as its IPv4 prefix. IPv4 prefixes are stored v4-mapped, so an IPv6
    /// prefix shorter than /96 that contains `::ffff:0:0` (such as `::/0`) covers IPv4
    /// too.
    ///
    /// # Errors
    /// As [`Steering::sync_frontends`].
    pub fn sync_service_cidrs(&mut self, want: &HashSet<IpNet>) -> Result<SyncStats, XdpError> {
        let canonical: HashSet<IpNet> = want.iter().map(|&n| key::canonical_net(n)).collect();
        // The program looks a destination up only inside the cover of the CIDRs, so the
        // cover holds every CIDR in the map at every moment: widened to the old and the
        // new ones first, narrowed to what the map holds after.
        let both: Vec<IpNet> = self
            .service_cidrs
            .installed()
            .iter()
            .chain(&canonical)
            .copied()
            .collect();
        self.set_cidr_cover(&both, false)?;
        let synced = self.service_cidrs.sync(&canonical);
        let held: Vec<IpNet> = self.service_cidrs.installed().iter().copied().collect();
        self.set_cidr_cover(&held, true)?;
        synced
    }

    /// Writes the smallest prefix of each family holding all of `nets` to the config,
    /// marked exact (no trie lookup inside it) when it is one of `nets` and `exact`.
    fn set_cidr_cover(&self, nets: &[IpNet], exact: bool) -> Result<(), XdpError> {
        let (v4, v6) = key::covers(nets);
        let is_one = |cover: Option<IpNet>| exact && cover.is_some_and(|c| nets.contains(&c));
        let flags = u8::from(is_one(v4.map(IpNet::V4))) | u8::from(is_one(v6.map(IpNet::V6))) << 1;
        self.update_config(|c| {
            c[14] = flags;
            let (a4, l4) = v4.map_or((0, COVER_NONE), |n| {
                (u32::from(n.network()), n.prefix_len())
            });
            c[8..12].copy_from_slice(&a4.to_ne_bytes());
            c[12] = l4;
            let (a6, l6) = v6.map_or((0, COVER_NONE), |n| {
                (u128::from(n.network()), n.prefix_len())
            });
            c[13] = l6;
            for (i, w) in c[16..32].chunks_exact_mut(4).enumerate() {
                w.copy_from_slice(&((a6 >> (96 - 32 * i)) as u32).to_ne_bytes());
            }
        })
    }

    /// The counters, summed over CPUs.
    ///
    /// # Errors
    /// [`XdpError::Map`] if the kernel read fails.
    pub fn stats(&self) -> Result<SteerStats, XdpError> {
        stats::read(&self.stats)
    }

    /// Runs the program once on `frame` (an Ethernet frame) with BPF_PROG_TEST_RUN, as if
    /// received on queue 0, and returns the XDP action ([`XDP_PASS`], [`XDP_REDIRECT`]).
    /// The counters and maps are the live ones. With no socket in `xsks` a match returns
    /// [`XDP_PASS`] too: compare [`Steering::stats`] before and after.
    ///
    /// # Errors
    /// [`XdpError::TestRunFrameSize`] below 14 bytes; [`XdpError::TestRun`] (e.g. a frame
    /// larger than the kernel's limit of about 3.5 KiB).
    pub fn test_run(&self, frame: &[u8]) -> Result<u32, XdpError> {
        self.test_run_timed(frame).map(|(action, _)| action)
    }

    /// [`Steering::test_run`], with the nanoseconds the kernel timed the program for
    /// (the `steer` bench).
    ///
    /// # Errors
    /// As [`Steering::test_run`].
    pub fn test_run_timed(&self, frame: &[u8]) -> Result<(u32, u32), XdpError> {
        if frame.len() < 14 {
            return Err(XdpError::TestRunFrameSize { len: frame.len() });
        }
        sys::prog_test_run(self.prog.as_fd(), frame).map_err(|source| XdpError::TestRun { source })
    }

    /// Detaches the program from its interface (no-op if not attached). In link mode this
    /// closes the link; in the netlink modes only this instance is removed, never a program
    /// someone else attached since. An interface that is gone counts as detached.
    ///
    /// # Errors
    /// [`XdpError::Detach`].
    pub fn detach(mut self) -> Result<(), XdpError> {
        self.detach_inner()
    }

    fn detach_inner(&mut self) -> Result<(), XdpError> {
        let Some(a) = self.attachment.take() else {
            return Ok(());
        };
        let flags = match a.mode {
            AttachMode::Link => {
                drop(a.link); // the last reference: the kernel detaches
                return Ok(());
            }
            AttachMode::Native => sys::XDP_FLAGS_DRV_MODE,
            AttachMode::Generic => sys::XDP_FLAGS_SKB_MODE,
        };
        pins::unpin(a.ifindex, self.prog_id);
        match sys::xdp_detach_expected(a.ifindex, flags, self.prog.as_fd()) {
            Ok(()) => Ok(()),
            // gone with its interface, or replaced by someone else's program
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENODEV | libc::EEXIST | libc::ENOENT)
                ) =>
            {
                Ok(())
            }
            Err(source) => Err(XdpError::Detach {
                hint: detach_hint(&source),
                ifname: a.ifname,
                mode: a.mode,
                source,
            }),
        }
    }
}

impl Drop for Steering {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        // Best effort: a netlink-attached program left behind is fail-open (its sockets
        // are gone) and `kxp cleanup` removes it.
        let _ = self.detach_inner();
    }
}

/// The index of interface `ifname` in the calling thread's network namespace, if it
/// exists and the name is valid.
pub fn ifindex_of(ifname: &str) -> Option<u32> {
    resolve_ifindex(ifname).ok()
}

/// Checks a Linux interface name and resolves it in the calling thread's network namespace.
fn resolve_ifindex(ifname: &str) -> Result<u32, XdpError> {
    let valid = !ifname.is_empty()
        && ifname.len() < libc::IFNAMSIZ
        && ifname != "."
        && ifname != ".."
        && !ifname
            .bytes()
            .any(|b| b == b'/' || b == b':' || b == 0 || b.is_ascii_whitespace());
    if !valid {
        return Err(XdpError::InvalidInterfaceName {
            ifname: ifname.to_owned(),
        });
    }
    match sys::if_nametoindex(ifname) {
        Ok(Some(idx)) => Ok(idx),
        Ok(None) => Err(XdpError::InterfaceNotFound {
            ifname: ifname.to_owned(),
        }),
        Err(source) => Err(XdpError::InterfaceLookup {
            ifname: ifname.to_owned(),
            source,
        }),
    }
}
