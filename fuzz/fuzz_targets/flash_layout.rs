//! The flash array's on-device pages and its checkpoint stream, as recovery reads them from a
//! device that may hold anything.
//!
//! The first input byte picks what is parsed (modulo 10: the four page kinds without and with
//! their magic, array id and CRC made right, a checkpoint stream, then a map leaf's record read
//! back from checkpoint pages). See `skiff_flash::layout::fuzz_api`: no panic, and whatever
//! parses emits back to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use skiff_flash::layout::fuzz_api;

fuzz_target!(|data: &[u8]| {
    match data.first() {
        Some(&b) if b % 10 < 8 => fuzz_api::page(&[&[b % 10][..], &data[1..]].concat()),
        Some(&b) if b % 10 == 8 => fuzz_api::checkpoint(&data[1..]),
        Some(_) => fuzz_api::leaf(&data[1..]),
        None => {}
    }
});
