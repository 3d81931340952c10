//! Thin wrappers over the plain socket syscalls the baseline server and the client use.
//!
//! Each wrapper is one syscall, so the callers can count them; none retries on its own except
//! for `EINTR`, which is not a cost of the mechanism but of this process receiving a signal.

use std::io;
use std::os::fd::RawFd;

fn cvt(ret: isize) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

fn retry<T>(mut call: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match call() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// `recv(2)` into `buf`; `Ok(0)` is the peer's end of stream.
pub fn recv(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the kernel writes at most `buf.len()` bytes into memory we hold exclusively.
    retry(|| cvt(unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) }))
}

/// `send(2)` of `buf`, without blocking.
pub fn send_nonblocking(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    // SAFETY: the kernel reads at most `buf.len()` bytes of memory we hold.
    retry(|| cvt(unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), flags) }))
}

/// `writev(2)` of `iovs` (at most `IOV_MAX` of them).
///
/// # Safety
///
/// Every iovec must describe memory that stays readable for the duration of the call.
pub unsafe fn writev(fd: RawFd, iovs: &[libc::iovec]) -> io::Result<usize> {
    debug_assert!(iovs.len() <= IOV_MAX);
    // SAFETY: the caller vouches for the memory the iovecs describe; the array itself is ours.
    retry(|| cvt(unsafe { libc::writev(fd, iovs.as_ptr(), iovs.len() as libc::c_int) }))
}

/// The most iovecs one `writev`/`sendmsg` accepts on Linux.
pub const IOV_MAX: usize = 1024;

/// Sleep until `fd` is ready for `events` (`POLLIN`/`POLLOUT`); returns the ready set.
pub fn ppoll_one(fd: RawFd, events: i16) -> io::Result<i16> {
    let mut pfd = libc::pollfd { fd, events, revents: 0 };
    // SAFETY: one valid pollfd, no timeout and no signal mask.
    retry(|| cvt(unsafe { libc::ppoll(&mut pfd, 1, std::ptr::null(), std::ptr::null()) } as isize))?;
    Ok(pfd.revents)
}

/// A level-triggered epoll instance watching one socket, as mio would for one connection.
pub struct Epoll {
    fd: RawFd,
}

impl Epoll {
    pub fn new() -> io::Result<Epoll> {
        // SAFETY: plain syscall without pointers.
        let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) } as isize)?;
        Ok(Epoll { fd: fd as RawFd })
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, events: u32) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: fd as u64 };
        // SAFETY: `ev` is a valid event for the duration of the call.
        cvt(unsafe { libc::epoll_ctl(self.fd, op, fd, &mut ev) } as isize).map(drop)
    }

    pub fn add(&self, fd: RawFd, events: u32) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, events)
    }

    pub fn modify(&self, fd: RawFd, events: u32) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, events)
    }

    /// Block until at least one event; returns how many of `events` were filled.
    pub fn wait(&self, events: &mut [libc::epoll_event]) -> io::Result<usize> {
        let max = events.len() as libc::c_int;
        // SAFETY: the kernel writes at most `max` events into our array.
        retry(|| cvt(unsafe { libc::epoll_wait(self.fd, events.as_mut_ptr(), max, -1) } as isize))
    }
}

impl Drop for Epoll {
    fn drop(&mut self) {
        // SAFETY: we own this descriptor and close it once.
        unsafe {
            libc::close(self.fd);
        }
    }
}
