//! RStore's data path (issue 12): a segment allocated through the control plane (real etcd) on
//! three memory servers (real targets), mapped and written and read across chunk boundaries,
//! each chunk landing where the map says; with two replicas, a server shut down between I/Os
//! surfaces no error and loses nothing written; with one, reads of its chunks fail clearly.

use std::time::Duration;

use coord::{CopyState, Scope, ServerInfo};
use initiator::{Lane, LaneConfig, Queue};
use rstore::{Coordinator, RAddress, Segment, SegmentMap};
use skiff_tests::etcd::Cluster;
use skiff_tests::{start_target, start_target_with, tcp_endpoint};

const MIB: u64 = 1 << 20;

/// A memory server as `skiff serve --pool` makes one: a target whose `pool` export (the one
/// export given) takes I/O only to chunks of `chunk` bytes granted under `key`.
fn pool_target(export: &str, chunk: u64, key: [u8; 32]) -> server::Target {
    start_target_with(&[export], |config| {
        config.workers = 1;
        config.exports[0].grants = Some(server::GrantConfig { key, chunk_bytes: chunk });
    })
}

/// Register target `t`'s 16 MiB `pool` export as a memory server of `chunk`-byte chunks whose
/// grants are sealed under `key`.
fn register(
    c: &Coordinator,
    t: &server::Target,
    chunk: u64,
    incarnation: u64,
    key: [u8; 32],
) -> rstore::Registration {
    let endpoint = tcp_endpoint(t).to_string();
    let info = ServerInfo {
        id: endpoint.clone(),
        endpoint,
        export: "pool".into(),
        scope: Scope::Ram,
        bytes: 16 * MIB,
        chunk_bytes: chunk,
        incarnation,
        grant_key: coord::encode_key(&key),
        boot: incarnation,
    };
    c.register(&info, Duration::from_secs(30)).unwrap()
}

/// A memory server's pool export, at a one-byte block as `skiff serve --pool` serves it.
const POOL: &str = "pool=ram:16M,block=1";

/// Three targets with a 16 MiB pool each, registered with the coordinator.
fn servers(c: &Coordinator) -> (Vec<server::Target>, Vec<rstore::Registration>) {
    servers_of(c, POOL)
}

fn servers_of(c: &Coordinator, export: &str) -> (Vec<server::Target>, Vec<rstore::Registration>) {
    let key = |i: usize| [i as u8 + 1; 32];
    let targets: Vec<server::Target> = (0..3).map(|i| pool_target(export, MIB, key(i))).collect();
    let regs = targets.iter().enumerate().map(|(i, t)| register(c, t, MIB, 100 + i as u64, key(i))).collect();
    (targets, regs)
}

/// Namespace `name` of `chunk`-byte chunks and `replicas` copies, with `bytes` reserved and
/// allocated at its first address.
fn allocate(c: &Coordinator, name: &str, chunk: u64, replicas: u32, bytes: u64) -> RAddress {
    c.create_ns(name, Scope::Ram, chunk, replicas).unwrap();
    c.reserve(name, bytes).unwrap();
    c.alloc(name, bytes, None).unwrap()
}

/// A lane's configuration that presents `loc`'s grant, to look at a chunk on its server.
fn granted(loc: &rstore::Location) -> LaneConfig {
    LaneConfig { grants: loc.grant.into_iter().collect(), ..LaneConfig::default() }
}

fn segment_map(c: &Coordinator, r: &RAddress) -> SegmentMap {
    skiff_tests::rstore::segment_map(c, &r.ns, r.addr)
}

fn pattern(seed: u64, at: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| ((at + i).wrapping_mul(2_654_435_761) >> 13 ^ seed) as u8).collect()
}

/// Write the whole segment in `io`-byte pieces that straddle chunk boundaries, in round `seed`.
fn fill(seg: &mut Segment, seed: u64, io: usize) {
    let mut at = 0;
    while at < seg.len() {
        let n = io.min((seg.len() - at) as usize);
        seg.write(at, &pattern(seed, at, n)).unwrap_or_else(|e| panic!("write at {at}: {e}"));
        at += n as u64;
    }
}

fn check(seg: &mut Segment, seed: u64, io: usize) {
    let mut at = 0;
    while at < seg.len() {
        let n = io.min((seg.len() - at) as usize);
        let mut buf = vec![0u8; n];
        seg.read(at, &mut buf).unwrap_or_else(|e| panic!("read at {at}: {e}"));
        assert!(buf == pattern(seed, at, n), "round {seed}: bytes at {at} read back wrong");
        at += n as u64;
    }
}

#[test]
fn a_segment_is_striped_over_its_servers_and_reads_back() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let (_targets, _regs) = servers(&c);
    let r = allocate(&c, "data", MIB, 1, 6 * MIB);
    let map = segment_map(&c, &r);
    let mut seg = Segment::map(map.clone(), &LaneConfig::default()).unwrap();
    // 192 KiB pieces: every sixth or so straddles two chunks, on two servers.
    fill(&mut seg, 1, 192 << 10);
    check(&mut seg, 1, 96 << 10);
    assert!(seg.read(6 * MIB, &mut [0u8; 512]).is_err(), "I/O past the end is refused");
    // Each chunk's bytes are on the server and at the offset the map names.
    for (i, copies) in map.stripes.iter().enumerate() {
        let loc = &copies[0];
        let mut lane = Lane::connect(&loc.endpoint, &loc.export, &granted(loc)).unwrap();
        lane.submit_read(loc.offset, vec![0; 4096], 0).unwrap();
        let mut out = Vec::new();
        lane.wait(1, &mut out).unwrap();
        assert!(
            out[0].buf.as_deref() == Some(&pattern(1, i as u64 * MIB, 4096)[..]),
            "stripe {i} is not where the map says"
        );
    }
    let servers: std::collections::HashSet<_> =
        map.stripes.iter().map(|s| s[0].endpoint.to_string()).collect();
    assert_eq!(servers.len(), 3, "six chunks over three servers");
    assert_eq!(seg.stats().servers_failed, 0);
}

#[test]
fn with_two_replicas_a_server_shut_down_while_mapped_costs_no_error_and_no_data() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let (mut targets, _regs) = servers(&c);
    let r = allocate(&c, "safe", MIB, 2, 6 * MIB);
    let mut seg = Segment::map(segment_map(&c, &r), &LaneConfig::default()).unwrap();
    fill(&mut seg, 1, 256 << 10);
    // One server goes while writes run (from another thread, a few milliseconds in): what it
    // held is on the others too, and no write reports an error.
    let gone = targets.remove(1);
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(5));
        gone.shutdown();
    });
    for round in 10..20 {
        fill(&mut seg, round, 256 << 10);
    }
    stopper.join().unwrap();
    check(&mut seg, 19, 128 << 10);
    fill(&mut seg, 1, 256 << 10);
    check(&mut seg, 1, 128 << 10);
    fill(&mut seg, 2, 320 << 10);
    check(&mut seg, 2, 64 << 10);
    let s = seg.stats();
    assert_eq!(s.servers_failed, 1, "{s:?}");
    assert_eq!(seg.failed().len(), 1);
    // Whether a write or a read met the failure first depends on when the shutdown landed;
    // either way every byte above read back from the copies left.
    eprintln!("after losing a server mid-run: {s:?}");
}

#[test]
fn with_one_copy_the_chunks_of_a_lost_server_fail_clearly() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let (mut targets, _regs) = servers(&c);
    let r = allocate(&c, "bare", MIB, 1, 3 * MIB);
    let map = segment_map(&c, &r);
    let mut seg = Segment::map(map.clone(), &LaneConfig::default()).unwrap();
    fill(&mut seg, 1, MIB as usize);
    let victim = map.stripes[1][0].endpoint.to_string();
    let i = targets.iter().position(|t| tcp_endpoint(t).to_string() == victim).unwrap();
    targets.remove(i).shutdown();
    let mut buf = vec![0u8; MIB as usize];
    seg.read(0, &mut buf).expect("stripe 0 is on a live server");
    let err = seg.read(MIB, &mut buf).expect_err("stripe 1's only copy is gone");
    assert!(err.to_string().contains("out of service"), "{err}");
}

/// I/O larger than what one request may carry (a 4 MiB chunk, a target's 1 MiB limit) is
/// split into requests the servers take, and a request a server refuses for what it asked
/// fails alone: the server stays in service.
#[test]
fn large_io_is_split_to_the_servers_limit_and_a_refusal_takes_no_server_out() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let t = pool_target(POOL, 4 * MIB, [7; 32]);
    let _reg = register(&c, &t, 4 * MIB, 7, [7; 32]);
    let r = allocate(&c, "big", 4 * MIB, 1, 8 * MIB);
    let mut seg = Segment::map(segment_map(&c, &r), &LaneConfig::default()).unwrap();
    let data = pattern(3, 0, 8 * MIB as usize);
    seg.write(0, &data).unwrap();
    let mut back = vec![0u8; 8 * MIB as usize];
    seg.read(0, &mut back).unwrap();
    assert!(back == data, "8 MiB in one call reads back");
    assert_eq!(seg.stats().servers_failed, 0);
    assert!(seg.stats().requests >= 16, "split into requests of at most 1 MiB: {:?}", seg.stats());

    // A map whose second stripe lies past the end of the export: the server refuses that
    // read (out of range), the read fails with that status, and the server stays in service.
    let mut bad = segment_map(&c, &r);
    bad.stripes[1][0].offset = 16 * MIB;
    let mut seg = Segment::map(bad, &LaneConfig::default()).unwrap();
    let err = seg.read(4 * MIB, &mut vec![0u8; 2 * MIB as usize]).expect_err("past the export's end");
    assert!(matches!(err, initiator::Error::Status(initiator::Status::OutOfRange)), "{err}");
    assert_eq!(seg.stats().servers_failed, 0, "a refused request takes no server out");
    seg.read(0, &mut vec![0u8; MIB as usize]).expect("the server still serves the first stripe");
}

/// A server a mapped segment loses may miss the writes that follow: the control plane marks
/// its copies of the allocation stale, a segment mapped afterwards leaves them out, and reads
/// the latest data from the copies that have it. With one replica nothing is marked: the lost
/// copy is the only one there is.
#[test]
fn a_lost_replica_is_marked_stale_and_not_mapped_again() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let (mut targets, _regs) = servers(&c);
    allocate(&c, "twice", MIB, 2, 6 * MIB);
    allocate(&c, "once", MIB, 1, 3 * MIB);
    let mut twice = c.map("twice", 0, &LaneConfig::default()).unwrap();
    let mut once = c.map("once", 0, &LaneConfig::default()).unwrap();
    fill(&mut twice, 1, 256 << 10);
    fill(&mut once, 1, MIB as usize);

    let victim = tcp_endpoint(&targets[0]).to_string();
    targets.remove(0).shutdown();
    // The next round of writes meets the loss.
    fill(&mut twice, 2, 256 << 10);
    // Every stripe of "once", the lost server's too: that write fails, and the server is out.
    assert!(once.write(0, &vec![0u8; 3 * MIB as usize]).is_err());
    assert_eq!(once.stats().servers_failed, 1);
    let states = |name: &str| -> Vec<(String, CopyState)> {
        let r = c.lookup(name, 0).unwrap();
        r.stripes
            .iter()
            .flatten()
            .filter(|c| c.server == victim)
            .map(|c| (c.server.clone(), c.state))
            .collect()
    };
    let twice_states = states("twice");
    assert!(
        !twice_states.is_empty() && twice_states.iter().all(|(_, s)| *s == CopyState::Stale),
        "marked stale: {twice_states:?}"
    );
    assert!(states("once").iter().all(|(_, s)| *s == CopyState::Ok), "the only copies are not marked");

    // Mapped again: the stale copies are left out even though the server's id is still
    // registered (its lease has not lapsed), and the reads see round 2.
    let map = segment_map(&c, &c.lookup("twice", 0).unwrap());
    assert!(map.stripes.iter().flatten().all(|l| l.endpoint.to_string() != victim));
    let mut again = c.map("twice", 0, &LaneConfig::default()).unwrap();
    check(&mut again, 2, 128 << 10);
}

/// On pools of a one-byte block, I/O goes at any byte offset and length with no
/// read-modify-write: bytes that straddle a chunk boundary land on both servers, and
/// one-byte writes of many threads to neighbouring bytes (RStore's flags) never undo each
/// other. Each byte only grows, as read by a thread polling them all, so no read saw a torn
/// or stale-then-new value. Against exports of 512-byte blocks the segment refuses unaligned
/// I/O instead.
#[test]
fn one_byte_writes_of_many_threads_to_neighbouring_bytes_all_land() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let (_targets, _regs) = servers(&c);
    let r = allocate(&c, "flags", MIB, 2, 2 * MIB);
    let map = segment_map(&c, &r);
    let mut seg = Segment::map(map.clone(), &LaneConfig::default()).unwrap();
    assert_eq!(seg.block_bytes(), 1);

    // Five bytes across the boundary of chunks 0 and 1 (two servers), then single bytes.
    let edge = MIB - 2;
    seg.write(edge, b"abcde").unwrap();
    let mut back = [0u8; 7];
    seg.read(edge - 1, &mut back).unwrap();
    assert_eq!(&back, b"\0abcde\0");
    seg.write(MIB, b"X").unwrap();
    let mut one = [0u8; 1];
    seg.read(MIB - 1, &mut one).unwrap();
    assert_eq!(&one, b"b", "the byte beside the one written is untouched");

    // Eight writers, each counting its own byte of one sector up to ROUNDS, one write at a
    // time; a reader polls the whole sector meanwhile.
    const WRITERS: usize = 8;
    const ROUNDS: u8 = 250;
    let base = 4096u64;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let map = map.clone();
            std::thread::spawn(move || {
                let mut seg = Segment::map(map, &LaneConfig::default()).unwrap();
                for v in 1..=ROUNDS {
                    seg.write(base + w as u64 * 3, &[v]).unwrap();
                }
            })
        })
        .collect();
    let reader = {
        let (map, stop) = (map.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seg = Segment::map(map, &LaneConfig::default()).unwrap();
            let mut seen = [0u8; WRITERS];
            let mut polls = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for (w, last) in seen.iter_mut().enumerate() {
                    let mut b = [0u8; 1];
                    seg.read(base + w as u64 * 3, &mut b).unwrap();
                    assert!(b[0] >= *last, "writer {w}'s byte went back from {last} to {}", b[0]);
                    *last = b[0];
                }
                polls += 1;
            }
            polls
        })
    };
    for w in writers {
        w.join().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let polls = reader.join().unwrap();
    let mut sector = vec![0u8; 512];
    seg.read(base, &mut sector).unwrap();
    for w in 0..WRITERS {
        assert_eq!(sector[w * 3], ROUNDS, "writer {w}'s last write was lost");
        assert_eq!(&sector[w * 3 + 1..w * 3 + 3], &[0, 0], "the bytes between the flags are untouched");
    }
    // Both replicas of the sector hold the same flags.
    for loc in &map.stripes[0] {
        let mut lane = Lane::connect(&loc.endpoint, &loc.export, &granted(loc)).unwrap();
        lane.submit_read(loc.offset + base, vec![0; 512], 0).unwrap();
        let mut out = Vec::new();
        lane.wait(1, &mut out).unwrap();
        assert!(out[0].buf.as_deref() == Some(&sector[..]), "replica {} differs", loc.endpoint);
    }
    eprintln!("{WRITERS} writers x {ROUNDS} one-byte writes; the reader polled {polls} times");

    // Servers of 512-byte blocks: the segment refuses what they would.
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let (_targets, _regs) = servers_of(&c, "pool=ram:16M");
    let r = allocate(&c, "sectors", MIB, 1, MIB);
    let mut seg = Segment::map(segment_map(&c, &r), &LaneConfig::default()).unwrap();
    assert_eq!(seg.block_bytes(), 512);
    let err = seg.read(5, &mut [0u8; 512]).expect_err("unaligned I/O is refused");
    assert!(err.to_string().contains("block"), "{err}");
    seg.read(512, &mut [0u8; 512]).expect("aligned I/O goes");
}

/// Read `len` bytes at `offset` on `lane`: the completion's status.
fn read_status(lane: &mut Lane, offset: u64, len: usize) -> initiator::Status {
    lane.submit_read(offset, vec![0; len], 0).unwrap();
    let mut out = Vec::new();
    lane.wait(1, &mut out).unwrap();
    out[0].status
}

/// A pool's chunks are reached only with grants (docs/PROTOCOL.md, section 14.6): a connection
/// without one is refused every chunk; a forged grant, or one for another export, is refused
/// when presented; a grant opens its own chunk and no other. Once the server retires a chunk
/// (before zeroing it for the next namespace), a segment mapped earlier is refused with
/// `StaleCapability` and writes nothing into the next owner's bytes, while a segment mapped
/// afterwards, with the new generation, works.
#[test]
fn chunks_are_reached_with_grants_and_a_retired_chunk_refuses_its_last_owner() {
    use initiator::Status;
    use wire::CapRights;
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let key = [42; 32];
    let t = pool_target(POOL, MIB, key);
    let _reg = register(&c, &t, MIB, 9, key);
    let pool = tcp_endpoint(&t);
    let rw = CapRights::READ.union(CapRights::WRITE);
    let sealer = proto::capability::CapKey::new(key);

    // No grant: every chunk is refused, and the connection stays up.
    let mut bare = Lane::connect(&pool, "pool", &LaneConfig::default()).unwrap();
    assert_eq!(read_status(&mut bare, 0, 4096), Status::BadCapability);
    assert_eq!(read_status(&mut bare, 5 * MIB, 1), Status::BadCapability);
    assert!(bare.flush().is_err(), "nor may it make the server sync the pool");
    // A forged grant is refused when presented.
    let forged = proto::grant::seal(&proto::capability::CapKey::new([1; 32]), 0, MIB, 0, rw);
    let with = |grants: Vec<wire::Capability>| LaneConfig { grants: grants.into(), ..LaneConfig::default() };
    let err = Lane::connect(&pool, "pool", &with(vec![forged])).err().expect("a forged grant");
    assert!(matches!(err, initiator::Error::Refused(Status::BadCapability)), "{err}");
    // A grant for chunk 2 opens chunk 2 alone; a request that straddles into chunk 3 is not
    // covered. A read-only grant does not write.
    let mut two =
        Lane::connect(&pool, "pool", &with(vec![proto::grant::seal(&sealer, 2, MIB, 0, rw)])).unwrap();
    assert_eq!(read_status(&mut two, 2 * MIB + 7, 100), Status::Ok);
    assert_eq!(read_status(&mut two, MIB, 512), Status::BadCapability);
    assert_eq!(read_status(&mut two, 3 * MIB - 1, 2), Status::BadCapability);
    two.flush().expect("a connection holding a grant may flush");
    let ro = proto::grant::seal(&sealer, 4, MIB, 0, CapRights::READ);
    let mut reader = Lane::connect(&pool, "pool", &with(vec![ro])).unwrap();
    assert_eq!(read_status(&mut reader, 4 * MIB, 512), Status::Ok);
    assert!(reader.write_at(&[1; 512], 4 * MIB).is_err(), "a read grant does not write");
    // Grants are for pools: an ordinary export refuses them.
    let plain = start_target(&["vol=ram:1M"], 1);
    let err = Lane::connect(&tcp_endpoint(&plain), "vol", &with(vec![ro])).err().expect("no pool there");
    assert!(matches!(err, initiator::Error::Refused(Status::Unsupported)), "{err}");

    // A namespace maps with grants; the server retires its chunks when they come back.
    allocate(&c, "first", MIB, 1, 2 * MIB);
    let mut old = c.map("first", 0, &LaneConfig::default()).unwrap();
    old.write(0, &vec![0xAA; 2 * MIB as usize]).unwrap();
    c.delete_ns("first").unwrap();
    let served = t.pool("pool").expect("a pool");
    let retired = served.retire(&c.dirty(&pool.to_string()).unwrap());
    assert_eq!(retired.len(), 2);
    let err = old.write(0, &[0xEE; 512]).expect_err("the last owner's grant is stale");
    assert!(matches!(err, initiator::Error::Status(Status::StaleCapability)), "{err}");
    assert_eq!(old.stats().servers_failed, 0, "a refusal takes no server out");
    // (The server zeroes here, through grants of its own; then hands the chunks back.)
    for &(chunk, _) in &retired {
        let mut own =
            Lane::connect(&pool, "pool", &with(vec![served.grants().mint(chunk, rw).unwrap()])).unwrap();
        own.submit_write_zeroes(chunk * MIB, MIB as u32, initiator::ReqFlags::empty(), 0).unwrap();
        let mut out = Vec::new();
        own.wait(1, &mut out).unwrap();
        assert_eq!(out[0].status, Status::Ok);
    }
    c.cleaned(&pool.to_string(), &retired).unwrap();
    allocate(&c, "next", MIB, 1, 2 * MIB);
    let mut new = c.map("next", 0, &LaneConfig::default()).unwrap();
    let mut back = vec![1u8; 2 * MIB as usize];
    new.read(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0), "the next namespace reads zeroes");
    assert!(old.write(MIB, &[0xEE; 512]).is_err(), "still stale");
    new.write(0, b"mine").unwrap();
    let mut four = [0u8; 4];
    new.read(0, &mut four).unwrap();
    assert_eq!(&four, b"mine");
}

/// What a pool's target does with bad GRANT frames, on the wire: a grant for a handle never
/// opened is refused `BadHandle`; a GRANT whose second grant is forged is refused naming it, and
/// binds none, not even the good first one; the connection goes on after both. A GRANT whose
/// count does not match its length is a framing error: GOAWAY `Invalid`, and the target closes.
#[test]
fn bad_grant_frames_are_refused_and_bind_nothing() {
    use skiff_tests::{caravan, RawPeer};
    use wire::{CapRights, FrameKind, GoAway, Grant, GrantReply, Opcode, ReqFlags, Request, Status};
    let key = [9; 32];
    let t = pool_target(POOL, MIB, key);
    let rw = CapRights::READ.union(CapRights::WRITE);
    let good = proto::grant::seal(&proto::capability::CapKey::new(key), 2, MIB, 0, rw);
    let forged = proto::grant::seal(&proto::capability::CapKey::new([8; 32]), 3, MIB, 0, rw);
    let (mut peer, handle) = RawPeer::ready(&t, wire::Limits::default(), "pool");
    let grant = |peer: &mut RawPeer, g: Grant| {
        peer.send(&wire::control::frame(FrameKind::Grant, &g.encode()));
        let (h, body) = peer.recv().expect("a reply");
        assert_eq!(h.kind, FrameKind::GrantReply);
        GrantReply::decode(&body).unwrap()
    };
    let reply = grant(&mut peer, Grant { handle: handle + 7, caps: vec![good] });
    assert_eq!(reply, GrantReply { status: Status::BadHandle, refused: 0 });
    let reply = grant(&mut peer, Grant { handle, caps: vec![good, forged] });
    assert_eq!(reply, GrantReply { status: Status::BadCapability, refused: 1 });
    // The good grant of the refused frame was not bound: its chunk is still refused.
    let read = Request {
        opcode: Opcode::Read,
        flags: ReqFlags::empty(),
        tag: 1,
        handle,
        offset: 2 * MIB,
        length: 512,
    };
    peer.send(&caravan(&[read], &[]));
    let (h, body) = peer.recv().expect("a completion");
    assert_eq!(h.kind, FrameKind::Completions);
    let done = wire::caravan::CompletionCaravan::parse(&h, &body).unwrap();
    assert_eq!(done.iter().next().unwrap().0.status, Status::BadCapability);
    // Presented alone, it is bound and the read goes.
    assert_eq!(grant(&mut peer, Grant { handle, caps: vec![good] }).status, Status::Ok);
    peer.send(&caravan(&[read], &[]));
    let (h, body) = peer.recv().expect("a completion");
    let done = wire::caravan::CompletionCaravan::parse(&h, &body).unwrap();
    assert_eq!(done.iter().next().unwrap().0.status, Status::Ok);
    // A count that lies about the length breaks the framing.
    let mut lying = Grant { handle, caps: vec![good] }.encode();
    lying[4] = 2;
    peer.send(&wire::control::frame(FrameKind::Grant, &lying));
    let (h, body) = peer.recv().expect("a GOAWAY");
    assert_eq!(h.kind, FrameKind::GoAway);
    assert_eq!(GoAway::decode(&body).unwrap().status, Status::Invalid);
    assert!(peer.closed());
}

/// A segment that threads share: eight threads, each with its own handle on one segment (one
/// lane to each server), write and read back their own bytes, blocking and with requests in
/// flight through the handle's queue; every byte lands and reads back, completions reach the
/// handle that sent them with its user data, and the segment's lanes are the one set.
#[test]
fn threads_share_a_segment_through_handles() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let (_targets, _regs) = servers(&c);
    allocate(&c, "shared", MIB, 2, 9 * MIB);
    let shared = rstore::SharedSegment::new(c.map("shared", 0, &LaneConfig::default()).unwrap());
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let mut h = shared.handle().unwrap();
                // Its own 512 KiB: for odd threads across a chunk boundary, so two stripes.
                let base = t * MIB + if t % 2 == 1 { 3 * MIB / 4 } else { MIB / 4 };
                for round in 0..20u64 {
                    let data = pattern(t * 100 + round, 0, 32 << 10);
                    let at = base + (round % 16) * (32 << 10);
                    h.write(at, &data).unwrap();
                    let mut back = vec![0u8; 32 << 10];
                    h.read(at, &mut back).unwrap();
                    assert!(back == data, "thread {t} round {round}");
                }
                // Four in flight through the queue, each with its own user data.
                let mut out = Vec::new();
                for i in 0..4u64 {
                    let data = pattern(t * 1000 + i, 0, 4096);
                    h.submit(
                        wire::Opcode::Write,
                        initiator::ReqFlags::empty(),
                        base + i * 4096,
                        4096,
                        Some(data),
                        i,
                    )
                    .map_err(|r| r.error)
                    .unwrap();
                }
                while out.len() < 4 {
                    h.wait(1, &mut out).unwrap();
                }
                let mut seen: Vec<u64> = out.iter().map(|c| c.user_data).collect();
                seen.sort_unstable();
                assert_eq!(seen, [0, 1, 2, 3], "thread {t}: its own completions");
                assert!(out.iter().all(|c| c.status == initiator::Status::Ok));
                for i in 0..4u64 {
                    let mut back = vec![0u8; 4096];
                    h.read(base + i * 4096, &mut back).unwrap();
                    assert!(back == pattern(t * 1000 + i, 0, 4096), "thread {t} queued write {i}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stats = shared.stats();
    assert!(stats.writes >= 8 * 24 && stats.reads >= 8 * 24, "{stats:?}");
}

/// A coordinator keeps the maps it resolved (thesis 6.3.2), shared with the clients made from
/// it: a second map of an allocation reuses the map while the allocation's record is unchanged,
/// and one freed and made again at the same address (other chunks) is resolved afresh, so its
/// writes land in the new chunks, never in the old ones.
#[test]
fn a_cached_map_serves_while_its_allocation_stands_and_never_after() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let (_targets, _regs) = servers(&c);
    c.create_ns("cached", Scope::Ram, MIB, 1).unwrap();
    c.reserve("cached", 6 * MIB).unwrap();
    let first = c.alloc("cached", 3 * MIB, Some(0)).unwrap();
    assert!(!c.map_cached("cached", 0));
    let mut seg = c.map("cached", 0, &LaneConfig::default()).unwrap();
    fill(&mut seg, 1, 64 << 10);
    drop(seg);
    let other = c.again();
    assert!(c.map_cached("cached", 0) && other.map_cached("cached", 0), "kept, and shared with again()");
    let mut seg = other.map("cached", 0, &LaneConfig::default()).unwrap();
    check(&mut seg, 1, 64 << 10);
    drop(seg);

    // Freed, and the address bound again to other slots (the reserve's first three, which the
    // first allocation did not hold), by another client that shares no cache.
    let stranger = Coordinator::connect(&etcd.endpoints());
    stranger.free("cached", 0).unwrap();
    let taken = stranger.alloc("cached", 3 * MIB, Some(MIB * 16)).unwrap();
    let second = stranger.alloc("cached", 3 * MIB, Some(0)).unwrap();
    assert_ne!(second.stripes, first.stripes, "the address names other chunks now");
    assert_eq!(taken.stripes, first.stripes, "the old chunks went to the other address");
    assert!(c.map_cached("cached", 0), "the cache has not heard");
    let mut seg = c.map("cached", 0, &LaneConfig::default()).unwrap();
    fill(&mut seg, 2, 64 << 10);
    drop(seg);
    // The old chunks (now at 16 MiB) still hold round 1: nothing went to them through the
    // cached map.
    let mut old = stranger.map("cached", MIB * 16, &LaneConfig::default()).unwrap();
    check(&mut old, 1, 64 << 10);
    let mut new = stranger.map("cached", 0, &LaneConfig::default()).unwrap();
    check(&mut new, 2, 64 << 10);
    c.free("cached", 0).unwrap();
    assert!(!c.map_cached("cached", 0), "a client's own free forgets its map");
}

/// Connections are kept across mappings (thesis 6.3.2): a segment unmapped leaves its idle
/// lanes to its coordinator, and the next segment mapped to the same servers presents its own
/// grants on them and makes no connection; it reaches its own chunks through them, the first
/// allocation's bytes are untouched, and a kept lane holding a chunk's grant of an earlier
/// generation reaches that chunk no more. A server shut down while its lane was kept costs
/// the next mapping nothing (two copies): the lane fails its grants, a new connection fails,
/// and the segment heals around the server.
#[test]
fn unmapped_segments_leave_their_connections_to_the_next_mapping() {
    use initiator::Status;
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let (mut targets, _regs) = servers(&c);
    let accepted = |ts: &[server::Target]| -> u64 {
        ts.iter().map(|t| t.stats().get("connections_accepted").unwrap()).sum()
    };
    c.create_ns("conns", Scope::Ram, MIB, 2).unwrap();
    c.reserve("conns", 12 * MIB).unwrap();
    let first = c.alloc("conns", 3 * MIB, Some(0)).unwrap();
    let second = c.alloc("conns", 3 * MIB, Some(8 * MIB)).unwrap();
    let servers_of = |r: &RAddress| -> std::collections::BTreeSet<String> {
        r.stripes.iter().flatten().map(|copy| copy.server.clone()).collect()
    };
    let mut seg = c.map("conns", 0, &LaneConfig::default()).unwrap();
    fill(&mut seg, 1, 64 << 10);
    drop(seg);
    let s0 = c.connections().stats();
    assert_eq!((s0.opened, s0.reused, s0.idle), (servers_of(&first).len() as u64, 0, s0.opened), "{s0:?}");
    let before = accepted(&targets);

    // Another allocation, mapped by another client of the coordinator: its lanes are the kept
    // ones, the servers accept no connection.
    let mut seg = c.again().map("conns", 8 * MIB, &LaneConfig::default()).unwrap();
    fill(&mut seg, 2, 64 << 10);
    check(&mut seg, 2, 64 << 10);
    let lanes = seg.lane_stats();
    drop(seg);
    let s1 = c.connections().stats();
    let shared = servers_of(&first).intersection(&servers_of(&second)).count() as u64;
    assert!(shared > 0, "the two allocations share a server");
    assert_eq!(s1.reused, shared, "{s1:?}");
    assert_eq!(s1.opened, s0.opened + servers_of(&second).len() as u64 - shared, "{s1:?}");
    assert_eq!(accepted(&targets), before + s1.opened - s0.opened, "no connection for a kept lane");
    // Two copies written, one read: 48 writes of 64 KiB twice, 48 reads.
    assert_eq!(lanes.completed, 3 * (3 * MIB / (64 << 10)), "a kept lane counts only this mapping's work");
    let mut seg = c.map("conns", 0, &LaneConfig::default()).unwrap();
    check(&mut seg, 1, 64 << 10);
    drop(seg);
    let s2 = c.connections().stats();
    assert_eq!(s2.opened, s1.opened, "every server had a kept lane: {s2:?}");

    // The first allocation's chunks retired on a server: a kept lane to it holds their old
    // grants and reaches them no more.
    let copy = &first.stripes[0][0];
    let t = targets.iter().find(|t| tcp_endpoint(t).to_string() == copy.server).expect("the copy's server");
    t.pool("pool").unwrap().retire(&[copy.index]);
    let mut kept = c
        .connections()
        .open(
            &tcp_endpoint(t),
            "pool",
            &LaneConfig { reconnect: initiator::ReconnectConfig::OFF, ..LaneConfig::default() },
        )
        .unwrap();
    assert_eq!(c.connections().stats().reused, s2.reused + 1, "the lane is a kept one");
    assert_eq!(read_status(&mut kept, copy.index * MIB, 512), Status::StaleCapability);
    drop(kept);

    // A server shut down while its lane is kept: the second allocation maps and serves all
    // the same, from its other copies.
    let gone = second.stripes[0][0].server.clone();
    let i = targets.iter().position(|t| tcp_endpoint(t).to_string() == gone).unwrap();
    targets.remove(i).shutdown();
    let mut seg = c.map("conns", 8 * MIB, &LaneConfig::default()).unwrap();
    check(&mut seg, 2, 64 << 10);
    assert!(seg.failed().iter().all(|f| f.starts_with(&gone)), "{:?}", seg.failed());
}

/// A kept lane that its server closed for its silence (a `GOAWAY` read only at the next
/// mapping's `GRANT`) is replaced by a new connection: the server is not reported lost, its
/// only copy is not marked stale, and the mapping reads back what was written.
#[test]
fn a_kept_lane_its_server_closed_for_silence_is_replaced_not_reported() {
    let etcd = Cluster::start(1);
    let c = Coordinator::connect(&etcd.endpoints());
    let key = [5; 32];
    let t = start_target_with(&[POOL], |config| {
        config.workers = 1;
        config.exports[0].grants = Some(server::GrantConfig { key, chunk_bytes: MIB });
        config.bounds.idle_timeout = Duration::from_millis(300);
    });
    let _reg = register(&c, &t, MIB, 1, key);
    allocate(&c, "quiet", MIB, 1, 2 * MIB);
    let mut seg = c.map("quiet", 0, &LaneConfig::default()).unwrap();
    fill(&mut seg, 7, 64 << 10);
    drop(seg);
    assert_eq!(c.connections().stats().idle, 1);
    // The server closes the kept connection, with a GOAWAY, while it waits.
    let start = std::time::Instant::now();
    while t.stats().get("idle_timeouts") != Some(1) {
        assert!(start.elapsed() < Duration::from_secs(30), "the server never closed the kept lane");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut seg = c.map("quiet", 0, &LaneConfig::default()).unwrap();
    check(&mut seg, 7, 64 << 10);
    assert_eq!(seg.stats().servers_failed, 0, "{:?}", seg.stats());
    let s = c.connections().stats();
    assert_eq!((s.opened, s.reused), (2, 0), "a new connection in place of the closed one: {s:?}");
    let r = c.lookup("quiet", 0).unwrap();
    assert!(r.stripes.iter().flatten().all(|copy| copy.state == CopyState::Ok), "{:?}", r.stripes);
}
