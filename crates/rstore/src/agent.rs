//! The repair agent every memory server runs (docs/RSTORE.md, "Healing"): one of them leads,
//! and each copies out the repairs it is the source of.
//!
//! - **The leader** holds [`LEADER`](crate::control::LEADER) in etcd under its registration's
//!   lease (created only if absent: etcd's lease primitive, no election protocol of our own),
//!   so it lapses when the server dies or loses etcd, and another server takes it. Once a
//!   pass, the leader runs [`repair::plan`](crate::repair::plan) over every namespace's
//!   groups (all of them when a server came or went, else only those the repair index marks
//!   as holding a copy that is not `ok`; [`Leader`]) (marks
//!   copies stale, starts repairs of copies whose server is back, undoes repairs whose copy
//!   or source went away) and rebuilds elsewhere the copies away past the grace period. Each
//!   change is one etcd transaction on what it read, so a leader that dies mid-pass leaves
//!   nothing half done, and its successor starts from the records.
//! - **A source** is the server of the healthy copy a syncing copy names (`from`): whoever
//!   leads, it copies the regions the syncing copy misses (those its dirty regions name, or
//!   all of them for a full repair), then marks the copy healthy. A repair interrupted (the
//!   source died, the stripe moved on) is found again in the records and goes on under the
//!   new epoch, chunk by chunk: chunks marked healthy stay so.
//!
//! The copy itself ([`copy_chunk`]): the source raises its chunk to the repair's epoch (no
//! write under an older map lands after that), then for each region locks it (writes into it
//! are `Busy` meanwhile), reads it from its own pool (its backend, directly), writes it to the
//! syncing copy, and only then unlocks it. The regions stay dirty: another copy of the stripe
//! may be missing them too (three replicas, two away), and a repair cut short goes again from
//! them. They are cleared when the stripe is whole again (docs/PROTOCOL.md, 14.6). Writers send
//! writes to the syncing copy after the healthy ones hold them, so none is overwritten by an
//! older region (docs/PROTOCOL.md, 14.6). A partial repair then compares the regions it did not
//! copy, eight at a time, with the syncing copy's, and copies those that differ (a pool damaged
//! in place while away; `Config::verify`). Copies and comparisons are paced to `rebuild_rate`
//! bytes a second, so the foreground keeps its IOPS.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use coord::{CoordError, CopyState, ServerInfo};
use initiator::{Lane, LaneConfig, Queue, ReconnectConfig, ReqFlags, Status};

use crate::control::{unix_ms, Coordinator, Finished};
use crate::repair;

/// How the agent repairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// How long a copy's server may stay away before the copy is rebuilt on another server.
    pub rebuild_after: Duration,
    /// Bytes a second a source copies at most (0: no bound).
    pub rebuild_rate: u64,
    /// How often the agent looks.
    pub every: Duration,
    /// Whether a partial repair compares the regions it does not copy (not dirty) with the
    /// copy it repairs, and copies those that differ ("Verified rejoins", docs/RSTORE.md).
    pub verify: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            rebuild_after: Duration::from_secs(600),
            rebuild_rate: 100 << 20,
            every: Duration::from_secs(1),
            verify: true,
        }
    }
}

/// What a server's agent did: the target's own counters, which its metrics show.
pub use server::RepairStats as Progress;

/// How often the leader looks at every group even when no server came or went.
const FULL_PASS_EVERY: Duration = Duration::from_secs(60);

/// What the leader remembers between passes: the servers registered (`id@incarnation`) at its
/// last full pass over every group, and when that was. While they stay the same, a pass looks
/// only at the groups the repair index marks (a copy not `ok`): a copy goes stale only when
/// its server goes, and everything else a pass does concerns copies already not `ok`.
#[derive(Debug, Default)]
pub struct Leader {
    seen: Vec<String>,
    at: Option<Instant>,
}

/// One pass of the leader over every namespace: plans, then rebuilds elsewhere what stayed
/// away past the grace period. Returns what it changed.
pub fn lead(coord: &Coordinator, config: &Config) -> Result<repair::Plan, CoordError> {
    lead_with(coord, config, &mut Leader::default())
}

/// [`lead`], remembering in `leader` what lets the next pass look only where it must.
pub fn lead_with(
    coord: &Coordinator,
    config: &Config,
    leader: &mut Leader,
) -> Result<repair::Plan, CoordError> {
    let mut total = repair::Plan::default();
    let namespaces = coord.list_ns()?;
    if namespaces.is_empty() {
        return Ok(total);
    }
    let live = coord.servers()?;
    let seen: Vec<String> = live.iter().map(|s| format!("{}@{:x}", s.id, s.incarnation)).collect();
    let full = seen != leader.seen || leader.at.is_none_or(|at| at.elapsed() >= FULL_PASS_EVERY);
    // A server killed keeps its registration until its lease lapses: only those reached now
    // count as back.
    let present: Vec<ServerInfo> = live.into_iter().filter(reachable).collect();
    for ns in namespaces {
        let plan =
            coord.plan(&ns.name, &present, unix_ms(), config.rebuild_after.as_millis() as u64, !full)?;
        for r in &plan.relocate {
            if coord.relocate(&ns.name, r)? {
                tracing::info!(ns = %ns.name, slot = r.stripe, "a copy away past the grace period is rebuilt elsewhere");
                total.started += 1;
            }
        }
        total.stale += plan.stale;
        total.started += plan.started;
    }
    if full {
        (leader.seen, leader.at) = (seen, Some(Instant::now()));
    }
    Ok(total)
}

/// Whether a TCP connection to the server's endpoint opens within a second (other endpoints
/// are taken as reached).
fn reachable(s: &ServerInfo) -> bool {
    match initiator::Endpoint::parse(&s.endpoint) {
        Ok(initiator::Endpoint::Tcp(addr)) => {
            use std::net::ToSocketAddrs;
            let Some(addr) = addr.to_socket_addrs().ok().and_then(|mut a| a.next()) else { return false };
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
        }
        _ => true,
    }
}

/// A repair this server is the source of.
struct Task {
    ns: String,
    slot: u64,
    copy: usize,
    epoch: u32,
    full: bool,
    /// This server's (healthy) copy and the syncing one.
    source: coord::ChunkRef,
    target: coord::ChunkRef,
}

/// Copy out every repair `me` is the source of, and mark each copy healthy once done.
/// Returns the chunks repaired.
pub fn serve(
    coord: &Coordinator,
    me: &ServerInfo,
    pool: &server::Pool,
    config: &Config,
    progress: &Progress,
    lease: i64,
    stop: &AtomicBool,
) -> Result<usize, Box<dyn std::error::Error>> {
    let mut tasks = Vec::new();
    // Only groups the repair index marks hold a syncing copy.
    for ns in coord.list_ns()? {
        for g in coord.groups(&ns.name, true)? {
            let group = coord.group(&ns.name, g)?;
            for (si, stripe) in group.stripes.iter().enumerate() {
                for (ci, c) in stripe.iter().enumerate() {
                    if c.state != CopyState::Syncing || c.from != me.id {
                        continue;
                    }
                    let Some(source) = stripe.iter().find(|s| s.server == me.id && s.state == CopyState::Ok)
                    else {
                        continue;
                    };
                    tasks.push(Task {
                        ns: ns.name.clone(),
                        slot: g * coord::schema::GROUP_STRIPES + si as u64,
                        copy: ci,
                        epoch: c.epoch,
                        // Partial only from the boot whose dirty regions cover the copy: a
                        // source restarted since lost them, and copies it all.
                        full: c.full || !c.dirty_on.contains(&repair::tracker(me)),
                        source: source.clone(),
                        target: c.clone(),
                    });
                }
            }
        }
    }
    if tasks.is_empty() {
        return Ok(0);
    }
    let live = coord.servers()?;
    let mut done = 0;
    // Copies repaired and not yet marked healthy: marked together, one transaction per
    // namespace and batch rather than one per chunk.
    let mut pending: Vec<Finished> = Vec::new();
    let mut pending_ns = String::new();
    let mut flush = |ns: &str, pending: &mut Vec<Finished>| -> Result<(), CoordError> {
        if pending.is_empty() {
            return Ok(());
        }
        let n = coord.finish_syncs(ns, pending, &me.id)?;
        pending.clear();
        progress.chunks.fetch_add(n as u64, Ordering::Relaxed);
        done += n;
        let published = repair::SourceProgress {
            server: me.id.clone(),
            chunks: progress.chunks.load(Ordering::Relaxed),
            bytes: progress.bytes.load(Ordering::Relaxed),
            rate: progress.rate.load(Ordering::Relaxed),
            at_ms: unix_ms(),
            verified: progress.verified.load(Ordering::Relaxed),
            mismatched: progress.mismatched.load(Ordering::Relaxed),
        };
        if let Err(e) = coord.publish_progress(&published, lease) {
            tracing::debug!(error = %e, "cannot publish the repair's progress");
        }
        Ok(())
    };
    let mut batch_began = Instant::now();
    let began = Instant::now();
    for t in tasks {
        // A pass copies for a while at most: the thread also leads, and a large rebuild must
        // not hold the leader's passes back. The rest goes on in the next pass.
        if stop.load(Ordering::Relaxed) || began.elapsed() >= SERVE_SLICE {
            break;
        }
        if t.ns != pending_ns || pending.len() >= FINISH_BATCH || batch_began.elapsed() >= FINISH_EVERY {
            flush(&pending_ns, &mut pending)?;
            pending_ns.clone_from(&t.ns);
            batch_began = Instant::now();
        }
        let Some(to) = repair::holder(&live, &t.target) else { continue };
        let started = Instant::now();
        let bytes = match copy_chunk(pool, &t, to, config, progress) {
            Ok(bytes) => bytes,
            Err(e) => {
                // Its server is gone again (or refuses): stale until it is back.
                tracing::warn!(ns = %t.ns, slot = t.slot, to = %to.id, error = %e, "a repair copy failed; the copy is stale again");
                coord.abandon_sync(&t.ns, t.slot, t.copy, &me.id, t.epoch)?;
                continue;
            }
        };
        progress.bytes.fetch_add(bytes, Ordering::Relaxed);
        let secs = started.elapsed().as_secs_f64().max(1e-6);
        progress.rate.store((bytes as f64 / secs) as u64, Ordering::Relaxed);
        tracing::debug!(ns = %t.ns, slot = t.slot, to = %to.id, bytes, full = t.full, "a copy is repaired");
        pending.push(Finished { slot: t.slot, copy: t.copy, epoch: t.epoch });
    }
    flush(&pending_ns, &mut pending)?;
    Ok(done)
}

/// Copies marked healthy in one transaction at most, and the longest a repaired copy waits
/// for its mark.
const FINISH_BATCH: usize = 64;
const FINISH_EVERY: Duration = Duration::from_millis(200);
/// The longest one pass copies before the agent leads again.
const SERVE_SLICE: Duration = Duration::from_secs(2);

/// Copy what `t`'s syncing copy misses from this server's copy to its server `to`: every
/// region of the chunk for a full repair, else the dirty ones, and (`config.verify`) the others
/// that read back different there. Returns the bytes copied.
fn copy_chunk(
    pool: &server::Pool,
    t: &Task,
    to: &ServerInfo,
    config: &Config,
    progress: &Progress,
) -> Result<u64, Box<dyn std::error::Error>> {
    let chunk = t.source.index;
    // From here no write under an older map lands in this copy: every writer holds the map
    // that writes the syncing copy after this one.
    pool.raise(chunk, t.source.generation, t.epoch)?;
    let regions = if t.full { u64::MAX } else { pool.grants().dirty(chunk) };
    if regions == 0 && !config.verify {
        return Ok(0);
    }
    if chunk >= pool.grants().chunks() {
        return Err(format!("the source chunk {chunk} is past the pool").into());
    }
    // Presenting the grant of the repair's epoch raises the syncing copy's chunk to it too.
    let theirs = to.grant_at(t.target.index, t.target.generation, t.epoch, false)?;
    let there = Lane::connect(
        &initiator::Endpoint::parse(&to.endpoint)?,
        &to.export,
        // No reconnection: a target gone mid-copy ends the repair at once, and the region's
        // lock with it, rather than hold writers at Busy while it is tried again.
        &LaneConfig {
            grants: theirs.into_iter().collect(),
            reconnect: ReconnectConfig::OFF,
            ..LaneConfig::default()
        },
    )?;
    let mut copy = RegionCopy {
        pool,
        chunk,
        from: chunk * pool.grants().chunk_bytes(),
        to: t.target.index * pool.grants().chunk_bytes(),
        region: pool.grants().region_bytes(),
        piece: u64::from(there.limits().io_bytes_max).clamp(1, pool.grants().region_bytes()),
        there,
        out: Vec::new(),
    };
    let (started, mut copied, mut moved) = (Instant::now(), 0u64, 0u64);
    // Paced: never ahead of `rate` bytes (copied or compared) a second since the copy began.
    let pace = |moved: u64| {
        if config.rebuild_rate > 0 {
            let due = Duration::from_secs_f64(moved as f64 / config.rebuild_rate as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    };
    for r in (0..proto::grant::REGIONS).filter(|r| regions & (1u64 << r) != 0) {
        copy.copy(r)?;
        copied += copy.region;
        moved += copy.region;
        pace(moved);
    }
    if !config.verify || t.full {
        return Ok(copied);
    }
    // The regions not copied, compared a few at a time.
    let rest: Vec<u32> = (0..proto::grant::REGIONS).filter(|r| regions & (1u64 << r) == 0).collect();
    for batch in rest.chunks(COMPARE_REGIONS) {
        let differ = copy.differing(batch)?;
        let bytes = batch.len() as u64 * copy.region;
        progress.verified.fetch_add(bytes, Ordering::Relaxed);
        moved += bytes;
        for &r in batch.iter().filter(|&&r| differ & (1u64 << r) != 0) {
            tracing::warn!(ns = %t.ns, slot = t.slot, to = %to.id, region = r, "a region the copy should hold reads back different there: copied");
            progress.mismatched.fetch_add(1, Ordering::Relaxed);
            copy.copy(r)?;
            copied += copy.region;
            moved += copy.region;
        }
        pace(moved);
    }
    Ok(copied)
}

/// Regions a repair compares at once (their reads in flight together on both lanes).
const COMPARE_REGIONS: usize = 8;

/// One chunk's repair: this server's pool (read directly), a lane to the copy repaired, and
/// where the chunk starts in each pool.
struct RegionCopy<'a> {
    pool: &'a server::Pool,
    chunk: u64,
    from: u64,
    to: u64,
    region: u64,
    piece: u64,
    there: Lane,
    out: Vec<initiator::Completion>,
}

impl RegionCopy<'_> {
    /// Copy region `r` under its lock (module docs).
    fn copy(&mut self, r: u32) -> Result<(), Box<dyn std::error::Error>> {
        let bit = 1u64 << r;
        self.pool.lock(self.chunk, bit);
        let result = (|| -> Result<(), Box<dyn std::error::Error>> {
            let mut at = 0;
            while at < self.region {
                let n = self.piece.min(self.region - at);
                let within = u64::from(r) * self.region + at;
                let mut buf = vec![0u8; n as usize];
                self.pool.read_at(&mut buf, self.from + within)?;
                self.there.submit_write(self.to + within, buf, ReqFlags::empty(), 0).map_err(|r| r.error)?;
                self.out.clear();
                self.there.wait(1, &mut self.out)?;
                if let Some(c) = self.out.iter().find(|c| c.status != Status::Ok) {
                    return Err(format!("writing the syncing copy: {}", c.status).into());
                }
                at += n;
            }
            Ok(())
        })();
        self.pool.unlock(self.chunk, bit);
        result
    }

    /// Which of `regions` read differently here and there (a bit per region), their reads
    /// there in flight together, as many as the lane's queue depth and [`COMPARE_BYTES`]
    /// allow. Without the lock: a write landing meanwhile may make a region look different
    /// (it is then copied, under the lock, which is always right), never make a different one
    /// look the same (writes reach both).
    fn differing(&mut self, regions: &[u32]) -> Result<u64, Box<dyn std::error::Error>> {
        let pieces: Vec<(u32, u64)> = regions
            .iter()
            .flat_map(|&r| (0..self.region).step_by(self.piece as usize).map(move |at| (r, at)))
            .collect();
        let depth = self.there.queue_depth().min((COMPARE_BYTES / self.piece) as usize).max(1);
        let (mut next, mut done, mut differ) = (0, 0, 0u64);
        let (mut out, mut mine) = (Vec::new(), Vec::new());
        while done < pieces.len() {
            while next < pieces.len() && self.there.in_flight() < depth {
                let (r, at) = pieces[next];
                let n = self.piece.min(self.region - at) as usize;
                let within = u64::from(r) * self.region + at;
                self.there.submit_read(self.to + within, vec![0; n], next as u64).map_err(|r| r.error)?;
                next += 1;
            }
            out.clear();
            self.there.wait(1, &mut out)?;
            for c in out.drain(..) {
                if c.status != Status::Ok {
                    return Err(format!("reading a region to compare: {}", c.status).into());
                }
                let (r, at) = pieces[c.user_data as usize];
                let theirs = c.buf.unwrap_or_default();
                mine.resize(theirs.len(), 0);
                self.pool.read_at(&mut mine, self.from + u64::from(r) * self.region + at)?;
                if mine != theirs {
                    differ |= 1u64 << r;
                }
                done += 1;
            }
        }
        Ok(differ)
    }
}

/// Bytes of a comparison's reads in flight at most.
const COMPARE_BYTES: u64 = 1 << 20;

/// The agent's thread: lead when it can (`lease`: the server's registration lease now, 0 while
/// it has none), and serve the repairs this server is the source of, every `config.every`.
pub fn spawn(
    coord: Arc<Coordinator>,
    me: ServerInfo,
    pool: server::Pool,
    config: Config,
    lease: Arc<AtomicI64>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("skiff-repair".into()).spawn(move || {
        let progress = pool.repair();
        let mut leader = Leader::default();
        let tick = Duration::from_millis(50);
        let mut waited = config.every;
        while !stop.load(Ordering::Relaxed) {
            if waited < config.every {
                std::thread::sleep(tick);
                waited += tick;
                continue;
            }
            waited = Duration::ZERO;
            let lease = lease.load(Ordering::Relaxed);
            let leading = lease != 0 && coord.campaign(&me.id, lease).unwrap_or(false);
            if leading != progress.leading.swap(leading, Ordering::Relaxed) {
                tracing::info!(leading, "repair leadership");
                // A leader that comes (back) looks at every group first.
                leader = Leader::default();
            }
            if leading {
                match lead_with(&coord, &config, &mut leader) {
                    Ok(plan) if plan.changed() || !plan.relocate.is_empty() => {
                        tracing::info!(stale = plan.stale, started = plan.started, "repair pass")
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "repair pass failed; trying again"),
                }
            }
            match serve(&coord, &me, &pool, &config, progress, lease, &stop) {
                // Repairs done: there may be more, so the next pass comes at once.
                Ok(done) if done > 0 => waited = config.every,
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "cannot serve repairs; trying again"),
            }
        }
    })
}
