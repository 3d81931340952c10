//! One contiguous receive buffer per connection: bytes arrive in the spare tail, complete frames
//! are consumed from the front, and the short partial tail moves to the front between receives.

/// A fixed-size reassembly buffer; it never grows, so its address is stable for the kernel.
pub struct RxBuffer {
    buf: Box<[u8]>,
    /// First byte not yet consumed.
    start: usize,
    /// End of the bytes received.
    end: usize,
}

impl RxBuffer {
    pub fn new(capacity_bytes: usize) -> RxBuffer {
        RxBuffer { buf: vec![0u8; capacity_bytes].into_boxed_slice(), start: 0, end: 0 }
    }

    /// The bytes received and not yet consumed.
    pub fn filled(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    pub fn consume(&mut self, n: usize) {
        assert!(n <= self.end - self.start);
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Where the next receive may write.
    pub fn spare(&mut self) -> &mut [u8] {
        &mut self.buf[self.end..]
    }

    /// The spare tail as a raw pointer and length, for an SQE. The buffer must not be compacted
    /// or dropped until that SQE completes.
    pub fn spare_raw(&mut self) -> (*mut u8, usize) {
        let spare = self.spare();
        (spare.as_mut_ptr(), spare.len())
    }

    /// Record `n` bytes written into the spare tail.
    pub fn commit(&mut self, n: usize) {
        assert!(n <= self.buf.len() - self.end);
        self.end += n;
    }

    /// Copy `bytes` into the spare tail (compacting first if needed); false if they do not fit.
    pub fn append(&mut self, bytes: &[u8]) -> bool {
        if self.buf.len() - self.end < bytes.len() {
            self.compact();
        }
        let Some(dst) = self.spare().get_mut(..bytes.len()) else {
            return false;
        };
        dst.copy_from_slice(bytes);
        self.commit(bytes.len());
        true
    }

    /// Move the partial tail to the front. Only while no receive targets the spare tail.
    pub fn compact(&mut self) {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }
}
