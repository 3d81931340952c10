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

    python3 bench/compare.py                       # randread+randwrite, QD 32 and 128, 10 s each
    python3 bench/compare.py --rw randread --qd 1,32 --runtime 5 --systems skiff-nbd,nbdkit
Writes bench/results/compare-<time>.json and prints a Markdown table.
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")
SYSTEMS = ["skiff-native", "skiff-nbd", "nbdkit", "qemu-nbd"]


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
    if system == "skiff-nbd":
        argv = [a.skiff, "serve", "--no-tcp", "--nbd", f"127.0.0.1:{port}", "--export", "vol=ram:1G"]
        return Server(argv, port), f"nbd://127.0.0.1:{port}/vol"
    if system == "nbdkit":
        argv = ["nbdkit", "--foreground", "--ipaddr", "127.0.0.1", "--port", str(port), "memory", "1G"]
        return Server(argv, port), f"nbd://127.0.0.1:{port}/"
    if system == "qemu-nbd":
        # qemu-nbd's own defaults did best here; its file holds data, like the RAM volumes
        # (a sparse file reads as holes and roughly doubles its read IOPS, which flatters it).
        argv = ["qemu-nbd", "--persistent", "--shared=8", "--bind", "127.0.0.1", "--port", str(port),
                "--format", "raw", scratch]
        return Server(argv, port), f"nbd://127.0.0.1:{port}/"
    raise ValueError(system)


def precondition(uri):
    """Write the whole volume once, untimed: the first touch of fresh memory (page faults,
    transparent huge pages being zeroed) costs every RAM-backed server several microseconds per
    I/O and would otherwise be charged to whichever run comes first."""
    subprocess.run(["fio", "--name=precondition", "--ioengine=nbd", f"--uri={uri}", "--rw=write", "--bs=1M",
                    "--iodepth=8", "--size=1G", "--output-format=json"], check=True, capture_output=True)


def run_fio(system, a, rw, qd, scratch):
    server, uri = start_nbd_server(system, a, scratch)
    try:
        precondition(uri)
        server.cpu0 = cpu_s(server.proc.pid)
        out = subprocess.run(
            ["fio", f"--name={system}", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={a.bs}",
             f"--iodepth={qd}", f"--runtime={a.runtime}", "--time_based", "--size=1G", "--output-format=json"],
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
        "client_cpu_us_per_io": (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * runtime_s * 1e6 / ios,
        "server_cpu_us_per_io": server_cpu * 1e6 / ios,
        "client_ctx_per_io": job["ctx"] / ios,
    }


def run_skiff_native(a, rw, qd):
    port = free_port()
    nbd_port = free_port()
    server = Server([a.skiff, "serve", "--listen", f"127.0.0.1:{port}", "--nbd", f"127.0.0.1:{nbd_port}",
                     "--export", "vol=ram:1G"], port)
    try:
        precondition(f"nbd://127.0.0.1:{nbd_port}/vol")
        server.cpu0 = cpu_s(server.proc.pid)
        out = subprocess.run(
            [a.skiff, "bench", "--target", f"127.0.0.1:{port}", "--export", "vol", "--rw", rw, "--bs", a.bs,
             "--qd", str(qd), "--duration", f"{a.runtime}s", "--json"],
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


def link_reference(seconds):
    """Bulk TCP stream on loopback with iperf3; bytes/s received."""
    port = free_port()
    srv = subprocess.Popen(["iperf3", "-s", "-p", str(port), "-B", "127.0.0.1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        d, why = None, ""
        for _ in range(30):
            time.sleep(0.2)
            r = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds), "-J"],
                               capture_output=True, text=True)
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
                "tool": "iperf3 -c 127.0.0.1"}
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
    a = p.parse_args()
    systems = a.systems.split(",")
    for tool in ["fio"] + [s for s in systems if s in ("nbdkit", "qemu-nbd")]:
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed (apt-get install fio nbdkit qemu-utils)")
    if not os.access(a.skiff, os.X_OK):
        raise SystemExit(f"{a.skiff} not found: cargo build --release --bin skiff")

    scratch, scratch_dir = make_scratch()

    links = []
    if a.link_seconds and shutil.which("iperf3"):
        print(f"  link reference: iperf3 on loopback, {a.link_seconds} s ...", file=sys.stderr)
        links.append(link_reference(a.link_seconds))
    elif a.link_seconds:
        print("  iperf3 is not installed (apt-get install iperf3): no link reference", file=sys.stderr)
    records = []
    for rw in a.rw.split(","):
        for qd in [int(q) for q in a.qd.split(",")]:
            for system in systems:
                print(f"  {system:<13} {rw:<9} qd={qd:<4} ...", end="", flush=True, file=sys.stderr)
                r = run_skiff_native(a, rw, qd) if system == "skiff-native" else run_fio(system, a, rw, qd, scratch.name)
                r.update(system=system, rw=rw, qd=qd, bs=a.bs, runtime_s=a.runtime)
                records.append(r)
                print(f" {r['iops']:>10,.0f} IOPS", file=sys.stderr)

    if links:
        print(f"  link reference again: iperf3, {a.link_seconds} s ...", file=sys.stderr)
        links.append(link_reference(a.link_seconds))
    links = [lk for lk in links if lk]
    link_bps = min(lk["bytes_per_s"] for lk in links) if links else None

    print(f"\n4 KiB loopback, one client thread, {a.runtime} s per run, {os.cpu_count()} cores; "
          f"qemu-nbd file on {scratch_dir}")
    if link_bps:
        print(f"link reference (iperf3 bulk stream on loopback, before and after, lower kept): "
              f"{link_bps / 1e9:.2f} GB/s = {link_bps / 4096:,.0f} 4 KiB payloads/s\n")
    print("| workload | system | client | IOPS | vs nbdkit | of link | mean µs | p99 µs | CPU µs/I/O client "
          "| server | total | total vs nbdkit | server vs nbdkit |")
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
        json.dump({"machine": {"cores": os.cpu_count()}, "link_reference": links, "records": records}, f, indent=2)
    print(f"\nrecords: {path}")


if __name__ == "__main__":
    sys.exit(main())
