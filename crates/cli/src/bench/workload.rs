//! One bench thread: a lane kept `qd` requests deep for the duration, with optional
//! verification.
//!
//! Under `--verify` each thread owns a disjoint slice of the volume and never has two requests
//! on one block at once, so the expected content of every block is exact: its offset, the seed
//! and the generation of the last acknowledged write. The slice is written in full first
//! (generation 0), and read back in full after the timed phase.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use initiator::{Completion, Lane, LaneStats, ReqFlags, SharedHandle, Status, WaitStats};
use rt::usage::Usage;
use wire::Opcode;

use super::pattern::{self, Rng};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Rw {
    Randread,
    Randwrite,
    Randrw,
    Read,
    Write,
}

impl Rw {
    fn is_random(self) -> bool {
        matches!(self, Rw::Randread | Rw::Randwrite | Rw::Randrw)
    }
}

/// Where a bench thread sends its requests (its own lane, or a handle on a shared one), and
/// the telemetry it reports of it.
pub trait BenchQueue: initiator::Queue<Vec<u8>> + Send {
    /// The lane's counters, when the lanes are this thread's alone.
    fn lane_stats(&self) -> Option<LaneStats> {
        None
    }
    fn batch_level(&self) -> u32 {
        0
    }
    fn batch_level_log(&self) -> Vec<initiator::BatchDecision> {
        Vec::new()
    }
    /// How the lane's waits went under hybrid polling (zero when not measured per thread).
    fn poll_stats(&self) -> WaitStats {
        WaitStats::default()
    }
    /// A raw-Ethernet lane's reliable-delivery counters (`None` for sockets and for a shared
    /// lane's handle).
    fn link_stats(&self) -> Option<initiator::LinkStats> {
        None
    }
}

impl BenchQueue for Lane {
    fn lane_stats(&self) -> Option<LaneStats> {
        Some(self.stats())
    }
    fn batch_level(&self) -> u32 {
        Lane::batch_level(self)
    }
    fn batch_level_log(&self) -> Vec<initiator::BatchDecision> {
        Lane::batch_level_log(self).to_vec()
    }
    fn poll_stats(&self) -> WaitStats {
        Lane::poll_stats(self)
    }
    fn link_stats(&self) -> Option<initiator::LinkStats> {
        Lane::link_stats(self)
    }
}

/// Shared lanes report their counters and levels once, from the main thread.
impl BenchQueue for SharedHandle {}

/// A mapped RStore segment: its lanes' counters together; no batch level of its own.
impl BenchQueue for rstore::Segment {
    fn lane_stats(&self) -> Option<LaneStats> {
        Some(rstore::Segment::lane_stats(self))
    }
}

/// What one thread does.
#[derive(Debug, Clone)]
pub struct Workload {
    pub rw: Rw,
    pub read_pct: u32,
    pub bs: u32,
    pub qd: usize,
    /// Byte range of the volume this thread uses.
    pub region_start: u64,
    pub region_len: u64,
    pub duration: Duration,
    pub verify: bool,
    /// Read the whole region once before the timed phase.
    pub warm: bool,
    /// Writes carry FUA.
    pub fua: bool,
    /// Read one block before the timed phase, to earn the volume's reference (with the write
    /// right) so that writes go direct from the first (`--direct-reads` on a workload that
    /// writes).
    pub earn: bool,
    pub seed: u64,
    /// Open loop: start an I/O every this long (each thread its share of `--rate`), whatever
    /// is in flight; `None` keeps the queue full.
    pub pace: Option<Duration>,
}

/// What one thread measured in its timed phase (and, for verification, around it).
pub struct ThreadResult {
    pub ios: u64,
    pub bytes: u64,
    pub io_errors: u64,
    pub first_error: Option<Status>,
    pub verify_errors: u64,
    pub verify_first: Option<String>,
    pub latency_ns: Histogram<u64>,
    pub usage: Usage,
    pub lane: LaneStats,
    pub batch_level: u32,
    pub batch_level_log: Vec<initiator::BatchDecision>,
    /// The lane's hybrid polling over the whole run (warm-up included).
    pub poll: WaitStats,
    /// The lane's reliable delivery over raw Ethernet, over the whole run.
    pub link: Option<initiator::LinkStats>,
}

/// Barriers the main thread uses to take target stats exactly around the timed phase.
pub struct Phases {
    pub timed_start: Barrier,
    pub timed_end: Barrier,
    pub ios_done: AtomicU64,
}

struct Slot {
    buf: Option<Vec<u8>>,
    started: Instant,
    block: u64,
    generation: u32,
}

/// Generation of a block whose content is unknown (a write to it failed).
const UNKNOWN: u32 = u32::MAX;

struct Runner<'a, Q> {
    w: &'a Workload,
    lane: Q,
    slots: Vec<Slot>,
    free: Vec<usize>,
    rng: Rng,
    cursor: u64,
    blocks: u64,
    generations: Vec<u32>,
    busy: Vec<bool>,
    done: Vec<Completion>,
    r: ThreadResult,
    timing: bool,
    /// Barriers of [`Phases`] this thread has passed (0, 1 or 2).
    barriers_passed: u8,
}

pub fn run<Q: BenchQueue>(
    w: &Workload,
    lane: Q,
    phases: Arc<Phases>,
    thread: usize,
) -> Result<ThreadResult, initiator::Error> {
    let blocks = w.region_len / u64::from(w.bs);
    let tracked = if w.verify { blocks as usize } else { 0 };
    let mut run = Runner {
        lane,
        slots: (0..w.qd)
            .map(|_| Slot {
                buf: Some(vec![0; w.bs as usize]),
                started: Instant::now(),
                block: 0,
                generation: 0,
            })
            .collect(),
        free: (0..w.qd).rev().collect(),
        rng: Rng::new(w.seed ^ (thread as u64).wrapping_mul(0x1000_0001)),
        cursor: 0,
        blocks,
        generations: vec![0; tracked],
        busy: vec![false; tracked],
        done: Vec::with_capacity(w.qd),
        r: ThreadResult {
            ios: 0,
            bytes: 0,
            io_errors: 0,
            first_error: None,
            verify_errors: 0,
            verify_first: None,
            latency_ns: Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("static histogram bounds"),
            usage: Usage::default(),
            lane: LaneStats::default(),
            batch_level: 0,
            batch_level_log: Vec::new(),
            poll: WaitStats::default(),
            link: None,
        },
        timing: false,
        barriers_passed: 0,
        w,
    };
    let outcome = run.phases(&phases);
    if outcome.is_err() {
        // Never leave the main thread waiting at a barrier for a thread that failed: pass the
        // ones this thread has not passed yet, and only those.
        if run.barriers_passed < 1 {
            phases.timed_start.wait();
        }
        if run.barriers_passed < 2 {
            phases.timed_end.wait();
        }
    }
    outcome?;
    Ok(run.r)
}

impl<Q: BenchQueue> Runner<'_, Q> {
    fn phases(&mut self, phases: &Phases) -> Result<(), initiator::Error> {
        if self.w.verify {
            self.sweep(Opcode::Write)?;
        }
        if self.w.warm {
            self.sweep(Opcode::Read)?;
        }
        if self.w.earn {
            let i = self.free.pop().expect("every slot is free before the timed phase");
            self.submit(i, Opcode::Read, 0)?;
            self.drain()?;
        }
        phases.timed_start.wait();
        self.barriers_passed = 1;
        let before = rt::usage::this_thread();
        let lane_before = self.lane.lane_stats();
        self.timing = true;
        self.timed(phases)?;
        self.timing = false;
        self.r.usage = rt::usage::this_thread().since(&before);
        if let (Some(now), Some(before)) = (self.lane.lane_stats(), lane_before) {
            self.r.lane = now.since(&before);
        }
        self.r.batch_level = self.lane.batch_level();
        self.r.batch_level_log = self.lane.batch_level_log();
        self.r.poll = self.lane.poll_stats();
        self.r.link = self.lane.link_stats();
        phases.timed_end.wait();
        self.barriers_passed = 2;
        if self.w.verify {
            self.sweep(Opcode::Read)?;
        }
        Ok(())
    }

    fn timed(&mut self, phases: &Phases) -> Result<(), initiator::Error> {
        if let Some(pace) = self.w.pace {
            return self.timed_paced(phases, pace);
        }
        let deadline = Instant::now() + self.w.duration;
        let mut unreported = 0u64;
        while Instant::now() < deadline {
            while let Some(i) = self.free.pop() {
                let Some((op, block)) = self.choose() else {
                    self.free.push(i);
                    break;
                };
                self.submit(i, op, block)?;
            }
            self.lane.wait(1, &mut self.done)?;
            unreported += self.complete_all() as u64;
            if unreported >= 256 {
                phases.ios_done.fetch_add(unreported, Relaxed);
                unreported = 0;
            }
        }
        self.drain()?;
        phases.ios_done.fetch_add(unreported, Relaxed);
        Ok(())
    }

    /// The open loop of `--rate`: one I/O every `pace`, on time (a tick missed is skipped, not
    /// made up in a burst); completions are reaped as they come, waited for only when every
    /// slot is busy. The thread sleeps between ticks, so a light load shows what each side's
    /// waiting costs.
    fn timed_paced(&mut self, phases: &Phases, pace: Duration) -> Result<(), initiator::Error> {
        rt::poll::tight_timer_slack();
        let start = Instant::now();
        let deadline = start + self.w.duration;
        let mut next = start;
        let mut ios = 0u64;
        while next < deadline {
            let now = Instant::now();
            if now < next {
                std::thread::sleep(next - now);
            }
            next = (next + pace).max(Instant::now());
            if self.free.is_empty() {
                self.lane.wait(1, &mut self.done)?;
                ios += self.complete_all() as u64;
            }
            let i = self.free.pop().expect("a slot is free after the wait");
            match self.choose() {
                Some((op, block)) => self.submit(i, op, block)?,
                None => self.free.push(i),
            }
            // Reap what is due now; at QD 1 that is the I/O just sent, so wait for it.
            if self.free.is_empty() {
                self.lane.wait(1, &mut self.done)?;
            } else {
                self.lane.poll(&mut self.done)?;
            }
            ios += self.complete_all() as u64;
        }
        self.drain()?;
        phases.ios_done.fetch_add(ios, Relaxed);
        Ok(())
    }

    /// Write (generation 0) or read back and check every block of the region.
    fn sweep(&mut self, op: Opcode) -> Result<(), initiator::Error> {
        for block in 0..self.blocks {
            while self.free.is_empty() {
                self.lane.wait(1, &mut self.done)?;
                self.complete_all();
            }
            let i = self.free.pop().expect("checked non-empty");
            self.submit(i, op, block)?;
        }
        self.drain()
    }

    fn drain(&mut self) -> Result<(), initiator::Error> {
        while self.free.len() < self.slots.len() {
            self.lane.wait(1, &mut self.done)?;
            self.complete_all();
        }
        Ok(())
    }

    /// Pick the next operation and block; `None` when verification finds no idle block soon.
    fn choose(&mut self) -> Option<(Opcode, u64)> {
        let op = match self.w.rw {
            Rw::Randread | Rw::Read => Opcode::Read,
            Rw::Randwrite | Rw::Write => Opcode::Write,
            Rw::Randrw => {
                if self.rng.below(100) < u64::from(self.w.read_pct) {
                    Opcode::Read
                } else {
                    Opcode::Write
                }
            }
        };
        for _ in 0..8 {
            let block = if self.w.rw.is_random() {
                self.rng.below(self.blocks)
            } else {
                let b = self.cursor;
                self.cursor = (self.cursor + 1) % self.blocks;
                b
            };
            if !self.w.verify || !self.busy[block as usize] {
                return Some((op, block));
            }
        }
        None
    }

    fn submit(&mut self, i: usize, op: Opcode, block: u64) -> Result<(), initiator::Error> {
        let offset = self.w.region_start + block * u64::from(self.w.bs);
        let slot = &mut self.slots[i];
        let mut buf = slot.buf.take().expect("free slots own their buffer");
        slot.block = block;
        if self.w.verify {
            let b = block as usize;
            self.busy[b] = true;
            slot.generation = match op {
                Opcode::Write if self.generations[b] == UNKNOWN => 0,
                Opcode::Write if self.timing => self.generations[b] + 1,
                _ => self.generations[b],
            };
            if op == Opcode::Write {
                pattern::fill(&mut buf, self.w.seed, offset, slot.generation);
            }
        }
        slot.started = Instant::now();
        let submitted = match op {
            Opcode::Read => self.lane.submit_read(offset, buf, i as u64),
            _ => {
                let flags = if self.w.fua { ReqFlags::FUA } else { ReqFlags::empty() };
                self.lane.submit_write(offset, buf, flags, i as u64)
            }
        };
        submitted.map_err(|rejected| {
            self.slots[i].buf = rejected.buf;
            rejected.error
        })
    }

    fn complete_all(&mut self) -> usize {
        let n = self.done.len();
        for c in std::mem::take(&mut self.done) {
            self.complete(c);
        }
        n
    }

    fn complete(&mut self, c: Completion) {
        let i = c.user_data as usize;
        let slot = &mut self.slots[i];
        let buf = c.buf.expect("reads and writes carry their buffer back");
        if self.timing {
            let ns = slot.started.elapsed().as_nanos() as u64;
            let _ = self.r.latency_ns.record(ns.max(1));
            self.r.ios += 1;
            self.r.bytes += u64::from(self.w.bs);
        }
        if !c.status.is_ok() {
            self.r.io_errors += 1;
            self.r.first_error.get_or_insert(c.status);
        }
        if self.w.verify {
            let b = slot.block as usize;
            self.busy[b] = false;
            let offset = self.w.region_start + slot.block * u64::from(self.w.bs);
            match (c.opcode, c.status.is_ok()) {
                (Opcode::Write, true) => self.generations[b] = slot.generation,
                (Opcode::Write, false) => self.generations[b] = UNKNOWN,
                (Opcode::Read, true) if slot.generation != UNKNOWN => {
                    if let Some(at) = pattern::first_mismatch(&buf, self.w.seed, offset, slot.generation) {
                        self.r.verify_errors += 1;
                        self.r.verify_first.get_or_insert_with(|| {
                            format!(
                                "offset {offset}: byte {at} differs (expected generation {})",
                                slot.generation
                            )
                        });
                    }
                }
                _ => {}
            }
        }
        slot.buf = Some(buf);
        self.free.push(i);
    }
}
