//! libFuzzer entry point of the `snapshot` target: see `kxp_fuzz::snapshot`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kxp_fuzz::snapshot::run(data));
