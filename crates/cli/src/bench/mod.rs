//! `skiff bench`: many lanes against one export, reported as a table or JSON.
//!
//! CPU per I/O is measured where it is spent: the client figure is the bench threads' own
//! CPU time (`getrusage(RUSAGE_THREAD)`), the server figure is the target's threads' CPU time
//! from its STATS reply, both over the timed phase only and divided by the I/Os completed in
//! it. That holds whether the target runs in this process or elsewhere.

mod pattern;
mod report;
mod workload;

use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::Args;
use initiator::{BatchConfig, Batching, Client, Endpoint, Lane, LaneConfig, Limits, SharedLanes};
use server::{ExportConfig, Target, TargetConfig};

use crate::units::{parse_duration, parse_size};
use crate::CliResult;
use workload::{Phases, Rw, Workload};

const EMBEDDED_EXPORT: &str = "bench";
const EMBEDDED_SIZE: &str = "ram:1G";

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Target address (HOST:PORT or unix:PATH). Without it, a target with a 1 GiB RAM export
    /// runs in this process on loopback.
    #[arg(long, conflicts_with = "namespace")]
    target: Option<String>,
    /// Measure an RStore namespace instead of one target: the allocation at --raddress of
    /// namespace NAME, striped over its memory servers, each thread with a lane to each of them
    /// (docs/RSTORE.md). --size defaults to the allocation's length.
    #[arg(long, value_name = "NAME")]
    namespace: Option<String>,
    /// The coordinator of --namespace: etcd's client URLs [default: $SKIFF_COORDINATOR, or
    /// http://127.0.0.1:2379].
    #[arg(long, value_name = "URLS", requires = "namespace")]
    coordinator: Option<String>,
    #[command(flatten)]
    coordinator_tls: crate::ns::CoordinatorTls,
    /// The allocation of --namespace to measure (its address; the first allocation is at 0).
    #[arg(long, value_parser = parse_size, default_value = "0", requires = "namespace")]
    raddress: u64,
    /// Export to open on --target.
    #[arg(long, default_value = EMBEDDED_EXPORT)]
    export: String,
    #[arg(long, value_enum, default_value = "randread")]
    rw: Rw,
    /// Share of reads for --rw randrw, in percent.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(0..=100))]
    rwmix_read: u32,
    /// Block size of every I/O.
    #[arg(long, default_value = "4k", value_parser = parse_size)]
    bs: u64,
    /// Requests each thread keeps outstanding.
    #[arg(long, default_value_t = 32)]
    qd: usize,
    /// Threads, each with its own lane (or, with --shared-lane, a handle on a shared one).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Send every thread's requests through a few shared lanes (one per core, or --lanes),
    /// where they travel in common caravans: the workload of a FUSE mount or a blocking API.
    #[arg(long)]
    shared_lane: bool,
    /// Shared lanes to open with --shared-lane (default: one per core).
    #[arg(long, default_value_t = 0, requires = "shared_lane")]
    lanes: usize,
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    duration: Duration,
    /// Open loop: start this many I/Os per second in all (each thread its share, evenly
    /// spaced) instead of keeping every queue full; --qd bounds what may be in flight.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    rate: Option<u64>,
    /// Bytes of the export to use (default: all of it).
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Write a known pattern first and check every byte of every read, then read everything
    /// back; any mismatch makes the exit status non-zero.
    #[arg(long)]
    verify: bool,
    /// Seed for offsets and the verification pattern.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Print one JSON object on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// Worker threads of the in-process target (default: one per core).
    #[arg(long, default_value_t = 0)]
    target_workers: usize,
    /// How requests are gathered into caravans: off (one request per send), static (the
    /// doorbell's fixed aggregation), static:N (the same with N requests), or adaptive (the
    /// Tyche controller sets the caravan size and the doorbell delay).
    #[arg(long, default_value = "static", value_parser = parse_batching)]
    batching: BatchingArg,
    /// Requests per caravan for static batching (i10: 16).
    #[arg(long)]
    aggregation: Option<u32>,
    /// Doorbell delay bound in microseconds for static batching (i10: 50).
    #[arg(long)]
    doorbell_us: Option<u64>,
    /// Hybrid polling on the lanes (and the in-process target): off; hybrid (spin 50 us
    /// before sleeping; hybrid:US); or adaptive (spin only while it saves more wake-ups than
    /// it wastes, up to 50 us or adaptive:US, and sleep on a timer through long waits).
    #[arg(long, default_value = "off", value_parser = crate::units::parse_poll)]
    poll: initiator::PollMode,
    /// Direct placement of read data in the callers' buffers from this average read size on
    /// (0: every read; off, the default: never). Smaller reads are received in bulk and copied.
    #[arg(long, default_value = "off", value_parser = crate::units::parse_direct_min)]
    direct_min: u32,
    /// Direct reads (ODAFS, docs/DIRECT_READS.md): reads ask the target for capabilities, and
    /// later reads of the same bytes are served from them without the target's backend; a
    /// stale one falls back to an ordinary read in the same call.
    #[arg(long)]
    direct_reads: bool,
    /// Capabilities each lane's directory holds with --direct-reads (the default covers 1 GiB
    /// of 4 KiB cache slots, about 16 MiB per lane).
    #[arg(long, default_value_t = 1 << 18, requires = "direct_reads")]
    directory_entries: u32,
    /// Read the whole range once before the timed phase (after --verify's fill), so that the
    /// timed phase meets warm caches and directories: ODAFS's second pass.
    #[arg(long)]
    warm: bool,
    /// Every write carries FUA: it completes only once it is durable (synchronous writes).
    #[arg(long)]
    fua: bool,
    #[command(flatten)]
    reconnect: crate::reconnect::ReconnectArgs,
    #[command(flatten)]
    keys: crate::keys::KeyArgs,
    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

/// `--batching` as typed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BatchingArg {
    Off,
    Static(Option<u32>),
    Adaptive,
}

pub(crate) fn parse_batching(s: &str) -> Result<BatchingArg, crate::units::ArgError> {
    match s {
        "off" => Ok(BatchingArg::Off),
        "static" => Ok(BatchingArg::Static(None)),
        "adaptive" => Ok(BatchingArg::Adaptive),
        _ => match s.strip_prefix("static:").map(str::parse::<u32>) {
            Some(Ok(n)) if n >= 1 => Ok(BatchingArg::Static(Some(n))),
            _ => Err(crate::units::ArgError::Batching(s.to_owned())),
        },
    }
}

impl BatchingArg {
    fn label(self, doorbell: &initiator::Doorbell) -> String {
        match self {
            BatchingArg::Off => "off".into(),
            BatchingArg::Static(_) => format!("static:{}", doorbell.aggregation_reqs),
            BatchingArg::Adaptive => "adaptive".into(),
        }
    }
}

pub fn run(args: BenchArgs) -> CliResult {
    let bs = u32::try_from(args.bs)
        .ok()
        .filter(|b| *b >= 512 && b % 512 == 0)
        .ok_or("--bs must be a multiple of 512 below 4 GiB")?;
    if args.qd == 0 || args.threads == 0 {
        return Err("--qd and --threads must be at least 1".into());
    }
    // An RStore namespace: a segment per thread, each with lanes to every memory server.
    let coord = match &args.namespace {
        Some(_) => Some(crate::ns::coordinator(args.coordinator.as_deref(), &args.coordinator_tls)?.0),
        None => None,
    };
    let segment = match (&args.namespace, &coord) {
        (Some(ns), Some(c)) => Some(crate::ns::resolve(c, ns, args.raddress)?),
        _ => None,
    };
    // Keep the embedded target alive for the whole run; dropping it shuts it down.
    let (endpoint, embedded, target_label) = match (&args.target, &segment) {
        (_, Some((map, label))) => (map.stripes[0][0].endpoint.clone(), None, label.clone()),
        (Some(t), None) => (Endpoint::parse(t)?, None, t.clone()),
        (None, None) => {
            let config = TargetConfig {
                listen: vec![Endpoint::Tcp("127.0.0.1:0".into())],
                exports: vec![format!("{EMBEDDED_EXPORT}={EMBEDDED_SIZE}").parse::<ExportConfig>()?],
                workers: args.target_workers,
                poll: args.poll,
                ..TargetConfig::default()
            };
            let target = Target::start(config)?;
            let ep = target.endpoints()[0].clone();
            (ep, Some(target), format!("in-process {EMBEDDED_SIZE} on loopback"))
        }
    };
    if embedded.is_some() && segment.is_none() && args.export != EMBEDDED_EXPORT {
        return Err(format!("the in-process target has only the export {EMBEDDED_EXPORT:?}").into());
    }

    let mut doorbell = initiator::Doorbell::default();
    let static_n = match args.batching {
        BatchingArg::Static(n) => n,
        _ => None,
    };
    if let Some(n) = args.aggregation.or(static_n) {
        doorbell.aggregation_reqs = n.max(1);
    }
    if let Some(us) = args.doorbell_us {
        doorbell.delay_us = us;
    }
    let batching = match args.batching {
        BatchingArg::Off => Batching::Off,
        BatchingArg::Static(_) => Batching::Static,
        BatchingArg::Adaptive => Batching::Adaptive(BatchConfig::default()),
    };
    let lane_key = args.keys.key()?;
    let lane_tls = args.tls.config()?;
    let lane_config = LaneConfig {
        limits: Limits {
            queue_depth: args.qd as u32,
            caravan_reqs_max: 0,
            caravan_bytes_max: 0,
            io_bytes_max: 0,
        },
        doorbell,
        batching,
        poll: args.poll,
        direct_min_bytes: args.direct_min,
        reconnect: args.reconnect.config(),
        key: lane_key.clone(),
        tls: lane_tls.clone(),
        directory_entries: if args.direct_reads { args.directory_entries.max(1) } else { 0 },
        ..LaneConfig::default()
    };
    let connect_error = |e| format!("{endpoint} export {:?}: {e}", args.export);
    let queues = if let Some((map, label)) = &segment {
        if args.shared_lane {
            return Err(
                "--shared-lane does not apply to --namespace (each thread has a lane to each server)".into(),
            );
        }
        let c = coord.as_ref().expect("a segment comes from --namespace, with its coordinator");
        let ns = args.namespace.as_deref().expect("a segment comes from --namespace");
        let segments = (0..args.threads)
            .map(|_| c.map(ns, args.raddress, &lane_config))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{label}: {e}"))?;
        let info = initiator::ExportInfo {
            name: label.clone(),
            size_bytes: map.len / 512 * 512,
            block_size: 512,
            flags: initiator::ExportFlags(0),
        };
        Queues::Segments(segments, info)
    } else if args.shared_lane {
        // The lanes' queue depth is what all their threads keep outstanding together.
        let lanes_n = if args.lanes == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            args.lanes
        };
        let per_lane = (args.threads.div_ceil(lanes_n) * args.qd) as u32;
        let config =
            LaneConfig { limits: Limits { queue_depth: per_lane, ..lane_config.limits }, ..lane_config };
        let shared =
            SharedLanes::connect(&endpoint, &args.export, &config, lanes_n).map_err(connect_error)?;
        let handles = (0..args.threads).map(|_| shared.handle()).collect::<Result<Vec<_>, _>>()?;
        Queues::Shared(shared, handles)
    } else {
        let lanes = (0..args.threads)
            .map(|_| Lane::connect(&endpoint, &args.export, &lane_config))
            .collect::<Result<Vec<_>, _>>()
            .map_err(connect_error)?;
        if lanes[0].queue_depth() < args.qd {
            return Err(format!(
                "target allows queue depth {} per lane, asked {}",
                lanes[0].queue_depth(),
                args.qd
            )
            .into());
        }
        Queues::Private(lanes)
    };
    let export = queues.export().clone();
    let size = args.size.unwrap_or(export.size_bytes);
    if size > export.size_bytes {
        return Err(format!("--size {size} is larger than the export ({} bytes)", export.size_bytes).into());
    }
    if bs % export.block_size != 0 {
        return Err(
            format!("--bs must be a multiple of the export's block size {}", export.block_size).into()
        );
    }
    // Under --verify each thread gets its own slice; otherwise all share the whole range.
    let slice = if args.verify {
        size / args.threads as u64 / u64::from(bs) * u64::from(bs)
    } else {
        size / u64::from(bs) * u64::from(bs)
    };
    if slice < u64::from(bs) * args.qd as u64 {
        return Err("--size is too small for --bs × --qd per thread".into());
    }

    // The server figures are summed over every server measured (one, or a namespace's).
    let stats_endpoints: Vec<Endpoint> = match &segment {
        Some((map, _)) => {
            let mut all: Vec<Endpoint> = map.stripes.iter().flatten().map(|l| l.endpoint.clone()).collect();
            all.sort_by_key(|e| e.to_string());
            all.dedup();
            all
        }
        None => vec![endpoint.clone()],
    };
    let mut stats_client = TargetStats {
        clients: stats_endpoints
            .iter()
            .map(|e| match Client::connect_with(e, lane_key.as_deref(), lane_tls.as_ref()) {
                Ok(c) => Ok(Some(c)),
                // A namespace's server that is down: its copies are out of the segments too,
                // and its figures are left out of the sum.
                Err(err) if segment.is_some() => {
                    tracing::warn!(server = %e, error = %err, "no server figures from a memory server that is down");
                    Ok(None)
                }
                Err(err) => Err(err),
            })
            .collect::<Result<Vec<_>, _>>()?,
        endpoints: stats_endpoints,
        key: lane_key.clone(),
        tls: lane_tls.clone(),
    };
    let phases = Arc::new(Phases {
        timed_start: Barrier::new(args.threads + 1),
        timed_end: Barrier::new(args.threads + 1),
        ios_done: Default::default(),
    });
    let workload = |t: usize| Workload {
        rw: args.rw,
        read_pct: args.rwmix_read,
        bs,
        qd: args.qd,
        region_start: if args.verify { t as u64 * slice } else { 0 },
        region_len: slice,
        duration: args.duration,
        verify: args.verify,
        warm: args.warm,
        fua: args.fua,
        earn: args.direct_reads && !matches!(args.rw, Rw::Read | Rw::Randread),
        seed: args.seed,
        pace: args.rate.map(|rate| Duration::from_secs_f64(args.threads as f64 / rate as f64)),
    };
    fn spawn<Q: workload::BenchQueue + 'static>(
        t: usize,
        w: Workload,
        queue: Q,
        phases: &Arc<Phases>,
    ) -> std::io::Result<std::thread::JoinHandle<Result<workload::ThreadResult, initiator::Error>>> {
        let phases = phases.clone();
        std::thread::Builder::new()
            .name(format!("skiff-bench-{t}"))
            .spawn(move || workload::run(&w, queue, phases, t))
    }
    let (shared, threads) = match queues {
        Queues::Private(lanes) => {
            let threads = lanes.into_iter().enumerate().map(|(t, lane)| spawn(t, workload(t), lane, &phases));
            (None, threads.collect::<Result<Vec<_>, _>>()?)
        }
        Queues::Shared(shared, handles) => {
            let threads = handles.into_iter().enumerate().map(|(t, h)| spawn(t, workload(t), h, &phases));
            (Some(shared), threads.collect::<Result<Vec<_>, _>>()?)
        }
        Queues::Segments(segments, _) => {
            let threads = segments.into_iter().enumerate().map(|(t, s)| spawn(t, workload(t), s, &phases));
            (None, threads.collect::<Result<Vec<_>, _>>()?)
        }
    };

    let progress = report::Progress::new(args.duration, args.verify, args.json);
    phases.timed_start.wait();
    let stats_before = stats_client.take();
    let shared_before = shared.as_ref().map(SharedLanes::stats);
    let started = Instant::now();
    progress.timed(&phases.ios_done, started, args.duration);
    phases.timed_end.wait();
    let elapsed = started.elapsed();
    let stats_after = stats_client.take();
    let shared_after = shared.as_ref().map(SharedLanes::stats);
    progress.verifying();

    let mut results = Vec::new();
    let mut failed = None;
    for h in threads {
        match h.join().map_err(|_| "a bench thread panicked")? {
            Ok(r) => results.push(r),
            // Report what the other threads did, then the failure (e.g. the target gone for
            // longer than ctrl_loss_timeout).
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    if results.is_empty() {
        let e = failed.expect("no results means a failure");
        return Err(format!("{endpoint} export {:?}: {e}", args.export).into());
    }
    let telemetry = match (&shared, shared_before, shared_after) {
        (Some(shared), Some(before), Some(after)) => report::Telemetry {
            lanes: after.since(&before),
            batch_levels: shared.batch_levels(),
            batch_level_log: shared.batch_level_log(0),
            poll: shared.poll_stats(),
            link: shared.link_stats(),
        },
        _ => report::Telemetry::of_private_lanes(&results),
    };
    progress.finish();
    let setup = report::Setup {
        rw: args.rw,
        rwmix_read: args.rwmix_read,
        bs,
        qd: args.qd,
        threads: args.threads,
        shared_lanes: shared.as_ref().map_or(0, SharedLanes::lanes),
        target: target_label,
        export: args.export.clone(),
        size_bytes: size,
        verify: args.verify,
        batching: args.batching.label(&doorbell),
        poll: args.poll.label(),
    };
    let summary = report::summarize(setup, &results, &telemetry, elapsed, &stats_before, &stats_after);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        report::print_table(&summary);
    }
    drop(embedded);
    if let Some(e) = failed {
        return Err(format!("{endpoint} export {:?}: {e}", args.export).into());
    }
    Ok(if summary.verify_errors > 0 || summary.io_errors > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// Where the bench threads' requests go.
enum Queues {
    /// A lane per thread.
    Private(Vec<Lane>),
    /// A handle per thread on a few shared lanes.
    Shared(SharedLanes, Vec<initiator::SharedHandle>),
    /// A mapped RStore segment per thread, and what it looks like as a volume.
    Segments(Vec<rstore::Segment>, initiator::ExportInfo),
}

impl Queues {
    fn export(&self) -> &initiator::ExportInfo {
        match self {
            Queues::Private(lanes) => lanes[0].export(),
            Queues::Shared(shared, _) => shared.export(),
            Queues::Segments(_, info) => info,
        }
    }
}

/// The target's counters around the timed phase. A target restarted meanwhile (the lanes
/// reconnect) needs a new control connection too; if the target cannot be asked, the
/// server-side figures come out as zero rather than the run failing.
struct TargetStats {
    endpoints: Vec<Endpoint>,
    clients: Vec<Option<Client>>,
    key: Option<std::sync::Arc<proto::auth::Key>>,
    tls: Option<initiator::TlsConfig>,
}

impl TargetStats {
    /// Every target's counters, summed name by name.
    fn take(&mut self) -> initiator::StatsReply {
        let mut all = initiator::StatsReply { entries: Vec::new() };
        for i in 0..self.endpoints.len() {
            for (name, v) in self.take_one(i).entries {
                match all.entries.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, sum)) => *sum += v,
                    None => all.entries.push((name, v)),
                }
            }
        }
        all
    }

    fn take_one(&mut self, i: usize) -> initiator::StatsReply {
        for _ in 0..2 {
            if self.clients[i].is_none() {
                self.clients[i] =
                    Client::connect_with(&self.endpoints[i], self.key.as_deref(), self.tls.as_ref()).ok();
            }
            match self.clients[i].as_mut().map(Client::stats) {
                Some(Ok(stats)) => return stats,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "target stats unavailable; reconnecting once");
                    self.clients[i] = None;
                }
                None => break,
            }
        }
        initiator::StatsReply { entries: Vec::new() }
    }
}
