//! The NBD front end on one connection: the `nbd` crate's state machines driven over the
//! same workers, exports and engine as the native protocol.
//!
//! Negotiation runs through [`nbd::Handshake`]; transmission parses request headers in place,
//! checks them against the negotiated session ([`nbd::check_request`]) and the export (the
//! engine's [`crate::validate`]), executes them, and appends replies to the connection's
//! response buffer, which the worker sends at the end of its loop pass: many replies, one send.
//! Read data of RAM exports is sent from the volume's memory by address, and other backends
//! read it straight into that buffer. A refused WRITE's payload is
//! skipped as it streams in, never buffered, so the stream stays in step. Broken framing (a
//! bad request magic) closes this connection only.
//!
//! Replies: READ gets a single OFFSET_DATA chunk when structured replies are negotiated (so
//! `DF` always holds) and a simple reply otherwise; BLOCK_STATUS gets one BLOCK_STATUS chunk;
//! everything else gets a 16-byte simple reply, which the spec allows in both modes.

use std::sync::Arc;

use backend::Batch;

use crate::{Export, ExportTable, Io, Lease};
use nbd::handshake::BASE_ALLOCATION_ID;
use nbd::transmission::{
    chunk_block_status, chunk_offset_data_header, error_reply, simple_reply, EINVAL, EPERM, STATE_HOLE,
    STATE_ZERO,
};
use nbd::{Cmd, CmdFlags, Handshake, Request, Session, Step};
use wire::{Opcode, ReqFlags, Status};

use super::{Host, Laps, Link, Sink};

/// The NBD description of the target's exports as `principal` may use them: built for
/// anonymous clients (`None`) at start-up and again whenever the table changes (the driver
/// publishes it for the connections that arrive next), and per connection for a TLS client
/// whose verified certificate names a principal. An export the principal has no rights to is
/// hidden; a read-only grant is a read-only export. The first export is also served for the
/// empty name. Positions in it are not table indexes: a connection finds its export by name
/// when transmission begins.
pub fn handshake_config(
    shared_exports: &ExportTable,
    io_bytes_max: u32,
    principal: Option<&str>,
) -> Result<nbd::HandshakeConfig, nbd::NbdError> {
    let descs = shared_exports
        .iter()
        .map(|e| {
            let b = &e.backend;
            let caps = b.capabilities();
            // NBD has no key exchange of its own: a client is anonymous unless a verified TLS
            // client certificate names it.
            let granted = e.grant(principal);
            let writable = granted == Ok(false);
            let mut d = nbd::ExportDesc::new(e.name.clone(), b.size_bytes());
            d.description = format!("skiff {} export", b.kind());
            d.block_min = e.block_size();
            d.block_preferred = 4096.max(e.block_size());
            d.block_max = io_bytes_max;
            d.read_only = !writable;
            // A pool's chunks need grants, which NBD cannot present: an export with a layer
            // that judges requests by what a native connection holds is not NBD's.
            d.hidden = granted.is_err() || e.judges_requests();
            d.can_flush = caps.flush;
            d.can_fua = writable && caps.fua;
            d.can_trim = writable && caps.trim;
            d.can_write_zeroes = writable && caps.write_zeroes;
            d.can_fast_zero = writable && caps.write_zeroes && caps.fast_zero;
            d.can_cache = true;
            // Every connection reaches the same backend object, and flush syncs the whole
            // file (or is moot for RAM), so a flush on one connection covers writes completed
            // on any other: exactly what CAN_MULTI_CONN promises.
            d.can_multi_conn = true;
            d
        })
        .collect::<Vec<_>>();
    // A target serving flash volumes alone may have no export at all for a while.
    let default_export = (!descs.is_empty()).then_some(0);
    nbd::HandshakeConfig::new(descs, default_export)
}

/// How far ahead of the bytes received the receive buffer grows while a large WRITE's payload
/// arrives.
const RX_STEP_BYTES: usize = 1 << 20;

enum State {
    Negotiating(Handshake),
    /// Serving export `export` (a table index), held by `_lease` until the connection closes.
    Transmitting {
        session: Session,
        export: u32,
        _lease: Lease,
    },
}

pub struct NbdConn {
    state: State,
    /// What the handshake offers (the positions its sessions name).
    config: Arc<nbd::HandshakeConfig>,
    /// Payload bytes of a refused WRITE still to skip.
    drain_bytes: u64,
    /// Reused for replies built by the codec before they join the response buffer.
    scratch: Vec<u8>,
    /// Most extents one BLOCK_STATUS reply describes; the client asks again for the rest.
    extents_per_reply_max: usize,
    /// STARTTLS was acknowledged and the driver has not taken the news yet.
    starttls: bool,
}

impl NbdConn {
    /// A new connection; the greeting is queued on `link`'s response buffer by the caller.
    /// A new connection answering at most `extents_per_reply_max` extents per BLOCK_STATUS;
    /// the greeting is queued in `greeting` for the caller to send.
    pub fn new(
        config: Arc<nbd::HandshakeConfig>,
        extents_per_reply_max: usize,
        greeting: &mut Vec<u8>,
    ) -> NbdConn {
        let hs = Handshake::new(config.clone());
        hs.greeting(greeting);
        NbdConn {
            state: State::Negotiating(hs),
            config,
            drain_bytes: 0,
            scratch: Vec::with_capacity(64),
            extents_per_reply_max: extents_per_reply_max.max(1),
            starttls: false,
        }
    }

    /// Whether STARTTLS was just acknowledged (once): the driver sends the queued reply in
    /// plaintext, then runs the TLS handshake before it reads another byte.
    pub fn take_starttls(&mut self) -> bool {
        std::mem::take(&mut self.starttls)
    }

    /// Offer the exports of `config` from now on, as seen by the identity a TLS handshake
    /// proved; ignored once transmission began.
    pub fn set_config(&mut self, config: Arc<nbd::HandshakeConfig>) {
        if let State::Negotiating(hs) = &mut self.state {
            hs.set_config(config.clone());
            self.config = config;
        }
    }

    /// Whether the handshake is done (the client chose an export and transmission began).
    pub fn is_established(&self) -> bool {
        matches!(self.state, State::Transmitting { .. })
    }

    /// Handle everything complete in the receive buffer.
    pub fn process<S: Sink + ?Sized>(&mut self, link: &mut Link<'_, S>, host: &impl Host) {
        if let State::Transmitting { session, export, .. } = &self.state {
            let export = host.exports().get(*export);
            let may_wait = export.is_some_and(|e| e.backend.may_wait());
            if let Some(export) = export {
                let io_bytes_max = host.io_bytes_max();
                // The rest of a refused WRITE's payload, being skipped, comes first.
                let draining = usize::try_from(self.drain_bytes).unwrap_or(usize::MAX);
                if link.look_ahead(may_wait, |rx, batch| {
                    let requests = rx.get(draining..).unwrap_or_default();
                    look_ahead(requests, session, export, io_bytes_max, batch)
                }) {
                    return;
                }
            }
        }
        let mut laps = Laps::start(host);
        while !*link.closing && !link.backlogged() {
            let progressed = match &mut self.state {
                State::Negotiating(_) => self.negotiate(link, host),
                State::Transmitting { .. } => self.transmit(link, host, &mut laps),
            };
            if !progressed {
                return;
            }
        }
    }

    /// One handshake step. Returns whether anything was consumed.
    fn negotiate<S: Sink + ?Sized>(&mut self, link: &mut Link<'_, S>, host: &impl Host) -> bool {
        let State::Negotiating(hs) = &mut self.state else { return false };
        self.scratch.clear();
        let step = hs.handle(link.rx.unconsumed(), &mut self.scratch);
        // Replies produced before an error are whole messages: send them either way.
        link.tx.append(&self.scratch);
        match step {
            Ok(Step::NeedMore { consumed }) => {
                link.rx.consume(consumed);
                consumed > 0
            }
            Ok(Step::Done { consumed, session }) => {
                link.rx.consume(consumed);
                match self.attach(host, &session) {
                    Some((export, lease)) => {
                        self.state = State::Transmitting { session, export, _lease: lease };
                        true
                    }
                    None => {
                        // Deleted between the handshake's offer and the client's choice: NBD
                        // has no way to take a GO back, so the connection ends here.
                        link.protocol_error("NBD export deleted during the handshake");
                        false
                    }
                }
            }
            Ok(Step::Close { consumed }) => {
                link.rx.consume(consumed);
                *link.closing = true;
                false
            }
            Ok(Step::StartTls { consumed }) => {
                // Nothing follows STARTTLS in plaintext (the handshake checked): stop here
                // until the driver has switched the stream to TLS.
                link.rx.consume(consumed);
                self.starttls = true;
                false
            }
            Err(e) => {
                link.protocol_error(&format!("NBD handshake: {e}"));
                false
            }
        }
    }

    /// The table index of the export the handshake chose, and a lease on it; `None` when it
    /// is gone or going.
    fn attach(&self, host: &impl Host, session: &Session) -> Option<(u32, Lease)> {
        let name = &self.config.exports().get(session.export_index)?.name;
        let (index, _) = host.exports().find(name)?;
        Some((index, host.exports().lease(index).ok()?))
    }

    /// One request (or a piece of a refused write's payload). Returns whether it progressed.
    fn transmit<S: Sink + ?Sized>(
        &mut self,
        link: &mut Link<'_, S>,
        host: &impl Host,
        laps: &mut Laps,
    ) -> bool {
        if self.drain_bytes > 0 {
            let n = self.drain_bytes.min(link.rx.pending() as u64);
            link.rx.consume(n as usize);
            self.drain_bytes -= n;
            return n > 0;
        }
        let State::Transmitting { session, export, .. } = &self.state else { return false };
        let (session, index) = (*session, *export);
        let (req, header_len) = match nbd::parse_request(link.rx.unconsumed()) {
            Ok(Some(found)) => found,
            Ok(None) => return false,
            Err(e) => {
                link.protocol_error(&format!("NBD request: {e}"));
                return false;
            }
        };
        let Some(export) = host.exports().get(index) else {
            link.protocol_error("NBD export vanished");
            return false;
        };
        let verdict = nbd::check_request(&req, &session)
            .map_err(Refusal::Errno)
            .and_then(|()| validate(export, &req, &session, host.io_bytes_max()));
        if req.cmd == Cmd::Write {
            let payload = req.length as usize;
            if let Err(refusal) = verdict {
                // Answer now and skip the payload as it arrives.
                link.rx.consume(header_len);
                self.drain_bytes = payload as u64;
                let status = self.refuse(link, &session, &req, refusal);
                count(link, index, &req, status, laps.lap(host));
                return true;
            }
            if link.rx.pending() < header_len + payload {
                // Room for what comes next, not for all the payload declared: a client that
                // sends a 32 MiB header and stops holds no more than it sent.
                link.rx.reserve((link.rx.pending() + RX_STEP_BYTES).min(header_len + payload));
                return false;
            }
        }
        link.rx.consume(header_len);
        let status = match verdict {
            Err(refusal) => self.refuse(link, &session, &req, refusal),
            Ok(()) => self.execute(link, &session, export, &req),
        };
        count(link, index, &req, status, laps.lap(host));
        true
    }

    /// Execute a request and queue its reply; returns the status to count, if it is counted
    /// ([`count`]).
    fn execute<S: Sink + ?Sized>(
        &mut self,
        link: &mut Link<'_, S>,
        session: &Session,
        export: &Export,
        req: &Request,
    ) -> Option<Status> {
        match req.cmd {
            Cmd::Read => Some(self.read(link, session, export, req)),
            Cmd::Write => {
                let len = req.length as usize;
                let status = {
                    let payload = &link.rx.unconsumed()[..len];
                    crate::execute_later(export, &io_of(req, Opcode::Write), payload, &mut link.later)
                };
                link.rx.consume(len);
                self.finish(link, session, req, status);
                Some(status)
            }
            Cmd::Flush => Some(self.simple(link, session, export, req, Opcode::Flush)),
            Cmd::Trim => Some(self.simple(link, session, export, req, Opcode::Trim)),
            Cmd::WriteZeroes => Some(self.simple(link, session, export, req, Opcode::WriteZeroes)),
            // Data is already as close as it gets (RAM, or the page cache for files).
            Cmd::Cache => {
                self.reply_status(link, session, req, 0);
                None
            }
            Cmd::BlockStatus => {
                self.block_status(link, session, export, req);
                None
            }
            Cmd::Disc => {
                tracing::debug!(peer = %link.peer, "NBD client disconnected");
                *link.closing = true;
                None
            }
            Cmd::Unknown(_) => {
                self.reply_status(link, session, req, EINVAL);
                Some(Status::UnknownOpcode)
            }
        }
    }

    fn read<S: Sink + ?Sized>(
        &mut self,
        link: &mut Link<'_, S>,
        session: &Session,
        export: &Export,
        req: &Request,
    ) -> Status {
        let start = link.tx.len();
        self.scratch.clear();
        if session.structured_replies {
            chunk_offset_data_header(&mut self.scratch, req.cookie, true, req.offset, req.length);
        } else {
            simple_reply(&mut self.scratch, req.cookie, 0);
        }
        link.tx.append(&self.scratch);
        let status = link.tx.append_read(export, &io_of(req, Opcode::Read));
        if !status.is_ok() {
            // Take the header and the unread data back; answer with the error instead.
            link.tx.truncate(start);
            let errno = nbd::error_of(status, req.cmd, req.flags);
            self.reply_error(link, session, req, errno, &status.to_string());
        }
        status
    }

    /// Commands whose whole answer is a status.
    fn simple<S: Sink + ?Sized>(
        &mut self,
        link: &mut Link<'_, S>,
        session: &Session,
        export: &Export,
        req: &Request,
        op: Opcode,
    ) -> Status {
        let status = crate::execute_later(export, &io_of(req, op), &[], &mut link.later);
        self.finish(link, session, req, status);
        status
    }

    fn finish<S: Sink + ?Sized>(
        &mut self,
        link: &mut Link<'_, S>,
        session: &Session,
        req: &Request,
        status: Status,
    ) {
        let errno = if status.is_ok() { 0 } else { nbd::error_of(status, req.cmd, req.flags) };
        self.reply_status(link, session, req, errno);
    }

    fn block_status<S: Sink + ?Sized>(
        &mut self,
        link: &mut Link<'_, S>,
        session: &Session,
        export: &Export,
        req: &Request,
    ) {
        let mut extents = Vec::new();
        if let Err(e) = export.backend.extents(req.offset, req.length.into(), &mut extents) {
            let status = crate::status_of(&e);
            return self.reply_error(
                link,
                session,
                req,
                nbd::error_of(status, req.cmd, req.flags),
                &e.to_string(),
            );
        }
        let most = if req.flags.contains(CmdFlags::REQ_ONE) { 1 } else { self.extents_per_reply_max };
        let pairs: Vec<(u32, u32)> = extents
            .iter()
            .take(most)
            .map(|e| {
                let flags = if e.hole { STATE_HOLE } else { 0 } | if e.zero { STATE_ZERO } else { 0 };
                // The request length is a u32, so every extent within it fits one.
                (e.len_bytes as u32, flags)
            })
            .collect();
        let id = session.base_allocation_id.unwrap_or(BASE_ALLOCATION_ID);
        self.scratch.clear();
        chunk_block_status(&mut self.scratch, req.cookie, true, id, &pairs);
        link.tx.append(&self.scratch);
    }

    fn refuse<S: Sink + ?Sized>(
        &mut self,
        link: &mut Link<'_, S>,
        session: &Session,
        req: &Request,
        refusal: Refusal,
    ) -> Option<Status> {
        let (errno, status) = match refusal {
            Refusal::Errno(e) => (e, status_of_errno(req, e)),
            Refusal::Status(s) => (nbd::error_of(s, req.cmd, req.flags), s),
        };
        if req.cmd == Cmd::Disc {
            *link.closing = true;
            return None;
        }
        self.reply_error(link, session, req, errno, "request refused");
        Some(status)
    }

    /// A status reply: simple for everything but READ and BLOCK_STATUS in structured mode.
    fn reply_status<S: Sink + ?Sized>(
        &mut self,
        link: &mut Link<'_, S>,
        session: &Session,
        req: &Request,
        errno: u32,
    ) {
        if errno != 0 {
            return self.reply_error(link, session, req, errno, "request failed");
        }
        self.scratch.clear();
        simple_reply(&mut self.scratch, req.cookie, 0);
        link.tx.append(&self.scratch);
    }

    fn reply_error<S: Sink + ?Sized>(
        &mut self,
        link: &mut Link<'_, S>,
        session: &Session,
        req: &Request,
        errno: u32,
        message: &str,
    ) {
        self.scratch.clear();
        if matches!(req.cmd, Cmd::Read | Cmd::BlockStatus) {
            error_reply(&mut self.scratch, session, req.cookie, errno, message);
        } else {
            simple_reply(&mut self.scratch, req.cookie, errno);
        }
        link.tx.append(&self.scratch);
    }
}

/// Why a request is refused before execution.
enum Refusal {
    /// The session did not negotiate what it asks for.
    Errno(u32),
    /// The export refuses it (range, alignment, size, permission).
    Status(Status),
}

/// Count an answered request on export `index`: under its opcode when it has one in the
/// native protocol, and otherwise (CACHE, BLOCK_STATUS, unknown commands) only if it failed,
/// as a request refused before its opcode was known.
fn count<S: Sink + ?Sized>(
    link: &Link<'_, S>,
    index: u32,
    req: &Request,
    status: Option<Status>,
    service_ns: Option<u64>,
) {
    let Some(status) = status else { return };
    match opcode_of(req.cmd) {
        Some(op) => link.stats.ops.record(Some(index), op, req.length, status, service_ns),
        None if !status.is_ok() => link.stats.ops.record_refused(status),
        None => {}
    }
}

fn opcode_of(cmd: Cmd) -> Option<Opcode> {
    Some(match cmd {
        Cmd::Read => Opcode::Read,
        Cmd::Write => Opcode::Write,
        Cmd::Flush => Opcode::Flush,
        Cmd::Trim => Opcode::Trim,
        Cmd::WriteZeroes => Opcode::WriteZeroes,
        Cmd::Cache | Cmd::BlockStatus | Cmd::Disc | Cmd::Unknown(_) => return None,
    })
}

/// The status a request refused by the session's own checks counts as.
fn status_of_errno(req: &Request, errno: u32) -> Status {
    match (req.cmd, errno) {
        (Cmd::Unknown(_), _) => Status::UnknownOpcode,
        (_, EPERM) => Status::ReadOnly,
        _ => Status::Invalid,
    }
}

fn io_of(req: &Request, opcode: Opcode) -> Io {
    let flags = if req.flags.contains(CmdFlags::FUA) { ReqFlags::FUA } else { ReqFlags::empty() };
    let (offset, length) = if opcode == Opcode::Flush { (0, 0) } else { (req.offset, req.length) };
    Io { opcode, flags, offset, length }
}

/// Let the export's backend start what the READs and WRITEs among the complete requests at
/// the start of `rx` would wait for, on `batch` ([`Gate::batch`](super::Gate::batch)). Nothing is consumed or
/// answered here; the first request that does not parse ends the look.
fn look_ahead(rx: &[u8], session: &Session, export: &Export, io_bytes_max: u32, batch: &Arc<Batch>) {
    let mut at = 0;
    while let Ok(Some((req, header_len))) = nbd::parse_request(&rx[at..]) {
        let payload = if req.cmd == Cmd::Write { req.length as usize } else { 0 };
        if rx.len() - at < header_len + payload {
            break;
        }
        at += header_len + payload;
        if !matches!(req.cmd, Cmd::Read | Cmd::Write) {
            continue;
        }
        let fine = nbd::check_request(&req, session).is_ok()
            && validate(export, &req, session, io_bytes_max).is_ok();
        if fine {
            export.backend.prepare(req.offset, req.length.into(), req.cmd == Cmd::Write, batch);
        }
    }
}

/// The export's checks for commands the engine executes; range checks for the others. A
/// client that agreed to block sizes is held to the export's block and the target's largest
/// I/O; one that did not gets the spec's defaults: any byte alignment (every backend takes
/// it, a file through a read-modify-write of its partial blocks) and payloads up to
/// [`nbd::DEFAULT_PAYLOAD_MAX`], or the target's largest I/O if that is more.
fn validate(export: &Export, req: &Request, session: &Session, io_bytes_max: u32) -> Result<(), Refusal> {
    let opcode = match req.cmd {
        Cmd::Read => Opcode::Read,
        Cmd::Write => Opcode::Write,
        Cmd::Flush => Opcode::Flush,
        Cmd::Trim => Opcode::Trim,
        Cmd::WriteZeroes => Opcode::WriteZeroes,
        Cmd::Cache | Cmd::BlockStatus => {
            let end = req.offset.checked_add(req.length.into());
            let in_range = req.length > 0 && end.is_some_and(|end| end <= export.backend.size_bytes());
            return if in_range { Ok(()) } else { Err(Refusal::Status(Status::OutOfRange)) };
        }
        Cmd::Disc | Cmd::Unknown(_) => return Ok(()),
    };
    let (block_bytes, io_bytes_max) = if session.sizes_agreed {
        (export.block_size(), io_bytes_max)
    } else {
        (1, io_bytes_max.max(nbd::DEFAULT_PAYLOAD_MAX))
    };
    crate::validate_sized(export, &io_of(req, opcode), io_bytes_max, block_bytes).map_err(Refusal::Status)?;
    if req.flags.contains(CmdFlags::FAST_ZERO) && !export.backend.capabilities().fast_zero {
        return Err(Refusal::Status(Status::Unsupported));
    }
    Ok(())
}

#[cfg(test)]
mod look_ahead_tests {
    //! Requests that wait for a device over NBD: everything received is prepared at once, and
    //! nothing runs until all of it has landed.

    use super::*;
    use crate::front::testing::{self, Cold};
    use crate::front::Sealed;

    /// A connection to one export over `Cold`, with its handshake done (fixed newstyle, no
    /// zeroes, EXPORT_NAME: simple replies).
    type Rig = testing::Rig<NbdConn>;

    /// What a pass left: the cookies of the replies sent, and how it ended.
    #[derive(Debug, PartialEq)]
    struct Pass {
        replies: Vec<u64>,
        waiting: bool,
        stopped: bool,
        sealed: Sealed,
    }

    /// A write's cookie has this bit set; the rest of a cookie is the page number.
    const WRITE: u64 = 1 << 32;

    impl Rig {
        fn new(cold: &[u64]) -> Rig {
            let mut rig = Rig::over(cold, |host| {
                let config = Arc::new(handshake_config(host.exports(), host.io_bytes_max(), None).unwrap());
                NbdConn::new(config, 16, &mut Vec::new())
            });
            let mut hello = (nbd::FLAG_C_FIXED_NEWSTYLE | nbd::FLAG_C_NO_ZEROES).to_be_bytes().to_vec();
            hello.extend(nbd::IHAVEOPT.to_be_bytes());
            hello.extend(nbd::handshake::opt::EXPORT_NAME.to_be_bytes());
            hello.extend(3u32.to_be_bytes());
            hello.extend(b"vol");
            rig.rx.extend(&hello);
            rig.run(false, |_| {});
            assert!(rig.conn.is_established());
            rig.tx.clear();
            rig
        }

        /// 4 KiB requests: (page, command, FUA); a write carries the page's own pattern.
        fn send(&mut self, reqs: &[(u64, Cmd, bool)]) {
            let mut out = Vec::new();
            for &(page, cmd, fua) in reqs {
                let flags = if fua { CmdFlags::FUA } else { CmdFlags::empty() };
                let cookie = if cmd == Cmd::Write { page | WRITE } else { page };
                Request { flags, cmd, cookie, offset: page * 4096, length: 4096 }.emit(&mut out);
                if cmd == Cmd::Write {
                    let mut data = vec![0; 4096];
                    self.cold.ram.read_at(&mut data, page * 4096).unwrap();
                    out.extend(data);
                }
            }
            self.rx.extend(&out);
        }

        fn pass(&mut self, resumed: bool) -> Pass {
            self.pass_then(resumed, |_| {})
        }

        /// One processing pass, as the server's driver runs it, with `between` run after the
        /// front end and before the seal; every read's data is checked.
        fn pass_then(&mut self, resumed: bool, between: impl FnOnce(&Cold)) -> Pass {
            let (waiting, stopped, sealed) = self.run(resumed, between);
            Pass { replies: self.replies(), waiting, stopped, sealed }
        }

        /// The cookies of the simple replies queued since the last pass.
        fn replies(&mut self) -> Vec<u64> {
            let tx = std::mem::take(&mut self.tx);
            let (mut at, mut cookies) = (0, Vec::new());
            while at < tx.len() {
                let field = |from: usize, len: usize| {
                    u64::from_be_bytes({
                        let mut b = [0; 8];
                        b[8 - len..].copy_from_slice(&tx[at + from..at + from + len]);
                        b
                    })
                };
                assert_eq!(field(0, 4), u64::from(nbd::SIMPLE_REPLY_MAGIC));
                let (error, cookie) = (field(4, 4), field(8, 8));
                assert_eq!(error, 0, "cookie {cookie:#x}");
                at += 16;
                if cookie & WRITE == 0 {
                    let mut want = vec![0; 4096];
                    self.cold.ram.read_at(&mut want, cookie * 4096).unwrap();
                    assert!(tx[at..at + 4096] == want[..], "page {cookie} carries other bytes");
                    at += 4096;
                }
                cookies.push(cookie);
            }
            cookies
        }
    }

    fn read(page: u64) -> (u64, Cmd, bool) {
        (page, Cmd::Read, false)
    }

    #[test]
    fn every_request_received_waits_for_all_the_pages_it_reads() {
        let page = |p: u64| p * 4096;
        let mut rig = Rig::new(&[page(2), page(4)]);
        rig.send(&[read(0), read(1), read(2), read(3), read(4), read(5)]);
        assert_eq!(
            rig.pass(false),
            Pass { replies: vec![], waiting: true, stopped: false, sealed: Sealed::Free }
        );
        assert_eq!(rig.cold.prepared(), [0, 1, 2, 3, 4, 5].map(page), "all at once, each once");
        rig.cold.land(page(2));
        assert_eq!(rig.woken(), 0, "page 4 is still being read");
        rig.cold.land(page(4));
        assert_eq!(rig.woken(), 1);
        let after = rig.pass(true);
        assert_eq!(
            after,
            Pass { replies: vec![0, 1, 2, 3, 4, 5], waiting: false, stopped: false, sealed: Sealed::Free }
        );
        assert_eq!(rig.cold.prepared(), [], "woken: they run without being prepared again");
    }

    #[test]
    fn a_fua_write_answered_after_the_wake_holds_its_reply_for_durability() {
        let mut rig = Rig::new(&[4096]);
        rig.send(&[(0, Cmd::Write, true), read(1), read(2)]);
        assert_eq!(
            rig.pass(false),
            Pass { replies: vec![], waiting: true, stopped: false, sealed: Sealed::Free }
        );
        rig.cold.land(4096);
        assert_eq!(rig.woken(), 1);
        // The replies are queued, and the driver holds them until the write is durable.
        let after = rig.pass(true);
        assert_eq!(
            after,
            Pass { replies: vec![WRITE, 1, 2], waiting: false, stopped: false, sealed: Sealed::Wait }
        );
        rig.cold.synced();
        assert_eq!(rig.woken(), 2);
    }

    #[test]
    fn requests_behind_a_refused_write_being_skipped_are_looked_at() {
        // A write past the end is refused and its payload skipped as it streams in; the
        // requests after it are prepared before they run, with the skip half done.
        let mut rig = Rig::new(&[4096]);
        let mut out = Vec::new();
        Request {
            flags: CmdFlags::empty(),
            cmd: Cmd::Write,
            cookie: 99 | WRITE,
            offset: 1 << 20,
            length: 4096,
        }
        .emit(&mut out);
        rig.rx.extend(&out);
        rig.rx.extend(&[0; 1000]);
        let (waiting, ..) = rig.run(false, |_| {});
        assert!(!waiting);
        assert_eq!(rig.tx.len(), 16, "the refusal, a simple reply");
        rig.tx.clear();
        rig.rx.extend(&[0; 3096]);
        rig.send(&[read(1), read(0)]);
        assert!(rig.pass(false).waiting, "the read of the cold page 1 was not looked at");
        rig.cold.land(4096);
        assert_eq!(rig.pass(true).replies, vec![1, 0]);
    }
}
