//! The few raw calls [`super`] needs that libbpf-rs 0.25 does not wrap in a usable form:
//! interface lookup, XDP attach/detach/query with the errno kept (libbpf-rs folds it into
//! a coarse `ErrorKind`), bpf_link creation and BPF_PROG_TEST_RUN on a bare program fd
//! (libbpf-rs has them only on `ProgramMut`, which borrows the whole object mutably), and
//! the verifier log buffer of an `ObjectBuilder`.
//!
//! Every function here is safe to call; the unsafe blocks only pass valid pointers and
//! borrowed fds to libc / libbpf for the duration of one call.

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
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `if_nametoindex(3)` in the calling thread's network namespace; `Ok(None)` if no
/// interface has that name. The caller has checked the name holds no NUL byte.
pub fn if_nametoindex(name: &str) -> io::Result<Option<u32>> {
    let c = CString::new(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
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
    // SAFETY: plain integer arguments and a NULL opts pointer, which libbpf accepts.
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
    // SAFETY: `opts` is a fully initialised, correctly sized struct that outlives the
    // call; libbpf only reads it.
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

/// `bpf_xdp_query(3)`: the programs attached to `ifindex` in each mode.
pub fn xdp_query(ifindex: u32) -> io::Result<XdpQuery> {
    let mut opts = libbpf_sys::bpf_xdp_query_opts {
        sz: size_of::<libbpf_sys::bpf_xdp_query_opts>() as libbpf_sys::size_t,
        ..Default::default()
    };
    // SAFETY: `opts` is a correctly sized struct that libbpf fills in; it outlives the call.
    let ret = unsafe { libbpf_sys::bpf_xdp_query(ifindex as c_int, 0, &mut opts) };
    check(ret)?;
    Ok(XdpQuery {
        drv_prog_id: opts.drv_prog_id,
        skb_prog_id: opts.skb_prog_id,
        hw_prog_id: opts.hw_prog_id,
    })
}

/// BPF_LINK_CREATE for XDP: the program stays attached while the returned fd is open
/// (the kernel picks native mode if the driver has it, else generic).
pub fn xdp_link_create(ifindex: u32, prog: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    // SAFETY: plain integer arguments and a NULL opts pointer, which libbpf accepts.
    let ret = unsafe {
        libbpf_sys::bpf_link_create(
            prog.as_raw_fd(),
            ifindex as c_int,
            libbpf_sys::BPF_XDP,
            ptr::null(),
        )
    };
    let fd = check(ret)?;
    // SAFETY: a non-negative return is a new link fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// BPF_PROG_TEST_RUN of an XDP program on one frame (>= 14 bytes); the XDP action.
pub fn prog_test_run(prog: BorrowedFd<'_>, frame: &[u8]) -> io::Result<u32> {
    let mut opts = libbpf_sys::bpf_test_run_opts {
        sz: size_of::<libbpf_sys::bpf_test_run_opts>() as libbpf_sys::size_t,
        data_in: frame.as_ptr().cast(),
        data_size_in: u32::try_from(frame.len())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
        repeat: 1,
        ..Default::default()
    };
    // SAFETY: `data_in` points to `data_size_in` readable bytes that outlive the call; no
    // output buffers are given, so the kernel writes only the scalar fields of `opts`.
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
    let opts = builder.as_libbpf_object().as_ptr();
    // SAFETY: `opts` points to the builder's own `bpf_object_open_opts`, alive and not
    // otherwise borrowed here; libbpf reads these plain fields when the object is opened.
    // `log` outlives every use libbpf makes of the pointer: the object is dropped before
    // this function returns.
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
    // SAFETY: `opts` is a fully initialised, correctly sized struct that outlives the
    // call; libbpf only reads it.
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
