//! `Lane::sleep`, the one place a thread that owns a lane and a queue of its own (skiff
//! attach's I/O threads) sleeps: it returns for a kick from another thread, for bytes from the
//! target, and for the silence bound, where a lane without reconnection fails every request
//! rather than leave them waiting forever.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use initiator::{Error, Kick, Lane, LaneConfig, Queue, ReconnectConfig, Status};
use skiff_tests::{start_target, tcp_endpoint};
use transport::Endpoint;
use wire::control::{frame, ExportFlags, HelloReply, OpenReply};
use wire::{FrameKind, Header, HEADER_LEN};

#[test]
fn a_kick_from_another_thread_wakes_the_sleeper_and_is_cleared() {
    let t = start_target(&["vol=ram:1M"], 1);
    let mut lane = Lane::connect(&tcp_endpoint(&t), "vol", &LaneConfig::default()).unwrap();
    let kick = Arc::new(Kick::new().unwrap());
    let kicker = {
        let kick = kick.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            kick.kick();
        })
    };
    let started = Instant::now();
    assert!(lane.sleep(&kick).unwrap(), "woken by the kick");
    assert!(started.elapsed() >= Duration::from_millis(40));
    kicker.join().unwrap();
    // Cleared: with nothing due and nothing in flight, the next sleep would last; a kick
    // rung now is the only way out, at once.
    kick.kick();
    assert!(lane.sleep(&kick).unwrap());
}

#[test]
fn a_completion_wakes_the_sleeper() {
    let t = start_target(&["vol=ram:1M"], 1);
    let mut lane = Lane::connect(&tcp_endpoint(&t), "vol", &LaneConfig::default()).unwrap();
    let kick = Kick::new().unwrap();
    lane.submit_read(0, vec![1; 4096], 9).unwrap();
    lane.commit().unwrap();
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while done.is_empty() {
        assert!(Instant::now() < deadline, "no completion");
        assert!(!lane.sleep(&kick).unwrap(), "no kick was rung");
        lane.poll(&mut done).unwrap();
    }
    assert_eq!((done[0].user_data, done[0].status), (9, Status::Ok));
    assert_eq!(done[0].buf.as_deref(), Some(&[0u8; 4096][..]));
}

/// A target that completes the handshake, reads the first request caravan and never answers.
fn silent_target() -> (Endpoint, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = Endpoint::Tcp(listener.local_addr().unwrap().to_string());
    let read_frame = |s: &mut std::net::TcpStream| {
        let mut head = [0u8; HEADER_LEN];
        s.read_exact(&mut head).unwrap();
        let h = Header::parse(&head).unwrap();
        s.read_exact(&mut vec![0; h.body_len()]).unwrap();
    };
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        read_frame(&mut s);
        let limits = LaneConfig::default().limits;
        let hello = HelloReply { status: Status::Ok, version: 1, features: 0, limits, auth_nonce: None };
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
        // Hold the connection, answering nothing, until the lane gives up on it.
        let _ = s.read_to_end(&mut Vec::new());
    });
    (endpoint, t)
}

#[test]
fn silence_without_reconnection_fails_what_is_in_flight() {
    let (endpoint, target) = silent_target();
    let config = LaneConfig {
        timeout: Duration::from_millis(300),
        reconnect: ReconnectConfig::OFF,
        ..LaneConfig::default()
    };
    let mut lane = Lane::connect(&endpoint, "vol", &config).unwrap();
    let kick = Kick::new().unwrap();
    lane.submit_read(0, vec![0; 512], 3).unwrap();
    lane.commit().unwrap();
    let started = Instant::now();
    let err = loop {
        match lane.sleep(&kick) {
            Ok(_) => assert!(started.elapsed() < Duration::from_secs(10), "the silence was never noticed"),
            Err(e) => break e,
        }
    };
    assert!(matches!(err, Error::TimedOut(_)), "{err}");
    assert!(started.elapsed() >= Duration::from_millis(250), "{:?}", started.elapsed());
    assert!(lane.is_broken());
    let mut done = Vec::new();
    let _ = lane.poll(&mut done);
    assert_eq!(done.len(), 1, "the read completes, with an error");
    assert_eq!((done[0].user_data, done[0].status), (3, Status::IoError));
    // A failed lane's sleep waits for kicks only: its dead socket does not make it spin.
    kick.kick();
    assert!(lane.sleep(&kick).unwrap());
    drop(lane);
    target.join().unwrap();
}
