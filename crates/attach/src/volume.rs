//! The export as a file: byte ranges in, block requests out, through the I/O threads.
//!
//! A [`Volume`] is the export seen by every FUSE thread at once: its size and block size, the
//! largest request the target takes, what writes share (the write gate and the flush
//! counters), and one I/O thread per lane with its queue and buffer pool (`io`). Each FUSE
//! thread owns a [`Worker`]: one I/O thread's queue, a spare buffer from its pool, and what the
//! rare paths need (a waiter, a buffer of its own, a buffer to assemble split reads), all made
//! on the thread's first request.
//!
//! Two paths:
//! - The common case, a block-aligned read or write no larger than the largest I/O (all that a
//!   loop device sends), and a flush: `handle_*` copies a write's bytes into the spare buffer,
//!   queues the request with the kernel's reply, and returns. The I/O thread answers the kernel
//!   when the completion arrives; the FUSE thread never waits for the network.
//! - Anything else (misaligned or oversized I/O, read-modify-write, zeroing, FUA on an export
//!   that cannot do it) is cut into aligned requests that the FUSE thread sends one at a time
//!   through the same queue, waiting for each: the blocking [`Worker::read`], [`Worker::write`],
//!   [`Worker::zero`], [`Worker::flush`], which the `handle_*` methods fall back on.
//!
//! The kernel may run writes to one file concurrently (`FOPEN_PARALLEL_DIRECT_WRITES`), so a
//! read-modify-write must not interleave with another write to the same block: aligned writes
//! hold the write gate shared from before they are queued until their completion, and a
//! read-modify-write holds it exclusive, waiting first for the aligned writes in flight to
//! drain (`gate`). Reads take no lock.
//!
//! A FLUSH makes durable every write that completed before the target received it, on any
//! connection (docs/PROTOCOL.md, 7.3). A write is counted done, and only then acknowledged to the
//! kernel, when its completion arrives; an `fsync` arrives after the acknowledgements of the
//! writes it must cover, so its FLUSH, queued then on any lane, covers them.
//!
//! This module knows nothing of FUSE: replies are any [`Reply`]; the adapter in `fs` passes
//! fuser's, and the tests drive the volume directly.

use std::sync::atomic::{
    AtomicU64, AtomicUsize,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use initiator::{Endpoint, ExportFlags, ExportInfo, Lane, LaneConfig, LaneStats, ReqFlags};
use wire::Opcode;

use crate::gate::{ExclusiveHold, SharedGuard, WriteGate};
use crate::io::{Answer, IoThread, Outcome, Queue, Reply, Request, Ticket, Waiter};

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
    #[error("the volume's I/O threads have stopped")]
    Stopped,
    #[error("starting an I/O thread: {0}")]
    Thread(std::io::Error),
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
            IoError::Lane(_) | IoError::Stopped | IoError::Thread(_) => libc::EIO,
            IoError::PastEnd => libc::ENOSPC,
            IoError::ReadOnly => libc::EROFS,
            IoError::CannotZero => libc::EOPNOTSUPP,
        }
    }
}

pub type IoResult<T> = std::result::Result<T, IoError>;

/// What all writes share, with the FUSE threads and the I/O threads alike.
#[derive(Debug, Default)]
pub(crate) struct Writes {
    /// Aligned writes shared, read-modify-writes exclusive (see the module docs).
    pub(crate) gate: WriteGate,
    /// Writes completed, and how many of them the last completed FLUSH covered: a flush with
    /// nothing new to cover (a `close` after reading) is not sent.
    pub(crate) done: AtomicU64,
    pub(crate) flushed: AtomicU64,
}

/// How to reach the export, and the volume's bounds.
#[derive(Debug, Clone)]
pub struct VolumeConfig {
    /// Every lane's configuration.
    pub lane: LaneConfig,
    /// Lanes, each with its I/O thread (0: one per core).
    pub lanes: usize,
    /// Largest READ or WRITE to send: the target's limit, or a lower one (FUSE's); rounded
    /// down to the block size.
    pub io_bytes_max: u32,
    /// Refuse writes even when the export takes them.
    pub read_only: bool,
    /// Buffers of `io_bytes_max` bytes made for each lane at start-up: enough for the requests
    /// the kernel may have in flight plus one spare per FUSE thread, so that no thread waits
    /// for one (more requests than that wait for a buffer to come back).
    pub buffers_per_lane: usize,
    /// Run the I/O threads under `SCHED_BATCH` (see [`crate::AttachConfig::sched_batch`]).
    pub sched_batch: bool,
}

impl VolumeConfig {
    /// One lane per core, `buffers_per_lane` 64, normal scheduling.
    pub fn new(lane: LaneConfig, io_bytes_max: u32) -> VolumeConfig {
        VolumeConfig {
            lane,
            lanes: 0,
            io_bytes_max,
            read_only: false,
            buffers_per_lane: 64,
            sched_batch: false,
        }
    }
}

/// Lanes for a configured count: zero means one per core.
pub fn lane_count(configured: usize) -> usize {
    match configured {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// The export, shared by every FUSE thread; answers go to replies of type `R`.
pub struct Volume<R: Reply> {
    id: u64,
    export: ExportInfo,
    block_bytes: u64,
    /// Largest READ or WRITE the target takes, a multiple of the block size.
    io_bytes_max: usize,
    read_only: bool,
    writes: Arc<Writes>,
    /// One per lane, each served by its I/O thread.
    queues: Vec<Arc<Queue<R>>>,
    io_threads: Mutex<Vec<JoinHandle<()>>>,
    /// The queue the next worker feeds.
    next_queue: AtomicUsize,
}

impl<R: Reply> Volume<R> {
    /// Connect the lanes and start one I/O thread on each.
    pub fn connect(endpoint: &Endpoint, export: &str, config: &VolumeConfig) -> IoResult<Volume<R>> {
        let lanes = (0..lane_count(config.lanes))
            .map(|_| Lane::connect_with(endpoint, export, &config.lane))
            .collect::<Result<Vec<Lane<Chunk>>, _>>()?;
        let info = lanes[0].export().clone();
        let block_bytes = u64::from(info.block_size.max(1));
        let io_bytes_max = u64::from(config.io_bytes_max) / block_bytes * block_bytes;
        if io_bytes_max == 0 {
            return Err(initiator::Error::InvalidArgument("largest I/O below the export's block size").into());
        }
        let mut volume = Volume {
            id: NEXT_VOLUME_ID.fetch_add(1, Relaxed),
            read_only: config.read_only || info.flags.has(ExportFlags::READ_ONLY),
            export: info,
            block_bytes,
            io_bytes_max: io_bytes_max as usize,
            writes: Arc::new(Writes::default()),
            queues: Vec::with_capacity(lanes.len()),
            io_threads: Mutex::new(Vec::with_capacity(lanes.len())),
            next_queue: AtomicUsize::new(0),
        };
        for (i, lane) in lanes.into_iter().enumerate() {
            // A read-only volume never takes a pool buffer for a write, but reads need them all.
            let pool = (0..config.buffers_per_lane.max(1)).map(|_| Chunk::new(volume.io_bytes_max)).collect();
            let queue = Arc::new(Queue::new(lane.queue_depth(), pool).map_err(IoError::Thread)?);
            let name = format!("skiff-io-{i}");
            let thread =
                IoThread::start(lane, queue.clone(), volume.writes.clone(), name, config.sched_batch)
                    .map_err(IoError::Thread)?;
            volume.queues.push(queue);
            volume.io_threads.get_mut().unwrap_or_else(|p| p.into_inner()).push(thread);
        }
        Ok(volume)
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

    /// Lanes (and I/O threads).
    pub fn lanes(&self) -> usize {
        self.queues.len()
    }

    /// Every lane's counters, summed, as their I/O threads last published them.
    pub fn stats(&self) -> LaneStats {
        let mut total = LaneStats::default();
        for q in &self.queues {
            total.add(&q.stats());
        }
        total
    }

    /// How often a thread had to wait for a request buffer or for room in a queue.
    pub fn stalls(&self) -> u64 {
        self.queues.iter().map(|q| q.stalls()).sum()
    }

    /// A worker for the calling thread, on the next I/O thread in turn.
    pub fn worker(&self) -> Worker<R> {
        let queue = self.queues[self.next_queue.fetch_add(1, Relaxed) % self.queues.len()].clone();
        let block = self.block_bytes as usize;
        Worker {
            volume_id: self.id,
            spare: queue.take_buffer(),
            queue,
            waiter: Arc::new(Waiter::default()),
            chunk: Some(Chunk::new(self.io_bytes_max)),
            assembled: Vec::with_capacity(self.io_bytes_max + 2 * block),
            zero_block: vec![0; block].into_boxed_slice(),
        }
    }

    /// Stop the I/O threads, answering whatever is still queued or in flight with an error
    /// (once the FUSE session has ended, nobody waits for it). Later requests fail.
    pub fn stop(&self) {
        for q in &self.queues {
            q.stop();
        }
        let threads = std::mem::take(&mut *self.io_threads.lock().unwrap_or_else(|p| p.into_inner()));
        let joined = !threads.is_empty();
        for t in threads {
            if t.join().is_err() {
                tracing::error!("an I/O thread panicked");
            }
        }
        let stalls = self.stalls();
        if joined && stalls > 0 {
            tracing::info!(
                stalls,
                "threads waited for a request buffer or queue room; a larger in-flight bound avoids it"
            );
        }
    }

    /// A block-aligned range no larger than the largest I/O: one request, the common path.
    fn is_one_request(&self, offset: u64, len: usize) -> bool {
        offset.is_multiple_of(self.block_bytes)
            && (len as u64).is_multiple_of(self.block_bytes)
            && len <= self.io_bytes_max
    }

    /// What is left of a read of `len` at `offset` within the export.
    fn clip_read(&self, offset: u64, len: usize) -> usize {
        len.min(self.size_bytes().saturating_sub(offset) as usize)
    }

    /// What is left of a write of `len` at `offset` within the export, or why it cannot be.
    fn clip_write(&self, offset: u64, len: usize) -> IoResult<usize> {
        if self.read_only {
            return Err(IoError::ReadOnly);
        }
        if offset >= self.size_bytes() {
            return Err(IoError::PastEnd);
        }
        Ok(len.min((self.size_bytes() - offset) as usize))
    }

    /// FUA asked of an export that cannot do it but can flush: the write is followed by a
    /// FLUSH, which the blocking path does.
    fn fua_by_flush(&self, fua: bool) -> bool {
        fua && !self.export.flags.has(ExportFlags::CAN_FUA) && self.can_flush()
    }

    fn write_flags(&self, fua: bool) -> ReqFlags {
        if fua && self.export.flags.has(ExportFlags::CAN_FUA) {
            ReqFlags::FUA
        } else {
            ReqFlags::empty()
        }
    }
}

impl<R: Reply> Drop for Volume<R> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One thread's way to the volume. Not shared: every method takes `&mut self`.
pub struct Worker<R: Reply> {
    volume_id: u64,
    queue: Arc<Queue<R>>,
    /// The next common-path request's buffer, from the queue's pool; the I/O thread returns it
    /// to the pool once the request is answered, and the next push takes another.
    spare: Option<Chunk>,
    /// Where this thread waits on the rare paths.
    waiter: Arc<Waiter>,
    /// The rare paths' request buffer; `None` only while a request is out.
    chunk: Option<Chunk>,
    /// Where a read cut into pieces is put together.
    assembled: Vec<u8>,
    /// One block of zeroes, for the partial blocks at the edges of a range to zero.
    zero_block: Box<[u8]>,
}

impl<R: Reply> Worker<R> {
    /// Whether this worker was made by `volume`.
    pub fn serves(&self, volume: &Volume<R>) -> bool {
        self.volume_id == volume.id
    }

    /// Read up to `len` bytes at `offset` (fewer at the end of the export, none past it) and
    /// answer `reply` with them: from the I/O thread for one aligned request, else here.
    pub fn handle_read(&mut self, vol: &Volume<R>, offset: u64, len: usize, reply: R) {
        let len = vol.clip_read(offset, len);
        if len == 0 {
            return reply.data(&[]);
        }
        if !vol.is_one_request(offset, len) {
            return match self.read(vol, offset, len) {
                Ok(data) => reply.data(data),
                Err(e) => reply.error(e.errno()),
            };
        }
        let Some(mut buf) = self.spare_buffer() else { return reply.error(IoError::Stopped.errno()) };
        buf.set_len(len);
        let ticket =
            Ticket { opcode: Opcode::Read, length: len, answer: Answer::Reply(reply), hold: None, covers: 0 };
        self.queue_request(vol, Request { flags: ReqFlags::empty(), offset, buf: Some(buf), ticket });
    }

    /// Write `data` at `offset` (durable before the answer when `fua`) and answer `reply` with
    /// the bytes written, fewer than given at the end of the export: from the I/O thread for
    /// one aligned request, else here.
    pub fn handle_write(&mut self, vol: &Volume<R>, offset: u64, data: &[u8], fua: bool, reply: R) {
        let len = match vol.clip_write(offset, data.len()) {
            Ok(0) => return reply.written(0),
            Ok(len) => len,
            Err(e) => return reply.error(e.errno()),
        };
        if !vol.is_one_request(offset, len) || vol.fua_by_flush(fua) {
            return match self.write(vol, offset, data, fua) {
                Ok(n) => reply.written(n),
                Err(e) => reply.error(e.errno()),
            };
        }
        let Some(mut buf) = self.spare_buffer() else { return reply.error(IoError::Stopped.errno()) };
        buf.set_len(len);
        buf.as_mut().copy_from_slice(&data[..len]);
        let hold = Some(vol.writes.gate.enter_shared());
        let ticket =
            Ticket { opcode: Opcode::Write, length: len, answer: Answer::Reply(reply), hold, covers: 0 };
        self.queue_request(vol, Request { flags: vol.write_flags(fua), offset, buf: Some(buf), ticket });
    }

    /// Make every write completed so far durable and answer `reply`, from the I/O thread when
    /// a FLUSH is needed (see [`flush`](Self::flush) for when it is not).
    pub fn handle_flush(&mut self, vol: &Volume<R>, reply: R) {
        let written = vol.writes.done.load(Acquire);
        if !vol.can_flush() || vol.writes.flushed.load(Acquire) >= written {
            return reply.ok();
        }
        let ticket = Ticket {
            opcode: Opcode::Flush,
            length: 0,
            answer: Answer::Reply(reply),
            hold: None,
            covers: written,
        };
        // Someone waits on every flush (fsync, a journal commit): it leaves at once.
        self.queue_request(vol, Request { flags: ReqFlags::NO_DELAY, offset: 0, buf: None, ticket });
    }

    /// The spare buffer, or one from the pool (waiting for one if none is free).
    fn spare_buffer(&mut self) -> Option<Chunk> {
        self.spare.take().or_else(|| self.queue.take_buffer())
    }

    /// Queue a common-path request, refilling the spare. If the I/O thread has stopped, the
    /// request is answered here with an error.
    fn queue_request(&mut self, vol: &Volume<R>, request: Request<R>) {
        let Err(refused) = self.queue.push(request, Some(&mut self.spare)) else { return };
        let Request { buf, ticket, .. } = refused;
        if let Some(hold) = ticket.hold {
            vol.writes.gate.leave_shared(hold);
        }
        if let Some(buf) = buf {
            self.spare.get_or_insert(buf);
        }
        if let Answer::Reply(reply) = ticket.answer {
            reply.error(IoError::Stopped.errno());
        }
    }

    /// Read up to `len` bytes at `offset`, waiting for them; fewer at the end of the export,
    /// none past it.
    pub fn read(&mut self, vol: &Volume<R>, offset: u64, len: usize) -> IoResult<&[u8]> {
        let len = vol.clip_read(offset, len);
        if len == 0 {
            return Ok(&[]);
        }
        if vol.is_one_request(offset, len) {
            self.request(Opcode::Read, ReqFlags::empty(), offset, len)?;
            return Ok(self.chunk_ref());
        }
        self.read_pieces(vol, offset, len)?;
        Ok(&self.assembled)
    }

    /// A read that is misaligned or larger than one request: aligned pieces, each copied into
    /// place.
    fn read_pieces(&mut self, vol: &Volume<R>, offset: u64, len: usize) -> IoResult<()> {
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

    /// Write `data` at `offset`, waiting for it; durable before it returns when `fua`. Returns
    /// how many bytes were written: fewer than given at the end of the export.
    pub fn write(&mut self, vol: &Volume<R>, offset: u64, data: &[u8], fua: bool) -> IoResult<usize> {
        let len = vol.clip_write(offset, data.len())?;
        if len == 0 {
            return Ok(0);
        }
        let data = &data[..len];
        let flags = vol.write_flags(fua);
        if vol.is_one_request(offset, len) {
            let _shared = vol.writes.gate.shared();
            self.write_aligned(offset, data, flags)?;
        } else {
            let _exclusive: ExclusiveHold<'_> = vol.writes.gate.enter_exclusive();
            self.write_pieces(vol, offset, data, flags)?;
        }
        vol.writes.done.fetch_add(1, Release);
        if vol.fua_by_flush(fua) {
            // The export cannot make one write durable, but it can make all of them durable.
            self.flush(vol)?;
        }
        Ok(len)
    }

    fn write_aligned(&mut self, offset: u64, data: &[u8], flags: ReqFlags) -> IoResult<()> {
        let chunk = self.chunk_mut();
        chunk.set_len(data.len());
        chunk.as_mut().copy_from_slice(data);
        self.request(Opcode::Write, flags, offset, data.len())
    }

    /// A write that is misaligned or larger than one request, under the exclusive hold: whole
    /// blocks go as they are, partial ones by read-modify-write.
    fn write_pieces(&mut self, vol: &Volume<R>, offset: u64, data: &[u8], flags: ReqFlags) -> IoResult<()> {
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

    /// Make every completed write durable, waiting for it (a no-op on an export with no
    /// volatile cache, which is what an export that cannot flush says of itself, and when a
    /// FLUSH that completed already covers every write).
    pub fn flush(&mut self, vol: &Volume<R>) -> IoResult<()> {
        let written = vol.writes.done.load(Acquire);
        if !vol.can_flush() || vol.writes.flushed.load(Acquire) >= written {
            return Ok(());
        }
        self.request(Opcode::Flush, ReqFlags::NO_DELAY, 0, 0)?;
        // Every write counted in `written` completed before this FLUSH was sent.
        vol.writes.flushed.fetch_max(written, Release);
        Ok(())
    }

    /// Make `len` bytes at `offset` read back as zeroes (`fallocate` punch-hole and
    /// zero-range), waiting for it: whole blocks with WRITE_ZEROES, partial blocks at the
    /// edges by read-modify-write. Clipped to the export.
    pub fn zero(&mut self, vol: &Volume<R>, offset: u64, len: u64) -> IoResult<()> {
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
        let gate = &vol.writes.gate;
        let _held: (Option<SharedGuard<'_>>, Option<ExclusiveHold<'_>>) =
            if edges { (None, Some(gate.enter_exclusive())) } else { (Some(gate.shared()), None) };
        if whole_start >= whole_end {
            // Within one block, or across one boundary with no whole block between.
            self.zero_partial(vol, offset, end)?;
            vol.writes.done.fetch_add(1, Release);
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
        vol.writes.done.fetch_add(1, Release);
        Ok(())
    }

    /// Zero `[from, to)`, which lies within partial blocks, by read-modify-write.
    fn zero_partial(&mut self, vol: &Volume<R>, from: u64, to: u64) -> IoResult<()> {
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

    /// Send one request through the I/O thread and wait for its completion. A read lands in
    /// the chunk; a write sends the chunk's first `length` bytes.
    fn request(&mut self, opcode: Opcode, flags: ReqFlags, offset: u64, length: usize) -> IoResult<()> {
        let buf = match opcode {
            Opcode::Read | Opcode::Write => Some(self.take_chunk(length)),
            _ => None,
        };
        let answer = Answer::Wake(self.waiter.clone());
        let ticket = Ticket { opcode, length, answer, hold: None, covers: 0 };
        if let Err(refused) = self.queue.push(Request { flags, offset, buf, ticket }, None) {
            self.keep(refused.buf);
            return Err(IoError::Stopped);
        }
        let Outcome { result, buf } = self.waiter.wait();
        self.keep(buf);
        Ok(result?)
    }

    /// The chunk, `length` bytes long (its bytes as they stand: a write's data).
    fn take_chunk(&mut self, length: usize) -> Chunk {
        let mut chunk = self.chunk.take().unwrap_or_else(|| {
            // Only if a completion came back without its buffer: a new one, once.
            tracing::debug!("request buffer not returned; making another");
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

impl<R: Reply> Drop for Worker<R> {
    /// The spare goes back to the pool, so that a thread's end costs the pool nothing.
    fn drop(&mut self) {
        if let Some(buf) = self.spare.take() {
            self.queue.give_back(buf);
        }
    }
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}
