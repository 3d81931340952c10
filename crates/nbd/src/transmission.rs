//! The transmission phase: request headers in, replies out, and the errno a refusal carries.
//!
//! [`parse_request`] reads one 28-byte header; a WRITE's payload follows it on the wire and
//! is the driver's to read (or to discard, when the request is refused, so that framing
//! survives). [`check_request`] refuses what the negotiated session does not allow; range,
//! alignment and size checks are the engine's, whose [`wire::Status`] [`error_of`] turns into
//! an NBD error. The emitters append simple replies and structured chunks to the driver's
//! buffer; read data is appended by the driver right after the header that announces it.
//!
//! Which reply to use is the driver's choice within one rule from the spec: once structured
//! replies are negotiated, READ (even a refused one) and BLOCK_STATUS must be answered with
//! chunks; anything without a payload may still get a 16-byte simple reply.

use wire::Status;

use crate::bytes::Reader;
use crate::handshake::Session;
use crate::{tflags, NbdError, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC, STRING_MAX, STRUCTURED_REPLY_MAGIC};

// Error values, as NBD defines them (the common Linux errno numbers, fixed by the spec).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
/// The spec asks servers to avoid this one.
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
/// Only for a READ with `DF` that cannot be sent as one chunk.
pub const EOVERFLOW: u32 = 75;
/// Only for WRITE_ZEROES with `FAST_ZERO` that would not be fast.
pub const ENOTSUP: u32 = 95;
/// For requests refused while the server shuts down.
pub const ESHUTDOWN: u32 = 108;

/// Structured reply chunk types. Error chunks have bit 15 set.
pub mod chunk {
    pub const NONE: u16 = 0;
    pub const OFFSET_DATA: u16 = 1;
    pub const OFFSET_HOLE: u16 = 2;
    pub const BLOCK_STATUS: u16 = 5;
    pub const ERROR: u16 = (1 << 15) + 1;
    pub const ERROR_OFFSET: u16 = (1 << 15) + 2;
}

/// The only structured reply flag: this chunk is the last of its reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;

/// `base:allocation` extent flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// Most data one OFFSET_DATA chunk can carry: its length field also covers the 8-byte offset.
pub const CHUNK_DATA_MAX: u32 = u32::MAX - 8;
/// Most extents in one BLOCK_STATUS chunk, for the same reason.
pub const CHUNK_EXTENTS_MAX: usize = (u32::MAX as usize - 4) / 8;

/// A request's command. Unknown codes are kept so the driver can answer `EINVAL` and go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cmd {
    Read,
    /// The only command with a payload: `length` bytes follow the header.
    Write,
    /// Soft disconnect: finish outstanding requests, send no reply, close.
    Disc,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    Unknown(u16),
}

impl Cmd {
    pub fn from_u16(v: u16) -> Cmd {
        match v {
            0 => Cmd::Read,
            1 => Cmd::Write,
            2 => Cmd::Disc,
            3 => Cmd::Flush,
            4 => Cmd::Trim,
            5 => Cmd::Cache,
            6 => Cmd::WriteZeroes,
            7 => Cmd::BlockStatus,
            other => Cmd::Unknown(other),
        }
    }

    pub fn to_u16(self) -> u16 {
        match self {
            Cmd::Read => 0,
            Cmd::Write => 1,
            Cmd::Disc => 2,
            Cmd::Flush => 3,
            Cmd::Trim => 4,
            Cmd::Cache => 5,
            Cmd::WriteZeroes => 6,
            Cmd::BlockStatus => 7,
            Cmd::Unknown(v) => v,
        }
    }

    /// Commands that change the export's contents.
    pub fn writes(self) -> bool {
        matches!(self, Cmd::Write | Cmd::Trim | Cmd::WriteZeroes)
    }
}

/// Command flags. Bits the spec does not define are kept, so they can be refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CmdFlags(u16);

impl CmdFlags {
    pub const FUA: CmdFlags = CmdFlags(1 << 0);
    pub const NO_HOLE: CmdFlags = CmdFlags(1 << 1);
    pub const DF: CmdFlags = CmdFlags(1 << 2);
    pub const REQ_ONE: CmdFlags = CmdFlags(1 << 3);
    pub const FAST_ZERO: CmdFlags = CmdFlags(1 << 4);
    const KNOWN: u16 = 0x1f;

    pub const fn empty() -> CmdFlags {
        CmdFlags(0)
    }

    pub const fn from_bits(bits: u16) -> CmdFlags {
        CmdFlags(bits)
    }

    pub const fn bits(self) -> u16 {
        self.0
    }

    pub const fn contains(self, other: CmdFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Bits no version of the spec we know defines.
    pub const fn unknown_bits(self) -> u16 {
        self.0 & !Self::KNOWN
    }
}

impl std::ops::BitOr for CmdFlags {
    type Output = CmdFlags;
    fn bitor(self, rhs: CmdFlags) -> CmdFlags {
        CmdFlags(self.0 | rhs.0)
    }
}

/// One request header, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: CmdFlags,
    pub cmd: Cmd,
    /// Chosen by the client (the spec's "handle"), echoed in every reply.
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl Request {
    /// Bytes that follow this header on the wire: `length` for a WRITE, else none.
    pub fn payload_len(&self) -> u32 {
        if self.cmd == Cmd::Write {
            self.length
        } else {
            0
        }
    }

    /// The 28-byte header, as a client would send it (for tests and in-memory peers).
    pub fn emit(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.flags.bits().to_be_bytes());
        out.extend_from_slice(&self.cmd.to_u16().to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
        out.extend_from_slice(&self.offset.to_be_bytes());
        out.extend_from_slice(&self.length.to_be_bytes());
    }
}

/// Parse one request header from the front of `buf`. `Ok(None)`: fewer than 28 bytes so far.
/// `Ok(Some((request, 28)))`: the header and its length; a WRITE's payload comes next. A bad
/// magic means the stream is out of step, and the only answer is to close.
pub fn parse_request(buf: &[u8]) -> Result<Option<(Request, usize)>, NbdError> {
    let mut r = Reader::new(buf);
    let (Some(magic), Some(flags), Some(cmd), Some(cookie), Some(offset), Some(length)) =
        (r.u32(), r.u16(), r.u16(), r.u64(), r.u64(), r.u32())
    else {
        return Ok(None);
    };
    if magic != REQUEST_MAGIC {
        return Err(NbdError::BadRequestMagic(magic));
    }
    let request = Request { flags: CmdFlags(flags), cmd: Cmd::from_u16(cmd), cookie, offset, length };
    Ok(Some((request, crate::REQUEST_LEN)))
}

/// Refuse what the session did not negotiate, with the errno the spec asks for: `EPERM` for
/// a write to a read-only export; `EINVAL` for an unknown command or flag, a flag not
/// documented for the command or not advertised, a command not advertised, BLOCK_STATUS
/// without a selected context, and a FLUSH with a nonzero offset or length.
///
/// Checks that need the export's geometry (range, alignment, `block_max`) are left to the
/// engine and come back through [`error_of`]. A refused WRITE's payload must still be
/// discarded by the driver. DISC passes whatever its fields say: it gets no reply.
pub fn check_request(req: &Request, session: &Session) -> Result<(), u32> {
    let advertised = |flag: u16| session.transmission_flags & flag != 0;
    // Flags each command accepts beyond FUA, and the transmission flag it needs, if any.
    let (allowed, needs) = match req.cmd {
        Cmd::Read => (CmdFlags::DF, None),
        Cmd::Write | Cmd::Disc => (CmdFlags::empty(), None),
        Cmd::Flush => (CmdFlags::empty(), Some(tflags::SEND_FLUSH)),
        Cmd::Trim => (CmdFlags::empty(), Some(tflags::SEND_TRIM)),
        Cmd::Cache => (CmdFlags::empty(), Some(tflags::SEND_CACHE)),
        Cmd::WriteZeroes => (CmdFlags::NO_HOLE | CmdFlags::FAST_ZERO, Some(tflags::SEND_WRITE_ZEROES)),
        Cmd::BlockStatus => (CmdFlags::REQ_ONE, None),
        Cmd::Unknown(_) => return Err(EINVAL),
    };
    if req.cmd.writes() && advertised(tflags::READ_ONLY) {
        return Err(EPERM);
    }
    if needs.is_some_and(|flag| !advertised(flag)) {
        return Err(EINVAL);
    }
    let flags = req.flags;
    // FUA is valid on every command once advertised; the others only where documented.
    let fua_ok = !flags.contains(CmdFlags::FUA) || advertised(tflags::SEND_FUA);
    let others = flags.bits() & !CmdFlags::FUA.bits();
    if !fua_ok || others & !allowed.bits() != 0 {
        return Err(EINVAL);
    }
    if flags.contains(CmdFlags::DF) && !advertised(tflags::SEND_DF) {
        return Err(EINVAL);
    }
    if flags.contains(CmdFlags::FAST_ZERO) && !advertised(tflags::SEND_FAST_ZERO) {
        return Err(EINVAL);
    }
    if req.cmd == Cmd::BlockStatus && session.base_allocation_id.is_none() {
        return Err(EINVAL);
    }
    if req.cmd == Cmd::Flush && (req.offset != 0 || req.length != 0) {
        return Err(EINVAL);
    }
    Ok(())
}

/// The NBD error for a skiff status on a request with command `cmd` and flags `flags`;
/// `Ok` maps to 0. Following the spec's "Error values" and "Block size constraints":
///
/// | status | NBD error |
/// |---|---|
/// | `ReadOnly` | `EPERM` |
/// | `OutOfRange` | `ENOSPC` for WRITE and WRITE_ZEROES; `EINVAL` for READ, TRIM, CACHE, BLOCK_STATUS |
/// | `NoSpace` | `ENOSPC` |
/// | `Invalid`, `Misaligned`, `BadHandle`, `UnknownOpcode` | `EINVAL` |
/// | `TooLarge` | `EINVAL`: the spec asks for `EINVAL` past the advertised maximum block size and keeps `EOVERFLOW` for DF reads that cannot go in one chunk, which never happens here since reads are never fragmented |
/// | `Unsupported` | `ENOTSUP` for WRITE_ZEROES with `FAST_ZERO` (the one place the spec allows it); `EINVAL` otherwise, as for any command the export does not offer |
/// | `IoError` and anything else | `EIO` |
pub fn error_of(status: Status, cmd: Cmd, flags: CmdFlags) -> u32 {
    match status {
        Status::Ok => 0,
        Status::ReadOnly => EPERM,
        Status::OutOfRange => match cmd {
            Cmd::Write | Cmd::WriteZeroes => ENOSPC,
            _ => EINVAL,
        },
        Status::NoSpace => ENOSPC,
        Status::Invalid
        | Status::Misaligned
        | Status::BadHandle
        | Status::UnknownOpcode
        | Status::TooLarge => EINVAL,
        Status::Unsupported if cmd == Cmd::WriteZeroes && flags.contains(CmdFlags::FAST_ZERO) => ENOTSUP,
        Status::Unsupported => EINVAL,
        Status::IoError
        | Status::NotFound
        | Status::VersionMismatch
        | Status::TooManyOpen
        | Status::TimedOut
        | Status::TlsRequired
        | Status::StaleCapability
        | Status::BadCapability
        | Status::Exists
        | Status::Busy
        | Status::Other(_) => EIO,
        Status::ShuttingDown => ESHUTDOWN,
        Status::AuthRequired | Status::AuthFailed | Status::AccessDenied => EPERM,
    }
}

/// A simple reply. For a successful READ the driver appends `length` bytes of data after it;
/// after a nonzero `error` nothing follows.
pub fn simple_reply(out: &mut Vec<u8>, cookie: u64, error: u32) {
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
}

/// The header of an OFFSET_DATA chunk for `data_len` bytes read at `offset`; the driver
/// appends exactly `data_len` bytes of data.
///
/// # Panics
/// If `data_len` is 0 or above [`CHUNK_DATA_MAX`]: the length field would lie, and the
/// client could no longer find the next message.
pub fn chunk_offset_data_header(out: &mut Vec<u8>, cookie: u64, done: bool, offset: u64, data_len: u32) {
    assert!((1..=CHUNK_DATA_MAX).contains(&data_len), "OFFSET_DATA chunk of {data_len} bytes");
    chunk_header(out, cookie, done, chunk::OFFSET_DATA, data_len + 8);
    out.extend_from_slice(&offset.to_be_bytes());
}

/// An OFFSET_HOLE chunk: `hole_len` (nonzero) bytes at `offset` read as zeroes.
pub fn chunk_offset_hole(out: &mut Vec<u8>, cookie: u64, done: bool, offset: u64, hole_len: u32) {
    debug_assert!(hole_len > 0, "the spec requires a nonzero hole");
    chunk_header(out, cookie, done, chunk::OFFSET_HOLE, 12);
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&hole_len.to_be_bytes());
}

/// The NONE chunk that ends a successful structured reply.
pub fn chunk_none(out: &mut Vec<u8>, cookie: u64) {
    chunk_header(out, cookie, true, chunk::NONE, 0);
}

/// An ERROR chunk ending the reply: `error` (nonzero) and a message for humans, cut to the
/// spec's string limit.
pub fn chunk_error(out: &mut Vec<u8>, cookie: u64, error: u32, message: &str) {
    let message = truncate(message);
    chunk_header(out, cookie, true, chunk::ERROR, 6 + message.len() as u32);
    put_error_fields(out, error, message);
}

/// An ERROR_OFFSET chunk: the request failed at `offset` (for partial success on READ, WRITE,
/// TRIM, CACHE, WRITE_ZEROES and BLOCK_STATUS).
pub fn chunk_error_offset(
    out: &mut Vec<u8>,
    cookie: u64,
    done: bool,
    error: u32,
    message: &str,
    offset: u64,
) {
    let message = truncate(message);
    chunk_header(out, cookie, done, chunk::ERROR_OFFSET, 14 + message.len() as u32);
    put_error_fields(out, error, message);
    out.extend_from_slice(&offset.to_be_bytes());
}

/// A BLOCK_STATUS chunk for one context: consecutive `(length, flags)` extents from the
/// request's offset, at least one, each with a nonzero length.
///
/// # Panics
/// If there are more than [`CHUNK_EXTENTS_MAX`] extents (the length field would overflow).
pub fn chunk_block_status(
    out: &mut Vec<u8>,
    cookie: u64,
    done: bool,
    context_id: u32,
    extents: &[(u32, u32)],
) {
    assert!(extents.len() <= CHUNK_EXTENTS_MAX, "{} extents in one chunk", extents.len());
    debug_assert!(!extents.is_empty() && extents.iter().all(|&(len, _)| len > 0));
    chunk_header(out, cookie, done, chunk::BLOCK_STATUS, 4 + 8 * extents.len() as u32);
    out.extend_from_slice(&context_id.to_be_bytes());
    for &(len, flags) in extents {
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
    }
}

/// Answer a refused or failed request in the form the session requires: an ERROR chunk
/// (which READ needs and which carries the message) with structured replies, a simple reply
/// without.
pub fn error_reply(out: &mut Vec<u8>, session: &Session, cookie: u64, error: u32, message: &str) {
    if session.structured_replies {
        chunk_error(out, cookie, error, message);
    } else {
        simple_reply(out, cookie, error);
    }
}

fn chunk_header(out: &mut Vec<u8>, cookie: u64, done: bool, kind: u16, len: u32) {
    let flags = if done { REPLY_FLAG_DONE } else { 0 };
    out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

fn put_error_fields(out: &mut Vec<u8>, error: u32, message: &str) {
    debug_assert!(error != 0, "an error chunk must carry an error");
    out.extend_from_slice(&error.to_be_bytes());
    // `truncate` keeps messages within STRING_MAX, well inside u16.
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message.as_bytes());
}

/// `message` cut to at most [`STRING_MAX`] bytes on a character boundary.
fn truncate(message: &str) -> &str {
    let mut end = message.len().min(STRING_MAX);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message.get(..end).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(transmission_flags: u16, structured: bool, context: bool) -> Session {
        Session {
            export_index: 0,
            structured_replies: structured,
            base_allocation_id: context.then_some(1),
            transmission_flags: tflags::HAS_FLAGS | transmission_flags,
            sizes_agreed: false,
        }
    }

    fn req(cmd: Cmd, flags: CmdFlags) -> Request {
        Request { flags, cmd, cookie: 7, offset: 0, length: 0 }
    }

    #[test]
    fn commands_and_flags_round_trip() {
        for v in 0..=20u16 {
            assert_eq!(Cmd::from_u16(v).to_u16(), v);
        }
        assert_eq!(Cmd::from_u16(8), Cmd::Unknown(8), "RESIZE is not supported");
        let f = CmdFlags::from_bits(0x8011);
        assert!(f.contains(CmdFlags::FUA | CmdFlags::FAST_ZERO));
        assert!(!f.contains(CmdFlags::DF));
        assert_eq!(f.unknown_bits(), 0x8000);
    }

    #[test]
    fn emit_then_parse() {
        let r = Request {
            flags: CmdFlags::FUA,
            cmd: Cmd::Write,
            cookie: u64::MAX,
            offset: 1 << 40,
            length: 4096,
        };
        let mut buf = Vec::new();
        r.emit(&mut buf);
        assert_eq!(parse_request(&buf), Ok(Some((r, 28))));
        assert_eq!(parse_request(&buf[..27]), Ok(None));
        assert_eq!(r.payload_len(), 4096);
        assert_eq!(Request { cmd: Cmd::Read, ..r }.payload_len(), 0);
    }

    #[test]
    fn check_request_enforces_the_negotiation() {
        let plain = session(0, false, false);
        assert_eq!(check_request(&req(Cmd::Read, CmdFlags::empty()), &plain), Ok(()));
        assert_eq!(check_request(&req(Cmd::Unknown(9), CmdFlags::empty()), &plain), Err(EINVAL));
        assert_eq!(check_request(&req(Cmd::Read, CmdFlags::from_bits(0x20)), &plain), Err(EINVAL));
        assert_eq!(check_request(&req(Cmd::Write, CmdFlags::FUA), &plain), Err(EINVAL), "FUA not sent");
        assert_eq!(check_request(&req(Cmd::Flush, CmdFlags::empty()), &plain), Err(EINVAL));
        assert_eq!(check_request(&req(Cmd::Trim, CmdFlags::empty()), &plain), Err(EINVAL));
        assert_eq!(check_request(&req(Cmd::Cache, CmdFlags::empty()), &plain), Err(EINVAL));
        assert_eq!(check_request(&req(Cmd::Read, CmdFlags::DF), &plain), Err(EINVAL), "DF needs SR");
        assert_eq!(check_request(&req(Cmd::BlockStatus, CmdFlags::empty()), &plain), Err(EINVAL));
        assert_eq!(check_request(&req(Cmd::Disc, CmdFlags::empty()), &plain), Ok(()));

        let all = tflags::SEND_FLUSH
            | tflags::SEND_FUA
            | tflags::SEND_TRIM
            | tflags::SEND_WRITE_ZEROES
            | tflags::SEND_FAST_ZERO
            | tflags::SEND_CACHE
            | tflags::SEND_DF;
        let full = session(all, true, true);
        let ok = |cmd, flags| check_request(&req(cmd, flags), &full);
        assert_eq!(ok(Cmd::Read, CmdFlags::DF | CmdFlags::FUA), Ok(()));
        assert_eq!(ok(Cmd::Flush, CmdFlags::FUA), Ok(()), "FUA is valid on every command");
        assert_eq!(ok(Cmd::WriteZeroes, CmdFlags::NO_HOLE | CmdFlags::FAST_ZERO), Ok(()));
        assert_eq!(ok(Cmd::BlockStatus, CmdFlags::REQ_ONE), Ok(()));
        assert_eq!(ok(Cmd::Cache, CmdFlags::empty()), Ok(()));
        assert_eq!(ok(Cmd::Write, CmdFlags::DF), Err(EINVAL), "DF is for READ only");
        assert_eq!(ok(Cmd::Read, CmdFlags::REQ_ONE), Err(EINVAL));
        assert_eq!(ok(Cmd::Trim, CmdFlags::NO_HOLE), Err(EINVAL));
        let flush = Request { offset: 512, ..req(Cmd::Flush, CmdFlags::empty()) };
        assert_eq!(check_request(&flush, &full), Err(EINVAL));

        let no_fast = session(tflags::SEND_WRITE_ZEROES, false, false);
        assert_eq!(check_request(&req(Cmd::WriteZeroes, CmdFlags::FAST_ZERO), &no_fast), Err(EINVAL));

        let ro = session(tflags::READ_ONLY | tflags::SEND_FLUSH, false, false);
        for cmd in [Cmd::Write, Cmd::Trim, Cmd::WriteZeroes] {
            assert_eq!(check_request(&req(cmd, CmdFlags::empty()), &ro), Err(EPERM), "{cmd:?}");
        }
        assert_eq!(check_request(&req(Cmd::Flush, CmdFlags::empty()), &ro), Ok(()));
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        let long = "é".repeat(STRING_MAX); // two bytes each
        assert_eq!(truncate(&long).len(), STRING_MAX);
        let odd = format!("a{long}");
        assert_eq!(truncate(&odd).len(), STRING_MAX - 1);
        assert_eq!(truncate("short"), "short");
    }

    #[test]
    #[should_panic(expected = "OFFSET_DATA chunk of 0 bytes")]
    fn empty_data_chunk_is_a_driver_bug() {
        chunk_offset_data_header(&mut Vec::new(), 1, true, 0, 0);
    }
}
