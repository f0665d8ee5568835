//! The program on real interfaces: veth pairs in fresh network namespaces (addresses
//! from 198.18.0.0/15 only), the three attach modes, refusing to replace another
//! program, cleanup of leftovers, and packets redirected into an AF_XDP socket while the
//! rest (ARP, other ports) reaches the kernel. Needs root.

use std::collections::HashSet;
use std::net::UdpSocket;
use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

use crate::afxdp::{Area, Bind, Desc, Socket};
use nat::tuple::Protocol;

use super::testutil::require_root;
use super::*;
use lab::{Topology, ip};

/// Prefix of this module's namespaces (`kxpx-{role}{n}-{pid}`).
const LAB: &str = "kxpx";

const IF: &str = "kxv0";
const PEER: &str = "kxv1";
const NONE: sys::XdpQuery = sys::XdpQuery {
    drv_prog_id: 0,
    skb_prog_id: 0,
    hw_prog_id: 0,
};

/// One namespace holding both ends of a veth pair, up, without addresses; the namespace
/// goes when the topology is dropped.
fn veth_pair() -> (Topology, String) {
    require_root();
    let mut lab = Topology::new(LAB);
    let ns = lab.add_ns_unique("veth").unwrap();
    lab.link((&ns, IF, ""), (&ns, PEER, "")).unwrap();
    (lab, ns)
}

/// `ip ARGS`'s output, panicking with ip's message on failure.
fn ip_stdout(args: &[&str]) -> String {
    let out = ip(args).unwrap_or_else(|e| panic!("{e}"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Call from inside the namespace.
fn query(ifname: &str) -> sys::XdpQuery {
    sys::xdp_query(resolve_ifindex(ifname).unwrap()).unwrap()
}

#[test]
fn attach_in_each_mode_never_replacing_another_program() {
    let (lab, ns) = veth_pair();
    lab.run_in(&ns, || {
        for (mode, runs_as, ip_shows) in [
            (AttachMode::Link, AttachedAs::Native, "xdp"),
            (AttachMode::Native, AttachedAs::Native, "xdp"),
            (AttachMode::Generic, AttachedAs::Generic, "xdpgeneric"),
        ] {
            let s = Steering::load_and_attach(IF, mode).unwrap_or_else(|e| panic!("{mode}: {e}"));
            assert_eq!(s.ifindex(), resolve_ifindex(IF).unwrap());
            assert_eq!(s.ifname(), Some(IF));
            assert_eq!(s.attached_as().unwrap(), Some(runs_as), "{mode}");
            let shown = ip_stdout(&["link", "show", IF]);
            assert!(shown.contains(&format!(" {ip_shows} ")), "{mode}: {shown}");

            for other in [AttachMode::Link, AttachMode::Native, AttachMode::Generic] {
                let err = Steering::load_and_attach(IF, other).unwrap_err();
                let msg = err.to_string();
                assert!(
                    matches!(err, XdpError::Attach { .. }),
                    "{mode} then {other}: {msg}"
                );
                assert!(
                    msg.contains("already attached"),
                    "{mode} then {other}: {msg}"
                );
            }
            assert_eq!(
                s.attached_as().unwrap(),
                Some(runs_as),
                "{mode}: still ours"
            );

            // the other end: a second instance with its own maps, same queue numbers
            let peer = Steering::load_and_attach(PEER, mode).unwrap();
            assert_ne!(peer.prog_id(), s.prog_id());
            s.set_snat_range(1000, 2000).unwrap();
            peer.set_snat_range(3000, 4000).unwrap();

            s.detach().unwrap();
            assert_eq!(query(IF), NONE, "{mode}: detached");
            assert_eq!(
                peer.attached_as().unwrap(),
                Some(runs_as),
                "{mode}: peer untouched"
            );
            drop(peer);
            assert_eq!(query(PEER), NONE, "{mode}: detached on drop");
        }
    })
    .unwrap();
}

#[test]
fn cleanup_removes_leftovers_but_not_a_live_link() {
    let (lab, ns) = veth_pair();
    lab.run_in(&ns, || {
        assert!(!cleanup_interface(IF).unwrap(), "nothing attached");
        let ifindex = resolve_ifindex(IF).unwrap();
        for flags in [sys::XDP_FLAGS_DRV_MODE, sys::XDP_FLAGS_SKB_MODE] {
            // what a killed kxp leaves: a netlink-attached program nobody holds
            let s = Steering::load().unwrap();
            sys::xdp_attach(ifindex, s.program.fd.as_fd(), flags).unwrap();
            drop(s);
            assert_ne!(query(IF), NONE);
            assert!(cleanup_interface(IF).unwrap(), "flags {flags}");
            assert_eq!(query(IF), NONE);
            assert!(!cleanup_interface(IF).unwrap());
        }
        let s = Steering::load_and_attach(IF, AttachMode::Link).unwrap();
        let err = cleanup_interface(IF).unwrap_err();
        assert!(matches!(err, XdpError::HeldByLink { .. }), "{err}");
        assert!(err.to_string().contains("stop that process"), "{err}");
        assert_eq!(s.attached_as().unwrap(), Some(AttachedAs::Native));
        drop(s);
        // The kernel releases a closed link's program asynchronously (its last
        // reference goes after an RCU grace period): wait for it, bounded.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while query(IF) != NONE && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(query(IF), NONE, "closing the link detaches");
    })
    .unwrap();
}

/// An AF_XDP socket on queue 0 of `ifname` (copy mode) with a small UMEM of its own,
/// all frames on the fill ring.
struct TestXsk {
    // The socket first: it goes before the area it uses.
    sock: Socket,
    area: Area,
}

impl TestXsk {
    fn open(ifname: &str) -> TestXsk {
        let area = Area::new(64, 2048).unwrap();
        let bind = Bind {
            ifindex: crate::xdp::ifindex_of(ifname).unwrap(),
            queue: 0,
            ring_size: 64,
            flags: libc::XDP_COPY,
        };
        let mut sock = Socket::new(&area, None, bind)
            .unwrap_or_else(|e| panic!("AF_XDP socket on {ifname}: {e}"));
        let addrs: Vec<u64> = area.descs().iter().map(|d| d.addr).collect();
        // SAFETY: `Socket::fill` requires frames of the socket's UMEM that the caller
        // owns: they are `area`'s own, fresh, each once, and this test never puts a frame
        // on the TX ring or writes one.
        let n = unsafe { sock.fill(&addrs) };
        assert_eq!(n, addrs.len());
        TestXsk { sock, area }
    }

    fn fd(&self) -> i32 {
        self.sock.fd().as_raw_fd()
    }

    /// Up to `want` received frames (copied out), waiting at most `timeout`.
    fn recv(&mut self, want: usize, timeout: Duration) -> Vec<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut descs = vec![Desc::default(); 16];
        let mut out = Vec::new();
        while out.len() < want && Instant::now() < deadline {
            // SAFETY: `Socket::recv` makes the frames the caller's: they are only read
            // below and never put back on a ring.
            let n = unsafe { self.sock.recv(&mut descs) };
            if n == 0 {
                std::thread::sleep(Duration::from_millis(5));
            }
            for d in &descs[..n] {
                // SAFETY: `Area::bytes` requires no other access to the frame: the kernel
                // gave it up on the RX ring and it is never put back on the fill (or TX)
                // ring, and this copy is the only use.
                out.push(unsafe { self.area.bytes(d) }.to_vec());
            }
        }
        out
    }
}

fn udp_dport(frame: &[u8]) -> Option<u16> {
    let ip = frame.get(14..)?;
    let l4 = usize::from(ip.first()? & 0xf) * 4;
    let p = ip.get(l4 + 2..l4 + 4)?;
    Some(u16::from_be_bytes([p[0], p[1]]))
}

#[test]
fn steered_packets_reach_the_socket_and_the_rest_the_kernel() {
    require_root();
    let mut lab = Topology::new(LAB);
    let (a, b) = (
        lab.add_ns_unique("a").unwrap(),
        lab.add_ns_unique("b").unwrap(),
    );
    lab.link((&a, "kxa", "198.18.0.1/24"), (&b, "kxb", "198.18.0.2/24"))
        .unwrap();
    let send = |port: u16, n: usize| {
        lab.run_in(&a, || {
            let sock = UdpSocket::bind("198.18.0.1:0").unwrap();
            for _ in 0..n {
                sock.send_to(b"kxp", ("198.18.0.2", port)).unwrap();
            }
        })
        .unwrap()
    };

    for mode in [AttachMode::Link, AttachMode::Generic] {
        // forget the neighbours, so that ARP has to pass through the program again
        ip_stdout(&["-n", &a, "neigh", "flush", "dev", "kxa"]);
        ip_stdout(&["-n", &b, "neigh", "flush", "dev", "kxb"]);
        lab.run_in(&b, || {
            let mut s = Steering::load_and_attach("kxb", mode).unwrap();
            let vip = SteerKey::new("198.18.0.2".parse().unwrap(), 9000, Protocol::Udp);
            s.sync_frontends(&HashSet::from([vip])).unwrap();
            let kernel = UdpSocket::bind("198.18.0.2:9001").unwrap();
            kernel
                .set_read_timeout(Some(Duration::from_secs(3)))
                .unwrap();
            let mut xsk = TestXsk::open("kxb");
            s.set_socket(0, xsk.fd()).unwrap();
            let before = s.stats().unwrap();

            send(9000, 5);
            send(9001, 5);
            let frames = xsk.recv(5, Duration::from_secs(3));
            assert_eq!(frames.len(), 5, "{mode}: steered frames in the socket");
            assert!(frames.iter().all(|f| udp_dport(f) == Some(9000)), "{mode}");
            let mut buf = [0u8; 64];
            for _ in 0..5 {
                let (n, from) = kernel
                    .recv_from(&mut buf)
                    .expect("the kernel gets port 9001");
                assert_eq!((&buf[..n], from.port() != 0), (&b"kxp"[..], true));
            }
            let d = s.stats().unwrap().since(&before);
            assert_eq!(
                (d.frontend, d.redirected, d.no_socket),
                (5, 5, 0),
                "{mode}: {d:?}"
            );
            assert!(d.passed >= 6, "{mode}: ARP and port 9001 passed: {d:?}");
            assert_eq!(d.seen, d.redirected + d.passed, "{d:?}");

            // fail-open: with the socket gone from xsks, matches go to the kernel
            s.clear_socket(0).unwrap();
            let before = s.stats().unwrap();
            send(9000, 1);
            let deadline = Instant::now() + Duration::from_secs(3);
            let mut d = SteerStats::default();
            while d.no_socket == 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
                d = s.stats().unwrap().since(&before);
            }
            assert_eq!(
                (d.frontend, d.no_socket, d.redirected),
                (1, 1, 0),
                "{mode}: {d:?}"
            );
            assert!(xsk.recv(1, Duration::from_millis(200)).is_empty());
            s.detach().unwrap();
        })
        .unwrap();
    }
}

/// Namespaces `a` (kxa 198.18.0.1, kxc 198.18.1.1) and `b` (kxb .0.2, kxd .1.2), named
/// from `a_name` and `b_name`, joined by two links.
fn two_links(a_name: &str, b_name: &str) -> (Topology, String, String) {
    let mut lab = Topology::new(LAB);
    let (a, b) = (
        lab.add_ns_unique(a_name).unwrap(),
        lab.add_ns_unique(b_name).unwrap(),
    );
    lab.link((&a, "kxa", "198.18.0.1/24"), (&b, "kxb", "198.18.0.2/24"))
        .unwrap();
    lab.link((&a, "kxc", "198.18.1.1/24"), (&b, "kxd", "198.18.1.2/24"))
        .unwrap();
    (lab, a, b)
}

#[test]
fn one_program_serves_several_interfaces_each_with_its_sockets_counters_and_flags() {
    require_root();
    let (lab, a, b) = two_links("sa", "sb");
    let send = |to: &'static str, n: usize| {
        lab.run_in(&a, move || {
            let sock = UdpSocket::bind("0.0.0.0:0").unwrap();
            for _ in 0..n {
                sock.send_to(b"kxp", (to, 9000)).unwrap();
            }
        })
        .unwrap()
    };
    // Neighbours resolved first: the counters below see only the test's datagrams.
    for to in ["198.18.0.2", "198.18.1.2"] {
        ip_stdout(&["netns", "exec", &a, "ping", "-c1", "-W2", to]);
    }
    let wait = |s: &Steering, before: &SteerStats, matched: u64| {
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let d = s.stats().unwrap().since(before);
            if d.frontend >= matched || Instant::now() > deadline {
                return d;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    lab.run_in(&b, || {
        let first = Steering::load_and_attach("kxb", AttachMode::Link).unwrap();
        let mut second = first.share().unwrap();
        second.attach("kxd", AttachMode::Link, false).unwrap();
        assert_eq!(first.prog_id(), second.prog_id(), "one program");
        assert_ne!(first.slot(), second.slot());
        // Written once, through either handle: both interfaces steer both frontends.
        let keys = ["198.18.0.2", "198.18.1.2"]
            .map(|ip| SteerKey::new(ip.parse().unwrap(), 9000, Protocol::Udp));
        second.sync_frontends(&HashSet::from(keys)).unwrap();

        // The same queue number on each interface, each its own socket.
        let mut xb = TestXsk::open("kxb");
        let mut xd = TestXsk::open("kxd");
        first.set_socket(0, xb.fd()).unwrap();
        second.set_socket(0, xd.fd()).unwrap();
        let (b0, d0) = (first.stats().unwrap(), second.stats().unwrap());
        send("198.18.0.2", 3);
        send("198.18.1.2", 5);
        assert_eq!(xb.recv(3, Duration::from_secs(3)).len(), 3);
        assert_eq!(xd.recv(5, Duration::from_secs(3)).len(), 5);
        assert!(xb.recv(1, Duration::from_millis(200)).is_empty(), "kxd's");
        let (db, dd) = (wait(&first, &b0, 3), wait(&second, &d0, 5));
        assert_eq!(
            (db.frontend, db.redirected),
            (3, 3),
            "kxb's counters: {db:?}"
        );
        assert_eq!(
            (dd.frontend, dd.redirected),
            (5, 5),
            "kxd's counters: {dd:?}"
        );

        // Flags are the interface's: hold on kxd drops its matches without a socket,
        // kxb passes them to the kernel as before.
        first.clear_socket(0).unwrap();
        second.clear_socket(0).unwrap();
        second.set_hold(1).unwrap();
        let kernel = UdpSocket::bind("0.0.0.0:9000").unwrap();
        kernel
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let (b0, d0) = (first.stats().unwrap(), second.stats().unwrap());
        send("198.18.0.2", 2);
        send("198.18.1.2", 2);
        let (db, dd) = (wait(&first, &b0, 2), wait(&second, &d0, 2));
        assert_eq!((db.frontend, db.no_socket), (2, 2), "{db:?}");
        assert_eq!((dd.frontend, dd.no_socket), (2, 2), "{dd:?}");
        let mut buf = [0u8; 64];
        let mut from_kernel = Vec::new();
        while let Ok((_, from)) = kernel.recv_from(&mut buf) {
            from_kernel.push(from.ip());
        }
        assert_eq!(
            from_kernel,
            ["198.18.0.1".parse::<std::net::IpAddr>().unwrap(); 2],
            "kxb's two reach the kernel, kxd's are held"
        );

        // A handle dropped gives its slot back clean: the next one starts from zero and
        // holds no socket of the old one.
        let slot = second.slot();
        second.set_socket(0, xd.fd()).unwrap();
        drop(second);
        let mut third = first.share().unwrap();
        assert_eq!(third.slot(), slot);
        assert_eq!(third.stats().unwrap(), SteerStats::default());
        third.attach("kxd", AttachMode::Link, false).unwrap();
        let d0 = third.stats().unwrap();
        send("198.18.1.2", 2);
        let dd = wait(&third, &d0, 2);
        assert_eq!(
            (dd.frontend, dd.no_socket, dd.redirected),
            (2, 2, 0),
            "{dd:?}"
        );
        assert!(xd.recv(1, Duration::from_millis(200)).is_empty());
        let mut n = 0;
        while kernel.recv_from(&mut buf).is_ok() {
            n += 1;
        }
        assert_eq!(n, 2, "not held any more: passed to the kernel");
        drop(third);
        first.detach().unwrap();
    })
    .unwrap();
}

/// A kxp with a state directory pins its program and maps; the next kxp of the same build
/// takes them up without a load: the previous kxp's entries go on holding each interface
/// (its sockets are gone) until the new one takes the interface over, and only then do
/// its sockets get the packets. The first full sync rewrites the sets (a growing one in a
/// new map swapped in); an interface not taken over is forgotten. Needs root and bpffs.
#[test]
fn a_restarted_kxp_of_the_same_build_takes_up_the_pinned_program_and_its_steering() {
    require_root();
    let (lab, a, b) = two_links("pa", "pb");
    for to in ["198.18.0.2", "198.18.1.2"] {
        ip_stdout(&["netns", "exec", &a, "ping", "-c1", "-W2", to]);
    }
    let send = |port: u16, n: usize| {
        lab.run_in(&a, move || {
            let sock = UdpSocket::bind("0.0.0.0:0").unwrap();
            for _ in 0..n {
                sock.send_to(b"kxp", ("198.18.0.2", port)).unwrap();
            }
        })
        .unwrap()
    };
    let vip = |port: u16| SteerKey::new("198.18.0.2".parse().unwrap(), port, Protocol::Udp);
    lab.run_in(&b, || {
        let kernel = UdpSocket::bind("0.0.0.0:9000").unwrap();
        kernel
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let from_kernel = || {
            let mut buf = [0u8; 64];
            let mut n = 0;
            while kernel.recv_from(&mut buf).is_ok() {
                n += 1;
            }
            n
        };
        let (kxb, kxd) = (
            resolve_ifindex("kxb").unwrap(),
            resolve_ifindex("kxd").unwrap(),
        );

        // The first kxp: loads, pins, steers kxb and kxd with a socket on kxb.
        let (mut first, origin) = Steering::load_or_adopt(true).unwrap();
        assert_eq!(origin, Origin::Loaded);
        let prog_id = first.prog_id();
        first.sync_frontends(&HashSet::from([vip(9000)])).unwrap();
        let addrs: [IpAddr; 2] = ["198.18.0.2", "198.18.9.9"].map(|a| a.parse().unwrap());
        first.sync_local_addrs(&HashSet::from(addrs)).unwrap();
        let mut handles = Vec::new();
        for (ifname, ifindex) in [("kxb", kxb), ("kxd", kxd)] {
            let mut s = first.share().unwrap();
            s.prepare_for(ifname, ifindex).unwrap();
            s.set_hold(1).unwrap();
            s.attach(ifname, AttachMode::Native, true).unwrap();
            handles.push(s);
        }
        let mut xsk = TestXsk::open("kxb");
        handles[0].set_socket(0, xsk.fd()).unwrap();
        send(9000, 2);
        assert_eq!(xsk.recv(2, Duration::from_secs(3)).len(), 2);
        // It stops as with a state directory: everything left attached and holding.
        for mut s in handles.into_iter().chain([first]) {
            s.keep_attached();
        }
        drop(xsk);
        send(9000, 2);
        assert_eq!(from_kernel(), 0, "held while no kxp runs");

        // The next kxp: the same program and maps, no load.
        let (mut first, origin) = Steering::load_or_adopt(true).unwrap();
        assert_eq!(origin, Origin::Adopted);
        assert_eq!(first.prog_id(), prog_id);
        // Its full sync: port 9002 instead of 9000, one address fewer.
        first.sync_frontends(&HashSet::from([vip(9002)])).unwrap();
        first.sync_local_addrs(&HashSet::from([addrs[0]])).unwrap();
        assert_eq!(first.sets().local_addrs.map().keys().count(), 1);
        let mut s = first.share().unwrap();
        s.prepare_for("kxb", kxb).unwrap();
        s.set_hold(1).unwrap();
        let mut xsk = TestXsk::open("kxb");
        s.set_socket(0, xsk.fd()).unwrap();
        send(9000, 1);
        send(9002, 2);
        assert!(
            xsk.recv(1, Duration::from_millis(300)).is_empty(),
            "the previous entry holds kxb until the take-over"
        );
        assert_eq!(from_kernel(), 1, "9000 is no frontend any more");
        // The take-over: the same program on kxb, so no replace; the entry is this one's.
        s.attach("kxb", AttachMode::Native, true).unwrap();
        assert_eq!(query("kxb").drv_prog_id, prog_id);
        let before = s.stats().unwrap();
        send(9002, 3);
        assert_eq!(xsk.recv(3, Duration::from_secs(3)).len(), 3);
        assert_eq!(s.stats().unwrap().since(&before).redirected, 3);
        // kxd was not taken over (no longer matching): forgotten, its entry gone.
        assert_eq!(first.forget_previous(), 1);
        assert!(
            first
                .program
                .ifaces
                .lookup(&kxd.to_ne_bytes(), MapFlags::ANY)
                .unwrap()
                .is_none()
        );
        // Cleaned up as `kxp cleanup` does.
        s.detach().unwrap();
        cleanup_interface("kxd").unwrap();
        drop(first);
        pins::remove_dir(&pins::dir().unwrap());
    })
    .unwrap();
}
