//! Direct reads (ODAFS) end to end through a real target: capabilities handed out on ordinary
//! reads, reads served from them, and every way a capability goes stale or is refused, with
//! the caller seeing only its data.

use std::time::Duration;

use initiator::{Lane, LaneConfig, LaneStats};
use skiff_tests::{caravan, start_target, tcp_endpoint, RawPeer};
use wire::caravan::CompletionCaravan;
use wire::control::FEATURE_DIRECT_READS;
use wire::{Capability, FrameKind, Limits, Opcode, ReqFlags, Request, Status};

const BLOCK: usize = 4096;

fn pattern(round: u8, offset: u64) -> Vec<u8> {
    (0..BLOCK as u64).map(|i| ((offset + i) as u8) ^ round.wrapping_mul(31)).collect()
}

fn lane(t: &server::Target, export: &str, directory_entries: u32) -> Lane {
    let config = LaneConfig { directory_entries, timeout: Duration::from_secs(20), ..LaneConfig::default() };
    Lane::connect(&tcp_endpoint(t), export, &config).expect("lane")
}

fn read(lane: &mut Lane, offset: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK];
    lane.read_at(&mut buf, offset).expect("read");
    buf
}

/// 32 blocks, each in a RAM region (1 MiB) of its own, so that the first pass knows nothing.
fn blocks() -> impl Iterator<Item = u64> {
    (0..32).map(|i| i * ((1 << 20) + 3 * BLOCK as u64))
}

fn stat(t: &server::Target, name: &str) -> u64 {
    t.stats().get(name).unwrap_or_else(|| panic!("no stat {name}"))
}

/// Write every block, read it twice (the second pass direct), and check every byte.
fn two_passes(t: &server::Target, export: &str) -> (Lane, LaneStats) {
    let mut lane = lane(t, export, 4096);
    for b in blocks() {
        lane.write_at(&pattern(1, b), b).unwrap();
    }
    for b in blocks() {
        assert_eq!(read(&mut lane, b), pattern(1, b), "first pass, block at {b}");
    }
    let first = lane.stats();
    assert_eq!(first.direct_reads, 0, "nothing is known before the first pass");
    assert!(first.capabilities_received > 0, "ordinary reads earn capabilities");
    for b in blocks() {
        assert_eq!(read(&mut lane, b), pattern(1, b), "second pass, block at {b}");
    }
    let second = lane.stats().since(&first);
    (lane, second)
}

#[test]
fn a_cached_file_export_serves_the_second_pass_directly_and_never_stale_data() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vol");
    std::fs::File::create(&path).unwrap().set_len(64 << 20).unwrap();
    let t = start_target(&[&format!("vol=file:{},cache=1M", path.display())], 2);
    let (mut lane, second) = two_passes(&t, "vol");
    assert_eq!(second.direct_reads, blocks().count() as u64, "every read of the second pass was direct");
    assert_eq!(second.direct_faults, 0);
    assert!(stat(&t, "cache_hits") >= second.direct_reads);

    // A write invalidates the block before it is acknowledged: the direct read of it faults,
    // falls back, and returns the new bytes.
    let b = blocks().nth(5).unwrap();
    lane.write_at(&pattern(2, b), b).unwrap();
    let before = lane.stats();
    assert_eq!(read(&mut lane, b), pattern(2, b));
    let after = lane.stats().since(&before);
    assert_eq!((after.direct_faults, after.fallbacks, after.direct_reads), (1, 1, 0));
    // The fallback earned a fresh capability: the next read is direct again.
    assert_eq!(read(&mut lane, b), pattern(2, b));
    assert_eq!(lane.stats().since(&before).direct_reads, 1);

    // Another initiator's write is seen too.
    let mut other = self::lane(&t, "vol", 0);
    let c = blocks().nth(9).unwrap();
    other.write_at(&pattern(3, c), c).unwrap();
    assert_eq!(read(&mut lane, c), pattern(3, c), "a write from another lane is never hidden by the cache");

    // Rotating the key epoch revokes everything: each read faults once, then is direct again.
    t.rotate_epoch("vol").unwrap();
    let before = lane.stats();
    for b in blocks() {
        read(&mut lane, b);
    }
    let after = lane.stats().since(&before);
    assert_eq!(after.direct_faults, blocks().count() as u64);
    assert_eq!(after.fallbacks, after.direct_faults);

    // Invalidating a range on the target: its blocks fault, the others stay direct.
    t.invalidate("vol", 0, blocks().nth(3).unwrap() + 1);
    let before = lane.stats();
    for b in blocks() {
        read(&mut lane, b);
    }
    let after = lane.stats().since(&before);
    assert_eq!(after.direct_faults, 4);
    assert_eq!(after.direct_reads, blocks().count() as u64 - 4);
}

#[test]
fn a_ram_export_is_its_own_cache() {
    let t = start_target(&["mem=ram:64M"], 2);
    let (mut lane, second) = two_passes(&t, "mem");
    assert_eq!(second.direct_reads, blocks().count() as u64);
    // RAM is read in place: a write is visible to the next direct read without any fault.
    let b = blocks().nth(3).unwrap();
    lane.write_at(&pattern(4, b), b).unwrap();
    let before = lane.stats();
    assert_eq!(read(&mut lane, b), pattern(4, b));
    assert_eq!(lane.stats().since(&before).direct_reads, 1);
}

#[test]
fn without_the_feature_nothing_changes() {
    let t = start_target(&["mem=ram:64M"], 1);
    let mut lane = lane(&t, "mem", 0);
    for b in blocks() {
        read(&mut lane, b);
        read(&mut lane, b);
    }
    let s = lane.stats();
    assert_eq!((s.direct_reads, s.capabilities_received), (0, 0));
    assert_eq!(stat(&t, "capabilities_sent"), 0);
}

/// A raw peer that asked for direct reads: read one block asking for a capability.
fn earn(t: &server::Target, export: &str) -> (RawPeer, u32, Capability) {
    let (mut peer, handle) = RawPeer::ready_with_features(t, Limits::default(), export, FEATURE_DIRECT_READS);
    let req = Request {
        opcode: Opcode::Read,
        flags: ReqFlags::WANT_CAP,
        tag: 1,
        handle,
        offset: 8192,
        length: 4096,
    };
    peer.send(&caravan(&[req], &[]));
    let (h, _) = peer.recv().expect("completions");
    assert_eq!(h.kind, FrameKind::Completions);
    let (h, body) = peer.recv().expect("capabilities");
    assert_eq!(h.kind, FrameKind::Capabilities);
    let mut caps = Vec::new();
    Capability::decode_list(&body, |c| caps.push(c)).unwrap();
    assert_eq!(caps.len(), 1);
    (peer, handle, caps[0])
}

fn direct(peer: &mut RawPeer, handle: u32, cap: &Capability, offset: u64, length: u32) -> Status {
    let req =
        Request { opcode: Opcode::DirectRead, flags: ReqFlags::empty(), tag: 2, handle, offset, length };
    peer.send(&caravan(&[req], &cap.encode()));
    let (h, body) = peer.recv().expect("completion");
    let c = CompletionCaravan::parse(&h, &body).unwrap();
    let (completion, data) = c.iter().next().unwrap();
    assert_eq!(data.len(), if completion.status.is_ok() { length as usize } else { 0 });
    completion.status
}

#[test]
fn forged_altered_misused_and_revoked_capabilities_are_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vol");
    std::fs::File::create(&path).unwrap().set_len(16 << 20).unwrap();
    let t = start_target(&[&format!("vol=file:{},cache=1M", path.display()), "mem=ram:16M"], 1);
    let (mut peer, handle, cap) = earn(&t, "vol");
    assert_eq!(direct(&mut peer, handle, &cap, 8192, 4096), Status::Ok);
    assert_eq!(direct(&mut peer, handle, &cap, 8192 + 1024, 512), Status::Ok, "a part of the block");
    // Altered: a wider range, another slot, a later expiry, another export, a flipped MAC bit.
    for altered in [
        Capability { length: 8192, ..cap },
        Capability { slot: cap.slot + 1, ..cap },
        Capability { expires_ms: u64::MAX, ..cap },
        Capability { export: 1, ..cap },
        Capability {
            mac: {
                let mut m = cap.mac;
                m[0] ^= 1;
                m
            },
            ..cap
        },
    ] {
        assert_eq!(direct(&mut peer, handle, &altered, 8192, 4096), Status::BadCapability, "{altered:?}");
    }
    // Outside the block it covers, or larger than it.
    assert_eq!(direct(&mut peer, handle, &cap, 4096, 4096), Status::BadCapability);
    assert_eq!(direct(&mut peer, handle, &cap, 8192, 8192), Status::BadCapability);
    // A capability of one export presented on another export's handle.
    let (mut mem_peer, mem_handle) =
        RawPeer::ready_with_features(&t, Limits::default(), "mem", FEATURE_DIRECT_READS);
    assert_eq!(direct(&mut mem_peer, mem_handle, &cap, 8192, 4096), Status::BadCapability);
    // Garbage for a capability.
    let req = Request {
        opcode: Opcode::DirectRead,
        flags: ReqFlags::empty(),
        tag: 3,
        handle,
        offset: 8192,
        length: 4096,
    };
    peer.send(&caravan(&[req], &[0xEE; wire::CAPABILITY_LEN]));
    let (h, body) = peer.recv().unwrap();
    let (c, _) = CompletionCaravan::parse(&h, &body).unwrap().iter().next().unwrap();
    assert_eq!(c.status, Status::BadCapability);
    // Revoked: the epoch rotates, and the same capability is now a stale fault.
    t.rotate_epoch("vol").unwrap();
    assert_eq!(direct(&mut peer, handle, &cap, 8192, 4096), Status::StaleCapability);
    // A fresh one works, until a write to its block.
    let (mut peer, handle, cap) = earn(&t, "vol");
    assert_eq!(direct(&mut peer, handle, &cap, 8192, 4096), Status::Ok);
    let write = Request {
        opcode: Opcode::Write,
        flags: ReqFlags::empty(),
        tag: 4,
        handle,
        offset: 8192 + 512,
        length: 512,
    };
    peer.send(&caravan(&[write], &[7u8; 512]));
    let (h, body) = peer.recv().unwrap();
    let (c, _) = CompletionCaravan::parse(&h, &body).unwrap().iter().next().unwrap();
    assert_eq!(c.status, Status::Ok);
    assert_eq!(direct(&mut peer, handle, &cap, 8192, 4096), Status::StaleCapability);
    // The connection survived every refusal: an ordinary read still works on it.
    let req = Request {
        opcode: Opcode::Read,
        flags: ReqFlags::empty(),
        tag: 5,
        handle,
        offset: 8192,
        length: 4096,
    };
    peer.send(&caravan(&[req], &[]));
    let (h, body) = peer.recv().unwrap();
    let (c, data) = CompletionCaravan::parse(&h, &body).unwrap().iter().next().unwrap();
    assert_eq!(c.status, Status::Ok);
    assert_eq!(&data[512..1024], &[7u8; 512]);
}

#[test]
fn revoke_rotates_or_invalidates_over_the_wire_and_only_where_one_may_write() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vol");
    std::fs::File::create(&path).unwrap().set_len(64 << 20).unwrap();
    let t = start_target(
        &[&format!("vol=file:{},cache=1M", path.display()), &format!("ro=file:{},ro", path.display())],
        1,
    );
    let (mut lane, _) = two_passes(&t, "vol");
    let mut admin = initiator::Client::connect(&tcp_endpoint(&t)).unwrap();
    // Invalidate the first four blocks: only their reads fault.
    let before = lane.stats();
    admin.revoke("vol", Some((0, blocks().nth(3).unwrap() + 1))).unwrap();
    for b in blocks() {
        assert_eq!(read(&mut lane, b), pattern(1, b));
    }
    assert_eq!(lane.stats().since(&before).direct_faults, 4);
    // Rotate: the epoch moves on and every reference faults once.
    let epoch = admin.revoke("vol", None).unwrap();
    assert_eq!(admin.revoke("vol", None).unwrap(), epoch + 1);
    let before = lane.stats();
    for b in blocks() {
        assert_eq!(read(&mut lane, b), pattern(1, b));
    }
    assert_eq!(lane.stats().since(&before).direct_faults, blocks().count() as u64);
    // A read-only export may not be revoked through this target; no export, no handle.
    match admin.revoke("ro", None) {
        Err(initiator::Error::Status(Status::ReadOnly)) => {}
        other => panic!("revoking a read-only export: {other:?}"),
    }
    assert!(admin.revoke("nothing", None).is_err());
}
