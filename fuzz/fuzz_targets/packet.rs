//! libFuzzer entry point of the `packet` target: see `kxp_fuzz::packet`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kxp_fuzz::packet::run(data));
