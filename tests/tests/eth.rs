//! The native protocol over raw Ethernet end to end (issue 16): a real target listening with
//! `--eth` inside a network namespace, lanes connecting to `eth:IFACE/MAC` from outside, every
//! byte written read back; then the same through the fault relay at 5% loss with duplicates,
//! reordering and corruption, where every read must still be right; and discovery: a lane to
//! `eth:IFACE` finds the one target on the segment, a silent segment or two targets are named
//! in the error. Root only.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use eth::packet::{PacketSocket, RingConfig, ETHERTYPE};
use initiator::{Lane, LaneConfig, Limits};
use relay::FaultRates;
use skiff_tests::netns::{self, Bridge, VethPair};
use skiff_tests::{start_target_with, verify};
use transport::Endpoint;

const MTU: u32 = 9000;

/// A target in the far end's namespace, listening on raw Ethernet only; its endpoint
/// (`eth:IFACE/MAC`) as seen from `near_iface`.
fn target_on(pair: &VethPair, near_iface: &str) -> (server::Target, Endpoint) {
    pair.target(near_iface, &["vol=ram:64M"], 2)
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

/// A lane its application leaves alone is not driven: nothing in it answers the target's
/// keepalives until the next call. Over TCP the kernel keeps such a connection; over raw
/// Ethernet the target must not take the silence for death within seconds. A lane idle for
/// 3 s (the target's old limit was 1.1 s) carries on in the same session.
#[test]
fn a_lane_left_idle_keeps_its_session() {
    if !netns::available("an idle lane over raw Ethernet") {
        return;
    }
    let pair = VethPair::new(MTU);
    let (t, endpoint) = target_on(&pair, &pair.host);
    let mut lane = Lane::connect(&endpoint, "vol", &lane_config()).expect("a lane over raw Ethernet");
    verify::write_read(&mut lane, 1, 0, 1 << 20, 4096, 8);
    std::thread::sleep(std::time::Duration::from_secs(3));
    verify::write_read(&mut lane, 2, 1 << 20, 1 << 20, 4096, 8);
    assert_eq!(lane.stats().reconnects, 0, "the idle session survived");
    drop(lane);
    assert_eq!(t.stats().get("req_write"), Some(2 * 256));
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

/// Discovery finds the target on a segment, and a lane to `eth:IFACE` without a MAC uses it.
#[test]
fn a_lane_finds_the_target_on_its_segment() {
    if !netns::available("discovery over raw Ethernet") {
        return;
    }
    let pair = VethPair::new(MTU);
    let (_t, endpoint) = target_on(&pair, &pair.host);
    let Endpoint::Eth { mac: Some(mac), .. } = endpoint else { unreachable!() };
    let found = eth::discover(&pair.host, std::time::Duration::from_millis(300)).unwrap();
    assert_eq!(found, vec![mac], "the one target on the segment answers, once");
    let mut lane = Lane::connect(&Endpoint::eth(pair.host.clone(), None), "vol", &lane_config())
        .expect("a lane to the target discovery found");
    verify::write_read(&mut lane, 5, 0, 1 << 20, 4096, 16);
}

/// No target on the segment, or two: a lane without a MAC fails and says why.
#[test]
fn discovery_names_a_silent_segment_and_a_crowded_one() {
    if !netns::available("discovery errors") {
        return;
    }
    let quiet = VethPair::new(MTU);
    assert!(eth::discover(&quiet.host, std::time::Duration::from_millis(200)).unwrap().is_empty());
    let err = Lane::connect(&Endpoint::eth(quiet.host.clone(), None), "vol", &lane_config())
        .err()
        .expect("no target to connect to");
    assert!(err.to_string().contains("no skiff target answered"), "{err}");

    // One segment: a client and two targets, each in a namespace of its own, bridged.
    let (client, one, two) = (VethPair::new(MTU), VethPair::new(MTU), VethPair::new(MTU));
    let _segment = Bridge::joining(&[&client, &one, &two]);
    let (_t1, e1) = target_on(&one, &client.peer);
    let (_t2, e2) = target_on(&two, &client.peer);
    let iface = client.peer.clone();
    let (found, err) = client.in_ns(move || {
        let found = eth::discover(&iface, std::time::Duration::from_millis(300)).unwrap();
        let err =
            Lane::connect(&Endpoint::eth(iface, None), "vol", &lane_config()).err().map(|e| e.to_string());
        (found, err)
    });
    let macs = |e: &Endpoint| match e {
        Endpoint::Eth { mac: Some(m), .. } => *m,
        _ => unreachable!(),
    };
    let mut want = vec![macs(&e1), macs(&e2)];
    let mut got = found.clone();
    want.sort();
    got.sort();
    assert_eq!(got, want, "both targets on the segment answer");
    let err = err.expect("two targets: the lane must be told which");
    assert!(err.contains("2 skiff targets answered"), "{err}");
    // Named, each is reachable through the bridge.
    let ep = Endpoint::eth(client.peer.clone(), Some(found[0]));
    client.in_ns(move || {
        let mut lane = Lane::connect(&ep, "vol", &lane_config()).expect("a lane to a named target");
        verify::write_read(&mut lane, 6, 0, 1 << 20, 4096, 8);
    });
}

/// NIC bundling: a target listening on two interfaces as one bundle, a lane over both
/// (`eth:A+B/MAC`). Both links carry datagrams; taking one down mid-run fails no request and
/// leaves it out; bringing it back up lets it rejoin and carry traffic again. Every byte read
/// back, every write run once, the lane never reconnected.
#[test]
fn a_bundle_of_two_links_spreads_traffic_and_rides_through_a_link_going_down() {
    if !netns::available("NIC bundling over raw Ethernet") {
        return;
    }
    let a = VethPair::new(MTU);
    let b = VethPair::beside(&a, MTU);
    let ifaces = vec![a.peer.clone(), b.peer.clone()];
    let t = a.in_ns(move || {
        start_target_with(&["vol=ram:64M"], |c| {
            c.listen = vec![Endpoint::Eth { ifaces, mac: None, options: Default::default() }];
            c.workers = 2;
        })
    });
    let Some(Endpoint::Eth { mac: Some(mac), .. }) = t.endpoints().into_iter().next() else {
        panic!("the target reports its Ethernet endpoint with its MAC")
    };
    let endpoint =
        Endpoint::parse(&format!("eth:{}+{}/{}", a.host, b.host, transport::endpoint::format_mac(&mac)))
            .unwrap();
    let mut lane = Lane::connect(&endpoint, "vol", &lane_config()).expect("a lane over a bundle");
    let paths = |lane: &Lane| lane.link_stats().expect("a raw-Ethernet lane has link counters").paths;
    let mut writes = 0u64;
    let mut round = |lane: &mut Lane, seed: u64, mib: u64| {
        verify::write_read(lane, seed, (seed % 8) * (8 << 20), mib << 20, 4096, 32);
        writes += (mib << 20) / 4096;
    };

    // Both links carry the session once the second has been found by its probes.
    let mut seed = 1;
    while paths(&lane)[1].datagrams_received == 0 && seed < 50 {
        round(&mut lane, seed, 1);
        seed += 1;
    }
    round(&mut lane, seed, 4);
    let before = paths(&lane);
    assert_eq!(before.len(), 2);
    for p in &before {
        assert!(
            p.up && p.datagrams_sent > 100 && p.datagrams_received > 100,
            "both links carry traffic: {before:?}"
        );
        assert!(p.probes_answered > 0 && p.srtt_us > 0, "each link's round trip is measured: {before:?}");
    }

    // Link B goes down while I/O runs: nothing fails, B is left out.
    let down = std::thread::spawn({
        let host = b.host.clone();
        move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let ok = std::process::Command::new("ip").args(["link", "set", &host, "down"]).status().unwrap();
            assert!(ok.success(), "ip link set {host} down");
        }
    });
    round(&mut lane, seed + 1, 16);
    down.join().unwrap();
    round(&mut lane, seed + 2, 2);
    let during = paths(&lane);
    assert!(!during[1].up && during[1].downs >= 1, "the link that went down is left out: {during:?}");
    round(&mut lane, seed + 3, 2);
    let later = paths(&lane);
    assert_eq!(
        later[1].datagrams_sent, during[1].datagrams_sent,
        "nothing goes out on a down link but probes"
    );
    assert!(later[0].datagrams_sent > during[0].datagrams_sent);

    // B comes back: probes find it and it carries traffic again.
    b.set_host_up(true);
    let mut tries = 0;
    while !paths(&lane)[1].up && tries < 2000 {
        round(&mut lane, seed + 4, 1);
        tries += 1;
    }
    let back = paths(&lane);
    assert!(back[1].up && back[1].rejoins >= 1, "the link rejoins: {back:?}");
    round(&mut lane, seed + 5, 4);
    let after = paths(&lane);
    assert!(
        after[1].datagrams_sent > back[1].datagrams_sent + 100,
        "the rejoined link carries traffic: {after:?}"
    );

    eprintln!("paths before: {before:?}\nduring: {during:?}\nafter: {after:?}\nrounds to rejoin: {tries}");
    assert_eq!(lane.stats().reconnects, 0, "the session itself never broke");
    drop(lane);
    assert_eq!(t.stats().get("req_write"), Some(writes), "every write ran exactly once");
}
