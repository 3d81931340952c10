//! Carafe's Pregel engine (thesis 6.5.2, Figure 6.11): the graph cut into partitions of equal
//! weight, a worker process per partition, supersteps synchronised on a coordination board,
//! and messages passed through a shared mailbox in RStore.
//!
//! **Partitions.** Weighted vertex partitioning: a vertex weighs [`VERTEX_WEIGHT`] (reading it
//! and computing on it) and each of its out-edges 1 (reading it and sending along it).
//! Partitions are ranges of internal ids of equal weight; since a vertex's first edge is the
//! sum of the out-degrees before it, the weight before vertex `v` is `VERTEX_WEIGHT * v +
//! first_edge(v)`, and the coordinator finds each bound by binary search over the vertex
//! records (a few dozen reads, whatever the graph's size).
//!
//! **Phases on the board.** Phase 0: each worker loads its partition (the vertex records and
//! their adjacency lists, a megabyte per read: the thesis's `SequentialEdgeIterator`) and
//! reports, for each other partition, how many distinct vertices of it its edges reach.
//! The coordinator sizes the mailbox from those counts and writes them to `<name>-meta`.
//! Phase `1 + k` is superstep `k`; its orders carry `k` and the aggregate of superstep `k - 1`
//! (PageRank's rank on vertices without out-edges), and each report the superstep's figures.
//! The coordinator stops after PageRank's last iteration, or when a superstep sent nothing.
//!
//! **The mailbox** (`<name>-mail`): a region per ordered pair of partitions `(i, j)`, `i ≠ j`,
//! holding what `i` sends to `j`, split into an even and an odd container. In superstep `k`,
//! worker `i` reads the containers of parity `k mod 2` of column `i` (its inbox) and writes
//! those of parity `k + 1 mod 2` of row `i` (its outbox), so no container is read and written
//! in the same superstep. A container holds a count (`u64`) then that many messages of
//! [`MESSAGE_BYTES`]: the target's internal id (`u32`) and a value (`f64`). Messages to one
//! vertex are combined at the sender (summed for PageRank, the least kept for shortest paths),
//! so a container needs room for as many messages as the partitions' counts say, and no more.
//! Messages between vertices of one partition stay in its worker's memory.
//!
//! **Write-back.** After every superstep a worker writes its vertices' values to
//! `<name>-values`, so the property map in RStore is always the last finished superstep's.
//!
//! **Programs.** PageRank as Pregel's paper has it, with rank on vertices without out-edges
//! spread evenly over all vertices (the aggregate), so that it is the same PageRank as
//! networkit's, igraph's and a power iteration's: superstep 0 gives every vertex `1/N`, each of
//! supersteps `1..=iterations` computes `(1 - d)/N + d (Σ incoming + dangling/N)`. SSSP:
//! superstep 0 sets the source to 0; a vertex whose least incoming distance beats its own takes
//! it and offers it plus each edge's weight to its neighbours; unreached vertices stay at
//! infinity.

use std::process::Command;
use std::time::{Duration, Instant};

use rstore::{Board, Party, Segment};

use super::{
    header, round_up, Carafe, Graph, Header, Report, BOARD_AT, BOUNDS_AT, EDGE_BYTES, MATRIX_AT, RUN_AT,
    VERTEX_BYTES, WORKERS_MAX,
};
use crate::store::{map, read_into, read_region, sector_u64s, u64s, write_region, SECTOR};
use crate::workers::{serve, Workers};
use crate::Result;

/// A vertex's weight in partitioning, against an edge's 1.
pub const VERTEX_WEIGHT: u64 = 2;
/// Bytes of a message: target (`u32`), value (`f64`).
pub const MESSAGE_BYTES: usize = 12;
/// Bytes of a container's count.
const COUNT_BYTES: usize = 8;
/// A container read first in one request up to this many bytes: most are no larger.
const FIRST_READ: usize = 4096;
/// How often the board is read while waiting: supersteps are short.
const POLL: Duration = Duration::from_micros(200);
/// How long the workers have to exit once the board said done.
const EXIT_PATIENCE: Duration = Duration::from_secs(30);
const RUN_MAGIC: u64 = 0x0070_7265_6765_6c31; // "pregel1"

/// A program for the engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Program {
    /// PageRank with damping `damping`, `iterations` rank updates after the first superstep.
    PageRank { damping: f64, iterations: u64 },
    /// Shortest paths from the vertex of internal id `source`, along edge weights.
    Sssp { source: u32 },
}

impl Program {
    fn encode(&self) -> [u64; 4] {
        match *self {
            Program::PageRank { damping, iterations } => [1, iterations, damping.to_bits(), 0],
            Program::Sssp { source } => [2, 0, 0, u64::from(source)],
        }
    }

    fn decode(w: &[u64]) -> Result<Program> {
        match w[0] {
            1 => Ok(Program::PageRank { damping: f64::from_bits(w[2]), iterations: w[1] }),
            2 => Ok(Program::Sssp { source: u32::try_from(w[3])? }),
            k => Err(format!("no program of kind {k} in the run's header").into()),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Program::PageRank { .. } => "pagerank",
            Program::Sssp { .. } => "sssp",
        }
    }

    /// What combining messages starts from.
    fn identity(&self) -> f64 {
        match self {
            Program::PageRank { .. } => 0.0,
            Program::Sssp { .. } => f64::INFINITY,
        }
    }

    fn combine(&self, a: f64, b: f64) -> f64 {
        match self {
            Program::PageRank { .. } => a + b,
            Program::Sssp { .. } => a.min(b),
        }
    }
}

/// One superstep's figures, summed over the workers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    pub superstep: u64,
    /// From the coordinator's start to the last report.
    pub seconds: f64,
    /// Vertices that computed a new value.
    pub active: u64,
    /// Messages after combining, within partitions and between them.
    pub messages: u64,
    /// Bytes written to the mailbox.
    pub mail_bytes: u64,
    /// PageRank: the rank on vertices without out-edges (the next superstep's aggregate).
    pub dangling: f64,
    /// The sum of every vertex's value change (PageRank), or of values reached (SSSP: 0).
    pub delta: f64,
    /// PageRank: the sum of ranks; SSSP: the vertices reached so far.
    pub total: f64,
}

impl StepStats {
    fn encode(&self) -> Vec<u8> {
        sector_u64s(&[
            self.active,
            self.messages,
            self.mail_bytes,
            self.dangling.to_bits(),
            self.delta.to_bits(),
            self.total.to_bits(),
        ])
    }

    fn add(&mut self, report: &[u8]) {
        let w = u64s(&report[..8 * STATS_WORDS]);
        self.active += w[0];
        self.messages += w[1];
        self.mail_bytes += w[2];
        self.dangling += f64::from_bits(w[3]);
        self.delta += f64::from_bits(w[4]);
        self.total += f64::from_bits(w[5]);
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "superstep": self.superstep, "seconds": self.seconds, "active": self.active,
            "messages": self.messages, "mail_bytes": self.mail_bytes, "delta": self.delta,
            "total": self.total,
        })
    }
}

/// Partition bounds for `workers`: `workers + 1` internal ids, partition `p` being
/// `bounds[p]..bounds[p + 1]`, of about equal weight (the module's docs).
pub fn partition(g: &mut Graph, workers: usize) -> Result<Vec<u64>> {
    let (v, e) = (g.header.vertices, g.header.edges);
    let total = VERTEX_WEIGHT * v + e;
    let mut bounds = vec![0u64; workers + 1];
    bounds[workers] = v;
    for p in 1..workers {
        let target = (u128::from(total) * p as u128 / workers as u128) as u64;
        // The first vertex whose weight before it reaches the target.
        let (mut lo, mut hi) = (bounds[p - 1], v);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let before = VERTEX_WEIGHT * mid + g.vertex(mid as u32)?.first_edge;
            if before >= target {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        bounds[p] = lo;
    }
    Ok(bounds)
}

/// Where each container of the mailbox lies: `caps[i * workers + j]` messages of room from
/// `i` to `j`, even then odd; `(offset, bytes)` per (pair, parity), and the total.
fn mailbox(caps: &[u64], workers: usize) -> (Vec<[(u64, u64); 2]>, u64) {
    let mut at = 0u64;
    let mut places = Vec::with_capacity(workers * workers);
    for &cap in caps {
        let bytes = if cap == 0 { 0 } else { round_up(COUNT_BYTES as u64 + MESSAGE_BYTES as u64 * cap) };
        places.push([(at, bytes), (at + bytes, bytes)]);
        at += 2 * bytes;
    }
    (places, at)
}

/// How a run's partition workers come to be.
pub enum Launch<'a> {
    /// The run starts worker `id` of `workers` from the command this gives (one running
    /// [`Carafe::worker`]), and sees at once when one exits.
    Spawn(&'a mut dyn FnMut(usize, usize) -> Command),
    /// Somebody starts them, on any machine (`skiff carafe ... worker --id I --workers W`):
    /// each has `attach` to begin beating on the board.
    External { attach: Duration },
}

/// Where a worker's time went, as its superstep reports carry it (cumulative seconds).
const TIMES: [&str; 5] = ["load_s", "inbox_s", "compute_s", "outbox_s", "wait_s"];
/// The report's words before the times: the superstep's figures.
const STATS_WORDS: usize = 6;

impl Carafe {
    /// Run `program` with `workers` partition workers, launched as `launch` says. `progress`
    /// sees every superstep as it ends.
    pub fn run(
        &self,
        program: Program,
        workers: usize,
        launch: Launch<'_>,
        mut progress: impl FnMut(&StepStats),
    ) -> Result<Report> {
        let c = &self.coord;
        if workers == 0 || workers > WORKERS_MAX {
            return Err(format!("--workers: 1 to {WORKERS_MAX}").into());
        }
        let start = Instant::now();
        let meta = self.ns("meta");
        let mut m = self.meta()?;
        let h = header(&mut m, &self.name)?;
        if workers as u64 > h.vertices {
            return Err(format!("{workers} workers for {} vertices", h.vertices).into());
        }
        if let Program::Sssp { source } = program {
            if u64::from(source) >= h.vertices {
                return Err(format!("no source vertex {source}").into());
            }
        }
        let mut g = self.open()?;
        let bounds = partition(&mut g, workers)?;
        drop(g);
        m.write(BOUNDS_AT, &sector_u64s(&bounds))?;
        let mut run = vec![RUN_MAGIC, workers as u64];
        run.extend(program.encode());
        run.push(0); // supersteps finished: written at the end
        m.write(RUN_AT, &sector_u64s(&run))?;
        let mut board = Board::new(BOARD_AT, workers)?;
        board.poll = POLL;
        board.reset(&mut m)?;
        let _beat = board.heartbeat(map(c, &meta)?, Party::Coordinator)?;
        let dead_after = board.dead_after;
        let mut procs = match launch {
            Launch::Spawn(worker) => Workers::spawn(workers, |i| worker(i, workers))?,
            Launch::External { attach } => {
                board.dead_after = attach.max(dead_after);
                Workers::none()
            }
        };

        // Phase 0: load, and size the mailbox.
        let t = Instant::now();
        board.start(&mut m, 0, &[])?;
        let reports = board.gather(&mut m, 0, || procs.watch())?;
        board.dead_after = dead_after;
        let mut caps = vec![0u64; workers * workers];
        for (i, r) in reports.iter().enumerate() {
            caps[i * workers..(i + 1) * workers].copy_from_slice(&u64s(&r[..8 * workers]));
            caps[i * workers + i] = 0;
        }
        let (_, mail_bytes) = mailbox(&caps, workers);
        self.fresh(&self.ns("mail"), mail_bytes)?;
        write_region(&mut m, MATRIX_AT, &sector_u64s(&caps))?;
        let load_s = t.elapsed().as_secs_f64();

        // Supersteps.
        let t = Instant::now();
        let mut steps: Vec<StepStats> = Vec::new();
        let mut aggregate = 0.0f64;
        let mut times = [0f64; TIMES.len()];
        for k in 0.. {
            let t_step = Instant::now();
            board.start(&mut m, 1 + k, &sector_u64s(&[k, aggregate.to_bits()]))?;
            let reports = board.gather(&mut m, 1 + k, || procs.watch())?;
            let mut s = StepStats { superstep: k, ..StepStats::default() };
            for r in &reports {
                s.add(r);
                let w = u64s(&r[8 * STATS_WORDS..8 * (STATS_WORDS + TIMES.len())]);
                for (t, &bits) in times.iter_mut().zip(&w) {
                    *t = t.max(f64::from_bits(bits));
                }
            }
            s.seconds = t_step.elapsed().as_secs_f64();
            aggregate = s.dangling;
            progress(&s);
            steps.push(s);
            let last = match program {
                Program::PageRank { iterations, .. } => k >= iterations,
                Program::Sssp { .. } => s.messages == 0,
            };
            if last {
                break;
            }
        }
        let compute_s = t.elapsed().as_secs_f64();
        board.finish(&mut m)?;
        *run.last_mut().expect("run header") = steps.len() as u64;
        m.write(RUN_AT, &sector_u64s(&run))?;
        procs.finish(EXIT_PATIENCE)?;
        let most = |key: &str| times[TIMES.iter().position(|&t| t == key).expect("a time")];
        let last = steps.last().copied().unwrap_or_default();
        let messages: u64 = steps.iter().map(|s| s.messages).sum();
        let mail: u64 = steps.iter().map(|s| s.mail_bytes).sum();
        Ok(Report {
            what: program.name(),
            fields: vec![
                ("vertices", h.vertices as f64),
                ("edges", h.edges as f64),
                ("workers", workers as f64),
                ("supersteps", steps.len() as f64),
                ("load_s", load_s),
                ("compute_s", compute_s),
                ("per_superstep_s", compute_s / steps.len().max(1) as f64),
                ("messages", messages as f64),
                ("mail_bytes", mail as f64),
                ("total", last.total),
                ("worker_compute_s", most("compute_s")),
                ("worker_inbox_s", most("inbox_s")),
                ("worker_outbox_s", most("outbox_s")),
                ("worker_wait_s", most("wait_s")),
                ("seconds", start.elapsed().as_secs_f64()),
            ],
            detail: vec![(
                "supersteps_detail",
                serde_json::Value::Array(steps.iter().map(StepStats::json).collect()),
            )],
        })
    }

    /// Partition worker `id` of `workers` (the module's docs). Its report holds where its time
    /// went.
    pub fn worker(&self, id: usize, workers: usize) -> Result<Report> {
        let c = &self.coord;
        let meta = self.ns("meta");
        let mut m = self.meta()?;
        let mut board = Board::new(BOARD_AT, workers)?;
        board.poll = POLL;
        let _beat = board.heartbeat(map(c, &meta)?, Party::Worker(id))?;
        // The run's header, bounds and program are read once phase 0 starts: a worker started
        // by hand may come before the run that will use it.
        let mut part: Option<Part> = None;
        let mut reported = Instant::now();
        serve(&board, &mut m, id, |m, phase, orders| {
            let t = Instant::now();
            let report = if phase == 0 {
                let p = part.insert(self.part(m, id, workers)?);
                let caps = p.load()?;
                p.time.load = t.elapsed();
                sector_u64s(&caps)
            } else {
                let p = part.as_mut().ok_or("a superstep before phase 0")?;
                p.time.wait += t - reported;
                let w = u64s(&orders[..16]);
                if w[0] != phase - 1 {
                    return Err(format!("phase {phase} carries superstep {}", w[0]).into());
                }
                if phase == 1 {
                    p.open_mailbox(m)?;
                }
                let mut report = p.superstep(w[0], f64::from_bits(w[1]))?.encode();
                let t = &p.time;
                let spent = [t.load, t.inbox, t.compute, t.outbox, t.wait];
                for (i, d) in spent.iter().enumerate() {
                    let at = 8 * (STATS_WORDS + i);
                    report[at..at + 8].copy_from_slice(&d.as_secs_f64().to_bits().to_le_bytes());
                }
                report
            };
            reported = Instant::now();
            Ok(report)
        })?;
        let time = part.map(|p| p.time).unwrap_or_default();
        Ok(Report {
            what: "worker",
            fields: vec![
                ("load_s", time.load.as_secs_f64()),
                ("inbox_s", time.inbox.as_secs_f64()),
                ("compute_s", time.compute.as_secs_f64()),
                ("outbox_s", time.outbox.as_secs_f64()),
                ("wait_s", time.wait.as_secs_f64()),
            ],
            detail: Vec::new(),
        })
    }
}

impl Carafe {
    /// Worker `id`'s partition of the run that started: its header, program and bounds.
    fn part(&self, m: &mut Segment, id: usize, workers: usize) -> Result<Part<'_>> {
        let h = header(m, &self.name)?;
        let run = u64s(&read_region(m, RUN_AT, SECTOR)?);
        if run[0] != RUN_MAGIC || run[1] != workers as u64 {
            return Err(format!("the run is for {} workers, not {workers}", run[1]).into());
        }
        let program = Program::decode(&run[2..6])?;
        let bounds = u64s(&read_region(m, BOUNDS_AT, 8 * (workers + 1))?);
        Ok(Part::new(self, h, program, &bounds, id, workers))
    }
}

#[derive(Debug, Default)]
struct Times {
    load: Duration,
    inbox: Duration,
    compute: Duration,
    outbox: Duration,
    wait: Duration,
}

/// One worker's partition: its vertices `lo..hi`, their edges, values and messages.
struct Part<'a> {
    carafe: &'a Carafe,
    header: Header,
    program: Program,
    bounds: Vec<u64>,
    id: usize,
    workers: usize,
    lo: u64,
    hi: u64,
    /// Per vertex of the partition: where its edges start in `targets` (one more entry).
    first: Vec<usize>,
    targets: Vec<(u32, f32)>,
    /// PageRank's: the partition's edges by target, and each vertex's share of its rank.
    by_target: ByTarget,
    share: Vec<f64>,
    value: Vec<f64>,
    incoming: Vec<f64>,
    got: Vec<bool>,
    /// What this superstep sends, combined per target over the whole graph, and which targets
    /// it sends to (a bit each). The partition's own range waits here for the next superstep.
    acc: Vec<f64>,
    sent: Vec<u64>,
    /// The mailbox's containers, and the segment they live in.
    places: Vec<[(u64, u64); 2]>,
    caps: Vec<u64>,
    mail: Option<Segment>,
    values: Option<Segment>,
    /// A container read or written, and the values written back: kept across supersteps.
    scratch: Vec<u8>,
    time: Times,
}

impl<'a> Part<'a> {
    fn new(
        carafe: &'a Carafe,
        header: Header,
        program: Program,
        bounds: &[u64],
        id: usize,
        workers: usize,
    ) -> Part<'a> {
        let (lo, hi) = (bounds[id], bounds[id + 1]);
        let n = (hi - lo) as usize;
        let v = header.vertices as usize;
        Part {
            carafe,
            header,
            program,
            bounds: bounds.to_vec(),
            id,
            workers,
            lo,
            hi,
            first: Vec::new(),
            targets: Vec::new(),
            by_target: ByTarget::default(),
            share: vec![0.0; n],
            value: vec![program.identity(); n],
            incoming: vec![program.identity(); n],
            got: vec![false; n],
            acc: vec![program.identity(); v],
            sent: vec![0u64; v.div_ceil(64)],
            places: Vec::new(),
            caps: Vec::new(),
            mail: None,
            values: None,
            scratch: Vec::new(),
            time: Times::default(),
        }
    }

    /// Phase 0: read the partition's vertices and edges; per partition, the distinct vertices
    /// of it that this one's edges reach.
    fn load(&mut self) -> Result<Vec<u64>> {
        let c = &self.carafe.coord;
        let n = (self.hi - self.lo) as usize;
        // One record past the end for the last vertex's end, unless it is the graph's last.
        let with_next = if self.hi < self.header.vertices { n + 1 } else { n };
        let mut vs = map(c, &self.carafe.ns("vertices"))?;
        let records = read_region(&mut vs, self.lo * VERTEX_BYTES as u64, with_next * VERTEX_BYTES)?;
        let firsts: Vec<u64> = records
            .chunks_exact(VERTEX_BYTES)
            .map(|r| u64::from_le_bytes(r[8..16].try_into().expect("8")))
            .collect();
        let base = firsts.first().copied().unwrap_or(self.header.edges);
        let end = if with_next > n { firsts[n] } else { self.header.edges };
        if end < base || end > self.header.edges {
            return Err(format!(
                "vertex records {}..{} say edges {base}..{end} of {}",
                self.lo, self.hi, self.header.edges
            )
            .into());
        }
        self.first = firsts[..n].iter().map(|&f| (f - base) as usize).collect();
        self.first.push((end - base) as usize);
        let mut es = map(c, &self.carafe.ns("edges"))?;
        let mut raw = vec![0u8; (end - base) as usize * EDGE_BYTES];
        read_into(&mut es, base * EDGE_BYTES as u64, &mut raw)?;
        self.targets = raw
            .chunks_exact(EDGE_BYTES)
            .map(|r| {
                (
                    u32::from_le_bytes(r[0..4].try_into().expect("4")),
                    f32::from_le_bytes(r[4..8].try_into().expect("4")),
                )
            })
            .collect();
        let v = self.header.vertices;
        let mut caps = vec![0u64; self.workers];
        let mut seen = vec![0u64; (v as usize).div_ceil(64)];
        for &(dst, _) in &self.targets {
            let d = u64::from(dst);
            if d >= v {
                return Err(format!("an edge of partition {} leads to vertex {d} of {v}", self.id).into());
            }
            let (w, b) = (d as usize / 64, 1u64 << (d % 64));
            if seen[w] & b == 0 {
                seen[w] |= b;
                caps[self.partition_of(d)] += 1;
            }
        }
        if let Program::PageRank { .. } = self.program {
            self.by_target = ByTarget::of(&self.first, &self.targets, v as usize);
        }
        self.values = Some(map(c, &self.carafe.ns("values"))?);
        Ok(caps)
    }

    fn partition_of(&self, v: u64) -> usize {
        self.bounds.partition_point(|&b| b <= v) - 1
    }

    fn open_mailbox(&mut self, m: &mut Segment) -> Result<()> {
        let w = self.workers;
        self.caps = u64s(&read_region(m, MATRIX_AT, 8 * w * w)?);
        self.places = mailbox(&self.caps, w).0;
        self.mail = Some(map(&self.carafe.coord, &self.carafe.ns("mail"))?);
        Ok(())
    }

    /// Superstep `k`, with `aggregate` the last superstep's dangling rank.
    fn superstep(&mut self, k: u64, aggregate: f64) -> Result<StepStats> {
        let program = self.program;
        let identity = program.identity();
        let (lo, n) = (self.lo as usize, (self.hi - self.lo) as usize);
        let t = Instant::now();
        // What the partition sent itself last superstep, then the inbox.
        self.got.fill(false);
        self.incoming.fill(identity);
        for i in 0..n {
            let g = lo + i;
            let (w, b) = (g / 64, 1u64 << (g % 64));
            if self.sent[w] & b != 0 {
                self.sent[w] &= !b;
                self.incoming[i] = self.acc[g];
                self.got[i] = true;
                self.acc[g] = identity;
            }
        }
        if k > 0 {
            self.read_inbox(k)?;
        }
        self.time.inbox += t.elapsed();

        let t = Instant::now();
        let mut s = StepStats { superstep: k, ..StepStats::default() };
        let nv = self.header.vertices as f64;
        match program {
            Program::PageRank { damping, iterations } => {
                for i in 0..n {
                    let rank = if k == 0 {
                        1.0 / nv
                    } else {
                        (1.0 - damping) / nv + damping * (self.incoming[i] + aggregate / nv)
                    };
                    s.delta += (rank - self.value[i]).abs() * f64::from(u8::from(k > 0));
                    self.value[i] = rank;
                    s.total += rank;
                    let degree = self.first[i + 1] - self.first[i];
                    if degree == 0 {
                        s.dangling += rank;
                        self.share[i] = 0.0;
                    } else {
                        self.share[i] = rank / degree as f64;
                    }
                }
                // Every edge sends its source's share; gathered per target, the targets in
                // order (the partition's edges by target, made at load), so that the sums
                // are written in order and only the shares are read at random.
                if k < iterations {
                    let by = &self.by_target;
                    for (t, &dst) in by.targets.iter().enumerate() {
                        let sources = &by.sources[by.first[t] as usize..by.first[t + 1] as usize];
                        let sum: f64 = sources.iter().map(|&j| self.share[j as usize]).sum();
                        let d = dst as usize;
                        self.acc[d] += sum;
                        self.sent[d / 64] |= 1 << (d % 64);
                    }
                }
                s.active = n as u64;
            }
            Program::Sssp { source } => {
                for i in 0..n {
                    let best = if k == 0 {
                        if lo + i == source as usize {
                            0.0
                        } else {
                            f64::INFINITY
                        }
                    } else if self.got[i] {
                        self.incoming[i]
                    } else {
                        f64::INFINITY
                    };
                    if best < self.value[i] {
                        self.value[i] = best;
                        s.active += 1;
                        for &(dst, w) in &self.targets[self.first[i]..self.first[i + 1]] {
                            let d = dst as usize;
                            let offer = best + f64::from(w);
                            if offer < self.acc[d] {
                                self.acc[d] = offer;
                            }
                            self.sent[d / 64] |= 1 << (d % 64);
                        }
                    }
                    if self.value[i].is_finite() {
                        s.total += 1.0;
                    }
                }
            }
        }
        self.time.compute += t.elapsed();

        let t = Instant::now();
        let (messages, bytes) = self.write_outbox(k)?;
        s.messages = messages;
        s.mail_bytes = bytes;
        let out = &mut self.scratch;
        out.clear();
        for x in &self.value {
            out.extend_from_slice(&x.to_le_bytes());
        }
        write_region(self.values.as_mut().expect("loaded"), self.lo * 8, out)?;
        self.time.outbox += t.elapsed();
        Ok(s)
    }

    /// Read the containers of parity `k mod 2` addressed to this partition and combine their
    /// messages into `incoming`.
    fn read_inbox(&mut self, k: u64) -> Result<()> {
        let (w, me) = (self.workers, self.id);
        let mail = self.mail.as_mut().expect("opened");
        let buf = &mut self.scratch;
        for j in (0..w).filter(|&j| j != me) {
            let cap = self.caps[j * w + me];
            if cap == 0 {
                continue;
            }
            let (at, bytes) = self.places[j * w + me][(k % 2) as usize];
            let first = (bytes as usize).min(FIRST_READ);
            buf.resize(first, 0);
            mail.read(at, buf)?;
            let count = u64::from_le_bytes(buf[..8].try_into().expect("8"));
            if count > cap {
                return Err(format!(
                    "worker {j}'s container for worker {me} holds {count} messages, room for {cap}"
                )
                .into());
            }
            let need = COUNT_BYTES + MESSAGE_BYTES * count as usize;
            if need > first {
                buf.resize(need, 0);
                read_into(mail, at + first as u64, &mut buf[first..])?;
            }
            for msg in buf[COUNT_BYTES..need].chunks_exact(MESSAGE_BYTES) {
                let dst = u64::from(u32::from_le_bytes(msg[0..4].try_into().expect("4")));
                let value = f64::from_le_bytes(msg[4..12].try_into().expect("8"));
                if dst < self.lo || dst >= self.hi {
                    return Err(format!(
                        "worker {j} sent worker {me} a message for vertex {dst}, outside {}..{}",
                        self.lo, self.hi
                    )
                    .into());
                }
                let i = (dst - self.lo) as usize;
                self.incoming[i] = self.program.combine(self.incoming[i], value);
                self.got[i] = true;
            }
        }
        Ok(())
    }

    /// Write what this superstep sends to other partitions into the containers of parity
    /// `k + 1 mod 2`; what it sends itself stays. Messages (all, this partition's too) and
    /// mailbox bytes written.
    fn write_outbox(&mut self, k: u64) -> Result<(u64, u64)> {
        let (w, me) = (self.workers, self.id);
        let identity = self.program.identity();
        let parity = ((k + 1) % 2) as usize;
        let (mut messages, mut bytes) = (0u64, 0u64);
        let mut buf = std::mem::take(&mut self.scratch);
        for j in 0..w {
            let (lo, hi) = (self.bounds[j] as usize, self.bounds[j + 1] as usize);
            if j == me {
                messages += count_bits(&self.sent, lo, hi);
                continue;
            }
            buf.clear();
            buf.extend_from_slice(&[0; COUNT_BYTES]);
            let mut count = 0u64;
            for word in lo / 64..hi.div_ceil(64) {
                let mut bits = self.sent[word];
                while bits != 0 {
                    let g = word * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    if g < lo || g >= hi {
                        continue;
                    }
                    buf.extend_from_slice(&(g as u32).to_le_bytes());
                    buf.extend_from_slice(&self.acc[g].to_le_bytes());
                    self.acc[g] = identity;
                    count += 1;
                }
            }
            clear_bits(&mut self.sent, lo, hi);
            let cap = self.caps[me * w + j];
            if count > cap {
                return Err(format!(
                    "{count} messages for partition {j}, room for {cap}: the mailbox was sized wrong"
                )
                .into());
            }
            if cap == 0 {
                continue;
            }
            buf[..COUNT_BYTES].copy_from_slice(&count.to_le_bytes());
            let (at, _) = self.places[me * w + j][parity];
            write_region(self.mail.as_mut().expect("opened"), at, &buf)?;
            messages += count;
            bytes += buf.len() as u64;
        }
        self.scratch = buf;
        Ok((messages, bytes))
    }
}

/// A partition's edges grouped by target: the distinct targets ascending, and for target `t`
/// the sources (local indices) `sources[first[t]..first[t + 1]]`.
#[derive(Debug, Default, PartialEq, Eq)]
struct ByTarget {
    targets: Vec<u32>,
    first: Vec<u64>,
    sources: Vec<u32>,
}

impl ByTarget {
    /// By counting sort over the graph's `vertices` ids: no comparison sort.
    fn of(first: &[usize], edges: &[(u32, f32)], vertices: usize) -> ByTarget {
        let mut count = vec![0u64; vertices + 1];
        for &(d, _) in edges {
            count[d as usize + 1] += 1;
        }
        for i in 0..vertices {
            count[i + 1] += count[i];
        }
        let mut sources = vec![0u32; edges.len()];
        let mut next = count.clone();
        for i in 0..first.len().saturating_sub(1) {
            for &(d, _) in &edges[first[i]..first[i + 1]] {
                sources[next[d as usize] as usize] = i as u32;
                next[d as usize] += 1;
            }
        }
        let targets: Vec<u32> =
            (0..vertices).filter(|&d| count[d + 1] > count[d]).map(|d| d as u32).collect();
        let mut starts: Vec<u64> = targets.iter().map(|&d| count[d as usize]).collect();
        starts.push(edges.len() as u64);
        ByTarget { targets, first: starts, sources }
    }
}

/// Set bits of `bits` in `lo..hi`.
fn count_bits(bits: &[u64], lo: usize, hi: usize) -> u64 {
    (lo..hi).filter(|&g| bits[g / 64] & (1 << (g % 64)) != 0).count() as u64
}

/// Clear bits `lo..hi` of `bits`.
fn clear_bits(bits: &mut [u64], lo: usize, hi: usize) {
    for g in lo..hi {
        if g % 64 == 0 && g + 64 <= hi {
            bits[g / 64] = 0;
        } else {
            bits[g / 64] &= !(1 << (g % 64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containers_lie_apart_even_then_odd() {
        let caps = [0, 3, 1000, 0];
        let (places, total) = mailbox(&caps, 2);
        assert_eq!(places[0], [(0, 0), (0, 0)]);
        assert_eq!(places[1], [(0, 512), (512, 512)]);
        let big = round_up(8 + 12 * 1000);
        assert_eq!(places[2], [(1024, big), (1024 + big, big)]);
        assert_eq!(total, 1024 + 2 * big);
    }

    #[test]
    fn edges_by_target_keep_every_edge_once() {
        // Local vertex 0 -> 5, 2; vertex 1 -> 2, 2; vertex 2 -> nothing.
        let first = [0, 2, 4, 4];
        let edges = [(5, 1.0), (2, 1.0), (2, 1.0), (2, 1.0)];
        let by = ByTarget::of(&first, &edges, 6);
        assert_eq!(by.targets, vec![2, 5]);
        assert_eq!(by.first, vec![0, 3, 4]);
        assert_eq!(by.sources, vec![0, 1, 1, 0]);
    }

    #[test]
    fn bits_are_counted_and_cleared_in_their_range_only() {
        let mut bits = vec![u64::MAX; 3];
        assert_eq!(count_bits(&bits, 10, 150), 140);
        clear_bits(&mut bits, 10, 150);
        assert_eq!(count_bits(&bits, 0, 192), 10 + 42);
        assert_eq!(bits[1], 0);
    }

    #[test]
    fn programs_travel_through_the_runs_header() {
        for p in [Program::PageRank { damping: 0.85, iterations: 32 }, Program::Sssp { source: 7 }] {
            assert_eq!(Program::decode(&p.encode()).unwrap(), p);
        }
        assert!(Program::decode(&[9, 0, 0, 0]).is_err());
    }
}
