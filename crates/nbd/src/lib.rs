//! The server side of the NBD (Network Block Device) protocol, free of I/O, so that every
//! existing NBD client (the Linux kernel, qemu, nbdkit's and libnbd's tools) can use a skiff
//! target.
//!
//! The split is the one the rest of skiff uses. This crate owns the bytes and the rules:
//!
//! - [`Handshake`] runs fixed-newstyle option haggling: bytes from the client in, option
//!   replies out, and at the end a [`Session`] saying which export was chosen and what was
//!   agreed (structured replies, the `base:allocation` context, transmission flags).
//! - [`transmission`] parses the 28-byte request headers, checks a request against the
//!   session ([`check_request`]), emits simple replies and structured reply chunks, and maps
//!   skiff statuses to NBD errors ([`error_of`]).
//!
//! The driver, in the target, owns everything else: the socket and its buffers, reading (or
//! discarding) a WRITE's payload, executing requests on the engine, and closing the
//! connection. Nothing here reads a clock, touches a socket or allocates on the data path:
//! the reply emitters append to a buffer the driver reuses.
//!
//! Source of truth: `doc/proto.md` in the NetworkBlockDevice/nbd repository. Implemented:
//! NOTLS mode and, with a [`TlsPolicy`] other than `Off`, NBD_OPT_STARTTLS (the driver
//! does the TLS handshake when [`Step::StartTls`] says so), the fixed-newstyle handshake with EXPORT_NAME, ABORT, LIST, INFO, GO,
//! STRUCTURED_REPLY, LIST_META_CONTEXT and SET_META_CONTEXT (the `base:allocation` context
//! only), and the transmission phase with simple and structured replies. Everything else
//! (extended headers, other metadata namespaces) is answered with
//! `NBD_REP_ERR_UNSUP` or simply not selected, as the spec requires of a server that does
//! not know it.
#![forbid(unsafe_code)]

mod bytes;
pub mod export;
#[doc(hidden)]
pub mod fuzz_api;
pub mod handshake;
pub mod transmission;

pub use export::{ExportDesc, HandshakeConfig, TlsPolicy};
pub use handshake::{Handshake, Session, Step};
pub use transmission::{check_request, error_of, parse_request, Cmd, CmdFlags, Request};

// Magic numbers, all sent big-endian like every NBD integer.

/// `NBDMAGIC`, the first eight bytes a server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: in the greeting it announces newstyle negotiation; it also starts every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Starts every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Starts every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Starts a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Starts a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags the server sends in the greeting.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags, the client's answer to the greeting. Any other bit closes the connection.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flags: what the server tells the client about one export.
pub mod tflags {
    /// Always set.
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    /// READ honours `NBD_CMD_FLAG_DF`; only with structured replies.
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    pub const SEND_RESIZE: u16 = 1 << 9;
    pub const SEND_CACHE: u16 = 1 << 10;
    /// WRITE_ZEROES honours `NBD_CMD_FLAG_FAST_ZERO`; only with SEND_WRITE_ZEROES.
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

// Sizes and limits. Every length a client sends is checked against one of these before
// anything is buffered or allocated.

/// Longest string the spec allows: export names, descriptions, queries, error messages.
pub const STRING_MAX: usize = 4096;
/// Most exports one handshake offers; bounds the size of a LIST reply.
pub const EXPORTS_MAX: usize = 1024;
/// Bytes of an option header: magic, option, length.
pub const OPTION_HEADER_LEN: usize = 16;
/// Largest option payload the handshake waits for and parses. A legitimate option is far
/// smaller: GO carries one name of at most [`STRING_MAX`] bytes and a short list of info
/// requests; SET_META_CONTEXT a name and a few queries.
pub const OPTION_LEN_MAX: u32 = 64 * 1024;
/// Largest amount of unconsumed input the handshake ever waits on. The driver's receive
/// buffer must hold at least this much during the handshake, or a legal option could never
/// complete.
pub const HANDSHAKE_INPUT_MAX: usize = OPTION_HEADER_LEN + OPTION_LEN_MAX as usize;
/// Bytes of oversized options one handshake will skip before it disconnects the client.
pub const OPTION_DISCARD_BYTES_MAX: u64 = 1 << 20;
/// Options one handshake accepts. Real clients send fewer than ten; a client still haggling
/// past this is not going to finish.
pub const OPTIONS_MAX: u32 = 1024;
/// Bytes of a request header.
pub const REQUEST_LEN: usize = 28;
/// Bytes of a simple reply (read data, if any, follows).
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Bytes of a structured reply chunk header (the payload follows).
pub const CHUNK_HEADER_LEN: usize = 20;
/// The largest READ or WRITE payload a client that did not agree to block sizes may send: the
/// spec's default maximum (at least 2^25 bytes). Such a client may also use any byte
/// alignment.
pub const DEFAULT_PAYLOAD_MAX: u32 = 1 << 25;
/// A WRITE payload shorter than this is never treated as a denial of service (the spec's
/// portability floor, 32 MiB), even when it exceeds the export's `block_max`: the driver
/// discards it and answers `EINVAL`. Above both, the driver may disconnect instead.
pub const WRITE_LEN_TOLERATED: u32 = 1 << 25;

/// Why a connection cannot go on. Every variant means "disconnect"; the replies already
/// appended to the output buffer are complete messages and may be flushed first.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NbdError {
    #[error("client flags {0:#x} set bits this server does not know")]
    UnknownClientFlags(u32),
    #[error("option magic is {0:#018x}, not IHAVEOPT")]
    BadOptionMagic(u64),
    /// EXPORT_NAME cannot be refused with a reply, so an unknown name ends the connection.
    #[error("EXPORT_NAME for unknown export {0:?}")]
    UnknownExport(String),
    #[error("EXPORT_NAME of {0} bytes, longer than any export name")]
    ExportNameTooLong(u32),
    #[error("more than {max} options in one handshake", max = OPTIONS_MAX)]
    TooManyOptions,
    #[error("option {option} declares {len} bytes, past the discard budget")]
    OptionTooLarge { option: u32, len: u32 },
    #[error("the handshake already finished")]
    HandshakeFinished,
    #[error("request magic is {0:#010x}, not {REQUEST_MAGIC:#010x}")]
    BadRequestMagic(u32),
    #[error("export {index}: {reason}")]
    BadExport { index: usize, reason: &'static str },
    #[error("handshake config: {0}")]
    BadConfig(&'static str),
    /// TLS is required and the client sent EXPORT_NAME in plaintext (which cannot be refused
    /// with a reply).
    #[error("EXPORT_NAME before STARTTLS on a TLS-only server")]
    TlsRequired,
    /// The client sent more bytes after NBD_OPT_STARTTLS, before the TLS handshake.
    #[error("{0} bytes after NBD_OPT_STARTTLS, before the TLS handshake")]
    DataAfterStartTls(usize),
}
