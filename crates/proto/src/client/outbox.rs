//! Request caravans between `submit` and the wire.
//!
//! The [`Outbox`] holds the open caravan (the one requests are still joining) behind zero or
//! more sealed caravans that wait to be sent, in one reusable byte buffer of headers and
//! descriptors and one list of tags in wire order. Write payloads are not copied here: a
//! sealed caravan's payloads are the buffers its write requests carry, which the session
//! gathers from its slots when the driver asks what to send. A driver that can send only part
//! of a caravan (a full socket, a short write) reports what went, and the outbox resumes from
//! there on the next call; a caravan leaves the outbox only once all its bytes are sent.
//!
//! Everything is sized at construction from the queue depth (every queued request holds a
//! slot, so no more than `queue_depth` descriptors or caravans can ever wait here): nothing
//! allocates afterwards.

use std::collections::VecDeque;
use std::io::IoSlice;

use wire::{FrameKind, Header, Limits, Request, HEADER_LEN, REQUEST_DESC_LEN};

/// A caravan whose header is written and which waits for the wire.
#[derive(Debug, Clone, Copy)]
struct Sealed {
    /// Header and descriptors.
    head_len: usize,
    reqs: usize,
    /// Head and payload: the whole frame.
    wire_len: usize,
}

/// A gather list being filled, skipping what was already sent.
struct Gather<'i, 'a> {
    iov: &'i mut [IoSlice<'a>],
    n: usize,
    skip: usize,
}

impl<'a> Gather<'_, 'a> {
    /// Add `piece` (or what of it is unsent); false once the list is full.
    fn put(&mut self, piece: &'a [u8]) -> bool {
        if self.skip >= piece.len() {
            self.skip -= piece.len();
            return true;
        }
        if self.n == self.iov.len() {
            return false;
        }
        self.iov[self.n] = IoSlice::new(&piece[self.skip..]);
        self.skip = 0;
        self.n += 1;
        true
    }
}

#[derive(Debug)]
pub struct Outbox {
    /// Sealed caravans' heads, then the open caravan's header slot and descriptors.
    bytes: Vec<u8>,
    /// Tags of the sealed caravans, then of the open one, in wire order.
    tags: Vec<u32>,
    sealed: VecDeque<Sealed>,
    /// Where the open caravan starts in `bytes` and `tags`.
    open_at: usize,
    open_tags_at: usize,
    open_payload_bytes: u32,
    /// Bytes of the first sealed caravan already sent.
    sent: usize,
    reqs_max: usize,
    bytes_max: u32,
}

impl Outbox {
    /// An outbox for caravans within `limits`, holding at most `queue_depth` requests.
    pub fn new(limits: &Limits, queue_depth: usize) -> Outbox {
        let reqs_max = (limits.caravan_reqs_max as usize).min(u16::MAX as usize).max(1);
        let mut bytes = Vec::with_capacity(queue_depth * (HEADER_LEN + REQUEST_DESC_LEN) + HEADER_LEN);
        bytes.resize(HEADER_LEN, 0);
        Outbox {
            bytes,
            tags: Vec::with_capacity(queue_depth),
            sealed: VecDeque::with_capacity(queue_depth),
            open_at: 0,
            open_tags_at: 0,
            open_payload_bytes: 0,
            sent: 0,
            reqs_max,
            bytes_max: limits.caravan_bytes_max,
        }
    }

    /// Requests in the open caravan.
    pub fn open_len(&self) -> usize {
        self.tags.len() - self.open_tags_at
    }

    pub fn open_payload_bytes(&self) -> u32 {
        self.open_payload_bytes
    }

    /// Requests here, sealed or open: queued and not yet wholly sent.
    pub fn queued_reqs(&self) -> usize {
        self.tags.len()
    }

    /// Whether a sealed caravan waits for the wire.
    pub fn has_sealed(&self) -> bool {
        !self.sealed.is_empty()
    }

    /// Whether `req` fits in the open caravan under the negotiated limits.
    pub fn fits(&self, req: &Request) -> bool {
        self.open_len() < self.reqs_max
            && u64::from(self.open_payload_bytes) + u64::from(req.payload_len()) <= u64::from(self.bytes_max)
    }

    /// Append a descriptor to the open caravan. The caller checked [`fits`](Self::fits).
    pub fn push(&mut self, req: &Request) {
        debug_assert!(self.fits(req));
        let at = self.bytes.len();
        self.bytes.resize(at + REQUEST_DESC_LEN, 0);
        req.emit(&mut self.bytes[at..]);
        self.tags.push(req.tag);
        self.open_payload_bytes += req.payload_len();
    }

    /// Close the open caravan: write its header and queue it for the wire. Returns how many
    /// requests it holds (zero, and nothing sealed, when it was empty).
    pub fn seal(&mut self) -> usize {
        let reqs = self.open_len();
        if reqs == 0 {
            return 0;
        }
        let header = Header {
            kind: FrameKind::Requests,
            desc_count: reqs as u16,
            payload_len: self.open_payload_bytes,
        };
        header.emit(&mut self.bytes[self.open_at..]);
        let head_len = self.bytes.len() - self.open_at;
        self.sealed.push_back(Sealed {
            head_len,
            reqs,
            wire_len: head_len + self.open_payload_bytes as usize,
        });
        self.open_at = self.bytes.len();
        self.open_tags_at = self.tags.len();
        self.open_payload_bytes = 0;
        self.bytes.resize(self.open_at + HEADER_LEN, 0);
        reqs
    }

    /// Fill `iov` with what is still to be sent of the sealed caravans, in order: each head,
    /// then the payload of each of its requests as `payload` gives it, in two pieces (a direct
    /// write's capability and its data; empty for what a request does not carry). Returns how
    /// many entries it filled.
    pub fn gather<'a>(&'a self, payload: impl Fn(u32) -> [&'a [u8]; 2], iov: &mut [IoSlice<'a>]) -> usize {
        let mut out = Gather { iov, n: 0, skip: self.sent };
        let (mut at, mut tag_at) = (0, 0);
        for c in &self.sealed {
            if !out.put(&self.bytes[at..at + c.head_len]) {
                break;
            }
            let full = self.tags[tag_at..tag_at + c.reqs].iter().all(|&tag| {
                let [head, tail] = payload(tag);
                out.put(head) && out.put(tail)
            });
            if !full {
                break;
            }
            at += c.head_len;
            tag_at += c.reqs;
        }
        out.n
    }

    /// Account for `n` more bytes sent; `on_sent` hears the tag of every request whose caravan
    /// has now left whole.
    pub fn advance(&mut self, n: usize, mut on_sent: impl FnMut(u32)) {
        self.sent += n;
        let (mut bytes_done, mut tags_done) = (0, 0);
        while let Some(&c) = self.sealed.front() {
            if self.sent < c.wire_len {
                break;
            }
            self.sent -= c.wire_len;
            for &tag in &self.tags[tags_done..tags_done + c.reqs] {
                on_sent(tag);
            }
            bytes_done += c.head_len;
            tags_done += c.reqs;
            self.sealed.pop_front();
        }
        // Bytes counted as sent that no sealed caravan holds would shift every later caravan:
        // the next send would start inside one.
        assert!(!self.sealed.is_empty() || self.sent == 0, "sent more than was sealed");
        if bytes_done > 0 {
            self.bytes.copy_within(bytes_done.., 0);
            self.bytes.truncate(self.bytes.len() - bytes_done);
            self.tags.drain(..tags_done);
            self.open_at -= bytes_done;
            self.open_tags_at -= tags_done;
        }
    }

    /// Forget everything queued (the connection is gone), keeping the allocations.
    pub fn clear(&mut self) {
        self.bytes.truncate(HEADER_LEN);
        self.tags.clear();
        self.sealed.clear();
        self.open_at = 0;
        self.open_tags_at = 0;
        self.open_payload_bytes = 0;
        self.sent = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::{caravan::RequestCaravan, Opcode, ReqFlags};

    fn req(opcode: Opcode, tag: u32, length: u32) -> Request {
        Request { opcode, flags: ReqFlags::empty(), tag, handle: 0, offset: u64::from(tag) * 4096, length }
    }

    fn limits(reqs: u32, bytes: u32) -> Limits {
        Limits { queue_depth: 64, caravan_reqs_max: reqs, caravan_bytes_max: bytes, io_bytes_max: bytes }
    }

    /// Payload of a write with tag `t`: `t` repeated.
    fn payloads() -> Vec<Vec<u8>> {
        (0..16u8).map(|t| vec![t; 100 + t as usize]).collect()
    }

    /// Send everything through a socket that takes `chunk` bytes per call.
    fn drain(o: &mut Outbox, payloads: &[Vec<u8>], is_write: &[bool], chunk: usize) -> (Vec<u8>, Vec<u32>) {
        let mut wire = Vec::new();
        let mut sent_tags = Vec::new();
        while o.has_sealed() {
            let mut iov = [IoSlice::new(&[]); 3];
            let n = o.gather(
                |t| [if is_write[t as usize] { &payloads[t as usize][..] } else { &[] }, &[]],
                &mut iov,
            );
            assert!(n > 0);
            let mut room = chunk;
            for piece in &iov[..n] {
                let take = piece.len().min(room);
                wire.extend_from_slice(&piece[..take]);
                room -= take;
            }
            o.advance(chunk - room, |t| sent_tags.push(t));
        }
        (wire, sent_tags)
    }

    #[test]
    fn sealed_caravans_go_out_whole_and_in_order_through_any_partial_sends() {
        let p = payloads();
        let is_write: Vec<bool> = (0..16).map(|t| t % 3 != 1).collect();
        for chunk in [1, 7, 100, 4096, 1 << 20] {
            let mut o = Outbox::new(&limits(3, 1 << 20), 64);
            for t in 0..8u32 {
                let op = if is_write[t as usize] { Opcode::Write } else { Opcode::Read };
                let r = req(op, t, p[t as usize].len() as u32);
                if !o.fits(&r) {
                    o.seal();
                }
                o.push(&r);
            }
            assert_eq!(o.seal(), 2, "8 requests in caravans of 3: 3 + 3 + 2");
            assert_eq!(o.queued_reqs(), 8);
            let (wire, sent) = drain(&mut o, &p, &is_write, chunk);
            assert_eq!(sent, (0..8).collect::<Vec<_>>(), "chunk {chunk}");
            assert_eq!(o.queued_reqs(), 0);
            // The bytes parse back as three caravans carrying the right payloads.
            let mut rest = &wire[..];
            let mut tags = Vec::new();
            while !rest.is_empty() {
                let h = Header::parse(rest).unwrap();
                let c = RequestCaravan::parse(&h, &rest[HEADER_LEN..h.frame_len()]).unwrap();
                for (r, payload) in c.iter() {
                    let r = r.unwrap();
                    let want: &[u8] = if is_write[r.tag as usize] { &p[r.tag as usize] } else { &[] };
                    assert_eq!(payload, want);
                    tags.push(r.tag);
                }
                rest = &rest[h.frame_len()..];
            }
            assert_eq!(tags, (0..8).collect::<Vec<_>>());
        }
    }

    #[test]
    fn the_open_caravan_keeps_filling_while_a_sealed_one_is_half_sent() {
        let p = payloads();
        let is_write = vec![true; 16];
        let mut o = Outbox::new(&limits(64, 1 << 20), 64);
        o.push(&req(Opcode::Write, 0, p[0].len() as u32));
        o.seal();
        let mut iov = [IoSlice::new(&[]); 4];
        o.gather(|t| [&p[t as usize][..], &[]], &mut iov);
        let mut sent = Vec::new();
        o.advance(30, |t| sent.push(t));
        assert!(sent.is_empty(), "half a caravan is not sent");
        o.push(&req(Opcode::Write, 1, p[1].len() as u32));
        assert_eq!((o.open_len(), o.queued_reqs()), (1, 2));
        let (wire, tags) = drain(&mut o, &p, &is_write, 13);
        assert_eq!(tags, vec![0]);
        assert_eq!(wire.len() + 30, HEADER_LEN + REQUEST_DESC_LEN + p[0].len());
        assert_eq!(o.open_len(), 1, "the open caravan is untouched by sending the sealed one");
        o.seal();
        let (_, tags) = drain(&mut o, &p, &is_write, 1 << 20);
        assert_eq!(tags, vec![1]);
    }

    #[test]
    fn limits_bound_the_open_caravan() {
        let mut o = Outbox::new(&limits(2, 8192), 8);
        assert!(o.fits(&req(Opcode::Write, 0, 8192)));
        o.push(&req(Opcode::Write, 0, 4096));
        assert!(!o.fits(&req(Opcode::Write, 1, 8192)), "bytes");
        assert!(o.fits(&req(Opcode::Read, 1, 8192)), "reads carry no payload");
        o.push(&req(Opcode::Read, 1, 8192));
        assert!(!o.fits(&req(Opcode::Flush, 2, 0)), "descriptors");
        o.clear();
        assert_eq!((o.open_len(), o.queued_reqs(), o.seal()), (0, 0, 0));
    }
}
