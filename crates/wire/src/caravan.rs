//! Caravans: data frames carrying many requests (or completions) at once.
//!
//! A request caravan is a header of kind `Requests`, `desc_count` request descriptors of
//! [`REQUEST_DESC_LEN`] bytes, then the payloads of those descriptors in the same order. Every
//! descriptor states its own `payload_len`, so the framing never depends on understanding the
//! opcode: a receiver can refuse one request with a precise status (unknown opcode, bad flags)
//! and still find the next one. A completion caravan has the same shape with
//! [`COMPLETION_DESC_LEN`]-byte completion descriptors and read data.

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::header::{FrameKind, Header};
use crate::status::Status;
use crate::{Result, WireError};

pub const REQUEST_DESC_LEN: usize = 32;
pub const COMPLETION_DESC_LEN: usize = 16;

/// A request descriptor exactly as on the wire.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct RequestDesc {
    pub opcode: u8,
    pub flags: u8,
    pub reserved0: U16,
    /// Chosen by the initiator, echoed by the completion.
    pub tag: U32,
    /// Export handle from the OPEN reply.
    pub handle: U32,
    /// Bytes of the volume the request covers.
    pub length: U32,
    pub offset: U64,
    /// Bytes of this request's payload in the caravan's payload section.
    pub payload_len: U32,
    pub reserved1: U32,
}

/// A completion descriptor exactly as on the wire.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct CompletionDesc {
    pub tag: U32,
    pub status: U16,
    pub reserved0: U16,
    /// Bytes of data for this completion in the caravan's payload section.
    pub data_len: U32,
    pub reserved1: U32,
}

const _: () = assert!(std::mem::size_of::<RequestDesc>() == REQUEST_DESC_LEN);
const _: () = assert!(std::mem::size_of::<CompletionDesc>() == COMPLETION_DESC_LEN);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    Read = 1,
    Write = 2,
    Flush = 3,
    Trim = 4,
    WriteZeroes = 5,
    /// A read served from the memory a capability names, the capability being the request's
    /// payload (docs/PROTOCOL.md, section 8).
    DirectRead = 6,
    /// A write under a capability with the write right (an extent of a flash volume): the
    /// payload is the capability followed by the `length` bytes to write (docs/PROTOCOL.md,
    /// section 14.8).
    DirectWrite = 7,
}

impl Opcode {
    /// How many opcodes there are (the size of per-opcode tables).
    pub const COUNT: usize = 7;
    pub const ALL: [Opcode; Opcode::COUNT] = [
        Opcode::Read,
        Opcode::Write,
        Opcode::Flush,
        Opcode::Trim,
        Opcode::WriteZeroes,
        Opcode::DirectRead,
        Opcode::DirectWrite,
    ];

    pub fn from_u8(v: u8) -> Option<Opcode> {
        Some(match v {
            1 => Opcode::Read,
            2 => Opcode::Write,
            3 => Opcode::Flush,
            4 => Opcode::Trim,
            5 => Opcode::WriteZeroes,
            6 => Opcode::DirectRead,
            7 => Opcode::DirectWrite,
            _ => return None,
        })
    }

    /// Index into per-opcode tables (0..[`Opcode::COUNT`]).
    pub fn index(self) -> usize {
        self as usize - 1
    }

    pub fn name(self) -> &'static str {
        match self {
            Opcode::Read => "read",
            Opcode::Write => "write",
            Opcode::Flush => "flush",
            Opcode::Trim => "trim",
            Opcode::WriteZeroes => "write_zeroes",
            Opcode::DirectRead => "direct_read",
            Opcode::DirectWrite => "direct_write",
        }
    }

    /// Whether the opcode changes the volume (refused on read-only exports).
    pub fn is_mutating(self) -> bool {
        !matches!(self, Opcode::Read | Opcode::Flush | Opcode::DirectRead)
    }

    /// Whether a successful completion carries `length` bytes of read data.
    pub fn returns_data(self) -> bool {
        matches!(self, Opcode::Read | Opcode::DirectRead)
    }
}

/// Request flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct ReqFlags(u8);

impl ReqFlags {
    /// Force unit access: the data is durable before the completion is sent.
    pub const FUA: ReqFlags = ReqFlags(0x01);
    /// The initiator rang the doorbell for this request at once; the target answers it without
    /// waiting to fill a response caravan.
    pub const NO_DELAY: ReqFlags = ReqFlags(0x02);
    /// On a read: the initiator would like a capability for the bytes read, to read them
    /// directly next time. Only with direct reads negotiated (HELLO feature bit 1); the target
    /// answers with a `CAPABILITIES` frame when it can, and ignores the flag when it cannot.
    pub const WANT_CAP: ReqFlags = ReqFlags(0x04);
    const KNOWN: u8 = 0x07;

    pub const fn empty() -> ReqFlags {
        ReqFlags(0)
    }
    pub fn bits(self) -> u8 {
        self.0
    }
    pub fn contains(self, other: ReqFlags) -> bool {
        self.0 & other.0 == other.0
    }
    pub fn from_bits(bits: u8) -> Option<ReqFlags> {
        (bits & !Self::KNOWN == 0).then_some(ReqFlags(bits))
    }
}

impl std::ops::BitOr for ReqFlags {
    type Output = ReqFlags;
    fn bitor(self, rhs: ReqFlags) -> ReqFlags {
        ReqFlags(self.0 | rhs.0)
    }
}

/// A request descriptor that passed validation of its own fields. Range, alignment and
/// permission checks need the export and belong to the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub opcode: Opcode,
    pub flags: ReqFlags,
    pub tag: u32,
    pub handle: u32,
    pub offset: u64,
    pub length: u32,
}

impl Request {
    /// Payload bytes this request carries on the wire.
    pub fn payload_len(&self) -> u32 {
        match self.opcode {
            Opcode::Write => self.length,
            Opcode::DirectRead => crate::CAPABILITY_LEN as u32,
            Opcode::DirectWrite => (crate::CAPABILITY_LEN as u32).saturating_add(self.length),
            _ => 0,
        }
    }

    /// Write the descriptor into `out[..REQUEST_DESC_LEN]`.
    pub fn emit(&self, out: &mut [u8]) {
        let d = RequestDesc {
            opcode: self.opcode as u8,
            flags: self.flags.bits(),
            reserved0: 0.into(),
            tag: self.tag.into(),
            handle: self.handle.into(),
            length: self.length.into(),
            offset: self.offset.into(),
            payload_len: self.payload_len().into(),
            reserved1: 0.into(),
        };
        out[..REQUEST_DESC_LEN].copy_from_slice(d.as_bytes());
    }
}

/// A descriptor that is intact for framing but cannot be executed: it gets a completion with
/// this status and the connection goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestError {
    pub tag: u32,
    pub status: Status,
}

fn validate_request(d: &RequestDesc) -> std::result::Result<Request, RequestError> {
    let tag = d.tag.get();
    let refuse = |status| Err(RequestError { tag, status });
    let Some(opcode) = Opcode::from_u8(d.opcode) else {
        return refuse(Status::UnknownOpcode);
    };
    let Some(flags) = ReqFlags::from_bits(d.flags) else {
        return refuse(Status::Invalid);
    };
    if d.reserved0.get() != 0 || d.reserved1.get() != 0 {
        return refuse(Status::Invalid);
    }
    let req = Request {
        opcode,
        flags,
        tag,
        handle: d.handle.get(),
        offset: d.offset.get(),
        length: d.length.get(),
    };
    if d.payload_len.get() != req.payload_len() {
        return refuse(Status::Invalid);
    }
    Ok(req)
}

/// A parsed request caravan: descriptors checked for framing, payloads located.
#[derive(Debug, Clone, Copy)]
pub struct RequestCaravan<'a> {
    descs: &'a [RequestDesc],
    payload: &'a [u8],
}

impl<'a> RequestCaravan<'a> {
    /// Parse the body (everything after the header) of a `Requests` frame.
    pub fn parse(header: &Header, body: &'a [u8]) -> Result<RequestCaravan<'a>> {
        let (descs, payload) = split_body::<RequestDesc>(header, body, FrameKind::Requests)?;
        let sum: u64 = descs.iter().map(|d| u64::from(d.payload_len.get())).sum();
        check_sum(header, sum)?;
        Ok(RequestCaravan { descs, payload })
    }

    pub fn len(&self) -> usize {
        self.descs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }

    /// Each descriptor, validated, with its payload.
    pub fn iter(&self) -> impl Iterator<Item = (std::result::Result<Request, RequestError>, &'a [u8])> + 'a {
        let mut payload = self.payload;
        self.descs.iter().map(move |d| {
            let (mine, rest) = payload.split_at(d.payload_len.get() as usize);
            payload = rest;
            (validate_request(d), mine)
        })
    }

    /// Byte range of each descriptor's payload within the frame body, for callers that keep
    /// the body and hand out slices later.
    pub fn payload_offset_in_body(&self) -> usize {
        self.descs.len() * REQUEST_DESC_LEN
    }
}

/// The outcome of one request as the initiator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub tag: u32,
    pub status: Status,
    /// Bytes of read data that follow for this completion.
    pub data_len: u32,
}

impl Completion {
    /// Write the descriptor into `out[..COMPLETION_DESC_LEN]`.
    pub fn emit(&self, out: &mut [u8]) {
        let d = CompletionDesc {
            tag: self.tag.into(),
            status: self.status.to_u16().into(),
            reserved0: 0.into(),
            data_len: self.data_len.into(),
            reserved1: 0.into(),
        };
        out[..COMPLETION_DESC_LEN].copy_from_slice(d.as_bytes());
    }
}

/// A parsed completion caravan.
#[derive(Debug, Clone, Copy)]
pub struct CompletionCaravan<'a> {
    descs: &'a [CompletionDesc],
    payload: &'a [u8],
}

impl<'a> CompletionCaravan<'a> {
    /// Parse the body of a `Completions` frame. Reserved fields must be zero: a target that
    /// sets them is broken, and the initiator closes the connection.
    pub fn parse(header: &Header, body: &'a [u8]) -> Result<CompletionCaravan<'a>> {
        let (descs, payload) = split_body::<CompletionDesc>(header, body, FrameKind::Completions)?;
        let descs = check_completion_descs(header, descs)?;
        Ok(CompletionCaravan { descs, payload })
    }

    /// Parse only the descriptors of a `Completions` frame whose payload has not arrived yet,
    /// so that a receiver can place each completion's read data straight into its destination.
    /// `head` is the start of the body, at least `desc_count × 16` bytes; the descriptors get
    /// the same checks as in [`parse`](Self::parse), and the payload is empty.
    pub fn parse_head(header: &Header, head: &'a [u8]) -> Result<CompletionCaravan<'a>> {
        if header.kind != FrameKind::Completions {
            return Err(WireError::KindMismatch { expected: FrameKind::Completions, got: header.kind });
        }
        let desc_bytes = header.desc_count as usize * COMPLETION_DESC_LEN;
        if head.len() < desc_bytes {
            return Err(WireError::BodyLength { need: desc_bytes, have: head.len() });
        }
        let descs = <[CompletionDesc]>::ref_from_bytes(&head[..desc_bytes])
            .map_err(|_| WireError::Body("descriptors"))?;
        let descs = check_completion_descs(header, descs)?;
        Ok(CompletionCaravan { descs, payload: &[] })
    }

    pub fn len(&self) -> usize {
        self.descs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }

    /// The completions alone, without their data (all that [`parse_head`](Self::parse_head)
    /// has).
    pub fn completions(&self) -> impl Iterator<Item = Completion> + 'a {
        self.descs.iter().map(|d| Completion {
            tag: d.tag.get(),
            status: Status::from_u16(d.status.get()),
            data_len: d.data_len.get(),
        })
    }

    pub fn iter(&self) -> impl Iterator<Item = (Completion, &'a [u8])> + 'a {
        let mut payload = self.payload;
        self.descs.iter().map(move |d| {
            let (mine, rest) = payload.split_at(d.data_len.get() as usize);
            payload = rest;
            let c = Completion {
                tag: d.tag.get(),
                status: Status::from_u16(d.status.get()),
                data_len: d.data_len.get(),
            };
            (c, mine)
        })
    }
}

fn split_body<'a, D: FromBytes + Immutable + KnownLayout + Unaligned>(
    header: &Header,
    body: &'a [u8],
    expected: FrameKind,
) -> Result<(&'a [D], &'a [u8])> {
    if header.kind != expected {
        return Err(WireError::KindMismatch { expected, got: header.kind });
    }
    if body.len() != header.body_len() {
        return Err(WireError::BodyLength { need: header.body_len(), have: body.len() });
    }
    let desc_bytes = header.desc_count as usize * std::mem::size_of::<D>();
    let (descs, payload) = body.split_at(desc_bytes);
    let descs = <[D]>::ref_from_bytes(descs).map_err(|_| WireError::Body("descriptors"))?;
    Ok((descs, payload))
}

fn check_completion_descs<'a>(header: &Header, descs: &'a [CompletionDesc]) -> Result<&'a [CompletionDesc]> {
    if descs.iter().any(|d| d.reserved0.get() != 0 || d.reserved1.get() != 0) {
        return Err(WireError::Reserved("completion.reserved"));
    }
    let sum: u64 = descs.iter().map(|d| u64::from(d.data_len.get())).sum();
    check_sum(header, sum)?;
    Ok(descs)
}

fn check_sum(header: &Header, sum: u64) -> Result<()> {
    if sum != u64::from(header.payload_len) {
        return Err(WireError::PayloadMismatch { declared: header.payload_len.into(), sum });
    }
    Ok(())
}
