#!/usr/bin/env python3
"""Hybrid polling at low queue depth: skiff with --poll off, hybrid and adaptive against nbdkit.

Every skiff run starts `skiff serve --workers 1 --poll MODE` and `skiff bench --poll MODE` (the
same mode on both sides); nbdkit (`memory 1G`) is driven by fio's nbd engine, its volume
written once first (compare.py's precondition). 4 KiB random reads at each queue depth, the
systems alternating within every round, median of --repeat rounds per cell.

Placements (one or more, in one invocation): apart (server CPU 1, client CPU 0: two machines
modelled, the default), same (both on CPU 0) and none (unpinned). Latency is submission to
completion on both clients (skiff bench's mean; fio's `lat`, not `clat`). CPU per I/O: skiff
from bench's JSON (its lane threads, and the target's threads from STATS), nbdkit from
/proc/PID/stat and fio's own usr+sys.

    python3 bench/polling.py                              # apart, QD 1/32/128, 3 rounds of 5 s
    python3 bench/polling.py --placements apart,same,none --qds 1,32,128
    python3 bench/polling.py --qds 1 --rate 2000          # a light open-loop load: 2000 I/Os a second
    python3 bench/polling.py --modes off,adaptive --qds 1,8,32,128 --threads 4,16,64 --no-nbdkit
                                                          # should adaptive be the default? QD and threads

With --threads LIST each listed count of client threads runs too, each thread keeping one read
outstanding on a shared lane (`skiff bench --threads T --qd 1 --shared-lane`): rows "T thr".
The target's 1 GiB RAM volume is filled by a sequential write before every skiff run is measured.

With --rate both clients start that many I/Os a second (skiff bench --rate, fio --rate_iops)
instead of keeping the queue full: the case where a fixed spin burns CPU for nothing.
Writes bench/results/polling-<time>.json and a plot beside it, and prints Markdown tables.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402  (shared placement, server and fio helpers)

MODES = ["off", "hybrid", "adaptive"]

# A point of the sweep: (queue depth, client threads); threads 1 is the plain queue-depth run.


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run_skiff(a, pl, mode, qd, threads=1):
    rate = ["--rate", str(a.rate)] if a.rate else []
    many = ["--threads", str(threads), "--shared-lane"] if threads > 1 else []
    port = compare.free_port()
    server = compare.Server(pl.server([a.skiff, "serve", "--listen", f"127.0.0.1:{port}", "--workers", "1",
                                       "--export", "vol=ram:1G", "--poll", mode]), port)
    target = ["--target", f"127.0.0.1:{port}", "--export", "vol"]
    try:
        # A RAM volume never written reads the kernel's zero page: fill it first.
        subprocess.run(pl.client([a.skiff, "bench", *target, "--rw", "write", "--bs", "1M", "--qd", "8",
                                  "--duration", "2s"]), check=True, capture_output=True)
        out = subprocess.run(pl.client([a.skiff, "bench", *target, "--rw", "randread", "--qd", str(qd),
                                        "--duration", f"{a.runtime}s", "--poll", mode, "--json", *rate, *many]),
                             check=True, capture_output=True, text=True).stdout
    finally:
        server.stop()
    r = json.loads(out)
    return {
        "iops": r["iops"],
        "lat_mean_us": r["lat_us"]["mean"],
        "lat_p99_us": r["lat_us"]["p99"],
        "client_cpu_us_per_io": r["client_cpu_us_per_io"],
        "server_cpu_us_per_io": r["server_cpu_us_per_io"],
        "client_ctx_per_io": r["client_ctx_switches_per_io"],
        "server_ctx_per_io": r["server_ctx_switches_per_io"],
        "client_poll": r["client_poll"],
        "server_poll": r["server_poll"],
    }


class FioArgs:
    """What compare.run_fio reads from its argument namespace."""

    def __init__(self, pl, runtime):
        self.pl, self.bs, self.runtime = pl, "4k", runtime


def run_nbdkit(a, pl, qd):
    extra = [f"--rate_iops={a.rate}"] if a.rate else []
    r = compare.run_fio("nbdkit", FioArgs(pl, a.runtime), "randread", qd, None, extra)
    r["lat_mean_us"] = r.pop("lat_submit_mean_us")  # submission to completion, like skiff bench
    return r


def systems_of(a):
    return [f"skiff:{m}" for m in a.modes] + ([] if a.no_nbdkit else ["nbdkit"])


def points_of(a):
    """The sweep's points: (QD, 1) for each QD, then (1, T) for each thread count."""
    return [(q, 1) for q in a.qds] + [(1, t) for t in a.threads]


def label(point):
    qd, threads = point
    return f"{threads} thr" if threads > 1 else str(qd)


def measure(a, placements):
    records = []
    systems = systems_of(a)
    total = len(placements) * len(points_of(a)) * a.repeat * len(systems)
    done = 0
    for pl in placements:
        for qd, threads in points_of(a):
            for rnd in range(a.repeat):
                for system in compare.rotate(systems, rnd):
                    if system == "nbdkit" and threads > 1:
                        continue
                    done += 1
                    log(f"[{done}/{total}] {pl.mode}: {system} QD {qd} x {threads} threads, round {rnd + 1}")
                    if system == "nbdkit":
                        r = run_nbdkit(a, pl, qd)
                    else:
                        r = run_skiff(a, pl, system.split(":")[1], qd, threads)
                    r.update(system=system, qd=qd, threads=threads, round=rnd, placement=pl.mode,
                             where=pl.describe())
                    records.append(r)
    return records


def cells(records):
    """(placement, system, qd) -> the median record of its rounds."""
    groups = {}
    for r in records:
        groups.setdefault((r["placement"], r["system"], (r["qd"], r.get("threads", 1))), []).append(r)
    return {k: compare.median_record(v) for k, v in groups.items()}


def table(records, placement, a):
    c = cells(records)
    where = next(r["where"] for r in records if r["placement"] == placement)
    load = f"; open loop, {a.rate:,} I/Os a second" if a.rate else ""
    out = [f"### {where}; median of {a.repeat}, {a.runtime} s per run{load}", "",
           "| QD | system | IOPS | mean µs | CPU µs/I/O client + server | total | × nbdkit CPU | × skiff:off CPU |",
           "|---:|---|---:|---:|---|---:|---:|---:|"]
    for point in points_of(a):
        peer = c.get((placement, "nbdkit", point))
        off = c.get((placement, "skiff:off", point))
        total = lambda r: r["client_cpu_us_per_io"] + r["server_cpu_us_per_io"]  # noqa: E731
        for system in systems_of(a):
            r = c.get((placement, system, point))
            if r is None:
                continue
            cpu = total(r)
            out.append(f"| {label(point)} | {system} | {r['iops']:,.0f} | {r['lat_mean_us']:.1f} | "
                       f"{r['client_cpu_us_per_io']:.2f} + {r['server_cpu_us_per_io']:.2f} | {cpu:.2f} | "
                       f"{f'{cpu / total(peer):.2f}' if peer else ''} | {f'{cpu / total(off):.2f}' if off else ''} |")
    return "\n".join(out)


def plot(records, placements, a, path):
    if importlib.util.find_spec("matplotlib") is None:
        log("matplotlib is missing (python3 -m pip install matplotlib): no plot")
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = cells(records)
    systems = systems_of(a)
    points = points_of(a)
    fig, axes = plt.subplots(2, len(placements), figsize=(5.5 * len(placements), 7), squeeze=False)
    for col, pl in enumerate(placements):
        for row, (key, ylabel) in enumerate([("lat", "mean latency µs (log)"), ("cpu", "CPU µs per I/O, total (log)")]):
            ax = axes[row][col]
            width = 0.8 / len(systems)
            for i, s in enumerate(systems):
                ys = []
                for point in points:
                    r = c.get((pl.mode, s, point))
                    if r is None:
                        ys.append(0)
                    elif key == "lat":
                        ys.append(r["lat_mean_us"])
                    else:
                        ys.append(r["client_cpu_us_per_io"] + r["server_cpu_us_per_io"])
                ax.bar([j + i * width for j in range(len(points))], ys, width, label=s)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))],
                          [f"QD {label(p)}" if p[1] == 1 else label(p) for p in points])
            ax.set_yscale("log")
            ax.set_ylabel(ylabel)
            ax.set_title(pl.short())
            ax.grid(alpha=0.3, axis="y")
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    fig.suptitle(f"4 KiB random reads, median of {a.repeat}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--placements", default="apart", help="comma-separated: apart, same, none")
    p.add_argument("--qds", default="1,32,128")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--runtime", type=int, default=5, help="seconds per run")
    p.add_argument("--rate", type=int, help="I/Os per second each client starts (open loop); default: a full queue")
    p.add_argument("--modes", default=",".join(MODES), help="the poll modes to run (off, hybrid, adaptive)")
    p.add_argument("--threads", default="", help="client thread counts, each thread one read outstanding on a "
                   "shared lane (4,16,64)")
    p.add_argument("--no-nbdkit", action="store_true", help="skiff's modes only")
    p.add_argument("--out", default="bench/results")
    a = p.parse_args()
    a.qds = [int(q) for q in a.qds.split(",")]
    a.modes = a.modes.split(",")
    a.threads = [int(t) for t in a.threads.split(",") if t]
    placements = []
    for mode in a.placements.split(","):
        ns = argparse.Namespace(placement=mode, server_cpu=None, client_cpu=None)
        placements.append(compare.Placement.from_args(ns))
    records = measure(a, placements)
    os.makedirs(a.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(a.out, f"polling-{stamp}.json")
    with open(path, "w") as f:
        json.dump({"command": " ".join(sys.argv), "repeat": a.repeat, "runtime_s": a.runtime, "rate": a.rate,
                   "placements": [pl.record() for pl in placements], "records": records}, f, indent=1)
    for pl in placements:
        print(table(records, pl.mode, a))
        print()
    made = plot(records, placements, a, os.path.join(a.out, f"polling-{stamp}.png"))
    log(f"records: {path}" + (f"; plot: {made}" if made else ""))


if __name__ == "__main__":
    main()
