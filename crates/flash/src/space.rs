//! Segments: which are free, which streams write into which, which garbage collection cleans
//! next, and how evenly they wear.
//!
//! Writes are always out of place, appended to an open segment of their **stream**. With
//! segregation on, a page goes to the stream of its origin (a user write or a
//! garbage-collection move) and its age class (how often and how lately it was written: `ctl`
//! decides), FlashNet's three levels of origin, age and heat; with it off, everything shares
//! one stream, so hot and cold pages mix in every segment and cleaning moves more of them.
//!
//! A segment is cleaned only once a checkpoint covers every group in it (its last group's
//! sequence number is at most the checkpoint's): replay after a crash starts from the
//! checkpoint's map, so the records in an uncovered segment must stay readable. A cleaned
//! segment becomes free only once the groups that moved its pages are durable. A reserve of
//! free segments is kept for cleaning and checkpoints, which user writes never take.
//!
//! **Wear.** Free segments are handed out least-worn first, except to the GC streams, which
//! take the most-worn: the pages it relocates have outlived a segment and are the coldest, so
//! they rest where more erases would hurt most. That alone leaves a segment of cold data
//! unerased for ever; so when the most-worn segment has been erased more than
//! `wear_spread_max` times more than the least-worn full one, that one is cleaned whatever its
//! valid pages (`wear_victim`, static wear levelling), its data moving to a worn segment and
//! the segment itself back to the free list for hot data.

use std::collections::BTreeSet;

use crate::layout::{SegmentHeader, SegmentKind};
use crate::map::Map;

/// Where a page is appended: a user stream or a garbage-collection stream, each for one age
/// class of pages (`ctl` classes a page by how often and how lately it was written). With
/// segregation off, everything goes to [`Stream::ONE`].
///
/// On the devices (a data segment's header, the checkpoint's open segments) a stream is its
/// index: user streams of classes `0..CLASSES`, then GC streams of classes `1..CLASSES`. A
/// moved page of class 0 goes back to the youngest user stream (`Stream::gc(0)`), so class 0
/// has no GC stream of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stream(u8);

/// Age classes of pages, youngest first.
pub const CLASSES: u8 = 3;

/// Streams in all: a user stream for each class, a GC stream for each but the youngest.
pub const STREAMS: usize = 2 * CLASSES as usize - 1;

impl Stream {
    /// The one stream with segregation off; with it on, user writes of the youngest class.
    pub const ONE: Stream = Stream(0);

    /// User writes of pages of age class `class` (0: the youngest).
    pub fn user(class: u8) -> Stream {
        Stream(class.min(CLASSES - 1))
    }

    /// Pages garbage collection moves, of age class `class`: the youngest class goes back to
    /// the youngest user stream (it survived only because its overwrite has not come yet).
    pub fn gc(class: u8) -> Stream {
        match class.min(CLASSES - 1) {
            0 => Stream::ONE,
            c => Stream(CLASSES + c - 1),
        }
    }

    pub fn is_gc(self) -> bool {
        self.0 >= CLASSES
    }

    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    pub fn from_u8(v: u8) -> Option<Stream> {
        (usize::from(v) < STREAMS).then_some(Stream(v))
    }

    pub fn as_u8(self) -> u8 {
        self.0
    }
}

/// How garbage collection chooses its victim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VictimPolicy {
    /// The segment with the fewest valid pages.
    #[default]
    Greedy,
    /// The best (1 - u) · age / (1 + u): old, mostly empty segments first (LFS).
    CostBenefit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Free,
    /// Taking groups of `stream`; `next` is the first page not written yet.
    Open {
        stream: Stream,
        next: u32,
    },
    /// Written to the end (or closed with a tail too short for a group).
    Full,
    /// Holds pages of a checkpoint (the current one, or one being written).
    Checkpoint,
    /// Cleaned; free once every group up to `after` is durable.
    Releasing {
        after: u64,
    },
}

#[derive(Debug, Clone, Copy)]
pub struct Segment {
    pub state: State,
    pub erase_count: u32,
    /// The sequence of its last group (0: none since it was opened).
    pub last_seq: u64,
    /// The write clock when it filled (its age, for cost-benefit).
    pub filled_at: u64,
}

/// Space for one write group: its header page at `first`, then `count` data pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub segment: u32,
    pub first: u32,
    pub count: u32,
    /// The segment was opened for it: its header page must be written first.
    pub opened: Option<SegmentHeader>,
}

#[derive(Debug)]
pub struct Space {
    pub segs: Vec<Segment>,
    pub segment_pages: u32,
    open: [Option<u32>; STREAMS],
    /// Free segments by (erase count, index): least worn first.
    free: BTreeSet<(u32, u32)>,
    /// Free segments user writes may not take.
    pub reserve: u32,
    /// The last checkpoint's sequence: segments whose groups are all at most this may be
    /// cleaned.
    pub covered_seq: u64,
    /// Pages written since format (the clock of segment ages).
    pub clock: u64,
    pub policy: VictimPolicy,
    /// Erases by which the most-worn segment may lead the least-worn full one before that one
    /// is cleaned to level them.
    pub wear_spread_max: u32,
    /// Reads in flight from each segment, outside the controller's lock: a cleaned segment
    /// is not freed (and so not rewritten) under them.
    readers: Vec<u32>,
    /// Every group up to this one is durable.
    durable_seq: u64,
}

impl Space {
    /// `segments` segments, all free, keeping `reserve` of them for cleaning.
    pub fn new(segments: u32, segment_pages: u32, reserve: u32) -> Space {
        let segs = vec![
            Segment { state: State::Free, erase_count: 0, last_seq: 0, filled_at: 0 };
            segments as usize
        ];
        let free = (0..segments).map(|s| (0, s)).collect();
        Space {
            segs,
            segment_pages,
            open: [None; STREAMS],
            free,
            reserve,
            covered_seq: 0,
            clock: 0,
            policy: VictimPolicy::Greedy,
            wear_spread_max: u32::MAX,
            readers: vec![0; segments as usize],
            durable_seq: 0,
        }
    }

    pub fn free_segments(&self) -> u32 {
        self.free.len() as u32
    }

    /// Give out room for a group of up to `pages` data pages in `stream`: the header page and
    /// as many data pages as fit in what is left of the open segment (at least one, if any
    /// was asked for). Opens a
    /// segment when there is none or the open one has no room; `seq` is the group's sequence
    /// number, recorded in a new segment's header. `None`: no free segment may be taken (the
    /// reserve is for garbage collection and checkpoints, `use_reserve`).
    pub fn grant(&mut self, stream: Stream, pages: u32, seq: u64, use_reserve: bool) -> Option<Grant> {
        let mut opened = None;
        let seg = match self.open[stream.index()] {
            Some(s) if self.room(s) >= 2 => s,
            other => {
                if let Some(s) = other {
                    self.close(s);
                }
                let s = self.take_free(use_reserve, stream.is_gc())?;
                let erase_count = self.segs[s as usize].erase_count + 1;
                self.segs[s as usize] = Segment {
                    state: State::Open { stream, next: 1 },
                    erase_count,
                    last_seq: 0,
                    filled_at: 0,
                };
                self.open[stream.index()] = Some(s);
                opened = Some(SegmentHeader {
                    segment: s,
                    opened_seq: seq,
                    erase_count,
                    kind: SegmentKind::Data(stream.as_u8()),
                });
                s
            }
        };
        let room = self.room(seg);
        let count = pages.min(room - 1);
        let State::Open { next, .. } = &mut self.segs[seg as usize].state else {
            unreachable!("open segment")
        };
        let first = *next;
        *next += 1 + count;
        self.segs[seg as usize].last_seq = seq;
        self.clock += u64::from(count);
        if self.room(seg) < 2 {
            self.close(seg);
        }
        Some(Grant { segment: seg, first, count, opened })
    }

    /// Pages left in an open segment.
    fn room(&self, s: u32) -> u32 {
        match self.segs[s as usize].state {
            State::Open { next, .. } => self.segment_pages - next,
            _ => 0,
        }
    }

    fn close(&mut self, s: u32) {
        let seg = &mut self.segs[s as usize];
        if let State::Open { stream, .. } = seg.state {
            seg.state = State::Full;
            seg.filled_at = self.clock;
            if self.open[stream.index()] == Some(s) {
                self.open[stream.index()] = None;
            }
        }
    }

    /// The least-worn free segment, or the most-worn one for `cold` data.
    fn take_free(&mut self, use_reserve: bool, cold: bool) -> Option<u32> {
        if !use_reserve && self.free.len() as u32 <= self.reserve {
            return None;
        }
        let pick = if cold { *self.free.iter().next_back()? } else { *self.free.iter().next()? };
        self.free.remove(&pick);
        Some(pick.1)
    }

    /// A free segment for a checkpoint's pages (the reserve included).
    pub fn take_for_checkpoint(&mut self) -> Option<(u32, u32)> {
        let s = self.take_free(true, false)?;
        let seg = &mut self.segs[s as usize];
        seg.erase_count += 1;
        seg.state = State::Checkpoint;
        seg.last_seq = 0;
        Some((s, seg.erase_count))
    }

    /// A checkpoint's segment is no longer needed (a newer checkpoint is durable).
    pub fn drop_checkpoint_segment(&mut self, s: u32) {
        debug_assert_eq!(self.segs[s as usize].state, State::Checkpoint);
        self.make_free(s);
    }

    fn make_free(&mut self, s: u32) {
        let seg = &mut self.segs[s as usize];
        seg.state = State::Free;
        seg.last_seq = 0;
        self.free.insert((seg.erase_count, s));
    }

    /// Garbage collection emptied `s`: free once every group up to `after` is durable.
    pub fn release(&mut self, s: u32, after: u64) {
        self.segs[s as usize].state = State::Releasing { after };
    }

    /// Every group up to `seq` is durable: segments waiting on it become free.
    pub fn durable(&mut self, seq: u64) {
        self.durable_seq = self.durable_seq.max(seq);
        for s in 0..self.segs.len() as u32 {
            self.free_if_released(s);
        }
    }

    fn free_if_released(&mut self, s: u32) {
        if let State::Releasing { after } = self.segs[s as usize].state {
            if after <= self.durable_seq && self.readers[s as usize] == 0 {
                self.make_free(s);
            }
        }
    }

    /// A read of segment `s` goes to the device without the controller's lock.
    pub fn read_begins(&mut self, s: u32) {
        self.readers[s as usize] += 1;
    }

    /// That read is done: the segment may be freed if it was waiting for it.
    pub fn read_ends(&mut self, s: u32) {
        let r = &mut self.readers[s as usize];
        debug_assert!(*r > 0, "a read of segment {s} ended that never began");
        *r = r.saturating_sub(1);
        self.free_if_released(s);
    }

    /// The segment to clean next, if any is worth it: full, covered by the checkpoint, and
    /// freeing at least a thirty-second of a segment once its valid pages are moved with the
    /// group headers they need (up to two: they may straddle two segments). Cleaning a segment
    /// that is all but full of valid pages wins nothing, and on a full array it would churn
    /// for ever.
    pub fn victim(&self, map: &Map) -> Option<u32> {
        let usable = u64::from(self.segment_pages - 1);
        let gain_min = (usable / 32).max(2);
        let mut best: Option<(f64, u32)> = None;
        for (s, seg) in self.segs.iter().enumerate() {
            if seg.state != State::Full || seg.last_seq > self.covered_seq {
                continue;
            }
            let valid = u64::from(map.valid(s as u32));
            if valid + 2 + gain_min > usable {
                continue;
            }
            let u = valid as f64 / usable as f64;
            let score = match self.policy {
                VictimPolicy::Greedy => 1.0 - u,
                VictimPolicy::CostBenefit => {
                    let age = (self.clock.saturating_sub(seg.filled_at) + 1) as f64;
                    (1.0 - u) * age / (1.0 + u)
                }
            };
            if best.is_none_or(|(b, _)| score > b) {
                best = Some((score, s as u32));
            }
        }
        best.map(|(_, s)| s)
    }

    /// The least-worn full segment that cleaning may take, when the most-worn segment leads it
    /// by more than `wear_spread_max` erases (static wear levelling: its data is cold, or it
    /// would have been cleaned already).
    pub fn wear_victim(&self) -> Option<u32> {
        let most = self.segs.iter().map(|s| s.erase_count).max()?;
        let (count, s) = self
            .segs
            .iter()
            .enumerate()
            .filter(|(_, seg)| seg.state == State::Full && seg.last_seq <= self.covered_seq)
            .map(|(s, seg)| (seg.erase_count, s as u32))
            .min()?;
        (most - count > self.wear_spread_max).then_some(s)
    }

    /// Erase counts, least and most worn, of the segments not open for writes (a stream that
    /// falls quiet leaves its open segment as it is, levelled or not).
    pub fn wear(&self) -> (u32, u32) {
        let counts =
            self.segs.iter().filter(|s| !matches!(s.state, State::Open { .. })).map(|s| s.erase_count);
        (counts.clone().min().unwrap_or(0), counts.max().unwrap_or(0))
    }

    /// Rebuild from what recovery found: each segment's state and wear, with `open` the
    /// segments that still take groups (and where).
    pub fn restore(&mut self, segs: Vec<Segment>) {
        self.free.clear();
        self.open = [None; STREAMS];
        for (s, seg) in segs.iter().enumerate() {
            match seg.state {
                State::Free => {
                    self.free.insert((seg.erase_count, s as u32));
                }
                State::Open { stream, .. } => self.open[stream.index()] = Some(s as u32),
                _ => {}
            }
        }
        self.segs = segs;
    }

    /// Check the free list against the states (tests and the simulator).
    pub fn audit(&self) -> Result<(), String> {
        for (s, seg) in self.segs.iter().enumerate() {
            let listed = self.free.contains(&(seg.erase_count, s as u32));
            if listed != (seg.state == State::Free) {
                return Err(format!("segment {s}: state {:?}, on the free list: {listed}", seg.state));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_fill_a_segment_then_open_the_least_worn() {
        let mut sp = Space::new(4, 8, 1);
        sp.segs[0].erase_count = 5;
        sp.free = (0..4).map(|s| (sp.segs[s as usize].erase_count, s)).collect();
        let g = sp.grant(Stream::ONE, 3, 1, false).unwrap();
        assert_eq!((g.segment, g.first, g.count), (1, 1, 3), "least worn: segment 1");
        assert!(g.opened.is_some());
        let g = sp.grant(Stream::ONE, 10, 2, false).unwrap();
        assert_eq!((g.segment, g.first, g.count), (1, 5, 2), "the rest of segment 1");
        assert_eq!(sp.segs[1].state, State::Full);
        let g = sp.grant(Stream::ONE, 1, 3, false).unwrap();
        assert_eq!(g.segment, 2);
        assert_eq!(sp.grant(Stream::user(1), 1, 4, false).unwrap().segment, 3);
        assert!(sp.grant(Stream::gc(1), 1, 5, false).is_none(), "the last free segment is the reserve");
        assert_eq!(sp.grant(Stream::gc(1), 1, 5, true).unwrap().segment, 0, "cleaning may take it");
        sp.audit().unwrap();
    }

    #[test]
    fn only_covered_segments_are_cleaned_and_freed_after_durability() {
        let mut sp = Space::new(3, 16, 0);
        let mut map = Map::new(3, 16);
        let g = sp.grant(Stream::ONE, 14, 7, false).unwrap();
        assert_eq!(sp.segs[g.segment as usize].state, State::Full);
        assert_eq!(sp.victim(&map), None, "seq 7 is past the checkpoint");
        sp.covered_seq = 7;
        let mut vm = crate::map::VolMap::new(8);
        map.set(&mut vm, 0, g.segment * 16 + 1).unwrap();
        assert_eq!(sp.victim(&map), Some(g.segment));
        sp.release(g.segment, 9);
        sp.durable(8);
        assert!(matches!(sp.segs[g.segment as usize].state, State::Releasing { .. }));
        sp.durable(9);
        assert_eq!(sp.segs[g.segment as usize].state, State::Free);
        sp.audit().unwrap();
    }
}
