#!/usr/bin/env bash
# Builds the kxp of an earlier commit, for the end-to-end test of a hand-over between two
# builds (an upgrade, and a roll-back). The commit is the last one before the hand-over's
# loans, so the two speak the protocol's two dialects: the test also checks that a kxp
# serves and takes over from one of the build before.
#
# The sources come from this clone's history (git archive), the build shares the
# workspace's target directory (the dependencies are compiled once) and the binary is
# copied to target/kxp-previous/kxp. Run it before `cargo build`: the earlier build
# leaves its kxp at target/debug/kxp, which the workspace's build then puts back.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=8f3b2335cae7dc06d6a8ea6e724a8cf9218a7c5e
dir=target/kxp-previous
mkdir -p "$dir"
rm -f "$dir/kxp" "$dir/absent"
if ! git cat-file -e "$rev^{commit}" 2>/dev/null; then
    # A clone without this commit (a shallow one) cannot build it: the test says so
    # rather than pass.
    echo "== the previous build's commit ${rev:0:7} is not in this clone; the hand-over test between builds is not run"
    echo "commit $rev is not in this clone's history" > "$dir/absent"
    exit 0
fi
echo "== building kxp at ${rev:0:7} (the hand-over test between builds)"
rm -rf "$dir/src"
mkdir -p "$dir/src"
git archive "$rev" | tar -x -C "$dir/src"
target=$(pwd)/target
(cd "$dir/src" && cargo build -p controlplane --bin kxp --target-dir "$target")
cp target/debug/kxp "$dir/kxp"
echo "$rev" > "$dir/commit"
rm -rf "$dir/src"
