//! A worker's connections, and which of them each loop pass reads and flushes.
//!
//! Readiness is edge-triggered: the poller reports a connection once when bytes arrive or
//! room opens in its socket, not again while they wait. So the one rule that keeps every
//! connection alive is that a pass ends with a connection left to sleep only when its socket
//! will raise another event for it:
//!
//! - its last receive found the socket empty (or read less than it offered, which on a stream
//!   socket means the same), so the next byte to arrive raises a readable event; or
//! - it stopped reading because its queued replies passed the backlog bound, *and* the flush
//!   after that left them over the bound, which it only does when the socket refused a send:
//!   the writable event that follows brings it back; or
//! - it is closing and reads nothing more.
//!
//! Everything else is carried to the next pass, which polls without waiting: a connection
//! that used up its receive budget, and one paused for its backlog whose flush then brought
//! the backlog under the bound (the socket took it all, so no writable event will come; the
//! bytes that arrived meanwhile would otherwise sit unread for ever, issue 26).
//!
//! This type is the worker's pass logic without the poller, so that `crate::model` runs it
//! over modelled sockets with every order of events, and `crate::worker` over `mio`.

use crate::conn::{Conn, ConnStream, ReadOutcome};
use crate::stats::WorkerStats;
use crate::Shared;

/// What the driver of a [`ConnSet`] does beside it: release a connection's registrations and
/// hand a staged connection's replies to another thread.
pub(crate) trait Driver<S> {
    /// Connection `index` was removed: deregister it, forget its stage thread handle.
    fn closed(&mut self, index: usize, conn: &mut Conn<S>);

    /// Take the replies of a connection that another thread sends for (`crate::stages`);
    /// returns whether it did. Run-to-completion connections send their own.
    fn hand_off(&mut self, _conn: &mut Conn<S>) -> bool {
        false
    }
}

#[cfg(test)]
thread_local! {
    /// Tests only: leave paused connections asleep, as before issue 26 was fixed, so that the
    /// model (`crate::model`) can show it catches the stall.
    pub(crate) static SKIP_RESUME: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(crate) struct ConnSet<S> {
    conns: Vec<Option<Conn<S>>>,
    free: Vec<usize>,
    /// Connections to read from this pass.
    readable: Vec<usize>,
    /// Connections to read from in the next pass without waiting for an event.
    carry: Vec<usize>,
    /// Connections with replies to flush this pass.
    dirty: Vec<usize>,
    /// Connections that stopped reading for their backlog in this pass's reads.
    paused: Vec<usize>,
}

impl<S: ConnStream> ConnSet<S> {
    pub fn new() -> ConnSet<S> {
        ConnSet {
            conns: Vec::new(),
            free: Vec::new(),
            readable: Vec::new(),
            carry: Vec::new(),
            dirty: Vec::new(),
            paused: Vec::new(),
        }
    }

    /// The slot a new connection will take.
    pub fn next_index(&self) -> usize {
        self.free.last().copied().unwrap_or(self.conns.len())
    }

    /// Add a connection in the slot [`next_index`](Self::next_index) named; it is read
    /// once in the next pass (bytes may have come before it was registered, and edges would
    /// not say so) and flushed (a greeting may be queued).
    pub fn insert(&mut self, conn: Conn<S>) -> usize {
        let index = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        self.conns[index] = Some(conn);
        self.dirty.push(index);
        index
    }

    pub fn get(&self, index: usize) -> Option<&Conn<S>> {
        self.conns.get(index).and_then(Option::as_ref)
    }

    pub fn get_mut(&mut self, index: usize) -> Option<&mut Conn<S>> {
        self.conns.get_mut(index).and_then(Option::as_mut)
    }

    /// Whether any connection is open.
    pub fn is_empty(&self) -> bool {
        self.free.len() == self.conns.len()
    }

    /// Slots there are, open or free: `0..slots()` covers every connection without
    /// collecting their indexes (which would allocate on the worker's path).
    pub fn slots(&self) -> usize {
        self.conns.len()
    }

    /// Slots of every open connection.
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn indexes(&self) -> impl Iterator<Item = usize> + '_ {
        self.conns.iter().enumerate().filter(|(_, c)| c.is_some()).map(|(i, _)| i)
    }

    /// Read connection `index` in this pass.
    pub fn mark_readable(&mut self, index: usize) {
        self.readable.push(index);
    }

    /// Flush connection `index` in this pass.
    pub fn mark_dirty(&mut self, index: usize) {
        self.dirty.push(index);
    }

    /// The poller reported connection `index`. Room in its socket resumes sending, and
    /// reading too (a backlog may have paused it).
    pub fn ready(&mut self, index: usize, readable: bool, writable: bool) {
        if readable || writable {
            self.readable.push(index);
        }
        if writable {
            self.dirty.push(index);
        }
    }

    /// The flash pages connection `index` waited for have landed: execute what waited, then
    /// read on, in the next pass. `token` is the one its batch was made with; a connection
    /// closed since (and its slot taken by another) is left alone.
    pub fn wake(&mut self, index: usize, token: u64) {
        let Some(conn) = self.get_mut(index) else { return };
        if conn.batch_token() != Some(token) {
            return;
        }
        conn.resume();
        self.readable.push(index);
    }

    /// Some connection must be read again without waiting for an event.
    pub fn has_carry(&self) -> bool {
        !self.carry.is_empty()
    }

    /// Whether a pass has anything to do.
    pub fn has_work(&self) -> bool {
        !(self.readable.is_empty() && self.carry.is_empty() && self.dirty.is_empty())
    }

    /// One loop pass after the poll: read (and execute) on every connection due, then flush
    /// every connection with replies, then carry over whoever no event would wake.
    pub fn pass(&mut self, shared: &Shared, stats: &WorkerStats, driver: &mut impl Driver<S>) {
        self.readable.append(&mut self.carry);
        self.read_pass(shared, stats, driver);
        self.flush_pass(shared, stats, driver);
        self.resume_paused(shared);
    }

    fn read_pass(&mut self, shared: &Shared, stats: &WorkerStats, driver: &mut impl Driver<S>) {
        self.readable.sort_unstable();
        self.readable.dedup();
        // Taken out for the pass and put back empty, so its allocation is kept: nothing on
        // this path allocates after warm-up (tests/tests/no_alloc.rs).
        let mut readable = std::mem::take(&mut self.readable);
        for &i in &readable {
            let Some(conn) = self.get_mut(i) else { continue };
            let outcome = conn.service(shared, stats);
            if conn.newly_established() {
                shared.admission.established(&conn.ticket);
            }
            match outcome {
                ReadOutcome::Drained => {}
                ReadOutcome::More => self.carry.push(i),
                ReadOutcome::Paused => self.paused.push(i),
                // Its batch's wake brings it back (`wake`).
                ReadOutcome::Waiting => {}
                ReadOutcome::Closed => {
                    self.close(i, shared, driver);
                    continue;
                }
            }
            self.dirty.push(i);
        }
        readable.clear();
        self.readable = readable;
    }

    /// Send every dirty connection's replies; close those that finished or failed.
    pub fn flush_pass(&mut self, shared: &Shared, stats: &WorkerStats, driver: &mut impl Driver<S>) {
        self.dirty.sort_unstable();
        self.dirty.dedup();
        let mut dirty = std::mem::take(&mut self.dirty);
        for &i in &dirty {
            let Some(conn) = self.conns.get_mut(i).and_then(Option::as_mut) else { continue };
            let stays = if driver.hand_off(conn) { !conn.closing } else { conn.flush_pass(stats) };
            if !stays {
                self.close(i, shared, driver);
            }
        }
        dirty.clear();
        self.dirty = dirty;
    }

    /// A connection that paused for its backlog and whose flush brought the backlog under
    /// the bound reads again next pass: the socket took the replies without refusing a send,
    /// so no writable event will come for it.
    fn resume_paused(&mut self, shared: &Shared) {
        #[cfg(test)]
        if SKIP_RESUME.with(|skip| skip.get()) {
            self.paused.clear();
            return;
        }
        let backlog_max = shared.config.bounds.tx_backlog_bytes_max;
        let mut paused = std::mem::take(&mut self.paused);
        for &i in &paused {
            if self.get(i).is_some_and(|c| !c.closing && !c.backlogged(backlog_max)) {
                self.carry.push(i);
            }
        }
        paused.clear();
        self.paused = paused;
    }

    /// Remove connection `index`: it finished, failed, its peer closed, or it was told to go
    /// (a TLS session not yet ended gets its `close_notify` if that cuts nothing short).
    pub fn close(&mut self, index: usize, shared: &Shared, driver: &mut impl Driver<S>) {
        let Some(mut conn) = self.conns.get_mut(index).and_then(Option::take) else { return };
        conn.abandon();
        driver.closed(index, &mut conn);
        self.free.push(index);
        shared.admission.closed(&conn.ticket, &shared.connections);
        self.carry.retain(|&c| c != index);
        self.paused.retain(|&c| c != index);
    }
}
