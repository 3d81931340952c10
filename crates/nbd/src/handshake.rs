//! The server side of NBD's fixed-newstyle handshake ("option haggling").
//!
//! [`Handshake`] is fed everything the client has sent and not yet consumed, and appends
//! option replies to the caller's buffer. It consumes whole client messages only (oversized
//! option data excepted, which it skips as it streams past), so the driver keeps the rest and
//! calls again when more arrives; however the bytes are split, the replies and the outcome
//! are the same. It ends in one of three ways:
//!
//! - [`Step::Done`]: GO or EXPORT_NAME succeeded; the [`Session`] says what was agreed and
//!   the transmission phase starts right after the consumed bytes.
//! - [`Step::Close`]: the client sent ABORT; flush the acknowledgement, then close.
//! - an [`NbdError`]: a hard disconnect, because the client broke a MUST (unknown client
//!   flags, bad magic), asked for something EXPORT_NAME cannot refuse politely (an unknown
//!   export), or overran a bound.
//!
//! Judgment calls, each within what the spec allows:
//!
//! - An option longer than [`OPTION_LEN_MAX`] is answered `NBD_REP_ERR_TOO_BIG` and its data
//!   skipped as it arrives, never buffered: the spec wants a server to error options rather
//!   than hang up. Past [`OPTION_DISCARD_BYTES_MAX`] skipped bytes in one handshake the client
//!   counts as a denial of service and is disconnected. EXPORT_NAME cannot be answered with an
//!   error, so one longer than any name disconnects at once.
//! - ABORT is acknowledged as soon as its header arrives; any data it carries is ignored.
//! - A client that leaves out `NBD_FLAG_C_FIXED_NEWSTYLE` is still answered in fixed newstyle
//!   (the spec allows it; such clients only ever send EXPORT_NAME).
//! - A second STRUCTURED_REPLY is refused with `NBD_REP_ERR_INVALID`, as the spec permits for
//!   repeated state-changing options. Since SET_META_CONTEXT needs structured replies first,
//!   this also covers STRUCTURED_REPLY after a context was set.
//! - LIST_META_CONTEXT, like SET_META_CONTEXT, requires structured replies first
//!   (`NBD_REP_ERR_INVALID` otherwise; the spec says MAY for LIST, SHOULD for SET).
//! - Queries are matched byte-exactly: `base:allocation` selects it, `base:` lists it (and is
//!   ignored by SET, as the spec requires), anything else is silently not selected.
//! - `NBD_INFO_BLOCK_SIZE` is sent when asked for, and also unasked when the export's
//!   constraints differ from the spec's defaults (the spec's SHOULD). GO without it is not
//!   refused: skiff's engine rejects misaligned requests cleanly, which the spec accepts.
//! - `NBD_INFO_DESCRIPTION` is sent when asked for and the description is not empty.

use std::sync::Arc;

use crate::bytes::Reader;
use crate::export::{ExportDesc, HandshakeConfig, TlsPolicy};
use crate::{
    NbdError, FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES, FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT,
    NBDMAGIC, OPTIONS_MAX, OPTION_DISCARD_BYTES_MAX, OPTION_HEADER_LEN, OPTION_LEN_MAX, OPTION_REPLY_MAGIC,
    STRING_MAX,
};

/// Option codes a client sends.
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
}

/// Option reply types. Errors have bit 31 set.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const META_CONTEXT: u32 = 4;
    pub const ERR_UNSUP: u32 = (1 << 31) + 1;
    pub const ERR_POLICY: u32 = (1 << 31) + 2;
    pub const ERR_INVALID: u32 = (1 << 31) + 3;
    pub const ERR_PLATFORM: u32 = (1 << 31) + 4;
    pub const ERR_TLS_REQD: u32 = (1 << 31) + 5;
    pub const ERR_UNKNOWN: u32 = (1 << 31) + 6;
    pub const ERR_SHUTDOWN: u32 = (1 << 31) + 7;
    pub const ERR_BLOCK_SIZE_REQD: u32 = (1 << 31) + 8;
    pub const ERR_TOO_BIG: u32 = (1 << 31) + 9;
}

/// Information types in INFO and GO requests and `NBD_REP_INFO` replies.
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// The one metadata context this server knows.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// The id SET_META_CONTEXT assigns to `base:allocation`. Ids are opaque to clients; a nonzero
/// one keeps it apart from the reserved 0 that LIST_META_CONTEXT replies carry.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// What the handshake agreed on, for the transmission phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Session {
    /// Index into [`HandshakeConfig::exports`].
    pub export_index: usize,
    /// READ must be answered with structured replies; errors may carry messages.
    pub structured_replies: bool,
    /// Set when the client selected `base:allocation` for this export: BLOCK_STATUS is
    /// allowed and its chunks carry this id.
    pub base_allocation_id: Option<u32>,
    /// As sent to the client; [`crate::check_request`] enforces them.
    pub transmission_flags: u16,
    /// The client asked for `NBD_INFO_BLOCK_SIZE` in its `GO`, and so must keep to the block
    /// sizes it was sent. Otherwise (`EXPORT_NAME`, or `GO` without that request) the spec's
    /// defaults hold: any byte alignment, and payloads up to [`crate::DEFAULT_PAYLOAD_MAX`].
    pub sizes_agreed: bool,
}

/// The outcome of one [`Handshake::handle`] call. `consumed` counts bytes of the input given
/// to that call; the driver drops them from its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Call again when more bytes arrive.
    NeedMore { consumed: usize },
    /// Negotiation finished; transmission starts at `input[consumed..]`.
    Done { consumed: usize, session: Session },
    /// The client aborted; flush the output, then close.
    Close { consumed: usize },
    /// STARTTLS was acknowledged: flush the output in plaintext, then run the TLS handshake
    /// as the server; every later byte, both ways, goes through TLS, and negotiation goes on
    /// with the next [`Handshake::handle`] call. Nothing may follow STARTTLS in the input
    /// (that is an error, [`NbdError::DataAfterStartTls`]).
    StartTls { consumed: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Greeting sent; waiting for the 32-bit client flags.
    ClientFlags,
    /// Waiting for the next option.
    Options,
    /// Skipping the data of an oversized option.
    Discarding { remaining: u32 },
    /// Done, closed or failed; nothing more is accepted.
    Finished,
}

/// One connection's handshake. See the module docs.
#[derive(Debug)]
pub struct Handshake {
    config: Arc<HandshakeConfig>,
    state: State,
    /// The client asked us to leave out the 124 zero bytes after EXPORT_NAME.
    no_zeroes: bool,
    structured_replies: bool,
    /// The export for which the latest SET_META_CONTEXT selected `base:allocation`.
    meta_export: Option<usize>,
    options_seen: u32,
    discarded_bytes: u64,
    /// STARTTLS was acknowledged: the rest of the connection runs over TLS.
    tls_active: bool,
}

impl Handshake {
    pub fn new(config: Arc<HandshakeConfig>) -> Handshake {
        Handshake {
            config,
            state: State::ClientFlags,
            no_zeroes: false,
            structured_replies: false,
            meta_export: None,
            options_seen: 0,
            discarded_bytes: 0,
            tls_active: false,
        }
    }

    /// The server's opening 18 bytes, to send as soon as the connection is accepted.
    pub fn greeting(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&NBDMAGIC.to_be_bytes());
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    }

    /// Consume client bytes, appending replies to `out`. `input` is everything received and
    /// not yet consumed. After anything but `NeedMore`, every further call fails.
    pub fn handle(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<Step, NbdError> {
        let result = self.consume(input, out);
        if !matches!(result, Ok(Step::NeedMore { .. } | Step::StartTls { .. })) {
            self.state = State::Finished;
        }
        result
    }

    fn consume(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<Step, NbdError> {
        let mut consumed = 0;
        loop {
            let rest = input.get(consumed..).unwrap_or_default();
            match self.state {
                State::Finished => return Err(NbdError::HandshakeFinished),
                State::ClientFlags => {
                    let Some(flags) = Reader::new(rest).u32() else {
                        return Ok(Step::NeedMore { consumed });
                    };
                    if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
                        return Err(NbdError::UnknownClientFlags(flags));
                    }
                    self.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
                    consumed += 4;
                    self.state = State::Options;
                }
                State::Discarding { remaining } => {
                    let skipped = rest.len().min(remaining as usize);
                    consumed += skipped;
                    // `skipped <= remaining`, so this neither wraps nor truncates.
                    let remaining = remaining - skipped as u32;
                    if remaining > 0 {
                        self.state = State::Discarding { remaining };
                        return Ok(Step::NeedMore { consumed });
                    }
                    self.state = State::Options;
                }
                State::Options => {
                    let Some((option, len)) = option_header(rest)? else {
                        return Ok(Step::NeedMore { consumed });
                    };
                    if option == opt::ABORT {
                        put_reply(out, option, rep::ACK, 0);
                        return Ok(Step::Close { consumed: consumed + OPTION_HEADER_LEN });
                    }
                    if self.tls_required() && option == opt::EXPORT_NAME {
                        return Err(NbdError::TlsRequired);
                    }
                    if option == opt::EXPORT_NAME && len as usize > STRING_MAX {
                        return Err(NbdError::ExportNameTooLong(len));
                    }
                    if len > OPTION_LEN_MAX {
                        self.count_option()?;
                        self.refuse_oversized(option, len, out)?;
                        consumed += OPTION_HEADER_LEN;
                        self.state = State::Discarding { remaining: len };
                        continue;
                    }
                    let end = OPTION_HEADER_LEN + len as usize;
                    let Some(data) = rest.get(OPTION_HEADER_LEN..end) else {
                        return Ok(Step::NeedMore { consumed });
                    };
                    self.count_option()?;
                    consumed += end;
                    if option == opt::STARTTLS && self.handle_starttls(data, out) {
                        let extra = input.len() - consumed;
                        if extra > 0 {
                            return Err(NbdError::DataAfterStartTls(extra));
                        }
                        self.tls_active = true;
                        return Ok(Step::StartTls { consumed });
                    }
                    if option == opt::STARTTLS {
                        continue;
                    }
                    if self.tls_required() {
                        put_error(out, option, rep::ERR_TLS_REQD, "TLS required: send STARTTLS first");
                        continue;
                    }
                    if let Some(session) = self.handle_option(option, data, out)? {
                        return Ok(Step::Done { consumed, session });
                    }
                }
            }
        }
    }

    /// Whether TLS is required and not started yet.
    fn tls_required(&self) -> bool {
        self.config.tls() == TlsPolicy::Require && !self.tls_active
    }

    /// Replace the exports this negotiation offers, as a driver does once a TLS peer has
    /// proved who it is (each identity sees the exports, and the rights, it is granted). Only
    /// the export list and its flags change: the TLS policy stays what the connection began
    /// with, so an upgraded connection cannot be talked out of TLS.
    pub fn set_config(&mut self, config: Arc<HandshakeConfig>) {
        let tls = self.config.tls();
        self.config = if config.tls() == tls {
            config
        } else {
            Arc::new(HandshakeConfig::clone(&config).with_tls(tls))
        };
        // A meta context selected for an export of the old list names nothing now.
        self.meta_export = None;
    }

    /// Whether the connection has switched to TLS.
    pub fn tls_active(&self) -> bool {
        self.tls_active
    }

    /// Answer STARTTLS; `true` when it was acknowledged and the driver must upgrade now.
    fn handle_starttls(&mut self, data: &[u8], out: &mut Vec<u8>) -> bool {
        let option = opt::STARTTLS;
        if self.config.tls() == TlsPolicy::Off {
            put_error(out, option, rep::ERR_UNSUP, "option not supported");
        } else if self.tls_active {
            put_error(out, option, rep::ERR_INVALID, "TLS is already started");
        } else if !data.is_empty() {
            put_error(out, option, rep::ERR_INVALID, "STARTTLS takes no data");
        } else {
            put_reply(out, option, rep::ACK, 0);
            return true;
        }
        false
    }

    fn count_option(&mut self) -> Result<(), NbdError> {
        self.options_seen += 1;
        if self.options_seen > OPTIONS_MAX {
            return Err(NbdError::TooManyOptions);
        }
        Ok(())
    }

    fn refuse_oversized(&mut self, option: u32, len: u32, out: &mut Vec<u8>) -> Result<(), NbdError> {
        let total = self.discarded_bytes + u64::from(len);
        if total > OPTION_DISCARD_BYTES_MAX {
            return Err(NbdError::OptionTooLarge { option, len });
        }
        self.discarded_bytes = total;
        put_error(out, option, rep::ERR_TOO_BIG, "option data too large");
        Ok(())
    }

    /// Answer one complete option. `Some` ends the handshake successfully.
    fn handle_option(
        &mut self,
        option: u32,
        data: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<Option<Session>, NbdError> {
        match option {
            opt::EXPORT_NAME => self.handle_export_name(data, out).map(Some),
            opt::LIST => {
                self.handle_list(data, out);
                Ok(None)
            }
            opt::INFO | opt::GO => Ok(self.handle_info(option, data, out)),
            opt::STRUCTURED_REPLY => {
                self.handle_structured_reply(data, out);
                Ok(None)
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
                self.handle_meta_context(option, data, out);
                Ok(None)
            }
            _ => {
                put_error(out, option, rep::ERR_UNSUP, "option not supported");
                Ok(None)
            }
        }
    }

    fn handle_export_name(&self, name: &[u8], out: &mut Vec<u8>) -> Result<Session, NbdError> {
        let Some((index, export)) = self.config.find(name) else {
            return Err(NbdError::UnknownExport(String::from_utf8_lossy(name).into_owned()));
        };
        let session = self.session(index, export);
        out.extend_from_slice(&export.size_bytes.to_be_bytes());
        out.extend_from_slice(&session.transmission_flags.to_be_bytes());
        if !self.no_zeroes {
            out.extend_from_slice(&[0; 124]);
        }
        Ok(session)
    }

    fn handle_list(&self, data: &[u8], out: &mut Vec<u8>) {
        if !data.is_empty() {
            return put_error(out, opt::LIST, rep::ERR_INVALID, "LIST takes no data");
        }
        for export in self.config.exports().iter().filter(|e| !e.hidden) {
            let (name, description) = (export.name.as_bytes(), export.description.as_bytes());
            put_reply(out, opt::LIST, rep::SERVER, 4 + name.len() + description.len());
            put_u32(out, name.len());
            out.extend_from_slice(name);
            // The spec leaves the bytes after the name to a human-readable description.
            out.extend_from_slice(description);
        }
        put_reply(out, opt::LIST, rep::ACK, 0);
    }

    /// INFO and GO share their request and replies; GO also ends the handshake.
    fn handle_info(&self, option: u32, data: &[u8], out: &mut Vec<u8>) -> Option<Session> {
        let Some(request) = InfoRequest::parse(data) else {
            put_error(out, option, rep::ERR_INVALID, "malformed INFO or GO request");
            return None;
        };
        let Some((index, export)) = self.config.find(request.name) else {
            put_error(out, option, rep::ERR_UNKNOWN, "no such export");
            return None;
        };
        let session = self.session(index, export);
        put_reply(out, option, rep::INFO, 12);
        out.extend_from_slice(&info::EXPORT.to_be_bytes());
        out.extend_from_slice(&export.size_bytes.to_be_bytes());
        out.extend_from_slice(&session.transmission_flags.to_be_bytes());
        if request.name_wanted {
            put_info_string(out, option, info::NAME, &export.name);
        }
        if request.description_wanted && !export.description.is_empty() {
            put_info_string(out, option, info::DESCRIPTION, &export.description);
        }
        // Sent to a client that asks, which then keeps to it. One that does not ask gets the
        // spec's default sizes, which the target serves whatever the export's own (the
        // engine splits or patches what the backend cannot take as it is).
        if request.block_size_wanted {
            put_reply(out, option, rep::INFO, 14);
            out.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
            for size in [export.block_min, export.block_preferred, export.block_max] {
                out.extend_from_slice(&size.to_be_bytes());
            }
        }
        put_reply(out, option, rep::ACK, 0);
        (option == opt::GO).then_some(Session { sizes_agreed: request.block_size_wanted, ..session })
    }

    fn handle_structured_reply(&mut self, data: &[u8], out: &mut Vec<u8>) {
        let option = opt::STRUCTURED_REPLY;
        if !data.is_empty() {
            return put_error(out, option, rep::ERR_INVALID, "STRUCTURED_REPLY takes no data");
        }
        if self.structured_replies {
            return put_error(out, option, rep::ERR_INVALID, "structured replies already negotiated");
        }
        self.structured_replies = true;
        put_reply(out, option, rep::ACK, 0);
    }

    fn handle_meta_context(&mut self, option: u32, data: &[u8], out: &mut Vec<u8>) {
        let setting = option == opt::SET_META_CONTEXT;
        if setting {
            // SET replaces the previous selection even when it fails.
            self.meta_export = None;
        }
        if !self.structured_replies {
            return put_error(out, option, rep::ERR_INVALID, "negotiate structured replies first");
        }
        let Some(request) = MetaRequest::parse(data, !setting) else {
            return put_error(out, option, rep::ERR_INVALID, "malformed metadata context request");
        };
        let Some((index, _)) = self.config.find(request.export) else {
            return put_error(out, option, rep::ERR_UNKNOWN, "no such export");
        };
        if request.base_allocation {
            // LIST replies carry the reserved id 0; SET assigns the real one.
            let id = if setting { BASE_ALLOCATION_ID } else { 0 };
            put_reply(out, option, rep::META_CONTEXT, 4 + BASE_ALLOCATION.len());
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(BASE_ALLOCATION.as_bytes());
            if setting {
                self.meta_export = Some(index);
            }
        }
        put_reply(out, option, rep::ACK, 0);
    }

    fn session(&self, export_index: usize, export: &ExportDesc) -> Session {
        // A context only counts if it was selected for the export finally chosen.
        let selected = self.meta_export == Some(export_index);
        Session {
            export_index,
            structured_replies: self.structured_replies,
            base_allocation_id: selected.then_some(BASE_ALLOCATION_ID),
            transmission_flags: export.transmission_flags(self.structured_replies),
            sizes_agreed: false,
        }
    }
}

/// The option code and data length, once all 16 header bytes are here.
fn option_header(buf: &[u8]) -> Result<Option<(u32, u32)>, NbdError> {
    let mut r = Reader::new(buf);
    let (Some(magic), Some(option), Some(len)) = (r.u64(), r.u32(), r.u32()) else {
        return Ok(None);
    };
    if magic != IHAVEOPT {
        return Err(NbdError::BadOptionMagic(magic));
    }
    Ok(Some((option, len)))
}

/// The data of INFO and GO: an export name and the information items wanted.
struct InfoRequest<'a> {
    name: &'a [u8],
    name_wanted: bool,
    description_wanted: bool,
    block_size_wanted: bool,
}

impl<'a> InfoRequest<'a> {
    fn parse(data: &'a [u8]) -> Option<InfoRequest<'a>> {
        let mut r = Reader::new(data);
        let name = r.string()?;
        let mut request =
            InfoRequest { name, name_wanted: false, description_wanted: false, block_size_wanted: false };
        // Unknown items are ignored and duplicates are harmless, as the spec asks.
        for _ in 0..r.u16()? {
            match r.u16()? {
                info::NAME => request.name_wanted = true,
                info::DESCRIPTION => request.description_wanted = true,
                info::BLOCK_SIZE => request.block_size_wanted = true,
                _ => {}
            }
        }
        r.is_empty().then_some(request)
    }
}

/// The data of LIST_META_CONTEXT and SET_META_CONTEXT, reduced to what we support.
struct MetaRequest<'a> {
    export: &'a [u8],
    base_allocation: bool,
}

impl<'a> MetaRequest<'a> {
    /// Every query is read, so a malformed one anywhere fails the whole request before any
    /// reply is sent. The loop ends early on a short read: each query costs at least 4 bytes.
    fn parse(data: &'a [u8], listing: bool) -> Option<MetaRequest<'a>> {
        let mut r = Reader::new(data);
        let export = r.string()?;
        let count = r.u32()?;
        // LIST with no queries means "everything you have".
        let mut base_allocation = listing && count == 0;
        for _ in 0..count {
            base_allocation |= selects_base_allocation(r.string()?, listing);
        }
        r.is_empty().then_some(MetaRequest { export, base_allocation })
    }
}

fn selects_base_allocation(query: &[u8], listing: bool) -> bool {
    match query {
        b"base:allocation" => true,
        // The namespace wildcard lists everything in it, but SET must ignore it.
        b"base:" => listing,
        _ => false,
    }
}

/// Option reply header. Every length passed here is bounded by [`STRING_MAX`]-sized fields,
/// far below `u32::MAX`.
fn put_reply(out: &mut Vec<u8>, option: u32, reply: u32, len: usize) {
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    put_u32(out, len);
}

fn put_u32(out: &mut Vec<u8>, v: usize) {
    debug_assert!(u32::try_from(v).is_ok());
    out.extend_from_slice(&(v as u32).to_be_bytes());
}

/// An error reply, with a message for the human behind the client.
fn put_error(out: &mut Vec<u8>, option: u32, reply: u32, message: &str) {
    debug_assert!(reply & (1 << 31) != 0);
    put_reply(out, option, reply, message.len());
    out.extend_from_slice(message.as_bytes());
}

fn put_info_string(out: &mut Vec<u8>, option: u32, kind: u16, text: &str) {
    put_reply(out, option, rep::INFO, 2 + text.len());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(text.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handshake() -> Handshake {
        let config = HandshakeConfig::new(vec![ExportDesc::new("disk", 1 << 20)], Some(0)).unwrap();
        Handshake::new(Arc::new(config))
    }

    fn tls_handshake(tls: TlsPolicy) -> Handshake {
        let config = HandshakeConfig::new(vec![ExportDesc::new("disk", 1 << 20)], Some(0)).unwrap();
        Handshake::new(Arc::new(config.with_tls(tls)))
    }

    fn go() -> Vec<u8> {
        option(opt::GO, &[0, 0, 0, 0, 0, 0])
    }

    #[test]
    fn require_refuses_everything_but_starttls_and_abort_before_tls() {
        let mut hs = tls_handshake(TlsPolicy::Require);
        let mut input = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        input.extend(option(opt::LIST, &[]));
        input.extend(go());
        input.extend(option(opt::STRUCTURED_REPLY, &[]));
        let mut out = Vec::new();
        assert_eq!(hs.handle(&input, &mut out), Ok(Step::NeedMore { consumed: input.len() }));
        assert_eq!(reply_types(&out), [rep::ERR_TLS_REQD; 3]);

        // STARTTLS is acknowledged; after it, the same options work.
        let starttls = option(opt::STARTTLS, &[]);
        out.clear();
        assert_eq!(hs.handle(&starttls, &mut out), Ok(Step::StartTls { consumed: starttls.len() }));
        assert_eq!(reply_types(&out), [rep::ACK]);
        assert!(hs.tls_active());

        // A second STARTTLS is invalid; negotiation goes on.
        out.clear();
        assert_eq!(hs.handle(&starttls, &mut out), Ok(Step::NeedMore { consumed: starttls.len() }));
        assert_eq!(reply_types(&out), [rep::ERR_INVALID]);
        let go = go();
        assert!(matches!(hs.handle(&go, &mut Vec::new()), Ok(Step::Done { .. })));
    }

    #[test]
    fn require_closes_on_plaintext_export_name_and_abort_still_works() {
        let mut hs = tls_handshake(TlsPolicy::Require);
        let mut input = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        input.extend(option(opt::EXPORT_NAME, b"disk"));
        assert_eq!(hs.handle(&input, &mut Vec::new()), Err(NbdError::TlsRequired));

        let mut hs = tls_handshake(TlsPolicy::Require);
        let mut input = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        input.extend(option(opt::ABORT, &[]));
        assert!(matches!(hs.handle(&input, &mut Vec::new()), Ok(Step::Close { .. })));
    }

    #[test]
    fn on_takes_both_and_off_does_not_offer_tls() {
        let mut hs = tls_handshake(TlsPolicy::On);
        let mut input = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        input.extend(go());
        assert!(matches!(hs.handle(&input, &mut Vec::new()), Ok(Step::Done { .. })));

        let mut hs = tls_handshake(TlsPolicy::Off);
        let mut input = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        input.extend(option(opt::STARTTLS, &[]));
        let mut out = Vec::new();
        assert_eq!(hs.handle(&input, &mut out), Ok(Step::NeedMore { consumed: input.len() }));
        assert_eq!(reply_types(&out), [rep::ERR_UNSUP]);
        assert!(!hs.tls_active());
    }

    #[test]
    fn starttls_with_data_or_bytes_behind_it_is_refused() {
        let mut hs = tls_handshake(TlsPolicy::On);
        let mut input = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        input.extend(option(opt::STARTTLS, &[1]));
        let mut out = Vec::new();
        assert_eq!(hs.handle(&input, &mut out), Ok(Step::NeedMore { consumed: input.len() }));
        assert_eq!(reply_types(&out), [rep::ERR_INVALID]);

        let mut hs = tls_handshake(TlsPolicy::On);
        let mut input = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        input.extend(option(opt::STARTTLS, &[]));
        input.extend(go());
        assert_eq!(hs.handle(&input, &mut Vec::new()), Err(NbdError::DataAfterStartTls(go().len())));
    }

    #[test]
    fn a_new_config_after_starttls_changes_the_exports_but_not_the_tls_policy() {
        let mut hs = tls_handshake(TlsPolicy::Require);
        let mut input = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        input.extend(option(opt::STARTTLS, &[]));
        assert!(matches!(hs.handle(&input, &mut Vec::new()), Ok(Step::StartTls { .. })));
        // The identity proved over TLS may only read "disk", and does not see "secret".
        let mut disk = ExportDesc::new("disk", 1 << 20);
        disk.read_only = true;
        let mut secret = ExportDesc::new("secret", 1 << 20);
        secret.hidden = true;
        hs.set_config(Arc::new(HandshakeConfig::new(vec![disk, secret], Some(0)).unwrap()));
        assert_eq!(hs.config.tls(), TlsPolicy::Require, "the policy the connection began with stays");
        let mut out = Vec::new();
        let name_go = |name: &[u8]| {
            let mut data = (name.len() as u32).to_be_bytes().to_vec();
            data.extend_from_slice(name);
            data.extend_from_slice(&[0, 0]);
            option(opt::GO, &data)
        };
        let refused = name_go(b"secret");
        assert_eq!(hs.handle(&refused, &mut out), Ok(Step::NeedMore { consumed: refused.len() }));
        assert_eq!(reply_types(&out), [rep::ERR_UNKNOWN]);
        match hs.handle(&name_go(b"disk"), &mut Vec::new()) {
            Ok(Step::Done { session, .. }) => {
                assert_ne!(
                    session.transmission_flags & crate::tflags::READ_ONLY,
                    0,
                    "read-only for this identity"
                )
            }
            other => panic!("GO disk: {other:?}"),
        }
    }

    fn option(code: u32, data: &[u8]) -> Vec<u8> {
        let mut v = IHAVEOPT.to_be_bytes().to_vec();
        v.extend_from_slice(&code.to_be_bytes());
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    /// The reply types in `out`, in order (every reply here has a short payload).
    fn reply_types(mut out: &[u8]) -> Vec<u32> {
        let mut types = Vec::new();
        while !out.is_empty() {
            let mut r = Reader::new(out);
            assert_eq!(r.u64(), Some(OPTION_REPLY_MAGIC));
            let (_, kind, len) = (r.u32().unwrap(), r.u32().unwrap(), r.u32().unwrap());
            types.push(kind);
            out = &out[20 + len as usize..];
        }
        types
    }

    #[test]
    fn nothing_is_consumed_until_a_message_is_whole() {
        let mut hs = handshake();
        let mut out = Vec::new();
        assert_eq!(hs.handle(&[0, 0, 0], &mut out), Ok(Step::NeedMore { consumed: 0 }));
        let mut input = vec![0, 0, 0, 1];
        input.extend_from_slice(&option(opt::LIST, &[])[..15]);
        assert_eq!(hs.handle(&input, &mut out), Ok(Step::NeedMore { consumed: 4 }));
        assert!(out.is_empty());
    }

    #[test]
    fn unknown_client_flags_close() {
        let mut hs = handshake();
        assert_eq!(hs.handle(&[0, 0, 0, 4], &mut Vec::new()), Err(NbdError::UnknownClientFlags(4)));
        assert_eq!(hs.handle(&[], &mut Vec::new()), Err(NbdError::HandshakeFinished));
    }

    #[test]
    fn bad_option_magic_closes() {
        let mut hs = handshake();
        let mut input = vec![0, 0, 0, 1];
        let mut bad = option(opt::LIST, &[]);
        bad[0] ^= 1;
        input.extend_from_slice(&bad);
        assert!(matches!(hs.handle(&input, &mut Vec::new()), Err(NbdError::BadOptionMagic(_))));
    }

    #[test]
    fn stateful_options_are_refused_when_repeated_or_malformed() {
        let mut hs = handshake();
        let mut out = Vec::new();
        let mut input = vec![0, 0, 0, 1];
        input.extend(option(opt::STRUCTURED_REPLY, &[]));
        input.extend(option(opt::STRUCTURED_REPLY, &[]));
        input.extend(option(opt::STRUCTURED_REPLY, &[1]));
        input.extend(option(opt::LIST, &[1]));
        input.extend(option(opt::GO, &[0, 0, 0, 0, 0])); // too short for its info count
        input.extend(option(opt::GO, &[0, 0, 0, 0, 0, 0, 9])); // trailing byte
        let consumed = input.len();
        assert_eq!(hs.handle(&input, &mut out), Ok(Step::NeedMore { consumed }));
        let invalid = rep::ERR_INVALID;
        assert_eq!(reply_types(&out), [rep::ACK, invalid, invalid, invalid, invalid, invalid]);
    }

    #[test]
    fn set_meta_context_replaces_the_selection_even_when_it_fails() {
        let mut hs = handshake();
        let mut out = Vec::new();
        let select =
            [&4u32.to_be_bytes()[..], b"disk", &1u32.to_be_bytes(), &15u32.to_be_bytes(), b"base:allocation"]
                .concat();
        let mut input = vec![0, 0, 0, 1];
        input.extend(option(opt::STRUCTURED_REPLY, &[]));
        input.extend(option(opt::SET_META_CONTEXT, &select));
        input.extend(option(opt::SET_META_CONTEXT, &select[..10])); // malformed
        input.extend(option(opt::GO, &[0, 0, 0, 0, 0, 0]));
        let Ok(Step::Done { session, .. }) = hs.handle(&input, &mut out) else { panic!("GO failed") };
        assert_eq!(session.base_allocation_id, None);
    }

    #[test]
    fn query_matching() {
        assert!(selects_base_allocation(b"base:allocation", false));
        assert!(selects_base_allocation(b"base:allocation", true));
        assert!(selects_base_allocation(b"base:", true));
        assert!(!selects_base_allocation(b"base:", false));
        assert!(!selects_base_allocation(b"base:dirty", true));
        assert!(!selects_base_allocation(b"qemu:dirty-bitmap:x", true));
        assert!(!selects_base_allocation(b"base", true));
        assert!(!selects_base_allocation(b"", true));
    }

    #[test]
    fn options_are_bounded() {
        let mut hs = handshake();
        let mut input = vec![0, 0, 0, 1];
        for _ in 0..=OPTIONS_MAX {
            input.extend(option(opt::INFO, &[0, 0, 0, 0, 0, 0]));
        }
        assert_eq!(hs.handle(&input, &mut Vec::new()), Err(NbdError::TooManyOptions));
    }
}
