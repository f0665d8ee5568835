//! The change tracker against a fresh build: the fuzzer's bytes are the choices of
//! [`translate::tracker::testutil::random_changes_match_a_fresh_build`] (which Services and
//! EndpointSlices change, how, and when a sync happens); after every sync the tracker's
//! snapshot must answer as a fresh build of the same objects.

use translate::tracker::testutil::{ByteChoices, random_changes_match_a_fresh_build};

pub fn run(data: &[u8]) {
    random_changes_match_a_fresh_build(&mut ByteChoices { data }, 64);
}
