//! `skiff`: the command-line front door.
//!
//! - `skiff serve`: run a target in the foreground until SIGINT or SIGTERM.
//! - `skiff bench`: drive a target with lanes and report IOPS, latency and CPU per I/O; with no
//!   `--target`, it starts a target in-process on loopback with a 1 GiB RAM export.
//! - `skiff info`: list a target's exports and limits.
//! - `skiff attach`: an export as a file through FUSE, until SIGINT or SIGTERM unmounts it.
//! - `skiff relay`: a fault relay between two interfaces, for testing raw-Ethernet delivery.
//! - `skiff flash format`: a flash array on files or block devices, for `skiff serve --flash`.
//! - `skiff rsort`, `skiff carafe`: the applications on RStore, RSort and Carafe.
//! - `skiff vol`: create, resize, snapshot, clone, delete, list and measure a running target's
//!   flash volumes.
//!
//! Argument parsing and presentation live here; everything else is in the library crates.

mod attach;
mod bench;
mod carafe;
mod flash;
mod floor;
mod info;
mod keys;
mod ns;
mod reconnect;
mod register;
mod relay;
mod revoke;
mod rsort;
mod serve;
mod tls;
mod units;
mod vol;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "skiff", version, about = "CPU-efficient networked block storage for small I/O")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Export volumes over the network.
    Serve(serve::ServeArgs),
    /// Measure a target (or an in-process one) with lanes.
    Bench(bench::BenchArgs),
    /// List a target's exports and limits.
    Info(info::InfoArgs),
    /// Expose an export as one file through FUSE (for losetup), until SIGINT or SIGTERM.
    Attach(attach::AttachArgs),
    /// Revoke an export's capabilities for direct reads (all of them, or a range's).
    Revoke(revoke::RevokeArgs),
    /// Register a range of an export (a flash volume's extent, of any size) and time the round
    /// trip: the target seals a reference without reading, allocating or pinning anything.
    Register(register::RegisterArgs),
    /// Bridge two interfaces, dropping, duplicating, reordering and corrupting raw-Ethernet
    /// frames at seeded rates (a fault relay for tests), until SIGINT or SIGTERM.
    Relay(relay::RelayArgs),
    /// RStore namespaces on the coordinator (etcd): create, reserve, alloc, list, delete.
    Ns(ns::NsArgs),
    /// RSort: generate TeraSort records into an RStore namespace, sort them with worker
    /// processes in two phases, check the result.
    Rsort(rsort::RsortArgs),
    /// Carafe: graphs in RStore namespaces (generated or imported), explored online and run
    /// through a Pregel engine with partition worker processes (PageRank, SSSP).
    Carafe(carafe::CarafeArgs),
    /// Flash arrays: format files or block devices as one, for `skiff serve --flash`.
    Flash(flash::FlashArgs),
    /// A running target's flash volumes: create, resize, snapshot, clone, delete, list, stats.
    Vol(vol::VolArgs),
    /// Measure what this machine charges for the primitives of an I/O (a 4 KiB copy, a system
    /// call, a cross-core cache-line transfer and wake-up): the floor beside skiff's CPU per I/O.
    Floor(floor::FloorArgs),
}

fn init_logging(default: &str) {
    // libnbd (through GnuTLS) sends an IP address as SNI when it connects by address, which
    // rustls notes at WARN on every such connection; by default only its errors are shown.
    let filter = tracing_subscriber::EnvFilter::try_from_env("SKIFF_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("{default},rustls=error")));
    // Colour only for a person at a terminal; logs captured by files or tools stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).init();
}

fn main() -> ExitCode {
    // Kept beside the parsed arguments: `skiff serve --config` needs to know which flags were
    // given on the command line, so that those override the file.
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let result = match cli.command {
        Command::Serve(args) => {
            init_logging("info");
            let serve = matches.subcommand_matches("serve").expect("clap parsed a serve command");
            serve::run(args, serve)
        }
        Command::Bench(args) => {
            init_logging("warn");
            bench::run(args)
        }
        Command::Info(args) => {
            init_logging("warn");
            info::run(args)
        }
        Command::Attach(args) => {
            init_logging("info");
            attach::run(args)
        }
        Command::Revoke(args) => {
            init_logging("warn");
            revoke::run(args)
        }
        Command::Register(args) => {
            init_logging("warn");
            register::run(args)
        }
        Command::Relay(args) => {
            init_logging("info");
            relay::run(args)
        }
        Command::Ns(args) => {
            init_logging("warn");
            ns::run(args)
        }
        Command::Rsort(args) => {
            init_logging("warn");
            rsort::run(args)
        }
        Command::Carafe(args) => {
            init_logging("warn");
            carafe::run(args)
        }
        Command::Flash(args) => {
            init_logging("warn");
            flash::run(args)
        }
        Command::Floor(args) => {
            init_logging("warn");
            floor::run(args)
        }
        Command::Vol(args) => {
            init_logging("warn");
            vol::run(args)
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("skiff: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Errors surfaced to the user, each with enough context to act on.
pub type CliResult = Result<ExitCode, Box<dyn std::error::Error>>;
