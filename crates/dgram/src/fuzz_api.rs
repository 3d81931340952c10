//! The datagram stack under hostile input, for `cargo fuzz` (fuzz/fuzz_targets/datagram.rs and
//! bundle.rs) and the seeded smoke tests (tests/fuzz_smoke.rs). Not part of the stable API.

use std::io::{IoSlice, IoSliceMut};

use wire::fuzz_api::Input;

/// The datagram header and a [`DatagramStream`](crate::reliable::DatagramStream) under a
/// hostile or broken network, for `cargo fuzz` (fuzz/fuzz_targets/datagram.rs) and the seeded
/// smoke test.
///
/// The whole input is first parsed as one datagram: what parses re-emits to the same bytes.
/// Then a stream with a configuration from the first byte runs against an honest peer, the
/// input choosing each move: writes and reads on either side, time passing, the two exchanging
/// datagrams (some dropped, some duplicated, some altered), and forged datagrams of the same
/// session with fuzzed fields and a correct checksum. Whatever arrives: no panic; every datagram
/// the stream emits parses, belongs to its session and fits its configured size; its bytes in
/// flight never exceed its send buffer; a dead stream sends nothing (after its Reset) and asks
/// for no timer; and while nothing forged carried data, the bytes read are exactly the peer's
/// bytes, in order, once.
pub fn reliable_stream(data: &[u8]) {
    use crate::reliable::{DatagramStream, ReadCursor, ReliableConfig, State};
    use wire::datagram::{flags, DatagramHeader, DatagramKind, DATAGRAM_HEADER_LEN};

    if let Ok((h, payload)) = DatagramHeader::parse(data) {
        if h.kind == DatagramKind::Place {
            // Segments parse until the first bad one; a good one re-emits to its bytes.
            let mut at = 0;
            let (segments, _) =
                wire::datagram::split_place_payload(h.flags, payload).expect("checked by parse");
            for seg in wire::datagram::PlaceSegment::parse_all(segments) {
                let Ok(seg) = seg else { break };
                let mut head = [0u8; wire::datagram::PLACE_SEGMENT_HEADER_LEN];
                wire::datagram::PlaceSegment::emit_header(
                    seg.tag,
                    seg.offset,
                    seg.bytes.len() as u32,
                    &mut head,
                );
                assert_eq!(head[..], payload[at..at + head.len()], "a segment header re-emits to its bytes");
                at += head.len() + seg.bytes.len();
            }
        }
        let mut out = vec![0u8; h.datagram_len()];
        out[DATAGRAM_HEADER_LEN..].copy_from_slice(payload);
        h.emit(&mut out);
        assert_eq!(out[..], data[..h.datagram_len()], "a parsed datagram re-emits to its bytes");
    }

    let mut input = Input(data);
    let shape = input.byte();
    let config = ReliableConfig {
        payload_bytes_max: 1 + u16::from(shape & 0x3) * 40,
        send_slots: 1 << ((shape >> 2) & 3),
        recv_slots: 1 << ((shape >> 4) & 3),
        peer_window_initial: u16::from(input.byte() % 16),
        ack_every: 1 + u32::from(shape >> 6),
        keepalive_us: if input.byte() & 1 == 0 { 0 } else { 2_000 },
        ..ReliableConfig::default()
    };
    let session = 0x5e55;
    let (isn_a, isn_b) = (u32::MAX - u32::from(input.byte()), u32::from(input.byte()));
    let mut ends = [
        DatagramStream::new(&config, session, isn_a, isn_b),
        DatagramStream::new(&config, session, isn_b, isn_a),
    ];
    let pattern = |side: usize, at: u64| (at.wrapping_mul(7) ^ (at >> 8) ^ (side as u64 * 0x33)) as u8;
    let mut written = [0u64; 2];
    let mut read = [0u64; 2];
    let mut forged_data = false;
    // Data messages each side queued (their tags count up from 0), and which tags each side
    // was handed: each once, and only what the peer queued.
    let mut places_written = [0u32; 2];
    let mut places_seen: [Vec<bool>; 2] = [Vec::new(), Vec::new()];
    let check_place = |payload: &[u8], side: usize, seen: &mut [Vec<bool>; 2], written: &[u32; 2]| {
        for seg in wire::datagram::PlaceSegment::parse_all(payload) {
            let seg = seg.expect("a stream emits well-formed segments");
            assert!(seg.tag < written[1 - side], "a data message the peer never queued");
            let tag = seg.tag as usize;
            if seen[side].len() <= tag {
                seen[side].resize(tag + 1, false);
            }
            assert!(!std::mem::replace(&mut seen[side][tag], true), "a data message handed over twice");
        }
    };
    // Bytes `side` read: the peer's, in order, once (unless something forged carried data).
    let check_read = |got: &[u8], side: usize, read: &mut [u64; 2], written: &[u64; 2], forged: bool| {
        if !forged {
            for (i, &byte) in got.iter().enumerate() {
                assert_eq!(byte, pattern(1 - side, read[side] + i as u64), "stream byte out of order");
            }
            assert!(read[side] + got.len() as u64 <= written[1 - side], "read more than the peer wrote");
        }
        read[side] += got.len() as u64;
    };
    let mut now = 0u64;
    let mut buf = vec![0u8; config.datagram_len_max()];
    // Datagrams on their way to each side.
    let mut wire: [Vec<Vec<u8>>; 2] = [Vec::new(), Vec::new()];
    while !input.is_empty() {
        let op = input.byte();
        let side = usize::from(op >> 7);
        match op % 8 {
            0 => {
                let n = usize::from(input.byte());
                if n >= 0xf0 {
                    // A data message of the next tag instead (batched or not).
                    let len = 1 + n % 8;
                    let tag = places_written[side];
                    if ends[side].write_place(tag, 0, &vec![0x5a; len], n & 1 == 0) {
                        places_written[side] += 1;
                    }
                } else {
                    let bytes: Vec<u8> = (0..n as u64).map(|i| pattern(side, written[side] + i)).collect();
                    written[side] += ends[side].write(&[IoSlice::new(&bytes)]) as u64;
                }
            }
            1 => {
                let mut got = vec![0u8; usize::from(input.byte())];
                let cut = usize::from(input.byte()).min(got.len());
                let (a, b) = got.split_at_mut(cut);
                let mut pieces = [IoSliceMut::new(a), IoSliceMut::new(b)];
                let n = if cut % 2 == 0 {
                    let mut place = |p: &[u8]| check_place(p, side, &mut places_seen, &places_written);
                    ends[side].read_into(&mut ReadCursor::placing(&mut pieces, &mut place))
                } else {
                    ends[side].read(&mut pieces)
                };
                check_read(&got[..n], side, &mut read, &written, forged_data);
            }
            2 => {
                now += u64::from(input.u16());
                for end in &mut ends {
                    end.handle_timeout(now);
                }
            }
            3 => {
                // The network moves what is on its way to `side`: each datagram delivered,
                // dropped, duplicated, with one bit flipped, or delivered while a read waits
                // for it (placed straight into the reader's buffer), as the input says.
                for bytes in std::mem::take(&mut wire[side]) {
                    match input.byte() % 5 {
                        0 => ends[side].handle_datagram(now, &bytes),
                        4 => {
                            let mut got = vec![0u8; usize::from(input.byte())];
                            let n = {
                                let mut pieces = [IoSliceMut::new(&mut got)];
                                let mut place =
                                    |p: &[u8]| check_place(p, side, &mut places_seen, &places_written);
                                let mut to = ReadCursor::placing(&mut pieces, &mut place);
                                ends[side].read_into(&mut to);
                                ends[side].handle_datagram_into(now, &bytes, &mut to);
                                ends[side].read_into(&mut to);
                                to.filled()
                            };
                            check_read(&got[..n], side, &mut read, &written, forged_data);
                        }
                        1 => {}
                        2 => {
                            ends[side].handle_datagram(now, &bytes);
                            ends[side].handle_datagram(now, &bytes);
                        }
                        _ => {
                            let mut bad = bytes.clone();
                            let bit = usize::from(input.u16()) % (bad.len() * 8);
                            bad[bit / 8] ^= 1 << (bit % 8);
                            ends[side].handle_datagram(now, &bad);
                        }
                    }
                }
            }
            4 => {
                // A forged datagram of the session, with a correct checksum.
                let kind = [
                    DatagramKind::Data,
                    DatagramKind::Ack,
                    DatagramKind::Close,
                    DatagramKind::Reset,
                    DatagramKind::Discover,
                    DatagramKind::Offer,
                ][usize::from(input.byte() % 6)];
                let len = if kind == DatagramKind::Data { 1 + usize::from(input.byte() % 200) } else { 0 };
                let h = DatagramHeader {
                    kind,
                    flags: input.byte() & flags::ALL,
                    session_id: session,
                    seq: u32::from_le_bytes([input.byte(), input.byte(), input.byte(), input.byte()]),
                    ack: u32::from_le_bytes([input.byte(), input.byte(), input.byte(), input.byte()]),
                    sack: u32::from_le_bytes([input.byte(), input.byte(), input.byte(), input.byte()]),
                    window: input.u16(),
                    payload_len: len as u16,
                };
                let mut out = vec![0u8; h.datagram_len()];
                out[DATAGRAM_HEADER_LEN..].copy_from_slice(&input.take(len));
                h.emit(&mut out);
                forged_data |= kind.is_sequenced();
                ends[side].handle_datagram(now, &out);
            }
            5 => {
                let len = usize::from(input.byte());
                let raw = input.take(len);
                ends[side].handle_datagram(now, &raw);
            }
            6 => ends[side].close(),
            _ => {
                if input.byte() == 0xff {
                    ends[side].reset();
                }
            }
        }
        // Both sides send what they have; check what the stream under test emits.
        for (from, end) in ends.iter_mut().enumerate() {
            while let Some(n) = end.poll_transmit(now, &mut buf) {
                assert!(n <= config.datagram_len_max());
                let (h, _) = DatagramHeader::parse(&buf[..n]).expect("a stream emits valid datagrams");
                assert_eq!(h.session_id, session);
                if wire[1 - from].len() < 256 {
                    wire[1 - from].push(buf[..n].to_vec());
                }
            }
            assert!(end.in_flight() <= end.config().send_slots);
            if matches!(end.state(), State::Dead(_)) {
                assert_eq!(end.poll_timeout(), None);
                assert_eq!(end.write(&[IoSlice::new(b"x")]), 0);
            }
        }
    }
}

/// The `bundle` target: a [`Bundle`](crate::bundle::Bundle) of up to four paths driven by
/// arbitrary moves (sends, arrivals, probes and answers with arbitrary fields, refused sends,
/// deliveries, time), its own probes answered or lost as the input says. No panic, and: a send
/// only goes on a path whose peer is known; a path that works has a known peer; counters only
/// grow; a path rejoins no more often than it went down; a probe comes out only on a bundle
/// of two paths or more, and never before its due time.
pub fn bundle(data: &[u8]) {
    use crate::bundle::{Bundle, BundleConfig, PathCounters};
    use wire::datagram::{DatagramHeader, DatagramKind};

    let mut input = Input(data);
    let n = 1 + usize::from(input.byte() % 4);
    let known: Vec<bool> = (0..n).map(|i| i == 0 || input.byte() & 1 == 1).collect();
    let session = 0xb0b;
    let mut b = Bundle::new(BundleConfig::default(), session, &known, input.byte() & 1 == 1);
    let mut now = 0u64;
    let mut seq = 0u32;
    let mut before: Vec<PathCounters> = (0..n).map(|i| b.counters(i)).collect();
    let mut probes_out: Vec<(usize, DatagramHeader)> = Vec::new();
    while !input.is_empty() {
        let op = input.byte();
        let path = usize::from(input.byte()) % n;
        match op % 8 {
            0 => {
                if let Some(p) = b.pick() {
                    assert!(b.known(p), "a send on a path whose peer is unknown");
                    seq = seq.wrapping_add(1);
                    if op & 4 != 0 {
                        // Sent again: a path's marked datagram, perhaps.
                        b.on_sequenced(seq.wrapping_sub(u32::from(op >> 5)));
                    }
                    b.on_sent(
                        p,
                        now,
                        1 + u64::from(op >> 4),
                        u64::from(input.u16()),
                        (op & 8 != 0).then_some(seq),
                    );
                }
            }
            1 => b.on_received(path, now, u64::from(op >> 3)),
            2 => {
                // Anything that parses: a peer's probe or answer, or a forgery.
                let kind = if op & 8 == 0 { DatagramKind::Probe } else { DatagramKind::ProbeAck };
                let kinds = [kind, DatagramKind::Data, DatagramKind::Ack];
                let h = DatagramHeader {
                    kind: kinds[usize::from(op >> 4) % 3],
                    flags: 0,
                    session_id: if op & 0x80 == 0 { session } else { u32::from(input.u16()) },
                    seq: u32::from(input.u16()),
                    ack: 0,
                    sack: 0,
                    window: 0,
                    payload_len: 0,
                };
                if let Some(ack) = b.on_probe(path, now, &h) {
                    assert_eq!((ack.kind, ack.seq, ack.session_id), (DatagramKind::ProbeAck, h.seq, session));
                }
            }
            3 => b.on_send_failed(path, now),
            4 => {
                let cut = seq.wrapping_sub(u32::from(input.byte()));
                b.on_delivered(now, |s| (s.wrapping_sub(cut) as i32) < 0);
            }
            5 => {
                now += u64::from(input.u16()) * 16;
                b.check(now, u64::from(input.u16()));
            }
            6 => {
                let due = b.poll_timeout();
                while let Some((p, probe)) = b.poll_probe(now) {
                    assert!(n > 1, "a lone path is never probed");
                    assert!(due.is_some_and(|d| d <= now), "a probe before its time");
                    assert_eq!(probe.kind, DatagramKind::Probe);
                    probes_out.push((p, probe));
                }
            }
            _ => {
                // The peer answers the probes out there, or they are lost.
                for (p, probe) in std::mem::take(&mut probes_out) {
                    if input.byte() & 1 == 0 {
                        let ack = DatagramHeader { kind: DatagramKind::ProbeAck, ..probe };
                        assert_eq!(b.on_probe(p, now, &ack), None);
                    }
                }
            }
        }
        while b.poll_event().is_some() {}
        for (i, was) in before.iter_mut().enumerate() {
            let c = b.counters(i);
            assert!(!c.up || b.known(i), "a working path with no known peer");
            assert!(c.datagrams_sent >= was.datagrams_sent && c.datagrams_received >= was.datagrams_received);
            assert!(c.probes_sent >= was.probes_sent && c.probes_answered >= was.probes_answered);
            assert!(c.downs >= was.downs && c.rejoins >= was.rejoins && c.rejoins <= c.downs);
            assert!(c.probes_answered <= c.probes_sent);
            *was = c;
        }
    }
}
