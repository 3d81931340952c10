//! A file export through the target: data lands in the file, FLUSH issues fdatasync and FUA
//! writes go through the O_DSYNC path before their completion is sent.

use std::os::unix::fs::FileExt;

use initiator::{Lane, LaneConfig, Queue, ReqFlags, Status};
use skiff_tests::{start_target, tcp_endpoint};

#[test]
fn flush_and_fua_reach_the_file() {
    // /var/tmp rather than /tmp: /tmp may be tmpfs, which is not a real file system for this.
    let file = tempfile::Builder::new().prefix("skiff-file-").tempfile_in("/var/tmp").unwrap();
    file.as_file().set_len(16 << 20).unwrap();
    let spec = format!("disk=file:{}", file.path().display());
    let t = start_target(&[spec.as_str()], 1);
    let mut lane = Lane::connect(&tcp_endpoint(&t), "disk", &LaneConfig::default()).unwrap();
    assert_eq!(lane.export().size_bytes, 16 << 20);
    let counters = |t: &server::Target| {
        let s = t.stats();
        (s.get("backend_syncs").unwrap(), s.get("backend_dsync_writes").unwrap())
    };
    let (syncs0, dsync0) = counters(&t);

    let mut out = Vec::new();
    lane.submit_write(0, vec![0xA5; 4096], ReqFlags::empty(), 1).unwrap();
    lane.wait(1, &mut out).unwrap();
    assert_eq!(counters(&t), (syncs0, dsync0), "a plain write neither syncs nor uses O_DSYNC");

    lane.submit_write(4096, vec![0x5A; 4096], ReqFlags::FUA, 2).unwrap();
    lane.wait(1, &mut out).unwrap();
    assert_eq!(counters(&t), (syncs0, dsync0 + 1), "FUA goes through the O_DSYNC path");

    lane.flush().unwrap();
    assert_eq!(counters(&t), (syncs0 + 1, dsync0 + 1), "FLUSH is one fdatasync");
    assert!(out.iter().all(|c| c.status == Status::Ok));

    // The bytes are in the file itself, seen through an independent descriptor.
    let mut back = vec![0; 8192];
    std::fs::File::open(file.path()).unwrap().read_exact_at(&mut back, 0).unwrap();
    assert!(back[..4096].iter().all(|&b| b == 0xA5));
    assert!(back[4096..].iter().all(|&b| b == 0x5A));

    // Unaligned-to-4K but block-aligned I/O takes the buffered path and is still correct.
    lane.write_at(&[0x77; 512], 512 * 3).unwrap();
    let mut small = vec![0; 512];
    lane.read_at(&mut small, 512 * 3).unwrap();
    assert_eq!(small, vec![0x77; 512]);
}

#[test]
fn read_only_file_export_refuses_writes() {
    let file = tempfile::Builder::new().prefix("skiff-ro-").tempfile_in("/var/tmp").unwrap();
    file.as_file().set_len(1 << 20).unwrap();
    let spec = format!("disk=file:{},ro", file.path().display());
    let t = start_target(&[spec.as_str()], 1);
    let mut lane = Lane::connect(&tcp_endpoint(&t), "disk", &LaneConfig::default()).unwrap();
    assert!(lane.export().flags.has(wire::ExportFlags::READ_ONLY));
    let err = lane.write_at(&[1; 512], 0).unwrap_err();
    assert!(matches!(err, initiator::Error::Status(Status::ReadOnly)), "{err}");
    let mut back = [9u8; 512];
    lane.read_at(&mut back, 0).unwrap();
    assert_eq!(back, [0; 512]);
}
