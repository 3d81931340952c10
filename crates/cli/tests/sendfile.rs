//! A file export with `send=sendfile` (issue 29, the thesis's "socket + sendfile", 5.4): `skiff
//! serve` runs under strace, `skiff bench --verify` writes and reads every block over TCP and
//! over a Unix socket, every byte reads back as written, and the trace shows the read data
//! leaving by `sendfile(2)` from the file's descriptor, not by a `pread` into a buffer.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn bench(target: &str, rw: &str) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_skiff"))
        .args(["bench", "--target", target, "--export", "f", "--rw", rw, "--bs", "16k", "--qd", "8"])
        .args(["--duration", "1s", "--verify", "--json"])
        .output()
        .expect("skiff bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "skiff bench {target}: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(&stdout).expect("bench JSON");
    assert_eq!((r["io_errors"].as_u64(), r["verify_errors"].as_u64()), (Some(0), Some(0)), "{r}");
    r
}

#[test]
fn a_sendfile_export_sends_read_data_with_sendfile_and_every_byte_reads_back() {
    let have_strace = Command::new("strace").arg("-V").output().map(|o| o.status.success()).unwrap_or(false);
    assert!(
        have_strace,
        "strace is not installed: run scripts/test.sh (it installs strace) or apt-get install strace"
    );
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let path = dir.path().join("f.img");
    std::fs::File::create(&path).unwrap().set_len(16 << 20).unwrap();
    let unix = dir.path().join("s.sock");
    let trace = dir.path().join("trace");
    let mut strace = skiff_tests::Traced(
        Command::new("strace")
            .args(["-f", "-qq", "-e", "trace=openat,sendfile,pread64", "-o"])
            .arg(&trace)
            .arg(env!("CARGO_BIN_EXE_skiff"))
            .args(["serve", "--listen", "127.0.0.1:0", "--workers", "1", "--unix"])
            .arg(&unix)
            .args(["--export", &format!("f=file:{},send=sendfile", path.display())])
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn strace"),
    );
    let mut lines = BufReader::new(strace.0.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("skiff serve exited early").unwrap();
        if let Some(i) = line.find("listening ep=") {
            let ep = line[i + 13..].split_whitespace().next().unwrap().to_owned();
            if !ep.starts_with("unix:") {
                break ep;
            }
        }
    };
    std::thread::spawn(move || for _ in lines.by_ref() {});

    let tcp = bench(&addr, "randrw");
    let over_unix = bench(&format!("unix:{}", unix.display()), "randread");
    assert!(tcp["ios"].as_u64().unwrap() > 100 && over_unix["ios"].as_u64().unwrap() > 100);

    strace.stop();

    let text = std::fs::read_to_string(&trace).unwrap();
    let calls: Vec<&str> =
        text.lines().map(|l| l.split_once(' ').map_or(l, |(_, c)| c.trim_start())).collect();
    let file_fds: Vec<i32> = calls
        .iter()
        .filter(|c| c.starts_with("openat(") && c.contains(&format!("\"{}\"", path.display())))
        .filter_map(|c| c.rsplit("= ").next()?.trim().parse().ok())
        .collect();
    assert!(!file_fds.is_empty(), "the file was never opened:\n{text}");
    // sendfile(out_fd, in_fd, ...): the second argument is the file's descriptor.
    let in_fd = |c: &str| c.split(['(', ',']).nth(2).and_then(|f| f.trim().parse::<i32>().ok());
    let sendfiles = calls
        .iter()
        .filter(|c| c.starts_with("sendfile(") && in_fd(c).is_some_and(|f| file_fds.contains(&f)));
    let preads = calls.iter().filter(|c| c.starts_with("pread64(")).count();
    let sent = sendfiles.count();
    eprintln!("{sent} sendfile calls from the file, {preads} preads, for the benches' reads");
    assert!(
        sent > 100,
        "read data did not leave by sendfile ({sent} calls):\n{}",
        &text[..text.len().min(4000)]
    );
    assert!(preads < sent, "{preads} preads against {sent} sendfiles");
}
