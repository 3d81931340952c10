//! An in-memory, in-order byte pipe on the virtual clock: the simulation's TCP connection.
//!
//! Each direction holds chunks stamped with when they may be delivered (now + latency, never
//! before an earlier chunk: bytes stay in order), and at most `capacity_bytes` in flight, so a
//! sender that outruns its reader sees `WouldBlock`, as on a full socket. Either end may shut
//! down (FIN: the reader gets what was sent, then end of stream) or reset the connection (RST:
//! everything in flight is lost and both ends see `ConnectionReset`).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut};
use std::rc::Rc;

use transport::FrameIo;

use crate::clock::Clock;

#[derive(Debug, Default)]
struct Direction {
    /// (deliverable at, bytes, bytes already read).
    chunks: VecDeque<(u64, Vec<u8>, usize)>,
    queued_bytes: usize,
    last_at: u64,
    /// The writer shut down: after the queued bytes, end of stream.
    fin: bool,
}

#[derive(Debug)]
struct Inner {
    /// `dirs[i]` carries bytes written by end `i`.
    dirs: [Direction; 2],
    reset: bool,
    latency_us: u64,
    capacity_bytes: usize,
}

/// One end of a pipe.
#[derive(Debug)]
pub struct PipeEnd {
    inner: Rc<RefCell<Inner>>,
    side: usize,
    clock: Clock,
    /// Extra delay for the next chunk this end sends (a fault: a slow path).
    delay_next_us: u64,
}

/// A connected pair of ends, `(initiator, target)`.
pub fn pipe(clock: &Clock, latency_us: u64, capacity_bytes: usize) -> (PipeEnd, PipeEnd) {
    let inner = Rc::new(RefCell::new(Inner {
        dirs: [Direction::default(), Direction::default()],
        reset: false,
        latency_us,
        capacity_bytes,
    }));
    let end = |side| PipeEnd { inner: inner.clone(), side, clock: clock.clone(), delay_next_us: 0 };
    (end(0), end(1))
}

impl PipeEnd {
    /// Stop sending: the peer reads what is queued, then end of stream.
    pub fn shutdown(&self) {
        self.inner.borrow_mut().dirs[self.side].fin = true;
    }

    /// Tear the connection down: what is in flight is lost, both ends see a reset.
    pub fn reset(&self) {
        let mut inner = self.inner.borrow_mut();
        inner.reset = true;
        for d in &mut inner.dirs {
            d.chunks.clear();
            d.queued_bytes = 0;
        }
    }

    pub fn is_reset(&self) -> bool {
        self.inner.borrow().reset
    }

    /// Delay the next chunk sent from this end by `us` more (later chunks queue behind it).
    pub fn delay_next(&mut self, us: u64) {
        self.delay_next_us += us;
    }
}

impl Drop for PipeEnd {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl FrameIo for PipeEnd {
    fn recv(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        let now = self.clock.now_us();
        let mut inner = self.inner.borrow_mut();
        if inner.reset {
            return Err(io::ErrorKind::ConnectionReset.into());
        }
        let dir = &mut inner.dirs[1 - self.side];
        let mut got = 0;
        for buf in bufs.iter_mut() {
            let mut at = 0;
            while at < buf.len() {
                let Some((when, bytes, read)) = dir.chunks.front_mut() else { break };
                if *when > now {
                    break;
                }
                let n = (bytes.len() - *read).min(buf.len() - at);
                buf[at..at + n].copy_from_slice(&bytes[*read..*read + n]);
                *read += n;
                at += n;
                if *read == bytes.len() {
                    dir.chunks.pop_front();
                }
            }
            got += at;
            if at < buf.len() {
                break;
            }
        }
        dir.queued_bytes -= got;
        match got {
            0 if dir.fin && dir.chunks.is_empty() => Ok(0),
            0 => Err(io::ErrorKind::WouldBlock.into()),
            n => Ok(n),
        }
    }

    fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let now = self.clock.now_us();
        let mut inner = self.inner.borrow_mut();
        if inner.reset {
            return Err(io::ErrorKind::ConnectionReset.into());
        }
        if inner.dirs[self.side].fin || inner.dirs[1 - self.side].fin {
            // Our own FIN, or a peer that closed: a real socket answers EPIPE or a reset.
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let (latency, capacity) = (inner.latency_us, inner.capacity_bytes);
        let dir = &mut inner.dirs[self.side];
        let room = capacity.saturating_sub(dir.queued_bytes);
        if room == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let mut chunk = Vec::new();
        for b in bufs {
            let n = b.len().min(room - chunk.len());
            chunk.extend_from_slice(&b[..n]);
            if chunk.len() == room {
                break;
            }
        }
        let n = chunk.len();
        if n > 0 {
            let when = (now + latency + std::mem::take(&mut self.delay_next_us)).max(dir.last_at);
            dir.last_at = when;
            dir.queued_bytes += n;
            dir.chunks.push_back((when, chunk, 0));
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv_all(end: &mut PipeEnd) -> io::Result<Vec<u8>> {
        let mut buf = [0u8; 64];
        let n = end.recv(&mut [IoSliceMut::new(&mut buf)])?;
        Ok(buf[..n].to_vec())
    }

    #[test]
    fn bytes_arrive_in_order_after_the_latency_then_fin() {
        let clock = Clock::new();
        let (mut a, mut b) = pipe(&clock, 10, 1024);
        assert_eq!(a.send(&[IoSlice::new(b"hello "), IoSlice::new(b"world")]).unwrap(), 11);
        assert_eq!(recv_all(&mut b).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        clock.advance(10);
        a.delay_next(100);
        a.send(&[IoSlice::new(b"!")]).unwrap();
        assert_eq!(recv_all(&mut b).unwrap(), b"hello world");
        clock.advance(50);
        assert_eq!(recv_all(&mut b).unwrap_err().kind(), io::ErrorKind::WouldBlock, "delayed");
        a.shutdown();
        clock.advance(100);
        assert_eq!(recv_all(&mut b).unwrap(), b"!");
        assert_eq!(recv_all(&mut b).unwrap(), b"", "end of stream after the data");
        assert_eq!(b.send(&[IoSlice::new(b"x")]).unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn capacity_pushes_back_and_reset_loses_everything() {
        let clock = Clock::new();
        let (mut a, mut b) = pipe(&clock, 0, 8);
        assert_eq!(a.send(&[IoSlice::new(b"0123456789")]).unwrap(), 8);
        assert_eq!(a.send(&[IoSlice::new(b"x")]).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        assert_eq!(recv_all(&mut b).unwrap(), b"01234567");
        assert_eq!(a.send(&[IoSlice::new(b"89")]).unwrap(), 2);
        b.reset();
        assert_eq!(recv_all(&mut b).unwrap_err().kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(a.send(&[IoSlice::new(b"x")]).unwrap_err().kind(), io::ErrorKind::ConnectionReset);
    }
}
