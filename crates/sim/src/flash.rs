//! The flash controller under crashes, torn writes and failing devices: a seeded simulation of
//! a flash array (`flash::engine::Array`, the real driver and controller) over devices that
//! keep what a sync made durable apart from what was written since.
//!
//! A [`CrashDevice`] answers reads from everything written so far, and remembers which page
//! writes a sync has not yet covered. A crash builds new devices from the durable image plus a
//! seeded choice among those pending writes: each is applied whole, dropped, or torn (only its
//! first 512-byte sectors land). Writes, reads and syncs may also fail (EIO) on a seeded
//! schedule; a write that fails may have landed in part.
//!
//! The model keeps every version of every page of every volume, and for each page the floor:
//! the newest version that must survive a crash (written before an acknowledged FLUSH, by an
//! acknowledged FUA write, or present when an acknowledged snapshot or volume change synced).
//! During a run every read must return exactly the newest version; after a crash and
//! recovery, every page must hold one of its versions from the floor on (never an older one,
//! never bytes that are no version at all: nothing half-written), every volume acknowledged
//! must exist and none deleted must, and the controller's own audit must pass. Background work
//! (write-back, cleaning, checkpoints) runs when the schedule says, so crashes land in the
//! middle of all of it.
//!
//! Beside every step, a sender may borrow pool pages (`Array::lend`, as a reply does to send
//! a read from the pool with no copy) and hold them across the steps that follow, crashes
//! included, before it "sends" them. At the lend the bytes must be the page's newest version;
//! when sent, each page must still be one of its versions from then on (a write meanwhile may
//! change them; nothing else may: a lent slot is never evicted, freed or reused). Once every
//! loan is given back, the pool must hold none.
//!
//! The array's look-ahead runs here too (`Array::prefetch`, as a target's front end calls it
//! before it runs a request): its reads are held (`Array::hold_reads`) and land, or fail, in an
//! order the seed draws, between the other steps, each reading the devices as it lands. Every
//! batch that waited must be woken exactly once, when its last read lands, and the range it
//! read ahead must then read back as the model says.
//!
//! [`Lie`] makes the devices lie (a sync that makes nothing durable, or a torn write that
//! claims success), to show the model catches lost acknowledged writes.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex};

use flash::ctl::Config;
use flash::device::Device;
use flash::engine::{format, Array};
use flash::layout::PAGE;
use flash::space::VictimPolicy;
use flash::FlashError;

use crate::rng::Rng;

/// A batch's driver that nothing wakes: the simulator's syncs end before their batch is sealed.
struct NoWake;

impl backend::Wake for NoWake {
    fn wake(&self, _token: u64) {}
}

/// The look-ahead's batches' driver: it writes down every wake.
#[derive(Default)]
struct Wakes(std::sync::Mutex<Vec<u64>>);

impl backend::Wake for Wakes {
    fn wake(&self, token: u64) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(token);
    }
}

/// A look-ahead that started reads and waits for them: the range it read ahead.
struct Ahead {
    batch: Arc<backend::Batch>,
    token: u64,
    name: String,
    first: u64,
    pages: u64,
}

const SECTOR: usize = 512;

/// How often the devices fail, per million operations of each kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceFaults {
    pub write_error: u32,
    pub read_error: u32,
    pub sync_error: u32,
}

impl DeviceFaults {
    pub const NONE: DeviceFaults = DeviceFaults { write_error: 0, read_error: 0, sync_error: 0 };

    pub fn typical() -> DeviceFaults {
        DeviceFaults { write_error: 300, read_error: 300, sync_error: 1_000 }
    }
}

/// A device that lies, to prove the simulation catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Lie {
    #[default]
    None,
    /// `sync` returns success and makes nothing durable.
    Sync,
}

struct DeviceState {
    /// What survives a crash for sure.
    durable: Vec<u8>,
    /// What reads see: `durable` plus the writes since the last sync.
    current: Vec<u8>,
    /// Page writes since the last sync, in order.
    pending: Vec<(u64, Vec<u8>)>,
    rng: Rng,
    faults: DeviceFaults,
    lie: Lie,
}

/// A device in memory that knows what a crash would keep.
pub struct CrashDevice {
    state: Mutex<DeviceState>,
    pages: u64,
    name: String,
}

impl CrashDevice {
    pub fn new(pages: u64, rng: Rng, faults: DeviceFaults, lie: Lie, name: String) -> CrashDevice {
        CrashDevice::from_image(vec![0; pages as usize * PAGE], rng, faults, lie, name)
    }

    fn from_image(image: Vec<u8>, rng: Rng, faults: DeviceFaults, lie: Lie, name: String) -> CrashDevice {
        let pages = (image.len() / PAGE) as u64;
        let state =
            DeviceState { durable: image.clone(), current: image, pending: Vec::new(), rng, faults, lie };
        CrashDevice { state: Mutex::new(state), pages, name }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, DeviceState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the device holds after a crash now: the durable image with each pending page
    /// write applied whole, torn (its first sectors only) or lost, as `rng` decides. Returns
    /// the image and how many writes were torn.
    pub fn crash_image(&self, rng: &mut Rng) -> (Vec<u8>, u64) {
        let s = self.state();
        let mut image = s.durable.clone();
        let mut torn = 0;
        for (page, data) in &s.pending {
            let at = *page as usize * PAGE;
            match rng.below(4) {
                0 | 1 => image[at..at + PAGE].copy_from_slice(data),
                2 => {
                    let sectors = rng.range(1, (PAGE / SECTOR - 1) as u64) as usize * SECTOR;
                    image[at..at + sectors].copy_from_slice(&data[..sectors]);
                    torn += 1;
                }
                _ => {}
            }
        }
        (image, torn)
    }
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(5)
}

impl Device for CrashDevice {
    fn pages(&self) -> u64 {
        self.pages
    }

    fn read(&self, page: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut s = self.state();
        let fault = s.faults.read_error;
        if s.rng.chance(fault) {
            return Err(eio());
        }
        let at = page as usize * PAGE;
        if at + buf.len() > s.current.len() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "read past the device"));
        }
        buf.copy_from_slice(&s.current[at..at + buf.len()]);
        Ok(())
    }

    fn write(&self, page: u64, buf: &[u8]) -> io::Result<()> {
        let mut s = self.state();
        let at = page as usize * PAGE;
        if at + buf.len() > s.current.len() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "write past the device"));
        }
        let pages = buf.len() / PAGE;
        let fault = s.faults.write_error;
        // A failing write may land in part: its first pages.
        let landed = if s.rng.chance(fault) { s.rng.below(pages as u64 + 1) as usize } else { pages };
        for i in 0..landed {
            let data = buf[i * PAGE..(i + 1) * PAGE].to_vec();
            s.current[at + i * PAGE..at + (i + 1) * PAGE].copy_from_slice(&data);
            s.pending.push((page + i as u64, data));
        }
        if landed < pages {
            return Err(eio());
        }
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        let mut s = self.state();
        let fault = s.faults.sync_error;
        if s.rng.chance(fault) {
            return Err(eio());
        }
        if s.lie == Lie::Sync {
            return Ok(());
        }
        let DeviceState { durable, current, pending, .. } = &mut *s;
        for (page, data) in pending.drain(..) {
            let at = page as usize * PAGE;
            durable[at..at + PAGE].copy_from_slice(&data);
        }
        debug_assert!(durable == current);
        Ok(())
    }

    fn name(&self) -> String {
        self.name.clone()
    }
}

/// A run's shape.
#[derive(Debug, Clone, Copy)]
pub struct FlashOptions {
    pub seed: u64,
    pub steps: usize,
    pub faults: DeviceFaults,
    pub lie: Lie,
}

/// What a run did.
#[derive(Debug, Clone, Copy, Default)]
pub struct FlashReport {
    pub crashes: u64,
    pub torn_writes: u64,
    pub torn_pages_seen: u64,
    pub device_errors: u64,
    pub gc_segments: u64,
    /// Segments cleaned to level wear.
    pub wear_moves: u64,
    pub checkpoints: u64,
    pub snapshots: u64,
    pub pages_checked: u64,
    pub writes: u64,
    /// Map leaves evicted, and read back from a checkpoint (the map budget at work).
    pub map_evictions: u64,
    pub map_loads: u64,
    /// Reads lent from the pool and checked when sent; of them, loans held across a crash and
    /// loans that saw their page written before they were sent.
    pub loans: u64,
    pub loans_across_crash: u64,
    pub loans_overwritten: u64,
    /// Look-aheads that waited for reads; reads the simulator landed, and made to fail (a
    /// thread that would wait for a read lands them too, uncounted here); pages the
    /// look-aheads started reading, and the device reads they took (neighbours read as one).
    pub look_aheads: u64,
    pub reads_landed: u64,
    pub reads_failed: u64,
    pub pages_read_ahead: u64,
    pub device_reads_ahead: u64,
}

impl FlashReport {
    pub fn add(&mut self, o: &FlashReport) {
        self.crashes += o.crashes;
        self.torn_writes += o.torn_writes;
        self.torn_pages_seen += o.torn_pages_seen;
        self.device_errors += o.device_errors;
        self.gc_segments += o.gc_segments;
        self.wear_moves += o.wear_moves;
        self.checkpoints += o.checkpoints;
        self.snapshots += o.snapshots;
        self.pages_checked += o.pages_checked;
        self.writes += o.writes;
        self.map_evictions += o.map_evictions;
        self.map_loads += o.map_loads;
        self.loans += o.loans;
        self.loans_across_crash += o.loans_across_crash;
        self.loans_overwritten += o.loans_overwritten;
        self.look_aheads += o.look_aheads;
        self.reads_landed += o.reads_landed;
        self.reads_failed += o.reads_failed;
        self.pages_read_ahead += o.pages_read_ahead;
        self.device_reads_ahead += o.device_reads_ahead;
    }
}

/// One page as the model knows it: every version written, oldest first, and the index of the
/// oldest that may still be there after a crash.
#[derive(Debug, Clone)]
struct Page {
    versions: Vec<Vec<u8>>,
    floor: usize,
}

impl Page {
    fn zero() -> Page {
        Page { versions: vec![vec![0; PAGE]], floor: 0 }
    }
    fn current(&self) -> &[u8] {
        self.versions.last().expect("a page has a version")
    }
    fn push(&mut self, v: Vec<u8>) {
        if self.versions.last().is_some_and(|l| *l == v) {
            return;
        }
        self.versions.push(v);
    }
    fn settle(&mut self) {
        self.floor = self.versions.len() - 1;
    }
    fn keep_only(&mut self, v: Vec<u8>) {
        self.versions = vec![v];
        self.floor = 0;
    }
}

#[derive(Debug, Clone)]
struct ModelVol {
    pages: Vec<Page>,
    writable: bool,
    origin: Option<String>,
}

/// A volume change that failed: after the crash that follows, it may or may not have
/// happened.
enum Uncertain {
    Appears(String, ModelVol),
    Goes(String),
    Resized(String, u64),
}

/// Pool pages a sender holds between [`Array::lend`] and sending them.
struct Held {
    name: String,
    /// The volume's bytes `offset..offset + len`, as the pool's ranges.
    offset: u64,
    len: usize,
    bytes: Vec<rt::mem::RegionBytes>,
    pages: Vec<HeldPage>,
    /// Lent since the array was last opened: counted against its bound.
    this_life: bool,
}

/// What one page of a loan may show when sent.
struct HeldPage {
    /// The page's version when lent: it may show that one or any later.
    since: usize,
    /// The versions it may show, gathered when the model stopped following the page (a
    /// crash, a delete, a resize): the lent slot changes no more.
    frozen: Option<Vec<Vec<u8>>>,
}

impl Held {
    fn first_page(&self) -> u64 {
        self.offset / PAGE as u64
    }

    /// Stop following page `i` (of the loan) in the model: what it may show is what was
    /// written to it from the lend until now.
    fn freeze(&mut self, i: usize, model: Option<&ModelVol>) {
        let vpage = self.first_page() as usize + i;
        let p = &mut self.pages[i];
        if p.frozen.is_none() {
            let versions = model.and_then(|m| m.pages.get(vpage)).map(|m| m.versions[p.since..].to_vec());
            p.frozen = Some(versions.expect("a page followed in the model is in it"));
        }
    }
}

struct Sim {
    uncertain: Option<Uncertain>,
    /// Draws for lending, a stream of its own (the seeds' other draws stay as they were).
    loan_rng: Rng,
    held: Vec<Held>,
    /// Draws for the look-ahead and its reads, a stream of its own.
    ahead_rng: Rng,
    /// How many reads the look-ahead may hold at once.
    read_depth: u32,
    wakes: Arc<Wakes>,
    waiting: Vec<Ahead>,
    /// Look-aheads woken since the array opened: none may see a read end after its wake.
    woken: Vec<Arc<backend::Batch>>,
    next_token: u64,
    rng: Rng,
    opts: FlashOptions,
    devs: Vec<Arc<CrashDevice>>,
    cfg: Config,
    array: Arc<Array>,
    model: BTreeMap<String, ModelVol>,
    report: FlashReport,
    step: usize,
    next_name: u32,
    /// Print every operation (`SKIFF_FLASH_TRACE`), to follow a failing seed.
    trace: bool,
}

macro_rules! trace {
    ($sim:expr, $($arg:tt)*) => {
        if $sim.trace {
            eprintln!("[{}] {}", $sim.step, format!($($arg)*));
        }
    };
}

/// Run one seeded simulation. `Err` names the step and what broke.
pub fn run_flash(opts: FlashOptions) -> Result<FlashReport, String> {
    let mut rng = Rng::new(opts.seed);
    let devices = rng.range(1, 3) as usize;
    let segment_pages = rng.pick(&[16u32, 24, 32]);
    let segments_per_device = rng.range(16, 40);
    let pages = 256 + segments_per_device * u64::from(segment_pages);
    let devs: Vec<Arc<CrashDevice>> = (0..devices)
        .map(|i| {
            let r = rng.fork(100 + i as u64);
            Arc::new(CrashDevice::new(pages, r, DeviceFaults::NONE, opts.lie, format!("sim{i}")))
        })
        .collect();
    let boxed = |devs: &[Arc<CrashDevice>]| -> Vec<Box<dyn Device>> {
        devs.iter().map(|d| Box::new(d.clone()) as Box<dyn Device>).collect()
    };
    format(&boxed(&devs), segment_pages, false).map_err(|e| format!("format: {e}"))?;
    let cfg = Config {
        pool_pages: rng.pick(&[8u32, 16, 48]),
        segregation: rng.below(2) == 0,
        hot_window_pages: rng.pick(&[64u64, 256]),
        group_pages_max: rng.pick(&[4u32, 16, 128]),
        policy: if rng.below(2) == 0 { VictimPolicy::CostBenefit } else { VictimPolicy::Greedy },
        wear_spread_max: rng.pick(&[1u32, 2, 64]),
        // No bound, one leaf, a few, or plenty: leaves are evicted and read back from the
        // checkpoint all the time with the small ones. (A stream of its own: the seeds' other
        // choices stay as they were.)
        map_budget: Rng::new(opts.seed ^ 0x6d61_705f_6275_6467).pick(&[
            0u64,
            1,
            3 * flash::ctl::LEAF_BYTES,
            64 << 10,
        ]),
    };
    let array = Array::open(boxed(&devs), cfg).map_err(|e| format!("open: {e}"))?;
    for d in &devs {
        d.state().faults = opts.faults;
    }
    let mut sim = Sim {
        uncertain: None,
        loan_rng: Rng::new(opts.seed ^ 0x6c65_6e64_5f73_656e),
        held: Vec::new(),
        ahead_rng: Rng::new(opts.seed ^ 0x6168_6561_645f_7264),
        read_depth: 0,
        wakes: Arc::new(Wakes::default()),
        waiting: Vec::new(),
        woken: Vec::new(),
        next_token: 0,
        rng,
        opts,
        devs,
        cfg,
        array,
        model: BTreeMap::new(),
        report: FlashReport::default(),
        step: 0,
        next_name: 0,
        trace: std::env::var_os("SKIFF_FLASH_TRACE").is_some(),
    };
    sim.read_depth = sim.ahead_rng.pick(&[2u32, 8, 64]);
    sim.array.hold_reads(sim.read_depth);
    sim.create_volume()?;
    while sim.step < opts.steps {
        sim.step += 1;
        sim.one_step().map_err(|e| format!("seed {} step {}: {e}", opts.seed, sim.step))?;
        sim.lend_or_send().map_err(|e| format!("seed {} step {}: {e}", opts.seed, sim.step))?;
        sim.look_ahead_or_land().map_err(|e| format!("seed {} step {}: {e}", opts.seed, sim.step))?;
    }
    sim.land_all().map_err(|e| format!("seed {} at the end: {e}", opts.seed))?;
    sim.crash().map_err(|e| format!("seed {} final crash: {e}", opts.seed))?;
    while !sim.held.is_empty() {
        sim.send(0).map_err(|e| format!("seed {} at the end: {e}", opts.seed))?;
    }
    sim.no_loans_left().map_err(|e| format!("seed {} at the end: {e}", opts.seed))?;
    let s = sim.array.stats();
    sim.report.gc_segments += s.counters.gc_segments_cleaned;
    sim.report.checkpoints += s.counters.checkpoints;
    sim.report.pages_read_ahead += s.pages_read_async;
    sim.report.device_reads_ahead += s.device_reads_async;
    Ok(sim.report)
}

/// The contents of a new version of a page: recognisable, never all zeroes.
fn content(rng: &mut Rng) -> Vec<u8> {
    let mut x = rng.next_u64() | 1;
    (0..PAGE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

impl Sim {
    fn one_step(&mut self) -> Result<(), String> {
        let roll = self.rng.below(1000);

        match roll {
            0..=379 => self.write(false, false),
            380..=449 => self.write(true, false),
            450..=499 => self.write(false, true),
            500..=649 => self.read(),
            650..=679 => self.zero(),
            680..=719 => self.flush(),
            720..=869 => self.background(),
            870..=889 => self.checkpoint(),
            890..=909 => self.snapshot(),
            910..=929 => self.delete(),
            930..=944 => self.create_volume(),
            945..=959 => self.resize(),
            _ => self.crash(),
        }
    }

    fn pick_volume(&mut self, writable: bool) -> Option<String> {
        let names: Vec<&String> =
            self.model.iter().filter(|(_, v)| !writable || v.writable).map(|(n, _)| n).collect();
        if names.is_empty() {
            return None;
        }
        Some(names[self.rng.below(names.len() as u64) as usize].clone())
    }

    /// An operation failed: fine if it may fail (the array failed, the devices erred, it is
    /// full), a bug otherwise.
    fn tolerate(&mut self, e: FlashError, what: &str) -> Result<(), String> {
        match e {
            FlashError::Failed | FlashError::Device(_) | FlashError::NoSpace => {
                self.report.device_errors += u64::from(!matches!(e, FlashError::NoSpace));
                Ok(())
            }
            other => Err(format!("{what}: unexpected error {other}")),
        }
    }

    fn write(&mut self, partial: bool, fua: bool) -> Result<(), String> {
        let Some(name) = self.pick_volume(true) else { return Ok(()) };
        let vol = self.array.id_of(&name).map_err(|e| format!("write: {name}: {e}"))?;
        let pages = self.model[&name].pages.len() as u64;
        let first = self.rng.below(pages);
        let count = if partial { 1 } else { self.rng.range(1, 4).min(pages - first) };
        let (at, len) = if partial {
            let at = self.rng.below(PAGE as u64 - 1) as usize;
            (at, self.rng.range(1, (PAGE - at) as u64) as usize)
        } else {
            (0, PAGE)
        };
        let mut buf = Vec::with_capacity(count as usize * PAGE);
        let mut new_versions = Vec::new();
        for p in first..first + count {
            let mut v = self.model[&name].pages[p as usize].current().to_vec();
            let c = content(&mut self.rng);
            v[at..at + len].copy_from_slice(&c[at..at + len]);
            buf.extend_from_slice(&v[at..at + len]);
            new_versions.push(v);
        }
        let offset = first * PAGE as u64 + at as u64;
        self.report.writes += 1;
        let result = self.array.write(vol, offset, &buf, fua);
        trace!(self, "write {name} pages {first}..{} at {at} len {len} fua {fua}: {result:?}", first + count);
        let vol_model = self.model.get_mut(&name).expect("picked");
        match result {
            Ok(()) => {
                for (i, v) in new_versions.into_iter().enumerate() {
                    vol_model.pages[(first + i as u64) as usize].push(v);
                }
                if fua {
                    for p in &mut vol_model.pages {
                        p.settle();
                    }
                }
                Ok(())
            }
            Err(e) => {
                // Not acknowledged: it may or may not be there, in whole pages or not at all
                // (a page is written as a whole or not); the next read tells, so resync.
                for (i, v) in new_versions.into_iter().enumerate() {
                    vol_model.pages[(first + i as u64) as usize].push(v);
                }
                self.tolerate(e, "write")?;
                self.crash()
            }
        }
    }

    fn read(&mut self) -> Result<(), String> {
        let Some(name) = self.pick_volume(false) else { return Ok(()) };
        let vol = self.array.id_of(&name).map_err(|e| format!("read: {name}: {e}"))?;
        let pages = self.model[&name].pages.len() as u64;
        let first = self.rng.below(pages);
        let count = self.rng.range(1, 8).min(pages - first);
        let mut buf = vec![0u8; count as usize * PAGE];
        match self.array.read(vol, first * PAGE as u64, &mut buf) {
            Ok(()) => {}
            Err(e) => return self.tolerate(e, "read"),
        }
        for i in 0..count as usize {
            let want = self.model[&name].pages[first as usize + i].current();
            if buf[i * PAGE..(i + 1) * PAGE] != *want {
                return Err(format!("read {name} page {}: not the page last written", first as usize + i));
            }
            self.report.pages_checked += 1;
        }
        Ok(())
    }

    fn zero(&mut self) -> Result<(), String> {
        let Some(name) = self.pick_volume(true) else { return Ok(()) };
        let vol = self.array.id_of(&name).map_err(|e| format!("zero: {e}"))?;
        let bytes = self.model[&name].pages.len() as u64 * PAGE as u64;
        let offset = self.rng.below(bytes);
        let len = self.rng.range(1, (bytes - offset).min(16 * PAGE as u64));
        let result = self.array.zero(vol, offset, len, false);
        trace!(self, "zero {name} {offset}+{len}: {result:?}");
        let m = self.model.get_mut(&name).expect("picked");
        for p in offset / PAGE as u64..(offset + len).div_ceil(PAGE as u64) {
            let page_start = p * PAGE as u64;
            let from = offset.max(page_start) - page_start;
            let to = (offset + len).min(page_start + PAGE as u64) - page_start;
            let mut v = m.pages[p as usize].current().to_vec();
            v[from as usize..to as usize].fill(0);
            m.pages[p as usize].push(v);
        }
        match result {
            Ok(()) => Ok(()),
            Err(e) => {
                self.tolerate(e, "zero")?;
                self.crash()
            }
        }
    }

    /// A FLUSH: `Array::flush`, or `Array::sync_later` as a target's FLUSH (every volume) or
    /// FUA (one volume) asks it, the sync bounded by what was dirtied when it was asked. (No
    /// sync thread runs here, so it is served before `sync_later` returns.)
    fn flush(&mut self) -> Result<(), String> {
        let (r, only) = match self.rng.below(3) {
            0 => (self.array.flush(), None),
            way => {
                let only = if way == 2 { self.pick_volume(false) } else { None };
                let vol = match &only {
                    Some(name) => Some(self.array.id_of(name).map_err(|e| format!("flush: {name}: {e}"))?),
                    None => None,
                };
                let batch = Arc::new(backend::Batch::new(Arc::new(NoWake), 0));
                batch.open();
                self.array.sync_later(vol, &batch);
                if batch.seal() {
                    return Err("sync_later without a sync thread left its batch waiting".into());
                }
                (if batch.failed() { Err(FlashError::Failed) } else { Ok(()) }, only)
            }
        };
        trace!(self, "flush ({}): {r:?}", only.as_deref().unwrap_or("every volume"));
        match r {
            Ok(()) => {
                for (name, v) in self.model.iter_mut() {
                    if only.as_ref().is_none_or(|o| o == name) {
                        for p in &mut v.pages {
                            p.settle();
                        }
                    }
                }
                Ok(())
            }
            Err(e) => {
                self.tolerate(e, "flush")?;
                self.crash()
            }
        }
    }

    fn background(&mut self) -> Result<(), String> {
        for _ in 0..self.rng.range(1, 20) {
            let r = self.array.background_step();
            trace!(self, "background step: {r:?}");
            match r {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    self.tolerate(e, "background")?;
                    return self.crash();
                }
            }
        }
        self.audit("after background work")
    }

    /// The controller's own audit, with the devices' faults off while it runs: it reads
    /// evicted map leaves back, and it is the oracle here, not the system under test.
    fn audit(&mut self, when: &str) -> Result<(), String> {
        let faults: Vec<DeviceFaults> = self.devs.iter().map(|d| d.state().faults).collect();
        for d in &self.devs {
            d.state().faults = DeviceFaults::NONE;
        }
        let r = self.array.audit().map_err(|e| format!("audit {when}: {e}"));
        for (d, f) in self.devs.iter().zip(faults) {
            d.state().faults = f;
        }
        r
    }

    fn checkpoint(&mut self) -> Result<(), String> {
        let r = if self.rng.below(2) == 0 { self.array.checkpoint() } else { self.array.gc_step().map(drop) };
        trace!(self, "checkpoint or gc: {r:?}");
        match r {
            Ok(()) => Ok(()),
            Err(e) => {
                self.tolerate(e, "checkpoint or cleaning")?;
                self.crash()
            }
        }
    }

    fn new_name(&mut self) -> String {
        self.next_name += 1;
        format!("v{}", self.next_name)
    }

    fn create_volume(&mut self) -> Result<(), String> {
        if self.model.len() >= 4 {
            return Ok(());
        }
        let name = self.new_name();
        let pages = self.rng.range(8, 160);
        let r = self.array.create(&name, pages * PAGE as u64);
        trace!(self, "create {name} {pages} pages: {r:?}");
        match r {
            Ok(_) => {
                let pages = (0..pages).map(|_| Page::zero()).collect();
                self.model.insert(name, ModelVol { pages, writable: true, origin: None });
                Ok(())
            }
            Err(e) => {
                self.tolerate(e, "create")?;
                let pages = (0..pages).map(|_| Page::zero()).collect();
                self.uncertain =
                    Some(Uncertain::Appears(name, ModelVol { pages, writable: true, origin: None }));
                self.crash()
            }
        }
    }

    fn snapshot(&mut self) -> Result<(), String> {
        if self.model.len() >= 5 {
            return Ok(());
        }
        let Some(origin) = self.pick_volume(false) else { return Ok(()) };
        let name = self.new_name();
        let writable = self.rng.below(2) == 0;
        let r = self.array.snapshot(&origin, &name, writable);
        trace!(self, "snapshot {origin} -> {name} writable {writable}: {r:?}");
        match r {
            Ok(_) => {
                self.report.snapshots += 1;
                // The origin's acknowledged writes were made durable first.
                let o = self.model.get_mut(&origin).expect("picked");
                for p in &mut o.pages {
                    p.settle();
                }
                let pages =
                    o.pages.iter().map(|p| Page { versions: vec![p.current().to_vec()], floor: 0 }).collect();
                self.model.insert(name, ModelVol { pages, writable, origin: Some(origin) });
                Ok(())
            }
            Err(e) => {
                self.tolerate(e, "snapshot")?;
                // If it happened, it holds the origin as the origin reads now (its writes were
                // made durable first, or the snapshot did not happen).
                let o = &self.model[&origin];
                let pages =
                    o.pages.iter().map(|p| Page { versions: vec![p.current().to_vec()], floor: 0 }).collect();
                self.uncertain =
                    Some(Uncertain::Appears(name, ModelVol { pages, writable, origin: Some(origin) }));
                self.crash()
            }
        }
    }

    fn delete(&mut self) -> Result<(), String> {
        if self.model.len() <= 1 {
            return Ok(());
        }
        let Some(name) = self.pick_volume(false) else { return Ok(()) };
        let has_children = self.model.values().any(|v| v.origin.as_deref() == Some(name.as_str()));
        let r = self.array.delete(&name, false);
        trace!(self, "delete {name}: {r:?}");
        match r {
            Ok(()) if has_children => Err(format!("deleted {name}, which has snapshots")),
            Ok(()) => {
                self.freeze_loans(Some(&name), 0);
                self.model.remove(&name);
                Ok(())
            }
            Err(FlashError::HasChildren { .. }) if has_children => Ok(()),
            Err(e) => {
                self.tolerate(e, "delete")?;
                self.uncertain = Some(Uncertain::Goes(name));
                self.crash()
            }
        }
    }

    fn resize(&mut self) -> Result<(), String> {
        let Some(name) = self.pick_volume(true) else { return Ok(()) };
        let old = self.model[&name].pages.len() as u64;
        let pages = self.rng.range(4, 200);
        let written_past = self.model[&name].pages[pages.min(old) as usize..]
            .iter()
            .any(|p| p.current().iter().any(|&b| b != 0));
        let r = self.array.resize(&name, pages * PAGE as u64);
        trace!(self, "resize {name} {old} -> {pages}: {r:?}");
        match r {
            Ok(()) => {
                if pages < old && written_past {
                    return Err(format!("shrank {name} below data written"));
                }
                self.freeze_loans(Some(&name), pages);
                let m = self.model.get_mut(&name).expect("picked");
                m.pages.resize_with(pages as usize, Page::zero);
                Ok(())
            }
            Err(FlashError::BadSize(_)) if pages < old => Ok(()),
            Err(e) => {
                self.tolerate(e, "resize")?;
                self.uncertain = Some(Uncertain::Resized(name, pages));
                self.crash()
            }
        }
    }

    /// Now and then lend pool pages to a sender, or send pages lent earlier, with draws of
    /// their own.
    fn lend_or_send(&mut self) -> Result<(), String> {
        match self.loan_rng.below(1000) {
            0..=99 if self.held.len() < 8 => self.lend(),
            100..=179 if !self.held.is_empty() => {
                let i = self.loan_rng.below(self.held.len() as u64) as usize;
                self.send(i)
            }
            _ => Ok(()),
        }
    }

    /// Now and then look ahead over a range, as a front end does before it runs a request, or
    /// land some of the reads held, with draws of their own.
    fn look_ahead_or_land(&mut self) -> Result<(), String> {
        match self.ahead_rng.below(1000) {
            0..=119 => self.look_ahead(),
            120..=299 if self.array.held_reads() > 0 => {
                let n = self.ahead_rng.range(1, self.array.held_reads() as u64);
                for _ in 0..n {
                    let held = self.array.held_reads() as u64;
                    if held == 0 {
                        break;
                    }
                    let i = self.ahead_rng.below(held) as usize;
                    // A read that fails now and then: its pages leave the pool, and whoever
                    // needs them reads them the ordinary way.
                    let fail = self.ahead_rng.below(50) == 0;
                    let ok = self.array.land_held(i, fail);
                    trace!(self, "land read {i} of {held} (fail {fail}): {ok}");
                    self.report.reads_landed += u64::from(ok);
                    self.report.reads_failed += u64::from(!ok);
                }
                self.check_wakes()
            }
            _ => Ok(()),
        }
    }

    /// `Array::prefetch` over a range of a volume, for a read or a write, on a batch of its
    /// own: if it started reads, it waits for its wake.
    fn look_ahead(&mut self) -> Result<(), String> {
        let names: Vec<&String> = self.model.keys().collect();
        let name = names[self.ahead_rng.below(names.len() as u64) as usize].clone();
        let vol = self.array.id_of(&name).map_err(|e| format!("look ahead: {name}: {e}"))?;
        let bytes = self.model[&name].pages.len() as u64 * PAGE as u64;
        let offset = self.ahead_rng.below(bytes);
        let len = self.ahead_rng.range(1, (bytes - offset).min(40 * PAGE as u64));
        let write = self.ahead_rng.below(4) == 0 && self.model[&name].writable;
        self.next_token += 1;
        let token = self.next_token;
        let batch = Arc::new(backend::Batch::new(self.wakes.clone(), token));
        batch.open();
        self.array.prefetch(vol, offset, len, write, &batch);
        let waits = batch.seal();
        trace!(
            self,
            "look ahead {name} {offset}+{len} write {write}: {} started, waits {waits}",
            batch.started()
        );
        if waits {
            self.report.look_aheads += 1;
            let first = offset / PAGE as u64;
            let pages = (offset + len).div_ceil(PAGE as u64) - first;
            self.waiting.push(Ahead { batch, token, name, first, pages });
        } else {
            // Nothing to wait for: nothing of it may end later either.
            self.woken.push(batch);
        }
        self.check_wakes()
    }

    /// Land every read held, in order (as a waiter would).
    fn land_all(&mut self) -> Result<(), String> {
        while self.array.held_reads() > 0 {
            let ok = self.array.land_held(0, false);
            self.report.reads_landed += u64::from(ok);
            self.report.reads_failed += u64::from(!ok);
        }
        self.check_wakes()
    }

    /// Every look-ahead woken was waiting and is woken once; with no read held, every one is
    /// woken. A look-ahead woken reads its range back as the model says (from the pool, if
    /// nothing evicted its pages meanwhile).
    fn check_wakes(&mut self) -> Result<(), String> {
        let woken: Vec<u64> = std::mem::take(&mut *self.wakes.0.lock().unwrap_or_else(|e| e.into_inner()));
        let mut done = Vec::new();
        for token in woken {
            let Some(i) = self.waiting.iter().position(|a| a.token == token) else {
                return Err(format!("look-ahead {token} woken, but it was not waiting (or woken twice)"));
            };
            done.push(self.waiting.swap_remove(i));
        }
        self.woken.extend(done.iter().map(|a| a.batch.clone()));
        // A read ended twice would wake its batch early and then count it past zero.
        if let Some(b) = self.woken.iter().find(|b| b.outstanding() != 0) {
            return Err(format!("look-ahead {} woken with {} reads outstanding", b.token(), b.outstanding()));
        }
        if self.array.held_reads() == 0 && !self.waiting.is_empty() {
            let tokens: Vec<u64> = self.waiting.iter().map(|a| a.token).collect();
            return Err(format!("no read is held, yet look-aheads {tokens:?} were never woken"));
        }
        for a in done {
            // Its volume may have gone, or shrunk, since.
            let Some(m) = self.model.get(&a.name) else { continue };
            let pages = a.pages.min((m.pages.len() as u64).saturating_sub(a.first));
            if pages == 0 {
                continue;
            }
            let vol = self.array.id_of(&a.name).map_err(|e| format!("read ahead: {}: {e}", a.name))?;
            let mut buf = vec![0u8; pages as usize * PAGE];
            if let Err(e) = self.array.read(vol, a.first * PAGE as u64, &mut buf) {
                self.tolerate(e, "read after a look-ahead")?;
                continue;
            }
            for i in 0..pages as usize {
                let want = self.model[&a.name].pages[a.first as usize + i].current();
                if buf[i * PAGE..(i + 1) * PAGE] != *want {
                    return Err(format!(
                        "{} page {} read ahead: not the page last written",
                        a.name,
                        a.first as usize + i
                    ));
                }
                self.report.pages_checked += 1;
            }
        }
        Ok(())
    }

    /// Lend a range of a volume, as a reply does; most often one just read into the pool.
    fn lend(&mut self) -> Result<(), String> {
        let names: Vec<&String> = self.model.keys().collect();
        let name = names[self.loan_rng.below(names.len() as u64) as usize].clone();
        let vol = self.array.id_of(&name).map_err(|e| format!("lend: {name}: {e}"))?;
        let bytes = self.model[&name].pages.len() as u64 * PAGE as u64;
        // Half of them from the start of a page (an unaligned one often spans one more).
        let offset = match self.loan_rng.below(2) {
            0 => self.loan_rng.below(bytes / PAGE as u64) * PAGE as u64,
            _ => self.loan_rng.below(bytes),
        };
        // Mostly within the bound of one read (an eighth of the pool), now and then past it.
        let most = (u64::from(self.cfg.pool_pages) / 8).max(1) + u64::from(self.loan_rng.below(8) == 0);
        let len = self.loan_rng.range(1, (bytes - offset).min(most * PAGE as u64)) as usize;
        let (first, end) = (offset / PAGE as u64, (offset + len as u64).div_ceil(PAGE as u64));
        if self.loan_rng.below(4) != 0 {
            // Read it first, as a reply to an earlier read would have.
            let mut buf = vec![0; (end - first) as usize * PAGE];
            if let Err(e) = self.array.read(vol, first * PAGE as u64, &mut buf) {
                return self.tolerate(e, "read before a lend");
            }
        }
        let mut out = Vec::new();
        let lent = self.array.lend(vol, offset, len, &mut out).map_err(|e| format!("lend {name}: {e}"))?;
        trace!(self, "lend {name} {offset}+{len}: {lent}");
        if !lent {
            return if out.is_empty() {
                Ok(())
            } else {
                Err(format!("lend {name}: refused, yet gave ranges"))
            };
        }
        // The bounds: an eighth of the pool for one read, a quarter at once.
        let pool = self.cfg.pool_pages as u64;
        let lent_now: u64 =
            self.held.iter().filter(|h| h.this_life).map(|h| h.pages.len() as u64).sum::<u64>() + end - first;
        if end - first > (pool / 8).max(1) || lent_now > pool / 4 {
            return Err(format!(
                "lend {name}: {} pages lent, {lent_now} at once, of a pool of {pool}",
                end - first
            ));
        }
        let m = &self.model[&name];
        let pages =
            (first..end).map(|p| HeldPage { since: m.pages[p as usize].versions.len() - 1, frozen: None });
        let held = Held { name, offset, len, bytes: out, pages: pages.collect(), this_life: true };
        // Nothing came between: the bytes lent are the pages' newest versions.
        self.check_sent(&held, true)?;
        self.held.push(held);
        Ok(())
    }

    /// Send loan `i`: check its bytes, and give its pages back.
    fn send(&mut self, i: usize) -> Result<(), String> {
        let held = self.held.swap_remove(i);
        trace!(self, "send {} {}+{}", held.name, held.offset, held.len);
        self.check_sent(&held, false)?;
        self.report.loans += 1;
        self.report.loans_across_crash += u64::from(!held.this_life);
        drop(held);
        self.no_loans_left()
    }

    /// Loan `held`'s bytes, page by page, against what each page may show: when just lent,
    /// its newest version only.
    fn check_sent(&mut self, held: &Held, just_lent: bool) -> Result<(), String> {
        let got: Vec<u8> = held.bytes.iter().flat_map(|b| b.as_slice().iter().copied()).collect();
        if got.len() != held.len {
            return Err(format!("lent {}+{}: {} bytes", held.offset, held.len, got.len()));
        }
        let first = held.first_page();
        let mut overwritten = false;
        for (i, p) in held.pages.iter().enumerate() {
            let vpage = first + i as u64;
            let page_at = vpage * PAGE as u64;
            let from = held.offset.max(page_at) - page_at;
            let to = (held.offset + held.len as u64).min(page_at + PAGE as u64) - page_at;
            let bytes = &got[(page_at + from - held.offset) as usize..(page_at + to - held.offset) as usize];
            let range = from as usize..to as usize;
            let followed;
            let may: &[Vec<u8>] = match &p.frozen {
                Some(v) => v,
                None => {
                    followed = &self.model[&held.name].pages[vpage as usize].versions[p.since..];
                    if just_lent {
                        &followed[followed.len() - 1..]
                    } else {
                        followed
                    }
                }
            };
            match may.iter().rposition(|v| v[range.clone()] == *bytes) {
                Some(at) => overwritten |= at > 0,
                None => {
                    return Err(format!(
                        "{} page {vpage} {}: neither the version lent nor a later one ({} may be)",
                        held.name,
                        if just_lent { "as lent" } else { "as sent" },
                        may.len()
                    ))
                }
            }
            self.report.pages_checked += 1;
        }
        self.report.loans_overwritten += u64::from(overwritten);
        Ok(())
    }

    /// Stop following in the model the lent pages of `name` from page `from` on (all loans'
    /// pages when `name` is `None`): the volume goes, shrinks, or the array crashed.
    fn freeze_loans(&mut self, name: Option<&str>, from: u64) {
        for h in &mut self.held {
            if name.is_some_and(|n| n != h.name) {
                continue;
            }
            let model = self.model.get(&h.name);
            for i in 0..h.pages.len() {
                if h.first_page() + i as u64 >= from {
                    h.freeze(i, model);
                }
            }
        }
    }

    /// With no loan of this life of the array held, none of its pool's slots is lent.
    fn no_loans_left(&mut self) -> Result<(), String> {
        if self.held.iter().any(|h| h.this_life) {
            return Ok(());
        }
        match (self.array.stats().pool_lends, self.array.lent_now()) {
            (0, 0) => self.audit("with every loan given back"),
            (n, counted) => {
                Err(format!("every loan was given back, yet the pool holds {n} ({counted} counted)"))
            }
        }
    }

    /// Crash every device at once, reopen, and check what survived.
    fn crash(&mut self) -> Result<(), String> {
        // Loans keep the array they were lent by, whose pool nothing writes to any more.
        self.freeze_loans(None, 0);
        for h in &mut self.held {
            h.this_life = false;
        }
        self.report.crashes += 1;
        let s = self.array.stats();
        self.report.wear_moves += s.counters.wear_segments_moved;
        self.report.map_evictions += s.map_evictions;
        self.report.map_loads += s.map_loads;
        self.report.pages_read_ahead += s.pages_read_async;
        self.report.device_reads_ahead += s.device_reads_async;
        let mut torn = 0;
        let images: Vec<Vec<u8>> = self
            .devs
            .iter()
            .map(|d| {
                let (image, t) = d.crash_image(&mut self.rng);
                torn += t;
                image
            })
            .collect();
        self.report.torn_writes += torn;
        trace!(self, "crash: {torn} writes torn");
        let lie = self.opts.lie;
        self.devs = images
            .into_iter()
            .enumerate()
            .map(|(i, image)| {
                let r = self.rng.fork(1000 + self.report.crashes * 10 + i as u64);
                Arc::new(CrashDevice::from_image(image, r, DeviceFaults::NONE, lie, format!("sim{i}")))
            })
            .collect();
        let boxed: Vec<Box<dyn Device>> =
            self.devs.iter().map(|d| Box::new(d.clone()) as Box<dyn Device>).collect();
        self.array = Array::open(boxed, self.cfg).map_err(|e| format!("reopen after a crash: {e}"))?;
        self.array.hold_reads(self.read_depth);
        // The reads held by the array that crashed never land; their look-aheads went with it
        // (woken or not).
        self.waiting.clear();
        self.woken.clear();
        self.wakes.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.report.torn_pages_seen += self.array.stats().recovered.torn_pages;
        trace!(self, "recovered: {:?}", self.array.stats().recovered);
        self.array.audit().map_err(|e| format!("audit after recovery: {e}"))?;
        self.verify_after_crash()?;
        for d in &self.devs {
            d.state().faults = self.opts.faults;
        }
        Ok(())
    }

    fn verify_after_crash(&mut self) -> Result<(), String> {
        let listed: BTreeMap<String, (u64, bool)> = self
            .array
            .list()
            .into_iter()
            .map(|v| (v.name, (v.size_bytes / PAGE as u64, v.writable)))
            .collect();
        // A volume change that failed either happened or did not.
        match self.uncertain.take() {
            Some(Uncertain::Appears(name, vol)) if listed.contains_key(&name) => {
                self.model.insert(name, vol);
            }
            Some(Uncertain::Goes(name)) if !listed.contains_key(&name) => {
                self.model.remove(&name);
            }
            Some(Uncertain::Resized(name, pages)) if listed.get(&name).is_some_and(|l| l.0 == pages) => {
                if let Some(m) = self.model.get_mut(&name) {
                    m.pages.resize_with(pages as usize, Page::zero);
                }
            }
            _ => {}
        }
        let modelled: BTreeMap<String, (u64, bool)> =
            self.model.iter().map(|(n, v)| (n.clone(), (v.pages.len() as u64, v.writable))).collect();
        if listed != modelled {
            return Err(format!("volumes after recovery {listed:?}, acknowledged {modelled:?}"));
        }
        let names: Vec<String> = self.model.keys().cloned().collect();
        for name in names {
            let vol = self.array.id_of(&name).map_err(|e| e.to_string())?;
            let pages = self.model[&name].pages.len();
            let mut buf = vec![0u8; pages * PAGE];
            self.array.read(vol, 0, &mut buf).map_err(|e| format!("read {name} after recovery: {e}"))?;
            let m = self.model.get_mut(&name).expect("listed");
            for (i, p) in m.pages.iter_mut().enumerate() {
                let got = &buf[i * PAGE..(i + 1) * PAGE];
                match p.versions.iter().rposition(|v| v == got) {
                    Some(at) if at >= p.floor => p.keep_only(got.to_vec()),
                    Some(at) => {
                        return Err(format!(
                        "{name} page {i}: version {at} after recovery, but version {} was durable (of {})",
                        p.floor,
                        p.versions.len()
                    ))
                    }
                    None => {
                        // A page of the array's own (a group header, a checkpoint) means a map
                        // entry that outlived its segment.
                        let what = if got.starts_with(b"SKFL") {
                            format!("the array's own {} page", String::from_utf8_lossy(&got[..8]))
                        } else {
                            "bytes that no write wrote (torn or lost)".to_owned()
                        };
                        return Err(format!("{name} page {i}: {what}"));
                    }
                }
                self.report.pages_checked += 1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crash_keeps_synced_writes_and_may_tear_the_rest() {
        let d = CrashDevice::new(4, Rng::new(1), DeviceFaults::NONE, Lie::None, "t".into());
        d.write(0, &[1; PAGE]).unwrap();
        d.sync().unwrap();
        d.write(0, &[2; PAGE]).unwrap();
        let mut seen = std::collections::HashSet::new();
        let mut rng = Rng::new(9);
        for _ in 0..64 {
            let (image, _) = d.crash_image(&mut rng);
            let first = &image[..PAGE];
            let kind = if first.iter().all(|&b| b == 1) {
                "old"
            } else if first.iter().all(|&b| b == 2) {
                "new"
            } else {
                assert!(first.iter().all(|&b| b == 1 || b == 2), "only whole sectors of either");
                "torn"
            };
            seen.insert(kind);
        }
        assert_eq!(seen.len(), 3, "old, new and torn all happen: {seen:?}");
    }
}
