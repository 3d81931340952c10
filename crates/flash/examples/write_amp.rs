//! Write amplification of the flash controller under skewed overwrites (thesis 5.4.6): fill a
//! volume to a share of the array, overwrite it with 4 KiB pages chosen uniformly or with a
//! hot set (80% of writes to 20% of the pages, or 95% to 20%), and count what reached the
//! devices per page the user wrote, with segregation on and off.
//!
//! ```text
//! cargo run --release -p skiff-flash --example write_amp -- --dist 80/20 --segregation on
//! cargo run --release -p skiff-flash --example write_amp -- --device /var/tmp/array.img --json
//! ```
//!
//! The array is in memory unless `--device PATH` names a file (then its pages written are also
//! counted by the device itself). Background work (write-back, cleaning, checkpoints) runs in
//! the writing thread every `--step` writes, as the target's flash thread would. Only the
//! overwrite phase is measured: the fill, and `--warmup N` volumes' worth of overwrites before
//! it (to measure the steady state rather than the way out of a sequential fill), are not.

use std::sync::Arc;
use std::time::Instant;

use skiff_flash::ctl::Config;
use skiff_flash::device::{Device, FileDevice, MemDevice};
use skiff_flash::engine::{format, Array};
use skiff_flash::layout::PAGE;
use skiff_flash::space::VictimPolicy;

struct Args {
    array_mib: u64,
    segment_kib: u64,
    fill: f64,
    dist: String,
    segregation: bool,
    overwrites: f64,
    warmup: f64,
    pool_mib: u64,
    policy: VictimPolicy,
    device: Option<String>,
    step: u64,
    seed: u64,
    json: bool,
    /// Pages rewritten within this share of the array's capacity count as hot.
    hot_window: f64,
    /// Static wear levelling's bound on the spread of erase counts.
    wear_spread: u32,
}

fn parse() -> Args {
    let mut a = Args {
        array_mib: 1024,
        segment_kib: 8192,
        fill: 0.8,
        dist: "80/20".into(),
        segregation: true,
        overwrites: 4.0,
        warmup: 0.0,
        pool_mib: 16,
        policy: VictimPolicy::CostBenefit,
        device: None,
        step: 64,
        seed: 1,
        json: false,
        hot_window: 0.5,
        wear_spread: Config::default().wear_spread_max,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let v = || args.get(i + 1).cloned().unwrap_or_else(|| die(&format!("{} needs a value", args[i])));
        match args[i].as_str() {
            "--array-mib" => a.array_mib = v().parse().unwrap_or_else(|_| die("--array-mib: a number")),
            "--segment-kib" => a.segment_kib = v().parse().unwrap_or_else(|_| die("--segment-kib: a number")),
            "--fill" => a.fill = v().parse().unwrap_or_else(|_| die("--fill: a fraction")),
            "--dist" => a.dist = v(),
            "--segregation" => a.segregation = v() == "on",
            "--overwrites" => {
                a.overwrites = v().parse().unwrap_or_else(|_| die("--overwrites: volume sizes"))
            }
            "--warmup" => a.warmup = v().parse().unwrap_or_else(|_| die("--warmup: volume sizes")),
            "--pool-mib" => a.pool_mib = v().parse().unwrap_or_else(|_| die("--pool-mib: a number")),
            "--policy" => {
                a.policy = match v().as_str() {
                    "greedy" => VictimPolicy::Greedy,
                    "cost-benefit" => VictimPolicy::CostBenefit,
                    _ => die("--policy: greedy or cost-benefit"),
                }
            }
            "--device" => a.device = Some(v()),
            "--step" => a.step = v().parse().unwrap_or_else(|_| die("--step: a number")),
            "--seed" => a.seed = v().parse().unwrap_or_else(|_| die("--seed: a number")),
            "--hot-window" => {
                a.hot_window = v().parse().unwrap_or_else(|_| die("--hot-window: a share of the array"))
            }
            "--wear-spread" => a.wear_spread = v().parse().unwrap_or_else(|_| die("--wear-spread: erases")),
            "--json" => {
                a.json = true;
                i += 1;
                continue;
            }
            other => die(&format!("unknown option {other}")),
        }
        i += 2;
    }
    if !["uniform", "80/20", "95/20"].contains(&a.dist.as_str()) {
        die("--dist: uniform, 80/20 or 95/20");
    }
    a
}

/// The disk a file lives on, as `/proc/diskstats` names it.
struct DiskCounter {
    major: u64,
    minor: u64,
    name: String,
}

impl DiskCounter {
    fn of(path: &str) -> Option<DiskCounter> {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(path).ok()?.dev();
        let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
        let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
        let mut d = DiskCounter { major, minor, name: String::new() };
        d.name = d.line()?.get(2)?.clone();
        Some(d)
    }

    fn line(&self) -> Option<Vec<String>> {
        let stats = std::fs::read_to_string("/proc/diskstats").ok()?;
        stats
            .lines()
            .map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            .find(|f| f.len() > 9 && f[0].parse() == Ok(self.major) && f[1].parse() == Ok(self.minor))
    }

    /// Sectors of 512 bytes written since boot (the tenth field).
    fn sectors_written(&self) -> Option<u64> {
        self.line()?.get(9)?.parse().ok()
    }
}

fn die(msg: &str) -> ! {
    eprintln!("write_amp: {msg}");
    std::process::exit(2);
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
}

/// A permutation of `0..n` (an affine map with a multiplier coprime to `n`), so that the hot
/// set is spread over the volume rather than a run of neighbouring pages.
fn scatter(i: u64, n: u64) -> u64 {
    let mut m = (0x9e37_79b9_7f4a_7c15u64 % n) | 1;
    while gcd(m, n) != 1 {
        m += 2;
    }
    ((u128::from(i) * u128::from(m) + 7) % u128::from(n)) as u64
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn main() {
    let a = parse();
    let segment_pages = (a.segment_kib * 1024 / PAGE as u64) as u32;
    let device_pages =
        a.array_mib * 1024 * 1024 / PAGE as u64 + skiff_flash::engine::DATA_START + u64::from(segment_pages);
    let dev: Arc<dyn Device> = match &a.device {
        None => Arc::new(MemDevice::new(device_pages)),
        Some(path) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(path)
                .unwrap_or_else(|e| die(&format!("{path}: {e}")));
            f.set_len(device_pages * PAGE as u64).unwrap_or_else(|e| die(&format!("{path}: {e}")));
            Arc::new(
                FileDevice::open(std::path::Path::new(path)).unwrap_or_else(|e| die(&format!("{path}: {e}"))),
            )
        }
    };
    format(&[Box::new(dev.clone()) as Box<dyn Device>], segment_pages, true)
        .unwrap_or_else(|e| die(&format!("format: {e}")));
    let capacity_pages = a.array_mib * 1024 * 1024 / PAGE as u64;
    let cfg = Config {
        pool_pages: (a.pool_mib * 1024 * 1024 / PAGE as u64) as u32,
        segregation: a.segregation,
        policy: a.policy,
        hot_window_pages: (capacity_pages as f64 * a.hot_window) as u64,
        wear_spread_max: a.wear_spread,
        ..Config::default()
    };
    let array = Array::open(vec![Box::new(dev.clone())], cfg).unwrap_or_else(|e| die(&format!("open: {e}")));
    let vol_pages = (capacity_pages as f64 * a.fill) as u64;
    let vol = array.create("v", vol_pages * PAGE as u64).unwrap_or_else(|e| die(&format!("create: {e}")));
    let mut page = vec![0u8; PAGE];
    let mut rng = Rng(a.seed);
    let background = |array: &Array| {
        for _ in 0..4 {
            match array.background_step() {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => die(&format!("background work: {e}")),
            }
        }
    };
    for p in 0..vol_pages {
        page[..8].copy_from_slice(&rng.next().to_le_bytes());
        array
            .write(vol, p * PAGE as u64, &page, false)
            .unwrap_or_else(|e| die(&format!("fill page {p}: {e}")));
        if p % a.step == 0 {
            background(&array);
        }
    }
    array.flush().unwrap_or_else(|e| die(&format!("flush: {e}")));
    let (hot_share, hot_pages) = match a.dist.as_str() {
        "80/20" => (0.8, vol_pages / 5),
        "95/20" => (0.95, vol_pages / 5),
        _ => (0.0, 0),
    };
    let pick = |rng: &mut Rng| {
        let hot = hot_pages > 0 && (rng.below(1_000_000) as f64) < hot_share * 1e6;
        let i = if hot { rng.below(hot_pages) } else { hot_pages + rng.below(vol_pages - hot_pages) };
        scatter(i, vol_pages)
    };
    for w in 0..(vol_pages as f64 * a.warmup) as u64 {
        let p = pick(&mut rng);
        page[..8].copy_from_slice(&rng.next().to_le_bytes());
        array.write(vol, p * PAGE as u64, &page, false).unwrap_or_else(|e| die(&format!("warm-up {w}: {e}")));
        if w % a.step == 0 {
            background(&array);
        }
    }
    array.flush().unwrap_or_else(|e| die(&format!("flush: {e}")));
    let before = array.stats();
    let dev_before = dev.pages_written();
    let disk = a.device.as_deref().and_then(DiskCounter::of);
    let disk_before = disk.as_ref().and_then(DiskCounter::sectors_written);
    let writes = (vol_pages as f64 * a.overwrites) as u64;
    let started = Instant::now();
    for w in 0..writes {
        let p = pick(&mut rng);
        page[..8].copy_from_slice(&rng.next().to_le_bytes());
        array
            .write(vol, p * PAGE as u64, &page, false)
            .unwrap_or_else(|e| die(&format!("overwrite {w}: {e}")));
        if w % a.step == 0 {
            background(&array);
        }
    }
    array.flush().unwrap_or_else(|e| die(&format!("flush: {e}")));
    let secs = started.elapsed().as_secs_f64();
    let after = array.stats();
    let user = after.counters.user_pages_written - before.counters.user_pages_written;
    let device = after.counters.device_pages_written - before.counters.device_pages_written;
    let moved = after.counters.gc_pages_moved - before.counters.gc_pages_moved;
    let measured = dev.pages_written() - dev_before;
    let wear_moves = after.counters.wear_segments_moved - before.counters.wear_segments_moved;
    let wa = device as f64 / user as f64;
    // What the kernel saw reach the disk beneath the file (file system metadata and anything
    // else on that disk included), in pages.
    let kernel = match (disk.as_ref(), disk_before) {
        (Some(d), Some(b)) => d.sectors_written().map(|now| (d.name.clone(), (now - b) * 512 / PAGE as u64)),
        _ => None,
    };
    if let Some((name, pages)) = &kernel {
        eprintln!(
            "the kernel's /proc/diskstats for {name}: {pages} pages written during the overwrites ({:.3} per user page)",
            *pages as f64 / user as f64
        );
    }
    if a.json {
        println!(
            "{{\"dist\":\"{}\",\"segregation\":{},\"fill\":{},\"warmup\":{},\"array_mib\":{},\"user_pages\":{user},\"device_pages\":{device},\"device_pages_measured\":{measured},\"gc_pages_moved\":{moved},\"gc_segments\":{},\"checkpoints\":{},\"write_amplification\":{wa:.4},\"seconds\":{secs:.2},\"erase_min\":{},\"erase_max\":{},\"wear_segments_moved\":{wear_moves},\"kernel_pages_written\":{}}}",
            a.dist,
            a.segregation,
            a.fill,
            a.warmup,
            a.array_mib,
            after.counters.gc_segments_cleaned - before.counters.gc_segments_cleaned,
            after.counters.checkpoints - before.counters.checkpoints,
            after.erase_min,
            after.erase_max,
            kernel.as_ref().map_or("null".to_owned(), |k| k.1.to_string())
        );
    } else {
        println!(
            "{} segregation {}: {user} user pages, {device} device pages ({measured} counted by the device), {moved} moved by GC: write amplification {wa:.3} ({secs:.1} s; erase counts {}..{}, {wear_moves} segments moved for wear)",
            a.dist,
            if a.segregation { "on" } else { "off" },
            after.erase_min,
            after.erase_max
        );
    }
}
