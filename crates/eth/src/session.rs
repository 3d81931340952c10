//! Sessions of skiff's native protocol over raw Ethernet: `dgram::reliable`'s
//! [`DatagramStream`] driven over a [`PacketSocket`] (or, with `SKIFF_ETH_DRIVER=xdp`, an
//! [`XdpSocket`] where the interface allows: [`Driver`]), behind [`FrameIo`], so that everything
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
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use dgram::bundle::{is_probe, Bundle, BundleConfig, PathEvent};
use dgram::reliable::split::Splitter;
use dgram::reliable::{Counters, DatagramStream, ReadCursor, ReliableConfig, State};
use wire::datagram::{DatagramHeader, DatagramKind, DATAGRAM_HEADER_LEN};

use crate::packet::{
    bpf, slot_bytes_for, Bpf, Mac, PacketSocket, RingConfig, BROADCAST, ETHERTYPE, ETH_HEADER_LEN,
};
use crate::xdp::XdpSocket;
use transport::endpoint::format_mac;
use transport::endpoint::ETH_FRAME_MAX;
use transport::{EthOptions, FrameIo};

/// Where the datagram header's fields sit in a frame (after the 14-byte Ethernet header;
/// docs/PROTOCOL.md, section 16).
const KIND_OFFSET: u32 = (ETH_HEADER_LEN + 1) as u32;
const SESSION_ID_OFFSET: u32 = (ETH_HEADER_LEN + 4) as u32;
const SEQ_OFFSET: u32 = (ETH_HEADER_LEN + 8) as u32;

/// A target's keepalive (`ReliableConfig::keepalive_us` of the sessions it accepts): 30 s.
/// An initiator's lane is driven only while its application calls it, so a lane left idle
/// answers nothing; the target must keep its session (as a TCP target keeps an idle
/// connection) and still, in the end, free the session of an initiator that is gone.
pub const TARGET_KEEPALIVE_US: u64 = 30_000_000;

/// The least reordering window of a bundled session's stream (`ReliableConfig::reorder_window_us`;
/// SRTT / 4 when that is more).
const BUNDLE_REORDER_WINDOW_US: u64 = 100;

/// What carries a session's frames on each interface: AF_PACKET's memory-mapped rings
/// ([`PacketSocket`], the default, everywhere) or AF_XDP ([`XdpSocket`]) where the interface
/// allows (one receive queue, nothing else of this process bound to it); a session that
/// cannot have AF_XDP falls back to AF_PACKET. The endpoint option's own type.
pub use transport::EthDriver as Driver;

/// The rings and the delivery settings of raw-Ethernet sessions.
///
/// Each setting comes from the endpoint's options ([`EthOptions`]: `eth:IFACE,driver=xdp`,
/// the target's `--eth-options` and `eth-options` in its file) where they name it; otherwise
/// from the environment variable beside it below, if set, which is how a whole process (a
/// benchmark, a test) changes a default without touching its endpoints; otherwise from the
/// built-in default ([`EthConfig::default`], which reads no environment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EthConfig {
    /// AF_PACKET or AF_XDP (`driver=`, `SKIFF_ETH_DRIVER=packet|xdp`) for sessions; listeners
    /// and discovery always use AF_PACKET.
    pub driver: Driver,
    /// Each session's AF_PACKET socket (small rings: a session has at most its window in
    /// flight); `qdisc=on` (`SKIFF_ETH_QDISC=on`) goes through the interface's queueing
    /// discipline.
    pub ring: RingConfig,
    /// `frame=` (`SKIFF_ETH_FRAME=BYTES`) sets `payload_bytes_max`.
    pub reliable: ReliableConfig,
    /// Read data in data messages (Place datagrams placed by tag and offset; docs/PROTOCOL.md
    /// 16.9), offered by an initiator and agreed by a target when both have it on
    /// (`data-messages=off`, `SKIFF_ETH_DATA_MESSAGES=off`: read data rides the byte stream).
    pub data_messages: bool,
    /// Two 4 KiB data segments share a jumbo frame (Tyche's data-message batching;
    /// `data-batching=off`, `SKIFF_ETH_DATA_BATCHING=off`: each data message in a frame of its
    /// own).
    pub data_batching: bool,
    /// Each datagram this side sends has a checksum over its payload too (`crc=full`, the
    /// default), or over its header alone (`crc=header`, `SKIFF_ETH_CRC=header`): for a link
    /// that is known to go from memory to memory, such as a veth pair between two namespaces
    /// of one host (where TCP, too, skips its checksum), and that nothing bridges onto a wire.
    /// Each side chooses for what it sends; a receiver checks what the sender covered.
    pub payload_crc: bool,
}

impl Default for EthConfig {
    /// The built-in settings, which neither an endpoint nor the environment changed.
    fn default() -> EthConfig {
        EthConfig {
            driver: Driver::Packet,
            // Past the interface's queueing discipline (PACKET_QDISC_BYPASS), which costs a
            // fifth of the CPU per I/O at QD 32 even on veth's noqueue; qdisc=on goes through
            // it, for links shaped with `tc` (bench/ethernet.py --shape).
            // Rings of what 192 slots of a jumbo frame take (2.25 MiB), split 2:1: 384 and 192
            // slots of 4 KiB at MTU 1,500 (three frames to a 4 KiB read), 128 and 64 at 9,000,
            // and at a larger MTU fewer, larger slots (32 and 16 at 65,535), so that the frames
            // in flight stay in the caches. (With 128 and 64 slots of 68 KiB, 4 KiB reads at
            // QD 128 over a 65,535-MTU veth pair cost 6.8 µs of CPU per I/O; with 32 and 16,
            // and the stream's buffers below cut alike, 4.7-5.0 µs; one run of each.)
            ring: RingConfig {
                rx_slots: 384,
                tx_slots: 192,
                bytes_max: (128 + 64) * slot_bytes_for(JUMBO_MTU, 4096),
                qdisc_bypass: true,
                ..RingConfig::default()
            },
            // Datagrams as large as the interface's MTU carries (the payload is lowered to the
            // MTU when a session opens), and a window that keeps a 64-deep queue of 4 KiB
            // requests moving. On a segment round trips are tens of microseconds: a lost
            // datagram with nothing behind it (a lone caravan) waits out the minimum RTO, so
            // it is 250 µs, still above the 100 µs delayed ack plus a round trip. A payload of
            // 8,972 bytes fills a 9,000-byte jumbo frame, where two 4 KiB data messages share
            // one frame, as in Tyche's data-message batching; at veth's largest MTU, 65,535,
            // fifteen share one. A data segment is cut at a multiple of 4 KiB only when a
            // datagram holds one: below 4,108 bytes (4 KiB and a segment header) a 4 KiB read
            // takes two datagrams.
            // The stream keeps as many datagrams as 1.1 MiB holds (`slots_for`): 512 each way at
            // MTU 1,500, where a QD of 128 4 KiB reads is 384 datagrams of data, 128 at 9,000,
            // 16 at 65,535.
            reliable: ReliableConfig {
                payload_bytes_max: ETH_FRAME_MAX,
                send_slots: 512,
                recv_slots: 512,
                rto_min_us: 250,
                ..ReliableConfig::default()
            },
            data_messages: true,
            data_batching: true,
            payload_crc: true,
        }
    }
}

impl EthConfig {
    /// The settings of sessions of an endpoint with `options`: each from the options, else
    /// from its environment variable, else the default.
    pub fn for_endpoint(options: &EthOptions) -> EthConfig {
        EthConfig::resolve(options, &|name| std::env::var(name).ok())
    }

    /// [`for_endpoint`](Self::for_endpoint) with the environment read through `env`. A
    /// variable whose value means nothing is warned about and left out.
    pub fn resolve(options: &EthOptions, env: &dyn Fn(&str) -> Option<String>) -> EthConfig {
        let mut from_env = EthOptions::default();
        for (name, key) in ENV_VARIABLES {
            let Some(v) = env(name) else { continue };
            match EthOptions::parse(&format!("{key}={v}")) {
                Ok(o) => from_env = from_env.or(o),
                Err(e) => tracing::warn!(variable = name, value = %v, error = %e, "ignored"),
            }
        }
        let o = options.or(from_env);
        let d = EthConfig::default();
        EthConfig {
            driver: o.driver.unwrap_or(d.driver),
            ring: RingConfig { qdisc_bypass: !o.qdisc.unwrap_or(!d.ring.qdisc_bypass), ..d.ring },
            reliable: ReliableConfig {
                payload_bytes_max: o.frame.unwrap_or(d.reliable.payload_bytes_max),
                ..d.reliable
            },
            data_messages: o.data_messages.unwrap_or(d.data_messages),
            data_batching: o.data_batching.unwrap_or(d.data_batching),
            payload_crc: o.payload_crc.unwrap_or(d.payload_crc),
        }
    }
}

/// The environment variables that fill in what an endpoint's options leave out, and the option
/// each stands for.
const ENV_VARIABLES: [(&str, &str); 6] = [
    ("SKIFF_ETH_DRIVER", "driver"),
    ("SKIFF_ETH_QDISC", "qdisc"),
    ("SKIFF_ETH_FRAME", "frame"),
    ("SKIFF_ETH_DATA_MESSAGES", "data-messages"),
    ("SKIFF_ETH_DATA_BATCHING", "data-batching"),
    ("SKIFF_ETH_CRC", "crc"),
];

/// A real NIC's jumbo MTU, by which rings and stream buffers are sized.
const JUMBO_MTU: usize = 9000;

/// The most bytes of datagrams a session's stream buffers each way: 128 payloads of a jumbo
/// frame (1.1 MiB).
const STREAM_BUFFER_BYTES: usize = 128 * (JUMBO_MTU - DATAGRAM_HEADER_LEN);

/// The fewest datagrams a stream's buffer holds each way, however large they are.
const STREAM_SLOTS_MIN: u32 = 16;

/// Of `slots` datagrams of `payload` bytes, as many as [`STREAM_BUFFER_BYTES`] holds (a power
/// of two, at least [`STREAM_SLOTS_MIN`], at most `slots`): a session on a large MTU keeps fewer,
/// larger buffers, so that what is in flight stays in the caches.
fn slots_for(slots: u32, payload: u16) -> u32 {
    let fit = u32::try_from(STREAM_BUFFER_BYTES / usize::from(payload.max(1))).unwrap_or(u32::MAX);
    let fit = fit.max(STREAM_SLOTS_MIN);
    slots.min(1 << fit.ilog2())
}

/// A random id that is not 0 (which no session or query uses): a session's, or a Discover's.
fn random_id() -> io::Result<u32> {
    loop {
        let id = u32::from_le_bytes(rt::random::bytes::<4>()?);
        if id != 0 {
            return Ok(id);
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
    let query = random_id()?;
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
        transport::wait_fd(socket.as_raw_fd(), false, Some(left))?;
    }
}

/// What one path (interface) of a session did: its share of the traffic, its probes' round
/// trips and answers, and how often it was left out ([`dgram::bundle::PathCounters`], with the
/// interface's name).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct PathStats {
    pub iface: String,
    /// `af_packet` or `af_xdp`: what carries its frames.
    pub driver: &'static str,
    /// Whether datagrams go out on it now.
    pub up: bool,
    pub datagrams_sent: u64,
    pub datagrams_received: u64,
    pub probes_sent: u64,
    pub probes_answered: u64,
    /// Smoothed round trip of its probes (0 before the first answer).
    pub srtt_us: u64,
    /// How often it was left out (its interface refused to send, its probes went unanswered,
    /// or it fell silent while another path did not), and how often it came back.
    pub downs: u64,
    pub rejoins: u64,
}

/// One interface's datagrams, as a session's driver needs them: what AF_PACKET and AF_XDP
/// sockets do ([`Link`]), and what the simulator's lossy link does (crates/sim), so that the
/// seeded simulation runs this driver, bundles and all, rather than a copy of it.
pub trait DatagramSocket {
    /// Hand each datagram that has arrived (what follows its Ethernet header) to `f` with its
    /// sender's MAC; returns how many there were.
    fn receive(&mut self, f: impl FnMut(Mac, &[u8])) -> usize;
    /// Queue one datagram to `dst`, written by `fill` into a transmit slot (it returns the
    /// length; 0 queues nothing): `Ok(Some(len))`, or `Ok(None)` when no slot is free.
    fn queue_with(&mut self, dst: Mac, fill: impl FnOnce(&mut [u8]) -> usize) -> io::Result<Option<usize>>;
    /// Hand what was queued to the wire.
    fn flush(&mut self) -> io::Result<()>;
    /// Whether frames a flush left behind (the device was busy) wait to go.
    fn pending(&self) -> bool;
    /// The error an interface going down left on the socket, taken.
    fn take_error(&self) -> io::Result<Option<io::Error>>;
    /// The largest datagram the interface carries, Ethernet header excluded.
    fn mtu(&self) -> usize;
    fn iface(&self) -> &str;
    /// What carries the frames, for reports: `af_packet`, `af_xdp`, or the simulator's.
    fn driver_name(&self) -> &'static str;
    /// Let through only session `session_id`'s datagrams, and only `peer`'s once it is known,
    /// where the socket can filter (the driver checks the peer's MAC itself in any case).
    fn filter(&mut self, session_id: u32, peer: Option<Mac>) -> io::Result<()>;
    /// The descriptor that is readable when datagrams arrive, for the caller's poll (`None`
    /// where nothing is waited on that way: the simulator steps its sessions).
    fn fd(&self) -> Option<RawFd>;
}

/// Deliberately broken variants of the driver, for the simulator's proof that it catches them.
/// Only the feature `mutations` (which only `skiff-sim`'s own feature turns on) compiles them
/// in; without it the check is a constant `false` and folds away.
#[cfg(feature = "mutations")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mutation {
    #[default]
    None,
    /// The stream's timers never fire: a lost datagram with nothing sent behind it is never
    /// sent again, and a silent peer is never declared dead.
    SkipTimers,
}

/// Where a session's driver reads the time: microseconds since an epoch of its own.
pub trait Clock {
    fn now_us(&self) -> u64;
}

/// The clock of real sessions: monotonic, from when the session opened.
#[derive(Debug, Clone, Copy)]
pub struct Monotonic(Instant);

impl Monotonic {
    pub fn new() -> Monotonic {
        Monotonic(Instant::now())
    }
}

impl Default for Monotonic {
    fn default() -> Monotonic {
        Monotonic::new()
    }
}

impl Clock for Monotonic {
    fn now_us(&self) -> u64 {
        self.0.elapsed().as_micros() as u64
    }
}

/// A path's socket on a real interface, by its [`Driver`].
pub enum Link {
    Packet(PacketSocket),
    Xdp(Box<XdpSocket>),
}

impl Link {
    /// A socket for session `session_id` on `iface`, as `config` asks: AF_XDP where it can be
    /// had, AF_PACKET otherwise (the first fallback of the process is a warning, later ones
    /// are debug lines).
    fn open(iface: &str, session_id: u32, config: &EthConfig) -> io::Result<Link> {
        if config.driver == Driver::Xdp {
            match XdpSocket::open(iface, session_id) {
                Ok(s) => return Ok(Link::Xdp(Box::new(s))),
                Err(e) => {
                    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
                    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        tracing::warn!(iface, error = %e, "AF_XDP unavailable; raw-Ethernet sessions fall back to AF_PACKET");
                    } else {
                        tracing::debug!(iface, error = %e, "AF_XDP unavailable for this session; AF_PACKET");
                    }
                }
            }
        }
        Ok(Link::Packet(PacketSocket::open(iface, ETHERTYPE, config.ring)?))
    }

    fn driver(&self) -> Driver {
        match self {
            Link::Packet(_) => Driver::Packet,
            Link::Xdp(_) => Driver::Xdp,
        }
    }
}

impl DatagramSocket for Link {
    fn receive(&mut self, f: impl FnMut(Mac, &[u8])) -> usize {
        match self {
            Link::Packet(s) => s.receive(f),
            Link::Xdp(s) => s.receive(f),
        }
    }

    fn queue_with(&mut self, dst: Mac, fill: impl FnOnce(&mut [u8]) -> usize) -> io::Result<Option<usize>> {
        match self {
            Link::Packet(s) => s.queue_with(dst, fill),
            Link::Xdp(s) => s.queue_with(dst, fill),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Link::Packet(s) => s.flush(),
            Link::Xdp(s) => s.flush(),
        }
    }

    fn take_error(&self) -> io::Result<Option<io::Error>> {
        match self {
            Link::Packet(s) => s.take_error(),
            Link::Xdp(s) => s.take_error(),
        }
    }

    fn pending(&self) -> bool {
        match self {
            Link::Packet(s) => s.pending(),
            Link::Xdp(s) => s.pending(),
        }
    }

    fn iface(&self) -> &str {
        match self {
            Link::Packet(s) => s.iface(),
            Link::Xdp(s) => s.iface(),
        }
    }

    fn mtu(&self) -> usize {
        match self {
            Link::Packet(s) => s.mtu(),
            Link::Xdp(s) => s.mtu(),
        }
    }

    fn driver_name(&self) -> &'static str {
        self.driver().name()
    }

    fn fd(&self) -> Option<RawFd> {
        Some(self.as_raw_fd())
    }

    /// AF_PACKET: a kernel filter on the session id and, once known, the peer's MAC. An
    /// AF_XDP socket gets only its session's frames from the XDP program already.
    fn filter(&mut self, session_id: u32, peer: Option<Mac>) -> io::Result<()> {
        let Link::Packet(socket) = self else { return Ok(()) };
        // Filters load big-endian words: the session id is little-endian on the wire.
        let session_be = u32::from_be_bytes(session_id.to_le_bytes());
        let mut checks =
            vec![(bpf::load_half(12), u32::from(ETHERTYPE)), (bpf::load_word(SESSION_ID_OFFSET), session_be)];
        if let Some(peer) = peer {
            checks.push((bpf::load_word(6), u32::from_be_bytes([peer[0], peer[1], peer[2], peer[3]])));
            checks.push((bpf::load_half(10), u32::from(u16::from_be_bytes([peer[4], peer[5]]))));
        }
        socket.attach_filter(&bpf::all_of(&checks))
    }
}

impl AsRawFd for Link {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Link::Packet(s) => s.as_raw_fd(),
            Link::Xdp(s) => s.as_raw_fd(),
        }
    }
}

/// One interface of a session: a socket filtered to the session, and the peer's MAC on it.
struct Path<S> {
    socket: S,
    /// `None` until the peer is found on this link (a bundle's other interfaces).
    peer: Option<Mac>,
    /// Frames were queued on the socket in this drive.
    queued: bool,
}

impl<S: DatagramSocket> Path<S> {
    /// The filter for the session's datagrams on this path: from its peer once that is known.
    fn filter(&mut self, session_id: u32) -> io::Result<()> {
        self.socket.filter(session_id, self.peer)
    }
}

/// An epoll set of the descriptors `fds`: readable when any of them is (a bundle's sockets,
/// waited on as one).
fn poll_set(fds: impl IntoIterator<Item = RawFd>) -> io::Result<OwnedFd> {
    // SAFETY: plain epoll_create1; the descriptor is owned below.
    let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new descriptor that nothing else owns.
    let set = unsafe { OwnedFd::from_raw_fd(raw) };
    for fd in fds {
        let mut event = libc::epoll_event { events: libc::EPOLLIN as u32, u64: 0 };
        // SAFETY: both descriptors are open; `event` is a valid epoll_event.
        if unsafe { libc::epoll_ctl(set.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(set)
}

/// A session's byte stream over raw Ethernet, on one interface or on a bundle of several.
///
/// A bundle's paths share one [`DatagramStream`] (one sequence space); [`Bundle`] decides which
/// path each drive's datagrams take (the working one that has carried the fewest bytes),
/// probes every path,
/// and leaves out one that stops working until it answers again; what was lost on it the
/// stream retransmits on the others, as it retransmits any loss (docs/PROTOCOL.md, 16.8).
///
/// Generic over its sockets and its clock so that the simulator drives this same code over
/// its seeded lossy links and virtual time ([`EthStream::over`]); a real session is an
/// `EthStream` of [`Link`]s on the [`Monotonic`] clock.
pub struct EthStream<S: DatagramSocket = Link, C: Clock = Monotonic> {
    paths: Vec<Path<S>>,
    bundle: Bundle,
    /// A bundle's sockets in one epoll set, readable when any of them is; a session on one
    /// interface is waited on through its socket.
    poller: Option<OwnedFd>,
    stream: DatagramStream,
    /// Follows the outgoing frames, sending completion caravans' read data as data messages
    /// once the connection agreed to them (a target's side).
    split: Splitter,
    /// Data messages may be used (offered, or agreed to) on this session.
    data_messages: bool,
    clock: C,
    #[cfg(feature = "mutations")]
    mutation: Mutation,
    /// While this lives, the listener that opened the session knows it (a target's side).
    _alive: Option<Arc<()>>,
}

impl EthStream {
    /// A session `session_id` with `peer` over `socket`, both sides starting their sequence
    /// numbers at zero. `config.payload_bytes_max` is lowered to what the interface's MTU
    /// carries. The socket is filtered to the session.
    pub fn open(
        socket: PacketSocket,
        peer: Mac,
        session_id: u32,
        config: &ReliableConfig,
    ) -> io::Result<EthStream> {
        let config = EthConfig { reliable: *config, ..EthConfig::default() };
        EthStream::open_bundle(vec![(Link::Packet(socket), Some(peer))], session_id, &config, false)
    }

    /// A real session over one socket per interface (see [`over`](Self::over)), sequence
    /// numbers from zero, on the monotonic clock.
    fn open_bundle(
        sockets: Vec<(Link, Option<Mac>)>,
        session_id: u32,
        eth: &EthConfig,
        seeks: bool,
    ) -> io::Result<EthStream> {
        EthStream::over(sockets, session_id, (0, 0), eth, seeks, Monotonic::new())
    }

    /// An initiator's session with the target at `peer` on the first of `ifaces`, under a
    /// session id drawn at random; the other interfaces join it as a bundle once the target
    /// answers on them. Nothing is sent until the first write.
    pub fn connect(ifaces: &[String], peer: Mac, config: &EthConfig) -> io::Result<EthStream> {
        let session_id = random_id()?;
        let mut sockets = Vec::with_capacity(ifaces.len());
        for (i, iface) in ifaces.iter().enumerate() {
            sockets.push((Link::open(iface, session_id, config)?, (i == 0).then_some(peer)));
        }
        EthStream::open_bundle(sockets, session_id, config, true)
    }
}

impl<S: DatagramSocket, C: Clock> EthStream<S, C> {
    /// A session over one socket per interface, each with its peer's MAC where known (one at
    /// least), its stream starting at sequence numbers `initial` (this side's, the peer's).
    /// `seeks`: look for the peer on the other interfaces (the initiator's side).
    /// `eth.reliable.payload_bytes_max` is lowered to what the smallest MTU carries.
    pub fn over(
        sockets: Vec<(S, Option<Mac>)>,
        session_id: u32,
        initial: (u32, u32),
        eth: &EthConfig,
        seeks: bool,
        clock: C,
    ) -> io::Result<EthStream<S, C>> {
        let config = &eth.reliable;
        let mtu = sockets.iter().map(|(s, _)| s.mtu()).min().unwrap_or(0);
        let fits = mtu.saturating_sub(DATAGRAM_HEADER_LEN);
        if fits == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("an MTU of {mtu} carries no datagram"),
            ));
        }
        let payload = config.payload_bytes_max.min(u16::try_from(fits).unwrap_or(u16::MAX));
        let (send_slots, recv_slots) =
            (slots_for(config.send_slots, payload), slots_for(config.recv_slots, payload));
        let config = ReliableConfig {
            payload_bytes_max: payload,
            send_slots,
            recv_slots,
            payload_crc: eth.payload_crc,
            // The peer runs on the same link, so its window is ours.
            peer_window_initial: config
                .peer_window_initial
                .min(u16::try_from(recv_slots).unwrap_or(u16::MAX)),
            // Over several links datagrams arrive in the order the links' queues decide: a
            // datagram overtaken by a few sent just after it is not lost for that.
            reorder_window_us: if sockets.len() > 1 {
                config.reorder_window_us.max(BUNDLE_REORDER_WINDOW_US)
            } else {
                config.reorder_window_us
            },
            ..*config
        };
        let known: Vec<bool> = sockets.iter().map(|(_, peer)| peer.is_some()).collect();
        let mut paths = Vec::with_capacity(sockets.len());
        for (socket, peer) in sockets {
            let mut path = Path { socket, peer, queued: false };
            path.filter(session_id)?;
            paths.push(path);
        }
        let poller = match paths.iter().map(|p| p.socket.fd()).collect::<Option<Vec<RawFd>>>() {
            Some(fds) if fds.len() > 1 => Some(poll_set(fds)?),
            _ => None,
        };
        Ok(EthStream {
            paths,
            bundle: Bundle::new(BundleConfig::default(), session_id, &known, seeks),
            poller,
            stream: DatagramStream::new(&config, session_id, initial.0, initial.1),
            split: Splitter::new(eth.data_batching),
            data_messages: eth.data_messages,
            clock,
            #[cfg(feature = "mutations")]
            mutation: Mutation::None,
            _alive: None,
        })
    }

    /// Plant a bug, for the simulator's proof that it catches it (feature `mutations`).
    #[cfg(feature = "mutations")]
    pub fn set_mutation(&mut self, mutation: Mutation) {
        self.mutation = mutation;
    }

    #[cfg(feature = "mutations")]
    fn planted_skip_timers(&self) -> bool {
        self.mutation == Mutation::SkipTimers
    }

    #[cfg(not(feature = "mutations"))]
    #[inline(always)]
    fn planted_skip_timers(&self) -> bool {
        false
    }

    fn now_us(&self) -> u64 {
        self.clock.now_us()
    }

    /// Take in what arrived, fire due timers, send what is due. Call whenever the socket is
    /// readable or [`timeout`](Self::timeout) has passed (`recv` and `send` call it too).
    pub fn drive(&mut self) -> io::Result<()> {
        self.drive_into(None)
    }

    /// As [`drive`](Self::drive); what arrives in order while `to` has room goes straight from
    /// the receive ring into it (`DatagramStream::handle_datagram_into`): one copy of received
    /// bytes instead of two.
    fn drive_into(&mut self, mut to: Option<&mut ReadCursor<'_, '_>>) -> io::Result<()> {
        let now = self.now_us();
        let bundled = self.paths.len() > 1;
        let mut arrived = 0;
        let mut probes: Vec<(usize, Mac, DatagramHeader)> = Vec::new();
        let EthStream { paths, stream, bundle, .. } = self;
        for (i, path) in paths.iter_mut().enumerate() {
            let peer = path.peer;
            let mut data = 0u64;
            arrived += path.socket.receive(|src, datagram| {
                if peer.is_some_and(|p| p != src) {
                    return;
                }
                if is_probe(datagram) {
                    // The link layer's: checked here, the stream never sees them.
                    if let Ok((h, _)) = DatagramHeader::parse(datagram) {
                        probes.push((i, src, h));
                    }
                } else if peer.is_some() {
                    // Until its peer is known, a path takes nothing but probes.
                    match to.as_deref_mut() {
                        Some(to) => {
                            stream.handle_datagram_into(now, datagram, to);
                        }
                        None => stream.handle_datagram(now, datagram),
                    }
                    data += 1;
                }
            });
            bundle.on_received(i, now, data);
        }
        for (i, src, h) in probes {
            let answer = self.bundle.on_probe(i, now, &h);
            let path = &mut self.paths[i];
            if path.peer.is_none() && self.bundle.known(i) {
                path.peer = Some(src);
                path.filter(self.stream.session_id())?;
            }
            if let Some(ack) = answer {
                path.queued |= path.socket.queue_with(src, |out| ack.emit(out))?.is_some();
            }
        }
        if bundled {
            if arrived == 0 {
                // Woken with nothing to read: perhaps by the error an interface going down
                // leaves on its socket, which keeps it ready until taken.
                for (i, path) in self.paths.iter().enumerate() {
                    if matches!(path.socket.take_error(), Ok(Some(_))) {
                        self.bundle.on_send_failed(i, now);
                    }
                }
            }
            let stream = &self.stream;
            self.bundle.on_delivered(now, |seq| stream.delivered(seq));
            self.bundle.check(now, stream.rto_estimate_us());
        }
        if self.stream.poll_timeout().is_some_and(|due| due <= now) && !self.planted_skip_timers() {
            self.stream.handle_timeout(now);
        }
        // A caravan head the splitter took when the send buffer was full goes as soon as
        // there is room (acknowledgements just freed some).
        if self.split.pending() {
            self.split.flush(&mut self.stream);
        }
        // What the stream has to send goes on one path, straight into its transmit ring; when
        // the ring is full, what is left goes at the next drive.
        let EthStream { paths, stream, bundle, .. } = self;
        if let Some(i) = bundle.pick() {
            let path = &mut paths[i];
            let to = path.peer.expect("a path the bundle picks has a peer");
            let (mut sent, mut bytes, mut sequenced) = (0, 0, None);
            while let Some(n) = path.socket.queue_with(to, |room| {
                let n = stream.poll_transmit(now, room).unwrap_or(0);
                // Data and Close are acknowledged; a bare ack expects no answer. Only a bundle
                // watches them (its silence rule); a lone path skips the parsing.
                if bundled && n > 0 && DatagramKind::from_u8(room[1]).is_some_and(DatagramKind::is_sequenced)
                {
                    let seq = u32::from_le_bytes([room[8], room[9], room[10], room[11]]);
                    bundle.on_sequenced(seq);
                    sequenced = Some(seq);
                }
                n
            })? {
                if n == 0 {
                    break;
                }
                sent += 1;
                bytes += n as u64;
            }
            if sent > 0 {
                path.queued = true;
                bundle.on_sent(i, now, sent, bytes, sequenced);
            }
        }
        while let Some((i, probe)) = self.bundle.poll_probe(now) {
            let path = &mut self.paths[i];
            let to = path.peer.unwrap_or(BROADCAST);
            path.queued |= path.socket.queue_with(to, |out| probe.emit(out))?.is_some();
        }
        for (i, path) in self.paths.iter_mut().enumerate() {
            // Frames a flush left behind (the device was busy) go now, even if nothing new
            // was queued: otherwise a full ring would wait for a send that never comes.
            if !std::mem::take(&mut path.queued) && !path.socket.pending() {
                continue;
            }
            if let Err(e) = path.socket.flush() {
                if !bundled {
                    return Err(e);
                }
                // The frames stay in the ring and leave if the interface comes back; the
                // stream retransmits what they carried meanwhile.
                let _ = path.socket.take_error();
                self.bundle.on_send_failed(i, now);
            }
        }
        while let Some(event) = self.bundle.poll_event() {
            self.log(event);
        }
        Ok(())
    }

    fn log(&self, event: PathEvent) {
        let session = format_args!("{:08x}", self.session_id());
        match event {
            PathEvent::Down { path, reason } => {
                let iface = self.paths[path].socket.iface();
                tracing::warn!(iface, %session, ?reason, "raw-Ethernet path left out of its bundle");
            }
            PathEvent::Rejoined { path } => {
                tracing::info!(iface = self.paths[path].socket.iface(), %session, "raw-Ethernet path back in its bundle");
            }
            PathEvent::Found { path } => {
                tracing::debug!(iface = self.paths[path].socket.iface(), %session, "raw-Ethernet path joined its bundle");
            }
        }
    }

    /// How long until the stream's next timer (retransmission, delayed ack, keepalive) or, in
    /// a bundle, the next probe.
    pub fn timeout(&self) -> Option<Duration> {
        self.next_timer_us().map(|due| Duration::from_micros(due.saturating_sub(self.now_us())))
    }

    pub fn counters(&self) -> Counters {
        self.stream.counters()
    }

    /// The stream's settings as the session opened it: the payload and windows its MTU
    /// allowed, and whether payloads carry a checksum.
    pub fn reliable_config(&self) -> &ReliableConfig {
        self.stream.config()
    }

    /// Each path's counters, in the order of the interfaces.
    pub fn paths(&self) -> Vec<PathStats> {
        (0..self.paths.len())
            .map(|i| {
                let c = self.bundle.counters(i);
                PathStats {
                    iface: self.paths[i].socket.iface().to_owned(),
                    driver: self.paths[i].socket.driver_name(),
                    up: c.up,
                    datagrams_sent: c.datagrams_sent,
                    datagrams_received: c.datagrams_received,
                    probes_sent: c.probes_sent,
                    probes_answered: c.probes_answered,
                    srtt_us: c.srtt_us,
                    downs: c.downs,
                    rejoins: c.rejoins,
                }
            })
            .collect()
    }

    pub fn session_id(&self) -> u32 {
        self.stream.session_id()
    }

    /// The peer, for logs: `eth:IFACE[+IFACE…]/MAC#SESSION` (its MAC on the first path it is
    /// known on).
    pub fn describe(&self) -> String {
        let ifaces: Vec<&str> = self.paths.iter().map(|p| p.socket.iface()).collect();
        let mac = self.paths.iter().find_map(|p| p.peer).map_or_else(String::new, |m| format_mac(&m));
        format!("eth:{}/{}#{:08x}", ifaces.join("+"), mac, self.session_id())
    }

    /// When the stream's next timer or, in a bundle, the next probe is due, on the session's
    /// clock (the simulator's virtual one).
    pub fn next_timer_us(&self) -> Option<u64> {
        self.stream.poll_timeout().into_iter().chain(self.bundle.poll_timeout()).min()
    }

    /// Where the session's stream is: open, closing, closed, or dead and why.
    pub fn state(&self) -> State {
        self.stream.state()
    }

    /// Whether the peer ended its stream (a FIN) and everything before it was read.
    pub fn peer_closed(&self) -> bool {
        self.stream.peer_closed()
    }

    /// Whether the send buffer has room for more of the stream.
    pub fn writable(&self) -> bool {
        self.stream.writable()
    }

    /// End the stream after what was written (a FIN), and send what that takes now.
    pub fn close(&mut self) -> io::Result<()> {
        self.stream.close();
        self.drive()
    }

    /// Abort the session (a Reset, sent now where a path can carry it): the peer lets go at
    /// once instead of finding out by its keepalives.
    pub fn reset(&mut self) {
        if self.stream.state() != State::Open {
            return;
        }
        self.stream.reset();
        let now = self.now_us();
        let EthStream { paths, stream, bundle, .. } = self;
        let Some(i) = bundle.pick() else { return };
        let path = &mut paths[i];
        let Some(to) = path.peer else { return };
        if let Ok(Some(n)) = path.socket.queue_with(to, |room| stream.poll_transmit(now, room).unwrap_or(0)) {
            if n > 0 {
                let _ = path.socket.flush();
            }
        }
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

    fn receive(&mut self, mut to: ReadCursor<'_, '_>) -> io::Result<usize> {
        // What waits in the stream's buffer comes first; then what arrives in order goes
        // straight from the ring into `bufs`, and what filled a gap behind it after that.
        self.stream.read_into(&mut to);
        self.drive_into(Some(&mut to))?;
        self.stream.read_into(&mut to);
        let n = to.filled();
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
}

impl<S: DatagramSocket, C: Clock> FrameIo for EthStream<S, C> {
    fn recv(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        self.receive(ReadCursor::new(bufs))
    }

    fn recv_placing(
        &mut self,
        bufs: &mut [IoSliceMut<'_>],
        place: &mut dyn FnMut(&[u8]),
    ) -> io::Result<usize> {
        self.receive(ReadCursor::placing(bufs, place))
    }

    fn data_messages(&self) -> bool {
        self.data_messages
    }

    fn send_data_messages(&mut self) -> bool {
        self.data_messages && self.split.set_apart()
    }

    fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut n = self.split.write(&mut self.stream, bufs);
        self.drive()?;
        if n == 0 && !bufs.iter().all(|b| b.is_empty()) {
            // Driving may have taken acknowledgements that opened the window: try once more,
            // or the caller would wait for an event that the arrivals already spent.
            n = self.split.write(&mut self.stream, bufs);
            if n > 0 {
                self.drive()?;
            }
        }
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

impl<S: DatagramSocket, C: Clock> Drop for EthStream<S, C> {
    /// A session dropped while open is aborted with a Reset (one datagram, best effort), so
    /// that its peer lets go of it at once, as a TCP peer learns of a close, instead of
    /// finding out by its keepalives. A session that closed, or died, has nothing to say.
    fn drop(&mut self) {
        self.reset();
    }
}

impl AsRawFd for EthStream {
    fn as_raw_fd(&self) -> RawFd {
        match &self.poller {
            Some(set) => set.as_raw_fd(),
            None => self.paths[0].socket.as_raw_fd(),
        }
    }
}

/// A target's listener on one interface or a bundle of several: opens a session for each new
/// initiator, with a path on every interface of the bundle.
pub struct EthListener {
    sockets: Vec<PacketSocket>,
    ifaces: Vec<String>,
    poller: Option<OwnedFd>,
    config: EthConfig,
    /// The sessions opened and still alive, by (initiator MAC, session id): a repeated first
    /// datagram of one of them (its ack was lost) must not open it twice.
    live: HashMap<(Mac, u32), Weak<()>>,
    ready: Vec<EthStream>,
}

impl EthListener {
    /// Listen on `ifaces`, which form one bundle. The sessions it opens keep idle initiators
    /// [`TARGET_KEEPALIVE_US`].
    pub fn bind(ifaces: &[String], config: EthConfig) -> io::Result<EthListener> {
        let config = EthConfig {
            reliable: ReliableConfig { keepalive_us: TARGET_KEEPALIVE_US, ..config.reliable },
            ..config
        };
        let listen_ring = RingConfig { rx_slots: 64, tx_slots: 8, ..config.ring };
        let mut sockets = Vec::with_capacity(ifaces.len());
        for iface in ifaces {
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
            sockets.push(socket);
        }
        let poller =
            if sockets.len() > 1 { Some(poll_set(sockets.iter().map(|s| s.as_raw_fd()))?) } else { None };
        Ok(EthListener {
            sockets,
            ifaces: ifaces.to_vec(),
            poller,
            config,
            live: HashMap::new(),
            ready: Vec::new(),
        })
    }

    /// The interfaces of the bundle.
    pub fn ifaces(&self) -> &[String] {
        &self.ifaces
    }

    /// The target's MAC on the first interface.
    pub fn mac(&self) -> Mac {
        self.sockets[0].mac()
    }

    /// The next new session, if one has started (`WouldBlock` otherwise).
    pub fn accept(&mut self) -> io::Result<EthStream> {
        if self.ready.is_empty() {
            self.live.retain(|_, alive| alive.strong_count() > 0);
            for on in 0..self.sockets.len() {
                self.take_first_datagrams(on)?;
            }
            self.ready.reverse();
        }
        self.ready.pop().ok_or_else(|| io::ErrorKind::WouldBlock.into())
    }

    /// Answer the Discovers and open the sessions whose first datagrams wait on interface `on`.
    fn take_first_datagrams(&mut self, on: usize) -> io::Result<()> {
        let mut first: Vec<(Mac, Vec<u8>)> = Vec::new();
        self.sockets[on].receive(|src, datagram| first.push((src, datagram.to_vec())));
        let mut offered = false;
        for (src, datagram) in first {
            // A datagram that does not parse is not a session's start: the session's own
            // checksum would refuse it too.
            let Ok((h, _)) = DatagramHeader::parse(&datagram) else { continue };
            if h.kind == DatagramKind::Discover {
                // Answer with an Offer; a full ring drops it, and the asker asks again.
                self.sockets[on]
                    .queue_with(src, |out| discovery_datagram(DatagramKind::Offer, h.session_id, out))?;
                offered = true;
                continue;
            }
            if h.session_id == 0 || self.live.contains_key(&(src, h.session_id)) {
                continue;
            }
            // A path on every interface of the bundle; the initiator's MAC is known on this one
            // and learnt on the others from its probes.
            let mut sockets = Vec::with_capacity(self.ifaces.len());
            for (i, iface) in self.ifaces.iter().enumerate() {
                sockets.push((Link::open(iface, h.session_id, &self.config)?, (i == on).then_some(src)));
            }
            let mut stream = EthStream::open_bundle(sockets, h.session_id, &self.config, false)?;
            stream.bundle.prefer(on);
            let now = stream.now_us();
            stream.stream.handle_datagram(now, &datagram);
            stream.bundle.on_received(on, now, 1);
            let alive = Arc::new(());
            self.live.insert((src, h.session_id), Arc::downgrade(&alive));
            stream._alive = Some(alive);
            self.ready.push(stream);
        }
        if offered {
            self.sockets[on].flush()?;
        }
        Ok(())
    }
}

impl AsRawFd for EthListener {
    fn as_raw_fd(&self) -> RawFd {
        match &self.poller {
            Some(set) => set.as_raw_fd(),
            None => self.sockets[0].as_raw_fd(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn the_endpoint_decides_then_the_environment_then_the_default() {
        let none = EthOptions::default();
        assert_eq!(EthConfig::resolve(&none, &env(&[])), EthConfig::default());
        let d = EthConfig::default();
        assert_eq!(
            (d.driver, d.reliable.payload_bytes_max, d.ring.qdisc_bypass),
            (Driver::Packet, 65507, true)
        );
        assert!(d.data_messages && d.data_batching && d.payload_crc);

        let vars = env(&[
            ("SKIFF_ETH_DRIVER", "xdp"),
            ("SKIFF_ETH_QDISC", "on"),
            ("SKIFF_ETH_FRAME", "4096"),
            ("SKIFF_ETH_DATA_MESSAGES", "off"),
            ("SKIFF_ETH_DATA_BATCHING", "off"),
            ("SKIFF_ETH_CRC", "header"),
        ]);
        let c = EthConfig::resolve(&none, &vars);
        assert_eq!((c.driver, c.reliable.payload_bytes_max, c.ring.qdisc_bypass), (Driver::Xdp, 4096, false));
        assert!(!c.data_messages && !c.data_batching && !c.payload_crc);

        let endpoint = transport::Endpoint::parse(
            "eth:v,driver=packet,qdisc=off,frame=1472,data-messages=on,data-batching=on,crc=full",
        )
        .unwrap();
        let transport::Endpoint::Eth { options, .. } = endpoint else { unreachable!() };
        let c = EthConfig::resolve(&options, &vars);
        assert_eq!(
            (c.driver, c.reliable.payload_bytes_max, c.ring.qdisc_bypass),
            (Driver::Packet, 1472, true)
        );
        assert!(c.data_messages && c.data_batching && c.payload_crc);
        // The rest of the settings are the defaults whatever decided these.
        assert_eq!((c.ring.rx_slots, c.reliable.send_slots, c.reliable.rto_min_us), (384, 512, 250));
    }

    #[test]
    fn large_datagrams_take_fewer_stream_buffers() {
        assert_eq!(slots_for(128, 1472), 128);
        assert_eq!(slots_for(128, 8972), 128);
        assert_eq!(slots_for(128, 16384), 64);
        assert_eq!(slots_for(128, 65507), STREAM_SLOTS_MIN);
        assert_eq!(slots_for(8, 65507), 8, "never more than asked");
        for payload in [64, 1472, 4096, 8972, 9000, 30000, 65507] {
            let n = slots_for(128, payload);
            assert!(n.is_power_of_two() && n >= STREAM_SLOTS_MIN, "{payload}: {n}");
            assert!(
                n as usize * payload as usize <= STREAM_BUFFER_BYTES || n == STREAM_SLOTS_MIN,
                "{payload}: {n}"
            );
        }
    }

    #[test]
    fn a_variable_that_means_nothing_is_left_out() {
        for bad in ["XDP", "af_xdp", "", "xdp ", "1"] {
            let c = EthConfig::resolve(&EthOptions::default(), &|n| {
                (n == "SKIFF_ETH_DRIVER").then(|| bad.into())
            });
            assert_eq!(c.driver, Driver::Packet, "{bad:?}");
        }
        for bad in ["63", "65508", "65536", "4k", "", "-1"] {
            let c =
                EthConfig::resolve(&EthOptions::default(), &|n| (n == "SKIFF_ETH_FRAME").then(|| bad.into()));
            assert_eq!(c.reliable.payload_bytes_max, 65507, "{bad:?}");
        }
        let c =
            EthConfig::resolve(&EthOptions::default(), &|n| (n == "SKIFF_ETH_QDISC").then(|| "yes".into()));
        assert!(c.ring.qdisc_bypass);
    }
}
