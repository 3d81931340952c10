//! Reassembling frames from a byte stream.
//!
//! [`FrameBuffer`] is one contiguous buffer per connection: the transport reads into its spare
//! tail, and [`FrameBuffer::next_frame`] hands out complete frames in place, without copying.
//! Frames larger than the buffer grow it, up to the limit the caller passes; a header that
//! announces more is a framing error before a single byte of its body is read. Consumed bytes
//! are reclaimed by moving the (short) partial tail to the front before the next read.

use std::ops::Range;

use wire::{Header, WireError, HEADER_LEN};

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

/// Why the stream cannot be framed any more.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("frame of {len} bytes exceeds the limit of {limit}")]
    TooLarge { len: usize, limit: usize },
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
}

impl Default for FrameBuffer {
    fn default() -> Self {
        FrameBuffer::new()
    }
}

impl FrameBuffer {
    pub fn new() -> FrameBuffer {
        FrameBuffer { buf: vec![0; INITIAL_BYTES], start: 0, end: 0, last_read_full: false }
    }

    /// Bytes received and not yet handed out.
    pub fn pending(&self) -> usize {
        self.end - self.start
    }

    /// Free space to read into, making room first when little is left.
    pub fn spare(&mut self) -> &mut [u8] {
        if self.buf.len() - self.end < READ_CHUNK_MIN {
            self.compact();
            if self.buf.len() - self.end < READ_CHUNK_MIN {
                let grown = (self.buf.len() * 2).max(self.end + READ_CHUNK_MIN);
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

    /// The next complete frame, if one has fully arrived. A frame whose header announces more
    /// than `frame_bytes_max` is refused as soon as the header is in.
    pub fn next_frame(&mut self, frame_bytes_max: usize) -> Result<Option<FrameRef>, FrameError> {
        let Some(header) = self.next_header(frame_bytes_max)? else {
            return Ok(None);
        };
        let len = header.frame_len();
        if self.pending() < len {
            self.reserve_frame(len);
            return Ok(None);
        }
        let body = self.start + HEADER_LEN..self.start + len;
        self.start += len;
        Ok(Some(FrameRef { header, body }))
    }

    /// The next frame when its header has arrived but not all of its body: the header, checked
    /// as in [`next_frame`](Self::next_frame), and the body bytes received so far. A receiver
    /// that can tell from them where the rest belongs reads it there directly and
    /// [`consume`](Self::consume)s what it took from here.
    pub fn partial_frame(&self, frame_bytes_max: usize) -> Result<Option<(Header, &[u8])>, FrameError> {
        match self.next_header(frame_bytes_max)? {
            Some(header) if self.pending() < header.frame_len() => {
                Ok(Some((header, &self.buf[self.start + HEADER_LEN..self.end])))
            }
            _ => Ok(None),
        }
    }

    /// The next frame's header, checked, with its length within `frame_bytes_max`, once it
    /// has arrived.
    fn next_header(&self, frame_bytes_max: usize) -> Result<Option<Header>, FrameError> {
        let avail = &self.buf[self.start..self.end];
        if avail.len() < HEADER_LEN {
            return Ok(None);
        }
        let header = Header::parse(avail)?;
        let len = header.frame_len();
        if len > frame_bytes_max {
            return Err(FrameError::TooLarge { len, limit: frame_bytes_max });
        }
        Ok(Some(header))
    }

    /// Bytes received and not yet consumed, for protocols framed differently (NBD).
    pub fn unconsumed(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Mark `n` bytes of [`unconsumed`](Self::unconsumed) as handled.
    pub fn consume(&mut self, n: usize) {
        assert!(n <= self.pending(), "consume past the received bytes");
        self.start += n;
    }

    /// Make sure `len` unconsumed bytes will fit once they arrive (a message of known length).
    pub fn reserve(&mut self, len: usize) {
        self.reserve_frame(len);
    }

    /// The bytes of a frame returned by [`next_frame`](Self::next_frame); valid until the
    /// next call to [`spare`](Self::spare).
    pub fn body(&self, frame: &FrameRef) -> &[u8] {
        &self.buf[frame.body.clone()]
    }

    /// Make sure a frame of `len` bytes starting at `start` will fit once it arrives.
    fn reserve_frame(&mut self, len: usize) {
        if self.start + len > self.buf.len() {
            self.compact();
            if len > self.buf.len() {
                self.buf.resize(len, 0);
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use wire::FrameKind;

    fn frame(kind: FrameKind, body: &[u8]) -> Vec<u8> {
        wire::control::frame(kind, body)
    }

    #[test]
    fn frames_split_anywhere_come_out_whole() {
        let a = frame(FrameKind::Stats, &[]);
        let b = frame(FrameKind::Open, &wire::Open { name: "vol".into() }.encode());
        let stream: Vec<u8> = [a.clone(), b.clone(), a.clone()].concat();
        for cut in 0..stream.len() {
            let mut fb = FrameBuffer::new();
            let mut got = Vec::new();
            for chunk in [&stream[..cut], &stream[cut..]] {
                fb.extend(chunk);
                while let Some(f) = fb.next_frame(1 << 20).unwrap() {
                    got.push((f.header.kind, fb.body(&f).to_vec()));
                }
            }
            assert_eq!(got.len(), 3, "cut at {cut}");
            assert_eq!(got[1].1, b[HEADER_LEN..]);
        }
    }

    #[test]
    fn a_partial_frame_shows_its_header_and_the_body_so_far() {
        let body = [5u8; 100];
        let h = Header { kind: FrameKind::Requests, desc_count: 0, payload_len: body.len() as u32 };
        let mut fb = FrameBuffer::new();
        fb.extend(&h.to_bytes()[..10]);
        assert!(fb.partial_frame(1 << 20).unwrap().is_none(), "no header yet");
        fb.extend(&h.to_bytes()[10..]);
        fb.extend(&body[..40]);
        let (got, so_far) = fb.partial_frame(1 << 20).unwrap().unwrap();
        assert_eq!((got, so_far), (h, &body[..40]));
        assert!(matches!(fb.partial_frame(50), Err(FrameError::TooLarge { .. })));
        fb.extend(&body[40..]);
        assert!(fb.partial_frame(1 << 20).unwrap().is_none(), "complete frames are next_frame's");
        fb.consume(HEADER_LEN + 60);
        assert_eq!(fb.unconsumed(), &body[60..]);
    }

    #[test]
    fn oversized_frames_are_refused_from_the_header() {
        let mut fb = FrameBuffer::new();
        let big = Header { kind: FrameKind::Requests, desc_count: 0, payload_len: 10 << 20 };
        fb.extend(&big.to_bytes());
        assert!(matches!(fb.next_frame(1 << 20), Err(FrameError::TooLarge { .. })));
    }

    #[test]
    fn large_frames_grow_the_buffer_and_garbage_is_refused() {
        let body = vec![7u8; 3 * INITIAL_BYTES];
        let h = Header { kind: FrameKind::Requests, desc_count: 0, payload_len: body.len() as u32 };
        let mut fb = FrameBuffer::new();
        fb.extend(&h.to_bytes());
        fb.extend(&body[..1000]);
        assert!(fb.next_frame(8 << 20).unwrap().is_none());
        fb.extend(&body[1000..]);
        let f = fb.next_frame(8 << 20).unwrap().unwrap();
        assert_eq!(fb.body(&f).len(), body.len());

        let mut fb = FrameBuffer::new();
        fb.extend(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(matches!(fb.next_frame(1 << 20), Err(FrameError::Wire(WireError::BadMagic(_)))));
    }
}
