//! Whole frames: `Header::parse`, then the body parser for the frame's kind.
//!
//! The first input byte picks how believable the header is made before parsing: `0` leaves the
//! bytes alone (so the header checks themselves are fuzzed), `1` re-stamps the CRC, `2` and `3`
//! also set `payload_len` to what actually follows. Without that, almost every input would stop
//! at the CRC and the body parsers would never be reached. The rest of the input is the frame.
//!
//! Anything that parses must re-encode to exactly the bytes it came from: every v1 encoding is
//! canonical. `crates/wire/tests/mutate.rs` runs the same checks on stable with seeded
//! mutations.
#![no_main]

use libfuzzer_sys::fuzz_target;
use skiff_wire::caravan::{CompletionCaravan, RequestCaravan};
use skiff_wire::{
    ExportInfo, FrameKind, GoAway, Header, Hello, HelloReply, Open, OpenReply, StatsReply, Status, VolumeReply,
    VolumeRequest, COMPLETION_DESC_LEN, HEADER_LEN, REQUEST_DESC_LEN,
};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, frame)) = data.split_first() else {
        return;
    };
    let mut frame = frame.to_vec();
    fix_up(mode, &mut frame);
    check_frame(&frame);
});

fn fix_up(mode: u8, bytes: &mut [u8]) {
    if bytes.len() < HEADER_LEN || mode & 3 == 0 {
        return;
    }
    if mode & 2 != 0 {
        let desc_len = FrameKind::from_u8(bytes[5]).map_or(0, FrameKind::desc_len);
        let desc_count = u16::from_le_bytes([bytes[6], bytes[7]]) as usize;
        if let Some(payload) = (bytes.len() - HEADER_LEN).checked_sub(desc_count * desc_len) {
            bytes[8..12].copy_from_slice(&(payload as u32).to_le_bytes());
        }
    }
    let crc = crc32c::crc32c(&bytes[..20]);
    bytes[20..24].copy_from_slice(&crc.to_le_bytes());
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn check_frame(bytes: &[u8]) {
    let Ok(header) = Header::parse(bytes) else {
        return;
    };
    assert_eq!(header.to_bytes()[..], bytes[..HEADER_LEN]);
    let rest = &bytes[HEADER_LEN..];
    if let Some(exact) = rest.get(..header.body_len()) {
        check_body(&header, exact);
    }
    if rest.len() != header.body_len() {
        check_body(&header, rest);
    }
}

fn check_body(header: &Header, body: &[u8]) {
    match header.kind {
        FrameKind::Requests => check_requests(header, body),
        FrameKind::Completions => check_completions(header, body),
        kind if body.len() == header.body_len() => check_control(kind, body),
        _ => {}
    }
}

fn check_requests(header: &Header, body: &[u8]) {
    let Ok(caravan) = RequestCaravan::parse(header, body) else {
        return;
    };
    assert_eq!(body.len(), header.body_len());
    assert_eq!(caravan.len(), usize::from(header.desc_count));
    let mut payloads = Vec::new();
    for (i, (result, payload)) in caravan.iter().enumerate() {
        let desc = &body[i * REQUEST_DESC_LEN..(i + 1) * REQUEST_DESC_LEN];
        assert_eq!(payload.len(), u32_at(desc, 24) as usize);
        match result {
            Ok(req) => {
                let mut out = [0u8; REQUEST_DESC_LEN];
                req.emit(&mut out);
                assert_eq!(out[..], desc[..]);
            }
            Err(e) => {
                assert_eq!(e.tag, u32_at(desc, 4));
                assert!(matches!(e.status, Status::UnknownOpcode | Status::Invalid));
            }
        }
        payloads.extend_from_slice(payload);
    }
    assert_eq!(payloads[..], body[caravan.payload_offset_in_body()..]);
}

fn check_completions(header: &Header, body: &[u8]) {
    let head = CompletionCaravan::parse_head(header, body);
    let Ok(caravan) = CompletionCaravan::parse(header, body) else {
        return;
    };
    // What a receiver decides from the descriptors alone (placing read data directly)
    // agrees with the whole frame.
    let head = head.expect("a frame that parses has descriptors that parse");
    assert!(head.completions().eq(caravan.iter().map(|(c, _)| c)));
    assert_eq!(body.len(), header.body_len());
    let mut payloads = Vec::new();
    for (i, (completion, data)) in caravan.iter().enumerate() {
        let desc = &body[i * COMPLETION_DESC_LEN..(i + 1) * COMPLETION_DESC_LEN];
        assert_eq!(data.len(), completion.data_len as usize);
        let mut out = [0u8; COMPLETION_DESC_LEN];
        completion.emit(&mut out);
        assert_eq!(out[..], desc[..]);
        payloads.extend_from_slice(data);
    }
    assert_eq!(payloads[..], body[caravan.len() * COMPLETION_DESC_LEN..]);
}

fn check_control(kind: FrameKind, body: &[u8]) {
    let encoded = match kind {
        FrameKind::Hello => Hello::decode(body).map(|v| v.encode()),
        FrameKind::HelloReply => HelloReply::decode(body).map(|v| v.encode()),
        FrameKind::Open => Open::decode(body).map(|v| v.encode()),
        FrameKind::OpenReply => OpenReply::decode(body).map(|v| v.encode()),
        FrameKind::ListReply => ExportInfo::decode_list(body).map(|v| ExportInfo::encode_list(&v)),
        FrameKind::StatsReply => StatsReply::decode(body).map(|v| v.encode()),
        FrameKind::GoAway => GoAway::decode(body).map(|v| v.encode()),
        FrameKind::Volume => VolumeRequest::decode(body).map(|v| v.encode()),
        FrameKind::VolumeReply => VolumeReply::decode(body).map(|v| v.encode()),
        _ => return,
    };
    if let Ok(encoded) = encoded {
        assert_eq!(encoded, body, "{kind:?}");
    }
}
