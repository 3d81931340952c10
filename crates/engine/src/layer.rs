//! Export options as layers over the export's backend, in the manner of nbdkit's filters and
//! SPDK's stacked bdevs.
//!
//! An [`Export`](crate::Export) is its backend and a stack of [`Layer`]s, one per option:
//! read-only ([`ReadOnly`], `ro`), who may open it ([`Access`], `allow=`), the block its
//! requests are aligned to ([`Block`], `block=`), every change durable before it is
//! acknowledged ([`SyncWrites`], `sync`), and an RStore pool's chunk grants ([`Grants`]). Each layer may narrow the rights a handle gets when the export is opened,
//! refuse changes to the volume, set the block, and judge each request by what its connection
//! holds. Each is tested alone and with the others (`tests.rs`), and a new option (the flash
//! engine's, RStore repair's) is a new layer rather than a new field and a new check in every
//! front end.
//!
//! The stack is folded when a layer is added, so that a request pays for no option it does
//! not use: whether the export is read-only and its block are plain values on the export, and
//! only layers that judge requests ([`Layer::judges_requests`]) are asked per request.
//!
//! Direct reads ([`crate::direct`]) are not a layer: they are a feature of the native
//! protocol (capabilities sealed, filled and revoked by its front end), kept beside the stack.

use std::any::Any;
use std::sync::Arc;

use proto::grant::PoolGrants;
use proto::server::ServerSession;
use wire::{Opcode, Status};

use crate::Io;

/// One export option, layered over the backend.
pub trait Layer: Send + Sync + std::fmt::Debug {
    /// The option as an operator writes it on `--export` (`ro`, `allow=…`, `block=512`) or
    /// what set it (`grants`), for logs and errors.
    fn describe(&self) -> String;

    /// The rights `principal` (a proven key's name, `None` without one) gets: given whether
    /// the layers beneath grant it read-only (`read_only`), the same, narrower, or a refusal.
    fn open(&self, principal: Option<&str>, read_only: bool) -> Result<bool, Status> {
        let _ = principal;
        Ok(read_only)
    }

    /// Whether this layer refuses every change to the volume, whoever asks.
    fn read_only(&self) -> bool {
        false
    }

    /// The block requests must be aligned to, if this layer sets it.
    fn block_bytes(&self) -> Option<u32> {
        None
    }

    /// Whether read data leaves by `sendfile(2)` from the backend's file ([`SendFile`]).
    fn sends_files(&self) -> bool {
        false
    }

    /// Whether every change to the volume must be durable before it is acknowledged, asked
    /// for or not ([`SyncWrites`]).
    fn syncs_writes(&self) -> bool {
        false
    }

    /// Whether [`judge`](Self::judge) may refuse anything: only such layers are asked per
    /// request, and an export with one is served to the native protocol alone (NBD cannot
    /// present what they ask for).
    fn judges_requests(&self) -> bool {
        false
    }

    /// Judge one request that passed the export's own checks ([`crate::validate`]), by what
    /// its connection holds for the handle (`held`).
    fn judge(&self, io: &Io, held: Held<'_>) -> Result<(), Status> {
        let _ = (io, held);
        Ok(())
    }

    /// The layer itself, for a front end that needs more of it than the trait says (the
    /// native protocol's GRANT judges grants against the pool's [`Grants`]).
    fn as_any(&self) -> &dyn Any;
}

/// What a connection holds for one handle, for the layers that judge requests by it.
#[derive(Clone, Copy)]
pub struct Held<'a> {
    pub session: &'a ServerSession,
    pub handle: u32,
}

/// `ro`: no change to the volume, whoever opens it.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadOnly;

impl Layer for ReadOnly {
    fn describe(&self) -> String {
        "ro".into()
    }

    // No `open` of its own: an export with this layer is read-only (`read_only`), which is
    // where every handle's rights start (`Export::grant`).

    fn read_only(&self) -> bool {
        true
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// `allow=NAME:rw+NAME:ro+*:ro`: who may open the export, and with which rights. A key the
/// list does not name is refused (`AccessDenied`), and so is a caller without a key where `*`
/// is not listed (`AuthRequired`); read-write rights never widen what the layers beneath
/// allow.
#[derive(Debug, Clone)]
pub struct Access(pub proto::auth::AccessList);

impl Layer for Access {
    fn describe(&self) -> String {
        format!("allow={}", self.0)
    }

    fn open(&self, principal: Option<&str>, read_only: bool) -> Result<bool, Status> {
        match self.0.rights_of(principal) {
            Some(proto::auth::Rights::ReadWrite) => Ok(read_only),
            Some(proto::auth::Rights::ReadOnly) => Ok(true),
            None if principal.is_none() => Err(Status::AuthRequired),
            None => Err(Status::AccessDenied),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// `send=sendfile`: a file export's read data goes from the file's page cache to the socket
/// with `sendfile(2)`, never through the reply buffer (thesis 5.4's "socket + sendfile"; the
/// front end asks [`crate::file_range`]). Where the transport cannot (TLS, raw Ethernet, a
/// staged target) the data is read and copied as usual.
#[derive(Debug, Clone, Copy)]
pub struct SendFile;

impl Layer for SendFile {
    fn describe(&self) -> String {
        "send=sendfile".into()
    }

    fn sends_files(&self) -> bool {
        true
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// `sync`: every change to the volume is durable before it is acknowledged, as if each write
/// and write-zeroes carried FUA and each trim were followed by a FLUSH (nbdkit's `fua` filter
/// with `fuamode=force`). For a client that cannot ask for durability itself, and for a flash
/// pool whose chunks must outlive a `kill -9` (docs/RSTORE.md). On a backend that syncs on
/// another thread ([`backend::Backend::syncs_later`]) the worker does not wait for it
/// ([`crate::execute_later`]).
#[derive(Debug, Clone, Copy)]
pub struct SyncWrites;

impl Layer for SyncWrites {
    fn describe(&self) -> String {
        "sync".into()
    }

    fn syncs_writes(&self) -> bool {
        true
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// `block=N`: requests aligned to `N` bytes instead of the backend's block, a power of two
/// that divides it (`block=1`: any byte range; RStore's pools).
#[derive(Debug, Clone, Copy)]
pub struct Block(pub u32);

impl Layer for Block {
    fn describe(&self) -> String {
        format!("block={}", self.0)
    }

    fn block_bytes(&self) -> Option<u32> {
        Some(self.0)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// An RStore pool: every request but `FLUSH` needs a grant for its chunk, presented on its
/// connection and bound to the handle (docs/PROTOCOL.md, section 14.6); a `FLUSH` needs some
/// grant. The pool's grants also carry its chunks' generations and repair state, which the
/// memory server's repair agent works on.
#[derive(Debug, Clone)]
pub struct Grants(pub Arc<PoolGrants>);

impl Layer for Grants {
    fn describe(&self) -> String {
        "grants".into()
    }

    fn judges_requests(&self) -> bool {
        true
    }

    fn judge(&self, io: &Io, held: Held<'_>) -> Result<(), Status> {
        let pool = &self.0;
        let bound = if io.opcode == Opcode::Flush {
            held.session.any_bound(held.handle)
        } else {
            pool.chunk_of(io.offset, io.length).and_then(|c| held.session.bound(held.handle, c))
        };
        pool.check(io.opcode, bound, io.offset, io.length)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
