//! The target's listeners under abuse (issue 13, "Limits that hold under abuse"): stalled
//! handshakes never lock out a client that completes its own, handshakes and silence time out,
//! one address cannot take every slot, and a stopping target says so.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use initiator::{Lane, LaneConfig};
use skiff_tests::{run_ok, start_target_with, tcp_endpoint, tool, RawPeer};
use transport::Endpoint;
use wire::{FrameKind, GoAway, Status};

fn stat(t: &server::Target, name: &str) -> u64 {
    t.stats().entries.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no counter {name}")).1
}

fn addr_of(e: &Endpoint) -> String {
    let Endpoint::Tcp(a) = e else { panic!("not TCP: {e}") };
    a.clone()
}

/// Resident memory of this process (the target runs in it), in bytes.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// The next frame must be a GOAWAY with `status`, and then the stream must end.
fn expect_goaway_then_close(peer: &mut RawPeer, status: Status) -> String {
    peer.stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let (h, body) = peer.recv().expect("a GOAWAY before the close");
    assert_eq!(h.kind, FrameKind::GoAway);
    let g = GoAway::decode(&body).unwrap();
    assert_eq!(g.status, status, "{}", g.message);
    assert!(peer.closed(), "the connection stays open after its GOAWAY");
    g.message
}

fn write_read_verify(endpoint: &Endpoint, export: &str) {
    let mut lane = Lane::connect(endpoint, export, &LaneConfig::default()).expect("a real client gets in");
    let data: Vec<u8> = (0..256 << 10).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    for (i, chunk) in data.chunks(64 << 10).enumerate() {
        lane.write_at(chunk, (i * (64 << 10)) as u64).unwrap();
    }
    let mut back = vec![0u8; data.len()];
    for (i, chunk) in back.chunks_mut(64 << 10).enumerate() {
        lane.read_at(chunk, (i * (64 << 10)) as u64).unwrap();
    }
    assert!(back == data, "data read back differs");
}

/// 1,100 connections that never finish a handshake (native and NBD; silent, or one byte and
/// a stall) exceed both `handshakes_max` and `connections_max`. A native lane and `nbdinfo`
/// still get in, the stalled ones are evicted oldest first, and memory stays bounded.
#[test]
fn a_flood_of_stalled_handshakes_never_locks_out_a_client_that_completes_its_own() {
    let t = start_target_with(&["vol=ram:4M"], |c| {
        c.nbd_listen = vec![Endpoint::Tcp("127.0.0.1:0".into())];
    });
    let native = addr_of(&tcp_endpoint(&t));
    let nbd = addr_of(&t.endpoints_of(server::Protocol::Nbd)[0]);
    let bounds = server::Bounds::default();
    let rss_before = rss_bytes();

    const FLOOD: usize = 1100;
    let mut flood = Vec::with_capacity(FLOOD);
    for i in 0..FLOOD {
        let mut s = TcpStream::connect(if i % 2 == 0 { &native } else { &nbd }).expect("connect");
        if i % 3 == 0 {
            // One byte of a handshake, then nothing.
            let _ = s.write_all(&[0x53]);
        }
        flood.push(s);
    }

    // Accepts go in order, so once these are in, the whole flood has been through admission.
    write_read_verify(&tcp_endpoint(&t), "vol");
    let info = run_ok(tool("nbdinfo", "libnbd-bin").arg(format!("nbd://{nbd}/vol")));
    assert!(info.contains("export-size: 4194304"), "{info}");

    let evicted = stat(&t, "connections_evicted");
    assert!(
        evicted as usize >= FLOOD - bounds.handshakes_max,
        "{evicted} evicted: stalled handshakes held more than {} slots",
        bounds.handshakes_max
    );
    assert_eq!(stat(&t, "connections_refused"), 0, "nobody who completes a handshake is refused");
    assert!(stat(&t, "connections_open") as usize <= bounds.handshakes_max + 2);
    let grown = rss_bytes().saturating_sub(rss_before);
    assert!(grown < 128 << 20, "resident memory grew by {} MiB under the flood", grown >> 20);

    // The evicted ones were closed by the target: most of the flood reads end of stream.
    let mut open: Vec<TcpStream> = flood;
    let want_closed = FLOOD - bounds.handshakes_max;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut closed = 0;
    while closed < want_closed {
        assert!(std::time::Instant::now() < deadline, "only {closed} of the flood closed");
        open.retain_mut(|s| {
            s.set_nonblocking(true).unwrap();
            let mut buf = [0u8; 512];
            loop {
                match s.read(&mut buf) {
                    Ok(0) => {
                        closed += 1;
                        return false;
                    }
                    Ok(_) => continue, // an NBD greeting
                    Err(_) => return true,
                }
            }
        });
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_handshake_that_does_not_finish_in_time_is_closed_with_a_reason() {
    let t = start_target_with(&["vol=ram:1M"], |c| c.bounds.handshake_timeout = Duration::from_millis(200));
    let mut silent = RawPeer::connect(&t);
    let message = expect_goaway_then_close(&mut silent, Status::TimedOut);
    assert!(message.contains("handshake"), "{message}");
    // A peer that completes its handshake in time is not touched by the handshake timeout.
    let (mut ok, handle) = RawPeer::ready(&t, wire::Limits::default(), "vol");
    std::thread::sleep(Duration::from_millis(1500));
    let read = wire::Request {
        opcode: wire::Opcode::Read,
        flags: wire::ReqFlags::empty(),
        tag: 1,
        handle,
        offset: 0,
        length: 512,
    };
    ok.send(&skiff_tests::caravan(&[read], &[]));
    let (h, _) = ok.recv().expect("a completion");
    assert_eq!(h.kind, FrameKind::Completions);
    assert_eq!(stat(&t, "handshake_timeouts"), 1);
}

#[test]
fn a_silent_native_connection_is_closed_after_the_idle_timeout_and_nbd_has_its_own() {
    let t = start_target_with(&["vol=ram:1M"], |c| {
        c.bounds.idle_timeout = Duration::from_millis(300);
        c.bounds.nbd_idle_timeout = Duration::from_millis(300);
        c.nbd_listen = vec![Endpoint::Tcp("127.0.0.1:0".into())];
    });
    let (mut idle, _) = RawPeer::ready(&t, wire::Limits::default(), "vol");
    let message = expect_goaway_then_close(&mut idle, Status::TimedOut);
    assert!(message.contains("idle"), "{message}");

    // An NBD client past its handshake, then silent: closed without a message (NBD has none).
    let nbd = addr_of(&t.endpoints_of(server::Protocol::Nbd)[0]);
    let mut s = TcpStream::connect(nbd).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    s.write_all(&1u32.to_be_bytes()).unwrap(); // FIXED_NEWSTYLE
    let mut opt = Vec::new();
    opt.extend_from_slice(b"IHAVEOPT");
    opt.extend_from_slice(&1u32.to_be_bytes()); // EXPORT_NAME
    opt.extend_from_slice(&3u32.to_be_bytes());
    opt.extend_from_slice(b"vol");
    s.write_all(&opt).unwrap();
    let mut export_reply = [0u8; 8 + 2 + 124];
    s.read_exact(&mut export_reply).unwrap();
    let mut rest = Vec::new();
    assert_eq!(s.read_to_end(&mut rest).unwrap(), 0, "the NBD connection ends with nothing more");
    assert_eq!(stat(&t, "idle_timeouts"), 2);
}

#[test]
fn one_address_cannot_hold_more_than_its_share() {
    let t = start_target_with(&["vol=ram:1M"], |c| c.bounds.connections_per_address_max = 2);
    let _a = RawPeer::ready(&t, wire::Limits::default(), "vol");
    let _b = RawPeer::ready(&t, wire::Limits::default(), "vol");
    // Both established: the third from the same address has nothing to evict and is refused.
    let mut third = RawPeer::connect(&t);
    assert!(third.closed(), "a third connection from one address was served");
    assert_eq!(stat(&t, "connections_refused"), 1);
    drop(_a);
    // Once one leaves, the address may connect again.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut again = RawPeer::connect(&t);
        again.send(&wire::control::frame(
            FrameKind::Hello,
            &wire::Hello {
                version_min: 1,
                version_max: 1,
                features: 0,
                limits: wire::Limits::default(),
                auth: None,
            }
            .encode(),
        ));
        if again.recv().is_some() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the address never got its slot back");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_stopping_target_tells_its_initiators() {
    let t = start_target_with(&["vol=ram:1M"], |_| {});
    let (mut peer, _) = RawPeer::ready(&t, wire::Limits::default(), "vol");
    t.shutdown();
    expect_goaway_then_close(&mut peer, Status::ShuttingDown);
}
