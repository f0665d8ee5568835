//! The few system calls the dataplane makes directly (through libc), each wrapped safely.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

/// Preferred busy polling on an AF_XDP socket: the worker's own rx/tx calls drive the
/// device's NAPI (kernel ≥ 5.11; pair with the device's `napi_defer_hard_irqs` and
/// `gro_flush_timeout`).
pub fn set_busy_poll(fd: RawFd, usecs: u32, budget: u32) -> io::Result<()> {
    for (opt, val) in [
        (libc::SO_PREFER_BUSY_POLL, 1i32),
        (libc::SO_BUSY_POLL, usecs.min(i32::MAX as u32) as i32),
        (
            libc::SO_BUSY_POLL_BUDGET,
            budget.min(i32::MAX as u32) as i32,
        ),
    ] {
        // SAFETY: `val` is a c_int that outlives the call and its size is passed; the
        // kernel only reads it. An invalid fd is reported as an error, not UB.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&val as *const i32).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Waits until one of `fds` is readable or `timeout_ms` passes. Returns whether any is.
pub fn poll_readable(fds: &[RawFd], timeout_ms: i32) -> bool {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `pfds` is a valid, exclusively borrowed array of `pfds.len()` pollfd
    // structs for the duration of the call.
    let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
    rc > 0
}

/// An eventfd that wakes a worker sleeping in [`poll_readable`] (its descriptor is in
/// the worker's set): the control plane rings it after sending the worker a command, so
/// the command is answered at once instead of after the worker's poll timeout (up to
/// 16 ms, once per queue of every interface attached).
#[derive(Debug)]
pub struct Wake(std::os::fd::OwnedFd);

impl Wake {
    /// # Errors
    /// The kernel refuses an eventfd (out of descriptors).
    pub fn new() -> io::Result<Wake> {
        // SAFETY: eventfd takes no pointers; a non-negative return is a new descriptor
        // that nothing else owns.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        Ok(Wake(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }))
    }

    /// Makes the descriptor readable (a wake-up), until [`Wake::clear`].
    pub fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live 8-byte buffer to our own eventfd; a full
        // counter (EAGAIN) means it is already readable, which is all we want.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Makes it unreadable again (non-blocking).
    pub fn clear(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live 8-byte buffer from our own
        // non-blocking eventfd.
        unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    }

    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Asks the processor to bring the cache line holding `line` into its caches, without
/// waiting for it: a hint, which neither reads memory as the program sees it nor faults,
/// whatever the address (so a raw pointer, as [`conntrack::ConnTable::warm`] hands out).
#[inline]
pub fn prefetch(line: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` is `unsafe` only for its `#[target_feature(enable = "sse")]`,
    // which every x86_64 processor has (SSE is part of the architecture's baseline). A
    // prefetch is a hint: it does not access memory architecturally and never faults,
    // whatever the address, dangling or null included.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(line.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = line;
}

/// Pins the calling thread to one CPU.
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    set_affinity(0, &[cpu])
}

/// Restricts thread `tid` (of this process, or another's with `CAP_SYS_NICE`; 0: the
/// calling thread) to `cpus`.
pub fn set_affinity(tid: libc::pid_t, cpus: &[usize]) -> io::Result<()> {
    // SAFETY: cpu_set_t is plain data for which all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("CPU {cpu} out of range"),
            ));
        }
        // SAFETY: `cpu` is below CPU_SETSIZE (checked above) and `set` is a valid set.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `tid` is a thread id (or 0, the caller); `set` is valid and its size is
    // passed.
    let rc = unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets the nice value of thread `tid` (this process's or, with `CAP_SYS_NICE`,
/// another's; 0: the calling thread): on Linux `setpriority(PRIO_PROCESS, tid)` sets
/// one thread's, not the whole process's. Lowering it below the thread's current value
/// needs `CAP_SYS_NICE` (or an `RLIMIT_NICE` that allows it).
pub fn set_nice(tid: libc::pid_t, nice: i32) -> io::Result<()> {
    let who = libc::id_t::try_from(tid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("thread id {tid}")))?;
    // SAFETY: setpriority takes plain integers and touches no memory of ours.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, who, nice) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes room in the process's descriptor table for `extra` more descriptors now: a
/// table that must grow while several threads share it waits for an RCU grace period
/// (milliseconds on a busy node), which must not happen in a hand-over's pause, when the
/// sockets arrive. (The table never shrinks.)
pub fn reserve_fds(extra: usize) -> io::Result<()> {
    let open = std::fs::read_dir("/proc/self/fd")?.count();
    let at = libc::c_int::try_from(open + extra + 64)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors"))?;
    // SAFETY: F_DUPFD_CLOEXEC makes a new descriptor for fd 0 (or fails), numbered `at`
    // or above; it is closed at once and used for nothing else.
    let fd = unsafe { libc::fcntl(0, libc::F_DUPFD_CLOEXEC, at) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just made by this function and is not used after.
    unsafe { libc::close(fd) };
    Ok(())
}

/// The CPUs the calling thread may run on.
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    affinity(0)
}

/// The CPUs thread `tid` (any process's; 0: the calling thread) may run on.
pub fn affinity(tid: libc::pid_t) -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data for which all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `tid` is a thread id or 0 (the caller); `set` is valid, writable and its
    // size passed.
    let rc =
        unsafe { libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: every index is below CPU_SETSIZE and `set` is a valid set.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Backs `[addr, addr + len)` (rounded inwards to whole pages) with transparent huge
/// pages where the kernel has them (madvise `MADV_HUGEPAGE`) and faults every page in
/// now (`MADV_POPULATE_WRITE`, Linux 5.14), so that no page fault — a huge page's above
/// all: 2 MiB zeroed, maybe compaction — stalls the packet path later. Nothing is read
/// or written: the pages of an anonymous allocation not touched yet are zero, and stay
/// so. Errors: the first call that failed (EINVAL: a kernel without THP or without
/// populate; ENOMEM).
pub fn populate_huge(addr: usize, len: usize) -> io::Result<()> {
    const PAGE: usize = 4096;
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    let start = addr.div_ceil(PAGE) * PAGE;
    let end = (addr + len) / PAGE * PAGE;
    if end <= start {
        return Ok(());
    }
    let mut first = Ok(());
    for advice in [libc::MADV_HUGEPAGE, MADV_POPULATE_WRITE] {
        // SAFETY: madvise with MADV_HUGEPAGE changes only how the kernel backs these
        // pages, and MADV_POPULATE_WRITE faults them in as a write of nothing would
        // (contents unchanged: zero pages stay zero); the range is page aligned and lies
        // within an allocation of this process (the caller's), so it names no memory
        // the process does not map.
        let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
        if rc != 0 && first.is_ok() {
            first = Err(io::Error::last_os_error());
        }
    }
    first
}

/// The thread ids of this process.
pub fn thread_ids() -> Vec<libc::pid_t> {
    tasks_in("/proc/self/task")
}

/// The thread ids of process `pid`.
pub fn thread_ids_of(pid: libc::pid_t) -> Vec<libc::pid_t> {
    tasks_in(&format!("/proc/{pid}/task"))
}

fn tasks_in(dir: &str) -> Vec<libc::pid_t> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter_map(|t| t.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether the process runs as root (effective uid 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Sends `sig` to the process group `pgid` (a child started in its own group).
///
/// # Errors
/// kill(2) failed (no such group, not permitted).
pub fn signal_group(pgid: u32, sig: libc::c_int) -> io::Result<()> {
    let pgid = libc::pid_t::try_from(pgid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pgid out of range"))?;
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
    if unsafe { libc::kill(-pgid, sig) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sends `sig` to process `pid`.
///
/// # Errors
/// kill(2) failed (no such process, not permitted), or `pid` is not a process's (0 or
/// negative would signal groups).
pub fn signal_process(pid: u32, sig: libc::c_int) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid)
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a process id"))?;
    // SAFETY: kill(2) with a positive pid signals that process; no memory is involved.
    if unsafe { libc::kill(pid, sig) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`, the unit of /proc/PID/stat times).
pub fn clock_ticks_per_sec() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(hz).ok().filter(|&h| h > 0).unwrap_or(100)
}

/// The page size (`sysconf(_SC_PAGESIZE)`, the unit of /proc/PID/statm).
pub fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// Asks the kernel to stamp every datagram received on `fd` (SO_TIMESTAMPNS).
///
/// # Errors
/// setsockopt(2) failed.
pub fn enable_rx_timestamps(fd: RawFd) -> io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: `one` is a c_int that outlives the call and its size is passed; the kernel
    // only reads it.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_TIMESTAMPNS,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// recvmsg(2) into `buf`, with the kernel's receive timestamp (CLOCK_REALTIME, ns) when
/// [`enable_rx_timestamps`] is on.
///
/// # Errors
/// recvmsg(2) failed (e.g. `WouldBlock` on a timeout).
pub fn recv_with_timestamp(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<u64>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; 16];
    // SAFETY: msghdr is plain data for which all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: `msg` points at `iov` (which points at `buf`) and at `control`, all alive
    // and writable for the duration of the call, with their lengths.
    let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut ts = None;
    // SAFETY: the CMSG_* macros walk the control buffer the kernel just filled, bounded
    // by msg_controllen; SCM_TIMESTAMPNS carries a struct timespec, read unaligned.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_TIMESTAMPNS {
                let t: libc::timespec = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast());
                ts = Some(t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64);
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n as usize, ts))
}

/// Gives the heap's free memory back to the kernel (glibc's `malloc_trim(0)`): after a
/// large one-off allocation (the first lists and the first programming of a big cluster)
/// glibc keeps what was freed in its arenas, counted in the process's RSS. Returns
/// whether anything was released.
pub fn release_free_heap() -> bool {
    // SAFETY: `malloc_trim` takes an integer and touches only the allocator's own state,
    // under its locks; it is safe to call from any thread at any time.
    unsafe { libc::malloc_trim(0) == 1 }
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every worker and every process since
/// boot, so that state one worker or one process stamped (conntrack expiry, affinity)
/// means the same to another.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// `SO_NETNS_COOKIE` (71 on every architecture kxp builds for).
const SO_NETNS_COOKIE: libc::c_int = 71;

/// The calling thread's network namespace cookie: unique per namespace for the whole
/// boot, never reused (unlike the namespace's inode number).
pub fn netns_cookie() -> io::Result<u64> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: plain integer arguments; a non-negative result is a new fd we own.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh socket nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` is writable for `len` bytes, which the kernel does not exceed.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

/// A thread's capability sets, as `capget(2)` gives them (64 bits each).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CapSets {
    pub effective: u64,
    pub permitted: u64,
    pub inheritable: u64,
}

/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
const CAP_V3: u32 = 0x2008_0522;
const CAP_SETPCAP: u32 = 8;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// `capget(2)` of the calling thread, as a raw system call (async-signal-safe); an errno
/// on failure.
fn capget_raw() -> Result<CapSets, i32> {
    let mut hdr = CapHeader {
        version: CAP_V3,
        pid: 0,
    };
    let mut data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capget with a version-3 header writes exactly two `CapData` (the array,
    // valid and exclusively borrowed) and may write the header's version (also ours);
    // pid 0 is the calling thread.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut hdr, data.as_mut_ptr()) };
    if rc != 0 {
        // SAFETY: `__errno_location` returns the calling thread's errno, always valid.
        return Err(unsafe { *libc::__errno_location() });
    }
    let join = |lo: u32, hi: u32| u64::from(lo) | u64::from(hi) << 32;
    Ok(CapSets {
        effective: join(data[0].effective, data[1].effective),
        permitted: join(data[0].permitted, data[1].permitted),
        inheritable: join(data[0].inheritable, data[1].inheritable),
    })
}

/// The calling thread's capability sets.
pub fn capget() -> io::Result<CapSets> {
    capget_raw().map_err(io::Error::from_raw_os_error)
}

/// Reduces the calling thread to the capabilities of `keep` it holds: drops the others
/// from its bounding set (if it holds CAP_SETPCAP), clears its ambient set, sets
/// effective = permitted = permitted ∩ `keep` and inheritable to none, and sets
/// no_new_privs, so that nothing it runs regains them. Raw system calls only, no
/// allocation: async-signal-safe, so [`on_reduce`] may call it. Returns 0 or an errno.
fn reduce_this_thread(keep: u64, last_cap: u32) -> i32 {
    let now = match capget_raw() {
        Ok(c) => c,
        Err(e) => return e,
    };
    if now.effective & (1 << CAP_SETPCAP) != 0 {
        for cap in 0..=last_cap.min(63) {
            if keep & (1 << cap) == 0 {
                // SAFETY: prctl with integer arguments only; EINVAL for a capability the
                // kernel does not know is harmless.
                unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) };
            }
        }
    }
    // SAFETY: integer arguments only (EINVAL on a kernel without ambient sets: harmless).
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    let new = now.permitted & keep;
    let mut hdr = CapHeader {
        version: CAP_V3,
        pid: 0,
    };
    let data = [
        CapData {
            effective: new as u32,
            permitted: new as u32,
            inheritable: 0,
        },
        CapData {
            effective: (new >> 32) as u32,
            permitted: (new >> 32) as u32,
            inheritable: 0,
        },
    ];
    // SAFETY: capset with a version-3 header reads exactly two `CapData` from `data`
    // (valid, alive for the call) and may write the header (ours, exclusively borrowed);
    // pid 0 is the calling thread. Only lowering sets, it needs no privilege.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut hdr, data.as_ptr()) };
    if rc != 0 {
        // SAFETY: as in `capget_raw`.
        return unsafe { *libc::__errno_location() };
    }
    // SAFETY: integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    if rc != 0 {
        // SAFETY: as in `capget_raw`.
        return unsafe { *libc::__errno_location() };
    }
    0
}

static REDUCE_KEEP: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static REDUCE_LAST_CAP: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
static REDUCE_DONE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static REDUCE_FAILED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static REDUCE_HANDLER: std::sync::Once = std::sync::Once::new();

/// The handler of [`reduce_signal`]: [`reduce_this_thread`] in the thread it lands on.
extern "C" fn on_reduce(_sig: libc::c_int) {
    use std::sync::atomic::Ordering::SeqCst;
    // SAFETY: the calling thread's errno location is always valid; it is restored below,
    // as the interrupted code may be about to read it.
    let saved = unsafe { *libc::__errno_location() };
    let rc = reduce_this_thread(REDUCE_KEEP.load(SeqCst), REDUCE_LAST_CAP.load(SeqCst));
    if rc == 0 {
        REDUCE_DONE.fetch_add(1, SeqCst);
    } else {
        REDUCE_FAILED.fetch_add(1, SeqCst);
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = saved };
}

/// The real-time signal kxp uses to have each of its threads reduce its own capabilities
/// (capabilities are per thread; glibc does the same for `setuid` with a signal of its
/// own, below this one).
pub fn reduce_signal() -> libc::c_int {
    libc::SIGRTMIN() + 6
}

/// The calling thread's id.
pub fn gettid() -> libc::pid_t {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// Reduces the calling thread to `keep` (see [`reduce_this_thread`]) and has each of
/// `tids` (other threads of this process) do the same, from the handler of
/// [`reduce_signal`], installed once and left in place (a late signal then does no
/// harm). Returns once signalled; (done, failed) counts the handlers that ran.
///
/// # Errors
/// This thread could not reduce itself, or the handler could not be installed.
pub fn reduce_threads(keep: u64, last_cap: u32, tids: &[libc::pid_t]) -> io::Result<()> {
    use std::sync::atomic::Ordering::SeqCst;
    REDUCE_KEEP.store(keep, SeqCst);
    REDUCE_LAST_CAP.store(last_cap, SeqCst);
    let rc = reduce_this_thread(keep, last_cap);
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    let mut installed = Ok(());
    REDUCE_HANDLER.call_once(|| {
        // SAFETY: an all-zero `sigaction` is a valid value of that C struct (no handler,
        // empty mask, no flags); the fields are then set.
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = on_reduce as extern "C" fn(libc::c_int) as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART;
        // SAFETY: `sa.sa_mask` is ours and valid; sigemptyset only initialises it.
        unsafe { libc::sigemptyset(&mut sa.sa_mask) };
        // SAFETY: `sa` is a valid, initialised sigaction alive for the call; the old
        // action is not asked for (NULL). `on_reduce` is async-signal-safe: it makes raw
        // system calls and atomic operations only, and restores errno.
        if unsafe { libc::sigaction(reduce_signal(), &sa, std::ptr::null_mut()) } != 0 {
            installed = Err(io::Error::last_os_error());
        }
    });
    installed?;
    // SAFETY: getpid has no arguments and cannot fail.
    let pid = unsafe { libc::getpid() };
    for &tid in tids {
        // SAFETY: tgkill with integer arguments only: it signals thread `tid` of this
        // process (ESRCH if it has exited meanwhile: harmless).
        unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, reduce_signal()) };
    }
    Ok(())
}

/// (threads that reduced themselves from the signal, threads whose reduction failed).
pub fn reduce_counts() -> (u64, u64) {
    use std::sync::atomic::Ordering::SeqCst;
    (REDUCE_DONE.load(SeqCst), REDUCE_FAILED.load(SeqCst))
}

/// The initial network namespace's inode (`PROC_NET_INIT_INO` of Linux 6.x), when
/// `/proc/1/ns/net` cannot be read.
const INIT_NETNS_INO: u64 = 0xEFFF_FFF9;

/// `None` in the host's network namespace; `netns-COOKIE` in another (a test's, a
/// container's), so that one kxp per namespace keeps its own state. The cookie, unlike
/// the namespace's inode number, is never reused during a boot: a new namespace never
/// finds the state of one that is gone.
pub fn netns_suffix() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata("/proc/thread-self/ns/net").ok()?.ino();
    let init = std::fs::metadata("/proc/1/ns/net").map_or(INIT_NETNS_INO, |m| m.ino());
    if ino == init {
        return None;
    }
    Some(match netns_cookie() {
        Ok(c) => format!("netns-{c}"),
        Err(_) => format!("netns-ino-{ino}"),
    })
}

/// A connected pair of Unix sockets that keep message boundaries (SOCK_SEQPACKET), both
/// closed on exec.
pub fn seqpacket_pair() -> io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use std::os::fd::FromRawFd as _;
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: socketpair writes two descriptors into the 2-element array it is given.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created by socketpair and are owned by no one
    // else.
    Ok(unsafe {
        (
            std::os::fd::OwnedFd::from_raw_fd(fds[0]),
            std::os::fd::OwnedFd::from_raw_fd(fds[1]),
        )
    })
}

/// Whether `fd` is closed on exec (`close`) or inherited by a program this process
/// runs.
pub fn set_cloexec(fd: std::os::fd::BorrowedFd<'_>, close: bool) -> io::Result<()> {
    let flags = if close { libc::FD_CLOEXEC } else { 0 };
    // SAFETY: F_SETFD with an integer argument on a descriptor the borrow keeps open.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The most descriptors one message carries (the kernel's `SCM_MAX_FD`).
pub const MAX_FDS_PER_MESSAGE: usize = 253;

/// Room for the control message of [`MAX_FDS_PER_MESSAGE`] descriptors, 8-aligned as
/// cmsghdr wants (CMSG_SPACE(253 * 4) = 1032 bytes).
type Control = [u64; 130];

/// Sends `data` as one message on the Unix socket `sock`, with a copy of `fd` attached
/// (SCM_RIGHTS) when given; with `wait` false, a full socket is an error
/// (`WouldBlock`) instead of a wait.
pub fn send_with_fd(
    sock: std::os::fd::BorrowedFd<'_>,
    data: &[u8],
    fd: Option<std::os::fd::BorrowedFd<'_>>,
    wait: bool,
) -> io::Result<()> {
    send_with_fds(sock, data, fd.as_slice(), wait)
}

/// As [`send_with_fd`], with copies of up to [`MAX_FDS_PER_MESSAGE`] descriptors `fds`
/// attached to the one message.
pub fn send_with_fds(
    sock: std::os::fd::BorrowedFd<'_>,
    data: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
    wait: bool,
) -> io::Result<()> {
    if fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} descriptors in one message", fds.len()),
        ));
    }
    let flags = libc::MSG_NOSIGNAL | if wait { 0 } else { libc::MSG_DONTWAIT };
    let mut control: Control = [0; 130];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let bytes = (fds.len() * std::mem::size_of::<libc::c_int>()) as u32;
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(bytes) };
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as usize;
        // SAFETY: msg_control points to `control` (1040 bytes, 8-aligned), at least
        // CMSG_SPACE(253 * 4) = 1032 bytes, so CMSG_FIRSTHDR returns a header inside it,
        // and CMSG_DATA of that header has room for the `fds.len()` ints written.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes) as usize;
            let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
            for (i, fd) in fds.iter().enumerate() {
                std::ptr::write_unaligned(data.add(i), fd.as_raw_fd());
            }
        }
    }
    loop {
        // SAFETY: `msg` points to `iov` (over `data`) and `control`, both alive for the
        // call; sendmsg only reads them.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, flags) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives one message of up to `buf.len()` bytes from the Unix socket `sock`, and the
/// descriptor attached to it, if any (made close-on-exec; any other attached is
/// closed). 0 bytes: the peer is gone.
pub fn recv_with_fd(
    sock: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
) -> io::Result<(usize, Option<std::os::fd::OwnedFd>)> {
    let (n, fds) = recv_with_fds(sock, buf)?;
    Ok((n, fds.into_iter().next()))
}

/// As [`recv_with_fd`], with every descriptor attached (up to
/// [`MAX_FDS_PER_MESSAGE`]), in order.
pub fn recv_with_fds(
    sock: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
) -> io::Result<(usize, Vec<std::os::fd::OwnedFd>)> {
    use std::os::fd::FromRawFd as _;
    let mut control: Control = [0; 130];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    let n = loop {
        // SAFETY: `msg` points to `iov` (over `buf`) and `control`, both alive and
        // writable for the call; recvmsg writes at most their lengths.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: after recvmsg, msg_control/msg_controllen describe the control messages
    // the kernel wrote into `control`; CMSG_FIRSTHDR/CMSG_NXTHDR stay within them, and
    // an SCM_RIGHTS message's data holds the descriptors the kernel installed in this
    // process, each owned by no one else yet.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                let count = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<libc::c_int>();
                for i in 0..count {
                    let raw = std::ptr::read_unaligned(data.add(i));
                    fds.push(std::os::fd::OwnedFd::from_raw_fd(raw));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n, fds))
}

/// Gives the calling thread a descriptor table of its own (`unshare(CLONE_FILES)`): a
/// copy of the process's at this moment; descriptors it opens or receives afterwards are
/// in its table only, and are closed by its own exit.
pub fn unshare_files() -> io::Result<()> {
    // SAFETY: unshare with a flag argument only affects the calling thread.
    if unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Ignores SIGTERM, SIGINT and SIGHUP in this process: a helper that must outlive its
/// parent's stop (see `crate::holder`) ends when its parent says so, or by SIGKILL.
pub fn ignore_stop_signals() {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: SIG_IGN as the disposition of a catchable signal; no handler runs.
        unsafe { libc::signal(sig, libc::SIG_IGN) };
    }
}

/// Drops every capability of the calling thread (and of the threads it starts after),
/// and sets no_new_privs. Returns 0 or an errno.
pub fn drop_all_capabilities() -> i32 {
    reduce_this_thread(0, 63)
}

/// Takes ownership of descriptor `fd`, inherited from the parent process, once it is
/// checked to be an open Unix socket (made close-on-exec).
pub fn adopt_unix_socket(fd: RawFd) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd as _;
    let mut domain: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `domain`; a descriptor that is
    // not open or not a socket makes it fail without writing.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_DOMAIN,
            (&mut domain as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if domain != libc::AF_UNIX {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a Unix socket",
        ));
    }
    // SAFETY: `fd` is open (getsockopt succeeded) and was handed to this process for it
    // alone (the parent closed its copy after starting it); nothing else owns it here.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    set_cloexec(std::os::fd::AsFd::as_fd(&owned), true)?;
    Ok(owned)
}

/// Makes this process the reaper of its orphaned descendants (PR_SET_CHILD_SUBREAPER),
/// as systemd and container runtimes' shims are: a benchmark that stands for a
/// supervisor sees a dead process's helpers exit when they do.
pub fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reaps every exited process of process group `pgid` that is this process's child
/// (directly, or as their subreaper); returns how many.
pub fn reap_group(pgid: u32) -> usize {
    let mut n = 0;
    loop {
        // SAFETY: siginfo_t is plain data; all-zero is valid, and waitid writes into it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid with P_PGID, an id and a pointer to `info`, alive for the call.
        let rc = unsafe {
            libc::waitid(
                libc::P_PGID,
                pgid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG,
            )
        };
        // SAFETY: after a successful waitid, si_pid is set (0 when nothing had exited).
        if rc != 0 || unsafe { info.si_pid() } == 0 {
            return n;
        }
        n += 1;
    }
}
