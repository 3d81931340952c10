//! Direct placement of read data, against a scripted target.
//!
//! The scripted target answers a lane's requests the way a target may but ours rarely does:
//! completions out of order, failed reads among good ones, one response caravan written in
//! pieces of a few bytes with pauses between them. Every read must still land whole in its
//! own buffer. A target that breaks the protocol in a frame being placed (a tag twice, a wrong
//! data length) fails the lane, and every request still comes back with its buffer.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

use initiator::{Completion, Error, Lane, LaneConfig, Limits, Queue, ReqFlags, Status};
use transport::Endpoint;
use wire::caravan::RequestCaravan;
use wire::control::{frame, ExportFlags, HelloReply, OpenReply};
use wire::{FrameKind, Header, Opcode, Request, COMPLETION_DESC_LEN, HEADER_LEN};

const LIMITS: Limits =
    Limits { queue_depth: 64, caravan_reqs_max: 64, caravan_bytes_max: 8 << 20, io_bytes_max: 1 << 20 };

/// The byte at `pos` of the scripted volume.
fn pattern(pos: u64) -> u8 {
    (pos ^ (pos >> 9) ^ (pos >> 17)) as u8
}

/// What the scripted target does with one request: its completion status, and whether to put
/// a second copy of its descriptor in the caravan (a broken target).
type Script = fn(&Request) -> (Status, bool);

struct Scripted {
    stream: TcpStream,
}

impl Scripted {
    /// Accept one lane, answer its HELLO and OPEN, then answer each request caravan with one
    /// response caravan, in reverse order, written in pieces whose sizes cycle through
    /// `pieces`, with a pause after each.
    fn start(script: Script, pieces: &'static [usize]) -> (Endpoint, JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = Endpoint::Tcp(listener.local_addr().unwrap().to_string());
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            stream.set_nodelay(true).unwrap();
            let mut t = Scripted { stream };
            t.recv().expect("hello");
            let hello =
                HelloReply { status: Status::Ok, version: 1, features: 0, limits: LIMITS, auth_nonce: None };
            t.send_all(&frame(FrameKind::HelloReply, &hello.encode()));
            t.recv().expect("open");
            let open = OpenReply {
                status: Status::Ok,
                handle: 1,
                size_bytes: 1 << 30,
                block_size: 512,
                flags: ExportFlags(0),
            };
            t.send_all(&frame(FrameKind::OpenReply, &open.encode()));
            while let Some((h, body)) = t.recv() {
                let caravan = RequestCaravan::parse(&h, &body).expect("a request caravan");
                let reqs: Vec<Request> = caravan.iter().map(|(r, _)| r.expect("valid request")).collect();
                let reply = answer(&reqs, script);
                let mut rest = &reply[..];
                for &size in pieces.iter().cycle() {
                    let (piece, after) = rest.split_at(size.min(rest.len()));
                    if t.stream.write_all(piece).is_err() {
                        return; // the lane gave up on us
                    }
                    rest = after;
                    if rest.is_empty() {
                        break;
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        });
        (endpoint, server)
    }

    fn send_all(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    fn recv(&mut self) -> Option<(Header, Vec<u8>)> {
        let mut head = [0u8; HEADER_LEN];
        self.stream.read_exact(&mut head).ok()?;
        let h = Header::parse(&head).expect("the lane sends valid headers");
        let mut body = vec![0u8; h.body_len()];
        self.stream.read_exact(&mut body).ok()?;
        Some((h, body))
    }
}

/// One response caravan for `reqs`, completions in reverse order.
fn answer(reqs: &[Request], script: Script) -> Vec<u8> {
    let mut descs = Vec::new();
    let mut data = Vec::new();
    for r in reqs.iter().rev() {
        let (status, twice) = script(r);
        let data_len = if status.is_ok() && r.opcode == Opcode::Read { r.length } else { 0 };
        let c = wire::Completion { tag: r.tag, status, data_len };
        for _ in 0..if twice { 2 } else { 1 } {
            let mut d = [0u8; COMPLETION_DESC_LEN];
            c.emit(&mut d);
            descs.extend_from_slice(&d);
            data.extend((r.offset..r.offset + u64::from(data_len)).map(pattern));
        }
    }
    let count = descs.len() / COMPLETION_DESC_LEN;
    let mut out = vec![0u8; HEADER_LEN];
    Header { kind: FrameKind::Completions, desc_count: count as u16, payload_len: data.len() as u32 }
        .emit(&mut out);
    out.extend_from_slice(&descs);
    out.extend_from_slice(&data);
    out
}

/// Reads of many sizes, a write and a flush, submitted as one batch; returns every completion.
fn run_batch(lane: &mut Lane, reads: &[(u64, usize)]) -> (Vec<Completion>, Result<(), Error>) {
    for (i, &(offset, len)) in reads.iter().enumerate() {
        lane.submit_read(offset, vec![0; len], i as u64).unwrap();
    }
    let n = reads.len() as u64;
    lane.submit_write(1 << 20, vec![7; 4096], ReqFlags::empty(), n).unwrap();
    lane.submit_flush(n + 1).unwrap();
    let mut done = Vec::new();
    let total = reads.len() + 2;
    let result = (|| {
        while done.len() < total {
            lane.wait(total - done.len(), &mut done)?;
        }
        Ok(())
    })();
    (done, result)
}

fn reads() -> Vec<(u64, usize)> {
    let sizes = [512, 4096, 131072, 1024, 65536, 4096, 8192, 262144, 512, 16384];
    sizes.iter().enumerate().map(|(i, &len)| ((i as u64) * (1 << 20) + 512 * i as u64, len)).collect()
}

/// A lane that places reads of at least `direct_min_bytes` directly (on average).
fn lane(endpoint: &Endpoint, direct_min_bytes: u32) -> Lane {
    let config = LaneConfig {
        limits: LIMITS,
        timeout: Duration::from_secs(20),
        direct_min_bytes,
        ..LaneConfig::default()
    };
    Lane::connect(endpoint, "vol", &config).unwrap()
}

#[test]
fn reads_land_whole_in_their_buffers_however_the_caravan_arrives() {
    // The 64 KiB read (the fifth) fails, so no data is on the wire for it; the rest succeed.
    let script: Script = |r| (if r.offset == reads()[4].0 { Status::IoError } else { Status::Ok }, false);
    let cuts: [&'static [usize]; 3] = [&[7, 1000, 70_000], &[1, 13, 4096], &[usize::MAX]];
    for (pieces, direct_min) in cuts.into_iter().flat_map(|p| [(p, 0), (p, u32::MAX)]) {
        let (endpoint, server) = Scripted::start(script, pieces);
        let mut lane = lane(&endpoint, direct_min);
        let reads = reads();
        for round in 0..3 {
            let (done, result) = run_batch(&mut lane, &reads);
            result.unwrap_or_else(|e| panic!("pieces {pieces:?} round {round}: {e}"));
            assert_eq!(done.len(), reads.len() + 2);
            let failed: Vec<u64> = done.iter().filter(|c| !c.status.is_ok()).map(|c| c.user_data).collect();
            assert_eq!(failed, [4], "exactly the scripted failure");
            for c in &done {
                let Some(&(offset, len)) = reads.get(c.user_data as usize) else { continue };
                let buf = c.buf.as_ref().expect("every read gets its buffer back");
                assert_eq!(buf.len(), len);
                if c.status.is_ok() {
                    let want: Vec<u8> = (offset..offset + len as u64).map(pattern).collect();
                    assert!(
                        *buf == want,
                        "pieces {pieces:?} round {round}: read {} at {offset} differs",
                        c.user_data
                    );
                }
            }
        }
        let stats = lane.stats();
        let asked: u64 = 3 * reads.iter().map(|&(_, len)| len as u64).sum::<u64>();
        let failed = 3 * reads[4].1 as u64;
        if direct_min == 0 {
            assert!(stats.read_bytes_placed > 0, "pieces {pieces:?}: nothing was placed directly: {stats:?}");
        } else {
            assert_eq!(stats.read_bytes_placed, 0, "pieces {pieces:?}: placed with placement off");
        }
        assert_eq!(
            stats.read_bytes_placed + stats.read_bytes_copied,
            asked - failed,
            "pieces {pieces:?}: every byte of read data is placed or copied, once: {stats:?}"
        );
        drop(lane);
        server.join().unwrap();
    }
}

#[test]
fn a_tag_twice_in_a_placed_caravan_fails_the_lane_and_returns_every_buffer() {
    let script: Script = |r| (Status::Ok, r.opcode == Opcode::Read && r.length == 131072);
    let (endpoint, server) = Scripted::start(script, &[100]);
    let mut lane = lane(&endpoint, 0);
    let reads = reads();
    let (done, result) = run_batch(&mut lane, &reads);
    assert!(matches!(result, Err(Error::Protocol(_))), "{result:?}");
    assert_eq!(done.len(), reads.len() + 2, "every request completes, once");
    for c in &done {
        if c.opcode == Opcode::Read && c.user_data < reads.len() as u64 {
            assert_eq!(c.buf.as_ref().map(Vec::len), Some(reads[c.user_data as usize].1), "buffer back");
        }
    }
    assert!(done.iter().any(|c| c.status == Status::IoError));
    assert!(lane.is_broken());
    drop(lane);
    server.join().unwrap();
}
