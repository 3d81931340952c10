//! No allocation per request on the data path after warm-up, on either side: a lane submitting
//! and completing reads and writes through a real socket, and the target worker's passes that
//! receive, execute and answer them. The counting allocator sees every thread, so this test
//! has a binary of its own (nothing else runs beside it) and counts only while the steady
//! state runs.

use initiator::{Completion, Lane, LaneConfig, Limits, Queue, ReqFlags};
use skiff_tests::{start_target_with, tcp_endpoint};

#[global_allocator]
static ALLOC: rt::alloc::Counting = rt::alloc::Counting::new();

const QD: usize = 32;
const BS: usize = 4096;
const VOLUME_BLOCKS: u64 = 16 * 1024;

/// Keep `QD` requests in flight for `ios` completions, reusing every buffer.
fn run(lane: &mut Lane, out: &mut Vec<Completion>, ios: u64, next: &mut u64) {
    let mut done = 0;
    while done < ios {
        lane.wait(1, out).expect("completions");
        for c in out.drain(..) {
            assert!(c.status.is_ok(), "{:?}", c.status);
            done += 1;
            resubmit(lane, c.buf.expect("a buffer"), next);
        }
    }
}

/// Reads and writes alternate over the volume.
fn resubmit(lane: &mut Lane, buf: Vec<u8>, next: &mut u64) {
    let offset = (*next * 7919 % VOLUME_BLOCKS) * BS as u64;
    *next += 1;
    let submitted = if next.is_multiple_of(2) {
        lane.submit_read(offset, buf, *next)
    } else {
        lane.submit_write(offset, buf, ReqFlags::empty(), *next)
    };
    submitted.map_err(|r| r.error).expect("submit");
}

#[test]
fn steady_state_io_allocates_nothing_on_either_side() {
    // Metrics on, so the service-time clock runs on the worker's data path as well.
    let t = start_target_with(&["vol=ram:64M"], |c| {
        c.workers = 1;
        c.metrics_listen = Some("127.0.0.1:0".into());
    });
    let config = LaneConfig {
        limits: Limits {
            queue_depth: QD as u32,
            caravan_reqs_max: 16,
            caravan_bytes_max: 0,
            io_bytes_max: 0,
        },
        ..LaneConfig::default()
    };
    let mut lane = Lane::connect(&tcp_endpoint(&t), "vol", &config).expect("lane");
    let mut out = Vec::with_capacity(2 * QD);
    let mut next = 0;
    for _ in 0..QD {
        resubmit(&mut lane, vec![0x5a; BS], &mut next);
    }
    // Warm up for at least 20,000 I/Os and 1.5 s, so that every buffer has met its largest
    // caravan and the worker's once-a-second sweep has run before counting starts (a slow
    // machine once saw two small first-time growths inside the counted phase).
    let warm_until = std::time::Instant::now() + std::time::Duration::from_millis(1500);
    run(&mut lane, &mut out, 20_000, &mut next);
    while std::time::Instant::now() < warm_until {
        run(&mut lane, &mut out, 2_000, &mut next);
    }

    ALLOC.count(true);
    run(&mut lane, &mut out, 50_000, &mut next);
    ALLOC.count(false);

    let (allocations, bytes) = (ALLOC.allocations(), ALLOC.bytes());
    assert_eq!(
        allocations,
        0,
        "{allocations} allocations ({bytes} bytes) in 50,000 steady-state I/Os; (size up to, count): {:?}",
        ALLOC.sizes()
    );
    assert!(lane.stats().completed >= 70_000);
}
