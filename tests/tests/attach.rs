//! `skiff attach` as a disk: an export attached through FUSE, a loop device with direct I/O
//! over its file, ext4 on that, files written and read back across a detach and a new
//! attachment. Also the file's own semantics (unaligned I/O, holes, a fixed size) and the
//! errors a user meets.
//!
//! These tests need root, `/dev/fuse` and loop devices. Under CI (`CI=true`) a missing one
//! fails them; elsewhere they say that they skip (`skiff_tests::devices::available`). Every
//! mount, loop device and FUSE mount they make is undone by a guard's `Drop`, in reverse order,
//! even when an assertion fails.

use std::os::unix::fs::FileExt;
use std::path::Path;

use attach::{AttachConfig, Attachment, Error};
use initiator::{Lane, LaneConfig};
use skiff_tests::devices::{available, LoopDevice, Mounted};
use skiff_tests::files::{content, verify_tree, write_tree};
use skiff_tests::{run_ok, start_target, tcp_endpoint, tool};

const E2FS: &str = "e2fsprogs";

/// CRC32C of the whole file, read in 1 MiB pieces.
fn checksum_file(path: &Path) -> u32 {
    let f = std::fs::File::open(path).unwrap();
    let mut buf = vec![0; 1 << 20];
    let mut crc = 0;
    let mut off = 0;
    loop {
        let n = f.read_at(&mut buf, off).unwrap();
        if n == 0 {
            return crc;
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        off += n as u64;
    }
}

/// Unmount once nothing uses the file. Tests run in parallel, and a process another test is
/// spawning holds a copy of every descriptor between its fork and its exec, so a mount may be
/// busy for a moment after its last user here closed it: retry a refusal for a few seconds.
fn unmount(attachment: Attachment) -> initiator::LaneStats {
    for _ in 0..100 {
        match attachment.unmounter().unmount() {
            Ok(()) => break,
            Err(Error::InUse(_)) => std::thread::sleep(std::time::Duration::from_millis(50)),
            Err(e) => panic!("unmount: {e}"),
        }
    }
    attachment.unmount().expect("unmount once nothing uses it")
}

fn attach(t: &server::Target, export: &str, at: &Path) -> Attachment {
    let config = AttachConfig { threads: 8, ..AttachConfig::new(tcp_endpoint(t), export, at) };
    Attachment::mount(&config).unwrap_or_else(|e| panic!("attach {export} at {}: {e}", at.display()))
}

#[test]
fn ext4_on_a_loop_device_keeps_every_byte_across_attachments() {
    if !available("ext4_on_a_loop_device_keeps_every_byte_across_attachments") {
        return;
    }
    let t = start_target(&["vol=ram:128M"], 2);
    let dir = tempfile::tempdir().unwrap();
    let (at, fs_dir) = (dir.path().join("attach"), dir.path().join("fs"));
    std::fs::create_dir_all(&at).unwrap();
    std::fs::create_dir_all(&fs_dir).unwrap();

    let attachment = attach(&t, "vol", &at);
    assert_eq!(attachment.file(), at.canonicalize().unwrap().join("vol"));
    assert_eq!(std::fs::metadata(attachment.file()).unwrap().len(), 128 << 20);
    let dev = LoopDevice::attach(&attachment.file());
    assert!(dev.direct_io(), "{} does not do direct I/O over the FUSE file", dev.path);
    run_ok(tool("mkfs.ext4", E2FS).args(["-q", "-F", &dev.path]));
    let mounted = Mounted::mount(&dev.path, &fs_dir);
    let sums = write_tree(&fs_dir);
    verify_tree(&fs_dir, &sums);
    mounted.unmount();
    dev.detach();
    let whole = checksum_file(&attachment.file());
    let stats = unmount(attachment);
    assert!(stats.completed > 0 && stats.caravans_sent > 0, "{stats:?}");
    assert!(std::fs::read_dir(&at).unwrap().next().is_none(), "the FUSE mount is gone");

    // A new attachment: the same bytes, the same file system, every file intact.
    let attachment = attach(&t, "vol", &at);
    assert_eq!(checksum_file(&attachment.file()), whole, "the export's bytes changed across attachments");
    let dev = LoopDevice::attach(&attachment.file());
    run_ok(tool("fsck.ext4", E2FS).args(["-n", "-f", &dev.path]));
    let mounted = Mounted::mount(&dev.path, &fs_dir);
    verify_tree(&fs_dir, &sums);
    mounted.unmount();
    dev.detach();
    unmount(attachment);
}

#[test]
fn the_file_takes_unaligned_io_holes_and_keeps_its_size() {
    if !available("the_file_takes_unaligned_io_holes_and_keeps_its_size") {
        return;
    }
    let t = start_target(&["vol=ram:4M"], 1);
    let dir = tempfile::tempdir().unwrap();
    // Mounted over a regular file: the path itself is the export.
    let file = dir.path().join("disk");
    std::fs::write(&file, b"").unwrap();
    let attachment = attach(&t, "vol", &file);
    assert_eq!(attachment.file(), file.canonicalize().unwrap());
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&file).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 4 << 20);

    let mut shadow = vec![0u8; 4 << 20];
    let writes: [(u64, usize); 6] =
        [(0, 4096), (1, 1), (4095, 2), (700, 9000), ((1 << 20) - 3, (1 << 20) + 10), (8191, 1)];
    for (i, (off, len)) in writes.into_iter().enumerate() {
        let bytes = content(100 + i as u64, len);
        f.write_all_at(&bytes, off).unwrap();
        shadow[off as usize..off as usize + len].copy_from_slice(&bytes);
    }
    for (off, len) in [(0u64, 4 << 20), (3, 5), (4090, 20), ((1 << 20) - 7, 70_000)] {
        let mut back = vec![0; len];
        f.read_exact_at(&mut back, off).unwrap();
        assert!(back == shadow[off as usize..off as usize + len], "read {len} at {off}");
    }
    // What the file shows is what the target holds.
    let mut lane = Lane::connect(&tcp_endpoint(&t), "vol", &LaneConfig::default()).unwrap();
    let mut target_bytes = vec![0; 4 << 20];
    for (i, piece) in target_bytes.chunks_mut(1 << 20).enumerate() {
        lane.read_at(piece, (i as u64) << 20).unwrap();
    }
    assert!(target_bytes == shadow, "the target holds other bytes than were written");

    // A hole, aligned and not, reads back as zeroes; zero-range too.
    for (off, len, mode) in [(4096u64, 8192u64, "-p"), (701, 50, "-p"), (9000, 3000, "-z")] {
        run_ok(
            tool("fallocate", "util-linux")
                .args([mode, "-o", &off.to_string(), "-l", &len.to_string()])
                .arg(&file),
        );
        shadow[off as usize..(off + len) as usize].fill(0);
    }
    let mut back = vec![0; 64 << 10];
    f.read_exact_at(&mut back, 0).unwrap();
    assert!(back == shadow[..64 << 10], "holes read back as zeroes, the rest unchanged");

    // The size is the export's: no truncating, no writing past the end, reads stop at it.
    let err = f.set_len(1 << 20).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    let err = f.write_at(b"x", 4 << 20).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    assert_eq!(f.write_at(&[7; 100], (4 << 20) - 10).unwrap(), 10, "a write across the end is cut short");
    assert_eq!(f.read_at(&mut [0; 100], (4 << 20) - 4).unwrap(), 4);
    assert_eq!(f.read_at(&mut [0; 100], 4 << 20).unwrap(), 0);
    f.sync_all().unwrap();
    assert_eq!(f.metadata().unwrap().len(), 4 << 20);
    drop(f);
    unmount(attachment);
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 0, "the file under the mount is back");
}

#[test]
fn a_read_only_export_refuses_writers() {
    if !available("a_read_only_export_refuses_writers") {
        return;
    }
    let t = start_target(&["golden=ram:1M,ro"], 1);
    let dir = tempfile::tempdir().unwrap();
    let attachment = attach(&t, "golden", dir.path());
    let meta = std::fs::metadata(attachment.file()).unwrap();
    assert!(
        meta.permissions().readonly(),
        "mode {:o}",
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions())
    );
    let err = std::fs::OpenOptions::new().write(true).open(attachment.file()).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    assert_eq!(std::fs::read(attachment.file()).unwrap(), vec![0; 1 << 20]);
    unmount(attachment);
}

#[test]
fn errors_say_what_is_wrong() {
    if !available("errors_say_what_is_wrong") {
        return;
    }
    let t = start_target(&["vol=ram:8M", "other=ram:1M"], 1);
    let dir = tempfile::tempdir().unwrap();
    let at = dir.path().join("at");
    std::fs::create_dir(&at).unwrap();

    match Attachment::mount(&AttachConfig::new(tcp_endpoint(&t), "nope", &at)) {
        Err(e @ Error::NoSuchExport { .. }) => {
            let text = e.to_string();
            assert!(text.contains("\"nope\"") && text.contains("\"vol\", \"other\""), "{text}");
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("attached an export that does not exist"),
    }
    let missing = dir.path().join("missing");
    match Attachment::mount(&AttachConfig::new(tcp_endpoint(&t), "vol", &missing)) {
        Err(e @ Error::MountPoint { .. }) => assert!(e.to_string().contains("No such file"), "{e}"),
        other => panic!("{:?}", other.err()),
    }

    let attachment = attach(&t, "vol", &at);
    // The same place again: refused, and the first mount is untouched.
    match Attachment::mount(&AttachConfig::new(tcp_endpoint(&t), "other", &at)) {
        Err(e @ Error::AlreadyMounted(_)) => assert!(e.to_string().contains("already a mount point"), "{e}"),
        other => panic!("{:?}", other.err()),
    }
    assert_eq!(std::fs::metadata(attachment.file()).unwrap().len(), 8 << 20);

    // Busy: a loop device holds the file, so a plain unmount is refused and the session goes
    // on serving; once the loop device is gone, it unmounts.
    let dev = LoopDevice::attach(&attachment.file());
    match attachment.unmounter().unmount() {
        Err(e @ Error::InUse(_)) => assert!(e.to_string().contains("losetup -d"), "{e}"),
        other => panic!("unmount under a loop device: {other:?}"),
    }
    let mut sector = vec![0u8; 512];
    std::fs::File::open(&dev.path).unwrap().read_exact_at(&mut sector, 0).unwrap();
    dev.detach();
    unmount(attachment);
}
