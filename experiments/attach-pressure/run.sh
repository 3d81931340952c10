#!/usr/bin/env bash
# ext4 on a loop device over a skiff attach file, written through a small memory cgroup (v1):
# does writeback under memory pressure make progress? (docs/ATTACH.md, "The loop-over-FUSE trap")
#
#   experiments/attach-pressure/run.sh outside 64 1024   # writer confined, skiff attach outside
#   experiments/attach-pressure/run.sh inside 256 1024   # skiff attach in the writer's cgroup
#
# Arguments: where skiff attach runs, the cgroup's memory limit in MiB, MiB to write. Root only.
# A writer that makes no progress for STALL_S seconds (default 120) is reported as stalled; the
# FUSE connection is then aborted through fusectl, which fails every pending request and frees
# whatever waits on it, so that the machine is left clean either way.
set -euo pipefail
mode=${1:?outside|inside} limit_mib=${2:?limit MiB} write_mib=${3:?MiB to write}
skiff=${SKIFF:-target/release/skiff}
stall_s=${STALL_S:-120}
port=$((20000 + RANDOM % 20000))
work=$(mktemp -d /var/tmp/skiff-pressure.XXXXXX)
cg=/sys/fs/cgroup/memory/skiff-pressure-$$
serve_pid= attach_pid= dev= fusectl_mounted=

cleanup() {
    set +e
    mountpoint -q "$work/fs" && { umount "$work/fs" || umount -l "$work/fs"; }
    [ -n "$dev" ] && losetup -d "$dev"
    [ -n "$attach_pid" ] && kill "$attach_pid" 2>/dev/null && sleep 1
    mountpoint -q "$work/fuse" && umount -l "$work/fuse"
    [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null
    if [ -d "$cg" ]; then
        for p in $(cat "$cg/tasks"); do echo "$p" > /sys/fs/cgroup/memory/tasks; done
        rmdir "$cg"
    fi
    rm -rf "$work"
    [ -n "$fusectl_mounted" ] && umount /sys/fs/fuse/connections
}
trap cleanup EXIT

if ! mountpoint -q /sys/fs/fuse/connections; then
    mount -t fusectl none /sys/fs/fuse/connections && fusectl_mounted=1
fi
mkdir -p "$work/fuse" "$work/fs" "$cg"
echo $((limit_mib << 20)) > "$cg/memory.limit_in_bytes"

"$skiff" serve --listen "127.0.0.1:$port" --export vol=ram:2G 2> "$work/serve.log" &
serve_pid=$!
for _ in $(seq 100); do grep -q listening "$work/serve.log" && break; sleep 0.1; done
# The write fills the whole export once first: the target's RAM is allocated before the test.
attach_cmd=("$skiff" attach --target "127.0.0.1:$port" --export vol "$work/fuse")
if [ "$mode" = inside ]; then
    sh -c 'echo $$ > "$1/tasks"; shift; exec "$@"' sh "$cg" "${attach_cmd[@]}" > "$work/attach.out" 2> "$work/attach.log" &
else
    "${attach_cmd[@]}" > "$work/attach.out" 2> "$work/attach.log" &
fi
attach_pid=$!
for _ in $(seq 100); do [ -s "$work/attach.out" ] && break; sleep 0.1; done
dd if=/dev/zero of="$work/fuse/vol" bs=1M count=2048 oflag=direct conv=notrunc status=none
dev=$(losetup --find --show --direct-io=on "$work/fuse/vol")
echo "loop device $dev, direct I/O $(cat /sys/block/${dev#/dev/}/loop/dio)"
mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dev"
mount "$dev" "$work/fs"
echo 0 > "$cg/memory.max_usage_in_bytes"

# The writer: buffered writes of random-looking data (so nothing is special-cased), then fsync.
head -c $((write_mib << 20)) /dev/urandom > "$work/data"   # outside the cgroup
start=$(date +%s.%N)
sh -c 'echo $$ > "$1/tasks"; exec dd if="$2" of="$3" bs=1M conv=fsync status=none' sh "$cg" "$work/data" "$work/fs/big" &
writer=$!
last_size=-1 still=0 outcome=done
while kill -0 "$writer" 2>/dev/null; do
    sleep 1
    size=$(stat -c %s "$work/fs/big" 2>/dev/null || echo 0)
    dirty=$(awk '/^Dirty:/ {print $2}' /proc/meminfo)
    wb=$(awk '/^Writeback:/ {print $2}' /proc/meminfo)
    if [ "$size" = "$last_size" ] && [ "$still" -ge 0 ]; then still=$((still + 1)); else still=0; fi
    last_size=$size
    if [ "$still" -ge "$stall_s" ]; then
        outcome=stalled
        echo "no progress for ${stall_s}s (file ${size} bytes, Dirty ${dirty} kB, Writeback ${wb} kB)"
        for p in "$writer" "$attach_pid"; do
            echo "--- $p $(cat /proc/$p/comm) state $(awk '{print $3}' /proc/$p/stat)"; cat /proc/$p/stack 2>/dev/null | head -20
        done
        for c in /sys/fs/fuse/connections/*; do echo 1 > "$c/abort"; done
        break
    fi
done
wait "$writer" 2>/dev/null && rc=0 || rc=$?
end=$(date +%s.%N)
secs=$(echo "$end - $start" | bc)
echo "mode=$mode limit=${limit_mib}MiB write=${write_mib}MiB outcome=$outcome dd_rc=$rc seconds=$secs"
echo "cgroup: max_usage=$(( $(cat $cg/memory.max_usage_in_bytes) >> 20 ))MiB failcnt=$(cat $cg/memory.failcnt) $(grep oom_kill $cg/memory.oom_control | tr '\n' ' ')"
if [ "$outcome" = done ] && [ "$rc" = 0 ]; then
    # Read back with O_DIRECT: from the device, not from the page cache.
    dd if="$work/fs/big" iflag=direct bs=1M status=none | cmp - "$work/data" && echo "read back: every byte matches"
fi
grep -i "warn\|error" "$work/attach.log" | head -3 || true
