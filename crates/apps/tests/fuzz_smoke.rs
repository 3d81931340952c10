//! A seeded mutation "fuzz smoke" test of Carafe's edge-list parser: about 20,000 mutated edge
//! lists through `carafe::build::fuzz_api::edge_list`, which asserts its invariants (no panic;
//! errors name their line; what parses prints back the same; the graph built is well formed).
//! Deterministic: a failure names its case, and rerunning reproduces it. `cargo fuzz run
//! edge_list` runs the same entry point without the case limit.

use std::panic::{catch_unwind, AssertUnwindSafe};

use skiff_apps::carafe::build::{fuzz_api::edge_list, Rng};

const SEED: u64 = 0xca2a_fe5e_edf0_0d11;
const CASES: u64 = 20_000;

/// A small valid edge list of the kinds SNAP files hold.
fn seed_input(rng: &mut Rng) -> Vec<u8> {
    let mut s = String::from("# Directed graph\n# FromNodeId\tToNodeId\n");
    for _ in 0..rng.below(12) {
        let (a, b) = (rng.below(50), rng.below(50));
        match rng.below(4) {
            0 => s += &format!("{a}\t{b}\t{}\n", rng.below(100)),
            1 => s += &format!("  {a} {b}  \n"),
            2 => s += "\n",
            _ => s += &format!("{a}\t{b}\n"),
        }
    }
    s.into_bytes()
}

fn mutate(rng: &mut Rng, data: &mut Vec<u8>) {
    const PIECES: [&[u8]; 12] = [
        b"-",
        b"18446744073709551616",
        b"1e9",
        b"NaN",
        b"inf",
        b"\t",
        b"\n",
        b"#",
        b" 0x1",
        b"\xff\xfe",
        b"+",
        b"99999999999",
    ];
    for _ in 0..1 + rng.below(4) {
        let at = if data.is_empty() { 0 } else { rng.below(data.len() as u64 + 1) as usize };
        match rng.below(4) {
            0 if !data.is_empty() => {
                let i = at.min(data.len() - 1);
                data[i] = rng.next_u64() as u8;
            }
            1 if !data.is_empty() => {
                let end = (at + rng.below(8) as usize).min(data.len());
                data.drain(at.min(end)..end);
            }
            _ => {
                let piece = PIECES[rng.below(PIECES.len() as u64) as usize];
                data.splice(at..at, piece.iter().copied());
            }
        }
    }
}

#[test]
fn mutated_edge_lists_never_break_the_parser_or_the_graph_it_builds() {
    let mut rng = Rng::new(SEED);
    for case in 0..CASES {
        let mut data = seed_input(&mut rng);
        mutate(&mut rng, &mut data);
        let outcome = catch_unwind(AssertUnwindSafe(|| edge_list(&data)));
        assert!(outcome.is_ok(), "case {case}: {:?}", String::from_utf8_lossy(&data));
    }
}
