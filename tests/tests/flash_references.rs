//! References to flash volume ranges (FlashNet's lazy registration, issue 29) through a real
//! target: registering any size reads, allocates and pins nothing; direct reads under an
//! extent on a cold volume park on pool misses instead of faulting, so the caller never sees a
//! fault; and a reference dies with its volume, a shrink or an epoch rotation, never serving
//! another volume's bytes; with a reference file, references outlive the target, and
//! revocations too. Writes under an extent with the write right go direct too, FUA
//! ones made durable before they complete.

use std::time::Duration;

use initiator::{Client, Endpoint, Lane, LaneConfig, Queue, VolumeBody, VolumeOp, VolumeRequest};
use server::{FlashConfig, Target};
use skiff_tests::{caravan, flash_array, start_target_with, tcp_endpoint, RawPeer};
use wire::caravan::CompletionCaravan;
use wire::control::FEATURE_DIRECT_READS;
use wire::{CapKind, Capability, FrameKind, Limits, Opcode, ReqFlags, Request, Status};

fn start(devices: &[std::path::PathBuf], exports: &[&str]) -> Target {
    start_keeping(devices, exports, None)
}

/// A target over the array, keeping its references in `references` when given.
fn start_keeping(
    devices: &[std::path::PathBuf],
    exports: &[&str],
    references: Option<std::path::PathBuf>,
) -> Target {
    start_target_with(exports, |c| {
        c.flash = Some(FlashConfig {
            devices: devices.to_vec(),
            pool_bytes: 4 << 20,
            map_bytes: server::FLASH_MAP_BYTES_DEFAULT,
            read_depth: server::FLASH_READ_DEPTH_DEFAULT,
            references,
            rstore_pool: None,
        });
    })
}

fn volume(client: &mut Client, op: VolumeOp, name: &str, size_bytes: u64) {
    let reply =
        client.volume(&VolumeRequest { op, name: name.into(), origin: String::new(), size_bytes }).unwrap();
    assert_eq!(reply.status, Status::Ok, "{op:?} {name}: {}", reply.message);
}

fn flash_stats(client: &mut Client) -> Vec<(String, u64)> {
    let reply = client.volume(&VolumeRequest::bare(VolumeOp::Stats)).unwrap();
    let VolumeBody::Stats(stats) = reply.body else { panic!("{reply:?}") };
    stats.entries
}

fn flash_stat(client: &mut Client, name: &str) -> u64 {
    flash_stats(client).into_iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no {name}")).1
}

fn direct_lane(ep: &Endpoint, export: &str) -> Lane {
    let config =
        LaneConfig { directory_entries: 64, timeout: Duration::from_secs(30), ..LaneConfig::default() };
    Lane::connect(ep, export, &config).unwrap()
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len).map(|i| ((i / 4096) as u32 ^ seed).wrapping_mul(2_654_435_761).to_le_bytes()[i % 4]).collect()
}

fn register_raw(
    peer: &mut RawPeer,
    handle: u32,
    rights: wire::CapRights,
    offset: u64,
    length: u64,
) -> wire::RegisterReply {
    let body = wire::Register { handle, rights, offset, length }.encode();
    peer.send(&wire::control::frame(FrameKind::Register, &body));
    let (h, body) = peer.recv().expect("a REGISTER_REPLY");
    assert_eq!(h.kind, FrameKind::RegisterReply);
    wire::RegisterReply::decode(&body).unwrap()
}

fn direct(peer: &mut RawPeer, handle: u32, cap: &Capability, offset: u64, length: u32) -> (Status, Vec<u8>) {
    let req =
        Request { opcode: Opcode::DirectRead, flags: ReqFlags::empty(), tag: 2, handle, offset, length };
    peer.send(&caravan(&[req], &cap.encode()));
    let (h, body) = peer.recv().expect("completion");
    let c = CompletionCaravan::parse(&h, &body).unwrap();
    let (completion, data) = c.iter().next().unwrap();
    (completion.status, data.to_vec())
}

/// A 64 GiB volume on a 128 MiB array (volumes are thin) is registered whole in one round
/// trip: no page is read, no pool slot taken, nothing written. A cold 24 MiB volume read
/// through its registered reference is served wholly direct, every byte right, with no fault
/// reaching the initiator: the pool misses were read ahead while the requests waited.
#[test]
fn registering_costs_metadata_and_cold_direct_reads_never_fault() {
    let (_dir, devices) = flash_array(2, 64 << 20);
    let len = 24usize << 20;
    let data = pattern(len, 7);
    {
        let t = start(&devices, &[]);
        let ep = tcp_endpoint(&t);
        let mut client = Client::connect(&ep).unwrap();
        volume(&mut client, VolumeOp::Create, "v", len as u64);
        volume(&mut client, VolumeOp::Create, "big", 64 << 30);
        let mut lane = Lane::connect(&ep, "v", &LaneConfig::default()).unwrap();
        for (i, piece) in data.chunks(1 << 20).enumerate() {
            lane.write_at(piece, (i << 20) as u64).unwrap();
        }
    }
    // A clean stop wrote everything back: the new target's pool is cold.
    let t = start(&devices, &[]);
    let ep = tcp_endpoint(&t);
    let mut client = Client::connect(&ep).unwrap();
    let before = flash_stats(&mut client);
    let big = client.register("big", 0, 64 << 30).unwrap();
    assert_eq!((big.kind, big.offset, big.span()), (CapKind::Extent, 0, 64 << 30));
    assert_eq!(big.rights, wire::CapRights::READ, "Client::register asks to read");
    let part = client.register("big", 40 << 30, 1 << 30).unwrap();
    assert_eq!((part.offset, part.span()), (40 << 30, 1 << 30));
    let after = flash_stats(&mut client);
    for counter in
        ["device_pages_read", "device_pages_written", "pool_misses", "pool_clean_pages", "pages_read_async"]
    {
        let get = |s: &[(String, u64)]| s.iter().find(|(n, _)| n == counter).unwrap().1;
        assert_eq!(get(&after), get(&before), "{counter} moved: registering touched the pool or the devices");
    }

    let mut lane = direct_lane(&ep, "v");
    let cap = lane.register(0, len as u64).unwrap();
    assert_eq!(cap.span(), len as u64);
    let misses = flash_stat(&mut client, "pool_misses");
    let mut back = vec![0u8; len];
    let piece = 128 << 10;
    for (i, chunk) in back.chunks_mut(piece).enumerate() {
        lane.read_at(chunk, (i * piece) as u64).unwrap();
    }
    assert!(back == data, "direct reads of a cold volume returned other bytes");
    let s = lane.stats();
    assert_eq!(s.direct_reads, (len / piece) as u64, "every read went direct");
    assert_eq!((s.direct_faults, s.fallbacks), (0, 0), "no fault reached the initiator");
    assert!(flash_stat(&mut client, "pool_misses") > misses, "the volume was not cold");
    assert!(flash_stat(&mut client, "pages_read_async") > 0, "no miss was read ahead: nothing parked");

    // A lane that registers nothing earns the whole volume on its first read.
    let mut earner = direct_lane(&ep, "v");
    let mut one = vec![0u8; 4096];
    earner.read_at(&mut one, 0).unwrap();
    for (i, chunk) in back.chunks_mut(piece).enumerate().take(16) {
        earner.read_at(chunk, (i * piece) as u64).unwrap();
    }
    let s = earner.stats();
    assert_eq!((s.capabilities_received, s.direct_reads, s.direct_faults), (1, 16, 0));
    assert!(back[..16 * piece] == data[..16 * piece]);
}

/// Refusals of REGISTER, each a status on that request alone; and every way an extent dies:
/// an epoch rotation, a shrink (stale past the new end at once, and everywhere after the
/// rotation it brings), the volume's deletion (a volume made again under the same name is
/// never read through the old reference).
#[test]
fn references_are_refused_where_they_must_be_and_die_with_their_volume() {
    let (dir, devices) = flash_array(1, 128 << 20);
    let file = dir.path().join("file.img");
    std::fs::File::create(&file).unwrap().set_len(1 << 20).unwrap();
    let t = start(&devices, &["mem=ram:8M", &format!("cached=file:{},cache=1M", file.display())]);
    let ep = tcp_endpoint(&t);
    let mut client = Client::connect(&ep).unwrap();
    volume(&mut client, VolumeOp::Create, "v", 8 << 20);
    let mut writer = Lane::connect(&ep, "v", &LaneConfig::default()).unwrap();
    for (i, piece) in pattern(8 << 20, 1).chunks(1 << 20).enumerate() {
        writer.write_at(piece, (i << 20) as u64).unwrap();
    }

    let (mut peer, handle) = RawPeer::ready_with_features(&t, Limits::default(), "v", FEATURE_DIRECT_READS);
    let read = wire::CapRights::READ;
    for (offset, length, rights, status) in [
        (0, 0, read, Status::Invalid),
        (512, 4096, read, Status::Invalid),
        (0, 4097, read, Status::Invalid),
        (0, (8 << 20) + 4096, read, Status::OutOfRange),
        (u64::MAX - 4095, 4096, read, Status::OutOfRange),
        (0, 4096, wire::CapRights::TRACK, Status::Invalid),
    ] {
        let reply = register_raw(&mut peer, handle, rights, offset, length);
        assert_eq!((reply.status, reply.cap), (status, None), "{offset}+{length} {rights:?}");
    }
    assert_eq!(register_raw(&mut peer, handle + 9, read, 0, 4096).status, Status::BadHandle);
    let cap = register_raw(&mut peer, handle, read, 0, 8 << 20).cap.expect("a reference");
    let (status, bytes) = direct(&mut peer, handle, &cap, 4096, 8192);
    assert_eq!(status, Status::Ok);
    assert_eq!(bytes, pattern(8 << 20, 1)[4096..12288]);
    // Wider than the range it was sealed for, or altered: never served.
    let sub = register_raw(&mut peer, handle, read, 1 << 20, 1 << 20).cap.unwrap();
    assert_eq!(direct(&mut peer, handle, &sub, 0, 4096).0, Status::BadCapability);
    assert_eq!(
        direct(&mut peer, handle, &Capability { length: cap.length + 1, ..cap }, 0, 4096).0,
        Status::BadCapability
    );
    assert_eq!(
        direct(&mut peer, handle, &Capability { generation: 99, ..cap }, 0, 4096).0,
        Status::BadCapability
    );

    // RAM exports take registrations (their memory is there); a cached file export does not.
    let (mut mem, mem_handle) =
        RawPeer::ready_with_features(&t, Limits::default(), "mem", FEATURE_DIRECT_READS);
    let mem_cap = register_raw(&mut mem, mem_handle, read, 0, 8 << 20).cap.expect("RAM registers");
    assert_eq!(direct(&mut mem, mem_handle, &mem_cap, 4 << 20, 65536).0, Status::Ok);
    assert_eq!(direct(&mut mem, mem_handle, &cap, 0, 4096).0, Status::BadCapability, "another export's");
    let (mut cached, cached_handle) =
        RawPeer::ready_with_features(&t, Limits::default(), "cached", FEATURE_DIRECT_READS);
    assert_eq!(register_raw(&mut cached, cached_handle, read, 0, 4096).status, Status::Unsupported);

    // An epoch rotation (REVOKE) makes it stale; a fresh registration works again.
    // (On a connection of its own: opening the volume holds it, and it is deleted below.)
    assert_eq!(Client::connect(&ep).unwrap().revoke("v", None).unwrap(), 2);
    assert_eq!(direct(&mut peer, handle, &cap, 0, 4096).0, Status::StaleCapability);
    let cap = register_raw(&mut peer, handle, read, 0, 8 << 20).cap.unwrap();
    // A shrink: the reference is stale at once, past the new end and (the epoch rotates)
    // everywhere; it never reads what a growth brings back.
    // (The array refuses to shrink over written pages: trim the tail first.)
    let trim = Request {
        opcode: Opcode::Trim,
        flags: ReqFlags::empty(),
        tag: 3,
        handle,
        offset: 4 << 20,
        length: 4 << 20,
    };
    peer.send(&caravan(&[trim], &[]));
    let (h, body) = peer.recv().unwrap();
    assert_eq!(CompletionCaravan::parse(&h, &body).unwrap().iter().next().unwrap().0.status, Status::Ok);
    volume(&mut client, VolumeOp::Resize, "v", 4 << 20);
    assert_eq!(direct(&mut peer, handle, &cap, 6 << 20, 4096).0, Status::StaleCapability);
    assert_eq!(direct(&mut peer, handle, &cap, 0, 4096).0, Status::StaleCapability);
    volume(&mut client, VolumeOp::Resize, "v", 8 << 20);
    assert_eq!(direct(&mut peer, handle, &cap, 6 << 20, 4096).0, Status::StaleCapability);

    // Deletion: a volume of the same name made afterwards never serves the old reference.
    let old = register_raw(&mut peer, handle, read, 0, 4 << 20).cap.unwrap();
    drop((peer, writer));
    let mut retry = 0;
    loop {
        // The target lets the connections go a moment after they close.
        let reply = client
            .volume(&VolumeRequest {
                op: VolumeOp::Delete,
                name: "v".into(),
                origin: String::new(),
                size_bytes: 0,
            })
            .unwrap();
        if reply.status == Status::Ok {
            break;
        }
        assert_eq!(reply.status, Status::Busy, "{}", reply.message);
        retry += 1;
        assert!(retry < 200, "the volume stayed in use");
        std::thread::sleep(Duration::from_millis(10));
    }
    volume(&mut client, VolumeOp::Create, "v", 8 << 20);
    let (mut peer, handle) = RawPeer::ready_with_features(&t, Limits::default(), "v", FEATURE_DIRECT_READS);
    let (status, bytes) = direct(&mut peer, handle, &old, 0, 4096);
    assert!(
        matches!(status, Status::StaleCapability | Status::BadCapability) && bytes.is_empty(),
        "a deleted volume's reference was served: {status}"
    );
    let fresh = register_raw(&mut peer, handle, read, 0, 4096).cap.unwrap();
    assert_ne!(fresh.generation, old.generation, "a new volume has a new id");
    let (status, bytes) = direct(&mut peer, handle, &fresh, 0, 4096);
    assert_eq!((status, bytes), (Status::Ok, vec![0u8; 4096]), "the new volume reads as zeroes");
}

fn send_one(peer: &mut RawPeer, req: Request, payload: &[u8]) -> Status {
    peer.send(&caravan(&[req], payload));
    let (h, body) = peer.recv().expect("completion");
    let status = CompletionCaravan::parse(&h, &body).unwrap().iter().next().unwrap().0.status;
    status
}

fn direct_write(peer: &mut RawPeer, handle: u32, cap: &Capability, offset: u64, data: &[u8]) -> Status {
    let req = Request {
        opcode: Opcode::DirectWrite,
        flags: ReqFlags::empty(),
        tag: 7,
        handle,
        offset,
        length: data.len() as u32,
    };
    let mut payload = cap.encode().to_vec();
    payload.extend_from_slice(data);
    send_one(peer, req, &payload)
}

/// A lane whose read earned the volume's extent (with the write right: the lane may write)
/// writes through it: every write goes direct and lands, another lane reads it back, and a FUA
/// one is made durable by the array's sync thread before it completes. Over a raw
/// connection, a reference without the write right, a RAM region's, or one altered is
/// refused and writes nothing; a snapshot refuses to register for writing.
#[test]
fn writes_under_an_extent_go_direct_and_fua_ones_are_durable_first() {
    let (_dir, devices) = flash_array(1, 128 << 20);
    let t = start(&devices, &["mem=ram:4M"]);
    let ep = tcp_endpoint(&t);
    let mut client = Client::connect(&ep).unwrap();
    volume(&mut client, VolumeOp::Create, "v", 8 << 20);
    let mut lane = direct_lane(&ep, "v");
    let mut one = vec![0u8; 4096];
    lane.read_at(&mut one, 0).unwrap();
    assert_eq!(lane.stats().capabilities_received, 1);
    let data = pattern(8 << 20, 3);
    let piece = 64 << 10;
    for (i, chunk) in data.chunks(piece).enumerate() {
        lane.write_at(chunk, (i * piece) as u64).unwrap();
    }
    let s = lane.stats();
    assert_eq!((s.direct_writes, s.direct_faults), ((data.len() / piece) as u64, 0), "{s:?}");
    let mut back = vec![0u8; data.len()];
    let mut reader = Lane::connect(&ep, "v", &LaneConfig::default()).unwrap();
    for (i, chunk) in back.chunks_mut(1 << 20).enumerate() {
        reader.read_at(chunk, (i << 20) as u64).unwrap();
    }
    assert!(back == data, "direct writes did not land");

    // FUA: durable (the sync thread ran for it) before the completion.
    let syncs = flash_stat(&mut client, "syncs_later");
    lane.submit_write(4096, vec![0xEE; 4096], ReqFlags::FUA, 1).map_err(|r| r.error).unwrap();
    let mut done = Vec::new();
    lane.wait(1, &mut done).unwrap();
    assert_eq!(done[0].status, Status::Ok);
    assert_eq!(lane.stats().direct_writes, s.direct_writes + 1, "the FUA write went direct");
    assert!(flash_stat(&mut client, "syncs_later") > syncs, "a FUA direct write completed before a sync");

    let (mut peer, handle) = RawPeer::ready_with_features(&t, Limits::default(), "v", FEATURE_DIRECT_READS);
    let read = wire::CapRights::READ;
    let both = read.union(wire::CapRights::WRITE);
    let read_only = register_raw(&mut peer, handle, read, 0, 8 << 20).cap.unwrap();
    assert_eq!(direct_write(&mut peer, handle, &read_only, 0, &[1; 4096]), Status::BadCapability);
    let writable = register_raw(&mut peer, handle, both, 0, 1 << 20).cap.unwrap();
    assert_eq!(writable.rights, both);
    assert_eq!(
        direct_write(&mut peer, handle, &writable, (1 << 20) - 4096, &[2; 8192]),
        Status::BadCapability,
        "past its range"
    );
    let widened = Capability { length: writable.length * 2, ..writable };
    assert_eq!(direct_write(&mut peer, handle, &widened, 1 << 20, &[2; 4096]), Status::BadCapability);
    assert_eq!(direct_write(&mut peer, handle, &writable, 100, &[2; 4096]), Status::Misaligned);
    let (mut mem, mem_handle) =
        RawPeer::ready_with_features(&t, Limits::default(), "mem", FEATURE_DIRECT_READS);
    let req = Request {
        opcode: Opcode::Read,
        flags: ReqFlags::WANT_CAP,
        tag: 1,
        handle: mem_handle,
        offset: 0,
        length: 4096,
    };
    mem.send(&caravan(&[req], &[]));
    mem.recv().expect("completions");
    let (h, body) = mem.recv().expect("capabilities");
    assert_eq!(h.kind, FrameKind::Capabilities);
    let mut region = Vec::new();
    Capability::decode_list(&body, |c| region.push(c)).unwrap();
    assert_eq!(region[0].kind, CapKind::Region);
    assert_eq!(
        direct_write(&mut mem, mem_handle, &region[0], 0, &[3; 4096]),
        Status::BadCapability,
        "a region grants no writes"
    );
    // Nothing refused was written.
    let (status, bytes) = direct(&mut peer, handle, &read_only, 0, 8192);
    assert_eq!(status, Status::Ok);
    assert_eq!(&bytes[..4096], &data[..4096]);
    assert_eq!(&bytes[4096..], &[0xEE; 4096]);
    // A good one lands.
    assert_eq!(direct_write(&mut peer, handle, &writable, 8192, &[4; 4096]), Status::Ok);
    assert_eq!(direct(&mut peer, handle, &read_only, 8192, 4096).1, vec![4; 4096]);

    let reply = client
        .volume(&VolumeRequest {
            op: VolumeOp::Snapshot,
            name: "s".into(),
            origin: "v".into(),
            size_bytes: 0,
        })
        .unwrap();
    assert_eq!(reply.status, Status::Ok, "{}", reply.message);
    let (mut snap, snap_handle) =
        RawPeer::ready_with_features(&t, Limits::default(), "s", FEATURE_DIRECT_READS);
    assert_eq!(register_raw(&mut snap, snap_handle, both, 0, 4096).status, Status::ReadOnly);
    let snap_cap = register_raw(&mut snap, snap_handle, read, 0, 4096).cap.expect("reading a snapshot");
    assert_eq!(direct(&mut snap, snap_handle, &snap_cap, 0, 4096).1, data[..4096].to_vec());
}

/// With a reference file (`--flash-references`), a reference registered before a restart reads
/// after it, one revoked before it (a rotated epoch) stays revoked, and a volume's epoch goes
/// on from where it was; without the file, the new target's secret refuses the old reference.
#[test]
fn references_outlive_a_restart_with_their_file_and_so_do_revocations() {
    let (dir, devices) = flash_array(1, 128 << 20);
    let refs = dir.path().join("references");
    let data = pattern(1 << 20, 5);
    let (kept, revoked) = {
        let t = start_keeping(&devices, &[], Some(refs.clone()));
        let ep = tcp_endpoint(&t);
        let mut client = Client::connect(&ep).unwrap();
        volume(&mut client, VolumeOp::Create, "v", 8 << 20);
        volume(&mut client, VolumeOp::Create, "w", 8 << 20);
        Lane::connect(&ep, "v", &LaneConfig::default()).unwrap().write_at(&data, 0).unwrap();
        let kept = client.register("v", 0, 8 << 20).unwrap();
        let revoked = client.register("w", 0, 8 << 20).unwrap();
        assert_eq!(Client::connect(&ep).unwrap().revoke("w", None).unwrap(), 2);
        (kept, revoked)
    };
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&refs).unwrap().permissions().mode() & 0o777,
        0o600,
        "the secret is private"
    );

    let t = start_keeping(&devices, &[], Some(refs.clone()));
    let (mut peer, handle) = RawPeer::ready_with_features(&t, Limits::default(), "v", FEATURE_DIRECT_READS);
    let (status, bytes) = direct(&mut peer, handle, &kept, 0, 65536);
    assert_eq!(status, Status::Ok, "a reference did not outlive the restart");
    assert_eq!(bytes, data[..65536].to_vec());
    let (mut wpeer, whandle) = RawPeer::ready_with_features(&t, Limits::default(), "w", FEATURE_DIRECT_READS);
    assert_eq!(
        direct(&mut wpeer, whandle, &revoked, 0, 4096).0,
        Status::StaleCapability,
        "a revocation was undone"
    );
    let fresh = register_raw(&mut wpeer, whandle, wire::CapRights::READ, 0, 4096).cap.unwrap();
    assert_eq!(fresh.epoch, 2, "the epoch goes on from where it was");
    assert_eq!(direct(&mut wpeer, whandle, &fresh, 0, 4096).0, Status::Ok);
    drop((peer, wpeer, t));

    let t = start_keeping(&devices, &[], None);
    let (mut peer, handle) = RawPeer::ready_with_features(&t, Limits::default(), "v", FEATURE_DIRECT_READS);
    assert_eq!(
        direct(&mut peer, handle, &kept, 0, 4096).0,
        Status::BadCapability,
        "another secret without the file"
    );
    drop(t);
    // A file that is not one is refused with its name, and the target does not start.
    std::fs::write(&refs, "version 1\nsecret 00\n").unwrap();
    let config = server::TargetConfig {
        flash: Some(FlashConfig {
            devices: devices.clone(),
            pool_bytes: 4 << 20,
            map_bytes: server::FLASH_MAP_BYTES_DEFAULT,
            read_depth: server::FLASH_READ_DEPTH_DEFAULT,
            references: Some(refs.clone()),
            rstore_pool: None,
        }),
        listen: vec![Endpoint::Tcp("127.0.0.1:0".into())],
        ..server::TargetConfig::default()
    };
    let e = Target::start(config).err().expect("a broken reference file refused");
    assert!(e.to_string().contains("references") && e.to_string().contains("hex"), "{e}");
}
