//! The bytes a connection owes its peer ([`TxBuf`]): replies queued by the front end, with
//! RAM read data and flash pool pages by address and a `send=sendfile` file export's by file
//! range, sent in one vectored send per pass (and a `sendfile(2)` per file range).

use std::io::{self, IoSlice};
use std::ops::Range;
use std::os::fd::RawFd;

use engine::front::Sink;
use engine::{Export, Io, RegionBytes};
use transport::FrameIo;
use wire::Status;

use crate::bounds::{IOV_BATCH, TX_IDLE_BYTES};

/// Response bytes waiting to be sent: bytes of our own (headers, descriptors, data read from
/// files) in one growing buffer, and read data of RAM exports and of flash volumes whose pages
/// are in the pool (lent, [`engine::lend`]) *by address*, sent straight from that memory
/// without first copying it here; a lent range gives its pool slots back when dropped. A
/// by-address piece sits between two owned bytes: `at` is the length of the owned stream in
/// front of it.
///
/// A file export that sends with `sendfile(2)` (`send=sendfile`) queues its read data as a
/// file range the same way, when [`send_files`](Self::send_files) says the connection may.
///
/// Addresses and file ranges never outlive the loop pass that made them: [`TxBuf::flush`]
/// copies whatever the socket did not take into the owned buffer before it returns (reading
/// a file range then), so no reply waits on memory or a file for longer than one pass. The
/// owned buffer only grows (bounded by the backlog limit plus one caravan), so appending never
/// zero-fills memory per request.
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
    /// Whether file ranges may be queued: set by the connection for a transport that takes
    /// `sendfile(2)` (plain TCP or Unix) and no send thread; cleared if the transport refuses
    /// one after all (a TLS upgrade).
    pub send_files: bool,
    /// A file range that could not be read when it had to be copied: the connection fails at
    /// the next flush (its reply said the read succeeded).
    failed: Option<io::Error>,
    /// Scratch for the pieces a backend lends ([`engine::lend`]), kept for its allocation.
    lent: Vec<RegionBytes>,
}

#[derive(Debug, Clone)]
struct Borrowed {
    at: usize,
    piece: Piece,
}

/// Data queued by reference rather than copied.
#[derive(Debug, Clone)]
enum Piece {
    /// A RAM export's bytes, or flash pool pages lent until dropped.
    Memory(RegionBytes),
    /// `len` bytes of file `fd` from `offset`.
    File { fd: RawFd, offset: u64, len: usize },
}

impl Piece {
    fn len(&self) -> usize {
        match self {
            Piece::Memory(bytes) => bytes.len(),
            Piece::File { len, .. } => *len,
        }
    }
}

/// One unsent stretch, in order: bytes, or a file range.
enum Unsent<'a> {
    Bytes(&'a [u8]),
    File { fd: RawFd, offset: u64, len: usize },
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
    /// memory (a RAM volume, or a flash volume's pool pages, lent), by file range when
    /// the export sends with `sendfile(2)` and the connection can, otherwise read into new
    /// space here. On failure nothing is appended.
    pub fn append_read(&mut self, export: &Export, io: &Io) -> Status {
        if !self.backlogged {
            if let Some(status) = self.append_by_reference(export, io) {
                return status;
            }
        }
        let range = self.reserve(io.length as usize);
        let status = engine::execute(export, io, &[], &mut self.buf[range.clone()]);
        if !status.is_ok() {
            self.truncate(range.start);
        }
        status
    }

    /// [`append_read`](Self::append_read) without a copy of our own, when the export can:
    /// `None` when it cannot now, and nothing was appended.
    fn append_by_reference(&mut self, export: &Export, io: &Io) -> Option<Status> {
        if self.send_files && io.length > 0 {
            if let Some((fd, offset)) = engine::file_range(export, io) {
                self.borrow(Piece::File { fd, offset, len: io.length as usize });
                return Some(Status::Ok);
            }
        }
        if let Some(found) = engine::read_in_place(export, io) {
            return Some(found.map_or_else(
                |status| status,
                |bytes| {
                    if !bytes.is_empty() {
                        self.borrow(Piece::Memory(bytes));
                    }
                    Status::Ok
                },
            ));
        }
        let mut lent = std::mem::take(&mut self.lent);
        let found = engine::lend(export, io, &mut lent);
        for bytes in lent.drain(..) {
            self.borrow(Piece::Memory(bytes));
        }
        self.lent = lent;
        match found {
            Ok(true) => Some(Status::Ok),
            Ok(false) => None,
            Err(status) => Some(status),
        }
    }

    fn borrow(&mut self, piece: Piece) {
        self.borrowed_bytes += piece.len();
        self.borrowed.push(Borrowed { at: self.len, piece });
    }

    /// Send what the socket takes. Returns bytes sent; `WouldBlock` when nothing could go.
    /// Whatever stays queued is owned by the buffer afterwards (see the type's docs).
    pub fn flush(&mut self, io: &mut impl FrameIo) -> io::Result<usize> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
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
                let mut file = None;
                // Bytes up to the next file range go in one send; a file range first goes
                // alone, by sendfile(2).
                self.each_unsent(|piece| match piece {
                    Unsent::Bytes(bytes) => {
                        iov[n] = IoSlice::new(bytes);
                        n += 1;
                        n < IOV_BATCH
                    }
                    Unsent::File { fd, offset, len } => {
                        if n == 0 {
                            file = Some((fd, offset, len));
                        }
                        false
                    }
                });
                match file {
                    Some((fd, offset, len)) => match io.send_file(fd, offset, len) {
                        Err(e) if e.kind() == io::ErrorKind::Unsupported => {
                            // Not on this transport after all: read what is queued into our
                            // own bytes and queue no more file ranges.
                            self.send_files = false;
                            self.own_the_rest();
                            if let Some(e) = self.failed.take() {
                                return Err(e);
                            }
                            continue;
                        }
                        sent => sent,
                    },
                    None => io.send(&iov[..n]),
                }
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
    fn each_unsent<'a>(&'a self, mut f: impl FnMut(Unsent<'a>) -> bool) {
        let mut pos = self.sent;
        for (i, b) in self.borrowed[self.next..].iter().enumerate() {
            if pos < b.at {
                if !f(Unsent::Bytes(&self.buf[pos..b.at])) {
                    return;
                }
                pos = b.at;
            }
            let skip = if i == 0 { self.into } else { 0 };
            let piece = match &b.piece {
                Piece::Memory(bytes) => Unsent::Bytes(&bytes.as_slice()[skip..]),
                &Piece::File { fd, offset, len } => {
                    Unsent::File { fd, offset: offset + skip as u64, len: len - skip }
                }
            };
            if !f(piece) {
                return;
            }
        }
        if pos < self.len {
            f(Unsent::Bytes(&self.buf[pos..self.len]));
        }
    }

    /// Append every unsent byte to `out`, reading file ranges. A range that cannot be read
    /// (the file shrank, an I/O error) is left as zeroes and fails the connection's next
    /// flush: its reply already said the read succeeded.
    fn copy_unsent(&mut self, out: &mut Vec<u8>) {
        let mut failed = None;
        self.each_unsent(|piece| {
            match piece {
                Unsent::Bytes(bytes) => out.extend_from_slice(bytes),
                Unsent::File { fd, offset, len } => {
                    let at = out.len();
                    out.resize(at + len, 0);
                    if let Err(e) = rt::fs::pread_exact(fd, &mut out[at..], offset) {
                        failed.get_or_insert(e);
                    }
                }
            }
            true
        });
        if let Some(e) = failed {
            tracing::warn!(error = %e, "a read sent by file could not be read when copied: the connection closes");
            self.failed = Some(e);
        }
    }

    /// Account for `n` more bytes sent.
    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            match self.borrowed.get(self.next) {
                Some(b) if b.at == self.sent => {
                    let len = b.piece.len();
                    let take = n.min(len - self.into);
                    self.into += take;
                    self.borrowed_sent += take;
                    n -= take;
                    if self.into == len {
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
        self.copy_unsent(&mut rest);
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
        } else if !self.borrowed.is_empty() {
            // Every piece went out, owned bytes did not: let go of the pieces now (a lent
            // range holds pool slots), not when the rest drains.
            self.forget_borrowed();
        }
        self.backlogged = true;
    }

    /// Move every unsent byte, by-address pieces included, into a new buffer (a hand-off to
    /// the send thread of a staged target, `crate::stages`); nothing stays queued here.
    pub fn take_unsent(&mut self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.pending());
        self.copy_unsent(&mut out);
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
        self.forget_borrowed();
        self.backlogged = false;
    }

    /// Drop every by-address piece (each sent or copied by now), letting go of what it holds.
    fn forget_borrowed(&mut self) {
        self.borrowed.clear();
        (self.next, self.into, self.borrowed_bytes, self.borrowed_sent) = (0, 0, 0, 0);
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
    /// volume do not change replies already queued, and pieces already sent are let go (8,778
    /// bytes: every piece goes in the first send, two bytes of the owned tail do not; a lent
    /// piece holds pool slots).
    #[test]
    fn partial_sends_keep_order_and_never_outlive_the_pass() {
        for chunk in [1, 7, 100, 4096, 5000, 8778, 1 << 20] {
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

    /// A socket that also takes file ranges, as `sendfile(2)` would: at most `chunk` bytes a
    /// call, read from the file when it is called.
    struct Files(Trickle);

    impl FrameIo for Files {
        fn recv(&mut self, _: &mut [std::io::IoSliceMut<'_>]) -> io::Result<usize> {
            unreachable!("only sends here")
        }
        fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            self.0.send(bufs)
        }
        fn send_file(&mut self, fd: RawFd, offset: u64, len: usize) -> io::Result<usize> {
            let n = len.min(self.0.chunk);
            let mut buf = vec![0; n];
            rt::fs::pread_exact(fd, &mut buf, offset)?;
            self.0.got.extend_from_slice(&buf);
            Ok(n)
        }
    }

    /// A file export with `send=sendfile`, its file filled with a pattern.
    fn file_export(bytes: usize) -> (tempfile::NamedTempFile, Export) {
        let file = tempfile::NamedTempFile::new().unwrap();
        let pattern: Vec<u8> = (0..bytes).map(|i| (i * 13 + i / 509) as u8).collect();
        std::fs::write(file.path(), &pattern).unwrap();
        let spec = BackendSpec::File { path: file.path().to_owned() };
        let export = Export::open_with("f", &spec, false, false).unwrap();
        let export = export.with_layer(std::sync::Arc::new(engine::layer::SendFile)).unwrap();
        (file, export)
    }

    /// File ranges keep their place among owned bytes and RAM reads through any pattern of
    /// partial sends; one the socket did not take in a flush is read into the buffer then,
    /// so a later write to the file does not change a reply queued before it.
    #[test]
    fn file_ranges_go_by_sendfile_in_order_and_are_copied_when_they_must_wait() {
        for chunk in [1, 100, 4096, 5000, 1 << 20] {
            let (_file, export) = file_export(64 << 10);
            let ram = ram_export(16 << 10);
            let mut tx = TxBuf { send_files: true, ..TxBuf::default() };
            let mut want = Vec::new();
            for (i, (e, io)) in
                [(&export, read(0, 4096)), (&ram, read(512, 1024)), (&export, read(10_000, 3000))]
                    .into_iter()
                    .enumerate()
            {
                let head = [i as u8; 24];
                tx.append(&head);
                want.extend_from_slice(&head);
                assert_eq!(tx.append_read(e, &io), Status::Ok);
                want.extend(contents(e, &io));
            }
            assert_eq!(tx.borrowed.len(), 3, "two file ranges and a RAM read, none copied");
            tx.append(b"tail");
            want.extend_from_slice(b"tail");
            let mut sock = Files(Trickle { got: Vec::new(), chunk, calls: 0 });
            let _ = tx.flush(&mut sock);
            if tx.pending() > 0 {
                assert!(tx.borrowed.is_empty(), "chunk {chunk}: file ranges kept past the flush");
                export.backend.write_at(&vec![0xEE; 64 << 10], 0, false).unwrap();
            }
            while tx.pending() > 0 {
                let _ = tx.flush(&mut sock);
            }
            assert_eq!(sock.0.got, want, "chunk {chunk}");
        }
    }

    /// A transport that refuses sendfile (TLS) gets the bytes read and sent as usual, and the
    /// buffer queues no file range after that; without `send_files` none is queued at all.
    #[test]
    fn a_transport_without_sendfile_gets_the_bytes_copied() {
        let (_file, export) = file_export(16 << 10);
        let mut tx = TxBuf { send_files: true, ..TxBuf::default() };
        tx.append(b"h");
        assert_eq!(tx.append_read(&export, &read(4096, 4096)), Status::Ok);
        let mut sock = Trickle { got: Vec::new(), chunk: usize::MAX, calls: 0 };
        while tx.pending() > 0 {
            let _ = tx.flush(&mut sock);
        }
        let mut want = b"h".to_vec();
        want.extend(contents(&export, &read(4096, 4096)));
        assert!(sock.got == want, "the bytes, in order");
        assert!(!tx.send_files, "no more file ranges on this transport");
        assert_eq!(tx.append_read(&export, &read(0, 512)), Status::Ok);
        assert!(tx.borrowed.is_empty(), "copied from now on");
        let mut plain = TxBuf::default();
        assert_eq!(plain.append_read(&export, &read(0, 512)), Status::Ok);
        assert!(plain.borrowed.is_empty());
    }

    /// A file range that cannot be read when it must be copied (the file shrank under it)
    /// fails the connection's next flush instead of sending zeroes for data said to be read.
    #[test]
    fn a_file_range_that_cannot_be_read_fails_the_connection() {
        let (file, export) = file_export(16 << 10);
        let mut tx = TxBuf { send_files: true, ..TxBuf::default() };
        assert_eq!(tx.append_read(&export, &read(8192, 4096)), Status::Ok);
        std::fs::OpenOptions::new().write(true).open(file.path()).unwrap().set_len(4096).unwrap();
        tx.hold();
        let mut sock = Trickle { got: Vec::new(), chunk: usize::MAX, calls: 0 };
        let e = tx.flush(&mut sock).expect_err("the range is gone");
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
