//! Staged targets (`--stages send-thread|recv-thread`, server::Stages): the designs Tyche
//! removed, kept to measure what run to completion saves. Measured or not, they must serve
//! every byte right: many lanes at once, large I/Os that fill the socket, connections that
//! come and go (their slots reused) while others run, and a protocol error's GOAWAY still
//! delivered before the close.

use initiator::{Lane, LaneConfig, Limits, Status};
use server::Stages;
use skiff_tests::{certs, start_target_with, tcp_endpoint, verify, RawPeer};
use wire::{FrameKind, GoAway, Header};

fn staged(stages: Stages) -> server::Target {
    start_target_with(&["vol=ram:64M"], |c| {
        c.workers = 2;
        c.stages = stages;
    })
}

/// Four threads, each on its own slice: small I/Os at QD 32, then I/Os of 256 KiB (more than
/// a socket takes at once), and three rounds of a lane closed and a new one opened.
fn serve_every_byte(stages: Stages) {
    let t = staged(stages);
    let ep = tcp_endpoint(&t);
    let slice = 8u64 << 20;
    let threads: Vec<_> = (0..4u64)
        .map(|th| {
            let ep = ep.clone();
            std::thread::spawn(move || {
                let config = LaneConfig {
                    limits: Limits { queue_depth: 32, ..LaneConfig::default().limits },
                    ..LaneConfig::default()
                };
                let base = th * slice;
                let mut lane = Lane::connect(&ep, "vol", &config).expect("lane");
                verify::write_read(&mut lane, th, base, slice / 2, 4096, 32);
                verify::write_read(&mut lane, th + 100, base + slice / 2, slice / 2, 256 << 10, 8);
                drop(lane);
                for round in 0..3 {
                    let mut lane = Lane::connect(&ep, "vol", &config).expect("lane again");
                    verify::write_read(&mut lane, th * 10 + round, base, 1 << 20, 8192, 16);
                }
            })
        })
        .collect();
    for h in threads {
        h.join().expect("a thread failed");
    }
    let s = t.stats();
    let handoffs = s.get("stage_handoffs").unwrap();
    let caravans = s.get("caravans_received").unwrap();
    // Every request came through the stage thread: at least one hand-off per few caravans.
    assert!(handoffs > 0 && handoffs * 8 >= caravans, "{handoffs} hand-offs for {caravans} caravans");
    // The target learns of the last closes a moment after the lanes drop.
    let open = || t.stats().get("connections_open").unwrap();
    for _ in 0..1000 {
        if open() == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(open(), 0, "every lane's connection closed");
}

#[test]
fn a_target_with_a_send_thread_serves_every_byte() {
    serve_every_byte(Stages::SendThread);
}

#[test]
fn a_target_with_a_receive_thread_serves_every_byte() {
    serve_every_byte(Stages::RecvThread);
}

#[test]
fn a_target_that_runs_to_completion_hands_nothing_off() {
    let t = staged(Stages::RunToCompletion);
    let mut lane = Lane::connect(&tcp_endpoint(&t), "vol", &LaneConfig::default()).unwrap();
    verify::write_read(&mut lane, 7, 0, 1 << 20, 4096, 16);
    assert_eq!(t.stats().get("stage_handoffs"), Some(0));
}

/// A peer that breaks the protocol gets its GOAWAY before the close, whichever thread sends,
/// and its neighbour on the same target carries on.
#[test]
fn staged_targets_say_goodbye_before_closing() {
    for stages in [Stages::SendThread, Stages::RecvThread] {
        let t = staged(stages);
        let mut neighbour = Lane::connect(&tcp_endpoint(&t), "vol", &LaneConfig::default()).unwrap();
        let limits = wire::control::Limits { queue_depth: 8, ..LaneConfig::default().limits };
        let (mut p, _) = RawPeer::ready(&t, limits, "vol");
        p.send(&Header { kind: FrameKind::Completions, desc_count: 0, payload_len: 0 }.to_bytes());
        let (h, body) = p.recv().unwrap_or_else(|| panic!("{stages}: no GOAWAY"));
        assert_eq!(h.kind, FrameKind::GoAway, "{stages}");
        assert_eq!(GoAway::decode(&body).unwrap().status, Status::Invalid, "{stages}");
        assert!(p.closed(), "{stages}: connection left open");
        verify::write_read(&mut neighbour, 3, 0, 1 << 20, 4096, 8);
    }
}

#[test]
fn a_staged_target_refuses_tls() {
    let dir = tempfile::tempdir().unwrap();
    certs::make(dir.path());
    let config = transport::tls::CertDir::new(dir.path()).server_config(false).unwrap();
    let mut c = server::TargetConfig {
        listen: vec![transport::Endpoint::Tcp("127.0.0.1:0".into())],
        exports: vec!["vol=ram:1M".parse().unwrap()],
        stages: Stages::SendThread,
        ..server::TargetConfig::default()
    };
    c.tls = Some(server::TlsListen { mode: transport::tls::TlsMode::On, config, verify_peer: false });
    let err = server::Target::start(c).err().expect("a staged target with TLS must not start");
    assert!(err.to_string().contains("TLS"), "{err}");
}

/// A staged target that stops tells its peers so, through the same thread as every reply.
#[test]
fn a_stopping_staged_target_says_goodbye() {
    for stages in [Stages::SendThread, Stages::RecvThread] {
        let t = staged(stages);
        let limits = wire::control::Limits { queue_depth: 8, ..LaneConfig::default().limits };
        let (mut p, _) = RawPeer::ready(&t, limits, "vol");
        t.shutdown();
        let (h, body) = p.recv().unwrap_or_else(|| panic!("{stages}: no GOAWAY"));
        assert_eq!(h.kind, FrameKind::GoAway, "{stages}");
        assert_eq!(GoAway::decode(&body).unwrap().status, Status::ShuttingDown, "{stages}");
        assert!(p.closed(), "{stages}: connection left open");
    }
}
