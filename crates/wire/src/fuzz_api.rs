//! Frame streams made from fuzzer bytes, for the session fuzz targets (`proto`, `engine`) and
//! their seeded smoke tests. Not part of the stable API.
//!
//! A fuzzer that had to find valid CRCs would spend its time on the header and never reach the
//! state machines behind it, so most frames here get a correct header computed from fuzzed
//! fields; some are passed through raw, so that broken headers are fuzzed too.

use crate::{FrameKind, Header, HEADER_LEN};

/// Every frame kind, in code order.
pub const KINDS: [FrameKind; 22] = [
    FrameKind::Hello,
    FrameKind::HelloReply,
    FrameKind::Open,
    FrameKind::OpenReply,
    FrameKind::List,
    FrameKind::ListReply,
    FrameKind::Stats,
    FrameKind::StatsReply,
    FrameKind::GoAway,
    FrameKind::Auth,
    FrameKind::AuthReply,
    FrameKind::Capabilities,
    FrameKind::Revoke,
    FrameKind::RevokeReply,
    FrameKind::Grant,
    FrameKind::GrantReply,
    FrameKind::Requests,
    FrameKind::Completions,
    FrameKind::Volume,
    FrameKind::VolumeReply,
    FrameKind::Register,
    FrameKind::RegisterReply,
];

/// SplitMix64, for the seeded smoke tests that drive these entry points on stable: tiny,
/// fast, and good enough to drive a mutator.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Bytes taken from the front of a fuzz input.
pub struct Input<'a>(pub &'a [u8]);

impl Input<'_> {
    pub fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else { return 0 };
        self.0 = rest;
        b
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `n` bytes (zeroes past the end of the input).
    pub fn take(&mut self, n: usize) -> Vec<u8> {
        let have = n.min(self.0.len());
        let mut v = self.0[..have].to_vec();
        self.0 = &self.0[have..];
        v.resize(n, 0);
        v
    }
}

/// One frame from the input: mostly a correct header for a kind from `kinds` with fuzzed
/// descriptor count and payload length, and a fuzzed body of that length; sometimes 24 raw
/// header bytes and a short raw body. `None` once the input is used up.
pub fn next_frame(input: &mut Input<'_>, kinds: &[FrameKind]) -> Option<Vec<u8>> {
    if input.is_empty() {
        return None;
    }
    let mode = input.byte();
    if mode % 16 == 15 {
        let mut raw = input.take(HEADER_LEN);
        let body = input.byte() as usize;
        raw.extend(input.take(body));
        return Some(raw);
    }
    let kind = kinds[input.byte() as usize % kinds.len()];
    let desc_count = if kind.is_caravan() { u16::from(input.byte() % 9) } else { 0 };
    let payload_len = u32::from(input.u16() % 9000);
    let header = Header { kind, desc_count, payload_len };
    let mut frame = header.to_bytes().to_vec();
    frame.extend(input.take(header.body_len()));
    Some(frame)
}
