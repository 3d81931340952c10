#!/usr/bin/env python3
"""RSort weak scaling (thesis Figure 6.13) against GNU sort and a single-process in-memory sort.

Starts a one-member etcd and two memory servers of each scope of --scopes (`skiff serve --pool`:
ram: RAM; file: a sparse file each; flash: a thin volume of --pool on an array of its own,
FlashNet's flash namespaces, thesis 7.4), then for W = 1, 2, 4 workers at a fixed number of
records per worker (RSort once per scope, the scopes alternating within each repetition):

  rsort        `skiff rsort gen`, then `skiff rsort sort --workers W` (W worker processes, two
               phases through RStore namespaces), then `skiff rsort check`
  gnu-sort     `LC_ALL=C sort` of the same records in a local file (`gen --file`)
  in-memory    `skiff rsort local`: the same records sorted in one process's memory
  spark        with --spark: Spark's sortByKey of the same file with W executor cores in local
               mode (bench/spark_peers.py: read, sort, write; the JVM's start left out)

--total N holds the total fixed instead (the thesis's other mode: N records at every W).

CPU per record: each sorter's user and system time (getrusage of the waited-for process and
its workers) and, for RSort, the memory servers' time over its sort too (from /proc), per
record sorted. Spark's includes its JVM start (about 10 s of CPU), which its times leave out.

Median of --repeat runs of each. Placement: servers under `taskset -c 1`, the sorters under
`taskset -c 0` (RSort's workers all share that core; GNU sort gets it alone). This machine has
two cores, so weak scaling cannot hold; the figure shows where the time goes.

    python3 bench/rsort.py                          # 200,000 records per worker, W = 1, 2, 4
    python3 bench/rsort.py --per-worker 1000000 --scopes ram,flash    # thesis 7.4: in memory and on flash
    python3 bench/rsort.py --per-worker 1000000 --spark --placement none
    python3 bench/rsort.py --total 4000000 --spark --placement none

Writes bench/results/rsort-<timestamp>.json and prints a Markdown table.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import median_record, parse_bench_args  # noqa: E402
from rstore import coordinator, flash_pool, log, memory_servers  # noqa: E402


def rsort(a, *args, scope="ram"):
    argv = a.pl.client([a.skiff, "rsort", "--coordinator", a.url, "--chunk", a.chunk, "--json",
                        "--scope", scope, *args])
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"skiff rsort {' '.join(args)}: {p.stderr.strip()}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def spark_sort(a, records_file, out, cores):
    """Spark's sortByKey of the same records with `cores` executor cores: its read, sort and
    write (JVM start apart), from bench/spark_peers.py."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spark_peers.py")
    p = subprocess.run(a.pl.client(["python3", script, "sort", "--records", records_file, "--cores", str(cores),
                                    "--out", out]), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"spark sort: {p.stderr.strip()[-800:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def timed(argv, **kw):
    t = time.time()
    subprocess.run(argv, check=True, **kw)
    return time.time() - t


def children_cpu():
    """User and system seconds of every child waited for so far (and of theirs)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def process_cpu(procs):
    """User and system seconds of running processes, from /proc/PID/stat."""
    total = 0.0
    for p in procs:
        with open(f"/proc/{p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--per-worker", type=int, default=200_000, help="records per worker (100 bytes each)")
    p.add_argument("--pool", default="1G", help="what each of the two memory servers donates")
    p.add_argument("--chunk", default="4M")
    p.add_argument("--scopes", default="ram", help="ram, file, flash, or several (ram,flash), alternating")
    p.add_argument("--flash-cache", default="256M", help="each flash server's page pool")
    p.add_argument("--total", type=int, help="fixed total work: this many records at every W (strong scaling) "
                                             "instead of --per-worker records per worker")
    p.add_argument("--spark", action="store_true",
                   help="also Spark's sortByKey on the same records with W executor cores (bench/spark_peers.py)")
    a = parse_bench_args(p)
    a.skiff = os.path.abspath(a.skiff)
    counts = [int(w) for w in a.workers.split(",")]
    runs = {}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch, coordinator(a, scratch):
        pools = []
        scopes = a.scopes.split(",")
        for scope in scopes:
            for i in range(2):
                if scope == "file":
                    path = os.path.join(scratch, f"pool{i}.img")
                    subprocess.run(["truncate", "-s", a.pool, path], check=True)
                    pools.append(f"file:{path}")
                elif scope == "flash":
                    pools.append(flash_pool(a, scratch, f"flash{i}", a.pool, a.flash_cache))
                elif scope == "ram":
                    pools.append(f"ram:{a.pool}")
                else:
                    raise SystemExit(f"--scopes {scope}: ram, file or flash")
        with memory_servers(a, pools) as servers:
            log(f"etcd at {a.url}; two memory servers per scope {scopes} (pools of {a.pool}); "
                f"placement {a.pl.describe()}")
            records_file = os.path.join(scratch, "records")
            for w in counts:
                records = a.total if a.total else w * a.per_worker
                for rep in range(a.repeat):
                    r = {"records": records}
                    for scope in scopes:
                        gen = rsort(a, "gen", "--records", str(records), "--file", records_file, scope=scope)
                        cpu, served = children_cpu(), process_cpu(servers)
                        srt = rsort(a, "sort", "--workers", str(w), scope=scope)
                        rsort_cpu, server_cpu = children_cpu() - cpu, process_cpu(servers) - served
                        chk = rsort(a, "check", scope=scope)
                        # The first scope's figures under the plain names; each scope's under its own.
                        for prefix in ([""] if scope == scopes[0] else []) + [f"{scope}_"]:
                            r.update({f"{prefix}gen_s": gen["seconds"], f"{prefix}sort_s": srt["seconds"],
                                      f"{prefix}phase1_s": srt["phase1_s"], f"{prefix}wait_s": srt["wait_s"],
                                      f"{prefix}phase2_s": srt["phase2_s"], f"{prefix}check_s": chk["seconds"],
                                      f"{prefix}rsort_cpu_us_per_record": rsort_cpu / records * 1e6,
                                      f"{prefix}rsort_server_cpu_us_per_record": server_cpu / records * 1e6})
                    cpu = children_cpu()
                    gnu = timed(a.pl.client(["sort", "-o", os.path.join(scratch, "sorted"), records_file]),
                                env={**os.environ, "LC_ALL": "C"})
                    gnu_cpu = children_cpu() - cpu
                    mem = rsort(a, "local", "--records", str(records))
                    spark = None
                    if a.spark:
                        cpu = children_cpu()
                        spark = spark_sort(a, records_file, os.path.join(scratch, "spark-sorted"), w)
                        spark_cpu = children_cpu() - cpu
                    r.update({"gnu_sort_s": gnu, "in_memory_sort_s": mem["sort_s"],
                              "gnu_cpu_us_per_record": gnu_cpu / records * 1e6})
                    if spark:
                        r.update(spark_s=spark["total_s"], spark_sort_s=spark["sort_s"],
                                 spark_startup_s=spark["startup_s"], spark_cpu_us_per_record=spark_cpu / records * 1e6)
                    runs.setdefault(w, []).append(r)
                    log(f"W={w} rep {rep + 1}/{a.repeat}: {records:,} records; rsort "
                        + ", ".join(f"{sc} {r[sc + '_sort_s']:.2f} s (phase 1 {r[sc + '_phase1_s']:.2f}, "
                                    f"wait {r[sc + '_wait_s']:.2f}, phase 2 {r[sc + '_phase2_s']:.2f})" for sc in scopes)
                        + "; "
                        f"GNU sort {gnu:.2f} s; in memory {r['in_memory_sort_s']:.2f} s"
                        + (f"; Spark {r['spark_s']:.2f} s" if spark else ""))
    med = {w: median_record(v, key="sort_s") for w, v in runs.items()}
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"rsort-{time.strftime('%Y%m%d-%H%M%S')}")
    with open(base + ".json", "w") as f:
        json.dump({"placement": a.pl.record(), "repeat": a.repeat, "per_worker": a.per_worker, "scopes": scopes,
                   "pool": a.pool,
                   "points": [{"workers": w, **med[w], "repetitions": runs[w]} for w in counts]}, f, indent=1)
    scaling = f"strong scaling, {a.total:,} records" if a.total else f"weak scaling, {a.per_worker:,} records per worker"
    print(f"RSort {scaling}, {' and '.join(scopes)} namespaces "
          f"({a.pl.short()}, median of {a.repeat}); {base}.json")
    print()
    print("| workers | records | scope | rsort s | phase 1 | wait | phase 2 | GNU sort s | in-memory sort s "
          "| Spark s (sort) | CPU µs/record: RSort (+ servers) | GNU | Spark |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in counts:
        r = med[w]
        sp = f"{r['spark_s']:.2f} ({r['spark_sort_s']:.2f})" if "spark_s" in r else ""
        sp_cpu = f"{r['spark_cpu_us_per_record']:.1f}" if "spark_s" in r else ""
        for sc in scopes:
            m = r  # every figure is its own median (median_record)
            print(f"| {w} | {int(r['records']):,} | {sc} | {m[sc + '_sort_s']:.2f} | {m[sc + '_phase1_s']:.2f} | "
                  f"{m[sc + '_wait_s']:.2f} | {m[sc + '_phase2_s']:.2f} | {r['gnu_sort_s']:.2f} | "
                  f"{r['in_memory_sort_s']:.2f} | {sp} | {m[sc + '_rsort_cpu_us_per_record']:.2f} "
                  f"(+ {m[sc + '_rsort_server_cpu_us_per_record']:.2f}) | {r['gnu_cpu_us_per_record']:.2f} | {sp_cpu} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
