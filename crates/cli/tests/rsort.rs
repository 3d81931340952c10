//! RSort end to end (issue 12): two memory servers on a real etcd, `skiff rsort gen` writes
//! 20,000 TeraSort records into a namespace, `sort --workers 2` sorts them with two worker
//! processes through the bucket and output namespaces, `check` finds them in order and equal
//! to the input; one sector of the output overwritten fails the check.

use std::process::Command;
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
    // Pretty JSON (skiff ns) or one JSON line (skiff rsort).
    serde_json::from_str(stdout.trim()).unwrap_or(serde_json::Value::Null)
}

#[test]
fn rsort_sorts_terasort_records_with_worker_processes_and_check_proves_it() {
    let etcd = Cluster::start(1);
    let url = etcd.url();
    let _servers: Vec<KillOnDrop> =
        (0..2).map(|_| memory_server(env!("CARGO_BIN_EXE_skiff"), &url, "ram:64M", &[])).collect();
    let start = Instant::now();
    while ok(&["ns", "--coordinator", &url, "servers", "--json"]).as_array().map(Vec::len) != Some(2) {
        assert!(start.elapsed() < Duration::from_secs(60), "the memory servers never registered");
        std::thread::sleep(Duration::from_millis(100));
    }
    let common = ["--coordinator", url.as_str(), "--chunk", "1M", "--json"];
    let gen = ok(&[&["rsort"][..], &common, &["gen", "--records", "20000"]].concat());
    assert_eq!(gen["records"].as_f64(), Some(20000.0));
    let sort = ok(&[&["rsort"][..], &common, &["sort", "--workers", "2"]].concat());
    assert_eq!(sort["workers"].as_f64(), Some(2.0));
    assert!(sort["phase1_s"].as_f64().unwrap() > 0.0 && sort["phase2_s"].as_f64().unwrap() > 0.0, "{sort}");
    let check = ok(&[&["rsort"][..], &common, &["check"]].concat());
    assert_eq!(check["records"].as_f64(), Some(20000.0));

    // One sector of the output overwritten (through the data path, as any client could):
    // the check tells.
    let c = rstore::Coordinator::connect(std::slice::from_ref(&url));
    let mut seg = skiff_tests::rstore::segment(&c, "rsort-out", 0);
    seg.write(512 * 100, &[b'~'; 512]).unwrap();
    let out = run(&[&["rsort"][..], &common, &["check"]].concat());
    assert!(!out.status.success(), "a check of a damaged output passed");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("checksum") || err.contains("out of order"), "{err}");
}
