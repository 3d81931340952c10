//! The client session under a hostile target, for `cargo fuzz` (fuzz/fuzz_targets/
//! client_session.rs) and the seeded smoke test. Not part of the stable API.
//!
//! A session with a fuzzed configuration sends a fuzzed mix of requests; then the fuzz input,
//! as a stream of frames (mostly completion caravans with correct headers and fuzzed
//! descriptors and data, some GOAWAYs, other kinds and raw garbage), arrives in fuzzed pieces,
//! part of it through the direct-placement path. Whatever arrives: no panic, every request
//! completes exactly once (after the connection is closed at the latest) with its buffer back
//! at its own length, and a session that reports an error has failed for good.

use std::io::{IoSlice, IoSliceMut};

use wire::fuzz_api::{next_frame, Input};
use wire::{FrameBuffer, FrameKind, Limits, Opcode, ReqFlags};

use crate::caravan::Doorbell;
use crate::client::{Batching, ClientSession, SessionConfig, Submission, DIRECT_OFF};

/// What a hostile target sends: mostly completions.
const TARGET_KINDS: [FrameKind; 6] = [
    FrameKind::Completions,
    FrameKind::Completions,
    FrameKind::Completions,
    FrameKind::Completions,
    FrameKind::GoAway,
    FrameKind::StatsReply,
];

pub fn client_session(data: &[u8]) {
    let mut input = Input(data);
    let flags = input.byte();
    let chunk = 1 + input.byte() as usize * 7;
    let config = SessionConfig {
        doorbell: Doorbell { aggregation_reqs: 1 + u32::from(flags % 4), ..Doorbell::default() },
        batching: if flags & 0x10 != 0 { Batching::Off } else { Batching::Static },
        direct_min_bytes: if flags & 0x20 != 0 { 0 } else { DIRECT_OFF },
        directory_entries: if flags & 0x40 != 0 { 64 } else { 0 },
    };
    let limits =
        Limits { queue_depth: 16, caravan_reqs_max: 8, caravan_bytes_max: 16384, io_bytes_max: 8192 };
    let mut s = ClientSession::<Vec<u8>>::new(&config, limits, 0);
    // Read data in data messages: completion frames end after their descriptors, and pieces
    // of the input also go to `place` as data-message payloads.
    let data_messages = flags & 0x80 != 0;
    s.set_data_messages(data_messages);
    let mut lengths = Vec::new();
    for i in 0..1 + u64::from(input.byte() % 16) {
        let (opcode, length) = match input.byte() % 5 {
            0 => (Opcode::Read, 512),
            1 => (Opcode::Read, 4096),
            2 => (Opcode::Write, 512),
            3 => (Opcode::Flush, 0),
            _ => (Opcode::WriteZeroes, 1024),
        };
        let buf = matches!(opcode, Opcode::Read | Opcode::Write).then(|| vec![0x11; length]);
        let sub =
            Submission { opcode, flags: ReqFlags::empty(), offset: i * 4096, length, buf, user_data: i };
        assert!(s.submit(i, sub).is_ok(), "the session refused a request it can frame");
        lengths.push(length);
    }
    s.commit();
    while s.has_transmit() {
        let mut iov = [IoSlice::new(&[]); 64];
        let n = s.poll_transmit(&mut iov);
        let sent: usize = iov[..n].iter().map(|b| b.len()).sum();
        s.handle_sent(sent);
    }
    let mut stream = Vec::new();
    while let Some(frame) = next_frame(&mut input, &TARGET_KINDS) {
        stream.extend(frame);
    }
    let mut rx = FrameBuffer::with_capacity(16 << 10);
    let mut done = Vec::new();
    let mut rest = &stream[..];
    while !rest.is_empty() && !s.is_broken() && !s.is_detached() {
        let (piece, after) = rest.split_at(chunk.min(rest.len()));
        rest = after;
        if data_messages && piece.first().is_some_and(|b| b & 1 == 1) {
            s.place(piece);
        }
        let placed = place(&mut s, piece);
        rx.extend(&piece[placed..]);
        match s.handle_rx(0, rx.unconsumed()) {
            Ok(p) => {
                rx.consume(p.consumed);
                if p.need > 0 {
                    rx.reserve(p.need);
                }
            }
            Err(_) => assert!(s.is_detached(), "an error that did not detach the session"),
        }
        s.take_completions(&mut done);
    }
    s.handle_closed();
    s.take_completions(&mut done);
    assert_eq!(s.in_flight(), 0);
    let mut seen = vec![false; lengths.len()];
    for c in &done {
        let i = c.user_data as usize;
        assert!(!std::mem::replace(&mut seen[i], true), "request {i} completed twice");
        let buf_len = c.buf.as_ref().map(Vec::len);
        let want = matches!(c.opcode, Opcode::Read | Opcode::Write).then_some(lengths[i]);
        assert_eq!(buf_len, want, "request {i} came back with the wrong buffer");
    }
    assert!(seen.iter().all(|&s| s), "a request never completed");
}

/// Receive `piece` the way a driver placing directly would: into the destinations the session
/// names first. Returns how many bytes went there.
fn place(s: &mut ClientSession<Vec<u8>>, piece: &[u8]) -> usize {
    let mut iov: [IoSliceMut<'_>; 16] = std::array::from_fn(|_| IoSliceMut::new(&mut []));
    let (n, _) = s.recv_destinations(&mut iov);
    let mut placed = 0;
    for d in iov[..n].iter_mut() {
        let k = d.len().min(piece.len() - placed);
        d[..k].copy_from_slice(&piece[placed..placed + k]);
        placed += k;
    }
    s.handle_placed(placed);
    placed
}

/// Capabilities from fuzzer bytes (target `capability`): the first byte picks the check.
///
/// - 0: bytes as one capability: decodes only at exactly 56 bytes with a known kind and rights,
///   and re-encodes to the same bytes; checked under a key, it is refused as forged (a fuzzer
///   does not find BLAKE3 MACs), and the same fields sealed under that key pass every check
///   they should and no other.
/// - 1: bytes as a `CAPABILITIES` body: decodes only when its count matches its length, and
///   re-encodes to the same bytes.
/// - 2: a sealed capability with fuzzed bytes XORed over it: if it still decodes and is not
///   the original, it is refused.
pub fn capability(data: &[u8]) {
    use crate::capability::{CapFault, CapKey};
    use wire::Capability;
    let Some((&which, rest)) = data.split_first() else { return };
    let key = CapKey::new([0x5A; crate::capability::KEY_LEN]);
    match which % 3 {
        0 => {
            let Ok(cap) = Capability::decode(rest) else { return };
            assert_eq!(&cap.encode()[..], rest);
            let check = |c: &Capability| key.check(c, c.export, c.epoch, 0, c.offset, c.length.max(1));
            if cap != key.seal(cap) {
                assert_eq!(check(&cap), Err(CapFault::Forged));
            }
            let sealed = key.seal(cap);
            let outcome = check(&sealed);
            let expect = if !sealed.rights.contains(wire::CapRights::READ) {
                Err(CapFault::NoRight)
            } else if !sealed.covers(sealed.offset, sealed.length.max(1)) {
                Err(CapFault::NotCovered)
            } else if sealed.expires_ms == 0 {
                Err(CapFault::Expired)
            } else {
                Ok(())
            };
            assert_eq!(outcome, expect);
        }
        1 => {
            let mut caps = Vec::new();
            if Capability::decode_list(rest, |c| caps.push(c)).is_ok() {
                let mut out = Vec::new();
                Capability::encode_list(&caps, &mut out);
                assert_eq!(out, rest);
            }
        }
        _ => {
            let original = key.seal(Capability {
                export: 1,
                kind: wire::CapKind::Slot,
                rights: wire::CapRights::READ,
                epoch: 2,
                generation: 4,
                offset: 8192,
                length: 4096,
                slot: 9,
                expires_ms: 1_000,
                mac: [0; 16],
            });
            let mut bytes = original.encode();
            for (b, x) in bytes.iter_mut().zip(rest) {
                *b ^= x;
            }
            if let Ok(altered) = Capability::decode(&bytes) {
                let verdict = key.check(&altered, 1, 2, 0, 8192, 4096);
                if altered == original {
                    assert_eq!(verdict, Ok(()));
                } else {
                    assert_eq!(verdict, Err(CapFault::Forged));
                }
            }
        }
    }
}

/// Key files and access lists from fuzzer bytes (target `keys`): the first byte picks which.
/// No panic; a key file that parses has only valid names, secrets of allowed lengths and no
/// name twice; an access list that parses prints back to a string that parses to the same.
pub fn keys(data: &[u8]) {
    use crate::auth::{valid_name, AccessList, Key, SECRET_MAX_BYTES};
    let Some((&which, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    if which % 2 == 0 {
        if let Ok(keys) = Key::parse_file(text) {
            for (i, k) in keys.iter().enumerate() {
                assert!(valid_name(&k.name));
                assert!(keys[..i].iter().all(|o| o.name != k.name));
                assert!(Key::new(&k.name, &[0; SECRET_MAX_BYTES + 1]).is_err());
            }
        }
    } else if let Ok(list) = AccessList::parse(text) {
        assert_eq!(AccessList::parse(&list.to_string()).as_ref(), Ok(&list));
    }
}
