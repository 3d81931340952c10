//! RStore's control plane from the command line (issue 12): two memory servers (`skiff serve
//! --pool ram:16M --coordinator URL`) register with a real etcd; `skiff ns` creates a
//! namespace striped over both, allocates in it, lists it; a server killed with SIGKILL loses
//! its lease and its chunks show as lost; one stopped cleanly ends its registration at once.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use skiff_tests::etcd::Cluster;
use skiff_tests::{memory_server, KillOnDrop};

fn skiff() -> Command {
    Command::new(env!("CARGO_BIN_EXE_skiff"))
}

fn ns(url: &str, args: &[&str]) -> String {
    let out = skiff().args(["ns", "--coordinator", url]).args(args).output().expect("skiff ns");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "skiff ns {args:?}: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    stdout
}

fn json(url: &str, args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.push("--json");
    serde_json::from_str(&ns(url, &all)).expect("JSON")
}

/// Wait until `skiff ns servers` lists `n` servers.
fn wait_servers(url: &str, n: usize) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let servers = json(url, &["servers"]);
        if servers.as_array().map(Vec::len) == Some(n) {
            return servers;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "never {n} servers: {servers}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn memory_servers_register_and_namespaces_stripe_over_them() {
    let etcd = Cluster::start(1);
    let url = etcd.url();
    let serve =
        |lease: &str| memory_server(env!("CARGO_BIN_EXE_skiff"), &url, "ram:16M", &["--lease", lease]);
    let (mut first, mut second) = (serve("2s"), serve("2s"));
    let servers = wait_servers(&url, 2);
    for s in servers.as_array().unwrap() {
        assert_eq!(
            (s["export"].as_str(), s["bytes"].as_u64(), s["chunk_bytes"].as_u64()),
            (Some("pool"), Some(16 << 20), Some(1 << 20))
        );
        assert!(s["endpoint"].as_str().unwrap().starts_with("127.0.0.1:"), "{s}");
    }

    // No --chunk: the namespace takes the servers' chunk size (1 MiB here, not the 4 MiB
    // default), or it could reserve nothing on them.
    let created = json(&url, &["create", "t", "--size", "8M"]);
    assert_eq!(created["chunk_bytes"].as_u64(), Some(1 << 20), "{created}");
    let stripes = created["reserved"].as_array().unwrap();
    assert_eq!(stripes.len(), 8);
    let on: Vec<&str> = stripes.iter().map(|s| s[0]["server"].as_str().unwrap()).collect();
    assert!(on.windows(2).all(|w| w[0] != w[1]), "consecutive chunks on different servers: {on:?}");
    let a = json(&url, &["alloc", "t", "3M"]);
    assert_eq!((a["addr"].as_u64(), a["stripes"].as_array().unwrap().len()), (Some(0), 3));
    // The bootstrap address is taken now: a second allocation there is refused.
    let out = skiff().args(["ns", "--coordinator", &url, "alloc", "t", "1M", "--at", "0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("overlaps"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = ns(&url, &["list"]);
    assert!(
        listed.contains("t: ram x1") && listed.contains("8 MiB reserved, 3 MiB in 1 allocation(s)"),
        "{listed}"
    );

    // The data path: skiff bench over the allocation, every thread with a lane to each server,
    // every block verified; the server figures come from both servers.
    let out = skiff()
        .args([
            "bench",
            "--namespace",
            "t",
            "--coordinator",
            &url,
            "--rw",
            "randrw",
            "--bs",
            "64k",
            "--qd",
            "8",
        ])
        .args(["--threads", "2", "--duration", "1s", "--verify", "--json"])
        .output()
        .expect("skiff bench --namespace");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "skiff bench --namespace: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bench: serde_json::Value = serde_json::from_str(&stdout).expect("bench JSON");
    assert!(bench["ios"].as_u64().unwrap() > 100, "{bench}");
    assert_eq!((bench["io_errors"].as_u64(), bench["verify_errors"].as_u64()), (Some(0), Some(0)), "{bench}");
    assert!(bench["target"].as_str().is_some_and(|t| t.contains("over 2 servers")), "{}", bench["target"]);
    eprintln!("bench over the namespace: {} I/Os, target {}", bench["ios"], bench["target"]);

    // SIGKILL: the lease lapses after its 2 s and the chunks on that server are lost.
    let killed = first.0.id();
    let _ = first.0.kill();
    let _ = first.0.wait();
    wait_servers(&url, 1);
    let listed = ns(&url, &["list"]);
    assert!(listed.contains("4 chunk(s) LOST"), "pid {killed} gone: {listed}");

    // SIGTERM: a clean stop ends the registration at once.
    let _ = Command::new("kill").args(["-TERM", &second.0.id().to_string()]).status();
    let _ = second.0.wait();
    assert_eq!(json(&url, &["servers"]).as_array().map(Vec::len), Some(0));

    ns(&url, &["delete", "t"]);
    assert_eq!(json(&url, &["list"]).as_array().map(Vec::len), Some(0));
}

/// Chunks a namespace gives back hold its bytes until their server zeroes them: the next
/// namespace on the same chunks reads zeros, never the last one's data. The pool takes I/O
/// only with the chunk grants a map hands out: a plain connection is refused, and a segment
/// mapped before the namespace was deleted is refused once the server retired its chunks,
/// and writes nothing into the next namespace.
#[test]
fn chunks_given_back_are_zeroed_before_another_namespace_gets_them() {
    let etcd = Cluster::start(1);
    let url = etcd.url();
    let _server = memory_server(env!("CARGO_BIN_EXE_skiff"), &url, "ram:4M", &[]);
    wait_servers(&url, 1);
    ns(&url, &["create", "first", "--size", "4M", "--chunk", "1M"]);
    ns(&url, &["alloc", "first", "4M"]);
    let c = rstore::Coordinator::connect(std::slice::from_ref(&url));
    let mut seg = skiff_tests::rstore::segment(&c, "first", 0);
    seg.write(0, &vec![0xA5; 4 << 20]).unwrap();
    let endpoint = initiator::Endpoint::parse(&c.servers().unwrap()[0].endpoint).unwrap();
    let mut bare = initiator::Lane::connect(&endpoint, "pool", &initiator::LaneConfig::default()).unwrap();
    let err = bare.write_at(&[0xEE; 512], 0).expect_err("no grant, no write");
    assert!(matches!(err, initiator::Error::Status(initiator::Status::BadCapability)), "{err}");
    ns(&url, &["delete", "first"]);
    // Every chunk is taken: none is handed out until the server has zeroed it.
    let start = Instant::now();
    let id = json(&url, &["servers"])[0]["id"].as_str().unwrap().to_owned();
    while !c.dirty(&id).unwrap().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(60), "the server never zeroed its chunks");
        std::thread::sleep(Duration::from_millis(100));
    }
    ns(&url, &["create", "second", "--size", "4M", "--chunk", "1M"]);
    ns(&url, &["alloc", "second", "4M"]);
    let err = seg.write(0, &[0xEE; 512]).expect_err("the first namespace's grants are stale");
    assert!(matches!(err, initiator::Error::Status(initiator::Status::StaleCapability)), "{err}");
    let mut seg = skiff_tests::rstore::segment(&c, "second", 0);
    let mut buf = vec![0xFFu8; 4 << 20];
    seg.read(0, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "the second namespace read the first one's bytes");
}

/// Replicas under load: three memory servers, a namespace with two copies of every chunk,
/// `skiff bench --namespace --verify` writing and reading, and one server killed with SIGKILL
/// in the middle of the timed phase. No I/O fails, and every block reads back as last written.
#[test]
fn with_two_replicas_a_memory_server_killed_under_load_costs_no_error_and_no_write() {
    let etcd = Cluster::start(1);
    let url = etcd.url();
    let mut servers: Vec<KillOnDrop> =
        (0..3).map(|_| memory_server(env!("CARGO_BIN_EXE_skiff"), &url, "ram:16M", &[])).collect();
    wait_servers(&url, 3);
    ns(&url, &["create", "safe", "--size", "12M", "--chunk", "1M", "--replicas", "2"]);
    ns(&url, &["alloc", "safe", "12M"]);
    let mut bench = skiff()
        .args(["bench", "--namespace", "safe", "--coordinator", &url, "--rw", "randrw", "--bs", "16k"])
        .args(["--qd", "8", "--threads", "2", "--duration", "3s", "--verify", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("skiff bench --namespace");
    // The verify phase writes the whole region first; then the timed phase runs for 3 s.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(bench.try_wait().unwrap().is_none(), "the bench ended before the kill: lengthen it");
    let victim = servers.remove(1);
    drop(victim); // SIGKILL, while the bench runs
    let out = bench.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "skiff bench: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(&stdout).expect("bench JSON");
    assert!(r["ios"].as_u64().unwrap() > 100, "{r}");
    assert_eq!((r["io_errors"].as_u64(), r["verify_errors"].as_u64()), (Some(0), Some(0)), "{r}");
    // The killed server's copies are marked stale: nobody maps them again, and the status
    // says the namespace is degraded, naming them.
    let status = json(&url, &["status", "safe"]);
    let copies = status["copies"].as_array().cloned().unwrap_or_default();
    let stale: Vec<&str> =
        copies.iter().filter(|c| c["state"] == "stale").filter_map(|c| c["server"].as_str()).collect();
    assert!(
        !stale.is_empty() && stale.iter().all(|s| *s == stale[0]),
        "one server's copies are stale: {status}"
    );
    assert_eq!(status["health"], "degraded", "{status}");
    eprintln!(
        "killed a server under load: {} I/Os, no error, every block verified; {} stale copies on {}",
        r["ios"],
        stale.len(),
        stale[0]
    );
}

/// `skiff serve --pool` refuses what cannot work, saying why, before it serves anything.
#[test]
fn serve_refuses_bad_pool_settings() {
    let unreachable = "http://127.0.0.1:1";
    for (args, says) in [
        (vec!["--pool", "null:1M", "--listen", "127.0.0.1:0"], "must hold data"),
        (vec!["--pool", "ram:4M", "--chunk", "3M", "--listen", "127.0.0.1:0"], "--chunk 3145728"),
        (
            vec!["--pool", "ram:16G", "--chunk", "2K", "--listen", "127.0.0.1:0"],
            "8388608 chunks, more than 4194304",
        ),
        (vec!["--pool", "ram:8G", "--chunk", "4G", "--listen", "127.0.0.1:0"], "nor 2 GiB"),
        (
            vec!["--pool", "ram:4M", "--export", "pool=ram:1M", "--listen", "127.0.0.1:0"],
            "no --export may take that name",
        ),
        (vec!["--pool", "ram:4M", "--listen", "0.0.0.0:0"], "give --advertise"),
        (vec!["--pool", "flash:1G", "--listen", "127.0.0.1:0"], "give --flash DEVICE"),
        (vec!["--pool", "ram:4M", "--listen", "127.0.0.1:0"], "registering with the coordinator"),
    ] {
        let out =
            skiff().args(["serve", "--coordinator", unreachable]).args(&args).output().expect("skiff serve");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{args:?}: {err}");
    }
}

/// A memory server over `file` listening on `port`, repairing at full speed.
fn file_server(url: &str, file: &std::path::Path, port: u16) -> KillOnDrop {
    KillOnDrop(
        skiff()
            .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--pool"])
            .arg(format!("file:{}", file.display()))
            .args(["--chunk", "1M", "--coordinator", url, "--rebuild-rate", "0", "--lease", "3s"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("skiff serve --pool"),
    )
}

/// `skiff bench` over namespace `name` with `args`, expected to end without an error.
fn bench(url: &str, name: &str, args: &[&str]) -> serde_json::Value {
    let out = skiff()
        .args(["bench", "--namespace", name, "--coordinator", url, "--json"])
        .args(args)
        .output()
        .expect("skiff bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "skiff bench {args:?}: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(&stdout).expect("bench JSON");
    assert_eq!((r["io_errors"].as_u64(), r["verify_errors"].as_u64()), (Some(0), Some(0)), "{r}");
    r
}

/// Three memory servers over files, two copies a stripe. One is killed (SIGKILL) while a bench
/// writes, a few writes land while it is away, its file is damaged in place, and it comes back
/// on its address with its file: its copies are repaired by copying the regions written
/// meanwhile and those found different, under a verified load, and end byte-identical to the
/// other copies; `skiff ns status` says healthy.
#[test]
fn a_memory_server_killed_and_back_with_its_file_is_repaired_under_load() {
    let etcd = Cluster::start(1);
    let url = etcd.url();
    let dir = tempfile::tempdir().unwrap();
    let files: Vec<std::path::PathBuf> = (0..3).map(|i| dir.path().join(format!("pool{i}"))).collect();
    for f in &files {
        std::fs::File::create(f).unwrap().set_len(16 << 20).unwrap();
    }
    // Fixed ports: a server must come back on the same address (its id).
    let ports = skiff_tests::free_ports(3);
    let mut servers: Vec<KillOnDrop> = (0..3).map(|i| file_server(&url, &files[i], ports[i])).collect();
    wait_servers(&url, 3);
    ns(&url, &["create", "heal", "--size", "8M", "--chunk", "1M", "--replicas", "2", "--scope", "file"]);
    ns(&url, &["alloc", "heal", "8M"]);
    bench(&url, "heal", &["--rw", "randwrite", "--bs", "64k", "--qd", "4", "--duration", "1s"]);
    // Killed under load (100 writes a second, so that what the copies miss is a few regions):
    // the bench sees no error.
    let load = skiff()
        .args(["bench", "--namespace", "heal", "--coordinator", &url, "--json", "--rw", "randwrite"])
        .args(["--bs", "4k", "--qd", "2", "--rate", "100", "--duration", "2s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    drop(std::mem::replace(&mut servers[1], KillOnDrop(Command::new("true").spawn().unwrap())));
    let out = load.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["io_errors"].as_u64(), Some(0), "{r}");
    let status = json(&url, &["status", "heal"]);
    assert_eq!(status["health"], "degraded", "{status}");
    // Its file is damaged in place while it is away, in three regions (of 16 KiB) of each of
    // its chunks, most of which no write touched meanwhile: only comparing finds them.
    let listed = json(&url, &["list"]);
    let away = format!(":{}", ports[1]);
    let mut damaged = 0;
    for stripe in listed[0]["allocs"]["0"]["stripes"].as_array().unwrap() {
        for c in stripe.as_array().unwrap().iter().filter(|c| c["server"].as_str().unwrap().ends_with(&away))
        {
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new().write(true).open(&files[1]).unwrap();
            for region in [5u64, 29, 53] {
                file.write_all_at(&[0xD5; 512], (c["index"].as_u64().unwrap() << 20) + region * (16 << 10))
                    .unwrap();
            }
            damaged += 1;
        }
    }
    assert!(damaged > 0, "the server held copies: {listed}");

    // Back on its address with its file: repaired while a load runs.
    servers[1] = file_server(&url, &files[1], ports[1]);
    let during = bench(
        &url,
        "heal",
        &["--rw", "randrw", "--bs", "4k", "--qd", "2", "--rate", "500", "--duration", "3s"],
    );
    assert!(during["ios"].as_u64().unwrap() > 100, "{during}");
    let start = Instant::now();
    let status = loop {
        let status = json(&url, &["status", "heal"]);
        if status["health"] == "healthy" {
            break status;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "never healthy: {status}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let copied: u64 =
        status["sources"].as_array().unwrap().iter().map(|s| s["bytes"].as_u64().unwrap()).sum();
    let repaired: u64 =
        status["sources"].as_array().unwrap().iter().map(|s| s["chunks"].as_u64().unwrap()).sum();
    assert!(
        copied > 0 && copied < repaired << 20,
        "partial repairs: {copied} bytes for {repaired} chunks: {status}"
    );
    let mismatched: u64 =
        status["sources"].as_array().unwrap().iter().map(|s| s["mismatched"].as_u64().unwrap()).sum();
    assert!(mismatched > 0, "the damaged regions were found by comparing: {status}");

    // Every stripe's copies are byte-identical in the servers' files.
    let listed = json(&url, &["list"]);
    let file_of = |server: &str| {
        let port: u16 = server.rsplit(':').next().unwrap().parse().unwrap();
        &files[ports.iter().position(|&p| p == port).expect("a known server")]
    };
    let chunk = |server: &str, index: u64| {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; 1 << 20];
        std::fs::File::open(file_of(server)).unwrap().read_exact_at(&mut buf, index << 20).unwrap();
        buf
    };
    let stripes = listed[0]["allocs"]["0"]["stripes"].as_array().unwrap();
    for (i, stripe) in stripes.iter().enumerate() {
        let copies: Vec<Vec<u8>> = stripe
            .as_array()
            .unwrap()
            .iter()
            .map(|c| chunk(c["server"].as_str().unwrap(), c["index"].as_u64().unwrap()))
            .collect();
        assert!(copies.windows(2).all(|w| w[0] == w[1]), "stripe {i}: copies differ");
    }
    // And a verified load reads back what it writes from either copy.
    let verified = bench(&url, "heal", &["--rw", "randrw", "--bs", "4k", "--duration", "1s", "--verify"]);
    assert!(verified["ios"].as_u64().unwrap() > 100, "{verified}");
    eprintln!("killed and back: {} bytes copied to repair it; status {status}", copied);
}

/// etcd over TLS with client certificates: a real etcd that asks every client for a
/// certificate signed by its CA. A memory server registers through it (`--coordinator-ca`,
/// `--coordinator-cert`, `--coordinator-key`), `skiff ns` makes a namespace (the same through
/// `$SKIFF_COORDINATOR_CA` and friends), and `skiff bench --namespace` runs a verified load
/// over it. Without a client certificate, or without the CA, the coordinator is refused with
/// a message that says so.
#[test]
fn etcd_over_tls_with_client_certificates() {
    let dir = tempfile::tempdir().unwrap();
    skiff_tests::certs::make(dir.path());
    skiff_tests::certs::etcd(dir.path());
    let pem = |f: &str| dir.path().join(f).display().to_string();
    let [client, peer] = skiff_tests::free_ports(2)[..] else { unreachable!("two ports") };
    let url = format!("https://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let _etcd = KillOnDrop(
        Command::new("etcd")
            .args(["--name", "tls", "--data-dir"])
            .arg(dir.path().join("etcd"))
            .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("tls={peer_url}")])
            .args(["--cert-file", &pem("etcd-cert.pem"), "--key-file", &pem("etcd-key.pem")])
            .args(["--client-cert-auth", "--trusted-ca-file", &pem("ca-cert.pem")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd"),
    );
    let tls = [
        "--coordinator-ca".to_owned(),
        pem("ca-cert.pem"),
        "--coordinator-cert".to_owned(),
        pem("client-cert.pem"),
        "--coordinator-key".to_owned(),
        pem("client-key.pem"),
    ];
    let ns_tls =
        |args: &[&str]| skiff().args(["ns", "--coordinator", &url]).args(&tls).args(args).output().unwrap();
    let start = Instant::now();
    while !ns_tls(&["servers"]).status.success() {
        assert!(start.elapsed() < Duration::from_secs(60), "etcd over TLS never answered");
        std::thread::sleep(Duration::from_millis(100));
    }
    let _server = KillOnDrop(
        skiff()
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--pool",
                "ram:16M",
                "--chunk",
                "1M",
                "--coordinator",
                &url,
            ])
            .args(&tls)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let start = Instant::now();
    loop {
        let out = ns_tls(&["servers", "--json"]);
        let servers: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if servers.as_array().map(Vec::len) == Some(1) {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the memory server never registered over TLS");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The same from the environment.
    let out = skiff()
        .args(["ns", "--coordinator", &url, "create", "secure", "--size", "4M", "--chunk", "1M"])
        .env("SKIFF_COORDINATOR_CA", pem("ca-cert.pem"))
        .env("SKIFF_COORDINATOR_CERT", pem("client-cert.pem"))
        .env("SKIFF_COORDINATOR_KEY", pem("client-key.pem"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(ns_tls(&["alloc", "secure", "4M"]).status.success());
    let out = skiff()
        .args(["bench", "--namespace", "secure", "--coordinator", &url])
        .args(&tls)
        .args(["--rw", "randrw", "--duration", "1s", "--verify", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((r["io_errors"].as_u64(), r["verify_errors"].as_u64()), (Some(0), Some(0)), "{r}");
    // No client certificate: etcd refuses the handshake. No CA: its certificate is unknown.
    let out = skiff()
        .args(["ns", "--coordinator", &url, "--coordinator-ca", &pem("ca-cert.pem"), "list"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "etcd took a client without a certificate");
    let out = skiff().args(["ns", "--coordinator", &url, "list"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("127.0.0.1"), "{err}");
    eprintln!("etcd over TLS: without a CA, {}", err.trim());
}

/// Namespace `name`'s head as etcd holds it now (`None`: no namespace).
fn head(c: &rstore::Coordinator, name: &str) -> Option<coord::NsHead> {
    let kv = c.etcd().get(&coord::schema::key(coord::schema::NAMESPACES, name)).expect("etcd answers")?;
    Some(coord::schema::decode(&kv).expect("a namespace head"))
}

/// Run `skiff ns ARGS` and kill it (SIGKILL) as soon as `moved` says its first steps are in
/// etcd. Returns whether it was killed before it finished.
fn kill_mid_call(
    url: &str,
    c: &rstore::Coordinator,
    args: &[&str],
    moved: impl Fn(Option<&coord::NsHead>) -> bool,
) -> bool {
    let mut child = skiff()
        .args(["ns", "--coordinator", url])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("skiff ns");
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "skiff ns {args:?} failed");
            return false;
        }
        if moved(head(c, "big").as_ref()) {
            child.kill().unwrap();
            child.wait().unwrap();
            return true;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "skiff ns {args:?} never moved");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A client killed (SIGKILL) in the middle of a call that takes many steps (a reserve, a
/// release and a delete of tens of gigabytes, a transaction per 1,024 stripes) leaves every
/// record whole: each chunk in use is held by one stripe and each stripe's chunks are in use in
/// their pools. The reserve holds what its steps took, the release gave back what its steps
/// gave, and a delete killed midway is finished by running it again, after which every chunk
/// is back in its pool.
#[test]
fn a_client_killed_mid_call_leaves_the_records_whole_and_the_next_call_finishes() {
    use skiff_tests::records;
    const GIB: u64 = 1 << 30;
    let etcd = Cluster::start(1);
    let url = etcd.url();
    let c = rstore::Coordinator::connect(&etcd.endpoints());
    // 16 servers of 16 GiB that hold no data: 65,536 chunks.
    let _phantoms = KillOnDrop(
        skiff()
            .args([
                "ns",
                "--coordinator",
                &url,
                "phantom",
                "--servers",
                "16",
                "--pool",
                "16G",
                "--chunk",
                "4M",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("skiff ns phantom"),
    );
    wait_servers(&url, 16);
    ns(&url, &["create", "big", "--chunk", "4M", "--replicas", "2"]);
    let reserved =
        |h: Option<&coord::NsHead>| h.map_or(0, |h| coord::schema::run_len(&h.reserved) * (4 << 20));

    // A reserve of 96 GiB (24 steps), killed once its first step is in.
    let total = 96 * GIB;
    let killed = kill_mid_call(&url, &c, &["reserve", "big", "96G"], |h| reserved(h) > 0);
    records::check(&c, 2, false);
    let got = reserved(head(&c, "big").as_ref());
    assert!(killed && got > 0 && got < total, "the reserve was cut short: {got} of {total} bytes");
    ns(&url, &["reserve", "big", &(total - got).to_string()]);
    assert_eq!(reserved(head(&c, "big").as_ref()), total, "the next reserve took the rest");
    assert_eq!(records::check(&c, 2, false).chunks_used, 2 * total / (4 << 20));

    // A release of 64 GiB, killed likewise.
    let killed = kill_mid_call(&url, &c, &["release", "big", "64G"], |h| reserved(h) < total);
    records::check(&c, 2, false);
    let left = reserved(head(&c, "big").as_ref());
    assert!(killed && left < total && left > total - 64 * GIB, "the release was cut short: {left} left");
    ns(&url, &["release", "big", &(left - 32 * GIB).to_string()]);
    assert_eq!(reserved(head(&c, "big").as_ref()), 32 * GIB);

    // A delete killed midway leaves the namespace marked, whole; the next one finishes it.
    let killed =
        kill_mid_call(&url, &c, &["delete", "big"], |h| h.is_none_or(|h| reserved(Some(h)) < 32 * GIB));
    let mid = records::check(&c, 2, true);
    assert!(killed && mid.namespaces["big"].deleting, "the delete was cut short");
    ns(&url, &["delete", "big"]);
    let end = records::check(&c, 2, false);
    assert!(end.namespaces.is_empty() && end.chunks_used == 0, "every chunk is back in its pool");
}
