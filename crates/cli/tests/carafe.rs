//! Carafe end to end (issue 30): two memory servers on a real etcd; `skiff carafe gen` stores an
//! R-MAT graph and writes its edge list; PageRank and SSSP on the Pregel engine with worker
//! processes, and Dijkstra explored online, agree with igraph and with a power iteration
//! (`bench/carafe_reference.py`) on the same edge list; a bad edge list is refused by line and
//! loses nothing; a worker killed with SIGKILL mid-run ends the run naming it, never a hang.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use skiff_tests::etcd::Cluster;
use skiff_tests::{memory_server, KillOnDrop};

fn skiff() -> Command {
    Command::new(env!("CARGO_BIN_EXE_skiff"))
}

fn run(args: &[&str]) -> std::process::Output {
    skiff().args(args).output().expect("skiff")
}

fn ok(args: &[&str]) -> serde_json::Value {
    let out = run(args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "skiff {args:?}: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    // Pretty JSON (skiff ns) or one JSON line after the progress (skiff carafe).
    serde_json::from_str(stdout.trim())
        .or_else(|_| serde_json::from_str(stdout.trim().lines().last().unwrap_or("")))
        .unwrap_or(serde_json::Value::Null)
}

/// `bench/carafe_reference.py` on Carafe's output: it exits 1 when a check fails. igraph is
/// installed by scripts/test.sh; its absence fails the test.
fn reference(args: &[&str]) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/carafe_reference.py");
    let out = Command::new("python3").arg(script).args(args).output().expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "carafe_reference.py {args:?} failed (is igraph installed? scripts/test.sh installs it): {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap()
}

struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let dir = std::env::temp_dir().join(format!("skiff-carafe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn file(&self, name: &str) -> String {
        self.0.join(name).to_str().unwrap().to_owned()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn carafe_computes_what_igraph_computes_refuses_bad_edge_lists_and_names_a_killed_worker() {
    let etcd = Cluster::start(1);
    let url = etcd.url();
    let _servers: Vec<KillOnDrop> =
        (0..2).map(|_| memory_server(env!("CARGO_BIN_EXE_skiff"), &url, "ram:128M", &[])).collect();
    let start = Instant::now();
    while ok(&["ns", "--coordinator", &url, "servers", "--json"]).as_array().map(Vec::len) != Some(2) {
        assert!(start.elapsed() < Duration::from_secs(60), "the memory servers never registered");
        std::thread::sleep(Duration::from_millis(100));
    }
    let dir = Scratch::new();
    let carafe = |name: &str, rest: &[&str]| -> serde_json::Value {
        // No --chunk: the namespaces take the servers' 1 MiB chunks.
        ok(&[&["carafe", "--coordinator", &url, "--json", "--name", name][..], rest].concat())
    };

    // A directed, unweighted R-MAT graph: PageRank with two workers, shortest paths online.
    let edges = dir.file("g.txt");
    let g = carafe("g", &["gen", "--scale", "10", "--seed", "3", "--file", &edges]);
    assert_eq!(g["edges"].as_f64(), Some(16.0 * 1024.0));
    let pr = dir.file("pr.txt");
    let ran = carafe("g", &["pagerank", "--workers", "2", "--iterations", "40", "--out", &pr]);
    assert_eq!(ran["supersteps"].as_f64(), Some(41.0), "{ran}");
    assert!(
        ran["mail_bytes"].as_f64().unwrap() > 0.0,
        "two partitions pass messages through the mailbox: {ran}"
    );
    let checked = reference(&["pagerank", "--edges", &edges, "--values", &pr, "--iterations", "40"]);
    assert_eq!(checked["ok"], true, "{checked}");
    // The same run with its workers started by hand, as on other machines: the same ranks.
    let pr_again = dir.file("pr-again.txt");
    let mut run_alone = KillOnDrop(
        skiff()
            .args([
                "carafe",
                "--coordinator",
                &url,
                "--chunk",
                "1M",
                "--json",
                "--name",
                "g",
                "--external-workers",
                "30",
            ])
            .args(["pagerank", "--workers", "2", "--iterations", "40", "--out", &pr_again])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // At once: a worker that comes before its run waits past what the last run left.
    let hand: Vec<KillOnDrop> = (0..2)
        .map(|i| {
            let (id, workers) = (i.to_string(), "2");
            KillOnDrop(
                skiff()
                    .args([
                        "carafe",
                        "--coordinator",
                        &url,
                        "--name",
                        "g",
                        "worker",
                        "--id",
                        &id,
                        "--workers",
                        workers,
                    ])
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap(),
            )
        })
        .collect();
    assert!(run_alone.0.wait().unwrap().success(), "the run with external workers failed");
    drop(hand);
    assert_eq!(std::fs::read_to_string(&pr).unwrap(), std::fs::read_to_string(&pr_again).unwrap());

    let paths = carafe("g", &["path", "--pairs", "12", "--seed", "5"]);
    let paths_file = dir.file("paths.json");
    std::fs::write(&paths_file, paths.to_string()).unwrap();
    let checked = reference(&["paths", "--edges", &edges, "--paths", &paths_file]);
    assert_eq!(checked["pairs"], 12, "{checked}");
    // The same walks with a cache of one block per namespace: blocks are evicted and read
    // again, and every length stays right.
    let evicting = carafe("g", &["path", "--pairs", "12", "--seed", "5", "--cache", "64K"]);
    assert!(evicting["reads"].as_f64().unwrap() > paths["reads"].as_f64().unwrap(), "{evicting}\n{paths}");
    std::fs::write(&paths_file, evicting.to_string()).unwrap();
    let checked = reference(&["paths", "--edges", &edges, "--paths", &paths_file]);
    assert_eq!(checked["pairs"], 12, "{checked}");
    // --cold: every pair reads what it touches again, and finds the same lengths.
    let cold = carafe("g", &["path", "--pairs", "12", "--seed", "5", "--cold"]);
    assert!(cold["reads"].as_f64().unwrap() > paths["reads"].as_f64().unwrap(), "{cold}\n{paths}");
    let lengths = |v: &serde_json::Value| -> Vec<serde_json::Value> {
        v["paths"].as_array().unwrap().iter().map(|p| p["distance"].clone()).collect()
    };
    assert_eq!(lengths(&cold), lengths(&paths));

    // A weighted graph stored both ways: SSSP with three workers.
    let wedges = dir.file("w.txt");
    carafe(
        "w",
        &["gen", "--scale", "9", "--seed", "4", "--max-weight", "50", "--undirected", "--file", &wedges],
    );
    let both = dir.file("w-both.txt");
    let text = std::fs::read_to_string(&wedges).unwrap();
    let mut doubled = String::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let f: Vec<&str> = line.split_whitespace().collect();
        doubled += &format!("{}\t{}\t{}\n", f[0], f[1], f[2]);
        if f[0] != f[1] {
            doubled += &format!("{}\t{}\t{}\n", f[1], f[0], f[2]);
        }
    }
    std::fs::write(&both, doubled).unwrap();
    let source = text.lines().nth(1).unwrap().split_whitespace().next().unwrap().to_owned();
    let dist = dir.file("d.txt");
    let ran = carafe("w", &["sssp", "--source", &source, "--workers", "3", "--out", &dist]);
    assert!(ran["supersteps"].as_f64().unwrap() > 2.0, "{ran}");
    let checked = reference(&["sssp", "--edges", &both, "--values", &dist, "--source", &source]);
    assert!(checked["reached"].as_u64().unwrap() > 100, "{checked}");

    // A SNAP file with comments imports; a bad one is refused by line and the graph it would
    // have replaced is still whole.
    let snap = dir.file("snap.txt");
    std::fs::write(&snap, "# Directed graph\n# FromNodeId\tToNodeId\n10\t20\n20\t30\n\n30\t10\n10\t30\n")
        .unwrap();
    let imported = carafe("s", &["import", "--file", &snap]);
    assert_eq!((imported["vertices"].as_f64(), imported["edges"].as_f64()), (Some(3.0), Some(4.0)));
    let bad = dir.file("bad.txt");
    for (text, want) in [
        ("1 2\n2 x\n", "line 2: a vertex id is not a number"),
        ("# c\n1 2\n-3 4\n", "line 3: vertex id out of range"),
        ("1 2 -0.5\n", "line 1: weight must be"),
        ("# nothing\n", "no edge"),
    ] {
        std::fs::write(&bad, text).unwrap();
        let out = run(&["carafe", "--coordinator", &url, "--name", "s", "import", "--file", &bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{text:?}: {err}");
    }
    let info = carafe("s", &["info"]);
    assert_eq!((info["vertices"].as_f64(), info["edges"].as_f64()), (Some(3.0), Some(4.0)));
    let out = run(&["carafe", "--coordinator", &url, "--name", "nothing", "pagerank"]);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("gen"),
        "a run on no graph"
    );

    // A worker killed with SIGKILL in the middle of a long run: the run ends naming it.
    // Killed on drop, so that a failing test leaves no run behind.
    let mut long = KillOnDrop(
        skiff()
            .args(["carafe", "--coordinator", &url, "--chunk", "1M", "--name", "g"])
            .args(["pagerank", "--workers", "2", "--iterations", "100000"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let pid = long.0.id().to_string();
    let victim = loop {
        let out = Command::new("pgrep").args(["-P", &pid, "-f", "worker --id 1"]).output().unwrap();
        let found = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if !found.is_empty() {
            break found;
        }
        assert!(long.0.try_wait().unwrap().is_none(), "the run ended before its workers started");
        std::thread::sleep(Duration::from_millis(20));
    };
    // Let it get into its supersteps.
    std::thread::sleep(Duration::from_millis(500));
    assert!(Command::new("kill").args(["-9", &victim]).status().unwrap().success());
    let t = Instant::now();
    let status = loop {
        if let Some(s) = long.0.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(30) {
            panic!("the run went on for 30 s after its worker was killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut long.0.stderr.take().unwrap(), &mut err).unwrap();
    let last = err.lines().last().unwrap_or("");
    assert!(!status.success() && last.contains("worker 1 exited"), "{last}");
    // Nothing is left running: the other worker stopped too.
    let workers = format!("carafe --coordinator {url} --name g worker");
    let out = Command::new("pgrep").args(["-f", &workers]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).trim().is_empty(), "workers left behind");
}
