//! Key files and access lists from fuzzer bytes: `skiff_proto::fuzz_api::keys` (no panic; what
//! parses is valid and round-trips).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| skiff_proto::fuzz_api::keys(data));
