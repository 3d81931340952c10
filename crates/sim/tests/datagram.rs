//! Reliable delivery over a faulty datagram link: thousands of seeds at 1%, 5% and 20% loss
//! (plus duplication, reordering, corruption and flaps), every byte delivered exactly once and
//! in order, both streams closed; a cut link ends in `Dead` within the bound.

use skiff_sim::datagram::{add_counters, stream_run, LinkCounts, LinkFaults, StreamOptions};

/// Seeds per loss rate.
const SEEDS: u64 = 1000;
const BYTES_MAX: u64 = 40_000;

fn run_seeds(loss: u32, first: u64) -> (LinkCounts, dgram::reliable::Counters) {
    let (mut link, mut streams) = Default::default();
    let mut failures = Vec::new();
    for seed in first..first + SEEDS {
        let opts = StreamOptions::new(seed, LinkFaults::with_loss(loss), BYTES_MAX);
        match stream_run(&opts) {
            Ok(r) => {
                LinkCounts::add(&mut link, &r.link);
                add_counters(&mut streams, &r.streams);
            }
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{} of {SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    eprintln!("loss {loss} ppm over {SEEDS} seeds: {link:?}\n  {streams:?}");
    (link, streams)
}

#[test]
fn every_byte_arrives_once_in_order_at_every_loss_rate() {
    for (i, loss) in [10_000, 50_000, 200_000].into_iter().enumerate() {
        let (link, s) = run_seeds(loss, i as u64 * 1_000_000);
        // The faults struck, and the streams saw them and recovered.
        assert!(link.lost > 100 && link.duplicated > 100 && link.reordered > 100, "{link:?}");
        assert!(link.corrupted > 50 && link.flaps > 0 && link.lost_down > 0, "{link:?}");
        // Every corrupted datagram that arrived was caught (some were still in flight at the
        // end, or lost in a flap); none slipped through, or a byte check above would have
        // failed.
        assert!(s.corrupt <= link.corrupted && s.corrupt * 10 >= link.corrupted * 9, "{s:?} {link:?}");
        assert!(s.duplicates > 100 && s.out_of_order > 100, "{s:?}");
        assert!(s.retransmitted_gap > 100 && s.retransmitted_timeout > 100, "{s:?}");
        assert_eq!(s.stream_bytes_read, s.stream_bytes_written);
        // Reads took bytes both ways: placed straight from arriving datagrams, and from the
        // stream's buffer (what arrived out of order, or while no read was posted).
        assert!(s.stream_bytes_placed > 0 && s.stream_bytes_placed < s.stream_bytes_read / 2, "{s:?}");
    }
}

#[test]
fn a_cut_link_ends_in_death_within_the_bound() {
    for seed in 0..100 {
        let opts = StreamOptions {
            cut_at_us: Some(2_000 + seed * 37),
            ..StreamOptions::new(seed, LinkFaults::with_loss(10_000), 1_000_000)
        };
        stream_run(&opts).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn a_stream_seed_replays_exactly() {
    let opts = StreamOptions::new(42, LinkFaults::with_loss(50_000), BYTES_MAX);
    let (a, b) = (stream_run(&opts).unwrap(), stream_run(&opts).unwrap());
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
    let bundled = StreamOptions { paths: 2, outage: Some((3_000, 50_000)), ..opts };
    let (a, b) = (stream_run(&bundled).unwrap(), stream_run(&bundled).unwrap());
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
}

/// NIC bundling under faults: a session over two links, every fault of the loss-rate runs on
/// both, and the second link taken down mid-run for 10 to 100 ms (both ways, silently: the sim
/// has no interface to refuse a send, so the bundle must notice by silence or unanswered
/// probes). Every byte arrives once and in order, both streams close, neither dies; the link
/// that failed is left out and rejoins.
#[test]
fn a_bundle_of_two_links_rides_through_one_going_down() {
    let (mut downs, mut rejoins, mut runs_with_down) = (0, 0, 0);
    let mut per_path = [0u64; 2];
    let mut failures = Vec::new();
    for seed in 0..SEEDS {
        let opts = StreamOptions {
            paths: 2,
            outage: Some((1_000 + (seed * 7_919) % 20_000, 10_000 + (seed * 104_729) % 90_000)),
            ..StreamOptions::new(5_000_000 + seed, LinkFaults::with_loss(10_000), 400_000)
        };
        match stream_run(&opts) {
            Ok(r) => {
                downs += r.paths[1].downs;
                rejoins += r.paths[1].rejoins;
                runs_with_down += u64::from(r.paths[1].downs > 0);
                for (p, c) in r.paths.iter().enumerate() {
                    per_path[p] += c.datagrams_sent;
                }
            }
            Err(e) => failures.push(e),
        }
    }
    assert!(failures.is_empty(), "{} of {SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    eprintln!(
        "bundle over {SEEDS} seeds: datagrams per path {per_path:?}; the failing link went down {downs} times \
         ({runs_with_down} runs) and rejoined {rejoins} times"
    );
    // Both links carried the sessions; the outages were noticed and healed in most runs (a
    // run may end before its outage begins, or before the link is probed again).
    assert!(per_path[0] > 100_000 && per_path[1] > 10_000, "{per_path:?}");
    assert!(
        runs_with_down > SEEDS / 2 && rejoins > SEEDS / 4,
        "downs {downs} in {runs_with_down} runs, rejoins {rejoins}"
    );
}

/// The simulation runs the raw-Ethernet driver itself (`eth::EthStream`), so a bug there is
/// caught too: a driver that never fires its stream's timers leaves a lost datagram with
/// nothing behind it unsent for good, and the run is stuck.
#[test]
#[cfg(feature = "mutations")]
fn a_driver_that_never_fires_its_timers_is_caught() {
    let caught = (0..SEEDS).find_map(|seed| {
        let opts = StreamOptions {
            planted: Some(eth::Mutation::SkipTimers),
            ..StreamOptions::new(seed, LinkFaults::with_loss(50_000), 20_000)
        };
        stream_run(&opts).err()
    });
    let message =
        caught.expect("a driver without timers survived every seed: the simulation has no teeth there");
    eprintln!("SkipTimers: {}", message.lines().next().unwrap_or_default());
    assert!(message.contains("stuck"), "{message}");
}

/// Requests per run of the full simulation over the datagram link: half of `seeds.rs`'s 300,
/// to keep the suite's debug-build time down (waiting out retransmission timeouts costs steps).
const FULL_OPS: usize = 150;

/// The full simulation (the real `ClientSession` and `NativeConn`, the shadow volume, disk
/// faults, reconnection) over the datagram link: every read verified, every acknowledged write
/// present at the end, at 5% loss with every other link fault and injected resets.
#[test]
fn a_thousand_full_simulation_seeds_pass_over_the_datagram_link() {
    use skiff_sim::disk::DiskFaults;
    use skiff_sim::faults::NetFaults;
    use skiff_sim::{run, LinkKind, Options, Planted, Report};
    let mut total = Report::default();
    let mut failures = Vec::new();
    let options = |seed| Options {
        seed,
        ops: FULL_OPS,
        net: NetFaults::typical(),
        disk: DiskFaults::typical(),
        planted: Planted::None,
        link: LinkKind::Datagram(LinkFaults::with_loss(50_000)),
    };
    for seed in 0..SEEDS {
        match run(&options(seed)) {
            Ok(r) => total.add(&r),
            Err(f) => failures.push(f.to_string()),
        }
    }
    assert!(failures.is_empty(), "{} of {SEEDS} seeds failed:\n{}", failures.len(), failures.join("\n"));
    let (link, s) = (total.link, total.streams);
    eprintln!("full simulation over the datagram link: {link:?}\n  {s:?}\n  {total:?}");
    assert_eq!(total.ops_ok + total.ops_failed, SEEDS * FULL_OPS as u64);
    assert!(link.lost > 10_000 && link.duplicated > 1_000 && link.reordered > 1_000, "{link:?}");
    assert!(link.corrupted > 1_000 && link.flaps > 100, "{link:?}");
    assert!(s.corrupt <= link.corrupted && s.corrupt * 10 >= link.corrupted * 9, "{s:?}");
    assert!(s.retransmitted_gap > 10_000 && s.retransmitted_timeout > 1_000 && s.duplicates > 1_000, "{s:?}");
    // Three connections in four carried read data in data messages, placed on arrival or
    // held for the next read; the rest on the stream.
    assert!(s.places_received > 1_000 && s.places_held > 0, "{s:?}");
    assert!(s.places_held < s.places_received && s.stream_bytes_placed > 0, "{s:?}");
    assert!(total.read_bytes_in_messages > 0 && total.read_bytes_copied > 0, "{total:?}");
    // Injected resets killed connections; the resuming half of the seeds carried on.
    assert!(total.net_faults[3] > 100 && total.reattaches > 100, "{total:?}");
    // And a seed replays exactly over this link too.
    let replay = || format!("{:?}", run(&options(7)));
    assert_eq!(replay(), replay());
}

/// The simulation has teeth for data messages too: a session that places a data message's
/// segments in each other's buffers is caught (a read verified against the shadow volume, or a
/// segment refused) within the seed budget, over the datagram link without faults.
#[test]
#[cfg(feature = "mutations")]
fn a_segment_placed_in_the_wrong_buffer_is_caught() {
    use skiff_sim::disk::DiskFaults;
    use skiff_sim::faults::NetFaults;
    use skiff_sim::{run, LinkKind, Options, Planted};
    let caught = (0..SEEDS).find_map(|seed| {
        run(&Options {
            seed,
            ops: FULL_OPS,
            net: NetFaults::NONE,
            disk: DiskFaults::NONE,
            planted: Planted::SwapSegments,
            link: LinkKind::Datagram(LinkFaults::NONE),
        })
        .err()
    });
    let f = caught.expect("SwapSegments survived every seed: the simulation has no teeth for data messages");
    eprintln!("SwapSegments: caught by seed {}: {}", f.seed, f.message.lines().next().unwrap_or_default());
}
