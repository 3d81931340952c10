//! A provided-buffer ring for multishot receive: the kernel picks a buffer per completion, the
//! server hands it back once it has copied the (small) request bytes out.

use std::io;
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::types::BufRingEntry;
use io_uring::Submitter;

pub struct BufRing {
    /// `entries` ring slots, page-aligned as the kernel requires.
    ring: *mut BufRingEntry,
    ring_bytes: usize,
    entries: u16,
    /// The buffers themselves, `buf_len` bytes each, indexed by buffer id.
    buffers: Box<[u8]>,
    buf_len: usize,
    /// Our copy of the tail; the kernel reads the shared one.
    tail: u16,
}

impl BufRing {
    /// Map and register a ring of `entries` (a power of two) buffers of `buf_len` bytes as group
    /// `bgid`, every buffer already handed to the kernel.
    pub fn new(submitter: &Submitter<'_>, bgid: u16, entries: u16, buf_len: usize) -> io::Result<BufRing> {
        assert!(entries.is_power_of_two());
        let ring_bytes = entries as usize * std::mem::size_of::<BufRingEntry>();
        // SAFETY: a fresh anonymous mapping; checked before use.
        let ring = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                ring_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if ring == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let mut this = BufRing {
            ring: ring.cast(),
            ring_bytes,
            entries,
            buffers: vec![0u8; entries as usize * buf_len].into_boxed_slice(),
            buf_len,
            tail: 0,
        };
        // SAFETY: the ring memory is ours, page-aligned, `entries` slots long, and lives until
        // `drop`, after the ring that reads it is gone (the kernel pins it while registered).
        unsafe { submitter.register_buf_ring_with_flags(ring as u64, entries, bgid, 0)? };
        for bid in 0..entries {
            this.push(bid);
        }
        this.publish();
        Ok(this)
    }

    /// The first `len` bytes the kernel wrote into buffer `bid`.
    pub fn buffer(&self, bid: u16, len: usize) -> &[u8] {
        let at = bid as usize * self.buf_len;
        &self.buffers[at..at + len.min(self.buf_len)]
    }

    /// Hand buffer `bid` back to the kernel.
    pub fn recycle(&mut self, bid: u16) {
        self.push(bid);
        self.publish();
    }

    fn push(&mut self, bid: u16) {
        assert!(bid < self.entries);
        let slot = (self.tail & (self.entries - 1)) as usize;
        let addr = self.buffers[bid as usize * self.buf_len..].as_mut_ptr() as u64;
        // SAFETY: `slot < entries`, inside the mapping. The kernel reads a slot only between the
        // published tail and its head, and this slot lies beyond the published tail.
        let entry = unsafe { &mut *self.ring.add(slot) };
        entry.set_addr(addr);
        entry.set_len(self.buf_len as u32);
        entry.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
    }

    fn publish(&self) {
        // SAFETY: the tail lives inside the first ring entry (the kernel's layout), is 2-byte
        // aligned, and is only ever written by us; the release store orders the entry writes
        // before it, as the kernel's acquire load of the tail expects.
        let tail = unsafe { AtomicU16::from_ptr(BufRingEntry::tail(self.ring) as *mut u16) };
        tail.store(self.tail, Ordering::Release);
    }
}

impl Drop for BufRing {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`; the kernel holds its own pin on the pages
        // for as long as the group stays registered, so unmapping first cannot fault it.
        unsafe {
            libc::munmap(self.ring.cast(), self.ring_bytes);
        }
    }
}
