//! TLS on the native protocol through a real target (docs/PROTOCOL.md, section 2): lanes,
//! shared lanes and control connections over TLS, a plaintext client refused by a target that
//! requires TLS, both served when TLS is on, and a certificate from the wrong CA refused.

use std::sync::Arc;
use std::time::Duration;

use initiator::{Client, Error, Lane, LaneConfig, Queue, SharedLanes, Status, TlsConfig};
use skiff_tests::{certs, start_target_with, tcp_endpoint};
use transport::tls::{CertDir, TlsMode};

fn server(dir: &std::path::Path, mode: TlsMode) -> server::Target {
    let config = CertDir::new(dir).server_config(false).unwrap();
    start_target_with(&["vol=ram:16M,allow=alice:rw+*:ro"], |c| {
        c.tls = Some(server::TlsListen { mode, config, verify_peer: false });
        c.keys = vec![proto::auth::Key::new("alice", &[7; 16]).unwrap()];
    })
}

fn client_tls(dir: &std::path::Path) -> TlsConfig {
    CertDir::new(dir).client_config().unwrap()
}

fn lane(t: &server::Target, tls: Option<TlsConfig>, key: bool) -> Result<Lane, Error> {
    let config = LaneConfig {
        tls,
        key: key.then(|| Arc::new(proto::auth::Key::new("alice", &[7; 16]).unwrap())),
        timeout: Duration::from_secs(10),
        ..LaneConfig::default()
    };
    Lane::connect(&tcp_endpoint(t), "vol", &config)
}

fn round_trip(lane: &mut Lane, seed: u8) {
    // Large enough that frames span many TLS records and partial sends.
    let data: Vec<u8> = (0..256 * 1024).map(|i| (i as u8).wrapping_mul(seed)).collect();
    lane.write_at(&data, 1 << 20).unwrap();
    let mut back = vec![0u8; data.len()];
    lane.read_at(&mut back, 1 << 20).unwrap();
    assert!(back == data, "bytes changed over TLS");
}

#[test]
fn lanes_shared_lanes_and_control_connections_work_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    certs::make(dir.path());
    let t = server(dir.path(), TlsMode::Require);
    let tls = client_tls(dir.path());
    let mut l = lane(&t, Some(tls.clone()), true).unwrap();
    round_trip(&mut l, 3);
    // Many requests in flight through one TLS connection.
    for i in 0..64u64 {
        l.submit_write(i * 4096, vec![i as u8; 4096], initiator::ReqFlags::empty(), i)
            .map_err(|r| r.error)
            .unwrap();
    }
    let mut done = Vec::new();
    while done.len() < 64 {
        l.wait(1, &mut done).unwrap();
    }
    assert!(done.iter().all(|c| c.status.is_ok()));
    let config =
        LaneConfig { tls: Some(tls.clone()), timeout: Duration::from_secs(10), ..LaneConfig::default() };
    let shared = SharedLanes::connect(&tcp_endpoint(&t), "vol", &config, 2).unwrap();
    let mut h = shared.handle().unwrap();
    let mut buf = vec![0u8; 4096];
    h.read_at(&mut buf, 5 * 4096).unwrap();
    assert_eq!(buf, vec![5u8; 4096]);
    let mut admin = Client::connect_with(&tcp_endpoint(&t), None, Some(&tls)).unwrap();
    assert_eq!(admin.list().unwrap().len(), 1);
}

#[test]
fn a_plaintext_client_is_refused_where_tls_is_required_and_served_where_it_is_on() {
    let dir = tempfile::tempdir().unwrap();
    certs::make(dir.path());
    let required = server(dir.path(), TlsMode::Require);
    match lane(&required, None, false) {
        Err(Error::GoAway { status: Status::TlsRequired, .. } | Error::Refused(Status::TlsRequired)) => {}
        other => panic!("a plaintext lane on a require-TLS target: {:?}", other.map(|_| ())),
    }
    let on = server(dir.path(), TlsMode::On);
    round_trip(&mut lane(&on, Some(client_tls(dir.path())), true).unwrap(), 5);
    round_trip(&mut lane(&on, None, true).unwrap(), 7);
}

#[test]
fn a_target_certificate_from_another_ca_is_refused() {
    let (right, wrong) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    certs::make(right.path());
    certs::make(wrong.path());
    let t = server(right.path(), TlsMode::Require);
    match lane(&t, Some(client_tls(wrong.path())), false) {
        Err(e) => assert!(e.to_string().contains("TLS") || e.to_string().contains("certificate"), "{e}"),
        Ok(_) => panic!("a target signed by an unknown CA was trusted"),
    }
}
