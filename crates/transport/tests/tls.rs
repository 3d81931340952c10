//! TLS under `FrameIo` over a non-blocking socket pair, with certificates the real `openssl`
//! CLI makes at test time (a CA, a server certificate for `localhost` / 127.0.0.1, a client
//! certificate), in a temporary directory removed afterwards.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;

use skiff_transport::tls::{server_name, CertDir, TlsStream};
use skiff_transport::FrameIo;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().expect("run openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA named `ca`, and `server-*` / `client-*` signed by it, in `dir`; `prefix` lets a test
/// make a second, unrelated CA.
fn make_ca(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            "ca-key.pem",
            "-out",
            "ca-cert.pem",
            "-days",
            "2",
            "-subj",
            "/CN=skiff test CA",
        ],
    );
}

fn make_leaf(dir: &Path, name: &str, cn: &str, ext: &str) {
    let key = format!("{name}-key.pem");
    let csr = format!("{name}.csr");
    let cert = format!("{name}-cert.pem");
    let extfile = format!("{name}.ext");
    std::fs::write(dir.join(&extfile), ext).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={cn}"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca-cert.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "2",
            "-extfile",
            &extfile,
        ],
    );
}

fn make_certs(dir: &Path) {
    make_ca(dir);
    make_leaf(
        dir,
        "server",
        "localhost",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    make_leaf(dir, "client", "client-one", "extendedKeyUsage=clientAuth\n");
}

fn pair() -> (UnixStream, UnixStream) {
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    b.set_nonblocking(true).unwrap();
    (a, b)
}

/// Move `data` from `tx` to `rx` and back the other way, pumping both in one thread (no
/// blocking calls: both sockets are non-blocking), until everything arrived or one side fails.
fn exchange(
    client: &mut TlsStream<UnixStream>,
    server: &mut TlsStream<UnixStream>,
    data: &[u8],
) -> io::Result<(Vec<u8>, Vec<u8>)> {
    let (mut c_sent, mut s_sent) = (0, 0);
    let (mut at_server, mut at_client) = (Vec::new(), Vec::new());
    let mut buf = vec![0u8; 7000]; // odd size: records split across reads
    for _ in 0..100_000 {
        if at_server.len() == data.len() && at_client.len() == data.len() {
            return Ok((at_server, at_client));
        }
        for (io, sent) in [(&mut *client, &mut c_sent), (&mut *server, &mut s_sent)] {
            match io.send(&[IoSlice::new(&data[*sent..])]) {
                Ok(n) => *sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        for (io, got) in [(&mut *server, &mut at_server), (&mut *client, &mut at_client)] {
            loop {
                match io.recv(&mut [IoSliceMut::new(&mut buf)]) {
                    Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e),
                }
                if !io.buffered_recv() && got.len() == data.len() {
                    break;
                }
            }
        }
    }
    Err(io::Error::other("no progress"))
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

#[test]
fn data_crosses_both_ways_intact() {
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path());
    let certs = CertDir::new(dir.path());
    let (a, b) = pair();
    let mut client =
        TlsStream::client(a, certs.client_config().unwrap(), server_name("localhost").unwrap()).unwrap();
    let mut server = TlsStream::server(b, certs.server_config(false).unwrap()).unwrap();
    let data = pattern(3 << 20); // more than the send buffer limit: partial sends
    let (at_server, at_client) = exchange(&mut client, &mut server, &data).unwrap();
    assert!(at_server == data && at_client == data);
    assert!(!client.is_handshaking() && !server.is_handshaking());
    // Without --tls-verify-peer the client cert is not asked for.
    assert!(server.peer_certificates().is_none());
}

#[test]
fn ip_address_names_match_the_san() {
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path());
    let certs = CertDir::new(dir.path());
    let (a, b) = pair();
    let mut client =
        TlsStream::client(a, certs.client_config().unwrap(), server_name("127.0.0.1").unwrap()).unwrap();
    let mut server = TlsStream::server(b, certs.server_config(false).unwrap()).unwrap();
    exchange(&mut client, &mut server, b"SKF1 over TLS").unwrap();
}

#[test]
fn a_wrong_ca_is_refused_by_the_client() {
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path());
    let other = tempfile::tempdir().unwrap();
    make_ca(other.path()); // an unrelated CA: the client trusts only it
    let (a, b) = pair();
    let mut client = TlsStream::client(
        a,
        CertDir::new(other.path()).client_config().unwrap(),
        server_name("localhost").unwrap(),
    )
    .unwrap();
    let mut server = TlsStream::server(b, CertDir::new(dir.path()).server_config(false).unwrap()).unwrap();
    let err = exchange(&mut client, &mut server, b"x").unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
}

#[test]
fn a_wrong_name_is_refused_by_the_client() {
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path());
    let certs = CertDir::new(dir.path());
    let (a, b) = pair();
    let mut client =
        TlsStream::client(a, certs.client_config().unwrap(), server_name("example.com").unwrap()).unwrap();
    let mut server = TlsStream::server(b, certs.server_config(false).unwrap()).unwrap();
    let err = exchange(&mut client, &mut server, b"x").unwrap_err();
    assert!(err.to_string().contains("TLS"), "{err}");
}

#[test]
fn verify_peer_requires_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path());
    let certs = CertDir::new(dir.path());

    // With client-cert.pem there, the client presents it and the target sees it.
    let (a, b) = pair();
    let mut client =
        TlsStream::client(a, certs.client_config().unwrap(), server_name("localhost").unwrap()).unwrap();
    let mut server = TlsStream::server(b, certs.server_config(true).unwrap()).unwrap();
    exchange(&mut client, &mut server, b"hello").unwrap();
    assert_eq!(server.peer_certificates().map(|c| c.len()), Some(1));

    // Without it, the target refuses the handshake.
    std::fs::remove_file(dir.path().join("client-cert.pem")).unwrap();
    let (a, b) = pair();
    let mut client =
        TlsStream::client(a, certs.client_config().unwrap(), server_name("localhost").unwrap()).unwrap();
    let mut server = TlsStream::server(b, certs.server_config(true).unwrap()).unwrap();
    assert!(exchange(&mut client, &mut server, b"hello").is_err());
}

#[test]
fn a_missing_directory_names_the_file() {
    let err = CertDir::new("/nonexistent-skiff-certs").server_config(false).unwrap_err();
    assert!(err.to_string().contains("/nonexistent-skiff-certs/"), "{err}");
}
