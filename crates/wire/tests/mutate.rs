//! A deterministic fuzz smoke test that runs on stable in the normal suite.
//!
//! Valid frames of every kind are mutated with a seeded generator (bit flips, byte writes,
//! truncation, extension, insertion, deletion, splices, interesting integers) and fed through
//! `Header::parse` and the body parser for the frame's kind. Nothing may panic, and whatever
//! parses must re-encode to exactly the bytes it came from (every v1 encoding is canonical:
//! reserved bytes are zero, lengths are exact). Since a random mutation almost never keeps the
//! header CRC right, most cases re-stamp the CRC (and often the payload length) afterwards so
//! that the body parsers see the damage too.
//!
//! A failing case prints its seed. Replay it alone with
//! `SKIFF_MUTATE_SEED=0x... cargo test -p skiff-wire --test mutate`; run longer with
//! `SKIFF_MUTATE_ITERS=1000000`. The `cargo fuzz` targets in `fuzz/` do the same with coverage
//! guidance.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use skiff_wire::caravan::{CompletionCaravan, RequestCaravan};
use skiff_wire::control;
use skiff_wire::{
    Completion, ExportFlags, ExportInfo, FrameKind, GoAway, Header, Hello, HelloReply, Limits, Opcode, Open,
    OpenReply, ReqFlags, Request, StatsReply, Status, COMPLETION_DESC_LEN, HEADER_LEN, REQUEST_DESC_LEN,
};

const MASTER_SEED: u64 = 0x5EED_5C1F_F000_0001;
const ITERS_DEFAULT: u64 = 20_000;

/// splitmix64: tiny, fast and good enough to drive mutations; no `rand` dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..n`; `n` must be non-zero.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

// ---------------------------------------------------------------------------------------------
// Seed frames: one or more valid frames of every kind.

fn control_frame(kind: FrameKind, body: Vec<u8>) -> Vec<u8> {
    control::frame(kind, &body)
}

fn requests_frame(reqs: &[(Request, &[u8])]) -> Vec<u8> {
    let payload_len: u32 = reqs.iter().map(|(r, _)| r.payload_len()).sum();
    let header = Header { kind: FrameKind::Requests, desc_count: reqs.len() as u16, payload_len };
    let mut out = header.to_bytes().to_vec();
    for (req, _) in reqs {
        let mut desc = [0u8; REQUEST_DESC_LEN];
        req.emit(&mut desc);
        out.extend_from_slice(&desc);
    }
    for (_, payload) in reqs {
        out.extend_from_slice(payload);
    }
    out
}

fn completions_frame(comps: &[(Completion, &[u8])]) -> Vec<u8> {
    let payload_len: u32 = comps.iter().map(|(c, _)| c.data_len).sum();
    let header = Header { kind: FrameKind::Completions, desc_count: comps.len() as u16, payload_len };
    let mut out = header.to_bytes().to_vec();
    for (c, _) in comps {
        let mut desc = [0u8; COMPLETION_DESC_LEN];
        c.emit(&mut desc);
        out.extend_from_slice(&desc);
    }
    for (_, data) in comps {
        out.extend_from_slice(data);
    }
    out
}

fn seed_frames() -> Vec<Vec<u8>> {
    let limits = Limits::default();
    let export = |name: &str, flags| ExportInfo {
        name: name.into(),
        size_bytes: 1 << 30,
        block_size: 4096,
        flags: ExportFlags(flags),
    };
    let req = |opcode, flags, tag, offset, length| Request { opcode, flags, tag, handle: 1, offset, length };
    let write_data = [0x5Au8; 64];
    let read_data = [0xC3u8; 48];
    vec![
        control_frame(
            FrameKind::Hello,
            Hello { version_min: 1, version_max: 1, features: 0, limits, auth: None }.encode(),
        ),
        control_frame(
            FrameKind::HelloReply,
            HelloReply { status: Status::Ok, version: 1, features: 0, limits, auth_nonce: None }.encode(),
        ),
        control_frame(
            FrameKind::HelloReply,
            HelloReply {
                status: Status::VersionMismatch,
                version: 0,
                features: 0,
                limits: Limits { queue_depth: 0, caravan_reqs_max: 0, caravan_bytes_max: 0, io_bytes_max: 0 },
                auth_nonce: None,
            }
            .encode(),
        ),
        control_frame(
            FrameKind::Hello,
            Hello {
                version_min: 1,
                version_max: 1,
                features: 1,
                limits,
                auth: Some(skiff_wire::HelloAuth { key_name: "alice".into(), nonce: [5; 32] }),
            }
            .encode(),
        ),
        control_frame(
            FrameKind::HelloReply,
            HelloReply { status: Status::Ok, version: 1, features: 1, limits, auth_nonce: Some([6; 32]) }
                .encode(),
        ),
        control_frame(FrameKind::Auth, skiff_wire::Auth { proof: [7; 32] }.encode()),
        control_frame(
            FrameKind::AuthReply,
            skiff_wire::AuthReply { status: Status::AuthFailed, proof: [0; 32] }.encode(),
        ),
        control_frame(FrameKind::Open, Open { name: "disk0".into() }.encode()),
        control_frame(FrameKind::Open, Open { name: "日本語-export".into() }.encode()),
        control_frame(
            FrameKind::OpenReply,
            OpenReply {
                status: Status::Ok,
                handle: 7,
                size_bytes: 1 << 40,
                block_size: 512,
                flags: ExportFlags(0x1F),
            }
            .encode(),
        ),
        control_frame(FrameKind::OpenReply, OpenReply::refused(Status::NotFound).encode()),
        control_frame(FrameKind::List, Vec::new()),
        control_frame(FrameKind::ListReply, ExportInfo::encode_list(&[])),
        control_frame(
            FrameKind::ListReply,
            ExportInfo::encode_list(&[export("disk0", 0x1E), export("ro-é", 0x03)]),
        ),
        control_frame(FrameKind::Stats, Vec::new()),
        control_frame(
            FrameKind::StatsReply,
            StatsReply {
                entries: vec![
                    ("req_read".into(), 12),
                    ("bytes_read".into(), 12 * 4096),
                    ("caravan_reqs_hist_8".into(), u64::MAX),
                ],
            }
            .encode(),
        ),
        control_frame(
            FrameKind::GoAway,
            GoAway { status: Status::Invalid, message: "bad frame: CRC".into() }.encode(),
        ),
        control_frame(
            FrameKind::Revoke,
            skiff_wire::Revoke {
                handle: 1,
                action: skiff_wire::RevokeAction::Invalidate,
                offset: 4096,
                length: 8192,
            }
            .encode(),
        ),
        control_frame(
            FrameKind::RevokeReply,
            skiff_wire::RevokeReply { status: Status::Ok, epoch: 3 }.encode(),
        ),
        control_frame(
            FrameKind::Register,
            skiff_wire::Register {
                handle: 1,
                rights: skiff_wire::CapRights::READ,
                offset: 0,
                length: 64 << 30,
            }
            .encode(),
        ),
        control_frame(
            FrameKind::RegisterReply,
            skiff_wire::RegisterReply::refused(Status::Unsupported).encode(),
        ),
        control_frame(FrameKind::Capabilities, {
            let cap = skiff_wire::Capability {
                export: 0,
                kind: skiff_wire::CapKind::Slot,
                rights: skiff_wire::CapRights::READ,
                epoch: 1,
                generation: 2,
                offset: 8192,
                length: 4096,
                slot: 3,
                expires_ms: 60_000,
                mac: [7; 16],
            };
            let mut body = Vec::new();
            skiff_wire::Capability::encode_list(&[cap, cap], &mut body);
            body
        }),
        control_frame(
            FrameKind::Volume,
            skiff_wire::VolumeRequest {
                op: skiff_wire::VolumeOp::Clone,
                name: "clone-é".into(),
                origin: "snap".into(),
                size_bytes: 0,
            }
            .encode(),
        ),
        control_frame(
            FrameKind::VolumeReply,
            skiff_wire::VolumeReply {
                status: Status::Ok,
                op: skiff_wire::VolumeOp::List,
                message: "2 volumes".into(),
                body: skiff_wire::VolumeBody::List {
                    volumes: vec![skiff_wire::VolumeEntry {
                        name: "vol".into(),
                        size_bytes: 1 << 30,
                        allocated_bytes: 8192,
                        writable: true,
                        origin: "base".into(),
                        children: 3,
                    }],
                    more: true,
                },
            }
            .encode(),
        ),
        control_frame(
            FrameKind::VolumeReply,
            skiff_wire::VolumeReply {
                status: Status::Ok,
                op: skiff_wire::VolumeOp::Stats,
                message: String::new(),
                body: skiff_wire::VolumeBody::Stats(StatsReply { entries: vec![("checkpoints".into(), 9)] }),
            }
            .encode(),
        ),
        requests_frame(&[
            (req(Opcode::Read, ReqFlags::empty(), 1, 0, 4096), &[]),
            (req(Opcode::Write, ReqFlags::FUA, 2, 4096, 64), &write_data),
            (req(Opcode::Flush, ReqFlags::NO_DELAY, 3, 0, 0), &[]),
            (req(Opcode::Trim, ReqFlags::empty(), 4, 1 << 20, 1 << 16), &[]),
            (req(Opcode::WriteZeroes, ReqFlags::FUA | ReqFlags::NO_DELAY, 5, 1 << 33, 8192), &[]),
        ]),
        requests_frame(&[(req(Opcode::Write, ReqFlags::empty(), 9, 0, 16), &write_data[..16])]),
        requests_frame(&[]),
        completions_frame(&[
            (Completion { tag: 1, status: Status::Ok, data_len: 48 }, &read_data),
            (Completion { tag: 2, status: Status::OutOfRange, data_len: 0 }, &[]),
            (Completion { tag: 3, status: Status::Ok, data_len: 0 }, &[]),
        ]),
        completions_frame(&[]),
    ]
}

// ---------------------------------------------------------------------------------------------
// Mutations.

const INTERESTING: [u32; 12] =
    [0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x1_0000, 0x7FFF_FFFF, 0x8000_0000, u32::MAX];

fn mutate_once(rng: &mut Rng, bytes: &mut Vec<u8>, seeds: &[Vec<u8>]) {
    let len = bytes.len();
    match rng.below(9) {
        0 if len > 0 => {
            let at = rng.below(len);
            bytes[at] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let at = rng.below(len);
            bytes[at] = rng.byte();
        }
        2 if len > 0 => {
            let at = rng.below(len);
            bytes[at] = INTERESTING[rng.below(INTERESTING.len())] as u8;
        }
        3 => bytes.truncate(rng.below(len + 1)),
        4 => {
            let n = 1 + rng.below(64);
            bytes.extend((0..n).map(|_| rng.byte()));
        }
        5 => {
            let at = rng.below(len + 1);
            let n = 1 + rng.below(16);
            let fill: Vec<u8> = (0..n).map(|_| rng.byte()).collect();
            bytes.splice(at..at, fill);
        }
        6 if len > 0 => {
            let at = rng.below(len);
            let n = 1 + rng.below((len - at).min(32));
            bytes.drain(at..at + n);
        }
        7 if len >= 4 => {
            // A little-endian integer where a length or count might be.
            let v = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
            let width = [1, 2, 4][rng.below(3)];
            let at = rng.below(len - width + 1);
            bytes[at..at + width].copy_from_slice(&v[..width]);
        }
        8 => {
            // Splice in part of another valid frame.
            let other = &seeds[rng.below(seeds.len())];
            if !other.is_empty() {
                let from = rng.below(other.len());
                let n = 1 + rng.below(other.len() - from);
                let at = rng.below(len + 1);
                let end = (at + n).min(len);
                bytes.splice(at..end, other[from..from + n].iter().copied());
            }
        }
        _ => {}
    }
}

/// Make the header believable again after mutation, so the body parsers get exercised.
fn fix_up(rng: &mut Rng, bytes: &mut [u8]) {
    if bytes.len() < HEADER_LEN {
        return;
    }
    match rng.below(4) {
        0 => return, // raw: the header checks take the hit
        1 => {}      // CRC only
        _ => {
            // Payload length to match what is there, then CRC.
            let kind = FrameKind::from_u8(bytes[5]);
            let desc_len = kind.map_or(0, FrameKind::desc_len);
            let desc_count = u16::from_le_bytes([bytes[6], bytes[7]]) as usize;
            let rest = bytes.len() - HEADER_LEN;
            if let Some(payload) = rest.checked_sub(desc_count * desc_len) {
                bytes[8..12].copy_from_slice(&(payload as u32).to_le_bytes());
            }
        }
    }
    let crc = crc32c::crc32c(&bytes[..20]);
    bytes[20..24].copy_from_slice(&crc.to_le_bytes());
}

// ---------------------------------------------------------------------------------------------
// Checks.

#[derive(Default, Debug)]
struct Reached {
    header_ok: u64,
    caravan_ok: u64,
    requests_ok: u64,
    requests_refused: u64,
    control_ok: u64,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn check_frame(bytes: &[u8], reached: &mut Reached) {
    let Ok(header) = Header::parse(bytes) else {
        return;
    };
    reached.header_ok += 1;
    // A header that parses is canonical: re-emitting it gives the same 24 bytes.
    assert_eq!(header.to_bytes()[..], bytes[..HEADER_LEN], "header re-encoding");
    let rest = &bytes[HEADER_LEN..];
    // A stream reader takes exactly frame_len bytes; a datagram hands over whatever arrived.
    if let Some(exact) = rest.get(..header.body_len()) {
        check_body(&header, exact, reached);
    }
    if rest.len() != header.body_len() {
        check_body(&header, rest, reached);
    }
    // Control decoders are cheap: run them all on whatever body there is.
    check_control_decoders(rest, reached);
}

fn check_body(header: &Header, body: &[u8], reached: &mut Reached) {
    match header.kind {
        FrameKind::Requests => check_requests(header, body, reached),
        FrameKind::Completions => check_completions(header, body, reached),
        kind => {
            if body.len() != header.body_len() {
                return; // a stream reader would not have handed this over
            }
            check_control(kind, body, reached);
        }
    }
}

fn check_requests(header: &Header, body: &[u8], reached: &mut Reached) {
    let Ok(caravan) = RequestCaravan::parse(header, body) else {
        return;
    };
    reached.caravan_ok += 1;
    assert_eq!(body.len(), header.body_len());
    assert_eq!(caravan.len(), usize::from(header.desc_count));
    let descs_len = caravan.payload_offset_in_body();
    let mut payloads = Vec::new();
    for (i, (result, payload)) in caravan.iter().enumerate() {
        let desc = &body[i * REQUEST_DESC_LEN..(i + 1) * REQUEST_DESC_LEN];
        assert_eq!(payload.len(), u32_at(desc, 24) as usize, "payload slice of descriptor {i}");
        match result {
            Ok(req) => {
                reached.requests_ok += 1;
                let mut out = [0u8; REQUEST_DESC_LEN];
                req.emit(&mut out);
                assert_eq!(out[..], desc[..], "request {i} re-encoding");
                assert_eq!(req.payload_len() as usize, payload.len());
            }
            Err(e) => {
                reached.requests_refused += 1;
                assert_eq!(e.tag, u32_at(desc, 4));
                assert!(matches!(e.status, Status::UnknownOpcode | Status::Invalid), "{e:?}");
            }
        }
        payloads.extend_from_slice(payload);
    }
    // The payloads tile the payload section exactly, in descriptor order.
    assert_eq!(payloads[..], body[descs_len..]);
}

fn check_completions(header: &Header, body: &[u8], reached: &mut Reached) {
    let head = CompletionCaravan::parse_head(header, body);
    let Ok(caravan) = CompletionCaravan::parse(header, body) else {
        return;
    };
    // What a receiver decides from the descriptors alone (placing read data directly)
    // agrees with the whole frame.
    let head = head.expect("a frame that parses has descriptors that parse");
    assert!(head.completions().eq(caravan.iter().map(|(c, _)| c)));
    reached.caravan_ok += 1;
    assert_eq!(body.len(), header.body_len());
    assert_eq!(caravan.len(), usize::from(header.desc_count));
    let descs_len = caravan.len() * COMPLETION_DESC_LEN;
    let mut payloads = Vec::new();
    for (i, (completion, data)) in caravan.iter().enumerate() {
        let desc = &body[i * COMPLETION_DESC_LEN..(i + 1) * COMPLETION_DESC_LEN];
        assert_eq!(data.len(), completion.data_len as usize);
        let mut out = [0u8; COMPLETION_DESC_LEN];
        completion.emit(&mut out);
        assert_eq!(out[..], desc[..], "completion {i} re-encoding");
        payloads.extend_from_slice(data);
    }
    assert_eq!(payloads[..], body[descs_len..]);
}

/// Decode `body` as a control frame of `kind`; if it decodes, the encoder must give the same
/// bytes back (and so the same frame).
fn check_control(kind: FrameKind, body: &[u8], reached: &mut Reached) {
    let encoded = match kind {
        FrameKind::Hello => Hello::decode(body).map(|v| v.encode()),
        FrameKind::HelloReply => HelloReply::decode(body).map(|v| v.encode()),
        FrameKind::Open => Open::decode(body).map(|v| v.encode()),
        FrameKind::OpenReply => OpenReply::decode(body).map(|v| v.encode()),
        FrameKind::ListReply => ExportInfo::decode_list(body).map(|v| ExportInfo::encode_list(&v)),
        FrameKind::StatsReply => StatsReply::decode(body).map(|v| v.encode()),
        FrameKind::GoAway => GoAway::decode(body).map(|v| v.encode()),
        FrameKind::Revoke => skiff_wire::Revoke::decode(body).map(|v| v.encode()),
        FrameKind::Auth => skiff_wire::Auth::decode(body).map(|v| v.encode()),
        FrameKind::AuthReply => skiff_wire::AuthReply::decode(body).map(|v| v.encode()),
        FrameKind::RevokeReply => skiff_wire::RevokeReply::decode(body).map(|v| v.encode()),
        FrameKind::Grant => skiff_wire::Grant::decode(body).map(|v| v.encode()),
        FrameKind::GrantReply => skiff_wire::GrantReply::decode(body).map(|v| v.encode()),
        FrameKind::Volume => skiff_wire::VolumeRequest::decode(body).map(|v| v.encode()),
        FrameKind::VolumeReply => skiff_wire::VolumeReply::decode(body).map(|v| v.encode()),
        FrameKind::Register => skiff_wire::Register::decode(body).map(|v| v.encode()),
        FrameKind::RegisterReply => skiff_wire::RegisterReply::decode(body).map(|v| v.encode()),
        FrameKind::Capabilities => {
            let mut caps = Vec::new();
            skiff_wire::Capability::decode_list(body, |c| caps.push(c)).map(|()| {
                let mut out = Vec::new();
                skiff_wire::Capability::encode_list(&caps, &mut out);
                out
            })
        }
        // LIST and STATS have no body and no decoder; the receiver checks for emptiness.
        FrameKind::List | FrameKind::Stats => return,
        FrameKind::Requests | FrameKind::Completions => unreachable!(),
    };
    if let Ok(encoded) = encoded {
        reached.control_ok += 1;
        assert_eq!(encoded, body, "{kind:?} re-encoding");
    }
}

fn check_control_decoders(body: &[u8], reached: &mut Reached) {
    for kind in [
        FrameKind::Hello,
        FrameKind::HelloReply,
        FrameKind::Open,
        FrameKind::OpenReply,
        FrameKind::ListReply,
        FrameKind::StatsReply,
        FrameKind::GoAway,
        FrameKind::Capabilities,
        FrameKind::Revoke,
        FrameKind::RevokeReply,
        FrameKind::Grant,
        FrameKind::GrantReply,
        FrameKind::Auth,
        FrameKind::AuthReply,
        FrameKind::Volume,
        FrameKind::VolumeReply,
        FrameKind::Register,
        FrameKind::RegisterReply,
    ] {
        check_control(kind, body, reached);
    }
}

// ---------------------------------------------------------------------------------------------
// Driver.

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{name}={v} is not a number")))
}

fn case_seed(i: u64) -> u64 {
    Rng(MASTER_SEED ^ i.wrapping_mul(0xD6E8_FEB8_6659_FD93)).next()
}

/// One case, fully determined by its seed.
fn run_case(seed: u64, seeds: &[Vec<u8>], reached: &mut Reached) {
    let mut rng = Rng(seed);
    let base = rng.below(seeds.len());
    let mut bytes = seeds[base].clone();
    for _ in 0..1 + rng.below(4) {
        mutate_once(&mut rng, &mut bytes, seeds);
    }
    fix_up(&mut rng, &mut bytes);
    let outcome = catch_unwind(AssertUnwindSafe(|| check_frame(&bytes, reached)));
    if let Err(panic) = outcome {
        eprintln!(
            "mutate: failing case seed={seed:#018x} (from seed frame {base}); replay with \
             SKIFF_MUTATE_SEED={seed:#x} cargo test -p skiff-wire --test mutate\n  input ({} \
             bytes): {}",
            bytes.len(),
            bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        resume_unwind(panic);
    }
}

#[test]
fn seed_frames_are_valid() {
    // The unmutated frames must pass every check and decode, or the smoke test proves little.
    let mut reached = Reached::default();
    let seeds = seed_frames();
    for frame in &seeds {
        check_frame(frame, &mut reached);
    }
    assert_eq!(reached.header_ok, seeds.len() as u64);
    // 11 control frames with decoders, 5 caravans.
    assert_eq!(reached.caravan_ok, 5);
    assert!(reached.control_ok >= 11, "{reached:?}");
}

#[test]
fn mutated_frames_never_panic_and_round_trip() {
    let seeds = seed_frames();
    let mut reached = Reached::default();
    if let Some(seed) = env_u64("SKIFF_MUTATE_SEED") {
        run_case(seed, &seeds, &mut reached);
        eprintln!("mutate: replayed {seed:#x}: {reached:?}");
        return;
    }
    let iters = env_u64("SKIFF_MUTATE_ITERS").unwrap_or(ITERS_DEFAULT);
    for i in 0..iters {
        run_case(case_seed(i), &seeds, &mut reached);
    }
    eprintln!("mutate: {iters} cases: {reached:?}");
    // Guard against a smoke test that stopped reaching the body parsers.
    if iters >= ITERS_DEFAULT {
        assert!(reached.header_ok > iters / 4, "{reached:?}");
        assert!(reached.caravan_ok > iters / 40, "{reached:?}");
        assert!(reached.requests_refused > iters / 400, "{reached:?}");
        assert!(reached.control_ok > iters / 10, "{reached:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Negotiation under random proposals.

fn random_limit(rng: &mut Rng) -> u32 {
    match rng.below(4) {
        0 => 0,
        1 => INTERESTING[rng.below(INTERESTING.len())],
        2 => rng.below(1 << 12) as u32,
        _ => rng.next() as u32,
    }
}

fn random_limits(rng: &mut Rng) -> Limits {
    Limits {
        queue_depth: random_limit(rng),
        caravan_reqs_max: random_limit(rng),
        caravan_bytes_max: random_limit(rng),
        io_bytes_max: random_limit(rng),
    }
}

#[test]
fn negotiation_invariants() {
    let mut rng = Rng(MASTER_SEED);
    for _ in 0..20_000 {
        let target = random_limits(&mut rng);
        let proposed = random_limits(&mut rng);
        let got = target.negotiate(&proposed);
        let ctx = format!("{target:?} x {proposed:?} = {got:?}");
        assert!(got.queue_depth >= 1, "{ctx}");
        assert!(got.caravan_reqs_max >= 1, "{ctx}");
        assert!(got.caravan_reqs_max <= got.queue_depth, "{ctx}");
        assert!(got.caravan_reqs_max <= u32::from(u16::MAX), "{ctx}");
        assert!(got.io_bytes_max >= 512, "{ctx}");
        assert!(got.caravan_bytes_max >= got.io_bytes_max, "{ctx}");
        // Never more than a non-zero proposal asked for, above the floors.
        let within = |got: u32, asked: u32, floor: u32| asked == 0 || got <= asked.max(floor);
        assert!(within(got.queue_depth, proposed.queue_depth, 1), "{ctx}");
        assert!(within(got.caravan_reqs_max, proposed.caravan_reqs_max, 1), "{ctx}");
        assert!(within(got.io_bytes_max, proposed.io_bytes_max, 512), "{ctx}");
        // Negotiating again with the result changes nothing.
        assert_eq!(target.negotiate(&got), got, "{ctx}");
        assert!(got.frame_bytes_max() >= HEADER_LEN + control::CONTROL_BODY_MAX, "{ctx}");
    }
}
