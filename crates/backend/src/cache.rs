//! The target-side block cache of a file-backed export: registered memory that direct reads
//! are served from (ODAFS's server cache, section 4), without the backend.
//!
//! The cache holds [`SLOT_BYTES`] blocks in slots of one page-aligned [`Region`], organised as
//! sets of [`WAYS`] slots; a block can live only in its set, so finding it needs no index.
//! Each slot has a **generation** that moves on whenever the slot's contents change (a fill,
//! an eviction, an invalidation). A capability names a slot and the generation it was sealed
//! at; a direct read copies the slot and then checks that the generation did not move during
//! the copy (a sequence lock), so it serves either the bytes the capability was sealed for, or
//! nothing (a stale fault) — never another block's bytes, never a torn mix.
//!
//! Consistency with writes. Ordinary reads go through the backend and may then *fill* their
//! blocks into the cache. A write invalidates the blocks it touches after the backend took it
//! and before it is acknowledged ([`BlockCache::invalidate`]), bumping their sets' versions;
//! a fill records its sets' versions before its backend read ([`BlockCache::fill_ticket`]) and
//! installs a block only if the version has not moved since ([`BlockCache::fill`]). So a fill
//! that read data older than a completed write can never install it after the write's
//! invalidation, and one installed before the invalidation is removed by it. The cache is
//! never a source of data older than the last acknowledged write.
//!
//! Eviction is CLOCK within a set: a slot read since the hand last passed gets a second
//! chance. Fills and invalidations take their set's spin lock (held for one 4 KiB copy at
//! most); direct reads take no lock.

use std::io;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};

use rt::mem::Region;

/// Bytes in one cache slot: the unit of capabilities for cached data.
pub const SLOT_BYTES: usize = 4096;
/// Slots per set.
pub const WAYS: usize = 8;
/// Most blocks one fill installs (a larger read is served but not cached).
pub const FILL_BLOCKS_MAX: usize = 64;

const EMPTY: u64 = u64::MAX;

#[derive(Debug)]
struct Slot {
    /// The volume block (offset / SLOT_BYTES) held, or EMPTY.
    block: AtomicU64,
    /// Even when stable, odd while the contents change.
    generation: AtomicU32,
    referenced: AtomicBool,
}

#[derive(Debug)]
struct Set {
    locked: AtomicBool,
    /// Bumped by every invalidation that touches a block of this set.
    version: AtomicU64,
    hand: AtomicU8,
}

/// What the cache did, for stats.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheCounters {
    /// Blocks installed by fills.
    pub fills: u64,
    /// Fills skipped because a write touched the block meanwhile.
    pub fills_raced: u64,
    /// Blocks pushed out to make room.
    pub evictions: u64,
    /// Cached blocks dropped by writes, trims, or an explicit invalidation.
    pub invalidations: u64,
    /// Direct reads served from a slot.
    pub hits: u64,
    /// Direct reads refused because the slot's generation moved on.
    pub stale: u64,
}

#[derive(Debug, Default)]
struct AtomicCacheCounters {
    fills: AtomicU64,
    fills_raced: AtomicU64,
    evictions: AtomicU64,
    invalidations: AtomicU64,
    hits: AtomicU64,
    stale: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Where a filled block lives: what a capability for it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Filled {
    /// Volume offset of the block.
    pub offset: u64,
    pub slot: u32,
    pub generation: u32,
}

/// The set versions a fill saw before its backend read ([`BlockCache::fill_ticket`]).
#[derive(Debug, Clone, Copy)]
pub struct FillTicket {
    first_block: u64,
    blocks: usize,
    versions: [u64; FILL_BLOCKS_MAX],
}

/// A block cache. See the module documentation.
pub struct BlockCache {
    memory: Region,
    slots: Box<[Slot]>,
    sets: Box<[Set]>,
    counters: AtomicCacheCounters,
}

impl std::fmt::Debug for BlockCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCache").field("slots", &self.slots.len()).finish()
    }
}

/// Holds a set's lock until dropped.
struct SetGuard<'a>(&'a Set);

impl Drop for SetGuard<'_> {
    fn drop(&mut self) {
        self.0.locked.store(false, Ordering::Release);
    }
}

impl Set {
    fn lock(&self) -> SetGuard<'_> {
        while self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            std::hint::spin_loop();
        }
        SetGuard(self)
    }
}

impl BlockCache {
    /// A cache of about `bytes` (rounded down to whole sets, at least one set). Its memory is
    /// mapped now and committed as slots fill.
    pub fn new(bytes: u64) -> io::Result<BlockCache> {
        let set_bytes = (SLOT_BYTES * WAYS) as u64;
        let sets = (bytes / set_bytes).max(1);
        let sets = usize::try_from(sets).map_err(|_| io::Error::other("cache size does not fit"))?;
        let slots = sets * WAYS;
        Ok(BlockCache {
            memory: Region::new(slots * SLOT_BYTES)?,
            slots: (0..slots)
                .map(|_| Slot {
                    block: AtomicU64::new(EMPTY),
                    generation: AtomicU32::new(0),
                    referenced: AtomicBool::new(false),
                })
                .collect(),
            sets: (0..sets)
                .map(|_| Set {
                    locked: AtomicBool::new(false),
                    version: AtomicU64::new(0),
                    hand: AtomicU8::new(0),
                })
                .collect(),
            counters: AtomicCacheCounters::default(),
        })
    }

    /// Bytes of cached data the cache can hold.
    pub fn capacity_bytes(&self) -> u64 {
        (self.slots.len() * SLOT_BYTES) as u64
    }

    pub fn counters(&self) -> CacheCounters {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CacheCounters {
            fills: get(&c.fills),
            fills_raced: get(&c.fills_raced),
            evictions: get(&c.evictions),
            invalidations: get(&c.invalidations),
            hits: get(&c.hits),
            stale: get(&c.stale),
        }
    }

    /// A block's set: its number modulo the sets, as a hardware cache indexes, so that a
    /// contiguous range as large as the cache fits it with no conflict at all (hashing would
    /// overflow some sets long before the cache is full).
    fn set_of(&self, block: u64) -> usize {
        (block % self.sets.len() as u64) as usize
    }

    /// The set versions a fill of `len` bytes from `offset` must still see when it installs.
    /// `None` when the range cannot be cached: not whole slots, or more than
    /// [`FILL_BLOCKS_MAX`] of them.
    pub fn fill_ticket(&self, offset: u64, len: usize) -> Option<FillTicket> {
        let slot = SLOT_BYTES as u64;
        if !offset.is_multiple_of(slot) || len == 0 || !len.is_multiple_of(SLOT_BYTES) {
            return None;
        }
        let blocks = len / SLOT_BYTES;
        if blocks > FILL_BLOCKS_MAX {
            return None;
        }
        let first_block = offset / slot;
        let mut versions = [0u64; FILL_BLOCKS_MAX];
        for (i, v) in versions.iter_mut().take(blocks).enumerate() {
            *v = self.sets[self.set_of(first_block + i as u64)].version.load(Ordering::Acquire);
        }
        Some(FillTicket { first_block, blocks, versions })
    }

    /// Install `data`, read from the backend after `ticket` was taken, block by block; calls
    /// `each` with where every block now lives. A block whose set saw a write since the
    /// ticket is skipped. A block already cached is not copied again.
    pub fn fill(&self, ticket: &FillTicket, data: &[u8], mut each: impl FnMut(Filled)) {
        debug_assert_eq!(data.len(), ticket.blocks * SLOT_BYTES);
        for i in 0..ticket.blocks {
            let block = ticket.first_block + i as u64;
            let set_index = self.set_of(block);
            let set = &self.sets[set_index];
            let _guard = set.lock();
            if set.version.load(Ordering::Relaxed) != ticket.versions[i] {
                bump(&self.counters.fills_raced);
                continue;
            }
            let ways = set_index * WAYS..(set_index + 1) * WAYS;
            let slot = match self.slots[ways.clone()]
                .iter()
                .position(|s| s.block.load(Ordering::Relaxed) == block)
            {
                Some(way) => ways.start + way,
                None => {
                    let victim = self.victim(set_index);
                    self.replace(victim, block, &data[i * SLOT_BYTES..(i + 1) * SLOT_BYTES]);
                    bump(&self.counters.fills);
                    victim
                }
            };
            let generation = self.slots[slot].generation.load(Ordering::Relaxed);
            each(Filled { offset: block * SLOT_BYTES as u64, slot: slot as u32, generation });
        }
    }

    /// CLOCK within the set: an empty slot, else the first not referenced since the hand last
    /// passed (clearing the bits it passes). Called with the set locked.
    fn victim(&self, set_index: usize) -> usize {
        let base = set_index * WAYS;
        if let Some(way) =
            self.slots[base..base + WAYS].iter().position(|s| s.block.load(Ordering::Relaxed) == EMPTY)
        {
            return base + way;
        }
        let set = &self.sets[set_index];
        let mut hand = set.hand.load(Ordering::Relaxed) as usize % WAYS;
        loop {
            let slot = &self.slots[base + hand];
            let next = (hand + 1) % WAYS;
            if !slot.referenced.swap(false, Ordering::Relaxed) {
                set.hand.store(next as u8, Ordering::Relaxed);
                bump(&self.counters.evictions);
                return base + hand;
            }
            hand = next;
        }
    }

    /// Put `block` with `bytes` into `slot` (its set locked), moving its generation on.
    fn replace(&self, slot: usize, block: u64, bytes: &[u8]) {
        let s = &self.slots[slot];
        let g = s.generation.load(Ordering::Relaxed);
        s.generation.store(g.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        s.block.store(block, Ordering::Relaxed);
        self.memory.write_at(slot * SLOT_BYTES, bytes);
        s.referenced.store(false, Ordering::Relaxed);
        s.generation.store(g.wrapping_add(2), Ordering::Release);
    }

    /// Drop every cached block that `len` bytes from `offset` touch, and make any fill that
    /// read them before now install nothing. Call after the backend took a write (trim,
    /// write-zeroes) and before acknowledging it.
    pub fn invalidate(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let slot = SLOT_BYTES as u64;
        let first = offset / slot;
        let end = offset.saturating_add(len).div_ceil(slot);
        if end - first > self.slots.len() as u64 {
            // A range larger than the cache: visit every set once instead of every block.
            for set_index in 0..self.sets.len() {
                self.invalidate_in_set(set_index, |b| b >= first && b < end);
            }
            return;
        }
        for block in first..end {
            self.invalidate_in_set(self.set_of(block), |b| b == block);
        }
    }

    /// Drop everything cached (every outstanding slot capability becomes stale).
    pub fn invalidate_all(&self) {
        for set_index in 0..self.sets.len() {
            self.invalidate_in_set(set_index, |_| true);
        }
    }

    fn invalidate_in_set(&self, set_index: usize, hit: impl Fn(u64) -> bool) {
        let set = &self.sets[set_index];
        let _guard = set.lock();
        set.version.fetch_add(1, Ordering::Release);
        for s in &self.slots[set_index * WAYS..(set_index + 1) * WAYS] {
            let b = s.block.load(Ordering::Relaxed);
            if b != EMPTY && hit(b) {
                let g = s.generation.load(Ordering::Relaxed);
                s.block.store(EMPTY, Ordering::Relaxed);
                s.generation.store(g.wrapping_add(2), Ordering::Release);
                bump(&self.counters.invalidations);
            }
        }
    }

    /// Copy `dst.len()` bytes of the block in `slot` from `offset` (a volume offset inside
    /// that block) into `dst`, if the slot still holds what it held at `generation`. Returns
    /// false (and `dst` holds unspecified bytes) when it does not: the capability is stale.
    pub fn read(&self, slot: u32, generation: u32, offset: u64, dst: &mut [u8]) -> bool {
        let Some(s) = self.slots.get(slot as usize) else { return false };
        let within = (offset % SLOT_BYTES as u64) as usize;
        if within + dst.len() > SLOT_BYTES || s.generation.load(Ordering::Acquire) != generation {
            bump(&self.counters.stale);
            return false;
        }
        self.memory.read_at(slot as usize * SLOT_BYTES + within, dst);
        fence(Ordering::Acquire);
        if s.generation.load(Ordering::Relaxed) != generation {
            bump(&self.counters.stale);
            return false;
        }
        if !s.referenced.load(Ordering::Relaxed) {
            s.referenced.store(true, Ordering::Relaxed);
        }
        bump(&self.counters.hits);
        true
    }

    /// The generation `slot` holds now (for tests and the simulator).
    pub fn generation(&self, slot: u32) -> Option<u32> {
        self.slots.get(slot as usize).map(|s| s.generation.load(Ordering::Acquire))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(fill: u8) -> Vec<u8> {
        vec![fill; SLOT_BYTES]
    }

    fn fill_one(cache: &BlockCache, offset: u64, data: &[u8]) -> Vec<Filled> {
        let ticket = cache.fill_ticket(offset, data.len()).unwrap();
        let mut out = Vec::new();
        cache.fill(&ticket, data, |f| out.push(f));
        out
    }

    #[test]
    fn a_filled_block_reads_back_until_invalidated() {
        let cache = BlockCache::new(64 * 1024).unwrap();
        let f = fill_one(&cache, 8192, &block(7));
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].offset, 8192);
        let mut dst = vec![0u8; 512];
        assert!(cache.read(f[0].slot, f[0].generation, 8192 + 1024, &mut dst));
        assert!(dst.iter().all(|&b| b == 7));
        cache.invalidate(8192 + 512, 1);
        assert!(!cache.read(f[0].slot, f[0].generation, 8192, &mut dst), "a write makes it stale");
        let c = cache.counters();
        assert_eq!((c.fills, c.hits, c.invalidations, c.stale), (1, 1, 1, 1));
    }

    #[test]
    fn a_fill_that_raced_a_write_installs_nothing() {
        let cache = BlockCache::new(64 * 1024).unwrap();
        let ticket = cache.fill_ticket(0, 2 * SLOT_BYTES).unwrap();
        // A write to the second block completes between the backend read and the fill.
        cache.invalidate(SLOT_BYTES as u64, SLOT_BYTES as u64);
        let mut filled = Vec::new();
        cache.fill(&ticket, &[block(1), block(2)].concat(), |f| filled.push(f));
        // The raced block is never installed (the other one is, unless it shares the set).
        assert!(filled.iter().all(|f| f.offset == 0));
        assert!(cache.counters().fills_raced >= 1);
    }

    #[test]
    fn eviction_moves_generations_and_refills_serve_new_data() {
        // One set of WAYS slots: every block competes for it.
        let cache = BlockCache::new((SLOT_BYTES * WAYS) as u64).unwrap();
        let first = fill_one(&cache, 0, &block(1))[0];
        for i in 1..=WAYS as u64 {
            fill_one(&cache, i * SLOT_BYTES as u64, &block(i as u8 + 1));
        }
        let mut dst = vec![0u8; SLOT_BYTES];
        assert!(!cache.read(first.slot, first.generation, 0, &mut dst), "evicted");
        assert!(cache.counters().evictions >= 1);
        let again = fill_one(&cache, 0, &block(9))[0];
        assert!(cache.read(again.slot, again.generation, 0, &mut dst));
        assert!(dst.iter().all(|&b| b == 9));
    }

    #[test]
    fn only_whole_slots_are_cached_and_big_ranges_invalidate_everything() {
        let cache = BlockCache::new(64 * 1024).unwrap();
        assert!(cache.fill_ticket(512, SLOT_BYTES).is_none());
        assert!(cache.fill_ticket(0, 512).is_none());
        assert!(cache.fill_ticket(0, (FILL_BLOCKS_MAX + 1) * SLOT_BYTES).is_none());
        let f = fill_one(&cache, 4096 * 100, &block(3))[0];
        cache.invalidate(0, u64::MAX);
        assert!(!cache.read(f.slot, f.generation, 4096 * 100, &mut [0u8; 16]));
        let g = fill_one(&cache, 0, &block(4))[0];
        cache.invalidate_all();
        assert!(!cache.read(g.slot, g.generation, 0, &mut [0u8; 16]));
        assert!(!cache.read(u32::MAX, 0, 0, &mut [0u8; 16]), "no such slot");
    }

    #[test]
    fn concurrent_fills_invalidations_and_reads_never_serve_a_torn_or_foreign_block() {
        use std::sync::Arc;
        let cache = Arc::new(BlockCache::new((SLOT_BYTES * WAYS * 2) as u64).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..2u8)
            .map(|t| {
                let (cache, stop) = (Arc::clone(&cache), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let blk = (i * 7 + u64::from(t)) % 64;
                        // Every block's bytes are its own number: a foreign block shows.
                        fill_one(&cache, blk * SLOT_BYTES as u64, &block(blk as u8));
                        if i.is_multiple_of(3) {
                            cache.invalidate(blk * SLOT_BYTES as u64, 1);
                        }
                        i += 1;
                    }
                })
            })
            .collect();
        let mut served = 0;
        for round in 0..20_000u64 {
            let blk = round % 64;
            let ticket = cache.fill_ticket(blk * SLOT_BYTES as u64, SLOT_BYTES).unwrap();
            let mut got = None;
            cache.fill(&ticket, &block(blk as u8), |f| got = Some(f));
            if let Some(f) = got {
                let mut dst = vec![0u8; SLOT_BYTES];
                if cache.read(f.slot, f.generation, f.offset, &mut dst) {
                    assert!(dst.iter().all(|&b| b == blk as u8), "block {blk} served foreign bytes");
                    served += 1;
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            w.join().unwrap();
        }
        assert!(served > 0);
    }
}

#[cfg(test)]
mod capacity {
    use super::*;

    #[test]
    fn a_contiguous_range_as_large_as_the_cache_is_held_whole() {
        let cache = BlockCache::new((SLOT_BYTES * WAYS * 5) as u64).unwrap();
        let blocks = (WAYS * 5) as u64;
        let mut filled = Vec::new();
        for b in 0..blocks {
            let offset = (77 + b) * SLOT_BYTES as u64;
            let ticket = cache.fill_ticket(offset, SLOT_BYTES).unwrap();
            cache.fill(&ticket, &vec![b as u8; SLOT_BYTES], |f| filled.push(f));
        }
        assert_eq!(cache.counters().evictions, 0);
        for f in filled {
            assert!(cache.read(f.slot, f.generation, f.offset, &mut [0u8; 64]));
        }
    }
}
