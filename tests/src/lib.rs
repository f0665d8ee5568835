//! Helpers for kxp's end-to-end tests.
#![forbid(unsafe_code)]

pub mod fakeapi;

use std::path::{Path, PathBuf};

/// The `kxp` binary the tests run: `KXP_BIN`, else `target/debug/kxp` of this workspace
/// (the tests build nothing themselves: `cargo build -p controlplane` first).
pub fn kxp_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("KXP_BIN") {
        let bin = PathBuf::from(bin);
        assert!(bin.is_file(), "KXP_BIN={} is not a file", bin.display());
        return bin;
    }
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/kxp");
    assert!(
        bin.is_file(),
        "the kxp binary is not at {}: run `cargo build -p controlplane` first \
         (or set KXP_BIN to a kxp binary, e.g. when CARGO_TARGET_DIR is elsewhere)",
        bin.display()
    );
    bin
}
