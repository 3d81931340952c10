#!/usr/bin/env python3
"""The flash array's map under a budget: memory held against what a large volume maps.

For each --budgets value (`skiff serve --flash-map-budget`; 0: no bound), on a fresh sparse
array of --array-gib on --dir:

1. **write**: a volume of 80% of the array takes one 4 KiB write in every 2 MiB (fio's
   `rw=write:2044k` with `io_size` one page per 2 MiB: without it, fio comes back round for
   the pages it skipped), through NBD, QD 32, so every leaf of its map (2 MiB each) holds a
   page;
2. the target stops cleanly (write-back and a checkpoint), and starts again, timed until it
   listens;
3. **read**: the same pages read back and checked (fio's crc32c verify), QD 32, so every
   leaf is needed again.

After each phase it records the map's figures from `skiff vol stats` (map_bytes, leaves in
memory and in use, leaves read back and evicted, checkpoints) and the target's resident set
(VmRSS: the page pool, --flash-cache, is part of it, touched as it fills).

Placement as in compare.py: the server on CPU 1, fio on CPU 0 by default. One run per budget
(this shows memory, not speed).

    python3 bench/flash_map.py                        # 64 GiB, budgets 0 and 16M
    python3 bench/flash_map.py --array-gib 32 --budgets 0,8M,64M
Writes bench/results/flash-map-<time>.json and prints a Markdown table.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.dont_write_bytecode = True

from compare import Placement, add_placement_args, free_port, wait_port  # noqa: E402
from flash import Target, run  # noqa: E402

GIB = 1 << 30
LEAF_BYTES = 2 << 20


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def serve(a, array, budget):
    port, nbd_port = free_port(), free_port()
    argv = [a.skiff, "serve", "--listen", f"127.0.0.1:{port}", "--nbd", f"127.0.0.1:{nbd_port}",
            "--flash", array, "--flash-cache", a.cache, "--flash-map-budget", budget]
    started = time.monotonic()
    t = Target(a.pl.server(argv), nbd_port)
    wait_port(port)
    t.start_s = time.monotonic() - started
    return t, f"127.0.0.1:{port}", f"nbd://127.0.0.1:{nbd_port}/vol"


def figures(a, t, native):
    stats = json.loads(run([a.skiff, "vol", "stats", "--json", "--target", native]).stdout)
    keep = ["map_bytes", "map_leaves", "map_leaves_resident", "map_loads", "map_loads_async", "map_evictions",
            "checkpoints"]
    out = {k: stats.get(k, 0) for k in keep}
    out["rss_bytes"] = rss_bytes(t.proc.pid)
    return out


def fio(a, uri, rw, verify):
    argv = ["fio", "--name=map", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}:2044k", "--bs=4k", "--iodepth=32",
            f"--size={a.array_gib * 8 // 10}G", f"--io_size={a.array_gib * 8 // 10 * 512 * 4}k",
            "--verify=crc32c", "--output-format=json"]
    argv += ["--verify_only"] if verify else ["--do_verify=0"]
    started = time.monotonic()
    out = run(a.pl.client(argv)).stdout
    seconds = time.monotonic() - started
    job = json.loads(out[out.index("{"):])["jobs"][0]
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    errors = job.get("error", 0)
    return {"ios": ios, "seconds": seconds, "iops": ios / max(seconds, 1e-9), "fio_error": errors}


def one(a, budget, scratch):
    array = os.path.join(scratch, "array.img")
    with open(array, "wb") as f:
        f.truncate(a.array_gib * GIB)
    run([a.skiff, "flash", "format", array, "--force"])
    rec = {"budget": budget}
    t, native, uri = serve(a, array, budget)
    try:
        run([a.skiff, "vol", "create", "vol", "--size", f"{a.array_gib * 8 // 10}G", "--target", native])
        rec["write"] = fio(a, uri, "write", verify=False)
        rec["after_write"] = figures(a, t, native)
    finally:
        t.stop()
    t, native, uri = serve(a, array, budget)
    try:
        rec["restart_s"] = t.start_s
        rec["after_restart"] = figures(a, t, native)
        rec["read"] = fio(a, uri, "read", verify=True)
        rec["after_read"] = figures(a, t, native)
    finally:
        t.stop()
    os.unlink(array)
    return rec


def mib(b):
    return f"{b / (1 << 20):,.1f}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--array-gib", type=int, default=64, help="the sparse array file; the volume is 80%% of it")
    p.add_argument("--budgets", default="0,16M", help="--flash-map-budget values, comma-separated")
    p.add_argument("--cache", default="64M", help="--flash-cache")
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--out", default="bench/results")
    add_placement_args(p, "unused: one run per budget")
    a = p.parse_args()
    a.pl = Placement.from_args(a)
    records = []
    for budget in a.budgets.split(","):
        with tempfile.TemporaryDirectory(dir=a.dir) as scratch:
            print(f"  budget {budget}: {a.array_gib} GiB array ...", file=sys.stderr, flush=True)
            records.append(one(a, budget, scratch))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, time.strftime("flash-map-%Y%m%d-%H%M%S.json"))
    with open(path, "w") as f:
        json.dump({"array_gib": a.array_gib, "cache": a.cache, "placement": a.pl.describe(), "records": records},
                  f, indent=1)
    print(f"\nOne 4 KiB page in every 2 MiB of a {a.array_gib * 8 // 10} GiB volume ({a.array_gib} GiB array, "
          f"--flash-cache {a.cache}); {a.pl.describe()}; one run per budget\n")
    print("| budget | phase | map MiB | leaves in memory / in use | read back (async) | evicted | RSS MiB | IOPS |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in records:
        for phase, key, io in [("after write", "after_write", r["write"]), ("after restart", "after_restart", None),
                               ("after read", "after_read", r["read"])]:
            f = r[key]
            iops = f"{io['iops']:,.0f}" if io else f"start {r['restart_s']:.2f} s"
            print(f"| {r['budget']} | {phase} | {mib(f['map_bytes'])} | {f['map_leaves_resident']:,} / "
                  f"{f['map_leaves']:,} | {f['map_loads']:,} ({f['map_loads_async']:,}) | {f['map_evictions']:,} | "
                  f"{mib(f['rss_bytes'])} | {iops} |")
    print(f"\nrecords: {path}")


if __name__ == "__main__":
    sys.exit(main())
