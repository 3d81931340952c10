//! `skiff bench --verify` over raw Ethernet through `skiff relay`, as the raw-Ethernet issue
//! asks: a target (`skiff serve --eth`) and a client (`skiff bench`) each in a network
//! namespace of its own, the relay bridging their veth pairs with 1% and then 5% of frames
//! dropped (and some duplicated, reordered and corrupted). Every read must verify, and the
//! relay's counters must show that the faults were real. And the relay with
//! `--every-ethertype`, which TCP crosses too (the loss comparison of bench/ethernet.py).
//!
//! Root and network namespaces are needed; under CI (`CI=true`) their absence fails this test,
//! elsewhere it skips loudly. Processes, namespaces and veth pairs are removed even on failure.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use skiff_tests::netns::{self, VethPair};
use skiff_tests::{run_ok, tool};

fn skiff() -> Command {
    Command::new(env!("CARGO_BIN_EXE_skiff"))
}

/// `skiff …` inside namespace `ns`.
fn skiff_in(ns: &str) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_skiff")]);
    c
}

/// A child stopped on drop (SIGTERM, then SIGKILL).
struct Proc(Child);

impl Proc {
    /// Start `cmd`, its stderr dropped and its stdout as `stdout` says (piped for
    /// [`finish`](Self::finish) to return).
    fn spawn(cmd: &mut Command, stdout: Stdio) -> Proc {
        Proc(cmd.stdout(stdout).stderr(Stdio::null()).spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}")))
    }

    /// SIGTERM and wait; returns what it printed on stdout.
    fn finish(mut self) -> String {
        signal(&self.0, "-TERM");
        let out =
            std::mem::replace(&mut self.0, Command::new("true").spawn().unwrap()).wait_with_output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        signal(&self.0, "-TERM");
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(child: &Child, sig: &str) {
    let _ = Command::new("kill").args([sig, &child.id().to_string()]).status();
}

/// The MAC of `iface` in namespace `ns`.
fn mac_of(ns: &str, iface: &str) -> String {
    let out = Command::new("ip").args(["-n", ns, "-o", "link", "show", iface]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split("link/ether").nth(1).and_then(|t| t.split_whitespace().next()).expect("a MAC").to_owned()
}

fn json_u64(v: &serde_json::Value, path: &[&str]) -> u64 {
    path.iter().fold(v, |v, k| &v[*k]).as_u64().unwrap_or_else(|| panic!("{path:?} in {v}"))
}

/// Run `skiff bench … --verify --json`: it must succeed with more than `ios_min` I/Os, none
/// failed and every read right. Returns its report.
fn bench_verified(cmd: &mut Command, ios_min: u64) -> serde_json::Value {
    let out = cmd.output().expect("skiff bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "skiff bench: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let bench: serde_json::Value = serde_json::from_str(&stdout).expect("bench JSON");
    assert!(json_u64(&bench, &["ios"]) > ios_min, "{bench}");
    assert_eq!(json_u64(&bench, &["io_errors"]), 0, "{bench}");
    assert_eq!(json_u64(&bench, &["verify_errors"]), 0, "{bench}");
    bench
}

/// `cmd` (`skiff`, perhaps in a namespace) running 2 s of verified random reads and writes of
/// `bs` at `qd` on export `vol` (32 MiB) of `target`: [`bench_verified`], more than 100 I/Os.
fn randrw_verified(cmd: &mut Command, target: &str, bs: &str, qd: &str) -> serde_json::Value {
    bench_verified(
        cmd.args(["bench", "--target", target, "--export", "vol", "--size", "32M", "--rw", "randrw"]).args([
            "--bs",
            bs,
            "--qd",
            qd,
            "--duration",
            "2s",
            "--verify",
            "--json",
        ]),
        100,
    )
}

/// Stop the relay; its counters, having dropped about `loss` of more than `received_min`
/// frames each way (the seeded share, within a factor of two).
fn relay_dropped(relay: Proc, loss: f64, received_min: u64) -> serde_json::Value {
    let counters: serde_json::Value = serde_json::from_str(relay.finish().trim()).expect("relay JSON");
    for side in ["left_to_right", "right_to_left"] {
        let (dropped, received) =
            (json_u64(&counters, &[side, "dropped"]), json_u64(&counters, &[side, "received"]));
        let share = dropped as f64 / received.max(1) as f64;
        assert!(
            received > received_min && share > loss / 2.0 && share < loss * 2.0,
            "{side} at {loss}: {counters}"
        );
    }
    counters
}

#[test]
fn bench_verifies_over_raw_ethernet_through_the_fault_relay_at_1_and_5_percent_loss() {
    if !netns::available("skiff bench --verify through skiff relay") {
        return;
    }
    let (client, target) = (VethPair::new(9000), VethPair::new(9000));
    let serve = Proc::spawn(
        skiff_in(&target.ns).args(["serve", "--no-tcp", "--eth", &target.peer, "--export", "vol=ram:32M"]),
        Stdio::null(),
    );
    let mac = mac_of(&target.ns, &target.peer);
    for (loss, seed) in [(0.01, 1), (0.05, 2)] {
        let relay = Proc::spawn(
            skiff()
                .args(["relay", "--left", &client.host, "--right", &target.host, "--seed", &seed.to_string()])
                .args([
                    "--drop",
                    &loss.to_string(),
                    "--duplicate",
                    "0.01",
                    "--reorder",
                    "0.01",
                    "--corrupt",
                    "0.01",
                ]),
            Stdio::piped(),
        );
        // Let the relay open its sockets before the first frame.
        std::thread::sleep(Duration::from_millis(300));
        let bench = bench_verified(
            skiff_in(&client.ns)
                .args(["bench", "--target", &format!("eth:{}/{mac}", client.peer), "--export", "vol"])
                .args([
                    "--size",
                    "32M",
                    "--rw",
                    "randrw",
                    "--qd",
                    "16",
                    "--duration",
                    "2s",
                    "--verify",
                    "--json",
                ]),
            1000,
        );
        // The lanes repaired what the relay broke: retransmissions, and corrupt datagrams
        // caught by their checksum.
        let repaired = json_u64(&bench, &["client_link", "retransmitted_timeout"])
            + json_u64(&bench, &["client_link", "retransmitted_gap"]);
        assert!(repaired > 0, "no retransmission at {loss}: {}", bench["client_link"]);
        assert!(json_u64(&bench, &["client_link", "corrupt"]) > 0, "{}", bench["client_link"]);
        // Read data came in data messages, through the same faults.
        assert!(json_u64(&bench, &["client_link", "data_messages_received"]) > 0, "{}", bench["client_link"]);
        let counters = relay_dropped(relay, loss, 1000);
        eprintln!(
            "loss {loss}: {} I/Os verified; lanes {}; relay {counters}",
            json_u64(&bench, &["ios"]),
            bench["client_link"]
        );
    }
    drop(serve);
}

/// Read data in data messages (the default) and on the byte stream (an initiator whose
/// endpoint says `data-messages=off`, or whose environment has `SKIFF_ETH_DATA_MESSAGES=off`
/// and an endpoint that does not say, does not offer them): all verify, and only those that
/// offer receive any, with every read byte placed by tag and offset rather than copied.
#[test]
fn data_messages_carry_read_data_when_offered_and_not_otherwise() {
    if !netns::available("skiff bench with and without data messages") {
        return;
    }
    let (client, target) = (VethPair::new(9000), VethPair::new(9000));
    let serve = Proc::spawn(
        skiff_in(&target.ns).args(["serve", "--no-tcp", "--eth", &target.peer, "--export", "vol=ram:32M"]),
        Stdio::null(),
    );
    let relay =
        Proc::spawn(skiff().args(["relay", "--left", &client.host, "--right", &target.host]), Stdio::piped());
    let mac = mac_of(&target.ns, &target.peer);
    std::thread::sleep(Duration::from_millis(300));
    let cases = [
        // (the environment's setting, the endpoint's options, offered)
        (None, "", true),
        (None, ",data-messages=off", false),
        (Some("off"), "", false),
        (Some("off"), ",data-messages=on", true),
    ];
    for (env, options, offered) in cases {
        let setting = format!("{env:?}{options}");
        let mut cmd = skiff_in(&client.ns);
        cmd.env_remove("SKIFF_ETH_DATA_MESSAGES");
        if let Some(v) = env {
            cmd.env("SKIFF_ETH_DATA_MESSAGES", v);
        }
        let bench = randrw_verified(&mut cmd, &format!("eth:{}/{mac}{options}", client.peer), "16k", "32");
        let messages = json_u64(&bench, &["client_link", "data_messages_received"]);
        let placed = bench["read_placed_share"].as_f64().unwrap_or(0.0);
        eprintln!("data messages {setting}: {messages} received, {placed:.3} of read bytes placed");
        if offered {
            assert!(messages > 0 && placed == 1.0, "{bench}");
        } else {
            assert!(messages == 0 && placed < 1.0, "{bench}");
        }
    }
    drop(relay);
    drop(serve);
}

/// `skiff relay --every-ethertype` carries ARP and IP under the same faults: skiff over TCP
/// verifies through it at 2% loss, and the relay's counters show it dropped frames of a
/// connection that only crossed it. (Without the flag TCP could not connect at all: the
/// namespaces have no other way between them.)
#[test]
fn tcp_verifies_through_the_relay_bridging_every_ethertype() {
    if !netns::available("skiff bench over TCP through skiff relay --every-ethertype") {
        return;
    }
    let (client, target) = ip_pairs(9000, 9000);
    // Whole, checksummed frames of at most the MTU on every end, for the relay to read.
    let offloads = ["tso", "off", "gso", "off", "gro", "off", "tx", "off"];
    for (ns, iface) in [
        (None, &client.host),
        (Some(&client.ns), &client.peer),
        (None, &target.host),
        (Some(&target.ns), &target.peer),
    ] {
        let mut cmd = match ns {
            Some(ns) => {
                let mut c = tool("ip", "iproute2");
                c.args(["netns", "exec", ns, "ethtool"]);
                c
            }
            None => tool("ethtool", "ethtool"),
        };
        run_ok(cmd.args(["-K", iface]).args(offloads));
    }
    let relay = Proc::spawn(
        skiff()
            .args(["relay", "--left", &client.host, "--right", &target.host, "--every-ethertype"])
            .args(["--drop", "0.02", "--seed", "3"]),
        Stdio::piped(),
    );
    let serve = Proc::spawn(
        skiff_in(&target.ns).args(["serve", "--listen", "10.79.0.2:7070", "--export", "vol=ram:32M"]),
        Stdio::null(),
    );
    // Let the relay and the target open their sockets before the first frame.
    std::thread::sleep(Duration::from_millis(500));
    let bench = bench_verified(
        skiff_in(&client.ns)
            .args([
                "bench",
                "--target",
                "10.79.0.2:7070",
                "--export",
                "vol",
                "--size",
                "32M",
                "--rw",
                "randrw",
            ])
            .args(["--qd", "16", "--duration", "2s", "--verify", "--json"]),
        100,
    );
    drop(serve);
    let counters = relay_dropped(relay, 0.02, 500);
    assert_eq!(counters["every_ethertype"], true, "{counters}");
    eprintln!("TCP through the relay: {} I/Os verified; relay {counters}", json_u64(&bench, &["ios"]));
}

/// Two veth pairs (MTUs `client_mtu` and `target_mtu`) whose far ends, each in a namespace of
/// its own, have addresses 10.79.0.1 (the client's) and 10.79.0.2 (the target's) on one
/// subnet: joined only by a relay between the near ends.
fn ip_pairs(client_mtu: u32, target_mtu: u32) -> (VethPair, VethPair) {
    let (client, target) = (VethPair::new(client_mtu), VethPair::new(target_mtu));
    for (ns, iface, addr) in
        [(&client.ns, &client.peer, "10.79.0.1/24"), (&target.ns, &target.peer, "10.79.0.2/24")]
    {
        run_ok(tool("ip", "iproute2").args(["-n", ns, "addr", "add", addr, "dev", iface]));
        run_ok(tool("ip", "iproute2").args(["-n", ns, "link", "set", "lo", "up"]));
    }
    (client, target)
}

/// A frame larger than the outgoing side's MTU (a sender with a larger MTU, or with its
/// segmentation offloads on) cannot be forwarded: the relay counts it (`oversized`), skips it
/// and keeps bridging, instead of stopping on the first.
#[test]
fn the_relay_skips_frames_over_the_mtu_and_keeps_running() {
    if !netns::available("skiff relay --every-ethertype between MTUs 9000 and 1500") {
        return;
    }
    let (client, target) = ip_pairs(9000, 1500);
    let relay = Proc::spawn(
        skiff().args(["relay", "--left", &client.host, "--right", &target.host, "--every-ethertype"]),
        Stdio::piped(),
    );
    std::thread::sleep(Duration::from_millis(300));
    // One UDP datagram of 5,000 bytes (one 5,042-byte frame on the client's side), then a
    // small one; ARP goes first, through the relay.
    for bytes in [5000, 100] {
        run_ok(
            tool("ip", "iproute2")
                .args(["netns", "exec", &client.ns, "bash", "-c"])
                .arg(format!("head -c {bytes} /dev/zero > /dev/udp/10.79.0.2/9999")),
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The relay still runs: it stops on SIGTERM and prints its counters.
    let counters: serde_json::Value = serde_json::from_str(relay.finish().trim()).expect("relay JSON");
    assert_eq!(json_u64(&counters, &["left_to_right", "oversized"]), 1, "{counters}");
    // ARP, and the small datagram after the big one.
    assert!(json_u64(&counters, &["left_to_right", "forwarded"]) >= 2, "{counters}");
}

/// NIC bundling from the command line: `skiff serve --eth A --eth B` forms one bundle, and
/// `skiff bench --target eth:A+B/MAC --verify` spreads its lanes' datagrams over both links,
/// every read verified.
#[test]
fn bench_verifies_over_a_bundle_of_two_links() {
    if !netns::available("skiff bench over a raw-Ethernet bundle") {
        return;
    }
    let a = VethPair::new(9000);
    let b = VethPair::beside(&a, 9000);
    let serve = Proc::spawn(
        skiff_in(&a.ns).args([
            "serve",
            "--no-tcp",
            "--eth",
            &a.peer,
            "--eth",
            &b.peer,
            "--export",
            "vol=ram:32M",
        ]),
        Stdio::null(),
    );
    let mac = mac_of(&a.ns, &a.peer);
    // Let the target open its sockets before the first frame.
    std::thread::sleep(Duration::from_millis(300));
    let bench = bench_verified(
        skiff()
            .args(["bench", "--target", &format!("eth:{}+{}/{mac}", a.host, b.host), "--export", "vol"])
            .args(["--size", "32M", "--rw", "randrw", "--qd", "16", "--threads", "2", "--duration", "2s"])
            .args(["--verify", "--json"]),
        1000,
    );
    let paths = bench["client_link"]["paths"].as_array().expect("per-path counters").clone();
    assert_eq!(paths.len(), 2, "{}", bench["client_link"]);
    for p in &paths {
        assert!(
            json_u64(p, &["datagrams_sent"]) > 1000 && json_u64(p, &["datagrams_received"]) > 1000,
            "both links carry the lanes: {}",
            bench["client_link"]
        );
    }
    eprintln!("bundle: {} I/Os verified; lanes {}", json_u64(&bench, &["ios"]), bench["client_link"]);
    drop(serve);
}

/// A session's datagrams follow the pair's MTU, up to veth's 65,535: reads of 64 KiB verify,
/// and arrive in datagrams larger than a jumbo frame could carry; a jumbo pair gives jumbo
/// payloads. Checksums cover payloads unless an endpoint says `crc=header` (the target's
/// `--eth-options` for what it sends, the initiator's endpoint for what it sends).
#[test]
fn datagrams_follow_the_mtu_up_to_65535_and_crc_header_leaves_payloads_unchecksummed() {
    if !netns::available("skiff bench over veth pairs of MTU 65,535 and 9,000") {
        return;
    }
    for (mtu, payload) in [(65535, 65507), (9000, 8972)] {
        let pair = VethPair::new(mtu);
        let serve = Proc::spawn(
            skiff_in(&pair.ns).args(["serve", "--no-tcp", "--eth", &pair.peer, "--export", "vol=ram:32M"]),
            Stdio::null(),
        );
        let mac = mac_of(&pair.ns, &pair.peer);
        std::thread::sleep(Duration::from_millis(300));
        for (options, crc) in [("", true), (",crc=header", false)] {
            let what = format!("MTU {mtu}{options}");
            let bench =
                randrw_verified(&mut skiff(), &format!("eth:{}/{mac}{options}", pair.host), "64k", "8");
            let link = &bench["client_link"];
            assert_eq!(json_u64(link, &["datagram_payload_max"]), payload, "{what}: {link}");
            assert_eq!(link["payload_crc"].as_bool(), Some(crc), "{what}: {link}");
            // Read data came in datagrams of the MTU's size: more than a jumbo payload each,
            // on average, where the MTU allows it.
            let read_bytes = json_u64(&bench, &["ios"]) * 65536 / 2;
            let per_datagram = read_bytes / json_u64(link, &["datagrams_received"]).max(1);
            eprintln!("{what}: about {per_datagram} bytes of read data per datagram received; {link}");
            if mtu > 9000 {
                assert!(per_datagram > 8972, "{what}: {per_datagram} bytes per datagram");
            } else {
                assert!(per_datagram <= 8972, "{what}: {per_datagram} bytes per datagram");
            }
        }
        drop(serve);
    }
}

/// `skiff floor --veth` measures frames of each size asked for over a real veth pair, on one
/// thread and across CPUs, and refuses frames larger than the pair's MTU by name.
#[test]
fn floor_measures_veth_frames_and_refuses_frames_over_the_mtu() {
    if !netns::available("skiff floor --veth") {
        return;
    }
    let pair = VethPair::new(9000);
    let veth = format!("{},{}/{}", pair.host, pair.ns, pair.peer);
    let out = skiff()
        .args([
            "floor",
            "--json",
            "--batches",
            "3",
            "--batch",
            "2ms",
            "--veth",
            &veth,
            "--frame-bytes",
            "1500,9000",
        ])
        .output()
        .expect("run skiff floor");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let figures = report["figures"].as_array().expect("figures");
    for name in ["veth_1500", "veth_1500_apart", "veth_9000", "veth_9000_apart"] {
        let f = figures.iter().find(|f| f["name"] == name).unwrap_or_else(|| panic!("no {name} in {report}"));
        let ns = f["ns"].as_f64().unwrap();
        assert!(ns > 0.0 && ns.is_finite(), "{f}");
    }
    let out =
        skiff().args(["floor", "--veth", &veth, "--frame-bytes", "9001"]).output().expect("run skiff floor");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("MTU of 9000") && stderr.contains(&pair.host), "{stderr}");
}
