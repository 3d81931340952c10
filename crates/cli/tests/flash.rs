//! Flash volumes as a user drives them: `skiff flash format` on sparse files, `skiff serve
//! --flash` in one process, `skiff vol` in others, the volumes reached over the native
//! protocol (a lane) and NBD (qemu-io, nbdinfo, nbdsh), and the target stopped, or killed with
//! SIGKILL, and started again.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Lines, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use initiator::{Endpoint, Lane, LaneConfig};
use skiff_tests::{run_ok, tool};

const QEMU: &str = "qemu-utils";
const LIBNBD: &str = "libnbd-bin";
const LIBNBD_PYTHON: &str = "python3-libnbd";

/// The signal `Child::kill` sends.
const SIGKILL: i32 = 9;

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

/// A running `skiff serve --flash`, its native and NBD addresses, and the line it logged on
/// opening the array (what recovery found and replayed).
struct Served {
    child: Child,
    native: String,
    nbd: String,
    recovered: Option<String>,
}

impl Served {
    fn start(flash: &str, extra: &[&str]) -> Served {
        let mut cmd = skiff();
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--nbd", "127.0.0.1:0", "--workers", "2"]);
        cmd.args(["--flash", flash, "--flash-cache", "16M"]).args(extra);
        let mut child = cmd.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().expect("spawn skiff serve");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let (mut native, mut nbd, mut recovered) = (None, None, None);
        let deadline = Instant::now() + Duration::from_secs(30);
        while (native.is_none() || nbd.is_none()) && Instant::now() < deadline {
            let Some(Ok(line)) = lines.next() else { break };
            if line.contains("flash array recovered") {
                recovered = Some(line.clone());
            }
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
        Served { child, native, nbd, recovered }
    }

    /// How many write groups the array's recovery replayed past its checkpoint on this start.
    fn groups_replayed(&self) -> u64 {
        let line = self.recovered.as_deref().expect("skiff serve --flash logs \"flash array recovered\"");
        let at = line.find("groups_replayed=").expect("the recovery line counts groups_replayed");
        let digits = line[at + "groups_replayed=".len()..].split_whitespace().next().unwrap();
        digits.parse().unwrap_or_else(|_| panic!("groups_replayed is a number in: {line}"))
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

    /// SIGKILL, as a crash: no write-back, no checkpoint, nothing flushed on the way out.
    fn kill(mut self) {
        self.child.kill().unwrap();
        let status = self.child.wait().unwrap();
        assert_eq!(status.signal(), Some(SIGKILL), "skiff serve had exited before the kill: {status}");
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

// -------------------------------------------------------------------------------------------
// Crashes: the target killed with SIGKILL, with writes flushed, written with FUA, left
// unflushed and still in flight, then started again on the same devices.

/// A page of a flash volume: what a crash keeps or loses whole.
const PAGE: usize = 4096;

/// The bytes of the volume the flushed-writes test writes and checks, from offset 0.
const REGION_BYTES: usize = 16 << 20;

/// xorshift64*: the crash tests draw their writes from a seed, which their failures name.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `lo..hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo) as u64) as usize
    }

    /// A seed for `stamp`.
    fn seed(&mut self) -> u32 {
        (self.next() >> 32) as u32
    }
}

/// `len` bytes whose every 8-byte word differs from the words of any other seed and from
/// the other words of this one, so that a page from the wrong write or the wrong place shows.
fn stamp(seed: u32, len: usize) -> Vec<u8> {
    let mut out: Vec<u8> = (0..len.div_ceil(8) as u64)
        .flat_map(|word| ((u64::from(seed) << 32) | word).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes())
        .collect();
    out.truncate(len);
    out
}

/// libnbd's Python binding (run by `nbdsh`, which makes `h`) as a client the tests drive
/// over a pipe: `w OFFSET LEN fua|-` and then LEN bytes writes them, `f` flushes, and each
/// is answered `ok` once the target has replied. A client that does not ask for block sizes
/// may write any bytes at any offset.
const NBD_CLIENT: &str = r#"
import os, sys
h.set_strict_mode(0)
h.set_request_block_size(False)
h.connect_uri(os.environ["URI"])
assert h.can_fua() and h.can_flush(), "a flash volume offers FUA and FLUSH"
print("ready", flush=True)
requests = sys.stdin.buffer
while True:
    words = requests.readline().split()
    if not words:
        break
    if words[0] == b"w":
        data = requests.read(int(words[2]))
        h.pwrite(data, int(words[1]), nbd.CMD_FLAG_FUA if words[3] == b"fua" else 0)
    else:
        h.flush()
    print("ok", flush=True)
"#;

/// A running `NBD_CLIENT` on one export; killed when dropped.
struct NbdClient {
    child: Child,
    requests: ChildStdin,
    replies: Lines<BufReader<ChildStdout>>,
    stderr: Option<JoinHandle<String>>,
}

impl NbdClient {
    fn connect(s: &Served, export: &str) -> NbdClient {
        // The system's Python first: that is where python3-libnbd puts the module.
        let path = std::env::var("PATH").unwrap_or_default();
        let mut child = tool("nbdsh", LIBNBD_PYTHON)
            .env("PATH", format!("/usr/bin:/bin:{path}"))
            .env("URI", s.uri(export))
            .args(["-c", NBD_CLIENT])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nbdsh");
        let requests = child.stdin.take().unwrap();
        let replies = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut pipe = child.stderr.take().unwrap();
        let stderr = Some(std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        }));
        let mut client = NbdClient { child, requests, replies, stderr };
        if !client.answered("ready") {
            panic!("nbdsh did not connect to {export}: {}", client.stderr());
        }
        client
    }

    fn answered(&mut self, word: &str) -> bool {
        matches!(self.replies.next(), Some(Ok(line)) if line == word)
    }

    /// Send one request: true once the target acknowledged it, false if the client died
    /// first (as it does when the target is killed under it).
    fn request(&mut self, line: &str, payload: &[u8]) -> bool {
        let sent = self.requests.write_all(line.as_bytes()).and_then(|()| self.requests.write_all(payload));
        sent.is_ok() && self.answered("ok")
    }

    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> bool {
        let flag = if fua { "fua" } else { "-" };
        self.request(&format!("w {offset} {} {flag}\n", data.len()), data)
    }

    /// A write the target must acknowledge.
    fn write_acked(&mut self, offset: usize, data: &[u8], fua: bool) {
        if !self.write(offset as u64, data, fua) {
            panic!("write of {} bytes at {offset} not acknowledged: {}", data.len(), self.stderr());
        }
    }

    fn flush_acked(&mut self) {
        if !self.request("f\n", &[]) {
            panic!("FLUSH not acknowledged: {}", self.stderr());
        }
    }

    /// What the client said on stderr; it is stopped first.
    fn stderr(&mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stderr.take().map(|h| h.join().unwrap_or_default()).unwrap_or_default()
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `len` bytes of `export` from offset 0, read over the native protocol 1 MiB at a time.
fn read_region(s: &Served, export: &str, len: usize) -> Vec<u8> {
    let mut lane = Lane::connect(&s.endpoint(), export, &LaneConfig::default()).expect("a lane");
    let mut out = vec![0; len];
    for (i, chunk) in out.chunks_mut(1 << 20).enumerate() {
        lane.read_at(chunk, (i as u64) << 20).expect("read");
    }
    out
}

/// `got` is `want`; if not, the first page where they differ is named.
fn assert_same_pages(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len());
    let pages = got.chunks(PAGE).zip(want.chunks(PAGE));
    if let Some((p, (g, w))) = pages.enumerate().find(|(_, (g, w))| g != w) {
        let at = g.iter().zip(w).position(|(a, b)| a != b).unwrap();
        panic!(
            "{what}: page {p} differs first at byte {}: {:#04x}, not {:#04x}",
            p * PAGE + at,
            g[at],
            w[at]
        );
    }
}

/// How many write groups this start replayed past the checkpoint, as the log line and
/// `skiff vol stats` say (they must agree).
fn replayed(s: &Served) -> u64 {
    let logged = s.groups_replayed();
    let stats: serde_json::Value = serde_json::from_str(&vol_ok(s, &["stats", "--json"])).unwrap();
    assert_eq!(stats["recovered_groups_replayed"].as_u64(), Some(logged), "the log and vol stats differ");
    logged
}

/// What a volume must read as after a crash. `durable` holds every write acknowledged
/// before a FLUSH and every FUA write; a page in `maybe` was written since without FUA and
/// may read as its durable contents or as these, whole.
struct Model {
    durable: Vec<u8>,
    maybe: HashMap<usize, Vec<u8>>,
    /// Pages written since the last FLUSH: later writes keep off them, so that a page has
    /// one durable contents and at most one newer.
    taken: Vec<bool>,
}

impl Model {
    fn new(len: usize) -> Model {
        Model { durable: vec![0; len], maybe: HashMap::new(), taken: vec![false; len / PAGE] }
    }

    /// An offset for `len` bytes anywhere (page-aligned if `aligned`).
    fn place(rng: &mut Rng, len: usize, aligned: bool) -> usize {
        let end = REGION_BYTES - len + 1;
        if aligned {
            rng.range(0, end.div_ceil(PAGE)) * PAGE
        } else {
            rng.range(0, end)
        }
    }

    /// An offset for `len` bytes over pages no write took since the last FLUSH; they are
    /// taken.
    fn claim(&mut self, rng: &mut Rng, len: usize, aligned: bool) -> usize {
        for _ in 0..10_000 {
            let offset = Model::place(rng, len, aligned);
            let pages = offset / PAGE..(offset + len).div_ceil(PAGE);
            if pages.clone().all(|p| !self.taken[p]) {
                pages.for_each(|p| self.taken[p] = true);
                return offset;
            }
        }
        panic!("no room left for {len} bytes");
    }

    /// A write acknowledged with FUA, or before a FLUSH: it must survive.
    fn durable(&mut self, offset: usize, data: &[u8]) {
        self.durable[offset..offset + data.len()].copy_from_slice(data);
    }

    /// A write acknowledged without FUA after the last FLUSH: each page it touched may
    /// hold it, or not.
    fn volatile(&mut self, offset: usize, data: &[u8]) {
        for p in offset / PAGE..(offset + data.len()).div_ceil(PAGE) {
            let start = p * PAGE;
            let page = self.maybe.entry(p).or_insert_with(|| self.durable[start..start + PAGE].to_vec());
            let (from, to) = (offset.max(start), (offset + data.len()).min(start + PAGE));
            page[from - start..to - start].copy_from_slice(&data[from - offset..to - offset]);
        }
    }

    fn flushed(&mut self) {
        for (p, page) in self.maybe.drain() {
            self.durable[p * PAGE..(p + 1) * PAGE].copy_from_slice(&page);
        }
        self.taken.fill(false);
    }

    /// Check what the volume reads as after a crash; then that is what it holds. Returns how
    /// many unflushed pages survived.
    fn settle(&mut self, got: &[u8], seed: u64) -> usize {
        let mut newer = 0;
        for (p, page) in got.chunks(PAGE).enumerate() {
            let old = &self.durable[p * PAGE..(p + 1) * PAGE];
            if page == old {
                continue;
            }
            if self.maybe.get(&p).is_some_and(|new| new == page) {
                newer += 1;
                continue;
            }
            let at = page.iter().zip(old).position(|(a, b)| a != b).unwrap();
            let unflushed =
                if self.maybe.contains_key(&p) { "nor its unflushed write" } else { "(no unflushed write)" };
            panic!(
                "seed {seed:#x}: page {p} reads as neither its durable contents {unflushed}; first \
                 difference at byte {}: {:#04x}, durable {:#04x}",
                p * PAGE + at,
                page[at],
                old[at]
            );
        }
        self.durable.copy_from_slice(got);
        self.maybe.clear();
        self.taken.fill(false);
        newer
    }
}

/// A write length, and whether it is page-aligned: less than a page anywhere, one page, up
/// to `pages_max` whole pages, or several pages' worth anywhere.
fn shape(rng: &mut Rng, i: usize, pages_max: usize) -> (usize, bool) {
    match i % 4 {
        0 => (rng.range(1, PAGE), false),
        1 => (PAGE, true),
        2 => (rng.range(2, pages_max + 1) * PAGE, true),
        _ => (rng.range(PAGE + 1, pages_max * PAGE), false),
    }
}

/// Writes of every shape at any offset, some overlapping, then a FLUSH: all must survive.
fn flushed_batch(c: &mut NbdClient, m: &mut Model, rng: &mut Rng) {
    for i in 0..12 {
        let (len, aligned) = shape(rng, i, 64);
        let offset = Model::place(rng, len, aligned);
        let data = stamp(rng.seed(), len);
        c.write_acked(offset, &data, false);
        m.durable(offset, &data);
    }
    c.flush_acked();
    m.flushed();
}

/// Unflushed writes, FUA writes on other pages, then more unflushed writes, one of them
/// 4.5 MiB: more than the 16 MiB pool lets stay dirty, so part of it is written back.
fn fua_and_unflushed(c: &mut NbdClient, m: &mut Model, rng: &mut Rng) {
    let big = stamp(rng.seed(), 4608 << 10);
    let big_at = m.claim(rng, big.len(), false);
    let mut write = |c: &mut NbdClient, m: &mut Model, i: usize, fua: bool| {
        let (len, aligned) = shape(rng, i, 16);
        let offset = m.claim(rng, len, aligned);
        let data = stamp(rng.seed(), len);
        c.write_acked(offset, &data, fua);
        if fua {
            m.durable(offset, &data);
        } else {
            m.volatile(offset, &data);
        }
    };
    (0..4).for_each(|i| write(c, m, i, false));
    (0..6).for_each(|i| write(c, m, i, true));
    c.write_acked(big_at, &big, false);
    m.volatile(big_at, &big);
    (0..4).for_each(|i| write(c, m, i, false));
}

/// The volume and its snapshots are listed, the snapshots read-only, and each reads as it
/// did when taken.
fn assert_snapshots(s: &Served, snapshots: &[(String, Vec<u8>)]) {
    let listing = list(s);
    let mut want: Vec<String> = snapshots.iter().map(|(name, _)| name.clone()).collect();
    want.push("disk".into());
    want.sort();
    let mut got = names(&listing);
    got.sort();
    assert_eq!(got, want, "the volumes after a restart");
    for v in listing["volumes"].as_array().unwrap().iter().filter(|v| v["name"] != "disk") {
        assert_eq!((v["writable"].as_bool(), v["origin"].as_str()), (Some(false), Some("disk")), "{v}");
    }
    for (name, image) in snapshots {
        assert_same_pages(&read_region(s, name, REGION_BYTES), image, &format!("snapshot {name}"));
    }
}

/// A map budget of a few leaves: the volume and its snapshots have 32 each (shared until
/// written), so most are evicted once a checkpoint stores them, and read back from it.
const SMALL_MAP: [&str; 2] = ["--flash-map-budget", "24K"];

#[test]
fn acknowledged_flushed_and_fua_writes_survive_kill_9() {
    let (_dir, flash) = devices();
    ok(&["flash", "format", &flash, "--segment", "4M"]);
    let mut s = Served::start(&flash, &SMALL_MAP);
    vol_ok(&s, &["create", "disk", "--size", "64M"]);
    let mut model = Model::new(REGION_BYTES);
    let mut snapshots = Vec::new();
    // Each round crashes a target that itself started by recovering from a crash.
    for round in 0..3 {
        let seed = 0x5eed_0000 + round;
        let mut rng = Rng::new(seed);
        let mut c = NbdClient::connect(&s, "disk");
        flushed_batch(&mut c, &mut model, &mut rng);
        let snap = format!("snap{round}");
        vol_ok(&s, &["snapshot", "disk", &snap]);
        snapshots.push((snap, model.durable.clone()));
        fua_and_unflushed(&mut c, &mut model, &mut rng);
        let unflushed = model.maybe.len();
        // The FLUSHes and FUA writes were made durable by the array's sync thread, their
        // worker serving on meanwhile (docs/FLASH.md, "FUA and FLUSH without a blocked
        // worker"): the durability checked below is that path's.
        let stats: serde_json::Value = serde_json::from_str(&vol_ok(&s, &["stats", "--json"])).unwrap();
        assert!(stats["syncs_later"].as_u64() > Some(0), "no FLUSH or FUA went to the sync thread: {stats}");
        // The client is still connected when the target dies.
        s.kill();
        drop(c);

        // The rounds fill less than the checkpoint interval (an eighth of the array), so no
        // checkpoint covers the FUA writes: recovery finds them by replaying the log.
        s = Served::start(&flash, &SMALL_MAP);
        let groups = replayed(&s);
        assert!(
            groups > 0,
            "seed {seed:#x}: the FUA writes' groups lie past the checkpoint, and are replayed"
        );
        let newer = model.settle(&read_region(&s, "disk", REGION_BYTES), seed);
        assert_snapshots(&s, &snapshots);
        eprintln!(
            "seed {seed:#x}: {groups} groups replayed; {newer} of {unflushed} unflushed pages survived"
        );
    }

    // A clean stop writes everything back and checkpoints: nothing to replay, nothing lost.
    s.stop();
    let s = Served::start(&flash, &SMALL_MAP);
    assert_eq!(replayed(&s), 0, "a start after a clean stop replays nothing");
    assert_same_pages(&read_region(&s, "disk", REGION_BYTES), &model.durable, "disk after a clean restart");
    assert_snapshots(&s, &snapshots);
    let stats: serde_json::Value = serde_json::from_str(&vol_ok(&s, &["stats", "--json"])).unwrap();
    assert!(
        stats["map_loads"].as_u64() > Some(0)
            && stats["map_leaves_resident"].as_u64() < stats["map_leaves"].as_u64(),
        "the map budget did not bind: {stats}"
    );
    s.stop();
}

/// Writers of the in-flight test, each on its own NBD connection.
const WRITERS: usize = 3;

const SLOTS_PER_WRITER: usize = 12;

/// Bytes from the start of one slot to the next: room for the largest shape.
const SLOT_STRIDE: usize = 512 << 10;

/// Where the in-flight test writes: always the same bytes, so that each page of a slot holds
/// one whole write (or none).
#[derive(Clone, Copy, Debug)]
struct Slot {
    at: usize,
    len: usize,
}

impl Slot {
    /// Writer `w`'s slots, two of each shape: one page, four, a piece of one, three pages'
    /// worth across four, two bytes across a page boundary, and 64 pages.
    fn of_writer(w: usize) -> Vec<Slot> {
        const SHAPES: [(usize, usize); 6] =
            [(0, PAGE), (0, 4 * PAGE), (PAGE + 100, 1000), (2048, 3 * PAGE), (PAGE - 1, 2), (0, 64 * PAGE)];
        (0..SLOTS_PER_WRITER)
            .map(|i| {
                let (at, len) = SHAPES[i % SHAPES.len()];
                Slot { at: (w * SLOTS_PER_WRITER + i) * SLOT_STRIDE + at, len }
            })
            .collect()
    }

    fn start(&self) -> usize {
        self.at / PAGE * PAGE
    }

    /// The bytes of the pages the slot touches.
    fn span(&self) -> usize {
        (self.at + self.len).div_ceil(PAGE) * PAGE - self.start()
    }

    /// The slot's pages once the write of `seed` landed on them.
    fn image(&self, seed: u32) -> Vec<u8> {
        let mut pages = vec![0; self.span()];
        let at = self.at - self.start();
        pages[at..at + self.len].copy_from_slice(&stamp(seed, self.len));
        pages
    }
}

/// What a writer did before the target died under it.
struct WriterLog {
    /// Per slot, the seed of the last write acknowledged.
    acked: Vec<Option<u32>>,
    /// The write sent and not answered when the connection died: slot and seed.
    in_flight: Option<(usize, u32)>,
    stderr: String,
}

/// Writer `w`: FUA writes of fresh seeds to its slots, one after another, until the target
/// dies. `acks` counts the acknowledged ones.
fn spawn_writer(s: &Served, w: usize, cycle: u32, acks: Arc<AtomicU64>) -> JoinHandle<WriterLog> {
    let mut client = NbdClient::connect(s, "disk");
    std::thread::spawn(move || {
        let slots = Slot::of_writer(w);
        let mut rng = Rng::new(u64::from(cycle) << 8 | w as u64);
        let mut log = WriterLog { acked: vec![None; slots.len()], in_flight: None, stderr: String::new() };
        for n in 1..1 << 24 {
            let i = rng.range(0, slots.len());
            let seed = cycle << 28 | (w as u32) << 24 | n;
            log.in_flight = Some((i, seed));
            if !client.write(slots[i].at as u64, &stamp(seed, slots[i].len), true) {
                log.stderr = client.stderr();
                return log;
            }
            log.acked[i] = Some(seed);
            log.in_flight = None;
            acks.fetch_add(1, Ordering::Relaxed);
        }
        log
    })
}

/// Acknowledged writes each writer must have before the kill.
const KILL_AFTER_ACKS: u64 = 40;

#[test]
fn fua_writes_acknowledged_while_a_kill_9_lands_mid_stream_survive_it() {
    let (_dir, flash) = devices();
    ok(&["flash", "format", &flash, "--segment", "4M"]);
    let mut s = Served::start(&flash, &[]);
    vol_ok(&s, &["create", "disk", "--size", "64M"]);
    let slots: Vec<Vec<Slot>> = (0..WRITERS).map(Slot::of_writer).collect();
    let region = WRITERS * SLOTS_PER_WRITER * SLOT_STRIDE;
    // What the volume must read as: zeroes, then each slot as its last acknowledged write.
    let mut durable = vec![0; region];
    for cycle in 0..2 {
        let acks: Vec<Arc<AtomicU64>> = (0..WRITERS).map(|_| Arc::default()).collect();
        let writers: Vec<_> = (0..WRITERS).map(|w| spawn_writer(&s, w, cycle, acks[w].clone())).collect();
        let deadline = Instant::now() + Duration::from_secs(120);
        while acks.iter().any(|a| a.load(Ordering::Relaxed) < KILL_AFTER_ACKS) {
            assert!(!writers.iter().any(JoinHandle::is_finished), "a writer stopped before the kill");
            assert!(Instant::now() < deadline, "the writers are still short of {KILL_AFTER_ACKS} writes");
            std::thread::sleep(Duration::from_millis(5));
        }
        s.kill();
        let logs: Vec<WriterLog> = writers.into_iter().map(|h| h.join().unwrap()).collect();

        s = Served::start(&flash, &[]);
        assert_eq!(names(&list(&s)), ["disk"]);
        let got = read_region(&s, "disk", region);
        let mut landed = 0;
        for (w, log) in logs.iter().enumerate() {
            for (i, slot) in slots[w].iter().enumerate() {
                let span = slot.start()..slot.start() + slot.span();
                if let Some(seed) = log.acked[i] {
                    durable[span.clone()].copy_from_slice(&slot.image(seed));
                }
                let newer = log.in_flight.filter(|&(j, _)| j == i).map(|(_, seed)| slot.image(seed));
                for (p, page) in got[span.clone()].chunks(PAGE).enumerate() {
                    let old = &durable[span.start + p * PAGE..span.start + (p + 1) * PAGE];
                    let new = newer.as_ref().map(|n| &n[p * PAGE..(p + 1) * PAGE]);
                    landed += usize::from(page != old && new == Some(page));
                    assert!(
                        page == old || new == Some(page),
                        "cycle {cycle}, writer {w}, slot {i} {slot:?}, page {p}: neither the last acknowledged \
                         write ({:#x?}) nor the one in flight ({:#x?}); the writer said: {}",
                        log.acked[i],
                        log.in_flight,
                        log.stderr
                    );
                }
                durable[span.clone()].copy_from_slice(&got[span]);
            }
        }
        // Nothing else was written.
        assert_same_pages(&got, &durable, &format!("cycle {cycle}: the bytes around the slots"));
        let acked: u64 = acks.iter().map(|a| a.load(Ordering::Relaxed)).sum();
        let flying = logs.iter().filter(|l| l.in_flight.is_some()).count();
        eprintln!("cycle {cycle}: {acked} FUA writes acknowledged, {flying} in flight, {landed} pages of those landed");
    }
    s.stop();
    let s = Served::start(&flash, &[]);
    assert_same_pages(&read_region(&s, "disk", region), &durable, "disk after a clean restart");
    s.stop();
}

/// Direct writes under a volume's extent (FlashNet's extended data path, issue 29): a lane
/// whose first read earned the whole volume's reference writes through it, and each FUA one is
/// on flash before it completes, so every one acknowledged survives `kill -9`.
#[test]
fn direct_fua_writes_survive_kill_9() {
    use initiator::{Queue, ReqFlags};
    let (_dir, flash) = devices();
    ok(&["flash", "format", &flash, "--segment", "4M"]);
    let s = Served::start(&flash, &[]);
    vol_ok(&s, &["create", "disk", "--size", "16M"]);
    let config = LaneConfig { directory_entries: 16, ..LaneConfig::default() };
    let mut lane = Lane::connect(&s.endpoint(), "disk", &config).expect("a lane");
    let mut first = vec![0u8; PAGE];
    lane.read_at(&mut first, 0).unwrap();
    let block = |i: usize| -> Vec<u8> { (0..4 * PAGE).map(|b| (i * 31 + b / PAGE * 7 + b) as u8).collect() };
    let writes = 64;
    let mut done = Vec::new();
    for i in 0..writes {
        lane.submit_write((i * 4 * PAGE) as u64, block(i), ReqFlags::FUA, i as u64)
            .map_err(|r| r.error)
            .unwrap();
        if lane.in_flight() == 8 {
            lane.wait(1, &mut done).unwrap();
        }
    }
    while done.len() < writes {
        lane.wait(1, &mut done).unwrap();
    }
    assert!(done.iter().all(|c| c.status.is_ok()), "a FUA write failed");
    let stats = lane.stats();
    assert_eq!((stats.direct_writes, stats.direct_faults), (writes as u64, 0), "every write went direct");
    let array: serde_json::Value = serde_json::from_str(&vol_ok(&s, &["stats", "--json"])).unwrap();
    assert!(array["syncs_later"].as_u64() > Some(0), "no FUA went to the sync thread: {array}");
    // The lane is still connected when the target dies.
    s.kill();
    drop(lane);

    let s = Served::start(&flash, &[]);
    assert!(s.groups_replayed() > 0, "the FUA writes lie past the checkpoint: recovery replays them");
    let mut lane = Lane::connect(&s.endpoint(), "disk", &LaneConfig::default()).expect("a lane");
    for i in 0..writes {
        let mut back = vec![0u8; 4 * PAGE];
        lane.read_at(&mut back, (i * 4 * PAGE) as u64).unwrap();
        assert!(back == block(i), "acknowledged FUA direct write {i} was lost");
    }
    s.stop();
}
