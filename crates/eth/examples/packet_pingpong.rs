//! Round trips of one small frame over AF_PACKET rings, V2 against V3: what each ring layout
//! costs a request at queue depth 1 (docs/ETHERNET.md). Root; makes its own veth pair.
//!
//! ```sh
//! cargo build --release -p skiff-eth --example packet_pingpong
//! target/release/examples/packet_pingpong [ROUND_TRIPS] [--spin]
//! ```
//!
//! The responder runs on a thread inside a namespace of its own, pinned to CPU 1; the sender
//! on CPU 0. Each side sleeps in poll(2) for the next frame, or spins on the ring with `--spin`.

use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use skiff_eth::packet::{PacketSocket, RingConfig, RingVersion, ETHERTYPE};

fn ip(args: &[&str]) {
    let ok = Command::new("ip").args(args).status().map(|s| s.success()).unwrap_or(false);
    assert!(ok, "ip {args:?} failed");
}

fn pin(cpu: usize) {
    let _ =
        Command::new("taskset").args(["-pc", &cpu.to_string(), &rt::usage::thread_id().to_string()]).output();
}

fn wait(s: &PacketSocket, spin: bool) {
    if !spin {
        let _ = transport::wait_fd(s.as_raw_fd(), false, Some(Duration::from_millis(100)));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rounds: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(20_000);
    let spin = args.iter().any(|a| a == "--spin");
    let tag = std::process::id() % 100_000;
    let (ns, host, peer) = (format!("skiff-pp{tag}"), format!("skph{tag}"), format!("skpp{tag}"));
    ip(&["netns", "add", &ns]);
    ip(&["link", "add", &host, "mtu", "9000", "type", "veth", "peer", "name", &peer, "mtu", "9000"]);
    ip(&["link", "set", &peer, "netns", &ns]);
    ip(&["link", "set", &host, "up"]);
    ip(&["-n", &ns, "link", "set", &peer, "up"]);
    println!(
        "round trips of a 64-byte frame over a veth pair, {rounds} each, {}",
        if spin { "spinning" } else { "sleeping in poll" }
    );
    println!("| rings | mean µs | p50 µs | p99 µs |");
    println!("|---|---:|---:|---:|");
    for version in [RingVersion::V2, RingVersion::V3] {
        let config = RingConfig { version, ..RingConfig::default() };
        let stop = Arc::new(AtomicBool::new(false));
        let (ns_path, peer_if, stop2) = (format!("/run/netns/{ns}"), peer.clone(), stop.clone());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let responder = std::thread::spawn(move || {
            rt::netns::enter(std::path::Path::new(&ns_path)).expect("enter the namespace");
            pin(1);
            let mut s = PacketSocket::open(&peer_if, ETHERTYPE, config).expect("responder socket");
            ready_tx.send(s.mac()).unwrap();
            let mut back: Vec<([u8; 6], Vec<u8>)> = Vec::new();
            while !stop2.load(Ordering::Relaxed) {
                if s.receive(|src, p| back.push((src, p.to_vec()))) == 0 {
                    wait(&s, spin);
                    continue;
                }
                for (src, p) in back.drain(..) {
                    while !s.queue(src, &[&p]).unwrap() {
                        s.flush().unwrap();
                    }
                }
                s.flush().unwrap();
            }
        });
        let dst = ready_rx.recv().unwrap();
        pin(0);
        let mut s = PacketSocket::open(&host, ETHERTYPE, config).expect("sender socket");
        let mut lat = Vec::with_capacity(rounds);
        let frame = [7u8; 64];
        for i in 0..rounds + 1000 {
            let t0 = Instant::now();
            assert!(s.queue(dst, &[&frame]).unwrap());
            s.flush().unwrap();
            let mut got = 0;
            while got == 0 {
                got = s.receive(|_, _| {});
                if got == 0 {
                    wait(&s, spin);
                    if t0.elapsed() > Duration::from_secs(2) {
                        // A lost frame: send again.
                        break;
                    }
                }
            }
            if i >= 1000 && got > 0 {
                lat.push(t0.elapsed().as_nanos() as f64 / 1000.0);
            }
        }
        stop.store(true, Ordering::Relaxed);
        // Wake the responder.
        let _ = s.queue(dst, &[&frame]);
        let _ = s.flush();
        responder.join().unwrap();
        lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let mean = lat.iter().sum::<f64>() / lat.len() as f64;
        let q = |f: f64| lat[((lat.len() as f64 * f) as usize).min(lat.len() - 1)];
        println!("| {version:?} | {mean:.1} | {:.1} | {:.1} |", q(0.5), q(0.99));
    }
    let _ = Command::new("ip").args(["link", "del", &host]).status();
    let _ = Command::new("ip").args(["netns", "del", &ns]).status();
}
