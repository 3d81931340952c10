//! Chunk grants: the capabilities that authorise I/O to an RStore pool (docs/PROTOCOL.md,
//! section 14.6; docs/RSTORE.md).
//!
//! A memory server serves its pool as one export whose requests are refused unless the
//! connection presented, in a `GRANT` frame, a grant for the chunk they touch: a capability of
//! kind [`CapKind::Chunk`] naming the chunk (`slot`), its byte range, the rights, the chunk's
//! **generation** and the stripe's **map epoch**. Grants are sealed under the pool's grant key,
//! which the server draws at start-up and gives to the control plane alone (its registration
//! in etcd): the control plane is RStore's master, and hands a namespace's grants to whoever
//! maps it, as the master hands out STags. The data path then costs the server one lookup per
//! request: the MAC is checked once, when the grant is presented, not on every request.
//!
//! Revocation is by generation, as for cache slots: when the server zeroes a chunk given back
//! it first moves the chunk's generation on ([`PoolGrants::retire`]), so every grant of the
//! chunk's previous owner is stale from then on, and the control plane records the new
//! generation for the next owner's grants. A new key (the server restarted) makes every grant
//! sealed before it bad. Grants do not expire.
//!
//! **Map epochs.** Every change to a stripe's copies (one goes stale, a repair starts or ends)
//! moves the namespace's epoch on, and the stripe's grants carry the epoch of its last change.
//! A chunk here keeps the highest epoch it was shown: an authentic grant of a higher epoch moves
//! it up when presented ([`PoolGrants::admit`]), and from then on requests made under an older
//! grant are stale, so a client with an old map re-reads it instead of writing where the map no
//! longer says. The epoch goes back to 0 with the generation when the chunk is retired.
//!
//! **Repair.** While a stripe has a copy that misses writes, the control plane seals its other
//! copies' grants with [`CapRights::TRACK`]: each write under such a grant marks the regions it
//! touches (a chunk is 64 regions) dirty here, so that a copy that comes back is repaired by
//! copying only those ([`PoolGrants::dirty`]). A grant of a newer epoch without `TRACK` says the
//! stripe is whole again, and clears them. A region being copied out is locked: writes into it
//! complete with `Busy` and are sent again by their initiator ([`PoolGrants::lock`]).

use std::sync::atomic::{AtomicU64, Ordering};

use wire::{CapKind, CapRights, Capability, Opcode, Status};

use crate::capability::{CapFault, CapKey, KEY_LEN};

/// A grant's `expires_ms`: never (grants are revoked by generation and key, not by time).
pub const NEVER: u64 = u64::MAX;

/// The grant for `chunk` (of `chunk_bytes`) at `generation` and map epoch 0, sealed under
/// `key`.
pub fn seal(key: &CapKey, chunk: u64, chunk_bytes: u64, generation: u32, rights: CapRights) -> Capability {
    seal_at(key, chunk, chunk_bytes, generation, 0, rights)
}

/// The grant for `chunk` (of `chunk_bytes`) at `generation` and map `epoch`, sealed under
/// `key`: what the control plane hands to a namespace's clients.
pub fn seal_at(
    key: &CapKey,
    chunk: u64,
    chunk_bytes: u64,
    generation: u32,
    epoch: u32,
    rights: CapRights,
) -> Capability {
    key.seal(Capability {
        export: 0,
        kind: CapKind::Chunk,
        rights,
        epoch,
        generation,
        offset: chunk * chunk_bytes,
        length: chunk_bytes as u32,
        slot: chunk as u32,
        expires_ms: NEVER,
        mac: [0; wire::capability::MAC_LEN],
    })
}

/// What a connection holds for one chunk once its grant was admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    pub chunk: u64,
    pub generation: u32,
    pub epoch: u32,
    pub rights: CapRights,
}

/// Regions a chunk is divided into for dirty tracking and repair locks: one bit each.
pub const REGIONS: u32 = 64;

/// One chunk's state, shared by every worker.
#[derive(Debug, Default)]
struct Chunk {
    /// The generation (high half) and the map epoch (low half): one word, so that a grant
    /// raising the epoch can never land on a chunk retired meanwhile, and a request's check is
    /// one load.
    version: AtomicU64,
    /// Regions written under a `TRACK` grant since the stripe was last whole.
    dirty: AtomicU64,
    /// Regions being copied out by a repair: writes into them are `Busy`.
    locked: AtomicU64,
}

fn version(generation: u32, epoch: u32) -> u64 {
    u64::from(generation) << 32 | u64::from(epoch)
}

fn split(version: u64) -> (u32, u32) {
    ((version >> 32) as u32, version as u32)
}

/// A pool export's grant key, chunk geometry and chunk states, shared by every worker.
#[derive(Debug)]
pub struct PoolGrants {
    key: CapKey,
    chunk_bytes: u64,
    chunks: Box<[Chunk]>,
    /// Held while a grant raises a chunk's epoch and clears its dirty regions, so that no
    /// raise to a newer epoch (and no tracked write under it) falls between the two steps of
    /// an older one. Raises are rare (a stripe's copies changed); requests never take it.
    raising: std::sync::Mutex<()>,
}

impl PoolGrants {
    /// `chunks` chunks of `chunk_bytes` (a power of two from 64 bytes to 2 GiB, so that each
    /// of its [`REGIONS`] holds a byte and a grant's 32-bit length holds it), all at
    /// generation 0.
    pub fn new(key: [u8; KEY_LEN], chunk_bytes: u64, chunks: u64) -> Result<PoolGrants, String> {
        if !chunk_bytes.is_power_of_two() || !(u64::from(REGIONS)..=1 << 31).contains(&chunk_bytes) {
            return Err(format!("chunk size {chunk_bytes}: a power of two from 64 bytes to 2 GiB"));
        }
        if chunks > u64::from(u32::MAX) {
            return Err(format!("{chunks} chunks: at most {} in a pool", u32::MAX));
        }
        let chunks = (0..chunks).map(|_| Chunk::default()).collect();
        Ok(PoolGrants { key: CapKey::new(key), chunk_bytes, chunks, raising: std::sync::Mutex::new(()) })
    }

    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    pub fn chunks(&self) -> u64 {
        self.chunks.len() as u64
    }

    /// Bytes per region of a chunk.
    pub fn region_bytes(&self) -> u64 {
        self.chunk_bytes / u64::from(REGIONS)
    }

    fn chunk(&self, chunk: u64) -> Option<&Chunk> {
        self.chunks.get(usize::try_from(chunk).ok()?)
    }

    /// The chunk's generation and map epoch now; `None` past the pool.
    pub fn version(&self, chunk: u64) -> Option<(u32, u32)> {
        // SeqCst, as `retire` and `lock`: the server orders them against the passes of its
        // workers (a worker marks its pass, then loads the chunk's state; a repair or a
        // retirement changes it, then looks at the passes), which needs one total order.
        self.chunk(chunk).map(|c| split(c.version.load(Ordering::SeqCst)))
    }

    /// The chunk's generation now; `None` past the pool.
    pub fn generation(&self, chunk: u64) -> Option<u32> {
        self.version(chunk).map(|(g, _)| g)
    }

    /// Set the chunk's generation, at map epoch 0 (a restarted server takes up the
    /// generations the control plane recorded). Ignored past the pool.
    pub fn set_generation(&self, chunk: u64, generation: u32) {
        if let Some(c) = self.chunk(chunk) {
            c.version.store(version(generation, 0), Ordering::SeqCst);
        }
    }

    /// Move the chunk's generation on (its epoch back to 0, its dirty regions cleared), making
    /// every grant of it stale; returns the new generation. `None` past the pool. Requests
    /// already past their check may still be running: the driver waits for them
    /// (`server::Pool::retire`).
    pub fn retire(&self, chunk: u64) -> Option<u32> {
        let c = self.chunk(chunk)?;
        let was = c.version.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
            Some(version(split(v).0.wrapping_add(1), 0))
        });
        c.dirty.store(0, Ordering::SeqCst);
        Some(split(was.unwrap_or_else(|v| v)).0.wrapping_add(1))
    }

    /// Move the chunk's map epoch up to `epoch` at generation `generation` (a repair on this
    /// server, told by the control plane). `Err` with the chunk's version when it is at another
    /// generation or a higher epoch already; `None` past the pool. As for [`retire`], requests
    /// already past their check may still be running.
    ///
    /// [`retire`]: PoolGrants::retire
    pub fn raise(&self, chunk: u64, generation: u32, epoch: u32) -> Option<Result<(), (u32, u32)>> {
        let c = self.chunk(chunk)?;
        let raised = c.version.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
            let (g, e) = split(v);
            (g == generation && e <= epoch).then_some(version(g, epoch))
        });
        Some(raised.map(drop).map_err(split))
    }

    /// A grant of `chunk` at its current generation and epoch, sealed here: for the server's
    /// own connections (zeroing the chunks given back, copying them out for a repair).
    pub fn mint(&self, chunk: u64, rights: CapRights) -> Option<Capability> {
        let (generation, epoch) = self.version(chunk)?;
        Some(seal_at(&self.key, chunk, self.chunk_bytes, generation, epoch, rights))
    }

    /// Judge a presented grant: sealed under this pool's key (the MAC, first, in constant
    /// time), a chunk grant of exactly one chunk of this pool, of the chunk's current
    /// generation, and of its map epoch or a newer one, which the chunk takes up: from then on
    /// grants of older epochs are stale. A newer epoch without [`CapRights::TRACK`] clears
    /// the chunk's dirty regions. A stale grant is [`CapFault::Evicted`]; anything else wrong
    /// is a refusal.
    pub fn admit(&self, cap: &Capability) -> Result<Bound, CapFault> {
        if !self.key.authentic(cap) {
            return Err(CapFault::Forged);
        }
        let chunk = u64::from(cap.slot);
        let exact = cap.kind == CapKind::Chunk
            && cap.export == 0
            && cap.offset == chunk * self.chunk_bytes
            && u64::from(cap.length) == self.chunk_bytes;
        let Some(c) = self.chunk(chunk).filter(|_| exact) else { return Err(CapFault::NotCovered) };
        if c.version.load(Ordering::SeqCst) == version(cap.generation, cap.epoch) {
            // The chunk's epoch already: nothing to raise or clear.
            return Ok(Bound { chunk, generation: cap.generation, epoch: cap.epoch, rights: cap.rights });
        }
        let _raising = self.raising.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let was = c.version.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
            let (g, e) = split(v);
            (g == cap.generation && e < cap.epoch).then_some(version(g, cap.epoch))
        });
        match was.map(split) {
            // Raised: the stripe changed. Without TRACK it is whole again.
            Ok(_) if !cap.rights.contains(CapRights::TRACK) => c.dirty.store(0, Ordering::SeqCst),
            Ok(_) => {}
            Err(v) if split(v) != (cap.generation, cap.epoch) => return Err(CapFault::Evicted),
            Err(_) => {}
        }
        Ok(Bound { chunk, generation: cap.generation, epoch: cap.epoch, rights: cap.rights })
    }

    /// The chunk a request of `length` bytes at `offset` lies in, if it lies in one.
    pub fn chunk_of(&self, offset: u64, length: u32) -> Option<u64> {
        let last = offset.checked_add(u64::from(length.max(1)) - 1)?;
        let chunk = offset / self.chunk_bytes;
        (last / self.chunk_bytes == chunk).then_some(chunk)
    }

    /// The regions of its chunk that `length` bytes at `offset` touch, as a mask.
    fn regions(&self, offset: u64, length: u32) -> u64 {
        let shift = self.region_bytes().trailing_zeros();
        let within = offset & (self.chunk_bytes - 1);
        let first = within >> shift;
        let last = (within + u64::from(length.max(1)) - 1) >> shift;
        let upto = if last >= 63 { u64::MAX } else { (1u64 << (last + 1)) - 1 };
        upto & !((1u64 << first) - 1)
    }

    /// Whether a request of `length` bytes at `offset` may run on the grant `bound` (what the
    /// connection holds for the request's chunk, if anything): `BadCapability` without a
    /// grant, or with one that lacks the right; `StaleCapability` when the chunk was retired
    /// or its map epoch moved on since; `Busy` for a write into a region a repair is copying
    /// out. A write under a `TRACK` grant marks its regions dirty. `FLUSH` touches no chunk:
    /// any grant the handle holds will do (a connection that holds none may not make the
    /// server sync its pool).
    pub fn check(
        &self,
        opcode: Opcode,
        bound: Option<&Bound>,
        offset: u64,
        length: u32,
    ) -> Result<(), Status> {
        let Some(b) = bound else { return Err(Status::BadCapability) };
        if opcode == Opcode::Flush {
            return Ok(());
        }
        let needs = if opcode.is_mutating() { CapRights::WRITE } else { CapRights::READ };
        if !b.rights.contains(needs) {
            return Err(Status::BadCapability);
        }
        let Some(c) = self.chunk(b.chunk) else { return Err(Status::StaleCapability) };
        if c.version.load(Ordering::SeqCst) != version(b.generation, b.epoch) {
            return Err(Status::StaleCapability);
        }
        if opcode.is_mutating() {
            let regions = self.regions(offset, length);
            if c.locked.load(Ordering::SeqCst) & regions != 0 {
                return Err(Status::Busy);
            }
            if b.rights.contains(CapRights::TRACK) {
                c.dirty.fetch_or(regions, Ordering::SeqCst);
            }
        }
        Ok(())
    }

    /// The chunk's dirty regions (bit `i`: bytes `i × region_bytes` of it); 0 past the pool.
    pub fn dirty(&self, chunk: u64) -> u64 {
        self.chunk(chunk).map_or(0, |c| c.dirty.load(Ordering::SeqCst))
    }

    /// Lock `regions` of the chunk (`true`) or unlock them: while locked, writes into them are
    /// `Busy`. Writes already past their check may still be running: the driver waits for
    /// them before it copies (`server::Pool::lock`).
    pub fn lock(&self, chunk: u64, regions: u64, locked: bool) {
        if let Some(c) = self.chunk(chunk) {
            if locked {
                c.locked.fetch_or(regions, Ordering::SeqCst);
            } else {
                c.locked.fetch_and(!regions, Ordering::SeqCst);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RW: CapRights = CapRights::READ.union(CapRights::WRITE);

    fn pool() -> PoolGrants {
        PoolGrants::new([5; KEY_LEN], 1 << 20, 8).unwrap()
    }

    #[test]
    fn a_grant_sealed_with_the_pool_key_is_admitted_and_authorises_its_chunk() {
        let p = pool();
        let key = CapKey::new([5; KEY_LEN]);
        let g = seal(&key, 3, 1 << 20, 0, RW);
        let bound = p.admit(&g).unwrap();
        assert_eq!(bound, Bound { chunk: 3, generation: 0, epoch: 0, rights: RW });
        assert_eq!(p.chunk_of(3 << 20, 4096), Some(3));
        assert_eq!(p.chunk_of((4 << 20) - 1, 1), Some(3));
        assert_eq!(p.chunk_of((4 << 20) - 1, 2), None, "straddles two chunks");
        assert_eq!(p.check(Opcode::Write, Some(&bound), 3 << 20, 4096), Ok(()));
        assert_eq!(p.check(Opcode::Read, None, 3 << 20, 4096), Err(Status::BadCapability));
        assert_eq!(
            p.check(Opcode::Flush, None, 3 << 20, 4096),
            Err(Status::BadCapability),
            "a flush needs some grant"
        );
        assert_eq!(p.check(Opcode::Flush, Some(&bound), 3 << 20, 4096), Ok(()));
        let read_only = p.admit(&seal(&key, 3, 1 << 20, 0, CapRights::READ)).unwrap();
        assert_eq!(p.check(Opcode::Read, Some(&read_only), 3 << 20, 4096), Ok(()));
        assert_eq!(p.check(Opcode::WriteZeroes, Some(&read_only), 3 << 20, 4096), Err(Status::BadCapability));
        // The server's own grants are the same.
        assert_eq!(p.mint(3, RW), Some(g));
        assert_eq!(p.mint(8, RW), None, "past the pool");
    }

    #[test]
    fn forged_misshapen_and_retired_grants_are_refused() {
        let p = pool();
        let key = CapKey::new([5; KEY_LEN]);
        let other = CapKey::new([6; KEY_LEN]);
        assert_eq!(p.admit(&seal(&other, 1, 1 << 20, 0, RW)), Err(CapFault::Forged));
        let mut altered = seal(&key, 1, 1 << 20, 0, RW);
        altered.slot = 2;
        assert_eq!(p.admit(&altered), Err(CapFault::Forged));
        assert_eq!(p.admit(&seal(&key, 1, 1 << 19, 0, RW)), Err(CapFault::NotCovered), "another geometry");
        assert_eq!(p.admit(&seal(&key, 8, 1 << 20, 0, RW)), Err(CapFault::NotCovered), "past the pool");
        let slot = key.seal(Capability { kind: CapKind::Slot, ..seal(&key, 1, 1 << 20, 0, RW) });
        assert_eq!(p.admit(&slot), Err(CapFault::NotCovered), "not a chunk grant");

        let g = seal(&key, 1, 1 << 20, 0, RW);
        let bound = p.admit(&g).unwrap();
        assert_eq!(p.retire(1), Some(1));
        assert_eq!(
            p.check(Opcode::Read, Some(&bound), 3 << 20, 4096),
            Err(Status::StaleCapability),
            "held before"
        );
        assert_eq!(p.admit(&g), Err(CapFault::Evicted), "presented after");
        assert!(CapFault::Evicted.is_stale());
        let next = seal(&key, 1, 1 << 20, 1, RW);
        assert!(p.admit(&next).is_ok(), "the next owner's grant");
        p.set_generation(1, 9);
        assert_eq!(p.generation(1), Some(9));
        assert!(PoolGrants::new([0; KEY_LEN], 3 << 20, 1).is_err());
        assert!(PoolGrants::new([0; KEY_LEN], 32, 1).is_err(), "a region per byte at least");
        assert!(PoolGrants::new([0; KEY_LEN], 4 << 30, 1).is_err());
    }

    /// A grant of a newer map epoch moves its chunk up when presented: requests under grants
    /// of the older epoch are stale from then on, and so is presenting one. Retirement takes
    /// the epoch back to 0, and a grant of the old owner's epoch cannot raise the new owner's.
    #[test]
    fn a_newer_epoch_makes_older_maps_stale() {
        let p = pool();
        let key = CapKey::new([5; KEY_LEN]);
        let old = p.admit(&seal_at(&key, 2, 1 << 20, 0, 4, RW)).unwrap();
        assert_eq!(p.version(2), Some((0, 4)), "a first grant sets the epoch");
        assert_eq!(p.check(Opcode::Write, Some(&old), 2 << 20, 512), Ok(()));
        let new = p.admit(&seal_at(&key, 2, 1 << 20, 0, 6, RW)).unwrap();
        assert_eq!(p.version(2), Some((0, 6)));
        assert_eq!(p.check(Opcode::Write, Some(&old), 2 << 20, 512), Err(Status::StaleCapability));
        assert_eq!(p.check(Opcode::Read, Some(&old), 2 << 20, 512), Err(Status::StaleCapability));
        assert_eq!(p.check(Opcode::Read, Some(&new), 2 << 20, 512), Ok(()));
        assert_eq!(p.admit(&seal_at(&key, 2, 1 << 20, 0, 5, RW)), Err(CapFault::Evicted), "an older map");
        assert!(p.admit(&seal_at(&key, 2, 1 << 20, 0, 6, RW)).is_ok(), "the same map again");
        assert_eq!(p.version(3), Some((0, 0)), "other chunks keep theirs");
        // Retired: generation on, epoch back to 0; the old owner's newest map is stale.
        assert_eq!(p.retire(2), Some(1));
        assert_eq!(p.version(2), Some((1, 0)));
        assert_eq!(p.admit(&seal_at(&key, 2, 1 << 20, 0, 9, RW)), Err(CapFault::Evicted));
        assert_eq!(p.version(2), Some((1, 0)), "not raised by the old owner");
        // A repair on the server raises it itself, never down and never across generations.
        assert_eq!(p.raise(2, 1, 3), Some(Ok(())));
        assert_eq!(p.raise(2, 1, 2), Some(Err((1, 3))));
        assert_eq!(p.raise(2, 0, 7), Some(Err((1, 3))));
        assert_eq!(p.raise(99, 0, 7), None);
        assert_eq!(p.mint(2, RW).map(|c| (c.generation, c.epoch)), Some((1, 3)));
    }

    /// Writes under a TRACK grant mark the regions they touch, and nothing else does; a
    /// newer grant without TRACK (the stripe is whole) clears them, as does retirement.
    #[test]
    fn tracked_writes_mark_their_regions_until_the_stripe_is_whole() {
        let p = pool();
        let key = CapKey::new([5; KEY_LEN]);
        let region = p.region_bytes();
        assert_eq!(region, 16 << 10);
        let tracked = p.admit(&seal_at(&key, 1, 1 << 20, 0, 1, RW.union(CapRights::TRACK))).unwrap();
        let base = 1 << 20;
        assert_eq!(p.check(Opcode::Read, Some(&tracked), base, 4096), Ok(()));
        assert_eq!(p.dirty(1), 0, "reads mark nothing");
        p.check(Opcode::Write, Some(&tracked), base + region - 1, 2).unwrap();
        assert_eq!(p.dirty(1), 0b11, "a write across a region boundary marks both");
        p.check(Opcode::WriteZeroes, Some(&tracked), base + 63 * region, region as u32).unwrap();
        p.check(Opcode::Write, Some(&tracked), base + 10 * region + 5, 1).unwrap();
        assert_eq!(p.dirty(1), 0b11 | 1 << 10 | 1 << 63);
        // Whole again at a newer epoch: presented without TRACK, the marks go.
        let whole = p.admit(&seal_at(&key, 1, 1 << 20, 0, 2, RW)).unwrap();
        assert_eq!(p.dirty(1), 0);
        p.check(Opcode::Write, Some(&whole), base, 4096).unwrap();
        assert_eq!(p.dirty(1), 0, "an untracked write marks nothing");
        // A TRACK grant of the current epoch marks again; retirement clears.
        let again = p.admit(&seal_at(&key, 1, 1 << 20, 0, 3, RW.union(CapRights::TRACK))).unwrap();
        p.check(Opcode::Write, Some(&again), base, 4096).unwrap();
        assert_eq!(p.dirty(1), 1);
        p.retire(1);
        assert_eq!(p.dirty(1), 0);
    }

    /// A locked region refuses writes with Busy and still serves reads; unlocked, it takes
    /// writes again. Other regions and chunks are not disturbed.
    #[test]
    fn a_region_being_copied_out_refuses_writes_until_unlocked() {
        let p = pool();
        let key = CapKey::new([5; KEY_LEN]);
        let b = p.admit(&seal(&key, 4, 1 << 20, 0, RW)).unwrap();
        let (base, region) = (4u64 << 20, p.region_bytes());
        p.lock(4, 1 << 3, true);
        assert_eq!(p.check(Opcode::Write, Some(&b), base + 3 * region, 512), Err(Status::Busy));
        assert_eq!(p.check(Opcode::Trim, Some(&b), base + 2 * region, 2 * region as u32), Err(Status::Busy));
        assert_eq!(p.check(Opcode::Read, Some(&b), base + 3 * region, 512), Ok(()));
        assert_eq!(p.check(Opcode::Write, Some(&b), base + 4 * region, 512), Ok(()));
        p.lock(4, 1 << 3, false);
        assert_eq!(p.check(Opcode::Write, Some(&b), base + 3 * region, 512), Ok(()));
    }
}
