//! The NBD specification's default size constraints, with libnbd's `nbdsh` as the client
//! (issue 26). A client that does not agree to block sizes (`EXPORT_NAME`, or `GO` without
//! `NBD_INFO_BLOCK_SIZE`) may send requests at any byte offset and length, with payloads up to
//! 32 MiB; one that asks gets the export's real constraints and is held to them.
//!
//! `nbdsh` is Python over libnbd (Debian's python3-libnbd). It runs here on the system's
//! `/usr/bin/python3`, which is where that package puts the module. Every script checks the
//! bytes it reads back against what it wrote, and exits non-zero on any difference.

use std::process::Command;
use std::time::Duration;

use skiff_tests::{run_ok_within, start_nbd_target, start_target_with, tool};

/// A guard against a hang, far above what each script needs.
const LIMIT: Duration = Duration::from_secs(120);
use transport::Endpoint;

/// `nbdsh` running `code` (with `h`, an `nbd.NBD` handle, already made), with the system's
/// Python first on the path.
fn nbdsh(code: &str) -> Command {
    let mut cmd = tool("nbdsh", "python3-libnbd");
    let path = std::env::var("PATH").unwrap_or_default();
    cmd.env("PATH", format!("/usr/bin:/bin:{path}")).args(["-c", code]);
    cmd
}

fn scratch_file(len: u64) -> tempfile::NamedTempFile {
    let f = tempfile::Builder::new().prefix("skiff-nbd-sizes-").tempfile_in("/var/tmp").unwrap();
    f.as_file().set_len(len).unwrap();
    f
}

/// Unaligned requests, a request of 1 MiB + 14 bytes, and one of 32 MiB at an odd offset,
/// each read back; the bytes around each are checked too.
const UNALIGNED: &str = r#"
import errno, os
h.set_strict_mode(0)
h.set_request_block_size(False)
h.connect_uri(os.environ["URI"])
assert h.get_block_size(nbd.SIZE_MINIMUM) == 0, "constraints sent to a client that did not ask"
size = h.get_size()
MAX = 32 << 20
def pread(n, off):
    return b"".join(h.pread(min(MAX, n - at), off + at) for at in range(0, n, MAX))
model = bytearray(os.urandom(size))
for off in range(0, size, MAX):
    h.pwrite(bytes(model[off:off + MAX]), off)
cases = [(1, 1), (4095, 2), (4097, 14), (12345, (1 << 20) + 14), (size - 7, 7), (3, 32 << 20), (511, 513)]
for i, (off, n) in enumerate(cases):
    data = os.urandom(n)
    h.pwrite(data, off)
    model[off:off + n] = data
    assert h.pread(n, off) == data, "read back %d+%d" % (off, n)
    lo, hi = max(0, off - 8192), min(size, off + n + 8192)
    assert pread(hi - lo, lo) == bytes(model[lo:hi]), "around %d+%d" % (off, n)
assert pread(size, 0) == bytes(model), "the volume differs from what was written"
# One byte past the default maximum payload is refused, and the connection goes on.
try:
    h.pread(MAX + 1, 0)
    raise SystemExit("a read of 32 MiB + 1 was served")
except nbd.Error as e:
    assert e.errnum == errno.EINVAL, e
assert h.pread(1, 0) == bytes(model[:1])
print("ok")
"#;

#[test]
fn nbdsh_without_block_sizes_reads_and_writes_any_bytes_on_ram_and_file() {
    let file = scratch_file(48 << 20);
    let exports = ["vol=ram:48M".to_owned(), format!("disk=file:{}", file.path().display())];
    let exports: Vec<&str> = exports.iter().map(String::as_str).collect();
    let (t, addr) = start_nbd_target(&exports);
    for export in ["vol", "disk"] {
        let out = run_ok_within(nbdsh(UNALIGNED).env("URI", format!("nbd://{addr}/{export}")), LIMIT);
        assert_eq!(out.trim(), "ok", "{export}");
    }
    t.shutdown();
}

/// A client that asks for block sizes gets the export's (512 bytes, the target's largest
/// I/O) and is held to them: an unaligned read sent anyway is refused with `EINVAL`.
#[test]
fn nbdsh_that_asks_gets_the_real_constraints_and_is_held_to_them() {
    let (t, addr) = start_nbd_target(&["vol=ram:4M"]);
    let code = r#"
import os, errno
h.connect_uri(os.environ["URI"])
assert h.get_block_size(nbd.SIZE_MINIMUM) == 512, h.get_block_size(nbd.SIZE_MINIMUM)
assert h.get_block_size(nbd.SIZE_PREFERRED) == 4096
assert h.get_block_size(nbd.SIZE_MAXIMUM) == 1 << 20
h.set_strict_mode(0)
try:
    h.pread(100, 7)
    raise SystemExit("an unaligned read was served to a client that agreed to 512-byte blocks")
except nbd.Error as e:
    assert e.errnum == errno.EINVAL, e
assert h.pread(512, 512) == bytes(512)
print("ok")
"#;
    let out = run_ok_within(nbdsh(code).env("URI", format!("nbd://{addr}/vol")), LIMIT);
    assert_eq!(out.trim(), "ok");
    t.shutdown();
}

/// Two connections write disjoint byte ranges that share 4 KiB blocks of a file export, all
/// at once, with whole-block writes beside them: the target's read-modify-write of a partial
/// block must never undo another connection's write in that block.
#[test]
fn concurrent_unaligned_writes_to_the_same_blocks_of_a_file_lose_nothing() {
    let file = scratch_file(8 << 20);
    let export = format!("disk=file:{}", file.path().display());
    let t = start_target_with(&[&export], |c| {
        c.nbd_listen = vec![Endpoint::Tcp("127.0.0.1:0".into())];
        c.workers = 2;
    });
    let Endpoint::Tcp(addr) = t.endpoints_of(server::Protocol::Nbd)[0].clone() else { unreachable!() };
    let code = r#"
import os, threading
uri = os.environ["URI"]
WRITERS, ROUNDS, BLOCKS = 4, 200, 16
def writer(w):
    g = nbd.NBD()
    g.set_request_block_size(False)
    g.connect_uri(uri)
    for r in range(ROUNDS):
        byte = bytes([(w * ROUNDS + r) % 251 + 1])
        for b in range(BLOCKS):
            g.aio_pwrite(byte * 1000, b * 4096 + w * 1000 + 37)
        g.aio_pwrite(byte * 4096, (BLOCKS + w) * 4096)
        while g.aio_in_flight() > 8:
            g.poll(-1)
    while g.aio_in_flight() > 0:
        g.poll(-1)
    g.shutdown()
threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
for t in threads: t.start()
for t in threads: t.join()
h.set_request_block_size(False)
h.connect_uri(uri)
for w in range(WRITERS):
    last = bytes([(w * ROUNDS + ROUNDS - 1) % 251 + 1])
    for b in range(BLOCKS):
        got = h.pread(1000, b * 4096 + w * 1000 + 37)
        assert got == last * 1000, "writer %d, block %d: a write was lost" % (w, b)
    assert h.pread(4096, (BLOCKS + w) * 4096) == last * 4096, "writer %d's whole block" % w
print("ok")
"#;
    let out = run_ok_within(nbdsh(code).env("URI", format!("nbd://{addr}/disk")), LIMIT);
    assert_eq!(out.trim(), "ok");
    t.shutdown();
}
