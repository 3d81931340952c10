//! `skiff serve` as systemd runs it (contrib/skiff.service): a Unix datagram socket stands in
//! for the service manager and must hear `READY=1` only once the listeners accept
//! connections, then `STOPPING=1` on SIGTERM; and the settings come from a configuration file.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn skiff() -> Command {
    Command::new(env!("CARGO_BIN_EXE_skiff"))
}

/// A spawned `skiff serve`, killed if the test ends before it does.
struct Running {
    child: Child,
    log: std::path::PathBuf,
}

impl Running {
    /// Spawn `skiff serve ARGS` with `$NOTIFY_SOCKET` set and its log in `dir`.
    fn spawn(dir: &Path, notify_socket: &str, args: &[&str]) -> Running {
        let log = dir.join("skiff.log");
        let child = skiff()
            .arg("serve")
            .args(args)
            .env("NOTIFY_SOCKET", notify_socket)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn skiff serve");
        Running { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then the exit status.
    fn terminate(&mut self) -> std::process::ExitStatus {
        let status = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        assert!(status.success(), "kill -TERM");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "skiff serve ignored SIGTERM:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The next notification, within a minute.
fn notification(manager: &UnixDatagram, skiff: &Running) -> String {
    manager.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut buf = [0u8; 4096];
    match manager.recv(&mut buf) {
        Ok(n) => String::from_utf8(buf[..n].to_vec()).expect("UTF-8"),
        Err(e) => panic!("no notification ({e}); skiff's log:\n{}", skiff.log()),
    }
}

/// The addresses of a `READY=1` notification's `STATUS=listening on A, B` line.
fn listening(ready: &str) -> Vec<String> {
    let mut lines = ready.lines();
    assert_eq!(lines.next(), Some("READY=1"), "{ready}");
    let status = lines.find_map(|l| l.strip_prefix("STATUS=listening on ")).expect("a STATUS line");
    status.split(", ").map(str::to_owned).collect()
}

#[test]
fn ready_comes_once_every_listener_accepts_and_stopping_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("notify");
    let manager = UnixDatagram::bind(&socket).unwrap();
    let args =
        ["--listen", "127.0.0.1:0", "--nbd", "127.0.0.1:0", "--export", "vol=ram:1M", "--workers", "1"];
    let mut skiff_serve = Running::spawn(dir.path(), socket.to_str().unwrap(), &args);

    let ready = notification(&manager, &skiff_serve);
    let addrs = listening(&ready);
    assert_eq!(addrs.len(), 2, "{ready}");
    for addr in &addrs {
        TcpStream::connect(addr).unwrap_or_else(|e| panic!("{addr} refuses connections after READY=1: {e}"));
    }
    // Not only accepting: answering. The native listener is the first.
    let info = skiff().args(["info", &addrs[0]]).output().unwrap();
    assert!(info.status.success(), "skiff info: {}", String::from_utf8_lossy(&info.stderr));
    assert!(String::from_utf8_lossy(&info.stdout).contains("vol"));

    let status = skiff_serve.terminate();
    assert_eq!(notification(&manager, &skiff_serve), "STOPPING=1");
    assert!(status.success(), "{status}:\n{}", skiff_serve.log());
}

#[test]
fn an_abstract_notify_socket_is_reached() {
    let name = format!("skiff-service-test-{}", std::process::id());
    let manager = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let args = ["--listen", "127.0.0.1:0", "--export", "vol=null:1M", "--workers", "1"];
    let mut skiff_serve = Running::spawn(dir.path(), &format!("@{name}"), &args);
    let addrs = listening(&notification(&manager, &skiff_serve));
    TcpStream::connect(&addrs[0]).expect("accepting after READY=1");
    assert!(skiff_serve.terminate().success());
}

#[test]
fn settings_come_from_the_config_file_and_flags_override_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("skiff.toml");
    std::fs::write(
        &config,
        "listen = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\nworkers = 3\nexport = [\"vol=ram:1M\"]\n",
    )
    .unwrap();
    let socket = dir.path().join("notify");
    let manager = UnixDatagram::bind(&socket).unwrap();
    let args = ["--config", config.to_str().unwrap(), "--workers", "2"];
    let skiff_serve = Running::spawn(dir.path(), socket.to_str().unwrap(), &args);
    listening(&notification(&manager, &skiff_serve));

    let log = skiff_serve.log();
    let at =
        log.find("metrics at http://").unwrap_or_else(|| panic!("no metrics address in the log:\n{log}"));
    let addr = log[at + "metrics at http://".len()..].split('/').next().unwrap();
    let mut http = TcpStream::connect(addr).unwrap();
    http.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut reply = String::new();
    http.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200 OK"), "{reply}");
    assert!(reply.contains("\nskiff_workers 2\n"), "--workers overrides the file's 3:\n{reply}");
    assert!(reply.contains("skiff_export_size_bytes{export=\"vol\"} 1048576"), "{reply}");
}

#[test]
fn a_bad_config_file_names_the_line_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("skiff.toml");
    std::fs::write(&config, "export = [\"vol=ram:1M\"]\nidle-timeout = \"soon\"\n").unwrap();
    let out = skiff().args(["serve", "--config", config.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("skiff.toml:2:16: idle-timeout: bad duration \"soon\""), "{err}");
}

#[test]
fn the_shipped_unit_passes_systemd_analyze_verify() {
    // A missing tool fails loudly, as everywhere in the tests (scripts/test.sh installs it).
    let found = Command::new("sh")
        .args(["-c", "command -v systemd-analyze"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(found, "systemd-analyze is not installed: run scripts/test.sh, or apt-get install systemd");
    let unit =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../contrib/skiff.service")).unwrap();
    assert!(
        unit.contains("\nType=notify\n") && unit.contains("ExecStart=/usr/local/bin/skiff serve --config")
    );
    // verify also checks that ExecStart's binary exists: point it at the one under test.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("skiff.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/skiff", env!("CARGO_BIN_EXE_skiff"))).unwrap();
    let out = Command::new("systemd-analyze").args(["verify", "--man=no"]).arg(&path).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    // Unknown or misspelt directives are only warnings to systemd; here they are failures.
    assert!(out.status.success() && said.trim().is_empty(), "systemd-analyze verify: {}\n{said}", out.status);
}
