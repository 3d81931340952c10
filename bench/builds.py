#!/usr/bin/env python3
"""Two skiff builds against each other: did a change make the native path faster or slower?

Each run starts `skiff serve --workers 1` with a fresh RAM export pinned to the server CPU and
`skiff bench --target ... --json` pinned to the client CPU (two machines modelled, as in
compare.py), for every workload, the two builds alternating and their order swapping every
repetition. Prints each run, then a Markdown table of medians; writes every record as JSON.

    python3 bench/builds.py --before /tmp/old/target/release/skiff --after target/release/skiff
    python3 bench/builds.py --before A --after B --workloads randread:128,randread:1 --repeat 5

The volume is fresh (never written) in every run, so reads hit pages the kernel has not
allocated and writes pay for first touch: compare builds with this script, and compare skiff
with its peers with compare.py, which writes each volume first.
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


def one(binary, rw, qd, args, port):
    serve = ["taskset", "-c", args.server_cpu, binary, "serve", "--listen", f"127.0.0.1:{port}",
             "--export", f"vol=ram:{args.size}", "--workers", "1"]
    bench = ["taskset", "-c", args.client_cpu, binary, "bench", "--target", f"127.0.0.1:{port}",
             "--export", "vol", "--rw", rw, "--qd", str(qd), "--duration", args.runtime, "--json"]
    server = subprocess.Popen(serve, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        return json.loads(subprocess.run(bench, capture_output=True, text=True, check=True).stdout)
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
    p.add_argument("--size", default="1G", help="RAM export size")
    p.add_argument("--server-cpu", default="1")
    p.add_argument("--client-cpu", default="0")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    builds = {"before": args.before, "after": args.after}
    for b in builds.values():
        if not os.access(b, os.X_OK):
            sys.exit(f"builds.py: {b} is not an executable")
    workloads = [(w.split(":")[0], int(w.split(":")[1])) for w in args.workloads.split(",")]
    print(f"placement: server on CPU {args.server_cpu}, client on CPU {args.client_cpu} (taskset); "
          f"{args.repeat} repetitions, builds alternating; {args.runtime} per run", flush=True)

    results, port = {}, 17000 + os.getpid() % 2000
    for rep in range(args.repeat):
        for rw, qd in workloads:
            order = list(builds.items())
            if rep % 2:
                order.reverse()
            for name, binary in order:
                port += 1
                r = one(binary, rw, qd, args, port)
                results.setdefault((rw, qd, name), []).append(r)
                print(f"rep {rep + 1}/{args.repeat} {rw} QD {qd} {name}: {r['iops']:,.0f} IOPS, "
                      f"{r['total_cpu_us_per_io']:.2f} µs CPU/I/O, mean {r['lat_us']['mean']:.1f} µs", flush=True)

    def med(rw, qd, name, f):
        return statistics.median(f(r) for r in results[(rw, qd, name)])

    print(f"\n| workload (server CPU {args.server_cpu}, client CPU {args.client_cpu}, median of {args.repeat}) "
          "| before IOPS | after IOPS | after / before | CPU µs/I/O before (client + server) | after | mean µs before | after |")
    print("|---|---:|---:|---:|---|---|---:|---:|")
    for rw, qd in workloads:
        iops = [med(rw, qd, n, lambda r: r["iops"]) for n in builds]
        cpu = [f'{med(rw, qd, n, lambda r: r["total_cpu_us_per_io"]):.2f} '
               f'({med(rw, qd, n, lambda r: r["client_cpu_us_per_io"]):.2f} + '
               f'{med(rw, qd, n, lambda r: r["server_cpu_us_per_io"]):.2f})' for n in builds]
        lat = [med(rw, qd, n, lambda r: r["lat_us"]["mean"]) for n in builds]
        print(f"| {rw} QD {qd} | {iops[0]:,.0f} | {iops[1]:,.0f} | {iops[1] / iops[0]:.2f} | {cpu[0]} | {cpu[1]} "
              f"| {lat[0]:.1f} | {lat[1]:.1f} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, time.strftime("builds-%Y%m%d-%H%M%S.json"))
    with open(path, "w") as f:
        json.dump({"builds": builds, "placement": {"server_cpus": args.server_cpu, "client_cpus": args.client_cpu},
                   "runs": {f"{rw} qd{qd} {n}": v for (rw, qd, n), v in results.items()}}, f, indent=1)
    print(f"\nrecords: {path}")


if __name__ == "__main__":
    main()
