//! No allocation per request on `skiff attach`'s side of the FUSE path: several threads, as
//! fuser's would, serve reads, writes (aligned, and read-modify-write), flushes and zeroed
//! ranges through their workers on shared lanes with the adaptive controller, and after
//! warm-up nothing allocates, on either side of the socket. fuser's own work (receiving the
//! kernel's request, sending the reply) is not in this picture; it reuses one buffer per thread
//! too. The counting allocator sees every thread, so this test has a binary of its own.

use std::sync::{Arc, Barrier};

use attach::{Chunk, Volume};
use initiator::{BatchConfig, Batching, LaneConfig, SharedLanes};
use skiff_tests::{start_target, tcp_endpoint};

#[global_allocator]
static ALLOC: rt::alloc::Counting = rt::alloc::Counting::new();

const THREADS: u64 = 4;
const BLOCK: u64 = 4096;
const BLOCKS_PER_THREAD: u64 = 256;

/// One thread's mix over its own region: what a file system on a loop device sends, and the
/// odd unaligned write and hole.
fn mix(w: &mut attach::Worker, vol: &Volume, t: u64, rounds: u64, data: &[u8]) {
    let base = t * BLOCKS_PER_THREAD * BLOCK;
    for i in 0..rounds {
        let off = base + (i * 7 % BLOCKS_PER_THREAD) * BLOCK;
        assert_eq!(w.write(vol, off, data, false).unwrap(), data.len());
        let back = w.read(vol, off, data.len()).unwrap();
        assert!(back == data, "thread {t} offset {off}");
        if i % 8 == 0 {
            w.write(vol, off + 100, &data[..300], true).unwrap();
            w.read(vol, off + 50, 5000).unwrap();
            w.zero(vol, off + BLOCK, 2 * BLOCK).unwrap();
            w.flush(vol).unwrap();
        }
    }
}

#[test]
fn serving_requests_allocates_nothing_after_warm_up() {
    let t = start_target(&["vol=ram:16M"], 1);
    let config = LaneConfig {
        batching: Batching::Adaptive(BatchConfig { interval_us: 5_000, ..BatchConfig::default() }),
        ..LaneConfig::default()
    };
    let lanes = SharedLanes::<Chunk>::connect(&tcp_endpoint(&t), "vol", &config, 2).unwrap();
    let vol = Arc::new(Volume::new(lanes, 1 << 20, false).unwrap());
    let phases = Arc::new(Barrier::new(THREADS as usize + 1));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (vol, phases) = (vol.clone(), phases.clone());
            let mut w = vol.worker().unwrap();
            let data: Vec<u8> = (0..BLOCK).map(|i| (i * 31 + t) as u8).collect();
            std::thread::spawn(move || {
                mix(&mut w, &vol, t, 400, &data);
                // Larger writes and reads than the measured mix sends, from every thread at
                // once: buffers that grow to the largest caravan seen (the target's receive and
                // response buffers) reach their size here.
                let big = vec![0x5a; 65_536];
                for i in 0..200 {
                    let off = t * BLOCKS_PER_THREAD * BLOCK + i % 4 * 65_536;
                    w.write(&vol, off, &big, false).unwrap();
                    w.read(&vol, off, 65_536).unwrap();
                }
                phases.wait();
                phases.wait();
                mix(&mut w, &vol, t, 2000, &data);
                phases.wait();
                // Dropped by the caller once counting is off: a handle's goodbye may allocate.
                w
            })
        })
        .collect();
    phases.wait();
    ALLOC.count(true);
    phases.wait();
    phases.wait();
    ALLOC.count(false);
    let workers: Vec<_> = threads.into_iter().map(|j| j.join().unwrap()).collect();
    drop(workers);
    assert_eq!(ALLOC.allocations(), 0, "allocations by size (bytes, count): {:?}", ALLOC.sizes());
    assert!(vol.lanes().stats().completed > 4 * 2000);
}
