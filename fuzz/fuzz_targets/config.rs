//! libFuzzer entry point of the `config` target: see `kxp_fuzz::config`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kxp_fuzz::config::run(data));
