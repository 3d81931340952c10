//! Sessions of skiff's native protocol over raw Ethernet: `proto::reliable`'s
//! [`DatagramStream`] driven over a [`PacketSocket`], behind [`FrameIo`], so that everything
//! above (the client session, the target's front end) runs over it as over TCP.
//!
//! [`EthStream`] is the driver of one session: it feeds the datagrams that arrive from its
//! peer into the stream, fires the stream's timers, and writes what the stream has to send
//! straight into the socket's transmit ring ([`PacketSocket::queue_with`]), flushing once per
//! drive. Each session has a socket of its own, which a kernel filter restricts to the
//! session's datagrams (its id and its peer's MAC, [`PacketSocket::attach_filter`]): many
//! sessions of one host never see each other's traffic, and a worker waits on a session's
//! descriptor as on a TCP socket's.
//!
//! A session starts when the initiator sends its first datagram (sequence number 0) under a
//! session id it drew at random. [`EthListener`] is the target's side of that: its socket
//! sees only datagrams with sequence number 0, and each one from a (MAC, session id) it does
//! not know yet opens a new session, whose own socket takes over from there. The listener
//! also answers [`discover`]'s broadcast Discover with an Offer, so an initiator can find the
//! targets on its segment (docs/PROTOCOL.md, section 16.2).
//!
//! The caller waits for the socket to be readable or for [`EthStream::timeout`] to pass,
//! whichever comes first, then drives the stream (`recv` and `send` drive it too): unlike a
//! TCP socket's, the retransmission and acknowledgement timers run in this process.

use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use proto::reliable::{Counters, DatagramStream, ReliableConfig, State};
use wire::datagram::{DatagramHeader, DatagramKind, DATAGRAM_HEADER_LEN};

use crate::endpoint::format_mac;
use crate::packet::{bpf, Bpf, Mac, PacketSocket, RingConfig, BROADCAST, ETHERTYPE, ETH_HEADER_LEN};
use crate::FrameIo;

/// Where the datagram header's fields sit in a frame (after the 14-byte Ethernet header;
/// docs/PROTOCOL.md, section 16).
const KIND_OFFSET: u32 = (ETH_HEADER_LEN + 1) as u32;
const SESSION_ID_OFFSET: u32 = (ETH_HEADER_LEN + 4) as u32;
const SEQ_OFFSET: u32 = (ETH_HEADER_LEN + 8) as u32;

/// The rings and the delivery settings of raw-Ethernet sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EthConfig {
    /// Each session's socket (small rings: a session has at most its window in flight).
    pub ring: RingConfig,
    pub reliable: ReliableConfig,
}

impl Default for EthConfig {
    fn default() -> EthConfig {
        EthConfig {
            // Past the interface's queueing discipline (PACKET_QDISC_BYPASS), which costs a
            // fifth of the CPU per I/O at QD 32 even on veth's noqueue; SKIFF_ETH_QDISC=on
            // goes through it, for links shaped with `tc` (bench/ethernet.py --shape).
            ring: RingConfig {
                rx_slots: 128,
                tx_slots: 64,
                qdisc_bypass: std::env::var("SKIFF_ETH_QDISC").map_or(true, |v| v != "on"),
                ..RingConfig::default()
            },
            // Jumbo datagrams where the MTU allows (lowered to the MTU when a session opens),
            // and a window that keeps a 64-deep queue of 4 KiB requests moving. On a segment
            // round trips are tens of microseconds: a lost datagram with nothing behind it
            // (a lone caravan) waits out the minimum RTO, so it is 250 µs, still above the
            // 100 µs delayed ack plus a round trip.
            reliable: ReliableConfig {
                payload_bytes_max: 8972,
                send_slots: 128,
                recv_slots: 128,
                rto_min_us: 250,
                ..ReliableConfig::default()
            },
        }
    }
}

/// A datagram with no payload outside any session: a Discover or an Offer, `id` its query id.
fn discovery_datagram(kind: DatagramKind, id: u32, out: &mut [u8]) -> usize {
    DatagramHeader { kind, flags: 0, session_id: id, seq: 0, ack: 0, sack: 0, window: 0, payload_len: 0 }
        .emit(out)
}

/// Find the skiff targets on the segment of interface `iface`: broadcast a Discover and
/// collect the MACs of the targets whose Offers come back within `wait` (each once, in the
/// order they answered).
pub fn discover(iface: &str, wait: Duration) -> io::Result<Vec<Mac>> {
    let ring = RingConfig { rx_slots: 16, tx_slots: 2, ..RingConfig::default() };
    let mut socket = PacketSocket::open(iface, ETHERTYPE, ring)?;
    let query = loop {
        let id = u32::from_le_bytes(rt::random::bytes::<4>()?);
        if id != 0 {
            break id;
        }
    };
    socket.attach_filter(&bpf::all_of(&[
        (bpf::load_half(12), u32::from(ETHERTYPE)),
        (bpf::load_byte(KIND_OFFSET), DatagramKind::Offer as u32),
        (bpf::load_word(SESSION_ID_OFFSET), u32::from_be_bytes(query.to_le_bytes())),
    ]))?;
    socket.queue_with(BROADCAST, |out| discovery_datagram(DatagramKind::Discover, query, out))?;
    socket.flush()?;
    let deadline = Instant::now() + wait;
    let mut found: Vec<Mac> = Vec::new();
    loop {
        socket.receive(|src, datagram| {
            let offer = DatagramHeader::parse(datagram)
                .is_ok_and(|(h, _)| h.kind == DatagramKind::Offer && h.session_id == query);
            if offer && !found.contains(&src) {
                found.push(src);
            }
        });
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(found);
        }
        crate::wait_fd(socket.as_raw_fd(), false, Some(left))?;
    }
}

/// A session's byte stream over raw Ethernet.
pub struct EthStream {
    socket: PacketSocket,
    peer: Mac,
    stream: DatagramStream,
    epoch: Instant,
    /// While this lives, the listener that opened the session knows it (a target's side).
    _alive: Option<Arc<()>>,
}

impl EthStream {
    /// A session `session_id` with `peer` over `socket`, both sides starting their sequence
    /// numbers at zero. `config.payload_bytes_max` is lowered to what the interface's MTU
    /// carries. The socket is filtered to the session.
    pub fn open(
        mut socket: PacketSocket,
        peer: Mac,
        session_id: u32,
        config: &ReliableConfig,
    ) -> io::Result<EthStream> {
        let fits = socket.mtu().saturating_sub(DATAGRAM_HEADER_LEN);
        if fits == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("an MTU of {} carries no datagram", socket.mtu()),
            ));
        }
        let config = ReliableConfig {
            payload_bytes_max: config.payload_bytes_max.min(u16::try_from(fits).unwrap_or(u16::MAX)),
            ..*config
        };
        // Filters load big-endian words: the session id is little-endian on the wire.
        let session_be = u32::from_be_bytes(session_id.to_le_bytes());
        socket.attach_filter(&bpf::all_of(&[
            (bpf::load_half(12), u32::from(ETHERTYPE)),
            (bpf::load_word(SESSION_ID_OFFSET), session_be),
            (bpf::load_word(6), u32::from_be_bytes([peer[0], peer[1], peer[2], peer[3]])),
            (bpf::load_half(10), u32::from(u16::from_be_bytes([peer[4], peer[5]]))),
        ]))?;
        Ok(EthStream {
            socket,
            peer,
            stream: DatagramStream::new(&config, session_id, 0, 0),
            epoch: Instant::now(),
            _alive: None,
        })
    }

    /// An initiator's session with the target at `peer` on interface `iface`, under a session
    /// id drawn at random. Nothing is sent until the first write.
    pub fn connect(iface: &str, peer: Mac, config: &EthConfig) -> io::Result<EthStream> {
        let socket = PacketSocket::open(iface, ETHERTYPE, config.ring)?;
        let session_id = loop {
            let id = u32::from_le_bytes(rt::random::bytes::<4>()?);
            if id != 0 {
                break id;
            }
        };
        EthStream::open(socket, peer, session_id, &config.reliable)
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Take in what arrived, fire due timers, send what is due. Call whenever the socket is
    /// readable or [`timeout`](Self::timeout) has passed (`recv` and `send` call it too).
    pub fn drive(&mut self) -> io::Result<()> {
        let now = self.now_us();
        let EthStream { socket, peer, stream, .. } = self;
        let from = *peer;
        socket.receive(|src, datagram| {
            if src == from {
                stream.handle_datagram(now, datagram);
            }
        });
        if stream.poll_timeout().is_some_and(|due| due <= now) {
            stream.handle_timeout(now);
        }
        // Straight into the transmit ring; when it is full, what is left goes at the next drive.
        while let Some(n) = socket.queue_with(from, |room| stream.poll_transmit(now, room).unwrap_or(0))? {
            if n == 0 {
                break;
            }
        }
        socket.flush()
    }

    /// How long until the stream's next timer (retransmission, delayed ack, keepalive).
    pub fn timeout(&self) -> Option<Duration> {
        self.stream.poll_timeout().map(|due| Duration::from_micros(due.saturating_sub(self.now_us())))
    }

    pub fn counters(&self) -> Counters {
        self.stream.counters()
    }

    pub fn socket(&self) -> &PacketSocket {
        &self.socket
    }

    pub fn session_id(&self) -> u32 {
        self.stream.session_id()
    }

    /// The peer, for logs: `eth:IFACE/MAC#SESSION`.
    pub fn describe(&self) -> String {
        format!("eth:{}/{}#{:08x}", self.socket.iface(), format_mac(&self.peer), self.session_id())
    }

    fn dead_error(&self) -> Option<io::Error> {
        match self.stream.state() {
            State::Dead(reason) => Some(io::Error::new(
                io::ErrorKind::ConnectionReset,
                format!("raw-Ethernet session ended: {reason:?}"),
            )),
            _ => None,
        }
    }
}

impl FrameIo for EthStream {
    fn recv(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        self.drive()?;
        let n = self.stream.read(bufs);
        if n > 0 {
            return Ok(n);
        }
        if let Some(e) = self.dead_error() {
            return Err(e);
        }
        if self.stream.peer_closed() {
            return Ok(0);
        }
        Err(io::ErrorKind::WouldBlock.into())
    }

    fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let n = self.stream.write(bufs);
        self.drive()?;
        if n > 0 || bufs.iter().all(|b| b.is_empty()) {
            return Ok(n);
        }
        // The send buffer is full until acknowledgements arrive: the caller waits for the
        // socket to be readable, not writable.
        Err(self.dead_error().unwrap_or_else(|| io::ErrorKind::WouldBlock.into()))
    }

    fn buffered_recv(&self) -> bool {
        self.stream.readable()
    }
}

impl AsRawFd for EthStream {
    fn as_raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}

/// A target's listener on one interface: opens a session for each new initiator.
pub struct EthListener {
    socket: PacketSocket,
    iface: String,
    config: EthConfig,
    /// The sessions opened and still alive, by (initiator MAC, session id): a repeated first
    /// datagram of one of them (its ack was lost) must not open it twice.
    live: HashMap<(Mac, u32), Weak<()>>,
    ready: Vec<EthStream>,
}

impl EthListener {
    pub fn bind(iface: &str, config: EthConfig) -> io::Result<EthListener> {
        let listen_ring = RingConfig { rx_slots: 64, tx_slots: 8, ..config.ring };
        let mut socket = PacketSocket::open(iface, ETHERTYPE, listen_ring)?;
        // Only first datagrams (Data with sequence number 0) and Discovers.
        socket.attach_filter(&[
            bpf::load_half(12),
            bpf::require(u32::from(ETHERTYPE), 6),
            bpf::load_byte(KIND_OFFSET),
            Bpf(0x15, 3, 0, DatagramKind::Discover as u32), // Discover: accept
            bpf::require(DatagramKind::Data as u32, 3),
            bpf::load_word(SEQ_OFFSET),
            bpf::require(0, 1),
            bpf::accept(),
            bpf::reject(),
        ])?;
        Ok(EthListener { socket, iface: iface.to_owned(), config, live: HashMap::new(), ready: Vec::new() })
    }

    pub fn iface(&self) -> &str {
        &self.iface
    }

    pub fn mac(&self) -> Mac {
        self.socket.mac()
    }

    /// The next new session, if one has started (`WouldBlock` otherwise).
    pub fn accept(&mut self) -> io::Result<EthStream> {
        if self.ready.is_empty() {
            let mut first: Vec<(Mac, Vec<u8>)> = Vec::new();
            self.socket.receive(|src, datagram| first.push((src, datagram.to_vec())));
            self.live.retain(|_, alive| alive.strong_count() > 0);
            let mut offered = false;
            for (src, datagram) in first {
                // A datagram that does not parse is not a session's start: the session's own
                // checksum would refuse it too.
                let Ok((h, _)) = DatagramHeader::parse(&datagram) else { continue };
                if h.kind == DatagramKind::Discover {
                    // Answer with an Offer; a full ring drops it, and the asker asks again.
                    self.socket
                        .queue_with(src, |out| discovery_datagram(DatagramKind::Offer, h.session_id, out))?;
                    offered = true;
                    continue;
                }
                if h.session_id == 0 || self.live.contains_key(&(src, h.session_id)) {
                    continue;
                }
                let socket = PacketSocket::open(&self.iface, ETHERTYPE, self.config.ring)?;
                let mut stream = EthStream::open(socket, src, h.session_id, &self.config.reliable)?;
                stream.stream.handle_datagram(stream.now_us(), &datagram);
                let alive = Arc::new(());
                self.live.insert((src, h.session_id), Arc::downgrade(&alive));
                stream._alive = Some(alive);
                self.ready.push(stream);
            }
            if offered {
                self.socket.flush()?;
            }
            self.ready.reverse();
        }
        self.ready.pop().ok_or_else(|| io::ErrorKind::WouldBlock.into())
    }
}

impl AsRawFd for EthListener {
    fn as_raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}
