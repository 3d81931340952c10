//! Staged targets: the designs Tyche removed, rebuilt on our worker so that their cost can be
//! measured (Tyche, section V and Tables V and VI; `bench/suite.py`'s `stages` experiment).
//!
//! skiff's worker runs each request to completion on one thread: it receives the caravan,
//! executes every request and sends the completions itself, with no hand-off. Tyche reached
//! that design in two steps, and each step is a [`Stages`] here:
//!
//! - [`Stages::SendThread`], the design before Tyche-NoWQ: completions go through a queue to a
//!   second thread that sends them (Tyche's work queue). The worker receives and executes as
//!   usual, then, instead of sending a connection's response caravan, copies it out and
//!   queues it; the stage thread sends it.
//! - [`Stages::RecvThread`], the design before Tyche-Rec: a second thread receives, and hands
//!   each batch of received bytes through a queue to the worker, which executes and sends.
//!
//! Each hand-off costs what the papers count: a queue operation, a wake-up of the other thread
//! (a context switch when both share a core, as they do under `taskset -c 1`) and a copy of
//! the bytes handed over (a response caravan or what one receive brought; the run-to-completion
//! worker copies neither). Only native connections without TLS are staged: NBD connections,
//! and every connection of a target with TLS, run to completion as always.
//!
//! One stage thread serves each worker's connections; its CPU time and context switches are
//! counted with the worker's in STATS (`cpu_ns`, `ctx_switches_*`). This is a measuring
//! instrument, not a configuration to run in production: the send queue is bounded and a full
//! one stalls the worker (every connection of it) until the stage thread catches up.

use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;

use transport::event::{Events, Interest, Poll, Token, Waker};
use transport::{FrameIo, Stream};

use crate::stats::WorkerStats;

/// How a target's workers divide a request's path among threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Stages {
    /// One thread receives, executes and sends (skiff's design, Tyche-Rec + NoWQ).
    #[default]
    RunToCompletion,
    /// Completions are sent by a second thread, through a queue (before Tyche-NoWQ).
    SendThread,
    /// Requests are received by a second thread and handed over through a queue (before
    /// Tyche-Rec).
    RecvThread,
}

impl std::str::FromStr for Stages {
    type Err = String;
    fn from_str(s: &str) -> Result<Stages, String> {
        match s {
            "rtc" | "run-to-completion" => Ok(Stages::RunToCompletion),
            "send-thread" => Ok(Stages::SendThread),
            "recv-thread" => Ok(Stages::RecvThread),
            _ => Err(format!("{s:?}: expected rtc, send-thread or recv-thread")),
        }
    }
}

impl std::fmt::Display for Stages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stages::RunToCompletion => "rtc",
            Stages::SendThread => "send-thread",
            Stages::RecvThread => "recv-thread",
        })
    }
}

use crate::bounds::{RECV_CHUNK, SEND_QUEUE_MAX};
const STAGE_WAKE: Token = Token(usize::MAX);

/// What the worker tells its stage thread. A connection is named by its serial, which is
/// never reused (its slot in the worker is).
enum ToStage {
    /// A second handle on a new connection's socket.
    Adopt(u64, Stream),
    /// Response bytes to send, in order (send thread).
    Send(u64, Vec<u8>),
    /// The worker closed the connection: drop the handle (the socket closes once both are).
    Forget(u64),
}

/// What the receive thread hands the worker: bytes received on a connection, or `None`
/// when the connection ended (end of stream or an error).
pub(crate) type Received = (u64, Option<Vec<u8>>);

/// A worker's stage thread and the queues to it.
pub(crate) struct Stage {
    to: Option<Queue>,
    /// Bytes the receive thread received (receive thread only).
    pub received: Option<Receiver<Received>>,
    /// Wakes the receive thread for a message (receive thread only: the send thread sleeps
    /// on its queue).
    wake: Option<Arc<Waker>>,
    thread: Option<JoinHandle<()>>,
}

enum Queue {
    Bounded(SyncSender<ToStage>),
    Unbounded(Sender<ToStage>),
}

impl Stage {
    /// Start the stage thread of worker `id` for `stages` (not `RunToCompletion`). The receive
    /// thread wakes the worker through `worker_wake` when it hands over bytes.
    pub fn start(
        stages: Stages,
        id: usize,
        stats: Arc<WorkerStats>,
        worker_wake: Arc<Waker>,
    ) -> io::Result<Stage> {
        let name = format!("skiff-{stages}-{id}");
        match stages {
            Stages::RunToCompletion => {
                Err(io::Error::other("a run-to-completion worker has no stage thread"))
            }
            Stages::SendThread => {
                let (tx, rx) = mpsc::sync_channel(SEND_QUEUE_MAX);
                let thread = std::thread::Builder::new().name(name).spawn(move || {
                    stats.stage_tid.store(rt::usage::thread_id(), Ordering::Relaxed);
                    send_thread(rx)
                })?;
                Ok(Stage { to: Some(Queue::Bounded(tx)), received: None, wake: None, thread: Some(thread) })
            }
            Stages::RecvThread => {
                let poll = Poll::new()?;
                let wake = Arc::new(Waker::new(poll.registry(), STAGE_WAKE)?);
                let (tx, rx) = mpsc::channel();
                let (given_tx, given) = mpsc::channel();
                let thread = std::thread::Builder::new().name(name).spawn(move || {
                    stats.stage_tid.store(rt::usage::thread_id(), Ordering::Relaxed);
                    RecvThread {
                        poll,
                        orders: rx,
                        out: given_tx,
                        worker_wake,
                        conns: Vec::new(),
                        free: Vec::new(),
                    }
                    .run()
                })?;
                Ok(Stage {
                    to: Some(Queue::Unbounded(tx)),
                    received: Some(given),
                    wake: Some(wake),
                    thread: Some(thread),
                })
            }
        }
    }

    /// Give the stage thread a handle on connection `serial`'s socket.
    pub fn adopt(&self, serial: u64, stream: Stream) {
        self.order(ToStage::Adopt(serial, stream));
    }

    /// Queue response bytes of connection `serial` to the send thread.
    pub fn send(&self, serial: u64, bytes: Vec<u8>) {
        self.order(ToStage::Send(serial, bytes));
    }

    /// The worker closed connection `serial`.
    pub fn forget(&self, serial: u64) {
        self.order(ToStage::Forget(serial));
    }

    fn order(&self, order: ToStage) {
        // The thread only stops when this handle drops; a send can fail only if it died.
        let sent = match self.to.as_ref().expect("queue open until drop") {
            Queue::Bounded(q) => q.send(order).is_ok(),
            Queue::Unbounded(q) => q.send(order).is_ok(),
        };
        if !sent {
            tracing::error!("stage thread gone");
        }
        if let Some(w) = &self.wake {
            let _ = w.wake();
        }
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        // Closing the queue stops the thread once it has done what was queued.
        self.to = None;
        if let Some(w) = &self.wake {
            let _ = w.wake();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The send thread: send each connection's response bytes in the order queued, waiting for
/// room in the socket when it is full.
fn send_thread(orders: Receiver<ToStage>) {
    let mut conns: HashMap<u64, Stream> = HashMap::new();
    while let Ok(order) = orders.recv() {
        match order {
            ToStage::Adopt(serial, stream) => {
                conns.insert(serial, stream);
            }
            ToStage::Forget(serial) => {
                conns.remove(&serial);
            }
            ToStage::Send(serial, bytes) => {
                let Some(stream) = conns.get_mut(&serial) else { continue };
                if let Err(e) = send_all(stream, &bytes) {
                    // The worker sees the connection fail on its side and closes it.
                    tracing::debug!(error = %e, "send thread: send failed");
                    conns.remove(&serial);
                }
            }
        }
    }
}

fn send_all(stream: &mut Stream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        match stream.send(&[IoSlice::new(bytes)]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                transport::wait_fd(stream.as_raw_fd(), true, None)?;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The receive thread: wait for readiness on every connection of its worker, receive what
/// arrived, and hand it over.
struct RecvThread {
    poll: Poll,
    orders: Receiver<ToStage>,
    out: Sender<Received>,
    worker_wake: Arc<Waker>,
    conns: Vec<Option<(u64, Stream)>>,
    free: Vec<usize>,
}

impl RecvThread {
    fn run(mut self) {
        let mut events = Events::with_capacity(256);
        let mut buf = vec![0u8; RECV_CHUNK];
        loop {
            if let Err(e) = self.poll.poll(&mut events, None) {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(error = %e, "receive thread: poll failed");
                    return;
                }
            }
            let mut handed = false;
            for ev in events.iter() {
                match ev.token() {
                    STAGE_WAKE => {
                        if !self.take_orders(&mut buf) {
                            return;
                        }
                    }
                    Token(i) => handed |= self.receive(i, &mut buf),
                }
            }
            if handed {
                let _ = self.worker_wake.wake();
            }
        }
    }

    /// Adopt and forget connections as the worker says. Returns false once the worker is gone.
    fn take_orders(&mut self, buf: &mut [u8]) -> bool {
        loop {
            match self.orders.try_recv() {
                Ok(ToStage::Adopt(serial, mut stream)) => {
                    let slot = self.free.pop().unwrap_or_else(|| {
                        self.conns.push(None);
                        self.conns.len() - 1
                    });
                    if let Err(e) =
                        self.poll.registry().register(&mut stream, Token(slot), Interest::READABLE)
                    {
                        tracing::warn!(error = %e, "receive thread: cannot register a connection");
                        self.free.push(slot);
                        let _ = self.out.send((serial, None));
                        continue;
                    }
                    self.conns[slot] = Some((serial, stream));
                    // Bytes may have come before the registration; edges would not say so.
                    if self.receive(slot, buf) {
                        let _ = self.worker_wake.wake();
                    }
                }
                Ok(ToStage::Forget(serial)) => {
                    if let Some(slot) =
                        self.conns.iter().position(|c| c.as_ref().is_some_and(|(s, _)| *s == serial))
                    {
                        self.drop_slot(slot);
                    }
                }
                Ok(ToStage::Send(..)) => {}
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// Receive everything there is on connection `slot` and hand it over. Returns whether it
    /// handed anything (bytes or the end of the connection).
    fn receive(&mut self, slot: usize, buf: &mut [u8]) -> bool {
        let mut handed = false;
        loop {
            let Some((serial, stream)) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
                return handed;
            };
            let serial = *serial;
            match stream.recv(&mut [IoSliceMut::new(buf)]) {
                Ok(0) => {}
                Ok(n) => {
                    let _ = self.out.send((serial, Some(buf[..n].to_vec())));
                    handed = true;
                    if n == buf.len() {
                        continue;
                    }
                    return true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return handed,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => tracing::debug!(error = %e, "receive thread: receive failed"),
            }
            // The end of the stream, or an error: the worker closes the connection.
            let _ = self.out.send((serial, None));
            self.drop_slot(slot);
            return true;
        }
    }

    fn drop_slot(&mut self, slot: usize) {
        if let Some((_, mut stream)) = self.conns[slot].take() {
            let _ = self.poll.registry().deregister(&mut stream);
            self.free.push(slot);
        }
    }
}
