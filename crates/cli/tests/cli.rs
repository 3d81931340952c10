//! The `skiff` binary as a user runs it: bench on the embedded default, serve in one process
//! and bench/info in another, signals, and the errors a user sees.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use skiff_tests::KillOnDrop;
use std::time::{Duration, Instant};

fn skiff() -> Command {
    Command::new(env!("CARGO_BIN_EXE_skiff"))
}

/// `skiff serve` on an ephemeral port; returns the child and the address it logged.
fn serve(exports: &[&str]) -> (KillOnDrop, String) {
    let args: Vec<&str> = exports.iter().flat_map(|e| ["--export", e]).collect();
    serve_args(&args)
}

/// `skiff serve` on an ephemeral port with these arguments besides (killed if the test fails
/// before it stops it).
fn serve_args(args: &[&str]) -> (KillOnDrop, String) {
    let mut cmd = skiff();
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--workers", "2"]);
    cmd.args(args);
    let mut child = cmd.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().expect("spawn skiff serve");
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let Some(Ok(line)) = lines.next() else { break };
        if let Some(i) = line.find("listening ep=") {
            let addr = line[i + "listening ep=".len()..].split_whitespace().next().unwrap().to_owned();
            // Keep draining the log so the server never blocks on a full pipe.
            std::thread::spawn(move || for _ in lines.by_ref() {});
            return (KillOnDrop(child), addr);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("skiff serve did not report its address");
}

fn terminate(mut child: KillOnDrop) -> std::process::ExitStatus {
    // SIGTERM through the kill command: the test needs no libc of its own.
    Command::new("kill").args(["-TERM", &child.0.id().to_string()]).status().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "skiff serve ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn json(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[test]
fn bench_on_the_embedded_default_verifies_and_reports_json() {
    let out = skiff()
        .args(["bench", "--duration", "1s", "--size", "16M", "--verify", "--json", "--rw", "randrw"])
        .output()
        .unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v = json(&out);
    for field in [
        "iops",
        "bytes_per_s",
        "ios",
        "client_cpu_us_per_io",
        "server_cpu_us_per_io",
        "client_ctx_switches_per_io",
        "verify_errors",
    ] {
        assert!(v[field].is_number(), "missing {field}: {v}");
    }
    for q in ["mean", "p50", "p99", "p999"] {
        assert!(v["lat_us"][q].as_f64().unwrap() > 0.0, "lat_us.{q}");
    }
    assert_eq!(v["verify_errors"], 0);
    assert_eq!(v["io_errors"], 0);
    assert!(v["ios"].as_u64().unwrap() > 0);
    assert!(v["server_cpu_us_per_io"].as_f64().unwrap() > 0.0, "server CPU is measured: {v}");
    for stage in
        ["client_send", "target_recv", "target_exec", "target_send", "client_recv", "client_complete"]
    {
        assert!(v["stages_us"][stage].as_f64().unwrap() > 0.0, "stage {stage} is measured: {v}");
    }
    assert!(v["stages_us"]["elsewhere"].is_null(), "only at QD 1 with one thread: {v}");
}

#[test]
fn bench_at_a_rate_starts_no_more_than_asked_with_adaptive_polling() {
    let out = skiff()
        .args(["bench", "--duration", "1s", "--size", "16M", "--verify", "--json", "--qd", "4"])
        .args(["--rate", "400", "--poll", "adaptive"])
        .output()
        .unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v = json(&out);
    assert_eq!((v["verify_errors"].as_u64(), v["io_errors"].as_u64()), (Some(0), Some(0)), "{v}");
    // One I/O per 2.5 ms tick over a timed second: at most 400 (and the tick at 0), never a burst.
    let ios = v["ios"].as_u64().unwrap();
    assert!((1..=401).contains(&ios), "{ios} I/Os at --rate 400 for 1 s: {v}");
    assert_eq!(v["poll"], "adaptive:50", "{v}");
    assert!(v["client_poll"]["waits"].as_u64().unwrap() > 0, "every reply was waited for by the policy: {v}");
}

#[test]
fn bench_through_shared_lanes_verifies_in_every_batching_mode() {
    for batching in ["off", "static:8", "adaptive"] {
        let out = skiff()
            .args(["bench", "--duration", "1s", "--size", "16M", "--verify", "--json", "--rw", "randrw"])
            .args(["--shared-lane", "--lanes", "2", "--threads", "8", "--qd", "4", "--batching", batching])
            .output()
            .unwrap();
        assert!(out.status.success(), "{batching}: {}", String::from_utf8_lossy(&out.stderr));
        let v = json(&out);
        assert_eq!(v["shared_lanes"], 2, "{v}");
        assert_eq!(v["threads"], 8);
        assert_eq!(v["verify_errors"], 0);
        assert_eq!(v["io_errors"], 0);
        assert_eq!(v["batch_level_final"].as_array().map(Vec::len), Some(2), "one level per lane: {v}");
        let per_caravan = v["client_reqs_per_caravan"].as_f64().unwrap();
        if batching == "off" {
            assert_eq!(per_caravan, 1.0, "{v}");
        }
    }
}

#[test]
fn bench_places_read_data_directly_only_when_asked() {
    for (direct_min, placed) in [("0", true), ("off", false)] {
        let out = skiff()
            .args(["bench", "--duration", "1s", "--size", "16M", "--verify", "--json", "--rw", "randrw"])
            .args(["--bs", "64k", "--qd", "8", "--direct-min", direct_min])
            .output()
            .unwrap();
        assert!(out.status.success(), "{direct_min}: {}", String::from_utf8_lossy(&out.stderr));
        let v = json(&out);
        assert_eq!((v["verify_errors"].as_u64(), v["io_errors"].as_u64()), (Some(0), Some(0)), "{v}");
        let share = v["read_placed_share"].as_f64().expect("reads happened");
        assert_eq!(share > 0.0, placed, "--direct-min {direct_min}: {v}");
    }
}

#[test]
fn serve_in_one_process_bench_and_info_in_others() {
    let (child, addr) = serve(&["vol=ram:32M", "blank=null:1G", "ro=ram:1M,ro"]);

    let out = skiff()
        .args([
            "bench",
            "--target",
            &addr,
            "--export",
            "vol",
            "--duration",
            "1s",
            "--verify",
            "--threads",
            "2",
            "--qd",
            "8",
            "--rw",
            "randwrite",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("IOPS") && stdout.contains("verify errors  0"), "{stdout}");

    // A null export reads zeroes: verification must catch that and fail the run.
    let out = skiff()
        .args([
            "bench",
            "--target",
            &addr,
            "--export",
            "blank",
            "--duration",
            "1s",
            "--size",
            "4M",
            "--verify",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "verification against a null export must fail");
    assert!(json(&out)["verify_errors"].as_u64().unwrap() > 0);

    let out = skiff().args(["info", &addr]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("vol") && text.contains("32.0 MiB") && text.contains("queue depth"), "{text}");
    let out = skiff().args(["info", &addr, "--json"]).output().unwrap();
    let v = json(&out);
    let ro = v["exports"].as_array().unwrap().iter().find(|e| e["name"] == "ro").unwrap().clone();
    assert_eq!(ro["read_only"], true);
    assert!(v["limits"]["io_bytes_max"].as_u64().unwrap() >= 4096);

    let out = skiff()
        .args(["bench", "--target", &addr, "--export", "missing", "--duration", "1s"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no such export"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let status = terminate(child);
    assert!(status.success(), "clean exit on SIGTERM, got {status:?}");
}

#[test]
fn bad_arguments_get_clear_errors() {
    let out = skiff().args(["serve", "--export", "vol=ram:12Q"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("vol"), "{}", String::from_utf8_lossy(&out.stderr));

    let out = skiff().args(["serve", "--export", "vol=file:/nonexistent/skiff-disk"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/skiff-disk"));

    let out = skiff().args(["bench", "--bs", "1000", "--duration", "1s"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--bs"));

    // Polling and pacing: a bad value names itself and nothing runs.
    for (args, says) in [
        (&["bench", "--poll", "adaptive:0", "--duration", "1s"][..], "adaptive:0"),
        (&["bench", "--poll", "spin", "--duration", "1s"][..], "spin"),
        (&["bench", "--rate", "0", "--duration", "1s"][..], "--rate"),
        (&["serve", "--poll", "hybrid:x", "--export", "vol=ram:1M"][..], "hybrid:x"),
        (&["serve", "--stages", "two-threads", "--export", "vol=ram:1M"][..], "two-threads"),
        (&["relay", "--left", "lo", "--right", "lo", "--drop", "1.5"][..], "drop rate 1.5"),
        // Raw Ethernet: a MAC that is not one, and an interface that is not there (as root, the
        // interface is named; without CAP_NET_RAW the socket itself is refused, and says so).
        (&["bench", "--target", "eth:eth0/zz", "--duration", "1s"][..], "\"zz\" is not a MAC address"),
        (&["bench", "--target", "eth:", "--duration", "1s"][..], "eth: needs an interface name"),
        // Raw-Ethernet settings: an option the endpoint cannot take, and options with no
        // interface to apply them to.
        (&["bench", "--target", "eth:eth0,driver=dpdk", "--duration", "1s"][..], "driver=dpdk"),
        (
            &["serve", "--eth-options", "frame=4000", "--export", "vol=ram:1M"][..],
            "eth-options without an interface",
        ),
    ] {
        let out = skiff().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }

    let out = skiff().args(["info", "127.0.0.1:1"]).output().unwrap();
    assert!(!out.status.success());
}

#[test]
fn keys_on_the_command_line_authenticate_and_limit_every_client() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.psk");
    std::fs::write(
        &keys,
        "# skiff keys\nalice:00112233445566778899aabbccddeeff\nbob:ffeeddccbbaa99887766554433221100\n",
    )
    .unwrap();
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    let keys = keys.to_str().unwrap();
    let (child, addr) = serve_args(&[
        "--key-file",
        keys,
        "--export",
        "vol=ram:16M,allow=alice:rw+bob:ro",
        "--export",
        "pub=ram:1M",
    ]);
    let bench = |extra: &[&str]| {
        skiff()
            .args([
                "bench",
                "--target",
                &addr,
                "--export",
                "vol",
                "--duration",
                "1s",
                "--size",
                "4M",
                "--qd",
                "4",
                "--json",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let ok = bench(&["--key-file", keys, "--key", "alice", "--verify"]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert_eq!(json(&ok)["verify_errors"], 0);
    let stderr = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).into_owned();
    let none = bench(&[]);
    assert!(!none.status.success() && stderr(&none).contains("a key is required"), "{}", stderr(&none));
    let reader = bench(&["--key-file", keys, "--key", "bob", "--rw", "randwrite"]);
    assert!(!reader.status.success() || json(&reader)["io_errors"].as_u64() > Some(0), "bob wrote to vol");
    let ambiguous = bench(&["--key-file", keys]);
    assert!(stderr(&ambiguous).contains("pick one with --key"), "{}", stderr(&ambiguous));
    let info = skiff().args(["info", &addr, "--key-file", keys, "--key", "bob"]).output().unwrap();
    let listing = String::from_utf8_lossy(&info.stdout);
    assert!(info.status.success() && listing.contains("vol") && listing.contains("read-only"), "{listing}");
    let anonymous = skiff().args(["info", &addr]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&anonymous.stdout).contains("vol"),
        "a keyed export listed without a key"
    );
    let revoke = |key: &str| {
        skiff().args(["revoke", &addr, "vol", "--key-file", keys, "--key", key]).output().unwrap()
    };
    assert!(!revoke("bob").status.success(), "a read-only key revoked");
    assert!(revoke("alice").status.success(), "{}", stderr(&revoke("alice")));
    assert!(terminate(child).success());
    // An access list naming a key no file gives is refused at start-up.
    let bad = skiff()
        .args(["serve", "--listen", "127.0.0.1:0", "--key-file", keys, "--export", "v=ram:1M,allow=carol:rw"])
        .output()
        .unwrap();
    assert!(!bad.status.success() && stderr(&bad).contains("carol"), "{}", stderr(&bad));
}

#[test]
fn a_missing_ethernet_interface_is_named() {
    for args in [
        &["serve", "--no-tcp", "--eth", "nosuchif0", "--export", "vol=ram:1M"][..],
        &["bench", "--target", "eth:nosuchif0/02:00:00:00:00:01", "--export", "vol", "--duration", "1s"][..],
    ] {
        let out = skiff().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Root reaches the interface lookup; anyone else is stopped at the raw socket.
        assert!(
            stderr.contains("nosuchif0: No such device") || stderr.contains("needs CAP_NET_RAW"),
            "{args:?}: {stderr}"
        );
    }
}

/// `skiff floor` measures every primitive it names, on the two CPUs asked for, and reports
/// each as a positive median within its batches' range; a malformed `--veth`, and a CPU that
/// does not exist, are refused by name.
#[test]
fn floor_measures_every_primitive_and_refuses_a_cpu_that_is_not_there() {
    let out = skiff()
        .args(["floor", "--json", "--batches", "3", "--batch", "2ms"])
        .output()
        .expect("run skiff floor");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report = json(&out);
    let figures = report["figures"].as_array().expect("figures");
    let names: Vec<&str> = figures.iter().map(|f| f["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "memcpy_4k_hot",
            "memcpy_4k_cold",
            "syscall",
            "recv_empty",
            "tcp_4k",
            "tcp_64k",
            "tcp_4k_apart",
            "tcp_64k_apart",
            "cache_line",
            "wakeup"
        ]
    );
    for f in figures {
        let (ns, min, max) =
            (f["ns"].as_f64().unwrap(), f["ns_min"].as_f64().unwrap(), f["ns_max"].as_f64().unwrap());
        assert!(ns > 0.0 && ns.is_finite() && min <= ns && ns <= max, "{f}");
    }
    assert_eq!((report["cpu"].as_u64(), report["peer_cpu"].as_u64()), (Some(0), Some(1)));

    let out = skiff().args(["floor", "--veth", "vethonly"]).output().expect("run skiff floor");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("expected HOST,NS/PEER"), "{stderr}");
    for flag in ["--cpu", "--peer-cpu"] {
        let out = skiff().args(["floor", flag, "4096"]).output().expect("run skiff floor");
        assert!(!out.status.success(), "{flag}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("CPU 4096"), "{flag}: {stderr}");
    }
}
