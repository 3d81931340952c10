//! Capabilities: the target's sealed references to bytes it can serve without the backend
//! (ODAFS's keyed references), and the `CAPABILITIES` frame that carries them to an initiator.
//!
//! A capability is 56 bytes: 40 bytes of fields, then a 16-byte keyed MAC over them that only
//! the target can compute (its key never leaves it; `proto::capability` seals and checks). The
//! initiator treats a capability as opaque except for the fields that say which bytes it
//! covers ([`Capability::covers`]); it sends one back whole as the payload of a `DIRECT_READ`
//! request. Layout, little-endian (docs/PROTOCOL.md, section 8):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | export: the target's export index (not a handle: valid on every connection) |
//! | 4 | 1 | kind: 1 = region (a RAM export's own memory), 2 = cache slot, 3 = chunk grant, 4 = extent |
//! | 5 | 1 | rights: bit 0 read, bit 1 write; other bits zero |
//! | 6 | 2 | reserved, zero |
//! | 8 | 4 | key epoch of the export when sealed |
//! | 12 | 4 | generation of the cache slot (zero for a region; an extent's volume) |
//! | 16 | 8 | offset: first volume byte covered |
//! | 24 | 4 | length: bytes covered (an extent: 4 KiB pages, so it can name a whole volume) |
//! | 28 | 4 | slot: cache slot index (zero for a region) |
//! | 32 | 8 | expiry, in milliseconds of the target's clock (opaque to initiators) |
//! | 40 | 16 | MAC |
//!
//! A `CAPABILITIES` frame (kind 18, target to initiator) has no descriptors; its body is a
//! `u16` count, two reserved zero bytes, then that many capabilities. A `GRANT` frame (kind
//! 14, initiator to target) carries chunk grants ([`CapKind::Chunk`]) the other way:
//! [`Grant`].

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::{Result, WireError};

/// Bytes of one capability on the wire.
pub const CAPABILITY_LEN: usize = 56;
/// Bytes of a capability the MAC covers (everything before the MAC).
pub const SEALED_LEN: usize = 40;
/// Bytes of the MAC.
pub const MAC_LEN: usize = 16;
/// Most capabilities one `CAPABILITIES` frame carries (its body stays under the control
/// body limit).
pub const CAPABILITIES_PER_FRAME_MAX: usize = 1024;

/// A capability exactly as on the wire.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct RawCapability {
    export: U32,
    kind: u8,
    rights: u8,
    reserved: U16,
    epoch: U32,
    generation: U32,
    offset: U64,
    length: U32,
    slot: U32,
    expires_ms: U64,
    mac: [u8; MAC_LEN],
}

const _: () = assert!(std::mem::size_of::<RawCapability>() == CAPABILITY_LEN);

/// What a capability names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CapKind {
    /// A range of an export that is its own cache (RAM): valid until the key epoch changes.
    Region,
    /// One slot of an export's block cache, valid while the slot keeps its generation.
    Slot,
    /// A chunk of an RStore pool (`slot` is its index), granted to whoever holds this by the
    /// control plane, like an RDMA STag: valid while the chunk keeps its generation.
    Chunk,
    /// A range of a volume of any size (FlashNet's lazily registered STag): `length` counts
    /// [`EXTENT_UNIT`]-byte pages, `generation` names the volume. Issuing one allocates nothing:
    /// the target reads the bytes through its page pool when they are asked for.
    Extent,
}

/// Bytes one unit of an extent's `length` stands for.
pub const EXTENT_UNIT: u64 = 4096;

/// The rights a capability grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CapRights(u8);

impl CapRights {
    pub const READ: CapRights = CapRights(0x01);
    pub const WRITE: CapRights = CapRights(0x02);
    /// Chunk grants only: writes under the grant mark the regions they touch dirty on the
    /// server, because another copy of the stripe misses them (docs/PROTOCOL.md, 14.6).
    pub const TRACK: CapRights = CapRights(0x04);
    const KNOWN: u8 = 0x07;

    pub fn bits(self) -> u8 {
        self.0
    }
    pub fn contains(self, other: CapRights) -> bool {
        self.0 & other.0 == other.0
    }
    pub const fn union(self, other: CapRights) -> CapRights {
        CapRights(self.0 | other.0)
    }
    pub fn from_bits(bits: u8) -> Option<CapRights> {
        (bits & !Self::KNOWN == 0).then_some(CapRights(bits))
    }
}

/// A parsed capability. Parsing checks the layout only; whether the MAC is right, and whether
/// the reference is still fresh, is the target's to judge (`proto::capability`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capability {
    pub export: u32,
    pub kind: CapKind,
    pub rights: CapRights,
    pub epoch: u32,
    pub generation: u32,
    pub offset: u64,
    pub length: u32,
    pub slot: u32,
    pub expires_ms: u64,
    pub mac: [u8; MAC_LEN],
}

impl Capability {
    /// The 40 bytes the MAC covers, as they are laid out on the wire.
    pub fn sealed_bytes(&self) -> [u8; SEALED_LEN] {
        let mut out = [0u8; SEALED_LEN];
        out.copy_from_slice(&self.encode()[..SEALED_LEN]);
        out
    }

    /// The whole 56-byte wire form.
    pub fn encode(&self) -> [u8; CAPABILITY_LEN] {
        let raw = RawCapability {
            export: self.export.into(),
            kind: match self.kind {
                CapKind::Region => 1,
                CapKind::Slot => 2,
                CapKind::Chunk => 3,
                CapKind::Extent => 4,
            },
            rights: self.rights.bits(),
            reserved: 0.into(),
            epoch: self.epoch.into(),
            generation: self.generation.into(),
            offset: self.offset.into(),
            length: self.length.into(),
            slot: self.slot.into(),
            expires_ms: self.expires_ms.into(),
            mac: self.mac,
        };
        let mut out = [0u8; CAPABILITY_LEN];
        out.copy_from_slice(raw.as_bytes());
        out
    }

    /// Parse exactly [`CAPABILITY_LEN`] bytes. Fails on a wrong length, an unknown kind or
    /// rights bit, non-zero reserved bytes, or a covered range that overflows.
    pub fn decode(bytes: &[u8]) -> Result<Capability> {
        let raw = RawCapability::read_from_bytes(bytes).map_err(|_| WireError::Body("capability"))?;
        let kind = match raw.kind {
            1 => CapKind::Region,
            2 => CapKind::Slot,
            3 => CapKind::Chunk,
            4 => CapKind::Extent,
            _ => return Err(WireError::Body("capability kind")),
        };
        let rights = CapRights::from_bits(raw.rights).ok_or(WireError::Body("capability rights"))?;
        if raw.reserved.get() != 0 {
            return Err(WireError::Reserved("capability.reserved"));
        }
        let cap = Capability {
            export: raw.export.get(),
            kind,
            rights,
            epoch: raw.epoch.get(),
            generation: raw.generation.get(),
            offset: raw.offset.get(),
            length: raw.length.get(),
            slot: raw.slot.get(),
            expires_ms: raw.expires_ms.get(),
            mac: raw.mac,
        };
        if cap.offset.checked_add(cap.span()).is_none() {
            return Err(WireError::Body("capability range"));
        }
        Ok(cap)
    }

    /// Bytes the capability covers from `offset`: `length`, in pages for an extent.
    pub fn span(&self) -> u64 {
        match self.kind {
            CapKind::Extent => u64::from(self.length) * EXTENT_UNIT,
            _ => u64::from(self.length),
        }
    }

    /// Whether the capability covers `len` bytes from `offset`, wholly.
    pub fn covers(&self, offset: u64, len: u32) -> bool {
        let end = offset.checked_add(u64::from(len));
        offset >= self.offset && end.is_some_and(|end| end <= self.offset.saturating_add(self.span()))
    }

    /// Body of a `CAPABILITIES` frame carrying `caps` (at most
    /// [`CAPABILITIES_PER_FRAME_MAX`]), appended to `out`.
    pub fn encode_list(caps: &[Capability], out: &mut Vec<u8>) {
        debug_assert!(caps.len() <= CAPABILITIES_PER_FRAME_MAX);
        out.extend_from_slice(&(caps.len() as u16).to_le_bytes());
        out.extend_from_slice(&[0, 0]);
        for c in caps {
            out.extend_from_slice(&c.encode());
        }
    }

    /// Length of a `CAPABILITIES` body carrying `count` capabilities.
    pub fn list_len(count: usize) -> usize {
        4 + count * CAPABILITY_LEN
    }

    /// Parse a `CAPABILITIES` frame body, calling `each` for every capability in order.
    pub fn decode_list(body: &[u8], mut each: impl FnMut(Capability)) -> Result<()> {
        let list = counted(body, 4, "CAPABILITIES", "capabilities per frame", CAPABILITIES_PER_FRAME_MAX)?;
        for chunk in list {
            each(Capability::decode(chunk)?);
        }
        Ok(())
    }
}

/// The capabilities of a `frame` body whose first `head` bytes end with a `count` (u16) and two
/// reserved zero bytes, checked in this order: a body shorter than the head, reserved bytes that
/// are not zero, a count above `limit` (`what`), a length that is not the count's.
fn counted<'a>(
    body: &'a [u8],
    head: usize,
    frame: &'static str,
    what: &'static str,
    limit: usize,
) -> Result<std::slice::ChunksExact<'a, u8>> {
    if body.len() < head {
        return Err(WireError::Body(frame));
    }
    let count = u16::from_le_bytes([body[head - 4], body[head - 3]]) as usize;
    if body[head - 2] != 0 || body[head - 1] != 0 {
        return Err(WireError::Reserved(frame));
    }
    if count > limit {
        return Err(WireError::Limit { what, value: count as u64, limit: limit as u64 });
    }
    if body.len() != head + count * CAPABILITY_LEN {
        return Err(WireError::Body(frame));
    }
    Ok(body[head..].chunks_exact(CAPABILITY_LEN))
}

/// Most chunk grants one `GRANT` frame carries (its body stays under the control body limit).
pub const GRANTS_PER_FRAME_MAX: usize = 1024;

/// GRANT (8 + 56 × count bytes, initiator to target): present chunk grants for an export this
/// connection opened, so that its requests to those chunks are served (docs/PROTOCOL.md,
/// section 14.6). Body: `handle` u32, `count` u16, two reserved zero bytes, `count`
/// capabilities.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub handle: u32,
    pub caps: Vec<Capability>,
}

impl Grant {
    pub fn encode(&self) -> Vec<u8> {
        debug_assert!(self.caps.len() <= GRANTS_PER_FRAME_MAX);
        let mut w = Vec::with_capacity(8 + self.caps.len() * CAPABILITY_LEN);
        w.extend_from_slice(&self.handle.to_le_bytes());
        w.extend_from_slice(&(self.caps.len() as u16).to_le_bytes());
        w.extend_from_slice(&[0, 0]);
        for c in &self.caps {
            w.extend_from_slice(&c.encode());
        }
        w
    }

    /// Parse a body: a count above [`GRANTS_PER_FRAME_MAX`], a length that is not the count's,
    /// reserved bytes that are not zero, or any capability that does not parse refuse it whole.
    pub fn decode(body: &[u8]) -> Result<Grant> {
        let list = counted(body, 8, "GRANT", "grants per frame", GRANTS_PER_FRAME_MAX)?;
        let handle = u32::from_le_bytes(body[0..4].try_into().expect("4 bytes"));
        let caps = list.map(Capability::decode).collect::<Result<_>>()?;
        Ok(Grant { handle, caps })
    }
}

/// GRANT_REPLY (8 bytes): `status` u16, two reserved zero bytes, and `refused` u32: the index in
/// the GRANT of the first capability refused (0 when the status is `Ok`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantReply {
    pub status: crate::Status,
    pub refused: u32,
}

impl GrantReply {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(8);
        w.extend_from_slice(&self.status.to_u16().to_le_bytes());
        w.extend_from_slice(&[0, 0]);
        w.extend_from_slice(&self.refused.to_le_bytes());
        w
    }

    pub fn decode(body: &[u8]) -> Result<GrantReply> {
        if body.len() != 8 {
            return Err(WireError::Body("GRANT_REPLY"));
        }
        if body[2] != 0 || body[3] != 0 {
            return Err(WireError::Reserved("GRANT_REPLY"));
        }
        Ok(GrantReply {
            status: crate::Status::from_u16(u16::from_le_bytes([body[0], body[1]])),
            refused: u32::from_le_bytes(body[4..8].try_into().expect("4 bytes")),
        })
    }
}

/// REGISTER (24 bytes, initiator to target): ask for a reference to `length` bytes from
/// `offset` of an export this connection opened, with `rights` (FlashNet's lazy registration:
/// docs/PROTOCOL.md, section 14.7). Body: `handle` u32, `rights` u8, three reserved zero bytes,
/// `offset` u64, `length` u64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Register {
    pub handle: u32,
    pub rights: CapRights,
    pub offset: u64,
    pub length: u64,
}

/// Bytes of a REGISTER body.
pub const REGISTER_LEN: usize = 24;
/// Bytes of a REGISTER_REPLY body.
pub const REGISTER_REPLY_LEN: usize = 4 + CAPABILITY_LEN;

impl Register {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(REGISTER_LEN);
        w.extend_from_slice(&self.handle.to_le_bytes());
        w.extend_from_slice(&[self.rights.bits(), 0, 0, 0]);
        w.extend_from_slice(&self.offset.to_le_bytes());
        w.extend_from_slice(&self.length.to_le_bytes());
        w
    }

    /// Parse a body: a wrong length, an unknown rights bit or non-zero reserved bytes refuse it.
    pub fn decode(body: &[u8]) -> Result<Register> {
        if body.len() != REGISTER_LEN {
            return Err(WireError::Body("REGISTER"));
        }
        if body[5..8] != [0, 0, 0] {
            return Err(WireError::Reserved("REGISTER"));
        }
        let rights = CapRights::from_bits(body[4]).ok_or(WireError::Body("REGISTER rights"))?;
        Ok(Register {
            handle: u32::from_le_bytes(body[0..4].try_into().expect("4 bytes")),
            rights,
            offset: u64::from_le_bytes(body[8..16].try_into().expect("8 bytes")),
            length: u64::from_le_bytes(body[16..24].try_into().expect("8 bytes")),
        })
    }
}

/// REGISTER_REPLY (60 bytes): `status` u16, two reserved zero bytes, and the reference when
/// the status is `Ok` (56 zero bytes otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterReply {
    pub status: crate::Status,
    pub cap: Option<Capability>,
}

impl RegisterReply {
    pub fn refused(status: crate::Status) -> RegisterReply {
        RegisterReply { status, cap: None }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(REGISTER_REPLY_LEN);
        w.extend_from_slice(&self.status.to_u16().to_le_bytes());
        w.extend_from_slice(&[0, 0]);
        match &self.cap {
            Some(c) => w.extend_from_slice(&c.encode()),
            None => w.resize(REGISTER_REPLY_LEN, 0),
        }
        w
    }

    /// Parse a body: an `Ok` must carry a capability, a refusal zeroes.
    pub fn decode(body: &[u8]) -> Result<RegisterReply> {
        if body.len() != REGISTER_REPLY_LEN {
            return Err(WireError::Body("REGISTER_REPLY"));
        }
        if body[2] != 0 || body[3] != 0 {
            return Err(WireError::Reserved("REGISTER_REPLY"));
        }
        let status = crate::Status::from_u16(u16::from_le_bytes([body[0], body[1]]));
        if !status.is_ok() {
            if body[4..].iter().any(|&b| b != 0) {
                return Err(WireError::Body("REGISTER_REPLY: a refusal carries a capability"));
            }
            return Ok(RegisterReply::refused(status));
        }
        Ok(RegisterReply { status, cap: Some(Capability::decode(&body[4..])?) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Capability {
        Capability {
            export: 3,
            kind: CapKind::Slot,
            rights: CapRights::READ,
            epoch: 7,
            generation: 42,
            offset: 0x1_0000,
            length: 4096,
            slot: 99,
            expires_ms: 123_456,
            mac: [0xAB; MAC_LEN],
        }
    }

    #[test]
    fn round_trip_and_fixed_bytes() {
        let cap = sample();
        let bytes = cap.encode();
        assert_eq!(Capability::decode(&bytes).unwrap(), cap);
        assert_eq!(&bytes[0..4], &[3, 0, 0, 0]);
        assert_eq!(bytes[4], 2, "kind slot");
        assert_eq!(bytes[5], 1, "rights read");
        assert_eq!(&bytes[8..12], &[7, 0, 0, 0]);
        assert_eq!(&bytes[12..16], &[42, 0, 0, 0]);
        assert_eq!(&bytes[16..24], &0x1_0000u64.to_le_bytes());
        assert_eq!(&bytes[24..28], &4096u32.to_le_bytes());
        assert_eq!(&bytes[28..32], &99u32.to_le_bytes());
        assert_eq!(&bytes[32..40], &123_456u64.to_le_bytes());
        assert_eq!(&bytes[40..], &[0xAB; 16]);
        assert_eq!(&cap.sealed_bytes()[..], &bytes[..SEALED_LEN]);
    }

    #[test]
    fn bad_layouts_are_refused() {
        let good = sample().encode();
        assert!(Capability::decode(&good[..55]).is_err());
        for (at, value) in [(4, 0u8), (4, 5), (5, 0x08), (6, 1), (7, 1)] {
            let mut bad = good;
            bad[at] = value;
            assert!(Capability::decode(&bad).is_err(), "byte {at} = {value}");
        }
        let mut overflow = sample();
        overflow.offset = u64::MAX - 10;
        assert!(Capability::decode(&overflow.encode()).is_err());
    }

    #[test]
    fn covers_only_whole_ranges() {
        let cap = sample();
        assert!(cap.covers(0x1_0000, 4096));
        assert!(cap.covers(0x1_0200, 512));
        assert!(!cap.covers(0x1_0200, 4096));
        assert!(!cap.covers(0xFE00, 1024));
        assert!(!cap.covers(u64::MAX, 2));
    }

    #[test]
    fn an_extent_counts_pages_and_can_name_sixteen_tebibytes() {
        let extent = Capability { kind: CapKind::Extent, offset: 0, length: u32::MAX, ..sample() };
        let bytes = extent.encode();
        assert_eq!(bytes[4], 4, "kind extent");
        assert_eq!(Capability::decode(&bytes).unwrap(), extent);
        assert_eq!(extent.span(), u64::from(u32::MAX) * 4096);
        assert!(extent.covers(15 << 40, 1 << 20));
        assert!(!extent.covers(extent.span() - 4096, 8192), "past its last page");
        let slot = Capability { length: 3, ..sample() };
        assert_eq!(slot.span(), 3, "other kinds count bytes");
        let mut overflow = Capability { kind: CapKind::Extent, length: 2, ..sample() };
        overflow.offset = u64::MAX - 4096;
        assert!(Capability::decode(&overflow.encode()).is_err());
    }

    #[test]
    fn lists_round_trip_and_check_their_count() {
        let caps = [sample(), Capability { slot: 5, ..sample() }];
        let mut body = Vec::new();
        Capability::encode_list(&caps, &mut body);
        assert_eq!(body.len(), Capability::list_len(2));
        let mut back = Vec::new();
        Capability::decode_list(&body, |c| back.push(c)).unwrap();
        assert_eq!(back, caps);
        let mut short = body.clone();
        short.pop();
        assert!(Capability::decode_list(&short, |_| ()).is_err());
        let mut lying = body.clone();
        lying[0] = 3;
        assert!(Capability::decode_list(&lying, |_| ()).is_err());
        let mut reserved = body;
        reserved[2] = 1;
        assert!(Capability::decode_list(&reserved, |_| ()).is_err());
    }

    #[test]
    fn grants_round_trip_and_refuse_bad_bodies() {
        let chunk = Capability { kind: CapKind::Chunk, rights: CapRights(0x03), ..sample() };
        let g = Grant { handle: 2, caps: vec![chunk, Capability { slot: 6, ..chunk }] };
        let body = g.encode();
        assert_eq!(body.len(), 8 + 2 * CAPABILITY_LEN);
        assert_eq!(&body[..8], &[2, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(body[8 + 4], 3, "kind chunk");
        assert_eq!(Grant::decode(&body).unwrap(), g);
        assert!(Grant::decode(&body[..body.len() - 1]).is_err(), "short");
        let mut lying = body.clone();
        lying[4] = 3;
        assert!(Grant::decode(&lying).is_err(), "count not the length's");
        let mut reserved = body.clone();
        reserved[7] = 1;
        assert!(Grant::decode(&reserved).is_err());
        let mut too_many = body.clone();
        too_many[4..6].copy_from_slice(&(GRANTS_PER_FRAME_MAX as u16 + 1).to_le_bytes());
        assert!(matches!(Grant::decode(&too_many), Err(WireError::Limit { .. })));
        let mut bad_cap = body;
        bad_cap[8 + 4] = 9;
        assert!(Grant::decode(&bad_cap).is_err(), "a capability that does not parse");
        assert_eq!(Grant::decode(&[2, 0, 0, 0, 0, 0, 0, 0]).unwrap().caps.len(), 0);

        let r = GrantReply { status: crate::Status::StaleCapability, refused: 7 };
        assert_eq!(GrantReply::decode(&r.encode()).unwrap(), r);
        assert!(GrantReply::decode(&[0; 7]).is_err());
        assert!(GrantReply::decode(&[0, 0, 1, 0, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn registrations_round_trip_and_refuse_bad_bodies() {
        let r = Register { handle: 3, rights: CapRights::READ, offset: 8192, length: 64 << 30 };
        let body = r.encode();
        assert_eq!(body.len(), REGISTER_LEN);
        assert_eq!(&body[..8], &[3, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(&body[16..24], &(64u64 << 30).to_le_bytes());
        assert_eq!(Register::decode(&body).unwrap(), r);
        assert!(Register::decode(&body[..23]).is_err(), "short");
        let mut reserved = body.clone();
        reserved[6] = 1;
        assert!(Register::decode(&reserved).is_err());
        let mut rights = body;
        rights[4] = 0x10;
        assert!(Register::decode(&rights).is_err(), "an unknown right");

        let extent = Capability { kind: CapKind::Extent, ..sample() };
        let ok = RegisterReply { status: crate::Status::Ok, cap: Some(extent) };
        let body = ok.encode();
        assert_eq!(body.len(), REGISTER_REPLY_LEN);
        assert_eq!(RegisterReply::decode(&body).unwrap(), ok);
        let refused = RegisterReply::refused(crate::Status::Unsupported);
        let body = refused.encode();
        assert_eq!(RegisterReply::decode(&body).unwrap(), refused);
        let mut carrying = body.clone();
        carrying[10] = 1;
        assert!(RegisterReply::decode(&carrying).is_err(), "a refusal with a capability");
        let mut bad_cap = ok.encode();
        bad_cap[4 + 4] = 9;
        assert!(RegisterReply::decode(&bad_cap).is_err(), "Ok with no capability");
        assert!(RegisterReply::decode(&bad_cap[..59]).is_err());
    }
}
