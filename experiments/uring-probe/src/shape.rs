//! The skiff-shaped frames the probe exchanges, and the data pattern the client checks.
//!
//! A request caravan is a [`HEADER_LEN`]-byte header and `count` [`REQUEST_DESC_LEN`]-byte read
//! descriptors; a response caravan is a header, `count` [`COMPLETION_DESC_LEN`]-byte completion
//! descriptors, then the read data in descriptor order. The sizes match skiff's wire crate so the
//! kernel sees the same byte counts, but the probe keeps its own encoding: it must not depend on
//! (or change) the real protocol crates. Everything here is pure: no sockets, no clock.

pub const HEADER_LEN: usize = 24;
pub const REQUEST_DESC_LEN: usize = 32;
pub const COMPLETION_DESC_LEN: usize = 16;

const MAGIC: u32 = u32::from_le_bytes(*b"SKPB");
const KIND_REQUESTS: u8 = 1;
const KIND_RESPONSES: u8 = 2;
const OPCODE_READ: u8 = 1;

/// Why a frame was refused. The probe has one peer it wrote itself, so any of these is a bug in
/// the mode under test (lost, duplicated or reordered bytes), never something to recover from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShapeError {
    BadMagic(u32),
    BadKind(u8),
    BadCount { count: usize, max: usize },
    BadBodyLen { body_len: usize, expected: usize },
    BadOpcode(u8),
    OutOfRange { offset: u64, length: u32 },
}

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShapeError::BadMagic(m) => write!(f, "bad magic {m:#010x}"),
            ShapeError::BadKind(k) => write!(f, "bad frame kind {k}"),
            ShapeError::BadCount { count, max } => write!(f, "{count} descriptors, limit {max}"),
            ShapeError::BadBodyLen { body_len, expected } => {
                write!(f, "body of {body_len} bytes where {expected} were expected")
            }
            ShapeError::BadOpcode(op) => write!(f, "unknown opcode {op}"),
            ShapeError::OutOfRange { offset, length } => {
                write!(f, "read of {length} bytes at {offset} is outside the data area")
            }
        }
    }
}

/// A caravan header: `body_len` counts every byte after the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub responses: bool,
    pub count: u16,
    pub seq: u64,
    pub body_len: u32,
}

impl Header {
    pub fn emit(&self, out: &mut [u8]) {
        let kind = if self.responses { KIND_RESPONSES } else { KIND_REQUESTS };
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4] = kind;
        out[5] = 0;
        out[6..8].copy_from_slice(&self.count.to_le_bytes());
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..20].copy_from_slice(&self.body_len.to_le_bytes());
        out[20..24].fill(0);
    }

    /// Parse and check the fixed part; the caller checks `body_len` against the count.
    pub fn parse(bytes: &[u8; HEADER_LEN], count_max: usize) -> Result<Header, ShapeError> {
        let magic = u32::from_le_bytes(le4(&bytes[0..4]));
        if magic != MAGIC {
            return Err(ShapeError::BadMagic(magic));
        }
        let responses = match bytes[4] {
            KIND_REQUESTS => false,
            KIND_RESPONSES => true,
            other => return Err(ShapeError::BadKind(other)),
        };
        let count = u16::from_le_bytes([bytes[6], bytes[7]]);
        if count == 0 || count as usize > count_max {
            return Err(ShapeError::BadCount { count: count as usize, max: count_max });
        }
        Ok(Header {
            responses,
            count,
            seq: u64::from_le_bytes(le8(&bytes[8..16])),
            body_len: u32::from_le_bytes(le4(&bytes[16..20])),
        })
    }
}

/// A read request: `length` bytes of the data area at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequest {
    pub tag: u32,
    pub offset: u64,
    pub length: u32,
}

impl ReadRequest {
    pub fn emit(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&self.tag.to_le_bytes());
        out[4] = OPCODE_READ;
        out[5..8].fill(0);
        out[8..16].copy_from_slice(&self.offset.to_le_bytes());
        out[16..20].copy_from_slice(&self.length.to_le_bytes());
        // No payload travels with a read.
        out[20..32].fill(0);
    }

    /// Parse one descriptor and check it stays inside a data area of `area_len` bytes.
    pub fn parse(bytes: &[u8], area_len: usize, length_max: u32) -> Result<ReadRequest, ShapeError> {
        if bytes[4] != OPCODE_READ {
            return Err(ShapeError::BadOpcode(bytes[4]));
        }
        let req = ReadRequest {
            tag: u32::from_le_bytes(le4(&bytes[0..4])),
            offset: u64::from_le_bytes(le8(&bytes[8..16])),
            length: u32::from_le_bytes(le4(&bytes[16..20])),
        };
        let end = req.offset.checked_add(req.length as u64);
        if req.length > length_max || end.is_none_or(|end| end > area_len as u64) {
            return Err(ShapeError::OutOfRange { offset: req.offset, length: req.length });
        }
        Ok(req)
    }
}

/// A completion: `data_len` bytes of data for request `tag` follow in the data section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub tag: u32,
    pub status: u16,
    pub data_len: u32,
}

impl Completion {
    pub fn emit(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&self.tag.to_le_bytes());
        out[4..6].copy_from_slice(&self.status.to_le_bytes());
        out[6..8].fill(0);
        out[8..12].copy_from_slice(&self.data_len.to_le_bytes());
        out[12..16].fill(0);
    }

    pub fn parse(bytes: &[u8]) -> Completion {
        Completion {
            tag: u32::from_le_bytes(le4(&bytes[0..4])),
            status: u16::from_le_bytes([bytes[4], bytes[5]]),
            data_len: u32::from_le_bytes(le4(&bytes[8..12])),
        }
    }
}

/// Bytes of a request caravan of `count` reads.
pub fn request_caravan_len(count: usize) -> usize {
    HEADER_LEN + count * REQUEST_DESC_LEN
}

/// Bytes of a response caravan of `count` reads of `bs` bytes each.
pub fn response_caravan_len(count: usize, bs: usize) -> usize {
    HEADER_LEN + count * (COMPLETION_DESC_LEN + bs)
}

/// The 8-byte word stored at byte `offset` of the data area (`offset` a multiple of 8). A
/// multiplicative hash makes every word distinct, so a block from the wrong place, a shifted
/// stream or a stale buffer all show up as a mismatch.
pub fn pattern_word(offset: u64) -> u64 {
    (offset / 8).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17) ^ 0x5EED_5EED_5EED_5EED
}

/// Fill `area` (which starts at data-area offset 0) with the pattern.
pub fn fill_pattern(area: &mut [u8]) {
    for (i, word) in area.chunks_exact_mut(8).enumerate() {
        word.copy_from_slice(&pattern_word(i as u64 * 8).to_le_bytes());
    }
}

/// Where the first mismatch lies when `data` should hold the pattern from `offset`, if anywhere.
pub fn check_pattern(data: &[u8], offset: u64) -> Option<usize> {
    data.chunks_exact(8)
        .enumerate()
        .position(|(i, word)| u64::from_le_bytes(le8(word)) != pattern_word(offset + i as u64 * 8))
        .map(|i| i * 8)
}

fn le4(b: &[u8]) -> [u8; 4] {
    [b[0], b[1], b[2], b[3]]
}

fn le8(b: &[u8]) -> [u8; 8] {
    [b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = Header { responses: true, count: 16, seq: 7, body_len: 65_792 };
        let mut b = [0u8; HEADER_LEN];
        h.emit(&mut b);
        assert_eq!(Header::parse(&b, 16), Ok(h));
        assert!(matches!(Header::parse(&b, 8), Err(ShapeError::BadCount { .. })));
    }

    #[test]
    fn read_request_stays_inside_area() {
        let r = ReadRequest { tag: 3, offset: 4096, length: 4096 };
        let mut b = [0u8; REQUEST_DESC_LEN];
        r.emit(&mut b);
        assert_eq!(ReadRequest::parse(&b, 8192, 4096), Ok(r));
        assert!(ReadRequest::parse(&b, 8191, 4096).is_err());
    }

    #[test]
    fn pattern_catches_a_shift() {
        let mut area = vec![0u8; 64];
        fill_pattern(&mut area);
        assert_eq!(check_pattern(&area[8..40], 8), None);
        assert_eq!(check_pattern(&area[16..48], 8), Some(0));
    }
}
