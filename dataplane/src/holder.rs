//! The socket holder: a small process, started by kxp, that holds a second reference to
//! every AF_XDP socket of the workers, so that a kxp that dies without stopping (kill -9,
//! a crash, the OOM killer) has its sockets released in parallel.
//!
//! The kernel's release of a bound AF_XDP socket waits for an RCU grace period
//! (`synchronize_net` in `xsk_unbind_dev`). A process that dies has its descriptors
//! closed by its last thread, one after another: with 110 pod veths, 112 sockets took
//! 1.75-1.95 s to go, and a supervisor (systemd, the kubelet) starts the next kxp only
//! after that. With the holder, the dying kxp's closes only drop references; the holder
//! sees its link to kxp close and exits, and its threads, each with a descriptor table
//! of its own (`unshare(CLONE_FILES)`) holding one socket (a thread is started for each
//! socket, up to [`MAX_LANES`]), close theirs at the same time, so the grace periods
//! overlap: the release takes one grace period, whatever the number of pods (with 32
//! threads for 112 sockets, each closed three or four in turn: 0.12 s). Where the holder is killed together with
//! kxp (its container's PID namespace ends with kxp), its threads still close their
//! tables in parallel.
//!
//! A stop that kxp makes itself (SIGTERM, a hand-over) drops the workers' references and
//! then [`SocketHolder::finish`]es, which waits for the holder's exit: the sockets are
//! gone when kxp says it has stopped.
//!
//! The holder ignores SIGTERM, SIGINT and SIGHUP (a signal to kxp's process group must
//! not end it before kxp has dropped its references), drops every capability, and
//! inherits no descriptor but its link.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::sys;

/// The argument kxp's binary runs the holder with (then the link's descriptor number).
pub const HOLD_ARG: &str = "hold-sockets";

/// Most threads of the holder (one per socket up to there; past it, they share).
const MAX_LANES: usize = 1024;

/// A lane thread's stack: it holds a map of descriptors and waits.
const LANE_STACK: usize = 64 * 1024;

const OP_HOLD: u32 = 1;
const OP_FORGET: u32 = 2;

/// A message: operation and key, little-endian.
const MSG: usize = 12;

/// The key of the socket on `ifindex`'s receive queue `queue` (one socket each).
pub fn key(ifindex: u32, queue: u32) -> u64 {
    u64::from(ifindex) << 32 | u64::from(queue)
}

/// kxp's side of a running holder.
#[derive(Debug)]
pub struct SocketHolder {
    link: Mutex<Option<OwnedFd>>,
    child: Mutex<Option<Child>>,
}

impl SocketHolder {
    /// Starts `exe hold-sockets FD`, linked to this process.
    ///
    /// # Errors
    /// The link cannot be made or the program cannot be started.
    pub fn spawn(exe: &Path) -> io::Result<SocketHolder> {
        let (ours, theirs) = sys::seqpacket_pair()?;
        sys::set_cloexec(theirs.as_fd(), false)?;
        let child = Command::new(exe)
            .arg(HOLD_ARG)
            .arg(std::os::fd::AsRawFd::as_raw_fd(&theirs).to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn();
        // Ours only from here: the holder has its copy (or did not start).
        drop(theirs);
        Ok(SocketHolder {
            link: Mutex::new(Some(ours)),
            child: Mutex::new(Some(child?)),
        })
    }

    /// The holder's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(Child::id)
    }

    fn send(&self, op: u32, key: u64, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        let mut msg = [0u8; MSG];
        msg[..4].copy_from_slice(&op.to_le_bytes());
        msg[4..].copy_from_slice(&key.to_le_bytes());
        let link = self.link.lock().unwrap_or_else(|e| e.into_inner());
        let Some(link) = link.as_ref() else {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "holder finished",
            ));
        };
        // Never a wait: a worker tells the holder about its sockets, and a holder that
        // does not read (stopped, stuck) must not stop it.
        sys::send_with_fd(link.as_fd(), &msg, fd, false)
    }

    /// Has the holder keep a reference to `fd` under `key` (replacing what it held
    /// there).
    ///
    /// # Errors
    /// The holder is gone.
    pub fn hold(&self, key: u64, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.send(OP_HOLD, key, Some(fd))
    }

    /// Has the holder drop what it holds under `key`.
    ///
    /// # Errors
    /// The holder is gone.
    pub fn forget(&self, key: u64) -> io::Result<()> {
        self.send(OP_FORGET, key, None)
    }

    /// Closes the link, so the holder drops everything it holds (the sockets released
    /// in parallel where its references were the last) and exits; waits up to `wait`
    /// for that, then kills it. Whether it exited by itself.
    pub fn finish(&self, wait: Duration) -> bool {
        self.link.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(mut child) = self.child.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return true;
        };
        let end = Instant::now() + wait;
        while Instant::now() < end {
            if let Ok(Some(_)) = child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }
}

impl Drop for SocketHolder {
    fn drop(&mut self) {
        self.finish(Duration::from_secs(5));
    }
}

/// [`serve`] on the descriptor `fd` (from the command line), once it is checked to be
/// an open Unix socket; 2 if it is not.
pub fn serve_fd(fd: i32) -> i32 {
    match sys::adopt_unix_socket(fd) {
        Ok(link) => serve(link),
        Err(e) => {
            eprintln!("kxp hold-sockets: descriptor {fd}: {e}");
            2
        }
    }
}

/// The holder's side, on the link `link` (its descriptor from the command line): holds
/// what it is given until the link closes, then exits. Never returns.
pub fn serve(link: OwnedFd) -> ! {
    sys::ignore_stop_signals();
    let rc = sys::drop_all_capabilities();
    if rc != 0 {
        eprintln!("kxp hold-sockets: cannot drop capabilities (errno {rc})");
    }
    let mut lanes = Lanes::default();
    lanes.keep_one_idle();
    let mut buf = [0u8; MSG];
    loop {
        let (n, fd) = sys::recv_with_fd(link.as_fd(), &mut buf).unwrap_or_default();
        if n == 0 {
            // kxp closed the link, or died: every thread's table is closed by its own
            // exit, at the same time.
            std::process::exit(0);
        }
        if n != MSG {
            continue;
        }
        let op = u32::from_le_bytes(buf[..4].try_into().unwrap_or_default());
        let key = u64::from_le_bytes(buf[4..].try_into().unwrap_or_default());
        if let Some(lane) = lanes.route(op, key) {
            let _ = sys::send_with_fd(lane.as_fd(), &buf, fd.as_ref().map(AsFd::as_fd), true);
        }
        // This thread's copy (in the table the lanes do not share) goes now.
        drop(fd);
        // A lane started while this thread held a socket would copy it into its table
        // (never to let it go at a `forget`): the next is started now, ahead.
        lanes.keep_one_idle();
    }
}

/// The holder's lanes, and which holds each key.
#[derive(Default)]
struct Lanes {
    /// Each lane's end of its link, and how many sockets it holds.
    lanes: Vec<(OwnedFd, usize)>,
    held: std::collections::HashMap<u64, usize>,
}

impl Lanes {
    /// Starts a lane if none holds nothing (up to [`MAX_LANES`]).
    fn keep_one_idle(&mut self) {
        if self.lanes.len() < MAX_LANES
            && self.lanes.iter().all(|l| l.1 > 0)
            && let Some(l) = start_lane()
        {
            self.lanes.push((l, 0));
        }
    }

    /// The lane a message about `key` goes to: the one holding it, else (to hold it)
    /// one holding nothing, else the least loaded. None if there is no lane, or to
    /// forget what no lane holds.
    fn route(&mut self, op: u32, key: u64) -> Option<&OwnedFd> {
        let i = match (op, self.held.get(&key).copied()) {
            (OP_FORGET, Some(i)) => {
                self.held.remove(&key);
                self.lanes[i].1 -= 1;
                i
            }
            (OP_FORGET, None) => return None,
            (_, Some(i)) => i,
            (_, None) => {
                let idle = self.lanes.iter().position(|l| l.1 == 0);
                let i = match idle {
                    Some(i) => i,
                    None => (0..self.lanes.len()).min_by_key(|&i| self.lanes[i].1)?,
                };
                self.held.insert(key, i);
                self.lanes[i].1 += 1;
                i
            }
        };
        Some(&self.lanes[i].0)
    }
}

/// Starts a lane, and waits until it has a descriptor table of its own (a socket sent
/// earlier would be copied into the tables of lanes still to unshare).
fn start_lane() -> Option<OwnedFd> {
    let (ours, theirs) = sys::seqpacket_pair().ok()?;
    let (ready_tx, ready) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("kxp-holder".into())
        .stack_size(LANE_STACK)
        .spawn(move || lane(theirs, &ready_tx))
        .ok()?;
    ready.recv_timeout(Duration::from_secs(5)).ok()?;
    Some(ours)
}

/// One lane of the holder: a descriptor table of its own, holding what it receives on
/// `rx` until the process exits.
fn lane(rx: OwnedFd, ready: &std::sync::mpsc::Sender<()>) {
    // Where the table cannot be unshared (a seccomp profile that refuses unshare), the
    // lane shares the process's: its references are still held, released in turn.
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if let Err(e) = sys::unshare_files()
        && !SAID.swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        eprintln!(
            "kxp hold-sockets: cannot give its threads descriptor tables of their own \
             (unshare(CLONE_FILES): {e}): the sockets of a kxp that dies are released one \
             after another"
        );
    }
    let _ = ready.send(());
    let mut held: std::collections::HashMap<u64, OwnedFd> = std::collections::HashMap::new();
    let mut buf = [0u8; MSG];
    loop {
        let Ok((n, fd)) = sys::recv_with_fd(rx.as_fd(), &mut buf) else {
            return park();
        };
        if n == 0 {
            return park();
        }
        if n != MSG {
            continue;
        }
        let op = u32::from_le_bytes(buf[..4].try_into().unwrap_or_default());
        let key = u64::from_le_bytes(buf[4..].try_into().unwrap_or_default());
        match (op, fd) {
            (OP_HOLD, Some(fd)) => {
                held.insert(key, fd);
            }
            (OP_FORGET, _) => {
                held.remove(&key);
            }
            _ => {}
        }
    }
}

/// Waits for the process's exit, holding what this thread holds.
fn park() {
    loop {
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_one_socket_per_interface_and_queue() {
        assert_ne!(key(7, 1), key(7, 2));
        assert_ne!(key(7, 1), key(1, 7));
        assert_eq!(key(7, 1) >> 32, 7);
    }

    #[test]
    fn descriptors_cross_the_link_with_their_messages() {
        let (a, b) = sys::seqpacket_pair().unwrap();
        let (x, _y) = sys::seqpacket_pair().unwrap();
        sys::send_with_fd(a.as_fd(), b"hold", Some(x.as_fd()), true).unwrap();
        sys::send_with_fd(a.as_fd(), b"bare", None, false).unwrap();
        let mut buf = [0u8; 16];
        let (n, fd) = sys::recv_with_fd(b.as_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hold");
        let fd = fd.expect("the descriptor came with its message");
        // The same socket: a message written into the received copy reaches `_y`.
        sys::send_with_fd(fd.as_fd(), b"via copy", None, true).unwrap();
        let (n, none) = sys::recv_with_fd(b.as_fd(), &mut buf).unwrap();
        assert_eq!((&buf[..n], none.is_none()), (&b"bare"[..], true));
        drop(a);
        let (n, _) = sys::recv_with_fd(b.as_fd(), &mut buf).unwrap();
        assert_eq!(n, 0, "the peer's close reads as 0 bytes");
        let (n, _) = sys::recv_with_fd(_y.as_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"via copy");
    }
}
