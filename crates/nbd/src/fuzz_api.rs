//! Entry points for fuzz targets and the seeded smoke test. Not part of the stable API.
//!
//! Each entry point takes arbitrary bytes and panics only when an invariant breaks: the
//! handshake must give the same replies and outcome whether its input arrives whole or one
//! byte at a time, must never wait on more than [`HANDSHAKE_INPUT_MAX`] bytes, and every
//! request that parses must be checkable, mappable and answerable in both reply styles.

use std::sync::Arc;

use wire::Status;

use crate::handshake::{Handshake, Session, Step};
use crate::transmission::{self as tx, Cmd, CHUNK_DATA_MAX};
use crate::{
    check_request, error_of, parse_request, ExportDesc, HandshakeConfig, NbdError, TlsPolicy,
    CHUNK_HEADER_LEN, HANDSHAKE_INPUT_MAX, REQUEST_LEN, SIMPLE_REPLY_LEN,
};

/// Client bytes for a handshake (and, if it finishes, the transmission phase after it).
pub fn fuzz_handshake(data: &[u8]) {
    let Some(plain) = fuzz_config() else { return };
    for tls in [TlsPolicy::Off, TlsPolicy::On, TlsPolicy::Require] {
        let config = Arc::new(HandshakeConfig::clone(&plain).with_tls(tls));
        let whole = run_handshake(&config, data, usize::MAX);
        let bytewise = run_handshake(&config, data, 1);
        // Bytes pipelined behind STARTTLS are caught only when they arrive with it: the one
        // outcome that depends on the split, by the protocol's nature.
        if !matches!(whole.end, End::Failed(NbdError::DataAfterStartTls(_))) {
            assert_eq!(whole, bytewise, "the outcome depends on how the input was split");
        }
        if let End::Done { consumed, session } = bytewise.end {
            fuzz_transmission(data.get(consumed..).unwrap_or_default(), &session);
        }
    }
}

/// Client bytes in the transmission phase, tried against several negotiated sessions.
pub fn fuzz_request(data: &[u8]) {
    for session in fuzz_sessions() {
        fuzz_transmission(data, &session);
    }
}

/// Everything a handshake said and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transcript {
    /// Replies after the greeting.
    pub replies: Vec<u8>,
    pub end: End,
}

/// How a handshake ended; `consumed` counts client bytes from the start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    NeedMore { consumed: usize },
    Done { consumed: usize, session: Session },
    Close { consumed: usize },
    Failed(NbdError),
}

/// Drive a handshake the way a driver would, with `client` arriving `piece_len` bytes at a
/// time and unconsumed bytes kept for the next call.
pub fn run_handshake(config: &Arc<HandshakeConfig>, client: &[u8], piece_len: usize) -> Transcript {
    let mut handshake = Handshake::new(Arc::clone(config));
    let mut replies = Vec::new();
    let (mut consumed, mut arrived) = (0usize, 0usize);
    loop {
        arrived = arrived.saturating_add(piece_len.max(1)).min(client.len());
        let input = client.get(consumed..arrived).unwrap_or_default();
        let end = match handshake.handle(input, &mut replies) {
            Ok(Step::NeedMore { consumed: n }) => {
                assert!(n <= input.len(), "consumed {n} of {} bytes", input.len());
                consumed += n;
                assert!(arrived - consumed < HANDSHAKE_INPUT_MAX, "waiting on an unbounded message");
                if arrived < client.len() {
                    continue;
                }
                End::NeedMore { consumed }
            }
            Ok(Step::Done { consumed: n, session }) => {
                assert!(n <= input.len());
                End::Done { consumed: consumed + n, session }
            }
            Ok(Step::Close { consumed: n }) => {
                assert!(n <= input.len());
                End::Close { consumed: consumed + n }
            }
            Ok(Step::StartTls { consumed: n }) => {
                // Nothing may follow STARTTLS unread; the bytes after it stand for what the
                // TLS layer decrypts once the driver has upgraded.
                assert_eq!(n, input.len(), "STARTTLS acknowledged with bytes behind it");
                assert!(handshake.tls_active());
                consumed += n;
                continue;
            }
            Err(e) => End::Failed(e),
        };
        if !matches!(end, End::NeedMore { .. }) {
            let again = handshake.handle(&[], &mut Vec::new());
            assert_eq!(again, Err(NbdError::HandshakeFinished), "a finished handshake accepted more");
        }
        return Transcript { replies, end };
    }
}

/// Parse requests until the input runs out or breaks, answering each as a driver would.
fn fuzz_transmission(mut data: &[u8], session: &Session) {
    let mut out = Vec::new();
    while let Ok(Some((req, header_len))) = parse_request(data) {
        assert_eq!(header_len, REQUEST_LEN);
        out.clear();
        match check_request(&req, session) {
            Err(error) => {
                assert!(error != 0);
                tx::error_reply(&mut out, session, req.cookie, error, "refused");
            }
            Ok(()) => answer_every_way(&mut out, &req, session),
        }
        if req.cmd == Cmd::Disc {
            return;
        }
        // Skip the WRITE payload, as the driver would.
        let next = header_len.saturating_add(req.payload_len() as usize);
        data = data.get(next..).unwrap_or_default();
    }
}

fn answer_every_way(out: &mut Vec<u8>, req: &tx::Request, session: &Session) {
    const STATUSES: [Status; 18] = [
        Status::Ok,
        Status::Invalid,
        Status::OutOfRange,
        Status::Misaligned,
        Status::TooLarge,
        Status::ReadOnly,
        Status::UnknownOpcode,
        Status::BadHandle,
        Status::Unsupported,
        Status::IoError,
        Status::NoSpace,
        Status::NotFound,
        Status::VersionMismatch,
        Status::TooManyOpen,
        Status::TimedOut,
        Status::ShuttingDown,
        Status::Other(0),
        Status::Other(u16::MAX),
    ];
    const ERRNOS: [u32; 7] =
        [tx::EPERM, tx::EIO, tx::EINVAL, tx::ENOSPC, tx::EOVERFLOW, tx::ENOTSUP, tx::ESHUTDOWN];
    for status in STATUSES {
        let error = error_of(status, req.cmd, req.flags);
        assert_eq!(error == 0, status.is_ok(), "{status:?}");
        assert!(error == 0 || ERRNOS.contains(&error), "{status:?} gave {error}");
    }
    let before = out.len();
    tx::simple_reply(out, req.cookie, 0);
    assert_eq!(out.len() - before, SIMPLE_REPLY_LEN);
    if !session.structured_replies {
        return;
    }
    let before = out.len();
    if (1..=CHUNK_DATA_MAX).contains(&req.length) {
        tx::chunk_offset_data_header(out, req.cookie, false, req.offset, req.length);
        tx::chunk_offset_hole(out, req.cookie, false, req.offset, req.length);
        tx::chunk_error_offset(out, req.cookie, false, tx::EIO, "read failed", req.offset);
    }
    if let Some(id) = session.base_allocation_id {
        tx::chunk_block_status(out, req.cookie, false, id, &[(req.length.max(1), tx::STATE_HOLE)]);
    }
    tx::chunk_error(out, req.cookie, tx::EIO, "");
    tx::chunk_none(out, req.cookie);
    assert!(out.len() - before >= 2 * CHUNK_HEADER_LEN);
}

/// Two exports with different shapes: a writable default with every capability, and a small
/// read-only one with block-size constraints.
pub fn fuzz_config() -> Option<Arc<HandshakeConfig>> {
    let disk = ExportDesc {
        description: "scratch disk".into(),
        can_flush: true,
        can_fua: true,
        can_trim: true,
        can_write_zeroes: true,
        can_fast_zero: true,
        can_cache: true,
        can_multi_conn: true,
        ..ExportDesc::new("disk", 1 << 30)
    };
    let ro = ExportDesc {
        block_min: 512,
        block_preferred: 4096,
        block_max: 1 << 20,
        read_only: true,
        ..ExportDesc::new("ro", 1 << 20)
    };
    HandshakeConfig::new(vec![disk, ro], Some(0)).ok().map(Arc::new)
}

fn fuzz_sessions() -> Vec<Session> {
    let Some(config) = fuzz_config() else { return Vec::new() };
    let session = |export_index: usize, structured_replies: bool| Session {
        export_index,
        structured_replies,
        base_allocation_id: structured_replies.then_some(crate::handshake::BASE_ALLOCATION_ID),
        transmission_flags: config
            .exports()
            .get(export_index)
            .map_or(0, |e| e.transmission_flags(structured_replies)),
        sizes_agreed: structured_replies,
    };
    vec![session(0, false), session(0, true), session(1, true)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fuzz_config_is_valid() {
        assert!(fuzz_config().is_some());
        assert_eq!(fuzz_sessions().len(), 3);
    }

    #[test]
    fn empty_and_tiny_inputs() {
        fuzz_handshake(&[]);
        fuzz_handshake(&[0, 0, 0, 3]);
        fuzz_request(&[]);
        fuzz_request(&[0x25, 0x60, 0x95, 0x13]);
    }
}
