//! Capabilities and `CAPABILITIES` bodies from fuzzer bytes: `skiff_proto::fuzz_api::capability`
//! decodes, re-encodes and checks them (no panic; nothing unsealed or altered ever passes).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| skiff_proto::fuzz_api::capability(data));
