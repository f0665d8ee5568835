//! The few system calls the dataplane makes directly (through libc), each wrapped safely.

use std::fs::File;
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

/// A zero-length non-blocking `recvfrom` on an AF_XDP socket: with busy polling, this is
/// what makes the kernel run the device's receive processing for us.
pub fn kick_rx(fd: RawFd) {
    // SAFETY: a zero-length receive with null buffer and address pointers is valid for
    // any socket and writes nothing.
    unsafe {
        libc::recvfrom(
            fd,
            std::ptr::null_mut(),
            0,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
    }
}

/// Pins the calling thread to one CPU.
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("CPU {cpu} out of range"),
        ));
    }
    // SAFETY: cpu_set_t is plain data for which all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (checked above) and `set` is a valid set.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pid 0 is the calling thread; `set` is valid and its size is passed.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether the process runs as root (effective uid 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Moves the calling thread into the network namespace `/var/run/netns/NAME` (setns(2) is
/// per thread; sockets keep the namespace they were created in).
pub fn enter_netns(name: &str) -> io::Result<()> {
    let f = File::open(format!("/var/run/netns/{name}"))?;
    // SAFETY: `f` is an open namespace file for the duration of the call; setns only
    // changes the calling thread's network namespace.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
