#!/usr/bin/env python3
"""skiff over raw Ethernet against skiff over TCP and nbdkit over TCP, on one veth pair.

Makes a network namespace and a veth pair (MTU 9000 unless --mtu), runs the servers in the namespace on the
far end and the clients on the near end, both directions crossing the same pair:

  skiff-eth   `skiff serve --eth IFACE`, driven by `skiff bench --target eth:IFACE/MAC`
  skiff-tcp   the same `skiff serve` over TCP on the pair, `skiff bench --target ADDR`
  nbdkit      `nbdkit memory 1G` over TCP on the pair, fio's nbd engine

4 KiB random reads at each queue depth, every system at every point, --repeat rounds with the
order rotating, medians reported. Placement models two machines by default: servers under
`taskset -c 1`, clients under `taskset -c 0`. Root (namespaces, CAP_NET_RAW); everything it
makes is removed at the end, even on failure.

    python3 bench/ethernet.py                      # QD 1, 8, 32, 128; 3 rounds of 3 s
    python3 bench/ethernet.py --qds 1,128 --repeat 5 --runtime 5
    python3 bench/ethernet.py --shape 10gbit       # Tyche Fig. 5: link utilisation, 1-128 threads x QD 4
    python3 bench/ethernet.py --shape 10gbit --rw randwrite    # Tyche Fig. 7: the same for writes
    python3 bench/ethernet.py --table2             # Tyche Table II: QD 1, 4-128 KiB, per stage, eth and TCP
    python3 bench/ethernet.py --drivers            # AF_XDP against AF_PACKET (and TCP), QD 1-128
    python3 bench/ethernet.py --shape 10gbit --data-batching   # Tyche VI.B: data messages batched or not
    python3 bench/ethernet.py --data-messages [--bs 16k]       # read data in data messages or on the stream
    python3 bench/ethernet.py --bundle [--shape 2gbit]         # NIC bundling: 1 link against 2
    python3 bench/ethernet.py --bundle --shape 2gbit,500mbit   # ... of two speeds
    python3 bench/ethernet.py --loss 0,1,5 --qds 1,32          # through skiff relay dropping 0, 1, 5%
    python3 bench/ethernet.py --mtus 1500,9000,65535 --qds 32,128   # frame sizes, TCP offloads on and off
    python3 bench/ethernet.py --mtu 65535 --shape 10gbit       # any mode on a pair of another MTU

With --shape RATE both ends of the pair are shaped with `tc qdisc ... tbf rate RATE` and the
sweep is Tyche's (Figures 5 and 7): 1 to 128 threads x 4 outstanding 4 KiB random reads on
shared lanes (`skiff bench --shared-lane`), skiff-eth against skiff-tcp, payload bytes per
second as a share of the shaped rate.

With --data-batching (and --shape) skiff-eth runs the same sweep twice: with two 4 KiB data
messages sharing a jumbo frame (the default; Tyche's data-message batching, its Fig. 7), and
with SKIFF_ETH_DATA_BATCHING=off, each in a frame of its own (Fig. 5); the target restarts with
the setting for each run.

With --data-messages skiff-eth runs with read data in data messages (Place datagrams, placed by
tag and offset: the default) and with SKIFF_ETH_DATA_MESSAGES=off (read data on the session's
byte stream), beside skiff-tcp, at each of --qds, --bs random reads.

With --bundle a second veth pair joins the namespace, the target serves both as one bundle
(`--eth FAR --eth FAR2`), and the sweep runs skiff-eth over one link (eth:NEAR/MAC) against
the same over both (eth:NEAR+NEAR2/MAC); with --shape each of the four ends is shaped, so the
bundle's ceiling is twice one link's; `--shape A,B` shapes the first pair to A and the second
to B, a bundle of links of different speeds.

With --loss PCTS the pair is cut in two and `skiff relay --every-ethertype` bridges the halves
from a third namespace, dropping each listed percentage of frames (seeded, both directions; ARP
and IP cross it too), so skiff-eth's own reliable delivery and TCP's meet the same losses. A
relay starts for every run (seed = the round) and its counters give the share it dropped. The
four ends run with segmentation and checksum offloads off (ethtool), so every TCP frame the
relay sees is a whole one; the relay itself is not pinned.

With --mtus LIST the pair takes each MTU in turn, and at each QD four systems alternate, the
target restarted for every run with that run's settings and its volume filled by a sequential
write first: skiff-eth, whose datagrams follow the MTU; skiff-eth-hcrc, the same with
`SKIFF_ETH_CRC=header` at both ends (checksums over headers alone: TCP on veth computes none);
skiff-tcp with the pair's segmentation offloads on (veth's default: TCP moves 64 KiB GSO
segments whatever the MTU); and skiff-tcp-nooff, the same with `ethtool -K tso off gso off gro
off` on both ends for its runs, the model of a path where TCP pays per wire frame.

Writes bench/results/ethernet-{qd,mtus,shaped,table2,batching,bundle,drivers,loss,messages-BS}-<timestamp>.json (and a .png of each sweep), and
prints a Markdown table.
"""
import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import Placement, add_placement_args, cpu_s, median_record, rotate, stop  # noqa: E402

NS = "skiff-bench-eth"
NEAR, FAR = "skbe0", "skbe1"
NEAR2, FAR2 = "skbe2", "skbe3"  # the second pair of --bundle
NS_RELAY = "skiff-bench-relay"  # --loss: the relay's namespace and its two ends
RELAY_L, RELAY_R = "skbr0", "skbr1"
NEAR_IP, FAR_IP = "10.77.0.1", "10.77.0.2"
SYSTEMS = ["skiff-eth", "skiff-tcp", "nbdkit"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def sh(argv, check=True):
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def tc_rate_bytes(rate):
    """tc's rate syntax (10gbit, 1gbit, 500mbit) in bytes per second."""
    r = rate.lower()
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1)):
        if r.endswith(unit):
            return float(r[:-len(unit)]) * mult / 8
    raise SystemExit(f"--shape {rate}: use a tc rate such as 10gbit or 500mbit")


def shape(rates, pairs):
    """A token bucket on each end's egress of each (near, far) pair: requests one way, replies
    the other; `rates` is a tc rate, or one per pair separated by commas (a bundle of links of
    different speeds). Sessions then go through the queueing discipline (SKIFF_ETH_QDISC=on,
    for every skiff started here), which they otherwise bypass."""
    os.environ["SKIFF_ETH_QDISC"] = "on"
    rates = rates.split(",")
    for i, (near, far) in enumerate(pairs):
        tbf = ["root", "tbf", "rate", rates[min(i, len(rates) - 1)], "burst", "2mb", "latency", "20ms"]
        sh(["tc", "qdisc", "add", "dev", near, *tbf])
        sh(["ip", "netns", "exec", NS, "tc", "qdisc", "add", "dev", far, *tbf])


def setup(bundle=False, relay=False, mtu=9000):
    """The namespace and the pair (and with `bundle` a second pair, no addresses: raw
    Ethernet only); returns the target's MAC on the first. With `relay` the pair is two, NEAR
    to RELAY_L and RELAY_R to FAR, the relay's ends in a namespace of their own (with an address
    on neither: the host must not answer ARP there and carry TCP past the relay)."""
    teardown()
    sh(["ip", "netns", "add", NS])
    if relay:
        sh(["ip", "netns", "add", NS_RELAY])
        pairs = [(NEAR, RELAY_L, NS_RELAY, None), (RELAY_R, FAR, NS, NS_RELAY)]
    else:
        pairs = [(NEAR, FAR, NS, None)] + ([(NEAR2, FAR2, NS, None)] if bundle else [])
    for near, far, far_ns, near_ns in pairs:
        sh(["ip", "link", "add", near, "mtu", str(mtu), "type", "veth", "peer", "name", far, "mtu", str(mtu)])
        sh(["ip", "link", "set", far, "netns", far_ns])
        if near_ns:
            sh(["ip", "link", "set", near, "netns", near_ns])
        for ns, dev in ((near_ns, near), (far_ns, far)):
            sh((["ip", "netns", "exec", ns] if ns else []) + ["ip", "link", "set", dev, "up"])
            if relay:
                # Whole, checksummed frames of at most the MTU, for the relay to read.
                sh((["ip", "netns", "exec", ns] if ns else [])
                   + ["ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off", "tx", "off"])
    sh(["ip", "addr", "add", f"{NEAR_IP}/24", "dev", NEAR])
    for args in (["addr", "add", f"{FAR_IP}/24", "dev", FAR], ["link", "set", "lo", "up"]):
        sh(["ip", "-n", NS, *args])
    out = sh(["ip", "-n", NS, "-o", "link", "show", FAR]).stdout
    return out.split("link/ether")[1].split()[0]


def teardown():
    sh(["ip", "link", "del", NEAR], check=False)
    sh(["ip", "link", "del", NEAR2], check=False)
    sh(["ip", "link", "del", RELAY_R], check=False)  # a --loss setup that failed half way
    sh(["ip", "netns", "del", NS], check=False)
    sh(["ip", "netns", "del", NS_RELAY], check=False)


def wait_tcp(host, port, timeout=15.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listening on {host}:{port}")


def in_ns(argv):
    return ["ip", "netns", "exec", NS] + argv


def start(argv, host, port):
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_tcp(host, port)
    except BaseException:
        stop(proc)
        raise
    return proc


def precondition(uri, pl):
    subprocess.run(pl.client(["fio", "--name=precondition", "--ioengine=nbd", f"--uri={uri}", "--rw=write",
                              "--bs=1M", "--iodepth=8", "--size=1G", "--output-format=json"]),
                   check=True, capture_output=True)


def skiff_bench(a, target, qd, threads=None, rw="randread", bs="4k"):
    argv = a.pl.client([a.skiff, "bench", "--target", target, "--export", "vol", "--size", "1G", "--rw", rw,
                        "--bs", bs, "--qd", str(qd), "--duration", f"{a.runtime}s", "--json"]
                       + (["--threads", str(threads), "--shared-lane"] if threads else []))
    p = subprocess.run(argv, capture_output=True, text=True, timeout=a.runtime + 60)
    if p.returncode != 0:
        raise RuntimeError(f"skiff bench {target} QD {qd} failed: {p.stderr[-500:]}")
    r = json.loads(p.stdout)
    return {"iops": r["iops"], "ios": r["ios"], "bytes_per_s": r["bytes_per_s"], "lat_mean_us": r["lat_us"]["mean"],
            "lat_p99_us": r["lat_us"]["p99"],
            "client_cpu_us_per_io": r["client_cpu_us_per_io"], "server_cpu_us_per_io": r["server_cpu_us_per_io"],
            "client_ctx_per_io": r["client_ctx_switches_per_io"],
            "server_ctx_per_io": r["server_ctx_switches_per_io"], "stages_us": r["stages_us"],
            "client_link": r.get("client_link")}


def fio_nbd(a, uri, qd, server_pid):
    c0 = cpu_s(server_pid)
    out = subprocess.run(a.pl.client(["fio", "--name=nbdkit", "--ioengine=nbd", f"--uri={uri}", "--rw=randread",
                                      "--bs=4k", f"--iodepth={qd}", f"--runtime={a.runtime}", "--time_based",
                                      "--size=1G", "--output-format=json"]),
                         check=True, capture_output=True, text=True).stdout
    server_cpu = cpu_s(server_pid) - c0
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read"]
    ios = side["total_ios"]
    secs = side["runtime"] / 1000.0
    return {"iops": ios / secs, "lat_mean_us": side["lat_ns"]["mean"] / 1000,
            "lat_p99_us": side["clat_ns"]["percentile"]["99.000000"] / 1000,
            "client_cpu_us_per_io": (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * secs * 1e6 / ios,
            "server_cpu_us_per_io": server_cpu * 1e6 / ios, "client_ctx_per_io": job["ctx"] / ios,
            "server_ctx_per_io": None}


def plot(path, xs, xlabel, med, names, title):
    """IOPS and CPU per I/O (client + server) of each of `names` at each x: med[(name, x)]."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot (python3 -m pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in names:
        pts = [x for x in xs if (s, x) in med]
        axes[0].plot(pts, [med[(s, x)]["iops"] for x in pts], marker="o", label=s)
        axes[1].plot(pts, [med[(s, x)]["client_cpu_us_per_io"] + med[(s, x)]["server_cpu_us_per_io"] for x in pts],
                     marker="o", label=s)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("IOPS (4 KiB)")
    axes[1].set_ylabel("CPU µs per I/O, client + server")
    fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def serve_argv(a, port, eth=(FAR,)):
    """`skiff serve` in the namespace: TCP on the pair (also how readiness is seen) and raw
    Ethernet on `eth` (one bundle)."""
    eths = [arg for iface in eth for arg in ("--eth", iface)]
    return in_ns(a.pl.server([a.skiff, "serve", "--listen", f"{FAR_IP}:{port}", *eths, "--export", "vol=ram:1G",
                              "--workers", "1"]))


@contextlib.contextmanager
def environ(env):
    """`env` set in this process's environment (so in the processes it starts) meanwhile."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fill(a, port):
    """Write the target's volume from end to end over TCP: a RAM volume never written reads the
    kernel's zero page, faster than real data."""
    skiff_bench(a, f"{FAR_IP}:{port}", 8, rw="write", bs="1M")


def alternate(a, variants, points, measure, label, eth=(FAR,)):
    """At each point of `points`, the `variants` (name, target, environment or None) take
    turns for --repeat rounds, `measure(target, point)` measuring one run. One `skiff serve`
    serves them all, unless a variant needs an environment of its own: then the target starts
    afresh, with it, for each of that variant's runs. Returns {(name, point): [records]}; the
    pairs are torn down after."""
    runs = {}
    port = 7070
    shared = None
    try:
        if all(env is None for _, _, env in variants):
            shared = start(serve_argv(a, port, eth), FAR_IP, port)
            fill(a, port)
        log(f"veth pair {NEAR} - {FAR}{f' and {NEAR2} - {FAR2}' if len(eth) > 1 else ''}, MTU {a.mtu}"
            f"{f', shaped to {a.shape} each way (tbf)' if a.shape else ''}; placement {a.pl.describe()}")
        for i, pt in enumerate(points):
            for rep in range(a.repeat):
                for name, target, env in rotate(variants, i + rep):
                    with environ(env or {}):
                        own = start(serve_argv(a, port, eth), FAR_IP, port) if env is not None else None
                        try:
                            if own:
                                fill(a, port)
                            r = measure(target, pt)
                        finally:
                            if own:
                                stop(own)
                    runs.setdefault((name, pt), []).append(r)
                    log(f"{label(pt)} {name:<10} rep {rep + 1}/{a.repeat}: {r['iops']:>9,.0f} IOPS "
                        f"{r['lat_mean_us']:7.1f} µs  CPU µs/IO {r['client_cpu_us_per_io']:.2f} + "
                        f"{r['server_cpu_us_per_io']:.2f}")
    finally:
        if shared:
            stop(shared)
        teardown()
    return runs


def eth_against_tcp(a, mac, points, measure, label):
    """skiff-eth against skiff-tcp on the pair (`alternate`)."""
    return alternate(a, [("skiff-eth", f"eth:{NEAR}/{mac}", None), ("skiff-tcp", f"{FAR_IP}:7070", None)],
                     points, measure, label)


def save(a, name, fields, points):
    """bench/results/ethernet-NAME-<timestamp>.json; returns the path without its ending."""
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"ethernet-{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    with open(base + ".json", "w") as f:
        json.dump({"placement": a.pl.record(), "repeat": a.repeat, "runtime_s": a.runtime, **fields,
                   "points": points}, f, indent=1)
    return base


def shaped_sweep(a, variants, name, fields, title, eth=(FAR,), links=1):
    """Tyche's sweep (1 to 128 threads x 4 outstanding 4 KiB I/Os on shared lanes) over
    `variants`; with --shape, payload as a share of the shaped rate of one link (`links`
    links: the share of all of them too). Prints a table; returns 0."""
    rates = [tc_rate_bytes(r) for r in a.shape.split(",")] if a.shape else []
    rate = rates[0] if rates else None
    threads = [int(t) for t in a.threads.split(",")]

    def measure(target, t):
        r = skiff_bench(a, target, 4, threads=t, rw=a.rw)
        r["link_util"] = r["bytes_per_s"] / rate if rate else None
        return r
    runs = alternate(a, variants, threads, measure, lambda t: f"{t:>3} threads", eth=eth)
    med = {k: median_record(v) for k, v in runs.items()}
    base = save(a, name, {"shape": a.shape, "rw": a.rw, **fields},
                [{"system": s, "threads": t, **med[(s, t)], "repetitions": runs[(s, t)]} for (s, t) in runs])
    what = (f"{title}: 4 KiB {a.rw}, threads x QD 4 on shared lanes"
            f"{f', each link shaped to {a.shape}' if a.shape else ', unshaped'} ({a.pl.short()}, median of {a.repeat})")
    png = plot(base + ".png", threads, "threads x QD 4", med, [v for v, _, _ in variants], what)
    print(f"{what}; {base}.json" + (f", {png}" if png else ""))
    print()
    head = "| threads x QD 4 |"
    for v, _, _ in variants:
        head += f" {v} IOPS |" + (" of one link |" if rate else "") + " CPU µs/I/O | client ctx/I/O |"
    print(head)
    print("|---:|" + ("---:|" * (4 if rate else 3)) * len(variants))
    for t in threads:
        cells = []
        for v, _, _ in variants:
            r = med.get((v, t))
            if not r:
                cells += ["-"] * (4 if rate else 3)
                continue
            cells.append(f"{r['iops']:,.0f}")
            if rate:
                cells.append(f"{100 * r['link_util']:.1f}%")
            cells.append(f"{r['client_cpu_us_per_io'] + r['server_cpu_us_per_io']:.2f}")
            # Context switches per I/O: the cost of waking each caller on a shared lane, which
            # decides these points when the client's core is the bound.
            cells.append(f"{r['client_ctx_per_io']:.2f}")
        print(f"| {t} | " + " | ".join(cells) + " |")
    if links > 1 and rate:
        ceiling = sum(rates[min(i, len(rates) - 1)] for i in range(links)) / rate
        print(f"\n(\"Of one link\" is of the first link's rate; the bundle's ceiling is {100 * ceiling:.0f}% of it.)")
    return 0


def link_utilisation(a, mac):
    """Tyche Figures 5 and 7 on a shaped pair: payload as a share of the shaped rate."""
    variants = [("skiff-eth", f"eth:{NEAR}/{mac}", None), ("skiff-tcp", f"{FAR_IP}:7070", None)]
    return shaped_sweep(a, variants, "shaped", {}, "Link utilisation, raw Ethernet against TCP")


def data_batching(a, mac):
    """Tyche VI.B: data messages batched two 4 KiB to a jumbo frame (the default), against each
    data message in a frame of its own (SKIFF_ETH_DATA_BATCHING=off)."""
    target = f"eth:{NEAR}/{mac}"
    variants = [("batched", target, {"SKIFF_ETH_DATA_BATCHING": "on"}),
                ("unbatched", target, {"SKIFF_ETH_DATA_BATCHING": "off"})]
    return shaped_sweep(a, variants, "batching", {}, "Data-message batching on (two 4 KiB to a frame) and off")


def data_messages_shaped(a, mac):
    """Tyche's sweep on the shaped pair with read data in data messages and on the stream."""
    target = f"eth:{NEAR}/{mac}"
    variants = [("eth-messages", target, {"SKIFF_ETH_DATA_MESSAGES": "on"}),
                ("eth-stream", target, {"SKIFF_ETH_DATA_MESSAGES": "off"})]
    return shaped_sweep(a, variants, "messages-shaped", {}, "Data messages on and off")


def bundle(a, mac):
    """NIC bundling: skiff-eth over one link of the bundle against the same over both."""
    variants = [("1-link", f"eth:{NEAR}/{mac}", None), ("2-links", f"eth:{NEAR}+{NEAR2}/{mac}", None)]
    return shaped_sweep(a, variants, "bundle", {"links": 2}, "NIC bundling, one link against two",
                        eth=(FAR, FAR2), links=2)


def qd_results(a, name, fields, qds, runs, names, title):
    """A sweep by queue depth, {(system, qd): [records]}, saved (JSON with every repetition) and
    plotted as `name`; prints the title and where they went; returns the medians."""
    med = {k: median_record(v) for k, v in runs.items()}
    base = save(a, name, fields, [{"system": s, "qd": q, **med[(s, q)], "repetitions": runs[(s, q)]}
                                  for (s, q) in runs])
    png = plot(base + ".png", qds, "queue depth", med, names, title)
    print(f"{title}; {base}.json" + (f", {png}" if png else ""))
    print()
    return med


def drivers(a, mac, qds):
    """AF_XDP against AF_PACKET under skiff-eth, and skiff-tcp beside them, at each QD. The target
    restarts for every run with the driver of that run (SKIFF_ETH_DRIVER), the bench's lane is
    the first session on each end, so it gets the AF_XDP socket; a run of skiff-xdp whose lane
    did not get it is an error."""
    eth = f"eth:{NEAR}/{mac}"
    variants = [("skiff-eth", eth, {"SKIFF_ETH_DRIVER": "packet"}), ("skiff-xdp", eth, {"SKIFF_ETH_DRIVER": "xdp"}),
                ("skiff-tcp", f"{FAR_IP}:7070", {"SKIFF_ETH_DRIVER": "packet"})]

    def measure(target, qd):
        r = skiff_bench(a, target, qd)
        link = r.get("client_link") or {}
        r["driver"] = (link.get("paths") or [{}])[0].get("driver")
        if os.environ.get("SKIFF_ETH_DRIVER") == "xdp" and r["driver"] != "af_xdp":
            raise RuntimeError(f"skiff-xdp at QD {qd} ran over {r['driver']}, not AF_XDP")
        return r
    title = f"AF_XDP against AF_PACKET, 4 KiB random reads, one veth pair, MTU {a.mtu} ({a.pl.short()}, median of {a.repeat})"
    return variants_by_qd(a, "drivers", variants, qds, measure, title)


def variants_by_qd(a, name, variants, qds, measure, title):
    """`variants` (the first one the reference, a skiff-tcp among them) alternating at each QD
    (`alternate`); saves and plots them as `name` and prints a table with each one's CPU per
    I/O against the first's and TCP's. Returns 0."""
    names = [v for v, _, _ in variants]
    first = names[0]
    runs = alternate(a, variants, qds, measure, lambda q: f"QD {q:>3}")
    med = qd_results(a, name, {}, qds, runs, names, title)
    print(f"| QD | system | IOPS | mean µs | CPU µs/I/O client | server | total | ÷ {first} | ÷ skiff-tcp |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for q in qds:
        total = {s: med[(s, q)]["client_cpu_us_per_io"] + med[(s, q)]["server_cpu_us_per_io"]
                 for s in names if (s, q) in med}
        for s in names:
            r = med.get((s, q))
            if not r:
                continue
            ref_ratio = f"{total[s] / total[first]:.2f}" if first in total else ""
            tcp_ratio = f"{total[s] / total['skiff-tcp']:.2f}" if "skiff-tcp" in total else ""
            print(f"| {q} | {s} | {r['iops']:,.0f} | {r['lat_mean_us']:.1f} | {r['client_cpu_us_per_io']:.2f} | "
                  f"{r['server_cpu_us_per_io']:.2f} | {total[s]:.2f} | {ref_ratio} | {tcp_ratio} |")
    return 0


def data_messages(a, mac, qds):
    """Read data in data messages (Place datagrams placed by tag and offset, the default)
    against read data on the session's byte stream (SKIFF_ETH_DATA_MESSAGES=off), and
    skiff-tcp, at each QD, --bs reads. The target restarts for every run with the setting of
    that run; a run whose lanes got data messages when they should not, or none when they
    should, is an error."""
    eth = f"eth:{NEAR}/{mac}"
    variants = [("eth-messages", eth, {"SKIFF_ETH_DATA_MESSAGES": "on"}),
                ("eth-stream", eth, {"SKIFF_ETH_DATA_MESSAGES": "off"}),
                ("skiff-tcp", f"{FAR_IP}:7070", {"SKIFF_ETH_DATA_MESSAGES": "on"})]

    def measure(target, qd):
        r = skiff_bench(a, target, qd, bs=a.bs)
        got = (r.get("client_link") or {}).get("data_messages_received", 0)
        want = target == eth and os.environ.get("SKIFF_ETH_DATA_MESSAGES") == "on"
        if (got > 0) != want:
            raise RuntimeError(f"{target} QD {qd}: {got} data messages received, expected {'some' if want else 'none'}")
        r["data_messages_received"] = got
        return r
    title = (f"Data messages on and off, {a.bs} random reads, one veth pair, MTU {a.mtu} "
             f"({a.pl.short()}, median of {a.repeat})")
    return variants_by_qd(a, f"messages-{a.bs}", variants, qds, measure, title)


def offloads(on):
    """TCP's segmentation and receive offloads on both ends of the pair, on or off."""
    for prefix, dev in (([], NEAR), (["ip", "netns", "exec", NS], FAR)):
        sh(prefix + ["ethtool", "-K", dev, *[x for k in ("tso", "gso", "gro") for x in (k, "on" if on else "off")]])


# name: (over raw Ethernet, SKIFF_ETH_CRC for both ends, TCP offloads on)
MTU_SYSTEMS = {"skiff-eth": (True, "full", True), "skiff-eth-hcrc": (True, "header", True),
               "skiff-tcp": (False, "full", True), "skiff-tcp-nooff": (False, "full", False)}


def mtus(a, mac, qds):
    """At each MTU of --mtus, skiff-eth (payload checksums on, the default), skiff-eth-hcrc
    (`crc=header` at both ends: checksums over headers alone, as TCP on veth has none),
    skiff-tcp with offloads and skiff-tcp without them alternate at each QD. The target
    restarts for every run with that run's settings, and its volume is filled before it is
    read. Prints a table of CPU per I/O with each system's ratio to both TCPs; saves JSON and a
    plot per MTU."""
    sizes = [int(m) for m in a.mtus.split(",")]
    names = list(MTU_SYSTEMS)
    port = 7070
    runs = {}
    try:
        for m in sizes:
            for prefix, dev in (([], NEAR), (["ip", "netns", "exec", NS], FAR)):
                sh(prefix + ["ip", "link", "set", dev, "mtu", str(m)])
            log(f"MTU {m}: veth pair {NEAR} - {FAR}, target MAC {mac}; placement {a.pl.describe()}")
            for i, qd in enumerate(qds):
                for rep in range(a.repeat):
                    for s in rotate(names, i + rep):
                        eth, crc, offload = MTU_SYSTEMS[s]
                        offloads(offload)
                        try:
                            with environ({"SKIFF_ETH_CRC": crc}):
                                server = start(serve_argv(a, port), FAR_IP, port)
                                try:
                                    fill(a, port)
                                    r = skiff_bench(a, f"eth:{NEAR}/{mac}" if eth else f"{FAR_IP}:{port}", qd)
                                finally:
                                    stop(server)
                        finally:
                            offloads(True)
                        link = r.get("client_link") or {}
                        if eth and link.get("payload_crc") != (crc == "full"):
                            raise RuntimeError(f"{s}: the session's checksum was not {crc}: {link}")
                        runs.setdefault((s, m, qd), []).append(r)
                        log(f"MTU {m:>5} QD {qd:>3} {s:<15} rep {rep + 1}/{a.repeat}: {r['iops']:>9,.0f} IOPS "
                            f"{r['lat_mean_us']:7.1f} µs  CPU µs/IO {r['client_cpu_us_per_io']:.2f} + "
                            f"{r['server_cpu_us_per_io']:.2f}")
    finally:
        teardown()
    med = {k: median_record(v) for k, v in runs.items()}
    base = save(a, "mtus", {"target_mac": mac, "mtus": sizes},
                [{"system": s, "mtu": m, "qd": q, **med[(s, m, q)], "repetitions": runs[(s, m, q)]}
                 for (s, m, q) in runs])
    total = {k: r["client_cpu_us_per_io"] + r["server_cpu_us_per_io"] for k, r in med.items()}
    print(f"4 KiB random reads over one veth pair by MTU ({a.pl.short()}, median of {a.repeat}, volume filled); "
          f"{base}.json")
    print()
    print("| MTU | QD | system | IOPS | mean µs | CPU µs/I/O client | server | total | ÷ skiff-tcp | ÷ skiff-tcp-nooff |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in sizes:
        for q in qds:
            for s in names:
                r = med.get((s, m, q))
                if not r:
                    continue
                t = total[(s, m, q)]
                ratios = [f"{t / total[(p, m, q)]:.2f}" if (p, m, q) in total else "" for p in ("skiff-tcp", "skiff-tcp-nooff")]
                print(f"| {m} | {q} | {s} | {r['iops']:,.0f} | {r['lat_mean_us']:.1f} | {r['client_cpu_us_per_io']:.2f} | "
                      f"{r['server_cpu_us_per_io']:.2f} | {t:.2f} | {ratios[0]} | {ratios[1]} |")
    for m in sizes:
        title = f"4 KiB random reads, one veth pair, MTU {m} ({a.pl.short()}, median of {a.repeat})"
        plot(f"{base}-{m}.png", qds, "queue depth", {(s, q): med[(s, mm, q)] for (s, mm, q) in med if mm == m},
             names, title)
    return 0


def relay(a, loss_pct, seed):
    """`skiff relay` between the halves, dropping `loss_pct` percent of frames each way."""
    proc = subprocess.Popen(["ip", "netns", "exec", NS_RELAY, a.skiff, "relay", "--left", RELAY_L, "--right",
                             RELAY_R, "--every-ethertype", "--drop", str(loss_pct / 100), "--seed", str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    time.sleep(0.3)  # its sockets open before the first frame
    if proc.poll() is not None:
        raise RuntimeError(f"skiff relay exited with {proc.returncode}")
    return proc


def relay_counters(proc):
    """Stop a relay; its counters (JSON)."""
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError("skiff relay did not stop on SIGTERM")
    if proc.returncode != 0 or not out.strip():
        raise RuntimeError(f"skiff relay failed (exit {proc.returncode}); run it by hand to see why")
    return json.loads(out)


def loss(a, mac, qds):
    """skiff-eth against skiff-tcp through skiff relay, at each loss rate and QD."""
    rates = [float(x) for x in a.loss.split(",")]
    variants = [("skiff-eth", f"eth:{NEAR}/{mac}"), ("skiff-tcp", f"{FAR_IP}:7070")]
    points = [(p, q) for p in rates for q in qds]
    runs = {}
    server = None
    try:
        ready = relay(a, 0.0, 0)  # the target's readiness is seen through the relay
        try:
            server = start(serve_argv(a, 7070), FAR_IP, 7070)
        finally:
            relay_counters(ready)
        log(f"veth pairs {NEAR} - {RELAY_L} | skiff relay --every-ethertype | {RELAY_R} - {FAR}, MTU {a.mtu}, "
            f"offloads off; placement {a.pl.describe()}, relay not pinned")
        for i, (pct, qd) in enumerate(points):
            for rep in range(a.repeat):
                for name, target in rotate(variants, i + rep):
                    proc = relay(a, pct, rep + 1)
                    try:
                        r = skiff_bench(a, target, qd)
                    except BaseException:
                        stop(proc)
                        raise
                    counters = relay_counters(proc)
                    dropped = sum(counters[d]["dropped"] for d in ("left_to_right", "right_to_left"))
                    received = sum(counters[d]["received"] for d in ("left_to_right", "right_to_left"))
                    r["relay"] = counters
                    # Over the relay's whole life (the session's setup too): a little high.
                    r["frames_per_io"] = received / max(1, r["ios"])
                    r["dropped_share"] = dropped / max(1, received)
                    link = r.get("client_link") or {}
                    r["client_resent"] = (link.get("retransmitted_gap", 0) + link.get("retransmitted_timeout", 0)
                                          if link else None)
                    runs.setdefault((name, (pct, qd)), []).append(r)
                    log(f"loss {pct:>4}% QD {qd:>3} {name:<9} rep {rep + 1}/{a.repeat}: {r['iops']:>9,.0f} IOPS "
                        f"{r['lat_mean_us']:8.1f} µs p99 {r['lat_p99_us']:9.1f}  CPU µs/IO "
                        f"{r['client_cpu_us_per_io']:.2f} + {r['server_cpu_us_per_io']:.2f}; relay dropped "
                        f"{dropped} of {received} frames")
    finally:
        if server:
            stop(server)
        teardown()
    med = {k: median_record(v) for k, v in runs.items()}
    base = save(a, "loss", {"loss_pct": rates, "qds": qds},
                [{"system": s, "loss_pct": p, "qd": q, **med[(s, (p, q))], "repetitions": runs[(s, (p, q))]}
                 for (s, (p, q)) in runs])
    print(f"4 KiB random reads through skiff relay dropping frames at random, both directions "
          f"({a.pl.short()}, relay not pinned, median of {a.repeat}); {base}.json")
    print()
    print("| loss | QD | system | IOPS | ÷ no loss | mean µs | p99 µs | CPU µs/I/O | frames/I/O | dropped | "
          "client resends |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p, q in points:
        for s, _ in variants:
            r = med.get((s, (p, q)))
            if not r:
                continue
            base_r = med.get((s, (rates[0], q)))
            kept = f"{r['iops'] / base_r['iops']:.2f}" if base_r and rates[0] == 0 else ""
            resent = "" if r["client_resent"] is None else f"{r['client_resent']:,.0f}"
            print(f"| {p}% | {q} | {s} | {r['iops']:,.0f} | {kept} | {r['lat_mean_us']:.1f} | {r['lat_p99_us']:.1f} | "
                  f"{r['client_cpu_us_per_io'] + r['server_cpu_us_per_io']:.2f} | {r['frames_per_io']:.2f} | "
                  f"{100 * r['dropped_share']:.2f}% | {resent} |")
    return 0


def table2(a, mac):
    """Tyche Table II over raw Ethernet and TCP: QD 1 by size, with skiff bench's stages."""
    points = [(rw, bs) for rw in ("randread", "randwrite") for bs in ("4k", "8k", "64k", "128k")]
    runs = eth_against_tcp(a, mac, points, lambda target, pt: skiff_bench(a, target, 1, rw=pt[0], bs=pt[1]),
                           lambda pt: f"{pt[0]:<9} {pt[1]:>4}")
    med = {k: median_record(v, key="lat_mean_us") for k, v in runs.items()}
    base = save(a, "table2", {}, [{"system": s, "rw": rw, "bs": bs, **med[(s, (rw, bs))],
                                   "repetitions": runs[(s, (rw, bs))]} for (s, (rw, bs)) in runs])
    keys = ["client_send", "target_recv", "target_exec", "target_send", "client_recv", "client_complete", "elsewhere"]
    print(f"QD 1 by size over one veth pair, MTU {a.mtu} ({a.pl.short()}, median of {a.repeat}); {base}.json")
    print()
    print("| point | system | mean µs | CPU µs/I/O client + server | " + " | ".join(k.replace("_", " ") for k in keys) + " |")
    print("|---|---|---:|---|" + "---:|" * len(keys))
    for (s, (rw, bs)), r in med.items():
        st = r.get("stages_us") or {}
        print(f"| {rw} {bs.upper()}iB | {s} | {r['lat_mean_us']:.1f} | {r['client_cpu_us_per_io']:.1f} + "
              f"{r['server_cpu_us_per_io']:.1f} | " + " | ".join(f"{st.get(k, 0):.1f}" for k in keys) + " |")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--qds", default="1,8,32,128")
    p.add_argument("--runtime", type=int, default=3)
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--shape", metavar="RATE", help="shape the pair with tc tbf (e.g. 10gbit) and sweep threads x QD 4; "
                   "with --bundle one rate per link may be given (2gbit,500mbit)")
    p.add_argument("--threads", default="1,2,4,8,16,32,64,128", help="with --shape: thread counts")
    p.add_argument("--rw", default="randread", choices=["randread", "randwrite"], help="with --shape: the direction")
    p.add_argument("--table2", action="store_true",
                   help="Tyche Table II: QD 1 at 4, 8, 64 and 128 KiB, reads and writes, per stage, eth against TCP")
    p.add_argument("--data-batching", action="store_true",
                   help="with --shape: skiff-eth batching two 4 KiB data messages to a jumbo frame against one each")
    p.add_argument("--data-messages", action="store_true",
                   help="skiff-eth with read data in data messages against on the byte stream, and skiff-tcp, at --qds")
    p.add_argument("--bs", default="4k", help="with --data-messages: the read size")
    p.add_argument("--drivers", action="store_true",
                   help="skiff-eth over AF_XDP (SKIFF_ETH_DRIVER=xdp) against AF_PACKET and skiff-tcp, at --qds")
    p.add_argument("--loss", metavar="PCTS",
                   help="through skiff relay dropping each listed percentage of frames (0,1,5): skiff-eth against "
                        "skiff-tcp at --qds")
    p.add_argument("--mtu", type=int, default=9000, help="the pair's MTU, 68 to 65535 (default 9000)")
    p.add_argument("--mtus", metavar="LIST",
                   help="skiff-eth against skiff-tcp with offloads on and off at each MTU (1500,9000,65535), at --qds")
    p.add_argument("--bundle", action="store_true",
                   help="a second veth pair: skiff-eth over one link against a bundle of two (with --shape: each shaped)")
    add_placement_args(p, "rounds, the systems alternating (default 3)")
    a = p.parse_args()
    a.repeat = a.repeat or 3
    a.pl = Placement.from_args(a)
    a.skiff = os.path.abspath(a.skiff)
    qds = [int(q) for q in a.qds.split(",")]
    if os.geteuid() != 0:
        raise SystemExit("root is needed: network namespaces and raw sockets")
    if a.data_batching and not a.shape:
        raise SystemExit("--data-batching needs --shape RATE: it measures link utilisation")
    if a.shape and "," in a.shape and (not a.bundle or a.shape.count(",") > 1):
        raise SystemExit("--shape takes two rates (one per link) only with --bundle")
    if a.loss and (a.shape or a.bundle):
        raise SystemExit("--loss runs one link, unshaped")
    if a.mtus and (a.shape or a.bundle or a.loss):
        raise SystemExit("--mtus runs one link, unshaped")
    try:
        mac = setup(bundle=a.bundle, relay=bool(a.loss), mtu=a.mtu)
    except BaseException:
        teardown()
        raise
    if a.loss:
        return loss(a, mac, qds)
    if a.mtus:
        return mtus(a, mac, qds)
    if a.table2:
        return table2(a, mac)
    if a.drivers:
        return drivers(a, mac, qds)
    if a.data_messages and not a.shape:
        return data_messages(a, mac, qds)
    if a.shape:
        try:
            shape(a.shape, [(NEAR, FAR)] + ([(NEAR2, FAR2)] if a.bundle else []))
        except BaseException:
            teardown()
            raise
    if a.bundle:
        return bundle(a, mac)
    if a.shape and a.data_messages:
        return data_messages_shaped(a, mac)
    if a.shape:
        return data_batching(a, mac) if a.data_batching else link_utilisation(a, mac)
    procs = []
    try:
        port, nbd_port, kit_port = 7070, 10809, 10810
        skiff = start(in_ns(a.pl.server([a.skiff, "serve", "--listen", f"{FAR_IP}:{port}", "--nbd",
                                         f"{FAR_IP}:{nbd_port}", "--eth", FAR, "--export", "vol=ram:1G",
                                         "--workers", "1"])), FAR_IP, port)
        procs.append(skiff)
        kit = start(in_ns(a.pl.server(["nbdkit", "--foreground", "--ipaddr", FAR_IP, "--port", str(kit_port),
                                       "memory", "1G"])), FAR_IP, kit_port)
        procs.append(kit)
        for uri in (f"nbd://{FAR_IP}:{nbd_port}/vol", f"nbd://{FAR_IP}:{kit_port}/"):
            precondition(uri, a.pl)
        log(f"veth pair {NEAR} - {FAR} (namespace {NS}), MTU {a.mtu}; target MAC {mac}; placement {a.pl.describe()}")
        runs = {}
        for i, qd in enumerate(qds):
            for rep in range(a.repeat):
                for s in rotate(SYSTEMS, i + rep):
                    if s == "skiff-eth":
                        r = skiff_bench(a, f"eth:{NEAR}/{mac}", qd)
                    elif s == "skiff-tcp":
                        r = skiff_bench(a, f"{FAR_IP}:{port}", qd)
                    else:
                        r = fio_nbd(a, f"nbd://{FAR_IP}:{kit_port}/", qd, kit.pid)
                    runs.setdefault((s, qd), []).append(r)
                    log(f"QD {qd:>3} {s:<9} rep {rep + 1}/{a.repeat}: {r['iops']:>9,.0f} IOPS "
                        f"{r['lat_mean_us']:>7.1f} µs  CPU µs/IO {r['client_cpu_us_per_io']:.2f} + "
                        f"{r['server_cpu_us_per_io']:.2f}")
    finally:
        for proc in procs:
            stop(proc)
        teardown()
    title = f"4 KiB random reads over one veth pair, MTU {a.mtu} ({a.pl.short()}, median of {a.repeat})"
    med = qd_results(a, "qd", {"target_mac": mac}, qds, runs, SYSTEMS, title)
    print("| QD | system | IOPS | mean µs | p99 µs | CPU µs/I/O client | server | total | eth CPU ÷ TCP CPU |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for q in qds:
        tcp = med.get(("skiff-tcp", q))
        for s in SYSTEMS:
            r = med.get((s, q))
            if not r:
                continue
            total = r["client_cpu_us_per_io"] + r["server_cpu_us_per_io"]
            ratio = ""
            if s == "skiff-eth" and tcp:
                ratio = f"{total / (tcp['client_cpu_us_per_io'] + tcp['server_cpu_us_per_io']):.2f}"
            print(f"| {q} | {s} | {r['iops']:,.0f} | {r['lat_mean_us']:.1f} | {r['lat_p99_us']:.1f} | "
                  f"{r['client_cpu_us_per_io']:.2f} | {r['server_cpu_us_per_io']:.2f} | {total:.2f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
