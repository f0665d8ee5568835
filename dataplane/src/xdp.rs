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
//! gone), matching packets go to the kernel too. The program is loaded (and verified)
//! once: [`Steering::load`] makes the first handle, [`Steering::share`] one more for
//! another interface, with the same program and maps. What differs per interface is in
//! the `ifaces` map, keyed by interface index: its slot, which holds its sockets
//! (`xsks[slot * MAX_QUEUES + queue]`) and counters, and its flags (service device,
//! hold). So attaching one more interface costs a netlink call and its sockets, not a
//! program load (120 ms with the verifier), and the control plane writes a Service
//! change once, through any handle, with the incremental `sync_*` methods (only the
//! difference reaches the kernel).
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
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use ipnet::IpNet;
use libbpf_rs::{ErrorKind, MapCore, MapFlags, MapHandle, Object, Program};

pub use cleanup::cleanup_interface;
pub use error::XdpError;
use error::{attach_hint, detach_hint};
pub use key::SteerKey;
pub use stats::SteerStats;
use sync::SyncedMap;
pub use sync::{KeySet, SyncStats};

/// The program's name in the kernel (`bpftool prog`, [`cleanup_interface`]).
pub const PROG_NAME: &str = "kxp_steer";
/// Receive queues per interface the program can redirect (`xsks` entries per slot).
pub const MAX_QUEUES: u32 = 256;
/// Interface slots of one loaded program (slot 0 is for packets of no interface of
/// kxp's): at most `MAX_SLOTS - 1` interfaces attached at once.
pub const MAX_SLOTS: u32 = 1024;
/// Capacity of `local_addrs` (the node's own addresses).
pub const MAX_LOCAL_ADDRS: usize = 1024;
/// Capacity of `service_cidrs` (the cluster's ServiceCIDRs).
pub const MAX_SERVICE_CIDRS: usize = 256;
/// Size of `struct steer_key` (`frontends`, `endpoints`) and of `struct addr_key`
/// (`cluster_ips`). Those three sets have no fixed capacity: they grow with the cluster
/// (see [`sync::INITIAL_SET`]).
const STEER_KEY_LEN: u32 = 20;
const ADDR_KEY_LEN: u32 = 16;

/// XDP action values (`enum xdp_action`).
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_REDIRECT: u32 = 4;

/// `config.flags` bit: look inside one 802.1Q / 802.1ad tag (the workers take the tag
/// off and keep the VLAN id with the flow; kxp sets it at start).
const CFG_STEER_VLAN: u32 = 1;
/// `ifaces[..].flags` bit: this is kxp's service device; drop instead of passing.
const IF_SERVICE_DEVICE: u32 = 2;
/// `ifaces[..].flags` bit: drop, do not pass, a matching packet with no socket on its
/// queue (the first `flags >> 16` queues).
const IF_HOLD: u32 = 4;
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

/// The loaded program and its maps, shared by the [`Steering`] handles of every
/// interface.
struct SharedProgram {
    fd: OwnedFd,
    id: u32,
    xsks: MapHandle,
    config: MapHandle,
    stats: MapHandle,
    ifaces: MapHandle,
    sets: Mutex<Sets>,
    /// Slots in use (slot 0 never handed out).
    slots: Mutex<Vec<bool>>,
    /// A program taken up from a previous kxp: the interfaces it steered (index, slot)
    /// that this process has not taken over yet. Their entries stay until then.
    previous: Mutex<std::collections::HashMap<u32, u32>>,
}

impl SharedProgram {
    /// The interfaces a previous kxp steered, not taken over yet (see `previous`).
    fn previous(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u32, u32>> {
        self.previous.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `ifindex` still has the entry a previous kxp left (a program taken up).
    fn is_previous(&self, ifindex: u32) -> bool {
        self.previous().contains_key(&ifindex)
    }

    /// Removes the `ifaces` entry under `key` if it is still slot `slot`'s.
    fn unregister(&self, key: u32, slot: u32) {
        let k = key.to_ne_bytes();
        let ours = matches!(
            self.ifaces.lookup(&k, MapFlags::ANY),
            Ok(Some(v)) if v.get(..4) == Some(&slot.to_ne_bytes()[..])
        );
        if ours {
            let _ = self.ifaces.delete(&k);
        }
    }

    /// Gives `slot` back: no socket on its first `queues` queues (the others have none),
    /// counters at zero, free for another handle.
    fn free_slot(&self, slot: u32, queues: u32) {
        for queue in 0..queues.min(MAX_QUEUES) {
            let _ = self.xsks.delete(&(slot * MAX_QUEUES + queue).to_ne_bytes());
        }
        let _ = stats::clear(&self.stats, slot);
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(used) = slots.get_mut(slot as usize) {
            *used = false;
        }
    }
}

/// The entries (interface index, slot) a previous kxp left in `ifaces`, key 0 (the
/// first handle's, for test runs) aside.
fn previous_entries(ifaces: &MapHandle) -> Vec<(u32, u32)> {
    ifaces
        .keys()
        .filter_map(|k| {
            let ifindex = u32::from_ne_bytes(k.get(..4)?.try_into().ok()?);
            let v = ifaces.lookup(&k, MapFlags::ANY).ok()??;
            let slot = u32::from_ne_bytes(v.get(..4)?.try_into().ok()?);
            (ifindex != 0 && slot != 0 && slot < MAX_SLOTS).then_some((ifindex, slot))
        })
        .collect()
}

/// How [`Steering::load_or_adopt`] came by its program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Loaded (and verified) now.
    Loaded,
    /// Taken up from a previous kxp of the same build: no load.
    Adopted,
}

/// The key sets the control plane mirrors into the shared maps.
struct Sets {
    frontends: SyncedMap<SteerKey>,
    endpoints: SyncedMap<SteerKey>,
    local_addrs: SyncedMap<IpAddr>,
    cluster_ips: SyncedMap<IpAddr>,
    service_cidrs: SyncedMap<IpNet>,
}

/// The steering program as seen from one interface: the shared program and maps, this
/// interface's slot and flags, and its attachment (at most one interface). Detaches on
/// drop (best effort; see [`Steering::detach`] for errors).
///
/// Interface names resolve, and netlink attach/detach happen, in the network namespace of
/// the calling thread: attach and detach (or drop) a netlink-mode instance from the same
/// namespace. (A detach from elsewhere removes nothing: it only ever removes this very
/// program.) Map updates work from any thread.
pub struct Steering {
    program: Arc<SharedProgram>,
    /// This interface's slot (sockets, counters).
    slot: u32,
    /// This interface's `IF_*` flags.
    flags: u32,
    /// The `ifaces` key this handle's entry is written under: its interface's index, or
    /// 0 for the first handle before it has one (BPF_PROG_TEST_RUN runs find it there).
    key: Option<u32>,
    attachment: Option<Attachment>,
    /// The interface an instance not attached yet is being filled for (name, index).
    intended: Option<(String, u32)>,
    /// Not detached on drop (see [`Steering::keep_attached`]).
    keep: bool,
    /// One past the highest queue a socket was entered for (the entries to clear when
    /// the slot is given back).
    queues_set: AtomicU32,
}

impl fmt::Debug for Steering {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Steering")
            .field("prog_id", &self.program.id)
            .field("slot", &self.slot)
            .field("attachment", &self.attachment)
            .finish_non_exhaustive()
    }
}

struct Loaded {
    prog: OwnedFd,
    maps: [MapHandle; 9],
}

const MAP_NAMES: [&str; 9] = [
    "ifaces",
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
    let [a, b, c, d, e, f, g, h, i] = MAP_NAMES.map(dup);
    let maps = [a?, b?, c?, d?, e?, f?, g?, h?, i?];
    Ok(Loaded { prog, maps })
}

impl Steering {
    /// Loads the program (new, empty maps) and returns its first handle, not attached to
    /// any interface yet; [`Steering::share`] makes more. Until it is prepared for or
    /// attached to an interface, the handle's entry is `ifaces[0]`, which the program
    /// uses for packets of an interface it has no entry for (BPF_PROG_TEST_RUN's).
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
        Steering::from_parts(loaded, false)
    }

    /// With `keep` (a state directory), takes up the program and maps a previous kxp of
    /// this build left pinned (see [`pins`]), or else loads the program and pins it with
    /// its maps for the next kxp; without, loads it as [`Steering::load`].
    ///
    /// A program taken up goes on steering, with what the previous kxp left in its maps,
    /// until each interface is taken over ([`Steering::attach`] with `replace`): until
    /// then an interface keeps its previous entry (its slot and hold), so this process's
    /// sockets take its packets only from then on. The sets are written afresh by the
    /// first full sync (each growing set into a new map swapped in whole).
    ///
    /// # Errors
    /// As [`Steering::load`].
    pub fn load_or_adopt(keep: bool) -> Result<(Steering, Origin), XdpError> {
        let name = pins::program_dir_name(&OBJ.0);
        if keep && let Some((prog, at)) = pins::open_program(&name) {
            let open = |m: &&str| {
                MapHandle::from_pinned_path(at.join(m)).map_err(|source| XdpError::Map {
                    map: "pinned",
                    op: "open",
                    key: Some((*m).to_string()),
                    source,
                })
            };
            let maps = MAP_NAMES.iter().map(open).collect::<Result<Vec<_>, _>>();
            let taken = maps.and_then(|maps| {
                let maps: [MapHandle; 9] =
                    maps.try_into().map_err(|_| XdpError::MissingInObject {
                        what: "map",
                        name: "pinned",
                    })?;
                Steering::from_parts(Loaded { prog, maps }, true)
            });
            match taken {
                Ok(s) => return Ok((s, Origin::Adopted)),
                Err(e) => tracing::warn!(
                    error = %e,
                    "the steering program a previous kxp of this build pinned cannot be taken up: loading a new one"
                ),
            }
        }
        let s = Steering::load()?;
        if keep {
            let p = &s.program;
            let sets = s.sets();
            let mut maps: Vec<(&str, BorrowedFd<'_>)> = vec![
                ("ifaces", p.ifaces.as_fd()),
                ("xsks", p.xsks.as_fd()),
                ("config", p.config.as_fd()),
                ("stats", p.stats.as_fd()),
            ];
            maps.push(sets.frontends.pinnable());
            maps.push(sets.endpoints.pinnable());
            maps.push(sets.local_addrs.pinnable());
            maps.push(sets.cluster_ips.pinnable());
            maps.push(sets.service_cidrs.pinnable());
            if let Err(e) = pins::pin_program(&name, p.fd.as_fd(), &maps) {
                crate::warn_limited!(
                    "xdp-pin-program",
                    error = %e,
                    "cannot pin the steering program and its maps: a restarted kxp will load it again"
                );
            }
            drop(sets);
        }
        Ok((s, Origin::Loaded))
    }

    /// The first handle on a program and its maps, loaded now or (`adopted`) taken up
    /// from a previous kxp: then the interfaces it steers keep their entries and slots
    /// until taken over, and the sets are marked to be written afresh.
    fn from_parts(loaded: Loaded, adopted: bool) -> Result<Steering, XdpError> {
        let prog_id = Program::id_from_fd(loaded.prog.as_fd())
            .map_err(|source| XdpError::ProgInfo { source })?;
        let [
            ifaces,
            xsks,
            config,
            stats,
            frontends,
            endpoints,
            local_addrs,
            cluster_ips,
            service_cidrs,
        ] = loaded.maps;
        let mut slots = vec![false; MAX_SLOTS as usize];
        slots[0] = true;
        let previous = if adopted {
            previous_entries(&ifaces)
        } else {
            Vec::new()
        };
        for &(_, slot) in &previous {
            if let Some(used) = slots.get_mut(slot as usize) {
                *used = true;
            }
        }
        let sets = Sets {
            frontends: SyncedMap::growing(frontends, "frontends", STEER_KEY_LEN, adopted)?,
            endpoints: SyncedMap::growing(endpoints, "endpoints", STEER_KEY_LEN, adopted)?,
            local_addrs: SyncedMap::fixed(local_addrs, "local_addrs", adopted),
            cluster_ips: SyncedMap::growing(cluster_ips, "cluster_ips", ADDR_KEY_LEN, adopted)?,
            service_cidrs: SyncedMap::fixed(service_cidrs, "service_cidrs", adopted),
        };
        let program = Arc::new(SharedProgram {
            fd: loaded.prog,
            id: prog_id,
            xsks,
            config,
            stats,
            ifaces,
            sets: Mutex::new(sets),
            slots: Mutex::new(slots),
            previous: Mutex::new(previous.into_iter().collect()),
        });
        let mut s = Steering::with_slot(program)?;
        s.register(0)?;
        Ok(s)
    }

    /// Removes the program and maps other builds of kxp pinned (once this one has taken
    /// over every interface). Returns how many went.
    pub fn prune_pinned_programs() -> usize {
        pins::prune_programs(&pins::program_dir_name(&OBJ.0))
    }

    /// Forgets the interfaces a previous kxp steered that this one did not take over
    /// (gone, or no longer matching, once [`Steering::attach`] with `replace` has run for
    /// every interface kept): their entries go (unless rewritten since), their counters
    /// and slots are freed. Returns how many there were.
    pub fn forget_previous(&self) -> usize {
        let previous = std::mem::take(&mut *self.program.previous());
        for (&ifindex, &slot) in &previous {
            self.program.unregister(ifindex, slot);
            self.program.free_slot(slot, 0);
        }
        previous.len()
    }

    /// One more handle on this handle's program, for another interface: the same maps
    /// (Services, endpoints, node addresses, configuration), its own slot, flags and
    /// attachment. Costs no program load.
    ///
    /// # Errors
    /// [`XdpError::TooManyInterfaces`] when every slot is taken.
    pub fn share(&self) -> Result<Steering, XdpError> {
        Steering::with_slot(self.program.clone())
    }

    fn with_slot(program: Arc<SharedProgram>) -> Result<Steering, XdpError> {
        let slot = {
            let mut slots = program.slots.lock().unwrap_or_else(|p| p.into_inner());
            let free = slots
                .iter()
                .position(|used| !used)
                .ok_or(XdpError::TooManyInterfaces {
                    capacity: MAX_SLOTS - 1,
                })?;
            slots[free] = true;
            free as u32
        };
        Ok(Steering {
            program,
            slot,
            flags: 0,
            key: None,
            attachment: None,
            intended: None,
            keep: false,
            queues_set: AtomicU32::new(0),
        })
    }

    /// Writes this handle's entry (slot, flags) under `ifindex` in `ifaces`, and removes
    /// the one it had under another key.
    fn register(&mut self, ifindex: u32) -> Result<(), XdpError> {
        let mut value = [0u8; 8];
        value[..4].copy_from_slice(&self.slot.to_ne_bytes());
        value[4..].copy_from_slice(&self.flags.to_ne_bytes());
        self.program
            .ifaces
            .update(&ifindex.to_ne_bytes(), &value, MapFlags::ANY)
            .map_err(|source| XdpError::Map {
                map: "ifaces",
                op: "update",
                key: Some(format!("interface {ifindex}")),
                source,
            })?;
        if let Some(old) = self.key.replace(ifindex)
            && old != ifindex
        {
            self.unregister(old);
        }
        // The previous kxp's entry for it (a program taken up) is replaced: its slot free.
        let previous = self.program.previous().remove(&ifindex);
        if let Some(slot) = previous {
            // Its sockets closed with the previous kxp: the kernel took them out.
            self.program.free_slot(slot, 0);
        }
        Ok(())
    }

    /// Removes the entry under `key` if it is still this handle's.
    fn unregister(&self, key: u32) {
        self.program.unregister(key, self.slot);
    }

    /// Rewrites this handle's entry after a flag changed (nothing before it has one).
    fn update_flags(&mut self, flags: u32) -> Result<(), XdpError> {
        self.flags = flags;
        match self.key {
            Some(k) => self.register(k),
            None => Ok(()),
        }
    }

    /// The shared key sets (tests read the maps behind them).
    fn sets(&self) -> std::sync::MutexGuard<'_, Sets> {
        self.program.sets.lock().unwrap_or_else(|p| p.into_inner())
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
        self.register(ifindex)?;
        let program = self.program.clone();
        let prog = program.fd.as_fd();
        let attach_err = |source: io::Error| XdpError::Attach {
            ifname: ifname.to_owned(),
            mode,
            hint: attach_hint(&source, ifname, mode),
            source,
        };
        // A program taken up (see [`Steering::load_or_adopt`]) is already this very
        // program on the interface, attached and pinned by the previous kxp: nothing to
        // replace or pin (a netlink call and a pin saved per interface at a restart).
        if replace && let Some(as_mode) = self.already_attached(ifindex, mode) {
            self.attachment = Some(Attachment {
                ifname: ifname.to_owned(),
                ifindex,
                mode: as_mode,
                link: None,
            });
            return Ok(());
        }
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
            && let Err(e) = pins::pin(ifindex, self.program.fd.as_fd())
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

    /// The netlink mode this very program is attached to `ifindex` in, if it is, and
    /// `mode` would have attached it so (native falls back to generic).
    fn already_attached(&self, ifindex: u32, mode: AttachMode) -> Option<AttachMode> {
        let q = sys::xdp_query(ifindex).ok()?;
        match mode {
            AttachMode::Link => None,
            AttachMode::Native if q.drv_prog_id == self.program.id => Some(AttachMode::Native),
            AttachMode::Native | AttachMode::Generic if q.skb_prog_id == self.program.id => {
                Some(AttachMode::Generic)
            }
            _ => None,
        }
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

    /// Names the interface this unattached handle is filled for, before
    /// [`Steering::attach`] (which then takes it over), and writes its entry in
    /// `ifaces`.
    ///
    /// # Errors
    /// [`XdpError::Map`].
    pub fn prepare_for(&mut self, ifname: &str, ifindex: u32) -> Result<(), XdpError> {
        self.intended = Some((ifname.to_owned(), ifindex));
        // A program taken up: the previous kxp's entry steers (and holds) this
        // interface until it is taken over ([`Steering::attach`]).
        if self.program.is_previous(ifindex) {
            return Ok(());
        }
        self.register(ifindex)
    }

    /// Whether the program is attached (not just prepared).
    pub fn is_attached(&self) -> bool {
        self.attachment.is_some()
    }

    /// The kernel's id of the program (`bpftool prog show id N`), the same for every
    /// handle [`Steering::share`] made.
    pub fn prog_id(&self) -> u32 {
        self.program.id
    }

    /// This handle's slot in the program's maps.
    pub fn slot(&self) -> u32 {
        self.slot
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
        Ok(if q.drv_prog_id == self.program.id {
            Some(AttachedAs::Native)
        } else if q.skb_prog_id == self.program.id {
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
        self.queues_set.fetch_max(queue + 1, Ordering::Relaxed);
        self.program
            .xsks
            .update(&self.xsk_key(queue), &fd.to_ne_bytes(), MapFlags::ANY)
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
        match self.program.xsks.delete(&self.xsk_key(queue)) {
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
        if queue >= MAX_QUEUES {
            return Err(XdpError::QueueOutOfRange {
                queue,
                capacity: MAX_QUEUES,
            });
        }
        Ok(())
    }

    fn xsk_key(&self, queue: u32) -> [u8; 4] {
        (self.slot * MAX_QUEUES + queue).to_ne_bytes()
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
    /// redirected, tag included). Off in a freshly loaded program; kxp turns it on.
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

    /// Marks this handle's interface as kxp's service device: frames no rule takes (or
    /// with no socket to take them) are dropped instead of passed to the kernel, which
    /// would route them back into the device.
    ///
    /// # Errors
    /// [`XdpError::Map`].
    pub fn set_service_device(&mut self) -> Result<(), XdpError> {
        self.update_flags(self.flags | IF_SERVICE_DEVICE)
    }

    /// Holds kxp's packets while no socket is there to take them (a restart): on the
    /// first `queues` queues (those kxp serves), a packet that a rule matches is dropped
    /// instead of passed to the kernel when its queue has no socket. For a program that
    /// stays attached across kxp's restarts.
    ///
    /// # Errors
    /// [`XdpError::Map`].
    pub fn set_hold(&mut self, queues: u32) -> Result<(), XdpError> {
        self.update_flags(self.flags & 0xffff | IF_HOLD | queues.min(0xffff) << 16)
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
            .program
            .config
            .lookup(&key, MapFlags::ANY)
            .map_err(|e| map_err("lookup", e))?;
        let mut value = [0u8; CONFIG_LEN];
        if let Some(v) = current {
            let n = v.len().min(CONFIG_LEN);
            value[..n].copy_from_slice(&v[..n]);
        }
        change(&mut value);
        self.program
            .config
            .update(&key, &value, MapFlags::ANY)
            .map_err(|e| map_err("update", e))
    }

    /// How full each of the program's key sets is: (map, keys held, keys it holds before
    /// it grows, or at all for the two of fixed size: `local_addrs`, `service_cidrs`).
    pub fn set_fill(&self) -> Vec<(&'static str, usize, usize)> {
        let sets = self.sets();
        [
            ("frontends", sets.frontends.fill()),
            ("endpoints", sets.endpoints.fill()),
            ("cluster_ips", sets.cluster_ips.fill()),
            ("local_addrs", sets.local_addrs.fill()),
            ("service_cidrs", sets.service_cidrs.fill()),
        ]
        .map(|(name, (keys, size))| (name, keys, size))
        .to_vec()
    }

    /// Makes `frontends` hold exactly `want` (rule (a)); only the difference from the last
    /// successful sync reaches the kernel.
    ///
    /// # Errors
    /// [`XdpError::MapFull`] (nothing changed) or [`XdpError::Map`]; after an error the
    /// next sync finishes the job.
    pub fn sync_frontends(&mut self, want: &HashSet<SteerKey>) -> Result<SyncStats, XdpError> {
        self.sets().frontends.sync(want)
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
        self.sets().frontends.change(add, remove)
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
        self.sets().endpoints.change(add, remove)
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
        self.sets().cluster_ips.change(&c(add), &c(remove))
    }

    /// Makes `endpoints` hold exactly `want` (rules (c), (d)); incremental, as
    /// [`Steering::sync_frontends`].
    ///
    /// # Errors
    /// As [`Steering::sync_frontends`].
    pub fn sync_endpoints(&mut self, want: &HashSet<SteerKey>) -> Result<SyncStats, XdpError> {
        self.sets().endpoints.sync(want)
    }

    /// A full programming: makes `frontends`, `endpoints` and `cluster_ips` hold exactly
    /// these sets, as [`Steering::sync_frontends`], [`Steering::sync_endpoints`] and
    /// [`Steering::sync_cluster_ips`] do, taking them whole: a set made anew keeps them
    /// with no copy.
    pub fn refill(
        &mut self,
        frontends: KeySet<SteerKey>,
        endpoints: KeySet<SteerKey>,
        cluster_ips: &KeySet<IpAddr>,
    ) -> [Result<SyncStats, XdpError>; 3] {
        let canonical: KeySet<IpAddr> = cluster_ips.iter().map(|a| a.to_canonical()).collect();
        let mut sets = self.sets();
        [
            sets.frontends.sync_owned(frontends),
            sets.endpoints.sync_owned(endpoints),
            sets.cluster_ips.sync_owned(canonical),
        ]
    }

    /// Makes `local_addrs` hold exactly the node addresses `want` (rules (b)-(d));
    /// incremental, as [`Steering::sync_frontends`]. IPv4-mapped IPv6 addresses count as
    /// their IPv4 address.
    ///
    /// # Errors
    /// As [`Steering::sync_frontends`].
    pub fn sync_local_addrs(&mut self, want: &HashSet<IpAddr>) -> Result<SyncStats, XdpError> {
        let canonical: HashSet<IpAddr> = want.iter().map(|a| a.to_canonical()).collect();
        self.sets().local_addrs.sync(&canonical)
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
        self.sets().cluster_ips.sync(&canonical)
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
        let program = self.program.clone();
        let mut sets = program.sets.lock().unwrap_or_else(|p| p.into_inner());
        let both: Vec<IpNet> = sets
            .service_cidrs
            .installed()
            .iter()
            .chain(&canonical)
            .copied()
            .collect();
        self.set_cidr_cover(&both, false)?;
        let synced = sets.service_cidrs.sync(&canonical);
        let held: Vec<IpNet> = sets.service_cidrs.installed().iter().copied().collect();
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

    /// This handle's interface's counters, summed over CPUs.
    ///
    /// # Errors
    /// [`XdpError::Map`] if the kernel read fails.
    pub fn stats(&self) -> Result<SteerStats, XdpError> {
        stats::read(&self.program.stats, self.slot)
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

    /// [`Steering::test_run`] as if `frame` had arrived on interface `ifindex` (queue
    /// 0), which must exist in this network namespace.
    ///
    /// # Errors
    /// As [`Steering::test_run`].
    pub fn test_run_on(&self, frame: &[u8], ifindex: u32) -> Result<u32, XdpError> {
        if frame.len() < 14 {
            return Err(XdpError::TestRunFrameSize { len: frame.len() });
        }
        sys::prog_test_run_on(self.program.fd.as_fd(), frame, ifindex)
            .map_err(|source| XdpError::TestRun { source })
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
        sys::prog_test_run(self.program.fd.as_fd(), frame)
            .map_err(|source| XdpError::TestRun { source })
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
        pins::unpin(a.ifindex, self.program.id);
        match sys::xdp_detach_expected(a.ifindex, flags, self.program.fd.as_fd()) {
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
            // Left steering (and holding) for the next kxp: the entry and slot stay.
            return;
        }
        // Best effort: a netlink-attached program left behind is fail-open (its sockets
        // are gone) and `kxp cleanup` removes it.
        let _ = self.detach_inner();
        // The slot goes back clean: no entry, no socket, counters at zero.
        if let Some(k) = self.key.take() {
            self.unregister(k);
        }
        self.program
            .free_slot(self.slot, self.queues_set.load(Ordering::Relaxed));
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
