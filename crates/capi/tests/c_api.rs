//! Compile a C program against include/skiff.h, link it to the cdylib, and run it against a
//! real target: the header's declarations, constants and struct layouts are checked against
//! this crate from the C side, and data moves through caller-owned buffers.

use std::path::PathBuf;
use std::process::Command;

use server::{Target, TargetConfig};
use skiff::{SkiffCompletion, SkiffLaneConfig};
use transport::Endpoint;

/// target/<profile>/deps: where `cargo test` builds this crate's cdylib, fresh for this test
/// (only `cargo build` copies it up to target/<profile>, so that copy may be stale).
fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().to_path_buf()
}

#[test]
fn c_program_moves_data_through_the_header_api() {
    let lib_dir = deps_dir();
    assert!(lib_dir.join("libskiff.so").exists(), "libskiff.so not built in {}", lib_dir.display());
    let exe = compile("smoke");

    let config = TargetConfig {
        listen: vec![Endpoint::Tcp("127.0.0.1:0".into())],
        exports: vec!["vol=ram:4M".parse().unwrap()],
        workers: 1,
        ..TargetConfig::default()
    };
    let t = Target::start(config).unwrap();
    // The library this test built, not a stale copy that `cargo build` left in target/debug,
    // which cargo's LD_LIBRARY_PATH would otherwise put before the rpath.
    let out = Command::new(&exe)
        .env("LD_LIBRARY_PATH", &lib_dir)
        .arg(t.endpoints()[0].to_string())
        .arg("vol")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("size 4194304 block 512 qd 8"), "{stdout}");
    assert!(stdout.contains("missing export: -2 "), "ENOENT with a message: {stdout}");
    assert!(stdout.trim_end().ends_with("ok"));

    // The C compiler's view of the structs equals Rust's.
    let completion = format!(
        "layout completion {} {} {}",
        std::mem::size_of::<SkiffCompletion>(),
        std::mem::offset_of!(SkiffCompletion, result),
        std::mem::offset_of!(SkiffCompletion, reserved)
    );
    let config = format!(
        "layout config {} {} {}",
        std::mem::size_of::<SkiffLaneConfig>(),
        std::mem::offset_of!(SkiffLaneConfig, timeout_ms),
        std::mem::offset_of!(SkiffLaneConfig, shared_lanes)
    );
    assert!(stdout.contains(&completion), "{completion} vs {stdout}");
    assert!(stdout.contains(&config), "{config} vs {stdout}");
    assert!(stdout.contains("shared ok"), "{stdout}");
    assert!(stdout.contains("direct ok"), "{stdout}");

    let s = t.stats();
    assert_eq!(
        s.get("req_write"),
        Some(10),
        "8 on a lane of its own, 1 on a shared one, 1 before direct reads"
    );
    assert_eq!(s.get("req_direct_read"), Some(1), "the second read of the block was direct");
    assert_eq!(s.get("backend_syncs").unwrap_or(0), 0, "RAM flushes need no sync");
}

/// Compile `tests/c/NAME.c` against the header and the cdylib this test built; returns the
/// program's path.
fn compile(name: &str) -> PathBuf {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let lib_dir = deps_dir();
    let exe = tempfile_dir().join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(crate_dir.join(format!("tests/c/{name}.c")))
        .arg(format!("-I{}", crate_dir.join("include").display()))
        .arg(format!("-L{}", lib_dir.display()))
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-lskiff")
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc}: {e}"));
    assert!(status.success(), "{name}.c does not compile against skiff.h");
    exe
}

/// RStore's API from C: a real etcd, two memory servers (targets with a `pool` export,
/// registered with it), and a C program that creates, reserves, allocates, maps, writes and
/// reads back across servers, and meets the errnos the header names.
#[test]
fn c_program_uses_rstore_namespaces() {
    let exe = compile("rstore");
    let etcd = skiff_tests::etcd::Cluster::start(1);
    let c = rstore::Coordinator::connect(&etcd.endpoints());
    let targets: Vec<Target> =
        (0..2).map(|_| skiff_tests::start_target(&["pool=ram:8M,block=1"], 1)).collect();
    let _regs: Vec<rstore::Registration> = targets
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let endpoint = skiff_tests::tcp_endpoint(t).to_string();
            let info = coord::ServerInfo {
                id: endpoint.clone(),
                endpoint,
                export: "pool".into(),
                scope: coord::Scope::Ram,
                bytes: 8 << 20,
                chunk_bytes: 1 << 20,
                incarnation: 1 + i as u64,
                grant_key: String::new(),
                boot: 1,
            };
            c.register(&info, std::time::Duration::from_secs(30)).unwrap()
        })
        .collect();
    let out = Command::new(&exe).env("LD_LIBRARY_PATH", deps_dir()).arg(etcd.url()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("create again: -17"), "-EEXIST: {stdout}");
    assert!(stdout.trim_end().ends_with("ok"), "{stdout}");
    // Both servers took writes: the 4 MiB were striped.
    for t in &targets {
        assert!(t.stats().get("req_write").unwrap_or(0) > 0, "a server took no write");
    }
    assert!(c.list_ns().unwrap().is_empty(), "the C program deleted its namespace");
}

#[test]
fn header_constants_match_the_protocol() {
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/skiff.h")).unwrap();
    let define = |name: &str| -> u32 {
        let line = header.lines().find(|l| l.starts_with(&format!("#define {name} "))).unwrap();
        let v = line.split_whitespace().nth(2).unwrap();
        match v.strip_prefix("0x") {
            Some(hex) => u32::from_str_radix(hex, 16).unwrap(),
            None => v.parse().unwrap(),
        }
    };
    use wire::Opcode;
    assert_eq!(define("SKIFF_OP_READ"), Opcode::Read as u32);
    assert_eq!(define("SKIFF_OP_WRITE"), Opcode::Write as u32);
    assert_eq!(define("SKIFF_OP_FLUSH"), Opcode::Flush as u32);
    assert_eq!(define("SKIFF_OP_TRIM"), Opcode::Trim as u32);
    assert_eq!(define("SKIFF_OP_WRITE_ZEROES"), Opcode::WriteZeroes as u32);
    assert_eq!(define("SKIFF_FLAG_FUA"), skiff::SKIFF_FLAG_FUA);
    assert_eq!(define("SKIFF_FLAG_NO_DELAY"), skiff::SKIFF_FLAG_NO_DELAY);
    assert_eq!(define("SKIFF_BATCHING_STATIC"), skiff::SKIFF_BATCHING_STATIC);
    assert_eq!(define("SKIFF_BATCHING_OFF"), skiff::SKIFF_BATCHING_OFF);
    assert_eq!(define("SKIFF_BATCHING_ADAPTIVE"), skiff::SKIFF_BATCHING_ADAPTIVE);
    assert_eq!(define("SKIFF_FLAG_FUA"), u32::from(wire::ReqFlags::FUA.bits()));
    assert_eq!(define("SKIFF_FLAG_NO_DELAY"), u32::from(wire::ReqFlags::NO_DELAY.bits()));
    assert_eq!(define("SKIFF_SCOPE_RAM"), skiff::SKIFF_SCOPE_RAM);
    assert_eq!(define("SKIFF_SCOPE_FILE"), skiff::SKIFF_SCOPE_FILE);
    assert_eq!(define("SKIFF_SCOPE_FLASH"), skiff::SKIFF_SCOPE_FLASH);
    assert_eq!(define("SKIFF_ALLOC_AT"), skiff::SKIFF_ALLOC_AT);
}

fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("skiff-capi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
