//! `skiff attach`: flags in, [`attach::Attachment`] out; the library does the rest.

use std::path::PathBuf;
use std::process::ExitCode;

use attach::{AttachConfig, Attachment};
use clap::Args;
use initiator::{BatchConfig, Batching, Doorbell, Endpoint};

use crate::bench::{parse_batching, BatchingArg};
use crate::CliResult;

#[derive(Args)]
pub struct AttachArgs {
    /// Target address: HOST:PORT or unix:PATH.
    #[arg(long)]
    target: String,
    /// The export to attach.
    #[arg(long)]
    export: String,
    /// A directory (the export appears in it as a file named after the export) or an existing
    /// regular file (the export is mounted over it, and the path itself is the export).
    mountpoint: PathBuf,
    /// FUSE threads serving the kernel's requests.
    #[arg(long, default_value_t = attach::THREADS_DEFAULT)]
    threads: usize,
    /// Lanes, each with an I/O thread that owns it (default: one per core).
    #[arg(long, default_value_t = 0)]
    lanes: usize,
    /// Requests the kernel may have in flight at once (FUSE's max_background).
    #[arg(long, default_value_t = attach::IN_FLIGHT_DEFAULT)]
    in_flight: usize,
    /// Caravans: drain (the default: what an I/O thread found queued leaves together, at once),
    /// adaptive (the Tyche controller caps them), static:N (at most N), static (at most the
    /// doorbell's default 16) or off (one request each).
    #[arg(long, default_value = "drain", value_parser = parse_attach_batching)]
    // Spelled in full so clap takes the parser's `Option` as the value, not as "optional".
    batching: std::option::Option<BatchingArg>,
    /// Refuse writes even when the export takes them.
    #[arg(long)]
    read_only: bool,
    /// Scheduling policy of the FUSE and I/O threads: batch (the default: a thread woken while
    /// the CPU is busy waits for the running task instead of preempting it, and finds a batch)
    /// or normal (it preempts: lower latency under CPU contention, more context switches).
    #[arg(long, default_value = "batch", value_parser = ["batch", "normal"])]
    sched: String,
    #[command(flatten)]
    reconnect: crate::reconnect::ReconnectArgs,
    #[command(flatten)]
    keys: crate::keys::KeyArgs,
    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

pub fn run(args: AttachArgs) -> CliResult {
    let mut config = AttachConfig::new(Endpoint::parse(&args.target)?, &args.export, args.mountpoint);
    config.threads = args.threads.max(1);
    config.lanes = args.lanes;
    config.in_flight = args.in_flight.max(1);
    config.read_only = args.read_only;
    config.sched_batch = args.sched == "batch";
    // A target restart costs the file system time, not errors: the lanes reconnect and
    // re-send what was in flight (docs/ATTACH.md).
    config.lane.reconnect = args.reconnect.config();
    config.lane.key = args.keys.key()?;
    config.lane.tls = args.tls.config()?;
    // The I/O threads send what they have taken whenever their queue is empty, so a doorbell
    // only splits caravans; its delay never holds a request back.
    let doorbell = Doorbell { delay_us: 1, ..Doorbell::default() };
    (config.lane.batching, config.lane.doorbell) = match args.batching {
        None => (Batching::Static, attach::DRAIN_DOORBELL),
        Some(BatchingArg::Off) => (Batching::Off, doorbell),
        Some(BatchingArg::Static(n)) => (
            Batching::Static,
            Doorbell { aggregation_reqs: n.unwrap_or(doorbell.aggregation_reqs).max(1), ..doorbell },
        ),
        Some(BatchingArg::Adaptive) => (Batching::Adaptive(BatchConfig::default()), doorbell),
    };
    // Before any thread starts, so that every thread inherits the blocked mask and only the
    // waiter below takes SIGINT and SIGTERM.
    rt::signals::block_termination()?;
    let attachment = Attachment::mount(&config)?;
    println!("{}", attachment.file().display());
    let unmounter = attachment.unmounter();
    std::thread::Builder::new().name("signals".into()).spawn(move || loop {
        let Ok(sig) = rt::signals::wait_termination() else { return };
        tracing::info!(signal = sig, "unmounting");
        match unmounter.unmount() {
            Ok(()) => return,
            // Still in use: keep serving whoever uses it; the next signal tries again.
            Err(e) => tracing::error!("{e}"),
        }
    })?;
    let stats = attachment.wait()?;
    tracing::info!(requests = stats.completed, caravans = stats.caravans_sent, "detached");
    Ok(ExitCode::SUCCESS)
}

/// `--batching`: `drain` (`None`), or what `skiff bench` takes.
fn parse_attach_batching(s: &str) -> Result<Option<BatchingArg>, crate::units::ArgError> {
    match s {
        "drain" => Ok(None),
        _ => parse_batching(s).map(Some),
    }
}
