//! Reads that do not block the thread that starts them: a small, safe face on the kernel's
//! io_uring (the `io-uring` crate) for the flash array's pool misses.
//!
//! Any thread may start reads ([`Reads::push`], then [`Reads::submit`] once for a batch);
//! one thread, the completer, waits for them and takes each finished read back with what its
//! starter attached ([`Reads::complete`]). The ring owns every buffer while its read is in
//! flight, so no buffer can be freed or reused under the kernel; a file handed in is held
//! open by the kernel from submission to completion, so closing it early is harmless too.
//!
//! A read lands in a buffer of its own ([`Dest::Buf`]) or straight in ranges of a shared
//! [`Region`] ([`Dest::Region`], a page pool's slots: no copy after it lands); either way the
//! ring holds the memory until the read is handed back.
//!
//! The ring holds at most `depth` reads at once; [`push`](Reads::push) refuses more
//! (`WouldBlock`), and the caller reads some other way. [`close`](Reads::close) makes the
//! completer's next [`complete`](Reads::complete) return `Ok(false)` once the reads started
//! before it have been handed back.

use std::io;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

use io_uring::{opcode, squeue, types, IoUring};

use crate::mem::{AlignedBuf, Region};

/// Where a read's bytes land.
pub enum Dest {
    /// A buffer of the read's own, handed back with it.
    Buf(AlignedBuf),
    /// Ranges of a region, filled in order.
    Region(RegionDest),
}

impl std::fmt::Debug for Dest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dest::Buf(b) => write!(f, "Buf({} bytes)", b.len()),
            Dest::Region(r) => write!(f, "Region({} ranges, {} bytes)", r.iov.len(), r.len()),
        }
    }
}

impl Dest {
    /// Bytes the read fills.
    pub fn len(&self) -> usize {
        match self {
            Dest::Buf(b) => b.len(),
            Dest::Region(r) => r.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Ranges of a [`Region`] one read fills, in order, keeping the region mapped until the read
/// is handed back. While the read is in flight the kernel writes those bytes: nobody else may
/// touch them (a page pool's slots being fetched).
pub struct RegionDest {
    region: Arc<Region>,
    /// The ranges, as the addresses the kernel writes to.
    iov: Vec<libc::iovec>,
}

// SAFETY: the iovecs point into `region`, which this value keeps alive; they are only handed
// to the kernel (and read by `scatter`), never dereferenced as Rust references, so moving the
// value to another thread is as sound as moving the `Arc<Region>`.
unsafe impl Send for RegionDest {}
// SAFETY: shared access reads only the addresses and lengths, which never change.
unsafe impl Sync for RegionDest {}

impl RegionDest {
    /// The ranges `(offset, len)` of `region`, filled in this order.
    ///
    /// # Panics
    /// If a range is not inside the region.
    pub fn new(region: &Arc<Region>, ranges: impl IntoIterator<Item = (usize, usize)>) -> RegionDest {
        let iov = ranges
            .into_iter()
            .map(|(at, n)| libc::iovec { iov_base: region.ptr_at(at, n).cast(), iov_len: n })
            .collect();
        RegionDest { region: Arc::clone(region), iov }
    }

    /// Bytes the ranges hold together.
    pub fn len(&self) -> usize {
        self.iov.iter().map(|v| v.iov_len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copy `src` (of [`len`](Self::len) bytes) into the ranges, as a read landing there
    /// would: for a caller that read the bytes some other way.
    pub fn scatter(&self, mut src: &[u8]) {
        let base = self.region.ptr_at(0, 0) as usize;
        for v in &self.iov {
            // An offset into the region: the range was checked to lie inside it in `new`.
            let (at, n) = (v.iov_base as usize - base, v.iov_len.min(src.len()));
            self.region.write_at(at, &src[..n]);
            src = &src[n..];
        }
    }
}

/// `user_data` of the no-op that [`Reads::close`] sends.
const CLOSE: u64 = u64::MAX;

/// Reads in flight, each with its buffer and what its starter attached.
pub struct Reads<T> {
    ring: IoUring,
    /// The submission side: one pusher at a time. Also the table of reads in flight.
    inflight: Mutex<Table<T>>,
    /// The completion side: one completer at a time.
    reaping: Mutex<()>,
    depth: usize,
}

struct Table<T> {
    slots: Vec<Option<(Dest, T)>>,
    free: Vec<usize>,
    /// [`Reads::close`] was called: no read may start after its no-op, whose completion ends
    /// the completer's loop (a read started after it would never be handed back).
    closed: bool,
}

impl<T: Send> Reads<T> {
    /// A ring for up to `depth` reads in flight. Fails where io_uring is not available (an old
    /// kernel, a seccomp profile that forbids it): the caller reads synchronously then.
    pub fn new(depth: u32) -> io::Result<Reads<T>> {
        let depth = depth.max(1);
        // One more entry than reads, for the closing no-op.
        let ring = IoUring::builder().build(depth + 1)?;
        Ok(Reads {
            ring,
            inflight: Mutex::new(Table { slots: Vec::new(), free: Vec::new(), closed: false }),
            reaping: Mutex::new(()),
            depth: depth as usize,
        })
    }

    /// Queue a read of `buf.len()` bytes at byte `offset` of `fd` into `buf`; it starts at the
    /// next [`submit`](Self::submit). Refused with `WouldBlock` when `depth` reads are in
    /// flight already (the buffer and `user` come back with the error).
    #[allow(clippy::result_large_err)]
    pub fn push(&self, fd: RawFd, offset: u64, mut buf: Dest, user: T) -> Result<(), (io::Error, Dest, T)> {
        let Ok(len) = u32::try_from(buf.len()) else {
            return Err((io::Error::new(io::ErrorKind::InvalidInput, "read past 4 GiB"), buf, user));
        };
        if matches!(&buf, Dest::Region(r) if u32::try_from(r.iov.len()).is_err()) {
            return Err((io::Error::new(io::ErrorKind::InvalidInput, "too many ranges"), buf, user));
        }
        let mut table = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        let in_flight = table.slots.len() - table.free.len();
        if in_flight >= self.depth || table.closed {
            return Err((io::ErrorKind::WouldBlock.into(), buf, user));
        }
        let index = table.free.pop().unwrap_or_else(|| {
            table.slots.push(None);
            table.slots.len() - 1
        });
        // The buffer's memory is its own heap allocation, and a region's ranges and their
        // iovecs live in allocations of their own: moving the `Dest` into the table below moves
        // none of the bytes the kernel reads or writes.
        let entry = match &mut buf {
            Dest::Buf(b) => opcode::Read::new(types::Fd(fd), b.as_mut_ptr(), len).offset(offset).build(),
            Dest::Region(r) => match r.iov.as_slice() {
                [one] => opcode::Read::new(types::Fd(fd), one.iov_base.cast(), len).offset(offset).build(),
                many => {
                    opcode::Readv::new(types::Fd(fd), many.as_ptr(), many.len() as u32).offset(offset).build()
                }
            },
        }
        .user_data(index as u64);
        // SAFETY: `inflight` is locked, so this thread is the only one touching the submission
        // queue. The entry points into `buf` (its own buffer, or a region's ranges and their
        // iovecs, kept mapped by the `Arc<Region>` it holds), which the table owns from here until the read's
        // completion hands it back (`complete`), so the memory outlives the kernel's use.
        let pushed = unsafe { self.ring.submission_shared().push(&entry) };
        if pushed.is_err() {
            // The queue holds `depth + 1` entries and at most `depth` reads are in flight,
            // so it is full only of entries not yet submitted: submit them and try once more.
            drop(table);
            let submitted = self.submit();
            table = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
            if table.closed {
                // Closed meanwhile: a read queued after the close would never be handed back.
                table.free.push(index);
                return Err((io::ErrorKind::WouldBlock.into(), buf, user));
            }
            // SAFETY: as above.
            if let Err(e) = submitted.and_then(|_| {
                // SAFETY: as above.
                unsafe { self.ring.submission_shared().push(&entry) }
                    .map_err(|_| io::Error::other("io_uring submission queue full"))
            }) {
                table.free.push(index);
                return Err((e, buf, user));
            }
        }
        table.slots[index] = Some((buf, user));
        Ok(())
    }

    /// Start every read queued so far (one system call for the batch).
    pub fn submit(&self) -> io::Result<usize> {
        loop {
            match self.ring.submitter().submit() {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => return other,
            }
        }
    }

    /// Most reads in flight at once.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Reads in flight (queued or started, not yet handed back).
    pub fn in_flight(&self) -> usize {
        let table = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        table.slots.len() - table.free.len()
    }

    /// Wait until at least one read has ended, then hand back every one that has: `done`
    /// gets what its starter attached, the bytes read (a short read is an `UnexpectedEof`
    /// error) and the buffer. Returns `Ok(false)` once [`close`](Self::close) was called and
    /// its no-op came back.
    pub fn complete(&self, mut done: impl FnMut(T, io::Result<()>, Dest)) -> io::Result<bool> {
        let _reaping = self.reaping.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match self.ring.submitter().submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        let mut open = true;
        // SAFETY: `reaping` is held, so this thread is the only one reading the completion
        // queue. Each entry is copied out before `done` runs; the queue's head moves on when
        // the view is dropped.
        let cq = unsafe { self.ring.completion_shared() };
        for cqe in cq {
            let (tag, result) = (cqe.user_data(), cqe.result());
            if tag == CLOSE {
                open = false;
                continue;
            }
            let taken = {
                let mut table = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
                let taken = table.slots.get_mut(tag as usize).and_then(Option::take);
                if taken.is_some() {
                    table.free.push(tag as usize);
                }
                taken
            };
            let Some((buf, user)) = taken else {
                tracing::error!(tag, "io_uring completion for no read in flight");
                continue;
            };
            let outcome = match result {
                n if n < 0 => Err(io::Error::from_raw_os_error(-n)),
                n if n as usize == buf.len() => Ok(()),
                n => Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("short read: {n} of {} bytes", buf.len()),
                )),
            };
            done(user, outcome, buf);
        }
        Ok(open)
    }

    /// Make the completer's [`complete`](Self::complete) return `Ok(false)` after the reads
    /// started before this call.
    pub fn close(&self) -> io::Result<()> {
        let mut table = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        table.closed = true;
        // Drained: it completes only after every read queued before it, so the completer hands
        // all of them back before it stops.
        let entry = opcode::Nop::new().build().flags(squeue::Flags::IO_DRAIN).user_data(CLOSE);
        // SAFETY: `inflight` is locked, so this thread is the only one touching the submission
        // queue; a no-op points at no memory.
        if unsafe { self.ring.submission_shared().push(&entry) }.is_err() {
            self.ring.submitter().submit()?;
            // SAFETY: as above.
            unsafe { self.ring.submission_shared().push(&entry) }
                .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        self.ring.submitter().submit()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;

    use super::*;

    #[test]
    fn reads_come_back_with_their_bytes_and_tags() {
        let mut file = tempfile::tempfile().unwrap();
        let bytes: Vec<u8> = (0..16 * 4096).map(|i| (i / 4096 * 7 + i % 251) as u8).collect();
        file.write_all(&bytes).unwrap();
        let reads = match Reads::<usize>::new(8) {
            Ok(r) => r,
            Err(e) => panic!("io_uring is not available here: {e}"),
        };
        for page in [3usize, 0, 15, 9] {
            reads
                .push(file.as_raw_fd(), (page * 4096) as u64, Dest::Buf(AlignedBuf::new(4096).unwrap()), page)
                .unwrap();
        }
        reads.submit().unwrap();
        let mut seen = Vec::new();
        while seen.len() < 4 {
            assert!(reads
                .complete(|page, result, buf| {
                    result.unwrap();
                    let Dest::Buf(buf) = buf else { panic!("a buffer was read into") };
                    assert_eq!(&buf[..], &bytes[page * 4096..(page + 1) * 4096], "page {page}");
                    seen.push(page);
                })
                .unwrap());
        }
        seen.sort_unstable();
        assert_eq!(seen, [0, 3, 9, 15]);
        assert_eq!(reads.in_flight(), 0);
        // Past the end: a short read is an error, and the buffer comes back.
        reads.push(file.as_raw_fd(), 16 * 4096, Dest::Buf(AlignedBuf::new(4096).unwrap()), 99).unwrap();
        reads.submit().unwrap();
        let mut failed = false;
        while !failed {
            reads
                .complete(|page, result, _| {
                    assert_eq!(page, 99);
                    assert_eq!(result.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
                    failed = true;
                })
                .unwrap();
        }
        reads.close().unwrap();
        assert!(!reads.complete(|_, _, _| panic!("nothing in flight")).unwrap());
    }

    /// A read into ranges of a region fills them in order (one range: a plain read; several:
    /// a vectored one), and the region stays mapped while the read is in flight.
    #[test]
    fn reads_land_in_a_regions_ranges_in_order() {
        let mut file = tempfile::tempfile().unwrap();
        let bytes: Vec<u8> = (0..8 * 4096).map(|i| (i / 4096 * 13 + i % 241) as u8).collect();
        file.write_all(&bytes).unwrap();
        let reads = Reads::<u8>::new(4).unwrap();
        let region = Arc::new(Region::new(16 * 4096).unwrap());
        // Pages 2..5 of the file into slots 9, 3 and 12 of the region; page 6 into slot 0.
        let three = RegionDest::new(&region, [(9 * 4096, 4096), (3 * 4096, 4096), (12 * 4096, 4096)]);
        reads.push(file.as_raw_fd(), 2 * 4096, Dest::Region(three), 3).unwrap();
        reads
            .push(file.as_raw_fd(), 6 * 4096, Dest::Region(RegionDest::new(&region, [(0, 4096)])), 1)
            .unwrap();
        reads.submit().unwrap();
        let mut landed = 0;
        while landed < 2 {
            reads
                .complete(|ranges, result, dest| {
                    result.unwrap();
                    assert_eq!(dest.len(), usize::from(ranges) * 4096);
                    landed += 1;
                })
                .unwrap();
        }
        let page = |slot: usize| {
            let mut out = vec![0u8; 4096];
            region.read_at(slot * 4096, &mut out);
            out
        };
        for (slot, file_page) in [(9, 2), (3, 3), (12, 4), (0, 6)] {
            assert_eq!(page(slot), bytes[file_page * 4096..(file_page + 1) * 4096], "slot {slot}");
        }
        assert!(page(1).iter().all(|&b| b == 0), "nothing else written");
        // Scattered by hand, as a caller that read the bytes some other way.
        RegionDest::new(&region, [(5 * 4096, 4096), (4096, 4096)]).scatter(&bytes[..2 * 4096]);
        assert_eq!((page(5), page(1)), (bytes[..4096].to_vec(), bytes[4096..2 * 4096].to_vec()));
    }

    /// Every read queued before `close` is handed back before the completer is told to
    /// stop, and none starts after it.
    #[test]
    fn close_hands_back_what_was_queued_and_refuses_more() {
        let file = tempfile::tempfile().unwrap();
        file.set_len(64 * 4096).unwrap();
        let reads = Reads::<usize>::new(64).unwrap();
        for page in 0..64usize {
            reads
                .push(file.as_raw_fd(), (page * 4096) as u64, Dest::Buf(AlignedBuf::new(4096).unwrap()), page)
                .unwrap();
        }
        reads.close().unwrap();
        let (e, _, _) =
            reads.push(file.as_raw_fd(), 0, Dest::Buf(AlignedBuf::new(4096).unwrap()), 99).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "a read after close is refused");
        let mut back = 0;
        while reads
            .complete(|_, result, _| {
                result.unwrap();
                back += 1;
            })
            .unwrap()
        {}
        assert_eq!(back, 64, "every read queued before the close came back before it");
        assert_eq!(reads.in_flight(), 0);
    }

    #[test]
    fn a_full_ring_refuses_and_gives_the_buffer_back() {
        let file = tempfile::tempfile().unwrap();
        file.set_len(4 * 4096).unwrap();
        let reads = Reads::<u8>::new(2).unwrap();
        reads.push(file.as_raw_fd(), 0, Dest::Buf(AlignedBuf::new(4096).unwrap()), 1).unwrap();
        reads.push(file.as_raw_fd(), 4096, Dest::Buf(AlignedBuf::new(4096).unwrap()), 2).unwrap();
        let (e, buf, user) =
            reads.push(file.as_raw_fd(), 8192, Dest::Buf(AlignedBuf::new(4096).unwrap()), 3).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert_eq!((buf.len(), user), (4096, 3));
        reads.submit().unwrap();
        let mut n = 0;
        while n < 2 {
            reads
                .complete(|_, r, _| {
                    r.unwrap();
                    n += 1;
                })
                .unwrap();
        }
        // Room again.
        reads.push(file.as_raw_fd(), 8192, Dest::Buf(AlignedBuf::new(4096).unwrap()), 3).unwrap();
        reads.submit().unwrap();
        reads.close().unwrap();
        let mut closed = false;
        let mut got = 0;
        while !closed {
            closed = !reads
                .complete(|u, r, _| {
                    r.unwrap();
                    got = u;
                })
                .unwrap();
        }
        assert_eq!(got, 3);
    }
}
