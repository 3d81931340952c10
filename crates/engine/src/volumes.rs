//! Flash volumes as exports: the flash array a target serves, each of its volumes an ordinary
//! export (native protocol and NBD) that also serves direct reads under extent capabilities
//! (FlashNet's references to volume ranges: [`crate::direct`]), and the `VOLUME` requests that create,
//! resize, snapshot, clone, delete, list and measure them while the target runs
//! (docs/PROTOCOL.md, section 17).
//!
//! This module owns what a volume change means for the exports: a new volume (or snapshot, or
//! clone) is added to the [`ExportTable`] once the array has made it durable; a deleted one is
//! retired from the table first, which is refused while connections hold it, and only then
//! deleted from the array. The array's own rules (names, sizes, shrinking below data, children)
//! are the flash crate's, and its refusals reach the initiator as a status and a message
//! ([`VolumeError`]). What the target derives from the table (per-worker counters, the NBD
//! export list) it rebuilds through a [`Publisher`] it passes in.
//!
//! Volume changes are few and slow (each ends with a device sync), so they run one at a time
//! under a mutex, on the worker that received the request: that worker's other connections
//! wait for the sync, the other workers and their data paths do not.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use backend::Backend;
pub use flash;
use flash::device::{Device, FileDevice};
use flash::engine::{Array, Stats, VolumeInfo};
use flash::volume::FlashVolume;
use flash::FlashError;
use wire::{StatsReply, Status, VolumeBody, VolumeEntry, VolumeOp, VolumeReply, VolumeRequest};

use crate::references::ReferenceStore;
use crate::table::{AddError, RetireError};
use crate::{Export, ExportTable};

/// Where a target's flash array lies, and the DRAM its page pool gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlashConfig {
    /// Every device (file or block device) of the array, in any order.
    pub devices: Vec<PathBuf>,
    pub pool_bytes: u64,
    /// Bytes of map leaves and per-page side tables kept in memory (0: no bound;
    /// `flash::ctl::Config::map_budget`).
    pub map_bytes: u64,
    /// Pool misses read asynchronously at once (io_uring, `Array::start_reads`); 0 reads them
    /// on the thread that needs them.
    pub read_depth: u32,
    /// Where the references' secret and the volumes' key epochs persist
    /// ([`crate::references`]); `None`: references die with the target.
    pub references: Option<PathBuf>,
    /// A volume served as an RStore pool (`skiff serve --pool flash:SIZE`), if any.
    pub rstore_pool: Option<PoolVolume>,
}

/// A flash volume donated to RStore (thesis chapter 7): served as a pool, byte-addressed and
/// reached with chunk grants alone, never with extents, and held out of `VOLUME` changes
/// (resize, snapshot, clone, delete) while it is one. Made thin at the first start, so that
/// chunks take flash only where namespaces write them; a namespace given back is zeroed by
/// unmapping its pages.
///
/// Beside it a one-page volume, `NAME.state` ([`state_volume`]), keeps the pool's incarnation
/// (`coord::ServerInfo::incarnation`) and how its last life ended ([`Mark`]). Writes to the
/// pool are acknowledged once in the array's page pool: a target killed before they were
/// written back loses them, so after a stop that was not clean the pool takes a new
/// incarnation and namespaces rebuild their copies on it in full rather than trust them. After
/// a clean stop (everything written back first) it keeps the old one, and namespaces find
/// their chunks' data where they left it. A pool served with `sync` ([`crate::layer::SyncWrites`]:
/// every change durable before it is acknowledged) loses nothing acknowledged in a crash
/// either, so it keeps its incarnation across a `kill -9` too.
#[derive(Clone, PartialEq, Eq)]
pub struct PoolVolume {
    /// The volume's name, which is also the export's.
    pub name: String,
    pub size_bytes: u64,
    /// The key the pool's chunk grants are sealed with.
    pub key: [u8; proto::capability::KEY_LEN],
    pub chunk_bytes: u64,
    /// The incarnation the pool takes when it is new or its last life may have lost
    /// acknowledged writes (drawn by the driver: nonzero, and unlike any earlier one).
    pub fresh_incarnation: u64,
    /// Every change durable before it is acknowledged (`--pool flash:SIZE,sync`).
    pub sync: bool,
}

/// The volume that keeps pool `name`'s incarnation and clean-stop mark.
pub fn state_volume(name: &str) -> String {
    format!("{name}.state")
}

/// How the pool's last life ended, as its state page says: byte 16 of the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    /// Serving writes acknowledged before they were durable: if this is what the next start
    /// finds, the target did not stop cleanly and some may be lost.
    Serving = 0,
    /// Stopped cleanly: everything acknowledged was written back first.
    Stopped = 1,
    /// Serving with every change durable before it was acknowledged (`sync`): however it
    /// ended, nothing acknowledged was lost.
    ServingSync = 2,
}

impl Mark {
    /// Whether a pool whose last life ended so holds every write it acknowledged.
    fn kept_everything(self) -> bool {
        self != Mark::Serving
    }
}

/// The state page: magic, incarnation (u64 LE), [`Mark`] (one byte).
const STATE_MAGIC: &[u8; 8] = b"skfpool1";

fn encode_state(incarnation: u64, mark: Mark) -> Vec<u8> {
    let mut page = vec![0u8; flash::layout::PAGE];
    page[..8].copy_from_slice(STATE_MAGIC);
    page[8..16].copy_from_slice(&incarnation.to_le_bytes());
    page[16] = mark as u8;
    page
}

/// The incarnation and mark a state page holds, if it holds them.
fn decode_state(page: &[u8]) -> Option<(u64, Mark)> {
    if page.len() < 17 || &page[..8] != STATE_MAGIC {
        return None;
    }
    let mark = match page[16] {
        0 => Mark::Serving,
        1 => Mark::Stopped,
        2 => Mark::ServingSync,
        _ => return None,
    };
    let incarnation = u64::from_le_bytes(page[8..16].try_into().ok()?);
    (incarnation != 0).then_some((incarnation, mark))
}

impl std::fmt::Debug for PoolVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolVolume")
            .field("name", &self.name)
            .field("size_bytes", &self.size_bytes)
            .field("chunk_bytes", &self.chunk_bytes)
            .field("fresh_incarnation", &self.fresh_incarnation)
            .field("sync", &self.sync)
            .finish_non_exhaustive()
    }
}

/// Pool misses read asynchronously at once when nothing else is asked.
pub const READ_DEPTH_DEFAULT: u32 = 128;

/// The map's memory when none is asked for: no paging below about 500 GiB of volumes written.
pub const MAP_BYTES_DEFAULT: u64 = 1 << 30;

/// The page pool when none is asked for.
pub const POOL_BYTES_DEFAULT: u64 = 256 << 20;
/// The smallest page pool: room for a few write groups of dirty pages besides the pages
/// being read.
pub const POOL_BYTES_MIN: u64 = 4 << 20;

/// What a target does when its export table changes.
pub trait Publisher {
    /// Export `index` is about to be added: make room for it (the workers' counter rows).
    fn publishing(&self, index: u32);
    /// The table changed (an export added, retired or resized): rebuild what is derived from
    /// it (the NBD export list).
    fn changed(&self, table: &ExportTable);
}

/// Why a volume request was refused. [`status`](Self::status) is the one mapping to wire
/// statuses; the message is what the initiator shows.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("{}", flash_message(.name, .source))]
    Flash { name: String, source: FlashError },
    #[error("{0:?} is an export given at start-up (--export), not a flash volume")]
    NotAVolume(String),
    #[error("an export named {0:?} was given at start-up (--export): the name is taken")]
    ExportName(String),
    #[error("volume {name:?} is open on {connections} connection(s): close them first")]
    InUse { name: String, connections: u32 },
    #[error("{0}")]
    Table(AddError),
    #[error("the target serves {0} exports, the most it lists (NBD's bound): delete some first")]
    TooManyExports(usize),
    #[error("volume {0:?} is the RStore pool this target serves (--pool flash:SIZE): it is not resized, copied or deleted while it is one")]
    Pool(String),
}

/// The export of the pool volume: RStore addresses bytes (reads and writes at any offset and
/// length, one-byte flags), and every request is judged by the chunk grant its connection
/// holds. No extents: they would reach past the chunks granted.
fn pool_export(pool: &PoolVolume, volume: FlashVolume, read_only: bool) -> Result<Export, FlashError> {
    let chunks = volume.size_bytes() / pool.chunk_bytes.max(1);
    let grants = proto::grant::PoolGrants::new(pool.key, pool.chunk_bytes, chunks)
        .map_err(|e| FlashError::BadSize(format!("RStore pool {:?}: {e}", pool.name)))?;
    let layer = |e: backend::BackendError| FlashError::BadSize(format!("RStore pool {:?}: {e}", pool.name));
    let export = Export::new(&pool.name, Arc::new(volume), read_only)
        .with_block_bytes(1)
        .and_then(|e| e.with_layer(Arc::new(crate::layer::Grants(Arc::new(grants)))))
        .map_err(layer)?;
    if pool.sync {
        export.with_layer(Arc::new(crate::layer::SyncWrites)).map_err(layer)
    } else {
        Ok(export)
    }
}

fn flash_message(name: &str, e: &FlashError) -> String {
    match e {
        FlashError::NoSuchVolume => format!("no volume named {name:?}"),
        // These name the volume themselves.
        FlashError::NameTaken(_) | FlashError::BadName(_) | FlashError::HasChildren { .. } => e.to_string(),
        _ => format!("volume {name:?}: {e}"),
    }
}

impl VolumeError {
    fn flash(name: &str) -> impl FnOnce(FlashError) -> VolumeError + '_ {
        move |source| VolumeError::Flash { name: name.to_owned(), source }
    }

    pub fn status(&self) -> Status {
        match self {
            VolumeError::Flash { source, .. } => match source {
                FlashError::NoSuchVolume => Status::NotFound,
                FlashError::NameTaken(_) => Status::Exists,
                FlashError::BadName(_) | FlashError::BadSize(_) | FlashError::OutOfRange => Status::Invalid,
                FlashError::ReadOnly => Status::ReadOnly,
                FlashError::NoSpace => Status::NoSpace,
                FlashError::HasChildren { .. } | FlashError::Busy(_) => Status::Busy,
                FlashError::Corrupt(_) | FlashError::Failed | FlashError::Device(_) => Status::IoError,
            },
            VolumeError::NotAVolume(_) | VolumeError::Pool(_) => Status::Invalid,
            VolumeError::ExportName(_) => Status::Exists,
            VolumeError::InUse { .. } => Status::Busy,
            VolumeError::Table(AddError::NameTaken(_)) => Status::Exists,
            VolumeError::Table(AddError::Full(_)) | VolumeError::TooManyExports(_) => Status::NoSpace,
        }
    }
}

/// A flash array served as exports.
pub struct FlashVolumes {
    array: Arc<Array>,
    /// One volume change at a time (see the module docs).
    changing: Mutex<()>,
    /// Serve every volume read-only (the target's `--read-only`).
    read_only: bool,
    /// Most exports the table may hold at once, volumes and the rest.
    exports_max: usize,
    /// The secret every volume's extent capabilities are sealed with (drawn by the driver;
    /// never leaves the target). A volume's id is in each of its extents, so one secret serves
    /// them all without a reference to one volume serving another.
    secret: [u8; proto::capability::KEY_LEN],
    /// Where the secret and the epochs persist, when they do.
    store: Option<Arc<ReferenceStore>>,
    /// The volume served as an RStore pool, if one is, and the incarnation it serves in.
    pool: Option<(PoolVolume, u64)>,
}

impl std::fmt::Debug for FlashVolumes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlashVolumes").field("read_only", &self.read_only).finish_non_exhaustive()
    }
}

impl FlashVolumes {
    /// Open the array on `config`'s devices, recover it, and start its background work.
    /// Errors name the device at fault: missing, of another array, holding no array.
    /// `secret` seals the volumes' references unless `config.references` names a file that
    /// holds one already (a new file keeps `secret`).
    pub fn open(
        config: &FlashConfig,
        read_only: bool,
        secret: [u8; proto::capability::KEY_LEN],
    ) -> Result<FlashVolumes, FlashError> {
        let store = match &config.references {
            Some(path) => Some(Arc::new(ReferenceStore::open(path, || Ok(secret))?)),
            None => None,
        };
        if config.pool_bytes < POOL_BYTES_MIN {
            return Err(FlashError::BadSize(format!(
                "a page pool of {} bytes is too small: at least {POOL_BYTES_MIN}",
                config.pool_bytes
            )));
        }
        let pool_pages = u32::try_from(config.pool_bytes / flash::layout::PAGE as u64)
            .map_err(|_| FlashError::BadSize("a page pool holds at most 2^32 pages (16 TiB)".into()))?;
        let mut devices: Vec<Box<dyn Device>> = Vec::with_capacity(config.devices.len());
        for path in &config.devices {
            let device = FileDevice::open(path).map_err(|e| FlashError::Device(with_path(path, e)))?;
            devices.push(Box::new(device));
        }
        let cfg = flash::ctl::Config { pool_pages, map_budget: config.map_bytes, ..Default::default() };
        let array = Array::open(devices, cfg)?;
        array.start_background();
        if config.read_depth > 0 {
            array.start_reads(config.read_depth)?;
        }
        let secret = store.as_ref().map_or(secret, |s| s.secret());
        let volumes = FlashVolumes { store, ..FlashVolumes::new(array, read_only, secret) };
        match &config.rstore_pool {
            Some(pool) => volumes.with_pool(pool.clone()),
            None => Ok(volumes),
        }
    }

    /// Serve `pool.name` as an RStore pool: made (thin) if the array has no such volume, grown
    /// if it is smaller than `pool.size_bytes`; refused if it is larger (its chunks past the
    /// size asked would be lost to the namespaces that hold them), a snapshot, or a clone, or
    /// if the target is read-only. Its state volume says which incarnation it serves in
    /// ([`PoolVolume`]); it is marked "serving" (durably), or "serving sync" for a `sync` pool,
    /// before anything is served.
    pub fn with_pool(mut self, pool: PoolVolume) -> Result<FlashVolumes, FlashError> {
        if self.read_only {
            return Err(FlashError::ReadOnly);
        }
        let existed = match self.array.list().into_iter().find(|v| v.name == pool.name) {
            None => {
                self.array.create(&pool.name, pool.size_bytes)?;
                tracing::info!(volume = %pool.name, size_bytes = pool.size_bytes, "made the RStore pool's volume (thin)");
                false
            }
            Some(v) if !v.writable || v.origin.is_some() => {
                return Err(FlashError::BadSize(format!(
                    "volume {:?} is a snapshot or a clone: it cannot serve as an RStore pool",
                    pool.name
                )))
            }
            Some(v) if v.size_bytes > pool.size_bytes.next_multiple_of(flash::layout::PAGE as u64) => {
                return Err(FlashError::BadSize(format!(
                    "volume {:?} holds an RStore pool of {} bytes: a pool of {} would drop the chunks past it; give at least its size",
                    pool.name, v.size_bytes, pool.size_bytes
                )))
            }
            Some(v) => {
                if v.size_bytes < pool.size_bytes {
                    self.array.resize(&pool.name, pool.size_bytes)?;
                }
                true
            }
        };
        let state = state_volume(&pool.name);
        let vol = match self.array.id_of(&state) {
            Ok(vol) => vol,
            Err(FlashError::NoSuchVolume) => self.array.create(&state, flash::layout::PAGE as u64)?,
            Err(e) => return Err(e),
        };
        let mut page = vec![0u8; flash::layout::PAGE];
        self.array.read(vol, 0, &mut page)?;
        let incarnation = match decode_state(&page) {
            Some((incarnation, mark)) if existed && mark.kept_everything() => incarnation,
            Some(_) if existed => {
                tracing::warn!(volume = %pool.name, "the RStore pool's last stop was not clean: writes acknowledged before it may be lost, so it serves as a new pool and namespaces rebuild their copies here in full");
                pool.fresh_incarnation
            }
            _ => pool.fresh_incarnation,
        };
        let mark = if pool.sync { Mark::ServingSync } else { Mark::Serving };
        self.array.write(vol, 0, &encode_state(incarnation, mark), true)?;
        self.pool = Some((pool, incarnation));
        Ok(self)
    }

    /// Which life of the pool volume's data this is (`coord::ServerInfo::incarnation`).
    pub fn pool_incarnation(&self) -> Option<u64> {
        self.pool.as_ref().map(|(_, incarnation)| *incarnation)
    }

    /// Whether `name` is the pool's volume or its state volume.
    fn is_pool(&self, name: &str) -> bool {
        self.pool.as_ref().is_some_and(|(p, _)| p.name == name || state_volume(&p.name) == name)
    }

    /// Serve the volumes of `array`, open already (an in-memory array, for tests and the
    /// simulator), sealing their extent capabilities with `secret`.
    pub fn new(array: Arc<Array>, read_only: bool, secret: [u8; proto::capability::KEY_LEN]) -> FlashVolumes {
        FlashVolumes {
            array,
            changing: Mutex::new(()),
            read_only,
            exports_max: nbd::EXPORTS_MAX,
            secret,
            store: None,
            pool: None,
        }
    }

    pub fn array(&self) -> &Arc<Array> {
        &self.array
    }

    /// The array's figures (metrics).
    pub fn stats(&self) -> Stats {
        self.array.stats()
    }

    /// One export per volume, in name order: what a target serves when it starts.
    pub fn exports(&self) -> Result<Vec<Export>, FlashError> {
        let state = self.pool.as_ref().map(|(p, _)| state_volume(&p.name));
        let volumes = self.array.list().into_iter().filter(|v| Some(&v.name) != state.as_ref());
        volumes.map(|v| self.export_of(&v.name)).collect()
    }

    fn export_of(&self, name: &str) -> Result<Export, FlashError> {
        let volume = FlashVolume::open(self.array.clone(), name)?;
        if let Some((pool, _)) = self.pool.as_ref().filter(|(p, _)| p.name == name) {
            return pool_export(pool, volume, self.read_only);
        }
        let id = volume.id();
        // A snapshot's backend says it is read-only; `read_only` makes every volume so.
        let mut export = Export::new(name, Arc::new(volume), self.read_only);
        let direct = crate::direct::DirectReads::for_volume(self.secret, id);
        export.direct = Some(match &self.store {
            Some(store) => direct.with_store(store.clone()),
            None => direct,
        });
        Ok(export)
    }

    /// Write back everything and checkpoint, so that the next start has nothing to replay.
    /// Called once no worker runs any more.
    pub fn shutdown(&self) -> Result<(), FlashError> {
        if let Some((pool, incarnation)) = &self.pool {
            // Everything acknowledged on flash first; only then is the pool marked clean.
            self.array.flush()?;
            let vol = self.array.id_of(&state_volume(&pool.name))?;
            self.array.write(vol, 0, &encode_state(*incarnation, Mark::Stopped), true)?;
        }
        self.array.shutdown()
    }

    /// Execute `request` on the array and the table; the reply says how it went. Changes are
    /// durable before this returns.
    pub fn execute(
        &self,
        request: &VolumeRequest,
        table: &ExportTable,
        publisher: &dyn Publisher,
    ) -> VolumeReply {
        let _one = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        let (op, name) = (request.op, request.name.as_str());
        let result = match op {
            VolumeOp::Create => self.create(name, request.size_bytes, table, publisher),
            VolumeOp::Resize => self.resize(name, request.size_bytes, table, publisher),
            VolumeOp::Snapshot | VolumeOp::Clone => {
                self.copy(&request.origin, name, op == VolumeOp::Clone, table, publisher)
            }
            VolumeOp::Delete => self.delete(name, table, publisher),
            VolumeOp::List => return self.list(name),
            VolumeOp::Stats => return self.stats_reply(),
        };
        match result {
            Ok(message) => {
                tracing::info!(op = op.name(), volume = name, origin = %request.origin, size_bytes = request.size_bytes, "{message}");
                VolumeReply::done(op, message)
            }
            Err(e) => {
                tracing::info!(op = op.name(), volume = name, error = %e, "volume request refused");
                VolumeReply::refused(op, e.status(), e.to_string())
            }
        }
    }

    /// Whether a new volume `name` could be exported: no export of that name, and room.
    fn check_new(&self, name: &str, table: &ExportTable) -> Result<(), VolumeError> {
        if let Some((index, _)) = table.find(name) {
            return Err(match table.is_fixed(index) {
                true => VolumeError::ExportName(name.to_owned()),
                false => VolumeError::Flash {
                    name: name.to_owned(),
                    source: FlashError::NameTaken(name.to_owned()),
                },
            });
        }
        if table.room() == 0 {
            return Err(VolumeError::Table(AddError::Full(table.capacity() - table.fixed_len())));
        }
        if table.len() >= self.exports_max {
            return Err(VolumeError::TooManyExports(self.exports_max));
        }
        Ok(())
    }

    /// Export volume `name`, which the array has just made.
    fn publish(&self, name: &str, table: &ExportTable, publisher: &dyn Publisher) -> Result<(), VolumeError> {
        let export = self.export_of(name).map_err(VolumeError::flash(name))?;
        // Checked before the array changed, under the same lock: only a bug fails here.
        table.add(export, |index| publisher.publishing(index)).map_err(VolumeError::Table)?;
        publisher.changed(table);
        Ok(())
    }

    fn create(
        &self,
        name: &str,
        size_bytes: u64,
        table: &ExportTable,
        publisher: &dyn Publisher,
    ) -> Result<String, VolumeError> {
        self.check_new(name, table)?;
        self.array.create(name, size_bytes).map_err(VolumeError::flash(name))?;
        self.publish(name, table, publisher)?;
        Ok(format!("created volume {name:?} of {}", bytes_text(self.size_of(name))))
    }

    fn resize(
        &self,
        name: &str,
        size_bytes: u64,
        table: &ExportTable,
        publisher: &dyn Publisher,
    ) -> Result<String, VolumeError> {
        let index = self.volume_index(name, table)?;
        let before = self.size_of(name);
        self.array.resize(name, size_bytes).map_err(VolumeError::flash(name))?;
        if self.size_of(name) < before {
            // References past the new end must not reach pages a later growth brings back:
            // a shrink revokes the volume's references (reads past the end are refused
            // meanwhile, since a direct read checks the range against the volume's size).
            if let Some(d) = table.get(index).and_then(|e| e.direct.as_ref()) {
                if let Err(e) = d.rotate_epoch_durably() {
                    tracing::error!(volume = name, error = %e, "shrunk, and its references revoked until the target stops, but the new key epoch could not be saved: after a restart they would be valid again");
                }
            }
        }
        publisher.changed(table);
        Ok(format!("resized volume {name:?} to {}", bytes_text(self.size_of(name))))
    }

    fn copy(
        &self,
        origin: &str,
        name: &str,
        writable: bool,
        table: &ExportTable,
        publisher: &dyn Publisher,
    ) -> Result<String, VolumeError> {
        self.volume_index(origin, table)?;
        self.check_new(name, table)?;
        self.array.snapshot(origin, name, writable).map_err(|source| match source {
            // The new name's problems name it; the rest are the origin's.
            FlashError::NameTaken(_) | FlashError::BadName(_) => {
                VolumeError::Flash { name: name.to_owned(), source }
            }
            source => VolumeError::Flash { name: origin.to_owned(), source },
        })?;
        self.publish(name, table, publisher)?;
        let what = if writable { "writable clone" } else { "read-only snapshot" };
        Ok(format!("created {what} {name:?} of {origin:?}"))
    }

    fn delete(
        &self,
        name: &str,
        table: &ExportTable,
        publisher: &dyn Publisher,
    ) -> Result<String, VolumeError> {
        let index = self.volume_index(name, table)?;
        // Children first, so that a volume they pin is refused without being touched.
        if let Some(v) = self.array.list().into_iter().find(|v| v.name == name) {
            if !v.snapshots.is_empty() {
                let source =
                    FlashError::HasChildren { name: name.to_owned(), children: v.snapshots.join(", ") };
                return Err(VolumeError::Flash { name: name.to_owned(), source });
            }
        }
        let going = table.retire(index).map_err(|e| match e {
            RetireError::InUse(connections) => VolumeError::InUse { name: name.to_owned(), connections },
            RetireError::Fixed(_) => VolumeError::NotAVolume(name.to_owned()),
            RetireError::NotFound => {
                VolumeError::Flash { name: name.to_owned(), source: FlashError::NoSuchVolume }
            }
        })?;
        // On failure the guard drops and the export is live again, as it was.
        self.array.delete(name, false).map_err(VolumeError::flash(name))?;
        going.finish();
        publisher.changed(table);
        Ok(format!("deleted volume {name:?}"))
    }

    /// The table index of volume `name`; refused for a name that is not a volume's.
    fn volume_index(&self, name: &str, table: &ExportTable) -> Result<u32, VolumeError> {
        if self.is_pool(name) {
            return Err(VolumeError::Pool(name.to_owned()));
        }
        match table.find(name) {
            Some((index, _)) if table.is_fixed(index) => Err(VolumeError::NotAVolume(name.to_owned())),
            Some((index, _)) => Ok(index),
            None => Err(VolumeError::Flash { name: name.to_owned(), source: FlashError::NoSuchVolume }),
        }
    }

    fn size_of(&self, name: &str) -> u64 {
        self.array.list().iter().find(|v| v.name == name).map_or(0, |v| v.size_bytes)
    }

    /// The volumes after `after` in name order, as many as one reply holds (the encoder cuts
    /// the rest and says more follow).
    fn list(&self, after: &str) -> VolumeReply {
        let all = self.array.list();
        let volumes: Vec<VolumeEntry> =
            all.iter().filter(|v| after.is_empty() || v.name.as_str() > after).map(entry).collect();
        VolumeReply {
            status: Status::Ok,
            op: VolumeOp::List,
            message: format!("{} volumes", all.len()),
            body: VolumeBody::List { volumes, more: false },
        }
    }

    fn stats_reply(&self) -> VolumeReply {
        let s = self.array.stats();
        VolumeReply {
            status: Status::Ok,
            op: VolumeOp::Stats,
            message: String::new(),
            body: VolumeBody::Stats(StatsReply { entries: counters(&s, self.array.list().len()) }),
        }
    }
}

fn entry(v: &VolumeInfo) -> VolumeEntry {
    VolumeEntry {
        name: v.name.clone(),
        size_bytes: v.size_bytes,
        allocated_bytes: v.allocated_bytes,
        writable: v.writable,
        origin: v.origin.clone().unwrap_or_default(),
        children: v.snapshots.len() as u32,
    }
}

/// Bytes that could still be written once cleaning has made room: the capacity less what
/// valid data holds.
pub fn free_bytes(s: &Stats) -> u64 {
    s.capacity_bytes.saturating_sub(s.valid_bytes)
}

/// The array's figures as named counters (docs/PROTOCOL.md, section 17.2): the write
/// amplification, a ratio, in millionths.
fn counters(s: &Stats, volumes: usize) -> Vec<(String, u64)> {
    let c = &s.counters;
    [
        ("volumes", volumes as u64),
        ("capacity_bytes", s.capacity_bytes),
        ("valid_bytes", s.valid_bytes),
        ("free_bytes", free_bytes(s)),
        ("free_segments", u64::from(s.free_segments)),
        ("total_segments", u64::from(s.total_segments)),
        ("write_amplification_e6", (s.write_amplification * 1e6).round() as u64),
        ("user_pages_written", c.user_pages_written),
        ("device_pages_written", c.device_pages_written),
        ("device_pages_read", c.device_pages_read),
        ("groups_written", c.groups_written),
        ("gc_segments_cleaned", c.gc_segments_cleaned),
        ("gc_pages_moved", c.gc_pages_moved),
        ("wear_segments_moved", c.wear_segments_moved),
        ("checkpoints", c.checkpoints),
        ("pool_pages", u64::from(s.pool_pages)),
        ("pool_clean_pages", u64::from(s.pool_clean)),
        ("pool_dirty_pages", u64::from(s.pool_dirty)),
        ("pool_lent_pages", u64::from(s.pool_lends)),
        ("pool_hits", c.pool_hits),
        ("pool_misses", c.pool_misses),
        ("pool_evictions", c.evictions),
        ("pages_read_async", s.pages_read_async),
        ("device_reads_async", s.device_reads_async),
        ("pages_joined", s.pages_joined),
        ("pages_lent", s.pages_lent),
        ("syncs_later", s.syncs_later),
        ("sync_rounds_later", s.sync_rounds_later),
        ("pool_full_writes", s.pool_full_writes),
        ("rooms_later", s.rooms_later),
        ("erase_count_min", u64::from(s.erase_min)),
        ("erase_count_max", u64::from(s.erase_max)),
        ("map_bytes", s.map_bytes),
        ("map_leaves", s.map_leaves),
        ("map_leaves_resident", s.map_leaves_resident),
        ("map_loads", s.map_loads),
        ("map_loads_async", s.map_loads_async),
        ("map_evictions", s.map_evictions),
        ("recovered_groups_replayed", s.recovered.groups_replayed),
    ]
    .into_iter()
    .map(|(name, v)| (name.to_owned(), v))
    .collect()
}

fn with_path(path: &std::path::Path, e: std::io::Error) -> String {
    let text = e.to_string();
    // FileDevice names the path in some errors and not in others.
    if text.contains(&*path.to_string_lossy()) {
        text
    } else {
        format!("{}: {text}", path.display())
    }
}

fn bytes_text(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {} ({bytes} bytes)", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use flash::device::MemDevice;

    use super::*;
    use crate::BackendSpec;

    const SEGMENT_PAGES: u32 = 64;

    /// Counts what the target would be told.
    #[derive(Default)]
    struct Told {
        publishing: Mutex<Vec<u32>>,
        changed: AtomicUsize,
    }

    impl Publisher for Told {
        fn publishing(&self, index: u32) {
            self.publishing.lock().unwrap().push(index);
        }
        fn changed(&self, _: &ExportTable) {
            self.changed.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn volumes() -> (FlashVolumes, ExportTable, Told) {
        let pages = flash::engine::DATA_START + 40 * u64::from(SEGMENT_PAGES);
        let devs: Vec<Box<dyn Device>> = vec![Box::new(MemDevice::new(pages))];
        flash::engine::format(&devs, SEGMENT_PAGES, false).unwrap();
        let array = Array::open(devs, flash::ctl::Config { pool_pages: 256, ..Default::default() }).unwrap();
        let fixed = Export::open("fixed", &BackendSpec::Ram { size_bytes: 1 << 20 }, false).unwrap();
        (FlashVolumes::new(array, false, [7; 32]), ExportTable::with_room(vec![fixed], 8), Told::default())
    }

    fn req(op: VolumeOp, name: &str, origin: &str, size_bytes: u64) -> VolumeRequest {
        VolumeRequest { op, name: name.into(), origin: origin.into(), size_bytes }
    }

    fn run(v: &FlashVolumes, t: &ExportTable, told: &Told, r: VolumeRequest) -> VolumeReply {
        v.execute(&r, t, told)
    }

    #[test]
    fn volumes_become_exports_and_refusals_change_nothing() {
        let (v, t, told) = volumes();
        let made = run(&v, &t, &told, req(VolumeOp::Create, "a", "", 1 << 20));
        assert_eq!(made.status, Status::Ok, "{}", made.message);
        assert!(made.message.contains("\"a\""), "{}", made.message);
        let (index, export) = t.find("a").expect("exported");
        assert_eq!((index, export.backend.kind(), export.backend.size_bytes()), (1, "flash", 1 << 20));
        assert_eq!(*told.publishing.lock().unwrap(), [1]);
        assert_eq!(told.changed.load(Ordering::SeqCst), 1);

        for (r, status, says) in [
            (req(VolumeOp::Create, "fixed", "", 4096), Status::Exists, "--export"),
            (req(VolumeOp::Create, "a", "", 4096), Status::Exists, "taken"),
            (req(VolumeOp::Create, "b", "", 0), Status::Invalid, "size"),
            (req(VolumeOp::Create, "b/c", "", 4096), Status::Invalid, "b/c"),
            (req(VolumeOp::Resize, "nope", "", 4096), Status::NotFound, "no volume named \"nope\""),
            (req(VolumeOp::Resize, "fixed", "", 4096), Status::Invalid, "not a flash volume"),
            (req(VolumeOp::Snapshot, "s", "nope", 0), Status::NotFound, "nope"),
            (req(VolumeOp::Delete, "fixed", "", 0), Status::Invalid, "not a flash volume"),
        ] {
            let reply = run(&v, &t, &told, r.clone());
            assert_eq!(reply.status, status, "{r:?}: {}", reply.message);
            assert!(reply.message.contains(says), "{r:?}: {}", reply.message);
        }
        assert_eq!(t.len(), 2, "nothing added");
        assert_eq!(v.array().list().len(), 1, "nothing made");
        assert_eq!(told.changed.load(Ordering::SeqCst), 1);

        // Data written below the new end: shrinking over it is refused, growing is not.
        export.backend.write_at(&[7; 4096], 8192, false).unwrap();
        let shrink = run(&v, &t, &told, req(VolumeOp::Resize, "a", "", 4096));
        assert_eq!(shrink.status, Status::Invalid, "{}", shrink.message);
        assert_eq!(export.backend.size_bytes(), 1 << 20, "unchanged");
        assert_eq!(run(&v, &t, &told, req(VolumeOp::Resize, "a", "", 2 << 20)).status, Status::Ok);
        assert_eq!(export.backend.size_bytes(), 2 << 20, "the export sees the new size at once");
    }

    #[test]
    fn snapshots_clones_and_deletion() {
        let (v, t, told) = volumes();
        assert_eq!(run(&v, &t, &told, req(VolumeOp::Create, "a", "", 1 << 20)).status, Status::Ok);
        t.find("a").unwrap().1.backend.write_at(&[1; 4096], 0, false).unwrap();
        assert_eq!(run(&v, &t, &told, req(VolumeOp::Snapshot, "s", "a", 0)).status, Status::Ok);
        assert_eq!(run(&v, &t, &told, req(VolumeOp::Clone, "c", "s", 0)).status, Status::Ok);
        let snap = t.find("s").unwrap().1;
        assert!(snap.is_read_only() && !t.find("c").unwrap().1.is_read_only());
        let mut back = [0; 4096];
        t.find("c").unwrap().1.backend.read_at(&mut back, 0).unwrap();
        assert_eq!(back, [1; 4096], "the clone holds what the origin held");

        let refused = run(&v, &t, &told, req(VolumeOp::Delete, "a", "", 0));
        assert_eq!(refused.status, Status::Busy);
        assert!(refused.message.contains("s"), "{}", refused.message);
        let (c, _) = t.find("c").unwrap();
        let lease = t.lease(c).unwrap();
        let busy = run(&v, &t, &told, req(VolumeOp::Delete, "c", "", 0));
        assert_eq!(busy.status, Status::Busy);
        assert!(busy.message.contains("1 connection"), "{}", busy.message);
        assert!(t.lease(c).is_ok(), "still live");
        drop(lease);
        assert_eq!(run(&v, &t, &told, req(VolumeOp::Delete, "c", "", 0)).status, Status::Ok);
        assert!(t.find("c").is_none() && t.get(c).is_none());
        assert_eq!(run(&v, &t, &told, req(VolumeOp::Delete, "c", "", 0)).status, Status::NotFound);

        let listed = run(&v, &t, &told, req(VolumeOp::List, "", "", 0));
        let VolumeBody::List { volumes, more } = listed.body else { panic!("{listed:?}") };
        let names: Vec<(&str, &str, u32)> =
            volumes.iter().map(|e| (e.name.as_str(), e.origin.as_str(), e.children)).collect();
        assert_eq!((names, more), (vec![("a", "", 1), ("s", "a", 0)], false));
        let VolumeBody::List { volumes, .. } = run(&v, &t, &told, req(VolumeOp::List, "a", "", 0)).body
        else {
            panic!()
        };
        assert_eq!(volumes.len(), 1, "after the cursor");
        let VolumeBody::Stats(stats) = run(&v, &t, &told, VolumeRequest::bare(VolumeOp::Stats)).body else {
            panic!()
        };
        assert_eq!(stats.get("volumes"), Some(2));
        assert!(stats.get("capacity_bytes").unwrap() > stats.get("free_bytes").unwrap());
    }

    /// A device the test keeps a handle on, to take its image while an array runs on it (what
    /// the devices hold when the target is killed).
    struct Kept(Arc<MemDevice>);

    impl Device for Kept {
        fn pages(&self) -> u64 {
            self.0.pages()
        }
        fn read(&self, page: u64, buf: &mut [u8]) -> std::io::Result<()> {
            self.0.read(page, buf)
        }
        fn write(&self, page: u64, buf: &[u8]) -> std::io::Result<()> {
            self.0.write(page, buf)
        }
        fn sync(&self) -> std::io::Result<()> {
            self.0.sync()
        }
        fn name(&self) -> String {
            self.0.name()
        }
    }

    fn pool_on(image: Option<Vec<u8>>, fresh: u64) -> Result<(FlashVolumes, Arc<MemDevice>), FlashError> {
        pool_of(image, pool_volume(1 << 30, fresh))
    }

    fn pool_of(
        image: Option<Vec<u8>>,
        pool: PoolVolume,
    ) -> Result<(FlashVolumes, Arc<MemDevice>), FlashError> {
        let pages = flash::engine::DATA_START + 40 * u64::from(SEGMENT_PAGES);
        let formatted = image.is_none();
        let dev = Arc::new(image.map_or_else(|| MemDevice::new(pages), MemDevice::from_image));
        let devs: Vec<Box<dyn Device>> = vec![Box::new(Kept(dev.clone()))];
        if formatted {
            flash::engine::format(&devs, SEGMENT_PAGES, false).unwrap();
        }
        let array = Array::open(devs, flash::ctl::Config { pool_pages: 256, ..Default::default() }).unwrap();
        Ok((FlashVolumes::new(array, false, [7; 32]).with_pool(pool)?, dev))
    }

    fn pool_volume(size_bytes: u64, fresh_incarnation: u64) -> PoolVolume {
        PoolVolume {
            name: "pool".into(),
            size_bytes,
            key: [9; 32],
            chunk_bytes: 1 << 20,
            fresh_incarnation,
            sync: false,
        }
    }

    /// A pool volume is thin (1 GiB on an array of a few MiB), served byte-addressed with
    /// grants and no extents, its state volume hidden, and both held out of VOLUME changes.
    #[test]
    fn a_pool_volume_is_thin_granted_and_held_out_of_volume_changes() {
        let (v, _dev) = pool_on(None, 11).unwrap();
        let t = ExportTable::with_room(Vec::new(), 8);
        let told = Told::default();
        for e in v.exports().unwrap() {
            t.add(e, |_| {}).unwrap();
        }
        assert_eq!(t.len(), 1, "the state volume is not an export");
        let (_, pool) = t.find("pool").unwrap();
        assert_eq!((pool.backend.size_bytes(), pool.block_size()), (1 << 30, 1));
        assert!(pool.grants().is_some() && pool.judges_requests() && pool.direct.is_none());
        assert_eq!(pool.grants().unwrap().chunk_bytes(), 1 << 20);
        let info = v.array().list();
        assert!(
            info.iter().all(|i| i.allocated_bytes <= 4096),
            "nothing allocated but the state page: {info:?}"
        );
        // One byte at the last chunk's end: allocated where written, and only there.
        pool.backend.write_at(&[0x5a], (1 << 30) - 1, false).unwrap();
        let mut b = [0u8; 2];
        pool.backend.read_at(&mut b, (1 << 30) - 2).unwrap();
        assert_eq!(b, [0, 0x5a]);
        for (r, says) in [
            (req(VolumeOp::Resize, "pool", "", 2 << 30), "RStore pool"),
            (req(VolumeOp::Delete, "pool", "", 0), "RStore pool"),
            (req(VolumeOp::Snapshot, "s", "pool", 0), "RStore pool"),
            (req(VolumeOp::Clone, "c", "pool", 0), "RStore pool"),
            (req(VolumeOp::Delete, "pool.state", "", 0), "RStore pool"),
            (req(VolumeOp::Create, "pool.state", "", 4096), "taken"),
        ] {
            let reply = run(&v, &t, &told, r.clone());
            assert_ne!(reply.status, Status::Ok, "{r:?}");
            assert!(reply.message.contains(says), "{r:?}: {}", reply.message);
        }
        assert_eq!(v.array().list().len(), 2, "nothing made or lost");
        assert_eq!(pool_incarnation_of(&v), 11, "a new pool takes the fresh incarnation");
    }

    fn pool_incarnation_of(v: &FlashVolumes) -> u64 {
        v.pool_incarnation().expect("a pool")
    }

    /// The incarnation survives a clean stop, with the data; a stop that was not clean (the
    /// devices as they were while the target ran) gives a new one, since writes acknowledged
    /// then may be missing. A pool asked smaller than its volume is refused.
    #[test]
    fn a_pool_keeps_its_incarnation_across_a_clean_stop_and_not_across_a_crash() {
        let (v, dev) = pool_on(None, 21).unwrap();
        v.export_of("pool").unwrap().backend.write_at(b"kept", 5 << 20, false).unwrap();
        v.shutdown().unwrap();
        let (v, dev) = pool_on(Some(dev.image()), 22).unwrap();
        assert_eq!(pool_incarnation_of(&v), 21, "a clean stop keeps the incarnation");
        let mut b = [0u8; 4];
        v.export_of("pool").unwrap().backend.read_at(&mut b, 5 << 20).unwrap();
        assert_eq!(&b, b"kept");
        // Killed: what the devices hold while it runs (the state says "not clean").
        v.export_of("pool").unwrap().backend.write_at(b"lost?", 6 << 20, false).unwrap();
        let crashed = dev.image();
        drop(v);
        let (v, dev) = pool_on(Some(crashed), 23).unwrap();
        assert_eq!(pool_incarnation_of(&v), 23, "after a crash the pool is a new one");
        v.shutdown().unwrap();
        let image = dev.image();
        let (v, _) = pool_on(Some(image.clone()), 24).unwrap();
        assert_eq!(pool_incarnation_of(&v), 23, "and keeps that one across the next clean stop");
        drop(v);
        let devs: Vec<Box<dyn Device>> = vec![Box::new(MemDevice::from_image(image))];
        let array = Array::open(devs, flash::ctl::Config { pool_pages: 256, ..Default::default() }).unwrap();
        let smaller = pool_volume(1 << 29, 1);
        let e =
            FlashVolumes::new(array, false, [7; 32]).with_pool(smaller).expect_err("a smaller pool refused");
        assert!(e.to_string().contains("give at least its size"), "{e}");
    }

    /// A write through the pool's export, as a worker executes it (no FUA asked for).
    fn write_pool(v: &FlashVolumes, bytes: &[u8], offset: u64) {
        let export = v.export_of("pool").unwrap();
        let io = crate::Io {
            opcode: wire::Opcode::Write,
            flags: wire::ReqFlags::empty(),
            offset,
            length: bytes.len() as u32,
        };
        assert_eq!(crate::execute(&export, &io, bytes, &mut []), Status::Ok);
    }

    fn read_pool(v: &FlashVolumes, offset: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        v.export_of("pool").unwrap().backend.read_at(&mut b, offset).unwrap();
        b
    }

    /// A `sync` pool makes every write durable before it is acknowledged, so a crash (the
    /// devices as they were while it ran) keeps both its writes and its incarnation. Served
    /// without `sync` after a crash of a `sync` life, it keeps them too; but a crash of that
    /// plain life gives a new one again, even if the next start asks for `sync`.
    #[test]
    fn a_sync_pool_keeps_its_writes_and_incarnation_across_a_crash() {
        let sync = |fresh| PoolVolume { sync: true, ..pool_volume(1 << 30, fresh) };
        let (v, dev) = pool_of(None, sync(31)).unwrap();
        let export = v.export_of("pool").unwrap();
        let names: Vec<String> = export.layers().iter().map(|l| l.describe()).collect();
        assert!(names.contains(&"sync".to_owned()), "{names:?}");
        write_pool(&v, b"durable", 7 << 20);
        let crashed = dev.image();
        drop((v, export));
        let (v, dev) = pool_of(Some(crashed), sync(32)).unwrap();
        assert_eq!(pool_incarnation_of(&v), 31, "a crash of a sync pool loses nothing acknowledged");
        assert_eq!(read_pool(&v, 7 << 20, 7), b"durable");

        // The next life is plain: until it stops cleanly, a crash may lose its writes.
        let crashed = dev.image();
        drop(v);
        let (v, dev) = pool_on(Some(crashed), 33).unwrap();
        assert_eq!(pool_incarnation_of(&v), 31, "the sync life ended by a crash, and lost nothing");
        write_pool(&v, b"maybe", 8 << 20);
        let crashed = dev.image();
        drop(v);
        let (v, _) = pool_of(Some(crashed), sync(34)).unwrap();
        assert_eq!(pool_incarnation_of(&v), 34, "a crash of the plain life: a new pool, sync or not");
        assert_eq!(read_pool(&v, 7 << 20, 7), b"durable");
    }

    /// Without `sync`, the same write is not on flash when it is acknowledged: the crash image
    /// does not hold it (the mutation the test above would miss if `sync` did nothing).
    #[test]
    fn a_plain_pool_write_is_not_durable_when_acknowledged() {
        let (v, dev) = pool_on(None, 41).unwrap();
        write_pool(&v, b"durable", 7 << 20);
        let crashed = dev.image();
        drop(v);
        let (v, _) = pool_on(Some(crashed), 42).unwrap();
        assert_eq!(pool_incarnation_of(&v), 42);
        assert_eq!(read_pool(&v, 7 << 20, 7), [0; 7], "the page pool held it, not the flash");
    }

    #[test]
    fn a_state_page_parses_only_when_whole() {
        for mark in [Mark::Serving, Mark::Stopped, Mark::ServingSync] {
            assert_eq!(decode_state(&encode_state(5, mark)), Some((5, mark)));
        }
        assert_eq!(decode_state(&encode_state(0, Mark::Stopped)), None, "no incarnation is 0");
        assert_eq!(decode_state(&[0; 4096]), None);
        let mut bad = encode_state(5, Mark::Stopped);
        bad[16] = 3;
        assert_eq!(decode_state(&bad), None);
        assert_eq!(decode_state(&bad[..10]), None);
    }
}
