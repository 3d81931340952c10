//! The probe's one error type.

use std::io;

use crate::shape::ShapeError;

#[derive(Debug)]
pub enum ProbeError {
    /// A syscall or ring operation failed; `op` names it.
    Io { op: &'static str, source: io::Error },
    /// The kernel (or the io-uring crate) cannot run this mode; the text says why.
    Unavailable(String),
    /// A frame did not parse: bytes were lost, duplicated or reordered.
    Shape(ShapeError),
    /// A frame parsed but carried the wrong sequence, tag or data.
    Corrupt(String),
}

impl ProbeError {
    pub fn io(op: &'static str) -> impl FnOnce(io::Error) -> ProbeError {
        move |source| ProbeError::Io { op, source }
    }

    /// A completion's negative `res`, as an error of `op`.
    pub fn errno(op: &'static str, res: i32) -> ProbeError {
        ProbeError::Io { op, source: io::Error::from_raw_os_error(-res) }
    }
}

impl std::fmt::Display for ProbeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProbeError::Io { op, source } => write!(f, "{op}: {source}"),
            ProbeError::Unavailable(why) => write!(f, "not available: {why}"),
            ProbeError::Shape(e) => write!(f, "malformed frame: {e}"),
            ProbeError::Corrupt(what) => write!(f, "corrupt stream: {what}"),
        }
    }
}

impl std::error::Error for ProbeError {}

impl From<ShapeError> for ProbeError {
    fn from(e: ShapeError) -> ProbeError {
        ProbeError::Shape(e)
    }
}
