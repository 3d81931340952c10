#!/usr/bin/env python3
"""Flash volumes (FlashNet part 1) beside a `file:` export on ext4 and nbdkit's file plugin.

One invocation measures, on files of the same disk (--dir, /var/tmp by default):

- **I/O**: 4 KiB random reads and writes at each --qd, through one client (fio's nbd engine,
  libnbd, no FUA: fio sends none) against
  - `flash-pool`: a 1 GiB volume of a flash array whose page pool holds it all (--pool-big),
    read once before a read run so that it is resident;
  - `flash-disk`: the same volume with a small pool (--pool-small), so reads go to the device;
    pool misses are read on io_uring while the request waits parked (the default);
  - `flash-disk-sync`: as `flash-disk`, with `--flash-read-depth 0`: misses read on the
    worker's thread (pread), the path before io_uring;
  - `file`: `skiff serve --export vol=file:PATH`, a 1 GiB file on ext4 read and written with
    O_DIRECT;
  - `nbdkit-file`: `nbdkit file PATH` on the same file (through the kernel's page cache, its
    default);
  - `ram`: `skiff serve --export vol=ram:1G`, the reference for reads from the pool (the
    issue's aim: no more CPU per read than a RAM export), filled before each run;
  - `flash-disk-before`: as `flash-disk`, served by another build (--skiff-before), to show a
    change beside the build before it in the same run;
  - `flash-disk-paged`: as `flash-disk`, with a map budget of --map-small (default 64 KiB: a
    few dozen of the volume's 512 leaves), so that most requests read their map leaf back from
    the checkpoint first (docs/FLASH.md, "Memory").
  With --fsync N, writes send a FLUSH after every N (fio's --fsync), and --jobs N runs N fio
  jobs, each on its own NBD connection.
  Every volume is filled with data before the runs (never-written pages read as zeroes for
  free). IOPS, latency and CPU per I/O of server (/proc) and client (fio) are the median of
  --repeat runs, systems alternating in each round.
- **Snapshots** (--snapshot): the time `skiff vol snapshot` takes on a filled 1 GiB volume and
  on a 64 GiB volume with 1 GiB written, and 4 KiB random-write IOPS for --snap-seconds before
  and right after the snapshot (the first writes after it copy on write).
- **Recovery** (--recovery): write N MiB after a clean start, `kill -9` the target, start it
  again and read the recovery's own report ("flash array recovered": groups replayed, ms).
- **Write amplification on a disk** (--wa): `examples/write_amp.rs` on a file of --dir (80/20
  overwrites of a volume at 80% of a 1 GiB array, segregation on and off, measured after
  --wa-warmup volumes' worth of the same overwrites), counting what the
  engine wrote, what the file took, and what the kernel's /proc/diskstats saw reach the disk;
  and the same overwrites (fio, zoned 80/20, 4 KiB, 4 times the 0.8 GiB) through a `file:`
  export of a file on that disk, counted by /proc/diskstats.

Placement as in compare.py: servers on CPU 1, clients on CPU 0 by default.

    python3 bench/flash.py                                    # everything, defaults
    python3 bench/flash.py --qd 32 --rw randwrite --repeat 3 --no-snapshot --no-recovery
Writes bench/results/flash-<time>.json and prints Markdown tables.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # no bench/__pycache__ from importing compare.py

from compare import (Placement, add_placement_args, cpu_s, free_port, median_record, rotate,  # noqa: E402
                     stop, wait_port)

SYSTEMS = ["flash-pool", "flash-disk", "flash-disk-sync", "ram", "file", "nbdkit-file"]
GIB = 1 << 30


def run(argv, **kw):
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw)


class Target:
    """One server process, started for a run; `log` collects a skiff target's stderr."""

    def __init__(self, argv, port, log=None):
        self.log_path = log
        err = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
        wait_port(port, timeout=120)
        self.cpu0 = cpu_s(self.proc.pid)

    def restart_cpu(self):
        self.cpu0 = cpu_s(self.proc.pid)

    def cpu(self):
        return cpu_s(self.proc.pid) - self.cpu0

    def stop(self):
        stop(self.proc, timeout=60)

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def skiff_flash(a, array, cache, log=None, extra=()):
    """`skiff serve --flash`: (target, native address, NBD uri of the volume `vol`)."""
    port, nbd_port = free_port(), free_port()
    argv = [a.skiff, "serve", "--listen", f"127.0.0.1:{port}", "--nbd", f"127.0.0.1:{nbd_port}",
            "--flash", array, "--flash-cache", cache, *extra]
    t = Target(a.pl.server(argv), nbd_port, log)
    wait_port(port)
    return t, f"127.0.0.1:{port}", f"nbd://127.0.0.1:{nbd_port}/vol"


def start(system, a, files):
    if system in ("flash-pool", "flash-disk", "flash-disk-sync", "flash-disk-before", "flash-disk-paged"):
        cache = a.pool_big if system == "flash-pool" else a.pool_small
        # flash-disk-sync: pool misses read on the worker's thread, as before io_uring.
        extra = ["--flash-read-depth", "0"] if system == "flash-disk-sync" else []
        if system == "flash-disk-paged":
            extra = ["--flash-map-budget", a.map_small]
        b = a
        if system == "flash-disk-before":
            if not a.skiff_before:
                raise SystemExit("flash-disk-before needs --skiff-before PATH")
            b = argparse.Namespace(**{**vars(a), "skiff": a.skiff_before})
        t, native, uri = skiff_flash(b, files["array"], cache, extra=extra)
        t.native = native
        return t, uri
    port = free_port()
    if system == "ram":
        argv = [a.skiff, "serve", "--no-tcp", "--nbd", f"127.0.0.1:{port}", "--export", "vol=ram:1G"]
        return Target(a.pl.server(argv), port), f"nbd://127.0.0.1:{port}/vol"
    if system == "file":
        argv = [a.skiff, "serve", "--no-tcp", "--nbd", f"127.0.0.1:{port}", "--export", f"vol=file:{files['file']}"]
        return Target(a.pl.server(argv), port), f"nbd://127.0.0.1:{port}/vol"
    if system == "nbdkit-file":
        argv = ["nbdkit", "--foreground", "--ipaddr", "127.0.0.1", "--port", str(port), "file", files["file"]]
        return Target(a.pl.server(argv), port), f"nbd://127.0.0.1:{port}/"
    raise ValueError(system)


def fio(a, uri, rw, qd, seconds=None, size="1G", bs="4k", extra=()):
    argv = ["fio", "--name=flash", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
            f"--iodepth={qd}", f"--size={size}", "--output-format=json", *extra]
    if getattr(a, "jobs", 1) > 1:
        argv += [f"--numjobs={a.jobs}", "--group_reporting"]
    if seconds:
        argv += [f"--runtime={seconds}", "--time_based"]
    out = run(a.pl.client(argv)).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read"] if job["read"]["io_bytes"] > 0 else job["write"]
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    runtime_s = max(side["runtime"], 1) / 1000.0
    return {
        "iops": ios / runtime_s,
        "ios": ios,
        "lat_mean_us": side["clat_ns"]["mean"] / 1000,
        "lat_p99_us": side["clat_ns"]["percentile"]["99.000000"] / 1000,
        "client_cpu_us_per_io": (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * runtime_s * 1e6 / max(ios, 1),
    }


def measure(system, a, files, rw, qd):
    t, uri = start(system, a, files)
    try:
        if system == "flash-pool" and rw == "randread":
            fio(a, uri, "read", 8, bs="1M")  # bring the volume into the pool, untimed
        if system == "ram":
            fio(a, uri, "write", 8, bs="1M")  # never-written RAM reads the zero page
        t.restart_cpu()
        extra = [f"--fsync={a.fsync}"] if a.fsync and "write" in rw else []
        r = fio(a, uri, rw, qd, seconds=a.runtime, extra=extra)
        r["server_cpu_us_per_io"] = t.cpu() * 1e6 / max(r["ios"], 1)
        if getattr(t, "native", None) and system != "flash-disk-before":
            stats = json.loads(run([a.skiff, "vol", "stats", "--json", "--target", t.native]).stdout)
            r["map_loads"] = stats.get("map_loads", 0)
            r["map_leaves_resident"] = stats.get("map_leaves_resident", 0)
    finally:
        t.stop()
    return r


def prepare(a, scratch):
    """The array (a sparse file, formatted, with a filled 1 GiB volume) and the 1 GiB file."""
    files = {"array": os.path.join(scratch, "array.img"), "file": os.path.join(scratch, "file.img")}
    with open(files["array"], "wb") as f:
        f.truncate(a.array_gib * GIB)
    run([a.skiff, "flash", "format", files["array"]])
    t, native, uri = skiff_flash(a, files["array"], a.pool_small)
    try:
        run([a.skiff, "vol", "create", "vol", "--size", "1G", "--target", native])
        fio(a, uri, "write", 8, bs="1M")
    finally:
        t.stop()
    print("  filling the 1 GiB file ...", file=sys.stderr)
    run(["fio", "--name=fill", f"--filename={files['file']}", "--rw=write", "--bs=1M", "--size=1G",
         "--direct=1", "--output-format=json"])
    return files


def io_runs(a, files):
    records, point = [], 0
    systems = a.systems.split(",")
    for rw in a.rw.split(","):
        for qd in [int(q) for q in a.qd.split(",")]:
            reps = {s: [] for s in systems}
            for rep in range(a.repeat):
                for system in rotate(systems, point + rep):
                    print(f"  {system:<12} {rw:<9} qd={qd:<4} rep {rep + 1}/{a.repeat} ...", end="", flush=True,
                          file=sys.stderr)
                    r = measure(system, a, files, rw, qd)
                    reps[system].append(r)
                    print(f" {r['iops']:>10,.0f} IOPS", file=sys.stderr)
            point += 1
            for system in systems:
                r = median_record(reps[system])
                r.update(system=system, rw=rw, qd=qd, repetitions=reps[system])
                records.append(r)
    return records


def snapshot_runs(a, scratch):
    """Snapshot time of a filled 1 GiB volume and of a 64 GiB one with 1 GiB written."""
    out = []
    for size_gib in (1, 64):
        array = os.path.join(scratch, f"snap-{size_gib}.img")
        with open(array, "wb") as f:
            f.truncate((size_gib + 4) * GIB)
        run([a.skiff, "flash", "format", array])
        t, native, uri = skiff_flash(a, array, a.pool_small)
        try:
            run([a.skiff, "vol", "create", "vol", "--size", f"{size_gib}G", "--target", native])
            fio(a, uri, "write", 8, bs="1M", size="1G")
            before = fio(a, uri, "randwrite", 32, seconds=a.snap_seconds, size="1G")
            took = []
            for i in range(3):
                t0 = time.perf_counter()
                run([a.skiff, "vol", "snapshot", "vol", f"snap{i}", "--target", native])
                took.append(time.perf_counter() - t0)
                if i == 0:
                    after = fio(a, uri, "randwrite", 32, seconds=a.snap_seconds, size="1G")
        finally:
            t.stop()
            os.unlink(array)
        took.sort()
        out.append({"volume_gib": size_gib, "written_gib": 1, "snapshot_s": took, "snapshot_median_s": took[1],
                    "randwrite_before_iops": before["iops"], "randwrite_after_iops": after["iops"]})
        print(f"  snapshot of a {size_gib} GiB volume: {took[1] * 1000:.0f} ms (median of 3)", file=sys.stderr)
    return out


def disk_of(path):
    """The /proc/diskstats line of the disk holding `path`: its (major, minor)."""
    dev = os.stat(path).st_dev
    return os.major(dev), os.minor(dev)


def sectors_written(disk):
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if (int(fields[0]), int(fields[1])) == disk:
                return int(fields[9])
    raise SystemExit(f"disk {disk} is not in /proc/diskstats")


def wa_runs(a, scratch):
    """Write amplification of flash (engine, file and kernel counts) and of a file export."""
    example = os.path.join(os.path.dirname(a.skiff), "examples", "write_amp")
    if not os.access(example, os.X_OK):
        raise SystemExit(f"{example} not found: cargo build --release -p skiff-flash --example write_amp")
    out = []
    for seg in ("on", "off"):
        dev = os.path.join(scratch, "wa.img")
        r = run([example, "--segment-kib", "2048", "--dist", "80/20", "--segregation", seg, "--device", dev,
                 "--warmup", str(a.wa_warmup), "--json"])
        rec = json.loads(r.stdout)
        rec["system"] = "flash"
        out.append(rec)
        os.unlink(dev)
        print(f"  flash segregation {seg}: {rec}", file=sys.stderr)
    # The same overwrites through a file: export on the same disk.
    path = os.path.join(scratch, "wa-file.img")
    run(["fio", "--name=fill", f"--filename={path}", "--rw=write", "--bs=1M", "--size=820M", "--direct=1"])
    disk = disk_of(path)
    port = free_port()
    t = Target(a.pl.server([a.skiff, "serve", "--no-tcp", "--nbd", f"127.0.0.1:{port}", "--export",
                            f"vol=file:{path}"]), port)
    try:
        before = sectors_written(disk)
        user = 4 * 820 * (1 << 20)
        fio(a, f"nbd://127.0.0.1:{port}/vol", "randwrite", 32, size="820M",
            extra=["--random_distribution=zoned:80/20:20/80", f"--io_size={user}", "--end_fsync=1"])
        os.sync()
        kernel = (sectors_written(disk) - before) * 512
    finally:
        t.stop()
    os.unlink(path)
    rec = {"system": "file", "dist": "80/20", "user_pages": user // 4096, "kernel_pages_written": kernel // 4096,
           "write_amplification_kernel": kernel / user}
    out.append(rec)
    print(f"  file export: {rec}", file=sys.stderr)
    return out


RECOVERED = re.compile(r"groups_replayed=(\d+).*pages_read=(\d+).*ms=(\d+)")


def recovery_runs(a, scratch):
    """Recovery after kill -9 against the data written since the last checkpoint."""
    array = os.path.join(scratch, "recovery.img")
    out = []
    for mib in [int(m) for m in a.recovery_mib.split(",")]:
        with open(array, "wb") as f:
            f.truncate(a.array_gib * GIB)
        run([a.skiff, "flash", "format", array])
        t, native, uri = skiff_flash(a, array, a.pool_small)
        run([a.skiff, "vol", "create", "vol", "--size", "1G", "--target", native])
        t.stop()  # a clean stop checkpoints: what follows is all the next start replays
        t, native, uri = skiff_flash(a, array, a.pool_small)
        fio(a, uri, "randwrite", 32, size=f"{mib}M", extra=["--end_fsync=1"])
        t.kill9()
        log = os.path.join(scratch, "recovery.log")
        t0 = time.perf_counter()
        t, native, uri = skiff_flash(a, array, a.pool_small, log=log)
        fio(a, uri, "randread", 1, size="4k")  # the first read served
        start_s = time.perf_counter() - t0
        t.stop()
        m = None
        with open(log) as f:
            for line in f:
                if "flash array recovered" in line:
                    m = RECOVERED.search(line)
        rec = {"written_mib": mib, "start_s": start_s}
        if m:
            rec.update(groups_replayed=int(m[1]), pages_read=int(m[2]), recovery_ms=int(m[3]))
        out.append(rec)
        print(f"  recovery after {mib} MiB since the checkpoint: {rec}", file=sys.stderr)
    os.unlink(array)
    return out


def table(headers, rows):
    """A Markdown table: the first column left-aligned, the others right-aligned."""
    print("\n| " + " | ".join(headers) + " |")
    print("|---|" + "---:|" * (len(headers) - 1))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rw", default="randread,randwrite")
    p.add_argument("--qd", default="1,32,128")
    p.add_argument("--runtime", type=int, default=5, help="seconds per measured run")
    p.add_argument("--array-gib", type=int, default=4, help="size of the array's file (a sparse file)")
    p.add_argument("--pool-big", default="1536M", help="--flash-cache of flash-pool: holds the whole volume")
    p.add_argument("--pool-small", default="64M", help="--flash-cache of flash-disk")
    p.add_argument("--map-small", default="64K", help="--flash-map-budget of flash-disk-paged")
    p.add_argument("--dir", default="/var/tmp", help="where the array and the ext4 file live (one disk)")
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--skiff-before", help="another build of skiff, for the flash-disk-before system")
    p.add_argument("--fsync", type=int, default=0, help="writes: a FLUSH after every N (0: none)")
    p.add_argument("--jobs", type=int, default=1, help="fio jobs, each on its own NBD connection")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--no-io", action="store_true")
    p.add_argument("--no-snapshot", action="store_true")
    p.add_argument("--snap-seconds", type=int, default=3)
    p.add_argument("--no-recovery", action="store_true")
    p.add_argument("--recovery-mib", default="16,64,256")
    p.add_argument("--wa", action="store_true", help="also measure write amplification on the disk (minutes)")
    p.add_argument("--wa-warmup", type=float, default=8,
                   help="volumes' worth of overwrites before the flash runs measure (steady state; 0: from the fill)")
    add_placement_args(p, "runs per point, systems alternating in each round; the median is reported (default 3)")
    a = p.parse_args()
    a.repeat = 3 if a.repeat is None else a.repeat
    a.pl = Placement.from_args(a)
    for tool in ["fio", "nbdkit"]:
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed (apt-get install fio nbdkit)")
    if not os.access(a.skiff, os.X_OK):
        raise SystemExit(f"{a.skiff} not found: cargo build --release --bin skiff")
    print(f"  placement: {a.pl.describe()}; median of {a.repeat}", file=sys.stderr)
    result = {"placement": a.pl.record(), "repeat": a.repeat, "runtime_s": a.runtime, "dir": a.dir,
              "fsync": a.fsync, "jobs": a.jobs, "skiff_before": a.skiff_before,
              "machine": {"cores": os.cpu_count()}}
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="skiff-flash-bench-") as scratch:
        if not a.no_io:
            files = prepare(a, scratch)
            result["io"] = io_runs(a, files)
        if not a.no_snapshot:
            result["snapshot"] = snapshot_runs(a, scratch)
        if not a.no_recovery:
            result["recovery"] = recovery_runs(a, scratch)
        if a.wa:
            result["wa"] = wa_runs(a, scratch)

    flushes = f", a FLUSH after every {a.fsync} writes" if a.fsync else ""
    jobs = f", {a.jobs} connections" if a.jobs > 1 else ""
    print(f"\n4 KiB random I/O through fio's nbd engine (no FUA{flushes}{jobs}), files on {a.dir}; placement "
          f"{a.pl.describe()}; median of {a.repeat} runs of {a.runtime} s, systems alternating")
    if "io" in result:
        rows = []
        for r in result["io"]:
            base = next((b for b in result["io"] if b["system"] == "file" and b["rw"] == r["rw"]
                         and b["qd"] == r["qd"]), None)
            rows.append([f"{r['rw']} QD {r['qd']}", r["system"], f"{r['iops']:,.0f}",
                         f"{r['iops'] / base['iops']:.2f}x" if base else "-", f"{r['lat_mean_us']:.1f}",
                         f"{r['lat_p99_us']:.1f}", f"{r['server_cpu_us_per_io']:.2f}",
                         f"{r['client_cpu_us_per_io']:.2f}"])
        table(["workload", "system", "IOPS", "vs file", "mean µs", "p99 µs", "CPU µs/I/O server", "client"], rows)
    if "snapshot" in result:
        table(["volume", "written", "snapshot (median of 3)", "randwrite QD 32 before", "right after"],
              [[f"{s['volume_gib']} GiB", f"{s['written_gib']} GiB", f"{s['snapshot_median_s'] * 1000:.0f} ms",
                f"{s['randwrite_before_iops']:,.0f}", f"{s['randwrite_after_iops']:,.0f}"]
               for s in result["snapshot"]])
    if "recovery" in result:
        table(["written since the checkpoint", "groups replayed", "pages read", "recovery",
               "start to first read served"],
              [[f"{r['written_mib']} MiB", r.get("groups_replayed", "-"), r.get("pages_read", "-"),
                f"{r.get('recovery_ms', '-')} ms", f"{r['start_s'] * 1000:.0f} ms"] for r in result["recovery"]])
    if "wa" in result:
        rows = []
        for r in result["wa"]:
            user, kern = r["user_pages"], r.get("kernel_pages_written")
            kern_wa = f"{kern / user:.2f}" if kern is not None else "-"
            if r["system"] == "flash":
                rows.append([f"flash, segregation {'on' if r['segregation'] else 'off'}",
                             f"{r['write_amplification']:.2f}", f"{r['device_pages_measured'] / user:.2f}", kern_wa])
            else:
                rows.append(["file: export on ext4", "-", "-", kern_wa])
        table([f"80/20 overwrites, 4 x 0.8 GiB (flash: after {a.wa_warmup:g} more)", "engine's count", "the file's count", "/proc/diskstats"], rows)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, time.strftime("flash-%Y%m%d-%H%M%S.json"))
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nrecords: {path}")


if __name__ == "__main__":
    sys.exit(main())
