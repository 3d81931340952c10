//! The page pool: the one DRAM copy of each page in use, owned by the controller rather than
//! the kernel's page cache.
//!
//! Each slot holds one 4 KiB page of one volume and walks the states of FlashNet's page state
//! machine (thesis Figure 5.7): free, fetching (a read or a read-modify-write in flight),
//! filling (a whole-page write into a page that was not in DRAM), clean, dirty, and being
//! written back. Users pin a slot while they read or write its bytes; a pinned, dirty or
//! in-flight slot is never evicted. Clean, unpinned slots are evicted by CLOCK: each hit sets
//! the slot's reference bit, and the hand clears bits until it finds one clear. A use counter
//! per slot feeds the statistics; which stream a dirty page is written to is decided when it
//! is dirtied (`ctl`).
//!
//! This module holds the states only; the bytes live in the driver's memory, slot `s` at
//! `s * PAGE`.

use crate::space::Stream;

/// A slot's number in the pool.
pub type SlotId = u32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Free,
    /// Its page is being read from flash (for a read, or a partial write that needs the rest).
    Fetching,
    /// A whole-page write fills it; it has no valid bytes before that.
    Filling,
    Clean,
    Dirty,
    /// Being written to flash; `redirty`: written to meanwhile, so dirty again afterwards.
    WritingBack {
        redirty: bool,
    },
}

#[derive(Debug, Clone, Copy)]
pub struct Slot {
    pub state: SlotState,
    pub pins: u32,
    /// Senders holding its bytes to send them ([`lend`](Pool::lend)): it keeps its page
    /// (never evicted nor freed) until they let go, but unlike a pin this holds back no
    /// write to it, write-back or sync.
    pub lends: u32,
    pub vol: u32,
    pub vpage: u64,
    /// CLOCK's reference bit.
    referenced: bool,
    /// Its page was trimmed or its volume deleted while it could not be freed (pinned or in
    /// flight): it is freed as soon as it can be, and its write-back maps nothing.
    pub orphan: bool,
    /// The stream its dirty contents go to.
    pub stream: Stream,
    /// Gets since it was filled.
    pub uses: u32,
    /// When it last became dirty, by the pool's dirtying count (`Pool::dirtied`): a sync
    /// asked for at count `n` needs only the slots dirtied at or before `n`.
    pub dirtied: u64,
}

#[derive(Debug)]
pub struct Pool {
    slots: Vec<Slot>,
    free: Vec<SlotId>,
    hand: usize,
    /// Dirty slots, oldest first (entries whose slot moved on are skipped when taken).
    dirty: std::collections::VecDeque<SlotId>,
    dirty_count: u32,
    /// Times a slot became dirty (or dirty again) since the pool was made.
    dirtied: u64,
}

const EMPTY: Slot = Slot {
    state: SlotState::Free,
    pins: 0,
    lends: 0,
    vol: 0,
    vpage: 0,
    referenced: false,
    orphan: false,
    stream: Stream::ONE,
    uses: 0,
    dirtied: 0,
};

impl Pool {
    pub fn new(slots: u32) -> Pool {
        Pool {
            slots: vec![EMPTY; slots as usize],
            free: (0..slots).rev().collect(),
            hand: 0,
            dirty: std::collections::VecDeque::new(),
            dirty_count: 0,
            dirtied: 0,
        }
    }

    pub fn len(&self) -> u32 {
        self.slots.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn slot(&self, s: SlotId) -> &Slot {
        &self.slots[s as usize]
    }

    pub fn dirty_count(&self) -> u32 {
        self.dirty_count
    }

    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }

    /// A slot for page `vpage` of `vol`, in `state`, pinned once: a free one, or a clean
    /// unpinned one evicted (returned second, with the page it held). `None`: every slot is
    /// pinned, dirty or in flight.
    pub fn take(&mut self, vol: u32, vpage: u64, state: SlotState) -> Option<(SlotId, Option<(u32, u64)>)> {
        let (s, evicted) = match self.free.pop() {
            Some(s) => (s, None),
            None => {
                let s = self.evict()?;
                let old = self.slots[s as usize];
                (s, Some((old.vol, old.vpage)))
            }
        };
        self.slots[s as usize] = Slot { state, pins: 1, vol, vpage, uses: 1, ..EMPTY };
        Some((s, evicted))
    }

    /// CLOCK: the first clean, unpinned slot whose reference bit is clear, clearing bits on
    /// the way; two turns at most.
    fn evict(&mut self) -> Option<SlotId> {
        let n = self.slots.len();
        for _ in 0..2 * n {
            let i = self.hand;
            self.hand = (self.hand + 1) % n;
            let slot = &mut self.slots[i];
            if slot.state != SlotState::Clean || slot.pins > 0 || slot.lends > 0 {
                continue;
            }
            if slot.referenced {
                slot.referenced = false;
                continue;
            }
            return Some(i as SlotId);
        }
        None
    }

    /// Lend a slot's bytes to a sender: counted as a use, kept in place until
    /// [`give_back`](Self::give_back).
    pub fn lend(&mut self, s: SlotId) {
        let slot = &mut self.slots[s as usize];
        slot.lends += 1;
        slot.referenced = true;
        slot.uses = slot.uses.saturating_add(1);
    }

    /// A sender let go of a slot it was lent. Returns whether the slot was freed (an orphan
    /// no one holds any more).
    pub fn give_back(&mut self, s: SlotId) -> bool {
        let slot = &mut self.slots[s as usize];
        debug_assert!(slot.lends > 0, "gave back a slot nobody was lent");
        slot.lends -= 1;
        self.free_if_orphan(s)
    }

    /// Pin a slot for a user of its page.
    pub fn pin(&mut self, s: SlotId) {
        let slot = &mut self.slots[s as usize];
        slot.pins += 1;
        slot.referenced = true;
        slot.uses = slot.uses.saturating_add(1);
    }

    /// Unpin; `dirtied`: the user wrote its bytes, to go to `stream`. Returns whether the
    /// slot was freed (an orphan no one holds any more).
    pub fn unpin(&mut self, s: SlotId, dirtied: bool, stream: Stream) -> bool {
        let slot = &mut self.slots[s as usize];
        debug_assert!(slot.pins > 0, "unpinned a slot nobody pinned");
        slot.pins -= 1;
        if dirtied && !slot.orphan {
            slot.stream = stream;
            match slot.state {
                SlotState::Clean | SlotState::Filling => {
                    slot.state = SlotState::Dirty;
                    self.dirtied += 1;
                    slot.dirtied = self.dirtied;
                    self.dirty.push_back(s);
                    self.dirty_count += 1;
                }
                SlotState::WritingBack { redirty } => {
                    slot.state = SlotState::WritingBack { redirty: true };
                    if !redirty {
                        self.dirtied += 1;
                        slot.dirtied = self.dirtied;
                    }
                }
                // Dirty already since `slot.dirtied`: that still says when it must go out by.
                SlotState::Dirty => {}
                SlotState::Free | SlotState::Fetching => {
                    debug_assert!(false, "wrote a slot in state {:?}", slot.state)
                }
            }
        } else if slot.state == SlotState::Filling {
            // A fill given up (an error): the slot never held the page.
            slot.orphan = true;
        }
        self.free_if_orphan(s)
    }

    /// The fetch into `s` finished: clean now (`ok`), or given up: an orphan, freed once its
    /// readers let go (the caller unlinks it from its page, so nobody is served its bytes).
    pub fn fetched(&mut self, s: SlotId, ok: bool) {
        let slot = &mut self.slots[s as usize];
        debug_assert_eq!(slot.state, SlotState::Fetching);
        // No longer in flight either way: an orphan left `Fetching` would never be freed.
        slot.state = SlotState::Clean;
        slot.orphan |= !ok;
    }

    /// Check the pool's own invariants: every orphan is still held by someone (pinned, lent
    /// or being written back), or it would never be freed; a page being read in is pinned by
    /// its reader; the dirty count is the dirty slots'.
    pub fn audit(&self) -> Result<(), String> {
        let mut dirty = 0;
        for (i, slot) in self.slots.iter().enumerate() {
            dirty += u32::from(slot.state == SlotState::Dirty);
            // A page being read in is pinned by its reader until the read ends.
            if slot.state == SlotState::Fetching && slot.pins == 0 {
                return Err(format!("pool slot {i} is being read in for nobody: it is never freed"));
            }
            let writing_back = matches!(slot.state, SlotState::WritingBack { .. });
            if slot.orphan && slot.pins == 0 && slot.lends == 0 && !writing_back {
                return Err(format!(
                    "pool slot {i} is an orphan nobody holds ({:?}): it is never freed",
                    slot.state
                ));
            }
        }
        if dirty != self.dirty_count {
            return Err(format!("{dirty} dirty pool slots, {} counted", self.dirty_count));
        }
        Ok(())
    }

    /// Up to `max` dirty, unpinned slots to write back, marked as being written back; those
    /// of `stream` only, or of the stream of the first one found (`None`).
    pub fn take_dirty(&mut self, max: usize, stream: Option<Stream>, only_vol: Option<u32>) -> Vec<SlotId> {
        let mut out = Vec::new();
        let mut skipped = Vec::new();
        let mut want = stream;
        while out.len() < max {
            let Some(s) = self.dirty.pop_front() else { break };
            let slot = self.slots[s as usize];
            if slot.state != SlotState::Dirty {
                continue; // stale entry
            }
            let fits = slot.pins == 0
                && want.is_none_or(|w| w == slot.stream)
                && only_vol.is_none_or(|v| v == slot.vol);
            if !fits {
                skipped.push(s);
                continue;
            }
            want = Some(slot.stream);
            self.slots[s as usize].state = SlotState::WritingBack { redirty: false };
            self.dirty_count -= 1;
            out.push(s);
        }
        for s in skipped.into_iter().rev() {
            self.dirty.push_front(s);
        }
        out
    }

    /// The write-back of `s` finished (`ok`) or failed. Returns whether it is dirty again.
    pub fn written(&mut self, s: SlotId, ok: bool) -> bool {
        let slot = &mut self.slots[s as usize];
        let SlotState::WritingBack { redirty } = slot.state else {
            debug_assert!(false, "write-back finished for a slot in state {:?}", slot.state);
            return false;
        };
        // An orphan's page is gone (trimmed, its volume deleted): whether or not this
        // write-back made it, it is never written back again (`discard`).
        if (ok && !redirty) || slot.orphan {
            slot.state = SlotState::Clean;
            self.free_if_orphan(s);
            return false;
        }
        slot.state = SlotState::Dirty;
        self.dirty.push_back(s);
        self.dirty_count += 1;
        self.free_if_orphan(s);
        true
    }

    /// The slot's page is gone (trimmed, its volume deleted): free it now if nothing holds it,
    /// or orphan it until then. Returns whether it was freed.
    ///
    /// Its bytes are never written back again, even while a sender still holds them: a
    /// write-back after the trim was recorded would map the page again when the log is
    /// replayed. (A write-back already under way was planned before the trim, and replays
    /// before it.)
    pub fn discard(&mut self, s: SlotId) -> bool {
        let slot = &mut self.slots[s as usize];
        slot.orphan = true;
        match slot.state {
            SlotState::Dirty => {
                // Its entry in the dirty queue goes stale.
                slot.state = SlotState::Clean;
                self.dirty_count -= 1;
            }
            SlotState::WritingBack { redirty: true } => {
                slot.state = SlotState::WritingBack { redirty: false }
            }
            _ => {}
        }
        self.free_if_orphan(s)
    }

    fn free_if_orphan(&mut self, s: SlotId) -> bool {
        let slot = self.slots[s as usize];
        if !slot.orphan
            || slot.pins > 0
            || slot.lends > 0
            || matches!(slot.state, SlotState::Fetching | SlotState::WritingBack { .. })
        {
            return false;
        }
        if slot.state == SlotState::Dirty {
            self.dirty_count -= 1;
        }
        self.slots[s as usize] = EMPTY;
        self.free.push(s);
        true
    }

    /// The dirtying count now: a sync asked for now needs the slots dirtied up to it.
    pub fn dirtied(&self) -> u64 {
        self.dirtied
    }

    /// Dirty slots (of `vol`, if given; dirtied at or before count `by`, if given, a write
    /// being filled never) and how many of them are pinned, including those written to again
    /// while being written back.
    pub fn dirty_of(&self, vol: Option<u32>, by: Option<u64>) -> (u32, u32) {
        let mut c = (0, 0);
        for s in &self.slots {
            let dirty = match s.state {
                SlotState::Dirty | SlotState::WritingBack { redirty: true } => {
                    by.is_none_or(|n| s.dirtied <= n)
                }
                SlotState::Filling => by.is_none(),
                _ => false,
            };
            if dirty && !s.orphan && vol.is_none_or(|v| v == s.vol) {
                c.0 += 1;
                if s.pins > 0 || s.state != SlotState::Dirty {
                    c.1 += 1;
                }
            }
        }
        c
    }

    /// Slots in each state, and loans outstanding, for statistics and audits.
    pub fn census(&self) -> Census {
        let mut c = Census::default();
        for s in &self.slots {
            match s.state {
                SlotState::Clean => c.clean += 1,
                SlotState::Dirty => c.dirty += 1,
                SlotState::Fetching | SlotState::Filling | SlotState::WritingBack { .. } => c.in_flight += 1,
                SlotState::Free => {}
            }
            c.pinned += u32::from(s.pins > 0);
            c.lends += s.lends;
        }
        c
    }
}

/// What the pool's slots hold now ([`Pool::census`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Census {
    pub clean: u32,
    pub dirty: u32,
    /// Being read in, filled or written back.
    pub in_flight: u32,
    pub pinned: u32,
    /// Loans outstanding: a slot lent twice counts twice.
    pub lends: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_evicts_clean_unreferenced_unpinned_slots_only() {
        let mut p = Pool::new(3);
        let (a, _) = p.take(1, 0, SlotState::Fetching).unwrap();
        p.fetched(a, true);
        p.unpin(a, false, Stream::ONE);
        let (b, _) = p.take(1, 1, SlotState::Filling).unwrap();
        p.unpin(b, true, Stream::ONE); // dirty
        let (c, _) = p.take(1, 2, SlotState::Fetching).unwrap(); // stays pinned, in flight
                                                                 // Full: only `a` (clean, unpinned) may go.
        let (d, evicted) = p.take(1, 3, SlotState::Filling).unwrap();
        assert_eq!((d, evicted), (a, Some((1, 0))));
        assert!(p.take(1, 4, SlotState::Filling).is_none(), "b is dirty, c and d pinned");
        let _ = c;
    }

    #[test]
    fn a_slot_written_during_its_write_back_is_dirty_again() {
        let mut p = Pool::new(2);
        let (a, _) = p.take(1, 0, SlotState::Filling).unwrap();
        p.unpin(a, true, Stream::user(1));
        assert_eq!(p.take_dirty(8, None, None), vec![a]);
        p.pin(a);
        p.unpin(a, true, Stream::ONE);
        assert!(p.written(a, true), "redirtied");
        assert_eq!(p.slot(a).state, SlotState::Dirty);
        assert_eq!(p.take_dirty(8, Some(Stream::user(1)), None), vec![], "it goes to the hot stream now");
        assert_eq!(p.take_dirty(8, Some(Stream::ONE), None), vec![a]);
        assert!(!p.written(a, true));
        assert_eq!(p.dirty_count(), 0);
    }

    #[test]
    fn a_sync_asked_at_a_count_waits_only_for_pages_dirtied_by_then() {
        let mut p = Pool::new(4);
        let (a, _) = p.take(1, 0, SlotState::Filling).unwrap();
        p.unpin(a, true, Stream::ONE);
        let asked = p.dirtied();
        let (b, _) = p.take(1, 1, SlotState::Filling).unwrap();
        p.unpin(b, true, Stream::ONE);
        let (_filling, _) = p.take(1, 2, SlotState::Filling).unwrap();
        assert_eq!(p.dirty_of(None, Some(asked)), (1, 0), "only a; b came after, the fill is no write yet");
        assert_eq!(p.dirty_of(None, None), (3, 1), "everything, the pinned fill included");
        // Written again while dirty: still due by the count it was first dirtied at.
        p.pin(a);
        p.unpin(a, true, Stream::ONE);
        assert_eq!(p.dirty_of(None, Some(asked)), (1, 0));
        // In a write-back and written again: its old bytes go with that write-back, its new
        // ones are newer than the count.
        assert_eq!(p.take_dirty(8, None, None), vec![a, b]);
        p.pin(a);
        p.unpin(a, true, Stream::ONE);
        assert_eq!(p.dirty_of(None, Some(asked)), (0, 0));
        assert_eq!(p.dirty_of(None, Some(p.dirtied())), (1, 1), "due by now, and busy until written");
    }

    #[test]
    fn an_orphan_is_freed_when_its_last_holder_lets_go() {
        let mut p = Pool::new(1);
        let (a, _) = p.take(1, 0, SlotState::Filling).unwrap();
        p.unpin(a, true, Stream::ONE);
        let taken = p.take_dirty(1, None, None);
        assert_eq!(taken, vec![a]);
        assert!(!p.discard(a), "in flight");
        assert!(!p.written(a, true));
        assert_eq!(p.free_count(), 1);
    }

    #[test]
    fn a_failed_fetch_frees_its_slot_once_its_reader_lets_go() {
        let mut p = Pool::new(1);
        let (a, _) = p.take(1, 0, SlotState::Fetching).unwrap();
        p.fetched(a, false);
        p.audit().unwrap();
        assert!(p.unpin(a, false, Stream::ONE), "freed");
        assert_eq!((p.free_count(), p.census().in_flight), (1, 0));
        p.audit().unwrap();
    }

    #[test]
    fn a_discarded_page_is_never_written_back_while_it_is_lent() {
        let mut p = Pool::new(3);
        let (a, _) = p.take(1, 0, SlotState::Filling).unwrap();
        p.unpin(a, true, Stream::ONE);
        p.lend(a);
        assert!(!p.discard(a), "lent");
        assert_eq!((p.dirty_count(), p.take_dirty(8, None, None)), (0, vec![]), "not written back");
        // Discarded while its write-back is under way and it was written again meanwhile:
        // that write-back is its last.
        let (b, _) = p.take(1, 1, SlotState::Filling).unwrap();
        p.unpin(b, true, Stream::ONE);
        assert_eq!(p.take_dirty(8, None, None), vec![b]);
        p.pin(b);
        p.unpin(b, true, Stream::ONE);
        p.lend(b);
        assert!(!p.discard(b));
        assert!(!p.written(b, true), "not dirty again");
        // A write-back that fails after the discard does not make it dirty again either.
        let (c, _) = p.take(1, 2, SlotState::Filling).unwrap();
        p.unpin(c, true, Stream::ONE);
        assert_eq!(p.take_dirty(8, None, None), vec![c]);
        p.lend(c);
        assert!(!p.discard(c));
        assert!(!p.written(c, false), "not dirty again");
        assert_eq!((p.dirty_count(), p.take_dirty(8, None, None)), (0, vec![]));
        p.audit().unwrap();
        assert!(p.give_back(c));
        assert_eq!((p.dirty_count(), p.take_dirty(8, None, None)), (0, vec![]));
        assert!(p.give_back(a) && p.give_back(b), "freed when given back");
        assert_eq!(p.free_count(), 3);
    }
}
