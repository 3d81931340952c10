//! NIC bundling's path state machine under arbitrary moves: see
//! `skiff_dgram::fuzz_api::bundle` (sends, arrivals, forged probes and answers, refused sends,
//! time; no panic, and the invariants hold).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| skiff_dgram::fuzz_api::bundle(data));
