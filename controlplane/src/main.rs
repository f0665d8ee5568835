//! The `kxp` binary.
#![forbid(unsafe_code)]

fn main() {
    std::process::exit(controlplane::cli::main());
}
