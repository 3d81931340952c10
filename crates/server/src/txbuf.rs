//! The bytes a connection owes its peer ([`TxBuf`]): replies queued by the front end, with
//! RAM read data by address, sent in one vectored send per pass.

use std::io::{self, IoSlice};
use std::ops::Range;

use engine::front::Sink;
use engine::{Export, Io, RegionBytes};
use transport::FrameIo;
use wire::Status;

use crate::bounds::{IOV_BATCH, TX_IDLE_BYTES};

/// Response bytes waiting to be sent: bytes of our own (headers, descriptors, data read from
/// files) in one growing buffer, and read data of RAM exports *by address*, sent straight from
/// the volume's memory without first copying it here. A by-address piece sits between two
/// owned bytes: `at` is the length of the owned stream in front of it.
///
/// Addresses never outlive the loop pass that made them: [`TxBuf::flush`] copies whatever the
/// socket did not take into the owned buffer before it returns, so no reply waits on memory
/// for longer than one pass. The owned buffer only grows (bounded by the backlog limit plus one
/// caravan), so appending never zero-fills memory per request.
#[derive(Debug, Default)]
pub(crate) struct TxBuf {
    pub buf: Vec<u8>,
    pub len: usize,
    /// Owned bytes already sent.
    sent: usize,
    borrowed: Vec<Borrowed>,
    /// First piece of `borrowed` not wholly sent, and how much of it was.
    next: usize,
    into: usize,
    borrowed_bytes: usize,
    borrowed_sent: usize,
    /// Bytes from an earlier pass still wait for the socket: new read data is copied, since
    /// it would be copied when this pass ends anyway.
    backlogged: bool,
    /// The other buffer of [`own_the_rest`](Self::own_the_rest), kept for reuse.
    spare: Vec<u8>,
}

#[derive(Debug, Clone)]
struct Borrowed {
    at: usize,
    bytes: RegionBytes,
}

impl TxBuf {
    /// A buffer with room for `len` owned bytes from the start.
    pub fn with_room(len: usize) -> TxBuf {
        TxBuf { buf: vec![0; len], ..TxBuf::default() }
    }

    pub fn pending(&self) -> usize {
        self.len - self.sent + self.borrowed_bytes - self.borrowed_sent
    }

    /// Append `n` bytes of space; returns where they lie.
    pub fn reserve(&mut self, n: usize) -> Range<usize> {
        let start = self.len;
        if start + n > self.buf.len() {
            // Powers of two while small; exactly what is asked past 1 MiB (a 32 MiB read from
            // a file must not zero-fill 64 MiB).
            let want = start + n;
            self.buf.resize(if want <= 1 << 20 { want.next_power_of_two() } else { want }, 0);
        }
        self.len += n;
        start..self.len
    }

    /// Drop owned bytes from `len` on (a reservation taken back).
    pub fn truncate(&mut self, len: usize) {
        // Below what was sent, or before a by-address piece, the bytes on the wire and those
        // still queued would no longer line up.
        assert!(
            len >= self.sent && len <= self.len,
            "truncate to {len}: sent {}, queued {}",
            self.sent,
            self.len
        );
        assert!(self.borrowed.last().is_none_or(|b| b.at <= len), "truncate past a by-address piece");
        self.len = len;
    }

    /// Remove the owned bytes of `gap`, closing it up; by-address pieces after it move along.
    pub fn remove(&mut self, gap: Range<usize>) {
        assert!(
            gap.start >= self.sent && gap.end <= self.len,
            "remove {gap:?}: sent {}, queued {}",
            self.sent,
            self.len
        );
        self.buf.copy_within(gap.end..self.len, gap.start);
        self.len -= gap.len();
        for b in self.borrowed.iter_mut().rev().take_while(|b| b.at >= gap.end) {
            b.at -= gap.len();
        }
    }

    pub fn append(&mut self, bytes: &[u8]) {
        let r = self.reserve(bytes.len());
        self.buf[r].copy_from_slice(bytes);
    }

    /// Append a validated read's data: by address when the export's backend holds it in
    /// memory, otherwise read into new space here. On failure nothing is appended.
    pub fn append_read(&mut self, export: &Export, io: &Io) -> Status {
        let in_place = if self.backlogged { None } else { engine::read_in_place(export, io) };
        match in_place {
            Some(Ok(bytes)) => {
                if !bytes.is_empty() {
                    self.borrowed_bytes += bytes.len();
                    self.borrowed.push(Borrowed { at: self.len, bytes });
                }
                Status::Ok
            }
            Some(Err(status)) => status,
            None => {
                let range = self.reserve(io.length as usize);
                let status = engine::execute(export, io, &[], &mut self.buf[range.clone()]);
                if !status.is_ok() {
                    self.truncate(range.start);
                }
                status
            }
        }
    }

    /// Send what the socket takes. Returns bytes sent; `WouldBlock` when nothing could go.
    /// Whatever stays queued is owned by the buffer afterwards (see the type's docs).
    pub fn flush(&mut self, io: &mut impl FrameIo) -> io::Result<usize> {
        let result = self.send_some(io);
        if self.pending() == 0 {
            self.reset();
        } else {
            self.hold();
        }
        result
    }

    fn send_some(&mut self, io: &mut impl FrameIo) -> io::Result<usize> {
        let mut total = 0;
        while self.pending() > 0 {
            let sent = {
                let mut iov = [IoSlice::new(&[]); IOV_BATCH];
                let mut n = 0;
                self.each_unsent(|piece| {
                    iov[n] = IoSlice::new(piece);
                    n += 1;
                    n < IOV_BATCH
                });
                io.send(&iov[..n])
            };
            match sent {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.advance(n);
                    total += n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && total > 0 => break,
                Err(e) => return Err(e),
            }
        }
        Ok(total)
    }

    /// Call `f` on each unsent piece in order until it returns false.
    fn each_unsent<'a>(&'a self, mut f: impl FnMut(&'a [u8]) -> bool) {
        let mut pos = self.sent;
        for (i, b) in self.borrowed[self.next..].iter().enumerate() {
            if pos < b.at {
                if !f(&self.buf[pos..b.at]) {
                    return;
                }
                pos = b.at;
            }
            let skip = if i == 0 { self.into } else { 0 };
            let bytes = b.bytes.as_slice();
            if !f(&bytes[skip..]) {
                return;
            }
        }
        if pos < self.len {
            f(&self.buf[pos..self.len]);
        }
    }

    /// Account for `n` more bytes sent.
    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            match self.borrowed.get(self.next) {
                Some(b) if b.at == self.sent => {
                    let take = n.min(b.bytes.len() - self.into);
                    self.into += take;
                    self.borrowed_sent += take;
                    n -= take;
                    if self.into == b.bytes.len() {
                        self.next += 1;
                        self.into = 0;
                    }
                }
                next => {
                    let limit = next.map_or(self.len, |b| b.at);
                    let take = n.min(limit - self.sent);
                    debug_assert!(take > 0, "advance past the queued bytes");
                    self.sent += take;
                    n -= take;
                }
            }
        }
    }

    /// Copy every unsent byte, by-address pieces included, into the spare owned buffer, which
    /// becomes the buffer (the socket is full; the addresses may not wait for it). The two
    /// buffers trade places, so a connection that backs up often stops allocating once both
    /// have grown to its backlog.
    fn own_the_rest(&mut self) {
        let mut rest = std::mem::take(&mut self.spare);
        rest.clear();
        rest.reserve(self.pending());
        self.each_unsent(|piece| {
            rest.extend_from_slice(piece);
            true
        });
        let len = rest.len();
        rest.resize(rest.capacity(), 0);
        self.reset();
        self.spare = std::mem::replace(&mut self.buf, rest);
        self.len = len;
    }

    /// Replies queued now wait beyond this pass (the socket is full, or a hold for
    /// durability): copy the read data held by address, and copy what is appended until a
    /// flush empties the buffer.
    pub fn hold(&mut self) {
        if self.next < self.borrowed.len() {
            self.own_the_rest();
        }
        self.backlogged = true;
    }

    /// Move every unsent byte, by-address pieces included, into a new buffer (a hand-off to
    /// the send thread of a staged target, `crate::stages`); nothing stays queued here.
    pub fn take_unsent(&mut self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.pending());
        self.each_unsent(|piece| {
            out.extend_from_slice(piece);
            true
        });
        self.reset();
        out
    }

    /// Give back a reply buffer grown past [`TX_IDLE_BYTES`], when nothing is queued.
    pub fn shrink_idle(&mut self) {
        if self.pending() == 0 && (self.buf.len() > TX_IDLE_BYTES || self.spare.capacity() > TX_IDLE_BYTES) {
            self.buf = vec![0; TX_IDLE_BYTES];
            self.spare = Vec::new();
            self.reset();
        }
    }

    /// Nothing queued: start over at the front, keeping the allocations.
    fn reset(&mut self) {
        self.len = 0;
        self.sent = 0;
        self.borrowed.clear();
        self.next = 0;
        self.into = 0;
        self.borrowed_bytes = 0;
        self.borrowed_sent = 0;
        self.backlogged = false;
    }
}

impl Sink for TxBuf {
    fn len(&self) -> usize {
        self.len
    }

    fn queued_bytes(&self) -> usize {
        self.pending()
    }

    fn append(&mut self, bytes: &[u8]) {
        TxBuf::append(self, bytes);
    }

    fn reserve(&mut self, len: usize) -> Range<usize> {
        TxBuf::reserve(self, len)
    }

    fn bytes_mut(&mut self, range: Range<usize>) -> &mut [u8] {
        &mut self.buf[range]
    }

    fn remove(&mut self, gap: Range<usize>) {
        TxBuf::remove(self, gap);
    }

    fn truncate(&mut self, len: usize) {
        TxBuf::truncate(self, len);
    }

    fn append_read(&mut self, export: &Export, io: &Io) -> Status {
        TxBuf::append_read(self, export, io)
    }
}

#[cfg(test)]
mod tests {

    use engine::BackendSpec;
    use wire::{Opcode, ReqFlags};

    use super::*;

    /// A socket that takes at most `chunk` bytes per send and refuses every other call.
    struct Trickle {
        got: Vec<u8>,
        chunk: usize,
        calls: usize,
    }

    impl FrameIo for Trickle {
        fn recv(&mut self, _: &mut [std::io::IoSliceMut<'_>]) -> io::Result<usize> {
            unreachable!("only sends here")
        }
        fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            self.calls += 1;
            if self.calls.is_multiple_of(2) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let mut room = self.chunk;
            for b in bufs {
                let n = b.len().min(room);
                self.got.extend_from_slice(&b[..n]);
                room -= n;
            }
            Ok(self.chunk - room)
        }
    }

    fn ram_export(bytes: usize) -> Export {
        let export = Export::open("ram", &BackendSpec::Ram { size_bytes: bytes as u64 }, false).unwrap();
        let pattern: Vec<u8> = (0..bytes).map(|i| (i * 7 + i / 251) as u8).collect();
        export.backend.write_at(&pattern, 0, false).unwrap();
        export
    }

    fn read(offset: u64, length: u32) -> Io {
        Io { opcode: Opcode::Read, flags: ReqFlags::empty(), offset, length }
    }

    fn contents(export: &Export, io: &Io) -> Vec<u8> {
        let mut v = vec![0; io.length as usize];
        export.backend.read_at(&mut v, io.offset).unwrap();
        v
    }

    /// Owned bytes and by-address reads interleave in order through any pattern of partial
    /// sends; what the socket did not take in one flush is copied, so later writes to the
    /// volume do not change replies already queued.
    #[test]
    fn partial_sends_keep_order_and_never_outlive_the_pass() {
        for chunk in [1, 7, 100, 4096, 5000, 1 << 20] {
            let export = ram_export(64 << 10);
            let mut tx = TxBuf::default();
            let mut want = Vec::new();
            for (i, io) in [read(0, 4096), read(8192, 512), read(4096, 4096)].iter().enumerate() {
                let head = [i as u8; 24];
                tx.append(&head);
                want.extend_from_slice(&head);
                assert_eq!(tx.append_read(&export, io), Status::Ok);
                want.extend(contents(&export, io));
            }
            tx.append(b"tail");
            want.extend_from_slice(b"tail");
            assert_eq!(tx.pending(), want.len());

            let mut sock = Trickle { got: Vec::new(), chunk, calls: 0 };
            let _ = tx.flush(&mut sock);
            if tx.pending() > 0 {
                assert!(tx.borrowed.is_empty(), "chunk {chunk}: addresses kept past the flush");
                // Overwrite the volume: queued replies must keep the bytes read before.
                export.backend.write_at(&vec![0xEE; 64 << 10], 0, false).unwrap();
                // Backlogged: new reads are copied, not borrowed.
                assert_eq!(tx.append_read(&export, &read(0, 512)), Status::Ok);
                assert!(tx.borrowed.is_empty());
                want.extend_from_slice(&[0xEE; 512]);
            }
            while tx.pending() > 0 {
                let _ = tx.flush(&mut sock);
            }
            assert_eq!(sock.got, want, "chunk {chunk}");
        }
    }

    #[test]
    fn removing_a_gap_moves_later_pieces_along() {
        let export = ram_export(16 << 10);
        let mut tx = TxBuf::default();
        tx.append(b"head");
        let gap = tx.reserve(10);
        tx.buf[gap.clone()].fill(b'x');
        tx.append(b"mid");
        assert_eq!(tx.append_read(&export, &read(512, 1024)), Status::Ok);
        tx.append(b"end");
        tx.remove(gap);
        let mut want = b"headmid".to_vec();
        want.extend(contents(&export, &read(512, 1024)));
        want.extend_from_slice(b"end");
        let mut sock = Trickle { got: Vec::new(), chunk: usize::MAX, calls: 0 };
        tx.flush(&mut sock).unwrap();
        assert_eq!((sock.got, tx.pending()), (want, 0));
    }

    #[test]
    fn a_failed_read_appends_nothing() {
        let export = ram_export(4096);
        let mut tx = TxBuf::default();
        tx.append(b"h");
        assert_ne!(tx.append_read(&export, &read(4096, 512)), Status::Ok);
        assert_eq!(tx.pending(), 1);
    }
}
