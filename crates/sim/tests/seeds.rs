//! The simulation's own proof: a thousand seeds with every fault pass, a seed replays exactly,
//! and every planted bug is caught within that budget.

use skiff_sim::disk::DiskFaults;
use skiff_sim::faults::NetFaults;
use skiff_sim::{run, LinkKind, Options, Planted};

/// The CI budget: seeds per run of the suite.
const SEEDS: u64 = 1000;
const OPS: usize = 300;

fn all_faults(seed: u64, planted: Planted) -> Options {
    Options {
        seed,
        ops: OPS,
        net: NetFaults::typical(),
        disk: DiskFaults::typical(),
        planted,
        link: LinkKind::Pipe,
    }
}

#[test]
fn a_thousand_seeds_with_every_fault_pass() {
    let mut failures = Vec::new();
    let mut total = skiff_sim::Report::default();
    for seed in 0..SEEDS {
        match run(&all_faults(seed, Planted::None)) {
            Ok(r) => total.add(&r),
            Err(f) => failures.push(f.to_string()),
        }
    }
    let faults = total.net_faults;
    assert!(failures.is_empty(), "{} of {SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    // The faults were real: every kind struck, many times.
    assert!(
        faults.iter().all(|&n| n > 50),
        "faults injected (short, blocked, delayed, disconnects, flips): {faults:?}"
    );
    // Authentication was exercised: about half the seeds proved a key on every connection.
    assert!(
        total.authenticated_runs > SEEDS / 4 && total.authenticated_runs < SEEDS * 3 / 4,
        "{} seeds authenticated",
        total.authenticated_runs
    );
    // Reconnection was exercised: about half the seeds resumed, many times over.
    assert!(
        total.resuming_runs > SEEDS / 4 && total.resuming_runs < SEEDS * 3 / 4 && total.reattaches > 300,
        "{} seeds resumed, {} reattaches",
        total.resuming_runs,
        total.reattaches
    );
}

#[test]
fn without_faults_every_request_succeeds() {
    for seed in 0..100 {
        let opts =
            Options { net: NetFaults::NONE, disk: DiskFaults::NONE, ..all_faults(seed, Planted::None) };
        let r = run(&opts).unwrap_or_else(|f| panic!("{f}"));
        assert_eq!((r.ops_ok, r.ops_failed, r.connections), (OPS as u64, 0, 1), "seed {seed}: {r:?}");
    }
}

#[test]
fn a_seed_replays_exactly() {
    for seed in [3, 77, 901] {
        let a = run(&all_faults(seed, Planted::None)).unwrap();
        let b = run(&all_faults(seed, Planted::None)).unwrap();
        assert_eq!(format!("{a:?}"), format!("{b:?}"), "seed {seed}");
        #[cfg(feature = "mutations")]
        {
            let failed = |s| run(&all_faults(s, Planted::SwapTags)).err().map(|f| f.to_string());
            assert_eq!(failed(seed), failed(seed), "a failure replays with the same message");
        }
    }
}

#[test]
#[cfg(feature = "mutations")]
fn every_planted_bug_is_caught_within_the_seed_budget() {
    for planted in Planted::ALL {
        let caught = (0..SEEDS).find_map(|seed| run(&all_faults(seed, planted)).err());
        let f = caught.unwrap_or_else(|| {
            panic!("{planted:?} survived {SEEDS} seeds: the simulation has no teeth there")
        });
        eprintln!("{planted:?}: caught by seed {}: {}", f.seed, f.message.lines().next().unwrap_or_default());
    }
}

/// Direct reads (ODAFS): two initiators, writes, evictions, key rotations, invalidations and
/// expiries against direct reads, on RAM, a cached backend and a flash volume (with
/// snapshots, GC and checkpoints under its extents); every byte read checked.
#[test]
fn a_thousand_direct_read_seeds_pass_and_a_stale_cache_is_caught() {
    use skiff_sim::direct;
    let mut total = direct::Report::default();
    let mut failures = Vec::new();
    for seed in 0..SEEDS {
        match direct::run(&direct::Options { seed, ops: OPS, stale_cache: false }) {
            Ok(r) => total.add(&r),
            Err(e) => failures.push(format!("seed {seed}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{} of {SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    eprintln!("direct reads over {SEEDS} seeds: {total:?}");
    assert!(total.direct_reads > SEEDS * 20, "{total:?}");
    assert!(total.direct_faults > SEEDS && total.fallbacks == total.direct_faults, "{total:?}");
    assert!(
        total.rotations > SEEDS / 2 && total.invalidations > SEEDS && total.cache_evictions > SEEDS * 10,
        "{total:?}"
    );
    // A third of the seeds read a flash volume under extents while its pages move.
    assert!(total.flash_runs > SEEDS / 5 && total.flash_direct_reads > total.flash_runs * 20, "{total:?}");
    assert!(total.direct_writes > total.flash_runs * 10, "{total:?}");
    assert!(total.snapshots > total.flash_runs && total.gc_steps > total.flash_runs / 2, "{total:?}");
    let a = direct::run(&direct::Options { seed: 42, ops: OPS, stale_cache: false }).unwrap();
    let b = direct::run(&direct::Options { seed: 42, ops: OPS, stale_cache: false }).unwrap();
    assert_eq!(format!("{a:?}"), format!("{b:?}"), "a seed replays exactly");
    planted_stale_cache_is_caught();
}

#[cfg(feature = "mutations")]
fn planted_stale_cache_is_caught() {
    use skiff_sim::direct;
    let caught =
        (0..SEEDS).find_map(|seed| direct::run(&direct::Options { seed, ops: OPS, stale_cache: true }).err());
    let message = caught.expect("a cache that writes do not invalidate survived every seed");
    eprintln!("stale cache caught: {}", message.lines().next().unwrap_or_default());
}

/// Without the feature `mutations` the bug cannot be planted, and a run that asks for it says so.
#[cfg(not(feature = "mutations"))]
fn planted_stale_cache_is_caught() {
    use skiff_sim::direct;
    let e = direct::run(&direct::Options { seed: 0, ops: OPS, stale_cache: true }).unwrap_err();
    assert_eq!(e, skiff_sim::NO_PLANTED_BUGS);
}
