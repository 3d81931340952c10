//! What a flash array looks like on its devices: the superblock, segment headers, write-group
//! headers and checkpoint pages, each with `parse` and `emit` over one 4 KiB page.
//!
//! Every structure is little-endian at fixed offsets, starts with an 8-byte magic, carries
//! the array's 16-byte id (so a device of another array, or a stale page of this one, never
//! passes for ours) and ends its covered bytes with a CRC32C. A page that fails any check is
//! not ours: `parse` says why and the caller treats the page as unwritten.
//!
//! Physical pages are numbered by a 32-bit PBA, global over the array: segment `s`, page `p`
//! of it is PBA `s * segment_pages + p`. Page 0 of every segment is its header, so PBA 0 is
//! never data and means "unmapped" in the map.

use crate::FlashError;

/// Bytes of a page: the unit of the map, the pool and device I/O.
pub const PAGE: usize = 4096;

/// Bytes at the start of every structure that hold its kind.
const MAGIC_LEN: usize = 8;
const SUPER_MAGIC: &[u8; MAGIC_LEN] = b"SKFLSUP1";
const SEGMENT_MAGIC: &[u8; MAGIC_LEN] = b"SKFLSEG1";
const GROUP_MAGIC: &[u8; MAGIC_LEN] = b"SKFLGRP1";
const CKPT_MAGIC: &[u8; MAGIC_LEN] = b"SKFLCKP1";

/// The array's identity: random at format time, never shown to volume users.
pub type ArrayId = [u8; 16];

/// A physical page number over the whole array (0: none).
pub type Pba = u32;

/// Where the superblock copies live on every device: pages 0 and 1, written alternately.
pub const SUPER_PAGES: [u64; 2] = [0, 1];

/// The header of a write group has room for this many bytes of records.
pub const GROUP_RECORDS_BYTES: usize = PAGE - GROUP_HEADER_LEN;
const GROUP_HEADER_LEN: usize = 56;

/// Bytes of payload in one checkpoint page.
pub const CKPT_PAYLOAD: usize = PAGE - CKPT_HEADER_LEN;
const CKPT_HEADER_LEN: usize = 48;

fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A volume size from a record: what a request may ask for, so that replaying a record
/// never allocates more than creating the volume did.
fn volume_pages(pages: u64) -> Result<u64, FlashError> {
    if pages == 0 || pages > crate::ctl::VOLUME_PAGES_MAX {
        return Err(FlashError::Corrupt("volume size out of range"));
    }
    Ok(pages)
}

/// Check the magic, the array id (unless `array` is `None`: the superblock that names it) and
/// the CRC stored at `crc_at` over `covered` bytes (the CRC field itself read as zero).
fn check(
    page: &[u8],
    magic: &[u8; MAGIC_LEN],
    array: Option<&ArrayId>,
    crc_at: usize,
    covered: usize,
) -> Result<(), FlashError> {
    if page.len() != PAGE {
        return Err(FlashError::Corrupt("page of the wrong size"));
    }
    if &page[..MAGIC_LEN] != magic {
        return Err(FlashError::Corrupt("wrong magic"));
    }
    if array.is_some_and(|a| &page[8..24] != a) {
        return Err(FlashError::Corrupt("page of another array"));
    }
    if covered > PAGE || crc_at + 4 > covered {
        return Err(FlashError::Corrupt("length out of range"));
    }
    let mut copy = [0u8; PAGE];
    copy[..covered].copy_from_slice(&page[..covered]);
    copy[crc_at..crc_at + 4].fill(0);
    if crc(&copy[..covered]) != u32_at(page, crc_at) {
        return Err(FlashError::Corrupt("checksum mismatch"));
    }
    Ok(())
}

fn seal(page: &mut [u8], crc_at: usize, covered: usize) {
    page[crc_at..crc_at + 4].fill(0);
    let c = crc(&page[..covered]);
    put_u32(page, crc_at, c);
}

/// Where the last complete checkpoint lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CkptRef {
    /// Every write group up to this sequence number is in it.
    pub seq: u64,
    /// Its first segment (its segments chain through their headers).
    pub first_segment: u32,
    /// Its pages, in order over the chain.
    pub pages: u32,
}

/// One device's superblock: the array's geometry and this device's place in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub array: ArrayId,
    pub device_index: u16,
    pub device_count: u16,
    /// Pages per segment (at least 3: a header and a group of one page).
    pub segment_pages: u32,
    /// Segments on this device.
    pub segments: u32,
    /// This device's first segment, in the array's numbering.
    pub first_segment: u32,
    /// Segments over the whole array.
    pub total_segments: u32,
    /// The device page where this device's first segment starts.
    pub data_start: u64,
    /// Bumped at every superblock write; the copy with the highest wins.
    pub generation: u64,
    /// The last complete checkpoint; `None` on a freshly formatted array.
    pub checkpoint: Option<CkptRef>,
    /// Seconds since the epoch at format time.
    pub created_s: u64,
    /// No write group on the array has a sequence number at or above this: a driver raises it
    /// (durably) before it hands out one past it, and starts above it after a crash, so that a
    /// group lost in a crash, whose header may still lie in a segment, never shares its number
    /// with a new one.
    pub seq_ceiling: u64,
}

impl Superblock {
    pub fn emit(&self, page: &mut [u8]) {
        page.fill(0);
        page[..8].copy_from_slice(SUPER_MAGIC);
        page[8..24].copy_from_slice(&self.array);
        put_u32(page, 24, PAGE as u32);
        put_u16(page, 28, self.device_index);
        put_u16(page, 30, self.device_count);
        put_u32(page, 32, self.segment_pages);
        put_u32(page, 36, self.segments);
        put_u32(page, 40, self.first_segment);
        put_u32(page, 44, self.total_segments);
        put_u64(page, 48, self.data_start);
        put_u64(page, 56, self.generation);
        put_u64(page, 64, self.created_s);
        if let Some(c) = self.checkpoint {
            page[72] = 1;
            put_u64(page, 80, c.seq);
            put_u32(page, 88, c.first_segment);
            put_u32(page, 92, c.pages);
        }
        put_u64(page, 100, self.seq_ceiling);
        seal(page, 96, 108);
    }

    pub fn parse(page: &[u8]) -> Result<Superblock, FlashError> {
        check(page, SUPER_MAGIC, None, 96, 108)?;
        if u32_at(page, 24) != PAGE as u32 {
            return Err(FlashError::Corrupt("page size other than 4 KiB"));
        }
        let mut array = [0u8; 16];
        array.copy_from_slice(&page[8..24]);
        let sb = Superblock {
            array,
            device_index: u16_at(page, 28),
            device_count: u16_at(page, 30),
            segment_pages: u32_at(page, 32),
            segments: u32_at(page, 36),
            first_segment: u32_at(page, 40),
            total_segments: u32_at(page, 44),
            data_start: u64_at(page, 48),
            generation: u64_at(page, 56),
            created_s: u64_at(page, 64),
            seq_ceiling: u64_at(page, 100),
            checkpoint: (page[72] == 1).then(|| CkptRef {
                seq: u64_at(page, 80),
                first_segment: u32_at(page, 88),
                pages: u32_at(page, 92),
            }),
        };
        let geometry_ok = sb.segment_pages >= 3
            && sb.device_count > 0
            && sb.device_index < sb.device_count
            && sb.data_start >= 2
            && u64::from(sb.first_segment) + u64::from(sb.segments) <= u64::from(sb.total_segments)
            && u64::from(sb.total_segments) * u64::from(sb.segment_pages) <= u64::from(u32::MAX);
        if !geometry_ok {
            return Err(FlashError::Corrupt("superblock geometry out of range"));
        }
        Ok(sb)
    }
}

/// What a segment holds, said in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentKind {
    /// Write groups of data stream `n` (see `space::Stream`).
    Data(u8),
    /// Pages of a checkpoint; `next` is the checkpoint's next segment, if any.
    Checkpoint { next: Option<u32> },
}

/// The first page of every segment, written when the segment is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    pub segment: u32,
    /// The next write-group sequence number when it was opened: every group in it is at
    /// least this, which tells this life of the segment from any earlier one.
    pub opened_seq: u64,
    /// Times the segment was written since format (wear levelling).
    pub erase_count: u32,
    pub kind: SegmentKind,
}

impl SegmentHeader {
    pub fn emit(&self, array: &ArrayId, page: &mut [u8]) {
        page.fill(0);
        page[..8].copy_from_slice(SEGMENT_MAGIC);
        page[8..24].copy_from_slice(array);
        put_u32(page, 24, self.segment);
        put_u64(page, 28, self.opened_seq);
        put_u32(page, 36, self.erase_count);
        match self.kind {
            SegmentKind::Data(stream) => {
                page[40] = 1;
                page[41] = stream;
            }
            SegmentKind::Checkpoint { next } => {
                page[40] = 2;
                put_u32(page, 44, next.map_or(u32::MAX, |n| n));
            }
        }
        seal(page, 48, 52);
    }

    pub fn parse(array: &ArrayId, page: &[u8]) -> Result<SegmentHeader, FlashError> {
        check(page, SEGMENT_MAGIC, Some(array), 48, 52)?;
        let kind = match page[40] {
            1 => SegmentKind::Data(page[41]),
            2 => {
                let next = u32_at(page, 44);
                SegmentKind::Checkpoint { next: (next != u32::MAX).then_some(next) }
            }
            _ => return Err(FlashError::Corrupt("unknown segment kind")),
        };
        Ok(SegmentHeader {
            segment: u32_at(page, 24),
            opened_seq: u64_at(page, 28),
            erase_count: u32_at(page, 36),
            kind,
        })
    }
}

/// Longest volume name.
pub const NAME_MAX: usize = 64;

/// One change a write group records. Records that carry a page take the group's next data
/// page, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// Page `vpage` of volume `vol` is the next data page (CRC32C `crc`).
    Write { vol: u32, vpage: u64, crc: u32 },
    /// Garbage collection moved page `vpage` of volume `vol`'s family from `old` to the next
    /// data page: every member of the family that mapped it at `old` maps it there now.
    Move { vol: u32, vpage: u64, old: Pba, crc: u32 },
    /// `pages` pages of `vol` from `vpage` on are unmapped (trim, write-zeroes, shrink).
    Trim { vol: u32, vpage: u64, pages: u64 },
    /// A new, empty volume.
    Create { vol: u32, family: u32, pages: u64, name: String },
    /// A volume's size changed.
    Resize { vol: u32, pages: u64 },
    /// A volume is gone.
    Delete { vol: u32 },
    /// `vol` starts as a copy of `origin`'s map (sharing every page); read-only for a
    /// snapshot, writable for a clone.
    Snapshot { vol: u32, origin: u32, writable: bool, name: String },
}

const R_WRITE: u8 = 1;
const R_MOVE: u8 = 2;
const R_TRIM: u8 = 3;
const R_CREATE: u8 = 4;
const R_RESIZE: u8 = 5;
const R_DELETE: u8 = 6;
const R_SNAPSHOT: u8 = 7;

impl Record {
    /// Whether the record takes a data page.
    pub fn carries_page(&self) -> bool {
        matches!(self, Record::Write { .. } | Record::Move { .. })
    }

    /// Bytes it takes in a group header.
    pub fn encoded_len(&self) -> usize {
        1 + match self {
            Record::Write { .. } => 16,
            Record::Move { .. } => 20,
            Record::Trim { .. } => 20,
            Record::Create { name, .. } => 17 + name.len(),
            Record::Resize { .. } => 12,
            Record::Delete { .. } => 4,
            Record::Snapshot { name, .. } => 10 + name.len(),
        }
    }

    fn emit(&self, out: &mut Vec<u8>) {
        match self {
            Record::Write { vol, vpage, crc } => {
                out.push(R_WRITE);
                out.extend_from_slice(&vol.to_le_bytes());
                out.extend_from_slice(&vpage.to_le_bytes());
                out.extend_from_slice(&crc.to_le_bytes());
            }
            Record::Move { vol, vpage, old, crc } => {
                out.push(R_MOVE);
                out.extend_from_slice(&vol.to_le_bytes());
                out.extend_from_slice(&vpage.to_le_bytes());
                out.extend_from_slice(&old.to_le_bytes());
                out.extend_from_slice(&crc.to_le_bytes());
            }
            Record::Trim { vol, vpage, pages } => {
                out.push(R_TRIM);
                out.extend_from_slice(&vol.to_le_bytes());
                out.extend_from_slice(&vpage.to_le_bytes());
                out.extend_from_slice(&pages.to_le_bytes());
            }
            Record::Create { vol, family, pages, name } => {
                out.push(R_CREATE);
                out.extend_from_slice(&vol.to_le_bytes());
                out.extend_from_slice(&family.to_le_bytes());
                out.extend_from_slice(&pages.to_le_bytes());
                out.push(name.len() as u8);
                out.extend_from_slice(name.as_bytes());
            }
            Record::Resize { vol, pages } => {
                out.push(R_RESIZE);
                out.extend_from_slice(&vol.to_le_bytes());
                out.extend_from_slice(&pages.to_le_bytes());
            }
            Record::Delete { vol } => {
                out.push(R_DELETE);
                out.extend_from_slice(&vol.to_le_bytes());
            }
            Record::Snapshot { vol, origin, writable, name } => {
                out.push(R_SNAPSHOT);
                out.extend_from_slice(&vol.to_le_bytes());
                out.extend_from_slice(&origin.to_le_bytes());
                out.push(u8::from(*writable));
                out.push(name.len() as u8);
                out.extend_from_slice(name.as_bytes());
            }
        }
    }

    /// One record from the front of `b`: it and its length.
    fn parse(b: &[u8]) -> Result<(Record, usize), FlashError> {
        let short = FlashError::Corrupt("record cut short");
        let need = |n: usize| if b.len() < n { Err(short.clone()) } else { Ok(()) };
        need(1)?;
        let name_at = |at: usize| -> Result<(String, usize), FlashError> {
            need(at + 1)?;
            let len = b[at] as usize;
            if len == 0 || len > NAME_MAX {
                return Err(FlashError::Corrupt("volume name length out of range"));
            }
            need(at + 1 + len)?;
            let name = std::str::from_utf8(&b[at + 1..at + 1 + len])
                .map_err(|_| FlashError::Corrupt("volume name not UTF-8"))?;
            Ok((name.to_owned(), at + 1 + len))
        };
        Ok(match b[0] {
            R_WRITE => {
                need(17)?;
                (Record::Write { vol: u32_at(b, 1), vpage: u64_at(b, 5), crc: u32_at(b, 13) }, 17)
            }
            R_MOVE => {
                need(21)?;
                let r = Record::Move {
                    vol: u32_at(b, 1),
                    vpage: u64_at(b, 5),
                    old: u32_at(b, 13),
                    crc: u32_at(b, 17),
                };
                (r, 21)
            }
            R_TRIM => {
                need(21)?;
                (Record::Trim { vol: u32_at(b, 1), vpage: u64_at(b, 5), pages: u64_at(b, 13) }, 21)
            }
            R_CREATE => {
                need(17)?;
                let (name, end) = name_at(17)?;
                let pages = volume_pages(u64_at(b, 9))?;
                (Record::Create { vol: u32_at(b, 1), family: u32_at(b, 5), pages, name }, end)
            }
            R_RESIZE => {
                need(13)?;
                (Record::Resize { vol: u32_at(b, 1), pages: volume_pages(u64_at(b, 5))? }, 13)
            }
            R_DELETE => {
                need(5)?;
                (Record::Delete { vol: u32_at(b, 1) }, 5)
            }
            R_SNAPSHOT => {
                need(10)?;
                if b[9] > 1 {
                    return Err(FlashError::Corrupt("snapshot flag out of range"));
                }
                let (name, end) = name_at(10)?;
                (Record::Snapshot { vol: u32_at(b, 1), origin: u32_at(b, 5), writable: b[9] == 1, name }, end)
            }
            _ => return Err(FlashError::Corrupt("unknown record type")),
        })
    }
}

/// The header page of a write group: its records, then (after the header) its data pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupHeader {
    /// Strictly increasing over the array; replay applies groups in this order.
    pub seq: u64,
    pub segment: u32,
    pub records: Vec<Record>,
}

impl GroupHeader {
    /// Data pages that follow the header.
    pub fn data_pages(&self) -> usize {
        self.records.iter().filter(|r| r.carries_page()).count()
    }

    /// Whether `records` fit one header.
    pub fn fits(records: &[Record]) -> bool {
        records.iter().map(Record::encoded_len).sum::<usize>() <= GROUP_RECORDS_BYTES
    }

    pub fn emit(&self, array: &ArrayId, page: &mut [u8]) {
        page.fill(0);
        page[..8].copy_from_slice(GROUP_MAGIC);
        page[8..24].copy_from_slice(array);
        put_u64(page, 24, self.seq);
        put_u32(page, 32, self.segment);
        let mut body = Vec::with_capacity(GROUP_RECORDS_BYTES);
        for r in &self.records {
            r.emit(&mut body);
        }
        assert!(body.len() <= GROUP_RECORDS_BYTES, "records overflow a group header");
        put_u16(page, 36, self.records.len() as u16);
        put_u16(page, 38, self.data_pages() as u16);
        put_u32(page, 40, body.len() as u32);
        page[GROUP_HEADER_LEN..GROUP_HEADER_LEN + body.len()].copy_from_slice(&body);
        seal(page, 44, GROUP_HEADER_LEN + body.len());
    }

    pub fn parse(array: &ArrayId, page: &[u8]) -> Result<GroupHeader, FlashError> {
        if page.len() != PAGE {
            return Err(FlashError::Corrupt("page of the wrong size"));
        }
        let body_len = u32_at(page, 40) as usize;
        if body_len > GROUP_RECORDS_BYTES {
            return Err(FlashError::Corrupt("record bytes out of range"));
        }
        check(page, GROUP_MAGIC, Some(array), 44, GROUP_HEADER_LEN + body_len)?;
        let count = u16_at(page, 36) as usize;
        let mut records = Vec::with_capacity(count.min(GROUP_RECORDS_BYTES));
        let mut at = GROUP_HEADER_LEN;
        let end = GROUP_HEADER_LEN + body_len;
        while at < end {
            let (r, len) = Record::parse(&page[at..end])?;
            records.push(r);
            at += len;
        }
        if records.len() != count {
            return Err(FlashError::Corrupt("record count mismatch"));
        }
        let header = GroupHeader { seq: u64_at(page, 24), segment: u32_at(page, 32), records };
        if header.data_pages() != u16_at(page, 38) as usize {
            return Err(FlashError::Corrupt("data page count mismatch"));
        }
        Ok(header)
    }
}

/// One page of a checkpoint's byte stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CkptPage {
    pub seq: u64,
    pub index: u32,
    pub payload: Vec<u8>,
}

impl CkptPage {
    pub fn emit(array: &ArrayId, seq: u64, index: u32, payload: &[u8], page: &mut [u8]) {
        assert!(payload.len() <= CKPT_PAYLOAD);
        page.fill(0);
        page[..8].copy_from_slice(CKPT_MAGIC);
        page[8..24].copy_from_slice(array);
        put_u64(page, 24, seq);
        put_u32(page, 32, index);
        put_u32(page, 36, payload.len() as u32);
        page[CKPT_HEADER_LEN..CKPT_HEADER_LEN + payload.len()].copy_from_slice(payload);
        seal(page, 40, PAGE);
    }

    pub fn parse(array: &ArrayId, page: &[u8]) -> Result<CkptPage, FlashError> {
        check(page, CKPT_MAGIC, Some(array), 40, PAGE)?;
        let len = u32_at(page, 36) as usize;
        if len > CKPT_PAYLOAD {
            return Err(FlashError::Corrupt("checkpoint payload length out of range"));
        }
        Ok(CkptPage {
            seq: u64_at(page, 24),
            index: u32_at(page, 32),
            payload: page[CKPT_HEADER_LEN..CKPT_HEADER_LEN + len].to_vec(),
        })
    }
}

/// CRC32C of a data page, as group records carry it.
pub fn page_crc(page: &[u8]) -> u32 {
    crc(page)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ARRAY: ArrayId = [7; 16];

    #[test]
    fn a_record_sized_past_the_largest_volume_is_refused() {
        let too_big = crate::ctl::VOLUME_PAGES_MAX + 1;
        for r in [
            Record::Create { vol: 1, family: 1, pages: too_big, name: "v".into() },
            Record::Resize { vol: 1, pages: too_big },
            Record::Resize { vol: 1, pages: 0 },
        ] {
            let g = GroupHeader { seq: 1, segment: 0, records: vec![r] };
            let mut page = vec![0u8; PAGE];
            g.emit(&ARRAY, &mut page);
            assert_eq!(
                GroupHeader::parse(&ARRAY, &page),
                Err(FlashError::Corrupt("volume size out of range"))
            );
        }
    }

    #[test]
    fn every_structure_round_trips() {
        let sb = Superblock {
            array: ARRAY,
            device_index: 1,
            device_count: 2,
            segment_pages: 2048,
            segments: 100,
            first_segment: 100,
            total_segments: 200,
            data_start: 2048,
            generation: 9,
            checkpoint: Some(CkptRef { seq: 77, first_segment: 3, pages: 12 }),
            created_s: 1_700_000_000,
            seq_ceiling: 1 << 40,
        };
        let mut page = vec![0u8; PAGE];
        sb.emit(&mut page);
        assert_eq!(Superblock::parse(&page).unwrap(), sb);

        for kind in [
            SegmentKind::Data(2),
            SegmentKind::Checkpoint { next: Some(9) },
            SegmentKind::Checkpoint { next: None },
        ] {
            let h = SegmentHeader { segment: 5, opened_seq: 1234, erase_count: 3, kind };
            h.emit(&ARRAY, &mut page);
            assert_eq!(SegmentHeader::parse(&ARRAY, &page).unwrap(), h);
        }

        let g = GroupHeader {
            seq: 42,
            segment: 5,
            records: vec![
                Record::Write { vol: 1, vpage: 99, crc: 0xdead_beef },
                Record::Move { vol: 2, vpage: 7, old: 123, crc: 5 },
                Record::Trim { vol: 1, vpage: 0, pages: 1 << 40 },
                Record::Create { vol: 3, family: 3, pages: 1 << 20, name: "vm-disk".into() },
                Record::Resize { vol: 3, pages: 12 },
                Record::Delete { vol: 4 },
                Record::Snapshot { vol: 5, origin: 3, writable: true, name: "clone-a".into() },
            ],
        };
        g.emit(&ARRAY, &mut page);
        let parsed = GroupHeader::parse(&ARRAY, &page).unwrap();
        assert_eq!(parsed, g);
        assert_eq!(parsed.data_pages(), 2);

        CkptPage::emit(&ARRAY, 8, 3, b"payload", &mut page);
        assert_eq!(
            CkptPage::parse(&ARRAY, &page).unwrap(),
            CkptPage { seq: 8, index: 3, payload: b"payload".to_vec() }
        );
    }

    #[test]
    fn a_flipped_bit_or_a_foreign_array_is_refused() {
        let g = GroupHeader { seq: 1, segment: 0, records: vec![Record::Delete { vol: 1 }] };
        let mut page = vec![0u8; PAGE];
        g.emit(&ARRAY, &mut page);
        assert!(GroupHeader::parse(&[8; 16], &page).is_err(), "another array");
        for at in [0, 9, 30, 44, GROUP_HEADER_LEN + 2] {
            let mut bad = page.clone();
            bad[at] ^= 1;
            assert!(GroupHeader::parse(&ARRAY, &bad).is_err(), "bit flipped at {at}");
        }
        assert!(GroupHeader::parse(&ARRAY, &[0u8; PAGE]).is_err(), "a zeroed page");
        assert!(SegmentHeader::parse(&ARRAY, &page).is_err(), "a group header is no segment header");
    }

    #[test]
    fn a_full_header_takes_as_many_records_as_fit() {
        let one = Record::Write { vol: 1, vpage: 2, crc: 3 };
        let n = GROUP_RECORDS_BYTES / one.encoded_len();
        assert!(GroupHeader::fits(&vec![one.clone(); n]));
        assert!(!GroupHeader::fits(&vec![one.clone(); n + 1]));
        let g = GroupHeader { seq: 3, segment: 1, records: vec![one; n] };
        let mut page = vec![0u8; PAGE];
        g.emit(&ARRAY, &mut page);
        assert_eq!(GroupHeader::parse(&ARRAY, &page).unwrap().data_pages(), n);
    }

    /// The fuzz entry points on seeded noise and on mutations of inputs that parse: no panic
    /// (`cargo fuzz run flash_layout` searches much further).
    #[test]
    fn fuzz_entry_points_survive_noise() {
        let mut x = 0x5eed_f1a5_u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for case in 0..3000u64 {
            let len = (next() % 9000) as usize;
            let mut data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if let Some(first) = data.first_mut() {
                *first = case as u8;
            }
            fuzz_api::page(&data);
            fuzz_api::checkpoint(&data);
            if data.len() > 12 {
                data[12] = case as u8;
                // A record that names its leaf: the id at its offset once the pages are made.
                let at = u64::from_le_bytes(data[..8].try_into().unwrap()) % (4 * CKPT_PAYLOAD as u64);
                let id = u32::from_le_bytes(data[8..12].try_into().unwrap());
                let skip = (at % CKPT_PAYLOAD as u64) as usize;
                if case % 2 == 1 && data.len() > 13 + skip + 4 {
                    data[13 + skip..13 + skip + 4].copy_from_slice(&id.to_le_bytes());
                }
            }
            fuzz_api::leaf(&data);
        }
    }
}

/// Entry points for the fuzz targets (`fuzz/fuzz_targets/flash_layout.rs`); not an API.
#[doc(hidden)]
pub mod fuzz_api {
    use super::*;

    const ARRAY: ArrayId = [7; 16];

    /// The first byte picks the page kind (superblock, segment header, group header,
    /// checkpoint page, modulo 4); bit 2 of it asks for a page whose magic, array id and CRC
    /// are made right, so that the fuzzer reaches the fields; the rest is the page. Whatever
    /// parses must emit a page that parses to the same value. Never panics.
    pub fn page(data: &[u8]) {
        let Some((&which, rest)) = data.split_first() else { return };
        let mut page = vec![0u8; PAGE];
        let n = rest.len().min(PAGE);
        page[..n].copy_from_slice(&rest[..n]);
        let repair = which & 4 != 0;
        match which % 4 {
            0 => {
                if repair {
                    page[..MAGIC_LEN].copy_from_slice(SUPER_MAGIC);
                    seal(&mut page, 96, 108);
                }
                if let Ok(sb) = Superblock::parse(&page) {
                    let mut again = vec![0u8; PAGE];
                    sb.emit(&mut again);
                    assert_eq!(Superblock::parse(&again).expect("an emitted superblock parses"), sb);
                }
            }
            1 => {
                if repair {
                    page[..MAGIC_LEN].copy_from_slice(SEGMENT_MAGIC);
                    page[8..24].copy_from_slice(&ARRAY);
                    seal(&mut page, 48, 52);
                }
                if let Ok(h) = SegmentHeader::parse(&ARRAY, &page) {
                    let mut again = vec![0u8; PAGE];
                    h.emit(&ARRAY, &mut again);
                    assert_eq!(SegmentHeader::parse(&ARRAY, &again).expect("an emitted header parses"), h);
                }
            }
            2 => {
                if repair {
                    page[..MAGIC_LEN].copy_from_slice(GROUP_MAGIC);
                    page[8..24].copy_from_slice(&ARRAY);
                    let body = (u32_at(&page, 40) as usize) % (GROUP_RECORDS_BYTES + 1);
                    put_u32(&mut page, 40, body as u32);
                    seal(&mut page, 44, GROUP_HEADER_LEN + body);
                }
                if let Ok(g) = GroupHeader::parse(&ARRAY, &page) {
                    let mut again = vec![0u8; PAGE];
                    g.emit(&ARRAY, &mut again);
                    assert_eq!(GroupHeader::parse(&ARRAY, &again).expect("an emitted group parses"), g);
                }
            }
            _ => {
                if repair {
                    page[..MAGIC_LEN].copy_from_slice(CKPT_MAGIC);
                    page[8..24].copy_from_slice(&ARRAY);
                    seal(&mut page, 40, PAGE);
                }
                if let Ok(p) = CkptPage::parse(&ARRAY, &page) {
                    let mut again = vec![0u8; PAGE];
                    CkptPage::emit(&ARRAY, p.seq, p.index, &p.payload, &mut again);
                    assert_eq!(CkptPage::parse(&ARRAY, &again).expect("an emitted page parses"), p);
                }
            }
        }
    }

    /// A checkpoint's byte stream into `ckpt::decode` for a small array: never panics, and a
    /// controller it decodes either passes its audit or is refused by it (as recovery would),
    /// and encodes to a stream that decodes again.
    pub fn checkpoint(data: &[u8]) {
        let cfg = crate::ctl::Config { pool_pages: 8, ..crate::ctl::Config::default() };
        let Ok((mut c, seq)) = crate::ckpt::decode(&mut &data[..], cfg, 16, 64, None) else { return };
        if c.audit().is_err() {
            return;
        }
        let bytes = crate::ckpt::encode_to_vec(&mut c, seq, &[]);
        let (mut again, seq_again) =
            crate::ckpt::decode(&mut &bytes[..], cfg, 16, 64, None).expect("an encoded checkpoint decodes");
        assert_eq!(seq_again, seq);
        assert!(again.audit().is_ok(), "a re-encoded checkpoint passes its audit");
    }

    /// An evicted map leaf's record read back from the checkpoint's pages, as the look-ahead
    /// does (`ckpt::Chain::leaf_from_pages`): bytes 0..8 give the record's offset, 8..12 the
    /// leaf id, bit 0 of byte 12 asks for pages whose headers are made right (the rest of the
    /// input is then their payloads), and the rest is the pages. Never panics.
    pub fn leaf(data: &[u8]) {
        if data.len() < 13 {
            return;
        }
        let at = u64::from_le_bytes(data[..8].try_into().expect("8 bytes")) % (4 * CKPT_PAYLOAD as u64);
        let id = u32::from_le_bytes(data[8..12].try_into().expect("4 bytes"));
        let repair = data[12] & 1 != 0;
        let rest = &data[13..];
        let chain = crate::ckpt::Chain {
            array: ARRAY,
            seq: 7,
            pages: 8,
            segments: vec![3, 5, 6],
            segment_pages: 4,
            array_pages: 64,
        };
        let (index, n, _) = chain.record_pages(at);
        let mut pages = vec![0u8; n as usize * PAGE];
        for (k, page) in pages.chunks_mut(PAGE).enumerate() {
            if repair {
                let from = (k * CKPT_PAYLOAD).min(rest.len());
                let to = ((k + 1) * CKPT_PAYLOAD).min(rest.len());
                CkptPage::emit(&ARRAY, 7, index + k as u32, &rest[from..to], page);
            } else {
                let from = (k * PAGE).min(rest.len());
                let to = ((k + 1) * PAGE).min(rest.len());
                page[..to - from].copy_from_slice(&rest[from..to]);
            }
        }
        if let Ok(leaf) = chain.leaf_from_pages(id, at, &mut pages) {
            assert!(leaf.iter().all(|&p| p == 0 || (u64::from(p) < chain.array_pages && p % 4 != 0)));
        }
    }
}
