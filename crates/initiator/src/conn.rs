//! The connection core shared by control clients and lanes: a non-blocking stream, its frame
//! buffer, the handshake, and blocking control calls.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use proto::auth::Key;
use rt::poll::{PollMode, Wait, Waiter};

/// A TLS client configuration (the CA to trust, and perhaps a client certificate).
pub type TlsConfig = std::sync::Arc<transport::tls::ClientTlsConfig>;
use proto::client::{ClientHandshake, Opened, Opening};
use transport::{wait_fd, Endpoint, FrameBuffer, FrameIo, FrameRef, Stream};
use wire::{FrameKind, Header, Limits};

use crate::{Error, Result};

/// A receive's result: bytes received, zero for "nothing there now", end of stream an error.
pub(crate) fn received(got: io::Result<usize>) -> Result<usize> {
    match got {
        Ok(0) => Err(Error::Closed),
        Ok(n) => Ok(n),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
        Err(e) => Err(e.into()),
    }
}

pub(crate) struct Conn {
    pub stream: Stream,
    pub rx: FrameBuffer,
    pub limits: Limits,
    pub timeout: Duration,
    /// Hybrid polling: how a wait for the target tries non-blocking receives before sleeping.
    pub waiter: Waiter,
    /// Wall time in receive and send calls so far (not in waiting for readiness).
    pub recv_ns: u64,
    pub send_ns: u64,
}

/// Open a transport to `endpoint` (TCP, Unix, TLS over either, or a raw-Ethernet session),
/// blocking for at most about `timeout`.
pub(crate) fn connect_transport(
    endpoint: &Endpoint,
    timeout: Duration,
    tls: Option<&TlsConfig>,
) -> Result<Stream> {
    Ok(match (tls, endpoint) {
        (Some(config), _) => Stream::connect_tls(endpoint, timeout, config.clone())?,
        (None, Endpoint::Eth { .. }) => eth::connect(endpoint, timeout)?,
        (None, _) => Stream::connect(endpoint, timeout)?,
    })
}

impl Conn {
    /// A connection for control calls: connected, and the handshake done (proving `key` when
    /// there is one; docs/PROTOCOL.md, section 15).
    pub fn connect(
        endpoint: &Endpoint,
        proposed: &Limits,
        timeout: Duration,
        key: Option<&Key>,
        tls: Option<&TlsConfig>,
    ) -> Result<Conn> {
        let mut conn = Conn::over(connect_transport(endpoint, timeout, tls)?, timeout, PollMode::Off);
        conn.limits = *proposed;
        let mut handshake = ClientHandshake::new(*proposed);
        if let Some(key) = key {
            handshake = handshake.with_key(key.clone(), rt::random::bytes()?);
        }
        conn.send_all(&[&handshake.hello_frame()])?;
        let (h, body) = conn.recv_control()?;
        conn.limits = handshake.handle_reply(&h, &body)?;
        if let Some(auth) = handshake.auth_frame() {
            conn.send_all(&[&auth])?;
            let (h, body) = conn.recv_control()?;
            handshake.handle_auth_reply(&h, &body)?;
        }
        Ok(conn)
    }

    /// A connection over `stream`, which no handshake has run on yet.
    pub fn over(stream: Stream, timeout: Duration, poll: PollMode) -> Conn {
        Conn {
            stream,
            rx: FrameBuffer::new(),
            limits: Limits::default(),
            timeout,
            waiter: Waiter::new(poll),
            recv_ns: 0,
            send_ns: 0,
        }
    }

    /// Run a lane's handshake (HELLO, AUTH, OPEN, grants) to the end, waiting for each reply
    /// at most the timeout.
    pub fn open(&mut self, mut opening: Opening) -> Result<Opened> {
        loop {
            let out = opening.poll_transmit();
            if !out.is_empty() {
                let n = out.len();
                self.send_all(&[out])?;
                opening.handle_sent(n);
            }
            if let Some(opened) = opening.handle_rx(&mut self.rx)? {
                self.limits = opened.limits;
                return Ok(opened);
            }
            if !opening.poll_transmit().is_empty() {
                // A reply called for the next frame: send it before waiting.
                continue;
            }
            let deadline = Instant::now() + self.timeout;
            self.receive_blocking(deadline, &mut |conn| conn.fill_now(usize::MAX))?;
        }
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
            if let Some(f) = self.next_control()? {
                return Ok((f.header, self.rx.body(&f).to_vec()));
            }
            self.receive_blocking(deadline, &mut |conn| conn.fill_now(usize::MAX))?;
        }
    }

    fn next_control(&mut self) -> Result<Option<FrameRef>> {
        Ok(self.rx.next_frame(proto::client::admit_control)?)
    }

    /// Receive what is there without waiting, at most `cap` bytes. Returns bytes received.
    pub fn fill_now(&mut self, cap: usize) -> Result<usize> {
        let spare = self.rx.spare();
        let cap = cap.min(spare.len());
        let started = Instant::now();
        let got = FrameIo::recv(&mut self.stream, &mut [IoSliceMut::new(&mut spare[..cap])]);
        self.recv_ns += started.elapsed().as_nanos() as u64;
        let n = received(got)?;
        self.rx.commit(n);
        Ok(n)
    }

    /// One vectored send, timed: what the socket takes now (`WouldBlock`: nothing).
    pub fn send(&mut self, iov: &[IoSlice<'_>]) -> io::Result<usize> {
        let started = Instant::now();
        let sent = self.stream.send(iov);
        self.send_ns += started.elapsed().as_nanos() as u64;
        sent
    }

    /// Receive at least one byte with `receive`, waiting until `deadline` (by the hybrid
    /// polling policy of `waiter`: perhaps a timed sleep, then spinning, then sleeping).
    pub fn receive_blocking(
        &mut self,
        deadline: Instant,
        receive: &mut dyn FnMut(&mut Conn) -> Result<usize>,
    ) -> Result<()> {
        if receive(self)? > 0 {
            return Ok(());
        }
        let timeout = self.timeout;
        let mut waiter = std::mem::take(&mut self.waiter);
        let mut w = ReceiveWait { conn: self, receive, deadline, got: false };
        // The policy's wait, then plain sleeps until bytes come (a wake-up may bring none:
        // only TLS records to write, or a spurious one) or the deadline passes.
        let result = rt::poll::wait(&mut waiter, &mut w).and_then(|_| loop {
            if w.got || w.ready()? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::TimedOut(timeout));
            }
            w.sleep(None)?;
        });
        self.waiter = waiter;
        result
    }

    /// Wait until the socket takes more bytes, receiving whatever the peer sends meanwhile into
    /// the frame buffer (to be handled afterwards), so the peer is never blocked on us while
    /// we are blocked on it. That backlog is bounded by the replies to the requests in flight.
    pub fn wait_writable(&mut self, deadline: Instant) -> Result<()> {
        // A raw-Ethernet session's send waits for acknowledgements: for readability, and
        // its timers.
        let for_writable = self.stream.send_waits_for_writable();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let left = self.stream.timer().map_or(left, |t| t.min(left));
            let ready = wait_fd(self.stream.as_raw_fd(), for_writable, Some(left))?;
            if ready.readable || !for_writable {
                self.fill_now(usize::MAX)?;
            }
            if ready.writable || !for_writable {
                return Ok(());
            }
            if !ready.readable && Instant::now() >= deadline {
                return Err(Error::TimedOut(self.timeout));
            }
        }
    }

    /// Send every byte of `parts`, in order, receiving while the socket is full (see
    /// [`wait_writable`](Self::wait_writable)). For control frames.
    pub fn send_all(&mut self, parts: &[&[u8]]) -> Result<()> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut sent = 0;
        let deadline = Instant::now() + self.timeout;
        while sent < total {
            let iov = gather_from(parts, sent);
            match self.send(&iov) {
                Ok(0) => return Err(Error::Closed),
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait_writable(deadline)?,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

/// One wait of [`Conn::receive_blocking`] for `rt::poll` to drive. A receive that gets bytes
/// ends it; they stay in the frame buffer for the caller.
struct ReceiveWait<'a> {
    conn: &'a mut Conn,
    receive: &'a mut dyn FnMut(&mut Conn) -> Result<usize>,
    deadline: Instant,
    /// A receive got bytes.
    got: bool,
}

impl Wait for ReceiveWait<'_> {
    type Error = Error;

    fn ready(&mut self) -> Result<bool> {
        self.got = (self.receive)(self.conn)? > 0;
        Ok(self.got)
    }

    fn sleep(&mut self, timeout: Option<Duration>) -> Result<bool> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        let t = timeout.map_or(left, |t| t.min(left));
        if t.is_zero() {
            return Ok(true);
        }
        let stream = &self.conn.stream;
        // A raw-Ethernet session's timer cuts the sleep short; the next receive drives it.
        let t = stream.timer().map_or(t, |timer| timer.min(t));
        let ready = wait_fd(stream.as_raw_fd(), stream.pending_send(), Some(t))?;
        Ok(ready.readable || (ready.writable && stream.pending_send()))
    }
}

/// The unsent rest of `parts`, `skip` bytes in.
fn gather_from<'a>(parts: &[&'a [u8]], mut skip: usize) -> Vec<IoSlice<'a>> {
    let mut iov = Vec::with_capacity(parts.len());
    for p in parts {
        if skip >= p.len() {
            skip -= p.len();
            continue;
        }
        iov.push(IoSlice::new(&p[skip..]));
        skip = 0;
    }
    iov
}
