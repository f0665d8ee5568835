//! libFuzzer entry point of the `state` target: see `kxp_fuzz::state`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kxp_fuzz::state::run(data));
