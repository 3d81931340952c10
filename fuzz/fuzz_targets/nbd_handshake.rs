//! Client bytes for an NBD server handshake, and the transmission phase after it.
//!
//! The whole input is what a client sends after the greeting: client flags, options, and, if
//! GO or EXPORT_NAME succeeds, request headers. `skiff_nbd::fuzz_api::fuzz_handshake` holds
//! the checks, so this target and the seeded smoke test (`crates/nbd/tests/fuzz_smoke.rs`)
//! cannot drift apart: no panic, the same replies and outcome whether the input arrives whole
//! or one byte at a time, never more than `HANDSHAKE_INPUT_MAX` bytes waited on, and every
//! request after a finished handshake answerable in the session's reply styles.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| skiff_nbd::fuzz_api::fuzz_handshake(data));
