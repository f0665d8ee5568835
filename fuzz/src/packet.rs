//! The packet parser, rewrite and replies: the fuzzer's bytes are one IP packet, checked
//! by [`nat::rewrite::testutil::check_packet`] (the random-mutation test's invariants),
//! as it is and, for IPv4, with its header checksum made right (a mutated header seldom
//! verifies, and kxp drops what does not: the fuzzer still reaches everything behind it).

use nat::rewrite::testutil::{check_packet, fix_ipv4_checksum};

pub fn run(data: &[u8]) {
    let _ = check_packet(data);
    if data.len() >= 20 && data[0] >> 4 == 4 {
        let mut fixed = data.to_vec();
        fix_ipv4_checksum(&mut fixed);
        if fixed != data {
            let _ = check_packet(&fixed);
        }
    }
}
