//! The adaptive batch controller of Tyche (section VI.A), extended to set the doorbell delay.
//!
//! The controller decides how many requests a caravan should carry (the *batch level*) from
//! what batching achieved: each interval it compares the throughput of the last interval with
//! the one before and moves the level, using the average number of requests that were waiting
//! to be sent (`a_out`):
//!
//! - improvement above `threshold_pct`: keep moving the way the last move went; up is
//!   `level = (level + min(a_peak, level_max)) / 2`, down is `level = (1 + min(a_out, level)) / 2`;
//! - improvement below `-threshold_pct`: if fewer requests waited than the level gathers
//!   (`a_peak < level`: the load fell), the paper's decrease `(1 + min(a_out, level)) / 2`; else,
//!   if the last interval moved the level, the move is undone and the next interval only sets a
//!   new baseline; else (nothing moved, the load held) the dip is noise and the level stays;
//! - otherwise the level stays. After `probe_after` unchanged intervals it *probes*: one
//!   interval at `level - 1`, one at `level + 1`; a neighbour at least `threshold_pct` better
//!   than the current level becomes the new level, else the level returns to where it was.
//!
//! Two departures from the paper's formulas, both from measurement (docs/PERFORMANCE.md): the
//! paper states "keep moving in the same direction" in words but its formulas lower the level
//! on any drop, so one noisy interval (frequent at 100 ms on a shared 2-core machine) halved a
//! good level and the next drop halved it again; and the raise aims at the *peak* number
//! waiting (`a_peak`) rather than the average, because in a closed loop (threads that each keep
//! a few requests outstanding) the average sits below what a caravan can gather and the level
//! never reached the best static one.
//!
//! i10 leaves the doorbell delay static and calls a dynamic one future work; here the delay
//! follows the level: it is the time the last interval's arrival rate needs to gather `level`
//! requests, with headroom, capped at `delay_max_us`. At level 1 it is zero, so a caravan of one
//! goes at once and costs nothing over no batching.
//!
//! No clock and no I/O: the driver reports completions and queue samples and calls
//! [`BatchController::poll`] with the time, in microseconds.

/// Tunables, with the paper's values as defaults where it gives them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchConfig {
    /// Length of a measurement interval (the paper uses 1 s; shorter reacts faster to change).
    pub interval_us: u64,
    /// Most requests in one caravan (the paper's `max_batch_level`, 64).
    pub level_max: u32,
    /// Longest a request may wait for its caravan to fill (the paper's `max_delay`, 5 ms).
    pub delay_max_us: u64,
    /// Throughput change that counts as a change (3%).
    pub threshold_pct: f64,
    /// Unchanged intervals before probing the neighbours (10).
    pub probe_after: u32,
}

impl Default for BatchConfig {
    fn default() -> BatchConfig {
        BatchConfig {
            interval_us: 100_000,
            level_max: 64,
            delay_max_us: 5_000,
            threshold_pct: 3.0,
            probe_after: 10,
        }
    }
}

/// Headroom over the expected gathering time, so that an arrival rate with some jitter still
/// fills the caravan before the delay bound expires.
const DELAY_HEADROOM: f64 = 2.0;

/// Where a probe stands.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Probe {
    /// Running one interval at `level - 1`; `base` is the throughput at `level`.
    Below { home: u32, base: f64 },
    /// Running one interval at `level + 1`.
    Above { home: u32, base: f64, below: f64 },
}

/// The controller's last change of level, and where it came from.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Move {
    None,
    Up(u32),
    Down(u32),
}

/// What the controller decided at the end of an interval, for telemetry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    pub level: u32,
    pub delay_us: u64,
    /// Throughput of the interval that just ended, in bytes per second.
    pub bytes_per_s: f64,
    /// Average number of requests waiting to be sent during it.
    pub a_out: f64,
}

#[derive(Debug, Clone)]
pub struct BatchController {
    cfg: BatchConfig,
    level: u32,
    delay_us: u64,
    interval_start_us: Option<u64>,
    bytes: u64,
    arrivals: u64,
    waiting_sum: u64,
    waiting_samples: u64,
    /// Most requests waiting at once during the interval.
    waiting_max: u32,
    previous: Option<f64>,
    last_move: Move,
    /// The running probe tries the level above as well.
    probe_above: bool,
    /// The next interval only sets the baseline (the level was just put back).
    rebase: bool,
    unchanged: u32,
    probe: Option<Probe>,
}

impl BatchController {
    /// A controller starting at level 1 (no batching until batching proves better).
    pub fn new(cfg: BatchConfig) -> BatchController {
        assert!(cfg.level_max >= 1 && cfg.interval_us > 0, "batch config out of range: {cfg:?}");
        BatchController {
            cfg,
            level: 1,
            delay_us: 0,
            interval_start_us: None,
            bytes: 0,
            arrivals: 0,
            waiting_sum: 0,
            waiting_samples: 0,
            waiting_max: 0,
            previous: None,
            last_move: Move::None,
            probe_above: false,
            rebase: false,
            unchanged: 0,
            probe: None,
        }
    }

    /// Requests per caravan now.
    pub fn level(&self) -> u32 {
        self.level
    }

    /// How long the first request of a caravan may wait for the caravan to fill.
    pub fn delay_us(&self) -> u64 {
        self.delay_us
    }

    /// A request arrived and `waiting` requests (it included) now wait to be sent.
    pub fn handle_arrival(&mut self, waiting: u32) {
        self.arrivals += 1;
        self.waiting_sum += u64::from(waiting);
        self.waiting_samples += 1;
        self.waiting_max = self.waiting_max.max(waiting);
    }

    /// A request completed, moving `bytes` of payload.
    pub fn handle_completion(&mut self, bytes: u64) {
        self.bytes += bytes;
    }

    /// Call whenever convenient; at the end of an interval it adjusts the level and delay and
    /// returns what it decided.
    pub fn poll(&mut self, now_us: u64) -> Option<Decision> {
        let start = *self.interval_start_us.get_or_insert(now_us);
        let elapsed_us = now_us.saturating_sub(start);
        if elapsed_us < self.cfg.interval_us {
            return None;
        }
        let secs = elapsed_us as f64 / 1e6;
        let bytes_per_s = self.bytes as f64 / secs;
        let a_out = if self.waiting_samples == 0 {
            0.0
        } else {
            self.waiting_sum as f64 / self.waiting_samples as f64
        };
        let arrivals_per_us = self.arrivals as f64 / elapsed_us as f64;
        self.adjust(bytes_per_s, a_out, f64::from(self.waiting_max));
        self.delay_us = self.delay_for(arrivals_per_us);
        self.interval_start_us = Some(now_us);
        self.bytes = 0;
        self.arrivals = 0;
        self.waiting_sum = 0;
        self.waiting_samples = 0;
        self.waiting_max = 0;
        Some(Decision { level: self.level, delay_us: self.delay_us, bytes_per_s, a_out })
    }

    fn adjust(&mut self, xput: f64, a_out: f64, a_peak: f64) {
        if let Some(probe) = self.probe {
            return self.continue_probe(probe, xput);
        }
        let Some(previous) = self.previous.replace(xput) else {
            // The first interval has nothing to compare with: try batching if requests queued.
            if a_out > 1.0 {
                self.move_to(self.raised(a_peak));
            }
            return;
        };
        if std::mem::take(&mut self.rebase) {
            // The level just went back: this interval is the new baseline, not a trend.
            return;
        }
        let change_pct = if previous > 0.0 { (xput - previous) / previous * 100.0 } else { 0.0 };
        let before = self.level;
        let lowered = |waiting: f64, level: u32| ((1.0 + waiting.min(f64::from(level))) / 2.0).floor() as u32;
        if change_pct > self.cfg.threshold_pct {
            // Better: keep moving the way the last move went.
            match self.last_move {
                Move::Down(_) => self.move_to(lowered(a_out, self.level)),
                _ => self.move_to(self.raised(a_peak)),
            }
        } else if change_pct < -self.cfg.threshold_pct {
            if a_peak < f64::from(self.level) {
                // Load fell: fewer requests than the level gathers. The paper's decrease.
                self.move_to(lowered(a_out, self.level));
            } else if let Move::Up(from) | Move::Down(from) = self.last_move {
                // The last move made things worse: undo it.
                self.set_level(from);
                self.last_move = Move::None;
                self.rebase = true;
            }
            // Otherwise nothing moved and the load did not fall: noise, or a peer's doing.
        }
        if self.level == before {
            self.unchanged += 1;
            if self.unchanged >= self.cfg.probe_after {
                self.start_probe(xput, a_peak);
            }
        } else {
            self.unchanged = 0;
        }
    }

    /// Set the level and remember the way it went.
    fn move_to(&mut self, level: u32) {
        let from = self.level;
        self.set_level(level);
        self.last_move = match self.level.cmp(&from) {
            std::cmp::Ordering::Greater => Move::Up(from),
            std::cmp::Ordering::Less => Move::Down(from),
            std::cmp::Ordering::Equal => Move::None,
        };
    }

    /// The paper's raise: halfway from the level to what was waiting (at most `level_max`).
    fn raised(&self, a_out: f64) -> u32 {
        let target = a_out.min(f64::from(self.cfg.level_max));
        ((f64::from(self.level) + target) / 2.0).ceil() as u32
    }

    fn start_probe(&mut self, base: f64, a_peak: f64) {
        self.unchanged = 0;
        let home = self.level;
        // A level above what ever waits at once cannot fill a caravan: every caravan would wait
        // out the delay bound. Probe it only when more requests waited.
        self.probe_above = f64::from(home) < a_peak && home < self.cfg.level_max;
        if home > 1 {
            self.probe = Some(Probe::Below { home, base });
            self.level = home - 1;
        } else {
            // Nothing below level 1: go straight to the level above.
            self.probe = Some(Probe::Above { home, base, below: 0.0 });
            self.level = (home + 1).min(self.cfg.level_max);
        }
    }

    fn continue_probe(&mut self, probe: Probe, xput: f64) {
        match probe {
            Probe::Below { home, base } if self.probe_above => {
                self.probe = Some(Probe::Above { home, base, below: xput });
                self.level = home + 1;
            }
            Probe::Below { home, base } => {
                // No level above to try: decide on the one below alone.
                self.continue_probe(Probe::Above { home, base, below: xput }, 0.0);
            }
            Probe::Above { home, base, below } => {
                self.probe = None;
                self.last_move = Move::None;
                let better = |x: f64| x >= base * (1.0 + self.cfg.threshold_pct / 100.0);
                self.level = match (better(below), better(xput)) {
                    (_, true) if xput >= below => (home + 1).min(self.cfg.level_max),
                    (true, _) => home.saturating_sub(1).max(1),
                    _ => home,
                };
                // Compare the next interval with this one's figure at the chosen level.
                self.previous = Some(if self.level == home { base } else { xput.max(below) });
            }
        }
    }

    fn set_level(&mut self, level: u32) {
        self.level = level.clamp(1, self.cfg.level_max);
    }

    fn delay_for(&self, arrivals_per_us: f64) -> u64 {
        if self.level <= 1 || arrivals_per_us <= 0.0 {
            return 0;
        }
        let gather_us = f64::from(self.level - 1) / arrivals_per_us * DELAY_HEADROOM;
        (gather_us as u64).min(self.cfg.delay_max_us)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INTERVAL_US: u64 = 100_000;

    /// Drive one interval: `arrivals` requests with `waiting` queued on average, and a
    /// throughput given by `xput(level)`.
    fn run_interval(
        c: &mut BatchController,
        now: &mut u64,
        waiting: u32,
        xput: impl Fn(u32) -> f64,
    ) -> Decision {
        for _ in 0..1000 {
            c.handle_arrival(waiting);
        }
        let bytes = xput(c.level()) * INTERVAL_US as f64 / 1e6;
        c.handle_completion(bytes as u64);
        *now += INTERVAL_US;
        c.poll(*now).expect("an interval ended")
    }

    fn controller() -> (BatchController, u64) {
        let mut c = BatchController::new(BatchConfig { interval_us: INTERVAL_US, ..BatchConfig::default() });
        assert_eq!(c.poll(0), None, "the first poll only starts the clock");
        (c, 0)
    }

    #[test]
    fn rising_load_raises_the_level() {
        let (mut c, mut now) = controller();
        // Throughput grows with the level up to 32 requests per caravan, and 48 are waiting.
        let xput = |level: u32| 1e9 * f64::from(level.min(32)) / 32.0;
        let mut levels = Vec::new();
        for _ in 0..8 {
            levels.push(run_interval(&mut c, &mut now, 48, xput).level);
        }
        assert!(levels.windows(2).all(|w| w[1] >= w[0]), "levels only rise: {levels:?}");
        assert!(c.level() >= 24, "climbs toward what is waiting: {levels:?}");
        assert!(c.level() <= 48);
    }

    #[test]
    fn falling_load_lowers_the_level() {
        let (mut c, mut now) = controller();
        for _ in 0..6 {
            run_interval(&mut c, &mut now, 48, |l| 1e9 * f64::from(l.min(32)));
        }
        let high = c.level();
        assert!(high > 8);
        // Load falls: fewer requests wait and throughput drops by half.
        let d = run_interval(&mut c, &mut now, 4, |_| 1e8);
        assert!(d.level < high, "{} -> {}", high, d.level);
        assert_eq!(d.level, 2, "(1 + min(a_out = 4, level)) / 2, rounded down");
        let d = run_interval(&mut c, &mut now, 1, |_| 5e7);
        assert_eq!(d.level, 1, "one waiting request: back to no batching");
        assert_eq!(d.delay_us, 0, "level 1 sends at once");
    }

    #[test]
    fn a_move_that_hurts_is_undone_and_a_dip_alone_moves_nothing() {
        let (mut c, mut now) = controller();
        // Eight requests wait at most; throughput peaks at level 7.
        let peak_at = |p: u32| move |level: u32| 1e9 - (f64::from(level) - f64::from(p)).abs() * 1e8;
        let levels: Vec<u32> = (0..4).map(|_| run_interval(&mut c, &mut now, 8, peak_at(7)).level).collect();
        // 1 -> 5 (halfway to 8) -> 7 (better, so on up) -> 8 (better again) -> worse: back to 7.
        assert_eq!(levels, vec![5, 7, 8, 7], "{levels:?}");
        let d = run_interval(&mut c, &mut now, 8, peak_at(7));
        assert_eq!(d.level, 7, "the interval after an undo only sets the baseline");
        // The peak moves to level 6: throughput at 7 dips by 10% although nothing moved and
        // the load held. That alone moves nothing; the probe, ten intervals on, finds level 6.
        let mut levels = Vec::new();
        for _ in 0..14 {
            levels.push(run_interval(&mut c, &mut now, 8, peak_at(6)).level);
        }
        assert!(levels[..9].iter().all(|&l| l == 7), "a dip is not a trend: {levels:?}");
        assert_eq!(*levels.last().unwrap(), 6, "the probe found the new peak: {levels:?}");
    }

    #[test]
    fn stable_load_triggers_a_probe_that_finds_a_better_level() {
        let (mut c, mut now) = controller();
        // Throughput peaks at level 5 and six requests wait at most: the level climbs to 5, one
        // step to 6 is undone, and from then on probes keep checking both neighbours.
        let xput = |level: u32| 1e9 - (f64::from(level) - 5.0).abs() * 1e8;
        let mut levels = Vec::new();
        for _ in 0..90 {
            levels.push(run_interval(&mut c, &mut now, 6, xput).level);
        }
        assert_eq!(*levels.last().unwrap(), 5, "probing walks to the peak: {levels:?}");
        // Settled at the peak, probes try 4 and 6 and come back.
        let tail = &levels[levels.len() - 24..];
        assert!(tail.iter().all(|&l| (4..=6).contains(&l)), "{tail:?}");
        assert!(tail.contains(&4) && tail.contains(&6), "probes both neighbours: {tail:?}");
    }

    #[test]
    fn no_probe_above_what_ever_waits() {
        let (mut c, mut now) = controller();
        // Four requests wait at most and throughput is flat: the level settles at 3 or 4 and
        // never tries 5, which could only fill caravans by waiting out the delay bound.
        let mut levels = Vec::new();
        for _ in 0..60 {
            levels.push(run_interval(&mut c, &mut now, 4, |_| 1e9).level);
        }
        assert!(levels.iter().all(|&l| l <= 4), "{levels:?}");
    }

    #[test]
    fn level_stays_within_bounds_and_delay_follows_arrivals() {
        let cfg = BatchConfig {
            interval_us: INTERVAL_US,
            level_max: 8,
            delay_max_us: 5_000,
            ..BatchConfig::default()
        };
        let mut c = BatchController::new(cfg);
        c.poll(0);
        let mut now = 0;
        for i in 0..20 {
            let d = run_interval(&mut c, &mut now, 1000, |l| 1e6 * f64::from(l) * f64::from(i + 1));
            assert!((1..=8).contains(&d.level), "{d:?}");
        }
        assert_eq!(c.level(), 8, "capped at level_max");
        // 1000 arrivals per 100 ms is one per 100 us: gathering 7 more takes 700 us, doubled.
        assert_eq!(c.delay_us(), 1_400);
        // A trickle would wait longer than the cap allows.
        c.handle_arrival(1000);
        now += INTERVAL_US;
        let d = c.poll(now).unwrap();
        assert!(d.delay_us <= 5_000, "{d:?}");
    }

    #[test]
    fn nothing_changes_before_an_interval_ends() {
        let (mut c, _) = controller();
        c.handle_arrival(10);
        assert_eq!(c.poll(INTERVAL_US - 1), None);
        assert_eq!((c.level(), c.delay_us()), (1, 0));
    }
}
