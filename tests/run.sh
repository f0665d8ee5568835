#!/usr/bin/env bash
# kxp's whole check, as CI runs it: system packages, formatting, lints, build, tests.
# Run as root on a fresh machine: bash tests/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."

bash tests/install-deps.sh

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo build (the kxp binary the end-to-end tests run)"
cargo build --workspace --bins
echo "== cargo test"
cargo test --workspace
