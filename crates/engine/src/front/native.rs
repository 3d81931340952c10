//! The native skiff protocol on one connection: handshake and control frames through
//! [`ServerSession`], caravans executed in place.
//!
//! Every frame is judged from its header alone (state, direction, negotiated limits) before its
//! body is waited for. Write payloads are used where they lie in the receive buffer; read data
//! goes to the sink (which may send RAM data straight from the volume's memory). The
//! completions of one request caravan form one response caravan, split only if its read data
//! would exceed the negotiated caravan bytes, or where a request waits for a device: on a
//! flash volume, the requests before the first whose pages are being read are answered at
//! once, and the rest once they land, in order (the thesis's longest ready prefix;
//! [`super::Gate`]). A protocol violation queues a GOAWAY with the
//! status [`ProtoError::goaway_status`] gives and the reason, and the connection closes once
//! that is sent; a GOAWAY from the initiator closes it with nothing more said.

use std::sync::Arc;

use backend::Batch;
use proto::server::{Inbound, ServerSession};
use proto::ProtoError;
use wire::capability::CAPABILITIES_PER_FRAME_MAX;
use wire::caravan::RequestCaravan;
use wire::control::{frame, OpenReply};
use wire::{
    Capability, Completion, FrameKind, GoAway, Header, Opcode, ReqFlags, Request, Status,
    COMPLETION_DESC_LEN, HEADER_LEN,
};

use super::{FrontStats, Host, Laps, Later, Link, Sink};
use crate::direct::Plan;
use crate::layer::Held;
use crate::stats::bump;
use crate::{Export, Io, Lease};

/// One native connection's protocol state on the target.
#[derive(Debug)]
pub struct NativeConn {
    session: ServerSession,
    /// Capabilities earned by the caravan being answered, sent after its completions.
    caps: Vec<Capability>,
    /// The exports this connection opened, held until it closes: none of them can be retired
    /// meanwhile (`crate::table`).
    leases: Vec<Lease>,
    /// The planted bug's state (nothing without the feature `mutations`).
    bug: mutation::Bug,
    /// Where it stands with requests that wait for a device.
    waits: Waits,
}

/// Where a native connection stands with requests that wait for a device ([`Gate`](super::Gate)).
#[derive(Debug, Default)]
struct Waits {
    /// An export this connection opened may park requests.
    may_wait: bool,
    /// Requests of the first caravan in the receive buffer answered already: the connection
    /// stopped inside it, before one whose pages were being read, and goes on from there.
    answered: usize,
    /// Bytes at the start of the receive buffer whose requests the look-ahead has prepared
    /// ([`Waits::look_ahead`]): not prepared there again.
    looked_to: usize,
    /// The look-ahead's batch ([`Batch::detached`]): what it started for requests not yet
    /// answered, still going.
    ahead: Option<Arc<Batch>>,
}

impl Waits {
    /// Let the backends start what every complete request in `rx` not looked at yet would
    /// wait for, on the look-ahead's batch, so that it all goes at once; returns whether any of
    /// what the look-ahead started is still going, or it could not start it all. While
    /// neither, the requests run as they come (a page taken from the pool since is read the
    /// ordinary way); else each is asked first whether it is ready (`Gate::ready`). A caravan
    /// whose reads a backend could not all start (its read queue was full: the batch is cut
    /// short) is looked at again in the next pass, when those started have made room. Nothing
    /// is consumed or answered here; a frame that does not parse, or a request that would be
    /// refused, is left for `process` to answer.
    fn look_ahead(&mut self, rx: &[u8], session: &ServerSession, host: &impl Host) -> bool {
        let ahead = self.ahead.get_or_insert_with(|| Arc::new(Batch::detached()));
        let mut at = self.looked_to;
        let mut cut = false;
        while let Ok(Some(header)) = wire::framing::peek_header(&rx[at..]) {
            let len = header.frame_len();
            if rx.len() - at < len {
                break;
            }
            if header.kind == FrameKind::Requests {
                let body = &rx[at + HEADER_LEN..at + len];
                let Ok(caravan) = RequestCaravan::parse(&header, body) else { break };
                let answered = if at == 0 { self.answered } else { 0 };
                for req in caravan.iter().skip(answered).filter_map(|(parsed, _)| parsed.ok()) {
                    prepare(&req, session, host, ahead);
                    cut = ahead.take_cut_short();
                    if cut {
                        break;
                    }
                }
                if cut {
                    break;
                }
            }
            at += len;
        }
        self.looked_to = at;
        cut || ahead.outstanding() > 0
    }
}

impl NativeConn {
    /// A connection that will offer `limits` in the handshake and let its peer hold
    /// `open_handles_max` exports open.
    pub fn new(limits: wire::Limits, open_handles_max: usize) -> NativeConn {
        NativeConn {
            session: ServerSession::new(limits, open_handles_max),
            caps: Vec::new(),
            leases: Vec::new(),
            bug: mutation::Bug::new(),
            waits: Waits::default(),
        }
    }

    /// Authenticate initiators that ask with `auth`'s keys and nonce (docs/PROTOCOL.md,
    /// section 15).
    pub fn with_auth(mut self, auth: proto::server::AuthConfig) -> NativeConn {
        self.session = self.session.with_auth(auth);
        self
    }

    /// Agree to data messages when the initiator asks: the connection's transport can send
    /// completion caravans' read data apart from the stream (docs/PROTOCOL.md 16.9).
    pub fn with_data_messages(mut self) -> NativeConn {
        self.session = self.session.with_data_messages();
        self
    }

    /// Whether data messages were agreed: the driver switches its transport over.
    pub fn data_messages(&self) -> bool {
        self.session.data_messages()
    }

    /// Plant a bug, for the simulator's proof that it catches them.
    #[cfg(feature = "mutations")]
    pub fn set_mutation(&mut self, mutation: mutation::Mutation) {
        self.bug.mutation = mutation;
    }

    /// Whether the handshake is done ([`ServerSession::is_established`]).
    pub fn is_established(&self) -> bool {
        self.session.is_established()
    }

    /// Handle every frame that has arrived whole, up to the first request that waits for a
    /// device ([`Gate`](super::Gate)).
    pub fn process<S: Sink + ?Sized>(&mut self, link: &mut Link<'_, S>, host: &impl Host) {
        let leases = self.leases.len();
        process(
            &mut self.session,
            link,
            host,
            &mut self.caps,
            &mut self.leases,
            &mut self.bug,
            &mut self.waits,
        );
        if self.leases.len() != leases && !self.waits.may_wait {
            // An export opened just now may be one whose reads can wait.
            self.waits.may_wait = (0..host.exports().len() as u32).any(|i| {
                self.session.handle_of(i).is_some()
                    && host.exports().get(i).is_some_and(|e| e.backend.may_wait())
            });
        }
    }
}

fn process<S: Sink + ?Sized>(
    session: &mut ServerSession,
    link: &mut Link<'_, S>,
    host: &impl Host,
    caps: &mut Vec<Capability>,
    leases: &mut Vec<Lease>,
    bug: &mut mutation::Bug,
    waits: &mut Waits,
) {
    // Everything received is prepared at once; while some of it is still being read, each
    // request is asked before it runs.
    let gated =
        waits.may_wait && link.gate.batch.is_some() && waits.look_ahead(link.rx.unconsumed(), session, host);
    while !*link.closing && !link.backlogged() {
        let f = match link.rx.next_frame(|h| session.admit(h)) {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => return goaway(link, &e),
        };
        let looked_to = waits.looked_to;
        waits.looked_to = looked_to.saturating_sub(HEADER_LEN + f.body.len());
        let body = link.rx.body(&f);
        let inbound = match session.handle_frame(&f.header, body) {
            Ok(i) => i,
            Err(e) => return goaway(link, &e),
        };
        match inbound {
            Inbound::Hello { reply } => {
                link.tx.append(&frame(FrameKind::HelloReply, &reply.encode()));
                if reply.status != Status::Ok {
                    *link.closing = true;
                    tracing::info!(peer = %link.peer, "no common protocol version");
                }
            }
            Inbound::Auth { reply, key, reason } => {
                link.tx.append(&frame(FrameKind::AuthReply, &reply.encode()));
                if let Some(reason) = reason {
                    tracing::warn!(peer = %link.peer, key = %key, reason, "authentication failed");
                    *link.closing = true;
                } else {
                    tracing::debug!(peer = %link.peer, key = %key, "authenticated");
                }
            }
            Inbound::Open(open) => {
                let reply = open_export(session, host, &open.name, link.peer, leases);
                link.tx.append(&frame(FrameKind::OpenReply, &reply.encode()));
            }
            Inbound::List => {
                // Only what this initiator may open, with the rights it would get.
                let infos: Vec<wire::ExportInfo> = host
                    .exports()
                    .iter()
                    .filter_map(|e| {
                        let read_only = e.grant(session.principal()).ok()?;
                        Some(wire::ExportInfo { flags: e.flags_granted(read_only), ..e.info() })
                    })
                    .collect();
                let body = wire::ExportInfo::encode_list(&infos);
                link.tx.append(&frame(FrameKind::ListReply, &body));
            }
            Inbound::Grant(grant) => {
                let reply = bind_grants(session, host, &grant, link.peer);
                link.tx.append(&frame(FrameKind::GrantReply, &reply.encode()));
            }
            Inbound::Revoke(revoke) => {
                let reply = revoke_capabilities(session, host, &revoke, link.peer);
                link.tx.append(&frame(FrameKind::RevokeReply, &reply.encode()));
            }
            Inbound::Register(register) => {
                let reply = register_reference(session, host, &register);
                link.tx.append(&frame(FrameKind::RegisterReply, &reply.encode()));
            }
            Inbound::Stats => {
                link.tx.append(&frame(FrameKind::StatsReply, &host.stats_reply().encode()));
            }
            Inbound::Volume(request) => {
                let reply = host.volume(&request);
                link.tx.append(&frame(FrameKind::VolumeReply, &reply.encode()));
            }
            Inbound::VolumeRefused { op, status } => {
                tracing::warn!(peer = %link.peer, op = op.name(), %status, "volume request refused: no key proved");
                let message = "volume requests need a connection that proved a key on a target with keys";
                let reply = wire::VolumeReply::refused(op, status, message);
                link.tx.append(&frame(FrameKind::VolumeReply, &reply.encode()));
            }
            Inbound::Requests(caravan) => {
                let from = std::mem::take(&mut waits.answered);
                if from == 0 {
                    bug.before_caravan(host);
                }
                let gate = &mut link.gate;
                let mut ready = |req: &Request, later: &Later<'_>| {
                    !gated || gate.ready(later, |batch| prepare(req, session, host, batch))
                };
                let out = Out { tx: &mut *link.tx, later: &mut link.later, stats: link.stats, caps };
                let Some(at) = execute_caravan(&caravan, from, session, out, &mut ready, host, bug) else {
                    continue;
                };
                // The request at `at` waits for its pages: it and the rest stay in the
                // buffer (what they will read was started by the look-ahead).
                link.rx.unread(&f);
                waits.looked_to = looked_to;
                waits.answered = at;
                return;
            }
            Inbound::GoAway(goaway) => {
                // The initiator is done: what it sent before is answered (it was executed in
                // order), then the connection closes with nothing more said.
                tracing::debug!(peer = %link.peer, status = %goaway.status, message = %goaway.message, "initiator closed the connection");
                *link.closing = true;
            }
        }
    }
}

/// Let the backends start, on `batch`, what a READ or WRITE would wait for ([`Gate`](super::Gate)). A
/// request that would be refused starts nothing: it is answered when it runs.
fn prepare(req: &Request, session: &ServerSession, host: &impl Host, batch: &Arc<Batch>) {
    // A direct read is prepared like a read: its reference is checked when it executes, and a
    // wrong one has cost no more than the read it names.
    let write = match req.opcode {
        Opcode::Read | Opcode::DirectRead => false,
        Opcode::Write | Opcode::DirectWrite if !session.is_read_only(req.handle) => true,
        _ => return,
    };
    let io = Io { opcode: if write { Opcode::Write } else { Opcode::Read }, ..Io::from(req) };
    let Some(export) = session.resolve(req.handle).and_then(|i| host.exports().get(i)) else {
        return;
    };
    // A pool's request is prepared only under a grant the connection holds now (one presented
    // in this same read is bound later: its request just waits for its pages when it runs).
    // Judged as a read: a write's own check marks the regions it touches, which only its
    // execution may do.
    let judged = || {
        let read = Io { opcode: Opcode::Read, ..io };
        export.judge(&read, Held { session, handle: req.handle }).is_ok()
    };
    if crate::validate(export, &io, session.limits().io_bytes_max).is_ok()
        && (!export.judges_requests() || judged())
    {
        export.backend.prepare(io.offset, io.length.into(), write, batch);
    }
}

fn open_export(
    session: &mut ServerSession,
    host: &impl Host,
    name: &str,
    peer: &str,
    leases: &mut Vec<Lease>,
) -> OpenReply {
    let Some((index, export)) = host.exports().find(name) else {
        return OpenReply::refused(Status::NotFound);
    };
    let read_only = match export.grant(session.principal()) {
        Ok(read_only) => read_only,
        Err(status) => {
            tracing::warn!(peer, export = name, key = session.principal().unwrap_or("(none)"), %status, "open refused");
            return OpenReply::refused(status);
        }
    };
    // One lease per export and connection, taken when it is first opened here: a dynamic
    // export being retired refuses it (NotFound, as if it were gone already).
    let lease = match session.handle_of(index) {
        Some(_) => None,
        None => match host.exports().lease(index) {
            Ok(lease) => Some(lease),
            Err(status) => return OpenReply::refused(status),
        },
    };
    match session.open_handle(index, read_only) {
        Ok(handle) => {
            leases.extend(lease);
            let info = export.info();
            OpenReply {
                status: Status::Ok,
                handle,
                size_bytes: info.size_bytes,
                block_size: info.block_size,
                flags: export.flags_granted(read_only),
            }
        }
        Err(status) => OpenReply::refused(status),
    }
}

/// REVOKE: rotate the key epoch of, or invalidate a range of the cache of, an export this
/// connection opened; only where it may write (a reader cannot revoke what others read).
fn revoke_capabilities(
    session: &ServerSession,
    host: &impl Host,
    revoke: &wire::Revoke,
    peer: &str,
) -> wire::RevokeReply {
    let refuse = |status| wire::RevokeReply { status, epoch: 0 };
    let Some(export) = session.resolve(revoke.handle).and_then(|i| host.exports().get(i)) else {
        return refuse(Status::BadHandle);
    };
    if session.is_read_only(revoke.handle) {
        return refuse(Status::ReadOnly);
    }
    let Some(d) = &export.direct else { return refuse(Status::Unsupported) };
    let epoch = match revoke.action {
        wire::RevokeAction::RotateEpoch => match d.rotate_epoch_durably() {
            Ok(epoch) => epoch,
            Err(e) => {
                // In force here until the target stops, but not saved: say so rather than Ok.
                tracing::error!(peer, export = %export.name, error = %e, "key epoch rotated, but it could not be saved: after a restart the revoked references would be valid again");
                return refuse(Status::IoError);
            }
        },
        wire::RevokeAction::Invalidate => {
            d.invalidate(revoke.offset, revoke.length);
            d.epoch()
        }
    };
    tracing::info!(peer, export = %export.name, action = ?revoke.action, offset = revoke.offset, length = revoke.length, epoch, "capabilities revoked");
    wire::RevokeReply { status: Status::Ok, epoch }
}

/// REGISTER: seal a reference to a range of an export this connection opened (FlashNet's
/// lazy registration: nothing is read, allocated or pinned), with no more rights than the
/// handle has.
fn register_reference(
    session: &ServerSession,
    host: &impl Host,
    register: &wire::Register,
) -> wire::RegisterReply {
    let refuse = wire::RegisterReply::refused;
    let Some(index) = session.resolve(register.handle) else { return refuse(Status::BadHandle) };
    let Some(export) = host.exports().get(index) else { return refuse(Status::BadHandle) };
    if register.rights.contains(wire::CapRights::WRITE)
        && (session.is_read_only(register.handle) || export.is_read_only())
    {
        return refuse(Status::ReadOnly);
    }
    let Some(d) = &export.direct else { return refuse(Status::Unsupported) };
    let size = export.backend.size_bytes();
    match d.register(index, size, register.rights, register.offset, register.length) {
        Ok(cap) => wire::RegisterReply { status: Status::Ok, cap: Some(cap) },
        Err(status) => refuse(status),
    }
}

/// GRANT: judge each chunk grant against the pool of the export the handle names, and bind
/// them all to the handle, or none: the reply names the first refused.
fn bind_grants(
    session: &mut ServerSession,
    host: &impl Host,
    grant: &wire::Grant,
    peer: &str,
) -> wire::GrantReply {
    let refuse = |status, refused| wire::GrantReply { status, refused };
    let Some(export) = session.resolve(grant.handle).and_then(|i| host.exports().get(i)) else {
        return refuse(Status::BadHandle, 0);
    };
    let Some(pool) = export.grants() else { return refuse(Status::Unsupported, 0) };
    let mut admitted = Vec::with_capacity(grant.caps.len());
    for (i, cap) in grant.caps.iter().enumerate() {
        match pool.admit(cap) {
            Ok(bound) => admitted.push(bound),
            Err(fault) => {
                // Debug, not warn: a peer may send refused grants as fast as it likes.
                tracing::debug!(peer, export = %export.name, chunk = cap.slot, ?fault, "chunk grant refused");
                return refuse(fault.status(), i as u32);
            }
        }
    }
    for bound in admitted {
        session.bind(grant.handle, bound);
    }
    wire::GrantReply { status: Status::Ok, refused: 0 }
}

/// Queue a GOAWAY and stop reading: the framing can no longer be trusted.
fn goaway<S: Sink + ?Sized>(link: &mut Link<'_, S>, error: &ProtoError) {
    let reason = error.to_string();
    link.protocol_error(&reason);
    let goaway = GoAway { status: error.goaway_status(), message: reason };
    link.tx.append(&frame(FrameKind::GoAway, &goaway.encode()));
}

/// Builds response caravans in a [`Sink`]: header and descriptor slots first, read data after.
struct CompletionWriter {
    frame_start: usize,
    slots: usize,
    used: usize,
    data_bytes: usize,
    data_bytes_max: usize,
    /// Read data the descriptors pushed so far announce: at the seal it must be what the
    /// caravan carries, or the initiator would take one request's bytes for another's.
    described: usize,
}

impl CompletionWriter {
    fn begin<S: Sink + ?Sized>(tx: &mut S, slots: usize, data_bytes_max: usize) -> CompletionWriter {
        let frame_start = tx.reserve(HEADER_LEN + slots * COMPLETION_DESC_LEN).start;
        CompletionWriter { frame_start, slots, used: 0, data_bytes: 0, data_bytes_max, described: 0 }
    }

    /// Make room for `len` bytes of read data, first starting a new response caravan when this
    /// one would exceed the caravan byte limit.
    fn room<S: Sink + ?Sized>(&mut self, tx: &mut S, len: usize, stats: &FrontStats) {
        if self.data_bytes + len > self.data_bytes_max && self.used > 0 {
            let rest = self.slots - self.used;
            self.seal(tx, stats);
            *self = CompletionWriter::begin(tx, rest, self.data_bytes_max);
        }
    }

    /// Append a read's data. On failure nothing was appended and the request completes with
    /// the status alone. Returns where the data starts in the sink when the sink copied it
    /// there (not for data sent by address).
    fn read<S: Sink + ?Sized>(
        &mut self,
        tx: &mut S,
        export: &Export,
        io: &Io,
        stats: &FrontStats,
    ) -> (Status, usize) {
        let len = io.length as usize;
        self.room(tx, len, stats);
        let start = tx.len();
        let status = tx.append_read(export, io);
        if status.is_ok() {
            self.data_bytes += len;
        }
        (status, start)
    }

    /// Append `len` bytes that `fill` writes (a direct read from a cache slot); on failure
    /// nothing is appended.
    fn read_with<S: Sink + ?Sized, E>(
        &mut self,
        tx: &mut S,
        len: usize,
        stats: &FrontStats,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        self.room(tx, len, stats);
        let range = tx.reserve(len);
        let start = range.start;
        match fill(tx.bytes_mut(range)) {
            Ok(()) => {
                self.data_bytes += len;
                Ok(())
            }
            Err(e) => {
                tx.truncate(start);
                Err(e)
            }
        }
    }

    fn push<S: Sink + ?Sized>(&mut self, tx: &mut S, c: Completion) {
        // A descriptor past the slots reserved would land on read data already appended.
        assert!(self.used < self.slots, "completion {} of a caravan of {}", self.used + 1, self.slots);
        self.described += c.data_len as usize;
        let at = self.frame_start + HEADER_LEN + self.used * COMPLETION_DESC_LEN;
        c.emit(tx.bytes_mut(at..at + COMPLETION_DESC_LEN));
        self.used += 1;
    }

    /// End here, before the requests left: seal what was answered, or take back the empty
    /// caravan begun for them.
    fn stop<S: Sink + ?Sized>(&self, tx: &mut S, stats: &FrontStats) {
        if self.used == 0 {
            tx.truncate(self.frame_start);
        } else {
            self.seal(tx, stats);
        }
    }

    fn seal<S: Sink + ?Sized>(&self, tx: &mut S, stats: &FrontStats) {
        assert_eq!(
            self.described, self.data_bytes,
            "completion descriptors announce {} bytes of read data, the caravan carries {}",
            self.described, self.data_bytes
        );
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
        header.emit(tx.bytes_mut(self.frame_start..self.frame_start + HEADER_LEN));
        bump(&stats.caravans_sent, 1);
    }
}

/// Where a caravan's answers go: the connection's sink, the batch its durability is started
/// on, its counters, and the capabilities its reads earn.
struct Out<'o, 'a, S: ?Sized> {
    tx: &'o mut S,
    later: &'o mut Later<'a>,
    stats: &'o FrontStats,
    caps: &'o mut Vec<Capability>,
}

/// Execute the requests of `caravan` from request `from` on, in order, and answer them with
/// one completion caravan (split only by the caravan byte limit). Before each, `ready` says
/// whether it may run now (`Gate::ready`); the first that may not ends the caravan's answer
/// there, and its index is returned: it and the rest run later.
fn execute_caravan<S: Sink + ?Sized>(
    caravan: &RequestCaravan<'_>,
    from: usize,
    session: &ServerSession,
    out: Out<'_, '_, S>,
    ready: &mut impl FnMut(&Request, &Later<'_>) -> bool,
    host: &impl Host,
    bug: &mut mutation::Bug,
) -> Option<usize> {
    let Out { tx, later, stats, caps } = out;
    if from == 0 {
        stats.record_caravan(caravan.len());
    }
    if caravan.len() <= from {
        // Well-formed, and carries nothing: nothing to answer.
        return None;
    }
    let limits = session.limits();
    let mut out = CompletionWriter::begin(tx, caravan.len() - from, limits.caravan_bytes_max as usize);
    let mut laps = Laps::start(host);
    for (i, (parsed, payload)) in caravan.iter().enumerate().skip(from) {
        if let Ok(req) = &parsed {
            if !ready(req, later) {
                out.stop(tx, stats);
                send_capabilities(caps, tx, stats);
                return Some(i);
            }
        }
        let req = match parsed {
            Ok(req) => req,
            Err(refused) => {
                stats.ops.record_refused(refused.status);
                out.push(tx, Completion { tag: refused.tag, status: refused.status, data_len: 0 });
                continue;
            }
        };
        let io = Io::from(&req);
        let index = session.resolve(req.handle);
        let export = index.and_then(|i| host.exports().get(i));
        if req.opcode == Opcode::DirectRead {
            let status = match (index, export) {
                (Some(index), Some(export)) => {
                    direct_read(&mut out, tx, index, export, &io, payload, host, limits.io_bytes_max, stats)
                }
                _ => Status::BadHandle,
            };
            let data_len = if status.is_ok() { req.length } else { 0 };
            stats.ops.record(index, req.opcode, req.length, status, laps.lap(host));
            out.push(tx, Completion { tag: req.tag, status, data_len });
            continue;
        }
        if req.opcode == Opcode::DirectWrite {
            let status = match (index, export) {
                (Some(index), Some(export)) => {
                    let read_only = session.is_read_only(req.handle);
                    direct_write(index, export, &io, payload, read_only, later, host, limits.io_bytes_max)
                }
                _ => Status::BadHandle,
            };
            stats.ops.record(index, req.opcode, req.length, status, laps.lap(host));
            out.push(tx, Completion { tag: req.tag, status, data_len: 0 });
            continue;
        }
        let checked = export
            .ok_or(Status::BadHandle)
            .and_then(|e| {
                // A handle granted read-only refuses what changes the volume, whatever the
                // export would allow another key.
                if req.opcode.is_mutating() && session.is_read_only(req.handle) {
                    Err(Status::ReadOnly)
                } else {
                    Ok(e)
                }
            })
            .and_then(|e| crate::validate(e, &io, limits.io_bytes_max).map(|()| e))
            .and_then(|e| {
                // The layers that judge requests by what the connection holds (a pool's
                // chunks need a grant for them).
                if !e.judges_requests() {
                    return Ok(e);
                }
                e.judge(&io, Held { session, handle: req.handle }).map(|()| e)
            });
        let (status, data_len) = match checked {
            Err(status) => (status, 0),
            Ok(export) if req.opcode == Opcode::Read => {
                let wants = req.flags.contains(ReqFlags::WANT_CAP) && session.direct_reads();
                let plan = match (&export.direct, index) {
                    (Some(d), Some(_)) if wants => d.plan(io.offset, io.length),
                    _ => Plan::None,
                };
                let (status, start) = out.read(tx, export, &io, stats);
                if status.is_ok() {
                    let writable = !session.is_read_only(req.handle) && !export.is_read_only();
                    earn(caps, tx, export, index.unwrap_or(0), &io, plan, start, writable, host);
                }
                (status, if status.is_ok() { req.length } else { 0 })
            }
            Ok(export) => match bug.write(req.handle, &io, payload) {
                Some(status) => (status, 0),
                None => (crate::execute_later(export, &io, payload, later), 0),
            },
        };
        stats.ops.record(index, req.opcode, req.length, status, laps.lap(host));
        out.push(tx, Completion { tag: req.tag, status, data_len });
    }
    out.seal(tx, stats);
    send_capabilities(caps, tx, stats);
    None
}

/// Seal the capabilities a successful read earned (see [`crate::direct`]) into `caps`.
#[allow(clippy::too_many_arguments)]
fn earn<S: Sink + ?Sized>(
    caps: &mut Vec<Capability>,
    tx: &mut S,
    export: &Export,
    index: u32,
    io: &Io,
    plan: Plan,
    start: usize,
    writable: bool,
    host: &impl Host,
) {
    let Some(d) = &export.direct else { return };
    match plan {
        Plan::None => {}
        Plan::Region => {
            caps.push(d.seal_region(index, export.backend.size_bytes(), io.offset, host.clock_ms()))
        }
        Plan::Extent => {
            caps.push(d.seal_volume(index, export.backend.size_bytes(), writable, host.clock_ms()))
        }
        Plan::Fill(ticket) => {
            if tx.len() < start + io.length as usize {
                // Sent by reference (a backend lent the bytes): no copy here to fill from.
                return;
            }
            let data = tx.bytes_mut(start..start + io.length as usize);
            d.fill(index, &ticket, data, host.clock_ms(), |c| caps.push(c));
        }
    }
}

/// Send the capabilities a caravan earned, after its completions, in as few frames as fit.
fn send_capabilities<S: Sink + ?Sized>(caps: &mut Vec<Capability>, tx: &mut S, stats: &FrontStats) {
    for chunk in caps.chunks(CAPABILITIES_PER_FRAME_MAX) {
        let body_len = Capability::list_len(chunk.len());
        let at = tx.reserve(HEADER_LEN + body_len);
        let frame = tx.bytes_mut(at);
        Header { kind: FrameKind::Capabilities, desc_count: 0, payload_len: body_len as u32 }
            .emit(&mut frame[..HEADER_LEN]);
        let body = &mut frame[HEADER_LEN..];
        body[..2].copy_from_slice(&(chunk.len() as u16).to_le_bytes());
        body[2..4].fill(0);
        for (c, out) in chunk.iter().zip(body[4..].chunks_exact_mut(wire::CAPABILITY_LEN)) {
            out.copy_from_slice(&c.encode());
        }
        bump(&stats.capabilities_sent, chunk.len() as u64);
    }
    caps.clear();
}

/// Serve a direct read: check the capability in the payload against the export the handle
/// names, then send the bytes from the memory it names (the RAM volume by address, or a copy
/// of the cache slot checked against its generation), never from the backend.
#[allow(clippy::too_many_arguments)]
fn direct_read<S: Sink + ?Sized>(
    out: &mut CompletionWriter,
    tx: &mut S,
    index: u32,
    export: &Export,
    io: &Io,
    payload: &[u8],
    host: &impl Host,
    io_bytes_max: u32,
    stats: &FrontStats,
) -> Status {
    if io.length == 0 || io.length > io_bytes_max {
        return if io.length == 0 { Status::Invalid } else { Status::TooLarge };
    }
    let Some(d) = &export.direct else { return Status::BadCapability };
    let Ok(cap) = Capability::decode(payload) else { return Status::BadCapability };
    if let Err(fault) = d.check(&cap, index, io.offset, io.length, host.clock_ms()) {
        return fault.status();
    }
    match cap.kind {
        wire::CapKind::Region => out.read(tx, export, io, stats).0,
        // Read through the backend (a flash volume's page pool, whose misses the look-ahead
        // has started), so never a stale byte. A volume shrunk under the reference leaves it
        // stale past the new end.
        wire::CapKind::Extent => {
            match crate::validate(export, &Io { opcode: Opcode::Read, ..*io }, io_bytes_max) {
                Ok(()) => out.read(tx, export, io, stats).0,
                Err(Status::OutOfRange) => Status::StaleCapability,
                Err(status) => status,
            }
        }
        wire::CapKind::Slot => {
            match out.read_with(tx, io.length as usize, stats, |dst| d.read_slot(&cap, io.offset, dst)) {
                Ok(()) => Status::Ok,
                Err(fault) => fault.status(),
            }
        }
        // Sealed under a pool's grant key, never under a direct-read secret: the check above
        // has refused it already.
        wire::CapKind::Chunk => Status::BadCapability,
    }
}

/// Serve a direct write: the payload is a capability with the write right (an extent) and
/// the bytes to write. Checked as a direct read's capability is, then against the handle's
/// rights and the volume's current size (a shrink leaves the reference stale past the end),
/// then carried out as a write, its durability (FUA) made as an ordinary write's is.
#[allow(clippy::too_many_arguments)]
fn direct_write(
    index: u32,
    export: &Export,
    io: &Io,
    payload: &[u8],
    read_only: bool,
    later: &mut Later<'_>,
    host: &impl Host,
    io_bytes_max: u32,
) -> Status {
    if io.length == 0 || io.length > io_bytes_max {
        return if io.length == 0 { Status::Invalid } else { Status::TooLarge };
    }
    let Some(d) = &export.direct else { return Status::BadCapability };
    // The payload's length is the descriptor's, checked when the caravan was parsed.
    let (cap, data) = payload.split_at(wire::CAPABILITY_LEN.min(payload.len()));
    let Ok(cap) = Capability::decode(cap) else { return Status::BadCapability };
    if let Err(fault) = d.check_write(&cap, index, io.offset, io.length, host.clock_ms()) {
        return fault.status();
    }
    if read_only {
        return Status::ReadOnly;
    }
    match crate::validate(export, &Io { opcode: Opcode::Write, ..*io }, io_bytes_max) {
        Ok(()) => crate::execute_later(export, io, data, later),
        Err(Status::OutOfRange) => Status::StaleCapability,
        Err(status) => status,
    }
}

/// Deliberately broken variants, compiled only for the simulator's proof that it catches them
/// (feature `mutations`); without the feature every hook is an empty inline function.
#[cfg(feature = "mutations")]
pub mod mutation {
    use super::Host;
    use crate::Io;

    /// A planted bug of the native front end.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum Mutation {
        #[default]
        None,
        /// Acknowledge a write at once and execute it only when the next caravan arrives: a
        /// write acknowledged before it reached the backend, lost if the connection drops.
        AckBeforeBackend,
    }

    #[derive(Debug, Default)]
    pub(super) struct Bug {
        pub mutation: Mutation,
        /// Acknowledged writes not yet executed.
        deferred: Vec<(Io, Vec<u8>)>,
    }

    impl Bug {
        pub fn new() -> Bug {
            Bug::default()
        }

        pub fn before_caravan(&mut self, host: &impl Host) {
            let Some(export) = host.exports().get(0) else { return };
            for (io, data) in self.deferred.drain(..) {
                crate::execute(export, &io, &data, &mut []);
            }
        }

        /// Some(status) when the bug answered the write instead of the backend.
        pub fn write(&mut self, handle: u32, io: &Io, payload: &[u8]) -> Option<wire::Status> {
            if self.mutation != Mutation::AckBeforeBackend || io.opcode != wire::Opcode::Write || handle != 0
            {
                return None;
            }
            self.deferred.push((*io, payload.to_vec()));
            Some(wire::Status::Ok)
        }
    }
}

#[cfg(not(feature = "mutations"))]
mod mutation {
    use super::Host;
    use crate::Io;

    #[derive(Debug)]
    pub(super) struct Bug;

    impl Bug {
        pub fn new() -> Bug {
            Bug
        }

        #[inline(always)]
        pub fn before_caravan(&mut self, _: &impl Host) {}

        #[inline(always)]
        pub fn write(&mut self, _: u32, _: &Io, _: &[u8]) -> Option<wire::Status> {
            None
        }
    }
}

#[cfg(test)]
mod prefix_tests {
    //! The longest ready prefix: a connection answers its requests in order up to the first
    //! whose pages are being read, and the rest once they land.

    use wire::caravan::CompletionCaravan;
    use wire::{Hello, Limits, REQUEST_DESC_LEN};

    use super::*;
    use crate::front::testing::{self, Cold};
    use crate::front::Sealed;

    /// A connection to one export over `Cold`, with its handshake done.
    type Rig = testing::Rig<NativeConn>;

    /// What a pass left: the tags of each completion caravan sent, and how it ended.
    #[derive(Debug, PartialEq)]
    struct Pass {
        caravans: Vec<Vec<u32>>,
        waiting: bool,
        stopped: bool,
        sealed: Sealed,
    }

    const LIMITS: Limits =
        Limits { queue_depth: 64, caravan_reqs_max: 16, caravan_bytes_max: 1 << 20, io_bytes_max: 1 << 16 };

    impl Rig {
        fn new(cold: &[u64]) -> Rig {
            let mut rig = Rig::over(cold, |_| NativeConn::new(LIMITS, 4));
            let hello = Hello { version_min: 1, version_max: 1, features: 0, limits: LIMITS, auth: None };
            rig.rx.extend(&frame(FrameKind::Hello, &hello.encode()));
            rig.rx.extend(&frame(FrameKind::Open, &wire::Open { name: "vol".into() }.encode()));
            assert_eq!(rig.pass(false).caravans, Vec::<Vec<u32>>::new());
            rig
        }

        /// A caravan of 4 KiB requests: (tag, opcode, offset, flags); writes carry the
        /// page's own pattern.
        fn send(&mut self, reqs: &[(u32, Opcode, u64, ReqFlags)]) {
            let writes = reqs.iter().filter(|r| r.1 == Opcode::Write).count();
            let header = Header {
                kind: FrameKind::Requests,
                desc_count: reqs.len() as u16,
                payload_len: (writes * 4096) as u32,
            };
            let mut out = header.to_bytes().to_vec();
            for &(tag, opcode, offset, flags) in reqs {
                let mut desc = [0; REQUEST_DESC_LEN];
                Request { opcode, flags, tag, handle: 0, offset, length: 4096 }.emit(&mut desc);
                out.extend(desc);
            }
            for &(_, opcode, offset, _) in reqs {
                if opcode == Opcode::Write {
                    let mut page = vec![0; 4096];
                    self.cold.ram.read_at(&mut page, offset).unwrap();
                    out.extend(page);
                }
            }
            self.rx.extend(&out);
        }

        /// One processing pass, as the server's driver runs it; every read's data is checked.
        fn pass(&mut self, resumed: bool) -> Pass {
            self.pass_then(resumed, |_| {})
        }

        /// [`pass`](Self::pass), with `between` run after the front end and before the seal.
        fn pass_then(&mut self, resumed: bool, between: impl FnOnce(&Cold)) -> Pass {
            let (waiting, stopped, sealed) = self.run(resumed, between);
            Pass { caravans: self.completions(), waiting, stopped, sealed }
        }

        /// The tags of the completion caravans queued since the last pass.
        fn completions(&mut self) -> Vec<Vec<u32>> {
            let tx = std::mem::take(&mut self.tx);
            let mut at = 0;
            let mut caravans = Vec::new();
            while at < tx.len() {
                let header = Header::parse(&tx[at..at + HEADER_LEN]).unwrap();
                let body = &tx[at + HEADER_LEN..at + header.frame_len()];
                if header.kind == FrameKind::Completions {
                    let caravan = CompletionCaravan::parse(&header, body).unwrap();
                    caravans.push(caravan.iter().map(|(c, _)| c.tag).collect());
                    for (c, data) in caravan.iter() {
                        assert_eq!(c.status, Status::Ok, "tag {}", c.tag);
                        let mut want = vec![0; data.len()];
                        self.cold.ram.read_at(&mut want, u64::from(c.tag) * 4096).unwrap();
                        assert!(data == want, "tag {} carries another page's bytes", c.tag);
                    }
                }
                at += header.frame_len();
            }
            caravans
        }
    }

    /// A read of page `tag`, tagged with its page number.
    fn read(tag: u32) -> (u32, Opcode, u64, ReqFlags) {
        (tag, Opcode::Read, u64::from(tag) * 4096, ReqFlags::empty())
    }

    #[test]
    fn requests_are_answered_up_to_the_first_that_waits_and_the_rest_once_it_lands() {
        let page = |p: u64| p * 4096;
        let mut rig = Rig::new(&[page(2), page(4)]);
        rig.send(&[read(0), read(1), read(2), read(3), read(4)]);
        rig.send(&[read(5)]);

        let first = rig.pass(false);
        assert_eq!(
            first,
            Pass { caravans: vec![vec![0, 1]], waiting: true, stopped: false, sealed: Sealed::Free }
        );
        // Everything at once on the look-ahead's batch, then each request in turn on the
        // connection's, up to the one that waits.
        assert_eq!(rig.cold.prepared(), [0, 1, 2, 3, 4, 5, 0, 1, 2].map(page));
        assert_eq!(rig.cold.going.lock().unwrap().len(), 3, "pages 2 and 4 read at once, page 2 waited for");

        rig.cold.land(page(2));
        assert_eq!(rig.woken(), 1, "the head's read woke the driver");
        let second = rig.pass(true);
        assert_eq!(
            second,
            Pass { caravans: vec![vec![2, 3]], waiting: true, stopped: false, sealed: Sealed::Free }
        );
        // The request that waited runs unprepared, and the look-ahead has seen the rest.
        assert_eq!(rig.cold.prepared(), [page(3), page(4)]);

        rig.cold.land(page(4));
        assert_eq!(rig.woken(), 2);
        let third = rig.pass(true);
        assert_eq!(
            third,
            Pass { caravans: vec![vec![4], vec![5]], waiting: false, stopped: false, sealed: Sealed::Free }
        );
        assert_eq!(rig.cold.prepared(), [], "nothing left going: the rest runs as it comes");
        assert_eq!(rig.rx.pending(), 0);
        assert_eq!(
            rig.stats.caravans_received.load(std::sync::atomic::Ordering::Relaxed),
            2,
            "each caravan counted once"
        );
    }

    #[test]
    fn a_request_that_waits_first_answers_nothing_of_its_caravan() {
        let mut rig = Rig::new(&[0]);
        rig.send(&[read(0), read(1)]);
        let first = rig.pass(false);
        assert_eq!(first, Pass { caravans: vec![], waiting: true, stopped: false, sealed: Sealed::Free });
        rig.cold.land(0);
        assert_eq!(rig.pass(true).caravans, vec![vec![0, 1]]);
    }

    #[test]
    fn after_a_fua_write_a_request_that_waits_joins_the_durability_wait() {
        let mut rig = Rig::new(&[4096]);
        rig.send(&[(0, Opcode::Write, 0, ReqFlags::FUA), read(1), read(2)]);
        let first = rig.pass(false);
        // The write is answered (its reply held for its durability); the read of page 1 waits
        // on the same batch, so nothing after it runs yet.
        assert_eq!(
            first,
            Pass { caravans: vec![vec![0]], waiting: false, stopped: true, sealed: Sealed::Wait }
        );
        rig.cold.land(4096);
        assert_eq!(rig.woken(), 0, "the sync is still going");
        rig.cold.synced();
        assert_eq!(rig.woken(), 1);
        // Woken for the replies: the read is prepared again, finds its page, and runs.
        assert_eq!(rig.pass(false).caravans, vec![vec![1, 2]]);

        // Both done before the seal: no wake comes, and the driver comes back by itself.
        rig.send(&[(3, Opcode::Write, 0, ReqFlags::FUA), read(1)]);
        rig.cold.cold.lock().unwrap().insert(4096);
        let pass = rig.pass_then(false, |cold| {
            cold.land(4096);
            cold.synced();
        });
        assert_eq!(
            pass,
            Pass { caravans: vec![vec![3]], waiting: false, stopped: true, sealed: Sealed::Free }
        );
        assert_eq!(rig.pass(false).caravans, vec![vec![1]]);
    }
}
