#!/usr/bin/env python3
"""FlashNet's extended data path (issue 29) measured: registration by size, and reads per target
core and at QD 1 against a `file:` export.

One invocation measures, on files in --dir (/var/tmp by default):

- **Registration by size** (thesis Figure 5.8; --no-registration skips it): `skiff register
  --repeat N` against flash volumes of --reg-sizes (thin: an 8 TiB volume on a 256 MiB array
  costs a map of leaf ids, no flash) and a RAM export, median round trip over loopback; beside
  it, what a DRAM buffer of that size costs to prepare the way an RDMA registration must
  (mmap, then mlock: every page allocated, zeroed and pinned), measured here up to
  --dram-max and extrapolated linearly (and said so) beyond.
- **Reads per target core** (thesis Figure 5.2 and Table 5.1; --no-reads skips it): 4 KiB
  random reads, one outstanding per client thread (`skiff bench --threads T --qd 1`), T in
  --threads, the target on one worker pinned to the server CPU, against
  - `file`: `file:F` on ext4, read with O_DIRECT (the thesis's (a): socket + pread);
  - `file-sendfile`: the same file with `send=sendfile` (the thesis's (b): read data leaves by
    sendfile(2) from the page cache, which the run warms with the whole file first);
  - `flash`: a flash volume of the same size whose page pool holds it, ordinary reads;
  - `flash-direct`: the same volume read under its extent (`--direct-reads`: the first read
    earns the whole volume's reference, every read after it is a DIRECT_READ: the extended
    data path, (c));
  - `flash-direct-cold`: the same with a page pool of a quarter of the volume (--cold-pool),
    so most reads miss: they park while the page is read on io_uring, never faulting back to
    the initiator (the issue's "cold data" figure: the share served direct, and the pool's
    hit rate).
  IOPS per target core = 10^6 / the target's CPU µs per read. The volume and the file are
  filled with data first (a never-written page costs nothing to read). QD 1 latency is the
  T = 1 point. Systems alternate within each round; medians of --repeat rounds.
- **Where the target's CPU goes** (thesis Table 5.1; --no-breakdown skips it; needs root and
  perf): for (a) `file`, (b) `file-sendfile` and (c) `flash-direct` at each of
  --breakdown-threads, one run each, `perf record -C <server CPU>` for --breakdown-seconds in
  the middle of the run; the idle task dropped, symbols sorted into the thesis's categories by
  bench/cycles.py, each share also as µs of target CPU per read; and the same for (b) and (c)
  at one thread reading each of --breakdown-sizes (1 MiB by default).
- **Latency and bandwidth by read size** (thesis Figures 5.9 and 5.10; --no-sizes skips it):
  random reads of each of --read-sizes at QD 1 on one thread, `file` (O_DIRECT) and
  `file-sendfile` (warm page cache) against a resident `flash` volume and `flash-direct`, each
  with the client's polling off and `hybrid` (spin before sleeping): median latency and MB/s.
  The target serves I/Os up to 32 MiB.
- **Synchronous writes per target core** (thesis Figures 5.12; --no-writes skips it): 4 KiB
  random writes with FUA (`skiff bench --fua`: each completes once durable), one outstanding
  per thread, T in --write-threads, against `file` (O_DIRECT and O_DSYNC on ext4), `flash`
  (a flash volume, ordinary FUA writes: the array's sync thread makes each durable, one sync
  for every write waiting) and `flash-direct` (the same as direct writes under the volume's
  extent). IOPS per target core as above.
- **Synchronous write bandwidth by size** (thesis Figure 5.13; --no-write-sizes skips it):
  random FUA writes of each of --write-sizes at QD 1 on one thread, `file` against `flash` and
  `flash-direct`: MB/s and the target's CPU per MB.

Placement as in compare.py: server on CPU 1, client on CPU 0 by default.

    python3 bench/flashnet.py
    python3 bench/flashnet.py --no-reads --reg-sizes 4K,1G,16T
Writes bench/results/flashnet-<time>.json (and a .png with matplotlib) and prints tables.
"""
import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True

from compare import Placement, add_placement_args, free_port, median_record, rotate, stop, wait_port  # noqa: E402

UNITS = {"K": 10, "M": 20, "G": 30, "T": 40}
SYSTEMS = ["file", "file-sendfile", "flash", "flash-direct", "flash-direct-cold"]
WRITE_SYSTEMS = ["file", "flash", "flash-direct"]


def size_of(text):
    text = text.strip().upper()
    return int(text[:-1]) << UNITS[text[-1]] if text[-1] in UNITS else int(text)


def human(n):
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def run(argv, **kw):
    out = subprocess.run(argv, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        raise SystemExit(f"flashnet.py: {' '.join(argv)} failed:\n{out.stderr}")
    return out.stdout


class Target:
    def __init__(self, a, argv):
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        argv = a.pl.server([a.skiff, "serve", "--listen", self.addr, "--workers", "1"] + argv)
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, timeout=120)

    def vol(self, a, *args):
        run([a.skiff, "vol"] + list(args) + ["--target", self.addr])

    def stop(self):
        stop(self.proc, timeout=60)


def format_array(a, path, size):
    with open(path, "wb") as f:
        f.truncate(size)
    run([a.skiff, "flash", "format", path, "--force"])


# ---------------------------------------------------------------------------------------------
# Registration


def dram_prepare_s(size):
    """Seconds to allocate and pin `size` bytes (mmap + mlock: what an RDMA registration of a
    DRAM buffer pays, every page faulted in, zeroed and pinned), then release them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    started = time.perf_counter()
    addr = libc.mmap(None, size, prot, flags, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise SystemExit(f"mmap of {size} bytes failed: errno {ctypes.get_errno()}")
    if libc.mlock(addr, size) != 0:
        raise SystemExit(f"mlock of {size} bytes failed (errno {ctypes.get_errno()}): run as root or raise "
                         "RLIMIT_MEMLOCK, or lower --dram-max")
    took = time.perf_counter() - started
    libc.munmap(addr, size)
    return took


def registration(a, scratch):
    array = os.path.join(scratch, "reg.img")
    format_array(a, array, 256 << 20)
    target = Target(a, ["--flash", array, "--flash-cache", "16M", "--export", "ram=ram:1G"])
    rows = []
    try:
        for size in a.reg_sizes:
            name = f"r{human(size)}"
            target.vol(a, "create", name, "--size", str(size))
            rows.append(register_row(a, target, name, size, "flash volume"))
        rows.append(register_row(a, target, "ram", 1 << 30, "RAM export"))
    finally:
        target.stop()
    for row in rows:
        if row["bytes"] <= a.dram_max:
            row["dram_prepare_us"] = statistics.median(dram_prepare_s(row["bytes"]) for _ in range(3)) * 1e6
            row["dram_extrapolated"] = False
    measured = [r for r in rows if not r.get("dram_extrapolated", True)]
    per_byte = measured[-1]["dram_prepare_us"] / measured[-1]["bytes"] if measured else None
    for row in rows:
        if "dram_prepare_us" not in row and per_byte:
            row["dram_prepare_us"] = per_byte * row["bytes"]
            row["dram_extrapolated"] = True
    print("\n## Registration by size (Figure 5.8)\n")
    print(f"placement: {a.pl.describe()}; `skiff register --repeat {a.reg_repeat}`, median round trip "
          "(the first, apart, excluded); DRAM: mmap + mlock, median of 3\n")
    print("| export | bytes | register median µs | p99 µs | DRAM prepare µs | DRAM ÷ register |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        dram = r.get("dram_prepare_us")
        mark = " (extrapolated)" if r.get("dram_extrapolated") else ""
        ratio = f"{dram / r['rtt_us']['median']:,.0f}" if dram else "-"
        dram_text = f"{dram:,.0f}{mark}" if dram else "-"
        print(f"| {r['what']} | {human(r['bytes'])} | {r['rtt_us']['median']:.1f} | {r['rtt_us']['p99']:.1f} | "
              f"{dram_text} | {ratio} |")
    return rows


def register_row(a, target, export, size, what):
    argv = a.pl.client([a.skiff, "register", target.addr, export, "--repeat", str(a.reg_repeat), "--json"])
    out = json.loads(run(argv))
    return {"what": what, "export": export, "bytes": size, "rtt_us": out["rtt_us"], "rtt_first_us": out["rtt_first_us"],
            "covers_bytes": out["covers_bytes"]}


# ---------------------------------------------------------------------------------------------
# Reads per target core


def fill(a, addr, export, size):
    # --verify writes a pattern over the whole range first (then reads a moment and checks).
    run(a.pl.client([a.skiff, "bench", "--target", addr, "--export", export, "--rw", "read", "--bs", "1M",
                     "--qd", "4", "--size", str(size), "--duration", "1s", "--verify", "--json"]))


def warm(a, addr, export, size):
    """Read the whole volume once (1 MiB reads), so that the pool holds it."""
    run(a.pl.client([a.skiff, "bench", "--target", addr, "--export", export, "--rw", "read", "--bs", "1M",
                     "--qd", "8", "--size", str(size), "--duration", "1ms", "--warm", "--json"]))


def file_and_array(a, scratch, prefix, array_bytes):
    """A file of --size for the file export, and a formatted array of `array_bytes`."""
    data = os.path.join(scratch, f"{prefix}file.img")
    with open(data, "wb") as f:
        f.truncate(a.size)
    array = os.path.join(scratch, f"{prefix}array.img")
    format_array(a, array, array_bytes)
    return data, array


def resident(size):
    """A page pool that holds a volume of `size` whole."""
    return str(size + (64 << 20))


def filled_file_and_volume(a, scratch, prefix):
    """The file and an array holding volume `v`, both of --size and filled with data, made once:
    every run starts a target over them again."""
    data, array = file_and_array(a, scratch, prefix, a.size * 2 + (256 << 20))
    t = Target(a, ["--flash", array, "--flash-cache", resident(a.size)])
    try:
        t.vol(a, "create", "v", "--size", str(a.size))
        fill(a, t.addr, "v", a.size)
    finally:
        t.stop()
    t = Target(a, ["--export", f"vol=file:{data}"])
    try:
        fill(a, t.addr, "vol", a.size)
    finally:
        t.stop()
    return data, array


def read_target(a, system, data, array, extra=()):
    """A target serving `system`'s export of the read runs (with `extra` arguments), and the
    export's name."""
    if system == "file":
        return Target(a, ["--export", f"vol=file:{data}", *extra]), "vol"
    if system == "file-sendfile":
        return Target(a, ["--export", f"vol=file:{data},send=sendfile", *extra]), "vol"
    pool = str(a.size // 4) if system == "flash-direct-cold" else resident(a.size)
    return Target(a, ["--flash", array, "--flash-cache", pool, *extra]), "v"


def read_run(a, system, target, export, threads, runtime, bs="4k"):
    """`skiff bench` of random reads of `bs`, QD 1 per thread, against `system` served by
    `target` (warmed first where the run reads from a pool or a page cache), started in the
    background: returns the Popen, whose stdout is the JSON."""
    bench = [a.skiff, "bench", "--target", target.addr, "--export", export, "--rw", "randread",
             "--bs", bs, "--qd", "1", "--threads", str(threads), "--size", str(a.size),
             "--duration", runtime, "--json"]
    if system.startswith("flash-direct"):
        bench.append("--direct-reads")
    if system in ("flash", "flash-direct", "file-sendfile"):
        # The pool (or the page cache) holds the data before the run.
        warm(a, target.addr, export, a.size)
    return subprocess.Popen(a.pl.client(bench), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_result(proc):
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"flashnet.py: skiff bench failed:\n{err}")
    return json.loads(out)


def read_record(system, threads, rnd, out):
    rec = {"system": system, "threads": threads, "round": rnd, "iops": out["iops"],
           "lat_us": out["lat_us"], "server_cpu_us_per_io": out["server_cpu_us_per_io"],
           "client_cpu_us_per_io": out["client_cpu_us_per_io"],
           "direct_reads": out.get("direct_reads", 0), "direct_faults": out.get("direct_faults", 0),
           "ios": out.get("ios") or out.get("completed")}
    rec["iops_per_target_core"] = 1e6 / rec["server_cpu_us_per_io"] if rec["server_cpu_us_per_io"] else None
    return rec


def reads(a, scratch):
    size = a.size
    data, array = filled_file_and_volume(a, scratch, "")
    records = []
    for threads in a.threads:
        for rnd in range(a.repeat):
            for system in rotate(SYSTEMS, rnd):
                target, export = read_target(a, system, data, array)
                try:
                    out = read_result(read_run(a, system, target, export, threads, a.runtime))
                finally:
                    target.stop()
                rec = read_record(system, threads, rnd, out)
                records.append(rec)
                print(f"  T={threads} {system:18} {rec['iops']:9.0f} IOPS  target {rec['server_cpu_us_per_io']:6.2f} "
                      f"µs/read  {rec['iops_per_target_core'] or 0:9.0f} IOPS/core", file=sys.stderr)
    medians = []
    for threads in a.threads:
        for system in SYSTEMS:
            reps = [r for r in records if r["threads"] == threads and r["system"] == system]
            medians.append(median_record(reps, key="iops_per_target_core"))
    print("\n## 4 KiB random reads, one outstanding per thread (Figure 5.2, Table 5.1)\n")
    print(f"placement: {a.pl.describe()}; target `--workers 1`; {human(size)} filled; medians of {a.repeat}\n")
    print("| threads | " + " | ".join(f"{s} IOPS/core" for s in SYSTEMS) + " | direct ÷ file | direct ÷ sendfile |")
    print("|---:|" + "---:|" * (len(SYSTEMS) + 2))
    for threads in a.threads:
        row = {m["system"]: m for m in medians if m["threads"] == threads}
        cells = [f"{row[s]['iops_per_target_core']:,.0f}" for s in SYSTEMS]
        per_core = lambda s: row[s]["iops_per_target_core"]
        print(f"| {threads} | " + " | ".join(cells) + f" | {per_core('flash-direct') / per_core('file'):.2f} | "
              f"{per_core('flash-direct') / per_core('file-sendfile'):.2f} |")
    one = {m["system"]: m for m in medians if m["threads"] == min(a.threads)}
    print(f"\nQD 1 latency at T = {min(a.threads)} (median µs): "
          + ", ".join(f"{s} {one[s]['lat_us']['p50']:.1f}" for s in SYSTEMS))
    cold = [m for m in medians if m["system"] == "flash-direct-cold"]
    faults = sum(m["direct_faults"] for m in cold)
    print(f"cold pool (a quarter of the volume): {faults:.0f} faults reached the initiator over all points")
    return records, medians


BREAKDOWN_SYSTEMS = ["file", "file-sendfile", "flash-direct"]


def breakdown(a, scratch):
    """Table 5.1: where the target's CPU goes for (a), (b) and (c) at each of
    --breakdown-threads, one run each: `perf record -C <server CPU>` over the middle of a
    4 KiB QD-1 random-read run, the idle task dropped, symbols sorted into the thesis's
    categories (bench/cycles.py), each share turned into µs per read with the run's own
    target CPU per read."""
    import cycles
    if a.pl.mode != "apart":
        raise SystemExit("the breakdown records the server's CPU alone: use --placement apart (or --no-breakdown)")
    cpu = str(a.pl.server_cpus).split(",")[0].split("-")[0]
    data, array = filled_file_and_volume(a, scratch, "b")
    rows = []
    cells = [(threads, "4K", system) for threads in a.breakdown_threads for system in BREAKDOWN_SYSTEMS]
    cells += [(1, human(bs), system) for bs in a.breakdown_sizes for system in BREAKDOWN_SYSTEMS[1:]]
    for threads, bs, system in cells:
        target, export = read_target(a, system, data, array, extra=["--io-max", "32M"])
        try:
            proc = read_run(a, system, target, export, threads, f"{a.breakdown_seconds + 3}s", bs=bs)
            # The warm-up is done when read_run returns; skip the run's first second.
            time.sleep(1)
            rec = cycles.Recording(cpu, a.breakdown_seconds, os.path.join(scratch, f"perf-{system}-{threads}-{bs}.data"))
            path = rec.wait()
            out = read_result(proc)
        finally:
            target.stop()
        b = cycles.breakdown(path)
        us = out["server_cpu_us_per_io"]
        row = {"system": system, "threads": threads, "bs": bs, "iops": out["iops"], "mb_s": out["iops"] * size_of(bs) / 1e6,
               "server_cpu_us_per_io": us, "busy": b["busy"], "shares": b["shares"],
               "us_per_read": {k: v * us for k, v in b["shares"].items()},
               "top": [{"share": sh, "category": c, "symbol": sym} for sh, c, sym in b["top"]]}
        rows.append(row)
        print(f"  T={threads} {bs:>4} {system:14} {out['iops']:9.0f} IOPS  target {us:6.2f} µs/read  "
              f"busy {b['busy']:.0%} of CPU {cpu}", file=sys.stderr)
    print("\n## Where the target's CPU goes (Table 5.1)\n")
    print(f"placement: {a.pl.describe()}; `perf record -C {cpu}` for {a.breakdown_seconds} s of each run; "
          f"idle dropped; one run per cell; share / µs per read\n")
    for threads, bs in dict.fromkeys((r["threads"], r["bs"]) for r in rows):
        cells = [r for r in rows if (r["threads"], r["bs"]) == (threads, bs)]
        print(f"{bs} reads, {threads} thread(s), QD 1 each: " + ", ".join(
            f"{r['system']} {r['iops']:,.0f} IOPS at {r['server_cpu_us_per_io']:.1f} µs/read" for r in cells) + "\n")
        print("| category | " + " | ".join(r["system"] for r in cells) + " |")
        print("|---|" + "---:|" * len(cells))
        for cat in cycles.CATEGORIES:
            print(f"| {cat} | " + " | ".join(
                f"{r['shares'][cat]:.1%} / {r['us_per_read'][cat]:.1f}" for r in cells) + " |")
        print()
        for r in cells:
            print(f"{r['system']} top: " + "; ".join(
                f"{t['symbol']} {t['share']:.1%}" for t in r["top"][:6]))
        print()
    return rows


def sizes(a, scratch):
    size = a.size
    data, array = filled_file_and_volume(a, scratch, "s")
    systems = ["file", "file-sendfile", "flash", "flash-direct"]
    records = []
    for bs in a.read_sizes:
        for poll in ("off", "hybrid"):
            for rnd in range(a.repeat):
                for system in rotate(systems, rnd):
                    if system == "file":
                        argv, export = ["--export", f"vol=file:{data}"], "vol"
                    elif system == "file-sendfile":
                        argv, export = ["--export", f"vol=file:{data},send=sendfile"], "vol"
                    else:
                        argv, export = ["--flash", array, "--flash-cache", resident(size)], "v"
                    target = Target(a, argv + ["--io-max", "32M"])
                    try:
                        if system != "file":
                            warm(a, target.addr, export, size)
                        bench = [a.skiff, "bench", "--target", target.addr, "--export", export, "--rw", "randread",
                                 "--bs", str(bs), "--qd", "1", "--size", str(size), "--duration", a.runtime,
                                 "--poll", poll, "--json"]
                        if system == "flash-direct":
                            bench.append("--direct-reads")
                        out = json.loads(run(a.pl.client(bench)))
                    finally:
                        target.stop()
                    rec = {"system": system, "bs": bs, "poll": poll, "round": rnd, "iops": out["iops"],
                           "lat_us": out["lat_us"], "mb_s": out["iops"] * bs / 1e6,
                           "server_cpu_us_per_io": out["server_cpu_us_per_io"]}
                    records.append(rec)
                    print(f"  {human(bs):>4} poll={poll:6} {system:12} p50 {rec['lat_us']['p50']:9.1f} µs "
                          f"{rec['mb_s']:8.1f} MB/s", file=sys.stderr)
    medians = [median_record([r for r in records if (r["bs"], r["poll"], r["system"]) == (bs, poll, s)], key="mb_s")
               for bs in a.read_sizes for poll in ("off", "hybrid") for s in systems]
    print("\n## Random reads at QD 1 by size (Figures 5.9, 5.10)\n")
    print(f"placement: {a.pl.describe()}; one thread; medians of {a.repeat}; median latency µs / MB/s\n")
    print("| size | poll | " + " | ".join(systems) + " |")
    print("|---:|---|" + "---:|" * len(systems))
    for bs in a.read_sizes:
        for poll in ("off", "hybrid"):
            row = {m["system"]: m for m in medians if (m["bs"], m["poll"]) == (bs, poll)}
            cells = [f"{row[s]['lat_us']['p50']:,.1f} / {row[s]['mb_s']:,.0f}" for s in systems]
            print(f"| {human(bs)} | {poll} | " + " | ".join(cells) + " |")
    return records, medians


def file_and_empty_volume(a, scratch, prefix):
    """A file of --size, and an array holding an empty volume `v` of --size with room for it
    four times over (random overwrites keep the cleaner light); the serve arguments and export
    of each write system."""
    data, array = file_and_array(a, scratch, prefix, a.size * 4 + (256 << 20))
    t = Target(a, ["--flash", array])
    try:
        t.vol(a, "create", "v", "--size", str(a.size))
    finally:
        t.stop()
    return lambda system: (["--export", f"vol=file:{data}"], "vol") if system == "file" else (["--flash", array], "v")


def writes(a, scratch):
    size = a.size
    serve = file_and_empty_volume(a, scratch, "w")
    records = []
    for threads in a.write_threads:
        for rnd in range(a.repeat):
            for system in rotate(WRITE_SYSTEMS, rnd):
                argv, export = serve(system)
                target = Target(a, argv)
                try:
                    bench = [a.skiff, "bench", "--target", target.addr, "--export", export, "--rw", "randwrite",
                             "--bs", "4k", "--qd", "1", "--threads", str(threads), "--size", str(size),
                             "--duration", a.runtime, "--fua", "--json"]
                    if system == "flash-direct":
                        bench.append("--direct-reads")
                    out = json.loads(run(a.pl.client(bench)))
                finally:
                    target.stop()
                rec = {"system": system, "threads": threads, "round": rnd, "iops": out["iops"], "lat_us": out["lat_us"],
                       "server_cpu_us_per_io": out["server_cpu_us_per_io"],
                       "client_cpu_us_per_io": out["client_cpu_us_per_io"], "direct_writes": out.get("direct_writes", 0)}
                rec["iops_per_target_core"] = 1e6 / rec["server_cpu_us_per_io"] if rec["server_cpu_us_per_io"] else None
                records.append(rec)
                print(f"  T={threads} {system:13} {rec['iops']:9.0f} IOPS  target {rec['server_cpu_us_per_io']:6.2f} "
                      f"µs/write  direct {rec['direct_writes']}", file=sys.stderr)
    medians = [median_record([r for r in records if r["threads"] == t and r["system"] == s], key="iops_per_target_core")
               for t in a.write_threads for s in WRITE_SYSTEMS]
    print("\n## 4 KiB synchronous (FUA) random writes, one outstanding per thread (Figure 5.12)\n")
    print(f"placement: {a.pl.describe()}; target `--workers 1`; medians of {a.repeat}; IOPS / target µs per write\n")
    print("| threads | " + " | ".join(WRITE_SYSTEMS) + " | flash-direct ÷ file, IOPS per target core |")
    print("|---:|" + "---:|" * (len(WRITE_SYSTEMS) + 1))
    for t in a.write_threads:
        row = {m["system"]: m for m in medians if m["threads"] == t}
        cells = [f"{row[s]['iops']:,.0f} / {row[s]['server_cpu_us_per_io']:.1f}" for s in WRITE_SYSTEMS]
        ratio = row["flash-direct"]["iops_per_target_core"] / row["file"]["iops_per_target_core"]
        print(f"| {t} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return records, medians


def write_sizes(a, scratch):
    """FUA random writes by size at QD 1 (Figure 5.13): file (O_DIRECT, O_DSYNC) against a
    flash volume, ordinary and direct."""
    size = a.size
    serve = file_and_empty_volume(a, scratch, "ws")
    records = []
    for bs in a.write_sizes:
        for rnd in range(a.repeat):
            for system in rotate(WRITE_SYSTEMS, rnd):
                argv, export = serve(system)
                target = Target(a, argv + ["--io-max", "32M"])
                try:
                    bench = [a.skiff, "bench", "--target", target.addr, "--export", export, "--rw", "randwrite",
                             "--bs", str(bs), "--qd", "1", "--size", str(size), "--duration", a.runtime, "--fua",
                             "--json"]
                    if system == "flash-direct":
                        bench.append("--direct-reads")
                    out = json.loads(run(a.pl.client(bench)))
                finally:
                    target.stop()
                rec = {"system": system, "bs": bs, "round": rnd, "iops": out["iops"], "lat_us": out["lat_us"],
                       "mb_s": out["iops"] * bs / 1e6, "server_cpu_us_per_io": out["server_cpu_us_per_io"]}
                rec["server_cpu_us_per_mb"] = rec["server_cpu_us_per_io"] * 1e6 / bs
                records.append(rec)
                print(f"  {human(bs):>4} {system:13} {rec['mb_s']:8.1f} MB/s  p50 {rec['lat_us']['p50']:9.1f} µs  "
                      f"target {rec['server_cpu_us_per_mb']:8.1f} µs/MB", file=sys.stderr)
    medians = [median_record([r for r in records if (r["bs"], r["system"]) == (bs, s)], key="mb_s")
               for bs in a.write_sizes for s in WRITE_SYSTEMS]
    print("\n## Synchronous (FUA) random writes at QD 1 by size (Figure 5.13)\n")
    print(f"placement: {a.pl.describe()}; one thread; medians of {a.repeat}; MB/s / target CPU µs per MB\n")
    print("| size | " + " | ".join(WRITE_SYSTEMS) + " |")
    print("|---:|" + "---:|" * len(WRITE_SYSTEMS))
    for bs in a.write_sizes:
        row = {m["system"]: m for m in medians if m["bs"] == bs}
        print(f"| {human(bs)} | " + " | ".join(f"{row[s]['mb_s']:,.1f} / {row[s]['server_cpu_us_per_mb']:,.0f}"
                                              for s in WRITE_SYSTEMS) + " |")
    return records, medians


def plot(path, result):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plot)", file=sys.stderr)
        return
    panels = [k for k in ("registration", "reads", "breakdown", "sizes", "writes", "write_sizes") if result.get(k)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "registration":
            rows = [r for r in result["registration"] if r["what"] == "flash volume"]
            xs = [r["bytes"] for r in rows]
            ax.loglog(xs, [r["rtt_us"]["median"] for r in rows], "o-", label="skiff REGISTER (round trip)")
            ax.loglog(xs, [r["dram_prepare_us"] for r in rows], "s--", label="DRAM mmap + mlock")
            ax.set_xlabel("bytes registered")
            ax.set_ylabel("µs")
            ax.set_title("Registration by size (Fig. 5.8)")
        elif key == "sizes":
            for system in ("file", "file-sendfile", "flash", "flash-direct"):
                for poll, style in (("off", "o-"), ("hybrid", "s--")):
                    pts = [m for m in result["sizes"]["medians"] if (m["system"], m["poll"]) == (system, poll)]
                    ax.loglog([p["bs"] for p in pts], [p["lat_us"]["p50"] for p in pts], style,
                              label=f"{system}, poll {poll}")
            ax.set_xlabel("read size (bytes), QD 1")
            ax.set_ylabel("median latency (µs)")
            ax.set_title("Latency by read size (Fig. 5.9)")
        elif key == "breakdown":
            import cycles
            rows = result["breakdown"]
            labels = [f"{r['system']}\n{r['bs']} x{r['threads']}" for r in rows]
            bottom = [0.0] * len(rows)
            for cat in cycles.CATEGORIES:
                vals = [100 * r["shares"][cat] for r in rows]
                ax.bar(range(len(rows)), vals, bottom=bottom, label=cat)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=30)
            ax.set_ylabel("% of the target's busy cycles")
            ax.set_title("Where the target's CPU goes (Table 5.1)")
        elif key == "write_sizes":
            for system in WRITE_SYSTEMS:
                pts = [m for m in result["write_sizes"]["medians"] if m["system"] == system]
                ax.loglog([p["bs"] for p in pts], [p["mb_s"] for p in pts], "o-", label=system)
            ax.set_xlabel("write size (bytes), FUA, QD 1")
            ax.set_ylabel("MB/s")
            ax.set_title("Synchronous write bandwidth (Fig. 5.13)")
        else:
            systems = SYSTEMS if key == "reads" else WRITE_SYSTEMS
            for system in systems:
                pts = [m for m in result[key]["medians"] if m["system"] == system]
                ax.plot([p["threads"] for p in pts], [p["iops_per_target_core"] for p in pts], "o-", label=system)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("client threads (QD 1 each)")
            ax.set_ylabel("IOPS per target core")
            ax.set_title("4 KiB random reads (Fig. 5.2)" if key == "reads" else "4 KiB FUA writes (Fig. 5.12)")
        if key == "breakdown":
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        else:
            ax.legend()
        ax.grid(True, alpha=0.3)
    fig.suptitle(result["placement_text"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--dir", default="/var/tmp", help="where the array and file go")
    p.add_argument("--no-registration", action="store_true")
    p.add_argument("--no-reads", action="store_true")
    p.add_argument("--no-writes", action="store_true")
    p.add_argument("--no-sizes", action="store_true")
    p.add_argument("--no-write-sizes", action="store_true")
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument("--breakdown-threads", default="16,32")
    p.add_argument("--breakdown-seconds", type=int, default=4)
    p.add_argument("--breakdown-sizes", default="1M", help="large reads profiled at one thread, (b) and (c)")
    p.add_argument("--write-sizes", default="4K,64K,1M,8M")
    p.add_argument("--read-sizes", default="4K,64K,1M,8M,32M")
    p.add_argument("--write-threads", default="1,4,16,64")
    p.add_argument("--reg-sizes", default="4K,1M,1G,64G,1T,8T")
    p.add_argument("--reg-repeat", type=int, default=200)
    p.add_argument("--dram-max", default="4G", help="largest DRAM buffer actually pinned")
    p.add_argument("--size", default="1G", help="the volume and the file")
    p.add_argument("--threads", default="1,2,4,8,16,32,64")
    p.add_argument("--runtime", default="3s")
    add_placement_args(p, "rounds per point (default 3)")
    a = p.parse_args()
    a.repeat = a.repeat or 3
    a.pl = Placement.from_args(a)
    a.reg_sizes = [size_of(s) for s in a.reg_sizes.split(",")]
    a.dram_max = size_of(a.dram_max)
    a.size = size_of(a.size)
    a.threads = [int(t) for t in a.threads.split(",")]
    a.write_threads = [int(t) for t in a.write_threads.split(",")]
    a.read_sizes = [size_of(s) for s in a.read_sizes.split(",")]
    a.write_sizes = [size_of(s) for s in a.write_sizes.split(",")]
    a.breakdown_threads = [int(t) for t in a.breakdown_threads.split(",")]
    a.breakdown_sizes = [size_of(s) for s in a.breakdown_sizes.split(",") if s]
    result = {"placement": a.pl.record(), "placement_text": a.pl.describe(),
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="flashnet-") as scratch:
        if not a.no_registration:
            result["registration"] = registration(a, scratch)
        if not a.no_reads:
            records, medians = reads(a, scratch)
            result["reads"] = {"records": records, "medians": medians, "size": a.size}
        if not a.no_breakdown:
            result["breakdown"] = breakdown(a, scratch)
        if not a.no_sizes:
            records, medians = sizes(a, scratch)
            result["sizes"] = {"records": records, "medians": medians, "size": a.size}
        if not a.no_writes:
            records, medians = writes(a, scratch)
            result["writes"] = {"records": records, "medians": medians, "size": a.size}
        if not a.no_write_sizes:
            records, medians = write_sizes(a, scratch)
            result["write_sizes"] = {"records": records, "medians": medians, "size": a.size}
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, "flashnet-" + time.strftime("%Y%m%d-%H%M%S"))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nresults: {stem}.json", file=sys.stderr)
    plot(stem + ".png", result)


if __name__ == "__main__":
    main()
