//! No allocation per request on `skiff attach`'s side of the FUSE path: several threads, as
//! fuser's would, hand reads, writes and flushes to the I/O threads (several in flight each,
//! answered from the I/O threads) and serve read-modify-writes, split reads and zeroed ranges
//! through the waiting path, and after warm-up nothing allocates, on either side of the
//! socket. fuser's own work (receiving the kernel's request, sending the reply) is not in this
//! picture; `attach_fuse_no_alloc.rs` has it. The counting allocator sees every thread, so
//! this test has a binary of its own.

use std::sync::{Arc, Barrier};

use attach::{Volume, VolumeConfig, Worker};
use initiator::LaneConfig;
use skiff_tests::inbox::{Answered, Inbox, ToInbox};
use skiff_tests::{start_target, tcp_endpoint};

#[global_allocator]
static ALLOC: rt::alloc::Counting = rt::alloc::Counting::new();

const THREADS: u64 = 4;
const BLOCK: u64 = 4096;
const BLOCKS_PER_THREAD: u64 = 256;
/// Requests each thread has in flight on the common path at once.
const DEPTH: usize = 4;

/// One thread's requests, and where its answers land: all made before counting starts.
struct Client {
    t: u64,
    data: Vec<u8>,
    inboxes: Vec<Arc<Inbox>>,
    back: Vec<u8>,
}

impl Client {
    /// One thread's mix over its own region: what a file system on a loop device sends
    /// (aligned writes and reads, several in flight, and flushes), and the odd unaligned write
    /// and hole.
    fn mix(&mut self, w: &mut Worker<ToInbox>, vol: &Volume<ToInbox>, rounds: u64) {
        let Client { t, data, inboxes, back } = self;
        let base = *t * BLOCKS_PER_THREAD * BLOCK;
        for i in 0..rounds {
            let off = |k: usize| base + ((i * DEPTH as u64 + k as u64) * 7 % BLOCKS_PER_THREAD) * BLOCK;
            for (k, inbox) in inboxes.iter().enumerate() {
                w.handle_write(vol, off(k), data, false, inbox.reply());
            }
            for inbox in inboxes.iter() {
                assert_eq!(inbox.wait(back), Answered::Written(data.len()));
            }
            for (k, inbox) in inboxes.iter().enumerate() {
                w.handle_read(vol, off(k), data.len(), inbox.reply());
            }
            for (k, inbox) in inboxes.iter().enumerate() {
                assert_eq!(inbox.wait(back), Answered::Data);
                assert!(back == data, "thread {t} offset {}", off(k));
            }
            if i % 8 == 0 {
                w.handle_flush(vol, inboxes[0].reply());
                assert_eq!(inboxes[0].wait(back), Answered::Ok);
                w.write(vol, off(0) + 100, &data[..300], true).unwrap();
                w.read(vol, off(0) + 50, 5000).unwrap();
                w.zero(vol, off(0) + BLOCK, 2 * BLOCK).unwrap();
                w.flush(vol).unwrap();
            }
        }
    }

    /// Larger writes and reads than the measured mix sends, several in flight.
    fn big(&mut self, w: &mut Worker<ToInbox>, vol: &Volume<ToInbox>, big: &[u8], rounds: u64) {
        for i in 0..rounds {
            let off = self.t * BLOCKS_PER_THREAD * BLOCK + i % 4 * big.len() as u64;
            for inbox in &self.inboxes {
                w.handle_write(vol, off, big, false, inbox.reply());
            }
            for inbox in &self.inboxes {
                assert_eq!(inbox.wait(&mut self.back), Answered::Written(big.len()));
            }
            for inbox in &self.inboxes {
                w.handle_read(vol, off, big.len(), inbox.reply());
            }
            for inbox in &self.inboxes {
                assert_eq!(inbox.wait(&mut self.back), Answered::Data);
            }
        }
    }
}

#[test]
fn serving_requests_allocates_nothing_after_warm_up() {
    let t = start_target(&["vol=ram:16M"], 1);
    let config = VolumeConfig { lanes: 2, ..VolumeConfig::new(LaneConfig::default(), 1 << 20) };
    let vol = Arc::new(Volume::<ToInbox>::connect(&tcp_endpoint(&t), "vol", &config).unwrap());
    let phases = Arc::new(Barrier::new(THREADS as usize + 1));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (vol, phases) = (vol.clone(), phases.clone());
            let mut w = vol.worker();
            let mut client = Client {
                t,
                data: (0..BLOCK).map(|i| (i * 31 + t) as u8).collect(),
                inboxes: (0..DEPTH).map(|_| Inbox::new(65_536)).collect(),
                back: Vec::with_capacity(65_536),
            };
            std::thread::spawn(move || {
                client.mix(&mut w, &vol, 400);
                // From every thread at once: buffers that grow to the largest caravan seen (the
                // target's receive and response buffers) reach their size here.
                client.big(&mut w, &vol, &[0x5a; 65_536], 200);
                phases.wait();
                phases.wait();
                client.mix(&mut w, &vol, 2000);
                phases.wait();
                // Dropped by the caller once counting is off.
                (w, client)
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
    assert!(vol.stats().completed > 4 * 2000 * 2 * DEPTH as u64);
    assert_eq!(vol.stalls(), 0, "threads waited for buffers");
}
