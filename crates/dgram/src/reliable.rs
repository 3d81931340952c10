//! Reliable delivery over datagrams: one side of a session of the raw-Ethernet transport, turning
//! a lossy, duplicating, reordering datagram channel into a reliable, ordered byte stream, so
//! that skiff frames, the client session (`proto::client::ClientSession`) and the target's front end run over it
//! unchanged, exactly as over TCP.
//!
//! [`DatagramStream`] is sans-I/O in the manner of quinn-proto: stream bytes go in with
//! [`write`](DatagramStream::write) and come out with [`read`](DatagramStream::read); datagrams
//! from the peer go in with [`handle_datagram`](DatagramStream::handle_datagram), datagrams to
//! send come out of [`poll_transmit`](DatagramStream::poll_transmit); the driver wakes it at
//! [`poll_timeout`](DatagramStream::poll_timeout) with
//! [`handle_timeout`](DatagramStream::handle_timeout). Time is a `now` in microseconds passed
//! in; nothing here reads a clock, does I/O or draws a random number. It owns neither the
//! Ethernet header nor discovery of peers (the transport's), nor the choice of session id and
//! initial sequence numbers (passed to [`DatagramStream::new`]).
//!
//! # The mechanism (docs/PROTOCOL.md, section 16, is the specification)
//!
//! - **Datagrams and sequence numbers.** The stream is cut into datagrams of at most
//!   `payload_bytes_max` bytes; each Data datagram carries one contiguous chunk and a sequence
//!   number (u32, counted in datagrams, compared with wrapping arithmetic, so any initial
//!   number works, including one just below `u32::MAX`). Small writes are appended to the last
//!   datagram not yet sent; nothing waits to fill one (no Nagle).
//! - **Acknowledgements.** Every datagram carries the cumulative ack (the next sequence number
//!   expected), a 32-bit selective-ack bitmap of what arrived beyond it, and the receive window.
//!   They ride on Data datagrams; when there is nothing to send, an Ack datagram goes at once
//!   after an out-of-order, duplicate or gap-filling arrival, after `ack_every` in-order
//!   arrivals, or when asked (the ACK_NOW flag), and otherwise within `ack_delay_us`.
//! - **Window (credits).** The receiver has `recv_slots` datagram buffers; its window is the
//!   number it can still take from the cumulative ack on. The sender never sends a new sequence
//!   number at or past `ack + window` (the largest right edge it has seen: a receiver never
//!   takes credits back). A closed window with data waiting is probed on the retransmission
//!   timer with an Ack flagged ACK_NOW, which the receiver answers.
//! - **Retransmission on timeout.** RTO from measured round trips after Jacobson and Karels
//!   (RFC 6298): SRTT, RTTVAR, `RTO = SRTT + 4·RTTVAR`, clamped to `[rto_min_us, rto_max_us]`;
//!   Karn's rule (no sample from a datagram sent more than once); doubled on every expiry. On
//!   expiry every unacknowledged datagram the peer has not selectively acknowledged is sent
//!   again, flagged ACK_NOW.
//! - **Retransmission on gaps** uses the selective-ack bitmap, not duplicate acks: every
//!   transmission gets a stamp from a counter; when the peer acknowledges (cumulatively or
//!   selectively) a transmission at least `reorder_threshold` stamps younger than that of a
//!   datagram still missing, that datagram is taken as lost and sent again at once. A lost
//!   retransmission is caught the same way, because its new stamp needs new evidence. With
//!   fewer than `reorder_threshold + 1` datagrams in flight the threshold falls to one less than
//!   what is in flight (at least 1: early retransmit, RFC 5827), so that a loss among a few
//!   datagrams is repaired on the first evidence instead of the timeout.
//! - **Reordering window.** A missing datagram overtaken only by datagrams sent less than the
//!   reordering window after it is not taken as lost yet (RACK, RFC 8985). The window starts at
//!   `reorder_window_us` (0, off, on a single link) and **adapts**: a gap retransmission is
//!   flagged GAP_RESEND, a receiver that gets a second copy of one (either copy flagged: the
//!   resend may overtake its late original) flags its next datagram DUPLICATE (DSACK, RFC
//!   2883), and a sender told so counts a widening (at most one a
//!   round trip, at most 16): the window is `step × (1 + widenings)`
//!   with `step = max(reorder_window_us, SRTT/4)`, never past the RTO estimate (a wider
//!   window would only wait for the timeout; so from off, the first widening gives SRTT/2);
//!   every 64 gap losses with no DSACK take one widening back.
//!   A missing datagram that enough younger transmissions overtook (the threshold) but the
//!   window still excuses is taken as lost once SRTT plus the window have passed since it
//!   left (RACK's reordering timer), not left to the retransmission timeout.
//! - **Round-trip samples** time in-order delivery, which is what the retransmission timer
//!   waits for: an ack that moves the cumulative point gives `now` minus the sending of the
//!   newest datagram it passes (over a bundle, a datagram's wait behind one on a slower link
//!   counts), unless that one was sent more than once (Karn's rule) or left before a resend of
//!   one the ack passes (then it waited for the repair, not the path).
//! - **Dead peer.** Each expiry without acknowledgement progress since the last one counts a
//!   backoff; at `backoffs_max + 1` in a row the stream is [`State::Dead`]. Since the timer
//!   never waits longer than `rto_max_us`, that happens within
//!   [`ReliableConfig::dead_after_us_max`] of the last progress. A stream with nothing to send
//!   expects nothing and never dies of silence (keepalives are the driver's business).
//! - **Close and reset.** [`close`](DatagramStream::close) queues a Close datagram after the
//!   last byte; it takes a sequence number and is delivered and acknowledged like data (TCP's
//!   FIN), so the peer's `read` sees the end of the stream only after every byte. A Reset
//!   aborts at once and is not acknowledged.
//!
//! # Exactly once
//!
//! The stream is delivered once and in order: a datagram is placed by its sequence number and
//! handed to `read` only when every earlier one has been, and a sequence number below the
//! cumulative ack, or already buffered, is dropped as a duplicate (and answered with an ack, in
//! case the sender missed ours). So a request frame that the network duplicated, or that the
//! sender retransmitted because an ack was lost, reaches the target's front end once: a write
//! never runs twice. The sender's unacknowledged datagrams (at most `send_slots`) are the
//! bounded replay window: only they can be sent again, and only under their original sequence
//! numbers, which the receiver has either delivered (drops the copy) or not (delivers it once).
//! Sequence numbers wrap after 2³² datagrams, far beyond any window: a copy older than the
//! window by 2³¹ datagrams would be the only way to fool this, and no network holds a datagram
//! that long. A new session (a new session id) starts a new stream: requests of a dead session
//! are the initiator's to re-send (`ClientSession::reattach`), as after a TCP reset.
//!
//! # Bounds
//!
//! Every buffer is allocated in [`DatagramStream::new`]: `send_slots` and `recv_slots` buffers
//! of `payload_bytes_max` bytes each (rounded up to powers of two, so a slot is `seq & mask`
//! across the wrap). Nothing is allocated per datagram.

use std::io::{IoSlice, IoSliceMut};

use wire::datagram::{
    flags, split_place_payload, DatagramHeader, DatagramKind, PlaceSegment, DATAGRAM_HEADER_LEN,
    PLACE_SEGMENT_HEADER_LEN, STREAM_TAIL_COUNT_LEN,
};

/// Bits in the selective-ack bitmap.
const SACK_BITS: u32 = 32;

/// Most steps DSACKs widen the reordering window by (it never passes the RTO anyway).
const REORDER_STEPS_MAX: u32 = 16;

/// Gap losses with no DSACK after which the reordering window narrows a step again.
const REORDER_NARROW_AFTER: u32 = 64;

/// Gap resends a receiver remembers having taken first, so that the late original of one,
/// arriving after it, is reported as a duplicate of a gap resend (a resend overtakes its
/// original on a faster link of a bundle). Resends are rare: the last 16 cover a round trip.
const GAP_RESENDS_KEPT: usize = 16;

/// Every bound and timer of a [`DatagramStream`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReliableConfig {
    /// Largest payload of one datagram (1472: a 1500-byte MTU less the 28-byte header).
    pub payload_bytes_max: u16,
    /// Datagrams this side keeps until they are acknowledged: the send buffer, and the replay
    /// window (64; rounded up to a power of two).
    pub send_slots: u32,
    /// Datagrams this side buffers for the reader, in order or not: the largest window it
    /// advertises (64; rounded up to a power of two, at most 32768).
    pub recv_slots: u32,
    /// The peer's window assumed before its first datagram arrives (64: a peer with the
    /// default configuration). Too large only costs datagrams the peer drops and we resend.
    pub peer_window_initial: u16,
    /// Longest an in-order arrival waits for its acknowledgement (100 µs).
    pub ack_delay_us: u64,
    /// In-order arrivals that make an acknowledgement go at once (2).
    pub ack_every: u32,
    /// Retransmission timeout before the first round-trip sample (2 ms).
    pub rto_initial_us: u64,
    /// Smallest retransmission timeout (500 µs; above `ack_delay_us` plus a round trip, so a
    /// delayed ack is not taken for a loss).
    pub rto_min_us: u64,
    /// Largest retransmission timeout, however often it has doubled (100 ms).
    pub rto_max_us: u64,
    /// Consecutive timeouts without progress tolerated; one more and the peer is dead (10).
    pub backoffs_max: u32,
    /// An idle stream (nothing in flight) that has heard nothing from its peer for this long
    /// sends a probe, and dies like a busy one if the probes go unanswered, so a driver
    /// waiting on replies learns that the peer is gone (100 ms; 0: never, and an idle stream
    /// never dies).
    pub keepalive_us: u64,
    /// How many transmissions younger a delivered datagram must be before a missing one is
    /// taken as lost and sent again (3; reordering shallower than this costs nothing).
    pub reorder_threshold: u32,
    /// 0 (the default): off. Otherwise a delivered datagram must also have left at least
    /// `max(reorder_window_us, SRTT / 4)` after a missing one before that is taken as lost
    /// (RACK's reordering window, RFC 8985): for sessions bundled over several links, whose
    /// datagrams reach the peer in an order the links' queues decide. A loss then overtaken
    /// only by datagrams sent at about the same time is taken as lost by the reordering timer,
    /// SRTT plus the window after it left.
    pub reorder_window_us: u64,
    /// Each datagram's checksum covers its payload (true, the default), or its header alone
    /// (`HEADER_CRC`): for a link that protects the payload itself, such as a veth pair whose
    /// frames never leave memory. What the peer sends decides what it is checked for.
    pub payload_crc: bool,
}

impl Default for ReliableConfig {
    fn default() -> ReliableConfig {
        ReliableConfig {
            payload_bytes_max: 1472,
            send_slots: 64,
            recv_slots: 64,
            peer_window_initial: 64,
            ack_delay_us: 100,
            ack_every: 2,
            rto_initial_us: 2_000,
            rto_min_us: 500,
            rto_max_us: 100_000,
            backoffs_max: 10,
            keepalive_us: 100_000,
            reorder_threshold: 3,
            reorder_window_us: 0,
            payload_crc: true,
        }
    }
}

impl ReliableConfig {
    /// The most time that passes between the last acknowledgement progress (or the first
    /// transmission after an idle spell) and [`State::Dead`]: `backoffs_max + 1` timer
    /// expiries, none further apart than `rto_max_us`.
    pub fn dead_after_us_max(&self) -> u64 {
        (u64::from(self.backoffs_max) + 1) * self.rto_max_us.max(self.rto_initial_us)
    }

    /// The largest datagram this side emits (Ethernet header excluded): the size of the buffer
    /// [`DatagramStream::poll_transmit`] needs.
    pub fn datagram_len_max(&self) -> usize {
        DATAGRAM_HEADER_LEN + usize::from(self.payload_bytes_max)
    }
}

/// Where a stream stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Carrying data (one direction may have closed already).
    Open,
    /// Both directions are finished: our Close was acknowledged and the peer's has been read.
    /// The stream still acknowledges what the peer resends, until the driver drops it.
    Closed,
    /// The session is over, for the reason given; nothing more is sent or delivered.
    Dead(DeadReason),
}

/// Why a stream died.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DeadReason {
    #[error("no acknowledgement progress after {0} retransmission timeouts")]
    Timeout(u32),
    #[error("the peer reset the session")]
    PeerReset,
    #[error("reset by this side")]
    LocalReset,
}

/// What a stream has done, for tests, statistics and the simulator's proof that faults struck.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Every datagram emitted, of any kind.
    pub datagrams_sent: u64,
    /// Datagrams from the peer flagged DUPLICATE: it received again something it had (a
    /// retransmission that reordering, not loss, had called for).
    pub dsacks_received: u64,
    /// The reordering window now, in µs (0: off).
    pub reorder_window_us: u64,
    /// Data and Close datagrams sent for the first time.
    pub data_sent: u64,
    pub retransmitted_timeout: u64,
    pub retransmitted_gap: u64,
    /// Ack datagrams (acknowledgements riding on data are not counted here).
    pub acks_sent: u64,
    /// Acks flagged ACK_NOW sent on the timer: window probes and keepalives.
    pub probes: u64,
    pub timeouts: u64,
    pub datagrams_received: u64,
    /// Sequenced datagrams received that had already arrived.
    pub duplicates: u64,
    /// Sequenced datagrams received ahead of a gap (and buffered).
    pub out_of_order: u64,
    /// Sequenced datagrams beyond the advertised window (dropped).
    pub out_of_window: u64,
    /// Datagrams that failed to parse: checksum, version, kind, lengths.
    pub corrupt: u64,
    /// Datagrams of another session id.
    pub wrong_session: u64,
    /// Valid datagrams otherwise ignored: acks of sequence numbers never sent, payloads over
    /// the configured maximum, anything after death.
    pub ignored: u64,
    pub stream_bytes_written: u64,
    pub stream_bytes_read: u64,
    /// Of those read, the bytes placed straight from their datagrams into the reader's
    /// buffers ([`DatagramStream::handle_datagram_into`]), never buffered.
    pub stream_bytes_placed: u64,
    /// Place datagrams (data messages) queued to send, and received: handed to the reader's
    /// placer on arrival, or held until a reader with a placer came (`places_held`).
    pub places_sent: u64,
    pub places_received: u64,
    pub places_held: u64,
    /// Round-trip estimates (0 before the first sample) and the current timeout.
    pub srtt_us: u64,
    pub rttvar_us: u64,
    pub rto_us: u64,
}

/// `a` before `b` in sequence space (RFC 1982 serial number arithmetic).
fn seq_lt(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// Why a datagram is queued for retransmission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loss {
    None,
    Timeout,
    Gap,
}

/// One datagram of the send buffer (its bytes live in `tx_bytes`).
#[derive(Debug, Clone, Copy)]
struct TxSlot {
    len: u16,
    close: bool,
    /// A Place datagram: its bytes are segments, then `tail` stream bytes (sent with
    /// STREAM_TAIL and their count after them). Segments join only while `tail` is 0.
    place: bool,
    tail: u16,
    transmissions: u32,
    sent_at_us: u64,
    /// The transmission counter at its latest transmission.
    stamp: u64,
    sacked: bool,
    loss: Loss,
}

const TX_EMPTY: TxSlot = TxSlot {
    len: 0,
    close: false,
    place: false,
    tail: 0,
    transmissions: 0,
    sent_at_us: 0,
    stamp: 0,
    sacked: false,
    loss: Loss::None,
};

/// One datagram of the receive buffer (its bytes live in `rx_bytes`).
#[derive(Debug, Clone, Copy, Default)]
struct RxSlot {
    filled: bool,
    len: u16,
    close: bool,
    /// A Place datagram's payload waits here for a reader with a placer: `skip` bytes of
    /// segments, then its stream tail.
    place: bool,
    /// Bytes at the start of the buffer that are not stream bytes (a Place datagram's
    /// segments, placed or waiting to be).
    skip: u16,
}

/// Where a reader takes Place datagrams' payloads (segments, [`wire::datagram::PlaceSegment`]).
pub type Placer<'c> = &'c mut dyn FnMut(&[u8]);

/// The reader's buffers, filled in order, and how far: where [`DatagramStream::read_into`] and
/// [`DatagramStream::handle_datagram_into`] put stream bytes; and, for a reader that takes
/// data messages, its placer.
pub struct ReadCursor<'c, 'b> {
    bufs: &'c mut [IoSliceMut<'b>],
    place: Option<Placer<'c>>,
    /// The buffer being filled, and how much of it is.
    index: usize,
    offset: usize,
    filled: usize,
}

impl<'c, 'b> ReadCursor<'c, 'b> {
    pub fn new(bufs: &'c mut [IoSliceMut<'b>]) -> ReadCursor<'c, 'b> {
        let mut cursor = ReadCursor { bufs, place: None, index: 0, offset: 0, filled: 0 };
        cursor.skip_full();
        cursor
    }

    /// A cursor that also takes data messages: `place` gets each Place datagram's payload
    /// once, as soon as the datagram arrives (in order or not) or, if it arrived while no
    /// placer was there, at the next read.
    pub fn placing(bufs: &'c mut [IoSliceMut<'b>], place: Placer<'c>) -> ReadCursor<'c, 'b> {
        ReadCursor { place: Some(place), ..ReadCursor::new(bufs) }
    }

    /// Bytes put so far.
    pub fn filled(&self) -> usize {
        self.filled
    }

    /// No room is left.
    pub fn is_full(&self) -> bool {
        self.index == self.bufs.len()
    }

    /// Copy as much of `bytes` as there is room for; returns how much.
    pub fn put(&mut self, bytes: &[u8]) -> usize {
        let mut taken = 0;
        while taken < bytes.len() && !self.is_full() {
            let buf = &mut self.bufs[self.index][self.offset..];
            let n = buf.len().min(bytes.len() - taken);
            buf[..n].copy_from_slice(&bytes[taken..taken + n]);
            taken += n;
            self.offset += n;
            self.skip_full();
        }
        self.filled += taken;
        taken
    }

    fn skip_full(&mut self) {
        while self.index < self.bufs.len() && self.offset == self.bufs[self.index].len() {
            self.index += 1;
            self.offset = 0;
        }
    }
}

/// One side of a reliable byte stream over datagrams (see the module documentation).
#[derive(Debug)]
pub struct DatagramStream {
    config: ReliableConfig,
    session_id: u32,
    state: State,
    counters: Counters,
    payload_max: usize,

    // Sending: [snd_una, snd_nxt) in flight, [snd_nxt, snd_end) filled and not yet sent.
    tx_bytes: Vec<u8>,
    tx_slots: Vec<TxSlot>,
    tx_mask: u32,
    snd_una: u32,
    snd_nxt: u32,
    snd_end: u32,
    /// First sequence number the peer's window does not allow.
    peer_right: u32,
    /// `close` was called; `close_queued` once the Close datagram has its slot.
    closing: bool,
    close_queued: bool,
    /// Datagrams marked for retransmission.
    lost: u32,
    stamp_next: u64,
    /// The youngest transmission the peer has acknowledged, and when it left.
    delivered_stamp: u64,
    delivered_sent_at_us: u64,
    rto_at_us: Option<u64>,
    rto_us: u64,
    backoffs: u32,
    srtt_us: Option<u64>,
    rttvar_us: u64,
    /// The shortest round trip sampled.
    min_rtt_us: Option<u64>,
    probe_pending: bool,
    reset_pending: bool,
    /// Steps the reordering window has widened by (DSACKs), when it last widened, and gap
    /// losses since the last DSACK.
    reorder_steps: u32,
    reorder_widened_at_us: u64,
    gap_losses_quiet: u32,
    /// When a datagram overtaken only by its burst is next due to be taken as lost.
    reorder_at_us: Option<u64>,

    // Receiving: [rcv_read, rcv_nxt) in order and not yet read; beyond it, out of order.
    rx_bytes: Vec<u8>,
    rx_slots: Vec<RxSlot>,
    rx_mask: u32,
    rcv_read: u32,
    rcv_read_off: usize,
    rcv_nxt: u32,
    /// The peer's Close has been read: the stream has ended.
    peer_closed: bool,
    /// The right edge we last advertised.
    advertised_right: u32,
    acks_owed: u32,
    ack_due_us: Option<u64>,
    ack_now: bool,
    /// A duplicate of a gap resend arrived since our last datagram: flag the next one
    /// DUPLICATE.
    duplicate_seen: bool,
    /// The latest sequence numbers whose first copy here was a gap resend (a ring).
    gap_resends_seen: [Option<u32>; GAP_RESENDS_KEPT],
    gap_resends_next: usize,
    /// Place datagrams received while no placer was there, waiting in their slots.
    held: u32,
}

impl DatagramStream {
    /// A stream of session `session_id` whose first datagram will carry sequence number
    /// `send_seq`, expecting the peer's first at `recv_seq` (both agreed out of band, by the
    /// transport's discovery or configuration). Allocates every buffer it will use.
    pub fn new(config: &ReliableConfig, session_id: u32, send_seq: u32, recv_seq: u32) -> DatagramStream {
        let mut config = *config;
        config.payload_bytes_max = config.payload_bytes_max.max(1);
        config.send_slots = config.send_slots.clamp(1, 1 << 20).next_power_of_two();
        config.recv_slots = config.recv_slots.clamp(1, 1 << 15).next_power_of_two();
        config.ack_every = config.ack_every.max(1);
        config.rto_min_us = config.rto_min_us.max(1);
        config.rto_max_us = config.rto_max_us.max(config.rto_min_us);
        let payload_max = usize::from(config.payload_bytes_max);
        let (tx, rx) = (config.send_slots as usize, config.recv_slots as usize);
        let rto_us = config.rto_initial_us.clamp(config.rto_min_us, config.rto_max_us);
        DatagramStream {
            session_id,
            state: State::Open,
            counters: Counters { rto_us, ..Counters::default() },
            payload_max,
            tx_bytes: vec![0; tx * payload_max],
            tx_slots: vec![TX_EMPTY; tx],
            tx_mask: config.send_slots - 1,
            snd_una: send_seq,
            snd_nxt: send_seq,
            snd_end: send_seq,
            peer_right: send_seq.wrapping_add(u32::from(config.peer_window_initial)),
            closing: false,
            close_queued: false,
            lost: 0,
            stamp_next: 1,
            delivered_stamp: 0,
            delivered_sent_at_us: 0,
            rto_at_us: None,
            rto_us,
            backoffs: 0,
            srtt_us: None,
            rttvar_us: 0,
            min_rtt_us: None,
            probe_pending: false,
            reorder_steps: 0,
            reorder_widened_at_us: 0,
            gap_losses_quiet: 0,
            reorder_at_us: None,
            reset_pending: false,
            rx_bytes: vec![0; rx * payload_max],
            rx_slots: vec![RxSlot::default(); rx],
            rx_mask: config.recv_slots - 1,
            rcv_read: recv_seq,
            rcv_read_off: 0,
            rcv_nxt: recv_seq,
            peer_closed: false,
            advertised_right: recv_seq,
            acks_owed: 0,
            ack_due_us: None,
            ack_now: false,
            duplicate_seen: false,
            gap_resends_seen: [None; GAP_RESENDS_KEPT],
            gap_resends_next: 0,
            held: 0,
            config,
        }
    }

    pub fn config(&self) -> &ReliableConfig {
        &self.config
    }

    pub fn session_id(&self) -> u32 {
        self.session_id
    }

    pub fn state(&self) -> State {
        self.state
    }

    /// The counters, with the current round-trip estimates.
    pub fn counters(&self) -> Counters {
        Counters {
            srtt_us: self.srtt_us.unwrap_or(0),
            rttvar_us: self.rttvar_us,
            rto_us: self.rto_us,
            reorder_window_us: self.reorder_window(),
            ..self.counters
        }
    }

    /// The peer's stream has ended and everything before its end has been read.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// Stream bytes the reader can take now, or data messages held for a reader with a placer.
    pub fn readable(&self) -> bool {
        self.rcv_read != self.rcv_nxt || self.held > 0
    }

    /// [`write`](Self::write) would take at least one byte now.
    pub fn writable(&self) -> bool {
        let room = self.snd_end.wrapping_sub(self.snd_una) < self.config.send_slots
            || (self.snd_end != self.snd_nxt
                && usize::from(self.tx_slots[(self.snd_end.wrapping_sub(1) & self.tx_mask) as usize].len)
                    < self.payload_max);
        room && !self.closing && !matches!(self.state, State::Dead(_))
    }

    /// Datagrams sent and not yet acknowledged.
    pub fn in_flight(&self) -> u32 {
        self.snd_nxt.wrapping_sub(self.snd_una)
    }

    /// The retransmission timeout the round trips measured call for (`SRTT + 4·RTTVAR`,
    /// clamped), without the doubling of timeouts in a row.
    pub fn rto_estimate_us(&self) -> u64 {
        self.rto_estimate()
    }

    /// Whether the datagram with sequence number `seq` has reached the peer: it is
    /// acknowledged, cumulatively or selectively (a bundle's paths learn from this whether
    /// what they carried arrived, whichever path brought the acknowledgement back).
    pub fn delivered(&self, seq: u32) -> bool {
        if seq_lt(seq, self.snd_una) {
            return true;
        }
        seq_lt(seq, self.snd_nxt) && self.tx_slots[(seq & self.tx_mask) as usize].sacked
    }

    /// Everything written (and the Close, if any) has been acknowledged.
    pub fn all_acked(&self) -> bool {
        self.snd_una == self.snd_end && (!self.closing || self.close_queued)
    }

    fn tx_slot(&mut self, seq: u32) -> &mut TxSlot {
        &mut self.tx_slots[(seq & self.tx_mask) as usize]
    }

    fn rx_slot(&self, seq: u32) -> RxSlot {
        self.rx_slots[(seq & self.rx_mask) as usize]
    }

    // ---- the stream side ----

    /// Take stream bytes from `bufs`, as many as the send buffer has room for; returns how
    /// many (0 when it is full, closed or dead).
    pub fn write(&mut self, bufs: &[IoSlice<'_>]) -> usize {
        if self.closing || matches!(self.state, State::Dead(_)) {
            return 0;
        }
        let mut taken = 0;
        for buf in bufs {
            let mut rest: &[u8] = buf;
            while !rest.is_empty() {
                let n = self.append(rest);
                if n == 0 {
                    self.counters.stream_bytes_written += taken as u64;
                    return taken;
                }
                taken += n;
                rest = &rest[n..];
            }
        }
        self.counters.stream_bytes_written += taken as u64;
        taken
    }

    /// Append to the last unsent datagram, or open a new one; returns the bytes taken.
    fn append(&mut self, bytes: &[u8]) -> usize {
        let last = self.snd_end.wrapping_sub(1);
        // A Place datagram not yet sent takes stream bytes after its segments (its tail), with
        // room kept for their count.
        let open = self.snd_end != self.snd_nxt && usize::from(self.tx_slot(last).len) < self.room(last);
        let seq = if open {
            last
        } else if self.snd_end.wrapping_sub(self.snd_una) < self.config.send_slots {
            let seq = self.snd_end;
            *self.tx_slot(seq) = TX_EMPTY;
            self.snd_end = seq.wrapping_add(1);
            seq
        } else {
            return 0;
        };
        let at = (seq & self.tx_mask) as usize * self.payload_max;
        let len = usize::from(self.tx_slot(seq).len);
        let n = bytes.len().min(self.room(seq) - len);
        self.tx_bytes[at + len..at + len + n].copy_from_slice(&bytes[..n]);
        let slot = self.tx_slot(seq);
        slot.len = (len + n) as u16;
        if slot.place {
            slot.tail += n as u16;
        }
        n
    }

    /// Most bytes slot `seq` holds: a Place datagram keeps room for its tail's count.
    fn room(&mut self, seq: u32) -> usize {
        if self.tx_slot(seq).place {
            self.payload_max - STREAM_TAIL_COUNT_LEN
        } else {
            self.payload_max
        }
    }

    /// Most bytes of data one Place segment may carry: a datagram's payload less the segment
    /// header.
    pub fn place_segment_max(&self) -> usize {
        self.payload_max.saturating_sub(PLACE_SEGMENT_HEADER_LEN)
    }

    /// Queue `bytes` (at most [`place_segment_max`](Self::place_segment_max)) of request
    /// `tag`'s read data, for `offset` in its buffer, as one segment of a Place datagram (a
    /// data message: docs/PROTOCOL.md, 16.9). With `batch`, the segment joins the last
    /// datagram not yet sent when that is a Place datagram with room for it (Tyche's
    /// data-message batching: two 4 KiB payloads in one 8 KiB frame); otherwise, or when it
    /// does not fit, it opens a datagram of its own. Place datagrams take sequence numbers in
    /// the order of calls, between the stream's. Returns false, taking nothing, when the send
    /// buffer is full, the stream is closing or dead, or `bytes` is empty or too long.
    pub fn write_place(&mut self, tag: u32, offset: u32, bytes: &[u8], batch: bool) -> bool {
        if self.closing
            || matches!(self.state, State::Dead(_))
            || bytes.is_empty()
            || bytes.len() > self.place_segment_max()
        {
            return false;
        }
        let need = PLACE_SEGMENT_HEADER_LEN + bytes.len();
        let last = self.snd_end.wrapping_sub(1);
        let joins = batch
            && self.snd_end != self.snd_nxt
            && self.tx_slot(last).place
            && self.tx_slot(last).tail == 0
            && usize::from(self.tx_slot(last).len) + need <= self.room(last);
        let seq = if joins {
            last
        } else if self.snd_end.wrapping_sub(self.snd_una) < self.config.send_slots {
            let seq = self.snd_end;
            *self.tx_slot(seq) = TxSlot { place: true, ..TX_EMPTY };
            self.snd_end = seq.wrapping_add(1);
            self.counters.places_sent += 1;
            seq
        } else {
            return false;
        };
        let at = (seq & self.tx_mask) as usize * self.payload_max + usize::from(self.tx_slot(seq).len);
        let out = &mut self.tx_bytes[at..at + need];
        PlaceSegment::emit_header(tag, offset, bytes.len() as u32, out);
        out[PLACE_SEGMENT_HEADER_LEN..].copy_from_slice(bytes);
        self.tx_slot(seq).len += need as u16;
        true
    }

    /// Move in-order stream bytes into `bufs`; returns how many (0 when there are none now:
    /// see [`peer_closed`](Self::peer_closed) for the end of the stream). Each byte is read
    /// exactly once. A reader without a placer stops at a data message that waits for one.
    pub fn read(&mut self, bufs: &mut [IoSliceMut<'_>]) -> usize {
        self.read_into(&mut ReadCursor::new(bufs))
    }

    /// As [`read`](Self::read), into the room `to` has left; returns the bytes moved.
    pub fn read_into(&mut self, to: &mut ReadCursor<'_, '_>) -> usize {
        if matches!(self.state, State::Dead(_)) {
            return 0;
        }
        if self.held > 0 && to.place.is_some() {
            self.place_held(to);
        }
        let mut got = 0;
        while self.rcv_read != self.rcv_nxt {
            let idx = (self.rcv_read & self.rx_mask) as usize;
            let slot = self.rx_slots[idx];
            let start = idx * self.payload_max;
            if slot.place {
                // Held while no placer was there (above), and there is none now either (a
                // lane waiting for room to send takes in what arrived): the stream stops here
                // until a reader with a placer comes, so no segment is lost and nothing after
                // it (its tail: the descriptors of the reads it carries) overtakes it.
                break;
            }
            let start = start + usize::from(slot.skip);
            let len = usize::from(slot.len - slot.skip);
            let n = to.put(&self.rx_bytes[start + self.rcv_read_off..start + len]);
            got += n;
            self.rcv_read_off += n;
            if self.rcv_read_off < len {
                break;
            }
            if slot.close {
                self.peer_closed = true;
            }
            self.rx_slots[idx] = RxSlot::default();
            self.rcv_read = self.rcv_read.wrapping_add(1);
            self.rcv_read_off = 0;
            if slot.close || to.is_full() {
                break;
            }
        }
        // A Close right behind the bytes just read ends the stream now, not on the next call.
        if self.rcv_read != self.rcv_nxt && self.rx_slot(self.rcv_read).close {
            self.rx_slots[(self.rcv_read & self.rx_mask) as usize] = RxSlot::default();
            self.rcv_read = self.rcv_read.wrapping_add(1);
            self.peer_closed = true;
        }
        self.bytes_read(got);
        got
    }

    /// Hand every held Place payload's segments, in order or not, to the reader's placer;
    /// their slots keep only their stream tails.
    fn place_held(&mut self, to: &mut ReadCursor<'_, '_>) {
        let Some(place) = to.place.as_mut() else { return };
        let right = self.rcv_read.wrapping_add(self.config.recv_slots);
        let mut seq = self.rcv_read;
        while self.held > 0 && seq_lt(seq, right) {
            let idx = (seq & self.rx_mask) as usize;
            let slot = self.rx_slots[idx];
            if slot.place {
                let start = idx * self.payload_max;
                place(&self.rx_bytes[start..start + usize::from(slot.skip)]);
                self.rx_slots[idx].place = false;
                self.held -= 1;
            }
            seq = seq.wrapping_add(1);
        }
    }

    /// `got` stream bytes went to the reader: count them, and tell the sender about freed
    /// buffers once half of them are free again (a smaller update would only invite tiny
    /// bursts), or the window was shut.
    fn bytes_read(&mut self, got: usize) {
        self.counters.stream_bytes_read += got as u64;
        self.update_state();
        let right = self.rcv_read.wrapping_add(self.config.recv_slots);
        let opened = right.wrapping_sub(self.advertised_right);
        if opened > 0 && (opened >= self.config.recv_slots / 2 || self.advertised_right == self.rcv_nxt) {
            self.ack_now = true;
        }
    }

    /// End this side's stream after the bytes written so far: the peer reads them, then the
    /// end. Later writes take nothing.
    pub fn close(&mut self) {
        self.closing = true;
        self.queue_close();
    }

    fn queue_close(&mut self) {
        if !self.closing
            || self.close_queued
            || self.snd_end.wrapping_sub(self.snd_una) >= self.config.send_slots
        {
            return;
        }
        let seq = self.snd_end;
        *self.tx_slot(seq) = TxSlot { close: true, ..TX_EMPTY };
        self.snd_end = seq.wrapping_add(1);
        self.close_queued = true;
    }

    /// Abort the session: a Reset goes to the peer (once, best effort) and the stream is dead.
    pub fn reset(&mut self) {
        if !matches!(self.state, State::Dead(_)) {
            self.state = State::Dead(DeadReason::LocalReset);
            self.reset_pending = true;
        }
    }

    fn update_state(&mut self) {
        if self.state == State::Open
            && self.peer_closed
            && self.closing
            && self.close_queued
            && self.snd_una == self.snd_end
        {
            self.state = State::Closed;
        }
    }

    // ---- datagrams in ----

    /// A datagram from the link (the Ethernet header stripped). Corrupt datagrams, other
    /// sessions' and anything after death are counted and dropped; nothing here fails.
    pub fn handle_datagram(&mut self, now_us: u64, bytes: &[u8]) {
        self.handle_datagram_placing(now_us, bytes, None);
    }

    /// As [`handle_datagram`](Self::handle_datagram), placing what the datagram brings in
    /// order straight into the reader's buffers while `to` has room and nothing waits to be
    /// read before it: the bytes are read then, as by [`read_into`](Self::read_into), without
    /// a stop in the receive buffer. What does not fit, or arrives out of order, is buffered as
    /// ever. Returns the bytes placed.
    pub fn handle_datagram_into(&mut self, now_us: u64, bytes: &[u8], to: &mut ReadCursor<'_, '_>) -> usize {
        self.handle_datagram_placing(now_us, bytes, Some(to))
    }

    fn handle_datagram_placing(
        &mut self,
        now_us: u64,
        bytes: &[u8],
        to: Option<&mut ReadCursor<'_, '_>>,
    ) -> usize {
        self.counters.datagrams_received += 1;
        let Ok((h, payload)) = DatagramHeader::parse(bytes) else {
            self.counters.corrupt += 1;
            return 0;
        };
        if h.session_id != self.session_id {
            self.counters.wrong_session += 1;
            return 0;
        }
        if matches!(
            h.kind,
            DatagramKind::Discover | DatagramKind::Offer | DatagramKind::Probe | DatagramKind::ProbeAck
        ) {
            // Discovery lives outside sessions (its query id may equal a session id); link
            // probes belong to the link layer under the stream (a bundle's paths).
            self.counters.ignored += 1;
            return 0;
        }
        if matches!(self.state, State::Dead(_)) {
            self.counters.ignored += 1;
            return 0;
        }
        if h.kind == DatagramKind::Reset {
            self.state = State::Dead(DeadReason::PeerReset);
            return 0;
        }
        if payload.len() > self.payload_max || !self.handle_ack(now_us, &h) {
            self.counters.ignored += 1;
            return 0;
        }
        if h.flags & flags::ACK_NOW != 0 {
            self.ack_now = true;
        }
        if h.flags & flags::DUPLICATE != 0 {
            self.widen_reorder_window(now_us);
        }
        let placed = if h.kind.is_sequenced() { self.receive(now_us, &h, payload, to) } else { 0 };
        self.update_state();
        placed
    }

    /// The acknowledgement fields. Returns false for an ack of what was never sent (a
    /// datagram of a confused or hostile peer, dropped whole).
    fn handle_ack(&mut self, now_us: u64, h: &DatagramHeader) -> bool {
        if seq_lt(h.ack, self.snd_una) {
            // An old ack overtaken by newer ones: its fields say nothing new.
            return true;
        }
        if seq_lt(self.snd_nxt, h.ack) {
            return false;
        }
        let (mut delivered, mut delivered_at) = (0, 0);
        let progressed = h.ack != self.snd_una;
        if progressed {
            // The round-trip sample times in-order delivery, what the retransmission timer
            // waits for: from the sending of the newest datagram the ack passes to now. Over a
            // bundle that includes the wait behind a datagram on a slower link, as it should.
            // Not if that datagram was sent more than once (Karn: its ack could be for either
            // copy), nor if it left before a resend of one the ack passes: then it waited for
            // the repair, which is not the path's round trip (counted, a few timeouts in a row
            // stretch SRTT and the RTO without end).
            let newest = *self.tx_slot(h.ack.wrapping_sub(1));
            let mut resent_last = None;
            while self.snd_una != h.ack {
                let seq = self.snd_una;
                let slot = *self.tx_slot(seq);
                if slot.stamp > delivered && self.evidence(now_us, &slot) {
                    (delivered, delivered_at) = (slot.stamp, slot.sent_at_us);
                }
                if slot.transmissions > 1 {
                    resent_last = resent_last.max(Some(slot.sent_at_us));
                }
                if slot.loss != Loss::None {
                    self.lost -= 1;
                }
                *self.tx_slot(seq) = TX_EMPTY;
                self.snd_una = seq.wrapping_add(1);
            }
            if newest.transmissions == 1 && resent_last.is_none_or(|at| at <= newest.sent_at_us) {
                self.rtt_sample(now_us.saturating_sub(newest.sent_at_us));
            }
            self.backoffs = 0;
        } else if self.in_flight() == 0 && self.backoffs > 0 {
            // Nothing to acknowledge, but the peer answered a probe: it is alive, and the
            // path works again, so the timeout returns to the estimate.
            self.backoffs = 0;
            self.rto_us = self.rto_estimate();
        }
        let right = h.ack.wrapping_add(u32::from(h.window));
        if seq_lt(self.peer_right, right) {
            self.peer_right = right;
        }
        for i in 0..SACK_BITS {
            let seq = h.ack.wrapping_add(1 + i);
            if h.sack & (1 << i) == 0 || !seq_lt(seq, self.snd_nxt) {
                continue;
            }
            let slot = *self.tx_slot(seq);
            if !slot.sacked {
                *self.tx_slot(seq) = TxSlot { sacked: true, loss: Loss::None, ..slot };
                if slot.stamp > delivered && self.evidence(now_us, &slot) {
                    (delivered, delivered_at) = (slot.stamp, slot.sent_at_us);
                }
                if slot.loss != Loss::None {
                    self.lost -= 1;
                }
            }
        }
        if delivered > self.delivered_stamp {
            self.delivered_stamp = delivered;
            self.delivered_sent_at_us = delivered_at;
            self.detect_gaps(now_us);
        }
        self.queue_close();
        if self.in_flight() == 0 {
            self.reorder_at_us = None;
        }
        if progressed || self.in_flight() == 0 {
            self.rearm(now_us);
        }
        true
    }

    /// Whether the acknowledgement of `slot` shows its latest transmission arrived. One sent
    /// again and acknowledged sooner than the shortest round trip seen was the original's
    /// acknowledgement: taking the copy as delivered would date the evidence too late and
    /// mark datagrams sent before it lost for nothing (RACK's rule, RFC 8985 section 6.2).
    fn evidence(&self, now_us: u64, slot: &TxSlot) -> bool {
        slot.transmissions == 1 || now_us.saturating_sub(slot.sent_at_us) >= self.min_rtt_us.unwrap_or(0)
    }

    /// Mark as lost every missing datagram that a much younger transmission overtook. With
    /// few datagrams in flight there may never be `reorder_threshold` younger ones, and every
    /// loss would wait for the timeout: the threshold then falls to one less than what is in
    /// flight, at least 1 (early retransmit, after RFC 5827).
    ///
    /// A missing datagram overtaken by enough younger transmissions, but only by its own burst
    /// (sent within the reordering window of it), is lost once a round trip and the window
    /// have passed since it left (RACK's reordering timer, RFC 8985): the reordering timer is
    /// set for the earliest such. One overtaken by fewer than the threshold waits for more
    /// evidence or the timeout, as without a window.
    fn detect_gaps(&mut self, now_us: u64) {
        let in_flight = u64::from(self.in_flight());
        let threshold = u64::from(self.config.reorder_threshold).min(in_flight.saturating_sub(1)).max(1);
        let window = self.reorder_window();
        // Without a round-trip estimate there is no reordering timer (the RTO covers it).
        let wait = self.srtt_us.map(|srtt| srtt + window);
        let (delivered, delivered_at) = (self.delivered_stamp, self.delivered_sent_at_us);
        let mut reorder_at = None;
        let mut seq = self.snd_una;
        while seq != self.snd_nxt {
            let slot = self.tx_slot(seq);
            seq = seq.wrapping_add(1);
            if slot.sacked || slot.loss != Loss::None || slot.stamp + threshold > delivered {
                continue;
            }
            let overtaken = slot.sent_at_us + window <= delivered_at;
            let due = wait.map(|wait| slot.sent_at_us + wait);
            if overtaken || due.is_some_and(|due| due <= now_us) {
                slot.loss = Loss::Gap;
                self.lost += 1;
                self.gap_losses_quiet += 1;
            } else if let Some(due) = due {
                reorder_at = Some(reorder_at.map_or(due, |at: u64| at.min(due)));
            }
        }
        self.reorder_at_us = reorder_at;
        if self.gap_losses_quiet >= REORDER_NARROW_AFTER {
            self.gap_losses_quiet = 0;
            self.reorder_steps = self.reorder_steps.saturating_sub(1);
        }
    }

    /// How long after a missing datagram a delivered one must have left to show it lost:
    /// `reorder_window_us` (0: off) until DSACKs widen it to `step × (1 + widenings)`, with
    /// `step = max(reorder_window_us, SRTT / 4)`, never past the RTO estimate. (Not SRTT: over
    /// a bundle whose links' queues differ, a datagram on the fuller one is overtaken by more
    /// than the mean round trip; capped at SRTT, a bundle of two shaped links resent 7% of its
    /// datagrams for nothing.)
    fn reorder_window(&self) -> u64 {
        let configured = self.config.reorder_window_us;
        if configured == 0 && self.reorder_steps == 0 {
            return 0;
        }
        let srtt = self.srtt_us.unwrap_or(0);
        let step = configured.max(srtt / 4);
        if self.reorder_steps == 0 {
            return step;
        }
        (step * (1 + u64::from(self.reorder_steps))).min(self.rto_estimate().max(step))
    }

    /// The peer received a duplicate: something was sent again that had arrived, because
    /// reordering looked like loss. Widen the window a step, at most once a round trip (one
    /// spurious burst brings many DSACKs).
    fn widen_reorder_window(&mut self, now_us: u64) {
        self.counters.dsacks_received += 1;
        self.gap_losses_quiet = 0;
        let round = self.srtt_us.unwrap_or(self.rto_us);
        if self.reorder_steps == 0 || now_us >= self.reorder_widened_at_us + round {
            self.reorder_steps = (self.reorder_steps + 1).min(REORDER_STEPS_MAX);
            self.reorder_widened_at_us = now_us;
        }
    }

    /// RFC 6298, section 2.
    fn rtt_sample(&mut self, rtt_us: u64) {
        self.min_rtt_us = Some(self.min_rtt_us.map_or(rtt_us, |min| min.min(rtt_us)));
        let srtt = match self.srtt_us {
            None => {
                self.rttvar_us = rtt_us / 2;
                rtt_us
            }
            Some(srtt) => {
                self.rttvar_us = (3 * self.rttvar_us + srtt.abs_diff(rtt_us)) / 4;
                (7 * srtt + rtt_us) / 8
            }
        };
        self.srtt_us = Some(srtt);
        self.rto_us = self.rto_estimate();
    }

    /// `SRTT + 4·RTTVAR`, clamped; the initial timeout before any sample.
    fn rto_estimate(&self) -> u64 {
        let rto = match self.srtt_us {
            Some(srtt) => srtt + (4 * self.rttvar_us).max(1),
            None => self.config.rto_initial_us,
        };
        rto.clamp(self.config.rto_min_us, self.config.rto_max_us)
    }

    /// A Data or Close datagram; what of it `to` took (in order, nothing unread before it).
    fn receive(
        &mut self,
        now_us: u64,
        h: &DatagramHeader,
        payload: &[u8],
        to: Option<&mut ReadCursor<'_, '_>>,
    ) -> usize {
        let (seq, close) = (h.seq, h.kind == DatagramKind::Close);
        let resent = h.flags & flags::GAP_RESEND != 0;
        let right = self.rcv_read.wrapping_add(self.config.recv_slots);
        if seq_lt(seq, self.rcv_nxt) {
            self.duplicate(seq, resent);
            return 0;
        }
        if !seq_lt(seq, right) {
            self.counters.out_of_window += 1;
            self.ack_now = true;
            return 0;
        }
        let idx = (seq & self.rx_mask) as usize;
        if self.rx_slots[idx].filled {
            self.duplicate(seq, resent);
            return 0;
        }
        if resent {
            self.gap_resends_seen[self.gap_resends_next] = Some(seq);
            self.gap_resends_next = (self.gap_resends_next + 1) % GAP_RESENDS_KEPT;
        }
        // A Place datagram's segments, and the stream bytes it carries (all of a Data's
        // payload; a Place's tail).
        let place = h.kind == DatagramKind::Place;
        let (segments, bytes) = if place {
            self.counters.places_received += 1;
            split_place_payload(h.flags, payload).unwrap_or((payload, &[]))
        } else {
            (&[][..], payload)
        };
        let mut to = to;
        let held = place && to.as_ref().is_none_or(|to| to.place.is_none());
        if place && !held {
            // A data message goes to its buffers on arrival, in order or not.
            if let Some(placer) = to.as_deref_mut().and_then(|to| to.place.as_mut()) {
                placer(segments);
            }
        }
        // Next in order with nothing unread before it: the reader's buffers take what they can.
        let in_order = seq == self.rcv_nxt && self.rcv_read == self.rcv_nxt && !close && !held;
        let placed = match to.as_deref_mut() {
            Some(to) if in_order => to.put(bytes),
            _ => 0,
        };
        let at = idx * self.payload_max;
        if held {
            // Kept whole, segments then tail (contiguous in the payload), for a reader with a
            // placer.
            let kept = segments.len() + bytes.len();
            self.rx_bytes[at..at + kept].copy_from_slice(&payload[..kept]);
            let (len, skip) = (kept as u16, segments.len() as u16);
            self.rx_slots[idx] = RxSlot { filled: true, len, close: false, place: true, skip };
            self.held += 1;
            self.counters.places_held += 1;
        } else if in_order && to.is_some() && placed == bytes.len() && (placed > 0 || place) {
            // Read whole on arrival: it never takes its buffer.
            self.rcv_read = self.rcv_read.wrapping_add(1);
        } else {
            let rest = &bytes[placed..];
            self.rx_bytes[at..at + rest.len()].copy_from_slice(rest);
            self.rx_slots[idx] =
                RxSlot { filled: true, len: rest.len() as u16, close, place: false, skip: 0 };
        }
        if seq != self.rcv_nxt {
            self.counters.out_of_order += 1;
            self.ack_now = true;
            return 0;
        }
        self.rcv_nxt = self.rcv_nxt.wrapping_add(1);
        let mut filled_gap = false;
        while seq_lt(self.rcv_nxt, right) && self.rx_slot(self.rcv_nxt).filled {
            self.rcv_nxt = self.rcv_nxt.wrapping_add(1);
            filled_gap = true;
        }
        self.acks_owed += 1;
        if filled_gap || close || self.acks_owed >= self.config.ack_every {
            self.ack_now = true;
        } else {
            self.ack_due_us.get_or_insert(now_us + self.config.ack_delay_us);
        }
        if placed > 0 {
            self.counters.stream_bytes_placed += placed as u64;
            self.bytes_read(placed);
        }
        placed
    }

    /// A second copy of `seq` arrived: acknowledge at once (the sender may have missed our
    /// ack), and if either copy was a gap resend (this one, or the first, when the resend
    /// overtook a late original), it was not needed: flag the next datagram DUPLICATE. A
    /// copy the network made, or one resent on a timeout (a lost ack), says nothing about
    /// reordering.
    fn duplicate(&mut self, seq: u32, resent: bool) {
        self.counters.duplicates += 1;
        self.ack_now = true;
        self.duplicate_seen |= resent || self.gap_resends_seen.contains(&Some(seq));
    }

    // ---- timers ----

    /// The retransmission timer runs while datagrams are in flight, or data waits on a shut
    /// window (then it times the window probe).
    fn wants_retransmit_timer(&self) -> bool {
        self.in_flight() > 0 || (self.snd_nxt != self.snd_end && !self.window_open())
    }

    /// Set the timer from scratch: the retransmission timeout when it is needed, else the
    /// keepalive (restarted by every datagram from the peer), else nothing.
    fn rearm(&mut self, now_us: u64) {
        self.rto_at_us = if self.wants_retransmit_timer() {
            Some(now_us + self.rto_us)
        } else if self.config.keepalive_us > 0 && self.backoffs == 0 && self.state == State::Open {
            Some(now_us + self.config.keepalive_us)
        } else {
            self.rto_at_us.filter(|_| self.backoffs > 0)
        };
    }

    fn window_open(&self) -> bool {
        seq_lt(self.snd_nxt, self.peer_right)
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next due, if anything is pending.
    pub fn poll_timeout(&self) -> Option<u64> {
        if matches!(self.state, State::Dead(_)) {
            return None;
        }
        [self.rto_at_us, self.ack_due_us, self.reorder_at_us].into_iter().flatten().min()
    }

    /// Run the timers due at `now_us`: a delayed ack falls due; the reordering timer takes
    /// what its burst overtook as lost; the retransmission timer queues retransmissions or a
    /// window probe, or declares the peer dead.
    pub fn handle_timeout(&mut self, now_us: u64) {
        if matches!(self.state, State::Dead(_)) {
            return;
        }
        if self.ack_due_us.is_some_and(|due| due <= now_us) {
            self.ack_due_us = None;
            self.ack_now = true;
        }
        if self.reorder_at_us.is_some_and(|due| due <= now_us) {
            self.detect_gaps(now_us);
        }
        if self.rto_at_us.is_none_or(|due| due > now_us) {
            return;
        }
        // A closed stream has nothing more to expect: no keepalives.
        if !self.wants_retransmit_timer() && (self.config.keepalive_us == 0 || self.state != State::Open) {
            self.rto_at_us = None;
            return;
        }
        self.counters.timeouts += 1;
        self.backoffs += 1;
        if self.backoffs > self.config.backoffs_max {
            self.state = State::Dead(DeadReason::Timeout(self.backoffs - 1));
            self.rto_at_us = None;
            // Tell the peer, in case it lives but was not listening (an initiator whose
            // application left it alone): its next look finds the Reset at once instead of
            // waiting out timers of its own on a session that is gone.
            self.reset_pending = true;
            return;
        }
        self.rto_us = (self.rto_us * 2).min(self.config.rto_max_us);
        if self.in_flight() > 0 {
            let mut seq = self.snd_una;
            while seq != self.snd_nxt {
                let slot = self.tx_slot(seq);
                if !slot.sacked && slot.loss == Loss::None {
                    slot.loss = Loss::Timeout;
                    self.lost += 1;
                }
                seq = seq.wrapping_add(1);
            }
        } else {
            // A shut window, or a keepalive: ask the peer for an ack.
            self.probe_pending = true;
        }
        self.rto_at_us = Some(now_us + self.rto_us);
    }

    // ---- datagrams out ----

    /// The next datagram to send, written into `out`; returns its length, or `None` when
    /// there is nothing to send now. In order of urgency: a Reset, retransmissions, new data
    /// within the peer's window, an acknowledgement or window probe. Call until `None`.
    ///
    /// # Panics
    /// If `out` is shorter than [`ReliableConfig::datagram_len_max`].
    pub fn poll_transmit(&mut self, now_us: u64, out: &mut [u8]) -> Option<usize> {
        if matches!(self.state, State::Dead(_)) {
            if !std::mem::take(&mut self.reset_pending) {
                return None;
            }
            return Some(self.emit_control(DatagramKind::Reset, 0, out));
        }
        if self.wants_retransmit_timer() && self.backoffs == 0 {
            // Data written onto a shut window since the last ack needs the probe timer.
            let at = now_us + self.rto_us;
            self.rto_at_us = Some(self.rto_at_us.map_or(at, |t| t.min(at)));
        }
        if self.lost > 0 {
            let mut seq = self.snd_una;
            while seq != self.snd_nxt {
                if self.tx_slot(seq).loss != Loss::None {
                    return Some(self.transmit(now_us, seq, out));
                }
                seq = seq.wrapping_add(1);
            }
        }
        if self.snd_nxt != self.snd_end && self.window_open() {
            let idle = self.in_flight() == 0;
            let seq = self.snd_nxt;
            self.snd_nxt = seq.wrapping_add(1);
            let n = self.transmit(now_us, seq, out);
            if idle && self.backoffs == 0 {
                // The first datagram in flight starts the retransmission timer (replacing a
                // keepalive).
                self.rto_at_us = Some(now_us + self.rto_us);
            }
            return Some(n);
        }
        if self.ack_due_us.is_some_and(|due| due <= now_us) {
            self.ack_now = true;
        }
        if std::mem::take(&mut self.probe_pending) {
            self.counters.probes += 1;
            return Some(self.emit_control(DatagramKind::Ack, flags::ACK_NOW, out));
        }
        if self.ack_now {
            return Some(self.emit_control(DatagramKind::Ack, 0, out));
        }
        None
    }

    /// Send (or resend) the datagram `seq`, with our current acknowledgement on it.
    fn transmit(&mut self, now_us: u64, seq: u32, out: &mut [u8]) -> usize {
        let stamp = self.stamp_next;
        self.stamp_next += 1;
        let slot = *self.tx_slot(seq);
        let len = usize::from(slot.len);
        let at = (seq & self.tx_mask) as usize * self.payload_max;
        out[DATAGRAM_HEADER_LEN..DATAGRAM_HEADER_LEN + len].copy_from_slice(&self.tx_bytes[at..at + len]);
        match slot.loss {
            Loss::None => self.counters.data_sent += 1,
            Loss::Timeout => self.counters.retransmitted_timeout += 1,
            Loss::Gap => self.counters.retransmitted_gap += 1,
        }
        if slot.loss != Loss::None {
            self.lost -= 1;
        }
        let flags = match slot.loss {
            Loss::None => 0,
            Loss::Timeout => flags::ACK_NOW,
            Loss::Gap => flags::GAP_RESEND,
        };
        *self.tx_slot(seq) = TxSlot {
            transmissions: slot.transmissions + 1,
            sent_at_us: now_us,
            stamp,
            loss: Loss::None,
            ..slot
        };
        if self.rto_at_us.is_none() {
            self.rto_at_us = Some(now_us + self.rto_us);
        }
        let (kind, flags, len) = if slot.close {
            (DatagramKind::Close, flags, slot.len)
        } else if slot.place && slot.tail > 0 {
            let end = DATAGRAM_HEADER_LEN + usize::from(slot.len);
            out[end..end + STREAM_TAIL_COUNT_LEN].copy_from_slice(&slot.tail.to_le_bytes());
            (DatagramKind::Place, flags | flags::STREAM_TAIL, slot.len + STREAM_TAIL_COUNT_LEN as u16)
        } else if slot.place {
            (DatagramKind::Place, flags, slot.len)
        } else {
            (DatagramKind::Data, flags, slot.len)
        };
        self.emit(kind, flags, seq, len, out)
    }

    fn emit_control(&mut self, kind: DatagramKind, flags: u8, out: &mut [u8]) -> usize {
        if kind == DatagramKind::Ack {
            self.counters.acks_sent += 1;
        }
        self.emit(kind, flags, self.snd_nxt, 0, out)
    }

    /// Write a header with our acknowledgement state; the payload is in place already.
    fn emit(&mut self, kind: DatagramKind, flags: u8, seq: u32, payload_len: u16, out: &mut [u8]) -> usize {
        let right = self.rcv_read.wrapping_add(self.config.recv_slots);
        let flags = if std::mem::take(&mut self.duplicate_seen) { flags | flags::DUPLICATE } else { flags };
        let flags = if self.config.payload_crc { flags } else { flags | flags::HEADER_CRC };
        let header = DatagramHeader {
            kind,
            flags,
            session_id: self.session_id,
            seq,
            ack: self.rcv_nxt,
            sack: self.sack_bits(),
            window: right.wrapping_sub(self.rcv_nxt).min(u32::from(u16::MAX)) as u16,
            payload_len,
        };
        self.advertised_right = right;
        self.acks_owed = 0;
        self.ack_due_us = None;
        self.ack_now = false;
        self.counters.datagrams_sent += 1;
        header.emit(out)
    }

    /// Bit `i`: sequence number `rcv_nxt + 1 + i` is buffered.
    fn sack_bits(&self) -> u32 {
        let right = self.rcv_read.wrapping_add(self.config.recv_slots);
        let mut bits = 0;
        for i in 0..SACK_BITS {
            let seq = self.rcv_nxt.wrapping_add(1 + i);
            if !seq_lt(seq, right) {
                break;
            }
            if self.rx_slot(seq).filled {
                bits |= 1 << i;
            }
        }
        bits
    }
}

pub mod split;

#[cfg(test)]
mod tests;
