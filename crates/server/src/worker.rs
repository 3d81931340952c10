//! A run-to-completion worker: one thread, one `mio` poll, the connections it owns.
//!
//! Each loop pass waits for readiness, reads and executes everything that arrived on ready
//! connections, then flushes every connection that has responses queued: one send for all the
//! completions a pass produced on a connection. Which connections a pass reads and flushes,
//! and which it carries to the next pass without sleeping, is [`ConnSet`]'s (`crate::passes`);
//! this module owns the poller, the acceptor's hand-over, timers and the stage threads.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::{Batch, Wake};

use transport::event::{Events, Interest, Poll, Token, Waker};
use transport::Stream;

use rt::poll::{Wait, Waiter};

use crate::admission::Ticket;
use crate::conn::{Conn, Protocol};
use crate::passes::{ConnSet, Driver};
use crate::stages::{Stage, Stages};
use crate::stats::{bump, WorkerStats};
use crate::Shared;

const WAKE: Token = Token(usize::MAX);
use crate::bounds::SWEEP_INTERVAL;

/// A connection on its way from the acceptor to a worker.
pub(crate) type Arrival = (Stream, Protocol, Arc<Ticket>);
/// Where the acceptor hands a worker its new connections, and how it wakes the worker.
pub(crate) type Inbox = (Sender<Arrival>, Arc<Waker>);

pub(crate) struct Worker {
    id: usize,
    poll: Poll,
    waker: Arc<Waker>,
    inbox_tx: Sender<Arrival>,
    inbox: Receiver<Arrival>,
    shared: Arc<Shared>,
    stats: Arc<WorkerStats>,
    /// The connections this worker owns, and which of them each pass reads and flushes.
    conns: ConnSet<Stream>,
    /// The thread that receives or sends for this worker's native connections, on a staged
    /// target (`crate::stages`).
    stage: Option<Stage>,
    /// Connections adopted so far: with the slot, a staged connection's name.
    adopted: u64,
    /// Connections with timers of their own: raw-Ethernet sessions.
    timed: Vec<usize>,
    /// Batches of flash reads that have landed, by token; `None` without asynchronous flash
    /// reads.
    landed: Option<Arc<Landed>>,
    /// The tokens [`take_landed`](Worker::take_landed) is working through.
    woken: Vec<u64>,
}

/// Where the flash array's completion thread says a connection's batch of reads landed
/// (`engine::Wake`): the token goes on a list and the worker is woken to take it.
pub(crate) struct Landed {
    tokens: Mutex<Vec<u64>>,
    waker: Arc<Waker>,
}

impl Wake for Landed {
    fn wake(&self, token: u64) {
        self.tokens.lock().unwrap_or_else(|e| e.into_inner()).push(token);
        if let Err(e) = self.waker.wake() {
            tracing::error!(error = %e, "cannot wake a worker for landed flash reads");
        }
    }
}

/// What the worker does beside its [`ConnSet`]: `mio` registrations, the stage thread.
struct MioDriver<'a> {
    id: usize,
    poll: &'a Poll,
    stage: Option<&'a Stage>,
    stages: Stages,
    stats: &'a WorkerStats,
    timed: &'a mut Vec<usize>,
}

impl Driver<Stream> for MioDriver<'_> {
    fn closed(&mut self, index: usize, conn: &mut Conn<Stream>) {
        let _ = self.poll.registry().deregister(&mut conn.stream);
        tracing::debug!(worker = self.id, peer = %conn.peer, "connection closed");
        if let (Some(serial), Some(stage)) = (conn.staged, self.stage) {
            // Its other handle closes once the stage thread has done what was queued.
            stage.forget(serial);
        }
        self.timed.retain(|&c| c != index);
    }

    fn hand_off(&mut self, conn: &mut Conn<Stream>) -> bool {
        let (Some(serial), Some(stage)) = (conn.staged, self.stage) else { return false };
        if self.stages != Stages::SendThread {
            return false;
        }
        if conn.tx.pending() > 0 {
            bump(&self.stats.stage_handoffs, 1);
            stage.send(serial, conn.tx.take_unsent());
        }
        true
    }
}

impl Worker {
    pub fn new(id: usize, shared: Arc<Shared>) -> io::Result<Worker> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKE)?);
        let (inbox_tx, inbox) = mpsc::channel();
        let stats = shared.workers[id].clone();
        let stage = match shared.config.stages {
            Stages::RunToCompletion => None,
            stages => Some(Stage::start(stages, id, stats.clone(), waker.clone())?),
        };
        let landed = shared
            .flash
            .as_ref()
            .is_some_and(|f| f.array().reads_async())
            .then(|| Arc::new(Landed { tokens: Mutex::new(Vec::new()), waker: waker.clone() }));
        Ok(Worker {
            stage,
            adopted: 0,
            timed: Vec::new(),
            landed,
            woken: Vec::new(),
            id,
            poll,
            waker,
            inbox_tx,
            inbox,
            shared,
            stats,
            conns: ConnSet::new(),
        })
    }

    pub fn waker(&self) -> Arc<Waker> {
        self.waker.clone()
    }

    /// Where the acceptor drops new connections for this worker.
    pub fn inbox(&self) -> Inbox {
        (self.inbox_tx.clone(), self.waker.clone())
    }

    /// The worker's own part of a pass, borrowed beside its connections.
    fn parts(&mut self) -> (&mut ConnSet<Stream>, MioDriver<'_>, &Shared, &WorkerStats) {
        let driver = MioDriver {
            id: self.id,
            poll: &self.poll,
            stage: self.stage.as_ref(),
            stages: self.shared.config.stages,
            stats: &self.stats,
            timed: &mut self.timed,
        };
        (&mut self.conns, driver, &self.shared, &self.stats)
    }

    pub fn run(mut self) {
        self.stats.tid.store(rt::usage::thread_id(), Ordering::Relaxed);
        let mut events = Events::with_capacity(self.shared.config.bounds.events_per_poll);
        let mut waiter = Waiter::new(self.shared.config.poll);
        let mut next_sweep = Instant::now() + SWEEP_INTERVAL;
        loop {
            let now = Instant::now();
            if now >= next_sweep {
                self.sweep(now);
                next_sweep = now + SWEEP_INTERVAL;
            }
            let waited = if self.conns.has_carry() {
                // Connections to read again: look for more without waiting.
                self.poll.poll(&mut events, Some(Duration::ZERO))
            } else if !self.conns.is_empty() {
                // Connections to watch: wait by the polling policy, and wake for the next
                // sweep even if none of them speaks, or for a raw-Ethernet session's timer.
                let mut block = next_sweep.saturating_duration_since(now);
                if let Some(t) = self.timers() {
                    block = block.min(t);
                }
                let mut w = PollWait { poll: &mut self.poll, events: &mut events, block };
                let waited = rt::poll::wait(&mut waiter, &mut w).map(drop);
                if !waiter.mode().is_off() {
                    self.stats.publish_poll(&waiter.stats());
                }
                waited
            } else {
                self.poll.poll(&mut events, None)
            };
            if let Err(e) = waited {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(worker = self.id, error = %e, "poll failed; worker stops");
                    break;
                }
            }
            if self.shared.shutdown.load(Ordering::Acquire) {
                break;
            }
            self.fire_timers();
            if events.is_empty() && !self.conns.has_work() {
                continue;
            }
            bump(&self.stats.loop_passes, 1);
            // A pass that may serve a pool's chunks is fenced for its retirement.
            let fenced = self.shared.serves_pool;
            if fenced {
                self.stats.pass.fetch_add(1, Ordering::SeqCst);
            }
            for ev in events.iter() {
                match ev.token() {
                    WAKE => {
                        self.adopt_new();
                        self.close_evicted();
                        self.take_received();
                        self.take_landed();
                    }
                    Token(i) if self.receives_elsewhere(i) => {
                        // The receive thread reads this one, and reports its end.
                        if ev.is_writable() {
                            self.conns.mark_dirty(i);
                        }
                    }
                    Token(i) => {
                        let readable = ev.is_readable() || ev.is_read_closed() || ev.is_error();
                        self.conns.ready(i, readable, ev.is_writable());
                    }
                }
            }
            let (conns, mut driver, shared, stats) = self.parts();
            conns.pass(shared, stats, &mut driver);
            if fenced {
                self.stats.pass.fetch_add(1, Ordering::SeqCst);
            }
        }
        self.say_goodbye();
        tracing::debug!(worker = self.id, "worker stopped");
    }

    /// The target is stopping: tell every native peer (`GOAWAY` `ShuttingDown`, so an
    /// initiator knows to reconnect rather than fail), with one send that does not wait, and
    /// close every connection (ending its TLS session where that cuts nothing short).
    fn say_goodbye(&mut self) {
        for i in 0..self.conns.slots() {
            if let Some(conn) = self.conns.get_mut(i) {
                if !conn.closing {
                    conn.say_goaway(wire::Status::ShuttingDown, "target shutting down");
                }
                self.conns.mark_dirty(i);
            }
        }
        // One send each, the way every reply goes (through the send thread on a staged
        // target, behind what it already holds), then close whatever is left.
        let (conns, mut driver, shared, stats) = self.parts();
        conns.flush_pass(shared, stats, &mut driver);
        for i in 0..conns.slots() {
            conns.close(i, shared, &mut driver);
        }
    }

    /// Close connections whose handshake or silence outlived its timeout.
    fn sweep(&mut self, now: Instant) {
        let bounds = self.shared.config.bounds;
        for i in 0..self.conns.slots() {
            if let Some(conn) = self.conns.get_mut(i) {
                if conn.expire(now, &bounds, &self.shared) {
                    self.conns.mark_dirty(i);
                }
            }
        }
        let (conns, mut driver, shared, stats) = self.parts();
        conns.flush_pass(shared, stats, &mut driver);
    }

    /// Close the connections the acceptor evicted to make room for new ones.
    fn close_evicted(&mut self) {
        let (conns, mut driver, shared, _) = self.parts();
        for i in 0..conns.slots() {
            if conns.get(i).is_some_and(|c| c.ticket.is_evicted()) {
                conns.close(i, shared, &mut driver);
            }
        }
    }

    fn adopt_new(&mut self) {
        while let Ok((mut stream, protocol, ticket)) = self.inbox.try_recv() {
            let index = self.conns.next_index();
            // Sockets only: a raw-Ethernet session's timers and rings stay with its worker.
            let staged = self.stage.is_some()
                && protocol == Protocol::Native
                && !matches!(stream, transport::Stream::Datagram(_));
            let interest = match (staged, self.shared.config.stages) {
                // The send thread waits for room in the socket itself.
                (true, Stages::SendThread) => Interest::READABLE,
                // The receive thread reads; the worker sends.
                (true, Stages::RecvThread) => Interest::WRITABLE,
                _ => Interest::READABLE | Interest::WRITABLE,
            };
            if let Err(e) = self.poll.registry().register(&mut stream, Token(index), interest) {
                tracing::warn!(error = %e, "cannot register connection");
                self.shared.admission.closed(&ticket, &self.shared.connections);
                continue;
            }
            if ticket.is_evicted() {
                // Evicted before it got here: it never starts.
                let _ = self.poll.registry().deregister(&mut stream);
                continue;
            }
            let second = if staged { Some(stream.try_clone_plain()) } else { None };
            let timed = matches!(stream, transport::Stream::Datagram(_));
            let mut conn = Conn::new(stream, protocol, ticket, &self.shared);
            tracing::debug!(worker = self.id, peer = %conn.peer, ?protocol, "connection");
            bump(&self.stats.connections_accepted, 1);
            self.adopted += 1;
            match (second, &self.stage) {
                (Some(Ok(handle)), Some(stage)) => {
                    let serial = (self.adopted << 32) | index as u64;
                    stage.adopt(serial, handle);
                    conn.staged = Some(serial);
                    // The stage thread sends bytes handed to it: no file ranges.
                    conn.tx.send_files = false;
                }
                (Some(Err(e)), _) => {
                    tracing::warn!(error = %e, "cannot hand a connection to the stage thread; closing it");
                    conn.closing = true;
                }
                _ => {}
            }
            if let (Some(landed), None) = (&self.landed, conn.staged) {
                // Its requests may park for flash reads; the wake names it by slot and serial.
                let token = (self.adopted << 32) | index as u64;
                conn.batch = Some(Arc::new(Batch::new(landed.clone(), token)));
            }
            let receives_here = conn.staged.is_none() || self.shared.config.stages != Stages::RecvThread;
            let inserted = self.conns.insert(conn);
            debug_assert_eq!(inserted, index);
            if timed {
                self.timed.push(index);
            }
            // Data may have arrived before registration; edge-triggered polling would not
            // report it, so read once now (the receive thread does the same for its own).
            if receives_here {
                self.conns.mark_readable(index);
            }
        }
    }

    /// The soonest timer of the raw-Ethernet sessions (retransmission, acknowledgement,
    /// keepalive); `None` without any.
    fn timers(&self) -> Option<Duration> {
        if self.timed.is_empty() {
            return None;
        }
        self.timed.iter().filter_map(|&i| self.conns.get(i).and_then(|c| c.stream.timer())).min()
    }

    /// Service the raw-Ethernet sessions whose timers are due: receiving drives them.
    fn fire_timers(&mut self) {
        for &i in &self.timed {
            if self.conns.get(i).and_then(|c| c.stream.timer()).is_some_and(|t| t.is_zero()) {
                self.conns.mark_readable(i);
                self.conns.mark_dirty(i);
            }
        }
    }

    /// Whether the receive thread of a staged target reads connection `index`.
    fn receives_elsewhere(&self, index: usize) -> bool {
        self.shared.config.stages == Stages::RecvThread
            && self.conns.get(index).is_some_and(|c| c.staged.is_some())
    }

    /// Execute what the receive thread of a staged target received.
    /// Bring back the connections whose flash reads landed.
    fn take_landed(&mut self) {
        let Some(landed) = &self.landed else { return };
        // Swapped with a list the worker keeps, so neither side allocates once both have grown.
        std::mem::swap(&mut self.woken, &mut *landed.tokens.lock().unwrap_or_else(|e| e.into_inner()));
        for &token in &self.woken {
            self.conns.wake((token & u64::from(u32::MAX)) as usize, token);
        }
        self.woken.clear();
    }

    fn take_received(&mut self) {
        loop {
            let received = self.stage.as_ref().and_then(|s| s.received.as_ref());
            let Some(Ok((serial, bytes))) = received.map(|r| r.try_recv()) else { return };
            let index = (serial & u64::from(u32::MAX)) as usize;
            let Some(conn) = self.conns.get_mut(index) else { continue };
            if conn.staged != Some(serial) {
                continue; // a connection closed since, whose slot is reused
            }
            match bytes {
                Some(bytes) => {
                    bump(&self.stats.stage_handoffs, 1);
                    conn.take_in(&bytes, &self.shared, &self.stats);
                    if conn.newly_established() {
                        self.shared.admission.established(&conn.ticket);
                    }
                    self.conns.mark_dirty(index);
                }
                None => {
                    let (conns, mut driver, shared, _) = self.parts();
                    conns.close(index, shared, &mut driver);
                }
            }
        }
    }
}

/// A worker's wait for readiness on its connections, as `rt::poll` drives it.
struct PollWait<'a> {
    poll: &'a mut Poll,
    events: &'a mut Events,
    /// How long the final sleep may last (until the next sweep).
    block: Duration,
}

impl Wait for PollWait<'_> {
    type Error = io::Error;

    fn ready(&mut self) -> io::Result<bool> {
        self.poll.poll(self.events, Some(Duration::ZERO))?;
        Ok(!self.events.is_empty())
    }

    fn sleep(&mut self, timeout: Option<Duration>) -> io::Result<bool> {
        match timeout {
            // A timed sleep: epoll's own timeout counts whole milliseconds, so sleep on the
            // epoll descriptor itself, which is readable when any connection is.
            Some(t) => {
                if !transport::wait_fd(self.poll.as_raw_fd(), false, Some(t))?.readable {
                    return Ok(false);
                }
                self.ready()
            }
            None => {
                self.poll.poll(self.events, Some(self.block))?;
                Ok(!self.events.is_empty())
            }
        }
    }
}
