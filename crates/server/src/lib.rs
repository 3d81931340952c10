//! The skiff target daemon: listeners, workers, exports, stats, metrics.
//!
//! [`Target::start`] opens the backends (and a flash array, whose volumes it serves as exports
//! that come and go while it runs: `engine::volumes`), binds the listeners and starts one
//! acceptor thread and one worker per core. A worker owns its connections outright and runs
//! each request to completion on its own thread: read a caravan, execute every request on the
//! backend, append the completions to the connection's response buffer, and send all responses
//! at the end of the loop pass. The acceptor hands a connection to a worker once, at connect
//! time; nothing on the data path crosses threads or takes a lock. With a metrics address
//! configured, a side thread serves the workers' counters to Prometheus ([`metrics`]); it only
//! ever reads them.

mod acceptor;
mod admission;
mod bounds;
mod conn;
pub mod drive;
mod front;
mod metrics;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod model;
mod passes;
mod stages;
pub mod stats;
mod txbuf;
mod worker;

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;

use engine::volumes::FlashVolumes;
use engine::{BackendSpec, Export, ExportTable, BLOCK_BYTES};
use transport::{Endpoint, Listener};

pub use engine::volumes::{
    FlashConfig, PoolVolume, MAP_BYTES_DEFAULT as FLASH_MAP_BYTES_DEFAULT, POOL_BYTES_DEFAULT,
    READ_DEPTH_DEFAULT as FLASH_READ_DEPTH_DEFAULT,
};

pub use bounds::Bounds;
pub use conn::Protocol;
pub use stages::Stages;
pub use stats::{ListenerStats, WorkerStats};

/// One export on the command line: `NAME=SPEC[,OPTION...]`. Options: `ro` (read-only),
/// `cache=SIZE` (a block cache for direct reads of a file export; docs/DIRECT_READS.md),
/// `direct=off` (a file export through the page cache instead of `O_DIRECT`),
/// `allow=NAME:rw+NAME:ro+*:ro` (which keys may open it, with which rights; `*` is anyone
/// without a key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportConfig {
    pub name: String,
    pub spec: BackendSpec,
    pub read_only: bool,
    /// Bytes of block cache serving direct reads (file exports); 0 for none.
    pub cache_bytes: u64,
    /// Who may open the export (`,allow=NAME:rw+NAME:ro+*:ro`); `None`: anyone.
    pub access: Option<proto::auth::AccessList>,
    /// `O_DIRECT` where the file system takes it (the default); `,direct=off` goes through
    /// the page cache.
    pub use_direct: bool,
    /// Send read data from the file with `sendfile(2)` (`,send=sendfile`, file exports only;
    /// through the page cache, so it implies `direct=off`).
    pub send_file: bool,
    /// A block finer than the backend's (`,block=N`, a power of two): RStore pools serve
    /// byte-granular I/O with `block=1`. `None`: the backend's own (512 bytes).
    pub block_bytes: Option<u32>,
    /// Every change durable before it is acknowledged, FUA or not (`,sync`;
    /// [`engine::layer::SyncWrites`]).
    pub sync: bool,
    /// Serve the export as an RStore pool whose chunks need grants (`skiff serve --pool`
    /// sets it; there is no `,option` for it: the key must reach the control plane).
    pub grants: Option<GrantConfig>,
}

/// A pool export's grant key and chunk size ([`proto::grant`]).
#[derive(Clone, PartialEq, Eq)]
pub struct GrantConfig {
    pub key: [u8; proto::capability::KEY_LEN],
    pub chunk_bytes: u64,
}

impl std::fmt::Debug for GrantConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("GrantConfig").field("chunk_bytes", &self.chunk_bytes).finish_non_exhaustive()
    }
}

/// Why an `--export` argument does not describe an export.
#[derive(Debug, thiserror::Error)]
pub enum ExportConfigError {
    #[error("export {0:?}: expected NAME=SPEC")]
    MissingEquals(String),
    #[error("export {0:?}: name must be 1 to {max} bytes", max = wire::control::EXPORT_NAME_MAX)]
    BadName(String),
    #[error("export {name:?}: {source}")]
    Spec { name: String, source: engine::SpecError },
    #[error("export {name:?}: cache={value:?}: {source}")]
    CacheSize { name: String, value: String, source: engine::SpecError },
    #[error("export {name:?}: allow=: {message}")]
    Access { name: String, message: String },
    #[error("export {name:?}: block={value:?}: expected a power of two from 1 to 512")]
    BlockSize { name: String, value: String },
    #[error("export {name:?}: send={value:?}: expected copy or sendfile")]
    Send { name: String, value: String },
}

impl std::str::FromStr for ExportConfig {
    type Err = ExportConfigError;
    fn from_str(s: &str) -> Result<ExportConfig, ExportConfigError> {
        let (name, spec) = s.split_once('=').ok_or_else(|| ExportConfigError::MissingEquals(s.to_owned()))?;
        if name.is_empty() || name.len() > wire::control::EXPORT_NAME_MAX {
            return Err(ExportConfigError::BadName(s.to_owned()));
        }
        // Options trail the spec (`,ro`, `,cache=SIZE`); a path may hold commas of its own, so
        // only known options are taken from the end.
        let (mut spec, mut read_only, mut cache_bytes, mut use_direct) = (spec, false, 0, true);
        let (mut access, mut block_bytes, mut send_file, mut sync) = (None, None, false, false);
        while let Some((head, option)) = spec.rsplit_once(',') {
            if option == "ro" {
                read_only = true;
            } else if option == "sync" {
                sync = true;
            } else if let Some(list) = option.strip_prefix("allow=") {
                let parsed = proto::auth::AccessList::parse(list)
                    .map_err(|message| ExportConfigError::Access { name: name.to_owned(), message })?;
                access = Some(parsed);
            } else if let Some(value) = option.strip_prefix("block=") {
                let bytes = value.parse::<u32>().ok().filter(|b| b.is_power_of_two() && *b <= BLOCK_BYTES);
                let bad = || ExportConfigError::BlockSize { name: name.to_owned(), value: value.to_owned() };
                block_bytes = Some(bytes.ok_or_else(bad)?);
            } else if let Some(value) = option.strip_prefix("send=") {
                send_file = match value {
                    "sendfile" => true,
                    "copy" => false,
                    _ => {
                        return Err(ExportConfigError::Send {
                            name: name.to_owned(),
                            value: value.to_owned(),
                        })
                    }
                };
            } else if option == "direct=off" || option == "direct=on" {
                use_direct = option == "direct=on";
            } else if let Some(value) = option.strip_prefix("cache=") {
                cache_bytes = engine::parse_size(value).map_err(|source| ExportConfigError::CacheSize {
                    name: name.to_owned(),
                    value: value.to_owned(),
                    source,
                })?;
            } else {
                break;
            }
            spec = head;
        }
        let spec = BackendSpec::parse(spec)
            .map_err(|source| ExportConfigError::Spec { name: name.to_owned(), source })?;
        Ok(ExportConfig {
            name: name.to_owned(),
            spec,
            read_only,
            cache_bytes,
            use_direct,
            send_file,
            access,
            block_bytes,
            sync,
            grants: None,
        })
    }
}

/// TLS on the listeners (native: by the first byte; NBD: by STARTTLS): whether it is offered
/// or required, and the certificate.
#[derive(Clone)]
pub struct TlsListen {
    pub mode: transport::tls::TlsMode,
    pub config: Arc<transport::tls::ServerTlsConfig>,
    /// Clients must present a certificate the CA signed (`config` was built to ask for one):
    /// its CN is then a principal that `allow=` lists may name, as they name keys.
    pub verify_peer: bool,
}

impl std::fmt::Debug for TlsListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsListen")
            .field("mode", &self.mode)
            .field("verify_peer", &self.verify_peer)
            .finish_non_exhaustive()
    }
}

/// Everything a target needs to start. Bounds live here with their defaults.
#[derive(Debug, Clone)]
pub struct TargetConfig {
    /// Where to listen for the native protocol (TCP addresses and Unix socket paths).
    pub listen: Vec<Endpoint>,
    /// Where to listen for NBD clients.
    pub nbd_listen: Vec<Endpoint>,
    pub exports: Vec<ExportConfig>,
    /// Serve every export read-only (each export may also be read-only on its own).
    pub read_only: bool,
    /// Worker threads; zero means one per core.
    pub workers: usize,
    /// Every limit the target holds to ([`Bounds`]).
    pub bounds: Bounds,
    /// Hybrid polling (`rt::poll`): how a worker waits for its connections' next requests.
    /// Spinning saves the sleep and wake-up when requests arrive back to back and costs a busy
    /// core meanwhile; `Off`, the default, always sleeps.
    pub poll: rt::poll::PollMode,
    /// How the workers divide a request's path among threads: run to completion (the
    /// default, and the only design for production), or one of the staged designs Tyche
    /// removed, kept to measure what removing them saves ([`Stages`]).
    pub stages: Stages,
    /// The keys initiators may authenticate with (docs/PROTOCOL.md, section 15); exports name
    /// them in their access lists.
    pub keys: Vec<proto::auth::Key>,
    /// TLS on the native TCP and the NBD listeners (`--tls on|require`); `None` is plaintext
    /// only.
    pub tls: Option<TlsListen>,
    /// Serve Prometheus metrics at `GET /metrics` on this TCP address (`HOST:PORT`). Also
    /// turns on the measurement of request service times, one clock read per request.
    pub metrics_listen: Option<String>,
    /// A flash array (`skiff flash format`) whose volumes are exports, created, resized,
    /// snapshotted, cloned and deleted with `VOLUME` requests while the target runs
    /// (docs/PROTOCOL.md, section 17). `None`: no flash array, and `VOLUME` is refused.
    pub flash: Option<FlashConfig>,
}

impl Default for TargetConfig {
    fn default() -> TargetConfig {
        TargetConfig {
            listen: vec![Endpoint::Tcp(format!("127.0.0.1:{}", transport::endpoint::DEFAULT_PORT))],
            nbd_listen: Vec::new(),
            exports: Vec::new(),
            read_only: false,
            workers: 0,
            bounds: Bounds::default(),
            poll: rt::poll::PollMode::Off,
            stages: Stages::RunToCompletion,
            metrics_listen: None,
            keys: Vec::new(),
            tls: None,
            flash: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("no exports configured (give --export, or --flash to serve a flash array's volumes)")]
    NoExports,
    #[error("nothing to listen on")]
    NothingToListenOn,
    #[error("NBD export table: {0}")]
    Nbd(::nbd::NbdError),
    #[error("export {export:?} allows {key:?}, which no key file gives (nor can a TLS client certificate name it: that needs --tls-verify-peer)")]
    UnknownKey { export: String, key: String },
    #[error("export name {0:?} given twice")]
    DuplicateExport(String),
    #[error("export {name:?}: {source}")]
    Backend { name: String, source: engine::BackendError },
    #[error("listen on {endpoint}: {source}")]
    Listen { endpoint: Endpoint, source: io::Error },
    #[error("--stages {0} serves plaintext native connections only: it cannot be combined with TLS")]
    StagedTls(Stages),
    #[error("start worker: {0}")]
    Spawn(io::Error),
    #[error("metrics on {addr}: {source}")]
    Metrics { addr: String, source: io::Error },
    #[error("flash array: {0}")]
    Flash(engine::volumes::flash::FlashError),
    #[error("flash volume {0:?} has the name of an --export: serve that export under another name")]
    VolumeNameTaken(String),
    #[error("the flash array holds {volumes} volumes, more than volume_exports_max ({max})")]
    TooManyVolumes { volumes: usize, max: usize },
}

/// What a memory server's repair agent did (`rstore::agent` keeps it; the metrics show it).
#[derive(Debug, Default)]
pub struct RepairStats {
    /// Whether this server leads the repair now.
    pub leading: AtomicBool,
    /// Repairs this server copied out as a source, and their bytes.
    pub chunks: std::sync::atomic::AtomicU64,
    pub bytes: std::sync::atomic::AtomicU64,
    /// Bytes a second over the last chunk copied.
    pub rate: std::sync::atomic::AtomicU64,
    /// Bytes of regions a partial repair left out (not dirty) that it compared with the copy
    /// being repaired, and the regions found different (copied like dirty ones).
    pub verified: std::sync::atomic::AtomicU64,
    pub mismatched: std::sync::atomic::AtomicU64,
}

/// A pool export's chunk grants, with the target's workers behind them: how `skiff serve
/// --pool` retires the chunks given back before it zeroes them.
#[derive(Clone)]
pub struct Pool {
    grants: Arc<proto::grant::PoolGrants>,
    backend: Arc<dyn engine::Backend>,
    shared: Arc<Shared>,
}

impl Pool {
    pub fn grants(&self) -> &proto::grant::PoolGrants {
        &self.grants
    }

    /// Read `buf.len()` bytes of the pool at `offset` from its backend, as a worker would,
    /// with no grant: the server's own reads (a repair copying out of this pool).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), String> {
        self.backend.read_at(buf, offset).map_err(|e| format!("reading the pool at {offset}: {e}"))
    }

    /// What the repair agent did, shown by the target's metrics.
    pub fn repair(&self) -> &RepairStats {
        &self.shared.repair
    }

    /// Retire `chunks`: move each one's generation on, so that no grant sealed before is
    /// honoured from now, then wait until every worker has finished the pass it was in. A
    /// request checked against an old grant just before ran in such a pass, so on return no
    /// write of the last owner can still land in these chunks, and none of their bytes is
    /// still being sent to it. Returns each chunk's new generation (chunks past the pool are
    /// left out).
    pub fn retire(&self, chunks: &[u64]) -> Vec<(u64, u32)> {
        let retired = chunks.iter().filter_map(|&c| Some((c, self.grants.retire(c)?))).collect();
        self.fence();
        retired
    }

    /// Move `chunk`'s map epoch up to `epoch` at `generation` (a repair starting on this
    /// server: [`PoolGrants::raise`](proto::grant::PoolGrants::raise)), then wait for the
    /// requests checked under the old epoch. On `Ok`, no write under an older map can land in
    /// the chunk any more.
    pub fn raise(&self, chunk: u64, generation: u32, epoch: u32) -> Result<(), String> {
        match self.grants.raise(chunk, generation, epoch) {
            None => Err(format!("chunk {chunk} is past the pool")),
            Some(Err((g, e))) => Err(format!(
                "chunk {chunk} is at generation {g}, epoch {e}: not raised to generation {generation}, epoch {epoch}"
            )),
            Some(Ok(())) => {
                self.fence();
                Ok(())
            }
        }
    }

    /// Lock `regions` of `chunk` against writes (they complete with `Busy`), then wait for
    /// the writes checked before: on return the regions hold still until [`unlock`], and a
    /// copy read from them now is what every write acknowledged so far left there.
    ///
    /// [`unlock`]: Pool::unlock
    pub fn lock(&self, chunk: u64, regions: u64) {
        self.grants.lock(chunk, regions, true);
        self.fence();
    }

    pub fn unlock(&self, chunk: u64, regions: u64) {
        self.grants.lock(chunk, regions, false);
    }

    /// Wait until every worker has finished the pass it is in. Called after a change to the
    /// chunks' states (SeqCst): a pass that had not begun yet will see it, and one that had
    /// ran its requests to the end (writes land within their pass) before it ends.
    fn fence(&self) {
        let running: Vec<(&WorkerStats, u64)> = self
            .shared
            .workers
            .iter()
            .map(|w| (w.as_ref(), w.pass.load(Ordering::SeqCst)))
            .filter(|(_, pass)| pass % 2 == 1)
            .collect();
        for (worker, pass) in running {
            while worker.pass.load(Ordering::SeqCst) == pass && !self.shared.shutdown.load(Ordering::Acquire)
            {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }
}

/// State every thread of one target can see.
pub(crate) struct Shared {
    /// What the RStore repair agent of a memory server did (`rstore::agent`), for metrics.
    pub repair: RepairStats,
    pub config: TargetConfig,
    pub exports: ExportTable,
    /// The NBD view of the exports, when an NBD listener is configured: rebuilt whenever the
    /// table changes, and read once per NBD connection when it is accepted, so the lock is
    /// never on the data path (an NBD connection keeps the view it started with until its
    /// client chooses an export, and finds that export in the table by name).
    pub nbd: Option<RwLock<Arc<::nbd::HandshakeConfig>>>,
    /// The flash array whose volumes are exports, when one is configured.
    pub flash: Option<FlashVolumes>,
    pub workers: Vec<Arc<WorkerStats>>,
    pub shutdown: AtomicBool,
    pub connections: std::sync::atomic::AtomicUsize,
    pub listener: ListenerStats,
    pub admission: admission::Admission,
    /// Thread ids of the acceptor, for CPU accounting beside the workers'.
    pub acceptor_tid: std::sync::atomic::AtomicI32,
    /// The epoch of service-time measurement, when metrics are on ([`Host::now_ns`]).
    ///
    /// [`Host::now_ns`]: engine::front::Host::now_ns
    pub clock: Option<std::time::Instant>,
    /// When the target started: the clock capabilities expire on ([`Host::clock_ms`]).
    ///
    /// [`Host::clock_ms`]: engine::front::Host::clock_ms
    pub started: std::time::Instant,
    /// The keys of [`TargetConfig::keys`], shared with every connection's handshake.
    pub keys: Arc<Vec<proto::auth::Key>>,
    /// Some export is a pool: workers fence their passes ([`WorkerStats::pass`]).
    pub serves_pool: bool,
}

impl engine::front::Host for Shared {
    fn exports(&self) -> &ExportTable {
        &self.exports
    }

    fn io_bytes_max(&self) -> u32 {
        self.config.bounds.limits.io_bytes_max
    }

    fn stats_reply(&self) -> wire::StatsReply {
        stats::collect(self)
    }

    fn now_ns(&self) -> Option<u64> {
        self.clock.map(|epoch| epoch.elapsed().as_nanos() as u64)
    }

    fn clock_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn volume(&self, request: &wire::VolumeRequest) -> wire::VolumeReply {
        match &self.flash {
            Some(flash) => flash.execute(request, &self.exports, self),
            None => wire::VolumeReply::refused(
                request.op,
                wire::Status::Unsupported,
                "this target serves no flash array (skiff serve --flash)",
            ),
        }
    }
}

/// What the table's changes mean for the rest of the target.
impl engine::volumes::Publisher for Shared {
    fn publishing(&self, index: u32) {
        for w in &self.workers {
            w.front.ops.add_row(index);
        }
    }

    fn changed(&self, table: &ExportTable) {
        let Some(nbd) = &self.nbd else { return };
        match self.nbd_config(table) {
            Ok(c) => *nbd.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(c),
            // Every export was checked when it was made; keep offering the last good list.
            Err(e) => tracing::error!(error = %e, "NBD export list not rebuilt"),
        }
    }
}

impl Shared {
    /// The state of a target serving `exports` (and the volumes of `flash`) on `workers`
    /// workers; `timed` measures request service times (for the metrics endpoint).
    #[cfg(any(test, feature = "fuzzing"))]
    fn new(
        config: TargetConfig,
        exports: ExportTable,
        workers: usize,
        timed: bool,
    ) -> Result<Shared, TargetError> {
        Shared::with_flash(config, exports, None, workers, timed)
    }

    fn with_flash(
        config: TargetConfig,
        exports: ExportTable,
        flash: Option<FlashVolumes>,
        workers: usize,
        timed: bool,
    ) -> Result<Shared, TargetError> {
        let (fixed, room) = (exports.fixed_len(), exports.capacity() - exports.fixed_len());
        let mut shared = Shared {
            serves_pool: false,
            repair: RepairStats::default(),
            exports,
            nbd: None,
            flash,
            workers: (0..workers).map(|_| Arc::new(WorkerStats::with_room(fixed, room))).collect(),
            shutdown: AtomicBool::new(false),
            connections: Default::default(),
            listener: Default::default(),
            admission: Default::default(),
            acceptor_tid: Default::default(),
            clock: timed.then(std::time::Instant::now),
            started: std::time::Instant::now(),
            keys: Arc::new(config.keys.clone()),
            config,
        };
        shared.export_volumes()?;
        // A pool is an export given at start (`ram:`, `file:`) or a flash volume.
        shared.serves_pool = shared.exports.iter().any(|e| e.grants().is_some());
        if !shared.config.nbd_listen.is_empty() {
            let c = shared.nbd_config(&shared.exports).map_err(TargetError::Nbd)?;
            shared.nbd = Some(RwLock::new(Arc::new(c)));
        }
        Ok(shared)
    }

    /// Add every volume of the flash array to the table.
    fn export_volumes(&self) -> Result<(), TargetError> {
        let Some(flash) = &self.flash else { return Ok(()) };
        let volumes = flash.exports().map_err(TargetError::Flash)?;
        let max = self.config.bounds.volume_exports_max;
        if volumes.len() > max {
            return Err(TargetError::TooManyVolumes { volumes: volumes.len(), max });
        }
        for export in volumes {
            let name = export.name.clone();
            self.exports
                .add(export, |index| engine::volumes::Publisher::publishing(self, index))
                .map_err(|_| TargetError::VolumeNameTaken(name))?;
        }
        Ok(())
    }

    /// The NBD view of `table` for anonymous clients, with the listeners' TLS policy.
    fn nbd_config(&self, table: &ExportTable) -> Result<::nbd::HandshakeConfig, ::nbd::NbdError> {
        let c = engine::front::nbd::handshake_config(table, self.config.bounds.limits.io_bytes_max, None)?;
        // The NBD listeners offer TLS as the native ones do, through STARTTLS.
        let policy = match self.config.tls.as_ref().map(|t| t.mode) {
            None | Some(transport::tls::TlsMode::Off) => ::nbd::TlsPolicy::Off,
            Some(transport::tls::TlsMode::On) => ::nbd::TlsPolicy::On,
            Some(transport::tls::TlsMode::Require) => ::nbd::TlsPolicy::Require,
        };
        Ok(c.with_tls(policy))
    }

    /// What a new NBD connection is offered, when NBD is served.
    pub fn nbd_view(&self) -> Option<Arc<::nbd::HandshakeConfig>> {
        self.nbd.as_ref().map(|c| c.read().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

/// A running target. Dropping it shuts the target down and waits for its threads.
pub struct Target {
    shared: Arc<Shared>,
    endpoints: Vec<(Endpoint, Protocol)>,
    wakers: Vec<Arc<transport::event::Waker>>,
    threads: Vec<JoinHandle<()>>,
    /// The metrics endpoint's address and thread, when configured.
    metrics: Option<(std::net::SocketAddr, JoinHandle<()>)>,
    stopped: bool,
}

impl Target {
    /// Open the exports, bind the listeners and start serving.
    pub fn start(config: TargetConfig) -> Result<Target, TargetError> {
        if config.stages != Stages::RunToCompletion && config.tls.is_some() {
            return Err(TargetError::StagedTls(config.stages));
        }
        let exports = open_exports(&config)?;
        if exports.is_empty() && config.flash.is_none() {
            return Err(TargetError::NoExports);
        }
        let metrics_listener = match &config.metrics_listen {
            Some(addr) => Some(
                std::net::TcpListener::bind(addr)
                    .and_then(|l| Ok((l.local_addr()?, l)))
                    .map_err(|source| TargetError::Metrics { addr: addr.clone(), source })?,
            ),
            None => None,
        };
        let mut listeners = Vec::new();
        let mut endpoints = Vec::new();
        let tagged = config.listen.iter().map(|e| (e, Protocol::Native));
        for (ep, protocol) in tagged.chain(config.nbd_listen.iter().map(|e| (e, Protocol::Nbd))) {
            let listener = match ep {
                Endpoint::Eth { .. } => eth::listen(ep),
                _ => Listener::bind(ep),
            };
            let bound = listener.and_then(|l| Ok((l.local_endpoint()?, l)));
            let (local, l) = bound.map_err(|source| TargetError::Listen { endpoint: ep.clone(), source })?;
            endpoints.push((local, protocol));
            listeners.push((l, protocol));
        }
        if listeners.is_empty() {
            return Err(TargetError::NothingToListenOn);
        }
        let workers = match config.workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        // Last of what may fail at start: recovering an array can take a while.
        let flash = match &config.flash {
            Some(f) => {
                // Extent capabilities of every volume are sealed with this; it never leaves
                // the process, so they die with it.
                let secret = rt::random::bytes().map_err(|e| TargetError::Flash(e.into()))?;
                Some(FlashVolumes::open(f, config.read_only, secret).map_err(TargetError::Flash)?)
            }
            None => None,
        };
        let timed = metrics_listener.is_some();
        let shared = Arc::new(Shared::with_flash(config, exports, flash, workers, timed)?);
        for e in shared.exports.iter() {
            tracing::info!(export = %e.name, kind = e.backend.kind(), size_bytes = e.backend.size_bytes(), read_only = e.is_read_only(), "export ready");
        }

        let mut threads = Vec::new();
        let mut wakers = Vec::new();
        let mut inboxes = Vec::new();
        for id in 0..workers {
            let w = worker::Worker::new(id, shared.clone()).map_err(TargetError::Spawn)?;
            wakers.push(w.waker());
            inboxes.push(w.inbox());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("skiff-worker-{id}"))
                    .spawn(move || w.run())
                    .map_err(TargetError::Spawn)?,
            );
        }
        let acceptor =
            acceptor::Acceptor::new(listeners, inboxes, shared.clone()).map_err(TargetError::Spawn)?;
        wakers.push(acceptor.waker());
        threads.push(
            std::thread::Builder::new()
                .name("skiff-accept".into())
                .spawn(move || acceptor.run())
                .map_err(TargetError::Spawn)?,
        );
        for (ep, protocol) in &endpoints {
            tracing::info!(%ep, ?protocol, workers, "listening");
        }
        let mut target = Target { shared, endpoints, wakers, threads, metrics: None, stopped: false };
        if let Some((addr, listener)) = metrics_listener {
            let shared = target.shared.clone();
            let fixed = metrics::Static { start_time_s: unix_time_s() };
            let thread = std::thread::Builder::new()
                .name("skiff-metrics".into())
                .spawn(move || {
                    let render = || metrics::render(&shared, &fixed);
                    metrics::http::serve(listener, Default::default(), &shared.shutdown, render)
                })
                .map_err(TargetError::Spawn)?;
            tracing::info!(%addr, "metrics at http://{addr}/metrics");
            target.metrics = Some((addr, thread));
        }
        Ok(target)
    }

    /// The address of the metrics endpoint (with its real port when port 0 was asked for).
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics.as_ref().map(|(addr, _)| *addr)
    }

    /// The native-protocol addresses actually bound (with real ports when port 0 was asked
    /// for), in the order configured.
    pub fn endpoints(&self) -> Vec<Endpoint> {
        self.endpoints_of(Protocol::Native)
    }

    /// The addresses bound for one protocol.
    pub fn endpoints_of(&self, protocol: Protocol) -> Vec<Endpoint> {
        self.endpoints.iter().filter(|(_, p)| *p == protocol).map(|(e, _)| e.clone()).collect()
    }

    /// Counters of the whole target, as a STATS request would see them.
    /// Revoke every capability of export `name` by rotating its key epoch (docs/DIRECT_READS.md);
    /// returns the new epoch, or `None` when there is no such export serving direct reads.
    pub fn rotate_epoch(&self, name: &str) -> Option<u32> {
        let (_, export) = self.shared.exports.find(name)?;
        let epoch = export.direct.as_ref()?.rotate_epoch();
        tracing::info!(
            export = name,
            epoch,
            "capability key epoch rotated: every capability of the export is stale"
        );
        Some(epoch)
    }

    /// Pool export `name`, to retire its chunks and take up generations (`skiff serve
    /// --pool`); `None` when there is no such pool.
    pub fn pool(&self, name: &str) -> Option<Pool> {
        let export = self.shared.exports.find(name)?.1;
        let grants = export.grants()?.clone();
        Some(Pool { grants, backend: export.backend.clone(), shared: self.shared.clone() })
    }

    /// Which life of the flash pool volume's data this is (`--pool flash:SIZE`), if the
    /// target serves one ([`FlashVolumes::pool_incarnation`]).
    pub fn flash_pool_incarnation(&self) -> Option<u64> {
        self.shared.flash.as_ref()?.pool_incarnation()
    }

    /// Drop the cached blocks of export `name` that `len` bytes from `offset` touch: their
    /// capabilities become stale. Returns false when there is no such export.
    pub fn invalidate(&self, name: &str, offset: u64, len: u64) -> bool {
        match self.shared.exports.find(name).and_then(|(_, e)| e.direct.as_ref()) {
            Some(d) => {
                d.invalidate(offset, len);
                true
            }
            None => false,
        }
    }

    pub fn stats(&self) -> wire::StatsReply {
        stats::collect(&self.shared)
    }

    /// Stop accepting, close every connection and wait for all threads.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        self.shared.shutdown.store(true, Ordering::Release);
        for w in &self.wakers {
            let _ = w.wake();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Some((addr, thread)) = self.metrics.take() {
            if metrics::http::wake(addr) {
                let _ = thread.join();
            } else {
                // Blocked in accept with no way in: it exits at its next scrape.
                tracing::warn!(%addr, "metrics thread not woken; left to exit on its own");
            }
        }
        // No worker writes any more: what the array holds dirty goes to the devices with a
        // checkpoint, so the next start has nothing to replay.
        if let Some(flash) = &self.shared.flash {
            match flash.shutdown() {
                Ok(()) => tracing::info!("flash array written back and checkpointed"),
                Err(e) => {
                    tracing::error!(error = %e, "flash array shutdown failed; the next start replays its log")
                }
            }
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.stop();
    }
}

fn unix_time_s() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn open_exports(config: &TargetConfig) -> Result<ExportTable, TargetError> {
    let mut exports: Vec<Export> = Vec::new();
    for ec in &config.exports {
        if exports.iter().any(|e| e.name == ec.name) {
            return Err(TargetError::DuplicateExport(ec.name.clone()));
        }
        let read_only = config.read_only || ec.read_only;
        let backend_error = |source| TargetError::Backend { name: ec.name.clone(), source };
        // A file served at a finer block goes through the page cache alone: a sub-page write
        // (buffered) and an O_DIRECT write to the same page can leave a stale cached page
        // whose writeback undoes the bytes written beside it.
        // And data sent with sendfile(2) comes from the page cache: a file that also takes
        // O_DIRECT writes would send what they did not invalidate yet.
        let use_direct = ec.use_direct && ec.block_bytes.is_none() && !ec.send_file;
        let mut export =
            Export::open_with(&ec.name, &ec.spec, read_only, use_direct).map_err(backend_error)?;
        if ec.send_file {
            if export.backend.file_fd().is_none() {
                return Err(TargetError::Backend {
                    name: ec.name.clone(),
                    source: std::io::Error::other("send=sendfile: only a file export sends from its file")
                        .into(),
                });
            }
            export = export.with_layer(Arc::new(engine::layer::SendFile)).map_err(backend_error)?;
        }
        if let Some(block_bytes) = ec.block_bytes {
            export = export.with_block_bytes(block_bytes).map_err(backend_error)?;
        }
        if ec.sync {
            export = export.with_layer(Arc::new(engine::layer::SyncWrites)).map_err(backend_error)?;
        }
        // A principal is a key's name, or the CN of a verified client certificate: with
        // certificates in play, any name may be one, so only a typo without them is caught.
        let certificates_name_principals = config.tls.as_ref().is_some_and(|t| t.verify_peer);
        if let Some(list) = &ec.access {
            for (key, _) in &list.keys {
                if !certificates_name_principals && !config.keys.iter().any(|k| &k.name == key) {
                    return Err(TargetError::UnknownKey { export: ec.name.clone(), key: key.clone() });
                }
            }
        } else if !config.keys.is_empty() {
            tracing::warn!(export = %ec.name, "no allow= list: anyone who reaches this target may open the export, key or not");
        }
        if let Some(list) = &ec.access {
            export =
                export.with_layer(Arc::new(engine::layer::Access(list.clone()))).map_err(backend_error)?;
        }
        if ec.cache_bytes > 0 && export.backend.read_in_place(0, 0).is_some() {
            tracing::warn!(export = %ec.name, "cache= ignored: a RAM export is its own cache for direct reads");
        }
        if let Some(g) = &ec.grants {
            // A pool: its chunks are reached with grants alone, and it hands out no direct-read
            // capabilities (they would reach past the chunks granted).
            let chunks = export.backend.size_bytes() / g.chunk_bytes.max(1);
            let pool = proto::grant::PoolGrants::new(g.key, g.chunk_bytes, chunks).map_err(|e| {
                TargetError::Backend { name: ec.name.clone(), source: std::io::Error::other(e).into() }
            })?;
            export =
                export.with_layer(Arc::new(engine::layer::Grants(Arc::new(pool)))).map_err(backend_error)?;
            exports.push(export);
            continue;
        }
        // Every export serves direct reads under a secret of its own that never leaves this
        // process; capabilities die with it.
        rt::random::bytes()
            .and_then(|secret| export.enable_direct_reads(secret, ec.cache_bytes))
            .map_err(|e| TargetError::Backend { name: ec.name.clone(), source: e.into() })?;
        exports.push(export);
    }
    let room = if config.flash.is_some() { config.bounds.volume_exports_max } else { 0 };
    Ok(ExportTable::with_room(exports, room))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_arguments_parse_or_say_what_is_wrong() {
        let ok: ExportConfig = "vol=ram:1M,ro".parse().unwrap();
        assert_eq!((ok.name.as_str(), ok.read_only), ("vol", true));
        let cached: ExportConfig = "vol=file:/var/tmp/a,b,cache=64M,ro".parse().unwrap();
        assert_eq!((cached.cache_bytes, cached.read_only, cached.use_direct), (64 << 20, true, true));
        let buffered: ExportConfig = "vol=file:/x,direct=off".parse().unwrap();
        assert!(!buffered.use_direct);
        let sent: ExportConfig = "vol=file:/x,send=sendfile".parse().unwrap();
        assert!(
            sent.send_file
                && !ok.send_file
                && !"v=file:/x,send=copy".parse::<ExportConfig>().unwrap().send_file
        );
        let err = "vol=file:/x,send=splice".parse::<ExportConfig>().unwrap_err();
        assert!(err.to_string().contains("expected copy or sendfile"), "{err}");
        assert_eq!(cached.spec, BackendSpec::File { path: "/var/tmp/a,b".into() });
        assert_eq!(ok.block_bytes, None, "the backend's block");
        let bytes: ExportConfig = "pool=ram:1M,block=1".parse().unwrap();
        assert_eq!(bytes.block_bytes, Some(1));
        let synced: ExportConfig = "vol=file:/x,sync,ro".parse().unwrap();
        assert!(synced.sync && synced.read_only && !ok.sync);
        assert_eq!(synced.spec, BackendSpec::File { path: "/x".into() });
        for bad in ["0", "3", "1024", "x", ""] {
            let err = format!("vol=ram:1M,block={bad}").parse::<ExportConfig>().unwrap_err();
            assert!(matches!(err, ExportConfigError::BlockSize { .. }), "block={bad}: {err}");
            assert!(err.to_string().contains("power of two"), "{err}");
        }
        let err = "vol=file:/x,cache=lots".parse::<ExportConfig>().unwrap_err();
        assert!(err.to_string().contains("cache=\"lots\""), "{err}");
        assert!(matches!("ram:1M".parse::<ExportConfig>(), Err(ExportConfigError::MissingEquals(_))));
        assert!(matches!("=ram:1M".parse::<ExportConfig>(), Err(ExportConfigError::BadName(_))));
        let long = format!("{}=ram:1M", "n".repeat(256));
        assert!(matches!(long.parse::<ExportConfig>(), Err(ExportConfigError::BadName(_))));
        let err = "vol=tape:9".parse::<ExportConfig>().unwrap_err();
        assert!(matches!(err, ExportConfigError::Spec { .. }));
        assert!(err.to_string().starts_with("export \"vol\": "), "{err}");
    }

    /// send=sendfile takes a file, reads it through the page cache, and refuses anything
    /// else by name.
    #[test]
    fn only_a_file_export_sends_with_sendfile() {
        let file = tempfile::NamedTempFile::new().unwrap();
        file.as_file().set_len(1 << 20).unwrap();
        let exports = vec![format!("f=file:{},send=sendfile", file.path().display()).parse().unwrap()];
        let table = open_exports(&TargetConfig { exports, ..TargetConfig::default() }).unwrap();
        let (_, f) = table.find("f").unwrap();
        assert!(f.layer::<engine::layer::SendFile>().is_some() && f.backend.file_fd().is_some());
        let exports = vec!["r=ram:1M,send=sendfile".parse().unwrap()];
        let err = open_exports(&TargetConfig { exports, ..TargetConfig::default() }).expect_err("refused");
        assert!(err.to_string().contains("\"r\"") && err.to_string().contains("only a file export"), "{err}");
    }

    /// `,sync` stacks the layer that makes every change durable, on any backend.
    #[test]
    fn a_sync_export_makes_every_change_durable() {
        let exports = vec!["s=ram:1M,sync".parse().unwrap(), "p=ram:1M".parse().unwrap()];
        let table = open_exports(&TargetConfig { exports, ..TargetConfig::default() }).unwrap();
        let write = engine::Io {
            opcode: wire::Opcode::Write,
            flags: wire::ReqFlags::empty(),
            offset: 0,
            length: 512,
        };
        let (_, synced) = table.find("s").unwrap();
        let (_, plain) = table.find("p").unwrap();
        assert!(synced.layer::<engine::layer::SyncWrites>().is_some() && synced.wants_durable(&write));
        assert!(plain.layer::<engine::layer::SyncWrites>().is_none() && !plain.wants_durable(&write));
    }

    /// Retiring a pool's chunks moves their generations at once, and returns only after every
    /// worker pass that was running has ended: a request checked against an old grant in such
    /// a pass may still be writing. Here a pass is held open by hand (the target has no
    /// connections, so its worker is otherwise idle); retirement must not return before it ends.
    #[test]
    fn retiring_chunks_waits_for_the_passes_running_when_it_began() {
        let mut pool: ExportConfig = "pool=ram:4M,block=1".parse().unwrap();
        pool.grants = Some(GrantConfig { key: [3; 32], chunk_bytes: 1 << 20 });
        let config = TargetConfig {
            listen: vec![Endpoint::Tcp("127.0.0.1:0".into())],
            exports: vec![pool],
            workers: 1,
            ..TargetConfig::default()
        };
        let target = Target::start(config).unwrap();
        let served = target.pool("pool").expect("a pool");
        let worker = target.shared.workers[0].clone();
        assert_eq!(worker.pass.load(Ordering::SeqCst) % 2, 0, "idle between passes");
        worker.pass.fetch_add(1, Ordering::SeqCst);
        let ended = Arc::new(AtomicBool::new(false));
        let retiring = {
            let (served, ended) = (served.clone(), ended.clone());
            std::thread::spawn(move || {
                let retired = served.retire(&[1, 3, 9]);
                (retired, ended.load(Ordering::SeqCst))
            })
        };
        while served.grants().generation(3) != Some(1) {
            std::thread::yield_now();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        ended.store(true, Ordering::SeqCst);
        worker.pass.fetch_add(1, Ordering::SeqCst);
        let (retired, after_the_pass) = retiring.join().unwrap();
        assert!(after_the_pass, "retirement returned while a pass that began before it ran");
        assert_eq!(retired, [(1, 1), (3, 1)], "chunk 9 is past the 4-chunk pool");
        // With no pass running it returns at once.
        assert_eq!(served.retire(&[1]), [(1, 2)]);
        target.shutdown();
    }

    /// Locking a region for a repair copy and raising a chunk's epoch fence the same way: the
    /// state changes at once, and the call returns only after the pass running when it began
    /// has ended. A raise that would go down, or to another generation, is refused clearly.
    #[test]
    fn locking_and_raising_wait_for_the_passes_running_when_they_began() {
        let mut pool: ExportConfig = "pool=ram:4M,block=1".parse().unwrap();
        pool.grants = Some(GrantConfig { key: [3; 32], chunk_bytes: 1 << 20 });
        let config = TargetConfig {
            listen: vec![Endpoint::Tcp("127.0.0.1:0".into())],
            exports: vec![pool],
            workers: 1,
            ..TargetConfig::default()
        };
        let target = Target::start(config).unwrap();
        let served = target.pool("pool").expect("a pool");
        let worker = target.shared.workers[0].clone();
        let key = proto::capability::CapKey::new([3; 32]);
        let rw = wire::CapRights::READ.union(wire::CapRights::WRITE);
        let bound = served.grants().admit(&proto::grant::seal(&key, 2, 1 << 20, 0, rw)).unwrap();
        for step in ["lock", "raise"] {
            worker.pass.fetch_add(1, Ordering::SeqCst);
            let ended = Arc::new(AtomicBool::new(false));
            let call = {
                let (served, ended) = (served.clone(), ended.clone());
                std::thread::spawn(move || {
                    let raised = match step {
                        "lock" => {
                            served.lock(2, 0b100);
                            Ok(())
                        }
                        _ => served.raise(2, 0, 5),
                    };
                    (raised, ended.load(Ordering::SeqCst))
                })
            };
            let changed = || match step {
                "lock" => {
                    served.grants().check(wire::Opcode::Write, Some(&bound), (2 << 20) + 2 * 16384, 1)
                        == Err(wire::Status::Busy)
                }
                _ => served.grants().version(2) == Some((0, 5)),
            };
            while !changed() {
                std::thread::yield_now();
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            ended.store(true, Ordering::SeqCst);
            worker.pass.fetch_add(1, Ordering::SeqCst);
            let (raised, after_the_pass) = call.join().unwrap();
            assert_eq!(raised, Ok(()));
            assert!(after_the_pass, "{step} returned while a pass that began before it ran");
        }
        served.unlock(2, 0b100);
        let err = served.raise(2, 0, 4).unwrap_err();
        assert!(err.contains("epoch 5") && err.contains("not raised"), "{err}");
        assert!(served.raise(2, 1, 9).is_err(), "another generation");
        assert!(served.raise(7, 0, 1).unwrap_err().contains("past the pool"));
        target.shutdown();
    }
}
