//! Reconnection in the initiator library (issue 13): private and shared lanes, and the lanes
//! of skiff attach's I/O threads, ride through a target restart with every request answered
//! and every byte right; `fast_io_fail_timeout` fails what waits while attempts go on;
//! `ctrl_loss_timeout` gives up with a clear error.

use std::sync::Arc;
use std::time::Duration;

use attach::{Volume, VolumeConfig};
use initiator::{Error, Lane, LaneConfig, Queue, ReconnectConfig, ReqFlags, SharedLanes, Status};
use server::{ExportConfig, Target, TargetConfig};
use skiff_tests::inbox::{Answered, Inbox, ToInbox};
use transport::Endpoint;

const BLOCK: usize = 4096;

fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    format!("127.0.0.1:{port}")
}

fn start(addr: &str, file: &str) -> Target {
    Target::start(TargetConfig {
        listen: vec![Endpoint::Tcp(addr.to_owned())],
        exports: vec![format!("disk=file:{file}").parse::<ExportConfig>().unwrap()],
        workers: 1,
        ..TargetConfig::default()
    })
    .expect("target starts")
}

/// Lanes that retry every 50 ms at most, give up after `loss_ms` and fail waiting requests
/// after `fast_fail_ms`.
/// A reconnect keeps the lane's polling policy, what it learned and its counters: the waits
/// before the restart still count after it.
#[test]
fn a_lane_keeps_its_polling_through_a_reconnect() {
    let (_file, addr, path, target) = target_on_file(64);
    let config =
        LaneConfig { poll: initiator::PollMode::Adaptive(Duration::from_micros(50)), ..fast_reconnect() };
    let mut lane = Lane::connect(&Endpoint::parse(&addr).unwrap(), "disk", &config).unwrap();
    let mut back = vec![0u8; BLOCK];
    for i in 0..1000u64 {
        lane.read_at(&mut back, (i % 64) * BLOCK as u64).unwrap();
    }
    // Waits that found their completion there at once are not counted, but most of a
    // thousand reads must wait for theirs.
    let before = lane.poll_stats().waits;
    assert!(before >= 20, "{before} waits for 1000 reads");
    target.shutdown();
    let _target = start(&addr, &path);
    lane.read_at(&mut back, 0).expect("a read after the restart");
    // A waiter started afresh would count only the new connection's few waits.
    let after = lane.poll_stats().waits;
    assert!(after >= before, "the waits before the reconnect were forgotten: {before} then {after}");
}

fn reconnecting(loss_ms: u64, fast_fail_ms: Option<u64>) -> LaneConfig {
    LaneConfig {
        reconnect: ReconnectConfig {
            reconnect_delay_us: 50_000,
            ctrl_loss_timeout_us: loss_ms * 1000,
            fast_io_fail_timeout_us: fast_fail_ms.map(|ms| ms * 1000),
        },
        ..LaneConfig::default()
    }
}

fn fast_reconnect() -> LaneConfig {
    reconnecting(30_000, None)
}

/// A target on a fixed address over a fresh file of `blocks` blocks: (file, address, path,
/// target). The address stays the same across restarts.
fn target_on_file(blocks: usize) -> (tempfile::NamedTempFile, String, String, Target) {
    let file = scratch(blocks);
    let path = file.path().to_str().unwrap().to_owned();
    let addr = free_addr();
    let target = start(&addr, &path);
    (file, addr, path, target)
}

fn scratch(blocks: usize) -> tempfile::NamedTempFile {
    let f = tempfile::Builder::new().prefix("skiff-reconnect-").tempfile_in("/var/tmp").unwrap();
    f.as_file().set_len((blocks * BLOCK) as u64).unwrap();
    f
}

fn pattern(thread: usize, round: usize, block: usize) -> Vec<u8> {
    vec![(thread * 31 + round * 7 + block) as u8 | 1; BLOCK]
}

/// Eight threads on two shared lanes write and read back their own blocks in rounds while
/// the target is stopped and started again, twice. No call fails and every byte reads back.
#[test]
fn shared_lanes_ride_through_target_restarts() {
    const THREADS: usize = 8;
    const BLOCKS_EACH: usize = 16;
    let file = scratch(THREADS * BLOCKS_EACH);
    let path = file.path().to_str().unwrap().to_owned();
    let addr = free_addr();
    let mut target = Some(start(&addr, &path));
    let endpoint = Endpoint::parse(&addr).unwrap();
    let lanes = Arc::new(SharedLanes::<Vec<u8>>::connect(&endpoint, "disk", &fast_reconnect(), 2).unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let mut h = lanes.handle().unwrap();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut rounds = 0;
                let mut back = vec![0u8; BLOCK];
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || rounds < 3 {
                    for b in 0..BLOCKS_EACH {
                        let offset = ((t * BLOCKS_EACH + b) * BLOCK) as u64;
                        h.write_at(&pattern(t, rounds, b), offset).expect("write through a restart");
                        h.read_at(&mut back, offset).expect("read through a restart");
                        assert!(back == pattern(t, rounds, b), "thread {t} round {rounds} block {b}");
                    }
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    for _ in 0..2 {
        std::thread::sleep(Duration::from_millis(300));
        target.take().unwrap().shutdown();
        std::thread::sleep(Duration::from_millis(300));
        target = Some(start(&addr, &path));
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        assert!(w.join().expect("a worker failed") >= 3);
    }
    let stats = lanes.stats();
    assert!(stats.reconnects >= 2, "the lanes never lost their connection: {stats:?}");
}

/// Four threads hand writes and reads, eight in flight each, to the I/O threads of an attach
/// volume on two lanes while the target is stopped and started again, twice: every request is
/// answered, none with an error, and every byte reads back.
#[test]
fn attach_io_threads_ride_through_target_restarts() {
    const THREADS: usize = 4;
    const DEPTH: usize = 8;
    let file = scratch(THREADS * DEPTH);
    let path = file.path().to_str().unwrap().to_owned();
    let addr = free_addr();
    let mut target = Some(start(&addr, &path));
    let config = VolumeConfig { lanes: 2, ..VolumeConfig::new(fast_reconnect(), 1 << 20) };
    let vol =
        Arc::new(Volume::<ToInbox>::connect(&Endpoint::parse(&addr).unwrap(), "disk", &config).unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (vol, stop) = (vol.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut w = vol.worker();
                let inboxes: Vec<_> = (0..DEPTH).map(|_| Inbox::new(BLOCK)).collect();
                let mut back = Vec::with_capacity(BLOCK);
                let offset = |b: usize| ((t * DEPTH + b) * BLOCK) as u64;
                let mut rounds = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || rounds < 3 {
                    for (b, inbox) in inboxes.iter().enumerate() {
                        w.handle_write(&vol, offset(b), &pattern(t, rounds, b), false, inbox.reply());
                    }
                    for inbox in &inboxes {
                        assert_eq!(
                            inbox.wait(&mut back),
                            Answered::Written(BLOCK),
                            "write through a restart"
                        );
                    }
                    for (b, inbox) in inboxes.iter().enumerate() {
                        w.handle_read(&vol, offset(b), BLOCK, inbox.reply());
                    }
                    for (b, inbox) in inboxes.iter().enumerate() {
                        assert_eq!(inbox.wait(&mut back), Answered::Data, "read through a restart");
                        assert!(back == pattern(t, rounds, b), "thread {t} round {rounds} block {b}");
                    }
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    for _ in 0..2 {
        std::thread::sleep(Duration::from_millis(300));
        target.take().unwrap().shutdown();
        std::thread::sleep(Duration::from_millis(300));
        target = Some(start(&addr, &path));
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        assert!(w.join().expect("a worker failed") >= 3);
    }
    // The counters are published by the I/O threads as they go; stopping publishes the last.
    vol.stop();
    let stats = vol.stats();
    assert!(stats.reconnects >= 2, "the lanes never lost their connection: {stats:?}");
}

/// A private lane with requests on the wire when the target stops: they are sent again on
/// the new connection and complete OK.
#[test]
fn a_private_lane_resends_what_was_in_flight() {
    let (_file, addr, path, target) = target_on_file(64);
    let mut lane = Lane::connect(&Endpoint::parse(&addr).unwrap(), "disk", &fast_reconnect()).unwrap();
    for i in 0..32u64 {
        lane.submit_write(i * BLOCK as u64, vec![i as u8; BLOCK], ReqFlags::empty(), i).unwrap();
    }
    target.shutdown();
    let restarter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        start(&addr, &path)
    });
    let mut done = Vec::new();
    while done.len() < 32 {
        lane.wait(1, &mut done).expect("completions after the restart");
    }
    assert!(done.iter().all(|c| c.status == Status::Ok), "{done:?}");
    let _target = restarter.join().unwrap();
    let mut back = vec![0u8; BLOCK];
    for i in 0..32u64 {
        lane.read_at(&mut back, i * BLOCK as u64).unwrap();
        assert!(back.iter().all(|&b| b == i as u8), "block {i}");
    }
}

#[test]
fn fast_io_fail_fails_what_waits_and_the_lane_recovers_when_the_target_is_back() {
    let (_file, addr, path, target) = target_on_file(16);
    let mut lane =
        Lane::connect(&Endpoint::parse(&addr).unwrap(), "disk", &reconnecting(30_000, Some(200))).unwrap();
    target.shutdown();
    lane.submit_read(0, vec![0; BLOCK], 7).unwrap();
    let mut done = Vec::new();
    lane.wait(1, &mut done).unwrap();
    assert_eq!((done[0].user_data, done[0].status), (7, Status::IoError));
    // Refused while the target stays away.
    assert!(matches!(lane.submit_read(0, vec![0; BLOCK], 8), Err(r) if matches!(r.error, Error::Closed)));
    let _target = start(&addr, &path);
    // Back: a blocking read waits for the reconnection and succeeds.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut buf = vec![0u8; BLOCK];
    while lane.read_at(&mut buf, 0).is_err() {
        assert!(std::time::Instant::now() < deadline, "the lane never came back");
        std::thread::sleep(Duration::from_millis(20));
        let mut drained = Vec::new();
        let _ = lane.poll(&mut drained);
    }
}

#[test]
fn ctrl_loss_timeout_gives_up_with_a_clear_error() {
    let (_file, addr, _path, target) = target_on_file(16);
    let mut lane = Lane::connect(&Endpoint::parse(&addr).unwrap(), "disk", &reconnecting(300, None)).unwrap();
    target.shutdown();
    let mut buf = vec![0u8; BLOCK];
    let err = lane.read_at(&mut buf, 0).unwrap_err();
    assert!(matches!(err, Error::Lost(_)), "{err}");
    assert!(err.to_string().contains("ctrl_loss_timeout"), "{err}");
    assert!(lane.is_broken());
}
