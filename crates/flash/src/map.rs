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

use crate::layout::Pba;

/// Pages one leaf maps.
pub const LEAF_PAGES: usize = 512;
const LEAF_SHIFT: u32 = LEAF_PAGES.trailing_zeros();

/// A leaf's place in the slab.
pub type LeafId = u32;
/// No leaf: every page of that stretch is unmapped.
pub const NO_LEAF: LeafId = u32::MAX;

type Leaf = [Pba; LEAF_PAGES];

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
    leaves: Vec<Option<Box<Leaf>>>,
    shares: Vec<u32>,
    free: Vec<LeafId>,
    holders: Vec<u16>,
    valid: Vec<u32>,
    valid_total: u64,
    segment_pages: u32,
}

impl Map {
    /// An empty map for an array of `segments` segments of `segment_pages` pages.
    pub fn new(segments: u32, segment_pages: u32) -> Map {
        Map {
            leaves: Vec::new(),
            shares: Vec::new(),
            free: Vec::new(),
            holders: vec![0; segments as usize * segment_pages as usize],
            valid: vec![0; segments as usize],
            valid_total: 0,
            segment_pages,
        }
    }

    /// The PBA that page `vpage` of `vm` maps to (0: unmapped).
    pub fn get(&self, vm: &VolMap, vpage: u64) -> Pba {
        let (l, i) = split(vpage);
        match vm.leaves.get(l) {
            Some(&id) if id != NO_LEAF => self.leaves[id as usize].as_ref().map_or(0, |leaf| leaf[i]),
            _ => 0,
        }
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
    pub fn set(&mut self, vm: &mut VolMap, vpage: u64, pba: Pba) -> Pba {
        debug_assert!(vpage < vm.pages, "page {vpage} past a volume of {} pages", vm.pages);
        let (l, i) = split(vpage);
        let id = vm.leaves[l];
        if id == NO_LEAF && pba == 0 {
            return 0;
        }
        let id = if id == NO_LEAF {
            let id = self.alloc_leaf(Box::new([0; LEAF_PAGES]));
            vm.leaves[l] = id;
            id
        } else if self.shares[id as usize] > 1 {
            let copy = self.leaves[id as usize].clone().expect("a shared leaf exists");
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
        let leaf = self.leaves[id as usize].as_mut().expect("leaf in use");
        let old = std::mem::replace(&mut leaf[i], pba);
        if pba != 0 {
            self.hold(pba);
        }
        if old != 0 {
            self.release(old);
        }
        old
    }

    /// Unmap `pages` pages of `vm` from `vpage`, skipping leaves that hold nothing.
    pub fn trim(&mut self, vm: &mut VolMap, vpage: u64, pages: u64) {
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
                let id = std::mem::replace(&mut vm.leaves[l], NO_LEAF);
                self.drop_share(id);
                p = leaf_end;
                continue;
            }
            while p < leaf_end {
                self.set(vm, p, 0);
                p += 1;
            }
        }
    }

    /// A new map sharing every leaf of `vm` (a snapshot or clone).
    pub fn share(&mut self, vm: &VolMap) -> VolMap {
        for &id in vm.leaves.iter().filter(|&&id| id != NO_LEAF) {
            self.shares[id as usize] += 1;
        }
        vm.clone()
    }

    /// Give up `vm`'s leaves (the volume is deleted).
    pub fn drop_map(&mut self, vm: VolMap) {
        for id in vm.leaves.into_iter().filter(|&id| id != NO_LEAF) {
            self.drop_share(id);
        }
    }

    /// Change `vm`'s size: growing maps nothing new; shrinking unmaps what falls off.
    pub fn resize(&mut self, vm: &mut VolMap, pages: u64) {
        if pages < vm.pages {
            self.trim(vm, pages, vm.pages - pages);
            for id in vm.leaves.drain(leaves_for(pages)..).collect::<Vec<_>>() {
                if id != NO_LEAF {
                    self.drop_share(id);
                }
            }
        } else {
            vm.leaves.resize(leaves_for(pages), NO_LEAF);
        }
        vm.pages = pages;
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
    ) -> usize {
        let (l, i) = split(vpage);
        let mut changed = 0;
        let mut seen: Vec<LeafId> = Vec::new();
        for vm in family {
            let Some(&id) = vm.leaves.get(l) else { continue };
            if id == NO_LEAF || seen.contains(&id) {
                continue;
            }
            seen.push(id);
            let leaf = self.leaves[id as usize].as_mut().expect("leaf in use");
            if leaf[i] == old {
                leaf[i] = new;
                changed += 1;
            }
        }
        for _ in 0..changed {
            self.hold(new);
            self.release(old);
        }
        changed
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
        match self.free.pop() {
            Some(id) => {
                self.leaves[id as usize] = Some(leaf);
                self.shares[id as usize] = 1;
                id
            }
            None => {
                self.leaves.push(Some(leaf));
                self.shares.push(1);
                (self.leaves.len() - 1) as LeafId
            }
        }
    }

    fn drop_share(&mut self, id: LeafId) {
        let s = &mut self.shares[id as usize];
        *s -= 1;
        if *s > 0 {
            return;
        }
        let leaf = self.leaves[id as usize].take().expect("leaf in use");
        for &p in leaf.iter().filter(|&&p| p != 0) {
            self.release(p);
        }
        self.free.push(id);
    }

    /// Leaves in use (for the map's memory figure).
    pub fn leaves_in_use(&self) -> usize {
        self.leaves.len() - self.free.len()
    }

    /// Every leaf in use, with its id, shares and entries (a checkpoint writes them).
    pub fn each_leaf(&self) -> impl Iterator<Item = (LeafId, u32, &[Pba; LEAF_PAGES])> + '_ {
        self.leaves
            .iter()
            .enumerate()
            .filter_map(|(id, l)| l.as_ref().map(|l| (id as LeafId, self.shares[id], &**l)))
    }

    /// Put back a leaf a checkpoint wrote, with its id and shares (recovery, before any
    /// volume refers to it).
    pub fn restore_leaf(&mut self, id: LeafId, shares: u32, entries: Box<[Pba; LEAF_PAGES]>) {
        let i = id as usize;
        if self.leaves.len() <= i {
            self.leaves.resize_with(i + 1, || None);
            self.shares.resize(i + 1, 0);
        }
        for &p in entries.iter().filter(|&&p| p != 0) {
            self.hold(p);
        }
        self.leaves[i] = Some(entries);
        self.shares[i] = shares;
    }

    /// After every leaf is restored: slots left empty become free.
    pub fn finish_restore(&mut self) {
        self.free =
            (0..self.leaves.len() as LeafId).filter(|&id| self.leaves[id as usize].is_none()).rev().collect();
    }

    /// Whether a PBA can exist in this geometry and is not a segment header.
    pub fn is_data_pba(&self, pba: Pba) -> bool {
        (pba as usize) < self.holders.len() && !pba.is_multiple_of(self.segment_pages)
    }

    /// Check the counts against the leaves (tests and the simulator).
    pub fn audit(&self, maps: &[&VolMap]) -> Result<(), String> {
        let mut holders = vec![0u32; self.holders.len()];
        for (id, leaf) in self.leaves.iter().enumerate() {
            if let Some(leaf) = leaf {
                for &p in leaf.iter().filter(|&&p| p != 0) {
                    holders[p as usize] += 1;
                }
                let users = maps
                    .iter()
                    .map(|m| m.leaves.iter().filter(|&&l| l == id as LeafId).count())
                    .sum::<usize>();
                if users as u32 != self.shares[id] {
                    return Err(format!("leaf {id}: {users} users, {} shares counted", self.shares[id]));
                }
            }
        }
        for (p, (&want, &have)) in holders.iter().zip(&self.holders).enumerate() {
            if want != u32::from(have) {
                return Err(format!("PBA {p}: held by {want} leaves, counted {have}"));
            }
        }
        for (s, &v) in self.valid.iter().enumerate() {
            let start = s * self.segment_pages as usize;
            let want = holders[start..start + self.segment_pages as usize].iter().filter(|&&h| h > 0).count();
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

    #[test]
    fn snapshots_share_leaves_until_a_write_copies_one() {
        let mut m = Map::new(4, 1024);
        let mut vol = VolMap::new(2000);
        for p in 0..1000 {
            m.set(&mut vol, p, 1 + p as Pba);
        }
        let snap = m.share(&vol);
        assert_eq!(m.leaves_in_use(), 2);
        let old = m.set(&mut vol, 3, 2000);
        assert_eq!(old, 4);
        assert_eq!(m.leaves_in_use(), 3, "the first leaf was copied");
        assert_eq!(m.get(&snap, 3), 4, "the snapshot keeps the old page");
        assert_eq!(m.get(&vol, 3), 2000);
        assert!(m.is_held(4), "the snapshot still holds it");
        m.audit(&[&vol, &snap]).unwrap();
        m.drop_map(snap);
        assert!(!m.is_held(4), "nobody holds it now");
        m.audit(&[&vol]).unwrap();
        assert_eq!((m.valid(0), m.valid(1)), (999, 1), "pages 1..=1000 but 4, and the new page");
    }

    #[test]
    fn relocation_updates_every_sharer_once() {
        let mut m = Map::new(4, 1024);
        let mut vol = VolMap::new(600);
        m.set(&mut vol, 10, 5);
        let snap = m.share(&vol);
        let mut clone = m.share(&snap);
        m.set(&mut clone, 11, 6); // the clone copies its leaf: page 10 is held by two leaves now
        assert_eq!(m.relocate([&vol, &snap, &clone], 10, 5, 1030), 2);
        for v in [&vol, &snap, &clone] {
            assert_eq!(m.get(v, 10), 1030);
        }
        assert!(!m.is_held(5));
        m.audit(&[&vol, &snap, &clone]).unwrap();
    }

    #[test]
    fn trim_resize_and_delete_release_pages() {
        let mut m = Map::new(8, 1024);
        let mut vol = VolMap::new(3 * LEAF_PAGES as u64);
        for p in 0..3 * LEAF_PAGES as u64 {
            m.set(&mut vol, p, 1 + p as Pba + (p as Pba / 1023));
        }
        m.trim(&mut vol, 100, LEAF_PAGES as u64 * 2);
        assert_eq!(m.get(&vol, 99), 100);
        assert_eq!(m.get(&vol, 100), 0);
        assert_eq!(m.get(&vol, 611), 0);
        m.audit(&[&vol]).unwrap();
        m.resize(&mut vol, 50);
        assert_eq!(vol.leaves.len(), 1);
        m.audit(&[&vol]).unwrap();
        m.resize(&mut vol, 5000);
        assert_eq!(m.get(&vol, 4999), 0);
        m.drop_map(vol);
        assert_eq!(m.leaves_in_use(), 0);
        m.audit(&[]).unwrap();
    }
}
