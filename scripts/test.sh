#!/usr/bin/env bash
# Run every test skiff has, installing what the tests need first. This is the README's test
# command and what CI runs (.ci/run) on a clean clone, as root.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n== %s\n' "$*"; }

if ! command -v cargo >/dev/null 2>&1; then
    echo "scripts/test.sh: cargo not found; install Rust with rustup (the toolchain is not an apt package we can use)" >&2
    exit 1
fi

# System packages the tests use: strace proves that FLUSH and FUA reach the file as syscalls;
# qemu-utils (qemu-io, qemu-img), libnbd-bin (nbdinfo, nbdcopy, nbdfuse), python3-libnbd (nbdsh),
# fuse3 and fio are the real NBD clients of the interop tests; prometheus brings promtool, which checks the metrics
# endpoint's exposition; systemd brings systemd-analyze, which checks contrib/skiff.service;
# e2fsprogs (mkfs.ext4, fsck.ext4), mount and util-linux (losetup, fallocate, unshare) put ext4
# on a loop device over a skiff attach file (root tests); openssl makes the certificates of the
# TLS tests; iproute2 (ip) makes the network namespaces and veth pairs of the raw-Ethernet tests,
# and ethtool turns their offloads off where TCP crosses the fault relay; etcd-server is the
# coordinator of RStore namespaces, started for real by their tests.
apt_packages=(strace qemu-utils libnbd-bin python3-libnbd fuse3 fio prometheus systemd e2fsprogs mount util-linux openssl iproute2 ethtool etcd-server)
if [ ${#apt_packages[@]} -gt 0 ]; then
    missing=()
    for p in "${apt_packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "$(id -u)" -ne 0 ]; then
            echo "scripts/test.sh: need ${missing[*]}; run as root or install them" >&2
            exit 1
        fi
        say "installing ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    fi
fi

# Python packages the tests use, from PyPI: igraph is the independent PageRank and shortest-path
# implementation that Carafe's results are checked against (bench/carafe_reference.py).
pip_packages=(igraph==1.0.0)
if ! python3 -c "import igraph" >/dev/null 2>&1; then
    say "installing ${pip_packages[*]}"
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "${pip_packages[@]}"
fi

# The file-backend tests want a real file system at /var/tmp (O_DIRECT, fdatasync).
mkdir -p /var/tmp

# A test run builds once from clean, so cargo's incremental caches (2 GB of the 9 GB a full
# debug build wrote before) only cost disk. A developer who wants them sets CARGO_INCREMENTAL=1.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

say "format"
cargo fmt --all -- --check

say "lint"
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy -p skiff-sim --all-targets --features mutations --locked -- -D warnings

say "the house: layering rules, and docs/ARCHITECTURE.md's crate graph up to date"
python3 scripts/architecture.py --check

say "planted bugs stay out of the product"
scripts/check-planted.sh

say "tests"
cargo test --workspace --locked

say "the simulator's proofs, with its planted bugs"
cargo test -p skiff-sim --features mutations --locked
