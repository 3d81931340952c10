//! `skiff attach`: flags in, [`attach::Attachment`] out; the library does the rest.

use std::path::PathBuf;
use std::process::ExitCode;

use attach::{AttachConfig, Attachment};
use clap::Args;
use initiator::{BatchConfig, Batching, Endpoint};

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
    /// Shared lanes the threads' requests travel on (default: one per core).
    #[arg(long, default_value_t = 0)]
    lanes: usize,
    /// Caravans on the shared lanes: adaptive (the default), static, static:N or off.
    #[arg(long, default_value = "adaptive", value_parser = parse_batching)]
    batching: BatchingArg,
    /// Refuse writes even when the export takes them.
    #[arg(long)]
    read_only: bool,
    #[command(flatten)]
    reconnect: crate::reconnect::ReconnectArgs,
}

pub fn run(args: AttachArgs) -> CliResult {
    let mut config = AttachConfig::new(Endpoint::parse(&args.target)?, &args.export, args.mountpoint);
    config.threads = args.threads.max(1);
    config.lanes = args.lanes;
    config.read_only = args.read_only;
    // A target restart costs the file system time, not errors: the lanes reconnect and
    // re-send what was in flight (docs/ATTACH.md).
    config.lane.reconnect = args.reconnect.config();
    config.lane.batching = match args.batching {
        BatchingArg::Off => Batching::Off,
        BatchingArg::Static(n) => {
            if let Some(n) = n {
                config.lane.doorbell.aggregation_reqs = n.max(1);
            }
            Batching::Static
        }
        BatchingArg::Adaptive => Batching::Adaptive(BatchConfig::default()),
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
