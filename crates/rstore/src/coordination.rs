//! The coordination service of RStore's applications (thesis 6.5.1, "global barrier
//! synchronization"; docs/RSTORE.md): a [`Board`] in a mapped namespace through which one
//! coordinator and its workers, processes on any machine that share nothing but the namespace,
//! move through numbered phases together.
//!
//! Layout, from byte `at` of the segment (`Board::bytes` in all):
//!
//! | sector | what |
//! |---|---|
//! | 0 | status bytes: the coordinator's at byte 0, worker `i`'s at byte `1 + i` |
//! | 1 | heartbeats: a little-endian `u32` each, the coordinator's first, then worker `i`'s |
//! | 2 | the coordinator's area: what it tells every worker (the phase's orders, or why it aborted) |
//! | 3 + i | worker `i`'s assignment (written by the coordinator) |
//! | 3 + W + i | worker `i`'s report (written by the worker; the W reports are read in one request) |
//!
//! Turns. The coordinator writes the assignments and its area, then its status byte: "phase
//! `p`" (`Board::start`). A worker that reads "phase `p`" reads its assignment, works, writes its
//! report, then its status byte: "finished `p`" or "error" (`Board::report`, `Board::fail`).
//! The coordinator, once every worker has finished `p`, reads their reports and starts `p + 1`,
//! or says done. Each status byte is written by one party only and each area is read only after
//! the status byte that announces it, so no two processes ever write the same byte, and a
//! status byte is a one-byte write: atomic on a memory server's pool (served at a one-byte
//! block), leaving its neighbours alone, and written only once what it announces is
//! acknowledged. Phases are told apart modulo [`PHASE_TAGS`]: the parties are never more than
//! one phase apart.
//!
//! Nobody waits for ever. A worker's error ends the run with its message, naming it. Every
//! party beats: a [`Heartbeat`] thread bumps its counter every [`BEAT`], through a mapping of
//! its own, so a process that dies or hangs on any machine stops beating, and whoever waits for
//! it gives up once its counter stood still for the board's `dead_after`. A coordinator that
//! gives up (or is told by its caller that a worker process exited) aborts: its status byte
//! says so and its area says why, and every worker waiting reads it and stops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use initiator::{Error, Result};

use crate::segment::Segment;

/// Workers on one board at most.
pub const WORKERS_MAX: usize = 64;
/// Bytes of a sector: each area is one.
pub const SECTOR: usize = 512;
/// Phases are told apart modulo this many.
pub const PHASE_TAGS: u64 = 250;
/// How often a [`Heartbeat`] beats.
pub const BEAT: Duration = Duration::from_millis(100);

/// Status bytes besides the phase tags `1..=PHASE_TAGS`.
const IDLE: u8 = 0;
const DONE: u8 = 0xFD;
const ERROR: u8 = 0xFE;
const ABORT: u8 = 0xFF;

fn tag(phase: u64) -> u8 {
    1 + (phase % PHASE_TAGS) as u8
}

/// Who a status byte, heartbeat or area belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Party {
    Coordinator,
    Worker(usize),
}

impl Party {
    fn index(self) -> usize {
        match self {
            Party::Coordinator => 0,
            Party::Worker(i) => 1 + i,
        }
    }
}

impl std::fmt::Display for Party {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Party::Coordinator => f.write_str("the coordinator"),
            Party::Worker(i) => write!(f, "worker {i}"),
        }
    }
}

/// What a worker waiting for the coordinator learns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Phase `p` started: the coordinator's area and this worker's assignment are written.
    Phase(u64),
    /// The run is over.
    Done,
}

/// Why a wait ended without what it waited for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// A worker reported an error: its message.
    Failed { worker: usize, why: String },
    /// A party's heartbeat stood still for the board's `dead_after`.
    Silent { who: Party, for_: Duration },
    /// The coordinator aborted the run: its reason.
    Aborted(String),
    /// The caller's watch said so (a worker process exited, say).
    Watch(String),
    /// RStore failed under the board.
    Io(String),
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stop::Failed { worker, why } => write!(f, "worker {worker} failed: {why}"),
            Stop::Silent { who, for_ } => {
                write!(f, "{who} stopped beating (no heartbeat for {:.1} s)", for_.as_secs_f64())
            }
            Stop::Aborted(why) => write!(f, "the coordinator aborted the run: {why}"),
            Stop::Watch(why) => f.write_str(why),
            Stop::Io(e) => write!(f, "the board: {e}"),
        }
    }
}

impl std::error::Error for Stop {}

impl From<Error> for Stop {
    fn from(e: Error) -> Stop {
        Stop::Io(e.to_string())
    }
}

/// A coordination board of `workers` workers at byte `at` of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Board {
    at: u64,
    workers: usize,
    /// Poll interval of every wait.
    pub poll: Duration,
    /// A party whose heartbeat stands still this long is taken for dead.
    pub dead_after: Duration,
    /// How long a worker waits for its first phase while the coordinator does not beat: a
    /// worker started by hand may come before its run, on a board an earlier run left.
    pub first_wait: Duration,
}

/// Heartbeats that stood still: the last value seen of each party and since when.
struct Pulse {
    seen: Vec<(u32, Instant)>,
}

impl Pulse {
    fn new(parties: usize) -> Pulse {
        Pulse { seen: vec![(0, Instant::now()); parties] }
    }

    /// Note `beats` (one per party); the first party in `watch` whose counter stood still for
    /// `dead_after`, if any.
    fn check(
        &mut self,
        beats: &[u32],
        watch: impl Iterator<Item = usize>,
        dead_after: Duration,
    ) -> Option<(usize, Duration)> {
        let now = Instant::now();
        let mut dead = None;
        for i in watch {
            let (last, since) = &mut self.seen[i];
            if beats[i] != *last {
                *last = beats[i];
                *since = now;
            } else if dead.is_none() && now - *since >= dead_after {
                dead = Some((i, now - *since));
            }
        }
        dead
    }
}

impl Board {
    /// Bytes a board of `workers` takes.
    pub const fn bytes(workers: usize) -> u64 {
        ((3 + 2 * workers) * SECTOR) as u64
    }

    /// The board of `workers` (1 to [`WORKERS_MAX`]) at byte `at`, which a sector divides.
    pub fn new(at: u64, workers: usize) -> Result<Board> {
        if workers == 0 || workers > WORKERS_MAX {
            return Err(Error::InvalidArgument("a board holds 1 to 64 workers"));
        }
        if !at.is_multiple_of(SECTOR as u64) {
            return Err(Error::InvalidArgument("a board starts on a sector"));
        }
        Ok(Board {
            at,
            workers,
            poll: Duration::from_millis(1),
            dead_after: Duration::from_secs(5),
            first_wait: Duration::from_secs(60),
        })
    }

    pub fn workers(&self) -> usize {
        self.workers
    }

    fn status_at(&self, who: Party) -> u64 {
        self.at + who.index() as u64
    }

    fn beat_at(&self, who: Party) -> u64 {
        self.at + SECTOR as u64 + 4 * who.index() as u64
    }

    fn coordinator_area(&self) -> u64 {
        self.at + 2 * SECTOR as u64
    }

    fn assignment_at(&self, i: usize) -> u64 {
        self.at + ((3 + i) * SECTOR) as u64
    }

    fn report_at(&self, i: usize) -> u64 {
        self.at + ((3 + self.workers + i) * SECTOR) as u64
    }

    fn check_worker(&self, i: usize) -> Result<()> {
        if i >= self.workers {
            return Err(Error::InvalidArgument("no such worker on the board"));
        }
        Ok(())
    }

    /// Clear the whole board (one write): before a run, so that nothing of an earlier one
    /// counts.
    pub fn reset(&self, seg: &mut Segment) -> Result<()> {
        seg.write(self.at, &vec![0; Board::bytes(self.workers) as usize])
    }

    // The coordinator's side.

    /// Write worker `i`'s assignment (at most a sector) for the phase about to start.
    pub fn assign(&self, seg: &mut Segment, i: usize, data: &[u8]) -> Result<()> {
        self.check_worker(i)?;
        seg.write(self.assignment_at(i), &sector(data)?)
    }

    /// Start phase `phase`, telling every worker `orders` (at most a sector): the coordinator's
    /// area, then its status byte.
    pub fn start(&self, seg: &mut Segment, phase: u64, orders: &[u8]) -> Result<()> {
        seg.write(self.coordinator_area(), &sector(orders)?)?;
        seg.write(self.status_at(Party::Coordinator), &[tag(phase)])
    }

    /// Say the run is over.
    pub fn finish(&self, seg: &mut Segment) -> Result<()> {
        seg.write(self.status_at(Party::Coordinator), &[DONE])
    }

    /// Abort the run: every worker waiting reads `why` and stops.
    pub fn abort(&self, seg: &mut Segment, why: &str) -> Result<()> {
        seg.write(self.coordinator_area(), &text_sector(why))?;
        seg.write(self.status_at(Party::Coordinator), &[ABORT])
    }

    /// Wait until every worker finished `phase` and return their reports, in order. Stops at a
    /// worker's error, at a worker that stopped beating, or when `watch` (called every poll)
    /// says so; the board is aborted then, with the reason, so that the other workers stop too.
    pub fn gather(
        &self,
        seg: &mut Segment,
        phase: u64,
        mut watch: impl FnMut() -> std::result::Result<(), String>,
    ) -> std::result::Result<Vec<Vec<u8>>, Stop> {
        let want = tag(phase);
        let mut status = vec![0u8; 1 + self.workers];
        let mut beats = vec![0u8; 4 * (1 + self.workers)];
        let mut pulse = Pulse::new(1 + self.workers);
        let mut last_beats = Instant::now() - BEAT;
        let stop = loop {
            seg.read(self.at, &mut status)?;
            let workers = &status[1..];
            if let Some(i) = workers.iter().position(|&s| s == ERROR) {
                let why = read_text(seg, self.report_at(i))?;
                break Stop::Failed { worker: i, why };
            }
            if workers.iter().all(|&s| s == want) {
                let mut all = vec![0u8; SECTOR * self.workers];
                seg.read(self.report_at(0), &mut all)?;
                return Ok(all.chunks_exact(SECTOR).map(<[u8]>::to_vec).collect());
            }
            if let Err(why) = watch() {
                // A worker that failed says why before it exits: its own reason comes first.
                seg.read(self.at, &mut status)?;
                if let Some(i) = status[1..].iter().position(|&s| s == ERROR) {
                    let why = read_text(seg, self.report_at(i))?;
                    break Stop::Failed { worker: i, why };
                }
                break Stop::Watch(why);
            }
            // Heartbeats change every BEAT: read them no more often than that.
            if last_beats.elapsed() >= BEAT {
                last_beats = Instant::now();
                seg.read(self.beat_at(Party::Coordinator), &mut beats)?;
                let counters = u32s(&beats);
                // Only the workers that have not finished yet are waited for.
                let waiting = (0..self.workers).filter(|&i| workers[i] != want).map(|i| 1 + i);
                if let Some((i, for_)) = pulse.check(&counters, waiting, self.dead_after) {
                    break Stop::Silent { who: Party::Worker(i - 1), for_ };
                }
            }
            std::thread::sleep(self.poll);
        };
        // Best effort: the run is over either way, and the error to report is `stop`.
        let _ = self.abort(seg, &stop.to_string());
        Err(stop)
    }

    // A worker's side.

    /// Worker `i`: wait for the coordinator to move past phase `after` (`None` before the
    /// first), to the next phase or the end. Stops when it aborts or stops beating. Before the
    /// first phase, only phase 0 counts (what an earlier run left on the board is waited
    /// past), and the coordinator may be silent for `first_wait`.
    pub fn next(&self, seg: &mut Segment, i: usize, after: Option<u64>) -> std::result::Result<Step, Stop> {
        self.check_worker(i)?;
        let was = after.map_or(IDLE, tag);
        let patience = if after.is_none() { self.first_wait.max(self.dead_after) } else { self.dead_after };
        let mut pulse = Pulse::new(1);
        let mut last_beat = Instant::now() - BEAT;
        let mut status = [0u8; 1];
        let mut beat = [0u8; 4];
        loop {
            seg.read(self.status_at(Party::Coordinator), &mut status)?;
            match status[0] {
                s if s == was => {}
                s if after.is_none() && s != tag(0) => {}
                DONE => return Ok(Step::Done),
                ABORT => return Err(Stop::Aborted(read_text(seg, self.coordinator_area())?)),
                IDLE | ERROR => {
                    return Err(Stop::Io(format!("the coordinator's status byte went back to {}", status[0])))
                }
                _ => return Ok(Step::Phase(after.map_or(0, |p| p + 1))),
            }
            if last_beat.elapsed() >= BEAT {
                last_beat = Instant::now();
                seg.read(self.beat_at(Party::Coordinator), &mut beat)?;
                if let Some((_, for_)) = pulse.check(&u32s(&beat), 0..1, patience) {
                    return Err(Stop::Silent { who: Party::Coordinator, for_ });
                }
            }
            std::thread::sleep(self.poll);
        }
    }

    /// The coordinator's orders for the current phase (a sector).
    pub fn orders(&self, seg: &mut Segment) -> Result<Vec<u8>> {
        let mut s = vec![0u8; SECTOR];
        seg.read(self.coordinator_area(), &mut s)?;
        Ok(s)
    }

    /// Worker `i`'s assignment (a sector).
    pub fn assignment(&self, seg: &mut Segment, i: usize) -> Result<Vec<u8>> {
        self.check_worker(i)?;
        let mut s = vec![0u8; SECTOR];
        seg.read(self.assignment_at(i), &mut s)?;
        Ok(s)
    }

    /// Worker `i` finished `phase`: its report (at most a sector), then its status byte.
    pub fn report(&self, seg: &mut Segment, i: usize, phase: u64, data: &[u8]) -> Result<()> {
        self.check_worker(i)?;
        seg.write(self.report_at(i), &sector(data)?)?;
        seg.write(self.status_at(Party::Worker(i)), &[tag(phase)])
    }

    /// Worker `i` failed: `why` as its report, then "error" as its status.
    pub fn fail(&self, seg: &mut Segment, i: usize, why: &str) -> Result<()> {
        self.check_worker(i)?;
        seg.write(self.report_at(i), &text_sector(why))?;
        seg.write(self.status_at(Party::Worker(i)), &[ERROR])
    }

    /// Start `who`'s heartbeat on `seg`, a mapping of the board's namespace of its own.
    pub fn heartbeat(&self, seg: Segment, who: Party) -> Result<Heartbeat> {
        if let Party::Worker(i) = who {
            self.check_worker(i)?;
        }
        Heartbeat::start(seg, self.beat_at(who))
    }
}

/// `data` padded to a sector.
fn sector(data: &[u8]) -> Result<Vec<u8>> {
    if data.len() > SECTOR {
        return Err(Error::InvalidArgument("a board's area holds one sector"));
    }
    let mut s = vec![0u8; SECTOR];
    s[..data.len()].copy_from_slice(data);
    Ok(s)
}

/// `text` as a sector: its length (`u16`), then as much of it as fits.
fn text_sector(text: &str) -> Vec<u8> {
    let mut end = text.len().min(SECTOR - 2);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut s = vec![0u8; SECTOR];
    s[..2].copy_from_slice(&(end as u16).to_le_bytes());
    s[2..2 + end].copy_from_slice(&text.as_bytes()[..end]);
    s
}

fn read_text(seg: &mut Segment, at: u64) -> Result<String> {
    let mut s = vec![0u8; SECTOR];
    seg.read(at, &mut s)?;
    let n = usize::from(u16::from_le_bytes([s[0], s[1]])).min(SECTOR - 2);
    Ok(String::from_utf8_lossy(&s[2..2 + n]).into_owned())
}

fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()
}

/// A party's heartbeat: a thread that bumps its counter on the board every [`BEAT`] until
/// dropped. A beat that fails (the memory server is gone) stops it; whoever waits for this
/// party then finds it silent.
pub struct Heartbeat {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Heartbeat {
    fn start(mut seg: Segment, at: u64) -> Result<Heartbeat> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("heartbeat".into())
            .spawn(move || {
                let mut n = 0u32;
                while !flag.load(Ordering::Relaxed) {
                    n = n.wrapping_add(1);
                    if seg.write(at, &n.to_le_bytes()).is_err() {
                        return;
                    }
                    std::thread::sleep(BEAT);
                }
            })
            .map_err(Error::Io)?;
        Ok(Heartbeat { stop, thread: Some(thread) })
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn areas_lie_apart_and_inside_the_board() {
        let b = Board::new(1024, 3).unwrap();
        let end = 1024 + Board::bytes(3);
        assert_eq!(b.status_at(Party::Coordinator), 1024);
        assert_eq!(b.status_at(Party::Worker(2)), 1027);
        assert_eq!(b.beat_at(Party::Worker(2)), 1024 + 512 + 12);
        assert_eq!(b.coordinator_area(), 1024 + 1024);
        assert_eq!(b.assignment_at(0), 1024 + 1536);
        assert_eq!(b.assignment_at(2) + SECTOR as u64, b.report_at(0));
        assert_eq!(b.report_at(2) + SECTOR as u64, end);
        let full = Board::new(0, WORKERS_MAX).unwrap();
        assert!(full.beat_at(Party::Worker(WORKERS_MAX - 1)) + 4 <= 2 * SECTOR as u64);
        assert!((full.status_at(Party::Worker(WORKERS_MAX - 1)) as usize) < SECTOR);
        for (at, w) in [(0, 0), (0, WORKERS_MAX + 1), (100, 2)] {
            assert!(Board::new(at, w).is_err(), "{at} {w}");
        }
        assert!(matches!(b.check_worker(3), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn phase_tags_never_collide_with_the_states() {
        for p in 0..3 * PHASE_TAGS {
            let t = tag(p);
            assert!(![IDLE, DONE, ERROR, ABORT].contains(&t), "{p}");
            assert_ne!(t, tag(p + 1), "neighbouring phases are told apart");
        }
    }

    #[test]
    fn text_is_cut_on_a_character_and_areas_hold_a_sector() {
        let long = "é".repeat(400);
        let s = text_sector(&long);
        let n = usize::from(u16::from_le_bytes([s[0], s[1]]));
        assert!(n <= SECTOR - 2 && n % 2 == 0);
        assert!(std::str::from_utf8(&s[2..2 + n]).is_ok());
        assert!(sector(&[1; SECTOR]).is_ok());
        assert!(sector(&[1; SECTOR + 1]).is_err());
    }

    #[test]
    fn a_heartbeat_that_stands_still_is_found_after_dead_after() {
        let mut p = Pulse::new(2);
        let dead = Duration::from_millis(30);
        assert_eq!(p.check(&[1, 1], 0..2, dead), None);
        std::thread::sleep(Duration::from_millis(40));
        // Party 0 moved, party 1 did not.
        let found = p.check(&[2, 1], 0..2, dead);
        assert!(matches!(found, Some((1, d)) if d >= dead), "{found:?}");
        // Only the parties watched count.
        assert_eq!(p.check(&[3, 1], 0..1, dead), None);
    }
}
