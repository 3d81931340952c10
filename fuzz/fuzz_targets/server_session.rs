//! The target's native front end fed arbitrary frame sequences: see
//! `skiff_engine::fuzz_api::native_conn`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| skiff_engine::fuzz_api::native_conn(data));
