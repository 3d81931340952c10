//! The checkpoint: the controller's durable state (volume table, map leaves, segment table,
//! counters) as one byte stream, so that recovery starts from it and replays only the groups
//! written after it.
//!
//! It is taken when every group handed out has been written and synced, so the maps it holds
//! are exactly what the log up to its sequence number says. Pages still dirty in the pool are
//! not in it: their groups come later and are replayed. The stream is cut into checkpoint
//! pages (`layout::CkptPage`) written to segments of their own; the superblock names the
//! first, and each segment's header the next.

use crate::ctl::{Config, Controller, Counters, Volume};
use crate::layout::{Pba, NAME_MAX};
use crate::map::{VolMap, LEAF_PAGES, NO_LEAF};
use crate::space::{Segment, State, Stream};
use crate::FlashError;

const VERSION: u32 = 1;

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u8(s.len() as u8);
        self.0.extend_from_slice(s.as_bytes());
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], FlashError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or(FlashError::Corrupt("checkpoint cut short"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, FlashError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, FlashError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, FlashError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn str(&mut self) -> Result<String, FlashError> {
        let n = self.u8()? as usize;
        if n == 0 || n > NAME_MAX {
            return Err(FlashError::Corrupt("checkpoint: volume name length out of range"));
        }
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| FlashError::Corrupt("checkpoint: volume name not UTF-8"))
    }
    /// A count of items of at least `item_bytes` each, bounded by the bytes left.
    fn count(&mut self, item_bytes: usize) -> Result<usize, FlashError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(item_bytes.max(1)) > self.b.len() - self.at {
            return Err(FlashError::Corrupt("checkpoint: count past its end"));
        }
        Ok(n)
    }
}

/// The controller's durable state as bytes, for a checkpoint covering every group up to
/// `seq`, to be written to `segments` (which the table records as the checkpoint's; any
/// older checkpoint's segments are recorded free).
pub fn encode(c: &Controller, seq: u64, segments: &[u32]) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    w.u32(VERSION);
    w.u64(seq);
    w.u32(c.next_vol);
    w.u32(c.next_family);
    w.u64(c.space.clock);
    let k = &c.counters;
    for v in [
        k.user_pages_written,
        k.gc_pages_moved,
        k.device_pages_written,
        k.groups_written,
        k.gc_segments_cleaned,
        k.checkpoints,
    ] {
        w.u64(v);
    }
    let mut families: Vec<(u32, u32)> = c.families.iter().map(|(&v, &f)| (v, f)).collect();
    families.sort_unstable();
    w.u32(families.len() as u32);
    for (v, f) in families {
        w.u32(v);
        w.u32(f);
    }
    w.u32(c.vols.len() as u32);
    for v in c.vols.values() {
        w.u32(v.id);
        w.u32(v.family);
        w.u8(u8::from(v.writable));
        w.u32(v.origin.map_or(0, |o| o + 1));
        w.str(&v.name);
        w.u64(v.map.pages);
        w.u32(v.map.leaves.len() as u32);
        for &l in &v.map.leaves {
            w.u32(l);
        }
    }
    let leaves: Vec<_> = c.map.each_leaf().collect();
    w.u32(leaves.len() as u32);
    for (id, shares, entries) in leaves {
        w.u32(id);
        w.u32(shares);
        for &p in entries {
            w.u32(p);
        }
    }
    w.u32(c.space.segs.len() as u32);
    for (s, seg) in c.space.segs.iter().enumerate() {
        let (state, stream, next) = match seg.state {
            State::Open { stream, next } => (1, stream.as_u8(), next),
            State::Full => (2, 0, 0),
            State::Checkpoint if segments.contains(&(s as u32)) => (3, 0, 0),
            _ if segments.contains(&(s as u32)) => (3, 0, 0),
            State::Free | State::Checkpoint | State::Releasing { .. } => (0, 0, 0),
        };
        w.u8(state);
        w.u8(stream);
        w.u32(next);
        w.u32(seg.erase_count);
        w.u64(seg.last_seq);
        w.u64(seg.filled_at);
    }
    w.0
}

/// A controller rebuilt from a checkpoint's bytes, for an array of `segments` segments of
/// `segment_pages` pages. Returns it with the checkpoint's sequence number.
pub fn decode(
    bytes: &[u8],
    cfg: Config,
    segments: u32,
    segment_pages: u32,
) -> Result<(Controller, u64), FlashError> {
    let bad = FlashError::Corrupt;
    let mut r = Reader { b: bytes, at: 0 };
    if r.u32()? != VERSION {
        return Err(bad("checkpoint of an unknown version"));
    }
    let seq = r.u64()?;
    let mut c = Controller::new(cfg, segments, segment_pages);
    c.next_vol = r.u32()?;
    c.next_family = r.u32()?;
    c.space.clock = r.u64()?;
    let mut k = [0u64; 6];
    for v in &mut k {
        *v = r.u64()?;
    }
    c.counters = Counters {
        user_pages_written: k[0],
        gc_pages_moved: k[1],
        device_pages_written: k[2],
        groups_written: k[3],
        gc_segments_cleaned: k[4],
        checkpoints: k[5],
        ..Counters::default()
    };
    for _ in 0..r.count(8)? {
        let (v, f) = (r.u32()?, r.u32()?);
        c.families.insert(v, f);
    }
    let mut vols = Vec::new();
    for _ in 0..r.count(22)? {
        let (id, family) = (r.u32()?, r.u32()?);
        let writable = match r.u8()? {
            0 => false,
            1 => true,
            _ => return Err(bad("checkpoint: flag out of range")),
        };
        let origin = r.u32()?.checked_sub(1);
        let name = r.str()?;
        let pages = r.u64()?;
        let n = r.count(4)?;
        if n != crate::map::leaves_for(pages) {
            return Err(bad("checkpoint: a volume's leaves do not match its size"));
        }
        let leaves = (0..n).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
        vols.push((id, family, writable, origin, name, VolMap { leaves, pages }));
    }
    let mut leaf_ids = std::collections::HashSet::new();
    let pages_total = u64::from(segments) * u64::from(segment_pages);
    for _ in 0..r.count(8 + 4 * LEAF_PAGES)? {
        let (id, shares) = (r.u32()?, r.u32()?);
        if id == NO_LEAF || !leaf_ids.insert(id) || shares == 0 {
            return Err(bad("checkpoint: leaf id repeated or out of range"));
        }
        let mut entries = Box::new([0 as Pba; LEAF_PAGES]);
        for e in entries.iter_mut() {
            *e = r.u32()?;
            if *e != 0 && (u64::from(*e) >= pages_total || *e % segment_pages == 0) {
                return Err(bad("checkpoint: a map entry past the array or on a header page"));
            }
        }
        c.map.restore_leaf(id, shares, entries);
    }
    c.map.finish_restore();
    let mut uses = std::collections::HashMap::<u32, u32>::new();
    for (id, family, writable, origin, name, map) in vols {
        for &l in map.leaves.iter().filter(|&&l| l != NO_LEAF) {
            if !leaf_ids.contains(&l) {
                return Err(bad("checkpoint: a volume names a leaf it does not hold"));
            }
            *uses.entry(l).or_default() += 1;
        }
        c.families.insert(id, family);
        c.vols.insert(id, Volume::restored(id, name, family, map, writable, origin));
    }
    let shares_ok = c.map.each_leaf().all(|(id, shares, _)| uses.get(&id).copied().unwrap_or(0) == shares);
    if !shares_ok {
        return Err(bad("checkpoint: a leaf's shares do not match its users"));
    }
    if r.count(26)? != segments as usize {
        return Err(bad("checkpoint of an array of another size"));
    }
    let mut segs = Vec::with_capacity(segments as usize);
    let mut checkpoint_segments = Vec::new();
    for s in 0..segments {
        let (state, stream, next) = (r.u8()?, r.u8()?, r.u32()?);
        let (erase_count, last_seq, filled_at) = (r.u32()?, r.u64()?, r.u64()?);
        let state = match state {
            0 => State::Free,
            1 => State::Open {
                stream: Stream::from_u8(stream).ok_or(bad("checkpoint: stream out of range"))?,
                next: if (1..=segment_pages).contains(&next) {
                    next
                } else {
                    return Err(bad("checkpoint: open segment position out of range"));
                },
            },
            2 => State::Full,
            3 => {
                checkpoint_segments.push(s);
                State::Checkpoint
            }
            _ => return Err(bad("checkpoint: segment state out of range")),
        };
        if state == State::Free && c.map.valid(s) > 0 {
            return Err(bad("checkpoint: a free segment holds mapped pages"));
        }
        segs.push(Segment { state, erase_count, last_seq, filled_at });
    }
    if r.at != bytes.len() {
        return Err(bad("checkpoint: bytes after its end"));
    }
    c.space.restore(segs);
    c.space.covered_seq = seq;
    c.checkpoint_segments = checkpoint_segments;
    c.next_seq = seq + 1;
    c.durable_seq = seq;
    Ok((c, seq))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ctl::{Access, Got};

    #[test]
    fn a_controller_survives_encoding_and_garbage_does_not_pass() {
        let mut c = Controller::new(Config { pool_pages: 64, ..Config::default() }, 16, 64);
        c.seq_ceiling = u64::MAX;
        let vol = c.create("v", 2000).unwrap();
        for p in [0u64, 1, 700, 1999] {
            let (Got::Fresh(s) | Got::Ready(s)) = c.get(vol, p, Access::WriteWhole).unwrap() else {
                panic!()
            };
            c.put(s, true);
        }
        while let Some(plan) = c.writeback(64, None) {
            c.written(plan.seq, true);
        }
        c.durable(c.completed_seq());
        let snap = c.snapshot(vol, "snap", false).unwrap();
        let (Got::Fresh(s) | Got::Ready(s)) = c.get(vol, 700, Access::WriteWhole).unwrap() else { panic!() };
        c.put(s, true);
        while let Some(plan) = c.writeback(64, None) {
            c.written(plan.seq, true);
        }
        let seq = c.last_seq();
        let bytes = encode(&c, seq, &[9]);
        let (d, got_seq) = decode(&bytes, c.cfg, 16, 64).unwrap();
        assert_eq!(got_seq, seq);
        d.audit().unwrap();
        for (id, v) in &c.vols {
            let w = &d.vols[id];
            assert_eq!((&w.name, w.family, w.writable, w.origin), (&v.name, v.family, v.writable, v.origin));
            for p in 0..v.map.pages {
                assert_eq!(d.map.get(&w.map, p), c.map.get(&v.map, p), "volume {id} page {p}");
            }
        }
        assert_eq!(d.vols[&snap].origin, Some(vol));
        assert_eq!(d.space.segs[9].state, State::Checkpoint);
        for cut in [0, 1, 10, bytes.len() / 2, bytes.len() - 1] {
            assert!(decode(&bytes[..cut], c.cfg, 16, 64).is_err(), "cut at {cut}");
        }
        assert!(decode(&bytes, c.cfg, 17, 64).is_err(), "another geometry");
    }
}
