//! The adaptive batch controller: Tyche's idea (section VI.A), choosing how many requests a
//! caravan carries (the *batch level*) from the throughput batching achieves, made to hold
//! under any placement of client and target.
//!
//! Tyche moves the level each interval from the change in throughput since the interval before,
//! aiming raises at the average number of requests waiting (`a_out`). Measured with client and
//! target on different cores of this VM (docs/PERFORMANCE.md, "The adaptive controller"), that
//! rule lost twice: one interval's noise read as a trend moved the level, and a raise aimed at
//! what waits jumped from 1 straight to half the outstanding requests, a level that only fills
//! by waiting, so the move failed, was undone, and the controller never saw that level 2 was
//! 1.2-1.4× better than 1. This controller keeps Tyche's inputs (throughput per interval, the
//! requests outstanding) and its bound (never more than `level_max`, never more than ever
//! waits), and changes how it decides:
//!
//! - **Levels on a doubling grid** (1, 2, 4, ... `level_max`): neighbours differ enough to
//!   measure, and any level is a few steps from any other.
//! - **Paired comparisons, not trends.** To judge a neighbour it runs interleaved intervals,
//!   home, neighbour, home, neighbour (the first home one is the interval just measured), and
//!   moves only if the neighbour's mean beats home's by `threshold_pct` and it won both
//!   pairs. Interleaving cancels
//!   drift from outside load; a lone noisy interval cannot move the level. A neighbour that
//!   wins or loses by far (20%) after one pair is decided at once.
//! - **Hill climbing with memory.** After a move it tries the next level the same way at once;
//!   after a failed comparison it tries the other side; when neither side is better it holds
//!   for `probe_after` intervals and then checks one neighbour again (alternating sides). Each
//!   probe that finds nothing doubles the next hold (up to 8×), so a settled controller spends
//!   less and less time away from home; a move or a change of load resets it.
//! - **A start from the load.** The first interval, a quarter of the others, runs at level 1
//!   and measures how many requests are outstanding at most (`a_peak`); the search starts at the grid level nearest
//!   `a_peak / 4` (a caravan every quarter of the outstanding requests; where that is wrong the
//!   climb corrects it). When the outstanding count later moves by 2× either way, in a hold or
//!   in the middle of a comparison (fio's threads still starting up), the search starts again
//!   from the same rule.
//!
//! The doorbell delay is the bound itself (`delay_max_us`, Tyche's `max_delay`) at every level
//! above 1, and zero at level 1, so a caravan of one goes at once. A caravan thus leaves when it
//! holds `level` requests, when no one can join it (`initiator::shared`), or at the bound. An
//! earlier rule set the delay from the level and the arrival rate (eight times the time the
//! last interval's rate needed to gather `level` requests); it sent caravans short whenever
//! arrivals came in bursts, and short caravans fragment the ones after them (see
//! [`BatchController::delay_for`]).
//!
//! The decisions are tested against pure throughput curves below and against a closed-loop
//! model of a lane, a link and a target on a virtual clock (`model` in the tests), whose best
//! static level is found by running every one.
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
    /// Throughput gain a neighbouring level must show to be chosen (3%).
    pub threshold_pct: f64,
    /// Intervals held at a settled level before checking a neighbour again (10).
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

/// The starting level is the grid level nearest `a_peak / START_SHARE`. Through fio and
/// `skiff bench` alike the best static level lay between a quarter and all of the requests
/// outstanding on a lane (docs/PERFORMANCE.md); from an eighth the climb took most of a 3 s
/// run and often stopped a step short, because neighbours within 10% of each other do not
/// tell apart in 100 ms intervals that swing by ±20% on this VM.
const START_SHARE: f64 = 4.0;

/// A neighbour whose first interval beats home's by this much (%) is taken at once, and one
/// that trails it by this much is given up at once: a climb of several steps (level 1 to 64 is
/// six) then costs one interval a step instead of three, and a probe of a bad neighbour one
/// interval instead of two.
const CLEAR_GAIN_PCT: f64 = 20.0;

/// A settled controller's hold doubles after each fruitless probe, at most this many times
/// (`probe_after` × 8: 8 s between probes with the defaults).
const HOLD_DOUBLINGS_MAX: u32 = 3;

/// A change of the outstanding count by this factor either way restarts the search.
const LOAD_CHANGE: f64 = 2.0;

/// What the controller is doing.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// The first interval, at level 1: measuring the load.
    Start,
    /// At `home`, for `held` intervals since the last comparison.
    Hold { held: u32 },
    /// Comparing `home` with `other` over four intervals, home at even steps and `other` at odd
    /// ones: `step` is the one running now, `xput` what the ones before measured.
    Compare { other: u32, step: u8, xput: [f64; 4] },
}

/// What the controller decided at the end of an interval, for telemetry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// When it was decided, on the driver's clock (µs).
    pub at_us: u64,
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
    /// The level of the interval running now.
    level: u32,
    interval_start_us: Option<u64>,
    bytes: u64,
    waiting_sum: u64,
    waiting_samples: u64,
    /// Most requests waiting at once during the interval.
    waiting_max: u32,
    phase: Phase,
    /// The level believed best.
    home: u32,
    /// The most requests ever waiting at once, as measured when the search last started.
    load: f64,
    /// The side of `home` to compare next: up when true.
    try_up: bool,
    /// Sides of `home` compared without gain since it last moved.
    failed_sides: u8,
    /// Probes in a row that found nothing better: each doubles the next hold, up to
    /// `HOLD_DOUBLINGS_MAX` times, so a settled controller explores less and less.
    failed_probes: u32,
}

impl BatchController {
    /// A controller starting at level 1 (no batching until batching proves better).
    pub fn new(cfg: BatchConfig) -> BatchController {
        assert!(cfg.level_max >= 1 && cfg.interval_us > 0, "batch config out of range: {cfg:?}");
        BatchController {
            cfg,
            level: 1,
            interval_start_us: None,
            bytes: 0,
            waiting_sum: 0,
            waiting_samples: 0,
            waiting_max: 0,
            phase: Phase::Start,
            home: 1,
            load: 0.0,
            try_up: true,
            failed_sides: 0,
            failed_probes: 0,
        }
    }

    /// Requests per caravan now.
    pub fn level(&self) -> u32 {
        self.level
    }

    /// How long the first request of a caravan may wait for the caravan to fill.
    pub fn delay_us(&self) -> u64 {
        self.delay_for()
    }

    /// A request arrived and `waiting` requests (it included) now wait to be sent.
    pub fn handle_arrival(&mut self, waiting: u32) {
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
        // The first interval only measures the load, and at level 1, which may be far from
        // the best: a quarter interval is enough for that.
        let interval_us = match self.phase {
            Phase::Start => (self.cfg.interval_us / 4).max(1),
            _ => self.cfg.interval_us,
        };
        if elapsed_us < interval_us {
            return None;
        }
        let secs = elapsed_us as f64 / 1e6;
        let bytes_per_s = self.bytes as f64 / secs;
        let a_out = if self.waiting_samples == 0 {
            0.0
        } else {
            self.waiting_sum as f64 / self.waiting_samples as f64
        };
        self.adjust(bytes_per_s, f64::from(self.waiting_max));
        self.interval_start_us = Some(now_us);
        self.bytes = 0;
        self.waiting_sum = 0;
        self.waiting_samples = 0;
        self.waiting_max = 0;
        Some(Decision { at_us: now_us, level: self.level, delay_us: self.delay_for(), bytes_per_s, a_out })
    }

    /// The interval that just ran at `self.level` measured `xput` with at most `a_peak`
    /// requests waiting at once; choose the next interval's level.
    fn adjust(&mut self, xput: f64, a_peak: f64) {
        match self.phase {
            // The first interval measured the load; or the load moved by 2× since the search
            // last started, in a hold or while two levels were compared (fio's threads still
            // starting, say), where both may be far from where the search should be.
            Phase::Start => self.restart(a_peak, xput),
            _ if self.load_changed(a_peak) => self.restart(a_peak, xput),
            Phase::Hold { held } => {
                if held + 1 >= self.cfg.probe_after << self.failed_probes.min(HOLD_DOUBLINGS_MAX) {
                    // Probe one side, alternating; the other side if this one does not exist.
                    self.try_up = !self.try_up;
                    self.failed_sides = 0;
                    match self.neighbour(self.try_up, a_peak).or_else(|| self.neighbour(!self.try_up, a_peak))
                    {
                        Some(other) => self.compare(other, Some(xput)),
                        None => self.hold(true),
                    }
                } else {
                    self.phase = Phase::Hold { held: held + 1 };
                }
            }
            Phase::Compare { other, step, xput: mut seen } => {
                seen[usize::from(step)] = xput;
                let gain = |home: f64, other: f64| other > home * (1.0 + self.cfg.threshold_pct / 100.0);
                // After one pair, only a clear win counts; after two, the neighbour must be better
                // on average and in each pair, so that one outlier cannot carry the mean.
                let clear_win = step == 1 && seen[1] > seen[0] * (1.0 + CLEAR_GAIN_PCT / 100.0);
                let clear_loss = step == 1 && seen[1] < seen[0] * (1.0 - CLEAR_GAIN_PCT / 100.0);
                let won = step == 3
                    && seen[1] > seen[0]
                    && seen[3] > seen[2]
                    && gain(seen[0] + seen[2], seen[1] + seen[3]);
                if step < 3 && !clear_win && !clear_loss {
                    let step = step + 1;
                    self.level = if step % 2 == 1 { other } else { self.home };
                    self.phase = Phase::Compare { other, step, xput: seen };
                } else if clear_win || won {
                    // Better: move there, and try the next level the same way at once with
                    // this interval (run at the new home) as its first home sample.
                    let up = other > self.home;
                    self.home = other;
                    self.failed_sides = 0;
                    self.failed_probes = 0;
                    match self.neighbour(up, a_peak) {
                        Some(next) => self.compare(next, Some(xput)),
                        None => self.hold(false),
                    }
                } else {
                    // Not better: try the other side, once, then hold.
                    self.failed_sides += 1;
                    let other_side = self.neighbour(other < self.home, a_peak);
                    match other_side.filter(|_| self.failed_sides < 2) {
                        Some(next) => self.compare(next, None),
                        None => self.hold(true),
                    }
                }
            }
        }
    }

    /// Begin the search again from the level the load suggests.
    fn restart(&mut self, a_peak: f64, xput: f64) {
        self.load = a_peak.max(1.0);
        self.failed_probes = 0;
        let measured_home = self.level == self.grid_level(self.load / START_SHARE);
        self.home = self.grid_level(self.load / START_SHARE);
        self.failed_sides = 0;
        match self.neighbour(true, a_peak).or_else(|| self.neighbour(false, a_peak)) {
            Some(other) => self.compare(other, measured_home.then_some(xput)),
            None => self.hold(true),
        }
    }

    /// Compare home with `other` over four interleaved intervals; `home_sample` is the
    /// throughput of an interval that just ran at home, which then counts as the first.
    fn compare(&mut self, other: u32, home_sample: Option<f64>) {
        match home_sample {
            Some(xput) => {
                self.level = other;
                self.phase = Phase::Compare { other, step: 1, xput: [xput, 0.0, 0.0, 0.0] };
            }
            None => {
                self.level = self.home;
                self.phase = Phase::Compare { other, step: 0, xput: [0.0; 4] };
            }
        }
    }

    /// Settle at home until the next probe, which comes later the more probes found nothing.
    /// `fruitless`: the comparisons that led here found nothing better.
    fn hold(&mut self, fruitless: bool) {
        self.level = self.home;
        self.failed_sides = 0;
        self.failed_probes += u32::from(fruitless);
        self.phase = Phase::Hold { held: 0 };
    }

    /// The grid level next to home, up or down; up only while it does not exceed what waits
    /// at most (a caravan larger than that fills only by waiting out the delay bound).
    fn neighbour(&self, up: bool, a_peak: f64) -> Option<u32> {
        if up {
            let next = (self.home * 2).min(self.cfg.level_max);
            (next > self.home && f64::from(next) <= a_peak.max(1.0)).then_some(next)
        } else {
            (self.home > 1).then(|| self.grid_level(f64::from(self.home) / 2.0))
        }
    }

    fn load_changed(&self, a_peak: f64) -> bool {
        let ratio = a_peak.max(1.0) / self.load;
        !(1.0 / LOAD_CHANGE..LOAD_CHANGE).contains(&ratio)
    }

    /// The largest grid level (a power of two, or `level_max`) not above `x`, at least 1.
    fn grid_level(&self, x: f64) -> u32 {
        let mut level = 1u32;
        while level < self.cfg.level_max && f64::from(level * 2) <= x {
            level *= 2;
        }
        level.min(self.cfg.level_max)
    }

    /// How long a caravan may wait for its level: the bound, at any level above 1.
    ///
    /// Waiting less sends caravans short, and a short caravan fragments the ones after it:
    /// fio's jobs, as threads on one client CPU, submit as the scheduler lets them after a
    /// caravan's completions wake them, so one that wakes fewer threads gathers fewer still.
    /// The average arrival rate hides those bursts. Through fio (jobs × QD 4 on two shared
    /// lanes, pinned apart, 2026-11-30), against a delay of eight times the time the last
    /// interval's rate needed to gather `level` requests, the bound read 1.01-1.16× the IOPS
    /// from 2 jobs on, and wrote as much on the whole (0.99× the geometric mean, points either
    /// way; docs/PERFORMANCE.md, "The doorbell delay at its bound"). The long wait costs nothing
    /// when every caller waits: a caravan no one can join still leaves at once.
    fn delay_for(&self) -> u64 {
        if self.level <= 1 {
            0
        } else {
            self.cfg.delay_max_us
        }
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

    /// Levels of `n` intervals with at most `waiting` requests waiting and throughput `xput`.
    fn levels(
        c: &mut BatchController,
        now: &mut u64,
        n: usize,
        waiting: u32,
        xput: impl Fn(u32) -> f64,
    ) -> Vec<u32> {
        (0..n).map(|_| run_interval(c, now, waiting, &xput).level).collect()
    }

    /// Throughput that peaks at level `best` and falls by 15% per doubling away from it.
    fn peak_at(best: u32) -> impl Fn(u32) -> f64 {
        move |level: u32| {
            let steps = (f64::from(level).log2() - f64::from(best).log2()).abs();
            1e9 * 0.85f64.powf(steps)
        }
    }

    #[test]
    fn climbs_to_the_best_level_and_stays_there_but_for_probes() {
        let (mut c, mut now) = controller();
        // 128 outstanding: the search starts at 32, the best is 8.
        let seen = levels(&mut c, &mut now, 40, 128, peak_at(8));
        assert_eq!(seen[0], 32, "starts at a quarter of what is outstanding: {seen:?}");
        let settled = &seen[12..];
        let at_best = settled.iter().filter(|&&l| l == 8).count();
        assert!(at_best * 10 >= settled.len() * 7, "mostly at 8 once found: {seen:?}");
        assert!(settled.iter().all(|&l| (4..=16).contains(&l)), "probes go one step only: {seen:?}");
    }

    #[test]
    fn a_lone_noisy_interval_moves_nothing() {
        let (mut c, mut now) = controller();
        // Flat throughput with 32 outstanding: home is 8, and neither neighbour is better.
        levels(&mut c, &mut now, 12, 32, |_| 1e9);
        assert_eq!(c.home, 8);
        // One interval at a neighbour reads 10% high (noise): the paired comparison, which
        // runs home and neighbour twice each, does not move for it.
        let mut noisy = 0;
        for _ in 0..30 {
            let level = c.level();
            let boost = if level != 8 && noisy == 0 { 1.1 } else { 1.0 };
            noisy += usize::from(boost > 1.0);
            run_interval(&mut c, &mut now, 32, move |_| 1e9 * boost);
            assert_eq!(c.home, 8, "one noisy interval moved the level");
        }
        assert_eq!(noisy, 1, "a probe ran");
    }

    #[test]
    fn a_clear_win_is_taken_after_one_interval() {
        let (mut c, mut now) = controller();
        // Every doubling 30% better: from 8 (32 outstanding), home is measured once, then each
        // step up is taken after one interval, up to 32 (never above what waits: next test).
        let rising = |level: u32| 1e8 * 1.3f64.powf(f64::from(level).log2());
        let seen = levels(&mut c, &mut now, 4, 32, rising);
        assert_eq!(seen, [8, 16, 32, 32], "home measured once, then a step per interval: {seen:?}");
    }

    #[test]
    fn no_level_above_what_ever_waits() {
        let (mut c, mut now) = controller();
        // Four requests wait at most and more batching always looks better: never above 4.
        let seen = levels(&mut c, &mut now, 60, 4, |l| 1e9 * f64::from(l));
        assert!(seen.iter().all(|&l| l <= 4), "{seen:?}");
        assert_eq!(c.home, 4);
    }

    #[test]
    fn a_change_of_load_restarts_the_search() {
        let (mut c, mut now) = controller();
        levels(&mut c, &mut now, 20, 512, peak_at(64));
        assert_eq!(c.home, 64);
        // The load falls to 16 outstanding and batching stops paying: back down within a few
        // intervals, not after a walk of many comparisons.
        let seen = levels(&mut c, &mut now, 12, 16, peak_at(1));
        assert!(seen[0] <= 4, "restarted from the new load: {seen:?}");
        assert_eq!(c.home, 1, "{seen:?}");
    }

    #[test]
    fn a_load_that_grows_during_a_comparison_restarts_the_search() {
        let (mut c, mut now) = controller();
        // fio's threads still starting: 16 outstanding at first, so the search starts at 4 and
        // compares it with a neighbour; then 128 are. The next interval is near 32, where the
        // best is, instead of finishing comparisons of levels far below it.
        let first = levels(&mut c, &mut now, 2, 16, peak_at(64));
        assert!(matches!(c.phase, Phase::Compare { .. }), "comparing after {first:?}");
        let seen = levels(&mut c, &mut now, 2, 128, peak_at(64));
        assert!(seen[0] >= 32, "restarted from the new load: {first:?} then {seen:?}");
    }

    #[test]
    fn level_stays_within_bounds_and_delay_is_the_bound() {
        let cfg = BatchConfig {
            interval_us: INTERVAL_US,
            level_max: 8,
            delay_max_us: 10_000,
            ..BatchConfig::default()
        };
        let mut c = BatchController::new(cfg);
        c.poll(0);
        let mut now = 0;
        for i in 0..20 {
            let d = run_interval(&mut c, &mut now, 1000, |l| 1e6 * f64::from(l) * f64::from(i + 1));
            assert!((1..=8).contains(&d.level), "{d:?}");
            assert_eq!(d.delay_us, if d.level == 1 { 0 } else { 10_000 }, "{d:?}");
        }
        assert_eq!((c.level(), c.delay_us()), (8, 10_000), "capped at level_max, waiting up to the bound");
        // Where batching only costs, the level falls back to 1 and a caravan of one goes at once.
        let mut c = BatchController::new(cfg);
        c.poll(0);
        let mut now = 0;
        for _ in 0..20 {
            run_interval(&mut c, &mut now, 1000, |l| 1e6 / f64::from(l));
        }
        assert_eq!((c.level(), c.delay_us()), (1, 0));
    }

    #[test]
    fn nothing_changes_before_an_interval_ends() {
        let (mut c, _) = controller();
        c.handle_arrival(10);
        // The first interval, which only measures the load, is a quarter of the others.
        assert_eq!(c.poll(INTERVAL_US / 4 - 1), None);
        assert_eq!((c.level(), c.delay_us()), (1, 0));
    }
}
