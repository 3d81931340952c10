//! RStore's healing in the seeded simulation (`skiff_sim::heal`): memory servers crash and
//! come back (RAM empty, files whole), leases lapse, etcd goes away, writers hold stale maps;
//! file pools come back damaged in place; every read and, at the end, every copy of every
//! stripe match the acknowledged writes.
//! Planted bugs are caught.

use skiff_sim::heal::{run_heal, HealOptions, HealReport, Lie};

const SEEDS: u64 = if cfg!(debug_assertions) { 150 } else { 500 };
const STEPS: usize = 3000;

/// Seeds to run: `SKIFF_HEAL_SEEDS=FIRST..END` (a failing seed alone: `N..N+1`), or the
/// first `SEEDS`.
fn seeds() -> std::ops::Range<u64> {
    std::env::var("SKIFF_HEAL_SEEDS")
        .ok()
        .and_then(|v| {
            let (a, b) = v.split_once("..")?;
            Some(a.parse().ok()?..b.parse().ok()?)
        })
        .unwrap_or(0..SEEDS)
}

#[test]
fn crashes_restarts_and_stale_maps_lose_no_acknowledged_write_and_every_copy_heals() {
    let mut total = HealReport::default();
    let mut failures = Vec::new();
    for seed in seeds() {
        match run_heal(HealOptions { seed, steps: STEPS, lie: Lie::None }) {
            Ok(r) => total.add(&r),
            Err(e) => failures.push(e),
        }
    }
    eprintln!("heal simulation: {total:?}");
    assert!(
        failures.is_empty(),
        "{} failing seeds (replay one: SKIFF_HEAL_SEEDS=N..N+1):\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The runs did what they are for.
    assert!(total.crashes > 0 && total.repairs > 0 && total.partial > 0, "{total:?}");
    assert!(total.remaps > 0 && total.relocations > 0 && total.etcd_outages > 0, "{total:?}");
    assert!(total.damaged > 0 && total.mismatched > 0, "{total:?}");
}

#[test]
fn planted_bugs_are_caught() {
    for lie in [Lie::SkipDirty, Lie::AcceptStale, Lie::NoVerify] {
        let caught = (0..SEEDS).find_map(|seed| run_heal(HealOptions { seed, steps: STEPS, lie }).err());
        assert!(caught.is_some(), "{lie:?} went unnoticed over {SEEDS} seeds");
        eprintln!("{lie:?}: {}", caught.unwrap());
    }
}

#[test]
fn a_seed_replays_exactly() {
    let run = || run_heal(HealOptions { seed: 11, steps: STEPS, lie: Lie::None });
    assert_eq!(run(), run());
}
