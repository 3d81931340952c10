//! Disk faults for any backend, like nbdkit's `error` and `delay` filters wrapped around a real
//! plugin: seeded EIO on reads, writes and flushes, ENOSPC on writes, and slow completions.
//!
//! A failed write may or may not have reached the medium (half of them are applied before the
//! error is returned), as on a real disk: the simulation's model then accepts either content.
//! Slowness is virtual: each slow operation adds to a debt that the simulated target pays by
//! holding its replies back that long ([`FaultyBackend::take_delay_us`]).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use backend::{Backend, BackendCounters, BackendError, Batch, Capabilities, Extent, Result};

use crate::rng::Rng;

/// How often each fault strikes, per million operations of its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskFaults {
    pub read_error: u32,
    pub write_error: u32,
    pub no_space: u32,
    pub flush_error: u32,
    /// An operation takes up to `slow_max_us` of virtual time.
    pub slow: u32,
    pub slow_max_us: u64,
    /// A READ or WRITE the front end looks ahead at needs device work first (as a flash
    /// volume's pool miss does): its batch waits until the disk lands it, a few steps later.
    pub park: u32,
}

impl DiskFaults {
    pub const NONE: DiskFaults = DiskFaults {
        read_error: 0,
        write_error: 0,
        no_space: 0,
        flush_error: 0,
        slow: 0,
        slow_max_us: 0,
        park: 0,
    };

    pub fn typical() -> DiskFaults {
        DiskFaults {
            read_error: 10_000,
            write_error: 10_000,
            no_space: 5_000,
            flush_error: 20_000,
            slow: 50_000,
            slow_max_us: 2_000,
            park: 200_000,
        }
    }
}

/// A backend that fails and stalls on a seeded schedule.
pub struct FaultyBackend {
    inner: Arc<dyn Backend>,
    faults: DiskFaults,
    rng: Mutex<Rng>,
    delay_us: AtomicU64,
    /// Errors injected so far.
    pub errors: AtomicU64,
    /// Device work started for batches ([`Backend::prepare`]) and not landed yet.
    started: Mutex<Vec<Arc<Batch>>>,
    /// Pieces of device work started so far.
    pub parks: AtomicU64,
    /// Durability started for batches ([`Backend::sync_later`]) and not done yet.
    syncing: Mutex<Vec<Arc<Batch>>>,
    /// FLUSH and FUA requests whose durability was started that way.
    pub syncs_later: AtomicU64,
}

impl FaultyBackend {
    pub fn new(inner: Arc<dyn Backend>, rng: Rng, faults: DiskFaults) -> FaultyBackend {
        FaultyBackend {
            inner,
            faults,
            rng: Mutex::new(rng),
            delay_us: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            started: Mutex::new(Vec::new()),
            parks: AtomicU64::new(0),
            syncing: Mutex::new(Vec::new()),
            syncs_later: AtomicU64::new(0),
        }
    }

    /// Land some of the device work started for batches (each piece with even odds), in
    /// any order: the last piece of a sealed batch wakes its driver.
    pub fn land_some(&self) {
        let mut started = self.started.lock().unwrap_or_else(|e| e.into_inner());
        let mut i = 0;
        while i < started.len() {
            if self.rng().chance(500_000) {
                started.swap_remove(i).done();
            } else {
                i += 1;
            }
        }
        drop(started);
        // Durability started for FLUSH and FUA: a flush each, failed on the flush-error
        // schedule (the driver must then close without sending the replies that waited).
        let mut syncing = self.syncing.lock().unwrap_or_else(|e| e.into_inner());
        let mut i = 0;
        while i < syncing.len() {
            if self.rng().chance(500_000) {
                let batch = syncing.swap_remove(i);
                if self.flush().is_err() {
                    batch.fail();
                }
                batch.done();
            } else {
                i += 1;
            }
        }
    }

    /// Virtual time the operations since the last call took, to be paid by whoever ran them.
    pub fn take_delay_us(&self) -> u64 {
        self.delay_us.swap(0, Relaxed)
    }

    fn rng(&self) -> std::sync::MutexGuard<'_, Rng> {
        self.rng.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Roll for slowness and for an error at `per_million`; the error is `errno`.
    fn roll(&self, per_million: u32, errno: i32) -> Result<()> {
        let mut rng = self.rng();
        if rng.chance(self.faults.slow) {
            let us = rng.range(1, self.faults.slow_max_us.max(1));
            self.delay_us.fetch_add(us, Relaxed);
        }
        if rng.chance(per_million) {
            self.errors.fetch_add(1, Relaxed);
            return Err(BackendError::Io(io::Error::from_raw_os_error(errno)));
        }
        Ok(())
    }

    /// A write-like operation: on an injected error, `apply` may still have run.
    fn write_like(&self, apply: impl FnOnce() -> Result<()>) -> Result<()> {
        let verdict =
            self.roll(self.faults.write_error, libc_eio()).and_then(|()| self.roll(self.faults.no_space, 28));
        if verdict.is_err() {
            if self.rng().chance(500_000) {
                apply()?;
            }
            return verdict;
        }
        apply()
    }
}

const fn libc_eio() -> i32 {
    5
}

impl Backend for FaultyBackend {
    fn kind(&self) -> &'static str {
        "faulty"
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn prepare(&self, _offset: u64, _len: u64, _write: bool, batch: &Arc<Batch>) {
        if self.rng().chance(self.faults.park) {
            batch.add();
            self.parks.fetch_add(1, Relaxed);
            if self.rng().chance(250_000) {
                // Landed before the pass ends (a fast device): the driver learns it from
                // the seal, with no wake.
                batch.done();
                return;
            }
            self.started.lock().unwrap_or_else(|e| e.into_inner()).push(batch.clone());
        }
    }
    fn may_wait(&self) -> bool {
        self.faults.park > 0
    }
    fn syncs_later(&self) -> bool {
        self.faults.park > 0
    }
    fn sync_later(&self, batch: &Arc<Batch>) {
        batch.add();
        self.syncs_later.fetch_add(1, Relaxed);
        if self.rng().chance(250_000) {
            // Done before the pass ends (a quick sync, or one that fails at once): the driver
            // learns it from the seal, with no wake.
            if self.flush().is_err() {
                batch.fail();
            }
            batch.done();
            return;
        }
        self.syncing.lock().unwrap_or_else(|e| e.into_inner()).push(batch.clone());
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.roll(self.faults.read_error, libc_eio())?;
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.write_like(|| self.inner.write_at(buf, offset, fua))
    }
    fn flush(&self) -> Result<()> {
        self.roll(self.faults.flush_error, libc_eio())?;
        self.inner.flush()
    }
    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.write_like(|| self.inner.trim(offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.write_like(|| self.inner.write_zeroes(offset, len, fua))
    }
    fn extents(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        self.inner.extents(offset, len, out)
    }
    fn counters(&self) -> BackendCounters {
        self.inner.counters()
    }
}
