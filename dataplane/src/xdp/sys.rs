//! The few raw calls [`super`] needs that libbpf-rs 0.25 does not wrap in a usable form:
//! interface lookup, XDP attach/detach/query with the errno kept (libbpf-rs folds it into
//! a coarse `ErrorKind`), bpf_link creation and BPF_PROG_TEST_RUN on a bare program fd
//! (libbpf-rs has them only on `ProgramMut`, which borrows the whole object mutably), and
//! the verifier log buffer of an `ObjectBuilder`.
//!
//! Every function here is safe to call; the unsafe blocks only pass valid pointers and
//! borrowed fds to libc / libbpf for the duration of one call (save the verifier log
//! buffer of [`load_object`], which outlives the object that keeps it).

use std::ffi::{CString, c_char, c_int};
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr;

use libbpf_rs::{AsRawLibbpf, Object, ObjectBuilder};

/// `XDP_FLAGS_SKB_MODE` (generic XDP).
pub const XDP_FLAGS_SKB_MODE: u32 = libbpf_sys::XDP_FLAGS_SKB_MODE;
/// `XDP_FLAGS_DRV_MODE` (native XDP).
pub const XDP_FLAGS_DRV_MODE: u32 = libbpf_sys::XDP_FLAGS_DRV_MODE;

/// Maps libbpf's return convention (negative errno, errno also set) to `io::Error`.
fn check(ret: c_int) -> io::Result<c_int> {
    if ret < 0 {
        Err(io::Error::from_raw_os_error(-ret))
    } else {
        Ok(ret)
    }
}

/// The effective user id is 0.
pub fn is_root() -> bool {
    // SAFETY: `geteuid(2)` takes no arguments, touches no memory of ours and cannot
    // fail: it has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// `if_nametoindex(3)` in the calling thread's network namespace; `Ok(None)` if no
/// interface has that name. The caller has checked the name holds no NUL byte.
pub fn if_nametoindex(name: &str) -> io::Result<Option<u32>> {
    let c = CString::new(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `if_nametoindex(3)` only reads its argument, which must be a valid
    // NUL-terminated string for the call: `c` is a `CString`, alive until after it.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx != 0 {
        return Ok(Some(idx));
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::ENODEV) | Some(libc::ENXIO) | Some(libc::ENOENT) => Ok(None),
        _ => Err(err),
    }
}

/// Netlink attach of `prog` to `ifindex` with `XDP_FLAGS_*` (survives the process).
pub fn xdp_attach(ifindex: u32, prog: BorrowedFd<'_>, flags: u32) -> io::Result<()> {
    // SAFETY: `bpf_xdp_attach` dereferences only `opts`, which may be NULL (libbpf's
    // OPTS_VALID / OPTS_GET take NULL as "all defaults"); the rest are integers, the
    // program fd borrowed (so open) for the call. An invalid ifindex or fd is an
    // error return, not UB.
    let ret = unsafe {
        libbpf_sys::bpf_xdp_attach(ifindex as c_int, prog.as_raw_fd(), flags, ptr::null())
    };
    check(ret).map(drop)
}

/// Netlink detach in the mode of `flags`, only if `expected` is still the program
/// attached there (XDP_FLAGS_REPLACE semantics): never removes someone else's program.
pub fn xdp_detach_expected(ifindex: u32, flags: u32, expected: BorrowedFd<'_>) -> io::Result<()> {
    let opts = libbpf_sys::bpf_xdp_attach_opts {
        sz: size_of::<libbpf_sys::bpf_xdp_attach_opts>() as libbpf_sys::size_t,
        old_prog_fd: expected.as_raw_fd(),
        ..Default::default()
    };
    // SAFETY: `bpf_xdp_detach` reads `opts` (a `const` pointer) for the call only: it
    // is a valid, initialised `bpf_xdp_attach_opts` whose `sz` is its own size, the
    // size the vendored libbpf (the headers' version) knows, so libbpf reads only its
    // fields (OPTS_GET), no padding; it is alive until after the call; `old_prog_fd` is
    // borrowed, so open, for the call.
    let ret = unsafe { libbpf_sys::bpf_xdp_detach(ifindex as c_int, flags, &opts) };
    check(ret).map(drop)
}

/// What the kernel reports as attached to an interface (program ids; 0 = none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XdpQuery {
    pub drv_prog_id: u32,
    pub skb_prog_id: u32,
    pub hw_prog_id: u32,
}

/// The programs attached to `ifindex` in each mode: one RTM_GETLINK for that interface.
/// (libbpf's `bpf_xdp_query` dumps every link of the namespace and keeps one: with 230
/// links, asking for each of 112 interfaces took 300 ms of a restart.)
pub fn xdp_query(ifindex: u32) -> io::Result<XdpQuery> {
    use rtnetlink::packet_core::{NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload};
    use rtnetlink::packet_route::RouteNetlinkMessage;
    use rtnetlink::packet_route::link::{LinkAttribute, LinkMessage, LinkXdp};
    use rtnetlink::sys::{SocketAddr, constants::NETLINK_ROUTE};

    let mut link = LinkMessage::default();
    link.header.index = ifindex;
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST;
    let mut req = NetlinkMessage::new(
        header,
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::GetLink(link)),
    );
    req.finalize();
    let mut buf = vec![0u8; req.buffer_len()];
    req.serialize(&mut buf);
    let mut sock = rtnetlink::sys::Socket::new(NETLINK_ROUTE)?;
    sock.bind_auto()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    sock.send(&buf, 0)?;
    let mut reply = vec![0u8; 32 * 1024];
    let n = sock.recv(&mut &mut reply[..], 0)?;
    let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&reply[..n])
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    let mut q = XdpQuery {
        drv_prog_id: 0,
        skb_prog_id: 0,
        hw_prog_id: 0,
    };
    match msg.payload {
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) => {
            for a in &link.attributes {
                let LinkAttribute::Xdp(xdp) = a else {
                    continue;
                };
                for x in xdp {
                    match x {
                        LinkXdp::DrvProgId(id) => q.drv_prog_id = *id,
                        LinkXdp::SkbProgId(id) => q.skb_prog_id = *id,
                        LinkXdp::HwProgId(id) => q.hw_prog_id = *id,
                        _ => {}
                    }
                }
            }
            Ok(q)
        }
        NetlinkPayload::Error(e) => Err(e.to_io()),
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unexpected netlink answer to RTM_GETLINK: {other:?}"),
        )),
    }
}

/// BPF_LINK_CREATE for XDP: the program stays attached while the returned fd is open
/// (the kernel picks native mode if the driver has it, else generic).
pub fn xdp_link_create(ifindex: u32, prog: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    // SAFETY: `bpf_link_create` dereferences only `opts`, which may be NULL (all
    // defaults; OPTS_VALID / OPTS_GET); the rest are integers, the program fd borrowed
    // (so open) for the call.
    let ret = unsafe {
        libbpf_sys::bpf_link_create(
            prog.as_raw_fd(),
            ifindex as c_int,
            libbpf_sys::BPF_XDP,
            ptr::null(),
        )
    };
    let fd = check(ret)?;
    // SAFETY: `from_raw_fd` requires an open fd that nothing else owns or closes, needing
    // no cleanup but `close`: a non-negative return of `bpf_link_create` is a new link
    // fd, returned to us only (closing it is what detaches the link).
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// BPF_OBJ_PIN: pins `fd` (a program) at `path` in a bpffs. Needs no capability, only
/// write access to the directory.
pub fn obj_pin(fd: BorrowedFd<'_>, path: &std::path::Path) -> io::Result<()> {
    let c = path_cstring(path)?;
    // SAFETY: `bpf_obj_pin` reads the NUL-terminated string `c` (alive until after the
    // call) and passes the fd, borrowed so open for the call, to the kernel; it writes no
    // memory of ours.
    let ret = unsafe { libbpf_sys::bpf_obj_pin(fd.as_raw_fd(), c.as_ptr()) };
    check(ret).map(drop)
}

/// BPF_OBJ_GET: a new fd for the object pinned at `path`. Needs no capability, only read
/// access to the pin.
pub fn obj_get(path: &std::path::Path) -> io::Result<OwnedFd> {
    let c = path_cstring(path)?;
    // SAFETY: `bpf_obj_get` reads the NUL-terminated string `c`, alive until after the
    // call, and writes no memory of ours.
    let ret = unsafe { libbpf_sys::bpf_obj_get(c.as_ptr()) };
    let fd = check(ret)?;
    // SAFETY: `from_raw_fd` requires an open fd that nothing else owns: a non-negative
    // return of BPF_OBJ_GET is a new fd, returned to us only.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn path_cstring(path: &std::path::Path) -> io::Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))
}

/// Whether `path` is a mounted bpffs (`statfs(2)`'s `f_type` is `BPF_FS_MAGIC`).
pub fn is_bpffs(path: &std::path::Path) -> bool {
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    let Ok(c) = path_cstring(path) else {
        return false;
    };
    // SAFETY: an all-zero `statfs` is a valid value of that plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `statfs` reads the NUL-terminated string `c` and writes one `statfs` into
    // `st`, which is valid, exclusively borrowed and alive for the call.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    rc == 0 && st.f_type as i64 == BPF_FS_MAGIC
}

/// BPF_PROG_TEST_RUN of an XDP program on one frame (>= 14 bytes); the XDP action.
/// Runs `prog` once on `frame`: its return value and the nanoseconds the kernel timed
/// the run for.
pub fn prog_test_run(prog: BorrowedFd<'_>, frame: &[u8]) -> io::Result<(u32, u32)> {
    let mut opts = libbpf_sys::bpf_test_run_opts {
        sz: size_of::<libbpf_sys::bpf_test_run_opts>() as libbpf_sys::size_t,
        data_in: frame.as_ptr().cast(),
        data_size_in: u32::try_from(frame.len())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
        repeat: 1,
        ..Default::default()
    };
    // SAFETY: `bpf_prog_test_run_opts` reads `opts` and `data_size_in` bytes at
    // `data_in`, and writes back only scalar fields of `opts` within `sz` (OPTS_SET):
    // `opts` is a valid, initialised struct of its own `sz`, borrowed mutably, alive
    // for the call; `data_in`/`data_size_in` are `frame`'s pointer and length (checked
    // to fit in a u32), borrowed for the call and only read. `data_out`, `ctx_in` and
    // `ctx_out` are NULL, so the kernel writes no buffer of ours.
    let ret = unsafe { libbpf_sys::bpf_prog_test_run_opts(prog.as_raw_fd(), &mut opts) };
    check(ret)?;
    Ok((opts.retval, opts.duration))
}

/// [`prog_test_run`] as if `frame` had arrived on `ifindex`'s receive queue 0 (an
/// `xdp_md` context in: the kernel runs the program with that device's queue).
pub fn prog_test_run_on(prog: BorrowedFd<'_>, frame: &[u8], ifindex: u32) -> io::Result<u32> {
    // struct xdp_md: data, data_end, data_meta (0 in a test run's context), then
    // ingress_ifindex, rx_queue_index, egress_ifindex.
    let mut ctx = [0u32; 6];
    ctx[3] = ifindex;
    let mut opts = libbpf_sys::bpf_test_run_opts {
        sz: size_of::<libbpf_sys::bpf_test_run_opts>() as libbpf_sys::size_t,
        data_in: frame.as_ptr().cast(),
        data_size_in: u32::try_from(frame.len())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
        ctx_in: ctx.as_ptr().cast(),
        ctx_size_in: size_of_val(&ctx) as u32,
        repeat: 1,
        ..Default::default()
    };
    // SAFETY: as in `prog_test_run`; besides, the kernel reads `ctx_size_in` bytes at
    // `ctx_in`: `ctx`'s pointer and size, a local array alive and only read for the
    // call. `ctx_out` is NULL.
    let ret = unsafe { libbpf_sys::bpf_prog_test_run_opts(prog.as_raw_fd(), &mut opts) };
    check(ret)?;
    Ok(opts.retval)
}

/// Why [`load_object`] failed: libbpf's error and the tail of the kernel verifier log
/// (empty when the failure came before the verifier, e.g. missing privileges).
#[derive(Debug)]
pub struct LoadFailure {
    pub error: libbpf_rs::Error,
    pub log: String,
}

/// Verifier log lines kept for an error message (the verdict is at the end).
const LOG_TAIL_LINES: usize = 25;

/// Opens and loads the BPF ELF `elf`, gives the loaded object to `extract` (which takes
/// what it needs as owned fds, e.g. `MapHandle`s), then closes the object.
///
/// libbpf is given a buffer for the kernel verifier log, filled only if a program load
/// fails (libbpf then retries with log level 1). The object keeps a pointer to that
/// buffer and to `elf`, so both outlive it here: the object never leaves this function.
pub fn load_object<R>(elf: &[u8], extract: impl FnOnce(&Object) -> R) -> Result<R, LoadFailure> {
    let mut log = vec![0u8; 1 << 18];
    let mut builder = ObjectBuilder::default();
    // `as_libbpf_object` makes its pointer from `&self`, which gives no right to write
    // through it: only its address is used, with the provenance of a mutable borrow of
    // the whole builder (the options are one of its fields).
    let opts_addr = builder.as_libbpf_object().addr().get();
    let opts = (&raw mut builder)
        .with_addr(opts_addr)
        .cast::<libbpf_sys::bpf_object_open_opts>();
    // SAFETY: the writes need `opts` valid for writes and aligned: it is the address of
    // the builder's own `bpf_object_open_opts` field (so aligned), in `builder`, a live
    // local, with the provenance of `&raw mut builder`, and nothing else uses `builder`
    // until they are done; the fields are plain pointers and integers (no drop). What
    // libbpf then does with them needs `log` valid for writes of `kernel_log_size`
    // bytes for as long as the object is open: `log` is neither touched nor moved
    // until the object (opened and loaded, or closed by a failed `load`) is dropped,
    // before `log_tail` reads it.
    unsafe {
        (*opts).kernel_log_buf = log.as_mut_ptr().cast::<c_char>();
        (*opts).kernel_log_size = log.len() as libbpf_sys::size_t;
        (*opts).kernel_log_level = 0;
    }
    let loaded = builder.open_memory(elf).and_then(|open| open.load());
    let result = match loaded {
        Ok(obj) => {
            let r = extract(&obj);
            drop(obj);
            Ok(r)
        }
        Err(error) => Err(error),
    };
    drop(builder);
    result.map_err(|error| LoadFailure {
        error,
        log: log_tail(&log),
    })
}

fn log_tail(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let text = String::from_utf8_lossy(&buf[..end]);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let skip = lines.len().saturating_sub(LOG_TAIL_LINES);
    lines[skip..].join("\n")
}

/// Netlink attach of `prog` to `ifindex` in the mode of `flags`, replacing `old` (which
/// must be the program attached there now) atomically: every packet sees one or the
/// other.
pub fn xdp_replace(
    ifindex: u32,
    prog: BorrowedFd<'_>,
    flags: u32,
    old: BorrowedFd<'_>,
) -> io::Result<()> {
    let opts = libbpf_sys::bpf_xdp_attach_opts {
        sz: size_of::<libbpf_sys::bpf_xdp_attach_opts>() as libbpf_sys::size_t,
        old_prog_fd: old.as_raw_fd(),
        ..Default::default()
    };
    // SAFETY: as in `xdp_detach_expected`: `bpf_xdp_attach` only reads `opts`, a valid,
    // initialised struct of its own `sz`, alive for the call; `prog` and `old` are
    // borrowed, so open, for the call.
    let ret = unsafe {
        libbpf_sys::bpf_xdp_attach(
            ifindex as c_int,
            prog.as_raw_fd(),
            flags | libbpf_sys::XDP_FLAGS_REPLACE,
            &opts,
        )
    };
    check(ret).map(drop)
}
