//! NIC bundling: the paths of one raw-Ethernet session, sans-I/O.
//!
//! A session may run over several interfaces at once (`eth:veth0+veth2`). One
//! [`DatagramStream`](crate::reliable::DatagramStream) carries the session (one sequence space);
//! a [`Bundle`] decides which path each burst of its datagrams takes, watches every path, and
//! leaves out those that stop working, so that a link going down costs the retransmission of
//! what was on it and fails no request. The driver (`eth::session`, or the simulator) owns
//! the sockets and the peer addresses; this module owns the decisions.
//!
//! # The mechanism (docs/PROTOCOL.md, section 16.8, is the specification)
//!
//! - **Spreading.** Each send of the driver (all the datagrams one drive has ready) goes on one
//!   working path: the one that drains the bytes already in flight on it soonest
//!   ([`Bundle::pick`]; earliest completion first, as MPTCP's ECF scheduler, for links of one
//!   segment, whose round trips differ only by their queues). Each path measures its delivery
//!   rate from the acknowledgements of the bursts it carried (bytes acknowledged over the time
//!   they took, as BBR samples it, smoothed by eighths). So under load a slow link carries a
//!   burst only when the fast one's queue would hold it longer, the stream's single sequence
//!   space is not held up behind the slow link's datagrams, and links of one speed share alike.
//!   Under light load both are empty, the drain times tie at zero, and bursts alternate by
//!   bytes carried, the slow link's share included (with no queue, a burst on it is late only
//!   by its slower transmission). Until every
//!   working path has an estimate, the one with the fewest bytes in flight goes; ties go to
//!   the one that has carried the fewest bytes, then round robin. The datagrams of a burst
//!   stay in order on one link. When no path works, sends go round robin over the paths whose
//!   peer is known, and the stream's own timers decide whether the peer is dead.
//! - **Probes.** Once the peer has been heard from, every path is probed with a Probe datagram
//!   (`kind` 18), answered with a ProbeAck (`kind` 19) on the same path, its number echoed
//!   ([`Bundle::poll_probe`], [`Bundle::on_probe`]). Probes belong to the link layer; the
//!   stream never sees them. A working path is probed every `probe_up_us`: its round trip
//!   (smoothed, as SRTT) and, while the session is idle, its liveness. A path that is down is
//!   probed from `probe_down_min_us` on, the gap doubling up to `probe_down_max_us`.
//! - **Finding the peer on a path.** At start a side knows its peer's address on one path
//!   (the initiator: the target's MAC it connected to; the target: the path the session
//!   started on). On the others the seeking side (the initiator) sends its probes to the
//!   broadcast address; the peer's paths are filtered by session id, so only the session's
//!   own peer answers, and each side learns the other's address from the probe or its answer
//!   ([`PathEvent::Found`]). A path is used once its peer is known.
//! - **Leaving a path out.** A working path is down when the interface refuses to send
//!   ([`Bundle::on_send_failed`]), when `probes_missed_down` of its probes in a row go
//!   unanswered, or when a datagram it carried that the peer acknowledges (Data, Close) has
//!   not been acknowledged within `silence_down_us`, by an ack on any path, while another path
//!   heard from the peer after it left ([`Bundle::on_sent`], [`Bundle::on_delivered`],
//!   [`Bundle::check`]). One such datagram per path is watched at a time, as TCP times one
//!   segment. Anything heard on a down path (data, a probe, an answer) brings it back.
//!
//! Nothing here reads a clock or does I/O; time is a `now` in microseconds passed in. A bundle
//! of one path never probes: the stream's keepalives already watch its only link.

use std::collections::VecDeque;

use wire::datagram::{DatagramHeader, DatagramKind};

/// Most bursts a path remembers in flight; past it a burst is counted with the one before.
const IN_FLIGHT_BURSTS_MAX: usize = 1024;
/// How long a path's least round trip stands before a larger one replaces it.
const LEAST_RTT_WINDOW_US: u64 = 1_000_000;

/// A burst sent on a path and not yet known to have arrived.
#[derive(Debug, Clone, Copy)]
struct Burst {
    /// The sequence number of its last datagram the peer acknowledges.
    seq: u32,
    bytes: u64,
    sent_at_us: u64,
    /// The path's delivered bytes, and when they were last counted, as it left.
    delivered_before: u64,
    delivered_at_before_us: u64,
}

/// The timers and thresholds of a [`Bundle`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BundleConfig {
    /// How often a working path is probed.
    pub probe_up_us: u64,
    /// The first probe interval of a down path, and of a path whose peer is not yet known; it
    /// doubles up to the next two.
    pub probe_down_min_us: u64,
    pub probe_down_max_us: u64,
    pub probe_unknown_max_us: u64,
    /// A working path whose probes go unanswered this many times in a row is down.
    pub probes_missed_down: u32,
    /// A working path silent this long after carrying acknowledged datagrams, while another
    /// path heard from the peer, is down.
    pub silence_down_us: u64,
}

impl Default for BundleConfig {
    fn default() -> BundleConfig {
        BundleConfig {
            probe_up_us: 100_000,
            probe_down_min_us: 5_000,
            probe_down_max_us: 200_000,
            probe_unknown_max_us: 1_000_000,
            probes_missed_down: 3,
            silence_down_us: 5_000,
        }
    }
}

/// What one path did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathCounters {
    /// Whether sends go on it now.
    pub up: bool,
    pub datagrams_sent: u64,
    pub datagrams_received: u64,
    pub probes_sent: u64,
    pub probes_answered: u64,
    /// Smoothed round trip of its probes (0 before the first answer).
    pub srtt_us: u64,
    /// How often it was left out, and how often it came back after.
    pub downs: u64,
    pub rejoins: u64,
}

/// Why a path was left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DownReason {
    /// The interface refused to send (it is down, or gone).
    SendFailed,
    /// Its probes went unanswered.
    ProbesUnanswered,
    /// It heard nothing back for what it carried while another path heard from the peer.
    Silent,
}

/// A change of a path's state, for the driver to log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathEvent {
    Down {
        path: usize,
        reason: DownReason,
    },
    Rejoined {
        path: usize,
    },
    /// The peer was found on a path it was not known on: its address is the source of the
    /// datagram just handed to [`Bundle::on_probe`].
    Found {
        path: usize,
    },
}

#[derive(Debug, Clone)]
struct PathState {
    /// The peer's address on this path is known (to the driver, which keeps it).
    known: bool,
    /// One datagram sent on the path and not yet known to have arrived: (sequence number,
    /// sent at). Armed at a send when none is; cleared when the stream learns it arrived
    /// ([`Bundle::on_delivered`]), by an acknowledgement that came back on any path.
    marker: Option<(u32, u64)>,
    /// The marked datagram was sent again (its copy may have arrived by another path): its
    /// delivery then clears the marker only if this path has heard from the peer since.
    marker_resent: bool,
    /// When the path last heard from the peer (`None`: never).
    last_heard_us: Option<u64>,
    next_probe_us: u64,
    probe_gap_us: u64,
    /// The probe waiting for its answer: (number, sent at).
    probe_out: Option<(u32, u64)>,
    probes_missed: u32,
    /// Bytes sent on the path while it worked: the spreading's tie-break.
    load_bytes: u64,
    /// The bursts sent on the path and not yet known to have arrived, oldest first, and their
    /// bytes.
    in_flight: VecDeque<Burst>,
    in_flight_bytes: u64,
    /// Bytes of bursts known to have arrived, and when the last of them was learnt.
    delivered_bytes: u64,
    delivered_at_us: u64,
    /// Delivery rate in bytes per millisecond (0: no estimate yet), and the least round trip
    /// of a burst with when it was seen (`None`: none yet).
    rate_bytes_per_ms: u64,
    least_rtt: Option<(u64, u64)>,
    counters: PathCounters,
}

/// The paths of one session.
#[derive(Debug, Clone)]
pub struct Bundle {
    config: BundleConfig,
    session_id: u32,
    paths: Vec<PathState>,
    /// Where the next round robin starts.
    turn: usize,
    /// This side looks for its peer on the paths where it is unknown (the initiator).
    seeks: bool,
    probe_number: u32,
    events: Vec<PathEvent>,
}

impl Bundle {
    /// A bundle of `known.len()` paths of session `session_id`, `known[i]` saying whether the
    /// peer's address on path `i` is known (at least one should be; those paths start
    /// working). `seeks`: probe the other paths by broadcast once the peer has answered.
    pub fn new(config: BundleConfig, session_id: u32, known: &[bool], seeks: bool) -> Bundle {
        let paths = known
            .iter()
            .map(|&known| PathState {
                known,
                marker: None,
                marker_resent: false,
                last_heard_us: None,
                next_probe_us: 0,
                probe_gap_us: config.probe_down_min_us,
                probe_out: None,
                probes_missed: 0,
                load_bytes: 0,
                in_flight: VecDeque::new(),
                in_flight_bytes: 0,
                delivered_bytes: 0,
                delivered_at_us: 0,
                rate_bytes_per_ms: 0,
                least_rtt: None,
                counters: PathCounters { up: known, ..PathCounters::default() },
            })
            .collect();
        Bundle { config, session_id, paths, turn: 0, seeks, probe_number: 0, events: Vec::new() }
    }

    pub fn len(&self) -> usize {
        self.paths.len()
    }

    pub fn is_empty(&self) -> bool {
        self.paths.is_empty()
    }

    /// Whether this side looks for its peer on the paths where it is unknown.
    pub fn seeks(&self) -> bool {
        self.seeks
    }

    pub fn counters(&self, path: usize) -> PathCounters {
        self.paths[path].counters
    }

    /// Whether the peer's address on `path` is known.
    pub fn known(&self, path: usize) -> bool {
        self.paths[path].known
    }

    /// Start the round robin at `path` (a target's session, on the path it started on).
    pub fn prefer(&mut self, path: usize) {
        self.turn = path % self.paths.len().max(1);
    }

    /// The path the next send goes on: the working one that drains what is in flight on it
    /// soonest, at its delivery rate (the fewest bytes in flight while any working path lacks
    /// an estimate; ties: the one that has carried the fewest bytes, then round robin), so
    /// that the datagrams of the paths reach the peer in about the order they left, whatever
    /// each link's speed; when none works, the next one whose peer is known.
    pub fn pick(&self) -> Option<usize> {
        let n = self.paths.len();
        let order = (0..n).map(|k| (self.turn + k) % n);
        let up = order.clone().filter(|&i| self.paths[i].counters.up);
        let estimated = up.clone().all(|i| self.paths[i].drain_us().is_some());
        up.min_by_key(|&i| {
            let p = &self.paths[i];
            let first = if estimated { p.drain_us().unwrap_or(0) } else { p.in_flight_bytes };
            (first, p.load_bytes)
        })
        .or_else(|| order.clone().find(|&i| self.paths[i].known))
    }

    /// Bytes sent on `path` and not yet known to have arrived (0 while it is down: what was on
    /// it is the stream's to send again).
    pub fn in_flight_bytes(&self, path: usize) -> u64 {
        self.paths[path].in_flight_bytes
    }

    /// `path`'s estimates: its delivery rate in bytes per millisecond and its least round
    /// trip in µs (`None` before its first acknowledged burst).
    pub fn estimates(&self, path: usize) -> Option<(u64, u64)> {
        let p = &self.paths[path];
        p.least_rtt.filter(|_| p.rate_bytes_per_ms > 0).map(|(rtt, _)| (p.rate_bytes_per_ms, rtt))
    }

    /// `datagrams` of `bytes` left on `path`, `sequenced` the sequence number of the last of
    /// them that the peer acknowledges (Data, Close), if any did.
    pub fn on_sent(&mut self, path: usize, now: u64, datagrams: u64, bytes: u64, sequenced: Option<u32>) {
        let p = &mut self.paths[path];
        p.counters.datagrams_sent += datagrams;
        if p.counters.up {
            p.load_bytes += bytes;
            if let Some(seq) = sequenced {
                let full = p.in_flight.len() >= IN_FLIGHT_BURSTS_MAX;
                match p.in_flight.back_mut() {
                    Some(last) if full => {
                        last.seq = seq;
                        last.bytes += bytes;
                    }
                    _ => {
                        if p.in_flight.is_empty() {
                            // Idle until now: the rate is measured from this send on.
                            p.delivered_at_us = now;
                        }
                        p.in_flight.push_back(Burst {
                            seq,
                            bytes,
                            sent_at_us: now,
                            delivered_before: p.delivered_bytes,
                            delivered_at_before_us: p.delivered_at_us,
                        });
                    }
                }
                p.in_flight_bytes += bytes;
            }
        }
        if let (None, Some(seq)) = (p.marker, sequenced) {
            p.marker = Some((seq, now));
            p.marker_resent = false;
        }
        self.turn = path + 1;
    }

    /// A datagram with sequence number `seq` (Data, Close) is going out, on any path: call for
    /// each, before [`on_sent`](Self::on_sent). A path whose marked datagram this is sending
    /// again learns that its own copy may not be what arrives.
    pub fn on_sequenced(&mut self, seq: u32) {
        for p in &mut self.paths {
            if p.marker.is_some_and(|(m, _)| m == seq) {
                p.marker_resent = true;
            }
        }
    }

    /// Take the bursts known to have arrived out of each path's bytes in flight, and clear the
    /// markers of the paths whose marked datagram has arrived: `delivered(seq)` says whether
    /// the stream has had it acknowledged
    /// ([`DatagramStream::delivered`](crate::reliable::DatagramStream::delivered)).
    /// Each burst's acknowledgement at `now` is a sample of its path's delivery rate and round
    /// trip.
    pub fn on_delivered(&mut self, now: u64, delivered: impl Fn(u32) -> bool) {
        for p in &mut self.paths {
            while let Some(&burst) = p.in_flight.front() {
                if !delivered(burst.seq) {
                    break;
                }
                p.in_flight.pop_front();
                p.in_flight_bytes -= burst.bytes;
                p.delivered_bytes += burst.bytes;
                p.delivered_at_us = now;
                p.sample(now, &burst);
            }
            let Some((seq, since)) = p.marker else { continue };
            // A copy sent again on another path proves nothing of this one, unless this path
            // has heard from the peer since its datagram left.
            let proven = !p.marker_resent || p.last_heard_us.is_some_and(|t| t > since);
            if delivered(seq) && proven {
                p.marker = None;
            }
        }
    }

    /// `datagrams` of the session's stream arrived on `path` (from the peer it knows there).
    pub fn on_received(&mut self, path: usize, now: u64, datagrams: u64) {
        if datagrams == 0 || !self.paths[path].known {
            return;
        }
        self.paths[path].counters.datagrams_received += datagrams;
        self.heard(path, now);
    }

    /// A valid Probe or ProbeAck of this session arrived on `path`. Returns the ProbeAck to
    /// send back on the same path, to the probe's source, when it was a Probe. A path whose
    /// peer was unknown learns it from this datagram's source ([`PathEvent::Found`]).
    pub fn on_probe(&mut self, path: usize, now: u64, h: &DatagramHeader) -> Option<DatagramHeader> {
        if h.session_id != self.session_id || !matches!(h.kind, DatagramKind::Probe | DatagramKind::ProbeAck)
        {
            return None;
        }
        let p = &mut self.paths[path];
        if !p.known {
            p.known = true;
            self.events.push(PathEvent::Found { path });
        }
        p.counters.datagrams_received += 1;
        let answer = match h.kind {
            DatagramKind::Probe => Some(DatagramHeader { kind: DatagramKind::ProbeAck, ..*h }),
            _ => {
                if let Some((_, sent)) = p.probe_out.filter(|(number, _)| *number == h.seq) {
                    let sample = now.saturating_sub(sent);
                    let srtt = &mut p.counters.srtt_us;
                    *srtt = if p.counters.probes_answered == 0 { sample } else { (*srtt * 7 + sample) / 8 };
                    p.counters.probes_answered += 1;
                    p.probe_out = None;
                }
                None
            }
        };
        self.heard(path, now);
        answer
    }

    /// The interface of `path` refused to send (down, or gone).
    pub fn on_send_failed(&mut self, path: usize, now: u64) {
        self.down(path, now, DownReason::SendFailed);
    }

    /// Leave out the working paths whose marked datagram has not arrived within
    /// `silence_down_us`, or three of the stream's retransmission timeouts (`rto_us`, as its
    /// round trips call for, before any backoff: queues can hold a datagram that long), or
    /// three of the path's own round trips (its probes', and its least round trip plus the
    /// time to drain what is in flight on it: a slow link of a bundle queues longer than the
    /// stream's round trips, which mix all the paths'), while another path heard from the
    /// peer after it left.
    pub fn check(&mut self, now: u64, rto_us: u64) {
        if self.paths.len() < 2 {
            return;
        }
        let silence = self.config.silence_down_us.max(rto_us.saturating_mul(3));
        for i in 0..self.paths.len() {
            let p = &self.paths[i];
            let Some((_, since)) = p.marker.filter(|_| p.counters.up) else { continue };
            let own = p.counters.srtt_us.max(p.arrival_us().unwrap_or(0));
            let silence = silence.max(own.saturating_mul(3));
            let others_heard = self
                .paths
                .iter()
                .enumerate()
                .any(|(j, o)| j != i && o.last_heard_us.is_some_and(|t| t > since));
            if now.saturating_sub(since) > silence && others_heard {
                self.down(i, now, DownReason::Silent);
            }
        }
    }

    /// The next probe due by `now`: its path and header (to the peer's address on that path,
    /// or to the broadcast address where it is not known). Call until `None`.
    pub fn poll_probe(&mut self, now: u64) -> Option<(usize, DatagramHeader)> {
        if self.paths.len() < 2 {
            return None;
        }
        let established = self.established();
        let i = (0..self.paths.len())
            .find(|&i| self.probed(i, established) && self.paths[i].next_probe_us <= now)?;
        if self.paths[i].counters.up && self.paths[i].probe_out.is_some() {
            self.paths[i].probes_missed += 1;
            if self.paths[i].probes_missed >= self.config.probes_missed_down {
                self.down(i, now, DownReason::ProbesUnanswered);
            }
        }
        self.probe_number = self.probe_number.wrapping_add(1);
        let config = self.config;
        let p = &mut self.paths[i];
        p.counters.probes_sent += 1;
        p.probe_out = Some((self.probe_number, now));
        let (gap, max) = match (p.counters.up, p.known) {
            (true, _) => (config.probe_up_us, config.probe_up_us),
            (false, true) => (p.probe_gap_us, config.probe_down_max_us),
            (false, false) => (p.probe_gap_us, config.probe_unknown_max_us),
        };
        p.next_probe_us = now + gap.max(1);
        if !p.counters.up {
            p.probe_gap_us = (p.probe_gap_us * 2).min(max);
        }
        Some((
            i,
            DatagramHeader {
                kind: DatagramKind::Probe,
                flags: 0,
                session_id: self.session_id,
                seq: self.probe_number,
                ack: 0,
                sack: 0,
                window: 0,
                payload_len: 0,
            },
        ))
    }

    /// When the next probe is due.
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.paths.len() < 2 {
            return None;
        }
        let established = self.established();
        (0..self.paths.len())
            .filter(|&i| self.probed(i, established))
            .map(|i| self.paths[i].next_probe_us)
            .min()
    }

    /// The next change of a path's state, oldest first.
    pub fn poll_event(&mut self) -> Option<PathEvent> {
        (!self.events.is_empty()).then(|| self.events.remove(0))
    }

    /// The peer has been heard from: the session is open at both ends, and probes get answers.
    fn established(&self) -> bool {
        self.paths.iter().any(|p| p.last_heard_us.is_some())
    }

    /// Whether `path` is probed: once the session is established, if its peer is known or
    /// this side seeks it.
    fn probed(&self, path: usize, established: bool) -> bool {
        established && (self.paths[path].known || self.seeks)
    }

    fn heard(&mut self, path: usize, now: u64) {
        // A path that starts working again starts level with the others, not behind them.
        let level = (0..self.paths.len())
            .filter(|&j| j != path && self.paths[j].counters.up)
            .map(|j| self.paths[j].load_bytes)
            .min()
            .unwrap_or(0);
        let p = &mut self.paths[path];
        p.last_heard_us = Some(now);
        p.probes_missed = 0;
        if !p.counters.up && p.known {
            p.counters.up = true;
            p.load_bytes = p.load_bytes.max(level);
            p.next_probe_us = now + self.config.probe_up_us;
            if p.counters.downs > 0 {
                p.counters.rejoins += 1;
                self.events.push(PathEvent::Rejoined { path });
            }
        }
    }

    fn down(&mut self, path: usize, now: u64, reason: DownReason) {
        let p = &mut self.paths[path];
        if !p.counters.up {
            return;
        }
        p.counters.up = false;
        p.counters.downs += 1;
        p.marker = None;
        p.in_flight.clear();
        p.in_flight_bytes = 0;
        p.probe_gap_us = self.config.probe_down_min_us;
        p.next_probe_us = now;
        p.probe_out = None;
        self.events.push(PathEvent::Down { path, reason });
    }
}

impl PathState {
    /// How long the path takes to deliver what is in flight on it, at its delivery rate
    /// (`None` before its first estimate).
    fn drain_us(&self) -> Option<u64> {
        (self.rate_bytes_per_ms > 0).then(|| self.in_flight_bytes * 1000 / self.rate_bytes_per_ms)
    }

    /// When a burst sent now should be known to have arrived, from now: the least round trip
    /// plus the time to drain what is in flight (`None` without both estimates).
    fn arrival_us(&self) -> Option<u64> {
        Some(self.least_rtt?.0 + self.drain_us()?)
    }

    /// `burst` was acknowledged at `now`: a round trip, and a delivery rate over the time since
    /// the path's last acknowledgement before it left (BBR's delivery rate sample), smoothed by
    /// eighths as SRTT is. (A path that carries less than it could measures less than it can
    /// carry; it then has little in flight, and its round trip alone decides its arrival.)
    fn sample(&mut self, now: u64, burst: &Burst) {
        let rtt = now.saturating_sub(burst.sent_at_us).max(1);
        self.least_rtt = match self.least_rtt {
            Some((least, at)) if least <= rtt && now.saturating_sub(at) < LEAST_RTT_WINDOW_US => {
                Some((least, at))
            }
            _ => Some((rtt, now)),
        };
        let elapsed = now.saturating_sub(burst.delivered_at_before_us).max(1);
        let rate = (self.delivered_bytes - burst.delivered_before).saturating_mul(1000) / elapsed;
        self.rate_bytes_per_ms =
            if self.rate_bytes_per_ms == 0 { rate } else { (7 * self.rate_bytes_per_ms + rate) / 8 };
    }
}

/// Whether a datagram (header first) is a link-layer one (Probe, ProbeAck), for the driver to
/// hand to [`Bundle::on_probe`] instead of the stream. Only the kind byte is looked at; the
/// driver still parses (and checks) what this says yes to.
pub fn is_probe(datagram: &[u8]) -> bool {
    matches!(datagram.get(1), Some(&k) if k == DatagramKind::Probe as u8 || k == DatagramKind::ProbeAck as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two(seeks: bool) -> Bundle {
        Bundle::new(BundleConfig::default(), 7, &[true, false], seeks)
    }

    /// Wire one bundle's probes to another's answers, path for path.
    fn answer(a: &mut Bundle, b: &mut Bundle, now: u64) {
        while let Some((path, probe)) = a.poll_probe(now) {
            if let Some(ack) = b.on_probe(path, now, &probe) {
                a.on_probe(path, now, &ack);
            }
        }
    }

    #[test]
    fn sends_alternate_over_working_paths_and_a_path_joins_when_its_peer_answers() {
        let (mut a, mut b) = (two(true), two(false));
        assert_eq!(a.pick(), Some(0));
        a.on_sent(0, 0, 3, 300, Some(0));
        assert_eq!(a.pick(), Some(0), "path 1 is not known yet");
        // Nothing is sought before the peer has answered.
        assert_eq!(a.poll_probe(0), None);
        a.on_received(0, 10, 1);
        assert_eq!(a.poll_timeout(), Some(0));
        answer(&mut a, &mut b, 20);
        assert!(a.known(1) && b.known(1) && a.counters(1).up && b.counters(1).up);
        assert_eq!(b.poll_event(), Some(PathEvent::Found { path: 1 }));
        assert_eq!(a.poll_event(), Some(PathEvent::Found { path: 1 }));
        assert_eq!(a.counters(1).probes_answered, 1);
        // Path 1 starts level with path 0, then the one with fewer bytes in flight carries the
        // next send.
        assert_eq!(a.pick(), Some(1));
        a.on_sent(1, 30, 1, 1_000, Some(3));
        assert_eq!(a.pick(), Some(0));
        a.on_sent(0, 31, 1, 100, Some(4));
        assert_eq!(a.pick(), Some(0), "path 0 has 400 bytes in flight, path 1 1,000");
        a.on_sent(0, 32, 1, 1_000, Some(5));
        assert_eq!(a.pick(), Some(1));
    }

    /// Two working paths, one four times as fast as the other (8,000 and 2,000 bytes a µs,
    /// 10 µs each way), loaded to 90% of both with a 9,000-byte burst every µs, more than the
    /// fast one carries alone. The fast path carries what it can, the slow one the rest, and
    /// bursts arrive in about the order they left: none overtakes one sent before it by more
    /// than a few µs, so a single sequence space is not held up behind the slow link.
    #[test]
    fn links_of_two_speeds_share_by_speed_and_keep_the_order_of_arrival() {
        let mut a = Bundle::new(BundleConfig::default(), 7, &[true, true], false);
        let (speed, delay) = ([8_000u64, 2_000], 10u64);
        let mut free_at = [0u64; 2];
        let mut acks: Vec<(u64, u32)> = Vec::new(); // (acknowledged at, seq)
        let mut arrived = std::collections::HashSet::new();
        let (mut carried, mut latest, mut overtaken_by) = ([0u64; 2], 0u64, 0u64);
        for now in 0..20_000u64 {
            acks.retain(|&(at, seq)| {
                if at <= now {
                    arrived.insert(seq);
                }
                at > now
            });
            a.on_delivered(now, |seq| arrived.contains(&seq));
            let path = a.pick().expect("two working paths");
            let seq = now as u32;
            a.on_sent(path, now, 1, 9_000, Some(seq));
            carried[path] += 9_000;
            let arrives = (now + delay).max(free_at[path]) + 9_000 / speed[path];
            free_at[path] = arrives;
            acks.push((arrives + delay, seq));
            if now > 1_000 {
                overtaken_by = overtaken_by.max(latest.saturating_sub(arrives));
            }
            latest = latest.max(arrives);
        }
        let share = carried[0] as f64 / (carried[0] + carried[1]) as f64;
        assert!((0.78..0.89).contains(&share), "fast path's share {share}: {carried:?}");
        assert!(overtaken_by < 20, "a burst arrived {overtaken_by} µs before one sent ahead of it");
        let (fast, slow) = (a.estimates(0).unwrap(), a.estimates(1).unwrap());
        assert!(fast.0 > 2 * slow.0, "rates {fast:?} {slow:?}");
        // A path that goes down forgets what it had in flight: the stream sends that again.
        assert!(a.in_flight_bytes(1) > 0);
        a.on_send_failed(1, 20_000);
        assert_eq!(a.in_flight_bytes(1), 0);
    }

    #[test]
    fn a_silent_path_is_left_out_and_rejoins_when_heard() {
        let mut a = Bundle::new(BundleConfig::default(), 7, &[true, true], false);
        a.on_sent(1, 1_000, 4, 4_000, Some(10));
        a.on_received(0, 2_000, 4);
        // Acknowledgements of what path 0 carried do not clear path 1's marker.
        a.on_delivered(6_000, |seq| seq < 10);
        a.check(5_000, 500);
        assert!(a.counters(1).up, "not silent for long enough yet");
        a.check(6_001, 500);
        assert!(!a.counters(1).up);
        assert_eq!(a.poll_event(), Some(PathEvent::Down { path: 1, reason: DownReason::Silent }));
        assert_eq!(a.pick(), Some(0));
        // Probed at once (path 0 too: its first probe is due), then at doubling gaps.
        let probed: Vec<usize> = std::iter::from_fn(|| a.poll_probe(6_001).map(|(p, _)| p)).collect();
        assert_eq!(probed, [0, 1]);
        assert_eq!(a.poll_timeout(), Some(11_001));
        a.on_received(1, 7_000, 1);
        assert!(a.counters(1).up);
        assert_eq!(a.counters(1).rejoins, 1);
        assert_eq!(a.poll_event(), Some(PathEvent::Rejoined { path: 1 }));
    }

    #[test]
    fn delivered_datagrams_bare_acks_and_a_lone_path_are_never_taken_for_silence() {
        let mut a = Bundle::new(BundleConfig::default(), 7, &[true, true], false);
        a.on_sent(1, 1_000, 1, 40, None);
        a.on_received(0, 2_000, 1);
        a.check(1_000_000, 500);
        assert!(a.counters(1).up, "a bare ack expects no answer");
        // Path 1's datagram was acknowledged through path 0: path 1 works.
        a.on_sent(1, 1_000_000, 1, 100, Some(5));
        a.on_received(0, 1_000_100, 1);
        a.on_delivered(0, |seq| seq <= 5);
        a.check(2_000_000, 500);
        assert!(a.counters(1).up);
        // Deep queues: a long retransmission timeout stretches the silence allowed.
        a.on_sent(1, 2_000_000, 1, 100, Some(6));
        a.on_received(0, 2_000_100, 1);
        a.check(2_020_000, 10_000);
        assert!(a.counters(1).up, "20 ms is less than three RTOs of 10 ms");
        let mut one = Bundle::new(BundleConfig::default(), 7, &[true], true);
        one.on_sent(0, 0, 1, 100, Some(0));
        one.check(1_000_000, 500);
        assert!(one.counters(0).up);
        assert_eq!(one.poll_probe(1_000_000), None);
        assert_eq!(one.poll_timeout(), None);
    }

    #[test]
    fn a_path_whose_datagram_arrived_only_as_a_copy_sent_elsewhere_is_still_silent() {
        let mut a = Bundle::new(BundleConfig::default(), 7, &[true, true], false);
        a.on_sent(1, 1_000, 1, 100, Some(10));
        // Lost on path 1; the stream sends it again (on path 0), and that copy arrives.
        a.on_sequenced(10);
        a.on_sent(0, 1_300, 1, 100, Some(10));
        a.on_received(0, 1_400, 1);
        a.on_delivered(0, |seq| seq <= 10);
        a.check(7_000, 500);
        assert!(!a.counters(1).up, "path 1 delivered nothing itself");
        // Had path 1 heard from the peer since, the copy would prove nothing against it.
        let mut b = Bundle::new(BundleConfig::default(), 7, &[true, true], false);
        b.on_sent(1, 1_000, 1, 100, Some(10));
        b.on_sequenced(10);
        b.on_received(1, 1_200, 1);
        b.on_received(0, 1_400, 1);
        b.on_delivered(0, |seq| seq <= 10);
        b.check(7_000, 500);
        assert!(b.counters(1).up);
    }

    #[test]
    fn unanswered_probes_and_refused_sends_take_a_path_down() {
        let mut a = Bundle::new(BundleConfig::default(), 7, &[true, true], false);
        assert_eq!(a.poll_probe(0), None, "no probe before the peer is heard from");
        a.on_received(0, 0, 1);
        let mut now = 0;
        for _ in 0..3 {
            while a.poll_probe(now).is_some() {}
            now += BundleConfig::default().probe_up_us;
        }
        while a.poll_probe(now).is_some() {}
        assert!(!a.counters(0).up && !a.counters(1).up);
        assert_eq!(a.pick(), Some(0), "with none working, the known paths still carry sends");
        let mut b = Bundle::new(BundleConfig::default(), 7, &[true, true], false);
        b.on_send_failed(1, 5);
        assert_eq!(b.poll_event(), Some(PathEvent::Down { path: 1, reason: DownReason::SendFailed }));
        assert_eq!(b.counters(1).downs, 1);
    }

    #[test]
    fn probes_of_another_session_or_kind_are_ignored() {
        let mut a = two(false);
        let other = DatagramHeader {
            kind: DatagramKind::Probe,
            flags: 0,
            session_id: 8,
            seq: 1,
            ack: 0,
            sack: 0,
            window: 0,
            payload_len: 0,
        };
        assert_eq!(a.on_probe(1, 0, &other), None);
        assert!(!a.known(1));
        let ack = DatagramHeader { kind: DatagramKind::Ack, session_id: 7, ..other };
        assert_eq!(a.on_probe(1, 0, &ack), None);
        assert!(!a.known(1));
        assert!(is_probe(&[1, 18]) && is_probe(&[1, 19]) && !is_probe(&[1, 1]) && !is_probe(&[1]));
    }
}
