//! A flash volume as a skiff export's backend: the native and NBD front ends, `skiff attach`
//! and the engine reach it through `backend::Backend`, like a RAM or file volume.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use backend::{push_extent, Backend, BackendError, Batch, Capabilities, Extent, Result, BLOCK_BYTES};

use crate::ctl::VolId;
use crate::engine::Array;
use crate::layout::PAGE;
use crate::FlashError;

/// One volume of an open array.
pub struct FlashVolume {
    array: Arc<Array>,
    vol: VolId,
    size: Arc<AtomicU64>,
    writable: bool,
}

impl FlashVolume {
    pub fn open(array: Arc<Array>, name: &str) -> std::result::Result<FlashVolume, FlashError> {
        let vol = array.id_of(name)?;
        let size = array.size_handle(vol)?;
        let writable = array.is_writable(vol);
        Ok(FlashVolume { array, vol, size, writable })
    }

    pub fn array(&self) -> &Arc<Array> {
        &self.array
    }

    /// The volume's id: never given to another volume of the array.
    pub fn id(&self) -> VolId {
        self.vol
    }
}

/// The errno a flash error reaches the front ends as.
fn io_error(e: FlashError) -> BackendError {
    let errno = match e {
        FlashError::NoSpace => libc::ENOSPC,
        FlashError::OutOfRange | FlashError::BadSize(_) | FlashError::BadName(_) => libc::EINVAL,
        FlashError::ReadOnly => libc::EROFS,
        FlashError::NoSuchVolume => libc::ENOENT,
        FlashError::Busy(_) => libc::EBUSY,
        _ => libc::EIO,
    };
    BackendError::Io(io::Error::from_raw_os_error(errno))
}

impl Backend for FlashVolume {
    fn kind(&self) -> &'static str {
        "flash"
    }

    fn size_bytes(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn block_size(&self) -> u32 {
        BLOCK_BYTES
    }

    fn is_read_only(&self) -> bool {
        !self.writable
    }

    /// Trim and write-zeroes unmap whole pages, which is as fast as it gets.
    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.array.read(self.vol, offset, buf).map_err(io_error)
    }

    /// Pages in the pool are lent, kept there until the sender lets go, and sent from there
    /// (`Array::lend`).
    fn lend(&self, offset: u64, len: usize, out: &mut Vec<backend::RegionBytes>) -> Result<bool> {
        self.array.lend(self.vol, offset, len, out).map_err(io_error)
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.array.write(self.vol, offset, buf, fua).map_err(io_error)
    }

    fn flush(&self) -> Result<()> {
        self.array.flush().map_err(io_error)
    }

    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.array.zero(self.vol, offset, len, false).map_err(io_error)
    }

    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.array.zero(self.vol, offset, len, fua).map_err(io_error)
    }

    /// Pool misses start reading on the array's io_uring (`Array::prefetch`).
    fn prepare(&self, offset: u64, len: u64, write: bool, batch: &Arc<Batch>) {
        self.array.prefetch(self.vol, offset, len, write, batch);
    }

    fn may_wait(&self) -> bool {
        self.array.reads_async()
    }

    fn syncs_later(&self) -> bool {
        self.array.syncs_later()
    }

    /// The volume's dirty pages and waiting records, by the array's syncer thread: a FUA
    /// write asks no more, and a FLUSH on this export asks only for the writes made through
    /// it.
    fn sync_later(&self, batch: &Arc<Batch>) {
        self.array.sync_later(Some(self.vol), batch);
    }

    /// Pages never written (or unmapped) are holes that read as zeroes.
    fn extents(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        let page = PAGE as u64;
        let end = offset + len;
        let first = offset / page;
        let pages = end.div_ceil(page) - first;
        let data = self.array.allocation(self.vol, first, pages).map_err(io_error)?;
        for (i, &d) in data.iter().enumerate() {
            let start = ((first + i as u64) * page).max(offset);
            let stop = ((first + i as u64 + 1) * page).min(end);
            push_extent(out, Extent { len_bytes: stop - start, hole: !d, zero: !d });
        }
        Ok(())
    }
}
