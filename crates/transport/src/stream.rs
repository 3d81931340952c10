//! TCP, Unix and TLS stream sockets behind [`FrameIo`], and a datagram transport's sessions.
//!
//! One connection type serves both sides: [`Stream`], non-blocking. The target accepts it from
//! a [`Listener`] and registers it with `mio`; the initiator makes it with
//! [`Stream::connect`] and uses [`wait_fd`] to sleep until its socket is ready, so that a lane
//! can keep receiving completions while a send would block: two peers that both only send
//! would otherwise deadlock on full buffers.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use mio::event::Source;
use mio::{Interest, Registry, Token};

use crate::tls::TlsStream;
use crate::{DatagramConn, DatagramListener, Endpoint, FrameBuffer, FrameIo};

/// How both sides notice a peer that vanished without closing (power loss, a cable, a
/// partition): TCP keepalive probes an idle connection after `KEEPALIVE_IDLE`, every
/// `KEEPALIVE_INTERVAL`, and gives up after `KEEPALIVE_PROBES` unanswered ones (16 s in all);
/// data left unacknowledged for `USER_TIMEOUT` fails the connection while it is busy. Either
/// way the next receive or send reports an error, which the target treats as a close and the
/// initiator as a reason to reconnect.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
pub const KEEPALIVE_PROBES: u32 = 3;
pub const USER_TIMEOUT: Duration = Duration::from_secs(20);

fn watch_peer(socket: socket2::SockRef<'_>) -> io::Result<()> {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    socket.set_tcp_keepalive(&keepalive)?;
    socket.set_tcp_user_timeout(Some(USER_TIMEOUT))
}

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

fn recv_from(r: &mut impl Read, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
    loop {
        match r.read_vectored(bufs) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
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
    /// A listener of a datagram transport ([`DatagramListener`]: raw Ethernet, `skiff-eth`).
    Datagram(Box<dyn DatagramListener>),
}

impl Listener {
    /// Bind `endpoint`. A stale Unix socket file left by a previous run is replaced. A raw
    /// Ethernet endpoint is refused: its listener is `skiff-eth`'s, wrapped as
    /// [`Listener::Datagram`].
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
            Endpoint::Eth { .. } => Err(not_here(endpoint)),
        }
    }

    /// The bound address, with the real port when port 0 was asked for.
    pub fn local_endpoint(&self) -> io::Result<Endpoint> {
        match self {
            Listener::Tcp(l) => Ok(Endpoint::Tcp(l.local_addr()?.to_string())),
            Listener::Unix(_, path) => Ok(Endpoint::Unix(path.clone())),
            Listener::Datagram(l) => Ok(l.local_endpoint()),
        }
    }

    /// Accept one pending connection, if any.
    pub fn accept(&mut self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                // Caravans are already batched by the sender; Nagle would only add delay.
                s.set_nodelay(true)?;
                watch_peer(socket2::SockRef::from(&s))?;
                Ok(Stream::Tcp(s))
            }
            Listener::Unix(l, _) => Ok(Stream::Unix(l.accept()?.0)),
            Listener::Datagram(l) => Ok(Stream::Datagram(l.accept()?)),
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
            Listener::Datagram(l) => mio::unix::SourceFd(&l.as_raw_fd()).register(r, t, i),
        }
    }
    fn reregister(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        match self {
            Listener::Tcp(l) => l.reregister(r, t, i),
            Listener::Unix(l, _) => l.reregister(r, t, i),
            Listener::Datagram(l) => mio::unix::SourceFd(&l.as_raw_fd()).reregister(r, t, i),
        }
    }
    fn deregister(&mut self, r: &Registry) -> io::Result<()> {
        match self {
            Listener::Tcp(l) => l.deregister(r),
            Listener::Unix(l, _) => l.deregister(r),
            Listener::Datagram(l) => mio::unix::SourceFd(&l.as_raw_fd()).deregister(r),
        }
    }
}

/// A connection, on either side.
pub enum Stream {
    Tcp(mio::net::TcpStream),
    Unix(mio::net::UnixStream),
    /// TCP carrying TLS ([`crate::tls`]).
    Tls(Box<TlsStream<mio::net::TcpStream>>),
    /// A session of a datagram transport ([`DatagramConn`]: raw Ethernet, `skiff-eth`).
    Datagram(Box<dyn DatagramConn>),
}

impl Stream {
    /// When the stream must be driven again even if nothing arrives: a datagram session's
    /// next retransmission or acknowledgement timer. Sockets need none.
    pub fn timer(&self) -> Option<Duration> {
        match self {
            Stream::Datagram(s) => s.timer(),
            _ => None,
        }
    }

    /// A description of the peer for logs.
    pub fn peer(&self) -> String {
        match self {
            Stream::Tcp(s) => s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "tcp:?".into()),
            Stream::Tls(s) => {
                s.get_ref().peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "tls:?".into())
            }
            Stream::Unix(_) => "unix".into(),
            Stream::Datagram(s) => s.describe(),
        }
    }

    /// The peer's IP address (`None` on a Unix socket), for per-address bounds.
    pub fn peer_ip(&self) -> Option<std::net::IpAddr> {
        match self {
            Stream::Tcp(s) => s.peer_addr().ok().map(|a| a.ip()),
            Stream::Tls(s) => s.get_ref().peer_addr().ok().map(|a| a.ip()),
            Stream::Unix(_) | Stream::Datagram(_) => None,
        }
    }

    /// The first byte the peer sent, without taking it: `Ok(None)` when nothing has come yet
    /// (or on a stream that is not plain TCP, where there is nothing to decide), `Ok(Some(_))`
    /// or an end-of-file error otherwise. For a listener that serves TLS and plaintext both.
    pub fn peek_first_byte(&self) -> io::Result<Option<u8>> {
        let Stream::Tcp(s) = self else { return Ok(None) };
        let mut b = [0u8; 1];
        match s.peek(&mut b) {
            Ok(0) => Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => Ok(Some(b[0])),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Who the peer proved to be over TLS with a client certificate
    /// ([`crate::tls::certificate_principal`]); `None` on plaintext streams.
    pub fn peer_principal(&self) -> Option<String> {
        match self {
            Stream::Tls(s) => s.peer_principal(),
            _ => None,
        }
    }

    /// End the TLS session of a TLS stream ([`TlsStream::close`]); nothing on other streams.
    pub fn close_tls(&mut self) {
        if let Stream::Tls(s) = self {
            s.close();
        }
    }

    /// Whether this stream runs TLS and its handshake is finished.
    pub fn tls_established(&self) -> bool {
        matches!(self, Stream::Tls(s) if !s.is_handshaking())
    }

    /// Turn a plain TCP stream into the target side of TLS, in place (the socket stays
    /// registered with the poller: it is the same descriptor). TLS runs over TCP only: on a
    /// Unix socket this fails (`Unsupported`), and a stream already in TLS is left alone.
    pub fn start_tls(&mut self, config: std::sync::Arc<rustls::ServerConfig>) -> io::Result<()> {
        match self {
            Stream::Tcp(_) => {}
            Stream::Tls(_) => return Ok(()),
            Stream::Unix(_) => {
                return Err(io::Error::new(io::ErrorKind::Unsupported, "TLS over a Unix socket"))
            }
            Stream::Datagram(_) => {
                return Err(io::Error::new(io::ErrorKind::Unsupported, "TLS over raw Ethernet"))
            }
        }
        // A stand-in for the moment the TCP stream moves into its TLS wrapper.
        let stand_in = Stream::Unix(mio::net::UnixStream::pair()?.0);
        let Stream::Tcp(s) = std::mem::replace(self, stand_in) else { unreachable!("checked above") };
        *self = Stream::Tls(Box::new(TlsStream::server(s, config)?));
        Ok(())
    }
}

impl Stream {
    /// A second handle on a plaintext stream's socket (a `dup` of its descriptor), for a
    /// thread beside the one that owns the stream: the staged targets of `server::Stages`
    /// send or receive on it. The socket stays open until both handles are dropped. A TLS
    /// stream has one session state and cannot be shared this way.
    pub fn try_clone_plain(&self) -> io::Result<Stream> {
        use std::os::fd::{FromRawFd, OwnedFd};
        let fd = match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tls(_) => {
                return Err(io::Error::new(io::ErrorKind::Unsupported, "a TLS stream has no second handle"))
            }
            Stream::Datagram(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "a raw-Ethernet session has no second handle",
                ))
            }
        };
        // SAFETY: `fd` is open for as long as `self` lives; fcntl(F_DUPFD_CLOEXEC) only reads it.
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `dup` is a new descriptor that nothing else owns.
        let owned = unsafe { OwnedFd::from_raw_fd(dup) };
        Ok(match self {
            Stream::Unix(_) => Stream::Unix(mio::net::UnixStream::from_std(owned.into())),
            _ => Stream::Tcp(mio::net::TcpStream::from_std(owned.into())),
        })
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tls(s) => s.get_ref().as_raw_fd(),
            Stream::Datagram(s) => s.as_raw_fd(),
        }
    }
}

impl FrameIo for Stream {
    fn recv(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => recv_from(s, bufs),
            Stream::Unix(s) => recv_from(s, bufs),
            Stream::Tls(s) => s.recv(bufs),
            Stream::Datagram(s) => s.recv(bufs),
        }
    }
    fn fill(&mut self, rx: &mut FrameBuffer) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => fill_from(s, rx),
            Stream::Unix(s) => fill_from(s, rx),
            Stream::Tls(s) => s.fill(rx),
            Stream::Datagram(s) => s.fill(rx),
        }
    }
    fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => send_to(s, bufs),
            Stream::Unix(s) => send_to(s, bufs),
            Stream::Tls(s) => s.send(bufs),
            Stream::Datagram(s) => s.send(bufs),
        }
    }
    fn send_file(&mut self, fd: RawFd, offset: u64, len: usize) -> io::Result<usize> {
        if !matches!(self, Stream::Tcp(_) | Stream::Unix(_)) {
            return Err(io::ErrorKind::Unsupported.into());
        }
        let mut off =
            libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        loop {
            // SAFETY: both descriptors are open (the socket is ours; the caller keeps `fd`
            // open for the call), and `off` is a valid place for the kernel to update.
            let n = unsafe { libc::sendfile(self.as_raw_fd(), fd, &mut off, len) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
    fn pending_send(&self) -> bool {
        matches!(self, Stream::Tls(s) if s.pending_send())
    }
    fn data_messages(&self) -> bool {
        matches!(self, Stream::Datagram(s) if s.data_messages())
    }
    fn send_data_messages(&mut self) -> bool {
        match self {
            Stream::Datagram(s) => s.send_data_messages(),
            _ => false,
        }
    }
    fn recv_placing(
        &mut self,
        bufs: &mut [IoSliceMut<'_>],
        place: &mut dyn FnMut(&[u8]),
    ) -> io::Result<usize> {
        match self {
            Stream::Datagram(s) => s.recv_placing(bufs, place),
            other => other.recv(bufs),
        }
    }
    fn buffered_recv(&self) -> bool {
        match self {
            Stream::Tls(s) => s.buffered_recv(),
            Stream::Datagram(s) => s.buffered_recv(),
            _ => false,
        }
    }
}

impl Source for Stream {
    fn register(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.register(r, t, i),
            Stream::Unix(s) => s.register(r, t, i),
            Stream::Tls(s) => s.get_mut().register(r, t, i),
            Stream::Datagram(s) => mio::unix::SourceFd(&s.as_raw_fd()).register(r, t, i),
        }
    }
    fn reregister(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.reregister(r, t, i),
            Stream::Unix(s) => s.reregister(r, t, i),
            Stream::Tls(s) => s.get_mut().reregister(r, t, i),
            Stream::Datagram(s) => mio::unix::SourceFd(&s.as_raw_fd()).reregister(r, t, i),
        }
    }
    fn deregister(&mut self, r: &Registry) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.deregister(r),
            Stream::Unix(s) => s.deregister(r),
            Stream::Tls(s) => s.get_mut().deregister(r),
            Stream::Datagram(s) => mio::unix::SourceFd(&s.as_raw_fd()).deregister(r),
        }
    }
}

impl Stream {
    /// The initiator's side: connect, waiting at most `timeout` for each address `endpoint`
    /// resolves to (a host that is gone would otherwise hold the caller for the kernel's SYN
    /// retries, minutes), then switch to non-blocking. A raw-Ethernet endpoint is refused:
    /// `skiff-eth` connects it, wrapped as [`Stream::Datagram`].
    pub fn connect(endpoint: &Endpoint, timeout: Duration) -> io::Result<Stream> {
        match endpoint {
            Endpoint::Tcp(addr) => {
                let s = connect_tcp(addr, timeout)?;
                s.set_nodelay(true)?;
                watch_peer(socket2::SockRef::from(&s))?;
                s.set_nonblocking(true)?;
                Ok(Stream::Tcp(mio::net::TcpStream::from_std(s)))
            }
            Endpoint::Unix(path) => {
                let u = std::os::unix::net::UnixStream::connect(path)?;
                u.set_nonblocking(true)?;
                Ok(Stream::Unix(mio::net::UnixStream::from_std(u)))
            }
            Endpoint::Eth { .. } => Err(not_here(endpoint)),
        }
    }

    /// [`connect`](Self::connect) over TLS, checking the target's certificate against the
    /// endpoint's host with `config`. Only TCP endpoints carry TLS.
    pub fn connect_tls(
        endpoint: &Endpoint,
        timeout: Duration,
        config: std::sync::Arc<rustls::ClientConfig>,
    ) -> io::Result<Stream> {
        let Endpoint::Tcp(addr) = endpoint else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "TLS needs a TCP endpoint, not a Unix socket",
            ));
        };
        let host = addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h);
        let name = crate::tls::server_name(host)?;
        let Stream::Tcp(s) = Stream::connect(endpoint, timeout)? else {
            unreachable!("a TCP endpoint gives a TCP stream")
        };
        Ok(Stream::Tls(Box::new(TlsStream::client(s, config, name)?)))
    }

    /// Whether a send that would block waits for the descriptor to be writable. A datagram
    /// session's send waits for acknowledgements instead: for it to be readable.
    pub fn send_waits_for_writable(&self) -> bool {
        !matches!(self, Stream::Datagram(_))
    }

    /// Close both directions now (the peer sees end of stream).
    pub fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(t) => t.shutdown(std::net::Shutdown::Both),
            Stream::Unix(u) => u.shutdown(std::net::Shutdown::Both),
            Stream::Tls(t) => t.get_ref().shutdown(std::net::Shutdown::Both),
            // A session ends by Close from a mutable stream (or by its peer's death timer).
            Stream::Datagram(_) => Ok(()),
        };
    }
}

/// What [`Listener::bind`] and [`Stream::connect`] say of an endpoint whose transport is
/// another crate's: a raw-Ethernet one is bound and connected by `skiff-eth`.
fn not_here(endpoint: &Endpoint) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("{endpoint}: raw Ethernet is bound and connected by skiff-eth, not by this crate"),
    )
}

fn connect_tcp(addr: &str, timeout: Duration) -> io::Result<std::net::TcpStream> {
    use std::net::ToSocketAddrs;
    let mut last = io::Error::new(io::ErrorKind::InvalidInput, format!("{addr}: no address"));
    for a in addr.to_socket_addrs()? {
        match std::net::TcpStream::connect_timeout(&a, timeout.max(Duration::from_millis(1))) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
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
    let mut events = libc::POLLIN;
    if want_write {
        events |= libc::POLLOUT;
    }
    let mut pfd = [libc::pollfd { fd, events, revents: 0 }];
    poll_fds(&mut pfd, timeout)?;
    Ok(ready_of(&pfd[0]))
}

/// Sleep until `a` or `b` is readable, or `timeout` passes; says which are.
pub fn wait_readable2(a: RawFd, b: RawFd, timeout: Option<Duration>) -> io::Result<(bool, bool)> {
    wait_either(a, false, b, timeout)
}

/// Sleep until `a` is readable (or writable, with `a_write`: a TLS stream with ciphertext to
/// flush) or `b` is readable, or `timeout` passes; says whether `a` and `b` are ready.
pub fn wait_either(a: RawFd, a_write: bool, b: RawFd, timeout: Option<Duration>) -> io::Result<(bool, bool)> {
    let a_events = if a_write { libc::POLLIN | libc::POLLOUT } else { libc::POLLIN };
    let mut pfds = [
        libc::pollfd { fd: a, events: a_events, revents: 0 },
        libc::pollfd { fd: b, events: libc::POLLIN, revents: 0 },
    ];
    poll_fds(&mut pfds, timeout)?;
    let a_ready = ready_of(&pfds[0]);
    Ok((a_ready.readable || a_ready.writable, ready_of(&pfds[1]).readable))
}

/// Sleep until any of `fds` is readable (errors and hang-ups count), or `timeout` passes; true
/// when one is. Up to 32 descriptors without allocating.
pub fn wait_any(fds: &[RawFd], timeout: Option<Duration>) -> io::Result<bool> {
    let pfd = |fd: RawFd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let mut few = [pfd(-1); 32];
    let mut many = Vec::new();
    let pfds: &mut [libc::pollfd] = if fds.len() <= few.len() {
        for (p, &fd) in few.iter_mut().zip(fds) {
            *p = pfd(fd);
        }
        &mut few[..fds.len()]
    } else {
        many.extend(fds.iter().map(|&fd| pfd(fd)));
        &mut many
    };
    poll_fds(pfds, timeout)?;
    Ok(pfds.iter().any(|p| ready_of(p).readable))
}

fn ready_of(pfd: &libc::pollfd) -> Ready {
    let bad = libc::POLLERR | libc::POLLHUP | libc::POLLNVAL;
    Ready { readable: pfd.revents & (libc::POLLIN | bad) != 0, writable: pfd.revents & libc::POLLOUT != 0 }
}

/// `ppoll` with a microsecond timeout (`poll` counts milliseconds, which would turn a
/// doorbell's 50 µs into a busy loop or a 1 ms sleep). Retries on EINTR.
fn poll_fds(pfds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<()> {
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    loop {
        // SAFETY: `pfds` is a valid array of its length; `ts_ptr` is null or points to `ts`,
        // alive for the call; a null signal mask leaves the mask unchanged.
        let rc =
            unsafe { libc::ppoll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ts_ptr, std::ptr::null()) };
        if rc >= 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// An eventfd one thread writes to wake another that sleeps in [`wait_readable2`].
#[derive(Debug)]
pub struct Kick {
    fd: std::os::fd::OwnedFd,
}

impl Kick {
    pub fn new() -> io::Result<Kick> {
        // SAFETY: plain syscall; the result is checked before it becomes an OwnedFd.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        Ok(Kick { fd: unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) } })
    }

    /// Make the eventfd readable (it stays so until [`Kick::clear`]).
    pub fn kick(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer. It can only fail when the counter would
        // overflow, and then the fd is readable anyway.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Consume pending kicks.
    pub fn clear(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer; EAGAIN (nothing pending) is fine.
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
    }
}

impl AsRawFd for Kick {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
