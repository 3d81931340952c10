//! The virtual FTL's map: for every volume, page → PBA.
//!
//! A volume's map is a row of leaves of [`LEAF_PAGES`] entries (2 MiB of volume each), kept
//! in one slab so that snapshots and clones can share them: taking a snapshot copies the row
//! of leaf ids and counts one more share of each leaf, whatever the volume's size; the first
//! write to a shared leaf copies it (copy on write at the leaf, page granularity for data).
//! Garbage collection moves a page by rewriting the entry in place in every leaf that holds
//! it, which every sharer sees at once.
//!
//! Each PBA counts the leaves that hold it. A PBA held by no leaf is garbage, and its
//! segment's valid-page count says so: the allocator reads those counts to pick what to
//! clean. A leaf is 2 KiB, so a fully written volume costs 1 MiB of map per GiB, plus 2 bytes
//! of count per physical page of the array.
//!
//! **Demand paging.** Leaves need not all be in memory. A leaf unchanged since the last
//! checkpoint has an exact copy in it (`stored`), so it may be *evicted*: its entries are
//! dropped and read back from the checkpoint through a [`LeafSource`] when next wanted. Only
//! such clean leaves are evicted, by a clock (second chance) over the slab, whenever more than
//! the budget are resident ([`Map::shed`]); a leaf changed since the checkpoint stays until
//! the next one stores it. The counts per PBA and per segment stay in memory whole. Every
//! call that reads or changes entries loads what it needs and can fail with the device's
//! error; the caller treats a failed change as a failed array.

use std::borrow::Cow;

use crate::layout::Pba;
use crate::FlashError;

/// Pages one leaf maps.
pub const LEAF_PAGES: usize = 512;
const LEAF_SHIFT: u32 = LEAF_PAGES.trailing_zeros();

/// A leaf's place in the slab.
pub type LeafId = u32;
/// No leaf: every page of that stretch is unmapped.
pub const NO_LEAF: LeafId = u32::MAX;

/// One leaf's entries.
pub type Leaf = [Pba; LEAF_PAGES];

/// Not in the current checkpoint (changed since, or new).
const NOT_STORED: u64 = u64::MAX;

/// Where evicted leaves come back from: the current checkpoint's stream.
pub trait LeafSource: Send {
    /// Leaf `id`'s entries, from its record at byte `at` of the checkpoint stream.
    fn load(&mut self, id: LeafId, at: u64) -> Result<Box<Leaf>, FlashError>;
}

/// A leaf as a checkpoint takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeafItem {
    /// In memory: a copy of its entries.
    Here { id: LeafId, shares: u32, leaf: Box<Leaf> },
    /// Evicted: its entries are in the current checkpoint's record at byte `at`.
    Stored { id: LeafId, shares: u32, at: u64 },
}

/// The source, if there is a checkpoint to load from.
#[derive(Default)]
struct Source(Option<Box<dyn LeafSource>>);

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Source(checkpoint)" } else { "Source(none)" })
    }
}

/// One volume's row of leaves; `pages` bounds the volume.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolMap {
    pub leaves: Vec<LeafId>,
    pub pages: u64,
}

impl VolMap {
    pub fn new(pages: u64) -> VolMap {
        VolMap { leaves: vec![NO_LEAF; leaves_for(pages)], pages }
    }
}

/// Leaves needed to map `pages` pages.
pub fn leaves_for(pages: u64) -> usize {
    pages.div_ceil(LEAF_PAGES as u64) as usize
}

fn split(vpage: u64) -> (usize, usize) {
    ((vpage >> LEAF_SHIFT) as usize, (vpage as usize) & (LEAF_PAGES - 1))
}

/// The shared leaves, the count of leaves per PBA, and valid pages per segment.
#[derive(Debug)]
pub struct Map {
    /// A leaf's entries; `None` for a free id, or one in use but evicted (`shares` > 0).
    leaves: Vec<Option<Box<Leaf>>>,
    shares: Vec<u32>,
    /// Byte offset of the leaf's record in the current checkpoint's stream, while that record
    /// holds what the leaf holds; `NOT_STORED` once it changes.
    stored: Vec<u64>,
    /// Where the checkpoint being written puts the leaf's record, while the leaf has not
    /// changed since that checkpoint's state was taken (`NOT_STORED` otherwise).
    pending: Vec<u64>,
    /// Used since the clock hand last passed (second chance).
    used: Vec<bool>,
    /// Entries that are not 0, per leaf, in memory or not (`vol list`'s allocated bytes
    /// without reading evicted leaves back).
    mapped: Vec<u16>,
    free: Vec<LeafId>,
    holders: Vec<u16>,
    valid: Vec<u32>,
    valid_total: u64,
    segment_pages: u32,
    /// Leaves in memory, of them those stored in the checkpoint as they are (which may be
    /// evicted), and at most how many may stay after [`Map::shed`].
    resident: usize,
    evictable: usize,
    budget: usize,
    hand: usize,
    source: Source,
    /// Leaves read back and evicted since the map was built.
    pub loads: u64,
    pub evictions: u64,
}

impl Map {
    /// An empty map for an array of `segments` segments of `segment_pages` pages.
    pub fn new(segments: u32, segment_pages: u32) -> Map {
        Map {
            leaves: Vec::new(),
            shares: Vec::new(),
            stored: Vec::new(),
            pending: Vec::new(),
            used: Vec::new(),
            mapped: Vec::new(),
            free: Vec::new(),
            holders: vec![0; segments as usize * segment_pages as usize],
            valid: vec![0; segments as usize],
            valid_total: 0,
            segment_pages,
            resident: 0,
            evictable: 0,
            budget: usize::MAX,
            hand: 0,
            source: Source::default(),
            loads: 0,
            evictions: 0,
        }
    }

    /// At most `leaves` leaves stay in memory after [`Map::shed`] (`usize::MAX`: all).
    pub fn set_budget(&mut self, leaves: usize) {
        self.budget = leaves.max(1);
    }

    /// Leaves in memory now.
    pub fn resident(&self) -> usize {
        self.resident
    }

    /// Leaf `id`'s entries in memory, read back from the checkpoint if it was evicted.
    fn leaf(&mut self, id: LeafId) -> Result<&mut Leaf, FlashError> {
        let i = id as usize;
        debug_assert!(self.shares[i] > 0, "leaf {id} is not in use");
        if self.leaves[i].is_none() {
            let at = self.stored[i];
            let source =
                self.source.0.as_mut().ok_or(FlashError::Corrupt("an evicted leaf and no checkpoint"))?;
            self.leaves[i] = Some(source.load(id, at)?);
            self.resident += 1;
            self.evictable += 1;
            self.loads += 1;
        }
        self.used[i] = true;
        Ok(self.leaves[i].as_mut().expect("just loaded"))
    }

    /// The leaf that maps `vpage` of `vm`, if it is evicted: its id, and where the current
    /// checkpoint stores it.
    pub fn evicted(&self, vm: &VolMap, vpage: u64) -> Option<(LeafId, u64)> {
        let (l, _) = split(vpage);
        let id = *vm.leaves.get(l)?;
        (id != NO_LEAF && self.leaves[id as usize].is_none()).then(|| (id, self.stored[id as usize]))
    }

    /// Put back leaf `id`, read from its record at `at` by the caller (asynchronously), if it
    /// is still evicted and stored there. Returns whether it was.
    pub fn install(&mut self, id: LeafId, at: u64, leaf: Box<Leaf>) -> bool {
        let i = id as usize;
        if i >= self.shares.len() || self.shares[i] == 0 || self.leaves[i].is_some() || self.stored[i] != at {
            return false;
        }
        self.leaves[i] = Some(leaf);
        self.resident += 1;
        self.evictable += 1;
        self.loads += 1;
        self.used[i] = true;
        true
    }

    /// Leaf `id`'s entries, read from the checkpoint without keeping them if it was evicted.
    fn peek(&mut self, id: LeafId) -> Result<Cow<'_, Leaf>, FlashError> {
        let i = id as usize;
        if let Some(leaf) = &self.leaves[i] {
            return Ok(Cow::Borrowed(&**leaf));
        }
        let source =
            self.source.0.as_mut().ok_or(FlashError::Corrupt("an evicted leaf and no checkpoint"))?;
        Ok(Cow::Owned(*source.load(id, self.stored[i])?))
    }

    /// The PBA that page `vpage` of `vm` maps to (0: unmapped).
    pub fn get(&mut self, vm: &VolMap, vpage: u64) -> Result<Pba, FlashError> {
        let (l, i) = split(vpage);
        match vm.leaves.get(l) {
            Some(&id) if id != NO_LEAF => Ok(self.leaf(id)?[i]),
            _ => Ok(0),
        }
    }

    /// The PBA of `vpage` of `vm` if its leaf is in memory (`None`: evicted; ask [`Map::get`]).
    pub fn get_resident(&self, vm: &VolMap, vpage: u64) -> Option<Pba> {
        let (l, i) = split(vpage);
        match vm.leaves.get(l) {
            Some(&id) if id != NO_LEAF => self.leaves[id as usize].as_ref().map(|leaf| leaf[i]),
            _ => Some(0),
        }
    }

    /// Pages of `vm` mapped (its leaves' entries that are not 0), from the counts kept per
    /// leaf: nothing evicted is read.
    pub fn mapped_pages(&self, vm: &VolMap) -> u64 {
        vm.leaves.iter().filter(|&&id| id != NO_LEAF).map(|&id| u64::from(self.mapped[id as usize])).sum()
    }

    /// Valid pages (held by some leaf) in `segment`.
    pub fn valid(&self, segment: u32) -> u32 {
        self.valid[segment as usize]
    }

    /// Valid pages over the whole array.
    pub fn valid_total(&self) -> u64 {
        self.valid_total
    }

    /// Whether some leaf holds `pba`.
    pub fn is_held(&self, pba: Pba) -> bool {
        self.holders.get(pba as usize).is_some_and(|&h| h > 0)
    }

    /// Map `vpage` of `vm` to `pba` (0: unmap). Copies the leaf first if another volume
    /// shares it. Returns the PBA it mapped before.
    pub fn set(&mut self, vm: &mut VolMap, vpage: u64, pba: Pba) -> Result<Pba, FlashError> {
        debug_assert!(vpage < vm.pages, "page {vpage} past a volume of {} pages", vm.pages);
        let (l, i) = split(vpage);
        let id = vm.leaves[l];
        if id == NO_LEAF && pba == 0 {
            return Ok(0);
        }
        let id = if id == NO_LEAF {
            let id = self.alloc_leaf(Box::new([0; LEAF_PAGES]));
            vm.leaves[l] = id;
            id
        } else if self.shares[id as usize] > 1 {
            let copy = Box::new(*self.leaf(id)?);
            for &p in copy.iter().filter(|&&p| p != 0) {
                self.hold(p);
            }
            self.shares[id as usize] -= 1;
            let new = self.alloc_leaf(copy);
            vm.leaves[l] = new;
            new
        } else {
            id
        };
        let leaf = self.leaf(id)?;
        let old = std::mem::replace(&mut leaf[i], pba);
        if old != pba {
            self.unstore(id);
            let m = &mut self.mapped[id as usize];
            *m = *m + u16::from(old == 0) - u16::from(pba == 0);
        }
        if pba != 0 {
            self.hold(pba);
        }
        if old != 0 {
            self.release(old);
        }
        Ok(old)
    }

    /// Unmap `pages` pages of `vm` from `vpage`, skipping leaves that hold nothing. Each leaf
    /// is read (if evicted) before anything of it changes, so an error leaves the counts
    /// right, with the pages before it unmapped.
    pub fn trim(&mut self, vm: &mut VolMap, vpage: u64, pages: u64) -> Result<(), FlashError> {
        let end = vpage.saturating_add(pages).min(vm.pages);
        let mut p = vpage;
        while p < end {
            let (l, _) = split(p);
            let leaf_end = ((l as u64 + 1) << LEAF_SHIFT).min(end);
            if vm.leaves[l] == NO_LEAF {
                p = leaf_end;
                continue;
            }
            if p & (LEAF_PAGES as u64 - 1) == 0 && leaf_end - p == LEAF_PAGES as u64 {
                // A whole leaf: let it go rather than zero its entries one by one.
                self.drop_share(vm.leaves[l])?;
                vm.leaves[l] = NO_LEAF;
                p = leaf_end;
                continue;
            }
            while p < leaf_end {
                self.set(vm, p, 0)?;
                p += 1;
            }
        }
        Ok(())
    }

    /// A new map sharing every leaf of `vm` (a snapshot or clone).
    pub fn share(&mut self, vm: &VolMap) -> VolMap {
        for &id in vm.leaves.iter().filter(|&&id| id != NO_LEAF) {
            self.shares[id as usize] += 1;
        }
        vm.clone()
    }

    /// Give up `vm`'s leaves (the volume is deleted), one at a time: after an error, the
    /// leaves not yet given up are still `vm`'s.
    pub fn drop_map(&mut self, vm: &mut VolMap) -> Result<(), FlashError> {
        for l in 0..vm.leaves.len() {
            if vm.leaves[l] != NO_LEAF {
                self.drop_share(vm.leaves[l])?;
                vm.leaves[l] = NO_LEAF;
            }
        }
        Ok(())
    }

    /// Change `vm`'s size: growing maps nothing new; shrinking unmaps what falls off.
    pub fn resize(&mut self, vm: &mut VolMap, pages: u64) -> Result<(), FlashError> {
        if pages < vm.pages {
            self.trim(vm, pages, vm.pages - pages)?;
            let keep = leaves_for(pages);
            for l in keep..vm.leaves.len() {
                if vm.leaves[l] != NO_LEAF {
                    self.drop_share(vm.leaves[l])?;
                    vm.leaves[l] = NO_LEAF;
                }
            }
            vm.leaves.truncate(keep);
        } else {
            vm.leaves.resize(leaves_for(pages), NO_LEAF);
        }
        vm.pages = pages;
        Ok(())
    }

    /// Garbage collection moved page `vpage` from `old` to `new`: every leaf of `family` that
    /// maps it at `old` maps it at `new` now (a shared leaf once, for all its sharers).
    /// Returns how many leaves changed.
    pub fn relocate<'a>(
        &mut self,
        family: impl IntoIterator<Item = &'a VolMap>,
        vpage: u64,
        old: Pba,
        new: Pba,
    ) -> Result<usize, FlashError> {
        let (l, i) = split(vpage);
        let mut changed = 0;
        let mut seen: Vec<LeafId> = Vec::new();
        for vm in family {
            let Some(&id) = vm.leaves.get(l) else { continue };
            if id != NO_LEAF && !seen.contains(&id) {
                seen.push(id);
            }
        }
        // Every leaf read first, so that an error changes nothing.
        for &id in &seen {
            self.leaf(id)?;
        }
        for id in seen {
            let leaf = self.leaf(id)?;
            if leaf[i] == old {
                leaf[i] = new;
                self.unstore(id);
                changed += 1;
            }
        }
        for _ in 0..changed {
            self.hold(new);
            self.release(old);
        }
        Ok(changed)
    }

    /// Leaf `id` (in memory) changed: its checkpoint copy is stale, so it stays until the
    /// next checkpoint stores it.
    fn unstore(&mut self, id: LeafId) {
        let i = id as usize;
        self.pending[i] = NOT_STORED;
        if self.stored[i] != NOT_STORED {
            self.stored[i] = NOT_STORED;
            self.evictable -= 1;
        }
    }

    /// Whether the map holds more leaves than its budget and none can go before a checkpoint
    /// stores them.
    pub fn over_budget_until_checkpoint(&self) -> bool {
        self.resident > self.budget && self.evictable == 0
    }

    fn hold(&mut self, pba: Pba) {
        let h = &mut self.holders[pba as usize];
        if *h == 0 {
            self.valid[(pba / self.segment_pages) as usize] += 1;
            self.valid_total += 1;
        }
        *h = h.checked_add(1).expect("more than 65,535 leaves hold one page");
    }

    fn release(&mut self, pba: Pba) {
        let h = &mut self.holders[pba as usize];
        debug_assert!(*h > 0, "released a page no leaf held");
        *h -= 1;
        if *h == 0 {
            self.valid[(pba / self.segment_pages) as usize] -= 1;
            self.valid_total -= 1;
        }
    }

    fn alloc_leaf(&mut self, leaf: Box<Leaf>) -> LeafId {
        self.resident += 1;
        let mapped = leaf.iter().filter(|&&p| p != 0).count() as u16;
        match self.free.pop() {
            Some(id) => {
                let i = id as usize;
                self.leaves[i] = Some(leaf);
                self.shares[i] = 1;
                self.stored[i] = NOT_STORED;
                self.pending[i] = NOT_STORED;
                self.used[i] = true;
                self.mapped[i] = mapped;
                id
            }
            None => {
                self.leaves.push(Some(leaf));
                self.shares.push(1);
                self.stored.push(NOT_STORED);
                self.pending.push(NOT_STORED);
                self.used.push(true);
                self.mapped.push(mapped);
                (self.leaves.len() - 1) as LeafId
            }
        }
    }

    fn drop_share(&mut self, id: LeafId) -> Result<(), FlashError> {
        let i = id as usize;
        if self.shares[i] == 1 {
            // The last user: its pages lose a holder, so its entries must be at hand.
            let leaf = self.peek(id)?.into_owned();
            for &p in leaf.iter().filter(|&&p| p != 0) {
                self.release(p);
            }
            if self.leaves[i].take().is_some() {
                self.resident -= 1;
                if self.stored[i] != NOT_STORED {
                    self.evictable -= 1;
                }
            }
            self.stored[i] = NOT_STORED;
            self.pending[i] = NOT_STORED;
            self.free.push(id);
        }
        self.shares[i] -= 1;
        Ok(())
    }

    /// Leaves in use (for the map's memory figure).
    pub fn leaves_in_use(&self) -> usize {
        self.leaves.len() - self.free.len()
    }

    /// A checkpoint takes the map's state: every leaf in use, by id, as a copy of its entries
    /// if it is in memory, or where the current checkpoint stores it if not. Their records
    /// will lie [`LEAF_RECORD`](crate::ckpt::LEAF_RECORD) bytes apart from byte `first_at` of
    /// its stream; [`Map::checkpointed`] takes them up once it is durable, for the leaves that
    /// have not changed since.
    pub fn begin_checkpoint(&mut self, first_at: u64, record: u64) -> Vec<LeafItem> {
        let mut items = Vec::with_capacity(self.leaves_in_use());
        let mut at = first_at;
        for i in 0..self.shares.len() {
            let shares = self.shares[i];
            if shares == 0 {
                continue;
            }
            let id = i as LeafId;
            items.push(match &self.leaves[i] {
                Some(leaf) => LeafItem::Here { id, shares, leaf: leaf.clone() },
                None => LeafItem::Stored { id, shares, at: self.stored[i] },
            });
            self.pending[i] = at;
            at += record;
        }
        items
    }

    /// The checkpoint [`Map::begin_checkpoint`] took is durable: every leaf unchanged since is
    /// stored in it, and evicted leaves come back from `source` from now on.
    pub fn checkpointed(&mut self, source: Box<dyn LeafSource>) {
        for i in 0..self.shares.len() {
            let at = std::mem::replace(&mut self.pending[i], NOT_STORED);
            if at == NOT_STORED {
                // Changed, or new, since: it stays until the next checkpoint.
                debug_assert!(
                    self.shares[i] == 0 || self.stored[i] == NOT_STORED,
                    "leaf {i} stored in a checkpoint it missed"
                );
                continue;
            }
            if self.stored[i] == NOT_STORED && self.leaves[i].is_some() {
                self.evictable += 1;
            }
            self.stored[i] = at;
        }
        self.source = Source(Some(source));
    }

    /// The checkpoint [`Map::begin_checkpoint`] took was not written: leaves stay stored where
    /// they were.
    pub fn checkpoint_abandoned(&mut self) {
        self.pending.fill(NOT_STORED);
    }

    /// Evict clean leaves (stored in the checkpoint as they are) by a clock, until at most
    /// the budget are resident or none more can go. One turn of the hand at most: a leaf used
    /// since the hand last passed (one just read back included) outlives this call, so that
    /// the budget may be passed until the next, never by evicting what the caller is about
    /// to use.
    pub fn shed(&mut self) {
        let n = self.leaves.len();
        let mut looked = 0;
        while self.resident > self.budget && self.evictable > 0 && looked < n {
            let i = self.hand;
            self.hand = (self.hand + 1) % n;
            looked += 1;
            if self.leaves[i].is_none() || self.stored[i] == NOT_STORED {
                continue;
            }
            if std::mem::take(&mut self.used[i]) {
                continue;
            }
            self.leaves[i] = None;
            self.resident -= 1;
            self.evictable -= 1;
            self.evictions += 1;
        }
    }

    /// Put back a leaf a checkpoint wrote at byte `at` of its stream, with its id and shares
    /// (recovery, before any volume refers to it); `keep`: in memory, else evicted.
    pub fn restore_leaf(
        &mut self,
        id: LeafId,
        shares: u32,
        entries: Box<[Pba; LEAF_PAGES]>,
        at: u64,
        keep: bool,
    ) {
        let i = id as usize;
        if self.leaves.len() <= i {
            self.leaves.resize_with(i + 1, || None);
            self.shares.resize(i + 1, 0);
            self.stored.resize(i + 1, NOT_STORED);
            self.pending.resize(i + 1, NOT_STORED);
            self.used.resize(i + 1, false);
            self.mapped.resize(i + 1, 0);
        }
        self.mapped[i] = entries.iter().filter(|&&p| p != 0).count() as u16;
        for &p in entries.iter().filter(|&&p| p != 0) {
            self.hold(p);
        }
        if keep {
            self.leaves[i] = Some(entries);
            self.resident += 1;
            self.evictable += 1;
        }
        self.shares[i] = shares;
        self.stored[i] = at;
    }

    /// After every leaf is restored: ids left unused become free, and evicted leaves come
    /// back from `source`.
    pub fn finish_restore(&mut self, source: Option<Box<dyn LeafSource>>) {
        self.free =
            (0..self.leaves.len() as LeafId).filter(|&id| self.shares[id as usize] == 0).rev().collect();
        if source.is_none() {
            // Nothing to read evicted leaves back from: they all stay.
            debug_assert_eq!(self.resident, self.leaves_in_use(), "leaves evicted with no source");
            self.stored.fill(NOT_STORED);
            self.evictable = 0;
        }
        self.source = Source(source);
    }

    /// Whether a PBA can exist in this geometry and is not a segment header.
    pub fn is_data_pba(&self, pba: Pba) -> bool {
        (pba as usize) < self.holders.len() && !pba.is_multiple_of(self.segment_pages)
    }

    /// Check the counts against the leaves (tests and the simulator), reading evicted
    /// leaves back without keeping them if `full`.
    pub fn audit(&mut self, maps: &[&VolMap], full: bool) -> Result<(), String> {
        let resident = self.leaves.iter().filter(|l| l.is_some()).count();
        if resident != self.resident {
            return Err(format!("{resident} leaves in memory, counted {}", self.resident));
        }
        let evictable = (0..self.leaves.len())
            .filter(|&i| self.leaves[i].is_some() && self.stored[i] != NOT_STORED)
            .count();
        if evictable != self.evictable {
            return Err(format!("{evictable} leaves may be evicted, counted {}", self.evictable));
        }
        let mut users = vec![0u32; self.shares.len()];
        for &l in maps.iter().flat_map(|m| m.leaves.iter()).filter(|&&l| l != NO_LEAF) {
            match users.get_mut(l as usize) {
                Some(u) => *u += 1,
                None => return Err(format!("a volume names leaf {l}, past the slab")),
            }
        }
        // Without `full`, evicted leaves are not read back: with any evicted, the holder counts
        // are checked against the valid counts only, not recounted from the leaves.
        let recount = full || self.resident == self.leaves_in_use();
        let mut holders = recount.then(|| vec![0u32; self.holders.len()]);
        for (id, &users) in users.iter().enumerate() {
            if users != self.shares[id] {
                return Err(format!("leaf {id}: {users} users, {} shares counted", self.shares[id]));
            }
            if self.shares[id] == 0 {
                if self.leaves[id].is_some() {
                    return Err(format!("leaf {id} is free and in memory"));
                }
                continue;
            }
            if self.leaves[id].is_none() && self.stored[id] == NOT_STORED {
                return Err(format!("leaf {id} is evicted and in no checkpoint"));
            }
            if holders.is_none() && self.leaves[id].is_none() {
                continue;
            }
            let mapped = self.mapped[id];
            let leaf = self.peek(id as LeafId).map_err(|e| format!("leaf {id}: {e}"))?;
            if leaf.iter().filter(|&&p| p != 0).count() != usize::from(mapped) {
                return Err(format!("leaf {id}: {mapped} entries counted mapped"));
            }
            if let Some(holders) = &mut holders {
                for &p in leaf.iter().filter(|&&p| p != 0) {
                    holders[p as usize] += 1;
                }
            }
        }
        if let Some(holders) = &holders {
            for (p, (&want, &have)) in holders.iter().zip(&self.holders).enumerate() {
                if want != u32::from(have) {
                    return Err(format!("PBA {p}: held by {want} leaves, counted {have}"));
                }
            }
        }
        for (s, &v) in self.valid.iter().enumerate() {
            let start = s * self.segment_pages as usize;
            let want =
                self.holders[start..start + self.segment_pages as usize].iter().filter(|&&h| h > 0).count();
            if want as u32 != v {
                return Err(format!("segment {s}: {want} valid pages, counted {v}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A volume of `leaves` leaves, every page mapped (page `p` to a PBA past it, skipping
    /// header pages of 1,024-page segments).
    fn full_volume(m: &mut Map, leaves: u64) -> VolMap {
        let mut vol = VolMap::new(leaves * LEAF_PAGES as u64);
        for p in 0..leaves * LEAF_PAGES as u64 {
            m.set(&mut vol, p, 1 + p as Pba + p as Pba / 1023).unwrap();
        }
        vol
    }

    #[test]
    fn snapshots_share_leaves_until_a_write_copies_one() {
        let mut m = Map::new(4, 1024);
        let mut vol = VolMap::new(2000);
        for p in 0..1000 {
            m.set(&mut vol, p, 1 + p as Pba).unwrap();
        }
        let mut snap = m.share(&vol);
        assert_eq!(m.leaves_in_use(), 2);
        let old = m.set(&mut vol, 3, 2000).unwrap();
        assert_eq!(old, 4);
        assert_eq!(m.leaves_in_use(), 3, "the first leaf was copied");
        assert_eq!(m.get(&snap, 3).unwrap(), 4, "the snapshot keeps the old page");
        assert_eq!(m.get(&vol, 3).unwrap(), 2000);
        assert!(m.is_held(4), "the snapshot still holds it");
        m.audit(&[&vol, &snap], true).unwrap();
        m.drop_map(&mut snap).unwrap();
        assert!(!m.is_held(4), "nobody holds it now");
        m.audit(&[&vol], true).unwrap();
        assert_eq!((m.valid(0), m.valid(1)), (999, 1), "pages 1..=1000 but 4, and the new page");
    }

    /// Leaves as a checkpoint stored them: a copy of each, by offset.
    struct Stored(std::collections::HashMap<u64, (LeafId, Box<Leaf>)>);

    impl LeafSource for Stored {
        fn load(&mut self, id: LeafId, at: u64) -> Result<Box<Leaf>, FlashError> {
            match self.0.get(&at) {
                Some((stored, leaf)) if *stored == id => Ok(leaf.clone()),
                _ => Err(FlashError::Corrupt("no such leaf stored")),
            }
        }
    }

    fn checkpoint(m: &mut Map) {
        let mut stored = std::collections::HashMap::new();
        for (k, item) in m.begin_checkpoint(100, 10).into_iter().enumerate() {
            let LeafItem::Here { id, leaf, .. } = item else { panic!("evicted: {item:?}") };
            stored.insert(100 + 10 * k as u64, (id, leaf));
        }
        m.checkpointed(Box::new(Stored(stored)));
    }

    #[test]
    fn leaves_past_the_budget_are_evicted_once_stored_and_read_back() {
        let mut m = Map::new(64, 1024);
        let mut vol = full_volume(&mut m, 8);
        m.set_budget(2);
        m.shed();
        assert_eq!(m.resident(), 8, "nothing is stored yet: every leaf stays");
        checkpoint(&mut m);
        m.shed();
        assert_eq!(m.resident(), 8, "every leaf was used since the hand last passed");
        m.shed();
        assert_eq!((m.resident(), m.evictions), (2, 6));
        m.audit(&[&vol], true).unwrap();
        // Reads bring leaves back; a change keeps one until the next checkpoint.
        assert_eq!(m.get(&vol, 5).unwrap(), 6);
        m.set(&mut vol, 3 * LEAF_PAGES as u64, 0).unwrap();
        assert!(m.loads >= 1);
        for p in (0..8 * LEAF_PAGES as u64).step_by(97) {
            m.get(&vol, p).unwrap();
        }
        m.shed(); // clears the bits of the leaves just read
        m.shed();
        assert_eq!(m.get_resident(&vol, 3 * LEAF_PAGES as u64), Some(0), "the changed leaf stayed");
        assert!(m.resident() <= 2);
        m.audit(&[&vol], true).unwrap();
        // A snapshot shares evicted leaves; the first write copies one back from the checkpoint.
        let mut snap = m.share(&vol);
        m.set(&mut snap, 7 * LEAF_PAGES as u64, 3000).unwrap();
        assert_eq!(m.get(&vol, 7 * LEAF_PAGES as u64).unwrap(), 1 + 7 * LEAF_PAGES as Pba + 3);
        m.audit(&[&vol, &snap], true).unwrap();
        // Deleting releases the pages of evicted leaves too.
        m.drop_map(&mut snap).unwrap();
        m.drop_map(&mut vol).unwrap();
        assert_eq!((m.leaves_in_use(), m.valid_total()), (0, 0));
        m.audit(&[], true).unwrap();
    }

    #[test]
    fn a_scan_reads_each_leaf_back_once() {
        let mut m = Map::new(4096, 1024);
        let leaves = 300u64;
        let mut vol = VolMap::new(leaves * LEAF_PAGES as u64);
        for l in 0..leaves {
            m.set(&mut vol, l * LEAF_PAGES as u64 + 7, 1 + l as Pba).unwrap();
        }
        checkpoint(&mut m);
        m.set_budget(20);
        m.shed();
        m.shed();
        assert_eq!(m.resident(), 20);
        for p in 0..leaves * LEAF_PAGES as u64 {
            m.get(&vol, p).unwrap();
            m.shed();
        }
        assert!(m.loads <= leaves, "{} leaves read back for a scan of {leaves}", m.loads);
    }

    #[test]
    fn relocation_updates_every_sharer_once() {
        let mut m = Map::new(4, 1024);
        let mut vol = VolMap::new(600);
        m.set(&mut vol, 10, 5).unwrap();
        let snap = m.share(&vol);
        let mut clone = m.share(&snap);
        m.set(&mut clone, 11, 6).unwrap(); // the clone copies its leaf: page 10 is held by two leaves now
        assert_eq!(m.relocate([&vol, &snap, &clone], 10, 5, 1030).unwrap(), 2);
        for v in [&vol, &snap, &clone] {
            assert_eq!(m.get(v, 10).unwrap(), 1030);
        }
        assert!(!m.is_held(5));
        m.audit(&[&vol, &snap, &clone], true).unwrap();
    }

    #[test]
    fn trim_resize_and_delete_release_pages() {
        let mut m = Map::new(8, 1024);
        let mut vol = full_volume(&mut m, 3);
        m.trim(&mut vol, 100, LEAF_PAGES as u64 * 2).unwrap();
        assert_eq!(m.get(&vol, 99).unwrap(), 100);
        assert_eq!(m.get(&vol, 100).unwrap(), 0);
        assert_eq!(m.get(&vol, 611).unwrap(), 0);
        m.audit(&[&vol], true).unwrap();
        m.resize(&mut vol, 50).unwrap();
        assert_eq!(vol.leaves.len(), 1);
        m.audit(&[&vol], true).unwrap();
        m.resize(&mut vol, 5000).unwrap();
        assert_eq!(m.get(&vol, 4999).unwrap(), 0);
        m.drop_map(&mut vol).unwrap();
        assert_eq!(m.leaves_in_use(), 0);
        m.audit(&[], true).unwrap();
    }

    /// A checkpoint that cannot be read (a device error).
    struct Failing;

    impl LeafSource for Failing {
        fn load(&mut self, _: LeafId, _: u64) -> Result<Box<Leaf>, FlashError> {
            Err(FlashError::Device("injected".into()))
        }
    }

    #[test]
    fn a_change_that_cannot_read_its_leaf_leaves_the_counts_right() {
        let mut m = Map::new(64, 1024);
        let mut vol = full_volume(&mut m, 3);
        let mut clone = m.share(&vol);
        m.set(&mut clone, 11, 2000).unwrap(); // the clone's first leaf is copied: page 10 has two holders
        checkpoint(&mut m);
        m.set_budget(1);
        m.shed(); // every bit cleared
        m.get(&vol, 10).unwrap();
        m.shed(); // all but the volume's first leaf evicted
        assert_eq!(m.resident(), 1);
        assert!(m.get_resident(&clone, 10).is_none(), "the clone's first leaf is evicted");
        let good = std::mem::replace(&mut m.source, Source(Some(Box::new(Failing))));
        // A move of page 10 needs both holders: nothing changes when one cannot be read.
        assert!(m.relocate([&vol, &clone], 10, 11, 3000).is_err());
        m.audit(&[&vol, &clone], false).unwrap();
        // A trim (or a delete) stops at the first leaf it cannot read, counts intact: the
        // clone's first leaf is its own (its pages lose a holder when it goes) and evicted.
        assert!(m.trim(&mut clone, 0, 3 * LEAF_PAGES as u64).is_err());
        m.audit(&[&vol, &clone], false).unwrap();
        assert!(m.drop_map(&mut clone).is_err());
        m.audit(&[&vol, &clone], false).unwrap();
        m.source = good;
        m.audit(&[&vol, &clone], true).unwrap();
        m.drop_map(&mut clone).unwrap();
        m.drop_map(&mut vol).unwrap();
        assert_eq!((m.leaves_in_use(), m.valid_total()), (0, 0));
    }
}
