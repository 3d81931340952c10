//! One connection on a worker: receive frames, execute caravans, queue responses.
//!
//! Write payloads are used in place in the receive buffer; read data is read by the backend
//! straight into the response buffer, where it is sent from. Completions of one request caravan
//! form one response caravan (split only if its read data would exceed the negotiated caravan
//! bytes). A protocol violation queues a GOAWAY naming the reason; the connection is closed
//! once that is sent, and no other connection notices.

use std::io::{self, IoSlice};
use std::ops::Range;

use engine::Io;
use proto::server::{Inbound, ServerSession};
use transport::{FrameBuffer, FrameIo, Stream};
use wire::caravan::RequestCaravan;
use wire::control::{frame, OpenReply};
use wire::{Completion, FrameKind, GoAway, Header, Opcode, Status, COMPLETION_DESC_LEN, HEADER_LEN};

use crate::stats::{bump, WorkerStats};
use crate::Shared;

/// Response bytes waiting to be sent. The backing store only grows (bounded by the backlog
/// limit plus one caravan), so appending never zero-fills memory per request.
#[derive(Debug, Default)]
pub(crate) struct TxBuf {
    buf: Vec<u8>,
    len: usize,
    sent: usize,
}

impl TxBuf {
    pub fn pending(&self) -> usize {
        self.len - self.sent
    }

    /// Append `n` bytes of space; returns where they lie.
    fn reserve(&mut self, n: usize) -> Range<usize> {
        let start = self.len;
        if start + n > self.buf.len() {
            self.buf.resize((start + n).next_power_of_two(), 0);
        }
        self.len += n;
        start..self.len
    }

    fn truncate(&mut self, len: usize) {
        debug_assert!(len >= self.sent && len <= self.len);
        self.len = len;
    }

    fn append(&mut self, bytes: &[u8]) {
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

/// Builds response caravans in a [`TxBuf`]: header and descriptor slots first, read data after.
struct CompletionWriter {
    frame_start: usize,
    slots: usize,
    used: usize,
    data_bytes: usize,
    data_bytes_max: usize,
}

impl CompletionWriter {
    fn begin(tx: &mut TxBuf, slots: usize, data_bytes_max: usize) -> CompletionWriter {
        let frame_start = tx.reserve(HEADER_LEN + slots * COMPLETION_DESC_LEN).start;
        CompletionWriter { frame_start, slots, used: 0, data_bytes: 0, data_bytes_max }
    }

    /// Space for `len` bytes of read data, starting a new response caravan first when this one
    /// would exceed the caravan byte limit.
    fn data_space(&mut self, tx: &mut TxBuf, len: usize, stats: &WorkerStats) -> Range<usize> {
        if self.data_bytes + len > self.data_bytes_max && self.used > 0 {
            let rest = self.slots - self.used;
            self.seal(tx, stats);
            *self = CompletionWriter::begin(tx, rest, self.data_bytes_max);
        }
        self.data_bytes += len;
        tx.reserve(len)
    }

    /// Give back data space reserved for a read that failed (it is always the last thing
    /// appended).
    fn unreserve(&mut self, tx: &mut TxBuf, range: Range<usize>) {
        self.data_bytes -= range.len();
        tx.truncate(range.start);
    }

    fn push(&mut self, tx: &mut TxBuf, c: Completion) {
        debug_assert!(self.used < self.slots);
        let at = self.frame_start + HEADER_LEN + self.used * COMPLETION_DESC_LEN;
        c.emit(&mut tx.buf[at..at + COMPLETION_DESC_LEN]);
        self.used += 1;
    }

    fn seal(&self, tx: &mut TxBuf, stats: &WorkerStats) {
        let descs_end = self.frame_start + HEADER_LEN + self.used * COMPLETION_DESC_LEN;
        let slots_end = self.frame_start + HEADER_LEN + self.slots * COMPLETION_DESC_LEN;
        if descs_end < slots_end {
            // Only after a split: close the gap of unused slots so data follows descriptors.
            tx.buf.copy_within(slots_end..tx.len, descs_end);
            tx.len -= slots_end - descs_end;
        }
        let header = Header {
            kind: FrameKind::Completions,
            desc_count: self.used as u16,
            payload_len: self.data_bytes as u32,
        };
        header.emit(&mut tx.buf[self.frame_start..]);
        bump(&stats.caravans_sent, 1);
    }
}

pub(crate) struct Conn {
    pub stream: Stream,
    pub peer: String,
    rx: FrameBuffer,
    pub tx: TxBuf,
    session: ServerSession,
    /// A GOAWAY is queued: send it, then close.
    pub closing: bool,
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
    pub fn new(stream: Stream, limits: wire::Limits) -> Conn {
        let peer = stream.peer();
        Conn {
            stream,
            peer,
            rx: FrameBuffer::new(),
            tx: TxBuf::default(),
            session: ServerSession::new(limits),
            closing: false,
        }
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
            match self.stream.fill(&mut self.rx) {
                Ok(0) => return ReadOutcome::Closed,
                Ok(n) => {
                    bump(&stats.rx_bytes, n as u64);
                    self.process(shared, stats);
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
        match self.tx.flush(&mut self.stream) {
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
        loop {
            let f = match self.rx.next_frame(self.session.frame_bytes_max()) {
                Ok(Some(f)) => f,
                Ok(None) => return,
                Err(e) => return self.fail(Status::Invalid, &e.to_string(), stats),
            };
            let body = self.rx.body(&f);
            let inbound = match self.session.handle_frame(&f.header, body) {
                Ok(i) => i,
                Err(e) => return self.fail(Status::Invalid, &e.to_string(), stats),
            };
            match inbound {
                Inbound::Hello { reply } => {
                    self.tx.append(&frame(FrameKind::HelloReply, &reply.encode()));
                    if reply.status != Status::Ok {
                        self.closing = true;
                        tracing::info!(peer = %self.peer, "no common protocol version");
                    }
                }
                Inbound::Open(open) => {
                    let reply = match shared.exports.find(&open.name) {
                        None => OpenReply::refused(Status::NotFound),
                        Some((index, export)) => match self.session.open_handle(index) {
                            Ok(handle) => {
                                let info = export.info();
                                OpenReply {
                                    status: Status::Ok,
                                    handle,
                                    size_bytes: info.size_bytes,
                                    block_size: info.block_size,
                                    flags: info.flags,
                                }
                            }
                            Err(status) => OpenReply::refused(status),
                        },
                    };
                    self.tx.append(&frame(FrameKind::OpenReply, &reply.encode()));
                }
                Inbound::List => {
                    let body = wire::ExportInfo::encode_list(&shared.exports.infos());
                    self.tx.append(&frame(FrameKind::ListReply, &body));
                }
                Inbound::Stats => {
                    let body = crate::stats::collect(shared).encode();
                    self.tx.append(&frame(FrameKind::StatsReply, &body));
                }
                Inbound::Requests(caravan) => {
                    execute_caravan(&caravan, &self.session, &mut self.tx, shared, stats);
                }
            }
        }
    }

    /// Queue a GOAWAY and stop reading: the framing can no longer be trusted.
    fn fail(&mut self, status: Status, reason: &str, stats: &WorkerStats) {
        tracing::warn!(peer = %self.peer, reason, "closing connection: protocol error");
        bump(&stats.connections_closed_protocol_error, 1);
        let goaway = GoAway { status, message: reason.to_owned() };
        self.tx.append(&frame(FrameKind::GoAway, &goaway.encode()));
        self.closing = true;
    }
}

fn execute_caravan(
    caravan: &RequestCaravan<'_>,
    session: &ServerSession,
    tx: &mut TxBuf,
    shared: &Shared,
    stats: &WorkerStats,
) {
    stats.record_caravan(caravan.len());
    let limits = session.limits();
    let mut out = CompletionWriter::begin(tx, caravan.len(), limits.caravan_bytes_max as usize);
    for (parsed, payload) in caravan.iter() {
        let req = match parsed {
            Ok(req) => req,
            Err(refused) => {
                stats.ops.record_refused();
                out.push(tx, Completion { tag: refused.tag, status: refused.status, data_len: 0 });
                continue;
            }
        };
        let io = Io::from(&req);
        let export = session.resolve(req.handle).and_then(|i| shared.exports.get(i));
        let checked = export
            .ok_or(Status::BadHandle)
            .and_then(|e| engine::validate(e, &io, limits.io_bytes_max).map(|()| e));
        let (status, data_len) = match checked {
            Err(status) => (status, 0),
            Ok(export) if req.opcode == Opcode::Read => {
                let range = out.data_space(tx, req.length as usize, stats);
                let status = engine::execute(export, &io, &[], &mut tx.buf[range.clone()]);
                if status.is_ok() {
                    (status, req.length)
                } else {
                    out.unreserve(tx, range);
                    (status, 0)
                }
            }
            Ok(export) => (engine::execute(export, &io, payload, &mut []), 0),
        };
        stats.ops.record(req.opcode, req.length, status);
        out.push(tx, Completion { tag: req.tag, status, data_len });
    }
    out.seal(tx, stats);
}
