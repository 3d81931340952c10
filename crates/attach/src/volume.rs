//! The export as a file: byte ranges in, block requests out, through shared lanes.
//!
//! A [`Volume`] is the export seen by every FUSE thread at once: its size and block size, the
//! largest request the target takes, and the shared lanes their requests travel on. Each thread
//! owns a [`Worker`]: a handle on one shared lane, one request buffer, one buffer to assemble
//! split reads, all made when the thread first serves a request and reused for every request
//! after. The common case (a loop device's block-aligned request no larger than the largest
//! I/O) is one request to the target and no copy beyond FUSE's own for a write; anything else
//! is cut into aligned pieces, and a write that covers part of a block becomes a read, a patch
//! and a write of that block (read-modify-write).
//!
//! The kernel may run writes to one file concurrently (`FOPEN_PARALLEL_DIRECT_WRITES`), so a
//! read-modify-write must not interleave with another write to the same block: aligned writes
//! hold a shared lock, read-modify-writes the exclusive one. Reads take no lock.
//!
//! This module knows nothing of FUSE; the adapter in `fs` calls it, and the tests drive it
//! directly.

use std::sync::atomic::{
    AtomicU64,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use initiator::{Completion, ExportFlags, ExportInfo, ReqFlags, SharedHandle, SharedLanes, USER_DATA_MAX};
use wire::Opcode;

/// Most bytes one WRITE_ZEROES asks for: the wire's `u32` length, rounded down to 1 GiB.
const ZERO_PIECE_BYTES_MAX: u64 = 1 << 30;

/// Identifies a volume, so that a thread's worker is never used with a volume it was not
/// made for.
static NEXT_VOLUME_ID: AtomicU64 = AtomicU64::new(1);

/// A request buffer: fixed capacity, the length of the request in flight. The lane holds it
/// while the request is out, and hands it back, with read data in it, in the completion.
#[derive(Debug)]
pub struct Chunk {
    data: Box<[u8]>,
    len: usize,
}

impl Chunk {
    fn new(capacity: usize) -> Chunk {
        Chunk { data: vec![0; capacity].into_boxed_slice(), len: 0 }
    }

    /// Make the buffer `len` bytes long (within its capacity) without touching its contents.
    fn set_len(&mut self, len: usize) {
        assert!(len <= self.data.len(), "a request of {len} bytes in a {}-byte chunk", self.data.len());
        self.len = len;
    }
}

impl AsRef<[u8]> for Chunk {
    fn as_ref(&self) -> &[u8] {
        &self.data[..self.len]
    }
}

impl AsMut<[u8]> for Chunk {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.data[..self.len]
    }
}

/// Why an operation on the volume failed.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error(transparent)]
    Lane(#[from] initiator::Error),
    #[error("write at or past the end of the export")]
    PastEnd,
    #[error("the export is read-only")]
    ReadOnly,
    #[error("the export cannot write zeroes")]
    CannotZero,
}

impl IoError {
    /// The one mapping to the errno a file system caller sees. Statuses map as the protocol
    /// document says; a lost connection or a silent target is an I/O error, which is what a
    /// file system on a loop device expects of a failing disk.
    pub fn errno(&self) -> i32 {
        match self {
            IoError::Lane(initiator::Error::Status(status) | initiator::Error::Refused(status)) => {
                status.errno()
            }
            IoError::Lane(initiator::Error::TimedOut(_)) => libc::ETIMEDOUT,
            IoError::Lane(initiator::Error::InvalidArgument(_)) => libc::EINVAL,
            IoError::Lane(_) => libc::EIO,
            IoError::PastEnd => libc::ENOSPC,
            IoError::ReadOnly => libc::EROFS,
            IoError::CannotZero => libc::EOPNOTSUPP,
        }
    }
}

pub type IoResult<T> = std::result::Result<T, IoError>;

/// The export, shared by every FUSE thread.
pub struct Volume {
    id: u64,
    lanes: SharedLanes<Chunk>,
    export: ExportInfo,
    block_bytes: u64,
    /// Largest READ or WRITE the target takes, a multiple of the block size.
    io_bytes_max: usize,
    read_only: bool,
    /// Shared by aligned writes, exclusive for a read-modify-write (see the module docs).
    rmw: RwLock<()>,
    /// Writes completed, and how many of them the last completed FLUSH covered: a flush with
    /// nothing new to cover (a `close` after reading) is not sent.
    writes_done: AtomicU64,
    writes_flushed: AtomicU64,
}

impl Volume {
    /// A volume over `lanes`; `io_bytes_max` is the largest READ or WRITE the target takes.
    /// `read_only` refuses writes here even when the export would take them.
    pub fn new(lanes: SharedLanes<Chunk>, io_bytes_max: u32, read_only: bool) -> IoResult<Volume> {
        let export = lanes.export().clone();
        let block_bytes = u64::from(export.block_size.max(1));
        let io_bytes_max = u64::from(io_bytes_max) / block_bytes * block_bytes;
        if io_bytes_max == 0 {
            return Err(initiator::Error::InvalidArgument("largest I/O below the export's block size").into());
        }
        Ok(Volume {
            id: NEXT_VOLUME_ID.fetch_add(1, Relaxed),
            read_only: read_only || export.flags.has(ExportFlags::READ_ONLY),
            lanes,
            export,
            block_bytes,
            io_bytes_max: io_bytes_max as usize,
            rmw: RwLock::new(()),
            writes_done: AtomicU64::new(0),
            writes_flushed: AtomicU64::new(0),
        })
    }

    pub fn export(&self) -> &ExportInfo {
        &self.export
    }

    pub fn size_bytes(&self) -> u64 {
        self.export.size_bytes
    }

    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// The largest read or write a single FUSE request should carry.
    pub fn io_bytes_max(&self) -> usize {
        self.io_bytes_max
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    pub fn can_flush(&self) -> bool {
        self.export.flags.has(ExportFlags::CAN_FLUSH)
    }

    pub fn can_zero(&self) -> bool {
        self.export.flags.has(ExportFlags::CAN_WRITE_ZEROES)
    }

    pub fn lanes(&self) -> &SharedLanes<Chunk> {
        &self.lanes
    }

    /// A worker for the calling thread: a handle on the next shared lane and its buffers.
    pub fn worker(&self) -> IoResult<Worker> {
        let handle = self.lanes.handle()?;
        let block = self.block_bytes as usize;
        Ok(Worker {
            volume_id: self.id,
            handle,
            chunk: Some(Chunk::new(self.io_bytes_max)),
            assembled: Vec::with_capacity(self.io_bytes_max + 2 * block),
            done: Vec::with_capacity(8),
            zero_block: vec![0; block].into_boxed_slice(),
            next_user_data: 0,
        })
    }
}

/// A hold on [`Volume::rmw`], shared or exclusive; released when dropped.
type Held<'a> = (Option<RwLockReadGuard<'a, ()>>, Option<RwLockWriteGuard<'a, ()>>);
const SHARED: bool = false;
const EXCLUSIVE: bool = true;

impl Volume {
    /// Take the write lock of the module docs. A panic while holding it leaves nothing to
    /// repair (the lock guards no data), so a poisoned lock is taken as it is.
    fn lock(&self, exclusive: bool) -> Held<'_> {
        if exclusive {
            (None, Some(self.rmw.write().unwrap_or_else(|p| p.into_inner())))
        } else {
            (Some(self.rmw.read().unwrap_or_else(|p| p.into_inner())), None)
        }
    }
}

/// One thread's way to the volume. Not shared: every method takes `&mut self`.
pub struct Worker {
    volume_id: u64,
    handle: SharedHandle<Chunk>,
    /// The request buffer; `None` only while a request is out, or after a request was
    /// abandoned (timed out) with it.
    chunk: Option<Chunk>,
    /// Where a read cut into pieces is put together.
    assembled: Vec<u8>,
    done: Vec<Completion<Chunk>>,
    /// One block of zeroes, for the partial blocks at the edges of a range to zero.
    zero_block: Box<[u8]>,
    next_user_data: u64,
}

impl Worker {
    /// Whether this worker was made by `volume`.
    pub fn serves(&self, volume: &Volume) -> bool {
        self.volume_id == volume.id
    }

    /// Read up to `len` bytes at `offset`; fewer at the end of the export, none past it.
    pub fn read(&mut self, vol: &Volume, offset: u64, len: usize) -> IoResult<&[u8]> {
        let len = len.min(vol.size_bytes().saturating_sub(offset) as usize);
        if len == 0 {
            return Ok(&[]);
        }
        if is_aligned(vol, offset, len) && len <= vol.io_bytes_max {
            self.request(Opcode::Read, ReqFlags::empty(), offset, len)?;
            return Ok(self.chunk_ref());
        }
        self.read_pieces(vol, offset, len)?;
        Ok(&self.assembled)
    }

    /// A read that is misaligned or larger than one request: aligned pieces, each copied into
    /// place.
    fn read_pieces(&mut self, vol: &Volume, offset: u64, len: usize) -> IoResult<()> {
        self.assembled.clear();
        let end = offset + len as u64;
        let mut pos = offset;
        while pos < end {
            let start = pos - pos % vol.block_bytes;
            let stop = round_up(end, vol.block_bytes).min(start + vol.io_bytes_max as u64);
            self.request(Opcode::Read, ReqFlags::empty(), start, (stop - start) as usize)?;
            let take = (end.min(stop) - pos) as usize;
            let from = (pos - start) as usize;
            let Worker { chunk, assembled, .. } = self;
            let data = chunk.as_ref().map_or(&[][..], |c| c.as_ref());
            assembled.extend_from_slice(&data[from..from + take]);
            pos += take as u64;
        }
        Ok(())
    }

    /// Write `data` at `offset`, durable before it returns when `fua`. Returns how many bytes
    /// were written: fewer than given at the end of the export.
    pub fn write(&mut self, vol: &Volume, offset: u64, data: &[u8], fua: bool) -> IoResult<usize> {
        if vol.read_only {
            return Err(IoError::ReadOnly);
        }
        if offset >= vol.size_bytes() {
            return Err(IoError::PastEnd);
        }
        let data = &data[..data.len().min((vol.size_bytes() - offset) as usize)];
        if data.is_empty() {
            return Ok(0);
        }
        let flags = write_flags(vol, fua);
        if is_aligned(vol, offset, data.len()) && data.len() <= vol.io_bytes_max {
            let _shared = vol.lock(SHARED);
            self.write_aligned(offset, data, flags)?;
        } else {
            let _exclusive = vol.lock(EXCLUSIVE);
            self.write_pieces(vol, offset, data, flags)?;
        }
        vol.writes_done.fetch_add(1, Relaxed);
        if fua && !vol.export.flags.has(ExportFlags::CAN_FUA) && vol.can_flush() {
            // The export cannot make one write durable, but it can make all of them durable.
            self.flush(vol)?;
        }
        Ok(data.len())
    }

    fn write_aligned(&mut self, offset: u64, data: &[u8], flags: ReqFlags) -> IoResult<()> {
        let chunk = self.chunk_mut();
        chunk.set_len(data.len());
        chunk.as_mut().copy_from_slice(data);
        self.request(Opcode::Write, flags, offset, data.len())
    }

    /// A write that is misaligned or larger than one request, under the exclusive lock: whole
    /// blocks go as they are, partial ones by read-modify-write.
    fn write_pieces(&mut self, vol: &Volume, offset: u64, data: &[u8], flags: ReqFlags) -> IoResult<()> {
        let block = vol.block_bytes;
        let mut pos = offset;
        let mut rest = data;
        while !rest.is_empty() {
            let into_block = (pos % block) as usize;
            let n = if into_block != 0 || (rest.len() as u64) < block {
                let n = rest.len().min(block as usize - into_block);
                self.patch_block(pos - into_block as u64, block as usize, into_block, &rest[..n], flags)?;
                n
            } else {
                let whole = rest.len() / block as usize * block as usize;
                let n = whole.min(vol.io_bytes_max);
                self.write_aligned(pos, &rest[..n], flags)?;
                n
            };
            pos += n as u64;
            rest = &rest[n..];
        }
        Ok(())
    }

    /// Read the block at `start`, put `patch` at `at` in it, and write it back.
    fn patch_block(
        &mut self,
        start: u64,
        block: usize,
        at: usize,
        patch: &[u8],
        flags: ReqFlags,
    ) -> IoResult<()> {
        self.request(Opcode::Read, ReqFlags::empty(), start, block)?;
        self.chunk_mut().as_mut()[at..at + patch.len()].copy_from_slice(patch);
        self.request(Opcode::Write, flags, start, block)
    }

    /// Make every completed write durable (a no-op on an export with no volatile cache, which
    /// is what an export that cannot flush says of itself, and when a FLUSH that completed
    /// already covers every write).
    pub fn flush(&mut self, vol: &Volume) -> IoResult<()> {
        let written = vol.writes_done.load(Acquire);
        if !vol.can_flush() || vol.writes_flushed.load(Acquire) >= written {
            return Ok(());
        }
        // Someone waits on every flush (fsync, a journal commit): it leaves at once, with
        // whatever the open caravan holds, rather than wait for the caravan to fill.
        self.request(Opcode::Flush, ReqFlags::NO_DELAY, 0, 0)?;
        // Every write counted in `written` completed before this FLUSH was sent.
        vol.writes_flushed.fetch_max(written, Release);
        Ok(())
    }

    /// Make `len` bytes at `offset` read back as zeroes (`fallocate` punch-hole and
    /// zero-range): whole blocks with WRITE_ZEROES, partial blocks at the edges by
    /// read-modify-write. Clipped to the export.
    pub fn zero(&mut self, vol: &Volume, offset: u64, len: u64) -> IoResult<()> {
        if vol.read_only {
            return Err(IoError::ReadOnly);
        }
        if !vol.can_zero() {
            return Err(IoError::CannotZero);
        }
        let end = offset.saturating_add(len).min(vol.size_bytes());
        if offset >= end {
            return Ok(());
        }
        let block = vol.block_bytes;
        let (whole_start, whole_end) = (round_up(offset, block), end - end % block);
        let edges = !offset.is_multiple_of(block) || !end.is_multiple_of(block);
        let _held = vol.lock(if edges { EXCLUSIVE } else { SHARED });
        if whole_start >= whole_end {
            // Within one block, or across one boundary with no whole block between.
            self.zero_partial(vol, offset, end)?;
            vol.writes_done.fetch_add(1, Relaxed);
            return Ok(());
        }
        self.zero_partial(vol, offset, whole_start)?;
        let mut pos = whole_start;
        while pos < whole_end {
            let n = (whole_end - pos).min(ZERO_PIECE_BYTES_MAX / block * block);
            self.request(Opcode::WriteZeroes, ReqFlags::empty(), pos, n as usize)?;
            pos += n;
        }
        self.zero_partial(vol, whole_end, end)?;
        vol.writes_done.fetch_add(1, Relaxed);
        Ok(())
    }

    /// Zero `[from, to)`, which lies within partial blocks, by read-modify-write.
    fn zero_partial(&mut self, vol: &Volume, from: u64, to: u64) -> IoResult<()> {
        let block = vol.block_bytes;
        let mut pos = from;
        while pos < to {
            let start = pos - pos % block;
            let n = (to.min(start + block) - pos) as usize;
            let zeroes = std::mem::take(&mut self.zero_block);
            let patched = self.patch_block(
                start,
                block as usize,
                (pos - start) as usize,
                &zeroes[..n],
                ReqFlags::empty(),
            );
            self.zero_block = zeroes;
            patched?;
            pos += n as u64;
        }
        Ok(())
    }

    /// Send one request and wait for its completion. A read lands in the chunk; a write sends
    /// the chunk's first `length` bytes.
    fn request(&mut self, opcode: Opcode, flags: ReqFlags, offset: u64, length: usize) -> IoResult<()> {
        let buf = match opcode {
            Opcode::Read | Opcode::Write => Some(self.take_chunk(length)),
            _ => None,
        };
        self.next_user_data = (self.next_user_data + 1) % USER_DATA_MAX;
        let tag = self.next_user_data;
        if let Err(rejected) = self.handle.submit(opcode, flags, offset, length, buf, tag) {
            self.keep(rejected.buf);
            return Err(rejected.error.into());
        }
        loop {
            self.handle.wait(1, &mut self.done)?;
            let mut status = None;
            for c in self.done.drain(..) {
                if c.user_data == tag {
                    status = Some(c.status);
                }
                // A late completion of an abandoned request brings its buffer home too.
                if let Some(b) = c.buf {
                    if self.chunk.is_none() {
                        self.chunk = Some(b);
                    }
                }
            }
            if let Some(status) = status {
                return if status.is_ok() { Ok(()) } else { Err(initiator::Error::Status(status).into()) };
            }
        }
    }

    /// The chunk, `length` bytes long (its bytes as they stand: a write's data).
    fn take_chunk(&mut self, length: usize) -> Chunk {
        let mut chunk = self.chunk.take().unwrap_or_else(|| {
            // Only after a request timed out with the chunk still out: a new one, once.
            tracing::debug!("request buffer still held by an abandoned request; making another");
            Chunk::new(self.assembled.capacity().max(length))
        });
        chunk.set_len(length);
        chunk
    }

    fn keep(&mut self, buf: Option<Chunk>) {
        if let Some(b) = buf {
            self.chunk = Some(b);
        }
    }

    fn chunk_ref(&self) -> &[u8] {
        self.chunk.as_ref().map_or(&[], |c| c.as_ref())
    }

    fn chunk_mut(&mut self) -> &mut Chunk {
        let capacity = self.assembled.capacity();
        self.chunk.get_or_insert_with(|| Chunk::new(capacity))
    }
}

fn is_aligned(vol: &Volume, offset: u64, len: usize) -> bool {
    offset.is_multiple_of(vol.block_bytes) && (len as u64).is_multiple_of(vol.block_bytes)
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

fn write_flags(vol: &Volume, fua: bool) -> ReqFlags {
    if fua && vol.export.flags.has(ExportFlags::CAN_FUA) {
        ReqFlags::FUA
    } else {
        ReqFlags::empty()
    }
}
