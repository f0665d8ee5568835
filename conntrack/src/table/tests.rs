//! Table tests, on a fake clock: `now` is just a number of nanoseconds.

use std::net::IpAddr;

use super::*;
use crate::entry::{FlowState, State};
use crate::tcp::TcpState;
use crate::tcp::flags::{ACK, FIN, RST, SYN};

const S: u64 = 1_000_000_000;
const CLIENT: &str = "198.18.0.1";
const VIP: &str = "198.19.0.10:80";
const EP: &str = "198.18.5.5:8080";
const SNAT_IP: &str = "198.18.0.254";

fn tuple(proto: Protocol, src: &str, dst: &str) -> Tuple {
    Tuple::new(src.parse().unwrap(), dst.parse().unwrap(), proto)
}

/// Client port `cport` to the VIP, DNATed to `EP` without SNAT.
fn flow(proto: Protocol, cport: u16) -> (Tuple, Tuple) {
    let c = format!("{CLIENT}:{cport}");
    (tuple(proto, &c, VIP), tuple(proto, EP, &c))
}

fn table(capacity: usize) -> ConnTable {
    let snat = SnatPorts::with_seed(61000..=61009, 1).unwrap();
    ConnTable::new(capacity, Timeouts::default(), snat).unwrap()
}

/// Checks the index, the free list and the unassured list against the slab.
fn check(t: &ConnTable) {
    let live: Vec<usize> = (0..t.slots.len())
        .filter(|&i| t.slots[i].is_live())
        .collect();
    assert_eq!(live.len(), t.len);
    assert!(t.len <= t.capacity);
    assert_eq!(t.index.len(), 2 * t.len);
    for &i in &live {
        let e = &t.slots[i];
        for dir in [Direction::Original, Direction::Reply] {
            let v = find(&t.index, &t.slots, t.hash(e.tuple(dir)), e.tuple(dir));
            assert_eq!(v, Some(pack(i, dir)));
        }
    }
    let mut free = 0;
    let mut f = t.free;
    while f != NIL {
        assert!(!t.slots[f as usize].is_live());
        free += 1;
        f = t.slots[f as usize].next;
    }
    assert_eq!(free + t.len, t.slots.len());
    let mut on_list = Vec::new();
    let (mut prev, mut cur) = (NIL, t.unassured_head);
    while cur != NIL {
        let e = &t.slots[cur as usize];
        assert!(e.is_live() && !e.is_assured());
        assert_eq!(e.prev, prev);
        on_list.push(cur as usize);
        (prev, cur) = (cur, e.next);
    }
    assert_eq!(t.unassured_tail, prev);
    let unassured = live.iter().filter(|&&i| !t.slots[i].is_assured()).count();
    assert_eq!(on_list.len(), unassured);
    // The look-ahead point is on the list, at most `ahead_by` places from its head.
    assert!(t.ahead_by <= ConnTable::LOOKAHEAD);
    if t.ahead == NIL {
        assert_eq!(t.ahead_by, 0);
    } else {
        let at = on_list.iter().position(|&s| s == t.ahead as usize);
        let at = at.expect("the look-ahead point is an unassured flow");
        assert!(
            at < t.ahead_by as usize,
            "place {at}, counted {}",
            t.ahead_by
        );
    }
}

/// SYN, SYN/ACK, ACK at `now`: an assured ESTABLISHED flow.
fn establish(t: &mut ConnTable, cport: u16, now: u64) {
    let (o, r) = flow(Protocol::Tcp, cport);
    t.insert(o, r, 0, SYN, now).unwrap();
    t.on_packet(&r, SYN | ACK, now).unwrap();
    let hit = t.on_packet(&o, ACK, now).unwrap();
    assert!(hit.entry.is_assured());
}

#[test]
fn both_directions_find_the_same_entry() {
    let mut t = table(16);
    let (o, r) = flow(Protocol::Tcp, 40000);
    let e = t.insert(o, r, 42, SYN, 0).unwrap();
    assert_eq!(e.tag(), 42);
    assert_eq!(e.endpoint(), EP.parse().unwrap());

    let hit = t.on_packet(&o, SYN, S).unwrap();
    assert_eq!(hit.dir, Direction::Original);
    assert_eq!(
        hit.rewrite_to(),
        tuple(Protocol::Tcp, "198.18.0.1:40000", EP)
    );
    let hit = t.on_packet(&r, SYN | ACK, S).unwrap();
    assert_eq!(hit.dir, Direction::Reply);
    assert_eq!(
        hit.rewrite_to(),
        tuple(Protocol::Tcp, VIP, "198.18.0.1:40000")
    );
    assert_eq!(hit.entry.tag(), 42);

    assert_eq!(t.get(&o, S).unwrap().0, Direction::Original);
    assert_eq!(t.get(&r, S).unwrap().0, Direction::Reply);
    assert!(t.get(&o.reversed(), S).is_none());
    let (o2, _) = flow(Protocol::Udp, 40000);
    assert!(t.get(&o2, S).is_none(), "protocol is part of the key");
    check(&t);
}

#[test]
fn a_clash_on_either_tuple_is_refused() {
    let mut t = table(16);
    let c2 = format!("{CLIENT}:40001");
    let o = tuple(Protocol::Udp, "198.18.0.1:40000", VIP);
    let r = tuple(Protocol::Udp, EP, &format!("{SNAT_IP}:61000"));
    t.insert(o, r, 1, 0, 0).unwrap();

    // Another client masqueraded to the same SNAT port: the reply tuple clashes.
    let o2 = tuple(Protocol::Udp, &c2, VIP);
    let err = t.insert(o2, r, 2, 0, S).unwrap_err();
    assert_eq!(
        err,
        InsertError::Clash {
            which: Direction::Reply,
            tuple: r
        }
    );
    // The same client tuple again.
    let r2 = tuple(Protocol::Udp, EP, &format!("{SNAT_IP}:61001"));
    assert!(matches!(
        t.insert(o, r2, 2, 0, S),
        Err(InsertError::Clash {
            which: Direction::Original,
            ..
        })
    ));
    // A tuple that is its own reply.
    assert!(t.insert(o2, o2, 2, 0, S).is_err());
    assert_eq!(t.stats().clashes, 3);
    assert_eq!(t.len(), 1);
    assert_eq!(t.get(&r, S).unwrap().1.orig(), &o);
    check(&t);
}

#[test]
fn an_expired_holder_of_a_tuple_is_reclaimed_on_insert() {
    let mut t = table(16);
    let (o, r) = flow(Protocol::Udp, 40000);
    t.insert(o, r, 1, 0, 0).unwrap();
    let e = t.insert(o, r, 2, 0, 30 * S).unwrap();
    assert_eq!(e.tag(), 2);
    assert_eq!(t.len(), 1);
    assert_eq!(t.stats().expired, 1);
    assert_eq!(t.stats().clashes, 0);
    check(&t);
}

#[test]
fn tcp_handshake_established_fin_time_wait() {
    let mut t = table(16);
    let (o, r) = flow(Protocol::Tcp, 40000);
    let e = t.insert(o, r, 0, SYN, 0).unwrap();
    assert_eq!(e.state(), State::Tcp(TcpState::SynSent));
    assert_eq!(e.expires_at(), 120 * S);

    let h = t.on_packet(&r, SYN | ACK, S).unwrap();
    assert_eq!(h.entry.state(), State::Tcp(TcpState::SynRecv));
    assert_eq!(h.entry.expires_at(), S + 60 * S);
    assert!(!h.entry.is_assured());

    let h = t.on_packet(&o, ACK, 2 * S).unwrap();
    assert_eq!(h.entry.state(), State::Tcp(TcpState::Established));
    assert!(h.entry.is_assured());
    assert_eq!(h.entry.expires_at(), 2 * S + 24 * 3600 * S);

    // Idle for an hour, then data: still there, refreshed.
    let h = t.on_packet(&r, ACK, 3602 * S).unwrap();
    assert_eq!(h.entry.remaining(3602 * S), 24 * 3600 * S);

    let h = t.on_packet(&o, FIN | ACK, 3603 * S).unwrap();
    assert_eq!(h.entry.state(), State::Tcp(TcpState::FinWait));
    assert_eq!(h.entry.remaining(3603 * S), 120 * S);
    let h = t.on_packet(&r, ACK, 3604 * S).unwrap();
    assert_eq!(h.entry.state(), State::Tcp(TcpState::CloseWait));
    assert_eq!(h.entry.remaining(3604 * S), 3600 * S);
    let h = t.on_packet(&r, FIN | ACK, 3605 * S).unwrap();
    assert_eq!(h.entry.state(), State::Tcp(TcpState::LastAck));
    assert_eq!(h.entry.remaining(3605 * S), 30 * S);
    let h = t.on_packet(&o, ACK, 3606 * S).unwrap();
    assert_eq!(h.entry.state(), State::Tcp(TcpState::TimeWait));
    assert_eq!(h.entry.expires_at(), 3606 * S + 120 * S);

    // Alive just before the end of TIME_WAIT, gone at it.
    assert!(t.get(&o, 3726 * S - 1).is_some());
    assert!(t.get(&o, 3726 * S).is_none());
    assert!(t.on_packet(&o, ACK, 3726 * S).is_none());
    assert_eq!(t.len(), 0);
    assert_eq!(t.stats().expired, 1);
    check(&t);
}

#[test]
fn rst_closes_and_a_refusing_endpoint_ends_the_flow() {
    let mut t = table(16);
    establish(&mut t, 40000, 0);
    let (o, r) = flow(Protocol::Tcp, 40000);
    let h = t.on_packet(&r, RST | ACK, S).unwrap();
    assert_eq!(h.update, Update::Tracked);
    assert_eq!(h.entry.state(), State::Tcp(TcpState::Close));
    assert_eq!(h.entry.expires_at(), 11 * S);
    assert!(t.get(&o, 11 * S).is_none());

    // The endpoint answers a SYN with RST: the RST is still translated, then the flow
    // is gone so the client's retry is a new flow.
    let (o, r) = flow(Protocol::Tcp, 40001);
    t.insert(o, r, 0, SYN, 0).unwrap();
    let h = t.on_packet(&r, RST | ACK, S).unwrap();
    assert_eq!(h.update, Update::Closed);
    assert_eq!(
        h.rewrite_to(),
        tuple(Protocol::Tcp, VIP, "198.18.0.1:40001")
    );
    assert!(t.get(&o, S).is_none());
    assert_eq!(t.stats().removed, 1);
    check(&t);
}

#[test]
fn a_syn_on_a_closed_connection_starts_a_new_flow() {
    let mut t = table(16);
    establish(&mut t, 40000, 0);
    let (o, r) = flow(Protocol::Tcp, 40000);
    t.on_packet(&o, RST, S).unwrap();
    assert!(t.on_packet(&o, SYN, 2 * S).is_none());
    assert_eq!(t.len(), 0);
    t.insert(o, r, 0, SYN, 2 * S).unwrap();
    check(&t);
}

#[test]
fn invalid_and_retransmitted_segments_do_not_refresh() {
    let mut t = table(16);
    let (o, r) = flow(Protocol::Tcp, 40000);
    t.insert(o, r, 0, SYN, 0).unwrap();
    assert_eq!(
        t.on_packet(&o, SYN, 100 * S).unwrap().update,
        Update::Ignored
    );
    assert_eq!(
        t.on_packet(&o, ACK, 100 * S).unwrap().update,
        Update::Invalid
    );
    assert!(t.on_packet(&o, SYN, 120 * S).is_none(), "expired at 120s");
}

#[test]
fn udp_unreplied_then_stream() {
    let mut t = table(16);
    let (o, r) = flow(Protocol::Udp, 5353);
    t.insert(o, r, 0, 0, 0).unwrap();
    let h = t.on_packet(&o, 0, 10 * S).unwrap();
    assert_eq!(h.entry.state(), State::Udp(FlowState::Unreplied));
    assert_eq!(h.entry.expires_at(), 40 * S);
    assert!(t.get(&o, 40 * S).is_none());

    // A query and its answer within 2s: replied but still on the short timeout and
    // unassured (a DNS lookup must not pin an entry).
    let (o, r) = flow(Protocol::Udp, 5354);
    t.insert(o, r, 0, 0, 100 * S).unwrap();
    let h = t.on_packet(&r, 0, 100 * S + S / 100).unwrap();
    assert_eq!(h.entry.state(), State::Udp(FlowState::Replied));
    assert_eq!(h.entry.remaining(100 * S + S / 100), 30 * S);
    let h = t.on_packet(&o, 0, 101 * S).unwrap();
    assert_eq!(h.entry.remaining(101 * S), 30 * S);
    assert!(!h.entry.is_assured());

    // Still talking both ways after 2s: a stream, assured, 120s.
    let h = t.on_packet(&o, 0, 103 * S).unwrap();
    assert_eq!(h.entry.state(), State::Udp(FlowState::Assured));
    assert_eq!(h.entry.remaining(103 * S), 120 * S);
    let h = t.on_packet(&r, 0, 200 * S).unwrap();
    assert_eq!(h.entry.expires_at(), 320 * S);
    check(&t);
}

#[test]
fn full_of_established_flows_refuses_new_ones_and_keeps_them() {
    let mut t = table(4);
    for p in 0..4 {
        establish(&mut t, 40000 + p, 0);
    }
    let (o, r) = flow(Protocol::Tcp, 50000);
    assert_eq!(
        t.insert(o, r, 0, SYN, S).unwrap_err(),
        InsertError::Full { capacity: 4 }
    );
    let (o, r) = flow(Protocol::Udp, 50000);
    assert!(t.insert(o, r, 0, 0, S).is_err());
    assert_eq!(t.stats().insert_failed_full, 2);
    assert_eq!(t.stats().evictions, 0);
    for p in 0..4 {
        assert!(t.get(&flow(Protocol::Tcp, 40000 + p).0, S).is_some());
    }
    check(&t);
}

#[test]
fn full_with_unassured_flows_evicts_the_oldest_unassured() {
    let mut t = table(4);
    establish(&mut t, 40000, 0);
    for p in 1..4 {
        let (o, r) = flow(Protocol::Tcp, 40000 + p);
        t.insert(o, r, 0, SYN, u64::from(p) * S).unwrap();
    }
    // The oldest SYN_SENT (40001) is refreshed by nothing: it goes first; then 40002.
    for (new, victim) in [(50000, 40001), (50001, 40002)] {
        let (o, r) = flow(Protocol::Udp, new);
        t.insert(o, r, 0, 0, 10 * S).unwrap();
        assert!(t.get(&flow(Protocol::Tcp, victim).0, 10 * S).is_none());
        check(&t);
    }
    assert_eq!(t.stats().evictions, 2);
    assert!(t.get(&flow(Protocol::Tcp, 40000).0, 10 * S).is_some());
    assert!(t.get(&flow(Protocol::Tcp, 40003).0, 10 * S).is_some());
    assert_eq!(t.len(), 4);
}

#[test]
fn a_full_table_reclaims_expired_flows_before_evicting() {
    let mut t = table(3);
    establish(&mut t, 40000, 0);
    let (o, r) = flow(Protocol::Udp, 40001);
    t.insert(o, r, 0, 0, 0).unwrap(); // expires at 30s
    let (o, r) = flow(Protocol::Tcp, 40002);
    t.insert(o, r, 0, SYN, 20 * S).unwrap();
    let (o, r) = flow(Protocol::Tcp, 40003);
    t.insert(o, r, 0, SYN, 31 * S).unwrap();
    assert_eq!(t.stats().expired, 1);
    assert_eq!(t.stats().evictions, 0);
    assert!(t.get(&flow(Protocol::Tcp, 40002).0, 31 * S).is_some());
    check(&t);
}

#[test]
fn incremental_expiry_is_bounded_and_eventually_complete() {
    let mut t = table(100);
    for p in 0..100 {
        let (o, r) = flow(Protocol::Udp, 10000 + p);
        t.insert(o, r, 0, 0, 0).unwrap();
    }
    assert_eq!(t.expire(29 * S, 1000), 0, "nothing expired yet");
    let mut calls = 0;
    while !t.is_empty() {
        let removed = t.expire(30 * S, 7);
        assert!(removed <= 7);
        calls += 1;
        assert!(
            calls <= 100_usize.div_ceil(7) + 1,
            "hand must cover the slab"
        );
        check(&t);
    }
    assert_eq!(t.stats().expired, 100);
    // Freed slots are reused: the slab never grows past capacity.
    for p in 0..100 {
        let (o, r) = flow(Protocol::Udp, 20000 + p);
        t.insert(o, r, 0, 0, 40 * S).unwrap();
    }
    assert_eq!(t.slots.len(), 100);
    check(&t);
}

#[test]
fn expiry_examines_at_most_the_budget() {
    let mut t = table(10);
    for p in 0..10 {
        let (o, r) = flow(Protocol::Udp, 10000 + p);
        t.insert(o, r, 0, 0, 0).unwrap();
    }
    // Everything is expired, so the number removed is the number examined.
    assert_eq!(t.expire(30 * S, 3), 3);
    assert_eq!(t.expire(30 * S, 3), 3);
    assert_eq!(t.expire(30 * S, 100), 4, "each slot at most once per call");
    assert_eq!(t.expire(30 * S, 100), 0);
}

#[test]
fn the_paced_hand_sweeps_every_slot_once_per_period_whatever_the_call_rate() {
    const MS: u64 = 1_000_000;
    let fill = |t: &mut ConnTable| {
        for p in 0..1000 {
            let (o, r) = flow(Protocol::Udp, 10000 + p);
            t.insert(o, r, 0, 0, 0).unwrap();
        }
    };
    // Every flow expired at 30 s. Calls every 10 µs for half the period remove half.
    let mut t = table(1000);
    fill(&mut t);
    let start = 30 * S;
    let mut removed = 0;
    let mut now = start;
    while now < start + 500 * MS {
        removed += t.expire_paced(now, 1000 * MS, 64);
        now += 10_000;
    }
    assert!((495..=505).contains(&removed), "{removed}");
    // The rest of the period, in calls every 50 ms, removes the rest.
    while now <= start + 1000 * MS {
        removed += t.expire_paced(now, 1000 * MS, 1000);
        now += 50 * MS;
    }
    assert_eq!(removed, 1000);
    assert!(t.is_empty());
    check(&t);

    // A call after a long pause owes at most one sweep, spent `max` slots per call.
    let mut t = table(1000);
    fill(&mut t);
    assert_eq!(
        t.expire_paced(start, 1000 * MS, 64),
        0,
        "the first call sets the pace"
    );
    assert_eq!(t.expire_paced(start + 3600 * S, 1000 * MS, 64), 64);
    let mut calls = 1;
    while !t.is_empty() {
        assert!(t.expire_paced(start + 3600 * S, 1000 * MS, 64) > 0);
        calls += 1;
    }
    assert_eq!(calls, 1000usize.div_ceil(64));
    assert_eq!(
        t.expire_paced(start + 3600 * S, 1000 * MS, 64),
        0,
        "nothing owed now"
    );
}

#[test]
fn snat_ports_avoid_used_ones_come_back_and_run_out() {
    let mut t = table(64);
    let snat: IpAddr = SNAT_IP.parse().unwrap();
    let ep = EP.parse().unwrap();
    let mut used = Vec::new();
    for p in 0..10 {
        let port = t.allocate_snat_port(snat, ep, Protocol::Tcp, 0).unwrap();
        assert!(t.snat_ports().contains(port));
        assert!(!used.contains(&port));
        used.push(port);
        let o = tuple(Protocol::Tcp, &format!("{CLIENT}:{}", 40000 + p), VIP);
        let r = tuple(Protocol::Tcp, EP, &format!("{SNAT_IP}:{port}"));
        t.insert(o, r, 0, SYN, 0).unwrap();
    }
    assert_eq!(t.allocate_snat_port(snat, ep, Protocol::Tcp, 0), None);
    // Another endpoint, or protocol, may reuse the same ports.
    let other = "198.18.5.6:8080".parse().unwrap();
    assert!(
        t.allocate_snat_port(snat, other, Protocol::Tcp, 0)
            .is_some()
    );
    assert!(t.allocate_snat_port(snat, ep, Protocol::Udp, 0).is_some());
    // Removing a flow releases its port.
    let freed = used[3];
    assert!(t.remove(&tuple(Protocol::Tcp, EP, &format!("{SNAT_IP}:{freed}"))));
    assert_eq!(
        t.allocate_snat_port(snat, ep, Protocol::Tcp, 0),
        Some(freed)
    );
    // Expired flows hold no port.
    assert!(
        t.allocate_snat_port(snat, ep, Protocol::Tcp, 120 * S)
            .is_some()
    );
    check(&t);
}

#[test]
fn stale_udp_removal_takes_only_udp_to_that_endpoint() {
    let mut t = table(64);
    let other_ep = "198.18.5.6:8080";
    let other_port = "198.18.5.5:9090";
    for (i, (proto, ep)) in [
        (Protocol::Udp, EP),
        (Protocol::Udp, EP),
        (Protocol::Tcp, EP),
        (Protocol::Udp, other_ep),
        (Protocol::Udp, other_port),
        (Protocol::Sctp, EP),
    ]
    .into_iter()
    .enumerate()
    {
        let c = format!("{CLIENT}:{}", 40000 + i);
        let f = if proto == Protocol::Tcp { SYN } else { 0 };
        t.insert(tuple(proto, &c, VIP), tuple(proto, ep, &c), i as u32, f, 0)
            .unwrap();
    }
    let ip: IpAddr = "198.18.5.5".parse().unwrap();
    assert_eq!(t.remove_udp_to_endpoint(ip, 8080), 2);
    let mut tags: Vec<u32> = t.iter(0).map(Entry::tag).collect();
    tags.sort_unstable();
    assert_eq!(tags, [2, 3, 4, 5]);
    assert_eq!(t.remove_to_endpoint_ip(ip), 3);
    assert_eq!(t.iter(0).map(Entry::tag).collect::<Vec<_>>(), [3]);
    assert_eq!(t.stats().removed_stale, 5);
    assert_eq!(t.remove_if(|e| e.tag() == 3), 1);
    assert!(t.is_empty());
    check(&t);
}

#[test]
fn listing_shows_state_remaining_time_and_tag() {
    let mut t = table(8);
    establish(&mut t, 40000, 0);
    let (o, r) = flow(Protocol::Udp, 40001);
    t.insert(o, r, 9, 0, 0).unwrap();
    let list: Vec<(String, u64, u32)> = t
        .iter(10 * S)
        .map(|e| (e.state().to_string(), e.remaining(10 * S), e.tag()))
        .collect();
    assert_eq!(
        list,
        [
            ("TCP ESTABLISHED".to_string(), 86_390 * S, 0),
            ("UDP UNREPLIED".to_string(), 20 * S, 9)
        ]
    );
    assert_eq!(t.iter(30 * S).count(), 1, "expired flows are not listed");
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let snat = || SnatPorts::new(1000..=1999).unwrap();
    assert!(matches!(
        ConnTable::new(0, Timeouts::default(), snat()),
        Err(CapacityError::OutOfRange { .. })
    ));
    assert!(ConnTable::new(usize::MAX, Timeouts::default(), snat()).is_err());
    let mut t = table(4);
    let (o, r) = flow(Protocol::Tcp, 40000);
    for f in [SYN | ACK, RST, FIN | ACK, 0] {
        assert_eq!(
            t.insert(o, r, 0, f, 0).unwrap_err(),
            InsertError::NotNew { flags: f }
        );
    }
    let (_, udp_reply) = flow(Protocol::Udp, 40000);
    assert!(matches!(
        t.insert(o, udp_reply, 0, SYN, 0),
        Err(InsertError::ProtocolMismatch { .. })
    ));
    // A mid-stream ACK is picked up, capped at the unacknowledged timeout.
    let e = t.insert(o, r, 0, ACK, 0).unwrap();
    assert_eq!(e.state(), State::Tcp(TcpState::Established));
    assert_eq!(e.expires_at(), 300 * S);
    assert!(t.on_packet(&flow(Protocol::Tcp, 1).0, ACK, 0).is_none());
    assert!(!t.remove(&flow(Protocol::Tcp, 1).0));
}

#[test]
fn entries_are_compact() {
    let mut t = table(1 << 16);
    let empty = t.memory_bytes();
    for p in 0..(1u32 << 16) {
        let (o, r) = flow(Protocol::Udp, (p % 65_535 + 1) as u16);
        let o = Tuple {
            src: std::net::IpAddr::from([10, 9, (p >> 16) as u8 + 1, (p >> 8) as u8]),
            ..o
        };
        let r = Tuple { dst: o.src, ..r };
        t.insert(o, r, 0, 0, 0).unwrap();
    }
    let per = t.bytes_per_entry_estimate();
    // Slab entry plus the index: two slots (4-byte value, 2-byte tag) per flow, the
    // index at most half full (here 40%, after the rounding to a power of two).
    assert!(per <= ConnTable::ENTRY_SIZE + 32, "{per}");
    // Everything was reserved when the table was made: filling it allocates nothing.
    assert_eq!(empty, t.memory_bytes());
}

/// Random operations against the invariants: a deterministic xorshift, no wall clock.
#[test]
fn random_operations_keep_the_structure_consistent() {
    let mut t = table(50);
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut rand = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let mut now = 0;
    for _ in 0..20_000 {
        now += rand(S / 2);
        let proto = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp][rand(3) as usize];
        let (o, r) = flow(proto, 1 + rand(120) as u16);
        let f = [SYN, ACK, SYN | ACK, FIN | ACK, RST][rand(5) as usize];
        let key = if rand(2) == 0 { o } else { r };
        match rand(10) {
            0..=3 => {
                // Half the time as a packet path does it: a lookup that finds no flow,
                // then the insert (which trusts that lookup: `ConnTable::absent`).
                if rand(2) == 0 && t.on_packet(&o, f, now).is_some() {
                    continue;
                }
                let _ = t.insert(o, r, 0, f, now);
            }
            4..=7 => {
                let _ = t.on_packet(&key, f, now);
            }
            8 => {
                t.expire(now, rand(20) as usize);
            }
            _ => {
                t.remove(&key);
            }
        }
        check(&t);
    }
    let s = t.stats();
    assert!(s.inserts > 0 && s.expired > 0 && s.evictions > 0, "{s:?}");
}

/// An insert after a lookup that found no flow skips looking the original tuple up
/// again, and only then: a tuple held meanwhile (as another flow's reply), or another
/// tuple than the one looked up, is checked as always.
#[test]
fn an_insert_trusts_only_the_last_miss_of_its_own_tuple() {
    let mut t = table(8);
    let (o1, r1) = flow(Protocol::Udp, 1);
    assert!(t.on_packet(&o1, 0, 0).is_none());
    t.insert(o1, r1, 0, 0, 0).unwrap();
    check(&t);
    // Missed, then taken as another flow's reply before its own insert.
    let x = tuple(Protocol::Udp, "198.18.1.9:99", VIP);
    assert!(t.on_packet(&x, 0, 0).is_none());
    let held_as_reply = tuple(Protocol::Udp, "198.18.9.9:9", "198.18.8.8:8");
    t.insert(held_as_reply, x, 0, 0, 0).unwrap();
    let e = t.insert(x, tuple(Protocol::Udp, EP, "198.18.1.9:99"), 0, 0, 0);
    assert!(
        matches!(
            e,
            Err(InsertError::Clash {
                which: Direction::Original,
                ..
            })
        ),
        "{e:?}"
    );
    // A miss on one tuple says nothing of another.
    assert!(t.on_packet(&flow(Protocol::Udp, 2).0, 0, 0).is_none());
    let e = t.insert(o1, r1, 0, 0, 0);
    assert!(
        matches!(
            e,
            Err(InsertError::Clash {
                which: Direction::Original,
                ..
            })
        ),
        "{e:?}"
    );
    // An expired flow found by the lookup is removed there, and its tuple is free.
    let later = 10 * 60 * S;
    assert!(t.on_packet(&o1, 0, later).is_none());
    t.insert(o1, r1, 0, 0, later).unwrap();
    check(&t);
    assert_eq!(t.get(&r1, later).map(|(d, _)| d), Some(Direction::Reply));
}

thread_local! {
    static PREFETCHED: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A full table of unanswered flows, each new one evicting the oldest: by the time a
/// batch of victims is read (by `warm`, then by the evictions), the table has already
/// asked for their entries, a batch or more ahead.
#[test]
fn the_flows_to_evict_next_are_prefetched_ahead() {
    let mut t = table(300);
    t.set_prefetch(|line| PREFETCHED.with(|p| p.borrow_mut().push(line as usize)));
    let udp = |i: u32| {
        let c = SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::from(0xC612_0000 + i)), 7);
        (
            Tuple::new(c, VIP.parse().unwrap(), Protocol::Udp),
            Tuple::new(EP.parse().unwrap(), c, Protocol::Udp),
        )
    };
    for i in 0..300 {
        let (o, r) = udp(i);
        t.insert(o, r, 0, 0, 0).unwrap();
    }
    assert!(
        PREFETCHED.with(|p| p.borrow().is_empty()),
        "no eviction, no look-ahead"
    );
    for i in 300..500 {
        let (o, r) = udp(i);
        t.insert(o, r, 0, 0, 0).unwrap();
        check(&t);
    }
    assert_eq!(t.stats().evictions, 200);
    let asked: std::collections::HashSet<usize> =
        PREFETCHED.with(|p| p.borrow().iter().copied().collect());
    let mut victim = t.unassured_head;
    for k in 0..ConnTable::WARM_BATCH {
        let e = &t.slots[victim as usize];
        let at = (&raw const *e) as usize;
        assert!(
            asked.contains(&at) && asked.contains(&(at + 64)),
            "victim {k} not asked for"
        );
        victim = e.next;
    }
    assert!(t.ahead_by >= ConnTable::LOOKAHEAD - 1);
}

/// The shared per-endpoint load follows every way a flow comes and goes.
#[test]
fn endpoint_load_follows_inserts_and_every_removal() {
    let load = Arc::new(EndpointLoad::new());
    let ep: SocketAddr = EP.parse().unwrap();
    let mut a = table(4);
    let mut b = table(8);
    a.set_load(load.clone());
    b.set_load(load.clone());
    for p in 1..=3 {
        let (o, r) = flow(Protocol::Tcp, 40000 + p);
        a.insert_counted(o, r, 0, SYN, 0).unwrap();
        let (o, r) = flow(Protocol::Udp, 40000 + p);
        b.insert_counted(o, r, 0, 0, 0).unwrap();
        // A flow of a Service that does not weigh by load is not counted.
        let (o, r) = flow(Protocol::Sctp, 40000 + p);
        b.insert(o, r, 0, 0, 0).unwrap();
    }
    assert_eq!(load.get(ep), 6, "both tables count");
    // Removed by a packet (RST answering the SYN), by key, by expiry, by eviction.
    let (_, r) = flow(Protocol::Tcp, 40001);
    a.on_packet(&r, RST | ACK, 1);
    assert!(a.remove(&flow(Protocol::Tcp, 40002).0));
    assert_eq!(load.get(ep), 4);
    b.expire(1000 * S, 100);
    assert_eq!(load.get(ep), 1);
    for p in 10..20 {
        let (o, r) = flow(Protocol::Tcp, 40000 + p);
        a.insert_counted(o, r, 0, SYN, 2).unwrap();
    }
    assert_eq!(a.len(), 4);
    assert_eq!(load.get(ep), 4, "evictions are taken off");
    // A table joining later adds what it holds.
    let mut c = table(4);
    let (o, r) = flow(Protocol::Udp, 50000);
    c.insert_counted(o, r, 0, 0, 0).unwrap();
    c.set_load(load.clone());
    assert_eq!(load.get(ep), 5);
}

#[test]
fn flows_count_their_packets_and_bytes_and_endpoints_keep_them_when_flows_go() {
    let mut t = table(16);
    let ep: SocketAddr = EP.parse().unwrap();
    let (o1, r1) = flow(Protocol::Tcp, 40000);
    let (o2, r2) = flow(Protocol::Tcp, 40001);
    let e = t.insert_first(o1, r1, 0, SYN, 0, 60, false).unwrap();
    assert_eq!((e.packets(), e.bytes()), (1, 60));
    let h = t.on_packet_bytes(&r1, SYN | ACK, S, 60).unwrap();
    assert_eq!((h.entry.packets(), h.entry.bytes()), (2, 120));
    t.on_packet_bytes(&o1, ACK, S, 52).unwrap();
    t.insert_first(o2, r2, 0, SYN, 0, 60, false).unwrap();
    let c = t.endpoint_counts(S);
    assert_eq!(
        c[&(ep, Protocol::Tcp)],
        (
            2,
            Counts {
                packets: 4,
                bytes: 232
            }
        )
    );
    // A UDP flow to the same address and port is another endpoint's count.
    let (ou, ru) = flow(Protocol::Udp, 40000);
    t.insert_first(ou, ru, 0, 0, 0, 100, false).unwrap();
    assert_eq!(t.endpoint_counts(S)[&(ep, Protocol::Udp)].1.bytes, 100);
    // The flow goes: its packets stay in the endpoint's totals.
    assert!(t.remove(&o1));
    assert_eq!(
        t.endpoint_counts(S)[&(ep, Protocol::Tcp)],
        (
            1,
            Counts {
                packets: 4,
                bytes: 232
            }
        )
    );
    assert_eq!(t.retired_len(), 1);
    // A restored or plain insert counts its first packet, without bytes.
    let (o3, r3) = flow(Protocol::Tcp, 40002);
    assert_eq!(t.insert(o3, r3, 0, SYN, 0).unwrap().packets(), 1);
    // Endpoints no longer in any Service are forgotten when pruned.
    t.prune_retired(|_, _| false);
    assert_eq!(t.retired_len(), 0);
    assert_eq!(t.endpoint_counts(S)[&(ep, Protocol::Tcp)].1.packets, 2);
    check(&t);
}

/// Warming the cache for a batch reads and changes nothing: tracked and untracked keys,
/// in either direction, more keys than it reads, none at all.
#[test]
fn warming_a_batch_changes_nothing() {
    let mut t = table(512);
    for cport in 40000..40200 {
        establish(&mut t, cport, S);
    }
    let before: Vec<(u16, u64, u64)> = (40000..40200)
        .map(|cport| {
            let e = t.get(&flow(Protocol::Tcp, cport).0, S).unwrap().1;
            (cport, e.packets(), e.expires_at())
        })
        .collect();
    let stats = *t.stats();
    let mut keys = Vec::new();
    for cport in 39900..40300 {
        let (o, r) = flow(Protocol::Tcp, cport);
        keys.push(o);
        keys.push(r);
    }
    t.warm(&keys, |_| {});
    t.warm(&keys[..ConnTable::WARM_BATCH - 1], |_| {});
    t.warm(&[], |_| {});
    assert_eq!(*t.stats(), stats);
    assert_eq!(t.len(), 200);
    for (cport, packets, expires) in before {
        let e = t.get(&flow(Protocol::Tcp, cport).0, S).unwrap().1;
        assert_eq!((e.packets(), e.expires_at()), (packets, expires));
    }
    assert!(t.get(&flow(Protocol::Tcp, 39999).0, S).is_none());
    check(&t);
}

/// In a full table, warming also reads the buckets of the flows new keys would evict:
/// still nothing changes, and the next insert evicts the oldest unassured flow as before.
#[test]
fn warming_a_full_table_changes_nothing() {
    let mut t = table(16);
    for cport in 1000..1016 {
        let (o, r) = flow(Protocol::Udp, cport);
        t.insert(o, r, 0, 0, S).unwrap();
    }
    assert_eq!(t.len(), t.capacity());
    let stats = *t.stats();
    let head = t.unassured_head;
    let fresh: Vec<Tuple> = (2000..2100).map(|p| flow(Protocol::Udp, p).0).collect();
    t.warm(&fresh, |_| {});
    assert_eq!((*t.stats(), t.unassured_head, t.len()), (stats, head, 16));
    check(&t);
    let (o, r) = flow(Protocol::Udp, 2000);
    t.insert(o, r, 0, 0, 2 * S).unwrap();
    assert!(
        t.get(&flow(Protocol::Udp, 1000).0, 2 * S).is_none(),
        "the oldest went"
    );
    assert!(t.get(&flow(Protocol::Udp, 1001).0, 2 * S).is_some());
    check(&t);
}

/// The addresses warming hands out, and whether each lies in the table's memory.
fn warmed_lines(t: &ConnTable, keys: &[Tuple], replies: &[Tuple]) -> (u64, Vec<usize>) {
    let lines = std::cell::RefCell::new(Vec::new());
    let fresh = t.warm(keys, |p| lines.borrow_mut().push(p as usize));
    t.warm_tuples(replies, |p| lines.borrow_mut().push(p as usize));
    let lines = lines.into_inner();
    for &p in &lines {
        assert!(
            t.regions()
                .iter()
                .any(|&(at, len)| (at..at + len).contains(&p)),
            "{p:#x} is outside the table's memory {:x?}",
            t.regions()
        );
    }
    (fresh, lines)
}

/// Warming asks for the lines the batch's lookups will read: a bucket per key, both
/// lines of each tracked flow's entry (an entry is two lines, line-aligned), a bucket per
/// reply tuple; in a full table, the two buckets of each flow the new ones would evict.
#[test]
fn warming_asks_for_the_lines_lookups_read() {
    assert_eq!(ConnTable::ENTRY_SIZE, 128);
    let mut t = table(512);
    for cport in 40000..40032 {
        establish(&mut t, cport, S);
    }
    let keys: Vec<Tuple> = (0..32)
        .flat_map(|i| {
            [
                flow(Protocol::Tcp, 40000 + i).0,
                flow(Protocol::Tcp, 50000 + i).0,
            ]
        })
        .collect();
    let replies: Vec<Tuple> = (0..10).map(|i| flow(Protocol::Tcp, 50000 + i).1).collect();
    let (fresh, lines) = warmed_lines(&t, &keys, &replies);
    let new = fresh.count_ones() as usize;
    assert!(new >= 31, "{new}");
    // A bucket per key and per reply, two lines per candidate (an untracked key's tag
    // may match one in its bucket: then it is a candidate too).
    assert_eq!(lines.len(), 64 + 2 * (64 - new) + 10);
    for cport in 40000..40032 {
        let at = std::ptr::from_ref(t.get(&flow(Protocol::Tcp, cport).0, S).unwrap().1) as usize;
        assert_eq!(at % 64, 0, "entries are line-aligned");
        assert!(lines.contains(&at) && lines.contains(&(at + 64)), "{cport}");
    }

    // Full of unassured flows: each new key's victim has its two buckets asked for, as
    // many victims as new keys (here more new keys than flows: each flow once).
    let mut t = table(16);
    for cport in 1000..1016 {
        let (o, r) = flow(Protocol::Udp, cport);
        t.insert(o, r, 0, 0, S).unwrap();
    }
    let keys: Vec<Tuple> = (2000..2100).map(|p| flow(Protocol::Udp, p).0).collect();
    let (fresh, lines) = warmed_lines(&t, &keys, &[]);
    let new = fresh.count_ones() as usize;
    assert_eq!(lines.len(), 64 + 2 * (64 - new) + 2 * new.min(16));
    // Three keys: three buckets, and for each either its candidate's two lines or its
    // victim's two buckets.
    let (_, lines) = warmed_lines(&t, &keys[..3], &[]);
    assert_eq!(lines.len(), 3 + 2 * 3);
}

/// Warming tells which keys of a batch have no candidate in their home bucket (most
/// likely new flows), and warming the reply tuples of such flows changes nothing.
#[test]
fn warming_flags_the_keys_with_no_candidate() {
    let mut t = table(512);
    for cport in 40000..40032 {
        establish(&mut t, cport, S);
    }
    let stats = *t.stats();
    // Tracked and untracked keys alternate: bit 2i is a tracked flow, 2i+1 an untracked one.
    let keys: Vec<Tuple> = (0..32)
        .flat_map(|i| {
            [
                flow(Protocol::Tcp, 40000 + i).0,
                flow(Protocol::Tcp, 50000 + i).0,
            ]
        })
        .collect();
    let fresh = t.warm(&keys, |_| {});
    let tracked = (0..32).filter(|i| fresh >> (2 * i) & 1 == 1).count();
    let untracked = (0..32).filter(|i| fresh >> (2 * i + 1) & 1 == 1).count();
    // A 16-bit tag of an untracked key may match one in its bucket (the hasher's seed is
    // random): allow one such.
    assert!(untracked >= 31, "{untracked} of 32 untracked keys flagged");
    assert_eq!(
        tracked, 0,
        "a tracked flow is in its home bucket in a sparse table"
    );
    // Keys past what warming reads are not flagged.
    let many: Vec<Tuple> = (0..100).map(|i| flow(Protocol::Tcp, 50000 + i).0).collect();
    assert!(t.warm(&many, |_| {}).count_ones() <= 64);
    assert_eq!(t.warm(&[], |_| {}), 0);
    let replies: Vec<Tuple> = (0..100).map(|i| flow(Protocol::Tcp, 50000 + i).1).collect();
    t.warm_tuples(&replies, |_| {});
    t.warm_tuples(&[], |_| {});
    assert_eq!((*t.stats(), t.len()), (stats, 32));
    check(&t);
}

/// With room reserved for the endpoints' totals, flows to thousands of endpoints going
/// one by one (evicted by new ones, as in a full table) never grow the map: no rehash on
/// the packet path.
#[test]
fn reserved_endpoint_totals_do_not_grow_as_flows_go() {
    let endpoints = 5_000usize;
    let mut t = table(256);
    t.reserve_retired(endpoints);
    let capacity = t.retired_capacity();
    assert!(capacity >= endpoints, "{capacity}");
    for i in 0..2 * endpoints {
        let ep = format!(
            "198.18.{}.{}:80",
            128 + (i % endpoints) / 250,
            (i % endpoints) % 250
        );
        let c = format!("{CLIENT}:{}", 1024 + i);
        let o = tuple(Protocol::Udp, &c, VIP);
        let r = tuple(Protocol::Udp, &ep, &c);
        t.insert(o, r, 0, 0, i as u64).unwrap();
    }
    assert_eq!(t.stats().evictions as usize, 2 * endpoints - 256);
    assert_eq!(t.retired_len(), endpoints);
    assert_eq!(t.retired_capacity(), capacity);
    // Reserving less than it holds changes nothing.
    t.reserve_retired(10);
    assert_eq!(t.retired_capacity(), capacity);
    // Growing keeps every total and nothing else (the map is built anew, its room
    // written with placeholders first).
    let before = t.endpoint_counts(0);
    t.reserve_retired(4 * capacity);
    assert!(t.retired_capacity() >= 4 * capacity);
    assert_eq!(t.retired_len(), endpoints);
    assert_eq!(t.endpoint_counts(0), before);
    check(&t);
}

#[test]
fn evicted_flows_totals_are_kept_whether_or_not_their_batch_was_added_yet() {
    // A full table evicts a flow per insert; each one's bytes go to its endpoint's
    // totals, in batches of RETIRED_BATCH: the totals are exact before, at and after a
    // batch is added.
    let mut t = table(64);
    let ep: SocketAddr = EP.parse().unwrap();
    let flows = 64 + crate::table::RETIRED_BATCH + 10;
    for i in 0..flows {
        let (o, r) = flow(Protocol::Udp, 10_000 + i as u16);
        t.insert_first(o, r, 0, 0, 0, 100, false).unwrap();
        let (_, c) = t.endpoint_counts(S)[&(ep, Protocol::Udp)];
        assert_eq!(c.bytes, 100 * (i as u64 + 1), "after {} flows", i + 1);
    }
    assert_eq!(t.retired_len(), 1);
    assert_eq!(
        t.endpoint_counts(S)[&(ep, Protocol::Udp)].1.packets,
        flows as u64
    );
}
