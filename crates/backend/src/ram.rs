//! The RAM backend: a volume held in one page-aligned anonymous mapping.
//!
//! Workers copy straight in and out of an [`rt::mem::Region`] with no lock; overlapping
//! in-flight requests give unspecified bytes, as on any block device (see [`rt::mem`]). The
//! contents vanish with the process, so flush and FUA have nothing to wait for: memory is as
//! durable as this backend gets. This module owns no unsafe code; the region does.

use std::io;

use rt::mem::Region;

use crate::spec::{check_range, read_only_error, BLOCK_BYTES};
use crate::{Backend, BackendError, Capabilities, Result};

/// A volume in anonymous memory, zero-filled at creation.
#[derive(Debug)]
pub struct RamBackend {
    region: Region,
    size_bytes: u64,
    read_only: bool,
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
        Ok(RamBackend { region: Region::new(len_bytes)?, size_bytes, read_only })
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

    /// `fua` needs no extra work: a completed copy is already as durable as RAM allows.
    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        if self.read_only {
            return Err(read_only_error());
        }
        let start = self.region_offset(offset, buf.len())?;
        self.region.write_at(start, buf);
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
