//! Network faults for any [`FrameIo`], like smoltcp's `FaultInjector` in the same slot as a
//! real device: seeded short reads and writes, bursts of `WouldBlock`, delays, disconnects, and
//! bit flips in frame headers.
//!
//! Bit flips land only in the 24-byte frame headers, which skiff v1 protects with a CRC: the
//! receiver must catch every one and close the connection. The rest of a frame has no checksum
//! of its own in v1 (TCP's covers it on a real wire), so a flip there would be undetectable by
//! design, not a bug the simulation could find. The raw-Ethernet transport's datagrams carry a
//! CRC over their payload, so [`crate::datagram`]'s link flips any bit.

use std::io::{self, IoSlice, IoSliceMut};

use transport::FrameIo;
use wire::HEADER_LEN;

use crate::pipe::PipeEnd;
use crate::rng::Rng;

/// How often each fault strikes, per million calls (or per million sends touching a header,
/// for flips).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetFaults {
    /// A call moves only a random part of what it could.
    pub short_io: u32,
    /// A call starts a burst of `WouldBlock`, up to `burst_max` calls long.
    pub would_block: u32,
    pub burst_max: u32,
    /// A send's bytes take up to `delay_max_us` longer to arrive.
    pub delay: u32,
    pub delay_max_us: u64,
    /// A send resets the connection instead.
    pub disconnect: u32,
    /// One bit of a header the send carries is flipped.
    pub flip: u32,
}

impl NetFaults {
    pub const NONE: NetFaults = NetFaults {
        short_io: 0,
        would_block: 0,
        burst_max: 0,
        delay: 0,
        delay_max_us: 0,
        disconnect: 0,
        flip: 0,
    };

    /// Faults often enough that a few hundred requests meet every kind.
    pub fn typical() -> NetFaults {
        NetFaults {
            short_io: 200_000,
            would_block: 50_000,
            burst_max: 8,
            delay: 50_000,
            delay_max_us: 500,
            disconnect: 1_500,
            flip: 1_500,
        }
    }
}

/// A transport that can be torn down from one end.
pub trait Disconnect {
    fn disconnect(&mut self);
}

impl Disconnect for PipeEnd {
    fn disconnect(&mut self) {
        self.reset();
    }
}

/// Delays need a transport that can hold bytes back.
pub trait Delay {
    fn delay_next(&mut self, us: u64);
}

impl Delay for PipeEnd {
    fn delay_next(&mut self, us: u64) {
        PipeEnd::delay_next(self, us);
    }
}

/// Where the outgoing stream is in its frames, from the bytes that pass: so that a flip can be
/// aimed at a header.
#[derive(Debug, Default)]
struct HeaderTracker {
    /// Bytes of the current frame seen, and its length once its header is in.
    pos: usize,
    frame_len: usize,
    head: [u8; HEADER_LEN],
}

impl HeaderTracker {
    /// How many of the next bytes are header bytes.
    fn header_bytes_ahead(&self) -> usize {
        HEADER_LEN.saturating_sub(self.pos)
    }

    fn advance(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.pos < HEADER_LEN {
                let n = (HEADER_LEN - self.pos).min(bytes.len());
                self.head[self.pos..self.pos + n].copy_from_slice(&bytes[..n]);
                self.pos += n;
                bytes = &bytes[n..];
                if self.pos == HEADER_LEN {
                    // Our own peer's frames always parse; anything else counts as a bare header.
                    self.frame_len = wire::Header::parse(&self.head).map_or(HEADER_LEN, |h| h.frame_len());
                }
            } else {
                let n = (self.frame_len - self.pos).min(bytes.len());
                self.pos += n;
                bytes = &bytes[n..];
            }
            if self.pos >= HEADER_LEN && self.pos == self.frame_len {
                self.pos = 0;
            }
        }
    }
}

/// A [`FrameIo`] with seeded faults on both directions.
#[derive(Debug)]
pub struct FaultyIo<T> {
    inner: T,
    rng: Rng,
    faults: NetFaults,
    blocked: u32,
    sent: HeaderTracker,
    /// The destructive fault injected on this connection, if any (a disconnect or a flipped
    /// header bit): a connection that fails without one has met a bug.
    pub injected: Option<&'static str>,
    /// Faults of each kind injected so far: short, would_block, delay, disconnect, flip.
    pub counts: [u64; 5],
}

impl<T: FrameIo + Disconnect + Delay> FaultyIo<T> {
    pub fn new(inner: T, rng: Rng, faults: NetFaults) -> FaultyIo<T> {
        FaultyIo {
            inner,
            rng,
            faults,
            blocked: 0,
            sent: HeaderTracker::default(),
            injected: None,
            counts: [0; 5],
        }
    }

    pub fn inner(&self) -> &T {
        &self.inner
    }

    /// Whether this call is refused with `WouldBlock` (a burst in progress, or a new one).
    fn blocked(&mut self) -> bool {
        if self.blocked == 0 && self.rng.chance(self.faults.would_block) {
            self.blocked = self.rng.range(1, u64::from(self.faults.burst_max.max(1))) as u32;
            self.counts[1] += 1;
        }
        if self.blocked > 0 {
            self.blocked -= 1;
            return true;
        }
        false
    }

    /// How much of `total` bytes this call may move.
    fn allowance(&mut self, total: usize) -> usize {
        if total > 1 && self.rng.chance(self.faults.short_io) {
            self.counts[0] += 1;
            return self.rng.range(1, total as u64 - 1) as usize;
        }
        total
    }
}

impl<T: FrameIo + Disconnect + Delay> FrameIo for FaultyIo<T> {
    fn recv(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        if self.blocked() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut room = self.allowance(total);
        if room == total {
            return self.inner.recv(bufs);
        }
        let mut short: Vec<IoSliceMut<'_>> = Vec::with_capacity(bufs.len());
        for b in bufs.iter_mut() {
            if room == 0 {
                break;
            }
            let n = b.len().min(room);
            room -= n;
            short.push(IoSliceMut::new(&mut b[..n]));
        }
        self.inner.recv(&mut short)
    }

    fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        if self.blocked() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        if self.rng.chance(self.faults.disconnect) {
            self.counts[3] += 1;
            self.injected.get_or_insert("disconnect");
            self.inner.disconnect();
            return Err(io::ErrorKind::ConnectionReset.into());
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let allowed = self.allowance(total);
        let mut bytes = Vec::with_capacity(allowed);
        for b in bufs {
            let n = b.len().min(allowed - bytes.len());
            bytes.extend_from_slice(&b[..n]);
        }
        let header_ahead = self.sent.header_bytes_ahead().min(bytes.len());
        let mut wire_bytes = bytes.clone();
        if header_ahead > 0 && self.rng.chance(self.faults.flip) {
            let at = self.rng.below(header_ahead as u64) as usize;
            wire_bytes[at] ^= 1 << self.rng.below(8);
            self.counts[4] += 1;
            self.injected.get_or_insert("flipped header bit");
        }
        if self.rng.chance(self.faults.delay) {
            self.counts[2] += 1;
            let us = self.rng.range(1, self.faults.delay_max_us.max(1));
            self.inner.delay_next(us);
        }
        let n = self.inner.send(&[IoSlice::new(&wire_bytes)])?;
        self.sent.advance(&bytes[..n]);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Clock;
    use crate::pipe::pipe;
    use wire::{FrameKind, Header};

    #[test]
    fn flips_land_in_headers_and_the_crc_catches_every_one() {
        let clock = Clock::new();
        let (a, mut b) = pipe(&clock, 0, 1 << 20);
        let faults = NetFaults { flip: 1_000_000, ..NetFaults::NONE };
        let mut a = FaultyIo::new(a, Rng::new(3), faults);
        let frame = |n: u8| {
            let mut f = Header { kind: FrameKind::Stats, desc_count: 0, payload_len: 3 }.to_bytes().to_vec();
            f.extend_from_slice(&[n; 3]);
            f
        };
        let mut changed = 0;
        for n in 0..50 {
            let f = frame(n);
            // Send in two pieces, the first ending inside the header.
            let cut = 1 + (n as usize % 26);
            a.send(&[IoSlice::new(&f[..cut])]).unwrap();
            a.send(&[IoSlice::new(&f[cut..])]).unwrap();
            let mut got = [0u8; 27];
            let mut read = 0;
            while read < 27 {
                read += b.recv(&mut [IoSliceMut::new(&mut got[read..])]).unwrap();
            }
            assert_eq!(got[HEADER_LEN..], f[HEADER_LEN..], "bodies are never touched");
            // Both pieces may flip a bit; two flips of the same bit cancel out.
            if got[..HEADER_LEN] != f[..HEADER_LEN] {
                changed += 1;
                assert!(Header::parse(&got).is_err(), "every header flip is caught");
            }
        }
        assert!(changed >= 45, "{changed} of 50 headers flipped");
        assert_eq!(a.injected, Some("flipped header bit"));
    }
}
