#!/usr/bin/env bash
# Build fio/skiff_engine.c into target/fio/skiff-engine.so, an external ioengine for the fio
# installed on this machine.
#
# An external engine is compiled against fio's own headers, which fio's Debian package does not
# ship, so this fetches the source of exactly the installed version (`apt-get source`) into a cache
# outside the repository and runs its ./configure once for config-host.h. Nothing of fio is
# copied into the repository. Later runs reuse the cache and only recompile the engine.
#
# usage: fio/build.sh [--profile debug|release]
# env:   SKIFF_CACHE (default /var/cache/skiff), CC (default cc)
set -euo pipefail

profile=debug
while [ $# -gt 0 ]; do
    case "$1" in
        --profile) profile="${2:-}"; shift 2 ;;
        --profile=*) profile="${1#--profile=}"; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "fio/build.sh: unknown argument '$1'" >&2; exit 2 ;;
    esac
done
case "$profile" in
    debug|release) ;;
    *) echo "fio/build.sh: --profile must be debug or release, not '$profile'" >&2; exit 2 ;;
esac

repo="$(cd "$(dirname "$0")/.." && pwd)"
cache="${SKIFF_CACHE:-/var/cache/skiff}"
cc="${CC:-cc}"

say() { printf 'fio/build.sh: %s\n' "$*"; }
die() { printf 'fio/build.sh: error: %s\n' "$*" >&2; exit 1; }

# (a) The installed fio, whose headers the engine must match.
version="$(dpkg-query -W -f='${Version}' fio 2>/dev/null)" || true
[ -n "$version" ] || die "fio is not installed (apt-get install fio)"
src="$cache/fio-$version"
say "fio $version; source cache $src"

# An apt source entry of the same suites, for deb-src. Debian 12 keeps its entries in deb822
# form; ours is a separate file so the system's own stays as it was.
ensure_deb_src() {
    local f
    # Only the files apt reads: *.list and *.sources (not *.disabled and the like).
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        if grep -qE '^(Types:.*\bdeb-src\b|deb-src[[:space:]])' "$f"; then
            return 0
        fi
    done
    local system=/etc/apt/sources.list.d/debian.sources
    local ours=/etc/apt/sources.list.d/skiff-deb-src.sources
    [ -f "$system" ] || die "no deb-src entry and no $system to derive one from; add a deb-src line for fio's suite"
    [ -w /etc/apt/sources.list.d ] || die "need root to add a deb-src entry ($ours)"
    say "adding $ours (deb-src for the suites of $system)"
    # Copy each stanza with Types: deb turned into deb-src; comments and the rest stay.
    sed -E 's/^Types:[[:space:]]*deb[[:space:]]*$/Types: deb-src/' "$system" >"$ours.tmp"
    grep -q '^Types: deb-src' "$ours.tmp" || { rm -f "$ours.tmp"; die "could not derive deb-src from $system"; }
    mv "$ours.tmp" "$ours"
}

# (b) Fetch the source package, only when it is not cached yet.
if [ ! -f "$src/.skiff-fetched" ]; then
    command -v apt-get >/dev/null || die "apt-get not found; fetch fio $version's source into $src by hand"
    ensure_deb_src
    say "apt-get update"
    apt-get update -qq || die "apt-get update failed"
    if ! command -v dpkg-source >/dev/null; then
        say "installing dpkg-dev (for dpkg-source)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dpkg-dev || die "cannot install dpkg-dev"
    fi
    work="$cache/.fetch-fio-$version.$$"
    rm -rf "$work"
    mkdir -p "$work"
    say "apt-get source fio=$version"
    (cd "$work" && apt-get source -qq fio="$version") || { rm -rf "$work"; die "apt-get source fio=$version failed"; }
    unpacked="$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'fio-*' | head -n1)"
    [ -n "$unpacked" ] && [ -f "$unpacked/ioengines.h" ] || { rm -rf "$work"; die "no unpacked fio tree with ioengines.h in $work"; }
    rm -rf "$src"
    mv "$unpacked" "$src"
    rm -rf "$work"
    touch "$src/.skiff-fetched"
else
    say "source cached"
fi

# (c) config-host.h, which fio's headers expect; fio itself is not built.
if [ ! -f "$src/config-host.h" ]; then
    say "configuring fio (for config-host.h)"
    (cd "$src" && ./configure >"$src/.skiff-configure.log" 2>&1) \
        || die "fio's ./configure failed; see $src/.skiff-configure.log"
    [ -f "$src/config-host.h" ] || die "fio's ./configure left no config-host.h"
else
    say "config-host.h cached"
fi

# (d) libskiff.so, then the engine linked to it.
cargo_args=(build -p skiff-capi)
[ "$profile" = release ] && cargo_args+=(--release)
say "cargo ${cargo_args[*]}"
(cd "$repo" && cargo "${cargo_args[@]}") || die "cargo ${cargo_args[*]} failed"
target_dir="${CARGO_TARGET_DIR:-$repo/target}"
libdir="$target_dir/$profile"
[ -f "$libdir/libskiff.so" ] || die "no libskiff.so in $libdir after cargo build"

out="$target_dir/fio"
mkdir -p "$out"
say "compiling $out/skiff-engine.so"
"$cc" -shared -fPIC -O2 -g -std=gnu11 -Wall -Wextra -Wno-unused-parameter -Wno-sign-compare \
    -D_GNU_SOURCE -D_LARGEFILE_SOURCE -D_FILE_OFFSET_BITS=64 \
    -include "$src/config-host.h" -I "$src" -I "$repo/crates/capi/include" \
    -o "$out/skiff-engine.so.tmp" "$repo/fio/skiff_engine.c" \
    -L "$libdir" -lskiff -Wl,-rpath,"$libdir" \
    || die "compiling fio/skiff_engine.c failed"

# fio resolves the engine's calls into fio at dlopen time; catch a header/binary mismatch here
# rather than as a lazy-binding crash in the middle of a run.
fio_bin="$(command -v fio || true)"
if [ -n "$fio_bin" ] && command -v nm >/dev/null; then
    provided="$(nm -D --defined-only "$fio_bin" | awk '{print $3}')"
    for sym in $(nm -D --undefined-only "$out/skiff-engine.so.tmp" | awk '$1 == "U" {print $2}' | grep -v -e '@' -e '^skiff_'); do
        grep -qx "$sym" <<<"$provided" || { rm -f "$out/skiff-engine.so.tmp"; die "the engine needs '$sym', which $fio_bin does not export"; }
    done
fi
mv "$out/skiff-engine.so.tmp" "$out/skiff-engine.so"
say "done: $out/skiff-engine.so (fio --ioengine=external:$out/skiff-engine.so)"
