//! The Prometheus endpoint: what the target's counters look like to a scraper.
//!
//! Nothing here runs on a worker. The workers keep their single-writer relaxed counters
//! ([`WorkerStats`], per export through [`engine::stats::OpCounters`]); at each scrape the
//! metrics thread ([`http`]) reads them all, sums what is summed, and renders the Prometheus
//! text format (version 0.0.4) through the `prometheus` crate's encoder, which owns the
//! format's escaping and layout. The OpenMetrics text of `prometheus-client` was the other
//! candidate; `promtool check metrics` rejects its counters (their samples end in `_total`
//! while their `# TYPE` line does not), so this endpoint speaks the classic format that every
//! Prometheus version and `promtool` read.
//!
//! Request metrics are per export (summed over workers, since a connection's worker is an
//! accident of accept order); worker metrics (caravans, loop passes, stages, CPU) are per
//! worker. A labelled series appears once it is non-zero, as in the client libraries; series
//! without labels are always there. Every name is documented in docs/METRICS.md, and
//! `tests/tests/metrics.rs` keeps that list and [`render`] in step.

pub(crate) mod http;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicUsize};

use engine::front::CARAVAN_BUCKETS;
use engine::stats::{self, ExportOps, SERVICE_BUCKETS, STATUS_SLOTS};
use prometheus::proto::{Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType};
use wire::Opcode;

use crate::stats::WorkerStats;
use crate::Shared;

/// The `Content-Type` of [`render`]'s output.
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Everything a scrape needs besides the shared state: fixed at start-up.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Static {
    /// When the target started, in seconds since the Unix epoch.
    pub start_time_s: f64,
}

/// The exposition of the whole target, as of now.
pub(crate) fn render(shared: &Shared, fixed: &Static) -> String {
    let mut out = Families::default();
    requests(&mut out, shared);
    workers(&mut out, &shared.workers);
    connections(&mut out, shared);
    exports(&mut out, shared);
    if let Some(f) = &shared.flash {
        flash(&mut out, &f.stats(), f.array().list().len());
    }
    if shared.serves_pool {
        pool(&mut out, shared);
    }
    cpu(&mut out, shared);
    out.gauge("skiff_workers", "Worker threads.", vec![(vec![], shared.workers.len() as f64)]);
    out.gauge("skiff_start_time_seconds", "When the target started, in seconds since the Unix epoch.", {
        vec![(vec![], fixed.start_time_s)]
    });
    out.gauge("skiff_build_info", "The skiff build serving, as labels; the value is always 1.", {
        vec![(vec![("version", env!("CARGO_PKG_VERSION").to_owned())], 1.0)]
    });
    let mut text = String::with_capacity(64 << 10);
    // The encoder refuses only families without samples, which `Families` never keeps.
    if let Err(e) = prometheus::TextEncoder::new().encode_utf8(&out.0, &mut text) {
        tracing::error!(error = %e, "metrics exposition failed");
    }
    text
}

type Labels = Vec<(&'static str, String)>;

/// The metric families of one scrape, in the order they are added.
#[derive(Default)]
struct Families(Vec<MetricFamily>);

impl Families {
    fn push(&mut self, name: &str, help: &str, kind: MetricType, metrics: Vec<Metric>) {
        if metrics.is_empty() {
            return;
        }
        let mut f = MetricFamily::default();
        f.set_name(name.to_owned());
        f.set_help(help.to_owned());
        f.set_field_type(kind);
        f.set_metric(metrics);
        self.0.push(f);
    }

    fn counter(&mut self, name: &str, help: &str, samples: Vec<(Labels, impl Value)>) {
        let metrics = samples
            .into_iter()
            .map(|(labels, v)| {
                let mut c = Counter::default();
                c.set_value(v.value());
                let mut m = metric(labels);
                m.set_counter(c);
                m
            })
            .collect();
        self.push(name, help, MetricType::COUNTER, metrics);
    }

    fn gauge(&mut self, name: &str, help: &str, samples: Vec<(Labels, impl Value)>) {
        let metrics = samples
            .into_iter()
            .map(|(labels, v)| {
                let mut g = Gauge::default();
                g.set_value(v.value());
                let mut m = metric(labels);
                m.set_gauge(g);
                m
            })
            .collect();
        self.push(name, help, MetricType::GAUGE, metrics);
    }

    fn histogram(&mut self, name: &str, help: &str, samples: Vec<(Labels, Hist)>) {
        let metrics = samples
            .into_iter()
            .map(|(labels, h)| {
                let mut m = metric(labels);
                m.set_histogram(h.into_proto());
                m
            })
            .collect();
        self.push(name, help, MetricType::HISTOGRAM, metrics);
    }
}

/// A sample's value: counts as they are kept, seconds and sizes as they are shown.
trait Value {
    fn value(self) -> f64;
}

impl Value for u64 {
    fn value(self) -> f64 {
        // Exact below 2^53; a counter past that is past any scrape's precision need.
        self as f64
    }
}

impl Value for f64 {
    fn value(self) -> f64 {
        self
    }
}

fn metric(labels: Labels) -> Metric {
    let pairs = labels
        .into_iter()
        .map(|(name, value)| {
            let mut p = LabelPair::default();
            p.set_name(name.to_owned());
            p.set_value(value);
            p
        })
        .collect();
    Metric::from_label(pairs)
}

/// A histogram's samples: per-bucket counts (not cumulative), one more than there are upper
/// bounds: the last bucket is unbounded (`+Inf`, which the encoder writes from the total).
struct Hist {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    sum: f64,
}

impl Hist {
    fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    fn into_proto(self) -> Histogram {
        let mut h = Histogram::default();
        let mut cumulative = 0;
        let buckets = self
            .bounds
            .iter()
            .zip(&self.counts)
            .map(|(&bound, &n)| {
                cumulative += n;
                let mut b = Bucket::default();
                b.set_upper_bound(bound);
                b.set_cumulative_count(cumulative);
                b
            })
            .collect();
        h.set_bucket(buckets);
        h.set_sample_count(self.count());
        h.set_sample_sum(self.sum);
        h
    }
}

fn load(c: &AtomicU64) -> u64 {
    c.load(Relaxed)
}

fn requests(out: &mut Families, shared: &Shared) {
    fn ops(w: &WorkerStats) -> &engine::stats::OpCounters {
        &w.front.ops
    }
    let mut reqs = Vec::new();
    let mut bytes = Vec::new();
    let mut service = Vec::new();
    for (index, export) in shared.exports.entries() {
        let rows: Vec<&ExportOps> = shared.workers.iter().filter_map(|w| ops(w).export(index)).collect();
        for op in Opcode::ALL {
            let labels = || vec![("export", export.name.clone()), ("opcode", op.name().to_owned())];
            for slot in 0..STATUS_SLOTS {
                let n: u64 = rows.iter().map(|r| r.reqs(op, slot)).sum();
                if n > 0 {
                    let mut l = labels();
                    l.push(("status", stats::slot_status(slot).name().to_owned()));
                    reqs.push((l, n));
                }
            }
            let n: u64 = rows.iter().map(|r| r.bytes(op)).sum();
            if n > 0 {
                bytes.push((labels(), n));
            }
            let h = service_times(&rows, op);
            if h.count() > 0 {
                service.push((labels(), h));
            }
        }
    }
    out.counter(
        "skiff_requests_total",
        "Requests answered, by export, opcode and status (NBD commands under the native opcode they map to).",
        reqs,
    );
    out.counter(
        "skiff_request_bytes_total",
        "Payload bytes of successful reads and writes, by export.",
        bytes,
    );
    out.histogram(
        "skiff_request_duration_seconds",
        "Service time of requests on their worker: from the end of the request before it in the same batch (or the batch's start) to its completion being queued; excludes time in sockets.",
        service,
    );

    let mut unattributed = Vec::new();
    for slot in 0..STATUS_SLOTS {
        let n: u64 = shared
            .workers
            .iter()
            .map(|w| {
                ops(w).undecoded(slot)
                    + Opcode::ALL.iter().map(|&op| ops(w).no_export().reqs(op, slot)).sum::<u64>()
            })
            .sum();
        if n > 0 {
            unattributed.push((vec![("status", stats::slot_status(slot).name().to_owned())], n));
        }
    }
    out.counter(
        "skiff_requests_unattributed_total",
        "Requests answered that named no export open on their connection, or whose descriptor could not be decoded, by status.",
        unattributed,
    );
}

fn service_times(rows: &[&ExportOps], op: Opcode) -> Hist {
    let mut counts = vec![0u64; SERVICE_BUCKETS];
    let mut sum_ns = 0;
    for r in rows {
        let (buckets, ns) = r.service(op).snapshot();
        for (total, n) in counts.iter_mut().zip(buckets) {
            *total += n;
        }
        sum_ns += ns;
    }
    let bounds =
        (0..SERVICE_BUCKETS).filter_map(stats::service_bucket_bound_ns).map(|ns| ns as f64 / 1e9).collect();
    Hist { bounds, counts, sum: sum_ns as f64 / 1e9 }
}

/// Picks one counter out of a worker's stats.
type Field = fn(&WorkerStats) -> &AtomicU64;

/// One sample per worker.
fn per_worker<T>(workers: &[std::sync::Arc<WorkerStats>], f: impl Fn(&WorkerStats) -> T) -> Vec<(Labels, T)> {
    workers.iter().enumerate().map(|(i, w)| (vec![("worker", i.to_string())], f(w))).collect()
}

fn workers(out: &mut Families, workers: &[std::sync::Arc<WorkerStats>]) {
    out.counter(
        "skiff_worker_requests_total",
        "Requests answered by each worker, any export, opcode and status.",
        per_worker(workers, |w| Opcode::ALL.iter().map(|&op| w.front.ops.reqs(op)).sum::<u64>()),
    );
    let caravans = per_worker(workers, |w| {
        let f = &w.front;
        let bounds = CARAVAN_BUCKETS.iter().map(|&b| f64::from(b)).collect();
        let counts = f.caravan_hist.iter().map(load).collect();
        Hist { bounds, counts, sum: load(&f.caravan_reqs_total) as f64 }
    });
    out.histogram(
        "skiff_caravan_requests",
        "Requests per received request caravan, by worker: the batch level the initiators chose.",
        caravans,
    );
    let counters: [(&str, &str, Field); 9] = [
        ("skiff_response_caravans_total", "Completion caravans sent, by worker.", |w| &w.front.caravans_sent),
        ("skiff_loop_passes_total", "Worker loop passes that found work.", |w| &w.loop_passes),
        ("skiff_received_bytes_total", "Bytes received from sockets, by worker.", |w| &w.rx_bytes),
        ("skiff_sent_bytes_total", "Bytes sent to sockets, by worker.", |w| &w.tx_bytes),
        ("skiff_connections_accepted_total", "Connections adopted by each worker.", |w| {
            &w.connections_accepted
        }),
        (
            "skiff_protocol_errors_total",
            "Connections closed because the peer broke the protocol, by worker.",
            |w| &w.front.connections_closed_protocol_error,
        ),
        ("skiff_poll_waits_total", "Waits for work under hybrid polling, by worker.", |w| &w.poll_waits),
        (
            "skiff_poll_caught_total",
            "Waits under hybrid polling whose work a spin caught without a wake-up, by worker.",
            |w| &w.poll_caught,
        ),
        (
            "skiff_capabilities_sent_total",
            "Capabilities for direct reads handed out on reads that asked for them, by worker.",
            |w| &w.front.capabilities_sent,
        ),
    ];
    for (name, help, field) in counters {
        out.counter(name, help, per_worker(workers, |w| load(field(w))));
    }
    let mut stages = Vec::new();
    for (i, w) in workers.iter().enumerate() {
        for (stage, ns) in
            [("recv", &w.stage_recv_ns), ("exec", &w.stage_exec_ns), ("send", &w.stage_send_ns)]
        {
            stages
                .push((vec![("worker", i.to_string()), ("stage", stage.to_owned())], load(ns) as f64 / 1e9));
        }
    }
    out.counter(
        "skiff_stage_seconds_total",
        "Wall time workers spent in receive calls (recv), processing what arrived (exec) and send calls (send).",
        stages,
    );
}

fn connections(out: &mut Families, shared: &Shared) {
    let open: &AtomicUsize = &shared.connections;
    out.gauge(
        "skiff_connections_open",
        "Connections open now, all listeners.",
        vec![(vec![], open.load(Relaxed) as f64)],
    );
    let l = &shared.listener;
    for (name, help, counter) in [
        (
            "skiff_connections_refused_total",
            "Connections refused at accept (connections_max, or the per-address cap with no handshake of that address to evict).",
            &l.connections_refused,
        ),
        (
            "skiff_connections_evicted_total",
            "Connections still in their handshake closed to make room for a new one.",
            &l.connections_evicted,
        ),
        (
            "skiff_handshake_timeouts_total",
            "Connections closed because their handshake outlived handshake_timeout.",
            &l.handshake_timeouts,
        ),
        (
            "skiff_idle_timeouts_total",
            "Connections closed because they were silent for the idle timeout.",
            &l.idle_timeouts,
        ),
    ] {
        out.counter(name, help, vec![(vec![], load(counter))]);
    }
}

fn exports(out: &mut Families, shared: &Shared) {
    let mut size = Vec::new();
    let mut info = Vec::new();
    let mut backend: [Vec<(Labels, u64)>; 4] = Default::default();
    let mut cache: [Vec<(Labels, u64)>; 6] = Default::default();
    let mut epochs = Vec::new();
    for e in shared.exports.iter() {
        let name = || vec![("export", e.name.clone())];
        size.push((name(), e.backend.size_bytes() as f64));
        let mut l = name();
        l.push(("kind", e.backend.kind().to_owned()));
        l.push(("read_only", e.is_read_only().to_string()));
        info.push((l, 1.0));
        let c = e.backend.counters();
        for (series, v) in backend.iter_mut().zip([c.syncs, c.dsync_writes, c.direct_ios, c.buffered_ios]) {
            series.push((name(), v));
        }
        if let Some(d) = &e.direct {
            epochs.push((name(), f64::from(d.epoch())));
            if let Some(c) = d.cache() {
                let c = c.counters();
                let values = [c.fills, c.fills_raced, c.evictions, c.invalidations, c.hits, c.stale];
                for (series, v) in cache.iter_mut().zip(values) {
                    series.push((name(), v));
                }
            }
        }
    }
    out.gauge("skiff_export_size_bytes", "Size of each export.", size);
    out.gauge(
        "skiff_export_info",
        "Each export's backend kind and whether it is read-only; the value is always 1.",
        info,
    );
    let [syncs, dsync, direct, buffered] = backend;
    out.counter(
        "skiff_backend_syncs_total",
        "fdatasync calls issued by file exports (flush, and FUA without O_DSYNC).",
        syncs,
    );
    out.counter("skiff_backend_dsync_writes_total", "Writes issued through O_DSYNC for FUA.", dsync);
    out.counter("skiff_backend_direct_ios_total", "Reads and writes that went through O_DIRECT.", direct);
    out.counter(
        "skiff_backend_buffered_ios_total",
        "Reads and writes that went through the page cache.",
        buffered,
    );
    out.gauge(
        "skiff_capability_key_epoch",
        "Each export's capability key epoch: it moves on when every capability of the export is revoked.",
        epochs,
    );
    let [fills, raced, evictions, invalidations, hits, stale] = cache;
    out.counter(
        "skiff_cache_fills_total",
        "Blocks copied into the direct-read cache by reads that asked for capabilities.",
        fills,
    );
    out.counter(
        "skiff_cache_fills_raced_total",
        "Blocks not cached because a write touched them between the backend read and the fill.",
        raced,
    );
    out.counter("skiff_cache_evictions_total", "Cached blocks pushed out to make room.", evictions);
    out.counter(
        "skiff_cache_invalidations_total",
        "Cached blocks dropped by writes, trims, write-zeroes or an explicit invalidation.",
        invalidations,
    );
    out.counter("skiff_cache_hits_total", "Direct reads served from the cache.", hits);
    out.counter(
        "skiff_cache_stale_total",
        "Direct reads refused because their cache slot had moved on.",
        stale,
    );
}

/// The flash array's figures (`engine::volumes`): space, write amplification, cleaning,
/// checkpoints and the page pool. One series each, without labels: a target has one array.
fn flash(out: &mut Families, s: &engine::volumes::flash::engine::Stats, volumes: usize) {
    let gauges: &[(&str, &str, f64)] = &[
        ("skiff_flash_volumes", "Volumes of the flash array, snapshots and clones included.", volumes as f64),
        ("skiff_flash_capacity_bytes", "Bytes the flash array holds for data (segments less their headers).", s.capacity_bytes as f64),
        ("skiff_flash_valid_bytes", "Bytes of the flash array holding data some volume maps.", s.valid_bytes as f64),
        (
            "skiff_flash_free_bytes",
            "Bytes of the flash array that could still take data once cleaned: capacity less valid bytes.",
            engine::volumes::free_bytes(s) as f64,
        ),
        ("skiff_flash_segments", "Segments of the flash array.", f64::from(s.total_segments)),
        ("skiff_flash_free_segments", "Segments of the flash array free to write.", f64::from(s.free_segments)),
        (
            "skiff_flash_write_amplification",
            "Pages written to the devices per page written by users, over the array's life (0 before the first write).",
            s.write_amplification,
        ),
        ("skiff_flash_pool_pages", "Pages (4 KiB) of the flash array's DRAM page pool.", f64::from(s.pool_pages)),
        ("skiff_flash_pool_dirty_pages", "Pages of the page pool written and not yet on the devices.", f64::from(s.pool_dirty)),
        (
            "skiff_flash_pool_lent_pages",
            "Pages of the page pool lent to replies on their way into sockets (a page lent twice counts twice).",
            f64::from(s.pool_lends),
        ),
        (
            "skiff_flash_map_bytes",
            "Bytes of the flash array's map leaves and per-page side tables in memory (bounded by --flash-map-budget).",
            s.map_bytes as f64,
        ),
    ];
    for &(name, help, v) in gauges {
        out.gauge(name, help, vec![(vec![], v)]);
    }
    let c = &s.counters;
    let counters: &[(&str, &str, u64)] = &[
        ("skiff_flash_user_pages_written_total", "Pages written to flash volumes by users (initiators).", c.user_pages_written),
        (
            "skiff_flash_device_pages_written_total",
            "Pages written to the devices: data, moved data, group and segment headers, checkpoints.",
            c.device_pages_written,
        ),
        ("skiff_flash_device_pages_read_total", "Pages read from the devices.", c.device_pages_read),
        ("skiff_flash_gc_segments_cleaned_total", "Segments the cleaner emptied for reuse.", c.gc_segments_cleaned),
        ("skiff_flash_gc_pages_moved_total", "Valid pages the cleaner moved out of segments it cleaned.", c.gc_pages_moved),
        ("skiff_flash_checkpoints_total", "Checkpoints of the flash array's map written.", c.checkpoints),
        ("skiff_flash_pool_hits_total", "Page reads and writes served by a page in the pool.", c.pool_hits),
        ("skiff_flash_pool_misses_total", "Page reads and writes that found the page outside the pool and took a slot for it (read from the devices unless wholly overwritten).", c.pool_misses),
        ("skiff_flash_pool_evictions_total", "Pages dropped from the pool to make room for others.", c.evictions),
        (
            "skiff_flash_pages_read_async_total",
            "Pool misses read ahead of their request without blocking a worker (io_uring).",
            s.pages_read_async,
        ),
        (
            "skiff_flash_device_reads_async_total",
            "Device reads those pool misses took: pages next to each other on a device are read as one.",
            s.device_reads_async,
        ),
        (
            "skiff_flash_pages_joined_total",
            "Pages a look-ahead found on their way into the pool for another request, and waited for parked rather than on a worker.",
            s.pages_joined,
        ),
        (
            "skiff_flash_pages_lent_total",
            "Pool pages read data was sent from by reference, lent (kept in the pool) until sent, with no copy of the target's own.",
            s.pages_lent,
        ),
        (
            "skiff_flash_syncs_later_total",
            "FLUSH and FUA requests made durable by the flash sync thread while their worker served others.",
            s.syncs_later,
        ),
        (
            "skiff_flash_sync_rounds_later_total",
            "Syncs the flash sync thread made for them (one serves every request it finds queued).",
            s.sync_rounds_later,
        ),
        (
            "skiff_flash_pool_full_writes_total",
            "Page writes that found every pool slot dirty, pinned or in flight and made room on their own thread.",
            s.pool_full_writes,
        ),
        (
            "skiff_flash_rooms_later_total",
            "Writes that found the pool nearly full of dirty pages and waited parked while the flash sync thread wrote back.",
            s.rooms_later,
        ),
        (
            "skiff_flash_map_loads_total",
            "Map leaves read back from the last checkpoint after the map budget evicted them.",
            s.map_loads,
        ),
        ("skiff_flash_map_evictions_total", "Map leaves dropped from memory to keep to the map budget.", s.map_evictions),
    ];
    for &(name, help, v) in counters {
        out.counter(name, help, vec![(vec![], v)]);
    }
}

/// CPU time and context switches of the target's threads, from procfs (user and system time
/// have clock-tick resolution there).
/// A memory server's RStore pool: its chunks' repair state and what its repair agent did.
fn pool(out: &mut Families, shared: &Shared) {
    let r = &shared.repair;
    let mut dirty = 0u64;
    for e in shared.exports.iter() {
        if let Some(g) = e.grants() {
            dirty += (0..g.chunks()).filter(|&c| g.dirty(c) != 0).count() as u64;
        }
    }
    out.gauge(
        "skiff_rstore_dirty_chunks",
        "Chunks of the pool with regions written while another copy of their stripe missed them (they are repaired from here).",
        vec![(vec![], dirty as f64)],
    );
    out.gauge(
        "skiff_rstore_repair_leader",
        "1 while this memory server leads the repair of RStore namespaces, else 0.",
        vec![(vec![], f64::from(u8::from(r.leading.load(std::sync::atomic::Ordering::Relaxed))))],
    );
    out.counter(
        "skiff_rstore_repair_chunks_total",
        "Copies this memory server repaired as their source.",
        vec![(vec![], load(&r.chunks))],
    );
    out.counter(
        "skiff_rstore_repair_bytes_total",
        "Bytes this memory server copied out to repair copies.",
        vec![(vec![], load(&r.bytes))],
    );
    out.gauge(
        "skiff_rstore_repair_rate_bytes",
        "Bytes a second of the last copy this memory server repaired.",
        vec![(vec![], load(&r.rate) as f64)],
    );
    out.counter(
        "skiff_rstore_repair_verified_bytes_total",
        "Bytes of regions not known to differ that this memory server compared with the copies it repaired.",
        vec![(vec![], load(&r.verified))],
    );
    out.counter(
        "skiff_rstore_repair_mismatched_regions_total",
        "Regions not known to differ that were found different from the copy being repaired, and copied.",
        vec![(vec![], load(&r.mismatched))],
    );
}

fn cpu(out: &mut Families, shared: &Shared) {
    let threads = shared
        .workers
        .iter()
        .enumerate()
        .map(|(i, w)| (format!("worker-{i}"), w.tid.load(Relaxed)))
        .chain([("acceptor".to_owned(), shared.acceptor_tid.load(Relaxed))]);
    let mut cpu = Vec::new();
    let mut switches = Vec::new();
    for (thread, tid) in threads.filter(|(_, tid)| *tid != 0) {
        let Ok(u) = rt::usage::of_thread(tid) else { continue };
        for (mode, us) in [("user", u.user_us), ("system", u.sys_us)] {
            cpu.push((vec![("thread", thread.clone()), ("mode", mode.to_owned())], us as f64 / 1e6));
        }
        for (kind, n) in [("voluntary", u.ctx_voluntary), ("involuntary", u.ctx_involuntary)] {
            switches.push((vec![("thread", thread.clone()), ("kind", kind.to_owned())], n));
        }
    }
    out.counter(
        "skiff_thread_cpu_seconds_total",
        "CPU time of the target's threads (workers and acceptor), user and system.",
        cpu,
    );
    out.counter(
        "skiff_thread_context_switches_total",
        "Context switches of the target's threads: voluntary (blocked) and involuntary (preempted).",
        switches,
    );
}
