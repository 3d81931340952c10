//! Durability seen from outside the process: `skiff serve` on a file export runs under strace,
//! and the trace must show a FUA write issued on a descriptor opened with O_DSYNC and a FLUSH
//! issued as fdatasync on the file, each before the client saw its completion.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use initiator::{Endpoint, Lane, LaneConfig, Queue, ReqFlags, Status};

#[test]
fn fua_uses_o_dsync_and_flush_is_fdatasync() {
    let have_strace = Command::new("strace").arg("-V").output().map(|o| o.status.success()).unwrap_or(false);
    assert!(
        have_strace,
        "strace is not installed: run scripts/test.sh (it installs strace) or apt-get install strace"
    );

    let file = tempfile::Builder::new().prefix("skiff-durable-").tempfile_in("/var/tmp").unwrap();
    file.as_file().set_len(8 << 20).unwrap();
    let path = file.path().to_str().unwrap().to_owned();
    let trace = tempfile::NamedTempFile::new().unwrap();

    let mut strace = skiff_tests::Traced(
        Command::new("strace")
            .args(["-f", "-qq", "-e", "trace=openat,pwrite64,pwritev,pwritev2,fdatasync,fsync", "-o"])
            .arg(trace.path())
            .arg(env!("CARGO_BIN_EXE_skiff"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--workers",
                "1",
                "--export",
                &format!("disk=file:{path}"),
            ])
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn strace"),
    );
    let mut lines = BufReader::new(strace.0.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("skiff serve exited early").unwrap();
        if let Some(i) = line.find("listening ep=") {
            break line[i + 13..].split_whitespace().next().unwrap().to_owned();
        }
    };
    std::thread::spawn(move || for _ in lines.by_ref() {});

    let mut lane = Lane::connect(&Endpoint::parse(&addr).unwrap(), "disk", &LaneConfig::default()).unwrap();
    let mut out = Vec::new();
    lane.submit_write(0, vec![1; 4096], ReqFlags::empty(), 1).unwrap();
    lane.wait(1, &mut out).unwrap();
    lane.submit_write(8192, vec![2; 4096], ReqFlags::FUA, 2).unwrap();
    lane.wait(1, &mut out).unwrap();
    lane.flush().unwrap();
    assert!(out.iter().all(|c| c.status == Status::Ok));
    drop(lane);

    // Stop skiff (strace's child) cleanly so the trace is complete.
    strace.stop();

    let text = std::fs::read_to_string(trace.path()).unwrap();
    let calls: Vec<&str> =
        text.lines().map(|l| l.split_once(' ').map_or(l, |(_, c)| c.trim_start())).collect();
    // Descriptors of our file, and which of them were opened with O_DSYNC.
    let mut file_fds = Vec::new();
    let mut dsync_fds = Vec::new();
    for c in &calls {
        if c.starts_with("openat(") && c.contains(&format!("\"{path}\"")) {
            let fd: i32 = c.rsplit("= ").next().unwrap().trim().parse().unwrap_or(-1);
            if fd >= 0 {
                file_fds.push(fd);
                if c.contains("O_DSYNC") {
                    dsync_fds.push(fd);
                }
            }
        }
    }
    assert!(!dsync_fds.is_empty(), "no O_DSYNC descriptor was opened:\n{text}");
    // The first argument of a call: `pwrite64(6, ...` or `fdatasync(3) = 0`.
    let fd_of = |c: &str| c.split(['(', ',', ')']).nth(1).and_then(|f| f.trim().parse::<i32>().ok());
    let write_at = |offset: &str| {
        calls
            .iter()
            .position(|c| c.starts_with("pwrite64(") && c.contains(&format!(", 4096, {offset}) = 4096")))
    };
    let plain = write_at("0").unwrap_or_else(|| panic!("no pwrite64 at offset 0:\n{text}"));
    let fua = write_at("8192").unwrap_or_else(|| panic!("no pwrite64 at offset 8192:\n{text}"));
    assert!(!dsync_fds.contains(&fd_of(calls[plain]).unwrap()), "a plain write must not pay for O_DSYNC");
    assert!(
        dsync_fds.contains(&fd_of(calls[fua]).unwrap()),
        "the FUA write must go through O_DSYNC: {}",
        calls[fua]
    );
    let sync = calls
        .iter()
        .position(|c| c.starts_with("fdatasync(") && file_fds.contains(&fd_of(c).unwrap_or(-1)))
        .unwrap_or_else(|| panic!("FLUSH issued no fdatasync on the file:\n{text}"));
    assert!(sync > fua, "fdatasync comes after the writes it makes durable");
}
