//! [`cleanup_interface`]: removing the netlink-attached steering programs a killed kxp
//! left behind (`kxp cleanup`).

use std::io;
use std::os::fd::AsFd;

use libbpf_rs::query::ProgInfoIter;
use libbpf_rs::{ErrorKind, Program};

use super::error::detach_hint;
use super::{AttachMode, PROG_NAME, XdpError, resolve_ifindex, sys};

/// Detaches from `ifname` every netlink-attached (native or generic) XDP program named
/// [`PROG_NAME`], e.g. left by a kxp that was killed. `Ok(false)` if there was none.
/// Other programs are left alone.
///
/// # Errors
/// [`XdpError::InterfaceNotFound`] and friends; [`XdpError::HeldByLink`] if kxp's
/// program is held by a running process's bpf_link; [`XdpError::Query`],
/// [`XdpError::ProgInfo`], [`XdpError::Detach`] on syscall failures.
pub fn cleanup_interface(ifname: &str) -> Result<bool, XdpError> {
    let ifindex = resolve_ifindex(ifname)?;
    let q = sys::xdp_query(ifindex).map_err(|source| XdpError::Query {
        ifname: ifname.to_owned(),
        source,
    })?;
    let mut removed = false;
    for (id, flags, mode) in [
        (q.drv_prog_id, sys::XDP_FLAGS_DRV_MODE, AttachMode::Native),
        (q.skb_prog_id, sys::XDP_FLAGS_SKB_MODE, AttachMode::Generic),
    ] {
        if id == 0 {
            continue;
        }
        let fd = match super::pins::get(ifindex, id) {
            Some(fd) => fd,
            None if !is_kxp_program(id)? => continue,
            None => match Program::fd_from_id(id) {
                Ok(fd) => fd,
                Err(e) if e.kind() == ErrorKind::NotFound => continue, // unloaded meanwhile
                Err(source) => return Err(XdpError::ProgInfo { source }),
            },
        };
        match sys::xdp_detach_expected(ifindex, flags, fd.as_fd()) {
            Ok(()) => {
                removed = true;
                super::pins::unpin(ifindex, id);
            }
            Err(source) if source.raw_os_error() == Some(libc::EBUSY) => {
                return Err(XdpError::HeldByLink {
                    ifname: ifname.to_owned(),
                    source,
                });
            }
            // replaced or removed meanwhile
            Err(e) if matches!(e.raw_os_error(), Some(libc::EEXIST | libc::ENOENT)) => {}
            Err(source) => {
                return Err(XdpError::Detach {
                    ifname: ifname.to_owned(),
                    mode,
                    hint: detach_hint(&source),
                    source,
                });
            }
        }
    }
    Ok(removed)
}

pub(super) fn is_kxp_program(id: u32) -> Result<bool, XdpError> {
    // A linear walk over the loaded programs: fine for a cleanup command.
    for info in ProgInfoIter::default() {
        if info.id == id {
            return Ok(info.name.to_bytes() == PROG_NAME.as_bytes());
        }
    }
    if !sys::is_root() {
        // without privileges the walk is empty rather than an error
        return Err(XdpError::NeedsPrivileges {
            action: "inspecting XDP programs",
            source: io::Error::from(io::ErrorKind::PermissionDenied).into(),
        });
    }
    Ok(false)
}

/// The kxp program a previous process left netlink-attached to `ifindex` in the mode of
/// `flags` (`XDP_FLAGS_DRV_MODE` or `XDP_FLAGS_SKB_MODE`), if any.
pub(super) fn kept_program(ifindex: u32, flags: u32) -> Option<std::os::fd::OwnedFd> {
    let q = sys::xdp_query(ifindex).ok()?;
    let id = if flags == sys::XDP_FLAGS_DRV_MODE {
        q.drv_prog_id
    } else {
        q.skb_prog_id
    };
    if id == 0 {
        return None;
    }
    // Its pin (no capability needed), else a walk of the loaded programs (CAP_SYS_ADMIN).
    if let Some(fd) = super::pins::get(ifindex, id) {
        return Some(fd);
    }
    if !is_kxp_program(id).unwrap_or(false) {
        return None;
    }
    Program::fd_from_id(id).ok()
}
