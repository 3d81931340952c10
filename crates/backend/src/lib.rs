//! Storage backends: where an export's bytes live.
//!
//! A backend knows nothing of protocols. It offers positional reads and writes, flush, trim and
//! write-zeroes, and answers capability queries (`can_flush`, `can_trim`, ...) so that the
//! engine and the front ends advertise what is true instead of assuming. Requests reaching a
//! backend have already been validated by the engine: in range, aligned to `block_size`, no
//! larger than the negotiated maximum. Backends are shared by all workers (`Send + Sync`) and
//! take no lock on the data path.
//!
//! Implementations: [`ram`] (page-aligned anonymous memory), [`mod@file`] (regular file or block
//! device, `O_DIRECT` where it works, `fdatasync` on flush, `O_DSYNC` writes for FUA) and
//! [`null`] (reads zeroes, discards writes: for measuring protocol overhead).
#![forbid(unsafe_code)]

pub mod cache;
pub mod file;
pub mod locks;
pub mod null;
pub mod ram;
pub mod spec;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

pub use rt::mem::RegionBytes;
pub use spec::{parse_size, BackendSpec, SpecError, BLOCK_BYTES};

/// An error from a backend operation, carrying the OS errno so the engine can map it to a
/// precise wire status.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("operation not supported by this backend")]
    Unsupported,
}

impl BackendError {
    /// The errno closest to this error (EIO when the OS gave none).
    pub fn errno(&self) -> i32 {
        match self {
            BackendError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            BackendError::Unsupported => libc::EOPNOTSUPP,
        }
    }
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// Counters a backend keeps about what it asked of the OS, so tests and stats can show that
/// flush and FUA really reached stable storage.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BackendCounters {
    /// `fdatasync` calls issued (flush, and FUA where no `O_DSYNC` path exists).
    pub syncs: u64,
    /// Writes issued through a synchronous-data path (`O_DSYNC`) for FUA.
    pub dsync_writes: u64,
    /// Reads and writes that went through `O_DIRECT`.
    pub direct_ios: u64,
    /// Reads and writes that went through the page cache.
    pub buffered_ios: u64,
}

/// A run of the volume with one allocation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub len_bytes: u64,
    /// Not allocated: no storage behind it (a file hole, a RAM page never written).
    pub hole: bool,
    /// Reads as zeroes.
    pub zero: bool,
}

/// Append `e` to `out`, merging it into the last extent when their states match.
pub fn push_extent(out: &mut Vec<Extent>, e: Extent) {
    if e.len_bytes == 0 {
        return;
    }
    match out.last_mut() {
        Some(last) if last.hole == e.hole && last.zero == e.zero => last.len_bytes += e.len_bytes,
        _ => out.push(e),
    }
}

/// Operations a backend may or may not support; front ends advertise only what is true.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Flush makes acknowledged writes durable (a no-op where they already are).
    pub flush: bool,
    /// A write can be made durable before it completes.
    pub fua: bool,
    pub trim: bool,
    pub write_zeroes: bool,
    /// Write-zeroes is much cheaper than writing zeroes (NBD's FAST_ZERO asks exactly this).
    pub fast_zero: bool,
}

impl Capabilities {
    pub const ALL: Capabilities =
        Capabilities { flush: true, fua: true, trim: true, write_zeroes: true, fast_zero: true };
}

/// The operations every backend offers. Offsets and lengths are in bytes.
pub trait Backend: Send + Sync {
    /// Short name of the kind, e.g. "ram", "file", "null".
    fn kind(&self) -> &'static str;
    /// Size of the volume in bytes.
    fn size_bytes(&self) -> u64;
    /// Smallest unit of I/O; every request's offset and length are multiples of it.
    fn block_size(&self) -> u32;
    /// True when the export must refuse writes (opened read-only).
    fn is_read_only(&self) -> bool;
    /// What this backend can do beyond reads and writes.
    fn capabilities(&self) -> Capabilities;
    fn can_flush(&self) -> bool {
        self.capabilities().flush
    }
    fn can_fua(&self) -> bool {
        self.capabilities().fua
    }
    fn can_trim(&self) -> bool {
        self.capabilities().trim
    }
    fn can_write_zeroes(&self) -> bool {
        self.capabilities().write_zeroes
    }

    /// Fill `buf` from `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    /// Where `len` bytes from `offset` already lie in memory, so that a sender can hand them
    /// to the kernel without first copying them into a buffer (the RAM backend). `None` means
    /// this backend holds no such memory and `read_at` is the way (the default). The bytes
    /// stay valid as long as the backend; a write that overlaps them meanwhile is an
    /// overlapping in-flight request and leaves them unspecified, as for `read_at`.
    fn read_in_place(&self, offset: u64, len: usize) -> Option<Result<RegionBytes>> {
        let _ = (offset, len);
        None
    }
    /// Where the `len` bytes from `offset` lie in memory now, appended to `out` in order as
    /// pieces that keep them there until the last piece is dropped (a flash volume's page
    /// pool lends its slots), so that a sender hands them to the kernel without copying them
    /// into a buffer first. `Ok(false)`, appending nothing, when they do not all lie in memory
    /// now (the default): `read_at` is the way then. A holder must let go soon (once they are
    /// sent, within its loop pass): lent pages cannot be evicted meanwhile. A write that
    /// overlaps them before they are sent is an overlapping in-flight request and leaves them
    /// unspecified, as for `read_at`.
    fn lend(&self, offset: u64, len: usize, out: &mut Vec<RegionBytes>) -> Result<bool> {
        let _ = (offset, len, out);
        Ok(false)
    }
    /// A descriptor whose bytes at a request's offset are the volume's, read through the page
    /// cache, for a sender that hands them to the socket with `sendfile(2)` (a file export's
    /// `send=sendfile`). `None` (the default): the volume is not a file. The descriptor stays
    /// open as long as the backend.
    fn file_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    /// Write `buf` at `offset`; with `fua`, durable before returning.
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()>;
    /// Make every acknowledged write durable.
    fn flush(&self) -> Result<()>;
    /// Discard a range (its contents become unspecified; RAM and file backends read zeroes).
    fn trim(&self, offset: u64, len: u64) -> Result<()>;
    /// Make a range read as zeroes; with `fua`, durable before returning.
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()>;
    /// Describe how `len` bytes from `offset` are stored, as extents appended to `out` that
    /// cover the range exactly (for NBD's `base:allocation`). The default says "all data",
    /// which is always true; backends that know better report holes and zeroes.
    fn extents(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        let _ = offset;
        push_extent(out, Extent { len_bytes: len, hole: false, zero: false });
        Ok(())
    }
    /// What this backend asked of the OS so far.
    fn counters(&self) -> BackendCounters {
        BackendCounters::default()
    }
    /// Get `offset..offset + len` ready for a read (or, with `write`, a write) that should
    /// not block its caller on a device: start, without waiting, whatever serving it would
    /// wait for (a flash volume's pool misses), counting each on `batch` ([`Batch::add`])
    /// and ending it with [`Batch::done`] from whichever thread sees it finish. A request
    /// served afterwards finds its data in memory, unless something took it away meanwhile,
    /// in which case it is served the ordinary way. The default starts nothing: every
    /// backend but a flash volume serves without waiting on a device it could wait for
    /// asynchronously.
    fn prepare(&self, offset: u64, len: u64, write: bool, batch: &Arc<Batch>) {
        let _ = (offset, len, write, batch);
    }
    /// Whether [`prepare`](Self::prepare) may start anything: a driver that knows it will not
    /// skips looking ahead at the requests it holds.
    fn may_wait(&self) -> bool {
        false
    }
    /// Whether [`sync_later`](Self::sync_later) works here. The default is no: FLUSH and FUA
    /// are waited for in [`flush`](Self::flush) and `write_at`.
    fn syncs_later(&self) -> bool {
        false
    }
    /// Start making every write acknowledged so far durable, without waiting: counted on
    /// `batch` ([`Batch::add`]), ended there with [`Batch::done`] once it is durable, after
    /// [`Batch::fail`] if it could not be made so. The driver holds the replies of the FLUSH
    /// or FUA requests that asked for it until the batch wakes it, and sends none of them if
    /// the batch failed. Only called where [`syncs_later`](Self::syncs_later) says so.
    fn sync_later(&self, batch: &Arc<Batch>) {
        let _ = batch;
    }
}

/// How a driver learns that what a [`Batch`] waited for has landed: called once per batch
/// that waited, from any thread.
pub trait Wake: Send + Sync {
    fn wake(&self, token: u64);
}

/// The [`Wake`] of a [detached](Batch::detached) batch: nobody waits for it.
struct Nobody;

impl Wake for Nobody {
    fn wake(&self, _token: u64) {}
}

/// Device work started for one batch of requests ([`Backend::prepare`]), and who to wake when
/// all of it is done. A driver opens a batch, lets backends add to it, and seals it: a sealed
/// batch with work still going wakes its driver (`wake(token)`) when the last of it ends;
/// a batch whose work all ended before the seal wakes nobody, and the seal says so.
///
/// A batch is reused: opened again only after its wake (or a seal that said `false`).
pub struct Batch {
    /// Work still going, plus one while the batch is open.
    left: AtomicUsize,
    /// Work started since the batch was opened.
    started: AtomicUsize,
    /// Some work that must succeed for the replies waiting on the batch to be true did not
    /// ([`sync_later`](Backend::sync_later)).
    failed: AtomicBool,
    /// A backend had more to start than it could take on now ([`cut_short`](Self::cut_short)).
    short: AtomicBool,
    wake: Arc<dyn Wake>,
    token: u64,
}

impl Batch {
    pub fn new(wake: Arc<dyn Wake>, token: u64) -> Batch {
        Batch {
            left: AtomicUsize::new(0),
            started: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
            short: AtomicBool::new(false),
            wake,
            token,
        }
    }

    /// A batch nobody waits for, whose work is started only to be done sooner (a front end's
    /// look-ahead over requests it may not wait for at all). It is never opened or sealed:
    /// work is added to it at any time, and [`outstanding`](Self::outstanding) counts what
    /// is still going.
    pub fn detached() -> Batch {
        Batch::new(Arc::new(Nobody), 0)
    }

    /// Start collecting work.
    pub fn open(&self) {
        debug_assert_eq!(self.left.load(Ordering::Acquire), 0, "a batch reopened while its work goes on");
        self.started.store(0, Ordering::Relaxed);
        self.failed.store(false, Ordering::Relaxed);
        self.short.store(false, Ordering::Relaxed);
        self.left.store(1, Ordering::Release);
    }

    /// A backend left work it was asked to prepare unstarted (its queue was full): once what
    /// it started has ended, the driver should prepare the same requests again before it runs
    /// them, or they do the rest on its thread.
    pub fn cut_short(&self) {
        self.short.store(true, Ordering::Relaxed);
    }

    /// Whether a backend [cut](Self::cut_short) the batch short; read after the wake.
    pub fn was_cut_short(&self) -> bool {
        self.short.load(Ordering::Relaxed)
    }

    /// Whether a backend [cut](Self::cut_short) the batch short since the last call, and clear
    /// it: for a [detached](Self::detached) batch, which is never opened.
    pub fn take_cut_short(&self) -> bool {
        self.short.swap(false, Ordering::Relaxed)
    }

    /// A piece of work failed in a way the replies waiting on the batch must not hide: call
    /// before its [`done`](Self::done).
    pub fn fail(&self) {
        self.failed.store(true, Ordering::Relaxed);
    }

    /// Whether a piece failed ([`fail`](Self::fail)); read after the wake.
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// A backend started one more piece of work for this batch.
    pub fn add(&self) {
        self.started.fetch_add(1, Ordering::Relaxed);
        self.left.fetch_add(1, Ordering::AcqRel);
    }

    /// One piece of work ended: the last one after the seal wakes the driver.
    pub fn done(&self) {
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.wake.wake(self.token);
        }
    }

    /// Nothing more will be added. Returns whether the driver must wait for its wake: `false`
    /// when nothing was started or everything started has ended already.
    pub fn seal(&self) -> bool {
        self.left.fetch_sub(1, Ordering::AcqRel) != 1
    }

    /// What the wake says.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Pieces of work not yet ended (and the open guard, until [`seal`](Self::seal)): 0 once
    /// sealed and everything ended; a piece ended twice shows as a wrapped count.
    pub fn outstanding(&self) -> usize {
        self.left.load(Ordering::Acquire)
    }

    /// Pieces of work started since [`open`](Self::open).
    pub fn started(&self) -> usize {
        self.started.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch").field("left", &self.left).field("token", &self.token).finish()
    }
}

/// Open a backend from a parsed spec. `read_only` opens files read-only.
pub fn open(spec: &BackendSpec, read_only: bool) -> Result<Arc<dyn Backend>> {
    open_with(spec, read_only, true)
}

/// [`open`]; with `use_direct` false a file is read and written through the page cache only.
pub fn open_with(spec: &BackendSpec, read_only: bool, use_direct: bool) -> Result<Arc<dyn Backend>> {
    Ok(match spec {
        BackendSpec::Ram { size_bytes } => Arc::new(ram::RamBackend::new(*size_bytes, read_only)?),
        BackendSpec::Null { size_bytes } => Arc::new(null::NullBackend::new(*size_bytes, read_only)),
        BackendSpec::File { path } => Arc::new(file::FileBackend::open_with(path, read_only, use_direct)?),
    })
}

#[cfg(test)]
mod batch_tests {
    use std::sync::Mutex;

    use super::*;

    #[derive(Default)]
    struct Woken(Mutex<Vec<u64>>);

    impl Wake for Woken {
        fn wake(&self, token: u64) {
            self.0.lock().unwrap().push(token);
        }
    }

    #[test]
    fn a_batch_wakes_once_after_its_last_piece_and_only_if_sealed_waiting() {
        let woken = Arc::new(Woken::default());
        let batch = Arc::new(Batch::new(woken.clone(), 7));
        // Nothing started: no wait, no wake.
        batch.open();
        assert!(!batch.seal());
        assert!(woken.0.lock().unwrap().is_empty());
        // Two pieces, one ends before the seal, one after: one wake, after the last.
        batch.open();
        batch.add();
        batch.add();
        batch.done();
        assert!(batch.seal());
        assert!(woken.0.lock().unwrap().is_empty());
        batch.done();
        assert_eq!(*woken.0.lock().unwrap(), [7]);
        assert_eq!(batch.started(), 2);
        // Everything ended before the seal: no wait, no wake.
        batch.open();
        batch.add();
        batch.done();
        assert!(!batch.seal());
        assert_eq!(woken.0.lock().unwrap().len(), 1);
        // A failure is told after the wake, and forgotten when the batch opens again.
        batch.open();
        batch.add();
        assert!(batch.seal());
        batch.fail();
        batch.done();
        assert_eq!(woken.0.lock().unwrap().len(), 2);
        assert!(batch.failed());
        batch.open();
        assert!(!batch.failed());
        assert!(!batch.seal());
        // From other threads.
        batch.open();
        let threads: Vec<_> = (0..8)
            .map(|_| {
                batch.add();
                let b = batch.clone();
                std::thread::spawn(move || b.done())
            })
            .collect();
        let waits = batch.seal();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(woken.0.lock().unwrap().len(), if waits { 3 } else { 2 });
    }
}
