//! The native protocol over raw Ethernet end to end (issue 16): a real target listening with
//! `--eth` inside a network namespace, lanes connecting to `eth:IFACE/MAC` from outside, every
//! byte written read back; then the same through the fault relay at 5% loss with duplicates,
//! reordering and corruption, where every read must still be right. Root only.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use initiator::{Lane, LaneConfig, Limits};
use skiff_tests::netns::{self, VethPair};
use skiff_tests::{start_target_with, verify};
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
                verify::write_read(&mut lane, t, base, 4 << 20, 4096, 32);
                verify::write_read(&mut lane, t + 10, base + (8 << 20), 4 << 20, 128 << 10, 4);
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
