//! Target-side execution: the export table, request validation, and request → backend →
//! status.
//!
//! The engine is shared by every front end ([`front::native`], [`front::nbd`]): a front end
//! parses its own wire format, resolves the export, and calls [`validate`] and [`execute`],
//! which know nothing of sockets or framing. All refusals and backend errors become a
//! [`wire::Status`] here and only here ([`status_of`]); a front end maps statuses to its own
//! error codes. The front ends write their replies into a [`front::Sink`] and never touch a
//! socket: the server's workers drive them over TCP, the simulator over an in-memory pipe.
//!
//! The target reaches its backends only through this crate: [`Export::open`] opens one from
//! its [`BackendSpec`], and [`volumes`] serves the volumes of a flash array as exports that
//! come and go while it runs ([`table`] says how the export table takes them without a lock
//! on the data path). An export's options are [`layer`]s stacked over its backend.
#![forbid(unsafe_code)]

pub mod direct;
pub mod front;
#[doc(hidden)]
pub mod fuzz_api;
pub mod layer;
pub mod references;
pub mod stats;
pub mod table;
pub mod volumes;

use std::sync::Arc;

pub use backend::cache::CacheCounters;
pub use backend::Backend;
pub use backend::{
    parse_size, BackendCounters, BackendError, BackendSpec, Batch, RegionBytes, SpecError, Wake, BLOCK_BYTES,
};
use wire::control::{ExportFlags, ExportInfo};
use wire::{Opcode, ReqFlags, Status};

pub use stats::OpCounters;
pub use table::{ExportTable, Lease};

/// One named volume the target serves.
pub struct Export {
    pub name: String,
    pub backend: Arc<dyn Backend>,
    /// Capabilities and direct reads, when the driver enabled them ([`direct`]).
    pub direct: Option<direct::DirectReads>,
    /// The options over the backend, innermost first ([`layer`]).
    layers: Vec<Arc<dyn layer::Layer>>,
    /// Folded from the layers as each is added, so that requests pay only for the options
    /// that judge them: a layer refuses changes to the volume.
    read_only: bool,
    /// The block requests are aligned to: the backend's own, or a layer's finer one.
    block_bytes: u32,
    /// The layers that judge each request ([`layer::Layer::judges_requests`]).
    judges: Vec<Arc<dyn layer::Layer>>,
    /// The backend's file, when a layer sends read data from it ([`layer::SendFile`]).
    send_fd: Option<std::os::fd::RawFd>,
    /// A layer makes every change durable before it is acknowledged ([`layer::SyncWrites`]).
    syncs_writes: bool,
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("name", &self.name)
            .field("kind", &self.backend.kind())
            .field("size_bytes", &self.backend.size_bytes())
            .field("read_only", &self.read_only)
            .field("layers", &self.layers.iter().map(|l| l.describe()).collect::<Vec<_>>())
            .finish()
    }
}

impl Export {
    /// Open the backend `spec` describes as export `name`.
    pub fn open(name: &str, spec: &BackendSpec, read_only: bool) -> Result<Export, BackendError> {
        Export::open_with(name, spec, read_only, true)
    }

    /// [`open`](Self::open); with `use_direct` false a file export bypasses `O_DIRECT` and
    /// goes through the page cache.
    pub fn open_with(
        name: &str,
        spec: &BackendSpec,
        read_only: bool,
        use_direct: bool,
    ) -> Result<Export, BackendError> {
        Ok(Export::new(name, backend::open_with(spec, read_only, use_direct)?, read_only))
    }

    /// Serve `backend` as export `name`, at the backend's block size, open to anyone and
    /// without direct reads; `read_only` stacks the [`layer::ReadOnly`] layer.
    pub fn new(name: &str, backend: Arc<dyn Backend>, read_only: bool) -> Export {
        let block_bytes = backend.block_size();
        let export = Export {
            name: name.to_owned(),
            backend,
            direct: None,
            layers: Vec::new(),
            read_only: false,
            block_bytes,
            judges: Vec::new(),
            send_fd: None,
            syncs_writes: false,
        };
        if read_only {
            export.with_layer(Arc::new(layer::ReadOnly)).expect("ro stacks on any export")
        } else {
            export
        }
    }

    /// Stack `layer` over the export's options. A layer that sets a block must set a power of
    /// two that divides the backend's block: every backend takes any byte range (RAM and null
    /// copy bytes; a file sends what `O_DIRECT` cannot take through the page cache), so a
    /// finer block only lets requests be smaller. On a RAM export a one-byte write is a single
    /// atomic store ([`rt::mem::Region`]).
    pub fn with_layer(mut self, layer: Arc<dyn layer::Layer>) -> Result<Export, BackendError> {
        if let Some(block_bytes) = layer.block_bytes() {
            let backend_block = self.backend.block_size();
            if !block_bytes.is_power_of_two() || block_bytes > backend_block {
                return Err(BackendError::Io(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("block={block_bytes}: expected a power of two up to the backend's {backend_block}-byte block"),
                )));
            }
            self.block_bytes = block_bytes;
        }
        self.read_only |= layer.read_only();
        self.syncs_writes |= layer.syncs_writes();
        if layer.judges_requests() {
            self.judges.push(layer.clone());
        }
        if layer.sends_files() {
            self.send_fd = self.backend.file_fd();
        }
        self.layers.push(layer);
        Ok(self)
    }

    /// Serve the export at a block of `block_bytes` instead of the backend's (`,block=1` on
    /// an export; RStore's pools): the [`layer::Block`] layer.
    pub fn with_block_bytes(self, block_bytes: u32) -> Result<Export, BackendError> {
        self.with_layer(Arc::new(layer::Block(block_bytes)))
    }

    /// The options over the backend, innermost first.
    pub fn layers(&self) -> &[Arc<dyn layer::Layer>] {
        &self.layers
    }

    /// The layer of type `L`, if the export has one.
    pub fn layer<L: layer::Layer + 'static>(&self) -> Option<&L> {
        self.layers.iter().find_map(|l| l.as_any().downcast_ref::<L>())
    }

    /// An RStore pool's chunk grants ([`layer::Grants`]), if the export is a pool.
    pub fn grants(&self) -> Option<&Arc<proto::grant::PoolGrants>> {
        self.layer::<layer::Grants>().map(|g| &g.0)
    }

    /// Whether a layer judges each request by what its connection holds (a pool's grants):
    /// such an export is served to the native protocol alone.
    pub fn judges_requests(&self) -> bool {
        !self.judges.is_empty()
    }

    /// Ask the layers that judge requests about `io`, which passed [`validate`], on a
    /// connection holding `held`.
    #[inline]
    pub fn judge(&self, io: &Io, held: layer::Held<'_>) -> Result<(), Status> {
        self.judges.iter().try_for_each(|l| l.judge(io, held))
    }

    /// Whether `io` must be durable before it is acknowledged: a change that asks for it
    /// (FUA), or any change on an export that makes every change so ([`layer::SyncWrites`]).
    #[inline]
    pub fn wants_durable(&self, io: &Io) -> bool {
        io.opcode.is_mutating() && (self.syncs_writes || io.flags.contains(ReqFlags::FUA))
    }

    /// The block that request offsets and lengths must be multiples of.
    pub fn block_size(&self) -> u32 {
        self.block_bytes
    }

    /// Serve direct reads on this export, sealing capabilities with `secret` (drawn by the
    /// driver from the OS: it never leaves the target), with a block cache of `cache_bytes`
    /// for a backend that does not hold its data in memory (0: no cache, so such an export
    /// hands out no capabilities).
    pub fn enable_direct_reads(
        &mut self,
        secret: [u8; proto::capability::KEY_LEN],
        cache_bytes: u64,
    ) -> std::io::Result<()> {
        let in_memory = self.backend.read_in_place(0, 0).is_some();
        let cache = if in_memory || cache_bytes == 0 {
            None
        } else {
            Some(backend::cache::BlockCache::new(cache_bytes)?)
        };
        self.direct = Some(direct::DirectReads::new(secret, cache, in_memory));
        Ok(())
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only || self.backend.is_read_only()
    }

    /// Whether `principal` (a proven key name, `None` without one) may open this export, and
    /// if so whether read-only: the export's own rights, narrowed by each layer in turn.
    /// Refusals ([`layer::Access`]): `AuthRequired` without a key where one is needed,
    /// `AccessDenied` for a key the export does not list.
    pub fn grant(&self, principal: Option<&str>) -> Result<bool, Status> {
        self.layers.iter().try_fold(self.is_read_only(), |read_only, l| l.open(principal, read_only))
    }

    /// The flags of a handle granted read-only (`read_only`) or not.
    pub fn flags_granted(&self, read_only: bool) -> ExportFlags {
        let mut f = self.flags();
        if read_only {
            f.0 |= ExportFlags::READ_ONLY;
            f.0 &= !(ExportFlags::CAN_FUA | ExportFlags::CAN_TRIM | ExportFlags::CAN_WRITE_ZEROES);
        }
        f
    }

    pub fn flags(&self) -> ExportFlags {
        let b = &self.backend;
        let writable = !self.is_read_only();
        let mut bits = 0;
        let mut set = |on: bool, bit: u32| {
            if on {
                bits |= bit
            }
        };
        set(!writable, ExportFlags::READ_ONLY);
        set(b.can_flush(), ExportFlags::CAN_FLUSH);
        set(writable && b.can_fua(), ExportFlags::CAN_FUA);
        set(writable && b.can_trim(), ExportFlags::CAN_TRIM);
        set(writable && b.can_write_zeroes(), ExportFlags::CAN_WRITE_ZEROES);
        ExportFlags(bits)
    }

    pub fn info(&self) -> ExportInfo {
        ExportInfo {
            name: self.name.clone(),
            size_bytes: self.backend.size_bytes(),
            block_size: self.block_bytes,
            flags: self.flags(),
        }
    }
}

/// What the engine needs to know about one request, whatever protocol carried it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Io {
    pub opcode: Opcode,
    pub flags: ReqFlags,
    pub offset: u64,
    pub length: u32,
}

impl From<&wire::Request> for Io {
    fn from(r: &wire::Request) -> Io {
        Io { opcode: r.opcode, flags: r.flags, offset: r.offset, length: r.length }
    }
}

/// Check a request against its export and the negotiated largest I/O, in the order a client
/// can act on: malformed, then not permitted, then too large, then misaligned, then out of
/// range, then not supported by the backend.
pub fn validate(export: &Export, io: &Io, io_bytes_max: u32) -> Result<(), Status> {
    validate_sized(export, io, io_bytes_max, export.block_bytes)
}

/// [`validate`] against a block of `block_bytes` instead of the export's (a power of two no
/// larger than it): an NBD client that did not agree to block sizes may use any byte
/// alignment, which every backend takes.
#[inline]
pub fn validate_sized(export: &Export, io: &Io, io_bytes_max: u32, block_bytes: u32) -> Result<(), Status> {
    debug_assert!(block_bytes.is_power_of_two() && block_bytes <= export.block_bytes);
    let b = &export.backend;
    if io.opcode == Opcode::Flush {
        if io.offset != 0 || io.length != 0 {
            return Err(Status::Invalid);
        }
        return if b.can_flush() { Ok(()) } else { Err(Status::Unsupported) };
    }
    if io.length == 0 {
        return Err(Status::Invalid);
    }
    if io.opcode.is_mutating() && export.is_read_only() {
        return Err(Status::ReadOnly);
    }
    let carries_data = matches!(io.opcode, Opcode::Read | Opcode::Write | Opcode::DirectWrite);
    if carries_data && io.length > io_bytes_max {
        return Err(Status::TooLarge);
    }
    let block = u64::from(block_bytes);
    if !io.offset.is_multiple_of(block) || u64::from(io.length) % block != 0 {
        return Err(Status::Misaligned);
    }
    match io.offset.checked_add(u64::from(io.length)) {
        Some(end) if end <= b.size_bytes() => {}
        _ => return Err(Status::OutOfRange),
    }
    let supported = match io.opcode {
        Opcode::Trim => b.can_trim(),
        Opcode::WriteZeroes => b.can_write_zeroes(),
        _ => true,
    };
    if supported {
        Ok(())
    } else {
        Err(Status::Unsupported)
    }
}

/// Execute a validated request. `payload` is the write data (empty otherwise); `read_into` is
/// where read data goes and is exactly `io.length` bytes for a read (empty otherwise). A
/// change the export wants durable ([`Export::wants_durable`]) is durable when this returns.
pub fn execute(export: &Export, io: &Io, payload: &[u8], read_into: &mut [u8]) -> Status {
    execute_as(export, io, export.wants_durable(io), payload, read_into)
}

/// [`execute`], made durable before it returns only if `durable`.
fn execute_as(export: &Export, io: &Io, durable: bool, payload: &[u8], read_into: &mut [u8]) -> Status {
    let b = &export.backend;
    let result = match io.opcode {
        Opcode::Read | Opcode::DirectRead => b.read_at(read_into, io.offset),
        Opcode::Write | Opcode::DirectWrite => b.write_at(payload, io.offset, durable),
        Opcode::Flush => b.flush(),
        // A trim has no FUA of its own: a FLUSH after it makes it durable.
        Opcode::Trim => {
            b.trim(io.offset, io.length.into()).and_then(|()| if durable { b.flush() } else { Ok(()) })
        }
        Opcode::WriteZeroes => b.write_zeroes(io.offset, io.length.into(), durable),
    };
    if io.opcode.is_mutating() {
        // Before the write is acknowledged, and whether or not the backend took all of it:
        // the cache must never serve bytes older than what the volume may now hold.
        if let Some(d) = &export.direct {
            d.written(io.offset, io.length.into());
        }
    }
    result.map_or_else(|e| failed(export, io, &e), |()| Status::Ok)
}

/// A backend error on `io`: logged, and its wire status.
fn failed(export: &Export, io: &Io, e: &BackendError) -> Status {
    tracing::warn!(export = %export.name, op = io.opcode.name(), offset = io.offset, length = io.length, error = %e, "backend error");
    status_of(e)
}

/// [`execute`] a validated request, except that the durability a FLUSH or a change the export
/// wants durable ([`Export::wants_durable`]: FUA, or `sync`) asks for is started on the batch
/// `later` opens rather than waited for, where the backend can ([`Backend::syncs_later`]): the
/// change itself is carried out now, and the status is what it came to. The caller must then
/// hold the request's reply until the batch wakes it, and send it only if the batch did not
/// fail ([`front::Later`]).
pub fn execute_later(export: &Export, io: &Io, payload: &[u8], later: &mut front::Later<'_>) -> Status {
    let wants_sync = io.opcode == Opcode::Flush || export.wants_durable(io);
    if !wants_sync || !export.backend.syncs_later() {
        return execute(export, io, payload, &mut []);
    }
    let Some(batch) = later.batch() else { return execute(export, io, payload, &mut []) };
    let status =
        if io.opcode == Opcode::Flush { Status::Ok } else { execute_as(export, io, false, payload, &mut []) };
    if status.is_ok() {
        export.backend.sync_later(batch);
    }
    status
}

/// Where a validated read's data already lies in memory, for a front end that sends it from
/// there without copying it into its reply buffer first. `None` when the backend holds no such
/// memory: call [`execute`] with a buffer instead. The bytes stay valid while the export does.
pub fn read_in_place(export: &Export, io: &Io) -> Option<Result<RegionBytes, Status>> {
    debug_assert!(io.opcode.returns_data());
    let found = export.backend.read_in_place(io.offset, io.length as usize)?;
    Some(found.map_err(|e| failed(export, io, &e)))
}

/// Where a validated read's data lies in memory now, as pieces kept there until the last
/// is dropped ([`backend::Backend::lend`]), appended to `out`. `Ok(false)`: read it with
/// [`execute`] instead.
pub fn lend(export: &Export, io: &Io, out: &mut Vec<RegionBytes>) -> Result<bool, Status> {
    debug_assert!(io.opcode.returns_data());
    export.backend.lend(io.offset, io.length as usize, out).map_err(|e| failed(export, io, &e))
}

/// Where a validated read's data lies in a file, for a front end that sends it with
/// `sendfile(2)`: the descriptor and the offset, when the export sends so
/// ([`layer::SendFile`]). The descriptor stays valid while the export does.
#[inline]
pub fn file_range(export: &Export, io: &Io) -> Option<(std::os::fd::RawFd, u64)> {
    debug_assert!(io.opcode.returns_data());
    Some((export.send_fd?, io.offset))
}

/// The one mapping from backend errors to wire statuses.
pub fn status_of(err: &BackendError) -> Status {
    match err {
        BackendError::Unsupported => Status::Unsupported,
        BackendError::Io(_) => match err.errno() {
            libc_errno::ENOSPC | libc_errno::EDQUOT => Status::NoSpace,
            libc_errno::EROFS | libc_errno::EPERM => Status::ReadOnly,
            libc_errno::EOPNOTSUPP => Status::Unsupported,
            libc_errno::EINVAL => Status::Invalid,
            _ => Status::IoError,
        },
    }
}

/// Linux errno values the mapping needs; the engine has no libc dependency of its own.
mod libc_errno {
    pub const EPERM: i32 = 1;
    pub const EINVAL: i32 = 22;
    pub const ENOSPC: i32 = 28;
    pub const EROFS: i32 = 30;
    pub const EOPNOTSUPP: i32 = 95;
    pub const EDQUOT: i32 = 122;
}

#[cfg(test)]
mod tests;
