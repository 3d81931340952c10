//! One connection on a worker: the driver of a front end (`engine::front`) over a socket.
//!
//! The worker reads what arrived into the connection's frame buffer and lets the front end
//! (its protocol's [`FrontEnd`](crate::front::FrontEnd)) execute it; the front end appends
//! every reply to the connection's [`TxBuf`] (crate::txbuf), which the worker sends at the end
//! of the loop pass. Read data of RAM exports goes out by address, straight from the volume's
//! memory; other backends read it into the buffer.
//! A connection the front end closes (a protocol error, a GOAWAY, an NBD disconnect) is
//! dropped once its queued bytes are sent, and no other connection notices.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::front::{Gate, Later, Link, Sealed};
use engine::Batch;
use transport::tls::ServerTlsConfig;
use transport::{FrameBuffer, FrameIo, Stream};
use wire::Status;

use crate::admission::Ticket;
pub use crate::front::Protocol;
use crate::front::{front_end, FrontEnd};
use crate::stats::{bump, WorkerStats};
pub(crate) use crate::txbuf::TxBuf;
use crate::{Bounds, Shared};

use crate::bounds::IDLE_SHRINK_AFTER;

/// What a connection needs of its stream beyond moving bytes ([`FrameIo`]): the target's
/// [`Stream`], or the modelled socket that the liveness tests drive the same code over
/// (`crate::model`).
pub trait ConnStream: FrameIo {
    /// A description of the peer for logs.
    fn peer(&self) -> String;
    /// A Unix socket, where TLS is never offered.
    fn is_unix(&self) -> bool;
    /// Plain TCP, which a listener with TLS may still turn into TLS.
    fn is_tcp(&self) -> bool;
    /// The peer's first byte without taking it (see [`Stream::peek_first_byte`]).
    fn peek_first_byte(&self) -> io::Result<Option<u8>>;
    /// Turn the stream into the target side of TLS, in place.
    fn start_tls(&mut self, config: Arc<ServerTlsConfig>) -> io::Result<()>;
    /// TLS runs and its handshake is done.
    fn tls_established(&self) -> bool;
    /// Who a verified TLS client certificate names.
    fn peer_principal(&self) -> Option<String>;
    /// End the TLS session, if one runs: queue `close_notify` and start sending it (the rest
    /// goes out as [`FrameIo::pending_send`] says). Plain streams have nothing to end.
    fn close_tls(&mut self);
}

impl ConnStream for Stream {
    fn peer(&self) -> String {
        Stream::peer(self)
    }
    fn is_unix(&self) -> bool {
        matches!(self, Stream::Unix(_))
    }
    fn is_tcp(&self) -> bool {
        matches!(self, Stream::Tcp(_))
    }
    fn peek_first_byte(&self) -> io::Result<Option<u8>> {
        Stream::peek_first_byte(self)
    }
    fn start_tls(&mut self, config: Arc<ServerTlsConfig>) -> io::Result<()> {
        Stream::start_tls(self, config)
    }
    fn tls_established(&self) -> bool {
        Stream::tls_established(self)
    }
    fn peer_principal(&self) -> Option<String> {
        Stream::peer_principal(self)
    }
    fn close_tls(&mut self) {
        Stream::close_tls(self)
    }
}

pub(crate) struct Conn<S = Stream> {
    pub stream: S,
    pub peer: String,
    rx: FrameBuffer,
    pub tx: TxBuf,
    /// Stop reading; close once the queued bytes are sent.
    pub closing: bool,
    /// Requests stay in `rx` unprocessed because the backlog of replies reached its bound:
    /// they are taken up before anything more is read, once the peer has drained it.
    held: bool,
    /// The TLS session was ended (`close_notify` queued), or there was none to end.
    tls_closed: bool,
    /// The protocol's front end.
    front: Box<dyn FrontEnd>,
    /// Its place in the admission book.
    pub ticket: Arc<Ticket>,
    accepted_at: Instant,
    /// When bytes last arrived.
    last_rx: Instant,
    /// The handshake is done.
    established: bool,
    /// A native TCP connection on a listener with TLS, until its first byte says whether the
    /// peer starts TLS.
    tls_undecided: Option<crate::TlsListen>,
    /// NBD STARTTLS was acknowledged: the reply goes out in plaintext, then the stream turns
    /// to TLS before another byte is read.
    starttls: bool,
    /// An NBD connection upgraded to TLS whose client has not been identified yet: once the
    /// TLS handshake is done, a verified client certificate's CN picks the exports it sees.
    identify: bool,
    /// Its name on a staged target's stage thread (`crate::stages`), for a connection whose
    /// receiving or sending another thread does; `None` when it runs to completion.
    pub staged: Option<u64>,
    /// The transport sends completion caravans' read data as data messages (agreed in HELLO).
    data_apart: bool,
    /// Where the front end parks requests whose flash pages are being read (`Link::gate`);
    /// `None` on a target without asynchronous flash reads, and on a staged connection.
    pub batch: Option<Arc<Batch>>,
    /// What the connection waits for on its batch.
    wait: Wait,
    /// A bug planted in it.
    #[cfg(feature = "mutations")]
    mutation: Option<Mutation>,
    /// The wait its batch's wake just ended, for the next pass: after `Reads`, the request
    /// that waited runs without being prepared again, so it waits at most once (a page taken
    /// from the pool meanwhile is read the ordinary way; `Gate::resumed`); after `Replies`, it sends the
    /// replies that waited before processing more (a FLUSH in what follows would hold them
    /// again for nothing).
    woken: Wait,
}

/// Deliberately broken variants of the connection's handling, for the simulator's proof that
/// it catches them. Only the feature `mutations` (never on in the product's binaries) lets one
/// be planted; without it every check folds to `false`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// The native front end acknowledges a write before it reaches the backend.
    AckBeforeBackend,
    /// A batch's wake resumes the connection without taking up the requests that waited in
    /// its buffer: they sit there until more bytes arrive, which may be never.
    ForgetHeldOnWake,
    /// A pass that stopped before a request whose reads joined a FLUSH's or FUA's batch,
    /// when all of it ended before the seal (so no wake comes), does not come back for the
    /// requests left: they sit there until more bytes arrive.
    ForgetStoppedOnFreeSeal,
}

/// What a connection waits for on its batch (`Conn::batch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    None,
    /// Flash reads a request waits for (`Link::gate`): it and those after it wait in `rx`,
    /// and nothing is read or executed until the wake.
    Reads,
    /// Durability a FLUSH or FUA asked for (`Link::later`): the replies queued in `tx` are
    /// held, nothing is sent or read until the wake.
    Replies,
    /// That durability failed: the replies held are never sent, and the connection goes.
    Void,
}

/// What reading left the connection as.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ReadOutcome {
    /// The socket is drained for now.
    Drained,
    /// Stopped at the per-pass budget; come back without waiting for an event.
    More,
    /// Stopped because the replies queued passed the backlog bound (the peer is not reading
    /// them). Come back as soon as a flush brings them under it: if the socket took them
    /// all, no event will say so.
    Paused,
    /// Requests wait for flash pages being read: the worker comes back when their batch
    /// wakes it (`Conn::resume`), not on a socket event.
    Waiting,
    /// Peer closed or the connection failed: drop it.
    Closed,
}

impl<S: ConnStream> Conn<S> {
    pub fn new(stream: S, protocol: Protocol, ticket: Arc<Ticket>, shared: &Shared) -> Conn<S> {
        let peer = stream.peer();
        // Room from the start for a completion caravan as large as a lane may have in flight,
        // so that the first pass to answer more requests at once than any before it does not
        // grow the buffer on the data path (tests/tests/attach_fuse_no_alloc.rs caught one).
        let depth = shared.config.bounds.limits.queue_depth as usize;
        let mut tx = TxBuf::with_room(
            (wire::header::HEADER_LEN + depth * wire::caravan::COMPLETION_DESC_LEN).next_power_of_two(),
        );
        // Plain sockets take file ranges by sendfile(2) (a TLS upgrade later refuses them,
        // and the buffer stops queuing them).
        tx.send_files = stream.is_tcp() || stream.is_unix();
        let front = front_end(protocol, &stream, shared, &mut tx);
        let now = Instant::now();
        let tls_undecided = shared.config.tls.clone().filter(|_| front.sniffs_tls() && stream.is_tcp());
        Conn {
            tls_undecided,
            starttls: false,
            identify: false,
            stream,
            peer,
            rx: FrameBuffer::new(),
            tx,
            closing: false,
            held: false,
            tls_closed: false,
            front,
            ticket,
            accepted_at: now,
            last_rx: now,
            established: false,
            staged: None,
            data_apart: false,
            batch: None,
            wait: Wait::None,
            woken: Wait::None,
            #[cfg(feature = "mutations")]
            mutation: None,
        }
    }

    /// Start closing the connection if it outlived a timeout of `bounds` at `now`: its
    /// handshake (`handshake_timeout`) or its silence (`idle_timeout`, `nbd_idle_timeout`).
    /// A native peer is told why (`GOAWAY` `TimedOut`). Returns whether it did.
    pub fn expire(&mut self, now: Instant, bounds: &Bounds, shared: &Shared) -> bool {
        if self.closing {
            return false;
        }
        if now.duration_since(self.last_rx) >= IDLE_SHRINK_AFTER {
            // A quiet connection gives back what its largest request grew the buffers to.
            self.rx.shrink_idle(0);
            self.tx.shrink_idle();
        }
        let (limit, since, what, counter) = if !self.established {
            (bounds.handshake_timeout, self.accepted_at, "handshake", &shared.listener.handshake_timeouts)
        } else {
            (self.front.idle_timeout(bounds), self.last_rx, "idle", &shared.listener.idle_timeouts)
        };
        // A connection whose replies the peer is still taking is not idle.
        if limit.is_zero() || now.duration_since(since) < limit || (self.established && self.tx.pending() > 0)
        {
            return false;
        }
        tracing::info!(peer = %self.peer, timeout = ?limit, "closing connection: {what} timeout");
        bump(counter, 1);
        self.say_goaway(Status::TimedOut, &format!("{what} timeout ({limit:?})"));
        true
    }

    /// Tell the peer why the connection ends, where its protocol has a way to (the native
    /// `GOAWAY`; NBD has none), and close it once that is sent.
    pub fn say_goaway(&mut self, status: Status, message: &str) {
        if let Some(goodbye) = self.front.goodbye(status, message) {
            self.tx.append(&goodbye);
        }
        self.closing = true;
    }

    /// Whether the handshake finished during the last [`service`](Self::service) and has not
    /// been reported yet (the caller tells the admission book, once).
    pub fn newly_established(&mut self) -> bool {
        if self.established {
            return false;
        }
        self.established = self.front.is_established();
        self.established
    }

    /// Read and process what the peer sent, within this pass's budget.
    pub fn service(&mut self, shared: &Shared, stats: &WorkerStats) -> ReadOutcome {
        if self.tls_undecided.is_some() {
            match self.decide_tls() {
                Ok(true) => {}
                Ok(false) => return ReadOutcome::Drained,
                Err(e) => {
                    tracing::debug!(peer = %self.peer, error = %e, "closed before its first byte");
                    return ReadOutcome::Closed;
                }
            }
        }
        if self.starttls && !self.upgrade(shared, stats) {
            return if self.closing { ReadOutcome::Closed } else { ReadOutcome::Drained };
        }
        let backlog_max = shared.config.bounds.tx_backlog_bytes_max;
        if self.waiting() {
            return ReadOutcome::Waiting;
        }
        if self.woken == Wait::Replies {
            self.woken = Wait::None;
            if !self.flush(stats) {
                return ReadOutcome::Closed;
            }
        }
        if self.held && !self.closing && !self.backlogged(backlog_max) {
            // What arrived while the backlog was full, or while requests waited for flash,
            // comes first: no event will announce it.
            let started = Instant::now();
            self.process(shared, stats, backlog_max);
            bump(&stats.stage_exec_ns, nanos(started.elapsed()));
            if self.waiting() {
                return ReadOutcome::Waiting;
            }
            if self.starttls && !self.upgrade(shared, stats) {
                return if self.closing { ReadOutcome::Closed } else { ReadOutcome::Drained };
            }
        }
        for _ in 0..shared.config.bounds.reads_per_pass {
            if self.closing {
                return ReadOutcome::Drained;
            }
            if self.held || self.backlogged(backlog_max) {
                // The peer is not reading its replies: take no more of its requests until it
                // does. The worker comes back once a flush brings the backlog under the bound.
                return ReadOutcome::Paused;
            }
            let started = Instant::now();
            let filled = self.stream.fill(&mut self.rx);
            let received = Instant::now();
            bump(&stats.stage_recv_ns, nanos(received - started));
            match filled {
                Ok(0) => return ReadOutcome::Closed,
                Ok(n) => {
                    bump(&stats.rx_bytes, n as u64);
                    self.last_rx = received;
                    // A full read, or plaintext rustls decrypted and still holds: read again.
                    let mut more = self.rx.last_read_full() || self.stream.buffered_recv();
                    self.process(shared, stats, backlog_max);
                    if self.starttls {
                        if !self.upgrade(shared, stats) {
                            return if self.closing { ReadOutcome::Closed } else { ReadOutcome::Drained };
                        }
                        // The ClientHello may be waiting already, and the poller reports
                        // edges: read on.
                        more = true;
                    }
                    bump(&stats.stage_exec_ns, nanos(received.elapsed()));
                    if self.waiting() {
                        return ReadOutcome::Waiting;
                    }
                    if self.held {
                        return ReadOutcome::Paused;
                    }
                    if !more {
                        return ReadOutcome::Drained;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return ReadOutcome::Drained,
                Err(e) => {
                    tracing::debug!(peer = %self.peer, error = %e, "receive failed");
                    return ReadOutcome::Closed;
                }
            }
        }
        ReadOutcome::More
    }

    /// The token its batch wakes the worker with, if it has one.
    pub fn batch_token(&self) -> Option<u64> {
        self.batch.as_ref().map(|b| b.token())
    }

    /// The batch its requests waited for has landed: execute them next (the one that waited
    /// without being prepared again), then read on.
    pub fn resume(&mut self) {
        if !self.waiting() {
            return;
        }
        self.held = !self.planted(Mutation::ForgetHeldOnWake);
        self.woken = std::mem::replace(&mut self.wait, Wait::None);
        if self.woken == Wait::Replies && self.batch.as_ref().is_some_and(|b| b.failed()) {
            self.void_replies();
        }
    }

    /// Durability a FLUSH or FUA asked for failed: it closes without sending the replies that
    /// waited for it.
    pub fn durability_failed(&self) -> bool {
        self.wait == Wait::Void
    }

    /// Plant a bug, for the simulator's proof that it catches them.
    #[cfg(feature = "mutations")]
    pub fn plant(&mut self, mutation: Mutation) {
        match mutation {
            Mutation::AckBeforeBackend => {
                self.front.plant(engine::front::native::mutation::Mutation::AckBeforeBackend)
            }
            Mutation::ForgetHeldOnWake | Mutation::ForgetStoppedOnFreeSeal => self.mutation = Some(mutation),
        }
    }

    #[cfg(feature = "mutations")]
    fn planted(&self, mutation: Mutation) -> bool {
        self.mutation == Some(mutation)
    }

    #[cfg(not(feature = "mutations"))]
    #[inline(always)]
    fn planted(&self, _: Mutation) -> bool {
        false
    }

    /// Whether it waits for its batch's wake.
    fn waiting(&self) -> bool {
        matches!(self.wait, Wait::Reads | Wait::Replies)
    }

    /// Whether the replies queued may not be sent now.
    fn holding(&self) -> bool {
        matches!(self.wait, Wait::Replies | Wait::Void)
    }

    /// Durability a FLUSH or FUA asked for failed: the replies queued must not say otherwise.
    /// Close without sending them; the peer sees its requests fail.
    fn void_replies(&mut self) {
        tracing::warn!(peer = %self.peer, "closing connection: a FLUSH or FUA write could not be made durable");
        self.wait = Wait::Void;
        self.woken = Wait::None;
        self.closing = true;
    }

    /// Whether the replies queued passed `backlog_max` bytes: the connection reads no more
    /// requests until the peer takes some.
    pub fn backlogged(&self, backlog_max: usize) -> bool {
        self.tx.pending() > backlog_max
    }

    /// Whether requests wait unprocessed in the receive buffer for the backlog to drain.
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn is_held(&self) -> bool {
        self.held
    }

    /// Process bytes the receive thread of a staged target received on this connection
    /// (`crate::stages`), as [`service`](Self::service) processes what it reads itself.
    pub fn take_in(&mut self, bytes: &[u8], shared: &Shared, stats: &WorkerStats) {
        if self.closing {
            return;
        }
        let started = Instant::now();
        bump(&stats.rx_bytes, bytes.len() as u64);
        self.last_rx = started;
        self.rx.extend(bytes);
        // No backlog bound here: the receive thread reads on its own, so requests held back
        // would wait for bytes that may never come.
        self.process(shared, stats, usize::MAX);
        bump(&stats.stage_exec_ns, nanos(started.elapsed()));
    }

    /// On a listener that serves TLS: look at the peer's first byte. A TLS handshake record
    /// turns the stream into TLS; anything else stays plaintext, unless TLS is required, when
    /// the peer is told so (`GOAWAY` `TlsRequired`, in plaintext it can read) and the
    /// connection closes. `Ok(false)`: nothing to decide from yet, or the connection closes.
    fn decide_tls(&mut self) -> io::Result<bool> {
        let Some(first) = self.stream.peek_first_byte()? else { return Ok(false) };
        let tls = self.tls_undecided.take().expect("called while undecided");
        if transport::tls::looks_like_tls(first) {
            self.stream.start_tls(tls.config)?;
            return Ok(true);
        }
        if tls.mode == transport::tls::TlsMode::Require {
            tracing::warn!(peer = %self.peer, "plaintext connection refused: this listener requires TLS");
            self.say_goaway(Status::TlsRequired, "this target requires TLS");
            return Ok(false);
        }
        Ok(true)
    }

    /// NBD STARTTLS: send the acknowledgement in plaintext, then turn the stream into TLS.
    /// Returns whether the stream is TLS now; `false` while the reply is still going out (the
    /// writable event brings the connection back) or when the connection fails (`closing`).
    fn upgrade(&mut self, shared: &Shared, stats: &WorkerStats) -> bool {
        if self.tx.pending() > 0 && !self.flush(stats) {
            self.closing = true;
            return false;
        }
        if self.tx.pending() > 0 {
            return false;
        }
        self.starttls = false;
        let Some(tls) = &shared.config.tls else {
            // Only a listener with TLS acknowledges STARTTLS (its handshake config says so).
            tracing::error!(peer = %self.peer, "NBD STARTTLS acknowledged without a TLS configuration");
            self.closing = true;
            return false;
        };
        if let Err(e) = self.stream.start_tls(tls.config.clone()) {
            tracing::warn!(peer = %self.peer, error = %e, "NBD STARTTLS: cannot start TLS");
            self.closing = true;
            return false;
        }
        self.identify = true;
        true
    }

    /// Once an upgraded NBD connection's TLS handshake is done: if the client presented a
    /// certificate (verified: the target asks for one only with `verify_peer`), its CN is the
    /// principal whose rights pick the exports offered from now on.
    fn identify_nbd(&mut self, shared: &Shared) {
        if !self.identify || !self.stream.tls_established() {
            return;
        }
        self.identify = false;
        let Some(principal) = self.stream.peer_principal() else { return };
        self.front.identify(&principal, shared, &self.peer);
    }

    /// Bytes still to go out: responses not yet sent, and ciphertext rustls could not write.
    pub fn pending(&self) -> usize {
        self.tx.pending() + usize::from(self.stream.pending_send())
    }

    /// Send queued responses; once a closing connection has sent them all, end its TLS session
    /// cleanly (`close_notify`, as the NBD specification asks after `NBD_CMD_DISC`). Returns
    /// false when the connection failed.
    pub fn flush(&mut self, stats: &WorkerStats) -> bool {
        if self.holding() {
            return true;
        }
        let started = Instant::now();
        let mut flushed = self.tx.flush(&mut self.stream);
        if flushed.is_ok() && self.closing && self.tx.pending() == 0 && !self.tls_closed {
            self.tls_closed = true;
            self.stream.close_tls();
        }
        if let (Ok(sent), true) = (&flushed, self.stream.pending_send()) {
            // Ciphertext the socket refused earlier: an empty send only flushes it (and counts
            // no plaintext bytes of its own).
            let sent = *sent;
            flushed = self.stream.send(&[]).map(|_| sent);
        }
        bump(&stats.stage_send_ns, nanos(started.elapsed()));
        match flushed {
            Ok(n) => bump(&stats.tx_bytes, n as u64),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                tracing::debug!(peer = %self.peer, error = %e, "send failed");
                return false;
            }
        }
        true
    }

    /// A flush of the loop pass: send what is queued (and a closing connection's
    /// `close_notify`). Returns whether the connection stays: false once it failed, or once it
    /// is closing and everything, the TLS end included, has gone out.
    pub fn flush_pass(&mut self, stats: &WorkerStats) -> bool {
        if self.wait == Wait::Void {
            return false;
        }
        let must_send = self.pending() > 0 || (self.closing && !self.tls_closed);
        if must_send && !self.flush(stats) {
            return false;
        }
        !(self.closing && self.pending() == 0)
    }

    /// The connection is dropped without a clean end (the peer closed, a failure, the target
    /// stopping): end its TLS session if nothing of ours would be cut short, with one send
    /// that does not wait.
    pub fn abandon(&mut self) {
        if self.tls_closed || self.tx.pending() > 0 {
            return;
        }
        self.tls_closed = true;
        self.stream.close_tls();
        if self.stream.pending_send() {
            let _ = self.stream.send(&[]);
        }
    }

    /// Let the front end handle what is in the receive buffer, stopping between requests
    /// once more than `backlog_max` bytes of replies are queued.
    fn process(&mut self, shared: &Shared, stats: &WorkerStats, backlog_max: usize) {
        self.identify_nbd(shared);
        let Conn { rx, tx, closing, peer, front, stream, data_apart, batch, woken, .. } = self;
        let later = Later::new(batch.as_ref());
        // Woken by the reads a request waited for: it runs now, without being prepared again
        // (unless the batch was cut short: the array's read queue was full).
        let resumed = std::mem::replace(woken, Wait::None) == Wait::Reads;
        let gate = Gate::new(batch.as_ref(), resumed);
        let mut link = Link { rx, tx, closing, peer, stats: &stats.front, backlog_max, gate, later };
        front.process(&mut link, shared);
        if !*data_apart && front.data_messages() {
            // Agreed in the HELLO just answered: completion caravans from here on send their
            // read data as data messages.
            *data_apart = stream.send_data_messages();
        }
        self.starttls |= front.take_starttls();
        let (parked, stopped, sealed) = (link.gate.waiting, link.gate.stopped, link.later.seal());
        if parked {
            self.wait = Wait::Reads;
        }
        match sealed {
            // Stopped for reads that all landed by the seal: no wake will come, so the next
            // pass takes up the requests left (`held`, below).
            Sealed::Free => {}
            Sealed::Wait => {
                // FLUSH or FUA replies queued: none leaves before the wake (`resume`), and
                // none may point into a RAM export's memory meanwhile.
                self.wait = Wait::Replies;
                self.tx.hold();
            }
            Sealed::Failed => self.void_replies(),
        }
        self.held = !self.closing
            && self.rx.pending() > 0
            && (self.backlogged(backlog_max)
                || (stopped && sealed == Sealed::Free && !self.planted(Mutation::ForgetStoppedOnFreeSeal)));
    }
}

fn nanos(d: Duration) -> u64 {
    d.as_nanos() as u64
}
