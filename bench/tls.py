#!/usr/bin/env python3
"""What TLS costs per 4 KiB I/O: skiff over plaintext TCP against skiff over TLS, side by side.

Each run starts `skiff serve --workers 1` (a RAM export; `--tls require` for the TLS runs)
pinned to the server CPU and `skiff bench --json` pinned to the client CPU (two machines
modelled), plaintext and TLS alternating; median of --repeat runs per row. Certificates are
made with the `openssl` CLI in a temporary directory (this kernel has no kTLS: rustls encrypts
in user space on both sides).

    python3 bench/tls.py                       # randread 4 KiB at QD 1 and 128, 3 repetitions
    python3 bench/tls.py --workloads randread:1,randwrite:128 --repeat 5
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def wait_port(port):
    for _ in range(400):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"tls.py: the server on port {port} did not come up")


def make_certs(d):
    def ssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    ssl("req", "-x509", *ec, "-keyout", "ca-key.pem", "-out", "ca-cert.pem", "-days", "2", "-subj", "/CN=bench CA")
    with open(os.path.join(d, "s.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    ssl("req", *ec, "-keyout", "server-key.pem", "-out", "s.csr", "-subj", "/CN=localhost")
    ssl("x509", "-req", "-in", "s.csr", "-CA", "ca-cert.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
        "-out", "server-cert.pem", "-days", "2", "-extfile", "s.ext")


def run(args, port, rw, qd, certs):
    tls_serve = ["--tls", "require", "--tls-certificates", certs] if certs else []
    tls_bench = ["--tls-certificates", certs] if certs else []
    serve = ["taskset", "-c", args.server_cpu, args.skiff, "serve", "--listen", f"127.0.0.1:{port}",
             "--export", f"vol=ram:{args.size}", "--workers", "1", *tls_serve]
    bench = ["taskset", "-c", args.client_cpu, args.skiff, "bench", "--target", f"127.0.0.1:{port}", "--export", "vol",
             "--rw", rw, "--qd", str(qd), "--duration", args.runtime, "--json", *tls_bench]
    server = subprocess.Popen(serve, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        out = subprocess.run(bench, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"tls.py: {' '.join(bench)} failed:\n{out.stderr}")
        return json.loads(out.stdout)
    finally:
        server.terminate()
        server.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--skiff", default="target/release/skiff")
    p.add_argument("--workloads", default="randread:1,randread:128")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--runtime", default="5s")
    p.add_argument("--size", default="1G")
    p.add_argument("--server-cpu", default="1")
    p.add_argument("--client-cpu", default="0")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    workloads = [(w.split(":")[0], int(w.split(":")[1])) for w in args.workloads.split(",")]
    print(f"placement: server on CPU {args.server_cpu}, client on CPU {args.client_cpu} (taskset); "
          f"median of {args.repeat}, plaintext and TLS alternating; {args.runtime} per run", flush=True)
    results, port = {}, 21000 + os.getpid() % 1000
    with tempfile.TemporaryDirectory() as certs:
        make_certs(certs)
        for rep in range(args.repeat):
            for rw, qd in workloads:
                order = [("plaintext", None), ("TLS", certs)]
                if rep % 2:
                    order.reverse()
                for name, c in order:
                    port += 1
                    r = run(args, port, rw, qd, c)
                    results.setdefault((rw, qd, name), []).append(r)
                    print(f"rep {rep + 1} {rw} QD {qd} {name}: {r['iops']:,.0f} IOPS, mean {r['lat_us']['mean']:.1f} µs, "
                          f"CPU µs/I/O client {r['client_cpu_us_per_io']:.2f} server {r['server_cpu_us_per_io']:.2f}", flush=True)

    def med(key, f):
        return statistics.median(f(r) for r in results[key])

    print(f"\n| workload (server CPU {args.server_cpu}, client CPU {args.client_cpu}, median of {args.repeat}) | transport "
          "| IOPS | mean µs | client CPU µs/I/O | server CPU µs/I/O | total CPU µs/I/O |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for rw, qd in workloads:
        for name in ("plaintext", "TLS"):
            k = (rw, qd, name)
            print(f"| {rw} 4k QD {qd} | {name} | {med(k, lambda r: r['iops']):,.0f} | {med(k, lambda r: r['lat_us']['mean']):.1f} "
                  f"| {med(k, lambda r: r['client_cpu_us_per_io']):.2f} | {med(k, lambda r: r['server_cpu_us_per_io']):.2f} "
                  f"| {med(k, lambda r: r['total_cpu_us_per_io']):.2f} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, time.strftime("tls-%Y%m%d-%H%M%S.json"))
    with open(path, "w") as f:
        json.dump({"placement": {"server_cpus": args.server_cpu, "client_cpus": args.client_cpu},
                   "runs": {f"{rw} qd{qd} {n}": v for (rw, qd, n), v in results.items()}}, f, indent=1)
    print(f"\nrecords: {path}")


if __name__ == "__main__":
    main()
