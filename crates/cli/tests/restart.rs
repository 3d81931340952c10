//! A target that dies under load (issue 13, "Reconnection and failure handling"): `skiff
//! bench --verify` rides through `kill -9` and restarts with no error surfaced; it exits with a
//! clear error, never hangs, when the target is gone for good; and after a crash every
//! acknowledged FUA write, and every write before an acknowledged flush, is on the file.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use initiator::{Endpoint, Lane, LaneConfig, Queue, ReconnectConfig, ReqFlags, Status};

/// Processes this test started; killed when it ends, however it ends.
#[derive(Default)]
struct Reaper(Vec<Child>);

impl Reaper {
    fn add(&mut self, c: Child) -> usize {
        self.0.push(c);
        self.0.len() - 1
    }

    fn kill9(&mut self, i: usize) {
        let _ = self.0[i].kill(); // SIGKILL
        let _ = self.0[i].wait();
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A port free now on 127.0.0.1 (the restarted target must come back on the same one).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `skiff serve` on `addr` with one file export; returns once it listens.
fn serve(addr: &str, file: &str) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_skiff"))
        .args(["serve", "--listen", addr, "--workers", "1", "--export", &format!("disk=file:{file}")])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn skiff serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    loop {
        let Some(Ok(line)) = lines.next() else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("skiff serve exited before listening on {addr}");
        };
        if line.contains("listening ep=") {
            std::thread::spawn(move || for _ in lines.by_ref() {});
            return child;
        }
    }
}

fn scratch_file(bytes: u64) -> tempfile::NamedTempFile {
    let f = tempfile::Builder::new().prefix("skiff-restart-").tempfile_in("/var/tmp").unwrap();
    f.as_file().set_len(bytes).unwrap();
    f
}

fn wait_with_deadline(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "skiff bench still running after {limit:?}: it hangs");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn bench_verify_rides_through_kill_9_and_restarts_with_no_error() {
    let file = scratch_file(64 << 20);
    let path = file.path().to_str().unwrap().to_owned();
    let addr = format!("127.0.0.1:{}", free_port());
    let mut procs = Reaper::default();
    let mut target = procs.add(serve(&addr, &path));
    let bench = Command::new(env!("CARGO_BIN_EXE_skiff"))
        .args(["bench", "--target", &addr, "--export", "disk", "--rw", "randrw", "--verify"])
        .args(["--qd", "16", "--threads", "2", "--duration", "6s", "--json", "--reconnect-delay", "200ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn skiff bench");
    let bench = procs.add(bench);
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(1500));
        procs.kill9(target);
        std::thread::sleep(Duration::from_millis(500));
        target = procs.add(serve(&addr, &path));
    }
    let status = wait_with_deadline(&mut procs.0[bench], Duration::from_secs(120));
    let mut out = String::new();
    let mut err = String::new();
    use std::io::Read;
    procs.0[bench].stdout.take().unwrap().read_to_string(&mut out).unwrap();
    procs.0[bench].stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(status.success(), "bench failed: {status}\n{out}\n{err}");
    let j: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    assert_eq!(j["io_errors"], 0, "{out}");
    assert_eq!(j["verify_errors"], 0, "{out}");
    assert!(j["ios"].as_u64().unwrap() > 0);
    // The bench counts reconnects of its timed phase; the log shows every one.
    let losses = err.matches("connection lost; reconnecting").count();
    assert!(losses >= 3, "expected the lanes to notice three kills: {err}");
}

#[test]
fn bench_exits_with_a_clear_error_when_the_target_is_gone_for_good() {
    let file = scratch_file(16 << 20);
    let path = file.path().to_str().unwrap().to_owned();
    let addr = format!("127.0.0.1:{}", free_port());
    let mut procs = Reaper::default();
    let target = procs.add(serve(&addr, &path));
    let bench = Command::new(env!("CARGO_BIN_EXE_skiff"))
        .args(["bench", "--target", &addr, "--export", "disk", "--rw", "randwrite", "--duration", "30s"])
        .args(["--reconnect-delay", "100ms", "--ctrl-loss-timeout", "2s"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn skiff bench");
    let bench = procs.add(bench);
    std::thread::sleep(Duration::from_millis(1000));
    procs.kill9(target);
    let status = wait_with_deadline(&mut procs.0[bench], Duration::from_secs(60));
    let mut err = String::new();
    use std::io::Read;
    procs.0[bench].stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(!status.success(), "bench succeeded against a dead target");
    assert!(err.contains("ctrl_loss_timeout"), "the error does not say why: {err}");
}

/// Kill -9 the target in the middle of a stream of writes, some FUA, with a flush every 16;
/// after a restart every FUA write acknowledged, and every write acknowledged before an
/// acknowledged flush, reads back. (A process kill, not a power cut: what the file system
/// promises for `O_DSYNC` and `fdatasync` beyond that is the kernel's.)
#[test]
fn acknowledged_fua_writes_and_flushed_writes_survive_kill_9() {
    const BLOCK: usize = 4096;
    const BLOCKS: u64 = 4096;
    let file = scratch_file(BLOCKS * BLOCK as u64);
    let path = file.path().to_str().unwrap().to_owned();
    let addr = format!("127.0.0.1:{}", free_port());
    let endpoint = Endpoint::parse(&addr).unwrap();
    let mut procs = Reaper::default();
    let target = procs.add(serve(&addr, &path));
    // No reconnection: the writer must see the crash, not ride through it.
    let config = LaneConfig { reconnect: ReconnectConfig::OFF, ..LaneConfig::default() };
    let mut lane = Lane::connect(&endpoint, "disk", &config).unwrap();
    let pattern = |i: u64| -> Vec<u8> {
        (0..BLOCK).map(|b| (i.wrapping_mul(0x9E37_79B9) >> (b % 24)) as u8 ^ b as u8).collect()
    };

    let writer = std::thread::spawn(move || {
        let mut durable = Vec::new(); // blocks whose contents are promised
        let mut since_flush = Vec::new(); // acknowledged, not yet covered by a flush
        let mut out = Vec::new();
        for i in 0.. {
            let block = (i * 7) % BLOCKS;
            let fua = i % 3 == 0;
            let flags = if fua { ReqFlags::FUA } else { ReqFlags::empty() };
            let acked = lane.submit_write(block * BLOCK as u64, pattern(i), flags, i).is_ok()
                && lane.wait(1, &mut out).is_ok()
                && out.last().is_some_and(|c| c.status == Status::Ok);
            if !acked {
                // The crash: this write may or may not have reached the block.
                durable.retain(|&(b, _)| b != block);
                break;
            }
            out.clear();
            // A later write to the block replaces the promise for it.
            durable.retain(|&(b, _)| b != block);
            since_flush.retain(|&(b, _)| b != block);
            if fua {
                durable.push((block, i));
            } else {
                since_flush.push((block, i));
            }
            if i % 16 == 15 {
                if lane.flush().is_err() {
                    break;
                }
                durable.append(&mut since_flush);
            }
        }
        durable
    });
    std::thread::sleep(Duration::from_millis(1500));
    procs.kill9(target);
    let durable = writer.join().unwrap();
    assert!(durable.len() > 100, "too few writes acknowledged before the kill: {}", durable.len());

    procs.add(serve(&addr, &path));
    let mut lane = Lane::connect(&endpoint, "disk", &LaneConfig::default()).unwrap();
    let mut back = vec![0u8; BLOCK];
    for &(block, i) in &durable {
        lane.read_at(&mut back, block * BLOCK as u64).unwrap();
        assert!(back == pattern(i), "block {block}: acknowledged write {i} lost after kill -9");
    }
}

/// A target that stops answering without closing anything (here: SIGSTOP; on a network, a
/// dead host or a partition) is found dead by the lane's silence bound: the lane reconnects,
/// re-sends what was unanswered, and the caller sees its data once the target answers again.
#[test]
fn a_silent_target_is_found_dead_and_the_lane_recovers_when_it_answers_again() {
    let _ = tracing_subscriber::fmt().with_env_filter("skiff_initiator=debug").with_test_writer().try_init();
    let file = scratch_file(1 << 20);
    let path = file.path().to_str().unwrap().to_owned();
    let addr = format!("127.0.0.1:{}", free_port());
    let mut procs = Reaper::default();
    let target = procs.add(serve(&addr, &path));
    let pid = procs.0[target].id().to_string();
    let config = LaneConfig {
        timeout: Duration::from_millis(500),
        reconnect: ReconnectConfig {
            reconnect_delay_us: 100_000,
            ctrl_loss_timeout_us: 60_000_000,
            fast_io_fail_timeout_us: None,
        },
        ..LaneConfig::default()
    };
    let mut lane = Lane::connect(&Endpoint::parse(&addr).unwrap(), "disk", &config).unwrap();
    lane.write_at(&[0x5A; 4096], 0).unwrap();
    let signal = move |sig: &str| assert!(Command::new("kill").args([sig, &pid]).status().unwrap().success());
    signal("-STOP");
    let resume = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(2000));
        signal("-CONT");
    });
    let mut back = vec![0u8; 4096];
    lane.read_at(&mut back, 0).expect("the read is answered once the target is back");
    resume.join().unwrap();
    assert!(back.iter().all(|&b| b == 0x5A));
    let stats = lane.stats();
    assert!(stats.reconnects >= 1, "silence was not taken for a dead connection: {stats:?}");
}
