//! AF_XDP at the level of the kernel's interface (`linux/if_xdp.h`): a UMEM in a memfd,
//! sockets on it, and their four rings, mapped from the socket and driven with the
//! kernel's ordering (the consumer loads the producer index with acquire, reads the
//! descriptors, then stores its index with release; the producer writes the
//! descriptors, then stores its index with release).
//!
//! kxp's own, instead of xsk-rs/libxdp, for what those cannot do: the UMEM is a memfd
//! (`MAP_SHARED`), so it can be passed to another process with its sockets, and a
//! socket's rings can be mapped again from a socket descriptor received that way
//! (Linux 6.4 and later map a bound socket's rings), taking up where the sender left
//! off: a ring's cached indices are always read from the live ones, for a new socket as
//! for one taken over.
//!
//! Frame ownership is [`crate::xsk`]'s: this module moves descriptors, and says in each
//! `unsafe fn` what its caller must hold.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

/// A ring descriptor (`struct xdp_desc`): the address of a packet in the UMEM (an offset
/// from its start), its length, and `XDP_PKT_CONTD` in `options` when the packet goes on
/// in the next descriptor.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub options: u32,
}

/// Room the kernel leaves before a received packet in its frame (`XDP_PACKET_HEADROOM`):
/// a received packet starts this far into its frame, and kxp puts the packets it builds
/// there too.
pub const XDP_HEADROOM: u64 = 256;

/// A UMEM's memory: `frames` frames of `frame_size` bytes in a sealed memfd, mapped
/// shared.
pub struct Area {
    memfd: OwnedFd,
    base: NonNull<u8>,
    len: usize,
    frame_size: u32,
}

// SAFETY: `Area` owns its mapping (unmapped only in `drop`); the raw pointer is an
// address in it, valid in any thread. Access to the bytes goes through `unsafe fn`s
// whose callers hold frame ownership (module docs).
unsafe impl Send for Area {}

impl std::fmt::Debug for Area {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Area")
            .field("len", &self.len)
            .field("frame_size", &self.frame_size)
            .finish_non_exhaustive()
    }
}

impl Area {
    /// A new area of `frames` frames of `frame_size` bytes (a power of two from 2048 to
    /// the page size), its pages faulted in now.
    pub fn new(frames: u32, frame_size: u32) -> io::Result<Area> {
        if !frame_size.is_power_of_two() || !(2048..=4096).contains(&frame_size) || frames == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{frames} frames of {frame_size} bytes: frames must be > 0 and the frame \
                     size 2048 or 4096"
                ),
            ));
        }
        let len = frames as usize * frame_size as usize;
        // SAFETY: the name is a NUL-terminated string that outlives the call.
        let fd = unsafe {
            libc::memfd_create(
                c"kxp-umem".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain calls on an fd this function owns; no memory is passed.
        if unsafe { libc::ftruncate(memfd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // The size is fixed for good: the kernel pins these pages (`XDP_UMEM_REG`), and a
        // truncate would leave it writing to pages a new mapping no longer sees.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: as above.
        if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Self::map(memfd, len, frame_size)
    }

    /// The area of `memfd` (received from another process), `len` bytes of frames of
    /// `frame_size`.
    pub fn adopt(memfd: OwnedFd, len: usize, frame_size: u32) -> io::Result<Area> {
        // SAFETY: `stat` is written by the kernel; the fd is only a number to it.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(memfd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if (st.st_size as usize) < len || len == 0 || !frame_size.is_power_of_two() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the UMEM handed over has {} bytes, {len} were announced",
                    st.st_size
                ),
            ));
        }
        Self::map(memfd, len, frame_size)
    }

    fn map(memfd: OwnedFd, len: usize, frame_size: u32) -> io::Result<Area> {
        // SAFETY: a new shared mapping of `len` bytes of the memfd (at least that long),
        // at an address the kernel chooses; nothing existing is replaced.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                memfd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Area {
            memfd,
            base: NonNull::new(p.cast()).ok_or_else(io::Error::last_os_error)?,
            len,
            frame_size,
        })
    }

    /// The memfd, to hand the area over.
    /// The identity of the memfd (device, inode), to tell the same UMEM from another.
    pub fn identity(&self) -> io::Result<(u64, u64)> {
        identity(self.memfd.as_fd())
    }

    pub fn memfd(&self) -> BorrowedFd<'_> {
        self.memfd.as_fd()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn frame_size(&self) -> u32 {
        self.frame_size
    }

    /// The descriptor of every frame, free to use: its address past the headroom, length 0.
    pub fn descs(&self) -> Vec<Desc> {
        (0..self.len as u64 / u64::from(self.frame_size))
            .map(|i| Desc {
                addr: i * u64::from(self.frame_size) + XDP_HEADROOM,
                len: 0,
                options: 0,
            })
            .collect()
    }

    /// Room for packet data from `d.addr` to the end of its frame; 0 for an address
    /// outside the area.
    pub fn room(&self, d: &Desc) -> usize {
        let fs = u64::from(self.frame_size);
        if d.addr >= self.len as u64 {
            return 0;
        }
        (d.addr / fs * fs + fs - d.addr) as usize
    }

    /// The packet bytes of `d` (`len`, cut to the frame), writable.
    ///
    /// # Safety
    /// Nothing else (the kernel or another reference) may access `d`'s frame while the
    /// slice lives: the caller owns the frame, off every ring.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes(&self, d: &Desc) -> &mut [u8] {
        let len = (d.len as usize).min(self.room(d));
        if len == 0 {
            return &mut [];
        }
        // SAFETY: `d.addr + len` is within the area (`room`), which is mapped readable and
        // writable for as long as `self` lives; the caller guarantees that no other access
        // to the frame exists meanwhile, and distinct frames do not overlap.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(d.addr as usize), len) }
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of `len` bytes, unmapped once. The sockets
        // registered on it hold their own reference to its pages.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// One mapped ring: its indices (shared with the kernel) and this side's cached copies.
struct Ring<T> {
    producer: NonNull<AtomicU32>,
    consumer: NonNull<AtomicU32>,
    flags: NonNull<AtomicU32>,
    descs: NonNull<T>,
    mask: u32,
    size: u32,
    cached_prod: u32,
    cached_cons: u32,
    map: NonNull<libc::c_void>,
    map_len: usize,
}

impl<T: Copy> Ring<T> {
    /// Maps the ring at `pgoff` of socket `fd`, of `size` entries, with the offsets the
    /// kernel gave, and sets the cached indices from the live ones (`producer` says
    /// which side this process is).
    fn map(
        fd: RawFd,
        pgoff: u64,
        off: &libc::xdp_ring_offset,
        size: u32,
        producer: bool,
    ) -> io::Result<Ring<T>> {
        let map_len = off.desc as usize + size as usize * size_of::<T>();
        // SAFETY: a new shared mapping of the ring's pages from the socket, at an address
        // the kernel chooses; the kernel checks the offset and length against the ring.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                pgoff as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let at = |o: u64| {
            // SAFETY: the kernel's offsets are within the mapping of `map_len` bytes.
            NonNull::new(unsafe { p.cast::<u8>().add(o as usize) })
                .expect("an offset into a mapping is not null")
        };
        let mut r = Ring {
            producer: at(off.producer).cast(),
            consumer: at(off.consumer).cast(),
            flags: at(off.flags).cast(),
            descs: at(off.desc).cast(),
            mask: size - 1,
            size,
            cached_prod: 0,
            cached_cons: 0,
            map: NonNull::new(p).expect("mmap returned no null"),
            map_len,
        };
        r.sync_caches(producer);
        Ok(r)
    }

    /// Sets the cached indices from the live ones (`producer` says which side this
    /// process is): at the mapping, and again when the rings were mapped ahead of a
    /// hand-over while another process still used them.
    fn sync_caches(&mut self, producer: bool) {
        let (prod, cons) = (
            self.prod().load(Ordering::Acquire),
            self.cons().load(Ordering::Acquire),
        );
        self.cached_prod = prod;
        // A producer's cached consumer runs a ring ahead: free = cached_cons - cached_prod.
        self.cached_cons = if producer {
            cons.wrapping_add(self.size)
        } else {
            cons
        };
    }

    fn prod(&self) -> &AtomicU32 {
        // SAFETY: an aligned u32 of the mapping, which lives as long as `self`; the kernel
        // accesses it atomically too.
        unsafe { self.producer.as_ref() }
    }

    fn cons(&self) -> &AtomicU32 {
        // SAFETY: as in `prod`.
        unsafe { self.consumer.as_ref() }
    }

    fn needs_wakeup(&self) -> bool {
        // SAFETY: as in `prod`.
        unsafe { self.flags.as_ref() }.load(Ordering::Relaxed) & libc::XDP_RING_NEED_WAKEUP != 0
    }

    /// Free entries for a producer, reading the consumer index again only when the cached
    /// one shows fewer than `want`.
    fn free(&mut self, want: u32) -> u32 {
        let free = self.cached_cons.wrapping_sub(self.cached_prod);
        if free >= want {
            return free;
        }
        self.cached_cons = self.cons().load(Ordering::Acquire).wrapping_add(self.size);
        self.cached_cons.wrapping_sub(self.cached_prod)
    }

    /// Puts what fits of `items` on the ring and publishes it; returns how many.
    fn produce(&mut self, items: &[T]) -> usize {
        let n = (self.free(items.len() as u32) as usize).min(items.len());
        for (i, item) in items[..n].iter().enumerate() {
            let idx = (self.cached_prod.wrapping_add(i as u32) & self.mask) as usize;
            // SAFETY: `idx` <= mask < size entries of the mapped array.
            unsafe { self.descs.as_ptr().add(idx).write_volatile(*item) };
        }
        self.cached_prod = self.cached_prod.wrapping_add(n as u32);
        self.prod().store(self.cached_prod, Ordering::Release);
        n
    }

    /// Takes up to `out.len()` entries off the ring into `out` and releases them; returns
    /// how many.
    fn consume(&mut self, out: &mut [T]) -> usize {
        let mut avail = self.cached_prod.wrapping_sub(self.cached_cons);
        if avail == 0 {
            self.cached_prod = self.prod().load(Ordering::Acquire);
            avail = self.cached_prod.wrapping_sub(self.cached_cons);
        }
        let n = (avail as usize).min(out.len());
        for (i, o) in out[..n].iter_mut().enumerate() {
            let idx = (self.cached_cons.wrapping_add(i as u32) & self.mask) as usize;
            // SAFETY: `idx` <= mask < size entries of the mapped array, published by the
            // kernel before its producer index (loaded with acquire above).
            *o = unsafe { self.descs.as_ptr().add(idx).read_volatile() };
        }
        if n > 0 {
            self.cached_cons = self.cached_cons.wrapping_add(n as u32);
            self.cons().store(self.cached_cons, Ordering::Release);
        }
        n
    }
}

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; the socket keeps the ring.
        unsafe { libc::munmap(self.map.as_ptr(), self.map_len) };
    }
}

/// How a socket is bound.
#[derive(Debug, Clone, Copy)]
pub struct Bind {
    pub ifindex: u32,
    pub queue: u32,
    /// Entries of each of the four rings (a power of two).
    pub ring_size: u32,
    /// `XDP_COPY`, `XDP_USE_NEED_WAKEUP`, `XDP_USE_SG`: for the socket that registers the
    /// UMEM only (the others share its mode).
    pub flags: u16,
}

/// An AF_XDP socket and its mapped rings.
pub struct Socket {
    fd: OwnedFd,
    rx: Ring<Desc>,
    tx: Ring<Desc>,
    fill: Ring<u64>,
    comp: Ring<u64>,
}

impl std::fmt::Debug for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Socket")
            .field("fd", &self.fd)
            .field("ring_size", &self.rx.size)
            .finish_non_exhaustive()
    }
}

// SAFETY: the rings point into mappings owned by the socket; one thread at a time uses
// them (`&mut self`), in whichever thread owns the socket.
unsafe impl Send for Socket {}

fn setopt<T>(fd: RawFd, opt: libc::c_int, val: &T) -> io::Result<()> {
    // SAFETY: `val` is a live value of its type, whose size is passed; the kernel reads it.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_XDP,
            opt,
            (val as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A C struct of integers only, which any bytes are a valid value of.
///
/// # Safety
/// Implemented only for such structs.
unsafe trait Plain {}
// SAFETY: structs of u64s.
unsafe impl Plain for libc::xdp_mmap_offsets {}
// SAFETY: a struct of u64s.
unsafe impl Plain for libc::xdp_statistics {}
// SAFETY: a struct of one u32.
unsafe impl Plain for libc::xdp_options {}

fn getopt<T: Plain>(fd: RawFd, opt: libc::c_int) -> io::Result<T> {
    // SAFETY: all-zero bytes are a valid `T` (`Plain`).
    let mut v: T = unsafe { std::mem::zeroed() };
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `v` is writable for `len` bytes; the kernel writes at most that.
    let rc = unsafe { libc::getsockopt(fd, libc::SOL_XDP, opt, (&raw mut v).cast(), &mut len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v)
}

/// A socket's statistics from the kernel (`XDP_STATISTICS`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Statistics {
    pub rx_dropped: u64,
    pub rx_invalid_descs: u64,
    pub tx_invalid_descs: u64,
    pub rx_ring_full: u64,
    pub rx_fill_ring_empty_descs: u64,
    pub tx_ring_empty_descs: u64,
}

impl Socket {
    /// A new socket bound to `bind.ifindex`/`bind.queue`: with `umem` `None` it registers
    /// `area` as its UMEM; with the UMEM's own socket it shares that UMEM
    /// (`XDP_SHARED_UMEM`), with a fill and completion ring of its own.
    pub fn new(area: &Area, umem: Option<&Socket>, bind: Bind) -> io::Result<Socket> {
        if !bind.ring_size.is_power_of_two() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("ring size {} is not a power of two", bind.ring_size),
            ));
        }
        // SAFETY: plain socket creation; the fd returned is owned by nothing else.
        let raw = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` was just created and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        if umem.is_none() {
            let reg = libc::xdp_umem_reg {
                addr: area.base.as_ptr() as u64,
                len: area.len as u64,
                chunk_size: area.frame_size,
                headroom: 0,
                flags: 0,
                tx_metadata_len: 0,
            };
            setopt(raw, libc::XDP_UMEM_REG, &reg)?;
        }
        let size = bind.ring_size;
        setopt(raw, libc::XDP_UMEM_FILL_RING, &size)?;
        setopt(raw, libc::XDP_UMEM_COMPLETION_RING, &size)?;
        setopt(raw, libc::XDP_RX_RING, &size)?;
        setopt(raw, libc::XDP_TX_RING, &size)?;
        let sock = Self::map(fd, [size; 4])?;
        let mut sa = libc::sockaddr_xdp {
            sxdp_family: libc::AF_XDP as u16,
            sxdp_flags: bind.flags,
            sxdp_ifindex: bind.ifindex,
            sxdp_queue_id: bind.queue,
            sxdp_shared_umem_fd: 0,
        };
        if let Some(u) = umem {
            // A socket sharing a UMEM takes its mode from the UMEM's: no flags of its own.
            sa.sxdp_flags = libc::XDP_SHARED_UMEM;
            sa.sxdp_shared_umem_fd = u.fd.as_raw_fd() as u32;
        }
        // SAFETY: `sa` is a live sockaddr_xdp whose size is passed; the kernel reads it.
        let rc = unsafe {
            libc::bind(
                raw,
                (&raw const sa).cast(),
                size_of::<libc::sockaddr_xdp>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(sock)
    }

    /// A bound socket received from another process (its ring sizes as that process
    /// said: the kernel does not tell them): its rings mapped again, their positions
    /// where the other process left them. That process must no longer use them.
    pub fn adopt(fd: OwnedFd, ring_size: u32) -> io::Result<Socket> {
        if !ring_size.is_power_of_two() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("ring size {ring_size} is not a power of two"),
            ));
        }
        Self::map(fd, [ring_size; 4])
    }

    /// Maps the four rings (sizes: RX, TX, fill, completion).
    fn map(fd: OwnedFd, sizes: [u32; 4]) -> io::Result<Socket> {
        let raw = fd.as_raw_fd();
        let off: libc::xdp_mmap_offsets = getopt(raw, libc::XDP_MMAP_OFFSETS)?;
        Ok(Socket {
            rx: Ring::map(
                raw,
                libc::XDP_PGOFF_RX_RING as u64,
                &off.rx,
                sizes[0],
                false,
            )?,
            tx: Ring::map(raw, libc::XDP_PGOFF_TX_RING as u64, &off.tx, sizes[1], true)?,
            fill: Ring::map(raw, libc::XDP_UMEM_PGOFF_FILL_RING, &off.fr, sizes[2], true)?,
            comp: Ring::map(
                raw,
                libc::XDP_UMEM_PGOFF_COMPLETION_RING,
                &off.cr,
                sizes[3],
                false,
            )?,
            fd,
        })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Takes the rings up where they are now: for a socket mapped ahead of a hand-over
    /// ([`Socket::adopt`] while the other process still used it), once that process has
    /// stopped (a syscall in between, so that its last index stores are seen).
    pub fn resync(&mut self) {
        self.rx.sync_caches(false);
        self.tx.sync_caches(true);
        self.fill.sync_caches(true);
        self.comp.sync_caches(false);
    }

    /// Entries of each ring.
    pub fn ring_size(&self) -> u32 {
        self.rx.size
    }

    /// Takes received descriptors off the RX ring.
    ///
    /// # Safety
    /// The frames they name become the caller's: it must not let two owners use one.
    pub unsafe fn recv(&mut self, out: &mut [Desc]) -> usize {
        self.rx.consume(out)
    }

    /// Puts descriptors on the TX ring for the kernel to send; returns how many it took.
    ///
    /// # Safety
    /// The frames must be of this socket's UMEM and the caller's, and are the kernel's
    /// until they come back on the completion ring.
    pub unsafe fn send(&mut self, descs: &[Desc]) -> usize {
        self.tx.produce(descs)
    }

    /// Free TX entries (reading the kernel's index again when the cache shows fewer than
    /// `want`).
    pub fn tx_free(&mut self, want: u32) -> u32 {
        self.tx.free(want)
    }

    /// Free TX entries, read from the kernel's index.
    pub fn tx_free_exact(&mut self) -> u32 {
        self.tx.free(u32::MAX)
    }

    pub fn tx_needs_wakeup(&self) -> bool {
        self.tx.needs_wakeup()
    }

    /// Has the kernel send what the TX ring holds (copy mode). Errors that only mean
    /// "not now" (no buffer, busy, down) are not errors.
    pub fn tx_wakeup(&self) -> io::Result<()> {
        // SAFETY: a zero-length send with no buffer or address.
        let rc = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                std::ptr::null(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null(),
                0,
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOBUFS | libc::EAGAIN | libc::EBUSY | libc::ENETDOWN) => Ok(()),
                _ => Err(e),
            };
        }
        Ok(())
    }

    /// Whether the socket is bound in zero-copy mode (`XDP_OPTIONS`), else copy mode.
    pub fn zero_copy(&self) -> io::Result<bool> {
        let o: libc::xdp_options = getopt(self.fd.as_raw_fd(), libc::XDP_OPTIONS)?;
        Ok(o.flags & libc::XDP_OPTIONS_ZEROCOPY != 0)
    }

    /// Lets one `sendto()` in copy mode transmit up to `frames` descriptors of the TX ring
    /// (`XDP_MAX_TX_SKB_BUDGET`, Linux 6.17) instead of the kernel's default 32: fewer
    /// system calls per packet on the copy-mode TX path. The kernel accepts 32 up to the
    /// TX ring's size. Errors: ENOPROTOOPT on a kernel without the option (the default
    /// then stays), EACCES for a value out of range.
    pub fn set_tx_budget(&self, frames: u32) -> io::Result<()> {
        const XDP_MAX_TX_SKB_BUDGET: libc::c_int = 9;
        setopt(self.fd.as_raw_fd(), XDP_MAX_TX_SKB_BUDGET, &frames)
    }

    /// A zero-length non-blocking `recvfrom`: with busy polling, this is what makes the
    /// kernel run the device's receive processing for us.
    pub fn kick_rx(&self) {
        // SAFETY: a zero-length receive with null buffer and address pointers is valid
        // for any socket and writes nothing.
        unsafe {
            libc::recvfrom(
                self.fd.as_raw_fd(),
                std::ptr::null_mut(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
        }
    }

    /// Takes completed TX descriptors' addresses off the completion ring.
    ///
    /// # Safety
    /// As for [`Socket::recv`]: the frames become the caller's.
    pub unsafe fn completed(&mut self, out: &mut [u64]) -> usize {
        self.comp.consume(out)
    }

    /// Gives frames (by address) to the kernel to receive into; returns how many it took.
    ///
    /// # Safety
    /// As for [`Socket::send`].
    pub unsafe fn fill(&mut self, addrs: &[u64]) -> usize {
        self.fill.produce(addrs)
    }

    pub fn fill_free(&mut self, want: u32) -> u32 {
        self.fill.free(want)
    }

    pub fn fill_needs_wakeup(&self) -> bool {
        self.fill.needs_wakeup()
    }

    /// Wakes the kernel to receive into the fill ring (a zero-timeout poll).
    pub fn fill_wakeup(&self) {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd, no wait.
        unsafe { libc::poll(&mut p, 1, 0) };
    }

    pub fn statistics(&self) -> io::Result<Statistics> {
        let s: libc::xdp_statistics = getopt(self.fd.as_raw_fd(), libc::XDP_STATISTICS)?;
        Ok(Statistics {
            rx_dropped: s.rx_dropped,
            rx_invalid_descs: s.rx_invalid_descs,
            tx_invalid_descs: s.tx_invalid_descs,
            rx_ring_full: s.rx_ring_full,
            rx_fill_ring_empty_descs: s.rx_fill_ring_empty_descs,
            tx_ring_empty_descs: s.tx_ring_empty_descs,
        })
    }
}

/// The (device, inode) of a descriptor: the same for every descriptor of one socket or
/// one memfd, in any process, while it lives.
///
/// # Errors
/// `fstat` fails.
pub fn identity(fd: BorrowedFd<'_>) -> io::Result<(u64, u64)> {
    // SAFETY: `st` is written by the kernel; the fd is only a number to it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.st_dev, st.st_ino))
}
