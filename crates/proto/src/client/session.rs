//! The initiator's session on one lane: everything between a caller's request and the bytes on
//! the wire, with no socket, clock or thread.
//!
//! A [`ClientSession`] owns the lane's slots (tags), the [`Outbox`] of request caravans, the
//! doorbell and the adaptive batch controller, completion matching and every check on what the
//! target sends back, the bookkeeping of direct placement, and failing everything when the
//! connection dies. A driver (a lane over a socket, a shared lane, the simulator) moves bytes
//! and time in and out:
//!
//! - inputs: [`submit`](ClientSession::submit) and [`commit`](ClientSession::commit) from the
//!   caller; [`handle_rx`](ClientSession::handle_rx) with received bytes;
//!   [`handle_sent`](ClientSession::handle_sent) after a send;
//!   [`handle_timeout`](ClientSession::handle_timeout) when [`poll_timeout`] falls due;
//!   [`handle_closed`](ClientSession::handle_closed) when the transport fails for good;
//!   [`handle_disconnected`](ClientSession::handle_disconnected) and
//!   [`reattach`](ClientSession::reattach) around a reconnection;
//! - outputs: [`poll_transmit`](ClientSession::poll_transmit) (what to send, gathered from the
//!   callers' buffers), [`recv_destinations`](ClientSession::recv_destinations) (where read
//!   data may be received directly), [`poll_timeout`](ClientSession::poll_timeout) (when to
//!   call back), and completions ([`take_completions`](ClientSession::take_completions)).
//!
//! Time is a `now_us` passed in, microseconds on any clock that does not go backwards.
//!
//! **Losing the connection.** Whatever ends a connection (a receive the session refuses, a
//! GOAWAY, the driver's [`handle_disconnected`](ClientSession::handle_disconnected)), the
//! session first *detaches*: every request not yet answered is parked, whole, in the order it
//! was submitted; nothing is sent and new submissions queue behind them. The driver then
//! either reconnects and calls [`reattach`](ClientSession::reattach), which gives the parked
//! requests fresh tags and sends them again, in order, on the new connection; or gives up with
//! [`handle_closed`](ClientSession::handle_closed) (each request completes with an I/O error);
//! or, while it keeps trying, fails what waits with
//! [`fail_parked`](ClientSession::fail_parked) (SPDK's `fast_io_fail_timeout`). A request
//! re-sent may have been executed before the connection was lost; every opcode is idempotent
//! in isolation, and no completion was given for it, so the caller cannot tell.
//!
//! [`poll_timeout`]: ClientSession::poll_timeout

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut};

use wire::caravan::CompletionCaravan;
use wire::control::CONTROL_BODY_MAX;
use wire::framing::peek_header;
use wire::CAPABILITY_LEN;
use wire::{Capability, FrameBuffer, FrameKind, GoAway, Header, Limits, Opcode, ReqFlags, Request, Status};
use wire::{COMPLETION_DESC_LEN, HEADER_LEN};

use super::directory::Directory;
use super::outbox::Outbox;
use super::placement::{Placed, Placement};
use crate::batch::{BatchConfig, BatchController, Decision};
use crate::caravan::Doorbell;
use crate::slots::SlotTable;
use crate::ProtoError;

/// A buffer a session can hold for a request until it completes: write data is sent from it,
/// read data lands in it. `Vec<u8>` is the usual one; the C API passes the caller's memory.
pub trait IoBuf: AsRef<[u8]> + AsMut<[u8]> {}

impl<T: AsRef<[u8]> + AsMut<[u8]>> IoBuf for T {}

/// How requests are gathered into caravans (the ablation switch of the fast path).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Batching {
    /// Every request leaves on its own: the doorbell rings after each submit.
    Off,
    /// The fixed doorbell policy of [`SessionConfig::doorbell`] (i10's caravans).
    Static,
    /// The Tyche controller sets the caravan size and the doorbell delay from measured
    /// throughput ([`crate::batch`]).
    Adaptive(BatchConfig),
}

/// [`SessionConfig::direct_min_bytes`] that places no read directly.
pub const DIRECT_OFF: u32 = u32::MAX;

/// Most batch-level changes a session remembers for telemetry.
pub const LEVEL_LOG_MAX: usize = 4096;

/// How a session batches and receives.
#[derive(Debug, Clone, Copy)]
pub struct SessionConfig {
    pub doorbell: Doorbell,
    pub batching: Batching,
    /// Direct placement while the reads in flight average at least this many bytes; smaller
    /// reads are received into the frame buffer and copied out. 0 places every read,
    /// [`DIRECT_OFF`] none.
    pub direct_min_bytes: u32,
    /// Direct reads (ODAFS): the number of capabilities the directory holds; 0 turns direct
    /// reads off. Only when the target agreed to direct reads in the handshake.
    pub directory_entries: u32,
}

/// What a caller asks for.
#[derive(Debug)]
pub struct Submission<B> {
    pub opcode: Opcode,
    pub flags: ReqFlags,
    pub offset: u64,
    pub length: usize,
    /// For reads and writes, exactly `length` bytes: the data to write or the room to read into.
    pub buf: Option<B>,
    /// The caller's; handed back in the completion.
    pub user_data: u64,
}

/// The outcome of one request, with the caller's buffer back.
#[derive(Debug)]
pub struct Completion<B = Vec<u8>> {
    pub user_data: u64,
    pub opcode: Opcode,
    pub status: Status,
    /// For reads, filled with the data when `status` is OK.
    pub buf: Option<B>,
}

/// Why a session did not take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// The connection failed; nothing more is accepted.
    Closed,
    /// The request cannot be framed (the target would judge everything else).
    Invalid(&'static str),
    /// Every slot is in flight; holds how many.
    QueueFull(usize),
}

/// A request the session did not take, with its buffer returned.
#[derive(Debug)]
pub struct Refused<B> {
    pub error: SubmitError,
    pub buf: Option<B>,
}

/// What a session did, for benchmarks and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SessionStats {
    pub submitted: u64,
    pub completed: u64,
    pub caravans_sent: u64,
    /// Caravans sent by size: at most 1, 2, 4, ... 64 requests, then more.
    pub caravan_hist: [u64; 8],
    pub completion_caravans: u64,
    /// Read data received straight into callers' buffers, and read data copied into them from
    /// the frame buffer.
    pub read_bytes_placed: u64,
    pub read_bytes_copied: u64,
    /// Read data that arrived in data messages, placed by tag and offset
    /// ([`ClientSession::place`]).
    pub read_bytes_in_messages: u64,
    /// Reads served by the target from a capability, without its backend.
    pub direct_reads: u64,
    /// Writes the target took under an extent with the write right.
    pub direct_writes: u64,
    /// Direct reads and writes the target refused (stale or bad capability)...
    pub direct_faults: u64,
    /// ...and re-issued as ordinary reads and writes in the same call.
    pub fallbacks: u64,
    /// Capabilities received from the target.
    pub capabilities_received: u64,
}

/// What [`ClientSession::handle_rx`] did with the bytes it was shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxProgress {
    /// Bytes taken from the front; the driver drops them from its buffer.
    pub consumed: usize,
    /// Length of the frame that starts right after them and has not wholly arrived (its header
    /// was checked), so the driver can make room; 0 when nothing is known of the next frame.
    pub need: usize,
}

/// A request between `submit` and its completion.
#[derive(Debug)]
pub(super) struct Pending<B> {
    pub opcode: Opcode,
    pub length: u32,
    pub buf: Option<B>,
    pub user_data: u64,
    /// Its caravan has left whole: only now may the target answer it.
    pub sent: bool,
    /// What a re-send needs besides the above.
    pub flags: ReqFlags,
    pub offset: u64,
    /// Submission order, kept across reconnections.
    pub seq: u64,
    /// A direct read's capability, sent as its payload.
    pub cap: Option<[u8; CAPABILITY_LEN]>,
    /// With data messages: bytes of its read data placed so far, and the status its
    /// completion brought if that came first (it completes when the data is all in).
    pub placed: u32,
    pub answered: Option<Status>,
}

/// Reads submitted and not yet answered.
#[derive(Debug, Default, Clone, Copy)]
struct ReadsInFlight {
    count: u64,
    bytes: u64,
}

/// One lane's protocol state on the initiator. See the module documentation.
#[derive(Debug)]
pub struct ClientSession<B> {
    limits: Limits,
    /// Export handle every request names.
    handle: u32,
    slots: SlotTable<Pending<B>>,
    outbox: Outbox,
    /// When the open caravan's first request arrived.
    first_queued_us: Option<u64>,
    doorbell: Doorbell,
    batching: Batching,
    controller: Option<BatchController>,
    /// Every adaptive decision, at most [`LEVEL_LOG_MAX`].
    level_log: Vec<Decision>,
    done: VecDeque<Completion<B>>,
    /// The completion caravan whose read data is arriving straight into callers' buffers.
    placement: Placement<B>,
    reads: ReadsInFlight,
    direct_min_bytes: u32,
    broken: bool,
    /// The connection is gone; requests wait in `parked` (and new ones in the slots) for
    /// [`reattach`](Self::reattach) or [`handle_closed`](Self::handle_closed).
    detached: bool,
    /// Requests not answered when the connection was lost, sized once to the queue depth.
    parked: Vec<Pending<B>>,
    next_seq: u64,
    /// Refuse submissions until the next reattach ([`fail_parked`](Self::fail_parked)).
    failing_fast: bool,
    /// Capabilities for direct reads, when they were negotiated.
    directory: Option<Directory>,
    /// Direct reads the target refused, to be sent again as ordinary reads.
    fallback: Vec<Pending<B>>,
    /// Completion caravans end after their descriptors: read data comes in data messages.
    data_messages: bool,
    /// What the last data messages did wrong, reported by the next `handle_rx`.
    place_error: Option<ProtoError>,
    stats: SessionStats,
    #[cfg(feature = "mutations")]
    mutation: Mutation,
}

/// Deliberately broken variants of the session, for the simulator's proof that it catches
/// them. Only the feature `mutations` (never on in the product's binaries) lets one be planted;
/// without it every check of `ClientSession::planted` is a constant `None` and folds away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    None,
    /// The first two completions of every completion caravan are matched to each other's tag.
    SwapTags,
    /// When the connection fails, requests not yet wholly sent are dropped instead of being
    /// completed with an error: their callers wait forever.
    ForgetUnsent,
    /// The doorbell's delay bound is never honoured: a caravan that does not fill waits for the
    /// next submit or commit.
    IgnoreDeadline,
    /// When the connection is lost, writes already sent are taken as done and completed OK
    /// instead of being parked and re-sent: "sent" mistaken for "executed".
    AckSentWrites,
    /// The first two segments of every data message are placed in each other's requests'
    /// buffers (the data-message form of `SwapTags`).
    SwapSegments,
    /// Connection: a reconnection skips OPEN and sends the parked requests under the export
    /// handle of the lost connection, which the new one never opened.
    ReopenWithoutOpen,
    /// Connection: the reconnection policy is driven only when a transport is lost, not from
    /// `handle_timeout`, so an attempt that failed is never followed by another.
    NoRetry,
}

impl<B: IoBuf> ClientSession<B> {
    /// A session under the negotiated `limits` for export `handle`. Allocates everything it
    /// will ever need now, sized by the queue depth.
    pub fn new(config: &SessionConfig, limits: Limits, handle: u32) -> ClientSession<B> {
        let queue_depth = (limits.queue_depth as usize).clamp(1, crate::slots::SLOTS_MAX);
        let doorbell = match config.batching {
            // The controller sets the caravan size and the delay. A byte bound of the doorbell
            // would cut its caravans of writes short of its level (64 KiB holds 16 writes of 4
            // KiB); the negotiated bytes per caravan still bound them (`Outbox::fits`).
            Batching::Adaptive(_) => {
                Doorbell { aggregation_reqs: 1, aggregation_bytes: u32::MAX, delay_us: 0 }
            }
            _ => config.doorbell,
        };
        ClientSession {
            limits,
            handle,
            slots: SlotTable::new(queue_depth),
            outbox: Outbox::new(&limits, queue_depth),
            first_queued_us: None,
            doorbell,
            batching: config.batching,
            controller: match config.batching {
                Batching::Adaptive(cfg) => Some(BatchController::new(cfg)),
                _ => None,
            },
            // Its full size up front (64 KiB) when it will be used: it grows on the data path
            // otherwise.
            level_log: match config.batching {
                Batching::Adaptive(_) => Vec::with_capacity(LEVEL_LOG_MAX),
                _ => Vec::new(),
            },
            done: VecDeque::with_capacity(queue_depth),
            placement: Placement::new(),
            directory: (config.directory_entries > 0)
                .then(|| Directory::new(config.directory_entries as usize)),
            fallback: Vec::with_capacity(if config.directory_entries > 0 { queue_depth } else { 0 }),
            reads: ReadsInFlight::default(),
            direct_min_bytes: config.direct_min_bytes,
            broken: false,
            detached: false,
            parked: Vec::with_capacity(queue_depth),
            next_seq: 0,
            failing_fast: false,
            data_messages: false,
            place_error: None,
            stats: SessionStats::default(),
            #[cfg(feature = "mutations")]
            mutation: Mutation::None,
        }
    }

    /// Whether the connection agreed on data messages (`FEATURE_DATA_MESSAGES`): completion
    /// caravans then end after their descriptors, and read data arrives through
    /// [`place`](Self::place). Set after every handshake, before any request is sent on it.
    pub fn set_data_messages(&mut self, on: bool) {
        self.data_messages = on;
    }

    /// Whether read data comes in data messages ([`set_data_messages`](Self::set_data_messages)).
    pub fn data_messages(&self) -> bool {
        self.data_messages
    }

    /// A data message's payload from the transport (its segments, docs/PROTOCOL.md 16.9): put
    /// each segment's bytes into the buffer of the request it names, at its offset. A request
    /// whose completion came first completes when its last byte is in. A segment no request
    /// can take breaks the session, reported by the next [`handle_rx`](Self::handle_rx).
    pub fn place(&mut self, payload: &[u8]) {
        if self.broken || self.detached || self.place_error.is_some() {
            return;
        }
        // The planted bug swaps the first two segments' tags; nothing is allocated unless it
        // is planted.
        #[cfg(feature = "mutations")]
        if self.planted() == Mutation::SwapSegments {
            let mut segs: Vec<_> = wire::datagram::PlaceSegment::parse_all(payload).collect();
            if let [Ok(a), Ok(b), ..] = &mut segs[..] {
                std::mem::swap(&mut a.tag, &mut b.tag);
            }
            for seg in segs {
                if let Err(e) = self.place_segment(seg) {
                    self.place_error = Some(e);
                    return;
                }
            }
            return;
        }
        for seg in wire::datagram::PlaceSegment::parse_all(payload) {
            if let Err(e) = self.place_segment(seg) {
                self.place_error = Some(e);
                return;
            }
        }
    }

    fn place_segment(
        &mut self,
        seg: Result<wire::datagram::PlaceSegment<'_>, wire::datagram::DatagramError>,
    ) -> Result<(), ProtoError> {
        let seg = seg.map_err(|_| ProtoError::DataMessage { tag: 0, why: "malformed segment" })?;
        let refuse = |why| ProtoError::DataMessage { tag: seg.tag, why };
        if !self.data_messages {
            return Err(refuse("data messages were not agreed"));
        }
        let p = self.slots.get_mut(seg.tag).filter(|p| p.sent).ok_or(refuse("tag not in flight"))?;
        if !p.opcode.returns_data() {
            return Err(refuse("the request returns no data"));
        }
        let end = u64::from(seg.offset) + seg.bytes.len() as u64;
        if end > u64::from(p.length) || u64::from(p.placed) + seg.bytes.len() as u64 > u64::from(p.length) {
            return Err(refuse("more data than the request's length"));
        }
        let buf = p.buf.as_mut().ok_or(refuse("the request has no buffer"))?;
        buf.as_mut()[seg.offset as usize..end as usize].copy_from_slice(seg.bytes);
        p.placed += seg.bytes.len() as u32;
        self.stats.read_bytes_in_messages += seg.bytes.len() as u64;
        if p.placed == p.length {
            if let Some(status) = p.answered {
                let p = self.slots.remove(seg.tag).expect("looked up above");
                self.settle(p, status);
            }
        }
        Ok(())
    }

    fn settle(&mut self, p: Pending<B>, status: Status) {
        settle(
            &mut self.done,
            &mut self.controller,
            &mut self.reads,
            &mut self.stats,
            &mut self.directory,
            &mut self.fallback,
            p,
            status,
        );
    }

    /// One receive for a session with data messages: `recv` is the driver's I/O, given the
    /// frame buffer's spare room and a placer for the data messages that arrive meanwhile
    /// ([`place`](Self::place)). Returns the bytes received into the frame buffer plus those
    /// placed, so a receive that brought only data messages (which may have completed
    /// requests) is progress, not `WouldBlock`; `Ok(0)` still means the peer closed. Call
    /// [`handle_rx`](Self::handle_rx) afterwards.
    pub fn receive_placing(
        &mut self,
        rx: &mut FrameBuffer,
        recv: impl FnOnce(&mut [IoSliceMut<'_>], &mut dyn FnMut(&[u8])) -> io::Result<usize>,
    ) -> io::Result<usize> {
        let before = self.stats.read_bytes_in_messages;
        let got = recv(&mut [IoSliceMut::new(rx.spare())], &mut |payload| self.place(payload));
        let placed = (self.stats.read_bytes_in_messages - before) as usize;
        match got {
            Ok(0) => Ok(0),
            Ok(n) => {
                rx.commit(n);
                Ok(n + placed)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && placed > 0 => Ok(placed),
            Err(e) => Err(e),
        }
    }

    /// Plant a bug, for the simulator's proof that it catches them.
    #[cfg(feature = "mutations")]
    pub fn set_mutation(&mut self, mutation: Mutation) {
        self.mutation = mutation;
    }

    /// The bug planted in this session (and read by its connection).
    #[cfg(feature = "mutations")]
    pub(super) fn planted(&self) -> Mutation {
        self.mutation
    }

    #[cfg(not(feature = "mutations"))]
    #[inline(always)]
    pub(super) fn planted(&self) -> Mutation {
        Mutation::None
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn queue_depth(&self) -> usize {
        self.slots.capacity()
    }

    /// The export handle requests go out under.
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// Hold `cap`, a reference registered on this connection (`REGISTER`), in the directory,
    /// so that reads it covers go direct. False when direct reads are off (no directory).
    pub fn remember(&mut self, cap: Capability) -> bool {
        match self.directory.as_mut() {
            Some(d) => {
                d.insert(cap);
                true
            }
            None => false,
        }
    }

    /// Requests accepted and not yet taken back by the caller.
    pub fn in_flight(&self) -> usize {
        self.slots.len() + self.placement.len() + self.parked.len() + self.done.len()
    }

    /// Requests sent whole and not yet answered.
    pub fn on_the_wire(&self) -> usize {
        self.slots.len() - self.outbox.queued_reqs() + self.placement.len()
    }

    /// Completions waiting for the caller.
    pub fn ready(&self) -> usize {
        self.done.len()
    }

    /// The connection failed for good: every request has completed or will complete with an
    /// I/O error.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// The connection is lost and the session waits for [`reattach`](Self::reattach) (or
    /// [`handle_closed`](Self::handle_closed)); requests are kept.
    pub fn is_detached(&self) -> bool {
        self.detached
    }

    pub fn stats(&self) -> SessionStats {
        SessionStats {
            read_bytes_placed: self.placement.placed_bytes,
            read_bytes_copied: self.stats.read_bytes_copied + self.placement.copied_bytes,
            ..self.stats
        }
    }

    /// The caravan size the session aims for now (the adaptive level, or the static one).
    pub fn batch_level(&self) -> u32 {
        if self.batching == Batching::Off {
            1
        } else {
            self.doorbell.aggregation_reqs
        }
    }

    /// Every adaptive decision so far (times on the driver's clock).
    pub fn batch_level_log(&self) -> &[Decision] {
        &self.level_log
    }

    /// Queue a request in the open caravan. The target judges range, alignment and
    /// permissions; the session refuses only what it cannot frame. An accepted request
    /// completes exactly once.
    pub fn submit(&mut self, now_us: u64, sub: Submission<B>) -> Result<(), Refused<B>> {
        let Submission { opcode, flags, offset, length, buf, user_data } = sub;
        let refuse = |error, buf| Err(Refused { error, buf });
        if self.broken || self.failing_fast {
            return refuse(SubmitError::Closed, buf);
        }
        let Ok(length) = u32::try_from(length) else {
            return refuse(SubmitError::Invalid("length over 4 GiB"), buf);
        };
        if opcode == Opcode::Write && length > self.limits.caravan_bytes_max {
            return refuse(SubmitError::Invalid("write larger than a caravan may carry"), buf);
        }
        if matches!(opcode, Opcode::Read | Opcode::Write)
            && buf.as_ref().map(|b| b.as_ref().len()) != Some(length as usize)
        {
            return refuse(SubmitError::Invalid("a read or write needs a buffer of exactly its length"), buf);
        }
        if self.slots.is_full() {
            return refuse(SubmitError::QueueFull(self.slots.len()), buf);
        }
        if matches!(opcode, Opcode::DirectRead | Opcode::DirectWrite) {
            return refuse(
                SubmitError::Invalid(
                    "direct reads and writes are the session's to choose: submit a read or write",
                ),
                buf,
            );
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let (opcode, flags, cap) = self.choose_direct(opcode, flags, offset, length);
        let pending = Pending {
            opcode,
            length,
            buf,
            user_data,
            sent: false,
            flags,
            offset,
            seq,
            cap,
            placed: 0,
            answered: None,
        };
        self.enqueue(pending);
        if opcode.returns_data() {
            self.reads.count += 1;
            self.reads.bytes += u64::from(length);
        }
        self.stats.submitted += 1;
        self.first_queued_us.get_or_insert(now_us);
        if let Some(c) = self.controller.as_mut() {
            // Tyche counts requests waiting in its batch queue. A lane sends at once at level 1,
            // so nothing would ever wait; what could be batched is what the caller has
            // outstanding on the lane, so that is the controller's a_out.
            c.handle_arrival(self.slots.len() as u32);
        }
        self.adapt(now_us);
        let ring = self.batching == Batching::Off
            || self.doorbell.ring_after_submit(
                self.outbox.open_len(),
                self.outbox.open_payload_bytes(),
                flags,
            );
        if ring {
            self.seal();
        }
        Ok(())
    }

    /// With a directory, a read becomes a direct read when a capability covers it, and
    /// otherwise asks the target for capabilities for what it reads; a write becomes a direct
    /// write when an extent with the write right covers it (and the capability fits the
    /// caravan beside the data).
    fn choose_direct(
        &self,
        opcode: Opcode,
        flags: ReqFlags,
        offset: u64,
        length: u32,
    ) -> (Opcode, ReqFlags, Option<[u8; CAPABILITY_LEN]>) {
        let Some(dir) = self.directory.as_ref() else { return (opcode, flags, None) };
        match opcode {
            Opcode::Read => match dir.find(offset, length) {
                Some(cap) => (Opcode::DirectRead, flags, Some(cap.encode())),
                None => (Opcode::Read, flags | ReqFlags::WANT_CAP, None),
            },
            Opcode::Write if length as usize + CAPABILITY_LEN <= self.limits.caravan_bytes_max as usize => {
                match dir.find(offset, length).filter(|c| c.rights.contains(wire::CapRights::WRITE)) {
                    Some(cap) => (Opcode::DirectWrite, flags, Some(cap.encode())),
                    None => (opcode, flags, None),
                }
            }
            _ => (opcode, flags, None),
        }
    }

    /// Put a request into a slot and the open caravan (a free slot is the caller's to ensure).
    fn enqueue(&mut self, pending: Pending<B>) {
        let probe = Request {
            opcode: pending.opcode,
            flags: pending.flags,
            tag: 0,
            handle: self.handle,
            offset: pending.offset,
            length: pending.length,
        };
        if !self.outbox.fits(&probe) {
            self.seal();
        }
        let Ok(tag) = self.slots.insert(pending) else {
            unreachable!("a slot is free");
        };
        self.outbox.push(&Request { tag, ..probe });
    }

    /// Close the open caravan now: the caller is about to wait, or has nothing more to add.
    pub fn commit(&mut self) {
        self.seal();
    }

    /// When the doorbell's delay bound closes the open caravan if nothing else does first;
    /// `None` when nothing is held back.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.first_queued_us.map(|first| first.saturating_add(self.doorbell.delay_us))
    }

    /// The clock reached `now_us`: close the open caravan if its delay bound has passed.
    pub fn handle_timeout(&mut self, now_us: u64) {
        if self.planted() == Mutation::IgnoreDeadline {
            return;
        }
        if self.poll_timeout().is_some_and(|due| now_us >= due) {
            self.seal();
        }
    }

    /// Whether bytes wait to be sent ([`poll_transmit`](Self::poll_transmit)); never while
    /// detached.
    pub fn has_transmit(&self) -> bool {
        !self.detached && self.outbox.has_sealed()
    }

    /// Fill `iov` with the bytes to send next, in order: the sealed caravans' headers and
    /// descriptors and their writes' payloads, straight from the callers' buffers. Returns how
    /// many entries it filled (0: nothing to send). Report what went with
    /// [`handle_sent`](Self::handle_sent).
    pub fn poll_transmit<'a>(&'a self, iov: &mut [IoSlice<'a>]) -> usize {
        if self.detached {
            return 0;
        }
        let slots = &self.slots;
        let payload = |tag| match slots.get(tag) {
            Some(Pending { opcode: Opcode::Write, buf: Some(b), .. }) => [b.as_ref(), &[][..]],
            Some(Pending { opcode: Opcode::DirectRead, cap: Some(c), .. }) => [&c[..], &[][..]],
            Some(Pending { opcode: Opcode::DirectWrite, cap: Some(c), buf: Some(b), .. }) => {
                [&c[..], b.as_ref()]
            }
            _ => [&[][..], &[][..]],
        };
        self.outbox.gather(payload, iov)
    }

    /// `n` bytes of what [`poll_transmit`](Self::poll_transmit) offered were sent.
    pub fn handle_sent(&mut self, n: usize) {
        let slots = &mut self.slots;
        self.outbox.advance(n, |tag| {
            if let Some(p) = slots.get_mut(tag) {
                p.sent = true;
            }
        });
    }

    /// Most bytes the next receive may put into the frame buffer. While reads large enough to
    /// place directly are in flight, only what the next frame's header and descriptors can
    /// need: their read data then arrives after the descriptors have said where it goes.
    pub fn rx_cap(&self) -> usize {
        if self.placing_directly() {
            HEADER_LEN + COMPLETION_DESC_LEN * self.slots.len().max(1)
        } else {
            usize::MAX
        }
    }

    /// Where the next receive should put its first bytes: the unfilled parts of the buffers of
    /// the caravan being placed, in order. Returns how many entries of `iov` it filled and
    /// whether they cover all the data still to come (only then may the frame buffer follow
    /// them in the same receive). `(0, true)` when nothing is being placed.
    pub fn recv_destinations<'a>(&'a mut self, iov: &mut [IoSliceMut<'a>]) -> (usize, bool) {
        if !self.placement.is_active() || self.placement.is_complete() {
            return (0, true);
        }
        self.placement.destinations(iov)
    }

    /// `n` bytes were received into the [`recv_destinations`](Self::recv_destinations) (and,
    /// past them, into the frame buffer). Returns how many of them were placed data; the rest
    /// belongs to the frame buffer.
    pub fn handle_placed(&mut self, n: usize) -> usize {
        self.placement.receive(n)
    }

    /// One receive laid out as the session wants it: the buffers of the caravan being placed
    /// first, then (once they cover all its remaining data) at most [`rx_cap`](Self::rx_cap)
    /// bytes of `rx`'s spare room. `recv` is the driver's I/O, called once with that scatter
    /// list; its result is accounted ([`handle_placed`](Self::handle_placed), `rx` committed)
    /// and returned. Call [`handle_rx`](Self::handle_rx) afterwards.
    pub fn receive_with(
        &mut self,
        rx: &mut FrameBuffer,
        recv: impl FnOnce(&mut [IoSliceMut<'_>]) -> io::Result<usize>,
    ) -> io::Result<usize> {
        const DIRECT_IOV_MAX: usize = 64;
        let cap = self.rx_cap();
        let (got, direct_len) = {
            let mut iov: [IoSliceMut<'_>; DIRECT_IOV_MAX + 1] =
                std::array::from_fn(|_| IoSliceMut::new(&mut []));
            let (n, all) = self.recv_destinations(&mut iov[..DIRECT_IOV_MAX]);
            let direct_len: usize = iov[..n].iter().map(|d| d.len()).sum();
            let mut used = n;
            if all {
                let spare = rx.spare();
                let cap = cap.min(spare.len());
                iov[n] = IoSliceMut::new(&mut spare[..cap]);
                used += 1;
            }
            (recv(&mut iov[..used])?, direct_len)
        };
        self.handle_placed(got.min(direct_len));
        if got > direct_len {
            rx.commit(got - direct_len);
        }
        Ok(got)
    }

    /// Handle received bytes: `rx` is everything in the driver's frame buffer not yet consumed.
    /// Completes what arrived whole, checks every header from the header alone (kind and the
    /// negotiated limits) before waiting for its body, and begins direct placement of a
    /// completion caravan whose descriptors are in. On error the session has failed every
    /// request ([`is_broken`](Self::is_broken)) and the driver closes the connection.
    pub fn handle_rx(&mut self, now_us: u64, rx: &[u8]) -> Result<RxProgress, ProtoError> {
        if self.broken || self.detached {
            return Ok(RxProgress { consumed: 0, need: 0 });
        }
        let result = self.process_rx(rx);
        if result.is_err() {
            // Nothing more from this connection can be trusted; the driver reconnects or
            // gives up.
            self.handle_disconnected();
        }
        self.adapt(now_us);
        result
    }

    /// The connection failed or closed for good: every request completes with an I/O error,
    /// so callers get their buffers back, and nothing more is accepted.
    pub fn handle_closed(&mut self) {
        self.handle_disconnected();
        self.broken = true;
        self.detached = false;
        self.fail_parked();
        self.failing_fast = false;
    }

    /// The connection is lost but the driver will try another: park every request not yet
    /// answered, in submission order, to be sent again by [`reattach`](Self::reattach). What
    /// was received is dropped (the driver starts its new connection with an empty buffer).
    pub fn handle_disconnected(&mut self) {
        if self.broken || self.detached {
            return;
        }
        self.detached = true;
        // A data message this connection broke the session with belongs to it alone.
        self.place_error = None;
        self.outbox.clear();
        self.first_queued_us = None;
        let placed = self.placement.take().map(|p| p.pending);
        self.parked.extend(placed.chain(self.slots.drain()));
        if self.planted() == Mutation::AckSentWrites {
            let (acked, kept): (Vec<_>, Vec<_>) =
                self.parked.drain(..).partition(|p| p.sent && p.opcode == Opcode::Write);
            self.parked = kept;
            for p in acked {
                finish(&mut self.done, &mut self.controller, &mut self.reads, &mut self.stats, p, Status::Ok);
            }
        }
    }

    /// Complete every parked request with an I/O error and refuse new ones until the next
    /// reattach: the connection has been lost too long for callers to wait
    /// (`fast_io_fail_timeout`). The driver keeps reconnecting.
    pub fn fail_parked(&mut self) {
        if !self.detached && !self.broken {
            return;
        }
        self.failing_fast = true;
        let forget_unsent = self.planted() == Mutation::ForgetUnsent;
        self.parked.extend(self.slots.drain());
        for p in self.parked.drain(..) {
            if p.opcode.returns_data() {
                self.reads.count -= 1;
                self.reads.bytes -= u64::from(p.length);
            }
            if forget_unsent && !p.sent {
                continue;
            }
            self.done.push_back(Completion {
                user_data: p.user_data,
                opcode: caller_opcode(p.opcode),
                status: Status::IoError,
                buf: p.buf,
            });
        }
    }

    /// A new connection is up, with `limits` negotiated and the export open as `handle`: send
    /// every parked request and every request queued meanwhile again, in submission order,
    /// under fresh tags. Fails (and the driver should give up with
    /// [`handle_closed`](Self::handle_closed)) if the target now allows less than this
    /// session was built on.
    pub fn reattach(&mut self, limits: Limits, handle: u32) -> Result<(), ProtoError> {
        if self.broken {
            return Err(ProtoError::Unexpected(FrameKind::OpenReply, "after the session closed"));
        }
        let was = self.limits;
        for (what, before, now) in [
            ("queue depth", was.queue_depth, limits.queue_depth),
            ("requests per caravan", was.caravan_reqs_max, limits.caravan_reqs_max),
            ("bytes per caravan", was.caravan_bytes_max, limits.caravan_bytes_max),
            ("bytes per I/O", was.io_bytes_max, limits.io_bytes_max),
        ] {
            if now < before {
                return Err(ProtoError::LimitsShrank { what, before, now });
            }
        }
        self.handle = handle;
        if let Some(d) = self.directory.as_mut() {
            // Perhaps another target process, with other keys: start learning again.
            d.clear();
        }
        self.detached = false;
        self.failing_fast = false;
        self.outbox.clear();
        self.first_queued_us = None;
        self.parked.extend(self.slots.drain());
        self.parked.sort_unstable_by_key(|p| p.seq);
        for mut p in self.parked.drain(..) {
            p.sent = false;
            p.placed = 0;
            p.answered = None;
            let probe = Request {
                opcode: p.opcode,
                flags: p.flags,
                tag: 0,
                handle,
                offset: p.offset,
                length: p.length,
            };
            if !self.outbox.fits(&probe) {
                seal(&mut self.outbox, &mut self.stats);
            }
            let Ok(tag) = self.slots.insert(p) else {
                unreachable!("the parked requests held these slots");
            };
            self.outbox.push(&Request { tag, ..probe });
        }
        self.seal();
        Ok(())
    }

    /// Move the completions that arrived to `out`; returns how many.
    pub fn take_completions(&mut self, out: &mut Vec<Completion<B>>) -> usize {
        let n = self.done.len();
        self.stats.completed += n as u64;
        out.extend(self.done.drain(..));
        n
    }

    /// Take the first arrived completion with this `user_data`, if any.
    pub fn take_completion_of(&mut self, user_data: u64) -> Option<Completion<B>> {
        let i = self.done.iter().position(|c| c.user_data == user_data)?;
        self.stats.completed += 1;
        self.done.remove(i)
    }

    fn process_rx(&mut self, rx: &[u8]) -> Result<RxProgress, ProtoError> {
        if let Some(e) = self.place_error.take() {
            return Err(e);
        }
        let mut consumed = 0;
        if self.placement.is_active() {
            consumed += self.placement.absorb(rx);
            if !self.placement.is_complete() {
                return Ok(RxProgress { consumed, need: 0 });
            }
            for Placed { pending, completion } in self.placement.take() {
                settle(
                    &mut self.done,
                    &mut self.controller,
                    &mut self.reads,
                    &mut self.stats,
                    &mut self.directory,
                    &mut self.fallback,
                    pending,
                    completion.status,
                );
            }
            self.fall_back();
        }
        loop {
            let rest = &rx[consumed..];
            let Some(header) = peek_header(rest)? else {
                return Ok(RxProgress { consumed, need: 0 });
            };
            self.admit(&header)?;
            let len = self.frame_len(&header);
            if rest.len() >= len {
                self.handle_frame(&header, &rest[HEADER_LEN..len])?;
                consumed += len;
                continue;
            }
            return Ok(match self.begin_placement(&header, &rest[HEADER_LEN..])? {
                Some(taken) => RxProgress { consumed: consumed + HEADER_LEN + taken, need: 0 },
                None => RxProgress { consumed, need: len },
            });
        }
    }

    /// Bytes of the frame on the stream: a completion caravan's read data is not there when
    /// it comes in data messages.
    fn frame_len(&self, header: &Header) -> usize {
        if self.data_messages && header.kind == FrameKind::Completions {
            HEADER_LEN + header.desc_count as usize * COMPLETION_DESC_LEN
        } else {
            header.frame_len()
        }
    }

    /// Judge a frame from its header alone: only completions and GOAWAY come on a lane, and a
    /// completion caravan keeps to the negotiated limits.
    fn admit(&self, h: &Header) -> Result<(), ProtoError> {
        let l = &self.limits;
        match h.kind {
            FrameKind::Completions => {
                ProtoError::check_limit(
                    "descriptors per caravan",
                    h.desc_count.into(),
                    l.caravan_reqs_max.into(),
                )?;
                ProtoError::check_limit(
                    "caravan payload bytes",
                    h.payload_len.into(),
                    l.caravan_bytes_max.into(),
                )
            }
            FrameKind::GoAway => {
                ProtoError::check_limit("control body bytes", h.payload_len.into(), CONTROL_BODY_MAX as u64)
            }
            FrameKind::Capabilities if self.directory.is_some() => {
                ProtoError::check_limit("control body bytes", h.payload_len.into(), CONTROL_BODY_MAX as u64)
            }
            other => Err(ProtoError::Unexpected(other, "on a lane")),
        }
    }

    fn handle_frame(&mut self, header: &Header, body: &[u8]) -> Result<(), ProtoError> {
        if header.kind == FrameKind::GoAway {
            let g = GoAway::decode(body)?;
            return Err(ProtoError::GoAway { status: g.status, message: g.message });
        }
        if header.kind == FrameKind::Capabilities {
            let (dir, stats) = (self.directory.as_mut(), &mut self.stats);
            if let Some(dir) = dir {
                Capability::decode_list(body, |c| {
                    stats.capabilities_received += 1;
                    dir.insert(c);
                })?;
            }
            return Ok(());
        }
        if self.data_messages {
            return self.handle_completions_apart(header, body);
        }
        let caravan = CompletionCaravan::parse(header, body)?;
        self.stats.completion_caravans += 1;
        // The planted bug swaps the first two tags; nothing is allocated unless it is planted.
        #[cfg(feature = "mutations")]
        let swapped: Vec<u32> = match self.planted() {
            Mutation::SwapTags if caravan.len() >= 2 => {
                let mut tags: Vec<u32> = caravan.iter().map(|(c, _)| c.tag).collect();
                tags.swap(0, 1);
                tags
            }
            _ => Vec::new(),
        };
        #[cfg_attr(not(feature = "mutations"), allow(unused_variables))]
        for (i, (c, data)) in caravan.iter().enumerate() {
            #[cfg(feature = "mutations")]
            let c = wire::Completion { tag: swapped.get(i).copied().unwrap_or(c.tag), ..c };
            let want = self.expected_data(&c)?;
            let mut p = self.slots.remove(c.tag).ok_or(ProtoError::UnknownTag(c.tag))?;
            if let Some(buf) = p.buf.as_mut().filter(|_| want > 0) {
                buf.as_mut().copy_from_slice(data);
                self.stats.read_bytes_copied += data.len() as u64;
            }
            self.settle(p, c.status);
        }
        self.fall_back();
        Ok(())
    }

    /// A completion caravan whose read data comes in data messages: a request whose data is
    /// all in completes now, one still waiting for data keeps its slot, with its status, until
    /// [`place`](Self::place) puts its last byte.
    fn handle_completions_apart(&mut self, header: &Header, descs: &[u8]) -> Result<(), ProtoError> {
        let head = CompletionCaravan::parse_head(header, descs)?;
        let mut data_total = 0u64;
        for c in head.completions() {
            data_total += u64::from(self.expected_data(&c)?);
        }
        if data_total != u64::from(header.payload_len) {
            return Err(ProtoError::Wire(wire::WireError::PayloadMismatch {
                declared: u64::from(header.payload_len),
                sum: data_total,
            }));
        }
        self.stats.completion_caravans += 1;
        for c in head.completions() {
            let p = self.slots.get_mut(c.tag).ok_or(ProtoError::UnknownTag(c.tag))?;
            if p.answered.is_some() {
                return Err(ProtoError::UnknownTag(c.tag));
            }
            if p.placed < c.data_len {
                p.answered = Some(c.status);
                continue;
            }
            if c.data_len == 0 && p.placed > 0 {
                return Err(ProtoError::DataLength { tag: c.tag, got: p.placed, want: 0 });
            }
            let p = self.slots.remove(c.tag).expect("looked up above");
            self.settle(p, c.status);
        }
        self.fall_back();
        Ok(())
    }

    /// Send the direct reads the target refused again as ordinary reads, in the slots their
    /// completions just freed.
    fn fall_back(&mut self) {
        if self.fallback.is_empty() {
            return;
        }
        while let Some(mut p) = self.fallback.pop() {
            if p.opcode == Opcode::DirectWrite {
                p.opcode = Opcode::Write;
            } else {
                p.opcode = Opcode::Read;
                p.flags = p.flags | ReqFlags::WANT_CAP;
            }
            p.cap = None;
            p.sent = false;
            p.placed = 0;
            p.answered = None;
            self.stats.fallbacks += 1;
            self.enqueue(p);
        }
        self.seal();
    }

    /// Check a completion against its request (in flight, sent, right data length); returns
    /// the data length it must carry.
    fn expected_data(&self, c: &wire::Completion) -> Result<u32, ProtoError> {
        let p = self.slots.get(c.tag).filter(|p| p.sent).ok_or(ProtoError::UnknownTag(c.tag))?;
        let want = if c.status.is_ok() && p.opcode.returns_data() { p.length } else { 0 };
        if c.data_len != want {
            return Err(ProtoError::DataLength { tag: c.tag, got: c.data_len, want });
        }
        Ok(want)
    }

    /// If a completion caravan's descriptors are in but its read data is not, and reads are
    /// being placed directly, take its requests out of the slot table so that the rest of the
    /// data is received straight into their buffers. Returns the body bytes it took.
    fn begin_placement(&mut self, header: &Header, so_far: &[u8]) -> Result<Option<usize>, ProtoError> {
        let desc_bytes = header.desc_count as usize * COMPLETION_DESC_LEN;
        if !self.placing_directly() || header.kind != FrameKind::Completions || so_far.len() < desc_bytes {
            return Ok(None);
        }
        let head = CompletionCaravan::parse_head(header, so_far)?;
        // Check all of them before taking any: an error leaves the slots to `fail`.
        for c in head.completions() {
            self.expected_data(&c)?;
        }
        let slots = &mut self.slots;
        let mut missing = None;
        let entries = head.completions().map_while(|completion| match slots.remove(completion.tag) {
            Some(pending) => Some(Placed { pending, completion }),
            None => {
                missing = Some(completion.tag);
                None
            }
        });
        self.placement.begin(entries, header.payload_len as usize);
        self.stats.completion_caravans += 1;
        if let Some(tag) = missing {
            // A tag twice in one caravan: the second finds its slot gone.
            return Err(ProtoError::UnknownTag(tag));
        }
        let arrived = self.placement.absorb(&so_far[desc_bytes..]);
        Ok(Some(desc_bytes + arrived))
    }

    /// Whether reads now in flight are large enough to place directly.
    fn placing_directly(&self) -> bool {
        !self.data_messages
            && self.direct_min_bytes != DIRECT_OFF
            && self.reads.count > 0
            && self.reads.bytes >= self.reads.count * u64::from(self.direct_min_bytes)
    }

    /// Close the open caravan and queue it for the wire.
    fn seal(&mut self) {
        if seal(&mut self.outbox, &mut self.stats) > 0 {
            self.first_queued_us = None;
        }
    }

    /// Let the adaptive controller close its interval, and follow its decision.
    fn adapt(&mut self, now_us: u64) {
        let Some(c) = self.controller.as_mut() else { return };
        if let Some(d) = c.poll(now_us) {
            self.doorbell.aggregation_reqs = d.level;
            self.doorbell.delay_us = d.delay_us;
            if self.level_log.len() < LEVEL_LOG_MAX {
                self.level_log.push(d);
            }
        }
    }
}

/// Close the open caravan of `outbox` and count it; returns its requests.
fn seal(outbox: &mut Outbox, stats: &mut SessionStats) -> usize {
    let reqs = outbox.seal();
    if reqs > 0 {
        let bucket = match reqs {
            n if n <= 64 => (usize::BITS - (n - 1).leading_zeros()) as usize,
            _ => 7,
        };
        stats.caravan_hist[bucket.min(7)] += 1;
        stats.caravans_sent += 1;
    }
    reqs
}

/// A request the target answered: a direct read it refused goes to `fallback` (its
/// reference forgotten) to be read the ordinary way; anything else is finished.
#[allow(clippy::too_many_arguments)]
fn settle<B>(
    done: &mut VecDeque<Completion<B>>,
    controller: &mut Option<BatchController>,
    reads: &mut ReadsInFlight,
    stats: &mut SessionStats,
    directory: &mut Option<Directory>,
    fallback: &mut Vec<Pending<B>>,
    p: Pending<B>,
    status: Status,
) {
    if matches!(p.opcode, Opcode::DirectRead | Opcode::DirectWrite) {
        if matches!(status, Status::StaleCapability | Status::BadCapability) {
            stats.direct_faults += 1;
            if let Some(d) = directory.as_mut() {
                d.forget(p.offset);
            }
            fallback.push(p);
            return;
        }
        if status.is_ok() && p.opcode == Opcode::DirectRead {
            stats.direct_reads += 1;
        }
        if status.is_ok() && p.opcode == Opcode::DirectWrite {
            stats.direct_writes += 1;
        }
    }
    finish(done, controller, reads, stats, p, status);
}

/// Hand a finished request back to its caller, and tell the controller what it moved.
fn finish<B>(
    done: &mut VecDeque<Completion<B>>,
    controller: &mut Option<BatchController>,
    reads: &mut ReadsInFlight,
    _stats: &mut SessionStats,
    p: Pending<B>,
    status: Status,
) {
    if p.opcode.returns_data() {
        reads.count -= 1;
        reads.bytes -= u64::from(p.length);
    }
    if let Some(ctl) = controller.as_mut() {
        let moved =
            matches!(p.opcode, Opcode::Read | Opcode::Write | Opcode::DirectRead | Opcode::DirectWrite)
                && status.is_ok();
        ctl.handle_completion(if moved { p.length.into() } else { 0 });
    }
    done.push_back(Completion {
        user_data: p.user_data,
        opcode: caller_opcode(p.opcode),
        status,
        buf: p.buf,
    });
}

/// The opcode a caller submitted: a direct read was the session's choice for a read.
fn caller_opcode(op: Opcode) -> Opcode {
    match op {
        Opcode::DirectRead => Opcode::Read,
        Opcode::DirectWrite => Opcode::Write,
        op => op,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(queue_depth: u32) -> ClientSession<Vec<u8>> {
        let config = SessionConfig {
            doorbell: Doorbell::default(),
            batching: Batching::Off,
            direct_min_bytes: DIRECT_OFF,
            directory_entries: 0,
        };
        let limits = Limits { queue_depth, caravan_reqs_max: 4, caravan_bytes_max: 8192, io_bytes_max: 4096 };
        ClientSession::new(&config, limits, 0)
    }

    fn read(user_data: u64) -> Submission<Vec<u8>> {
        Submission {
            opcode: Opcode::Read,
            flags: ReqFlags::empty(),
            offset: 0,
            length: 512,
            buf: Some(vec![0; 512]),
            user_data,
        }
    }

    /// A completion caravan answering `tag` with `data_len` bytes of data.
    fn completion(tag: u32, data_len: u32) -> Vec<u8> {
        let mut desc = [0u8; COMPLETION_DESC_LEN];
        wire::Completion { tag, status: Status::Ok, data_len }.emit(&mut desc);
        let header = Header { kind: FrameKind::Completions, desc_count: 1, payload_len: data_len };
        let mut frame = header.to_bytes().to_vec();
        frame.extend_from_slice(&desc);
        frame.resize(frame.len() + data_len as usize, 0x42);
        frame
    }

    /// Send everything the session has sealed, all at once.
    fn send_all(s: &mut ClientSession<Vec<u8>>) {
        let mut iov = [IoSlice::new(&[]); 8];
        let n = s.poll_transmit(&mut iov);
        let sent = iov[..n].iter().map(|b| b.len()).sum();
        s.handle_sent(sent);
    }

    #[test]
    fn a_completion_for_a_request_not_yet_sent_fails_the_session() {
        let mut s = session(4);
        s.submit(0, read(7)).unwrap();
        assert!(s.has_transmit(), "batching off: the caravan is sealed at once");
        // The caravan has not left, so the target cannot have seen tag 0 (slot 0, generation 0).
        let err = s.handle_rx(0, &completion(0, 512)).unwrap_err();
        assert_eq!(err, ProtoError::UnknownTag(0));
        assert!(s.is_detached(), "the connection is distrusted; the driver decides what next");
        s.handle_closed();
        assert!(s.is_broken());
        let mut done = Vec::new();
        s.take_completions(&mut done);
        assert_eq!(done.len(), 1, "the request comes back, failed, with its buffer");
        assert_eq!(
            (done[0].user_data, done[0].status, done[0].buf.as_ref().map(Vec::len)),
            (7, Status::IoError, Some(512))
        );
    }

    /// One data-message segment: `len` bytes of `fill` for `tag` at `offset`.
    fn segment(tag: u32, offset: u32, len: usize, fill: u8) -> Vec<u8> {
        let mut seg = vec![fill; wire::datagram::PLACE_SEGMENT_HEADER_LEN + len];
        wire::datagram::PlaceSegment::emit_header(tag, offset, len as u32, &mut seg);
        seg
    }

    #[test]
    fn with_data_messages_a_read_completes_when_both_its_completion_and_its_data_are_in() {
        let mut s = session(4);
        s.set_data_messages(true);
        s.submit(0, read(7)).unwrap();
        s.submit(0, read(8)).unwrap();
        send_all(&mut s);
        // Tag 0's first half before its completion, tag 1's data all after it.
        s.place(&segment(0, 0, 256, 0xA0));
        let mut frame = completion(0, 512);
        frame.truncate(HEADER_LEN + COMPLETION_DESC_LEN);
        assert_eq!(
            s.handle_rx(0, &frame).unwrap().consumed,
            frame.len(),
            "the frame ends after its descriptors"
        );
        assert!(s.take_completion_of(7).is_none(), "half its data is still to come");
        s.place(&[segment(0, 256, 256, 0xA1), segment(1, 256, 256, 0xB1)].concat());
        let c = s.take_completion_of(7).expect("its last byte completes it");
        assert_eq!(c.buf.unwrap(), [vec![0xA0; 256], vec![0xA1; 256]].concat());
        s.place(&segment(1, 0, 256, 0xB0));
        assert!(s.take_completion_of(8).is_none(), "no completion yet: the data alone does not complete");
        let mut frame = completion(1, 512);
        frame.truncate(HEADER_LEN + COMPLETION_DESC_LEN);
        s.handle_rx(0, &frame).unwrap();
        let c = s.take_completion_of(8).expect("its completion completes it");
        assert_eq!(c.buf.unwrap(), [vec![0xB0; 256], vec![0xB1; 256]].concat());
        assert_eq!(s.stats().read_bytes_in_messages, 1024);
    }

    #[test]
    fn a_data_message_no_request_can_take_breaks_the_session() {
        for (seg, why) in [
            (segment(3, 0, 16, 0), "tag not in flight"),
            (segment(0, 500, 16, 0), "more data than the request's length"),
            ([segment(0, 0, 512, 0), segment(0, 0, 1, 0)].concat(), "more data than the request's length"),
        ] {
            let mut s = session(4);
            s.set_data_messages(true);
            s.submit(0, read(7)).unwrap();
            send_all(&mut s);
            s.place(&seg);
            let err = s.handle_rx(0, &[]).unwrap_err();
            assert!(matches!(err, ProtoError::DataMessage { why: w, .. } if w == why), "{err}");
            assert!(s.is_detached());
        }
        // Unasked: a session without data messages takes none.
        let mut s = session(4);
        s.submit(0, read(7)).unwrap();
        send_all(&mut s);
        s.place(&segment(0, 0, 16, 0));
        assert!(matches!(
            s.handle_rx(0, &[]),
            Err(ProtoError::DataMessage { why: "data messages were not agreed", .. })
        ));
    }

    #[test]
    fn data_messages_that_do_not_match_their_requests_or_frames_break_the_session() {
        // A segment for a write, and a malformed payload (a segment longer than what follows).
        let mut short = segment(0, 0, 16, 0);
        short.truncate(20);
        for (seg, why) in
            [(segment(1, 0, 16, 0), "the request returns no data"), (short, "malformed segment")]
        {
            let mut s = session(4);
            s.set_data_messages(true);
            s.submit(0, read(7)).unwrap();
            s.submit(0, write(8, 0, 0x33)).unwrap();
            send_all(&mut s);
            s.place(&seg);
            let err = s.handle_rx(0, &[]).unwrap_err();
            assert!(matches!(err, ProtoError::DataMessage { why: w, .. } if w == why), "{err}");
        }
        let head = |tag, data_len, payload_len| {
            let mut frame = completion(tag, data_len);
            frame.truncate(HEADER_LEN + COMPLETION_DESC_LEN);
            Header { kind: FrameKind::Completions, desc_count: 1, payload_len }.emit(&mut frame);
            frame
        };
        // A caravan whose payload_len is not the sum of its completions' data.
        let mut s = session(4);
        s.set_data_messages(true);
        s.submit(0, read(7)).unwrap();
        send_all(&mut s);
        assert!(matches!(s.handle_rx(0, &head(0, 512, 100)), Err(ProtoError::Wire(_))));
        // A second completion for a request still waiting for its data.
        let mut s = session(4);
        s.set_data_messages(true);
        s.submit(0, read(7)).unwrap();
        send_all(&mut s);
        s.handle_rx(0, &head(0, 512, 512)).unwrap();
        assert_eq!(s.handle_rx(0, &head(0, 512, 512)), Err(ProtoError::UnknownTag(0)));
    }

    #[test]
    fn once_sent_the_same_completion_is_taken() {
        let mut s = session(4);
        s.submit(0, read(7)).unwrap();
        send_all(&mut s);
        let frame = completion(0, 512);
        assert_eq!(s.handle_rx(0, &frame).unwrap(), RxProgress { consumed: frame.len(), need: 0 });
        let c = s.take_completion_of(7).expect("completed");
        assert_eq!((c.status, c.buf.unwrap()), (Status::Ok, vec![0x42; 512]));
    }

    #[test]
    fn an_oversized_completion_caravan_is_refused_from_its_header() {
        let mut s = session(4);
        s.submit(0, read(7)).unwrap();
        send_all(&mut s);
        // Only the header of a caravan with more descriptors than negotiated: no body needed.
        let header = Header { kind: FrameKind::Completions, desc_count: 5, payload_len: 0 };
        let err = s.handle_rx(0, &header.to_bytes()).unwrap_err();
        assert!(matches!(err, ProtoError::OverLimit { what: "descriptors per caravan", .. }), "{err:?}");
        assert_eq!(err.goaway_status(), Status::TooLarge);
    }

    fn write(user_data: u64, offset: u64, byte: u8) -> Submission<Vec<u8>> {
        Submission {
            opcode: Opcode::Write,
            flags: ReqFlags::FUA,
            offset,
            length: 512,
            buf: Some(vec![byte; 512]),
            user_data,
        }
    }

    /// The requests of the frames `poll_transmit` offers now: (tag, opcode, offset, flags).
    fn on_the_way(s: &ClientSession<Vec<u8>>) -> Vec<(u32, Opcode, u64, ReqFlags)> {
        let mut iov = [IoSlice::new(&[]); 16];
        let n = s.poll_transmit(&mut iov);
        let bytes: Vec<u8> = iov[..n].iter().flat_map(|b| b.iter().copied()).collect();
        let mut out = Vec::new();
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let h = Header::parse(&rest[..HEADER_LEN]).unwrap();
            let caravan = wire::caravan::RequestCaravan::parse(&h, &rest[HEADER_LEN..h.frame_len()]).unwrap();
            out.extend(caravan.iter().map(|(r, _)| r.unwrap()).map(|r| (r.tag, r.opcode, r.offset, r.flags)));
            rest = &rest[h.frame_len()..];
        }
        out
    }

    /// Send every caravan sealed: the tags of each one's requests, in order.
    fn send_caravans(s: &mut ClientSession<Vec<u8>>) -> Vec<Vec<u32>> {
        let mut caravans = Vec::new();
        while s.has_transmit() {
            let mut iov = [IoSlice::new(&[]); 512];
            let n = s.poll_transmit(&mut iov);
            let bytes: Vec<u8> = iov[..n].iter().flat_map(|b| b.iter().copied()).collect();
            let mut rest = &bytes[..];
            while !rest.is_empty() {
                let h = Header::parse(&rest[..HEADER_LEN]).unwrap();
                let caravan =
                    wire::caravan::RequestCaravan::parse(&h, &rest[HEADER_LEN..h.frame_len()]).unwrap();
                caravans.push(caravan.iter().map(|(r, _)| r.unwrap().tag).collect());
                rest = &rest[h.frame_len()..];
            }
            s.handle_sent(bytes.len());
        }
        caravans
    }

    #[test]
    fn the_adaptive_level_sizes_write_caravans_beyond_the_doorbells_byte_bound() {
        // The controller sets the caravan size; the static doorbell's 64 KiB would cut 4 KiB
        // writes at 16 whatever level it chose (through fio, 64 jobs of writes read 0.8x the
        // best static level for this). Only the negotiated bytes per caravan bound them.
        let config = SessionConfig {
            doorbell: Doorbell::default(),
            batching: Batching::Adaptive(crate::batch::BatchConfig {
                interval_us: 1_000,
                ..Default::default()
            }),
            direct_min_bytes: DIRECT_OFF,
            directory_entries: 0,
        };
        let limits =
            Limits { queue_depth: 128, caravan_reqs_max: 64, caravan_bytes_max: 1 << 20, io_bytes_max: 4096 };
        let mut s = ClientSession::<Vec<u8>>::new(&config, limits, 0);
        let page_write = |user_data: u64| Submission {
            opcode: Opcode::Write,
            flags: ReqFlags::empty(),
            offset: user_data * 4096,
            length: 4096,
            buf: Some(vec![7; 4096]),
            user_data,
        };
        // The controller's first quarter interval, at level 1, sees 128 requests outstanding.
        for i in 0..128 {
            s.submit(0, page_write(i)).unwrap();
        }
        for tag in send_caravans(&mut s).concat() {
            s.handle_rx(0, &completion(tag, 0)).unwrap();
        }
        // Its decision, at the next submit, starts the search at a quarter of them.
        for i in 0..128 {
            s.submit(1_000, page_write(i)).unwrap();
        }
        let level = s.batch_level();
        assert!(level > 16, "the search starts at level {level}, not past what 64 KiB holds");
        let sizes: Vec<usize> = send_caravans(&mut s).iter().map(Vec::len).collect();
        assert!(sizes.iter().all(|&n| n as u32 == level), "caravans of {sizes:?} at level {level}");
    }

    #[test]
    fn a_lost_connection_parks_every_request_and_reattach_sends_them_again_in_order() {
        let mut s = session(8);
        s.submit(0, write(1, 4096, 0xA1)).unwrap();
        s.submit(0, read(2)).unwrap();
        send_all(&mut s);
        s.submit(0, write(3, 8192, 0xA3)).unwrap(); // sealed, not sent
        let before = on_the_way(&s);
        assert_eq!(before.len(), 1);
        s.handle_disconnected();
        assert!(s.is_detached() && !s.is_broken());
        assert!(!s.has_transmit(), "nothing goes out without a connection");
        // Queued while detached: goes after the parked ones.
        s.submit(0, read(4)).unwrap();
        assert_eq!(s.in_flight(), 4);

        s.reattach(s.limits, 9).unwrap();
        let resent = on_the_way(&s);
        let order: Vec<(Opcode, u64, ReqFlags)> = resent.iter().map(|&(_, o, off, f)| (o, off, f)).collect();
        assert_eq!(
            order,
            [
                (Opcode::Write, 4096, ReqFlags::FUA),
                (Opcode::Read, 0, ReqFlags::empty()),
                (Opcode::Write, 8192, ReqFlags::FUA),
                (Opcode::Read, 0, ReqFlags::empty()),
            ],
            "every request again, in submission order, flags kept"
        );
        send_all(&mut s);
        // A completion for a tag of the old connection is not taken for a new request.
        let (tag_read, tag_write) = (resent[1].0, resent[0].0);
        let mut frames = completion(tag_read, 512);
        let mut desc = [0u8; COMPLETION_DESC_LEN];
        wire::Completion { tag: tag_write, status: Status::Ok, data_len: 0 }.emit(&mut desc);
        frames.extend(Header { kind: FrameKind::Completions, desc_count: 1, payload_len: 0 }.to_bytes());
        frames.extend(desc);
        s.handle_rx(0, &frames).unwrap();
        let c = s.take_completion_of(2).unwrap();
        assert_eq!((c.status, c.buf.unwrap()), (Status::Ok, vec![0x42; 512]));
        assert_eq!(s.take_completion_of(1).unwrap().status, Status::Ok);
        assert_eq!(s.in_flight(), 2);
    }

    #[test]
    fn fail_parked_fails_what_waits_and_refuses_more_until_the_connection_is_back() {
        let mut s = session(8);
        s.submit(0, read(1)).unwrap();
        send_all(&mut s);
        s.handle_disconnected();
        s.fail_parked();
        let mut done = Vec::new();
        s.take_completions(&mut done);
        assert_eq!((done.len(), done[0].status), (1, Status::IoError));
        assert_eq!(s.submit(0, read(2)).unwrap_err().error, SubmitError::Closed);
        s.reattach(s.limits, 1).unwrap();
        s.submit(0, read(3)).unwrap();
        assert_eq!(on_the_way(&s).len(), 1);
    }

    #[test]
    fn a_target_that_now_allows_less_is_refused_at_reattach() {
        let mut s = session(8);
        s.submit(0, read(1)).unwrap();
        s.handle_disconnected();
        let smaller = Limits { queue_depth: 4, ..s.limits };
        let err = s.reattach(smaller, 1).unwrap_err();
        assert!(matches!(err, ProtoError::LimitsShrank { what: "queue depth", before: 8, now: 4 }), "{err}");
        s.handle_closed();
        let mut done = Vec::new();
        s.take_completions(&mut done);
        assert_eq!(done[0].status, Status::IoError);
    }
}
