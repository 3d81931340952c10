//! Flash volumes as a user drives them: `skiff flash format` on sparse files, `skiff serve
//! --flash` in one process, `skiff vol` in others, the volumes reached over the native
//! protocol (a lane) and NBD (qemu-io, nbdinfo), and the target stopped and started again.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use initiator::{Endpoint, Lane, LaneConfig};
use skiff_tests::{run_ok, tool};

const QEMU: &str = "qemu-utils";
const LIBNBD: &str = "libnbd-bin";

fn skiff() -> Command {
    Command::new(env!("CARGO_BIN_EXE_skiff"))
}

fn output(args: &[&str]) -> Output {
    skiff().args(args).output().expect("run skiff")
}

/// `skiff ARGS`, which must succeed; returns stdout.
fn ok(args: &[&str]) -> String {
    let out = output(args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "skiff {args:?}: {}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `skiff ARGS`, which must fail saying `says`; returns stderr.
fn refused(args: &[&str], says: &str) -> String {
    let out = output(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "skiff {args:?} succeeded: {}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr.contains(says), "skiff {args:?}: expected {says:?} in: {stderr}");
    stderr
}

/// Two sparse 128 MiB files in a directory under /var/tmp, as one array's devices.
fn devices() -> (tempfile::TempDir, String) {
    let dir = tempfile::Builder::new().prefix("skiff-flash-").tempdir_in("/var/tmp").unwrap();
    let paths: Vec<String> = ["a.img", "b.img"]
        .iter()
        .map(|name| {
            let path = dir.path().join(name);
            std::fs::File::create(&path).unwrap().set_len(128 << 20).unwrap();
            path.display().to_string()
        })
        .collect();
    (dir, paths.join(","))
}

/// A running `skiff serve --flash`, and its native and NBD addresses.
struct Served {
    child: Child,
    native: String,
    nbd: String,
}

impl Served {
    fn start(flash: &str, extra: &[&str]) -> Served {
        let mut cmd = skiff();
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--nbd", "127.0.0.1:0", "--workers", "2"]);
        cmd.args(["--flash", flash, "--flash-cache", "16M"]).args(extra);
        let mut child = cmd.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().expect("spawn skiff serve");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let (mut native, mut nbd) = (None, None);
        let deadline = Instant::now() + Duration::from_secs(30);
        while (native.is_none() || nbd.is_none()) && Instant::now() < deadline {
            let Some(Ok(line)) = lines.next() else { break };
            if let Some(i) = line.find("listening ep=") {
                let addr = line[i + "listening ep=".len()..].split_whitespace().next().unwrap().to_owned();
                if line.contains("protocol=Nbd") {
                    nbd = Some(addr);
                } else {
                    native = Some(addr);
                }
            }
        }
        let (Some(native), Some(nbd)) = (native, nbd) else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("skiff serve --flash did not report its addresses");
        };
        // Keep draining the log so that the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines.by_ref() {});
        Served { child, native, nbd }
    }

    /// `skiff vol ACTION ARGS --target` this target.
    fn vol(&self, args: &[&str]) -> Vec<String> {
        let mut all: Vec<String> = vec!["vol".into()];
        all.extend(args.iter().map(|a| a.to_string()));
        all.extend(["--target".into(), self.native.clone()]);
        all
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint::parse(&self.native).unwrap()
    }

    fn uri(&self, export: &str) -> String {
        format!("nbd://{}/{export}", self.nbd)
    }

    /// SIGTERM, and wait for a clean exit.
    fn stop(mut self) {
        Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "skiff serve exited with {status}");
                return;
            }
            assert!(Instant::now() < deadline, "skiff serve ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn as_strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

fn vol_ok(s: &Served, args: &[&str]) -> String {
    ok(&as_strs(&s.vol(args)))
}

fn vol_refused(s: &Served, args: &[&str], says: &str) -> String {
    refused(&as_strs(&s.vol(args)), says)
}

fn list(s: &Served) -> serde_json::Value {
    serde_json::from_str(&vol_ok(s, &["list", "--json"])).expect("vol list --json is JSON")
}

fn names(listing: &serde_json::Value) -> Vec<String> {
    listing["volumes"].as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap().to_owned()).collect()
}

fn nbd_exports(s: &Served) -> Vec<String> {
    let out = run_ok(tool("nbdinfo", LIBNBD).args(["--list", "--json", &format!("nbd://{}", s.nbd)]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["exports"].as_array().unwrap().iter().map(|e| e["export-name"].as_str().unwrap().to_owned()).collect()
}

fn qemu_io(s: &Served, export: &str, command: &str) -> String {
    run_ok(tool("qemu-io", QEMU).args(["-f", "raw", &s.uri(export), "-c", command]))
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn read(s: &Served, export: &str, offset: u64, len: usize) -> Vec<u8> {
    let mut lane = Lane::connect(&s.endpoint(), export, &LaneConfig::default()).expect("a lane");
    let mut buf = vec![0; len];
    lane.read_at(&mut buf, offset).expect("read");
    buf
}

#[test]
fn format_refuses_what_it_would_overwrite_unless_forced() {
    let (dir, flash) = devices();
    let out = ok(&["flash", "format", &flash, "--segment", "4M"]);
    assert!(out.contains("2 device(s)") && out.contains("segments of 4.0 MiB"), "{out}");
    refused(&["flash", "format", &flash], "holds a skiff flash array; format it anyway with --force");
    ok(&["flash", "format", &flash, "--segment", "4M", "--force"]);
    let missing = dir.path().join("missing.img").display().to_string();
    refused(&["flash", "format", &missing], "missing.img");
    refused(&["flash", "format", &flash, "--segment", "5000", "--force"], "multiple of 4 KiB");

    // Serving: a device missing from the array, a file that holds none, a name taken.
    let first = flash.split(',').next().unwrap();
    let no_array = dir.path().join("empty.img");
    std::fs::File::create(&no_array).unwrap().set_len(64 << 20).unwrap();
    let serve = |flash: &str, extra: &[&str]| {
        let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--flash", flash, "--flash-cache", "16M"];
        args.extend_from_slice(extra);
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let run = |args: Vec<String>, says: &str| refused(&as_strs(&args), says);
    run(serve(first, &[]), "missing device index 1");
    let other = dir.path().join("other.img");
    std::fs::File::create(&other).unwrap().set_len(128 << 20).unwrap();
    ok(&["flash", "format", &other.display().to_string(), "--segment", "4M"]);
    let mixed = format!("{first},{}", other.display());
    run(serve(&mixed, &[]), "belongs to another flash array than");
    run(serve(&missing, &[]), "missing.img: No such file or directory");
    run(serve(&no_array.display().to_string(), &[]), "holds no skiff flash array (run `skiff flash format`)");
    let s = Served::start(&flash, &[]);
    vol_ok(&s, &["create", "disk", "--size", "1M"]);
    s.stop();
    run(serve(&flash, &["--export", "disk=ram:1M"]), "flash volume \"disk\" has the name of an --export");
}

#[test]
fn volumes_are_exports_over_both_protocols_and_survive_a_restart() {
    let (_dir, flash) = devices();
    ok(&["flash", "format", &flash, "--segment", "4M"]);
    let s = Served::start(&flash, &[]);
    assert_eq!(names(&list(&s)), Vec::<String>::new());
    let made = vol_ok(&s, &["create", "v1", "--size", "64M"]);
    assert!(made.contains("created volume \"v1\" of 64.0 MiB"), "{made}");
    assert_eq!(nbd_exports(&s), ["v1"], "NBD lists a volume as soon as it exists");

    // Native writes read back through NBD, and NBD writes through the native protocol.
    let data = pattern(7, 256 << 10);
    let mut lane = Lane::connect(&s.endpoint(), "v1", &LaneConfig::default()).unwrap();
    assert_eq!(lane.export().size_bytes, 64 << 20);
    lane.write_at(&data, 1 << 20).unwrap();
    lane.flush().unwrap();
    drop(lane);
    let dumped = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
    run_ok(tool("nbdcopy", LIBNBD).args([&s.uri("v1"), dumped.path().to_str().unwrap()]));
    let image = std::fs::read(dumped.path()).unwrap();
    assert_eq!(&image[1 << 20..(1 << 20) + data.len()], &data[..], "NBD reads what the lane wrote");
    qemu_io(&s, "v1", "write -P 0x5a 8M 64k");
    assert_eq!(read(&s, "v1", 8 << 20, 64 << 10), vec![0x5a; 64 << 10], "a lane reads what NBD wrote");

    // A snapshot is a read-only export holding the data as it was; a clone of it is writable.
    let snap = vol_ok(&s, &["snapshot", "v1", "s1"]);
    assert!(snap.contains("read-only snapshot \"s1\" of \"v1\""), "{snap}");
    qemu_io(&s, "v1", "write -P 0x11 8M 64k");
    assert_eq!(read(&s, "s1", 8 << 20, 64 << 10), vec![0x5a; 64 << 10], "the snapshot kept the old data");
    let code = tool("nbdinfo", LIBNBD).args(["--can", "write", &s.uri("s1")]).status().unwrap().code();
    assert_eq!(code, Some(2), "a snapshot is not writable over NBD");
    let mut on_snap = Lane::connect(&s.endpoint(), "s1", &LaneConfig::default()).unwrap();
    assert!(on_snap.write_at(&[1; 4096], 0).is_err(), "nor over the native protocol");
    drop(on_snap);
    vol_ok(&s, &["clone", "s1", "c1"]);
    qemu_io(&s, "c1", "write -P 0x22 0 4k");
    assert_eq!(read(&s, "c1", 8 << 20, 4096), vec![0x5a; 4096], "the clone starts as the snapshot");
    assert_eq!(read(&s, "s1", 0, 4096), vec![0; 4096], "writing the clone leaves the snapshot be");
    let mut exports = nbd_exports(&s);
    exports.sort();
    assert_eq!(exports, ["c1", "s1", "v1"]);

    // Deletion: refused with children, and with connections open (NBD, then native).
    vol_refused(&s, &["delete", "v1"], "volume \"v1\" has snapshots or clones (s1): delete them first");
    vol_refused(&s, &["delete", "s1"], "(c1)");
    let mut held = tool("qemu-io", QEMU)
        .args(["-f", "raw", &s.uri("c1")])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Once it has read through its connection, the connection is in transmission on c1.
    let mut stdin = held.stdin.take().unwrap();
    stdin.write_all(b"read 0 512\n").unwrap();
    let mut replies = BufReader::new(held.stdout.take().unwrap()).lines();
    assert!(replies.any(|l| l.unwrap().contains("read 512/512 bytes")), "qemu-io read through NBD");
    vol_refused(&s, &["delete", "c1"], "volume \"c1\" is open on 1 connection(s): close them first");
    stdin.write_all(b"quit\n").unwrap();
    drop(stdin);
    held.wait().unwrap();
    let lane = Lane::connect(&s.endpoint(), "c1", &LaneConfig::default()).unwrap();
    vol_refused(&s, &["delete", "c1"], "volume \"c1\" is open on 1 connection(s): close them first");
    drop(lane);
    // The target notices a closed connection when its worker next reads the socket.
    wait_for(|| output(&as_strs(&s.vol(&["delete", "c1"]))).status.success());
    assert!(Lane::connect(&s.endpoint(), "c1", &LaneConfig::default()).is_err(), "c1 is gone");
    let gone = run_ok(tool("nbdinfo", LIBNBD).args(["--list", "--json", &format!("nbd://{}", s.nbd)]));
    assert!(!gone.contains("\"c1\""), "{gone}");
    vol_ok(&s, &["delete", "s1"]);

    // Bad input: a clear error, and nothing changes.
    let before = list(&s);
    vol_refused(&s, &["resize", "nope", "1M"], "no volume named \"nope\"");
    vol_refused(&s, &["create", "v1", "--size", "1M"], "volume name \"v1\" is already taken");
    vol_refused(&s, &["resize", "v1", "4M"], "shrinking would discard it");
    vol_refused(&s, &["create", "zero", "--size", "0"], "bad size");
    vol_refused(&s, &["create", "huge", "--size", "12Q"], "12Q");
    vol_refused(&s, &["create", "a/b", "--size", "1M"], "a/b");
    vol_refused(&s, &["snapshot", "nope", "s2"], "no volume named \"nope\"");
    assert_eq!(list(&s), before, "refusals change nothing");
    let grown = vol_ok(&s, &["resize", "v1", "128M"]);
    assert!(grown.contains("to 128.0 MiB"), "{grown}");
    let listing = list(&s);
    let v1 = &listing["volumes"][0];
    assert_eq!((v1["name"].as_str(), v1["size_bytes"].as_u64()), (Some("v1"), Some(128 << 20)));
    assert!(v1["allocated_bytes"].as_u64().unwrap() >= (256 << 10) + (64 << 10), "{v1}");
    assert_eq!((v1["writable"].as_bool(), v1["origin"].is_null()), (Some(true), true));

    let stats: serde_json::Value = serde_json::from_str(&vol_ok(&s, &["stats", "--json"])).unwrap();
    assert_eq!(stats["volumes"], 1);
    assert!(stats["write_amplification"].as_f64().unwrap() >= 1.0, "{stats}");
    assert!(stats["user_pages_written"].as_u64().unwrap() >= 64 + 16, "{stats}");
    assert!(stats["capacity_bytes"].as_u64() > stats["valid_bytes"].as_u64(), "{stats}");
    assert!(vol_ok(&s, &["stats"]).contains("write amplification"));
    assert!(vol_ok(&s, &["list"]).lines().any(|l| l.starts_with("v1 ")));

    // Stopped and started again: the same volumes, the same data, nothing to replay.
    s.stop();
    let s = Served::start(&flash, &[]);
    assert_eq!(list(&s), listing, "the volumes survive a restart");
    assert_eq!(read(&s, "v1", 1 << 20, data.len()), data);
    assert_eq!(read(&s, "v1", 8 << 20, 64 << 10), vec![0x11; 64 << 10]);
    assert_eq!(nbd_exports(&s), ["v1"]);
    s.stop();
}

/// Try `done` until it holds, for at most a few seconds.
fn wait_for(mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "still not done after 10 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_target_without_a_flash_array_says_so() {
    let mut child = skiff()
        .args(["serve", "--listen", "127.0.0.1:0", "--export", "vol=ram:1M"])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("a log line").unwrap();
        if let Some(i) = line.find("listening ep=") {
            break line[i + "listening ep=".len()..].split_whitespace().next().unwrap().to_owned();
        }
    };
    std::thread::spawn(move || for _ in lines.by_ref() {});
    refused(&["vol", "list", "--target", &addr], "this target serves no flash array");
    let _ = child.kill();
    let _ = child.wait();
}
