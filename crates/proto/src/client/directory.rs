//! The initiator's directory of capabilities (ODAFS's reference directory, section 4.2).
//!
//! A bounded, direct-mapped table: each capability goes to the entry its start offset maps to,
//! replacing whatever was there, so the directory never grows, never allocates after it
//! is made, and a lookup is one probe. Entries are small (a capability, 56 bytes) next to the
//! data they stand for, so a directory holds references to much more data than any cache on
//! the initiator would: ODAFS's "empty headers".
//!
//! Every capability of one export covers the same length (a cache slot, or a RAM region), so
//! the directory learns that length from the first one it stores and finds the entry for a
//! read from its offset alone. Extents (ranges of a volume of any size: a whole volume earned
//! by a read, or a range registered) are few and large, like RDMA memory regions: they sit in
//! a short list of their own, [`EXTENTS_MAX`] at most, searched first. A reference is a hint:
//! it may be stale at any moment, and the target says so with a fault, after which the session
//! drops it ([`Directory::forget`]).

use wire::{CapKind, Capability};

/// Most extents a directory holds; the oldest goes to make room.
pub const EXTENTS_MAX: usize = 16;

#[derive(Debug)]
pub struct Directory {
    entries: Box<[Option<Capability>]>,
    /// Extents, oldest first.
    extents: Vec<Capability>,
    /// Bytes every capability covers; 0 until the first arrives.
    grain: u64,
    pub stored: u64,
}

impl Directory {
    /// A directory of `entries` references (at least one).
    pub fn new(entries: usize) -> Directory {
        Directory {
            entries: vec![None; entries.max(1)].into_boxed_slice(),
            extents: Vec::with_capacity(EXTENTS_MAX),
            grain: 0,
            stored: 0,
        }
    }

    /// The entry of the reference starting at `start`: its grain number modulo the size, as a
    /// hardware cache indexes, so that any contiguous range of up to `entries` grains is held
    /// without a single collision (a hash would keep only about 63% of a full directory).
    fn index(&self, start: u64) -> usize {
        ((start / self.grain) % self.entries.len() as u64) as usize
    }

    /// Remember `cap`. One of another grain than the directory learned is ignored.
    pub fn insert(&mut self, cap: Capability) {
        if cap.kind == CapKind::Extent {
            return self.insert_extent(cap);
        }
        let grain = u64::from(cap.length);
        if grain == 0 {
            return;
        }
        if self.grain == 0 {
            self.grain = grain;
        }
        if grain != self.grain || !cap.offset.is_multiple_of(grain) {
            return;
        }
        let i = self.index(cap.offset);
        self.entries[i] = Some(cap);
        self.stored += 1;
    }

    /// Remember an extent: it replaces one of the same range, or the oldest when full.
    fn insert_extent(&mut self, cap: Capability) {
        if cap.length == 0 {
            return;
        }
        self.extents.retain(|e| (e.offset, e.span()) != (cap.offset, cap.span()));
        if self.extents.len() == EXTENTS_MAX {
            self.extents.remove(0);
        }
        self.extents.push(cap);
        self.stored += 1;
    }

    /// A capability covering `len` bytes from `offset`, if the directory holds one.
    pub fn find(&self, offset: u64, len: u32) -> Option<&Capability> {
        if let Some(e) = self.extents.iter().rev().find(|e| e.covers(offset, len)) {
            return Some(e);
        }
        if self.grain == 0 {
            return None;
        }
        let start = offset / self.grain * self.grain;
        self.entries[self.index(start)].as_ref().filter(|c| c.offset == start && c.covers(offset, len))
    }

    /// Drop the reference covering `offset`, after the target refused it (every extent
    /// covering it: which of them was refused the caller no longer knows, and the next read
    /// earns a fresh one).
    pub fn forget(&mut self, offset: u64) {
        self.extents.retain(|e| !e.covers(offset, 1));
        if self.grain == 0 {
            return;
        }
        let start = offset / self.grain * self.grain;
        let i = self.index(start);
        if self.entries[i].is_some_and(|c| c.offset == start) {
            self.entries[i] = None;
        }
    }

    /// Drop every reference (the target is a new one, after a reconnection).
    pub fn clear(&mut self) {
        self.extents.clear();
        self.entries.iter_mut().for_each(|e| *e = None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::{CapKind, CapRights};

    fn cap(offset: u64, length: u32) -> Capability {
        Capability {
            export: 0,
            kind: CapKind::Slot,
            rights: CapRights::READ,
            epoch: 1,
            generation: 2,
            offset,
            length,
            slot: 0,
            expires_ms: 1,
            mac: [0; 16],
        }
    }

    #[test]
    fn finds_what_covers_forgets_on_request_and_stays_bounded() {
        let mut d = Directory::new(4);
        assert!(d.find(0, 4096).is_none());
        d.insert(cap(8192, 4096));
        assert_eq!(d.find(8192, 4096).map(|c| c.offset), Some(8192));
        assert_eq!(d.find(8192 + 1024, 512).map(|c| c.offset), Some(8192));
        assert!(d.find(8192 + 1024, 4096).is_none(), "reaches past the reference");
        assert!(d.find(4096, 4096).is_none());
        d.insert(cap(0, 1 << 20));
        assert!(d.find(0, 4096).is_none(), "another grain is ignored");
        d.forget(8192 + 512);
        assert!(d.find(8192, 4096).is_none());
        for i in 0..100 {
            d.insert(cap(i * 4096, 4096));
        }
        let held = (0..100).filter(|&i| d.find(i * 4096, 4096).is_some()).count();
        assert!((1..=4).contains(&held), "bounded: {held}");
        d.clear();
        assert!((0..100).all(|i| d.find(i * 4096, 4096).is_none()));
    }
}

#[cfg(test)]
mod extents {
    use super::*;
    use wire::CapRights;

    fn extent(offset: u64, pages: u32) -> Capability {
        Capability {
            export: 0,
            kind: CapKind::Extent,
            rights: CapRights::READ,
            epoch: 1,
            generation: 9,
            offset,
            length: pages,
            slot: 0,
            expires_ms: u64::MAX,
            mac: [0; 16],
        }
    }

    #[test]
    fn extents_of_any_size_are_found_by_range_kept_few_and_forgotten_whole() {
        let mut d = Directory::new(4);
        // 64 GiB from 1 GiB: found for a read anywhere in it, however far from its start.
        d.insert(extent(1 << 30, 16 << 20));
        assert!(d.find((40 << 30) + 8192, 4096).is_some());
        assert!(d.find(0, 4096).is_none(), "before it");
        assert!(d.find((65 << 30) - 4096, 8192).is_none(), "past its end");
        // The same range again replaces it; others pile up to the bound, oldest out first.
        d.insert(extent(1 << 30, 16 << 20));
        for i in 0..EXTENTS_MAX as u64 {
            d.insert(extent((100 + i) << 30, 1));
        }
        assert!(d.find(1 << 30, 4096).is_none(), "the oldest made room");
        assert!(d.find(100 << 30, 4096).is_some());
        d.forget((100 << 30) + 100);
        assert!(d.find(100 << 30, 4096).is_none());
        assert!(d.find(101 << 30, 4096).is_some(), "only what covered the offset");
        d.clear();
        assert!(d.find(101 << 30, 4096).is_none());
    }
}

#[cfg(test)]
mod capacity {
    use super::*;

    #[test]
    fn a_contiguous_range_as_large_as_the_directory_is_held_whole() {
        let mut d = Directory::new(1 << 12);
        let cap = |i: u64| Capability {
            export: 0,
            kind: wire::CapKind::Slot,
            rights: wire::CapRights::READ,
            epoch: 1,
            generation: 2,
            offset: (1000 + i) * 4096,
            length: 4096,
            slot: 0,
            expires_ms: 1,
            mac: [0; 16],
        };
        for i in 0..1 << 12 {
            d.insert(cap(i));
        }
        assert!((0..1 << 12).all(|i| d.find(cap(i).offset, 4096).is_some()));
    }
}
