//! Command line of the probe: run the chosen modes interleaved, repeat, print a table or JSON.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use skiff_uring_probe::report::{self, ModeReport, Outcome};
use skiff_uring_probe::{check_available, run_mode, Mode, ProbeError, Stop, Workload};

/// Compare io_uring server loops with plain syscalls over loopback TCP, with skiff-shaped
/// caravans. Only the server side changes between modes; the client uses plain syscalls.
#[derive(Parser, Debug)]
#[command(name = "skiff-uring-probe", version)]
struct Args {
    /// Requests per caravan.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=4096))]
    caravan: u16,
    /// Caravans the client keeps in flight (1 = ping-pong).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=1024))]
    outstanding: u16,
    /// Bytes per read (a multiple of 8, at most 1 MiB).
    #[arg(long, default_value_t = 4096)]
    bs: usize,
    /// Seconds per run.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Modes to run, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Mode::ALL)]
    modes: Vec<Mode>,
    /// Runs per mode; modes are interleaved run by run.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=100))]
    repeat: u16,
    /// Print JSON instead of a Markdown table.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.bs == 0 || args.bs % 8 != 0 || args.bs > 1 << 20 {
        eprintln!("error: --bs must be a positive multiple of 8, at most 1048576");
        return ExitCode::from(2);
    }
    if !(args.seconds > 0.0 && args.seconds <= 600.0) {
        eprintln!("error: --seconds must be in (0, 600]");
        return ExitCode::from(2);
    }
    if let Err(e) = check_available() {
        eprintln!("error: io_uring is unusable here, so the probe cannot compare anything: {e}");
        return ExitCode::from(3);
    }
    let w = Workload { caravan: args.caravan as usize, outstanding: args.outstanding as usize, bs: args.bs };
    let stop = Stop::After(Duration::from_secs_f64(args.seconds));
    let mut reports: Vec<ModeReport> =
        args.modes.iter().map(|&mode| ModeReport { mode, outcome: Outcome::Measured(Vec::new()) }).collect();
    for round in 1..=args.repeat {
        for report in &mut reports {
            let Outcome::Measured(samples) = &mut report.outcome else {
                continue;
            };
            eprintln!("run {round}/{}: {}", args.repeat, report.mode.name());
            match run_mode(report.mode, &w, stop) {
                Ok(sample) => samples.push(sample),
                Err(ProbeError::Unavailable(why)) => {
                    eprintln!("  {} is not available: {why}", report.mode.name());
                    report.outcome = Outcome::Unavailable(why);
                }
                Err(e) => {
                    eprintln!("error: mode {} failed: {e}", report.mode.name());
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    let seconds = args.seconds;
    let repeat = args.repeat as usize;
    if args.json {
        println!("{:#}", report::json(&w, seconds, repeat, &reports));
    } else {
        print!("{}", report::markdown(&w, seconds, repeat, &reports));
    }
    ExitCode::SUCCESS
}
