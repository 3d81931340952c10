//! The client: plain syscalls in every mode, as skiff's initiator does (send the request
//! caravan, then `ppoll` and `recv`). It keeps `outstanding` caravans in flight and checks every
//! response: sequence, tags, lengths and every data byte against the pattern.

use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::error::ProbeError;
use crate::rx::RxBuffer;
use crate::server::{data_area_len, RX_BYTES};
use crate::shape::{self, Completion, Header, ReadRequest, COMPLETION_DESC_LEN, HEADER_LEN};
use crate::shape::{ShapeError, REQUEST_DESC_LEN};
use crate::sys;
use crate::tx::Limits;
use rt::usage::{self, Usage};

/// Compact the receive buffer before a `recv` when less than this is free.
const RECV_SPARE_MIN: usize = 64 << 10;

/// The traffic shape.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// Requests per caravan.
    pub caravan: usize,
    /// Caravans in flight.
    pub outstanding: usize,
    /// Bytes per read.
    pub bs: usize,
}

impl Workload {
    pub fn limits(&self) -> Limits {
        Limits { caravan_max: self.caravan, outstanding_max: self.outstanding, bs_max: self.bs }
    }
}

/// When the client stops issuing caravans (it then waits for those in flight).
#[derive(Debug, Clone, Copy)]
pub enum Stop {
    Caravans(u64),
    After(Duration),
}

#[derive(Debug, Default, Clone, Copy)]
pub struct ClientStats {
    pub caravans: u64,
    pub payloads: u64,
    /// From the first send to the last response checked.
    pub elapsed: Duration,
    pub usage: Usage,
}

/// Where request `tag` reads from: blocks scattered over the whole data area.
fn offset_of(tag: u32, blocks: u64, bs: usize) -> u64 {
    (tag as u64).wrapping_mul(2_654_435_761) % blocks * bs as u64
}

struct Checker {
    w: Workload,
    blocks: u64,
    next_seq: u64,
    next_tag: u32,
}

impl Checker {
    /// Check and consume every complete response at the front of `rx`; returns how many.
    fn handle_responses(&mut self, rx: &mut RxBuffer) -> Result<u64, ProbeError> {
        let mut done = 0;
        let count = self.w.caravan;
        let frame_len = shape::response_caravan_len(count, self.w.bs);
        while let Some(header_bytes) = rx.filled().first_chunk::<HEADER_LEN>() {
            let header = Header::parse(header_bytes, count)?;
            let body_len = frame_len - HEADER_LEN;
            if !header.responses || header.count as usize != count {
                return Err(ProbeError::Corrupt(format!("unexpected header {header:?}")));
            }
            if header.body_len as usize != body_len {
                let got = header.body_len as usize;
                return Err(ShapeError::BadBodyLen { body_len: got, expected: body_len }.into());
            }
            if header.seq != self.next_seq {
                let want = self.next_seq;
                return Err(ProbeError::Corrupt(format!("caravan {} where {want} was due", header.seq)));
            }
            let Some(frame) = rx.filled().get(..frame_len) else {
                break;
            };
            self.check_caravan(&frame[HEADER_LEN..])?;
            rx.consume(frame_len);
            self.next_seq += 1;
            done += 1;
        }
        Ok(done)
    }

    fn check_caravan(&mut self, body: &[u8]) -> Result<(), ProbeError> {
        let (descs, data) = body.split_at(self.w.caravan * COMPLETION_DESC_LEN);
        for (desc, block) in descs.chunks_exact(COMPLETION_DESC_LEN).zip(data.chunks(self.w.bs)) {
            let c = Completion::parse(desc);
            let tag = self.next_tag;
            if c.tag != tag || c.status != 0 || c.data_len as usize != self.w.bs {
                return Err(ProbeError::Corrupt(format!("completion {c:?} where tag {tag} was due")));
            }
            let offset = offset_of(tag, self.blocks, self.w.bs);
            if let Some(at) = shape::check_pattern(block, offset) {
                return Err(ProbeError::Corrupt(format!(
                    "tag {tag}: data differs at byte {at} of the block read at offset {offset}"
                )));
            }
            self.next_tag = self.next_tag.wrapping_add(1);
        }
        Ok(())
    }
}

/// Append one request caravan (`seq`, tags from `first_tag`) to `txq`.
fn emit_caravan(txq: &mut RxBuffer, w: &Workload, blocks: u64, seq: u64, first_tag: u32) {
    let len = shape::request_caravan_len(w.caravan);
    let out = &mut txq.spare()[..len];
    let body_len = (w.caravan * REQUEST_DESC_LEN) as u32;
    Header { responses: false, count: w.caravan as u16, seq, body_len }.emit(&mut out[..HEADER_LEN]);
    for (i, desc) in out[HEADER_LEN..].chunks_exact_mut(REQUEST_DESC_LEN).enumerate() {
        let tag = first_tag.wrapping_add(i as u32);
        let offset = offset_of(tag, blocks, w.bs);
        ReadRequest { tag, offset, length: w.bs as u32 }.emit(desc);
    }
    txq.commit(len);
}

/// Drive one connection until `stop`, then close the sending side.
pub fn run(sock: TcpStream, w: &Workload, stop: Stop) -> Result<ClientStats, ProbeError> {
    sock.set_nonblocking(true).map_err(ProbeError::io("set_nonblocking"))?;
    let fd = sock.as_raw_fd();
    let blocks = (data_area_len(w.bs) / w.bs) as u64;
    let mut txq = RxBuffer::new(w.outstanding * shape::request_caravan_len(w.caravan));
    let mut rx = RxBuffer::new(RX_BYTES.max(2 * shape::response_caravan_len(w.caravan, w.bs)));
    let mut checker = Checker { w: *w, blocks, next_seq: 0, next_tag: 0 };
    let (mut sent, mut received) = (0u64, 0u64);

    let before = usage::this_thread();
    let start = Instant::now();
    loop {
        let issuing = match stop {
            Stop::Caravans(n) => sent < n,
            Stop::After(d) => start.elapsed() < d,
        };
        let limit = match stop {
            Stop::Caravans(n) => n,
            Stop::After(_) => u64::MAX,
        };
        while issuing && sent < limit && sent - received < w.outstanding as u64 {
            let first_tag = (sent * w.caravan as u64) as u32;
            emit_caravan(&mut txq, w, blocks, sent, first_tag);
            sent += 1;
        }
        if !txq.filled().is_empty() {
            match sys::send_nonblocking(fd, txq.filled()) {
                Ok(n) => txq.consume(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(ProbeError::Io { op: "send", source: e }),
            }
        }
        if !issuing && received == sent {
            break;
        }
        let want_out = if txq.filled().is_empty() { 0 } else { libc::POLLOUT };
        let ready = sys::ppoll_one(fd, libc::POLLIN | want_out).map_err(ProbeError::io("ppoll"))?;
        if ready & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            if rx.spare().len() < RECV_SPARE_MIN {
                rx.compact();
            }
            match sys::recv(fd, rx.spare()) {
                Ok(0) => return Err(ProbeError::Corrupt("the server closed the connection".into())),
                Ok(n) => rx.commit(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(ProbeError::Io { op: "recv", source: e }),
            }
            received += checker.handle_responses(&mut rx)?;
        }
    }
    let elapsed = start.elapsed();
    let usage = usage::this_thread().since(&before);
    sock.shutdown(Shutdown::Write).map_err(ProbeError::io("shutdown"))?;
    Ok(ClientStats { caravans: received, payloads: received * w.caravan as u64, elapsed, usage })
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Workload = Workload { caravan: 2, outstanding: 1, bs: 64 };
    const BLOCKS: u64 = 1000;

    /// A response caravan as a correct server would send it.
    fn response(seq: u64, first_tag: u32) -> Vec<u8> {
        let mut out = vec![0u8; shape::response_caravan_len(W.caravan, W.bs)];
        let body_len = (out.len() - HEADER_LEN) as u32;
        Header { responses: true, count: W.caravan as u16, seq, body_len }.emit(&mut out);
        let data_at = HEADER_LEN + W.caravan * COMPLETION_DESC_LEN;
        for i in 0..W.caravan {
            let tag = first_tag + i as u32;
            let desc = &mut out[HEADER_LEN + i * COMPLETION_DESC_LEN..];
            Completion { tag, status: 0, data_len: W.bs as u32 }.emit(desc);
            let mut block = vec![0u8; W.bs];
            let offset = offset_of(tag, BLOCKS, W.bs);
            for (j, word) in block.chunks_exact_mut(8).enumerate() {
                word.copy_from_slice(&shape::pattern_word(offset + j as u64 * 8).to_le_bytes());
            }
            out[data_at + i * W.bs..][..W.bs].copy_from_slice(&block);
        }
        out
    }

    fn check(bytes: &[u8]) -> Result<u64, ProbeError> {
        let mut checker = Checker { w: W, blocks: BLOCKS, next_seq: 0, next_tag: 0 };
        let mut rx = RxBuffer::new(4096);
        assert!(rx.append(bytes));
        checker.handle_responses(&mut rx)
    }

    #[test]
    fn intact_stream_passes() {
        let mut bytes = response(0, 0);
        bytes.extend(response(1, 2));
        assert_eq!(check(&bytes).unwrap(), 2);
    }

    #[test]
    fn reordered_caravans_fail() {
        let mut bytes = response(1, 2);
        bytes.extend(response(0, 0));
        assert!(matches!(check(&bytes), Err(ProbeError::Corrupt(_))));
    }

    #[test]
    fn flipped_data_byte_fails() {
        let mut bytes = response(0, 0);
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        assert!(matches!(check(&bytes), Err(ProbeError::Corrupt(_))));
    }

    #[test]
    fn lost_bytes_fail() {
        let mut bytes = response(0, 0);
        bytes.remove(HEADER_LEN + 3);
        bytes.extend(response(1, 2));
        assert!(check(&bytes).is_err());
    }
}
