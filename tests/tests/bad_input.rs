//! Bad input through real sockets.
//!
//! Requests that are wrong but intact get a precise status and the connection goes on. Broken
//! framing gets a GOAWAY naming the reason and that connection is closed, while a neighbour
//! lane keeps reading and writing verified data throughout.

use initiator::{Lane, LaneConfig, Limits, ReqFlags, Status};
use skiff_tests::{caravan, start_target, tcp_endpoint, RawPeer};
use wire::caravan::CompletionCaravan;
use wire::control::{frame, Hello, HelloReply};
use wire::{FrameKind, GoAway, Header, Opcode, Request, HEADER_LEN};

fn req(opcode: Opcode, tag: u32, handle: u32, offset: u64, length: u32) -> Request {
    Request { opcode, flags: ReqFlags::empty(), tag, handle, offset, length }
}

/// Completions of one response caravan as (tag, status, data length).
fn completions(peer: &mut RawPeer) -> Vec<(u32, Status, u32)> {
    let (h, body) = peer.recv().expect("a response");
    assert_eq!(h.kind, FrameKind::Completions, "{h:?}");
    let c = CompletionCaravan::parse(&h, &body).unwrap();
    c.iter().map(|(c, _)| (c.tag, c.status, c.data_len)).collect()
}

fn small_limits() -> Limits {
    Limits { queue_depth: 32, caravan_reqs_max: 8, caravan_bytes_max: 256 << 10, io_bytes_max: 64 << 10 }
}

#[test]
fn wrong_requests_get_precise_statuses_and_the_connection_goes_on() {
    let t = start_target(&["vol=ram:1M", "ro=ram:1M,ro"], 1);
    let (mut p, vol) = RawPeer::ready(&t, small_limits(), "vol");
    p.send(&frame(FrameKind::Open, &wire::Open { name: "ro".into() }.encode()));
    let ro = wire::OpenReply::decode(&p.recv().unwrap().1).unwrap().handle;

    let unknown = req(Opcode::Read, 7, vol, 0, 512);
    let bad_flags = req(Opcode::Read, 8, vol, 0, 512);
    let reqs = [
        req(Opcode::Read, 1, vol, 1 << 20, 512), // past the end
        req(Opcode::Read, 2, vol, 100, 512),     // misaligned offset
        req(Opcode::Write, 3, vol, 0, 100),      // misaligned length
        req(Opcode::Read, 4, vol, 0, 128 << 10), // over io_bytes_max (64 KiB)
        req(Opcode::Write, 5, ro, 0, 512),       // read-only export
        req(Opcode::Read, 6, 99, 0, 512),        // handle never opened
        unknown,
        bad_flags,
    ];
    let mut bytes = caravan(&reqs, &[0xAB; 612]);
    // Patch opcode 7 to an unknown value and request 8's flags to an unknown bit, in place:
    // both stay intact for framing.
    let desc = |i: usize| HEADER_LEN + i * wire::REQUEST_DESC_LEN;
    bytes[desc(6)] = 0x7F;
    bytes[desc(7) + 1] = 0x80;
    p.send(&bytes);
    let got = completions(&mut p);
    let want = [
        (1, Status::OutOfRange, 0),
        (2, Status::Misaligned, 0),
        (3, Status::Misaligned, 0),
        (4, Status::TooLarge, 0),
        (5, Status::ReadOnly, 0),
        (6, Status::BadHandle, 0),
        (7, Status::UnknownOpcode, 0),
        (8, Status::Invalid, 0),
    ];
    assert_eq!(got, want);

    // The same connection still works, and the refused write changed nothing.
    p.send(&caravan(&[req(Opcode::Read, 9, vol, 0, 512)], &[]));
    let (h, body) = p.recv().unwrap();
    let c = CompletionCaravan::parse(&h, &body).unwrap();
    let (done, data) = c.iter().next().unwrap();
    assert_eq!((done.tag, done.status, data.len()), (9, Status::Ok, 512));
    assert!(data.iter().all(|&b| b == 0), "nothing was written by refused requests");
    assert_eq!(t.stats().get("req_errors"), Some(8));
}

#[test]
fn open_of_a_missing_export_is_refused_and_the_connection_goes_on() {
    let t = start_target(&["vol=ram:1M"], 1);
    let lane_err = Lane::connect(&tcp_endpoint(&t), "nope", &LaneConfig::default()).err().expect("refused");
    assert!(lane_err.to_string().contains("no such export"), "{lane_err}");
    let (mut p, _) = RawPeer::ready(&t, small_limits(), "vol");
    p.send(&frame(FrameKind::Open, &wire::Open { name: "nope".into() }.encode()));
    assert_eq!(wire::OpenReply::decode(&p.recv().unwrap().1).unwrap().status, Status::NotFound);
    p.send(&frame(FrameKind::List, &[]));
    let (h, body) = p.recv().unwrap();
    assert_eq!(h.kind, FrameKind::ListReply);
    assert_eq!(wire::ExportInfo::decode_list(&body).unwrap().len(), 1);
}

#[test]
fn a_version_we_do_not_speak_is_answered_then_closed() {
    let t = start_target(&["vol=ram:1M"], 1);
    let mut p = RawPeer::connect(&t);
    p.send(&frame(
        FrameKind::Hello,
        &Hello { version_min: 2, version_max: 9, features: 0, limits: Limits::default(), auth: None }
            .encode(),
    ));
    let (h, body) = p.recv().unwrap();
    assert_eq!(h.kind, FrameKind::HelloReply);
    assert_eq!(HelloReply::decode(&body).unwrap().status, Status::VersionMismatch);
    assert!(p.closed());
}

/// A lane that writes and verifies data while misbehaving peers come and go.
struct Neighbour {
    lane: Lane,
    round: u8,
}

impl Neighbour {
    fn new(t: &server::Target) -> Neighbour {
        Neighbour { lane: Lane::connect(&tcp_endpoint(t), "vol", &LaneConfig::default()).unwrap(), round: 0 }
    }

    fn check(&mut self) {
        self.round = self.round.wrapping_add(1);
        let data = vec![self.round; 65536];
        self.lane.write_at(&data, 1 << 20).unwrap();
        let mut back = vec![0; 65536];
        self.lane.read_at(&mut back, 1 << 20).unwrap();
        assert_eq!(back, data, "neighbour disturbed in round {}", self.round);
    }
}

/// Send `bytes` on a fresh, handshaken connection; expect a GOAWAY with `status` whose message
/// contains `reason`, then the close.
fn expect_goaway(t: &server::Target, bytes: &[u8], status: Status, reason: &str) {
    let (mut p, _) = RawPeer::ready(t, small_limits(), "vol");
    p.send(bytes);
    let (h, body) = p.recv().unwrap_or_else(|| panic!("no GOAWAY for {reason}"));
    assert_eq!(h.kind, FrameKind::GoAway, "for {reason}");
    let g = GoAway::decode(&body).unwrap();
    assert!(g.message.contains(reason), "GOAWAY {:?} does not mention {reason:?}", g.message);
    assert_eq!(g.status, status, "GOAWAY status for {reason}");
    assert!(p.closed(), "connection left open after {reason}");
}

#[test]
fn broken_framing_closes_only_that_connection() {
    let t = start_target(&["vol=ram:4M"], 2);
    let mut n = Neighbour::new(&t);
    n.check();

    let good = caravan(&[req(Opcode::Read, 1, 0, 0, 512)], &[]);

    let mut bad_magic = good.clone();
    bad_magic[0] ^= 0xFF;
    expect_goaway(&t, &bad_magic, Status::Invalid, "magic");
    n.check();

    let mut bad_crc = good.clone();
    bad_crc[8] ^= 0x01; // payload_len changes, CRC does not
    expect_goaway(&t, &bad_crc, Status::Invalid, "checksum");
    n.check();

    let mut bad_version = good.clone();
    bad_version[4] = 9;
    let crc = crc_of(&bad_version);
    bad_version[20..24].copy_from_slice(&crc.to_le_bytes());
    expect_goaway(&t, &bad_version, Status::VersionMismatch, "version");
    n.check();

    // Lengths that cannot be: a payload far over the negotiated caravan bytes, refused from
    // the header alone (no body follows).
    let huge = Header { kind: FrameKind::Requests, desc_count: 1, payload_len: 1 << 30 }.to_bytes();
    expect_goaway(&t, &huge, Status::TooLarge, "caravan payload bytes");
    n.check();

    // More descriptors than the negotiated caravan_reqs_max (8).
    let nine: Vec<Request> = (0..9).map(|i| req(Opcode::Read, i, 0, 0, 512)).collect();
    expect_goaway(&t, &caravan(&nine, &[]), Status::TooLarge, "descriptors per caravan");
    n.check();

    // Payload section that does not match the descriptors.
    let mut mismatch = caravan(&[req(Opcode::Write, 1, 0, 0, 512)], &[0; 512]);
    mismatch.extend_from_slice(&[0; 8]);
    Header { kind: FrameKind::Requests, desc_count: 1, payload_len: 520 }.emit(&mut mismatch);
    expect_goaway(&t, &mismatch, Status::Invalid, "does not match");
    n.check();

    // A frame only a target sends.
    expect_goaway(
        &t,
        &Header { kind: FrameKind::Completions, desc_count: 0, payload_len: 0 }.to_bytes(),
        Status::Invalid,
        "Completions",
    );
    n.check();

    // Not skiff at all, before any handshake.
    let mut p = RawPeer::connect(&t);
    p.send(b"GET / HTTP/1.1\r\nHost: skiff\r\n\r\n");
    let (h, _) = p.recv().expect("a GOAWAY");
    assert_eq!(h.kind, FrameKind::GoAway);
    assert!(p.closed());
    n.check();

    // Requests before HELLO.
    let mut p = RawPeer::connect(&t);
    p.send(&good);
    assert_eq!(p.recv().expect("a GOAWAY").0.kind, FrameKind::GoAway);
    assert!(p.closed());
    n.check();

    assert_eq!(t.stats().get("connections_closed_protocol_error"), Some(9));
}

#[test]
fn a_peer_that_never_reads_does_not_stall_others() {
    let t = start_target(&["vol=ram:64M"], 1);
    let mut n = Neighbour::new(&t);
    let (mut hog, vol) = RawPeer::ready(&t, small_limits(), "vol");
    hog.stream.set_nonblocking(true).unwrap();
    // Ask for far more read data than socket buffers and the target's backlog bound hold, and
    // never read a byte of it.
    let reads: Vec<Request> =
        (0..8).map(|i| req(Opcode::Read, i, vol, u64::from(i) * (64 << 10), 64 << 10)).collect();
    let frame = caravan(&reads, &[]);
    let mut sent_bytes = 0usize;
    for _ in 0..2000 {
        match std::io::Write::write(&mut hog.stream, &frame) {
            Ok(n) => sent_bytes += n,
            Err(_) => break, // our own send buffer is full: the target stopped reading us
        }
    }
    assert!(sent_bytes > 0);
    for _ in 0..20 {
        n.check();
    }
    let s = t.stats();
    let asked = sent_bytes as u64 / frame.len() as u64 * 8 * (64 << 10);
    assert!(s.get("bytes_read").unwrap() < asked, "the target stopped executing a peer that does not read");
}

/// The header checksum of `frame` as it stands, so only the field under test is wrong.
fn crc_of(frame: &[u8]) -> u32 {
    crc32c_sw(&frame[..20])
}

/// Bitwise CRC32C (Castagnoli, reflected, poly 0x82F63B78): an independent implementation, so
/// this test does not trust the code under test for the checksum it forges.
fn crc32c_sw(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

#[test]
fn independent_crc_matches_the_standard_check_value() {
    assert_eq!(crc32c_sw(b"123456789"), 0xE306_9283);
    let h = Header { kind: FrameKind::Stats, desc_count: 0, payload_len: 0 }.to_bytes();
    assert_eq!(u32::from_le_bytes(h[20..24].try_into().unwrap()), crc32c_sw(&h[..20]));
}
