//! fio's own workloads through skiff's fio engine (fio/skiff_engine.c over the C API), against
//! a real target. fio/build.sh builds the engine once per test run; every test checks what
//! fio reports and, where it can, what reached the target.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use initiator::{Lane, LaneConfig};
use serde_json::Value;
use server::Target;
use skiff_tests::{run_ok, start_target, tcp_endpoint, tool};

const MIB: u64 = 1024 * 1024;

/// target/fio/skiff-engine.so, built by fio/build.sh the first time a test asks for it.
fn engine() -> &'static PathBuf {
    static ENGINE: OnceLock<PathBuf> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
        let out = Command::new(root.join("fio/build.sh"))
            .args(["--profile", "debug"])
            .current_dir(&root)
            .output()
            .expect("run fio/build.sh");
        assert!(
            out.status.success(),
            "fio/build.sh failed: {}\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let so = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target"))
            .join("fio/skiff-engine.so");
        assert!(so.exists(), "fio/build.sh succeeded but left no {}", so.display());
        so
    })
}

/// fio with the skiff engine loaded. It runs in the temporary directory so that nothing it
/// leaves behind (verify state files) lands in the source tree.
fn fio() -> Command {
    let mut cmd = tool("fio", "fio");
    cmd.current_dir(std::env::temp_dir()).arg(format!("--ioengine=external:{}", engine().display()));
    cmd
}

/// fio on export `vol` of `t` with `args`; returns the JSON report.
fn fio_json(t: &Target, args: &[&str]) -> Value {
    fio_json_at(&tcp_endpoint(t).to_string(), args)
}

/// fio on export `vol` of the target at `target` (any endpoint syntax) with `args`.
fn fio_json_at(target: &str, args: &[&str]) -> Value {
    let mut cmd = fio();
    cmd.arg(format!("--target={target}"))
        .args(["--export=vol", "--output-format=json", "--verify_state_save=0"])
        .args(args);
    let stdout = run_ok(&mut cmd);
    // fio may print notes before the report; the report is the JSON object after them.
    let start = stdout.find('{').unwrap_or_else(|| panic!("no JSON from fio: {stdout}"));
    serde_json::from_str(&stdout[start..]).unwrap_or_else(|e| panic!("fio JSON: {e}\n{stdout}"))
}

fn jobs(report: &Value) -> &Vec<Value> {
    report["jobs"].as_array().expect("jobs in the fio report")
}

fn io_bytes(job: &Value, dir: &str) -> u64 {
    job[dir]["io_bytes"].as_u64().unwrap_or_else(|| panic!("{dir}.io_bytes in {job}"))
}

fn assert_no_error(report: &Value) {
    for job in jobs(report) {
        assert_eq!(job["error"].as_i64(), Some(0), "job {} failed: {job}", job["jobname"]);
    }
}

#[test]
fn random_writes_read_back_verified() {
    let t = start_target(&["vol=ram:64M"], 2);
    let report = fio_json(
        &t,
        &[
            "--name=verify",
            "--rw=randwrite",
            "--bs=4k",
            "--size=16M",
            "--iodepth=32",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ],
    );
    assert_no_error(&report);
    let job = &jobs(&report)[0];
    assert_eq!(io_bytes(job, "write"), 16 * MIB, "{job}");
    assert_eq!(io_bytes(job, "read"), 16 * MIB, "the verify pass reads all back: {job}");
    assert!(t.stats().get("req_write").unwrap_or(0) >= 4096);
}

#[test]
fn adaptive_polling_verifies_at_queue_depth_one() {
    let t = start_target(&["vol=ram:64M"], 1);
    let report = fio_json(
        &t,
        &[
            "--name=polled",
            "--rw=randwrite",
            "--bs=4k",
            "--size=4M",
            "--iodepth=1",
            "--poll=adaptive",
            "--poll_spin_us=30",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ],
    );
    assert_no_error(&report);
    let job = &jobs(&report)[0];
    assert_eq!(io_bytes(job, "read"), 4 * MIB, "the verify pass reads all back: {job}");
}

#[test]
fn jobs_as_threads_share_lanes_and_verify() {
    let t = start_target(&["vol=ram:64M"], 2);
    let accepted_before = t.stats().get("connections_accepted").unwrap_or(0);
    let report = fio_json(
        &t,
        &[
            "--name=shared",
            "--thread",
            "--numjobs=8",
            "--shared_lanes=2",
            "--rw=randwrite",
            "--bs=4k",
            "--size=2M",
            "--offset_increment=2M",
            "--iodepth=4",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--group_reporting=0",
        ],
    );
    assert_no_error(&report);
    assert_eq!(jobs(&report).len(), 8);
    for job in jobs(&report) {
        assert_eq!(io_bytes(job, "read"), 2 * MIB, "each job verifies its 2 MiB: {job}");
    }
    let s = t.stats();
    // setup opens a lane per job to learn the size; the eight jobs then share two lanes.
    let accepted = s.get("connections_accepted").unwrap_or(0) - accepted_before;
    assert_eq!(accepted, 8 + 2, "8 setup lanes, then 8 jobs on 2 shared lanes");
    assert!(s.get("req_write").unwrap_or(0) >= 8 * 512);
    let per_caravan =
        s.get("caravan_reqs_total").unwrap() as f64 / s.get("caravans_received").unwrap() as f64;
    assert!(per_caravan > 4.0, "{per_caravan:.2} requests per caravan: no job has more than 4 outstanding");
}

/// `batch_log=FILE`: the adaptive controller's decisions reach the file once, when the lane
/// closes or, shared, when the group's last job does (each job holds its own copy of the path,
/// and the jobs still share their two lanes); every line is a decision of one of the lanes.
#[test]
fn the_adaptive_controller_logs_its_decisions_once() {
    let t = start_target(&["vol=ram:64M"], 2);
    let dir = tempfile::tempdir().unwrap();
    for (jobs, shared) in [(8, 2), (1, 0)] {
        let log = dir.path().join(format!("levels-{jobs}.jsonl"));
        let accepted_before = t.stats().get("connections_accepted").unwrap_or(0);
        let report = fio_json(
            &t,
            &[
                "--name=adaptive",
                "--thread",
                &format!("--numjobs={jobs}"),
                &format!("--shared_lanes={shared}"),
                "--batching=adaptive",
                &format!("--batch_log={}", log.display()),
                "--rw=randread",
                "--bs=4k",
                "--size=8M",
                "--iodepth=4",
                "--time_based",
                "--runtime=1",
            ],
        );
        assert_no_error(&report);
        let accepted = t.stats().get("connections_accepted").unwrap_or(0) - accepted_before;
        assert_eq!(accepted, jobs + shared.max(1), "a setup lane per job, then the jobs' lanes");
        let text = std::fs::read_to_string(&log).unwrap();
        let decisions: Vec<Value> =
            text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
        let mut seen = std::collections::BTreeSet::new();
        for d in &decisions {
            let lane = d["lane"].as_u64().unwrap();
            assert!(lane < shared.max(1), "{d}");
            assert!((1..=64).contains(&d["level"].as_u64().unwrap()), "{d}");
            assert!(d["bytes_per_s"].as_f64().unwrap() >= 0.0 && d["a_out"].as_f64().is_some(), "{d}");
            assert!(seen.insert((lane, d["at_us"].as_u64().unwrap())), "a decision logged twice: {text}");
        }
        for lane in 0..shared.max(1) {
            let n = decisions.iter().filter(|d| d["lane"] == lane).count();
            // The first decision ends the controller's first quarter interval (25 ms) of a
            // 1 s run: any lane that carried I/O has one, however slow the machine.
            assert!(n >= 1, "lane {lane} logged no decision: {text}");
        }
    }
}

#[test]
fn sequential_large_blocks_land_as_written() {
    let t = start_target(&["vol=ram:64M"], 2);
    let common = ["--bs=128k", "--size=16M", "--iodepth=8", "--buffer_pattern=0xdeadbeef"];
    let mut args = vec!["--name=write", "--rw=write"];
    args.extend(common);
    // A second job, after the first (stonewall), reads the same range back.
    args.extend(["--name=read", "--rw=read", "--stonewall"]);
    args.extend(common);
    let report = fio_json(&t, &args);
    assert_no_error(&report);
    let j = jobs(&report);
    assert_eq!(j.len(), 2);
    assert_eq!(io_bytes(&j[0], "write"), 16 * MIB, "{}", j[0]);
    assert_eq!(io_bytes(&j[1], "read"), 16 * MIB, "{}", j[1]);

    // The bytes themselves, read through the native lane rather than fio.
    let mut lane = Lane::connect(&tcp_endpoint(&t), "vol", &LaneConfig::default()).unwrap();
    for offset in [0, 5 * 128 * 1024 + 4096, 16 * MIB - 4096] {
        let mut block = vec![0u8; 4096];
        lane.read_at(&mut block, offset).unwrap();
        let want: Vec<u8> = [0xde, 0xad, 0xbe, 0xef].iter().copied().cycle().take(4096).collect();
        assert_eq!(block, want, "block at {offset} holds fio's buffer_pattern");
    }
    let mut past = vec![0xffu8; 4096];
    lane.read_at(&mut past, 16 * MIB).unwrap();
    assert!(past.iter().all(|&b| b == 0), "fio wrote past its 16 MiB");
}

#[test]
fn fsync_becomes_flush() {
    let t = start_target(&["vol=ram:64M"], 2);
    let flushes_before = t.stats().get("req_flush").unwrap_or(0);
    let report =
        fio_json(&t, &["--name=fsync", "--rw=write", "--bs=4k", "--size=1M", "--iodepth=4", "--fsync=8"]);
    assert_no_error(&report);
    let job = &jobs(&report)[0];
    assert_eq!(io_bytes(job, "write"), MIB, "{job}");
    // 256 writes with a sync after every 8th: 32 flushes, perhaps one more at the end.
    let flushes = t.stats().get("req_flush").unwrap_or(0) - flushes_before;
    assert!(flushes >= 32, "{flushes} flushes reached the target");
    let syncs = job["sync"]["total_ios"].as_u64().unwrap_or(0);
    assert!(syncs >= 32, "fio counted {syncs} syncs: {job}");
}

#[test]
fn a_missing_export_fails_the_job() {
    let t = start_target(&["vol=ram:64M"], 1);
    let out = fio()
        .arg(format!("--target={}", tcp_endpoint(&t)))
        .args(["--export=nope", "--name=x", "--rw=read", "--size=1M"])
        .output()
        .unwrap();
    let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "fio succeeded on a missing export: {all}");
    assert!(all.contains("cannot open nope"), "the log names the failure: {all}");
}

#[test]
fn a_key_and_tls_reach_a_target_that_requires_both() {
    let dir = tempfile::tempdir().unwrap();
    skiff_tests::certs::make(dir.path());
    let keys = dir.path().join("keys.psk");
    std::fs::write(&keys, format!("alice:{}\n", "07".repeat(16))).unwrap();
    let tls = transport::tls::CertDir::new(dir.path()).server_config(false).unwrap();
    let t = skiff_tests::start_target_with(&["vol=ram:64M,allow=alice:rw"], |c| {
        c.tls = Some(server::TlsListen {
            mode: transport::tls::TlsMode::Require,
            config: tls,
            verify_peer: false,
        });
        c.keys = vec![proto::auth::Key::new("alice", &[7; 16]).unwrap()];
    });
    let key_file = format!("--key_file={}", keys.display());
    let certs = format!("--tls_certificates={}", dir.path().display());
    let report = fio_json(
        &t,
        &[
            &key_file,
            &certs,
            "--name=tls",
            "--rw=randwrite",
            "--bs=4k",
            "--size=4M",
            "--iodepth=16",
            "--verify=crc32c",
        ],
    );
    assert_no_error(&report);
    assert_eq!(io_bytes(&jobs(&report)[0], "write"), 4 * MIB);

    // Without TLS, or without the key, the job fails.
    for args in [vec![key_file.as_str()], vec![certs.as_str()]] {
        let out = fio()
            .arg(format!("--target={}", tcp_endpoint(&t)))
            .args(["--export=vol", "--name=x", "--rw=read", "--size=1M"])
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "fio {args:?} reached a target needing TLS and a key");
    }
}

#[test]
fn enghelp_lists_the_engine_options() {
    let help = run_ok(tool("fio", "fio").arg(format!("--enghelp={}", engine().display())));
    for option in [
        "target",
        "export",
        "aggregation",
        "aggregation_bytes",
        "doorbell_us",
        "timeout_ms",
        "batching",
        "shared_lanes",
        "key_file",
        "key",
        "tls_certificates",
        "poll",
        "poll_spin_us",
        "batch_log",
    ] {
        assert!(
            help.lines().any(|l| l.split_whitespace().next() == Some(option)),
            "{option} missing: {help}"
        );
    }
}

/// The engine over raw Ethernet (`--target=eth:IFACE/MAC`): a target listening with `--eth` in
/// a namespace at the far end of a veth pair, fio's jobs as threads on shared lanes, every
/// block verified. Root only (the raw-Ethernet tests' rule).
#[test]
fn fio_verifies_over_raw_ethernet() {
    use skiff_tests::netns::{self, VethPair};
    if !netns::available("fio over raw Ethernet") {
        return;
    }
    let pair = VethPair::new(9000);
    let iface = pair.peer.clone();
    let t = pair.in_ns(move || {
        skiff_tests::start_target_with(&["vol=ram:64M"], |c| {
            c.listen = vec![transport::Endpoint::eth(iface, None)];
        })
    });
    let Some(transport::Endpoint::Eth { mac: Some(mac), .. }) = t.endpoints().into_iter().next() else {
        panic!("the target reports its Ethernet endpoint")
    };
    let target = transport::Endpoint::eth(pair.host.clone(), Some(mac)).to_string();
    let report = fio_json_at(
        &target,
        &[
            "--name=eth",
            "--thread",
            "--numjobs=2",
            "--shared_lanes=1",
            "--rw=randwrite",
            "--bs=4k",
            "--size=8M",
            "--offset_increment=8M",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ],
    );
    assert_no_error(&report);
    for job in jobs(&report) {
        assert_eq!(io_bytes(job, "write"), 8 * MIB, "{job}");
        assert_eq!(io_bytes(job, "read"), 8 * MIB, "{job}");
    }
    assert_eq!(t.stats().get("req_write"), Some(2 * 2048));
}
