#!/usr/bin/env bash
# kxp's whole check, as CI runs it: system packages, formatting, lints, build, tests, and
# a short run of every fuzz target.
# Run as root on a fresh machine: bash tests/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# No incremental caches (CI builds once, from clean): they doubled the target directory.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
echo "== disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free where the build goes"

bash tests/install-deps.sh

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
# Before the workspace's build: the earlier build's kxp passes through target/debug/kxp.
bash tests/build-previous.sh
echo "== cargo build (the kxp binary the end-to-end tests run)"
cargo build --workspace --bins
echo "== cargo test"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
passed=$(grep -Eo '^test result: [a-zA-Z]+\. [0-9]+ passed' "$log" | awk '{s += $4} END {print s + 0}')
failed=$(grep -Eo '[0-9]+ failed;' "$log" | awk '{s += $1} END {print s + 0}')
set -e
[ "$status" -eq 0 ] || { echo "tests: ${passed} passed, ${failed} failed"; exit "$status"; }
echo "== cargo test: the tests run alone (ignored in the parallel run)"
set +e
cargo test -p kxp-tests --test dataplane_e2e -- --ignored --test-threads=1 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
passed=$((passed + $(grep -Eo '^test result: [a-zA-Z]+\. [0-9]+ passed' "$log" | awk '{s += $4} END {print s + 0}')))
failed=$((failed + $(grep -Eo '[0-9]+ failed;' "$log" | awk '{s += $1} END {print s + 0}')))
set -e
echo "tests: ${passed} passed, ${failed} failed"
[ "$status" -eq 0 ] || exit "$status"
echo "== disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free before the fuzz build"
echo "== fuzzing: every target for ${FUZZ_SECONDS:-60}s (fuzz/run)"
bash fuzz/run "${FUZZ_SECONDS:-60}"
