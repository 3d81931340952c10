//! `skiff attach`'s I/O layer without FUSE (no root needed): byte ranges of any offset and
//! length against a shadow copy, cut into pieces by a small largest I/O; read-modify-writes
//! from several threads into the same blocks, which must lose no byte; and the edges of the
//! export.

use std::sync::Arc;

use attach::{Chunk, IoError, Volume};
use initiator::{LaneConfig, SharedLanes};
use skiff_tests::{start_target, tcp_endpoint};

const SIZE: usize = 1 << 20;

fn volume(t: &server::Target, export: &str, io_bytes_max: u32) -> Arc<Volume> {
    let lanes = SharedLanes::<Chunk>::connect(&tcp_endpoint(t), export, &LaneConfig::default(), 2).unwrap();
    Arc::new(Volume::new(lanes, io_bytes_max, false).unwrap())
}

/// SplitMix64: the seeded sequence of offsets, lengths and bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn any_range_reads_back_what_was_written() {
    let t = start_target(&["vol=ram:1M"], 1);
    // A largest I/O of 8 KiB: most ranges here span several requests.
    let vol = volume(&t, "vol", 8192);
    assert_eq!((vol.block_bytes(), vol.io_bytes_max()), (512, 8192));
    let mut w = vol.worker().unwrap();
    let mut shadow = vec![0u8; SIZE];
    let mut rng = Rng(13);
    for round in 0..600 {
        let off = rng.below(SIZE as u64 - 1);
        let len = (1 + rng.below(40_000)).min(SIZE as u64 - off) as usize;
        match rng.below(10) {
            0..=5 => {
                let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
                assert_eq!(w.write(&vol, off, &bytes, round % 7 == 0).unwrap(), len);
                shadow[off as usize..off as usize + len].copy_from_slice(&bytes);
            }
            6 => {
                w.zero(&vol, off, len as u64).unwrap();
                shadow[off as usize..off as usize + len].fill(0);
            }
            7 => w.flush(&vol).unwrap(),
            _ => {}
        }
        let (roff, rlen) = (rng.below(SIZE as u64), 1 + rng.below(50_000) as usize);
        let got = w.read(&vol, roff, rlen).unwrap();
        let end = (roff as usize + rlen).min(SIZE);
        assert!(got == &shadow[roff as usize..end], "round {round}: read {rlen} at {roff}");
    }
    let whole = w.read(&vol, 0, SIZE).unwrap().to_vec();
    assert!(whole == shadow);
}

#[test]
fn concurrent_partial_block_writes_lose_nothing() {
    let t = start_target(&["vol=ram:64K"], 2);
    let vol = volume(&t, "vol", 1 << 20);
    const THREADS: usize = 4;
    const SLICE: usize = 128; // each thread owns 128 bytes of every 512-byte block
    let joins: Vec<_> = (0..THREADS)
        .map(|th| {
            let vol = vol.clone();
            let mut w = vol.worker().unwrap();
            std::thread::spawn(move || {
                for round in 0..50u8 {
                    for block in 0..16u64 {
                        let bytes = [round ^ th as u8; SLICE];
                        w.write(&vol, block * 512 + (th * SLICE) as u64, &bytes, false).unwrap();
                    }
                }
            })
        })
        .collect();
    for j in joins {
        j.join().unwrap();
    }
    let mut w = vol.worker().unwrap();
    let got = w.read(&vol, 0, 16 * 512).unwrap();
    for block in 0..16 {
        for th in 0..THREADS {
            let at = block * 512 + th * SLICE;
            assert!(
                got[at..at + SLICE].iter().all(|&b| b == 49 ^ th as u8),
                "block {block}, thread {th}'s bytes"
            );
        }
    }
}

#[test]
fn the_edges_of_the_export() {
    let t = start_target(&["vol=ram:64K", "golden=ram:64K,ro"], 1);
    let vol = volume(&t, "vol", 1 << 20);
    let mut w = vol.worker().unwrap();
    let end = 64 << 10;
    assert!(matches!(w.write(&vol, end, b"x", false), Err(IoError::PastEnd)));
    assert_eq!(IoError::PastEnd.errno(), libc::ENOSPC);
    assert_eq!(w.write(&vol, end - 3, b"abcdef", false).unwrap(), 3, "cut short at the end");
    assert_eq!(w.read(&vol, end - 3, 100).unwrap(), b"abc");
    assert!(w.read(&vol, end, 100).unwrap().is_empty());
    w.zero(&vol, end - 2, 100).unwrap();
    assert_eq!(w.read(&vol, end - 3, 3).unwrap(), b"a\0\0");

    let ro = volume(&t, "golden", 1 << 20);
    assert!(ro.is_read_only());
    let mut w = ro.worker().unwrap();
    let err = w.write(&ro, 0, b"x", false).unwrap_err();
    assert_eq!(err.errno(), libc::EROFS, "{err}");
    assert_eq!(w.zero(&ro, 0, 512).unwrap_err().errno(), libc::EROFS);
    assert_eq!(w.read(&ro, 0, 4).unwrap(), [0; 4]);
}
