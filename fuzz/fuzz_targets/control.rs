//! Control bodies straight into their decoders, without a header in the way.
//!
//! The first input byte picks the decoder (HELLO, HELLO_REPLY, OPEN, OPEN_REPLY, LIST_REPLY,
//! STATS_REPLY, GOAWAY, AUTH, AUTH_REPLY, REVOKE, GRANT, GRANT_REPLY, REVOKE_REPLY, VOLUME,
//! VOLUME_REPLY, modulo 15); the rest is the body. A body that decodes must encode back to
//! the same bytes. A decoded HELLO is also negotiated against the default limits, whose result
//! must respect the floors and orderings in `docs/PROTOCOL.md`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use skiff_wire::{
    Auth, AuthReply, ExportInfo, GoAway, Grant, GrantReply, Hello, HelloReply, Limits, Open, OpenReply, Revoke,
    RevokeReply, StatsReply, VolumeReply, VolumeRequest, HEADER_LEN,
};

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let encoded = match which % 15 {
        0 => Hello::decode(body).map(|hello| {
            check_negotiation(&hello.limits);
            hello.encode()
        }),
        1 => HelloReply::decode(body).map(|v| v.encode()),
        2 => Open::decode(body).map(|v| v.encode()),
        3 => OpenReply::decode(body).map(|v| v.encode()),
        4 => ExportInfo::decode_list(body).map(|v| ExportInfo::encode_list(&v)),
        5 => StatsReply::decode(body).map(|v| v.encode()),
        6 => GoAway::decode(body).map(|v| v.encode()),
        7 => Auth::decode(body).map(|v| v.encode()),
        8 => AuthReply::decode(body).map(|v| v.encode()),
        9 => Revoke::decode(body).map(|v| v.encode()),
        10 => Grant::decode(body).map(|v| v.encode()),
        11 => GrantReply::decode(body).map(|v| v.encode()),
        12 => RevokeReply::decode(body).map(|v| v.encode()),
        13 => VolumeRequest::decode(body).map(|v| v.encode()),
        _ => VolumeReply::decode(body).map(|v| v.encode()),
    };
    if let Ok(encoded) = encoded {
        assert_eq!(encoded, body);
    }
});

fn check_negotiation(proposed: &Limits) {
    for target in [Limits::default(), *proposed] {
        let got = target.negotiate(proposed);
        assert!(got.queue_depth >= 1);
        assert!((1..=got.queue_depth.min(u32::from(u16::MAX))).contains(&got.caravan_reqs_max));
        assert!(got.io_bytes_max >= 512);
        assert!(got.caravan_bytes_max >= got.io_bytes_max);
        assert_eq!(target.negotiate(&got), got);
        assert!(got.frame_bytes_max() >= HEADER_LEN + 64 * 1024);
    }
}
