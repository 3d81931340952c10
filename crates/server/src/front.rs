//! A connection's protocol, as the worker's connection drives it: one [`FrontEnd`] per
//! protocol (the native protocol, NBD), chosen by the listener the connection arrived on.
//!
//! `Conn` (crate::conn) owns the socket, the buffers, TLS and the timeouts, and asks its front
//! end only what differs between protocols: handle what arrived, whether the handshake is
//! done, how long silence may last, how to say goodbye, and which change of transport the peer
//! has just agreed to. Everything the protocols share stays in `Conn`, written once.

use std::sync::Arc;
use std::time::Duration;

use engine::front::native::NativeConn;
use engine::front::nbd::NbdConn;
use engine::front::Link;
use wire::Status;

use crate::conn::{ConnStream, TxBuf};
use crate::{Bounds, Shared};

/// The protocol a connection speaks, chosen by the listener it arrived on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Native,
    /// The NBD front end.
    Nbd,
}

/// What a connection asks of its protocol's front end.
pub(crate) trait FrontEnd: Send {
    /// Execute what `link.rx` holds, queueing every reply in `link.tx` (see
    /// `engine::front::native::NativeConn::process`).
    fn process(&mut self, link: &mut Link<'_, TxBuf>, shared: &Shared);

    /// The handshake is done: the connection counts as established for admission.
    fn is_established(&self) -> bool;

    /// How long an established connection may stay silent before it is closed.
    fn idle_timeout(&self, bounds: &Bounds) -> Duration;

    /// The frame that tells the peer why the connection ends, if the protocol has one.
    fn goodbye(&self, status: Status, message: &str) -> Option<Vec<u8>>;

    /// On a TLS listener, whether the connection's first byte decides between TLS and
    /// plaintext (the native protocol's frames cannot start like a ClientHello); otherwise
    /// the protocol starts TLS itself (NBD's STARTTLS).
    fn sniffs_tls(&self) -> bool;

    /// The peer agreed (in the handshake just answered) to data messages: read data goes in
    /// messages of its own where the transport can place them.
    fn data_messages(&self) -> bool {
        false
    }

    /// The peer's STARTTLS was acknowledged by the last `process`: the stream turns to TLS
    /// before another byte is read. Reported once.
    fn take_starttls(&mut self) -> bool {
        false
    }

    /// The peer was identified by a verified TLS certificate as `principal`: the exports it
    /// sees may change (NBD after STARTTLS; a native peer proves a key instead).
    fn identify(&mut self, _principal: &str, _shared: &Shared, _peer: &str) {}

    /// Plant a bug of the native front end (others have none to plant).
    #[cfg(feature = "mutations")]
    fn plant(&mut self, _mutation: engine::front::native::mutation::Mutation) {}
}

/// The front end for a new connection of `protocol` over `stream`; an NBD greeting goes into
/// `tx`.
pub(crate) fn front_end<S: ConnStream>(
    protocol: Protocol,
    stream: &S,
    shared: &Shared,
    tx: &mut TxBuf,
) -> Box<dyn FrontEnd> {
    match (protocol, shared.nbd_view()) {
        (Protocol::Nbd, Some(config)) => {
            let mut greeting = Vec::new();
            // TLS runs over TCP only: where it is merely offered, a Unix socket client is not
            // offered it (STARTTLS gets ERR_UNSUP); where it is required, it is refused.
            let config = if stream.is_unix() && config.tls() == ::nbd::TlsPolicy::On {
                Arc::new(::nbd::HandshakeConfig::clone(&config).with_tls(::nbd::TlsPolicy::Off))
            } else {
                config
            };
            let conn = NbdConn::new(config, shared.config.bounds.nbd_extents_per_reply_max, &mut greeting);
            tx.append(&greeting);
            Box::new(conn)
        }
        _ => {
            let mut conn =
                NativeConn::new(shared.config.bounds.limits, shared.config.bounds.open_handles_max);
            if stream.data_messages() {
                conn = conn.with_data_messages();
            }
            // Each connection proves keys against a nonce of its own.
            match rt::random::bytes() {
                Ok(nonce) => {
                    Box::new(conn.with_auth(proto::server::AuthConfig { keys: shared.keys.clone(), nonce }))
                }
                Err(e) => {
                    tracing::error!(error = %e, "no randomness for a handshake nonce: this connection cannot authenticate");
                    Box::new(conn)
                }
            }
        }
    }
}

impl FrontEnd for NativeConn {
    fn process(&mut self, link: &mut Link<'_, TxBuf>, shared: &Shared) {
        NativeConn::process(self, link, shared);
    }

    fn is_established(&self) -> bool {
        NativeConn::is_established(self)
    }

    fn idle_timeout(&self, bounds: &Bounds) -> Duration {
        bounds.idle_timeout
    }

    fn goodbye(&self, status: Status, message: &str) -> Option<Vec<u8>> {
        let goaway = wire::GoAway { status, message: message.to_owned() };
        Some(wire::control::frame(wire::FrameKind::GoAway, &goaway.encode()))
    }

    fn sniffs_tls(&self) -> bool {
        true
    }

    fn data_messages(&self) -> bool {
        NativeConn::data_messages(self)
    }

    #[cfg(feature = "mutations")]
    fn plant(&mut self, mutation: engine::front::native::mutation::Mutation) {
        self.set_mutation(mutation);
    }
}

impl FrontEnd for NbdConn {
    fn process(&mut self, link: &mut Link<'_, TxBuf>, shared: &Shared) {
        NbdConn::process(self, link, shared);
    }

    fn is_established(&self) -> bool {
        NbdConn::is_established(self)
    }

    fn idle_timeout(&self, bounds: &Bounds) -> Duration {
        bounds.nbd_idle_timeout
    }

    /// NBD has no goodbye message: the connection just closes.
    fn goodbye(&self, _: Status, _: &str) -> Option<Vec<u8>> {
        None
    }

    fn sniffs_tls(&self) -> bool {
        false
    }

    fn take_starttls(&mut self) -> bool {
        NbdConn::take_starttls(self)
    }

    fn identify(&mut self, principal: &str, shared: &Shared, peer: &str) {
        let io_bytes_max = shared.config.bounds.limits.io_bytes_max;
        match engine::front::nbd::handshake_config(&shared.exports, io_bytes_max, Some(principal)) {
            Ok(config) => {
                tracing::info!(peer, principal, "NBD client identified by its TLS certificate");
                self.set_config(Arc::new(config));
            }
            Err(e) => tracing::warn!(peer, principal, error = %e, "NBD exports for this principal"),
        }
    }
}
