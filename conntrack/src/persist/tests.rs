use super::*;
use crate::tcp::flags::{ACK, SYN};
use crate::{SnatPorts, Timeouts};

const S: u64 = 1_000_000_000;
const BOOT: [u8; 16] = *b"0123456789abcdef";

fn tuple(p: Protocol, a: &str, b: &str) -> Tuple {
    Tuple::new(a.parse().unwrap(), b.parse().unwrap(), p)
}

fn table() -> ConnTable {
    ConnTable::new(
        64,
        Timeouts::default(),
        SnatPorts::with_seed(61000..=61100, 1).unwrap(),
    )
    .unwrap()
}

/// The writer's protocol (the dataplane does the same on the mapped file with atomic
/// stores), stopping after `steps` stores to simulate a kill in the middle.
fn write(rec: &mut [u64; RECORD_WORDS], payload: &[u64; RECORD_WORDS - 1], steps: usize) {
    let seq = (rec[0] as u32) | 1;
    let mut n = 0;
    let mut step = |f: &mut dyn FnMut()| {
        if n < steps {
            f();
        }
        n += 1;
    };
    step(&mut || rec[0] = u64::from(seq));
    for i in 0..RECORD_WORDS - 1 {
        step(&mut || rec[1 + i] = payload[i]);
    }
    step(&mut || rec[0] = seal(seq.wrapping_add(1), payload));
}

#[test]
fn records_round_trip_both_families() {
    let v4 = FlowRecord {
        orig: tuple(Protocol::Tcp, "198.18.1.2:61000", "198.19.0.10:80"),
        reply: tuple(Protocol::Tcp, "198.18.2.2:8080", "198.18.1.1:61234"),
        tag: 7,
        created: 5 * S,
        expires: 100 * S,
        tcp: TcpState::Established,
        seen_reply: true,
        assured: true,
        counted: true,
    };
    let v6 = FlowRecord {
        orig: tuple(Protocol::Udp, "[2001:db8::2]:5353", "[2001:db8:ff::10]:53"),
        reply: tuple(Protocol::Udp, "[2001:db8:2::2]:53", "[2001:db8::2]:5353"),
        tcp: TcpState::Close,
        seen_reply: false,
        assured: false,
        counted: false,
        ..v4
    };
    for r in [v4, v6] {
        assert_eq!(FlowRecord::decode(&r.encode()), Ok(r));
    }
    let a = AffinityRecord {
        service: 0xdead_beef_1234,
        client: "2001:db8::9".parse().unwrap(),
        endpoint: "198.18.2.6:8080".parse().unwrap(),
        expires: 3600 * S,
    };
    assert_eq!(AffinityRecord::decode(&a.encode()), Ok(a));
    assert!(
        FlowRecord::decode(&a.encode()).is_err(),
        "kinds are not confused"
    );
}

#[test]
fn header_is_checked() {
    let h = Header {
        kind: Kind::Conntrack,
        records: 64,
        worker: 1,
        workers: 2,
        boot_id: BOOT,
        seed: 5,
        netns: 4096,
    };
    let w = h.encode();
    assert_eq!(Header::decode(&w, BOOT, 4096), Ok(h));
    assert_eq!(
        Header::decode(&w, [0; 16], 4096),
        Err(StateError::OtherBoot)
    );
    assert_eq!(Header::decode(&w, BOOT, 7), Err(StateError::OtherNamespace));
    let mut bad = w;
    bad[1] = u64::from(VERSION + 1) | 1 << 32;
    assert!(matches!(
        Header::decode(&bad, BOOT, 4096),
        Err(StateError::Version { .. })
    ));
    let mut bad = w;
    bad[2] += 1;
    assert_eq!(
        Header::decode(&bad, BOOT, 4096),
        Err(StateError::Header("checksum"))
    );
    assert_eq!(Header::decode(&[0; 10], BOOT, 0), Err(StateError::BadMagic));
    assert!(Header::decode(&w[..3], BOOT, 0).is_err());
}

/// Found by fuzzing (`fuzz/regressions/state/`): a header with a valid checksum and a
/// record count whose file length overflows made `file_len` panic (debug builds) or wrap.
#[test]
fn a_record_count_no_file_can_hold_is_refused() {
    for records in [MAX_RECORDS + 1, 1 << 62, u64::MAX] {
        let h = Header {
            kind: Kind::Conntrack,
            records,
            worker: 0,
            workers: 1,
            boot_id: BOOT,
            seed: 0,
            netns: 0,
        };
        assert_eq!(
            Header::decode(&h.encode(), BOOT, 0),
            Err(StateError::Header("record count"))
        );
        if records >= 1 << 62 {
            assert_eq!(h.file_len(), usize::MAX);
        }
    }
    let ok = Header {
        records: MAX_RECORDS,
        kind: Kind::Conntrack,
        worker: 0,
        workers: 1,
        boot_id: BOOT,
        seed: 0,
        netns: 0,
    };
    assert!(Header::decode(&ok.encode(), BOOT, 0).is_ok());
}

/// A record cut short at any store is reported torn or stale, never read as something
/// it is not; a record with any bit flipped is refused.
#[test]
fn a_record_killed_mid_write_or_corrupted_is_never_trusted() {
    let old = FlowRecord {
        orig: tuple(Protocol::Tcp, "198.18.1.2:40000", "198.19.0.10:80"),
        reply: tuple(Protocol::Tcp, "198.18.2.2:8080", "198.18.1.2:40000"),
        tag: 1,
        created: S,
        expires: 2 * S,
        tcp: TcpState::SynSent,
        seen_reply: false,
        assured: false,
        counted: false,
    };
    let new = FlowRecord {
        tcp: TcpState::Established,
        seen_reply: true,
        expires: 9 * S,
        ..old
    };
    for steps in 0..=RECORD_WORDS + 1 {
        let mut rec = [0u64; RECORD_WORDS];
        write(&mut rec, &old.encode(), usize::MAX);
        write(&mut rec, &new.encode(), steps);
        match open_record(&rec) {
            Ok(Some(p)) => {
                let r = FlowRecord::decode(p).unwrap();
                // Only the untouched old record or the complete new one can be read.
                assert!(
                    (steps == 0 && r == old) || (steps > RECORD_WORDS && r == new),
                    "steps {steps}: {r:?}"
                );
            }
            Ok(None) => panic!("steps {steps}: a written record read as empty"),
            Err(e) => assert!((1..=RECORD_WORDS).contains(&steps), "steps {steps}: {e}"),
        }
    }
    let mut rec = [0u64; RECORD_WORDS];
    write(&mut rec, &new.encode(), usize::MAX);
    for word in 1..RECORD_WORDS {
        for bit in [0, 7, 33, 63] {
            let mut bad = rec;
            bad[word] ^= 1 << bit;
            assert_eq!(open_record(&bad), Err(StateError::Checksum), "{word}/{bit}");
        }
    }
    // Whole but nonsensical payloads are refused by the decoder.
    let mut p = new.encode();
    p[0] = (p[0] & !0xff00) | 99 << 8; // protocol 99
    assert_eq!(FlowRecord::decode(&p), Err(StateError::Invalid("protocol")));
    let mut p = new.encode();
    p[0] = (p[0] & !(0xff << 24)) | 200 << 24; // TCP state 200
    assert!(FlowRecord::decode(&p).is_err());
    assert_eq!(open_record(&[0; RECORD_WORDS]), Ok(None), "never written");
    let mut rec = [0u64; RECORD_WORDS];
    write(&mut rec, &CLEARED, usize::MAX);
    assert_eq!(open_record(&rec), Ok(None), "cleared");
}

/// What a worker journals is what the next process restores: same translation both
/// ways, same TCP state, SNAT ports still taken, and the flow's lifetime not cut short.
#[test]
fn journal_then_restore_keeps_every_flow() {
    let mut t = table();
    t.enable_journal();
    let est = (
        tuple(Protocol::Tcp, "203.0.113.9:40000", "198.19.0.10:80"),
        tuple(Protocol::Tcp, "198.18.2.2:8080", "198.18.1.1:61001"),
    );
    let udp = (
        tuple(Protocol::Udp, "198.18.2.6:5000", "198.19.0.10:53"),
        tuple(Protocol::Udp, "198.18.2.10:53", "198.18.2.6:5000"),
    );
    let gone = (
        tuple(Protocol::Udp, "198.18.2.6:5001", "198.19.0.10:53"),
        tuple(Protocol::Udp, "198.18.2.10:53", "198.18.2.6:5001"),
    );
    let now = 10 * S;
    t.insert(est.0, est.1, 3, SYN, now).unwrap();
    t.on_packet(&est.1, SYN | ACK, now);
    t.on_packet(&est.0, ACK, now);
    t.insert(udp.0, udp.1, 4, 0, now).unwrap();
    t.on_packet(&udp.1, 0, now + 3 * S);
    t.on_packet(&udp.0, 0, now + 3 * S); // a stream: assured
    t.insert(gone.0, gone.1, 4, 0, now).unwrap();
    assert!(t.remove(&gone.0));

    let mut file = vec![[0u64; RECORD_WORDS]; t.capacity()];
    let mut writes = 0;
    t.drain_journal(|slot, r| {
        writes += 1;
        let payload = r.map_or(CLEARED, |r| r.encode());
        write(&mut file[slot], &payload, usize::MAX);
    });
    // The two flows the endpoints answered; the one nobody answered never was written.
    assert_eq!(writes, 2);
    assert_eq!(t.journal_pending(), 0);
    // A flood of new flows nobody answers costs the journal nothing.
    for p in 0..20 {
        let o = tuple(
            Protocol::Udp,
            &format!("198.18.9.9:{}", 7000 + p),
            "198.19.0.10:53",
        );
        let r = tuple(
            Protocol::Udp,
            "198.18.2.10:53",
            &format!("198.18.9.9:{}", 7000 + p),
        );
        t.insert(o, r, 4, 0, now).unwrap();
    }
    assert_eq!(t.journal_pending(), 0);
    // Only state changes are journaled, not every packet.
    t.on_packet(&est.0, ACK, now + 4 * S);
    assert_eq!(t.journal_pending(), 0);

    // The next process, much later for the UDP timeout (30 s), restores.
    let later = now + 100 * S;
    let mut fresh = table();
    let mut restored = 0;
    for rec in &file {
        if let Ok(Some(p)) = open_record(rec) {
            fresh
                .restore(&FlowRecord::decode(p).unwrap(), later)
                .unwrap();
            restored += 1;
        }
    }
    assert_eq!(restored, 2);
    let hit = fresh.on_packet(&est.0, ACK, later).unwrap();
    assert_eq!(hit.rewrite_to(), est.1.reversed());
    assert_eq!(hit.entry.state().to_string(), "TCP ESTABLISHED");
    assert!(hit.entry.is_assured());
    let hit = fresh.on_packet(&udp.1, 0, later).unwrap();
    assert_eq!(hit.rewrite_to(), udp.0.reversed());
    assert!(fresh.get(&gone.0, later).is_none());
    // The restored flow's SNAT port is still taken.
    assert!(
        fresh
            .restore(
                &FlowRecord {
                    orig: tuple(Protocol::Tcp, "203.0.113.7:1", "198.19.0.10:80"),
                    ..FlowRecord::of(fresh.get(&est.0, later).unwrap().1)
                },
                later
            )
            .is_err()
    );
}
