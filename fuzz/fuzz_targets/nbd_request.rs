//! A stream of NBD transmission-phase bytes: request headers, with WRITE payloads skipped.
//!
//! Each input is replayed by `skiff_nbd::fuzz_api::fuzz_request` against three sessions: the
//! writable export with simple replies only, and the writable and the read-only export with
//! structured replies and `base:allocation`. The checks are shared with the seeded smoke test:
//! no panic; a refused request gets a nonzero errno; every skiff status maps to a known errno,
//! and to 0 only for `Ok`; every accepted request can be answered simply and, where
//! negotiated, with each kind of structured chunk.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| skiff_nbd::fuzz_api::fuzz_request(data));
