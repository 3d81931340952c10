//! `skiff attach`'s I/O layer without FUSE (no root needed): byte ranges of any offset and
//! length against a shadow copy, cut into pieces by a small largest I/O, through both the
//! common path (queued, answered by the I/O threads) and the waiting one; read-modify-writes
//! from several threads into the same blocks, alone and against aligned writes in flight,
//! which must lose no byte; flushes; and the edges of the export.

use std::sync::Arc;

use attach::{IoError, Volume, VolumeConfig};
use initiator::LaneConfig;
use skiff_tests::inbox::{Answered, Inbox, ToInbox};
use skiff_tests::{start_target, tcp_endpoint};

const SIZE: usize = 1 << 20;

fn volume(t: &server::Target, export: &str, io_bytes_max: u32) -> Arc<Volume<ToInbox>> {
    let config = VolumeConfig { lanes: 2, ..VolumeConfig::new(LaneConfig::default(), io_bytes_max) };
    Arc::new(Volume::connect(&tcp_endpoint(t), export, &config).unwrap())
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
    let mut w = vol.worker();
    let inbox = Inbox::new(SIZE);
    let mut got = Vec::with_capacity(SIZE);
    let mut shadow = vec![0u8; SIZE];
    let mut rng = Rng(13);
    for round in 0..1200 {
        // Half the rounds aligned, so that the common path sees as many as the rare ones.
        let aligned = round % 2 == 0;
        let mut off = rng.below(SIZE as u64 - 1);
        let mut len = (1 + rng.below(40_000)).min(SIZE as u64 - off) as usize;
        if aligned {
            off -= off % 512;
            len = (len / 512).clamp(1, 16) * 512;
            len = len.min(SIZE - off as usize);
        }
        match rng.below(10) {
            0..=5 => {
                let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
                let fua = round % 7 == 0;
                if round % 4 < 2 {
                    w.handle_write(&vol, off, &bytes, fua, inbox.reply());
                    assert_eq!(inbox.wait(&mut got), Answered::Written(len), "round {round}");
                } else {
                    assert_eq!(w.write(&vol, off, &bytes, fua).unwrap(), len);
                }
                shadow[off as usize..off as usize + len].copy_from_slice(&bytes);
            }
            6 => {
                w.zero(&vol, off, len as u64).unwrap();
                shadow[off as usize..off as usize + len].fill(0);
            }
            7 => {
                w.handle_flush(&vol, inbox.reply());
                assert_eq!(inbox.wait(&mut got), Answered::Ok);
            }
            8 => w.flush(&vol).unwrap(),
            _ => {}
        }
        let (mut roff, mut rlen) = (rng.below(SIZE as u64), 1 + rng.below(50_000) as usize);
        if aligned {
            roff -= roff % 512;
            rlen = (rlen / 512).clamp(1, 16) * 512;
        }
        let end = (roff as usize + rlen).min(SIZE);
        if round % 3 == 0 {
            let direct = w.read(&vol, roff, rlen).unwrap();
            assert!(direct == &shadow[roff as usize..end], "round {round}: read {rlen} at {roff}");
        } else {
            w.handle_read(&vol, roff, rlen, inbox.reply());
            assert_eq!(inbox.wait(&mut got), Answered::Data);
            assert!(got == shadow[roff as usize..end], "round {round}: handle_read {rlen} at {roff}");
        }
    }
    let whole = w.read(&vol, 0, SIZE).unwrap().to_vec();
    assert!(whole == shadow);
    assert_eq!(vol.stalls(), 0);
}

/// Aligned writes through the common path, many in flight at once, against read-modify-writes
/// of the same blocks: each read-modify-write must see, and keep, the last aligned write
/// completed before it, so that after each round of writes every block holds that round's
/// version outside the patches. Without the write gate (or with the aligned writes' hold released when
/// they are queued rather than when they complete), a read-modify-write that read a block
/// before an aligned write landed writes the old bytes back after it, and the block ends
/// with an old version.
#[test]
fn read_modify_writes_keep_aligned_writes_in_flight() {
    let t = start_target(&["vol=ram:64K"], 2);
    let vol = volume(&t, "vol", 1 << 20);
    const BLOCKS: u64 = 16;
    const VERSIONS: u8 = 200;
    const PATCH: usize = 16; // each patcher owns 16 bytes at the start of every block
    const PATCHERS: usize = 3;
    let writer = {
        let vol = vol.clone();
        std::thread::spawn(move || {
            let mut w = vol.worker();
            let inboxes: Vec<_> = (0..BLOCKS).map(|_| Inbox::new(0)).collect();
            let mut scratch = Vec::new();
            for version in 1..=VERSIONS {
                // One write per block, all in flight together.
                for (b, inbox) in inboxes.iter().enumerate() {
                    w.handle_write(&vol, b as u64 * 512, &[version; 512], false, inbox.reply());
                }
                for inbox in &inboxes {
                    assert_eq!(inbox.wait(&mut scratch), Answered::Written(512));
                }
                // Until the next version, every block holds this one outside the patches.
                let got = w.read(&vol, 0, BLOCKS as usize * 512).unwrap();
                for (b, block) in got.chunks(512).enumerate() {
                    let rest = &block[PATCHERS * PATCH..];
                    assert!(
                        rest.iter().all(|&x| x == version),
                        "block {b}: version {} after {version}",
                        rest[0]
                    );
                }
            }
        })
    };
    let patchers: Vec<_> = (0..PATCHERS)
        .map(|p| {
            let vol = vol.clone();
            std::thread::spawn(move || {
                let mut w = vol.worker();
                for round in 0..100u8 {
                    for b in 0..BLOCKS {
                        let at = b * 512 + (p * PATCH) as u64;
                        w.write(&vol, at, &[0x80 | round; PATCH], false).unwrap();
                    }
                }
            })
        })
        .collect();
    writer.join().unwrap();
    for p in patchers {
        p.join().unwrap();
    }
    let mut w = vol.worker();
    let got = w.read(&vol, 0, BLOCKS as usize * 512).unwrap();
    for b in 0..BLOCKS as usize {
        let block = &got[b * 512..(b + 1) * 512];
        let rest = &block[PATCHERS * PATCH..];
        assert!(
            rest.iter().all(|&x| x == VERSIONS),
            "block {b} lost the last aligned write: {:?}",
            &rest[..8]
        );
    }
}

/// A flush is sent only when a write completed since the last one that completed, and
/// `handle_flush` answers from the I/O thread.
#[test]
fn flushes_cover_completed_writes_and_are_not_repeated() {
    let t = start_target(&["vol=ram:64K"], 1);
    let vol = volume(&t, "vol", 1 << 20);
    assert!(vol.can_flush());
    let flushes = || t.stats().get("req_flush").unwrap_or(0);
    let mut w = vol.worker();
    let inbox = Inbox::new(4096);
    let mut scratch = Vec::new();
    w.handle_flush(&vol, inbox.reply());
    assert_eq!(inbox.wait(&mut scratch), Answered::Ok);
    assert_eq!(flushes(), 0, "nothing written yet: no FLUSH");
    w.handle_write(&vol, 0, &[7; 4096], false, inbox.reply());
    assert_eq!(inbox.wait(&mut scratch), Answered::Written(4096));
    w.handle_flush(&vol, inbox.reply());
    assert_eq!(inbox.wait(&mut scratch), Answered::Ok);
    assert_eq!(flushes(), 1);
    w.handle_flush(&vol, inbox.reply());
    assert_eq!(inbox.wait(&mut scratch), Answered::Ok);
    w.flush(&vol).unwrap();
    assert_eq!(flushes(), 1, "covered already");
    w.write(&vol, 100, b"odd", false).unwrap();
    w.handle_flush(&vol, inbox.reply());
    assert_eq!(inbox.wait(&mut scratch), Answered::Ok);
    assert_eq!(flushes(), 2);
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
            let mut w = vol.worker();
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
    let mut w = vol.worker();
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
    let mut w = vol.worker();
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
    let mut w = ro.worker();
    let err = w.write(&ro, 0, b"x", false).unwrap_err();
    assert_eq!(err.errno(), libc::EROFS, "{err}");
    assert_eq!(w.zero(&ro, 0, 512).unwrap_err().errno(), libc::EROFS);
    assert_eq!(w.read(&ro, 0, 4).unwrap(), [0; 4]);
}
