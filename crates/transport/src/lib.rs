//! Moving frames between peers.
//!
//! Transports know frame boundaries (the 24-byte header says how long a frame is) and nothing
//! else of the protocol. The seam is [`FrameIo`]: receive into a scatter list (read data straight
//! into callers' buffers, the rest into a [`FrameBuffer`]), push a gather list of byte slices
//! out. TCP and Unix stream sockets, and TLS over TCP, implement it here as one connection type,
//! [`Stream`] (non-blocking), for the target's event loop (accepted from a [`Listener`],
//! registered with `mio`) and for the initiator's lanes ([`Stream::connect`]). Endpoints
//! ([`Endpoint`]) name every transport skiff has.
//!
//! A datagram transport with its own reliable, in-order delivery in this process (raw
//! Ethernet, in `skiff-eth`) implements the same trait by placing each delivered frame's bytes
//! into the buffer, and [`DatagramConn`] and [`DatagramListener`] besides, so that
//! [`Stream::Datagram`] and [`Listener::Datagram`] carry it and
//! everything above stays unchanged. This crate does not depend on it: the server and the
//! initiator bind and connect raw-Ethernet endpoints through `skiff-eth`.

pub mod endpoint;
pub mod stream;
pub mod tls;

/// The readiness loop the target's workers run on: `mio`'s poll, re-exported so that the
/// server reaches the network only through this crate.
pub mod event {
    pub use mio::{Events, Interest, Poll, Token, Waker};
}

pub use endpoint::{Endpoint, EndpointError, EthDriver, EthOptions};
pub use stream::{wait_any, wait_either, wait_fd, wait_readable2, Kick, Listener, Stream};
pub use wire::{FrameBuffer, FrameRef};

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::AsRawFd;
use std::time::Duration;

/// A connection of a datagram transport whose delivery runs in this process (raw Ethernet:
/// `skiff-eth`'s sessions). Beside [`FrameIo`], what a caller needs that a socket does not ask
/// for: timers of its own, and a description. Its descriptor (`AsRawFd`) is readable when
/// datagrams arrive; a send it cannot take now waits for acknowledgements, so for
/// readability, never for writability.
pub trait DatagramConn: FrameIo + AsRawFd + Send {
    /// When it must be driven again even if nothing arrives (its retransmission and
    /// acknowledgement timers), from now.
    fn timer(&self) -> Option<Duration>;
    /// The peer and the session, for logs.
    fn describe(&self) -> String;
    /// The connection itself, for what only its own crate can report (`skiff-eth`'s counters).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A listener of such a transport: its descriptor is readable when a new session may be
/// waiting.
pub trait DatagramListener: AsRawFd + Send {
    /// A new session, or `WouldBlock`.
    fn accept(&mut self) -> io::Result<Box<dyn DatagramConn>>;
    /// Where it listens, as an initiator would name it.
    fn local_endpoint(&self) -> Endpoint;
}

/// A connection that carries frames. Non-blocking: `WouldBlock` means "not now".
pub trait FrameIo {
    /// Receive what is there into `bufs`, filling them in order. `Ok(0)` means the peer
    /// closed; `WouldBlock` means nothing is there now.
    fn recv(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize>;
    /// Send from the gather list what the OS takes now; returns the bytes taken.
    fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize>;
    /// Send up to `len` bytes of file `fd` from `offset` with `sendfile(2)`, what the OS takes
    /// now; returns the bytes taken. `Unsupported` where the bytes must pass through the
    /// transport (TLS, datagrams): the caller reads them and sends them with `send`.
    fn send_file(&mut self, fd: std::os::fd::RawFd, offset: u64, len: usize) -> io::Result<usize> {
        let _ = (fd, offset, len);
        Err(io::ErrorKind::Unsupported.into())
    }
    /// Move what is there into `rx`'s spare room; as [`recv`](Self::recv).
    fn fill(&mut self, rx: &mut FrameBuffer) -> io::Result<usize> {
        let n = self.recv(&mut [IoSliceMut::new(rx.spare())])?;
        rx.commit(n);
        Ok(n)
    }
    /// Bytes the transport took in `send` but has not yet handed to the OS (TLS ciphertext the
    /// socket refused): while true, wait for writability too, and call `send` (an empty list
    /// only flushes). Plain sockets keep nothing back.
    fn pending_send(&self) -> bool {
        false
    }
    /// Received bytes the transport may hold already, or may read without the socket saying so
    /// again (TLS: plaintext decrypted ahead, or ciphertext left in the socket because rustls
    /// reads a record at a time): while true, call `recv` again instead of sleeping on
    /// readability, until it reports `WouldBlock`. Plain sockets hold nothing.
    fn buffered_recv(&self) -> bool {
        false
    }
    /// Whether the transport can carry data messages: read data apart from the byte stream,
    /// placed by tag and offset (docs/PROTOCOL.md 16.9; raw Ethernet's Place datagrams).
    fn data_messages(&self) -> bool {
        false
    }
    /// From the next frame on, send the read data of completion caravans in data messages (a
    /// target whose initiator agreed to them). Returns whether it will.
    fn send_data_messages(&mut self) -> bool {
        false
    }
    /// As [`recv`](Self::recv), handing each data message that arrives meanwhile (its
    /// payload: segments) to `place`, once, in arrival order.
    fn recv_placing(
        &mut self,
        bufs: &mut [IoSliceMut<'_>],
        place: &mut dyn FnMut(&[u8]),
    ) -> io::Result<usize> {
        let _ = place;
        self.recv(bufs)
    }
}
