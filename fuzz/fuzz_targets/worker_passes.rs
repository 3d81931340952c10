//! The target's worker passes over modelled edge-triggered sockets, with the schedule (how
//! the peers' bytes are cut, when they read, when the worker polls, what happens in the middle
//! of a pass) taken from the input: see `skiff_server::model`. A connection must never sleep
//! while bytes it can use are waiting, and every request must get its reply.
#![no_main]

use libfuzzer_sys::fuzz_target;
use skiff_server::model::{run, FromBytes};

fuzz_target!(|data: &[u8]| {
    if let Err(e) = run(Box::new(FromBytes::new(data))) {
        panic!("{e}");
    }
});
