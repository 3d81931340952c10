//! Sealing and checking capabilities (ODAFS's keyed references; layout in
//! [`wire::capability`]).
//!
//! Each export has a [`CapKey`]: a 32-byte secret that never leaves the target, drawn by the
//! driver from the OS at start-up. A capability's MAC is the first 16 bytes of BLAKE3 in keyed
//! mode over its 40 sealed bytes, so a target checks a capability from the capability alone,
//! without looking anything up, and an initiator cannot make or alter one.
//!
//! Revocation never tracks initiators: rotating the export's key epoch makes every
//! capability sealed before it stale, and the block cache bumps a slot's generation when it
//! evicts or invalidates the slot. Both are recoverable faults ([`CapFault::is_stale`]): the
//! initiator drops the reference and reads the ordinary way. A capability whose MAC is wrong,
//! or that names another export, lacks the read right or does not cover the request, is
//! refused outright and never served. Time is passed in (`now_ms`, the target's clock).

use wire::{Capability, Status};

/// Bytes of an export's secret.
pub const KEY_LEN: usize = 32;

/// An export's capability secret.
#[derive(Clone)]
pub struct CapKey {
    key: [u8; KEY_LEN],
}

impl std::fmt::Debug for CapKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.write_str("CapKey(..)")
    }
}

/// Why a direct read's capability was not honoured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapFault {
    /// The MAC does not match: not sealed by this target with this key, or altered.
    Forged,
    /// Sealed for another export than the handle the request names.
    WrongExport,
    /// The capability does not grant what the request needs.
    NoRight,
    /// The request reaches outside the bytes the capability covers.
    NotCovered,
    /// Past its expiry.
    Expired,
    /// Sealed under an earlier key epoch: revoked by rotation.
    Revoked,
    /// The cache slot it names was evicted or invalidated since (its generation moved on).
    Evicted,
}

impl CapFault {
    /// A stale reference (expired, revoked, evicted) is a recoverable fault; the rest are
    /// refusals of a capability that was never valid for this request.
    pub fn is_stale(self) -> bool {
        matches!(self, CapFault::Expired | CapFault::Revoked | CapFault::Evicted)
    }

    /// The status a completion carries for this fault.
    pub fn status(self) -> Status {
        if self.is_stale() {
            Status::StaleCapability
        } else {
            Status::BadCapability
        }
    }
}

impl CapKey {
    pub fn new(key: [u8; KEY_LEN]) -> CapKey {
        CapKey { key }
    }

    fn mac(&self, cap: &Capability) -> [u8; wire::capability::MAC_LEN] {
        let full = blake3::keyed_hash(&self.key, &cap.sealed_bytes());
        let mut mac = [0u8; wire::capability::MAC_LEN];
        mac.copy_from_slice(&full.as_bytes()[..wire::capability::MAC_LEN]);
        mac
    }

    /// Whether `cap`'s MAC is this key's over its sealed bytes (compared in constant time).
    pub fn authentic(&self, cap: &Capability) -> bool {
        constant_time_eq(&self.mac(cap), &cap.mac)
    }

    /// `cap` with its MAC computed under this key (whatever MAC it carried is replaced).
    pub fn seal(&self, cap: Capability) -> Capability {
        Capability { mac: self.mac(&cap), ..cap }
    }

    /// Whether `cap` may serve a read of `len` bytes from `offset` on export `export`, whose
    /// key epoch is now `epoch`, at `now_ms`. Checks the MAC first (in constant time), so a
    /// forged capability learns nothing from which other check it would have failed.
    /// Generations are the cache's to check, after this.
    pub fn check(
        &self,
        cap: &Capability,
        export: u32,
        epoch: u32,
        now_ms: u64,
        offset: u64,
        len: u32,
    ) -> Result<(), CapFault> {
        self.check_for(wire::CapRights::READ, cap, export, epoch, now_ms, offset, len)
    }

    /// [`check`](Self::check) for a request that needs `needs` (read, or write for a direct
    /// write).
    #[allow(clippy::too_many_arguments)]
    pub fn check_for(
        &self,
        needs: wire::CapRights,
        cap: &Capability,
        export: u32,
        epoch: u32,
        now_ms: u64,
        offset: u64,
        len: u32,
    ) -> Result<(), CapFault> {
        if !self.authentic(cap) {
            return Err(CapFault::Forged);
        }
        if cap.export != export {
            return Err(CapFault::WrongExport);
        }
        if !cap.rights.contains(needs) {
            return Err(CapFault::NoRight);
        }
        if !cap.covers(offset, len) {
            return Err(CapFault::NotCovered);
        }
        if cap.epoch != epoch {
            return Err(CapFault::Revoked);
        }
        if now_ms >= cap.expires_ms {
            return Err(CapFault::Expired);
        }
        Ok(())
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::{CapKind, CapRights};

    fn fields() -> Capability {
        Capability {
            export: 1,
            kind: CapKind::Slot,
            rights: CapRights::READ,
            epoch: 3,
            generation: 8,
            offset: 4096,
            length: 4096,
            slot: 17,
            expires_ms: 10_000,
            mac: [0; 16],
        }
    }

    #[test]
    fn a_sealed_capability_checks_and_every_alteration_is_caught() {
        let key = CapKey::new([9; KEY_LEN]);
        let cap = key.seal(fields());
        assert_eq!(key.check(&cap, 1, 3, 5_000, 4096, 4096), Ok(()));
        assert_eq!(key.check(&cap, 1, 3, 5_000, 4096 + 512, 512), Ok(()));
        // Flip every bit of the wire form: either it no longer parses or it no longer checks.
        let bytes = cap.encode();
        for i in 0..bytes.len() * 8 {
            let mut bad = bytes;
            bad[i / 8] ^= 1 << (i % 8);
            if let Ok(altered) = Capability::decode(&bad) {
                assert_eq!(key.check(&altered, 1, 3, 5_000, 4096, 512), Err(CapFault::Forged), "bit {i}");
            }
        }
        // Another target's key.
        let other = CapKey::new([10; KEY_LEN]);
        assert_eq!(other.check(&cap, 1, 3, 5_000, 4096, 4096), Err(CapFault::Forged));
    }

    #[test]
    fn stale_and_refused_are_told_apart() {
        let key = CapKey::new([1; KEY_LEN]);
        let cap = key.seal(fields());
        assert_eq!(key.check(&cap, 2, 3, 0, 4096, 4096), Err(CapFault::WrongExport));
        assert_eq!(key.check(&cap, 1, 3, 0, 0, 4096), Err(CapFault::NotCovered));
        assert_eq!(key.check(&cap, 1, 3, 0, 8192, 512), Err(CapFault::NotCovered));
        assert_eq!(key.check(&cap, 1, 4, 0, 4096, 4096), Err(CapFault::Revoked));
        assert_eq!(key.check(&cap, 1, 3, 10_000, 4096, 4096), Err(CapFault::Expired));
        let write_only = key.seal(Capability { rights: CapRights::WRITE, ..fields() });
        assert_eq!(key.check(&write_only, 1, 3, 0, 4096, 4096), Err(CapFault::NoRight));
        assert!(CapFault::Revoked.is_stale() && CapFault::Expired.is_stale() && CapFault::Evicted.is_stale());
        assert!(!CapFault::Forged.is_stale() && !CapFault::NotCovered.is_stale());
        assert_eq!(CapFault::Evicted.status(), Status::StaleCapability);
        assert_eq!(CapFault::Forged.status(), Status::BadCapability);
    }

    /// The MAC is BLAKE3 keyed over the 40 sealed bytes, truncated to 16: a fixed vector for
    /// docs/PROTOCOL.md, so that a second implementation can check its sealing.
    #[test]
    fn fixed_vector() {
        let key = CapKey::new(std::array::from_fn(|i| i as u8));
        let cap = key.seal(fields());
        let hex: String = cap.mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "5380372a6bfdd2e7744a9e38ee774787");
        let sealed: String = cap.sealed_bytes().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            sealed,
            "01000000020100000300000008000000001000000000000000100000110000001027000000000000"
        );
    }
}
