//! The frame header: 24 bytes at the start of every frame, checked by CRC32C before anything
//! else in the frame is believed.

use zerocopy::little_endian::{U16, U32};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::{caravan, Result, WireError};

/// "SKF1" read as a little-endian u32: bytes `53 4B 46 31` on the wire.
pub const MAGIC: u32 = u32::from_le_bytes(*b"SKF1");
/// The only protocol version this implementation speaks.
pub const VERSION: u8 = 1;
/// Size of [`FrameHeader`] in bytes.
pub const HEADER_LEN: usize = 24;

/// The raw header exactly as it sits on the wire (little-endian, no padding).
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct FrameHeader {
    pub magic: U32,
    pub version: u8,
    pub kind: u8,
    pub desc_count: U16,
    pub payload_len: U32,
    pub reserved: [u8; 8],
    /// CRC32C (Castagnoli) of bytes 0..20 of this header.
    pub header_crc: U32,
}

const _: () = assert!(std::mem::size_of::<FrameHeader>() == HEADER_LEN);
const CRC_COVERED_LEN: usize = 20;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    Hello = 1,
    HelloReply = 2,
    Open = 3,
    OpenReply = 4,
    List = 5,
    ListReply = 6,
    Stats = 7,
    StatsReply = 8,
    GoAway = 9,
    /// The initiator's proof of its key (docs/PROTOCOL.md, section 15).
    Auth = 10,
    /// The target's verdict and its own proof.
    AuthReply = 11,
    /// References to data the initiator may read directly (target to initiator, with direct
    /// reads negotiated): see [`crate::capability`].
    Capabilities = 18,
    /// Revoke an export's capabilities (initiator to target; docs/PROTOCOL.md, section 14.5).
    Revoke = 12,
    RevokeReply = 13,
    /// Chunk grants for an export (initiator to target; docs/PROTOCOL.md, section 14.6).
    Grant = 14,
    GrantReply = 15,
    /// A caravan of request descriptors and write payloads (initiator to target).
    Requests = 16,
    /// A caravan of completion descriptors and read payloads (target to initiator).
    Completions = 17,
    /// Create, resize, snapshot, clone, delete, list or measure the target's flash volumes
    /// (initiator to target; docs/PROTOCOL.md, section 17): see [`crate::volume`].
    Volume = 19,
    VolumeReply = 20,
    /// Ask for a reference to a range of an export (initiator to target; docs/PROTOCOL.md,
    /// section 14.7): see [`crate::capability::Register`].
    Register = 21,
    RegisterReply = 22,
}

impl FrameKind {
    pub fn from_u8(v: u8) -> Option<FrameKind> {
        use FrameKind::*;
        Some(match v {
            1 => Hello,
            2 => HelloReply,
            3 => Open,
            4 => OpenReply,
            5 => List,
            6 => ListReply,
            7 => Stats,
            8 => StatsReply,
            9 => GoAway,
            10 => Auth,
            11 => AuthReply,
            18 => Capabilities,
            12 => Revoke,
            13 => RevokeReply,
            14 => Grant,
            15 => GrantReply,
            16 => Requests,
            17 => Completions,
            19 => Volume,
            20 => VolumeReply,
            21 => Register,
            22 => RegisterReply,
            _ => return None,
        })
    }

    /// Size of one descriptor in frames of this kind; zero for control frames, which carry none.
    pub fn desc_len(self) -> usize {
        match self {
            FrameKind::Requests => caravan::REQUEST_DESC_LEN,
            FrameKind::Completions => caravan::COMPLETION_DESC_LEN,
            _ => 0,
        }
    }

    pub fn is_caravan(self) -> bool {
        self.desc_len() != 0
    }
}

/// A header that passed every check: magic, version, checksum, kind, reserved bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: FrameKind,
    pub desc_count: u16,
    pub payload_len: u32,
}

impl Header {
    /// Bytes that follow the header: the descriptors, then the payload (or the control body).
    pub fn body_len(&self) -> usize {
        self.desc_count as usize * self.kind.desc_len() + self.payload_len as usize
    }

    /// Length of the whole frame, header included.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.body_len()
    }

    /// Validate the first [`HEADER_LEN`] bytes of `bytes` as a frame header.
    pub fn parse(bytes: &[u8]) -> Result<Header> {
        let Some(raw) = bytes.get(..HEADER_LEN) else {
            return Err(WireError::Short { need: HEADER_LEN, have: bytes.len() });
        };
        let computed = crc32c::crc32c(&raw[..CRC_COVERED_LEN]);
        let h = FrameHeader::read_from_bytes(raw)
            .map_err(|_| WireError::Short { need: HEADER_LEN, have: bytes.len() })?;
        // Magic first: a stream that is not skiff at all gets the clearest error.
        if h.magic.get() != MAGIC {
            return Err(WireError::BadMagic(h.magic.get()));
        }
        if h.header_crc.get() != computed {
            return Err(WireError::BadHeaderCrc { carried: h.header_crc.get(), computed });
        }
        if h.version != VERSION {
            return Err(WireError::BadVersion(h.version));
        }
        let kind = FrameKind::from_u8(h.kind).ok_or(WireError::UnknownKind(h.kind))?;
        if h.reserved != [0; 8] {
            return Err(WireError::Reserved("header.reserved"));
        }
        if !kind.is_caravan() && h.desc_count.get() != 0 {
            return Err(WireError::DescriptorsInControl(kind));
        }
        Ok(Header { kind, desc_count: h.desc_count.get(), payload_len: h.payload_len.get() })
    }

    /// Write this header, checksum included, into the first [`HEADER_LEN`] bytes of `out`.
    ///
    /// # Panics
    /// If `out` is shorter than [`HEADER_LEN`]: callers size their buffers from it.
    pub fn emit(&self, out: &mut [u8]) {
        let mut h = FrameHeader {
            magic: MAGIC.into(),
            version: VERSION,
            kind: self.kind as u8,
            desc_count: self.desc_count.into(),
            payload_len: self.payload_len.into(),
            reserved: [0; 8],
            header_crc: 0.into(),
        };
        h.header_crc = crc32c::crc32c(&h.as_bytes()[..CRC_COVERED_LEN]).into();
        out[..HEADER_LEN].copy_from_slice(h.as_bytes());
    }

    /// The header as a fresh array, for callers that gather frames with vectored writes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        self.emit(&mut out);
        out
    }
}
