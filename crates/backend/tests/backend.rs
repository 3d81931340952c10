//! Behaviour every backend must show through the `Backend` trait: round trips at awkward
//! offsets, zeroing, read-only refusal, and for files, durability paths (`O_DIRECT`, `O_DSYNC`,
//! `fdatasync`) proven by the counters and by reading the file back with plain `std::fs`.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;

use rt::mem::{AlignedBuf, ALIGN_BYTES};
use skiff_backend::file::FileBackend;
use skiff_backend::null::NullBackend;
use skiff_backend::ram::RamBackend;
use skiff_backend::{Backend, BackendCounters, BackendSpec};

const MIB: u64 = 1024 * 1024;

/// Bytes that differ by position and seed, so misplaced data cannot pass for correct data.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

fn read_vec(backend: &dyn Backend, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xeeu8; len];
    backend.read_at(&mut buf, offset).unwrap();
    buf
}

fn assert_zeroes(backend: &dyn Backend, offset: u64, len: usize) {
    let got = read_vec(backend, offset, len);
    if let Some(i) = got.iter().position(|&b| b != 0) {
        panic!("byte {} of [{offset}, +{len}) is {:#x}, want 0", i, got[i]);
    }
}

/// (offset, length) pairs covering aligned, 512-only-aligned and multi-page requests, the first
/// and the last block, and the last 4 KiB.
fn awkward_ranges(size_bytes: u64) -> Vec<(u64, usize)> {
    vec![
        (0, 512),
        (512, 512),
        (4096, 4096),
        (3 * 4096 + 512, 8192 + 512),
        (64 * 1024, 128 * 1024),
        (size_bytes - 4096, 4096),
        (size_bytes - 512, 512),
    ]
}

/// Write every range, then read all of them back (later writes overwrite earlier overlaps, so
/// verify against a model of the whole volume).
fn check_round_trips(backend: &dyn Backend) {
    let size_bytes = backend.size_bytes();
    let mut model = read_vec(backend, 0, size_bytes as usize);
    for (i, (offset, len)) in awkward_ranges(size_bytes).into_iter().enumerate() {
        let data = pattern(len, i as u8 + 1);
        backend.write_at(&data, offset, i % 2 == 0).unwrap();
        model[offset as usize..][..len].copy_from_slice(&data);
        assert_eq!(read_vec(backend, offset, len), data, "range {offset}+{len}");
    }
    assert!(read_vec(backend, 0, size_bytes as usize) == model, "volume differs from model");
}

/// Zero a misaligned range inside written data and check both the hole and its neighbours.
fn check_zeroing(backend: &dyn Backend, trim: bool) {
    let data = pattern(256 * 1024, 7);
    backend.write_at(&data, 0, false).unwrap();
    let (offset, len) = (512u64, 100 * 1024 + 512);
    if trim {
        backend.trim(offset, len as u64).unwrap();
    } else {
        backend.write_zeroes(offset, len as u64, false).unwrap();
    }
    assert_zeroes(backend, offset, len);
    assert_eq!(read_vec(backend, 0, 512), data[..512]);
    let after = offset as usize + len;
    assert_eq!(read_vec(backend, after as u64, 4096), data[after..][..4096]);
    // Zeroing the very last block works too.
    let last = backend.size_bytes() - 512;
    backend.write_at(&[1u8; 512], last, false).unwrap();
    backend.write_zeroes(last, 512, true).unwrap();
    assert_zeroes(backend, last, 512);
}

fn check_read_only_refusal(backend: &dyn Backend) {
    assert!(backend.is_read_only());
    let errno = |r: skiff_backend::Result<()>| r.unwrap_err().errno();
    assert_eq!(errno(backend.write_at(&[0u8; 512], 0, false)), libc::EROFS);
    assert_eq!(errno(backend.write_at(&[0u8; 512], 0, true)), libc::EROFS);
    assert_eq!(errno(backend.trim(0, 512)), libc::EROFS);
    assert_eq!(errno(backend.write_zeroes(0, 512, false)), libc::EROFS);
    let mut buf = [0u8; 512];
    backend.read_at(&mut buf, 0).unwrap();
}

fn check_out_of_range(backend: &dyn Backend) {
    let size_bytes = backend.size_bytes();
    let mut buf = [0u8; 1024];
    assert_eq!(backend.read_at(&mut buf, size_bytes - 512).unwrap_err().errno(), libc::EINVAL);
    if !backend.is_read_only() {
        assert_eq!(backend.write_at(&buf, size_bytes, false).unwrap_err().errno(), libc::EINVAL);
        assert_eq!(backend.trim(size_bytes, 512).unwrap_err().errno(), libc::EINVAL);
    }
}

fn check_all_capabilities(backend: &dyn Backend) {
    assert_eq!(backend.block_size(), 512);
    assert!(backend.can_flush());
    assert!(backend.can_fua());
    assert!(backend.can_trim());
    assert!(backend.can_write_zeroes());
}

// ---------------------------------------------------------------------------------------------
// RAM

#[test]
fn ram_round_trips_and_starts_zeroed() {
    let ram = RamBackend::new(MIB, false).unwrap();
    assert_eq!(ram.kind(), "ram");
    assert_eq!(ram.size_bytes(), MIB);
    check_all_capabilities(&ram);
    assert_zeroes(&ram, 0, MIB as usize);
    check_round_trips(&ram);
    ram.flush().unwrap();
    assert_eq!(ram.counters(), BackendCounters::default());
}

#[test]
fn ram_trim_and_write_zeroes_read_back_zeroes() {
    let ram = RamBackend::new(MIB, false).unwrap();
    check_zeroing(&ram, false);
    check_zeroing(&ram, true);
}

#[test]
fn ram_read_only_refuses_changes() {
    let ram = RamBackend::new(MIB, true).unwrap();
    check_read_only_refusal(&ram);
    check_out_of_range(&ram);
}

#[test]
fn ram_out_of_range_is_einval() {
    check_out_of_range(&RamBackend::new(MIB, false).unwrap());
}

#[test]
fn ram_disjoint_concurrent_writers() {
    const THREADS: u64 = 4;
    const SLICE_BYTES: u64 = 256 * 1024;
    const REQUEST_BYTES: usize = 4096 + 512;
    let ram = Arc::new(RamBackend::new(THREADS * SLICE_BYTES, false).unwrap());
    let writers: Vec<_> = (0..THREADS)
        .map(|t| {
            let ram = Arc::clone(&ram);
            thread::spawn(move || {
                let data = pattern(SLICE_BYTES as usize, t as u8);
                // Many small requests, so the threads really interleave.
                for (i, chunk) in data.chunks(REQUEST_BYTES).enumerate() {
                    let offset = t * SLICE_BYTES + (i * REQUEST_BYTES) as u64;
                    ram.write_at(chunk, offset, false).unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().unwrap();
    }
    for t in 0..THREADS {
        let got = read_vec(&*ram, t * SLICE_BYTES, SLICE_BYTES as usize);
        assert!(got == pattern(SLICE_BYTES as usize, t as u8), "slice {t} corrupted");
    }
}

// ---------------------------------------------------------------------------------------------
// Null

#[test]
fn null_reads_zeroes_and_discards_writes() {
    let null = NullBackend::new(MIB, false);
    assert_eq!(null.kind(), "null");
    assert_eq!(null.size_bytes(), MIB);
    check_all_capabilities(&null);
    null.write_at(&[0xabu8; 4096], MIB - 4096, true).unwrap();
    assert_zeroes(&null, MIB - 4096, 4096);
    null.trim(0, MIB).unwrap();
    null.write_zeroes(0, MIB, true).unwrap();
    null.flush().unwrap();
    check_out_of_range(&null);
}

#[test]
fn null_read_only_refuses_changes() {
    check_read_only_refusal(&NullBackend::new(MIB, true));
}

// ---------------------------------------------------------------------------------------------
// open() from specs

#[test]
fn open_builds_each_kind_from_its_spec() {
    let ram = skiff_backend::open(&BackendSpec::parse("ram:1M").unwrap(), false).unwrap();
    assert_eq!((ram.kind(), ram.size_bytes()), ("ram", MIB));
    let null = skiff_backend::open(&BackendSpec::parse("null:512M").unwrap(), true).unwrap();
    assert_eq!((null.kind(), null.size_bytes()), ("null", 512 * MIB));
    assert!(null.is_read_only());

    let dir = scratch_dir();
    let path = sized_file(dir.path(), "spec.img", MIB);
    let spec = BackendSpec::parse(&format!("file:{}", path.display())).unwrap();
    let file = skiff_backend::open(&spec, false).unwrap();
    assert_eq!((file.kind(), file.size_bytes()), ("file", MIB));
}

// ---------------------------------------------------------------------------------------------
// File

/// A directory under /var/tmp: /tmp may be tmpfs, which refuses `O_DIRECT` on older kernels.
fn scratch_dir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("skiff-backend-").tempdir_in("/var/tmp").unwrap()
}

/// A sparse file of `size_bytes` (reads as zeroes).
fn sized_file(dir: &Path, name: &str, size_bytes: u64) -> PathBuf {
    let path = dir.join(name);
    fs::File::create(&path).unwrap().set_len(size_bytes).unwrap();
    path
}

/// Whether this file system accepts `O_DIRECT`, found the same way the backend finds it.
fn direct_io_supported(path: &Path) -> bool {
    let supported = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).is_ok();
    if !supported {
        eprintln!(
            "!!!!! O_DIRECT is NOT supported on {}: the direct I/O paths were NOT exercised !!!!!",
            path.display()
        );
    }
    supported
}

fn delta(before: BackendCounters, after: BackendCounters) -> BackendCounters {
    BackendCounters {
        syncs: after.syncs - before.syncs,
        dsync_writes: after.dsync_writes - before.dsync_writes,
        direct_ios: after.direct_ios - before.direct_ios,
        buffered_ios: after.buffered_ios - before.buffered_ios,
    }
}

#[test]
fn file_round_trips_and_persists() {
    let dir = scratch_dir();
    let path = sized_file(dir.path(), "vol.img", MIB);
    let expected = {
        let file = FileBackend::open(&path, false).unwrap();
        assert_eq!(file.kind(), "file");
        assert_eq!(file.size_bytes(), MIB);
        assert!(!file.is_read_only());
        check_all_capabilities(&file);
        assert_zeroes(&file, 0, MIB as usize);
        check_round_trips(&file);
        file.flush().unwrap();
        read_vec(&file, 0, MIB as usize)
    };
    // Reopen through plain std::fs: what the backend acknowledged is really in the file.
    let on_disk = fs::read(&path).unwrap();
    assert_eq!(on_disk.len() as u64, MIB, "backend must never grow the file");
    assert!(on_disk == expected, "file contents differ from what the backend read");
    assert_eq!(&on_disk[MIB as usize - 512..], &pattern(512, 7)[..]);
}

#[test]
fn file_trim_and_write_zeroes_read_back_zeroes() {
    let dir = scratch_dir();
    let path = sized_file(dir.path(), "zero.img", MIB);
    let file = FileBackend::open(&path, false).unwrap();
    check_zeroing(&file, false);
    check_zeroing(&file, true);
    drop(file);
    let on_disk = fs::read(&path).unwrap();
    assert!(on_disk[512..512 + 100 * 1024 + 512].iter().all(|&b| b == 0));
}

#[test]
fn file_flush_and_fua_reach_the_os() {
    let dir = scratch_dir();
    let path = sized_file(dir.path(), "sync.img", MIB);
    let file = FileBackend::open(&path, false).unwrap();

    let before = file.counters();
    file.flush().unwrap();
    assert_eq!(delta(before, file.counters()).syncs, 1, "flush must fdatasync");

    let before = file.counters();
    file.write_at(&pattern(512, 1), 512, true).unwrap();
    let aligned = AlignedBuf::new(8192).unwrap();
    file.write_at(&aligned, 8192, true).unwrap();
    let d = delta(before, file.counters());
    assert_eq!(d.dsync_writes, 2, "FUA writes must take the O_DSYNC path");
    assert_eq!(d.syncs, 0, "FUA writes need no whole-file sync");

    let before = file.counters();
    file.write_at(&pattern(512, 2), 1024, false).unwrap();
    assert_eq!(delta(before, file.counters()).dsync_writes, 0, "plain writes are not O_DSYNC");

    let before = file.counters();
    file.write_zeroes(0, 64 * 1024, true).unwrap();
    assert_eq!(delta(before, file.counters()).syncs, 1, "FUA write-zeroes must sync");
}

#[test]
fn file_aligned_io_goes_direct_when_supported() {
    let dir = scratch_dir();
    let path = sized_file(dir.path(), "direct.img", MIB);
    let supported = direct_io_supported(&path);
    let file = FileBackend::open(&path, false).unwrap();
    assert_eq!(file.uses_direct_io(), supported);

    let mut buf = AlignedBuf::new(2 * ALIGN_BYTES).unwrap();
    buf.copy_from_slice(&pattern(2 * ALIGN_BYTES, 3));
    let before = file.counters();
    file.write_at(&buf, 4 * ALIGN_BYTES as u64, false).unwrap();
    let mut back = AlignedBuf::new(2 * ALIGN_BYTES).unwrap();
    file.read_at(&mut back, 4 * ALIGN_BYTES as u64).unwrap();
    assert_eq!(&back[..], &buf[..]);
    let d = delta(before, file.counters());
    if supported {
        assert_eq!((d.direct_ios, d.buffered_ios), (2, 0));
    } else {
        assert_eq!((d.direct_ios, d.buffered_ios), (0, 2));
    }

    // Offsets aligned to 512 but not 4096 go O_DIRECT too, over the 4 KiB blocks around them
    // (a read-modify-write for the write): the page cache never holds a page O_DIRECT writes.
    let before = file.counters();
    file.write_at(&buf[..1024], 512, false).unwrap();
    assert_eq!(read_vec(&file, 512, 1024), &buf[..1024]);
    let d = delta(before, file.counters());
    if supported {
        assert_eq!((d.direct_ios, d.buffered_ios), (2, 0));
    } else {
        assert_eq!((d.direct_ios, d.buffered_ios), (0, 2));
    }
}

/// Byte ranges at any offset and length (an NBD client that did not agree to block sizes
/// sends them): what is written reads back, and the bytes around it are unchanged.
fn check_byte_ranges(backend: &dyn Backend) {
    let size_bytes = backend.size_bytes();
    let mut model = pattern(size_bytes as usize, 9);
    backend.write_at(&model, 0, false).unwrap();
    let ranges = [(1u64, 1usize), (4095, 2), (4097, 14), (100, 4096), (8191, 8194), (3, (1 << 20) + 14)];
    for (i, (offset, len)) in ranges.into_iter().enumerate() {
        let offset = offset.min(size_bytes - len as u64);
        let data = pattern(len, i as u8 + 40);
        backend.write_at(&data, offset, i % 2 == 1).unwrap();
        model[offset as usize..][..len].copy_from_slice(&data);
        assert_eq!(read_vec(backend, offset, len), data, "range {offset}+{len}");
        let around = (
            offset.saturating_sub(5000),
            (len + 10_000).min((size_bytes - offset.saturating_sub(5000)) as usize),
        );
        assert!(
            read_vec(backend, around.0, around.1) == model[around.0 as usize..][..around.1],
            "around {offset}+{len}"
        );
    }
    // The last bytes of the volume, whether or not it ends on a 4 KiB boundary.
    let data = pattern(700, 77);
    backend.write_at(&data, size_bytes - 700, false).unwrap();
    model[size_bytes as usize - 700..].copy_from_slice(&data);
    assert!(read_vec(backend, 0, size_bytes as usize) == model, "volume differs from model");
}

#[test]
fn file_takes_byte_ranges_at_any_alignment() {
    let dir = scratch_dir();
    let path = sized_file(dir.path(), "bytes.img", 4 * MIB);
    let supported = direct_io_supported(&path);
    let file = FileBackend::open(&path, false).unwrap();
    check_byte_ranges(&file);
    let c = file.counters();
    assert_eq!(c.direct_ios > 0, supported, "the direct path was used where O_DIRECT works: {c:?}");
    if supported {
        assert_eq!(c.buffered_ios, 0, "nothing went through the page cache: {c:?}");
    }
    // A size that ends 512 bytes into a 4 KiB block: its last block only the page cache
    // reaches, and a write across that boundary is split.
    let ragged = sized_file(dir.path(), "ragged.img", 4 * MIB + 512);
    let file = FileBackend::open(&ragged, false).unwrap();
    assert_eq!(file.size_bytes(), 4 * MIB + 512);
    check_byte_ranges(&file);
    let across = pattern(8192, 3);
    file.write_at(&across, 4 * MIB + 512 - 8192, false).unwrap();
    assert_eq!(read_vec(&file, 4 * MIB + 512 - 8192, 8192), across);
}

#[test]
fn ram_and_null_take_byte_ranges_at_any_alignment() {
    check_byte_ranges(&RamBackend::new(4 * MIB, false).unwrap());
    let null = NullBackend::new(MIB, false);
    null.write_at(&[1; 3], 5, false).unwrap();
    assert_eq!(read_vec(&null, 5, 3), [0; 3]);
}

/// Writers of disjoint byte ranges that share 4 KiB blocks, and of whole blocks beside them,
/// all at once: a read-modify-write must never undo a write that landed in its block
/// meanwhile, so every range ends holding its writer's last bytes.
#[test]
fn file_patches_of_one_block_never_lose_a_write() {
    const WRITERS: usize = 4;
    const ROUNDS: usize = 1000;
    let dir = scratch_dir();
    let path = sized_file(dir.path(), "patches.img", MIB);
    let file = Arc::new(FileBackend::open(&path, false).unwrap());
    // Writer w owns bytes [w * 1000 + 10, w * 1000 + 990) of blocks 0 to 3, and whole block
    // 4 + w; the ranges cut across the blocks' edges.
    let threads: Vec<_> = (0..WRITERS)
        .map(|w| {
            let file = file.clone();
            thread::spawn(move || {
                for round in 0..ROUNDS {
                    let byte = (w * ROUNDS + round) as u8;
                    for block in 0..4u64 {
                        let offset = block * 4096 + w as u64 * 1000 + 10;
                        file.write_at(&[byte; 980], offset, false).unwrap();
                    }
                    let mut whole = AlignedBuf::new(4096).unwrap();
                    whole.fill(byte);
                    file.write_at(&whole, (4 + w as u64) * 4096, false).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(
        !direct_io_supported(&path) || file.counters().direct_ios > 0,
        "O_DIRECT works here, so the read-modify-writes must have gone through it"
    );
    for w in 0..WRITERS {
        let last = (w * ROUNDS + ROUNDS - 1) as u8;
        for block in 0..4u64 {
            let offset = block * 4096 + w as u64 * 1000 + 10;
            assert_eq!(
                read_vec(&*file, offset, 980),
                vec![last; 980],
                "writer {w}, block {block}: a write was lost"
            );
        }
        assert_eq!(
            read_vec(&*file, (4 + w as u64) * 4096, 4096),
            vec![last; 4096],
            "writer {w}'s whole block"
        );
    }
}

#[test]
fn file_misaligned_buffers_give_correct_data() {
    let dir = scratch_dir();
    let path = sized_file(dir.path(), "bounce.img", MIB);
    let supported = direct_io_supported(&path);
    let file = FileBackend::open(&path, false).unwrap();

    // Slices starting one byte into an aligned allocation are guaranteed misaligned.
    let len = 3 * ALIGN_BYTES;
    let mut backing = AlignedBuf::new(len + 1).unwrap();
    backing[1..].copy_from_slice(&pattern(len, 9));
    let offset = 8 * ALIGN_BYTES as u64;
    let before = file.counters();
    file.write_at(&backing[1..], offset, false).unwrap();
    file.write_at(&backing[1..], offset + len as u64, true).unwrap();
    let mut read_back = AlignedBuf::new(len + 1).unwrap();
    file.read_at(&mut read_back[1..], offset).unwrap();
    assert_eq!(&read_back[1..], &backing[1..]);
    file.read_at(&mut read_back[1..], offset + len as u64).unwrap();
    assert_eq!(&read_back[1..], &backing[1..]);

    let d = delta(before, file.counters());
    if supported {
        assert_eq!((d.direct_ios, d.buffered_ios), (4, 0), "bounce keeps O_DIRECT");
    } else {
        assert_eq!((d.direct_ios, d.buffered_ios), (0, 4));
    }
    drop(file);
    let on_disk = fs::read(&path).unwrap();
    assert_eq!(&on_disk[offset as usize..][..len], &backing[1..]);
    assert_eq!(&on_disk[offset as usize + len..][..len], &backing[1..]);
}

#[test]
fn file_read_only_refuses_changes() {
    let dir = scratch_dir();
    let path = sized_file(dir.path(), "ro.img", MIB);
    fs::write(&path, pattern(MIB as usize, 5)).unwrap();
    let file = FileBackend::open(&path, true).unwrap();
    check_read_only_refusal(&file);
    check_out_of_range(&file);
    assert_eq!(read_vec(&file, MIB - 512, 512), &pattern(MIB as usize, 5)[MIB as usize - 512..]);
    assert!(fs::read(&path).unwrap() == pattern(MIB as usize, 5));
}

#[test]
fn file_writes_never_grow_the_file() {
    let dir = scratch_dir();
    let path = sized_file(dir.path(), "grow.img", MIB);
    let file = FileBackend::open(&path, false).unwrap();
    check_out_of_range(&file);
    assert_eq!(fs::metadata(&path).unwrap().len(), MIB);
}

#[test]
fn file_size_must_hold_a_block() {
    let dir = scratch_dir();
    let empty = sized_file(dir.path(), "empty.img", 0);
    let err = FileBackend::open(&empty, false).unwrap_err().to_string();
    assert!(err.contains("empty file"), "{err}");

    let tiny = sized_file(dir.path(), "tiny.img", 100);
    assert!(FileBackend::open(&tiny, false).is_err());

    // A trailing partial block is not exported.
    let ragged = sized_file(dir.path(), "ragged.img", 4096 + 100);
    assert_eq!(FileBackend::open(&ragged, false).unwrap().size_bytes(), 4096);

    let err = FileBackend::open(dir.path(), true).unwrap_err().to_string();
    assert!(err.contains("not a regular file"), "{err}");
    assert!(FileBackend::open(&dir.path().join("missing.img"), false).is_err());
}

#[test]
fn file_disjoint_concurrent_writers() {
    const THREADS: u64 = 4;
    const SLICE_BYTES: u64 = 256 * 1024;
    let dir = scratch_dir();
    let path = sized_file(dir.path(), "threads.img", THREADS * SLICE_BYTES);
    let file = Arc::new(FileBackend::open(&path, false).unwrap());
    let writers: Vec<_> = (0..THREADS)
        .map(|t| {
            let file = Arc::clone(&file);
            thread::spawn(move || {
                let data = pattern(SLICE_BYTES as usize, t as u8);
                // Mixed sizes: some requests direct, some bounced, some buffered.
                for (i, chunk) in data.chunks(4096 + 512 * (t as usize)).enumerate() {
                    let offset = t * SLICE_BYTES + (i * (4096 + 512 * t as usize)) as u64;
                    file.write_at(chunk, offset, i % 3 == 0).unwrap();
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().unwrap();
    }
    file.flush().unwrap();
    let on_disk = fs::read(&path).unwrap();
    for (t, slice) in on_disk.chunks(SLICE_BYTES as usize).enumerate() {
        assert!(slice == pattern(SLICE_BYTES as usize, t as u8), "slice {t} corrupted");
    }
}

mod extents {
    use skiff_backend::{Backend, Extent};

    fn map(b: &dyn Backend, offset: u64, len: u64) -> Vec<(u64, bool)> {
        let mut out = Vec::new();
        b.extents(offset, len, &mut out).unwrap();
        assert_eq!(out.iter().map(|e| e.len_bytes).sum::<u64>(), len, "extents cover the range exactly");
        assert!(
            out.iter().all(|e: &Extent| e.hole == e.zero),
            "holes read as zeroes, data is not claimed zero"
        );
        out.iter().map(|e| (e.len_bytes, e.hole)).collect()
    }

    #[test]
    fn ram_reports_pages_never_written_as_holes() {
        let b = skiff_backend::ram::RamBackend::new(1 << 20, false).unwrap();
        assert_eq!(map(&b, 0, 1 << 20), vec![(1 << 20, true)]);
        b.write_at(&[1; 512], 8192 + 512, false).unwrap();
        assert_eq!(map(&b, 0, 1 << 20), vec![(8192, true), (4096, false), ((1 << 20) - 12288, true)]);
        assert_eq!(map(&b, 8192 + 1024, 1024), vec![(1024, false)], "a sub-range of a written page");
        b.write_zeroes(8192, 4096, false).unwrap();
        assert_eq!(map(&b, 0, 1 << 20), vec![(1 << 20, true)], "zeroing a whole page frees it");
        b.write_at(&[1; 4096], 0, false).unwrap();
        b.trim(0, 2048).unwrap();
        assert_eq!(map(&b, 0, 4096), vec![(4096, false)], "a partial trim keeps the page");
    }

    #[test]
    fn file_reports_holes_from_the_file_system() {
        let f = tempfile::Builder::new().prefix("skiff-extents-").tempfile_in("/var/tmp").unwrap();
        f.as_file().set_len(8 << 20).unwrap();
        let b = skiff_backend::file::FileBackend::open(f.path(), false).unwrap();
        assert_eq!(map(&b, 0, 8 << 20), vec![(8 << 20, true)], "a new sparse file is one hole");
        b.write_at(&[7; 65536], 4 << 20, false).unwrap();
        b.flush().unwrap();
        let m = map(&b, 0, 8 << 20);
        let data: u64 = m.iter().filter(|(_, hole)| !hole).map(|(len, _)| len).sum();
        assert!((65536..8 << 20).contains(&data), "{m:?}");
        assert!(m.first().unwrap().1 && m.last().unwrap().1, "holes before and after: {m:?}");
    }

    #[test]
    fn null_is_one_hole() {
        let b = skiff_backend::null::NullBackend::new(1 << 30, false);
        assert_eq!(map(&b, 4096, 1 << 20), vec![(1 << 20, true)]);
    }
}
