//! Direct placement: read data received straight into the buffers callers posted.
//!
//! A completion caravan carries its descriptors before its read data (docs/PROTOCOL.md,
//! section 7), so once a frame's header and descriptors have arrived the lane knows which
//! buffer each following byte belongs in. A [`Placement`] holds such a frame's requests, taken
//! out of the slot table, and hands out the unfilled parts of their buffers as the leading
//! elements of the next vectored receive; the frame buffer comes last and takes whatever
//! follows (the next frame's header). Data that reached the frame buffer anyway (it came with
//! the descriptors, or while the driver was busy sending) is copied once from there, which is
//! all the copying direct placement leaves.

use std::io::IoSliceMut;

use wire::Completion;

use super::session::{IoBuf, Pending};

/// One request of the frame being placed, with the completion the target sent for it.
#[derive(Debug)]
pub(super) struct Placed<B> {
    pub pending: Pending<B>,
    pub completion: Completion,
}

/// The frame whose read data is arriving; empty when there is none.
#[derive(Debug)]
pub(super) struct Placement<B> {
    entries: Vec<Placed<B>>,
    /// Entry whose data arrives next, and how much of it is in place.
    at: usize,
    filled: usize,
    /// Payload bytes still to come.
    left: usize,
    /// Read data received into callers' buffers directly, and copied from the frame buffer,
    /// since the lane opened.
    pub placed_bytes: u64,
    pub copied_bytes: u64,
}

impl<B: IoBuf> Placement<B> {
    pub fn new() -> Placement<B> {
        Placement { entries: Vec::new(), at: 0, filled: 0, left: 0, placed_bytes: 0, copied_bytes: 0 }
    }

    pub fn is_active(&self) -> bool {
        !self.entries.is_empty()
    }

    /// Requests held here: completed by the target, not yet handed back.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Start placing a frame whose requests are `entries`, in descriptor order, with
    /// `payload_len` bytes of read data still to come. Every entry with data has a buffer of
    /// exactly its `data_len` (the session checked).
    pub fn begin(&mut self, entries: impl Iterator<Item = Placed<B>>, payload_len: usize) {
        // A second frame's entries behind an unfinished first's would take the first's
        // remaining data into the wrong buffers.
        assert!(!self.is_active(), "a frame's placement began before the last one finished");
        self.entries.extend(entries);
        self.at = 0;
        self.filled = 0;
        self.left = payload_len;
        self.skip_empty();
    }

    /// Copy the frame's data that arrived in the frame buffer (`bytes`, of which only the first
    /// part may be this frame's) into place. Returns how many bytes it took.
    pub fn absorb(&mut self, bytes: &[u8]) -> usize {
        let mut rest = &bytes[..bytes.len().min(self.left)];
        let taken = rest.len();
        self.copied_bytes += taken as u64;
        while !rest.is_empty() {
            let dest = self.dest();
            let n = dest.len().min(rest.len());
            dest[..n].copy_from_slice(&rest[..n]);
            rest = &rest[n..];
            self.advance(n);
        }
        taken
    }

    /// Fill `iov` with the unfilled parts of the buffers, in order. Returns how many it used
    /// and whether they cover all the data still to come (only then may the receive append
    /// the frame buffer after them).
    pub fn destinations<'a>(&'a mut self, iov: &mut [IoSliceMut<'a>]) -> (usize, bool) {
        let mut n = 0;
        let mut skip = self.filled;
        for e in self.entries[self.at..].iter_mut() {
            let len = e.completion.data_len as usize;
            if len == 0 {
                continue;
            }
            if n == iov.len() {
                return (n, false);
            }
            let buf = e.pending.buf.as_mut().expect("entries with data have buffers").as_mut();
            iov[n] = IoSliceMut::new(&mut buf[skip..len]);
            skip = 0;
            n += 1;
        }
        (n, true)
    }

    /// Account for `n` bytes received into [`destinations`](Self::destinations) (and the
    /// frame buffer after them); returns how many were this frame's data.
    pub fn receive(&mut self, n: usize) -> usize {
        let taken = self.advance(n);
        self.placed_bytes += taken as u64;
        taken
    }

    fn advance(&mut self, n: usize) -> usize {
        let taken = n.min(self.left);
        let mut rest = taken;
        while rest > 0 {
            let len = self.entries[self.at].completion.data_len as usize;
            let step = rest.min(len - self.filled);
            self.filled += step;
            rest -= step;
            if self.filled == len {
                self.at += 1;
                self.filled = 0;
                self.skip_empty();
            }
        }
        self.left -= taken;
        taken
    }

    /// All data is in place.
    pub fn is_complete(&self) -> bool {
        self.is_active() && self.left == 0
    }

    /// Hand back the frame's requests (complete, or failed with the connection).
    pub fn take(&mut self) -> std::vec::Drain<'_, Placed<B>> {
        self.left = 0;
        self.entries.drain(..)
    }

    fn dest(&mut self) -> &mut [u8] {
        let e = &mut self.entries[self.at];
        let len = e.completion.data_len as usize;
        &mut e.pending.buf.as_mut().expect("entries with data have buffers").as_mut()[self.filled..len]
    }

    fn skip_empty(&mut self) {
        while self.entries.get(self.at).is_some_and(|e| e.completion.data_len == 0) {
            self.at += 1;
        }
    }
}
