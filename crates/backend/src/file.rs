//! The file backend: a regular file or a block device, read and written with positional I/O.
//!
//! Each backend holds up to four descriptors on the same file, so that every request picks its
//! path without `fcntl` or locks:
//!
//! - `buffered`: through the page cache; always present, and the one `flush` syncs.
//! - `direct`: `O_DIRECT`, bypassing the page cache, when the file system accepts it (tmpfs
//!   and some FUSE file systems refuse it at open; we say so once in the log and stay buffered).
//! - `dsync_direct` and `dsync_buffered`: `O_DSYNC` (the first also `O_DIRECT`) for FUA writes,
//!   which are then durable on return without syncing the whole file.
//!
//! A request uses `O_DIRECT` when its offset and length are multiples of [`ALIGN_BYTES`]
//! (a conservative alignment every device accepts). If only the caller's buffer is misaligned,
//! the bytes go through a per-thread aligned bounce buffer, which costs a memory copy but keeps
//! the page cache out. A request at any other offset or length still goes `O_DIRECT`, over the
//! 4 KiB blocks around it: a read reads them into the bounce buffer and copies out its part; a
//! write reads the blocks it covers in part, patches them and writes the whole span back,
//! under [`BlockLocks`] so that no other write lands in those blocks meanwhile (a
//! read-modify-write). The page cache never holds a page that `O_DIRECT` also writes: a
//! buffered write there and a direct write beside it in the same page can leave a dirty
//! cached page whose writeback undoes the direct write. Only the file's last partial 4 KiB
//! block, if its size is not a multiple of 4 KiB, is reached through the page cache, since
//! `O_DIRECT` cannot address it; and a file system that refuses `O_DIRECT` (tmpfs, some FUSE
//! file systems, `,direct=off`) is used through the page cache alone. An `O_DIRECT` request
//! the kernel still refuses with `EINVAL` is retried buffered, with one log line per backend.
//!
//! This module owns no unsafe code (`FileExt` does positional I/O) and no policy on request
//! sizes: the engine bounds those, and the bounce buffer grows to the largest it sees.

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rt::mem::{AlignedBuf, ALIGN_BYTES};

use crate::locks::{BlockLocks, BLOCK};
use crate::spec::{check_range, read_only_error, BLOCK_BYTES};
use crate::{push_extent, Backend, BackendCounters, Capabilities, Extent, Result};

/// Size of each write that `write_zeroes` and `trim` issue: large enough to keep system-call
/// overhead small, small enough to live in the binary.
const ZERO_CHUNK_BYTES: usize = 64 * 1024;

/// Zeroes aligned for `O_DIRECT`, shared by every zeroing write; read-only, so never stale.
#[repr(C, align(4096))]
struct ZeroChunk([u8; ZERO_CHUNK_BYTES]);

static ZEROES: ZeroChunk = ZeroChunk([0; ZERO_CHUNK_BYTES]);

thread_local! {
    /// Each worker's `O_DIRECT` bounce buffer: allocated on first use, grown to the largest
    /// misaligned request, then reused so the data path does not allocate.
    static BOUNCE: RefCell<Option<AlignedBuf>> = const { RefCell::new(None) };
}

/// Counters shared by all workers. Relaxed ordering: they are statistics, read after the fact.
#[derive(Debug, Default)]
struct AtomicCounters {
    syncs: AtomicU64,
    dsync_writes: AtomicU64,
    direct_ios: AtomicU64,
    buffered_ios: AtomicU64,
}

/// Every worker writes these (one backend serves them all), so unlike the single-writer
/// counters in `engine::stats` this needs a locked add.
fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// The descriptors only a writable backend opens.
#[derive(Debug)]
struct WriteFds {
    /// `O_DSYNC | O_DIRECT`, when `O_DIRECT` works on this file.
    dsync_direct: Option<File>,
    /// `O_DSYNC` through the page cache, for FUA writes `O_DIRECT` cannot take.
    dsync_buffered: File,
}

/// A volume backed by a regular file or block device.
#[derive(Debug)]
pub struct FileBackend {
    path: PathBuf,
    size_bytes: u64,
    buffered: File,
    direct: Option<File>,
    /// `None` when opened read-only, which is what makes a backend read-only.
    write_fds: Option<WriteFds>,
    counters: AtomicCounters,
    /// The kernel refused an `O_DIRECT` request (`EINVAL`): every request goes through the
    /// page cache from then on.
    direct_refused: AtomicBool,
    /// Orders read-modify-writes against the writes they overlap (with `O_DIRECT` only).
    locks: BlockLocks,
    /// Where `O_DIRECT` ends: the size rounded down to whole 4 KiB blocks.
    direct_end: u64,
}

/// How one request reaches an `O_DIRECT` descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Direct,
    /// Aligned on the file, not in memory: through the bounce buffer.
    Bounce,
    /// Not aligned on the file: over the whole blocks around it (a read-modify-write for a
    /// write).
    Span,
}

fn route(offset: u64, len_bytes: usize, buf_addr: usize) -> Route {
    let align = ALIGN_BYTES as u64;
    if !offset.is_multiple_of(align) || !(len_bytes as u64).is_multiple_of(align) {
        Route::Span
    } else if !buf_addr.is_multiple_of(ALIGN_BYTES) {
        Route::Bounce
    } else {
        Route::Direct
    }
}

/// The whole blocks around `len` bytes at `offset`: their start, and their length.
fn span(offset: u64, len: usize) -> (u64, usize) {
    let start = offset - offset % BLOCK;
    let end = (offset + len as u64).div_ceil(BLOCK) * BLOCK;
    (start, (end - start) as usize)
}

/// Add the path to an open-time error, keeping its kind. The errno is lost, which only matters
/// on the data path, never here.
fn with_path(path: &Path, what: &str, err: io::Error) -> io::Error {
    io::Error::new(err.kind(), format!("{}: {what}: {err}", path.display()))
}

fn open_fd(path: &Path, write: bool, flags: i32) -> io::Result<File> {
    OpenOptions::new().read(true).write(write).custom_flags(flags).open(path)
}

/// Bounce buffers up to this size are kept per thread for reuse; a larger request (a 32 MiB
/// write from an NBD client without block sizes) gets one of its own, freed after it.
const BOUNCE_KEEP_BYTES: usize = 1 << 20;

/// Run `f` on an aligned bounce buffer of `len_bytes`: this thread's, grown as needed, or a
/// fresh one past [`BOUNCE_KEEP_BYTES`]. An allocation failure is an error (`ENOMEM`), never a
/// quiet fall back to the page cache.
fn with_bounce<R>(len_bytes: usize, f: impl FnOnce(&mut [u8]) -> io::Result<R>) -> io::Result<R> {
    if len_bytes > BOUNCE_KEEP_BYTES {
        let mut buf = AlignedBuf::new(len_bytes)?;
        return f(&mut buf[..len_bytes]);
    }
    BOUNCE.with(|cell| {
        let mut slot = cell.try_borrow_mut().map_err(|_| io::Error::other("bounce buffer in use"))?;
        let too_small = match slot.as_ref() {
            Some(buf) => buf.len() < len_bytes,
            None => true,
        };
        if too_small {
            // Drop the old buffer first so peak memory is one buffer, not two.
            *slot = None;
            *slot = Some(AlignedBuf::new(len_bytes)?);
        }
        let buf = slot.as_mut().expect("just made");
        f(&mut buf[..len_bytes])
    })
}

impl FileBackend {
    /// Open `path` (a regular file or block device) for I/O; writable unless `read_only`.
    ///
    /// The volume size is the file's size, found by seeking to its end (which works for block
    /// devices too), rounded down to whole 512-byte blocks. An empty file is an error.
    pub fn open(path: &Path, read_only: bool) -> Result<Self> {
        FileBackend::open_with(path, read_only, true)
    }

    /// [`open`](Self::open); with `use_direct` false every request goes through the page cache
    /// (`,direct=off` on an export: for measuring what the page cache gives).
    pub fn open_with(path: &Path, read_only: bool, use_direct: bool) -> Result<Self> {
        let buffered = open_fd(path, !read_only, 0).map_err(|e| with_path(path, "open", e))?;
        let file_type = buffered.metadata().map_err(|e| with_path(path, "stat", e))?.file_type();
        if !file_type.is_file() && !file_type.is_block_device() {
            return Err(invalid(path, "not a regular file or block device"));
        }
        let size_bytes = volume_size(path, &buffered)?;
        let direct = if use_direct { open_direct(path, !read_only) } else { None };
        let write_fds = if read_only { None } else { Some(open_write_fds(path, direct.is_some())?) };
        Ok(FileBackend {
            path: path.to_owned(),
            size_bytes,
            buffered,
            direct,
            write_fds,
            counters: AtomicCounters::default(),
            direct_refused: AtomicBool::new(false),
            locks: BlockLocks::default(),
            direct_end: size_bytes - size_bytes % BLOCK,
        })
    }

    /// True when `O_DIRECT` is in use on this file.
    pub fn uses_direct_io(&self) -> bool {
        self.direct_fd().is_some()
    }

    /// The `O_DIRECT` descriptor, unless the file has none or the kernel refused it once.
    fn direct_fd(&self) -> Option<&File> {
        self.direct.as_ref().filter(|_| !self.direct_refused.load(Ordering::Relaxed))
    }

    /// Read `buf` at `offset` through `fd` (`O_DIRECT`), on whatever route its alignment
    /// needs.
    fn read_direct(fd: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match route(offset, buf.len(), buf.as_ptr() as usize) {
            Route::Direct => fd.read_exact_at(buf, offset),
            Route::Bounce => with_bounce(buf.len(), |bounce| {
                fd.read_exact_at(bounce, offset)?;
                buf.copy_from_slice(bounce);
                Ok(())
            }),
            Route::Span => {
                let (start, len) = span(offset, buf.len());
                let at = (offset - start) as usize;
                with_bounce(len, |bounce| {
                    fd.read_exact_at(bounce, start)?;
                    buf.copy_from_slice(&bounce[at..at + buf.len()]);
                    Ok(())
                })
            }
        }
    }

    /// Write `buf` at `offset` through `fd` (`O_DIRECT`): as it is, through the bounce buffer,
    /// or as a read-modify-write of the blocks it covers in part. The caller holds the blocks'
    /// locks.
    fn write_direct(fd: &File, buf: &[u8], offset: u64) -> io::Result<()> {
        match route(offset, buf.len(), buf.as_ptr() as usize) {
            Route::Direct => fd.write_all_at(buf, offset),
            Route::Bounce => with_bounce(buf.len(), |bounce| {
                bounce.copy_from_slice(buf);
                fd.write_all_at(bounce, offset)
            }),
            Route::Span => {
                let (start, len) = span(offset, buf.len());
                let at = (offset - start) as usize;
                with_bounce(len, |bounce| {
                    if at > 0 {
                        fd.read_exact_at(&mut bounce[..BLOCK as usize], start)?;
                    }
                    let tail = len - BLOCK as usize;
                    let tail_partial = at + buf.len() < len;
                    if tail_partial && (tail > 0 || at == 0) {
                        fd.read_exact_at(&mut bounce[tail..], start + tail as u64)?;
                    }
                    bounce[at..at + buf.len()].copy_from_slice(buf);
                    fd.write_all_at(bounce, start)
                })
            }
        }
    }

    /// The kernel refused an `O_DIRECT` request: from now on every request of this file goes
    /// through the page cache (mixing the two per request is what the block locks exist to
    /// keep safe, and a refusal says the paths cannot be trusted to agree).
    fn refuse_direct(&self, err: &io::Error) {
        if !self.direct_refused.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                path = %self.path.display(),
                error = %err,
                "O_DIRECT request refused; this file goes through the page cache from now on"
            );
        }
    }

    /// One write on the FUA (`O_DSYNC`) or ordinary descriptors; range already checked.
    fn write_checked(&self, fds: &WriteFds, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        // Bytes past the last whole 4 KiB block only the page cache can reach.
        let (head, tail) =
            buf.split_at(self.direct_end.saturating_sub(offset).min(buf.len() as u64) as usize);
        if !head.is_empty() {
            self.write_head(fds, head, offset, fua)?;
        }
        if !tail.is_empty() {
            let fd = if fua { &fds.dsync_buffered } else { &self.buffered };
            fd.write_all_at(tail, offset + head.len() as u64)?;
            bump(&self.counters.buffered_ios);
        }
        if fua {
            bump(&self.counters.dsync_writes);
        }
        Ok(())
    }

    /// A write inside the whole 4 KiB blocks. On a file with `O_DIRECT` it holds the locks of
    /// the blocks it touches for all of it, whichever path it takes, so that no
    /// read-modify-write of another request overlaps it.
    fn write_head(&self, fds: &WriteFds, head: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let buffered = if fua { &fds.dsync_buffered } else { &self.buffered };
        let _held = self.direct.is_some().then(|| self.locks.write(offset, head.len() as u64));
        let Some(direct) = self.direct_fd() else {
            buffered.write_all_at(head, offset)?;
            bump(&self.counters.buffered_ios);
            return Ok(());
        };
        // FUA: the O_DSYNC|O_DIRECT descriptor, or a plain direct write then fdatasync.
        let (fd, sync_after) = match (fua, fds.dsync_direct.as_ref()) {
            (true, Some(d)) => (d, false),
            (true, None) => (direct, true),
            (false, _) => (direct, false),
        };
        match Self::write_direct(fd, head, offset) {
            Ok(()) => {
                bump(&self.counters.direct_ios);
                if sync_after {
                    self.buffered.sync_data()?;
                    bump(&self.counters.syncs);
                }
                Ok(())
            }
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
                self.refuse_direct(&err);
                buffered.write_all_at(head, offset)?;
                bump(&self.counters.buffered_ios);
                Ok(())
            }
            Err(err) => Err(err),
        }
    }

    fn writable(&self) -> Result<&WriteFds> {
        self.write_fds.as_ref().ok_or_else(read_only_error)
    }
}

fn invalid(path: &Path, why: &str) -> crate::BackendError {
    crate::BackendError::Io(io::Error::new(io::ErrorKind::InvalidInput, format!("{}: {why}", path.display())))
}

/// The file's size in whole blocks. A trailing partial block cannot be addressed by 512-byte
/// requests, so it is left out (with a warning) rather than advertised.
fn volume_size(path: &Path, file: &File) -> Result<u64> {
    // `&File` implements `Seek`; the position is irrelevant since all I/O is positional.
    let mut cursor = file;
    let file_bytes = cursor.seek(SeekFrom::End(0)).map_err(|e| with_path(path, "seek to end", e))?;
    if file_bytes == 0 {
        return Err(invalid(path, "empty file"));
    }
    let size_bytes = file_bytes - file_bytes % u64::from(BLOCK_BYTES);
    if size_bytes == 0 {
        return Err(invalid(path, "smaller than one 512-byte block"));
    }
    if size_bytes != file_bytes {
        tracing::warn!(
            path = %path.display(),
            file_bytes,
            size_bytes,
            "file size is not whole 512-byte blocks; the tail is not exported"
        );
    }
    Ok(size_bytes)
}

/// Open the `O_DIRECT` descriptor, or say once why we cannot and carry on buffered.
fn open_direct(path: &Path, write: bool) -> Option<File> {
    match open_fd(path, write, libc::O_DIRECT) {
        Ok(fd) => Some(fd),
        Err(err) => {
            tracing::info!(
                path = %path.display(),
                error = %err,
                "O_DIRECT is unsupported on this path; using buffered I/O"
            );
            None
        }
    }
}

fn open_write_fds(path: &Path, direct_works: bool) -> Result<WriteFds> {
    let dsync_buffered =
        open_fd(path, true, libc::O_DSYNC).map_err(|e| with_path(path, "open O_DSYNC", e))?;
    // O_DIRECT already opened once, so a failure here is unexpected; FUA then stays buffered.
    let dsync_direct =
        if direct_works { open_fd(path, true, libc::O_DSYNC | libc::O_DIRECT).ok() } else { None };
    Ok(WriteFds { dsync_direct, dsync_buffered })
}

impl Backend for FileBackend {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn file_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        Some(self.buffered.as_raw_fd())
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn block_size(&self) -> u32 {
        BLOCK_BYTES
    }

    fn is_read_only(&self) -> bool {
        self.write_fds.is_none()
    }

    /// Write-zeroes writes zero buffers here (no hole punching yet), so it is not fast.
    fn capabilities(&self) -> Capabilities {
        Capabilities { fast_zero: false, ..Capabilities::ALL }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.size_bytes, offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        let split = self.direct_end.saturating_sub(offset).min(buf.len() as u64) as usize;
        let (head, tail) = buf.split_at_mut(split);
        if !head.is_empty() {
            let direct = match self.direct_fd().map(|fd| Self::read_direct(fd, head, offset)) {
                Some(Ok(())) => true,
                Some(Err(err)) if err.raw_os_error() == Some(libc::EINVAL) => {
                    self.refuse_direct(&err);
                    false
                }
                Some(Err(err)) => return Err(err.into()),
                None => false,
            };
            if direct {
                bump(&self.counters.direct_ios);
            } else {
                self.buffered.read_exact_at(head, offset)?;
                bump(&self.counters.buffered_ios);
            }
        }
        if !tail.is_empty() {
            self.buffered.read_exact_at(tail, offset + split as u64)?;
            bump(&self.counters.buffered_ios);
        }
        Ok(())
    }

    /// With `fua`, the write goes through an `O_DSYNC` descriptor and is durable on return.
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        let fds = self.writable()?;
        check_range(self.size_bytes, offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.write_checked(fds, buf, offset, fua)
    }

    /// `fdatasync`: covers writes from every descriptor, since they share one inode.
    fn flush(&self) -> Result<()> {
        self.buffered.sync_data()?;
        bump(&self.counters.syncs);
        Ok(())
    }

    /// Implemented as [`write_zeroes`](Backend::write_zeroes) without FUA, so trimmed blocks
    /// read zeroes but no space is released. Punching holes needs `fallocate`, which std does
    /// not wrap and this crate may not call unsafely; it can come later from `rt`.
    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.write_zeroes(offset, len, false)
    }

    /// Writes zeroes in 64 KiB chunks, the first cut short to reach a 4 KiB boundary so the
    /// rest can go `O_DIRECT`. With `fua`, one `fdatasync` at the end makes the whole range
    /// durable, cheaper than `O_DSYNC` on every chunk.
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        let fds = self.writable()?;
        check_range(self.size_bytes, offset, len)?;
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let to_boundary = ZERO_CHUNK_BYTES as u64 - pos % ALIGN_BYTES as u64;
            let chunk_bytes = to_boundary.min(end - pos) as usize;
            self.write_checked(fds, &ZEROES.0[..chunk_bytes], pos, false)?;
            pos += chunk_bytes as u64;
        }
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Holes from `SEEK_DATA`/`SEEK_HOLE`; they read as zeroes. Data extents may still hold
    /// zeroes: the file system does not say, so neither do we.
    fn extents(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        use rt::fs::{seek, Seek};
        check_range(self.size_bytes, offset, len)?;
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let data = match seek(&self.buffered, pos, Seek::Data) {
                Ok(found) => found.unwrap_or(end).min(end),
                // No hole support here: everything is data, which is true.
                Err(_) => pos,
            };
            push_extent(out, Extent { len_bytes: data - pos, hole: true, zero: true });
            if data >= end {
                break;
            }
            let hole = seek(&self.buffered, data, Seek::Hole).ok().flatten().unwrap_or(end).min(end);
            push_extent(out, Extent { len_bytes: hole - data, hole: false, zero: false });
            pos = hole.max(data + 1);
        }
        Ok(())
    }

    fn counters(&self) -> BackendCounters {
        let c = &self.counters;
        BackendCounters {
            syncs: c.syncs.load(Ordering::Relaxed),
            dsync_writes: c.dsync_writes.load(Ordering::Relaxed),
            direct_ios: c.direct_ios.load(Ordering::Relaxed),
            buffered_ios: c.buffered_ios.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_follow_alignment() {
        let a = ALIGN_BYTES;
        assert_eq!(route(0, a, a), Route::Direct);
        assert_eq!(route(a as u64 * 3, 2 * a, 5 * a), Route::Direct);
        assert_eq!(route(0, a, a + 1), Route::Bounce);
        assert_eq!(route(512, a, a), Route::Span);
        assert_eq!(route(0, 512, a), Route::Span);
        assert_eq!(route(512, 512, 3), Route::Span);
        assert_eq!(span(512, 512), (0, a));
        assert_eq!(span(a as u64 - 1, 2), (0, 2 * a));
        assert_eq!(span(a as u64, a), (a as u64, a));
    }

    #[test]
    fn bounce_buffer_grows_and_is_reused() {
        let first = with_bounce(ALIGN_BYTES, |b| Ok((b.as_ptr() as usize, b.len()))).unwrap();
        assert_eq!(first.0 % ALIGN_BYTES, 0);
        assert_eq!(first.1, ALIGN_BYTES);
        let grown = with_bounce(4 * ALIGN_BYTES, |b| Ok(b.len())).unwrap();
        assert_eq!(grown, 4 * ALIGN_BYTES);
        // A smaller request reuses the grown buffer rather than shrinking it.
        let again = with_bounce(ALIGN_BYTES, |b| Ok(b.len())).unwrap();
        assert_eq!(again, ALIGN_BYTES);
        BOUNCE.with(|cell| assert_eq!(cell.borrow().as_ref().unwrap().len(), 4 * ALIGN_BYTES));
        // A large one is made for the request and not kept.
        let big = with_bounce(BOUNCE_KEEP_BYTES + ALIGN_BYTES, |b| Ok(b.len())).unwrap();
        assert_eq!(big, BOUNCE_KEEP_BYTES + ALIGN_BYTES);
        BOUNCE.with(|cell| assert_eq!(cell.borrow().as_ref().unwrap().len(), 4 * ALIGN_BYTES));
    }

    #[test]
    fn zero_chunk_is_aligned() {
        assert_eq!(ZEROES.0.as_ptr() as usize % ALIGN_BYTES, 0);
        assert!(ZEROES.0.iter().all(|&b| b == 0));
    }
}
