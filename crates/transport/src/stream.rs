//! TCP and Unix stream sockets behind [`FrameIo`].
//!
//! The target uses [`Listener`] and [`Stream`] (non-blocking, registered with `mio`); the
//! initiator uses [`ClientStream`] (non-blocking std sockets) and [`wait_fd`] to sleep until
//! its socket is ready, so that a lane can keep receiving completions while a send would
//! block: two peers that both only send would otherwise deadlock on full buffers.

use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use mio::event::Source;
use mio::{Interest, Registry, Token};

use crate::{Endpoint, FrameBuffer, FrameIo};

fn fill_from(r: &mut impl Read, rx: &mut FrameBuffer) -> io::Result<usize> {
    loop {
        match r.read(rx.spare()) {
            Ok(n) => {
                rx.commit(n);
                return Ok(n);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

fn send_to(w: &mut impl Write, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    loop {
        match w.write_vectored(bufs) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// A listening socket of the target.
pub enum Listener {
    Tcp(mio::net::TcpListener),
    Unix(mio::net::UnixListener, std::path::PathBuf),
}

impl Listener {
    /// Bind `endpoint`. A stale Unix socket file left by a previous run is replaced.
    pub fn bind(endpoint: &Endpoint) -> io::Result<Listener> {
        match endpoint {
            Endpoint::Tcp(addr) => {
                let addr =
                    std::net::ToSocketAddrs::to_socket_addrs(addr.as_str())?.next().ok_or_else(|| {
                        io::Error::new(io::ErrorKind::InvalidInput, "address resolves to nothing")
                    })?;
                Ok(Listener::Tcp(mio::net::TcpListener::bind(addr)?))
            }
            Endpoint::Unix(path) => {
                use std::os::unix::fs::FileTypeExt;
                if let Ok(meta) = std::fs::symlink_metadata(path) {
                    if meta.file_type().is_socket() {
                        std::fs::remove_file(path)?;
                    }
                }
                Ok(Listener::Unix(mio::net::UnixListener::bind(path)?, path.clone()))
            }
        }
    }

    /// The bound address, with the real port when port 0 was asked for.
    pub fn local_endpoint(&self) -> io::Result<Endpoint> {
        match self {
            Listener::Tcp(l) => Ok(Endpoint::Tcp(l.local_addr()?.to_string())),
            Listener::Unix(_, path) => Ok(Endpoint::Unix(path.clone())),
        }
    }

    /// Accept one pending connection, if any.
    pub fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                // Caravans are already batched by the sender; Nagle would only add delay.
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
            Listener::Unix(l, _) => Ok(Stream::Unix(l.accept()?.0)),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Source for Listener {
    fn register(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        match self {
            Listener::Tcp(l) => l.register(r, t, i),
            Listener::Unix(l, _) => l.register(r, t, i),
        }
    }
    fn reregister(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        match self {
            Listener::Tcp(l) => l.reregister(r, t, i),
            Listener::Unix(l, _) => l.reregister(r, t, i),
        }
    }
    fn deregister(&mut self, r: &Registry) -> io::Result<()> {
        match self {
            Listener::Tcp(l) => l.deregister(r),
            Listener::Unix(l, _) => l.deregister(r),
        }
    }
}

/// A target-side connection.
pub enum Stream {
    Tcp(mio::net::TcpStream),
    Unix(mio::net::UnixStream),
}

impl Stream {
    /// A description of the peer for logs.
    pub fn peer(&self) -> String {
        match self {
            Stream::Tcp(s) => s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "tcp:?".into()),
            Stream::Unix(_) => "unix".into(),
        }
    }
}

impl FrameIo for Stream {
    fn fill(&mut self, rx: &mut FrameBuffer) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => fill_from(s, rx),
            Stream::Unix(s) => fill_from(s, rx),
        }
    }
    fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => send_to(s, bufs),
            Stream::Unix(s) => send_to(s, bufs),
        }
    }
}

impl Source for Stream {
    fn register(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.register(r, t, i),
            Stream::Unix(s) => s.register(r, t, i),
        }
    }
    fn reregister(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.reregister(r, t, i),
            Stream::Unix(s) => s.reregister(r, t, i),
        }
    }
    fn deregister(&mut self, r: &Registry) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.deregister(r),
            Stream::Unix(s) => s.deregister(r),
        }
    }
}

/// An initiator-side connection: connected blocking, then switched to non-blocking.
pub enum ClientStream {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl ClientStream {
    pub fn connect(endpoint: &Endpoint) -> io::Result<ClientStream> {
        let s = match endpoint {
            Endpoint::Tcp(addr) => {
                let s = std::net::TcpStream::connect(addr.as_str())?;
                s.set_nodelay(true)?;
                ClientStream::Tcp(s)
            }
            Endpoint::Unix(path) => ClientStream::Unix(std::os::unix::net::UnixStream::connect(path)?),
        };
        match &s {
            ClientStream::Tcp(t) => t.set_nonblocking(true)?,
            ClientStream::Unix(u) => u.set_nonblocking(true)?,
        }
        Ok(s)
    }

    /// Close both directions now (the peer sees end of stream).
    pub fn shutdown(&self) {
        let _ = match self {
            ClientStream::Tcp(t) => t.shutdown(std::net::Shutdown::Both),
            ClientStream::Unix(u) => u.shutdown(std::net::Shutdown::Both),
        };
    }
}

impl AsRawFd for ClientStream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            ClientStream::Tcp(t) => t.as_raw_fd(),
            ClientStream::Unix(u) => u.as_raw_fd(),
        }
    }
}

impl FrameIo for ClientStream {
    fn fill(&mut self, rx: &mut FrameBuffer) -> io::Result<usize> {
        match self {
            ClientStream::Tcp(s) => fill_from(s, rx),
            ClientStream::Unix(s) => fill_from(s, rx),
        }
    }
    fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            ClientStream::Tcp(s) => send_to(s, bufs),
            ClientStream::Unix(s) => send_to(s, bufs),
        }
    }
}

/// Readiness reported by [`wait_fd`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ready {
    pub readable: bool,
    pub writable: bool,
}

/// Sleep until `fd` is readable (or writable, when `want_write`), or `timeout` passes.
/// Errors and hang-ups count as readable, so the caller's next read reports them.
pub fn wait_fd(fd: RawFd, want_write: bool, timeout: Option<Duration>) -> io::Result<Ready> {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    if want_write {
        pfd.events |= libc::POLLOUT;
    }
    let timeout_ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    loop {
        // SAFETY: one valid pollfd, count 1.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if rc >= 0 {
            break;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    let bad = libc::POLLERR | libc::POLLHUP | libc::POLLNVAL;
    Ok(Ready {
        readable: pfd.revents & (libc::POLLIN | bad) != 0,
        writable: pfd.revents & libc::POLLOUT != 0,
    })
}
