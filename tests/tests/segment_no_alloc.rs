//! No allocation per request on RStore's data path after warm-up (issue 32): a segment of two
//! replicas over two memory servers, read and written through its `Queue` (pieces that take
//! the caller's buffer whole, pieces of requests straddling chunks, writes to both copies)
//! and through the blocking `read` and `write`. As `no_alloc.rs`, a binary of its own: the
//! counting allocator sees every thread, the targets' workers included.

use initiator::{Completion, LaneConfig, Queue, ReqFlags};
use rstore::{Location, Segment, SegmentMap};
use skiff_tests::{start_target, tcp_endpoint};

#[global_allocator]
static ALLOC: rt::alloc::Counting = rt::alloc::Counting::new();

const QD: usize = 32;
const BS: usize = 4096;
const CHUNK: u64 = 1 << 20;
const STRIPES: u64 = 4;

/// Request `n`'s offset: mostly 4 KiB blocks, every third straddling two chunks.
fn offset(n: u64) -> u64 {
    let stripe = n % STRIPES;
    if n.is_multiple_of(3) && stripe + 1 < STRIPES {
        (stripe + 1) * CHUNK - (BS as u64) / 2
    } else {
        stripe * CHUNK + (n * 7919 % (CHUNK / BS as u64 - 1)) * BS as u64
    }
}

fn resubmit(seg: &mut Segment, buf: Vec<u8>, next: &mut u64) {
    *next += 1;
    let opcode = if next.is_multiple_of(2) { wire::Opcode::Read } else { wire::Opcode::Write };
    seg.submit(opcode, ReqFlags::empty(), offset(*next), BS, Some(buf), *next)
        .map_err(|r| r.error)
        .expect("submit");
}

fn run(seg: &mut Segment, out: &mut Vec<Completion>, ios: u64, next: &mut u64) {
    let mut done = 0;
    while done < ios {
        seg.wait(1, out).expect("completions");
        for c in out.drain(..) {
            assert!(c.status.is_ok(), "{:?}", c.status);
            done += 1;
            resubmit(seg, c.buf.expect("a buffer"), next);
        }
    }
}

fn blocking(seg: &mut Segment, buf: &mut [u8], ios: u64, next: &mut u64) {
    for _ in 0..ios {
        *next += 1;
        if next.is_multiple_of(2) {
            seg.read(offset(*next), buf).expect("read");
        } else {
            seg.write(offset(*next), buf).expect("write");
        }
    }
}

#[test]
fn steady_state_segment_io_allocates_nothing() {
    let targets: Vec<server::Target> = (0..2).map(|_| start_target(&["pool=ram:8M,block=1"], 1)).collect();
    let stripes = (0..STRIPES)
        .map(|i| {
            targets
                .iter()
                .map(|t| Location {
                    endpoint: tcp_endpoint(t),
                    export: "pool".into(),
                    offset: i * CHUNK,
                    grant: None,
                    syncing: false,
                })
                .collect()
        })
        .collect();
    let map = SegmentMap { len: STRIPES * CHUNK, chunk_bytes: CHUNK, stripes };
    let mut seg = Segment::map(map, &LaneConfig::default()).expect("the segment maps");

    // Through the queue: QD requests in flight, every buffer reused.
    let mut out = Vec::with_capacity(2 * QD);
    let mut next = 0;
    for _ in 0..QD {
        resubmit(&mut seg, vec![0x5a; BS], &mut next);
    }
    let warm_until = std::time::Instant::now() + std::time::Duration::from_millis(1500);
    run(&mut seg, &mut out, 20_000, &mut next);
    while std::time::Instant::now() < warm_until {
        run(&mut seg, &mut out, 2_000, &mut next);
    }
    ALLOC.count(true);
    run(&mut seg, &mut out, 30_000, &mut next);
    ALLOC.count(false);
    let queued = (ALLOC.allocations(), ALLOC.bytes(), ALLOC.sizes());
    // Drain, then the blocking calls.
    seg.wait(usize::MAX, &mut out).expect("the last completions");
    out.clear();
    let mut buf = vec![0x33; BS];
    blocking(&mut seg, &mut buf, 5_000, &mut next);
    ALLOC.count(true);
    blocking(&mut seg, &mut buf, 10_000, &mut next);
    ALLOC.count(false);
    let (allocations, bytes) = (ALLOC.allocations() - queued.0, ALLOC.bytes() - queued.1);
    assert_eq!(
        queued.0, 0,
        "{} allocations ({} bytes) in 30,000 queued segment I/Os: {:?}",
        queued.0, queued.1, queued.2
    );
    assert_eq!(
        allocations,
        0,
        "{allocations} allocations ({bytes} bytes) in 10,000 blocking segment I/Os: {:?}",
        ALLOC.sizes()
    );
    let stats = seg.stats();
    assert!(
        stats.requests > stats.reads + stats.writes,
        "pieces straddle chunks and writes go to both copies: {stats:?}"
    );
}
