//! `skiff attach` as a user runs it: the file appears, SIGTERM unmounts it and exits, a busy
//! mount point keeps being served until it is released, and the errors name the problem.
//!
//! Root, FUSE and loop devices are needed; under CI (`CI=true`) their absence fails these
//! tests, elsewhere they skip loudly. Every process, loop device and mount is cleaned up by a
//! guard, even when a test fails.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use skiff_tests::devices::{available, LoopDevice};

fn skiff() -> Command {
    Command::new(env!("CARGO_BIN_EXE_skiff"))
}

/// A child process, stopped on drop (SIGTERM, then SIGKILL), with its stderr collected.
struct Proc {
    child: Child,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
    /// A FUSE mount to take down if the process could not (it was killed).
    mount: Option<PathBuf>,
}

impl Proc {
    fn spawn(cmd: &mut Command) -> (Proc, std::io::Lines<BufReader<std::process::ChildStdout>>) {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn skiff");
        let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = stderr.clone();
        let pipe = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        (Proc { child, stderr, mount: None }, stdout)
    }

    fn signal(&self, sig: &str) {
        Command::new("kill").args([&format!("-{sig}"), &self.child.id().to_string()]).status().unwrap();
    }

    fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Wait until stderr holds `text`.
    fn wait_stderr(&self, text: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.stderr().contains(text) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            self.signal("TERM");
            if self.wait_exit(Duration::from_secs(5)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
        if let Some(m) = &self.mount {
            if is_mount_point(m) {
                let _ = Command::new("umount").arg("-l").arg(m).status();
            }
        }
    }
}

fn is_mount_point(path: &Path) -> bool {
    let Ok(canonical) = path.canonicalize() else { return false };
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    table.lines().filter_map(|l| l.split(' ').nth(4)).any(|m| Path::new(m) == canonical)
}

/// `skiff serve` with a RAM export on an ephemeral port; its address.
fn serve() -> (Proc, String) {
    let (p, _) = Proc::spawn(skiff().args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "1",
        "--export",
        "vol=ram:32M",
    ]));
    assert!(p.wait_stderr("listening ep=", Duration::from_secs(30)), "skiff serve: {}", p.stderr());
    let log = p.stderr();
    let i = log.find("listening ep=").unwrap() + "listening ep=".len();
    let addr = log[i..].split_whitespace().next().unwrap().to_owned();
    (p, addr)
}

/// `skiff attach` at `at`; returns once it printed the file's path.
fn attach(addr: &str, at: &Path) -> (Proc, PathBuf) {
    let (mut p, mut stdout) =
        Proc::spawn(skiff().args(["attach", "--target", addr, "--export", "vol", "--threads", "4"]).arg(at));
    p.mount = Some(at.to_owned());
    let line = stdout.next().and_then(Result::ok).unwrap_or_else(|| panic!("skiff attach: {}", p.stderr()));
    (p, PathBuf::from(line))
}

#[test]
fn sigterm_unmounts_and_exits_cleanly() {
    if !available("sigterm_unmounts_and_exits_cleanly") {
        return;
    }
    let (_server, addr) = serve();
    let dir = tempfile::tempdir().unwrap();
    let (mut att, file) = attach(&addr, dir.path());
    assert_eq!(file, dir.path().canonicalize().unwrap().join("vol"));
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&file).unwrap();
    f.write_all_at(b"through the file", 4096).unwrap();
    let mut back = [0; 16];
    f.read_exact_at(&mut back, 4096).unwrap();
    assert_eq!(&back, b"through the file");
    drop(f);
    att.signal("TERM");
    let status =
        att.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| panic!("still running: {}", att.stderr()));
    assert!(status.success(), "{status}: {}", att.stderr());
    assert!(!is_mount_point(dir.path()), "the mount outlived skiff attach");
}

#[test]
fn a_busy_mount_is_served_until_released() {
    if !available("a_busy_mount_is_served_until_released") {
        return;
    }
    let (_server, addr) = serve();
    let dir = tempfile::tempdir().unwrap();
    let (mut att, file) = attach(&addr, dir.path());
    let dev = LoopDevice::attach(&file);
    att.signal("TERM");
    assert!(att.wait_stderr("is busy", Duration::from_secs(10)), "{}", att.stderr());
    assert!(
        att.wait_exit(Duration::from_millis(500)).is_none(),
        "exited under a loop device: {}",
        att.stderr()
    );
    // Still served: the loop device reads and writes through it.
    let d = std::fs::OpenOptions::new().read(true).write(true).open(&dev.path).unwrap();
    d.write_all_at(&[0xa5; 4096], 8192).unwrap();
    d.sync_all().unwrap();
    let mut back = vec![0; 4096];
    d.read_exact_at(&mut back, 8192).unwrap();
    assert!(back.iter().all(|&b| b == 0xa5));
    drop(d);
    dev.detach();
    att.signal("INT");
    let status =
        att.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| panic!("still running: {}", att.stderr()));
    assert!(status.success(), "{status}: {}", att.stderr());
    assert!(!is_mount_point(dir.path()));
}

#[test]
fn errors_name_the_problem() {
    if !available("errors_name_the_problem") {
        return;
    }
    let (_server, addr) = serve();
    let dir = tempfile::tempdir().unwrap();
    let fails_with = |cmd: &mut Command, text: &str| {
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(text), "expected {text:?} in: {stderr}");
        assert!(!is_mount_point(dir.path()));
    };
    let attach_cmd = |export: &str| {
        let mut cmd = skiff();
        cmd.args(["attach", "--target", &addr, "--export", export]).arg(dir.path());
        cmd
    };
    fails_with(&mut attach_cmd("nope"), "has no export \"nope\" (it offers: \"vol\")");
    fails_with(
        skiff().args(["attach", "--target", "127.0.0.1:1", "--export", "vol"]).arg(dir.path()),
        "target 127.0.0.1:1: connection",
    );
    // No FUSE: a mount namespace where /dev is an empty tmpfs.
    let script = format!(
        "mount -t tmpfs none /dev && exec {} attach --target {addr} --export vol {}",
        env!("CARGO_BIN_EXE_skiff"),
        dir.path().display()
    );
    let mut no_fuse = Command::new("unshare");
    no_fuse.args(["--mount", "sh", "-c", &script]);
    fails_with(&mut no_fuse, "FUSE is not available: /dev/fuse does not exist: load the fuse module");

    // Busy: something is mounted there already.
    let (_att, _) = attach(&addr, dir.path());
    let out = attach_cmd("vol").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("is already a mount point"), "{stderr}");
}

/// `skiff serve` with one file export named `vol` on `addr` (a fixed address, so that a
/// restarted target is found where the old one was).
fn serve_file(addr: &str, path: &Path) -> Proc {
    let (p, _) = Proc::spawn(
        skiff()
            .args(["serve", "--listen", addr, "--workers", "1", "--export"])
            .arg(format!("vol=file:{}", path.display())),
    );
    assert!(p.wait_stderr("listening ep=", Duration::from_secs(30)), "skiff serve: {}", p.stderr());
    p
}

/// ext4 over a loop device over `skiff attach`, written while the target is killed with
/// SIGKILL and restarted twice: the file system never sees an error, fsck finds it clean, and
/// after yet another kill every file written and synced reads back byte for byte from the
/// target.
#[test]
fn ext4_over_attach_rides_through_kill_9_of_the_target() {
    use skiff_tests::devices::Mounted;
    use skiff_tests::files::{verify_tree, write_tree};
    if !available("ext4_over_attach_rides_through_kill_9_of_the_target") {
        return;
    }
    let image = tempfile::Builder::new().prefix("skiff-attach-kill-").tempfile_in("/var/tmp").unwrap();
    image.as_file().set_len(512 << 20).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut server = serve_file(&addr, image.path());
    let dir = tempfile::tempdir().unwrap();
    let (at, fs_dir) = (dir.path().join("attach"), dir.path().join("fs"));
    std::fs::create_dir_all(&at).unwrap();
    std::fs::create_dir_all(&fs_dir).unwrap();
    let (mut p, mut stdout) = Proc::spawn(
        skiff()
            .args(["attach", "--target", &addr, "--export", "vol", "--threads", "8"])
            .args(["--reconnect-delay", "100ms", "--ctrl-loss-timeout", "60s"])
            .arg(&at),
    );
    p.mount = Some(at.clone());
    let file = stdout.next().and_then(Result::ok).unwrap_or_else(|| panic!("skiff attach: {}", p.stderr()));
    let dev = LoopDevice::attach(Path::new(&file));
    run(Command::new("mkfs.ext4").args(["-q", "-F", &dev.path]));
    let mounted = Mounted::mount(&dev.path, &fs_dir);

    // Write trees of files, each synced, round after round, until the kills are over.
    let root = fs_dir.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = stop.clone();
    let writer = std::thread::spawn(move || {
        let mut rounds = Vec::new();
        // About 16 MiB a round; 20 rounds at most fit the 512 MiB volume.
        while rounds.len() < 2 || (rounds.len() < 20 && !stopped.load(std::sync::atomic::Ordering::Relaxed)) {
            let dir = root.join(format!("round{}", rounds.len()));
            let sums = write_tree(&dir);
            run(Command::new("sync").arg("-f").arg(&dir));
            rounds.push((dir, sums));
        }
        rounds
    });
    for _ in 0..2 {
        std::thread::sleep(Duration::from_millis(400));
        server.child.kill().unwrap(); // SIGKILL
        server.child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        server = serve_file(&addr, image.path());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = writer.join().expect("writing the trees failed while the target restarted");
    eprintln!("{} trees written and synced across two kills", rounds.len());
    mounted.unmount();
    dev.detach();
    // Acknowledged is durable: kill the target once more, then read everything from a fresh one.
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let _server = serve_file(&addr, image.path());
    let dev = LoopDevice::attach(Path::new(&file));
    run(Command::new("fsck.ext4").args(["-n", "-f", &dev.path]));
    let mounted = Mounted::mount(&dev.path, &fs_dir);
    for (dir, sums) in &rounds {
        verify_tree(dir, sums);
    }
    mounted.unmount();
    dev.detach();
    let log = p.stderr();
    assert!(log.contains("connection lost; reconnecting"), "the lanes never saw the target go: {log}");
    assert!(!log.contains("ERROR"), "{log}");
}

/// Run a command that must succeed.
fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
