//! One lane's connection to its target, across transports: the handshake on each new transport
//! ([`Opening`]: HELLO, AUTH, OPEN, GRANT), the session that carries the requests
//! ([`ClientSession`]), the silence deadline, and the reconnection policy ([`Reconnect`]),
//! behind one [`poll_timeout`](Connection::poll_timeout).
//!
//! Sans-I/O, like the session: the driver owns the transports and the clock. It connects a
//! transport when the connection asks ([`Event::Connect`]) and closes it when told
//! ([`Event::Disconnect`]); it sends what [`poll_transmit`](Connection::poll_transmit) gathers,
//! hands over what arrives ([`handle_rx`](Connection::handle_rx)), reports a transport that
//! failed ([`handle_transport_lost`](Connection::handle_transport_lost)), and calls
//! [`handle_timeout`](Connection::handle_timeout) when `poll_timeout` comes. Everything else,
//! which losses are retried, when attempts start, when waiting requests fail, when to give
//! up, whether the target that answers is still the same, is decided here, so the seeded
//! simulator runs the same decisions as a lane.
//!
//! The first connection is opened by the driver with an [`Opening`] of its own before the
//! connection exists (a lane fails at once if the target is not there); every later one is
//! opened here.

use std::io::IoSlice;
use std::sync::Arc;

use wire::control::{Limits, OpenReply, FEATURE_DATA_MESSAGES, FEATURE_DIRECT_READS, NONCE_LEN};
use wire::{Capability, FrameBuffer, FrameKind, Status};

use super::handshake::{admit_control, expect, handle_open_reply, ClientHandshake};
use super::reconnect::{Action, Reconnect, ReconnectConfig};
use super::session::{ClientSession, IoBuf, Mutation, SessionConfig};
use crate::auth::Key;
use crate::ProtoError;

/// What a connection is to its target, on every transport it will use.
#[derive(Debug, Clone)]
pub struct ConnectionConfig {
    /// The export to open.
    pub export: String,
    /// The limits to propose (zero fields: the target's choice).
    pub proposed: Limits,
    /// HELLO feature bits to ask for besides authentication and data messages (which follow
    /// from `key` and from each transport).
    pub features: u64,
    /// The key to prove on every transport; `None` connects without one.
    pub key: Option<Arc<Key>>,
    /// Chunk grants to present right after OPEN, on every transport.
    pub grants: Arc<[Capability]>,
    pub session: SessionConfig,
    pub reconnect: ReconnectConfig,
    /// Requests on the wire and nothing heard for this long: the transport is dead.
    pub timeout_us: u64,
    /// How long one reconnection attempt's handshake may take.
    pub attempt_timeout_us: u64,
}

/// The handshake on one new transport: HELLO (and AUTH with a key), OPEN, then the grants,
/// one reply awaited before the next frame goes.
#[derive(Debug)]
pub struct Opening {
    handshake: ClientHandshake,
    export: String,
    grants: Arc<[Capability]>,
    step: Step,
    /// Frames to send, and how much of them has been sent.
    out: Vec<u8>,
    sent: usize,
    limits: Limits,
    features: u64,
    /// A planted bug: take this OPEN_REPLY as the answer without sending OPEN.
    skip_open: Option<OpenReply>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Hello,
    Auth,
    Open,
    /// Waiting for the reply to the grants from index `from` on, for the export `reply` opened.
    Grant {
        from: usize,
        reply: OpenReply,
    },
}

/// A transport on which the export is open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    pub limits: Limits,
    /// HELLO features the target agreed to.
    pub features: u64,
    pub reply: OpenReply,
}

impl Opening {
    /// A handshake for `config` on a transport that can (`data_messages`) or cannot place read
    /// data by tag. `nonce` is this side's random contribution to the key's proof (unused
    /// without a key).
    pub fn new(config: &ConnectionConfig, data_messages: bool, nonce: [u8; NONCE_LEN]) -> Opening {
        let features = if data_messages {
            config.features | FEATURE_DATA_MESSAGES
        } else {
            config.features & !FEATURE_DATA_MESSAGES
        };
        let mut handshake = ClientHandshake::new(config.proposed).with_features(features);
        if let Some(key) = &config.key {
            handshake = handshake.with_key(Key::clone(key), nonce);
        }
        Opening {
            out: handshake.hello_frame(),
            handshake,
            export: config.export.clone(),
            grants: config.grants.clone(),
            step: Step::Hello,
            sent: 0,
            limits: config.proposed,
            features: 0,
            skip_open: None,
        }
    }

    /// Bytes to send now (empty: waiting for a reply).
    pub fn poll_transmit(&self) -> &[u8] {
        &self.out[self.sent..]
    }

    /// `n` bytes of [`poll_transmit`](Self::poll_transmit) were sent.
    pub fn handle_sent(&mut self, n: usize) {
        assert!(self.sent + n <= self.out.len(), "sent more than was gathered");
        self.sent += n;
        if self.sent == self.out.len() {
            self.out.clear();
            self.sent = 0;
        }
    }

    /// Take the replies that arrived whole in `rx`. Returns the open export once the last
    /// reply is in; what follows it stays in `rx` for the session. A refusal (`Refused`,
    /// including a `GOAWAY`) or a broken reply fails the handshake.
    pub fn handle_rx(&mut self, rx: &mut FrameBuffer) -> Result<Option<Opened>, ProtoError> {
        while let Some(frame) = rx.next_frame(admit_control)? {
            let (h, body) = (frame.header, rx.body(&frame));
            let opened = match self.step {
                Step::Hello => {
                    (self.limits, self.features) = self.handshake.handle_reply_features(&h, body)?;
                    match self.handshake.auth_frame() {
                        Some(auth) => {
                            self.out.extend_from_slice(&auth);
                            self.step = Step::Auth;
                            None
                        }
                        None => self.open(),
                    }
                }
                Step::Auth => {
                    self.handshake.handle_auth_reply(&h, body)?;
                    self.open()
                }
                Step::Open => self.granted(handle_open_reply(&h, body)?, 0),
                Step::Grant { from, reply } => {
                    let answer = expect(&h, body, FrameKind::GrantReply, wire::GrantReply::decode)?;
                    if !answer.status.is_ok() {
                        return Err(ProtoError::Refused(answer.status));
                    }
                    self.granted(reply, from + wire::GRANTS_PER_FRAME_MAX)
                }
            };
            if opened.is_some() {
                return Ok(opened);
            }
        }
        Ok(None)
    }

    /// Send OPEN (or, with the planted bug, skip it).
    fn open(&mut self) -> Option<Opened> {
        if let Some(reply) = self.skip_open {
            return self.granted(reply, 0);
        }
        let open = wire::Open { name: self.export.clone() };
        self.out.extend_from_slice(&wire::control::frame(FrameKind::Open, &open.encode()));
        self.step = Step::Open;
        None
    }

    /// The export is open as `reply`: send the grants from `from` on, or finish.
    fn granted(&mut self, reply: OpenReply, from: usize) -> Option<Opened> {
        let Some(batch) = self.grants.get(from..).filter(|rest| !rest.is_empty()) else {
            return Some(Opened { limits: self.limits, features: self.features, reply });
        };
        let batch = &batch[..batch.len().min(wire::GRANTS_PER_FRAME_MAX)];
        let grant = wire::Grant { handle: reply.handle, caps: batch.to_vec() };
        self.out.extend_from_slice(&wire::control::frame(FrameKind::Grant, &grant.encode()));
        self.step = Step::Grant { from, reply };
        None
    }
}

/// What the driver must do to the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Open a new transport to the target and report it with
    /// [`handle_transport_up`](Connection::handle_transport_up) or
    /// [`handle_transport_failed`](Connection::handle_transport_failed); may take a while
    /// (it is one attempt of the reconnection policy).
    Connect,
    /// Close the current transport: it is lost or no longer trusted. The next one starts with
    /// an empty receive buffer.
    Disconnect,
}

/// Why a connection closed for good. Every request has completed (with an I/O error) or will
/// complete from what was already received.
#[derive(Debug, Clone, PartialEq)]
pub enum Closed {
    /// The target broke the protocol or refused, or came back different after a loss.
    Protocol(ProtoError),
    /// Requests were on the wire and nothing came back for the timeout, and reconnection is
    /// off.
    Silent,
    /// The transport failed and reconnection is off (the driver has the cause).
    Transport,
    /// Reconnection gave up (`ctrl_loss_timeout`).
    GaveUp,
}

/// Where the connection's transport stands.
#[derive(Debug)]
enum Link {
    /// The export is open on the transport; the session runs.
    Up,
    /// Lost; no transport. The policy says when the next attempt starts.
    Down,
    /// The driver is connecting a transport.
    Connecting,
    /// A new transport is up and its handshake runs until `deadline_us`.
    Opening { opening: Box<Opening>, deadline_us: u64 },
    /// Closed for good.
    Closed,
}

/// One lane's connection: see the module's documentation.
pub struct Connection<B> {
    config: ConnectionConfig,
    session: ClientSession<B>,
    reconnect: Reconnect,
    link: Link,
    /// The export as first opened: a reconnection must find it the same.
    first: OpenReply,
    /// Since when the connection has waited without hearing from the target: the later of the
    /// last bytes received, the last (re)connection, and the moment requests went on an idle
    /// wire.
    quiet_since_us: u64,
    connect: bool,
    disconnect: bool,
}

impl<B: IoBuf> Connection<B> {
    /// A connection whose first transport the driver has opened (`opened`, at `now_us`).
    pub fn new(config: ConnectionConfig, opened: Opened, now_us: u64) -> Connection<B> {
        let mut session_config = config.session;
        if opened.features & FEATURE_DIRECT_READS == 0 {
            session_config.directory_entries = 0;
        }
        let mut session = ClientSession::new(&session_config, opened.limits, opened.reply.handle);
        session.set_data_messages(opened.features & FEATURE_DATA_MESSAGES != 0);
        Connection {
            reconnect: Reconnect::new(config.reconnect),
            config,
            session,
            link: Link::Up,
            first: opened.reply,
            quiet_since_us: now_us,
            connect: false,
            disconnect: false,
        }
    }

    /// Plant a bug, for the simulator's proof that it catches them. The session keeps it;
    /// the connection's own bugs (`ReopenWithoutOpen`, `NoRetry`) are read from there.
    #[cfg(feature = "mutations")]
    pub fn set_mutation(&mut self, mutation: Mutation) {
        self.session.set_mutation(mutation);
    }

    fn planted(&self) -> Mutation {
        self.session.planted()
    }

    pub fn config(&self) -> &ConnectionConfig {
        &self.config
    }

    /// The export as it was opened.
    pub fn export(&self) -> &OpenReply {
        &self.first
    }

    pub fn session(&self) -> &ClientSession<B> {
        &self.session
    }

    /// The session, for submitting and taking completions. Its connection-level calls
    /// (`handle_disconnected`, `handle_closed`, `reattach`, `fail_parked`) are this type's.
    pub fn session_mut(&mut self) -> &mut ClientSession<B> {
        &mut self.session
    }

    /// The reconnection policy's state and counters.
    pub fn reconnect(&self) -> &Reconnect {
        &self.reconnect
    }

    /// The export is open on the current transport and the session runs on it.
    pub fn is_up(&self) -> bool {
        matches!(self.link, Link::Up)
    }

    /// A transport is there to receive from (the session's, or one in its handshake).
    pub fn has_transport(&self) -> bool {
        matches!(self.link, Link::Up | Link::Opening { .. })
    }

    /// The connection was lost and is not back yet.
    pub fn is_reconnecting(&self) -> bool {
        matches!(self.link, Link::Down | Link::Connecting | Link::Opening { .. })
    }

    /// Closed for good.
    pub fn is_closed(&self) -> bool {
        matches!(self.link, Link::Closed)
    }

    /// What the driver must do to the transport now, if anything. Ask after every call.
    pub fn poll_event(&mut self) -> Option<Event> {
        // A transport is closed before the next one is asked for.
        if std::mem::take(&mut self.disconnect) {
            return Some(Event::Disconnect);
        }
        std::mem::take(&mut self.connect).then_some(Event::Connect)
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next due (`None`: nothing is, until
    /// the driver calls something else).
    pub fn poll_timeout(&self) -> Option<u64> {
        let session = self.session.poll_timeout();
        let link = match &self.link {
            Link::Up => self.silence_due(),
            Link::Opening { deadline_us, .. } => {
                Some(self.reconnect.poll_timeout().map_or(*deadline_us, |t| t.min(*deadline_us)))
            }
            Link::Down | Link::Connecting => self.reconnect.poll_timeout(),
            Link::Closed => return None,
        };
        [session, link].into_iter().flatten().min()
    }

    /// When silence would reach the timeout: requests are on the wire and the session runs.
    pub fn silence_due(&self) -> Option<u64> {
        (self.is_up() && self.session.on_the_wire() > 0)
            .then(|| self.quiet_since_us.saturating_add(self.config.timeout_us))
    }

    /// Do what is due at `now_us`: the open caravan's delay bound, the silence deadline, a
    /// handshake that takes too long, and the reconnection policy's steps. Fails when the
    /// connection closes for good.
    pub fn handle_timeout(&mut self, now_us: u64) -> Result<(), Closed> {
        self.session.handle_timeout(now_us);
        match &self.link {
            Link::Up if self.silence_due().is_some_and(|due| now_us >= due) => {
                self.lose(now_us, Closed::Silent)?;
            }
            Link::Opening { deadline_us, .. } if now_us >= *deadline_us => self.attempt_failed(now_us),
            _ => {}
        }
        if self.planted() == Mutation::NoRetry {
            return Ok(());
        }
        self.drive_policy(now_us)
    }

    /// Bytes arrived from the target (whether into the frame buffer or placed directly).
    pub fn handle_received(&mut self, now_us: u64) {
        self.quiet_since_us = now_us;
    }

    /// Whether anything waits to be sent on the current transport.
    pub fn has_transmit(&self) -> bool {
        match &self.link {
            Link::Up => self.session.has_transmit(),
            Link::Opening { opening, .. } => !opening.poll_transmit().is_empty(),
            _ => false,
        }
    }

    /// Gather what to send into `iov`; returns the slices used.
    pub fn poll_transmit<'a>(&'a self, iov: &mut [IoSlice<'a>]) -> usize {
        match &self.link {
            Link::Up => self.session.poll_transmit(iov),
            Link::Opening { opening, .. } if !opening.poll_transmit().is_empty() && !iov.is_empty() => {
                iov[0] = IoSlice::new(opening.poll_transmit());
                1
            }
            _ => 0,
        }
    }

    /// `n` bytes of what [`poll_transmit`](Self::poll_transmit) gathered were sent at `now_us`.
    pub fn handle_sent(&mut self, now_us: u64, n: usize) {
        match &mut self.link {
            Link::Up => {
                if self.session.on_the_wire() == 0 {
                    // Requests go on an idle wire: silence counts from now.
                    self.quiet_since_us = now_us;
                }
                self.session.handle_sent(n);
            }
            Link::Opening { opening, .. } => opening.handle_sent(n),
            _ => assert_eq!(n, 0, "sent bytes with no transport"),
        }
    }

    /// Handle what the frame buffer holds: the session's completions, or the replies of a
    /// handshake. Returns whether a completion became ready. A retryable loss (the target
    /// said it stops or timed the connection out, a reconnection's refusal) starts or goes on
    /// reconnecting; anything else closes the connection for good.
    pub fn handle_rx(&mut self, now_us: u64, rx: &mut FrameBuffer) -> Result<bool, Closed> {
        match &mut self.link {
            Link::Up => {
                let before = self.session.ready();
                match self.session.handle_rx(now_us, rx.unconsumed()) {
                    Ok(progress) => {
                        rx.consume(progress.consumed);
                        if progress.need > 0 {
                            rx.reserve(progress.need);
                        }
                    }
                    Err(e) if is_goodbye(&e) => self.lose(now_us, Closed::Protocol(e))?,
                    Err(e) => {
                        self.close();
                        return Err(Closed::Protocol(e));
                    }
                }
                Ok(self.session.ready() > before)
            }
            Link::Opening { opening, .. } => {
                match opening.handle_rx(rx) {
                    Ok(None) => {}
                    Ok(Some(opened)) => self.reattach(now_us, opened)?,
                    Err(e) if is_refusal(&e) => self.attempt_failed(now_us),
                    Err(e) => {
                        self.close();
                        return Err(Closed::Protocol(e));
                    }
                }
                self.drive_policy(now_us)?;
                Ok(false)
            }
            _ => Ok(false),
        }
    }

    /// The driver's transport is up after [`Event::Connect`]: start its handshake. It can
    /// (`data_messages`) or cannot place read data by tag; `nonce` is fresh randomness for
    /// the key's proof.
    pub fn handle_transport_up(&mut self, now_us: u64, data_messages: bool, nonce: [u8; NONCE_LEN]) {
        if !matches!(self.link, Link::Connecting) {
            // Closed for good meanwhile: the transport is not wanted.
            self.disconnect = true;
            return;
        }
        let mut opening = Opening::new(&self.config, data_messages, nonce);
        if self.planted() == Mutation::ReopenWithoutOpen {
            opening.skip_open = Some(OpenReply { handle: self.session.handle(), ..self.first });
        }
        let deadline_us = now_us.saturating_add(self.config.attempt_timeout_us);
        self.link = Link::Opening { opening: Box::new(opening), deadline_us };
    }

    /// The driver could not open a transport after [`Event::Connect`].
    pub fn handle_transport_failed(&mut self, now_us: u64) {
        if matches!(self.link, Link::Connecting) {
            self.link = Link::Down;
            self.reconnect.handle_attempt_failed(now_us);
        }
    }

    /// The current transport failed (a send or receive error, the peer's close). Returns
    /// whether the connection goes on (reconnecting); if not, it closed for good and the
    /// driver reports its own error.
    pub fn handle_transport_lost(&mut self, now_us: u64) -> bool {
        match self.link {
            Link::Up => self.lose(now_us, Closed::Transport).is_ok(),
            Link::Opening { .. } => {
                self.attempt_failed(now_us);
                true
            }
            Link::Down | Link::Connecting => true,
            Link::Closed => false,
        }
    }

    /// Close for good now, as a caller that gives up does: every request completes with an
    /// I/O error.
    pub fn close(&mut self) {
        if self.has_transport() {
            self.disconnect = true;
        }
        self.session.handle_closed();
        self.link = Link::Closed;
    }

    /// The session's transport is gone: reconnect, or close with `why` when reconnection is
    /// off or the session is past saving.
    fn lose(&mut self, now_us: u64, why: Closed) -> Result<(), Closed> {
        if self.session.is_broken() || !self.reconnect.handle_lost(now_us) {
            self.close();
            return Err(why);
        }
        self.disconnect = true;
        self.session.handle_disconnected();
        self.link = Link::Down;
        self.drive_policy(now_us)
    }

    /// A reconnection attempt's transport or handshake failed: the policy schedules the next.
    fn attempt_failed(&mut self, now_us: u64) {
        self.disconnect = true;
        self.link = Link::Down;
        self.reconnect.handle_attempt_failed(now_us);
    }

    /// A new transport has the export open: the session runs on it if it is the same export.
    fn reattach(&mut self, now_us: u64, opened: Opened) -> Result<(), Closed> {
        let (was, now) = (&self.first, &opened.reply);
        let attached = if now.size_bytes != was.size_bytes || now.block_size != was.block_size {
            Err(ProtoError::Unexpected(
                FrameKind::OpenReply,
                "after reconnecting: the export's size or block size changed",
            ))
        } else {
            self.session.reattach(opened.limits, now.handle)
        };
        if let Err(e) = attached {
            self.close();
            return Err(Closed::Protocol(e));
        }
        self.session.set_data_messages(opened.features & FEATURE_DATA_MESSAGES != 0);
        self.reconnect.handle_connected();
        self.link = Link::Up;
        self.quiet_since_us = now_us;
        Ok(())
    }

    /// Take the reconnection policy's steps due at `now_us`.
    fn drive_policy(&mut self, now_us: u64) -> Result<(), Closed> {
        if !self.is_reconnecting() {
            return Ok(());
        }
        loop {
            match self.reconnect.poll_action(now_us) {
                Action::Wait { .. } => return Ok(()),
                Action::Attempt => {
                    self.link = Link::Connecting;
                    self.connect = true;
                }
                Action::FailIo => self.session.fail_parked(),
                Action::GiveUp => {
                    self.close();
                    return Err(Closed::GaveUp);
                }
            }
        }
    }
}

/// Whether the session's transport ended in a way worth another: the target said it stops or
/// timed the connection out. A broken protocol, or a GOAWAY for anything else, is not.
pub fn is_goodbye(e: &ProtoError) -> bool {
    matches!(e, ProtoError::GoAway { status: Status::TimedOut | Status::ShuttingDown, .. })
}

/// Whether a reconnection's handshake failed in a way the next attempt may not: the target
/// refused (a `GOAWAY` in the handshake is a refusal too), perhaps a restarting target's
/// admission limit. A broken reply or an impostor is not retried.
pub fn is_refusal(e: &ProtoError) -> bool {
    matches!(e, ProtoError::Refused(_) | ProtoError::GoAway { .. })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caravan::Doorbell;
    use crate::client::{Batching, Submission, DIRECT_OFF};
    use wire::control::{ExportFlags, HelloReply};
    use wire::{CapKind, CapRights, Opcode, ReqFlags, VERSION};

    const TIMEOUT_US: u64 = 1_000_000;
    const LIMITS: Limits =
        Limits { queue_depth: 8, caravan_reqs_max: 8, caravan_bytes_max: 1 << 16, io_bytes_max: 4096 };

    fn config(reconnect: ReconnectConfig) -> ConnectionConfig {
        ConnectionConfig {
            export: "vol".into(),
            proposed: LIMITS,
            features: 0,
            key: None,
            grants: Arc::new([]),
            session: SessionConfig {
                doorbell: Doorbell { aggregation_reqs: 1, aggregation_bytes: 0, delay_us: 0 },
                batching: Batching::Off,
                direct_min_bytes: DIRECT_OFF,
                directory_entries: 0,
            },
            reconnect,
            timeout_us: TIMEOUT_US,
            attempt_timeout_us: TIMEOUT_US,
        }
    }

    fn reconnecting() -> ReconnectConfig {
        ReconnectConfig {
            reconnect_delay_us: 100_000,
            ctrl_loss_timeout_us: 10_000_000,
            fast_io_fail_timeout_us: None,
        }
    }

    fn open_reply(handle: u32, size_bytes: u64) -> OpenReply {
        OpenReply { status: Status::Ok, handle, size_bytes, block_size: 512, flags: ExportFlags(0) }
    }

    fn hello_reply() -> Vec<u8> {
        let reply = HelloReply {
            status: Status::Ok,
            version: VERSION,
            features: 0,
            limits: LIMITS,
            auth_nonce: None,
        };
        wire::control::frame(FrameKind::HelloReply, &reply.encode())
    }

    fn open_frame(reply: OpenReply) -> Vec<u8> {
        wire::control::frame(FrameKind::OpenReply, &reply.encode())
    }

    /// A connection up on its first transport with one read sent.
    fn up_with_a_read(reconnect: ReconnectConfig) -> Connection<Vec<u8>> {
        let opened = Opened { limits: LIMITS, features: 0, reply: open_reply(1, 1 << 20) };
        let mut c = Connection::new(config(reconnect), opened, 0);
        let read = Submission {
            opcode: Opcode::Read,
            flags: ReqFlags::empty(),
            offset: 0,
            length: 512,
            buf: Some(vec![0; 512]),
            user_data: 7,
        };
        c.session_mut().submit(0, read).expect("room for a read");
        c.session_mut().commit();
        send_all(&mut c, 0);
        assert_eq!(c.session().on_the_wire(), 1);
        c
    }

    /// Send everything gathered; returns the bytes.
    fn send_all(c: &mut Connection<Vec<u8>>, now: u64) -> Vec<u8> {
        let mut out = Vec::new();
        while c.has_transmit() {
            let mut iov = [IoSlice::new(&[]); 8];
            let n = c.poll_transmit(&mut iov);
            let bytes: Vec<u8> = iov[..n].iter().flat_map(|s| s.iter().copied()).collect();
            c.handle_sent(now, bytes.len());
            out.extend(bytes);
        }
        out
    }

    fn events(c: &mut Connection<Vec<u8>>) -> Vec<Event> {
        std::iter::from_fn(|| c.poll_event()).collect()
    }

    /// The kinds of the frames in `bytes`.
    fn kinds(bytes: &[u8]) -> Vec<FrameKind> {
        let mut rx = FrameBuffer::new();
        rx.extend(bytes);
        std::iter::from_fn(|| rx.next_frame::<wire::WireError>(|_| Ok(())).unwrap().map(|f| f.header.kind))
            .collect()
    }

    fn completions(c: &mut Connection<Vec<u8>>) -> Vec<(u64, Status)> {
        let mut out = Vec::new();
        c.session_mut().take_completions(&mut out);
        out.iter().map(|c| (c.user_data, c.status)).collect()
    }

    #[test]
    fn a_lost_transport_is_replaced_and_the_request_sent_again() {
        let mut c = up_with_a_read(reconnecting());
        assert!(c.handle_transport_lost(10));
        // The lost transport is closed before the first attempt, which starts at once.
        assert_eq!(events(&mut c), [Event::Disconnect, Event::Connect]);
        assert!(c.is_reconnecting() && !c.has_transport());
        c.handle_transport_up(20, false, [0; NONCE_LEN]);
        assert_eq!(kinds(&send_all(&mut c, 20)), [FrameKind::Hello]);
        let mut rx = FrameBuffer::new();
        rx.extend(&hello_reply());
        assert_eq!(c.handle_rx(30, &mut rx), Ok(false));
        assert_eq!(kinds(&send_all(&mut c, 30)), [FrameKind::Open]);
        rx.extend(&open_frame(open_reply(5, 1 << 20)));
        assert_eq!(c.handle_rx(40, &mut rx), Ok(false));
        assert!(c.is_up() && !c.is_reconnecting());
        assert_eq!(c.session().handle(), 5, "requests go under the new connection's handle");
        assert_eq!(kinds(&send_all(&mut c, 40)), [FrameKind::Requests], "the read is sent again");
        assert!(completions(&mut c).is_empty(), "nothing failed");
        assert_eq!((c.reconnect().losses, c.reconnect().attempts), (1, 1));
    }

    /// A connection with a read in flight whose transport was lost at 10 µs, with a new one
    /// up at 20 µs and HELLO sent on it.
    fn reconnecting_with_a_read() -> Connection<Vec<u8>> {
        let mut c = up_with_a_read(reconnecting());
        assert!(c.handle_transport_lost(10));
        events(&mut c);
        c.handle_transport_up(20, false, [0; NONCE_LEN]);
        send_all(&mut c, 20);
        c
    }

    #[test]
    fn a_target_that_comes_back_different_closes_for_good() {
        let mut c = reconnecting_with_a_read();
        let mut rx = FrameBuffer::new();
        rx.extend(&hello_reply());
        rx.extend(&open_frame(open_reply(5, 2 << 20)));
        assert!(matches!(c.handle_rx(30, &mut rx), Err(Closed::Protocol(ProtoError::Unexpected(..)))));
        assert!(c.is_closed());
        assert_eq!(events(&mut c), [Event::Disconnect]);
        assert_eq!(completions(&mut c), [(7, Status::IoError)]);
    }

    #[test]
    fn a_refused_attempt_waits_for_the_policy_then_tries_again() {
        let mut c = reconnecting_with_a_read();
        let mut rx = FrameBuffer::new();
        rx.extend(&hello_reply());
        let refused = OpenReply { status: Status::NotFound, ..open_reply(0, 0) };
        rx.extend(&open_frame(refused));
        assert_eq!(c.handle_rx(30, &mut rx), Ok(false));
        assert_eq!(events(&mut c), [Event::Disconnect], "no new attempt yet");
        let next = c.poll_timeout().expect("the next attempt is due");
        assert_eq!(next, 30 + super::super::reconnect::FIRST_RETRY_US);
        assert_eq!(c.handle_timeout(next - 1), Ok(()));
        assert_eq!(events(&mut c), []);
        assert_eq!(c.handle_timeout(next), Ok(()));
        assert_eq!(events(&mut c), [Event::Connect]);
        assert!(completions(&mut c).is_empty(), "the read still waits");
    }

    #[test]
    fn silence_without_reconnection_closes_for_good() {
        let mut c = up_with_a_read(ReconnectConfig::OFF);
        assert_eq!(c.poll_timeout(), Some(TIMEOUT_US), "silence counts from the send");
        assert_eq!(c.handle_timeout(TIMEOUT_US - 1), Ok(()));
        c.handle_received(TIMEOUT_US - 1);
        assert_eq!(c.handle_timeout(TIMEOUT_US), Ok(()), "bytes arrived: silence starts again");
        assert_eq!(c.handle_timeout(2 * TIMEOUT_US - 1), Err(Closed::Silent));
        assert_eq!(events(&mut c), [Event::Disconnect]);
        assert_eq!(completions(&mut c), [(7, Status::IoError)]);
        assert_eq!(c.poll_timeout(), None);
    }

    #[test]
    fn silence_with_reconnection_is_a_loss() {
        let mut c = up_with_a_read(reconnecting());
        assert_eq!(c.handle_timeout(TIMEOUT_US), Ok(()));
        assert_eq!(events(&mut c), [Event::Disconnect, Event::Connect]);
        assert_eq!(c.reconnect().losses, 1);
    }

    #[test]
    fn the_policy_gives_up_at_ctrl_loss_timeout() {
        let mut c = up_with_a_read(reconnecting());
        assert!(c.handle_transport_lost(0));
        events(&mut c);
        c.handle_transport_failed(1);
        let mut now;
        let closed = loop {
            now = c.poll_timeout().expect("something is due");
            match c.handle_timeout(now) {
                Ok(()) => {
                    if events(&mut c).contains(&Event::Connect) {
                        c.handle_transport_failed(now);
                    }
                }
                Err(closed) => break closed,
            }
        };
        assert_eq!(closed, Closed::GaveUp);
        assert_eq!(now, reconnecting().ctrl_loss_timeout_us);
        assert_eq!(completions(&mut c), [(7, Status::IoError)]);
    }

    #[test]
    fn a_goodbye_for_shutdown_is_a_loss_and_a_broken_frame_is_not() {
        let goaway = |status| {
            let g = wire::GoAway { status, message: "bye".into() };
            wire::control::frame(FrameKind::GoAway, &g.encode())
        };
        let mut c = up_with_a_read(reconnecting());
        let mut rx = FrameBuffer::new();
        rx.extend(&goaway(Status::ShuttingDown));
        assert_eq!(c.handle_rx(5, &mut rx), Ok(false));
        assert!(c.is_reconnecting());

        let mut c = up_with_a_read(reconnecting());
        let mut rx = FrameBuffer::new();
        rx.extend(&goaway(Status::Invalid));
        assert!(matches!(c.handle_rx(5, &mut rx), Err(Closed::Protocol(ProtoError::GoAway { .. }))));
        assert!(c.is_closed());
        assert_eq!(completions(&mut c), [(7, Status::IoError)]);
    }

    #[test]
    fn an_opening_presents_grants_one_frame_at_a_time_after_open() {
        let cap = Capability {
            export: 1,
            kind: CapKind::Chunk,
            rights: CapRights::READ,
            epoch: 0,
            generation: 0,
            offset: 0,
            length: 4096,
            slot: 0,
            expires_ms: 0,
            mac: [0; wire::capability::MAC_LEN],
        };
        let mut cfg = config(ReconnectConfig::OFF);
        cfg.grants = vec![cap; wire::GRANTS_PER_FRAME_MAX + 1].into();
        let mut opening = Opening::new(&cfg, false, [0; NONCE_LEN]);
        let mut rx = FrameBuffer::new();
        let mut step = |opening: &mut Opening, reply: Vec<u8>| {
            let out = opening.poll_transmit().to_vec();
            opening.handle_sent(out.len());
            rx.extend(&reply);
            (kinds(&out), opening.handle_rx(&mut rx))
        };
        assert_eq!(step(&mut opening, hello_reply()), (vec![FrameKind::Hello], Ok(None)));
        assert_eq!(step(&mut opening, open_frame(open_reply(3, 1 << 20))), (vec![FrameKind::Open], Ok(None)));
        let granted = wire::GrantReply { status: Status::Ok, refused: 0 };
        let granted = wire::control::frame(FrameKind::GrantReply, &granted.encode());
        assert_eq!(step(&mut opening, granted.clone()), (vec![FrameKind::Grant], Ok(None)));
        let (sent, opened) = step(&mut opening, granted);
        assert_eq!(sent, [FrameKind::Grant]);
        assert_eq!(opened.unwrap().unwrap().reply.handle, 3);

        let mut opening = Opening::new(&cfg, false, [0; NONCE_LEN]);
        let mut rx = FrameBuffer::new();
        rx.extend(&hello_reply());
        rx.extend(&open_frame(open_reply(3, 1 << 20)));
        let refused = wire::GrantReply { status: Status::AccessDenied, refused: 1 };
        rx.extend(&wire::control::frame(FrameKind::GrantReply, &refused.encode()));
        assert_eq!(opening.handle_rx(&mut rx), Err(ProtoError::Refused(Status::AccessDenied)));
    }
}
