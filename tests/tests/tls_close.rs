//! The target ends every TLS session it closes cleanly: `close_notify`, then the TCP close
//! (issue 26). The NBD specification asks it after `NBD_CMD_DISC` ("the server MUST close
//! down the TLS session ... and then close the TCP connection"); the native protocol does the
//! same after a GOAWAY, whoever says it (the initiator, the idle timeout, a target shutting
//! down).
//!
//! The client here is rustls itself over a blocking socket, which tells the two ends apart: a
//! read returns `Ok(0)` after the peer's `close_notify`, and fails with `UnexpectedEof` when
//! TCP ends without one (a truncation attack, to TLS).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use rustls::{ClientConnection, StreamOwned};
use server::{Protocol, Target};
use skiff_tests::{certs, nbd_request, start_target_with, tcp_endpoint};
use transport::tls::{CertDir, TlsMode};
use transport::Endpoint;
use wire::control::frame;
use wire::{FrameKind, GoAway, Header, Hello, HelloReply, Limits, Status, HEADER_LEN};

/// A guard against a hang, never a measure of speed.
const TIMEOUT: Duration = Duration::from_secs(20);

type Tls = StreamOwned<ClientConnection, TcpStream>;

fn target(dir: &std::path::Path, tweak: impl FnOnce(&mut server::TargetConfig)) -> Target {
    certs::make(dir);
    let config = CertDir::new(dir).server_config(false).unwrap();
    start_target_with(&["vol=ram:1M"], |c| {
        c.nbd_listen = vec![Endpoint::Tcp("127.0.0.1:0".into())];
        c.tls = Some(server::TlsListen { mode: TlsMode::Require, config, verify_peer: false });
        tweak(c);
    })
}

/// Start TLS as a client over `sock` (blocking, with a read timeout).
fn tls_over(sock: TcpStream, dir: &std::path::Path) -> Tls {
    let config: Arc<rustls::ClientConfig> = CertDir::new(dir).client_config().unwrap();
    let name = transport::tls::server_name("127.0.0.1").unwrap();
    StreamOwned::new(ClientConnection::new(config, name).unwrap(), sock)
}

/// Read until the TLS session ends; panics unless it ends with the target's `close_notify`.
/// Returns what was read before the end.
fn read_to_clean_end(tls: &mut Tls) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tls.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
                panic!("TCP closed without TLS close_notify after {} bytes", got.len())
            }
            Err(e) => panic!("TLS read failed after {} bytes: {e}", got.len()),
        }
    }
}

/// A native connection over TLS past HELLO.
fn native(t: &Target, dir: &std::path::Path) -> Tls {
    let Endpoint::Tcp(addr) = tcp_endpoint(t) else { unreachable!() };
    let sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut tls = tls_over(sock, dir);
    let hello = Hello { version_min: 1, version_max: 1, features: 0, limits: Limits::default(), auth: None };
    tls.write_all(&frame(FrameKind::Hello, &hello.encode())).unwrap();
    let mut head = [0u8; HEADER_LEN];
    tls.read_exact(&mut head).unwrap();
    let header = Header::parse(&head).unwrap();
    let mut body = vec![0u8; header.body_len()];
    tls.read_exact(&mut body).unwrap();
    assert!(HelloReply::decode(&body).unwrap().status.is_ok());
    tls
}

/// The GOAWAY frame a target sent before it ended the session, with its status.
fn goaway_status(bytes: &[u8]) -> Status {
    let header = Header::parse(&bytes[..HEADER_LEN]).unwrap();
    assert_eq!(header.kind, FrameKind::GoAway, "the target's last frame");
    GoAway::decode(&bytes[HEADER_LEN..header.frame_len()]).unwrap().status
}

#[test]
fn nbd_disc_ends_the_tls_session_before_the_tcp_connection() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path(), |_| {});
    let Endpoint::Tcp(addr) = t.endpoints_of(Protocol::Nbd)[0].clone() else { unreachable!() };
    let mut sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut greeting = [0u8; 18];
    sock.read_exact(&mut greeting).unwrap();
    // Fixed newstyle, no zeroes; NBD_OPT_STARTTLS; its ACK in plaintext.
    sock.write_all(&3u32.to_be_bytes()).unwrap();
    let mut opt = 0x4948_4156_454F_5054u64.to_be_bytes().to_vec();
    opt.extend_from_slice(&5u32.to_be_bytes());
    opt.extend_from_slice(&0u32.to_be_bytes());
    sock.write_all(&opt).unwrap();
    let mut ack = [0u8; 20];
    sock.read_exact(&mut ack).unwrap();
    assert_eq!(u32::from_be_bytes(ack[12..16].try_into().unwrap()), 1, "NBD_REP_ACK");
    let mut tls = tls_over(sock, dir.path());
    // EXPORT_NAME inside TLS, a write, then DISC.
    let mut opt = 0x4948_4156_454F_5054u64.to_be_bytes().to_vec();
    opt.extend_from_slice(&1u32.to_be_bytes());
    opt.extend_from_slice(&3u32.to_be_bytes());
    opt.extend_from_slice(b"vol");
    tls.write_all(&opt).unwrap();
    let mut export = [0u8; 10];
    tls.read_exact(&mut export).unwrap();
    tls.write_all(&nbd_request(1, 0, 7, 0, 4096, &[5; 4096])).unwrap();
    tls.write_all(&nbd_request(2, 0, 8, 0, 0, &[])).unwrap();
    let rest = read_to_clean_end(&mut tls);
    assert_eq!(rest.len(), 16, "the write's reply, then the clean end");
    assert_eq!(&rest[8..16], &7u64.to_be_bytes());
    t.shutdown();
}

#[test]
fn native_goaway_from_the_initiator_ends_the_tls_session_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path(), |_| {});
    let mut tls = native(&t, dir.path());
    let goaway = GoAway { status: Status::Ok, message: "done".into() };
    tls.write_all(&frame(FrameKind::GoAway, &goaway.encode())).unwrap();
    assert!(read_to_clean_end(&mut tls).is_empty(), "nothing after the initiator's GOAWAY");
    t.shutdown();
}

#[test]
fn native_idle_timeout_says_goaway_then_ends_the_tls_session_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path(), |c| c.bounds.idle_timeout = Duration::from_millis(200));
    let mut tls = native(&t, dir.path());
    let rest = read_to_clean_end(&mut tls);
    assert_eq!(goaway_status(&rest), Status::TimedOut);
    t.shutdown();
}

#[test]
fn a_target_shutting_down_says_goaway_then_ends_the_tls_session_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(dir.path(), |_| {});
    let mut tls = native(&t, dir.path());
    let reader = std::thread::spawn(move || read_to_clean_end(&mut tls));
    std::thread::sleep(Duration::from_millis(100));
    t.shutdown();
    let rest = reader.join().unwrap();
    assert_eq!(goaway_status(&rest), Status::ShuttingDown);
}
