//! `skiff flash`: make a flash array on files or block devices, for `skiff serve --flash`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use flash::device::{recognise, Device, FileDevice};
use flash::engine::{DATA_START, SEGMENT_PAGES_DEFAULT};
use flash::layout::PAGE;

use crate::units::human_bytes;
use crate::CliResult;

#[derive(Args)]
pub struct FlashArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Write a new, empty flash array over the devices (files or block devices). A device
    /// that holds an array or a file system is refused, saying what it holds, unless --force.
    Format {
        /// The devices, comma-separated: every one of them is the array's.
        #[arg(value_name = "PATH[,PATH...]", value_delimiter = ',', required = true)]
        devices: Vec<PathBuf>,
        /// Segment size: the unit of allocation and cleaning (a multiple of 4 KiB, from 12
        /// KiB to 4 GiB).
        #[arg(long, value_name = "SIZE", value_parser = crate::units::parse_size, default_value_t = u64::from(SEGMENT_PAGES_DEFAULT) * PAGE as u64)]
        segment: u64,
        /// Overwrite whatever the devices hold (an array, a file system).
        #[arg(long)]
        force: bool,
    },
}

pub fn run(args: FlashArgs) -> CliResult {
    match args.action {
        Action::Format { devices, segment, force } => format(&devices, segment, force),
    }
}

fn format(paths: &[PathBuf], segment_bytes: u64, force: bool) -> CliResult {
    if segment_bytes == 0 || !segment_bytes.is_multiple_of(PAGE as u64) {
        return Err(format!("--segment {segment_bytes}: expected a multiple of 4 KiB").into());
    }
    let segment_pages = u32::try_from(segment_bytes / PAGE as u64).map_err(|_| "--segment: at most 4 GiB")?;
    let mut devices: Vec<Box<dyn Device>> = Vec::with_capacity(paths.len());
    for path in paths {
        let device = FileDevice::open(path).map_err(|e| named(path, e))?;
        if let Some(held) = recognise(&device).map_err(|e| named(path, e))? {
            if !force {
                return Err(format!("{} holds {held}; format it anyway with --force", path.display()).into());
            }
            eprintln!("skiff: {} holds {held}: overwriting it (--force)", path.display());
        }
        devices.push(Box::new(device));
    }
    let id = flash::engine::format(&devices, segment_pages, force)?;
    // The geometry `format` chose: whole segments after the superblocks, as many on every
    // device as the smallest takes.
    let per_device = devices
        .iter()
        .map(|d| d.pages().saturating_sub(DATA_START) / u64::from(segment_pages))
        .min()
        .unwrap_or(0);
    let segments = per_device * devices.len() as u64;
    let capacity = segments * u64::from(segment_pages - 1) * PAGE as u64;
    let id: String = id.iter().map(|b| format!("{b:02x}")).collect();
    println!(
        "flash array {id}: {} device(s), {segments} segments of {}, {} for data",
        devices.len(),
        human_bytes(segment_bytes as f64),
        human_bytes(capacity as f64)
    );
    Ok(ExitCode::SUCCESS)
}

fn named(path: &std::path::Path, e: std::io::Error) -> String {
    let text = e.to_string();
    if text.contains(&*path.to_string_lossy()) {
        text
    } else {
        format!("{}: {text}", path.display())
    }
}
