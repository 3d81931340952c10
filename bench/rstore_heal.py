#!/usr/bin/env python3
"""RStore heals (issue 32): repair time and rate, foreground IOPS during a rebuild, and what the
map-epoch checks cost a 4 KiB read.

Starts a one-member etcd on loopback and two memory servers (`skiff serve --pool`, one worker
each), a namespace of --size with two replicas (4 MiB chunks, so every chunk has a copy on
each server), filled once with 1 MiB writes. Then:

  partial   file pools: server B is killed (SIGKILL), --writes 4 KiB random writes land at
            500 a second while it is away, B comes back on its address with its file; the
            time from its restart until `skiff ns status` says healthy, and the bytes the
            source copied (its dirty regions) and compared (the other regions, with
            --repair-verify on, the default).
  partial-unverified  the same with --repair-verify false: only the dirty regions are read.
  full      RAM pools: B is killed and comes back empty (another incarnation): every chunk is
            copied whole.
  load      RAM pools, the default --rebuild-rate (100 MiB/s): 4 KiB random reads at QD 32 for
            --runtime seconds while B's copies are rebuilt, beside the same reads with both
            servers whole (the peer, in the same run, alternating).
  epochs    one server, one replica, RAM, filled: 4 KiB random reads at QD 1 and QD 32 with this
            build against --old (a build from before map epochs), alternating.

Repairs run at --rebuild-rate 0 (no bound) for partial and full, so the figure is the
mechanism's. Placement: the servers under `taskset -c 1`, the clients under `taskset -c 0`;
etcd unpinned. Median of --repeat runs.

    python3 bench/rstore_heal.py [--size 1G] [--repeat 3] [--old /var/tmp/old-target/release/skiff]

Writes bench/results/rstore-heal-<timestamp>.json and prints Markdown tables.
"""
import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import free_port, median_record, parse_bench_args, stop  # noqa: E402
from rstore import coordinator, ns, wait_servers  # noqa: E402


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def serve(a, skiff, pool, port, rate, verify=True):
    extra = [] if verify else ["--repair-verify", "false"]
    return subprocess.Popen(
        a.pl.server([skiff, "serve", "--listen", f"127.0.0.1:{port}", "--workers", "1", "--pool", pool,
                     "--chunk", "4M", "--coordinator", a.url, "--lease", "3s", "--rebuild-rate", rate, *extra]),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def bench(a, skiff, name, *args):
    argv = a.pl.client([skiff, "bench", "--namespace", name, "--coordinator", a.url, "--json", *args])
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"skiff bench {' '.join(args)}: {p.stderr[-800:]}")
    r = json.loads(p.stdout)
    if r.get("io_errors"):
        raise RuntimeError(f"skiff bench {' '.join(args)}: {r['io_errors']} I/O errors")
    return r


def status(a, name):
    return json.loads(ns(a, "status", name, "--json"))


def wait_health(a, name, want, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = status(a, name)
        if s["health"] == want:
            return s
        time.sleep(0.05)
    raise RuntimeError(f"{name} never {want}: {s}")


def copied(s):
    return sum(x["bytes"] for x in s["sources"]), sum(x["chunks"] for x in s["sources"])


def verified(s):
    return sum(x.get("verified", 0) for x in s["sources"]), sum(x.get("mismatched", 0) for x in s["sources"])


@contextlib.contextmanager
def pair(a, scope, rate, scratch, verify=True):
    """Two memory servers of `scope` and a namespace of a.size over both, two replicas, filled.
    Yields (servers, ports, pools) to kill and restart B (index 1)."""
    ports = [free_port(), free_port()]
    if scope == "file":
        pools = []
        for i in range(2):
            path = os.path.join(scratch, f"pool{i}")
            with open(path, "wb") as f:
                f.truncate(a.size_bytes + (64 << 20))
            pools.append(f"file:{path}")
    else:
        pools = [f"ram:{a.size_bytes + (64 << 20)}"] * 2
    servers = [serve(a, a.skiff, pools[i], ports[i], rate, verify) for i in range(2)]
    try:
        wait_servers(a, 2)
        ns(a, "create", "h", "--size", a.size, "--chunk", "4M", "--replicas", "2", "--scope", scope)
        ns(a, "alloc", "h", a.size)
        fill = max(3, a.size_bytes // (400 << 20))
        bench(a, a.skiff, "h", "--rw", "write", "--bs", "1M", "--qd", "4", "--duration", f"{fill}s")
        yield servers, ports, pools
    finally:
        for s in servers:
            stop(s)
        with contextlib.suppress(Exception):
            ns(a, "delete", "h")
        wait_servers(a, 0)


def kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def repair(a, scope, scratch, verify=True):
    """Kill B, write a little (partial) or nothing (full) meanwhile, restart it; time the repair.
    `verify`: whether partial repairs compare the regions they do not copy."""
    with pair(a, scope, "0", scratch, verify) as (servers, ports, pools):
        kill(servers[1])
        if scope == "file":
            bench(a, a.skiff, "h", "--rw", "randwrite", "--bs", "4k", "--qd", "1", "--rate", "500",
                  "--duration", f"{a.writes / 500:.1f}s")
        else:
            # A write makes the client mark B's copies stale (else the leader does once its
            # lease lapses): one 4 KiB write is enough, and leaves every chunk to copy in full.
            bench(a, a.skiff, "h", "--rw", "randwrite", "--bs", "4k", "--qd", "1", "--rate", "100",
                  "--duration", "0.2s")
        before = status(a, "h")
        t0 = time.time()
        servers[1] = serve(a, a.skiff, pools[1], ports[1], "0", verify)
        s = wait_health(a, "h", "healthy")
        secs = time.time() - t0
        bytes_, chunks = copied(s)
        compared, mismatched = verified(s)
        stale = sum(1 for c in before["copies"] if c["state"] == "stale")
        return {"scope": scope, "verify": verify, "stale_copies": stale, "chunks": chunks, "bytes_copied": bytes_,
                "bytes_compared": compared, "regions_mismatched": mismatched,
                "seconds": secs, "mib_per_s": bytes_ / (1 << 20) / secs if secs else 0}


def load(a, scratch):
    """4 KiB random reads at QD 32 during a rebuild at the default rate, beside the same with
    both servers whole; alternating."""
    out = {"whole": [], "rebuilding": []}
    with pair(a, "ram", a.rate, scratch) as (servers, ports, pools):
        for rep in range(a.repeat):
            r = bench(a, a.skiff, "h", "--rw", "randread", "--bs", "4k", "--qd", "32", "--duration", f"{a.runtime}s")
            out["whole"].append({"iops": r["iops"], "server_cpu_us_per_io": r["server_cpu_us_per_io"]})
            kill(servers[1])
            bench(a, a.skiff, "h", "--rw", "randwrite", "--bs", "4k", "--qd", "1", "--rate", "100",
                  "--duration", "0.2s")
            servers[1] = serve(a, a.skiff, pools[1], ports[1], a.rate)
            wait_health(a, "h", "rebuilding", timeout=60)
            r = bench(a, a.skiff, "h", "--rw", "randread", "--bs", "4k", "--qd", "32", "--duration", f"{a.runtime}s")
            s = status(a, "h")
            out["rebuilding"].append({"iops": r["iops"], "server_cpu_us_per_io": r["server_cpu_us_per_io"],
                                      "still_rebuilding": s["health"] == "rebuilding"})
            log(f"load rep {rep + 1}: whole {out['whole'][-1]['iops']:,.0f} IOPS, "
                f"rebuilding {out['rebuilding'][-1]['iops']:,.0f} IOPS ({s['health']} at the end)")
            wait_health(a, "h", "healthy")
    return {k: median_record(v) for k, v in out.items()}, out


def epochs(a):
    """4 KiB random reads, QD 1 and 32, this build against --old, alternating."""
    runs = {}
    for rep in range(a.repeat):
        for label, skiff in [("new", a.skiff), ("old", a.old)]:
            port = free_port()
            server = serve(a, skiff, "ram:1G", port, "0") if label == "new" else subprocess.Popen(
                a.pl.server([skiff, "serve", "--listen", f"127.0.0.1:{port}", "--workers", "1", "--pool", "ram:1G",
                             "--chunk", "4M", "--coordinator", a.url]),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_servers(a, 1)
                subprocess.run([skiff, "ns", "--coordinator", a.url, "create", "e", "--size", "512M", "--chunk", "4M"],
                               check=True, capture_output=True)
                subprocess.run([skiff, "ns", "--coordinator", a.url, "alloc", "e", "512M"], check=True,
                               capture_output=True)
                bench(a, skiff, "e", "--rw", "write", "--bs", "1M", "--qd", "4", "--duration", "2s")
                for qd in (1, 32):
                    r = bench(a, skiff, "e", "--rw", "randread", "--bs", "4k", "--qd", str(qd),
                              "--duration", f"{a.runtime}s")
                    rec = {"iops": r["iops"], "lat_mean_us": r["lat_us"]["mean"],
                           "client_cpu_us_per_io": r["client_cpu_us_per_io"],
                           "server_cpu_us_per_io": r["server_cpu_us_per_io"]}
                    runs.setdefault((label, qd), []).append(rec)
                    log(f"epochs rep {rep + 1} {label} qd {qd}: {rec['iops']:,.0f} IOPS, "
                        f"server {rec['server_cpu_us_per_io']:.2f} us/IO")
                subprocess.run([skiff, "ns", "--coordinator", a.url, "delete", "e"], check=True, capture_output=True)
            finally:
                stop(server)
                wait_servers(a, 0)
    return {f"{k[0]}-qd{k[1]}": median_record(v) for k, v in runs.items()}, {f"{k[0]}-qd{k[1]}": v for k, v in runs.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--size", default="1G")
    p.add_argument("--writes", type=int, default=1000, help="4 KiB writes while B is away (partial)")
    p.add_argument("--runtime", type=int, default=5)
    p.add_argument("--rate", default="100M", help="--rebuild-rate for the load run (the default)")
    p.add_argument("--old", help="a build from before map epochs, for the epochs run")
    p.add_argument("--only", default="partial,partial-unverified,full,load,epochs")
    a = parse_bench_args(p)
    units = {"K": 10, "M": 20, "G": 30}
    a.size_bytes = int(a.size[:-1]) << units[a.size[-1].upper()]
    only = a.only.split(",")
    result = {"placement": a.pl.record(), "repeat": a.repeat, "size": a.size, "runtime_s": a.runtime}
    log(f"placement {a.pl.describe()}")
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch, coordinator(a, scratch):
        kinds = [(k, scope, verify) for k, scope, verify in
                 [("partial", "file", True), ("partial-unverified", "file", False), ("full", "ram", True)] if k in only]
        reps = {k: [] for k, _, _ in kinds}
        # The kinds alternate within each repetition.
        for rep in range(a.repeat):
            for kind, scope, verify in kinds:
                r = repair(a, scope, scratch, verify)
                reps[kind].append(r)
                log(f"{kind} rep {rep + 1}: {r['chunks']} chunks, {r['bytes_copied'] / (1 << 20):,.1f} MiB copied, "
                    f"{r['bytes_compared'] / (1 << 20):,.1f} MiB compared ({r['regions_mismatched']} differed) "
                    f"in {r['seconds']:.2f} s ({r['mib_per_s']:,.0f} MiB/s)")
        for kind, _, _ in kinds:
            result[kind] = {"median": median_record(reps[kind], key="seconds"), "runs": reps[kind]}
        if "load" in only:
            med, runs = load(a, scratch)
            result["load"] = {"median": med, "runs": runs}
        if "epochs" in only and a.old:
            med, runs = epochs(a)
            result["epochs"] = {"median": med, "runs": runs}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, time.strftime("rstore-heal-%Y%m%d-%H%M%S.json"))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"results: {path}\n")
    for kind in ("partial", "partial-unverified", "full"):
        if kind in result:
            m = result[kind]["median"]
            print(f"| {kind} | {m['stale_copies']} | {m['chunks']} | {m['bytes_copied'] / (1 << 20):,.1f} | "
                  f"{m['bytes_compared'] / (1 << 20):,.1f} | {m['seconds']:.2f} | {m['mib_per_s']:,.0f} |")
    if "load" in result:
        m = result["load"]["median"]
        print(f"\n| whole | {m['whole']['iops']:,.0f} | rebuilding | {m['rebuilding']['iops']:,.0f} |")
    if "epochs" in result:
        for k, m in sorted(result["epochs"]["median"].items()):
            print(f"| {k} | {m['iops']:,.0f} | {m['lat_mean_us']:.1f} | {m['client_cpu_us_per_io']:.2f} | "
                  f"{m['server_cpu_us_per_io']:.2f} |")


if __name__ == "__main__":
    main()
