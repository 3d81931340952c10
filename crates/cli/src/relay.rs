//! `skiff relay`: a fault relay between two interfaces (eth::relay), for testing
//! reliable delivery over raw Ethernet on real frames: seeded drops, duplicates, reordering
//! and bit flips, counted per direction. Runs until SIGINT or SIGTERM, then prints its
//! counters as JSON on stdout; a progress line each second on stderr.
//!
//! It bridges skiff's EtherType only, unless `--every-ethertype`: then ARP and IP cross it
//! too, under the same faults, so TCP can be measured through the same relay as raw Ethernet
//! (the ends then need segmentation and checksum offloads off, `ethtool -K IFACE tso off gso
//! off gro off tx off`: a frame the relay reads must be a whole, checksummed frame of at most
//! the MTU).

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use clap::Args;
use eth::packet::{PacketSocket, RingConfig, ETHERTYPE, ETHERTYPE_ALL};
use relay::{DirectionCounters, FaultRates};

use crate::CliResult;

#[derive(Args)]
pub struct RelayArgs {
    /// One side's interface (frames from it go out on --right).
    #[arg(long, value_name = "IFACE")]
    left: String,
    /// The other side's interface.
    #[arg(long, value_name = "IFACE")]
    right: String,
    /// Share of frames dropped, 0 to 1 (e.g. 0.01 for 1%).
    #[arg(long, default_value_t = 0.0)]
    drop: f64,
    /// Share of frames sent twice.
    #[arg(long, default_value_t = 0.0)]
    duplicate: f64,
    /// Share of frames held back and sent after the next one (or after 200 µs if none comes).
    #[arg(long, default_value_t = 0.0)]
    reorder: f64,
    /// Share of frames with one payload bit flipped.
    #[arg(long, default_value_t = 0.0)]
    corrupt: f64,
    /// Seed of the fault decisions: the same seed and the same frames make the same faults.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Bridge frames of every EtherType (ARP and IP too, so TCP crosses the same faults), not
    /// only skiff's 0x88B5.
    #[arg(long)]
    every_ethertype: bool,
}

pub fn run(args: RelayArgs) -> CliResult {
    let rates = FaultRates {
        drop: args.drop,
        duplicate: args.duplicate,
        reorder: args.reorder,
        corrupt: args.corrupt,
    };
    rates.check()?;
    // Through the interfaces' queueing disciplines, so that a shaped link stays shaped.
    let config = RingConfig { qdisc_bypass: false, ..RingConfig::default() };
    let ethertype = if args.every_ethertype { ETHERTYPE_ALL } else { ETHERTYPE };
    let left =
        PacketSocket::open(&args.left, ethertype, config).map_err(|e| format!("{}: {e}", args.left))?;
    let right =
        PacketSocket::open(&args.right, ethertype, config).map_err(|e| format!("{}: {e}", args.right))?;
    rt::signals::block_termination()?;
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let seed = args.seed;
    let bridge = std::thread::Builder::new().name("skiff-relay".into()).spawn(move || {
        relay::run(left, right, rates, seed, &stop2, |lr, rl| {
            eprintln!("relay: left->right {}; right->left {}", line(lr), line(rl));
        })
    })?;
    tracing::info!(left = %args.left, right = %args.right, ?rates, seed, "relaying");
    rt::signals::wait_termination()?;
    stop.store(true, Ordering::Relaxed);
    let (lr, rl) = bridge.join().map_err(|_| "the relay thread panicked")??;
    let json = serde_json::json!({
        "left": args.left, "right": args.right, "seed": seed, "every_ethertype": args.every_ethertype,
        "rates": {"drop": rates.drop, "duplicate": rates.duplicate, "reorder": rates.reorder, "corrupt": rates.corrupt},
        "left_to_right": counters(&lr), "right_to_left": counters(&rl),
    });
    println!("{json}");
    Ok(ExitCode::SUCCESS)
}

fn line(c: &DirectionCounters) -> String {
    format!(
        "{} received, {} forwarded, {} dropped, {} duplicated, {} reordered, {} corrupted",
        c.received, c.forwarded, c.dropped, c.duplicated, c.reordered, c.corrupted
    )
}

fn counters(c: &DirectionCounters) -> serde_json::Value {
    serde_json::json!({
        "received": c.received, "forwarded": c.forwarded, "dropped": c.dropped, "duplicated": c.duplicated,
        "reordered": c.reordered, "corrupted": c.corrupted, "overflowed": c.overflowed, "oversized": c.oversized,
    })
}
