//! skiff's native wire format, version 1: frame and descriptor layouts, `parse` and `emit`,
//! status codes and limits.
//!
//! Every frame starts with a fixed 24-byte [`header::FrameHeader`] protected by its own CRC32C,
//! so a receiver can trust the lengths in it before the rest of the frame arrives. Data frames
//! (caravans) carry fixed-size descriptors followed by payload bytes; control frames (the
//! handshake, export listing, stats, volume management) carry a small hand-encoded body. `docs/PROTOCOL.md`
//! describes every byte.
//!
//! Over raw Ethernet, the same frames ride a byte stream cut into datagrams, each behind a
//! 28-byte [`datagram::DatagramHeader`] with a CRC32C over header and payload.
//!
//! This crate does no I/O, reads no clock and allocates only for control bodies and a
//! connection's receive buffer ([`framing::FrameBuffer`]). Parsing turns
//! untrusted bytes into validated types once, at the boundary; the layers above never look at
//! raw bytes again.
#![forbid(unsafe_code)]

pub mod capability;
pub mod caravan;
pub mod control;
pub mod datagram;
pub mod framing;
#[doc(hidden)]
pub mod fuzz_api;
pub mod header;
pub mod status;
pub mod volume;

pub use capability::{
    CapKind, CapRights, Capability, Grant, GrantReply, Register, RegisterReply, CAPABILITY_LEN, EXTENT_UNIT,
    GRANTS_PER_FRAME_MAX,
};
pub use caravan::{
    Completion, CompletionDesc, Opcode, ReqFlags, Request, RequestDesc, RequestError, COMPLETION_DESC_LEN,
    REQUEST_DESC_LEN,
};
pub use control::{
    Auth, AuthReply, ExportFlags, ExportInfo, GoAway, Hello, HelloAuth, HelloReply, Limits, Open, OpenReply,
    Revoke, RevokeAction, RevokeReply, StatsReply,
};
pub use datagram::{DatagramError, DatagramHeader, DatagramKind, DATAGRAM_HEADER_LEN};
pub use framing::{FrameBuffer, FrameRef};
pub use header::{FrameHeader, FrameKind, Header, HEADER_LEN, MAGIC, VERSION};
pub use status::Status;
pub use volume::{VolumeBody, VolumeEntry, VolumeOp, VolumeReply, VolumeRequest};

/// Why bytes could not be parsed as a frame. Any of these breaks the framing of a stream: the
/// receiver closes the connection, it cannot answer a single request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("frame too short: need {need} bytes, have {have}")]
    Short { need: usize, have: usize },
    #[error("frame body is {have} bytes, its header says {need}")]
    BodyLength { need: usize, have: usize },
    #[error("{got:?} frame handed to the {expected:?} parser")]
    KindMismatch { expected: FrameKind, got: FrameKind },
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    #[error("unsupported version {0}")]
    BadVersion(u8),
    #[error("header checksum mismatch: carried {carried:#010x}, computed {computed:#010x}")]
    BadHeaderCrc { carried: u32, computed: u32 },
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("reserved field {0} is not zero")]
    Reserved(&'static str),
    #[error("{what} is {value}, limit {limit}")]
    Limit { what: &'static str, value: u64, limit: u64 },
    #[error("payload length {declared} does not match the descriptors' sum {sum}")]
    PayloadMismatch { declared: u64, sum: u64 },
    #[error("malformed {0} body")]
    Body(&'static str),
    #[error("descriptor count must be zero for {0:?} frames")]
    DescriptorsInControl(FrameKind),
}

pub type Result<T> = std::result::Result<T, WireError>;
