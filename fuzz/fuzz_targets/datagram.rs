//! The raw-Ethernet datagram header and the reliable stream under a hostile network: see
//! `skiff_dgram::fuzz_api::reliable_stream` (parse arbitrary bytes, which must re-emit exactly
//! if they parse; then drive a `DatagramStream` and an honest peer with losses, duplicates,
//! bit flips, forged datagrams and raw garbage: no panic, and the invariants hold).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| skiff_dgram::fuzz_api::reliable_stream(data));
