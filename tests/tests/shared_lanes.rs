//! Shared lanes through real sockets: many threads, few lanes, every batching mode, checked
//! byte for byte.

use std::sync::Arc;

use initiator::{
    BatchConfig, Batching, Completion, Doorbell, Error, LaneConfig, Limits, PollMode, Queue, SharedLanes,
    Status, USER_DATA_MAX,
};
use skiff_tests::{start_target, tcp_endpoint};

fn block(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed as usize * 131 + offset as usize / 4096 * 7 + i) as u8).collect()
}

fn config(queue_depth: u32, batching: Batching, doorbell: Doorbell) -> LaneConfig {
    LaneConfig {
        limits: Limits { queue_depth, ..LaneConfig::default().limits },
        batching,
        doorbell,
        ..LaneConfig::default()
    }
}

/// `threads` threads, each with `qd` requests outstanding on its handle, write their own slice
/// and read it back through `lanes` shared lanes; returns the lanes for their counters.
fn threads_verify(threads: usize, qd: usize, lanes: usize, config: LaneConfig) -> Arc<SharedLanes> {
    let t = start_target(&["vol=ram:64M"], 2);
    let shared = Arc::new(SharedLanes::connect(&tcp_endpoint(&t), "vol", &config, lanes).expect("lanes"));
    let slice = 512 << 10;
    let joins: Vec<_> = (0..threads)
        .map(|t| {
            let mut h = shared.handle().expect("handle");
            std::thread::spawn(move || {
                let base = t as u64 * slice;
                let offsets: Vec<u64> = (0..slice / 4096).map(|i| base + i * 4096).collect();
                let mut out: Vec<Completion> = Vec::new();
                for (n, &off) in offsets.iter().enumerate() {
                    while h.in_flight() >= qd {
                        h.wait(1, &mut out).unwrap();
                    }
                    h.submit_write(off, block(t as u64, off, 4096), Default::default(), n as u64).unwrap();
                }
                h.wait(usize::MAX, &mut out).unwrap();
                assert_eq!(out.len(), offsets.len());
                assert!(out.iter().all(|c| c.status == Status::Ok));
                out.clear();
                for (n, &off) in offsets.iter().enumerate() {
                    while h.in_flight() >= qd {
                        h.wait(1, &mut out).unwrap();
                    }
                    h.submit_read(off, vec![0; 4096], n as u64).unwrap();
                }
                h.wait(usize::MAX, &mut out).unwrap();
                assert_eq!(out.len(), offsets.len(), "every request completes exactly once");
                for c in out {
                    assert_eq!(c.status, Status::Ok);
                    let off = offsets[c.user_data as usize];
                    assert!(c.buf.unwrap() == block(t as u64, off, 4096), "thread {t} offset {off}");
                }
            })
        })
        .collect();
    for j in joins {
        j.join().expect("thread");
    }
    let s = t.stats();
    let ios = (threads as u64) * (slice / 4096);
    assert_eq!((s.get("req_write"), s.get("req_read")), (Some(ios), Some(ios)));
    shared
}

#[test]
fn every_batching_mode_moves_the_right_bytes() {
    let quick = BatchConfig { interval_us: 5_000, ..BatchConfig::default() };
    for batching in [Batching::Off, Batching::Static, Batching::Adaptive(quick)] {
        let shared = threads_verify(8, 4, 2, config(64, batching, Doorbell::default()));
        let stats = shared.stats();
        assert_eq!(stats.submitted, 2 * 8 * 128, "{batching:?}");
        if batching == Batching::Off {
            assert_eq!(stats.caravans_sent, stats.submitted, "off: one request per caravan");
        }
    }
}

/// Hybrid polling on shared lanes: whichever caller receives for everyone spins, then sleeps,
/// and hands the others their completions; every request still completes exactly once with
/// the right bytes, whatever the plan, and the receivers did wait by it.
#[test]
fn receivers_that_poll_move_the_right_bytes() {
    let plans = [
        PollMode::Fixed(std::time::Duration::from_millis(2)),
        PollMode::Adaptive(std::time::Duration::from_micros(200)),
    ];
    for poll in plans {
        let cfg = LaneConfig { poll, ..config(64, Batching::Static, Doorbell::default()) };
        let shared = threads_verify(8, 2, 2, cfg);
        let waits = shared.poll_stats().waits;
        assert!(waits > 0, "{poll:?}: no receiver waited");
    }
}

#[test]
fn threads_requests_meet_in_common_caravans() {
    // 16 threads with 4 requests each on one lane, a doorbell that waits for 32 requests (or
    // 200 µs): caravans must carry requests of several threads.
    let bell = Doorbell { aggregation_reqs: 32, delay_us: 200, ..Doorbell::default() };
    let shared = threads_verify(16, 4, 1, config(64, Batching::Static, bell));
    let stats = shared.stats();
    let per_caravan = stats.submitted as f64 / stats.caravans_sent as f64;
    assert!(per_caravan > 4.0, "{per_caravan:.1} requests per caravan: no thread has more than 4");
}

#[test]
fn a_full_queue_makes_submitters_wait_not_fail() {
    // 8 threads × 4 outstanding share a lane that holds 8: submitters wait for room.
    threads_verify(8, 4, 1, config(8, Batching::Static, Doorbell::default()));
}

#[test]
fn a_lone_thread_is_not_held_by_the_delay_bound() {
    // One thread, 4 outstanding, a doorbell waiting for 64 requests or 10 s, and a 2 s timeout:
    // the lane must send as soon as every handle waits with nothing on the wire, or the first
    // wait times out.
    let bell = Doorbell { aggregation_reqs: 64, delay_us: 10_000_000, ..Doorbell::default() };
    let cfg = LaneConfig { timeout: std::time::Duration::from_secs(2), ..config(64, Batching::Static, bell) };
    threads_verify(1, 4, 1, cfg);
}

#[test]
fn blocking_api_from_many_threads() {
    let t = start_target(&["vol=ram:16M"], 2);
    let shared = Arc::new(
        SharedLanes::connect(&tcp_endpoint(&t), "vol", &config(16, Batching::Static, Doorbell::default()), 0)
            .expect("lanes"),
    );
    let joins: Vec<_> = (0..12u64)
        .map(|t| {
            let mut h = shared.handle().unwrap();
            std::thread::spawn(move || {
                for i in 0..64u64 {
                    let off = (t * 64 + i) * 4096;
                    h.write_at(&block(t, off, 4096), off).unwrap();
                }
                h.flush().unwrap();
                let mut buf = vec![0; 4096];
                for i in 0..64u64 {
                    let off = (t * 64 + i) * 4096;
                    h.read_at(&mut buf, off).unwrap();
                    assert!(buf == block(t, off, 4096), "thread {t} offset {off}");
                }
            })
        })
        .collect();
    for j in joins {
        j.join().unwrap();
    }
    assert_eq!(t.stats().get("req_flush"), Some(12));
}

#[test]
fn errors_reach_their_owner_and_bad_arguments_are_refused() {
    let t = start_target(&["vol=ram:1M"], 1);
    let shared: SharedLanes =
        SharedLanes::connect(&tcp_endpoint(&t), "vol", &LaneConfig::default(), 1).expect("lanes");
    let mut a = shared.handle().unwrap();
    let mut b = shared.handle().unwrap();
    let mut buf = vec![0; 4096];
    assert!(matches!(a.read_at(&mut buf, 1 << 20), Err(Error::Status(Status::OutOfRange))));
    b.read_at(&mut buf, 0).unwrap();
    let rejected = a.submit_read(0, vec![0; 512], USER_DATA_MAX + 1).unwrap_err();
    assert!(matches!(rejected.error, Error::InvalidArgument(_)));
    assert_eq!(rejected.buf.map(|b| b.len()), Some(512), "the buffer comes back");
    // A handle dropped with a request in flight: its completion is discarded, the lane goes on.
    a.submit_read(0, vec![0; 4096], 7).unwrap();
    drop(a);
    b.write_at(&[9; 4096], 4096).unwrap();
    b.read_at(&mut buf, 4096).unwrap();
    assert_eq!(buf, vec![9; 4096]);
    let missing = SharedLanes::<Vec<u8>>::connect(&tcp_endpoint(&t), "nope", &LaneConfig::default(), 1);
    assert!(matches!(missing.err(), Some(Error::Refused(_))));
}
