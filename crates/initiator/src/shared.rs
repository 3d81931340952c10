//! Shared lanes: many threads with a few requests each, one connection per core.
//!
//! A FUSE mount or a blocking API has many threads with one or a few requests outstanding
//! each. A lane per thread gives no connection enough requests to batch; instead threads take
//! a [`SharedHandle`] on one of a few [`SharedLanes`] (one per core by default), their requests
//! meet in that lane's open caravan, and the lane's doorbell (off, static, or the adaptive
//! controller of Tyche section VI.A) decides when it leaves. The lane's queue depth bounds the
//! shared queue: a submitter that finds it full waits for a slot.
//!
//! No thread runs besides the callers':
//! - submitting is inline (Tyche-NoWQ): the caller takes the lane's lock, puts its request in
//!   the open caravan, and sends the caravan if the doorbell says so;
//! - receiving is done by one waiting caller at a time, the receiver. It takes the completions
//!   that arrived, puts each in its owner's mailbox (waking the owner if it sleeps), and
//!   otherwise sleeps in the socket, without the lock, until more arrive or the open caravan's
//!   delay bound falls due. A submitter whose request opens a caravan due before the receiver
//!   would wake kicks it (an eventfd). The other waiters sleep until the receiver hands them a
//!   completion; a receiver that has what it waited for passes the role to a sleeper.
//!
//! A waiting thread thus sleeps once per wait, as any blocking API must, and a caravan of many
//! threads' requests costs one send and, usually, one receive.
//!
//! Wake-ups are made after the lock is released ([`Held`]): a thread woken while the lock is
//! still held would, on the same core, often run at once, find the lock taken and sleep again on
//! it, two context switches for nothing.

use std::cell::Cell;
use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::Thread;
use std::time::{Duration, Instant};

use rt::poll::{Wait, Waiter};
use transport::{wait_either, wait_fd, Endpoint, Kick};
use wire::{ExportInfo, Opcode, ReqFlags};

use crate::lane::{status_result, Completion, IoBuf, Lane, LaneConfig, LaneStats, Rejected};
use crate::{Error, Result};

/// The top 16 bits of a request's `user_data` on the lane name the handle it belongs to.
const ID_SHIFT: u32 = 48;
/// Largest `user_data` a shared handle's caller may give a request.
pub const USER_DATA_MAX: u64 = (1 << ID_SHIFT) - 2;
/// `user_data` of the blocking API's own requests.
const SYNC_USER_DATA: u64 = USER_DATA_MAX + 1;
/// Most handles one shared lane serves at once.
pub const HANDLES_MAX: usize = 1 << (64 - ID_SHIFT);

/// A few lanes for many threads. Cheap to share: wrap it in an `Arc` or take handles up front.
pub struct SharedLanes<B = Vec<u8>> {
    lanes: Vec<Arc<SharedLane<B>>>,
    next: AtomicUsize,
    export: ExportInfo,
}

impl<B: IoBuf + Send> SharedLanes<B> {
    /// Open `count` lanes (zero: one per core) to `export` on `endpoint`, each configured by
    /// `config`; its queue depth is what all the handles on one lane share.
    pub fn connect(
        endpoint: &Endpoint,
        export: &str,
        config: &LaneConfig,
        count: usize,
    ) -> Result<SharedLanes<B>> {
        let count = match count {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let lanes = (0..count)
            .map(|_| SharedLane::connect(endpoint, export, config).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        let export = lanes[0].lock().lane.export().clone();
        Ok(SharedLanes { lanes, next: AtomicUsize::new(0), export })
    }

    /// A handle for one thread, on the next lane in turn.
    pub fn handle(&self) -> Result<SharedHandle<B>> {
        let lane = self.lanes[self.next.fetch_add(1, Relaxed) % self.lanes.len()].clone();
        let id = lane.lock().register()?;
        Ok(SharedHandle { lane, id, scratch: Vec::new() })
    }

    pub fn export(&self) -> &ExportInfo {
        &self.export
    }

    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// Every lane's counters, summed.
    pub fn stats(&self) -> LaneStats {
        let mut total = LaneStats::default();
        for l in &self.lanes {
            total.add(&l.lock().lane.stats());
        }
        total
    }

    /// The lanes' reliable-delivery counters, summed, over raw Ethernet (`None` over sockets).
    pub fn link_stats(&self) -> Option<crate::LinkStats> {
        let mut total: Option<crate::LinkStats> = None;
        for l in &self.lanes {
            if let Some(s) = l.lock().lane.link_stats() {
                total.get_or_insert_with(Default::default).add(&s);
            }
        }
        total
    }

    /// How the shared lanes' receivers waited under hybrid polling.
    pub fn poll_stats(&self) -> rt::poll::WaitStats {
        let mut all = rt::poll::WaitStats::default();
        for l in &self.lanes {
            all.add(&l.waiter().stats());
        }
        all
    }

    /// Each lane's batch level now.
    pub fn batch_levels(&self) -> Vec<u32> {
        self.lanes.iter().map(|l| l.lock().lane.batch_level()).collect()
    }

    /// Lane `i`'s adaptive decisions (times in µs since it opened).
    pub fn batch_level_log(&self, i: usize) -> Vec<crate::BatchDecision> {
        self.lanes[i].lock().lane.batch_level_log().to_vec()
    }
}

struct SharedLane<B> {
    state: Mutex<State<B>>,
    kick: Kick,
    timeout: Duration,
    /// Hybrid polling of whichever caller receives for everyone.
    waiter: Mutex<Waiter>,
}

struct State<B> {
    lane: Lane<B>,
    mailboxes: Vec<Mailbox<B>>,
    free_ids: Vec<u16>,
    /// A caller is receiving for everyone.
    receiving: bool,
    /// When the receiver, asleep in the socket, wakes on its own (`None`: it is not asleep).
    receiver_wakes_at: Option<Instant>,
    /// Callers asleep in [`std::thread::park`].
    sleepers: usize,
    /// Callers to unpark once the lock is released (by [`Held`]'s drop).
    wake: Vec<Thread>,
    /// Handles that exist, and callers inside a wait (see `wait_loop` for what it is used for).
    live_handles: usize,
    waiting: usize,
    scratch: Vec<Completion<B>>,
}

struct Mailbox<B> {
    done: VecDeque<Completion<B>>,
    /// Submitted and not yet taken by the owner (including those in `done`).
    in_flight: usize,
    sleeper: Option<std::thread::Thread>,
    /// The handle still exists; completions for a dropped handle are discarded.
    live: bool,
}

impl<B> SharedLane<B> {
    /// The lane's lock: every release goes through [`Held`], so wakes queued are never left
    /// behind.
    fn lock(&self) -> Held<'_, State<B>> {
        Held::new(&self.state)
    }
}

impl<B: IoBuf + Send> SharedLane<B> {
    fn connect(endpoint: &Endpoint, export: &str, config: &LaneConfig) -> Result<SharedLane<B>> {
        let lane = Lane::connect_with(endpoint, export, config)?;
        // One receive completes at most a queue's worth: room for it now, none on the data path.
        let scratch = Vec::with_capacity(lane.queue_depth());
        Ok(SharedLane {
            timeout: lane.timeout(),
            waiter: Mutex::new(Waiter::new(config.poll)),
            kick: Kick::new()?,
            state: Mutex::new(State {
                lane,
                mailboxes: Vec::new(),
                free_ids: Vec::new(),
                receiving: false,
                receiver_wakes_at: None,
                sleepers: 0,
                wake: Vec::new(),
                live_handles: 0,
                waiting: 0,
                scratch,
            }),
        })
    }

    /// The receivers' polling policy: only the receiver of the moment takes it, and a panic
    /// cannot leave it inconsistent (it is a few counters).
    fn waiter(&self) -> MutexGuard<'_, Waiter> {
        self.waiter.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Wait until `done` holds, receiving for everyone when nobody else is.
    fn wait_until<'a>(
        &'a self,
        mut st: Held<'a, State<B>>,
        id: u16,
        done: impl Fn(&State<B>) -> bool,
    ) -> Result<Held<'a, State<B>>> {
        st.waiting += 1;
        match self.wait_loop(st, id, done) {
            Ok(mut st) => {
                st.waiting -= 1;
                Ok(st)
            }
            Err(e) => {
                self.lock().waiting -= 1;
                Err(e)
            }
        }
    }

    fn wait_loop<'a>(
        &'a self,
        mut st: Held<'a, State<B>>,
        id: u16,
        done: impl Fn(&State<B>) -> bool,
    ) -> Result<Held<'a, State<B>>> {
        loop {
            if done(&st) {
                return Ok(st);
            }
            if st.waiting == st.live_handles && st.lane.doorbell_due().is_some() && st.lane.on_the_wire() == 0
            {
                // Every handle waits and nothing is on the wire whose completion could make a
                // caller submit more: the open caravan cannot grow, so waiting out its delay
                // would only idle the link. A failed send completes its requests with errors,
                // which the receive below delivers.
                let _ = st.lane.commit();
            }
            if st.lane.is_broken() && !st.receiving {
                // Deliver what the failure completed, then report it.
                let _ = st.receive();
                st.pass_on();
                if done(&st) {
                    return Ok(st);
                }
                return Err(Error::Closed);
            }
            let now = Instant::now();
            // What is due: requests on the wire and nothing back for the timeout is a dead
            // connection (the lane reconnects, or fails and says why); while it reconnects,
            // the policy's timeouts rule.
            st.lane.handle_due_at(now)?;
            if st.receiving {
                // The receiving thread wakes this one with its completions.
                let wake = st.lane.waiter_due().unwrap_or(now + self.timeout).max(now);
                st.mailboxes[id as usize].sleeper = Some(std::thread::current());
                st.sleepers += 1;
                drop(st);
                std::thread::park_timeout(wake - now);
                st = self.lock();
                if st.mailboxes[id as usize].sleeper.take().is_some() {
                    st.sleepers -= 1;
                }
                continue;
            }
            let deadline = st.lane.due().unwrap_or(now + self.timeout).max(now);
            st.receiving = true;
            if st.receive().is_err() || done(&st) {
                st.receiving = false;
                st.pass_on();
                continue;
            }
            let mut w = ReceiverWait { lane: self, st: Some(st), done: &done, deadline, caught: false };
            let waited = rt::poll::wait(&mut self.waiter(), &mut w);
            let caught = w.caught;
            st = w.st.take().unwrap_or_else(|| self.lock());
            st.receiving = false;
            if let Err(e) = waited {
                st.pass_on();
                return Err(e);
            }
            if caught {
                st.pass_on();
            }
        }
    }
}

/// The receiver's wait on a shared lane, for `rt::poll` to drive: spinning receives for
/// everyone and looks at the caller's mailbox, without holding the lock between looks;
/// sleeping watches the socket and the kick until the lane's next deadline.
struct ReceiverWait<'a, 'd, B> {
    lane: &'a SharedLane<B>,
    /// The lock, while this wait holds it.
    st: Option<Held<'a, State<B>>>,
    done: &'d dyn Fn(&State<B>) -> bool,
    deadline: Instant,
    /// A look while spinning found the caller done (or the lane failed).
    caught: bool,
}

impl<'a, B: IoBuf + Send> ReceiverWait<'a, '_, B> {
    fn state(&mut self) -> &mut Held<'a, State<B>> {
        let lane = self.lane;
        self.st.get_or_insert_with(|| lane.lock())
    }
}

impl<B: IoBuf + Send> Wait for ReceiverWait<'_, '_, B> {
    type Error = Error;

    fn ready(&mut self) -> Result<bool> {
        let done = self.done;
        let st = self.state();
        let ready = st.receive().is_err() || done(st);
        if ready {
            self.caught = true;
        } else {
            // Let the other handles submit while this one spins.
            self.st = None;
        }
        Ok(ready)
    }

    fn sleep(&mut self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = self.deadline;
        let st = self.state();
        let now = Instant::now();
        let due = st.lane.due().map_or(deadline, |due| due.min(deadline));
        let wake_at = timeout.map_or(due, |t| due.min(now + t));
        st.receiver_wakes_at = Some(wake_at);
        let fd = st.lane.wake_fd();
        let (tls_write, tls_buffered) = (st.lane.tls_wants_write(), st.lane.tls_buffered());
        self.st = None;
        // Decrypted bytes already inside TLS are there to take without waiting.
        let sleep = if tls_buffered { Duration::ZERO } else { wake_at - now.min(wake_at) };
        let kick = self.lane.kick.as_raw_fd();
        let slept = match fd {
            Some(fd) => wait_either(fd, tls_write, kick, Some(sleep)),
            // Reconnecting: no socket to watch until the next attempt.
            None => wait_fd(kick, false, Some(sleep)).map(|r| (false, r.readable)),
        };
        let st = self.state();
        st.receiver_wakes_at = None;
        let (readable, kicked) = slept?;
        if kicked {
            self.lane.kick.clear();
        }
        // A timed sleep that ran out with nothing to do goes on to spin; one that ended at the
        // lane's own deadline (doorbell, reconnection, silence) goes back to the caller.
        let lane_due = timeout.is_none_or(|t| due <= now + t);
        Ok(readable || kicked || tls_buffered || lane_due)
    }
}

/// The lane's lock, held: on release it unparks the callers that were given something to wake
/// for meanwhile ([`Wakes`]), after the lock is free, so that none of them wakes only to wait
/// for it.
struct Held<'a, T: Wakes> {
    /// `None` only inside `drop`.
    guard: Option<MutexGuard<'a, T>>,
}

/// State behind a lock that collects the threads to unpark once the lock is released.
trait Wakes {
    fn wakes(&mut self) -> &mut Vec<Thread>;
}

impl<B> Wakes for State<B> {
    fn wakes(&mut self) -> &mut Vec<Thread> {
        &mut self.wake
    }
}

thread_local! {
    /// This thread's spare list for the wake-ups it makes on release: swapped with the
    /// lane's, so both keep their capacity and releasing allocates nothing.
    static WAKE_SPARE: Cell<Vec<Thread>> = const { Cell::new(Vec::new()) };
}

impl<'a, T: Wakes> Held<'a, T> {
    fn new(mutex: &'a Mutex<T>) -> Held<'a, T> {
        // A panic while holding the lock leaves the state consistent: every change under it is
        // a few field updates, and the lane's own calls are panic-free on their paths.
        Held { guard: Some(mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())) }
    }
}

impl<T: Wakes> Deref for Held<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl<T: Wakes> DerefMut for Held<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl<T: Wakes> Drop for Held<'_, T> {
    fn drop(&mut self) {
        let Some(mut guard) = self.guard.take() else { return };
        if guard.wakes().is_empty() {
            return;
        }
        // `try_with`: a handle kept in a thread-local of its caller's may be used by that
        // thread-local's destructor after the spare is gone: the list is then allocated anew.
        let spare = WAKE_SPARE.try_with(Cell::take).unwrap_or_default();
        let mut wake = std::mem::replace(guard.wakes(), spare);
        drop(guard);
        for t in wake.drain(..) {
            t.unpark();
        }
        let _ = WAKE_SPARE.try_with(|s| s.set(wake));
    }
}

impl<B: IoBuf> State<B> {
    fn register(&mut self) -> Result<u16> {
        let mailbox = Mailbox { done: VecDeque::new(), in_flight: 0, sleeper: None, live: true };
        let id = if let Some(id) = self.free_ids.pop() {
            self.mailboxes[id as usize] = mailbox;
            id
        } else if self.mailboxes.len() < HANDLES_MAX {
            self.mailboxes.push(mailbox);
            (self.mailboxes.len() - 1) as u16
        } else {
            return Err(Error::InvalidArgument("too many handles on one shared lane"));
        };
        self.live_handles += 1;
        Ok(id)
    }

    /// Take the completions that arrived and hand them to their owners.
    fn receive(&mut self) -> Result<()> {
        let mut got = std::mem::take(&mut self.scratch);
        let result = self.lane.poll(&mut got);
        for mut c in got.drain(..) {
            let id = (c.user_data >> ID_SHIFT) as usize;
            c.user_data &= (1 << ID_SHIFT) - 1;
            let m = &mut self.mailboxes[id];
            if !m.live {
                m.in_flight -= 1;
                if m.in_flight == 0 {
                    self.free_ids.push(id as u16);
                }
                continue;
            }
            m.done.push_back(c);
            if let Some(t) = m.sleeper.take() {
                self.sleepers -= 1;
                self.wake.push(t);
            }
        }
        self.scratch = got;
        result.map(|_| ())
    }

    /// The receiver is leaving: wake a sleeper to take over, if one waits.
    fn pass_on(&mut self) {
        if self.sleepers == 0 {
            return;
        }
        if let Some(m) = self.mailboxes.iter_mut().find(|m| m.sleeper.is_some()) {
            self.sleepers -= 1;
            let t = m.sleeper.take().expect("found above");
            self.wake.push(t);
        }
    }

    /// Move up to everything in `id`'s mailbox to `out`.
    fn take(&mut self, id: u16, out: &mut Vec<Completion<B>>) -> usize {
        let m = &mut self.mailboxes[id as usize];
        let n = m.done.len();
        m.in_flight -= n;
        out.extend(m.done.drain(..));
        n
    }
}

/// One thread's way into a shared lane. `Send`, so it may be made on one thread and used on
/// another, but each handle is used by one thread at a time.
pub struct SharedHandle<B = Vec<u8>> {
    lane: Arc<SharedLane<B>>,
    id: u16,
    scratch: Vec<u8>,
}

impl<B: IoBuf + Send> SharedHandle<B> {
    /// Queue a request (as [`Lane::submit`]); `user_data` may be at most [`USER_DATA_MAX`].
    /// When the lane's queue is full, waits for a slot.
    pub fn submit(
        &mut self,
        opcode: Opcode,
        flags: ReqFlags,
        offset: u64,
        length: usize,
        buf: Option<B>,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<B>> {
        if user_data > USER_DATA_MAX {
            return Err(Rejected { error: Error::InvalidArgument("user_data above USER_DATA_MAX"), buf });
        }
        self.submit_any(opcode, flags, offset, length, buf, user_data)
    }

    /// `submit` without the check, for the blocking API's own `user_data` too.
    fn submit_any(
        &mut self,
        opcode: Opcode,
        flags: ReqFlags,
        offset: u64,
        length: usize,
        buf: Option<B>,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<B>> {
        let tagged = u64::from(self.id) << ID_SHIFT | user_data;
        let shared = &*self.lane;
        let mut st = shared.lock();
        let mut buf = buf;
        loop {
            match st.lane.submit(opcode, flags, offset, length, buf, tagged) {
                Ok(()) => break,
                Err(Rejected { error: Error::QueueFull(_), buf: back }) => {
                    buf = back;
                    let room = |s: &State<B>| s.lane.in_flight() < s.lane.queue_depth();
                    st = match shared.wait_until(st, self.id, room) {
                        Ok(st) => st,
                        Err(error) => return Err(Rejected { error, buf }),
                    };
                }
                Err(rejected) => return Err(rejected),
            }
        }
        st.mailboxes[self.id as usize].in_flight += 1;
        // A caravan the doorbell holds back must not wait for a receiver asleep past its due time.
        if let (Some(due), Some(wakes)) = (st.lane.doorbell_due(), st.receiver_wakes_at) {
            if due < wakes {
                st.receiver_wakes_at = Some(due);
                shared.kick.kick();
            }
        }
        Ok(())
    }

    /// Collect this handle's completions that have arrived, without waiting (receiving for
    /// everyone first if nobody else is).
    pub fn poll(&mut self, out: &mut Vec<Completion<B>>) -> Result<usize> {
        let mut st = self.lane.lock();
        let mut received = Ok(());
        if !st.receiving {
            received = st.receive();
        }
        let n = st.take(self.id, out);
        received.map(|()| n)
    }

    /// The shared lane's queue depth (what all its handles share).
    pub fn queue_depth(&self) -> usize {
        self.lane.lock().lane.queue_depth()
    }

    pub fn export(&self) -> ExportInfo {
        self.lane.lock().lane.export().clone()
    }

    /// This handle's requests submitted and not yet returned by `wait`.
    pub fn in_flight(&self) -> usize {
        self.lane.lock().mailboxes[self.id as usize].in_flight
    }

    /// Wait until at least `min` of this handle's completions (bounded by what it has in
    /// flight) are in `out`. Unlike a private lane's `wait`, this does not ring the doorbell:
    /// other threads' requests may still join the open caravan, and its delay bound sends it.
    pub fn wait(&mut self, min: usize, out: &mut Vec<Completion<B>>) -> Result<usize> {
        let id = self.id;
        let mut st = self.lane.lock();
        let min = min.min(st.mailboxes[id as usize].in_flight);
        let enough = |s: &State<B>| s.mailboxes[id as usize].done.len() >= min;
        let waited = self.lane.wait_until(st, id, enough);
        st = match waited {
            Ok(st) => st,
            Err(e) => {
                self.lane.lock().take(id, out);
                return Err(e);
            }
        };
        Ok(st.take(id, out))
    }

    /// Submit one request of the blocking API and wait for it.
    fn run_sync(
        &mut self,
        opcode: Opcode,
        offset: u64,
        length: usize,
        buf: Option<B>,
    ) -> Result<Completion<B>> {
        self.submit_any(opcode, ReqFlags::empty(), offset, length, buf, SYNC_USER_DATA)
            .map_err(|r| r.error)?;
        let id = self.id;
        let mine = |s: &State<B>| s.mailboxes[id as usize].done.iter().any(|c| c.user_data == SYNC_USER_DATA);
        let mut st = self.lane.wait_until(self.lane.lock(), id, mine)?;
        let m = &mut st.mailboxes[id as usize];
        let i = m.done.iter().position(|c| c.user_data == SYNC_USER_DATA).expect("waited for it");
        m.in_flight -= 1;
        Ok(m.done.remove(i).expect("index from position"))
    }

    /// Blocking flush.
    pub fn flush(&mut self) -> Result<()> {
        status_result(self.run_sync(Opcode::Flush, 0, 0, None)?.status)
    }
}

impl SharedHandle<Vec<u8>> {
    /// Blocking read into `buf` (its length is the read length).
    pub fn read_at(&mut self, buf: &mut [u8], offset: u64) -> Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.resize(buf.len(), 0);
        let c = self.run_sync(Opcode::Read, offset, buf.len(), Some(scratch))?;
        let data = c.buf.unwrap_or_default();
        if c.status.is_ok() {
            buf.copy_from_slice(&data);
        }
        self.scratch = data;
        status_result(c.status)
    }

    /// Blocking write of `buf`.
    pub fn write_at(&mut self, buf: &[u8], offset: u64) -> Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        scratch.extend_from_slice(buf);
        let c = self.run_sync(Opcode::Write, offset, buf.len(), Some(scratch))?;
        self.scratch = c.buf.unwrap_or_default();
        status_result(c.status)
    }
}

impl<B: IoBuf + Send> crate::Queue<B> for SharedHandle<B> {
    fn submit(
        &mut self,
        opcode: Opcode,
        flags: ReqFlags,
        offset: u64,
        length: usize,
        buf: Option<B>,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<B>> {
        SharedHandle::submit(self, opcode, flags, offset, length, buf, user_data)
    }

    /// Does not ring the doorbell: other threads' requests may still join the open caravan.
    fn wait(&mut self, min: usize, out: &mut Vec<Completion<B>>) -> Result<usize> {
        SharedHandle::wait(self, min, out)
    }

    fn poll(&mut self, out: &mut Vec<Completion<B>>) -> Result<usize> {
        SharedHandle::poll(self, out)
    }

    fn in_flight(&self) -> usize {
        SharedHandle::in_flight(self)
    }
}

impl<B> Drop for SharedHandle<B> {
    fn drop(&mut self) {
        let mut st = self.lane.lock();
        let id = self.id as usize;
        let m = &mut st.mailboxes[id];
        m.in_flight -= m.done.len();
        m.done.clear();
        m.live = false;
        st.live_handles -= 1;
        let m = &st.mailboxes[id];
        if m.in_flight == 0 {
            st.free_ids.push(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::time::Duration;

    use super::*;

    #[derive(Default)]
    struct Board {
        wake: Vec<Thread>,
    }

    impl Wakes for Board {
        fn wakes(&mut self) -> &mut Vec<Thread> {
            &mut self.wake
        }
    }

    #[test]
    fn a_caller_woken_under_the_lock_is_unparked_after_it_is_released() {
        let board = Arc::new(Mutex::new(Board::default()));
        let told = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (board, told) = (board.clone(), told.clone());
            std::thread::spawn(move || {
                // Parks until unparked (a spurious return finds `told` false and parks again;
                // a wake that never comes fails the test after a minute instead of hanging it).
                for _ in 0..60 {
                    if told.load(SeqCst) {
                        return board.try_lock().is_ok();
                    }
                    std::thread::park_timeout(Duration::from_secs(1));
                }
                panic!("never woken");
            })
        };
        let mut held = Held::new(&*board);
        held.wake.push(waiter.thread().clone());
        told.store(true, SeqCst);
        assert_eq!(held.wake.len(), 1, "queued while the lock is held, not sent");
        drop(held);
        assert!(waiter.join().expect("the waiter ran"), "woke to find the lock still held");
        let board = board.lock().expect("not poisoned");
        assert!(board.wake.is_empty(), "every queued wake was made");
    }

    #[test]
    fn a_release_in_a_thread_locals_destructor_still_wakes() {
        struct Late(Arc<Mutex<Board>>, Thread);
        impl Drop for Late {
            fn drop(&mut self) {
                // Runs after the spare list's own destructor (thread-locals go in the reverse
                // order of their first use): the release must not touch it.
                let mut held = Held::new(&*self.0);
                held.wake.push(self.1.clone());
            }
        }
        thread_local! {
            static LATE: std::cell::RefCell<Option<Late>> = const { std::cell::RefCell::new(None) };
        }
        let board = Arc::new(Mutex::new(Board::default()));
        let me = std::thread::current();
        let b = board.clone();
        std::thread::spawn(move || {
            LATE.with(|l| *l.borrow_mut() = Some(Late(b.clone(), me.clone())));
            let mut held = Held::new(&*b);
            held.wake.push(me);
            drop(held); // the spare list is first used here, after LATE
        })
        .join()
        .expect("the thread and its thread-locals' destructors ran without a panic");
        assert!(board.lock().expect("not poisoned").wake.is_empty(), "the late release made its wake");
    }

    #[test]
    fn releasing_keeps_the_wake_lists_allocations() {
        let board = Mutex::new(Board::default());
        for _ in 0..3 {
            let mut held = Held::new(&board);
            held.wake.push(std::thread::current());
            drop(held);
            std::thread::park(); // takes the token the release left
        }
        let held = Held::new(&board);
        assert!(held.wake.is_empty());
        assert!(held.wake.capacity() > 0, "the list swapped in on release has room already");
    }
}
