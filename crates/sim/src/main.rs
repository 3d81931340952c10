//! `skiff-sim`: run the deterministic simulation over many seeds.
//!
//! ```text
//! cargo run --release -p skiff-sim -- --seeds 1000                 # seeds 0..1000, all faults
//! cargo run --release -p skiff-sim -- --seed 4242 --faults net     # replay one seed
//! cargo run --release -p skiff-sim --features mutations -- --seeds 100 --planted swap-tags   # a planted bug caught
//! cargo run --release -p skiff-sim -- --seeds 1000 --link datagram --loss-ppm 50000   # raw Ethernet
//! ```
//!
//! Planted bugs (`--planted`, `--planted-stale-cache`) exist only in a build with the feature
//! `mutations`, so that no product binary carries them.
//!
//! Every failing seed is printed with the command that replays it; the last line is
//! `N seeds, M failed`, and the exit status is 1 when M > 0.

use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use skiff_sim::datagram::LinkFaults;
use skiff_sim::disk::DiskFaults;
use skiff_sim::faults::NetFaults;
use skiff_sim::{run, LinkKind, Options, Planted, Report};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Faults {
    All,
    None,
    Net,
    Disk,
}

/// The connection between the two sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Link {
    /// A byte pipe (TCP), with short I/O, would-block bursts, delays, resets and header flips.
    Pipe,
    /// A datagram link (raw Ethernet) under the reliable streams of `dgram::reliable`, with
    /// loss, duplication, reordering, corruption anywhere, flaps and resets.
    Datagram,
}

#[derive(Debug, Parser)]
#[command(about = "Deterministic simulation of a skiff initiator and target with faults")]
struct Args {
    /// Run seeds `first..first+N`.
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// The first seed of the range (with --seeds), or the one seed to replay (alone).
    #[arg(long)]
    seed: Option<u64>,
    /// Which faults to inject.
    #[arg(long, value_enum, default_value_t = Faults::All)]
    faults: Faults,
    /// Requests each run issues.
    #[arg(long, default_value_t = 300)]
    ops: usize,
    /// Plant a known bug (the simulation must catch it).
    #[arg(long, value_enum, default_value_t = Planted::None)]
    planted: Planted,
    /// The link between initiator and target.
    #[arg(long, value_enum, default_value_t = Link::Pipe)]
    link: Link,
    /// With `--link datagram` and network faults: datagrams lost, per million.
    #[arg(long, default_value_t = 50_000)]
    loss_ppm: u32,
    /// Print a line for every seed, not only failures.
    #[arg(long)]
    verbose: bool,
    /// Run the direct-read simulation instead (two initiators, capabilities, a block cache,
    /// key rotations and invalidations; docs/SIMULATION.md). With --planted-stale-cache, writes
    /// do not invalidate the cache, which it must catch.
    #[arg(long)]
    direct_reads: bool,
    #[arg(long, requires = "direct_reads")]
    planted_stale_cache: bool,
}

/// `--direct-reads`: the seeds of [`skiff_sim::direct`].
fn direct_reads(args: &Args, seeds: std::ops::Range<u64>) -> ExitCode {
    use skiff_sim::direct;
    if args.planted_stale_cache && !skiff_sim::PLANTED_BUGS {
        eprintln!("skiff-sim: --planted-stale-cache: {}", skiff_sim::NO_PLANTED_BUGS);
        return ExitCode::from(2);
    }
    let count = seeds.end - seeds.start;
    let (mut failed, mut total) = (0u64, direct::Report::default());
    for seed in seeds {
        match direct::run(&direct::Options { seed, ops: args.ops, stale_cache: args.planted_stale_cache }) {
            Ok(r) => total.add(&r),
            Err(e) => {
                failed += 1;
                println!("seed {seed} failed: {e}");
                println!(
                    "  replay: cargo run --release -p skiff-sim{} -- --direct-reads --seed {seed} --ops {}{}",
                    if args.planted_stale_cache { " --features mutations" } else { "" },
                    args.ops,
                    if args.planted_stale_cache { " --planted-stale-cache" } else { "" }
                );
            }
        }
    }
    println!(
        "direct reads: {} requests, {} reads checked, {} served directly, {} faults (each fell back), {} key \
         rotations, {} invalidations, {} cache evictions; {} of {count} seeds behind a block cache; {} on a \
         flash volume ({} direct reads and {} direct writes under extents, {} snapshots, {} GC steps, {} checkpoints)",
        total.ops,
        total.reads_checked,
        total.direct_reads,
        total.direct_faults,
        total.rotations,
        total.invalidations,
        total.cache_evictions,
        total.cache_runs,
        total.flash_runs,
        total.flash_direct_reads,
        total.direct_writes,
        total.snapshots,
        total.gc_steps,
        total.checkpoints
    );
    println!("{count} seeds, {failed} failed");
    if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let (net, disk) = match args.faults {
        Faults::All => (NetFaults::typical(), DiskFaults::typical()),
        Faults::None => (NetFaults::NONE, DiskFaults::NONE),
        Faults::Net => (NetFaults::typical(), DiskFaults::NONE),
        Faults::Disk => (NetFaults::NONE, DiskFaults::typical()),
    };
    let seeds = match (args.seed, std::env::args().any(|a| a == "--seeds")) {
        (Some(s), false) => s..s + 1,
        (Some(s), true) => s..s + args.seeds,
        (None, _) => 0..args.seeds,
    };
    if args.direct_reads {
        return direct_reads(&args, seeds);
    }
    let link = match (args.link, net == NetFaults::NONE) {
        (Link::Pipe, _) => LinkKind::Pipe,
        (Link::Datagram, true) => LinkKind::Datagram(LinkFaults::NONE),
        (Link::Datagram, false) => LinkKind::Datagram(LinkFaults::with_loss(args.loss_ppm)),
    };
    let count = seeds.end - seeds.start;
    let started = Instant::now();
    let mut last_progress = Instant::now();
    let mut failed = 0u64;
    let mut total = Report::default();
    for (i, seed) in seeds.enumerate() {
        let opts = Options { seed, ops: args.ops, net, disk, planted: args.planted, link };
        match run(&opts) {
            Ok(r) => {
                if args.verbose {
                    println!(
                        "seed {seed}: ok, {} requests ok, {} failed, {} connections, {} µs virtual",
                        r.ops_ok, r.ops_failed, r.connections, r.virtual_us
                    );
                }
                total.add(&r);
            }
            Err(f) => {
                failed += 1;
                println!("{f}");
                println!(
                    "  replay: cargo run --release -p skiff-sim{} -- --seed {seed} --faults {} --ops {}{}{}",
                    if args.planted == Planted::None { "" } else { " --features mutations" },
                    args.faults.to_possible_value().expect("named").get_name(),
                    args.ops,
                    if args.planted == Planted::None {
                        String::new()
                    } else {
                        format!(" --planted {}", args.planted.to_possible_value().expect("named").get_name())
                    },
                    match args.link {
                        Link::Pipe => String::new(),
                        Link::Datagram => format!(" --link datagram --loss-ppm {}", args.loss_ppm),
                    }
                );
            }
        }
        if last_progress.elapsed().as_secs() >= 5 {
            eprintln!(
                "skiff-sim: {}/{count} seeds, {failed} failed, {:.0} s",
                i + 1,
                started.elapsed().as_secs_f64()
            );
            last_progress = Instant::now();
        }
    }
    let [short, blocked, delayed, disconnects, flips] = total.net_faults;
    println!(
        "faults injected: {short} short I/Os, {blocked} would-block bursts, {delayed} delays, {disconnects} disconnects, \
         {flips} header bit flips ({} caught by a target), {} disk errors, {} requests parked for device work, \
         {} FLUSH/FUA replies held for durability ({} connections closed when it failed)",
        total.goaways, total.disk_errors, total.parks, total.syncs_later, total.sync_failures
    );
    println!(
        "reconnection: {} of {count} seeds resumed their session across connections, {} reattaches (every request \
         re-sent, none failed for a lost connection)",
        total.resuming_runs, total.reattaches
    );
    println!(
        "authentication: {} of {count} seeds proved a key on every connection",
        total.authenticated_runs
    );
    println!(
        "work done: {} requests ok, {} failed; {} connections; {} caravans sent ({:.1} requests each), {} completion \
         caravans; read data {} KiB placed directly, {} KiB copied",
        total.ops_ok,
        total.ops_failed,
        total.connections,
        total.caravans_sent,
        (total.ops_ok + total.ops_failed) as f64 / total.caravans_sent.max(1) as f64,
        total.completion_caravans,
        total.read_bytes_placed >> 10,
        total.read_bytes_copied >> 10
    );
    if args.link == Link::Datagram {
        let (l, st) = (total.link, total.streams);
        println!(
            "datagram link: {} datagrams sent, {} lost, {} duplicated, {} reordered, {} corrupted ({} caught by the \
             CRC), {} flaps ({} lost while down)",
            l.sent, l.lost, l.duplicated, l.reordered, l.corrupted, st.corrupt, l.flaps, l.lost_down
        );
        println!(
            "reliable streams: {} data datagrams, {} resent on gaps, {} on timeouts, {} duplicates and {} out of order \
             received, {} acks, {} probes; {} KiB delivered; {} data messages received ({} held for a reader), \
             {} KiB of read data in them",
            st.data_sent,
            st.retransmitted_gap,
            st.retransmitted_timeout,
            st.duplicates,
            st.out_of_order,
            st.acks_sent,
            st.probes,
            st.stream_bytes_read >> 10,
            st.places_received,
            st.places_held,
            total.read_bytes_in_messages >> 10
        );
    }
    println!("{count} seeds, {failed} failed");
    if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
