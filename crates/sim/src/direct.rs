//! The direct-read simulation: two initiators, each a [`ClientSession`] with a capability
//! directory, and a target front end ([`NativeConn`]) per initiator over one export with
//! direct reads, stepped on one thread and a virtual clock, every read checked against the
//! [`Shadow`].
//!
//! What it interleaves, by seed: reads (whole cache slots, which earn and use capabilities,
//! and odd-sized ones, which do not), writes and write-zeroes of any size and alignment from
//! both initiators (a write by one must never be hidden from the other by the cache), bytes
//! delivered between the sides in pieces of any size, an operator rotating the export's key
//! epoch and invalidating ranges, a small cache that evicts all the time, small directories
//! that collide, and capabilities expiring on the virtual clock. A third of the seeds serve a
//! flash volume (extent capabilities: FlashNet's references to volume ranges) on an array in
//! memory with a tiny page pool (the extents a read earns carry the write right, so writes go
//! direct too, from both initiators), while the operator also snapshots the volume and deletes the
//! snapshot, writes pages back, cleans segments (GC moves the pages under the references)
//! and checkpoints. Of the rest, half serve a RAM export (region capabilities), half a backend
//! without memory of its own behind a block cache (slot capabilities). No request is ever refused for a stale capability: the session
//! falls back, and the caller sees only its data, which must be what the volume held.
//!
//! Two requests are never in flight on one block at once, across both initiators: the one
//! ordering a block device leaves to its users, and what makes the model exact.

use std::collections::BTreeMap;
use std::io::{IoSlice, IoSliceMut};
use std::sync::Arc;

use backend::cache::{SLOT_BYTES, WAYS};
use engine::front::native::NativeConn;
use engine::front::{FrontStats, Gate, Host, Later, Link};
use engine::{BackendSpec, Export, ExportTable};
use proto::caravan::Doorbell;
use proto::client::{
    Batching, ClientHandshake, ClientSession, Completion, SessionConfig, Submission, SubmitError,
};
use wire::control::{OpenReply, FEATURE_DIRECT_READS};
use wire::{FrameBuffer, FrameKind, Header, Limits, Opcode, ReqFlags, HEADER_LEN};

use crate::clock::Clock;
use crate::disk::{DiskFaults, FaultyBackend};
use crate::rng::Rng;
use crate::shadow::{Shadow, BLOCK_BYTES};
#[cfg(not(feature = "mutations"))]
use crate::NO_PLANTED_BUGS;

/// Blocks (of the model's 512 bytes) in the volume: 64 cache slots.
const VOLUME_BLOCKS: usize = 512;
const SLOT_BLOCKS: usize = SLOT_BYTES / BLOCK_BYTES;
/// Steps before a run that has not finished counts as stuck.
const STEPS_MAX: u64 = 200_000;

/// What one run does.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub seed: u64,
    /// Requests to issue, over both initiators.
    pub ops: usize,
    /// Plant the bug that writes do not invalidate the cache, to show it is caught (only in a
    /// build with the feature `mutations`; without it, a run that asks fails at once).
    pub stale_cache: bool,
}

/// What a run did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Report {
    pub ops: u64,
    pub reads_checked: u64,
    pub direct_reads: u64,
    pub direct_faults: u64,
    pub fallbacks: u64,
    pub rotations: u64,
    pub invalidations: u64,
    pub cache_evictions: u64,
    pub cache_runs: u64,
    pub flash_runs: u64,
    /// Direct reads served on flash seeds (under extents).
    pub flash_direct_reads: u64,
    /// Writes taken under extents with the write right (flash seeds).
    pub direct_writes: u64,
    /// Flash seeds: snapshots taken (each deleted later), GC steps that cleaned a segment,
    /// checkpoints.
    pub snapshots: u64,
    pub gc_steps: u64,
    pub checkpoints: u64,
}

impl Report {
    pub fn add(&mut self, r: &Report) {
        self.ops += r.ops;
        self.reads_checked += r.reads_checked;
        self.direct_reads += r.direct_reads;
        self.direct_faults += r.direct_faults;
        self.fallbacks += r.fallbacks;
        self.rotations += r.rotations;
        self.invalidations += r.invalidations;
        self.cache_evictions += r.cache_evictions;
        self.cache_runs += r.cache_runs;
        self.flash_runs += r.flash_runs;
        self.flash_direct_reads += r.flash_direct_reads;
        self.direct_writes += r.direct_writes;
        self.snapshots += r.snapshots;
        self.gc_steps += r.gc_steps;
        self.checkpoints += r.checkpoints;
    }
}

struct SimHost {
    exports: ExportTable,
    clock: Clock,
}

impl Host for SimHost {
    fn exports(&self) -> &ExportTable {
        &self.exports
    }
    fn io_bytes_max(&self) -> u32 {
        1 << 20
    }
    fn stats_reply(&self) -> wire::StatsReply {
        wire::StatsReply { entries: Vec::new() }
    }
    fn clock_ms(&self) -> u64 {
        // A virtual millisecond per 100 µs, so that capabilities expire within a run.
        self.clock.now_us() / 100
    }
}

/// One initiator and the target's side of its connection, joined by byte buffers.
struct Side {
    session: ClientSession<Vec<u8>>,
    client_rx: FrameBuffer,
    target: NativeConn,
    target_rx: FrameBuffer,
    target_tx: Vec<u8>,
    closing: bool,
    stats: FrontStats,
}

#[derive(Debug, Clone, Copy)]
struct Op {
    opcode: Opcode,
    first: usize,
    count: usize,
    gen: u32,
}

/// Run one seed; an error says what went wrong, with the seed.
pub fn run(opts: &Options) -> Result<Report, String> {
    let mut rng = Rng::new(opts.seed);
    let clock = Clock::new();
    // A stream of its own, so that the RAM and cached seeds draw as they did before.
    let on_flash = Rng::new(opts.seed ^ 0x666c_6173_685f_7265).below(3) == 0;
    let lifetime_ms;
    let (volume, export, array, cached) = if on_flash {
        let (array, volume) = flash_volume(&mut rng)?;
        let id = volume.id();
        let volume: Arc<dyn backend::Backend> = Arc::new(volume);
        // The model's 512-byte blocks: the array takes any byte range (partial pages are
        // read, modified and written).
        let mut export = Export::new("sim", volume.clone(), false)
            .with_block_bytes(BLOCK_BYTES as u32)
            .map_err(|e| e.to_string())?;
        let secret: [u8; 32] = std::array::from_fn(|i| (rng.next_u64() >> (i % 8)) as u8);
        lifetime_ms = rng.range(5, 2_000);
        export.direct =
            Some(engine::direct::DirectReads::for_volume(secret, id).with_lifetime_ms(lifetime_ms));
        (volume, export, Some(array), false)
    } else {
        let spec = BackendSpec::Ram { size_bytes: (VOLUME_BLOCKS * BLOCK_BYTES) as u64 };
        let volume = Export::open("sim", &spec, false).expect("a small RAM volume").backend;
        let cached = rng.below(2) == 1;
        // A backend with no memory of its own (the faulty wrapper, without faults) goes through
        // the block cache; the bare RAM backend is its own cache.
        let backend: Arc<dyn backend::Backend> = if cached {
            Arc::new(FaultyBackend::new(volume.clone(), rng.fork(1), DiskFaults::NONE))
        } else {
            volume.clone()
        };
        let mut export = Export::new("sim", backend, false);
        let cache_slots = WAYS * rng.range(1, 4) as usize;
        let secret: [u8; 32] = std::array::from_fn(|i| (rng.next_u64() >> (i % 8)) as u8);
        export.enable_direct_reads(secret, (cache_slots * SLOT_BYTES) as u64).map_err(|e| e.to_string())?;
        lifetime_ms = rng.range(5, 2_000);
        export.direct = export.direct.map(|d| d.with_lifetime_ms(lifetime_ms));
        (volume, export, None, cached)
    };
    if opts.stale_cache {
        #[cfg(feature = "mutations")]
        export.direct.as_ref().expect("enabled above").plant_stale_cache();
        #[cfg(not(feature = "mutations"))]
        return Err(NO_PLANTED_BUGS.to_string());
    }
    let host = SimHost { exports: ExportTable::new(vec![export]), clock: clock.clone() };
    let mut sides = Vec::new();
    for i in 0..2 {
        sides.push(open_side(&host, &mut rng, i)?);
    }
    let mut shadow = Shadow::new(opts.seed, VOLUME_BLOCKS);
    let mut busy = vec![false; VOLUME_BLOCKS];
    let mut ops: BTreeMap<u64, Op> = BTreeMap::new();
    let mut issued = 0usize;
    let mut report =
        Report { cache_runs: u64::from(cached), flash_runs: u64::from(on_flash), ..Report::default() };
    let mut snapshot = false;
    let mut done: Vec<Completion<Vec<u8>>> = Vec::new();
    let mut step = 0u64;
    while issued < opts.ops || !ops.is_empty() {
        step += 1;
        if step > STEPS_MAX {
            return Err(format!("stuck: {issued} issued, {} in flight", ops.len()));
        }
        clock.advance(rng.range(1, 40));
        let i = rng.below(2) as usize;
        let side = &mut sides[i];
        // Issue a few requests.
        while issued < opts.ops
            && side.session.in_flight() < side.session.queue_depth()
            && rng.chance(400_000)
        {
            let Some((op, sub)) = choose(&mut rng, &mut shadow, &busy, issued as u64) else { break };
            match side.session.submit(clock.now_us(), sub) {
                Ok(()) => {}
                Err(r) if matches!(r.error, SubmitError::QueueFull(_)) => break,
                Err(r) => return Err(format!("the session refused a request: {:?}", r.error)),
            }
            busy[op.first..op.first + op.count].fill(true);
            ops.insert(issued as u64, op);
            issued += 1;
        }
        if rng.chance(300_000) {
            side.session.commit();
        }
        side.session.handle_timeout(clock.now_us());
        deliver_to_target(side, &host, &mut rng);
        deliver_to_client(side, &mut rng, clock.now_us())?;
        side.session.take_completions(&mut done);
        for c in done.drain(..) {
            let op = ops
                .remove(&c.user_data)
                .ok_or_else(|| format!("completion for {} not in flight", c.user_data))?;
            busy[op.first..op.first + op.count].fill(false);
            if !c.status.is_ok() {
                return Err(format!("request {} ({op:?}) failed with {}", c.user_data, c.status));
            }
            if c.opcode != op.opcode {
                return Err(format!("request {} ({op:?}) completed as {:?}", c.user_data, c.opcode));
            }
            match op.opcode {
                Opcode::Read => {
                    report.reads_checked += 1;
                    shadow
                        .check_read(op.first, c.buf.as_deref().unwrap_or_default())
                        .map_err(|e| format!("read {} ({op:?}) by initiator {i}: {e}", c.user_data))?;
                }
                _ => shadow.acknowledged(op.first, op.count, op.gen),
            }
        }
        // The operator.
        let direct = host.exports.get(0).and_then(|e| e.direct.as_ref()).expect("direct reads on");
        if rng.chance(2_000) {
            direct.rotate_epoch();
            report.rotations += 1;
        }
        if rng.chance(3_000) {
            let first = rng.below(VOLUME_BLOCKS as u64);
            let len = rng.range(1, 64 * BLOCK_BYTES as u64);
            direct.invalidate(first * BLOCK_BYTES as u64, len);
            report.invalidations += 1;
        }
        if let Some(array) = &array {
            flash_operator(array, &mut rng, &mut snapshot, &mut report)?;
        }
    }
    if let Some(array) = &array {
        array.audit().map_err(|e| format!("the array's accounting: {e}"))?;
    }
    // Every acknowledged write is in the volume.
    let mut data = vec![0u8; VOLUME_BLOCKS * BLOCK_BYTES];
    volume.read_at(&mut data, 0).map_err(|e| e.to_string())?;
    shadow.check_read(0, &data).map_err(|e| format!("final check of the volume: {e}"))?;
    for side in &sides {
        let s = side.session.stats();
        report.direct_reads += s.direct_reads;
        report.direct_writes += s.direct_writes;
        report.direct_faults += s.direct_faults;
        report.fallbacks += s.fallbacks;
    }
    if on_flash {
        report.flash_direct_reads = report.direct_reads;
    }
    if let Some(c) = host.exports.get(0).and_then(|e| e.direct.as_ref()).and_then(|d| d.cache()) {
        report.cache_evictions = c.counters().evictions;
    }
    report.ops = issued as u64;
    Ok(report)
}

/// A formatted array in memory with a tiny pool (pages are evicted, written back and read again
/// all the time) and volume `sim` of the model's size on it.
fn flash_volume(rng: &mut Rng) -> Result<(Arc<flash::engine::Array>, flash::volume::FlashVolume), String> {
    use flash::device::{Device, MemDevice};
    let segment_pages = 16u32;
    let pages = 256 + 24 * u64::from(segment_pages);
    let blank: Vec<Box<dyn Device>> = vec![Box::new(MemDevice::new(pages))];
    flash::engine::format(&blank, segment_pages, false).map_err(|e| format!("format: {e}"))?;
    let cfg = flash::ctl::Config {
        pool_pages: rng.pick(&[8u32, 16, 48]),
        group_pages_max: rng.pick(&[4u32, 16]),
        ..flash::ctl::Config::default()
    };
    let array = flash::engine::Array::open(blank, cfg).map_err(|e| format!("open: {e}"))?;
    array.create("sim", (VOLUME_BLOCKS * BLOCK_BYTES) as u64).map_err(|e| format!("create: {e}"))?;
    let volume = flash::volume::FlashVolume::open(array.clone(), "sim").map_err(|e| e.to_string())?;
    Ok((array, volume))
}

/// What an operator and the array's background work do to a flash volume meanwhile: a
/// snapshot taken and later deleted (its pages shared, then copied on write), dirty pages
/// written back, segments cleaned (pages move under the references), checkpoints.
fn flash_operator(
    array: &flash::engine::Array,
    rng: &mut Rng,
    snapshot: &mut bool,
    report: &mut Report,
) -> Result<(), String> {
    if rng.chance(6_000) {
        if *snapshot {
            array.delete("snap", false).map_err(|e| format!("delete the snapshot: {e}"))?;
        } else {
            array.snapshot("sim", "snap", false).map_err(|e| format!("snapshot: {e}"))?;
            report.snapshots += 1;
        }
        *snapshot = !*snapshot;
    }
    if rng.chance(5_000) {
        array.background_step().map_err(|e| format!("write-back: {e}"))?;
    }
    if rng.chance(6_000) && array.gc_step().map_err(|e| format!("GC: {e}"))? {
        report.gc_steps += 1;
    }
    if rng.chance(2_000) {
        array.checkpoint().map_err(|e| format!("checkpoint: {e}"))?;
        report.checkpoints += 1;
    }
    Ok(())
}

/// Pick a request on idle blocks; `None` when the blocks it chose are busy.
fn choose(
    rng: &mut Rng,
    shadow: &mut Shadow,
    busy: &[bool],
    user_data: u64,
) -> Option<(Op, Submission<Vec<u8>>)> {
    let (opcode, first, count) = match rng.below(100) {
        // Whole slots: these earn and use capabilities.
        0..55 => {
            let slots = rng.range(1, 2) as usize;
            let first = rng.below((VOLUME_BLOCKS / SLOT_BLOCKS - slots + 1) as u64) as usize * SLOT_BLOCKS;
            (Opcode::Read, first, slots * SLOT_BLOCKS)
        }
        55..62 => {
            let count = rng.range(1, 8) as usize;
            (Opcode::Read, rng.below((VOLUME_BLOCKS - count + 1) as u64) as usize, count)
        }
        62..80 => {
            let first = rng.below((VOLUME_BLOCKS / SLOT_BLOCKS) as u64) as usize * SLOT_BLOCKS;
            (Opcode::Write, first, SLOT_BLOCKS)
        }
        80..95 => {
            let count = rng.range(1, 12) as usize;
            (Opcode::Write, rng.below((VOLUME_BLOCKS - count + 1) as u64) as usize, count)
        }
        _ => {
            let count = rng.range(1, 16) as usize;
            (Opcode::WriteZeroes, rng.below((VOLUME_BLOCKS - count + 1) as u64) as usize, count)
        }
    };
    if busy[first..first + count].iter().any(|&b| b) {
        return None;
    }
    let gen = if opcode == Opcode::Write { shadow.new_gen() } else { 0 };
    let buf = match opcode {
        Opcode::Read => Some(vec![0xA5; count * BLOCK_BYTES]),
        Opcode::Write => Some(shadow.data(first, count, gen)),
        _ => None,
    };
    let sub = Submission {
        opcode,
        flags: ReqFlags::empty(),
        offset: (first * BLOCK_BYTES) as u64,
        length: count * BLOCK_BYTES,
        buf,
        user_data,
    };
    Some((Op { opcode, first, count, gen }, sub))
}

/// Connect an initiator: HELLO with direct reads, OPEN, and a session with a small directory.
fn open_side(host: &SimHost, rng: &mut Rng, _index: usize) -> Result<Side, String> {
    let offered = Limits {
        queue_depth: rng.range(2, 32) as u32,
        caravan_reqs_max: rng.range(1, 16) as u32,
        caravan_bytes_max: 64 << 10,
        io_bytes_max: 8192,
    };
    let mut target = NativeConn::new(offered, 4);
    let stats = FrontStats::new(1);
    let (mut target_rx, mut target_tx, mut closing) = (FrameBuffer::new(), Vec::new(), false);
    let mut hs = ClientHandshake::new(Limits {
        queue_depth: 0,
        caravan_reqs_max: 0,
        caravan_bytes_max: 0,
        io_bytes_max: 0,
    })
    .with_features(FEATURE_DIRECT_READS);
    let mut exchange = |bytes: &[u8], target: &mut NativeConn| -> Result<(Header, Vec<u8>), String> {
        target_rx.extend(bytes);
        let mut link = Link {
            rx: &mut target_rx,
            tx: &mut target_tx,
            closing: &mut closing,
            peer: "sim",
            stats: &stats,
            backlog_max: usize::MAX,
            gate: Gate::new(None, false),
            later: Later::new(None),
        };
        target.process(&mut link, host);
        let header = Header::parse(&target_tx).map_err(|e| e.to_string())?;
        let body = target_tx[HEADER_LEN..header.frame_len()].to_vec();
        target_tx.clear();
        Ok((header, body))
    };
    let (h, body) = exchange(&hs.hello_frame(), &mut target)?;
    let (limits, features) = hs.handle_reply_features(&h, &body).map_err(|e| e.to_string())?;
    if features & FEATURE_DIRECT_READS == 0 {
        return Err("the target did not agree to direct reads".into());
    }
    let (h, body) = exchange(
        &wire::control::frame(FrameKind::Open, &wire::Open { name: "sim".into() }.encode()),
        &mut target,
    )?;
    let open: OpenReply = proto::client::handle_open_reply(&h, &body).map_err(|e| e.to_string())?;
    let config = SessionConfig {
        doorbell: Doorbell {
            aggregation_reqs: rng.range(1, 8) as u32,
            delay_us: rng.range(0, 100),
            ..Doorbell::default()
        },
        batching: if rng.below(2) == 0 { Batching::Off } else { Batching::Static },
        direct_min_bytes: rng.pick(&[proto::client::DIRECT_OFF, 0]),
        directory_entries: rng.range(1, 64) as u32,
    };
    Ok(Side {
        session: ClientSession::new(&config, limits, open.handle),
        client_rx: FrameBuffer::new(),
        target,
        target_rx,
        target_tx,
        closing,
        stats,
    })
}

/// Move a random part of what the initiator has to send to its target, and let the target
/// execute what arrived whole.
fn deliver_to_target(side: &mut Side, host: &SimHost, rng: &mut Rng) {
    let mut budget = rng.pick(&[1, 7, 100, 4096, usize::MAX]);
    while budget > 0 && side.session.has_transmit() {
        let mut iov = [IoSlice::new(&[]); 16];
        let n = side.session.poll_transmit(&mut iov);
        let mut sent = 0;
        for s in &iov[..n] {
            let take = s.len().min(budget - sent);
            side.target_rx.extend(&s[..take]);
            sent += take;
            if sent == budget {
                break;
            }
        }
        side.session.handle_sent(sent);
        budget -= sent;
    }
    let mut link = Link {
        rx: &mut side.target_rx,
        tx: &mut side.target_tx,
        closing: &mut side.closing,
        peer: "sim",
        stats: &side.stats,
        backlog_max: usize::MAX,
        gate: Gate::new(None, false),
        later: Later::new(None),
    };
    side.target.process(&mut link, host);
}

/// Move a random part of the target's replies to the initiator, laid out as its session asks
/// (read data straight into callers' buffers), and let it handle them.
fn deliver_to_client(side: &mut Side, rng: &mut Rng, now: u64) -> Result<(), String> {
    if side.closing {
        return Err("the target closed a connection: a protocol error".into());
    }
    let mut budget = rng.pick(&[3, 50, 1000, 9000, usize::MAX]).min(side.target_tx.len());
    while budget > 0 {
        let Side { session, client_rx, target_tx, .. } = side;
        let got = session
            .receive_with(client_rx, |iov: &mut [IoSliceMut<'_>]| {
                let mut n = 0;
                for d in iov.iter_mut() {
                    let take = d.len().min(budget - n);
                    d[..take].copy_from_slice(&target_tx[n..n + take]);
                    n += take;
                    if n == budget {
                        break;
                    }
                }
                Ok(n)
            })
            .map_err(|e| e.to_string())?;
        side.target_tx.drain(..got);
        budget -= got;
        let progress = side
            .session
            .handle_rx(now, side.client_rx.unconsumed())
            .map_err(|e| format!("initiator: {e}"))?;
        side.client_rx.consume(progress.consumed);
        if progress.need > 0 {
            side.client_rx.reserve(progress.need);
        }
        if got == 0 {
            break;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn many_seeds_pass_and_exercise_what_they_claim() {
        let mut total = Report::default();
        for seed in 0..60 {
            let r = run(&Options { seed, ops: 400, stale_cache: false })
                .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            total.add(&r);
        }
        eprintln!("{total:?}");
        assert!(total.direct_reads > 1000, "{total:?}");
        assert!(total.direct_faults > 50 && total.fallbacks == total.direct_faults, "{total:?}");
        assert!(total.rotations > 0 && total.invalidations > 0 && total.cache_evictions > 0, "{total:?}");
        assert!(total.cache_runs > 10 && total.cache_runs < 50, "{total:?}");
    }

    #[test]
    #[cfg(feature = "mutations")]
    fn a_cache_that_writes_do_not_invalidate_is_caught() {
        let caught =
            (0..60).filter(|&seed| run(&Options { seed, ops: 400, stale_cache: true }).is_err()).count();
        assert!(caught > 5, "the planted stale cache was caught on only {caught} of 60 seeds");
    }
}
