//! RStore's data path (docs/RSTORE.md): a mapped `raddress` segment, read and written straight
//! on the memory servers that hold its chunks, striped, with replicas.
//!
//! The control plane ([`crate::control`], over etcd) resolves a segment to a [`SegmentMap`]:
//! its length, its chunk size, and for every chunk (a *stripe*) the places of its copies
//! (server endpoint, export, byte offset, grant, and whether the copy is being repaired).
//! [`Segment::map`] opens one lane per distinct (server, export) and keeps them: reads and
//! writes allocate nothing on the servers and never ask the coordinator. One `Segment` belongs
//! to one thread, so its lanes are that thread's lanes to each server (i10's P×T): several
//! threads map the segment each.
//!
//! A `Segment` is a [`Queue`] like a lane: requests in, completions out, many in flight. A
//! request is split at chunk boundaries into pieces, each sent to its servers as an ordinary
//! request on their lanes (a *sub*-request); the request completes when its last piece does.
//! A read piece asks the first healthy copy in service and, when that fails, the next. A write
//! piece goes to every healthy copy, and once they all hold it, to the copies being repaired
//! (so a repair that copies a region out of a healthy copy under a lock never overwrites a
//! newer write: docs/PROTOCOL.md, 14.6). A write refused with `Busy` (its region is being
//! copied out) is sent again 200 µs later.
//!
//! **Healing.** A segment mapped through the control plane has a [`MapSource`]. When it loses
//! a server (its connection fails, or its storage fails a request), it reports the server to
//! the source, which marks the server's copies stale, so that the other copies track what they
//! miss; when a server answers `StaleCapability` (the segment's map is older than the server
//! knows), or after a loss, it reads the map again, opens lanes for the servers whose grants
//! changed, and sends again every request that did not reach all its copies. No error reaches
//! the caller for any of that: a request fails only when a stripe has no healthy copy left, or
//! the control plane cannot be reached for [`HEAL_DEADLINE`]. That blocks the thread, on the
//! failure path only. A segment without a source (mapped from a [`SegmentMap`] by hand) takes
//! a lost server out of service for good and counts a write held by one copy as done.
//!
//! Offsets and lengths may be any bytes when the servers serve their pools at a one-byte
//! block (`skiff serve --pool` does): a request goes to the servers as it is, with no
//! read-modify-write, so a one-byte write changes that byte alone, atomically on a RAM pool
//! (RStore's one-byte flags). Against exports with a coarser block, requests must be
//! multiples of the coarsest block among the segment's servers.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use initiator::{
    Completion, Endpoint, Error, Lane, LaneConfig, LaneStats, Queue, ReconnectConfig, Rejected, Result,
};
use wire::{Opcode, ReqFlags, Status};

use crate::connections::Connections;

/// Chunks are whole sectors, whatever the servers' block.
const SECTOR: u64 = 512;

/// How long a write refused with `Busy` waits before it is sent again.
const BUSY_RETRY: Duration = Duration::from_micros(200);

/// How long a segment keeps trying to reach the control plane to heal (report a lost server,
/// read the map again) before the requests waiting on it fail.
pub const HEAL_DEADLINE: Duration = Duration::from_secs(60);

/// Times one request is sent again after a stale map before it fails with `StaleCapability`
/// (the control plane keeps handing out a map the servers refuse: the allocation was freed).
const REISSUES_MAX: u8 = 8;

/// Where one copy of a chunk lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub endpoint: Endpoint,
    pub export: String,
    /// Byte offset of the chunk in the export.
    pub offset: u64,
    /// The chunk's grant, for a server whose pool needs one (every `skiff serve --pool`):
    /// presented when the segment connects (docs/PROTOCOL.md, section 14.6).
    pub grant: Option<wire::Capability>,
    /// The copy is being repaired: written after the healthy copies hold a write, never read.
    pub syncing: bool,
}

/// The pieces of a request of `length` bytes at `offset`: each `(at, len, stripe)`, split at
/// chunk boundaries and at the largest I/O the lanes take (`max`).
fn pieces(chunk: u64, max: u64, offset: u64, length: usize) -> impl Iterator<Item = (u64, usize, usize)> {
    let end = offset + length as u64;
    let mut at = offset;
    std::iter::from_fn(move || {
        (at < end).then(|| {
            let n = (chunk - at % chunk).min(end - at).min(max);
            let piece = (at, n as usize, (at / chunk) as usize);
            at += n;
            piece
        })
    })
}

/// A segment resolved for the data path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentMap {
    pub len: u64,
    pub chunk_bytes: u64,
    /// `stripes[i]`: the copies of bytes `i * chunk_bytes ..` of the segment.
    pub stripes: Vec<Vec<Location>>,
}

/// Where a segment mapped through the control plane reports the servers it loses and reads
/// its map again (`Coordinator::map` gives one).
pub trait MapSource: Send {
    /// The copies on the server at `endpoint` miss writes from now on: record them stale, so
    /// that the next map leaves them out and the other copies track what they miss.
    fn lost(&mut self, endpoint: &str) -> std::result::Result<(), SourceError>;
    /// The segment's map as the control plane has it now.
    fn map(&mut self) -> std::result::Result<SegmentMap, SourceError>;
}

/// Why a [`MapSource`] could not answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceError {
    pub message: String,
    /// The control plane could not be reached: asking again later may work. Otherwise the
    /// answer is final (the allocation is gone).
    pub retry: bool,
}

/// What a segment's I/O did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentStats {
    pub reads: u64,
    pub writes: u64,
    /// Requests sent to servers (pieces times copies, retries included).
    pub requests: u64,
    /// Read pieces sent again to another copy after the first failed.
    pub fallbacks: u64,
    /// Servers taken out of service.
    pub servers_failed: u64,
    /// Times the map was read again, and requests sent again under the new one.
    pub remaps: u64,
    pub reissues: u64,
    /// Writes sent again after `Busy` (their region was being copied out by a repair).
    pub busy: u64,
}

/// A request of the caller, split into pieces.
struct Parent {
    opcode: Opcode,
    user_data: u64,
    offset: u64,
    /// The caller's buffer: a write's data, a read's destination. `None` while it is lent to
    /// a lane whole (a request of one piece: no copy), or when its lane failed with it.
    buf: Option<Vec<u8>>,
    len: usize,
    /// Sub-requests still out.
    subs: usize,
    /// Pieces that reached no copy (a write) or no copy answered (a read).
    failed: bool,
    /// Per piece of a write: whether some copy holds it.
    held: Held,
    /// What a server answered when it refused a piece (out of range, too large...): the
    /// request's own fault, reported as it is, and no reason to take the server out.
    refused: Option<Status>,
    /// A write's healthy copies hold it; the copies being repaired are being written.
    second: bool,
    /// A piece missed a copy, or met a newer map: the request goes again once the map is read
    /// again (a segment with a source only).
    again: bool,
    /// What sent it again last: a newer map (rather than a lost server).
    stale: bool,
    reissues: u8,
}

/// Which pieces of a request some copy holds: a bit each, for requests of up to 128 pieces
/// (128 MiB at 1 MiB pieces) with no allocation; a vector beyond.
enum Held {
    Bits { held: u128, pieces: u32 },
    Many(Vec<bool>),
}

impl Held {
    /// `pieces` pieces, all held already (a read's) or none.
    fn new(pieces: usize, all: bool) -> Held {
        if pieces <= 128 {
            let full = if pieces == 128 { u128::MAX } else { (1u128 << pieces) - 1 };
            Held::Bits { held: if all { full } else { 0 }, pieces: pieces as u32 }
        } else {
            Held::Many(vec![all; pieces])
        }
    }

    fn set(&mut self, piece: usize) {
        match self {
            Held::Bits { held, .. } => *held |= 1 << piece,
            Held::Many(v) => v[piece] = true,
        }
    }

    fn all(&self) -> bool {
        match self {
            Held::Bits { held, pieces } => held.count_ones() == *pieces,
            Held::Many(v) => v.iter().all(|&h| h),
        }
    }

    fn reset(&mut self, all: bool) {
        match self {
            Held::Bits { held, pieces } => {
                *held = if !all {
                    0
                } else if *pieces == 128 {
                    u128::MAX
                } else {
                    (1u128 << *pieces) - 1
                }
            }
            Held::Many(v) => v.iter_mut().for_each(|h| *h = all),
        }
    }
}

/// One piece on one copy.
#[derive(Clone, Copy)]
struct Sub {
    parent: usize,
    /// The piece's index in its parent, its byte range in the segment, and its stripe.
    piece: usize,
    at: u64,
    len: usize,
    stripe: usize,
    lane: usize,
    /// The request is this one piece on this one lane: the caller's buffer goes as it is.
    whole: bool,
    /// Which sub this is among all the segment's: a slot is reused, a `Busy` wait names both.
    seq: u64,
}

/// One copy of a stripe, on a lane.
#[derive(Clone, Copy)]
struct Copy {
    lane: usize,
    offset: u64,
    syncing: bool,
}

/// A server (and export) the segment has a lane to, and what it presented there.
struct Server {
    endpoint: Endpoint,
    export: String,
    grants: Vec<wire::Capability>,
    /// `endpoint/export`, for messages.
    name: String,
}

/// A mapped segment: its lanes, one per server and export.
pub struct Segment {
    len: u64,
    chunk_bytes: u64,
    /// `None` once the server failed.
    lanes: Vec<Option<Lane>>,
    /// Each lane's counters when the segment took it (a kept lane did work before).
    base: Vec<LaneStats>,
    servers: Vec<Server>,
    /// `copies[i]`: stripe `i`'s copies, healthy first in map order, then those syncing.
    copies: Vec<Vec<Copy>>,
    parents: Vec<Option<Parent>>,
    free_parents: Vec<usize>,
    subs: Vec<Option<Sub>>,
    free_subs: Vec<usize>,
    /// Sub-requests waiting for room on their lane.
    backlog: Vec<VecDeque<usize>>,
    /// Writes refused with `Busy`, each with when to send it again.
    busy: VecDeque<(Instant, usize, u64)>,
    in_flight: usize,
    /// The unit of alignment: the coarsest block among the servers' exports.
    block: u64,
    /// The largest piece: the smallest I/O size the servers' lanes negotiated.
    piece_max: u64,
    done: Vec<Completion>,
    scratch: Vec<Completion>,
    stats: SegmentStats,
    config: LaneConfig,
    source: Option<Box<dyn MapSource>>,
    /// Where lanes come from and go back to when dropped; `None`: connected and closed here.
    connections: Option<Connections>,
    /// Endpoints of servers lost and not yet reported to the source.
    unreported: Vec<String>,
    /// Requests to send again once the map is read again.
    again: Vec<usize>,
    /// What the lanes dropped so far (lost, or replaced by a new map) did.
    retired: LaneStats,
    /// The last sub's number ([`Sub::seq`]).
    next_seq: u64,
    /// A server refused a grant of the map as stale when its lane connected: a newer map
    /// exists, to read before going on (the server is not lost).
    restale: bool,
    /// Buffers of pieces that do not take the caller's buffer whole, kept for the next ones:
    /// the data path allocates nothing once warm.
    spare: Vec<Vec<u8>>,
    /// The buffer and completions of the blocking `read` and `write`, kept likewise.
    own: Vec<u8>,
    own_done: Vec<Completion>,
}

/// A lane's server, export and grants: a new map keeps the lane only if all three are the same.
type LaneKey = (String, String, Vec<wire::Capability>);

/// Spare piece buffers kept at most.
const SPARE_MAX: usize = 1024;

impl Segment {
    /// Open a lane to every server and export of `map` (no reconnection). A server that
    /// cannot be reached is out of service from the start; mapping fails if that leaves a
    /// stripe with no healthy copy.
    pub fn map(map: SegmentMap, config: &LaneConfig) -> Result<Segment> {
        Segment::open(map, config, None, None)
    }

    /// As [`map`](Segment::map), with the control plane behind it: servers it cannot reach
    /// or loses are reported to `source`, and the map is read again from it (module docs).
    /// With `connections`, lanes are taken from them where they keep one to the server, and
    /// left to them when the segment drops them (`crate::connections`).
    pub fn map_with(
        map: SegmentMap,
        config: &LaneConfig,
        source: Box<dyn MapSource>,
        connections: Option<Connections>,
    ) -> Result<Segment> {
        let mut segment = Segment::open(map, config, Some(source), connections)?;
        if !segment.unreported.is_empty() || segment.restale {
            segment.heal()?;
        }
        Ok(segment)
    }

    fn open(
        map: SegmentMap,
        config: &LaneConfig,
        source: Option<Box<dyn MapSource>>,
        connections: Option<Connections>,
    ) -> Result<Segment> {
        let mut segment = Segment {
            len: 0,
            chunk_bytes: 0,
            lanes: Vec::new(),
            base: Vec::new(),
            servers: Vec::new(),
            copies: Vec::new(),
            parents: Vec::new(),
            free_parents: Vec::new(),
            subs: Vec::new(),
            free_subs: Vec::new(),
            backlog: Vec::new(),
            busy: VecDeque::new(),
            in_flight: 0,
            block: SECTOR,
            piece_max: SECTOR,
            done: Vec::new(),
            scratch: Vec::new(),
            stats: SegmentStats::default(),
            config: config.clone(),
            source,
            connections,
            unreported: Vec::new(),
            again: Vec::new(),
            retired: LaneStats::default(),
            next_seq: 0,
            restale: false,
            spare: Vec::new(),
            own: Vec::new(),
            own_done: Vec::new(),
        };
        segment.install(map)?;
        Ok(segment)
    }

    /// Take up `map`: keep the lanes whose server, export and grants are the same and in
    /// service, open the others, drop the rest. No request may be out on a lane.
    fn install(&mut self, map: SegmentMap) -> Result<()> {
        if map.chunk_bytes == 0 || !map.chunk_bytes.is_multiple_of(SECTOR) {
            return Err(Error::InvalidArgument("chunk size is not a multiple of 512 bytes"));
        }
        if (map.stripes.len() as u64) < map.len.div_ceil(map.chunk_bytes) {
            return Err(Error::InvalidArgument("the map has fewer stripes than the segment's length needs"));
        }
        // The distinct servers (and exports), each with the grants of its chunks.
        let mut index: HashMap<(String, String), usize> = HashMap::new();
        let mut servers: Vec<Server> = Vec::new();
        let mut copies = Vec::with_capacity(map.stripes.len());
        for stripe in &map.stripes {
            let mut these = Vec::with_capacity(stripe.len());
            for loc in stripe {
                let i = *index.entry((loc.endpoint.to_string(), loc.export.clone())).or_insert_with(|| {
                    servers.push(Server {
                        endpoint: loc.endpoint.clone(),
                        export: loc.export.clone(),
                        grants: Vec::new(),
                        name: format!("{}/{}", loc.endpoint, loc.export),
                    });
                    servers.len() - 1
                });
                servers[i].grants.extend(loc.grant);
                these.push(Copy { lane: i, offset: loc.offset, syncing: loc.syncing });
            }
            // Healthy copies first: reads take the first in service.
            these.sort_by_key(|c| c.syncing);
            copies.push(these);
        }
        let mut old: HashMap<LaneKey, (Lane, LaneStats, Endpoint)> = HashMap::new();
        let was = self.lanes.drain(..).zip(self.base.drain(..)).zip(self.servers.drain(..));
        for ((lane, base), server) in was {
            if let Some(l) = lane {
                old.insert(
                    (server.endpoint.to_string(), server.export, server.grants),
                    (l, base, server.endpoint),
                );
            }
        }
        // The lanes of the old map the new one does not use as they are: counted, and left to
        // the connections, where the new map may take them up again with its own grants.
        let unused: Vec<_> = old
            .keys()
            .filter(|(e, x, g)| {
                !servers.iter().any(|s| s.endpoint.to_string() == *e && s.export == *x && s.grants == *g)
            })
            .cloned()
            .collect();
        for key in unused {
            let (lane, base, endpoint) = old.remove(&key).expect("a key of the old map");
            self.retired.add(&lane.stats().since(&base));
            self.leave(&endpoint, &key.1, &key.2, lane);
        }
        let mut lanes = Vec::with_capacity(servers.len());
        let mut bases = Vec::with_capacity(servers.len());
        let mut last_error = None;
        for server in &servers {
            let kept =
                old.remove(&(server.endpoint.to_string(), server.export.clone(), server.grants.clone()));
            let lane = kept.map(|(l, base, _)| (l, base)).or_else(|| {
                let config = self.lane_config(&server.grants);
                let opened = match &self.connections {
                    Some(c) => c.open(&server.endpoint, &server.export, &config),
                    None => Lane::connect(&server.endpoint, &server.export, &config),
                };
                opened
                    .map(|l| {
                        let base = l.stats();
                        (l, base)
                    })
                    .inspect_err(|e| {
                        if matches!(e, Error::Refused(wire::Status::StaleCapability)) && self.source.is_some() {
                            // The server knows a newer map than this one: read it again,
                            // rather than report a healthy server lost.
                            self.restale = true;
                            return;
                        }
                        tracing::warn!(server = %server.name, error = %e, "segment: a server is out of service");
                        last_error = Some(e.to_string());
                        self.unreported.push(server.endpoint.to_string());
                        // Counted once, when first mapped; a heal tries it again.
                        if self.stats.remaps == 0 {
                            self.stats.servers_failed += 1;
                        }
                    })
                    .ok()
            });
            let (lane, base) = lane.unzip();
            lanes.push(lane);
            bases.push(base.unwrap_or_default());
        }

        let block = lanes.iter().flatten().map(|l| u64::from(l.export().block_size)).max().unwrap_or(SECTOR);
        if !SECTOR.is_multiple_of(block) {
            return Err(Error::InvalidArgument(
                "a server's block is coarser than the 512-byte sector of chunks",
            ));
        }
        let piece_max = lanes
            .iter()
            .flatten()
            .map(|l| u64::from(l.limits().io_bytes_max))
            .filter(|&m| m >= SECTOR)
            .min()
            .unwrap_or(SECTOR)
            / SECTOR
            * SECTOR;
        self.len = map.len;
        self.chunk_bytes = map.chunk_bytes;
        self.backlog = vec![VecDeque::new(); lanes.len()];
        self.lanes = lanes;
        self.base = bases;
        self.servers = servers;
        self.copies = copies;
        self.block = block;
        self.piece_max = piece_max;
        // Without a source nothing can heal a stripe that lost every healthy copy.
        if self.source.is_none() && (0..self.copies.len()).any(|i| self.healthy(i).next().is_none()) {
            return Err(Error::Lost(format!(
                "every copy of a stripe is out of service: {}",
                last_error.unwrap_or_default()
            )));
        }
        Ok(())
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    /// The block request offsets and lengths must be multiples of: 1 on pools served by
    /// `skiff serve --pool`.
    pub fn block_bytes(&self) -> u64 {
        self.block
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn stats(&self) -> SegmentStats {
        self.stats
    }

    /// The lanes of the servers in service (for their counters).
    pub fn lanes(&self) -> impl Iterator<Item = &Lane> {
        self.lanes.iter().flatten()
    }

    /// The counters of every lane the segment has had, those dropped since (servers lost,
    /// lanes replaced by a new map) included: they only grow. A lane kept from an earlier
    /// mapping counts only what it did for this one.
    pub fn lane_stats(&self) -> LaneStats {
        let mut all = self.retired;
        for (lane, base) in self.lanes.iter().zip(&self.base) {
            if let Some(lane) = lane {
                all.add(&lane.stats().since(base));
            }
        }
        all
    }

    /// How the segment connects to a server it presents `grants` to.
    fn lane_config(&self, grants: &[wire::Capability]) -> LaneConfig {
        LaneConfig { reconnect: ReconnectConfig::OFF, grants: grants.into(), ..self.config.clone() }
    }

    /// Leave `lane` (to `export` at `endpoint`, opened with `grants`) to the connections, if
    /// the segment has them; else close it.
    fn leave(&self, endpoint: &Endpoint, export: &str, grants: &[wire::Capability], lane: Lane) {
        if let Some(c) = &self.connections {
            c.keep(endpoint, export, &self.lane_config(grants), lane);
        }
    }

    /// The sockets of the lanes with requests out, to sleep on all at once (after a
    /// [`poll`](Queue::poll), which takes in what TLS may hold decrypted already).
    pub fn wake_fds(&self, out: &mut Vec<std::os::fd::RawFd>) {
        out.extend(self.lanes.iter().flatten().filter(|l| l.in_flight() > 0).filter_map(Lane::wake_fd));
    }

    /// The servers (as `endpoint/export`) taken out of service.
    pub fn failed(&self) -> Vec<&str> {
        self.lanes
            .iter()
            .zip(&self.servers)
            .filter(|(l, _)| l.is_none())
            .map(|(_, s)| s.name.as_str())
            .collect()
    }

    /// The healthy copies of stripe `i` in service, as their lanes, in map order.
    fn healthy(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        self.copies[i].iter().filter(|c| !c.syncing && self.lanes[c.lane].is_some()).map(|c| c.lane)
    }

    fn take_out(&mut self, lane: usize, why: &str) {
        let Some(mut l) = self.lanes[lane].take() else { return };
        self.stats.servers_failed += 1;
        tracing::warn!(server = %self.servers[lane].name, why, "segment: a server is out of service");
        if self.source.is_some() {
            self.unreported.push(self.servers[lane].endpoint.to_string());
        }
        // What the lane completed as it failed brings the buffers it held back.
        let mut got = std::mem::take(&mut self.scratch);
        got.clear();
        let _ = l.poll(&mut got);
        self.retired.add(&l.stats().since(&self.base[lane]));
        for c in got.drain(..) {
            self.sub_failed(c.user_data as usize, c.buf);
        }
        self.scratch = got;
        // Everything else sent or waiting on it failed with it.
        let lost: Vec<usize> =
            (0..self.subs.len()).filter(|&s| self.subs[s].is_some_and(|sub| sub.lane == lane)).collect();
        self.backlog[lane].clear();
        for s in lost {
            self.sub_failed(s, None);
        }
    }

    fn new_sub(&mut self, mut sub: Sub) -> usize {
        self.next_seq += 1;
        sub.seq = self.next_seq;
        match self.free_subs.pop() {
            Some(i) => {
                self.subs[i] = Some(sub);
                i
            }
            None => {
                self.subs.push(Some(sub));
                self.subs.len() - 1
            }
        }
    }

    /// Queue a piece on `lane`; its parent counts it.
    fn queue_sub(&mut self, sub: Sub) {
        let lane = sub.lane;
        let i = self.new_sub(sub);
        if let Some(p) = self.parents[sub.parent].as_mut() {
            p.subs += 1;
        }
        self.backlog[lane].push_back(i);
    }

    /// Send request `pi` (new, or again under a new map) to its copies: a read to the first
    /// healthy copy of each piece, a write to every healthy copy. A piece with no healthy copy
    /// in service fails, or with a source, waits for the map to be read again.
    fn dispatch(&mut self, pi: usize) {
        let (opcode, offset, len) = {
            let p = self.parents[pi].as_ref().expect("a parent exists");
            (p.opcode, p.offset, p.len)
        };
        let (chunk, max) = (self.chunk_bytes, self.piece_max);
        let count = pieces(chunk, max, offset, len).count();
        // With a source, a write goes only where the map is current: every copy of its
        // stripes in service, and no server lost and not yet reported (a copy skipped
        // unreported would miss it untracked). Otherwise it waits for the heal.
        let outdated = self.source.is_some()
            && opcode == Opcode::Write
            && (!self.unreported.is_empty()
                || pieces(chunk, max, offset, len)
                    .any(|(_, _, s)| self.copies[s].iter().any(|c| self.lanes[c.lane].is_none())));
        for (piece, (at, n, stripe)) in pieces(chunk, max, offset, len).enumerate() {
            let healthy = if outdated { 0 } else { self.healthy(stripe).count() };
            if healthy == 0 {
                let p = self.parents[pi].as_mut().expect("a parent exists");
                if self.source.is_some() {
                    p.again = true;
                } else {
                    p.failed = true;
                }
                continue;
            }
            let whole = count == 1 && (healthy == 1 || opcode != Opcode::Write);
            for ci in 0..self.copies[stripe].len() {
                let c = self.copies[stripe][ci];
                if c.syncing || self.lanes[c.lane].is_none() {
                    continue;
                }
                self.queue_sub(Sub { parent: pi, piece, at, len: n, stripe, lane: c.lane, whole, seq: 0 });
                if opcode != Opcode::Write {
                    break;
                }
            }
        }
        if self.parents[pi].as_ref().is_some_and(|p| p.subs == 0) {
            // Nothing went out: the request ends (or waits for the map) at once.
            self.parents[pi].as_mut().expect("a parent exists").subs = 1;
            self.parent_sub_ended(pi);
        }
    }

    /// Move the writes whose `Busy` pause is over back to their lanes.
    fn retry_busy(&mut self) {
        let now = Instant::now();
        while self.busy.front().is_some_and(|&(due, _, _)| due <= now) {
            let (_, s, seq) = self.busy.pop_front().expect("a busy sub");
            // The sub may have ended meanwhile (its server failed) and its slot gone to another.
            let Some(sub) = self.subs[s].filter(|sub| sub.seq == seq) else { continue };
            if self.lanes[sub.lane].is_some() {
                self.backlog[sub.lane].push_back(s);
            } else {
                self.sub_failed(s, None);
            }
        }
    }

    /// Send what waits on each lane while it has room.
    fn pump(&mut self) {
        self.retry_busy();
        for lane in 0..self.lanes.len() {
            let mut failed = None;
            while let Some(&s) = self.backlog[lane].front() {
                let Some(l) = self.lanes[lane].as_mut() else { break };
                if l.in_flight() >= l.queue_depth() {
                    break;
                }
                self.backlog[lane].pop_front();
                let sub = self.subs[s].expect("a queued sub exists");
                let parent = self.parents[sub.parent].as_mut().expect("a sub's parent exists");
                let copy = self.copies[sub.stripe]
                    .iter()
                    .find(|c| c.lane == lane)
                    .expect("the lane holds the stripe");
                let place = copy.offset + sub.at % self.chunk_bytes;
                self.stats.requests += 1;
                // One piece on one lane takes the caller's buffer as it is; otherwise each
                // piece (and each copy of a write) has a buffer of its own.
                let lent = if sub.whole { parent.buf.take() } else { None };
                let submitted = if parent.opcode == Opcode::Write {
                    let from = (sub.at - parent.offset) as usize;
                    let buf = match lent {
                        Some(b) => b,
                        None => {
                            let mut b = self.spare.pop().unwrap_or_default();
                            b.clear();
                            b.extend_from_slice(
                                &parent.buf.as_ref().expect("a write keeps its data")[from..from + sub.len],
                            );
                            b
                        }
                    };
                    l.submit_write(place, buf, ReqFlags::empty(), s as u64)
                } else {
                    let buf = lent.unwrap_or_else(|| {
                        let mut b = self.spare.pop().unwrap_or_default();
                        b.resize(sub.len, 0);
                        b
                    });
                    l.submit_read(place, buf, s as u64)
                };
                match submitted {
                    Ok(()) => {}
                    // The lane judged the request itself wrong: it alone fails.
                    Err(r) if matches!(r.error, Error::InvalidArgument(_) | Error::QueueFull(_)) => {
                        self.sub_refused(s, Status::Invalid, r.buf);
                    }
                    Err(r) => {
                        self.give_back(s, r.buf);
                        failed = Some(r.error.to_string());
                        break;
                    }
                }
            }
            if failed.is_none() {
                if let Some(l) = self.lanes[lane].as_mut() {
                    if let Err(e) = l.commit() {
                        failed = Some(e.to_string());
                    }
                }
            }
            if let Some(why) = failed {
                self.take_out(lane, &why);
            }
        }
    }

    /// A buffer lent whole to sub `s` comes back to its request.
    fn give_back(&mut self, s: usize, buf: Option<Vec<u8>>) {
        let Some(sub) = self.subs[s] else { return };
        if let (true, Some(buf)) = (sub.whole, buf) {
            if let Some(p) = self.parents[sub.parent].as_mut() {
                p.buf.get_or_insert(buf);
            }
        }
    }

    /// Take in what the lanes with requests out have completed, waiting on none: a lane with
    /// nothing out has nothing to give, and asking it would cost a receive call.
    fn reap_busy(&mut self) {
        for lane in 0..self.lanes.len() {
            if self.lanes[lane].as_ref().is_some_and(|l| l.in_flight() > 0) {
                self.reap(lane, false);
            }
        }
    }

    /// Take in what lane `lane` has completed; with `block`, wait for at least one.
    fn reap(&mut self, lane: usize, block: bool) {
        let mut got = std::mem::take(&mut self.scratch);
        got.clear();
        let result = match self.lanes[lane].as_mut() {
            Some(l) if block => l.wait(1, &mut got),
            Some(l) => l.poll(&mut got),
            None => Ok(0),
        };
        let mut failed = result.err().map(|e| e.to_string());
        for c in got.drain(..) {
            let s = c.user_data as usize;
            match c.status {
                Status::Ok => self.sub_done(s, c.buf),
                // The server's storage failed: its copies are not to be trusted.
                Status::IoError => {
                    failed.get_or_insert_with(|| format!("request failed: {}", c.status));
                    self.sub_failed(s, c.buf);
                }
                // A repair is copying the region out: the write goes again shortly.
                Status::Busy => {
                    self.give_back(s, c.buf);
                    self.stats.busy += 1;
                    let seq = self.subs[s].map_or(0, |sub| sub.seq);
                    self.busy.push_back((Instant::now() + BUSY_RETRY, s, seq));
                }
                // The server knows a newer map than this segment: read it again.
                Status::StaleCapability if self.source.is_some() => self.sub_again(s, c.buf),
                // Refused for what it asked (range, size, rights): the request's fault.
                refused => self.sub_refused(s, refused, c.buf),
            }
        }
        self.scratch = got;
        if let Some(why) = failed {
            self.take_out(lane, &why);
        }
    }

    fn sub_done(&mut self, s: usize, data: Option<Vec<u8>>) {
        let Some(sub) = self.subs[s].take() else { return };
        self.free_subs.push(s);
        let p = self.parents[sub.parent].as_mut().expect("a sub's parent exists");
        if p.opcode == Opcode::Write {
            p.held.set(sub.piece);
        }
        match data {
            // The caller's buffer comes back (a read's filled in place).
            Some(data) if sub.whole => p.buf = Some(data),
            Some(data) => {
                if p.opcode != Opcode::Write {
                    let from = (sub.at - p.offset) as usize;
                    let len = p.len;
                    p.buf.get_or_insert_with(|| vec![0; len])[from..from + sub.len]
                        .copy_from_slice(&data[..sub.len]);
                }
                if self.spare.len() < SPARE_MAX {
                    self.spare.push(data);
                }
            }
            None => {}
        }
        self.parent_sub_ended(sub.parent);
    }

    /// Sub `s` failed with its server. A read goes to the next healthy copy in service; a
    /// write (with a source) goes again once the server is reported and the map read again.
    fn sub_failed(&mut self, s: usize, buf: Option<Vec<u8>>) {
        self.give_back(s, buf);
        let Some(sub) = self.subs[s].take() else { return };
        self.free_subs.push(s);
        let opcode = self.parents[sub.parent].as_ref().expect("a sub's parent exists").opcode;
        if opcode != Opcode::Write {
            // The next healthy copy in service, if any, reads the piece instead.
            let next = self.healthy(sub.stripe).find(|&l| l != sub.lane);
            if let Some(next) = next {
                self.stats.fallbacks += 1;
                self.queue_sub(Sub { lane: next, ..sub });
            } else if let Some(p) = self.parents[sub.parent].as_mut() {
                p.again |= self.source.is_some();
                p.failed |= self.source.is_none();
            }
        } else if self.source.is_some() {
            if let Some(p) = self.parents[sub.parent].as_mut() {
                p.again = true;
            }
        }
        self.parent_sub_ended(sub.parent);
    }

    /// Sub `s` met a newer map than the segment's: its request goes again under the next.
    fn sub_again(&mut self, s: usize, buf: Option<Vec<u8>>) {
        self.give_back(s, buf);
        let Some(sub) = self.subs[s].take() else { return };
        self.free_subs.push(s);
        if let Some(p) = self.parents[sub.parent].as_mut() {
            p.again = true;
            p.stale = true;
        }
        self.parent_sub_ended(sub.parent);
    }

    /// A sub-request refused for what it asked: its request fails with that status, no other
    /// copy is asked (it would say the same), and the server stays in service.
    fn sub_refused(&mut self, s: usize, status: Status, buf: Option<Vec<u8>>) {
        self.give_back(s, buf);
        let Some(sub) = self.subs[s].take() else { return };
        self.free_subs.push(s);
        let p = self.parents[sub.parent].as_mut().expect("a sub's parent exists");
        p.failed = true;
        p.refused.get_or_insert(status);
        self.parent_sub_ended(sub.parent);
    }

    fn parent_sub_ended(&mut self, i: usize) {
        let p = self.parents[i].as_mut().expect("a parent exists");
        p.subs -= 1;
        if p.subs > 0 {
            return;
        }
        if p.again && p.refused.is_none() {
            if p.reissues < REISSUES_MAX {
                self.again.push(i);
                return;
            }
            // Still stale: the allocation was freed, or the map is not the servers'. Still
            // missing a copy: no healthy one is left in service.
            p.refused = p.stale.then_some(Status::StaleCapability);
            p.failed = true;
        }
        if p.opcode == Opcode::Write && !p.failed && !p.second {
            // The healthy copies hold it: now the copies being repaired.
            p.second = true;
            let (offset, len) = (p.offset, p.len);
            for (piece, (at, n, stripe)) in pieces(self.chunk_bytes, self.piece_max, offset, len).enumerate()
            {
                if self.source.is_some() && self.copies[stripe].iter().any(|c| self.lanes[c.lane].is_none()) {
                    // A copy being repaired went out of service meanwhile: report, map again,
                    // and send it all again.
                    self.parents[i].as_mut().expect("a parent exists").again = true;
                    continue;
                }
                for ci in 0..self.copies[stripe].len() {
                    let c = self.copies[stripe][ci];
                    if c.syncing && self.lanes[c.lane].is_some() {
                        self.queue_sub(Sub {
                            parent: i,
                            piece,
                            at,
                            len: n,
                            stripe,
                            lane: c.lane,
                            whole: false,
                            seq: 0,
                        });
                    }
                }
            }
            if self.parents[i].as_ref().is_some_and(|p| p.again && p.subs == 0) {
                self.parents[i].as_mut().expect("a parent exists").subs = 1;
                self.parent_sub_ended(i);
                return;
            }
            if self.parents[i].as_ref().is_some_and(|p| p.subs > 0) {
                return;
            }
        }
        let p = self.parents[i].take().expect("a parent exists");
        self.free_parents.push(i);
        self.in_flight -= 1;
        let ok = !p.failed && p.held.all();
        self.done.push(Completion {
            user_data: p.user_data,
            opcode: p.opcode,
            status: if ok { Status::Ok } else { p.refused.unwrap_or(Status::IoError) },
            // A buffer lent to a lane that failed is gone with it: the caller gets one of the
            // same length.
            buf: Some(p.buf.unwrap_or_else(|| vec![0; p.len])),
        });
    }

    /// Whether the segment must report a lost server or read its map again before going on.
    fn must_heal(&self) -> bool {
        self.source.is_some() && (!self.unreported.is_empty() || !self.again.is_empty() || self.restale)
    }

    /// Heal: let every request out end, report the servers lost, read the map again and take
    /// it up, then send again the requests that wait for it. Blocks (an etcd round trip or
    /// more, and a connection per changed server); gives up after [`HEAL_DEADLINE`], failing
    /// the requests that waited.
    fn heal(&mut self) -> Result<()> {
        // Nothing may be out on a lane that the new map could replace.
        while self.lanes.iter().flatten().any(|l| l.in_flight() > 0)
            || self.backlog.iter().any(|b| !b.is_empty())
            || !self.busy.is_empty()
        {
            self.pump();
            match self.busiest() {
                Some(lane) => self.reap(lane, true),
                None => std::thread::sleep(BUSY_RETRY),
            }
        }
        let deadline = Instant::now() + HEAL_DEADLINE;
        let mut pause = Duration::from_millis(10);
        type Call<'a> = &'a mut dyn FnMut(&mut dyn MapSource) -> std::result::Result<(), SourceError>;
        let attempt = |source: &mut Box<dyn MapSource>, pause: &mut Duration, what: &str, f: Call<'_>| loop {
            match f(source.as_mut()) {
                Ok(()) => return Ok(()),
                Err(e) if !e.retry || Instant::now() >= deadline => {
                    return Err(format!("{what}: {}", e.message))
                }
                Err(e) => {
                    tracing::warn!(error = %e.message, "segment: cannot {what} yet; trying again");
                    std::thread::sleep(*pause);
                    *pause = (*pause * 2).min(Duration::from_secs(1));
                }
            }
        };
        let mut installed = Ok(());
        // Until a map takes with every server reached: one that fails to connect is reported
        // in its turn (its copies go stale, and the next map leaves them out).
        for _ in 0..=self.servers.len() {
            let mut healed = Ok(None);
            for endpoint in std::mem::take(&mut self.unreported) {
                let source = self.source.as_mut().expect("only a segment with a source heals");
                if let Err(e) =
                    attempt(source, &mut pause, "report a lost server", &mut |s| s.lost(&endpoint))
                {
                    healed = Err(e);
                    break;
                }
            }
            if healed.is_ok() {
                let mut map = None;
                let source = self.source.as_mut().expect("only a segment with a source heals");
                healed = attempt(source, &mut pause, "read the map again", &mut |s| {
                    s.map().map(|m| map = Some(m))
                })
                .map(|()| map);
            }
            self.stats.remaps += 1;
            self.restale = false;
            installed = match healed {
                Ok(Some(map)) => self.install(map).map_err(|e| e.to_string()),
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            };
            if installed.is_err() || (self.unreported.is_empty() && !self.restale) {
                break;
            }
        }
        let again = std::mem::take(&mut self.again);
        if let Err(why) = &installed {
            tracing::warn!(error = %why, "segment: cannot heal; the requests that waited fail");
        }
        for pi in again {
            let p = self.parents[pi].as_mut().expect("a request waiting for the map");
            if installed.is_err() {
                p.again = false;
                p.failed = true;
                p.refused = p.refused.or(p.stale.then_some(Status::StaleCapability));
                p.subs = 1;
                self.parent_sub_ended(pi);
                continue;
            }
            p.again = false;
            p.stale = false;
            p.second = false;
            p.reissues += 1;
            let all = p.opcode != Opcode::Write;
            p.held.reset(all);
            self.stats.reissues += 1;
            self.dispatch(pi);
        }
        installed.map_err(Error::Lost)
    }

    /// Read `buf.len()` bytes at `offset` of the segment, blocking. Allocates nothing once
    /// warm: the segment keeps the buffer the request goes in.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let (mut own, mut done) = (std::mem::take(&mut self.own), std::mem::take(&mut self.own_done));
        let read = blocking_read(self, &mut own, &mut done, offset, buf);
        (self.own, self.own_done) = (own, done);
        read
    }

    /// Write `data` at `offset` of the segment, blocking; allocates nothing once warm.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let (mut own, mut done) = (std::mem::take(&mut self.own), std::mem::take(&mut self.own_done));
        let written = blocking_write(self, &mut own, &mut done, offset, data);
        (self.own, self.own_done) = (own, done);
        written
    }

    /// The lane with the most requests out, if any has some: the one to sleep on.
    fn busiest(&self) -> Option<usize> {
        (0..self.lanes.len())
            .filter_map(|i| self.lanes[i].as_ref().map(|l| (l.in_flight(), i)))
            .max()
            .filter(|(n, _)| *n > 0)
            .map(|(_, i)| i)
    }
}

/// A blocking read through `q` (a segment, or a shared segment's handle) with nothing else in
/// flight, in the caller's kept buffer `own` and completions `done`: nothing allocated once
/// they have grown.
pub(crate) fn blocking_read(
    q: &mut impl Queue<Vec<u8>>,
    own: &mut Vec<u8>,
    done: &mut Vec<Completion>,
    offset: u64,
    buf: &mut [u8],
) -> Result<()> {
    let mut b = std::mem::take(own);
    b.clear();
    b.resize(buf.len(), 0);
    let data = blocking(q, done, Opcode::Read, offset, b)?;
    buf.copy_from_slice(&data);
    *own = data;
    Ok(())
}

/// A blocking write through `q`, as [`blocking_read`].
pub(crate) fn blocking_write(
    q: &mut impl Queue<Vec<u8>>,
    own: &mut Vec<u8>,
    done: &mut Vec<Completion>,
    offset: u64,
    data: &[u8],
) -> Result<()> {
    let mut b = std::mem::take(own);
    b.clear();
    b.extend_from_slice(data);
    *own = blocking(q, done, Opcode::Write, offset, b)?;
    Ok(())
}

fn blocking(
    q: &mut impl Queue<Vec<u8>>,
    done: &mut Vec<Completion>,
    opcode: Opcode,
    offset: u64,
    buf: Vec<u8>,
) -> Result<Vec<u8>> {
    if buf.is_empty() {
        return Ok(buf);
    }
    if q.in_flight() > 0 {
        return Err(Error::InvalidArgument("blocking segment I/O with requests in flight"));
    }
    let len = buf.len();
    q.submit(opcode, ReqFlags::empty(), offset, len, Some(buf), 0).map_err(|r| r.error)?;
    done.clear();
    q.wait(1, done)?;
    let c = done.pop().expect("one completion");
    match c.status {
        Status::Ok => Ok(c.buf.unwrap_or_default()),
        Status::IoError => Err(Error::Lost(format!(
            "bytes {offset}..{} of the segment: every copy is out of service",
            offset + len as u64
        ))),
        other => Err(Error::Status(other)),
    }
}

/// An unmapped segment leaves its idle lanes to its connections (`crate::connections`).
impl Drop for Segment {
    fn drop(&mut self) {
        if self.connections.is_none() {
            return;
        }
        let lanes = std::mem::take(&mut self.lanes);
        for (lane, server) in lanes.into_iter().zip(&self.servers) {
            if let Some(lane) = lane {
                self.leave(&server.endpoint, &server.export, &server.grants, lane);
            }
        }
    }
}

impl Queue<Vec<u8>> for Segment {
    fn submit(
        &mut self,
        opcode: Opcode,
        _flags: ReqFlags,
        offset: u64,
        length: usize,
        buf: Option<Vec<u8>>,
        user_data: u64,
    ) -> std::result::Result<(), Rejected<Vec<u8>>> {
        let reject = |error, buf| Err(Rejected { error, buf });
        if !matches!(opcode, Opcode::Read | Opcode::Write) {
            return reject(Error::InvalidArgument("a segment takes reads and writes"), buf);
        }
        let buf = match buf {
            Some(b) if b.len() == length => b,
            other => {
                return reject(
                    Error::InvalidArgument("a segment request needs a buffer of its length"),
                    other,
                )
            }
        };
        if length == 0 || !offset.is_multiple_of(self.block) || !(length as u64).is_multiple_of(self.block) {
            return reject(
                Error::InvalidArgument("segment I/O is not aligned to its servers' block"),
                Some(buf),
            );
        }
        if offset.checked_add(length as u64).is_none_or(|end| end > self.len) {
            return reject(Error::InvalidArgument("segment I/O past the end of the segment"), Some(buf));
        }
        if self.source.is_none()
            && pieces(self.chunk_bytes, self.piece_max, offset, length)
                .any(|(_, _, stripe)| self.healthy(stripe).next().is_none())
        {
            return reject(Error::Lost("every copy of a stripe is out of service".into()), Some(buf));
        }
        let parent = Parent {
            opcode,
            user_data,
            offset,
            buf: Some(buf),
            len: length,
            subs: 0,
            failed: false,
            refused: None,
            held: Held::new(
                pieces(self.chunk_bytes, self.piece_max, offset, length).count(),
                opcode != Opcode::Write,
            ),
            second: false,
            again: false,
            stale: false,
            reissues: 0,
        };
        let pi = match self.free_parents.pop() {
            Some(i) => {
                self.parents[i] = Some(parent);
                i
            }
            None => {
                self.parents.push(Some(parent));
                self.parents.len() - 1
            }
        };
        self.in_flight += 1;
        if opcode == Opcode::Write {
            self.stats.writes += 1;
        } else {
            self.stats.reads += 1;
        }
        self.dispatch(pi);
        Ok(())
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> Result<usize> {
        let min = min.min(self.in_flight + self.done.len());
        let mut got = 0;
        loop {
            if self.must_heal() {
                // Requests that waited fail on their own if this does; the rest go on.
                let _ = self.heal();
            }
            self.pump();
            self.reap_busy();
            got += self.done.len();
            out.append(&mut self.done);
            if got >= min {
                return Ok(got);
            }
            if self.must_heal() {
                continue;
            }
            self.pump();
            // Sleep on the lane with the most in flight; the others' completions wait in
            // their sockets meanwhile.
            match self.busiest() {
                Some(lane) => self.reap(lane, true),
                None if !self.busy.is_empty() => std::thread::sleep(BUSY_RETRY),
                None if self.backlog.iter().all(VecDeque::is_empty) && self.done.is_empty() => {
                    // Nothing in flight anywhere and nothing to send: whatever is left failed.
                    return Ok(got);
                }
                None => {}
            }
        }
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        if self.must_heal() {
            let _ = self.heal();
        }
        self.pump();
        self.reap_busy();
        let n = self.done.len();
        out.append(&mut self.done);
        Ok(n)
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}
