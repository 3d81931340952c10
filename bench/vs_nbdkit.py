#!/usr/bin/env python3
"""Side by side on loopback: skiff's native path against nbdkit driven by fio's nbd engine.

One workload (4 KiB random read by default, QD 32, one client thread), run back to back in one
invocation so the figures share the machine's state. CPU per I/O is measured for each process
separately: nbdkit's and skiff serve's from /proc/PID/stat over the run, fio's from its own
usr/sys report, skiff bench's from its JSON (its lane threads). This is the foundation's quick
comparison; the full suite with qemu-nbd, a link reference and plots comes with the benchmark
issues.

    python3 bench/vs_nbdkit.py [--rw randread] [--qd 32] [--runtime 10] [--skiff target/release/skiff]
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid):
    """User + system CPU seconds of a process (all its threads), from procfs."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def wait_port(port, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listening on port {port}")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_nbdkit(a):
    port = free_port()
    server = subprocess.Popen(["nbdkit", "--foreground", "--ipaddr", "127.0.0.1", "--port", str(port), "memory", "1G"])
    try:
        wait_port(port)
        before = cpu_s(server.pid)
        out = subprocess.run(
            ["fio", "--name=nbdkit", "--ioengine=nbd", f"--uri=nbd://127.0.0.1:{port}/", f"--rw={a.rw}",
             f"--bs={a.bs}", f"--iodepth={a.qd}", f"--runtime={a.runtime}", "--time_based", "--size=1G",
             "--output-format=json"],
            check=True, capture_output=True, text=True).stdout
        server_cpu = cpu_s(server.pid) - before
    finally:
        server.terminate()
        server.wait()
    # fio prints "fio: connected to NBD server" before the JSON document.
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read"] if job["read"]["io_bytes"] > 0 else job["write"]
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    runtime_s = side["runtime"] / 1000.0
    client_cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * runtime_s
    lat = side["clat_ns"]
    return {
        "system": "nbdkit memory 1G + fio nbd",
        "iops": ios / runtime_s,
        "lat_mean_us": lat["mean"] / 1000, "lat_p99_us": lat["percentile"]["99.000000"] / 1000,
        "client_cpu_us_per_io": client_cpu * 1e6 / ios,
        "server_cpu_us_per_io": server_cpu * 1e6 / ios,
        "client_ctx_per_io": job["ctx"] / ios,
    }


def run_skiff(a):
    port = free_port()
    server = subprocess.Popen([a.skiff, "serve", "--listen", f"127.0.0.1:{port}", "--export", "vol=ram:1G"],
                              stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        before = cpu_s(server.pid)
        out = subprocess.run(
            [a.skiff, "bench", "--target", f"127.0.0.1:{port}", "--export", "vol", "--rw", a.rw, "--bs", a.bs,
             "--qd", str(a.qd), "--duration", f"{a.runtime}s", "--json"],
            check=True, capture_output=True, text=True).stdout
        process_cpu = cpu_s(server.pid) - before
    finally:
        server.terminate()
        server.wait()
    r = json.loads(out)
    return {
        "system": "skiff serve + skiff bench",
        "iops": r["iops"],
        "lat_mean_us": r["lat_us"]["mean"], "lat_p99_us": r["lat_us"]["p99"],
        "client_cpu_us_per_io": r["client_cpu_us_per_io"],
        # The process figure includes the whole run (connect and handshake too); the stats figure
        # counts the target's threads over the timed phase. Both are shown; they should agree.
        "server_cpu_us_per_io": process_cpu * 1e6 / r["ios"],
        "server_cpu_us_per_io_stats": r["server_cpu_us_per_io"],
        "client_ctx_per_io": r["client_ctx_switches_per_io"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rw", default="randread")
    p.add_argument("--bs", default="4k")
    p.add_argument("--qd", type=int, default=32)
    p.add_argument("--runtime", type=int, default=10)
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--json", help="also write the records to this file")
    a = p.parse_args()
    for tool in ("nbdkit", "fio"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed (apt-get install nbdkit fio)")
    rows = [run_nbdkit(a), run_skiff(a)]
    print(f"{a.rw} bs={a.bs} qd={a.qd} one client thread, {a.runtime}s each, loopback, {os.cpu_count()} cores")
    print(f"{'system':<28} {'IOPS':>10} {'mean us':>8} {'p99 us':>8} {'cpu us/io client':>17} {'server':>7} {'total':>7}")
    for r in rows:
        total = r["client_cpu_us_per_io"] + r["server_cpu_us_per_io"]
        print(f"{r['system']:<28} {r['iops']:>10,.0f} {r['lat_mean_us']:>8.1f} {r['lat_p99_us']:>8.1f} "
              f"{r['client_cpu_us_per_io']:>17.2f} {r['server_cpu_us_per_io']:>7.2f} {total:>7.2f}")
    base, ours = rows
    base_total = base["client_cpu_us_per_io"] + base["server_cpu_us_per_io"]
    ours_total = ours["client_cpu_us_per_io"] + ours["server_cpu_us_per_io"]
    print(f"skiff / nbdkit: {ours['iops'] / base['iops']:.2f}x IOPS, {ours_total / base_total:.2f}x CPU per I/O")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workload": vars(a), "results": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
