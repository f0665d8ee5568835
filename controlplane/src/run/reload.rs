//! `systemctl reload kxp` (SIGHUP): the running kxp starts its successor beside itself
//! (the binary at the path it was started as, which an upgrade has replaced, with its
//! arguments and the next generation), which takes the node over by the hand-over of
//! [`super::handover`] as a rolling update's new pod does. Once programmed, the successor
//! tells systemd it is the service's main process (`MAINPID=`, `READY=1` on
//! `NOTIFY_SOCKET`) and stops its predecessor, which stood by since the release.
//!
//! Without a generation (`KXP_GENERATION`, which the unit sets) or a state directory
//! there is no hand-over to do: SIGHUP is then logged and ignored.

use std::ffi::OsString;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set in the successor's environment: the pid of the kxp that started it.
const RELOADED_FROM: &str = "KXP_RELOADED_FROM";

/// Listens for SIGHUP and starts a successor at each (one at a time: a second SIGHUP
/// while one is starting is ignored).
pub(crate) fn on_sighup(generation: Option<u64>, has_state_dir: bool) {
    let pending = Arc::new(AtomicBool::new(false));
    let mut signals = match signal_hook::iterator::Signals::new([signal_hook::consts::SIGHUP]) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot listen for SIGHUP (reload): {e}");
            return;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("kxp-reload".into())
        .spawn(move || {
            for _ in signals.forever() {
                let (Some(g), true) = (generation, has_state_dir) else {
                    tracing::warn!(
                        "SIGHUP: a reload hands the node over to a new kxp, which needs \
                         KXP_GENERATION (deploy/kxp.service sets it) and a state directory; \
                         ignored"
                    );
                    continue;
                };
                if pending.swap(true, Ordering::Relaxed) {
                    tracing::info!("SIGHUP: a successor is already starting; ignored");
                    continue;
                }
                match start_successor(g + 1) {
                    Ok(pid) => tracing::info!(
                        pid,
                        generation = g + 1,
                        "SIGHUP: started a successor, which takes this node over"
                    ),
                    Err(e) => {
                        tracing::warn!("SIGHUP: cannot start a successor: {e}");
                        pending.store(false, Ordering::Relaxed);
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot listen for SIGHUP (reload): {e}");
    }
}

/// The binary to start: the path this kxp was started as (an upgrade replaced the file
/// there), else this process's own executable.
fn binary() -> std::io::Result<PathBuf> {
    match std::env::args_os().next().map(PathBuf::from) {
        Some(p) if p.components().count() > 1 => Ok(p),
        _ => std::env::current_exe(),
    }
}

fn start_successor(generation: u64) -> std::io::Result<u32> {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let child = std::process::Command::new(binary()?)
        .args(args)
        .env("KXP_GENERATION", generation.to_string())
        .env(RELOADED_FROM, std::process::id().to_string())
        .stdin(std::process::Stdio::null())
        .spawn()?;
    Ok(child.id())
}

/// Once programmed: says so to systemd (`READY=1`), and, for a successor started by a
/// reload that took the node over, that it is the service's main process now, then
/// stops its predecessor (`took_over`: the predecessor released the node to this one).
pub(crate) fn ready(took_over: bool) {
    let from = std::env::var(RELOADED_FROM)
        .ok()
        .and_then(|p| p.trim().parse::<u32>().ok())
        .filter(|&p| p > 1);
    match from {
        Some(pid) if took_over => {
            notify(&format!("MAINPID={}\nREADY=1\n", std::process::id()));
            // The kxp that started this one stands by since it released the node.
            match dataplane::sys::signal_process(pid, signal_hook::consts::SIGTERM) {
                Ok(()) => tracing::info!(pid, "reload: stopped the kxp this one took over from"),
                Err(e) => tracing::warn!(
                    pid,
                    "reload: cannot stop the kxp this one took over from: {e}"
                ),
            }
        }
        _ => notify("READY=1\n"),
    }
}

/// Sends `msg` to systemd's notification socket, if it gave one.
fn notify(msg: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = UnixDatagram::unbound() else {
        return;
    };
    let path = PathBuf::from(path);
    let sent = match path.to_str().and_then(|p| p.strip_prefix('@')) {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
                .and_then(|a| sock.send_to_addr(msg.as_bytes(), &a))
        }
        None => sock.send_to(msg.as_bytes(), &path),
    };
    if let Err(e) = sent {
        tracing::warn!("cannot notify systemd ({}): {e}", path.display());
    }
}
