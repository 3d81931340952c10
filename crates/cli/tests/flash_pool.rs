//! RStore on FlashNet (issue 29, thesis chapter 7): a memory server donates a thin volume of
//! its flash array (`skiff serve --flash DEV --pool flash:SIZE`) to a real etcd. A flash-scope
//! namespace larger than the device is reserved and allocated without a page of flash taken;
//! its bytes survive a clean restart of the server (the same incarnation, the chunks found
//! where they were), a `kill -9` makes the pool a new one (writes acknowledged in the array's
//! DRAM may be gone, so nothing on it is trusted), a namespace given back is unmapped, and
//! the pool's volume is held out of `skiff vol` changes. A pool served with `,sync` (every
//! write durable before it is acknowledged) keeps its chunks and its incarnation across a
//! `kill -9`. `skiff rsort --scope flash` sorts on flash namespaces.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use skiff_tests::etcd::Cluster;
use skiff_tests::KillOnDrop;

fn skiff() -> Command {
    Command::new(env!("CARGO_BIN_EXE_skiff"))
}

fn ok(args: &[&str]) -> String {
    let out = skiff().args(args).output().expect("skiff");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "skiff {args:?}: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    stdout
}

fn json(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(ok(args).trim()).expect("JSON")
}

/// A sparse device file of `bytes`, formatted as a flash array.
fn device(dir: &Path, name: &str, bytes: u64) -> PathBuf {
    let path = dir.join(name);
    std::fs::File::create(&path).unwrap().set_len(bytes).unwrap();
    ok(&["flash", "format", path.to_str().unwrap(), "--segment", "1M"]);
    path
}

/// A memory server on `port` donating `pool` of the array on `dev`.
fn flash_server(url: &str, dev: &Path, pool: &str, port: u16) -> KillOnDrop {
    KillOnDrop(
        skiff()
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--flash"])
            .arg(dev)
            .args([
                "--flash-cache",
                "8M",
                "--pool",
                pool,
                "--chunk",
                "1M",
                "--coordinator",
                url,
                "--lease",
                "3s",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("skiff serve --pool flash:"),
    )
}

/// The registered servers once there are `n`.
fn servers(url: &str, n: usize) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let s = json(&["ns", "--coordinator", url, "servers", "--json"]);
        if s.as_array().map(Vec::len) == Some(n) {
            return s;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "never {n} servers: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pool volume's allocated bytes, as `skiff vol list` shows them.
fn allocated(port: u16) -> u64 {
    let list = json(&["vol", "list", "--target", &format!("127.0.0.1:{port}"), "--json"]);
    let pool =
        list["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "pool").expect("the pool volume");
    pool["allocated_bytes"].as_u64().unwrap()
}

fn stop(server: &mut KillOnDrop) {
    let _ = Command::new("kill").args(["-TERM", &server.0.id().to_string()]).status();
    let status = server.0.wait().unwrap();
    assert!(status.success(), "a clean stop: {status}");
}

#[test]
fn a_flash_pool_is_thin_keeps_its_chunks_across_a_clean_restart_and_is_new_after_kill_9() {
    let etcd = Cluster::start(1);
    let url = etcd.url();
    let dir = tempfile::tempdir().unwrap();
    let dev = device(dir.path(), "flash.img", 64 << 20);
    let port = skiff_tests::free_ports(1)[0];
    let mut server = flash_server(&url, &dev, "flash:1G", port);
    let s = servers(&url, 1);
    assert_eq!((s[0]["scope"].as_str(), s[0]["bytes"].as_u64()), (Some("flash"), Some(1 << 30)), "{s}");
    let incarnation = s[0]["incarnation"].as_u64().unwrap();

    // 1 GiB reserved and allocated on a 64 MiB device: records only, no page of flash.
    let ns = |args: &[&str]| ok(&[&["ns", "--coordinator", url.as_str()][..], args].concat());
    ns(&["create", "big", "--size", "1G", "--scope", "flash"]);
    ns(&["alloc", "big", "1G"]);
    assert_eq!(allocated(port), 0, "reserving and allocating took flash");
    let refused =
        skiff().args(["ns", "--coordinator", &url, "create", "ram", "--size", "1M"]).output().unwrap();
    assert!(!refused.status.success(), "a RAM namespace found room on a flash pool");

    let c = rstore::Coordinator::connect(std::slice::from_ref(&url));
    let mut seg = skiff_tests::rstore::segment(&c, "big", 0);
    let pattern: Vec<u8> = (0..(2u32 << 20)).map(|i| (i % 251) as u8).collect();
    seg.write(3 << 20, &pattern).unwrap();
    seg.write((1 << 30) - 1, &[0x5a]).unwrap();

    // A clean stop writes everything back: the same pool comes back, with the bytes.
    stop(&mut server);
    let mut server = flash_server(&url, &dev, "flash:1G", port);
    assert_eq!(servers(&url, 1)[0]["incarnation"].as_u64(), Some(incarnation), "the same pool");
    // Written back at the stop: flash is taken where written, and only there.
    let used = allocated(port);
    assert_eq!(used, (2 << 20) + 4096, "2 MiB and the page of the last byte");
    let mut seg = skiff_tests::rstore::segment(&c, "big", 0);
    let mut back = vec![0u8; pattern.len()];
    seg.read(3 << 20, &mut back).unwrap();
    assert!(back == pattern, "the chunks' bytes after a clean restart");
    let mut last = [0u8];
    seg.read((1 << 30) - 1, &mut last).unwrap();
    assert_eq!(last, [0x5a]);

    // Its volume is not the volume manager's to change.
    let vol = |args: &[&str]| {
        let target = format!("127.0.0.1:{port}");
        skiff().args(["vol"]).args(args).args(["--target", &target]).output().unwrap()
    };
    for args in [
        &["delete", "pool"][..],
        &["resize", "pool", "2G"],
        &["snapshot", "pool", "s"],
        &["delete", "pool.state"],
    ] {
        let out = vol(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("RStore pool"), "vol {args:?}: {err}");
    }

    // kill -9: writes acknowledged in the page pool may be lost, so the pool is a new one and
    // the namespace's copy on it is not trusted.
    seg.write(0, &[1; 4096]).unwrap();
    drop(seg);
    let _ = server.0.kill();
    let _ = server.0.wait();
    let _server = flash_server(&url, &dev, "flash:1G", port);
    let start = Instant::now();
    let again = loop {
        let s = servers(&url, 1);
        if s[0]["incarnation"].as_u64() != Some(incarnation) {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the old registration never lapsed: {s}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_ne!(again[0]["incarnation"].as_u64(), Some(incarnation), "{again}");
    let listed = ns(&["list"]);
    assert!(listed.contains("LOST"), "one copy, on a pool that is not the one it was written to: {listed}");

    // Given back: zeroed by unmapping, so the flash comes back too.
    ns(&["delete", "big"]);
    let id = again[0]["id"].as_str().unwrap().to_owned();
    let start = Instant::now();
    while !c.dirty(&id).unwrap().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(60), "the server never zeroed its chunks");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(allocated(port), 0, "zeroing a chunk given back unmaps its pages");
}

/// `--pool flash:SIZE,sync`: every write reaches flash before it is acknowledged (through the
/// array's sync thread, the worker serving on), so a `kill -9` right after the last write
/// loses nothing. The restarted server comes back as the same pool, and the namespace's one
/// copy on it is neither lost nor rebuilt: its bytes are there.
#[test]
fn a_sync_flash_pool_keeps_its_chunks_and_incarnation_across_kill_9() {
    let etcd = Cluster::start(1);
    let url = etcd.url();
    let dir = tempfile::tempdir().unwrap();
    let dev = device(dir.path(), "flash.img", 64 << 20);
    let port = skiff_tests::free_ports(1)[0];
    let mut server = flash_server(&url, &dev, "flash:256M,sync", port);
    let before = servers(&url, 1)[0].clone();
    let ns = |args: &[&str]| ok(&[&["ns", "--coordinator", url.as_str()][..], args].concat());
    ns(&["create", "kept", "--size", "16M", "--scope", "flash"]);
    ns(&["alloc", "kept", "16M"]);
    let c = rstore::Coordinator::connect(std::slice::from_ref(&url));
    let mut seg = skiff_tests::rstore::segment(&c, "kept", 0);
    let pattern: Vec<u8> = (0..(3u32 << 20) + 333).map(|i| (i % 253) as u8).collect();
    seg.write(5 << 20, &pattern).unwrap();
    seg.write(77, b"the last write before the kill").unwrap();
    let stats = json(&["vol", "stats", "--target", &format!("127.0.0.1:{port}"), "--json"]);
    assert!(stats["syncs_later"].as_u64() > Some(0), "no write went to the sync thread: {stats}");
    let _ = server.0.kill();
    let _ = server.0.wait();
    drop(seg);

    let _server = flash_server(&url, &dev, "flash:256M,sync", port);
    let start = Instant::now();
    let after = loop {
        let s = servers(&url, 1);
        if s[0]["boot"] != before["boot"] {
            break s[0].clone();
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the old registration never lapsed: {s}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(after["incarnation"], before["incarnation"], "the same pool after kill -9: {after}");
    let listed = ns(&["list"]);
    assert!(!listed.contains("LOST"), "the copy survived on the same pool: {listed}");
    let mut seg = skiff_tests::rstore::segment(&c, "kept", 0);
    let mut back = vec![0u8; pattern.len()];
    seg.read(5 << 20, &mut back).unwrap();
    assert!(back == pattern, "the acknowledged bytes after kill -9");
    let mut last = [0u8; 30];
    seg.read(77, &mut last).unwrap();
    assert_eq!(&last, b"the last write before the kill");
}

#[test]
fn rsort_sorts_on_flash_namespaces() {
    let etcd = Cluster::start(1);
    let url = etcd.url();
    let dir = tempfile::tempdir().unwrap();
    let ports = skiff_tests::free_ports(2);
    let _servers: Vec<KillOnDrop> = (0..2)
        .map(|i| {
            flash_server(&url, &device(dir.path(), &format!("f{i}.img"), 64 << 20), "flash:256M", ports[i])
        })
        .collect();
    servers(&url, 2);
    let common = ["rsort", "--coordinator", url.as_str(), "--chunk", "1M", "--scope", "flash", "--json"];
    let run = |args: &[&str]| json(&[&common[..], args].concat());
    assert_eq!(run(&["gen", "--records", "20000"])["records"].as_f64(), Some(20000.0));
    assert_eq!(run(&["sort", "--workers", "2"])["workers"].as_f64(), Some(2.0));
    assert_eq!(run(&["check"])["records"].as_f64(), Some(20000.0));
    let listed = ok(&["ns", "--coordinator", &url, "list"]);
    assert!(listed.contains("rsort-out: flash"), "{listed}");
    assert!(ports.iter().all(|&p| allocated(p) > 0), "the records are on flash");
}
