//! The null backend: reads zeroes, discards writes, succeeds at everything.
//!
//! It exists to measure what the protocol and transport cost with storage taken out of the
//! picture, so it does the least work a correct backend can: range and read-only checks, and a
//! zero-fill on reads (a client must never see stale buffer contents). It holds no data.

use crate::spec::{check_range, read_only_error, BLOCK_BYTES};
use crate::{push_extent, Backend, Capabilities, Extent, Result};

/// A volume of a given size with no contents.
#[derive(Debug, Clone)]
pub struct NullBackend {
    size_bytes: u64,
    read_only: bool,
}

impl NullBackend {
    /// A volume of `size_bytes`; the spec parser guarantees a non-zero multiple of 512. Any
    /// trailing partial block is simply unaddressable.
    pub fn new(size_bytes: u64, read_only: bool) -> Self {
        NullBackend { size_bytes, read_only }
    }

    /// The checks a real backend would make before changing anything.
    fn check_change(&self, offset: u64, len_bytes: u64) -> Result<()> {
        if self.read_only {
            return Err(read_only_error());
        }
        check_range(self.size_bytes, offset, len_bytes)
    }
}

impl Backend for NullBackend {
    fn kind(&self) -> &'static str {
        "null"
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
        check_range(self.size_bytes, offset, buf.len() as u64)?;
        buf.fill(0);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> Result<()> {
        self.check_change(offset, buf.len() as u64)
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.check_change(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64, _fua: bool) -> Result<()> {
        self.check_change(offset, len)
    }

    /// Nothing is ever stored: the whole volume is one hole of zeroes.
    fn extents(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<()> {
        check_range(self.size_bytes, offset, len)?;
        push_extent(out, Extent { len_bytes: len, hole: true, zero: true });
        Ok(())
    }
}
