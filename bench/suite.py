#!/usr/bin/env python3
"""skiff's side-by-side benchmark suite: every system driven by fio, on loopback, in one run.

Systems (all serve a 1 GiB RAM-backed volume, written once before anything is measured):

  skiff-native  `skiff serve`, native protocol, fio with skiff's external engine (fio/README.md)
  skiff-nbd     `skiff serve`, NBD front end, fio's nbd engine (libnbd)
  nbdkit        `nbdkit memory 1G`, fio's nbd engine
  qemu-nbd      `qemu-nbd` on a 1 GiB tmpfs file that holds data, fio's nbd engine
  link          reference, not a system: a bulk TCP stream on loopback (iperf3), measured at the
                start and at the end of the same run

Experiments (4 KiB random unless said; docs/BENCHMARKS.md says which paper figure each mirrors):

  load     randread and randwrite, QD 1..256, one job            (i10 Fig. 6)
  mix      read share 0/30/50/70/100 %, QD 128, one job           (i10 Fig. 8)
  threads  1..128 jobs x QD 4, randread and randwrite             (Tyche Fig. 5 and 7)
           with the batching variants, static levels at Tyche's max_delay (5 ms)
  sizes    32 jobs x QD 4 of 4 KiB reads, plus one 128 KiB reader (Tyche Fig. 8)
           at QD 1 added every interval; skiff adaptive against skiff with batching off
  qd1      QD 1, 4/8/64/128 KiB, read and write                   (Tyche Table II)
           skiff-native also through `skiff bench`, for its per-stage breakdown
  ablation i10's mechanisms added one by one: lanes only, + caravans, (i10 Fig. 10)
           + delayed doorbells, + adaptive control; 1 and 2 jobs (a lane per core) x QD 128
  stages   QD 1, 4/8/64/128 KiB, read and write, through `skiff bench` (Tyche Tables V, VI)
           against three targets: run to completion (skiff's design), completions sent by a
           second thread through a queue (what Tyche-NoWQ removed), and requests received by
           a second thread and handed over (what Tyche-Rec removed): `skiff serve --stages`

Placement models two machines by default: every server (skiff serve, nbdkit, qemu-nbd,
iperf3 -s) runs under `taskset -c 1`, every client (fio, skiff bench, iperf3 -c) under
`taskset -c 0`; a wake-up across cores costs tens of microseconds on a small VM, so unpinned
runs measure the scheduler's luck (docs/BENCHMARKS.md). --placement same puts both on CPU 0,
--placement none runs without taskset. Every point runs --repeat times (default 3; --quick 1),
the systems alternating within each round, and each figure reported is the median.

    python3 bench/suite.py --quick                        # a few points, one repetition, about 2 minutes
    python3 bench/suite.py                                # the full matrix, 3 repetitions, about 46 minutes
    python3 bench/suite.py --systems skiff-nbd,nbdkit --experiments load,qd1 --runtime 3
    python3 bench/suite.py --quick --placement none       # unpinned, as before

Writes bench/results/<timestamp>/: records.jsonl (one JSON record per point and system, the
median of its repetitions, which it keeps under "repetitions"; `skiff bench` runs
carry "client": "skiff bench" and stages_us), meta.json (machine, versions, link reference),
report.md (a table per experiment) and PNG plots.
"""
import argparse
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # no bench/__pycache__ from importing compare.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import (Placement, Server, add_placement_args, cpu_s, free_port, link_reference,  # noqa: E402
                     make_scratch, median_record, precondition, rotate, stop)  # (shared with compare.py)

SYSTEMS = ["skiff-native", "skiff-nbd", "nbdkit", "qemu-nbd"]
# skiff-native on shared lanes with one batching mode each, for the thread sweep's batching
# comparison (Tyche Fig. 5): off, static levels 2/8/64, adaptive. fio's jobs run as threads of
# one process and share one lane per core (the engine's shared_lanes=), so the caravans carry
# many jobs' requests as in the paper. Chosen with --systems.
SHARED = ["--thread", f"--shared_lanes={os.cpu_count()}"]
# The static levels wait at most Tyche's max_delay (5 ms, section VI.D) for their caravan to fill,
# as in the paper's Figures 5 and 7 (skiff's own default is i10's 50 µs).
TYCHE_MAX_DELAY = "--doorbell_us=5000"
BATCHING_VARIANTS = {
    "skiff-native-off": SHARED + ["--batching=off"],
    "skiff-native-b2": SHARED + ["--aggregation=2", TYCHE_MAX_DELAY],
    "skiff-native-b8": SHARED + ["--aggregation=8", TYCHE_MAX_DELAY],
    "skiff-native-b64": SHARED + ["--aggregation=64", "--aggregation_bytes=262144", TYCHE_MAX_DELAY],
    "skiff-native-adaptive": SHARED + ["--batching=adaptive"],
}
# Tyche's Figure 8 compares its adaptive batching with no batching, both on shared lanes.
SIZES_PAIR = ["skiff-native-adaptive", "skiff-native-off"]
# i10's Figure 10: its mechanisms added one at a time, a lane (fio job) of its own per core.
# fio hands the engine up to 16 requests per commit in every step, as a block layer hands a
# driver what queued up meanwhile; without that, fio commits one request at a time and a
# caravan sent at once could only ever hold one.
ABLATION_SUBMIT = ["--iodepth_batch_submit=16", "--iodepth_batch_complete_min=1"]
ABLATION_VARIANTS = {
    "skiff-lanes": ABLATION_SUBMIT + ["--batching=off"],  # lanes only: every request on its own
    # + caravans: sent when 16 requests or 64 KiB are in, or when fio waits for completions;
    # never on a timer (a doorbell delay of 0 would send each request on its own).
    "skiff-caravans": ABLATION_SUBMIT + ["--doorbell_us=1000000"],
    "skiff-doorbells": ABLATION_SUBMIT,  # + delayed doorbells (16 requests, 64 KiB or 50 µs): the default
    "skiff-adaptive": ABLATION_SUBMIT + ["--batching=adaptive"],  # + adaptive control of size and delay
}
# The adaptive controller of another build (--before-engine) beside this one's, with the same
# options: one invocation, the systems alternating, compares two builds' controllers.
BEFORE = "skiff-native-adaptive-before"
VARIANTS = {**BATCHING_VARIANTS, **ABLATION_VARIANTS, BEFORE: BATCHING_VARIANTS["skiff-native-adaptive"]}
# Tyche's Tables V and VI: the designs it removed, rebuilt on skiff's target (`--stages`), beside
# skiff-native, which runs each request to completion on one thread. Measured with skiff bench.
STAGED = {"skiff-send-thread": "send-thread", "skiff-recv-thread": "recv-thread"}
DESIGNS = ["skiff-native", *STAGED]
# At QD 1 this system is also measured with skiff's own client, whose JSON has the per-stage
# breakdown (Tyche Table II); those records carry "client": SKIFF_BENCH.
STAGES_SYSTEM = "skiff-native"
SKIFF_BENCH = "skiff bench"
QUICK_SYSTEMS = ["skiff-native", "skiff-nbd", "nbdkit"]
EXPERIMENTS = ["load", "mix", "threads", "sizes", "qd1", "ablation", "stages"]
ENGINE = "target/fio/skiff-engine.so"


def title_machine(meta):
    """The machine, the placement and the repetitions, for plot titles."""
    return f"{meta['machine']['cores']} cores, loopback, {placement_short(meta)}, {reps_short(meta)}"


def placement_short(meta):
    pl = Placement.from_record(meta.get("placement"))
    return pl.short() if pl else "unpinned (placement not recorded)"


def placement_long(meta):
    pl = Placement.from_record(meta.get("placement"))
    return pl.describe() if pl else "not recorded (a run from before placement existed: unpinned)"


def reps_short(meta):
    n = meta.get("repeat", 1)
    return f"median of {n}" if n > 1 else "1 repetition"
COLORS = {"skiff-native": "#d62728", "skiff-nbd": "#ff7f0e", "nbdkit": "#1f77b4", "qemu-nbd": "#2ca02c"}
MARKERS = {"skiff-native": "o", "skiff-nbd": "s", "nbdkit": "^", "qemu-nbd": "D"}
# The batching variants: one fixed colour each, so both panels of a plot agree.
COLORS.update({"skiff-native-off": "#7f7f7f", "skiff-native-b2": "#bcbd22", "skiff-native-b8": "#17becf",
               "skiff-native-b64": "#9467bd", "skiff-native-adaptive": "#8c564b"})
MARKERS.update({"skiff-native-off": "x", "skiff-native-b2": "v", "skiff-native-b8": "<",
                "skiff-native-b64": ">", "skiff-native-adaptive": "*"})
COLORS.update({"skiff-lanes": "#c6dbef", "skiff-caravans": "#6baed6", "skiff-doorbells": "#2171b5",
               "skiff-adaptive": "#08306b"})
COLORS.update({"skiff-send-thread": "#fdae6b", "skiff-recv-thread": "#a63603"})


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Needs


def ensure_needs(a, systems):
    """Check for every tool the run needs; install what can be installed, saying so."""
    if importlib.util.find_spec("matplotlib") is None:
        log("matplotlib is missing: installing it with `python3 -m pip install matplotlib` (for the plots)")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "matplotlib"])
        if r.returncode != 0:
            r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--break-system-packages",
                                "matplotlib"])
        if r.returncode != 0:
            raise SystemExit("could not install matplotlib: python3 -m pip install matplotlib "
                             "(or apt-get install python3-matplotlib)")
    apt = {"fio": "fio", "iperf3": "iperf3"}
    if "nbdkit" in systems:
        apt["nbdkit"] = "nbdkit"
    if "qemu-nbd" in systems:
        apt["qemu-nbd"] = "qemu-utils"
    missing = [pkg for tool, pkg in apt.items() if not shutil.which(tool)]
    if missing:
        cmd = ["apt-get", "install", "-y"] + missing
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            raise SystemExit(f"missing tools: run `{' '.join(cmd)}` as root")
        log(f"missing tools: running `{' '.join(cmd)}`")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, stdout=subprocess.DEVNULL)
            if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
                raise SystemExit(f"`{' '.join(cmd)}` failed")
    if any(s.startswith("skiff") for s in systems) and not os.access(a.skiff, os.X_OK):
        raise SystemExit(f"{a.skiff} not found: cargo build --release --bin skiff")
    if any(s.startswith("skiff-native") for s in systems) and not os.path.exists(a.engine):
        raise SystemExit(f"{a.engine} not found: fio/build.sh --profile release")


def versions():
    def first_line(argv):
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            return (out.stdout or out.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return None
    return {
        "fio": first_line(["fio", "--version"]),
        "nbdkit": first_line(["nbdkit", "--version"]),
        "qemu-nbd": first_line(["qemu-nbd", "--version"]),
        "iperf3": first_line(["iperf3", "--version"]),
    }


def machine():
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"cores": os.cpu_count(), "cpu": model, "mem_bytes": mem, "kernel": platform.release(),
            "host": platform.node()}


# ---------------------------------------------------------------------------------------------
# Servers


class Target:
    """One system's server, started once, preconditioned once, measured per run by CPU delta."""

    def __init__(self, system, server, fio_args, client):
        self.system, self.server, self.fio_args, self.client = system, server, fio_args, client

    @property
    def pid(self):
        return self.server.proc.pid

    def alive(self):
        return self.server.proc.poll() is None


def start_target(system, a, scratch):
    """Start one system's server where servers run (a separate `skiff serve` for skiff, never
    skiff bench's in-process target, so that it can be placed)."""
    port = free_port()
    pin = a.pl.server
    if system == "skiff-native" or system in VARIANTS or system in STAGED:
        nbd_port = free_port()
        stages = ["--stages", STAGED[system]] if system in STAGED else []
        srv = Server(pin([a.skiff, "serve", "--listen", f"127.0.0.1:{port}", "--nbd", f"127.0.0.1:{nbd_port}",
                          "--export", "vol=ram:1G"] + stages), port)
        engine = a.before_engine if system == BEFORE else a.engine
        t = Target(system, srv, [f"--ioengine=external:{engine}", f"--target=127.0.0.1:{port}",
                                 "--export=vol"] + VARIANTS.get(system, []), "fio skiff engine")
        t.precondition_uri = f"nbd://127.0.0.1:{nbd_port}/vol"
        t.native_addr = f"127.0.0.1:{port}"
        return t
    if system == "skiff-nbd":
        srv = Server(pin([a.skiff, "serve", "--no-tcp", "--nbd", f"127.0.0.1:{port}", "--export", "vol=ram:1G"]),
                     port)
        uri = f"nbd://127.0.0.1:{port}/vol"
    elif system == "nbdkit":
        srv = Server(pin(["nbdkit", "--foreground", "--ipaddr", "127.0.0.1", "--port", str(port), "memory", "1G"]),
                     port)
        uri = f"nbd://127.0.0.1:{port}/"
    elif system == "qemu-nbd":
        # --shared=0: any number of clients (the thread sweep opens up to 64 connections).
        srv = Server(pin(["qemu-nbd", "--persistent", "--shared=0", "--bind", "127.0.0.1", "--port", str(port),
                          "--format", "raw", scratch]), port)
        uri = f"nbd://127.0.0.1:{port}/"
    else:
        raise ValueError(system)
    t = Target(system, srv, ["--ioengine=nbd", f"--uri={uri}"], "fio nbd")
    t.precondition_uri = uri
    return t


# ---------------------------------------------------------------------------------------------
# The link reference


# ---------------------------------------------------------------------------------------------
# fio


def size_bytes(bs):
    s = str(bs).lower().rstrip("b")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def run_fio(argv):
    """Run fio; return (parsed JSON, CPU seconds of fio's whole process tree from wait4)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(argv, stdout=out, stderr=err)
        try:
            _, status, ru = os.wait4(p.pid, 0)
        except BaseException:
            # interrupted: let fio stop its job processes itself, then make sure
            stop(p)
            raise
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
        if p.returncode != 0 or "{" not in text:
            err.seek(0)
            raise RuntimeError(f"fio failed ({p.returncode}): {' '.join(argv)}\n{err.read()[-2000:]}{text[-2000:]}")
    # fio's nbd engine prints "fio: connected to NBD server" before the JSON document.
    return json.loads(text[text.index("{"):]), ru.ru_utime + ru.ru_stime


def side_stats(d):
    lat = d["lat_ns"]
    pct = lat.get("percentile", {})

    def p(k):
        v = pct.get(k)
        return v / 1000 if v is not None else None
    return {"mean": lat["mean"] / 1000, "p50": p("50.000000"), "p99": p("99.000000"), "p999": p("99.900000")}


def measure(target, a, *, rw, bs="4k", qd=1, numjobs=1, rwmixread=None, runtime=None, extra_jobs=None,
            logdir=None, log_msec=None):
    """One fio run against a running target. Returns the figures of the main job group."""
    runtime = runtime or a.runtime
    argv = ["fio", "--output-format=json"] + target.fio_args + [
        "--size=1G", "--time_based", "--group_reporting", "--unified_rw_reporting=both",
        "--lat_percentiles=1", "--percentile_list=50:99:99.9", "--randrepeat=0"]
    if logdir:
        argv += [f"--log_avg_msec={log_msec}", f"--write_bw_log={os.path.join(logdir, 'run')}"]
    argv += [f"--name={target.system}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}", f"--numjobs={numjobs}",
             f"--runtime={runtime}"]
    if rwmixread is not None:
        argv.append(f"--rwmixread={rwmixread}")
    for job in extra_jobs or []:
        argv += job
    if not target.alive():
        raise RuntimeError(f"{target.system} server exited")
    c0 = cpu_s(target.pid)
    t0 = time.time()
    d, tree_cpu = run_fio(a.pl.client(argv))
    wall = time.time() - t0
    server_cpu = cpu_s(target.pid) - c0
    jobs = d["jobs"]
    ios_all = sum(j["mixed"]["total_ios"] for j in jobs)
    bytes_all = sum(j["mixed"]["io_bytes"] for j in jobs)
    client_cpu = sum((j["usr_cpu"] + j["sys_cpu"]) / 100.0 * j["job_runtime"] / 1000.0 for j in jobs)
    ctx = sum(j["ctx"] for j in jobs)
    main = jobs[0]
    m = main["mixed"]
    secs = max(main["read"]["runtime"], main["write"]["runtime"], 1) / 1000.0
    st = side_stats(m)
    rec = {
        "client": target.client,
        "iops": m["total_ios"] / secs,
        "bw_bytes_s": m["io_bytes"] / secs,
        "read_iops": main["read"]["total_ios"] / secs,
        "write_iops": main["write"]["total_ios"] / secs,
        "lat_mean_us": st["mean"], "lat_p50_us": st["p50"], "lat_p99_us": st["p99"], "lat_p999_us": st["p999"],
        "ios": ios_all,
        "bytes": bytes_all,
        "measured_s": secs,
        "wall_s": wall,
        # fio's own usr+sys of its job threads (getrusage RUSAGE_THREAD), every job of the run.
        "client_cpu_us_per_io": client_cpu * 1e6 / ios_all if ios_all else None,
        # Cross-check: fio's whole process tree (job processes and fio's main process), from wait4.
        "client_tree_cpu_us_per_io": tree_cpu * 1e6 / ios_all if ios_all else None,
        # Server process, all threads, from /proc/PID/stat over the whole fio run.
        "server_cpu_us_per_io": server_cpu * 1e6 / ios_all if ios_all else None,
        "ctx_per_io": ctx / ios_all if ios_all else None,
        # cores kept busy over the run: a fio job near 1.0 is the bottleneck (it polls or works
        # flat out), and its CPU per I/O is then simply one core divided by its IOPS.
        "client_cores": client_cpu / secs,
        "server_cores": server_cpu / secs,
    }
    if rec["client_cpu_us_per_io"] is not None:
        rec["total_cpu_us_per_io"] = rec["client_cpu_us_per_io"] + rec["server_cpu_us_per_io"]
    rec["groups"] = [{"name": j["jobname"], "iops": j["mixed"]["total_ios"] / max(j["mixed"]["runtime"], 1) * 1000,
                      "bw_bytes_s": j["mixed"]["io_bytes"] / max(j["mixed"]["runtime"], 1) * 1000,
                      "lat_mean_us": j["mixed"]["lat_ns"]["mean"] / 1000} for j in jobs]
    return rec


# ---------------------------------------------------------------------------------------------
# skiff bench: the per-stage breakdown at QD 1


def run_skiff_bench(argv, runtime):
    """Run `skiff bench --json`; return its parsed summary."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=runtime + 30)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"skiff bench did not finish: {' '.join(argv)}")
    if p.returncode != 0 or not p.stdout.strip():
        raise RuntimeError(f"skiff bench failed ({p.returncode}): {' '.join(argv)}\n{p.stderr[-2000:]}")
    try:
        return json.loads(p.stdout)
    except ValueError as e:
        raise RuntimeError(f"skiff bench printed no JSON ({e}): {p.stdout[-500:]}")


def measure_stages(target, a, *, rw, bs, qd):
    """One `skiff bench` run, one thread, against the suite's own skiff-native server: the same
    export and size as the fio runs. Returns figures named like measure()'s, plus stages_us."""
    argv = [a.skiff, "bench", "--target", target.native_addr, "--export", "vol", "--size", "1G",
            "--threads", "1", "--rw", rw, "--bs", bs, "--qd", str(qd), "--duration", f"{a.runtime}s", "--json"]
    if not target.alive():
        raise RuntimeError(f"{target.system} server exited")
    c0 = cpu_s(target.pid)
    t0 = time.time()
    r = run_skiff_bench(a.pl.client(argv), a.runtime)
    wall = time.time() - t0
    server_cpu = cpu_s(target.pid) - c0
    ios, secs = r["ios"], r["duration_s"]
    if not ios:
        raise RuntimeError(f"skiff bench completed no I/O: {r.get('first_io_error')}")
    lat = r["lat_us"]
    rec = {
        "iops": r["iops"],
        "bw_bytes_s": r["bytes_per_s"],
        "lat_mean_us": lat["mean"], "lat_p50_us": lat["p50"], "lat_p99_us": lat["p99"], "lat_p999_us": lat["p999"],
        "ios": ios,
        "measured_s": secs,
        "wall_s": wall,
        # skiff bench's own usr+sys of its I/O threads, timed phase only.
        "client_cpu_us_per_io": r["client_cpu_us_per_io"],
        # Server process from /proc over the whole skiff bench run (connect included), as for fio;
        # skiff bench's own figure, from the target's STATS over the timed phase, beside it.
        "server_cpu_us_per_io": server_cpu * 1e6 / ios,
        "server_stats_cpu_us_per_io": r["server_cpu_us_per_io"],
        "ctx_per_io": r["client_ctx_switches_per_io"],
        "server_ctx_per_io": r["server_ctx_switches_per_io"],
        "client_cores": r["client_cpu_us_per_io"] * ios / 1e6 / secs,
        "server_cores": server_cpu / secs,
        # µs per I/O in each stage; at QD 1 with one thread `elsewhere` is the rest of the mean
        "stages_us": r["stages_us"],
    }
    rec["total_cpu_us_per_io"] = rec["client_cpu_us_per_io"] + rec["server_cpu_us_per_io"]
    return rec


def from_skiff_bench(r):
    return r.get("client") == SKIFF_BENCH


def runners(exp, systems):
    """What is measured at each point of `exp`: (system, client) pairs, client None for fio. At
    QD 1, skiff-native is measured a second time with `skiff bench`, for its stages. The ablation
    runs its own variants, and only it; `sizes` adds Tyche's pair (adaptive, batching off)."""
    if exp == "ablation":
        return [(s, None) for s in ABLATION_VARIANTS]
    if exp == "stages":
        return [(s, SKIFF_BENCH) for s in DESIGNS]
    out = [(s, None) for s in systems if s not in ABLATION_VARIANTS]
    if exp == "sizes":
        out += [(s, None) for s in SIZES_PAIR if s not in systems]
    if exp == "qd1" and STAGES_SYSTEM in systems:
        out.append((STAGES_SYSTEM, SKIFF_BENCH))
    return out


# ---------------------------------------------------------------------------------------------
# Experiments: each yields (point dict, fio kwargs) in order; systems alternate at every point.


def pow2(lo, hi):
    v, out = lo, []
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def plan(a):
    q = a.quick
    p = {}
    p["load"] = [({"rw": rw, "qd": qd}, dict(rw=rw, qd=qd))
                 for rw in (["randread", "randwrite"])
                 for qd in ([1, 16, 128] if q and rw == "randread" else [1, 128] if q else pow2(1, 256))]
    p["mix"] = [({"rw": "randrw", "read_pct": r, "qd": 128},
                 dict(rw="randread" if r == 100 else "randwrite" if r == 0 else "randrw", qd=128,
                      rwmixread=None if r in (0, 100) else r))
                for r in ([0, 50, 100] if q else [0, 30, 50, 70, 100])]
    p["threads"] = [({"rw": rw, "numjobs": n, "qd": 4}, dict(rw=rw, qd=4, numjobs=n))
                    for rw in (a.threads_rw.split(",") if a.threads_rw else ["randread"] if q else ["randread", "randwrite"])
                    for n in ([int(j) for j in a.threads_jobs.split(",")] if a.threads_jobs
                              else [1, 4, 16] if q else pow2(1, 128))]
    p["sizes"] = [({"rw": "randread", "numjobs": 32, "qd": 4, "streams": a.streams,
                    "interval_s": a.interval}, None)]
    p["qd1"] = [({"rw": rw, "bs": bs, "qd": 1}, dict(rw=rw, bs=bs, qd=1))
                for rw in (["randread"] if q else ["randread", "randwrite"])
                for bs in (["4k", "64k"] if q else ["4k", "8k", "64k", "128k"])]
    p["stages"] = [(pt, kw) for pt, kw in p["qd1"]]
    p["ablation"] = [({"rw": rw, "numjobs": n, "qd": 128}, dict(rw=rw, qd=128, numjobs=n))
                     for rw in (["randread"] if q else ["randread", "randwrite"])
                     for n in (1, 2)]
    return p


def run_estimate(a, exp):
    """Seconds one run (one repetition) takes here: its runtime plus fio's start-up (forking and
    connecting jobs)."""
    if exp == "sizes":
        return a.interval * (a.streams + 1) + 0.8
    return a.runtime + (0.9 if exp == "threads" else 0.35)


def run_sizes(target, a, logdir):
    """32 jobs x QD 4 of 4 KiB reads for the whole run, plus one 128 KiB reader (QD 1, as
    Tyche's) added at every interval; per-interval throughput from fio's bandwidth logs."""
    T, S = a.interval, a.streams
    total = T * (S + 1)
    extra = []
    for k in range(1, S + 1):
        extra.append(["--new_group", f"--name=stream{k}", "--rw=randread", "--bs=128k", "--iodepth=1",
                      "--numjobs=1", f"--startdelay={k * T}", f"--runtime={total - k * T}"])
    # --new_group belongs to the job it follows on fio's command line: place it after --name.
    extra = [[e[1], e[0]] + e[2:] for e in extra]
    win = 500
    rec = measure(target, a, rw="randread", qd=4, numjobs=32, runtime=total, extra_jobs=extra,
                  logdir=logdir, log_msec=win)
    # bw logs: run_bw.<job index>.log, jobs 1..32 the 4 KiB group, then the streams in order.
    # Each log entry is the average over the window that ends at its timestamp (ms since that
    # job's start; a stream starts after its startdelay): spread its bytes over fixed 0.5 s bins.
    bins_small, bins_big = {}, {}
    for idx in range(1, 32 + S + 1):
        path = os.path.join(logdir, f"run_bw.{idx}.log")
        if not os.path.exists(path):
            continue
        delay = 0 if idx <= 32 else (idx - 32) * T * 1000
        dst = bins_small if idx <= 32 else bins_big
        prev = 0
        with open(path) as f:
            for line in f:
                parts = [x.strip() for x in line.split(",")]
                if len(parts) < 2:
                    continue
                t_ms, kib_s = int(parts[0]), int(parts[1])
                lo, hi = max(prev, t_ms - win) + delay, t_ms + delay
                prev = t_ms
                if hi <= lo:
                    continue
                b = int(lo // win)
                while b * win < hi:
                    overlap = min(hi, (b + 1) * win) - max(lo, b * win)
                    dst[b] = dst.get(b, 0) + kib_s * 1024 * overlap / 1000  # bytes moved in this bin
                    b += 1
    # bins hold bytes; bin b covers [b, b+1) x win ms
    intervals = []
    for b in range(int(total * 1000 / win) - 1):  # the last window is the jobs' teardown
        intervals.append({"t_s": (b + 1) * win / 1000, "small_iops": bins_small.get(b, 0) * 1000 / win / 4096,
                          "big_bytes_s": bins_big.get(b, 0) * 1000 / win})
    phases = []
    for k in range(S + 1):
        lo, hi = k * T, (k + 1) * T
        # skip the first window of each phase (the new stream connecting and ramping)
        sel = [iv for iv in intervals if lo + win / 1000 < iv["t_s"] <= hi] or \
            [iv for iv in intervals if lo < iv["t_s"] <= hi]
        if sel:
            phases.append({"streams": k, "small_iops": sum(i["small_iops"] for i in sel) / len(sel),
                           "big_bytes_s": sum(i["big_bytes_s"] for i in sel) / len(sel)})
    rec["intervals"], rec["phases"] = intervals, phases
    rec["iops"] = rec["groups"][0]["iops"]  # the 4 KiB group's IOPS over the whole run
    rec["bw_bytes_s"] = sum(g["bw_bytes_s"] for g in rec["groups"])  # 4 KiB and 128 KiB payload together
    for name in os.listdir(logdir):
        os.unlink(os.path.join(logdir, name))
    return rec


# ---------------------------------------------------------------------------------------------
# Report


def fmt(v, nd=1):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if abs(v) >= 1000 and nd <= 1:
        return f"{v:,.0f}"
    return f"{v:.{nd}f}"


def point_label(exp, pt):
    if exp == "load":
        return f"{pt['rw']} QD {pt['qd']}"
    if exp == "mix":
        return f"{pt['read_pct']}% reads"
    if exp == "threads":
        return f"{pt['rw']} {pt['numjobs']} jobs"
    if exp in ("qd1", "stages"):
        return f"{pt['rw']} {pt['bs'].upper()}iB"
    if exp == "sizes":
        return f"32x4 KiB + {pt['streams']} x 128 KiB"
    if exp == "ablation":
        return f"{pt['rw']} {pt['numjobs']} job{'s' if pt['numjobs'] > 1 else ''} x QD {pt['qd']}"
    return str(pt)


def same_point(r, s):
    return r["experiment"] == s["experiment"] and r["point"] == s["point"]


EXPLAIN = {
    "load": ("Load sweep (i10 Fig. 6)", "4 KiB random, one fio job, queue depth 1 to 256."),
    "mix": ("Read/write mix (i10 Fig. 8)", "4 KiB random, one fio job, QD 128, read share 0 to 100%."),
    "threads": ("Thread sweep (Tyche Fig. 5 and 7)",
                "4 KiB random, N fio jobs x QD 4. skiff-native, skiff-nbd and the peers: each job a process "
                "with its own connection (lane). skiff-native-off/-b2/-b8/-b64/-adaptive: the jobs are "
                "threads of one fio process sharing one lane per core (engine option shared_lanes), with "
                "batching off, static 2/8/64 requests per caravan waiting at most Tyche's max_delay of "
                "5 ms, or the adaptive controller."),
    "sizes": ("Mixed sizes over time (Tyche Fig. 8)",
              "32 jobs x QD 4 of 4 KiB random reads for the whole run; one more 128 KiB random reader at "
              "QD 1 starts every interval (fio startdelay). skiff-native-adaptive and skiff-native-off are "
              "Tyche's pair: adaptive batching and no batching, both on shared lanes. The table gives the "
              "whole run; the phase "
              "table averages fio's 0.5 s bandwidth-log windows within each phase (first window of a phase "
              "skipped). IOPS is the 4 KiB group's; MB/s and link utilisation count all payload; CPU and "
              "ctx per I/O count every I/O of both sizes."),
    "qd1": ("QD 1 latency by size (Tyche Table II)",
            "One job, one outstanding I/O, random, end-to-end latency (fio's submission-to-completion `lat`) "
            "and CPU per I/O. skiff-native is also measured with `skiff bench` (one thread, same server, "
            "export and runtime), which times each stage on both sides: the per-stage table below."),
    "ablation": ("i10's mechanisms one by one (i10 Fig. 10)",
                 "4 KiB random, N fio jobs (a lane each, one per core) x QD 128 through skiff's engine: "
                 "fio commits up to 16 requests at a time in every step (iodepth_batch_submit=16). "
                 "skiff-lanes sends every request on its own; skiff-caravans gathers requests into caravans "
                 "sent when 16 requests or 64 KiB are in or when fio waits for completions, never on a timer "
                 "(doorbell_us=1000000); skiff-doorbells adds the delayed doorbell's timer (50 µs: skiff's "
                 "default); skiff-adaptive lets the adaptive controller "
                 "set caravan size and delay. The step table gives each step's IOPS gain over the one before."),
}


STAGES_TEXT = (
    "Per-stage breakdown of skiff-native at QD 1 (Tyche Table II), from `skiff bench --qd 1 --threads 1` "
    "against the same server: wall time inside each stage's calls, µs per I/O. Client send and recv are "
    "the initiator's send and receive calls, client complete its completion handling (matching tags, "
    "placing read data); target recv, exec (parsing, the backend, building replies) and send come from "
    "the target's STATS. At QD 1 the stages follow each I/O's path, and `elsewhere` is the rest of "
    "skiff bench's mean latency: the loopback wire, the wake-ups of the sleeping thread on each side, "
    "scheduling. The stages are wall time on two threads: where the woken side starts before the call "
    "that woke it has returned (on loopback a send runs the receiver's path and wakes it), they overlap "
    "and `elsewhere` comes out negative; the plot then draws it as zero and its mean mark falls inside "
    "the bar. The mean is skiff's own client, without fio; IOPS and CPU per I/O of these runs are in "
    "records.jsonl (\"client\": \"skiff bench\").")


def stage_keys(recs):
    """Stage names in skiff bench's order, `elsewhere` last."""
    keys = list(dict.fromkeys(k for r in recs for k in r["stages_us"]))
    return [k for k in keys if k != "elsewhere"] + [k for k in keys if k == "elsewhere"]


def stages_table(records, plots):
    """The Markdown lines of the QD 1 per-stage table, from skiff bench records."""
    if not records:
        return []
    ok = [r for r in records if "error" not in r]
    keys = stage_keys(ok)
    L = [STAGES_TEXT + "\n"]
    L += [f"![qd1 stages]({p})\n" for p in plots]
    L.append("| " + " | ".join(["point", "mean µs"] + [k.replace("_", " ") for k in keys]) + " |")
    L.append("|---|" + "---:|" * (len(keys) + 1))
    for r in ok:
        L.append(f"| {point_label('qd1', r['point'])} | {fmt(r['lat_mean_us'])} | "
                 + " | ".join(fmt(r["stages_us"].get(k), 2) for k in keys) + " |")
    for r in records:
        if "error" in r:
            L.append(f"| {point_label('qd1', r['point'])} | failed: {r['error'][:80]} |" + " |" * len(keys))
    L.append("")
    return L


DESIGNS_TEXT = (
    "Tyche removed two hand-offs between threads from its target: received requests handed from the "
    "network thread to the block thread (gone in Tyche-Rec, Table V) and completions sent by a work "
    "queue (gone in Tyche-NoWQ, Table VI). "
    "`skiff serve --stages` rebuilds both on skiff's own worker: skiff-send-thread executes as usual "
    "and queues each response caravan (copied out) to a second thread that sends it; skiff-recv-thread "
    "has a second thread receive and queue what arrived (copied) to the worker, which executes and "
    "sends. skiff-native runs every request to completion on one thread. All three are measured with "
    "`skiff bench --qd 1 --threads 1` against the same export; the server's threads share its CPU, so "
    "a hand-off is a wake-up and a context switch there. Server CPU and context switches per I/O come "
    "from the target's STATS (every worker and stage thread), over the timed phase; \"cost\" is the "
    "design's latency minus skiff-native's at the same point: what running to completion saves.")


def designs_table(records, plots):
    """The Markdown lines of the `stages` experiment: Tyche's Tables V and VI on skiff's target."""
    recs = [r for r in records if r["experiment"] == "stages"]
    if not recs:
        return []
    L = ["## Run to completion against the designs Tyche removed (Tyche Tables V and VI)\n", DESIGNS_TEXT + "\n"]
    L += [f"![stages]({p})\n" for p in plots]
    L.append("| point | design | IOPS | mean µs | cost µs | p99 µs | server CPU µs/I/O | server ctx/I/O | "
             "client CPU µs/I/O | target recv | target exec | target send |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for pt in dict.fromkeys(json.dumps(r["point"], sort_keys=True) for r in recs):
        at = {r["system"]: r for r in recs if json.dumps(r["point"], sort_keys=True) == pt}
        base = at.get("skiff-native")
        for name in DESIGNS:
            r = at.get(name)
            if r is None:
                continue
            label = point_label("stages", r["point"])
            if "error" in r:
                L.append(f"| {label} | {name} | failed: {r['error'][:80]} |" + " |" * 9)
                continue
            cost = (f"{r['lat_mean_us'] - base['lat_mean_us']:+.1f}" if base and "error" not in base
                    and name != "skiff-native" else "-")
            st = r.get("stages_us", {})
            L.append(f"| {label} | {name} | {fmt(r['iops'])} | {fmt(r['lat_mean_us'])} | {cost} | "
                     f"{fmt(r['lat_p99_us'])} | {fmt(r.get('server_stats_cpu_us_per_io'), 2)} | "
                     f"{fmt(r.get('server_ctx_per_io'), 2)} | {fmt(r['client_cpu_us_per_io'], 2)} | "
                     f"{fmt(st.get('target_recv'), 2)} | {fmt(st.get('target_exec'), 2)} | "
                     f"{fmt(st.get('target_send'), 2)} |")
    L.append("\nThe target stages are the worker's calls only: with a receive thread, its receives are not "
             "in `target recv`; with a send thread, its sends are not in `target send`.\n")
    return L


# The shared-lane systems of the thread sweep: the static levels the controller is held to.
STATIC_SHARED = ["skiff-native-b2", "skiff-native-b8", "skiff-native-b64"]


def controller_table(recs):
    """The adaptive controller against the best static level and against batching off at each
    point of the thread sweep (issue 31's aim: at least 0.9x and 0.95x), when those ran."""
    adaptive = [s for s in ("skiff-native-adaptive", "skiff-native-adaptive-before")
                if any(r["system"] == s for r in recs)]
    if not adaptive or not any(r["system"] in STATIC_SHARED for r in recs):
        return []
    L = ["The adaptive controller against the best static level (of " + ", ".join(
        s for s in STATIC_SHARED if any(r["system"] == s for r in recs)) + ") and against batching off, IOPS "
         "at each point:\n"]
    L.append("| point | " + " | ".join(f"{s} ÷ best static | ÷ off" for s in adaptive) + " | best static |")
    L.append("|---|" + "---:|---:|" * len(adaptive) + "---|")
    for pt in dict.fromkeys(json.dumps(r["point"], sort_keys=True) for r in recs):
        at = {r["system"]: r for r in recs if json.dumps(r["point"], sort_keys=True) == pt}
        statics = [at[s] for s in STATIC_SHARED if s in at and at[s]["iops"]]
        if not statics:
            continue
        best = max(statics, key=lambda r: r["iops"])
        off = at.get("skiff-native-off")
        cells = []
        for s in adaptive:
            r = at.get(s)
            cells.append(f"{r['iops'] / best['iops']:.2f}" if r else "-")
            cells.append(f"{r['iops'] / off['iops']:.2f}" if r and off and off["iops"] else "-")
        L.append(f"| {point_label('threads', best['point'])} | " + " | ".join(cells) + f" | {best['system']} |")
    L.append("")
    return L


def write_report(outdir, a, meta, records, plots):
    link = meta.get("link", {}).get("bytes_per_s")
    L = []
    L.append(f"# skiff benchmark suite: {meta['started']} ({placement_short(meta)}, {reps_short(meta)})\n")
    m = meta["machine"]
    n_rep = meta.get("repeat", 1)
    L.append(f"Machine: {m['cores']} cores ({m['cpu']}), {(m['mem_bytes'] or 0) / 2**30:.0f} GiB, Linux "
             f"{m['kernel']}, loopback TCP. Mode: {'--quick' if a.quick else 'full'}, {a.runtime} s per point. "
             f"Systems: {', '.join(meta['systems'])}.  ")
    pinned = (meta.get("placement") or {}).get("mode", "none") != "none"
    L.append(f"**Placement**: {placement_long(meta)}" + (", with `taskset -c`; the link reference is placed the same "
                                                          "way.  " if pinned else ".  "))
    L.append(f"**Repetitions**: {n_rep} per point, the systems alternating within each round"
             + ("; every figure below is the median of its repetitions, figure by figure (records.jsonl keeps "
                "each repetition under `repetitions`).  " if n_rep > 1 else
                "; one repetition, so the figures are single runs, not medians.  "))
    L.append("Tools: " + "; ".join(f"{k}: {v}" for k, v in meta["versions"].items() if v) + ".  ")
    L.append(f"Command: `{meta['command']}`; wall time {meta.get('wall_s', 0) / 60:.1f} min.\n")
    if meta.get("link"):
        lk = meta["link"]
        L.append(f"**Link reference** (bulk TCP stream on loopback, {lk['tool']}, {lk['seconds']} s, measured at "
                 f"the start and the end of this run): "
                 + ", ".join(f"{x / 1e9:.2f} GB/s" for x in lk["samples_bytes_per_s"])
                 + f"; mean {lk['bytes_per_s'] / 1e9:.2f} GB/s = {lk['payloads_4k_per_s'] / 1e6:.2f} million 4 KiB "
                 f"payloads/s. Link utilisation below is each run's payload bytes/s divided by this mean.\n")
    L.append("Every system is driven by fio 3.33: skiff-native through skiff's external engine, the others "
             "through fio's nbd engine (libnbd). Each server runs for the whole suite and its volume is written "
             "once before anything is measured. CPU µs/I/O: client = fio's usr+sys of its job threads, "
             "server = the server process (all threads, /proc/PID/stat) over the run, both divided by completed "
             "I/Os; ctx/I/O = fio's context switches per I/O; \"vs nbdkit\" = IOPS ratio at the same point. "
             "Latency is end-to-end (fio `lat`, submission to completion), in µs.\n")
    hdr = ("| point | system | IOPS | vs nbdkit | MB/s | mean µs | p50 | p99 | p99.9 | CPU µs/I/O client | server | "
           "sum | cores busy client/server | ctx/I/O | link util |")
    sep = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    for exp in EXPERIMENTS:
        recs = [r for r in records if r["experiment"] == exp and "error" not in r and not from_skiff_bench(r)]
        errs = [r for r in records if r["experiment"] == exp and "error" in r and not from_skiff_bench(r)]
        if not recs and not errs:
            continue
        title, text = EXPLAIN[exp]
        L.append(f"## {title}\n")
        L.append(text + "\n")
        for p in plots.get(exp, []):
            L.append(f"![{exp}]({p})\n")
        L.append(hdr)
        L.append(sep)
        for r in recs:
            base = next((b for b in recs if b["system"] == "nbdkit" and same_point(b, r)), None)
            ratio = f"{r['iops'] / base['iops']:.2f}x" if base and base["iops"] else "-"
            util = f"{100 * r['bw_bytes_s'] / link:.1f}%" if link else "-"
            cores = (f"{r['client_cores']:.2f} / {r['server_cores']:.2f}" if r.get("client_cores") is not None
                     else "-")
            L.append(f"| {point_label(exp, r['point'])} | {r['system']} | {fmt(r['iops'])} | {ratio} | "
                     f"{r['bw_bytes_s'] / 1e6:,.0f} | {fmt(r['lat_mean_us'])} | {fmt(r['lat_p50_us'])} | "
                     f"{fmt(r['lat_p99_us'])} | {fmt(r['lat_p999_us'])} | {fmt(r['client_cpu_us_per_io'], 2)} | "
                     f"{fmt(r['server_cpu_us_per_io'], 2)} | {fmt(r.get('total_cpu_us_per_io'), 2)} | "
                     f"{cores} | {fmt(r['ctx_per_io'], 2)} | {util} |")
        for r in errs:
            L.append(f"| {point_label(exp, r['point'])} | {r['system']} | failed: {r['error'][:80]} |"
                     + " |" * 12)
        for r in recs:
            if r.get("rep_errors"):
                L.append(f"\n{point_label(exp, r['point'])}, {r['system']}: {len(r['rep_errors'])} of "
                         f"{r.get('repeat', 1)} repetitions failed ({r['rep_errors'][0][:80]}); the median is of "
                         f"the rest.")
        L.append("")
        if exp == "sizes":
            L.append("Per phase (average over the phase's 0.5 s windows):\n")
            L.append("| system | 128 KiB streams | 4 KiB IOPS | 128 KiB MB/s | total MB/s | link util |")
            L.append("|---|---:|---:|---:|---:|---:|")
            for r in recs:
                for ph in r.get("phases", []):
                    tot = ph["small_iops"] * 4096 + ph["big_bytes_s"]
                    util = f"{100 * tot / link:.1f}%" if link else "-"
                    L.append(f"| {r['system']} | {ph['streams']} | {ph['small_iops']:,.0f} | "
                             f"{ph['big_bytes_s'] / 1e6:,.0f} | {tot / 1e6:,.0f} | {util} |")
            L.append("")
        if exp == "ablation":
            L.append("Each step against the one before it:\n")
            L.append("| point | step | IOPS | gain | CPU µs/I/O (sum) |")
            L.append("|---|---|---:|---:|---:|")
            for pt in dict.fromkeys(json.dumps(r["point"], sort_keys=True) for r in recs):
                prev = None
                for name in ABLATION_VARIANTS:
                    r = next((x for x in recs if x["system"] == name
                              and json.dumps(x["point"], sort_keys=True) == pt), None)
                    if r is None:
                        continue
                    gain = f"{r['iops'] / prev['iops'] - 1:+.0%}" if prev and prev["iops"] else "-"
                    L.append(f"| {point_label(exp, r['point'])} | {name} | {fmt(r['iops'])} | {gain} | "
                             f"{fmt(r.get('total_cpu_us_per_io'), 2)} |")
                    prev = r
            L.append("")
        if exp == "threads":
            L += controller_table(recs)
        if exp == "qd1":
            L += stages_table([r for r in records if r["experiment"] == exp and from_skiff_bench(r)],
                              plots.get("qd1-stages", []))
    L += designs_table(records, plots.get("stages", []))
    L.append("## Notes\n")
    L.append("- Systems alternate at every point (the order rotates from point to point and from repetition to "
             "repetition), so drift on this shared machine spreads over all of them; compare ratios within one "
             "run.")
    L.append("- \"cores busy\" is CPU seconds per second of the run, all fio jobs together / the server. On two "
             "cores a fio job near 1.0 is the bottleneck: it polls or works flat out, and its CPU per I/O is then "
             "one core divided by its IOPS, not a cost the server imposes. fio's nbd engine (libnbd) and skiff's "
             "fio engine both reach this at moderate queue depth with one job, which caps every system's IOPS "
             "there.")
    L.append("- Client CPU from fio counts the job threads only; `client_tree_cpu_us_per_io` in records.jsonl "
             "is the whole fio process tree (wait4), a cross-check that includes fio's main process.")
    with open(os.path.join(outdir, "report.md"), "w") as f:
        f.write("\n".join(L) + "\n")


# ---------------------------------------------------------------------------------------------
# Plots


def plot_all(outdir, a, meta, records):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plots = {}
    systems = meta["systems"]
    machine_title = title_machine(meta)
    sub = f"{machine_title}, fio, {a.runtime} s per point"
    kfmt = FuncFormatter(lambda v, _: f"{v / 1000:,.0f}K" if v >= 1000 else f"{v:,.0f}")

    def ok(exp):
        return [r for r in records if r["experiment"] == exp and "error" not in r and not from_skiff_bench(r)]

    def line(ax, xs, ys, s, **kw):
        ax.plot(xs, ys, marker=MARKERS.get(s, "o"), color=COLORS.get(s), label=s, linewidth=1.8, markersize=5, **kw)

    def save(fig, name, exp):
        path = os.path.join(outdir, name)
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        plots.setdefault(exp, []).append(name)

    def grouped_bars(axes, labels, series, fontsize=None):
        """Two panels of bar groups, one group per label and one bar per series in each:
        `series` is [(name, [(left value, right value) per label])]. A series with nothing to
        show keeps its slot, so every system sits at the same offset in every plot."""
        width = 0.8 / max(1, len(series))
        for i, (name, vals) in enumerate(series):
            if not any(left for left, _ in vals):
                continue
            xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(labels))]
            axes[0].bar(xs, [v[0] for v in vals], width, color=COLORS.get(name), label=name)
            axes[1].bar(xs, [v[1] for v in vals], width, color=COLORS.get(name), label=name)
        for ax in axes:
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, fontsize=fontsize)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=8)

    def pow2_axis(ax, vals):
        ax.set_xscale("log", base=2)
        ax.set_xticks(vals)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())

    # Load sweep: IOPS vs mean latency and vs p99, one figure per direction.
    recs = ok("load")
    for rw in dict.fromkeys(r["point"]["rw"] for r in recs):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
        for ax, key, lab in ((axes[0], "lat_mean_us", "mean"), (axes[1], "lat_p99_us", "p99")):
            for s in systems:
                pts = sorted((r["point"]["qd"], r["iops"], r[key]) for r in recs
                             if r["system"] == s and r["point"]["rw"] == rw and r[key])
                if not pts:
                    continue
                line(ax, [p[1] for p in pts], [p[2] for p in pts], s)
                for qd, x, y in (pts[0], pts[-1]):
                    ax.annotate(f"QD{qd}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                                color=COLORS.get(s))
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(
                lambda v, _: f"{v:,.0f}" if str(int(round(v)))[0] in "25" else ""))
            ax.set_xlabel("IOPS")
            ax.xaxis.set_major_formatter(kfmt)
            ax.set_ylabel(f"{lab} latency (µs, log)")
            ax.set_title(f"IOPS vs {lab} latency")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        qds = [r["point"]["qd"] for r in recs if r["point"]["rw"] == rw]
        fig.suptitle(f"Load sweep: 4 KiB {rw}, 1 job, QD {min(qds)}-{max(qds)} ({sub})")
        save(fig, f"load-{rw}.png", "load")

    def iops_and_cpu(axes, series):
        """Left: IOPS; right: server CPU per I/O (solid) and fio client CPU (dotted), per system.
        `series(system)` gives sorted (x, iops, client µs/I/O, server µs/I/O) points."""
        for s in systems:
            pts = series(s)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            line(axes[0], xs, [p[1] for p in pts], s)
            line(axes[1], xs, [p[3] for p in pts], s)
            axes[1].plot(xs, [p[2] for p in pts], color=COLORS.get(s), linestyle=":",
                         linewidth=1.2, marker=MARKERS.get(s), markersize=3, markerfacecolor="none")
        axes[0].set_ylabel("IOPS")
        axes[0].yaxis.set_major_formatter(kfmt)
        axes[0].set_ylim(bottom=0)
        axes[0].set_title("Throughput")
        axes[1].set_ylabel("CPU µs per I/O")
        axes[1].set_ylim(bottom=0)
        axes[1].set_title("CPU per I/O: server (solid), fio client (dotted)")

    # Read/write mix: IOPS and CPU per I/O against read share.
    recs = ok("mix")
    if recs:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
        iops_and_cpu(axes, lambda s: sorted(
            (r["point"]["read_pct"], r["iops"], r["client_cpu_us_per_io"], r["server_cpu_us_per_io"])
            for r in recs if r["system"] == s))
        for ax in axes:
            ax.set_xlabel("read share (%)")
            ax.set_xticks(sorted({r["point"]["read_pct"] for r in recs}))
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"Read/write mix: 4 KiB random, 1 job, QD {recs[0]['point']['qd']} ({sub})")
        save(fig, "mix.png", "mix")

    # Thread sweep: IOPS and CPU per I/O against jobs, one figure per direction.
    recs = ok("threads")
    for rw in dict.fromkeys(r["point"]["rw"] for r in recs):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
        ns = sorted({r["point"]["numjobs"] for r in recs if r["point"]["rw"] == rw})
        iops_and_cpu(axes, lambda s, rw=rw: sorted(
            (r["point"]["numjobs"], r["iops"], r["client_cpu_us_per_io"], r["server_cpu_us_per_io"])
            for r in recs if r["system"] == s and r["point"]["rw"] == rw))
        for ax in axes:
            pow2_axis(ax, ns)
            ax.set_xlabel("fio jobs (log scale), QD 4 each")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"Thread sweep: 4 KiB {rw}, N jobs x QD 4 ({sub})")
        save(fig, f"threads-{rw}.png", "threads")

    # Mixed sizes over time.
    recs = ok("sizes")
    link = meta.get("link", {}).get("bytes_per_s")
    if recs:
        fig, axes = plt.subplots(1, 3 if link else 2, figsize=(18 if link else 12, 4.6))
        T = recs[0]["point"]["interval_s"]
        S = recs[0]["point"]["streams"]
        for r in sorted(recs, key=lambda r: systems.index(r["system"])):
            s = r["system"]
            iv = r.get("intervals", [])
            xs = [i["t_s"] for i in iv]
            line(axes[0], xs, [i["small_iops"] for i in iv], s)
            line(axes[1], xs, [i["big_bytes_s"] / 1e6 for i in iv], s)
            if link:
                line(axes[2], xs, [100 * (i["small_iops"] * 4096 + i["big_bytes_s"]) / link for i in iv], s)
        if link:
            axes[2].set_ylabel("payload bytes/s, % of the bulk TCP stream")
            axes[2].set_title("Link utilisation (Tyche Fig. 8)")
        for ax in axes:
            for k in range(1, S + 1):
                ax.axvline(k * T, color="grey", linestyle="--", linewidth=0.8)
            ax.set_xlabel("time (s); dashed: one more 128 KiB stream starts")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            ax.set_ylim(bottom=0)
        axes[0].set_ylabel("4 KiB IOPS (32 jobs x QD 4)")
        axes[0].yaxis.set_major_formatter(kfmt)
        axes[0].set_title("4 KiB reads")
        axes[1].set_ylabel("128 KiB streams, MB/s")
        axes[1].set_title("128 KiB reads (all streams)")
        fig.suptitle(f"Mixed sizes over time: 32x4 KiB + one 128 KiB reader (QD 1) more every {T} s "
                     f"({machine_title}, fio, 0.5 s windows)")
        save(fig, "sizes.png", "sizes")

    # The ablation: IOPS and CPU per I/O of each step, a group of bars per point.
    recs = ok("ablation")
    if recs:
        pts = list(dict.fromkeys(json.dumps(r["point"], sort_keys=True) for r in recs))
        steps = list(ABLATION_VARIANTS)
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
        series = []
        for name in steps:
            got = [next((r for r in recs if r["system"] == name and json.dumps(r["point"], sort_keys=True) == pt),
                        None) for pt in pts]
            series.append((name, [(r["iops"], r.get("total_cpu_us_per_io") or 0) if r else (0, 0) for r in got]))
        labels = [point_label("ablation", json.loads(pt)).replace(" x ", "\nx ") for pt in pts]
        grouped_bars(axes, labels, series, fontsize=8)
        axes[0].set_ylabel("IOPS")
        axes[0].yaxis.set_major_formatter(kfmt)
        axes[0].set_title("Throughput")
        axes[1].set_ylabel("CPU µs per I/O, fio client + server")
        axes[1].set_title("CPU per I/O")
        fig.suptitle(f"i10's mechanisms one by one (i10 Fig. 10; {sub})")
        save(fig, "ablation.png", "ablation")

    # QD 1 latency and CPU by size.
    recs = ok("qd1")
    if recs:
        rws = list(dict.fromkeys(r["point"]["rw"] for r in recs))
        sizes = sorted({r["point"]["bs"] for r in recs}, key=size_bytes)
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
        groups = [(rw, bs) for rw in rws for bs in sizes]
        series = []
        for s in systems:
            got = [next((r for r in recs if r["system"] == s and r["point"]["rw"] == rw and r["point"]["bs"] == bs),
                        None) for rw, bs in groups]
            series.append((s, [(r["lat_mean_us"], r.get("total_cpu_us_per_io") or 0) if r else (0, 0) for r in got]))
        grouped_bars(axes, [f"{rw.replace('rand', '')}\n{bs.upper()}iB" for rw, bs in groups], series)
        axes[0].set_ylabel("mean end-to-end latency (µs)")
        axes[0].set_title("Latency at QD 1")
        axes[1].set_ylabel("CPU µs per I/O, client + server")
        axes[1].set_title("CPU per I/O at QD 1")
        fig.suptitle(f"QD 1 by size: random, 1 job ({sub})")
        save(fig, "qd1.png", "qd1")

    # Tyche Tables V and VI: latency and server CPU of the three designs by size.
    recs = [r for r in records if r["experiment"] == "stages" and "error" not in r]
    if recs:
        rws = list(dict.fromkeys(r["point"]["rw"] for r in recs))
        sizes = sorted({r["point"]["bs"] for r in recs}, key=size_bytes)
        groups = [(rw, bs) for rw in rws for bs in sizes]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
        series = []
        for s in DESIGNS:
            got = [next((r for r in recs if r["system"] == s and r["point"]["rw"] == rw and r["point"]["bs"] == bs),
                        None) for rw, bs in groups]
            series.append((s, [(r["lat_mean_us"], r.get("server_stats_cpu_us_per_io") or 0) if r else (0, 0)
                               for r in got]))
        grouped_bars(axes, [f"{rw.replace('rand', '')}\n{bs.upper()}iB" for rw, bs in groups], series)
        axes[0].set_ylabel("mean latency (µs), skiff bench")
        axes[0].set_title("Latency at QD 1")
        axes[1].set_ylabel("server CPU µs per I/O (STATS)")
        axes[1].set_title("Target CPU per I/O")
        fig.suptitle(f"Run to completion against a send thread and a receive thread (Tyche Tables V, VI; "
                     f"{machine_title}, skiff bench, {a.runtime} s per point)")
        save(fig, "stages.png", "stages")

    # QD 1 per-stage breakdown of skiff-native, from skiff bench.
    recs = [r for r in records if r["experiment"] == "qd1" and from_skiff_bench(r) and "error" not in r]
    if recs:
        save(plot_qd1_stages(plt, recs, a, machine_title), "qd1-stages.png", "qd1-stages")
    return plots


# Client side warm, target side blue, the unaccounted rest grey.
STAGE_COLORS = {"client_send": "#e6550d", "target_recv": "#9ecae1", "target_exec": "#08519c",
                "target_send": "#4292c6", "client_recv": "#fdae6b", "client_complete": "#a63603",
                "elsewhere": "#d9d9d9"}


def stage_panel(ax, by_bs, sizes, keys):
    """One direction: a stacked bar per size, µs per I/O in each stage, a black mark at the mean
    latency. A negative `elsewhere` (stages that overlapped) is drawn as zero; the mark then sits
    inside the bar."""
    ys = range(len(sizes))
    left = [0.0] * len(sizes)
    for k in keys:
        w = [max(0.0, by_bs[bs]["stages_us"].get(k) or 0) if bs in by_bs else 0 for bs in sizes]
        ax.barh(ys, w, left=left, height=0.6, color=STAGE_COLORS.get(k), edgecolor="white", linewidth=0.5,
                label=k.replace("_", " "))
        left = [x + y for x, y in zip(left, w)]
    for y, bs in zip(ys, sizes):
        if bs not in by_bs:
            continue
        mean = by_bs[bs]["lat_mean_us"]
        ax.plot([mean, mean], [y - 0.4, y + 0.4], color="black", linewidth=2.2,
                label="mean latency" if y == 0 else None)
        ax.annotate(f"mean {mean:.0f} µs", (max(mean, left[y]), y), textcoords="offset points", xytext=(5, 0),
                    va="center", fontsize=8)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([f"{bs.upper()}iB" for bs in sizes])
    ax.invert_yaxis()
    ax.set_xlabel("µs per I/O")
    ax.grid(True, axis="x", alpha=0.3)


def plot_qd1_stages(plt, recs, a, machine_title):
    """skiff bench's per-stage breakdown at QD 1: a panel per direction, a bar per size."""
    rws = list(dict.fromkeys(r["point"]["rw"] for r in recs))
    sizes = sorted({r["point"]["bs"] for r in recs}, key=size_bytes)
    keys = stage_keys(recs)
    fig, axes = plt.subplots(1, len(rws), figsize=(max(10, 6 * len(rws)), 1.6 + 0.7 * len(sizes)),
                             sharex=True, squeeze=False)
    for ax, rw in zip(axes[0], rws):
        stage_panel(ax, {r["point"]["bs"]: r for r in recs if r["point"]["rw"] == rw}, sizes, keys)
        ax.set_title(rw)
    widest = max(max(r["lat_mean_us"], sum(max(0.0, v or 0) for v in r["stages_us"].values())) for r in recs)
    axes[0][0].set_xlim(0, widest * 1.15)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    overlap = any((r["stages_us"].get("elsewhere") or 0) < 0 for r in recs)
    fig.suptitle(f"QD 1 per-stage breakdown: skiff-native, random, 1 thread "
                 f"({machine_title}, skiff bench, {a.runtime} s per point)"
                 + ("\nstages overlapped where the mean mark sits inside its bar (elsewhere < 0, drawn as 0)"
                    if overlap else ""))
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


# ---------------------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="a few points, 2 s each, 3 systems, one repetition (no median): about two minutes")
    p.add_argument("--systems", help=f"comma-separated, from {','.join(SYSTEMS)}")
    p.add_argument("--experiments", default=",".join(EXPERIMENTS), help=f"from {','.join(EXPERIMENTS)}")
    p.add_argument("--runtime", type=int, help="seconds per point (default 4, --quick 2)")
    p.add_argument("--interval", type=int, help="seconds between 128 KiB streams in `sizes` (default 4, quick 2)")
    p.add_argument("--streams", type=int, help="128 KiB streams added in `sizes` (default 3, quick 2)")
    p.add_argument("--link-seconds", type=int, help="iperf3 duration (default 3, quick 2)")
    p.add_argument("--threads-jobs", metavar="N,N", help="fio jobs of the `threads` sweep (default 1 to 128 by powers of 2)")
    p.add_argument("--threads-rw", metavar="RW,RW", help="workloads of the `threads` sweep (default randread,randwrite)")
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--engine", default=ENGINE)
    p.add_argument("--before-engine", metavar="SO",
                   help=f"another build's fio engine, run as system {BEFORE} (its adaptive batching)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--dry-run", action="store_true", help="print the runs and the time estimate, run nothing")
    p.add_argument("--replot", metavar="DIR", help="redo report.md and the plots from DIR's records")
    add_placement_args(p, "runs per point, systems alternating in each round; each figure reported is the median "
                          "(default 3, --quick 1)")
    a = p.parse_args()
    a.repeat = a.repeat if a.repeat is not None else (1 if a.quick else 3)
    if a.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    a.runtime = a.runtime or (2 if a.quick else 4)
    a.interval = a.interval or (2 if a.quick else 4)
    a.streams = a.streams if a.streams is not None else (2 if a.quick else 3)
    a.link_seconds = a.link_seconds or (2 if a.quick else 3)

    if a.replot:
        with open(os.path.join(a.replot, "meta.json")) as f:
            meta = json.load(f)
        with open(os.path.join(a.replot, "records.jsonl")) as f:
            records = [json.loads(l) for l in f if l.strip()]
        a.quick, a.runtime = meta["quick"], meta["runtime_s"]
        # the placement and repetitions of the run being replotted, not of this command line
        a.repeat = meta.get("repeat", 1)
        plots = plot_all(a.replot, a, meta, records)
        write_report(a.replot, a, meta, records, plots)
        log(f"rewrote {a.replot}/report.md")
        return 0

    systems = a.systems.split(",") if a.systems else (QUICK_SYSTEMS if a.quick else SYSTEMS)
    for s in systems:
        if s not in SYSTEMS and s not in VARIANTS:
            raise SystemExit(f"unknown system {s}: choose from {','.join(SYSTEMS + list(VARIANTS))}")
    if BEFORE in systems and not (a.before_engine and os.path.exists(a.before_engine)):
        raise SystemExit(f"{BEFORE} needs --before-engine, the engine .so of the build to compare")
    a.before_engine = a.before_engine and os.path.abspath(a.before_engine)
    exps = a.experiments.split(",")
    for e in exps:
        if e not in EXPERIMENTS:
            raise SystemExit(f"unknown experiment {e}: choose from {','.join(EXPERIMENTS)}")
    # Servers to start: the systems asked for, and what experiments add of their own (runners).
    servers = list(dict.fromkeys(systems + [s for e in exps for s, _ in runners(e, systems)]))
    a.skiff, a.engine = os.path.abspath(a.skiff), os.path.abspath(a.engine)
    a.pl = Placement.from_args(a)  # refuses a placement this machine cannot give
    reps_text = (f"{a.repeat} repetitions per point, median reported" if a.repeat > 1 else
                 "1 repetition per point (no median)" + (": --quick; --repeat 3 for medians" if a.quick else ""))
    log(f"placement: {a.pl.describe()}; {reps_text}")
    if a.dry_run:
        pl = plan(a)
        for e in exps:
            log(f"{e}: " + "; ".join(point_label(e, pt) for pt, _ in pl[e]))
        n = sum(len(pl[e]) for e in exps)
        total = sum(len(runners(e, systems)) for e in exps for _ in pl[e]) * a.repeat
        est = sum(run_estimate(a, e) * len(runners(e, systems)) for e in exps for _ in pl[e]) * a.repeat
        log(f"{len(servers)} systems x {n} points x {a.repeat} repetition{'s' if a.repeat > 1 else ''} = {total} runs, "
            f"about {est / 60 + 0.5:.1f} min")
        return 0
    ensure_needs(a, servers)
    # SIGTERM unwinds like Ctrl-C, through the finally that stops every server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    started = time.strftime("%Y%m%d-%H%M%S")
    outdir = os.path.join(a.out, started)
    os.makedirs(outdir, exist_ok=True)
    meta = {"started": started, "command": " ".join(["python3"] + sys.argv), "quick": a.quick,
            "runtime_s": a.runtime, "systems": servers, "experiments": exps, "machine": machine(),
            "versions": versions(), "placement": a.pl.record(), "repeat": a.repeat}
    try:
        meta["skiff_git"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                           text=True).stdout.strip()
    except OSError:
        pass

    # written now so that `--replot` works on the records of an interrupted run; rewritten at the end
    with open(os.path.join(outdir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)

    pl = plan(a)
    runs = [(e, pt, kw) for e in exps for pt, kw in pl[e]]
    total_runs = sum(len(runners(e, systems)) for e, _, _ in runs) * a.repeat
    est = sum(run_estimate(a, e) * len(runners(e, systems)) for e, _, _ in runs) * a.repeat
    log(f"skiff suite -> {outdir}: {len(servers)} systems x {len(runs)} points x {a.repeat} "
        f"repetition{'s' if a.repeat > 1 else ''} = "
        f"{total_runs} runs, about {est / 60 + 0.5:.1f} min; placement {a.pl.describe()}")

    t_start = time.time()
    records = []
    targets = {}
    scratch = None
    link_samples = []
    recfile = open(os.path.join(outdir, "records.jsonl"), "w")
    logdir = tempfile.mkdtemp(prefix="skiff-suite-")
    try:
        log(f"link reference: iperf3 on loopback, {a.link_seconds} s ...")
        lk = link_reference(a.link_seconds, a.pl)
        if lk:
            link_samples.append(lk["bytes_per_s"])
            log(f"  {lk['bytes_per_s'] / 1e9:.2f} GB/s = {lk['payloads_4k_per_s'] / 1e6:.2f} M 4 KiB payloads/s")
        if "qemu-nbd" in systems:
            scratch, scratch_dir = make_scratch()
            meta["qemu_nbd_file_dir"] = scratch_dir
        for s in servers:
            t0 = time.time()
            t = start_target(s, a, scratch.name if scratch else None)
            targets[s] = t
            precondition(t.precondition_uri, a.pl)
            log(f"started {s} (pid {t.pid}) and wrote its 1 GiB volume in {time.time() - t0:.1f} s")
        link_bps = link_samples[0] if link_samples else None

        n = 0
        who_width = max(len(f"{s} ({c})" if c else s) for e in exps for s, c in runners(e, systems))
        t_runs = time.time()
        for pi, (exp, pt, kw) in enumerate(runs):
            rs = runners(exp, systems)
            good = {r: [] for r in rs}
            errors = {r: [] for r in rs}
            for rep in range(a.repeat):
                # the order rotates from point to point and from round to round
                for s, client in rotate(rs, pi + rep):
                    n += 1
                    who = f"{s} ({client})" if client else s
                    label = (f"[{n:>3}/{total_runs}] {exp:<7} {point_label(exp, pt):<24} {who:<{who_width}} "
                             f"rep {rep + 1}/{a.repeat}")
                    try:
                        if client == SKIFF_BENCH:
                            r = measure_stages(targets[s], a, **kw)
                        elif exp == "sizes":
                            r = run_sizes(targets[s], a, logdir)
                        else:
                            r = measure(targets[s], a, **kw)
                        r["time"] = time.strftime("%H:%M:%S")
                        if link_bps:
                            r["link_util"] = r["bw_bytes_s"] / link_bps
                        good[(s, client)].append(r)
                        el = time.time() - t_runs
                        eta = el / n * (total_runs - n)
                        log(f"{label} {r['iops']:>9,.0f} IOPS {r['lat_mean_us']:>8.1f} µs mean "
                            f"{r['lat_p99_us'] or 0:>8.1f} p99  CPU µs/IO {r['client_cpu_us_per_io']:.2f} + "
                            f"{r['server_cpu_us_per_io']:.2f}  (eta {eta / 60:.1f} min)")
                    except RuntimeError as e:
                        errors[(s, client)].append(str(e))
                        log(f"{label} FAILED: {str(e).splitlines()[0][:200]}")
                        if not targets[s].alive():
                            log(f"  {s} exited: restarting it")
                            targets[s].server.stop()
                            targets[s] = start_target(s, a, scratch.name if scratch else None)
                            precondition(targets[s].precondition_uri, a.pl)
            for s, client in rs:
                rec = {"experiment": exp, "system": s, "point": pt, "runtime_s": a.runtime,
                       "time": time.strftime("%H:%M:%S")}
                if client:
                    rec["client"] = client
                reps = good[(s, client)]
                if reps:
                    rec.update(median_record(reps))
                    rec["time"] = reps[0]["time"]
                    if a.repeat > 1:
                        who = f"{s} ({client})" if client else s
                        log(f"{'':>9} {exp:<7} {point_label(exp, pt):<24} {who:<{who_width}} median of {len(reps)}"
                            f" {rec['iops']:>9,.0f} IOPS {rec['lat_mean_us']:>8.1f} µs mean")
                else:
                    rec["error"] = errors[(s, client)][0]
                if errors[(s, client)]:
                    rec["rep_errors"] = errors[(s, client)]
                rec.update(placement=a.pl.record(), repeat=a.repeat, repetitions=reps)
                records.append(rec)
                recfile.write(json.dumps(rec) + "\n")
                recfile.flush()

        log(f"link reference again: iperf3 on loopback, {a.link_seconds} s ...")
    finally:
        for t in targets.values():
            t.server.stop()
        if scratch:
            scratch.close()
        recfile.close()
        shutil.rmtree(logdir, ignore_errors=True)
    lk2 = link_reference(a.link_seconds, a.pl)
    if lk2:
        link_samples.append(lk2["bytes_per_s"])
        log(f"  {lk2['bytes_per_s'] / 1e9:.2f} GB/s")
    if link_samples:
        bps = sum(link_samples) / len(link_samples)
        meta["link"] = {"bytes_per_s": bps, "payloads_4k_per_s": bps / 4096, "samples_bytes_per_s": link_samples,
                        "seconds": a.link_seconds, "tool": "iperf3 -c 127.0.0.1", "placement": a.pl.record()}
        # utilisation against the mean of both samples
        for r in records:
            for x in [r] + r.get("repetitions", []):
                if "bw_bytes_s" in x:
                    x["link_util"] = x["bw_bytes_s"] / bps
        with open(os.path.join(outdir, "records.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    meta["wall_s"] = time.time() - t_start
    with open(os.path.join(outdir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    plots = plot_all(outdir, a, meta, records)
    write_report(outdir, a, meta, records, plots)
    log(f"done in {meta['wall_s'] / 60:.1f} min: {outdir}/report.md, records.jsonl, "
        f"{sum(len(v) for v in plots.values())} plots")
    return 1 if any("error" in r or r.get("rep_errors") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
