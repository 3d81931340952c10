#!/usr/bin/env python3
"""RStore's control path against size and servers (issue 32, "Scale"; thesis Figures 6.5-6.7:
reserve, alloc and map against the namespace's size and the number of memory servers).

Starts a one-member etcd on loopback, then for each server count N:

  phantom   `skiff ns phantom --servers N`: N registered memory servers that hold no data
            (each with a listening socket; chunks given back are taken as zeroed at once),
            pools sized so that the largest --sizes fits with room to spare. For each size,
            `skiff ns costs --control-only` (one replica, 4 MiB chunks): create, reserve,
            alloc, init (lookup and place), free, release and delete, each timed once in one
            process. Sizes far beyond this machine's memory: only records are made.
  real      with --real: N real `skiff serve --pool ram:--real-pool` processes, and the full
            `skiff ns costs` (map: a lane to every server; the first 4 KiB read; the mean 4 KiB
            read). The largest size is what the pools hold together (this machine has 23 GiB).
            With --scopes ram,flash also N flash memory servers (FlashNet's flash namespaces,
            thesis 7.2): each donates a thin volume of --flash-pool on an array of its own (a
            sparse file of 2 GiB), so sizes far past memory and past the devices are real chunks; RAM
            points past what the RAM pools hold are left out. The scopes alternate at each size.

Placement: the costs client under `taskset -c 0`, phantom (or real) servers under `taskset -c
1`, etcd unpinned. Each run waits until the chunks the last one gave back are zeroed (a
server zeroing its pool meets a reserve on its pool's head). Median of --repeat runs of each
point, the sizes alternating within a repetition.

    python3 bench/rstore_control.py [--servers 4,16,64,256] [--sizes 1G,16G,256G,1T] [--repeat 3]
    python3 bench/rstore_control.py --real --servers 1,2,4 --sizes 1G,4G,16G --real-pool 4G
    python3 bench/rstore_control.py --real --scopes ram,flash --servers 1,2,4 --sizes 1G,4G,64G,512G \
        --real-pool 4G --flash-pool 256G

Writes bench/results/rstore-control-scale-<timestamp>.json (and .png) and prints a Markdown
table.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import median_record, parse_bench_args, stop  # noqa: E402
from rstore import coordinator, flash_pool, memory_servers, ns  # noqa: E402

STEPS = ["create_ns", "reserve", "alloc", "init (lookup and place)", "free", "release",
         "map (a lane to each server)", "map again (cached map)", "map again (cached map, kept lanes)",
         "first 4 KiB read", "4 KiB read, data path (mean)",
         "delete_ns (release everything)"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def pools_dirty(a):
    """Chunks the pools of this phase's servers wait to be zeroed (their heads, read through
    etcd's JSON gateway)."""
    import base64
    import urllib.request
    b64 = lambda b: base64.b64encode(b).decode()
    body = json.dumps({"key": b64(b"/skiff/pools/"), "range_end": b64(b"/skiff/pools0")}).encode()
    with urllib.request.urlopen(urllib.request.Request(a.url + "/v3/kv/range", data=body), timeout=10) as r:
        kvs = json.load(r).get("kvs", [])
    if a.real:
        # Real servers are named by their endpoints: only those registered now zero.
        live = {s["id"] for s in json.loads(ns(a, "servers", "--json"))}
        mine = lambda key: key.decode()[len("/skiff/pools/"):] in live
    else:
        mine = lambda key: key.startswith(f"/skiff/pools/{a.prefix}".encode())
    return sum(json.loads(base64.b64decode(kv["value"])).get("dirty", 0) for kv in kvs
               if mine(base64.b64decode(kv["key"])))


def wait_clean(a):
    """Until every chunk given back has been zeroed: a run does not meet the last one's."""
    deadline = time.time() + 600
    while (left := pools_dirty(a)) > 0:
        if time.time() > deadline:
            raise SystemExit(f"{left} chunks never zeroed: {open(a.phantom_log).read()[-800:]}")
        time.sleep(0.2)


def costs(a, size, control_only, scope="ram"):
    wait_clean(a)
    argv = [a.skiff, "ns", "--coordinator", a.url, "costs", "--size", size, "--chunk", a.chunk, "--json",
            "--scope", scope]
    if control_only:
        argv.append("--control-only")
    for _ in range(100):
        p = subprocess.run(a.pl.client(argv), capture_output=True, text=True, timeout=3600)
        if p.returncode == 0:
            return json.loads(p.stdout)["us"]
        if "being zeroed" not in p.stderr:
            raise RuntimeError(f"skiff ns costs --size {size}: {p.stderr.strip()}")
        time.sleep(0.5)
    raise SystemExit("the pools never had their chunks back")


def phantoms(a, n, pool):
    """`skiff ns phantom` with n servers of `pool` bytes; returns once they are registered."""
    proc = subprocess.Popen(
        a.pl.server([a.skiff, "ns", "--coordinator", a.url, "phantom", "--servers", str(n), "--pool",
                     str(pool), "--chunk", a.chunk, "--prefix", f"n{n}-"]),
        stdout=subprocess.PIPE, stderr=open(a.phantom_log, "a"), text=True)
    line = proc.stdout.readline()
    if "registered" not in line:
        raise SystemExit(f"skiff ns phantom: see {a.phantom_log}")
    return proc


def point(a, n, runs, control_only, scopes=("ram",)):
    for rep in range(a.repeat):
        for size in a.sizes:
            for scope in scopes:
                if scope == "ram" and a.real and parse_size(size) > n * parse_size(a.real_pool):
                    continue
                r = costs(a, size, control_only, scope)
                runs.setdefault((scope, n, size), []).append(r)
                log(f"{n:>4} servers {scope:<5} {size:>5} rep {rep + 1}/{a.repeat}: " +
                    ", ".join(f"{k} {v / 1000:,.1f} ms" for k, v in r.items()))


def plot(path, med, counts, scopes, sizes, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot (python3 -m pip install matplotlib)")
        return None
    steps = [("reserve", "reserve (Fig. 6.5)"), ("alloc", "alloc (Fig. 6.6)"),
             ("init (lookup and place)", "init: lookup and place (Fig. 6.7)")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    xs = [parse_size(s) / (1 << 30) for s in sizes]
    for ax, (step, label) in zip(axes, steps):
        for scope in scopes:
            for n in counts:
                have = [(x, med[(scope, n, s)].get(step, 0) / 1000) for x, s in zip(xs, sizes) if (scope, n, s) in med]
                if have:
                    ax.plot(*zip(*have), marker="o", linestyle="-" if scope == "ram" else "--",
                            label=f"{n} servers" + (f", {scope}" if len(scopes) > 1 else ""))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("namespace size (GiB)")
        ax.set_ylabel("ms")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--servers", default="4,16,64,256")
    p.add_argument("--sizes", default="1G,16G,256G,1T")
    p.add_argument("--chunk", default="4M")
    p.add_argument("--real", action="store_true", help="real memory servers and the full costs, map included")
    p.add_argument("--real-pool", default="4G", help="RAM each real memory server donates")
    p.add_argument("--scopes", default="ram", help="with --real: ram, flash, or ram,flash")
    p.add_argument("--flash-pool", default="256G", help="the thin volume each real flash server donates")
    p.add_argument("--flash-cache", default="64M", help="each flash server's page pool")
    a = parse_bench_args(p)
    a.sizes = a.sizes.split(",")
    a.threads = 1
    counts = [int(n) for n in a.servers.split(",")]
    largest = max(parse_size(s) for s in a.sizes)
    chunk = parse_size(a.chunk)
    runs = {}
    scopes = a.scopes.split(",") if a.real else ["ram"]
    with tempfile.TemporaryDirectory(prefix="skiff-control-", dir="/var/tmp") as scratch, coordinator(a, scratch):
        a.phantom_log = os.path.join(scratch, "phantom.log")
        open(a.phantom_log, "w").close()
        for n in counts:
            if a.real:
                specs = [f"ram:{a.real_pool}"] * n if "ram" in scopes else []
                if "flash" in scopes:
                    specs += [flash_pool(a, scratch, f"n{n}-{i}", a.flash_pool, a.flash_cache, 2 << 30)
                              for i in range(n)]
                with memory_servers(a, specs):
                    point(a, n, runs, control_only=False, scopes=scopes)
                continue
            # Room for the largest size, a tenth more, in whole chunks.
            pool = -(-(largest * 11 // 10) // n // chunk) * chunk
            a.prefix = f"n{n}-"
            proc = phantoms(a, n, pool)
            try:
                point(a, n, runs, control_only=True)
            finally:
                stop(proc)
    med = {k: median_record(v, key="reserve") for k, v in runs.items()}
    kind = "real memory servers" if a.real else "phantom servers (no data)"
    title = f"RStore control path against size and servers: {kind}, {a.chunk} chunks, 1 replica, median of {a.repeat}"
    steps = [s for s in STEPS if any(s in m for m in med.values())]
    print(f"### {title}\n")
    print("| servers | scope | size | " + " | ".join(steps) + " |")
    print("|---:|---|---:|" + "---:|" * len(steps))
    for n in counts:
        for size in a.sizes:
            for scope in scopes:
                if (scope, n, size) not in med:
                    continue
                m = med[(scope, n, size)]
                print(f"| {n} | {scope} | {size} | " +
                      " | ".join(f"{m[s] / 1000:,.2f} ms" if s in m else "" for s in steps) + " |")
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"rstore-control-scale-{time.strftime('%Y%m%d-%H%M%S')}")
    with open(base + ".json", "w") as f:
        json.dump({"title": title, "placement": a.pl.describe() if hasattr(a.pl, "describe") else a.placement,
                   "chunk": a.chunk, "real": a.real, "scopes": scopes, "flash_pool": a.flash_pool,
                   "median": [{"scope": sc, "servers": n, "size": s, "us": m} for (sc, n, s), m in med.items()],
                   "runs": [{"scope": sc, "servers": n, "size": s, "us": r} for (sc, n, s), v in runs.items() for r in v]},
                  f, indent=1)
    png = plot(base + ".png", med, counts, scopes, a.sizes, title)
    print(f"\n{base}.json" + (f", {png}" if png else ""))


if __name__ == "__main__":
    main()
