//! The connection core shared by control clients and lanes: a non-blocking stream, its frame
//! buffer, the handshake, and blocking control calls.

use std::io::{self, IoSlice};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use proto::client::ClientHandshake;
use transport::{wait_fd, ClientStream, Endpoint, FrameBuffer, FrameIo, FrameRef};
use wire::{FrameKind, Header, Limits};

use crate::{Error, Result};

/// Most slices handed to one vectored send.
const IOV_BATCH: usize = 64;

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
        self.rx.next_frame(self.frame_bytes_max()).map_err(|e| match e {
            transport::FrameError::Wire(w) => Error::Protocol(w.into()),
            other => Error::Io(io::Error::new(io::ErrorKind::InvalidData, other.to_string())),
        })
    }

    /// Receive what is there without waiting. Returns bytes received.
    pub fn fill_now(&mut self) -> Result<usize> {
        let started = Instant::now();
        let filled = self.stream.fill(&mut self.rx);
        self.recv_ns += started.elapsed().as_nanos() as u64;
        match filled {
            Ok(0) => Err(Error::Closed),
            Ok(n) => Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(e) => Err(e.into()),
        }
    }

    /// Receive at least one byte, waiting until `deadline`.
    pub fn fill_blocking(&mut self, deadline: Instant) -> Result<()> {
        if !self.spin.is_zero() {
            // Hybrid polling: a reply due within the spin budget is taken without the sleep
            // and wake-up a blocking wait costs, at the price of a busy core meanwhile.
            let spin_until = Instant::now() + self.spin;
            while Instant::now() < spin_until {
                if self.fill_now()? > 0 {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
        }
        loop {
            if self.fill_now()? > 0 {
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
                        self.fill_now()?;
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
