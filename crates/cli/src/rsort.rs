//! `skiff rsort`: RSort on RStore namespaces (docs/RSTORE.md). The sort is `apps::rsort`; this
//! parses its arguments, starts its workers as `skiff rsort ... worker` processes, and prints
//! its reports.

use std::process::ExitCode;

use apps::rsort::{Report, Rsort};
use clap::{Args, Subcommand};
use coord::Scope;

use crate::CliResult;

#[derive(Args)]
pub struct RsortArgs {
    #[command(flatten)]
    coordinator: crate::ns::CoordinatorArg,
    /// The namespaces' common prefix.
    #[arg(long, default_value = "rsort", global = true)]
    name: String,
    /// ram, file (namespaces on the servers' files) or flash (on their flash volumes, `serve
    /// --pool flash:SIZE`: the thesis's flash variant, 7.4).
    #[arg(long, default_value = "ram", global = true)]
    scope: Scope,
    /// The namespaces' chunk size [default: the registered memory servers' --chunk].
    #[arg(long, value_parser = crate::units::parse_size, global = true)]
    chunk: Option<u64>,
    /// Print JSON.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Generate the input: --records records into <name>-in.
    Gen {
        #[arg(long)]
        records: u64,
        #[arg(long, default_value_t = 0x5eed)]
        seed: u64,
        /// Also write the records to this local file (for GNU sort and `local`).
        #[arg(long)]
        file: Option<std::path::PathBuf>,
    },
    /// Sort <name>-in into <name>-out with --workers processes.
    Sort {
        #[arg(long, default_value_t = 2)]
        workers: usize,
    },
    /// Check <name>-out: in order, and exactly the input's records.
    Check,
    /// Sort --records generated records in this process's memory (the single-process peer).
    Local {
        #[arg(long)]
        records: u64,
        #[arg(long, default_value_t = 0x5eed)]
        seed: u64,
    },
    /// One worker of `sort` (started by it).
    #[command(hide = true)]
    Worker {
        #[arg(long)]
        id: usize,
        #[arg(long)]
        workers: usize,
    },
}

pub fn run(args: RsortArgs) -> CliResult {
    let (coord, urls) = args.coordinator.connect()?;
    let rsort = Rsort {
        chunk_bytes: crate::ns::chunk_size(&coord, args.scope, args.chunk)?,
        coord,
        name: args.name.clone(),
        scope: args.scope,
    };
    let report = match args.action {
        Action::Gen { records, seed, ref file } => rsort.gen(records, seed, file.as_deref())?,
        Action::Sort { workers } => {
            let worker =
                |id, workers| args.coordinator.worker_command("rsort", &urls, &args.name, id, workers);
            // Checked once here, so that the closure the sort calls cannot fail.
            worker(0, 1)?;
            rsort.sort(workers, |id, workers| worker(id, workers).expect("the executable was found"))?
        }
        Action::Worker { id, workers } => {
            // JSON whatever --json says: the sort that started this worker reads it.
            println!("{}", rsort.worker(id, workers)?.json());
            return Ok(ExitCode::SUCCESS);
        }
        Action::Check => rsort.check()?,
        Action::Local { records, seed } => apps::rsort::local(records, seed),
    };
    print(args.json, &report);
    Ok(ExitCode::SUCCESS)
}

fn print(json: bool, report: &Report) {
    if json {
        println!("{}", report.json());
    } else {
        println!("{report}");
    }
}
