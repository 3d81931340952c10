//! `skiff attach`: an export as one regular file through FUSE, for a loop device to turn into
//! a block device.
//!
//! The kernel has no nbd or ublk driver here, so the way to a local disk is a FUSE file and
//! `losetup --direct-io=on` over it (docs/ATTACH.md). The kernel hands FUSE requests to many
//! threads, one request each. What owns what:
//!
//! - fuser's threads (`--threads`) each read their own clone of the FUSE device and own a
//!   [`Worker`]. For the common request (an aligned read or write of at most the largest I/O,
//!   and a flush) a worker queues it, with its buffer and fuser's reply object, for an I/O
//!   thread and goes back to the kernel for the next one: it never waits for the network.
//! - One I/O thread per lane (`--lanes`, default one per core) owns its `initiator::Lane`. It
//!   takes everything queued for it into one caravan, sends it, and answers the kernel from
//!   the completions; it sleeps on the lane's socket and its queue's eventfd at once.
//! - The [`Volume`] owns the I/O threads, their queues and buffer pools (made at start-up), and
//!   what writes share: the write gate (aligned writes shared until their completion,
//!   read-modify-writes exclusive) and the flush counters.
//!
//! - [`Attachment::mount`] checks FUSE and the mount point, asks the target for the export,
//!   connects the lanes and starts their I/O threads, mounts, and serves in background threads.
//! - [`Unmounter::unmount`] ends it cleanly: a plain `umount`, which fails with
//!   [`Error::InUse`] while a loop device, a mount or an open file still uses the file; the
//!   session keeps serving them.
//! - [`Attachment::wait`] returns once the file system is unmounted, by us or by anyone.
//!
//! The layers: `mountpoint` checks before mounting, `volume` turns byte ranges into block
//! requests (no FUSE in it), `io` runs the I/O threads, `gate` is the write gate, `fs` answers
//! the kernel's FUSE requests through the volume. The lanes reconnect to a restarted target on
//! their own (`LaneConfig::reconnect`).

mod fs;
mod gate;
pub mod io;
pub mod mountpoint;
pub mod volume;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use initiator::{Batching, Client, Doorbell, Endpoint, LaneConfig, LaneStats};

pub use io::Reply;
pub use mountpoint::{Layout, MountPoint};
pub use volume::{Chunk, IoError, Volume, VolumeConfig, Worker};

/// Largest FUSE read or write asked of the kernel: what FUSE allows by default
/// (`fs.fuse.max_pages_limit`, 256 pages), and the target's limit if that is lower.
pub const FUSE_IO_BYTES_MAX: u32 = 1 << 20;
/// FUSE threads by default. A thread only reads a request, queues it and reads the next, so
/// one keeps up with a loop device's requests; every other one adds wake-ups (the kernel wakes
/// an idle thread for each request rather than let a busy one come back for it), measured as
/// fewer IOPS at more CPU per request (docs/ATTACH.md). More threads help only a file that sees
/// much misaligned I/O or zeroing, whose requests wait for the network on the thread that took
/// them.
pub const THREADS_DEFAULT: usize = 1;
/// Requests the kernel may have in flight in the background by default (FUSE's
/// `max_background`): enough for 4 jobs × queue depth 8 through a loop device.
pub const IN_FLIGHT_DEFAULT: usize = 32;

/// The lanes' doorbell for `skiff attach`: a caravan is whatever an I/O thread found queued
/// (up to the negotiated caravan limits), sent as soon as it has taken it; nothing is held
/// back waiting for more.
pub const DRAIN_DOORBELL: Doorbell =
    Doorbell { aggregation_reqs: u32::MAX, aggregation_bytes: u32::MAX, delay_us: 1 };

/// What to attach, where, and how.
#[derive(Debug, Clone)]
pub struct AttachConfig {
    pub endpoint: Endpoint,
    pub export: String,
    /// A directory (the export appears in it as a file named after the export) or a regular
    /// file (the export is mounted over it).
    pub mountpoint: PathBuf,
    /// Every lane's configuration.
    pub lane: LaneConfig,
    /// Lanes, each with its I/O thread (0: one per core).
    pub lanes: usize,
    /// FUSE threads.
    pub threads: usize,
    /// Requests the kernel may have in flight in the background (`max_background`); with the
    /// threads, it sizes the buffer pools.
    pub in_flight: usize,
    /// Refuse writes even when the export takes them.
    pub read_only: bool,
    /// Run the FUSE and I/O threads under `SCHED_BATCH`: woken while something else runs on
    /// their CPU (the process submitting I/O), they wait for it to sleep or for the next tick
    /// instead of preempting it, and find the requests it queued meanwhile; on a busy CPU this
    /// turns one wake-up per request into one per batch (docs/ATTACH.md). Off, a request is
    /// picked up at once even when the CPU is busy with something else.
    pub sched_batch: bool,
}

impl AttachConfig {
    /// The defaults: caravans of what is queued ([`DRAIN_DOORBELL`]), one lane per core,
    /// [`THREADS_DEFAULT`] threads, [`IN_FLIGHT_DEFAULT`] requests in flight.
    pub fn new(endpoint: Endpoint, export: &str, mountpoint: impl Into<PathBuf>) -> AttachConfig {
        AttachConfig {
            endpoint,
            export: export.to_owned(),
            mountpoint: mountpoint.into(),
            lane: LaneConfig {
                batching: Batching::Static,
                doorbell: DRAIN_DOORBELL,
                ..LaneConfig::default()
            },
            lanes: 0,
            threads: THREADS_DEFAULT,
            in_flight: IN_FLIGHT_DEFAULT,
            read_only: false,
            sched_batch: true,
        }
    }
}

/// Why attaching or detaching failed, each with what a user can act on.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("FUSE is not available: {0}")]
    FuseMissing(String),
    #[error("mount point {path}: {why}")]
    MountPoint { path: PathBuf, why: String },
    #[error("{0} is already a mount point: unmount what is there, or choose another place")]
    AlreadyMounted(PathBuf),
    #[error(
        "{0} is busy: something still uses it (a loop device, a mount on it, an open file); \
         detach those first (umount, losetup -d), then stop again"
    )]
    InUse(PathBuf),
    #[error("target {endpoint}: {source}")]
    Target { endpoint: String, source: initiator::Error },
    #[error("target {endpoint} has no export {name:?} (it offers: {offered})")]
    NoSuchExport { endpoint: String, name: String, offered: String },
    #[error("mounting {path}: {source}")]
    Mount { path: PathBuf, source: std::io::Error },
    #[error("unmounting {path}: {source}")]
    Unmount { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Volume(#[from] IoError),
    #[error("FUSE session: {0}")]
    Session(std::io::Error),
}

/// A mounted export, served by background threads until it is unmounted.
pub struct Attachment {
    mount_point: MountPoint,
    volume: Arc<Volume<fs::FuseReply>>,
    unmounter: Unmounter,
    session: Option<JoinHandle<std::io::Result<()>>>,
}

impl Attachment {
    /// Check, connect, mount, and start serving. Signals that should reach the caller's
    /// handler only must be blocked before this call: the threads it starts inherit the mask.
    pub fn mount(config: &AttachConfig) -> Result<Attachment, Error> {
        mountpoint::check_fuse()?;
        let mount_point = mountpoint::inspect(&config.mountpoint, &config.export)?;
        let io_bytes_max = find_export(config)?;
        let target_error = |source| Error::Target { endpoint: config.endpoint.to_string(), source };
        let threads = config.threads.max(1);
        let in_flight = config.in_flight.max(1);
        let lanes = volume::lane_count(config.lanes);
        let volume_config = VolumeConfig {
            lane: config.lane.clone(),
            lanes,
            io_bytes_max: io_bytes_max.min(FUSE_IO_BYTES_MAX),
            read_only: config.read_only,
            buffers_per_lane: buffers_per_lane(in_flight, threads, lanes),
            sched_batch: config.sched_batch,
        };
        let volume = Arc::new(Volume::connect(&config.endpoint, &config.export, &volume_config).map_err(
            |e| match e {
                IoError::Lane(source) => target_error(source),
                other => Error::Volume(other),
            },
        )?);
        let fs = fs::ExportFs::new(volume.clone(), &mount_point, in_flight, config.sched_batch);
        let mut session = fuser::Session::new(fs, &mount_point.path, &fuse_config(config, &volume, threads))
            .map_err(|source| Error::Mount { path: mount_point.path.clone(), source })?;
        let finished = Arc::new(AtomicBool::new(false));
        let unmounter = Unmounter {
            path: mount_point.path.clone(),
            finished: finished.clone(),
            fuser: Arc::new(Mutex::new(Some(session.unmount_callable()))),
        };
        let serving = volume.clone();
        let session = std::thread::Builder::new()
            .name("skiff-attach".into())
            .spawn(move || {
                let ended = session.run();
                // Every FUSE thread has ended: nothing more comes, nobody waits.
                serving.stop();
                finished.store(true, Ordering::Release);
                ended
            })
            .map_err(Error::Session)?;
        tracing::info!(
            export = %config.export,
            file = %mount_point.file().display(),
            size_bytes = volume.size_bytes(),
            lanes = volume.lanes(),
            threads,
            in_flight,
            "attached"
        );
        Ok(Attachment { mount_point, volume, unmounter, session: Some(session) })
    }

    /// The export's file.
    pub fn file(&self) -> PathBuf {
        self.mount_point.file()
    }

    /// Where the file system is mounted (canonical).
    pub fn mount_point(&self) -> &Path {
        &self.mount_point.path
    }

    /// Every lane's counters, summed.
    pub fn lane_stats(&self) -> LaneStats {
        self.volume.stats()
    }

    /// How often a FUSE thread had to wait for a request buffer or for queue room (the pools
    /// are sized so that this stays zero under the configured load).
    pub fn stalls(&self) -> u64 {
        self.volume.stalls()
    }

    /// Something that can unmount from another thread (a signal handler's).
    pub fn unmounter(&self) -> Unmounter {
        self.unmounter.clone()
    }

    /// Unmount (failing with [`Error::InUse`] while anything uses the file) and wait for the
    /// session to end; returns what the lanes did.
    pub fn unmount(mut self) -> Result<LaneStats, Error> {
        self.unmounter.unmount()?;
        self.join()?;
        Ok(self.lane_stats())
    }

    /// Wait until the file system is unmounted, by [`Unmounter::unmount`] or by anyone; returns
    /// what the lanes did.
    pub fn wait(mut self) -> Result<LaneStats, Error> {
        self.join()?;
        Ok(self.lane_stats())
    }

    fn join(&mut self) -> Result<(), Error> {
        let Some(session) = self.session.take() else { return Ok(()) };
        let ended =
            session.join().map_err(|_| Error::Session(std::io::Error::other("FUSE session panicked")))?;
        ended.map_err(Error::Session)
    }
}

impl Drop for Attachment {
    /// Never leave a mount behind: unmount, or when something still uses the file, detach it
    /// lazily (the kernel ends it when the last user lets go, and the session serves until then).
    fn drop(&mut self) {
        if self.session.is_none() {
            return;
        }
        match self.unmounter.unmount() {
            Ok(()) => {
                let _ = self.join();
            }
            Err(e) => {
                tracing::warn!("{e}; detaching it lazily");
                let _ = rt::fs::unmount_lazily(&self.mount_point.path);
            }
        }
    }
}

/// Unmounts an [`Attachment`] from any thread.
#[derive(Clone)]
pub struct Unmounter {
    path: PathBuf,
    finished: Arc<AtomicBool>,
    /// fuser's own unmount, used for the first attempt: it knows how the mount was made
    /// (`mount(2)` as root, fusermount3 otherwise), and once it has run, fuser does not try
    /// again when the session ends. It is spent by that attempt, successful or not.
    fuser: Arc<Mutex<Option<fuser::SessionUnmounter>>>,
}

impl Unmounter {
    /// A plain unmount, never lazy. [`Error::InUse`] while anything uses the file system: the
    /// session goes on serving, and the caller may try again later.
    pub fn unmount(&self) -> Result<(), Error> {
        if self.finished.load(Ordering::Acquire) {
            return Ok(());
        }
        let first = self.fuser.lock().unwrap_or_else(|p| p.into_inner()).take();
        let result = match first {
            Some(mut fuser) => fuser.unmount(),
            None => match rt::fs::unmount(&self.path) {
                // Not root: the setuid helper may unmount what the user mounted.
                Err(e) if e.raw_os_error() == Some(libc::EPERM) => return self.fusermount_unmount(),
                other => other,
            },
        };
        match result {
            Ok(()) => Ok(()),
            Err(e) => match e.raw_os_error() {
                Some(libc::EBUSY) => Err(Error::InUse(self.path.clone())),
                // Not a mount point any more: someone unmounted it already.
                Some(libc::EINVAL) => Ok(()),
                _ => Err(Error::Unmount { path: self.path.clone(), source: e }),
            },
        }
    }

    fn fusermount_unmount(&self) -> Result<(), Error> {
        let out = std::process::Command::new("fusermount3")
            .arg("-u")
            .arg("--")
            .arg(&self.path)
            .output()
            .map_err(|source| Error::Unmount { path: self.path.clone(), source })?;
        if out.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("busy") {
            return Err(Error::InUse(self.path.clone()));
        }
        Err(Error::Unmount {
            path: self.path.clone(),
            source: std::io::Error::other(stderr.trim().to_owned()),
        })
    }
}

/// Said once per process when a thread cannot become an I/O flusher, and when it cannot be
/// put under `SCHED_BATCH`.
static FLUSHER_WARNED: AtomicBool = AtomicBool::new(false);
static BATCH_WARNED: AtomicBool = AtomicBool::new(false);

/// Ready the calling thread (a FUSE thread on its first request, an I/O thread as it starts)
/// to serve block I/O. It must not wait, when it allocates, for the writeback it is there to
/// do (docs/ATTACH.md): the kernel's answer is `PR_SET_IO_FLUSHER`. With `sched_batch`, it is
/// put under `SCHED_BATCH` ([`AttachConfig::sched_batch`]).
pub(crate) fn prepare_io_thread(sched_batch: bool) {
    if let Err(e) = rt::task::set_io_flusher() {
        if !FLUSHER_WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "the FUSE and I/O threads are not I/O flushers ({e}; needs CAP_SYS_RESOURCE and Linux \
                 5.6): a loop device over this file may stall under memory pressure"
            );
        }
    }
    if sched_batch {
        if let Err(e) = rt::task::set_batch_scheduling() {
            if !BATCH_WARNED.swap(true, Ordering::Relaxed) {
                tracing::info!("threads stay under the normal scheduling policy: SCHED_BATCH: {e}");
            }
        }
    }
}

/// Buffers for each lane's pool, so that no FUSE thread waits for one: every request in
/// flight may be on one lane, each of its threads holds a spare, and the buffers of as many
/// requests again may be answered and not yet back in the pool (the I/O thread returns them
/// after replying to a whole batch). Each is the largest I/O, but only the pages a request
/// touches are ever allocated, and the pool is used last in, first out.
fn buffers_per_lane(in_flight: usize, threads: usize, lanes: usize) -> usize {
    2 * in_flight + threads.div_ceil(lanes)
}

/// Ask the target, on a control connection, for the export; returns the largest I/O the
/// target takes. A missing export gets the list of those there are.
fn find_export(config: &AttachConfig) -> Result<u32, Error> {
    let endpoint = config.endpoint.to_string();
    let target_error = |source| Error::Target { endpoint: endpoint.clone(), source };
    let mut client = Client::connect(&config.endpoint).map_err(target_error)?;
    let exports = client.list().map_err(target_error)?;
    if !exports.iter().any(|e| e.name == config.export) {
        let names: Vec<String> = exports.iter().map(|e| format!("{:?}", e.name)).collect();
        let offered = if names.is_empty() { "none".into() } else { names.join(", ") };
        return Err(Error::NoSuchExport { endpoint, name: config.export.clone(), offered });
    }
    Ok(client.limits().io_bytes_max)
}

/// The mount options: a name that says what is mounted, permission checks by the kernel from
/// the file's mode, reads no larger than a request can be, and as many threads as configured,
/// each with its own clone of the FUSE device.
fn fuse_config(config: &AttachConfig, volume: &Volume<fs::FuseReply>, threads: usize) -> fuser::Config {
    use fuser::MountOption;
    let mut options = vec![
        MountOption::FSName(format!("skiff:{}", config.export)),
        MountOption::Subtype("skiff".into()),
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
        MountOption::CUSTOM(format!("max_read={}", volume.io_bytes_max())),
    ];
    if volume.is_read_only() {
        options.push(MountOption::RO);
    }
    let mut fuse = fuser::Config::default();
    fuse.mount_options = options;
    fuse.n_threads = Some(threads);
    fuse.clone_fd = true;
    fuse
}
