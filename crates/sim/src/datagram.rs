//! A seeded datagram link on the virtual clock, the raw-Ethernet segment of the simulation, and
//! what runs over it: [`DatagramIo`], a [`FrameIo`] built on a [`DatagramStream`] (so the full
//! simulation of `run` can use it in place of the byte pipe), and [`stream_run`], the
//! simulation of two streams alone with random writes and reads.
//!
//! The link carries whole datagrams both ways, each after the latency, and strikes with seeded
//! faults: loss, duplication, reordering (a datagram delayed by up to `jitter_max_us` lets later
//! ones overtake it), corruption (one bit flipped anywhere in the datagram: the datagram CRC
//! must catch every one), and flaps (the link goes down for a while and drops everything sent
//! or in flight). Unlike `faults::FaultyIo`, which may flip only frame headers because v1
//! frames over TCP have no body checksum, this link flips any bit: the datagram header's CRC
//! covers the payload.

use std::cell::RefCell;
use std::collections::BinaryHeap;
use std::io::{self, IoSlice, IoSliceMut};
use std::rc::Rc;

use dgram::bundle::{is_probe, Bundle, BundleConfig, PathCounters};
use dgram::reliable::split::Splitter;
use dgram::reliable::{Counters, DatagramStream, ReadCursor, ReliableConfig, State};
use transport::FrameIo;
use wire::datagram::{DatagramHeader, DatagramKind};

use crate::clock::Clock;
use crate::rng::Rng;

/// How often each fault strikes, per million datagrams (flaps: per million sends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkFaults {
    pub loss: u32,
    pub duplicate: u32,
    /// A datagram is held back by up to `jitter_max_us` more than the latency.
    pub reorder: u32,
    pub jitter_max_us: u64,
    /// One bit of the datagram is flipped.
    pub corrupt: u32,
    /// The link goes down for up to `flap_max_us`: every datagram sent or in flight is lost.
    pub flap: u32,
    pub flap_max_us: u64,
}

impl LinkFaults {
    pub const NONE: LinkFaults = LinkFaults {
        loss: 0,
        duplicate: 0,
        reorder: 0,
        jitter_max_us: 0,
        corrupt: 0,
        flap: 0,
        flap_max_us: 0,
    };

    /// Every fault at `loss_per_million` loss, the others at a few percent.
    pub fn with_loss(loss_per_million: u32) -> LinkFaults {
        LinkFaults {
            loss: loss_per_million,
            duplicate: 20_000,
            reorder: 50_000,
            jitter_max_us: 200,
            corrupt: 10_000,
            flap: 500,
            flap_max_us: 5_000,
        }
    }
}

/// What the link did, both directions together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkCounts {
    pub sent: u64,
    pub delivered: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub corrupted: u64,
    pub flaps: u64,
    /// Datagrams lost because the link was down.
    pub lost_down: u64,
}

impl LinkCounts {
    pub fn add(&mut self, o: &LinkCounts) {
        self.sent += o.sent;
        self.delivered += o.delivered;
        self.lost += o.lost;
        self.duplicated += o.duplicated;
        self.reordered += o.reordered;
        self.corrupted += o.corrupted;
        self.flaps += o.flaps;
        self.lost_down += o.lost_down;
    }
}

/// A datagram in flight: delivered at `at`, ties broken by the order sent.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: u64,
    order: u64,
    bytes: Vec<u8>,
}

#[derive(Debug)]
struct Link {
    /// `queues[i]` holds what end `i` will receive (min-heaps by arrival).
    queues: [BinaryHeap<std::cmp::Reverse<InFlight>>; 2],
    rng: Rng,
    faults: LinkFaults,
    latency_us: u64,
    order: u64,
    down_until_us: u64,
    counts: LinkCounts,
}

/// One end of a datagram link.
#[derive(Debug, Clone)]
pub struct LinkEnd {
    link: Rc<RefCell<Link>>,
    side: usize,
    clock: Clock,
}

/// A link with `latency_us` each way and seeded faults: `(initiator, target)` ends.
pub fn link(clock: &Clock, rng: Rng, latency_us: u64, faults: LinkFaults) -> (LinkEnd, LinkEnd) {
    let link = Rc::new(RefCell::new(Link {
        queues: [BinaryHeap::new(), BinaryHeap::new()],
        rng,
        faults,
        latency_us,
        order: 0,
        down_until_us: 0,
        counts: LinkCounts::default(),
    }));
    let end = |side| LinkEnd { link: link.clone(), side, clock: clock.clone() };
    (end(0), end(1))
}

impl LinkEnd {
    /// Put a datagram on the wire, to the other end; the faults decide its fate.
    pub fn send(&self, bytes: &[u8]) {
        let now = self.clock.now_us();
        let mut link = self.link.borrow_mut();
        let link = &mut *link;
        link.counts.sent += 1;
        if link.rng.chance(link.faults.flap) {
            link.counts.flaps += 1;
            link.down_until_us = now + link.rng.range(1, link.faults.flap_max_us.max(1));
            for q in &mut link.queues {
                link.counts.lost_down += q.len() as u64;
                q.clear();
            }
        }
        if now < link.down_until_us {
            link.counts.lost_down += 1;
            return;
        }
        if link.rng.chance(link.faults.loss) {
            link.counts.lost += 1;
            return;
        }
        let copies = if link.rng.chance(link.faults.duplicate) {
            link.counts.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut bytes = bytes.to_vec();
            if link.rng.chance(link.faults.corrupt) && !bytes.is_empty() {
                link.counts.corrupted += 1;
                let bit = link.rng.below(bytes.len() as u64 * 8);
                bytes[(bit / 8) as usize] ^= 1 << (bit % 8);
            }
            let mut at = now + link.latency_us;
            if link.rng.chance(link.faults.reorder) {
                link.counts.reordered += 1;
                at += link.rng.range(1, link.faults.jitter_max_us.max(1));
            }
            link.order += 1;
            let order = link.order;
            link.queues[1 - self.side].push(std::cmp::Reverse(InFlight { at, order, bytes }));
        }
    }

    /// The next datagram that has arrived, copied into `out` (truncated to its length, as a
    /// packet socket does); `None` when nothing has arrived by now.
    pub fn recv(&self, out: &mut [u8]) -> Option<usize> {
        let now = self.clock.now_us();
        let mut link = self.link.borrow_mut();
        let q = &mut link.queues[self.side];
        if q.peek().is_none_or(|d| d.0.at > now) {
            return None;
        }
        let d = q.pop()?.0;
        link.counts.delivered += 1;
        let n = d.bytes.len().min(out.len());
        out[..n].copy_from_slice(&d.bytes[..n]);
        Some(n)
    }

    /// When the next datagram arrives at this end, if one is on its way.
    pub fn next_arrival_us(&self) -> Option<u64> {
        self.link.borrow().queues[self.side].peek().map(|d| d.0.at)
    }

    /// Take the link down until `until_us` (both ways; what is in flight is lost): a cable
    /// pulled and plugged back, a switch port that flaps.
    pub fn take_down(&self, until_us: u64) {
        let mut link = self.link.borrow_mut();
        let link = &mut *link;
        link.down_until_us = link.down_until_us.max(until_us);
        for q in &mut link.queues {
            link.counts.lost_down += q.len() as u64;
            q.clear();
        }
    }

    /// Take the link down for good from now on (a dead peer, a pulled cable).
    pub fn cut(&self) {
        let mut link = self.link.borrow_mut();
        link.down_until_us = u64::MAX;
        link.queues = [BinaryHeap::new(), BinaryHeap::new()];
    }

    pub fn counts(&self) -> LinkCounts {
        self.link.borrow().counts
    }
}

/// A [`FrameIo`] over a [`DatagramStream`] and one end of a link: what the raw-Ethernet
/// transport will be, with the link in place of the packet socket. Call [`pump`](Self::pump)
/// every step: it moves datagrams both ways and runs the stream's timers.
#[derive(Debug)]
pub struct DatagramIo {
    stream: DatagramStream,
    /// The sending half of data messages, as in `EthStream`; whether this end offers them.
    split: Splitter,
    data_messages: bool,
    end: LinkEnd,
    clock: Clock,
    buf: Vec<u8>,
    /// Resets injected (the datagram form of a disconnect) and their odds per send.
    rng: Rng,
    reset_chance: u32,
    pub resets: u64,
}

impl DatagramIo {
    pub fn new(
        stream: DatagramStream,
        end: LinkEnd,
        clock: &Clock,
        rng: Rng,
        reset_chance: u32,
    ) -> DatagramIo {
        let buf = vec![0; stream.config().datagram_len_max()];
        DatagramIo {
            stream,
            split: Splitter::new(false),
            data_messages: false,
            end,
            clock: clock.clone(),
            buf,
            rng,
            reset_chance,
            resets: 0,
        }
    }

    /// Offer (initiator) or agree to (target) data messages, batching two segments to a
    /// datagram or not, as `EthStream` does with `EthConfig::data_messages`.
    pub fn with_data_messages(mut self, batch: bool) -> DatagramIo {
        self.split = Splitter::new(batch);
        self.data_messages = true;
        self
    }

    pub fn stream(&self) -> &DatagramStream {
        &self.stream
    }

    pub fn end(&self) -> &LinkEnd {
        &self.end
    }

    /// Receive what has arrived, run the timers, send what the stream has to send.
    pub fn pump(&mut self) {
        self.pump_into(None);
    }

    /// As [`pump`](Self::pump), placing what arrives in order into `to` while it has room,
    /// as the raw-Ethernet driver's `recv` does.
    fn pump_into(&mut self, mut to: Option<&mut ReadCursor<'_, '_>>) {
        let now = self.clock.now_us();
        while let Some(n) = self.end.recv(&mut self.buf) {
            match to.as_deref_mut() {
                Some(to) => {
                    self.stream.handle_datagram_into(now, &self.buf[..n], to);
                }
                None => self.stream.handle_datagram(now, &self.buf[..n]),
            }
        }
        self.stream.handle_timeout(now);
        if self.split.pending() {
            self.split.flush(&mut self.stream);
        }
        while let Some(n) = self.stream.poll_transmit(now, &mut self.buf) {
            self.end.send(&self.buf[..n]);
        }
    }

    /// End the stream after what was written (a FIN).
    pub fn shutdown(&mut self) {
        self.stream.close();
        self.pump();
    }

    /// Abort the session (an RST): the peer learns it from the Reset, or from its timeouts.
    pub fn reset(&mut self) {
        self.stream.reset();
        self.pump();
    }

    fn dead(&self) -> io::Result<usize> {
        match self.stream.state() {
            State::Dead(reason) => Err(io::Error::new(io::ErrorKind::ConnectionReset, reason.to_string())),
            _ => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

impl DatagramIo {
    fn receive(&mut self, mut to: ReadCursor<'_, '_>) -> io::Result<usize> {
        // As `eth::EthStream::recv`: buffered bytes first, then what arrives in
        // order placed straight into `bufs`, then what that let through.
        self.stream.read_into(&mut to);
        self.pump_into(Some(&mut to));
        self.stream.read_into(&mut to);
        match to.filled() {
            0 if self.stream.peer_closed() => Ok(0),
            0 => self.dead(),
            n => Ok(n),
        }
    }
}

impl FrameIo for DatagramIo {
    fn recv(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        self.receive(ReadCursor::new(bufs))
    }

    fn recv_placing(
        &mut self,
        bufs: &mut [IoSliceMut<'_>],
        place: &mut dyn FnMut(&[u8]),
    ) -> io::Result<usize> {
        self.receive(ReadCursor::placing(bufs, place))
    }

    fn data_messages(&self) -> bool {
        self.data_messages
    }

    fn send_data_messages(&mut self) -> bool {
        self.data_messages && self.split.set_apart()
    }

    fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        if self.rng.chance(self.reset_chance) {
            self.resets += 1;
            self.reset();
        }
        let n = self.split.write(&mut self.stream, bufs);
        self.pump();
        match n {
            0 if bufs.iter().any(|b| !b.is_empty()) => self.dead(),
            n => Ok(n),
        }
    }
}

/// One seed of [`stream_run`].
#[derive(Debug, Clone, Copy)]
pub struct StreamOptions {
    pub seed: u64,
    pub faults: LinkFaults,
    /// Most stream bytes each side writes.
    pub bytes_max: u64,
    /// Cut the link for good at this virtual time: both sides must end up dead.
    pub cut_at_us: Option<u64>,
    /// Links between the two sides, bundled ([`Bundle`]); 1 is a plain session.
    pub paths: usize,
    /// Take the last path down at `.0` for `.1` µs (a bundle's link failing mid-run); the
    /// others keep working, so the streams must not notice beyond retransmissions.
    pub outage: Option<(u64, u64)>,
}

impl StreamOptions {
    /// A plain session (one link) of seed `seed`.
    pub fn new(seed: u64, faults: LinkFaults, bytes_max: u64) -> StreamOptions {
        StreamOptions { seed, faults, bytes_max, cut_at_us: None, paths: 1, outage: None }
    }
}

/// What a stream run did.
#[derive(Debug, Clone, Default)]
pub struct StreamReport {
    pub bytes: u64,
    pub virtual_us: u64,
    pub steps: u64,
    pub link: LinkCounts,
    /// The two streams' counters, summed.
    pub streams: Counters,
    /// Each path's counters, both sides summed (datagrams, probes, downs, rejoins).
    pub paths: Vec<PathCounters>,
}

/// The stream byte at `at` of side `side`'s stream: every byte of a run is checkable.
/// (Cheap, because it runs for every byte; any datagram of 8 bytes or more misplaced by a
/// multiple of 256 bytes still shows, as the higher bytes of the offset enter too.)
fn pattern(seed: u64, side: usize, at: u64) -> u8 {
    (at ^ (at >> 8).wrapping_mul(7) ^ (at >> 16).wrapping_mul(13) ^ seed ^ (side as u64 * 0x55)) as u8
}

/// Largest single write of [`stream_run`] (a few datagrams; most writes take less, or only
/// part, since the send buffer holds as few as 4 datagrams of 64 bytes).
const WRITE_BYTES_MAX: u64 = 4_000;

/// Steps before a run counts as stuck.
const STREAM_STEPS_MAX: u64 = 2_000_000;

/// Two [`DatagramStream`]s over a faulty link, each writing a random number of bytes in
/// writes of random sizes and reading in reads of random sizes, then closing. Every byte must
/// arrive exactly once and in order, and both streams must end `Closed`; with the link cut,
/// both must end `Dead` within the configured bound.
pub fn stream_run(opts: &StreamOptions) -> Result<StreamReport, String> {
    let mut rng = Rng::new(opts.seed);
    let clock = Clock::new();
    let config = ReliableConfig {
        payload_bytes_max: rng.pick(&[64, 512, 1472]),
        send_slots: rng.pick(&[4, 16, 64]),
        recv_slots: rng.pick(&[4, 16, 64]),
        peer_window_initial: rng.pick(&[4, 16, 64]),
        ack_delay_us: rng.range(0, 200),
        ack_every: rng.range(1, 4) as u32,
        reorder_threshold: rng.range(1, 5) as u32,
        // A cut link must kill both sides, the idle one too: that takes keepalives.
        keepalive_us: if opts.cut_at_us.is_some() { 10_000 } else { rng.pick(&[0, 10_000]) },
        // Bundled, as eth::session sets it: links reorder among themselves.
        reorder_window_us: if opts.paths > 1 { 100 } else { 0 },
        ..ReliableConfig::default()
    };
    // Initial sequence numbers: random, or just below the wrap.
    let random_isn = rng.next_u64() as u32;
    let isn = [rng.next_u64() as u32, rng.pick(&[u32::MAX - 10, 0, random_isn])];
    let latency = rng.range(1, 50);
    let (a, b) = link(&clock, rng.fork(1), latency, opts.faults);
    let session = rng.next_u64() as u32;
    let mut ends = [
        Side::new(DatagramStream::new(&config, session, isn[0], isn[1]), a, true),
        Side::new(DatagramStream::new(&config, session, isn[1], isn[0]), b, false),
    ];
    let totals = [rng.range(0, opts.bytes_max), rng.range(0, opts.bytes_max)];
    if opts.paths > 1 {
        // More links between the two sides: each side knows its peer on the first only, the
        // initiator (side 0) finds it on the others by its probes.
        let mut ends_of = [vec![ends[0].ends[0].clone()], vec![ends[1].ends[0].clone()]];
        for p in 1..opts.paths {
            let (a, b) = link(&clock, rng.fork(100 + p as u64), latency + rng.range(0, 20), opts.faults);
            ends_of[0].push(a);
            ends_of[1].push(b);
        }
        for (side, links) in ends.iter_mut().zip(ends_of) {
            let mut known = vec![false; links.len()];
            known[0] = true;
            side.bundle = Bundle::new(BundleConfig::default(), session, &known, side.bundle.seeks());
            side.ends = links;
        }
    }
    let mut outage = opts.outage.filter(|_| opts.paths > 1);
    let mut written = [0u64; 2];
    let mut read = [0u64; 2];
    let mut buf = vec![0u8; config.datagram_len_max()];
    let mut chunk = vec![0u8; 5_000];
    let mut inbox = vec![0u8; 5_000];
    let mut step = 0;
    let fail = |step: u64, clock: &Clock, what: String| {
        format!("seed {} step {step} at {} µs: {what}", opts.seed, clock.now_us())
    };
    loop {
        step += 1;
        if step > STREAM_STEPS_MAX {
            return Err(fail(
                step,
                &clock,
                format!(
                    "stuck: written {written:?} of {totals:?}, read {read:?}; {config:?}; {:?}; {:?}",
                    ends[0].stream.counters(),
                    ends[1].stream.counters()
                ),
            ));
        }
        let now = clock.now_us();
        if opts.cut_at_us.is_some_and(|at| now >= at) {
            for end in &ends[0].ends {
                end.cut();
            }
        }
        if let Some((at, len)) = outage.filter(|(at, _)| now >= *at) {
            ends[0].ends.last().expect("a path").take_down(at + len);
            outage = None;
        }
        for side in 0..2 {
            // The application reads now and then into random pieces: half of those reads
            // take what arrives in order straight from the link (as the raw-Ethernet driver
            // does), the other half only what the stream buffered.
            let reading = rng.chance(600_000);
            let placing = reading && rng.chance(500_000);
            let (n, cut) = if reading {
                let n = rng.range(1, 5000) as usize;
                (n, rng.range(0, n as u64) as usize)
            } else {
                (0, 0)
            };
            let (first, second) = inbox[..n].split_at_mut(cut);
            let mut pieces = [IoSliceMut::new(first), IoSliceMut::new(second)];
            let mut to = ReadCursor::new(&mut pieces);
            if placing {
                ends[side].stream.read_into(&mut to);
                ends[side].take_in(now, &mut buf, Some(&mut to));
            } else {
                ends[side].take_in(now, &mut buf, None);
            }
            let stream = &mut ends[side].stream;
            // The application: a write of random size, a read into random pieces, a close.
            if written[side] < totals[side] && stream.writable() && rng.chance(500_000) {
                let n = rng.range(1, (totals[side] - written[side]).min(WRITE_BYTES_MAX)) as usize;
                for (i, byte) in chunk[..n].iter_mut().enumerate() {
                    *byte = pattern(opts.seed, side, written[side] + i as u64);
                }
                written[side] += stream.write(&[IoSlice::new(&chunk[..n])]) as u64;
            }
            if written[side] == totals[side] && opts.cut_at_us.is_none() {
                stream.close();
            }
            if reading {
                stream.read_into(&mut to);
                let got = to.filled();
                for (i, &byte) in pieces.iter().flat_map(|p| p.iter()).take(got).enumerate() {
                    let at = read[side] + i as u64;
                    if byte != pattern(opts.seed, 1 - side, at) {
                        return Err(fail(step, &clock, format!("side {side} read a wrong byte at {at}")));
                    }
                }
                read[side] += got as u64;
                if read[side] > totals[1 - side] {
                    return Err(fail(step, &clock, format!("side {side} read more than was written")));
                }
            }
            ends[side].send_out(now, &mut buf);
        }
        let states = [ends[0].stream.state(), ends[1].stream.state()];
        if let Some(cut) = opts.cut_at_us {
            if states.iter().all(|s| matches!(s, State::Dead(_))) {
                let bound = cut + config.keepalive_us + config.dead_after_us_max() + 1000;
                if now > bound {
                    return Err(fail(step, &clock, format!("dead only at {now} µs, bound {bound}")));
                }
                break;
            }
        } else if states == [State::Closed, State::Closed] {
            if read != [totals[1], totals[0]] || !ends.iter().all(|e| e.stream.peer_closed()) {
                return Err(fail(step, &clock, format!("closed with {read:?} read of {totals:?}")));
            }
            break;
        } else if let Some(dead) = states.iter().find(|s| matches!(s, State::Dead(_))) {
            return Err(fail(step, &clock, format!("a stream died on a working link: {dead:?}")));
        }
        // Advance: a small random step, or straight to the next event when nothing is due.
        let next = ends.iter().filter_map(Side::next_event_us).chain(outage.map(|(at, _)| at)).min();
        // The application can act when it has bytes to write and room, or bytes to read.
        let busy = (0..2).any(|side| {
            let stream = &ends[side].stream;
            (written[side] < totals[side] && stream.writable()) || stream.readable()
        });
        let tick = rng.range(1, 40);
        let to = match next {
            Some(at) if !busy => at.max(now + 1),
            Some(at) => (now + tick).min(at.max(now + 1)),
            None => now + tick,
        };
        clock.advance(to - now);
    }
    let mut streams = ends[0].stream.counters();
    add_counters(&mut streams, &ends[1].stream.counters());
    let mut link = LinkCounts::default();
    for end in &ends[0].ends {
        link.add(&end.counts());
    }
    let paths = (0..opts.paths.max(1))
        .map(|p| {
            let (a, b) = (ends[0].bundle.counters(p), ends[1].bundle.counters(p));
            PathCounters {
                up: a.up && b.up,
                datagrams_sent: a.datagrams_sent + b.datagrams_sent,
                datagrams_received: a.datagrams_received + b.datagrams_received,
                probes_sent: a.probes_sent + b.probes_sent,
                probes_answered: a.probes_answered + b.probes_answered,
                srtt_us: a.srtt_us.max(b.srtt_us),
                downs: a.downs + b.downs,
                rejoins: a.rejoins + b.rejoins,
            }
        })
        .collect();
    Ok(StreamReport {
        bytes: totals[0] + totals[1],
        virtual_us: clock.now_us(),
        steps: step,
        link,
        streams,
        paths,
    })
}

/// One side of a [`stream_run`]: its stream, and the links it reaches its peer by, bundled.
struct Side {
    stream: DatagramStream,
    bundle: Bundle,
    ends: Vec<LinkEnd>,
}

impl Side {
    fn new(stream: DatagramStream, end: LinkEnd, seeks: bool) -> Side {
        let bundle = Bundle::new(BundleConfig::default(), stream.session_id(), &[true], seeks);
        Side { stream, bundle, ends: vec![end] }
    }

    /// What arrived on every link: probes to the bundle (answered on their link), the rest to
    /// the stream (from links whose peer is known); then the bundle's checks and the timers.
    /// The raw-Ethernet driver (`eth::session`) does the same with its sockets.
    fn take_in(&mut self, now: u64, buf: &mut [u8], mut to: Option<&mut ReadCursor<'_, '_>>) {
        for (p, end) in self.ends.iter().enumerate() {
            let mut data = 0;
            while let Some(n) = end.recv(buf) {
                let datagram = &buf[..n];
                if is_probe(datagram) {
                    if let Ok((h, _)) = DatagramHeader::parse(datagram) {
                        if let Some(ack) = self.bundle.on_probe(p, now, &h) {
                            let mut out = [0u8; wire::datagram::DATAGRAM_HEADER_LEN];
                            let len = ack.emit(&mut out);
                            end.send(&out[..len]);
                        }
                    }
                } else if self.bundle.known(p) {
                    match to.as_deref_mut() {
                        Some(to) => {
                            self.stream.handle_datagram_into(now, datagram, to);
                        }
                        None => self.stream.handle_datagram(now, datagram),
                    }
                    data += 1;
                }
            }
            self.bundle.on_received(p, now, data);
        }
        let stream = &self.stream;
        self.bundle.on_delivered(now, |seq| stream.delivered(seq));
        self.bundle.check(now, stream.rto_estimate_us());
        while self.bundle.poll_event().is_some() {}
        self.stream.handle_timeout(now);
    }

    /// What the stream has to send, on the path the bundle picks; then the probes due.
    fn send_out(&mut self, now: u64, buf: &mut [u8]) {
        if let Some(p) = self.bundle.pick() {
            let (mut sent, mut bytes, mut sequenced) = (0, 0, None);
            while let Some(n) = self.stream.poll_transmit(now, buf) {
                if DatagramKind::from_u8(buf[1]).is_some_and(DatagramKind::is_sequenced) {
                    let seq = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]);
                    self.bundle.on_sequenced(seq);
                    sequenced = Some(seq);
                }
                self.ends[p].send(&buf[..n]);
                sent += 1;
                bytes += n as u64;
            }
            if sent > 0 {
                self.bundle.on_sent(p, now, sent, bytes, sequenced);
            }
        }
        while let Some((p, probe)) = self.bundle.poll_probe(now) {
            let len = probe.emit(buf);
            self.ends[p].send(&buf[..len]);
        }
    }

    fn next_event_us(&self) -> Option<u64> {
        let arrivals = self.ends.iter().filter_map(LinkEnd::next_arrival_us);
        let timers = [self.stream.poll_timeout(), self.bundle.poll_timeout()].into_iter().flatten();
        arrivals.chain(timers).min()
    }
}

/// Sum the event counters of `b` into `a` (the RTT estimates are left alone).
pub fn add_counters(a: &mut Counters, b: &Counters) {
    a.datagrams_sent += b.datagrams_sent;
    a.data_sent += b.data_sent;
    a.retransmitted_timeout += b.retransmitted_timeout;
    a.retransmitted_gap += b.retransmitted_gap;
    a.acks_sent += b.acks_sent;
    a.probes += b.probes;
    a.timeouts += b.timeouts;
    a.datagrams_received += b.datagrams_received;
    a.duplicates += b.duplicates;
    a.out_of_order += b.out_of_order;
    a.out_of_window += b.out_of_window;
    a.corrupt += b.corrupt;
    a.wrong_session += b.wrong_session;
    a.ignored += b.ignored;
    a.stream_bytes_written += b.stream_bytes_written;
    a.stream_bytes_read += b.stream_bytes_read;
    a.stream_bytes_placed += b.stream_bytes_placed;
    a.dsacks_received += b.dsacks_received;
    a.places_sent += b.places_sent;
    a.places_received += b.places_received;
    a.places_held += b.places_held;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_link_delivers_after_the_latency_and_its_faults_strike() {
        let clock = Clock::new();
        let (a, b) = link(&clock, Rng::new(1), 10, LinkFaults::NONE);
        a.send(b"one");
        let mut buf = [0u8; 8];
        assert_eq!(b.recv(&mut buf), None);
        clock.advance(10);
        assert_eq!(b.recv(&mut buf), Some(3));
        assert_eq!(&buf[..3], b"one");
        let faults = LinkFaults { corrupt: 1_000_000, duplicate: 1_000_000, ..LinkFaults::NONE };
        let (a, b) = link(&clock, Rng::new(2), 0, faults);
        a.send(b"abcd");
        let (x, y) =
            (b.recv(&mut buf).map(|n| buf[..n].to_vec()), b.recv(&mut buf).map(|n| buf[..n].to_vec()));
        assert!(x.is_some_and(|x| x != b"abcd") && y.is_some_and(|y| y != b"abcd"));
        assert_eq!(b.counts().corrupted, 2);
        a.cut();
        b.send(b"lost");
        assert_eq!(a.recv(&mut buf), None);
        assert_eq!(a.counts().lost_down, 1);
    }
}
