//! The FUSE side: the kernel's requests on the export's file, answered through the volume.
//!
//! The file system holds one regular file (and, for a directory mount, the directory around
//! it). Its size is the export's and never changes. Every open is `FOPEN_DIRECT_IO`: the kernel
//! keeps no page cache for the file, so nothing written to it is ever dirty in memory waiting
//! for this daemon to write it back, which is half of what keeps a loop device over it out of
//! the memory-reclaim deadlock (docs/ATTACH.md). Direct writes may run in parallel
//! (`FOPEN_PARALLEL_DIRECT_WRITES`) and asynchronous direct I/O, which a loop device issues,
//! stays asynchronous (`FUSE_ASYNC_DIO`): many requests reach the daemon at once, which is
//! what lets the I/O threads batch them.
//!
//! fuser calls these methods from several threads; each thread finds its own [`Worker`] in a
//! thread-local, made on its first request, so requests take no lock here and reuse their
//! buffers. Reads, writes and flushes hand fuser's reply object to the volume with the
//! request ([`FuseReply`]) and return at once: the I/O thread answers the kernel when the
//! target has (the common path), or the worker does before returning (the rare ones).
//! Everything else is answered here.

use std::cell::RefCell;
use std::ffi::OsStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, WriteFlags,
};

use crate::io::Reply;
use crate::mountpoint::{Layout, MountPoint};
use crate::volume::{Volume, Worker};

/// How long the kernel may cache names and attributes: nothing here ever changes.
const TTL: Duration = Duration::from_secs(3600);
/// The export's inode in a directory mount (the directory is the root, 1).
const FILE_IN_DIRECTORY: INodeNo = INodeNo(2);

thread_local! {
    static WORKER: RefCell<Option<Worker<FuseReply>>> = const { RefCell::new(None) };
}

/// fuser's reply object for a read, a write or a flush, answered by whichever thread has the
/// outcome. Each is made for its kind of request, so a mismatch is a bug here; it gets EIO.
pub(crate) enum FuseReply {
    Data(ReplyData),
    Written(ReplyWrite),
    Empty(ReplyEmpty),
}

impl Reply for FuseReply {
    fn data(self, bytes: &[u8]) {
        match self {
            FuseReply::Data(r) => r.data(bytes),
            other => other.mismatch(),
        }
    }

    fn written(self, bytes: usize) {
        match self {
            FuseReply::Written(r) => r.written(bytes as u32),
            other => other.mismatch(),
        }
    }

    fn ok(self) {
        match self {
            FuseReply::Empty(r) => r.ok(),
            other => other.mismatch(),
        }
    }

    fn error(self, errno: i32) {
        let e = Errno::from_i32(errno);
        match self {
            FuseReply::Data(r) => r.error(e),
            FuseReply::Written(r) => r.error(e),
            FuseReply::Empty(r) => r.error(e),
        }
    }
}

impl FuseReply {
    fn mismatch(self) {
        debug_assert!(false, "a reply of the wrong kind");
        self.error(libc::EIO)
    }
}

pub(crate) struct ExportFs {
    volume: Arc<Volume<FuseReply>>,
    layout: Layout,
    file_ino: INodeNo,
    uid: u32,
    gid: u32,
    since: SystemTime,
    /// Requests the kernel may have outstanding in the background (`max_background`).
    background_max: u16,
    /// FUSE threads run under `SCHED_BATCH` ([`crate::AttachConfig::sched_batch`]).
    sched_batch: bool,
}

impl ExportFs {
    pub(crate) fn new(
        volume: Arc<Volume<FuseReply>>,
        mount_point: &MountPoint,
        background_max: usize,
        sched_batch: bool,
    ) -> ExportFs {
        let file_ino = match mount_point.layout {
            Layout::Directory { .. } => FILE_IN_DIRECTORY,
            Layout::File => INodeNo::ROOT,
        };
        ExportFs {
            volume,
            layout: mount_point.layout.clone(),
            file_ino,
            uid: mount_point.uid,
            gid: mount_point.gid,
            since: SystemTime::now(),
            background_max: background_max.clamp(1, usize::from(u16::MAX)) as u16,
            sched_batch,
        }
    }

    fn file_attr(&self) -> FileAttr {
        let size = self.volume.size_bytes();
        FileAttr {
            ino: self.file_ino,
            size,
            blocks: size.div_ceil(512),
            kind: FileType::RegularFile,
            perm: if self.volume.is_read_only() { 0o444 } else { 0o644 },
            nlink: 1,
            blksize: self.volume.block_bytes().max(4096) as u32,
            ..self.attr_common()
        }
    }

    fn dir_attr(&self) -> FileAttr {
        FileAttr {
            ino: INodeNo::ROOT,
            kind: FileType::Directory,
            perm: 0o755,
            nlink: 2,
            ..self.attr_common()
        }
    }

    fn attr_common(&self) -> FileAttr {
        FileAttr {
            ino: INodeNo::ROOT,
            size: 0,
            blocks: 0,
            atime: self.since,
            mtime: self.since,
            ctime: self.since,
            crtime: self.since,
            kind: FileType::Directory,
            perm: 0,
            nlink: 1,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn attr_of(&self, ino: INodeNo) -> Option<FileAttr> {
        if ino == self.file_ino {
            Some(self.file_attr())
        } else if ino == INodeNo::ROOT {
            Some(self.dir_attr())
        } else {
            None
        }
    }

    /// Run `f` with this thread's worker, making it on the thread's first request.
    fn with_worker<T>(&self, f: impl FnOnce(&mut Worker<FuseReply>, &Volume<FuseReply>) -> T) -> T {
        WORKER.with(|cell| {
            let mut slot = cell.borrow_mut();
            let worker = match &mut *slot {
                Some(w) if w.serves(&self.volume) => w,
                stale => {
                    crate::prepare_io_thread(self.sched_batch);
                    stale.insert(self.volume.worker())
                }
            };
            f(worker, &self.volume)
        })
    }

    /// An operation on anything but the export's file.
    fn not_the_file(&self, ino: INodeNo) -> Option<Errno> {
        match ino {
            i if i == self.file_ino => None,
            INodeNo::ROOT => Some(Errno::EISDIR),
            _ => Some(Errno::ENOENT),
        }
    }
}

impl Filesystem for ExportFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if config.add_capabilities(InitFlags::FUSE_ASYNC_DIO).is_err() {
            tracing::info!("the kernel has no asynchronous direct I/O for FUSE: a loop device sends one request at a time");
        }
        let io_max = self.volume.io_bytes_max() as u32;
        if let Err(nearest) = config.set_max_write(io_max) {
            let _ = config.set_max_write(nearest);
        }
        let _ = config.set_max_background(self.background_max);
        let _ = config.set_congestion_threshold((u32::from(self.background_max) * 3 / 4).max(1) as u16);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match &self.layout {
            Layout::Directory { file_name } if parent == INodeNo::ROOT && name == file_name.as_os_str() => {
                reply.entry(&TTL, &self.file_attr(), Generation(0))
            }
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr_of(ino) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    /// The size is the export's: truncating or growing is refused, as are owner and mode
    /// changes; setting times is accepted and forgotten (there is nowhere to keep them).
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let Some(attr) = self.attr_of(ino) else { return reply.error(Errno::ENOENT) };
        let resized = size.is_some_and(|s| s != attr.size);
        if resized || mode.is_some() || uid.is_some() || gid.is_some() {
            return reply.error(Errno::EPERM);
        }
        reply.attr(&TTL, &attr)
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if let Some(e) = self.not_the_file(ino) {
            return reply.error(e);
        }
        if self.volume.is_read_only() && flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES)
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if let Some(e) = self.not_the_file(ino) {
            return reply.error(e);
        }
        self.with_worker(|w, vol| w.handle_read(vol, offset, size as usize, FuseReply::Data(reply)))
    }

    /// `O_DSYNC` or `O_SYNC` on the file (or `RWF_DSYNC` on the write) makes the write FUA:
    /// durable before it is acknowledged. `O_DIRECT` asks for nothing more than every open
    /// already gets: no page cache.
    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if let Some(e) = self.not_the_file(ino) {
            return reply.error(e);
        }
        let fua = flags.0 & libc::O_DSYNC != 0;
        self.with_worker(|w, vol| w.handle_write(vol, offset, data, fua, FuseReply::Written(reply)))
    }

    /// `close`: the export's FLUSH, so that what was written through a descriptor is durable
    /// once it is closed.
    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        self.sync(ino, reply)
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        self.sync(ino, reply)
    }

    /// Punching a hole or zeroing a range (what a loop device does for discard and
    /// write-zeroes) promises zeroes on read, which the protocol's TRIM does not: both go as
    /// WRITE_ZEROES. Allocating is a no-op within the export and refused beyond it.
    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if let Some(e) = self.not_the_file(ino) {
            return reply.error(e);
        }
        let beyond = offset.saturating_add(length) > self.volume.size_bytes();
        let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let result = match mode & !libc::FALLOC_FL_KEEP_SIZE {
            0 if beyond && !keep_size => Err(Errno::EFBIG),
            0 => Ok(()),
            libc::FALLOC_FL_PUNCH_HOLE if !keep_size => Err(Errno::EINVAL),
            libc::FALLOC_FL_ZERO_RANGE if beyond && !keep_size => Err(Errno::EFBIG),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE => {
                self.with_worker(|w, vol| w.zero(vol, offset, length)).map_err(|e| Errno::from_i32(e.errno()))
            }
            _ => Err(Errno::EOPNOTSUPP),
        };
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // The block size is what a loop device takes as its discard granularity.
        let bsize = self.volume.block_bytes() as u32;
        let blocks = self.volume.size_bytes() / u64::from(bsize);
        reply.statfs(blocks, 0, 0, 1, 0, bsize, 255, bsize)
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let Layout::Directory { file_name } = &self.layout else { return reply.error(Errno::ENOTDIR) };
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries: [(INodeNo, FileType, &OsStr); 3] = [
            (INodeNo::ROOT, FileType::Directory, OsStr::new(".")),
            (INodeNo::ROOT, FileType::Directory, OsStr::new("..")),
            (self.file_ino, FileType::RegularFile, file_name.as_os_str()),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, i as u64 + 1, *kind, name) {
                break;
            }
        }
        reply.ok()
    }

    // Nothing can be created, removed or renamed: one file, fixed.
    fn mknod(&self, _: &Request, _: INodeNo, _: &OsStr, _: u32, _: u32, _: u32, reply: ReplyEntry) {
        reply.error(Errno::EPERM)
    }

    fn mkdir(&self, _: &Request, _: INodeNo, _: &OsStr, _: u32, _: u32, reply: ReplyEntry) {
        reply.error(Errno::EPERM)
    }

    fn create(&self, _: &Request, _: INodeNo, _: &OsStr, _: u32, _: u32, _: i32, reply: fuser::ReplyCreate) {
        reply.error(Errno::EPERM)
    }

    fn unlink(&self, _: &Request, _: INodeNo, _: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EPERM)
    }

    fn rmdir(&self, _: &Request, _: INodeNo, _: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EPERM)
    }

    fn rename(
        &self,
        _: &Request,
        _: INodeNo,
        _: &OsStr,
        _: INodeNo,
        _: &OsStr,
        _: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EPERM)
    }

    // No extended attributes and no SEEK_DATA: the kernel remembers ENOSYS and stops asking,
    // without fuser's "not implemented" warning on every first call.
    fn getxattr(&self, _: &Request, _: INodeNo, _: &OsStr, _: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::ENOSYS)
    }

    fn listxattr(&self, _: &Request, _: INodeNo, _: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::ENOSYS)
    }

    fn lseek(&self, _: &Request, _: INodeNo, _: FileHandle, _: i64, _: i32, reply: fuser::ReplyLseek) {
        reply.error(Errno::ENOSYS)
    }
}

impl ExportFs {
    fn sync(&self, ino: INodeNo, reply: ReplyEmpty) {
        if let Some(e) = self.not_the_file(ino) {
            return reply.error(e);
        }
        self.with_worker(|w, vol| w.handle_flush(vol, FuseReply::Empty(reply)))
    }
}
