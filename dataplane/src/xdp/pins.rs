//! Pins of the programs kxp leaves attached for the next kxp (netlink modes, with a
//! state directory): `/sys/fs/bpf/kxp[/netns-COOKIE]/xdp-IFINDEX`, one per interface.
//!
//! A restarted kxp must recognise its predecessor's program on each interface to replace
//! it atomically (`XDP_FLAGS_REPLACE` needs its fd). Walking the loaded programs and
//! opening one by id (`BPF_PROG_GET_NEXT_ID`, `BPF_PROG_GET_FD_BY_ID`) needs
//! `CAP_SYS_ADMIN`, which kxp's deployments do not grant; opening a pin needs only access
//! to the file. The pin is checked against what netlink reports as attached (the same
//! program id), so a stale or foreign pin is never taken for the attached program.
//!
//! The program itself and its maps are pinned too, in `steer-BUILD/` beside those (BUILD:
//! a hash of the embedded object): a restarted kxp of the same build takes them up
//! instead of loading and verifying a new program, so steering carries on with what the
//! previous kxp left in the maps and the restart's gap loses the program load (see
//! [`super::Steering::load_or_adopt`]).
//!
//! Pins live as long as the state directory of the same namespace: removed with it
//! (`kxp cleanup`, [`crate::statefile::remove_state`], the sweep of stale directories), and
//! pruned to the interfaces kxp steers once it has taken over.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use libbpf_rs::Program;

use super::sys;

/// Where bpffs is mounted on a node (and in kxp's DaemonSet).
pub const BPFFS: &str = "/sys/fs/bpf";

/// The pin directory of the calling thread's network namespace, if bpffs is mounted.
pub fn dir() -> Option<PathBuf> {
    let base = Path::new(BPFFS);
    if !sys::is_bpffs(base) {
        return None;
    }
    let kxp = base.join("kxp");
    Some(match crate::sys::netns_suffix() {
        Some(ns) => kxp.join(ns),
        None => kxp,
    })
}

/// The pin directory that goes with the state directory `state`: for
/// `/run/kxp/netns-COOKIE`, that namespace's; for any other, the calling thread's.
pub fn dir_for_state(state: &Path) -> Option<PathBuf> {
    let name = state.file_name()?.to_string_lossy();
    if state.parent() == Some(Path::new("/run/kxp")) && name.starts_with("netns-") {
        let base = Path::new(BPFFS);
        return sys::is_bpffs(base).then(|| base.join("kxp").join(name.as_ref()));
    }
    dir()
}

fn pin_path(dir: &Path, ifindex: u32) -> PathBuf {
    dir.join(format!("xdp-{ifindex}"))
}

/// Pins `prog` as the program kxp leaves on `ifindex` (replacing the pin there, never
/// leaving none: pinned beside it, then renamed over it).
pub(super) fn pin(ifindex: u32, prog: BorrowedFd<'_>) -> io::Result<()> {
    let Some(dir) = dir() else {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no bpffs at {BPFFS}"),
        ));
    };
    std::fs::create_dir_all(&dir)?;
    let path = pin_path(&dir, ifindex);
    // (bpffs refuses dots in names: they are reserved.)
    let tmp = dir.join(format!("xdp-{ifindex}-new"));
    let _ = std::fs::remove_file(&tmp);
    sys::obj_pin(prog, &tmp)?;
    std::fs::rename(&tmp, &path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The program pinned for `ifindex`, if it is program `id` (the one attached there).
pub(super) fn get(ifindex: u32, id: u32) -> Option<OwnedFd> {
    let fd = sys::obj_get(&pin_path(&dir()?, ifindex)).ok()?;
    (Program::id_from_fd(fd.as_fd()).ok()? == id).then_some(fd)
}

/// Removes the pin of `ifindex` if it holds program `id`.
pub(super) fn unpin(ifindex: u32, id: u32) {
    let Some(dir) = dir() else {
        return;
    };
    let path = pin_path(&dir, ifindex);
    let ours = sys::obj_get(&path)
        .ok()
        .and_then(|fd| Program::id_from_fd(fd.as_fd()).ok())
        == Some(id);
    if ours {
        let _ = std::fs::remove_file(path);
    }
}

/// The name of the directory the program and maps of this build are pinned in:
/// `steer-` and a 64-bit FNV-1a hash of the embedded object and [`PIN_LAYOUT`].
pub(super) fn program_dir_name(object: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in PIN_LAYOUT.to_le_bytes().iter().chain(object) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("steer-{h:016x}")
}

/// The version of what userspace reads in a pinned program's maps beyond the object
/// itself (which pins, under which names): a change makes the next kxp load afresh.
const PIN_LAYOUT: u32 = 1;

/// Pins `prog` and `maps` (name, fd) in `dir/name`, emptied first: a directory with a pin
/// missing is never taken up (see [`open_program`]).
pub(super) fn pin_program(
    name: &str,
    prog: BorrowedFd<'_>,
    maps: &[(&str, BorrowedFd<'_>)],
) -> io::Result<()> {
    let Some(dir) = dir() else {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no bpffs at {BPFFS}"),
        ));
    };
    let at = dir.join(name);
    remove_program_dir(&at);
    std::fs::create_dir_all(&at)?;
    for (map, fd) in maps {
        sys::obj_pin(*fd, &at.join(map))?;
    }
    // The program last: its pin says the directory is whole.
    sys::obj_pin(prog, &at.join("prog"))
}

/// The program pinned in `dir/name`, and that directory (its maps are pinned in it
/// under their names), if the directory is whole (the program's pin is written last).
pub(super) fn open_program(name: &str) -> Option<(OwnedFd, PathBuf)> {
    let at = dir()?.join(name);
    let prog = sys::obj_get(&at.join("prog")).ok()?;
    Some((prog, at))
}

/// Removes the program directories of other builds than `keep` (once kxp has taken over:
/// their programs are detached everywhere). Returns how many went.
pub(super) fn prune_programs(keep: &str) -> usize {
    sweep(None, |name, path| {
        let stale = name.starts_with("steer-") && name != keep;
        if stale {
            remove_program_dir(path);
        }
        stale
    })
}

/// Calls `remove` with the name and path of each entry of `dir` (the calling thread's pin
/// directory if `None`); returns how many it said it removed.
fn sweep(dir: Option<&Path>, mut remove: impl FnMut(&str, &Path) -> bool) -> usize {
    let Some(dir) = dir.map(Path::to_path_buf).or_else(self::dir) else {
        return 0;
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| remove(&e.file_name().to_string_lossy(), &e.path()))
        .count()
}

/// Removes a program directory and its pins (the program and maps live on while
/// anything else holds them).
fn remove_program_dir(at: &Path) {
    if let Ok(entries) = std::fs::read_dir(at) {
        for e in entries.filter_map(Result::ok) {
            let _ = std::fs::remove_file(e.path());
        }
    }
    let _ = std::fs::remove_dir(at);
}

/// Removes the pins of every interface but `keep` (once kxp has taken over: the others
/// are interfaces gone while no kxp ran). Returns how many went.
pub fn prune(keep: &[u32]) -> usize {
    sweep(None, |name, path| {
        let stale = match name.strip_prefix("xdp-").map(str::parse::<u32>) {
            Some(Ok(i)) => !keep.contains(&i),
            // A pin being renamed into place by a kxp that died there.
            _ => name.ends_with("-new"),
        };
        stale && std::fs::remove_file(path).is_ok()
    })
}

/// Removes the pins in `dir` (kxp's files only) and the directory if it is then empty.
pub fn remove_dir(dir: &Path) {
    sweep(Some(dir), |name, path| {
        if name.starts_with("xdp-") {
            std::fs::remove_file(path).is_ok()
        } else if name.starts_with("steer-") {
            remove_program_dir(path);
            true
        } else {
            false
        }
    });
    let _ = std::fs::remove_dir(dir);
    // A namespace's directory was the last: `kxp` itself goes too (only if empty).
    let base = Path::new(BPFFS).join("kxp");
    if dir.parent() == Some(base.as_path()) {
        let _ = std::fs::remove_dir(base);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pin is found again by the id netlink would report, never for another id, and
    /// goes when unpinned (or with its directory). Needs root and bpffs.
    #[test]
    fn a_pinned_program_is_found_by_its_id_only() {
        let s = crate::xdp::testutil::steering();
        assert!(dir().is_some(), "bpffs is not mounted at {BPFFS}");
        // An interface index no test namespace has.
        let ifindex = 0x7fff_0000 + std::process::id() % 0xffff;
        pin(ifindex, s.program.fd.as_fd()).unwrap();
        let fd = get(ifindex, s.prog_id()).expect("found by its id");
        assert_eq!(Program::id_from_fd(fd.as_fd()).unwrap(), s.prog_id());
        assert!(get(ifindex, s.prog_id() + 1).is_none(), "another id");
        // Pinning again replaces it.
        let t = crate::xdp::testutil::steering();
        pin(ifindex, t.program.fd.as_fd()).unwrap();
        assert!(get(ifindex, s.prog_id()).is_none());
        unpin(ifindex, s.prog_id()); // not its pin any more: stays
        assert!(get(ifindex, t.prog_id()).is_some());
        unpin(ifindex, t.prog_id());
        assert!(get(ifindex, t.prog_id()).is_none());
        assert!(!pin_path(&dir().unwrap(), ifindex).exists());
        let _ = std::fs::remove_dir(dir().unwrap()); // if no kxp uses it
    }
}
