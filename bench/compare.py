#!/usr/bin/env python3
"""Side-by-side comparison on loopback: skiff against nbdkit and qemu-nbd.

Every NBD server (skiff's NBD front end, `nbdkit memory`, `qemu-nbd` on a RAM-backed file) is
driven by the same client, fio's nbd ioengine (libnbd), so the servers differ and nothing else.
skiff's native protocol is measured beside them with `skiff bench`. Systems run back to back in
one invocation, alternating per workload, so they share the machine's state.

Every volume is written once, untimed, before its measured run (see `precondition`). The link
reference, a bulk TCP stream on the same loopback (iperf3), is measured before and after the
runs, and each row's 4 KiB payload rate is shown as a share of it.

CPU per I/O is measured for each process separately: servers from /proc/PID/stat (all
threads) over the run, fio from its own usr/sys report, skiff bench from its JSON (its lane
threads over the timed phase).

Placement models two machines by default: every server (skiff serve, nbdkit, qemu-nbd,
iperf3 -s) runs under `taskset -c 1`, every client (skiff bench, fio, iperf3 -c) under
`taskset -c 0`. On a small VM a wake-up across cores costs tens of microseconds, so unpinned
runs measure where the scheduler happened to put the two sides (docs/BENCHMARKS.md).
`--placement same` puts both on CPU 0, `--placement none` runs without taskset. Each point is
run --repeat times (default 3), systems alternating within every round, and the median of each
figure is reported; every repetition is kept in the JSON.

    python3 bench/compare.py                       # randread+randwrite, QD 32 and 128, 10 s each
    python3 bench/compare.py --rw randread --qd 1,32 --runtime 5 --systems skiff-nbd,nbdkit
    python3 bench/compare.py --placement none --repeat 1   # the old unpinned, single-run behaviour
Writes bench/results/compare-<time>.json and prints a Markdown table.
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")
SYSTEMS = ["skiff-native", "skiff-nbd", "nbdkit", "qemu-nbd"]
PLACEMENTS = ["apart", "same", "none"]
# Default CPUs per placement: (server, client). apart models two machines, same one machine.
DEFAULT_CPUS = {"apart": ("1", "0"), "same": ("0", "0")}


# ---------------------------------------------------------------------------------------------
# Placement: which CPUs the servers and the clients may run on (shared with suite.py)


def parse_cpus(text):
    """A taskset-style CPU list ("1", "0,2", "2-3") as a set of ints."""
    cpus = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SystemExit(f"bad CPU list {text!r}: use numbers and ranges, e.g. 1 or 0,2 or 2-3")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise SystemExit(f"bad CPU list {text!r}: it names no CPU")
    return cpus


class Placement:
    """Where servers and clients run. `server(argv)` and `client(argv)` prefix an argv with
    `taskset -c <cpus>` (util-linux), or leave it alone for the mode `none`. taskset execs its
    command, so the pid of the Popen is the pinned process itself."""

    def __init__(self, mode, server_cpus=None, client_cpus=None):
        self.mode, self.server_cpus, self.client_cpus = mode, server_cpus, client_cpus

    @classmethod
    def from_args(cls, a):
        mode = a.placement
        if mode == "none":
            if a.server_cpu is not None or a.client_cpu is not None:
                raise SystemExit("--server-cpu/--client-cpu need --placement apart or same (none runs without taskset)")
            return cls("none")
        srv = a.server_cpu if a.server_cpu is not None else DEFAULT_CPUS[mode][0]
        cli = a.client_cpu if a.client_cpu is not None else DEFAULT_CPUS[mode][1]
        if mode == "same" and (a.server_cpu is None) != (a.client_cpu is None):
            srv = cli = a.server_cpu if a.server_cpu is not None else a.client_cpu  # one override moves both
        s_set, c_set = parse_cpus(srv), parse_cpus(cli)
        if mode == "apart" and s_set & c_set:
            raise SystemExit(f"--placement apart needs disjoint CPUs, but the server ({srv}) and the client ({cli}) "
                             f"share {','.join(map(str, sorted(s_set & c_set)))}; use --placement same for one core")
        if mode == "same" and s_set != c_set:
            raise SystemExit(f"--placement same puts server and client on the same CPUs, not {srv} and {cli}")
        have = os.sched_getaffinity(0)  # the CPUs this machine (and any cpuset around us) lets us use
        need = s_set | c_set
        if not need <= have:
            cpus = lambda c: ",".join(map(str, sorted(c)))  # noqa: E731
            raise SystemExit(
                f"--placement {mode} needs {len(need)} CPU(s) ({cls._describe(mode, srv, cli)}), but this machine "
                f"has {len(have)} usable (CPU {cpus(have)}): CPU {cpus(need - have)} is not there. "
                f"Use --placement same (one core) or none (no pinning), or pick CPUs with --server-cpu/--client-cpu.")
        if not shutil.which("taskset"):
            raise SystemExit("taskset is not installed (apt-get install util-linux), or use --placement none")
        return cls(mode, srv, cli)

    @staticmethod
    def _describe(mode, srv, cli):
        if mode == "none":
            return "no pinning: the scheduler places servers and clients"
        if mode == "same":
            return f"servers and clients on CPU {srv}"
        return f"servers on CPU {srv}, clients on CPU {cli}"

    def describe(self):
        return f"{self.mode} ({self._describe(self.mode, self.server_cpus, self.client_cpus)})"

    def short(self):
        """For plot titles and table headings."""
        if self.mode == "none":
            return "unpinned"
        if self.mode == "same":
            return f"server+client on CPU {self.server_cpus}"
        return f"server CPU {self.server_cpus}, client CPU {self.client_cpus}"

    def record(self):
        return {"mode": self.mode, "server_cpus": self.server_cpus, "client_cpus": self.client_cpus}

    @classmethod
    def from_record(cls, d):
        if not d:
            return None
        return cls(d.get("mode"), d.get("server_cpus"), d.get("client_cpus"))

    def _pin(self, cpus, argv):
        return list(argv) if self.mode == "none" else ["taskset", "-c", cpus] + list(argv)

    def server(self, argv):
        return self._pin(self.server_cpus, argv)

    def client(self, argv):
        return self._pin(self.client_cpus, argv)


UNPINNED = Placement("none")


def add_placement_args(p, repeat_help):
    p.add_argument("--placement", choices=PLACEMENTS, default="apart",
                   help="apart (default): servers on CPU 1, clients on CPU 0, two machines modelled; same: both on "
                        "CPU 0; none: no taskset, the scheduler decides")
    p.add_argument("--server-cpu", metavar="CPUS", help="taskset CPU list for every server (overrides the placement's)")
    p.add_argument("--client-cpu", metavar="CPUS", help="taskset CPU list for every client (overrides the placement's)")
    p.add_argument("--repeat", type=int, metavar="N", help=repeat_help)


def parse_bench_args(p, repeat=3):
    """Add what the skiff bench scripts share (--skiff, --out, the placement) to parser `p`,
    and parse: the repetitions default to `repeat`, and `a.pl` is the placement."""
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--out", default="bench/results")
    add_placement_args(p, f"runs per point (default {repeat})")
    a = p.parse_args()
    a.repeat = a.repeat or repeat
    a.pl = Placement.from_args(a)
    return a


# ---------------------------------------------------------------------------------------------
# Repetitions


def median_record(reps, key="iops"):
    """One record from the repetitions of one run: every number is the median of its
    repetitions, figure by figure (nested dicts key by key, lists of equal length element by
    element); anything else (strings, lists that differ in length) comes from the repetition
    whose `key` is the median (the lower one of an even count)."""
    order = sorted(reps, key=lambda r: r.get(key) or 0)
    mid = order[(len(order) - 1) // 2]

    def med(vals, fallback):
        present = [v for v in vals if v is not None]
        if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
            return statistics.median(present)
        if present and isinstance(fallback, dict) and all(isinstance(v, dict) for v in present):
            return {k: med([v.get(k) for v in present], fv) for k, fv in fallback.items()}
        if (present and isinstance(fallback, list) and all(isinstance(v, list) for v in present)
                and len({len(v) for v in present}) == 1):
            return [med(list(col), f) for col, f in zip(zip(*present), fallback)]
        return fallback
    return med(reps, mid)


def rotate(items, k):
    k %= max(1, len(items))
    return items[k:] + items[:k]


def cpu_s(pid):
    """User + system CPU seconds of a process (all its threads), from procfs."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, timeout=15.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listening on port {port}")


class Server:
    """A server process started for one run and stopped after it."""

    def __init__(self, argv, port):
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(port)
        self.cpu0 = cpu_s(self.proc.pid)

    def cpu(self):
        return cpu_s(self.proc.pid) - self.cpu0

    def stop(self):
        stop(self.proc, timeout=10)


def stop(proc, timeout=5):
    """Ask a process to end, and make sure it does."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_nbd_server(system, a, scratch):
    port = free_port()
    pin = a.pl.server
    if system == "skiff-nbd":
        argv = [a.skiff, "serve", "--no-tcp", "--nbd", f"127.0.0.1:{port}", "--export", "vol=ram:1G"]
        return Server(pin(argv), port), f"nbd://127.0.0.1:{port}/vol"
    if system == "nbdkit":
        argv = ["nbdkit", "--foreground", "--ipaddr", "127.0.0.1", "--port", str(port), "memory", "1G"]
        return Server(pin(argv), port), f"nbd://127.0.0.1:{port}/"
    if system == "qemu-nbd":
        # qemu-nbd's own defaults did best here; its file holds data, like the RAM volumes
        # (a sparse file reads as holes and roughly doubles its read IOPS, which flatters it).
        argv = ["qemu-nbd", "--persistent", "--shared=8", "--bind", "127.0.0.1", "--port", str(port),
                "--format", "raw", scratch]
        return Server(pin(argv), port), f"nbd://127.0.0.1:{port}/"
    raise ValueError(system)


def precondition(uri, placement=UNPINNED):
    """Write the whole volume once, untimed: the first touch of fresh memory (page faults,
    transparent huge pages being zeroed) costs every RAM-backed server several microseconds per
    I/O and would otherwise be charged to whichever run comes first. fio runs where clients run."""
    subprocess.run(placement.client(["fio", "--name=precondition", "--ioengine=nbd", f"--uri={uri}", "--rw=write",
                                     "--bs=1M", "--iodepth=8", "--size=1G", "--output-format=json"]),
                   check=True, capture_output=True)


def run_fio(system, a, rw, qd, scratch, extra=()):
    server, uri = start_nbd_server(system, a, scratch)
    try:
        precondition(uri, a.pl)
        server.cpu0 = cpu_s(server.proc.pid)
        out = subprocess.run(a.pl.client(
            ["fio", f"--name={system}", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={a.bs}",
             f"--iodepth={qd}", f"--runtime={a.runtime}", "--time_based", "--size=1G", "--output-format=json",
             *extra]),
            check=True, capture_output=True, text=True).stdout
        server_cpu = server.cpu()
    finally:
        server.stop()
    # fio's nbd engine prints "fio: connected to NBD server" before the JSON document.
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read"] if job["read"]["io_bytes"] > 0 else job["write"]
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    runtime_s = side["runtime"] / 1000.0
    lat = side["clat_ns"]
    return {
        "client": "fio nbd",
        "iops": ios / runtime_s,
        "lat_mean_us": lat["mean"] / 1000,
        "lat_p99_us": lat["percentile"]["99.000000"] / 1000,
        # fio's `lat`: submission to completion (`clat` above leaves out the submission).
        "lat_submit_mean_us": side["lat_ns"]["mean"] / 1000,
        "client_cpu_us_per_io": (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * runtime_s * 1e6 / ios,
        "server_cpu_us_per_io": server_cpu * 1e6 / ios,
        "client_ctx_per_io": job["ctx"] / ios,
    }


def run_skiff_native(a, rw, qd):
    port = free_port()
    nbd_port = free_port()
    # A separate `skiff serve`, never skiff bench's in-process target, so that it can be placed.
    server = Server(a.pl.server([a.skiff, "serve", "--listen", f"127.0.0.1:{port}", "--nbd", f"127.0.0.1:{nbd_port}",
                                 "--export", "vol=ram:1G"]), port)
    try:
        precondition(f"nbd://127.0.0.1:{nbd_port}/vol", a.pl)
        server.cpu0 = cpu_s(server.proc.pid)
        out = subprocess.run(a.pl.client(
            [a.skiff, "bench", "--target", f"127.0.0.1:{port}", "--export", "vol", "--rw", rw, "--bs", a.bs,
             "--qd", str(qd), "--duration", f"{a.runtime}s", "--json"]),
            check=True, capture_output=True, text=True).stdout
        server_cpu = server.cpu()
    finally:
        server.stop()
    r = json.loads(out)
    return {
        "client": "skiff bench",
        "iops": r["iops"],
        "lat_mean_us": r["lat_us"]["mean"],
        "lat_p99_us": r["lat_us"]["p99"],
        "client_cpu_us_per_io": r["client_cpu_us_per_io"],
        # Whole-process figure (connect and handshake included), like the other servers'.
        "server_cpu_us_per_io": server_cpu * 1e6 / r["ios"],
        "client_ctx_per_io": r["client_ctx_switches_per_io"],
    }


def make_scratch():
    """qemu-nbd's 1 GiB file: on tmpfs when there is room, so that it is RAM-backed like the
    others (else /var/tmp, the page cache), and filled with data, not sparse."""
    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    scratch_dir = "/dev/shm" if shm_free > 2 << 30 else "/var/tmp"
    scratch = tempfile.NamedTemporaryFile(dir=scratch_dir, prefix="skiff-qemu-nbd-", suffix=".img")
    with open(scratch.name, "r+b") as f:
        chunk = b"\x5a" * (1 << 20)
        for _ in range(1024):
            f.write(chunk)
    return scratch, scratch_dir


def link_reference(seconds, placement=UNPINNED):
    """Bulk TCP stream on loopback with iperf3, its server and client placed like the others';
    bytes/s received."""
    port = free_port()
    srv = subprocess.Popen(placement.server(["iperf3", "-s", "-p", str(port), "-B", "127.0.0.1"]),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        d, why = None, ""
        for _ in range(30):
            time.sleep(0.2)
            r = subprocess.run(placement.client(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds),
                                                 "-J"]), capture_output=True, text=True)
            try:
                d = json.loads(r.stdout)
            except ValueError:
                d = None
            if r.returncode == 0 and d and "sum_received" in d.get("end", {}):
                break
            why = (d or {}).get("error") or r.stderr.strip()
            d = None
        if d is None:
            print(f"  link reference: iperf3 failed ({why}); link utilisation will be missing", file=sys.stderr)
            return None
        bps = d["end"]["sum_received"]["bits_per_second"] / 8
        return {"bytes_per_s": bps, "payloads_4k_per_s": bps / 4096, "seconds": seconds,
                "tool": "iperf3 -c 127.0.0.1", "placement": placement.record()}
    finally:
        stop(srv)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rw", default="randread,randwrite")
    p.add_argument("--qd", default="32,128")
    p.add_argument("--bs", default="4k")
    p.add_argument("--runtime", type=int, default=10)
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--link-seconds", type=int, default=5, help="iperf3 bulk stream before and after (0: skip)")
    add_placement_args(p, "runs per point, systems alternating in each round; the median is reported (default 3)")
    a = p.parse_args()
    a.repeat = 3 if a.repeat is None else a.repeat
    if a.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    a.pl = Placement.from_args(a)
    systems = a.systems.split(",")
    for tool in ["fio"] + [s for s in systems if s in ("nbdkit", "qemu-nbd")]:
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed (apt-get install fio nbdkit qemu-utils)")
    if not os.access(a.skiff, os.X_OK):
        raise SystemExit(f"{a.skiff} not found: cargo build --release --bin skiff")
    reps_text = (f"median of {a.repeat} repetitions" if a.repeat > 1 else "1 repetition per point, no median")
    print(f"  placement: {a.pl.describe()}; {reps_text}", file=sys.stderr)

    scratch, scratch_dir = make_scratch()

    links = []
    if a.link_seconds and shutil.which("iperf3"):
        print(f"  link reference: iperf3 on loopback, {a.link_seconds} s ...", file=sys.stderr)
        links.append(link_reference(a.link_seconds, a.pl))
    elif a.link_seconds:
        print("  iperf3 is not installed (apt-get install iperf3): no link reference", file=sys.stderr)
    records = []
    point = 0
    for rw in a.rw.split(","):
        for qd in [int(q) for q in a.qd.split(",")]:
            reps = {s: [] for s in systems}
            for rep in range(a.repeat):
                # The order rotates from round to round, so drift spreads over every system.
                for system in rotate(systems, point + rep):
                    print(f"  {system:<13} {rw:<9} qd={qd:<4} rep {rep + 1}/{a.repeat} ...", end="", flush=True,
                          file=sys.stderr)
                    r = run_skiff_native(a, rw, qd) if system == "skiff-native" else run_fio(system, a, rw, qd,
                                                                                            scratch.name)
                    reps[system].append(r)
                    print(f" {r['iops']:>10,.0f} IOPS", file=sys.stderr)
            point += 1
            for system in systems:
                r = median_record(reps[system])
                r.update(system=system, rw=rw, qd=qd, bs=a.bs, runtime_s=a.runtime, repeat=a.repeat,
                         placement=a.pl.record(), repetitions=reps[system])
                records.append(r)
                if a.repeat > 1:
                    print(f"  {system:<13} {rw:<9} qd={qd:<4} median   {r['iops']:>10,.0f} IOPS", file=sys.stderr)

    if links:
        print(f"  link reference again: iperf3, {a.link_seconds} s ...", file=sys.stderr)
        links.append(link_reference(a.link_seconds, a.pl))
    links = [lk for lk in links if lk]
    link_bps = min(lk["bytes_per_s"] for lk in links) if links else None

    print(f"\n4 KiB loopback, one client thread, {a.runtime} s per run, {os.cpu_count()} cores; "
          f"qemu-nbd file on {scratch_dir}")
    print(f"placement: {a.pl.describe()}{'' if a.pl.mode == 'none' else ', taskset -c'}; figures: {reps_text}")
    if link_bps:
        print(f"link reference (iperf3 bulk stream on loopback, same placement, before and after, lower kept): "
              f"{link_bps / 1e9:.2f} GB/s = {link_bps / 4096:,.0f} 4 KiB payloads/s\n")
    else:
        print()
    print(f"| workload ({a.pl.short()}, {reps_text}) | system | client | IOPS | vs nbdkit | of link | mean µs "
          "| p99 µs | CPU µs/I/O client | server | total | total vs nbdkit | server vs nbdkit |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in records:
        base = next((b for b in records if b["system"] == "nbdkit" and b["rw"] == r["rw"] and b["qd"] == r["qd"]), None)
        total = r["client_cpu_us_per_io"] + r["server_cpu_us_per_io"]
        ratio = f"{r['iops'] / base['iops']:.2f}x" if base else "-"
        cpu_ratio = f"{r['server_cpu_us_per_io'] / base['server_cpu_us_per_io']:.2f}x" if base else "-"
        base_total = base["client_cpu_us_per_io"] + base["server_cpu_us_per_io"] if base else None
        total_ratio = f"{total / base_total:.2f}x" if base_total else "-"
        of_link = f"{r['iops'] * 4096 / link_bps:.0%}" if link_bps and a.bs == "4k" else "-"
        r["link_share"] = r["iops"] * 4096 / link_bps if link_bps and a.bs == "4k" else None
        print(f"| {r['rw']} QD {r['qd']} | {r['system']} | {r['client']} | {r['iops']:,.0f} | {ratio} | {of_link} | "
              f"{r['lat_mean_us']:.1f} | {r['lat_p99_us']:.1f} | {r['client_cpu_us_per_io']:.2f} | "
              f"{r['server_cpu_us_per_io']:.2f} | {total:.2f} | {total_ratio} | {cpu_ratio} |")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, time.strftime("compare-%Y%m%d-%H%M%S.json"))
    with open(path, "w") as f:
        json.dump({"machine": {"cores": os.cpu_count()}, "placement": a.pl.record(), "repeat": a.repeat,
                   "link_reference": links, "records": records}, f, indent=2)
    print(f"\nrecords: {path}")


if __name__ == "__main__":
    sys.exit(main())
