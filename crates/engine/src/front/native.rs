//! The native skiff protocol on one connection: handshake and control frames through
//! [`ServerSession`], caravans executed in place.
//!
//! Every frame is judged from its header alone (state, direction, negotiated limits) before its
//! body is waited for. Write payloads are used where they lie in the receive buffer; read data
//! goes to the sink (which may send RAM data straight from the volume's memory). The
//! completions of one request caravan form one response caravan, split only if its read data
//! would exceed the negotiated caravan bytes. A protocol violation queues a GOAWAY with the
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
    Capability, Completion, FrameKind, GoAway, Header, Opcode, ReqFlags, Status, COMPLETION_DESC_LEN,
    HEADER_LEN,
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
    /// An export this connection opened may park requests (`Link::batch`).
    may_wait: bool,
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
            may_wait: false,
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

    /// Handle every frame that has arrived whole.
    pub fn process<S: Sink + ?Sized>(&mut self, link: &mut Link<'_, S>, host: &impl Host) {
        if link.look_ahead(self.may_wait, |rx, batch| look_ahead(rx, &self.session, host, batch)) {
            return;
        }
        let leases = self.leases.len();
        process(&mut self.session, link, host, &mut self.caps, &mut self.leases, &mut self.bug);
        if self.leases.len() != leases && !self.may_wait {
            // An export opened just now may be one whose reads can wait.
            self.may_wait = (0..host.exports().len() as u32).any(|i| {
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
) {
    while !*link.closing && !link.backlogged() {
        let f = match link.rx.next_frame(|h| session.admit(h)) {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => return goaway(link, &e),
        };
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
                bug.before_caravan(host);
                execute_caravan(&caravan, session, link.tx, &mut link.later, host, link.stats, caps, bug);
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

/// Let the backends start what the READs and WRITEs of every complete caravan in `rx` would
/// wait for, on `batch` ([`Link::batch`]). Nothing is consumed or answered here; a frame that
/// does not parse, or a request that would be refused, is left for `process` to answer.
fn look_ahead(rx: &[u8], session: &ServerSession, host: &impl Host, batch: &Arc<Batch>) {
    let io_bytes_max = session.limits().io_bytes_max;
    let mut at = 0;
    while let Ok(Some(header)) = wire::framing::peek_header(&rx[at..]) {
        let len = header.frame_len();
        if rx.len() - at < len {
            break;
        }
        if header.kind == FrameKind::Requests {
            let body = &rx[at + HEADER_LEN..at + len];
            let Ok(caravan) = RequestCaravan::parse(&header, body) else { break };
            for req in caravan.iter().filter_map(|(parsed, _)| parsed.ok()) {
                // A direct read is prepared like a read: its reference is checked when it
                // executes, and a wrong one has cost no more than the read it names.
                let write = match req.opcode {
                    Opcode::Read | Opcode::DirectRead => false,
                    Opcode::Write | Opcode::DirectWrite if !session.is_read_only(req.handle) => true,
                    _ => continue,
                };
                let io = Io { opcode: if write { Opcode::Write } else { Opcode::Read }, ..Io::from(&req) };
                let Some(export) = session.resolve(req.handle).and_then(|i| host.exports().get(i)) else {
                    continue;
                };
                // A pool's request is prepared only under a grant the connection holds now
                // (one presented in this same read is bound later: its request just waits
                // for its pages when it runs). Judged as a read: a write's own check marks
                // the regions it touches, which only its execution may do.
                let judged = || {
                    let read = Io { opcode: Opcode::Read, ..io };
                    export.judge(&read, Held { session, handle: req.handle }).is_ok()
                };
                if crate::validate(export, &io, io_bytes_max).is_ok()
                    && (!export.judges_requests() || judged())
                {
                    export.backend.prepare(io.offset, io.length.into(), write, batch);
                }
            }
        }
        at += len;
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

#[allow(clippy::too_many_arguments)]
fn execute_caravan<S: Sink + ?Sized>(
    caravan: &RequestCaravan<'_>,
    session: &ServerSession,
    tx: &mut S,
    later: &mut Later<'_>,
    host: &impl Host,
    stats: &FrontStats,
    caps: &mut Vec<Capability>,
    bug: &mut mutation::Bug,
) {
    stats.record_caravan(caravan.len());
    if caravan.is_empty() {
        // Well-formed, and carries nothing: nothing to answer.
        return;
    }
    let limits = session.limits();
    let mut out = CompletionWriter::begin(tx, caravan.len(), limits.caravan_bytes_max as usize);
    let mut laps = Laps::start(host);
    for (parsed, payload) in caravan.iter() {
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
