//! The whole FUSE path of `skiff attach`, kernel to target and back, allocates nothing per
//! request after warm-up: an in-process attachment, four threads reading and writing its
//! file (direct I/O, as a loop device does), and every thread of this process counted:
//! fuser's request loop, the workers, the I/O threads and their replies, and the target. This
//! is one of the things that keeps a loop device over the file out of the memory-reclaim deadlock
//! (docs/ATTACH.md). Root and FUSE are needed (see `skiff_tests::devices::available`). The
//! counting allocator sees every thread, so this test has a binary of its own.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::{Arc, Barrier};

use attach::{AttachConfig, Attachment};
use skiff_tests::devices::available;
use skiff_tests::{start_target, tcp_endpoint};

#[global_allocator]
static ALLOC: rt::alloc::Counting = rt::alloc::Counting::new();

const THREADS: u64 = 4;
const BLOCK: usize = 4096;
const REGION: u64 = 1 << 20;

/// One thread's reads and writes over its own megabyte, through the FUSE file.
fn mix(f: &std::fs::File, t: u64, rounds: u64, buf: &mut [u8], back: &mut [u8]) {
    for i in 0..rounds {
        let off = t * REGION + (i * 7 % (REGION / BLOCK as u64)) * BLOCK as u64;
        buf[..8].copy_from_slice(&(off ^ i).to_le_bytes());
        f.write_all_at(buf, off).unwrap();
        f.read_exact_at(back, off).unwrap();
        assert!(back == buf, "thread {t} offset {off}");
    }
}

#[test]
fn the_fuse_path_allocates_nothing_after_warm_up() {
    if !available("the_fuse_path_allocates_nothing_after_warm_up") {
        return;
    }
    let t = start_target(&["vol=ram:16M"], 1);
    let dir = tempfile::tempdir().unwrap();
    let config = AttachConfig { threads: 4, ..AttachConfig::new(tcp_endpoint(&t), "vol", dir.path()) };
    let attachment = Attachment::mount(&config).unwrap();
    let phases = Arc::new(Barrier::new(THREADS as usize + 1));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(attachment.file())
                .unwrap();
            let phases = phases.clone();
            // Page-aligned buffers for O_DIRECT: an aligned slice of a larger vector.
            let mut mem = vec![0x6bu8; 4 * BLOCK];
            std::thread::spawn(move || {
                let at = mem.as_ptr().align_offset(BLOCK);
                let (buf, back) = mem[at..at + 2 * BLOCK].split_at_mut(BLOCK);
                // Every FUSE thread sees a first request, and makes its worker, before counting.
                mix(&f, t, 2000, buf, back);
                phases.wait();
                phases.wait();
                mix(&f, t, 2000, buf, back);
                phases.wait();
                (f, mem)
            })
        })
        .collect();
    phases.wait();
    ALLOC.count(true);
    phases.wait();
    phases.wait();
    ALLOC.count(false);
    let files: Vec<_> = threads.into_iter().map(|j| j.join().unwrap()).collect();
    drop(files);
    assert_eq!(attachment.stalls(), 0, "a FUSE thread waited for a request buffer");
    let stats = attachment.unmount().unwrap();
    assert_eq!(ALLOC.allocations(), 0, "allocations by size (bytes, count): {:?}", ALLOC.sizes());
    assert!(stats.completed >= 2 * THREADS * 4000, "{stats:?}");
}
