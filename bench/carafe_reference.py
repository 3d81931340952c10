#!/usr/bin/env python3
"""Carafe's results against independent implementations on the same edge list.

    python3 bench/carafe_reference.py pagerank --edges G.txt --values PR.txt --iterations 32 [--damping 0.85]
    python3 bench/carafe_reference.py sssp --edges G.txt --values D.txt --source ID
    python3 bench/carafe_reference.py paths --edges G.txt --paths PATH.json

The edge list is SNAP's text format (`src dst [weight]`, `#` comments); the values are what
`skiff carafe pagerank|sssp --out` writes (`external-id value`, `inf` for unreached); the paths
are `skiff carafe path --json`'s output.

- pagerank: a power iteration in pure Python with Carafe's semantics (uniform start,
  `iterations` updates, rank on vertices without out-edges spread over all, repeated edges
  counted, self loops kept) must agree within 1e-9 per vertex; and igraph's PageRank (PRPACK,
  converged, directed, the same damping) within `damping^iterations` times a small factor in
  L1, since a fixed number of iterations stops short of convergence by about that much.
- sssp: igraph's distances from the source (weights when the file has them) must be equal,
  unreachable vertices included.
- paths: igraph's shortest-path length for each pair must equal Carafe's.

Prints one JSON object (the comparison's figures) and exits 1 when any check fails.
"""
import argparse
import json
import math
import sys

sys.dont_write_bytecode = True


def read_edges(path):
    edges, weighted = [], False
    with open(path) as f:
        for line in f:
            t = line.strip()
            if not t or t[0] in "#%":
                continue
            parts = t.split()
            w = float(parts[2]) if len(parts) > 2 else 1.0
            weighted |= len(parts) > 2
            edges.append((int(parts[0]), int(parts[1]), w))
    return edges, weighted


def read_values(path):
    out = {}
    with open(path) as f:
        for line in f:
            k, v = line.split()
            out[int(k)] = math.inf if v == "inf" else float(v)
    return out


def graph(edges):
    import igraph
    ids = sorted({e[0] for e in edges} | {e[1] for e in edges})
    index = {x: i for i, x in enumerate(ids)}
    g = igraph.Graph(n=len(ids), edges=[(index[s], index[d]) for s, d, _ in edges], directed=True)
    g.es["weight"] = [w for _, _, w in edges]
    return g, ids, index


def power_iteration(edges, ids, index, damping, iterations):
    n = len(ids)
    out_deg = [0] * n
    for s, _, _ in edges:
        out_deg[index[s]] += 1
    arcs = [(index[s], index[d]) for s, d, _ in edges]
    rank = [1.0 / n] * n
    for _ in range(iterations):
        dangling = sum(r for r, d in zip(rank, out_deg) if d == 0)
        incoming = [0.0] * n
        for s, d in arcs:
            incoming[d] += rank[s] / out_deg[s]
        rank = [(1 - damping) / n + damping * (incoming[v] + dangling / n) for v in range(n)]
    return rank


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["pagerank", "sssp", "paths"])
    p.add_argument("--edges", required=True)
    p.add_argument("--values")
    p.add_argument("--paths")
    p.add_argument("--iterations", type=int, default=32)
    p.add_argument("--damping", type=float, default=0.85)
    p.add_argument("--source", type=int)
    a = p.parse_args()
    edges, weighted = read_edges(a.edges)
    g, ids, index = graph(edges)
    result = {"check": a.what, "vertices": len(ids), "edges": len(edges)}
    ok = True
    if a.what == "pagerank":
        carafe = read_values(a.values)
        ok &= sorted(carafe) == ids
        mine = power_iteration(edges, ids, index, a.damping, a.iterations)
        worst = max(abs(carafe[x] - mine[i]) for i, x in enumerate(ids))
        ref = g.pagerank(directed=True, damping=a.damping)
        l1 = sum(abs(carafe[x] - ref[i]) for i, x in enumerate(ids))
        bound = 4 * a.damping ** a.iterations
        result.update(power_iteration_max_diff=worst, igraph_l1=l1, igraph_l1_bound=bound,
                      rank_sum=sum(carafe.values()))
        ok &= worst <= 1e-9 and l1 <= bound
    elif a.what == "sssp":
        carafe = read_values(a.values)
        ok &= sorted(carafe) == ids
        ref = g.distances(source=[index[a.source]], weights="weight" if weighted else None)[0]
        wrong = [x for i, x in enumerate(ids) if carafe[x] != ref[i]]
        result.update(reached=sum(1 for d in ref if d != math.inf), wrong=len(wrong), first_wrong=wrong[:5])
        ok &= not wrong
    else:
        with open(a.paths) as f:
            paths = json.loads(f.read().strip().splitlines()[-1])["paths"]
        wrong = []
        for q in paths:
            d = g.distances(source=[index[q["from"]]], target=[index[q["to"]]], weights="weight" if weighted else None)[0][0]
            mine = math.inf if q["distance"] is None else q["distance"]
            if mine != d:
                wrong.append((q["from"], q["to"], mine, d))
        result.update(pairs=len(paths), wrong=len(wrong), first_wrong=wrong[:5])
        ok &= not wrong
    result["ok"] = bool(ok)
    print(json.dumps(result))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
