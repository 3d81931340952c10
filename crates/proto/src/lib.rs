//! skiff's protocol state machines, free of I/O.
//!
//! Inputs arrive as parsed frames (and, where time matters, a `now` in microseconds passed by
//! the caller); outputs are bytes to send and decisions to act on. Sockets, clocks and threads
//! belong to the drivers (`target`, `initiator`), which keeps every path here testable in memory.
//!
//! - [`server::ServerSession`]: one target connection: handshake, frame admission against the
//!   negotiated limits, the table of opened export handles.
//! - [`client::ClientHandshake`]: the initiator's side of the handshake.
//! - [`client::ClientSession`]: one lane on the initiator: slots, the outbox of caravans, the
//!   doorbell and batch controller, completion matching and its checks, direct placement,
//!   failing everything when the connection dies.
//! - [`slots::SlotTable`]: tags for in-flight requests, with generations that catch stale or
//!   forged completions.
//! - [`batch::BatchController`]: the Tyche adaptive batch level, extended to set the doorbell
//!   delay.
//! - [`caravan::Doorbell`]: deciding when to send the open caravan.
//! - [`auth`]: keys, key files, access lists and the handshake's challenge-response proofs.
//! - [`capability::CapKey`]: sealing and checking the capabilities of direct reads.
//! - [`grant::PoolGrants`]: the chunk grants that authorise I/O to an RStore pool.
//!
//! The datagram stack of raw Ethernet (reliable streams, bundles of paths) is a stack of its own,
//! in `skiff-dgram`.
#![forbid(unsafe_code)]

pub mod auth;
pub mod batch;
pub mod capability;
pub mod caravan;
pub mod client;
#[doc(hidden)]
pub mod fuzz_api;
pub mod grant;
pub mod server;
pub mod slots;

/// A protocol violation by the peer: the connection cannot continue.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error(transparent)]
    Wire(#[from] wire::WireError),
    #[error("{0:?} frame not allowed {1}")]
    Unexpected(wire::FrameKind, &'static str),
    #[error("handshake refused: {0}")]
    Refused(wire::Status),
    #[error("completion for tag {0:#x}, which is not in flight (or not yet sent)")]
    UnknownTag(u32),
    #[error("completion for tag {tag:#x} carries {got} bytes of data, expected {want}")]
    DataLength { tag: u32, got: u32, want: u32 },
    /// A data message (docs/PROTOCOL.md, 16.9) that no request in flight can take: an unknown
    /// or unsent tag, a request that returns no data, bytes outside its buffer, or a
    /// malformed segment.
    #[error("data message for tag {tag:#x} refused: {why}")]
    DataMessage { tag: u32, why: &'static str },
    /// A frame's header announces more than the negotiated limits (or the control body limit)
    /// allow: refused before any of its body is read.
    #[error("{what} is {value}, limit {limit}")]
    OverLimit { what: &'static str, value: u64, limit: u64 },
    /// The peer closed the connection with GOAWAY.
    #[error("peer closed the connection: {status}: {message}")]
    GoAway { status: wire::Status, message: String },
    /// The target did not prove that it holds the key this side authenticated with: it does not
    /// authenticate, or it is not the target it claims to be.
    #[error(
        "the target did not prove that it holds the key (it does not authenticate, or it is an impostor)"
    )]
    TargetNotAuthenticated,
    /// A reconnection negotiated less than the requests waiting to be re-sent need.
    #[error("the target now allows {what} {now}, less than the {before} this session was built on")]
    LimitsShrank { what: &'static str, before: u32, now: u32 },
}

impl ProtoError {
    /// The status a GOAWAY carries for this error (docs/PROTOCOL.md, section 10.2): a bad
    /// header version is `VersionMismatch`, a header over a limit `TooLarge`, anything else
    /// (a malformed body too, even one whose string is over its limit) `Invalid`. The one
    /// mapping from protocol errors to wire statuses.
    pub fn goaway_status(&self) -> wire::Status {
        match self {
            ProtoError::Wire(wire::WireError::BadVersion(_)) => wire::Status::VersionMismatch,
            ProtoError::OverLimit { .. } => wire::Status::TooLarge,
            _ => wire::Status::Invalid,
        }
    }

    /// `value` against `limit`, for a check made from a frame's header.
    pub fn check_limit(what: &'static str, value: u64, limit: u64) -> Result<(), ProtoError> {
        if value > limit {
            return Err(ProtoError::OverLimit { what, value, limit });
        }
        Ok(())
    }
}
