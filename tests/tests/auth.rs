//! Authentication and per-export access through a real target: keys proven both ways in the
//! handshake, rights per export and per key, every refusal with its own status, and NBD
//! clients held to an export's anonymous rights (docs/PROTOCOL.md, section 15).

use std::sync::Arc;
use std::time::Duration;

use initiator::{Client, Error, ExportFlags, Lane, LaneConfig, Status};
use proto::auth::Key;
use skiff_tests::{run_ok, start_target_with, tcp_endpoint, tool};
use transport::Endpoint;

fn key(name: &str, byte: u8) -> Key {
    Key::new(name, &[byte; 16]).unwrap()
}

/// alice may write `vol`, bob only read it; carol is known but listed nowhere; `secret` is
/// alice's alone; `public` is open to anyone; `shared` lets anyone read and alice write.
fn target() -> server::Target {
    start_target_with(
        &[
            "vol=ram:4M,allow=alice:rw+bob:ro",
            "secret=ram:1M,allow=alice:rw",
            "public=ram:1M",
            "shared=ram:1M,allow=alice:rw+*:ro",
        ],
        |c| {
            c.keys = vec![key("alice", 1), key("bob", 2), key("carol", 3)];
            c.nbd_listen = vec![Endpoint::Tcp("127.0.0.1:0".into())];
        },
    )
}

fn lane(t: &server::Target, export: &str, key: Option<Key>) -> Result<Lane, Error> {
    let config =
        LaneConfig { key: key.map(Arc::new), timeout: Duration::from_secs(10), ..LaneConfig::default() };
    Lane::connect(&tcp_endpoint(t), export, &config)
}

fn refused(r: Result<Lane, Error>) -> Status {
    match r {
        Err(Error::Refused(status)) => status,
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("not refused"),
    }
}

#[test]
fn keys_grant_exactly_their_rights() {
    let t = target();
    let mut alice = lane(&t, "vol", Some(key("alice", 1))).unwrap();
    alice.write_at(&[7; 4096], 0).unwrap();
    let mut bob = lane(&t, "vol", Some(key("bob", 2))).unwrap();
    assert!(bob.export().flags.has(ExportFlags::READ_ONLY), "a read-only grant says so at OPEN");
    let mut buf = vec![0u8; 4096];
    bob.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, vec![7; 4096]);
    match bob.write_at(&[9; 4096], 0) {
        Err(Error::Status(Status::ReadOnly)) => {}
        other => panic!("a read-only key wrote: {other:?}"),
    }
    assert!(!alice.export().flags.has(ExportFlags::READ_ONLY));
    // An export without a list is anyone's, keyed or not; one with `*` lets anyone read.
    lane(&t, "public", None).unwrap().write_at(&[1; 512], 0).unwrap();
    lane(&t, "public", Some(key("carol", 3))).unwrap().write_at(&[1; 512], 0).unwrap();
    let anon_shared = lane(&t, "shared", None).unwrap();
    assert!(anon_shared.export().flags.has(ExportFlags::READ_ONLY));
    let carol_shared = lane(&t, "shared", Some(key("carol", 3))).unwrap();
    assert!(carol_shared.export().flags.has(ExportFlags::READ_ONLY), "an unlisted key gets what anyone gets");
    assert!(!lane(&t, "shared", Some(key("alice", 1))).unwrap().export().flags.has(ExportFlags::READ_ONLY));
}

#[test]
fn every_refusal_has_its_own_status() {
    let t = target();
    assert_eq!(refused(lane(&t, "vol", None)), Status::AuthRequired, "no key");
    assert_eq!(refused(lane(&t, "vol", Some(key("alice", 9)))), Status::AuthFailed, "a wrong secret");
    assert_eq!(refused(lane(&t, "vol", Some(key("mallory", 1)))), Status::AuthFailed, "an unknown key");
    assert_eq!(refused(lane(&t, "secret", Some(key("bob", 2)))), Status::AccessDenied, "a key not listed");
    assert_eq!(refused(lane(&t, "secret", None)), Status::AuthRequired);
    // The target still serves everyone else.
    lane(&t, "secret", Some(key("alice", 1))).unwrap().write_at(&[3; 512], 0).unwrap();
}

#[test]
fn a_listing_shows_what_the_key_may_open() {
    let t = target();
    let names = |key: Option<Key>| -> Vec<(String, bool)> {
        let mut c = Client::connect_with_key(&tcp_endpoint(&t), key.as_ref()).unwrap();
        c.list().unwrap().into_iter().map(|e| (e.name, e.flags.has(ExportFlags::READ_ONLY))).collect()
    };
    let n = |v: &[(&str, bool)]| v.iter().map(|(s, ro)| (s.to_string(), *ro)).collect::<Vec<_>>();
    assert_eq!(names(None), n(&[("public", false), ("shared", true)]));
    assert_eq!(names(Some(key("bob", 2))), n(&[("vol", true), ("public", false), ("shared", true)]));
    assert_eq!(
        names(Some(key("alice", 1))),
        n(&[("vol", false), ("secret", false), ("public", false), ("shared", false)])
    );
}

/// A target holding another secret under alice's name refuses alice's proof. (One that
/// pretends to accept any proof is caught by the initiator when its own proof comes back
/// wrong: `proto::client::handshake` tests that in memory.)
#[test]
fn a_target_with_another_secret_for_the_name_refuses_the_key() {
    let impostor = start_target_with(&["vol=ram:1M"], |c| c.keys = vec![key("alice", 5)]);
    assert_eq!(refused(lane(&impostor, "vol", Some(key("alice", 1)))), Status::AuthFailed);
}

#[test]
fn nbd_clients_get_the_anonymous_rights_only() {
    let t = target();
    let Endpoint::Tcp(addr) = t.endpoints_of(server::Protocol::Nbd)[0].clone() else { unreachable!() };
    let list = run_ok(tool("nbdinfo", "libnbd-bin").args(["--list", &format!("nbd://{addr}")]));
    assert!(
        list.contains("export=\"public\"") || list.contains("export: public") || list.contains("public"),
        "{list}"
    );
    assert!(
        !list.contains("secret") && !list.contains("\"vol\""),
        "exports NBD clients may not open are not listed:\n{list}"
    );
    let shared = run_ok(tool("nbdinfo", "libnbd-bin").args([&format!("nbd://{addr}/shared")]));
    assert!(shared.contains("is_read_only: true"), "{shared}");
    let hidden = tool("nbdinfo", "libnbd-bin").arg(format!("nbd://{addr}/secret")).output().unwrap();
    assert!(!hidden.status.success(), "an NBD client opened a keyed export");
}

/// A lane proves its key again on every reconnection: a keyed export served by a target that
/// restarts (same address, same keys, new nonces) keeps answering, byte for byte.
#[test]
fn a_lane_authenticates_again_after_the_target_restarts() {
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let file = tempfile::Builder::new().prefix("skiff-auth-").tempfile_in("/var/tmp").unwrap();
    file.as_file().set_len(1 << 20).unwrap();
    let start = || {
        server::Target::start(server::TargetConfig {
            listen: vec![Endpoint::Tcp(addr.clone())],
            exports: vec![format!("vol=file:{},allow=alice:rw", file.path().display()).parse().unwrap()],
            keys: vec![key("alice", 1)],
            workers: 1,
            ..server::TargetConfig::default()
        })
        .expect("target starts")
    };
    let target = start();
    let config = LaneConfig {
        key: Some(Arc::new(key("alice", 1))),
        reconnect: initiator::ReconnectConfig {
            reconnect_delay_us: 50_000,
            ctrl_loss_timeout_us: 30_000_000,
            fast_io_fail_timeout_us: None,
        },
        ..LaneConfig::default()
    };
    let mut lane = Lane::connect(&Endpoint::Tcp(addr.clone()), "vol", &config).unwrap();
    lane.write_at(&[0x11; 4096], 0).unwrap();
    target.shutdown();
    let target = start();
    lane.write_at(&[0x22; 4096], 4096).unwrap();
    let mut buf = vec![0u8; 8192];
    lane.read_at(&mut buf, 0).unwrap();
    assert_eq!(&buf[..4096], &[0x11; 4096][..]);
    assert_eq!(&buf[4096..], &[0x22; 4096][..]);
    assert!(lane.stats().reconnects >= 1, "the lane reconnected: {:?}", lane.stats());
    drop(target);
}
