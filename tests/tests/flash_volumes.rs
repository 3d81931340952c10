//! Flash volumes on a target in this process, over real sockets: a stopped target leaves its
//! array with nothing to replay, volume requests on a keyed target need a key, and volumes
//! come and go while other connections keep working.

use initiator::{Client, Endpoint, Lane, LaneConfig, Queue, VolumeBody, VolumeOp, VolumeRequest};
use server::{FlashConfig, Target};
use skiff_tests::{flash_array, start_target_with, tcp_endpoint};
use wire::Status;

fn with_flash(devices: &[std::path::PathBuf], exports: &[&str], keys: Vec<proto::auth::Key>) -> Target {
    start_target_with(exports, |c| {
        c.flash = Some(FlashConfig {
            devices: devices.to_vec(),
            pool_bytes: 16 << 20,
            map_bytes: server::FLASH_MAP_BYTES_DEFAULT,
            read_depth: server::FLASH_READ_DEPTH_DEFAULT,
            references: None,
            rstore_pool: None,
        });
        c.keys = keys;
    })
}

/// A target on `devices` with a 16 MiB page pool and a read ring of `depth`.
fn with_read_ring(devices: &[std::path::PathBuf], depth: u32) -> Target {
    start_target_with(&[], |c| {
        c.flash = Some(FlashConfig {
            devices: devices.to_vec(),
            pool_bytes: 16 << 20,
            map_bytes: server::FLASH_MAP_BYTES_DEFAULT,
            read_depth: depth,
            references: None,
            rstore_pool: None,
        });
    })
}

fn request(op: VolumeOp, name: &str, origin: &str, size_bytes: u64) -> VolumeRequest {
    VolumeRequest { op, name: name.into(), origin: origin.into(), size_bytes }
}

fn stat(client: &mut Client, name: &str) -> u64 {
    let reply = client.volume(&VolumeRequest::bare(VolumeOp::Stats)).unwrap();
    let VolumeBody::Stats(stats) = reply.body else { panic!("{reply:?}") };
    stats.get(name).unwrap_or_else(|| panic!("no {name} in {stats:?}"))
}

/// Writes acknowledged without a flush sit in the page pool; dropping the target writes them
/// back and checkpoints, so the next target over the same files finds them and replays
/// nothing.
#[test]
fn a_dropped_target_leaves_nothing_to_replay() {
    let (_dir, devices) = flash_array(2, 64 << 20);
    let t = with_flash(&devices, &[], vec![]);
    let ep = tcp_endpoint(&t);
    let mut client = Client::connect(&ep).unwrap();
    assert_eq!(client.volume(&request(VolumeOp::Create, "v", "", 8 << 20)).unwrap().status, Status::Ok);
    assert_eq!(client.volume(&request(VolumeOp::Snapshot, "s", "v", 0)).unwrap().status, Status::Ok);
    let mut lane = Lane::connect(&ep, "v", &LaneConfig::default()).unwrap();
    let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
    lane.write_at(&data, 4096).unwrap();
    drop((lane, client));
    drop(t);

    let t = with_flash(&devices, &[], vec![]);
    let ep = tcp_endpoint(&t);
    let mut client = Client::connect(&ep).unwrap();
    assert_eq!(stat(&mut client, "recovered_groups_replayed"), 0, "a checkpoint covered everything");
    let names: Vec<String> = client.volumes().unwrap().into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["s", "v"]);
    let mut lane = Lane::connect(&ep, "v", &LaneConfig::default()).unwrap();
    let mut back = vec![0; data.len()];
    lane.read_at(&mut back, 4096).unwrap();
    assert!(back == data, "the unflushed writes were written back");
    let listed = client.list().unwrap();
    let snap = listed.iter().find(|e| e.name == "s").expect("the snapshot is an export again");
    assert!(snap.flags.has(wire::ExportFlags::READ_ONLY));
}

#[test]
fn a_keyed_target_takes_volume_requests_only_from_a_proved_key() {
    let (_dir, devices) = flash_array(1, 128 << 20);
    let alice = proto::auth::Key::new("alice", &[7; 16]).unwrap();
    let t = with_flash(&devices, &["ram=ram:1M"], vec![alice.clone()]);
    let ep = tcp_endpoint(&t);
    let mut anonymous = Client::connect(&ep).unwrap();
    let reply = anonymous.volume(&request(VolumeOp::Create, "v", "", 1 << 20)).unwrap();
    assert_eq!(reply.status, Status::AuthRequired, "{}", reply.message);
    assert!(reply.message.contains("proved a key"), "{}", reply.message);
    assert!(anonymous.list().is_ok(), "the connection goes on");
    let mut keyed = Client::connect_with_key(&ep, Some(&alice)).unwrap();
    assert_eq!(keyed.volume(&request(VolumeOp::Create, "v", "", 1 << 20)).unwrap().status, Status::Ok);
    assert_eq!(keyed.volumes().unwrap().len(), 1);
    // A volume does not take the name of an export given at start.
    let taken = keyed.volume(&request(VolumeOp::Create, "ram", "", 1 << 20)).unwrap();
    assert_eq!(taken.status, Status::Exists, "{}", taken.message);
}

/// Volumes created and deleted in a loop on one connection while lanes keep reading and
/// writing another volume and a RAM export: none of their requests fails, and every delete
/// of a volume in use is refused while it is.
#[test]
fn volumes_come_and_go_while_other_connections_work() {
    let (_dir, devices) = flash_array(1, 128 << 20);
    let t = with_flash(&devices, &["ram=ram:4M"], vec![]);
    let ep = tcp_endpoint(&t);
    let mut client = Client::connect(&ep).unwrap();
    assert_eq!(client.volume(&request(VolumeOp::Create, "steady", "", 4 << 20)).unwrap().status, Status::Ok);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = ["steady", "ram"]
        .into_iter()
        .map(|export| {
            let (ep, stop) = (ep.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut lane = Lane::connect(&ep, export, &LaneConfig::default()).unwrap();
                let mut done = 0u64;
                let mut back = vec![0; 4096];
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let offset = (done % 1024) * 4096;
                    lane.write_at(&[done as u8; 4096], offset).unwrap();
                    lane.read_at(&mut back, offset).unwrap();
                    assert_eq!(back, [done as u8; 4096], "{export} at {offset}");
                    done += 1;
                }
                done
            })
        })
        .collect();
    for round in 0..20 {
        let name = format!("churn{}", round % 3);
        assert_eq!(client.volume(&request(VolumeOp::Create, &name, "", 1 << 20)).unwrap().status, Status::Ok);
        let mut lane = Lane::connect(&ep, &name, &LaneConfig::default()).unwrap();
        lane.write_at(&[round as u8; 4096], 0).unwrap();
        let busy = client.volume(&request(VolumeOp::Delete, &name, "", 0)).unwrap();
        assert_eq!(busy.status, Status::Busy, "{}", busy.message);
        drop(lane);
        // The worker drops the connection (and its lease) when it reads its end.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let reply = client.volume(&request(VolumeOp::Delete, &name, "", 0)).unwrap();
            if reply.status == Status::Ok {
                break;
            }
            assert_eq!(reply.status, Status::Busy, "{}", reply.message);
            assert!(std::time::Instant::now() < deadline, "the closed lane still holds {name}");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let gone = Lane::connect(&ep, &name, &LaneConfig::default());
        assert!(matches!(gone, Err(initiator::Error::Refused(Status::NotFound))), "{name} after delete");
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for w in workers {
        assert!(w.join().unwrap() > 0, "the lanes made progress");
    }
    assert_eq!(client.volumes().unwrap().len(), 1);
}

/// Create volume `v` on `t` holding `data`, written 1 MiB at a time; dropping `t` after
/// writes it all back, so that a target started next finds every page cold.
fn write_volume(t: &Target, data: &[u8]) {
    let ep = tcp_endpoint(t);
    let mut client = Client::connect(&ep).unwrap();
    let create = request(VolumeOp::Create, "v", "", data.len() as u64);
    assert_eq!(client.volume(&create).unwrap().status, Status::Ok);
    let mut lane = Lane::connect(&ep, "v", &LaneConfig::default()).unwrap();
    for (i, piece) in data.chunks(1 << 20).enumerate() {
        lane.write_at(piece, (i << 20) as u64).unwrap();
    }
}

/// `len` bytes whose every 4 KiB page carries its own number, times `mul`.
fn page_numbered(len: usize, mul: u32) -> Vec<u8> {
    (0..len).map(|i| ((i / 4096) as u32).wrapping_mul(mul).to_le_bytes()[i % 4]).collect()
}

/// The first `len` bytes of the lane's volume, read 1 MiB at a time.
fn read_by_mib(lane: &mut Lane, len: usize) -> Vec<u8> {
    let mut back = vec![0u8; len];
    for (i, piece) in back.chunks_mut(1 << 20).enumerate() {
        lane.read_at(piece, (i << 20) as u64).unwrap();
    }
    back
}

/// Pool misses park their requests instead of blocking the worker: a volume six times the
/// page pool, read back after a restart emptied the pool, through the native protocol (many
/// requests per caravan) and through NBD (nbdcopy keeps several in flight). Every byte comes
/// back, and the misses were read ahead on the array's io_uring. The map's budget holds a
/// third of the volume's leaves, so the rest come back from the checkpoint on the way.
#[test]
fn pool_misses_park_their_requests_and_every_byte_comes_back() {
    let (dir, devices) = flash_array(2, 64 << 20);
    let start = || {
        start_target_with(&[], |c| {
            c.flash = Some(FlashConfig {
                devices: devices.to_vec(),
                pool_bytes: 4 << 20,
                // Room for a few of the volume's twelve leaves: the rest are read back from
                // the checkpoint as the reads reach them.
                map_bytes: 4 * flash::ctl::LEAF_BYTES,
                read_depth: server::FLASH_READ_DEPTH_DEFAULT,
                references: None,
                rstore_pool: None,
            });
            c.nbd_listen = vec![Endpoint::Tcp("127.0.0.1:0".into())];
        })
    };
    let len = 24usize << 20;
    let data = page_numbered(len, 2_654_435_761);
    write_volume(&start(), &data);
    // A clean stop wrote everything back: the new target's pool is empty.
    let t = start();
    let ep = tcp_endpoint(&t);
    let mut client = Client::connect(&ep).unwrap();
    let mut lane = Lane::connect(&ep, "v", &LaneConfig::default()).unwrap();
    let back = read_by_mib(&mut lane, len);
    assert!(back == data, "the native protocol read back other bytes");
    assert!(stat(&mut client, "map_loads") > 0, "no map leaf was read back: the budget did not bind");
    assert!(stat(&mut client, "map_loads_async") > 0, "no map leaf was read back on the look-ahead");
    let async_native = stat(&mut client, "pages_read_async");
    assert!(async_native > 0, "no page was read ahead: the requests did not park");

    let Endpoint::Tcp(addr) = t.endpoints_of(server::Protocol::Nbd)[0].clone() else { unreachable!() };
    let out = dir.path().join("out.raw");
    skiff_tests::run_ok(skiff_tests::tool("nbdcopy", "libnbd-bin").arg(format!("nbd://{addr}/v")).arg(&out));
    let copied = std::fs::read(&out).unwrap();
    assert!(copied == data, "nbdcopy read back other bytes");
    assert!(stat(&mut client, "pages_read_async") > async_native, "NBD's misses were not read ahead");

    // Writes through NBD look ahead too, and start nothing: they must never park. (A build
    // that set the parked flag whatever the batch said hung on the first NBD write.)
    assert_eq!(client.volume(&request(VolumeOp::Create, "w", "", len as u64)).unwrap().status, Status::Ok);
    let guard = std::time::Duration::from_secs(120);
    skiff_tests::run_ok_within(
        skiff_tests::tool("nbdcopy", "libnbd-bin").arg(&out).arg(format!("nbd://{addr}/w")),
        guard,
    );
    let again = dir.path().join("again.raw");
    skiff_tests::run_ok_within(
        skiff_tests::tool("nbdcopy", "libnbd-bin").arg(format!("nbd://{addr}/w")).arg(&again),
        guard,
    );
    assert!(std::fs::read(&again).unwrap() == data, "a volume written through NBD read back other bytes");
}

/// A read of more cold pages than the array's read queue holds is read ahead in rounds: the
/// connection parks for the pages the queue took, looks ahead again for the rest, and parks
/// again, so that no page of it is read on the worker's thread. Every miss is an asynchronous
/// read, and every byte comes back.
#[test]
fn a_read_larger_than_the_read_queue_is_read_ahead_in_rounds() {
    let (_dir, devices) = flash_array(1, 128 << 20);
    let start = || with_read_ring(&devices, 16);
    let len = 8usize << 20;
    let data = page_numbered(len, 40_503);
    write_volume(&start(), &data);
    // A clean stop wrote everything back: every page is cold now.
    let t = start();
    let ep = tcp_endpoint(&t);
    let mut client = Client::connect(&ep).unwrap();
    let mut lane = Lane::connect(&ep, "v", &LaneConfig::default()).unwrap();
    let back = read_by_mib(&mut lane, len);
    assert!(back == data, "other bytes came back");
    let (misses, ahead) = (stat(&mut client, "pool_misses"), stat(&mut client, "pages_read_async"));
    assert_eq!(misses, (len / 4096) as u64, "every page missed once");
    assert_eq!(ahead, misses, "{} of {misses} cold pages were read on the worker", misses - ahead);
}

/// Many small cold reads at once, needing more device reads than the array's read queue
/// holds: the look-ahead starts what the queue takes and cuts its batch short, and the caravans
/// it could not start whole are looked at again in the next pass, so no page is read on the
/// worker's thread while requests before it are answered as their pages land. The pages were
/// written in a shuffled order, so neighbours in the volume do not lie next to each other on
/// the device: each is a read of its own. (Built first without the second look, the pages
/// past the queue's first fill were read on the worker.)
#[test]
fn many_cold_reads_beyond_the_read_queue_are_all_read_ahead() {
    let (_dir, devices) = flash_array(1, 128 << 20);
    let start = || with_read_ring(&devices, 16);
    let pages = 1024usize;
    let data = page_numbered(pages * 4096, 7_919);
    {
        let t = start();
        let ep = tcp_endpoint(&t);
        let mut client = Client::connect(&ep).unwrap();
        let create = request(VolumeOp::Create, "v", "", data.len() as u64);
        assert_eq!(client.volume(&create).unwrap().status, Status::Ok);
        let mut lane = Lane::connect(&ep, "v", &LaneConfig::default()).unwrap();
        // 389 is prime to 1024: every page once, no two neighbours one after the other.
        for k in 0..pages {
            let p = k * 389 % pages;
            lane.write_at(&data[p * 4096..(p + 1) * 4096], (p * 4096) as u64).unwrap();
        }
    }
    // A clean stop wrote everything back: every page is cold now.
    let t = start();
    let ep = tcp_endpoint(&t);
    let mut client = Client::connect(&ep).unwrap();
    let mut lane = Lane::connect(&ep, "v", &LaneConfig::default()).unwrap();
    let mut back = vec![0u8; data.len()];
    let (mut submitted, mut landed, mut done) = (0, 0, Vec::new());
    while landed < pages {
        while submitted < pages && submitted - landed < 128 {
            lane.submit_read((submitted * 4096) as u64, vec![0; 4096], submitted as u64).unwrap();
            submitted += 1;
        }
        lane.wait(1, &mut done).unwrap();
        for c in done.drain(..) {
            assert_eq!(c.status, Status::Ok, "read of page {}", c.user_data);
            let p = c.user_data as usize;
            back[p * 4096..(p + 1) * 4096].copy_from_slice(&c.buf.unwrap());
            landed += 1;
        }
    }
    assert!(back == data, "other bytes came back");
    let (misses, ahead) = (stat(&mut client, "pool_misses"), stat(&mut client, "pages_read_async"));
    assert_eq!(misses, pages as u64, "every page missed once");
    assert_eq!(ahead, misses, "{} of {misses} cold pages were read on the worker", misses - ahead);
}

/// A FLUSH through the native protocol is made durable by the array's sync thread while the
/// worker serves on: the lane's flush is answered only after it (the counter moved), and
/// writes queued behind it in the same pass are answered too. Reads of pages in the pool
/// are sent from the pool (`Array::lend`).
#[test]
fn a_native_flush_is_served_by_the_sync_thread() {
    let (_dir, devices) = flash_array(2, 64 << 20);
    let t = with_flash(&devices, &[], vec![]);
    let ep = tcp_endpoint(&t);
    let mut client = Client::connect(&ep).unwrap();
    assert_eq!(client.volume(&request(VolumeOp::Create, "v", "", 8 << 20)).unwrap().status, Status::Ok);
    let before = stat(&mut client, "syncs_later");
    let mut lane = Lane::connect(&ep, "v", &LaneConfig::default()).unwrap();
    let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 253) as u8).collect();
    for round in 0..4u64 {
        lane.write_at(&data, round << 20).unwrap();
        lane.flush().unwrap();
    }
    assert!(stat(&mut client, "syncs_later") >= before + 4, "the flushes did not go to the sync thread");
    assert!(stat(&mut client, "sync_rounds_later") > 0);
    let mut back = vec![0u8; data.len()];
    for round in 0..4u64 {
        lane.read_at(&mut back, round << 20).unwrap();
        assert!(back == data, "round {round} read back other bytes");
    }
    // The pages were in the pool: their bytes left from there, lent, not copied first.
    assert!(stat(&mut client, "pages_lent") >= 4 * 256, "pool pages were copied into the reply buffer");
}
