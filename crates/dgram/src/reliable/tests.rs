//! Two streams wired together in memory on a virtual clock (the Pair harness), with a fate
//! for every datagram chosen by the test.

use super::*;

/// What happens to one datagram on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Deliver,
    Drop,
    Duplicate,
    /// Delivered this much later than the latency.
    Delay(u64),
}

/// What a fate is decided on: the sending side, the datagram's header, and how many datagrams
/// that side has sent before it.
type FateFn = Box<dyn FnMut(usize, &DatagramHeader, u64) -> Fate>;

struct Pair {
    now: u64,
    ends: [DatagramStream; 2],
    /// (deliver at, to side, bytes), in the order sent.
    wire: Vec<(u64, usize, Vec<u8>)>,
    latency_us: u64,
    fate: FateFn,
    sent: [u64; 2],
    /// Stream bytes each side has written and read so far.
    written: [u64; 2],
    read: [Vec<u8>; 2],
    buf: Vec<u8>,
}

fn pattern(side: usize, at: u64) -> u8 {
    (at.wrapping_mul(131) ^ (at >> 9) ^ (side as u64 * 0x5A)) as u8
}

impl Pair {
    fn new(config: ReliableConfig, seq: [u32; 2], latency_us: u64) -> Pair {
        Pair {
            now: 0,
            ends: [
                DatagramStream::new(&config, 7, seq[0], seq[1]),
                DatagramStream::new(&config, 7, seq[1], seq[0]),
            ],
            wire: Vec::new(),
            latency_us,
            fate: Box::new(|_, _, _| Fate::Deliver),
            sent: [0; 2],
            written: [0; 2],
            read: [Vec::new(), Vec::new()],
            buf: vec![0; config.datagram_len_max()],
        }
    }

    fn with_fate(mut self, fate: impl FnMut(usize, &DatagramHeader, u64) -> Fate + 'static) -> Pair {
        self.fate = Box::new(fate);
        self
    }

    /// Side `side` writes up to `n` more bytes of its pattern; returns how many it took.
    fn write(&mut self, side: usize, n: usize) -> usize {
        let bytes: Vec<u8> = (0..n as u64).map(|i| pattern(side, self.written[side] + i)).collect();
        let took = self.ends[side].write(&[IoSlice::new(&bytes)]);
        self.written[side] += took as u64;
        took
    }

    /// Side `side` reads everything there is.
    fn read(&mut self, side: usize) -> usize {
        let mut total = 0;
        loop {
            let mut chunk = [0u8; 3000];
            let (first, second) = chunk.split_at_mut(1000);
            let n = self.ends[side].read(&mut [IoSliceMut::new(first), IoSliceMut::new(second)]);
            if n == 0 {
                return total;
            }
            self.read[side].extend_from_slice(&chunk[..n]);
            total += n;
        }
    }

    /// Every byte side `side` read is the peer's pattern, in order.
    fn check_read(&self, side: usize) {
        for (i, &b) in self.read[side].iter().enumerate() {
            assert_eq!(b, pattern(1 - side, i as u64), "side {side}, stream byte {i}");
        }
    }

    /// Deliver what is due, run timers, send what the ends have to send.
    fn step(&mut self) {
        let now = self.now;
        let mut due = Vec::new();
        self.wire.retain(|(at, to, bytes)| {
            if *at <= now {
                due.push((*at, *to, bytes.clone()));
                false
            } else {
                true
            }
        });
        due.sort_by_key(|(at, _, _)| *at);
        for (_, to, bytes) in due {
            self.ends[to].handle_datagram(now, &bytes);
        }
        for side in 0..2 {
            self.ends[side].handle_timeout(now);
            while let Some(n) = self.ends[side].poll_transmit(now, &mut self.buf) {
                let (h, _) = DatagramHeader::parse(&self.buf[..n]).expect("a stream emits valid datagrams");
                let fate = (self.fate)(side, &h, self.sent[side]);
                self.sent[side] += 1;
                let at = now + self.latency_us;
                let bytes = self.buf[..n].to_vec();
                match fate {
                    Fate::Deliver => self.wire.push((at, 1 - side, bytes)),
                    Fate::Drop => {}
                    Fate::Duplicate => {
                        self.wire.push((at, 1 - side, bytes.clone()));
                        self.wire.push((at + 1, 1 - side, bytes));
                    }
                    Fate::Delay(us) => self.wire.push((at + us, 1 - side, bytes)),
                }
            }
        }
    }

    /// The next time something happens, if anything will.
    fn next_event(&self) -> Option<u64> {
        let wire = self.wire.iter().map(|(at, _, _)| *at).min();
        [wire, self.ends[0].poll_timeout(), self.ends[1].poll_timeout()].into_iter().flatten().min()
    }

    /// Step until `done` holds (checked after every step) or nothing is left to happen.
    /// Returns whether `done` held.
    fn run_until(&mut self, limit_us: u64, mut done: impl FnMut(&mut Pair) -> bool) -> bool {
        // What `done` wrote is sent by the next step, even when no event is pending.
        let mut idle_steps = 0;
        loop {
            self.step();
            if done(self) {
                return true;
            }
            let next = match self.next_event() {
                Some(at) => {
                    idle_steps = 0;
                    at.max(self.now + 1)
                }
                None if idle_steps == 0 => {
                    idle_steps += 1;
                    self.now + 1
                }
                None => return false,
            };
            if next > limit_us {
                return false;
            }
            self.now = next;
        }
    }

    /// Side 0 sends `total` bytes to side 1, which reads as they come.
    fn transfer(&mut self, total: u64, limit_us: u64) {
        let ok = self.run_until(limit_us, |p| {
            let left = total - p.written[0];
            if left > 0 {
                p.write(0, left.min(10_000) as usize);
            }
            p.read(1);
            p.read[1].len() as u64 == total && p.ends[0].all_acked()
        });
        assert!(ok, "transfer stalled at {} µs: {} of {total} bytes read", self.now, self.read[1].len());
        self.check_read(1);
    }
}

/// A fate for side 0's data datagram `seq`: its first `copies` transmissions get `fate`, every
/// other datagram is delivered.
fn first_copies(seq: u32, copies: u32, fate: Fate) -> impl FnMut(usize, &DatagramHeader, u64) -> Fate {
    let mut seen = 0;
    move |side, h, _| {
        if side == 0 && h.kind == DatagramKind::Data && h.seq == seq && seen < copies {
            seen += 1;
            return fate;
        }
        Fate::Deliver
    }
}

fn config() -> ReliableConfig {
    ReliableConfig { payload_bytes_max: 1000, ..ReliableConfig::default() }
}

#[test]
fn in_order_delivery_without_loss() {
    let mut pair = Pair::new(config(), [100, 5000], 20);
    pair.transfer(200_000, 1_000_000);
    let (a, b) = (pair.ends[0].counters(), pair.ends[1].counters());
    assert_eq!(a.data_sent, 200);
    assert_eq!((a.retransmitted_gap, a.retransmitted_timeout, a.timeouts), (0, 0, 0));
    assert_eq!((b.duplicates, b.out_of_order, b.corrupt), (0, 0, 0));
    // Acks: datagrams arriving together share one; never more than one per datagram.
    assert!(b.acks_sent >= 200 / 64 && b.acks_sent <= 200, "{b:?}");
    assert_eq!(b.stream_bytes_read, 200_000);
}

#[test]
fn without_the_payload_crc_every_datagram_says_so_and_the_stream_is_the_same() {
    let cfg = ReliableConfig { payload_crc: false, ..config() };
    let flagged = std::rc::Rc::new(std::cell::Cell::new((0u32, 0u32)));
    let seen = flagged.clone();
    let mut pair = Pair::new(cfg, [0, 0], 20).with_fate(move |_, h, _| {
        let (with, all) = seen.get();
        seen.set((with + u32::from(h.flags & flags::HEADER_CRC != 0), all + 1));
        Fate::Deliver
    });
    pair.transfer(50_000, 1_000_000);
    let (with, all) = flagged.get();
    assert!(all >= 50 && with == all, "{with} of {all} datagrams flagged HEADER_CRC");
    assert_eq!(pair.ends[1].counters().stream_bytes_read, 50_000);
    assert_eq!(pair.ends[1].counters().corrupt, 0);
}

#[test]
fn a_lost_datagram_in_the_middle_is_resent_on_the_gap() {
    let mut pair = Pair::new(config(), [0, 0], 20).with_fate(first_copies(5, 1, Fate::Drop));
    pair.transfer(20_000, 1_000_000);
    let (a, b) = (pair.ends[0].counters(), pair.ends[1].counters());
    assert_eq!((a.retransmitted_gap, a.retransmitted_timeout), (1, 0), "{a:?}");
    assert!(b.out_of_order >= 3, "{b:?}");
    assert_eq!(b.duplicates, 0);
}

#[test]
fn a_loss_among_two_datagrams_in_flight_is_resent_on_the_first_evidence() {
    // 2,000 bytes: two datagrams, the first lost. Only one younger transmission can ever be
    // acknowledged behind it, short of the threshold of 3: early retransmit resends it without
    // waiting for the timeout.
    let mut pair = Pair::new(config(), [0, 0], 20).with_fate(first_copies(0, 1, Fate::Drop));
    pair.transfer(2_000, 1_000_000);
    let a = pair.ends[0].counters();
    assert_eq!((a.retransmitted_gap, a.retransmitted_timeout, a.timeouts), (1, 0, 0), "{a:?}");
    assert!(pair.now < config().rto_min_us, "repaired in {} µs, before any timeout", pair.now);
}

#[test]
fn a_lost_last_datagram_is_resent_on_timeout() {
    let mut pair = Pair::new(config(), [0, 0], 20).with_fate(first_copies(2, 1, Fate::Drop));
    pair.transfer(3_000, 1_000_000);
    let a = pair.ends[0].counters();
    assert_eq!((a.retransmitted_gap, a.retransmitted_timeout, a.timeouts), (0, 1, 1), "{a:?}");
    // It took one timeout: at least the minimum RTO.
    assert!(pair.now >= config().rto_min_us);
}

#[test]
fn duplicated_and_reordered_datagrams_deliver_once_in_order() {
    let mut pair = Pair::new(config(), [9, 9], 20).with_fate(|side, _, n| match (side, n % 7) {
        (0, 1) => Fate::Duplicate,
        (0, 3) => Fate::Delay(100),
        (1, 4) => Fate::Duplicate,
        _ => Fate::Deliver,
    });
    pair.transfer(100_000, 10_000_000);
    let (a, b) = (pair.ends[0].counters(), pair.ends[1].counters());
    assert!(b.duplicates > 5 && b.out_of_order > 5, "{b:?}");
    assert_eq!(b.stream_bytes_read, 100_000);
    assert!(a.datagrams_received > 0);
}

#[test]
fn a_full_window_stalls_the_sender_until_the_reader_reads() {
    let cfg = ReliableConfig { send_slots: 32, recv_slots: 16, peer_window_initial: 16, ..config() };
    let mut pair = Pair::new(cfg, [0, 0], 20);
    // The reader reads nothing: the sender fills the receiver's 16 buffers, then its own 32.
    pair.run_until(100_000, |p| {
        p.write(0, 100_000);
        false
    });
    // 16 datagrams sit acknowledged in the receiver's buffers, 32 more in the sender's.
    assert_eq!(pair.written[0], 48_000, "the send buffer bounds what write takes");
    assert_eq!(pair.ends[0].in_flight(), 0, "everything sent was acknowledged");
    assert_eq!(pair.ends[0].counters().data_sent, 16, "no more than the window was sent");
    assert_eq!(pair.ends[1].counters().out_of_window, 0);
    assert!(pair.ends[0].counters().probes > 0, "a shut window is probed");
    assert_eq!(pair.ends[0].state(), State::Open, "a peer that answers probes is alive");
    // The reader drains its buffers: the window opens, and the rest flows.
    pair.transfer(100_000, 10_000_000);
}

#[test]
fn a_lost_window_update_is_recovered_by_a_probe() {
    let cfg = ReliableConfig { recv_slots: 8, peer_window_initial: 8, ..config() };
    // Drop every Ack the receiver sends between 1 ms and 3 ms (the update after the read).
    let clock = std::rc::Rc::new(std::cell::Cell::new(0u64));
    let seen = clock.clone();
    let mut pair = Pair::new(cfg, [0, 0], 20).with_fate(move |side, h, _| {
        let t = seen.get();
        if side == 1 && h.kind == DatagramKind::Ack && (1_000..3_000).contains(&t) {
            Fate::Drop
        } else {
            Fate::Deliver
        }
    });
    pair.write(0, 20_000);
    pair.run_until(1_000, |p| {
        clock.set(p.now);
        false
    });
    assert_eq!(pair.ends[0].counters().data_sent, 8);
    pair.now = 1_000;
    pair.read(1);
    let ok = pair.run_until(1_000_000, |p| {
        clock.set(p.now);
        p.read(1);
        p.read[1].len() == 20_000
    });
    assert!(ok);
    pair.check_read(1);
    assert!(pair.ends[0].counters().probes >= 1, "{:?}", pair.ends[0].counters());
}

#[test]
fn the_rtt_estimate_converges_on_the_path() {
    let mut pair = Pair::new(config(), [0, 0], 50);
    // A steady flow, one datagram at a time, acknowledged at once (ACK_NOW is not needed:
    // two in-order arrivals force an ack), so each sample is the bare round trip or that plus
    // at most one ack delay.
    for _ in 0..200 {
        pair.write(0, 2000);
        let ok = pair.run_until(pair.now + 1_000_000, |p| {
            p.read(1);
            p.ends[0].all_acked()
        });
        assert!(ok);
    }
    let a = pair.ends[0].counters();
    assert!((100..=110).contains(&a.srtt_us), "{a:?}");
    assert!(a.rttvar_us <= 10, "{a:?}");
    assert_eq!(a.rto_us, config().rto_min_us, "a short steady path sits on the minimum RTO");
    pair.check_read(1);
}

#[test]
fn a_hole_repaired_late_does_not_stretch_the_rtt_estimate() {
    // Datagram 15 of 20 is lost, and its first resend too: the second goes on the timeout,
    // hundreds of µs later. Datagrams 16..19 were selectively acknowledged long before the
    // cumulative ack passes them; their wait behind the repair is no round trip of the path.
    let mut pair = Pair::new(config(), [0, 0], 50).with_fate(first_copies(15, 2, Fate::Drop));
    pair.transfer(20_000, 1_000_000);
    let a = pair.ends[0].counters();
    assert_eq!(a.timeouts, 1, "the second loss waited for the timeout: {a:?}");
    assert!((100..=130).contains(&a.srtt_us), "a 100 µs path: {a:?}");
}

#[test]
fn a_datagram_its_burst_overtook_is_resent_on_the_reordering_timer_not_the_timeout() {
    // A bundle's reordering window (100 µs) excuses a datagram overtaken by datagrams sent
    // right after it. Datagram 25 (of a burst from 2 on) is lost: a round trip plus the window
    // after it left, it is taken as lost and sent again, long before the 5 ms timeout.
    let cfg = ReliableConfig { reorder_window_us: 100, rto_min_us: 5_000, rto_initial_us: 5_000, ..config() };
    let mut pair = Pair::new(cfg, [0, 0], 50).with_fate(first_copies(25, 1, Fate::Drop));
    // A first exchange gives the sender its round-trip estimate; the burst follows at once.
    pair.transfer(2_000, 1_000_000);
    let start = pair.now;
    pair.write(0, 10_000);
    pair.step();
    pair.transfer(40_000, 1_000_000);
    let a = pair.ends[0].counters();
    assert_eq!((a.retransmitted_gap, a.retransmitted_timeout, a.timeouts), (1, 0, 0), "{a:?}");
    assert!(pair.now - start < 1_000, "repaired in {} µs", pair.now - start);
}

#[test]
fn the_rto_backs_off_and_follows_a_slower_path() {
    let cfg = ReliableConfig { rto_min_us: 10, ack_delay_us: 5, ..config() };
    let mut pair = Pair::new(cfg, [0, 0], 2_000);
    pair.transfer(50_000, 10_000_000);
    let a = pair.ends[0].counters();
    // The initial 2 ms RTO is shorter than the 4 ms round trip: it expires and doubles
    // (Karn: the datagrams sent twice give no sample), then the samples of the later ones
    // set it above the round trip and it never expires again.
    assert!((1..=2).contains(&a.timeouts) && a.retransmitted_timeout > 0, "{a:?}");
    assert!(a.srtt_us >= 4_000 && a.srtt_us <= 4_010, "{a:?}");
    assert!(a.rto_us > a.srtt_us, "{a:?}");
    let before = a.timeouts;
    pair.transfer(100_000, 100_000_000);
    assert_eq!(pair.ends[0].counters().timeouts, before);
}

#[test]
fn a_dead_peer_is_declared_within_the_bound() {
    let cfg = config();
    let clock = std::rc::Rc::new(std::cell::Cell::new(0u64));
    let seen = clock.clone();
    let mut pair =
        Pair::new(cfg, [0, 0], 20)
            .with_fate(move |_, _, _| if seen.get() >= 500 { Fate::Drop } else { Fate::Deliver });
    let ok = pair.run_until(10_000_000, |p| {
        clock.set(p.now);
        if p.now < 500 || p.written[0] < 100_000 {
            p.write(0, 1_000);
        }
        p.read(1);
        matches!(p.ends[0].state(), State::Dead(_))
    });
    assert!(ok, "never declared dead");
    assert_eq!(pair.ends[0].state(), State::Dead(DeadReason::Timeout(cfg.backoffs_max)));
    assert!(pair.now <= 500 + cfg.dead_after_us_max(), "dead at {} µs", pair.now);
    assert_eq!(pair.ends[0].counters().timeouts, u64::from(cfg.backoffs_max) + 1);
    assert_eq!(pair.ends[0].poll_timeout(), None);
    assert_eq!(pair.ends[0].write(&[IoSlice::new(b"x")]), 0);
    // The receiver, which has nothing to send, learns it from its keepalive probes.
    // It last heard from the sender just after 500 µs (the latency is 20 µs).
    let last_heard = 520;
    let ok = pair.run_until(10_000_000, |p| matches!(p.ends[1].state(), State::Dead(_)));
    assert!(ok);
    assert_eq!(pair.ends[1].state(), State::Dead(DeadReason::Timeout(cfg.backoffs_max)));
    assert!(pair.now <= last_heard + cfg.keepalive_us + cfg.dead_after_us_max(), "dead at {} µs", pair.now);
}

#[test]
fn without_keepalives_an_idle_stream_never_dies() {
    let cfg = ReliableConfig { keepalive_us: 0, ..config() };
    let mut pair = Pair::new(cfg, [0, 0], 20).with_fate(|_, _, _| Fate::Drop);
    assert!(!pair.run_until(100_000_000, |p| p.ends.iter().any(|e| e.state() != State::Open)));
    assert_eq!(pair.ends.map(|e| e.poll_timeout()), [None, None]);
}

#[test]
fn sequence_numbers_wrap_around() {
    let start = [u32::MAX - 20, u32::MAX - 3];
    let mut pair =
        Pair::new(config(), start, 20)
            .with_fate(|_, _, n| if n % 11 == 5 { Fate::Drop } else { Fate::Deliver });
    // Both directions at once, past the wrap.
    let total = 150_000u64;
    let ok = pair.run_until(100_000_000, |p| {
        for side in 0..2 {
            let left = total - p.written[side];
            if left > 0 {
                p.write(side, left.min(3_333) as usize);
            }
            p.read(side);
        }
        p.read[0].len() as u64 == total
            && p.read[1].len() as u64 == total
            && p.ends.iter().all(|e| e.all_acked())
    });
    assert!(ok);
    pair.check_read(0);
    pair.check_read(1);
    for end in &pair.ends {
        let c = end.counters();
        assert!(c.retransmitted_gap + c.retransmitted_timeout > 0, "{c:?}");
    }
    assert!(seq_lt(u32::MAX, 0) && !seq_lt(0, u32::MAX) && seq_lt(u32::MAX - 5, 3));
}

#[test]
fn close_ends_the_stream_after_every_byte_and_reset_kills_it() {
    let mut pair =
        Pair::new(config(), [1, 2], 20)
            .with_fate(|_, _, n| if n % 4 == 1 { Fate::Drop } else { Fate::Deliver });
    pair.write(0, 5_000);
    pair.write(1, 3_000);
    pair.ends[0].close();
    pair.ends[1].close();
    assert_eq!(pair.ends[0].write(&[IoSlice::new(b"late")]), 0, "nothing after close");
    let ok = pair.run_until(10_000_000, |p| {
        p.read(0);
        p.read(1);
        p.ends.iter().all(|e| e.state() == State::Closed)
    });
    assert!(ok, "{:?} {:?}", pair.ends[0].state(), pair.ends[1].state());
    assert_eq!((pair.read[0].len(), pair.read[1].len()), (3_000, 5_000));
    pair.check_read(0);
    pair.check_read(1);
    assert!(pair.ends[0].peer_closed() && pair.ends[1].peer_closed());
    // Closed streams expect nothing more: no keepalives, no timers, once the last acks settle.
    pair.run_until(10_000_000, |_| false);
    assert_eq!(pair.ends.each_ref().map(|e| (e.state(), e.poll_timeout())), [(State::Closed, None); 2]);

    let mut pair = Pair::new(config(), [1, 2], 20);
    pair.write(0, 500);
    pair.run_until(1_000, |p| p.read(1) > 0);
    pair.ends[0].reset();
    pair.run_until(1_000_000, |_| false);
    assert_eq!(pair.ends[0].state(), State::Dead(DeadReason::LocalReset));
    assert_eq!(pair.ends[1].state(), State::Dead(DeadReason::PeerReset));
    assert_eq!(pair.ends[1].poll_timeout(), None);
}

#[test]
fn corrupt_foreign_and_bogus_datagrams_are_counted_and_ignored() {
    let cfg = config();
    let mut a = DatagramStream::new(&cfg, 1, 0, 0);
    let mut b = DatagramStream::new(&cfg, 1, 0, 0);
    let mut other = DatagramStream::new(&cfg, 2, 0, 0);
    let mut buf = vec![0u8; cfg.datagram_len_max()];
    a.write(&[IoSlice::new(b"hello")]);
    let n = a.poll_transmit(0, &mut buf).unwrap();
    let good = buf[..n].to_vec();
    let mut flipped = good.clone();
    flipped[30] ^= 4;
    b.handle_datagram(1, &flipped);
    b.handle_datagram(1, &good[..10]);
    other.handle_datagram(1, &good);
    assert_eq!((b.counters().corrupt, other.counters().wrong_session), (2, 1));
    assert!(!b.readable() && !other.readable());
    // An ack of a sequence number never sent is dropped whole, data and all.
    other.write(&[IoSlice::new(b"x")]);
    let mut bogus = DatagramStream::new(&cfg, 1, 0, 0);
    bogus.rcv_nxt = 50;
    bogus.write(&[IoSlice::new(b"x")]);
    let n = bogus.poll_transmit(0, &mut buf).unwrap();
    b.handle_datagram(1, &buf[..n]);
    assert_eq!(b.counters().ignored, 1);
    b.handle_datagram(2, &good);
    let mut got = [0u8; 16];
    assert_eq!(b.read(&mut [IoSliceMut::new(&mut got)]), 5);
    assert_eq!(&got[..5], b"hello");
    b.handle_datagram(3, &good);
    assert_eq!(b.counters().duplicates, 1);
    assert_eq!(b.read(&mut [IoSliceMut::new(&mut got)]), 0, "delivered exactly once");
}

#[test]
fn discovery_datagrams_are_no_session_business_even_with_its_id() {
    use wire::datagram::DatagramKind;
    let cfg = config();
    let mut a = DatagramStream::new(&cfg, 9, 0, 0);
    let mut buf = vec![0u8; cfg.datagram_len_max()];
    for kind in [DatagramKind::Discover, DatagramKind::Offer] {
        // A query id equal to the session id, and an ack that would otherwise be bogus.
        let h = DatagramHeader {
            kind,
            flags: 0,
            session_id: 9,
            seq: 0,
            ack: 40,
            sack: 0,
            window: 0,
            payload_len: 0,
        };
        let n = h.emit(&mut buf);
        a.handle_datagram(1, &buf[..n]);
    }
    assert_eq!(a.counters().ignored, 2);
    assert_eq!(a.state(), State::Open);
    // The session goes on as if nothing came.
    a.write(&[IoSlice::new(b"still here")]);
    assert!(a.poll_transmit(2, &mut buf).is_some());
}

#[test]
fn a_reordering_window_keeps_datagrams_overtaken_by_their_burst_from_being_resent() {
    // Datagram 5 is held back 300 µs, so those after it overtake it. Without a reordering
    // window the overtaking alone marks it lost and sends it again for nothing; with one (as
    // a bundle of links sets) it is lost only if datagrams sent well after it arrive first.
    let run = |window: u64| {
        let config = ReliableConfig { reorder_window_us: window, ..config() };
        let mut pair = Pair::new(config, [0, 0], 20).with_fate(first_copies(5, 1, Fate::Delay(300)));
        pair.transfer(20_000, 1_000_000);
        (pair.ends[0].counters(), pair.ends[1].counters())
    };
    let (a, _) = run(0);
    assert_eq!(a.retransmitted_gap, 1, "{a:?}");
    let (a, b) = run(1_000);
    assert_eq!((a.retransmitted_gap, a.retransmitted_timeout), (0, 0), "{a:?}");
    assert_eq!(b.duplicates, 0, "{b:?}");
    assert!(b.out_of_order >= 3, "{b:?}");
}

#[test]
fn duplicates_reported_back_widen_the_reordering_window_until_reordering_costs_nothing() {
    // Every 10th data datagram is held back 150 µs on a 200 µs path: reordering that looks
    // like loss to a sender with no reordering window (a single link's default). Those of the
    // first round trip are sent again for nothing; the receiver flags its next datagram
    // DUPLICATE, the sender widens its window, and from then on reordering is left alone.
    let delayed = std::rc::Rc::new(std::cell::Cell::new(0u64));
    let seen = std::rc::Rc::new(std::cell::RefCell::new(std::collections::HashSet::new()));
    let (d, s) = (delayed.clone(), seen.clone());
    let mut pair = Pair::new(config(), [0, 0], 200).with_fate(move |side, h, _| {
        if side == 0 && h.kind == DatagramKind::Data && h.seq % 10 == 5 && s.borrow_mut().insert(h.seq) {
            d.set(d.get() + 1);
            return Fate::Delay(150);
        }
        Fate::Deliver
    });
    let total = 2_000_000u64;
    let mut before_first_dsack = None;
    let done = pair.run_until(100_000_000, |p| {
        let left = total - p.written[0];
        if left > 0 {
            p.write(0, left.min(10_000) as usize);
        }
        p.read(1);
        let c = p.ends[0].counters();
        if c.dsacks_received > 0 && before_first_dsack.is_none() {
            before_first_dsack = Some((c.retransmitted_gap, p.now));
        }
        p.read[1].len() as u64 == total && p.ends[0].all_acked()
    });
    assert!(done, "the transfer finished");
    pair.check_read(1);
    let (a, b) = (pair.ends[0].counters(), pair.ends[1].counters());
    let (resent, at) = before_first_dsack.expect("the receiver reported its duplicates");
    assert!(delayed.get() >= 150, "{}", delayed.get());
    assert!(
        resent > 0 && at < 2 * 450,
        "spurious resends before the first DSACK, within two round trips: {resent} by {at} µs"
    );
    assert_eq!(a.retransmitted_gap, resent, "none after it: {a:?}");
    assert_eq!(b.duplicates, a.retransmitted_gap + a.retransmitted_timeout, "every resend was a duplicate");
    assert!(a.reorder_window_us >= 150, "{a:?}");
}

#[test]
fn duplicates_the_network_makes_leave_the_reordering_window_alone() {
    // Every 7th data datagram of the sender arrives twice (first transmissions only), and one
    // is lost: the receiver drops the copies and acknowledges them, but only a gap resend it
    // already had (flagged GAP_RESEND) would be reported DUPLICATE. The window stays off, and
    // the loss is repaired on the gap.
    let mut seen = std::collections::HashSet::new();
    let mut pair = Pair::new(config(), [0, 0], 50).with_fate(move |side, h, _| {
        if side != 0 || h.kind != DatagramKind::Data || !seen.insert(h.seq) {
            return Fate::Deliver;
        }
        match h.seq {
            40 => Fate::Drop,
            seq if seq % 7 == 3 => Fate::Duplicate,
            _ => Fate::Deliver,
        }
    });
    pair.transfer(200_000, 10_000_000);
    let (a, b) = (pair.ends[0].counters(), pair.ends[1].counters());
    assert!(b.duplicates >= 25, "{b:?}");
    assert_eq!((a.dsacks_received, a.reorder_window_us), (0, 0), "{a:?}");
    assert_eq!((a.retransmitted_gap, a.retransmitted_timeout), (1, 0), "{a:?}");
}

#[test]
fn a_resend_that_overtook_its_late_original_is_reported_when_the_original_comes() {
    // No reordering window: datagram 5, held back 300 µs on a 20 µs path, is overtaken by its
    // burst and sent again on the gap. The resend arrives first; the late original is the
    // duplicate, and carries no flag of its own. The receiver remembers that the copy it took
    // was a gap resend and reports DUPLICATE, and the sender widens its window.
    let mut pair = Pair::new(config(), [0, 0], 20).with_fate(first_copies(5, 1, Fate::Delay(300)));
    pair.transfer(20_000, 1_000_000);
    // Everything is acknowledged before the original arrives: let it come.
    pair.run_until(pair.now + 2_000, |_| false);
    let (a, b) = (pair.ends[0].counters(), pair.ends[1].counters());
    assert_eq!((a.retransmitted_gap, b.duplicates), (1, 1), "{a:?} {b:?}");
    assert_eq!(a.dsacks_received, 1, "{a:?}");
    assert!(a.reorder_window_us > 0, "{a:?}");
}

#[test]
fn reordering_shallower_than_the_threshold_costs_nothing_without_a_window() {
    // No reordering window. Four datagrams leave a microsecond apart; the second arrives
    // before the first, which is 2 µs late: overtaken by one datagram, fewer than the
    // threshold. Its ack reaches the sender a round trip after the first left, and nothing
    // is taken as lost: not on the gap, and not on the reordering timer either.
    let cfg = ReliableConfig { ack_every: 1, ..config() };
    let (mut a, mut b) = (DatagramStream::new(&cfg, 7, 0, 0), DatagramStream::new(&cfg, 7, 0, 0));
    let mut buf = vec![0; cfg.datagram_len_max()];
    let mut send = |from: &mut DatagramStream, now: u64| {
        let n = from.poll_transmit(now, &mut buf).expect("a datagram to send");
        buf[..n].to_vec()
    };
    // A first round trip of 100 µs gives the sender its estimate.
    a.write(&[IoSlice::new(&[1; 1000])]);
    let d = send(&mut a, 0);
    b.handle_datagram(50, &d);
    let ack = send(&mut b, 50);
    a.handle_datagram(100, &ack);
    assert_eq!(a.counters().srtt_us, 100);
    let burst: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            a.write(&[IoSlice::new(&[2; 1000])]);
            send(&mut a, 200 + i)
        })
        .collect();
    b.handle_datagram(251, &burst[1]);
    let ack = send(&mut b, 251);
    b.handle_datagram(252, &burst[0]);
    a.handle_datagram(301, &ack);
    a.handle_timeout(301);
    while a.poll_transmit(301, &mut buf).is_some() {}
    let c = a.counters();
    assert_eq!((c.retransmitted_gap, c.retransmitted_timeout), (0, 0), "{c:?}");
    assert_eq!(b.counters().out_of_order, 1);
}

/// `handle_datagram_into` places only what is next in order with nothing unread before it:
/// the rest waits in the receive buffer, and every byte is read once, in order.
#[test]
fn in_order_datagrams_are_placed_straight_into_the_readers_buffers() {
    let cfg = ReliableConfig { payload_bytes_max: 100, ..config() };
    let (mut a, mut b) = (DatagramStream::new(&cfg, 7, 5, 9), DatagramStream::new(&cfg, 7, 9, 5));
    let sent: Vec<u8> = (0..300).map(|i| pattern(0, i)).collect();
    assert_eq!(a.write(&[IoSlice::new(&sent)]), 300);
    let mut buf = vec![0; cfg.datagram_len_max()];
    let mut datagrams = Vec::new();
    while let Some(n) = a.poll_transmit(0, &mut buf) {
        datagrams.push(buf[..n].to_vec());
    }
    assert_eq!(datagrams.len(), 3);

    let mut got = [0u8; 400];
    let (first, rest) = got.split_at_mut(120);
    let (second, third) = rest.split_at_mut(130);
    let mut pieces = [IoSliceMut::new(first), IoSliceMut::new(second)];
    let mut to = ReadCursor::new(&mut pieces);
    // Out of order: buffered, not placed.
    assert_eq!(b.handle_datagram_into(10, &datagrams[1], &mut to), 0);
    // The first: placed whole. The second now waits in the buffer, behind nothing.
    assert_eq!(b.handle_datagram_into(11, &datagrams[0], &mut to), 100);
    assert_eq!(b.read_into(&mut to), 100);
    // The third: half of it fits.
    assert_eq!(b.handle_datagram_into(12, &datagrams[2], &mut to), 50);
    assert!(to.is_full());
    assert_eq!(to.filled(), 250);
    // A copy of the first is a duplicate, placed nowhere.
    let mut more = [IoSliceMut::new(third)];
    let mut to = ReadCursor::new(&mut more);
    assert_eq!(b.handle_datagram_into(13, &datagrams[0], &mut to), 0);
    assert_eq!(b.read_into(&mut to), 50);
    assert_eq!(b.read_into(&mut to), 0);
    assert_eq!(&got[..300], &sent[..]);
    let c = b.counters();
    assert_eq!((c.stream_bytes_read, c.stream_bytes_placed, c.duplicates, c.out_of_order), (300, 150, 1, 1));

    // A Close is never placed: the end of the stream is read after every byte, as ever.
    a.handle_datagram(20, &{
        let n = b.poll_transmit(20, &mut buf).expect("b owes an ack");
        buf[..n].to_vec()
    });
    a.close();
    let n = a.poll_transmit(21, &mut buf).expect("the Close");
    let mut room = [0u8; 10];
    let mut pieces = [IoSliceMut::new(&mut room)];
    let mut to = ReadCursor::new(&mut pieces);
    assert_eq!(b.handle_datagram_into(22, &buf[..n], &mut to), 0);
    assert!(!b.peer_closed());
    assert_eq!(b.read_into(&mut to), 0);
    assert!(b.peer_closed());
}

/// A side that gives its peer up for dead says so with one Reset: a peer that was alive but
/// not listening (an initiator whose application left it idle) finds it on its next look and
/// starts a new session at once, instead of backing off on a session that is gone.
#[test]
fn death_by_timeout_sends_one_reset_and_the_peer_takes_it() {
    let cfg = ReliableConfig { keepalive_us: 1_000, ..config() };
    let (mut a, mut b) = (DatagramStream::new(&cfg, 7, 0, 0), DatagramStream::new(&cfg, 7, 0, 0));
    let mut buf = vec![0; cfg.datagram_len_max()];
    assert_eq!(a.write(&[IoSlice::new(b"hello")]), 5);
    let n = a.poll_transmit(0, &mut buf).expect("the data");
    b.handle_datagram(10, &buf[..n]);
    let n = b.poll_transmit(200, &mut buf).expect("b's ack");
    a.handle_datagram(210, &buf[..n]);
    // b goes quiet: a's keepalives go unanswered until it gives b up.
    let mut now = 210;
    let mut resets = Vec::new();
    while !matches!(a.state(), State::Dead(_)) {
        now = a.poll_timeout().expect("a keeps a timer until it dies");
        a.handle_timeout(now);
        while let Some(n) = a.poll_transmit(now, &mut buf) {
            let (h, _) = DatagramHeader::parse(&buf[..n]).unwrap();
            if h.kind == DatagramKind::Reset {
                resets.push(buf[..n].to_vec());
            }
        }
        assert!(now < 10_000_000, "a never gave up");
    }
    assert!(matches!(a.state(), State::Dead(DeadReason::Timeout(_))));
    assert_eq!(resets.len(), 1, "one Reset, at death");
    assert_eq!(a.poll_transmit(now, &mut buf), None, "nothing after it");
    b.handle_datagram(now + 10, &resets[0]);
    assert_eq!(b.state(), State::Dead(DeadReason::PeerReset));
}

/// Segments a placer received: (tag, offset, bytes).
type Placed = Vec<(u32, u32, Vec<u8>)>;

fn collect_segments(into: &mut Placed) -> impl FnMut(&[u8]) + '_ {
    |payload| {
        for seg in PlaceSegment::parse_all(payload) {
            let seg = seg.expect("a stream emits well-formed segments");
            into.push((seg.tag, seg.offset, seg.bytes.to_vec()));
        }
    }
}

#[test]
fn data_messages_batch_two_to_a_datagram_and_are_placed_on_arrival_in_any_order() {
    // Room for two 400-byte segments and a tail's count.
    let room = 2 * (PLACE_SEGMENT_HEADER_LEN + 400) + STREAM_TAIL_COUNT_LEN;
    let cfg = ReliableConfig { payload_bytes_max: room as u16, ..config() };
    let mut a = DatagramStream::new(&cfg, 7, 0, 0);
    let mut b = DatagramStream::new(&cfg, 7, 0, 0);
    assert_eq!(a.place_segment_max(), 2 * 400 + PLACE_SEGMENT_HEADER_LEN + STREAM_TAIL_COUNT_LEN);
    // A frame's head on the stream, then its data as messages: two to a datagram with batching,
    // the third alone (and the fourth, unbatched); then more stream bytes, which ride in the
    // last Place datagram as its tail, and after which no segment joins it.
    assert_eq!(a.write(&[IoSlice::new(b"head")]), 4);
    for (tag, fill) in [(1u32, 0xA1u8), (2, 0xA2), (3, 0xA3)] {
        assert!(a.write_place(tag, 0, &[fill; 400], true));
    }
    assert!(a.write_place(4, 800, &[0xA4; 400], false), "unbatched: a datagram of its own");
    assert_eq!(a.write(&[IoSlice::new(b"tail")]), 4);
    assert!(a.write_place(6, 0, &[0xA6; 1], true), "after a tail: a datagram of its own");
    assert!(!a.write_place(5, 0, &[0; 815], true), "longer than a segment can be");
    assert!(!a.write_place(5, 0, &[], true));
    let mut datagrams = Vec::new();
    let mut out = vec![0u8; cfg.datagram_len_max()];
    while let Some(n) = a.poll_transmit(0, &mut out) {
        datagrams.push(out[..n].to_vec());
    }
    let kinds: Vec<_> = datagrams.iter().map(|d| DatagramHeader::parse(d).unwrap().0.kind).collect();
    use DatagramKind::{Data, Place};
    assert_eq!(kinds, [Data, Place, Place, Place, Place]);
    let tails: Vec<bool> = datagrams
        .iter()
        .map(|d| DatagramHeader::parse(d).unwrap().0.flags & flags::STREAM_TAIL != 0)
        .collect();
    assert_eq!(tails, [false, false, false, true, false]);
    assert_eq!(a.counters().places_sent, 4);

    // The receiver gets them backwards: each data message reaches the placer as it arrives,
    // the stream bytes only in order.
    let mut placed = Placed::new();
    let mut stream = [0u8; 16];
    let mut got = 0;
    for d in datagrams.iter().rev() {
        let mut place = collect_segments(&mut placed);
        let mut bufs = [IoSliceMut::new(&mut stream[got..])];
        let mut to = ReadCursor::placing(&mut bufs, &mut place);
        got += b.handle_datagram_into(1, d, &mut to);
        got += b.read_into(&mut to);
    }
    assert_eq!(&stream[..got], b"headtail");
    let tags: Vec<u32> = placed.iter().map(|p| p.0).collect();
    assert_eq!(tags, [6, 4, 3, 1, 2], "in arrival order, each once");
    assert_eq!(placed[1], (4, 800, vec![0xA4; 400]));
    let c = b.counters();
    assert_eq!((c.places_received, c.places_held, c.stream_bytes_read), (4, 0, 8));
}

#[test]
fn data_messages_that_arrive_with_no_placer_wait_for_one_and_a_reader_without_stops_at_them() {
    let mut a = DatagramStream::new(&config(), 7, 0, 0);
    assert!(a.write_place(9, 0, b"early", true));
    // Stream bytes after a data message ride in it as its tail.
    assert_eq!(a.write(&[IoSlice::new(b"stream")]), 6);
    assert!(a.write_place(9, 5, b"late", true));
    let mut out = vec![0u8; config().datagram_len_max()];
    let mut datagrams = Vec::new();
    while let Some(n) = a.poll_transmit(0, &mut out) {
        datagrams.push(out[..n].to_vec());
    }
    assert_eq!(datagrams.len(), 2);
    // Taken in with no reader (a driver's timer pass): held.
    let mut b = DatagramStream::new(&config(), 7, 0, 0);
    for d in &datagrams {
        b.handle_datagram(1, d);
    }
    // A reader without a placer (a lane waiting for room to send) stops at the first: neither
    // its segments nor the stream bytes behind them are taken.
    let mut stream = [0u8; 16];
    assert_eq!(b.read(&mut [IoSliceMut::new(&mut stream)]), 0);
    assert!(b.readable());
    // The next reader with a placer takes everything, in order.
    let mut placed = Placed::new();
    let n = {
        let mut place = collect_segments(&mut placed);
        let mut bufs = [IoSliceMut::new(&mut stream)];
        b.read_into(&mut ReadCursor::placing(&mut bufs, &mut place))
    };
    assert_eq!(&stream[..n], b"stream");
    assert_eq!(placed, [(9, 0, b"early".to_vec()), (9, 5, b"late".to_vec())]);
    assert_eq!(b.counters().places_held, 2);
    assert!(!b.readable());
}

#[test]
fn data_messages_through_loss_duplication_and_delay_are_placed_exactly_once() {
    // Side 0 interleaves stream bytes and data messages; side 1 reads with a placer. Every
    // fifth datagram of side 0 is dropped once, every seventh duplicated, every eleventh late.
    let mut pair = Pair::new(config(), [3, u32::MAX - 2], 50).with_fate(|side, _, n| match (side, n) {
        (0, n) if n % 5 == 0 => Fate::Drop,
        (0, n) if n % 7 == 0 => Fate::Duplicate,
        (0, n) if n % 11 == 0 => Fate::Delay(400),
        _ => Fate::Deliver,
    });
    let mut placed = Placed::new();
    let (mut next_tag, total_tags) = (0u32, 300u32);
    let ok = pair.run_until(10_000_000, |p| {
        while next_tag < total_tags
            && p.ends[0].write_place(next_tag, next_tag * 3, &next_tag.to_le_bytes(), true)
        {
            p.write(0, 37);
            next_tag += 1;
        }
        let mut stream = [0u8; 4096];
        let mut place = collect_segments(&mut placed);
        let mut bufs = [IoSliceMut::new(&mut stream)];
        let n = p.ends[1].read_into(&mut ReadCursor::placing(&mut bufs, &mut place));
        p.read[1].extend_from_slice(&stream[..n]);
        next_tag == total_tags && p.ends[0].all_acked()
    });
    assert!(ok, "stalled with {} of {total_tags} data messages placed", placed.len());
    pair.check_read(1);
    assert_eq!(pair.read[1].len() as u64, pair.written[0]);
    placed.sort();
    let want: Placed = (0..total_tags).map(|t| (t, t * 3, t.to_le_bytes().to_vec())).collect();
    assert_eq!(placed, want);
    let (a, b) = (pair.ends[0].counters(), pair.ends[1].counters());
    assert!(a.retransmitted_gap + a.retransmitted_timeout > 0 && b.duplicates > 0, "{a:?} {b:?}");
}
