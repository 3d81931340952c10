#!/usr/bin/env python3
"""ODAFS Table 3 on skiff: ordinary reads against direct reads (capabilities) of a file export.

A client reads a file-backed export twice in 4 KiB reads; the second pass is measured
(`skiff bench --warm`: the first pass fills the target's cache and the lanes' directories,
then the timed phase reads from the start again). Every case runs `skiff serve --workers 1`
pinned to the server CPU and `skiff bench --json` pinned to the client CPU (two machines
modelled), median of --repeat runs:

  page cache, ordinary     file:F,direct=off                    reads through the page cache
  page cache, direct       file:F,direct=off,cache=C  --direct-reads
  O_DIRECT, ordinary       file:F                               every read from the device
  O_DIRECT, direct         file:F,cache=C             --direct-reads

Then a working set twice the cache (cache = half the file), random reads with direct reads:
how many hit, how many fault, and what a fault costs.

    python3 bench/odafs.py                          # 1 GiB file in /var/tmp, QD 1 and 32
    python3 bench/odafs.py --size 256M --runtime 5s --repeat 3

Writes every record as JSON and a Markdown table; the file is created once and removed at
the end (unless --keep).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def wait_port(port):
    for _ in range(400):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"odafs.py: the server on port {port} did not come up")


def size_bytes(s):
    units = {"K": 10, "M": 20, "G": 30}
    return int(s[:-1]) << units[s[-1].upper()] if s[-1].upper() in units else int(s)


def run(args, port, export_opts, bench_opts):
    serve = ["taskset", "-c", args.server_cpu, args.skiff, "serve", "--listen", f"127.0.0.1:{port}",
             "--export", f"vol=file:{args.file}{export_opts}", "--workers", "1"]
    bench = ["taskset", "-c", args.client_cpu, args.skiff, "bench", "--target", f"127.0.0.1:{port}",
             "--export", "vol", "--bs", "4k", "--duration", args.runtime, "--json", "--warm"] + bench_opts
    server = subprocess.Popen(serve, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        out = subprocess.run(bench, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"odafs.py: {' '.join(bench)} failed:\n{out.stderr}")
        return json.loads(out.stdout)
    finally:
        server.terminate()
        server.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--file", default="/var/tmp/skiff-odafs.img")
    p.add_argument("--size", default="1G", help="file size (default %(default)s)")
    p.add_argument("--qds", default="1,32", help="queue depths (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--runtime", default="8s", help="timed phase per run (the second pass)")
    p.add_argument("--server-cpu", default="1")
    p.add_argument("--client-cpu", default="0")
    p.add_argument("--keep", action="store_true", help="keep the file afterwards")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    total = size_bytes(args.size)
    if not os.path.exists(args.file) or os.path.getsize(args.file) != total:
        print(f"writing {args.size} of random data to {args.file} ...", flush=True)
        subprocess.run(["dd", "if=/dev/urandom", f"of={args.file}", "bs=1M", f"count={total >> 20}",
                        "status=none"], check=True)
    # A set-associative cache needs headroom to hold the whole file without conflicts.
    cache_all = (total * 5 // 4) >> 20
    cache_half = (total // 2) >> 20
    qds = [int(q) for q in args.qds.split(",")]
    cases = [
        ("page cache, ordinary", ",direct=off", []),
        ("page cache, direct", f",direct=off,cache={cache_all}M", ["--direct-reads"]),
        ("O_DIRECT, ordinary", "", []),
        ("O_DIRECT, direct", f",cache={cache_all}M", ["--direct-reads"]),
    ]
    print(f"placement: server on CPU {args.server_cpu}, client on CPU {args.client_cpu} (taskset); "
          f"median of {args.repeat}; {args.runtime} timed after a warm pass over {args.size}", flush=True)
    results, port = {}, 19000 + os.getpid() % 1000
    for rep in range(args.repeat):
        for qd in qds:
            for name, export_opts, bench_opts in cases:
                port += 1
                r = run(args, port, export_opts, ["--rw", "read", "--qd", str(qd)] + bench_opts)
                results.setdefault((name, qd), []).append(r)
                print(f"rep {rep + 1} QD {qd} {name}: mean {r['lat_us']['mean']:.1f} µs, p99 {r['lat_us']['p99']:.1f}, "
                      f"{r['iops']:,.0f} IOPS, server {r['server_cpu_us_per_io']:.2f} µs CPU/read, "
                      f"{r['direct_reads']:,} direct, {r['direct_faults']:,} faults", flush=True)
            port += 1
            r = run(args, port, f",cache={cache_half}M", ["--rw", "randread", "--qd", str(qd), "--direct-reads"])
            results.setdefault(("working set 2x cache, direct", qd), []).append(r)
            print(f"rep {rep + 1} QD {qd} working set 2x cache: mean {r['lat_us']['mean']:.1f} µs, "
                  f"{r['direct_reads']:,} direct, {r['direct_faults']:,} faults of {r['ios']:,}", flush=True)

    def med(key, f):
        return statistics.median(f(r) for r in results[key])

    print(f"\n| case (server CPU {args.server_cpu}, client CPU {args.client_cpu}, median of {args.repeat}) | QD "
          "| mean µs | p99 µs | IOPS | server CPU µs/read | client CPU µs/read | direct share | fault share |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (name, qd) in results:
        key = (name, qd)
        print(f"| {name} | {qd} | {med(key, lambda r: r['lat_us']['mean']):.1f} | {med(key, lambda r: r['lat_us']['p99']):.1f} "
              f"| {med(key, lambda r: r['iops']):,.0f} | {med(key, lambda r: r['server_cpu_us_per_io']):.2f} "
              f"| {med(key, lambda r: r['client_cpu_us_per_io']):.2f} "
              f"| {med(key, lambda r: r['direct_reads'] / max(r['ios'], 1)):.1%} "
              f"| {med(key, lambda r: r['direct_faults'] / max(r['ios'], 1)):.1%} |")
    comparisons = [("page cache", "through the page cache", " (aims: x0.75 or less, x0.70 or less)"),
                   ("O_DIRECT", "from the device (O_DIRECT)", "")]
    for qd in qds:
        for backing, words, aims in comparisons:
            base, fast = (f"{backing}, ordinary", qd), (f"{backing}, direct", qd)
            if base in results and fast in results:
                lat = med(fast, lambda r: r['lat_us']['mean']) / med(base, lambda r: r['lat_us']['mean'])
                cpu = med(fast, lambda r: r['server_cpu_us_per_io']) / med(base, lambda r: r['server_cpu_us_per_io'])
                print(f"QD {qd}: direct reads of cached data against ordinary reads {words}: "
                      f"response time x{lat:.2f}, target CPU per read x{cpu:.2f}{aims}")
        mixed = ("working set 2x cache, direct", qd)
        hit = ("O_DIRECT, direct", qd)
        miss = ("O_DIRECT, ordinary", qd)
        if mixed in results and hit in results and miss in results:
            h = med(mixed, lambda r: r['direct_reads'] / max(r['ios'], 1))
            f = med(mixed, lambda r: r['direct_faults'] / max(r['ios'], 1))
            m = med(mixed, lambda r: r['lat_us']['mean'])
            cost = (m - h * med(hit, lambda r: r['lat_us']['mean']) - (1 - h) * med(miss, lambda r: r['lat_us']['mean'])) / f \
                if f > 0 else float('nan')
            print(f"QD {qd}: working set twice the cache: {h:.0%} of reads direct, {f:.0%} faulted; a fault costs about "
                  f"{cost:.1f} µs over an ordinary read (mean latency {m:.1f} µs)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, time.strftime("odafs-%Y%m%d-%H%M%S.json"))
    with open(path, "w") as f:
        json.dump({"placement": {"server_cpus": args.server_cpu, "client_cpus": args.client_cpu},
                   "file_bytes": total, "runs": {f"{n} qd{q}": v for (n, q), v in results.items()}}, f, indent=1)
    print(f"\nrecords: {path}")
    if not args.keep:
        os.unlink(args.file)


if __name__ == "__main__":
    main()
