//! Status codes carried by completions and control replies.
//!
//! One table for the whole protocol: the engine maps every refusal and backend error to one of
//! these, and the initiator maps them back to errors. Unknown codes received from a newer peer
//! are kept as [`Status::Other`] rather than rejected.

/// The outcome of one request or control operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    Ok,
    /// Malformed request: bad flags, payload length not matching the opcode, zero length.
    Invalid,
    /// The range reaches past the end of the export.
    OutOfRange,
    /// Offset or length not a multiple of the export's block size.
    Misaligned,
    /// Length larger than the negotiated largest I/O.
    TooLarge,
    /// A write, trim or write-zeroes on a read-only export.
    ReadOnly,
    UnknownOpcode,
    /// The export handle was never opened on this connection.
    BadHandle,
    /// The backend cannot do this (e.g. trim on a device without discard).
    Unsupported,
    /// The backend reported an I/O error.
    IoError,
    /// The backend ran out of space.
    NoSpace,
    /// No export by that name.
    NotFound,
    /// No protocol version in common.
    VersionMismatch,
    /// Too many exports open on one connection.
    TooManyOpen,
    /// The connection was closed for silence: its handshake did not finish, or it sent
    /// nothing, within the target's timeout (`GOAWAY`).
    TimedOut,
    /// The target is shutting down (`GOAWAY`); an initiator may reconnect once it is back.
    ShuttingDown,
    /// The export needs a key and the initiator gave none (`OPEN_REPLY`).
    AuthRequired,
    /// Authentication failed: an unknown key, or a wrong proof (`AUTH_REPLY`; which of the two is
    /// not said).
    AuthFailed,
    /// The key may not open this export, or not with the rights asked for.
    AccessDenied,
    /// The listener takes TLS only and the peer's first frame came in plaintext (`GOAWAY`).
    TlsRequired,
    /// A direct read's capability is no longer valid (expired, key epoch rotated, cache slot
    /// evicted or invalidated): a recoverable fault, the initiator reads the ordinary way.
    StaleCapability,
    /// A direct read's capability is not one this target sealed (forged or altered), names
    /// another export, lacks the read right, or does not cover the request: never served.
    BadCapability,
    /// The name is taken: a volume (or an export) of that name exists already (`VOLUME_REPLY`).
    Exists,
    /// The volume is in use and cannot be deleted: connections have it open, or snapshots or
    /// clones depend on it (`VOLUME_REPLY`).
    Busy,
    /// A code this implementation does not know.
    Other(u16),
}

impl Status {
    pub fn to_u16(self) -> u16 {
        match self {
            Status::Ok => 0,
            Status::Invalid => 1,
            Status::OutOfRange => 2,
            Status::Misaligned => 3,
            Status::TooLarge => 4,
            Status::ReadOnly => 5,
            Status::UnknownOpcode => 6,
            Status::BadHandle => 7,
            Status::Unsupported => 8,
            Status::IoError => 9,
            Status::NoSpace => 10,
            Status::NotFound => 11,
            Status::VersionMismatch => 12,
            Status::TooManyOpen => 13,
            Status::TimedOut => 14,
            Status::ShuttingDown => 15,
            Status::AuthRequired => 16,
            Status::AuthFailed => 17,
            Status::AccessDenied => 18,
            Status::TlsRequired => 19,
            Status::StaleCapability => 20,
            Status::BadCapability => 21,
            Status::Exists => 22,
            Status::Busy => 23,
            Status::Other(v) => v,
        }
    }

    pub fn from_u16(v: u16) -> Status {
        match v {
            0 => Status::Ok,
            1 => Status::Invalid,
            2 => Status::OutOfRange,
            3 => Status::Misaligned,
            4 => Status::TooLarge,
            5 => Status::ReadOnly,
            6 => Status::UnknownOpcode,
            7 => Status::BadHandle,
            8 => Status::Unsupported,
            9 => Status::IoError,
            10 => Status::NoSpace,
            11 => Status::NotFound,
            12 => Status::VersionMismatch,
            13 => Status::TooManyOpen,
            14 => Status::TimedOut,
            15 => Status::ShuttingDown,
            16 => Status::AuthRequired,
            17 => Status::AuthFailed,
            18 => Status::AccessDenied,
            19 => Status::TlsRequired,
            20 => Status::StaleCapability,
            21 => Status::BadCapability,
            22 => Status::Exists,
            23 => Status::Busy,
            other => Status::Other(other),
        }
    }

    /// A short snake_case name, stable across releases: for logs and metric labels. Codes
    /// this implementation does not know are all `other`.
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Invalid => "invalid",
            Status::OutOfRange => "out_of_range",
            Status::Misaligned => "misaligned",
            Status::TooLarge => "too_large",
            Status::ReadOnly => "read_only",
            Status::UnknownOpcode => "unknown_opcode",
            Status::BadHandle => "bad_handle",
            Status::Unsupported => "unsupported",
            Status::IoError => "io_error",
            Status::NoSpace => "no_space",
            Status::NotFound => "not_found",
            Status::VersionMismatch => "version_mismatch",
            Status::TooManyOpen => "too_many_open",
            Status::TimedOut => "timed_out",
            Status::ShuttingDown => "shutting_down",
            Status::AuthRequired => "auth_required",
            Status::AuthFailed => "auth_failed",
            Status::AccessDenied => "access_denied",
            Status::TlsRequired => "tls_required",
            Status::StaleCapability => "stale_capability",
            Status::BadCapability => "bad_capability",
            Status::Exists => "exists",
            Status::Busy => "busy",
            Status::Other(_) => "other",
        }
    }

    pub fn is_ok(self) -> bool {
        self == Status::Ok
    }

    /// The errno a POSIX caller (the C API, an NBD reply) would expect for this status.
    pub fn errno(self) -> i32 {
        // Values from Linux's asm-generic/errno-base.h and errno.h; wire has no libc.
        match self {
            Status::Ok => 0,
            Status::Invalid | Status::Misaligned | Status::BadHandle => 22, // EINVAL
            Status::OutOfRange => 22,                                       // EINVAL
            Status::TooLarge => 75,                                         // EOVERFLOW
            Status::ReadOnly => 1,                                          // EPERM
            Status::UnknownOpcode | Status::Unsupported => 95,              // EOPNOTSUPP
            Status::IoError | Status::Other(_) => 5,                        // EIO
            Status::NoSpace => 28,                                          // ENOSPC
            Status::NotFound => 2,                                          // ENOENT
            Status::VersionMismatch => 71,                                  // EPROTO
            Status::TooManyOpen => 24,                                      // EMFILE
            Status::TimedOut => 110,                                        // ETIMEDOUT
            Status::ShuttingDown => 108,                                    // ESHUTDOWN
            Status::AuthRequired | Status::AuthFailed | Status::AccessDenied => 13, // EACCES
            Status::TlsRequired => 71,                                      // EPROTO
            Status::StaleCapability => 116,                                 // ESTALE
            Status::BadCapability => 13,                                    // EACCES
            Status::Exists => 17,                                           // EEXIST
            Status::Busy => 16,                                             // EBUSY
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = match self {
            Status::Ok => "ok",
            Status::Invalid => "invalid request",
            Status::OutOfRange => "out of range",
            Status::Misaligned => "misaligned to the block size",
            Status::TooLarge => "larger than the largest I/O",
            Status::ReadOnly => "read-only export",
            Status::UnknownOpcode => "unknown opcode",
            Status::BadHandle => "export handle not open",
            Status::Unsupported => "not supported by the export",
            Status::IoError => "I/O error",
            Status::NoSpace => "no space",
            Status::NotFound => "no such export",
            Status::VersionMismatch => "no common protocol version",
            Status::TooManyOpen => "too many exports open",
            Status::TimedOut => "timed out",
            Status::ShuttingDown => "target shutting down",
            Status::AuthRequired => "a key is required",
            Status::AuthFailed => "authentication failed (unknown or wrong key)",
            Status::AccessDenied => "access denied to this key",
            Status::TlsRequired => "TLS required",
            Status::StaleCapability => "stale capability",
            Status::BadCapability => "capability refused",
            Status::Exists => "the name is taken",
            Status::Busy => "in use",
            Status::Other(v) => return write!(f, "status {v}"),
        };
        f.write_str(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips() {
        for v in 0..=23u16 {
            assert_eq!(Status::from_u16(v).to_u16(), v);
        }
        assert_eq!(Status::from_u16(999), Status::Other(999));
    }

    #[test]
    fn names_are_distinct_for_known_codes() {
        let names: std::collections::HashSet<_> = (0..=15u16).map(|v| Status::from_u16(v).name()).collect();
        assert_eq!(names.len(), 16);
        assert!(!names.contains("other"));
        assert_eq!(Status::from_u16(999).name(), "other");
    }
}
