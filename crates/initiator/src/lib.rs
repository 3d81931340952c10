//! The skiff initiator: connect to a target, open exports, and move data through lanes.
//!
//! - [`Client`] is a control connection: list exports, read target stats, check an export,
//!   manage the target's flash volumes.
//! - [`Lane`] is one data connection owned by one thread (no locks), the driver of a
//!   [`proto::client::ClientSession`] over a socket: `submit_*` queue requests into the open
//!   caravan, the doorbell sends it (when full, on `commit`/`wait`, for a `NO_DELAY` request,
//!   or once its delay bound has passed, a deadline the lane honours in `poll` and shared
//!   lanes honour while they sleep), and `poll`/`wait` return completions, in the order they
//!   arrive. Buffers are moved into the lane with the request and handed back in its
//!   [`Completion`], with read data in them.
//! - `read_at`, `write_at` and `flush` on a lane are a blocking convenience API.
//! - [`SharedLanes`] serve many threads with few requests each (a FUSE mount, a blocking API):
//!   each thread's [`SharedHandle`] feeds one of a few lanes, where the requests of all its
//!   threads travel in common caravans.
//!
//! RStore's segments, striped over lanes to many targets, are the `rstore` crate's.
//!
//! Sockets are non-blocking: while a caravan waits for room in the socket, the lane keeps
//! receiving completions, so two peers can never deadlock on full buffers.

mod bounds;
mod conn;
mod lane;
mod queue;
mod shared;

pub use lane::{
    Batching, Completion, IoBuf, Lane, LaneConfig, LaneStats, LinkStats, Rejected, DIRECT_MIN_BYTES,
};
pub use proto::batch::{BatchConfig, Decision as BatchDecision};
pub use proto::caravan::Doorbell;
pub use proto::client::ReconnectConfig;
pub use queue::Queue;
pub use rt::poll::{PollMode, WaitStats};
pub use shared::{SharedHandle, SharedLanes, HANDLES_MAX, USER_DATA_MAX};
pub use transport::{Endpoint, Kick};
pub use wire::{
    ExportFlags, ExportInfo, Limits, ReqFlags, StatsReply, Status, VolumeBody, VolumeEntry, VolumeOp,
    VolumeReply, VolumeRequest,
};

use std::time::Duration;

use conn::Conn;
pub use conn::TlsConfig;
use wire::FrameKind;

/// Everything that can go wrong on the initiator side.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Protocol(proto::ProtoError),
    /// The target answered, and said no (no such export, no common version, too many open).
    #[error("target refused: {0}")]
    Refused(Status),
    #[error("target closed the connection: {status}: {message}")]
    GoAway { status: Status, message: String },
    #[error("target closed the connection")]
    Closed,
    #[error("no reply within {0:?}")]
    TimedOut(Duration),
    #[error("request failed: {0}")]
    Status(Status),
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    #[error("queue full: {0} requests in flight")]
    QueueFull(usize),
    /// The connection was lost and could not be restored within `ctrl_loss_timeout`.
    #[error("lost the target at {0}: reconnection gave up (ctrl_loss_timeout)")]
    Lost(String),
    /// A volume request was refused; the message is the target's.
    #[error("{message} ({status})")]
    VolumeRefused { status: Status, message: String },
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<proto::ProtoError> for Error {
    /// A refusal or a GOAWAY is the target's answer, not a broken protocol: it keeps its status.
    fn from(e: proto::ProtoError) -> Error {
        match e {
            proto::ProtoError::Refused(status) => Error::Refused(status),
            proto::ProtoError::GoAway { status, message } => Error::GoAway { status, message },
            other => Error::Protocol(other),
        }
    }
}

/// A control connection to a target.
pub struct Client {
    conn: Conn,
}

impl Client {
    /// Connect and complete the handshake. A control connection proposes no limits of its own,
    /// so [`Client::limits`] shows what the target offers.
    pub fn connect(endpoint: &Endpoint) -> Result<Client> {
        Client::connect_with_key(endpoint, None)
    }

    /// [`connect`](Self::connect), proving `key` in the handshake.
    pub fn connect_with_key(endpoint: &Endpoint, key: Option<&proto::auth::Key>) -> Result<Client> {
        Client::connect_with(endpoint, key, None)
    }

    /// [`connect`](Self::connect), proving `key` and over TLS with `tls`, each when given.
    pub fn connect_with(
        endpoint: &Endpoint,
        key: Option<&proto::auth::Key>,
        tls: Option<&TlsConfig>,
    ) -> Result<Client> {
        let no_preference =
            Limits { queue_depth: 0, caravan_reqs_max: 0, caravan_bytes_max: 0, io_bytes_max: 0 };
        Ok(Client { conn: Conn::connect(endpoint, &no_preference, DEFAULT_TIMEOUT, key, tls)? })
    }

    /// The exports the target offers.
    pub fn list(&mut self) -> Result<Vec<ExportInfo>> {
        let (h, body) = self.conn.call(FrameKind::List, &[])?;
        Ok(proto::client::expect(&h, &body, FrameKind::ListReply, ExportInfo::decode_list)?)
    }

    /// The target's counters.
    pub fn stats(&mut self) -> Result<StatsReply> {
        let (h, body) = self.conn.call(FrameKind::Stats, &[])?;
        Ok(proto::client::expect(&h, &body, FrameKind::StatsReply, StatsReply::decode)?)
    }

    /// Revoke capabilities of `export` (docs/DIRECT_READS.md): rotate its key epoch, or, with a
    /// range, invalidate that range of its cache. Needs an export this target lets us write.
    /// Returns the export's key epoch afterwards.
    pub fn revoke(&mut self, export: &str, range: Option<(u64, u64)>) -> Result<u32> {
        let (h, body) = self.conn.call(FrameKind::Open, &wire::Open { name: export.to_owned() }.encode())?;
        let open = proto::client::handle_open_reply(&h, &body)?;
        let (action, offset, length) = match range {
            None => (wire::RevokeAction::RotateEpoch, 0, 0),
            Some((offset, length)) => (wire::RevokeAction::Invalidate, offset, length),
        };
        let revoke = wire::Revoke { handle: open.handle, action, offset, length };
        let (h, body) = self.conn.call(FrameKind::Revoke, &revoke.encode())?;
        let reply = proto::client::expect(&h, &body, FrameKind::RevokeReply, wire::RevokeReply::decode)?;
        if !reply.status.is_ok() {
            return Err(Error::Status(reply.status));
        }
        Ok(reply.epoch)
    }

    /// Register `length` bytes from `offset` of `export` (`REGISTER`, docs/PROTOCOL.md,
    /// section 14.7): a reference to the range, sealed by the target without reading,
    /// allocating or pinning anything. It is valid until the export's references are revoked,
    /// on any connection that opens the export (a [`Lane`] with direct reads holds the ones it
    /// registers itself: [`Lane::register`]).
    pub fn register(&mut self, export: &str, offset: u64, length: u64) -> Result<wire::Capability> {
        let handle = self.open(export)?;
        self.register_on(handle, offset, length)
    }

    /// [`register`](Self::register) on a handle this connection opened already: one round
    /// trip, what a registration costs.
    pub fn register_on(&mut self, handle: u32, offset: u64, length: u64) -> Result<wire::Capability> {
        let register = wire::Register { handle, rights: wire::CapRights::READ, offset, length };
        let (h, body) = self.conn.call(FrameKind::Register, &register.encode())?;
        let reply = proto::client::expect(&h, &body, FrameKind::RegisterReply, wire::RegisterReply::decode)?;
        reply.cap.ok_or(Error::Refused(reply.status))
    }

    /// Open `export` on this control connection; returns its handle.
    pub fn open(&mut self, export: &str) -> Result<u32> {
        let (h, body) = self.conn.call(FrameKind::Open, &wire::Open { name: export.to_owned() }.encode())?;
        Ok(proto::client::handle_open_reply(&h, &body)?.handle)
    }

    /// Send a volume request (docs/PROTOCOL.md, section 17) and return the target's reply,
    /// whatever its status: a refusal carries the target's message.
    pub fn volume(&mut self, request: &VolumeRequest) -> Result<VolumeReply> {
        let (h, body) = self.conn.call(FrameKind::Volume, &request.encode())?;
        let reply = proto::client::expect(&h, &body, FrameKind::VolumeReply, VolumeReply::decode)?;
        if reply.op != request.op {
            return Err(Error::Protocol(proto::ProtoError::Unexpected(
                FrameKind::VolumeReply,
                "for another operation",
            )));
        }
        Ok(reply)
    }

    /// Every volume of the target's flash array, in name order, asking page after page.
    /// `Err(Error::Refused)` with the target's message when it refuses.
    pub fn volumes(&mut self) -> Result<Vec<VolumeEntry>> {
        let mut all: Vec<VolumeEntry> = Vec::new();
        loop {
            let cursor = all.last().map(|v| v.name.clone()).unwrap_or_default();
            let request = VolumeRequest { name: cursor, ..VolumeRequest::bare(VolumeOp::List) };
            let reply = self.volume(&request)?;
            if !reply.status.is_ok() {
                return Err(Error::VolumeRefused { status: reply.status, message: reply.message });
            }
            let VolumeBody::List { volumes, more } = reply.body else { return Ok(all) };
            // A page that brings nothing new cannot move the cursor: stop rather than loop.
            let progressed = !volumes.is_empty();
            all.extend(volumes);
            if !more || !progressed {
                return Ok(all);
            }
        }
    }

    /// The limits negotiated on this connection (what a lane would get by default).
    pub fn limits(&self) -> &Limits {
        &self.conn.limits
    }
}

pub use bounds::DEFAULT_TIMEOUT;
