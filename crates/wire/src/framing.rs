//! Reassembling frames from a byte stream.
//!
//! [`FrameBuffer`] is one contiguous buffer per connection: a transport reads into its spare
//! tail, and [`FrameBuffer::next_frame`] hands out complete frames in place, without copying.
//! Every header is shown to the caller's `admit` check as soon as its 24 bytes are in, before
//! any byte of the body is waited for, so a frame that the connection's state or negotiated
//! limits forbid is refused from its header alone (docs/PROTOCOL.md, sections 2 and 9). Frames
//! larger than the buffer grow it, up to what `admit` allowed. Consumed bytes are reclaimed by
//! moving the (short) partial tail to the front before the next read.
//!
//! The buffer is this crate's one allocation beyond control bodies: made once per connection
//! and grown only to the largest frame that the connection's `admit` let through.

use std::ops::Range;

use crate::{Header, WireError, HEADER_LEN};

/// The buffer's size before any frame asks for more.
const INITIAL_BYTES: usize = 256 << 10;
/// Read at least this much at a time; compact or grow when less is free.
const READ_CHUNK_MIN: usize = 64 << 10;

/// A complete frame inside the buffer: its header and where its body lies.
#[derive(Debug, Clone)]
pub struct FrameRef {
    pub header: Header,
    pub body: Range<usize>,
}

#[derive(Debug)]
pub struct FrameBuffer {
    buf: Vec<u8>,
    /// First byte not yet handed out as part of a frame.
    start: usize,
    /// End of the bytes received.
    end: usize,
    /// The last read filled all the space it was given, so the socket may hold more.
    last_read_full: bool,
    /// Read at least this much at a time ([`READ_CHUNK_MIN`], less for a small buffer).
    chunk_min: usize,
}

impl Default for FrameBuffer {
    fn default() -> Self {
        FrameBuffer::new()
    }
}

impl FrameBuffer {
    pub fn new() -> FrameBuffer {
        FrameBuffer::with_capacity(INITIAL_BYTES)
    }

    /// A buffer that starts at `bytes` (it grows as frames need), reading at least a quarter
    /// of that at a time.
    pub fn with_capacity(bytes: usize) -> FrameBuffer {
        let chunk_min = READ_CHUNK_MIN.min(bytes / 4).max(1);
        FrameBuffer { buf: vec![0; bytes], start: 0, end: 0, last_read_full: false, chunk_min }
    }

    /// Bytes received and not yet handed out.
    pub fn pending(&self) -> usize {
        self.end - self.start
    }

    /// Free space to read into, making room first when little is left.
    pub fn spare(&mut self) -> &mut [u8] {
        if self.buf.len() - self.end < self.chunk_min {
            self.compact();
            if self.buf.len() - self.end < self.chunk_min {
                let grown = (self.buf.len() * 2).max(self.end + self.chunk_min);
                self.buf.resize(grown, 0);
            }
        }
        &mut self.buf[self.end..]
    }

    /// Record that `n` bytes were written into [`spare`](Self::spare).
    pub fn commit(&mut self, n: usize) {
        assert!(self.end + n <= self.buf.len(), "commit past the buffer");
        self.end += n;
        self.last_read_full = self.end == self.buf.len();
    }

    /// Whether the last read filled the buffer. A stream socket that returned less than it was
    /// offered had nothing more at that moment, so an edge-triggered reader may stop there
    /// without the extra read that would only say `EAGAIN`: new data raises a new edge.
    pub fn last_read_full(&self) -> bool {
        self.last_read_full
    }

    /// Append bytes (for transports that do not read in place, and for tests).
    pub fn extend(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while !rest.is_empty() {
            let spare = self.spare();
            let n = spare.len().min(rest.len());
            spare[..n].copy_from_slice(&rest[..n]);
            self.commit(n);
            rest = &rest[n..];
        }
    }

    /// The next complete frame, if one has fully arrived. `admit` judges each header as soon as
    /// it is in, before the body is waited for; its error (or a header that fails
    /// [`Header::parse`]) ends the framing of the stream, and nothing is consumed.
    pub fn next_frame<E: From<WireError>>(
        &mut self,
        admit: impl FnOnce(&Header) -> Result<(), E>,
    ) -> Result<Option<FrameRef>, E> {
        let Some(header) = peek_header(self.unconsumed())? else {
            return Ok(None);
        };
        admit(&header)?;
        let len = header.frame_len();
        if self.pending() < len {
            self.reserve(len);
            return Ok(None);
        }
        let body = self.start + HEADER_LEN..self.start + len;
        self.start += len;
        Ok(Some(FrameRef { header, body }))
    }

    /// Give back `frame`, the last one [`next_frame`](Self::next_frame) returned (no read in
    /// between): it is returned again next time, for a receiver that handled only part of it.
    pub fn unread(&mut self, frame: &FrameRef) {
        assert_eq!(frame.body.end, self.start, "only the last frame taken can be given back");
        self.start = frame.body.start - HEADER_LEN;
    }

    /// Bytes received and not yet consumed, for receivers that parse in place (the client
    /// session, NBD).
    pub fn unconsumed(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Mark `n` bytes of [`unconsumed`](Self::unconsumed) as handled.
    pub fn consume(&mut self, n: usize) {
        assert!(n <= self.pending(), "consume past the received bytes");
        self.start += n;
    }

    /// Make sure `len` unconsumed bytes will fit once they arrive (a message whose length the
    /// caller has already judged). A buffer grown for it keeps a read's worth of room past
    /// it, so that reading its last bytes does not grow the buffer again.
    pub fn reserve(&mut self, len: usize) {
        if self.start + len > self.buf.len() {
            self.compact();
            if len > self.buf.len() {
                self.buf.resize(len + self.chunk_min, 0);
            }
        }
    }

    /// Give back memory a large message left: when nothing is pending and the buffer grew
    /// past `bytes`, it becomes `bytes` again (never less than it started with). For a driver
    /// to call on a connection gone quiet, not on every message: growing again costs an
    /// allocation and a fill.
    pub fn shrink_idle(&mut self, bytes: usize) {
        let bytes = bytes.max(INITIAL_BYTES);
        if self.pending() == 0 && self.buf.len() > bytes {
            self.buf = vec![0; bytes];
            self.start = 0;
            self.end = 0;
            self.last_read_full = false;
        }
    }

    /// Bytes the buffer holds room for.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// The bytes of a frame returned by [`next_frame`](Self::next_frame); valid until the
    /// next call to [`spare`](Self::spare).
    pub fn body(&self, frame: &FrameRef) -> &[u8] {
        &self.buf[frame.body.clone()]
    }

    fn compact(&mut self) {
        if self.start == 0 {
            return;
        }
        self.buf.copy_within(self.start..self.end, 0);
        self.end -= self.start;
        self.start = 0;
    }
}

/// The header at the start of `bytes`, validated, once all of its 24 bytes are there.
pub fn peek_header(bytes: &[u8]) -> Result<Option<Header>, WireError> {
    if bytes.len() < HEADER_LEN {
        return Ok(None);
    }
    Header::parse(bytes).map(Some)
}

/// An `admit` check for [`FrameBuffer::next_frame`] that bounds only the whole frame.
pub fn frame_at_most(frame_bytes_max: usize) -> impl Fn(&Header) -> Result<(), WireError> {
    move |h: &Header| {
        let len = h.frame_len();
        if len > frame_bytes_max {
            return Err(WireError::Limit {
                what: "frame bytes",
                value: len as u64,
                limit: frame_bytes_max as u64,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FrameKind;

    fn frame(kind: FrameKind, body: &[u8]) -> Vec<u8> {
        crate::control::frame(kind, body)
    }

    #[test]
    fn frames_split_anywhere_come_out_whole() {
        let a = frame(FrameKind::Stats, &[]);
        let b = frame(FrameKind::Open, &crate::Open { name: "vol".into() }.encode());
        let stream: Vec<u8> = [a.clone(), b.clone(), a.clone()].concat();
        for cut in 0..stream.len() {
            let mut fb = FrameBuffer::new();
            let mut got = Vec::new();
            for chunk in [&stream[..cut], &stream[cut..]] {
                fb.extend(chunk);
                while let Some(f) = fb.next_frame(frame_at_most(1 << 20)).unwrap() {
                    got.push((f.header.kind, fb.body(&f).to_vec()));
                }
            }
            assert_eq!(got.len(), 3, "cut at {cut}");
            assert_eq!(got[1].1, b[HEADER_LEN..]);
        }
    }

    #[test]
    fn a_frame_given_back_comes_out_again_and_then_the_next() {
        let a = frame(FrameKind::Stats, &[]);
        let b = frame(FrameKind::Open, &crate::Open { name: "vol".into() }.encode());
        let mut fb = FrameBuffer::new();
        fb.extend(&[a.clone(), b.clone()].concat());
        let first = fb.next_frame(frame_at_most(1 << 20)).unwrap().unwrap();
        let second = fb.next_frame(frame_at_most(1 << 20)).unwrap().unwrap();
        fb.unread(&second);
        assert_eq!(fb.pending(), b.len());
        let again = fb.next_frame(frame_at_most(1 << 20)).unwrap().unwrap();
        assert_eq!((again.header.kind, fb.body(&again)), (FrameKind::Open, &b[HEADER_LEN..]));
        assert!(fb.next_frame(frame_at_most(1 << 20)).unwrap().is_none());
        let given_back_late = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fb.unread(&first)));
        assert!(given_back_late.is_err(), "only the last frame taken can be given back");
    }

    #[test]
    fn admit_sees_each_header_before_any_of_its_body() {
        let mut fb = FrameBuffer::new();
        let big = Header { kind: FrameKind::Requests, desc_count: 0, payload_len: 10 << 20 };
        fb.extend(&big.to_bytes()[..23]);
        let mut seen = 0;
        let counted = fb.next_frame(|_| -> Result<(), WireError> {
            seen += 1;
            Ok(())
        });
        assert!(counted.unwrap().is_none());
        assert_eq!(seen, 0, "no header yet");
        fb.extend(&big.to_bytes()[23..]);
        assert!(matches!(fb.next_frame(frame_at_most(1 << 20)), Err(WireError::Limit { .. })));
        assert_eq!(fb.pending(), HEADER_LEN, "a refused frame consumes nothing");
    }

    #[test]
    fn large_frames_grow_the_buffer_and_garbage_is_refused() {
        let body = vec![7u8; 3 * INITIAL_BYTES];
        let h = Header { kind: FrameKind::Requests, desc_count: 0, payload_len: body.len() as u32 };
        let mut fb = FrameBuffer::new();
        fb.extend(&h.to_bytes());
        fb.extend(&body[..1000]);
        assert!(fb.next_frame(frame_at_most(8 << 20)).unwrap().is_none());
        fb.extend(&body[1000..]);
        let f = fb.next_frame(frame_at_most(8 << 20)).unwrap().unwrap();
        assert_eq!(fb.body(&f).len(), body.len());

        let mut fb = FrameBuffer::new();
        fb.extend(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(matches!(fb.next_frame(frame_at_most(1 << 20)), Err(WireError::BadMagic(_))));
    }
}
