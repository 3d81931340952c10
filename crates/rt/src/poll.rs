//! How a thread waits for its next event: hybrid polling, fixed or adaptive.
//!
//! Sleeping in the kernel and being woken is not free. On this project's 2-vCPU VM a thread
//! woken on an idle vCPU pays a VM exit and an IPI, about 25 µs, and a timed sleep overshoots
//! by the same (a halted vCPU wakes as slowly for its timer as for a peer). A QD 1 round trip
//! across cores pays two of them and spends most of its 65 µs there; spinning instead takes
//! 12 µs, but spinning wastes a core when the event is far off, and on one core it starves the
//! very peer it waits for.
//!
//! [`PollMode::Fixed`] spins a set time on every wait, then sleeps. [`PollMode::Adaptive`] does
//! what the block layer's hybrid polling does, and learns when not to:
//!
//! - it spins only as long as the waits that spinning catches take (twice their running mean,
//!   at most the mode's bound);
//! - it sleeps through the predictable part of a wait too long to spin through (a timed sleep
//!   until a wake-up cost and a margin before the wait's expected end, then a short spin);
//! - it stops spinning while spinning does not pay, which is its CPU bound: over each window of
//!   spins, all the time spent spinning (in vain or not) must not exceed the wake-ups that
//!   spinning saved, each worth the measured cost of a wake-up. Then it sleeps at once for a
//!   stretch of waits (doubling while spinning keeps failing) before it tries again.
//!
//! [`Waiter`] is the policy alone, with no clock: its caller measures and reports each wait,
//! so the policy is tested on a virtual clock (the tests below). [`wait`] drives one wait with
//! a real clock for the initiator's lanes and the target's workers.

use std::time::{Duration, Instant};

/// How a thread waits for its next event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollMode {
    /// Sleep in the kernel at once.
    Off,
    /// Spin this long on every wait, then sleep.
    Fixed(Duration),
    /// Learn from the waits when and how long to spin, spinning at most this long per wait.
    Adaptive(Duration),
}

impl PollMode {
    pub fn is_off(self) -> bool {
        self == PollMode::Off
    }

    /// For reports: `off`, `hybrid:50` or `adaptive:50` (microseconds).
    pub fn label(self) -> String {
        match self {
            PollMode::Off => "off".into(),
            PollMode::Fixed(d) => format!("hybrid:{}", d.as_micros()),
            PollMode::Adaptive(d) => format!("adaptive:{}", d.as_micros()),
        }
    }
}

/// What one wait should do: a timed sleep (that the event may end early), then spinning, then
/// sleeping until the event. Either phase may be zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub sleep_ns: u64,
    pub spin_ns: u64,
}

/// Which phase of a [`Plan`] saw the event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// At the spin's first look, with no timed sleep before it: the event was there already,
    /// and a sleep would have returned at once too. Teaches nothing about waiting.
    Immediately,
    /// During the timed sleep.
    Sleeping,
    /// During the spin: a wake-up saved.
    Spinning,
    /// In the final, untimed sleep.
    Blocked,
}

/// One finished wait, as its driver measured it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub ended: Ended,
    /// From the start of the wait to the event being seen.
    pub waited_ns: u64,
    /// Time spent spinning.
    pub spun_ns: u64,
    /// How much later than asked a timed sleep that ran out returned (`None`: no timed sleep,
    /// or the event cut it short).
    pub overshoot_ns: Option<u64>,
    /// The spin lost its core for a while (another thread ran on it): whatever it then
    /// caught, it saved no wake-up, for the core was given up anyway.
    pub preempted: bool,
}

/// Counters of a waiter's decisions, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WaitStats {
    /// Waits that had to wait (the event not there at the first look); none are counted with
    /// polling off.
    pub waits: u64,
    /// Waits whose event a spin caught (no wake-up).
    pub caught: u64,
    /// Waits that spun in vain and slept after all, or lost the core while spinning.
    pub missed: u64,
    /// Waits that began with a timed sleep.
    pub timed_sleeps: u64,
    /// Waits that slept at once because spinning was not paying.
    pub held_off: u64,
    pub spun_ns: u64,
}

impl WaitStats {
    pub fn add(&mut self, o: &WaitStats) {
        self.waits += o.waits;
        self.caught += o.caught;
        self.missed += o.missed;
        self.timed_sleeps += o.timed_sleeps;
        self.held_off += o.held_off;
        self.spun_ns += o.spun_ns;
    }
}

/// The least an adaptive spin lasts: below this a spin catches nothing a syscall would not.
const SPIN_MIN_NS: u64 = 5_000;
/// A timed sleep shorter than this is not worth its wake-up.
const SLEEP_MIN_NS: u64 = 10_000;
/// The wake-up cost assumed until timed sleeps have measured it (this VM's, see the module doc).
const WAKE_COST_GUESS_NS: u64 = 25_000;
/// A gap between two looks of a spin longer than this means the core ran another thread.
const PREEMPTED_GAP: Duration = Duration::from_micros(4);
/// Spins per judgement of whether spinning pays.
const WINDOW_SPINS: u32 = 16;
/// Waits that sleep at once after a window that did not pay, doubling up to the maximum while
/// windows keep failing.
const HOLD_OFF_MIN: u32 = 64;
const HOLD_OFF_MAX: u32 = 4096;
/// A share of one, in the fixed point of `Waiter::short_share`.
const SHARE_ONE: u64 = 1024;

/// A running mean weighting the newest sample 1/8.
#[derive(Clone, Copy, Debug)]
struct Ewma(u64);

impl Ewma {
    fn add(&mut self, sample: u64) {
        self.0 = self.0 - self.0 / 8 + sample / 8;
    }
}

/// The waiting policy of one thread's (or one lane's) waits. See the module doc.
#[derive(Clone, Debug)]
pub struct Waiter {
    mode: PollMode,
    // Waits come as short ones (within the spin bound) and long ones; the event times are as
    // best known (a blocked wait's wake-up taken off).
    /// How long the short waits take.
    short: Ewma,
    /// How long the long waits take.
    long: Ewma,
    /// The share of short waits, in 1/1024ths.
    short_share: Ewma,
    /// What a wake-up from a sleep costs, as timed sleeps overshoot.
    wake_cost: Ewma,
    // The current window: spins, wake-ups they saved, and the time they took.
    window_spins: u32,
    window_caught: u32,
    window_spun_ns: u64,
    /// Waits left that sleep at once, and the length of the next such stretch.
    hold_off_left: u32,
    hold_off_next: u32,
    stats: WaitStats,
}

impl Default for Waiter {
    /// A waiter that always sleeps at once.
    fn default() -> Waiter {
        Waiter::new(PollMode::Off)
    }
}

impl Waiter {
    pub fn new(mode: PollMode) -> Waiter {
        let bound = match mode {
            PollMode::Adaptive(d) | PollMode::Fixed(d) => d.as_nanos() as u64,
            PollMode::Off => 0,
        };
        Waiter {
            mode,
            // Start by spinning the whole bound: the first waits teach what they take.
            short: Ewma(bound / 2),
            long: Ewma(0),
            short_share: Ewma(SHARE_ONE),
            wake_cost: Ewma(WAKE_COST_GUESS_NS),
            window_spins: 0,
            window_caught: 0,
            window_spun_ns: 0,
            hold_off_left: 0,
            hold_off_next: HOLD_OFF_MIN,
            stats: WaitStats::default(),
        }
    }

    pub fn mode(&self) -> PollMode {
        self.mode
    }

    pub fn stats(&self) -> WaitStats {
        self.stats
    }

    /// What the next wait should do.
    pub fn plan(&mut self) -> Plan {
        match self.mode {
            PollMode::Off => Plan::default(),
            PollMode::Fixed(d) => Plan { sleep_ns: 0, spin_ns: d.as_nanos() as u64 },
            PollMode::Adaptive(d) => self.plan_adaptive(d.as_nanos() as u64),
        }
    }

    fn plan_adaptive(&mut self, bound_ns: u64) -> Plan {
        if self.hold_off_left > 0 {
            self.hold_off_left -= 1;
            self.stats.held_off += 1;
            return Plan::default();
        }
        if self.short_share.0 >= SHARE_ONE / 4 {
            // Enough waits end within the bound: spin through them, with room for their spread.
            let spin_ns = (2 * self.short.0).clamp(SPIN_MIN_NS, bound_ns.max(SPIN_MIN_NS));
            return Plan { sleep_ns: 0, spin_ns };
        }
        // Long waits: sleep until a wake-up and a margin before one is expected to end, then
        // spin across the margin (twice it, for the spread of the wait and of the wake-up).
        let expected = self.long.0;
        let margin = (expected / 32).max(SPIN_MIN_NS);
        let spin_ns = (2 * margin).min(bound_ns.max(SPIN_MIN_NS));
        let sleep_ns = expected.saturating_sub(self.wake_cost.0 + margin);
        if sleep_ns < SLEEP_MIN_NS {
            // Too short to sleep through, too long to spin through: sleep until the event.
            return Plan::default();
        }
        Plan { sleep_ns, spin_ns }
    }

    /// Learn from a finished wait that followed `plan`.
    pub fn handle_outcome(&mut self, plan: Plan, o: Outcome) {
        if o.ended == Ended::Immediately {
            // Not a wait after all (and not counted as one).
            return;
        }
        self.stats.waits += 1;
        self.stats.spun_ns += o.spun_ns;
        if plan.sleep_ns > 0 {
            self.stats.timed_sleeps += 1;
        }
        let PollMode::Adaptive(bound) = self.mode else {
            if o.ended == Ended::Spinning {
                self.stats.caught += 1;
            } else if plan.spin_ns > 0 && o.ended == Ended::Blocked {
                self.stats.missed += 1;
            }
            return;
        };
        let bound_ns = bound.as_nanos() as u64;
        if let Some(over) = o.overshoot_ns {
            self.wake_cost.add(over);
        }
        let event_ns = match o.ended {
            // Woken by the event: it came about a wake-up before we saw it.
            Ended::Blocked | Ended::Sleeping => o.waited_ns.saturating_sub(self.wake_cost.0),
            Ended::Spinning | Ended::Immediately => o.waited_ns,
        };
        if event_ns <= bound_ns {
            self.short.add(event_ns);
            self.short_share.add(SHARE_ONE);
        } else {
            self.long.add(event_ns);
            self.short_share.add(0);
        }
        if plan.spin_ns == 0 {
            return;
        }
        match o.ended {
            Ended::Spinning if !o.preempted => {
                self.stats.caught += 1;
                self.window_caught += 1;
                // Even a spin that catches costs its time: worth it only when shorter than the
                // wake-up it saves.
                self.window_spun_ns += o.spun_ns;
            }
            Ended::Spinning | Ended::Blocked => {
                self.stats.missed += 1;
                self.window_spun_ns += o.spun_ns;
            }
            // The event came early, before any spin: says nothing of spinning.
            Ended::Sleeping | Ended::Immediately => return,
        }
        self.window_spins += 1;
        if self.window_spins >= WINDOW_SPINS {
            self.judge_window();
        }
    }

    /// Spinning pays when the wake-ups it saved outweigh all the time it spun: the CPU bound.
    fn judge_window(&mut self) {
        let saved_ns = u64::from(self.window_caught) * self.wake_cost.0;
        if self.window_spun_ns > saved_ns {
            self.hold_off_left = self.hold_off_next;
            self.hold_off_next = (self.hold_off_next * 2).min(HOLD_OFF_MAX);
        } else {
            self.hold_off_next = HOLD_OFF_MIN;
        }
        self.window_spins = 0;
        self.window_caught = 0;
        self.window_spun_ns = 0;
    }
}

/// What a driven wait waits on.
pub trait Wait {
    type Error;
    /// Whether the event is there, without blocking.
    fn ready(&mut self) -> Result<bool, Self::Error>;
    /// Block until the event or `timeout` (`None`: the caller's own deadline); whether the
    /// wait should end (the event came, or something else that needs the caller).
    fn sleep(&mut self, timeout: Option<Duration>) -> Result<bool, Self::Error>;
}

/// Drive one wait by `waiter`'s plan with a real clock: a timed sleep, a spin on
/// [`Wait::ready`], then [`Wait::sleep`] without a timeout. Returns what ended it: `true` when
/// the event (or a wake-up) came, `false` when the final sleep ran out. An error ends the wait
/// at once. With polling off it only sleeps, reads no clock and counts nothing.
pub fn wait<W: Wait>(waiter: &mut Waiter, w: &mut W) -> Result<bool, W::Error> {
    if waiter.mode.is_off() {
        return w.sleep(None);
    }
    let plan = waiter.plan();
    let start = Instant::now();
    let mut preempted = false;
    let finish = |waiter: &mut Waiter, ended, spun_ns, overshoot_ns, preempted| {
        let waited_ns = start.elapsed().as_nanos() as u64;
        waiter.handle_outcome(plan, Outcome { ended, waited_ns, spun_ns, overshoot_ns, preempted });
    };
    let mut overshoot_ns = None;
    if plan.sleep_ns > 0 {
        tight_timer_slack();
        if w.sleep(Some(Duration::from_nanos(plan.sleep_ns)))? {
            finish(waiter, Ended::Sleeping, 0, None, false);
            return Ok(true);
        }
        overshoot_ns = Some((start.elapsed().as_nanos() as u64).saturating_sub(plan.sleep_ns));
    }
    if plan.spin_ns > 0 {
        let spin_start = Instant::now();
        let spin_until = spin_start + Duration::from_nanos(plan.spin_ns);
        let mut last_look = spin_start;
        let mut first_look = plan.sleep_ns == 0;
        loop {
            if w.ready()? {
                let ended = if first_look { Ended::Immediately } else { Ended::Spinning };
                finish(waiter, ended, spin_start.elapsed().as_nanos() as u64, overshoot_ns, preempted);
                return Ok(true);
            }
            first_look = false;
            let now = Instant::now();
            // A look takes a syscall, about a microsecond; a long gap between two is time the
            // core went to another thread.
            preempted |= now - last_look > PREEMPTED_GAP;
            last_look = now;
            if now >= spin_until {
                break;
            }
            std::hint::spin_loop();
        }
    }
    let woke = w.sleep(None)?;
    finish(waiter, Ended::Blocked, plan.spin_ns, overshoot_ns, preempted);
    Ok(woke)
}

/// Ask the kernel to end this thread's timed sleeps on time instead of up to 50 µs late (the
/// default timer slack lets it gather wake-ups). Cheap; failure only costs precision.
pub fn tight_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK takes an integer argument and touches no memory of ours.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0 as libc::c_ulong, 0 as libc::c_ulong, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;

    /// A virtual-clock model of one side of a connection: waking from any sleep costs `wake_ns`
    /// of latency and of CPU, spinning costs its time in CPU.
    struct Model {
        wake_ns: u64,
        /// The peer shares the waiter's core and the scheduler runs it in the middle of a
        /// spin: whatever the spin then catches, it saved no switch.
        preempts: bool,
    }

    #[derive(Default, Debug)]
    struct Tally {
        latency_ns: u64,
        cpu_ns: u64,
        waits: u64,
    }

    impl Tally {
        fn latency_us(&self) -> f64 {
            self.latency_ns as f64 / self.waits as f64 / 1e3
        }
        fn cpu_us(&self) -> f64 {
            self.cpu_ns as f64 / self.waits as f64 / 1e3
        }
    }

    impl Model {
        /// Run `n` waits. `arrival(i, sleeps_at)` says when the event of wait `i` comes (from
        /// the wait's start), given when the waiter first lets go of its core: a peer on the
        /// same core can only run from then on. Latency runs from the event to the waiter
        /// seeing it; the first `skip` waits (learning) are not counted.
        fn run(&self, w: &mut Waiter, n: u64, skip: u64, arrival: impl Fn(u64, u64) -> u64) -> Tally {
            let mut t = Tally::default();
            let preempts = self.preempts;
            for i in 0..n {
                let plan = w.plan();
                let sleeps_at = if plan.sleep_ns > 0 { 0 } else { plan.spin_ns };
                let event = arrival(i, sleeps_at);
                let (ended, seen, spun, over, cpu) = if plan.sleep_ns > 0 && event < plan.sleep_ns {
                    (Ended::Sleeping, event + self.wake_ns, 0, None, self.wake_ns)
                } else {
                    let timed = plan.sleep_ns > 0;
                    let spin_from = if timed { plan.sleep_ns + self.wake_ns } else { 0 };
                    let (over, cpu0) = if timed { (Some(self.wake_ns), self.wake_ns) } else { (None, 0) };
                    let spin_end = spin_from + plan.spin_ns;
                    if plan.spin_ns > 0 && event <= spin_end {
                        let seen = event.max(spin_from);
                        (Ended::Spinning, seen, seen - spin_from, over, cpu0 + seen - spin_from)
                    } else {
                        let seen = event.max(spin_end) + self.wake_ns;
                        (Ended::Blocked, seen, plan.spin_ns, over, cpu0 + plan.spin_ns + self.wake_ns)
                    }
                };
                let preempted = ended == Ended::Spinning && preempts;
                w.handle_outcome(
                    plan,
                    Outcome { ended, waited_ns: seen, spun_ns: spun, overshoot_ns: over, preempted },
                );
                if i >= skip {
                    t.waits += 1;
                    t.latency_ns += seen - event;
                    t.cpu_ns += cpu;
                }
            }
            t
        }
    }

    fn adaptive() -> Waiter {
        Waiter::new(PollMode::Adaptive(Duration::from_micros(50)))
    }

    const MODEL: Model = Model { wake_ns: 25 * US, preempts: false };

    #[test]
    fn spins_through_short_waits() {
        // Client and target apart, the peer answering 10 µs after each wait starts.
        let mut w = adaptive();
        let t = MODEL.run(&mut w, 2000, 200, |_, _| 10 * US);
        assert!(t.latency_us() < 1.0, "{t:?}");
        assert!(t.cpu_us() < 12.0, "{t:?}");
        assert_eq!(w.stats().held_off, 0);
    }

    #[test]
    fn stops_spinning_when_the_peer_needs_this_core() {
        // One core: the peer runs only once the waiter sleeps, and answers 8 µs after that.
        let mut w = adaptive();
        let t = MODEL.run(&mut w, 20_000, 200, |_, sleeps_at| sleeps_at + 8 * US);
        let mut fixed = Waiter::new(PollMode::Fixed(Duration::from_micros(50)));
        let f = MODEL.run(&mut fixed, 20_000, 200, |_, sleeps_at| sleeps_at + 8 * US);
        let mut off = Waiter::new(PollMode::Off);
        let o = MODEL.run(&mut off, 20_000, 200, |_, sleeps_at| sleeps_at + 8 * US);
        // Probing costs something, little: within 10% of never spinning, far below fixed.
        assert!(t.cpu_us() < o.cpu_us() * 1.1, "adaptive {t:?} off {o:?}");
        assert!(f.cpu_us() > o.cpu_us() * 2.5, "fixed {f:?} off {o:?}");
        assert!(w.stats().held_off > 18_000, "{:?}", w.stats());
    }

    #[test]
    fn a_spin_that_loses_its_core_saves_nothing() {
        // One core, and the scheduler preempts the spinner for the peer, which answers 8 µs
        // into the wait: the spin "catches" it, but the switch it meant to save happened.
        let shared_core = Model { wake_ns: 25 * US, preempts: true };
        let mut w = adaptive();
        shared_core.run(&mut w, 20_000, 0, |_, _| 8 * US);
        assert!(w.stats().held_off > 18_000, "{:?}", w.stats());
        assert_eq!(w.stats().caught, 0);
    }

    #[test]
    fn sleeps_through_the_predictable_part_of_long_waits() {
        // A paced peer: the event comes 400 µs after each wait starts, give or take 2 µs.
        let mut w = adaptive();
        let t = MODEL.run(&mut w, 3000, 300, |i, _| 400 * US + (i % 5) * 1_000);
        assert!(w.stats().timed_sleeps > 2500, "{:?}", w.stats());
        // Seen within a few µs of arriving (blocking would see it a wake-up late), for a
        // wake-up and a short spin of CPU.
        assert!(t.latency_us() < 5.0, "{t:?}");
        assert!(t.cpu_us() < 25.0 + 2.0 * 25.0, "{t:?}");
    }

    #[test]
    fn unpredictable_long_waits_cost_little_spin() {
        // Long waits of random length (a pseudo-random spread over 100-1100 µs).
        let mut w = adaptive();
        let mut off = Waiter::new(PollMode::Off);
        let gap = |i: u64, _| 100 * US + (i.wrapping_mul(2654435761) % 1000) * US;
        let t = MODEL.run(&mut w, 20_000, 500, gap);
        let o = MODEL.run(&mut off, 20_000, 500, gap);
        // Whatever it tries, it spends at most a few µs per wait more than sleeping at once.
        assert!(t.cpu_us() < o.cpu_us() + 10.0, "adaptive {t:?} off {o:?}");
    }

    #[test]
    fn mixed_waits_still_spin_when_the_short_ones_pay() {
        // Half the waits 6 µs, half 2 ms: catching the short ones saves more than the long
        // ones cost in spinning.
        let mut w = adaptive();
        let t = MODEL.run(&mut w, 4000, 400, |i, _| if i % 2 == 0 { 6 * US } else { 2000 * US });
        assert!(w.stats().caught > 1500, "{:?}", w.stats());
        let mut off = Waiter::new(PollMode::Off);
        let o = MODEL.run(&mut off, 4000, 400, |i, _| if i % 2 == 0 { 6 * US } else { 2000 * US });
        assert!(t.latency_us() < o.latency_us() * 0.7, "adaptive {t:?} off {o:?}");
    }

    #[test]
    fn returns_to_spinning_when_it_pays_again() {
        // First on one core, then apart: after the move the waits are caught again.
        let mut w = adaptive();
        MODEL.run(&mut w, 5000, 0, |_, sleeps_at| sleeps_at + 8 * US);
        let t = MODEL.run(&mut w, 10_000, 6000, |_, _| 10 * US);
        assert!(t.latency_us() < 1.0, "{t:?} {:?}", w.stats());
    }

    #[test]
    fn off_and_fixed_plans() {
        assert_eq!(Waiter::new(PollMode::Off).plan(), Plan::default());
        let mut f = Waiter::new(PollMode::Fixed(Duration::from_micros(20)));
        assert_eq!(f.plan(), Plan { sleep_ns: 0, spin_ns: 20 * US });
    }

    /// A scripted event source: ready at the `ready_at`-th look, and what each sleep says.
    struct Script {
        looks: u32,
        ready_at: u32,
        sleeps: Vec<Option<Duration>>,
        sleep_says: bool,
    }

    impl Wait for Script {
        type Error = ();
        fn ready(&mut self) -> Result<bool, ()> {
            self.looks += 1;
            Ok(self.looks >= self.ready_at)
        }
        fn sleep(&mut self, timeout: Option<Duration>) -> Result<bool, ()> {
            self.sleeps.push(timeout);
            Ok(self.sleep_says)
        }
    }

    #[test]
    fn drives_a_real_wait() {
        // The event is there at the second look: caught while spinning, no sleep.
        let mut w = Waiter::new(PollMode::Fixed(Duration::from_millis(100)));
        let mut s = Script { looks: 0, ready_at: 2, sleeps: vec![], sleep_says: true };
        assert_eq!(wait(&mut w, &mut s), Ok(true));
        assert!(s.sleeps.is_empty());
        assert_eq!(w.stats().caught, 1);
        // Off: straight to the untimed sleep, whose answer is passed on.
        let mut w = Waiter::new(PollMode::Off);
        let mut s = Script { looks: 0, ready_at: u32::MAX, sleeps: vec![], sleep_says: false };
        assert_eq!(wait(&mut w, &mut s), Ok(false));
        assert_eq!((s.looks, s.sleeps), (0, vec![None]));
    }

    #[test]
    fn drives_a_timed_sleep_then_a_spin() {
        // Taught that waits take 400 µs, the waiter sleeps most of the next one on a timer.
        let mut w = adaptive();
        MODEL.run(&mut w, 200, 0, |_, _| 400 * US);
        let mut s = Script { looks: 0, ready_at: 1, sleeps: vec![], sleep_says: false };
        assert_eq!(wait(&mut w, &mut s), Ok(true));
        assert_eq!(s.sleeps.len(), 1);
        let slept = s.sleeps[0].expect("a timed sleep");
        assert!(slept > Duration::from_micros(300) && slept < Duration::from_micros(400), "{slept:?}");
        assert_eq!(s.looks, 1);
    }
}
