//! The flash controller driven over real devices: the array a target serves volumes from.
//!
//! One lock guards the controller (`ctl::Controller`); device I/O happens outside it, but for
//! map leaves the map budget evicted, which are read back under it (docs/FLASH.md, "Memory").
//! A page-pool hit is served under the lock (a 4 KiB copy); a miss marks the page as being
//! fetched, reads it with the lock released, and wakes whoever waited for it. Dirty pages are
//! written back in write groups by a background thread when they pile up, by a writer that
//! finds the pool full, and by FLUSH and FUA, which also wait for every group issued before
//! theirs and then sync the devices. The background thread also cleans segments (reading a
//! victim whole, moving its valid pages in groups of their own) and takes checkpoints.
//!
//! Segments are spread over the devices in turn (segment `s` on device `s mod n`), so
//! consecutive segments, and the streams writing into them, land on different devices.
//!
//! Pool misses can be read without blocking whoever needs them: after
//! [`Array::start_reads`], [`Array::prefetch`] starts the reads a request would wait for on an
//! io_uring (`rt::uring`) and returns at once; a completion thread puts each page in its slot
//! and counts down the request's `backend::Batch`, whose last page wakes the worker that
//! parked the request. Everything else (a miss without a prefetch, write-back, FUA, FLUSH)
//! is synchronous on the calling thread. docs/FLASH.md says what that costs.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use backend::Batch;
use rt::mem::{AlignedBuf, Region};
use rt::uring::{Dest, Reads, RegionDest};

use crate::ckpt;
use crate::ctl::{Access, Ahead, Config, Controller, Counters, Got, GroupPlan, LeafRead, Source, VolId};
use crate::device::{recognise, Device};
use crate::layout::{
    page_crc, ArrayId, CkptPage, CkptRef, Pba, SegmentHeader, SegmentKind, Superblock, CKPT_PAYLOAD, PAGE,
};
use crate::map::{LeafSource, LEAF_PAGES};
use crate::recover::{self, Report};
use crate::FlashError;

/// Pages at the start of every device before its first segment (superblocks, alignment).
pub const DATA_START: u64 = 256;

/// Segment size when none is given: 8 MiB.
pub const SEGMENT_PAGES_DEFAULT: u32 = 2048;

/// Most pool misses read asynchronously at once (`Array::start_reads`'s ring depth is at
/// most this).
pub const READS_DEPTH_MAX: u32 = 256;

/// Most dirty pages one write-back group takes.
const GROUP_PAGES: u32 = 128;

/// Most groups the sync thread writes back for writes waiting for room in the pool, per round
/// (a sixteenth of a 256 MiB pool): the writes go on once it stops, making any room still
/// missing themselves.
const ROOM_GROUPS_MAX: u32 = 32;

/// How many sequence numbers one durable ceiling covers (`Superblock::seq_ceiling`): raised
/// at every open and checkpoint, and when half of it is used.
const SEQ_WINDOW: u64 = 1 << 32;

/// Segments cleaned in a row, without any write-back getting through, before a writer is told
/// the array is full.
const RECLAIM_ROUNDS_MAX: u32 = 8;

/// Most pages one look-ahead device read covers: pages that lie next to each other on a device
/// (a stretch written in one group) are read as one, up to 256 KiB.
const READ_RUN_MAX: usize = 64;

/// Where [`Array::prefetch`]'s reads go.
enum ReadQueue {
    /// The kernel's io_uring, completed by the array's completion thread.
    Ring(Arc<Reads<Landing>>),
    /// Held until the caller lands them ([`Array::land_held`]): the seeded simulator's reads,
    /// which land in the order it draws, between its other operations.
    Held { reads: Mutex<Vec<HeldRead>>, depth: usize },
}

/// A read [`ReadQueue::Held`] keeps: `dest.len()` bytes at page `at` of device `dev`.
struct HeldRead {
    dev: usize,
    at: u64,
    dest: Dest,
    landing: Landing,
}

impl ReadQueue {
    fn depth(&self) -> usize {
        match self {
            ReadQueue::Ring(r) => r.depth(),
            ReadQueue::Held { depth, .. } => *depth,
        }
    }

    fn in_flight(&self) -> usize {
        match self {
            ReadQueue::Ring(r) => r.in_flight(),
            ReadQueue::Held { reads, .. } => reads.lock().unwrap_or_else(|e| e.into_inner()).len(),
        }
    }

    fn room(&self) -> usize {
        self.depth().saturating_sub(self.in_flight())
    }
}

/// A read started by [`Array::prefetch`], and whose batch it counts on.
struct Landing {
    what: Read,
    batch: Arc<Batch>,
}

enum Read {
    /// Pages that lie one after another on a device, from `pba` on, into pool slots `slots`
    /// (one device read for all of them: [`READ_RUN_MAX`] at most).
    Pages { pba: Pba, slots: Vec<u32> },
    /// An evicted map leaf, back from the checkpoint; then the pages of `span` under it are
    /// read in turn.
    Leaf { read: LeafRead, span: Span },
}

/// The pages of a volume a request wants read ahead: `vol`'s `first..=last`, less the pages a
/// write overwrites whole (`whole`: its range of such pages).
#[derive(Debug, Clone, Copy)]
struct Span {
    vol: VolId,
    first: u64,
    last: u64,
    whole: Option<(u64, u64)>,
}

impl Span {
    /// Whether page `vpage` is one the write overwrites whole.
    fn overwritten(&self, vpage: u64) -> bool {
        self.whole.is_some_and(|(from, to)| (from..to).contains(&vpage))
    }
}

/// Pool slots lent to a sender ([`Array::lend`]), kept until it lets go of the last range.
struct Loan {
    array: Arc<Array>,
    slots: Vec<u32>,
}

impl Drop for Loan {
    fn drop(&mut self) {
        self.array.give_back(&self.slots, self.slots.len());
    }
}

/// Take a slot to read page `vpage` of `vol` into ahead of its request: the read to start, if
/// one is needed. `Break`: no slot to be had, or an error; the rest is read the ordinary way.
fn slot_ahead(c: &mut Controller, vol: VolId, vpage: u64) -> ControlFlow<(), Option<(u32, Pba)>> {
    match c.get(vol, vpage, Access::Read) {
        Ok(Got::Fetch { slot, pba }) => ControlFlow::Continue(Some((slot, pba))),
        Ok(Got::Direct(pba)) => {
            c.read_done(pba);
            ControlFlow::Break(())
        }
        Ok(Got::Ready(s)) => {
            c.put(s, false);
            ControlFlow::Continue(None)
        }
        Ok(_) => ControlFlow::Continue(None),
        Err(_) => ControlFlow::Break(()),
    }
}

/// Read page `pba` into `slot`: it joins the last read of `started` when it lies right after
/// that read's pages, in the same segment (so on the same device). Returns whether it took a
/// read of its own.
fn start_or_join(started: &mut Vec<Read>, slot: u32, pba: Pba, segment_pages: u32) -> bool {
    if let Some(Read::Pages { pba: run, slots }) = started.last_mut() {
        let next = *run + slots.len() as Pba;
        if pba == next && !next.is_multiple_of(segment_pages) && slots.len() < READ_RUN_MAX {
            slots.push(slot);
            return false;
        }
    }
    started.push(Read::Pages { pba, slots: vec![slot] });
    true
}

/// Reads of whole pages by PBA through an aligned buffer of its own (recovery, and map leaves
/// read back from the checkpoint).
fn page_reader(devs: &Arc<Vec<Box<dyn Device>>>, geo: Geometry) -> ckpt::PageRead {
    let devs = devs.clone();
    Arc::new(move |pba: Pba, buf: &mut [u8]| -> Result<(), FlashError> {
        let mut scratch = AlignedBuf::new(buf.len())?;
        let (dev, at) = geo.locate(pba);
        devs[dev].read(at, &mut scratch)?;
        buf.copy_from_slice(&scratch);
        Ok(())
    })
}

/// Where each global segment lies.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    segment_pages: u32,
    devices: u32,
    segments_per_device: u32,
}

impl Geometry {
    fn total_segments(&self) -> u32 {
        self.devices * self.segments_per_device
    }

    /// Device and device page of a PBA.
    fn locate(&self, pba: Pba) -> (usize, u64) {
        let seg = pba / self.segment_pages;
        let dev = (seg % self.devices) as usize;
        let local = u64::from(seg / self.devices);
        (dev, DATA_START + local * u64::from(self.segment_pages) + u64::from(pba % self.segment_pages))
    }
}

/// Write `devs` as one new, empty array of segments of `segment_pages` pages. A device that
/// holds an array or a file system is refused unless `force`. Returns the array's id.
pub fn format(devs: &[Box<dyn Device>], segment_pages: u32, force: bool) -> Result<ArrayId, FlashError> {
    if devs.is_empty() || devs.len() > u16::MAX as usize {
        return Err(FlashError::BadSize("an array needs at least one device".into()));
    }
    if !(3..=1 << 20).contains(&segment_pages) {
        return Err(FlashError::BadSize("a segment is 12 KiB to 4 GiB".into()));
    }
    for d in devs {
        if let Some(what) = recognise(d.as_ref())? {
            if !force {
                return Err(FlashError::Device(format!(
                    "{} holds {what}; format it anyway with --force",
                    d.name()
                )));
            }
        }
    }
    let per_device = devs
        .iter()
        .map(|d| d.pages().saturating_sub(DATA_START) / u64::from(segment_pages))
        .min()
        .unwrap_or(0)
        .min(u64::from(u32::MAX));
    let geo = Geometry { segment_pages, devices: devs.len() as u32, segments_per_device: per_device as u32 };
    let total = u64::from(geo.devices) * per_device;
    if total < 16 {
        return Err(FlashError::BadSize(format!(
            "{total} segments of {} KiB fit the devices; an array needs at least 16",
            segment_pages as usize * PAGE / 1024
        )));
    }
    if total * u64::from(segment_pages) > u64::from(u32::MAX) {
        return Err(FlashError::BadSize(
            "an array holds at most 2^32 pages (16 TiB): use larger segments or fewer devices".into(),
        ));
    }
    let array: ArrayId = rt::random::bytes()?;
    let created_s =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut page = AlignedBuf::new(PAGE)?;
    for (i, d) in devs.iter().enumerate() {
        let sb = Superblock {
            array,
            device_index: i as u16,
            device_count: devs.len() as u16,
            segment_pages,
            segments: geo.segments_per_device,
            first_segment: i as u32,
            total_segments: geo.total_segments(),
            data_start: DATA_START,
            generation: 1,
            checkpoint: None,
            created_s,
            seq_ceiling: 1,
        };
        // Generation 1 in copy 1; copy 0 invalid. Each later generation g goes to copy g mod 2,
        // never over the copy that holds the current one.
        page.fill(0);
        d.write(0, &page)?;
        sb.emit(&mut page);
        d.write(1, &page)?;
        d.sync()?;
    }
    Ok(array)
}

/// The highest sequence ceiling the devices' superblocks name.
fn superblocks_max_ceiling(ceilings: &[u64]) -> u64 {
    ceilings.iter().copied().max().unwrap_or(0)
}

/// The valid superblock copy with the highest generation on `d`.
fn read_superblock(d: &dyn Device) -> Result<Superblock, FlashError> {
    let mut page = AlignedBuf::new(PAGE)?;
    let mut best: Option<Superblock> = None;
    for p in crate::layout::SUPER_PAGES {
        d.read(p, &mut page)?;
        if let Ok(sb) = Superblock::parse(&page) {
            if best.as_ref().is_none_or(|b| sb.generation > b.generation) {
                best = Some(sb);
            }
        }
    }
    best.ok_or_else(|| {
        FlashError::Device(format!("{} holds no skiff flash array (run `skiff flash format`)", d.name()))
    })
}

/// Pages of groups between checkpoints at most (1 GiB), whatever the array's size.
const CHECKPOINT_SEGMENT_PAGES_MAX: u32 = (1 << 30) / PAGE as u32;

/// What the engine is asked to keep to beyond the controller's configuration.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Write dirty pages back in the background once this many are dirty.
    pub writeback_dirty_min: u32,
    /// Take a checkpoint once this many segments filled since the last one.
    pub checkpoint_every_segments: u32,
}

impl Options {
    fn for_array(cfg: &Config, segments: u32, segment_pages: u32) -> Options {
        Options {
            writeback_dirty_min: (cfg.pool_pages / 4).max(1),
            // An eighth of the array, and at most 1 GiB of groups: recovery replays what
            // follows the checkpoint, reading every data page of it.
            checkpoint_every_segments: (segments / 8)
                .min(CHECKPOINT_SEGMENT_PAGES_MAX / segment_pages.max(1))
                .max(4),
        }
    }
}

/// Figures for `vol stats` and the metrics endpoint.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    pub counters: Counters,
    pub write_amplification: f64,
    pub capacity_bytes: u64,
    pub valid_bytes: u64,
    pub free_segments: u32,
    pub total_segments: u32,
    pub pool_pages: u32,
    pub pool_clean: u32,
    pub pool_dirty: u32,
    pub erase_min: u32,
    pub erase_max: u32,
    /// Bytes of map leaves and per-page side tables in memory (`Config::map_budget` bounds it).
    pub map_bytes: u64,
    /// Leaves in use, and of them in memory; leaves read back from the checkpoint and evicted
    /// since the array was opened.
    pub map_leaves: u64,
    pub map_leaves_resident: u64,
    pub map_loads: u64,
    pub map_evictions: u64,
    /// Of `map_loads`, leaves a request's look-ahead read back on the io_uring.
    pub map_loads_async: u64,
    /// Pages the devices say were written through them.
    pub device_pages_written_measured: u64,
    /// Pool misses read asynchronously ([`Array::prefetch`]) since the array was opened, and
    /// the device reads they took (pages next to each other on a device are read as one).
    pub pages_read_async: u64,
    pub device_reads_async: u64,
    /// Pages a look-ahead found on their way in for someone else, and waited for on its batch
    /// rather than leave its request to wait on the worker ([`Array::prefetch`]).
    pub pages_joined: u64,
    /// Pool pages lent to senders, sent from the pool with no copy ([`Array::lend`]).
    pub pages_lent: u64,
    /// Loans of pool slots not yet given back ([`Array::lend`]).
    pub pool_lends: u32,
    /// FLUSH and FUA requests whose durability the syncer thread provided
    /// ([`Array::sync_later`]), and the syncs it made for them (one serves all it finds queued).
    pub syncs_later: u64,
    pub sync_rounds_later: u64,
    /// Page writes that found no slot to take (every one dirty, pinned or in flight) and
    /// made room themselves: the one place a worker still blocks on device writes.
    pub pool_full_writes: u64,
    /// Writes that parked while the sync thread made room in a (nearly) full pool.
    pub rooms_later: u64,
    pub recovered: Report,
}

/// A volume as `vol list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    pub id: VolId,
    pub name: String,
    pub size_bytes: u64,
    pub allocated_bytes: u64,
    pub writable: bool,
    pub origin: Option<String>,
    pub snapshots: Vec<String>,
}

/// A FLUSH or FUA waiting for the sync thread: the volume (`None`: every one), the pool's
/// dirtying count when it was asked (what it must make durable), the batch to end after.
struct SyncJob {
    vol: Option<VolId>,
    by: u64,
    batch: Arc<Batch>,
}

/// Durability requests and writes waiting for room, for the syncer thread.
#[derive(Default)]
struct SyncQueue {
    jobs: Vec<SyncJob>,
    /// Writes waiting for room in the pool: the pages each needs, and its batch.
    rooms: Vec<(u32, Arc<Batch>)>,
    running: bool,
    stop: bool,
}

/// A flash array, open.
pub struct Array {
    ctl: Mutex<Controller>,
    /// A page, group or sync finished: whoever waits for one looks again.
    changed: Condvar,
    /// Work for the background thread: dirty pages reached the write-back mark, records
    /// wait, or it must stop. (It also looks every 20 ms.) Reads never wake it.
    kick: Condvar,
    /// The page pool's memory: slot `s` is `PAGE` bytes at `s * PAGE`. Shared with the
    /// pages lent to senders ([`lend`](Array::lend)).
    pool: Arc<Region>,
    /// Slots in the pool.
    pool_len: u32,
    devs: Arc<Vec<Box<dyn Device>>>,
    geo: Geometry,
    id: ArrayId,
    superblocks: Mutex<Vec<Superblock>>,
    /// One checkpoint at a time.
    checkpointing: Mutex<()>,
    opts: Options,
    recovered: Report,
    /// Sizes of open volumes, shared with their backends (read on every request).
    sizes: Mutex<HashMap<VolId, Arc<AtomicU64>>>,
    stop: AtomicBool,
    background: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Pool misses read asynchronously, once [`start_reads`](Array::start_reads) (or
    /// [`hold_reads`](Array::hold_reads)) set it up.
    reads: OnceLock<ReadQueue>,
    reader: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Pages [`prefetch`](Array::prefetch) started reading, and the device reads it started
    /// for them (neighbours read as one).
    prefetched: AtomicU64,
    prefetch_reads: AtomicU64,
    /// Batches waiting for pages being read into the pool for someone else, by slot: a
    /// look-ahead that meets such a page counts it on its batch and parks, and the read's
    /// end (async or not) ends it there too ([`Array::fetched`]). Taken under the
    /// controller's lock, so that no read can end between the look and the joining.
    arriving: Mutex<HashMap<u32, Vec<Arc<Batch>>>>,
    /// Slots in `arriving`, changed and read under the controller's lock: a read that ends
    /// while nobody joined one (nearly always) does not take `arriving`'s lock.
    arriving_slots: AtomicUsize,
    pages_joined: AtomicU64,
    pages_lent: AtomicU64,
    /// Pool slots lent to senders now ([`Array::lend`]).
    lent_now: AtomicUsize,
    leaves_read_async: AtomicU64,
    /// FLUSH and FUA durability asked for without waiting ([`sync_later`](Array::sync_later)),
    /// for the syncer thread.
    syncs: Mutex<SyncQueue>,
    /// The sync thread takes work (`running` and not `stop`), read without its lock on every
    /// FLUSH and FUA ([`syncs_later`](Array::syncs_later)).
    syncs_open: AtomicBool,
    /// Requests queued, or the syncer must stop.
    sync_kick: Condvar,
    syncer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Requests [`sync_later`](Array::sync_later) took, and the syncs that served them.
    synced_later: AtomicU64,
    sync_rounds: AtomicU64,
    /// Page writes that found the pool full and wrote back (or waited) on their own thread.
    pool_full_writes: AtomicU64,
    /// Dirty pages in the pool as of the last write or write-back, read without the lock by
    /// [`prefetch`](Array::prefetch) to tell whether a write would find the pool full.
    dirty_hint: AtomicU32,
    /// Writes whose look-ahead found the pool (nearly) full and parked while the sync thread
    /// made room ([`prefetch`](Array::prefetch)).
    rooms_later: AtomicU64,
    /// Segments filled when the last checkpoint began.
    filled_at_checkpoint: AtomicU64,
}

impl Array {
    /// Open the array formatted on `devs` (in any order): check they belong together, then
    /// recover its state. A device of another array, a missing one or one given twice is
    /// refused with a message that names it.
    pub fn open(devs: Vec<Box<dyn Device>>, cfg: Config) -> Result<Arc<Array>, FlashError> {
        let mut found: Vec<(Superblock, Box<dyn Device>)> = Vec::new();
        for d in devs {
            let sb = read_superblock(d.as_ref())?;
            found.push((sb, d));
        }
        let first = found.first().ok_or_else(|| FlashError::BadSize("no devices given".into()))?.0.clone();
        for (sb, d) in &found {
            if sb.array != first.array {
                return Err(FlashError::Device(format!(
                    "{} belongs to another flash array than {}",
                    d.name(),
                    found[0].1.name()
                )));
            }
            if (sb.device_count, sb.segment_pages, sb.segments)
                != (first.device_count, first.segment_pages, first.segments)
            {
                return Err(FlashError::Device(format!(
                    "{}: its superblock disagrees with the others' geometry",
                    d.name()
                )));
            }
        }
        if found.len() != first.device_count as usize {
            let have: Vec<u16> = found.iter().map(|(sb, _)| sb.device_index).collect();
            let missing: Vec<String> =
                (0..first.device_count).filter(|i| !have.contains(i)).map(|i| i.to_string()).collect();
            return Err(FlashError::Device(format!(
                "the array has {} devices, {} given (missing device index {})",
                first.device_count,
                found.len(),
                if missing.is_empty() { "none: one is given twice".into() } else { missing.join(", ") }
            )));
        }
        found.sort_by_key(|(sb, _)| sb.device_index);
        for (i, (sb, d)) in found.iter().enumerate() {
            if sb.device_index as usize != i {
                return Err(FlashError::Device(format!(
                    "{}: device index {} given twice",
                    d.name(),
                    sb.device_index
                )));
            }
        }
        let geo = Geometry {
            segment_pages: first.segment_pages,
            devices: u32::from(first.device_count),
            segments_per_device: first.segments,
        };
        let checkpoint = found.iter().max_by_key(|(sb, _)| sb.generation).and_then(|(sb, _)| sb.checkpoint);
        let found_ceilings: Vec<u64> = found.iter().map(|(sb, _)| sb.seq_ceiling).collect();
        let (superblocks, devs): (Vec<Superblock>, Vec<Box<dyn Device>>) = found.into_iter().unzip();
        let devs = Arc::new(devs);
        let read = page_reader(&devs, geo);
        let started = Instant::now();
        let (mut ctl, report) =
            recover::recover(&first.array, checkpoint, cfg, geo.total_segments(), geo.segment_pages, &read)?;
        // Numbers the last run may have used (groups lost in a crash may still lie on a device)
        // are never used again.
        ctl.next_seq = ctl.next_seq.max(superblocks_max_ceiling(&found_ceilings));
        tracing::info!(
            checkpoint_seq = report.checkpoint_seq,
            groups_replayed = report.groups_replayed,
            pages_read = report.pages_read,
            torn_pages = report.torn_pages,
            ms = started.elapsed().as_millis() as u64,
            "flash array recovered"
        );
        let pool = Arc::new(Region::new(cfg.pool_pages as usize * PAGE)?);
        let opts = Options::for_array(&cfg, geo.total_segments(), geo.segment_pages);
        let pool_len = ctl.pool.len();
        let array = Arc::new(Array {
            pool_len,
            ctl: Mutex::new(ctl),
            changed: Condvar::new(),
            kick: Condvar::new(),
            pool,
            devs,
            geo,
            id: first.array,
            superblocks: Mutex::new(superblocks),
            checkpointing: Mutex::new(()),
            opts,
            recovered: report,
            sizes: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            background: Mutex::new(None),
            reads: OnceLock::new(),
            reader: Mutex::new(None),
            prefetched: AtomicU64::new(0),
            prefetch_reads: AtomicU64::new(0),
            pages_lent: AtomicU64::new(0),
            lent_now: AtomicUsize::new(0),
            leaves_read_async: AtomicU64::new(0),
            syncs: Mutex::new(SyncQueue::default()),
            syncs_open: AtomicBool::new(false),
            sync_kick: Condvar::new(),
            syncer: Mutex::new(None),
            synced_later: AtomicU64::new(0),
            sync_rounds: AtomicU64::new(0),
            pool_full_writes: AtomicU64::new(0),
            dirty_hint: AtomicU32::new(0),
            rooms_later: AtomicU64::new(0),
            filled_at_checkpoint: AtomicU64::new(0),
            arriving: Mutex::new(HashMap::new()),
            arriving_slots: AtomicUsize::new(0),
            pages_joined: AtomicU64::new(0),
        });
        array.raise_ceiling()?;
        let filled = array.lock().space.clock / u64::from(array.geo.segment_pages);
        array.filled_at_checkpoint.store(filled, Ordering::Relaxed);
        // What was replayed is checkpointed at once, so that a crash soon after does not
        // replay it again (and again, crash after crash).
        if array.recovered.groups_replayed > 0 {
            if let Err(e) = array.checkpoint() {
                tracing::warn!(error = %e, "flash: no checkpoint after recovery; the next start replays again");
            }
        }
        Ok(array)
    }

    /// Make a new sequence ceiling durable, `SEQ_WINDOW` past the next number, so that groups
    /// may be handed out up to it.
    fn raise_ceiling(&self) -> Result<(), FlashError> {
        let ceiling = self.lock().next_seq + SEQ_WINDOW;
        self.write_superblocks(|sb| sb.seq_ceiling = sb.seq_ceiling.max(ceiling))?;
        let mut c = self.lock();
        c.seq_ceiling = c.seq_ceiling.max(ceiling);
        Ok(())
    }

    /// Write every device's superblock, changed by `change`, as the next generation (into the
    /// copy that does not hold the current one), then sync.
    fn write_superblocks(&self, mut change: impl FnMut(&mut Superblock)) -> Result<(), FlashError> {
        let mut page = AlignedBuf::new(PAGE)?;
        let mut sbs = self.superblocks.lock().unwrap_or_else(|e| e.into_inner());
        let generation = sbs.iter().map(|s| s.generation).max().unwrap_or(0) + 1;
        for (i, sb) in sbs.iter_mut().enumerate() {
            sb.generation = generation;
            change(sb);
            sb.emit(&mut page);
            self.devs[i].write(generation % 2, &page)?;
        }
        drop(sbs);
        self.sync_all()
    }

    fn lock(&self) -> MutexGuard<'_, Controller> {
        // A panic under the lock is a bug: going on with the state as it is would be no worse
        // than stopping, and the audit in tests catches it.
        self.ctl.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&'a self, g: MutexGuard<'a, Controller>) -> MutexGuard<'a, Controller> {
        if self.held_reads() > 0 {
            // Nothing completes held reads but their caller (the simulator): whoever would
            // wait for one lands them all, in order, as if it waited for the device.
            drop(g);
            while self.land_held(0, false) || self.held_reads() > 0 {}
            return self.lock();
        }
        self.changed.wait_timeout(g, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0
    }

    /// Run the background work (write-back, cleaning, checkpoints) on a thread of its own,
    /// until the array is dropped or `stop` is called.
    pub fn start_background(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let handle = std::thread::Builder::new()
            .name("skiff-flash".into())
            .spawn(move || loop {
                let Some(a) = weak.upgrade() else { return };
                if a.stop.load(Ordering::Acquire) {
                    return;
                }
                match a.background_step() {
                    Ok(true) => continue,
                    Ok(false) => {}
                    Err(e) => tracing::warn!(error = %e, "flash background work failed"),
                }
                let g = a.lock();
                let _ = a.kick.wait_timeout(g, Duration::from_millis(20));
            })
            .expect("spawn the flash thread");
        *self.background.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        self.start_syncer();
    }

    /// Serve [`sync_later`](Self::sync_later) on a thread of its own (`skiff-flash-sync`;
    /// [`start_background`](Self::start_background) starts it too, once per array): it
    /// takes every request queued, makes one [`sync_pages`](Self::sync_pages) cover them all
    /// (a group commit: the volume's if they all name one, the whole array's otherwise), and
    /// ends their batches.
    pub fn start_syncer(self: &Arc<Self>) {
        {
            let mut q = self.syncs.lock().unwrap_or_else(|e| e.into_inner());
            if q.running || q.stop {
                return;
            }
            q.running = true;
            self.syncs_open.store(true, Ordering::Release);
        }
        let weak = Arc::downgrade(self);
        let handle = std::thread::Builder::new()
            .name("skiff-flash-sync".into())
            .spawn(move || loop {
                let Some(a) = weak.upgrade() else { return };
                let jobs = {
                    let mut q = a.syncs.lock().unwrap_or_else(|e| e.into_inner());
                    if q.jobs.is_empty() && q.rooms.is_empty() {
                        if q.stop {
                            q.running = false;
                            return;
                        }
                        let (q, _) = a
                            .sync_kick
                            .wait_timeout(q, Duration::from_millis(100))
                            .unwrap_or_else(|e| e.into_inner());
                        drop(q);
                        continue;
                    }
                    (std::mem::take(&mut q.jobs), std::mem::take(&mut q.rooms))
                };
                let (jobs, rooms) = jobs;
                let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    // Room first: it is bounded, where a sync runs until its volume is clean.
                    if !rooms.is_empty() {
                        a.serve_rooms(&rooms);
                    }
                    if !jobs.is_empty() {
                        a.serve_syncs(&jobs);
                    }
                }));
                if served.is_err() {
                    let held = jobs.into_iter().map(|j| j.batch).chain(rooms.into_iter().map(|r| r.1));
                    a.syncer_died(held);
                    return;
                }
            })
            .expect("spawn the flash sync thread");
        *self.syncer.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
    }

    /// The sync thread panicked serving `taken`: take no more work there (workers sync
    /// themselves from now on), and fail and end every batch it held or that is queued, so
    /// that no connection waits for a wake that would never come.
    fn syncer_died(&self, taken: impl Iterator<Item = Arc<Batch>>) {
        tracing::error!(
            "the flash sync thread failed; FLUSH and FUA are made durable on the workers from now on"
        );
        let mut q = self.syncs.lock().unwrap_or_else(|e| e.into_inner());
        q.running = false;
        self.syncs_open.store(false, Ordering::Release);
        let (jobs, rooms) = (std::mem::take(&mut q.jobs), std::mem::take(&mut q.rooms));
        drop(q);
        let queued = jobs.into_iter().map(|j| j.batch).chain(rooms.into_iter().map(|r| r.1));
        for batch in taken.chain(queued) {
            batch.fail();
            batch.done();
        }
    }

    /// Make what `jobs` ask durable with one sync, then end each batch (failed if it failed).
    fn serve_syncs(&self, jobs: &[SyncJob]) {
        let scope = jobs[0].vol.filter(|v| jobs.iter().all(|j| j.vol == Some(*v)));
        let by = jobs.iter().map(|j| j.by).max();
        let result = self.sync_pages_by(scope, by);
        if let Err(e) = &result {
            tracing::warn!(error = %e, requests = jobs.len(), "flash: a sync for FLUSH or FUA failed");
        }
        self.synced_later.fetch_add(jobs.len() as u64, Ordering::Relaxed);
        self.sync_rounds.fetch_add(1, Ordering::Relaxed);
        for SyncJob { batch, .. } in jobs {
            if result.is_err() {
                batch.fail();
            }
            batch.done();
        }
    }

    /// Write back until the writes in `rooms` would find the pool under its high mark, or
    /// nothing more can be written back (those writes then make room themselves), and end
    /// their batches. A write parked for room never fails for it: its own execution meets any
    /// error.
    fn serve_rooms(&self, rooms: &[(u32, Arc<Batch>)]) {
        let need = rooms.iter().map(|r| r.0).max().unwrap_or(0);
        for _ in 0..ROOM_GROUPS_MAX {
            if !self.pool_short(need) || !matches!(self.writeback_once(GROUP_PAGES, None), Ok(true)) {
                break;
            }
        }
        self.rooms_later.fetch_add(rooms.len() as u64, Ordering::Relaxed);
        for (_, batch) in rooms {
            batch.done();
        }
    }

    /// Whether `pages` more dirty pages would take the pool past its high mark (seven
    /// eighths dirty), by the dirty count of the last write or write-back.
    fn pool_short(&self, pages: u32) -> bool {
        let len = self.pool_len;
        // A write larger than the room above the mark would always look short: it asks for
        // that room only, and makes the rest itself.
        let pages = pages.min(len / 8);
        self.dirty_hint.load(Ordering::Relaxed).saturating_add(pages) > len - len / 8
    }

    /// Whether [`sync_later`](Self::sync_later) hands its work to the syncer thread (once
    /// [`start_background`](Self::start_background) ran, until shutdown).
    pub fn syncs_later(&self) -> bool {
        self.syncs_open.load(Ordering::Acquire)
    }

    /// Queue work for the sync thread with `push`; `false` (nothing queued) when no sync
    /// thread takes work.
    fn enqueue(&self, push: impl FnOnce(&mut SyncQueue)) -> bool {
        let mut q = self.syncs.lock().unwrap_or_else(|e| e.into_inner());
        if !q.running || q.stop {
            return false;
        }
        push(&mut q);
        drop(q);
        self.sync_kick.notify_one();
        true
    }

    /// Make every write to `vol` (`None`: to any volume) acknowledged so far durable without
    /// waiting: counted on `batch` and ended there once durable, after [`Batch::fail`] if it
    /// could not be made so. Without a syncer running, it is done here, before returning.
    pub fn sync_later(&self, vol: Option<VolId>, batch: &Arc<Batch>) {
        batch.add();
        let mut job = Some(SyncJob { vol, by: self.lock().pool.dirtied(), batch: batch.clone() });
        if !self.enqueue(|q| q.jobs.extend(job.take())) {
            self.serve_syncs(&[job.take().expect("not queued")]);
        }
    }

    /// Queue a write of `pages` pages for room in the pool, counted on `batch`. `false`
    /// (nothing queued) without a syncer running.
    fn room_later(&self, pages: u32, batch: &Arc<Batch>) -> bool {
        self.enqueue(|q| {
            batch.add();
            q.rooms.push((pages, batch.clone()));
        })
    }

    /// Stop the syncer once it has served what is queued.
    fn stop_syncer(&self) {
        self.syncs.lock().unwrap_or_else(|e| e.into_inner()).stop = true;
        self.syncs_open.store(false, Ordering::Release);
        self.sync_kick.notify_all();
        if let Some(h) = self.syncer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }

    /// Stop the background thread, write back every dirty page and take a checkpoint, so the
    /// next open has nothing to replay.
    pub fn shutdown(&self) -> Result<(), FlashError> {
        self.stop.store(true, Ordering::Release);
        self.kick.notify_all();
        if let Some(h) = self.background.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
        self.stop_syncer();
        self.stop_reads();
        self.flush()?;
        self.checkpoint()
    }

    /// One round of background work. Returns whether it did something (and more may wait).
    pub fn background_step(&self) -> Result<bool, FlashError> {
        let (dirty, wants_gc, has_pending, ceiling_low) = {
            let c = self.lock();
            (
                c.pool.dirty_count(),
                c.wants_gc(),
                c.has_pending(),
                c.seq_ceiling.saturating_sub(c.next_seq) < SEQ_WINDOW / 2,
            )
        };
        if ceiling_low {
            self.raise_ceiling()?;
            return Ok(true);
        }
        if dirty >= self.opts.writeback_dirty_min || has_pending {
            return self.writeback_once(GROUP_PAGES, None);
        }
        if wants_gc && self.gc_step()? {
            return Ok(true);
        }
        if self.wear_step()? {
            return Ok(true);
        }
        if self.checkpoint_due() {
            self.checkpoint()?;
            return Ok(true);
        }
        Ok(false)
    }

    fn checkpoint_due(&self) -> bool {
        let c = self.lock();
        let filled = c.space.clock / u64::from(self.geo.segment_pages);
        let since = filled.saturating_sub(self.filled_at_checkpoint.load(Ordering::Relaxed));
        since >= u64::from(self.opts.checkpoint_every_segments)
            || (c.wants_gc() && c.gc_victim().is_none() && since > 0)
            // Leaves changed since the last checkpoint stay in memory: past the budget with no
            // other to evict, store them (but not more often than an eighth of the usual).
            || (c.map.over_budget_until_checkpoint()
                && since >= u64::from(self.opts.checkpoint_every_segments / 8).max(1))
    }

    // ---------------------------------------------------------------------------------
    // Device I/O

    fn read_pages(&self, pba: Pba, buf: &mut [u8]) -> Result<(), FlashError> {
        let (dev, at) = self.geo.locate(pba);
        self.devs[dev].read(at, buf)?;
        Ok(())
    }

    fn write_pages(&self, pba: Pba, buf: &[u8]) -> Result<(), FlashError> {
        let (dev, at) = self.geo.locate(pba);
        self.devs[dev].write(at, buf)?;
        Ok(())
    }

    /// Sync every device. A failed sync fails the array: the kernel may have dropped the
    /// writes it could not store, and a later sync that succeeds would vouch for them.
    fn sync_all(&self) -> Result<(), FlashError> {
        for d in self.devs.iter() {
            if let Err(e) = d.sync() {
                self.lock().failed = true;
                self.changed.notify_all();
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Read pool misses asynchronously from now on: an io_uring of `depth` reads and a
    /// completion thread. Returns `Ok(false)`, and reads stay synchronous, when a device has
    /// no file descriptor (a device in memory) or the kernel refuses io_uring.
    pub fn start_reads(self: &Arc<Self>, depth: u32) -> Result<bool, FlashError> {
        if self.devs.iter().any(|d| d.fd().is_none()) {
            return Ok(false);
        }
        let reads = match Reads::new(depth.min(READS_DEPTH_MAX)) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                tracing::warn!(error = %e, "io_uring unavailable: flash pool misses are read on the worker's thread");
                return Ok(false);
            }
        };
        if self.reads.set(ReadQueue::Ring(reads.clone())).is_err() {
            return Ok(true);
        }
        let weak = Arc::downgrade(self);
        let handle = std::thread::Builder::new()
            .name("skiff-flash-rd".into())
            .spawn(move || loop {
                let array = weak.clone();
                let landed = |landing: Landing, result: std::io::Result<()>, dest: Dest| match array.upgrade()
                {
                    Some(a) => a.landed(landing, result, Some(dest)),
                    // The array is gone: nobody waits for its pool, but a driver may wait
                    // for the batch.
                    None => landing.batch.done(),
                };
                match reads.complete(landed) {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(e) => {
                        tracing::error!(error = %e, "flash read completions failed; stopping them");
                        return;
                    }
                }
            })
            .map_err(FlashError::from)?;
        *self.reader.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(true)
    }

    /// Read pool misses ahead from now on into a queue nothing completes until the caller
    /// lands its reads ([`land_held`](Self::land_held)), each reading the devices when it
    /// lands, as the kernel may at any moment before a read completes. For the seeded
    /// simulator, which draws when each read lands among its other operations. A thread that
    /// would wait for such a read lands every held read first. Returns `false` if reads are
    /// already set up.
    pub fn hold_reads(&self, depth: u32) -> bool {
        let depth = depth.clamp(1, READS_DEPTH_MAX) as usize;
        self.reads.set(ReadQueue::Held { reads: Mutex::new(Vec::new()), depth }).is_ok()
    }

    /// Reads held by [`hold_reads`](Self::hold_reads)'s queue, not yet landed.
    pub fn held_reads(&self) -> usize {
        match self.reads.get() {
            Some(ReadQueue::Held { reads, .. }) => reads.lock().unwrap_or_else(|e| e.into_inner()).len(),
            _ => 0,
        }
    }

    /// Land held read `i` (of [`held_reads`](Self::held_reads)): read its pages from the
    /// devices now, or fail it (`fail`), and end it as a completion does. Returns whether the
    /// device read succeeded; `false` too if there is no such read.
    pub fn land_held(&self, i: usize, fail: bool) -> bool {
        let Some(ReadQueue::Held { reads, .. }) = self.reads.get() else { return false };
        let held = {
            let mut reads = reads.lock().unwrap_or_else(|e| e.into_inner());
            if i >= reads.len() {
                return false;
            }
            reads.remove(i)
        };
        let HeldRead { dev, at, mut dest, landing } = held;
        let result = if fail {
            Err(std::io::Error::from_raw_os_error(libc::EIO))
        } else {
            match &mut dest {
                Dest::Buf(buf) => self.devs[dev].read(at, buf),
                Dest::Region(slots) => AlignedBuf::new(slots.len())
                    .and_then(|mut buf| self.devs[dev].read(at, &mut buf).map(|()| slots.scatter(&buf))),
            }
        };
        let ok = result.is_ok();
        self.landed(landing, result, Some(dest));
        ok
    }

    /// Stop the completion thread once the reads in flight have landed.
    fn stop_reads(&self) {
        if let Some(ReadQueue::Ring(reads)) = self.reads.get() {
            let _ = reads.close();
        }
        if let Some(h) = self.reader.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }

    /// Whether [`prefetch`](Self::prefetch) reads asynchronously.
    pub fn reads_async(&self) -> bool {
        self.reads.get().is_some()
    }

    /// Start reading, without waiting, the pages of `vol` that a read of `len` bytes at
    /// `offset` (with `write`, a write: only its partial first and last pages) would fetch
    /// from flash, neighbours on a device as one read, each read counted on `batch` and ended
    /// there when its pages have landed in the pool. A page already on its way in for someone
    /// else is counted on `batch` too, and ended there when that read ends. Pages in the pool
    /// or never written are left alone; so is the rest of the range once the pool or the ring
    /// has no room (the request then reads those the ordinary way). Does nothing before
    /// [`start_reads`](Self::start_reads) or [`hold_reads`](Self::hold_reads).
    pub fn prefetch(&self, vol: VolId, offset: u64, len: u64, write: bool, batch: &Arc<Batch>) {
        let Some(reads) = self.reads.get() else { return };
        if len == 0 {
            return;
        }
        let page = PAGE as u64;
        let Some(end) = offset.checked_add(len) else { return };
        let (first, last) = (offset / page, (end - 1) / page);
        // A write's whole pages are not read (its partial first and last are).
        let whole = write.then(|| (offset.div_ceil(page), end / page));
        if write {
            let pages = u32::try_from(last - first + 1).unwrap_or(u32::MAX);
            if self.pool_short(pages) && self.room_later(pages, batch) {
                // The write would find the pool full and write back on its worker: the sync
                // thread makes room while the request waits parked.
                return;
            }
            if offset.is_multiple_of(page) && end.is_multiple_of(page) {
                // Whole pages: a write fills them without reading anything.
                return;
            }
        }
        let mut started = Vec::new();
        let span = Span { vol, first, last, whole };
        self.read_ahead(&mut self.lock(), reads, span, true, batch, &mut started);
        self.start(reads, started, batch);
    }

    /// Under the controller's lock (`c`), the reads of `span`'s pages that are neither in the
    /// pool nor never written, appended to `started` (neighbours on a device as one read), each
    /// to count on `batch`; a page on its way in for someone else is joined. An evicted map leaf
    /// is read first, and the pages under it once it is back ([`landed`](Self::landed)), when
    /// `leaves` says so; else those pages are left alone. Stops, cutting `batch` short, once the
    /// ring has no room: how much it has is asked of `reads` only once a page needs a read, so
    /// a request served from the pool never touches the ring's lock.
    fn read_ahead(
        &self,
        c: &mut Controller,
        reads: &ReadQueue,
        span: Span,
        leaves: bool,
        batch: &Arc<Batch>,
        started: &mut Vec<Read>,
    ) {
        let mut room: Option<usize> = None;
        let mut vpage = span.first;
        while vpage <= span.last {
            let this = vpage;
            vpage += 1;
            let ahead = if span.overwritten(this) { Ahead::Nothing } else { c.ahead(span.vol, this) };
            match ahead {
                Ahead::Nothing => continue,
                Ahead::Leaf(_) if !leaves => continue,
                Ahead::Arriving(slot) => {
                    self.join(c, slot, batch);
                    continue;
                }
                Ahead::Page | Ahead::Leaf(_) => {}
            }
            let room = room.get_or_insert_with(|| reads.room());
            if *room == 0 {
                // The rest once these have landed: the driver looks ahead again.
                batch.cut_short();
                break;
            }
            let new_read = match ahead {
                Ahead::Arriving(_) | Ahead::Nothing => unreachable!("taken above"),
                Ahead::Leaf(read) => {
                    // The leaf first; the pages under it go once it is back (`landed`).
                    let until = span.last.min((this / LEAF_PAGES as u64 + 1) * LEAF_PAGES as u64 - 1);
                    vpage = until + 1;
                    started.push(Read::Leaf { read, span: Span { first: this, last: until, ..span } });
                    true
                }
                Ahead::Page => match slot_ahead(c, span.vol, this) {
                    ControlFlow::Continue(Some((slot, pba))) => {
                        start_or_join(started, slot, pba, self.geo.segment_pages)
                    }
                    ControlFlow::Continue(None) => continue,
                    ControlFlow::Break(()) => break,
                },
            };
            if new_read {
                *room -= 1;
            }
        }
    }

    /// Put `started` on the ring, each counting on `batch`, and submit them.
    fn start(&self, reads: &ReadQueue, started: Vec<Read>, batch: &Arc<Batch>) {
        if started.is_empty() {
            return;
        }
        for what in started {
            let (pba, pages) = match &what {
                Read::Pages { pba, slots } => {
                    self.prefetched.fetch_add(slots.len() as u64, Ordering::Relaxed);
                    self.prefetch_reads.fetch_add(1, Ordering::Relaxed);
                    (*pba, slots.len() as u32)
                }
                Read::Leaf { read, .. } => (read.pba, read.pages),
            };
            let (dev, at) = self.geo.locate(pba);
            // Pages land straight in their slots (pinned and `Fetching`: nobody else touches
            // their bytes until they are marked clean); a leaf in a buffer, to be decoded.
            let dest = match &what {
                Read::Pages { slots, .. } => Ok(Dest::Region(RegionDest::new(
                    &self.pool,
                    slots.iter().map(|&s| (s as usize * PAGE, PAGE)),
                ))),
                Read::Leaf { .. } => AlignedBuf::new(pages as usize * PAGE).map(Dest::Buf),
            };
            batch.add();
            let landing = Landing { what, batch: batch.clone() };
            let dest = match dest {
                Ok(dest) => dest,
                Err(e) => {
                    self.landed(landing, Err(e), None);
                    continue;
                }
            };
            match reads {
                ReadQueue::Ring(ring) => {
                    let fd = self.devs[dev].fd().expect("start_reads checked every device has one");
                    if let Err((e, dest, landing)) = ring.push(fd, at * PAGE as u64, dest, landing) {
                        self.landed(landing, Err(e), Some(dest));
                    }
                }
                ReadQueue::Held { reads, .. } => {
                    reads.lock().unwrap_or_else(|e| e.into_inner()).push(HeldRead { dev, at, dest, landing });
                }
            }
        }
        if let ReadQueue::Ring(ring) = reads {
            if let Err(e) = ring.submit() {
                // What is queued goes with the completion thread's next wait.
                tracing::debug!(error = %e, "io_uring submit failed; the completion thread submits");
            }
        }
    }

    /// Count `batch` on the read bringing `slot` in for someone else, and end it there when
    /// that read ends: the request waits for it parked, rather than on the worker when it
    /// runs. Under the controller's lock (`_c`), so the read cannot end before `batch` is on
    /// its list.
    fn join(&self, _c: &Controller, slot: u32, batch: &Arc<Batch>) {
        batch.add();
        let mut arriving = self.arriving.lock().unwrap_or_else(|p| p.into_inner());
        let waiting = arriving.entry(slot).or_default();
        if waiting.is_empty() {
            self.arriving_slots.fetch_add(1, Ordering::Relaxed);
        }
        waiting.push(batch.clone());
        self.pages_joined.fetch_add(1, Ordering::Relaxed);
    }

    /// A read [`prefetch`](Array::prefetch) started landed (or failed: a page leaves the pool,
    /// and whoever needs it reads it the ordinary way, meeting the error there if it lasts; a
    /// leaf stays evicted, and is read back the ordinary way).
    fn landed(&self, landing: Landing, result: std::io::Result<()>, mut dest: Option<Dest>) {
        let Landing { what, batch } = landing;
        if let Err(e) = &result {
            if e.kind() != std::io::ErrorKind::WouldBlock {
                tracing::warn!(error = %e, "flash prefetch failed");
            }
        }
        match what {
            Read::Pages { pba, slots } => {
                // The pages are in their slots already (`start`); a failed read may have
                // written some of them in part, and its slots are given up.
                let ok = result.is_ok();
                let mut joined = Vec::new();
                {
                    let mut c = self.lock();
                    for (&slot, pba) in slots.iter().zip(pba..) {
                        joined.extend(self.fetched(&mut c, slot, pba, ok).into_iter().flatten());
                        c.put(slot, false);
                    }
                }
                self.changed.notify_all();
                joined.into_iter().for_each(|b| b.done());
            }
            Read::Leaf { read, span } => {
                let mut next = Vec::new();
                let reads = self.reads.get();
                {
                    let mut c = self.lock();
                    let buf: &mut [u8] = match &mut dest {
                        Some(Dest::Buf(buf)) => buf,
                        _ => &mut [],
                    };
                    let back = result.is_ok() && c.leaf_landed(&read, buf).unwrap_or_else(|e| {
                        tracing::warn!(error = %e, leaf = read.id, "flash: a map leaf read back asynchronously fails its checks");
                        false
                    });
                    if back {
                        c.shed();
                        self.leaves_read_async.fetch_add(1, Ordering::Relaxed);
                    }
                    // The pages under the leaf, whether this read put it back or another did
                    // meanwhile (two look-aheads met the same evicted leaf, and the other
                    // started the pages' reads: this batch joins them). The leaf's own read has
                    // left the ring: they take what is free, and the rest waits for the
                    // driver's next round. A leaf evicted again is left to the request.
                    if let Some(reads) = reads.filter(|_| result.is_ok()) {
                        self.read_ahead(&mut c, reads, span, false, &batch, &mut next);
                    }
                }
                if let Some(reads) = self.reads.get() {
                    self.start(reads, next, &batch);
                }
            }
        }
        batch.done();
    }

    /// Carry out a `Got::Fetch`: read `pba` into `slot` without the lock, then take it again
    /// and tell the controller.
    fn fetch_unlocked<'a>(
        &'a self,
        c: MutexGuard<'a, Controller>,
        slot: u32,
        pba: Pba,
    ) -> (MutexGuard<'a, Controller>, Result<(), FlashError>) {
        drop(c);
        let result = self.fetch(slot, pba);
        let mut c = self.lock();
        // Ending a batch only counts it down and perhaps wakes its driver: nothing there takes
        // the controller's lock.
        self.fetched(&mut c, slot, pba, result.is_ok()).into_iter().flatten().for_each(|b| b.done());
        (c, result)
    }

    /// Tell the controller the read into `slot` ended (`ok`: with the page), and take the
    /// batches that were waiting for it ([`arriving`](Self::arriving)), to end.
    fn fetched(&self, c: &mut Controller, slot: u32, pba: Pba, ok: bool) -> Option<Vec<Arc<Batch>>> {
        c.fetched(slot, pba, ok);
        // `c` holds the controller's lock, which orders this load after every join.
        if self.arriving_slots.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let waiting = self.arriving.lock().unwrap_or_else(|p| p.into_inner()).remove(&slot)?;
        self.arriving_slots.fetch_sub(1, Ordering::Relaxed);
        Some(waiting)
    }

    /// Read `pba` into pool slot `slot`.
    fn fetch(&self, slot: u32, pba: Pba) -> Result<(), FlashError> {
        let mut page = AlignedBuf::new(PAGE)?;
        self.read_pages(pba, &mut page)?;
        self.pool.write_at(slot as usize * PAGE, &page);
        Ok(())
    }

    /// A group's data pages, copied from their sources into a buffer after room for the
    /// header. Pool pages must be copied under the controller's lock: a writer may take a
    /// page being written back (and dirty it again) as soon as the lock is free, and a copy
    /// torn by its bytes would carry a CRC that vouches for them.
    fn gather(&self, plan: &GroupPlan, image: Option<&[u8]>) -> Result<AlignedBuf, FlashError> {
        let mut buf = AlignedBuf::new((1 + plan.sources.len()) * PAGE)?;
        let pool = &self.pool;
        for (i, src) in plan.sources.iter().enumerate() {
            let page = &mut buf[(1 + i) * PAGE..(2 + i) * PAGE];
            match *src {
                Source::Slot(s) => pool.read_at(s as usize * PAGE, page),
                Source::Image(at) => {
                    page.copy_from_slice(&image.expect("a GC group has its image")[at..at + PAGE])
                }
            }
        }
        Ok(buf)
    }

    /// Write a gathered group: its data pages' CRCs into the header, the header, and a new
    /// segment's header first if the group opened one.
    fn write_group(&self, plan: &mut GroupPlan, mut buf: AlignedBuf) -> Result<(), FlashError> {
        let crcs: Vec<u32> =
            (0..plan.sources.len()).map(|i| page_crc(&buf[(1 + i) * PAGE..(2 + i) * PAGE])).collect();
        plan.set_crcs(&crcs);
        plan.header.emit(&self.id, &mut buf[..PAGE]);
        tracing::trace!(
            seq = plan.seq,
            segment = plan.header.segment,
            pba = plan.pba,
            opened = plan.opened.is_some(),
            records = plan.header.records.len(),
            "flash: write group"
        );
        if let Some(h) = plan.opened {
            let mut page = AlignedBuf::new(PAGE)?;
            h.emit(&self.id, &mut page);
            self.write_pages(h.segment * self.geo.segment_pages, &page)?;
        }
        self.write_pages(plan.pba, &buf)
    }

    /// Tell the controller group `plan` was written (`ok`) or not, and return its lock. The
    /// evicted map leaves mapping it will change are read back first, without the lock, so
    /// that nobody waits for those reads; one evicted meanwhile is read under the lock.
    fn group_written(&self, plan: &GroupPlan, ok: bool) -> MutexGuard<'_, Controller> {
        let reads = if ok { self.lock().evicted_leaves_of(plan) } else { Vec::new() };
        let mut landed = Vec::with_capacity(reads.len());
        for read in reads {
            let Ok(mut buf) = AlignedBuf::new(read.pages as usize * PAGE) else { continue };
            if self.read_pages(read.pba, &mut buf).is_ok() {
                landed.push((read, buf));
            }
        }
        let mut c = self.lock();
        for (read, mut buf) in landed {
            if let Err(e) = c.leaf_landed(&read, &mut buf) {
                tracing::warn!(error = %e, leaf = read.id, "flash: a map leaf read back fails its checks");
            }
        }
        c.written(plan.seq, ok);
        c
    }

    /// Write back one group of up to `max` dirty pages (of `only_vol`, if given) and any
    /// waiting records. Returns whether there was one.
    fn writeback_once(&self, max: u32, only_vol: Option<VolId>) -> Result<bool, FlashError> {
        let (plan, gathered) = {
            let mut c = self.lock();
            let Some(plan) = c.writeback(max, only_vol) else { return Ok(false) };
            let gathered = self.gather(&plan, None);
            (plan, gathered)
        };
        let mut plan = plan;
        let result = gathered.and_then(|buf| self.write_group(&mut plan, buf));
        let c = self.group_written(&plan, result.is_ok());
        self.dirty_hint.store(c.pool.dirty_count(), Ordering::Relaxed);
        drop(c);
        self.changed.notify_all();
        result.map(|()| true)
    }

    /// Every group issued so far has completed; sync, so they are durable.
    fn make_durable(&self) -> Result<(), FlashError> {
        let target = {
            let mut c = self.lock();
            let target = c.last_seq();
            while c.completed_seq() < target {
                if c.failed {
                    return Err(FlashError::Failed);
                }
                c = self.wait(c);
            }
            target
        };
        self.sync_all()?;
        self.lock().durable(target);
        self.changed.notify_all();
        Ok(())
    }

    /// Write back every dirty page (of `only_vol`) and waiting record, then make them
    /// durable. A page another user holds pinned, or is writing back, is waited for: the
    /// write acknowledged before the call must be on flash when it returns. Out of space, it
    /// cleans (taking a checkpoint first if nothing can be cleaned yet); `NoSpace` when that
    /// frees nothing.
    fn sync_pages(&self, only_vol: Option<VolId>) -> Result<(), FlashError> {
        self.sync_pages_by(only_vol, None)
    }

    /// [`sync_pages`](Self::sync_pages) for the pages dirtied up to the pool's dirtying count
    /// `by` (`None`: all): what was acknowledged before a FLUSH or FUA asked at `by`. Pages
    /// that writers keep dirtying meanwhile cannot keep it going for ever.
    fn sync_pages_by(&self, only_vol: Option<VolId>, by: Option<u64>) -> Result<(), FlashError> {
        let mut fruitless = 0;
        loop {
            if self.writeback_once(GROUP_PAGES, only_vol)? {
                fruitless = 0;
                continue;
            }
            let (dirty, busy, pending, failed) = {
                let c = self.lock();
                let (dirty, busy) = c.pool.dirty_of(only_vol, by);
                (dirty, busy, c.has_pending(), c.failed)
            };
            if failed {
                return Err(FlashError::Failed);
            }
            if dirty == 0 && !pending {
                break;
            }
            if dirty > 0 && dirty == busy {
                // Pinned by writers or already on their way: wait for them.
                drop(self.wait(self.lock()));
                continue;
            }
            // Dirty pages that could be written and were not: no space to write them to.
            // Cleaning may win too little for a user stream; give up after a few rounds.
            fruitless += 1;
            if fruitless > RECLAIM_ROUNDS_MAX || !self.reclaim()? {
                return Err(FlashError::NoSpace);
            }
        }
        self.make_durable()
    }

    /// Free a segment: clean one, or take a checkpoint so that one may be cleaned, then clean.
    /// Returns whether a segment was cleaned.
    fn reclaim(&self) -> Result<bool, FlashError> {
        if self.gc_step()? {
            return Ok(true);
        }
        self.checkpoint()?;
        self.gc_step()
    }

    /// Make room in the pool: write back a group; failing that, wait for pinned pages, or free
    /// a segment to write to. `NoSpace` when the array is full of valid data.
    fn make_room(&self) -> Result<(), FlashError> {
        if self.writeback_once(GROUP_PAGES, None)? {
            return Ok(());
        }
        let (dirty, busy) = self.lock().pool.dirty_of(None, None);
        if dirty == 0 || dirty == busy {
            // Everything is pinned or in flight: wait for a holder to let go.
            drop(self.wait(self.lock()));
            return Ok(());
        }
        for _ in 0..RECLAIM_ROUNDS_MAX {
            if !self.reclaim()? {
                break;
            }
            if self.writeback_once(GROUP_PAGES, None)? {
                return Ok(());
            }
        }
        Err(FlashError::NoSpace)
    }

    // ---------------------------------------------------------------------------------
    // Cleaning and checkpoints

    /// Clean one segment, if one is worth it. Returns whether it did.
    pub fn gc_step(&self) -> Result<bool, FlashError> {
        let Some(victim) = self.lock().gc_victim() else { return Ok(false) };
        self.clean(victim)
    }

    /// Clean the least-worn full segment, if wear calls for it (static wear levelling).
    /// Returns whether it did.
    pub fn wear_step(&self) -> Result<bool, FlashError> {
        let victim = {
            let mut c = self.lock();
            let Some(victim) = c.wear_victim() else { return Ok(false) };
            c.counters.wear_segments_moved += 1;
            victim
        };
        self.clean(victim)
    }

    /// Move the valid pages of `victim` elsewhere and release it.
    fn clean(&self, victim: u32) -> Result<bool, FlashError> {
        let spp = self.geo.segment_pages as usize;
        let mut image = AlignedBuf::new(spp * PAGE)?;
        self.read_pages(victim * self.geo.segment_pages, &mut image)?;
        let moves = self.lock().gc_scan(victim, &image, &self.id);
        let mut moves = match moves {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(segment = victim, error = %e, "flash: a segment cannot be cleaned; it stays as it is");
                self.lock().space.segs[victim as usize].last_seq = u64::MAX;
                return Ok(false);
            }
        };
        let mut last = 0;
        while !moves.is_empty() {
            let plan = self.lock().gc_writeback(&mut moves);
            let Some(mut plan) = plan else { return Err(FlashError::NoSpace) };
            let result = self.gather(&plan, Some(&image)).and_then(|buf| self.write_group(&mut plan, buf));
            drop(self.group_written(&plan, result.is_ok()));
            self.changed.notify_all();
            result?;
            last = plan.seq;
        }
        {
            let mut c = self.lock();
            if c.failed {
                // A move's group may be written but not mapped (a leaf could not be read back):
                // the victim still holds those pages.
                return Err(FlashError::Failed);
            }
            let last = if last == 0 { c.last_seq() } else { last };
            c.gc_done(victim, last);
        }
        self.make_durable()?;
        Ok(true)
    }

    /// Write a checkpoint of the whole state, so that recovery replays only what follows it
    /// and segments written before it may be cleaned.
    ///
    /// The state is taken under the lock (the map's leaves in memory copied, evicted ones
    /// named where the current checkpoint stores them) and written without it, evicted leaves
    /// read back one at a time. Once it is durable, every leaf unchanged since is stored in
    /// it, and evicted leaves come back from it.
    pub fn checkpoint(&self) -> Result<(), FlashError> {
        let _one = self.checkpointing.lock().unwrap_or_else(|e| e.into_inner());
        let spp = self.geo.segment_pages;
        let (enc, seq, segments, erase, stored) = {
            // The checkpoint holds the state with every record applied, so none may still wait
            // for its group: replayed on top of the checkpoint, it would apply twice.
            let mut c = self.lock();
            loop {
                if c.failed {
                    return Err(FlashError::Failed);
                }
                if c.in_flight() > 0 {
                    c = self.wait(c);
                } else if c.has_pending() {
                    drop(c);
                    if !self.writeback_once(0, None)? {
                        return Err(FlashError::NoSpace);
                    }
                    c = self.lock();
                } else {
                    break;
                }
            }
            let seq = c.last_seq();
            let mut enc = ckpt::encode(&mut c, seq);
            let pages = enc.bytes().div_ceil(CKPT_PAYLOAD as u64).max(1);
            let need = pages.div_ceil(u64::from(spp) - 1) as usize;
            let mut segments = Vec::with_capacity(need);
            for _ in 0..need {
                match c.space.take_for_checkpoint() {
                    Some((s, _)) => segments.push(s),
                    None => {
                        for &s in &segments {
                            c.space.drop_checkpoint_segment(s);
                        }
                        c.map.checkpoint_abandoned();
                        return Err(FlashError::NoSpace);
                    }
                }
            }
            enc.close(&c, &segments);
            self.filled_at_checkpoint.store(c.space.clock / u64::from(spp), Ordering::Relaxed);
            let erase: Vec<u32> = segments.iter().map(|&s| c.space.segs[s as usize].erase_count).collect();
            (enc, seq, segments, erase, c.checkpoint_chain.clone())
        };
        let written = self.write_checkpoint(&enc, stored, seq, &segments, erase);
        drop(enc);
        let mut c = self.lock();
        let pages = match written {
            Ok(pages) => pages,
            Err(e) => {
                for &s in &segments {
                    c.space.drop_checkpoint_segment(s);
                }
                c.map.checkpoint_abandoned();
                return Err(e);
            }
        };
        for s in std::mem::take(&mut c.checkpoint_segments) {
            c.space.drop_checkpoint_segment(s);
        }
        c.checkpoint_segments = segments.clone();
        c.checkpoint = Some(CkptRef { seq, first_segment: segments[0], pages });
        c.space.covered_seq = seq;
        c.counters.checkpoints += 1;
        c.counters.device_pages_written +=
            u64::from(pages) + segments.len() as u64 + u64::from(self.geo.devices);
        c.durable(seq);
        let chain = ckpt::Chain {
            array: self.id,
            seq,
            pages,
            segments,
            segment_pages: spp,
            array_pages: u64::from(self.geo.total_segments()) * u64::from(spp),
        };
        c.map.checkpointed(Box::new(ckpt::CkptLeaves::new(chain.clone(), page_reader(&self.devs, self.geo))));
        c.checkpoint_chain = Some(chain);
        c.shed();
        drop(c);
        self.changed.notify_all();
        Ok(())
    }

    /// Write `enc` (checkpoint `seq`) to `segments`, reading evicted leaves back from the
    /// checkpoint `stored` names; sync it with every group before it, and name it in the
    /// superblocks. Returns its pages.
    fn write_checkpoint(
        &self,
        enc: &ckpt::Encoded,
        stored: Option<ckpt::Chain>,
        seq: u64,
        segments: &[u32],
        erase: Vec<u32>,
    ) -> Result<u32, FlashError> {
        let mut w = CkptWriter::new(self, seq, segments, erase)?;
        let mut stored = stored.map(|chain| ckpt::CkptLeaves::new(chain, page_reader(&self.devs, self.geo)));
        ckpt::write(enc, stored.as_mut().map(|s| s as &mut dyn LeafSource), &mut |b| w.push(b))?;
        let pages = w.finish()?;
        // The checkpoint and every group up to `seq` durable, then the superblocks name it.
        self.sync_all()?;
        let ceiling = self.lock().next_seq + SEQ_WINDOW;
        let named = self.write_superblocks(|sb| {
            sb.checkpoint = Some(CkptRef { seq, first_segment: segments[0], pages });
            sb.seq_ceiling = sb.seq_ceiling.max(ceiling);
        });
        if let Err(e) = named {
            // Some superblock may name this checkpoint already: its segments must never be
            // written again, so the array takes no more writes.
            self.lock().failed = true;
            self.changed.notify_all();
            return Err(e);
        }
        let mut c = self.lock();
        c.seq_ceiling = c.seq_ceiling.max(ceiling);
        Ok(pages)
    }

    // ---------------------------------------------------------------------------------
    // The data path

    /// Fill `buf` from byte `offset` of volume `vol`.
    pub fn read(&self, vol: VolId, offset: u64, buf: &mut [u8]) -> Result<(), FlashError> {
        let mut done = 0;
        while done < buf.len() {
            let pos = offset + done as u64;
            let (vpage, at) = (pos / PAGE as u64, (pos % PAGE as u64) as usize);
            let n = (PAGE - at).min(buf.len() - done);
            self.read_page(vol, vpage, at, &mut buf[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// The `len` bytes at byte `offset` of volume `vol`, when every page of them is in the
    /// pool now, appended to `out` in order as ranges of the pool (pages in neighbouring slots
    /// as one), each keeping every slot lent until the last of them is dropped, so that a
    /// sender hands them to the kernel with no copy of its own. Returns whether it lent them;
    /// when not, [`read`](Self::read) is the way, and nothing was appended or stays lent:
    /// - not when a page is not in the pool (a miss, a hole, a page being read in);
    /// - not past a quarter of the pool lent at once, and never more than an eighth for one
    ///   read, so that writers always find most of the pool evictable or writable back.
    ///
    /// A lent slot keeps its page (it is neither evicted nor freed, a delete included, until
    /// given back), but writes to the page, its write-back and syncs go on: a write before
    /// the bytes are sent changes them, as an overlapping in-flight request may, and nothing
    /// waits for a loan, so a worker holding one never waits on itself.
    pub fn lend(
        self: &Arc<Self>,
        vol: VolId,
        offset: u64,
        len: usize,
        out: &mut Vec<rt::mem::RegionBytes>,
    ) -> Result<bool, FlashError> {
        if len == 0 {
            return Ok(false);
        }
        let page = PAGE as u64;
        let (first, last) = (offset / page, (offset + len as u64 - 1) / page);
        let pages = (last - first + 1) as usize;
        let pool = self.pool_len as usize;
        if pages > (pool / 8).max(1) {
            return Ok(false);
        }
        // Counted before the lock, so that workers lending at once cannot pass the bound
        // together; given back if nothing is lent.
        if self.lent_now.fetch_add(pages, Ordering::Relaxed) + pages > pool / 4 {
            self.lent_now.fetch_sub(pages, Ordering::Relaxed);
            return Ok(false);
        }
        let mut slots = Vec::with_capacity(pages);
        {
            let mut c = self.lock();
            for vpage in first..=last {
                match c.lend(vol, vpage) {
                    Ok(Some(s)) => slots.push(s),
                    other => {
                        // Not all in memory: give back what was lent, and read the usual way.
                        drop(c);
                        self.give_back(&slots, pages);
                        return other.map(|_| false);
                    }
                }
            }
            c.counters.pool_hits += pages as u64;
        }
        self.pages_lent.fetch_add(pages as u64, Ordering::Relaxed);
        let loan = Arc::new(Loan { array: Arc::clone(self), slots });
        let keep: Arc<dyn Send + Sync> = loan.clone();
        let slots = &loan.slots;
        let (mut at, mut left, mut i) = ((offset % page) as usize, len, 0);
        while left > 0 {
            // Slots that follow one another in the pool make one range.
            let mut run = 1;
            while i + run < slots.len() && slots[i + run] == slots[i] + run as u32 {
                run += 1;
            }
            let n = (run * PAGE - at).min(left);
            out.push(self.pool.bytes(slots[i] as usize * PAGE + at, n).keeping(Arc::clone(&keep)));
            (left, i, at) = (left - n, i + run, 0);
        }
        Ok(true)
    }

    /// Give back `slots` lent by [`lend`](Self::lend), which counted `counted` pages against
    /// the bound; wake writers waiting for room if an orphan (its volume deleted) was freed.
    fn give_back(&self, slots: &[u32], counted: usize) {
        let freed = {
            let mut c = self.lock();
            slots.iter().fold(false, |freed, &s| c.give_back(s) | freed)
        };
        self.lent_now.fetch_sub(counted, Ordering::Relaxed);
        if freed {
            self.changed.notify_all();
        }
    }

    fn read_page(&self, vol: VolId, vpage: u64, at: usize, dst: &mut [u8]) -> Result<(), FlashError> {
        let mut c = self.lock();
        loop {
            match c.get(vol, vpage, Access::Read)? {
                Got::Ready(s) => {
                    self.pool.read_at(s as usize * PAGE + at, dst);
                    c.put(s, false);
                    return Ok(());
                }
                Got::Zero => {
                    dst.fill(0);
                    return Ok(());
                }
                Got::Fetch { slot, pba } => {
                    let (mut c, result) = self.fetch_unlocked(c, slot, pba);
                    if result.is_ok() {
                        self.pool.read_at(slot as usize * PAGE + at, dst);
                    }
                    c.put(slot, false);
                    drop(c);
                    self.changed.notify_all();
                    return result;
                }
                Got::Direct(pba) => {
                    drop(c);
                    let result = AlignedBuf::new(PAGE).map_err(FlashError::from).and_then(|mut page| {
                        self.read_pages(pba, &mut page)?;
                        dst.copy_from_slice(&page[at..at + dst.len()]);
                        Ok(())
                    });
                    self.lock().read_done(pba);
                    return result;
                }
                Got::Busy => c = self.wait(c),
                Got::PoolFull | Got::Fresh(_) => unreachable!("a read gets no slot to fill"),
            }
        }
    }

    /// Write `buf` at byte `offset` of volume `vol`; with `fua`, durable before returning.
    pub fn write(&self, vol: VolId, offset: u64, buf: &[u8], fua: bool) -> Result<(), FlashError> {
        let mut done = 0;
        while done < buf.len() {
            let pos = offset + done as u64;
            let (vpage, at) = (pos / PAGE as u64, (pos % PAGE as u64) as usize);
            let n = (PAGE - at).min(buf.len() - done);
            self.write_page(vol, vpage, at, &buf[done..done + n])?;
            done += n;
        }
        if fua {
            self.sync_pages(Some(vol))?;
        }
        Ok(())
    }

    /// Wake the background thread as dirty pages reach the write-back mark (once, on the way
    /// up: a notify is a system call, too dear for every write).
    fn kick_at_mark(&self, c: &Controller) {
        self.dirty_hint.store(c.pool.dirty_count(), Ordering::Relaxed);
        if c.pool.dirty_count() == self.opts.writeback_dirty_min {
            self.kick.notify_one();
        }
    }

    fn write_page(&self, vol: VolId, vpage: u64, at: usize, src: &[u8]) -> Result<(), FlashError> {
        let whole = at == 0 && src.len() == PAGE;
        let access = if whole { Access::WriteWhole } else { Access::WritePart };
        let mut c = self.lock();
        loop {
            match c.get(vol, vpage, access)? {
                Got::Ready(s) => {
                    self.pool.write_at(s as usize * PAGE + at, src);
                    c.put(s, true);
                    self.kick_at_mark(&c);
                    return Ok(());
                }
                Got::Fresh(s) => {
                    if !whole {
                        self.pool.fill_zero(s as usize * PAGE, PAGE);
                    }
                    self.pool.write_at(s as usize * PAGE + at, src);
                    c.put(s, true);
                    self.kick_at_mark(&c);
                    return Ok(());
                }
                Got::Fetch { slot, pba } => {
                    let (mut c, result) = self.fetch_unlocked(c, slot, pba);
                    if result.is_ok() {
                        self.pool.write_at(slot as usize * PAGE + at, src);
                    }
                    c.put(slot, result.is_ok());
                    self.kick_at_mark(&c);
                    drop(c);
                    self.changed.notify_all();
                    return result;
                }
                Got::Busy => c = self.wait(c),
                Got::PoolFull => {
                    drop(c);
                    self.pool_full_writes.fetch_add(1, Ordering::Relaxed);
                    self.make_room()?;
                    c = self.lock();
                }
                Got::Zero | Got::Direct(_) => unreachable!("a write always gets a slot or waits"),
            }
        }
    }

    /// Make `len` bytes from `offset` of `vol` read as zeroes: whole pages are unmapped (no
    /// flash written), partial ones written with zeroes.
    pub fn zero(&self, vol: VolId, offset: u64, len: u64, fua: bool) -> Result<(), FlashError> {
        let end = offset.checked_add(len).ok_or(FlashError::OutOfRange)?;
        let first_whole = offset.div_ceil(PAGE as u64);
        let end_whole = end / PAGE as u64;
        if first_whole < end_whole {
            let head = (first_whole * PAGE as u64).min(end) - offset;
            if head > 0 {
                self.write(vol, offset, &vec![0; head as usize], false)?;
            }
            self.lock().trim(vol, first_whole, end_whole - first_whole)?;
            self.kick.notify_one(); // the trim's record waits for a group
            let tail_at = end_whole * PAGE as u64;
            if end > tail_at {
                self.write(vol, tail_at, &vec![0; (end - tail_at) as usize], false)?;
            }
        } else {
            self.write(vol, offset, &vec![0; len as usize], false)?;
        }
        if fua {
            self.sync_pages(Some(vol))?;
        }
        Ok(())
    }

    /// Make every write acknowledged so far durable.
    pub fn flush(&self) -> Result<(), FlashError> {
        self.sync_pages(None)
    }

    /// Which pages of `count` pages of `vol` from `vpage` hold data (mapped or dirty in the
    /// pool): `true` for data, in order.
    pub fn allocation(&self, vol: VolId, vpage: u64, count: u64) -> Result<Vec<bool>, FlashError> {
        let mut c = self.lock();
        let c = &mut *c;
        let v = c.vols.get(&vol).ok_or(FlashError::NoSuchVolume)?;
        let end = vpage.saturating_add(count).min(v.pages());
        let mut out = Vec::with_capacity((end - vpage.min(end)) as usize);
        for p in vpage..end {
            out.push(c.map.get(&v.map, p)? != 0 || c.has_slot(vol, p));
        }
        c.shed();
        Ok(out)
    }

    // ---------------------------------------------------------------------------------
    // Volumes

    /// Write the waiting records and sync: a volume change is durable before it is answered.
    fn commit(&self) -> Result<(), FlashError> {
        while self.lock().has_pending() {
            // Records alone (no dirty pages): they may use the reserve, so this only fails
            // when the array has no segment left at all.
            if !self.writeback_once(0, None)? {
                return Err(FlashError::NoSpace);
            }
        }
        self.make_durable()
    }

    /// Create volume `name` of `size_bytes` (rounded up to whole pages).
    pub fn create(&self, name: &str, size_bytes: u64) -> Result<VolId, FlashError> {
        let vol = self.lock().create(name, size_bytes.div_ceil(PAGE as u64))?;
        self.commit()?;
        Ok(vol)
    }

    /// Resize `name`. Shrinking below written data is refused.
    pub fn resize(&self, name: &str, size_bytes: u64) -> Result<(), FlashError> {
        let vol = self.id_of(name)?;
        let pages = size_bytes.div_ceil(PAGE as u64);
        self.lock().resize(vol, pages, false)?;
        self.commit()?;
        if let Some(size) = self.sizes.lock().unwrap_or_else(|e| e.into_inner()).get(&vol) {
            size.store(pages * PAGE as u64, Ordering::Release);
        }
        Ok(())
    }

    /// A read-only snapshot (`writable` false) or a writable clone of `origin`, named `name`.
    /// Pages of `origin` written before the call are in it.
    pub fn snapshot(&self, origin: &str, name: &str, writable: bool) -> Result<VolId, FlashError> {
        let o = self.id_of(origin)?;
        loop {
            self.sync_pages(Some(o))?;
            let made = self.lock().snapshot(o, name, writable);
            match made {
                Err(FlashError::Busy(_)) => continue, // written to meanwhile
                other => {
                    let vol = other?;
                    self.commit()?;
                    return Ok(vol);
                }
            }
        }
    }

    /// Delete `name`; refused while it has snapshots or clones, or is `in_use`.
    pub fn delete(&self, name: &str, in_use: bool) -> Result<(), FlashError> {
        let vol = self.id_of(name)?;
        if in_use {
            return Err(FlashError::Busy("the volume has open connections"));
        }
        self.lock().delete(vol)?;
        self.commit()?;
        self.sizes.lock().unwrap_or_else(|e| e.into_inner()).remove(&vol);
        Ok(())
    }

    pub fn id_of(&self, name: &str) -> Result<VolId, FlashError> {
        self.lock().find(name).map(|v| v.id).ok_or(FlashError::NoSuchVolume)
    }

    /// Every volume, by name.
    pub fn list(&self) -> Vec<VolumeInfo> {
        let c = self.lock();
        let name_of = |id: VolId| c.vols.get(&id).map(|v| v.name.clone());
        let mut out: Vec<VolumeInfo> = c
            .vols
            .values()
            .map(|v| VolumeInfo {
                id: v.id,
                name: v.name.clone(),
                size_bytes: v.pages() * PAGE as u64,
                allocated_bytes: c.allocated_pages(v.id) * PAGE as u64,
                writable: v.writable,
                origin: v.origin.and_then(name_of),
                snapshots: c
                    .vols
                    .values()
                    .filter(|s| s.origin == Some(v.id))
                    .map(|s| s.name.clone())
                    .collect(),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// The size of volume `vol`, shared with its backend (updated on resize).
    pub fn size_handle(&self, vol: VolId) -> Result<Arc<AtomicU64>, FlashError> {
        let bytes = self.lock().volume(vol)?.pages() * PAGE as u64;
        let mut sizes = self.sizes.lock().unwrap_or_else(|e| e.into_inner());
        Ok(sizes.entry(vol).or_insert_with(|| Arc::new(AtomicU64::new(bytes))).clone())
    }

    /// The array's id, drawn when it was formatted (in every superblock and header).
    pub fn id(&self) -> ArrayId {
        self.id
    }

    pub fn is_writable(&self, vol: VolId) -> bool {
        self.lock().volume(vol).is_ok_and(|v| v.writable)
    }

    pub fn stats(&self) -> Stats {
        let c = self.lock();
        let census = c.pool.census();
        let (erase_min, erase_max) = c.space.wear();
        Stats {
            counters: c.counters,
            write_amplification: c.write_amplification(),
            capacity_bytes: c.capacity_pages() * PAGE as u64,
            valid_bytes: c.valid_pages() * PAGE as u64,
            free_segments: c.space.free_segments(),
            total_segments: self.geo.total_segments(),
            pool_pages: c.pool.len(),
            pool_clean: census.clean,
            pool_dirty: census.dirty,
            pool_lends: census.lends,
            erase_min,
            erase_max,
            map_bytes: c.map_memory(),
            map_leaves: c.map.leaves_in_use() as u64,
            map_leaves_resident: c.map.resident() as u64,
            map_loads: c.map.loads,
            map_loads_async: self.leaves_read_async.load(Ordering::Relaxed),
            map_evictions: c.map.evictions,
            device_pages_written_measured: self.devs.iter().map(|d| d.pages_written()).sum(),
            pages_read_async: self.prefetched.load(Ordering::Relaxed),
            device_reads_async: self.prefetch_reads.load(Ordering::Relaxed),
            pages_joined: self.pages_joined.load(Ordering::Relaxed),
            pages_lent: self.pages_lent.load(Ordering::Relaxed),
            syncs_later: self.synced_later.load(Ordering::Relaxed),
            sync_rounds_later: self.sync_rounds.load(Ordering::Relaxed),
            pool_full_writes: self.pool_full_writes.load(Ordering::Relaxed),
            rooms_later: self.rooms_later.load(Ordering::Relaxed),
            recovered: self.recovered,
        }
    }

    /// Pool pages counted as lent now ([`lend`](Self::lend)), for tests and the simulator:
    /// 0 once every loan is given back.
    pub fn lent_now(&self) -> usize {
        self.lent_now.load(Ordering::Relaxed)
    }

    /// Check the controller's invariants (tests and the simulator).
    pub fn audit(&self) -> Result<(), String> {
        let mut c = self.lock();
        c.audit()?;
        // A loan is counted against the bound before its slots are lent, and uncounted after
        // they are given back, so under the lock the slots never hold more than is counted.
        let (lends, counted) = (c.pool.census().lends, self.lent_now.load(Ordering::Relaxed));
        if lends as usize > counted {
            return Err(format!("{lends} loans of pool slots outstanding, {counted} counted"));
        }
        Ok(())
    }
}

/// A checkpoint's byte stream cut into checkpoint pages, written a segment at a time.
struct CkptWriter<'a> {
    array: &'a Array,
    seq: u64,
    segments: &'a [u32],
    /// Erase counts of `segments`, for their headers.
    erase: Vec<u32>,
    buf: AlignedBuf,
    /// The segment being filled (an index into `segments`), and its next page.
    seg: usize,
    page: usize,
    index: u32,
    payload: Vec<u8>,
}

impl<'a> CkptWriter<'a> {
    fn new(
        array: &'a Array,
        seq: u64,
        segments: &'a [u32],
        erase: Vec<u32>,
    ) -> Result<CkptWriter<'a>, FlashError> {
        let spp = array.geo.segment_pages as usize;
        let mut w = CkptWriter {
            array,
            seq,
            segments,
            erase,
            buf: AlignedBuf::new(spp * PAGE)?,
            seg: 0,
            page: 1,
            index: 0,
            payload: Vec::with_capacity(CKPT_PAYLOAD),
        };
        w.start_segment();
        Ok(w)
    }

    fn start_segment(&mut self) {
        let h = SegmentHeader {
            segment: self.segments[self.seg],
            opened_seq: self.seq,
            erase_count: self.erase[self.seg],
            kind: SegmentKind::Checkpoint { next: self.segments.get(self.seg + 1).copied() },
        };
        h.emit(&self.array.id, &mut self.buf[..PAGE]);
        self.page = 1;
    }

    fn push(&mut self, mut bytes: &[u8]) -> Result<(), FlashError> {
        while !bytes.is_empty() {
            let n = (CKPT_PAYLOAD - self.payload.len()).min(bytes.len());
            self.payload.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.payload.len() == CKPT_PAYLOAD {
                self.emit_page()?;
            }
        }
        Ok(())
    }

    fn emit_page(&mut self) -> Result<(), FlashError> {
        if self.page == self.array.geo.segment_pages as usize {
            self.write_segment()?;
            self.seg += 1;
            if self.seg == self.segments.len() {
                return Err(FlashError::Corrupt("a checkpoint longer than its segments"));
            }
            self.start_segment();
        }
        let at = self.page * PAGE;
        CkptPage::emit(&self.array.id, self.seq, self.index, &self.payload, &mut self.buf[at..at + PAGE]);
        self.index += 1;
        self.page += 1;
        self.payload.clear();
        Ok(())
    }

    fn write_segment(&mut self) -> Result<(), FlashError> {
        let pba = self.segments[self.seg] * self.array.geo.segment_pages;
        self.array.write_pages(pba, &self.buf[..self.page * PAGE])
    }

    /// Write what is left; returns the checkpoint's pages.
    fn finish(mut self) -> Result<u32, FlashError> {
        if !self.payload.is_empty() || self.index == 0 {
            self.emit_page()?;
        }
        self.write_segment()?;
        if self.seg + 1 != self.segments.len() {
            return Err(FlashError::Corrupt("a checkpoint shorter than its segments"));
        }
        Ok(self.index)
    }
}

impl Drop for Array {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.kick.notify_all();
        if let Some(ReadQueue::Ring(reads)) = self.reads.get() {
            // The completion thread holds the ring, not the array: it ends on this no-op.
            let _ = reads.close();
        }
    }
}
