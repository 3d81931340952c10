//! Carafe's edge-list parser (SNAP's text format) and the graph built from what it accepts.
//! See `apps::carafe::build::fuzz_api::edge_list`: no panic; errors name their line; what
//! parses prints back the same; the graph is well formed.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    apps::carafe::build::fuzz_api::edge_list(data);
});
