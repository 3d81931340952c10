//! A lane: one connection, one export, one owning thread.
//!
//! The protocol lives in [`proto::client::ClientSession`]: slots, caravans, the doorbell and the
//! batch controller, completion matching and its checks, direct placement. A [`Lane`] is its
//! driver over a non-blocking socket and the monotonic clock: it hands the session the time and
//! the bytes that arrive, sends what the session gathers (write payloads straight from the
//! callers' buffers, one vectored send per caravan), receives read data where the session says
//! (directly into callers' buffers when placing), and sleeps in the socket when the caller
//! waits. While a caravan waits for room in the socket the lane keeps receiving, so two peers
//! can never deadlock on full buffers.

use std::io::IoSlice;
use std::time::{Duration, Instant};

use proto::caravan::Doorbell;
use proto::client::reconnect::Action;
use proto::client::{
    ClientSession, Reconnect, ReconnectConfig, SessionConfig, SessionStats, Submission, SubmitError,
};
use rt::poll::{PollMode, WaitStats};
use transport::{wait_either, wait_fd, Endpoint, FrameIo, Kick};
use wire::{ExportInfo, FrameKind, Limits, Opcode, ReqFlags, Status};

use crate::conn::Conn;
use crate::{Error, Result};

pub use proto::client::{Batching, Completion, IoBuf};

use crate::bounds::{ATTEMPT_POLL, CONNECT_TIMEOUT_MAX, SEND_IOV_MAX};
pub use crate::bounds::{DIRECT_MIN_BYTES, LANE_CARAVAN_REQS_MAX};
/// `user_data` reserved for the blocking API's own requests.
const SYNC_USER_DATA: u64 = u64::MAX;

/// How a lane behaves.
#[derive(Debug, Clone)]
pub struct LaneConfig {
    /// What the lane proposes in the handshake (zero fields mean "the target's choice").
    pub limits: Limits,
    pub doorbell: Doorbell,
    pub batching: Batching,
    /// Hybrid polling (`rt::poll`): how `wait` tries non-blocking receives before sleeping.
    /// `Off`, the default, always sleeps; spinning lowers latency at low queue depth and
    /// costs a busy core while it lasts.
    pub poll: PollMode,
    /// How long a blocking call waits for the target before failing.
    pub timeout: Duration,
    /// Direct placement while the reads in flight average at least this many bytes; smaller
    /// reads are received in bulk into the frame buffer and copied out. 0 places every read,
    /// `u32::MAX` (the default, [`DIRECT_MIN_BYTES`]) none.
    pub direct_min_bytes: u32,
    /// What to do when the connection is lost ([`proto::client::reconnect`]): by default,
    /// reconnect at most a second apart for 60 s, re-sending every request not yet answered;
    /// callers see nothing unless the target stays away that long.
    pub reconnect: ReconnectConfig,
    /// Direct reads (ODAFS, docs/DIRECT_READS.md): how many capabilities the lane's directory
    /// holds. 0 (the default) turns them off; otherwise reads ask the target for capabilities
    /// and later reads of the same bytes use them, falling back to ordinary reads on a fault.
    pub directory_entries: u32,
    /// The key to prove in the handshake, on every connection and reconnection (docs/
    /// PROTOCOL.md, section 15); `None` connects without one.
    pub key: Option<std::sync::Arc<proto::auth::Key>>,
    /// TLS to the target (docs/PROTOCOL.md, section 2), on every connection and reconnection;
    /// `None` is plaintext.
    pub tls: Option<crate::conn::TlsConfig>,
    /// Chunk grants to present right after opening the export, on every connection and
    /// reconnection (RStore pools; docs/PROTOCOL.md, section 14.6). A grant the target refuses
    /// fails the connection with its status.
    pub grants: std::sync::Arc<[wire::Capability]>,
}

impl Default for LaneConfig {
    fn default() -> LaneConfig {
        LaneConfig {
            limits: Limits { queue_depth: 256, caravan_reqs_max: 64, caravan_bytes_max: 0, io_bytes_max: 0 },
            doorbell: Doorbell::default(),
            batching: Batching::Static,
            poll: PollMode::Off,
            timeout: crate::DEFAULT_TIMEOUT,
            direct_min_bytes: DIRECT_MIN_BYTES,
            reconnect: ReconnectConfig::default(),
            directory_entries: 0,
            key: None,
            tls: None,
            grants: std::sync::Arc::new([]),
        }
    }
}

/// A request the lane did not take, with its buffer returned.
#[derive(Debug)]
pub struct Rejected<B = Vec<u8>> {
    pub error: Error,
    pub buf: Option<B>,
}

/// What a lane did, for benchmarks and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LaneStats {
    pub submitted: u64,
    pub completed: u64,
    pub caravans_sent: u64,
    /// Caravans sent by size: at most 1, 2, 4, ... 64 requests, then more.
    pub caravan_hist: [u64; 8],
    pub completion_caravans: u64,
    /// Wall time in send calls, in receive calls, and in handling what arrived (matching
    /// completions, placing read data): the initiator's stages, for the per-stage breakdown.
    pub send_ns: u64,
    pub recv_ns: u64,
    pub complete_ns: u64,
    /// Read data received straight into callers' buffers, and read data copied into them from
    /// the frame buffer (what came in one receive with its descriptors, or all of it when
    /// little is in flight).
    pub read_bytes_placed: u64,
    pub read_bytes_copied: u64,
    /// Read data that came in data messages, put into callers' buffers by tag and offset as
    /// it arrived (raw Ethernet; docs/PROTOCOL.md 16.9).
    pub read_bytes_in_messages: u64,
    /// Connections lost (and reconnected or given up on), and connection attempts after them.
    pub reconnects: u64,
    pub reconnect_attempts: u64,
    /// Reads served from capabilities, direct reads refused as stale or bad, ordinary reads
    /// issued in their place, and capabilities received ([`LaneConfig::directory_entries`]).
    pub direct_reads: u64,
    pub direct_faults: u64,
    pub fallbacks: u64,
    pub capabilities_received: u64,
}

impl LaneStats {
    fn of(s: SessionStats, conn: &Conn, complete_ns: u64, reconnect: &Reconnect) -> LaneStats {
        LaneStats {
            submitted: s.submitted,
            completed: s.completed,
            caravans_sent: s.caravans_sent,
            caravan_hist: s.caravan_hist,
            completion_caravans: s.completion_caravans,
            send_ns: conn.send_ns,
            recv_ns: conn.recv_ns,
            complete_ns,
            read_bytes_placed: s.read_bytes_placed,
            read_bytes_copied: s.read_bytes_copied,
            read_bytes_in_messages: s.read_bytes_in_messages,
            direct_reads: s.direct_reads,
            direct_faults: s.direct_faults,
            fallbacks: s.fallbacks,
            capabilities_received: s.capabilities_received,
            reconnects: reconnect.losses,
            reconnect_attempts: reconnect.attempts,
        }
    }

    /// Field-wise `self += other`: several lanes' counters together.
    pub fn add(&mut self, other: &LaneStats) {
        self.submitted += other.submitted;
        self.completed += other.completed;
        self.caravans_sent += other.caravans_sent;
        for (sum, n) in self.caravan_hist.iter_mut().zip(other.caravan_hist) {
            *sum += n;
        }
        self.completion_caravans += other.completion_caravans;
        self.send_ns += other.send_ns;
        self.recv_ns += other.recv_ns;
        self.complete_ns += other.complete_ns;
        self.read_bytes_placed += other.read_bytes_placed;
        self.read_bytes_copied += other.read_bytes_copied;
        self.read_bytes_in_messages += other.read_bytes_in_messages;
        self.direct_reads += other.direct_reads;
        self.direct_faults += other.direct_faults;
        self.fallbacks += other.fallbacks;
        self.capabilities_received += other.capabilities_received;
        self.reconnects += other.reconnects;
        self.reconnect_attempts += other.reconnect_attempts;
    }

    /// Field-wise `self - earlier`: what happened between two snapshots.
    pub fn since(&self, earlier: &LaneStats) -> LaneStats {
        let mut caravan_hist = self.caravan_hist;
        for (now, then) in caravan_hist.iter_mut().zip(earlier.caravan_hist) {
            *now -= then;
        }
        LaneStats {
            submitted: self.submitted - earlier.submitted,
            completed: self.completed - earlier.completed,
            caravans_sent: self.caravans_sent - earlier.caravans_sent,
            caravan_hist,
            completion_caravans: self.completion_caravans - earlier.completion_caravans,
            send_ns: self.send_ns - earlier.send_ns,
            recv_ns: self.recv_ns - earlier.recv_ns,
            complete_ns: self.complete_ns - earlier.complete_ns,
            read_bytes_placed: self.read_bytes_placed - earlier.read_bytes_placed,
            read_bytes_copied: self.read_bytes_copied - earlier.read_bytes_copied,
            read_bytes_in_messages: self.read_bytes_in_messages - earlier.read_bytes_in_messages,
            reconnects: self.reconnects - earlier.reconnects,
            reconnect_attempts: self.reconnect_attempts - earlier.reconnect_attempts,
            direct_reads: self.direct_reads - earlier.direct_reads,
            direct_faults: self.direct_faults - earlier.direct_faults,
            fallbacks: self.fallbacks - earlier.fallbacks,
            capabilities_received: self.capabilities_received - earlier.capabilities_received,
        }
    }
}

pub struct Lane<B = Vec<u8>> {
    conn: Conn,
    session: ClientSession<B>,
    export: ExportInfo,
    /// Where and how to connect again after a loss.
    endpoint: Endpoint,
    proposed: Limits,
    key: Option<std::sync::Arc<proto::auth::Key>>,
    tls: Option<crate::conn::TlsConfig>,
    grants: std::sync::Arc<[wire::Capability]>,
    reconnect: Reconnect,
    /// Since when the lane has waited for the target without hearing from it: the later of
    /// the last bytes received, the last (re)connection, and the moment requests went on an
    /// idle wire. Requests on the wire and silence for the timeout mean a dead connection.
    quiet_since: Instant,
    /// The outcome of the reconnection attempt running on a connector thread, if one is.
    attempt: Option<std::sync::mpsc::Receiver<Result<(Conn, wire::OpenReply)>>>,
    /// Time zero of the session's clock.
    epoch: Instant,
    /// Wall time in the session's handling of received bytes.
    complete_ns: u64,
    scratch: Vec<u8>,
}

impl Lane<Vec<u8>> {
    /// Connect to `endpoint`, negotiate, and open `export`, for requests with `Vec<u8>`
    /// buffers.
    pub fn connect(endpoint: &Endpoint, export: &str, config: &LaneConfig) -> Result<Lane> {
        Lane::connect_with(endpoint, export, config)
    }

    /// Blocking read into `buf` (its length is the read length).
    pub fn read_at(&mut self, buf: &mut [u8], offset: u64) -> Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.resize(buf.len(), 0);
        let c = self.run_sync(Opcode::Read, offset, buf.len(), Some(scratch))?;
        let data = c.buf.unwrap_or_default();
        if c.status.is_ok() {
            buf.copy_from_slice(&data);
        }
        self.scratch = data;
        status_result(c.status)
    }

    /// Blocking write of `buf`.
    pub fn write_at(&mut self, buf: &[u8], offset: u64) -> Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        scratch.extend_from_slice(buf);
        let c = self.run_sync(Opcode::Write, offset, buf.len(), Some(scratch))?;
        self.scratch = c.buf.unwrap_or_default();
        status_result(c.status)
    }
}

impl<B: IoBuf> Lane<B> {
    /// Connect to `endpoint`, negotiate, and open `export`, for requests with buffers of type
    /// `B`.
    pub fn connect_with(endpoint: &Endpoint, export: &str, config: &LaneConfig) -> Result<Lane<B>> {
        if export.len() > wire::control::EXPORT_NAME_MAX {
            return Err(Error::InvalidArgument("export name longer than 255 bytes"));
        }
        let mut proposed = config.limits;
        proposed.queue_depth = proposed.queue_depth.clamp(1, proto::slots::SLOTS_MAX as u32);
        if proposed.caravan_reqs_max == 0 {
            proposed.caravan_reqs_max = LANE_CARAVAN_REQS_MAX;
        }
        let features = if config.directory_entries > 0 { wire::control::FEATURE_DIRECT_READS } else { 0 };
        let key = config.key.clone();
        let tls = config.tls.clone();
        let (conn, reply) = open_lane(
            endpoint,
            export,
            &proposed,
            features,
            key.as_deref(),
            tls.as_ref(),
            &config.grants,
            config.timeout,
            config.poll,
        )?;
        let session_config = SessionConfig {
            doorbell: config.doorbell,
            batching: config.batching,
            direct_min_bytes: config.direct_min_bytes,
            directory_entries: if conn.features & wire::control::FEATURE_DIRECT_READS != 0 {
                config.directory_entries
            } else {
                0
            },
        };
        let mut session = ClientSession::new(&session_config, conn.limits, reply.handle);
        session.set_data_messages(conn.features & wire::control::FEATURE_DATA_MESSAGES != 0);
        Ok(Lane {
            session,
            export: ExportInfo {
                name: export.to_owned(),
                size_bytes: reply.size_bytes,
                block_size: reply.block_size,
                flags: reply.flags,
            },
            endpoint: endpoint.clone(),
            proposed,
            key,
            tls,
            grants: config.grants.clone(),
            reconnect: Reconnect::new(config.reconnect),
            attempt: None,
            quiet_since: Instant::now(),
            epoch: Instant::now(),
            complete_ns: 0,
            scratch: Vec::new(),
            conn,
        })
    }

    pub fn export(&self) -> &ExportInfo {
        &self.export
    }

    pub fn limits(&self) -> &Limits {
        self.session.limits()
    }

    /// Requests submitted and not yet returned by `poll`/`wait`.
    pub fn in_flight(&self) -> usize {
        self.session.in_flight()
    }

    pub fn queue_depth(&self) -> usize {
        self.session.queue_depth()
    }

    pub fn stats(&self) -> LaneStats {
        LaneStats::of(self.session.stats(), &self.conn, self.complete_ns, &self.reconnect)
    }

    /// Present more chunk grants for the lane's export on its open connection (`GRANT`,
    /// docs/PROTOCOL.md, section 14.6), as a connection reused for another mapping does. The
    /// lane must be idle (nothing in flight) and connected, and must not reconnect (a
    /// reconnection presents the grants it was configured with, which these would not be).
    /// A grant refused fails with its status (`Refused`); the connection goes on, holding what
    /// it held. Anything else that answers (a `GOAWAY` the target sent while the lane sat idle,
    /// before it closed the connection, or a close) fails with `Closed`: the lane is done, and
    /// the target may be well.
    pub fn grant(&mut self, grants: &[wire::Capability]) -> Result<()> {
        if self.in_flight() > 0 || self.reconnect.config().is_on() {
            return Err(Error::InvalidArgument(
                "grants are presented on an idle lane that does not reconnect",
            ));
        }
        if self.session.is_broken() || self.reconnect.is_lost() {
            return Err(Error::Closed);
        }
        for batch in grants.chunks(wire::GRANTS_PER_FRAME_MAX) {
            let grant = wire::Grant { handle: self.session.handle(), caps: batch.to_vec() };
            let (h, body) = self.conn.call(FrameKind::Grant, &grant.encode()).map_err(|_| Error::Closed)?;
            if h.kind != FrameKind::GrantReply {
                return Err(Error::Closed);
            }
            let answer = wire::GrantReply::decode(&body).map_err(|_| Error::Closed)?;
            if !answer.status.is_ok() {
                return Err(Error::Refused(answer.status));
            }
        }
        Ok(())
    }

    /// Queue any request; the typed `submit_*` methods of [`crate::Queue`] are the usual entry
    /// points. The target judges range, alignment and permissions; the lane refuses only what
    /// it cannot frame. A request that is accepted completes exactly once, through `poll` or
    /// `wait`.
    pub fn submit(
        &mut self,
        opcode: Opcode,
        flags: ReqFlags,
        offset: u64,
        length: usize,
        buf: Option<B>,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<B>> {
        let now = self.now_us();
        let sub = Submission { opcode, flags, offset, length, buf, user_data };
        if let Err(refused) = self.session.submit(now, sub) {
            let error = match refused.error {
                SubmitError::Closed => Error::Closed,
                SubmitError::Invalid(why) => Error::InvalidArgument(why),
                SubmitError::QueueFull(n) => Error::QueueFull(n),
            };
            return Err(Rejected { error, buf: refused.buf });
        }
        // On failure the request is already in flight: like every accepted request it
        // completes exactly once (with an I/O error), and the next call reports the error.
        let _ = self.transmit();
        Ok(())
    }

    /// The caravan size the lane aims for now (the adaptive level, or the static one).
    pub fn batch_level(&self) -> u32 {
        self.session.batch_level()
    }

    /// A raw-Ethernet lane's reliable-delivery counters (its current connection's); `None`
    /// over TCP and Unix sockets, whose kernel keeps its own.
    pub fn link_stats(&self) -> Option<LinkStats> {
        match &self.conn.stream {
            transport::Stream::Datagram(s) => {
                let s = s.as_any().downcast_ref::<eth::EthStream>()?;
                Some(LinkStats { paths: s.paths(), ..LinkStats::from(&s.counters()) })
            }
            _ => None,
        }
    }

    /// How the lane's waits went under hybrid polling (since its last connection).
    pub fn poll_stats(&self) -> WaitStats {
        self.conn.waiter.stats()
    }

    /// Every adaptive decision so far: (milliseconds since the lane opened, batch level).
    pub fn batch_level_log(&self) -> &[proto::batch::Decision] {
        self.session.batch_level_log()
    }

    /// When the doorbell's delay bound sends the open caravan if nothing else does first
    /// (`None`: nothing is held back).
    pub fn doorbell_due(&self) -> Option<Instant> {
        self.session.poll_timeout().map(|us| self.epoch + Duration::from_micros(us))
    }

    /// When the connection itself must be driven though nothing arrives: a raw-Ethernet
    /// session's retransmission or acknowledgement timer (`None` on sockets).
    pub(crate) fn stream_due(&self) -> Option<Instant> {
        self.conn.stream.timer().map(|t| Instant::now() + t)
    }

    /// Requests sent and not yet answered.
    pub fn on_the_wire(&self) -> usize {
        self.session.on_the_wire()
    }

    /// The connection failed; every request has completed or will complete with an I/O error.
    pub fn is_broken(&self) -> bool {
        self.session.is_broken()
    }

    /// TLS holds ciphertext the socket did not take yet: wait for writability too.
    pub(crate) fn tls_wants_write(&self) -> bool {
        self.conn.stream.pending_send()
    }

    /// TLS holds decrypted bytes not received yet: there is something to do without waiting.
    pub(crate) fn tls_buffered(&self) -> bool {
        self.conn.stream.buffered_recv()
    }

    /// The socket to sleep on for completions (readable when some arrived); `None` while the
    /// connection is lost (sleep until [`reconnect_due`](Self::reconnect_due) instead). A
    /// caller that sleeps on it calls [`poll`](Self::poll) first: TLS may hold decrypted bytes
    /// the socket no longer shows.
    pub fn wake_fd(&self) -> Option<std::os::fd::RawFd> {
        (!self.reconnect.is_lost()).then(|| std::os::fd::AsRawFd::as_raw_fd(&self.conn.stream))
    }

    /// The connection is lost and attempts to restore it go on.
    pub fn is_reconnecting(&self) -> bool {
        self.reconnect.is_lost() && !self.session.is_broken()
    }

    /// When the reconnection policy next wants to act (`None`: connected). While an attempt
    /// runs in the background, soon: its outcome is polled for.
    pub(crate) fn reconnect_due(&self) -> Option<Instant> {
        let due = self.reconnect.poll_timeout().map(|us| self.epoch + Duration::from_micros(us))?;
        Some(if self.attempt.is_some() { due.min(Instant::now() + ATTEMPT_POLL) } else { due })
    }

    /// Requests are on the wire and nothing has arrived for the lane's timeout: with
    /// reconnection on, treat the connection as lost (the peer may be gone without a word) and
    /// return true; otherwise the caller reports the timeout.
    pub(crate) fn handle_silence(&mut self) -> bool {
        if !self.reconnect.config().is_on() || self.on_the_wire() == 0 || self.session.is_broken() {
            return false;
        }
        let _ = self.lose(&Error::TimedOut(self.conn.timeout));
        true
    }

    /// When silence since the last sign of life would reach the timeout (`None`: nothing on
    /// the wire, or reconnecting).
    pub(crate) fn silence_due(&self) -> Option<Instant> {
        (!self.reconnect.is_lost() && self.on_the_wire() > 0).then(|| self.quiet_since + self.conn.timeout)
    }

    /// Requests are on the wire and nothing has come back for the lane's timeout.
    pub(crate) fn is_silent(&self) -> bool {
        !self.reconnect.is_lost() && self.on_the_wire() > 0 && self.quiet_since.elapsed() >= self.conn.timeout
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.conn.timeout
    }

    /// Send the open caravan now.
    pub fn commit(&mut self) -> Result<()> {
        self.session.commit();
        self.transmit()
    }

    /// Collect completions that have arrived, without waiting. Sends the open caravan first if
    /// its delay bound has passed.
    pub fn poll(&mut self, out: &mut Vec<Completion<B>>) -> Result<usize> {
        if self.reconnect.is_lost() {
            let recovered = self.recover(false);
            let n = self.session.take_completions(out);
            return recovered.map(|()| n);
        }
        let now = self.now_us();
        self.session.handle_timeout(now);
        // Even when the connection fails, what it completed (with an error) reaches `out`.
        let pumped = self.transmit().and_then(|()| self.pump(false));
        let n = self.session.take_completions(out);
        pumped.map(|_| n)
    }

    /// Send the open caravan and wait until at least `min` completions (bounded by what is in
    /// flight) have been collected into `out`.
    pub fn wait(&mut self, min: usize, out: &mut Vec<Completion<B>>) -> Result<usize> {
        let min = min.min(self.in_flight());
        let sent = self.commit();
        let mut got = self.session.take_completions(out);
        sent?;
        while got < min {
            let pumped = self.pump(true);
            got += self.session.take_completions(out);
            pumped?;
            // While the connection is restored, the reconnection policy's timeouts rule.
            if got < min && self.is_silent() && !self.handle_silence() {
                return Err(Error::TimedOut(self.conn.timeout));
            }
        }
        Ok(got)
    }

    /// For a thread that owns the lane and serves a queue of its own besides (`skiff attach`'s
    /// I/O threads): sleep until the lane may have something to do (bytes from the target, the
    /// open caravan's delay bound, a step of reconnection, the silence deadline) or `kick` is
    /// rung, and return whether it was (clearing it). [`poll`](Self::poll) then does what is
    /// due. A target silent for the timeout with requests on the wire is dealt with here, as
    /// `wait` deals with it: with reconnection on, the connection counts as lost and the lane
    /// reconnects and re-sends; without, the lane fails (every request completes with an error,
    /// delivered by the next `poll`) and the error is returned.
    pub fn sleep(&mut self, kick: &Kick) -> Result<bool> {
        let now = Instant::now();
        // A failed lane has nothing due, and its socket is shut down (always readable): only a
        // kick can matter.
        let (socket, wake_at) = if self.session.is_broken() {
            (None, None)
        } else {
            let due = [self.doorbell_due(), self.reconnect_due(), self.silence_due(), self.stream_due()];
            (self.wake_fd(), due.into_iter().flatten().min())
        };
        let mut timeout = wake_at.map(|at| at.saturating_duration_since(now));
        if socket.is_some() && self.tls_buffered() {
            // Decrypted bytes already wait inside TLS: the socket will not say so.
            timeout = Some(Duration::ZERO);
        }
        let kicked = match socket {
            Some(fd) => {
                wait_either(fd, self.tls_wants_write(), std::os::fd::AsRawFd::as_raw_fd(kick), timeout)?.1
            }
            None => wait_fd(std::os::fd::AsRawFd::as_raw_fd(kick), false, timeout)?.readable,
        };
        if kicked {
            kick.clear();
        }
        if self.is_silent() {
            self.lose(&Error::TimedOut(self.conn.timeout))?;
        }
        Ok(kicked)
    }

    /// Blocking flush.
    pub fn flush(&mut self) -> Result<()> {
        let c = self.run_sync(Opcode::Flush, 0, 0, None)?;
        status_result(c.status)
    }

    fn run_sync(
        &mut self,
        opcode: Opcode,
        offset: u64,
        length: usize,
        buf: Option<B>,
    ) -> Result<Completion<B>> {
        self.submit(opcode, ReqFlags::empty(), offset, length, buf, SYNC_USER_DATA).map_err(|r| r.error)?;
        self.commit()?;
        loop {
            if let Some(c) = self.session.take_completion_of(SYNC_USER_DATA) {
                return Ok(c);
            }
            if self.is_silent() && !self.handle_silence() {
                return Err(Error::TimedOut(self.conn.timeout));
            }
            self.pump(true)?;
        }
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Send everything the session has sealed, waiting (and receiving) while the socket is
    /// full. A failure fails the session, completing every request with an I/O error.
    fn transmit(&mut self) -> Result<()> {
        if self.session.is_broken() {
            return if self.session.has_transmit() { Err(Error::Closed) } else { Ok(()) };
        }
        if self.reconnect.is_lost() {
            // Queued in the session; it goes out when the connection is back.
            return self.recover(false);
        }
        let deadline = Instant::now() + self.conn.timeout;
        if self.session.has_transmit() && self.on_the_wire() == 0 {
            self.quiet_since = Instant::now();
        }
        while self.session.has_transmit() {
            let sent = {
                let mut iov = [IoSlice::new(&[]); SEND_IOV_MAX];
                let n = self.session.poll_transmit(&mut iov);
                self.conn.send(&iov[..n])
            };
            let result = match sent {
                Ok(0) => Err(Error::Closed),
                Ok(n) => {
                    self.session.handle_sent(n);
                    Ok(())
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => self.conn.wait_writable(deadline),
                Err(e) => Err(e.into()),
            };
            if let Err(e) = result {
                return self.lose(&e);
            }
        }
        Ok(())
    }

    /// Handle what already arrived, then receive (with `block`, waiting for at least one byte
    /// if nothing new completed) and handle that too.
    fn pump(&mut self, block: bool) -> Result<()> {
        if self.session.is_broken() {
            return Err(Error::Closed);
        }
        if self.reconnect.is_lost() {
            return self.recover(block);
        }
        let result = self.handle_rx().and_then(|progressed| {
            let got = if block && !progressed {
                // Silence is measured from the last sign of life, not from this call.
                let since = if self.on_the_wire() > 0 { self.quiet_since } else { Instant::now() };
                let deadline = since + self.conn.timeout;
                let Lane { conn, session, .. } = self;
                conn.receive_blocking(deadline, &mut |conn| receive(conn, session))?;
                1
            } else {
                receive(&mut self.conn, &mut self.session)?
            };
            if got > 0 {
                self.quiet_since = Instant::now();
            }
            self.handle_rx().map(|_| ())
        });
        match result {
            Ok(()) => Ok(()),
            Err(e) => self.lose(&e),
        }
    }

    /// Give the session what the frame buffer holds. Returns whether a completion became ready.
    fn handle_rx(&mut self) -> Result<bool> {
        let before = self.session.ready();
        let started = Instant::now();
        let now = self.now_us();
        let handled = self.session.handle_rx(now, self.conn.rx.unconsumed());
        self.complete_ns += started.elapsed().as_nanos() as u64;
        let progress = handled?;
        self.conn.rx.consume(progress.consumed);
        if progress.need > 0 {
            self.conn.rx.reserve(progress.need);
        }
        if self.session.has_transmit() {
            // What answers brought about: direct reads the target refused, re-sent as
            // ordinary reads in the same call.
            self.transmit()?;
        }
        Ok(self.session.ready() > before)
    }

    /// The connection is gone. If it was lost (a failed socket, the peer's close, silence, a
    /// GOAWAY saying the target times out or stops) and reconnection is on, the session parks
    /// every request and the lane starts reconnecting: the call goes on as if nothing
    /// happened. A target that broke the protocol, or said the initiator did, is not retried:
    /// every request completes with an I/O error and `why` is returned, as it is once the
    /// policy gives up.
    fn lose(&mut self, why: &Error) -> Result<()> {
        self.conn.stream.shutdown();
        let now = self.now_us();
        let lost = match why {
            Error::Io(_) | Error::Closed | Error::TimedOut(_) => true,
            Error::GoAway { status, .. } => matches!(status, Status::TimedOut | Status::ShuttingDown),
            _ => false,
        };
        if self.session.is_broken() || !lost || !self.reconnect.handle_lost(now) {
            self.session.handle_closed();
            return Err(clone_error(why));
        }
        if self.reconnect.losses == 1 || self.reconnect.losses.is_power_of_two() {
            tracing::warn!(export = %self.export.name, error = %why, losses = self.reconnect.losses, "connection lost; reconnecting");
        }
        self.session.handle_disconnected();
        Ok(())
    }

    /// Drive the reconnection policy while the connection is lost: start an attempt when due,
    /// fail what waits at `fast_io_fail_timeout`, give up at `ctrl_loss_timeout`. Attempts
    /// (connect, handshake, open) run on a connector thread, so no caller ever blocks in a
    /// connect. With `block`, sleeps until the connection is back, or requests were failed,
    /// or it gives up; without, does only what is due now.
    fn recover(&mut self, block: bool) -> Result<()> {
        loop {
            if let Some(outcome) = self.attempt_outcome() {
                match self.finish_attempt(outcome) {
                    Ok(true) => return self.transmit(),
                    Ok(false) => {}
                    Err(e) => return Err(e),
                }
            }
            let now = self.now_us();
            match self.reconnect.poll_action(now) {
                Action::Wait { until } => {
                    if !self.reconnect.is_lost() || !block {
                        return Ok(());
                    }
                    let sleep = Duration::from_micros(until.saturating_sub(now));
                    if self.attempt.is_some() {
                        if let Some(outcome) = self.attempt_outcome_within(sleep) {
                            match self.finish_attempt(outcome) {
                                Ok(true) => return self.transmit(),
                                Ok(false) => {}
                                Err(e) => return Err(e),
                            }
                        }
                    } else {
                        std::thread::sleep(sleep);
                    }
                }
                Action::Attempt => self.start_attempt(),
                Action::FailIo => {
                    tracing::warn!(export = %self.export.name, "fast_io_fail_timeout: failing requests while reconnecting");
                    self.session.fail_parked();
                    if block {
                        return Ok(());
                    }
                }
                Action::GiveUp => {
                    tracing::error!(export = %self.export.name, endpoint = %self.endpoint, "ctrl_loss_timeout: target gone; giving up");
                    self.attempt = None;
                    self.session.handle_closed();
                    return Err(Error::Lost(self.endpoint.to_string()));
                }
            }
        }
    }

    /// Connect, negotiate and open the export on a connector thread.
    fn start_attempt(&mut self) {
        let (tx, rx) = std::sync::mpsc::channel();
        let endpoint = self.endpoint.clone();
        let export = self.export.name.clone();
        let proposed = self.proposed;
        let features = self.conn.features;
        let key = self.key.clone();
        let tls = self.tls.clone();
        let grants = self.grants.clone();
        let timeout = self.conn.timeout.min(CONNECT_TIMEOUT_MAX);
        let poll = self.conn.waiter.mode();
        let spawned = std::thread::Builder::new().name("skiff-reconnect".into()).spawn(move || {
            let _ = tx.send(open_lane(
                &endpoint,
                &export,
                &proposed,
                features,
                key.as_deref(),
                tls.as_ref(),
                &grants,
                timeout,
                poll,
            ));
        });
        match spawned {
            Ok(_) => self.attempt = Some(rx),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a reconnection attempt");
                self.reconnect.handle_attempt_failed(self.now_us());
            }
        }
    }

    /// The running attempt's outcome, if it has ended.
    fn attempt_outcome(&mut self) -> Option<Result<(Conn, wire::OpenReply)>> {
        use std::sync::mpsc::TryRecvError;
        let outcome = match self.attempt.as_ref()?.try_recv() {
            Ok(outcome) => outcome,
            Err(TryRecvError::Empty) => return None,
            Err(TryRecvError::Disconnected) => Err(Error::Closed),
        };
        self.attempt = None;
        Some(outcome)
    }

    /// The running attempt's outcome, waiting for it at most `limit`.
    fn attempt_outcome_within(&mut self, limit: Duration) -> Option<Result<(Conn, wire::OpenReply)>> {
        use std::sync::mpsc::RecvTimeoutError;
        let outcome = match self.attempt.as_ref()?.recv_timeout(limit) {
            Ok(outcome) => outcome,
            Err(RecvTimeoutError::Timeout) => return None,
            Err(RecvTimeoutError::Disconnected) => Err(Error::Closed),
        };
        self.attempt = None;
        Some(outcome)
    }

    /// Take an attempt's outcome: `Ok(true)` when the session runs on the new connection,
    /// `Ok(false)` when the attempt failed (the next one is scheduled), an error when no
    /// attempt can help (the target came back different).
    fn finish_attempt(&mut self, outcome: Result<(Conn, wire::OpenReply)>) -> Result<bool> {
        let attached = outcome.and_then(|(conn, reply)| self.reattach(conn, reply));
        match attached {
            Ok(()) => {
                self.reconnect.handle_connected();
                tracing::info!(export = %self.export.name, losses = self.reconnect.losses, "reconnected");
                Ok(true)
            }
            Err(Error::Protocol(e)) => {
                tracing::error!(export = %self.export.name, error = %e, "reconnected to a different target; giving up");
                self.session.handle_closed();
                Err(Error::Protocol(e))
            }
            Err(e) => {
                tracing::debug!(export = %self.export.name, error = %e, "reconnect attempt failed");
                self.reconnect.handle_attempt_failed(self.now_us());
                Ok(false)
            }
        }
    }

    /// Hand the session a new connection on which the export is open.
    fn reattach(&mut self, mut conn: Conn, reply: wire::OpenReply) -> Result<()> {
        if reply.size_bytes != self.export.size_bytes || reply.block_size != self.export.block_size {
            return Err(Error::Protocol(proto::ProtoError::Unexpected(
                FrameKind::OpenReply,
                "after reconnecting: the export's size or block size changed",
            )));
        }
        self.session.reattach(conn.limits, reply.handle)?;
        self.session.set_data_messages(conn.features & wire::control::FEATURE_DATA_MESSAGES != 0);
        conn.timeout = self.conn.timeout;
        conn.send_ns += self.conn.send_ns;
        conn.recv_ns += self.conn.recv_ns;
        // The same target, most likely the same service times: keep what the polling policy
        // learned, and its counters.
        conn.waiter = std::mem::take(&mut self.conn.waiter);
        self.conn = conn;
        self.quiet_since = Instant::now();
        Ok(())
    }
}

/// What reliable delivery did on a raw-Ethernet lane (`dgram::reliable::Counters`, the part
/// a report needs): datagrams out, and the repairs that show the network's faults; and what
/// each interface of its bundle carried.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct LinkStats {
    pub datagrams_sent: u64,
    pub datagrams_received: u64,
    pub retransmitted_timeout: u64,
    pub retransmitted_gap: u64,
    pub duplicates: u64,
    pub out_of_order: u64,
    pub corrupt: u64,
    /// Datagrams of the target flagged DUPLICATE: this side's retransmissions that reordering,
    /// not loss, had called for.
    pub dsacks_received: u64,
    /// The reordering window when the counters were taken, in µs (the largest of the lanes').
    pub reorder_window_us: u64,
    /// Stream bytes received, and of them those placed from the receive ring straight into
    /// the lane's buffers (the rest waited in the stream's receive buffer).
    pub stream_bytes_read: u64,
    pub stream_bytes_placed: u64,
    /// Data messages (Place datagrams) received, and of them those that arrived while no
    /// reader was there and waited in the stream's buffer for the next receive.
    pub data_messages_received: u64,
    pub data_messages_held: u64,
    /// Each interface's share, round trip and outages (one entry unless bundled).
    pub paths: Vec<eth::PathStats>,
}

impl From<&dgram::reliable::Counters> for LinkStats {
    fn from(c: &dgram::reliable::Counters) -> LinkStats {
        LinkStats {
            datagrams_sent: c.datagrams_sent,
            datagrams_received: c.datagrams_received,
            retransmitted_timeout: c.retransmitted_timeout,
            retransmitted_gap: c.retransmitted_gap,
            duplicates: c.duplicates,
            out_of_order: c.out_of_order,
            corrupt: c.corrupt,
            dsacks_received: c.dsacks_received,
            reorder_window_us: c.reorder_window_us,
            stream_bytes_read: c.stream_bytes_read,
            stream_bytes_placed: c.stream_bytes_placed,
            data_messages_received: c.places_received,
            data_messages_held: c.places_held,
            paths: Vec::new(),
        }
    }
}

impl LinkStats {
    pub fn add(&mut self, o: &LinkStats) {
        self.datagrams_sent += o.datagrams_sent;
        self.datagrams_received += o.datagrams_received;
        self.retransmitted_timeout += o.retransmitted_timeout;
        self.retransmitted_gap += o.retransmitted_gap;
        self.duplicates += o.duplicates;
        self.out_of_order += o.out_of_order;
        self.corrupt += o.corrupt;
        self.dsacks_received += o.dsacks_received;
        self.reorder_window_us = self.reorder_window_us.max(o.reorder_window_us);
        self.stream_bytes_read += o.stream_bytes_read;
        self.stream_bytes_placed += o.stream_bytes_placed;
        self.data_messages_received += o.data_messages_received;
        self.data_messages_held += o.data_messages_held;
        // Lanes over one bundle: the same interfaces in the same order.
        for (i, p) in o.paths.iter().enumerate() {
            match self.paths.get_mut(i) {
                Some(all) => {
                    all.up &= p.up;
                    all.datagrams_sent += p.datagrams_sent;
                    all.datagrams_received += p.datagrams_received;
                    all.probes_sent += p.probes_sent;
                    all.probes_answered += p.probes_answered;
                    all.srtt_us = all.srtt_us.max(p.srtt_us);
                    all.downs += p.downs;
                    all.rejoins += p.rejoins;
                }
                None => self.paths.push(p.clone()),
            }
        }
    }
}

/// Connect to `endpoint`, negotiate `proposed`, open `export`, and present `grants` for it.
#[allow(clippy::too_many_arguments)] // each is one setting of a connection; a struct would only rename them
fn open_lane(
    endpoint: &Endpoint,
    export: &str,
    proposed: &Limits,
    features: u64,
    key: Option<&proto::auth::Key>,
    tls: Option<&crate::conn::TlsConfig>,
    grants: &[wire::Capability],
    timeout: Duration,
    poll: PollMode,
) -> Result<(Conn, wire::OpenReply)> {
    let mut conn = Conn::connect_with_features(endpoint, proposed, timeout, features, key, tls)?;
    conn.waiter = rt::poll::Waiter::new(poll);
    let (h, body) = conn.call(FrameKind::Open, &wire::Open { name: export.to_owned() }.encode())?;
    let reply = proto::client::handle_open_reply(&h, &body)?;
    for batch in grants.chunks(wire::GRANTS_PER_FRAME_MAX) {
        let grant = wire::Grant { handle: reply.handle, caps: batch.to_vec() };
        let (h, body) = conn.call(FrameKind::Grant, &grant.encode())?;
        let answer = proto::client::expect(&h, &body, FrameKind::GrantReply, wire::GrantReply::decode)?;
        if !answer.status.is_ok() {
            return Err(Error::Refused(answer.status));
        }
    }
    Ok((conn, reply))
}

/// An error to hand back again (the lane keeps its cause for the log).
fn clone_error(e: &Error) -> Error {
    match e {
        Error::Io(io) => Error::Io(std::io::Error::new(io.kind(), io.to_string())),
        Error::Protocol(p) => Error::Protocol(p.clone()),
        Error::Refused(s) => Error::Refused(*s),
        Error::GoAway { status, message } => Error::GoAway { status: *status, message: message.clone() },
        Error::Closed => Error::Closed,
        Error::TimedOut(d) => Error::TimedOut(*d),
        Error::Status(s) => Error::Status(*s),
        Error::InvalidArgument(a) => Error::InvalidArgument(a),
        Error::QueueFull(n) => Error::QueueFull(*n),
        Error::Lost(t) => Error::Lost(t.clone()),
        Error::VolumeRefused { status, message } => {
            Error::VolumeRefused { status: *status, message: message.clone() }
        }
    }
}

/// One receive without waiting, laid out by the session (placed data first), timed.
fn receive<B: IoBuf>(conn: &mut Conn, session: &mut ClientSession<B>) -> Result<usize> {
    let Conn { stream, rx, recv_ns, .. } = conn;
    let started = Instant::now();
    let got = if session.data_messages() {
        session.receive_placing(rx, |iov, place| FrameIo::recv_placing(stream, iov, place))
    } else {
        session.receive_with(rx, |iov| FrameIo::recv(stream, iov))
    };
    *recv_ns += started.elapsed().as_nanos() as u64;
    crate::conn::received(got)
}

pub(crate) fn status_result(status: Status) -> Result<()> {
    if status.is_ok() {
        Ok(())
    } else {
        Err(Error::Status(status))
    }
}

impl<B: IoBuf> crate::Queue<B> for Lane<B> {
    fn submit(
        &mut self,
        opcode: Opcode,
        flags: ReqFlags,
        offset: u64,
        length: usize,
        buf: Option<B>,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<B>> {
        Lane::submit(self, opcode, flags, offset, length, buf, user_data)
    }

    /// Rings the doorbell first: a private lane has no one else to wait for.
    fn wait(&mut self, min: usize, out: &mut Vec<Completion<B>>) -> Result<usize> {
        Lane::wait(self, min, out)
    }

    fn poll(&mut self, out: &mut Vec<Completion<B>>) -> Result<usize> {
        Lane::poll(self, out)
    }

    fn in_flight(&self) -> usize {
        Lane::in_flight(self)
    }
}
