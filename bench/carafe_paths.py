#!/usr/bin/env python3
"""Carafe's online exploration: Dijkstra between random vertex pairs, time against the
neighbours explored (thesis Figure 6.12a; issue 30), beside networkit's Dijkstra in memory.

Starts a one-member etcd and two memory servers, then for each R-MAT scale: `skiff carafe gen
--simple --compact --max-weight W --file G` (a weighted simple graph; ids 0..V-1, so Carafe's
and networkit's vertex ids agree), `skiff carafe import --file G`, and `skiff carafe path
--pairs N --json`: N seeded random pairs, each a Dijkstra that reads from RStore only the vertex
records and adjacency lists it visits (one 24-byte read per vertex, one read per 512 edges).
The same pairs then run through networkit's Dijkstra (one thread, the graph in its memory,
stopping at the target), which also checks every distance.

Carafe walks the pairs twice: cold (`--cold`: every pair starts with an empty cache, as the
first query on a graph does, so it pays a round trip for every 32 KiB block it touches) and
warm (one cache of up to 512 MiB over all pairs, as a session of queries on one graph works).
Figures per pair: Carafe's times, the vertices it settled, the edges it looked at and the reads
it made cold, and networkit's time. The table bins the pairs by vertices explored (decades);
the plot draws every pair. Unreachable pairs (R-MAT graphs have many isolated and sink vertices) explore
little and are kept: they are part of what a user sees.

Placement: none by default (the memory servers and the client share both cores, as an
application would); --placement apart pins the servers to core 1 and the client to core 0.

    python3 bench/carafe_paths.py                              # scale 18, 200 pairs
    python3 bench/carafe_paths.py --scales 16,20 --pairs 500

Writes bench/results/carafe-paths-<timestamp>.json (and .png when matplotlib is installed)
and prints a Markdown table.
"""
import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from carafe import application_args, carafe, run_json  # noqa: E402
from rstore import coordinator, log, memory_servers  # noqa: E402

NETWORKIT = r"""
import json, sys, time
import networkit as nk
nk.setNumberOfThreads(1)
path, pairs_file = sys.argv[1], sys.argv[2]
G = nk.graphio.EdgeListReader('\t', 0, commentPrefix='#', directed=True, continuous=True).read(path)
out = []
for a, b in json.load(open(pairs_file)):
    t = time.perf_counter()
    d = nk.distance.Dijkstra(G, a, storePaths=False, storeNodesSortedByDistance=False, target=b)
    d.run()
    seconds = time.perf_counter() - t
    dist = d.distance(b)
    out.append({"seconds": seconds, "distance": None if dist > 1e300 else dist})
print(json.dumps(out))
"""


def decade(n):
    return 0 if n < 1 else int(math.log10(n))


def run_scale(a, scale, scratch):
    edges = os.path.join(scratch, f"rmat-{scale}.txt")
    g = carafe(a, "gen", "--scale", str(scale), "--seed", str(a.seed), "--simple", "--compact",
               "--max-weight", str(a.max_weight), "--file", edges)
    carafe(a, "import", "--file", edges)
    log(f"scale {scale}: {int(g['vertices'])} vertices, {int(g['edges'])} edges; {a.pairs} pairs")
    report = carafe(a, "path", "--pairs", str(a.pairs), "--seed", str(a.seed), "--cold")
    warm = carafe(a, "path", "--pairs", str(a.pairs), "--seed", str(a.seed))
    rows = report["paths"]
    for r, w in zip(rows, warm["paths"]):
        assert (r["from"], r["to"], r["distance"]) == (w["from"], w["to"], w["distance"]), (r, w)
        r["warm_seconds"] = w["seconds"]
    pairs_file = os.path.join(scratch, "pairs.json")
    with open(pairs_file, "w") as f:
        json.dump([[r["from"], r["to"]] for r in rows], f)
    peer = run_json(a.pl.client(["python3", "-c", NETWORKIT, edges, pairs_file]), "networkit dijkstra")
    wrong = 0
    for r, n in zip(rows, peer):
        r["networkit_seconds"] = n["seconds"]
        mine, theirs = r["distance"], n["distance"]
        if (mine is None) != (theirs is None) or (mine is not None and abs(mine - theirs) > 1e-6 * max(1, theirs)):
            wrong += 1
    if wrong:
        raise RuntimeError(f"scale {scale}: {wrong} of {len(rows)} distances differ from networkit's")
    return {"scale": scale, "vertices": g["vertices"], "edges": g["edges"], "reads": report["reads"],
            "seconds": report["seconds"], "warm_seconds": warm["seconds"], "warm_reads": warm["reads"],
            "paths": rows}


def plot(path, results, a):
    if importlib.util.find_spec("matplotlib") is None:
        log("matplotlib is missing (python3 -m pip install matplotlib): no plot")
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        x = [max(1, p["vertices_explored"]) for p in r["paths"]]
        ax.scatter(x, [p["seconds"] * 1e3 for p in r["paths"]], s=10, label=f"Carafe cold, scale {r['scale']}")
        ax.scatter(x, [p["warm_seconds"] * 1e3 for p in r["paths"]], s=10, marker="^",
                   label=f"Carafe warm, scale {r['scale']}")
        ax.scatter(x, [p["networkit_seconds"] * 1e3 for p in r["paths"]], s=10, marker="x",
                   label=f"networkit in memory, scale {r['scale']}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("vertices explored (settled) by Dijkstra")
    ax.set_ylabel("time per pair, ms")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Dijkstra between random pairs ({a.pl.short()})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--scales", default="18")
    p.add_argument("--pairs", type=int, default=200)
    p.add_argument("--max-weight", type=int, default=100)
    p.add_argument("--pool", default="2G", help="what each of the two memory servers donates")
    p.add_argument("--chunk", default="4M")
    p.add_argument("--seed", type=int, default=1)
    a = application_args(p)
    results = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch, coordinator(a, scratch):
        with memory_servers(a, [f"ram:{a.pool}"] * 2):
            log(f"etcd at {a.url}; two memory servers (RAM pools of {a.pool}); placement {a.pl.describe()}")
            for scale in (int(s) for s in a.scales.split(",")):
                results.append(run_scale(a, scale, scratch))
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"carafe-paths-{time.strftime('%Y%m%d-%H%M%S')}")
    with open(base + ".json", "w") as f:
        json.dump({"placement": a.pl.describe(), "max_weight": a.max_weight, "results": results}, f, indent=1)
    png = plot(base + ".png", results, a)
    print("| scale | vertices explored | pairs | edges explored | reads, cold | Carafe cold ms | "
          "Carafe warm ms | networkit ms | cold µs per vertex | warm M edges/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        bins = {}
        for path in r["paths"]:
            bins.setdefault(decade(path["vertices_explored"]), []).append(path)
        for d in sorted(bins):
            ps = bins[d]
            med = lambda k: statistics.median(x[k] for x in ps)  # noqa: E731
            per = statistics.median(x["seconds"] / max(1, x["vertices_explored"]) for x in ps)
            rate = sum(x["edges_explored"] for x in ps) / max(1e-9, sum(x["warm_seconds"] for x in ps))
            print(f"| {r['scale']} | {10 ** d:,}-{10 ** (d + 1) - 1:,} | {len(ps)} | {med('edges_explored'):,.0f} | "
                  f"{med('reads'):,.0f} | {med('seconds') * 1e3:.2f} | {med('warm_seconds') * 1e3:.2f} | "
                  f"{med('networkit_seconds') * 1e3:.3f} | {per * 1e6:.1f} | {rate / 1e6:.1f} |")
    print("\nMedians per bin; warm M edges/s is the bin's edges explored over its warm time.")
    log(f"wrote {base}.json" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
