//! The packet parser, rewrite and replies: the fuzzer's bytes are one IP packet, checked
//! by [`nat::rewrite::testutil::check_packet`] (the random-mutation test's invariants).

pub fn run(data: &[u8]) {
    let _ = nat::rewrite::testutil::check_packet(data);
}
