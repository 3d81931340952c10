//! Reads that do not block the thread that starts them: a small, safe face on the kernel's
//! io_uring (the `io-uring` crate) for the flash array's pool misses.
//!
//! Any thread may start reads ([`Reads::push`], then [`Reads::submit`] once for a batch);
//! one thread, the completer, waits for them and takes each finished read back with what its
//! starter attached ([`Reads::complete`]). The ring owns every buffer while its read is in
//! flight, so no buffer can be freed or reused under the kernel; a file handed in is held
//! open by the kernel from submission to completion, so closing it early is harmless too.
//!
//! The ring holds at most `depth` reads at once; [`push`](Reads::push) refuses more
//! (`WouldBlock`), and the caller reads some other way. [`close`](Reads::close) makes the
//! completer's next [`complete`](Reads::complete) return `Ok(false)` once the reads started
//! before it have been handed back.

use std::io;
use std::os::fd::RawFd;
use std::sync::Mutex;

use io_uring::{opcode, squeue, types, IoUring};

use crate::mem::AlignedBuf;

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
    slots: Vec<Option<(AlignedBuf, T)>>,
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
    pub fn push(
        &self,
        fd: RawFd,
        offset: u64,
        mut buf: AlignedBuf,
        user: T,
    ) -> Result<(), (io::Error, AlignedBuf, T)> {
        let Ok(len) = u32::try_from(buf.len()) else {
            return Err((io::Error::new(io::ErrorKind::InvalidInput, "read past 4 GiB"), buf, user));
        };
        let mut table = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        let in_flight = table.slots.len() - table.free.len();
        if in_flight >= self.depth || table.closed {
            return Err((io::ErrorKind::WouldBlock.into(), buf, user));
        }
        let index = table.free.pop().unwrap_or_else(|| {
            table.slots.push(None);
            table.slots.len() - 1
        });
        // The buffer's memory is its own heap allocation: moving the `AlignedBuf` into the
        // table below does not move the bytes the kernel writes to.
        let entry = opcode::Read::new(types::Fd(fd), buf.as_mut_ptr(), len)
            .offset(offset)
            .build()
            .user_data(index as u64);
        // SAFETY: `inflight` is locked, so this thread is the only one touching the submission
        // queue. The entry points into `buf`, which the table owns from here until the read's
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
    pub fn complete(&self, mut done: impl FnMut(T, io::Result<()>, AlignedBuf)) -> io::Result<bool> {
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
            reads.push(file.as_raw_fd(), (page * 4096) as u64, AlignedBuf::new(4096).unwrap(), page).unwrap();
        }
        reads.submit().unwrap();
        let mut seen = Vec::new();
        while seen.len() < 4 {
            assert!(reads
                .complete(|page, result, buf| {
                    result.unwrap();
                    assert_eq!(&buf[..], &bytes[page * 4096..(page + 1) * 4096], "page {page}");
                    seen.push(page);
                })
                .unwrap());
        }
        seen.sort_unstable();
        assert_eq!(seen, [0, 3, 9, 15]);
        assert_eq!(reads.in_flight(), 0);
        // Past the end: a short read is an error, and the buffer comes back.
        reads.push(file.as_raw_fd(), 16 * 4096, AlignedBuf::new(4096).unwrap(), 99).unwrap();
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

    /// Every read queued before `close` is handed back before the completer is told to
    /// stop, and none starts after it.
    #[test]
    fn close_hands_back_what_was_queued_and_refuses_more() {
        let file = tempfile::tempfile().unwrap();
        file.set_len(64 * 4096).unwrap();
        let reads = Reads::<usize>::new(64).unwrap();
        for page in 0..64usize {
            reads.push(file.as_raw_fd(), (page * 4096) as u64, AlignedBuf::new(4096).unwrap(), page).unwrap();
        }
        reads.close().unwrap();
        let (e, _, _) = reads.push(file.as_raw_fd(), 0, AlignedBuf::new(4096).unwrap(), 99).unwrap_err();
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
        reads.push(file.as_raw_fd(), 0, AlignedBuf::new(4096).unwrap(), 1).unwrap();
        reads.push(file.as_raw_fd(), 4096, AlignedBuf::new(4096).unwrap(), 2).unwrap();
        let (e, buf, user) =
            reads.push(file.as_raw_fd(), 8192, AlignedBuf::new(4096).unwrap(), 3).unwrap_err();
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
        reads.push(file.as_raw_fd(), 8192, AlignedBuf::new(4096).unwrap(), 3).unwrap();
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
