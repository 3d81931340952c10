//! What both applications do with namespaces: make one afresh, map it, and move whole regions
//! through a segment a megabyte per request.

use std::time::{Duration, Instant};

use coord::Scope;
use initiator::{LaneConfig, Queue, ReqFlags, Status};
use rstore::{Coordinator, Segment};

use crate::Result;

/// Bytes of a sector: the unit of the applications' headers and reports.
pub const SECTOR: usize = 512;

/// `values` little-endian, padded with zeros to whole sectors (at least one).
pub fn sector_u64s(values: &[u64]) -> Vec<u8> {
    let len = (8 * values.len()).div_ceil(SECTOR).max(1) * SECTOR;
    let mut s = vec![0u8; len];
    for (i, v) in values.iter().enumerate() {
        s[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    s
}

/// The little-endian `u64`s of `bytes`.
pub fn u64s(bytes: &[u8]) -> Vec<u64> {
    bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
}

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

/// Requests in flight when moving a region: enough to keep both directions of every lane busy.
pub const DEPTH: usize = 8;

/// Fill `out` from `offset`, a megabyte per request, [`DEPTH`] requests in flight.
pub fn read_into(seg: &mut Segment, offset: u64, out: &mut [u8]) -> Result<()> {
    let pieces: Vec<&mut [u8]> = out.chunks_mut(IO_BYTES).collect();
    let mut pieces: Vec<Option<&mut [u8]>> = pieces.into_iter().map(Some).collect();
    let n = pieces.len();
    let lens: Vec<usize> = pieces.iter().map(|p| p.as_ref().map_or(0, |p| p.len())).collect();
    pipeline(
        seg,
        false,
        offset,
        n,
        |i, mut buf| {
            buf.resize(lens[i], 0);
            buf
        },
        |i, data| {
            pieces[i].take().expect("each piece once").copy_from_slice(data);
        },
    )
}

/// Write `data` at `offset`, a megabyte per request, [`DEPTH`] requests in flight.
pub fn write_region(seg: &mut Segment, offset: u64, data: &[u8]) -> Result<()> {
    let pieces: Vec<&[u8]> = data.chunks(IO_BYTES).collect();
    pipeline(
        seg,
        true,
        offset,
        pieces.len(),
        |i, mut buf| {
            buf.extend_from_slice(pieces[i]);
            buf
        },
        |_, _| {},
    )
}

/// Read or write `n` consecutive pieces of [`IO_BYTES`] (the last maybe shorter) from `offset`, with up
/// to [`DEPTH`] in flight: `fill(i, empty)` gives piece `i`'s request buffer, `done(i, data)`
/// takes what came back. Buffers are reused.
fn pipeline(
    seg: &mut Segment,
    write: bool,
    offset: u64,
    n: usize,
    mut fill: impl FnMut(usize, Vec<u8>) -> Vec<u8>,
    mut done: impl FnMut(usize, &[u8]),
) -> Result<()> {
    let mut spare: Vec<Vec<u8>> = Vec::new();
    let mut completions = Vec::new();
    let (mut next, mut finished) = (0usize, 0usize);
    while finished < n {
        while next < n && seg.in_flight() < DEPTH {
            let mut buf = spare.pop().unwrap_or_default();
            buf.clear();
            let buf = fill(next, buf);
            let at = offset + (next * IO_BYTES) as u64;
            let submitted = if write {
                seg.submit_write(at, buf, ReqFlags::empty(), next as u64)
            } else {
                seg.submit_read(at, buf, next as u64)
            };
            submitted.map_err(|r| r.error)?;
            next += 1;
        }
        completions.clear();
        seg.wait(1, &mut completions)?;
        for c in completions.drain(..) {
            let i = c.user_data as usize;
            match c.status {
                Status::Ok => {}
                Status::IoError => {
                    return Err(format!(
                        "bytes at {} of the segment: every copy is out of service",
                        offset + (i * IO_BYTES) as u64
                    )
                    .into())
                }
                other => return Err(format!("piece {i} of a region: {other}").into()),
            }
            let buf = c.buf.unwrap_or_default();
            done(i, &buf);
            spare.push(buf);
            finished += 1;
        }
    }
    Ok(())
}
