//! The native skiff protocol on one connection: handshake and control frames through
//! [`ServerSession`], caravans executed in place.
//!
//! Write payloads are used where they lie in the receive buffer; read data of RAM exports is
//! sent straight from the volume's memory, and other backends read it into the response
//! buffer, where it is sent from. The completions of one
//! request caravan form one response caravan (split only if its read data would exceed the
//! negotiated caravan bytes). A protocol violation queues a GOAWAY naming the reason, and the
//! connection closes once that is sent.

use engine::{Export, Io};
use proto::server::{Inbound, ServerSession};
use wire::caravan::RequestCaravan;
use wire::control::{frame, OpenReply};
use wire::{Completion, FrameKind, GoAway, Header, Opcode, Status, COMPLETION_DESC_LEN, HEADER_LEN};

use crate::conn::{Link, TxBuf};
use crate::stats::{bump, WorkerStats};
use crate::Shared;

pub(crate) fn process(session: &mut ServerSession, link: &mut Link<'_>, shared: &Shared) {
    loop {
        let f = match link.rx.next_frame(session.frame_bytes_max()) {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => return goaway(link, Status::Invalid, &e.to_string()),
        };
        let body = link.rx.body(&f);
        let inbound = match session.handle_frame(&f.header, body) {
            Ok(i) => i,
            Err(e) => return goaway(link, Status::Invalid, &e.to_string()),
        };
        match inbound {
            Inbound::Hello { reply } => {
                link.tx.append(&frame(FrameKind::HelloReply, &reply.encode()));
                if reply.status != Status::Ok {
                    *link.closing = true;
                    tracing::info!(peer = %link.peer, "no common protocol version");
                }
            }
            Inbound::Open(open) => {
                let reply = match shared.exports.find(&open.name) {
                    None => OpenReply::refused(Status::NotFound),
                    Some((index, export)) => match session.open_handle(index) {
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
                link.tx.append(&frame(FrameKind::OpenReply, &reply.encode()));
            }
            Inbound::List => {
                let body = wire::ExportInfo::encode_list(&shared.exports.infos());
                link.tx.append(&frame(FrameKind::ListReply, &body));
            }
            Inbound::Stats => {
                let body = crate::stats::collect(shared).encode();
                link.tx.append(&frame(FrameKind::StatsReply, &body));
            }
            Inbound::Requests(caravan) => {
                execute_caravan(&caravan, session, link.tx, shared, link.stats);
            }
        }
    }
}

/// Queue a GOAWAY and stop reading: the framing can no longer be trusted.
fn goaway(link: &mut Link<'_>, status: Status, reason: &str) {
    link.protocol_error(reason);
    let goaway = GoAway { status, message: reason.to_owned() };
    link.tx.append(&frame(FrameKind::GoAway, &goaway.encode()));
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

    /// Make room for `len` bytes of read data, starting a new response caravan first when this
    /// one would exceed the caravan byte limit. Returns false, having made no room, when the
    /// read fails: nothing was appended and the request completes with `status` alone.
    fn read(&mut self, tx: &mut TxBuf, export: &Export, io: &Io, stats: &WorkerStats) -> Status {
        let len = io.length as usize;
        if self.data_bytes + len > self.data_bytes_max && self.used > 0 {
            let rest = self.slots - self.used;
            self.seal(tx, stats);
            *self = CompletionWriter::begin(tx, rest, self.data_bytes_max);
        }
        let status = tx.append_read(export, io);
        if status.is_ok() {
            self.data_bytes += len;
        }
        status
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
            tx.remove(descs_end..slots_end);
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
                let status = out.read(tx, export, &io, stats);
                (status, if status.is_ok() { req.length } else { 0 })
            }
            Ok(export) => (engine::execute(export, &io, payload, &mut []), 0),
        };
        stats.ops.record(req.opcode, req.length, status);
        out.push(tx, Completion { tag: req.tag, status, data_len });
    }
    out.seal(tx, stats);
}
