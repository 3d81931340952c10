//! `skiff carafe`: Carafe, graph processing on RStore namespaces (docs/RSTORE.md). The engine
//! is `apps::carafe`; this parses its arguments, starts its partition workers as `skiff carafe
//! ... worker` processes, shows each superstep as it ends, and prints the reports.

use std::io::Write;
use std::process::{Command, ExitCode};

use apps::carafe::build::GenSpec;
use apps::carafe::pregel::{Launch, Program, StepStats};
use apps::carafe::{Carafe, Report, Walk};
use clap::{Args, Subcommand};
use coord::Scope;

use crate::CliResult;

#[derive(Args)]
pub struct CarafeArgs {
    #[command(flatten)]
    coordinator: crate::ns::CoordinatorArg,
    /// The graph's name: its namespaces' common prefix.
    #[arg(long, default_value = "graph", global = true)]
    name: String,
    /// ram, file (the namespaces on the servers' files) or flash (on their flash volumes).
    #[arg(long, default_value = "ram", global = true)]
    scope: Scope,
    /// The namespaces' chunk size [default: the registered memory servers' --chunk].
    #[arg(long, value_parser = crate::units::parse_size, global = true)]
    chunk: Option<u64>,
    /// Print JSON.
    #[arg(long, global = true)]
    json: bool,
    /// Runs start no workers: each of --workers is started by hand, on any machine, as
    /// `skiff carafe --coordinator URLS --name NAME worker --id I --workers W`, and has this
    /// many seconds to begin.
    #[arg(long, value_name = "SECONDS", global = true)]
    external_workers: Option<u64>,
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Generate a Graph500 R-MAT graph (2^scale vertex ids, edge-factor edges each) as the graph.
    Gen {
        #[arg(long)]
        scale: u32,
        #[arg(long, default_value_t = 16)]
        edge_factor: u64,
        #[arg(long, default_value_t = 0x5eed)]
        seed: u64,
        /// Weights uniform in 1..=N (1: unweighted).
        #[arg(long, default_value_t = 1)]
        max_weight: u32,
        /// Also write the edge list here (SNAP's text format), for other tools.
        #[arg(long)]
        file: Option<std::path::PathBuf>,
        /// Store each edge both ways.
        #[arg(long)]
        undirected: bool,
        /// Drop self loops and repeated edges.
        #[arg(long)]
        simple: bool,
        /// Number the vertices 0 to V - 1 (for tools that index arrays by id).
        #[arg(long)]
        compact: bool,
    },
    /// Import an edge list in SNAP's text format (`src dst [weight]` per line, `#` comments).
    Import {
        #[arg(long)]
        file: std::path::PathBuf,
        /// Store each edge both ways.
        #[arg(long)]
        undirected: bool,
    },
    /// The graph's size.
    Info,
    /// PageRank on the Pregel engine with --workers partition worker processes.
    Pagerank {
        #[arg(long, default_value_t = 2)]
        workers: usize,
        /// Rank updates after the first superstep.
        #[arg(long, default_value_t = 32)]
        iterations: u64,
        #[arg(long, default_value_t = 0.85)]
        damping: f64,
        /// Write `external-id rank` per vertex here.
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Single-source shortest paths (along weights; hops when unweighted) on the Pregel engine.
    Sssp {
        /// The source's external id.
        #[arg(long)]
        source: u64,
        #[arg(long, default_value_t = 2)]
        workers: usize,
        /// Write `external-id distance` per vertex here (inf: unreached).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Dijkstra's shortest paths explored online, between --pairs random vertex pairs or
    /// between --from and --to.
    Path {
        #[arg(long, default_value_t = 10)]
        pairs: usize,
        #[arg(long, default_value_t = 0x5eed)]
        seed: u64,
        #[arg(long, requires = "to")]
        from: Option<u64>,
        #[arg(long, requires = "from")]
        to: Option<u64>,
        /// What the walk keeps of the graph's vertices and edges between reads (blocks of
        /// 32 KiB; half for each).
        #[arg(long, value_parser = crate::units::parse_size, default_value = "512M")]
        cache: u64,
        /// Start every path with an empty cache, as the first query on a graph does.
        #[arg(long)]
        cold: bool,
    },
    /// One partition worker of a run (started by it).
    #[command(hide = true)]
    Worker {
        #[arg(long)]
        id: usize,
        #[arg(long)]
        workers: usize,
    },
}

pub fn run(args: CarafeArgs) -> CliResult {
    let (coord, urls) = args.coordinator.connect()?;
    let carafe = Carafe {
        chunk_bytes: crate::ns::chunk_size(&coord, args.scope, args.chunk)?,
        coord,
        name: args.name.clone(),
        scope: args.scope,
    };
    let worker = |id, workers| args.coordinator.worker_command("carafe", &urls, &args.name, id, workers);
    // Checked once here, so that the closure the run calls cannot fail.
    worker(0, 1)?;
    let mut spawn = |id, workers| worker(id, workers).expect("the executable was found");
    if let (Some(s), Action::Pagerank { workers, .. } | Action::Sssp { workers, .. }) =
        (args.external_workers, &args.action)
    {
        eprintln!("waiting {s} s for {workers} workers; start each, on any machine, as:");
        eprintln!(
            "  skiff carafe --coordinator {urls} --name {} worker --id I --workers {workers}",
            args.name
        );
    }
    let report = match args.action {
        Action::Gen { scale, edge_factor, seed, max_weight, ref file, undirected, simple, compact } => {
            let spec = GenSpec { scale, edge_factor, seed, max_weight, simple, compact };
            carafe.gen(&spec, file.as_deref(), undirected)?
        }
        Action::Import { ref file, undirected } => carafe.import(file, undirected)?,
        Action::Info => {
            let h = carafe.header()?;
            Report {
                what: "graph",
                fields: vec![
                    ("vertices", h.vertices as f64),
                    ("edges", h.edges as f64),
                    ("weighted", f64::from(u8::from(h.weighted))),
                    ("undirected", f64::from(u8::from(h.undirected))),
                ],
                detail: Vec::new(),
            }
        }
        Action::Pagerank { workers, iterations, damping, ref out } => {
            if !(0.0..1.0).contains(&damping) {
                return Err("--damping: from 0 up to 1".into());
            }
            let r = carafe.run(
                Program::PageRank { damping, iterations },
                workers,
                launch(&mut spawn, args.external_workers),
                progress,
            )?;
            write_values(&carafe, out.as_deref())?;
            r
        }
        Action::Sssp { source, workers, ref out } => {
            let v = carafe
                .open()?
                .find(source)?
                .ok_or_else(|| format!("graph {} has no vertex {source}", args.name))?;
            let r = carafe.run(
                Program::Sssp { source: v.internal },
                workers,
                launch(&mut spawn, args.external_workers),
                progress,
            )?;
            write_values(&carafe, out.as_deref())?;
            r
        }
        Action::Path { pairs, seed, from, to, cache, cold } => {
            let walk = Walk { cache_bytes: usize::try_from(cache).unwrap_or(usize::MAX), cold };
            match (from, to) {
                (Some(a), Some(b)) => carafe.paths_of(&[(a, b)], walk)?,
                _ => carafe.paths(pairs, seed, walk)?,
            }
        }
        Action::Worker { id, workers } => {
            // JSON whatever --json says: the run that started this worker reads it.
            println!("{}", carafe.worker(id, workers)?.json());
            return Ok(ExitCode::SUCCESS);
        }
    };
    if args.json {
        println!("{}", report.json());
    } else {
        println!("{report}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Workers started by the run, or by hand (`--external-workers`).
fn launch(spawn: &mut dyn FnMut(usize, usize) -> Command, external: Option<u64>) -> Launch<'_> {
    match external {
        Some(s) => Launch::External { attach: std::time::Duration::from_secs(s) },
        None => Launch::Spawn(spawn),
    }
}

/// Each superstep as it ends, on stderr.
fn progress(s: &StepStats) {
    eprintln!(
        "superstep {:>3}: {:>9.3} ms, {:>10} active, {:>11} messages, {:>11} mailbox bytes",
        s.superstep,
        s.seconds * 1e3,
        s.active,
        s.messages,
        s.mail_bytes
    );
}

/// `external-id value` per vertex, from the graph's values, to `out`.
fn write_values(carafe: &Carafe, out: Option<&std::path::Path>) -> Result<(), Box<dyn std::error::Error>> {
    let Some(path) = out else { return Ok(()) };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for (ext, value) in carafe.values()? {
        if value.is_finite() {
            writeln!(f, "{ext}\t{value:e}")?;
        } else {
            writeln!(f, "{ext}\tinf")?;
        }
    }
    f.flush()?;
    Ok(())
}
