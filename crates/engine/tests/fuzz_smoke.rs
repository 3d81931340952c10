//! Seeded "fuzz smoke" of the target's native front end: thousands of frame sequences through
//! `skiff_engine::fuzz_api::native_conn`, which asserts that whatever arrives, the target answers
//! with well-formed frames and a GOAWAY only as its last word. Deterministic; a failure prints
//! its input, which `cargo fuzz run server_session` accepts as a file.

use std::panic::{catch_unwind, AssertUnwindSafe};

const SEED: u64 = 0x5e55_1011_7a96_e700;
const CASES: u64 = 10_000;

use wire::fuzz_api::SplitMix64 as Rng;

/// A request descriptor (docs/PROTOCOL.md 7.1) aimed at export handle 0.
fn request(rng: &mut Rng) -> (Vec<u8>, Vec<u8>) {
    let opcode = 1 + rng.below(6) as u8;
    let length = (rng.below(9) * 512) as u32;
    let payload_len = if opcode == 2 { length } else { 0 };
    let mut d = vec![opcode, (rng.below(8) == 0) as u8, 0, 0];
    d.extend((rng.below(64) as u32).to_le_bytes());
    d.extend((rng.below(3) as u32 / 2).to_le_bytes());
    d.extend(length.to_le_bytes());
    d.extend((rng.below(4096) * 512).to_le_bytes());
    d.extend(payload_len.to_le_bytes());
    d.extend([0u8; 4]);
    (d, vec![0x5a; payload_len as usize])
}

/// An input in `fuzz_api`'s format: preface (HELLO, OPEN), then plausible caravans and
/// control frames.
fn plausible(rng: &mut Rng) -> Vec<u8> {
    let mut v: Vec<u8> = (0..5).map(|_| rng.below(256) as u8).collect();
    v[4] |= 1; // a HELLO
    v.extend((0..6).map(|_| rng.below(256) as u8));
    for _ in 0..rng.below(6) {
        if rng.below(4) == 0 {
            // A control frame: kind index 4 (LIST) or 6 (STATS), empty body.
            v.extend([0u8, [4, 6][rng.below(2) as usize], 0, 0]);
            continue;
        }
        let n = rng.below(5) as u8;
        let (mut descs, mut payload) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let (d, p) = request(rng);
            descs.extend(d);
            payload.extend(p);
        }
        v.extend([0u8, 9, n]);
        v.extend(((payload.len() % 9000) as u16).to_le_bytes());
        v.extend(descs);
        v.extend(payload);
    }
    v
}

#[test]
fn arbitrary_frame_sequences_get_well_formed_answers() {
    let mut rng = Rng(SEED);
    for case in 0..CASES {
        let mut input = match case % 3 {
            0 => (0..rng.below(400)).map(|_| rng.below(256) as u8).collect(),
            _ => plausible(&mut rng),
        };
        if case % 3 == 2 && !input.is_empty() {
            let at = rng.below(input.len() as u64) as usize;
            input[at] ^= 1 << rng.below(8);
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| skiff_engine::fuzz_api::native_conn(&input)));
        assert!(outcome.is_ok(), "case {case} broke an invariant; input: {input:02x?}");
    }
}
