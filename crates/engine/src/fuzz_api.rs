//! The target's native front end fed arbitrary frame sequences, for `cargo fuzz`
//! (fuzz/fuzz_targets/server_session.rs) and the seeded smoke test. Not part of the stable
//! API.
//!
//! A connection with fuzzed offered limits receives, in fuzzed pieces, an optional valid HELLO
//! (with fuzzed proposals) and OPEN, optionally the OPEN of a pool export that needs chunk
//! grants and a GRANT of a valid grant for one of its chunks (a fuzzer cannot forge one),
//! then frames of every kind made from the input (mostly
//! with correct headers and fuzzed bodies; some raw). Whatever arrives: no panic, everything
//! the target queued is a sequence of well-formed frames of kinds a target sends, a GOAWAY is
//! the last of them and closes the connection, and nothing follows a close.

use wire::caravan::CompletionCaravan;
use wire::control::{frame, Hello};
use wire::fuzz_api::{next_frame, Input, KINDS};
use wire::{FrameBuffer, FrameKind, GoAway, Header, Limits, StatsReply};

use crate::front::native::NativeConn;
use crate::front::{FrontStats, Gate, Host, Later, Link};
use crate::{BackendSpec, Export, ExportTable};

struct FuzzHost {
    exports: ExportTable,
}

impl Host for FuzzHost {
    fn exports(&self) -> &ExportTable {
        &self.exports
    }
    fn io_bytes_max(&self) -> u32 {
        8192
    }
    fn stats_reply(&self) -> StatsReply {
        StatsReply { entries: vec![("req_read".into(), 1)] }
    }
}

/// The grant key and chunk size of the fuzzed pool export.
const POOL_KEY: [u8; 32] = [7; 32];
const POOL_CHUNK: u64 = 256 << 10;

/// One host for every input: mapping fresh volumes per input would cost more than the input.
fn host() -> &'static FuzzHost {
    static HOST: std::sync::OnceLock<FuzzHost> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        let ram = |name, read_only| {
            Export::open(name, &BackendSpec::Ram { size_bytes: 1 << 20 }, read_only).expect("a RAM export")
        };
        let grants = proto::grant::PoolGrants::new(POOL_KEY, POOL_CHUNK, 4).expect("a pool of four chunks");
        let pool = ram("pool", false)
            .with_block_bytes(1)
            .and_then(|e| {
                e.with_layer(std::sync::Arc::new(crate::layer::Grants(std::sync::Arc::new(grants))))
            })
            .expect("a byte-granular pool");
        FuzzHost { exports: ExportTable::new(vec![ram("vol", false), ram("ro", true), pool]) }
    })
}

pub fn native_conn(data: &[u8]) {
    let mut input = Input(data);
    let chunk = 1 + input.byte() as usize * 13;
    let offered = Limits {
        queue_depth: 1 + u32::from(input.byte() % 64),
        caravan_reqs_max: 1 + u32::from(input.byte() % 16),
        caravan_bytes_max: 4096 * (1 + u32::from(input.byte() % 8)),
        io_bytes_max: 4096,
    };
    let mut stream = Vec::new();
    let preface = input.byte();
    if preface % 8 != 0 {
        let proposal = Limits {
            queue_depth: u32::from(input.byte()),
            caravan_reqs_max: u32::from(input.byte()),
            caravan_bytes_max: u32::from(input.u16()),
            io_bytes_max: u32::from(input.u16()),
        };
        let hello = Hello { version_min: 1, version_max: 1, features: 0, limits: proposal, auth: None };
        stream.extend(frame(FrameKind::Hello, &hello.encode()));
        if preface % 4 != 0 {
            stream.extend(frame(FrameKind::Open, &wire::Open { name: "vol".into() }.encode()));
        }
        if preface & 0x10 != 0 {
            // The pool opens as handle 1 after "vol", 0 without it; one chunk granted.
            stream.extend(frame(FrameKind::Open, &wire::Open { name: "pool".into() }.encode()));
            let handle = u32::from(preface % 4 != 0);
            let key = proto::capability::CapKey::new(POOL_KEY);
            let rights = wire::CapRights::from_bits(input.byte() % 8).unwrap_or(wire::CapRights::READ);
            let chunk = u64::from(input.byte() % 4);
            // Up to two grants of the chunk, of map epochs the input picks: a newer one makes
            // the first stale; TRACK marks regions; the fuzzed frames may present older ones.
            for _ in 0..1 + input.byte() % 2 {
                let epoch = u32::from(input.byte() % 4);
                let cap = proto::grant::seal_at(&key, chunk, POOL_CHUNK, 0, epoch, rights);
                stream.extend(frame(FrameKind::Grant, &wire::Grant { handle, caps: vec![cap] }.encode()));
            }
        }
    }
    while let Some(f) = next_frame(&mut input, &KINDS) {
        stream.extend(f);
    }
    let host = host();
    let stats = FrontStats::default();
    let mut conn = NativeConn::new(offered, 4);
    let (mut rx, mut tx, mut closing) = (FrameBuffer::with_capacity(16 << 10), Vec::new(), false);
    for piece in stream.chunks(chunk) {
        rx.extend(piece);
        let mut link = Link {
            rx: &mut rx,
            tx: &mut tx,
            closing: &mut closing,
            peer: "fuzz",
            stats: &stats,
            backlog_max: usize::MAX,
            gate: Gate::new(None, false),
            later: Later::new(None),
        };
        conn.process(&mut link, host);
        if closing {
            break;
        }
    }
    check_replies(&tx, closing);
}

/// Everything queued parses as frames a target sends; a GOAWAY comes last and only when the
/// connection is closing.
fn check_replies(mut out: &[u8], closing: bool) {
    while !out.is_empty() {
        let h = Header::parse(out).expect("the target queued a broken header");
        let body = &out[wire::HEADER_LEN..h.frame_len()];
        out = &out[h.frame_len()..];
        match h.kind {
            FrameKind::Completions => {
                let c = CompletionCaravan::parse(&h, body).expect("a broken completion caravan");
                assert!(!c.is_empty(), "an empty completion caravan");
            }
            FrameKind::GoAway => {
                GoAway::decode(body).expect("a broken GOAWAY");
                assert!(out.is_empty() && closing, "a GOAWAY that is not the connection's last word");
            }
            FrameKind::HelloReply => {
                wire::HelloReply::decode(body).expect("a broken HELLO_REPLY");
            }
            FrameKind::OpenReply => {
                wire::OpenReply::decode(body).expect("a broken OPEN_REPLY");
            }
            FrameKind::ListReply => {
                wire::ExportInfo::decode_list(body).expect("a broken LIST_REPLY");
            }
            FrameKind::StatsReply => {
                StatsReply::decode(body).expect("a broken STATS_REPLY");
            }
            FrameKind::RevokeReply => {
                wire::RevokeReply::decode(body).expect("a broken REVOKE_REPLY");
            }
            FrameKind::GrantReply => {
                wire::GrantReply::decode(body).expect("a broken GRANT_REPLY");
            }
            FrameKind::VolumeReply => {
                wire::VolumeReply::decode(body).expect("a broken VOLUME_REPLY");
            }
            kind => panic!("the target sent a {kind:?} frame"),
        }
    }
}
