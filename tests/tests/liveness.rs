//! A connection never sleeps while bytes it can use are waiting (issue 26).
//!
//! The target stops reading a connection whose replies pile up past
//! `Bounds::tx_backlog_bytes_max` (the peer is not draining its socket). Before the fix it
//! then relied on a writable event to come back, but a send that takes everything raises none:
//! the request bytes that arrived meanwhile sat in the socket while the worker slept. These
//! tests drive exactly that through real sockets: a large READ whose reply the client leaves
//! unread, a WRITE sent behind it, then the reply drained in one go. Each round waits for the
//! WRITE's reply with a generous timeout, a guard against hanging, never a measure of speed.
//!
//! A soak through libnbd (`nbdsh`, Debian's python3-libnbd) pipelines large reads and writes,
//! plaintext and over TLS, and checks every byte read against a model of the volume.
//!
//! The same property is checked in `server`'s own tests, where the worker's real connection
//! handling runs over a modelled edge-triggered socket with every split of the bytes and
//! every order of readiness events (`crates/server/src/model.rs`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use server::{Protocol, Target};
use skiff_tests::{certs, nbd_request, run_ok_within, start_target_with, tool, RawPeer};
use transport::Endpoint;

/// A guard against a hang: far above any answer time on a loaded machine.
const TIMEOUT: Duration = Duration::from_secs(20);
const BACKLOG_BYTES: usize = 64 << 10;
const READ_BYTES: u32 = 16 << 20;
/// The client's receive buffer: small, so that the target's reply drains through many
/// writable events rather than one.
const CLIENT_RCVBUF_BYTES: usize = 64 << 10;
const WRITE_BYTES: usize = 256 << 10;
const ROUNDS: usize = 8;

fn target() -> Target {
    start_target_with(&["vol=ram:32M"], |c| {
        c.nbd_listen = vec![Endpoint::Tcp("127.0.0.1:0".into())];
        c.workers = 1;
        c.bounds.tx_backlog_bytes_max = BACKLOG_BYTES;
        c.bounds.limits.io_bytes_max = READ_BYTES;
    })
}

/// An NBD client past the handshake (`EXPORT_NAME`, simple replies).
fn nbd_client(t: &Target) -> TcpStream {
    let Endpoint::Tcp(addr) = t.endpoints_of(Protocol::Nbd)[0].clone() else { unreachable!() };
    let mut s = connect_small(&addr);
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    // Client flags: fixed newstyle, no zeroes; then EXPORT_NAME "vol".
    s.write_all(&3u32.to_be_bytes()).unwrap();
    let mut opt = 0x4948_4156_454F_5054u64.to_be_bytes().to_vec();
    opt.extend_from_slice(&1u32.to_be_bytes());
    opt.extend_from_slice(&3u32.to_be_bytes());
    opt.extend_from_slice(b"vol");
    s.write_all(&opt).unwrap();
    let mut export = [0u8; 10];
    s.read_exact(&mut export).unwrap();
    s
}

/// A TCP connection with a small receive buffer (set before connecting, so the window
/// scale follows it).
fn connect_small(addr: &str) -> TcpStream {
    let addr: std::net::SocketAddr = addr.parse().unwrap();
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_recv_buffer_size(CLIENT_RCVBUF_BYTES).unwrap();
    socket.connect(&addr.into()).unwrap();
    let s: TcpStream = socket.into();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s.set_write_timeout(Some(TIMEOUT)).unwrap();
    s
}

/// Block until the first byte of a reply is there (the read timeout guards a silent target; a
/// closed connection fails the test rather than spinning).
fn wait_for_reply(s: &TcpStream) {
    let mut first = [0u8; 1];
    let n = s.peek(&mut first).expect("the reply starts before the timeout");
    assert_eq!(n, 1, "the target closed the connection");
}

/// Read one simple reply whose data is `data_len` bytes; returns (cookie, error).
fn simple_reply(s: &mut TcpStream, data_len: usize) -> (u64, u32) {
    let mut head = [0u8; 16];
    s.read_exact(&mut head).expect("a reply before the timeout (the target stalled?)");
    assert_eq!(&head[..4], &0x6744_6698u32.to_be_bytes(), "simple reply magic");
    let error = u32::from_be_bytes(head[4..8].try_into().unwrap());
    let cookie = u64::from_be_bytes(head[8..16].try_into().unwrap());
    if error == 0 {
        let mut data = vec![0u8; data_len];
        s.read_exact(&mut data).unwrap();
    }
    (cookie, error)
}

/// The reply of a large READ is left in the sockets while a WRITE arrives behind it, then
/// taken in one go: the target must go back to the WRITE once its backlog is sent.
#[test]
fn nbd_write_behind_an_unread_reply_is_answered() {
    let t = target();
    for round in 0..ROUNDS {
        let mut s = nbd_client(&t);
        s.write_all(&nbd_request(0, 0, 1, 0, READ_BYTES, &[])).unwrap();
        // The reply has started to come: the target holds most of it, over its backlog bound.
        wait_for_reply(&s);
        let payload = vec![round as u8; WRITE_BYTES];
        s.write_all(&nbd_request(1, 0, 2, 16 << 20, WRITE_BYTES as u32, &payload)).unwrap();
        // Let the target see the WRITE arrive while it is over its bound.
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(simple_reply(&mut s, READ_BYTES as usize), (1, 0), "round {round}: the READ");
        assert_eq!(simple_reply(&mut s, 0), (2, 0), "round {round}: the WRITE");
    }
    t.shutdown();
}

/// The same on the native protocol: a caravan of reads (16 MiB) whose completions the
/// initiator leaves unread, then a caravan with a write.
#[test]
fn native_caravan_behind_an_unread_reply_is_answered() {
    use wire::{Opcode, ReqFlags, Request};
    let t = target();
    let limits = wire::Limits::default();
    for round in 0..ROUNDS {
        let Endpoint::Tcp(addr) = skiff_tests::tcp_endpoint(&t) else { unreachable!() };
        let (mut peer, handle) =
            RawPeer::ready_on(RawPeer { stream: connect_small(&addr) }, limits, "vol", 0);
        let reads: Vec<Request> = (0..16)
            .map(|i| Request {
                tag: i,
                opcode: Opcode::Read,
                flags: ReqFlags::empty(),
                handle,
                offset: u64::from(i) << 20,
                length: 1 << 20,
            })
            .collect();
        peer.send(&skiff_tests::caravan(&reads, &[]));
        wait_for_reply(&peer.stream);
        let write = Request {
            tag: 100,
            opcode: Opcode::Write,
            flags: ReqFlags::empty(),
            handle,
            offset: 16 << 20,
            length: WRITE_BYTES as u32,
        };
        peer.send(&skiff_tests::caravan(&[write], &vec![round as u8; WRITE_BYTES]));
        std::thread::sleep(Duration::from_millis(50));
        let mut tags = Vec::new();
        while !tags.contains(&100) {
            let (head, body) = peer.recv().expect("completions before the timeout (the target stalled?)");
            let caravan = wire::caravan::CompletionCaravan::parse(&head, &body).unwrap();
            tags.extend(caravan.completions().map(|c| c.tag));
        }
        assert_eq!(tags.len(), 17, "round {round}: every request answered once: {tags:?}");
    }
    t.shutdown();
}

/// Large reads and writes pipelined through libnbd at random offsets and sizes (up to 16 MiB,
/// eight in flight), every read checked against a model of the volume. NBD lets a server run
/// requests in flight together in any order, so no request is issued over the range of a
/// write still in flight, nor a write over a request in flight: every read has one answer.
const SOAK: &str = r#"
import os, random, zlib
rng = random.Random(int(os.environ["SEED"]))
h.set_request_block_size(False)
h.set_uri_allow_local_file(True)
h.connect_uri(os.environ["URI"])
size = h.get_size()
# The volume as an earlier run left it.
model = bytearray(b"".join(h.pread(min(16 << 20, size - at), at) for at in range(0, size, 16 << 20)))
pending = {}
issued = done = 0
TOTAL, IN_FLIGHT = int(os.environ["REQUESTS"]), 8
while done < TOTAL:
    if issued < TOTAL and len(pending) < IN_FLIGHT:
        n = min(size, int(2 ** rng.uniform(10, 24)))
        off = rng.randrange(0, size - n + 1)
        write = rng.random() < 0.5
        clash = [p for p in pending.values() if off < p[1] + p[2] and p[1] < off + n and (write or p[0] == "write")]
        if clash:
            h.poll(-1)
            for cookie in [c for c in pending if h.aio_command_completed(c)]:
                kind, o, m, crc, buf = pending.pop(cookie)
                if kind == "read":
                    assert zlib.crc32(buf.to_bytearray()) == crc, "read %d+%d differs from the model" % (o, m)
                done += 1
            continue
        if write:
            data = rng.randbytes(n)
            model[off:off + n] = data
            buf = nbd.Buffer.from_bytearray(bytearray(data))
            pending[h.aio_pwrite(buf, off)] = ("write", off, n, None, buf)
        else:
            buf = nbd.Buffer(n)
            pending[h.aio_pread(buf, off)] = ("read", off, n, zlib.crc32(model[off:off + n]), buf)
        issued += 1
        continue
    h.poll(-1)
    for cookie in [c for c in pending if h.aio_command_completed(c)]:
        kind, off, n, crc, buf = pending.pop(cookie)
        if kind == "read":
            assert zlib.crc32(buf.to_bytearray()) == crc, "read %d+%d differs from the model" % (off, n)
        done += 1
print("ok", done)
"#;

/// A target for the soak: NBD on a 64 MiB RAM volume, a 1 MiB backlog bound (so that large
/// reads pause reading often), TLS offered when `tls` is given.
fn soak_target(tls: Option<&std::path::Path>) -> (Target, String) {
    let t = start_target_with(&["vol=ram:64M"], |c| {
        c.nbd_listen = vec![Endpoint::Tcp("127.0.0.1:0".into())];
        c.bounds.tx_backlog_bytes_max = 1 << 20;
        c.bounds.limits.io_bytes_max = 16 << 20;
        if let Some(dir) = tls {
            let config = transport::tls::CertDir::new(dir).server_config(false).unwrap();
            c.tls = Some(server::TlsListen {
                mode: transport::tls::TlsMode::Require,
                config,
                verify_peer: false,
            });
        }
    });
    let Endpoint::Tcp(addr) = t.endpoints_of(Protocol::Nbd)[0].clone() else { unreachable!() };
    (t, addr)
}

fn nbdsh(code: &str) -> std::process::Command {
    let mut cmd = tool("nbdsh", "python3-libnbd");
    let path = std::env::var("PATH").unwrap_or_default();
    // python3-libnbd installs its module for the system's Python.
    cmd.env("PATH", format!("/usr/bin:/bin:{path}")).args(["-c", code]);
    cmd
}

#[test]
fn soak_of_large_pipelined_reads_and_writes_through_libnbd() {
    let (t, addr) = soak_target(None);
    for seed in 0..3 {
        let out = run_ok_within(
            nbdsh(SOAK)
                .env("URI", format!("nbd://{addr}/vol"))
                .env("SEED", seed.to_string())
                .env("REQUESTS", "150"),
            TIMEOUT * 6,
        );
        assert_eq!(out.trim(), "ok 150", "seed {seed}");
    }
    t.shutdown();
}

#[test]
fn soak_of_large_pipelined_reads_and_writes_through_libnbd_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    certs::make(dir.path());
    let (t, addr) = soak_target(Some(dir.path()));
    for seed in 0..3 {
        let uri = format!("nbds://{addr}/vol?tls-certificates={}", dir.path().display());
        let mut soak = nbdsh(SOAK);
        soak.env("URI", uri).env("SEED", seed.to_string()).env("REQUESTS", "100");
        let out = run_ok_within(&mut soak, TIMEOUT * 6);
        assert_eq!(out.trim(), "ok 100", "seed {seed}");
    }
    t.shutdown();
}
