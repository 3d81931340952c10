//! Progress while the bench runs, and the summary after: a table for people, JSON for tools.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use initiator::{LaneStats, WaitStats};
use serde::Serialize;
use wire::StatsReply;

use super::workload::{Rw, ThreadResult};
use crate::units::{grouped, human_bytes};

/// The progress bar on stderr (hidden with --json or when stderr is not a terminal).
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub fn new(duration: Duration, verify: bool, json: bool) -> Progress {
        let bar = ProgressBar::new(duration.as_millis() as u64);
        if json {
            bar.set_draw_target(ProgressDrawTarget::hidden());
        }
        bar.set_style(
            ProgressStyle::with_template("{spinner} {prefix:>9} [{bar:32}] {elapsed:>3}/{duration:3} {msg}")
                .expect("static template")
                .progress_chars("=> "),
        );
        bar.set_prefix(if verify { "prefill" } else { "starting" });
        bar.enable_steady_tick(Duration::from_millis(100));
        Progress { bar }
    }

    /// Follow the timed phase until `duration` has passed, showing the current IOPS.
    pub fn timed(&self, ios: &AtomicU64, started: Instant, duration: Duration) {
        self.bar.set_prefix("running");
        let mut last = (Instant::now(), ios.load(Relaxed));
        while started.elapsed() < duration {
            std::thread::sleep(Duration::from_millis(250).min(duration.saturating_sub(started.elapsed())));
            let now = (Instant::now(), ios.load(Relaxed));
            let rate = (now.1 - last.1) as f64 / now.0.duration_since(last.0).as_secs_f64().max(1e-9);
            self.bar.set_position(started.elapsed().as_millis() as u64);
            self.bar.set_message(format!("{} IOPS", grouped(rate as u64)));
            last = now;
        }
    }

    pub fn verifying(&self) {
        self.bar.set_prefix("finishing");
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

#[derive(Debug, Serialize)]
pub struct Setup {
    pub rw: Rw,
    pub rwmix_read: u32,
    pub bs: u32,
    pub qd: usize,
    pub threads: usize,
    /// Shared lanes the threads' requests went through (0: a lane per thread).
    pub shared_lanes: usize,
    pub target: String,
    pub export: String,
    pub size_bytes: u64,
    pub verify: bool,
    pub batching: String,
    /// Hybrid polling of the lanes (and the in-process target): off, hybrid:US or adaptive:US.
    pub poll: String,
}

/// Hybrid polling's waits: how many a spin caught (no wake-up), how many spun in vain, began
/// with a timed sleep, or slept at once because spinning was not paying; time spun per wait.
#[derive(Debug, Serialize)]
pub struct PollReport {
    pub waits: u64,
    pub caught: u64,
    pub missed: u64,
    pub timed_sleeps: u64,
    pub held_off: u64,
    pub spin_us_per_wait: f64,
}

impl PollReport {
    fn of(s: &WaitStats) -> PollReport {
        PollReport {
            waits: s.waits,
            caught: s.caught,
            missed: s.missed,
            timed_sleeps: s.timed_sleeps,
            held_off: s.held_off,
            spin_us_per_wait: per(s.spun_ns as f64 / 1e3, s.waits),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Latency {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

#[derive(Debug, Serialize)]
pub struct Summary {
    #[serde(flatten)]
    pub setup: Setup,
    pub duration_s: f64,
    pub ios: u64,
    pub iops: f64,
    pub bytes_per_s: f64,
    pub lat_us: Latency,
    pub client_cpu_us_per_io: f64,
    pub server_cpu_us_per_io: f64,
    pub total_cpu_us_per_io: f64,
    pub client_cpu_user_us: u64,
    pub client_cpu_sys_us: u64,
    pub server_cpu_user_us: u64,
    pub server_cpu_sys_us: u64,
    pub client_ctx_switches_per_io: f64,
    pub server_ctx_switches_per_io: f64,
    pub client_caravans: u64,
    pub client_reqs_per_caravan: f64,
    /// Caravans sent by the client by size: at most 1, 2, 4, ... 64 requests, then more.
    pub client_caravan_hist: [u64; 8],
    /// Batch level at the end of the run, per lane.
    pub batch_level_final: Vec<u32>,
    /// The first lane's adaptive decisions, one per interval: the level and delay chosen, and
    /// what the interval that just ended measured.
    pub batch_level_log: Vec<LevelPoint>,
    /// How the lanes' waits for the target went under hybrid polling (whole run).
    pub client_poll: PollReport,
    /// The same for the target's workers over the timed phase (all zero when they do not poll).
    pub server_poll: PollReport,
    /// Over raw Ethernet, what reliable delivery did on the lanes over the whole run: datagrams
    /// and the repairs (retransmissions, duplicates and corrupt datagrams dropped); `null` over
    /// TCP and Unix sockets.
    pub client_link: Option<initiator::LinkStats>,
    /// Where the time goes, in µs per I/O (Tyche Table II's stages, as far as they are ours).
    pub stages_us: Stages,
    /// Share of read data the lanes received straight into the callers' buffers (direct
    /// placement); the rest was copied from their frame buffers. `None` without reads.
    pub read_placed_share: Option<f64>,
    pub server_caravans_received: u64,
    pub server_reqs_per_caravan: f64,
    pub server_caravans_sent: u64,
    /// Connections the lanes lost and restored (or gave up on) during the timed phase, and
    /// the attempts it took.
    pub reconnects: u64,
    pub reconnect_attempts: u64,
    /// With --direct-reads: reads served from capabilities, direct reads the target refused
    /// (stale or bad), the ordinary reads issued in their place, and capabilities received.
    pub direct_reads: u64,
    /// Writes under extents with the write right (flash volumes, RAM exports).
    pub direct_writes: u64,
    pub direct_faults: u64,
    pub fallbacks: u64,
    pub capabilities_received: u64,
    pub io_errors: u64,
    pub first_io_error: Option<String>,
    pub verify_errors: u64,
    pub first_verify_error: Option<String>,
}

/// Time in each stage, in µs per I/O: wall time inside the calls, summed over threads and
/// divided by the I/Os. At QD 1 with one thread the stages lie along each I/O's path and
/// `elsewhere` is the mean latency minus their sum: the wake-ups of a sleeping thread on each
/// side, scheduling. On loopback a send call runs the receiver's network path and wakes it, so
/// the woken side's stages can overlap the sender's call; `elsewhere` then comes out negative,
/// and says that the stages overlapped rather than that time went missing. At higher depths
/// they are amortised costs, and `elsewhere` is not given.
#[derive(Debug, Serialize)]
pub struct Stages {
    pub client_send: f64,
    pub target_recv: f64,
    pub target_exec: f64,
    pub target_send: f64,
    pub client_recv: f64,
    pub client_complete: f64,
    pub elsewhere: Option<f64>,
}

fn delta(before: &StatsReply, after: &StatsReply, name: &str) -> u64 {
    after.get(name).unwrap_or(0).saturating_sub(before.get(name).unwrap_or(0))
}

fn per(n: f64, ios: u64) -> f64 {
    if ios == 0 {
        0.0
    } else {
        n / ios as f64
    }
}

/// What the lanes did over the timed phase.
pub struct Telemetry {
    pub lanes: LaneStats,
    pub batch_levels: Vec<u32>,
    pub batch_level_log: Vec<initiator::BatchDecision>,
    pub poll: WaitStats,
    /// Reliable delivery over raw Ethernet, summed over the lanes (`None` over sockets).
    pub link: Option<initiator::LinkStats>,
}

impl Telemetry {
    /// Each thread had its own lane, and measured it.
    pub fn of_private_lanes(results: &[ThreadResult]) -> Telemetry {
        let mut lanes = LaneStats::default();
        for r in results {
            lanes.add(&r.lane);
        }
        Telemetry {
            lanes,
            batch_levels: results.iter().map(|r| r.batch_level).collect(),
            batch_level_log: results.first().map(|r| r.batch_level_log.clone()).unwrap_or_default(),
            poll: results.iter().fold(WaitStats::default(), |mut all, r| {
                all.add(&r.poll);
                all
            }),
            link: results.iter().filter_map(|r| r.link.as_ref()).fold(None, |all, l| {
                let mut all: initiator::LinkStats = all.unwrap_or_default();
                all.add(l);
                Some(all)
            }),
        }
    }
}

pub fn summarize(
    setup: Setup,
    results: &[ThreadResult],
    telemetry: &Telemetry,
    elapsed: Duration,
    before: &StatsReply,
    after: &StatsReply,
) -> Summary {
    let mut hist: Histogram<u64> = Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("static bounds");
    let mut usage = rt::usage::Usage::default();
    let (mut ios, mut bytes, mut io_errors, mut verify_errors) = (0, 0, 0, 0);
    for r in results {
        let _ = hist.add(&r.latency_ns);
        usage.add(&r.usage);
        ios += r.ios;
        bytes += r.bytes;
        io_errors += r.io_errors;
        verify_errors += r.verify_errors;
    }
    let secs = elapsed.as_secs_f64();
    let us = |ns: u64| ns as f64 / 1000.0;
    let server_cpu_ns = match delta(before, after, "cpu_ns") {
        0 => (delta(before, after, "cpu_user_us") + delta(before, after, "cpu_sys_us")) * 1000,
        ns => ns,
    };
    let client_cpu_us = (usage.user_us + usage.sys_us) as f64;
    let server_cpu_us = server_cpu_ns as f64 / 1000.0;
    let server_ctx =
        delta(before, after, "ctx_switches_voluntary") + delta(before, after, "ctx_switches_involuntary");
    let received = delta(before, after, "caravans_received");
    let per_io_us = |ns: u64| per(ns as f64 / 1000.0, ios);
    let mut stages = Stages {
        client_send: per_io_us(telemetry.lanes.send_ns),
        target_recv: per_io_us(delta(before, after, "stage_recv_ns")),
        target_exec: per_io_us(delta(before, after, "stage_exec_ns")),
        target_send: per_io_us(delta(before, after, "stage_send_ns")),
        client_recv: per_io_us(telemetry.lanes.recv_ns),
        client_complete: per_io_us(telemetry.lanes.complete_ns),
        elsewhere: None,
    };
    if setup.qd == 1 && setup.threads == 1 {
        let counted = stages.client_send
            + stages.target_recv
            + stages.target_exec
            + stages.target_send
            + stages.client_recv
            + stages.client_complete;
        stages.elsewhere = Some(hist.mean() / 1000.0 - counted);
    }
    Summary {
        setup,
        duration_s: secs,
        ios,
        iops: ios as f64 / secs,
        bytes_per_s: bytes as f64 / secs,
        lat_us: Latency {
            mean: hist.mean() / 1000.0,
            p50: us(hist.value_at_quantile(0.50)),
            p99: us(hist.value_at_quantile(0.99)),
            p999: us(hist.value_at_quantile(0.999)),
            max: us(hist.max()),
        },
        client_cpu_us_per_io: per(client_cpu_us, ios),
        server_cpu_us_per_io: per(server_cpu_us, ios),
        total_cpu_us_per_io: per(client_cpu_us + server_cpu_us, ios),
        client_cpu_user_us: usage.user_us,
        client_cpu_sys_us: usage.sys_us,
        server_cpu_user_us: delta(before, after, "cpu_user_us"),
        server_cpu_sys_us: delta(before, after, "cpu_sys_us"),
        client_ctx_switches_per_io: per(usage.ctx_switches() as f64, ios),
        server_ctx_switches_per_io: per(server_ctx as f64, ios),
        client_caravans: telemetry.lanes.caravans_sent,
        client_reqs_per_caravan: per(telemetry.lanes.submitted as f64, telemetry.lanes.caravans_sent),
        client_caravan_hist: telemetry.lanes.caravan_hist,
        batch_level_final: telemetry.batch_levels.clone(),
        batch_level_log: telemetry.batch_level_log.iter().map(LevelPoint::from).collect(),
        client_poll: PollReport::of(&telemetry.poll),
        client_link: telemetry.link.clone(),
        server_poll: PollReport::of(&WaitStats {
            waits: delta(before, after, "poll_waits"),
            caught: delta(before, after, "poll_caught"),
            missed: delta(before, after, "poll_missed"),
            timed_sleeps: delta(before, after, "poll_timed_sleeps"),
            held_off: delta(before, after, "poll_held_off"),
            spun_ns: delta(before, after, "poll_spin_ns"),
        }),
        stages_us: stages,
        read_placed_share: {
            // Data messages are placed by tag and offset as they arrive: placed too.
            let l = &telemetry.lanes;
            let (placed, copied) = (l.read_bytes_placed + l.read_bytes_in_messages, l.read_bytes_copied);
            (placed + copied > 0).then(|| placed as f64 / (placed + copied) as f64)
        },
        server_caravans_received: received,
        server_reqs_per_caravan: per(delta(before, after, "caravan_reqs_total") as f64, received),
        server_caravans_sent: delta(before, after, "caravans_sent"),
        reconnects: telemetry.lanes.reconnects,
        reconnect_attempts: telemetry.lanes.reconnect_attempts,
        direct_reads: telemetry.lanes.direct_reads,
        direct_writes: telemetry.lanes.direct_writes,
        direct_faults: telemetry.lanes.direct_faults,
        fallbacks: telemetry.lanes.fallbacks,
        capabilities_received: telemetry.lanes.capabilities_received,
        io_errors,
        first_io_error: results.iter().find_map(|r| r.first_error).map(|s| s.to_string()),
        verify_errors,
        first_verify_error: results.iter().find_map(|r| r.verify_first.clone()),
    }
}

pub fn print_table(s: &Summary) {
    let st = &s.setup;
    println!(
        "skiff bench: {:?} bs={} qd={} threads={}{} batching={} over {:.1}s, target {} export {:?}{}",
        st.rw,
        st.bs,
        st.qd,
        st.threads,
        match st.shared_lanes {
            0 => String::new(),
            n => format!(" on {n} shared lanes"),
        },
        st.batching,
        s.duration_s,
        st.target,
        st.export,
        if st.verify { ", verified" } else { "" }
    );
    let rows: Vec<(&str, String)> = vec![
        ("IOPS", grouped(s.iops as u64)),
        ("bandwidth", format!("{}/s", human_bytes(s.bytes_per_s))),
        ("I/Os", grouped(s.ios)),
        (
            "latency µs",
            format!(
                "mean {:.1}  p50 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}",
                s.lat_us.mean, s.lat_us.p50, s.lat_us.p99, s.lat_us.p999, s.lat_us.max
            ),
        ),
        (
            "CPU µs/I/O",
            format!(
                "client {:.2}  server {:.2}  total {:.2}",
                s.client_cpu_us_per_io, s.server_cpu_us_per_io, s.total_cpu_us_per_io
            ),
        ),
        (
            "ctx sw/I/O",
            format!("client {:.3}  server {:.3}", s.client_ctx_switches_per_io, s.server_ctx_switches_per_io),
        ),
        (
            "caravans",
            format!(
                "client sent {} ({:.1} req each)  server received {} ({:.1} req each), sent {}",
                grouped(s.client_caravans),
                s.client_reqs_per_caravan,
                grouped(s.server_caravans_received),
                s.server_reqs_per_caravan,
                grouped(s.server_caravans_sent)
            ),
        ),
        (
            "stages µs/I/O",
            format!(
                "client send {:.2}  target recv {:.2}  exec {:.2}  send {:.2}  client recv {:.2}  complete {:.2}{}",
                s.stages_us.client_send,
                s.stages_us.target_recv,
                s.stages_us.target_exec,
                s.stages_us.target_send,
                s.stages_us.client_recv,
                s.stages_us.client_complete,
                s.stages_us.elsewhere.map(|e| format!("  elsewhere {e:.2}")).unwrap_or_default()
            ),
        ),
        (
            "read data",
            s.read_placed_share
                .map(|p| format!("{:.0}% placed directly in callers' buffers, the rest copied", p * 100.0))
                .unwrap_or_else(|| "none".into()),
        ),
        (
            "reconnects",
            format!("{} ({} attempts)", s.reconnects, s.reconnect_attempts),
        ),
        (
            "raw Ethernet",
            s.client_link
                .as_ref()
                .map(|l| {
                    let mut line = format!(
                        "{}, payloads of up to {} bytes, checksummed {}: {} datagrams sent, {} received; retransmitted {} on timeout, {} on gaps; {} duplicates, {} corrupt dropped; {} DSACKs, reordering window {} µs; {:.0}% of received stream bytes placed from the ring; {} data messages received, {} of them held for a reader",
                        l.paths.first().map_or("?", |p| p.driver),
                        grouped(l.datagram_payload_max),
                        if l.payload_crc { "whole" } else { "in the header only" },
                        grouped(l.datagrams_sent),
                        grouped(l.datagrams_received),
                        grouped(l.retransmitted_timeout),
                        grouped(l.retransmitted_gap),
                        grouped(l.duplicates),
                        grouped(l.corrupt),
                        grouped(l.dsacks_received),
                        l.reorder_window_us,
                        100.0 * l.stream_bytes_placed as f64 / l.stream_bytes_read.max(1) as f64,
                        grouped(l.data_messages_received),
                        grouped(l.data_messages_held)
                    );
                    if l.paths.len() > 1 {
                        for p in &l.paths {
                            line.push_str(&format!(
                                "; {}: {} sent, {} received, probe RTT {} µs, {} down{}",
                                p.iface,
                                grouped(p.datagrams_sent),
                                grouped(p.datagrams_received),
                                p.srtt_us,
                                p.downs,
                                if p.up { "" } else { " (down now)" }
                            ));
                        }
                    }
                    line
                })
                .unwrap_or_else(|| "no (a socket: the kernel delivers reliably)".into()),
        ),
        (
            "direct reads",
            format!(
                "{} served, {} writes, {} faults, {} fallbacks, {} capabilities received",
                grouped(s.direct_reads),
                grouped(s.direct_writes),
                grouped(s.direct_faults),
                grouped(s.fallbacks),
                grouped(s.capabilities_received)
            ),
        ),
        (
            "I/O errors",
            format!(
                "{}{}",
                s.io_errors,
                s.first_io_error.as_deref().map(|e| format!(" (first: {e})")).unwrap_or_default()
            ),
        ),
        (
            "verify errors",
            if st.verify {
                format!(
                    "{}{}",
                    s.verify_errors,
                    s.first_verify_error.as_deref().map(|e| format!(" (first: {e})")).unwrap_or_default()
                )
            } else {
                "not verified (use --verify)".into()
            },
        ),
    ];
    for (k, v) in rows {
        println!("  {k:<14} {v}");
    }
}

/// One adaptive decision, as `--json` reports it.
#[derive(Debug, Clone, Serialize)]
pub struct LevelPoint {
    /// Milliseconds since the lane opened.
    pub ms: u64,
    pub level: u32,
    pub delay_us: u64,
    /// Payload throughput of the interval that just ended.
    pub mb_per_s: f64,
    /// Requests outstanding on the lane, on average over that interval.
    pub a_out: f64,
}

impl From<&initiator::BatchDecision> for LevelPoint {
    fn from(d: &initiator::BatchDecision) -> LevelPoint {
        LevelPoint {
            ms: d.at_us / 1000,
            level: d.level,
            delay_us: d.delay_us,
            mb_per_s: d.bytes_per_s / 1e6,
            a_out: d.a_out,
        }
    }
}
