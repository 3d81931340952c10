//! The client session under a hostile target: see `skiff_proto::fuzz_api::client_session`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| skiff_proto::fuzz_api::client_session(data));
