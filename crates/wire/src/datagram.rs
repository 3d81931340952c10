//! The datagram header of the raw-Ethernet transport: 28 bytes at the start of every datagram,
//! after the Ethernet header and before the stream bytes the datagram carries.
//!
//! On the wire a datagram is
//!
//! ```text
//! | Ethernet header (14 bytes: dst MAC, src MAC, EtherType 0x88B5) |  <- the transport's
//! | DatagramHeader (28 bytes, this module)                         |  <- this module
//! | payload (payload_len bytes: a contiguous chunk of one session's byte stream) |
//! ```
//!
//! The Ethernet header belongs to the transport (`crates/transport`), which strips it before
//! calling [`DatagramHeader::parse`] and writes it in front of what [`DatagramHeader::emit`]
//! produced. Skiff frames (24-byte [`crate::header`] and bodies) travel *inside* the payloads as
//! an ordinary byte stream, cut wherever the sender's datagrams end: a frame may span many
//! datagrams and a datagram may hold the end of one frame and the start of the next.
//!
//! One CRC32C covers the header (its first 24 bytes, the checksum field excluded) and then the
//! payload, so a flipped bit anywhere in a datagram is caught here, including in stream bytes
//! that the frame header's own CRC does not cover. The Ethernet FCS normally catches these
//! first; this check also covers what the NIC, the driver and memory did after it.
//!
//! What the fields mean to the reliable-delivery state machine (`dgram::reliable`) is described
//! there and in docs/PROTOCOL.md, section 16. This module only validates layout: version, kind,
//! flags, reserved bytes, lengths and the checksum.

use zerocopy::little_endian::{U16, U32};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// The EtherType skiff's datagrams carry (IEEE 802 local experimental EtherType 1).
pub const ETHERTYPE: u16 = 0x88B5;
/// The only datagram header version this implementation speaks.
pub const DATAGRAM_VERSION: u8 = 1;
/// Size of [`DatagramHeaderRaw`] in bytes.
pub const DATAGRAM_HEADER_LEN: usize = 28;
/// The smallest Ethernet payload: shorter datagrams arrive padded with zeros up to it.
pub const ETHERNET_PAYLOAD_MIN: usize = 46;
/// Header bytes before the checksum field: the part of the header the CRC covers.
const CRC_COVERED_LEN: usize = 24;

/// The raw header exactly as it sits on the wire (little-endian, no padding).
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct DatagramHeaderRaw {
    pub version: u8,
    pub kind: u8,
    pub flags: u8,
    pub reserved: u8,
    pub session_id: U32,
    pub seq: U32,
    pub ack: U32,
    pub sack: U32,
    pub window: U16,
    pub payload_len: U16,
    /// CRC32C of header bytes 0..24, then of the payload.
    pub crc: U32,
}

const _: () = assert!(std::mem::size_of::<DatagramHeaderRaw>() == DATAGRAM_HEADER_LEN);
const _: () = assert!(std::mem::offset_of!(DatagramHeaderRaw, crc) == CRC_COVERED_LEN);

/// What a datagram is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DatagramKind {
    /// Stream bytes (one or more), with a sequence number, plus the sender's acknowledgement.
    Data = 1,
    /// Only the acknowledgement fields (ack, sack, window); no payload.
    Ack = 2,
    /// The sender's stream ends: no payload, occupies a sequence number like data (TCP's FIN).
    Close = 3,
    /// Abort the session at once; no payload, not acknowledged.
    Reset = 4,
    /// Read data placed by the receiver at the buffer its header names, not stream bytes
    /// (Tyche's data messages; docs/PROTOCOL.md, section 16.9): one or more [`PlaceSegment`]s,
    /// each a 12-byte segment header and its bytes, filling the payload exactly. Sequenced
    /// like Data, so it is acknowledged, retransmitted and delivered once.
    Place = 5,
    /// Who serves skiff on this segment? Broadcast by an initiator, `session_id` a query id of
    /// its choosing; no payload, outside any session.
    Discover = 16,
    /// A target's answer to a Discover, unicast to the asker with the query id echoed in
    /// `session_id`: the Offer's source MAC is the target's. No payload.
    Offer = 17,
    /// Is this link of a bundle alive? Sent by either side of a session on one link of a bundle
    /// (docs/PROTOCOL.md, section 16.8), `seq` a probe number of the sender's choosing, every
    /// other field 0 but `session_id`. No payload; handled by the link layer, not the stream.
    Probe = 18,
    /// The answer to a Probe, sent back on the link the Probe came in on, with its `seq`
    /// echoed. No payload.
    ProbeAck = 19,
}

impl DatagramKind {
    pub fn from_u8(v: u8) -> Option<DatagramKind> {
        Some(match v {
            1 => DatagramKind::Data,
            2 => DatagramKind::Ack,
            3 => DatagramKind::Close,
            4 => DatagramKind::Reset,
            5 => DatagramKind::Place,
            16 => DatagramKind::Discover,
            17 => DatagramKind::Offer,
            18 => DatagramKind::Probe,
            19 => DatagramKind::ProbeAck,
            _ => return None,
        })
    }

    /// Whether datagrams of this kind occupy a sequence number (and so are acknowledged and
    /// retransmitted).
    pub fn is_sequenced(self) -> bool {
        matches!(self, DatagramKind::Data | DatagramKind::Place | DatagramKind::Close)
    }
}

/// Flag bits of the header's `flags` byte. Undefined bits must be zero.
pub mod flags {
    /// The receiver should acknowledge at once instead of delaying its ack: set on
    /// retransmissions after a timeout and on window probes, whose answer the sender waits for.
    pub const ACK_NOW: u8 = 0x01;
    /// The sender of this datagram received a second copy of a datagram since the last one it
    /// sent, and one of the copies was flagged `GAP_RESEND` (DSACK, RFC 2883): the peer took
    /// reordering for loss, and widens its reordering window.
    pub const DUPLICATE: u8 = 0x02;
    /// A Data, Place or Close datagram sent again because younger ones overtook it (a gap loss), not
    /// on a timeout. A receiver that already had it answers with `DUPLICATE`; a duplicate the
    /// network made of a first transmission, or a copy resent on a timeout (a lost ack), says
    /// nothing about reordering and is not reported.
    pub const GAP_RESEND: u8 = 0x04;
    /// On a Place datagram only: its payload ends with stream bytes after its segments, their
    /// count in the payload's last two bytes (u16, little-endian): the end of the stream's
    /// next chunk rides in the frame that carries the data before it
    /// ([`super::split_place_payload`]).
    pub const STREAM_TAIL: u8 = 0x08;
    /// The checksum covers the header alone, not the payload: the sender's link protects the
    /// payload otherwise (a veth pair, whose frames go from memory to memory and never cross
    /// a wire). The flag is under the checksum, so a flipped one is caught like any other bit.
    pub const HEADER_CRC: u8 = 0x10;
    /// Every flag bit this version defines.
    pub const ALL: u8 = ACK_NOW | DUPLICATE | GAP_RESEND | STREAM_TAIL | HEADER_CRC;
}

/// Why bytes are not a valid datagram. The receiver drops such a datagram and counts it; one
/// bad datagram never ends a session.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DatagramError {
    #[error("datagram too short: {have} bytes, the header alone is {DATAGRAM_HEADER_LEN}")]
    Short { have: usize },
    #[error("datagram checksum mismatch: carried {carried:#010x}, computed {computed:#010x}")]
    BadCrc { carried: u32, computed: u32 },
    #[error("unsupported datagram version {0}")]
    BadVersion(u8),
    #[error("unknown datagram kind {0}")]
    UnknownKind(u8),
    #[error("undefined datagram flags {0:#04x}")]
    UnknownFlags(u8),
    #[error("datagram reserved byte is {0:#04x}, not zero")]
    Reserved(u8),
    #[error("datagram payload is {have} bytes, its header says {declared}")]
    PayloadLength { declared: usize, have: usize },
    #[error("{kind:?} datagram with {len} payload bytes")]
    PayloadForKind { kind: DatagramKind, len: usize },
    #[error("place segment header says {declared} bytes, {have} are left in the datagram")]
    SegmentLength { declared: usize, have: usize },
    #[error("place segment of 0 bytes")]
    EmptySegment,
    #[error("stream tail of {tail} bytes in a Place payload of {len}")]
    TailLength { tail: usize, len: usize },
    #[error("STREAM_TAIL flag on a {0:?} datagram")]
    TailForKind(DatagramKind),
}

/// Bytes of the count after a Place datagram's stream tail.
pub const STREAM_TAIL_COUNT_LEN: usize = 2;

/// A Place datagram's payload as its segments and its stream tail (empty without
/// [`flags::STREAM_TAIL`]). With the flag the last two bytes count the tail, which must leave
/// room for at least one segment header before it.
pub fn split_place_payload(flags: u8, payload: &[u8]) -> Result<(&[u8], &[u8]), DatagramError> {
    if flags & flags::STREAM_TAIL == 0 {
        return Ok((payload, &[]));
    }
    let len = payload.len();
    let Some(body) = len.checked_sub(STREAM_TAIL_COUNT_LEN) else {
        return Err(DatagramError::TailLength { tail: 0, len });
    };
    let tail = usize::from(u16::from_le_bytes([payload[body], payload[body + 1]]));
    if tail == 0 || tail + PLACE_SEGMENT_HEADER_LEN > body {
        return Err(DatagramError::TailLength { tail, len });
    }
    Ok(payload[..body].split_at(body - tail))
}

/// Size of a [`PlaceSegment`]'s header in a Place datagram's payload.
pub const PLACE_SEGMENT_HEADER_LEN: usize = 12;

/// One segment of a Place datagram: `len` bytes of the read data of request `tag`, to be put
/// at `offset` within that request's buffer. On the wire: `tag`, `offset`, `len` (each u32,
/// little-endian), then the `len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaceSegment<'a> {
    pub tag: u32,
    pub offset: u32,
    pub bytes: &'a [u8],
}

impl PlaceSegment<'_> {
    /// Write the segment header for `len` bytes of `tag`'s data at `offset` into
    /// `out[..PLACE_SEGMENT_HEADER_LEN]`; the caller puts the bytes after it.
    pub fn emit_header(tag: u32, offset: u32, len: u32, out: &mut [u8]) {
        out[0..4].copy_from_slice(&tag.to_le_bytes());
        out[4..8].copy_from_slice(&offset.to_le_bytes());
        out[8..12].copy_from_slice(&len.to_le_bytes());
    }

    /// The segments of a Place datagram's payload, each checked as it is reached: the first
    /// malformed one ends the iteration with its error.
    pub fn parse_all(payload: &[u8]) -> PlaceSegments<'_> {
        PlaceSegments { rest: payload }
    }
}

/// Iterator over the segments of a Place payload ([`PlaceSegment::parse_all`]).
#[derive(Debug, Clone)]
pub struct PlaceSegments<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for PlaceSegments<'a> {
    type Item = Result<PlaceSegment<'a>, DatagramError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let word = |at: usize| {
            u32::from_le_bytes([self.rest[at], self.rest[at + 1], self.rest[at + 2], self.rest[at + 3]])
        };
        let bad = |e| Some(Err(e));
        if self.rest.len() < PLACE_SEGMENT_HEADER_LEN {
            let have = self.rest.len();
            self.rest = &[];
            return bad(DatagramError::SegmentLength { declared: PLACE_SEGMENT_HEADER_LEN, have });
        }
        let (tag, offset, len) = (word(0), word(4), word(8) as usize);
        let have = self.rest.len() - PLACE_SEGMENT_HEADER_LEN;
        if len == 0 || len > have {
            self.rest = &[];
            return bad(if len == 0 {
                DatagramError::EmptySegment
            } else {
                DatagramError::SegmentLength { declared: len, have }
            });
        }
        let bytes = &self.rest[PLACE_SEGMENT_HEADER_LEN..PLACE_SEGMENT_HEADER_LEN + len];
        self.rest = &self.rest[PLACE_SEGMENT_HEADER_LEN + len..];
        Some(Ok(PlaceSegment { tag, offset, bytes }))
    }
}

/// A header that passed every check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DatagramHeader {
    pub kind: DatagramKind,
    pub flags: u8,
    /// The session this datagram belongs to; the receiver ignores other sessions' datagrams.
    pub session_id: u32,
    /// The datagram's sequence number (Data, Close); the sender's next one otherwise.
    pub seq: u32,
    /// Cumulative acknowledgement: the next sequence number the sender of this datagram
    /// expects from its peer (everything before it has arrived).
    pub ack: u32,
    /// Selective acknowledgement: bit `i` set means sequence number `ack + 1 + i` has arrived.
    pub sack: u32,
    /// Receive window: how many datagrams from `ack` on (`ack` included) the sender of this
    /// datagram can still buffer.
    pub window: u16,
    pub payload_len: u16,
}

impl DatagramHeader {
    /// Length of the whole datagram (Ethernet header excluded).
    pub fn datagram_len(&self) -> usize {
        DATAGRAM_HEADER_LEN + usize::from(self.payload_len)
    }

    /// Validate `bytes` (one whole datagram, Ethernet header stripped) and return its header
    /// and payload. The checksum is checked first: a corrupted datagram says nothing else
    /// reliably.
    pub fn parse(bytes: &[u8]) -> Result<(DatagramHeader, &[u8]), DatagramError> {
        let (raw, payload) = DatagramHeaderRaw::read_from_prefix(bytes)
            .map_err(|_| DatagramError::Short { have: bytes.len() })?;
        let declared = usize::from(raw.payload_len.get());
        // The length must agree with the buffer, except for the pad a NIC adds to reach the
        // minimum Ethernet frame: bytes after the payload are allowed only in a datagram of
        // at most ETHERNET_PAYLOAD_MIN bytes.
        let padded = bytes.len() <= ETHERNET_PAYLOAD_MIN && payload.len() > declared;
        if payload.len() != declared && !padded {
            return Err(DatagramError::PayloadLength { declared, have: payload.len() });
        }
        let payload = &payload[..declared];
        let computed = checksum(&bytes[..CRC_COVERED_LEN], raw.flags, payload);
        if raw.crc.get() != computed {
            return Err(DatagramError::BadCrc { carried: raw.crc.get(), computed });
        }
        if raw.version != DATAGRAM_VERSION {
            return Err(DatagramError::BadVersion(raw.version));
        }
        let kind = DatagramKind::from_u8(raw.kind).ok_or(DatagramError::UnknownKind(raw.kind))?;
        if raw.flags & !flags::ALL != 0 {
            return Err(DatagramError::UnknownFlags(raw.flags & !flags::ALL));
        }
        if raw.reserved != 0 {
            return Err(DatagramError::Reserved(raw.reserved));
        }
        if raw.flags & flags::STREAM_TAIL != 0 {
            if kind != DatagramKind::Place {
                return Err(DatagramError::TailForKind(kind));
            }
            split_place_payload(raw.flags, &payload[..declared])?;
        }
        let payload_ok = match kind {
            DatagramKind::Data => declared > 0,
            DatagramKind::Place => declared >= PLACE_SEGMENT_HEADER_LEN,
            _ => declared == 0,
        };
        if !payload_ok {
            return Err(DatagramError::PayloadForKind { kind, len: declared });
        }
        let header = DatagramHeader {
            kind,
            flags: raw.flags,
            session_id: raw.session_id.get(),
            seq: raw.seq.get(),
            ack: raw.ack.get(),
            sack: raw.sack.get(),
            window: raw.window.get(),
            payload_len: raw.payload_len.get(),
        };
        Ok((header, payload))
    }

    /// Write this header into `out[..DATAGRAM_HEADER_LEN]`, with the checksum over it and the
    /// `payload_len` bytes that the caller has already placed at `out[DATAGRAM_HEADER_LEN..]`
    /// (so a payload is copied once, straight into the transmit buffer). Returns the datagram's
    /// length.
    ///
    /// # Panics
    /// If `out` is shorter than [`datagram_len`](Self::datagram_len): callers size their
    /// buffers from the largest payload they send.
    pub fn emit(&self, out: &mut [u8]) -> usize {
        let len = self.datagram_len();
        let raw = DatagramHeaderRaw {
            version: DATAGRAM_VERSION,
            kind: self.kind as u8,
            flags: self.flags,
            reserved: 0,
            session_id: self.session_id.into(),
            seq: self.seq.into(),
            ack: self.ack.into(),
            sack: self.sack.into(),
            window: self.window.into(),
            payload_len: self.payload_len.into(),
            crc: 0.into(),
        };
        out[..DATAGRAM_HEADER_LEN].copy_from_slice(raw.as_bytes());
        let crc = checksum(&out[..CRC_COVERED_LEN], self.flags, &out[DATAGRAM_HEADER_LEN..len]);
        out[CRC_COVERED_LEN..DATAGRAM_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
        len
    }
}

/// CRC32C over a datagram's covered header bytes and, unless `flags` has
/// [`flags::HEADER_CRC`], its payload.
fn checksum(covered: &[u8], flags: u8, payload: &[u8]) -> u32 {
    let header = crc32c::crc32c(covered);
    if flags & flags::HEADER_CRC != 0 {
        header
    } else {
        crc32c::crc32c_append(header, payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(payload: &[u8]) -> Vec<u8> {
        let h = DatagramHeader {
            kind: DatagramKind::Data,
            flags: flags::ACK_NOW,
            session_id: 0x0102_0304,
            seq: 0xFFFF_FFFE,
            ack: 7,
            sack: 0b101,
            window: 64,
            payload_len: payload.len() as u16,
        };
        let mut out = vec![0u8; h.datagram_len()];
        out[DATAGRAM_HEADER_LEN..].copy_from_slice(payload);
        assert_eq!(h.emit(&mut out), out.len());
        out
    }

    /// Re-stamp the CRC after editing a header, so that the check after it is reached.
    fn restamp(bytes: &mut [u8]) {
        let len = DATAGRAM_HEADER_LEN + usize::from(u16::from_le_bytes([bytes[22], bytes[23]]));
        let crc = crc32c::crc32c_append(crc32c::crc32c(&bytes[..24]), &bytes[DATAGRAM_HEADER_LEN..len]);
        bytes[24..28].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn fixed_bytes() {
        let bytes = data(b"hi");
        let expected_head: [u8; 24] = [
            0x01, 0x01, 0x01, 0x00, // version, kind Data, flags ACK_NOW, reserved
            0x04, 0x03, 0x02, 0x01, // session id 0x01020304
            0xFE, 0xFF, 0xFF, 0xFF, // seq 0xFFFFFFFE
            0x07, 0x00, 0x00, 0x00, // ack 7
            0x05, 0x00, 0x00, 0x00, // sack 0b101
            0x40, 0x00, 0x02, 0x00, // window 64, payload_len 2
        ];
        assert_eq!(bytes[..24], expected_head);
        let crc = crc32c::crc32c(&[&expected_head[..], b"hi"].concat());
        assert_eq!(bytes[24..28], crc.to_le_bytes());
        // The test vector of docs/PROTOCOL.md, section 16.1.
        assert_eq!(crc, 0x11B5_898A);
        assert_eq!(bytes[24..28], [0x8A, 0x89, 0xB5, 0x11]);
        assert_eq!(&bytes[28..], b"hi");
    }

    #[test]
    fn round_trip_every_kind() {
        for (kind, payload) in [
            (DatagramKind::Data, &b"x"[..]),
            (DatagramKind::Data, &[0xAB; 1472][..]),
            (DatagramKind::Ack, &[][..]),
            (DatagramKind::Close, &[][..]),
            (DatagramKind::Reset, &[][..]),
            (DatagramKind::Place, &[7; PLACE_SEGMENT_HEADER_LEN + 1][..]),
        ] {
            let h = DatagramHeader {
                kind,
                flags: 0,
                session_id: 9,
                seq: u32::MAX,
                ack: 0,
                sack: u32::MAX,
                window: u16::MAX,
                payload_len: payload.len() as u16,
            };
            let mut out = vec![0u8; h.datagram_len().max(ETHERNET_PAYLOAD_MIN)];
            out[DATAGRAM_HEADER_LEN..h.datagram_len()].copy_from_slice(payload);
            let n = h.emit(&mut out);
            let (back, got) = DatagramHeader::parse(&out[..n]).unwrap();
            assert_eq!((back, got), (h, payload));
            // The pad up to a minimum-size Ethernet frame is ignored; nothing else may follow.
            assert_eq!(DatagramHeader::parse(&out).unwrap().0, h);
            out.push(0);
            let have = out.len() - DATAGRAM_HEADER_LEN;
            assert_eq!(
                DatagramHeader::parse(&out),
                Err(DatagramError::PayloadLength { declared: payload.len(), have })
            );
        }
    }

    #[test]
    fn every_bit_flip_is_caught() {
        let good = data(b"payload bytes");
        for bit in 0..good.len() * 8 {
            let mut bad = good.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(DatagramHeader::parse(&bad).is_err(), "flip of bit {bit} passed");
        }
    }

    #[test]
    fn a_header_crc_covers_the_header_and_leaves_the_payload_to_the_link() {
        let h = DatagramHeader {
            kind: DatagramKind::Data,
            flags: flags::HEADER_CRC,
            session_id: 3,
            seq: 1,
            ack: 2,
            sack: 0,
            window: 16,
            payload_len: 5,
        };
        let mut good = vec![0u8; h.datagram_len()];
        good[DATAGRAM_HEADER_LEN..].copy_from_slice(b"bytes");
        h.emit(&mut good);
        assert_eq!(good[24..28], crc32c::crc32c(&good[..24]).to_le_bytes());
        assert_eq!(DatagramHeader::parse(&good).unwrap(), (h, &b"bytes"[..]));
        for bit in 0..good.len() * 8 {
            let mut bad = good.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            let caught = DatagramHeader::parse(&bad).is_err();
            // Every flip in the header (the flag itself included) is caught; the payload's
            // are the link's to catch.
            assert_eq!(caught, bit < DATAGRAM_HEADER_LEN * 8, "flip of bit {bit}");
        }
        // Without the flag the same datagram's checksum covers its payload too.
        let full = DatagramHeader { flags: 0, ..h };
        let mut out = good.clone();
        full.emit(&mut out);
        assert_ne!(out[24..28], good[24..28]);
    }

    #[test]
    fn precise_errors() {
        let good = data(b"ab");
        assert_eq!(DatagramHeader::parse(&good[..27]), Err(DatagramError::Short { have: 27 }));
        assert_eq!(
            DatagramHeader::parse(&good[..29]),
            Err(DatagramError::PayloadLength { declared: 2, have: 1 })
        );
        let mut bad = good.clone();
        bad[28] ^= 1;
        assert!(matches!(DatagramHeader::parse(&bad), Err(DatagramError::BadCrc { .. })));
        let edit = |at: usize, v: u8| {
            let mut b = good.clone();
            b[at] = v;
            restamp(&mut b);
            DatagramHeader::parse(&b).map(|(h, _)| h)
        };
        assert_eq!(edit(0, 2), Err(DatagramError::BadVersion(2)));
        assert_eq!(edit(1, 6), Err(DatagramError::UnknownKind(6)));
        assert_eq!(edit(1, 20), Err(DatagramError::UnknownKind(20)));
        // Discovery and link probes carry no payload either.
        assert_eq!(
            edit(1, DatagramKind::Probe as u8),
            Err(DatagramError::PayloadForKind { kind: DatagramKind::Probe, len: 2 })
        );
        assert_eq!(
            edit(1, DatagramKind::Discover as u8),
            Err(DatagramError::PayloadForKind { kind: DatagramKind::Discover, len: 2 })
        );
        assert_eq!(edit(1, 0), Err(DatagramError::UnknownKind(0)));
        assert_eq!(edit(2, 0x81), Err(DatagramError::UnknownFlags(0x80)));
        assert_eq!(edit(2, flags::STREAM_TAIL), Err(DatagramError::TailForKind(DatagramKind::Data)));
        assert_eq!(edit(3, 1), Err(DatagramError::Reserved(1)));
        assert_eq!(
            edit(1, DatagramKind::Ack as u8),
            Err(DatagramError::PayloadForKind { kind: DatagramKind::Ack, len: 2 })
        );
        let mut empty = vec![0u8; DATAGRAM_HEADER_LEN];
        DatagramHeader {
            kind: DatagramKind::Data,
            flags: 0,
            session_id: 1,
            seq: 0,
            ack: 0,
            sack: 0,
            window: 1,
            payload_len: 0,
        }
        .emit(&mut empty);
        assert_eq!(
            DatagramHeader::parse(&empty),
            Err(DatagramError::PayloadForKind { kind: DatagramKind::Data, len: 0 })
        );
        // A Place datagram holds at least one segment header.
        assert_eq!(
            edit(1, DatagramKind::Place as u8),
            Err(DatagramError::PayloadForKind { kind: DatagramKind::Place, len: 2 })
        );
    }

    #[test]
    fn place_segments_round_trip_and_reject_what_does_not_fill_the_payload() {
        let mut payload = vec![0u8; 2 * PLACE_SEGMENT_HEADER_LEN + 5];
        PlaceSegment::emit_header(7, 4096, 3, &mut payload);
        payload[12..15].copy_from_slice(b"abc");
        PlaceSegment::emit_header(u32::MAX, 0, 2, &mut payload[15..]);
        payload[27..29].copy_from_slice(b"de");
        let got: Vec<_> = PlaceSegment::parse_all(&payload).collect();
        assert_eq!(
            got,
            [
                Ok(PlaceSegment { tag: 7, offset: 4096, bytes: b"abc" }),
                Ok(PlaceSegment { tag: u32::MAX, offset: 0, bytes: b"de" })
            ]
        );
        // The test vectors of docs/PROTOCOL.md, section 16.9: the segment, and with a tail.
        assert_eq!(&payload[..15], [7, 0, 0, 0, 0, 0x10, 0, 0, 3, 0, 0, 0, b'a', b'b', b'c']);
        let tailed = [&payload[..15], &[0x74, 0x61, 0x69, 0x6c, 0x04, 0x00][..]].concat();
        assert_eq!(split_place_payload(flags::STREAM_TAIL, &tailed), Ok((&payload[..15], &b"tail"[..])));
        // A segment longer than what is left, a trailing partial header, an empty segment.
        let short: Vec<_> = PlaceSegment::parse_all(&payload[..28]).collect();
        assert_eq!(short[1], Err(DatagramError::SegmentLength { declared: 2, have: 1 }));
        let trailing: Vec<_> = PlaceSegment::parse_all(&payload[..20]).collect();
        assert_eq!(trailing[1], Err(DatagramError::SegmentLength { declared: 12, have: 5 }));
        let mut empty = [0u8; PLACE_SEGMENT_HEADER_LEN];
        PlaceSegment::emit_header(1, 0, 0, &mut empty);
        assert_eq!(PlaceSegment::parse_all(&empty).collect::<Vec<_>>(), [Err(DatagramError::EmptySegment)]);
    }

    #[test]
    fn a_stream_tail_is_counted_from_the_end_and_leaves_room_for_a_segment() {
        let mut payload = vec![0u8; PLACE_SEGMENT_HEADER_LEN + 1];
        PlaceSegment::emit_header(3, 0, 1, &mut payload);
        payload.extend_from_slice(b"tail");
        payload.extend_from_slice(&4u16.to_le_bytes());
        let (segs, tail) = split_place_payload(flags::STREAM_TAIL, &payload).unwrap();
        assert_eq!((segs.len(), tail), (PLACE_SEGMENT_HEADER_LEN + 1, &b"tail"[..]));
        assert_eq!(split_place_payload(0, &payload).unwrap(), (&payload[..], &[][..]));
        let n = payload.len();
        for (count, why) in
            [(0u16, "empty"), (6, "no room for a segment"), (u16::MAX, "longer than the payload")]
        {
            payload[n - 2..].copy_from_slice(&count.to_le_bytes());
            assert_eq!(
                split_place_payload(flags::STREAM_TAIL, &payload),
                Err(DatagramError::TailLength { tail: usize::from(count), len: n }),
                "{why}"
            );
        }
        assert!(split_place_payload(flags::STREAM_TAIL, &[1]).is_err());
    }
}
