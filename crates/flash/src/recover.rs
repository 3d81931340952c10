//! Recovery: the controller rebuilt from what the devices hold after a stop, clean or not.
//!
//! Start from the checkpoint the superblock names (or an empty array), then find every write
//! group written after it: every segment whose header says it was opened after the checkpoint,
//! or that the checkpoint saw open, is read group by group as a chain from its first page. A
//! group counts only if its header checks out (magic, this array, checksum), names this
//! segment, and its sequence number is not below the segment's opening and above the group
//! before it; the chain ends at the first page that fails, since nothing durable can follow a
//! group that was lost (syncs wait for every group issued before them). The groups found are
//! applied in sequence order; a data page whose checksum does not match its record was torn
//! by the crash and is skipped, so the page keeps its earlier contents: nothing half-written
//! is ever mapped. Segments that took groups after the checkpoint are closed (never appended
//! to again, until cleaned).
//!
//! Device reads come through a closure, so the logic here stays free of I/O.

use crate::ckpt::{self, Chain, ChainBytes, CkptLeaves, PageRead};
use crate::ctl::{Config, Controller};
use crate::layout::{page_crc, ArrayId, CkptRef, GroupHeader, Record, SegmentHeader, SegmentKind, PAGE};
use crate::space::State;
use crate::FlashError;

/// What recovery found and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Report {
    pub checkpoint_seq: u64,
    pub checkpoint_pages: u32,
    pub segments_scanned: u32,
    pub groups_replayed: u64,
    pub pages_read: u64,
    /// Data pages whose checksum failed: torn by the crash, left unmapped.
    pub torn_pages: u64,
}

/// Rebuild the controller of array `array` (`segments` × `segment_pages`), from checkpoint
/// `ckpt`, reading pages through `read` (which the map keeps, to read evicted leaves back).
pub fn recover(
    array: &ArrayId,
    ckpt: Option<CkptRef>,
    cfg: Config,
    segments: u32,
    segment_pages: u32,
    read: &PageRead,
) -> Result<(Controller, Report), FlashError> {
    let mut report = Report::default();
    let mut page = vec![0u8; PAGE];
    let (mut c, covered) = match ckpt {
        Some(r) => {
            let chain = checkpoint_chain(array, r, segments, segment_pages, read, &mut report)?;
            let mut bytes = ChainBytes::new(&chain, read);
            let source = Box::new(CkptLeaves::new(chain.clone(), read.clone()));
            let decoded = ckpt::decode(&mut bytes, cfg, segments, segment_pages, Some(source));
            report.pages_read += bytes.pages_read;
            report.checkpoint_pages = bytes.pages_read as u32;
            let (mut c, seq) = decoded?;
            if seq != r.seq {
                return Err(FlashError::Corrupt("checkpoint sequence differs from the superblock's"));
            }
            c.checkpoint_chain = Some(chain);
            (c, seq)
        }
        None => (Controller::new(cfg, segments, segment_pages), 0),
    };
    report.checkpoint_seq = covered;

    // Which segments to read, and what the checkpoint thought of each.
    let mut groups: Vec<(u64, u32, u32, GroupHeader)> = Vec::new();
    let mut segs = c.space.segs.clone();
    for s in 0..segments {
        let base = s * segment_pages;
        read(base, &mut page)?;
        report.pages_read += 1;
        let Ok(h) = SegmentHeader::parse(array, &page) else { continue };
        if h.segment != s {
            continue;
        }
        let seg = &mut segs[s as usize];
        seg.erase_count = seg.erase_count.max(h.erase_count);
        let was_open = matches!(seg.state, State::Open { .. });
        let SegmentKind::Data(_) = h.kind else {
            continue;
        };
        if h.opened_seq <= covered && !was_open {
            continue; // every group in it is in the checkpoint, or it is an old life's
        }
        report.segments_scanned += 1;
        tracing::trace!(
            segment = s,
            opened_seq = h.opened_seq,
            was_open,
            "flash recovery: reading a segment's groups"
        );
        let mut at = 1u32;
        let mut last = 0u64;
        let mut found = false;
        while at < segment_pages {
            read(base + at, &mut page)?;
            report.pages_read += 1;
            let Ok(g) = GroupHeader::parse(array, &page) else { break };
            let n = g.data_pages() as u32;
            if g.segment != s || g.seq < h.opened_seq || g.seq <= last || at + 1 + n > segment_pages {
                break;
            }
            last = g.seq;
            if g.seq > covered {
                groups.push((g.seq, s, at, g));
                found = true;
            }
            at += 1 + n;
        }
        // A segment that took groups after the checkpoint is closed; one opened after it with
        // nothing durable in it stays free (as the checkpoint recorded it).
        if found || was_open {
            seg.state = State::Full;
            seg.last_seq = seg.last_seq.max(last);
        }
    }
    // Rebuild the free list from the states found, then replay in order.
    c.space.restore(segs);
    groups.sort_by_key(|g| g.0);
    let mut pages = Vec::new();
    let mut max_seq = covered;
    for (seq, s, at, g) in &groups {
        if *seq == max_seq {
            return Err(FlashError::Corrupt("two groups with one sequence number"));
        }
        max_seq = *seq;
        // The group's data pages follow its header: read them at once.
        let first = s * segment_pages + at + 1;
        pages.resize(g.data_pages() * PAGE, 0);
        if !pages.is_empty() {
            read(first, &mut pages)?;
        }
        report.pages_read += g.data_pages() as u64;
        let mut pba = first - 1;
        let mut i = 0;
        for r in &g.records {
            if !r.carries_page() {
                c.apply(r)?;
                continue;
            }
            pba += 1;
            let data = &pages[i * PAGE..(i + 1) * PAGE];
            i += 1;
            match r {
                Record::Write { vol, vpage, crc } => {
                    if page_crc(data) != *crc {
                        report.torn_pages += 1;
                        continue;
                    }
                    if let Some(v) = c.vols.get_mut(vol) {
                        if *vpage < v.map.pages {
                            c.map.set(&mut v.map, *vpage, pba)?;
                        }
                    }
                }
                Record::Move { vol, vpage, old, crc } => {
                    if page_crc(data) != *crc {
                        report.torn_pages += 1;
                        continue;
                    }
                    c.relocate(*vol, *vpage, *old, pba)?;
                }
                _ => unreachable!("carries a page"),
            }
        }
        report.groups_replayed += 1;
        c.shed();
    }
    c.next_seq = max_seq + 1;
    c.durable_seq = max_seq;
    c.checkpoint = ckpt;
    c.audit_in_memory().map_err(|_| FlashError::Corrupt("recovered state fails its own checks"))?;
    Ok((c, report))
}

/// Where checkpoint `r` lies: its chain of segments, from their headers.
fn checkpoint_chain(
    array: &ArrayId,
    r: CkptRef,
    segments: u32,
    segment_pages: u32,
    read: &PageRead,
    report: &mut Report,
) -> Result<Chain, FlashError> {
    let mut page = vec![0u8; PAGE];
    let mut chain = Vec::new();
    let mut segment = r.first_segment;
    let per = u64::from(segment_pages - 1);
    while (chain.len() as u64) * per < u64::from(r.pages) {
        if segment >= segments || chain.len() > segments as usize {
            return Err(FlashError::Corrupt("checkpoint chain leaves the array"));
        }
        read(segment * segment_pages, &mut page)?;
        report.pages_read += 1;
        let h = SegmentHeader::parse(array, &page)?;
        let SegmentKind::Checkpoint { next } = h.kind else {
            return Err(FlashError::Corrupt("checkpoint chain reaches a data segment"));
        };
        chain.push(segment);
        match next {
            Some(n) => segment = n,
            None if (chain.len() as u64) * per < u64::from(r.pages) => {
                return Err(FlashError::Corrupt("checkpoint chain ends early"))
            }
            None => {}
        }
    }
    Ok(Chain {
        array: *array,
        seq: r.seq,
        pages: r.pages,
        segments: chain,
        segment_pages,
        array_pages: u64::from(segments) * u64::from(segment_pages),
    })
}
