//! A segment that threads share (issue 32): one [`Segment`] (a lane to each server) serving
//! many threads with a few requests each, as [`initiator::SharedLanes`] serve an export.
//!
//! Each thread takes a [`SegmentHandle`], which is a [`Queue`] like the segment itself and has
//! the blocking `read` and `write`. No thread runs besides the callers':
//! - submitting takes the segment's lock, queues the request, and sends what the lanes have
//!   room for;
//! - one waiting caller at a time is the receiver: under the lock it takes in what the lanes
//!   completed and puts each completion in its owner's mailbox (waking the owners), then sleeps
//!   *without the lock* on every lane's socket at once, so others submit meanwhile. The other
//!   waiters sleep until the receiver hands them a completion, or the role is free.
//!
//! A request's `user_data` carries its handle in its top 16 bits on the segment: a handle's
//! caller may use up to [`USER_DATA_MAX`]. The segment heals under the handles as it does
//! alone (a heal blocks the thread that holds the lock for it).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use initiator::{Completion, Error, LaneConfig, Queue, Rejected, ReqFlags, Result};
use wire::Opcode;

use crate::segment::{Segment, SegmentMap, SegmentStats};

/// The top 16 bits of a request's `user_data` on the segment name its handle.
const ID_SHIFT: u32 = 48;
/// Largest `user_data` a handle's caller may give a request.
pub const USER_DATA_MAX: u64 = (1 << ID_SHIFT) - 2;
/// Most handles at once.
pub const HANDLES_MAX: usize = 1 << (64 - ID_SHIFT);
/// The longest a receiver sleeps on the lanes before it looks again (a write refused with
/// `Busy` waits 200 µs to go again, and sends happen on submit).
const RECEIVE_SLICE: Duration = Duration::from_millis(1);

/// A segment for many threads: cheap to clone, each thread takes a [`handle`](Self::handle).
#[derive(Clone)]
pub struct SharedSegment {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    /// Signalled when completions land in mailboxes, or the receiver's role is free.
    delivered: Condvar,
    len: u64,
    block: u64,
}

struct State {
    segment: Segment,
    /// Completions by handle, not yet taken by their owner.
    mailboxes: Vec<VecDeque<Completion>>,
    /// Handles in use.
    taken: Vec<bool>,
    receiving: bool,
    scratch: Vec<Completion>,
    fds: Vec<std::os::fd::RawFd>,
}

impl SharedSegment {
    /// `segment`, shared.
    pub fn new(segment: Segment) -> SharedSegment {
        let (len, block) = (segment.len(), segment.block_bytes());
        let state = State {
            segment,
            mailboxes: Vec::new(),
            taken: Vec::new(),
            receiving: false,
            scratch: Vec::new(),
            fds: Vec::new(),
        };
        SharedSegment {
            inner: Arc::new(Inner { state: Mutex::new(state), delivered: Condvar::new(), len, block }),
        }
    }

    /// Map `map` for sharing (as [`Segment::map`]).
    pub fn map(map: SegmentMap, config: &LaneConfig) -> Result<SharedSegment> {
        Ok(SharedSegment::new(Segment::map(map, config)?))
    }

    /// A handle for one thread.
    pub fn handle(&self) -> Result<SegmentHandle> {
        let mut st = self.inner.lock();
        let id = match st.taken.iter().position(|t| !t) {
            Some(id) => id,
            None if st.taken.len() < HANDLES_MAX => {
                st.taken.push(false);
                st.mailboxes.push(VecDeque::new());
                st.taken.len() - 1
            }
            None => return Err(Error::InvalidArgument("every handle of the shared segment is taken")),
        };
        st.taken[id] = true;
        Ok(SegmentHandle {
            inner: self.inner.clone(),
            id,
            in_flight: 0,
            own: Vec::new(),
            own_done: Vec::new(),
        })
    }

    pub fn len(&self) -> u64 {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    pub fn block_bytes(&self) -> u64 {
        self.inner.block
    }

    pub fn stats(&self) -> SegmentStats {
        self.inner.lock().segment.stats()
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A thread that panicked with the lock left the segment as consistent as any caller
        // could: go on.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl State {
    /// Take in what the segment completed, each into its owner's mailbox; whether any went to
    /// a handle other than `me`.
    fn deliver(&mut self, me: usize) -> bool {
        let mut others = false;
        for mut c in self.scratch.drain(..) {
            let id = (c.user_data >> ID_SHIFT) as usize;
            c.user_data &= (1 << ID_SHIFT) - 1;
            if let Some(mailbox) = self.mailboxes.get_mut(id) {
                others |= id != me;
                mailbox.push_back(c);
            }
        }
        others
    }
}

/// One thread's access to a [`SharedSegment`].
pub struct SegmentHandle {
    inner: Arc<Inner>,
    id: usize,
    in_flight: usize,
    own: Vec<u8>,
    own_done: Vec<Completion>,
}

impl SegmentHandle {
    /// Read `buf.len()` bytes at `offset` of the segment, blocking.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let (mut own, mut done) = (std::mem::take(&mut self.own), std::mem::take(&mut self.own_done));
        let read = crate::segment::blocking_read(self, &mut own, &mut done, offset, buf);
        (self.own, self.own_done) = (own, done);
        read
    }

    /// Write `data` at `offset` of the segment, blocking.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let (mut own, mut done) = (std::mem::take(&mut self.own), std::mem::take(&mut self.own_done));
        let written = crate::segment::blocking_write(self, &mut own, &mut done, offset, data);
        (self.own, self.own_done) = (own, done);
        written
    }

    fn submit_tagged(
        &mut self,
        opcode: Opcode,
        offset: u64,
        length: usize,
        buf: Vec<u8>,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<Vec<u8>>> {
        let tagged = (self.id as u64) << ID_SHIFT | user_data;
        let mut st = self.inner.lock();
        st.segment.submit(opcode, ReqFlags::empty(), offset, length, Some(buf), tagged)?;
        // Send now: nobody may wait on the lanes for a while.
        let mut scratch = std::mem::take(&mut st.scratch);
        let polled = st.segment.poll(&mut scratch);
        st.scratch = scratch;
        let others = st.deliver(self.id);
        drop(st);
        if others {
            self.inner.delivered.notify_all();
        }
        self.in_flight += 1;
        polled.map(drop).map_err(|error| Rejected { error, buf: None })
    }
}

impl Drop for SegmentHandle {
    fn drop(&mut self) {
        let mut st = self.inner.lock();
        // Completions that waited count as done: only requests still out keep the number.
        self.in_flight -= st.mailboxes[self.id].len().min(self.in_flight);
        st.mailboxes[self.id].clear();
        // A handle dropped with requests out keeps its number: their completions must not
        // reach the next owner of it.
        st.taken[self.id] = self.in_flight > 0;
    }
}

impl Queue<Vec<u8>> for SegmentHandle {
    fn submit(
        &mut self,
        opcode: Opcode,
        _flags: ReqFlags,
        offset: u64,
        length: usize,
        buf: Option<Vec<u8>>,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<Vec<u8>>> {
        if user_data > USER_DATA_MAX {
            return Err(Rejected { error: Error::InvalidArgument("user_data above USER_DATA_MAX"), buf });
        }
        let Some(buf) = buf else {
            return Err(Rejected {
                error: Error::InvalidArgument("a segment request needs a buffer"),
                buf: None,
            });
        };
        self.submit_tagged(opcode, offset, length, buf, user_data)
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> Result<usize> {
        let min = min.min(self.in_flight);
        let mut got = 0;
        let mut st = self.inner.lock();
        loop {
            while let Some(c) = st.mailboxes[self.id].pop_front() {
                out.push(c);
                got += 1;
                self.in_flight -= 1;
            }
            if got >= min {
                return Ok(got);
            }
            if st.receiving {
                // The receiver hands completions out; or gives its role up.
                st = match self.inner.delivered.wait_timeout(st, RECEIVE_SLICE * 4) {
                    Ok((g, _)) => g,
                    Err(poisoned) => poisoned.into_inner().0,
                };
                continue;
            }
            // The receiver now: take in what arrived, then sleep on every lane without the lock.
            st.receiving = true;
            let mut scratch = std::mem::take(&mut st.scratch);
            let polled = st.segment.poll(&mut scratch);
            st.scratch = scratch;
            let others = st.deliver(self.id);
            if others {
                self.inner.delivered.notify_all();
            }
            if let Err(e) = polled {
                st.receiving = false;
                self.inner.delivered.notify_all();
                return Err(e);
            }
            if !st.mailboxes[self.id].is_empty() {
                st.receiving = false;
                self.inner.delivered.notify_one();
                continue;
            }
            let mut fds = std::mem::take(&mut st.fds);
            fds.clear();
            st.segment.wake_fds(&mut fds);
            drop(st);
            if fds.is_empty() {
                std::thread::sleep(RECEIVE_SLICE / 4);
            } else {
                let _ = transport::wait_any(&fds, Some(RECEIVE_SLICE));
            }
            st = self.inner.lock();
            st.fds = fds;
            st.receiving = false;
            // Another waiter may take the role (or its completions) at once.
            self.inner.delivered.notify_one();
        }
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        let mut st = self.inner.lock();
        if !st.receiving {
            let mut scratch = std::mem::take(&mut st.scratch);
            let polled = st.segment.poll(&mut scratch);
            st.scratch = scratch;
            if st.deliver(self.id) {
                self.inner.delivered.notify_all();
            }
            polled?;
        }
        let mut got = 0;
        while let Some(c) = st.mailboxes[self.id].pop_front() {
            out.push(c);
            got += 1;
            self.in_flight -= 1;
        }
        Ok(got)
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}
