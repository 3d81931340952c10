//! The adaptive batch controller against a model whose best level is known: a closed loop of
//! `outstanding` requests between one client core and one target core (or one core for both),
//! with a cost per message and per request on each side and a one-way latency for the link,
//! on a virtual clock. The best static level of each placement is found by running every level
//! of the grid; the controller, started cold, must reach 0.9× of it and 0.95× of no batching
//! (issue 14's aims) over the same two seconds that `skiff bench` measures a point for.
//!
//! The model follows what a shared lane does: a completion caravan makes its requests'
//! threads submit again, each submission joins the open caravan, and the caravan leaves when it
//! holds `level` requests, when its doorbell delay runs out, or when every request is in it
//! (nothing on the wire could add more: `wait_loop`'s rule). The target answers each request
//! caravan with one completion caravan.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use skiff_proto::batch::{BatchConfig, BatchController};

/// Costs in nanoseconds; `None` for `target_core` puts the target on the client's core.
#[derive(Debug, Clone, Copy)]
struct Machine {
    name: &'static str,
    outstanding: u32,
    /// Client CPU per caravan sent, per request submitted, per completion caravan received,
    /// per completion handed back.
    client_send: u64,
    client_req: u64,
    client_recv: u64,
    client_cpl: u64,
    /// Target CPU per caravan (receive and the reply's send) and per request.
    target_msg: u64,
    target_req: u64,
    /// One way, sender to receiver: the wire and the wake-up at the other end.
    latency: u64,
    /// Client and target share one core.
    one_core: bool,
    /// Each cost is scaled by a factor drawn uniformly from 1 ± `jitter`.
    jitter: f64,
}

/// How the client batches: a fixed level with a fixed delay, or the controller.
enum Policy {
    Static { level: u32, delay_ns: u64 },
    Adaptive(BatchController),
}

impl Policy {
    fn level(&self) -> u32 {
        match self {
            Policy::Static { level, .. } => *level,
            Policy::Adaptive(c) => c.level(),
        }
    }

    fn delay_ns(&self) -> u64 {
        match self {
            Policy::Static { delay_ns, .. } => *delay_ns,
            Policy::Adaptive(c) => c.delay_us() * 1000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A request caravan of this many requests reaches the target.
    AtTarget(u32),
    /// A completion caravan of this many reaches the client.
    AtClient(u32),
    /// The open caravan with this number may have waited out its delay.
    Doorbell(u64),
}

struct Model {
    m: Machine,
    now: u64,
    client_free: u64,
    target_free: u64,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    open: u32,
    /// Number of the open caravan, for its doorbell timer.
    caravan: u64,
    /// Requests the client holds (in the open caravan, or completed and not yet resubmitted).
    at_client: u32,
    completed: u64,
    rng: u64,
    levels: Vec<u32>,
}

impl Model {
    fn new(m: Machine, seed: u64) -> Model {
        Model {
            m,
            now: 0,
            client_free: 0,
            target_free: 0,
            events: BinaryHeap::new(),
            seq: 0,
            open: 0,
            caravan: 0,
            at_client: 0,
            completed: 0,
            rng: seed | 1,
            levels: Vec::new(),
        }
    }

    fn cost(&mut self, ns: u64) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let unit = (self.rng >> 11) as f64 / (1u64 << 53) as f64;
        (ns as f64 * (1.0 + self.m.jitter * (2.0 * unit - 1.0))) as u64
    }

    fn at(&mut self, t: u64, e: Event) {
        self.seq += 1;
        self.events.push(Reverse((t, self.seq, e)));
    }

    /// Run `ns` of CPU on the client's core from `from`; returns when it is done.
    fn client_cpu(&mut self, from: u64, ns: u64) -> u64 {
        let ns = self.cost(ns);
        let start = from.max(self.client_free);
        self.client_free = start + ns;
        if self.m.one_core {
            self.target_free = self.target_free.max(self.client_free);
        }
        self.client_free
    }

    fn target_cpu(&mut self, from: u64, ns: u64) -> u64 {
        let ns = self.cost(ns);
        let (free, other) = if self.m.one_core {
            (self.client_free.max(self.target_free), true)
        } else {
            (self.target_free, false)
        };
        let start = from.max(free);
        self.target_free = start + ns;
        if other {
            self.client_free = self.target_free;
        }
        self.target_free
    }

    fn send(&mut self, from: u64) {
        let done = self.client_cpu(from, self.m.client_send);
        let n = self.open;
        self.open = 0;
        self.at_client -= n;
        self.caravan += 1;
        self.at(done + self.m.latency, Event::AtTarget(n));
    }

    /// One request joins the open caravan at `t` (on the client's core).
    fn submit(&mut self, t: u64, policy: &mut Policy) -> u64 {
        let t = self.client_cpu(t, self.m.client_req);
        if let Policy::Adaptive(c) = policy {
            // A lane's a_out: everything outstanding on it.
            c.handle_arrival(self.m.outstanding - (self.at_client - self.open - 1));
        }
        self.open += 1;
        if self.open == 1 && policy.delay_ns() > 0 {
            let caravan = self.caravan;
            self.at(t + policy.delay_ns(), Event::Doorbell(caravan));
        }
        let all_here = self.open == self.m.outstanding;
        if self.open >= policy.level() || policy.delay_ns() == 0 || all_here {
            self.send(t);
        }
        self.client_free
    }

    /// Completions per second over `seconds` of virtual time.
    fn run(mut self, policy: &mut Policy, seconds: f64) -> (f64, Vec<u32>) {
        let end = (seconds * 1e9) as u64;
        self.at_client = self.m.outstanding;
        let mut t = 0;
        for _ in 0..self.m.outstanding {
            t = self.submit(t, policy);
        }
        while let Some(Reverse((time, _, event))) = self.events.pop() {
            if time > end {
                break;
            }
            self.now = time;
            match event {
                Event::AtTarget(n) => {
                    let cost = self.m.target_msg + u64::from(n) * self.m.target_req;
                    let done = self.target_cpu(time, cost);
                    self.at(done + self.m.latency, Event::AtClient(n));
                }
                Event::AtClient(n) => {
                    let cost = self.m.client_recv + u64::from(n) * self.m.client_cpl;
                    let mut t = self.client_cpu(time, cost);
                    self.completed += u64::from(n);
                    self.at_client += n;
                    if let Policy::Adaptive(c) = policy {
                        c.handle_completion(u64::from(n) * 4096);
                    }
                    for _ in 0..n {
                        t = self.submit(t, policy);
                    }
                }
                Event::Doorbell(caravan) => {
                    if caravan == self.caravan && self.open > 0 {
                        self.send(time);
                    }
                }
            }
            if let Policy::Adaptive(c) = policy {
                if let Some(d) = c.poll(self.now / 1000) {
                    self.levels.push(d.level);
                }
            }
        }
        (self.completed as f64 / seconds, self.levels)
    }
}

const SECONDS: f64 = 2.0;
const GRID: [u32; 7] = [1, 2, 4, 8, 16, 32, 64];
/// `skiff bench --batching static:N` keeps the doorbell's default delay bound.
const STATIC_DELAY_NS: u64 = 50_000;

fn static_iops(m: Machine, level: u32, seed: u64) -> f64 {
    let delay_ns = if level == 1 { 0 } else { STATIC_DELAY_NS };
    Model::new(m, seed).run(&mut Policy::Static { level, delay_ns }, SECONDS).0
}

fn adaptive(m: Machine, seed: u64) -> (f64, Vec<u32>) {
    let mut policy = Policy::Adaptive(BatchController::new(BatchConfig::default()));
    Model::new(m, seed).run(&mut policy, SECONDS)
}

/// Every static level, then the controller: the controller within the aims.
fn check(m: Machine) -> (u32, f64) {
    let statics: Vec<(u32, f64)> = GRID.iter().map(|&l| (l, static_iops(m, l, 7))).collect();
    let &(best_level, best) = statics.iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
    let off = statics[0].1;
    let (iops, levels) = adaptive(m, 7);
    let table: Vec<String> = statics.iter().map(|(l, x)| format!("{l}: {:.0}K", x / 1e3)).collect();
    let report = format!(
        "{}: adaptive {:.0}K, {:.2}x the best static (level {best_level}, {:.0}K), {:.2}x off; statics {}; levels {:?}",
        m.name,
        iops / 1e3,
        iops / best,
        best / 1e3,
        iops / off,
        table.join(", "),
        levels
    );
    eprintln!("{report}");
    assert!(iops >= 0.9 * best, "{report}");
    assert!(iops >= 0.95 * off, "{report}");
    (best_level, best / off)
}

/// Two cores, client and target apart: a send or receive costs several requests' worth, and
/// each way pays a cross-core wake-up. Roughly this VM pinned apart.
fn apart(outstanding: u32) -> Machine {
    Machine {
        name: "apart",
        outstanding,
        client_send: 4_000,
        client_req: 700,
        client_recv: 5_000,
        client_cpl: 700,
        target_msg: 6_000,
        target_req: 1_200,
        latency: 35_000,
        one_core: false,
        jitter: 0.3,
    }
}

/// One core for both: no wake-up latency to speak of, but every cost lands on the same core.
fn together(outstanding: u32) -> Machine {
    Machine { name: "one core", latency: 3_000, one_core: true, ..apart(outstanding) }
}

/// Cheap messages (a kernel-bypass NIC, say): batching saves little and waiting costs.
fn cheap_messages(outstanding: u32) -> Machine {
    Machine {
        name: "cheap messages",
        client_send: 300,
        client_recv: 300,
        target_msg: 400,
        latency: 10_000,
        ..apart(outstanding)
    }
}

#[test]
fn many_outstanding_apart_batching_helps_and_the_controller_finds_it() {
    for outstanding in [64, 256, 512] {
        let (best_level, gain) = check(apart(outstanding));
        assert!(
            best_level > 1 && gain > 1.2,
            "the model should reward batching here: level {best_level}, ×{gain:.2}"
        );
    }
}

#[test]
fn few_outstanding_apart_the_controller_costs_nothing() {
    for outstanding in [4, 8, 16] {
        check(apart(outstanding));
    }
}

#[test]
fn one_core_for_both_sides() {
    for outstanding in [4, 16, 64, 256] {
        check(together(outstanding));
    }
}

#[test]
fn where_batching_hurts_the_controller_stays_low() {
    for outstanding in [8, 32, 128] {
        check(cheap_messages(outstanding));
    }
}
