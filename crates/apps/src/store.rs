//! What both applications do with namespaces: make one afresh, map it, and move whole regions
//! through a segment a megabyte per request.

use std::time::{Duration, Instant};

use coord::Scope;
use initiator::LaneConfig;
use rstore::{Coordinator, Segment};

use crate::Result;

/// Bytes moved per request when reading or writing whole regions.
pub const IO_BYTES: usize = 1 << 20;

/// Namespace `name` (re)created, of `scope` and chunks of `chunk`, with one allocation of
/// `bytes` at 0.
pub fn fresh(c: &Coordinator, name: &str, scope: Scope, chunk: u64, bytes: u64) -> Result<()> {
    match c.delete_ns(name) {
        Ok(()) | Err(coord::CoordError::NoNamespace(_)) => {}
        Err(e) => return Err(e.into()),
    }
    c.create_ns(name, scope, chunk, 1)?;
    // Chunks an earlier run gave back come free once their servers have zeroed them.
    let start = Instant::now();
    loop {
        match c.reserve(name, bytes) {
            Ok(_) => break,
            Err(coord::CoordError::NoCapacity { zeroing, .. })
                if zeroing > 0 && start.elapsed() < Duration::from_secs(60) =>
            {
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e.into()),
        }
    }
    c.alloc(name, bytes, Some(0))?;
    Ok(())
}

/// The allocation at 0 of namespace `name`, mapped.
pub fn map(c: &Coordinator, name: &str) -> Result<Segment> {
    Ok(c.map(name, 0, &LaneConfig::default()).map_err(|e| format!("mapping {name}: {e}"))?)
}

/// Read `len` bytes at `offset`, a megabyte at a time.
pub fn read_region(seg: &mut Segment, offset: u64, len: usize) -> Result<Vec<u8>> {
    let mut out = vec![0u8; len];
    read_into(seg, offset, &mut out)?;
    Ok(out)
}

/// Fill `out` from `offset`, a megabyte at a time.
pub fn read_into(seg: &mut Segment, offset: u64, out: &mut [u8]) -> Result<()> {
    for (i, piece) in out.chunks_mut(IO_BYTES).enumerate() {
        seg.read(offset + (i * IO_BYTES) as u64, piece)?;
    }
    Ok(())
}

/// Write `data` at `offset`, a megabyte at a time.
pub fn write_region(seg: &mut Segment, offset: u64, data: &[u8]) -> Result<()> {
    for (i, piece) in data.chunks(IO_BYTES).enumerate() {
        seg.write(offset + (i * IO_BYTES) as u64, piece)?;
    }
    Ok(())
}
