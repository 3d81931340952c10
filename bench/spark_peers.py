#!/usr/bin/env python3
"""Spark peers for Carafe (graphs) and RSort (TeraSort records): GraphX PageRank and shortest
paths, and Spark's sortByKey, in local mode on this machine, timed phase by phase.

    python3 bench/spark_peers.py pagerank --edges G.txt --cores 2 --iterations 32 --damping 0.85 [--out PR.txt]
    python3 bench/spark_peers.py sssp --edges G.txt --cores 2 --source 0 [--out D.txt]
    python3 bench/spark_peers.py sort --records IN.dat --cores 2 --out SORTED.dat
    python3 bench/spark_peers.py install [--run]      # what to install (pip, env); --run installs it
    python3 bench/spark_peers.py selftest             # small inputs, every result checked in Python
    python3 bench/spark_peers.py gen-graph --vertices 16384 --degree 16 --out G.txt
    python3 bench/spark_peers.py gen-records --records 1000000 --out IN.dat
    python3 bench/spark_peers.py check-sort --records IN.dat --sorted SORTED.dat
    python3 bench/spark_peers.py check-values pagerank|sssp --edges G.txt --values V.txt ...

Every subcommand prints one JSON object on the last line of stdout; progress goes to stderr.

**How it runs.** GraphX has no Python API, so the Spark side is Scala: bench/spark_graph.scala,
compiled on first use with the Scala compiler that pyspark's pip package ships in its jars dir
(scala-compiler 2.13; about 15 s, cached under ~/.cache/skiff-spark by the source's hash), then
run with pyspark's own `bin/spark-submit --master local[N]`. Nothing is downloaded at run time:
pyspark's wheel carries Spark's jars (spark-graphx included), the REPL and the compiler; the
driver binds to 127.0.0.1 and the web UI is off. No Python worker runs (the jobs are all JVM),
so PYSPARK_PYTHON does not matter. Needs Java 17 or newer (Spark 4 dropped Java 8 and 11).
Install: `install_instructions()` (or the `install` subcommand) gives the exact pip command and
environment.

**Times.** `startup_s` is from launching spark-submit until timing starts: two JVM starts
(spark-submit's launcher is a JVM too), the SparkContext's start (`context_s` is up to
there), and `--warmup` small shuffle jobs (`warmup_s`) that take class loading and the first
JIT compilations out of the first timed phase. Leave it out of comparisons. All other times
are measured inside the driver after that:
  pagerank/sssp: load_s reads the edge list and builds the GraphX graph, cached and
    materialised (edges and vertices counted); compute_s runs the algorithm until its result
    vertices are materialised; per_superstep_s = compute_s / iterations (PageRank) or
    / supersteps (SSSP); write_s writes --out (collect to the driver, sorted by id);
    total_s = load_s + compute_s + write_s.
  sort: read_s reads the records (binaryRecords, 100 bytes) into a cached RDD; sort_s keys
    them (first 10 bytes, the other 90 as the value) and sortByKey's them into --partitions
    (= cores) partitions, cached and counted per partition (this includes RangePartitioner's
    sampling job and the shuffle); write_s writes every partition in parallel at its offset in
    one local output file (page cache, no fsync); total_s is their sum. Materialising each
    phase costs a cached copy that a pipelined Spark job would not make: `--mode pipelined`
    runs it as TeraSort does instead, and reports sample_s (RangePartitioner's sampling job
    over the input), shuffle_sort_write_s (one job: read, shuffle, sort, write a part file
    per partition), concat_s (the driver joins the parts into the one output) and total_s.
`wall_s` is the whole process, start-up and shutdown included. Kryo serialisation is on
(with GraphX's classes registered), as GraphX's docs advise.

**Graph input.** SNAP text: `src dst [weight]` per line, whitespace separated, `#` and `%`
lines are comments (GraphLoader.edgeListFile's parse, plus `%` and the weight). Repeated edges
and self loops are kept. The vertices are those named by some edge (GraphX has no isolated
vertices); `vertices` in the JSON says how many.

**PageRank semantics (Spark 4.3.0, checked in its bytecode and by `selftest`).** `--dangling
rescale` (the default) runs GraphX's own `lib.PageRank.run(graph, iterations, 1 - damping)`:
ranks start at 1.0, each iteration computes `(1 - d) + d * sum(in-neighbour rank / outdegree)`,
so rank on vertices without out-edges (dangling) is dropped every iteration, *not*
redistributed; then `run` -> `runWithOptions(..., normalized = true)` -> `normalizeRankSum`
rescales the final ranks once so they sum to N (Spark 1.x's PageRank had no such step: its
sum fell below N whenever the graph had sinks). This script divides by the sum, so `--out`
ranks sum to 1. At convergence that equals PageRank with dangling rank spread evenly (the two
fixed points are proportional), but after a fixed 32 iterations from a uniform start they
differ: on random graphs with 10% sinks, by up to 1e-4 of a vertex's rank (1.9e-9 absolute
at 16,384 vertices), enough to fail carafe_reference.py's 1e-9 check against Carafe.
`--dangling spread` runs Carafe's, networkit's and igraph's PageRank with the same GraphX
operators lib.PageRank uses (aggregateMessages, outerJoinVertices, one job per iteration that
materialises the new ranks, which also sums the dangling rank in an accumulator): start 1/N,
each iteration `(1 - d)/N + d * (incoming + dangling/N)`. It matches a Python power iteration
with those semantics (and carafe_reference.py's check) to ~1e-18 per vertex, and costs about
what lib.PageRank does; use it where ranks are compared with Carafe's.

**Shortest paths.** Unweighted input: GraphX's `lib.ShortestPaths.run(graph.reverse,
Seq(source))`. Careful: ShortestPaths gives each vertex its hop count *to* the landmarks
(its messages go from an edge's destination to its source), so the distances *from* the
source are those of the reversed graph. Weighted input (a third column anywhere): the GraphX
programming guide's Pregel SSSP on the weights (`--algorithm pregel|shortestpaths` forces
either). `supersteps` is superstep 0 plus Pregel's iterations, the last of which sends
nothing, as Carafe counts them (a path of k hops from the source: k + 1). Pregel returns no
count and Spark 4's Pregel runs one or two jobs per superstep (RDD.isEmpty), so the count
comes from Pregel's own "Pregel finished iteration i" log lines, caught by a log4j appender
on that logger alone. Unreached vertices are written as `inf`.

**Sort.** Records are 100 bytes (gensort -a: 10-byte key, 88 bytes, "\\r\\n"); keys compare as
unsigned bytes, so the output equals `LC_ALL=C sort` of the file when keys are distinct (ties
in any order). `check-sort` verifies order and the multiset of records.

Depends on pyspark (pip) and the standard library only.
"""
import argparse
import collections
import fcntl
import hashlib
import heapq
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from carafe_reference import read_edges, read_values  # noqa: E402  (the same parsers as the tests' checks)

HERE = os.path.dirname(os.path.abspath(__file__))
SCALA_SOURCE = os.path.join(HERE, "spark_graph.scala")
SCALA_MAIN = "SkiffSpark"
PYSPARK_VERSION = "4.3.0"
JAVA_MIN = 17
RESULT_TAG = "SKIFF_RESULT "
RECORD = 100
KEY = 10


def log(msg):
    print(f"[spark_peers] {msg}", file=sys.stderr, flush=True)


def emit(obj):
    print(json.dumps(obj), flush=True)


# ---------------------------------------------------------------------------------------------
# Installation and environment


def install_instructions():
    """What the bench must install and set for these peers, as a dict:
    `pip`: the exact install command (argv); `env`: variables to set (none are required:
    SPARK_HOME is derived from the pyspark package and set for spark-submit by this script,
    JAVA_HOME only if `java` on PATH is older than 17); `java`: the Java needed."""
    return {
        "pip": [sys.executable, "-m", "pip", "install", f"pyspark=={PYSPARK_VERSION}"],
        "env": {},
        "env_optional": {
            "JAVA_HOME": f"a JDK >= {JAVA_MIN} if `java` on PATH is older (Debian: openjdk-17-jdk-headless)",
            "SPARK_HOME": "set by this script to pyspark's package dir; the pip package is a full Spark",
            "PYSPARK_PYTHON": "not needed: no Python workers run (all jobs are Scala/JVM)",
        },
        "java": f">= {JAVA_MIN} (Spark 4 runs on Java 17 and 21)",
        "apt_if_no_java": ["apt-get", "install", "-y", "openjdk-17-jdk-headless"],
        "first_run": "compiles bench/spark_graph.scala (about 15 s) into ~/.cache/skiff-spark; "
                     "nothing is downloaded at run time",
        "pyspark_version": PYSPARK_VERSION,
    }


def pyspark_info():
    """(version, SPARK_HOME) of the installed pyspark, or (None, None). Nothing is imported:
    the pip package's directory is a complete Spark (bin/, jars/)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    try:
        version = importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return version, os.path.abspath(list(spec.submodule_search_locations)[0])


def ensure_installed(install=False):
    """SPARK_HOME of an installed pyspark; installs the pinned one first when `install` and it
    is missing. Raises SystemExit with the install command when it is missing."""
    version, home = pyspark_info()
    if home is None and install:
        cmd = install_instructions()["pip"]
        log("installing: " + " ".join(cmd))
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        version, home = pyspark_info()
    if home is None:
        raise SystemExit("pyspark is not installed: " + " ".join(install_instructions()["pip"]))
    if version != PYSPARK_VERSION:
        log(f"warning: pyspark {version} installed, these peers were checked with {PYSPARK_VERSION}")
    return home


def java_bin():
    """The `java` spark-submit runs: $JAVA_HOME/bin/java, else the one on PATH."""
    return os.path.join(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else "java"


def java_version():
    """(major, text) of the `java` spark-submit will run."""
    try:
        p = subprocess.run([java_bin(), "-version"], capture_output=True, text=True)
    except FileNotFoundError:
        return None, "no java"
    m = re.search(r'version "(\d+)(?:\.(\d+))?', p.stderr)
    if not m:
        return None, p.stderr.strip()
    major = int(m.group(1))
    if major == 1 and m.group(2):  # "1.8.0_x"
        major = int(m.group(2))
    return major, p.stderr.splitlines()[0]


def spark_env(home):
    env = dict(os.environ)
    env["SPARK_HOME"] = home
    env.pop("SPARK_CONF_DIR", None)  # no site config: the run is what the flags say
    env["SPARK_LOCAL_IP"] = "127.0.0.1"  # loopback only, and no lookup of the host's name
    return env


def cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "skiff-spark")


def build_jar(home):
    """The compiled spark_graph.scala, compiled now if no jar for this source and Spark exists.
    Returns (jar path, seconds spent compiling or 0)."""
    with open(SCALA_SOURCE, "rb") as f:
        source = f.read()
    jars = os.path.join(home, "jars")
    compiler = sorted(j for j in os.listdir(jars) if j.startswith("scala-compiler"))
    tag = hashlib.sha256(source + "\0".join(compiler + [PYSPARK_VERSION, home]).encode()).hexdigest()[:16]
    d = os.path.join(cache_dir(), tag)
    jar = os.path.join(d, "skiff-spark.jar")
    if os.path.exists(jar):
        return jar, 0.0
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(jar):
            return jar, 0.0
        if not compiler:
            raise SystemExit(f"no scala-compiler jar in {jars}")
        log(f"compiling {os.path.relpath(SCALA_SOURCE)} with {compiler[0]} (once)")
        t = time.time()
        tmp = jar + ".tmp.jar"
        p = subprocess.run([java_bin(), "-cp", os.path.join(jars, "*"), "scala.tools.nsc.Main", "-usejavacp",
                            "-nowarn", "-d", tmp, SCALA_SOURCE], capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"scalac failed:\n{p.stdout}{p.stderr}")
        os.replace(tmp, jar)
        return jar, time.time() - t


LOG4J2 = """\
rootLogger.level = {level}
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{{HH:mm:ss}} %p %c{{1}}: %m%n
logger.nativecode.name = org.apache.hadoop.util.NativeCodeLoader
logger.nativecode.level = error
"""


def log4j_config(level):
    d = cache_dir()
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"log4j2-{level.lower()}.properties")
    text = LOG4J2.format(level=level.lower())
    if not os.path.exists(path) or open(path).read() != text:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    return path


def run_spark(a, command, **kv):
    """Runs `command` of spark_graph.scala under spark-submit in local[a.cores]; returns its
    figures plus this process's: cores, memory, startup_s (launch to timing start), context_s
    (launch to SparkContext up), jvm_start_s (launch to the driver JVM's start), wall_s,
    compile_s (0 unless the Scala was compiled in this call)."""
    home = ensure_installed()
    major, jtext = java_version()
    if major is None or major < JAVA_MIN:
        raise SystemExit(f"Spark {PYSPARK_VERSION} needs Java >= {JAVA_MIN}; found: {jtext} "
                         f"(set JAVA_HOME or apt-get install openjdk-17-jdk-headless)")
    jar, compile_s = build_jar(home)
    os.makedirs(a.local_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="skiff-spark-", dir=a.local_dir)
    partitions = a.partitions or a.cores
    log4j = log4j_config(a.log_level)
    argv = [os.path.join(home, "bin", "spark-submit"),
            "--master", f"local[{a.cores}]",
            "--driver-memory", a.memory,
            "--driver-java-options", f"-Dlog4j2.configurationFile=file:{log4j}",
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.driver.host=127.0.0.1",
            "--conf", "spark.driver.bindAddress=127.0.0.1",
            "--conf", f"spark.default.parallelism={partitions}",
            "--conf", "spark.log.structuredLogging.enabled=false",
            "--class", SCALA_MAIN, jar, command, f"partitions={partitions}", f"warmup={a.warmup}"]
    argv += [f"{k}={v}" for k, v in kv.items() if v is not None]
    log(f"spark-submit local[{a.cores}] {command} (driver memory {a.memory})")
    launch = time.time()
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=None, text=True,
                           env=spark_env(home) | {"SPARK_LOCAL_DIRS": scratch})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.time() - launch
    result = None
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
        elif line.strip():
            print(line, file=sys.stderr)
    if p.returncode != 0 or result is None:
        raise SystemExit(f"spark-submit {command} failed (exit {p.returncode})")
    jvm = result.pop("jvm_start_epoch_ms") / 1000.0
    ready = result.pop("context_ready_epoch_ms") / 1000.0
    started = result.pop("timed_start_epoch_ms") / 1000.0
    result.update({"cores": a.cores, "memory": a.memory, "pyspark_version": pyspark_info()[0],
                   "startup_s": started - launch, "jvm_start_s": jvm - launch, "context_s": ready - launch,
                   "wall_s": wall, "compile_s": compile_s})
    return result


# ---------------------------------------------------------------------------------------------
# Subcommands that run Spark


def cmd_pagerank(a):
    r = run_spark(a, "pagerank", edges=os.path.abspath(a.edges), iterations=a.iterations, damping=a.damping,
                  dangling=a.dangling, out=os.path.abspath(a.out) if a.out else None)
    r["ranks_sum_to"] = 1.0
    r["dangling_redistributed"] = a.dangling == "spread"
    if a.out:
        r["out"] = a.out
    emit(r)


def cmd_sssp(a):
    r = run_spark(a, "sssp", edges=os.path.abspath(a.edges), source=a.source, algorithm=a.algorithm,
                  out=os.path.abspath(a.out) if a.out else None)
    if a.out:
        r["out"] = a.out
    emit(r)


def cmd_sort(a):
    size = os.path.getsize(a.records)
    if size % RECORD:
        raise SystemExit(f"{a.records}: {size} bytes is not a whole number of {RECORD}-byte records")
    r = run_spark(a, "sort", records=os.path.abspath(a.records), out=os.path.abspath(a.out), mode=a.mode)
    r["out"] = a.out
    emit(r)


def cmd_install(a):
    info = install_instructions()
    if a.run:
        ensure_installed(install=True)
    version, home = pyspark_info()
    major, jtext = java_version()
    info.update({"installed_pyspark": version, "spark_home": home, "java_found": jtext,
                 "java_ok": major is not None and major >= JAVA_MIN})
    if home:
        jars = os.listdir(os.path.join(home, "jars"))
        info["graphx_jar"] = next((j for j in jars if j.startswith("spark-graphx")), None)
        info["scala_compiler_jar"] = next((j for j in jars if j.startswith("scala-compiler")), None)
    emit(info)


# ---------------------------------------------------------------------------------------------
# Inputs, and references in pure Python to check the results against


def gen_graph(path, vertices, degree, sinks, max_weight, seed):
    """A random directed graph on ids 0..vertices-1: vertices*degree edges, each from a random
    vertex outside the `sinks` fraction (those have no out-edges) to a random vertex, no self
    loops; a third column of integer weights in 1..max_weight when max_weight > 0."""
    rng = random.Random(seed)
    n_sinks = int(vertices * sinks)
    sources = list(range(vertices))
    rng.shuffle(sources)
    sources = sources[n_sinks:]
    m = vertices * degree
    with open(path, "w") as f:
        f.write(f"# random digraph: {vertices} vertices, {m} edges, {n_sinks} sinks, seed {seed}\n")
        written = 0
        while written < m:
            s, d = rng.choice(sources), rng.randrange(vertices)
            if s == d:
                continue
            f.write(f"{s}\t{d}\t{rng.randint(1, max_weight)}\n" if max_weight > 0 else f"{s}\t{d}\n")
            written += 1
    return {"vertices": vertices, "edges": m, "sinks": n_sinks, "weighted": max_weight > 0}


def gen_records(path, n, seed):
    """n gensort -a-like records: 10 printable key bytes, 88 printable bytes, "\\r\\n"."""
    rng = random.Random(seed)
    table = bytes(0x20 + b % 95 for b in range(256))
    with open(path, "wb") as f:
        done = 0
        while done < n:
            k = min(100_000, n - done)
            body = rng.randbytes(k * 98).translate(table)
            out = bytearray(k * RECORD)
            for i in range(k):
                out[i * RECORD:i * RECORD + 98] = body[i * 98:(i + 1) * 98]
                out[i * RECORD + 98:i * RECORD + 100] = b"\r\n"
            f.write(out)
            done += k
    return {"records": n, "bytes": n * RECORD}


def pagerank_reference(edges, iterations, damping, dangling):
    """PageRank by power iteration, ranks summing to 1. rescale: GraphX's lib.PageRank.run
    (start 1, (1-d) + d*incoming, dangling rank dropped, rescaled at the end); spread: start
    1/N, (1-d)/N + d*(incoming + dangling/N)."""
    vs = sorted({e[0] for e in edges} | {e[1] for e in edges})
    idx = {v: i for i, v in enumerate(vs)}
    n = len(vs)
    out = [0] * n
    for s, _, _ in edges:
        out[idx[s]] += 1
    src = [idx[s] for s, _, _ in edges]
    dst = [idx[d] for _, d, _ in edges]
    r = [1.0] * n if dangling == "rescale" else [1.0 / n] * n
    for _ in range(iterations):
        inc = [0.0] * n
        share = [r[i] / out[i] if out[i] else 0.0 for i in range(n)]
        for s, d in zip(src, dst):
            inc[d] += share[s]
        if dangling == "rescale":
            r = [(1 - damping) + damping * x for x in inc]
        else:
            base = (1 - damping) / n + damping * sum(r[i] for i in range(n) if not out[i]) / n
            r = [base + damping * x for x in inc]
    total = sum(r)
    return {v: r[i] / total for v, i in idx.items()}


def sssp_reference(edges, source, weighted):
    """Dijkstra from source (unit weights when unweighted); unreached vertices are inf."""
    adj = collections.defaultdict(list)
    vs = set()
    for s, d, w in edges:
        adj[s].append((d, w if weighted else 1.0))
        vs.update((s, d))
    dist = {v: math.inf for v in vs}
    if source not in dist:
        return dist
    dist[source] = 0.0
    heap = [(0.0, source)]
    while heap:
        du, u = heapq.heappop(heap)
        if du > dist[u]:
            continue
        for v, w in adj[u]:
            if du + w < dist[v]:
                dist[v] = du + w
                heapq.heappush(heap, (du + w, v))
    return dist


def compare_values(mine, ref):
    """Largest absolute difference (inf where the vertex sets or infinities disagree)."""
    if set(mine) != set(ref):
        return math.inf
    worst = 0.0
    for k, v in ref.items():
        if math.isinf(v) or math.isinf(mine[k]):
            if v != mine[k]:
                return math.inf
            continue
        worst = max(worst, abs(mine[k] - v))
    return worst


def check_sort(records_path, sorted_path, gnu=False):
    with open(records_path, "rb") as f:
        data = f.read()
    with open(sorted_path, "rb") as f:
        out = f.read()
    n = len(data) // RECORD
    recs = [data[i * RECORD:(i + 1) * RECORD] for i in range(n)]
    got = [out[i * RECORD:(i + 1) * RECORD] for i in range(len(out) // RECORD)]
    ordered = all(got[i - 1][:KEY] <= got[i][:KEY] for i in range(1, len(got)))
    recs.sort()
    same = len(out) == len(data) and sorted(got) == recs
    r = {"records": n, "output_records": len(got), "sorted_by_key": ordered, "same_records": same,
         "ok": ordered and same, "distinct_keys": len({x[:KEY] for x in recs}) == n}
    if gnu:
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(sorted_path))) as t:
            subprocess.run(["sort", "-o", t.name, records_path], check=True, env={**os.environ, "LC_ALL": "C"})
            with open(t.name, "rb") as f:
                r["identical_to_lc_all_c_sort"] = f.read() == out
    return r


def cmd_gen_graph(a):
    emit(gen_graph(a.out, a.vertices, a.degree, a.sinks, a.weights, a.seed) | {"out": a.out})


def cmd_gen_records(a):
    emit(gen_records(a.out, a.records, a.seed) | {"out": a.out})


def cmd_check_sort(a):
    r = check_sort(a.records, a.sorted, a.gnu)
    emit(r)
    sys.exit(0 if r["ok"] and r.get("identical_to_lc_all_c_sort", True) else 1)


def cmd_check_values(a):
    edges, weighted = read_edges(a.edges)
    mine = read_values(a.values)
    if a.kind == "pagerank":
        ref = pagerank_reference(edges, a.iterations, a.damping, a.dangling)
        diff = compare_values(mine, ref)
        r = {"kind": "pagerank", "dangling": a.dangling, "vertices": len(ref), "max_abs_diff": diff,
             "sum": sum(mine.values()), "ok": diff <= a.tolerance}
    else:
        ref = sssp_reference(edges, a.source, weighted)
        diff = compare_values(mine, ref)
        r = {"kind": "sssp", "weighted": weighted, "vertices": len(ref), "max_abs_diff": diff,
             "reached": sum(1 for v in ref.values() if v < math.inf), "ok": diff == 0.0}
    emit(r)
    sys.exit(0 if r["ok"] else 1)


def cmd_selftest(a):
    """Small inputs through every Spark path, each result checked against pure Python."""
    checks = {}
    with tempfile.TemporaryDirectory(prefix="skiff-spark-selftest-", dir=a.local_dir) as d:
        g = os.path.join(d, "g.txt")
        gw = os.path.join(d, "gw.txt")
        gen_graph(g, a.vertices, 8, 0.1, 0, 1)
        gen_graph(gw, a.vertices, 8, 0.1, 9, 2)
        edges, _ = read_edges(g)
        wedges, _ = read_edges(gw)
        refs = {m: pagerank_reference(edges, 32, 0.85, m) for m in ("rescale", "spread")}
        for mode in ("rescale", "spread"):
            out = os.path.join(d, f"pr-{mode}.txt")
            r = run_spark(a, "pagerank", edges=g, iterations=32, damping=0.85, dangling=mode, out=out)
            mine = read_values(out)
            checks[f"pagerank-{mode}"] = {
                "max_abs_diff": compare_values(mine, refs[mode]), "sum": sum(mine.values()),
                "rank_sum_before_normalising": r["rank_sum_before_normalising"], "vertices": r["vertices"],
                "compute_s": r["compute_s"], "startup_s": r["startup_s"]}
        checks["rescale_vs_spread_max_rel_diff"] = max(
            abs(refs["rescale"][v] - refs["spread"][v]) / refs["spread"][v] for v in refs["spread"])
        for name, path, es, weighted in (("sssp-hops", g, edges, False), ("sssp-weighted", gw, wedges, True)):
            out = os.path.join(d, f"{name}.txt")
            r = run_spark(a, "sssp", edges=path, source=0, algorithm="auto", out=out)
            ref = sssp_reference(es, 0, weighted)
            checks[name] = {"algorithm": r["algorithm"], "supersteps": r["supersteps"], "reached": r["reached"],
                            "max_abs_diff": compare_values(read_values(out), ref)}
            if not weighted:  # breadth first: one superstep per hop, and superstep 0
                checks[name]["expected_supersteps"] = int(max(v for v in ref.values() if v < math.inf)) + 1
        recs, out = os.path.join(d, "in.dat"), os.path.join(d, "out.dat")
        gen_records(recs, a.records, 3)
        for mode in ("phased", "pipelined"):
            r = run_spark(a, "sort", records=recs, out=out, mode=mode)
            checks[f"sort-{mode}"] = check_sort(recs, out, gnu=True) | {"total_s": r["total_s"]}
    ok = (checks["pagerank-rescale"]["max_abs_diff"] < 1e-12 and checks["pagerank-spread"]["max_abs_diff"] < 1e-12
          and checks["sssp-hops"]["max_abs_diff"] == 0 and checks["sssp-weighted"]["max_abs_diff"] == 0
          and checks["sssp-hops"]["supersteps"] == checks["sssp-hops"]["expected_supersteps"]
          and all(checks[f"sort-{m}"]["ok"] and checks[f"sort-{m}"]["identical_to_lc_all_c_sort"]
                  for m in ("phased", "pipelined")))
    emit({"ok": ok, "checks": checks})
    sys.exit(0 if ok else 1)


# ---------------------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def spark_flags(q):
        q.add_argument("--cores", type=int, default=2, help="local[N]: executor threads (default 2)")
        q.add_argument("--partitions", type=int, default=0, help="edge / output partitions (default: --cores)")
        q.add_argument("--memory", default="4g", help="spark.driver.memory, the heap of the one JVM (default 4g)")
        q.add_argument("--local-dir", default="/var/tmp", help="where spark.local.dir (shuffle, spill) goes")
        q.add_argument("--log-level", default="WARN", choices=["ERROR", "WARN", "INFO", "DEBUG"])
        q.add_argument("--warmup", type=int, default=3,
                       help="small shuffle jobs run before timing starts, counted in startup_s (default 3)")

    q = sub.add_parser("pagerank", help="GraphX static PageRank")
    q.add_argument("--edges", required=True)
    q.add_argument("--iterations", type=int, default=32)
    q.add_argument("--damping", type=float, default=0.85)
    q.add_argument("--dangling", choices=["rescale", "spread"], default="rescale",
                   help="rescale: GraphX's lib.PageRank.run (dangling rank dropped, ranks rescaled at the "
                        "end); spread: dangling rank spread evenly every iteration (Carafe's semantics)")
    q.add_argument("--out", help="write `vertex<TAB>rank` lines, ranks summing to 1")
    spark_flags(q)
    q.set_defaults(fn=cmd_pagerank)

    q = sub.add_parser("sssp", help="GraphX shortest paths from one source")
    q.add_argument("--edges", required=True)
    q.add_argument("--source", type=int, required=True)
    q.add_argument("--algorithm", choices=["auto", "shortestpaths", "pregel"], default="auto",
                   help="auto: lib.ShortestPaths (hops) on unweighted input, Pregel on weights otherwise")
    q.add_argument("--out", help="write `vertex<TAB>distance` lines (inf when unreached)")
    spark_flags(q)
    q.set_defaults(fn=cmd_sssp)

    q = sub.add_parser("sort", help="sortByKey of 100-byte TeraSort records into one file")
    q.add_argument("--records", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--mode", choices=["phased", "pipelined"], default="phased",
                   help="phased: read_s, sort_s, write_s, each materialised; pipelined: one TeraSort-like "
                        "pass (sample_s, shuffle_sort_write_s, concat_s)")
    spark_flags(q)
    q.set_defaults(fn=cmd_sort)

    q = sub.add_parser("install", help="print (and with --run do) what these peers need installed")
    q.add_argument("--run", action="store_true")
    q.set_defaults(fn=cmd_install)

    q = sub.add_parser("selftest", help="every Spark path on small inputs, checked in Python")
    q.add_argument("--vertices", type=int, default=1000)
    q.add_argument("--records", type=int, default=20000)
    spark_flags(q)
    q.set_defaults(fn=cmd_selftest)

    q = sub.add_parser("gen-graph", help="a random SNAP edge list")
    q.add_argument("--vertices", type=int, default=1 << 14)
    q.add_argument("--degree", type=int, default=16)
    q.add_argument("--sinks", type=float, default=0.1, help="fraction of vertices without out-edges")
    q.add_argument("--weights", type=int, default=0, help="max integer weight (0: no weight column)")
    q.add_argument("--seed", type=int, default=1)
    q.add_argument("--out", required=True)
    q.set_defaults(fn=cmd_gen_graph)

    q = sub.add_parser("gen-records", help="gensort -a-like 100-byte records")
    q.add_argument("--records", type=int, default=1_000_000)
    q.add_argument("--seed", type=int, default=1)
    q.add_argument("--out", required=True)
    q.set_defaults(fn=cmd_gen_records)

    q = sub.add_parser("check-sort", help="is SORTED the records of RECORDS in key order?")
    q.add_argument("--records", required=True)
    q.add_argument("--sorted", required=True)
    q.add_argument("--gnu", action="store_true", help="also compare bytes with `LC_ALL=C sort` (distinct keys)")
    q.set_defaults(fn=cmd_check_sort)

    q = sub.add_parser("check-values", help="compare --out values with a pure-Python reference")
    q.add_argument("kind", choices=["pagerank", "sssp"])
    q.add_argument("--edges", required=True)
    q.add_argument("--values", required=True)
    q.add_argument("--iterations", type=int, default=32)
    q.add_argument("--damping", type=float, default=0.85)
    q.add_argument("--dangling", choices=["rescale", "spread"], default="rescale")
    q.add_argument("--tolerance", type=float, default=1e-12)
    q.add_argument("--source", type=int, default=0)
    q.set_defaults(fn=cmd_check_values)

    a = p.parse_args()
    if getattr(a, "cores", 1) < 1:
        raise SystemExit("--cores must be at least 1")
    a.fn(a)


if __name__ == "__main__":
    main()
