//! A worker's sockets and frames handed to the next kxp (an upgrade that hands over): the
//! UMEM's memfd, every socket, and which frames userspace owns, so that the next process
//! consumes the same rings where this one stopped, instead of closing them and opening
//! new ones (see docs/design/handover.md).
//!
//! What the kernel holds (frames on the fill and TX rings, received ones on the RX ring,
//! completed ones on the completion ring) stays where it is: the next process's rings
//! start from the live indices. What userspace holds is in [`HandedState`]: the free
//! frames, each port's frames waiting for room on its TX ring, and which port's rings
//! each frame was last put on. A frame a [`Frame`](super::Frame) token held when the
//! worker stopped is not in it (the worker gives those back first; one it could not is
//! lost to the UMEM, not corrupted).

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};

use super::{Port, WorkerIo, XskConfig, XskError};
use crate::afxdp::{Area, Desc, Socket};

/// A worker's sockets and frames, handed over.
#[derive(Debug)]
pub struct Handed {
    /// The UMEM's memory.
    pub memfd: OwnedFd,
    /// One per port of `state.ports`, in order (the first is the UMEM's own socket).
    pub sockets: Vec<OwnedFd>,
    pub state: HandedState,
}

/// What a worker's userspace held of its frames and ports, and the geometry they were
/// made with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandedState {
    pub frames: u32,
    pub frame_size: u32,
    pub ring_size: u32,
    pub bind_flags: u16,
    /// The worker's queue (of kxp's service device).
    pub queue: u32,
    pub ports: Vec<HandedPort>,
    pub free: Vec<u64>,
    /// Per frame, the ifindex of the port whose rings it was last put on (0: none).
    pub ring_of: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandedPort {
    pub ifname: String,
    pub ifindex: u32,
    pub queue: u32,
    pub in_fill: u32,
    pub tx_in_flight: u32,
    pub warm: bool,
    pub zero_copy: bool,
    pub tx_budget: u32,
    pub tx_pending: Vec<Desc>,
}

/// A worker's UMEM and sockets lent ahead of a hand-over, while it still forwards (copies
/// of its descriptors): the next kxp maps them ahead ([`Premapped`]), and at the hand-over
/// only takes the rings up where they are then.
#[derive(Debug)]
pub struct Lent {
    pub memfd: OwnedFd,
    pub geometry: LentGeometry,
    pub sockets: Vec<OwnedFd>,
}

/// The UMEM's and the rings' sizes, which the kernel does not tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LentGeometry {
    pub frames: u32,
    pub frame_size: u32,
    pub ring_size: u32,
    /// Sockets that follow.
    pub sockets: u32,
}

const LENT_MAGIC: u32 = 0x4b58_504c; // "KXPL"

impl LentGeometry {
    pub fn encode(&self) -> Vec<u8> {
        [
            LENT_MAGIC,
            self.frames,
            self.frame_size,
            self.ring_size,
            self.sockets,
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
    }

    /// Reads [`LentGeometry::encode`]'s bytes back; an error says what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<LentGeometry, String> {
        let mut r = Reader { b: bytes, at: 0 };
        if r.u32()? != LENT_MAGIC {
            return Err("not a kxp loan of sockets".into());
        }
        let g = LentGeometry {
            frames: r.u32()?,
            frame_size: r.u32()?,
            ring_size: r.u32()?,
            sockets: r.u32()?,
        };
        if r.at != bytes.len() {
            return Err("trailing bytes".into());
        }
        Ok(g)
    }
}

/// UMEMs and sockets lent by the running kxp, mapped ahead of the hand-over (see
/// [`Lent`]), by their identity ([`crate::afxdp::identity`]): taking the same ones up at
/// the hand-over costs no mapping. What the hand-over does not name is unmapped.
#[derive(Debug, Default)]
pub struct Premapped {
    areas: HashMap<(u64, u64), Area>,
    sockets: HashMap<(u64, u64), Socket>,
}

impl Premapped {
    /// Maps what `lent` holds. What cannot be mapped is left out (the hand-over maps it
    /// then); returns the mappings and how many sockets were left out.
    pub fn map(lent: Vec<Lent>) -> (Premapped, usize) {
        let mut p = Premapped::default();
        let mut failed = 0;
        for l in lent {
            let g = l.geometry;
            let len = g.frames as usize * g.frame_size as usize;
            if let Ok(id) = crate::afxdp::identity(l.memfd.as_fd())
                && let Ok(area) = Area::adopt(l.memfd, len, g.frame_size)
            {
                p.areas.insert(id, area);
            }
            for fd in l.sockets {
                match crate::afxdp::identity(fd.as_fd())
                    .and_then(|id| Socket::adopt(fd, g.ring_size).map(|s| (id, s)))
                {
                    Ok((id, sock)) => {
                        p.sockets.insert(id, sock);
                    }
                    Err(_) => failed += 1,
                }
            }
        }
        (p, failed)
    }

    /// Sockets mapped ahead.
    pub fn sockets(&self) -> usize {
        self.sockets.len()
    }

    fn take_area(&mut self, memfd: &OwnedFd, len: usize) -> Option<Area> {
        let id = crate::afxdp::identity(memfd.as_fd()).ok()?;
        self.areas.remove(&id).filter(|a| a.len() == len)
    }

    /// The socket of `fd` mapped ahead (with ring size `ring_size`), its rings taken up
    /// where they are now.
    fn take_socket(&mut self, fd: &OwnedFd, ring_size: u32) -> Option<Socket> {
        let id = crate::afxdp::identity(fd.as_fd()).ok()?;
        let mut sock = self
            .sockets
            .remove(&id)
            .filter(|s| s.ring_size() == ring_size)?;
        sock.resync();
        Some(sock)
    }
}

const MAGIC: u32 = 0x4b58_5048; // "KXPH"
const VERSION: u32 = 1;

impl HandedState {
    /// The state as bytes (little-endian), for [`HandedState::decode`] in the next kxp.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.free.len() * 8 + self.ring_of.len() * 4);
        let u32s = |b: &mut Vec<u8>, v: u32| b.extend_from_slice(&v.to_le_bytes());
        for v in [
            MAGIC,
            VERSION,
            self.frames,
            self.frame_size,
            self.ring_size,
            u32::from(self.bind_flags),
            self.queue,
            self.ports.len() as u32,
        ] {
            u32s(&mut b, v);
        }
        for p in &self.ports {
            for v in [
                p.ifindex,
                p.queue,
                p.in_fill,
                p.tx_in_flight,
                u32::from(p.warm) | u32::from(p.zero_copy) << 1,
                p.tx_budget,
                p.ifname.len() as u32,
            ] {
                u32s(&mut b, v);
            }
            b.extend_from_slice(p.ifname.as_bytes());
            u32s(&mut b, p.tx_pending.len() as u32);
            for d in &p.tx_pending {
                b.extend_from_slice(&d.addr.to_le_bytes());
                u32s(&mut b, d.len);
                u32s(&mut b, d.options);
            }
        }
        u32s(&mut b, self.free.len() as u32);
        for a in &self.free {
            b.extend_from_slice(&a.to_le_bytes());
        }
        u32s(&mut b, self.ring_of.len() as u32);
        for &o in &self.ring_of {
            u32s(&mut b, o);
        }
        b
    }

    /// Reads [`HandedState::encode`]'s bytes back; an error says what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<HandedState, String> {
        let mut r = Reader { b: bytes, at: 0 };
        if r.u32()? != MAGIC {
            return Err("not a kxp hand-over".into());
        }
        let version = r.u32()?;
        if version != VERSION {
            return Err(format!(
                "hand-over format {version}, this kxp reads {VERSION}"
            ));
        }
        let (frames, frame_size, ring_size) = (r.u32()?, r.u32()?, r.u32()?);
        let bind_flags = u16::try_from(r.u32()?).map_err(|_| "bad bind flags".to_string())?;
        let queue = r.u32()?;
        let n = r.count(28)?;
        let mut ports = Vec::with_capacity(n);
        for _ in 0..n {
            let (ifindex, queue, in_fill, tx_in_flight, flags, tx_budget) =
                (r.u32()?, r.u32()?, r.u32()?, r.u32()?, r.u32()?, r.u32()?);
            let len = r.count(1)?;
            let ifname = String::from_utf8(r.take(len)?.to_vec())
                .map_err(|_| "an interface name is not UTF-8".to_string())?;
            let pending = r.count(16)?;
            let mut tx_pending = Vec::with_capacity(pending);
            for _ in 0..pending {
                tx_pending.push(Desc {
                    addr: r.u64()?,
                    len: r.u32()?,
                    options: r.u32()?,
                });
            }
            ports.push(HandedPort {
                ifname,
                ifindex,
                queue,
                in_fill,
                tx_in_flight,
                warm: flags & 1 != 0,
                zero_copy: flags & 2 != 0,
                tx_budget,
                tx_pending,
            });
        }
        let nfree = r.count(8)?;
        let free = (0..nfree).map(|_| r.u64()).collect::<Result<_, _>>()?;
        let nring = r.count(4)?;
        let ring_of = (0..nring).map(|_| r.u32()).collect::<Result<_, _>>()?;
        if r.at != bytes.len() {
            return Err(format!("{} bytes too many", bytes.len() - r.at));
        }
        Ok(HandedState {
            frames,
            frame_size,
            ring_size,
            bind_flags,
            queue,
            ports,
            free,
            ring_of,
        })
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let s = self
            .b
            .get(self.at..self.at.saturating_add(n))
            .ok_or_else(|| format!("cut short at byte {}", self.at))?;
        self.at += n;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, String> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from(self.u32()?) | u64::from(self.u32()?) << 32)
    }

    /// A count of items of at least `size` bytes each, no more than the bytes left hold.
    fn count(&mut self, size: usize) -> Result<usize, String> {
        let n = self.u32()? as usize;
        if n.saturating_mul(size) > self.b.len() - self.at {
            return Err(format!("a count of {n} at byte {} is too large", self.at));
        }
        Ok(n)
    }
}

impl WorkerIo<'_> {
    /// Stops using the sockets and hands them over: what waits for room on a TX ring is
    /// put there if it fits and the kernel told to send, then the UMEM, the sockets (new
    /// descriptors of them) and what userspace holds are returned, and this process's
    /// mappings and descriptors closed. Every [`Frame`](super::Frame) should have been
    /// given back first (the type system makes sure none outlives `self`).
    /// A copy of descriptor `fd`, to `what` (for the error).
    fn dup(&self, fd: std::os::fd::BorrowedFd<'_>, what: &str) -> Result<OwnedFd, XskError> {
        fd.try_clone_to_owned().map_err(|e| XskError::Socket {
            ifname: String::new(),
            queue: self.queue,
            reason: format!("duplicating a descriptor to {what}: {e}"),
            errno: e.raw_os_error(),
        })
    }

    /// Copies of the UMEM's and the sockets' descriptors, for the next kxp to map ahead
    /// of a hand-over while this worker goes on forwarding ([`Lent`]).
    ///
    /// # Errors
    /// A descriptor cannot be duplicated.
    pub fn lend(&self) -> Result<Lent, XskError> {
        let dup = |fd| self.dup(fd, "lend it");
        Ok(Lent {
            memfd: dup(self.area.memfd())?,
            geometry: LentGeometry {
                frames: self.frames_total as u32,
                frame_size: self.frame_size as u32,
                ring_size: self.ring_size as u32,
                sockets: self.ports.len() as u32,
            },
            sockets: self
                .ports
                .iter()
                .map(|p| dup(p.sock.fd()))
                .collect::<Result<_, _>>()?,
        })
    }

    pub fn hand_over(&mut self) -> Result<Handed, XskError> {
        for i in 0..self.ports.len() {
            self.flush_port(i);
        }
        let dup = |fd| self.dup(fd, "hand it over");
        let memfd = dup(self.area.memfd())?;
        let sockets = self
            .ports
            .iter()
            .map(|p| dup(p.sock.fd()))
            .collect::<Result<Vec<_>, _>>()?;
        let state = HandedState {
            frames: self.frames_total as u32,
            frame_size: self.frame_size as u32,
            ring_size: self.ring_size as u32,
            bind_flags: self.bind_flags,
            queue: self.queue,
            ports: self
                .ports
                .iter_mut()
                .map(|p| HandedPort {
                    ifname: p.ifname.clone(),
                    ifindex: p.ifindex,
                    queue: p.queue,
                    in_fill: p.in_fill as u32,
                    tx_in_flight: p.tx_in_flight as u32,
                    warm: p.warm,
                    zero_copy: p.zero_copy,
                    tx_budget: p.tx_budget,
                    tx_pending: std::mem::take(&mut p.tx_pending),
                })
                .collect(),
            free: std::mem::take(&mut self.free),
            ring_of: std::mem::take(&mut self.ring_of),
        };
        Ok(Handed {
            memfd,
            sockets,
            state,
        })
    }
}

impl WorkerIo<'static> {
    /// The sockets and frames a previous kxp handed over (see [`WorkerIo::hand_over`]),
    /// if they were made as `cfg` makes them; their rings taken up where it left them.
    pub(super) fn adopt(
        cfg: &XskConfig,
        h: Handed,
        premapped: &mut Premapped,
    ) -> Result<Self, XskError> {
        let bad = |m: String| XskError::Config(format!("the sockets handed over: {m}"));
        let s = &h.state;
        let flags = super::bind_flags(cfg);
        if (s.frames, s.frame_size, s.ring_size, s.bind_flags)
            != (cfg.frames, cfg.frame_size, cfg.ring_size, flags)
        {
            return Err(bad(format!(
                "{} frames of {} bytes, rings of {}, bind flags {:#x}; this kxp makes {} of \
                 {}, rings of {}, flags {flags:#x}",
                s.frames,
                s.frame_size,
                s.ring_size,
                s.bind_flags,
                cfg.frames,
                cfg.frame_size,
                cfg.ring_size
            )));
        }
        if h.sockets.len() != s.ports.len() || s.ports.is_empty() {
            return Err(bad(format!(
                "{} sockets for {} ports",
                h.sockets.len(),
                s.ports.len()
            )));
        }
        let len = s.frames as usize * s.frame_size as usize;
        if s.ring_of.len() != s.frames as usize
            || s.free.iter().any(|&a| a >= len as u64)
            || s.ports
                .iter()
                .flat_map(|p| &p.tx_pending)
                .any(|d| d.addr >= len as u64)
        {
            return Err(bad("frames outside the UMEM".into()));
        }
        let area = match premapped.take_area(&h.memfd, len) {
            Some(a) => a,
            None => Area::adopt(h.memfd, len, s.frame_size).map_err(|e| XskError::Umem {
                frames: s.frames,
                frame_size: s.frame_size,
                reason: e.to_string(),
            })?,
        };
        let HandedState {
            ring_size,
            queue,
            ports,
            free,
            ring_of,
            ..
        } = h.state;
        let mut io = Self::with_area(cfg, area, queue, free);
        io.ring_of = ring_of;
        for (fd, p) in h.sockets.into_iter().zip(ports) {
            let sock = match premapped.take_socket(&fd, ring_size) {
                Some(sock) => sock,
                None => Socket::adopt(fd, ring_size).map_err(|e| XskError::Socket {
                    ifname: p.ifname.clone(),
                    queue: p.queue,
                    reason: format!("taking up a socket handed over: {e}"),
                    errno: e.raw_os_error(),
                })?,
            };
            let mut port = Port::new(&p.ifname, p.ifindex, p.queue, sock, p.zero_copy);
            port.tx_budget = p.tx_budget;
            port.warm = p.warm;
            port.in_fill = p.in_fill as usize;
            port.tx_in_flight = p.tx_in_flight as usize;
            port.tx_pending = p.tx_pending;
            io.ports.push(port);
        }
        io.reshare();
        // The previous process may have put frames on a TX ring without a kick, and the
        // kernel may wait for a wakeup to receive into the fill rings.
        for p in &mut io.ports {
            if p.sock.tx_needs_wakeup() {
                let _ = p.sock.tx_wakeup();
            }
            if p.sock.fill_needs_wakeup() {
                p.sock.fill_wakeup();
            }
        }
        Ok(io)
    }
}

impl super::Sockets {
    /// A worker's sockets from a previous kxp (see [`Handed`]).
    ///
    /// # Errors
    /// They were not made as `cfg` makes them, or cannot be taken up.
    pub fn adopt(
        cfg: &XskConfig,
        h: Handed,
        premapped: &mut Premapped,
    ) -> Result<super::Sockets, XskError> {
        WorkerIo::adopt(cfg, h, premapped).map(super::Sockets)
    }
}

impl Handed {
    /// The descriptors to send, the UMEM's first.
    pub fn fds(&self) -> impl Iterator<Item = std::os::fd::BorrowedFd<'_>> {
        std::iter::once(self.memfd.as_fd()).chain(self.sockets.iter().map(AsFd::as_fd))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> HandedState {
        HandedState {
            frames: 4,
            frame_size: 2048,
            ring_size: 64,
            bind_flags: 8,
            queue: 1,
            ports: vec![HandedPort {
                ifname: "kxp0-dp".into(),
                ifindex: 7,
                queue: 1,
                in_fill: 2,
                tx_in_flight: 1,
                warm: true,
                zero_copy: false,
                tx_budget: 64,
                tx_pending: vec![Desc {
                    addr: 256,
                    len: 60,
                    options: 0,
                }],
            }],
            free: vec![2048 + 256],
            ring_of: vec![0, 0, 7, 7],
        }
    }

    #[test]
    fn the_state_reads_back_as_written_and_damage_is_an_error() {
        let s = state();
        let b = s.encode();
        assert_eq!(HandedState::decode(&b), Ok(s));
        for cut in [0, 3, 8, 40, b.len() - 1] {
            assert!(HandedState::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(HandedState::decode(&long).is_err());
        let mut huge = b.clone();
        // The port count.
        huge[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(
            HandedState::decode(&huge)
                .unwrap_err()
                .contains("too large")
        );
        let mut other = b;
        other[4] = 9;
        assert!(
            HandedState::decode(&other)
                .unwrap_err()
                .contains("format 9")
        );
    }
}
