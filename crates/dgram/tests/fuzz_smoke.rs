//! Seeded "fuzz smoke" of the datagram stack: thousands of random move lists through
//! `skiff_dgram::fuzz_api`, which asserts the streams' and the bundle's invariants.
//! Deterministic; a failure prints its input, which `cargo fuzz run datagram` (or `bundle`)
//! accepts as a file. `cargo fuzz` runs the same entry points without limits.

use std::panic::{catch_unwind, AssertUnwindSafe};

use wire::fuzz_api::SplitMix64 as Rng;

const SEED: u64 = 0xc11e_47f0_5e55_1011;
const CASES: u64 = 20_000;

/// The `datagram` target's checks on seeded inputs: random move lists (every byte is a valid
/// move, so random input already drives the streams through writes, losses, timeouts and
/// forgeries), half of them with many exchanges and time steps mixed in so that data flows.
#[test]
fn reliable_stream_smoke() {
    let mut rng = Rng(SEED ^ 0xda7a);
    for case in 0..CASES / 4 {
        let len = rng.below(600) as usize;
        let mut input: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
        if case % 2 == 0 {
            // Bias moves toward writes (0), reads (1), time (2) and exchanges (3).
            for (i, b) in input.iter_mut().enumerate().skip(5) {
                if i % 3 == 0 {
                    *b = (*b & 0x80) | (*b % 4);
                }
            }
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| skiff_dgram::fuzz_api::reliable_stream(&input)));
        assert!(outcome.is_ok(), "case {case} broke an invariant; input: {input:02x?}");
    }
}

/// The `bundle` target's checks on seeded inputs (every byte is a valid move).
#[test]
fn bundle_smoke() {
    let mut rng = Rng(SEED ^ 0xb0b);
    for case in 0..CASES / 4 {
        let len = rng.below(400) as usize;
        let input: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
        let outcome = catch_unwind(AssertUnwindSafe(|| skiff_dgram::fuzz_api::bundle(&input)));
        assert!(outcome.is_ok(), "case {case} broke an invariant; input: {input:02x?}");
    }
}
