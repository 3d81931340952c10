#!/usr/bin/env python3
"""An RStore namespace striped over 1, 2 and 4 memory servers (i10 Figure 9, RStore's aggregate;
with --scopes ram,flash also FlashNet's flash namespaces beside DRAM ones, thesis Figure 7.3).

Starts a one-member etcd on loopback, then for each server count N and each scope of --scopes:
N `skiff serve --pool SPEC --coordinator URL` processes (each its own port; ram:--pool, or for
flash a thin volume of --pool on an array of its own, `--flash DEV --flash-cache
--flash-cache --pool flash:--pool`, the array a sparse file in the scratch directory), a
namespace of that scope reserved and allocated over all of them and filled once with
`--verify` (so that no read meets a page never written), and `skiff bench --namespace` from
one initiator process, the scopes alternating within each repetition:

  4k-randread   4 KiB random reads, --threads T x --qd 32 (each thread a lane to every server)
  1m-read       1 MiB sequential reads, --threads T x --qd 4
  4k-randwrite  4 KiB random writes, --threads T x --qd 32
  1m-write      1 MiB sequential writes, --threads T x --qd 4

A flash namespace larger than the page pool reads and writes through it to the array's device
(a file on this VM's virtual disk, opened O_DIRECT).

IOPS, bandwidth and CPU per I/O (the initiator's, and all servers' summed), median of --repeat
runs. Placement models two machines by default: every server under `taskset -c 1`, the
initiator under `taskset -c 0`; with 2 cores all servers share one, so the figure shows how
the striping behaves, not what N machines would give (docs/RSTORE.md says what it predicts).

    python3 bench/rstore.py                       # N = 1, 2, 4; 3 runs of 3 s each
    python3 bench/rstore.py --servers 1,2 --threads 2 --repeat 5
    python3 bench/rstore.py --control              # control-path costs against the data path's
    python3 bench/rstore.py --scopes ram,flash --pool 1G --flash-cache 256M
    python3 bench/rstore.py --sync-ab --pool 1G    # a flash pool plain against `,sync`

With --control each server count runs `skiff ns costs` instead: create, reserve, alloc, init,
map and the first read of a scratch namespace of 64 MiB, 256 MiB and 512 MiB, each timed once
in one process, beside the mean 4 KiB read on the data path (RStore's point: setup is paid once).

With --sync-ab one memory server donates a flash pool of --pool, served plain and with `,sync`
(every write on flash before it is acknowledged, so that the pool survives kill -9) by turns:
the same array and port, restarted cleanly between turns (a clean stop keeps the pool and its
chunks), one namespace filled once; the write workloads and a 4 KiB write at QD 1 at each turn.

Writes bench/results/rstore-<timestamp>.json (or rstore-control-…, rstore-sync-…; and .png)
and prints a Markdown table.
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import Placement, add_placement_args, free_port, median_record, stop  # noqa: E402


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def start_etcd(scratch):
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen(["etcd", "--name", "bench", "--data-dir", os.path.join(scratch, "etcd"),
                             "--listen-client-urls", url, "--advertise-client-urls", url,
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"bench=http://127.0.0.1:{peer}",
                             # As a deployment would: old revisions compacted away, so that runs
                             # that write many records do not slow the next ones.
                             "--auto-compaction-mode", "revision", "--auto-compaction-retention", "1000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, url


def ns(a, *args):
    p = subprocess.run([a.skiff, "ns", "--coordinator", a.url, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"skiff ns {' '.join(args)}: {p.stderr.strip()}")
    return p.stdout


def wait_etcd(a):
    deadline = time.time() + 30
    while True:
        try:
            ns(a, "list")
            return
        except RuntimeError:
            if time.time() > deadline:
                raise SystemExit("etcd never answered")
            time.sleep(0.1)


def wait_servers(a, n):
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if len(json.loads(ns(a, "servers", "--json"))) == n:
                return
        except (RuntimeError, json.JSONDecodeError):
            pass
        time.sleep(0.1)
    raise SystemExit(f"{n} memory servers never registered")


def start_server(a, pool):
    """One memory server (`skiff serve --pool POOL`, or with the serve arguments `pool` when it
    is a list) on a port of its own, pinned as a server."""
    args = ["--pool", pool] if isinstance(pool, str) else pool
    return subprocess.Popen(
        a.pl.server([a.skiff, "serve", "--listen", f"127.0.0.1:{free_port()}", "--workers", "1",
                     *args, "--chunk", a.chunk, "--coordinator", a.url]),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def flash_array(a, scratch, name, size, cache, device_bytes=None):
    """The serve arguments of an array of its own for a flash pool of `size`: a sparse file in
    `scratch`, formatted, of `device_bytes` (default: twice the pool and 256 MiB, room for the
    whole pool written and the collector's), with a page pool of `cache`."""
    dev = os.path.join(scratch, f"{name}.img")
    with open(dev, "wb") as f:
        f.truncate(device_bytes or 2 * parse_size(size) + (256 << 20))
    subprocess.run([a.skiff, "flash", "format", dev, "--force"], check=True, capture_output=True)
    return ["--flash", dev, "--flash-cache", cache]


def flash_pool(a, scratch, name, size, cache, device_bytes=None):
    """The serve arguments of a memory server donating a thin volume of `size` of an array of
    its own ([`flash_array`])."""
    return flash_array(a, scratch, name, size, cache, device_bytes) + ["--pool", f"flash:{size}"]


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def pools(a, scratch, scope, n, size):
    """The pool specs of n memory servers of `scope`, each donating `size`."""
    if scope == "ram":
        return [f"ram:{size}"] * n
    if scope == "flash":
        return [flash_pool(a, scratch, f"n{n}-{i}", size, a.flash_cache) for i in range(n)]
    raise SystemExit(f"--scopes {scope}: ram or flash")


@contextlib.contextmanager
def coordinator(a, scratch):
    """A one-member etcd with its data in `scratch`, answering, its URL in a.url; stopped after."""
    etcd, a.url = start_etcd(scratch)
    try:
        wait_etcd(a)
        yield
    finally:
        stop(etcd)


@contextlib.contextmanager
def memory_servers(a, pools):
    """A memory server per pool spec, registered, as their processes; stopped after, and
    their registrations gone."""
    servers = []
    try:
        for pool in pools:
            servers.append(start_server(a, pool))
        wait_servers(a, len(pools))
        yield servers
    finally:
        for s in servers:
            stop(s)
        wait_servers(a, 0)


def bench(a, name, rw, bs, qd):
    argv = a.pl.client([a.skiff, "bench", "--namespace", name, "--coordinator", a.url, "--rw", rw, "--bs", bs,
                        "--qd", str(qd), "--threads", str(a.threads), "--duration", f"{a.runtime}s", "--json"])
    p = subprocess.run(argv, capture_output=True, text=True, timeout=a.runtime + 60)
    if p.returncode != 0:
        raise RuntimeError(f"skiff bench --namespace {name} {rw} {bs}: {p.stderr[-500:]}")
    r = json.loads(p.stdout)
    return {"iops": r["iops"], "bytes_per_s": r["bytes_per_s"], "lat_mean_us": r["lat_us"]["mean"],
            "client_cpu_us_per_io": r["client_cpu_us_per_io"], "server_cpu_us_per_io": r["server_cpu_us_per_io"]}


WORKLOADS = [("4k-randread", "randread", "4k", 32), ("1m-read", "read", "1M", 4),
             ("4k-randwrite", "randwrite", "4k", 32), ("1m-write", "write", "1M", 4)]


def fill(a, name):
    """Write every byte of namespace `name` once (skiff bench --verify's fill, then its check)."""
    argv = [a.skiff, "bench", "--namespace", name, "--coordinator", a.url, "--rw", "write", "--bs", "1M",
            "--qd", "4", "--duration", "1s", "--verify", "--json"]
    p = subprocess.run(a.pl.client(argv), capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"filling {name}: {p.stderr[-500:]}")


def plot(path, counts, scopes, med, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot (python3 -m pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.5))
    labels = ["IOPS (4 KiB random reads)", "MB/s (1 MiB sequential reads)", "IOPS (4 KiB random writes)",
              "MB/s (1 MiB sequential writes)"]
    for ax, (w, _, bs, _), label in zip(axes, WORKLOADS, labels):
        key = "iops" if bs == "4k" else "bytes_per_s"
        for scope in scopes:
            ys = [med[(scope, w, n)][key] / (1e6 if key == "bytes_per_s" else 1) for n in counts]
            ax.plot(counts, ys, marker="o", label=scope)
        ax.legend()
        ax.set_xticks(counts)
        ax.set_xlabel("memory servers")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


CONTROL_SIZES = ["64M", "256M", "512M"]


def costs(a, size):
    """`skiff ns costs` once; a pool short of chunks still being zeroed is waited for."""
    for _ in range(50):
        try:
            return json.loads(ns(a, "costs", "--size", size, "--chunk", a.chunk, "--json"))["us"]
        except RuntimeError as e:
            if "being zeroed" not in str(e):
                raise
            time.sleep(0.2)
    raise SystemExit("the pools never had the chunks back")


def control(a, counts):
    """The control path's costs at each server count and size; prints a table."""
    runs = {}
    for n in counts:
        with memory_servers(a, [f"ram:{a.pool}"] * n):
            for size in CONTROL_SIZES:
                for rep in range(a.repeat):
                    r = costs(a, size)
                    runs.setdefault((n, size), []).append(r)
                    log(f"{n} server(s) {size:>5} rep {rep + 1}/{a.repeat}: " +
                        ", ".join(f"{k} {v:,.0f} us" for k, v in r.items()))
    return {k: median_record(v, key="reserve") for k, v in runs.items()}, runs


def save(a, kind, points):
    """The data path's records, with how they were measured, in --out/KIND-<timestamp>.json;
    returns that path without `.json`."""
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}")
    with open(base + ".json", "w") as f:
        json.dump({"placement": a.pl.record(), "repeat": a.repeat, "runtime_s": a.runtime, "threads": a.threads,
                   "pool": a.pool, "chunk": a.chunk, "flash_cache": a.flash_cache, "filled": True,
                   "points": points}, f, indent=1)
    return base


SYNC_WORKLOADS = [("4k-randwrite", "randwrite", "4k", 32), ("1m-write", "write", "1M", 4),
                  ("4k-randwrite-qd1", "randwrite", "4k", 1)]


def sync_ab(a, scratch):
    """A flash pool plain and `,sync` by turns (--sync-ab); returns the runs by (mode, workload)."""
    port = free_port()
    array = flash_array(a, scratch, "ab", a.pool, a.flash_cache)
    runs = {}
    made = False
    for rep in range(a.repeat):
        for mode in ["flash", "flash-sync"]:
            pool = f"flash:{a.pool}" + (",sync" if mode == "flash-sync" else "")
            argv = [a.skiff, "serve", "--listen", f"127.0.0.1:{port}", "--workers", "1", *array, "--pool", pool,
                    "--chunk", a.chunk, "--coordinator", a.url]
            server = subprocess.Popen(a.pl.server(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_servers(a, 1)
                if not made:
                    ns(a, "create", "sync-ab", "--size", a.pool, "--chunk", a.chunk, "--scope", "flash")
                    ns(a, "alloc", "sync-ab", a.pool)
                    fill(a, "sync-ab")
                    made = True
                for w, rw, bs, qd in SYNC_WORKLOADS:
                    r = bench(a, "sync-ab", rw, bs, qd)
                    runs.setdefault((mode, w), []).append(r)
                    log(f"{mode:<10} {w:<16} rep {rep + 1}/{a.repeat}: {r['iops']:>9,.0f} IOPS "
                        f"{r['bytes_per_s'] / 1e6:8.1f} MB/s  mean {r['lat_mean_us']:7.1f} us  CPU us/IO "
                        f"{r['client_cpu_us_per_io']:.2f} + {r['server_cpu_us_per_io']:.2f}")
            finally:
                # A clean stop: the pool keeps its chunks (and incarnation) for the next turn. It
                # writes back the dirty page pool first, which may take a while.
                stop(server, timeout=300)
                wait_servers(a, 0)
    return runs


def sync_report(a, runs):
    med = {k: median_record(v) for k, v in runs.items()}
    base = save(a, "rstore-sync", [{"mode": m, "workload": w, **med[(m, w)], "repetitions": runs[(m, w)]}
                                   for (m, w) in runs])
    print(f"A flash pool plain and ,sync, one memory server, one initiator ({a.threads} thread(s); "
          f"{a.pl.short()}, median of {a.repeat}, the modes alternating); {base}.json")
    print()
    print("| workload | mode | IOPS | MB/s | mean µs | CPU µs/I/O initiator | server |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for w, _, _, _ in SYNC_WORKLOADS:
        for m in ["flash", "flash-sync"]:
            r = med[(m, w)]
            print(f"| {w} | {m} | {r['iops']:,.0f} | {r['bytes_per_s'] / 1e6:,.1f} | {r['lat_mean_us']:.1f} | "
                  f"{r['client_cpu_us_per_io']:.2f} | {r['server_cpu_us_per_io']:.2f} |")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--servers", default="1,2,4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runtime", type=int, default=3)
    p.add_argument("--pool", default="1G", help="what each memory server donates")
    p.add_argument("--scopes", default="ram", help="ram, flash, or both (ram,flash), alternating")
    p.add_argument("--flash-cache", default="256M", help="each flash server's page pool")
    p.add_argument("--chunk", default="4M")
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--control", action="store_true", help="control-path costs (skiff ns costs) instead")
    p.add_argument("--sync-ab", action="store_true", help="a flash pool plain against ,sync instead")
    add_placement_args(p, "runs per point (default 3)")
    a = p.parse_args()
    a.repeat = a.repeat or 3
    a.pl = Placement.from_args(a)
    a.skiff = os.path.abspath(a.skiff)
    counts = [int(n) for n in a.servers.split(",")]
    runs = {}
    if a.control:
        with tempfile.TemporaryDirectory() as scratch, coordinator(a, scratch):
            med, raw = control(a, counts)
        os.makedirs(a.out, exist_ok=True)
        base = os.path.join(a.out, f"rstore-control-{time.strftime('%Y%m%d-%H%M%S')}")
        with open(base + ".json", "w") as f:
            json.dump({"placement": a.pl.record(), "repeat": a.repeat, "chunk": a.chunk,
                       "points": [{"servers": n, "size": sz, "us": med[(n, sz)], "repetitions": raw[(n, sz)]}
                                  for (n, sz) in med]}, f, indent=1)
        order = ["create_ns", "reserve", "alloc", "init (lookup and place)", "map (a lane to each server)",
                 "first 4 KiB read", "4 KiB read, data path (mean)", "free", "delete_ns (release everything)"]
        steps = [k for k in order if k in next(iter(med.values()))]
        print(f"Control path against data path, µs, one process ({a.pl.short()}, median of {a.repeat}); {base}.json")
        print()
        print("| servers | size | " + " | ".join(steps) + " |")
        print("|---:|---:|" + "---:|" * len(steps))
        for (n, sz), r in med.items():
            print(f"| {n} | {sz} | " + " | ".join(f"{r[k]:,.0f}" if r[k] >= 10 else f"{r[k]:.1f}" for k in steps) + " |")
        return 0
    if a.sync_ab:
        with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch, coordinator(a, scratch):
            log(f"etcd at {a.url}; placement {a.pl.describe()}; {a.threads} initiator thread(s)")
            runs = sync_ab(a, scratch)
        return sync_report(a, runs)
    scopes = a.scopes.split(",")
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch, coordinator(a, scratch):
        log(f"etcd at {a.url}; placement {a.pl.describe()}; {a.threads} initiator thread(s); scopes {scopes}")
        for n in counts:
            size = f"{n * int(a.pool[:-1])}{a.pool[-1]}"
            specs = [spec for scope in scopes for spec in pools(a, scratch, scope, n, a.pool)]
            with memory_servers(a, specs):
                for scope in scopes:
                    name = f"fig9-{scope}-{n}"
                    ns(a, "create", name, "--size", size, "--chunk", a.chunk, "--scope", scope)
                    ns(a, "alloc", name, size)
                    fill(a, name)
                for rep in range(a.repeat):
                    for w, rw, bs, qd in WORKLOADS:
                        for scope in scopes:
                            r = bench(a, f"fig9-{scope}-{n}", rw, bs, qd)
                            runs.setdefault((scope, w, n), []).append(r)
                            log(f"{n} server(s) {scope:<5} {w:<12} rep {rep + 1}/{a.repeat}: {r['iops']:>9,.0f} IOPS "
                                f"{r['bytes_per_s'] / 1e6:8.1f} MB/s  CPU µs/IO {r['client_cpu_us_per_io']:.2f} + "
                                f"{r['server_cpu_us_per_io']:.2f}")
                for scope in scopes:
                    ns(a, "delete", f"fig9-{scope}-{n}")
    med = {k: median_record(v) for k, v in runs.items()}
    base = save(a, "rstore", [{"scope": sc, "workload": w, "servers": n, **med[(sc, w, n)],
                               "repetitions": runs[(sc, w, n)]} for (sc, w, n) in runs])
    title = (f"RStore namespace over N memory servers, one initiator ({a.threads} thread(s); "
             f"{a.pl.short()}, median of {a.repeat})")
    png = plot(base + ".png", counts, scopes, med, title)
    print(f"{title}; {base}.json" + (f", {png}" if png else ""))
    print()
    print("| servers | scope | workload | IOPS | MB/s | mean µs | CPU µs/I/O initiator | servers (sum) |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for n in counts:
        for w, _, _, _ in WORKLOADS:
            for scope in scopes:
                r = med[(scope, w, n)]
                print(f"| {n} | {scope} | {w} | {r['iops']:,.0f} | {r['bytes_per_s'] / 1e6:,.1f} | "
                      f"{r['lat_mean_us']:.1f} | {r['client_cpu_us_per_io']:.2f} | {r['server_cpu_us_per_io']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
