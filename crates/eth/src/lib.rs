//! skiff over raw Ethernet (docs/ETHERNET.md): the sockets, the driver of a session over the
//! sans-I/O datagram stack (`skiff-dgram`), and discovery of targets. The fault relay that
//! tests and benchmarks put between two interfaces is a crate of its own (`skiff-relay`).
//!
//! - [`packet::PacketSocket`]: an AF_PACKET socket with memory-mapped rings and a kernel
//!   filter, one per session and interface; [`xdp::XdpSocket`], the AF_XDP alternative.
//! - [`EthStream`] and [`EthListener`] ([`session`]): a session's driver and the target's
//!   listener, behind `transport`'s [`FrameIo`](transport::FrameIo), [`DatagramConn`] and
//!   [`DatagramListener`], so that the target's event loop and the initiator's lanes carry
//!   them as [`Stream::Datagram`](transport::Stream::Datagram).
//! - [`listen`] and [`connect`]: a raw-Ethernet [`Endpoint`] bound or connected, with discovery
//!   of the target when the endpoint names no MAC ([`discover`]).
//!
//! Unsafe code (the rings, the sockets' options, the eBPF program of AF_XDP) lives in
//! `packet` and `xdp`, each block with a SAFETY comment.

use std::io;
use std::time::Duration;

use transport::{DatagramConn, DatagramListener, Endpoint, Listener, Stream};

pub mod packet;
pub mod session;
pub mod xdp;

#[cfg(feature = "mutations")]
pub use session::Mutation;
pub use session::{
    discover, Clock, DatagramSocket, Driver, EthConfig, EthListener, EthStream, Link, Monotonic, PathStats,
    TARGET_KEEPALIVE_US,
};

/// The target's listener on a raw-Ethernet `endpoint` (its interfaces form one bundle), its
/// sessions set up as the endpoint's options say ([`EthConfig::for_endpoint`]).
pub fn listen(endpoint: &Endpoint) -> io::Result<Listener> {
    let Endpoint::Eth { ifaces, options, .. } = endpoint else { return Err(not_eth(endpoint)) };
    Ok(Listener::Datagram(Box::new(EthListener::bind(ifaces, EthConfig::for_endpoint(options))?)))
}

/// An initiator's session with the target of a raw-Ethernet `endpoint`: the MAC it names, or
/// the one target that answers a Discover on its first interface within `timeout` (at most a
/// fifth of a second), set up as the endpoint's options say ([`EthConfig::for_endpoint`]).
pub fn connect(endpoint: &Endpoint, timeout: Duration) -> io::Result<Stream> {
    let Endpoint::Eth { ifaces, mac, options } = endpoint else { return Err(not_eth(endpoint)) };
    let config = &EthConfig::for_endpoint(options);
    let mac = match mac {
        Some(mac) => *mac,
        None => the_target_on(&ifaces[0], timeout)?,
    };
    Ok(Stream::Datagram(Box::new(EthStream::connect(ifaces, mac, config)?)))
}

fn not_eth(endpoint: &Endpoint) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("{endpoint} is not a raw-Ethernet endpoint"))
}

/// The one target that answers a Discover on `iface` (within a fifth of a second, or
/// `timeout` if shorter); an error names none or several.
fn the_target_on(iface: &str, timeout: Duration) -> io::Result<packet::Mac> {
    let found = discover(iface, timeout.min(Duration::from_millis(200)))?;
    match found.as_slice() {
        [one] => Ok(*one),
        [] => Err(io::Error::new(io::ErrorKind::NotFound, format!("no skiff target answered on {iface}"))),
        many => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} skiff targets answered on {iface}: name one as eth:{iface}/MAC ({})",
                many.len(),
                many.iter().map(transport::endpoint::format_mac).collect::<Vec<_>>().join(", ")
            ),
        )),
    }
}

impl DatagramConn for EthStream {
    fn timer(&self) -> Option<Duration> {
        self.timeout()
    }

    fn describe(&self) -> String {
        EthStream::describe(self)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl DatagramListener for EthListener {
    fn accept(&mut self) -> io::Result<Box<dyn DatagramConn>> {
        Ok(Box::new(EthListener::accept(self)?))
    }

    fn local_endpoint(&self) -> Endpoint {
        // Without the target's own options: an initiator chooses its sessions' settings.
        Endpoint::Eth { ifaces: self.ifaces().to_vec(), mac: Some(self.mac()), options: Default::default() }
    }
}
