//! Seeded "fuzz smoke" of the client session under a hostile target: thousands of plausible
//! and mutated completion streams through `skiff_proto::fuzz_api::client_session`, which asserts the
//! session's invariants. Deterministic; a failure prints its input, which `cargo fuzz run
//! client_session` accepts as a file. `cargo fuzz` runs the same entry point without limits.

use std::panic::{catch_unwind, AssertUnwindSafe};

const SEED: u64 = 0xc11e_47f0_5e55_1011;
const CASES: u64 = 20_000;

use wire::fuzz_api::SplitMix64 as Rng;

/// An input in `fuzz_api`'s format whose frames are mostly plausible completion caravans for
/// the requests it submits.
fn plausible(rng: &mut Rng) -> Vec<u8> {
    let requests = 1 + rng.below(16) as u8;
    let kinds: Vec<u8> = (0..requests).map(|_| rng.below(5) as u8).collect();
    let mut v = vec![rng.below(256) as u8, rng.below(256) as u8, requests - 1];
    v.extend(&kinds);
    let data_len = |k: u8| match k {
        0 => 512u32,
        1 => 4096,
        _ => 0,
    };
    let mut tags: Vec<u32> = (0..u32::from(requests)).collect();
    while !tags.is_empty() {
        let n = (1 + rng.below(tags.len() as u64)) as usize;
        let batch: Vec<u32> = tags.drain(..n).collect();
        let mut descs = Vec::new();
        let mut payload = Vec::new();
        for &tag in &batch {
            let ok = rng.below(8) != 0;
            let len = if ok { data_len(kinds[tag as usize]) } else { 0 };
            let tag = if rng.below(50) == 0 { tag + 1 } else { tag };
            descs.extend(tag.to_le_bytes());
            descs.extend((if ok { 0u16 } else { 9 }).to_le_bytes());
            descs.extend([0u8; 2]);
            descs.extend(len.to_le_bytes());
            descs.extend([0u8; 4]);
            payload.resize(payload.len() + len as usize, 0x77);
        }
        // Mode 0 (a correct header), kind index 0 (Completions).
        v.extend([0u8, 0, batch.len() as u8]);
        v.extend(((payload.len() % 9000) as u16).to_le_bytes());
        v.extend(descs);
        v.extend(payload);
    }
    v
}

fn mutate(rng: &mut Rng, mut v: Vec<u8>) -> Vec<u8> {
    for _ in 0..rng.below(4) {
        if v.is_empty() {
            break;
        }
        let at = rng.below(v.len() as u64) as usize;
        match rng.below(3) {
            0 => v[at] ^= 1 << rng.below(8),
            1 => v[at] = rng.below(256) as u8,
            _ => v.truncate(at),
        }
    }
    v
}

#[test]
fn hostile_completion_streams_never_break_the_session() {
    let mut rng = Rng(SEED);
    for case in 0..CASES {
        let input = match case % 4 {
            0 => (0..rng.below(300)).map(|_| rng.below(256) as u8).collect(),
            1 => plausible(&mut rng),
            _ => {
                let p = plausible(&mut rng);
                mutate(&mut rng, p)
            }
        };
        let outcome = catch_unwind(AssertUnwindSafe(|| skiff_proto::fuzz_api::client_session(&input)));
        assert!(outcome.is_ok(), "case {case} broke an invariant; input: {input:02x?}");
    }
}

/// The `capability` target's checks on seeded inputs: plausible capabilities and bodies, and
/// mutations of them.
#[test]
fn capability_smoke() {
    let mut rng = Rng(SEED ^ 0xcab);
    for case in 0..CASES {
        let which = (case % 3) as u8;
        let mut input = vec![which];
        let len = match which {
            0 => 56,
            1 => 4 + 56 * rng.below(3) as usize,
            _ => rng.below(64) as usize,
        };
        input.extend((0..len).map(|_| rng.below(256) as u8));
        if which == 0 {
            input[5] = 1 + rng.below(2) as u8; // kind
            input[6] = rng.below(4) as u8; // rights
            input[7] = 0;
            input[8] = 0;
        }
        if which == 1 {
            let count = ((len - 4) / 56) as u16;
            input[1..3].copy_from_slice(&count.to_le_bytes());
            input[3] = 0;
            input[4] = 0;
            for c in 0..count as usize {
                input[5 + c * 56 + 4] = 1 + rng.below(2) as u8;
                input[5 + c * 56 + 5] = rng.below(4) as u8;
                input[5 + c * 56 + 6] = 0;
                input[5 + c * 56 + 7] = 0;
            }
        }
        let input = mutate(&mut rng, input);
        if catch_unwind(AssertUnwindSafe(|| skiff_proto::fuzz_api::capability(&input))).is_err() {
            panic!("capability case {case} failed; input: {input:02x?}");
        }
    }
}

/// The `keys` target's checks on seeded key files and access lists, and mutations of them.
#[test]
fn keys_smoke() {
    let mut rng = Rng(SEED ^ 0x6b65);
    let seeds: [&[u8]; 4] = [
        b"\0alice:00112233445566778899aabbccddeeff\n# c\nbob:ffeeddccbbaa99887766554433221100\n",
        b"\0a:0011\n\nb c:zz\n",
        b"\x01alice:rw+bob:ro+*:ro",
        b"\x01*:rw+x:r",
    ];
    for case in 0..CASES {
        let input = mutate(&mut rng, seeds[(case % 4) as usize].to_vec());
        if catch_unwind(AssertUnwindSafe(|| skiff_proto::fuzz_api::keys(&input))).is_err() {
            panic!("keys case {case} failed; input: {input:02x?}");
        }
    }
}
