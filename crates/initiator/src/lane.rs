//! A lane: one connection, one export, one owning thread.
//!
//! Requests take a slot (their tag) and a place in the open caravan; write payloads stay in
//! the caller's buffer until the caravan is sent with one vectored send. Completions are
//! matched to slots by tag, and the buffer goes back to the caller in the [`Completion`]. Read
//! data is copied from the frame buffer into the buffer the caller posted, or, with direct
//! placement on ([`LaneConfig::direct_min_bytes`]), received straight into it once the
//! completion caravan's descriptors have said where it goes ([`crate::placement`]).

use std::collections::VecDeque;
use std::io::IoSliceMut;
use std::time::{Duration, Instant};

use proto::batch::{BatchConfig, BatchController};
use proto::caravan::{CaravanBuilder, Doorbell};
use proto::slots::SlotTable;
use proto::ProtoError;
use transport::Endpoint;
use wire::caravan::CompletionCaravan;
use wire::{
    ExportInfo, FrameKind, GoAway, Limits, Opcode, ReqFlags, Request, Status, COMPLETION_DESC_LEN, HEADER_LEN,
};

use crate::conn::{frame_error, Conn, DIRECT_IOV_MAX};
use crate::placement::{Placed, Placement};
use crate::{Error, Result};

/// Most requests a lane puts in one caravan, whatever the target would allow: it bounds the
/// gather list of one send, which lives on the stack.
pub const LANE_CARAVAN_REQS_MAX: u32 = 256;
/// The default of [`LaneConfig::direct_min_bytes`]: off. Measured on loopback TCP, placing
/// directly removes the copy from the lane but makes the target's sends dearer by as much or
/// more, at every read size tried (docs/PERFORMANCE.md, "Direct placement").
pub const DIRECT_MIN_BYTES: u32 = u32::MAX;
/// `user_data` reserved for the blocking API's own requests.
const SYNC_USER_DATA: u64 = u64::MAX;

/// How requests are gathered into caravans (the ablation switch of the fast-path work).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Batching {
    /// Every request leaves on its own: the doorbell rings after each submit.
    Off,
    /// The fixed doorbell policy of [`LaneConfig::doorbell`] (i10's caravans).
    Static,
    /// The Tyche controller sets the caravan size and the doorbell delay from measured
    /// throughput ([`proto::batch`]).
    Adaptive(BatchConfig),
}

/// Most batch-level changes a lane remembers for telemetry.
const LEVEL_LOG_MAX: usize = 4096;

/// How a lane behaves.
#[derive(Debug, Clone, Copy)]
pub struct LaneConfig {
    /// What the lane proposes in the handshake (zero fields mean "the target's choice").
    pub limits: Limits,
    pub doorbell: Doorbell,
    pub batching: Batching,
    /// Hybrid polling: spin this long on non-blocking receives before sleeping in `wait`
    /// (zero, the default, always sleeps). Lowers latency at low queue depth; costs a busy
    /// core while spinning.
    pub poll_spin: Duration,
    /// How long a blocking call waits for the target before failing.
    pub timeout: Duration,
    /// Direct placement ([`crate::placement`]) while the reads in flight average at least
    /// this many bytes; smaller reads are received in bulk into the frame buffer and copied
    /// out. 0 places every read, `u32::MAX` (the default, [`DIRECT_MIN_BYTES`]) none.
    pub direct_min_bytes: u32,
}

impl Default for LaneConfig {
    fn default() -> LaneConfig {
        LaneConfig {
            limits: Limits { queue_depth: 256, caravan_reqs_max: 64, caravan_bytes_max: 0, io_bytes_max: 0 },
            doorbell: Doorbell::default(),
            batching: Batching::Static,
            poll_spin: Duration::ZERO,
            timeout: crate::DEFAULT_TIMEOUT,
            direct_min_bytes: DIRECT_MIN_BYTES,
        }
    }
}

/// A buffer a lane can hold for a request until it completes: write data is sent from it,
/// read data lands in it. `Vec<u8>` is the usual one; the C API passes the caller's memory.
pub trait IoBuf: AsRef<[u8]> + AsMut<[u8]> {}

impl<T: AsRef<[u8]> + AsMut<[u8]>> IoBuf for T {}

/// The outcome of one request, with the caller's buffer back.
#[derive(Debug)]
pub struct Completion<B = Vec<u8>> {
    pub user_data: u64,
    pub opcode: Opcode,
    pub status: Status,
    /// For reads, filled with the data when `status` is OK.
    pub buf: Option<B>,
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
    /// little is in flight): see [`crate::placement`].
    pub read_bytes_placed: u64,
    pub read_bytes_copied: u64,
}

impl LaneStats {
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
        }
    }
}

/// Reads submitted and not yet answered.
#[derive(Debug, Default, Clone, Copy)]
struct ReadsInFlight {
    count: u64,
    bytes: u64,
}

#[derive(Debug)]
pub(crate) struct Pending<B> {
    pub opcode: Opcode,
    pub length: u32,
    pub buf: Option<B>,
    pub user_data: u64,
}

pub struct Lane<B = Vec<u8>> {
    conn: Conn,
    export: ExportInfo,
    handle: u32,
    slots: SlotTable<Pending<B>>,
    caravan: CaravanBuilder,
    /// Tags in the open caravan, in order: the payload order on the wire.
    queued: Vec<u32>,
    first_queued_at: Option<Instant>,
    doorbell: Doorbell,
    batching: Batching,
    controller: Option<BatchController>,
    /// Time zero for the controller's clock and the level log.
    epoch: Instant,
    /// (milliseconds since `epoch`, batch level) at every adaptive decision.
    level_log: Vec<(u64, u32)>,
    done: VecDeque<Completion<B>>,
    /// The completion caravan whose read data is arriving straight into callers' buffers.
    placement: Placement<B>,
    /// Reads submitted and not yet answered: whether to place directly.
    reads: ReadsInFlight,
    direct_min_bytes: u32,
    broken: bool,
    stats: LaneStats,
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
        let c = self.run_sync(Opcode::Read, ReqFlags::empty(), offset, buf.len(), Some(scratch))?;
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
        let c = self.run_sync(Opcode::Write, ReqFlags::empty(), offset, buf.len(), Some(scratch))?;
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
        proposed.caravan_reqs_max = match proposed.caravan_reqs_max {
            0 => LANE_CARAVAN_REQS_MAX,
            n => n.min(LANE_CARAVAN_REQS_MAX),
        };
        let mut conn = Conn::connect(endpoint, &proposed, config.timeout)?;
        conn.spin = config.poll_spin;
        let (h, body) = conn.call(FrameKind::Open, &wire::Open { name: export.to_owned() }.encode())?;
        let reply = proto::client::handle_open_reply(&h, &body)?;
        let limits = conn.limits;
        let queue_depth = limits.queue_depth as usize;
        Ok(Lane::<B> {
            export: ExportInfo {
                name: export.to_owned(),
                size_bytes: reply.size_bytes,
                block_size: reply.block_size,
                flags: reply.flags,
            },
            handle: reply.handle,
            slots: SlotTable::new(queue_depth),
            caravan: CaravanBuilder::new(&limits),
            queued: Vec::with_capacity(limits.caravan_reqs_max as usize),
            first_queued_at: None,
            doorbell: match config.batching {
                // The controller starts at level 1: one request per caravan, sent at once.
                Batching::Adaptive(_) => Doorbell { aggregation_reqs: 1, delay_us: 0, ..config.doorbell },
                _ => config.doorbell,
            },
            batching: config.batching,
            controller: match config.batching {
                Batching::Adaptive(cfg) => Some(BatchController::new(cfg)),
                _ => None,
            },
            epoch: Instant::now(),
            level_log: Vec::new(),
            done: VecDeque::with_capacity(queue_depth),
            placement: Placement::new(),
            reads: ReadsInFlight::default(),
            direct_min_bytes: config.direct_min_bytes,
            broken: false,
            stats: LaneStats::default(),
            scratch: Vec::new(),
            conn,
        })
    }

    pub fn export(&self) -> &ExportInfo {
        &self.export
    }

    pub fn limits(&self) -> &Limits {
        &self.conn.limits
    }

    /// Requests submitted and not yet returned by `poll`/`wait`.
    pub fn in_flight(&self) -> usize {
        self.slots.len() + self.placement.len() + self.done.len()
    }

    pub fn queue_depth(&self) -> usize {
        self.slots.capacity()
    }

    pub fn stats(&self) -> LaneStats {
        LaneStats {
            send_ns: self.conn.send_ns,
            recv_ns: self.conn.recv_ns,
            read_bytes_placed: self.placement.placed_bytes,
            read_bytes_copied: self.stats.read_bytes_copied + self.placement.copied_bytes,
            ..self.stats
        }
    }

    /// Queue any request; the typed `submit_*` methods are the usual entry points. The target
    /// judges range, alignment and permissions; the lane refuses only what it cannot frame.
    /// A request that is accepted completes exactly once, through `poll` or `wait`.
    pub fn submit(
        &mut self,
        opcode: Opcode,
        flags: ReqFlags,
        offset: u64,
        length: usize,
        buf: Option<B>,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<B>> {
        let reject = |error, buf| Err(Rejected { error, buf });
        if self.broken {
            return reject(Error::Closed, buf);
        }
        let Ok(length) = u32::try_from(length) else {
            return reject(Error::InvalidArgument("length over 4 GiB"), buf);
        };
        if opcode == Opcode::Write && length > self.conn.limits.caravan_bytes_max {
            return reject(Error::InvalidArgument("write larger than a caravan may carry"), buf);
        }
        if matches!(opcode, Opcode::Read | Opcode::Write)
            && buf.as_ref().map(|b| b.as_ref().len()) != Some(length as usize)
        {
            return reject(
                Error::InvalidArgument("a read or write needs a buffer of exactly its length"),
                buf,
            );
        }
        if self.slots.is_full() {
            return reject(Error::QueueFull(self.slots.len()), buf);
        }
        // Make room before taking a slot, so a failed send leaves this request untouched.
        let probe = Request { opcode, flags, tag: 0, handle: self.handle, offset, length };
        if !self.caravan.fits(&probe) {
            if let Err(error) = self.ring() {
                return reject(error, buf);
            }
        }
        let Ok(tag) = self.slots.insert(Pending { opcode, length, buf, user_data }) else {
            unreachable!("checked not full above");
        };
        self.caravan.push(&Request { tag, ..probe });
        self.queued.push(tag);
        if opcode == Opcode::Read {
            self.reads.count += 1;
            self.reads.bytes += u64::from(length);
        }
        self.stats.submitted += 1;
        if self.first_queued_at.is_none() {
            self.first_queued_at = Some(Instant::now());
        }
        if let Some(c) = self.controller.as_mut() {
            // Tyche counts requests waiting in its batch queue. A lane sends at once at level 1,
            // so nothing would ever wait; what could be batched is what the caller has
            // outstanding on the lane, so that is the controller's a_out.
            c.handle_arrival(self.slots.len() as u32);
            self.adapt();
        }
        let ring = self.batching == Batching::Off || self.doorbell.ring_after_submit(&self.caravan, flags);
        if ring {
            // On failure the request is already in flight: like every accepted request it
            // completes exactly once (with an I/O error), and the next call reports the error.
            let _ = self.ring();
        }
        Ok(())
    }

    /// Let the adaptive controller close its interval, and follow its decision.
    fn adapt(&mut self) {
        let Some(c) = self.controller.as_mut() else { return };
        let now_us = self.epoch.elapsed().as_micros() as u64;
        if let Some(d) = c.poll(now_us) {
            self.doorbell.aggregation_reqs = d.level;
            self.doorbell.delay_us = d.delay_us;
            if self.level_log.len() < LEVEL_LOG_MAX {
                self.level_log.push((now_us / 1000, d.level));
            }
        }
    }

    /// The caravan size the lane aims for now (the adaptive level, or the static one).
    pub fn batch_level(&self) -> u32 {
        if self.batching == Batching::Off {
            1
        } else {
            self.doorbell.aggregation_reqs
        }
    }

    /// Every adaptive decision so far: (milliseconds since the lane opened, batch level).
    pub fn batch_level_log(&self) -> &[(u64, u32)] {
        &self.level_log
    }

    /// When the doorbell's delay bound sends the open caravan if nothing else does first
    /// (`None`: nothing is held back).
    pub fn doorbell_due(&self) -> Option<Instant> {
        self.first_queued_at.map(|first| first + Duration::from_micros(self.doorbell.delay_us))
    }

    /// Requests sent and not yet answered (in flight minus the open caravan and the
    /// completions not yet taken).
    pub fn on_the_wire(&self) -> usize {
        self.slots.len() - self.caravan.len() + self.placement.len()
    }

    /// The connection failed; every request has completed or will complete with an I/O error.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    pub(crate) fn raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.conn.stream)
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.conn.timeout
    }

    /// Send the open caravan now.
    pub fn commit(&mut self) -> Result<()> {
        self.ring()
    }

    /// Collect completions that have arrived, without waiting. Rings the doorbell first if the
    /// delay bound has passed.
    pub fn poll(&mut self, out: &mut Vec<Completion<B>>) -> Result<usize> {
        if let Some(first) = self.first_queued_at {
            let now_us = first.elapsed().as_micros() as u64;
            if self.doorbell.expired(0, now_us) {
                self.ring()?;
            }
        }
        // Even when the connection fails, what it completed (with an error) reaches `out`.
        let pumped = self.pump(false);
        let n = self.take_done(out);
        pumped.map(|_| n)
    }

    /// Send the open caravan and wait until at least `min` completions (bounded by what is in
    /// flight) have been collected into `out`.
    pub fn wait(&mut self, min: usize, out: &mut Vec<Completion<B>>) -> Result<usize> {
        self.ring()?;
        let min = min.min(self.in_flight());
        let mut got = self.take_done(out);
        let deadline = Instant::now() + self.conn.timeout;
        while got < min {
            self.pump(true).inspect_err(|_| {
                got += self.take_done(out);
            })?;
            got += self.take_done(out);
            if got < min && Instant::now() >= deadline {
                return Err(Error::TimedOut(self.conn.timeout));
            }
        }
        Ok(got)
    }

    /// Blocking flush.
    pub fn flush(&mut self) -> Result<()> {
        let c = self.run_sync(Opcode::Flush, ReqFlags::empty(), 0, 0, None)?;
        status_result(c.status)
    }

    fn run_sync(
        &mut self,
        opcode: Opcode,
        flags: ReqFlags,
        offset: u64,
        length: usize,
        buf: Option<B>,
    ) -> Result<Completion<B>> {
        self.submit(opcode, flags, offset, length, buf, SYNC_USER_DATA).map_err(|r| r.error)?;
        self.ring()?;
        let deadline = Instant::now() + self.conn.timeout;
        loop {
            if let Some(i) = self.done.iter().position(|c| c.user_data == SYNC_USER_DATA) {
                return Ok(self.done.remove(i).expect("index from position"));
            }
            if Instant::now() >= deadline {
                return Err(Error::TimedOut(self.conn.timeout));
            }
            self.pump(true)?;
        }
    }

    fn take_done(&mut self, out: &mut Vec<Completion<B>>) -> usize {
        let n = self.done.len();
        self.stats.completed += n as u64;
        out.extend(self.done.drain(..));
        n
    }

    fn ring(&mut self) -> Result<()> {
        if self.caravan.is_empty() {
            return Ok(());
        }
        if self.broken {
            return Err(Error::Closed);
        }
        let bucket = match self.caravan.len() {
            n if n <= 64 => (usize::BITS - (n - 1).leading_zeros()) as usize,
            _ => 7,
        };
        self.stats.caravan_hist[bucket.min(7)] += 1;
        let cap = self.rx_cap();
        let result = {
            let mut parts: [&[u8]; LANE_CARAVAN_REQS_MAX as usize + 1] =
                [&[]; LANE_CARAVAN_REQS_MAX as usize + 1];
            parts[0] = self.caravan.seal();
            let mut n = 1;
            for &tag in &self.queued {
                let p = self.slots.get(tag).expect("queued tags are in flight");
                if p.opcode == Opcode::Write {
                    parts[n] = p.buf.as_ref().map_or(&[][..], |b| b.as_ref());
                    n += 1;
                }
            }
            let placement = &mut self.placement;
            self.conn.send_all_receiving(&parts[..n], &mut |conn| receive(conn, placement, cap))
        };
        self.caravan.clear();
        self.queued.clear();
        self.first_queued_at = None;
        self.stats.caravans_sent += 1;
        result.inspect_err(|_| self.fail_all())
    }

    /// Receive and process completions; with `block`, wait for at least one byte first.
    fn pump(&mut self, block: bool) -> Result<()> {
        if self.broken {
            return Err(Error::Closed);
        }
        let result = self.process_frames().and_then(|progressed| {
            let cap = self.rx_cap();
            let placement = &mut self.placement;
            let mut receive = |conn: &mut Conn| receive(conn, placement, cap);
            if block && !progressed {
                let deadline = Instant::now() + self.conn.timeout;
                self.conn.receive_blocking(deadline, &mut receive)?;
            } else {
                receive(&mut self.conn)?;
            }
            self.process_frames().map(|_| ())
        });
        result.inspect_err(|_| self.fail_all())
    }

    /// Handle every complete frame in the receive buffer. Returns whether any completed.
    fn process_frames(&mut self) -> Result<bool> {
        let started = Instant::now();
        let result = self.handle_frames();
        self.stats.complete_ns += started.elapsed().as_nanos() as u64;
        result
    }

    fn handle_frames(&mut self) -> Result<bool> {
        let mut progressed = false;
        if self.placement.is_complete() {
            for Placed { pending, completion } in self.placement.take() {
                finish(&mut self.done, &mut self.controller, &mut self.reads, pending, completion.status);
            }
            progressed = true;
        }
        if self.placement.is_active() {
            // Its data is still arriving; nothing after it can have come yet.
            return Ok(progressed);
        }
        while let Some(f) = self.conn.next_frame()? {
            let body = self.conn.rx.body(&f);
            match f.header.kind {
                FrameKind::Completions => {
                    let caravan = CompletionCaravan::parse(&f.header, body).map_err(ProtoError::from)?;
                    self.stats.completion_caravans += 1;
                    for (c, data) in caravan.iter() {
                        let mut p = self.slots.remove(c.tag).ok_or(ProtoError::UnknownTag(c.tag))?;
                        let want = if c.status.is_ok() && p.opcode == Opcode::Read { p.length } else { 0 };
                        if c.data_len != want {
                            return Err(ProtoError::DataLength { tag: c.tag, got: c.data_len, want }.into());
                        }
                        if let Some(buf) = p.buf.as_mut().filter(|_| want > 0) {
                            buf.as_mut().copy_from_slice(data);
                            self.stats.read_bytes_copied += data.len() as u64;
                        }
                        finish(&mut self.done, &mut self.controller, &mut self.reads, p, c.status);
                        progressed = true;
                    }
                }
                FrameKind::GoAway => {
                    let g = GoAway::decode(body).map_err(ProtoError::from)?;
                    return Err(Error::GoAway { status: g.status, message: g.message });
                }
                other => return Err(ProtoError::Unexpected(other, "on a lane").into()),
            }
        }
        self.begin_placement()?;
        Ok(progressed)
    }

    /// If the frame buffer ends in a completion caravan whose descriptors are in but whose
    /// read data is not, take its requests out of the slot table so that the rest of the data
    /// is received straight into their buffers ([`Placement`]).
    fn begin_placement(&mut self) -> Result<()> {
        if !self.placing_directly() {
            return Ok(());
        }
        let max = self.conn.frame_bytes_max();
        let Some((header, so_far)) = self.conn.rx.partial_frame(max).map_err(frame_error)? else {
            return Ok(());
        };
        let desc_bytes = header.desc_count as usize * COMPLETION_DESC_LEN;
        if header.kind != FrameKind::Completions || so_far.len() < desc_bytes {
            return Ok(());
        }
        let head = CompletionCaravan::parse_head(&header, so_far).map_err(ProtoError::from)?;
        // Check all of them before taking any: an error leaves the slots to `fail_all`.
        for c in head.completions() {
            let p = self.slots.get(c.tag).ok_or(ProtoError::UnknownTag(c.tag))?;
            let want = if c.status.is_ok() && p.opcode == Opcode::Read { p.length } else { 0 };
            if c.data_len != want {
                return Err(ProtoError::DataLength { tag: c.tag, got: c.data_len, want }.into());
            }
        }
        let started = Instant::now();
        let slots = &mut self.slots;
        let mut missing = None;
        let entries = head.completions().map_while(|completion| match slots.remove(completion.tag) {
            Some(pending) => Some(Placed { pending, completion }),
            None => {
                missing = Some(completion.tag);
                None
            }
        });
        self.placement.begin(entries, header.payload_len as usize, &so_far[desc_bytes..]);
        self.conn.rx.consume(HEADER_LEN + so_far.len());
        self.stats.completion_caravans += 1;
        self.stats.complete_ns += started.elapsed().as_nanos() as u64;
        match missing {
            // A tag twice in one caravan: the second has no slot left.
            Some(tag) => Err(ProtoError::UnknownTag(tag).into()),
            None => Ok(()),
        }
    }

    /// Whether reads now in flight are large enough to place directly.
    fn placing_directly(&self) -> bool {
        self.direct_min_bytes != u32::MAX
            && self.reads.count > 0
            && self.reads.bytes >= self.reads.count * u64::from(self.direct_min_bytes)
    }

    /// How many bytes one receive may put into the frame buffer. When placing directly, only
    /// what the next frame's header and descriptors can need (one descriptor per request in
    /// flight): their read data then arrives after the descriptors have said where it goes.
    /// Otherwise as much as there is room for.
    fn rx_cap(&self) -> usize {
        if self.placing_directly() {
            HEADER_LEN + COMPLETION_DESC_LEN * self.slots.len().max(1)
        } else {
            usize::MAX
        }
    }

    /// The connection is gone: every request in flight completes with an I/O error, so
    /// callers get their buffers back.
    fn fail_all(&mut self) {
        self.broken = true;
        self.caravan.clear();
        self.queued.clear();
        self.reads = ReadsInFlight::default();
        let placed = self.placement.take().map(|p| p.pending);
        for p in placed.chain(self.slots.drain()) {
            self.done.push_back(Completion {
                user_data: p.user_data,
                opcode: p.opcode,
                status: Status::IoError,
                buf: p.buf,
            });
        }
        self.conn.stream.shutdown();
    }
}

/// Hand a finished request back to its caller, and tell the controller what it moved.
fn finish<B>(
    done: &mut VecDeque<Completion<B>>,
    controller: &mut Option<BatchController>,
    reads: &mut ReadsInFlight,
    p: Pending<B>,
    status: Status,
) {
    if p.opcode == Opcode::Read {
        reads.count -= 1;
        reads.bytes -= u64::from(p.length);
    }
    if let Some(ctl) = controller.as_mut() {
        let moved = matches!(p.opcode, Opcode::Read | Opcode::Write) && status.is_ok();
        ctl.handle_completion(if moved { p.length.into() } else { 0 });
    }
    done.push_back(Completion { user_data: p.user_data, opcode: p.opcode, status, buf: p.buf });
}

/// One receive without waiting: the unfilled parts of the placed frame's buffers first, then
/// (once they cover all its remaining data) the frame buffer, at most `cap` bytes of it.
fn receive<B: IoBuf>(conn: &mut Conn, placement: &mut Placement<B>, cap: usize) -> Result<usize> {
    if !placement.is_active() || placement.is_complete() {
        return conn.fill_now(cap);
    }
    let got = {
        let mut iov: [IoSliceMut<'_>; DIRECT_IOV_MAX] = std::array::from_fn(|_| IoSliceMut::new(&mut []));
        let (n, all) = placement.destinations(&mut iov);
        conn.fill_direct(&mut iov[..n], all, cap)?
    };
    placement.receive(got);
    Ok(got)
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
