//! Direct reads (ODAFS): capabilities for an export's bytes, handed out on ordinary reads that
//! ask for them, and reads served from the memory a capability names without the backend.
//!
//! An export serves direct reads once its driver gives it a secret ([`DirectReads::new`]; the
//! server draws one from the OS per export at start-up, the simulator from its seed). What a
//! capability names depends on the backend:
//!
//! - a RAM export is its own cache: a **region** capability covers the aligned
//!   [`REGION_BYTES`] window around a read, and stays valid until the key epoch rotates
//!   (writes change the bytes in place, so a direct read always sees the latest data);
//! - a file export with a block cache (`file:PATH,cache=SIZE`): an ordinary read that asks
//!   for capabilities fills the blocks it read into the cache, and each gets a **slot**
//!   capability, valid while the slot keeps its generation (no eviction, no write since);
//! - a flash volume hands out **extent** capabilities: a range of the volume of any size
//!   (the whole volume for a read that asks, any block-aligned range for a `REGISTER`),
//!   sealed with the volume's id as their generation. Issuing one allocates nothing; a direct
//!   read under it goes through the page pool like any read (FlashNet's lazy registration);
//! - anything else hands out nothing, and refuses direct reads.
//!
//! A RAM export also seals extents for a `REGISTER`: its memory is there already.
//!
//! Revocation: [`DirectReads::rotate_epoch`] makes every capability of the export stale;
//! [`DirectReads::invalidate`] (and every write through [`crate::execute`]) drops cached
//! blocks. Neither tracks who holds what.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use backend::cache::{BlockCache, FillTicket, SLOT_BYTES};
use proto::capability::{CapFault, CapKey};
use wire::{CapKind, CapRights, Capability};

/// Bytes a region capability of a RAM export covers: the aligned window around the read.
pub const REGION_BYTES: u64 = 1 << 20;
/// How long a capability is valid after it is sealed, unless configured otherwise.
pub const LIFETIME_MS_DEFAULT: u64 = 10 * 60 * 1000;

/// One export's capability state.
#[derive(Debug)]
pub struct DirectReads {
    key: CapKey,
    epoch: AtomicU32,
    cache: Option<BlockCache>,
    lifetime_ms: u64,
    /// RAM: the export is its own cache and hands out region capabilities.
    in_memory: bool,
    /// A flash volume: its id, which every extent of it carries as its generation, so that a
    /// reference to a deleted volume never serves a later one at the same export index.
    volume: Option<u32>,
    /// Where this volume's key epoch persists across restarts, when it does.
    store: Option<Arc<crate::references::ReferenceStore>>,
    /// The planted bug of the simulator's proof (feature `mutations`): writes leave the cache
    /// alone, so it serves data older than an acknowledged write.
    #[cfg(feature = "mutations")]
    stale_cache: std::sync::atomic::AtomicBool,
}

impl DirectReads {
    /// Direct reads sealed with `secret`; `cache` for a file export (None for RAM, whose own
    /// memory serves them); `in_memory` when the backend serves reads from memory in place.
    pub fn new(
        secret: [u8; proto::capability::KEY_LEN],
        cache: Option<BlockCache>,
        in_memory: bool,
    ) -> DirectReads {
        DirectReads {
            key: CapKey::new(secret),
            epoch: AtomicU32::new(1),
            cache,
            lifetime_ms: LIFETIME_MS_DEFAULT,
            in_memory,
            volume: None,
            store: None,
            #[cfg(feature = "mutations")]
            stale_cache: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Direct reads of flash volume `volume` (its id), sealed with `secret`: extents only.
    pub fn for_volume(secret: [u8; proto::capability::KEY_LEN], volume: u32) -> DirectReads {
        DirectReads { volume: Some(volume), ..DirectReads::new(secret, None, false) }
    }

    /// Keep the volume's key epoch in `store`: start at the epoch saved there, and save every
    /// rotation before it answers (persistent references).
    pub fn with_store(mut self, store: Arc<crate::references::ReferenceStore>) -> DirectReads {
        if let Some(vol) = self.volume {
            self.epoch = AtomicU32::new(store.epoch(vol));
            self.store = Some(store);
        }
        self
    }

    /// Plant the bug that writes do not invalidate the cache (feature `mutations`).
    #[cfg(feature = "mutations")]
    pub fn plant_stale_cache(&self) {
        self.stale_cache.store(true, Ordering::Relaxed);
    }

    /// A write to `len` bytes from `offset` reached the backend: drop what the cache holds of
    /// them, before the write is acknowledged.
    pub fn written(&self, offset: u64, len: u64) {
        #[cfg(feature = "mutations")]
        if self.stale_cache.load(Ordering::Relaxed) {
            return;
        }
        self.invalidate(offset, len);
    }

    /// Capabilities sealed from now on expire `lifetime_ms` after sealing.
    pub fn with_lifetime_ms(mut self, lifetime_ms: u64) -> DirectReads {
        self.lifetime_ms = lifetime_ms.max(1);
        self
    }

    pub fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Revoke every capability of this export: they all become stale. A failure to save the
    /// new epoch (persistent references) is logged: see [`rotate_epoch_durably`](Self::rotate_epoch_durably).
    pub fn rotate_epoch(&self) -> u32 {
        match self.rotate_epoch_durably() {
            Ok(epoch) => epoch,
            Err(e) => {
                tracing::error!(error = %e, "references revoked until the target stops, but the new key epoch could not be saved: after a restart they would be valid again");
                self.epoch()
            }
        }
    }

    /// [`rotate_epoch`](Self::rotate_epoch), and with persistent references save the new epoch
    /// before returning it. On an error the rotation holds in this process regardless.
    pub fn rotate_epoch_durably(&self) -> std::io::Result<u32> {
        let epoch = self.epoch.fetch_add(1, Ordering::AcqRel) + 1;
        if let (Some(store), Some(vol)) = (&self.store, self.volume) {
            store.save_epoch(vol, epoch)?;
        }
        Ok(epoch)
    }

    /// Drop the cached blocks `len` bytes from `offset` touch (their capabilities become stale).
    pub fn invalidate(&self, offset: u64, len: u64) {
        if let Some(c) = &self.cache {
            c.invalidate(offset, len);
        }
    }

    pub fn cache(&self) -> Option<&BlockCache> {
        self.cache.as_ref()
    }

    /// Whether a read of `len` bytes from `offset` can earn capabilities, and the fill ticket
    /// to take before reading it from the backend (cached exports).
    pub fn plan(&self, offset: u64, len: u32) -> Plan {
        if self.volume.is_some() {
            return Plan::Extent;
        }
        if self.in_memory {
            let window = offset / REGION_BYTES;
            let end = offset + u64::from(len);
            return if end.div_ceil(REGION_BYTES) == window + 1 { Plan::Region } else { Plan::None };
        }
        match self.cache.as_ref().and_then(|c| c.fill_ticket(offset, len as usize)) {
            Some(t) => Plan::Fill(t),
            None => Plan::None,
        }
    }

    /// The region capability for a read that [`plan`](Self::plan)ned [`Plan::Region`].
    pub fn seal_region(&self, export: u32, size_bytes: u64, offset: u64, now_ms: u64) -> Capability {
        let start = offset / REGION_BYTES * REGION_BYTES;
        let length = REGION_BYTES.min(size_bytes - start) as u32;
        self.seal(export, CapKind::Region, start, length, 0, 0, now_ms)
    }

    /// The extent capability a read earns on a flash volume ([`Plan::Extent`]): the whole
    /// volume as it is now, with the write right when the reader may write it.
    pub fn seal_volume(&self, export: u32, size_bytes: u64, writable: bool, now_ms: u64) -> Capability {
        let pages = size_bytes.div_ceil(wire::EXTENT_UNIT).min(u64::from(u32::MAX)) as u32;
        let expires = now_ms.saturating_add(self.lifetime_ms);
        let rights = if writable { CapRights::READ.union(CapRights::WRITE) } else { CapRights::READ };
        self.seal_extent(export, 0, pages, rights, expires)
    }

    /// `REGISTER`: an extent capability for `length` bytes from `offset` of an export of
    /// `size_bytes`, with `rights`, valid until revoked (no expiry). Nothing is read, allocated
    /// or pinned: this is the whole cost of registering a range of any size. Refusals:
    /// `Unsupported` on an export that serves no extents (a cached file export's references are
    /// its cache's blocks); `Invalid` for an empty or unaligned range, or rights other than
    /// read, or read and write; `OutOfRange` past the end. Whether the asker may write is the
    /// caller's to judge.
    pub fn register(
        &self,
        export: u32,
        size_bytes: u64,
        rights: CapRights,
        offset: u64,
        length: u64,
    ) -> Result<Capability, wire::Status> {
        use wire::Status;
        if self.volume.is_none() && !self.in_memory {
            return Err(Status::Unsupported);
        }
        if rights != CapRights::READ && rights != CapRights::READ.union(CapRights::WRITE) {
            return Err(Status::Invalid);
        }
        let unit = wire::EXTENT_UNIT;
        if length == 0 || !offset.is_multiple_of(unit) || !length.is_multiple_of(unit) {
            return Err(Status::Invalid);
        }
        match offset.checked_add(length) {
            Some(end) if end <= size_bytes => {}
            _ => return Err(Status::OutOfRange),
        }
        let pages = u32::try_from(length / unit).map_err(|_| Status::OutOfRange)?;
        Ok(self.seal_extent(export, offset, pages, rights, u64::MAX))
    }

    fn seal_extent(
        &self,
        export: u32,
        offset: u64,
        pages: u32,
        rights: CapRights,
        expires_ms: u64,
    ) -> Capability {
        self.key.seal(Capability {
            export,
            kind: CapKind::Extent,
            rights,
            epoch: self.epoch(),
            generation: self.volume.unwrap_or(0),
            offset,
            length: pages,
            slot: 0,
            expires_ms,
            mac: [0; wire::capability::MAC_LEN],
        })
    }

    /// Fill the blocks of a planned read (`data`, read from the backend after `ticket` was
    /// taken) into the cache, calling `each` with a slot capability for every block filled.
    pub fn fill(
        &self,
        export: u32,
        ticket: &FillTicket,
        data: &[u8],
        now_ms: u64,
        mut each: impl FnMut(Capability),
    ) {
        let Some(cache) = &self.cache else { return };
        cache.fill(ticket, data, |f| {
            each(self.seal(export, CapKind::Slot, f.offset, SLOT_BYTES as u32, f.slot, f.generation, now_ms))
        });
    }

    #[allow(clippy::too_many_arguments)]
    fn seal(
        &self,
        export: u32,
        kind: CapKind,
        offset: u64,
        length: u32,
        slot: u32,
        generation: u32,
        now_ms: u64,
    ) -> Capability {
        self.key.seal(Capability {
            export,
            kind,
            rights: CapRights::READ,
            epoch: self.epoch(),
            generation,
            offset,
            length,
            slot,
            expires_ms: now_ms.saturating_add(self.lifetime_ms),
            mac: [0; wire::capability::MAC_LEN],
        })
    }

    /// Judge a direct read of `len` bytes from `offset` on export `export` with `cap`: the MAC,
    /// export, rights, range, epoch and expiry ([`CapKey::check`]). Generations are checked
    /// when the slot is read ([`read_slot`](Self::read_slot)).
    pub fn check(
        &self,
        cap: &Capability,
        export: u32,
        offset: u64,
        len: u32,
        now_ms: u64,
    ) -> Result<(), CapFault> {
        self.check_for(CapRights::READ, cap, export, offset, len, now_ms)
    }

    /// Judge a direct write of `len` bytes from `offset` with `cap`: as [`check`](Self::check),
    /// and the capability must be an extent with the write right.
    pub fn check_write(
        &self,
        cap: &Capability,
        export: u32,
        offset: u64,
        len: u32,
        now_ms: u64,
    ) -> Result<(), CapFault> {
        if cap.kind != CapKind::Extent {
            return Err(CapFault::NoRight);
        }
        self.check_for(CapRights::WRITE, cap, export, offset, len, now_ms)
    }

    fn check_for(
        &self,
        needs: CapRights,
        cap: &Capability,
        export: u32,
        offset: u64,
        len: u32,
        now_ms: u64,
    ) -> Result<(), CapFault> {
        self.key.check_for(needs, cap, export, self.epoch(), now_ms, offset, len)?;
        match cap.kind {
            CapKind::Region if self.in_memory => Ok(()),
            CapKind::Slot if self.cache.is_some() => Ok(()),
            // Another volume once served at this export index: stale, not forged.
            CapKind::Extent if self.volume.is_some() || self.in_memory => {
                if cap.generation == self.volume.unwrap_or(0) {
                    Ok(())
                } else {
                    Err(CapFault::Revoked)
                }
            }
            // Sealed by this key for a kind this export does not serve: cannot happen unless
            // the export changed; refuse rather than guess.
            _ => Err(CapFault::NotCovered),
        }
    }

    /// Copy a checked slot capability's bytes into `dst`; `Err(Evicted)` when the slot's
    /// generation moved on.
    pub fn read_slot(&self, cap: &Capability, offset: u64, dst: &mut [u8]) -> Result<(), CapFault> {
        let cache = self.cache.as_ref().ok_or(CapFault::NotCovered)?;
        if cache.read(cap.slot, cap.generation, offset, dst) {
            Ok(())
        } else {
            Err(CapFault::Evicted)
        }
    }
}

/// What an ordinary read that asks for capabilities can earn.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // lives on the stack for one request; never stored
pub enum Plan {
    None,
    /// A region capability (RAM).
    Region,
    /// Slot capabilities for the blocks filled into the cache.
    Fill(FillTicket),
    /// An extent capability for the whole volume (flash).
    Extent,
}
