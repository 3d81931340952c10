//! `skiff serve`.

use std::process::ExitCode;

use clap::Args;
use initiator::Endpoint;
use server::{ExportConfig, Target, TargetConfig};

use crate::CliResult;

#[derive(Args)]
pub struct ServeArgs {
    /// TCP address to listen on (native protocol).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: String,
    /// Also (or instead, with --no-tcp) listen on this Unix socket path.
    #[arg(long)]
    unix: Option<std::path::PathBuf>,
    /// Do not listen for the native protocol on TCP (use with --unix or --nbd).
    #[arg(long)]
    no_tcp: bool,
    /// Serve NBD clients on this TCP address (NBD's port is 10809). Repeatable.
    #[arg(long, value_name = "ADDR")]
    nbd: Vec<String>,
    /// Serve NBD clients on this Unix socket path.
    #[arg(long, value_name = "PATH")]
    nbd_unix: Option<std::path::PathBuf>,
    /// An export: NAME=SPEC[,ro], SPEC being ram:SIZE, file:PATH or null:SIZE; `,ro` makes
    /// that export read-only. Repeatable.
    #[arg(long = "export", value_name = "NAME=SPEC", required = true)]
    exports: Vec<ExportConfig>,
    /// Serve every export read-only.
    #[arg(long)]
    read_only: bool,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    workers: usize,
    /// Largest queue depth a lane may negotiate.
    #[arg(long, default_value_t = wire::Limits::default().queue_depth)]
    queue_depth: u32,
    /// Hybrid polling: off, hybrid (spin 50 us before sleeping) or hybrid:US. Lowers latency
    /// at low queue depth; a worker spins on a core while it waits.
    #[arg(long, default_value = "off", value_parser = crate::units::parse_poll)]
    poll: std::time::Duration,
    /// Largest single I/O in bytes (e.g. 1M).
    #[arg(long, value_parser = crate::units::parse_size, default_value = "1M")]
    io_max: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9470); see
    /// docs/METRICS.md.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
}

pub fn run(args: ServeArgs) -> CliResult {
    let mut listen = Vec::new();
    if !args.no_tcp {
        listen.push(Endpoint::parse(&args.listen)?);
    }
    if let Some(path) = args.unix {
        listen.push(Endpoint::Unix(path));
    }
    let mut nbd_listen = args.nbd.iter().map(|a| Endpoint::parse(a)).collect::<Result<Vec<_>, _>>()?;
    if let Some(path) = args.nbd_unix {
        nbd_listen.push(Endpoint::Unix(path));
    }
    if listen.is_empty() && nbd_listen.is_empty() {
        return Err("nothing to listen on: --no-tcp needs --unix, --nbd or --nbd-unix".into());
    }
    let io_bytes_max = u32::try_from(args.io_max).map_err(|_| "--io-max must be below 4 GiB")?;
    let defaults = wire::Limits::default();
    let limits = wire::Limits {
        queue_depth: args.queue_depth.max(1),
        io_bytes_max,
        caravan_bytes_max: defaults.caravan_bytes_max.max(io_bytes_max),
        ..defaults
    };
    let config = TargetConfig {
        listen,
        nbd_listen,
        exports: args.exports,
        read_only: args.read_only,
        workers: args.workers,
        bounds: server::Bounds { limits, ..server::Bounds::default() },
        poll_spin: args.poll,
        metrics_listen: args.metrics,
    };
    // Before any thread starts, so that every thread inherits the blocked mask and the signal
    // is taken synchronously below.
    rt::signals::block_termination()?;
    let target = Target::start(config)?;
    let sig = rt::signals::wait_termination()?;
    tracing::info!(signal = sig, "shutting down");
    target.shutdown();
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}
