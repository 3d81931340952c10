//! Control frames: the handshake, opening and listing exports, stats and the parting GOAWAY.
//!
//! Control bodies are small and rare (a handful per connection), so they are hand-encoded
//! little-endian fields with length-prefixed strings, and they may allocate. Every decoder
//! rejects trailing bytes, over-long strings and non-UTF-8 names.

use crate::header::{FrameKind, Header, HEADER_LEN};
use crate::status::Status;
use crate::{Result, WireError};

/// Largest control body either side accepts.
pub const CONTROL_BODY_MAX: usize = 64 * 1024;
/// Longest export name, in bytes of UTF-8.
pub const EXPORT_NAME_MAX: usize = 255;
/// Longest GOAWAY message.
pub const MESSAGE_MAX: usize = 1024;

/// Build a whole control frame (header and body).
pub fn frame(kind: FrameKind, body: &[u8]) -> Vec<u8> {
    debug_assert!(!kind.is_caravan() && body.len() <= CONTROL_BODY_MAX);
    let mut out = vec![0u8; HEADER_LEN + body.len()];
    Header { kind, desc_count: 0, payload_len: body.len() as u32 }.emit(&mut out);
    out[HEADER_LEN..].copy_from_slice(body);
    out
}

/// Limits negotiated once per connection in the handshake. Both sides propose; each field
/// becomes the smaller proposal (a proposal of zero means "no preference").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Requests one lane may have outstanding.
    pub queue_depth: u32,
    /// Descriptors in one caravan.
    pub caravan_reqs_max: u32,
    /// Payload bytes in one caravan (request or completion).
    pub caravan_bytes_max: u32,
    /// Length of a single read or write.
    pub io_bytes_max: u32,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { queue_depth: 256, caravan_reqs_max: 64, caravan_bytes_max: 2 << 20, io_bytes_max: 1 << 20 }
    }
}

impl Limits {
    const ENCODED_LEN: usize = 16;
    /// Floors no negotiation goes below: one request of one 512-byte block.
    const IO_BYTES_MIN: u32 = 512;

    /// The server's side of negotiation: combine its own limits with the client's proposal.
    pub fn negotiate(&self, proposed: &Limits) -> Limits {
        let pick = |mine: u32, theirs: u32| if theirs == 0 { mine } else { mine.min(theirs) };
        let queue_depth = pick(self.queue_depth, proposed.queue_depth).max(1);
        let caravan_reqs_max =
            pick(self.caravan_reqs_max, proposed.caravan_reqs_max).clamp(1, queue_depth.min(u16::MAX as u32));
        let io_bytes_max = pick(self.io_bytes_max, proposed.io_bytes_max).max(Self::IO_BYTES_MIN);
        let caravan_bytes_max = pick(self.caravan_bytes_max, proposed.caravan_bytes_max).max(io_bytes_max);
        Limits { queue_depth, caravan_reqs_max, caravan_bytes_max, io_bytes_max }
    }

    /// Largest frame a peer may send under these limits (request caravans are the largest).
    pub fn frame_bytes_max(&self) -> usize {
        let caravan = HEADER_LEN
            + self.caravan_reqs_max as usize * crate::REQUEST_DESC_LEN
            + self.caravan_bytes_max as usize;
        caravan.max(HEADER_LEN + CONTROL_BODY_MAX)
    }

    fn put(&self, w: &mut Vec<u8>) {
        for v in [self.queue_depth, self.caravan_reqs_max, self.caravan_bytes_max, self.io_bytes_max] {
            w.extend_from_slice(&v.to_le_bytes());
        }
    }

    fn get(r: &mut Reader<'_>) -> Result<Limits> {
        Ok(Limits {
            queue_depth: r.u32()?,
            caravan_reqs_max: r.u32()?,
            caravan_bytes_max: r.u32()?,
            io_bytes_max: r.u32()?,
        })
    }
}

/// HELLO feature bit 0: the initiator authenticates with a key (HELLO carries the key name and
/// a nonce, HELLO_REPLY a nonce, then `AUTH` and `AUTH_REPLY`; docs/PROTOCOL.md, section 15).
pub const FEATURE_AUTH: u64 = 1 << 0;
/// Bytes of a handshake nonce and of an authentication proof.
pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;
/// Longest key name.
pub const KEY_NAME_MAX: usize = 64;

/// HELLO feature bit 1: the initiator reads directly with capabilities (`WANT_CAP` reads,
/// `DIRECT_READ` requests, `CAPABILITIES` frames; docs/PROTOCOL.md, section 8). The target
/// echoes it in HELLO_REPLY when it serves direct reads.
pub const FEATURE_DIRECT_READS: u64 = 1 << 1;

/// HELLO feature bit 2: the read data of completion caravans travels apart from the byte
/// stream, in the transport's data messages placed by tag and offset (raw Ethernet's Place
/// datagrams; docs/PROTOCOL.md, section 16.9). Offered by an initiator whose transport can take
/// them, echoed by a target whose transport sends them; a caravan's frame on the stream then
/// ends after its descriptors.
pub const FEATURE_DATA_MESSAGES: u64 = 1 << 2;

/// What an authenticating initiator adds to HELLO ([`FEATURE_AUTH`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloAuth {
    pub key_name: String,
    pub nonce: [u8; NONCE_LEN],
}

/// First frame from the initiator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version_min: u8,
    pub version_max: u8,
    /// Feature bits the initiator wants ([`FEATURE_AUTH`], [`FEATURE_DIRECT_READS`]).
    pub features: u64,
    pub limits: Limits,
    /// Present exactly when `features` has [`FEATURE_AUTH`].
    pub auth: Option<HelloAuth>,
}

impl Hello {
    /// A HELLO without authentication.
    pub fn plain(version_min: u8, version_max: u8, features: u64, limits: Limits) -> Hello {
        Hello { version_min, version_max, features: features & !FEATURE_AUTH, limits, auth: None }
    }

    pub fn encode(&self) -> Vec<u8> {
        debug_assert_eq!(self.auth.is_some(), self.features & FEATURE_AUTH != 0);
        let mut w = Vec::with_capacity(12 + Limits::ENCODED_LEN);
        w.extend_from_slice(&[self.version_min, self.version_max, 0, 0]);
        w.extend_from_slice(&self.features.to_le_bytes());
        self.limits.put(&mut w);
        if let Some(a) = &self.auth {
            put_str16(&mut w, truncate_utf8(&a.key_name, KEY_NAME_MAX));
            w.extend_from_slice(&a.nonce);
        }
        w
    }

    pub fn decode(body: &[u8]) -> Result<Hello> {
        let mut r = Reader::new(body, "HELLO")?;
        let version_min = r.u8()?;
        let version_max = r.u8()?;
        r.zero(2)?;
        let features = r.u64()?;
        let limits = Limits::get(&mut r)?;
        let auth = if features & FEATURE_AUTH != 0 {
            let key_name = r.str16(KEY_NAME_MAX)?;
            Some(HelloAuth { key_name, nonce: r.array()? })
        } else {
            None
        };
        r.end()?;
        Ok(Hello { version_min, version_max, features, limits, auth })
    }
}

/// AUTH (32 bytes): the initiator's proof of its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Auth {
    pub proof: [u8; PROOF_LEN],
}

impl Auth {
    pub fn encode(&self) -> Vec<u8> {
        self.proof.to_vec()
    }

    pub fn decode(body: &[u8]) -> Result<Auth> {
        let mut r = Reader::new(body, "AUTH")?;
        let proof = r.array()?;
        r.end()?;
        Ok(Auth { proof })
    }
}

/// AUTH_REPLY (36 bytes): the verdict and, when it is `Ok`, the target's proof of the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthReply {
    pub status: Status,
    pub proof: [u8; PROOF_LEN],
}

impl AuthReply {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(4 + PROOF_LEN);
        w.extend_from_slice(&self.status.to_u16().to_le_bytes());
        w.extend_from_slice(&[0, 0]);
        w.extend_from_slice(&self.proof);
        w
    }

    pub fn decode(body: &[u8]) -> Result<AuthReply> {
        let mut r = Reader::new(body, "AUTH_REPLY")?;
        let status = Status::from_u16(r.u16()?);
        r.zero(2)?;
        let proof = r.array()?;
        r.end()?;
        Ok(AuthReply { status, proof })
    }
}

/// The target's answer to HELLO: the chosen version, agreed features and negotiated limits.
/// A status other than `Ok` (no common version) is followed by the target closing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloReply {
    pub status: Status,
    pub version: u8,
    pub features: u64,
    pub limits: Limits,
    /// The target's nonce, present exactly when `status` is `Ok` and `features` has
    /// [`FEATURE_AUTH`].
    pub auth_nonce: Option<[u8; NONCE_LEN]>,
}

impl HelloReply {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(12 + Limits::ENCODED_LEN);
        w.extend_from_slice(&self.status.to_u16().to_le_bytes());
        w.extend_from_slice(&[self.version, 0]);
        w.extend_from_slice(&self.features.to_le_bytes());
        self.limits.put(&mut w);
        if let Some(nonce) = &self.auth_nonce {
            w.extend_from_slice(nonce);
        }
        w
    }

    pub fn decode(body: &[u8]) -> Result<HelloReply> {
        let mut r = Reader::new(body, "HELLO_REPLY")?;
        let status = Status::from_u16(r.u16()?);
        let version = r.u8()?;
        r.zero(1)?;
        let features = r.u64()?;
        let limits = Limits::get(&mut r)?;
        let auth_nonce =
            if status == Status::Ok && features & FEATURE_AUTH != 0 { Some(r.array()?) } else { None };
        r.end()?;
        Ok(HelloReply { status, version, features, limits, auth_nonce })
    }
}

/// OPEN: ask for an export by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    pub name: String,
}

impl Open {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::new();
        put_str16(&mut w, &self.name);
        w
    }

    pub fn decode(body: &[u8]) -> Result<Open> {
        let mut r = Reader::new(body, "OPEN")?;
        let name = r.str16(EXPORT_NAME_MAX)?;
        r.end()?;
        Ok(Open { name })
    }
}

/// What an export offers, as bits in OPEN and LIST replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExportFlags(pub u32);

impl ExportFlags {
    pub const READ_ONLY: u32 = 1 << 0;
    pub const CAN_FLUSH: u32 = 1 << 1;
    pub const CAN_FUA: u32 = 1 << 2;
    pub const CAN_TRIM: u32 = 1 << 3;
    pub const CAN_WRITE_ZEROES: u32 = 1 << 4;

    pub fn has(self, bit: u32) -> bool {
        self.0 & bit != 0
    }
}

/// The answer to OPEN. On a status other than `Ok` the other fields are zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenReply {
    pub status: Status,
    pub handle: u32,
    pub size_bytes: u64,
    pub block_size: u32,
    pub flags: ExportFlags,
}

impl OpenReply {
    pub fn refused(status: Status) -> OpenReply {
        OpenReply { status, handle: 0, size_bytes: 0, block_size: 0, flags: ExportFlags(0) }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(24);
        w.extend_from_slice(&self.status.to_u16().to_le_bytes());
        w.extend_from_slice(&[0, 0]);
        w.extend_from_slice(&self.handle.to_le_bytes());
        w.extend_from_slice(&self.size_bytes.to_le_bytes());
        w.extend_from_slice(&self.block_size.to_le_bytes());
        w.extend_from_slice(&self.flags.0.to_le_bytes());
        w
    }

    pub fn decode(body: &[u8]) -> Result<OpenReply> {
        let mut r = Reader::new(body, "OPEN_REPLY")?;
        let status = Status::from_u16(r.u16()?);
        r.zero(2)?;
        let reply = OpenReply {
            status,
            handle: r.u32()?,
            size_bytes: r.u64()?,
            block_size: r.u32()?,
            flags: ExportFlags(r.u32()?),
        };
        r.end()?;
        Ok(reply)
    }
}

/// One export as LIST describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub size_bytes: u64,
    pub block_size: u32,
    pub flags: ExportFlags,
}

impl ExportInfo {
    /// Body of a LIST_REPLY: a count, then each export. The reply must fit one control body,
    /// so a target with more exports than fit lists the first ones that do.
    pub fn encode_list(exports: &[ExportInfo]) -> Vec<u8> {
        let mut w = vec![0, 0];
        let mut count: u16 = 0;
        for e in exports {
            let name = truncate_utf8(&e.name, EXPORT_NAME_MAX);
            if w.len() + 2 + name.len() + 16 > CONTROL_BODY_MAX || count == u16::MAX {
                break;
            }
            put_str16(&mut w, name);
            w.extend_from_slice(&e.size_bytes.to_le_bytes());
            w.extend_from_slice(&e.block_size.to_le_bytes());
            w.extend_from_slice(&e.flags.0.to_le_bytes());
            count += 1;
        }
        w[..2].copy_from_slice(&count.to_le_bytes());
        w
    }

    pub fn decode_list(body: &[u8]) -> Result<Vec<ExportInfo>> {
        let mut r = Reader::new(body, "LIST_REPLY")?;
        let count = r.u16()?;
        let mut out = Vec::with_capacity(usize::from(count).min(1024));
        for _ in 0..count {
            out.push(ExportInfo {
                name: r.str16(EXPORT_NAME_MAX)?,
                size_bytes: r.u64()?,
                block_size: r.u32()?,
                flags: ExportFlags(r.u32()?),
            });
        }
        r.end()?;
        Ok(out)
    }
}

/// STATS_REPLY: named 64-bit counters, in the order the target chose. Self-describing so that
/// new counters need no protocol change.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StatsReply {
    pub entries: Vec<(String, u64)>,
}

impl StatsReply {
    pub fn get(&self, name: &str) -> Option<u64> {
        self.entries.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::new();
        self.put(&mut w);
        w
    }

    /// Append the counters (also the body of a `VOLUME_REPLY` to a stats request).
    pub(crate) fn put(&self, w: &mut Vec<u8>) {
        w.extend_from_slice(&(self.entries.len() as u16).to_le_bytes());
        for (name, value) in &self.entries {
            let name = truncate_utf8(name, u8::MAX as usize);
            w.push(name.len() as u8);
            w.extend_from_slice(name.as_bytes());
            w.extend_from_slice(&value.to_le_bytes());
        }
    }

    pub fn decode(body: &[u8]) -> Result<StatsReply> {
        let mut r = Reader::new(body, "STATS_REPLY")?;
        let stats = StatsReply::read_from(&mut r)?;
        r.end()?;
        Ok(stats)
    }

    pub(crate) fn read_from(r: &mut Reader<'_>) -> Result<StatsReply> {
        let count = r.u16()?;
        let mut entries = Vec::with_capacity(usize::from(count).min(1024));
        for _ in 0..count {
            let len = r.u8()? as usize;
            let name = r.utf8(len)?;
            entries.push((name, r.u64()?));
        }
        Ok(StatsReply { entries })
    }
}

/// What a REVOKE does to an export's capabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RevokeAction {
    /// Rotate the export's key epoch: every capability of it becomes stale.
    RotateEpoch = 1,
    /// Drop the cached blocks of a range: their capabilities become stale.
    Invalidate = 2,
}

/// REVOKE (24 bytes): revoke capabilities of an export this connection opened for writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Revoke {
    pub handle: u32,
    pub action: RevokeAction,
    /// The range, for [`RevokeAction::Invalidate`]; zero otherwise.
    pub offset: u64,
    pub length: u64,
}

impl Revoke {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(24);
        w.extend_from_slice(&self.handle.to_le_bytes());
        w.extend_from_slice(&[self.action as u8, 0, 0, 0]);
        w.extend_from_slice(&self.offset.to_le_bytes());
        w.extend_from_slice(&self.length.to_le_bytes());
        w
    }

    pub fn decode(body: &[u8]) -> Result<Revoke> {
        let mut r = Reader::new(body, "REVOKE")?;
        let handle = r.u32()?;
        let action = match r.u8()? {
            1 => RevokeAction::RotateEpoch,
            2 => RevokeAction::Invalidate,
            _ => return Err(WireError::Body("REVOKE action")),
        };
        r.zero(3)?;
        let offset = r.u64()?;
        let length = r.u64()?;
        r.end()?;
        if action == RevokeAction::RotateEpoch && (offset != 0 || length != 0) {
            return Err(WireError::Body("REVOKE range with a key rotation"));
        }
        Ok(Revoke { handle, action, offset, length })
    }
}

/// REVOKE_REPLY (8 bytes): the status, and the export's key epoch after the REVOKE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RevokeReply {
    pub status: Status,
    pub epoch: u32,
}

impl RevokeReply {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(8);
        w.extend_from_slice(&self.status.to_u16().to_le_bytes());
        w.extend_from_slice(&[0, 0]);
        w.extend_from_slice(&self.epoch.to_le_bytes());
        w
    }

    pub fn decode(body: &[u8]) -> Result<RevokeReply> {
        let mut r = Reader::new(body, "REVOKE_REPLY")?;
        let status = Status::from_u16(r.u16()?);
        r.zero(2)?;
        let epoch = r.u32()?;
        r.end()?;
        Ok(RevokeReply { status, epoch })
    }
}

/// GOAWAY: the sender is about to close the connection, and says why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoAway {
    pub status: Status,
    pub message: String,
}

impl GoAway {
    pub fn encode(&self) -> Vec<u8> {
        let msg = truncate_utf8(&self.message, MESSAGE_MAX);
        let mut w = Vec::with_capacity(4 + msg.len());
        w.extend_from_slice(&self.status.to_u16().to_le_bytes());
        put_str16(&mut w, msg);
        w
    }

    pub fn decode(body: &[u8]) -> Result<GoAway> {
        let mut r = Reader::new(body, "GOAWAY")?;
        let status = Status::from_u16(r.u16()?);
        let message = r.str16(MESSAGE_MAX)?;
        r.end()?;
        Ok(GoAway { status, message })
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary, so a
/// shortened string is still valid UTF-8 for the peer's decoder.
pub(crate) fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    &s[..cut]
}

pub(crate) fn put_str16(w: &mut Vec<u8>, s: &str) {
    w.extend_from_slice(&(s.len() as u16).to_le_bytes());
    w.extend_from_slice(s.as_bytes());
}

/// A cursor over a control body that turns every shortfall into a [`WireError::Body`].
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader over a control body, which may not be longer than [`CONTROL_BODY_MAX`]
    /// whoever sent it: a decoder never accepts what its encoder could not have produced.
    pub(crate) fn new(bytes: &'a [u8], what: &'static str) -> Result<Reader<'a>> {
        if bytes.len() > CONTROL_BODY_MAX {
            return Err(WireError::Limit {
                what: "control body bytes",
                value: bytes.len() as u64,
                limit: CONTROL_BODY_MAX as u64,
            });
        }
        Ok(Reader { bytes, what })
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.bytes.len() < n {
            return Err(WireError::Body(self.what));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }
    pub(crate) fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub(crate) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    pub(crate) fn zero(&mut self, n: usize) -> Result<()> {
        if self.take(n)?.iter().any(|&b| b != 0) {
            return Err(WireError::Reserved(self.what));
        }
        Ok(())
    }

    pub(crate) fn utf8(&mut self, len: usize) -> Result<String> {
        let what = self.what;
        let raw = self.take(len)?;
        std::str::from_utf8(raw).map(str::to_owned).map_err(|_| WireError::Body(what))
    }

    pub(crate) fn str16(&mut self, max: usize) -> Result<String> {
        let len = self.u16()? as usize;
        if len > max {
            return Err(WireError::Limit { what: "string length", value: len as u64, limit: max as u64 });
        }
        self.utf8(len)
    }

    pub(crate) fn end(&self) -> Result<()> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(WireError::Body(self.what))
        }
    }
}
