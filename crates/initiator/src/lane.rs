//! A lane: one connection, one export, one owning thread.
//!
//! The protocol lives in [`proto::client::Connection`]: the handshake on every transport, the
//! silence deadline, the reconnection policy, and the session it carries
//! ([`proto::client::ClientSession`]: slots, caravans, the doorbell and the batch controller,
//! completion matching and its checks, direct placement). A [`Lane`] is its driver over a
//! non-blocking socket and the monotonic clock, a socket pump: it hands the connection the
//! time and the bytes that arrive, sends what it gathers (write payloads straight from the
//! callers' buffers, one vectored send per caravan), receives read data where the session says
//! (directly into callers' buffers when placing), opens a transport on a connector thread when
//! the connection asks for one and closes the one it gives up on, and sleeps in the socket
//! until the connection's next deadline when the caller waits. While a caravan waits for room
//! in the socket the lane keeps receiving, so two peers can never deadlock on full buffers.

use std::io::IoSlice;
use std::time::{Duration, Instant};

use proto::caravan::Doorbell;
use proto::client::{
    Closed, Connection, ConnectionConfig, Event, Opening, Reconnect, ReconnectConfig, SessionConfig,
    SessionStats, Submission, SubmitError,
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
    /// Reads served from capabilities, writes taken under extents, direct reads and writes
    /// refused as stale or bad, ordinary ones issued in their place, and capabilities
    /// received ([`LaneConfig::directory_entries`]).
    pub direct_reads: u64,
    pub direct_writes: u64,
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
            direct_writes: s.direct_writes,
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
        self.direct_writes += other.direct_writes;
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
            direct_writes: self.direct_writes - earlier.direct_writes,
            direct_faults: self.direct_faults - earlier.direct_faults,
            fallbacks: self.fallbacks - earlier.fallbacks,
            capabilities_received: self.capabilities_received - earlier.capabilities_received,
        }
    }
}

pub struct Lane<B = Vec<u8>> {
    /// The current transport (after a loss, the shut-down one until the next is up).
    conn: Conn,
    /// The session across transports: handshakes, silence, the reconnection policy.
    link: Connection<B>,
    export: ExportInfo,
    /// Where and how to connect again after a loss.
    endpoint: Endpoint,
    tls: Option<crate::conn::TlsConfig>,
    /// The transport a connector thread is opening, if one is (the handshake on it runs here).
    connecting: Option<std::sync::mpsc::Receiver<Result<transport::Stream>>>,
    /// Losses already logged, and whether the link was up when last looked at (for the log).
    losses_logged: u64,
    was_up: bool,
    /// Time zero of the connection's clock.
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
    /// `B`. The first connection is not retried: a target that is not there, or refuses,
    /// fails the call.
    pub fn connect_with(endpoint: &Endpoint, export: &str, config: &LaneConfig) -> Result<Lane<B>> {
        if export.len() > wire::control::EXPORT_NAME_MAX {
            return Err(Error::InvalidArgument("export name longer than 255 bytes"));
        }
        let mut proposed = config.limits;
        proposed.queue_depth = proposed.queue_depth.clamp(1, proto::slots::SLOTS_MAX as u32);
        if proposed.caravan_reqs_max == 0 {
            proposed.caravan_reqs_max = LANE_CARAVAN_REQS_MAX;
        }
        let link_config = ConnectionConfig {
            export: export.to_owned(),
            proposed,
            features: if config.directory_entries > 0 { wire::control::FEATURE_DIRECT_READS } else { 0 },
            key: config.key.clone(),
            grants: config.grants.clone(),
            session: SessionConfig {
                doorbell: config.doorbell,
                batching: config.batching,
                direct_min_bytes: config.direct_min_bytes,
                directory_entries: config.directory_entries,
            },
            reconnect: config.reconnect,
            timeout_us: micros(config.timeout),
            attempt_timeout_us: micros(config.timeout.min(CONNECT_TIMEOUT_MAX)),
        };
        let stream = crate::conn::connect_transport(endpoint, config.timeout, config.tls.as_ref())?;
        let mut conn = Conn::over(stream, config.timeout, config.poll);
        let opening = Opening::new(&link_config, conn.stream.data_messages(), nonce()?);
        let opened = conn.open(opening)?;
        let epoch = Instant::now();
        Ok(Lane {
            export: ExportInfo {
                name: export.to_owned(),
                size_bytes: opened.reply.size_bytes,
                block_size: opened.reply.block_size,
                flags: opened.reply.flags,
            },
            link: Connection::new(link_config, opened, 0),
            endpoint: endpoint.clone(),
            tls: config.tls.clone(),
            connecting: None,
            losses_logged: 0,
            was_up: true,
            epoch,
            complete_ns: 0,
            scratch: Vec::new(),
            conn,
        })
    }

    pub fn export(&self) -> &ExportInfo {
        &self.export
    }

    pub fn limits(&self) -> &Limits {
        self.link.session().limits()
    }

    /// Requests submitted and not yet returned by `poll`/`wait`.
    pub fn in_flight(&self) -> usize {
        self.link.session().in_flight()
    }

    pub fn queue_depth(&self) -> usize {
        self.link.session().queue_depth()
    }

    pub fn stats(&self) -> LaneStats {
        LaneStats::of(self.link.session().stats(), &self.conn, self.complete_ns, self.link.reconnect())
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
        if self.in_flight() > 0 || self.link.reconnect().config().is_on() {
            return Err(Error::InvalidArgument(
                "grants are presented on an idle lane that does not reconnect",
            ));
        }
        if !self.link.is_up() {
            return Err(Error::Closed);
        }
        for batch in grants.chunks(wire::GRANTS_PER_FRAME_MAX) {
            let grant = wire::Grant { handle: self.link.session().handle(), caps: batch.to_vec() };
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

    /// Register `length` bytes from `offset` of the lane's export (`REGISTER`, docs/PROTOCOL.md,
    /// section 14.7): the target seals a reference to the range, of any size, and allocates
    /// nothing for it (FlashNet's lazy registration). With direct reads on, the lane keeps it
    /// in its directory, so reads of the range go direct from now on. Returns the reference.
    /// The lane must be idle and connected, as for [`grant`](Self::grant); a refusal fails
    /// with its status (`Refused`) and the connection goes on.
    pub fn register(&mut self, offset: u64, length: u64) -> Result<wire::Capability> {
        if self.in_flight() > 0 {
            return Err(Error::InvalidArgument("references are registered on an idle lane"));
        }
        if !self.link.is_up() {
            return Err(Error::Closed);
        }
        let register = wire::Register {
            handle: self.link.session().handle(),
            rights: wire::CapRights::READ,
            offset,
            length,
        };
        let (h, body) = self.conn.call(FrameKind::Register, &register.encode()).map_err(|_| Error::Closed)?;
        if h.kind != FrameKind::RegisterReply {
            return Err(Error::Closed);
        }
        let reply = wire::RegisterReply::decode(&body).map_err(|_| Error::Closed)?;
        let cap = reply.cap.ok_or(Error::Refused(reply.status))?;
        self.link.session_mut().remember(cap);
        Ok(cap)
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
        if let Err(refused) = self.link.session_mut().submit(now, sub) {
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
        self.link.session().batch_level()
    }

    /// A raw-Ethernet lane's reliable-delivery counters (its current connection's); `None`
    /// over TCP and Unix sockets, whose kernel keeps its own.
    pub fn link_stats(&self) -> Option<LinkStats> {
        match &self.conn.stream {
            transport::Stream::Datagram(s) => {
                let s = s.as_any().downcast_ref::<eth::EthStream>()?;
                let c = s.reliable_config();
                Some(LinkStats {
                    paths: s.paths(),
                    datagram_payload_max: u64::from(c.payload_bytes_max),
                    payload_crc: c.payload_crc,
                    ..LinkStats::from(&s.counters())
                })
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
        self.link.session().batch_level_log()
    }

    /// When the doorbell's delay bound sends the open caravan if nothing else does first
    /// (`None`: nothing is held back).
    pub fn doorbell_due(&self) -> Option<Instant> {
        self.link.session().poll_timeout().map(|us| self.instant(us))
    }

    /// When the lane must be driven though nothing arrives ([`handle_due`](Self::handle_due)):
    /// the connection's deadline (the doorbell's delay bound, silence, a handshake's bound,
    /// the reconnection policy's next step), a raw-Ethernet session's timers, and soon while
    /// a connector thread runs, to look for its outcome. `None`: nothing is due.
    pub(crate) fn due(&self) -> Option<Instant> {
        let link = self.link.poll_timeout().map(|us| self.instant(us));
        let stream = self.link.has_transport().then(|| self.conn.stream.timer()).flatten();
        let connector = self.connecting.is_some().then(|| Instant::now() + ATTEMPT_POLL);
        [link, stream.map(|t| Instant::now() + t), connector].into_iter().flatten().min()
    }

    /// When a caller waiting while another thread receives must look again: on a connection
    /// that is up, when silence would reach the timeout (the receiving thread sends the open
    /// caravan when its delay is up and drives the transport's timers); while it is not up,
    /// whatever [`due`](Self::due) says. Waking such callers at the doorbell's every deadline
    /// cost a third of a shared lane's IOPS at 64 callers (docs/ETHERNET.md, "Link utilisation").
    pub(crate) fn waiter_due(&self) -> Option<Instant> {
        if self.link.is_up() {
            self.link.silence_due().map(|us| self.instant(us))
        } else {
            self.due()
        }
    }

    /// Requests sent and not yet answered.
    pub fn on_the_wire(&self) -> usize {
        self.link.session().on_the_wire()
    }

    /// The connection failed; every request has completed or will complete with an I/O error.
    pub fn is_broken(&self) -> bool {
        self.link.session().is_broken()
    }

    /// TLS holds ciphertext the socket did not take yet: wait for writability too.
    pub(crate) fn tls_wants_write(&self) -> bool {
        self.conn.stream.pending_send()
    }

    /// TLS holds decrypted bytes not received yet: there is something to do without waiting.
    pub(crate) fn tls_buffered(&self) -> bool {
        self.conn.stream.buffered_recv()
    }

    /// The socket to sleep on for completions (readable when some arrived); `None` while no
    /// transport is there (sleep until [`due`](Self::due) instead). A caller that sleeps on
    /// it calls [`poll`](Self::poll) first: TLS may hold decrypted bytes the socket no longer
    /// shows.
    pub fn wake_fd(&self) -> Option<std::os::fd::RawFd> {
        self.link.has_transport().then(|| std::os::fd::AsRawFd::as_raw_fd(&self.conn.stream))
    }

    /// The connection is lost and attempts to restore it go on.
    pub fn is_reconnecting(&self) -> bool {
        self.link.is_reconnecting()
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.conn.timeout
    }

    /// Send the open caravan now.
    pub fn commit(&mut self) -> Result<()> {
        self.link.session_mut().commit();
        self.transmit()
    }

    /// Collect completions that have arrived, without waiting. Does what is due first (sends
    /// the open caravan if its delay bound has passed, a step of reconnection).
    pub fn poll(&mut self, out: &mut Vec<Completion<B>>) -> Result<usize> {
        // Even when the connection fails, what it completed (with an error) reaches `out`.
        let pumped = self.handle_due().and_then(|()| self.transmit()).and_then(|()| self.pump(false));
        let n = self.link.session_mut().take_completions(out);
        pumped.map(|_| n)
    }

    /// Send the open caravan and wait until at least `min` completions (bounded by what is in
    /// flight) have been collected into `out`. A target silent for the timeout with requests
    /// on the wire is a lost connection: with reconnection on the lane reconnects and
    /// re-sends; without, every request completes with an error and `TimedOut` is returned.
    pub fn wait(&mut self, min: usize, out: &mut Vec<Completion<B>>) -> Result<usize> {
        let min = min.min(self.in_flight());
        let sent = self.commit();
        let mut got = self.link.session_mut().take_completions(out);
        sent?;
        while got < min {
            let pumped = self.pump(true);
            got += self.link.session_mut().take_completions(out);
            pumped?;
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
        let (socket, wake_at) =
            if self.link.is_closed() { (None, None) } else { (self.wake_fd(), self.due()) };
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
        self.handle_due()?;
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
            if let Some(c) = self.link.session_mut().take_completion_of(SYNC_USER_DATA) {
                return Ok(c);
            }
            self.pump(true)?;
        }
    }

    fn now_us(&self) -> u64 {
        self.us_at(Instant::now())
    }

    /// `at` on the connection's clock, for a caller that has just read the clock anyway.
    fn us_at(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_micros() as u64
    }

    /// The instant of `us` on the connection's clock.
    fn instant(&self, us: u64) -> Instant {
        self.epoch + Duration::from_micros(us)
    }

    /// Do what is due now: take a connector thread's outcome, and let the connection handle
    /// its timers (the doorbell, silence, a handshake's bound, the reconnection policy).
    /// Fails when the connection closed for good.
    pub(crate) fn handle_due(&mut self) -> Result<()> {
        self.handle_due_at(Instant::now())
    }

    /// [`handle_due`](Self::handle_due) for a caller that has just read the clock.
    pub(crate) fn handle_due_at(&mut self, now: Instant) -> Result<()> {
        self.take_connected();
        let now = self.us_at(now);
        let result = self.link.handle_timeout(now);
        self.settle();
        result.map_err(|why| self.closed_error(why))?;
        if self.link.has_transmit() {
            // A handshake's first frame, or the requests a reconnection re-sends.
            self.transmit()?;
        }
        Ok(())
    }

    /// Carry out what the connection asked of the transport, and log its transitions.
    fn settle(&mut self) {
        while let Some(event) = self.link.poll_event() {
            match event {
                Event::Disconnect => {
                    self.conn.stream.shutdown();
                    self.conn.rx = transport::FrameBuffer::new();
                }
                Event::Connect => self.start_connect(),
            }
        }
        let losses = self.link.reconnect().losses;
        if losses > self.losses_logged {
            self.losses_logged = losses;
            if losses == 1 || losses.is_power_of_two() {
                tracing::warn!(export = %self.export.name, losses, "connection lost; reconnecting");
            }
        }
        let up = self.link.is_up();
        if up && !self.was_up {
            tracing::info!(export = %self.export.name, losses, "reconnected");
        }
        self.was_up = up;
    }

    /// The error a caller sees for a connection that closed for good.
    fn closed_error(&self, why: Closed) -> Error {
        match why {
            Closed::Protocol(e) => {
                tracing::error!(export = %self.export.name, error = %e, "connection closed");
                Error::from(e)
            }
            Closed::Silent => Error::TimedOut(self.conn.timeout),
            Closed::Transport => Error::Closed,
            Closed::GaveUp => {
                tracing::error!(export = %self.export.name, endpoint = %self.endpoint, "ctrl_loss_timeout: target gone; giving up");
                Error::Lost(self.endpoint.to_string())
            }
        }
    }

    /// Open a transport on a connector thread, so no caller ever blocks in a connect; the
    /// handshake on it then runs here, through the connection.
    fn start_connect(&mut self) {
        let (tx, rx) = std::sync::mpsc::channel();
        let endpoint = self.endpoint.clone();
        let tls = self.tls.clone();
        let timeout = self.conn.timeout.min(CONNECT_TIMEOUT_MAX);
        let spawned = std::thread::Builder::new().name("skiff-reconnect".into()).spawn(move || {
            let _ = tx.send(crate::conn::connect_transport(&endpoint, timeout, tls.as_ref()));
        });
        match spawned {
            Ok(_) => self.connecting = Some(rx),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a reconnection attempt");
                self.link.handle_transport_failed(self.now_us());
            }
        }
    }

    /// Hand the connection the connector thread's transport, if it has one by now (waiting
    /// for it at most `limit`).
    fn take_connected_within(&mut self, limit: Duration) {
        use std::sync::mpsc::RecvTimeoutError;
        let Some(rx) = self.connecting.as_ref() else {
            return;
        };
        let outcome = match rx.recv_timeout(limit) {
            Ok(outcome) => outcome,
            Err(RecvTimeoutError::Timeout) => return,
            Err(RecvTimeoutError::Disconnected) => Err(Error::Closed),
        };
        self.connecting = None;
        let now = self.now_us();
        match outcome.and_then(|stream| Ok((stream, nonce()?))) {
            Ok((stream, nonce)) => {
                let data_messages = stream.data_messages();
                self.conn.stream = stream;
                self.conn.rx = transport::FrameBuffer::new();
                self.link.handle_transport_up(now, data_messages, nonce);
            }
            Err(e) => {
                tracing::debug!(export = %self.export.name, error = %e, "reconnect attempt failed");
                self.link.handle_transport_failed(now);
            }
        }
        self.settle();
    }

    fn take_connected(&mut self) {
        self.take_connected_within(Duration::ZERO);
    }

    /// Send everything the connection has gathered (a handshake's frames, or the session's
    /// caravans), waiting (and receiving) while the socket is full. A failed transport is
    /// reported to the connection, which reconnects or closes for good.
    fn transmit(&mut self) -> Result<()> {
        if self.link.is_closed() {
            return if self.link.session().has_transmit() { Err(Error::Closed) } else { Ok(()) };
        }
        let started = Instant::now();
        let (deadline, now) = (started + self.conn.timeout, self.us_at(started));
        // Without a transport nothing goes: it waits in the session for the next.
        while self.link.has_transmit() {
            let sent = {
                let mut iov = [IoSlice::new(&[]); SEND_IOV_MAX];
                let n = self.link.poll_transmit(&mut iov);
                self.conn.send(&iov[..n])
            };
            let result = match sent {
                Ok(0) => Err(Error::Closed),
                Ok(n) => {
                    self.link.handle_sent(now, n);
                    Ok(())
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => self.conn.wait_writable(deadline),
                Err(e) => Err(e.into()),
            };
            if let Err(e) = result {
                return self.lose(e);
            }
        }
        Ok(())
    }

    /// Handle what already arrived, then receive (with `block`, waiting for at least one byte
    /// if nothing new completed, or for what is due) and handle that too. Without a transport,
    /// with `block`, sleeps until the reconnection policy's next step or the connector
    /// thread's outcome.
    fn pump(&mut self, block: bool) -> Result<()> {
        if self.link.is_closed() {
            return Err(Error::Closed);
        }
        self.handle_due()?;
        if !self.link.has_transport() {
            if block {
                let until = self.due().unwrap_or_else(|| Instant::now() + self.conn.timeout);
                let sleep = until.saturating_duration_since(Instant::now());
                if self.connecting.is_some() {
                    self.take_connected_within(sleep);
                } else {
                    std::thread::sleep(sleep);
                }
            }
            return Ok(());
        }
        let result = self.handle_rx().and_then(|progressed| {
            let got = if block && !progressed {
                let deadline = self.due().unwrap_or_else(|| Instant::now() + self.conn.timeout);
                let Lane { conn, link, .. } = self;
                match conn.receive_blocking(deadline, &mut |conn| receive(conn, link)) {
                    Ok(()) => 1,
                    // Nothing came by the deadline: the next call does what is due.
                    Err(Error::TimedOut(_)) => 0,
                    Err(e) => return Err(e),
                }
            } else {
                receive(&mut self.conn, &mut self.link)?
            };
            if got > 0 {
                let now = self.now_us();
                self.link.handle_received(now);
            }
            self.handle_rx().map(|_| ())
        });
        match result {
            Ok(()) => Ok(()),
            Err(e) => self.lose(e),
        }
    }

    /// Give the connection what the frame buffer holds. Returns whether a completion became
    /// ready.
    fn handle_rx(&mut self) -> Result<bool> {
        let started = Instant::now();
        let now = self.us_at(started);
        let handled = self.link.handle_rx(now, &mut self.conn.rx);
        self.complete_ns += started.elapsed().as_nanos() as u64;
        self.settle();
        let progressed = handled.map_err(|why| self.closed_error(why))?;
        if self.link.has_transmit() {
            // What answers brought about: direct reads the target refused, re-sent as
            // ordinary reads in the same call; a handshake's next frame; the requests a
            // reconnection re-sends.
            self.transmit()?;
        }
        Ok(progressed)
    }

    /// The transport failed with `why` (a send or receive error, the peer's close, a wait for
    /// room that timed out): the connection reconnects and the call goes on as if nothing
    /// happened, or it closes for good (reconnection off) and `why` is returned. An error the
    /// connection already closed on is returned as it is.
    fn lose(&mut self, why: Error) -> Result<()> {
        if self.link.is_closed() {
            return Err(why);
        }
        let now = self.now_us();
        let goes_on = match why {
            Error::Io(_) | Error::Closed | Error::TimedOut(_) => self.link.handle_transport_lost(now),
            _ => {
                self.link.close();
                false
            }
        };
        self.settle();
        if goes_on {
            Ok(())
        } else {
            Err(why)
        }
    }
}

/// Microseconds of `d`, saturating.
fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Fresh randomness for a handshake's key proof.
fn nonce() -> Result<[u8; wire::control::NONCE_LEN]> {
    Ok(rt::random::bytes()?)
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
    /// The largest datagram payload the session's MTU allowed (the largest of the lanes').
    pub datagram_payload_max: u64,
    /// Whether datagrams' checksums cover their payloads (`crc=full`), true if any lane's do.
    pub payload_crc: bool,
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
            datagram_payload_max: 0,
            payload_crc: false,
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
        self.datagram_payload_max = self.datagram_payload_max.max(o.datagram_payload_max);
        self.payload_crc |= o.payload_crc;
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

/// One receive without waiting, timed: laid out by the session (placed data first) while it
/// runs, plain into the frame buffer during a handshake.
fn receive<B: IoBuf>(conn: &mut Conn, link: &mut Connection<B>) -> Result<usize> {
    if !link.is_up() {
        return conn.fill_now(usize::MAX);
    }
    let session = link.session_mut();
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
