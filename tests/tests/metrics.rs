//! The Prometheus endpoint of a real target: scraped before and after real load through lanes
//! and a raw peer, the counters checked against the load, the exposition checked by
//! `promtool check metrics` (Debian's `prometheus` package), and the metric names checked
//! against docs/METRICS.md. The target serves a flash array too, so that its families are
//! served and checked with the rest.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Stdio;
use std::time::Duration;

use initiator::{Client, Lane, LaneConfig, VolumeOp, VolumeRequest};
use server::Target;
use skiff_tests::{caravan, flash_array, run_ok, start_target_with, tcp_endpoint, tool, RawPeer};
use wire::{Limits, Opcode, ReqFlags, Request, Status};

const BS: usize = 4096;
const IOS: u64 = 256;

/// The target, and the directory of its flash array's devices (removed when dropped, after
/// the target).
fn start() -> (Target, tempfile::TempDir) {
    // A file export with a direct-read cache too, so that its families are served. The file
    // is unlinked once the target holds it open.
    let file = tempfile::NamedTempFile::new_in("/var/tmp").expect("a temporary file");
    file.as_file().set_len(1 << 20).unwrap();
    let cached = format!("cached=file:{},cache=64k", file.path().display());
    let (dir, devices) = flash_array(1, 128 << 20);
    // And an RStore pool (chunk grants), whose repair families a memory server serves.
    let t = start_target_with(&["vol=ram:16M", "golden=ram:1M,ro", &cached, "pool=ram:4M,block=1"], |c| {
        c.workers = 2;
        c.metrics_listen = Some("127.0.0.1:0".into());
        c.exports[3].grants = Some(server::GrantConfig { key: [9; 32], chunk_bytes: 1 << 20 });
        c.flash = Some(server::FlashConfig {
            devices,
            pool_bytes: 16 << 20,
            map_bytes: server::FLASH_MAP_BYTES_DEFAULT,
            read_depth: server::FLASH_READ_DEPTH_DEFAULT,
            references: None,
            rstore_pool: None,
        });
    });
    (t, dir)
}

/// A flash volume, written through a lane: its requests count under its export, and the
/// array's counters move.
fn load_flash(t: &Target) {
    let ep = tcp_endpoint(t);
    let mut client = Client::connect(&ep).expect("a control connection");
    let create =
        VolumeRequest { op: VolumeOp::Create, name: "fv".into(), origin: String::new(), size_bytes: 1 << 20 };
    assert_eq!(client.volume(&create).unwrap().status, Status::Ok);
    let mut lane = Lane::connect(&ep, "fv", &LaneConfig::default()).expect("lane to fv");
    for i in 0..16 {
        lane.write_at(&[0x3c; BS], i * BS as u64).expect("write");
    }
    lane.flush().expect("flush");
}

/// `GET /metrics`; returns the body after checking the status line and content type.
fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: skiff\r\nAccept: */*\r\n\r\n").unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).expect("a whole response");
    let (head, body) = reply.split_once("\r\n\r\n").expect("a head and a body");
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert!(head.contains("Content-Type: text/plain; version=0.0.4"), "{head}");
    assert!(head.contains(&format!("Content-Length: {}\r\n", body.len())), "{head}");
    body.to_owned()
}

/// The value of the sample `name` whose labels include all of `labels`; summed when several
/// match (e.g. over workers), `None` when none does.
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, v) = line.rsplit_once(' ').expect("a sample line");
        let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
        let wanted = labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        if n == name && wanted {
            *found.get_or_insert(0.0) += v.parse::<f64>().expect("a number");
        }
    }
    found
}

fn promtool_check(exposition: &str) {
    let mut child = tool("promtool", "prometheus")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child.stdin.take().unwrap().write_all(exposition.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}\n{}{}\nexposition:\n{exposition}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes and reads on `vol`, an out-of-range read, a write on the read-only export, and a
/// request naming a handle never opened. Returns the three connections, still open.
fn load(t: &Target) -> (Lane, Lane, RawPeer) {
    let ep = tcp_endpoint(t);
    let mut lane = Lane::connect(&ep, "vol", &LaneConfig::default()).expect("lane to vol");
    let mut buf = vec![0x5a; BS];
    for i in 0..IOS {
        lane.write_at(&buf, i * BS as u64).expect("write");
        lane.read_at(&mut buf, i * BS as u64).expect("read");
    }
    assert!(lane.read_at(&mut buf, 16 << 20).is_err(), "a read past the end fails");
    let mut golden = Lane::connect(&ep, "golden", &LaneConfig::default()).expect("lane to golden");
    assert!(golden.write_at(&buf, 0).is_err(), "golden is read-only");

    let (mut peer, handle) = RawPeer::ready(t, Limits::default(), "vol");
    let bad = Request {
        opcode: Opcode::Read,
        flags: ReqFlags::empty(),
        tag: 1,
        handle: handle + 7,
        offset: 0,
        length: BS as u32,
    };
    peer.send(&caravan(&[bad], &[]));
    assert!(peer.recv().is_some(), "the bad handle is answered");
    (lane, golden, peer)
}

#[test]
fn counters_move_under_load_and_promtool_accepts_the_exposition() {
    let (t, _devices) = start();
    let addr = t.metrics_addr().expect("a metrics address");
    let before = scrape(addr);
    promtool_check(&before);
    assert_eq!(value(&before, "skiff_requests_total", &[]), None, "no request yet");
    assert_eq!(value(&before, "skiff_connections_open", &[]), Some(0.0));
    assert_eq!(value(&before, "skiff_workers", &[]), Some(2.0));

    let _open = load(&t);
    let after = scrape(addr);
    promtool_check(&after);

    let vol = |op: &'static str| [("export", "vol"), ("opcode", op)];
    let reqs =
        |op, status| value(&after, "skiff_requests_total", &[vol(op)[0], vol(op)[1], ("status", status)]);
    assert_eq!(reqs("write", "ok"), Some(IOS as f64));
    assert_eq!(reqs("read", "ok"), Some(IOS as f64));
    assert_eq!(reqs("read", "out_of_range"), Some(1.0));
    let golden = [("export", "golden"), ("opcode", "write"), ("status", Status::ReadOnly.name())];
    assert_eq!(value(&after, "skiff_requests_total", &golden), Some(1.0));
    assert_eq!(value(&after, "skiff_requests_unattributed_total", &[("status", "bad_handle")]), Some(1.0));
    assert_eq!(value(&after, "skiff_request_bytes_total", &vol("read")), Some((IOS * BS as u64) as f64));
    assert_eq!(value(&after, "skiff_request_bytes_total", &vol("write")), Some((IOS * BS as u64) as f64));

    // Every answered request on an export is timed, the failed read included.
    let count = value(&after, "skiff_request_duration_seconds_count", &vol("read"));
    assert_eq!(count, Some(IOS as f64 + 1.0));
    let inf = [vol("read")[0], vol("read")[1], ("le", "+Inf")];
    assert_eq!(value(&after, "skiff_request_duration_seconds_bucket", &inf), count);
    assert!(value(&after, "skiff_request_duration_seconds_sum", &vol("read")).unwrap() > 0.0);

    let total = 2.0 * IOS as f64 + 3.0;
    assert_eq!(value(&after, "skiff_worker_requests_total", &[]), Some(total));
    assert_eq!(value(&after, "skiff_caravan_requests_sum", &[]), Some(total));
    assert!(value(&after, "skiff_caravan_requests_count", &[]).unwrap() >= 1.0);
    assert!(value(&after, "skiff_response_caravans_total", &[]).unwrap() >= 1.0);
    assert_eq!(value(&after, "skiff_connections_open", &[]), Some(3.0));
    assert_eq!(value(&after, "skiff_connections_accepted_total", &[]), Some(3.0));
    assert!(value(&after, "skiff_received_bytes_total", &[]).unwrap() >= (IOS * BS as u64) as f64);
    assert!(value(&after, "skiff_sent_bytes_total", &[]).unwrap() >= (IOS * BS as u64) as f64);
    assert_eq!(value(&after, "skiff_export_size_bytes", &[("export", "vol")]), Some((16 << 20) as f64));
    assert_eq!(value(&after, "skiff_export_info", &[("export", "golden"), ("read_only", "true")]), Some(1.0));
    // The listeners' counters are there from the start, whether or not they have moved.
    for name in ["skiff_connections_refused_total", "skiff_handshake_timeouts_total"] {
        assert!(value(&after, name, &[]).is_some(), "{name}");
    }

    // A flash volume made and written while the target runs: its export and the array count.
    assert_eq!(value(&after, "skiff_flash_volumes", &[]), Some(0.0));
    assert_eq!(value(&after, "skiff_flash_user_pages_written_total", &[]), Some(0.0));
    load_flash(&t);
    let flashed = scrape(addr);
    promtool_check(&flashed);
    assert_eq!(value(&flashed, "skiff_flash_volumes", &[]), Some(1.0));
    let fv = [("export", "fv"), ("opcode", "write"), ("status", "ok")];
    assert_eq!(value(&flashed, "skiff_requests_total", &fv), Some(16.0));
    assert_eq!(value(&flashed, "skiff_export_info", &[("export", "fv"), ("kind", "flash")]), Some(1.0));
    assert_eq!(value(&flashed, "skiff_flash_user_pages_written_total", &[]), Some(16.0));
    assert!(value(&flashed, "skiff_flash_device_pages_written_total", &[]).unwrap() >= 16.0);
    assert!(value(&flashed, "skiff_flash_write_amplification", &[]).unwrap() >= 1.0);
    assert_eq!(value(&flashed, "skiff_flash_valid_bytes", &[]), Some(16.0 * BS as f64));
    let capacity = value(&flashed, "skiff_flash_capacity_bytes", &[]).unwrap();
    assert_eq!(value(&flashed, "skiff_flash_free_bytes", &[]), Some(capacity - 16.0 * BS as f64));
    assert_eq!(value(&flashed, "skiff_flash_pool_pages", &[]), Some(4096.0));
}

#[test]
fn nbd_requests_count_under_their_export_and_opcode() {
    let t = start_target_with(&["vol=ram:16M", "nbdvol=ram:1M"], |c| {
        c.workers = 1;
        c.nbd_listen = vec![transport::Endpoint::Tcp("127.0.0.1:0".into())];
        c.metrics_listen = Some("127.0.0.1:0".into());
    });
    let transport::Endpoint::Tcp(addr) = t.endpoints_of(server::Protocol::Nbd)[0].clone() else {
        unreachable!()
    };
    let uri = format!("nbd://{addr}/nbdvol");
    // Each 4 KiB command is one NBD request; qemu also flushes when it closes.
    run_ok(tool("qemu-io", "qemu-utils").args([
        "-f",
        "raw",
        &uri,
        "-c",
        "write -P 0x11 0 4k",
        "-c",
        "read -P 0x11 0 4k",
        "-c",
        "flush",
    ]));
    let text = scrape(t.metrics_addr().unwrap());
    promtool_check(&text);
    for op in ["write", "read"] {
        let labels = [("export", "nbdvol"), ("opcode", op), ("status", "ok")];
        assert_eq!(value(&text, "skiff_requests_total", &labels), Some(1.0), "{op}:\n{text}");
        let timed = [("export", "nbdvol"), ("opcode", op)];
        assert_eq!(value(&text, "skiff_request_duration_seconds_count", &timed), Some(1.0), "{op}");
    }
    let flushes = [("export", "nbdvol"), ("opcode", "flush"), ("status", "ok")];
    assert!(value(&text, "skiff_requests_total", &flushes) >= Some(1.0), "{text}");
    assert_eq!(
        value(&text, "skiff_request_bytes_total", &[("export", "nbdvol"), ("opcode", "read")]),
        Some(4096.0)
    );
    assert_eq!(value(&text, "skiff_requests_total", &[("export", "vol")]), None, "only the export asked for");
}

/// The metric names in the table of docs/METRICS.md, in order.
fn documented_names() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/METRICS.md"))
        .expect("docs/METRICS.md");
    let start = doc.find("## Metrics").expect("the metrics section");
    let end = start + doc[start..].find("tests/tests/metrics.rs").expect("the end of the table");
    doc[start..end]
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|row| row.split('`').nth(1).expect("a name").to_owned())
        .collect()
}

#[test]
fn the_documented_metrics_are_the_ones_the_target_serves() {
    let (t, _devices) = start();
    // After load every family has a sample, so every family is in the exposition.
    let _open = load(&t);
    let text = scrape(t.metrics_addr().unwrap());
    let served: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap().to_owned())
        .collect();
    assert_eq!(documented_names(), served, "docs/METRICS.md and the target disagree");
}
