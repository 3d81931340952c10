//! RStore heals its replicas (issue 32; docs/RSTORE.md, "Healing"): real etcd, memory servers
//! as in-process targets over file pools, the repair agent's passes driven by the test.
//!
//! - A copy whose server goes away while a segment writes is marked stale, the writes go on
//!   to the other copy (which tracks the regions they touch), and when the server comes back
//!   its copies are repaired by copying only those regions, while another writer keeps
//!   writing: the copies end byte-identical and equal to every acknowledged write.
//! - A server back in another incarnation (a RAM pool restarted empty) is repaired in full.
//! - A copy away past the grace period is rebuilt on another server, never beside another
//!   copy of its stripe, and its old chunk goes back to its pool to be zeroed.
//! - One repair leader at a time, through a key under a lease; when its lease goes, another
//!   server leads.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use coord::{CopyState, Scope, ServerInfo};
use initiator::LaneConfig;
use rstore::{agent, repair, Coordinator};
use skiff_tests::etcd::Cluster;
use skiff_tests::{start_target_with, tcp_endpoint};

const MIB: u64 = 1 << 20;
/// A 1 MiB chunk is 64 regions of 16 KiB.
const REGION: u64 = MIB / 64;
const POOL_BYTES: u64 = 16 * MIB;

/// A memory server: a target serving a file pool of 1 MiB chunks with grants, registered as
/// `s<i>`.
struct Mem {
    /// `None` once it went away.
    target: Option<server::Target>,
    info: ServerInfo,
    file: PathBuf,
}

impl Mem {
    /// Start (or start again) memory server `i` over its pool file in `dir`, in `incarnation`
    /// and `boot`.
    fn start(c: &Coordinator, dir: &Path, i: usize, incarnation: u64, boot: u64) -> Mem {
        let file = dir.join(format!("pool{i}"));
        let f = std::fs::OpenOptions::new().create(true).write(true).truncate(false).open(&file).unwrap();
        f.set_len(POOL_BYTES).unwrap();
        let key = [i as u8 + 1; 32];
        let export = format!("pool=file:{},block=1", file.display());
        let target = start_target_with(&[&export], |config| {
            config.workers = 1;
            config.exports[0].grants = Some(server::GrantConfig { key, chunk_bytes: MIB });
            // A shallow queue: a repair comparing a batch of regions (more pieces than this)
            // keeps within it, and so do segments.
            config.bounds.limits.queue_depth = 4;
        });
        let info = ServerInfo {
            id: format!("s{i}"),
            endpoint: tcp_endpoint(&target).to_string(),
            export: "pool".into(),
            scope: Scope::File,
            bytes: POOL_BYTES,
            chunk_bytes: MIB,
            incarnation,
            grant_key: coord::encode_key(&key),
            boot,
        };
        // The registration lives on in etcd after the target stops (nobody revokes it): as a
        // server killed before its lease lapses.
        c.register(&info, Duration::from_secs(60)).unwrap();
        Mem { target: Some(target), info, file }
    }

    fn pool(&self) -> Option<server::Pool> {
        self.target.as_ref().map(|t| t.pool("pool").expect("a pool"))
    }

    fn stop(&mut self) {
        self.target.take().expect("running").shutdown();
    }

    /// Bytes `at..at+len` of chunk `index` of its pool file.
    fn chunk(&self, index: u64) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; MIB as usize];
        std::fs::File::open(&self.file).unwrap().read_exact_at(&mut buf, index * MIB).unwrap();
        buf
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Every copy of every stripe of `ns`'s allocation at 0 holds what `model` says.
fn assert_copies_equal(c: &Coordinator, mems: &[Mem], ns: &str, model: &[u8]) {
    let r = c.lookup(ns, 0).unwrap();
    for (si, stripe) in r.stripes.iter().enumerate() {
        let want = &model[si * MIB as usize..(si + 1) * MIB as usize];
        for copy in stripe {
            assert_eq!(copy.state, CopyState::Ok, "stripe {si}: {copy:?}");
            let mem = mems.iter().find(|m| m.info.id == copy.server).expect("a copy on a known server");
            let got = mem.chunk(copy.index);
            let first = got.iter().zip(want).position(|(a, b)| a != b);
            assert!(first.is_none(), "stripe {si} on {}: differs from byte {first:?}", copy.server);
        }
    }
}

/// Run the agent's passes (the leader's on `c`, each source's) until no copy of `ns` is
/// syncing; returns the bytes the sources copied.
fn repair_until_whole(c: &Coordinator, mems: &[Mem], ns: &str, config: &agent::Config) -> u64 {
    let progress = agent::Progress::default();
    let stop = AtomicBool::new(false);
    for _ in 0..50 {
        agent::lead(c, config).unwrap();
        for m in mems {
            if let Some(pool) = m.pool() {
                agent::serve(c, &m.info, &pool, config, &progress, 0, &stop).unwrap();
            }
        }
        let r = c.lookup(ns, 0).unwrap();
        if r.stripes.iter().all(repair::whole) {
            return progress.bytes.load(Ordering::Relaxed);
        }
    }
    panic!("still not whole: {:?}", c.lookup(ns, 0).unwrap().stripes);
}

fn unbounded() -> agent::Config {
    agent::Config { rebuild_rate: 0, ..agent::Config::default() }
}

/// Two copies a stripe on three servers; one server goes away mid-writes and comes back with
/// its pool: only the regions written meanwhile are copied back, while a second writer keeps
/// writing, and the copies end byte-identical and equal to every acknowledged write.
#[test]
fn a_server_back_with_its_pool_is_repaired_by_copying_only_what_it_missed() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let dir = tempfile::tempdir().unwrap();
    let mut mems: Vec<Mem> = (0..3).map(|i| Mem::start(&c, dir.path(), i, 0, 1)).collect();
    c.create_ns("heal", Scope::File, MIB, 2).unwrap();
    c.reserve("heal", 4 * MIB).unwrap();
    c.alloc("heal", 4 * MIB, None).unwrap();
    let mut seg = c.map("heal", 0, &LaneConfig::default()).unwrap();
    let mut model = pattern(1, 4 * MIB as usize);
    seg.write(0, &model).unwrap();

    // s0 goes away; a 4 KiB write into region 5 of each stripe meets the loss, and goes on.
    let victim = mems[0].info.id.clone();
    let held: Vec<usize> = (0..4)
        .filter(|&s| c.lookup("heal", 0).unwrap().stripes[s].iter().any(|c| c.server == victim))
        .collect();
    assert!(!held.is_empty());
    mems[0].stop();
    for s in 0..4u64 {
        let at = (s * MIB + 5 * REGION + 100) as usize;
        let data = pattern(10 + s, 4096);
        seg.write(at as u64, &data).expect("no error reaches the caller");
        model[at..at + 4096].copy_from_slice(&data);
    }
    assert!(seg.stats().remaps >= 1 && seg.stats().reissues >= 1, "{:?}", seg.stats());
    let r = c.lookup("heal", 0).unwrap();
    for &s in &held {
        let copy = r.stripes[s].iter().find(|c| c.server == victim).unwrap();
        assert_eq!(copy.state, CopyState::Stale, "stripe {s}");
        assert_eq!(copy.dirty_on.len(), 1, "the other copy tracks what it misses: {copy:?}");
    }
    let mut all = vec![0u8; 4 * MIB as usize];
    seg.read(0, &mut all).unwrap();
    assert!(all == model, "the healthy copies hold every write");

    // s0 comes back with its pool, in a new boot: the leader starts partial repairs.
    mems[0] = Mem::start(&c, dir.path(), 0, 0, 2);
    let plan = agent::lead(&c, &unbounded()).unwrap();
    assert_eq!(plan.started, held.len(), "{plan:?}");
    let r = c.lookup("heal", 0).unwrap();
    for &s in &held {
        let copy = r.stripes[s].iter().find(|c| c.server == victim).unwrap();
        assert_eq!((copy.state, copy.full), (CopyState::Syncing, false), "stripe {s}: {copy:?}");
    }

    // A segment mapped now presents the new epoch to the servers: the first segment's map is
    // older, and its next write is refused, reads the map again, and goes to both copies.
    let fresh = c.map("heal", 0, &LaneConfig::default()).unwrap();
    let remaps = seg.stats().remaps;
    let at = held[0] as u64 * MIB + 9 * REGION;
    let data = pattern(20, 512);
    seg.write(at, &data).expect("no error reaches the caller");
    model[at as usize..at as usize + 512].copy_from_slice(&data);
    assert!(seg.stats().remaps > remaps, "{:?}", seg.stats());
    drop(fresh);

    // A second writer keeps writing while the sources copy, into and around the regions being
    // copied out (regions 4 to 6 of each stripe); the copies are paced so that they overlap.
    let shared = Arc::new(Mutex::new(model));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (shared, stop, endpoints) = (shared.clone(), stop.clone(), etcd.endpoints());
        std::thread::spawn(move || {
            let c = Coordinator::connect(&endpoints);
            let mut seg = c.map("heal", 0, &LaneConfig::default()).unwrap();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) || n < 50 {
                let len = 512 + (n * 997 % 8192) as usize;
                let at = ((n % 4) * MIB + 4 * REGION + n * 7_919 % (3 * REGION - len as u64)) as usize;
                let data = pattern(100 + n, len);
                seg.write(at as u64, &data).expect("no error reaches the writer");
                shared.lock().unwrap()[at..at + len].copy_from_slice(&data);
                n += 1;
            }
            (n, seg.stats())
        })
    };
    let paced = agent::Config { rebuild_rate: MIB, ..unbounded() };
    let copied = repair_until_whole(&c, &mems, "heal", &paced);
    stop.store(true, Ordering::Relaxed);
    let (writes, stats) = writer.join().unwrap();
    assert!(writes >= 50, "{writes} writes, {stats:?}");
    // Partial: the regions written while s0 was away (one per stripe it held), and those the
    // second writer touched before its stripe was whole; far from whole chunks.
    assert!(copied >= held.len() as u64 * REGION, "{copied} bytes copied");
    assert!(copied <= held.len() as u64 * 4 * REGION, "{copied} bytes copied: not a partial repair");
    let model = shared.lock().unwrap().clone();
    assert_copies_equal(&c, &mems, "heal", &model);
    let health = repair::Health::of(&c.join_ns("heal").unwrap(), &c.servers().unwrap());
    assert_eq!((health.label(), health.healthy), ("healthy", 4), "{health:?}");
    // And a segment mapped now reads it all back.
    let mut now = c.map("heal", 0, &LaneConfig::default()).unwrap();
    let mut all = vec![0u8; 4 * MIB as usize];
    now.read(0, &mut all).unwrap();
    assert!(all == model);
}

/// A server back in another incarnation lost its chunks' data (a RAM pool restarted): its
/// copies are repaired in full.
#[test]
fn a_server_back_in_another_incarnation_is_repaired_in_full() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let dir = tempfile::tempdir().unwrap();
    let mut mems: Vec<Mem> = (0..2).map(|i| Mem::start(&c, dir.path(), i, 7, 1)).collect();
    c.create_ns("full", Scope::File, MIB, 2).unwrap();
    c.reserve("full", 2 * MIB).unwrap();
    c.alloc("full", 2 * MIB, None).unwrap();
    let mut seg = c.map("full", 0, &LaneConfig::default()).unwrap();
    let model = pattern(3, 2 * MIB as usize);
    seg.write(0, &model).unwrap();
    mems[1].stop();
    // Back empty, in another incarnation: nothing was written meanwhile, still all of it.
    std::fs::remove_file(&mems[1].file).unwrap();
    mems[1] = Mem::start(&c, dir.path(), 1, 8, 2);
    let copied = repair_until_whole(&c, &mems, "full", &unbounded());
    assert_eq!(copied, 2 * MIB, "two whole chunks");
    assert_copies_equal(&c, &mems, "full", &model);
}

/// A copy whose server stays away past the grace period is rebuilt on a server that holds no
/// copy of its stripe, in full; the chunk it leaves goes back to its pool, dirty.
#[test]
fn a_copy_away_past_the_grace_period_is_rebuilt_elsewhere() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let dir = tempfile::tempdir().unwrap();
    let mut mems: Vec<Mem> = (0..2).map(|i| Mem::start(&c, dir.path(), i, 0, 1)).collect();
    c.create_ns("move", Scope::File, MIB, 2).unwrap();
    c.reserve("move", MIB).unwrap();
    c.alloc("move", MIB, None).unwrap();
    let mut seg = c.map("move", 0, &LaneConfig::default()).unwrap();
    let mut model = pattern(5, MIB as usize);
    seg.write(0, &model).unwrap();
    // s1 goes for good (its registration lapses); s2 joins with room.
    mems[1].stop();
    let registration = format!("/skiff/servers/{}", mems[1].info.id).into_bytes();
    c.etcd().txn(&[], &[coord::etcd::Op::Delete(registration)], &[]).unwrap();
    mems.push(Mem::start(&c, dir.path(), 2, 0, 1));
    let data = pattern(6, 1000);
    seg.write(77, &data).unwrap();
    model[77..1077].copy_from_slice(&data);
    let old = c.lookup("move", 0).unwrap().stripes[0].iter().find(|c| c.server == "s1").unwrap().clone();
    assert_eq!(old.state, CopyState::Stale);
    // Within the grace period nothing moves; past it, the copy is rebuilt on s2.
    let patient = agent::Config { rebuild_after: Duration::from_secs(3600), ..unbounded() };
    let plan = agent::lead(&c, &patient).unwrap();
    assert!(plan.relocate.is_empty() && plan.started == 0, "{plan:?}");
    let eager = agent::Config { rebuild_after: Duration::ZERO, ..unbounded() };
    let copied = repair_until_whole(&c, &mems, "move", &eager);
    assert_eq!(copied, MIB);
    let stripe = c.lookup("move", 0).unwrap().stripes[0].clone();
    let servers: Vec<&str> = stripe.iter().map(|c| c.server.as_str()).collect();
    assert_eq!(servers, ["s0", "s2"], "rebuilt on s2 in s1's place");
    assert_copies_equal(&c, &mems, "move", &model);
    assert!(c.dirty("s1").unwrap().contains(&old.index), "s1 zeroes its old chunk when it returns");
}

/// One leader at a time: the leader key is taken only when absent, under the candidate's
/// lease; when that lease is revoked (the server died), the next candidate leads.
#[test]
fn one_repair_leader_at_a_time_and_another_when_its_lease_goes() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let a = c.etcd().grant(Duration::from_secs(30)).unwrap();
    let b = c.etcd().grant(Duration::from_secs(30)).unwrap();
    assert_eq!(c.leader().unwrap(), None);
    assert!(c.campaign("a", a).unwrap());
    assert!(!c.campaign("b", b).unwrap(), "a leads");
    assert!(c.campaign("a", a).unwrap(), "and stays the leader");
    c.etcd().revoke(a).unwrap();
    assert!(c.campaign("b", b).unwrap(), "b leads once a's lease is gone");
    assert_eq!(c.leader().unwrap().as_deref(), Some("b"));
}
