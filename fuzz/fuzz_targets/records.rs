//! RStore's control-plane records as a client reads them from etcd, which may hold anything
//! (another program's keys, a record cut short, a bit flipped). See
//! `skiff_coord::schema::fuzz_records`: no panic, and what parses stays within its bounds as
//! the control path walks it.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    skiff_coord::schema::fuzz_records(data);
});
