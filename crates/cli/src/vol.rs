//! `skiff vol`: the flash volumes of a running target (`skiff serve --flash`), through
//! `VOLUME` requests (docs/PROTOCOL.md, section 17). Every change is durable on the target
//! before the command returns; a refusal prints the target's message and exits non-zero.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use initiator::{Client, Endpoint, StatsReply, VolumeBody, VolumeEntry, VolumeOp, VolumeRequest};

use crate::units::{human_bytes, parse_size};
use crate::CliResult;

/// How to reach the target: every `vol` command takes these.
#[derive(Args)]
struct Reach {
    /// The target: HOST:PORT or unix:PATH.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:7070")]
    target: String,
    #[command(flatten)]
    keys: crate::keys::KeyArgs,
    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

impl Reach {
    fn connect(&self) -> Result<(Client, Endpoint), Box<dyn std::error::Error>> {
        let endpoint = Endpoint::parse(&self.target)?;
        let key = self.keys.key()?;
        let tls = self.tls.config()?;
        let client = Client::connect_with(&endpoint, key.as_deref(), tls.as_ref())
            .map_err(|e| format!("{endpoint}: {e}"))?;
        Ok((client, endpoint))
    }
}

#[derive(Args)]
pub struct VolArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Create an empty volume, exported under its name at once.
    Create {
        name: String,
        /// Its size (e.g. 10G; rounded up to 4 KiB).
        #[arg(long, value_parser = parse_size)]
        size: u64,
        #[command(flatten)]
        reach: Reach,
    },
    /// Grow or shrink a volume (never below the data written in it).
    Resize {
        name: String,
        #[arg(value_parser = parse_size)]
        size: u64,
        #[command(flatten)]
        reach: Reach,
    },
    /// A read-only snapshot SNAP of volume NAME, exported read-only.
    Snapshot {
        name: String,
        snap: String,
        #[command(flatten)]
        reach: Reach,
    },
    /// A writable clone NEW of a snapshot (or volume) SNAP.
    Clone {
        snap: String,
        new: String,
        #[command(flatten)]
        reach: Reach,
    },
    /// Delete a volume and its data: refused while connections have it open, or snapshots or
    /// clones of it exist.
    Delete {
        name: String,
        #[command(flatten)]
        reach: Reach,
    },
    /// The volumes: size, data allocated, writable, origin, snapshots and clones.
    List {
        /// One JSON document instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        reach: Reach,
    },
    /// The flash array's figures: space, write amplification, cleaning, page pool.
    Stats {
        /// One JSON document instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        reach: Reach,
    },
}

pub fn run(args: VolArgs) -> CliResult {
    let change = |reach: &Reach, op, name: &str, origin: &str, size_bytes| -> CliResult {
        let (mut client, endpoint) = reach.connect()?;
        let request = VolumeRequest { op, name: name.to_owned(), origin: origin.to_owned(), size_bytes };
        let reply = client.volume(&request).map_err(|e| format!("{endpoint}: {e}"))?;
        if !reply.status.is_ok() {
            return Err(format!("{endpoint}: {} ({})", reply.message, reply.status).into());
        }
        println!("{}", reply.message);
        Ok(ExitCode::SUCCESS)
    };
    match args.action {
        Action::Create { name, size, reach } => change(&reach, VolumeOp::Create, &name, "", size),
        Action::Resize { name, size, reach } => change(&reach, VolumeOp::Resize, &name, "", size),
        Action::Snapshot { name, snap, reach } => change(&reach, VolumeOp::Snapshot, &snap, &name, 0),
        Action::Clone { snap, new, reach } => change(&reach, VolumeOp::Clone, &new, &snap, 0),
        Action::Delete { name, reach } => change(&reach, VolumeOp::Delete, &name, "", 0),
        Action::List { json, reach } => list(&reach, json),
        Action::Stats { json, reach } => stats(&reach, json),
    }
}

/// The names of the snapshots and clones of `v`: the volumes whose origin it is.
fn children<'a>(all: &'a [VolumeEntry], v: &VolumeEntry) -> Vec<&'a str> {
    all.iter().filter(|c| c.origin == v.name).map(|c| c.name.as_str()).collect()
}

fn list(reach: &Reach, json: bool) -> CliResult {
    let (mut client, endpoint) = reach.connect()?;
    let all = client.volumes().map_err(|e| format!("{endpoint}: {e}"))?;
    if json {
        let volumes: Vec<serde_json::Value> = all
            .iter()
            .map(|v| {
                serde_json::json!({
                    "name": v.name,
                    "size_bytes": v.size_bytes,
                    "allocated_bytes": v.allocated_bytes,
                    "writable": v.writable,
                    "origin": (!v.origin.is_empty()).then_some(&v.origin),
                    "snapshots": children(&all, v),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "volumes": volumes }))?);
        return Ok(ExitCode::SUCCESS);
    }
    let width = all.iter().map(|v| v.name.len()).max().unwrap_or(0).max(6);
    println!(
        "{:<width$} {:>12} {:>12} {:>9}  {:<width$}  snapshots",
        "volume", "size", "allocated", "writable", "origin"
    );
    for v in &all {
        let origin = if v.origin.is_empty() { "-" } else { v.origin.as_str() };
        let kids = children(&all, v);
        println!(
            "{:<width$} {:>12} {:>12} {:>9}  {:<width$}  {}",
            v.name,
            human_bytes(v.size_bytes as f64),
            human_bytes(v.allocated_bytes as f64),
            if v.writable { "yes" } else { "no" },
            origin,
            if kids.is_empty() { "-".to_owned() } else { kids.join(",") }
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn stats(reach: &Reach, json: bool) -> CliResult {
    let (mut client, endpoint) = reach.connect()?;
    let reply =
        client.volume(&VolumeRequest::bare(VolumeOp::Stats)).map_err(|e| format!("{endpoint}: {e}"))?;
    let VolumeBody::Stats(stats) = reply.body else {
        return Err(format!("{endpoint}: {} ({})", reply.message, reply.status).into());
    };
    let amplification = write_amplification(&stats);
    if json {
        let mut doc = serde_json::Map::new();
        for (name, value) in &stats.entries {
            doc.insert(name.clone(), serde_json::json!(value));
        }
        doc.insert("write_amplification".into(), serde_json::json!(amplification));
        println!("{}", serde_json::to_string_pretty(&serde_json::Value::Object(doc))?);
        return Ok(ExitCode::SUCCESS);
    }
    let get = |name: &str| stats.get(name).unwrap_or(0);
    println!(
        "space: {} for data, {} valid, {} free; {} of {} segments free",
        human_bytes(get("capacity_bytes") as f64),
        human_bytes(get("valid_bytes") as f64),
        human_bytes(get("free_bytes") as f64),
        get("free_segments"),
        get("total_segments")
    );
    println!(
        "writes: {} user pages, {} device pages: write amplification {amplification:.3}",
        get("user_pages_written"),
        get("device_pages_written")
    );
    println!(
        "page pool: {} pages, {} dirty; {} hits, {} misses, {} evictions",
        get("pool_pages"),
        get("pool_dirty_pages"),
        get("pool_hits"),
        get("pool_misses"),
        get("pool_evictions")
    );
    println!(
        "map: {} in memory, {} of {} leaves; {} read back, {} evicted",
        human_bytes(get("map_bytes") as f64),
        get("map_leaves_resident"),
        get("map_leaves"),
        get("map_loads"),
        get("map_evictions")
    );
    println!("{:<32} {:>16}", "counter", "value");
    for (name, value) in &stats.entries {
        println!("{name:<32} {value:>16}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The ratio the reply carries in millionths.
fn write_amplification(stats: &StatsReply) -> f64 {
    stats.get("write_amplification_e6").unwrap_or(0) as f64 / 1e6
}
