//! Data through real sockets: many threads, many lanes, TCP and Unix, checked byte for byte.

use std::sync::Arc;

use initiator::{
    BatchConfig, Batching, Endpoint, Lane, LaneConfig, Limits, PollMode, Queue, ReqFlags, SharedLanes, Status,
};
use skiff_tests::verify::{self, block};
use skiff_tests::{start_target, start_target_with, tcp_endpoint};

/// Each thread owns a slice of the volume, writes it through its own lane with many requests in
/// flight, then reads it back through the async API and checks every byte.
fn threads_verify(endpoint: Endpoint, threads: usize, qd: u32, bs: usize) {
    threads_verify_with(endpoint, threads, qd, bs, Batching::Static);
}

fn threads_verify_with(endpoint: Endpoint, threads: usize, qd: u32, bs: usize, batching: Batching) {
    let slice = 4 << 20;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let ep = endpoint.clone();
            std::thread::spawn(move || {
                let config = LaneConfig {
                    limits: Limits { queue_depth: qd, ..LaneConfig::default().limits },
                    batching,
                    ..LaneConfig::default()
                };
                let mut lane = Lane::connect(&ep, "vol", &config).expect("lane");
                verify::write_read(&mut lane, t as u64, t as u64 * slice, slice, bs, qd as usize);
                lane.stats().caravans_sent
            })
        })
        .collect();
    for h in handles {
        let caravans = h.join().expect("thread");
        assert!(caravans > 0);
    }
}

#[test]
fn many_threads_many_lanes_over_tcp() {
    let t = start_target(&["vol=ram:64M"], 2);
    threads_verify(tcp_endpoint(&t), 4, 32, 4096);
    let s = t.stats();
    assert_eq!(s.get("req_write"), Some(4 * 1024));
    assert_eq!(s.get("req_read"), Some(4 * 1024));
    assert_eq!(s.get("bytes_read"), Some((4 * 4) << 20));
    assert!(s.get("caravans_received").unwrap() < 8 * 1024, "requests travel in caravans");
}

#[test]
fn unix_socket_and_large_ios() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("skiff.sock");
    let t = start_target_with(&["vol=ram:32M"], |c| c.listen.push(Endpoint::Unix(sock.clone())));
    threads_verify(Endpoint::Unix(sock.clone()), 2, 8, 128 << 10);
    drop(t);
    assert!(!sock.exists(), "the socket file is removed at shutdown");
}

#[test]
fn queue_depth_one_and_blocking_api() {
    let t = start_target(&["vol=ram:8M"], 1);
    let ep = tcp_endpoint(&t);
    let config = LaneConfig {
        limits: Limits { queue_depth: 1, ..LaneConfig::default().limits },
        ..LaneConfig::default()
    };
    let mut lane = Lane::connect(&ep, "vol", &config).unwrap();
    assert_eq!(lane.queue_depth(), 1);
    let data = block(9, 4096, 8192);
    lane.write_at(&data, 4096).unwrap();
    lane.flush().unwrap();
    let mut back = vec![0; 8192];
    lane.read_at(&mut back, 4096).unwrap();
    assert_eq!(back, data);
    // A second submit while one is in flight is refused, not queued without bound.
    lane.submit_read(0, vec![0; 512], 1).unwrap();
    let rejected = lane.submit_read(0, vec![0; 512], 2).unwrap_err();
    assert!(matches!(rejected.error, initiator::Error::QueueFull(1)));
    assert_eq!(rejected.buf.map(|b| b.len()), Some(512), "the buffer comes back");
}

#[test]
fn trim_write_zeroes_and_fua_round_trip() {
    let t = start_target(&["vol=ram:8M"], 1);
    let mut lane = Lane::connect(&tcp_endpoint(&t), "vol", &LaneConfig::default()).unwrap();
    lane.write_at(&[0xEE; 16384], 0).unwrap();
    let mut out = Vec::new();
    lane.submit_trim(0, 4096, 1).unwrap();
    lane.submit_write_zeroes(8192, 4096, ReqFlags::FUA, 2).unwrap();
    lane.submit_write(12288, vec![0x11; 4096], ReqFlags::FUA | ReqFlags::NO_DELAY, 3).unwrap();
    lane.wait(3, &mut out).unwrap();
    assert!(out.iter().all(|c| c.status == Status::Ok), "{out:?}");
    let mut back = vec![0xFF; 16384];
    lane.read_at(&mut back, 0).unwrap();
    assert!(back[..4096].iter().all(|&b| b == 0), "trimmed RAM reads zeroes");
    assert!(back[4096..8192].iter().all(|&b| b == 0xEE));
    assert!(back[8192..12288].iter().all(|&b| b == 0));
    assert!(back[12288..].iter().all(|&b| b == 0x11));
}

#[test]
fn lanes_of_one_target_share_data() {
    let t = Arc::new(start_target(&["vol=ram:8M"], 2));
    let ep = tcp_endpoint(&t);
    let mut a = Lane::connect(&ep, "vol", &LaneConfig::default()).unwrap();
    let mut b = Lane::connect(&ep, "vol", &LaneConfig::default()).unwrap();
    a.write_at(&[7; 4096], 1 << 20).unwrap();
    let mut back = vec![0; 4096];
    b.read_at(&mut back, 1 << 20).unwrap();
    assert_eq!(back, vec![7; 4096]);
}

#[test]
fn every_batching_mode_keeps_data_intact() {
    let t = start_target(&["vol=ram:32M"], 2);
    // A 1 ms interval lets the adaptive controller change its level many times in this test.
    let adaptive = Batching::Adaptive(BatchConfig { interval_us: 1_000, ..BatchConfig::default() });
    for batching in [Batching::Off, Batching::Static, adaptive] {
        let before = t.stats().get("caravans_received").unwrap();
        threads_verify_with(tcp_endpoint(&t), 2, 16, 4096, batching);
        let caravans = t.stats().get("caravans_received").unwrap() - before;
        if batching == Batching::Off {
            assert_eq!(caravans, 2 * 2 * 1024, "batching off sends every request on its own");
        } else {
            assert!(caravans < 2 * 2 * 1024, "{batching:?} gathers requests into caravans");
        }
    }
}

#[test]
fn hybrid_polling_on_both_sides_keeps_data_intact() {
    let bound = std::time::Duration::from_micros(50);
    for mode in [PollMode::Fixed(bound), PollMode::Adaptive(bound)] {
        let t = start_target_with(&["vol=ram:16M"], |c| {
            c.workers = 1;
            c.poll = mode;
        });
        let config = LaneConfig { poll: mode, ..LaneConfig::default() };
        let mut lane = Lane::connect(&tcp_endpoint(&t), "vol", &config).unwrap();
        for i in 0..256u64 {
            let data = block(i, i * 4096, 4096);
            lane.write_at(&data, i * 4096).unwrap();
            let mut back = vec![0; 4096];
            lane.read_at(&mut back, i * 4096).unwrap();
            assert_eq!(back, data, "{mode:?} block {i}");
        }
        // Every wait went through the policy, and each ended one way or another.
        let s = lane.poll_stats();
        assert!(s.waits > 0, "{mode:?}: {s:?}");
        assert!(s.caught + s.missed + s.held_off + s.timed_sleeps <= s.waits + s.timed_sleeps, "{s:?}");
    }
}

#[test]
fn adaptive_polling_on_shared_lanes_keeps_data_intact() {
    let mode = PollMode::Adaptive(std::time::Duration::from_micros(50));
    let t = start_target_with(&["vol=ram:16M"], |c| {
        c.workers = 1;
        c.poll = mode;
    });
    let config = LaneConfig { poll: mode, ..LaneConfig::default() };
    let lanes = SharedLanes::<Vec<u8>>::connect(&tcp_endpoint(&t), "vol", &config, 1).unwrap();
    std::thread::scope(|scope| {
        for thread in 0..4u64 {
            let mut h = lanes.handle().unwrap();
            scope.spawn(move || {
                for i in 0..128u64 {
                    let at = (thread * 128 + i) * 4096;
                    let data = block(thread, at, 4096);
                    h.write_at(&data, at).unwrap();
                    let mut back = vec![0; 4096];
                    h.read_at(&mut back, at).unwrap();
                    assert_eq!(back, data, "thread {thread} block {i}");
                }
            });
        }
    });
    assert!(lanes.poll_stats().waits > 0);
}
