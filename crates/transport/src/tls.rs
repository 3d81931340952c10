//! TLS under [`FrameIo`]: rustls driven by the caller's own loop, no threads.
//!
//! rustls' [`Connection`] does no I/O of its own: [`TlsStream`] moves ciphertext between it and
//! a non-blocking socket when its owner calls [`FrameIo::recv`] and [`FrameIo::send`], so the
//! target's run-to-completion workers and the initiator's lanes keep their single loop. The
//! handshake runs inside those same calls: the first `recv`/`send` pairs move its records.
//!
//! Certificates are read the nbdkit / qemu `tls-creds-x509` way, from one directory
//! ([`CertDir`]):
//!
//! | file | side | use |
//! |---|---|---|
//! | `ca-cert.pem` | both | the CA that signs the peer's certificate (client: always; server: with `verify_peer`) |
//! | `server-cert.pem`, `server-key.pem` | target | the target's chain and private key |
//! | `client-cert.pem`, `client-key.pem` | initiator | optional: presented when both files are there |
//!
//! The crypto provider is `ring` (no aws-lc, no cmake); TLS 1.2 and 1.3 are offered, rustls'
//! safe defaults.
//!
//! What a driver must know beyond the plaintext contract of [`FrameIo`]:
//!
//! * **Plaintext already decrypted** may wait inside rustls while the socket is not readable:
//!   before sleeping on readability a driver asks [`FrameIo::buffered_recv`] and calls `recv`
//!   again while it is true.
//! * **Ciphertext not yet written**: `send` takes plaintext only when rustls' outgoing buffer is
//!   empty and returns how much it took; what the socket refused stays queued, and
//!   [`FrameIo::pending_send`] says so: the driver then waits for writability (or calls `send`
//!   with an empty list, which only flushes) before sleeping on readability alone. Reads can
//!   queue ciphertext too (handshake messages, key updates, alerts): `recv` flushes what it can.
//! * Zero-copy sends (the target's by-address read data) cannot stay zero-copy under TLS: the
//!   bytes are encrypted, so they are copied through rustls' writer. The plaintext [`Stream`]
//!   path is untouched.
//!
//! [`Stream`]: crate::Stream

use std::fs;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection};
use rustls_pki_types::pem::PemObject;

use crate::FrameIo;

pub use rustls::{ClientConfig as ClientTlsConfig, ServerConfig as ServerTlsConfig};

/// The first byte of a TLS handshake record (a ClientHello); a native frame starts with the
/// magic `SKF1` (0x53), so a listener in mode [`TlsMode::On`] tells the two apart from one byte.
pub const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// How much plaintext rustls buffers on the sending side before `send` pushes back (returns
/// fewer bytes than offered): enough for the largest frame bursts, bounded like a socket buffer.
pub const SEND_BUFFER_LIMIT: usize = 1 << 20;

/// Whether a listener or a connection uses TLS; the names are nbdkit's `--tls`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// Plaintext only.
    #[default]
    Off,
    /// Both: TLS when the peer starts it, plaintext otherwise.
    On,
    /// TLS only: a plaintext peer is refused.
    Require,
}

impl std::str::FromStr for TlsMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(TlsMode::Off),
            "on" => Ok(TlsMode::On),
            "require" => Ok(TlsMode::Require),
            other => Err(format!("unknown TLS mode {other:?} (expected off, on or require)")),
        }
    }
}

impl std::fmt::Display for TlsMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TlsMode::Off => "off",
            TlsMode::On => "on",
            TlsMode::Require => "require",
        })
    }
}

/// Whether a connection's first byte opens a TLS handshake.
pub fn looks_like_tls(first_byte: u8) -> bool {
    first_byte == TLS_HANDSHAKE_RECORD
}

/// Why a certificate directory could not be turned into a TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path}: {what}")]
    Pem { path: PathBuf, what: String },
    #[error("{path}: no certificate in the file")]
    NoCertificate { path: PathBuf },
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client certificate verifier: {0}")]
    Verifier(String),
}

/// A directory of PEM files laid out as nbdkit and qemu's `tls-creds-x509` expect.
#[derive(Debug, Clone)]
pub struct CertDir(pub PathBuf);

impl CertDir {
    pub fn new(dir: impl Into<PathBuf>) -> CertDir {
        CertDir(dir.into())
    }

    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn certs(&self, name: &str) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
        let path = self.file(name);
        let bytes = fs::read(&path).map_err(|source| TlsConfigError::Read { path: path.clone(), source })?;
        let certs = CertificateDer::pem_slice_iter(&bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TlsConfigError::Pem { path: path.clone(), what: e.to_string() })?;
        if certs.is_empty() {
            return Err(TlsConfigError::NoCertificate { path });
        }
        Ok(certs)
    }

    fn key(&self, name: &str) -> Result<PrivateKeyDer<'static>, TlsConfigError> {
        let path = self.file(name);
        let bytes = fs::read(&path).map_err(|source| TlsConfigError::Read { path: path.clone(), source })?;
        PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsConfigError::Pem { path, what: e.to_string() })
    }

    fn roots(&self) -> Result<RootCertStore, TlsConfigError> {
        let mut roots = RootCertStore::empty();
        for cert in self.certs("ca-cert.pem")? {
            roots.add(cert)?;
        }
        Ok(roots)
    }

    /// The target's configuration: `server-cert.pem` and `server-key.pem`; with `verify_peer`,
    /// every client must present a certificate signed by `ca-cert.pem`.
    pub fn server_config(&self, verify_peer: bool) -> Result<Arc<ServerConfig>, TlsConfigError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder =
            ServerConfig::builder_with_provider(provider.clone()).with_safe_default_protocol_versions()?;
        let builder = if verify_peer {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(self.roots()?),
                provider,
            )
            .build()
            .map_err(|e| TlsConfigError::Verifier(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder.with_single_cert(self.certs("server-cert.pem")?, self.key("server-key.pem")?)?;
        Ok(Arc::new(config))
    }

    /// The initiator's configuration: the target is verified against `ca-cert.pem`;
    /// `client-cert.pem` and `client-key.pem` are presented when both are there.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, TlsConfigError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(self.roots()?);
        let config = if self.file("client-cert.pem").exists() && self.file("client-key.pem").exists() {
            builder.with_client_auth_cert(self.certs("client-cert.pem")?, self.key("client-key.pem")?)?
        } else {
            builder.with_no_client_auth()
        };
        Ok(Arc::new(config))
    }
}

/// The name a client checks the target's certificate against: the endpoint's host (a DNS name
/// or an IP address literal, as in the certificate's subjectAltName).
pub fn server_name(host: &str) -> io::Result<ServerName<'static>> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("TLS server name {host:?}: {e}")))
}

/// The principal a certificate names: the first Common Name (CN) of its subject, as nbdkit's
/// `nbdkit_peer_tls_dn` users and qemu's `tls-authz` match on. Trust it only for a certificate
/// the TLS handshake verified against the CA (a target with `verify_peer`): the name is what
/// the CA vouched for. `None` for DER that does not parse, a subject without a CN, or an empty
/// one.
pub fn certificate_principal(cert: &CertificateDer<'_>) -> Option<String> {
    use x509_cert::der::Decode;
    let cert = x509_cert::Certificate::from_der(cert.as_ref()).ok()?;
    let cn = cert.tbs_certificate().subject().common_name().ok()??;
    Some(cn.value().into_owned()).filter(|name| !name.is_empty())
}

/// A byte stream (a non-blocking socket) carrying TLS, presented as plaintext [`FrameIo`].
pub struct TlsStream<S> {
    sock: S,
    conn: Connection,
    /// Decrypted bytes rustls holds that `recv` has not handed out yet.
    plaintext_pending: usize,
    /// The peer sent close_notify, or the socket reached end of file.
    closed: bool,
    /// The last read of the socket would have blocked: everything it had is inside rustls. A
    /// read of fewer plaintext bytes than asked for does not mean the socket is empty (rustls
    /// reads it a record at a time), so an edge-triggered driver reads until this is true.
    drained: bool,
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
}

impl<S: Read + Write> TlsStream<S> {
    /// The target side of a connection over `sock`.
    pub fn server(sock: S, config: Arc<ServerConfig>) -> io::Result<TlsStream<S>> {
        let conn = ServerConnection::new(config).map_err(tls_error)?;
        Ok(TlsStream::wrap(sock, conn.into()))
    }

    /// The initiator side, checking the target's certificate against `name`.
    pub fn client(sock: S, config: Arc<ClientConfig>, name: ServerName<'static>) -> io::Result<TlsStream<S>> {
        let conn = ClientConnection::new(config, name).map_err(tls_error)?;
        Ok(TlsStream::wrap(sock, conn.into()))
    }

    fn wrap(sock: S, mut conn: Connection) -> TlsStream<S> {
        conn.set_buffer_limit(Some(SEND_BUFFER_LIMIT));
        TlsStream { sock, conn, plaintext_pending: 0, closed: false, drained: false }
    }

    /// The socket underneath (for registering with a poller, or its fd).
    pub fn get_ref(&self) -> &S {
        &self.sock
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.sock
    }

    pub fn is_handshaking(&self) -> bool {
        self.conn.is_handshaking()
    }

    /// The peer's certificate chain as it sent it (end entity first), once the handshake is
    /// done and only if it presented one; on the target with `verify_peer` it is verified.
    pub fn peer_certificates(&self) -> Option<&[CertificateDer<'static>]> {
        self.conn.peer_certificates()
    }

    /// Who the peer proved to be: the Common Name of the subject of the certificate it
    /// presented (see [`certificate_principal`]). `None` before the handshake is done, when it
    /// presented none, or when the subject has no usable CN.
    pub fn peer_principal(&self) -> Option<String> {
        certificate_principal(self.peer_certificates()?.first()?)
    }

    /// End the session cleanly: queue the `close_notify` alert and write what the socket takes
    /// now. The rest, if any, goes out through [`FrameIo::pending_send`] and an empty
    /// [`FrameIo::send`]; the caller closes the socket once nothing is pending, so the peer
    /// sees a TLS end rather than a truncated stream.
    pub fn close(&mut self) {
        self.conn.send_close_notify();
        let _ = self.flush_quietly();
    }

    /// Write queued ciphertext to the socket until it is all out or the socket would block.
    pub fn flush_tls(&mut self) -> io::Result<()> {
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut self.sock) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn flush_quietly(&mut self) -> io::Result<()> {
        match self.flush_tls() {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
            other => other,
        }
    }

    /// Feed what the socket has to rustls: `Ok(true)` when something came, `Ok(false)` at end
    /// of file.
    fn pull(&mut self) -> io::Result<bool> {
        let n = loop {
            match self.conn.read_tls(&mut self.sock) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.drained = true;
                    return Err(e);
                }
                other => break other?,
            }
        };
        self.drained = false;
        if n == 0 {
            return Ok(false);
        }
        match self.conn.process_new_packets() {
            Ok(state) => {
                self.plaintext_pending = state.plaintext_bytes_to_read();
                if state.peer_has_closed() {
                    self.closed = true;
                }
            }
            Err(e) => {
                // Send the alert rustls queued for the peer before giving up.
                let _ = self.flush_tls();
                return Err(tls_error(e));
            }
        }
        // Handshake messages, key updates, alerts.
        self.flush_quietly()?;
        Ok(true)
    }
}

impl<S: Read + Write> FrameIo for TlsStream<S> {
    fn recv(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        loop {
            if self.plaintext_pending > 0 {
                let n = self.conn.reader().read_vectored(bufs)?;
                self.plaintext_pending -= n.min(self.plaintext_pending);
                return Ok(n);
            }
            if self.closed {
                return Ok(0);
            }
            // Whatever the handshake or an earlier read left to say goes first.
            self.flush_quietly()?;
            if !self.pull()? {
                self.closed = true;
                if self.conn.is_handshaking() {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "TLS: the peer closed during the handshake",
                    ));
                }
                return Ok(0);
            }
        }
    }

    fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.flush_tls()?;
        let wanted: usize = bufs.iter().map(|b| b.len()).sum();
        if wanted == 0 {
            return Ok(0);
        }
        let n = self.conn.writer().write_vectored(bufs)?;
        self.flush_quietly()?;
        if n == 0 {
            // rustls' buffer is full (the handshake is not done and its limit is reached).
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }

    fn pending_send(&self) -> bool {
        self.conn.wants_write()
    }

    fn buffered_recv(&self) -> bool {
        self.plaintext_pending > 0 || !(self.drained || self.closed)
    }
}

/// The owner's `Path` of a certificate directory, for messages.
impl AsRef<Path> for CertDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_principal_comes_only_from_a_certificate_that_parses() {
        for junk in [&b""[..], b"\x30", b"\x30\x03\x02\x01\x01", &[0xff; 64]] {
            assert_eq!(certificate_principal(&CertificateDer::from(junk)), None, "{junk:?}");
        }
    }
}
