//! A seeded mutation "fuzz smoke" test: about 20,000 mutated handshakes and request streams
//! through the `fuzz_api` entry points, which assert the crate's invariants (no panic; the
//! same outcome however the input is split; bounded waiting). Deterministic: a failure
//! names its case and input, and rerunning reproduces it. `cargo fuzz` runs the same entry
//! points without the case limit.

use std::panic::{catch_unwind, AssertUnwindSafe};

use skiff_nbd::fuzz_api::{fuzz_config, fuzz_handshake, fuzz_request, run_handshake, End};
use skiff_nbd::{Cmd, CmdFlags, Request};

const SEED: u64 = 0x5eed_f00d_5b1f_f00d;
const HANDSHAKE_CASES: u64 = 12_000;
const REQUEST_CASES: u64 = 8_000;

/// splitmix64: tiny, fast, and good enough to drive a mutator.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn option(code: u32, data: &[u8]) -> Vec<u8> {
    let mut v = 0x4948_4156_454f_5054u64.to_be_bytes().to_vec();
    v.extend_from_slice(&code.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

fn string(s: &[u8]) -> Vec<u8> {
    [&(s.len() as u32).to_be_bytes()[..], s].concat()
}

fn request(cmd: Cmd, flags: CmdFlags, offset: u64, length: u32) -> Vec<u8> {
    let mut out = Vec::new();
    Request { flags, cmd, cookie: offset ^ 0xc0c0, offset, length }.emit(&mut out);
    if cmd == Cmd::Write {
        out.resize(out.len() + length as usize, 0x5a);
    }
    out
}

fn requests() -> Vec<u8> {
    [
        request(Cmd::Read, CmdFlags::empty(), 0, 4096),
        request(Cmd::Write, CmdFlags::FUA, 4096, 64),
        request(Cmd::Read, CmdFlags::DF, 512, 512),
        request(Cmd::Flush, CmdFlags::empty(), 0, 0),
        request(Cmd::Trim, CmdFlags::empty(), 0, 1 << 20),
        request(Cmd::WriteZeroes, CmdFlags::NO_HOLE | CmdFlags::FAST_ZERO, 0, 8192),
        request(Cmd::BlockStatus, CmdFlags::REQ_ONE, 0, 1 << 16),
        request(Cmd::Cache, CmdFlags::empty(), 0, 4096),
        request(Cmd::Unknown(8), CmdFlags::from_bits(0x40), 0, 0),
        request(Cmd::Disc, CmdFlags::empty(), 0, 0),
    ]
    .concat()
}

/// Valid client transcripts covering every option we handle, most followed by requests.
fn handshake_seeds() -> Vec<Vec<u8>> {
    let no_zeroes = 3u32.to_be_bytes().to_vec();
    let meta =
        |export: &[u8], query: &[u8]| [string(export), 1u32.to_be_bytes().to_vec(), string(query)].concat();
    let go = |export: &[u8], infos: &[u16]| {
        let mut data = string(export);
        data.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        infos.iter().for_each(|i| data.extend_from_slice(&i.to_be_bytes()));
        data
    };
    vec![
        [
            no_zeroes.clone(),
            option(8, &[]),
            option(9, &[string(b"disk"), 0u32.to_be_bytes().to_vec()].concat()),
            option(10, &meta(b"disk", b"base:allocation")),
            option(7, &go(b"disk", &[1, 2, 3])),
            requests(),
        ]
        .concat(),
        [
            no_zeroes.clone(),
            option(3, &[]),
            option(6, &go(b"ro", &[3])),
            option(7, &go(b"ro", &[3])),
            requests(),
        ]
        .concat(),
        [1u32.to_be_bytes().to_vec(), option(1, b"disk"), requests()].concat(),
        [no_zeroes.clone(), option(42, b"xyz"), option(5, &[]), option(7, &go(b"nope", &[])), option(2, &[])]
            .concat(),
        [no_zeroes, option(10, &meta(b"", b"base:")), option(8, &[]), option(1, b""), requests()].concat(),
    ]
}

const INTERESTING_U32: [u32; 9] = [0, 1, 4, 4096, 4097, 0x1_0000, 0x1_0001, 0x7fff_ffff, 0xffff_ffff];
const INTERESTING_U8: [u8; 5] = [0, 1, 0x7f, 0x80, 0xff];

fn mutate(rng: &mut SplitMix64, input: &mut Vec<u8>, seeds: &[Vec<u8>]) {
    for _ in 0..1 + rng.below(4) {
        let len = input.len().max(1);
        let at = rng.below(len).min(input.len());
        match rng.below(8) {
            0 if at < input.len() => input[at] ^= 1 << rng.below(8),
            1 if at < input.len() => input[at] = INTERESTING_U8[rng.below(5)],
            2 if input.len() >= 4 => {
                let at = at.min(input.len() - 4);
                let v = INTERESTING_U32[rng.below(INTERESTING_U32.len())];
                input[at..at + 4].copy_from_slice(&v.to_be_bytes());
            }
            3 => input.truncate(at),
            4 => {
                let end = (at + 1 + rng.below(32)).min(input.len());
                input.drain(at..end);
            }
            5 => {
                let end = (at + 1 + rng.below(32)).min(input.len());
                let copy = input[at..end].to_vec();
                input.splice(at..at, copy);
            }
            6 => {
                let noise: Vec<u8> = (0..1 + rng.below(8)).map(|_| rng.next() as u8).collect();
                input.splice(at..at, noise);
            }
            _ => {
                let other = &seeds[rng.below(seeds.len())];
                let from = rng.below(other.len().max(1)).min(other.len());
                input.truncate(at);
                input.extend_from_slice(&other[from..]);
            }
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn check(what: &str, case: u64, input: &[u8], f: impl FnOnce(&[u8])) {
    if catch_unwind(AssertUnwindSafe(|| f(input))).is_err() {
        panic!("{what} case {case} (seed {SEED:#x}) failed on input {}", hex(input));
    }
}

#[test]
fn mutated_handshakes() {
    let seeds = handshake_seeds();
    let config = fuzz_config().unwrap();
    for seed in &seeds {
        let end = run_handshake(&config, seed, usize::MAX).end;
        assert!(!matches!(end, End::Failed(_)), "seed fails unmutated: {end:?}");
    }
    let mut rng = SplitMix64(SEED);
    let mut ends = [0u32; 4];
    for case in 0..HANDSHAKE_CASES {
        let mut input = if case % 16 == 0 {
            // Now and then, pure noise after valid client flags.
            let noise: Vec<u8> = (0..rng.below(64)).map(|_| rng.next() as u8).collect();
            [&[0, 0, 0, 3][..], &noise].concat()
        } else {
            seeds[rng.below(seeds.len())].clone()
        };
        mutate(&mut rng, &mut input, &seeds);
        check("handshake", case, &input, fuzz_handshake);
        let slot = match run_handshake(&config, &input, usize::MAX).end {
            End::NeedMore { .. } => 0,
            End::Done { .. } => 1,
            End::Close { .. } => 2,
            End::Failed(_) => 3,
        };
        ends[slot] += 1;
    }
    // The mutator must reach every ending, or it is not exploring much.
    assert!(ends.iter().all(|&n| n > 50), "outcomes (need more, done, close, failed): {ends:?}");
}

#[test]
fn mutated_request_streams() {
    let seeds = vec![requests(), request(Cmd::Write, CmdFlags::empty(), 0, 300)];
    let mut rng = SplitMix64(SEED ^ 0xffff);
    for case in 0..REQUEST_CASES {
        let mut input = seeds[rng.below(seeds.len())].clone();
        mutate(&mut rng, &mut input, &seeds);
        check("request", case, &input, fuzz_request);
    }
}
