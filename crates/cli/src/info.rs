//! `skiff info`.

use std::process::ExitCode;

use clap::Args;
use initiator::{Client, Endpoint, ExportFlags};

use crate::units::human_bytes;
use crate::CliResult;

#[derive(Args)]
pub struct InfoArgs {
    /// Target address: HOST:PORT, unix:PATH, or eth:IFACE[/MAC] (without a MAC: every target
    /// that answers on the interface's segment).
    target: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    keys: crate::keys::KeyArgs,
    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

fn flag_names(f: ExportFlags) -> Vec<&'static str> {
    [
        (ExportFlags::READ_ONLY, "read-only"),
        (ExportFlags::CAN_FLUSH, "flush"),
        (ExportFlags::CAN_FUA, "fua"),
        (ExportFlags::CAN_TRIM, "trim"),
        (ExportFlags::CAN_WRITE_ZEROES, "write-zeroes"),
    ]
    .into_iter()
    .filter(|(bit, _)| f.has(*bit))
    .map(|(_, name)| name)
    .collect()
}

pub fn run(args: InfoArgs) -> CliResult {
    let endpoint = Endpoint::parse(&args.target)?;
    let targets = match &endpoint {
        // Every target on the segment that answers a Discover.
        Endpoint::Eth { ifaces, mac: None, options } => {
            let found = eth::discover(&ifaces[0], std::time::Duration::from_millis(300))
                .map_err(|e| format!("{endpoint}: {e}"))?;
            if found.is_empty() {
                return Err(format!("no skiff target answered on {}", ifaces[0]).into());
            }
            found
                .into_iter()
                .map(|mac| Endpoint::Eth { ifaces: ifaces.clone(), mac: Some(mac), options: *options })
                .collect()
        }
        one => vec![one.clone()],
    };
    let mut docs = Vec::new();
    for (i, target) in targets.iter().enumerate() {
        if i > 0 && !args.json {
            println!();
        }
        docs.push(show(&args, target)?);
    }
    if args.json {
        // One target: its document; several (found by discovery): an array of them.
        let doc = if docs.len() == 1 { docs.remove(0) } else { serde_json::Value::Array(docs) };
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(ExitCode::SUCCESS)
}

/// One target's limits and exports: printed as a table, or returned as JSON with `--json`.
fn show(args: &InfoArgs, endpoint: &Endpoint) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let key = args.keys.key()?;
    let tls = args.tls.config()?;
    let mut client = Client::connect_with(endpoint, key.as_deref(), tls.as_ref())
        .map_err(|e| format!("{endpoint}: {e}"))?;
    let exports = client.list()?;
    let l = *client.limits();
    if args.json {
        let list: Vec<_> = exports
            .iter()
            .map(|e| {
                serde_json::json!({
                    "name": e.name, "size_bytes": e.size_bytes, "block_size": e.block_size,
                    "read_only": e.flags.has(ExportFlags::READ_ONLY), "capabilities": flag_names(e.flags),
                })
            })
            .collect();
        return Ok(serde_json::json!({
            "target": endpoint.to_string(),
            "limits": { "queue_depth": l.queue_depth, "caravan_reqs_max": l.caravan_reqs_max,
                        "caravan_bytes_max": l.caravan_bytes_max, "io_bytes_max": l.io_bytes_max },
            "exports": list,
        }));
    }
    println!("target {endpoint}");
    println!(
        "limits: queue depth {}, {} requests and {} per caravan, largest I/O {}",
        l.queue_depth,
        l.caravan_reqs_max,
        human_bytes(l.caravan_bytes_max.into()),
        human_bytes(l.io_bytes_max.into())
    );
    println!("{:<20} {:>12} {:>7} {:>10}  capabilities", "export", "size", "block", "read-only");
    for e in &exports {
        println!(
            "{:<20} {:>12} {:>7} {:>10}  {}",
            e.name,
            human_bytes(e.size_bytes as f64),
            e.block_size,
            if e.flags.has(ExportFlags::READ_ONLY) { "yes" } else { "no" },
            flag_names(e.flags).join(",")
        );
    }
    Ok(serde_json::Value::Null)
}
