//! Response batches: the iovecs of whole response caravans, waiting to be sent in one call.
//!
//! A [`TxBatch`] owns a fixed set of header slots (header and completion descriptors of one
//! caravan each) and a fixed-capacity iovec array; data iovecs point straight into the data
//! area, so no payload byte is copied in user space. [`TxPair`] keeps two batches: the one being
//! sent (`flight`) and the one responses are added to (`staged`). A batch's slots are rewritten
//! only after it has been swapped out of flight, which is what an asynchronous send needs: the
//! kernel may read a slot until the send (or, for zero-copy, its notification) completes.

use crate::shape::{Completion, Header, ReadRequest, COMPLETION_DESC_LEN, HEADER_LEN};
use crate::sys::IOV_MAX;

/// Bounds of what the server holds at once; the client keeps within them.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Requests per caravan.
    pub caravan_max: usize,
    /// Caravans the client may have outstanding.
    pub outstanding_max: usize,
    /// Bytes per read.
    pub bs_max: usize,
}

impl Limits {
    pub fn slot_len(&self) -> usize {
        HEADER_LEN + self.caravan_max * COMPLETION_DESC_LEN
    }

    /// Header-slot bytes for both batches of a [`TxPair`].
    pub fn slots_len(&self) -> usize {
        2 * self.outstanding_max * self.slot_len()
    }
}

pub struct TxBatch<'r> {
    slots: &'r mut [u8],
    slot_len: usize,
    slots_used: usize,
    iovs: Vec<libc::iovec>,
    /// First iovec not yet (completely) sent; the kernel-visible part starts here.
    first: usize,
    bytes_left: usize,
}

impl<'r> TxBatch<'r> {
    fn new(slots: &'r mut [u8], limits: &Limits) -> TxBatch<'r> {
        let iov_capacity = limits.outstanding_max * (1 + limits.caravan_max);
        TxBatch {
            slots,
            slot_len: limits.slot_len(),
            slots_used: 0,
            iovs: Vec::with_capacity(iov_capacity),
            first: 0,
            bytes_left: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.bytes_left == 0
    }

    fn has_room(&self, count: usize) -> bool {
        (self.slots_used + 1) * self.slot_len <= self.slots.len()
            && self.iovs.len() + 1 + count <= self.iovs.capacity()
    }

    /// Append the response to one request caravan; false (and nothing appended) when full.
    pub fn push_response(&mut self, seq: u64, reads: &[ReadRequest], data: &'r [u8]) -> bool {
        if !self.has_room(reads.len()) {
            return false;
        }
        let slot_len = HEADER_LEN + reads.len() * COMPLETION_DESC_LEN;
        let data_len: usize = reads.iter().map(|r| r.length as usize).sum();
        let at = self.slots_used * self.slot_len;
        let slot = &mut self.slots[at..at + slot_len];
        let header = Header {
            responses: true,
            count: reads.len() as u16,
            seq,
            body_len: (slot_len - HEADER_LEN + data_len) as u32,
        };
        header.emit(&mut slot[..HEADER_LEN]);
        let descs = slot[HEADER_LEN..].chunks_exact_mut(COMPLETION_DESC_LEN);
        for (read, desc) in reads.iter().zip(descs) {
            Completion { tag: read.tag, status: 0, data_len: read.length }.emit(desc);
        }
        self.slots_used += 1;
        self.iovs.push(iovec(slot));
        for read in reads {
            let start = read.offset as usize;
            self.iovs.push(iovec(&data[start..start + read.length as usize]));
        }
        self.bytes_left += slot_len + data_len;
        true
    }

    /// The iovecs still to send, at most `IOV_MAX` of them.
    pub fn pending(&self) -> &[libc::iovec] {
        let end = self.iovs.len().min(self.first + IOV_MAX);
        &self.iovs[self.first..end]
    }

    /// Record `n` bytes as sent; when all are, the batch is ready for [`TxBatch::reset`].
    pub fn advance(&mut self, mut n: usize) {
        assert!(n <= self.bytes_left, "sent {n} bytes of {}", self.bytes_left);
        self.bytes_left -= n;
        while n > 0 {
            let iov = &mut self.iovs[self.first];
            if n >= iov.iov_len {
                n -= iov.iov_len;
                self.first += 1;
            } else {
                // SAFETY: `n < iov_len`, so the pointer stays inside the iovec's own span.
                iov.iov_base = unsafe { iov.iov_base.cast::<u8>().add(n).cast() };
                iov.iov_len -= n;
                n = 0;
            }
        }
    }

    fn reset(&mut self) {
        debug_assert!(self.is_empty());
        self.iovs.clear();
        self.first = 0;
        self.slots_used = 0;
    }
}

fn iovec(bytes: &[u8]) -> libc::iovec {
    libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() }
}

pub struct TxPair<'r> {
    flight: TxBatch<'r>,
    staged: TxBatch<'r>,
}

impl<'r> TxPair<'r> {
    pub fn new(slots: &'r mut [u8], limits: &Limits) -> TxPair<'r> {
        let (a, b) = slots.split_at_mut(slots.len() / 2);
        TxPair { flight: TxBatch::new(a, limits), staged: TxBatch::new(b, limits) }
    }

    /// Where new responses go.
    pub fn staged(&mut self) -> &mut TxBatch<'r> {
        &mut self.staged
    }

    /// The batch to send next: flight if it still has bytes, else the staged batch, swapped
    /// in. The caller must know the kernel no longer reads the old flight batch.
    pub fn poll_flight(&mut self) -> Option<&TxBatch<'r>> {
        if self.flight.is_empty() {
            if self.staged.is_empty() {
                return None;
            }
            self.flight.reset();
            std::mem::swap(&mut self.flight, &mut self.staged);
        }
        Some(&self.flight)
    }

    /// Record `n` bytes of flight as sent.
    pub fn handle_sent(&mut self, n: usize) {
        self.flight.advance(n);
    }

    pub fn is_idle(&self) -> bool {
        self.flight.is_empty() && self.staged.is_empty()
    }
}
