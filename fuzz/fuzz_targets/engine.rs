//! libFuzzer entry point of the `engine` target: see `kxp_fuzz::engine`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kxp_fuzz::engine::run(data));
