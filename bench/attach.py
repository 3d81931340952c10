#!/usr/bin/env python3
"""A file system on a remote export, two ways: skiff attach against nbdfuse.

Both stacks are the same from the loop device up: an export shown as one file through FUSE, a
loop device with direct I/O over it (`losetup --direct-io=on`), ext4 on the loop device,
mounted. Below the FUSE file they differ:

- skiff:   `skiff serve` (RAM export)   <- native protocol, shared lanes ->  `skiff attach`
- nbdfuse: `nbdkit memory`              <- NBD, multi-conn (4)            ->  `nbdfuse`

Workloads on the mounted ext4, driven from the client CPU:

- randwrite: fio, 4 KiB random writes, 4 jobs x QD 8 (libaio, O_DIRECT), every block of every
  job's file written once (`--size` per job) and then read back and checked (`verify=crc32c`);
  IOPS are those of the write phase.
- randread: fio, 4 KiB random reads of those files, 4 jobs x QD 8, `--runtime` seconds, every
  block read checked against the header the write phase put in it.
- smallfiles: a metadata-heavy cycle: `tar -x` of `--files` small files (4 KiB, 100 per
  directory), `sync`, `stat` of every file, `rm -r`, `sync`. Operations are files; ops/s is
  files over the cycle's wall time.

CPU per operation is the user + system time, from /proc/PID/stat over the phase, of the
processes of the stack: the target (skiff serve or nbdkit) and the FUSE daemon (skiff attach or
nbdfuse), each reported and summed, divided by the phase's operations. The kernel's own work
(ext4, the loop device's workers, FUSE) and the workload's (fio, tar) are the same on both
stacks' paths and are not in the sum; fio's own CPU is reported beside it.

Placement follows bench/compare.py: by default servers under `taskset -c 1`, everything else
(FUSE daemons, fio, tar, mkfs) under `taskset -c 0`. Each stack is set up afresh for every
repetition (`--repeat`, default 3), stacks alternate within each round, and the median of each
figure is reported; every repetition is kept in the JSON.

    sudo python3 bench/attach.py                                   # 3 repetitions
    sudo python3 bench/attach.py --size 8M --runtime 2 --files 500 --repeat 1   # a quick check
Writes bench/results/attach-<time>.json and prints a Markdown table. Needs root, fio, nbdkit,
nbdfuse (libnbd-bin), fuse3, e2fsprogs, util-linux.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

sys.dont_write_bytecode = True  # no bench/__pycache__ from importing compare.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import (Placement, add_placement_args, cpu_s, free_port, median_record, rotate,  # noqa: E402
                     stop, wait_port)  # (shared with compare.py)

STACKS = ["skiff", "nbdfuse"]
WORKLOADS = ["randwrite", "randread", "smallfiles"]


def run(argv):
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r


def wait_for(pred, what, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def file_size(path):
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


class Stack:
    """One stack, set up for one repetition and taken down after it, in reverse order, even
    when something fails on the way."""

    def __init__(self, name, a, work):
        self.name, self.a, self.work = name, a, work
        self.server = self.daemon = None
        self.loop = None
        self.fuse_dir = os.path.join(work, f"{name}-fuse")
        self.fs_dir = os.path.join(work, f"{name}-fs")
        os.makedirs(self.fuse_dir, exist_ok=True)
        os.makedirs(self.fs_dir, exist_ok=True)
        self.file = os.path.join(self.fuse_dir, "vol")
        self.mounted = False

    def up(self):
        a, pl = self.a, self.a.pl
        port = free_port()
        size = f"{a.volume_mib}M"
        if self.name == "skiff":
            self.server = subprocess.Popen(pl.server([a.skiff, "serve", "--listen", f"127.0.0.1:{port}",
                                                      "--export", f"vol=ram:{size}"]),
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_port(port)
            self.daemon = subprocess.Popen(pl.client([a.skiff, "attach", "--target", f"127.0.0.1:{port}",
                                                      "--export", "vol", self.fuse_dir] + a.attach_args.split()),
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            self.server = subprocess.Popen(pl.server(["nbdkit", "--foreground", "--ipaddr", "127.0.0.1",
                                                      "--port", str(port), "memory", size]),
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_port(port)
            self.daemon = subprocess.Popen(pl.client(["nbdfuse", self.file, f"nbd://127.0.0.1:{port}"]),
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        want = a.volume_mib << 20
        wait_for(lambda: file_size(self.file) == want or self.daemon.poll() is not None, f"{self.name}'s FUSE file")
        if self.daemon.poll() is not None:
            raise SystemExit(f"{self.name}: the FUSE daemon exited ({self.daemon.returncode})")
        self.loop = run(["losetup", "--find", "--show", "--direct-io=on", self.file]).stdout.strip()
        dio = open(f"/sys/block/{os.path.basename(self.loop)}/loop/dio").read().strip() == "1"
        # Inode tables and journal written now, not by ext4's lazy init during the runs.
        run(pl.client(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", self.loop]))
        run(["mount", self.loop, self.fs_dir])
        self.mounted = True
        return dio

    def cpu(self):
        return {"server": cpu_s(self.server.pid), "daemon": cpu_s(self.daemon.pid)}

    def down(self):
        if self.mounted:
            subprocess.run(["umount", self.fs_dir], capture_output=True)
            self.mounted = False
        if self.loop:
            for _ in range(50):
                if subprocess.run(["losetup", "-d", self.loop], capture_output=True).returncode == 0:
                    break
                time.sleep(0.1)
            self.loop = None
        if self.daemon:
            if self.name == "skiff":
                stop(self.daemon, timeout=20)  # SIGTERM: skiff attach unmounts and exits
            else:
                subprocess.run(["fusermount3", "-u", self.fuse_dir], capture_output=True)
                stop(self.daemon, timeout=20)
            if os.path.ismount(self.fuse_dir):
                subprocess.run(["umount", "-l", self.fuse_dir], capture_output=True)
            self.daemon = None
        if self.server:
            stop(self.server, timeout=10)
            self.server = None


def fio(a, stack, rw, extra):
    # One job name for both workloads: randread reads the files randwrite wrote (and checked).
    argv = ["fio", "--name=data", f"--directory={stack.fs_dir}", f"--rw={rw}", "--bs=4k", "--ioengine=libaio",
            "--direct=1", "--iodepth=8", "--numjobs=4", f"--size={a.size}", "--group_reporting",
            "--verify=crc32c", "--verify_fatal=1", "--output-format=json"] + extra
    out = run(a.pl.client(argv)).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    if job["error"]:
        raise SystemExit(f"{stack.name} {rw}: fio error {job['error']}")
    side = job["write"] if rw == "randwrite" else job["read"]
    runtime_s = side["runtime"] / 1000.0
    ios = side["total_ios"]
    return {"ops": ios, "seconds": runtime_s, "ops_per_s": side["iops"], "lat_mean_us": side["clat_ns"]["mean"] / 1000,
            "lat_p99_us": side["clat_ns"]["percentile"]["99.000000"] / 1000,
            # fio's usr/sys cover the whole job (for randwrite, the verify pass as well).
            "fio_cpu_s": (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job["job_runtime"] / 1000.0}


def make_tarball(a, work):
    """`--files` files of 4 KiB, 100 per directory, made once and extracted by every run."""
    path = os.path.join(work, "smallfiles.tar")
    src = os.path.join(work, "smallfiles-src")
    for i in range(a.files):
        d = os.path.join(src, f"d{i // 100:04d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i:06d}"), "wb") as f:
            f.write(os.urandom(4096))
    with tarfile.open(path, "w") as t:
        t.add(src, arcname="tree")
    shutil.rmtree(src)
    return path


def smallfiles(a, stack, tarball):
    tree = os.path.join(stack.fs_dir, "tree")
    started = time.monotonic()
    run(a.pl.client(["tar", "-xf", tarball, "-C", stack.fs_dir]))
    run(a.pl.client(["sync", "-f", stack.fs_dir]))
    run(a.pl.client(["find", tree, "-type", "f", "-exec", "stat", "--format=%s", "{}", "+"]))
    run(a.pl.client(["rm", "-r", tree]))
    run(a.pl.client(["sync", "-f", stack.fs_dir]))
    seconds = time.monotonic() - started
    return {"ops": a.files, "seconds": seconds, "ops_per_s": a.files / seconds}


def measure(a, stack, workload, tarball):
    before = stack.cpu()
    if workload == "randwrite":
        r = fio(a, stack, "randwrite", [])
    elif workload == "randread":
        r = fio(a, stack, "randread", ["--time_based", f"--runtime={a.runtime}"])
    else:
        r = smallfiles(a, stack, tarball)
    after = stack.cpu()
    server = (after["server"] - before["server"]) * 1e6 / r["ops"]
    daemon = (after["daemon"] - before["daemon"]) * 1e6 / r["ops"]
    r.update(server_cpu_us_per_op=server, daemon_cpu_us_per_op=daemon, stack_cpu_us_per_op=server + daemon)
    if "fio_cpu_s" in r:
        r["fio_cpu_us_per_op"] = r.pop("fio_cpu_s") * 1e6 / r["ops"]
    return r


def one_repetition(a, name, work, tarball):
    stack = Stack(name, a, work)
    try:
        dio = stack.up()
        out = {}
        for w in a.workloads:
            out[w] = measure(a, stack, w, tarball)
            out[w]["loop_direct_io"] = dio
        return out
    finally:
        stack.down()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stacks", default=",".join(STACKS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--size", default="64M", help="fio file per job (4 jobs); randwrite writes all of it once")
    p.add_argument("--runtime", type=int, default=10, help="seconds of randread")
    p.add_argument("--files", type=int, default=5000, help="files in the smallfiles cycle")
    p.add_argument("--volume-mib", type=int, default=1024, help="export size in MiB")
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--attach-args", default="", metavar="ARGS",
                   help="more flags for skiff attach, e.g. \"--batching off\" or \"--threads 64\"")
    p.add_argument("--out", default="bench/results")
    add_placement_args(p, "set-ups per stack, stacks alternating in each round; the median is reported (default 3)")
    a = p.parse_args()
    a.repeat = 3 if a.repeat is None else a.repeat
    if a.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    a.workloads = [w for w in a.workloads.split(",") if w]
    if any(w not in WORKLOADS for w in a.workloads):
        raise SystemExit(f"--workloads: choose from {','.join(WORKLOADS)}")
    stacks = [s for s in a.stacks.split(",") if s]
    if any(s not in STACKS for s in stacks):
        raise SystemExit(f"--stacks: choose from {','.join(STACKS)}")
    a.pl = Placement.from_args(a)
    if os.geteuid() != 0:
        raise SystemExit("needs root: loop devices, mkfs and mount")
    tools = ["fio", "losetup", "mkfs.ext4", "mount", "tar", "fusermount3"] + (["nbdkit", "nbdfuse"] if "nbdfuse" in stacks else [])
    for tool in tools:
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed (apt-get install fio nbdkit libnbd-bin fuse3 e2fsprogs util-linux)")
    if "skiff" in stacks and not os.access(a.skiff, os.X_OK):
        raise SystemExit(f"{a.skiff} not found: cargo build --release --bin skiff")
    reps_text = f"median of {a.repeat} repetitions" if a.repeat > 1 else "1 repetition, no median"
    print(f"  placement: {a.pl.describe()}; {reps_text}", file=sys.stderr)

    work = tempfile.mkdtemp(prefix="skiff-attach-bench-", dir="/var/tmp")
    try:
        tarball = make_tarball(a, work) if "smallfiles" in a.workloads else None
        reps = {s: [] for s in stacks}
        for rep in range(a.repeat):
            for name in rotate(stacks, rep):
                print(f"  {name:<8} rep {rep + 1}/{a.repeat} ...", end="", flush=True, file=sys.stderr)
                r = one_repetition(a, name, work, tarball)
                reps[name].append(r)
                print("  " + "  ".join(f"{w} {r[w]['ops_per_s']:,.0f}/s" for w in a.workloads), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    records = []
    for name in stacks:
        for w in a.workloads:
            runs = [r[w] for r in reps[name]]
            rec = median_record(runs, key="ops_per_s")
            rec.update(stack=name, workload=w, repeat=a.repeat, placement=a.pl.record(), repetitions=runs,
                       size_per_job=a.size, runtime_s=a.runtime, files=a.files, volume_mib=a.volume_mib)
            records.append(rec)

    print(f"\next4 on a loop device (direct I/O) over a FUSE file, {os.cpu_count()} cores, {a.volume_mib} MiB RAM export")
    print(f"placement: {a.pl.describe()}; figures: {reps_text}\n")
    print(f"| workload | stack | ops/s | vs nbdfuse | mean µs | p99 µs | CPU µs/op target | FUSE daemon | "
          "stack total | total vs nbdfuse | fio µs/op | loop dio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in records:
        base = next((b for b in records if b["stack"] == "nbdfuse" and b["workload"] == r["workload"]), None)
        ratio = f"{r['ops_per_s'] / base['ops_per_s']:.2f}x" if base else "-"
        cpu_ratio = f"{r['stack_cpu_us_per_op'] / base['stack_cpu_us_per_op']:.2f}x" if base else "-"
        lat = (f"{r['lat_mean_us']:.0f} | {r['lat_p99_us']:.0f}" if "lat_mean_us" in r else "- | -")
        fio_cpu = f"{r['fio_cpu_us_per_op']:.1f}" if "fio_cpu_us_per_op" in r else "-"
        print(f"| {r['workload']} | {r['stack']} | {r['ops_per_s']:,.0f} | {ratio} | {lat} | "
              f"{r['server_cpu_us_per_op']:.1f} | {r['daemon_cpu_us_per_op']:.1f} | {r['stack_cpu_us_per_op']:.1f} | "
              f"{cpu_ratio} | {fio_cpu} | {'on' if r['loop_direct_io'] else 'OFF'} |")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, time.strftime("attach-%Y%m%d-%H%M%S.json"))
    with open(path, "w") as f:
        json.dump({"machine": {"cores": os.cpu_count()}, "placement": a.pl.record(), "repeat": a.repeat,
                   "records": records}, f, indent=2)
    print(f"\nrecords: {path}")


if __name__ == "__main__":
    sys.exit(main())
