#!/usr/bin/env python3
"""The adaptive batch controller against every static level (Tyche Figures 5 and 6), with the
target and the client pinned apart (two machines modelled) and with nothing pinned.

For each placement one `skiff serve --workers 1` with a RAM export runs (pinned to the server
CPU, or not at all), and `skiff bench --shared-lane --qd 4 --rw randread --bs 4k` sweeps the
thread counts; at every point each batching mode runs once per round, modes alternating, and
the figure is the median of --repeat rounds. The report gives each point's IOPS, the best
static level, and adaptive against it and against batching off (issue 14's aims: >= 0.9x the
best static level, >= 0.95x off), plus the controller's level, delay and throughput over time
for a few points (Tyche Figure 6).

    python3 bench/batching.py                            # 1..128 threads, 3 rounds, both placements
    python3 bench/batching.py --threads 4,16 --repeat 5 --placements apart
"""
import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time

MODES = ["off", "static:2", "static:8", "static:64", "adaptive"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def wait_port(port):
    for _ in range(400):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"batching.py: the server on port {port} did not come up")


def pin(cpu):
    return ["taskset", "-c", cpu] if cpu else []


def bench(a, port, cpu, threads, mode):
    argv = [*pin(cpu), a.skiff, "bench", "--target", f"127.0.0.1:{port}", "--export", "vol", "--shared-lane",
            "--threads", str(threads), "--qd", "4", "--rw", "randread", "--bs", "4k", "--batching", mode,
            "--duration", a.runtime, "--json"]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"batching.py: {' '.join(argv)} failed:\n{out.stderr}")
    return json.loads(out.stdout)


def sweep(a, placement, port):
    server_cpu, client_cpu = (a.server_cpu, a.client_cpu) if placement == "apart" else (None, None)
    serve = [*pin(server_cpu), a.skiff, "serve", "--listen", f"127.0.0.1:{port}", "--export", f"vol=ram:{a.size}",
             "--workers", "1"]
    server = subprocess.Popen(serve, stderr=subprocess.DEVNULL)
    records = []
    try:
        wait_port(port)
        total = len(a.threads) * a.repeat * len(MODES)
        done = 0
        for threads in a.threads:
            for rnd in range(a.repeat):
                for mode in MODES:
                    r = bench(a, port, client_cpu, threads, mode)
                    done += 1
                    log(f"[{placement} {done}/{total}] threads {threads} {mode}: {r['iops']:,.0f} IOPS")
                    records.append({"placement": placement, "threads": threads, "round": rnd, "mode": mode,
                                    "iops": r["iops"], "reqs_per_caravan": r.get("client_reqs_per_caravan"),
                                    "level_log": r.get("batch_level_log") or []})
    finally:
        server.terminate()
        server.wait()
    return records


def summarize(records, placement, threads):
    rows = []
    for t in threads:
        med = {}
        for m in MODES:
            xs = [r["iops"] for r in records if r["placement"] == placement and r["threads"] == t and r["mode"] == m]
            med[m] = statistics.median(xs) if xs else None
        statics = {m: v for m, v in med.items() if m.startswith("static") and v}
        best_mode = max(statics, key=statics.get)
        rows.append({"threads": t, **med, "best_static": best_mode,
                     "vs_best": med["adaptive"] / statics[best_mode],
                     "vs_off": med["adaptive"] / med["off"]})
    return rows


def table(rows, placement, a):
    where = (f"server on CPU {a.server_cpu}, client on CPU {a.client_cpu}" if placement == "apart"
             else "nothing pinned")
    out = [f"### {placement} ({where}; median of {a.repeat}, {a.runtime} per run)", "",
           "| threads × QD 4 | " + " | ".join(MODES) + " | best static | adaptive / best static | adaptive / off |",
           "|---:|" + "---:|" * len(MODES) + "---|---:|---:|"]
    for r in rows:
        cells = [f"{r[m] / 1e3:,.0f}K" for m in MODES]
        out.append(f"| {r['threads']} | " + " | ".join(cells) +
                   f" | {r['best_static']} | {r['vs_best']:.2f} | {r['vs_off']:.2f} |")
    return "\n".join(out)


def plot(records, rows_by_placement, a, outdir, stamp):
    if importlib.util.find_spec("matplotlib") is None:
        log("matplotlib is missing (python3 -m pip install matplotlib): no plots")
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []
    fig, axes = plt.subplots(1, len(rows_by_placement), figsize=(6 * len(rows_by_placement), 4.5), squeeze=False)
    for ax, (placement, rows) in zip(axes[0], rows_by_placement.items()):
        xs = [r["threads"] for r in rows]
        for m in MODES:
            ax.plot(xs, [r[m] / 1e3 for r in rows], marker="o", label=m, linewidth=2.5 if m == "adaptive" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("threads × 4 outstanding")
        ax.set_ylabel("kIOPS (4 KiB random reads)")
        ax.set_title(f"{placement}, median of {a.repeat}")
        ax.grid(alpha=0.3)
        ax.legend()
    path = os.path.join(outdir, f"batching-iops-{stamp}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    made.append(path)
    # Tyche Figure 6: the level over time, first round, a few points.
    fig, axes = plt.subplots(1, len(rows_by_placement), figsize=(6 * len(rows_by_placement), 4), squeeze=False)
    for ax, placement in zip(axes[0], rows_by_placement):
        for r in records:
            if r["placement"] == placement and r["mode"] == "adaptive" and r["round"] == 0 and r["threads"] in a.trace:
                log_ = r["level_log"]
                ax.step([p["ms"] / 1e3 for p in log_], [p["level"] for p in log_], where="post",
                        label=f"{r['threads']} threads")
        ax.set_yscale("log", base=2)
        ax.set_xlabel("seconds")
        ax.set_ylabel("batch level")
        ax.set_title(f"adaptive level over time, {placement}")
        ax.grid(alpha=0.3)
        ax.legend()
    path = os.path.join(outdir, f"batching-levels-{stamp}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    made.append(path)
    return made


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--threads", default="1,2,4,8,16,32,64,128")
    p.add_argument("--placements", default="apart,none", help="apart (server and client pinned apart), none")
    p.add_argument("--server-cpu", default="1")
    p.add_argument("--client-cpu", default="0")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--runtime", default="2s")
    p.add_argument("--size", default="1G")
    p.add_argument("--trace", default="4,16,128", help="thread counts whose level over time is plotted")
    p.add_argument("--out", default="bench/results")
    a = p.parse_args()
    a.threads = [int(x) for x in a.threads.split(",")]
    a.trace = [int(x) for x in a.trace.split(",")]
    placements = a.placements.split(",")
    if not os.path.exists(a.skiff):
        sys.exit(f"batching.py: {a.skiff} not found: cargo build --release -p skiff-cli")
    records = []
    for i, placement in enumerate(placements):
        records += sweep(a, placement, 7400 + i)
    rows = {pl: summarize(records, pl, a.threads) for pl in placements}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"batching-{stamp}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(a), "records": records, "summary": rows}, f, indent=1)
    plots = plot(records, rows, a, a.out, stamp)
    print("\n\n".join(table(rows[pl], pl, a) for pl in placements))
    print(f"\nrecords: {path}" + "".join(f"\nplot: {x}" for x in plots))


if __name__ == "__main__":
    main()
