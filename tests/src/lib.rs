//! Helpers for skiff's loopback tests: start a target on an ephemeral port, and a raw peer
//! that speaks the wire format by hand, so tests can send what no well-behaved client would.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use server::{ExportConfig, Target, TargetConfig};
use transport::Endpoint;
use wire::control::{frame, Hello, HelloReply, Limits, OpenReply};
use wire::{FrameKind, Header, Request, HEADER_LEN};

/// A target on 127.0.0.1 with an ephemeral port and the given `NAME=SPEC` exports.
pub fn start_target(exports: &[&str], workers: usize) -> Target {
    start_target_with(exports, |c| c.workers = workers)
}

pub fn start_target_with(exports: &[&str], tweak: impl FnOnce(&mut TargetConfig)) -> Target {
    let mut config = TargetConfig {
        listen: vec![Endpoint::Tcp("127.0.0.1:0".into())],
        exports: exports.iter().map(|e| e.parse::<ExportConfig>().expect("valid export")).collect(),
        workers: 2,
        ..TargetConfig::default()
    };
    tweak(&mut config);
    Target::start(config).expect("target starts")
}

/// A process run under `strace` (`strace ... -o FILE PROGRAM ...`): [`stop`](Self::stop) ends
/// it cleanly so that the trace is complete; dropped without that (a test that failed half
/// way), it kills the traced process and strace, so that neither outlives the test.
pub struct Traced(pub std::process::Child);

impl Traced {
    /// The traced process: strace's first child.
    fn traced_pid(&self) -> Option<String> {
        let id = self.0.id();
        let children = std::fs::read_to_string(format!("/proc/{id}/task/{id}/children")).ok()?;
        children.split_whitespace().next().map(str::to_owned)
    }

    /// Stop the traced process with SIGTERM and wait up to 20 s for strace to exit.
    pub fn stop(&mut self) {
        let pid = self.traced_pid().expect("a process runs under strace");
        std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while self.0.try_wait().expect("strace's status").is_none() {
            assert!(std::time::Instant::now() < deadline, "the traced process did not stop");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            if let Some(pid) = self.traced_pid() {
                let _ = std::process::Command::new("kill").args(["-KILL", &pid]).status();
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// `n` distinct free loopback ports: each is held until all are chosen, so no two are the
/// same (another process may still take one before its user binds it).
pub fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a free port")).collect();
    held.iter().map(|l| l.local_addr().expect("a bound port").port()).collect()
}

pub fn tcp_endpoint(t: &Target) -> Endpoint {
    t.endpoints().iter().find(|e| matches!(e, Endpoint::Tcp(_))).expect("a TCP listener").clone()
}

/// A peer that writes raw bytes and reads raw frames.
pub struct RawPeer {
    pub stream: TcpStream,
}

impl RawPeer {
    pub fn connect(t: &Target) -> RawPeer {
        let Endpoint::Tcp(addr) = tcp_endpoint(t) else { unreachable!() };
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        RawPeer { stream }
    }

    /// Connect, say HELLO with `limits`, and open `export`; returns the handle.
    pub fn ready(t: &Target, limits: Limits, export: &str) -> (RawPeer, u32) {
        RawPeer::ready_with_features(t, limits, export, 0)
    }

    /// [`ready`](Self::ready), asking for HELLO feature bits `features`.
    pub fn ready_with_features(t: &Target, limits: Limits, export: &str, features: u64) -> (RawPeer, u32) {
        RawPeer::ready_on(RawPeer::connect(t), limits, export, features)
    }

    /// [`ready_with_features`](Self::ready_with_features) over a connection made already.
    pub fn ready_on(mut p: RawPeer, limits: Limits, export: &str, features: u64) -> (RawPeer, u32) {
        p.send(&frame(
            FrameKind::Hello,
            &Hello { version_min: 1, version_max: 1, features, limits, auth: None }.encode(),
        ));
        let (h, body) = p.recv().expect("hello reply");
        assert_eq!(h.kind, FrameKind::HelloReply);
        assert!(HelloReply::decode(&body).unwrap().status.is_ok());
        p.send(&frame(FrameKind::Open, &wire::Open { name: export.into() }.encode()));
        let (h, body) = p.recv().expect("open reply");
        assert_eq!(h.kind, FrameKind::OpenReply);
        let reply = OpenReply::decode(&body).unwrap();
        assert!(reply.status.is_ok(), "open {export}: {:?}", reply.status);
        (p, reply.handle)
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("send");
    }

    /// The next frame, or `None` at end of stream.
    pub fn recv(&mut self) -> Option<(Header, Vec<u8>)> {
        let mut head = [0u8; HEADER_LEN];
        if self.stream.read_exact(&mut head).is_err() {
            return None;
        }
        let h = Header::parse(&head).expect("target sends valid headers");
        let mut body = vec![0u8; h.body_len()];
        self.stream.read_exact(&mut body).expect("frame body");
        Some((h, body))
    }

    /// True when the target has closed the connection (after anything still queued).
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.stream.read(&mut b), Ok(0))
    }
}

/// A request caravan frame: descriptors as given, then `payload`.
pub fn caravan(reqs: &[Request], payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; HEADER_LEN + reqs.len() * wire::REQUEST_DESC_LEN];
    let payload_len: u32 = reqs.iter().map(|r| r.payload_len()).sum();
    Header { kind: FrameKind::Requests, desc_count: reqs.len() as u16, payload_len }.emit(&mut out);
    for (i, r) in reqs.iter().enumerate() {
        r.emit(&mut out[HEADER_LEN + i * wire::REQUEST_DESC_LEN..]);
    }
    out.extend_from_slice(payload);
    out
}

/// A target with an NBD listener on 127.0.0.1 (ephemeral port) besides the native one.
/// An NBD transmission request, encoded by hand from the NBD specification (magic, flags,
/// type, cookie, offset, length, then a WRITE's payload), so tests never check the NBD front
/// end against skiff's own codec.
pub fn nbd_request(cmd: u16, flags: u16, cookie: u64, offset: u64, len: u32, payload: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(28 + payload.len());
    r.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    r.extend_from_slice(&flags.to_be_bytes());
    r.extend_from_slice(&cmd.to_be_bytes());
    r.extend_from_slice(&cookie.to_be_bytes());
    r.extend_from_slice(&offset.to_be_bytes());
    r.extend_from_slice(&len.to_be_bytes());
    r.extend_from_slice(payload);
    r
}

/// A flash array on `files` sparse scratch files of `bytes` each in a new directory under
/// /var/tmp (4 MiB segments), for `TargetConfig::flash`; the directory goes when dropped.
pub fn flash_array(files: usize, bytes: u64) -> (tempfile::TempDir, Vec<std::path::PathBuf>) {
    let dir =
        tempfile::Builder::new().prefix("skiff-flash-").tempdir_in("/var/tmp").expect("a scratch directory");
    let mut paths = Vec::new();
    let mut devices: Vec<Box<dyn flash::device::Device>> = Vec::new();
    for i in 0..files {
        let path = dir.path().join(format!("dev{i}.img"));
        std::fs::File::create(&path).and_then(|f| f.set_len(bytes)).expect("a scratch file");
        devices.push(Box::new(flash::device::FileDevice::open(&path).expect("open a scratch file")));
        paths.push(path);
    }
    flash::engine::format(&devices, 1024, false).expect("format the scratch files");
    (dir, paths)
}

pub fn start_nbd_target(exports: &[&str]) -> (Target, String) {
    let t = start_target_with(exports, |c| c.nbd_listen = vec![Endpoint::Tcp("127.0.0.1:0".into())]);
    let Endpoint::Tcp(addr) = t.endpoints_of(server::Protocol::Nbd)[0].clone() else { unreachable!() };
    (t, addr)
}

/// Run an external tool; a tool that is not installed fails the test loudly, naming the
/// package (scripts/test.sh installs them all).
pub fn tool(name: &str, package: &str) -> std::process::Command {
    let found = std::process::Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(found, "{name} is not installed: run scripts/test.sh, or apt-get install {package}");
    std::process::Command::new(name)
}

/// [`run_ok`], but a command still running after `limit` is killed and fails the test: a
/// guard against a hang (a target that stalls), far above the time the command needs.
pub fn run_ok_within(cmd: &mut std::process::Command, limit: Duration) -> String {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("run tool");
    // Drain both pipes as the child writes, so that a chatty child never blocks on them.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut out = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut out);
            }
            String::from_utf8_lossy(&out).into_owned()
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for tool") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{:?} still running after {limit:?} (the target stalled?)\nstdout: {}\nstderr: {}",
                cmd.get_program(),
                stdout.join().unwrap_or_default(),
                stderr.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (stdout, stderr) = (stdout.join().unwrap_or_default(), stderr.join().unwrap_or_default());
    assert!(status.success(), "{cmd:?} failed: {status}\nstdout: {stdout}\nstderr: {stderr}");
    stdout
}

/// Run a prepared command, failing with its output unless it succeeds; returns stdout.
pub fn run_ok(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().expect("run tool");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Devices and mounts for the root-only tests (`skiff attach` under a loop device), each
/// undone by `Drop` even when a test fails, in the reverse order of their creation.
pub mod devices {
    use std::os::unix::fs::MetadataExt;
    use std::path::{Path, PathBuf};

    use super::{run_ok, tool};

    /// Whether this run may use root, FUSE and loop devices. A missing one fails the test
    /// under CI (`CI=true`: CI runs as root on a kernel with all three, so a missing one is a
    /// broken runner, never a reason to pass); elsewhere the test says loudly that it skips.
    pub fn available(test: &str) -> bool {
        let missing = if std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(u32::MAX) != 0 {
            Some("not running as root")
        } else if !Path::new("/dev/fuse").exists() {
            Some("/dev/fuse is missing (modprobe fuse)")
        } else if !Path::new("/dev/loop-control").exists() {
            Some("/dev/loop-control is missing (modprobe loop)")
        } else {
            None
        };
        let Some(why) = missing else { return true };
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test}: {why}; under CI this test must run (root, FUSE and loop devices)"
        );
        eprintln!("SKIPPED {test}: {why} (with CI=true this is a failure)");
        false
    }

    /// A loop device over a file, detached on drop.
    pub struct LoopDevice {
        pub path: String,
        attached: bool,
    }

    impl LoopDevice {
        /// `losetup --find --show --direct-io=on FILE`.
        pub fn attach(file: &Path) -> LoopDevice {
            let out = run_ok(tool("losetup", "mount").args(["--find", "--show", "--direct-io=on"]).arg(file));
            LoopDevice { path: out.trim().to_owned(), attached: true }
        }

        /// Whether the loop device really does direct I/O (losetup falls back to buffered I/O
        /// with only a warning when the backing file refuses it).
        pub fn direct_io(&self) -> bool {
            let name = self.path.trim_start_matches("/dev/");
            std::fs::read_to_string(format!("/sys/block/{name}/loop/dio"))
                .map(|s| s.trim() == "1")
                .unwrap_or(false)
        }

        /// `losetup -d`, which must succeed.
        pub fn detach(mut self) {
            self.attached = false;
            assert!(detach_loop(&self.path), "losetup -d {} failed", self.path);
        }
    }

    /// `losetup -d`, retried for a while: the kernel may hold the device a moment after an
    /// unmount.
    fn detach_loop(path: &str) -> bool {
        for _ in 0..50 {
            let ok = std::process::Command::new("losetup").arg("-d").arg(path).status();
            if ok.map(|s| s.success()).unwrap_or(false) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        false
    }

    impl Drop for LoopDevice {
        fn drop(&mut self) {
            if self.attached && !detach_loop(&self.path) {
                eprintln!("could not detach {}", self.path);
            }
        }
    }

    /// A file system mounted on a directory, unmounted on drop.
    pub struct Mounted {
        pub dir: PathBuf,
        mounted: bool,
    }

    impl Mounted {
        pub fn mount(device: &str, dir: &Path) -> Mounted {
            run_ok(tool("mount", "mount").arg(device).arg(dir));
            Mounted { dir: dir.to_owned(), mounted: true }
        }

        /// `umount`, which must succeed.
        pub fn unmount(mut self) {
            self.mounted = false;
            run_ok(std::process::Command::new("umount").arg(&self.dir));
        }
    }

    impl Drop for Mounted {
        fn drop(&mut self) {
            if !self.mounted {
                return;
            }
            let ok = std::process::Command::new("umount").arg(&self.dir).status();
            if !ok.map(|s| s.success()).unwrap_or(false) {
                // Never leave a mount behind a failed test.
                let _ = std::process::Command::new("umount").arg("-l").arg(&self.dir).status();
            }
        }
    }
}

/// A tree of files with known contents, for tests that put a file system on an export.
pub mod files {
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};

    /// Deterministic bytes for a file: its index seeds a xorshift generator.
    pub fn content(seed: u64, len: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// A tree of files of awkward sizes in nested directories: path → CRC32C of its bytes.
    pub fn write_tree(root: &Path) -> BTreeMap<PathBuf, (usize, u32)> {
        let sizes = [0, 1, 511, 512, 4095, 4096, 4097, 65_536, 100_003, 1 << 20, (3 << 20) + 7];
        let mut sums = BTreeMap::new();
        for (i, size) in sizes.iter().cycle().take(40).enumerate() {
            let dir = root.join(format!("d{}", i % 4)).join(format!("e{}", i % 3));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(format!("f{i}"));
            let bytes = content(i as u64 + 1, *size);
            std::fs::write(&path, &bytes).unwrap();
            sums.insert(path.strip_prefix(root).unwrap().to_owned(), (bytes.len(), crc32c::crc32c(&bytes)));
        }
        sums
    }

    /// Every file of the tree, read back: its length, checksum and every byte.
    pub fn verify_tree(root: &Path, sums: &BTreeMap<PathBuf, (usize, u32)>) {
        for (i, (rel, (len, sum))) in sums.iter().enumerate() {
            let bytes = std::fs::read(root.join(rel)).unwrap_or_else(|e| panic!("{}: {e}", rel.display()));
            assert_eq!(bytes.len(), *len, "{}", rel.display());
            assert_eq!(crc32c::crc32c(&bytes), *sum, "{}", rel.display());
            let index: u64 = rel.file_name().unwrap().to_str().unwrap()[1..].parse().unwrap();
            assert!(bytes == content(index + 1, *len), "{} (file {i}) differs", rel.display());
        }
    }
}

/// A [`attach::Reply`] for driving a volume without FUSE: the answer lands in an [`Inbox`]
/// that the test waits on. The inbox's data buffer is made once, so answering allocates
/// nothing after warm-up.
pub mod inbox {
    use std::sync::{Arc, Condvar, Mutex};

    /// What a request was answered with.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Answered {
        /// Read data, copied into the waiter's buffer.
        Data,
        Written(usize),
        Ok,
        Error(i32),
    }

    /// One request's answer; reusable once taken.
    pub struct Inbox {
        state: Mutex<(Option<Answered>, Vec<u8>)>,
        ready: Condvar,
    }

    impl Inbox {
        /// An inbox for answers of up to `data_bytes_max` bytes of read data.
        pub fn new(data_bytes_max: usize) -> Arc<Inbox> {
            Arc::new(Inbox {
                state: Mutex::new((None, Vec::with_capacity(data_bytes_max))),
                ready: Condvar::new(),
            })
        }

        /// A reply for the next request, into this inbox.
        pub fn reply(self: &Arc<Self>) -> ToInbox {
            ToInbox(self.clone())
        }

        /// Wait for the answer; read data is copied into `data` (cleared first).
        pub fn wait(&self, data: &mut Vec<u8>) -> Answered {
            let mut st = self.state.lock().unwrap();
            loop {
                if let Some(answered) = st.0.take() {
                    data.clear();
                    data.extend_from_slice(&st.1);
                    return answered;
                }
                st = self.ready.wait(st).unwrap();
            }
        }

        fn put(&self, answered: Answered, bytes: &[u8]) {
            let mut st = self.state.lock().unwrap();
            assert!(st.0.is_none(), "answered twice, or answered before the last answer was taken");
            st.1.clear();
            st.1.extend_from_slice(bytes);
            st.0 = Some(answered);
            self.ready.notify_all();
        }
    }

    pub struct ToInbox(Arc<Inbox>);

    impl attach::Reply for ToInbox {
        fn data(self, bytes: &[u8]) {
            self.0.put(Answered::Data, bytes)
        }

        fn written(self, bytes: usize) {
            self.0.put(Answered::Written(bytes), &[])
        }

        fn ok(self) {
            self.0.put(Answered::Ok, &[])
        }

        fn error(self, errno: i32) {
            self.0.put(Answered::Error(errno), &[])
        }
    }
}

/// Certificates for the TLS tests, made by the real `openssl` CLI in a directory laid out as
/// nbdkit and qemu expect: `ca-cert.pem`, `server-cert.pem` and `server-key.pem` for
/// `localhost` and 127.0.0.1, and `client-cert.pem` / `client-key.pem` (CN `alice`).
pub mod certs {
    use std::path::Path;

    fn openssl(dir: &Path, args: &[&str]) {
        let out =
            super::tool("openssl", "openssl").args(args).current_dir(dir).output().expect("run openssl");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }

    const EC: [&str; 5] = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];

    /// A CA and the server and client certificates it signs, in `dir`.
    pub fn make(dir: &Path) {
        let mut ca = vec!["req", "-x509"];
        ca.extend(EC);
        ca.extend([
            "-keyout",
            "ca-key.pem",
            "-out",
            "ca-cert.pem",
            "-days",
            "2",
            "-subj",
            "/CN=skiff test CA",
        ]);
        openssl(dir, &ca);
        sign(
            dir,
            "server",
            "localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        );
        sign(dir, "client", "alice", "extendedKeyUsage=clientAuth\n");
    }

    /// `etcd-cert.pem` and `etcd-key.pem` in `dir` (made by [`make`]), for `localhost` and
    /// 127.0.0.1, good for a server and a client both: etcd with `--client-cert-auth` dials
    /// its own gRPC gateway with its server certificate.
    pub fn etcd(dir: &Path) {
        sign(
            dir,
            "etcd",
            "localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
        );
    }

    /// A client certificate for `cn` signed by the CA of `ca_dir` (made by [`make`]), in `dir`
    /// with a copy of the CA's certificate: a client's certificate directory.
    pub fn client(ca_dir: &Path, dir: &Path, cn: &str) {
        for f in ["ca-cert.pem", "ca-key.pem"] {
            std::fs::copy(ca_dir.join(f), dir.join(f)).unwrap();
        }
        sign(dir, "client", cn, "extendedKeyUsage=clientAuth\n");
        std::fs::remove_file(dir.join("ca-key.pem")).unwrap();
    }

    /// `NAME-key.pem` and `NAME-cert.pem` for `cn`, signed by the CA in `dir`.
    fn sign(dir: &Path, name: &str, cn: &str, ext: &str) {
        let (key, csr, cert, extfile) = (
            format!("{name}-key.pem"),
            format!("{name}.csr"),
            format!("{name}-cert.pem"),
            format!("{name}.ext"),
        );
        std::fs::write(dir.join(&extfile), ext).unwrap();
        let mut req = vec!["req"];
        req.extend(EC);
        let subj = format!("/CN={cn}");
        req.extend(["-keyout", key.as_str(), "-out", csr.as_str(), "-subj", subj.as_str()]);
        openssl(dir, &req);
        let ca = ["-CA", "ca-cert.pem", "-CAkey", "ca-key.pem", "-CAcreateserial", "-days", "2"];
        let mut x509 =
            vec!["x509", "-req", "-in", csr.as_str(), "-out", cert.as_str(), "-extfile", extfile.as_str()];
        x509.extend(ca);
        openssl(dir, &x509);
    }
}

/// Network namespaces and veth pairs for the raw-Ethernet tests (root only).
pub mod netns {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::{run_ok, tool};

    /// Whether this run may make namespaces and veth pairs. As [`super::devices::available`]:
    /// under CI (`CI=true`, root) a missing feature fails the test; elsewhere it says loudly
    /// that it skips.
    pub fn available(test: &str) -> bool {
        use std::os::unix::fs::MetadataExt;
        let missing = if std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(u32::MAX) != 0 {
            Some("not running as root".to_owned())
        } else if !std::path::Path::new("/proc/self/ns/net").exists() {
            Some("this kernel has no network namespaces".to_owned())
        } else {
            match std::process::Command::new("ip").arg("-V").output() {
                Ok(o) if o.status.success() => None,
                _ => Some("the ip tool (iproute2) is missing".to_owned()),
            }
        };
        let Some(why) = missing else { return true };
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test}: {why}; under CI this test must run (root, network namespaces, veth)"
        );
        eprintln!("SKIPPED {test}: {why} (with CI=true this is a failure)");
        false
    }

    static NEXT: AtomicUsize = AtomicUsize::new(0);

    /// A veth pair: `host` stays in this namespace, `peer` lives in a namespace of its own
    /// (`ns`), both up with the MTU asked for. Dropping it deletes both (a failed test too).
    pub struct VethPair {
        pub ns: String,
        pub host: String,
        pub peer: String,
        /// The namespace was made for this pair (and goes with it).
        owns_ns: bool,
    }

    impl VethPair {
        pub fn new(mtu: u32) -> VethPair {
            VethPair::into_ns(mtu, None)
        }

        /// A second pair whose far end joins `other`'s namespace: two links between the same
        /// two namespaces (a bundle). `other`'s namespace must outlive it.
        pub fn beside(other: &VethPair, mtu: u32) -> VethPair {
            VethPair::into_ns(mtu, Some(&other.ns))
        }

        fn into_ns(mtu: u32, ns: Option<&str>) -> VethPair {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            // Interface names have 15 bytes at most.
            let tag = format!("{}{n}", std::process::id() % 100_000);
            let pair = VethPair {
                ns: ns.map_or_else(|| format!("skiff-t{tag}"), str::to_owned),
                host: format!("skh{tag}"),
                peer: format!("skp{tag}"),
                owns_ns: ns.is_none(),
            };
            if pair.owns_ns {
                run_ok(tool("ip", "iproute2").args(["netns", "add", &pair.ns]));
            }
            let mtu = mtu.to_string();
            let ip = |args: &[&str]| run_ok(tool("ip", "iproute2").args(args));
            ip(&[
                "link", "add", &pair.host, "mtu", &mtu, "type", "veth", "peer", "name", &pair.peer, "mtu",
                &mtu,
            ]);
            ip(&["link", "set", &pair.peer, "netns", &pair.ns]);
            ip(&["link", "set", &pair.host, "up"]);
            ip(&["-n", &pair.ns, "link", "set", &pair.peer, "up"]);
            ip(&["-n", &pair.ns, "link", "set", "lo", "up"]);
            pair
        }

        /// A target in the far end's namespace serving `exports` with `workers`, listening on
        /// raw Ethernet only; its endpoint (`eth:IFACE/MAC`) as seen from `near_iface`.
        pub fn target(
            &self,
            near_iface: &str,
            exports: &[&str],
            workers: usize,
        ) -> (super::Target, super::Endpoint) {
            self.target_with(near_iface, exports, workers, transport::EthOptions::default())
        }

        /// [`target`](Self::target) with `options` for the target's sessions and in the
        /// endpoint returned (`eth:IFACE/MAC,OPTIONS`).
        pub fn target_with(
            &self,
            near_iface: &str,
            exports: &[&str],
            workers: usize,
            options: transport::EthOptions,
        ) -> (super::Target, super::Endpoint) {
            let iface = self.peer.clone();
            let exports: Vec<String> = exports.iter().map(|e| e.to_string()).collect();
            let t = self.in_ns(move || {
                let exports: Vec<&str> = exports.iter().map(String::as_str).collect();
                super::start_target_with(&exports, |c| {
                    c.listen = vec![super::Endpoint::Eth { ifaces: vec![iface], mac: None, options }];
                    c.workers = workers;
                })
            });
            let Some(super::Endpoint::Eth { mac: Some(mac), .. }) = t.endpoints().into_iter().next() else {
                panic!("the target reports its Ethernet endpoint with its MAC")
            };
            (t, super::Endpoint::Eth { ifaces: vec![near_iface.to_owned()], mac: Some(mac), options })
        }

        /// Take the host end down or bring it back up (a link that fails mid-run).
        pub fn set_host_up(&self, up: bool) {
            run_ok(tool("ip", "iproute2").args(["link", "set", &self.host, if up { "up" } else { "down" }]));
        }

        /// Run `f` on a thread of its own inside the pair's namespace: sockets it opens stay
        /// in that namespace wherever they are used afterwards.
        pub fn in_ns<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
            let path = format!("/run/netns/{}", self.ns);
            std::thread::spawn(move || {
                rt::netns::enter(std::path::Path::new(&path)).unwrap_or_else(|e| panic!("{e}"));
                f()
            })
            .join()
            .expect("the thread in the namespace panicked")
        }
    }

    /// A bridge in this namespace joining the host ends of some veth pairs: one Ethernet
    /// segment for the namespaces at their far ends. Deleted on drop.
    pub struct Bridge {
        pub name: String,
    }

    impl Bridge {
        pub fn joining(pairs: &[&VethPair]) -> Bridge {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let bridge = Bridge { name: format!("skbr{}{n}", std::process::id() % 100_000) };
            let ip = |args: &[&str]| run_ok(tool("ip", "iproute2").args(args));
            ip(&["link", "add", &bridge.name, "mtu", "9000", "type", "bridge"]);
            for p in pairs {
                ip(&["link", "set", &p.host, "master", &bridge.name]);
            }
            ip(&["link", "set", &bridge.name, "up"]);
            bridge
        }
    }

    impl Drop for Bridge {
        fn drop(&mut self) {
            let _ = tool("ip", "iproute2").args(["link", "del", &self.name]).output();
        }
    }

    impl Drop for VethPair {
        fn drop(&mut self) {
            // Deleting one end deletes both; deleting the namespace would too.
            let _ = tool("ip", "iproute2").args(["link", "del", &self.host]).output();
            if self.owns_ns {
                let _ = tool("ip", "iproute2").args(["netns", "del", &self.ns]).output();
            }
        }
    }
}

/// A lane's round trip of data, checked: for tests that must prove every byte of many I/Os.
pub mod verify {
    use initiator::{Completion, Lane, Queue, ReqFlags, Status};

    /// The bytes written at `offset` in round `seed`: they differ by seed and by block.
    pub fn block(seed: u64, offset: u64, len: usize) -> Vec<u8> {
        (0..len).map(|i| (seed as usize * 131 + offset as usize / 512 * 7 + i) as u8).collect()
    }

    /// Write `bytes` from `base` in pieces of `bs` with up to `qd` in flight, read them back
    /// the same way, and check every byte.
    pub fn write_read(lane: &mut Lane, seed: u64, base: u64, bytes: u64, bs: usize, qd: usize) {
        let offsets: Vec<u64> = (0..bytes / bs as u64).map(|i| base + i * bs as u64).collect();
        let mut out: Vec<Completion> = Vec::new();
        for (n, &off) in offsets.iter().enumerate() {
            while lane.in_flight() >= qd {
                lane.wait(1, &mut out).unwrap();
            }
            lane.submit_write(off, block(seed, off, bs), ReqFlags::empty(), n as u64).unwrap();
        }
        lane.wait(usize::MAX, &mut out).unwrap();
        assert!(out.iter().all(|c| c.status == Status::Ok), "a write failed");
        out.clear();
        for (n, &off) in offsets.iter().enumerate() {
            while lane.in_flight() >= qd {
                lane.wait(1, &mut out).unwrap();
            }
            lane.submit_read(off, vec![0; bs], n as u64).unwrap();
        }
        lane.wait(usize::MAX, &mut out).unwrap();
        assert_eq!(out.len(), offsets.len());
        for c in out {
            assert_eq!(c.status, Status::Ok);
            let off = offsets[c.user_data as usize];
            assert!(c.buf.unwrap() == block(seed, off, bs), "seed {seed}: offset {off} read back wrong");
        }
    }
}

/// Real etcd processes (Debian's `etcd-server`) on loopback, for the control plane's tests:
/// one member or a cluster of several, each with a data directory of its own, killed and
/// removed on drop even when a test fails.
pub mod etcd {
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use std::path::PathBuf;

    /// How many times a cluster is started afresh, on new ports, when a member exits while it
    /// starts (most often because another process took one of its ports in between).
    const STARTS: usize = 3;

    /// The members of one etcd cluster.
    pub struct Cluster {
        members: Vec<Option<Child>>,
        /// How each member was started, to start it again.
        commands: Vec<Vec<std::ffi::OsString>>,
        client_urls: Vec<String>,
        /// Member `i`'s output, for the message when it exits.
        logs: Vec<PathBuf>,
        _dir: tempfile::TempDir,
    }

    impl Cluster {
        /// Start `n` members and wait until the cluster answers. A member that exits while
        /// the cluster starts (a port taken by another process between choosing and binding
        /// it) has the whole cluster started again on new ports; a cluster that never answers
        /// fails the test, with what etcd said.
        pub fn start(n: usize) -> Cluster {
            let _ = crate::tool("etcd", "etcd-server");
            for attempt in 1..=STARTS {
                let mut cluster = Cluster::spawn_all(n);
                match cluster.wait_ready() {
                    Ok(()) => return cluster,
                    Err(e) if attempt < STARTS => eprintln!("etcd: start {attempt} of {STARTS} failed: {e}"),
                    Err(e) => panic!("{e}"),
                }
            }
            unreachable!("the last start returns or panics")
        }

        fn spawn_all(n: usize) -> Cluster {
            let dir = tempfile::tempdir().expect("a directory for etcd's data");
            let ports = crate::free_ports(2 * n);
            let ports: Vec<(u16, u16)> = ports.chunks(2).map(|p| (p[0], p[1])).collect();
            let token = format!("skiff-test-{}-{}", std::process::id(), ports[0].0);
            let initial: Vec<String> = ports
                .iter()
                .enumerate()
                .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
                .collect();
            let mut members = Vec::new();
            let mut commands = Vec::new();
            let mut client_urls = Vec::new();
            let mut logs = Vec::new();
            for (i, (client, peer)) in ports.iter().enumerate() {
                let client_url = format!("http://127.0.0.1:{client}");
                let peer_url = format!("http://127.0.0.1:{peer}");
                let data = dir.path().join(format!("m{i}")).display().to_string();
                let args: Vec<std::ffi::OsString> = [
                    ["--name", &format!("m{i}")],
                    ["--data-dir", &data],
                    ["--listen-client-urls", &client_url],
                    ["--advertise-client-urls", &client_url],
                    ["--listen-peer-urls", &peer_url],
                    ["--initial-advertise-peer-urls", &peer_url],
                    ["--initial-cluster", &initial.join(",")],
                    ["--initial-cluster-state", "new"],
                    ["--initial-cluster-token", &token],
                    // Short elections: a test's cluster loses a member and must go on quickly.
                    ["--heartbeat-interval", "50"],
                    ["--election-timeout", "500"],
                ]
                .iter()
                .flatten()
                .map(std::ffi::OsString::from)
                .collect();
                let log = dir.path().join(format!("m{i}.log"));
                members.push(Some(spawn(&args, &log)));
                commands.push(args);
                client_urls.push(client_url);
                logs.push(log);
            }
            Cluster { members, commands, client_urls, logs, _dir: dir }
        }

        /// Every member's client URL.
        pub fn endpoints(&self) -> Vec<String> {
            self.client_urls.clone()
        }

        /// The members' client URLs joined by commas (the `--coordinator` form).
        pub fn url(&self) -> String {
            self.client_urls.join(",")
        }

        /// Kill member `i` (SIGKILL), as a crash would.
        pub fn kill(&mut self, i: usize) {
            if let Some(mut child) = self.members[i].take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }

        /// Start member `i` again over its data (after [`kill`](Self::kill)), and wait until
        /// the cluster answers.
        pub fn restart(&mut self, i: usize) {
            self.kill(i);
            self.members[i] = Some(spawn(&self.commands[i], &self.logs[i]));
            if let Err(e) = self.wait_ready() {
                panic!("{e}");
            }
        }

        /// Wait until every running member serves reads through the cluster (a quorum
        /// formed). Fails, with the end of its log, as soon as a member exits, or after a
        /// minute without an answer.
        fn wait_ready(&mut self) -> Result<(), String> {
            let start = Instant::now();
            for i in 0..self.client_urls.len() {
                let url = &self.client_urls[i];
                let etcd = coord::etcd::Etcd::new(std::slice::from_ref(url), Duration::from_secs(2));
                loop {
                    let e = match etcd.get(b"/skiff-test/ready") {
                        Ok(_) => break,
                        Err(e) => e,
                    };
                    let exited = self
                        .members
                        .iter_mut()
                        .enumerate()
                        .find_map(|(m, c)| Some((m, c.as_mut()?.try_wait().ok()??)));
                    if let Some((m, status)) = exited {
                        return Err(format!("etcd member {m} exited ({status}): {}", self.tail(m)));
                    }
                    if start.elapsed() > Duration::from_secs(60) {
                        return Err(format!(
                            "etcd member {i} at {url} never answered: {e}: {}",
                            self.tail(i)
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            Ok(())
        }

        /// The last lines member `i` wrote.
        fn tail(&self, i: usize) -> String {
            let log = std::fs::read_to_string(&self.logs[i]).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            lines[lines.len().saturating_sub(5)..].join("\n")
        }
    }

    /// An etcd member started with `args`, its output written to `log`.
    fn spawn(args: &[std::ffi::OsString], log: &std::path::Path) -> Child {
        let out = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("etcd's log");
        Command::new("etcd").args(args).stdout(Stdio::null()).stderr(out).spawn().expect("start etcd")
    }

    impl Drop for Cluster {
        fn drop(&mut self) {
            for i in 0..self.members.len() {
                self.kill(i);
            }
        }
    }
}

/// The control plane's records in etcd, read back whole and checked against each other
/// (docs/RSTORE.md, "Records at any size"): for the control-plane simulation and the tests
/// that kill a client mid-call.
pub mod records {
    use std::collections::{BTreeMap, BTreeSet};

    use coord::schema::{
        self, alloc_addr, group_index, slots, ALLOCS, EXTENT_CHUNKS, GROUPS, GROUP_STRIPES, MENDING,
        NAMESPACES, POOLS, POOL_EXTENTS,
    };
    use coord::{AllocRecord, Extent, NsHead, PoolHead, StripeGroup};
    use rstore::Coordinator;

    /// Largest record a run may leave in etcd.
    pub const RECORD_MAX: usize = 256 << 10;

    /// What the records hold.
    pub struct Records {
        /// Records, their bytes (keys and values), and the largest value.
        pub records: usize,
        pub bytes: usize,
        pub largest: usize,
        pub stripes_held: usize,
        pub namespaces: BTreeMap<String, NsHead>,
        /// Each namespace's allocations, by address.
        pub allocs: BTreeMap<String, BTreeMap<u64, AllocRecord>>,
        /// Chunks in use, over every pool.
        pub chunks_used: u64,
    }

    /// Read every record under `/skiff/` and check that they agree, failing the test where
    /// they do not:
    /// - no record is larger than [`RECORD_MAX`];
    /// - each namespace's reserve and allocations hold distinct slots, exactly those its stripe
    ///   groups fill, each stripe with `replicas` copies on distinct servers; a group not whole
    ///   is in the repair index; no record outlives its namespace; a namespace is marked
    ///   `deleting` only if `deleting_ok`;
    /// - each chunk is held by one stripe at most, and exactly the chunks held are in use in
    ///   their pools' extents; the pools' heads agree with their extents.
    pub fn check(c: &Coordinator, replicas: usize, deleting_ok: bool) -> Records {
        let all = c.etcd().prefix(b"/skiff/").expect("read every record");
        let largest = all.iter().map(|kv| kv.value.len()).max().unwrap_or(0);
        let bytes: usize = all.iter().map(|kv| kv.key.len() + kv.value.len()).sum();
        let under = |prefix: &'static str| all.iter().filter(move |kv| kv.key.starts_with(prefix.as_bytes()));
        let name_of = |key: &[u8], prefix: &str| -> String {
            let rest = &key[prefix.len()..];
            String::from_utf8_lossy(rest.split(|&b| b == b'/').next().unwrap()).into_owned()
        };
        let heads: BTreeMap<String, PoolHead> =
            under(POOLS).map(|kv| (name_of(&kv.key, POOLS), schema::decode(kv).unwrap())).collect();
        let mut extents: BTreeMap<(String, u64), Extent> = BTreeMap::new();
        for kv in under(POOL_EXTENTS) {
            extents.insert(
                (name_of(&kv.key, POOL_EXTENTS), group_index(&kv.key).unwrap()),
                schema::decode(kv).unwrap(),
            );
        }
        let namespaces: BTreeMap<String, NsHead> =
            under(NAMESPACES).map(|kv| (name_of(&kv.key, NAMESPACES), schema::decode(kv).unwrap())).collect();
        // A namespace's records under `prefix`, by the number its key ends in.
        fn by_ns<T: schema::Record>(
            kvs: impl Iterator<Item = coord::etcd::Kv>,
            prefix: &str,
            index: fn(&[u8]) -> Option<u64>,
            name_of: impl Fn(&[u8], &str) -> String,
        ) -> BTreeMap<String, BTreeMap<u64, T>> {
            let mut all: BTreeMap<String, BTreeMap<u64, T>> = BTreeMap::new();
            for kv in kvs {
                let record = schema::decode(&kv).unwrap();
                all.entry(name_of(&kv.key, prefix)).or_default().insert(index(&kv.key).unwrap(), record);
            }
            all
        }
        let allocs: BTreeMap<String, BTreeMap<u64, AllocRecord>> =
            by_ns(under(ALLOCS).cloned(), ALLOCS, alloc_addr, name_of);
        let groups: BTreeMap<String, BTreeMap<u64, StripeGroup>> =
            by_ns(under(GROUPS).cloned(), GROUPS, group_index, name_of);
        let mending: BTreeSet<(String, u64)> =
            under(MENDING).map(|kv| (name_of(&kv.key, MENDING), group_index(&kv.key).unwrap())).collect();

        assert!(largest <= RECORD_MAX, "a record of {largest} bytes");
        // Chunks held: each by one stripe at most, and the stripe's copies on distinct servers.
        let mut held: BTreeMap<(String, u64), (String, u64)> = BTreeMap::new();
        let mut stripes_held = 0;
        for (name, head) in &namespaces {
            assert!(deleting_ok || !head.deleting, "{name}: a delete was left half done");
            let mut owned: BTreeSet<u64> = slots(&head.reserved).collect();
            assert_eq!(owned.len() as u64, schema::run_len(&head.reserved), "{name}: reserved runs overlap");
            let records = allocs.get(name).cloned().unwrap_or_default();
            assert_eq!(records.len() as u64, head.allocs, "{name}: allocations counted");
            for (addr, a) in &records {
                for slot in slots(&a.runs) {
                    assert!(
                        owned.insert(slot),
                        "{name}: slot {slot} both reserved and in {addr:#x}, or in two"
                    );
                }
            }
            let empty = BTreeMap::new();
            let gs = groups.get(name).unwrap_or(&empty);
            let mut filled = BTreeSet::new();
            for (&g, group) in gs {
                if !group.whole() {
                    assert!(
                        mending.contains(&(name.clone(), g)),
                        "{name}: group {g} is not whole and not in the index"
                    );
                }
                for (i, stripe) in group.stripes.iter().enumerate().filter(|(_, s)| !s.is_empty()) {
                    let slot = g * GROUP_STRIPES + i as u64;
                    filled.insert(slot);
                    assert_eq!(stripe.len(), replicas, "{name}: slot {slot}: {stripe:?}");
                    let servers: BTreeSet<&str> = stripe.iter().map(|c| c.server.as_str()).collect();
                    assert_eq!(
                        servers.len(),
                        replicas,
                        "{name}: slot {slot}: copies share a server: {stripe:?}"
                    );
                    for copy in stripe {
                        let prev = held.insert((copy.server.clone(), copy.index), (name.clone(), slot));
                        assert!(
                            prev.is_none(),
                            "chunk {}/{} held by {name}/{slot} and {prev:?}",
                            copy.server,
                            copy.index
                        );
                    }
                    stripes_held += 1;
                }
            }
            assert_eq!(filled, owned, "{name}: the slots filled are exactly those reserved or allocated");
        }
        let orphans: Vec<&String> = (allocs.keys().chain(groups.keys()).chain(mending.iter().map(|m| &m.0)))
            .filter(|n| !namespaces.contains_key(*n))
            .collect();
        assert!(orphans.is_empty(), "records of namespaces that are gone: {orphans:?}");
        // Pools: their extents' used bits are exactly the chunks held, and the heads agree.
        for (id, head) in &heads {
            let (mut used, mut dirty) = (0, 0);
            for e in 0..head.chunks.div_ceil(EXTENT_CHUNKS) {
                let extent = extents.get(&(id.clone(), e)).cloned().unwrap_or_default();
                let mut free_here = false;
                for c in schema::extent_chunks(e, head.chunks) {
                    let i = c % EXTENT_CHUNKS;
                    let is_held = held.contains_key(&(id.clone(), c));
                    assert_eq!(
                        extent.used.get(i),
                        is_held,
                        "{id}/{c}: in use in its pool is held by a stripe"
                    );
                    assert!(!(extent.used.get(i) && extent.dirty.get(i)), "{id}/{c}: used and dirty");
                    used += u64::from(extent.used.get(i));
                    dirty += u64::from(extent.dirty.get(i));
                    free_here |= extent.is_free(c);
                }
                assert!(
                    !free_here || head.with_free.get(e),
                    "{id}: extent {e} has a free chunk its head does not show"
                );
                assert!(
                    extent.dirty.is_empty() || head.with_dirty.get(e),
                    "{id}: extent {e} has dirt its head does not show"
                );
            }
            assert_eq!(
                (head.dirty, head.free),
                (dirty, head.chunks - used - dirty),
                "{id}: the head's counts"
            );
        }
        assert!(held.keys().all(|(id, _)| heads.contains_key(id)), "a chunk of a server with no pool");
        Records {
            records: all.len(),
            bytes,
            largest,
            stripes_held,
            namespaces,
            allocs,
            chunks_used: held.len() as u64,
        }
    }
}

/// RStore segments for tests: an allocation resolved through the coordinator and mapped.
pub mod rstore {
    use initiator::LaneConfig;
    use rstore::{Coordinator, Segment, SegmentMap};

    /// The allocation at `addr` of namespace `ns`, resolved to the live copies of its chunks.
    pub fn segment_map(c: &Coordinator, ns: &str, addr: u64) -> SegmentMap {
        let r = c.lookup(ns, addr).expect("the allocation exists");
        rstore::segment_map(&r, &c.servers().expect("servers")).expect("every stripe has a live copy")
    }

    /// The same, mapped.
    pub fn segment(c: &Coordinator, ns: &str, addr: u64) -> Segment {
        Segment::map(segment_map(c, ns, addr), &LaneConfig::default()).expect("the segment maps")
    }
}

/// A child process killed (SIGKILL) and reaped when dropped, a failed test's too.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A memory server: `skiff serve --listen 127.0.0.1:0 --pool POOL --chunk 1M --coordinator URL`
/// and `extra` flags, run from the binary `skiff`, killed on drop.
pub fn memory_server(skiff: &str, url: &str, pool: &str, extra: &[&str]) -> KillOnDrop {
    KillOnDrop(
        std::process::Command::new(skiff)
            .args(["serve", "--listen", "127.0.0.1:0", "--pool", pool, "--chunk", "1M", "--coordinator", url])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("skiff serve --pool"),
    )
}
