//! The server's memory: the data area reads are served from, and the header slots responses are
//! built in, as one anonymous mapping.
//!
//! One mapping, because `IORING_OP_WRITEV_FIXED` and vectored `SEND_ZC` resolve every iovec of an
//! SQE against a single registered buffer: header slot and data slices must lie in the same one.
//! Every mode uses the same layout, so only the I/O mechanism differs between them. The mapping is
//! touched at start-up (pattern fill, zeroed slots), so no mode pays page faults on the data path.

use std::io;

use crate::shape;

pub struct Region {
    base: *mut u8,
    len: usize,
    data_len: usize,
}

impl Region {
    /// Map `data_len` bytes of data (filled with the pattern) followed by `slots_len` bytes of
    /// header slots.
    pub fn new(data_len: usize, slots_len: usize) -> io::Result<Region> {
        let len = data_len + slots_len;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no
        // existing memory; the result is checked before use.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let region = Region { base: base.cast(), len, data_len };
        // SAFETY: `base` is a fresh mapping of at least `data_len` bytes that nothing else
        // references yet; the slice dies before `region` is returned.
        let data = unsafe { std::slice::from_raw_parts_mut(region.base, data_len) };
        shape::fill_pattern(data);
        Ok(region)
    }

    /// The whole mapping as one iovec, for `register_buffers`.
    pub fn as_iovec(&self) -> libc::iovec {
        libc::iovec { iov_base: self.base.cast(), iov_len: self.len }
    }

    /// The data area (read-only from here on) and the header slots.
    pub fn split(&mut self) -> (&[u8], &mut [u8]) {
        // SAFETY: the mapping lives as long as `self` and the two halves do not overlap; the
        // `&mut self` borrow keeps anyone else from handing out another pair meanwhile.
        unsafe {
            let data = std::slice::from_raw_parts(self.base, self.data_len);
            let slots =
                std::slice::from_raw_parts_mut(self.base.add(self.data_len), self.len - self.data_len);
            (data, slots)
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are exactly the mapping made in `new`, and no borrow of it can
        // outlive `self`.
        unsafe {
            libc::munmap(self.base.cast(), self.len);
        }
    }
}
