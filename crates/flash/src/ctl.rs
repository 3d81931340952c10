//! The flash controller, sans-I/O: volumes and their maps, the page pool's states, write
//! groups, garbage collection and checkpoints, as plain data driven by calls.
//!
//! The controller never touches a device or the pool's bytes, but for one thing: map leaves
//! evicted under the map budget are read back through the `map::LeafSource` the driver gave
//! it (the checkpoint's pages, through the driver's own reads). It answers `get` with what the
//! caller must do (use a pooled page, read one from flash into a slot, wait), hands out write
//! groups to write (`writeback`, `gc_writeback`) and learns their fate (`written`), and turns
//! device images into plans (`gc_scan`, recovery in `recover`). The driver (`engine`) holds
//! it behind one lock and does the I/O in between; the simulator drives it over a faulty
//! device.
//!
//! Durability follows the log: every change to a map is a record in a write group (data
//! writes and moves carry their page; trims and volume changes ride in the next group), and
//! replay after a crash applies the groups after the last checkpoint in sequence order. A
//! write is durable once a device sync covers its group; `flush` and FUA writes wait for
//! that, and for every group issued before theirs, so a durable group never follows one that
//! might be lost (recovery reads each segment's groups as a chain and stops at the first gap).

use std::collections::{BTreeMap, HashMap};

use crate::layout::{CkptRef, GroupHeader, Pba, Record, SegmentHeader, NAME_MAX, PAGE};
use crate::map::{Map, VolMap, LEAF_PAGES};
use crate::pool::{Pool, SlotId, SlotState};
use crate::space::{Grant, Space, State, Stream, VictimPolicy, CLASSES};
use crate::FlashError;

pub type VolId = u32;

/// What the controller is told at start.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// DRAM pages in the pool.
    pub pool_pages: u32,
    /// Streams by origin and age class (`space::Stream`); off: one stream for everything.
    pub segregation: bool,
    pub policy: VictimPolicy,
    /// The youngest age class: pages rewritten every fewer than this many user page writes
    /// (estimated, see `PageMeta::interval`); each older class's bound is `CLASS_SPREAD`
    /// times the one before. 0: half the array's pages (the best of the shares tried in
    /// `examples/write_amp.rs`).
    pub hot_window_pages: u64,
    /// Most data pages in one write group.
    pub group_pages_max: u32,
    /// Static wear levelling: erases by which the most-worn segment may lead the least-worn
    /// full one (`space::Space::wear_victim`).
    pub wear_spread_max: u32,
    /// Bytes of map leaves and per-page side tables to keep in memory (0: no bound). Past it,
    /// leaves stored in the last checkpoint are evicted and read back when wanted, and side
    /// tables of stretches with nothing in the pool are dropped (`Controller::shed`).
    pub map_budget: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            pool_pages: 16384,
            segregation: true,
            policy: VictimPolicy::CostBenefit,
            hot_window_pages: 0,
            group_pages_max: 128,
            wear_spread_max: 64,
            map_budget: 0,
        }
    }
}

/// How a page is wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    /// To overwrite every byte of it.
    WriteWhole,
    /// To overwrite some of it: the rest must be there first.
    WritePart,
}

/// What `get` asks of the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Got {
    /// The page is in `slot`, pinned: use its bytes, then `put`.
    Ready(SlotId),
    /// The page is in `slot`, pinned, with no valid bytes: fill all of it (zeroes first for a
    /// partial write), then `put` dirty.
    Fresh(SlotId),
    /// Never written (or trimmed): it reads as zeroes. Nothing is pinned.
    Zero,
    /// Read `pba` into `slot` (pinned), then `fetched`.
    Fetch { slot: SlotId, pba: Pba },
    /// Another user is fetching or filling it: wait for that, then ask again.
    Busy,
    /// Not in the pool and no slot to be had (every one is pinned, dirty or in flight): read
    /// `pba` straight into the caller's buffer, without caching it, then `read_done`.
    Direct(Pba),
    /// No slot can be had: write-back must make room first.
    PoolFull,
}

/// Where a data page of a write group comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Slot(SlotId),
    /// A page of the segment image garbage collection read, at this byte offset.
    Image(usize),
}

/// A write group to write: the header page at `pba`, its data pages after it.
#[derive(Debug, Clone)]
pub struct GroupPlan {
    pub seq: u64,
    pub pba: Pba,
    /// The segment was opened for this group: write its header first (at its page 0).
    pub opened: Option<SegmentHeader>,
    /// The header, with every data record's CRC still 0: the driver sets them from the
    /// bytes it writes (`set_crcs`).
    pub header: GroupHeader,
    pub sources: Vec<Source>,
}

impl GroupPlan {
    /// Put the data pages' CRCs into their records, in order.
    pub fn set_crcs(&mut self, crcs: &[u32]) {
        let mut it = crcs.iter();
        for r in &mut self.header.records {
            match r {
                Record::Write { crc, .. } | Record::Move { crc, .. } => {
                    *crc = *it.next().expect("a CRC per data page")
                }
                _ => {}
            }
        }
    }
}

/// What reading a page ahead of its request needs ([`Controller::ahead`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ahead {
    /// Nothing from flash: it is in the pool (or being filled by a write), never written, or
    /// its leaf is evicted where the caller cannot read it (its `get` reads it back).
    Nothing,
    /// On its way in: slot `0` is being read from flash for someone else (`Fetching`).
    Arriving(SlotId),
    /// The page: it is mapped and on flash only.
    Page,
    /// Its evicted map leaf first.
    Leaf(LeafRead),
}

/// An evicted map leaf to read back: `pages` checkpoint pages from `pba`, of checkpoint `seq`,
/// holding leaf `id`'s record at byte `at` of its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeafRead {
    pub id: crate::map::LeafId,
    pub at: u64,
    pub seq: u64,
    pub pba: Pba,
    pub pages: u32,
}

/// A page garbage collection must move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcMove {
    pub vol: VolId,
    pub vpage: u64,
    pub old: Pba,
    /// Byte offset of its data in the segment image.
    pub at: usize,
    /// Its age class when the segment was scanned (0 with segregation off).
    pub class: u8,
}

/// One volume.
#[derive(Debug)]
pub struct Volume {
    pub id: VolId,
    pub name: String,
    pub family: u32,
    pub map: VolMap,
    pub writable: bool,
    pub origin: Option<VolId>,
    /// Pool slots (slot + 1; 0: none) and last-write clocks of its pages, by leaf.
    meta: Vec<Option<Box<PageMeta>>>,
    /// Of `meta`, the stretches in memory.
    chunks: usize,
}

#[derive(Debug)]
struct PageMeta {
    /// Pages of this stretch with a slot, and whether it was used since the shedding clock
    /// last passed (`Controller::shed`).
    slots: u16,
    touched: bool,
    slot: [u32; LEAF_PAGES],
    /// The heat clock when each page was last written by a user (0: never).
    written: [u16; LEAF_PAGES],
    /// Each page's estimated rewrite interval, in heat-clock ticks: the mean of the last
    /// interval and the estimate before it (0: never written).
    interval: [u16; LEAF_PAGES],
}

/// The largest volume, in pages: 16 TiB, what the widest array can address. Volumes are thin,
/// but their maps' directories are not: a size with no bound would be an allocation with none.
pub const VOLUME_PAGES_MAX: u64 = 1 << 32;

fn check_volume_pages(pages: u64) -> Result<(), FlashError> {
    if pages == 0 {
        return Err(FlashError::BadSize("a volume needs at least one page".into()));
    }
    if pages > VOLUME_PAGES_MAX {
        return Err(FlashError::BadSize(format!(
            "{pages} pages is over the largest volume, {VOLUME_PAGES_MAX} pages (16 TiB)"
        )));
    }
    Ok(())
}

/// Each age class's bound is this many times the one before.
const CLASS_SPREAD: u64 = 4;

/// The heat clock ticks once per `1 << heat_shift` user page writes, where `heat_shift` makes
/// the array's capacity at most `1 << HEAT_TICKS_PER_ARRAY` ticks: the `u16` clock then turns
/// over once per 128 arrays' worth of writes, far beyond the oldest class's bound.
const HEAT_TICKS_PER_ARRAY: u32 = 9;

/// The age class (0: youngest, `CLASSES - 1`: oldest) of a page rewritten every `interval`
/// heat-clock ticks, when class 0 is under `window` ticks.
fn age_class(interval: u16, window: u64) -> u8 {
    let mut bound = window;
    for c in 0..CLASSES - 1 {
        if u64::from(interval) < bound {
            return c;
        }
        bound *= CLASS_SPREAD;
    }
    CLASSES - 1
}

/// The estimate of a page's rewrite interval after a write `gap` ticks after the last one, from
/// the estimate before (0: none). Averaging two intervals tells a hot page that was left alone
/// once, or a cold page written twice in a row, from its kind far better than one interval
/// does (`examples/write_amp.rs`: 2.58 against 2.37 at 80/20 in steady state).
fn next_interval(before: u16, gap: u16) -> u16 {
    let est = if before == 0 { gap } else { ((u32::from(before) + u32::from(gap)) / 2) as u16 };
    est.max(1)
}

/// The heat clock's reading after `user_pages_written` user page writes (never 0).
fn heat_now(user_pages_written: u64, shift: u32) -> u16 {
    ((user_pages_written >> shift) as u16).max(1)
}

/// Bytes evicting a leaf frees: its entries, and the allocator's header of their box. (What
/// every leaf in use keeps whether in memory or not, its slab slot, shares, offsets, clock
/// bit and count of mapped entries, 31 bytes, is not counted: docs/FLASH.md, "Memory".)
pub const LEAF_BYTES: u64 = (LEAF_PAGES * 4 + 16) as u64;
/// Bytes dropping a side-table stretch frees (`PageMeta`, boxed).
pub const META_BYTES: u64 = std::mem::size_of::<PageMeta>() as u64 + 16;
/// The fewest leaves a budget keeps. One operation may need more at once (a move's family, a
/// copy on write): they are read back as it goes, and shed after it.
const MAP_BUDGET_LEAVES_MIN: usize = 1;
/// Side tables are counted against the budget once per this many calls to `shed`.
const SHED_META_EVERY: u32 = 64;

/// Leaves `cfg`'s map budget holds when side tables take none of it (`usize::MAX`: no bound).
fn budget_leaves(cfg: &Config) -> usize {
    match cfg.map_budget {
        0 => usize::MAX,
        b => (b / LEAF_BYTES).max(MAP_BUDGET_LEAVES_MIN as u64) as usize,
    }
}

/// Bytes of a `Record::Write` in a group header.
const WRITE_RECORD_BYTES: usize = 17;

impl Volume {
    fn new(
        id: VolId,
        name: String,
        family: u32,
        map: VolMap,
        writable: bool,
        origin: Option<VolId>,
    ) -> Volume {
        let leaves = map.leaves.len();
        Volume {
            id,
            name,
            family,
            map,
            writable,
            origin,
            meta: (0..leaves).map(|_| None).collect(),
            chunks: 0,
        }
    }

    /// A volume read back from a checkpoint (its pool state is empty).
    pub(crate) fn restored(
        id: VolId,
        name: String,
        family: u32,
        map: VolMap,
        writable: bool,
        origin: Option<VolId>,
    ) -> Volume {
        Volume::new(id, name, family, map, writable, origin)
    }

    fn meta_mut(&mut self, vpage: u64) -> &mut PageMeta {
        let l = (vpage / LEAF_PAGES as u64) as usize;
        if self.meta.len() <= l {
            self.meta.resize_with(l + 1, || None);
        }
        let chunks = &mut self.chunks;
        let m = self.meta[l].get_or_insert_with(|| {
            *chunks += 1;
            Box::new(PageMeta {
                slots: 0,
                touched: true,
                slot: [0; LEAF_PAGES],
                written: [0; LEAF_PAGES],
                interval: [0; LEAF_PAGES],
            })
        });
        m.touched = true;
        m
    }

    fn slot_of(&self, vpage: u64) -> Option<SlotId> {
        let l = (vpage / LEAF_PAGES as u64) as usize;
        let m = self.meta.get(l)?.as_ref()?;
        let s = m.slot[(vpage % LEAF_PAGES as u64) as usize];
        (s != 0).then(|| s - 1)
    }

    fn set_slot(&mut self, vpage: u64, slot: Option<SlotId>) {
        let i = (vpage % LEAF_PAGES as u64) as usize;
        let l = (vpage / LEAF_PAGES as u64) as usize;
        if slot.is_none() && !matches!(self.meta.get(l), Some(Some(_))) {
            return;
        }
        let m = self.meta_mut(vpage);
        let new = slot.map_or(0, |s| s + 1);
        let old = std::mem::replace(&mut m.slot[i], new);
        m.slots = m.slots + u16::from(new != 0) - u16::from(old != 0);
    }

    /// Side-table stretches in memory.
    fn meta_chunks(&self) -> usize {
        self.chunks
    }

    pub fn pages(&self) -> u64 {
        self.map.pages
    }
}

/// What the controller counts (thesis 5.4.6; `vol stats`, metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub user_pages_written: u64,
    pub gc_pages_moved: u64,
    /// Every page written to the devices: data, group headers, segment headers, checkpoints.
    pub device_pages_written: u64,
    pub device_pages_read: u64,
    pub groups_written: u64,
    pub gc_segments_cleaned: u64,
    /// Of those, cleaned to level wear (since the array was opened).
    pub wear_segments_moved: u64,
    pub checkpoints: u64,
    pub pool_hits: u64,
    pub pool_misses: u64,
    pub evictions: u64,
}

/// The state of the whole array.
#[derive(Debug)]
pub struct Controller {
    pub cfg: Config,
    pub map: Map,
    pub space: Space,
    pub pool: Pool,
    pub vols: BTreeMap<VolId, Volume>,
    /// Every volume id ever made, with its family: a deleted volume's records still name it.
    pub families: HashMap<VolId, u32>,
    pub next_vol: VolId,
    pub next_family: u32,
    /// The next write group's sequence number.
    pub next_seq: u64,
    /// No group is handed out with a sequence number at or above this until the driver has
    /// made a higher ceiling durable (`layout::Superblock::seq_ceiling`).
    pub seq_ceiling: u64,
    /// Groups handed out and not yet `written`.
    in_flight: BTreeMap<u64, GroupPlan>,
    /// Trims and volume changes waiting for the next group.
    pending: Vec<Record>,
    /// Cleaned segments that may hold pages a waiting trim or volume change unmapped: they are
    /// released with the group that carries the last of `pending`, never before (a crash
    /// before that group is durable brings those pages back into the map).
    released_after_pending: Vec<u32>,
    /// Every group up to this one is durable.
    pub durable_seq: u64,
    /// The last complete checkpoint.
    pub checkpoint: Option<CkptRef>,
    /// Segments of the last complete checkpoint (freed when the next one is durable).
    pub checkpoint_segments: Vec<u32>,
    /// Where it lies, in order: evicted map leaves are read back from it.
    pub checkpoint_chain: Option<crate::ckpt::Chain>,
    /// A device write failed: the array takes no more writes.
    pub failed: bool,
    pub counters: Counters,
    /// The heat clock ticks once per `1 << heat_shift` user page writes.
    heat_shift: u32,
    /// Where the side-table shedding clock stands: a volume and a stretch of it.
    shed_hand: (VolId, usize),
    /// Calls since side tables were last counted against the budget.
    shed_calls: u32,
}

/// Free segments kept for garbage collection and checkpoints: enough to move the contents
/// of one victim, to open a segment in every stream, and to write a checkpoint.
pub fn reserve_for(total_segments: u32) -> u32 {
    // A victim's pages go to up to `CLASSES` streams, each of which may need a segment; one
    // more for a checkpoint.
    (u32::from(CLASSES) + 1 + total_segments / 64).min(total_segments / 4)
}

impl Controller {
    /// A fresh, empty array of `segments` segments of `segment_pages` pages.
    pub fn new(mut cfg: Config, segments: u32, segment_pages: u32) -> Controller {
        if cfg.hot_window_pages == 0 {
            cfg.hot_window_pages = u64::from(segments) * u64::from(segment_pages) / 2;
        }
        let capacity = u64::from(segments) * u64::from(segment_pages);
        let heat_shift = (64 - capacity.leading_zeros()).saturating_sub(HEAT_TICKS_PER_ARRAY);
        // At least a tick; the oldest class's bound under half the clock's turn.
        let widest = (1u64 << 15) / CLASS_SPREAD.pow(u32::from(CLASSES) - 2);
        cfg.hot_window_pages = cfg.hot_window_pages.clamp(1 << heat_shift, widest << heat_shift);
        // A bound of 0 would chase its own moves: each one erases a segment.
        cfg.wear_spread_max = cfg.wear_spread_max.max(1);
        let mut space = Space::new(segments, segment_pages, reserve_for(segments));
        space.policy = cfg.policy;
        space.wear_spread_max = cfg.wear_spread_max;
        let mut map = Map::new(segments, segment_pages);
        // Side tables are counted against the budget as they come (`shed`).
        map.set_budget(budget_leaves(&cfg));
        Controller {
            cfg,
            map,
            heat_shift,
            space,
            pool: Pool::new(cfg.pool_pages),
            vols: BTreeMap::new(),
            families: HashMap::new(),
            next_vol: 1,
            next_family: 1,
            next_seq: 1,
            seq_ceiling: 0,
            in_flight: BTreeMap::new(),
            pending: Vec::new(),
            released_after_pending: Vec::new(),
            durable_seq: 0,
            checkpoint: None,
            checkpoint_segments: Vec::new(),
            checkpoint_chain: None,
            failed: false,
            counters: Counters::default(),
            shed_hand: (0, 0),
            shed_calls: 0,
        }
    }

    // ---------------------------------------------------------------------------------
    // Memory

    /// Leaves the map budget keeps in memory (`usize::MAX`: no bound), before side tables.
    pub fn map_budget_leaves(&self) -> usize {
        budget_leaves(&self.cfg)
    }

    /// Side-table stretches in memory, over every volume.
    fn meta_chunks(&self) -> usize {
        self.vols.values().map(Volume::meta_chunks).sum()
    }

    /// Bytes of map leaves and side tables in memory.
    pub fn map_memory(&self) -> u64 {
        self.map.resident() as u64 * LEAF_BYTES + self.meta_chunks() as u64 * META_BYTES
    }

    /// Keep to the map budget: drop side tables of stretches with no page in the pool (their
    /// heat estimates go: those pages count as the oldest again) until they hold at most half
    /// of it, then evict leaves stored in the checkpoint to the rest. Cheap when under it.
    pub fn shed(&mut self) {
        if self.cfg.map_budget == 0 {
            return;
        }
        let budget = self.cfg.map_budget;
        self.shed_calls += 1;
        if self.shed_calls >= SHED_META_EVERY {
            self.shed_calls = 0;
            let chunks = self.meta_chunks();
            let cap = (budget / 2 / META_BYTES) as usize;
            if chunks > cap {
                self.shed_meta(chunks - cap);
            }
            // Side tables of stretches with pages in the pool cannot go: past half the budget,
            // they take it from the pool's share, not from the leaves' half.
            let meta = (self.meta_chunks() as u64 * META_BYTES).min(budget / 2);
            let leaves = (budget.saturating_sub(meta) / LEAF_BYTES).max(MAP_BUDGET_LEAVES_MIN as u64);
            self.map.set_budget(leaves as usize);
        }
        self.map.shed();
    }

    /// Drop up to `n` side-table stretches that have no page in the pool, by a clock over
    /// the volumes' stretches (a stretch used since the hand last passed is spared once).
    fn shed_meta(&mut self, mut n: usize) {
        let rows: usize = self.vols.values().map(|v| v.meta.len()).sum();
        let (mut vol, mut row) = self.shed_hand;
        let mut looked = 0;
        while n > 0 && looked < 2 * rows {
            let Some((&id, v)) = self.vols.range_mut(vol..).next() else {
                (vol, row) = (0, 0);
                if self.vols.is_empty() {
                    break;
                }
                continue;
            };
            if id != vol {
                (vol, row) = (id, 0);
            }
            if row >= v.meta.len() {
                (vol, row) = (id + 1, 0);
                continue;
            }
            looked += 1;
            if let Some(m) = &mut v.meta[row] {
                if m.slots == 0 && !std::mem::take(&mut m.touched) {
                    v.meta[row] = None;
                    v.chunks -= 1;
                    n -= 1;
                }
            }
            row += 1;
        }
        self.shed_hand = (vol, row);
    }

    pub fn segment_pages(&self) -> u32 {
        self.space.segment_pages
    }

    // ---------------------------------------------------------------------------------
    // Volumes

    pub fn find(&self, name: &str) -> Option<&Volume> {
        self.vols.values().find(|v| v.name == name)
    }

    pub fn volume(&self, id: VolId) -> Result<&Volume, FlashError> {
        self.vols.get(&id).ok_or(FlashError::NoSuchVolume)
    }

    fn check_name(&self, name: &str) -> Result<(), FlashError> {
        if name.is_empty() || name.len() > NAME_MAX || name.chars().any(|c| c.is_control() || c == '/') {
            return Err(FlashError::BadName(name.to_owned()));
        }
        if self.find(name).is_some() {
            return Err(FlashError::NameTaken(name.to_owned()));
        }
        Ok(())
    }

    /// A new, empty volume of `pages` pages. The record rides in the next group: the driver
    /// writes it and syncs before it answers.
    pub fn create(&mut self, name: &str, pages: u64) -> Result<VolId, FlashError> {
        self.writable()?;
        self.check_name(name)?;
        check_volume_pages(pages)?;
        let (vol, family) = (self.next_vol, self.next_family);
        self.change(Record::Create { vol, family, pages, name: name.to_owned() })?;
        Ok(vol)
    }

    /// Grow or shrink a volume. Shrinking below what is written is refused unless `discard`.
    pub fn resize(&mut self, vol: VolId, pages: u64, discard: bool) -> Result<(), FlashError> {
        self.writable()?;
        let v = self.volume(vol)?;
        if !v.writable {
            return Err(FlashError::ReadOnly);
        }
        check_volume_pages(pages)?;
        if pages < v.map.pages && !discard {
            let v = &self.vols[&vol];
            for p in pages..v.map.pages {
                if self.map.get(&v.map, p)? != 0 || v.slot_of(p).is_some() {
                    return Err(FlashError::BadSize(format!(
                        "data is written past page {pages}: shrinking would discard it"
                    )));
                }
            }
        }
        self.change(Record::Resize { vol, pages })
    }

    /// A read-only snapshot (`writable` false) or a writable clone of `origin`, sharing all
    /// its pages. The caller wrote back `origin`'s dirty pages first (`writeback` with
    /// `only_vol`), so the snapshot holds every write acknowledged before it.
    pub fn snapshot(&mut self, origin: VolId, name: &str, writable: bool) -> Result<VolId, FlashError> {
        self.writable()?;
        self.check_name(name)?;
        let o = self.volume(origin)?;
        if o.meta.iter().flatten().any(|m| m.slot.iter().any(|&s| s != 0 && self.slot_is_dirty(s - 1))) {
            return Err(FlashError::Busy("the origin has pages not written back yet"));
        }
        let vol = self.next_vol;
        self.change(Record::Snapshot { vol, origin, writable, name: name.to_owned() })?;
        Ok(vol)
    }

    fn slot_is_dirty(&self, s: SlotId) -> bool {
        matches!(
            self.pool.slot(s).state,
            SlotState::Dirty | SlotState::WritingBack { .. } | SlotState::Filling
        )
    }

    /// Delete a volume. Refused while snapshots of it exist (they are its children: delete
    /// them first), unless it is itself a snapshot or clone.
    pub fn delete(&mut self, vol: VolId) -> Result<(), FlashError> {
        self.writable()?;
        let v = self.volume(vol)?;
        let children: Vec<&str> =
            self.vols.values().filter(|c| c.origin == Some(vol)).map(|c| c.name.as_str()).collect();
        if !children.is_empty() {
            return Err(FlashError::HasChildren { name: v.name.clone(), children: children.join(", ") });
        }
        self.change(Record::Delete { vol })
    }

    /// Make a checked change live: apply it and queue its record for the next group. A map
    /// leaf that cannot be read back fails the array (the change may be half made).
    fn change(&mut self, rec: Record) -> Result<(), FlashError> {
        if let Err(e) = self.apply(&rec) {
            self.failed = true;
            return Err(e);
        }
        self.pending.push(rec);
        self.shed();
        Ok(())
    }

    /// Apply a record's change to the maps and the volume table (live, and in replay).
    pub fn apply(&mut self, r: &Record) -> Result<(), FlashError> {
        match r {
            Record::Create { vol, family, pages, name } => {
                let v = Volume::new(*vol, name.clone(), *family, VolMap::new(*pages), true, None);
                self.vols.insert(*vol, v);
                self.families.insert(*vol, *family);
                self.next_vol = self.next_vol.max(vol + 1);
                self.next_family = self.next_family.max(family + 1);
            }
            Record::Resize { vol, pages } => {
                if self.vols.contains_key(vol) {
                    self.drop_slots(*vol, *pages, u64::MAX);
                    let v = self.vols.get_mut(vol).expect("checked");
                    self.map.resize(&mut v.map, *pages)?;
                }
            }
            Record::Delete { vol } => {
                if self.vols.contains_key(vol) {
                    self.drop_slots(*vol, 0, u64::MAX);
                    // The volume goes once its leaves have: after an error it keeps the rest.
                    let v = self.vols.get_mut(vol).expect("checked");
                    self.map.drop_map(&mut v.map)?;
                    self.vols.remove(vol);
                }
            }
            Record::Snapshot { vol, origin, writable, name } => {
                if let Some(o) = self.vols.get(origin) {
                    let family = o.family;
                    let map = self.map.share(&o.map);
                    self.vols
                        .insert(*vol, Volume::new(*vol, name.clone(), family, map, *writable, Some(*origin)));
                    self.families.insert(*vol, family);
                    self.next_vol = self.next_vol.max(vol + 1);
                }
            }
            Record::Trim { vol, vpage, pages } => {
                if self.vols.contains_key(vol) {
                    self.drop_slots(*vol, *vpage, *pages);
                    let v = self.vols.get_mut(vol).expect("checked");
                    self.map.trim(&mut v.map, *vpage, *pages)?;
                }
            }
            Record::Write { .. } | Record::Move { .. } => {
                debug_assert!(false, "data records are applied by `written`")
            }
        }
        Ok(())
    }

    /// Let go of the pool slots of `count` pages of `vol` from `first`.
    fn drop_slots(&mut self, vol: VolId, first: u64, count: u64) {
        let Some(v) = self.vols.get_mut(&vol) else { return };
        let end = first.saturating_add(count).min(v.map.pages.max(v.meta.len() as u64 * LEAF_PAGES as u64));
        let mut p = first;
        while p < end {
            let l = (p / LEAF_PAGES as u64) as usize;
            let Some(Some(m)) = v.meta.get_mut(l) else {
                p = (l as u64 + 1) * LEAF_PAGES as u64;
                continue;
            };
            let i = (p % LEAF_PAGES as u64) as usize;
            if m.slot[i] != 0 {
                let s = m.slot[i] - 1;
                m.slot[i] = 0;
                m.slots -= 1;
                self.pool.discard(s);
            }
            p += 1;
        }
    }

    // ---------------------------------------------------------------------------------
    // The data path

    fn writable(&self) -> Result<(), FlashError> {
        if self.failed {
            return Err(FlashError::Failed);
        }
        Ok(())
    }

    /// Page `vpage` of `vol`, wanted for `access`. See [`Got`].
    pub fn get(&mut self, vol: VolId, vpage: u64, access: Access) -> Result<Got, FlashError> {
        let v = self.vols.get(&vol).ok_or(FlashError::NoSuchVolume)?;
        if vpage >= v.map.pages {
            return Err(FlashError::OutOfRange);
        }
        if access != Access::Read {
            self.writable()?;
            if !v.writable {
                return Err(FlashError::ReadOnly);
            }
        }
        if let Some(s) = v.slot_of(vpage) {
            return Ok(match self.pool.slot(s).state {
                SlotState::Fetching | SlotState::Filling => Got::Busy,
                SlotState::Clean | SlotState::Dirty | SlotState::WritingBack { .. } => {
                    self.pool.pin(s);
                    self.counters.pool_hits += 1;
                    Got::Ready(s)
                }
                SlotState::Free => unreachable!("a volume points at a free slot"),
            });
        }
        // A whole-page write needs nothing of the old page, its PBA included: its leaf (read
        // back, if the map evicted it) is wanted only when the page is written back.
        let pba = if access == Access::WriteWhole {
            0
        } else {
            let pba = self.map.get(&v.map, vpage)?;
            self.shed();
            pba
        };
        if pba == 0 && access == Access::Read {
            return Ok(Got::Zero);
        }
        if access != Access::Read && !self.has_room_for_one_more() {
            return Err(FlashError::NoSpace);
        }
        let state = match (access, pba) {
            (Access::WriteWhole, _) | (_, 0) => SlotState::Filling,
            _ => SlotState::Fetching,
        };
        let Some((s, evicted)) = self.pool.take(vol, vpage, state) else {
            // A read never waits for room: flash holds the newest copy of a page not in the pool.
            if access != Access::Read {
                return Ok(Got::PoolFull);
            }
            self.space.read_begins(pba / self.space.segment_pages);
            return Ok(Got::Direct(pba));
        };
        if let Some((ev_vol, ev_page)) = evicted {
            self.counters.evictions += 1;
            if let Some(ev) = self.vols.get_mut(&ev_vol) {
                ev.set_slot(ev_page, None);
            }
        }
        self.vols.get_mut(&vol).expect("checked").set_slot(vpage, Some(s));
        self.counters.pool_misses += 1;
        Ok(if state == SlotState::Fetching {
            self.space.read_begins(pba / self.space.segment_pages);
            Got::Fetch { slot: s, pba }
        } else {
            Got::Fresh(s)
        })
    }

    /// Page `vpage` of `vol` lent to a sender, only if its bytes are in the pool now: kept in
    /// its slot (neither evicted nor freed) until [`give_back`](Self::give_back). Not counted
    /// as a hit: the caller counts the pages once all of a read's are lent. `None` (a miss, a
    /// hole, a page being read in or filled) changes nothing: the caller reads the usual way.
    /// Writes to the page, its write-back and syncs go on: a loan holds only the slot.
    pub fn lend(&mut self, vol: VolId, vpage: u64) -> Result<Option<SlotId>, FlashError> {
        let v = self.vols.get(&vol).ok_or(FlashError::NoSuchVolume)?;
        if vpage >= v.map.pages {
            return Err(FlashError::OutOfRange);
        }
        let Some(s) = v.slot_of(vpage) else { return Ok(None) };
        Ok(match self.pool.slot(s).state {
            SlotState::Clean | SlotState::Dirty | SlotState::WritingBack { .. } => {
                self.pool.lend(s);
                Some(s)
            }
            SlotState::Fetching | SlotState::Filling | SlotState::Free => None,
        })
    }

    /// A sender let go of `slot`, lent by [`lend`](Self::lend). Returns whether the slot was
    /// freed (its page was dropped meanwhile).
    pub fn give_back(&mut self, slot: SlotId) -> bool {
        self.pool.give_back(slot)
    }

    /// What a read of `vpage` of `vol` would need from flash now, for a caller that reads it
    /// ahead of its request. Touches no counter and pins nothing.
    pub fn ahead(&self, vol: VolId, vpage: u64) -> Ahead {
        let Some(v) = self.vols.get(&vol) else { return Ahead::Nothing };
        if vpage >= v.map.pages {
            return Ahead::Nothing;
        }
        if let Some(s) = v.slot_of(vpage) {
            return match self.pool.slot(s).state {
                SlotState::Fetching => Ahead::Arriving(s),
                _ => Ahead::Nothing,
            };
        }
        match self.map.get_resident(&v.map, vpage) {
            Some(0) => Ahead::Nothing,
            Some(_) => Ahead::Page,
            None => self.leaf_read(v, vpage).map_or(Ahead::Nothing, Ahead::Leaf),
        }
    }

    /// Where to read the evicted leaf that maps `vpage` of `v` back from. `None`: the leaf is
    /// in memory (or there is none), or its pages do not lie together.
    fn leaf_read(&self, v: &Volume, vpage: u64) -> Option<LeafRead> {
        let (id, at) = self.map.evicted(&v.map, vpage)?;
        let chain = self.checkpoint_chain.as_ref()?;
        let (index, pages, together) = chain.record_pages(at);
        let pba = chain.pba(index).ok()?;
        together.then_some(LeafRead { id, at, seq: chain.seq, pba, pages })
    }

    /// The pages `read` names landed in `images`: put the leaf back, unless a checkpoint or a
    /// change came in between. Returns whether it went back. (The caller sheds: a group's
    /// leaves go back together, before it is mapped.)
    pub fn leaf_landed(&mut self, read: &LeafRead, images: &mut [u8]) -> Result<bool, FlashError> {
        let Some(chain) = self.checkpoint_chain.as_ref().filter(|c| c.seq == read.seq) else {
            return Ok(false);
        };
        let leaf = chain.leaf_from_pages(read.id, read.at, images)?;
        Ok(self.map.install(read.id, read.at, leaf))
    }

    /// The evicted leaves mapping group `plan` will change (a write's volume's, every member
    /// of a move's family's), for the driver to read back before it takes the lock to map it.
    pub fn evicted_leaves_of(&self, plan: &GroupPlan) -> Vec<LeafRead> {
        let mut out: Vec<LeafRead> = Vec::new();
        if self.map.resident() == self.map.leaves_in_use() {
            return out; // nothing evicted (always so without a budget)
        }
        for r in plan.header.records.iter().filter(|r| r.carries_page()) {
            let (Record::Write { vol, vpage, .. } | Record::Move { vol, vpage, .. }) = r else {
                unreachable!()
            };
            let family = matches!(r, Record::Move { .. }).then(|| self.families.get(vol).copied()).flatten();
            let members = self.vols.values().filter(|v| v.id == *vol || Some(v.family) == family);
            for v in members {
                if let Some(read) = self.leaf_read(v, *vpage) {
                    if !out.iter().any(|o| o.id == read.id) {
                        out.push(read);
                    }
                }
            }
        }
        out
    }

    /// The read of a page into `slot` finished (`ok`) or failed; on failure the page leaves
    /// the pool and the next `get` tries again.
    /// A `Got::Direct` read of `pba` is done.
    pub fn read_done(&mut self, pba: Pba) {
        self.space.read_ends(pba / self.space.segment_pages);
    }

    /// The `Got::Fetch` of `slot` from `pba` is done (`ok`: its bytes are in the slot).
    pub fn fetched(&mut self, slot: SlotId, pba: Pba, ok: bool) {
        self.read_done(pba);
        self.counters.device_pages_read += 1;
        self.pool.fetched(slot, ok);
        if !ok {
            let s = *self.pool.slot(slot);
            if let Some(v) = self.vols.get_mut(&s.vol) {
                if v.slot_of(s.vpage) == Some(slot) {
                    v.set_slot(s.vpage, None);
                }
            }
        }
    }

    /// The age class of page `vpage` of `vol` for a move: by its estimated interval, or the
    /// time since its last write if that is longer (a page left alone has cooled). A page
    /// of a volume deleted since, or not written since the array was opened, is the oldest.
    fn move_class(&self, vol: VolId, vpage: u64) -> u8 {
        let Some(v) = self.vols.get(&vol) else { return CLASSES - 1 };
        let Some(Some(m)) = v.meta.get((vpage / LEAF_PAGES as u64) as usize) else { return CLASSES - 1 };
        let i = (vpage % LEAF_PAGES as u64) as usize;
        if m.written[i] == 0 {
            return CLASSES - 1;
        }
        let since = heat_now(self.counters.user_pages_written, self.heat_shift).wrapping_sub(m.written[i]);
        age_class(since.max(m.interval[i]), self.cfg.hot_window_pages >> self.heat_shift)
    }

    /// A user is done with `slot`; `dirtied`: it wrote the page's bytes.
    pub fn put(&mut self, slot: SlotId, dirtied: bool) {
        let s = *self.pool.slot(slot);
        let mut stream = Stream::ONE;
        if dirtied {
            self.counters.user_pages_written += 1;
            let clock = self.counters.user_pages_written;
            if let Some(v) = self.vols.get_mut(&s.vol) {
                let m = v.meta_mut(s.vpage);
                let i = (s.vpage % LEAF_PAGES as u64) as usize;
                let now = heat_now(clock, self.heat_shift);
                // A first write counts as one after the longest interval the clock tells, so a
                // page must be rewritten quickly a few times before it is thought hot: cold
                // pages are written rarely and keep that prior, hot ones lose it fast
                // (`examples/write_amp.rs`: starting from the first real interval instead
                // gives 2.47 against 2.37 at 80/20 in steady state).
                let gap = if m.written[i] == 0 { u16::MAX } else { now.wrapping_sub(m.written[i]) };
                m.interval[i] = next_interval(m.interval[i], gap);
                m.written[i] = now;
                if self.cfg.segregation {
                    let class = age_class(m.interval[i], self.cfg.hot_window_pages >> self.heat_shift);
                    stream = Stream::user(class);
                }
            }
        }
        let was_filling = s.state == SlotState::Filling;
        if self.pool.unpin(slot, dirtied, stream) || (was_filling && !dirtied) {
            if let Some(v) = self.vols.get_mut(&s.vol) {
                if v.slot_of(s.vpage) == Some(slot) {
                    v.set_slot(s.vpage, None);
                }
            }
        }
    }

    /// Unmap `pages` pages of `vol` from `vpage` (trim, write-zeroes): they read as zeroes.
    pub fn trim(&mut self, vol: VolId, vpage: u64, pages: u64) -> Result<(), FlashError> {
        self.writable()?;
        let v = self.volume(vol)?;
        if !v.writable {
            return Err(FlashError::ReadOnly);
        }
        if vpage.checked_add(pages).is_none_or(|end| end > v.map.pages) {
            return Err(FlashError::OutOfRange);
        }
        self.change(Record::Trim { vol, vpage, pages })
    }

    // ---------------------------------------------------------------------------------
    // Writing groups

    /// Whether trims or volume changes wait for a group.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Groups handed out and not yet `written`.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The last sequence number handed out.
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// A group writing back up to `max` dirty pages (of `only_vol`, if given), with whatever
    /// trims and volume changes wait. `None`: nothing to write, or no space (see
    /// [`FlashError::NoSpace`] from `need_space`).
    pub fn writeback(&mut self, max: u32, only_vol: Option<VolId>) -> Option<GroupPlan> {
        if !self.may_issue() {
            return None;
        }
        let max = max.min(self.cfg.group_pages_max) as usize;
        // Waiting records first, as many as fit a header with room for one write after them.
        let mut meta_bytes = 0;
        let mut meta_count = 0;
        for r in &self.pending {
            if meta_bytes + r.encoded_len() > crate::layout::GROUP_RECORDS_BYTES - WRITE_RECORD_BYTES {
                break;
            }
            meta_bytes += r.encoded_len();
            meta_count += 1;
        }
        let room = (crate::layout::GROUP_RECORDS_BYTES - meta_bytes) / WRITE_RECORD_BYTES;
        let slots = self.pool.take_dirty(max.min(room), None, only_vol);
        if slots.is_empty() && meta_count == 0 {
            return None;
        }
        let stream = if self.cfg.segregation {
            slots.first().map_or(Stream::ONE, |&s| self.pool.slot(s).stream)
        } else {
            Stream::ONE
        };
        let seq = self.next_seq;
        // A group of records alone (trims, volume changes) may use the reserve: trims free space.
        let Some(grant) = self.space.grant(stream, slots.len() as u32, seq, slots.is_empty()) else {
            for &s in &slots {
                self.pool.written(s, false);
            }
            return None;
        };
        // The grant may be smaller than asked: give back what does not fit.
        let fit = (grant.count as usize).min(slots.len());
        for &s in &slots[fit..] {
            self.pool.written(s, false);
        }
        let mut records: Vec<Record> = self.pending.drain(..meta_count).collect();
        if self.pending.is_empty() {
            for s in self.released_after_pending.drain(..) {
                self.space.release(s, seq);
            }
        }
        let mut sources = Vec::with_capacity(fit);
        for &s in &slots[..fit] {
            let slot = self.pool.slot(s);
            records.push(Record::Write { vol: slot.vol, vpage: slot.vpage, crc: 0 });
            sources.push(Source::Slot(s));
        }
        Some(self.issue(seq, grant, records, sources))
    }

    /// Whether a group may be handed out now (its sequence number under the durable ceiling).
    fn may_issue(&self) -> bool {
        !self.failed && self.next_seq < self.seq_ceiling
    }

    fn issue(&mut self, seq: u64, grant: Grant, records: Vec<Record>, sources: Vec<Source>) -> GroupPlan {
        self.next_seq += 1;
        let pba = grant.segment * self.space.segment_pages + grant.first;
        let header = GroupHeader { seq, segment: grant.segment, records };
        debug_assert_eq!(header.data_pages(), sources.len());
        let plan = GroupPlan { seq, pba, opened: grant.opened, header, sources };
        self.in_flight.insert(seq, plan.clone());
        plan
    }

    /// The group `seq` was written (`ok`) or its write failed. On success its pages are
    /// mapped (durable once a sync covers `seq`). A failed write fails the array: no more
    /// writes are taken, and what was acknowledged before stays readable.
    pub fn written(&mut self, seq: u64, ok: bool) {
        let Some(plan) = self.in_flight.remove(&seq) else {
            debug_assert!(false, "group {seq} finished twice");
            return;
        };
        if !ok {
            self.failed = true;
            for src in &plan.sources {
                if let Source::Slot(s) = *src {
                    self.pool.written(s, false);
                }
            }
            return;
        }
        self.counters.groups_written += 1;
        self.counters.device_pages_written +=
            1 + plan.sources.len() as u64 + u64::from(plan.opened.is_some());
        if let Err(e) = self.map_group(&plan) {
            // A leaf could not be read back: the group is on flash, but the map cannot say so.
            tracing::error!(error = %e, seq, "flash: a map leaf could not be read back; the array fails");
            self.failed = true;
            for src in &plan.sources {
                if let Source::Slot(s) = *src {
                    self.pool.written(s, false);
                }
            }
            return;
        }
        let mut pba = plan.pba;
        for (r, src) in plan.header.records.iter().filter(|r| r.carries_page()).zip(&plan.sources) {
            pba += 1;
            match (r, *src) {
                (Record::Write { vol, vpage, .. }, Source::Slot(s)) => {
                    let slot = *self.pool.slot(s);
                    if !slot.orphan {
                        if let Some(v) = self.vols.get_mut(vol) {
                            self.map.set(&mut v.map, *vpage, pba).expect("leaves read back first");
                        }
                    }
                    self.pool.written(s, true);
                }
                (Record::Move { vol, vpage, old, .. }, _) => {
                    self.counters.gc_pages_moved += 1;
                    self.relocate(*vol, *vpage, *old, pba).expect("leaves read back first");
                }
                _ => debug_assert!(false, "record and source disagree"),
            }
        }
        self.shed();
    }

    /// Read back every evicted leaf `plan`'s records will change, so that mapping them cannot
    /// fail half way. (Shedding waits until the group is mapped.)
    fn map_group(&mut self, plan: &GroupPlan) -> Result<(), FlashError> {
        for r in plan.header.records.iter().filter(|r| r.carries_page()) {
            let (Record::Write { vol, vpage, .. } | Record::Move { vol, vpage, .. }) = r else {
                unreachable!()
            };
            if matches!(r, Record::Write { .. }) {
                if let Some(v) = self.vols.get(vol).filter(|v| *vpage < v.map.pages) {
                    self.map.get(&v.map, *vpage)?;
                }
                continue;
            }
            // A move maps every member of the family, the moved page's own volume deleted
            // since or not (`relocate`).
            let Some(&family) = self.families.get(vol) else { continue };
            for m in self.vols.values().filter(|m| m.family == family) {
                self.map.get(&m.map, *vpage)?;
            }
        }
        Ok(())
    }

    /// Move page `vpage` of `vol`'s family from `old` to `new` in every map that holds it.
    pub fn relocate(&mut self, vol: VolId, vpage: u64, old: Pba, new: Pba) -> Result<(), FlashError> {
        let Some(&family) = self.families.get(&vol) else { return Ok(()) };
        let members = self.vols.values().filter(|v| v.family == family).map(|v| &v.map);
        self.map.relocate(members, vpage, old, new)?;
        Ok(())
    }

    /// A device sync finished after every group up to `seq` completed: they are durable.
    pub fn durable(&mut self, seq: u64) {
        self.durable_seq = self.durable_seq.max(seq);
        self.space.durable(self.durable_seq);
    }

    /// Every group up to this one has completed (and so a sync now makes them durable).
    pub fn completed_seq(&self) -> u64 {
        self.in_flight.keys().next().map_or(self.next_seq - 1, |&first| first - 1)
    }

    // ---------------------------------------------------------------------------------
    // Garbage collection

    /// Whether cleaning should run: free segments are at or below the reserve plus a margin.
    pub fn wants_gc(&self) -> bool {
        self.space.free_segments() <= self.space.reserve + 2
    }

    /// The segment to clean next, if any is worth it.
    pub fn gc_victim(&self) -> Option<u32> {
        self.space.victim(&self.map)
    }

    /// A segment to clean to level wear, if the spread of erase counts calls for one. It
    /// frees nothing (it trades one free segment for another), so it waits while cleaning
    /// is into the reserve.
    pub fn wear_victim(&self) -> Option<u32> {
        if self.space.free_segments() <= self.space.reserve {
            return None;
        }
        self.space.wear_victim()
    }

    /// The pages still valid in `segment`, found by walking its groups in `image` (the whole
    /// segment as read from flash). Refuses a segment whose valid pages its groups do not all
    /// explain: cleaning it would lose data.
    pub fn gc_scan(
        &self,
        segment: u32,
        image: &[u8],
        array: &crate::layout::ArrayId,
    ) -> Result<Vec<GcMove>, FlashError> {
        let spp = self.space.segment_pages as usize;
        if image.len() != spp * PAGE {
            return Err(FlashError::Corrupt("segment image of the wrong size"));
        }
        let header = SegmentHeader::parse(array, &image[..PAGE])?;
        let mut moves = Vec::new();
        let mut page = 1usize;
        let mut last_seq = 0;
        while page < spp {
            let Ok(g) = GroupHeader::parse(array, &image[page * PAGE..(page + 1) * PAGE]) else { break };
            if g.segment != segment
                || g.seq < header.opened_seq
                || g.seq <= last_seq
                || page + 1 + g.data_pages() > spp
            {
                break;
            }
            last_seq = g.seq;
            let mut data = page + 1;
            for r in g.records.iter().filter(|r| r.carries_page()) {
                let pba = segment * spp as u32 + data as u32;
                let (Record::Write { vol, vpage, .. } | Record::Move { vol, vpage, .. }) = r else {
                    unreachable!()
                };
                if self.map.is_held(pba) {
                    let class = if self.cfg.segregation { self.move_class(*vol, *vpage) } else { 0 };
                    moves.push(GcMove { vol: *vol, vpage: *vpage, old: pba, at: data * PAGE, class });
                }
                data += 1;
            }
            page = data;
        }
        if moves.len() as u32 != self.map.valid(segment) {
            return Err(FlashError::Corrupt("a segment's groups do not account for its valid pages"));
        }
        if self.cfg.segregation {
            // By class, so that each class goes out in runs (`gc_writeback`).
            moves.sort_by_key(|m| m.class);
        }
        Ok(moves)
    }

    /// A group moving the next of `moves` (taken from its front).
    pub fn gc_writeback(&mut self, moves: &mut Vec<GcMove>) -> Option<GroupPlan> {
        if moves.is_empty() || !self.may_issue() {
            return None;
        }
        // With segregation, a page goes to the GC stream of its age class, but the youngest
        // class goes back to the youngest user stream: it survived only because its overwrite
        // has not come yet.
        let class = moves[0].class;
        let stream = if self.cfg.segregation { Stream::gc(class) } else { Stream::ONE };
        let max = (moves.len() as u32).min(self.cfg.group_pages_max) as usize;
        let run = moves.iter().take(max).take_while(|m| m.class == class).count();
        let seq = self.next_seq;
        let grant = self.space.grant(stream, run as u32, seq, true)?;
        let taken: Vec<GcMove> = moves.drain(..grant.count as usize).collect();
        let records =
            taken.iter().map(|m| Record::Move { vol: m.vol, vpage: m.vpage, old: m.old, crc: 0 }).collect();
        let sources = taken.iter().map(|m| Source::Image(m.at)).collect();
        Some(self.issue(seq, grant, records, sources))
    }

    /// Every page of `segment` was moved (by groups up to `last_seq`): free it once they are
    /// durable, and once the records of any trim or volume change that unmapped its other
    /// pages are too.
    pub fn gc_done(&mut self, segment: u32, last_seq: u64) {
        self.counters.gc_segments_cleaned += 1;
        if self.pending.is_empty() {
            // A record drained by another thread meanwhile went out in a group after the
            // cleaner's own: wait for that group too.
            self.space.release(segment, last_seq.max(self.last_seq()));
            self.space.durable(self.durable_seq);
        } else {
            self.space.release(segment, u64::MAX);
            self.released_after_pending.push(segment);
        }
    }

    // ---------------------------------------------------------------------------------
    // Space and statistics

    /// Physical pages that hold valid data.
    pub fn valid_pages(&self) -> u64 {
        self.map.valid_total()
    }

    /// Whether one more page may be dirtied: valid pages plus dirty ones must fit in what the
    /// array holds outside its reserve, or a write acknowledged now could never be stored.
    pub fn has_room_for_one_more(&self) -> bool {
        // Outside the reserve and a segment per stream, less a sixteenth for group headers and
        // the tails of segments that no group fits.
        let spare = u64::from(self.space.reserve + crate::space::STREAMS as u32 + 1)
            * u64::from(self.space.segment_pages - 1);
        let usable = self.capacity_pages().saturating_sub(spare) * 15 / 16;
        self.valid_pages() + u64::from(self.pool.dirty_count()) < usable
    }

    /// Pages the array can hold data in (its segments minus their header pages).
    pub fn capacity_pages(&self) -> u64 {
        self.space.segs.len() as u64 * u64::from(self.space.segment_pages - 1)
    }

    /// Device bytes written per user byte written.
    pub fn write_amplification(&self) -> f64 {
        let c = &self.counters;
        if c.user_pages_written == 0 {
            return 0.0;
        }
        c.device_pages_written as f64 / c.user_pages_written as f64
    }

    /// Whether page `vpage` of `vol` is in the pool.
    pub fn has_slot(&self, vol: VolId, vpage: u64) -> bool {
        self.vols.get(&vol).is_some_and(|v| v.slot_of(vpage).is_some())
    }

    /// Pages allocated to `vol` on flash (its map entries; shared pages counted in full).
    pub fn allocated_pages(&self, vol: VolId) -> u64 {
        self.vols.get(&vol).map_or(0, |v| self.map.mapped_pages(&v.map))
    }

    /// Check the controller's invariants (tests and the simulator).
    pub fn audit(&mut self) -> Result<(), String> {
        self.audit_with(true)
    }

    /// [`audit`](Controller::audit) without reading evicted leaves back (recovery: the
    /// holder counts were just made from them).
    pub fn audit_in_memory(&mut self) -> Result<(), String> {
        self.audit_with(false)
    }

    fn audit_with(&mut self, full: bool) -> Result<(), String> {
        self.pool.audit()?;
        let maps: Vec<&VolMap> = self.vols.values().map(|v| &v.map).collect();
        self.map.audit(&maps, full)?;
        self.space.audit()?;
        for (s, seg) in self.space.segs.iter().enumerate() {
            if matches!(seg.state, State::Free | State::Checkpoint | State::Releasing { .. })
                && self.map.valid(s as u32) > 0
            {
                return Err(format!(
                    "segment {s} is {:?} but holds {} valid pages",
                    seg.state,
                    self.map.valid(s as u32)
                ));
            }
        }
        for v in self.vols.values() {
            if v.chunks != v.meta.iter().flatten().count() {
                return Err(format!("volume {}: {} side-table stretches counted", v.id, v.chunks));
            }
            for (l, m) in v.meta.iter().enumerate() {
                let Some(m) = m else { continue };
                if usize::from(m.slots) != m.slot.iter().filter(|&&s| s != 0).count() {
                    return Err(format!("volume {} stretch {l}: {} slots counted", v.id, m.slots));
                }
                for (i, &s) in m.slot.iter().enumerate() {
                    if s == 0 {
                        continue;
                    }
                    let slot = self.pool.slot(s - 1);
                    let vpage = (l * LEAF_PAGES + i) as u64;
                    if slot.vol != v.id || slot.vpage != vpage || slot.orphan || slot.state == SlotState::Free
                    {
                        return Err(format!(
                            "volume {} page {vpage} points at slot {} holding {:?}",
                            v.id,
                            s - 1,
                            slot
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctl() -> Controller {
        let mut c = Controller::new(Config { pool_pages: 8, ..Config::default() }, 16, 64);
        c.seq_ceiling = u64::MAX;
        c
    }

    /// Write-back everything and pretend the groups were written.
    fn settle(c: &mut Controller) {
        while let Some(plan) = c.writeback(64, None) {
            c.written(plan.seq, true);
        }
        let s = c.completed_seq();
        c.durable(s);
    }

    fn write_page(c: &mut Controller, vol: VolId, vpage: u64) {
        match c.get(vol, vpage, Access::WriteWhole).unwrap() {
            Got::Ready(s) | Got::Fresh(s) => c.put(s, true),
            other => panic!("write got {other:?}"),
        }
    }

    #[test]
    fn a_write_lands_in_the_pool_then_on_flash_and_a_read_finds_it() {
        let mut c = ctl();
        let vol = c.create("v", 100).unwrap();
        assert_eq!(c.get(vol, 5, Access::Read).unwrap(), Got::Zero);
        write_page(&mut c, vol, 5);
        let Got::Ready(s) = c.get(vol, 5, Access::Read).unwrap() else { panic!() };
        c.put(s, false);
        settle(&mut c);
        let pba = c.map.get(&c.vols[&vol].map, 5).unwrap();
        assert_ne!(pba, 0);
        c.audit().unwrap();
        // Evict it by filling the pool with other pages; then a read must fetch it.
        for p in 10..30 {
            write_page(&mut c, vol, p);
            settle(&mut c);
        }
        let Got::Fetch { slot, pba: fetched } = c.get(vol, 5, Access::Read).unwrap() else {
            panic!("not evicted")
        };
        assert_eq!(fetched, pba);
        assert_eq!(c.get(vol, 5, Access::Read).unwrap(), Got::Busy, "a second reader waits");
        c.fetched(slot, fetched, true);
        c.put(slot, false);
        c.audit().unwrap();
    }

    /// The stream page `vpage`'s dirty contents would go to.
    fn stream_of(c: &Controller, vol: VolId, vpage: u64) -> Stream {
        c.pool.slot(c.vols[&vol].slot_of(vpage).expect("in the pool")).stream
    }

    #[test]
    fn age_classes_grow_by_the_spread() {
        let w = 128;
        assert_eq!(age_class(1, w), 0);
        assert_eq!(age_class(127, w), 0);
        assert_eq!(age_class(128, w), 1);
        assert_eq!(age_class(128 * CLASS_SPREAD as u16 - 1, w), 1);
        assert_eq!(age_class(128 * CLASS_SPREAD as u16, w), CLASSES - 1);
        assert_eq!(age_class(u16::MAX, w), CLASSES - 1);
        assert_eq!(next_interval(0, 0), 1, "never 0, which means never written");
        assert_eq!(next_interval(100, 20), 60);
    }

    #[test]
    fn pages_go_to_streams_by_how_often_they_are_rewritten() {
        for segregation in [true, false] {
            let mut c = Controller::new(Config { pool_pages: 8, segregation, ..Config::default() }, 16, 64);
            c.seq_ceiling = u64::MAX;
            let vol = c.create("v", 100).unwrap();
            // Page 0 rewritten over and over: it sheds the first write's prior and is young.
            for _ in 0..20 {
                write_page(&mut c, vol, 0);
            }
            // Page 1 written once: nothing says it will be written again soon.
            write_page(&mut c, vol, 1);
            let (young, once) = (stream_of(&c, vol, 0), stream_of(&c, vol, 1));
            if segregation {
                assert_eq!(young, Stream::user(0));
                assert_eq!(once, Stream::user(CLASSES - 1));
            } else {
                assert_eq!((young, once), (Stream::ONE, Stream::ONE));
            }
            settle(&mut c);
            c.audit().unwrap();
        }
    }

    #[test]
    fn snapshots_keep_their_pages_and_refuse_writes() {
        let mut c = ctl();
        let vol = c.create("v", 10).unwrap();
        write_page(&mut c, vol, 1);
        assert!(matches!(c.snapshot(vol, "s", false), Err(FlashError::Busy(_))), "dirty pages first");
        settle(&mut c);
        let snap = c.snapshot(vol, "s", false).unwrap();
        let before = c.map.get(&c.vols[&snap].map, 1).unwrap();
        write_page(&mut c, vol, 1);
        settle(&mut c);
        assert_eq!(c.map.get(&c.vols[&snap].map, 1).unwrap(), before);
        assert_ne!(c.map.get(&c.vols[&vol].map, 1).unwrap(), before);
        assert_eq!(c.get(snap, 1, Access::WriteWhole), Err(FlashError::ReadOnly));
        assert!(matches!(c.delete(vol), Err(FlashError::HasChildren { .. })));
        let clone = c.snapshot(snap, "c", true).unwrap();
        write_page(&mut c, clone, 2);
        settle(&mut c);
        c.delete(clone).unwrap();
        c.delete(snap).unwrap();
        c.delete(vol).unwrap();
        settle(&mut c);
        assert_eq!(c.valid_pages(), 0);
        c.audit().unwrap();
    }

    #[test]
    fn bad_requests_are_refused_and_change_nothing() {
        let mut c = ctl();
        let vol = c.create("v", 10).unwrap();
        assert_eq!(c.create("v", 5), Err(FlashError::NameTaken("v".into())));
        assert!(matches!(c.create("", 5), Err(FlashError::BadName(_))));
        assert!(matches!(c.create("a/b", 5), Err(FlashError::BadName(_))));
        assert_eq!(c.get(vol, 10, Access::Read), Err(FlashError::OutOfRange));
        assert_eq!(c.trim(vol, 5, 6), Err(FlashError::OutOfRange));
        write_page(&mut c, vol, 9);
        settle(&mut c);
        assert!(matches!(c.resize(vol, 5, false), Err(FlashError::BadSize(_))), "would discard page 9");
        c.resize(vol, 5, true).unwrap();
        assert_eq!(c.valid_pages(), 0);
        c.audit().unwrap();
    }

    #[test]
    fn a_cleaned_segment_waits_for_the_trim_that_emptied_it() {
        // The simulator's seeds 666 and 932: a trim unmaps a page at once, but its record
        // waits for a group. Cleaning skips the unmapped page; were its segment freed (and
        // reused) before the trim's record is durable, a crash would map the page into a
        // stranger's bytes.
        let mut c = ctl();
        let vol = c.create("v", 100).unwrap();
        write_page(&mut c, vol, 5);
        settle(&mut c);
        let segment = c.map.get(&c.vols[&vol].map, 5).unwrap() / c.segment_pages();
        c.trim(vol, 5, 1).unwrap();
        assert!(c.has_pending());
        c.gc_done(segment, c.last_seq());
        c.durable(c.last_seq());
        assert!(
            matches!(c.space.segs[segment as usize].state, State::Releasing { .. }),
            "not before the trim"
        );
        let plan = c.writeback(64, None).expect("the trim's group");
        assert!(plan.header.records.iter().any(|r| matches!(r, Record::Trim { .. })));
        c.written(plan.seq, true);
        assert!(
            matches!(c.space.segs[segment as usize].state, State::Releasing { .. }),
            "not before it is durable"
        );
        c.durable(plan.seq);
        assert_eq!(c.space.segs[segment as usize].state, State::Free);
    }
}
