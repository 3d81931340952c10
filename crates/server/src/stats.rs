//! Target counters and the STATS reply.
//!
//! Each worker owns a [`WorkerStats`] and is its only writer (relaxed single-writer updates,
//! one cache line apart). A STATS request, on whichever worker receives it, sums them and adds
//! the CPU time and context switches of the target's own threads, read from procfs, so the
//! figures are right both for `skiff serve` and for a target running inside `skiff bench`.
//!
//! Counter names, their order and meaning are documented for initiators in docs/PROTOCOL.md,
//! section 6.6; `tests/tests/stats_names.rs` keeps that list and [`collect`] in step.

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering::Relaxed};

use engine::front::{FrontStats, CARAVAN_BUCKETS};
use wire::{Opcode, StatsReply};

use crate::Shared;

#[derive(Debug, Default)]
#[repr(align(64))]
pub struct WorkerStats {
    /// What the front ends count: requests, caravans, protocol errors.
    pub front: FrontStats,
    pub rx_bytes: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub loop_passes: AtomicU64,
    /// Wall time in receive calls, in processing what they brought (parse, backend, replies),
    /// and in send calls: the target's stages, for the per-stage breakdown.
    pub stage_recv_ns: AtomicU64,
    pub stage_exec_ns: AtomicU64,
    pub stage_send_ns: AtomicU64,
    pub connections_accepted: AtomicU64,
    /// The worker's waits under hybrid polling (`rt::poll::WaitStats`), published after each.
    pub poll_waits: AtomicU64,
    pub poll_caught: AtomicU64,
    pub poll_missed: AtomicU64,
    pub poll_timed_sleeps: AtomicU64,
    pub poll_held_off: AtomicU64,
    pub poll_spin_ns: AtomicU64,
    /// Hand-offs between the worker and its stage thread on a staged target
    /// ([`crate::Stages`]): response caravans queued to the send thread, or receives taken
    /// from the receive thread.
    pub stage_handoffs: AtomicU64,
    pub tid: AtomicI32,
    /// Odd while the worker is in a pass that may execute requests and send what they read,
    /// even between passes: a pool's retirement waits for every pass that was running when
    /// it began ([`crate::Pool::retire`]). Kept only on targets that serve a pool.
    pub pass: AtomicU64,
    /// The thread id of the worker's stage thread, when the target is staged
    /// ([`crate::Stages`]): its CPU time counts with the worker's.
    pub stage_tid: AtomicI32,
}

impl WorkerStats {
    /// A worker's counters for a target with `exports` exports.
    pub fn new(exports: usize) -> WorkerStats {
        WorkerStats::with_room(exports, 0)
    }

    /// [`new`](Self::new), with room for `room` exports added while the target runs.
    pub fn with_room(exports: usize, room: usize) -> WorkerStats {
        WorkerStats { front: FrontStats::with_room(exports, room), ..WorkerStats::default() }
    }

    /// Publish the worker's polling totals (it is their only writer).
    pub fn publish_poll(&self, s: &rt::poll::WaitStats) {
        self.poll_waits.store(s.waits, Relaxed);
        self.poll_caught.store(s.caught, Relaxed);
        self.poll_missed.store(s.missed, Relaxed);
        self.poll_timed_sleeps.store(s.timed_sleeps, Relaxed);
        self.poll_held_off.store(s.held_off, Relaxed);
        self.poll_spin_ns.store(s.spun_ns, Relaxed);
    }
}

/// What the listeners turned away or closed for the target's own bounds: counted by the
/// acceptor and the workers (rarely, never on the data path), shared by all of them.
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Connections refused at accept (`connections_max`, or the per-address cap with no
    /// handshake of that address to evict).
    pub connections_refused: AtomicU64,
    /// Connections still in their handshake closed to make room for a new one
    /// (`handshakes_max`, `connections_per_address_max`).
    pub connections_evicted: AtomicU64,
    /// Connections closed because their handshake outlived `handshake_timeout`.
    pub handshake_timeouts: AtomicU64,
    /// Connections closed because they were silent for the idle timeout.
    pub idle_timeouts: AtomicU64,
}

pub(crate) use engine::stats::bump;

/// Picks one counter out of a worker's stats.
type Field = fn(&WorkerStats) -> &AtomicU64;

pub(crate) fn collect(shared: &Shared) -> StatsReply {
    let mut e: Vec<(String, u64)> = Vec::with_capacity(64);
    let sum = |f: &dyn Fn(&WorkerStats) -> u64| shared.workers.iter().map(|w| f(w)).sum::<u64>();
    for op in Opcode::ALL {
        e.push((format!("req_{}", op.name()), sum(&|w| w.front.ops.reqs(op))));
        e.push((format!("bytes_{}", op.name()), sum(&|w| w.front.ops.bytes(op))));
    }
    e.push(("req_errors".into(), sum(&|w| w.front.ops.errors())));
    let named: [(&str, Field); 19] = [
        ("caravans_received", |w| &w.front.caravans_received),
        ("caravans_sent", |w| &w.front.caravans_sent),
        ("caravan_reqs_total", |w| &w.front.caravan_reqs_total),
        ("rx_bytes", |w| &w.rx_bytes),
        ("tx_bytes", |w| &w.tx_bytes),
        ("loop_passes", |w| &w.loop_passes),
        ("stage_recv_ns", |w| &w.stage_recv_ns),
        ("stage_exec_ns", |w| &w.stage_exec_ns),
        ("stage_send_ns", |w| &w.stage_send_ns),
        ("connections_accepted", |w| &w.connections_accepted),
        ("connections_closed_protocol_error", |w| &w.front.connections_closed_protocol_error),
        ("capabilities_sent", |w| &w.front.capabilities_sent),
        ("poll_waits", |w| &w.poll_waits),
        ("poll_caught", |w| &w.poll_caught),
        ("poll_missed", |w| &w.poll_missed),
        ("poll_timed_sleeps", |w| &w.poll_timed_sleeps),
        ("poll_held_off", |w| &w.poll_held_off),
        ("poll_spin_ns", |w| &w.poll_spin_ns),
        ("stage_handoffs", |w| &w.stage_handoffs),
    ];
    for (name, field) in named {
        e.push((name.into(), sum(&|w| field(w).load(Relaxed))));
    }
    for (i, bound) in CARAVAN_BUCKETS.iter().map(|b| b.to_string()).chain(["inf".to_string()]).enumerate() {
        e.push((format!("caravan_reqs_le_{bound}"), sum(&|w| w.front.caravan_hist[i].load(Relaxed))));
    }
    e.push(("connections_open".into(), shared.connections.load(Relaxed) as u64));
    let l = &shared.listener;
    for (name, counter) in [
        ("connections_refused", &l.connections_refused),
        ("connections_evicted", &l.connections_evicted),
        ("handshake_timeouts", &l.handshake_timeouts),
        ("idle_timeouts", &l.idle_timeouts),
    ] {
        e.push((name.into(), counter.load(Relaxed)));
    }

    let mut usage = rt::usage::Usage::default();
    let tids = shared.workers.iter().flat_map(|w| [w.tid.load(Relaxed), w.stage_tid.load(Relaxed)]);
    let tids = tids.chain([shared.acceptor_tid.load(Relaxed)]);
    for tid in tids.filter(|&t| t != 0) {
        if let Ok(u) = rt::usage::of_thread(tid) {
            usage.add(&u);
        }
    }
    e.push(("cpu_user_us".into(), usage.user_us));
    e.push(("cpu_sys_us".into(), usage.sys_us));
    e.push(("cpu_ns".into(), usage.cpu_ns));
    e.push(("ctx_switches_voluntary".into(), usage.ctx_voluntary));
    e.push(("ctx_switches_involuntary".into(), usage.ctx_involuntary));
    e.push(("workers".into(), shared.workers.len() as u64));

    let mut backend = engine::BackendCounters::default();
    let mut cache = engine::CacheCounters::default();
    let mut exports = 0;
    for x in shared.exports.iter() {
        if let Some(c) = x.direct.as_ref().and_then(|d| d.cache()) {
            let c = c.counters();
            cache.fills += c.fills;
            cache.fills_raced += c.fills_raced;
            cache.evictions += c.evictions;
            cache.invalidations += c.invalidations;
            cache.hits += c.hits;
            cache.stale += c.stale;
        }
        let c = x.backend.counters();
        backend.syncs += c.syncs;
        backend.dsync_writes += c.dsync_writes;
        backend.direct_ios += c.direct_ios;
        backend.buffered_ios += c.buffered_ios;
        exports += 1;
    }
    e.push(("exports".into(), exports));
    e.push(("backend_syncs".into(), backend.syncs));
    e.push(("backend_dsync_writes".into(), backend.dsync_writes));
    e.push(("backend_direct_ios".into(), backend.direct_ios));
    e.push(("backend_buffered_ios".into(), backend.buffered_ios));
    for (name, value) in [
        ("cache_fills", cache.fills),
        ("cache_fills_raced", cache.fills_raced),
        ("cache_evictions", cache.evictions),
        ("cache_invalidations", cache.invalidations),
        ("cache_hits", cache.hits),
        ("cache_stale", cache.stale),
    ] {
        e.push((name.into(), value));
    }
    StatsReply { entries: e }
}
