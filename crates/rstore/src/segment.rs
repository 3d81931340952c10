//! RStore's data path (docs/RSTORE.md): a mapped `raddress` segment, read and written straight
//! on the memory servers that hold its chunks, striped, with replicas.
//!
//! The control plane ([`crate::control`], over etcd) resolves a segment to a [`SegmentMap`]:
//! its length, its chunk size, and for every chunk (a *stripe*) the places of its copies
//! (server endpoint, export, byte offset). [`Segment::map`] opens one lane per distinct
//! (server, export) and keeps them for the segment's life: reads and writes allocate nothing
//! on the servers and never ask the coordinator. One `Segment` belongs to one thread, so its lanes are that
//! thread's lanes to each server (i10's P×T): several threads map the segment each.
//!
//! A `Segment` is a [`Queue`] like a lane: requests in, completions out, many in flight. A
//! request is split at chunk boundaries into pieces, each sent to its servers as an ordinary
//! request on their lanes (a *sub*-request); the request completes when its last piece does.
//! A write piece goes to every replica in service and succeeds when at least one holds it
//! (every replica still in service does, since a replica that fails is taken out); a read
//! piece asks the first replica in service and, when that fails, the next. A replica whose
//! server fails (its connection is lost, or a request on it fails) is taken out of service for
//! the rest of the segment's life: a server killed under load costs the requests in flight on
//! it a retry elsewhere and surfaces no error while one copy of every stripe it held is left.
//! Lanes do not reconnect: the replicas are the redundancy.
//!
//! Offsets and lengths may be any bytes when the servers serve their pools at a one-byte
//! block (`skiff serve --pool` does): a request goes to the servers as it is, with no
//! read-modify-write, so a one-byte write changes that byte alone, atomically on a RAM pool
//! (RStore's one-byte flags). Against exports with a coarser block, requests must be
//! multiples of the coarsest block among the segment's servers.

use std::collections::{HashMap, VecDeque};

use initiator::{Completion, Endpoint, Error, Lane, LaneConfig, Queue, ReconnectConfig, Rejected, Result};
use wire::{Opcode, ReqFlags, Status};

/// Chunks are whole sectors, whatever the servers' block.
const SECTOR: u64 = 512;

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
}

/// A segment resolved for the data path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentMap {
    pub len: u64,
    pub chunk_bytes: u64,
    /// `stripes[i]`: the copies of bytes `i * chunk_bytes ..` of the segment.
    pub stripes: Vec<Vec<Location>>,
}

/// What a segment's I/O did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentStats {
    pub reads: u64,
    pub writes: u64,
    /// Requests sent to servers (pieces times replicas, retries included).
    pub requests: u64,
    /// Read pieces sent again to another replica after the first failed.
    pub fallbacks: u64,
    /// Servers taken out of service.
    pub servers_failed: u64,
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
    /// Pieces that reached no replica (a write) or no replica answered (a read).
    failed: bool,
    /// Per piece of a write: whether some replica holds it.
    held: Vec<bool>,
    /// What a server answered when it refused a piece (out of range, too large...): the
    /// request's own fault, reported as it is, and no reason to take the server out.
    refused: Option<Status>,
}

/// One piece on one replica.
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
}

/// What a segment calls with the endpoint of a server it takes out of service.
type ServerFailed = Box<dyn FnMut(&str) + Send>;

/// A mapped segment: its lanes, one per server and export.
pub struct Segment {
    map: SegmentMap,
    /// `None` once the server failed.
    lanes: Vec<Option<Lane>>,
    names: Vec<String>,
    /// Each lane's server endpoint.
    endpoints: Vec<String>,
    /// `replicas[i][r]`: the lane of copy `r` of stripe `i`.
    replicas: Vec<Vec<usize>>,
    parents: Vec<Option<Parent>>,
    free_parents: Vec<usize>,
    subs: Vec<Option<Sub>>,
    free_subs: Vec<usize>,
    /// Sub-requests waiting for room on their lane.
    backlog: Vec<VecDeque<usize>>,
    in_flight: usize,
    /// The unit of alignment: the coarsest block among the servers' exports.
    block: u64,
    /// The largest piece: the smallest I/O size the servers' lanes negotiated.
    piece_max: u64,
    done: Vec<Completion>,
    scratch: Vec<Completion>,
    stats: SegmentStats,
    /// Told the endpoint of each server taken out of service.
    on_failed: Option<ServerFailed>,
}

impl Segment {
    /// Open a lane to every server and export of `map` (no reconnection: a failed server is
    /// taken out of service). A server that cannot be reached is out of service from the
    /// start; mapping fails if that leaves a stripe with no copy.
    pub fn map(map: SegmentMap, config: &LaneConfig) -> Result<Segment> {
        if map.chunk_bytes == 0 || !map.chunk_bytes.is_multiple_of(SECTOR) {
            return Err(Error::InvalidArgument("chunk size is not a multiple of 512 bytes"));
        }
        if (map.stripes.len() as u64) < map.len.div_ceil(map.chunk_bytes) {
            return Err(Error::InvalidArgument("the map has fewer stripes than the segment's length needs"));
        }
        // The distinct servers (and exports), each with the grants of its chunks.
        let mut index: HashMap<(String, String), usize> = HashMap::new();
        let mut servers: Vec<(&Location, Vec<wire::Capability>)> = Vec::new();
        let mut replicas = Vec::with_capacity(map.stripes.len());
        for stripe in &map.stripes {
            let mut copies = Vec::with_capacity(stripe.len());
            for loc in stripe {
                let i = *index.entry((loc.endpoint.to_string(), loc.export.clone())).or_insert_with(|| {
                    servers.push((loc, Vec::new()));
                    servers.len() - 1
                });
                servers[i].1.extend(loc.grant);
                copies.push(i);
            }
            replicas.push(copies);
        }
        let mut lanes = Vec::with_capacity(servers.len());
        let mut names = Vec::with_capacity(servers.len());
        let mut endpoints = Vec::with_capacity(servers.len());
        let mut last_error = None;
        for (loc, grants) in servers {
            let config =
                LaneConfig { reconnect: ReconnectConfig::OFF, grants: grants.into(), ..config.clone() };
            let (endpoint, export) = (loc.endpoint.to_string(), &loc.export);
            let lane = Lane::connect(&loc.endpoint, export, &config)
                .inspect_err(|e| {
                    tracing::warn!(server = %endpoint, %export, error = %e, "segment: a server is out of service");
                    last_error = Some(e.to_string());
                })
                .ok();
            lanes.push(lane);
            names.push(format!("{endpoint}/{export}"));
            endpoints.push(endpoint);
        }
        let servers_failed = lanes.iter().filter(|l| l.is_none()).count() as u64;
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
        let backlog = vec![VecDeque::new(); lanes.len()];
        let segment = Segment {
            map,
            lanes,
            names,
            endpoints,
            replicas,
            parents: Vec::new(),
            free_parents: Vec::new(),
            subs: Vec::new(),
            free_subs: Vec::new(),
            backlog,
            in_flight: 0,
            block,
            piece_max,
            done: Vec::new(),
            scratch: Vec::new(),
            stats: SegmentStats { servers_failed, ..SegmentStats::default() },
            on_failed: None,
        };
        if (0..segment.replicas.len()).any(|i| segment.in_service(i).next().is_none()) {
            return Err(Error::Lost(format!(
                "every copy of a stripe is out of service: {}",
                last_error.unwrap_or_default()
            )));
        }
        Ok(segment)
    }

    pub fn len(&self) -> u64 {
        self.map.len
    }

    /// The block request offsets and lengths must be multiples of: 1 on pools served by
    /// `skiff serve --pool`.
    pub fn block_bytes(&self) -> u64 {
        self.block
    }

    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    pub fn stats(&self) -> SegmentStats {
        self.stats
    }

    /// The lanes of the servers in service (for their counters).
    pub fn lanes(&self) -> impl Iterator<Item = &Lane> {
        self.lanes.iter().flatten()
    }

    /// The servers (as `endpoint/export`) taken out of service.
    pub fn failed(&self) -> Vec<&str> {
        self.lanes.iter().zip(&self.names).filter(|(l, _)| l.is_none()).map(|(_, n)| n.as_str()).collect()
    }

    /// The lanes in service holding stripe `i`, in replica order.
    fn in_service(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        self.replicas[i].iter().copied().filter(|&l| self.lanes[l].is_some())
    }

    /// Call `f` with the endpoint of each server this segment takes out of service from now
    /// on (the control plane marks its copies stale: [`crate::Coordinator::map`] sets this).
    pub fn on_server_failed(&mut self, f: impl FnMut(&str) + Send + 'static) {
        self.on_failed = Some(Box::new(f));
    }

    fn take_out(&mut self, lane: usize, why: &str) {
        if self.lanes[lane].take().is_none() {
            return;
        }
        self.stats.servers_failed += 1;
        tracing::warn!(server = %self.names[lane], why, "segment: a server is out of service");
        if let Some(f) = self.on_failed.as_mut() {
            f(&self.endpoints[lane]);
        }
        // Everything sent or waiting on it failed with it.
        let lost: Vec<usize> =
            (0..self.subs.len()).filter(|&s| self.subs[s].is_some_and(|sub| sub.lane == lane)).collect();
        self.backlog[lane].clear();
        for s in lost {
            self.sub_failed(s);
        }
    }

    fn new_sub(&mut self, sub: Sub) -> usize {
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

    /// Send what waits on each lane while it has room.
    fn pump(&mut self) {
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
                let copy = self.replicas[sub.stripe]
                    .iter()
                    .position(|&r| r == lane)
                    .expect("the lane holds the stripe");
                let place = self.map.stripes[sub.stripe][copy].offset + sub.at % self.map.chunk_bytes;
                self.stats.requests += 1;
                // One piece on one lane takes the caller's buffer as it is; otherwise each
                // piece (and each replica of a write) has a buffer of its own.
                let lent = if sub.whole { parent.buf.take() } else { None };
                let submitted = if parent.opcode == Opcode::Write {
                    let from = (sub.at - parent.offset) as usize;
                    let buf = match lent {
                        Some(b) => b,
                        None => parent.buf.as_ref().expect("a write keeps its data")[from..from + sub.len]
                            .to_vec(),
                    };
                    l.submit_write(place, buf, ReqFlags::empty(), s as u64)
                } else {
                    l.submit_read(place, lent.unwrap_or_else(|| vec![0; sub.len]), s as u64)
                };
                match submitted {
                    Ok(()) => {}
                    // The lane judged the request itself wrong: it alone fails.
                    Err(r) if matches!(r.error, Error::InvalidArgument(_) | Error::QueueFull(_)) => {
                        self.sub_refused(s, Status::Invalid, r.buf);
                    }
                    Err(r) => {
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
                    self.sub_failed(s);
                }
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
            p.held[sub.piece] = true;
        }
        match data {
            // The caller's buffer comes back (a read's filled in place).
            Some(data) if sub.whole => p.buf = Some(data),
            Some(data) if p.opcode != Opcode::Write => {
                let from = (sub.at - p.offset) as usize;
                let len = p.len;
                p.buf.get_or_insert_with(|| vec![0; len])[from..from + sub.len]
                    .copy_from_slice(&data[..sub.len]);
            }
            _ => {}
        }
        self.parent_sub_ended(sub.parent);
    }

    fn sub_failed(&mut self, s: usize) {
        let Some(sub) = self.subs[s].take() else { return };
        self.free_subs.push(s);
        let opcode = self.parents[sub.parent].as_ref().expect("a sub's parent exists").opcode;
        if opcode != Opcode::Write {
            // The next replica in service, if any, reads the piece instead.
            let next = self.in_service(sub.stripe).find(|&l| l != sub.lane);
            if let Some(next) = next {
                self.stats.fallbacks += 1;
                self.queue_sub(Sub { lane: next, ..sub });
            } else if let Some(p) = self.parents[sub.parent].as_mut() {
                p.failed = true;
            }
        }
        self.parent_sub_ended(sub.parent);
    }

    /// A sub-request refused for what it asked: its request fails with that status, no other
    /// replica is asked (it would say the same), and the server stays in service.
    fn sub_refused(&mut self, s: usize, status: Status, buf: Option<Vec<u8>>) {
        let Some(sub) = self.subs[s].take() else { return };
        self.free_subs.push(s);
        let p = self.parents[sub.parent].as_mut().expect("a sub's parent exists");
        p.failed = true;
        p.refused.get_or_insert(status);
        if sub.whole && p.buf.is_none() {
            p.buf = buf;
        }
        self.parent_sub_ended(sub.parent);
    }

    fn parent_sub_ended(&mut self, i: usize) {
        let p = self.parents[i].as_mut().expect("a parent exists");
        p.subs -= 1;
        if p.subs > 0 {
            return;
        }
        let p = self.parents[i].take().expect("a parent exists");
        self.free_parents.push(i);
        self.in_flight -= 1;
        let ok = !p.failed && p.held.iter().all(|&h| h);
        self.done.push(Completion {
            user_data: p.user_data,
            opcode: p.opcode,
            status: if ok { Status::Ok } else { p.refused.unwrap_or(Status::IoError) },
            // A buffer lent to a lane that failed is gone with it: the caller gets one of the
            // same length.
            buf: Some(p.buf.unwrap_or_else(|| vec![0; p.len])),
        });
    }

    /// Read `buf.len()` bytes at `offset` of the segment, blocking.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let data = self.blocking(Opcode::Read, offset, vec![0; buf.len()])?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    /// Write `data` at `offset` of the segment, blocking.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        self.blocking(Opcode::Write, offset, data.to_vec()).map(drop)
    }

    fn blocking(&mut self, opcode: Opcode, offset: u64, buf: Vec<u8>) -> Result<Vec<u8>> {
        if buf.is_empty() {
            return Ok(buf);
        }
        if self.in_flight > 0 {
            return Err(Error::InvalidArgument("blocking segment I/O with requests in flight"));
        }
        let len = buf.len();
        self.submit(opcode, ReqFlags::empty(), offset, len, Some(buf), u64::MAX).map_err(|r| r.error)?;
        let mut out = Vec::new();
        self.wait(1, &mut out)?;
        let c = out.pop().expect("one completion");
        if c.status != Status::Ok && c.status != Status::IoError {
            return Err(Error::Status(c.status));
        }
        if c.status != Status::Ok {
            return Err(Error::Lost(format!(
                "bytes {offset}..{} of the segment: every copy is out of service",
                offset + len as u64
            )));
        }
        Ok(c.buf.unwrap_or_default())
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
        if offset.checked_add(length as u64).is_none_or(|end| end > self.map.len) {
            return reject(Error::InvalidArgument("segment I/O past the end of the segment"), Some(buf));
        }
        // The pieces, at chunk boundaries.
        let chunk = self.map.chunk_bytes;
        let mut pieces = Vec::new();
        let (mut at, end) = (offset, offset + length as u64);
        while at < end {
            let n = (chunk - at % chunk).min(end - at).min(self.piece_max);
            pieces.push((at, n as usize, (at / chunk) as usize));
            at += n;
        }
        if pieces.iter().any(|&(_, _, stripe)| self.in_service(stripe).next().is_none()) {
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
            held: vec![opcode != Opcode::Write; pieces.len()],
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
        for (piece, &(at, len, stripe)) in pieces.iter().enumerate() {
            let lanes: Vec<usize> = if opcode == Opcode::Write {
                self.in_service(stripe).collect()
            } else {
                self.in_service(stripe).take(1).collect()
            };
            let whole = pieces.len() == 1 && lanes.len() == 1;
            for lane in lanes {
                self.queue_sub(Sub { parent: pi, piece, at, len, stripe, lane, whole });
            }
        }
        Ok(())
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> Result<usize> {
        let min = min.min(self.in_flight + self.done.len());
        let mut got = 0;
        loop {
            self.pump();
            self.reap_busy();
            got += self.done.len();
            out.append(&mut self.done);
            if got >= min {
                return Ok(got);
            }
            self.pump();
            // Sleep on the lane with the most in flight; the others' completions wait in
            // their sockets meanwhile.
            let busiest = (0..self.lanes.len())
                .filter_map(|i| self.lanes[i].as_ref().map(|l| (l.in_flight(), i)))
                .max()
                .filter(|(n, _)| *n > 0);
            match busiest {
                Some((_, lane)) => self.reap(lane, true),
                None if self.backlog.iter().all(VecDeque::is_empty) && self.done.is_empty() => {
                    // Nothing in flight anywhere and nothing to send: whatever is left failed.
                    return Ok(got);
                }
                None => {}
            }
        }
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
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
