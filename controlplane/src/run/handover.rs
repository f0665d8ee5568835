//! A new kxp taking a node over from the running one: a rolling update of the DaemonSet
//! with a surge, where the new pod starts beside the old one.
//!
//! The running kxp listens on `release.sock` in its state directory. The protocol, one
//! line each way:
//!
//! 1. At its start, before it lists the cluster, the new kxp **announces** itself:
//!    `intend 1 GENERATION`. The running kxp accepts it (`ok`) only if the generation is
//!    newer than its own (`KXP_GENERATION`: the DaemonSet's `pod-template-generation`
//!    label). So an old pod restarted by the kubelet never takes the node back.
//!    A new kxp that takes a loan of the sockets says so: `intend 1 GENERATION lend`; a
//!    running kxp that makes one answers `ok lend` (either side without it: `ok`, and no
//!    loan, as before).
//! 2. Once the new kxp has the lists (which take the longest), it takes up the pinned
//!    program and the service device, then asks for the loan: `lend`. The running kxp
//!    answers `lent N` and, for each of its N workers, the UMEM's memfd with its
//!    geometry and every socket (copies of its descriptors), and goes on forwarding; the
//!    new kxp maps them ([`Premapped`]).
//! 3. It then asks: `release`. The running kxp stops as at SIGTERM: steering, service
//!    device and state files kept, the state directory unlocked; but its sockets are not
//!    closed. It answers `released`,
//!    then `sockets N` and, for each of its N workers, the UMEM's memfd with what
//!    userspace held of its frames, and every socket (SCM_RIGHTS, one descriptor per
//!    message; see dataplane::xsk::Handed), and stands by until it is stopped. The new kxp
//!    takes the state directory and the steering program over as at a restart (see
//!    docs/operations.md), and the sockets up where the running one left their rings,
//!    instead of opening new ones (those it cannot take up, it closes and opens anew).
//!    Those it mapped ahead are taken up with no mapping, their rings where they are now.
//!
//! A running kxp told to stop (SIGTERM: the DaemonSet deleting the old pod, perhaps
//! because the new one looked ready) while a successor is announced goes on forwarding
//! until that successor asks for the node, or goes away, or [`SUCCESSOR_WAIT`] passes.
//! So the node is never left without a kxp while the new one lists the cluster. Without
//! a generation on either side, or with a running kxp that does not speak this
//! protocol, the new kxp waits for the state directory's lock as at a restart.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dataplane::plane::HandedOver;
use dataplane::xsk::{Handed, HandedState, Lent, LentGeometry, Premapped};

/// What lends the dataplane's sockets ahead of a hand-over (see [`send_lent`]): `None`
/// if they cannot be.
pub(crate) type Lender = Arc<dyn Fn() -> Option<Vec<Lent>> + Send + Sync>;

/// The protocol's version: a kxp that speaks another answers `refused`.
const VERSION: u32 = 1;
/// The start of the answer to a kxp that is not newer than the running one.
const OUTRANKED: &str = "refused: outranked";
/// How long a new kxp waits for each answer of the running one.
const ANSWER_WAIT: Duration = Duration::from_secs(10);
/// How long a running kxp told to stop goes on forwarding for an announced successor
/// (the DaemonSet's terminationGracePeriodSeconds is 60).
pub(crate) const SUCCESSOR_WAIT: Duration = Duration::from_secs(45);

/// The socket's path in state directory `dir`.
fn socket_path(dir: &Path) -> PathBuf {
    dir.join("release.sock")
}

/// This kxp's generation: `KXP_GENERATION` (the DaemonSet passes its pod template's
/// generation), if set and a number.
pub(crate) fn generation() -> Option<u64> {
    std::env::var("KXP_GENERATION").ok()?.trim().parse().ok()
}

/// The new kxp's side: announced to the running one, the node asked for later.
#[derive(Debug)]
pub(crate) struct Successor {
    stream: UnixStream,
    generation: u64,
    /// The running kxp lends its sockets ahead of the release (it answered `ok lend`).
    lends: bool,
}

/// What asking the running kxp for the node gave.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Asked {
    /// It released the node, in this long.
    Released(Duration),
    /// It did not (why).
    Refused(String),
}

/// What announcing this kxp gave.
#[derive(Debug)]
pub(crate) enum Announced {
    /// No kxp listens (none runs, or one without this protocol or a generation), or it
    /// did not take this one for another reason: the lock decides, as at a restart.
    Nobody,
    /// The running kxp takes this one as its successor.
    Successor(Successor),
    /// The running kxp is of this kxp's generation or a newer one: this one must not
    /// take the node (an old pod restarted during a rolling update).
    Outranked(String),
}

impl Successor {
    /// Announces this kxp, of `generation`, to the kxp running with state directory
    /// `dir`, and logs what came of it.
    pub(crate) fn announce(dir: &Path, generation: Option<u64>) -> Announced {
        let Some(generation) = generation else {
            return Announced::Nobody;
        };
        let Ok(mut stream) = UnixStream::connect(socket_path(dir)) else {
            return Announced::Nobody;
        };
        let answer = stream
            .set_read_timeout(Some(ANSWER_WAIT))
            .and_then(|()| writeln!(stream, "intend {VERSION} {generation} {LEND}"))
            .and_then(|()| read_line(&stream));
        match answer {
            Ok(a) if a == "ok" || a == format!("ok {LEND}") => {
                tracing::info!(
                    "a kxp runs on this node: announced as its successor (generation \
                     {generation}); it forwards until this one has the cluster's lists"
                );
                Announced::Successor(Successor {
                    stream,
                    generation,
                    lends: a.ends_with(LEND),
                })
            }
            Ok(a) if a.starts_with(OUTRANKED) => Announced::Outranked(a),
            Ok(a) => {
                tracing::warn!("the running kxp does not take this one as its successor: {a}");
                Announced::Nobody
            }
            Err(e) => {
                tracing::warn!("the running kxp did not answer this one's announcement: {e}");
                Announced::Nobody
            }
        }
    }

    /// Ahead of the release, while the running kxp still forwards: asks it to lend its
    /// workers' UMEMs and sockets, and maps them ([`Premapped`]), so that taking them up
    /// at the hand-over costs no mapping. Nothing if it does not lend them. Logs what
    /// came of it.
    ///
    /// # Errors
    /// The loan did not arrive whole: the connection is out of step, this kxp must not
    /// ask for the node on it.
    pub(crate) fn premap(&mut self) -> Result<Premapped, String> {
        if !self.lends {
            tracing::info!(
                "the running kxp lends no sockets ahead (a kxp before loans): they are mapped \
                 at the hand-over"
            );
            return Ok(Premapped::default());
        }
        let started = Instant::now();
        writeln!(self.stream, "{LEND}").map_err(|e| e.to_string())?;
        let lent = receive_lent(&self.stream)?;
        let workers = lent.len();
        let (premapped, failed) = Premapped::map(lent);
        tracing::info!(
            workers,
            sockets = premapped.sockets(),
            not_mapped = failed,
            took_ms = started.elapsed().as_millis() as u64,
            "mapped the running kxp's sockets ahead of the hand-over (it goes on forwarding)"
        );
        Ok(premapped)
    }

    /// Asks the running kxp for the node and waits until it has released it, then takes
    /// the sockets it hands over (none from a kxp that hands none). Logs what came of it.
    pub(crate) fn ask_release(self) -> (Asked, HandedOver) {
        let stream = self.stream.try_clone();
        let batched = self.lends;
        let asked = self.ask();
        if !matches!(asked, Asked::Released(_)) {
            return (asked, HandedOver::default());
        }
        let started = Instant::now();
        let handed = match stream
            .map_err(|e| e.to_string())
            .and_then(|s| receive_sockets(&s, batched))
        {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(
                    "the sockets the running kxp handed over did not arrive whole ({e}): \
                     opening new ones"
                );
                HandedOver::default()
            }
        };
        if !handed.workers.is_empty() {
            tracing::info!(
                workers = handed.workers.len(),
                sockets = handed.sockets(),
                took_ms = started.elapsed().as_millis() as u64,
                "took the sockets the running kxp handed over"
            );
        }
        (asked, handed)
    }

    fn ask(mut self) -> Asked {
        let started = Instant::now();
        let asked = match writeln!(self.stream, "release").and_then(|()| read_line(&self.stream)) {
            Ok(a) if a == "released" => Asked::Released(started.elapsed()),
            Ok(a) if a.is_empty() => Asked::Refused("it closed the connection".into()),
            Ok(a) => Asked::Refused(a),
            Err(e) => Asked::Refused(format!("no answer within {ANSWER_WAIT:?}: {e}")),
        };
        match &asked {
            Asked::Released(took) => tracing::info!(
                took_ms = took.as_millis() as u64,
                "the running kxp released the node to this one (generation {})",
                self.generation
            ),
            Asked::Refused(why) => tracing::warn!(
                "the running kxp did not release the node: {why}; waiting for its state \
                 directory as at a restart"
            ),
        }
        asked
    }
}

/// The kinds of the messages that carry descriptors, after `sockets N`: a worker's
/// UMEM (with its state after the header), and one of its sockets; after `lent N`, a
/// worker's UMEM with its geometry after the header.
const MSG_WORKER: u32 = 1;
const MSG_SOCKET: u32 = 2;
const MSG_LENT: u32 = 3;
/// Sockets in a batch (the header's length is how many descriptors it carries), between
/// two kxp that lend (this protocol's later form): one message instead of one each.
const MSG_SOCKETS: u32 = 4;
/// The word of the loan ahead of the release: in the announcement (the new kxp takes
/// one), its answer (the running kxp makes one) and the request.
const LEND: &str = "lend";

/// A message's header: its kind and the length of what follows.
fn header(kind: u32, len: usize) -> [u8; 8] {
    let mut h = [0u8; 8];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[4..].copy_from_slice(&(len as u32).to_le_bytes());
    h
}

/// Sends copies of `fds` on `s` in batches ([`MSG_SOCKETS`]).
fn send_batched(s: &UnixStream, fds: &[OwnedFd]) -> std::io::Result<()> {
    use std::os::fd::AsFd;
    for chunk in fds.chunks(dataplane::sys::MAX_FDS_PER_MESSAGE) {
        let borrowed: Vec<_> = chunk.iter().map(AsFd::as_fd).collect();
        dataplane::sys::send_with_fds(
            s.as_fd(),
            &header(MSG_SOCKETS, chunk.len()),
            &borrowed,
            true,
        )?;
    }
    Ok(())
}

/// `n` descriptors sent by [`send_batched`].
fn receive_batched(s: &UnixStream, n: usize) -> Result<Vec<OwnedFd>, String> {
    let mut fds = Vec::with_capacity(n);
    while fds.len() < n {
        let (kind, len, batch) = receive_header(s)?;
        if kind != MSG_SOCKETS || len != batch.len() || fds.len() + len > n {
            return Err(format!(
                "a message of kind {kind} with {} of {len} descriptors where {} sockets \
                 were due",
                batch.len(),
                n - fds.len()
            ));
        }
        fds.extend(batch);
    }
    Ok(fds)
}

/// Sends `lent` on `s` (the answer to `lend`): a line `lent N` (N workers, 0 if they
/// could not be lent), then per worker its UMEM's memfd with its geometry, and each of
/// its sockets, one descriptor per message.
fn send_lent(s: &UnixStream, lent: Option<&[Lent]>) -> std::io::Result<()> {
    let mut w = s;
    let lent = lent.unwrap_or_default();
    writeln!(w, "lent {}", lent.len())?;
    for l in lent {
        let g = l.geometry.encode();
        send_worker(s, (MSG_LENT, &g), &l.memfd, &l.sockets, true)?;
    }
    w.flush()
}

/// What the running kxp lent ([`send_lent`]).
fn receive_lent(s: &UnixStream) -> Result<Vec<Lent>, String> {
    let line = read_line(s).map_err(|e| e.to_string())?;
    let workers = match line.strip_prefix("lent ").map(str::parse::<usize>) {
        Some(Ok(n)) if n <= 4096 => n,
        _ => return Err(format!("not a loan of sockets: {line:?}")),
    };
    let mut lent = Vec::with_capacity(workers);
    for _ in 0..workers {
        let (len, memfd) = receive_fd(s, MSG_LENT)?;
        if len > 64 {
            return Err(format!("a worker's geometry of {len} bytes"));
        }
        let mut bytes = vec![0; len];
        let mut r = s;
        r.read_exact(&mut bytes).map_err(|e| e.to_string())?;
        let geometry = LentGeometry::decode(&bytes)?;
        if geometry.sockets > 65_536 {
            return Err(format!("{} sockets", geometry.sockets));
        }
        let sockets = receive_batched(s, geometry.sockets as usize)?;
        lent.push(Lent {
            memfd,
            geometry,
            sockets,
        });
    }
    Ok(lent)
}
/// The most bytes of a worker's state (its free list and frame owners are a few hundred
/// kilobytes at most).
const MAX_STATE: usize = 64 << 20;

/// Sends `handed` on `s` after `released`: a line `sockets N` (N workers), then per
/// worker its UMEM's memfd with its state, and each of its sockets, one descriptor per
/// message (SCM_RIGHTS).
fn send_sockets(s: &UnixStream, handed: &HandedOver, batched: bool) -> std::io::Result<()> {
    let mut w = s;
    writeln!(w, "sockets {} {}", handed.workers.len(), handed.stopped_ns)?;
    for h in &handed.workers {
        let state = h.state.encode();
        send_worker(s, (MSG_WORKER, &state), &h.memfd, &h.sockets, batched)?;
    }
    w.flush()
}

/// One worker's part of [`send_sockets`] or [`send_lent`]: its UMEM's `memfd` in a
/// message of kind `kind.0` followed by `kind.1` (its state or geometry), then its
/// `sockets`, in batches or (for a kxp before loans) one per message.
fn send_worker(
    s: &UnixStream,
    (kind, bytes): (u32, &[u8]),
    memfd: &OwnedFd,
    sockets: &[OwnedFd],
    batched: bool,
) -> std::io::Result<()> {
    use std::os::fd::AsFd;
    dataplane::sys::send_with_fd(
        s.as_fd(),
        &header(kind, bytes.len()),
        Some(memfd.as_fd()),
        true,
    )?;
    let mut w = s;
    w.write_all(bytes)?;
    if batched {
        return send_batched(s, sockets);
    }
    for sock in sockets {
        dataplane::sys::send_with_fd(s.as_fd(), &header(MSG_SOCKET, 0), Some(sock.as_fd()), true)?;
    }
    Ok(())
}

/// One message's header (its kind and length) and the descriptors it carries.
fn receive_header(s: &UnixStream) -> Result<(u32, usize, Vec<OwnedFd>), String> {
    use std::os::fd::AsFd;
    let mut h = [0u8; 8];
    let (n, fds) = dataplane::sys::recv_with_fds(s.as_fd(), &mut h).map_err(|e| e.to_string())?;
    if n == 0 {
        return Err("the connection closed".into());
    }
    let mut r = s;
    r.read_exact(&mut h[n..]).map_err(|e| e.to_string())?;
    let kind = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
    Ok((kind, len, fds))
}

/// One message's header and the descriptor it carries.
fn receive_fd(s: &UnixStream, kind: u32) -> Result<(usize, std::os::fd::OwnedFd), String> {
    let (got, len, fds) = receive_header(s)?;
    let fd = fds.into_iter().next();
    if got != kind {
        return Err(format!("a message of kind {got} where {kind} was expected"));
    }
    let fd = fd.ok_or("a message without its descriptor")?;
    Ok((len, fd))
}

/// The sockets the running kxp hands over after `released` ([`send_sockets`]): none if
/// it sends none (a kxp before this protocol closes the connection).
fn receive_sockets(s: &UnixStream, batched: bool) -> Result<HandedOver, String> {
    let line = read_line(s).map_err(|e| e.to_string())?;
    if line.is_empty() {
        return Ok(HandedOver::default());
    }
    let mut words = line.split_whitespace();
    let (Some("sockets"), Some(Ok(workers)), Some(Ok(stopped_ns))) = (
        words.next(),
        words.next().map(str::parse::<usize>),
        words.next().map(str::parse::<u64>),
    ) else {
        return Err(format!("not a count of sockets: {line:?}"));
    };
    if workers > 4096 {
        return Err(format!("{workers} workers"));
    }
    let mut handed = Vec::with_capacity(workers);
    for _ in 0..workers {
        let (len, memfd) = receive_fd(s, MSG_WORKER)?;
        if len > MAX_STATE {
            return Err(format!("a worker's state of {len} bytes"));
        }
        let mut bytes = vec![0; len];
        let mut r = s;
        r.read_exact(&mut bytes).map_err(|e| e.to_string())?;
        let state = HandedState::decode(&bytes)?;
        let sockets = if batched {
            receive_batched(s, state.ports.len())?
        } else {
            (0..state.ports.len())
                .map(|_| receive_fd(s, MSG_SOCKET).map(|(_, fd)| fd))
                .collect::<Result<_, _>>()?
        };
        handed.push(Handed {
            memfd,
            sockets,
            state,
        });
    }
    Ok(HandedOver {
        workers: handed,
        stopped_ns,
    })
}

/// One line from `s`, without its end (empty at the end of the stream). Read a byte at
/// a time, so that nothing of the next line is taken with it (each side sends a line
/// and waits for the answer; they are a few bytes long).
fn read_line(mut s: &UnixStream) -> std::io::Result<String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 256 {
        if s.read(&mut byte)? == 0 || byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
    }
    Ok(String::from_utf8_lossy(&line).trim().to_string())
}

/// What the listener knows, shared with `kxp run`.
#[derive(Debug, Default)]
struct State {
    /// A successor announced itself and is still connected.
    announced: bool,
    /// The successor that asked for the node (answered once the dataplane stopped).
    asking: Option<UnixStream>,
    /// It takes loans, so it takes its sockets in batches too.
    batched: bool,
}

/// The running kxp's side: takes a newer kxp's announcement and its request.
pub(crate) struct ReleaseListener {
    path: PathBuf,
    state: Arc<Mutex<State>>,
    /// SIGTERM or SIGINT came (as opposed to a successor asking).
    signalled: Arc<AtomicBool>,
    done: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ReleaseListener {
    /// Listens in state directory `dir` (this kxp holds its lock) for a newer kxp; when
    /// it asks for the node, sets `stop` so that this kxp stops as at SIGTERM. Without a
    /// generation there is nothing to listen for (no newer kxp can be told apart).
    pub(crate) fn start(
        dir: &Path,
        generation: Option<u64>,
        stop: Arc<AtomicBool>,
        lender: Option<Lender>,
    ) -> Option<ReleaseListener> {
        let generation = generation?;
        let signalled = Arc::new(AtomicBool::new(false));
        for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
            signal_hook::flag::register(sig, signalled.clone()).ok()?;
        }
        let path = socket_path(dir);
        // A socket left by a kxp that died: the lock is ours, so it is nobody's.
        let _ = std::fs::remove_file(&path);
        let listener = match UnixListener::bind(&path) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(
                    path = %path.display(),
                    "cannot listen for a newer kxp: {e}; a rolling update with a surge \
                     will restart this node's kxp instead of taking it over"
                );
                return None;
            }
        };
        let _ = listener.set_nonblocking(true);
        let state = Arc::new(Mutex::new(State::default()));
        let done = Arc::new(AtomicBool::new(false));
        let (st, d) = (state.clone(), done.clone());
        let thread = std::thread::Builder::new()
            .name("kxp-release".into())
            .spawn(move || listen(&listener, generation, &st, &d, &stop, lender.as_ref()))
            .ok()?;
        Some(ReleaseListener {
            path,
            state,
            signalled,
            done,
            thread: Some(thread),
        })
    }

    /// Told to stop by a signal while a successor is announced: goes on forwarding (the
    /// dataplane runs on) until it asks for the node, goes away, or `wait` passes.
    pub(crate) fn wait_for_successor(&self, wait: Duration) {
        if !self.signalled.load(Ordering::Relaxed) || !lock(&self.state).announced {
            return;
        }
        tracing::info!(
            "told to stop while a newer kxp prepares to take this node over: forwarding \
             until it does (at most {wait:?})"
        );
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            let st = lock(&self.state);
            if st.asking.is_some() || !st.announced {
                return;
            }
            drop(st);
            std::thread::sleep(Duration::from_millis(10));
        }
        tracing::warn!("the newer kxp did not ask for the node within {wait:?}: stopping");
    }

    /// Whether a successor has asked for the node (the dataplane then hands its sockets
    /// over as it stops, [`Dataplane::hand_over`](dataplane::plane::Dataplane::hand_over)).
    pub(crate) fn asked(&self) -> bool {
        lock(&self.state).asking.is_some()
    }

    /// Once the dataplane has stopped: tells the successor that asked, if one did, that
    /// the node is its own, and hands it the sockets `handed`. Returns whether this kxp
    /// should stand by: one asked and no signal came.
    pub(crate) fn finish(mut self, handed: &HandedOver) -> bool {
        self.done.store(true, Ordering::Relaxed);
        // The successor first: forwarding waits for the sockets; the listener's thread
        // and its socket file after.
        let (asking, batched) = {
            let mut st = lock(&self.state);
            (st.asking.take(), st.batched)
        };
        let asked = asking.is_some();
        if let Some(s) = asking {
            release_to(s, handed, batched);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
        asked && !self.signalled.load(Ordering::Relaxed)
    }
}

/// Tells the successor that asked (on `s`) that the node is its own, and hands it the
/// sockets `handed`.
fn release_to(mut s: UnixStream, handed: &HandedOver, batched: bool) {
    if let Err(e) = writeln!(s, "released") {
        tracing::warn!("cannot tell the newer kxp that the node is released: {e}");
    } else if let Err(e) = send_sockets(&s, handed, batched) {
        tracing::warn!("cannot hand the sockets over to the newer kxp: {e}");
    } else if !handed.workers.is_empty() {
        tracing::info!(
            workers = handed.workers.len(),
            sockets = handed.sockets(),
            sent_us = (dataplane::sys::monotonic_ns() - handed.stopped_ns) / 1000,
            "handed the sockets over to the newer kxp"
        );
    }
}

/// Serves announcements until `done`: takes the first from a newer generation than
/// `ours` and waits on it for `release` (then sets `stop`); answers the others at once,
/// outranked by the running kxp or by the successor it took.
fn listen(
    listener: &UnixListener,
    ours: u64,
    state: &Mutex<State>,
    done: &AtomicBool,
    stop: &AtomicBool,
    lender: Option<&Lender>,
) {
    // The successor's connection until it asks, and its generation from when it is
    // taken on (every later announcement is answered against it).
    let mut pending: Option<UnixStream> = None;
    let mut successor: Option<u64> = None;
    let mut batched = false;
    while !done.load(Ordering::Relaxed) {
        if let Ok((s, _)) = listener.accept() {
            let rank = successor.unwrap_or(ours);
            let (taken, lends) = (successor.is_some(), lender.is_some());
            if let Some((taken, theirs, lent)) = answer(s, ours, rank, taken, lends) {
                lock(state).announced = true;
                pending = Some(taken);
                successor = Some(theirs);
                batched = lent;
            }
        }
        let (Some(s), Some(theirs)) = (&pending, successor) else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        // Its request, or its going away.
        match read_line(s) {
            Ok(l) if l == LEND => {
                let lent = lender.and_then(|f| f());
                match send_lent(s, lent.as_deref()) {
                    Ok(()) => tracing::info!(
                        workers = lent.as_ref().map_or(0, Vec::len),
                        sockets = lent
                            .iter()
                            .flatten()
                            .map(|l| l.sockets.len())
                            .sum::<usize>(),
                        "lent the sockets to the newer kxp (generation {theirs}) to map \
                         ahead; forwarding goes on"
                    ),
                    Err(e) => tracing::warn!("cannot lend the sockets to the newer kxp: {e}"),
                }
            }
            Ok(l) if l == "release" => {
                tracing::info!(
                    "the newer kxp (generation {theirs}) asks for the node: stopping as at \
                     SIGTERM, then standing by"
                );
                let mut st = lock(state);
                st.asking = pending.take();
                st.batched = batched;
                drop(st);
                stop.store(true, Ordering::Relaxed);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            _ => {
                tracing::info!("the newer kxp (generation {theirs}) went away");
                lock(state).announced = false;
                pending = None;
                successor = None;
            }
        }
    }
}

/// Answers announcement connection `s` (this kxp of generation `ours`, outranking up to
/// generation `rank`; `taken`: a successor is already announced; `lends`: this kxp lends
/// its sockets ahead of the release). Returns it, its generation and whether it takes
/// loans, if it is taken as the successor.
fn answer(
    mut s: UnixStream,
    ours: u64,
    rank: u64,
    taken: bool,
    lends: bool,
) -> Option<(UnixStream, u64, bool)> {
    let _ = s.set_nonblocking(false);
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let line = read_line(&s).unwrap_or_default();
    match decide(&line, rank) {
        Ok(theirs) if !taken => {
            // A newer kxp that takes a loan of the sockets says so after its generation.
            let lent = lends && line.split_whitespace().skip(3).any(|w| w == LEND);
            if lent {
                writeln!(s, "ok {LEND}").ok()?;
            } else {
                writeln!(s, "ok").ok()?;
            }
            tracing::info!(
                "a newer kxp (generation {theirs}, this one {ours}) announced itself: it \
                 takes this node over once it has the cluster's lists"
            );
            // Polled for its request between accepts.
            let _ = s.set_read_timeout(Some(Duration::from_millis(10)));
            Some((s, theirs, lent))
        }
        Ok(theirs) => {
            let why = format!("generation {theirs}: another successor is announced");
            tracing::info!("refused to hand this node over: {why}");
            let _ = writeln!(s, "refused: {why}");
            None
        }
        Err(Refusal::Outranked(theirs)) => {
            tracing::info!(
                "a kxp of generation {theirs} started beside this one (of {ours}{}): it \
                 stands by",
                if taken {
                    ", its successor announced"
                } else {
                    ""
                }
            );
            let _ = writeln!(
                s,
                "{OUTRANKED}: this node's kxp is of generation {rank}, this one of \
                 {theirs}; only a newer one takes over"
            );
            None
        }
        Err(Refusal::Other(why)) => {
            tracing::info!("refused to hand this node over: {why}");
            let _ = writeln!(s, "refused: {why}");
            None
        }
    }
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why an announcement is not taken.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// The announcer is of this generation (given) or an older one.
    Outranked(u64),
    /// Not this protocol, or malformed (why).
    Other(String),
}

/// Whether to take announcement `line` (`intend VERSION GENERATION`), this kxp being of
/// generation `ours`: the announcer's generation, or why not.
fn decide(line: &str, ours: u64) -> Result<u64, Refusal> {
    let mut words = line.split_whitespace();
    if words.next() != Some("intend") {
        return Err(Refusal::Other(format!(
            "not an announcement: {:?}",
            line.trim()
        )));
    }
    let version: Option<u32> = words.next().and_then(|v| v.parse().ok());
    if version != Some(VERSION) {
        return Err(Refusal::Other(format!(
            "protocol version {} asked, this kxp speaks {VERSION}",
            version.map_or_else(|| "none".to_string(), |v| v.to_string())
        )));
    }
    let theirs: u64 = words
        .next()
        .and_then(|g| g.parse().ok())
        .ok_or_else(|| Refusal::Other("no generation given".to_string()))?;
    if theirs <= ours {
        return Err(Refusal::Outranked(theirs));
    }
    Ok(theirs)
}

/// Once the first sync is published at `resumed_ns` (the workers forward from then on):
/// how long forwarding paused since the previous kxp's workers stopped at `stopped_ns`
/// (`CLOCK_MONOTONIC`, shared by the processes of a node; 0: no hand-over), and when,
/// within the pause, the sockets arrived and the dataplane had started.
pub(crate) fn log_pause(stopped_ns: u64, received_ns: u64, started_ns: u64, resumed_ns: u64) {
    if stopped_ns == 0 || resumed_ns == 0 {
        return;
    }
    let ms = |t: u64| t.saturating_sub(stopped_ns) as f64 / 1e6;
    tracing::info!(
        paused_ms = ms(resumed_ns),
        sockets_in_ms = ms(received_ns),
        started_ms = ms(started_ns),
        "hand-over: forwarding resumed after this long since the previous kxp's workers stopped"
    );
}

/// Does nothing until SIGTERM or SIGINT: after releasing the node (`why`: the DaemonSet
/// deletes the old pod once the new one is ready), or when outranked by the kxp that runs.
pub(crate) fn stand_by(why: &str) {
    tracing::info!("{why}: standing by until stopped");
    let again = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if signal_hook::flag::register(sig, again.clone()).is_err() {
            return;
        }
    }
    while !again.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(200));
    }
    tracing::info!("stopped while standing by");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker's state for these tests (queue `queue`).
    fn test_state(queue: u32) -> HandedState {
        HandedState {
            frames: 2,
            frame_size: 2048,
            ring_size: 64,
            bind_flags: 8,
            queue,
            ports: ["kxp0-dp", "eth0"]
                .iter()
                .map(|n| dataplane::xsk::HandedPort {
                    ifname: n.to_string(),
                    ifindex: 3,
                    queue,
                    in_fill: 1,
                    tx_in_flight: 0,
                    warm: false,
                    zero_copy: false,
                    tx_budget: 64,
                    tx_pending: Vec::new(),
                })
                .collect(),
            free: vec![256],
            ring_of: vec![3, 0],
        }
    }

    /// Two workers' sockets for these tests (any descriptors travel).
    fn test_handed() -> HandedOver {
        let fd = || std::os::fd::OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        HandedOver {
            workers: (0..2)
                .map(|q| Handed {
                    memfd: fd(),
                    sockets: vec![fd(), fd()],
                    state: test_state(q),
                })
                .collect(),
            stopped_ns: 12345,
        }
    }

    /// Asks for the loan on `s` and returns (workers, sockets) of what arrived.
    fn receive_lent_for_test(s: &mut Successor) -> (usize, usize) {
        writeln!(s.stream, "{LEND}").unwrap();
        let lent = receive_lent(&s.stream).unwrap();
        (lent.len(), lent.iter().map(|l| l.sockets.len()).sum())
    }

    #[test]
    fn only_a_newer_generation_of_this_protocol_is_taken() {
        assert_eq!(decide("intend 1 8\n", 7), Ok(8));
        assert_eq!(decide("intend 1 7\n", 7), Err(Refusal::Outranked(7)));
        assert_eq!(decide("intend 1 6\n", 7), Err(Refusal::Outranked(6)));
        let other = |l: &str| match decide(l, 7) {
            Err(Refusal::Other(why)) => why,
            r => panic!("{l:?}: {r:?}"),
        };
        assert!(other("intend 2 8\n").contains("version 2"));
        assert!(other("intend 1\n").contains("no generation"));
        assert!(other("release\n").contains("not an announcement"));
        assert!(other("").contains("not an announcement"));
    }

    /// Over a real socket: an older or equal generation is refused; a newer one is
    /// taken, keeps a signalled kxp forwarding until it asks, and is told `released`
    /// once the running one has finished.
    #[test]
    fn a_newer_kxp_announced_then_asking_is_released_to() {
        let dir = std::env::temp_dir().join(format!("kxp-release-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(matches!(
            Successor::announce(&dir, Some(3)),
            Announced::Nobody
        ));
        let stop = Arc::new(AtomicBool::new(false));
        // It lends two workers' descriptors ahead (any travel: the dataplane's tests map
        // real sockets).
        let null = || std::os::fd::OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let lender: Lender = Arc::new(move || {
            Some(
                (0..2)
                    .map(|_| Lent {
                        memfd: null(),
                        geometry: LentGeometry {
                            frames: 2,
                            frame_size: 2048,
                            ring_size: 64,
                            sockets: 3,
                        },
                        sockets: vec![null(), null(), null()],
                    })
                    .collect(),
            )
        });
        let l = ReleaseListener::start(&dir, Some(2), stop.clone(), Some(lender)).unwrap();
        match Successor::announce(&dir, Some(2)) {
            Announced::Outranked(why) => assert!(why.contains("only a newer"), "{why}"),
            a => panic!("{a:?}"),
        }
        let Announced::Successor(mut s) = Successor::announce(&dir, Some(3)) else {
            panic!("a newer one is taken");
        };
        assert!(s.lends, "the running kxp lends its sockets ahead");
        // Lent, while it forwards: six sockets arrive (/dev/null cannot be mapped), and
        // the connection stays in step for the request below.
        let lent = receive_lent_for_test(&mut s);
        assert_eq!(lent, (2, 6));
        let deadline = Instant::now() + Duration::from_secs(5);
        while !lock(&l.state).announced && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        // A signal now: the running kxp waits for its successor's request.
        l.signalled.store(true, Ordering::Relaxed);
        let asker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            s.ask_release()
        });
        let waited = Instant::now();
        l.wait_for_successor(Duration::from_secs(5));
        assert!(
            waited.elapsed() >= Duration::from_millis(250),
            "waited for it"
        );
        assert!(stop.load(Ordering::Relaxed), "asked to stop");
        assert!(l.asked());
        // Any descriptors travel (the dataplane's tests take real sockets up).
        let handed = test_handed();
        assert!(!l.finish(&handed), "signalled: no standing by");
        let (asked, got) = asker.join().unwrap();
        assert!(matches!(asked, Asked::Released(_)));
        assert_eq!(got.stopped_ns, 12345);
        assert_eq!(got.workers.len(), 2, "both workers' sockets arrived");
        for (q, h) in got.workers.iter().enumerate() {
            assert_eq!(h.state, test_state(q as u32));
            assert_eq!(h.sockets.len(), 2);
        }
        assert!(!socket_path(&dir).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Between this build and one before loans (which announces `intend 1 G`, answers a
    /// bare `ok`, and sends one socket per message), both ways: no loan is asked for or
    /// made, and the sockets arrive one per message.
    #[test]
    fn a_kxp_before_loans_hands_over_and_takes_over_as_before() {
        let dir = std::env::temp_dir().join(format!("kxp-release-old-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // This kxp runs, the one before is its successor.
        let stop = Arc::new(AtomicBool::new(false));
        let lender: Lender = Arc::new(|| panic!("no loan asked for"));
        let l = ReleaseListener::start(&dir, Some(2), stop.clone(), Some(lender)).unwrap();
        let mut s = UnixStream::connect(socket_path(&dir)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        writeln!(s, "intend 1 3").unwrap();
        assert_eq!(read_line(&s).unwrap(), "ok");
        writeln!(s, "release").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !l.asked() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(l.finish(&test_handed()), "asked, no signal: it stands by");
        assert_eq!(read_line(&s).unwrap(), "released");
        let got = receive_sockets(&s, false).unwrap();
        assert_eq!(got.workers.len(), 2);
        assert!(got.workers.iter().all(|h| h.sockets.len() == 2));
        // The one before runs, this kxp is its successor.
        let _ = std::fs::remove_file(socket_path(&dir));
        let listener = UnixListener::bind(socket_path(&dir)).unwrap();
        let before = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let intend = read_line(&s).unwrap();
            writeln!(s, "ok").unwrap();
            let ask = read_line(&s).unwrap();
            writeln!(s, "released").unwrap();
            send_sockets(&s, &test_handed(), false).unwrap();
            (intend, ask)
        });
        let Announced::Successor(mut s) = Successor::announce(&dir, Some(3)) else {
            panic!("taken as the successor");
        };
        assert!(!s.lends);
        assert_eq!(s.premap().unwrap().sockets(), 0, "no loan asked for");
        let (asked, got) = s.ask_release();
        assert!(matches!(asked, Asked::Released(_)));
        assert_eq!(got.workers.len(), 2);
        assert!(got.workers.iter().all(|h| h.sockets.len() == 2));
        let (intend, ask) = before.join().unwrap();
        assert_eq!(intend, format!("intend {VERSION} 3 {LEND}"));
        assert_eq!(ask, "release", "no loan asked for first");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
