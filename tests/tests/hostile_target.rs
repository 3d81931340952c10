//! The initiator against a hostile target: limits are judged from a frame's header alone on
//! this side too (docs/PROTOCOL.md, sections 2 and 10.2). A target that announces a completion
//! caravan over the negotiated limits, and then sends nothing more, must fail the lane at
//! once with a protocol error, never leave it waiting for a body it will refuse anyway.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use initiator::{Error, Lane, LaneConfig, Limits, Queue, Status};
use proto::ProtoError;
use transport::Endpoint;
use wire::control::{frame, ExportFlags, HelloReply, OpenReply};
use wire::{FrameKind, Header, HEADER_LEN};

const LIMITS: Limits =
    Limits { queue_depth: 8, caravan_reqs_max: 4, caravan_bytes_max: 8192, io_bytes_max: 4096 };

/// Read one whole frame; returns its header.
fn read_frame(s: &mut TcpStream) -> Header {
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head).unwrap();
    let h = Header::parse(&head).unwrap();
    s.read_exact(&mut vec![0; h.body_len()]).unwrap();
    h
}

/// A target that completes the handshake, reads one request caravan, answers it with `header`
/// and nothing else, and then holds the connection open until the lane closes it.
fn hostile(header: Header) -> (Endpoint, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = Endpoint::Tcp(listener.local_addr().unwrap().to_string());
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        read_frame(&mut s);
        let hello =
            HelloReply { status: Status::Ok, version: 1, features: 0, limits: LIMITS, auth_nonce: None };
        s.write_all(&frame(FrameKind::HelloReply, &hello.encode())).unwrap();
        read_frame(&mut s);
        let open = OpenReply {
            status: Status::Ok,
            handle: 0,
            size_bytes: 1 << 20,
            block_size: 512,
            flags: ExportFlags(0),
        };
        s.write_all(&frame(FrameKind::OpenReply, &open.encode())).unwrap();
        read_frame(&mut s);
        s.write_all(&header.to_bytes()).unwrap();
        // Hold the connection until the lane gives up on it.
        let _ = s.read_to_end(&mut Vec::new());
    });
    (endpoint, t)
}

fn lane_against(header: Header) -> (Vec<initiator::Completion>, Error) {
    let (endpoint, target) = hostile(header);
    // A timeout far longer than the test: a lane that waited for the body would end with
    // TimedOut after it, not with the protocol error asserted below.
    let config = LaneConfig { limits: LIMITS, timeout: Duration::from_secs(60), ..LaneConfig::default() };
    let mut lane = Lane::connect(&endpoint, "vol", &config).expect("handshake");
    lane.submit_read(0, vec![0; 512], 7).map_err(|r| r.error).unwrap();
    let mut out = Vec::new();
    let err = lane.wait(1, &mut out).expect_err("the lane must fail");
    assert!(lane.is_broken());
    drop(lane);
    target.join().unwrap();
    (out, err)
}

#[test]
fn too_many_descriptors_fail_the_lane_from_the_header() {
    let header = Header { kind: FrameKind::Completions, desc_count: 5, payload_len: 0 };
    let (done, err) = lane_against(header);
    assert!(
        matches!(
            err,
            Error::Protocol(ProtoError::OverLimit { what: "descriptors per caravan", value: 5, limit: 4 })
        ),
        "{err:?}"
    );
    assert_eq!(done.len(), 1, "the request comes back");
    assert_eq!((done[0].user_data, done[0].status), (7, Status::IoError));
    assert_eq!(done[0].buf.as_ref().map(Vec::len), Some(512), "with its buffer");
}

#[test]
fn too_much_payload_fails_the_lane_from_the_header() {
    let header = Header { kind: FrameKind::Completions, desc_count: 1, payload_len: 8193 };
    let (_, err) = lane_against(header);
    assert!(
        matches!(err, Error::Protocol(ProtoError::OverLimit { what: "caravan payload bytes", .. })),
        "{err:?}"
    );
}

#[test]
fn a_control_body_over_64_kib_or_a_request_caravan_fails_the_lane_from_the_header() {
    let big_goaway = Header { kind: FrameKind::GoAway, desc_count: 0, payload_len: 65_537 };
    let (_, err) = lane_against(big_goaway);
    assert!(
        matches!(err, Error::Protocol(ProtoError::OverLimit { what: "control body bytes", .. })),
        "{err:?}"
    );
    let requests = Header { kind: FrameKind::Requests, desc_count: 1, payload_len: 0 };
    let (_, err) = lane_against(requests);
    assert!(matches!(err, Error::Protocol(ProtoError::Unexpected(FrameKind::Requests, _))), "{err:?}");
}
