//! The mirror against a real kernel: two fresh network namespaces joined by a veth pair.
//! Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for `ip netns`); without it every test
//! fails with a message saying so. Only 198.18.0.0/15 and 2001:db8::/32 are used, and
//! the namespaces are deleted by a drop guard (stale ones of dead runs are swept).

use std::net::IpAddr;
use std::time::{Duration, Instant};

use super::table::Resolved;
use super::{FibMirror, FibView, NextHop, Route};
use lab::Topology;

/// Prefix of this file's namespaces (`kxpf-{tag}{a|b}{n}-{pid}`).
const LAB: &str = "kxpf";
const WAIT: Duration = Duration::from_secs(5);

fn require_root() {
    assert!(
        lab::is_root(),
        "the FIB netns tests need root (they create network namespaces); run them as root, e.g. `sudo -E cargo test -p dataplane fib`"
    );
}

/// `ip -n NS ARGS` (ARGS split at whitespace): its stdout, panicking with ip's message on
/// failure.
fn ipn(ns: &str, args: &str) -> String {
    let mut full = vec!["-n", ns];
    full.extend(args.split_whitespace());
    let out = lab::ip(&full).unwrap_or_else(|e| panic!("{e}"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

/// Polls `f` until it returns `want`, for at most `WAIT`.
fn wait_for<T: PartialEq + std::fmt::Debug>(what: &str, want: T, mut f: impl FnMut() -> T) {
    let deadline = Instant::now() + WAIT;
    loop {
        let got = f();
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still {got:?} after {WAIT:?}, want {want:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

const GW_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0xfe];
const N7_MAC: [u8; 6] = [2, 0, 0, 0, 0, 7];

/// A = the host kxp runs on, B = its neighbour. a0 (A) — b0 (B) veth:
/// 198.18.0.1/24, 2001:db8::1/64 on a0; 198.18.0.2/24, 2001:db8::2/64 on b0.
/// In A: permanent neighbours .7 and .254 (and 2001:db8::7), 198.19.0.0/16 via .254,
/// veth d0 (peer d1 in B) with 198.19.5.1/24, not attached.
struct Topo {
    lab: Topology,
    a: String,
    b: String,
    a0: u32,
    d0: u32,
    a0_mac: [u8; 6],
    b0_mac: [u8; 6],
}

impl Topo {
    fn new(tag: &str) -> Topo {
        require_root();
        let mut lab = Topology::new(LAB);
        let a = lab.add_ns_unique(&format!("{tag}a")).unwrap();
        let b = lab.add_ns_unique(&format!("{tag}b")).unwrap();
        lab.link((&a, "a0", "198.18.0.1/24"), (&b, "b0", "198.18.0.2/24"))
            .unwrap();
        for (ns, dev, v6) in [(&a, "a0", "2001:db8::1/64"), (&b, "b0", "2001:db8::2/64")] {
            ipn(ns, &format!("addr add {v6} dev {dev} nodad"));
        }
        // A second interface kxp does not drive (the dummy module is not available here).
        lab.link((&a, "d0", "198.19.5.1/24"), (&b, "d1", ""))
            .unwrap();
        ipn(
            &a,
            "neigh add 198.18.0.7 lladdr 02:00:00:00:00:07 dev a0 nud permanent",
        );
        ipn(
            &a,
            "neigh add 198.18.0.254 lladdr 02:00:00:00:00:fe dev a0 nud permanent",
        );
        ipn(
            &a,
            "neigh add 2001:db8::7 lladdr 02:00:00:00:00:07 dev a0 nud permanent",
        );
        ipn(&a, "route add 198.19.0.0/16 via 198.18.0.254 dev a0");
        let a0 = lab.ifindex(&a, "a0").expect("ifindex of a0");
        let d0 = lab.ifindex(&a, "d0").expect("ifindex of d0");
        let a0_mac = lab.mac(&a, "a0").expect("MAC of a0");
        let b0_mac = lab.mac(&b, "b0").expect("MAC of b0");
        Topo {
            lab,
            a,
            b,
            a0,
            d0,
            a0_mac,
            b0_mac,
        }
    }

    /// Starts a mirror from a thread that entered A (the mirror's own thread inherits
    /// it), attached to a0, and waits for its first dump.
    fn start(&self) -> (FibMirror, FibView) {
        let attached = [self.a0];
        let mirror = self
            .lab
            .run_in(&self.a, || FibMirror::start(&attached))
            .expect("entering A")
            .expect("FibMirror::start");
        mirror.wait_ready(WAIT).expect("first dump");
        let view = mirror.view();
        (mirror, view)
    }

    fn fwd(&self, dst_mac: [u8; 6]) -> Route {
        Route::Forward(NextHop {
            ifindex: self.a0,
            src_mac: self.a0_mac,
            dst_mac,
        })
    }
}

#[test]
fn onlink_permanent_neighbour_forwards() {
    let t = Topo::new("on");
    let (_m, view) = t.start();
    assert!(view.generation() > 0);
    assert_eq!(view.route(ip("198.18.0.7")), t.fwd(N7_MAC));
    assert_eq!(view.route(ip("2001:db8::7")), t.fwd(N7_MAC));
}

#[test]
fn gateway_route_uses_the_gateway_mac() {
    let t = Topo::new("gw");
    ipn(&t.a, "-6 route add 2001:db8:1::/48 via 2001:db8::7 dev a0");
    let (_m, view) = t.start();
    assert_eq!(view.route(ip("198.19.1.1")), t.fwd(GW_MAC));
    assert_eq!(view.route(ip("2001:db8:1::42")), t.fwd(N7_MAC));
}

/// One Pending lookup is enough: the mirror's request makes the kernel resolve the next
/// hop (nothing else in A sends to B), and the answer reaches the view as an event.
fn resolves_after_one_lookup(t: &Topo, view: &FibView, dst: &str, ip_flag: &str) {
    let show = format!("{ip_flag} neigh show {dst} dev a0");
    assert_eq!(
        ipn(&t.a, &show).trim(),
        "",
        "no kernel entry before the lookup"
    );
    assert_eq!(view.route(ip(dst)), Route::Pending);
    let b0 = t.lab.sys(&t.b, "b0", "address").expect("b0's address");
    wait_for("kernel entry with B's MAC", true, || {
        ipn(&t.a, &show).contains(&b0)
    });
    // Without looking up again (no further requests).
    let want = Resolved::Route(t.fwd(t.b0_mac));
    wait_for("resolved in the view", want, || {
        view.load().table().resolve(ip(dst))
    });
}

#[test]
fn unknown_ipv4_neighbour_is_pending_then_resolved_by_the_kernel() {
    let t = Topo::new("arp");
    let (_m, view) = t.start();
    resolves_after_one_lookup(&t, &view, "198.18.0.2", "-4");
}

#[test]
fn unknown_ipv6_neighbour_is_pending_then_resolved_by_ndp() {
    let t = Topo::new("ndp");
    let (_m, view) = t.start();
    resolves_after_one_lookup(&t, &view, "2001:db8::2", "-6");
}

#[test]
fn route_and_neighbour_changes_are_picked_up() {
    let t = Topo::new("ev");
    let (_m, view) = t.start();
    let dst = ip("198.19.200.1");
    assert_eq!(view.route(dst), t.fwd(GW_MAC));
    let g0 = view.generation();

    ipn(&t.a, "route add 198.19.200.0/24 via 198.18.0.7 dev a0");
    wait_for("more specific route", t.fwd(N7_MAC), || view.route(dst));
    assert!(view.generation() > g0);

    let new_mac = [2, 0, 0, 0, 0, 0x77];
    ipn(
        &t.a,
        "neigh replace 198.18.0.7 lladdr 02:00:00:00:00:77 dev a0 nud permanent",
    );
    wait_for("changed lladdr", t.fwd(new_mac), || view.route(dst));

    ipn(
        &t.a,
        "route replace 198.19.200.0/24 via 198.18.0.254 dev a0",
    );
    wait_for("replaced route", t.fwd(GW_MAC), || view.route(dst));

    ipn(&t.a, "route del 198.19.200.0/24");
    ipn(&t.a, "neigh del 198.18.0.254 dev a0");
    wait_for("deleted neighbour", Route::Pending, || view.route(dst));

    // IPv4 routes flushed by a link going down come without RTM_DELROUTE: the mirror
    // re-dumps. 198.19.5.0/24 (d0) disappears and 198.19.0.0/16 via .254 matches again.
    // (`replace`: the Pending lookup above made the kernel create an INCOMPLETE entry.)
    ipn(
        &t.a,
        "neigh replace 198.18.0.254 lladdr 02:00:00:00:00:fe dev a0 nud permanent",
    );
    assert_eq!(
        view.route(ip("198.19.5.9")),
        Route::NotAttached { ifindex: t.d0 }
    );
    ipn(&t.a, "link set d0 down");
    wait_for("route flushed with d0", t.fwd(GW_MAC), || {
        view.route(ip("198.19.5.9"))
    });
}

#[test]
fn local_unreachable_and_not_attached() {
    let t = Topo::new("kind");
    ipn(&t.a, "route add blackhole 198.18.100.0/24");
    let (_m, view) = t.start();
    for local in [
        "198.18.0.1",
        "127.0.0.1",
        "2001:db8::1",
        "::1",
        "198.19.5.1",
    ] {
        assert_eq!(view.route(ip(local)), Route::Local, "{local}");
    }
    assert_eq!(
        view.route(ip("198.18.200.1")),
        Route::Unreachable,
        "no route"
    );
    assert_eq!(
        view.route(ip("2001:db8:ffff::1")),
        Route::Unreachable,
        "no v6 route"
    );
    assert_eq!(
        view.route(ip("198.18.100.1")),
        Route::Unreachable,
        "blackhole"
    );
    assert_eq!(view.route(ip("224.0.0.1")), Route::Unreachable, "multicast");
    assert_eq!(
        view.route(ip("198.19.5.9")),
        Route::NotAttached { ifindex: t.d0 }
    );
    let mut local = view.local_addrs();
    local.sort();
    let mut want: Vec<IpAddr> = [
        "127.0.0.1",
        "198.18.0.1",
        "198.19.5.1",
        "::1",
        "2001:db8::1",
    ]
    .map(ip)
    .to_vec();
    want.retain(|a| local.contains(a));
    assert_eq!(want.len(), 5, "local addresses {local:?}");
    assert!(
        local
            .iter()
            .all(|a| !a.to_string().starts_with("198.18.0.2"))
    );
}

/// The attached interfaces are swapped in without a netlink event: a view that has a
/// route cached sees the change at its next lookup.
#[test]
fn attached_interfaces_change_a_cached_route_at_once() {
    let t = Topo::new("att");
    let (m, view) = t.start();
    let n7 = ip("198.18.0.7");
    assert_eq!(view.route(n7), t.fwd(N7_MAC));
    assert_eq!(view.route(n7), t.fwd(N7_MAC), "from the cache");
    m.set_attached(&[]);
    assert_eq!(view.route(n7), Route::NotAttached { ifindex: t.a0 });
    m.set_attached(&[t.a0]);
    assert_eq!(view.route(n7), t.fwd(N7_MAC));
}

#[test]
fn source_for_uses_prefsrc_or_the_egress_address() {
    let t = Topo::new("src");
    ipn(&t.a, "addr add 198.18.0.9/24 dev a0");
    ipn(
        &t.a,
        "route add 198.19.77.0/24 via 198.18.0.254 dev a0 src 198.18.0.9",
    );
    let (_m, view) = t.start();
    assert_eq!(
        view.source_for(ip("198.19.1.1")),
        Some(ip("198.18.0.1")),
        "primary on the gateway's subnet"
    );
    assert_eq!(
        view.source_for(ip("198.18.0.7")),
        Some(ip("198.18.0.1")),
        "on-link"
    );
    assert_eq!(
        view.source_for(ip("198.19.77.5")),
        Some(ip("198.18.0.9")),
        "prefsrc"
    );
    assert_eq!(
        view.source_for(ip("198.19.5.9")),
        Some(ip("198.19.5.1")),
        "other interface"
    );
    assert_eq!(
        view.source_for(ip("2001:db8::2")),
        Some(ip("2001:db8::1")),
        "v6, global not link-local"
    );
    assert_eq!(
        view.source_for(ip("198.18.0.1")),
        Some(ip("198.18.0.1")),
        "local"
    );
    assert_eq!(view.source_for(ip("198.18.200.1")), None, "no route");
    // An address added later shows up (route src picks it once the route exists).
    ipn(&t.a, "addr add 198.18.6.1/24 dev a0");
    wait_for("new address", Some(ip("198.18.6.1")), || {
        view.source_for(ip("198.18.6.20"))
    });
}

#[test]
fn stop_joins_and_views_keep_the_last_tables() {
    let t = Topo::new("stop");
    let (m, view) = t.start();
    let g = view.generation();
    m.stop();
    assert_eq!(view.generation(), g);
    assert_eq!(view.route(ip("198.18.0.7")), t.fwd(N7_MAC));
}
