//! The connection core shared by control clients and lanes: a non-blocking stream, its frame
//! buffer, the handshake, and blocking control calls.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use proto::client::ClientHandshake;
use transport::{wait_fd, ClientStream, Endpoint, FrameBuffer, FrameIo, FrameRef};
use wire::{FrameKind, Header, Limits};

use crate::{Error, Result};

/// Most slices handed to one vectored send.
const IOV_BATCH: usize = 64;
/// Most direct-placement slices handed to one vectored receive.
pub(crate) const DIRECT_IOV_MAX: usize = 64;

/// A stream that cannot be framed any more, as the lane reports it.
pub(crate) fn frame_error(e: transport::FrameError) -> Error {
    match e {
        transport::FrameError::Wire(w) => Error::Protocol(w.into()),
        other => Error::Io(io::Error::new(io::ErrorKind::InvalidData, other.to_string())),
    }
}

/// A receive's result: bytes received, zero for "nothing there now", end of stream an error.
fn received(got: io::Result<usize>) -> Result<usize> {
    match got {
        Ok(0) => Err(Error::Closed),
        Ok(n) => Ok(n),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
        Err(e) => Err(e.into()),
    }
}

pub(crate) struct Conn {
    pub stream: ClientStream,
    pub rx: FrameBuffer,
    pub limits: Limits,
    pub timeout: Duration,
    /// Hybrid polling: how long to keep trying non-blocking receives before sleeping.
    pub spin: Duration,
    /// Wall time in receive and send calls so far (not in waiting for readiness).
    pub recv_ns: u64,
    pub send_ns: u64,
}

impl Conn {
    pub fn connect(endpoint: &Endpoint, proposed: &Limits, timeout: Duration) -> Result<Conn> {
        let stream = ClientStream::connect(endpoint)?;
        let mut conn = Conn {
            stream,
            rx: FrameBuffer::new(),
            limits: *proposed,
            timeout,
            spin: Duration::ZERO,
            recv_ns: 0,
            send_ns: 0,
        };
        let handshake = ClientHandshake::new(*proposed);
        conn.send_all(&[&handshake.hello_frame()])?;
        let (h, body) = conn.recv_control()?;
        conn.limits = handshake.handle_reply(&h, &body)?;
        Ok(conn)
    }

    /// Largest frame the target may send us.
    pub fn frame_bytes_max(&self) -> usize {
        self.limits.frame_bytes_max()
    }

    /// Send one control frame and wait for its reply.
    pub fn call(&mut self, kind: FrameKind, body: &[u8]) -> Result<(Header, Vec<u8>)> {
        self.send_all(&[&wire::control::frame(kind, body)])?;
        self.recv_control()
    }

    /// Wait for the next frame, which must be a control frame, and copy it out.
    pub fn recv_control(&mut self) -> Result<(Header, Vec<u8>)> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(f) = self.next_frame()? {
                return Ok((f.header, self.rx.body(&f).to_vec()));
            }
            self.fill_blocking(deadline)?;
        }
    }

    pub fn next_frame(&mut self) -> Result<Option<FrameRef>> {
        self.rx.next_frame(self.frame_bytes_max()).map_err(frame_error)
    }

    /// Receive what is there without waiting, at most `cap` bytes. Returns bytes received.
    pub fn fill_now(&mut self, cap: usize) -> Result<usize> {
        let spare = self.rx.spare();
        let cap = cap.min(spare.len());
        let started = Instant::now();
        let got = self.stream.recv_vectored(&mut [IoSliceMut::new(&mut spare[..cap])]);
        self.recv_ns += started.elapsed().as_nanos() as u64;
        let n = received(got)?;
        self.rx.commit(n);
        Ok(n)
    }

    /// One vectored receive without waiting: `direct` first (read data placed where it
    /// belongs), then at most `cap` bytes into the frame buffer, only if `rx_after` (the
    /// direct slices cover all that comes before the next frame). Returns bytes received;
    /// those beyond `direct` are already committed to the frame buffer.
    pub fn fill_direct(
        &mut self,
        direct: &mut [IoSliceMut<'_>],
        rx_after: bool,
        cap: usize,
    ) -> Result<usize> {
        let direct_len: usize = direct.iter().map(|d| d.len()).sum();
        let mut iov: [IoSliceMut<'_>; DIRECT_IOV_MAX + 1] = std::array::from_fn(|_| IoSliceMut::new(&mut []));
        let n = direct.len().min(DIRECT_IOV_MAX);
        debug_assert_eq!(n, direct.len(), "more direct slices than one receive takes");
        for (slot, d) in iov.iter_mut().zip(direct.iter_mut()) {
            *slot = IoSliceMut::new(&mut d[..]);
        }
        let mut used = n;
        if rx_after {
            let spare = self.rx.spare();
            let cap = cap.min(spare.len());
            iov[n] = IoSliceMut::new(&mut spare[..cap]);
            used += 1;
        }
        let started = Instant::now();
        let got = self.stream.recv_vectored(&mut iov[..used]);
        self.recv_ns += started.elapsed().as_nanos() as u64;
        let got = received(got)?;
        if got > direct_len {
            self.rx.commit(got - direct_len);
        }
        Ok(got)
    }

    /// Receive at least one byte, waiting until `deadline`.
    pub fn fill_blocking(&mut self, deadline: Instant) -> Result<()> {
        self.receive_blocking(deadline, &mut |conn| conn.fill_now(usize::MAX))
    }

    /// Receive at least one byte with `receive`, waiting until `deadline` (spinning first
    /// under hybrid polling).
    pub fn receive_blocking(
        &mut self,
        deadline: Instant,
        receive: &mut dyn FnMut(&mut Conn) -> Result<usize>,
    ) -> Result<()> {
        if !self.spin.is_zero() {
            // Hybrid polling: a reply due within the spin budget is taken without the sleep
            // and wake-up a blocking wait costs, at the price of a busy core meanwhile.
            let spin_until = Instant::now() + self.spin;
            while Instant::now() < spin_until {
                if receive(self)? > 0 {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
        }
        loop {
            if receive(self)? > 0 {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::TimedOut(self.timeout));
            }
            wait_fd(self.stream.as_raw_fd(), false, Some(left))?;
        }
    }

    /// Send every byte of `parts`, in order. While the socket is full, whatever the peer sends
    /// is received into the frame buffer (to be processed afterwards), so the peer is never
    /// blocked on us while we are blocked on it. That backlog is bounded by the replies to the
    /// requests in flight.
    pub fn send_all(&mut self, parts: &[&[u8]]) -> Result<()> {
        self.send_all_receiving(parts, &mut |conn| conn.fill_now(usize::MAX))
    }

    /// [`send_all`](Self::send_all), receiving with `receive` while the socket is full (a lane
    /// placing read data receives its own way).
    pub fn send_all_receiving(
        &mut self,
        parts: &[&[u8]],
        receive: &mut dyn FnMut(&mut Conn) -> Result<usize>,
    ) -> Result<()> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut sent = 0;
        let deadline = Instant::now() + self.timeout;
        while sent < total {
            match self.send_from(parts, sent) {
                Ok(0) => return Err(Error::Closed),
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let ready = wait_fd(
                        self.stream.as_raw_fd(),
                        true,
                        Some(deadline.saturating_duration_since(Instant::now())),
                    )?;
                    if ready.readable {
                        receive(self)?;
                    }
                    if !ready.readable && !ready.writable && Instant::now() >= deadline {
                        return Err(Error::TimedOut(self.timeout));
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// One vectored send of `parts` starting `skip` bytes in.
    fn send_from(&mut self, parts: &[&[u8]], mut skip: usize) -> io::Result<usize> {
        let mut iov = [IoSlice::new(&[]); IOV_BATCH];
        let mut n = 0;
        for p in parts {
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            iov[n] = IoSlice::new(&p[skip..]);
            skip = 0;
            n += 1;
            if n == IOV_BATCH {
                break;
            }
        }
        let started = Instant::now();
        let sent = self.stream.send(&iov[..n]);
        self.send_ns += started.elapsed().as_nanos() as u64;
        sent
    }
}
