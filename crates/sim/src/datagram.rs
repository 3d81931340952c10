//! A seeded datagram link on the virtual clock, the raw-Ethernet segment of the simulation, and
//! what runs over it: the raw-Ethernet session driver itself (`eth`'s [`EthStream`], over a
//! [`SimSocket`] per path instead of a packet socket, on the virtual [`Clock`]), as
//! [`DatagramIo`], a [`FrameIo`] that the full simulation of `run` uses in place of the byte
//! pipe; and [`stream_run`], the simulation of two sessions alone, bundled or not, with random
//! writes and reads. Nothing here re-implements the driver: its receive path, its timers, its
//! bundle (probes, paths left out and taken back) and its sends are the product's code.
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

use std::os::fd::RawFd;

use dgram::bundle::PathCounters;
use dgram::reliable::{Counters, ReliableConfig, State};
use eth::packet::Mac;
use eth::{DatagramSocket, EthConfig, EthStream};
use transport::FrameIo;

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

/// One end of a link as a raw-Ethernet driver's socket ([`DatagramSocket`]): what arrives
/// comes from the peer's MAC, what is queued goes on the wire at once. The simulation's
/// sessions are `eth`'s own driver ([`EthStream`]) over these, on the virtual clock.
#[derive(Debug)]
pub struct SimSocket {
    end: LinkEnd,
    peer: Mac,
    iface: &'static str,
    buf: Vec<u8>,
}

impl SimSocket {
    /// `end`, whose far side has MAC `peer`; datagrams up to `mtu` bytes.
    pub fn new(end: LinkEnd, peer: Mac, iface: &'static str, mtu: usize) -> SimSocket {
        SimSocket { end, peer, iface, buf: vec![0; mtu] }
    }
}

impl DatagramSocket for SimSocket {
    fn receive(&mut self, mut f: impl FnMut(Mac, &[u8])) -> usize {
        let mut n = 0;
        while let Some(len) = self.end.recv(&mut self.buf) {
            f(self.peer, &self.buf[..len]);
            n += 1;
        }
        n
    }

    fn queue_with(&mut self, _dst: Mac, fill: impl FnOnce(&mut [u8]) -> usize) -> io::Result<Option<usize>> {
        let n = fill(&mut self.buf);
        if n > 0 {
            self.end.send(&self.buf[..n]);
        }
        Ok(Some(n))
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn pending(&self) -> bool {
        false
    }

    fn take_error(&self) -> io::Result<Option<io::Error>> {
        Ok(None)
    }

    fn mtu(&self) -> usize {
        self.buf.len()
    }

    fn iface(&self) -> &str {
        self.iface
    }

    fn driver_name(&self) -> &'static str {
        "sim"
    }

    fn filter(&mut self, _session_id: u32, _peer: Option<Mac>) -> io::Result<()> {
        Ok(())
    }

    fn fd(&self) -> Option<RawFd> {
        None
    }
}

impl eth::Clock for Clock {
    fn now_us(&self) -> u64 {
        Clock::now_us(self)
    }
}

/// The MACs of the two sides of every simulated link: the initiator's, the target's.
pub const MACS: [Mac; 2] = [[2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]];

/// A session of the simulation: `eth`'s driver over one simulated link.
pub type SimEth = EthStream<SimSocket, Clock>;

/// A session `id` for side `side` (0 the initiator, 1 the target) over `ends`, one end of a
/// link per path (more than one: a bundle, whose peer is known on the first path only and
/// found on the others by the initiator's probes), its stream starting at sequence numbers
/// `initial`; `data_messages`: offered or agreed to, batching two segments to a datagram or not.
pub fn session(
    ends: Vec<LinkEnd>,
    side: usize,
    id: u32,
    initial: (u32, u32),
    config: &ReliableConfig,
    data_messages: Option<bool>,
    clock: &Clock,
) -> SimEth {
    let eth = EthConfig {
        reliable: *config,
        data_messages: data_messages.is_some(),
        data_batching: data_messages.unwrap_or(false),
        ..EthConfig::default()
    };
    let peer = MACS[1 - side];
    let sockets = ends
        .into_iter()
        .enumerate()
        .map(|(p, end)| {
            (SimSocket::new(end, peer, PATH_NAMES[p], config.datagram_len_max()), (p == 0).then_some(peer))
        })
        .collect();
    EthStream::over(sockets, id, initial, &eth, side == 0, clock.clone())
        .expect("a simulated link carries a datagram")
}

/// A [`FrameIo`] over one end of a link: `eth`'s session driver, with Resets injected at
/// seeded odds. Call [`pump`](Self::pump) every step: it moves datagrams both ways and runs
/// the timers.
pub struct DatagramIo {
    eth: SimEth,
    end: LinkEnd,
    /// Resets injected (the datagram form of a disconnect) and their odds per send.
    rng: Rng,
    reset_chance: u32,
    pub resets: u64,
}

impl std::fmt::Debug for DatagramIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatagramIo")
            .field("session", &self.eth.describe())
            .field("state", &self.eth.state())
            .field("resets", &self.resets)
            .finish()
    }
}

impl DatagramIo {
    pub fn new(eth: SimEth, end: LinkEnd, rng: Rng, reset_chance: u32) -> DatagramIo {
        DatagramIo { eth, end, rng, reset_chance, resets: 0 }
    }

    pub fn counters(&self) -> Counters {
        self.eth.counters()
    }

    pub fn end(&self) -> &LinkEnd {
        &self.end
    }

    /// Receive what has arrived, run the timers, send what is due.
    pub fn pump(&mut self) {
        // A simulated socket never fails; a dead session reports itself to the next call.
        let _ = self.eth.drive();
    }

    /// End the stream after what was written (a FIN).
    pub fn shutdown(&mut self) {
        let _ = self.eth.close();
    }

    /// Abort the session (an RST): the peer learns it from the Reset, or from its timeouts.
    pub fn reset(&mut self) {
        self.eth.reset();
    }
}

impl FrameIo for DatagramIo {
    fn recv(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        self.eth.recv(bufs)
    }

    fn recv_placing(
        &mut self,
        bufs: &mut [IoSliceMut<'_>],
        place: &mut dyn FnMut(&[u8]),
    ) -> io::Result<usize> {
        self.eth.recv_placing(bufs, place)
    }

    fn data_messages(&self) -> bool {
        self.eth.data_messages()
    }

    fn send_data_messages(&mut self) -> bool {
        self.eth.send_data_messages()
    }

    fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        if self.rng.chance(self.reset_chance) {
            self.resets += 1;
            self.reset();
        }
        self.eth.send(bufs)
    }

    fn buffered_recv(&self) -> bool {
        self.eth.buffered_recv()
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
    /// A bug planted in both sides' drivers (feature `mutations`), to show it is caught.
    #[cfg(feature = "mutations")]
    pub planted: Option<eth::Mutation>,
}

impl StreamOptions {
    /// A plain session (one link) of seed `seed`.
    pub fn new(seed: u64, faults: LinkFaults, bytes_max: u64) -> StreamOptions {
        StreamOptions {
            seed,
            faults,
            bytes_max,
            cut_at_us: None,
            paths: 1,
            outage: None,
            #[cfg(feature = "mutations")]
            planted: None,
        }
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

/// Two sessions of `eth`'s driver ([`EthStream`], a `DatagramStream` each, bundled over
/// `opts.paths` links) over faulty links, each writing a random number of bytes in writes of
/// random sizes and reading in reads of random sizes, then closing. Every byte must
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
    // Each side's sockets, one per path: both sides know their peer on the first path only,
    // and the initiator (side 0) finds it on the others by its probes.
    let mut link_ends: [Vec<LinkEnd>; 2] = [Vec::new(), Vec::new()];
    let mut add_path = |(a, b): (LinkEnd, LinkEnd)| {
        link_ends[0].push(a);
        link_ends[1].push(b);
    };
    add_path(link(&clock, rng.fork(1), latency, opts.faults));
    let id = rng.next_u64() as u32;
    let totals = [rng.range(0, opts.bytes_max), rng.range(0, opts.bytes_max)];
    for p in 1..opts.paths.max(1) {
        add_path(link(&clock, rng.fork(100 + p as u64), latency + rng.range(0, 20), opts.faults));
    }
    let open =
        |side: usize, initial| session(link_ends[side].clone(), side, id, initial, &config, None, &clock);
    let mut ends = [open(0, (isn[0], isn[1])), open(1, (isn[1], isn[0]))];
    #[cfg(feature = "mutations")]
    if let Some(bug) = opts.planted {
        ends.iter_mut().for_each(|e| e.set_mutation(bug));
    }
    let mut outage = opts.outage.filter(|_| opts.paths > 1);
    let mut written = [0u64; 2];
    let mut read = [0u64; 2];
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
                    ends[0].counters(),
                    ends[1].counters()
                ),
            ));
        }
        let now = clock.now_us();
        if opts.cut_at_us.is_some_and(|at| now >= at) {
            for end in &link_ends[0] {
                end.cut();
            }
        }
        if let Some((at, len)) = outage.filter(|(at, _)| now >= *at) {
            link_ends[0].last().expect("a path").take_down(at + len);
            outage = None;
        }
        for side in 0..2 {
            let eth = &mut ends[side];
            // The application now and then reads into random pieces: what the stream holds
            // first, then what arrives in order straight from the link (as a lane's receive
            // does). Half of those reads follow a drive, so that arrivals wait in the stream's
            // buffer first; without a read, the session is driven alone.
            let reading = rng.chance(600_000);
            if !reading || rng.chance(500_000) {
                let _ = eth.drive();
            }
            if reading {
                let n = rng.range(1, 5000) as usize;
                let cut = rng.range(0, n as u64) as usize;
                let (first, second) = inbox[..n].split_at_mut(cut);
                let mut pieces = [IoSliceMut::new(first), IoSliceMut::new(second)];
                // WouldBlock, the end of the stream and a dead session all read nothing; the
                // states below judge them.
                let got = eth.recv(&mut pieces).unwrap_or(0);
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
            // A write of random size, then a close once everything is written.
            if written[side] < totals[side] && eth.writable() && rng.chance(500_000) {
                let n = rng.range(1, (totals[side] - written[side]).min(WRITE_BYTES_MAX)) as usize;
                for (i, byte) in chunk[..n].iter_mut().enumerate() {
                    *byte = pattern(opts.seed, side, written[side] + i as u64);
                }
                written[side] += eth.send(&[IoSlice::new(&chunk[..n])]).unwrap_or(0) as u64;
            }
            if written[side] == totals[side] && opts.cut_at_us.is_none() && eth.state() == State::Open {
                let _ = eth.close();
            }
        }
        let states = [ends[0].state(), ends[1].state()];
        if let Some(cut) = opts.cut_at_us {
            if states.iter().all(|s| matches!(s, State::Dead(_))) {
                let bound = cut + config.keepalive_us + config.dead_after_us_max() + 1000;
                if now > bound {
                    return Err(fail(step, &clock, format!("dead only at {now} µs, bound {bound}")));
                }
                break;
            }
        } else if states == [State::Closed, State::Closed] {
            if read != [totals[1], totals[0]] || !ends.iter().all(|e| e.peer_closed()) {
                return Err(fail(step, &clock, format!("closed with {read:?} read of {totals:?}")));
            }
            break;
        } else if let Some(dead) = states.iter().find(|s| matches!(s, State::Dead(_))) {
            return Err(fail(step, &clock, format!("a stream died on a working link: {dead:?}")));
        }
        // Advance: a small random step, or straight to the next event when nothing is due.
        let arrivals = link_ends.iter().flatten().filter_map(LinkEnd::next_arrival_us);
        let next = arrivals
            .chain(ends.iter().filter_map(|e| e.next_timer_us()))
            .chain(outage.map(|(at, _)| at))
            .min();
        // The application can act when it has bytes to write and room, or bytes to read.
        let busy = (0..2).any(|side| {
            let eth = &ends[side];
            (written[side] < totals[side] && eth.writable()) || eth.buffered_recv()
        });
        let tick = rng.range(1, 40);
        let to = match next {
            Some(at) if !busy => at.max(now + 1),
            Some(at) => (now + tick).min(at.max(now + 1)),
            None => now + tick,
        };
        clock.advance(to - now);
    }
    let mut streams = ends[0].counters();
    add_counters(&mut streams, &ends[1].counters());
    let mut link = LinkCounts::default();
    for end in &link_ends[0] {
        link.add(&end.counts());
    }
    let (a, b) = (ends[0].paths(), ends[1].paths());
    let paths = a
        .iter()
        .zip(&b)
        .map(|(a, b)| PathCounters {
            up: a.up && b.up,
            datagrams_sent: a.datagrams_sent + b.datagrams_sent,
            datagrams_received: a.datagrams_received + b.datagrams_received,
            probes_sent: a.probes_sent + b.probes_sent,
            probes_answered: a.probes_answered + b.probes_answered,
            srtt_us: a.srtt_us.max(b.srtt_us),
            downs: a.downs + b.downs,
            rejoins: a.rejoins + b.rejoins,
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

/// The interface names of a run's paths, for the driver's reports.
const PATH_NAMES: [&str; 4] = ["sim0", "sim1", "sim2", "sim3"];

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
