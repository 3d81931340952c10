//! The native protocol over raw Ethernet end to end (issue 16): a real target listening with
//! `--eth` inside a network namespace, lanes connecting to `eth:IFACE/MAC` from outside, every
//! byte written read back; then the same through the fault relay at 5% loss with duplicates,
//! reordering and corruption, where every read must still be right. Root only.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use initiator::{Completion, Lane, LaneConfig, Limits, Queue, ReqFlags, Status};
use skiff_tests::netns::{self, VethPair};
use skiff_tests::start_target_with;
use transport::packet::{PacketSocket, RingConfig, ETHERTYPE};
use transport::relay::{self, FaultRates};
use transport::Endpoint;

const MTU: u32 = 9000;

/// A target in the far end's namespace, listening on raw Ethernet only; its endpoint
/// (`eth:IFACE/MAC`) as seen from `near_iface`.
fn target_on(pair: &VethPair, near_iface: &str) -> (server::Target, Endpoint) {
    let iface = pair.peer.clone();
    let t = pair.in_ns(move || {
        start_target_with(&["vol=ram:64M"], |c| {
            c.listen = vec![Endpoint::Eth { iface, mac: None }];
            c.workers = 2;
        })
    });
    let Some(Endpoint::Eth { mac: Some(mac), .. }) = t.endpoints().into_iter().next() else {
        panic!("the target reports its Ethernet endpoint with its MAC")
    };
    (t, Endpoint::Eth { iface: near_iface.to_owned(), mac: Some(mac) })
}

fn block(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed as usize * 131 + offset as usize / 512 * 7 + i) as u8).collect()
}

/// Write `bytes` from `base` in `bs` pieces with `qd` in flight, read them back, check.
fn write_read_verify(lane: &mut Lane, seed: u64, base: u64, bytes: u64, bs: usize, qd: usize) {
    let offsets: Vec<u64> = (0..bytes / bs as u64).map(|i| base + i * bs as u64).collect();
    let mut out: Vec<Completion> = Vec::new();
    for (n, &off) in offsets.iter().enumerate() {
        while lane.in_flight() >= qd {
            lane.wait(1, &mut out).unwrap();
        }
        lane.submit_write(off, block(seed, off, bs), ReqFlags::empty(), n as u64).unwrap();
    }
    lane.wait(usize::MAX, &mut out).unwrap();
    assert!(out.iter().all(|c| c.status == Status::Ok), "a write failed");
    out.clear();
    for (n, &off) in offsets.iter().enumerate() {
        while lane.in_flight() >= qd {
            lane.wait(1, &mut out).unwrap();
        }
        lane.submit_read(off, vec![0; bs], n as u64).unwrap();
    }
    lane.wait(usize::MAX, &mut out).unwrap();
    assert_eq!(out.len(), offsets.len());
    for c in out {
        assert_eq!(c.status, Status::Ok);
        let off = offsets[c.user_data as usize];
        assert!(c.buf.unwrap() == block(seed, off, bs), "offset {off} read back wrong");
    }
}

fn lane_config() -> LaneConfig {
    LaneConfig { limits: Limits { queue_depth: 32, ..LaneConfig::default().limits }, ..LaneConfig::default() }
}

/// Two lanes at once, small and large I/Os, every byte checked.
fn exercise(endpoint: &Endpoint) {
    let threads: Vec<_> = (0..2u64)
        .map(|t| {
            let ep = endpoint.clone();
            std::thread::spawn(move || {
                let mut lane = Lane::connect(&ep, "vol", &lane_config()).expect("a lane over raw Ethernet");
                let base = t * (16 << 20);
                write_read_verify(&mut lane, t, base, 4 << 20, 4096, 32);
                write_read_verify(&mut lane, t + 10, base + (8 << 20), 4 << 20, 128 << 10, 4);
            })
        })
        .collect();
    for h in threads {
        h.join().expect("a lane failed");
    }
}

#[test]
fn lanes_over_raw_ethernet_read_back_every_byte() {
    if !netns::available("lanes over raw Ethernet") {
        return;
    }
    let pair = VethPair::new(MTU);
    let (t, endpoint) = target_on(&pair, &pair.host);
    exercise(&endpoint);
    let s = t.stats();
    assert_eq!(s.get("req_write"), Some(2 * (1024 + 32)));
    assert_eq!(s.get("req_read"), Some(2 * (1024 + 32)));
}

#[test]
fn lanes_over_raw_ethernet_ride_through_loss_duplicates_reordering_and_corruption() {
    if !netns::available("lanes through the fault relay") {
        return;
    }
    let (client_pair, target_pair) = (VethPair::new(MTU), VethPair::new(MTU));
    let (t, far) = target_on(&target_pair, &client_pair.peer);
    // The client lives in its pair's far namespace; the relay bridges the two near ends.
    let left = PacketSocket::open(
        &client_pair.host,
        ETHERTYPE,
        RingConfig { qdisc_bypass: false, ..RingConfig::default() },
    )
    .unwrap();
    let right = PacketSocket::open(
        &target_pair.host,
        ETHERTYPE,
        RingConfig { qdisc_bypass: false, ..RingConfig::default() },
    )
    .unwrap();
    let rates = FaultRates { drop: 0.05, duplicate: 0.02, reorder: 0.02, corrupt: 0.02 };
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let bridge = std::thread::spawn(move || relay::run(left, right, rates, 11, &stop2, |_, _| {}).unwrap());
    client_pair.in_ns(move || exercise(&far));
    stop.store(true, Ordering::Relaxed);
    let (lr, rl) = bridge.join().unwrap();
    assert!(lr.dropped > 20 && rl.dropped > 20, "the faults were real: {lr:?} {rl:?}");
    assert!(lr.corrupted + rl.corrupted > 5 && lr.duplicated + rl.duplicated > 5, "{lr:?} {rl:?}");
    let s = t.stats();
    assert_eq!(s.get("req_write"), Some(2 * (1024 + 32)), "every write ran exactly once");
}
