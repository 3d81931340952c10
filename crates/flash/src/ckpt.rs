//! The checkpoint: the controller's durable state (volume table, map leaves, segment table,
//! counters) as one byte stream, so that recovery starts from it and replays only the groups
//! written after it.
//!
//! It is taken when every group handed out has been written and synced, so the maps it holds
//! are exactly what the log up to its sequence number says. Pages still dirty in the pool are
//! not in it: their groups come later and are replayed. The stream is cut into checkpoint
//! pages (`layout::CkptPage`) written to segments of their own; the superblock names the
//! first, and each segment's header the next.
//!
//! Neither side holds the whole stream: [`encode`] takes the state (copying the leaves in
//! memory, naming evicted ones where the current checkpoint stores them) and [`write`]
//! streams it, reading those back one at a time; [`decode`] reads from any [`Bytes`], a
//! [`ChainBytes`] walking the checkpoint's pages in recovery. [`CkptLeaves`] reads one leaf's
//! record back from its offset in the stream, for the map.

use std::sync::Arc;

use crate::ctl::{Config, Controller, Counters, Volume};
use crate::layout::{ArrayId, CkptPage, Pba, CKPT_PAYLOAD, NAME_MAX, PAGE};
use crate::map::{Leaf, LeafId, LeafItem, LeafSource, VolMap, LEAF_PAGES, NO_LEAF};
use crate::space::{Segment, State, Stream};
use crate::FlashError;

const VERSION: u32 = 1;

/// Bytes of one leaf's record: id, shares, entries.
pub const LEAF_RECORD: u64 = 8 + 4 * LEAF_PAGES as u64;

/// Bytes of one segment's record: state, stream, next page, erase count, last group, filled at.
const SEGMENT_RECORD: usize = 26;

/// How checkpoint code reads a page of the array (by PBA) into a page-sized buffer.
pub type PageRead = Arc<dyn Fn(Pba, &mut [u8]) -> Result<(), FlashError> + Send + Sync>;

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

/// Where a checkpoint's bytes come from, in order.
pub trait Bytes {
    /// The next `out.len()` bytes ("cut short" if there are fewer).
    fn fill(&mut self, out: &mut [u8]) -> Result<(), FlashError>;
    /// At most how many bytes are left.
    fn left_max(&self) -> u64;
}

impl Bytes for &[u8] {
    fn fill(&mut self, out: &mut [u8]) -> Result<(), FlashError> {
        if out.len() > self.len() {
            return Err(FlashError::Corrupt("checkpoint cut short"));
        }
        let (head, rest) = self.split_at(out.len());
        out.copy_from_slice(head);
        *self = rest;
        Ok(())
    }
    fn left_max(&self) -> u64 {
        self.len() as u64
    }
}

struct Reader<'a> {
    src: &'a mut dyn Bytes,
    buf: Vec<u8>,
    at: u64,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], FlashError> {
        self.buf.resize(n, 0);
        self.src.fill(&mut self.buf)?;
        self.at += n as u64;
        Ok(&self.buf)
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
        if (n as u64).saturating_mul(item_bytes.max(1) as u64) > self.src.left_max() {
            return Err(FlashError::Corrupt("checkpoint: count past its end"));
        }
        Ok(n)
    }
}

/// What comes before the leaves: version, counters, families and volumes.
fn head(c: &Controller, seq: u64) -> Vec<u8> {
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
    w.u32(c.map.leaves_in_use() as u32);
    w.0
}

/// What comes after the leaves: the segment table.
fn tail(c: &Controller, segments: &[u32]) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    w.u32(c.space.segs.len() as u32);
    for (s, seg) in c.space.segs.iter().enumerate() {
        let (state, stream, next) = match seg.state {
            State::Open { stream, next } => (1, stream.as_u8(), next),
            State::Full => (2, 0, 0),
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

/// The controller's durable state, taken for a checkpoint covering every group up to `seq`.
/// Leaves in memory are copied; evicted ones are named where the current checkpoint stores
/// them, to be read back one at a time as it is written ([`write`]), so that the whole map is
/// never in memory. Its size is known at once ([`Encoded::bytes`]); the segment table comes
/// last ([`Encoded::close`]), once the segments it is to be written to are taken.
pub struct Encoded {
    head: Vec<u8>,
    leaves: Vec<LeafItem>,
    segments: usize,
    tail: Vec<u8>,
}

impl Encoded {
    /// Bytes of the checkpoint (never 0: it starts with its version).
    pub fn bytes(&self) -> u64 {
        self.head.len() as u64
            + self.leaves.len() as u64 * LEAF_RECORD
            + 4
            + (self.segments * SEGMENT_RECORD) as u64
    }

    /// Add the segment table, recording `segments` as this checkpoint's (and any older
    /// checkpoint's as free).
    pub fn close(&mut self, c: &Controller, segments: &[u32]) {
        self.tail = tail(c, segments);
        debug_assert_eq!(self.tail.len(), 4 + self.segments * SEGMENT_RECORD);
    }
}

/// Take the controller's state for a checkpoint (see [`Encoded`]), under its lock.
pub fn encode(c: &mut Controller, seq: u64) -> Encoded {
    let head = head(c, seq);
    let leaves = c.map.begin_checkpoint(head.len() as u64, LEAF_RECORD);
    Encoded { head, leaves, segments: c.space.segs.len(), tail: Vec::new() }
}

/// Write `enc` to `sink` in pieces, reading evicted leaves back through `stored` (the
/// current checkpoint's leaves).
pub fn write(
    enc: &Encoded,
    mut stored: Option<&mut dyn LeafSource>,
    sink: &mut dyn FnMut(&[u8]) -> Result<(), FlashError>,
) -> Result<(), FlashError> {
    sink(&enc.head)?;
    let mut w = Writer(Vec::with_capacity(64 * LEAF_RECORD as usize));
    for item in &enc.leaves {
        let loaded;
        let (id, shares, entries) = match item {
            LeafItem::Here { id, shares, leaf } => (*id, *shares, &**leaf),
            LeafItem::Stored { id, shares, at } => {
                let source =
                    stored.as_mut().ok_or(FlashError::Corrupt("an evicted leaf and no checkpoint"))?;
                loaded = source.load(*id, *at)?;
                (*id, *shares, &*loaded)
            }
        };
        w.u32(id);
        w.u32(shares);
        for &p in entries {
            w.u32(p);
        }
        if w.0.len() >= 63 * LEAF_RECORD as usize {
            sink(&w.0)?;
            w.0.clear();
        }
    }
    sink(&w.0)?;
    sink(&enc.tail)
}

/// The whole checkpoint as one byte string (tests and fuzzing: every leaf must be in memory).
pub fn encode_to_vec(c: &mut Controller, seq: u64, segments: &[u32]) -> Vec<u8> {
    let mut enc = encode(c, seq);
    enc.close(c, segments);
    c.map.checkpoint_abandoned();
    let mut out = Vec::new();
    write(&enc, None, &mut |b| {
        out.extend_from_slice(b);
        Ok(())
    })
    .expect("leaves in memory");
    out
}

/// A controller rebuilt from a checkpoint's bytes, for an array of `segments` segments of
/// `segment_pages` pages, keeping up to `cfg`'s map budget of leaves in memory and leaving
/// the rest to come back from `source`. Returns it with the checkpoint's sequence number.
pub fn decode(
    bytes: &mut dyn Bytes,
    cfg: Config,
    segments: u32,
    segment_pages: u32,
    source: Option<Box<dyn LeafSource>>,
) -> Result<(Controller, u64), FlashError> {
    let bad = FlashError::Corrupt;
    let mut r = Reader { src: bytes, buf: Vec::new(), at: 0 };
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
    let mut leaf_shares = std::collections::HashMap::new();
    let pages_total = u64::from(segments) * u64::from(segment_pages);
    let keep = c.map_budget_leaves();
    for n in 0..r.count(LEAF_RECORD as usize)? {
        let at = r.at;
        let (id, shares) = (r.u32()?, r.u32()?);
        if id == NO_LEAF || shares == 0 || leaf_shares.insert(id, shares).is_some() {
            return Err(bad("checkpoint: leaf id repeated or out of range"));
        }
        let entries = leaf_entries(r.take(4 * LEAF_PAGES)?, pages_total, segment_pages)?;
        c.map.restore_leaf(id, shares, entries, at, n < keep || source.is_none());
    }
    c.map.finish_restore(source);
    let mut uses = std::collections::HashMap::<u32, u32>::new();
    for (id, family, writable, origin, name, map) in vols {
        for &l in map.leaves.iter().filter(|&&l| l != NO_LEAF) {
            if !leaf_shares.contains_key(&l) {
                return Err(bad("checkpoint: a volume names a leaf it does not hold"));
            }
            *uses.entry(l).or_default() += 1;
        }
        c.families.insert(id, family);
        c.vols.insert(id, Volume::restored(id, name, family, map, writable, origin));
    }
    if leaf_shares.iter().any(|(id, &shares)| uses.get(id).copied().unwrap_or(0) != shares) {
        return Err(bad("checkpoint: a leaf's shares do not match its users"));
    }
    if r.count(SEGMENT_RECORD)? != segments as usize {
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
    if r.src.left_max() != 0 {
        return Err(bad("checkpoint: bytes after its end"));
    }
    c.space.restore(segs);
    c.space.covered_seq = seq;
    c.checkpoint_segments = checkpoint_segments;
    c.next_seq = seq + 1;
    c.durable_seq = seq;
    Ok((c, seq))
}

/// A leaf's entries from its bytes, each checked to lie in the array and off header pages.
fn leaf_entries(b: &[u8], pages_total: u64, segment_pages: u32) -> Result<Box<Leaf>, FlashError> {
    let mut entries = Box::new([0 as Pba; LEAF_PAGES]);
    for (e, b) in entries.iter_mut().zip(b.chunks_exact(4)) {
        *e = u32::from_le_bytes(b.try_into().expect("4 bytes"));
        if *e != 0 && (u64::from(*e) >= pages_total || *e % segment_pages == 0) {
            return Err(FlashError::Corrupt("checkpoint: a map entry past the array or on a header page"));
        }
    }
    Ok(entries)
}

/// A checkpoint's place on the devices: its segments in chain order.
#[derive(Debug, Clone)]
pub struct Chain {
    pub array: ArrayId,
    pub seq: u64,
    /// Checkpoint pages in all.
    pub pages: u32,
    pub segments: Vec<u32>,
    pub segment_pages: u32,
    /// Pages of the whole array (to check map entries against).
    pub array_pages: u64,
}

impl Chain {
    /// Where checkpoint page `index` lies.
    pub fn pba(&self, index: u32) -> Result<Pba, FlashError> {
        let per = self.segment_pages - 1;
        let seg = *self
            .segments
            .get((index / per) as usize)
            .ok_or(FlashError::Corrupt("checkpoint page past its chain"))?;
        Ok(seg * self.segment_pages + 1 + index % per)
    }

    /// The checkpoint pages holding the leaf record at byte `at`: the first's index, how many
    /// (1 or 2), and whether they lie next to each other on their device.
    pub fn record_pages(&self, at: u64) -> (u32, u32, bool) {
        let index = (at / CKPT_PAYLOAD as u64) as u32;
        let two = at % CKPT_PAYLOAD as u64 + LEAF_RECORD > CKPT_PAYLOAD as u64;
        let per = self.segment_pages - 1;
        (index, 1 + u32::from(two), !two || index % per != per - 1)
    }

    /// The payload of checkpoint page `index` in `page` (as read from its PBA), checked to be
    /// this checkpoint's page of that index; it is moved to the start of `page`.
    fn check<'p>(&self, index: u32, page: &'p mut [u8]) -> Result<&'p [u8], FlashError> {
        let cp = CkptPage::parse(&self.array, page)?;
        if cp.seq != self.seq || cp.index != index {
            return Err(FlashError::Corrupt("checkpoint page out of place"));
        }
        let len = cp.payload.len();
        page[..len].copy_from_slice(&cp.payload);
        Ok(&page[..len])
    }

    /// The payload of checkpoint page `index`, read through `read` into `page` and checked.
    fn payload<'p>(&self, read: &PageRead, index: u32, page: &'p mut [u8]) -> Result<&'p [u8], FlashError> {
        read(self.pba(index)?, page)?;
        self.check(index, page)
    }

    /// Leaf `id`'s entries from its record at byte `at`, given its pages' images (read from
    /// [`Chain::record_pages`], one after the other).
    pub fn leaf_from_pages(&self, id: LeafId, at: u64, pages: &mut [u8]) -> Result<Box<Leaf>, FlashError> {
        let (_, n, _) = self.record_pages(at);
        if pages.len() != n as usize * PAGE {
            return Err(FlashError::Corrupt("a leaf record's pages of the wrong size"));
        }
        let mut k = 0;
        leaf_record(id, at, self, &mut |index| {
            let page = pages
                .get_mut(k * PAGE..(k + 1) * PAGE)
                .ok_or(FlashError::Corrupt("a leaf record cut short"))?;
            k += 1;
            Ok(self.check(index, page)?.to_vec())
        })
    }
}

/// Leaf `id`'s entries from its record at byte `at` of `chain`'s stream, taking the payload
/// of each checkpoint page it needs from `payload_of`.
fn leaf_record(
    id: LeafId,
    at: u64,
    chain: &Chain,
    payload_of: &mut dyn FnMut(u32) -> Result<Vec<u8>, FlashError>,
) -> Result<Box<Leaf>, FlashError> {
    let mut record = Vec::with_capacity(LEAF_RECORD as usize);
    let mut index =
        u32::try_from(at / CKPT_PAYLOAD as u64).map_err(|_| FlashError::Corrupt("leaf offset"))?;
    let mut skip = (at % CKPT_PAYLOAD as u64) as usize;
    while record.len() < LEAF_RECORD as usize {
        let payload = payload_of(index)?;
        let want = (LEAF_RECORD as usize - record.len()).min(payload.len().saturating_sub(skip));
        if want == 0 {
            return Err(FlashError::Corrupt("checkpoint: a leaf record cut short"));
        }
        record.extend_from_slice(&payload[skip..skip + want]);
        skip = 0;
        index += 1;
    }
    if u32::from_le_bytes(record[..4].try_into().expect("4 bytes")) != id {
        return Err(FlashError::Corrupt("checkpoint: another leaf where a leaf was stored"));
    }
    leaf_entries(&record[8..], chain.array_pages, chain.segment_pages)
}

/// A checkpoint's bytes, read page by page along its chain.
pub struct ChainBytes<'a> {
    chain: &'a Chain,
    read: &'a PageRead,
    next: u32,
    page: Vec<u8>,
    at: usize,
    len: usize,
    /// Pages read so far.
    pub pages_read: u64,
}

impl<'a> ChainBytes<'a> {
    pub fn new(chain: &'a Chain, read: &'a PageRead) -> ChainBytes<'a> {
        ChainBytes { chain, read, next: 0, page: vec![0; PAGE], at: 0, len: 0, pages_read: 0 }
    }
}

impl Bytes for ChainBytes<'_> {
    fn fill(&mut self, mut out: &mut [u8]) -> Result<(), FlashError> {
        while !out.is_empty() {
            if self.at == self.len {
                if self.next == self.chain.pages {
                    return Err(FlashError::Corrupt("checkpoint cut short"));
                }
                self.len = self.chain.payload(self.read, self.next, &mut self.page)?.len();
                self.at = 0;
                self.next += 1;
                self.pages_read += 1;
                if self.len < CKPT_PAYLOAD && self.next < self.chain.pages {
                    return Err(FlashError::Corrupt("a short checkpoint page before its last"));
                }
            }
            let n = out.len().min(self.len - self.at);
            out[..n].copy_from_slice(&self.page[self.at..self.at + n]);
            self.at += n;
            out = &mut out[n..];
        }
        Ok(())
    }
    fn left_max(&self) -> u64 {
        u64::from(self.chain.pages - self.next) * CKPT_PAYLOAD as u64 + (self.len - self.at) as u64
    }
}

/// Evicted leaves, read back from the checkpoint that holds them.
pub struct CkptLeaves {
    chain: Chain,
    read: PageRead,
    page: Vec<u8>,
}

impl CkptLeaves {
    pub fn new(chain: Chain, read: PageRead) -> CkptLeaves {
        CkptLeaves { chain, read, page: vec![0; PAGE] }
    }
}

impl LeafSource for CkptLeaves {
    fn load(&mut self, id: LeafId, at: u64) -> Result<Box<Leaf>, FlashError> {
        let CkptLeaves { chain, read, page } = self;
        leaf_record(id, at, chain, &mut |index| Ok(chain.payload(read, index, page)?.to_vec()))
    }
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
        let bytes = encode_to_vec(&mut c, seq, &[9]);
        let (mut d, got_seq) = decode(&mut &bytes[..], c.cfg, 16, 64, None).unwrap();
        assert_eq!(got_seq, seq);
        d.audit().unwrap();
        for (id, v) in &c.vols {
            let w = &d.vols[id];
            assert_eq!((&w.name, w.family, w.writable, w.origin), (&v.name, v.family, v.writable, v.origin));
            for p in 0..v.map.pages {
                assert_eq!(
                    d.map.get(&w.map, p).unwrap(),
                    c.map.get(&v.map, p).unwrap(),
                    "volume {id} page {p}"
                );
            }
        }
        assert_eq!(d.vols[&snap].origin, Some(vol));
        assert_eq!(d.space.segs[9].state, State::Checkpoint);
        for cut in [0, 1, 10, bytes.len() / 2, bytes.len() - 1] {
            assert!(decode(&mut &bytes[..cut], c.cfg, 16, 64, None).is_err(), "cut at {cut}");
        }
        assert!(decode(&mut &bytes[..], c.cfg, 17, 64, None).is_err(), "another geometry");
    }

    /// A leaf record's pages as a checkpoint writes them: `records` of leaves 0, 1, 2, ...
    /// (entries `id + 1` and `id + 2` up front) in the stream of checkpoint `seq`.
    fn stream_pages(array: &ArrayId, seq: u64, records: u32) -> (Chain, Vec<u8>) {
        let mut stream = Vec::new();
        for id in 0..records {
            stream.extend(id.to_le_bytes());
            stream.extend(1u32.to_le_bytes());
            let mut entries = [0u32; LEAF_PAGES];
            entries[0] = id + 1;
            entries[1] = id + 2;
            stream.extend(entries.iter().flat_map(|e| e.to_le_bytes()));
        }
        let mut pages = Vec::new();
        for (index, payload) in stream.chunks(CKPT_PAYLOAD).enumerate() {
            let mut page = vec![0u8; PAGE];
            CkptPage::emit(array, seq, index as u32, payload, &mut page);
            pages.extend(page);
        }
        let chain =
            Chain { array: *array, seq, pages: 8, segments: vec![2, 3], segment_pages: 64, array_pages: 256 };
        (chain, pages)
    }

    #[test]
    fn a_leaf_read_back_must_be_the_one_stored_there() {
        let array = [5u8; 16];
        let (chain, pages) = stream_pages(&array, 9, 3);
        // Leaf 1's record spans pages 0 and 1.
        let at = LEAF_RECORD;
        let (index, n, together) = chain.record_pages(at);
        assert_eq!((index, n, together), (0, 2, true));
        let mut two = pages[..2 * PAGE].to_vec();
        let leaf = chain.leaf_from_pages(1, at, &mut two).unwrap();
        assert_eq!((leaf[0], leaf[1], leaf[2]), (2, 3, 0));
        // Another leaf's id at that offset, pages of another checkpoint, a torn page, too
        // few pages: each refused with a reason, never taken for the leaf.
        let mut two = pages[..2 * PAGE].to_vec();
        assert!(matches!(chain.leaf_from_pages(2, at, &mut two), Err(FlashError::Corrupt(_))));
        let (_, older) = stream_pages(&array, 8, 3);
        let mut two = older[..2 * PAGE].to_vec();
        assert!(chain.leaf_from_pages(1, at, &mut two).is_err(), "a page of checkpoint 8 in checkpoint 9");
        let mut two = pages[..2 * PAGE].to_vec();
        two[PAGE + 100] ^= 1;
        assert!(chain.leaf_from_pages(1, at, &mut two).is_err(), "a torn second page");
        let mut one = pages[..PAGE].to_vec();
        assert!(chain.leaf_from_pages(1, at, &mut one).is_err(), "one page of two");
    }
}
