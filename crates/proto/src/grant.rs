//! Chunk grants: the capabilities that authorise I/O to an RStore pool (docs/PROTOCOL.md,
//! section 14.6; docs/RSTORE.md).
//!
//! A memory server serves its pool as one export whose requests are refused unless the
//! connection presented, in a `GRANT` frame, a grant for the chunk they touch: a capability of
//! kind [`CapKind::Chunk`] naming the chunk (`slot`), its byte range, the rights, and the
//! chunk's **generation**. Grants are sealed under the pool's grant key, which the server
//! draws at start-up and gives to the control plane alone (its registration in etcd): the
//! control plane is RStore's master, and hands a namespace's grants to whoever maps it, as the
//! master hands out STags. The data path then costs the server one lookup per request: the
//! MAC is checked once, when the grant is presented, not on every request.
//!
//! Revocation is by generation, as for cache slots: when the server zeroes a chunk given back
//! it first moves the chunk's generation on ([`PoolGrants::retire`]), so every grant of the
//! chunk's previous owner is stale from then on, and the control plane records the new
//! generation for the next owner's grants. A new key (the server restarted) makes every grant
//! sealed before it bad. Grants do not expire.

use std::sync::atomic::{AtomicU32, Ordering};

use wire::{CapKind, CapRights, Capability, Opcode, Status};

use crate::capability::{CapFault, CapKey, KEY_LEN};

/// A grant's `expires_ms`: never (grants are revoked by generation and key, not by time).
pub const NEVER: u64 = u64::MAX;

/// The grant for `chunk` (of `chunk_bytes`) at `generation`, sealed under `key`: what the
/// control plane hands to a namespace's clients.
pub fn seal(key: &CapKey, chunk: u64, chunk_bytes: u64, generation: u32, rights: CapRights) -> Capability {
    key.seal(Capability {
        export: 0,
        kind: CapKind::Chunk,
        rights,
        epoch: 0,
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
    pub rights: CapRights,
}

/// A pool export's grant key, chunk geometry and chunk generations, shared by every worker.
#[derive(Debug)]
pub struct PoolGrants {
    key: CapKey,
    chunk_bytes: u64,
    generations: Box<[AtomicU32]>,
}

impl PoolGrants {
    /// `chunks` chunks of `chunk_bytes` (a power of two of at most 2 GiB, so that a grant's
    /// 32-bit length holds it), all at generation 0.
    pub fn new(key: [u8; KEY_LEN], chunk_bytes: u64, chunks: u64) -> Result<PoolGrants, String> {
        if !chunk_bytes.is_power_of_two() || chunk_bytes > 1 << 31 {
            return Err(format!("chunk size {chunk_bytes}: a power of two up to 2 GiB"));
        }
        if chunks > u64::from(u32::MAX) {
            return Err(format!("{chunks} chunks: at most {} in a pool", u32::MAX));
        }
        let generations = (0..chunks).map(|_| AtomicU32::new(0)).collect();
        Ok(PoolGrants { key: CapKey::new(key), chunk_bytes, generations })
    }

    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    pub fn chunks(&self) -> u64 {
        self.generations.len() as u64
    }

    /// The chunk's generation now; `None` past the pool.
    pub fn generation(&self, chunk: u64) -> Option<u32> {
        // SeqCst, as `retire`: the server orders retirement against the passes of its workers
        // (a worker marks its pass, then loads generations; retirement moves a generation,
        // then looks at the passes), which needs one total order of the four.
        self.generations.get(usize::try_from(chunk).ok()?).map(|g| g.load(Ordering::SeqCst))
    }

    /// Set the chunk's generation (a restarted server takes up the generations the control
    /// plane recorded). Ignored past the pool.
    pub fn set_generation(&self, chunk: u64, generation: u32) {
        if let Some(g) = usize::try_from(chunk).ok().and_then(|i| self.generations.get(i)) {
            g.store(generation, Ordering::SeqCst);
        }
    }

    /// Move the chunk's generation on, making every grant of it stale; returns the new one.
    /// `None` past the pool. Requests already past their check may still be running: the
    /// driver waits for them (`server::Pool::retire`).
    pub fn retire(&self, chunk: u64) -> Option<u32> {
        let g = self.generations.get(usize::try_from(chunk).ok()?)?;
        Some(g.fetch_add(1, Ordering::SeqCst).wrapping_add(1))
    }

    /// A grant of `chunk` at its current generation, sealed here: for the server's own
    /// connections (zeroing the chunks given back).
    pub fn mint(&self, chunk: u64, rights: CapRights) -> Option<Capability> {
        Some(seal(&self.key, chunk, self.chunk_bytes, self.generation(chunk)?, rights))
    }

    /// Judge a presented grant: sealed under this pool's key (the MAC, first, in constant
    /// time), a chunk grant of exactly one chunk of this pool, and of the chunk's current
    /// generation. A stale grant is [`CapFault::Evicted`]; anything else wrong is a refusal.
    pub fn admit(&self, cap: &Capability) -> Result<Bound, CapFault> {
        if !self.key.authentic(cap) {
            return Err(CapFault::Forged);
        }
        let chunk = u64::from(cap.slot);
        let exact = cap.kind == CapKind::Chunk
            && cap.export == 0
            && cap.offset == chunk * self.chunk_bytes
            && u64::from(cap.length) == self.chunk_bytes;
        if !exact {
            return Err(CapFault::NotCovered);
        }
        let Some(now) = self.generation(chunk) else { return Err(CapFault::NotCovered) };
        if cap.generation != now {
            return Err(CapFault::Evicted);
        }
        Ok(Bound { chunk, generation: cap.generation, rights: cap.rights })
    }

    /// The chunk a request of `length` bytes at `offset` lies in, if it lies in one.
    pub fn chunk_of(&self, offset: u64, length: u32) -> Option<u64> {
        let last = offset.checked_add(u64::from(length.max(1)) - 1)?;
        let chunk = offset / self.chunk_bytes;
        (last / self.chunk_bytes == chunk).then_some(chunk)
    }

    /// Whether a request may run on the grant `bound` (what the connection holds for the
    /// request's chunk, if anything): `BadCapability` without a grant, or with one that lacks
    /// the right; `StaleCapability` when the chunk was retired since. `FLUSH` touches no
    /// chunk: any grant the handle holds will do (a connection that holds none may not make
    /// the server sync its pool).
    pub fn check(&self, opcode: Opcode, bound: Option<&Bound>) -> Result<(), Status> {
        let Some(b) = bound else { return Err(Status::BadCapability) };
        if opcode == Opcode::Flush {
            return Ok(());
        }
        let needs = if opcode.is_mutating() { CapRights::WRITE } else { CapRights::READ };
        if !b.rights.contains(needs) {
            return Err(Status::BadCapability);
        }
        if self.generation(b.chunk) != Some(b.generation) {
            return Err(Status::StaleCapability);
        }
        Ok(())
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
        assert_eq!(bound, Bound { chunk: 3, generation: 0, rights: RW });
        assert_eq!(p.chunk_of(3 << 20, 4096), Some(3));
        assert_eq!(p.chunk_of((4 << 20) - 1, 1), Some(3));
        assert_eq!(p.chunk_of((4 << 20) - 1, 2), None, "straddles two chunks");
        assert_eq!(p.check(Opcode::Write, Some(&bound)), Ok(()));
        assert_eq!(p.check(Opcode::Read, None), Err(Status::BadCapability));
        assert_eq!(p.check(Opcode::Flush, None), Err(Status::BadCapability), "a flush needs some grant");
        assert_eq!(p.check(Opcode::Flush, Some(&bound)), Ok(()));
        let read_only = p.admit(&seal(&key, 3, 1 << 20, 0, CapRights::READ)).unwrap();
        assert_eq!(p.check(Opcode::Read, Some(&read_only)), Ok(()));
        assert_eq!(p.check(Opcode::WriteZeroes, Some(&read_only)), Err(Status::BadCapability));
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
        assert_eq!(p.check(Opcode::Read, Some(&bound)), Err(Status::StaleCapability), "held before");
        assert_eq!(p.admit(&g), Err(CapFault::Evicted), "presented after");
        assert!(CapFault::Evicted.is_stale());
        let next = seal(&key, 1, 1 << 20, 1, RW);
        assert!(p.admit(&next).is_ok(), "the next owner's grant");
        p.set_generation(1, 9);
        assert_eq!(p.generation(1), Some(9));
        assert!(PoolGrants::new([0; KEY_LEN], 3 << 20, 1).is_err());
        assert!(PoolGrants::new([0; KEY_LEN], 4 << 30, 1).is_err());
    }
}
