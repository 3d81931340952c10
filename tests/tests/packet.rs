//! Raw Ethernet frames through AF_PACKET rings (eth::packet) on a veth pair whose far
//! end lives in a network namespace of its own, MTU 9000 as in the raw-Ethernet issue: frames
//! of every size from one byte to a jumbo frame cross both ways, in order and intact, with
//! both ring layouts; bounds hold (a payload over the MTU, a full transmit ring, a receive
//! ring that overflows). Root only; the namespace and the pair are removed even on failure.

use std::time::{Duration, Instant};

use skiff_tests::netns::{self, VethPair};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use dgram::reliable::ReliableConfig;
use eth::packet::{Mac, PacketSocket, RingConfig, RingVersion, ETHERTYPE};
use eth::EthStream;
use relay::FaultRates;

const MTU: u32 = 9000;

fn config(version: RingVersion) -> RingConfig {
    RingConfig { version, ..RingConfig::default() }
}

/// Sockets on both ends: (host end, far end in the namespace).
fn pair_sockets(pair: &VethPair, config: RingConfig) -> (PacketSocket, PacketSocket) {
    let host = PacketSocket::open(&pair.host, ETHERTYPE, config).expect("socket on the host end");
    let name = pair.peer.clone();
    let far =
        pair.in_ns(move || PacketSocket::open(&name, ETHERTYPE, config).expect("socket on the far end"));
    (host, far)
}

fn payload(seq: u32, len: usize) -> Vec<u8> {
    let mut p: Vec<u8> = (0..len).map(|i| (i as u32).wrapping_mul(31).wrapping_add(seq) as u8).collect();
    if len >= 4 {
        p[..4].copy_from_slice(&seq.to_le_bytes());
    }
    p
}

/// Receive until `want` frames came or 5 s passed without one; returns (source, payload).
fn receive_n(s: &mut PacketSocket, want: usize) -> Vec<(Mac, Vec<u8>)> {
    receive_within(s, want, Duration::from_secs(5))
}

/// Receive until `want` frames came or `quiet` passed without one.
fn receive_within(s: &mut PacketSocket, want: usize, quiet: Duration) -> Vec<(Mac, Vec<u8>)> {
    let mut got = Vec::new();
    let mut last = Instant::now();
    while got.len() < want && last.elapsed() < quiet {
        let n = s.receive(|src, p| got.push((src, p.to_vec())));
        if n > 0 {
            last = Instant::now();
        } else {
            let _ = transport::wait_fd(
                std::os::fd::AsRawFd::as_raw_fd(s),
                false,
                Some(Duration::from_millis(50)),
            );
        }
    }
    got
}

/// Frames of `sizes` from `from` to `to`, each checked: source, content, order.
fn transfer(from: &mut PacketSocket, to: &mut PacketSocket, sizes: &[usize], version: RingVersion) {
    let dst = to.mac();
    for (seq, &len) in sizes.iter().enumerate() {
        let p = payload(seq as u32, len);
        // The payload gathered from two pieces, as a header and its data would be.
        while !from.queue(dst, &[&p[..2], &p[2..]]).expect("queue") {
            from.flush().expect("flush");
            std::thread::sleep(Duration::from_micros(200));
        }
        if seq % 16 == 15 {
            from.flush().expect("flush");
        }
    }
    from.flush().expect("flush");
    // The receive ring holds every frame of the run: nothing needs reading ahead.
    let got = receive_n(to, sizes.len());
    assert_eq!(got.len(), sizes.len(), "{version:?}: frames lost on a quiet veth pair");
    for (seq, ((src, p), &len)) in got.iter().zip(sizes).enumerate() {
        assert_eq!(*src, from.mac(), "{version:?}: source of frame {seq}");
        assert!(
            *p == payload(seq as u32, len),
            "{version:?}: frame {seq} ({len} bytes) arrived changed or out of order"
        );
    }
}

/// Every size from 4 bytes to the MTU, in order, both ways.
fn both_ways(version: RingVersion) {
    if !netns::available("raw frames cross a veth pair") {
        return;
    }
    let pair = VethPair::new(MTU);
    let (mut a, mut b) = pair_sockets(&pair, config(version));
    assert_eq!(a.mtu(), MTU as usize);
    assert_ne!(a.mac(), b.mac());
    let sizes: Vec<usize> =
        (0..300usize).map(|i| 4 + (i * 7919) % (MTU as usize - 3)).chain([MTU as usize]).collect();
    transfer(&mut a, &mut b, &sizes, version);
    transfer(&mut b, &mut a, &sizes, version);
    assert_eq!(a.stats().tx_frames, sizes.len() as u64);
    assert_eq!(b.stats().rx_frames, sizes.len() as u64);
}

#[test]
fn frames_of_every_size_cross_both_ways_with_v2_rings() {
    both_ways(RingVersion::V2);
}

#[test]
fn frames_of_every_size_cross_both_ways_with_v3_rings() {
    both_ways(RingVersion::V3);
}

#[test]
fn bounds_hold_a_payload_over_the_mtu_a_full_transmit_ring_an_overflowing_receive_ring() {
    if !netns::available("packet socket bounds") {
        return;
    }
    let pair = VethPair::new(MTU);
    let small = RingConfig { rx_slots: 8, tx_slots: 8, ..RingConfig::default() };
    let (mut a, mut b) = pair_sockets(&pair, small);
    let dst = b.mac();
    let err = a.queue(dst, &[&vec![0u8; MTU as usize + 1]]).expect_err("a payload over the MTU");
    assert!(err.to_string().contains("MTU"), "{err}");
    // Nothing is sent until a flush: the ninth frame finds the ring full.
    for i in 0..8u32 {
        assert!(a.queue(dst, &[&payload(i, 64)]).unwrap(), "slot {i}");
    }
    assert!(!a.queue(dst, &[&payload(8, 64)]).unwrap(), "a full transmit ring says so");
    a.flush().unwrap();
    // Sent frames free their slots.
    let start = Instant::now();
    while !a.queue(dst, &[&payload(8, 64)]).unwrap() {
        assert!(start.elapsed() < Duration::from_secs(5), "transmit slots never came back");
        std::thread::sleep(Duration::from_millis(1));
    }
    a.flush().unwrap();
    // Nine frames into a receive ring of eight, unread: one is dropped, and counted.
    std::thread::sleep(Duration::from_millis(50));
    // (The veth pair delivers at once: what is not there within half a second never comes.)
    let got = receive_within(&mut b, 9, Duration::from_millis(500));
    assert_eq!(got.len(), 8, "the receive ring holds eight frames");
    assert_eq!(b.kernel_drops().unwrap(), 1, "the ninth frame was dropped and counted");
    // The ring works on afterwards.
    for i in 0..4u32 {
        assert!(a.queue(dst, &[&payload(100 + i, 64)]).unwrap());
    }
    a.flush().unwrap();
    let got = receive_n(&mut b, 4);
    assert_eq!(
        got.iter().map(|(_, p)| p.clone()).collect::<Vec<_>>(),
        (0..4).map(|i| payload(100 + i, 64)).collect::<Vec<_>>()
    );
}

#[test]
fn frames_of_another_ethertype_are_not_delivered() {
    if !netns::available("packet socket ethertype filter") {
        return;
    }
    let pair = VethPair::new(MTU);
    let (mut a, mut b) = pair_sockets(&pair, RingConfig::default());
    let mut other = PacketSocket::open(&pair.host, 0x88B6, RingConfig::default()).expect("a second socket");
    assert!(other.queue(b.mac(), &[b"not for skiff"]).unwrap());
    other.flush().unwrap();
    assert!(a.queue(b.mac(), &[b"for skiff"]).unwrap());
    a.flush().unwrap();
    let got = receive_within(&mut b, 2, Duration::from_millis(500));
    assert_eq!(got.len(), 1, "only the skiff frame arrives");
    assert_eq!(got[0].1, b"for skiff");
}

/// The fault relay on real frames: a client's veth pair and a target's, each far end in a
/// namespace of its own, bridged by the relay between the near ends. What arrives is exactly
/// what the relay's counters say it did: every frame not dropped arrives (duplicates twice),
/// each frame it corrupted arrives with a bad checksum, each it held back arrives after a
/// later one.
#[test]
fn the_fault_relay_does_what_its_counters_say() {
    if !netns::available("fault relay") {
        return;
    }
    let (client_pair, target_pair) = (VethPair::new(MTU), VethPair::new(MTU));
    let config = RingConfig::default();
    let name = client_pair.peer.clone();
    let mut client = client_pair.in_ns(move || PacketSocket::open(&name, ETHERTYPE, config).unwrap());
    let name = target_pair.peer.clone();
    let mut target = target_pair.in_ns(move || PacketSocket::open(&name, ETHERTYPE, config).unwrap());
    let relay_config = RingConfig { qdisc_bypass: false, ..config };
    let left = PacketSocket::open(&client_pair.host, ETHERTYPE, relay_config).unwrap();
    let right = PacketSocket::open(&target_pair.host, ETHERTYPE, relay_config).unwrap();
    let rates = FaultRates { drop: 0.05, duplicate: 0.05, reorder: 0.05, corrupt: 0.05 };
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let bridge = std::thread::spawn(move || relay::run(left, right, rates, 42, &stop2, |_, _| {}).unwrap());

    const FRAMES: u32 = 3000;
    let done = Arc::new(AtomicBool::new(false));
    let done2 = done.clone();
    let receiver = std::thread::spawn(move || {
        let mut got: Vec<Vec<u8>> = Vec::new();
        let mut quiet_since = Instant::now();
        while !(done2.load(Ordering::Relaxed) && quiet_since.elapsed() > Duration::from_millis(300)) {
            if target.receive(|_, p| got.push(p.to_vec())) > 0 {
                quiet_since = Instant::now();
            } else {
                let _ = transport::wait_fd(
                    std::os::fd::AsRawFd::as_raw_fd(&target),
                    false,
                    Some(Duration::from_millis(20)),
                );
            }
        }
        got
    });
    let dst = [0x02, 0, 0, 0, 0, 0x01]; // the relay forwards whatever the address
    for seq in 0..FRAMES {
        let body = payload(seq, 60);
        let sum = crc32c::crc32c(&body).to_le_bytes();
        while !client.queue(dst, &[&body, &sum]).unwrap() {
            client.flush().unwrap();
            std::thread::sleep(Duration::from_micros(100));
        }
        if seq % 16 == 15 {
            client.flush().unwrap();
            // Paced, so that no ring on the way overflows: every loss is the relay's.
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    client.flush().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let (sent_on, back) = bridge.join().unwrap();
    done.store(true, Ordering::Relaxed);
    let got = receiver.join().unwrap();

    assert_eq!(sent_on.received, u64::from(FRAMES), "the relay saw every frame: {sent_on:?}");
    assert_eq!(back.received, 0);
    assert_eq!(sent_on.overflowed, 0);
    assert_eq!(got.len() as u64, sent_on.forwarded, "arrived against forwarded: {sent_on:?}");
    assert_eq!(sent_on.forwarded, u64::from(FRAMES) - sent_on.dropped + sent_on.duplicated);
    let seq_of = |p: &Vec<u8>| u32::from_le_bytes(p[..4].try_into().unwrap());
    let intact = |p: &Vec<u8>| crc32c::crc32c(&p[..60]).to_le_bytes() == p[60..64];
    // A flipped bit may land in the sequence number itself: count corrupted frames, once per
    // distinct content.
    let corrupted: BTreeSet<&Vec<u8>> = got.iter().filter(|p| !intact(p)).collect();
    assert_eq!(corrupted.len() as u64, sent_on.corrupted, "{sent_on:?}");
    let arrived: BTreeSet<u32> = got.iter().filter(|p| intact(p)).map(seq_of).collect();
    assert_eq!(arrived.len() as u64 + sent_on.corrupted, u64::from(FRAMES) - sent_on.dropped);
    let intact_seqs: Vec<u32> = got.iter().filter(|p| intact(p)).map(seq_of).collect();
    let descents = intact_seqs.windows(2).filter(|w| w[1] < w[0]).count() as u64;
    assert!(descents > 0 && descents <= sent_on.reordered, "{descents} out of order, {sent_on:?}");
    // Every fault struck.
    for (what, n) in [
        ("dropped", sent_on.dropped),
        ("duplicated", sent_on.duplicated),
        ("reordered", sent_on.reordered),
        ("corrupted", sent_on.corrupted),
    ] {
        assert!(n > 50, "{what}: {n} of {FRAMES}");
    }
}

/// Push `len` bytes each way through two sessions' ends at once, in writes of varied sizes,
/// until both sides have read everything; returns what each read.
fn exchange(a: &mut EthStream, b: &mut EthStream, len: usize) -> (Vec<u8>, Vec<u8>) {
    use std::io::{IoSlice, IoSliceMut};
    use transport::FrameIo;
    let (a_data, b_data) = (skiff_tests::files::content(1, len), skiff_tests::files::content(2, len));
    let (mut a_sent, mut b_sent) = (0, 0);
    let (mut a_got, mut b_got) = (Vec::new(), Vec::new());
    let mut buf = vec![0u8; 64 << 10];
    let start = Instant::now();
    let mut round = 0usize;
    while a_got.len() < len || b_got.len() < len {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "stuck: a {:?}, b {:?}",
            a.counters(),
            b.counters()
        );
        round += 1;
        let chunk = 1 + (round * 7919) % 20_000;
        let mut moved = false;
        for (s, data, sent) in [(&mut *a, &a_data, &mut a_sent), (&mut *b, &b_data, &mut b_sent)] {
            if *sent < len {
                match s.send(&[IoSlice::new(&data[*sent..(*sent + chunk).min(len)])]) {
                    Ok(n) => {
                        *sent += n;
                        moved |= n > 0;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("send: {e}"),
                }
            }
        }
        for (s, got) in [(&mut *a, &mut a_got), (&mut *b, &mut b_got)] {
            match s.recv(&mut [IoSliceMut::new(&mut buf)]) {
                Ok(0) => panic!("end of stream before the end"),
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    moved = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("recv: {e}"),
            }
        }
        if !moved {
            let limit =
                [a.timeout(), b.timeout(), Some(Duration::from_millis(5))].into_iter().flatten().min();
            let _ = transport::wait_readable2(
                std::os::fd::AsRawFd::as_raw_fd(&*a),
                std::os::fd::AsRawFd::as_raw_fd(&*b),
                limit,
            );
        }
    }
    assert!(a_got == b_data, "a read something other than b wrote");
    assert!(b_got == a_data, "b read something other than a wrote");
    (a_got, b_got)
}

fn jumbo() -> ReliableConfig {
    ReliableConfig { payload_bytes_max: 9000 - 28, ..ReliableConfig::default() }
}

/// A session over a veth pair: 4 MiB each way, every byte once and in order, in jumbo
/// datagrams; a socket filtered to its session sees none of another session's datagrams.
#[test]
fn a_session_carries_a_byte_stream_over_raw_ethernet() {
    if !netns::available("a session over raw Ethernet") {
        return;
    }
    let pair = VethPair::new(MTU);
    let (a_sock, b_sock) = pair_sockets(&pair, RingConfig::default());
    let (a_mac, b_mac) = (a_sock.mac(), b_sock.mac());
    let mut a = EthStream::open(a_sock, b_mac, 0x5EED_0001, &jumbo()).unwrap();
    let mut b = EthStream::open(b_sock, a_mac, 0x5EED_0001, &jumbo()).unwrap();
    // A second session on the same pair, whose traffic the first must never see.
    let (c_sock, d_sock) = pair_sockets(&pair, RingConfig::default());
    let mut c = EthStream::open(c_sock, b_mac, 0x5EED_0002, &jumbo()).unwrap();
    let mut d = EthStream::open(d_sock, a_mac, 0x5EED_0002, &jumbo()).unwrap();
    exchange(&mut a, &mut b, 4 << 20);
    exchange(&mut c, &mut d, 1 << 20);
    for s in [&a, &b] {
        let k = s.counters();
        assert_eq!(k.wrong_session, 0, "a filtered socket saw another session: {k:?}");
        assert_eq!(k.corrupt, 0, "{k:?}");
    }
    assert!(a.counters().data_sent >= (4 << 20) / 8972, "jumbo datagrams: {:?}", a.counters());
}

/// The same through the fault relay: 5% loss, duplicates, reordering and bit flips in both
/// directions; every byte arrives once and in order, and the counters show the faults struck
/// and were repaired.
#[test]
fn a_session_repairs_loss_duplication_reordering_and_corruption_on_real_frames() {
    if !netns::available("a session through the fault relay") {
        return;
    }
    let (client_pair, target_pair) = (VethPair::new(MTU), VethPair::new(MTU));
    let config = RingConfig::default();
    let name = client_pair.peer.clone();
    let a_sock = client_pair.in_ns(move || PacketSocket::open(&name, ETHERTYPE, config).unwrap());
    let name = target_pair.peer.clone();
    let b_sock = target_pair.in_ns(move || PacketSocket::open(&name, ETHERTYPE, config).unwrap());
    let relay_config = RingConfig { qdisc_bypass: false, ..config };
    let left = PacketSocket::open(&client_pair.host, ETHERTYPE, relay_config).unwrap();
    let right = PacketSocket::open(&target_pair.host, ETHERTYPE, relay_config).unwrap();
    let rates = FaultRates { drop: 0.05, duplicate: 0.02, reorder: 0.02, corrupt: 0.02 };
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let bridge = std::thread::spawn(move || relay::run(left, right, rates, 7, &stop2, |_, _| {}).unwrap());
    let (a_mac, b_mac) = (a_sock.mac(), b_sock.mac());
    let mut a = EthStream::open(a_sock, b_mac, 77, &jumbo()).unwrap();
    let mut b = EthStream::open(b_sock, a_mac, 77, &jumbo()).unwrap();
    exchange(&mut a, &mut b, 2 << 20);
    stop.store(true, Ordering::Relaxed);
    let (lr, rl) = bridge.join().unwrap();
    assert!(lr.dropped > 0 && rl.dropped > 0 && lr.corrupted + rl.corrupted > 0, "{lr:?} {rl:?}");
    let (ka, kb) = (a.counters(), b.counters());
    eprintln!("relay {lr:?}\n      {rl:?}\nclient {ka:?}\ntarget {kb:?}");
    assert!(ka.retransmitted_gap + ka.retransmitted_timeout > 0, "{ka:?}");
    assert!(ka.corrupt + kb.corrupt > 0, "corrupt datagrams caught: {ka:?} {kb:?}");
    assert!(ka.duplicates + kb.duplicates > 0, "{ka:?} {kb:?}");
}
