//! Tests of the fast-path rewrite against packets etherparse builds, plus the robustness
//! sweeps (every truncation, deterministic random mutations) over the whole module.

use super::*;
use crate::rewrite::testutil::{
    Checked, Endpoints, PATTERN, PAYLOAD, PROTOS, XorShift, build_tuple, check_packet, corpus,
    insert_v6_ext, make_partial, verify_checksums, with_ipv4_options,
};
use crate::rewrite::{FlowPacket, Parsed, parse, rewrite_fragment, rewrite_icmp_error};

fn flow(pkt: &[u8]) -> FlowPacket {
    match parse(pkt).unwrap() {
        Parsed::Flow(f) => f,
        other => panic!("not a flow: {other:?}"),
    }
}

/// Translates a packet carrying `from` to `to` and checks the result is exactly the packet
/// etherparse builds for `to`, checksums verified by recomputation, link padding after the
/// packet untouched; then translates back and checks the original bytes come back.
fn check_translation(from: &Tuple, to: &Tuple) {
    let sent = build_tuple(from, PAYLOAD);
    let mut buf = sent.clone();
    buf.extend_from_slice(&[PATTERN; 16]); // link padding: never read nor written
    let parsed = flow(&buf);
    assert_eq!(parsed.tuple(), *from);
    rewrite(&mut buf, &parsed, to).unwrap();
    let (pkt, padding) = buf.split_at(sent.len());
    assert!(padding.iter().all(|&b| b == PATTERN));
    assert_eq!(pkt, build_tuple(to, PAYLOAD), "{from} => {to}");
    verify_checksums(pkt);

    let back = flow(&buf);
    assert_eq!(back.tuple(), *to);
    rewrite(&mut buf, &back, from).unwrap();
    assert_eq!(
        buf[..sent.len()],
        sent[..],
        "{to} => {from} is not the original"
    );
}

#[test]
fn dnat_snat_both_and_replies_in_both_families() {
    for e in [Endpoints::v4(), Endpoints::v6()] {
        for proto in PROTOS {
            let original = e.original(proto);
            for translated in [e.dnat(proto), e.snat(proto), e.masquerade(proto)] {
                check_translation(&original, &translated);
                // The reply, from the backend, back to what the client expects.
                check_translation(&translated.reversed(), &original.reversed());
            }
            check_translation(&original, &original); // identity is a no-op
        }
    }
}

#[test]
fn partial_checksums_are_completed_in_both_directions_and_families() {
    // A pod's veth offloads the checksum: its packets carry only the pseudo-header sum.
    // Translated, they must carry the complete checksum of the packet as it now is.
    for e in [Endpoints::v4(), Endpoints::v6()] {
        for proto in [Protocol::Tcp, Protocol::Udp] {
            let original = e.original(proto);
            for translated in [e.dnat(proto), e.masquerade(proto)] {
                for (from, to) in [
                    (original, translated),
                    (translated.reversed(), original.reversed()),
                ] {
                    for payload in [&b""[..], PAYLOAD, &[0x5Au8; 1473][..]] {
                        let mut buf = build_tuple(&from, payload);
                        make_partial(&mut buf);
                        let parsed = flow(&buf);
                        rewrite(&mut buf, &parsed, &to).unwrap();
                        assert_eq!(buf, build_tuple(&to, payload), "{from} => {to}");
                        verify_checksums(&buf);
                    }
                }
            }
        }
    }
}

#[test]
fn a_packet_forwarded_untranslated_gets_its_partial_checksum_completed_and_nothing_else() {
    // An endpoint answering a connection kxp did not translate: forwarded as it is, but
    // its pseudo-header-only checksum completed, as the kernel would on transmit.
    for e in [Endpoints::v4(), Endpoints::v6()] {
        for proto in PROTOS {
            let t = e.dnat(proto).reversed();
            for payload in [&b""[..], PAYLOAD, &[0x5Au8; 1473][..]] {
                let whole = build_tuple(&t, payload);
                let mut buf = whole.clone();
                let partial = proto != Protocol::Sctp;
                if partial {
                    make_partial(&mut buf);
                }
                buf.extend_from_slice(&[PATTERN; 16]);
                let parsed = flow(&buf);
                assert_eq!(complete_checksum(&mut buf, &parsed), Ok(partial), "{t}");
                assert_eq!(buf[..whole.len()], whole[..], "{t}");
                assert!(buf[whole.len()..].iter().all(|&b| b == PATTERN));
                verify_checksums(&buf[..whole.len()]);
                // Complete already: left alone.
                let parsed = flow(&buf);
                assert_eq!(complete_checksum(&mut buf, &parsed), Ok(false), "{t}");
                assert_eq!(buf[..whole.len()], whole[..], "{t}");
            }
        }
    }
    // A wrong checksum that is not the pseudo-header's sum stays wrong.
    let mut buf = build_tuple(&Endpoints::v4().original(Protocol::Tcp), PAYLOAD);
    buf[36] ^= 0x01;
    let before = buf.clone();
    let parsed = flow(&buf);
    assert_eq!(complete_checksum(&mut buf, &parsed), Ok(false));
    assert_eq!(buf, before);
    // Not the parsed buffer: refused, unchanged.
    let mut short = before[..30].to_vec();
    assert!(complete_checksum(&mut short, &parsed).is_err());
    assert_eq!(short, before[..30]);
}

#[test]
fn a_complete_checksum_is_still_patched_not_recomputed() {
    // A wrong (not partial) checksum stays exactly as wrong: kxp only completes the
    // pseudo-header sum it recognises, and patches everything else incrementally.
    let e = Endpoints::v4();
    let from = e.original(Protocol::Tcp);
    let mut buf = build_tuple(&from, PAYLOAD);
    buf[36] ^= 0x01;
    let parsed = flow(&buf);
    rewrite(&mut buf, &parsed, &e.dnat(Protocol::Tcp)).unwrap();
    let mut expected = build_tuple(&e.dnat(Protocol::Tcp), PAYLOAD);
    expected[36] ^= 0x01;
    assert_eq!(buf, expected);
}

#[test]
fn udp_over_ipv4_without_checksum_stays_without() {
    let e = Endpoints::v4();
    let mut pkt = build_tuple(&e.original(Protocol::Udp), PAYLOAD);
    pkt[26..28].fill(0);
    let parsed = flow(&pkt);
    rewrite(&mut pkt, &parsed, &e.masquerade(Protocol::Udp)).unwrap();
    let mut expected = build_tuple(&e.masquerade(Protocol::Udp), PAYLOAD);
    expected[26..28].fill(0);
    assert_eq!(pkt, expected);
    verify_checksums(&pkt);
}

#[test]
fn udp_checksum_that_computes_to_zero_is_sent_as_ffff() {
    for e in [Endpoints::v4(), Endpoints::v6()] {
        let to = e.dnat(Protocol::Udp);
        let l4 = if e.client.is_ipv4() { 20 } else { 40 };
        // Choose the first payload word so that the translated packet's sum is all ones.
        let probe = build_tuple(&to, &[0, 0, b'x', b'y']);
        let c = u16::from_be_bytes([probe[l4 + 6], probe[l4 + 7]]);
        let payload = [(c >> 8) as u8, c as u8, b'x', b'y'];
        let expected = build_tuple(&to, &payload);
        assert_eq!(
            expected[l4 + 6..l4 + 8],
            [0xFF, 0xFF],
            "etherparse sends 0 as ffff"
        );

        let mut pkt = build_tuple(&e.original(Protocol::Udp), &payload);
        let parsed = flow(&pkt);
        rewrite(&mut pkt, &parsed, &to).unwrap();
        assert_eq!(pkt, expected);
    }
}

#[test]
fn ipv4_options_and_ipv6_extension_headers_are_kept() {
    let e = Endpoints::v4();
    for proto in PROTOS {
        let mut pkt = with_ipv4_options(&build_tuple(&e.original(proto), PAYLOAD), &[1, 1, 1, 0]);
        let parsed = flow(&pkt);
        assert_eq!(parsed.l4_offset(), 24);
        rewrite(&mut pkt, &parsed, &e.masquerade(proto)).unwrap();
        verify_checksums(&pkt);
        assert_eq!(flow(&pkt).tuple(), e.masquerade(proto));
    }
    let e = Endpoints::v6();
    for proto in PROTOS {
        let mut pkt = insert_v6_ext(&build_tuple(&e.original(proto), PAYLOAD), &[0, 60]);
        let parsed = flow(&pkt);
        rewrite(&mut pkt, &parsed, &e.masquerade(proto)).unwrap();
        verify_checksums(&pkt);
        let expected = insert_v6_ext(&build_tuple(&e.masquerade(proto), PAYLOAD), &[0, 60]);
        assert_eq!(pkt, expected);
    }
}

#[test]
fn mismatched_targets_are_refused_and_leave_the_packet_alone() {
    let e4 = Endpoints::v4();
    let e6 = Endpoints::v6();
    let mut pkt = build_tuple(&e4.original(Protocol::Tcp), PAYLOAD);
    let before = pkt.clone();
    let parsed = flow(&pkt);
    let to6 = e6.dnat(Protocol::Tcp);
    assert_eq!(
        rewrite(&mut pkt, &parsed, &to6),
        Err(RewriteError::FamilyMismatch)
    );
    let mut mixed = e4.dnat(Protocol::Tcp);
    mixed.dst = e6.backend.ip();
    assert_eq!(
        rewrite(&mut pkt, &parsed, &mixed),
        Err(RewriteError::FamilyMismatch)
    );
    assert_eq!(
        rewrite(&mut pkt, &parsed, &e4.dnat(Protocol::Udp)),
        Err(RewriteError::ProtocolMismatch {
            packet: Protocol::Tcp,
            to: Protocol::Udp
        })
    );
    let short = pkt.len() - 1;
    assert_eq!(
        rewrite(&mut pkt[..short], &parsed, &e4.dnat(Protocol::Tcp)),
        Err(RewriteError::BufferTooShort {
            need: short + 1,
            have: short
        })
    );
    assert_eq!(pkt, before);
}

#[test]
fn decrement_ttl_in_both_families() {
    for e in [Endpoints::v4(), Endpoints::v6()] {
        let mut pkt = build_tuple(&e.original(Protocol::Udp), PAYLOAD);
        let at = if e.client.is_ipv4() { 8 } else { 7 };
        assert_eq!(decrement_ttl(&mut pkt), Ok(true));
        assert_eq!(pkt[at], 63);
        verify_checksums(&pkt);
        pkt[at] = 1;
        let before = pkt.clone();
        assert_eq!(decrement_ttl(&mut pkt), Ok(false));
        assert_eq!(pkt, before);
    }
    assert_eq!(decrement_ttl(&mut []), Err(ParseError::Truncated));
    assert_eq!(decrement_ttl(&mut [0x45; 19]), Err(ParseError::Truncated));
    assert_eq!(decrement_ttl(&mut [0x60; 39]), Err(ParseError::Truncated));
    assert_eq!(
        decrement_ttl(&mut [0x50; 60]),
        Err(ParseError::BadVersion(5))
    );
}

#[test]
fn every_truncation_is_an_error() {
    for pkt in corpus() {
        let full = parse(&pkt).unwrap();
        for len in 0..pkt.len() {
            assert!(
                parse(&pkt[..len]).is_err(),
                "{len} of {} bytes parsed",
                pkt.len()
            );
            let mut cut = pkt[..len].to_vec();
            let _ = decrement_ttl(&mut cut);
            let e = if pkt[0] >> 4 == 4 {
                Endpoints::v4()
            } else {
                Endpoints::v6()
            };
            match full {
                Parsed::Flow(f) => {
                    let to = e.dnat(f.tuple().proto);
                    let r = rewrite(&mut cut, &f, &to);
                    assert!(matches!(r, Err(RewriteError::BufferTooShort { .. })));
                }
                Parsed::IcmpError(i) => {
                    let to = e.original(i.inner().proto);
                    let r = rewrite_icmp_error(&mut cut, &i, &to, None, e.client.ip());
                    assert!(matches!(r, Err(RewriteError::BufferTooShort { .. })));
                }
                Parsed::Fragment(fp) => {
                    let r = rewrite_fragment(&mut cut, &fp, e.backend.ip(), e.client.ip());
                    assert!(matches!(r, Err(RewriteError::BufferTooShort { .. })));
                }
                Parsed::NotTranslatable(_) => {}
            }
        }
    }
}

/// Random byte mutations of valid packets: nothing panics; whatever parses can be
/// rewritten, re-parses as the target, and (outside the cases above) comes back exactly;
/// whatever reply is built is a valid packet.
#[test]
fn random_mutations_never_panic_and_keep_the_invariants() {
    let corpus = corpus();
    let mut rng = XorShift::new(0x6b78_7001);
    let (mut flows, mut errors, mut replies) = (0, 0, 0);
    for _ in 0..20_000 {
        let mut pkt = corpus[rng.below(corpus.len())].clone();
        for _ in 0..1 + rng.below(4) {
            // Mostly the headers, where the parser looks.
            let span = if rng.below(4) == 0 {
                pkt.len()
            } else {
                pkt.len().min(72)
            };
            let at = rng.below(span);
            pkt[at] = rng.next() as u8;
        }
        if rng.below(8) == 0 {
            pkt.truncate(rng.below(pkt.len() + 1));
        }
        let (path, built) = check_packet(&pkt);
        match path {
            Checked::Flow => flows += 1,
            Checked::IcmpError => errors += 1,
            _ => {}
        }
        replies += built;
    }
    // The sweep must exercise every path, not only the error ones.
    assert!(
        flows > 1000 && errors > 300 && replies > 1000,
        "{flows} {errors} {replies}"
    );
}

/// Splits an IP packet (no options, no extension headers) into fragments whose payloads
/// hold at most `chunk` bytes (a multiple of 8), as a sender's stack does: IPv4 with MF
/// and offsets (header checksums filled in), IPv6 with a fragment header.
fn fragments(pkt: &[u8], chunk: usize, id: u32) -> Vec<Vec<u8>> {
    let v4 = pkt[0] >> 4 == 4;
    let hl = if v4 { 20 } else { 40 };
    let payload = &pkt[hl..];
    let mut out = Vec::new();
    for (i, part) in payload.chunks(chunk).enumerate() {
        let off = i * chunk;
        let more = off + part.len() < payload.len();
        let mut f = pkt[..hl].to_vec();
        if v4 {
            let w = ((off / 8) as u16) | if more { 0x2000 } else { 0 };
            f[4..6].copy_from_slice(&(id as u16).to_be_bytes());
            f[6..8].copy_from_slice(&w.to_be_bytes());
            f.extend_from_slice(part);
            let len = f.len() as u16;
            f[2..4].copy_from_slice(&len.to_be_bytes());
            f[10..12].fill(0);
            let c = etherparse::checksum::Sum16BitWords::new()
                .add_slice(&f[..20])
                .ones_complement();
            f[10..12].copy_from_slice(&c.to_ne_bytes());
        } else {
            let next = f[6];
            f[6] = 44;
            let w = ((off / 8) as u16) << 3 | u16::from(more);
            f.extend_from_slice(&[next, 0]);
            f.extend_from_slice(&w.to_be_bytes());
            f.extend_from_slice(&id.to_be_bytes());
            f.extend_from_slice(part);
            let plen = (f.len() - 40) as u16;
            f[4..6].copy_from_slice(&plen.to_be_bytes());
        }
        out.push(f);
    }
    out
}

/// The payload of a datagram from its fragments (in any order).
fn reassemble(frags: &[Vec<u8>]) -> Vec<u8> {
    let mut parts: Vec<(usize, &[u8])> = frags
        .iter()
        .map(|f| {
            if f[0] >> 4 == 4 {
                let off = usize::from(u16::from_be_bytes([f[6], f[7]]) & 0x1FFF) * 8;
                (off, &f[20..])
            } else {
                let off = usize::from(u16::from_be_bytes([f[42], f[43]]) >> 3) * 8;
                (off, &f[48..])
            }
        })
        .collect();
    parts.sort_by_key(|p| p.0);
    parts
        .into_iter()
        .flat_map(|p| p.1.iter().copied())
        .collect()
}

#[test]
fn fragments_follow_the_translation_of_the_first_in_both_families() {
    let big: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
    for e in [Endpoints::v4(), Endpoints::v6()] {
        for proto in [Protocol::Udp, Protocol::Tcp] {
            let from = e.original(proto);
            let to = e.masquerade(proto);
            let whole = build_tuple(&from, &big);
            let frags = fragments(&whole, 1448, 0x1234_5678);
            assert!(frags.len() >= 3);
            let mut out = Vec::new();
            // Out of order: the last fragment first, as a real network may deliver them.
            for f in frags.iter().rev() {
                let mut buf = f.clone();
                match parse(&buf).unwrap() {
                    Parsed::Flow(first) => {
                        let key = first.fragment().expect("the first fragment says so");
                        assert_eq!((key.src, key.dst), (from.src, from.dst));
                        rewrite(&mut buf, &first, &to).unwrap();
                    }
                    Parsed::Fragment(later) => {
                        assert_eq!(later.key().src, from.src);
                        rewrite_fragment(&mut buf, &later, to.src, to.dst).unwrap();
                    }
                    other => panic!("{other:?}"),
                }
                out.push(buf);
            }
            // Reassembled, the datagram is exactly the one built for the translated tuple.
            let expected = build_tuple(&to, &big);
            let hl = if e.client.is_ipv4() { 20 } else { 40 };
            assert_eq!(reassemble(&out), expected[hl..], "{from} => {to}");
            for f in &out {
                if f[0] >> 4 == 4 {
                    let c = etherparse::checksum::Sum16BitWords::new()
                        .add_slice(&f[..20])
                        .ones_complement();
                    assert_eq!(c, 0, "IPv4 header checksum of a fragment");
                }
            }
        }
    }
}

#[test]
fn fragments_kxp_does_not_translate_are_refused() {
    let e = Endpoints::v4();
    // SCTP: its CRC covers the whole datagram.
    let whole = build_tuple(&e.original(Protocol::Sctp), &[1u8; 3000]);
    let frags = fragments(&whole, 1448, 7);
    assert_eq!(parse(&frags[0]), Err(ParseError::Fragment));
    // A first fragment too short for the TCP header.
    let whole = build_tuple(&e.original(Protocol::Tcp), &[1u8; 100]);
    let frags = fragments(&whole, 8, 9);
    assert_eq!(parse(&frags[0]), Err(ParseError::Fragment));
}
