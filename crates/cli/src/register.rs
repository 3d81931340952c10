//! `skiff register`: ask a running target for a reference to a range of an export (a flash
//! volume's extent: FlashNet's lazy registration, docs/DIRECT_READS.md) and time what asking
//! costs. Nothing on the target is read, allocated or pinned for it, whatever the size.

use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use initiator::{Client, Endpoint};

use crate::CliResult;

#[derive(Args)]
pub struct RegisterArgs {
    /// Target address: HOST:PORT or unix:PATH.
    target: String,
    /// The export (a flash volume, or a RAM export).
    export: String,
    /// The range to register, OFFSET:LENGTH (sizes such as 0:64G), 4 KiB aligned. Default:
    /// the whole export.
    #[arg(long, value_parser = crate::revoke::parse_range)]
    range: Option<(u64, u64)>,
    /// Register this many times on one connection, to time the round trip (the first one,
    /// which may pay for connection set-up in the target's caches, is shown apart).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    repeat: u32,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    keys: crate::keys::KeyArgs,
    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The `q`-quantile of sorted `v` (nearest rank).
fn quantile(v: &[f64], q: f64) -> f64 {
    v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1]
}

pub fn run(args: RegisterArgs) -> CliResult {
    let endpoint = Endpoint::parse(&args.target)?;
    let key = args.keys.key()?;
    let tls = args.tls.config()?;
    let mut client = Client::connect_with(&endpoint, key.as_deref(), tls.as_ref())
        .map_err(|e| format!("{endpoint}: {e}"))?;
    let (offset, length) = match args.range {
        Some(range) => range,
        None => {
            let listed = client.list().map_err(|e| format!("{endpoint}: {e}"))?;
            let info = listed
                .iter()
                .find(|e| e.name == args.export)
                .ok_or_else(|| format!("{endpoint}: no export {:?}", args.export))?;
            (0, info.size_bytes)
        }
    };
    let handle =
        client.open(&args.export).map_err(|e| format!("{endpoint} export {:?}: {e}", args.export))?;
    let mut rtt_us = Vec::with_capacity(args.repeat as usize);
    let mut cap = None;
    for _ in 0..args.repeat {
        let started = Instant::now();
        let got = client
            .register_on(handle, offset, length)
            .map_err(|e| format!("{endpoint} export {:?}, {offset}+{length}: {e}", args.export))?;
        rtt_us.push(started.elapsed().as_secs_f64() * 1e6);
        cap = Some(got);
    }
    let cap = cap.expect("at least one registration");
    let first = rtt_us[0];
    let mut rest: Vec<f64> = if rtt_us.len() > 1 { rtt_us[1..].to_vec() } else { rtt_us.clone() };
    rest.sort_by(f64::total_cmp);
    let (min, median, p99, max) =
        (rest[0], quantile(&rest, 0.5), quantile(&rest, 0.99), rest[rest.len() - 1]);
    if args.json {
        let out = serde_json::json!({
            "target": endpoint.to_string(),
            "export": args.export,
            "offset": offset,
            "length": length,
            "repeat": args.repeat,
            "kind": format!("{:?}", cap.kind).to_lowercase(),
            "covers_bytes": cap.span(),
            "rtt_first_us": first,
            "rtt_us": { "min": min, "median": median, "p99": p99, "max": max },
            "reference": hex(&cap.encode()),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "export {}: {:?} reference to {offset}..{} ({} bytes), rights {:#x}, key epoch {}",
            args.export,
            cap.kind,
            cap.offset.saturating_add(cap.span()),
            cap.span(),
            cap.rights.bits(),
            cap.epoch
        );
        println!("reference: {}", hex(&cap.encode()));
        println!(
            "round trip: first {first:.1} µs; then over {} registrations min {min:.1}, median {median:.1}, p99 {p99:.1}, max {max:.1} µs",
            rest.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}
