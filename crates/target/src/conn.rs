//! One connection on a worker: receive frames, execute caravans, queue responses.
//!
//! Write payloads are used in place in the receive buffer; read data is read by the backend
//! straight into the response buffer, where it is sent from. Completions of one request caravan
//! form one response caravan (split only if its read data would exceed the negotiated caravan
//! bytes). A protocol violation queues a GOAWAY naming the reason; the connection is closed
//! once that is sent, and no other connection notices.

use std::io::{self, IoSlice};
use std::ops::Range;
use std::time::{Duration, Instant};

use proto::server::ServerSession;
use transport::{FrameBuffer, FrameIo, Stream};

use crate::stats::{bump, WorkerStats};
use crate::Shared;

/// Response bytes waiting to be sent. The backing store only grows (bounded by the backlog
/// limit plus one caravan), so appending never zero-fills memory per request.
#[derive(Debug, Default)]
pub(crate) struct TxBuf {
    pub buf: Vec<u8>,
    pub len: usize,
    sent: usize,
}

impl TxBuf {
    pub fn pending(&self) -> usize {
        self.len - self.sent
    }

    /// Append `n` bytes of space; returns where they lie.
    pub fn reserve(&mut self, n: usize) -> Range<usize> {
        let start = self.len;
        if start + n > self.buf.len() {
            self.buf.resize((start + n).next_power_of_two(), 0);
        }
        self.len += n;
        start..self.len
    }

    pub fn truncate(&mut self, len: usize) {
        debug_assert!(len >= self.sent && len <= self.len);
        self.len = len;
    }

    pub fn append(&mut self, bytes: &[u8]) {
        let r = self.reserve(bytes.len());
        self.buf[r].copy_from_slice(bytes);
    }

    /// Send what the socket takes. Returns bytes sent; `WouldBlock` when nothing could go.
    fn flush(&mut self, io: &mut impl FrameIo) -> io::Result<usize> {
        let mut total = 0;
        while self.sent < self.len {
            match io.send(&[IoSlice::new(&self.buf[self.sent..self.len])]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.sent += n;
                    total += n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && total > 0 => break,
                Err(e) => return Err(e),
            }
        }
        if self.sent == self.len {
            self.sent = 0;
            self.len = 0;
        }
        Ok(total)
    }
}

pub(crate) struct Conn {
    pub stream: Stream,
    pub peer: String,
    rx: FrameBuffer,
    pub tx: TxBuf,
    /// Stop reading; close once the queued bytes are sent.
    pub closing: bool,
    kind: Kind,
}

/// The protocol a connection speaks, chosen by the listener it arrived on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Native,
    /// The NBD front end.
    Nbd,
}

enum Kind {
    Native(ServerSession),
    Nbd(Box<crate::nbd::NbdConn>),
}

/// What reading left the connection as.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ReadOutcome {
    /// The socket is drained for now.
    Drained,
    /// Stopped early (budget or backlog); come back without waiting for an event.
    More,
    /// Peer closed or the connection failed: drop it.
    Closed,
}

/// Reads per connection per loop pass, so one busy peer cannot starve the others.
const READS_PER_PASS: usize = 8;

impl Conn {
    pub fn new(stream: Stream, protocol: Protocol, shared: &Shared) -> Conn {
        let peer = stream.peer();
        let mut tx = TxBuf::default();
        let kind = match (protocol, &shared.nbd) {
            (Protocol::Nbd, Some(config)) => {
                let mut greeting = Vec::new();
                let conn = crate::nbd::NbdConn::new(config.clone(), &mut greeting);
                tx.append(&greeting);
                Kind::Nbd(Box::new(conn))
            }
            _ => Kind::Native(ServerSession::new(shared.config.limits)),
        };
        Conn { stream, peer, rx: FrameBuffer::new(), tx, closing: false, kind }
    }

    /// Read and process what the peer sent, within this pass's budget.
    pub fn service(&mut self, shared: &Shared, stats: &WorkerStats) -> ReadOutcome {
        for _ in 0..READS_PER_PASS {
            if self.closing {
                return ReadOutcome::Drained;
            }
            if self.tx.pending() > shared.config.tx_backlog_bytes_max {
                // The peer is not reading its completions; stop reading its requests until it
                // does (the writable event brings us back).
                return ReadOutcome::Drained;
            }
            let started = Instant::now();
            let filled = self.stream.fill(&mut self.rx);
            let received = Instant::now();
            bump(&stats.stage_recv_ns, nanos(received - started));
            match filled {
                Ok(0) => return ReadOutcome::Closed,
                Ok(n) => {
                    bump(&stats.rx_bytes, n as u64);
                    let more = self.rx.last_read_full();
                    self.process(shared, stats);
                    bump(&stats.stage_exec_ns, nanos(received.elapsed()));
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

    /// Send queued responses. Returns false when the connection is finished (failed, or a
    /// GOAWAY went out).
    pub fn flush(&mut self, stats: &WorkerStats) -> bool {
        let started = Instant::now();
        let flushed = self.tx.flush(&mut self.stream);
        bump(&stats.stage_send_ns, nanos(started.elapsed()));
        match flushed {
            Ok(n) => bump(&stats.tx_bytes, n as u64),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                tracing::debug!(peer = %self.peer, error = %e, "send failed");
                return false;
            }
        }
        !(self.closing && self.tx.pending() == 0)
    }

    fn process(&mut self, shared: &Shared, stats: &WorkerStats) {
        let Conn { rx, tx, closing, peer, kind, .. } = self;
        let mut link = Link { rx, tx, closing, peer, stats };
        match kind {
            Kind::Native(session) => crate::native::process(session, &mut link, shared),
            Kind::Nbd(conn) => conn.process(&mut link, shared),
        }
    }
}

/// What a protocol handler may touch on its connection.
pub(crate) struct Link<'a> {
    pub rx: &'a mut FrameBuffer,
    pub tx: &'a mut TxBuf,
    pub closing: &'a mut bool,
    pub peer: &'a str,
    pub stats: &'a WorkerStats,
}

impl Link<'_> {
    /// The peer broke the protocol: log why, count it, and close once queued bytes are sent.
    pub fn protocol_error(&mut self, reason: &str) {
        tracing::warn!(peer = %self.peer, reason, "closing connection: protocol error");
        bump(&self.stats.connections_closed_protocol_error, 1);
        *self.closing = true;
    }
}

fn nanos(d: Duration) -> u64 {
    d.as_nanos() as u64
}
