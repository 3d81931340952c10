#!/usr/bin/env bash
# Planted bugs never reach a product binary. The simulator proves it catches bugs by planting
# them through the `mutations` features of `proto`, `engine`, `eth` and `server`; cargo unifies features over
# everything one build selects, so a crate of the workspace that turned them on by default would
# link the planted branches into `skiff` in every `cargo build --workspace` and
# `cargo test --workspace`, debug and release alike. This asks cargo's own feature resolution
# for those builds and fails, saying who turns a feature on, if any of them has one. It first
# checks that it can see the features at all, in the one build that must have them
# (`-p skiff-sim --features mutations`), so that a change in cargo's output cannot make it pass
# by seeing nothing. scripts/test.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

# The planted features a build resolves: asked of each crate in turn (`-i`, the inverted tree,
# lists every feature of it that the build turns on, whoever turns it on).
planted() {
    for crate in skiff-proto skiff-engine skiff-eth skiff-server; do
        cargo tree --locked "$@" -e features -i "$crate" --prefix none |
            grep -E "^$crate feature \"mutations\"" || true
    done | sort -u
}

seen=$(planted -p skiff-sim --features mutations)
if [ "$(printf '%s\n' "$seen" | grep -c .)" -ne 4 ]; then
    echo "check-planted: cannot see the mutations features even where they are on; got: '$seen'" >&2
    exit 1
fi

failed=0
for build in "--workspace" "-p skiff-cli" "-p skiff-capi"; do
    # shellcheck disable=SC2086 # $build is two words on purpose
    found=$(planted $build)
    if [ -n "$found" ]; then
        echo "check-planted: a build of $build compiles planted bugs in:" >&2
        printf '  %s\n' "$found" >&2
        for crate in skiff-proto skiff-engine skiff-eth skiff-server; do
            # shellcheck disable=SC2086
            cargo tree --locked $build -e features -i "$crate" | grep -A4 'feature "mutations"' >&2 || true
        done
        failed=1
    fi
done
if [ "$failed" -ne 0 ]; then
    exit 1
fi
echo "check-planted: no build of the workspace, skiff or the C library compiles planted bugs in"
