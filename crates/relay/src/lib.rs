//! A fault relay: an Ethernet bridge between two interfaces that drops, duplicates, reorders
//! and corrupts frames at seeded rates, so that reliable delivery is tested on real frames
//! (this kernel has no netem). `skiff relay` runs it, typically in a namespace between a
//! client's veth pair and a target's.
//!
//! Every frame of the bridged EtherType that arrives on one side leaves on the other, as it
//! came (both MAC addresses kept), unless its fate says otherwise. The fates are drawn from a
//! seeded generator in the order frames arrive, per direction, so a run with the same seed
//! and the same frames makes the same decisions.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use eth::packet::{PacketSocket, ETH_HEADER_LEN};

/// Rates of each fault, from 0 to 1, applied to every frame in both directions.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FaultRates {
    /// Dropped.
    pub drop: f64,
    /// Sent twice.
    pub duplicate: f64,
    /// Held back and sent after the next frame in its direction, or after [`HOLD_MAX`] if no
    /// frame comes by then (a network reorders; it does not keep a frame until traffic resumes).
    pub reorder: f64,
    /// One bit of the payload (after the Ethernet header) flipped.
    pub corrupt: f64,
}

impl FaultRates {
    pub fn check(&self) -> Result<(), String> {
        for (name, v) in [
            ("drop", self.drop),
            ("duplicate", self.duplicate),
            ("reorder", self.reorder),
            ("corrupt", self.corrupt),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{name} rate {v} is not between 0 and 1"));
            }
        }
        Ok(())
    }
}

/// Longest a frame held back for reordering waits for the next one.
pub const HOLD_MAX: Duration = Duration::from_micros(200);

/// What happened to the frames of one direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirectionCounters {
    pub received: u64,
    pub forwarded: u64,
    pub dropped: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub corrupted: u64,
    /// Frames lost because the outgoing ring stayed full.
    pub overflowed: u64,
    /// Frames not forwarded because they exceed the outgoing interface's MTU (a segmentation
    /// offload left on at a sender: the relay forwards frames, not super-packets).
    pub oversized: u64,
}

/// The fate of one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Drop,
    /// Forward, perhaps twice, perhaps after the next frame, perhaps with bit `flip` of the
    /// payload inverted.
    Forward {
        twice: bool,
        hold: bool,
        flip: Option<usize>,
    },
}

/// A seeded source of fates (splitmix64: small, fast, and the same on every machine).
#[derive(Debug, Clone)]
pub struct Fates {
    state: u64,
    rates: FaultRates,
}

impl Fates {
    pub fn new(seed: u64, rates: FaultRates) -> Fates {
        Fates { state: seed, rates }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    /// The fate of a frame whose payload is `payload_len` bytes.
    pub fn decide(&mut self, payload_len: usize) -> Fate {
        let r = self.rates;
        if self.chance(r.drop) {
            return Fate::Drop;
        }
        let twice = self.chance(r.duplicate);
        let hold = self.chance(r.reorder);
        let flip = (self.chance(r.corrupt) && payload_len > 0)
            .then(|| (self.next_u64() % (payload_len as u64 * 8)) as usize);
        Fate::Forward { twice, hold, flip }
    }
}

/// One direction of the bridge: frames from `from` go out on the other socket.
struct Direction {
    fates: Fates,
    counters: DirectionCounters,
    /// A frame held back to go after the next one (whether it goes twice, and when it goes at
    /// the latest).
    held: Option<(Vec<u8>, bool, Instant)>,
    scratch: Vec<u8>,
}

impl Direction {
    /// Apply fates to what `from` received and queue the survivors on `to`.
    fn pump(&mut self, from: &mut PacketSocket, to: &mut PacketSocket) -> io::Result<usize> {
        let mut out: Vec<(Vec<u8>, bool)> = Vec::new();
        let frame_max = ETH_HEADER_LEN + to.mtu();
        let n = from.receive_frames(|frame| {
            self.counters.received += 1;
            if frame.len() > frame_max {
                self.counters.oversized += 1;
                return;
            }
            match self.fates.decide(frame.len().saturating_sub(ETH_HEADER_LEN)) {
                Fate::Drop => self.counters.dropped += 1,
                Fate::Forward { twice, hold, flip } => {
                    self.scratch.clear();
                    self.scratch.extend_from_slice(frame);
                    if let Some(bit) = flip {
                        self.scratch[ETH_HEADER_LEN + bit / 8] ^= 1 << (bit % 8);
                        self.counters.corrupted += 1;
                    }
                    if twice {
                        self.counters.duplicated += 1;
                    }
                    let frame = self.scratch.clone();
                    if hold && self.held.is_none() {
                        self.counters.reordered += 1;
                        self.held = Some((frame, twice, Instant::now() + HOLD_MAX));
                        return;
                    }
                    out.push((frame, twice));
                    out.extend(self.held.take().map(|(h, twice, _)| (h, twice)));
                }
            }
        });
        for (frame, twice) in out {
            self.forward(to, &frame, twice)?;
        }
        to.flush()?;
        Ok(n)
    }

    fn forward(&mut self, to: &mut PacketSocket, frame: &[u8], twice: bool) -> io::Result<()> {
        for _ in 0..if twice { 2 } else { 1 } {
            if send(to, frame)? {
                self.counters.forwarded += 1;
            } else {
                self.counters.overflowed += 1;
            }
        }
        Ok(())
    }

    /// Send the held frame if its time is up (or `force`).
    fn release(&mut self, to: &mut PacketSocket, force: bool) -> io::Result<()> {
        if self.held.as_ref().is_some_and(|(_, _, until)| force || Instant::now() >= *until) {
            let (frame, twice, _) = self.held.take().expect("checked");
            self.forward(to, &frame, twice)?;
            to.flush()?;
        }
        Ok(())
    }

    /// How long until the held frame must go.
    fn hold_left(&self) -> Option<Duration> {
        self.held.as_ref().map(|(_, _, until)| until.saturating_duration_since(Instant::now()))
    }
}

/// Queue a frame, waiting a little for room if the ring is full. Returns whether it went.
fn send(to: &mut PacketSocket, frame: &[u8]) -> io::Result<bool> {
    for _ in 0..1000 {
        if to.queue_frame(frame)? {
            return Ok(true);
        }
        to.flush()?;
        std::thread::sleep(Duration::from_micros(50));
    }
    Ok(false)
}

/// Bridge `left` and `right` until `stop` is set, with `rates` of faults drawn from `seed`
/// (the right-to-left direction from `seed + 1`). Returns the counters of (left to right,
/// right to left). A frame still held back for reordering when the relay stops is sent then.
pub fn run(
    mut left: PacketSocket,
    mut right: PacketSocket,
    rates: FaultRates,
    seed: u64,
    stop: &AtomicBool,
    mut report: impl FnMut(&DirectionCounters, &DirectionCounters),
) -> io::Result<(DirectionCounters, DirectionCounters)> {
    rates.check().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let new = |seed| Direction {
        fates: Fates::new(seed, rates),
        counters: DirectionCounters::default(),
        held: None,
        scratch: Vec::new(),
    };
    let (mut lr, mut rl) = (new(seed), new(seed.wrapping_add(1)));
    let mut last_report = std::time::Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let moved = lr.pump(&mut left, &mut right)? + rl.pump(&mut right, &mut left)?;
        lr.release(&mut right, false)?;
        rl.release(&mut left, false)?;
        if moved == 0 {
            // Sleep until either side has frames, a held frame must go, or a tenth of a
            // second passes (to see `stop`).
            let wait = [lr.hold_left(), rl.hold_left(), Some(Duration::from_millis(100))]
                .into_iter()
                .flatten()
                .min();
            let _ = transport::wait_readable2(left.as_raw_fd(), right.as_raw_fd(), wait)?;
        }
        if last_report.elapsed() >= Duration::from_secs(1) {
            report(&lr.counters, &rl.counters);
            last_report = std::time::Instant::now();
        }
    }
    lr.release(&mut right, true)?;
    rl.release(&mut left, true)?;
    Ok((lr.counters, rl.counters))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fates_follow_the_seed_and_the_rates() {
        let rates = FaultRates { drop: 0.1, duplicate: 0.05, reorder: 0.05, corrupt: 0.02 };
        let draw = |seed| {
            let mut f = Fates::new(seed, rates);
            (0..20_000).map(|_| f.decide(100)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7), "the same seed makes the same decisions");
        assert_ne!(draw(7), draw(8));
        let fates = draw(7);
        let share = |pred: &dyn Fn(&Fate) -> bool| {
            fates.iter().filter(|f| pred(f)).count() as f64 / fates.len() as f64
        };
        let near = |got: f64, want: f64| (got - want).abs() < want * 0.2 + 0.002;
        assert!(near(share(&|f| *f == Fate::Drop), 0.1));
        assert!(near(share(&|f| matches!(f, Fate::Forward { twice: true, .. })), 0.05 * 0.9));
        assert!(near(share(&|f| matches!(f, Fate::Forward { hold: true, .. })), 0.05 * 0.9));
        assert!(near(share(&|f| matches!(f, Fate::Forward { flip: Some(_), .. })), 0.02 * 0.9));
        assert!(fates.iter().all(|f| !matches!(f, Fate::Forward { flip: Some(b), .. } if *b >= 800)));
    }

    #[test]
    fn no_faults_forward_everything_untouched() {
        let mut f = Fates::new(1, FaultRates::default());
        assert!((0..1000).all(|_| f.decide(64) == Fate::Forward { twice: false, hold: false, flip: None }));
    }

    #[test]
    fn rates_outside_zero_to_one_are_refused() {
        assert!(FaultRates { drop: 1.5, ..FaultRates::default() }.check().is_err());
        assert!(FaultRates { corrupt: -0.1, ..FaultRates::default() }.check().is_err());
        assert!(FaultRates { drop: 1.0, ..FaultRates::default() }.check().is_ok());
    }
}
