//! RStore's data path (docs/RSTORE.md): a mapped `raddress` segment, read and written straight
//! on the memory servers that hold its chunks, striped, with replicas.
//!
//! The control plane (`coord`, etcd) resolves a segment to a [`SegmentMap`]: its length, its
//! chunk size, and for every chunk (a *stripe*) the places of its copies (server endpoint,
//! export, byte offset). [`Segment::map`] opens one lane per distinct (server, export) and
//! keeps them for the segment's life: reads and writes allocate nothing anywhere and never ask
//! the coordinator. One `Segment` belongs to one thread, so its lanes are that thread's lanes
//! to each server (i10's P×T): several threads map the segment each.
//!
//! An I/O is split at chunk boundaries; the pieces go out on all their lanes before any is
//! waited for, so the servers work in parallel. A write goes to every replica of its stripe
//! and completes when every replica still in service holds it; a read asks the first replica in
//! service and falls back to the next when that fails. A replica whose server fails (the
//! connection is lost or a request fails) is taken out of service for the rest of the
//! segment's life, so a server killed under load costs the I/Os in flight on it a retry and
//! surfaces no error while one copy of every stripe it held is left. Lanes do not reconnect:
//! the replica is the redundancy.
//!
//! Offsets and lengths must be multiples of 512 bytes, as on any export: RStore's one-byte
//! writes need a byte-granular operation on the target, which the protocol does not have yet.

use std::collections::HashMap;

use wire::{Opcode, ReqFlags, Status};

use crate::queue::Queue;
use crate::{Completion, Endpoint, Error, Lane, LaneConfig, ReconnectConfig, Result};

/// Requests one lane has in flight at most within one segment I/O.
const LANE_DEPTH: usize = 32;
/// The unit of alignment of segment I/O.
const SECTOR: u64 = 512;

/// Where one copy of a chunk lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub endpoint: Endpoint,
    pub export: String,
    /// Byte offset of the chunk in the export.
    pub offset: u64,
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
    /// Reads of a piece sent again to another replica after the first failed.
    pub fallbacks: u64,
    /// Servers taken out of service.
    pub servers_failed: u64,
}

/// A mapped segment: its lanes, one per server and export.
pub struct Segment {
    map: SegmentMap,
    /// `None` once the server failed.
    lanes: Vec<Option<Lane>>,
    names: Vec<String>,
    /// `replicas[i][r]`: the lane of copy `r` of stripe `i`.
    replicas: Vec<Vec<usize>>,
    stats: SegmentStats,
}

/// One piece of an I/O: bytes `[at, at + len)` of the segment, in stripe `stripe`.
#[derive(Debug, Clone, Copy)]
struct Piece {
    at: u64,
    len: usize,
    stripe: usize,
    within: u64,
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
        let config = LaneConfig { reconnect: ReconnectConfig::OFF, ..config.clone() };
        let mut index: HashMap<(String, String), usize> = HashMap::new();
        let mut lanes = Vec::new();
        let mut names = Vec::new();
        let mut replicas = Vec::with_capacity(map.stripes.len());
        let mut last_error = None;
        for stripe in &map.stripes {
            let mut copies = Vec::with_capacity(stripe.len());
            for loc in stripe {
                let name = (loc.endpoint.to_string(), loc.export.clone());
                let i = *index.entry(name.clone()).or_insert_with(|| {
                    let lane = Lane::connect(&loc.endpoint, &loc.export, &config)
                        .inspect_err(|e| {
                            tracing::warn!(server = %name.0, export = %name.1, error = %e, "segment: a server is out of service");
                            last_error = Some(e.to_string());
                        })
                        .ok();
                    lanes.push(lane);
                    names.push(format!("{}/{}", name.0, name.1));
                    lanes.len() - 1
                });
                copies.push(i);
            }
            replicas.push(copies);
        }
        let mut segment = Segment { map, lanes, names, replicas, stats: SegmentStats::default() };
        segment.stats.servers_failed = segment.lanes.iter().filter(|l| l.is_none()).count() as u64;
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

    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    pub fn stats(&self) -> SegmentStats {
        self.stats
    }

    /// The servers (as `endpoint/export`) taken out of service.
    pub fn failed(&self) -> Vec<&str> {
        self.lanes.iter().zip(&self.names).filter(|(l, _)| l.is_none()).map(|(_, n)| n.as_str()).collect()
    }

    /// The lanes in service holding stripe `i`, in replica order.
    fn in_service(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        self.replicas[i].iter().copied().filter(|&l| self.lanes[l].is_some())
    }

    fn pieces(&self, offset: u64, len: usize) -> Result<Vec<Piece>> {
        if !offset.is_multiple_of(SECTOR) || !(len as u64).is_multiple_of(SECTOR) {
            return Err(Error::InvalidArgument("segment I/O must be 512-byte aligned"));
        }
        if offset.checked_add(len as u64).is_none_or(|end| end > self.map.len) {
            return Err(Error::InvalidArgument("segment I/O past the end of the segment"));
        }
        let chunk = self.map.chunk_bytes;
        let mut pieces = Vec::new();
        let mut at = offset;
        let end = offset + len as u64;
        while at < end {
            let stripe = (at / chunk) as usize;
            let within = at % chunk;
            let n = (chunk - within).min(end - at);
            pieces.push(Piece { at, len: n as usize, stripe, within });
            at += n;
        }
        Ok(pieces)
    }

    fn take_out(&mut self, lane: usize, why: &str) {
        if self.lanes[lane].take().is_some() {
            self.stats.servers_failed += 1;
            tracing::warn!(server = %self.names[lane], why, "segment: a server is out of service");
        }
    }

    /// Send `(piece, lane)` requests and collect, for each, whether it succeeded (with the
    /// data, for reads). `data` gives a write's bytes; reads get buffers of the piece's length.
    fn run(
        &mut self,
        opcode: Opcode,
        jobs: &[(usize, usize)],
        pieces: &[Piece],
        data: Option<&[u8]>,
        base: u64,
    ) -> Vec<Option<Vec<u8>>> {
        let mut results: Vec<Option<Vec<u8>>> = vec![None; jobs.len()];
        let mut pending: Vec<Vec<usize>> = vec![Vec::new(); self.lanes.len()];
        for (j, &(_, lane)) in jobs.iter().enumerate() {
            pending[lane].push(j);
        }
        let mut out: Vec<Completion> = Vec::new();
        let mut queued: Vec<std::collections::VecDeque<usize>> =
            pending.into_iter().map(std::collections::VecDeque::from).collect();
        loop {
            // Every lane's requests go out before any lane is waited for.
            for (lane, queue) in queued.iter_mut().enumerate() {
                if let Err(why) = self.submit_queued(lane, queue, opcode, jobs, pieces, data, base) {
                    self.take_out(lane, &why);
                }
                if self.lanes[lane].is_none() {
                    queue.clear();
                }
            }
            let mut busy = false;
            for (lane, queue) in queued.iter_mut().enumerate() {
                let Some(l) = self.lanes[lane].as_mut() else { continue };
                if l.in_flight() == 0 {
                    continue;
                }
                busy = true;
                out.clear();
                let mut failed = None;
                match l.wait(1, &mut out) {
                    Ok(_) => {
                        for c in out.drain(..) {
                            if c.status == Status::Ok {
                                results[c.user_data as usize] = Some(c.buf.unwrap_or_default());
                            } else {
                                failed = Some(format!("request failed: {}", c.status));
                            }
                        }
                    }
                    Err(e) => failed = Some(e.to_string()),
                }
                if let Some(why) = failed {
                    self.take_out(lane, &why);
                    queue.clear();
                }
            }
            if !busy && queued.iter().all(|q| q.is_empty()) {
                return results;
            }
        }
    }

    /// Submit `lane`'s queued jobs while it has room, and send them.
    #[allow(clippy::too_many_arguments)] // the pieces of one I/O, passed down from `run`
    fn submit_queued(
        &mut self,
        lane: usize,
        queued: &mut std::collections::VecDeque<usize>,
        opcode: Opcode,
        jobs: &[(usize, usize)],
        pieces: &[Piece],
        data: Option<&[u8]>,
        base: u64,
    ) -> std::result::Result<(), String> {
        let Some(l) = self.lanes[lane].as_mut() else { return Ok(()) };
        while l.in_flight() < LANE_DEPTH {
            let Some(j) = queued.pop_front() else { break };
            let piece = pieces[jobs[j].0];
            let copy = self.replicas[piece.stripe]
                .iter()
                .position(|&r| r == lane)
                .expect("a job's lane holds its stripe");
            let place = self.map.stripes[piece.stripe][copy].offset + piece.within;
            let buf = match data {
                Some(d) => {
                    let from = (piece.at - base) as usize;
                    d[from..from + piece.len].to_vec()
                }
                None => vec![0; piece.len],
            };
            self.stats.requests += 1;
            let submitted = match opcode {
                Opcode::Write => l.submit_write(place, buf, ReqFlags::empty(), j as u64),
                _ => l.submit_read(place, buf, j as u64),
            };
            submitted.map_err(|r| r.error.to_string())?;
        }
        l.commit().map_err(|e| e.to_string())
    }

    /// Write `data` at `offset` of the segment: every piece on every replica in service.
    /// Fails only when some piece reached no replica.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let pieces = self.pieces(offset, data.len())?;
        self.stats.writes += 1;
        let jobs: Vec<(usize, usize)> = pieces
            .iter()
            .enumerate()
            .flat_map(|(p, piece)| self.in_service(piece.stripe).map(move |l| (p, l)).collect::<Vec<_>>())
            .collect();
        let results = self.run(Opcode::Write, &jobs, &pieces, Some(data), offset);
        for (p, piece) in pieces.iter().enumerate() {
            let held = jobs.iter().zip(&results).any(|(&(q, _), r)| q == p && r.is_some());
            if !held {
                return Err(Error::Lost(format!(
                    "no copy of bytes {}..{} of the segment could be written",
                    piece.at,
                    piece.at + piece.len as u64
                )));
            }
        }
        Ok(())
    }

    /// Read `buf.len()` bytes at `offset` of the segment, each piece from the first replica in
    /// service, falling back to the next when one fails.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let pieces = self.pieces(offset, buf.len())?;
        self.stats.reads += 1;
        let mut todo: Vec<usize> = (0..pieces.len()).collect();
        let mut first = true;
        while !todo.is_empty() {
            let mut jobs = Vec::with_capacity(todo.len());
            for &p in &todo {
                let lane = self.in_service(pieces[p].stripe).next().ok_or_else(|| {
                    Error::Lost(format!(
                        "every copy of bytes {}..{} of the segment is out of service",
                        pieces[p].at,
                        pieces[p].at + pieces[p].len as u64
                    ))
                })?;
                jobs.push((p, lane));
            }
            if !first {
                self.stats.fallbacks += jobs.len() as u64;
            }
            first = false;
            let results = self.run(Opcode::Read, &jobs, &pieces, None, offset);
            todo.clear();
            for (&(p, _), r) in jobs.iter().zip(results) {
                match r {
                    Some(data) => {
                        let from = (pieces[p].at - offset) as usize;
                        buf[from..from + pieces[p].len].copy_from_slice(&data);
                    }
                    None => todo.push(p),
                }
            }
        }
        Ok(())
    }
}
