//! The RAM backend: a volume held in one page-aligned anonymous mapping.
//!
//! Workers copy straight in and out of an [`rt::mem::Region`] with no lock; overlapping
//! in-flight requests give unspecified bytes, as on any block device (see [`rt::mem`]). The
//! contents vanish with the process, so flush and FUA have nothing to wait for: memory is as
//! durable as this backend gets. This module owns no unsafe code; the region does.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use rt::mem::Region;

use crate::spec::{check_range, read_only_error, BLOCK_BYTES};
use crate::{push_extent, Backend, BackendError, Capabilities, Extent, RegionBytes, Result};

/// Granularity of allocation tracking: the page size the kernel commits memory in.
const PAGE_BYTES: u64 = 4096;

/// A volume in anonymous memory, zero-filled at creation.
#[derive(Debug)]
pub struct RamBackend {
    region: Arc<Region>,
    size_bytes: u64,
    read_only: bool,
    /// One bit per page: set once the page has been written, cleared when a trim or
    /// write-zeroes covers it whole. Unset pages read as zeroes and hold no data.
    written: Vec<AtomicU64>,
}

impl RamBackend {
    /// Map a zero-filled volume of `size_bytes`, which must be a multiple of the 512-byte
    /// block. Pages are committed lazily, as they are first written.
    pub fn new(size_bytes: u64, read_only: bool) -> Result<Self> {
        if !size_bytes.is_multiple_of(u64::from(BLOCK_BYTES)) {
            return Err(invalid_size(size_bytes, "is not a multiple of the 512-byte block"));
        }
        let len_bytes = usize::try_from(size_bytes)
            .map_err(|_| invalid_size(size_bytes, "does not fit in this address space"))?;
        let pages = size_bytes.div_ceil(PAGE_BYTES);
        let written = (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        Ok(RamBackend { region: Arc::new(Region::new(len_bytes)?), size_bytes, read_only, written })
    }

    fn is_written(&self, page: u64) -> bool {
        self.written[(page / 64) as usize].load(Relaxed) & (1 << (page % 64)) != 0
    }

    /// Mark every page the range touches as written. A load first: the common case (a page
    /// written before) costs no locked instruction.
    fn mark_written(&self, offset: u64, len_bytes: u64) {
        for page in offset / PAGE_BYTES..(offset + len_bytes).div_ceil(PAGE_BYTES) {
            let (word, bit) = (&self.written[(page / 64) as usize], 1u64 << (page % 64));
            if word.load(Relaxed) & bit == 0 {
                word.fetch_or(bit, Relaxed);
            }
        }
    }

    /// Forget pages the range covers whole: they now read as zeroes.
    fn mark_zeroed(&self, offset: u64, len_bytes: u64) {
        for page in offset.div_ceil(PAGE_BYTES)..(offset + len_bytes) / PAGE_BYTES {
            self.written[(page / 64) as usize].fetch_and(!(1u64 << (page % 64)), Relaxed);
        }
    }

    /// Check a request's range and convert its offset to an index into the region. After
    /// `check_range`, offset and end are at most `size_bytes`, which fits in `usize`.
    fn region_offset(&self, offset: u64, len_bytes: usize) -> Result<usize> {
        check_range(self.size_bytes, offset, len_bytes as u64)?;
        Ok(offset as usize)
    }

    /// Like `region_offset` for ranges given as `u64` lengths (trim, write-zeroes).
    fn region_range(&self, offset: u64, len_bytes: u64) -> Result<(usize, usize)> {
        check_range(self.size_bytes, offset, len_bytes)?;
        Ok((offset as usize, len_bytes as usize))
    }

    fn zero_range(&self, offset: u64, len_bytes: u64) -> Result<()> {
        if self.read_only {
            return Err(read_only_error());
        }
        let (start, len) = self.region_range(offset, len_bytes)?;
        self.region.fill_zero(start, len);
        self.mark_zeroed(offset, len_bytes);
        Ok(())
    }
}

fn invalid_size(size_bytes: u64, why: &str) -> BackendError {
    BackendError::Io(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("RAM volume size {size_bytes} {why}"),
    ))
}

impl Backend for RamBackend {
    fn kind(&self) -> &'static str {
        "ram"
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn block_size(&self) -> u32 {
        BLOCK_BYTES
    }

    fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let start = self.region_offset(offset, buf.len())?;
        self.region.read_at(start, buf);
        Ok(())
    }

    fn read_in_place(&self, offset: u64, len: usize) -> Option<Result<RegionBytes>> {
        Some(self.region_offset(offset, len).map(|start| self.region.bytes(start, len)))
    }

    /// `fua` needs no extra work: a completed copy is already as durable as RAM allows.
    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        if self.read_only {
            return Err(read_only_error());
        }
        let start = self.region_offset(offset, buf.len())?;
        self.region.write_at(start, buf);
        self.mark_written(offset, buf.len() as u64);
        Ok(())
    }

    /// Nothing to do: every acknowledged write already sits in memory.
    fn flush(&self) -> Result<()> {
        Ok(())
    }

    /// Zeroes the range so that trimmed blocks read back as zeroes, as the trait promises.
    /// Returning pages to the kernel (`MADV_DONTNEED`) would save memory but needs page-granular
    /// unsafe code in `rt`; not worth it yet.
    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.zero_range(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64, _fua: bool) -> Result<()> {
        self.zero_range(offset, len)
    }

    /// Pages never written (or zeroed whole since) are holes that read as zeroes.
    fn extents(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        check_range(self.size_bytes, offset, len)?;
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let page = pos / PAGE_BYTES;
            let page_end = ((page + 1) * PAGE_BYTES).min(end);
            let hole = !self.is_written(page);
            push_extent(out, Extent { len_bytes: page_end - pos, hole, zero: hole });
            pos = page_end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_partial_blocks() {
        let err = RamBackend::new(1000, false).unwrap_err();
        assert_eq!(err.errno(), libc::EIO);
        assert!(err.to_string().contains("1000"), "{err}");
    }

    #[test]
    fn out_of_range_is_einval_not_a_panic() {
        let ram = RamBackend::new(4096, false).unwrap();
        let mut buf = [0u8; 512];
        assert_eq!(ram.read_at(&mut buf, 4096).unwrap_err().errno(), libc::EINVAL);
        assert_eq!(ram.write_at(&buf, 3584 + 512, false).unwrap_err().errno(), libc::EINVAL);
        assert_eq!(ram.trim(u64::MAX, 512).unwrap_err().errno(), libc::EINVAL);
        assert_eq!(ram.write_zeroes(0, 4097, false).unwrap_err().errno(), libc::EINVAL);
    }
}
