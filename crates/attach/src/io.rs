//! The I/O threads: one per lane, each the only owner of its lane.
//!
//! What owns what:
//! - An [`IoThread`] owns one `initiator::Lane` (the connection, its caravans, reconnection) and
//!   the table of the requests in flight on it, each with its [`Ticket`]: how to answer it and
//!   what its completion settles. No other thread touches the lane, so it takes no lock.
//! - A [`Queue`], one per I/O thread and shared with the FUSE threads that feed it, holds the
//!   requests waiting to be submitted (bounded) and the pool of request buffers made at
//!   start-up. FUSE threads push; the I/O thread takes everything queued at once, submits it
//!   into the lane's open caravan and sends it, so whatever queued together travels together.
//! - A [`Request`] carries its buffer and its ticket. When its completion arrives, the I/O
//!   thread settles the ticket: gives back an aligned write's hold on the write gate, counts a
//!   write done or a flush's coverage, answers (a reply to the kernel, or a waiting thread's
//!   wake-up), and returns a pool buffer to the pool.
//!
//! The I/O thread sleeps in one place, [`initiator::Lane::sleep`], on the lane's socket and on
//! the queue's eventfd at once. A FUSE thread rings the eventfd only when it queues a request
//! while the I/O thread sleeps, so a busy I/O thread is never woken and never woken twice.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Release;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use initiator::{Completion, Kick, Lane, LaneStats, Rejected, ReqFlags};
use wire::Opcode;

use crate::gate::SharedHold;
use crate::volume::{Chunk, IoError, Writes};

/// Where the outcome of a request goes once its I/O thread has it: the kernel, through fuser's
/// reply objects (`fs`), or a test's recorder. Each is answered exactly once, on whichever
/// thread has the outcome.
pub trait Reply: Send + 'static {
    /// A read's bytes.
    fn data(self, bytes: &[u8]);
    /// A write's length.
    fn written(self, bytes: usize);
    /// A flush (or a zeroing) done.
    fn ok(self);
    fn error(self, errno: i32);
}

/// Who hears of a request's outcome.
pub(crate) enum Answer<R> {
    /// The kernel, answered by the I/O thread: the common path.
    Reply(R),
    /// A thread that waits for this one request (split I/O, read-modify-write, zeroing).
    Wake(Arc<Waiter>),
}

/// What the I/O thread keeps of a request while it is in flight.
pub(crate) struct Ticket<R> {
    pub(crate) opcode: Opcode,
    pub(crate) length: usize,
    pub(crate) answer: Answer<R>,
    /// An aligned write's hold on the write gate, given back at its completion.
    pub(crate) hold: Option<SharedHold>,
    /// A flush's count of completed writes when it was queued: what it makes durable.
    pub(crate) covers: u64,
}

/// A request on its way to an I/O thread.
pub(crate) struct Request<R> {
    pub(crate) flags: ReqFlags,
    pub(crate) offset: u64,
    /// A read's or a write's buffer, `length` bytes long.
    pub(crate) buf: Option<Chunk>,
    pub(crate) ticket: Ticket<R>,
}

/// A request's outcome, for the thread that waits for it, with its buffer.
pub(crate) struct Outcome {
    pub(crate) result: initiator::Result<()>,
    pub(crate) buf: Option<Chunk>,
}

/// Where one thread waits for its requests on the rare paths, one at a time.
#[derive(Default)]
pub(crate) struct Waiter {
    outcome: Mutex<Option<Outcome>>,
    ready: Condvar,
}

impl Waiter {
    fn wake(&self, outcome: Outcome) {
        *lock(&self.outcome) = Some(outcome);
        self.ready.notify_one();
    }

    /// Wait for the outcome of the request out.
    pub(crate) fn wait(&self) -> Outcome {
        let mut slot = lock(&self.outcome);
        loop {
            if let Some(outcome) = slot.take() {
                return outcome;
            }
            slot = self.ready.wait(slot).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Every lock here guards a few fields that each change is complete in: a panic while holding
/// one leaves them consistent, so a poisoned lock is taken as it is.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An I/O thread's way in, shared with the FUSE threads.
pub(crate) struct Queue<R> {
    state: Mutex<QueueState<R>>,
    /// Rung when a request is queued while the I/O thread sleeps, and to stop it.
    kick: Kick,
    /// Where a FUSE thread waits for a free buffer or for room in the queue: a stall that the
    /// pool's size keeps off the common path.
    room: Condvar,
}

struct QueueState<R> {
    /// Requests not yet taken by the I/O thread, at most `pending_max`.
    pending: VecDeque<Request<R>>,
    pending_max: usize,
    /// The pool's free buffers; its capacity is the pool's size.
    buffers: Vec<Chunk>,
    /// The I/O thread sleeps, or is about to: the next request must ring the kick.
    asleep: bool,
    stopping: bool,
    /// FUSE threads waiting in `room`, and how often one had to.
    stalled: usize,
    stalls: u64,
    /// The lane's counters, as the I/O thread last saw them.
    stats: LaneStats,
}

impl<R: Reply> Queue<R> {
    /// A queue of at most `pending_max` requests and a pool of `buffers`.
    pub(crate) fn new(pending_max: usize, buffers: Vec<Chunk>) -> std::io::Result<Queue<R>> {
        Ok(Queue {
            state: Mutex::new(QueueState {
                pending: VecDeque::with_capacity(pending_max),
                pending_max,
                buffers,
                asleep: false,
                stopping: false,
                stalled: 0,
                stalls: 0,
                stats: LaneStats::default(),
            }),
            kick: Kick::new()?,
            room: Condvar::new(),
        })
    }

    /// Queue a request, waiting while the queue is full. With `refill`, an empty spare buffer
    /// is refilled from the pool on the same visit, if one is free. Once the I/O thread has
    /// stopped, the request is handed back.
    pub(crate) fn push(
        &self,
        request: Request<R>,
        refill: Option<&mut Option<Chunk>>,
    ) -> Result<(), Request<R>> {
        let mut st = lock(&self.state);
        while st.pending.len() >= st.pending_max && !st.stopping {
            st = self.stall(st);
        }
        if st.stopping {
            return Err(request);
        }
        st.pending.push_back(request);
        if let Some(spare) = refill.filter(|s| s.is_none()) {
            *spare = st.buffers.pop();
        }
        let wake = std::mem::take(&mut st.asleep);
        drop(st);
        if wake {
            self.kick.kick();
        }
        Ok(())
    }

    /// A buffer from the pool, waiting for one to come back if none is free; `None` once the
    /// I/O thread has stopped.
    pub(crate) fn take_buffer(&self) -> Option<Chunk> {
        let mut st = lock(&self.state);
        loop {
            if st.stopping {
                return None;
            }
            if let Some(buf) = st.buffers.pop() {
                return Some(buf);
            }
            st = self.stall(st);
        }
    }

    /// Return a buffer taken with [`take_buffer`](Self::take_buffer) or `push`'s refill.
    pub(crate) fn give_back(&self, buf: Chunk) {
        let mut st = lock(&self.state);
        if st.buffers.len() < st.buffers.capacity() {
            st.buffers.push(buf);
        }
    }

    fn stall<'a>(&self, mut st: MutexGuard<'a, QueueState<R>>) -> MutexGuard<'a, QueueState<R>> {
        if st.stalls == 0 {
            tracing::debug!("a FUSE thread waits for a request buffer or queue room");
        }
        st.stalled += 1;
        st.stalls += 1;
        st = self.room.wait(st).unwrap_or_else(|p| p.into_inner());
        st.stalled -= 1;
        st
    }

    /// Tell the I/O thread to stop: it answers what is queued and in flight with an error and
    /// ends. Requests pushed after this are handed back.
    pub(crate) fn stop(&self) {
        lock(&self.state).stopping = true;
        self.room.notify_all();
        self.kick.kick();
    }

    pub(crate) fn stats(&self) -> LaneStats {
        lock(&self.state).stats
    }

    /// How often a FUSE thread had to wait for a buffer or for room.
    pub(crate) fn stalls(&self) -> u64 {
        lock(&self.state).stalls
    }
}

/// One lane's owner: takes requests from its queue, submits them, and settles completions.
pub(crate) struct IoThread<R> {
    lane: Lane<Chunk>,
    queue: Arc<Queue<R>>,
    writes: Arc<Writes>,
    /// Requests taken from the queue and not yet accepted by the lane.
    batch: VecDeque<Request<R>>,
    /// In flight, by the `user_data` the lane knows them by; `free` holds the unused indices.
    tickets: Vec<Option<Ticket<R>>>,
    free: Vec<usize>,
    done: Vec<Completion<Chunk>>,
    /// Pool buffers of settled requests, back to the pool on the next visit to the queue.
    returned: Vec<Chunk>,
    /// The lane failed for good, and that was said.
    failed: bool,
    /// Run under `SCHED_BATCH` ([`crate::AttachConfig::sched_batch`]).
    sched_batch: bool,
}

impl<R: Reply> IoThread<R> {
    /// Start the thread that owns `lane` and serves `queue`.
    pub(crate) fn start(
        lane: Lane<Chunk>,
        queue: Arc<Queue<R>>,
        writes: Arc<Writes>,
        name: String,
        sched_batch: bool,
    ) -> std::io::Result<JoinHandle<()>> {
        let slots = lane.queue_depth();
        let pool = lock(&queue.state).buffers.capacity();
        let thread = IoThread {
            lane,
            queue,
            writes,
            batch: VecDeque::with_capacity(slots),
            tickets: (0..slots).map(|_| None).collect(),
            free: (0..slots).rev().collect(),
            done: Vec::with_capacity(slots),
            returned: Vec::with_capacity(pool),
            failed: false,
            sched_batch,
        };
        std::thread::Builder::new().name(name).spawn(move || thread.run())
    }

    fn run(mut self) {
        crate::prepare_io_thread(self.sched_batch);
        loop {
            // Completions first, so that their buffers are back in the pool on the visit to the
            // queue that follows, before the kernel's next requests need them.
            let settled = self.complete();
            if self.take_queued() {
                break;
            }
            let submitted = self.submit();
            if submitted == 0 && settled == 0 {
                self.sleep();
            }
        }
        self.fail_everything();
    }

    /// Visit the queue: return pool buffers, take what is queued (as much as the lane has
    /// slots for), publish the lane's counters. Returns whether to stop.
    fn take_queued(&mut self) -> bool {
        let queue = self.queue.clone();
        let mut st = lock(&queue.state);
        st.asleep = false;
        let returned = !self.returned.is_empty();
        st.buffers.append(&mut self.returned);
        let room = self.free.len().saturating_sub(self.batch.len());
        let n = st.pending.len().min(room);
        self.batch.extend(st.pending.drain(..n));
        if st.stalled > 0 && (returned || n > 0) {
            queue.room.notify_all();
        }
        st.stats = self.lane.stats();
        st.stopping
    }

    /// Put the batch in the lane's open caravan and send it. Returns how many requests left
    /// the batch (accepted, or refused and answered).
    fn submit(&mut self) -> usize {
        let mut accepted = 0;
        let mut refused = 0;
        while let Some(Request { flags, offset, buf, ticket }) = self.batch.pop_front() {
            let Some(slot) = self.free.pop() else {
                self.batch.push_front(Request { flags, offset, buf, ticket });
                break;
            };
            let Ticket { opcode, length, .. } = ticket;
            match self.lane.submit(opcode, flags, offset, length, buf, slot as u64) {
                Ok(()) => {
                    self.tickets[slot] = Some(ticket);
                    accepted += 1;
                }
                Err(Rejected { error: initiator::Error::QueueFull(_), buf }) => {
                    // The lane came back from a reconnection with a smaller queue: wait for room.
                    self.free.push(slot);
                    self.batch.push_front(Request { flags, offset, buf, ticket });
                    break;
                }
                Err(Rejected { error, buf }) => {
                    self.free.push(slot);
                    self.settle(ticket, Err(error), buf);
                    refused += 1;
                }
            }
        }
        if accepted > 0 {
            // Nothing else is queued: what was taken together leaves together.
            if let Err(e) = self.lane.commit() {
                self.report(&e);
            }
        }
        accepted + refused
    }

    /// Settle every completion that has arrived. Returns how many.
    fn complete(&mut self) -> usize {
        let mut done = std::mem::take(&mut self.done);
        // Even when the lane fails, what it completed (with an error) is in `done`.
        if let Err(e) = self.lane.poll(&mut done) {
            self.report(&e);
        }
        let n = done.len();
        for c in done.drain(..) {
            let slot = c.user_data as usize;
            let Some(ticket) = self.tickets.get_mut(slot).and_then(Option::take) else {
                debug_assert!(false, "a completion for no request in flight: {slot}");
                continue;
            };
            self.free.push(slot);
            let result = if c.status.is_ok() { Ok(()) } else { Err(initiator::Error::Status(c.status)) };
            self.settle(ticket, result, c.buf);
        }
        self.done = done;
        n
    }

    /// A request is over: give back its hold, count what it did, answer, recycle its buffer.
    fn settle(&mut self, ticket: Ticket<R>, result: initiator::Result<()>, buf: Option<Chunk>) {
        let Ticket { opcode, length, answer, hold, covers } = ticket;
        if let Some(hold) = hold {
            self.writes.gate.leave_shared(hold);
        }
        let reply = match answer {
            // The waiting thread counts and answers for itself, and keeps its buffer.
            Answer::Wake(waiter) => return waiter.wake(Outcome { result, buf }),
            Answer::Reply(reply) => reply,
        };
        match result {
            Ok(()) => match opcode {
                Opcode::Read => reply.data(buf.as_ref().map_or(&[], |b| b.as_ref())),
                Opcode::Write => {
                    // Counted before the kernel hears of it: a flush after that must be sent.
                    self.writes.done.fetch_add(1, Release);
                    reply.written(length)
                }
                Opcode::Flush => {
                    self.writes.flushed.fetch_max(covers, Release);
                    reply.ok()
                }
                _ => reply.ok(),
            },
            Err(e) => reply.error(IoError::from(e).errno()),
        }
        if let Some(buf) = buf {
            self.returned.push(buf);
        }
    }

    /// Sleep until the lane or the queue has something, unless the queue has already.
    fn sleep(&mut self) {
        {
            let mut st = lock(&self.queue.state);
            let can_take = !st.pending.is_empty() && self.free.len() > self.batch.len();
            if can_take || st.stopping {
                return;
            }
            st.asleep = true;
        }
        if let Err(e) = self.lane.sleep(&self.queue.kick) {
            self.report(&e);
        }
    }

    /// Say once that the lane failed for good; what it failed completes with errors anyway.
    fn report(&mut self, e: &initiator::Error) {
        if self.lane.is_broken() && !self.failed {
            self.failed = true;
            tracing::error!(export = %self.lane.export().name, error = %e, "lane failed: its requests fail with EIO");
        } else {
            tracing::debug!(error = %e, "lane");
        }
    }

    /// Stopping: answer everything still queued or in flight with an error.
    fn fail_everything(&mut self) {
        let queue = self.queue.clone();
        let mut st = lock(&queue.state);
        self.batch.extend(st.pending.drain(..));
        drop(st);
        while let Some(Request { buf, ticket, .. }) = self.batch.pop_front() {
            self.settle(ticket, Err(initiator::Error::Closed), buf);
        }
        for slot in 0..self.tickets.len() {
            if let Some(ticket) = self.tickets[slot].take() {
                self.settle(ticket, Err(initiator::Error::Closed), None);
            }
        }
        st = lock(&queue.state);
        st.buffers.append(&mut self.returned);
        st.stats = self.lane.stats();
    }
}
