//! Building request caravans and deciding when to send them.
//!
//! [`CaravanBuilder`] keeps the header and descriptors of the caravan being filled in one
//! reusable buffer; payloads are not copied into it: the driver gathers them from the callers'
//! buffers with a vectored send. [`Doorbell`] is the i10 policy: ring when the caravan holds
//! `aggregation_reqs` requests or `aggregation_bytes` payload bytes, when a request asks for
//! `NO_DELAY`, when the caller commits or waits, or once `delay_us` has passed since the first
//! request queued (checked whenever the caller enters the lane).

use wire::{FrameKind, Header, Limits, ReqFlags, Request, HEADER_LEN, REQUEST_DESC_LEN};

/// The open caravan: header space, descriptors, and a count of the payload bytes it refers to.
#[derive(Debug)]
pub struct CaravanBuilder {
    buf: Vec<u8>,
    reqs: u16,
    payload_bytes: u32,
    reqs_max: u16,
    bytes_max: u32,
}

impl CaravanBuilder {
    /// A builder for caravans within the negotiated `limits`; allocates once.
    pub fn new(limits: &Limits) -> CaravanBuilder {
        let reqs_max = limits.caravan_reqs_max.min(u16::MAX as u32) as u16;
        let mut buf = Vec::with_capacity(HEADER_LEN + reqs_max as usize * REQUEST_DESC_LEN);
        buf.resize(HEADER_LEN, 0);
        CaravanBuilder { buf, reqs: 0, payload_bytes: 0, reqs_max, bytes_max: limits.caravan_bytes_max }
    }

    pub fn len(&self) -> usize {
        self.reqs as usize
    }

    pub fn is_empty(&self) -> bool {
        self.reqs == 0
    }

    pub fn payload_bytes(&self) -> u32 {
        self.payload_bytes
    }

    /// Whether `req` fits in the open caravan under the hard limits.
    pub fn fits(&self, req: &Request) -> bool {
        self.reqs < self.reqs_max
            && u64::from(self.payload_bytes) + u64::from(req.payload_len()) <= u64::from(self.bytes_max)
    }

    /// Append a descriptor. The caller checked [`fits`](Self::fits).
    pub fn push(&mut self, req: &Request) {
        debug_assert!(self.fits(req));
        let at = self.buf.len();
        self.buf.resize(at + REQUEST_DESC_LEN, 0);
        req.emit(&mut self.buf[at..]);
        self.reqs += 1;
        self.payload_bytes += req.payload_len();
    }

    /// Seal the caravan: write its header, return header and descriptors as one slice. The
    /// payloads follow on the wire in the order the requests were pushed.
    pub fn seal(&mut self) -> &[u8] {
        let header =
            Header { kind: FrameKind::Requests, desc_count: self.reqs, payload_len: self.payload_bytes };
        header.emit(&mut self.buf[..HEADER_LEN]);
        &self.buf
    }

    /// Start a new caravan, keeping the allocation.
    pub fn clear(&mut self) {
        self.buf.truncate(HEADER_LEN);
        self.reqs = 0;
        self.payload_bytes = 0;
    }
}

/// When to send the open caravan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Doorbell {
    /// Ring when the caravan holds this many requests (i10: 16).
    pub aggregation_reqs: u32,
    /// Ring when the caravan's payload reaches this many bytes (i10: 64 KiB).
    pub aggregation_bytes: u32,
    /// Ring when the oldest queued request has waited this long (i10: 50 µs); zero rings at
    /// once on every submit.
    pub delay_us: u64,
}

impl Default for Doorbell {
    fn default() -> Doorbell {
        Doorbell { aggregation_reqs: 16, aggregation_bytes: 64 << 10, delay_us: 50 }
    }
}

impl Doorbell {
    /// After a submit: must the caravan go now?
    pub fn ring_after_submit(&self, caravan: &CaravanBuilder, flags: ReqFlags) -> bool {
        flags.contains(ReqFlags::NO_DELAY)
            || self.delay_us == 0
            || caravan.len() as u32 >= self.aggregation_reqs
            || caravan.payload_bytes() >= self.aggregation_bytes
    }

    /// Has the delay bound passed for a caravan whose first request queued at `first_us`?
    pub fn expired(&self, first_us: u64, now_us: u64) -> bool {
        now_us.saturating_sub(first_us) >= self.delay_us
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wire::{caravan::RequestCaravan, Opcode};

    fn req(opcode: Opcode, tag: u32, length: u32) -> Request {
        Request { opcode, flags: ReqFlags::empty(), tag, handle: 0, offset: u64::from(tag) * 4096, length }
    }

    #[test]
    fn sealed_caravan_parses_back() {
        let mut b = CaravanBuilder::new(&Limits::default());
        b.push(&req(Opcode::Write, 1, 4096));
        b.push(&req(Opcode::Read, 2, 4096));
        let mut frame = b.seal().to_vec();
        frame.extend_from_slice(&[0xAB; 4096]);
        let h = Header::parse(&frame).unwrap();
        assert_eq!((h.desc_count, h.payload_len), (2, 4096));
        let c = RequestCaravan::parse(&h, &frame[HEADER_LEN..]).unwrap();
        let got: Vec<_> = c.iter().map(|(r, p)| (r.unwrap().tag, p.len())).collect();
        assert_eq!(got, vec![(1, 4096), (2, 0)]);
        b.clear();
        assert!(b.is_empty());
        assert_eq!(b.seal().len(), HEADER_LEN);
    }

    #[test]
    fn hard_limits_bound_a_caravan() {
        let limits =
            Limits { queue_depth: 4, caravan_reqs_max: 2, caravan_bytes_max: 8192, io_bytes_max: 8192 };
        let mut b = CaravanBuilder::new(&limits);
        assert!(b.fits(&req(Opcode::Write, 0, 8192)));
        b.push(&req(Opcode::Write, 0, 4096));
        assert!(!b.fits(&req(Opcode::Write, 1, 8192)), "bytes");
        assert!(b.fits(&req(Opcode::Read, 1, 8192)), "reads carry no payload");
        b.push(&req(Opcode::Read, 1, 8192));
        assert!(!b.fits(&req(Opcode::Flush, 2, 0)), "descriptors");
    }

    #[test]
    fn doorbell_rings_on_size_bytes_no_delay_and_time() {
        let bell = Doorbell { aggregation_reqs: 2, aggregation_bytes: 8192, delay_us: 50 };
        let mut b = CaravanBuilder::new(&Limits::default());
        b.push(&req(Opcode::Read, 0, 4096));
        assert!(!bell.ring_after_submit(&b, ReqFlags::empty()));
        assert!(bell.ring_after_submit(&b, ReqFlags::NO_DELAY));
        b.push(&req(Opcode::Read, 1, 4096));
        assert!(bell.ring_after_submit(&b, ReqFlags::empty()));
        b.clear();
        b.push(&req(Opcode::Write, 2, 8192));
        assert!(bell.ring_after_submit(&b, ReqFlags::empty()), "byte threshold");
        assert!(!bell.expired(100, 149));
        assert!(bell.expired(100, 150));
        let eager = Doorbell { delay_us: 0, ..bell };
        b.clear();
        b.push(&req(Opcode::Read, 3, 512));
        assert!(eager.ring_after_submit(&b, ReqFlags::empty()));
    }
}
