//! The flash controller's proof under crashes: seeded runs over devices that tear and lose
//! unsynced writes and fail on a schedule, every acknowledged write checked after every
//! crash; and a device that lies about syncing is caught.

use skiff_sim::flash::{run_flash, DeviceFaults, FlashOptions, FlashReport, Lie};

/// Seeds per run of the suite: fewer in a debug build, where a run is ten times slower
/// (`cargo test --release -p skiff-sim --test flash` runs them all in about 20 s).
const SEEDS: u64 = if cfg!(debug_assertions) { 60 } else { 200 };
const STEPS: usize = 400;

/// Seeds to run: `SKIFF_FLASH_SEEDS=FIRST..END` (a failing seed alone: `N..N+1`), or the
/// first `SEEDS`.
fn seeds() -> std::ops::Range<u64> {
    std::env::var("SKIFF_FLASH_SEEDS")
        .ok()
        .and_then(|v| {
            let (a, b) = v.split_once("..")?;
            Some(a.parse().ok()?..b.parse().ok()?)
        })
        .unwrap_or(0..SEEDS)
}

#[test]
fn crashes_torn_writes_and_failing_devices_lose_no_acknowledged_write() {
    let mut total = FlashReport::default();
    let mut failures = Vec::new();
    let seeds = seeds();
    let many = seeds.end - seeds.start >= SEEDS;
    for seed in seeds.clone() {
        let faults = if seed % 2 == 0 { DeviceFaults::typical() } else { DeviceFaults::NONE };
        match run_flash(FlashOptions { seed, steps: STEPS, faults, lie: Lie::None }) {
            Ok(r) => total.add(&r),
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{} of {:?} seeds failed:\n{}", failures.len(), seeds, failures.join("\n"));
    if !many {
        return;
    }
    // The runs reached what matters: crashes tore writes that recovery then saw, cleaning and
    // checkpoints ran, snapshots were taken, devices failed.
    eprintln!("{} seeds: {total:?}", seeds.end - seeds.start);
    assert!(total.crashes > 2 * SEEDS, "{total:?}");
    assert!(total.torn_writes > SEEDS / 2 && total.torn_pages_seen > 0, "{total:?}");
    assert!(total.gc_segments > SEEDS / 4 && total.checkpoints > SEEDS / 4, "{total:?}");
    assert!(total.wear_moves > SEEDS / 4, "static wear levelling moved segments: {total:?}");
    assert!(
        total.map_evictions > SEEDS && total.map_loads > SEEDS,
        "map budgets evicted leaves and read them back: {total:?}"
    );

    assert!(total.snapshots > SEEDS / 2 && total.device_errors > SEEDS / 20, "{total:?}");
    assert!(
        total.loans > SEEDS && total.loans_across_crash > SEEDS / 10 && total.loans_overwritten > SEEDS / 10,
        "pool pages were lent and sent, some after a crash, some after a write to them: {total:?}"
    );
    assert!(
        total.look_aheads > SEEDS && total.reads_landed > SEEDS && total.reads_failed > SEEDS / 10,
        "look-aheads waited for reads that landed or failed: {total:?}"
    );
    assert!(
        total.pages_read_ahead > total.device_reads_ahead,
        "some reads carried neighbouring pages together: {total:?}"
    );
}

#[test]
fn a_device_that_lies_about_syncing_is_caught() {
    let caught = (0..SEEDS).find_map(|seed| {
        run_flash(FlashOptions { seed, steps: STEPS, faults: DeviceFaults::NONE, lie: Lie::Sync }).err()
    });
    let error = caught.expect("lost acknowledged writes are found");
    let lost = ["was durable", "no write wrote", "volumes after recovery", "reopen"];
    assert!(lost.iter().any(|l| error.contains(l)), "{error}");
}

#[test]
fn seeds_that_found_bugs_pass() {
    // 666, 932: a cleaned segment freed before the trim that emptied it was durable.
    // 150: a dirty page trimmed while lent to a sender was written back after the trim, and
    // came back on replay.
    for seed in [666, 932, 150] {
        let faults = if seed % 2 == 0 { DeviceFaults::typical() } else { DeviceFaults::NONE };
        if let Err(e) = run_flash(FlashOptions { seed, steps: STEPS, faults, lie: Lie::None }) {
            panic!("{e}");
        }
    }
}

#[test]
fn a_seed_replays_exactly() {
    let run =
        || run_flash(FlashOptions { seed: 7, steps: STEPS, faults: DeviceFaults::typical(), lie: Lie::None });
    let (a, b) = (run().unwrap(), run().unwrap());
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
}
