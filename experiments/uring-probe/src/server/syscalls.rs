//! The baseline: a non-blocking socket, level-triggered epoll, one `recv` into a 256 KiB buffer
//! and one `writev` of every response ready, per pass. This is skiff's target loop today.

use std::net::TcpStream;
use std::os::fd::AsRawFd;

use super::{data_area_len, ServerStats, RX_BYTES};
use crate::error::ProbeError;
use crate::region::Region;
use crate::respond::Responder;
use crate::rx::RxBuffer;
use crate::sys::{self, Epoll};
use crate::tx::{Limits, TxPair};
use rt::usage;

pub fn serve(sock: TcpStream, limits: Limits, ready: &dyn Fn()) -> Result<ServerStats, ProbeError> {
    sock.set_nonblocking(true).map_err(ProbeError::io("set_nonblocking"))?;
    let fd = sock.as_raw_fd();
    let data_len = data_area_len(limits.bs_max);
    let mut region = Region::new(data_len, limits.slots_len()).map_err(ProbeError::io("mmap"))?;
    let (data, slots) = region.split();
    let mut tx = TxPair::new(slots, &limits);
    let mut rx = RxBuffer::new(RX_BYTES);
    let mut responder = Responder::new(limits, data_len);
    let epoll = Epoll::new().map_err(ProbeError::io("epoll_create1"))?;
    let readable = libc::EPOLLIN as u32;
    let writable = libc::EPOLLOUT as u32;
    epoll.add(fd, readable).map_err(ProbeError::io("epoll_ctl"))?;
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; 4];
    let mut syscalls = 0u64;
    let mut watching_writable = false;
    let mut eof = false;

    ready();
    let before = usage::this_thread();
    while !(eof && tx.is_idle()) {
        let n = epoll.wait(&mut events).map_err(ProbeError::io("epoll_wait"))?;
        syscalls += 1;
        let ready = events[..n].iter().fold(0, |acc, ev| acc | ev.events);
        if ready & (readable | libc::EPOLLHUP as u32 | libc::EPOLLERR as u32) != 0 && !eof {
            rx.compact();
            syscalls += 1;
            match sys::recv(fd, rx.spare()) {
                Ok(0) => eof = true,
                Ok(n) => rx.commit(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(ProbeError::Io { op: "recv", source: e }),
            }
        }
        responder.handle_requests(&mut rx, data, tx.staged())?;
        let blocked = flush(fd, &mut tx, &mut syscalls)?;
        if blocked != watching_writable {
            let interest = if blocked { readable | writable } else { readable };
            epoll.modify(fd, interest).map_err(ProbeError::io("epoll_ctl"))?;
            syscalls += 1;
            watching_writable = blocked;
        }
    }
    let usage = usage::this_thread().since(&before);
    Ok(ServerStats { caravans: responder.caravans, payloads: responder.payloads, syscalls, usage })
}

/// `writev` what is ready: one call in the usual case, more only after the socket was full or
/// when more than `IOV_MAX` iovecs wait. Returns true when the socket is full.
fn flush(fd: i32, tx: &mut TxPair<'_>, syscalls: &mut u64) -> Result<bool, ProbeError> {
    while let Some(flight) = tx.poll_flight() {
        let pending = flight.pending();
        let asked: usize = pending.iter().map(|iov| iov.iov_len).sum();
        *syscalls += 1;
        // SAFETY: the iovecs point into the header slots and data area of the region, which
        // outlives this call; writev only reads them.
        match unsafe { sys::writev(fd, pending) } {
            Ok(n) => {
                tx.handle_sent(n);
                if n < asked {
                    return Ok(true);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(true),
            Err(e) => return Err(ProbeError::Io { op: "writev", source: e }),
        }
    }
    Ok(false)
}
