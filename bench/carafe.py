#!/usr/bin/env python3
"""Carafe PageRank and SSSP against Spark (GraphX) and networkit on one core, in the same run
(thesis Figure 6.12b; issue 30).

Starts a one-member etcd and two memory servers (`skiff serve --pool ram:SIZE`), then for each
R-MAT scale: `skiff carafe gen --simple --compact --file G` (Graph500's generator, seeded, with
self loops and repeated edges dropped so that every system holds the same simple graph), and
for each repetition, the systems in an order that rotates from one repetition to the next:

  carafe-W     `skiff carafe import --file G`, then `skiff carafe pagerank --workers W` (W
               partition worker processes, supersteps on the board, messages through the
               mailbox in RStore) and `skiff carafe sssp --source 0`
  spark-W      bench/spark_peers.py: Spark in local mode with W executor cores; GraphX's
               PageRank and shortest paths where it can run them (the JSON says which engine)
  networkit-1  networkit's PageRank (sinks distributed, the same iterations, no tolerance
               stop) and BFS, one thread

PageRank runs --iterations updates (32, as the figure) with damping 0.85 on every system, and
the ranks of each system are checked against Carafe's (largest difference per vertex).
Figures: time to import (Carafe: read, build and store the graph; Spark: read and build the
graph, materialised; networkit: read), time per superstep (PageRank's compute time divided by
its iterations), and SSSP's total. Spark's JVM start is reported apart and left out.

Placement: none by default (every system gets both cores; Carafe's memory servers share them
with its workers, as Spark's executors share the machine with its driver). --placement apart
pins the memory servers to core 1 and everything else to core 0.

GraphX needs minutes per run from scale 20 on (about 70 s to load a scale-20 graph and 12 s
an iteration on this VM), so --spark-scales limits the scales Spark runs at, and
--spark-iterations runs fewer PageRank iterations there: its time per superstep is then the
mean over those iterations (the JSON's `iterations` says how many each system ran), and its
ranks are not compared.

    python3 bench/carafe.py                                  # scales 16, 18, 20; W = 1, 2, 4
    python3 bench/carafe.py --scales 16 --workers 1,2 --repeat 1 --no-spark
    python3 bench/carafe.py --scales 20,21 --spark-scales 20 --spark-workers 2 --spark-iterations 4

Writes bench/results/carafe-<timestamp>.json (and .png: time per superstep and to import, by
scale, when matplotlib is installed) and prints a Markdown table.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import Placement, median_record, parse_bench_args  # noqa: E402
from carafe_reference import read_values as ranks  # noqa: E402
from rstore import coordinator, log, memory_servers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

NETWORKIT = r"""
import json, sys, time
t0 = time.time()
import networkit as nk
nk.setNumberOfThreads(1)
path, iterations, damping, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
t = time.time()
G = nk.graphio.EdgeListReader('\t', 0, commentPrefix='#', directed=True, continuous=True).read(path)
load = time.time() - t
t = time.time()
pr = nk.centrality.PageRank(G, damp=damping, tol=0.0, distributeSinks=nk.centrality.SinkHandling.DistributeSinks)
pr.maxIterations = iterations
pr.run()
compute = time.time() - t
t = time.time()
bfs = nk.distance.BFS(G, 0, storePaths=False)
bfs.run()
sssp = time.time() - t
with open(out, "w") as f:
    for v, r in enumerate(pr.scores()):
        f.write(f"{v}\t{r!r}\n")
print(json.dumps({"load_s": load, "compute_s": compute, "iterations": pr.numberOfIterations(),
                  "per_superstep_s": compute / max(1, pr.numberOfIterations()), "sssp_s": sssp,
                  "vertices": G.numberOfNodes(), "edges": G.numberOfEdges()}))
"""


def application_args(p):
    """parse_bench_args with placement none unless --placement is given: an application
    benchmark gives every system the machine (the module's docs)."""
    a = parse_bench_args(p)
    if a.placement == "apart" and "--placement" not in sys.argv:
        a.placement = "none"
        a.server_cpu = a.client_cpu = None
        a.pl = Placement.from_args(a)
    a.skiff = os.path.abspath(a.skiff)
    return a


def run_json(argv, what, timeout=3600):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{what}: {p.stderr.strip()[-800:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def carafe(a, *args):
    return run_json(a.pl.client([a.skiff, "carafe", "--coordinator", a.url, "--chunk", a.chunk, "--json",
                                 "--name", "bench", *args]), f"skiff carafe {' '.join(args)}")


def max_diff(mine, theirs):
    if sorted(mine) != sorted(theirs):
        return float("inf")
    return max(abs(mine[k] - theirs[k]) for k in mine)


def run_carafe(a, edges, w, scratch):
    imp = carafe(a, "import", "--file", edges)
    out = os.path.join(scratch, f"carafe-{w}.txt")
    pr = carafe(a, "pagerank", "--workers", str(w), "--iterations", str(a.iterations), "--out", out)
    ss = carafe(a, "sssp", "--workers", str(w), "--source", "0")
    return {"import_s": imp["seconds"], "load_s": pr["load_s"], "compute_s": pr["compute_s"],
            "iterations": a.iterations, "per_superstep_s": pr["compute_s"] / a.iterations,
            "pagerank_s": pr["seconds"],
            "sssp_s": ss["seconds"], "sssp_supersteps": ss["supersteps"], "messages": pr["messages"],
            "mail_bytes": pr["mail_bytes"], "worker_compute_s": pr["worker_compute_s"],
            "worker_inbox_s": pr["worker_inbox_s"], "worker_outbox_s": pr["worker_outbox_s"],
            "worker_wait_s": pr["worker_wait_s"], "ranks": out}


def run_spark(a, edges, w, scratch):
    out = os.path.join(scratch, f"spark-{w}.txt")
    base = ["python3", os.path.join(HERE, "spark_peers.py")]
    iterations = a.spark_iterations or a.iterations
    pr = run_json(a.pl.client(base + ["pagerank", "--edges", edges, "--cores", str(w), "--iterations",
                                      str(iterations), "--damping", "0.85", "--out", out]), "spark pagerank")
    ss = run_json(a.pl.client(base + ["sssp", "--edges", edges, "--cores", str(w), "--source", "0"]), "spark sssp")
    return {"engine": pr.get("engine"), "import_s": pr["load_s"], "compute_s": pr["compute_s"],
            "iterations": iterations, "per_superstep_s": pr["compute_s"] / iterations, "startup_s": pr.get("startup_s"),
            "pagerank_s": pr["total_s"], "sssp_s": ss["compute_s"], "sssp_engine": ss.get("engine"), "ranks": out}


def run_networkit(a, edges, scratch):
    out = os.path.join(scratch, "networkit.txt")
    r = run_json(a.pl.client(["python3", "-c", NETWORKIT, edges, str(a.iterations), "0.85", out]), "networkit")
    return {"import_s": r["load_s"], "compute_s": r["compute_s"], "iterations": r["iterations"],
            "per_superstep_s": r["per_superstep_s"],
            "sssp_s": r["sssp_s"], "ranks": out}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--scales", default="16,18,20")
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--iterations", type=int, default=32)
    p.add_argument("--pool", default="2G", help="what each of the two memory servers donates")
    p.add_argument("--chunk", default="4M")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-spark", action="store_true")
    p.add_argument("--spark-scales", help="the scales Spark runs at (default: all of --scales)")
    p.add_argument("--spark-workers", help="Spark's executor core counts (default: --workers)")
    p.add_argument("--spark-iterations", type=int,
                   help="PageRank iterations for Spark (default: --iterations); ranks are then not compared")
    p.add_argument("--no-networkit", action="store_true")
    a = application_args(p)
    scales = [int(s) for s in a.scales.split(",")]
    counts = [int(w) for w in a.workers.split(",")]
    spark_scales = scales if a.spark_scales is None else [int(s) for s in a.spark_scales.split(",")]
    base_systems = [f"carafe-{w}" for w in counts] + ([] if a.no_networkit else ["networkit-1"])
    spark_counts = counts if a.spark_workers is None else [int(w) for w in a.spark_workers.split(",")]
    spark_systems = [] if a.no_spark else [f"spark-{w}" for w in spark_counts]
    runs = {}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch, coordinator(a, scratch):
        with memory_servers(a, [f"ram:{a.pool}"] * 2):
            log(f"etcd at {a.url}; two memory servers (RAM pools of {a.pool}); placement {a.pl.describe()}")
            for scale in scales:
                edges = os.path.join(scratch, f"rmat-{scale}.txt")
                g = carafe(a, "gen", "--scale", str(scale), "--seed", str(a.seed), "--simple", "--compact",
                           "--file", edges)
                log(f"scale {scale}: {int(g['vertices'])} vertices, {int(g['edges'])} edges")
                systems = base_systems[:len(counts)] + (spark_systems if scale in spark_scales else []) \
                    + base_systems[len(counts):]
                reps = {s: [] for s in systems}
                for rep in range(a.repeat):
                    order = systems[rep % len(systems):] + systems[:rep % len(systems)]
                    for s in order:
                        kind, w = s.rsplit("-", 1)
                        t = time.time()
                        if kind == "carafe":
                            r = run_carafe(a, edges, int(w), scratch)
                        elif kind == "spark":
                            r = run_spark(a, edges, int(w), scratch)
                        else:
                            r = run_networkit(a, edges, scratch)
                        reference = os.path.join(scratch, f"carafe-{counts[0]}.txt")
                        if (os.path.exists(reference) and r["ranks"] != reference
                                and r["iterations"] == a.iterations):
                            r["rank_max_diff"] = max_diff(ranks(reference), ranks(r["ranks"]))
                        del r["ranks"]
                        reps[s].append(r)
                        log(f"  scale {scale} rep {rep + 1} {s}: import {r['import_s']:.2f} s, "
                            f"{r['per_superstep_s'] * 1e3:.1f} ms/superstep, sssp {r['sssp_s']:.2f} s "
                            f"({time.time() - t:.0f} s)")
                for s in systems:
                    runs[f"{scale}/{s}"] = {"scale": scale, "system": s, "vertices": g["vertices"],
                                            "edges": g["edges"], "reps": reps[s],
                                            "median": median_record(reps[s], key="compute_s")}
    os.makedirs(a.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(a.out, f"carafe-{stamp}.json")
    png = plot(path[:-len(".json")] + ".png", runs, a)
    with open(path, "w") as f:
        json.dump({"placement": a.pl.describe(), "iterations": a.iterations, "runs": runs}, f, indent=1)
    print(f"| scale | vertices | edges | system | import s | ms / superstep | PageRank s (iterations) "
          f"| SSSP s | ranks: largest difference from Carafe's |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in runs.values():
        m = r["median"]
        diff = m.get("rank_max_diff")
        print(f"| {r['scale']} | {int(r['vertices']):,} | {int(r['edges']):,} | {r['system']} | {m['import_s']:.2f} "
              f"| {m['per_superstep_s'] * 1e3:.1f} | {m['compute_s']:.2f} ({int(m['iterations'])}) | {m['sssp_s']:.2f} "
              f"| {'' if diff is None else f'{diff:.1e}'} |")
    log(f"wrote {path}" + (f" and {png}" if png else ""))


def plot(path, runs, a):
    """Time per superstep and time to import against scale, a line per system (log scale)."""
    if importlib.util.find_spec("matplotlib") is None:
        log("matplotlib is missing (python3 -m pip install matplotlib): no plot")
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in dict.fromkeys(r["system"] for r in runs.values()):
        points = sorted((r["scale"], r["median"]) for r in runs.values() if r["system"] == system)
        x = [s for s, _ in points]
        axes[0].plot(x, [m["per_superstep_s"] * 1e3 for _, m in points], marker="o", label=system)
        axes[1].plot(x, [m["import_s"] for _, m in points], marker="o", label=system)
    for ax, what in zip(axes, ["PageRank, ms per superstep", "import, s"]):
        ax.set_yscale("log")
        ax.set_xlabel("R-MAT scale (2^scale vertex ids, 16 edges each)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Carafe, GraphX and networkit ({a.pl.short()}, median of {a.repeat})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()
