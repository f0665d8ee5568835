//! Compiles the XDP steering program (`bpf/steer.bpf.c`) with clang into
//! `$OUT_DIR/steer.bpf.o`, which `dataplane::xdp` embeds with `include_bytes!`.
//!
//! Needs clang with the BPF target (Debian: `clang`, `llvm`). The libbpf headers
//! (`bpf/bpf_helpers.h`) come from the vendored libbpf of the `libbpf-sys`
//! dependency, which exports them as `DEP_BPF_INCLUDE`; set `CLANG` to use
//! another compiler binary.

use std::{env, path::PathBuf, process::Command};

fn main() {
    let src = "bpf/steer.bpf.c";
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-env-changed=CLANG");

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let bpf_inc = env::var("DEP_BPF_INCLUDE")
        .expect("DEP_BPF_INCLUDE is set by the libbpf-sys dependency (links = \"bpf\")");
    // <asm/types.h> and friends live in the multiarch include directory.
    let arch = env::var("CARGO_CFG_TARGET_ARCH").expect("cargo sets CARGO_CFG_TARGET_ARCH");
    let multiarch = match arch.as_str() {
        "x86_64" => "x86_64-linux-gnu",
        "aarch64" => "aarch64-linux-gnu",
        other => panic!("building the XDP program: unsupported target arch {other}"),
    };
    let obj = out.join("steer.bpf.o");
    let clang = env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let status = Command::new(&clang)
        .args([
            "-O2", "-g", "-target", "bpf", "-mcpu=v3", "-Wall", "-Werror",
        ])
        .arg(format!("-I{bpf_inc}"))
        .arg(format!("-I/usr/include/{multiarch}"))
        .args(["-c", src, "-o"])
        .arg(&obj)
        .status()
        .unwrap_or_else(|e| {
            panic!("running {clang} to build {src}: {e}; install clang and llvm (or set CLANG)")
        });
    assert!(status.success(), "{clang} failed to compile {src}");
}
