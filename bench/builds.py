#!/usr/bin/env python3
"""Two skiff builds against each other: did a change make the native path faster or slower?

Each run starts `skiff serve --workers 1` with a fresh RAM export pinned to the server CPU and
`skiff bench --target ... --json` pinned to the client CPU (two machines modelled, as in
compare.py), for every workload, the two builds alternating and their order swapping every
repetition. Prints each run, then a Markdown table of medians; writes every record as JSON.

    python3 bench/builds.py --before /tmp/old/target/release/skiff --after target/release/skiff
    python3 bench/builds.py --before A --after B --workloads randread:128,randread:1 --repeat 5

The volume is fresh (never written) in every run unless `--fill` writes it first (through
the NBD listener, with fio, untimed), so without it reads hit pages the kernel has not
allocated and writes pay for first touch. `--protocol nbd` drives the target's NBD front end
with fio's nbd engine (libnbd) instead of skiff bench, and takes the server's CPU from
/proc/PID/stat; `--export SPEC` serves something other than a RAM volume (a `file:` path).

    python3 bench/builds.py --before A --after B --protocol nbd --fill --workloads randread:32,randwrite:32
    python3 bench/builds.py --before A --after B --protocol nbd --export file:/var/tmp/vol.img --fill

`--flash ARRAY` serves volume `v` of a flash array instead (made, and filled, by the caller:
`skiff flash format`, then `skiff vol create v` and a write of it through a target), with
`--flash-cache` for its page pool; each run warms the pool by reading the whole volume once
(untimed) unless `--cold`. A workload may name its block size and client threads,
RW:QD:BS:THREADS, `--direct-reads` reads under the volume's extent, and `--fua` makes every write
synchronous (it completes once durable):

    python3 bench/builds.py --before A --after B --flash /var/tmp/array.img --flash-cache 1088M \
        --size 1G --direct-reads --workloads randread:1:4k:32,randread:1:1M:1,randread:1:8M:1
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
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"builds.py: the server on port {port} did not come up")


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid):
    """User + system CPU seconds of every thread of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def fio_nbd(args, uri, rw, qd, runtime, bs="4k", jobs=1):
    """fio's nbd engine: `jobs` jobs of `qd` requests of `bs` each (one NBD connection a job),
    reported as one group."""
    cmd = ["taskset", "-c", args.client_cpu, "fio", "--name=b", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}",
           f"--bs={bs}", f"--iodepth={qd}", f"--numjobs={jobs}", "--group_reporting", f"--size={args.size}",
           "--output-format=json"]
    if runtime:
        cmd += [f"--runtime={runtime}", "--time_based"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{"):])["jobs"][0]


def one(binary, rw, qd, bs, threads, args, port):
    nbd_port = port + 1000
    name = "v" if args.flash else "vol"
    if args.flash:
        served = ["--flash", args.flash, "--flash-cache", args.flash_cache, "--io-max", "32M"]
    else:
        served = ["--export", f"vol={args.export or f'ram:{args.size}'}"]
    serve = ["taskset", "-c", args.server_cpu, binary, "serve", "--listen", f"127.0.0.1:{port}",
             "--nbd", f"127.0.0.1:{nbd_port}", *served, "--workers", "1"]
    bench = ["taskset", "-c", args.client_cpu, binary, "bench", "--target", f"127.0.0.1:{port}",
             "--export", name, "--rw", rw, "--qd", str(qd), "--bs", bs, "--threads", str(threads),
             "--size", args.size, "--duration", args.runtime, "--json"]
    if args.direct_reads:
        bench.append("--direct-reads")
    if args.fua:
        bench.append("--fua")
    uri = f"nbd://127.0.0.1:{nbd_port}/{name}"
    server = subprocess.Popen(serve, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        wait_port(nbd_port)
        if args.fill:
            fio_nbd(args, uri, "write", 8, None, bs="1M")
        if args.flash and not args.cold:
            # The pool holds the volume before the run, as a busy target's would.
            subprocess.run(["taskset", "-c", args.client_cpu, binary, "bench", "--target", f"127.0.0.1:{port}",
                            "--export", name, "--rw", "read", "--bs", "1M", "--qd", "8", "--size", args.size,
                            "--duration", "1ms", "--warm", "--json"], capture_output=True, check=True)
        if args.protocol == "native":
            return json.loads(subprocess.run(bench, capture_output=True, text=True, check=True).stdout)
        cpu0 = cpu_s(server.pid)
        job = fio_nbd(args, uri, rw, qd, args.runtime.rstrip("s"), bs, threads)
        server_s = cpu_s(server.pid) - cpu0
        side = job["read"] if job["read"]["io_bytes"] > 0 else job["write"]
        ios = job["read"]["total_ios"] + job["write"]["total_ios"]
        runtime_s = side["runtime"] / 1000.0
        client = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * runtime_s * 1e6 / ios
        server_us = server_s * 1e6 / ios
        return {"iops": ios / runtime_s, "client_cpu_us_per_io": client, "server_cpu_us_per_io": server_us,
                "total_cpu_us_per_io": client + server_us,
                "lat_us": {"mean": side["clat_ns"]["mean"] / 1000,
                           "p99": side["clat_ns"]["percentile"]["99.000000"] / 1000}}
    finally:
        server.terminate()
        server.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="the skiff binary before the change")
    p.add_argument("--after", required=True, help="the skiff binary after the change")
    p.add_argument("--workloads", default="randread:128,randwrite:128,randread:32,randread:1",
                   help="RW:QD,... (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="runs per build and workload (median reported)")
    p.add_argument("--runtime", default="5s")
    p.add_argument("--size", default="1G", help="RAM export size, and the region fio covers")
    p.add_argument("--export", help="export SPEC instead of ram:SIZE (e.g. file:/var/tmp/vol.img)")
    p.add_argument("--protocol", choices=["native", "nbd"], default="native",
                   help="skiff bench over the native protocol, or fio's nbd engine over NBD")
    p.add_argument("--fill", action="store_true", help="write the whole volume first, untimed")
    p.add_argument("--flash", metavar="ARRAY", help="serve volume v of this flash array (made and filled by the caller)")
    p.add_argument("--flash-cache", default="1088M", help="the array's page pool (with --flash)")
    p.add_argument("--cold", action="store_true", help="with --flash, do not warm the pool before each run")
    p.add_argument("--direct-reads", action="store_true", help="skiff bench --direct-reads")
    p.add_argument("--fua", action="store_true",
                   help="skiff bench --fua: every write completes once durable (synchronous writes)")
    p.add_argument("--server-cpu", default="1")
    p.add_argument("--client-cpu", default="0")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    builds = {"before": args.before, "after": args.after}
    for b in builds.values():
        if not os.access(b, os.X_OK):
            sys.exit(f"builds.py: {b} is not an executable")
    workloads = []
    for w in args.workloads.split(","):
        f = w.split(":") + ["4k", "1"][max(0, len(w.split(":")) - 2):]
        workloads.append((f[0], int(f[1]), f[2], int(f[3])))
    client = "skiff bench, native" if args.protocol == "native" else "fio nbd engine, NBD"
    print(f"placement: server on CPU {args.server_cpu}, client on CPU {args.client_cpu} (taskset); "
          f"{args.repeat} repetitions, builds alternating; {args.runtime} per run; {client}; "
          f"export {('flash volume v of ' + args.flash) if args.flash else args.export or 'ram:' + args.size}, "
          f"{'filled' if args.fill or args.flash else 'never written'}", flush=True)

    results, port = {}, 17000 + os.getpid() % 2000
    for rep in range(args.repeat):
        for rw, qd, bs, threads in workloads:
            order = list(builds.items())
            if rep % 2:
                order.reverse()
            for name, binary in order:
                port += 1
                r = one(binary, rw, qd, bs, threads, args, port)
                results.setdefault((rw, qd, bs, threads, name), []).append(r)
                print(f"rep {rep + 1}/{args.repeat} {rw} QD {qd} {bs} x{threads} {name}: {r['iops']:,.0f} IOPS, "
                      f"{r['total_cpu_us_per_io']:.2f} µs CPU/I/O, mean {r['lat_us']['mean']:.1f} µs", flush=True)

    def med(w, name, f):
        return statistics.median(f(r) for r in results[(*w, name)])

    print(f"\n| workload (server CPU {args.server_cpu}, client CPU {args.client_cpu}, median of {args.repeat}) "
          "| before IOPS | after IOPS | after / before | CPU µs/I/O before (client + server) | after | mean µs before | after "
          "| p99 µs before | after |")
    print("|---|---:|---:|---:|---|---|---:|---:|---:|---:|")
    for w in workloads:
        rw, qd, bs, threads = w
        iops = [med(w, n, lambda r: r["iops"]) for n in builds]
        cpu = [f'{med(w, n, lambda r: r["total_cpu_us_per_io"]):.2f} '
               f'({med(w, n, lambda r: r["client_cpu_us_per_io"]):.2f} + '
               f'{med(w, n, lambda r: r["server_cpu_us_per_io"]):.2f})' for n in builds]
        lat = [med(w, n, lambda r: r["lat_us"]["mean"]) for n in builds]
        # Records from before fio's percentiles were kept carry none.
        p99 = [f'{med(w, n, lambda r: r["lat_us"]["p99"]):.1f}' if "p99" in results[(*w, n)][0]["lat_us"] else "-"
               for n in builds]
        label = f"{rw} QD {qd}" + (f" {bs} x{threads}" if (bs, threads) != ("4k", 1) else "")
        print(f"| {label} | {iops[0]:,.0f} | {iops[1]:,.0f} | {iops[1] / iops[0]:.2f} | {cpu[0]} | {cpu[1]} "
              f"| {lat[0]:.1f} | {lat[1]:.1f} | {p99[0]} | {p99[1]} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, time.strftime("builds-%Y%m%d-%H%M%S.json"))
    with open(path, "w") as f:
        json.dump({"builds": builds, "protocol": args.protocol,
                   "export": f"flash:{args.flash}" if args.flash else args.export or f"ram:{args.size}",
                   "filled": args.fill, "placement": {"server_cpus": args.server_cpu, "client_cpus": args.client_cpu},
                   "runs": {f"{rw} qd{qd} {bs} x{t} {n}": v for (rw, qd, bs, t, n), v in results.items()}}, f, indent=1)
    print(f"\nrecords: {path}")


if __name__ == "__main__":
    main()
