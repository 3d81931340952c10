//! Real NBD clients from Debian's packages against skiff's NBD front end. Every test checks
//! the data itself, not only the exit status.

use std::process::Command;

use initiator::{Lane, LaneConfig};
use skiff_tests::{run_ok, start_nbd_target, tcp_endpoint, tool};

const QEMU: &str = "qemu-utils";
const LIBNBD: &str = "libnbd-bin";

fn uri(addr: &str, export: &str) -> String {
    format!("nbd://{addr}/{export}")
}

/// Deterministic bytes with a hole-shaped gap of zeroes in the middle, for image tests.
fn image_bytes(len: usize) -> Vec<u8> {
    let mut x = 0x2545F4914F6CDD1Du64;
    (0..len)
        .map(|i| {
            if (len / 4..len / 2).contains(&i) {
                return 0;
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn scratch_file(bytes: &[u8]) -> tempfile::NamedTempFile {
    let f = tempfile::Builder::new().prefix("skiff-nbd-").tempfile_in("/var/tmp").unwrap();
    std::fs::write(f.path(), bytes).unwrap();
    f
}

#[test]
fn nbdinfo_sees_exports_flags_and_the_true_allocation_map() {
    let (t, addr) = start_nbd_target(&["vol=ram:16M", "golden=ram:1M,ro"]);
    let json = run_ok(tool("nbdinfo", LIBNBD).args(["--json", &uri(&addr, "vol")]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let e = &v["exports"][0];
    assert_eq!(e["export-size"], 16 << 20);
    for flag in ["can_flush", "can_fua", "can_trim", "can_zero", "can_multi_conn"] {
        assert_eq!(e[flag], true, "{flag} in {e}");
    }
    assert_eq!(e["is_read_only"], false);
    assert_eq!(e["block_size_minimum"], 512);

    let list = run_ok(tool("nbdinfo", LIBNBD).args(["--list", "--json", &format!("nbd://{addr}")]));
    let v: serde_json::Value = serde_json::from_str(&list).unwrap();
    let names: Vec<&str> =
        v["exports"].as_array().unwrap().iter().map(|e| e["export-name"].as_str().unwrap()).collect();
    assert_eq!(names, ["vol", "golden"]);

    // --can answers with the exit status: 0 for yes, 2 for no.
    let can = |what: &str, export: &str| {
        tool("nbdinfo", LIBNBD).args(["--can", what, &uri(&addr, export)]).status().unwrap().code()
    };
    assert_eq!(can("flush", "vol"), Some(0));
    assert_eq!(can("multi-conn", "vol"), Some(0));
    assert_eq!(can("write", "golden"), Some(2), "a read-only export is not writable");

    // Write through the native protocol, then map through NBD: both see one engine.
    let mut lane = Lane::connect(&tcp_endpoint(&t), "vol", &LaneConfig::default()).unwrap();
    lane.write_at(&[9; 8192], 1 << 20).unwrap();
    let map = run_ok(tool("nbdinfo", LIBNBD).args(["--map", "--json", &uri(&addr, "vol")]));
    let extents: Vec<(u64, u64, u64)> = serde_json::from_str::<serde_json::Value>(&map)
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|x| (x["offset"].as_u64().unwrap(), x["length"].as_u64().unwrap(), x["type"].as_u64().unwrap()))
        .collect();
    assert_eq!(extents, vec![(0, 1 << 20, 3), (1 << 20, 8192, 0), ((1 << 20) + 8192, (15 << 20) - 8192, 3)]);
}

#[test]
fn qemu_io_patterns_flush_discard_zero_and_aio() {
    let (t, addr) = start_nbd_target(&["vol=ram:16M"]);
    let out = run_ok(tool("qemu-io", QEMU).args([
        "-f",
        "raw",
        &uri(&addr, "vol"),
        "-c",
        "write -P 0xab 0 64k",
        "-c",
        "read -P 0xab 0 64k",
        "-c",
        "flush",
        "-c",
        "write -P 0xcd 128k 64k",
        "-c",
        "discard 128k 4k",
        "-c",
        "read -P 0 128k 4k",
        "-c",
        "read -P 0xcd 132k 60k",
        "-c",
        "write -z 64k 64k",
        "-c",
        "read -P 0 64k 64k",
        "-c",
        "aio_write -P 0x11 1M 128k",
        "-c",
        "aio_write -P 0x22 2M 4k",
        "-c",
        "aio_flush",
        "-c",
        "read -P 0x11 1M 128k",
        "-c",
        "read -P 0x22 2M 4k",
        "-c",
        "write -f -P 0x33 3M 4k",
        "-c",
        "read -P 0x33 3M 4k",
    ]));
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert_eq!(out.matches("read ").count(), 7, "{out}");
    // The native protocol sees what qemu wrote.
    let mut lane = Lane::connect(&tcp_endpoint(&t), "vol", &LaneConfig::default()).unwrap();
    let mut back = vec![0; 4096];
    lane.read_at(&mut back, 1 << 20).unwrap();
    assert_eq!(back, vec![0x11; 4096]);
}

#[test]
fn qemu_img_info_map_convert_and_compare() {
    let (_t, addr) = start_nbd_target(&["vol=ram:8M"]);
    let src = scratch_file(&image_bytes(8 << 20));
    let info = run_ok(tool("qemu-img", QEMU).args(["info", "--output=json", &uri(&addr, "vol")]));
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(v["virtual-size"], 8 << 20);

    run_ok(
        tool("qemu-img", QEMU)
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(src.path())
            .arg(uri(&addr, "vol")),
    );
    let cmp = run_ok(
        tool("qemu-img", QEMU)
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(src.path())
            .arg(uri(&addr, "vol")),
    );
    assert!(cmp.contains("Images are identical"), "{cmp}");

    let map = run_ok(tool("qemu-img", QEMU).args(["map", "--output=json", "-f", "raw", &uri(&addr, "vol")]));
    let v: serde_json::Value = serde_json::from_str(&map).unwrap();
    let data: u64 = v
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["data"] == true)
        .map(|e| e["length"].as_u64().unwrap())
        .sum();
    // convert skips the zero quarter of the image (it writes zeroes or nothing there), so
    // at least the three data quarters are allocated and nothing beyond the volume.
    assert!((6 << 20..=8 << 20).contains(&data), "data bytes {data}: {map}");
}

#[test]
fn nbdcopy_both_directions_preserves_every_byte() {
    let (_t, addr) = start_nbd_target(&["vol=ram:8M"]);
    let bytes = image_bytes(8 << 20);
    let src = scratch_file(&bytes);
    run_ok(tool("nbdcopy", LIBNBD).arg(src.path()).arg(uri(&addr, "vol")));
    let out = tempfile::Builder::new().prefix("skiff-nbd-out-").tempfile_in("/var/tmp").unwrap();
    run_ok(tool("nbdcopy", LIBNBD).arg(uri(&addr, "vol")).arg(out.path()));
    let back = std::fs::read(out.path()).unwrap();
    assert_eq!(back.len(), bytes.len());
    assert!(back == bytes, "nbdcopy round trip changed data");
}

#[test]
fn fio_nbd_engine_writes_and_verifies_crc32c() {
    let (_t, addr) = start_nbd_target(&["vol=ram:32M"]);
    let out = run_ok(tool("fio", "fio").args([
        "--name=verify",
        "--ioengine=nbd",
        &format!("--uri={}", uri(&addr, "vol")),
        "--rw=randwrite",
        "--bs=4k",
        "--size=16M",
        "--iodepth=16",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--verify_state_save=0",
        "--output-format=json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "{job}");
    assert_eq!(job["write"]["io_bytes"], 16 << 20);
    assert_eq!(job["read"]["io_bytes"], 16 << 20, "the verify pass read everything back");
}

#[test]
fn nbdfuse_file_reads_and_writes() {
    let (_t, addr) = start_nbd_target(&["vol=ram:8M"]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("disk");
    let mut fuse = tool("nbdfuse", LIBNBD).arg(&file).arg(uri(&addr, "vol")).spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) != 8 << 20 {
        if std::time::Instant::now() >= deadline {
            let _ = Command::new("fusermount3").arg("-u").arg(dir.path()).status();
            let _ = fuse.kill();
            let _ = fuse.wait();
            panic!("nbdfuse did not mount (is /dev/fuse available?)");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let result = std::panic::catch_unwind(|| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&file).unwrap();
        let bytes = image_bytes(256 << 10);
        f.write_all_at(&bytes, 1 << 20).unwrap();
        f.sync_all().unwrap();
        let mut back = vec![0; bytes.len()];
        f.read_exact_at(&mut back, 1 << 20).unwrap();
        assert!(back == bytes);
    });
    let _ = Command::new("fusermount3").arg("-u").arg(dir.path()).status();
    let _ = fuse.wait();
    result.unwrap();
}
