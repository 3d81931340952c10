//! `skiff revoke`: revoke an export's capabilities on a running target (docs/DIRECT_READS.md).

use std::process::ExitCode;

use clap::Args;
use initiator::{Client, Endpoint};

use crate::units::parse_size;
use crate::CliResult;

#[derive(Args)]
pub struct RevokeArgs {
    /// Target address: HOST:PORT or unix:PATH.
    target: String,
    /// The export whose capabilities to revoke (it must be writable on this target).
    export: String,
    /// Invalidate only the cached blocks of this range, OFFSET:LENGTH (sizes such as 0:1G or
    /// 4096:64k), instead of rotating the export's key epoch (which revokes everything).
    #[arg(long, value_parser = parse_range)]
    range: Option<(u64, u64)>,
    #[command(flatten)]
    keys: crate::keys::KeyArgs,
    #[command(flatten)]
    tls: crate::tls::TlsArgs,
}

pub(crate) fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let (offset, length) = s.split_once(':').ok_or_else(|| format!("{s:?}: expected OFFSET:LENGTH"))?;
    let offset = parse_size(offset).map_err(|e| e.to_string())?;
    let length = parse_size(length).map_err(|e| e.to_string())?;
    if length == 0 {
        return Err(format!("{s:?}: the length is zero"));
    }
    Ok((offset, length))
}

pub fn run(args: RevokeArgs) -> CliResult {
    let endpoint = Endpoint::parse(&args.target)?;
    let key = args.keys.key()?;
    let tls = args.tls.config()?;
    let mut client = Client::connect_with(&endpoint, key.as_deref(), tls.as_ref())
        .map_err(|e| format!("{endpoint}: {e}"))?;
    let epoch = client
        .revoke(&args.export, args.range)
        .map_err(|e| format!("{endpoint} export {:?}: {e}", args.export))?;
    match args.range {
        None => {
            println!("export {}: key epoch rotated to {epoch}; every capability of it is stale", args.export)
        }
        Some((offset, length)) => println!(
            "export {}: cached blocks of {offset}..{} invalidated (key epoch {epoch})",
            args.export,
            offset.saturating_add(length)
        ),
    }
    Ok(ExitCode::SUCCESS)
}
