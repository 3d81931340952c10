//! The connection between the simulated initiator and target, as a run sees it: either the
//! faulty in-memory byte pipe (a TCP connection: [`FaultyIo`] over [`PipeEnd`]) or a faulty
//! datagram link under two sessions of the raw-Ethernet driver ([`DatagramIo`]). The
//! run drives both through [`FrameIo`] and does not care which it has.

use std::io::{self, IoSlice, IoSliceMut};

use dgram::reliable::{Counters, ReliableConfig};
use transport::FrameIo;

use crate::clock::Clock;
use crate::datagram::{link, session, DatagramIo, LinkCounts, LinkFaults};
use crate::faults::{FaultyIo, NetFaults};
use crate::pipe::{pipe, PipeEnd};
use crate::rng::Rng;

/// Which link a run's connections use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkKind {
    /// The byte pipe with `NetFaults` (short I/O, would-block, delays, disconnects, header
    /// flips): skiff over TCP.
    Pipe,
    /// A datagram link with these faults, under a [`DatagramStream`] at each end; the
    /// `NetFaults`' disconnect rate becomes the rate of injected Resets.
    Datagram(LinkFaults),
}

/// The reliable streams' configuration in the simulation: the defaults with a shorter
/// maximum RTO and a short keepalive, so that a session whose peer is gone dies within about
/// 130 virtual milliseconds (thousands of steps) instead of a second, and a link flap (at most
/// 5 ms) is still survived. 12 backoffs, not fewer: at 20% loss a retransmission and its ack
/// both get through only 64% of the time, and 7 failures in a row (1 in 1,300) killed about
/// one seed in 2,000 with 6.
fn reliable_config(rng: &mut Rng) -> ReliableConfig {
    ReliableConfig {
        payload_bytes_max: rng.pick(&[256, 1472]),
        send_slots: rng.pick(&[8, 64]),
        recv_slots: rng.pick(&[8, 64]),
        peer_window_initial: 8,
        rto_max_us: 10_000,
        backoffs_max: 12,
        keepalive_us: 5_000,
        ..ReliableConfig::default()
    }
}

/// One end of a connection.
#[derive(Debug)]
pub enum ConnIo {
    Pipe(FaultyIo<PipeEnd>),
    Datagram(Box<DatagramIo>),
}

impl ConnIo {
    /// The `(initiator, target)` ends of connection `id`, with their faults drawn from `rng`.
    pub fn pair(
        kind: LinkKind,
        clock: &Clock,
        rng: &mut Rng,
        id: u32,
        latency_us: u64,
        pipe_bytes: usize,
        net: NetFaults,
    ) -> (ConnIo, ConnIo) {
        let stream = u64::from(id) * 2;
        match kind {
            LinkKind::Pipe => {
                let (c, t) = pipe(clock, latency_us, pipe_bytes);
                let client = FaultyIo::new(c, rng.fork(stream), net);
                (ConnIo::Pipe(client), ConnIo::Pipe(FaultyIo::new(t, rng.fork(stream + 1), net)))
            }
            LinkKind::Datagram(faults) => {
                let (c, t) = link(clock, rng.fork(stream), latency_us, faults);
                let config = reliable_config(rng);
                let isn = [rng.next_u64() as u32, rng.next_u64() as u32];
                // Three connections in four carry read data in data messages (each end
                // batching or not), the rest on the stream: both paths stay proven.
                let (client_dm, target_dm) =
                    if rng.below(4) > 0 { (Some(false), Some(rng.below(2) == 0)) } else { (None, None) };
                let client = session(vec![c.clone()], 0, id, (isn[0], isn[1]), &config, client_dm, clock);
                let target = session(vec![t.clone()], 1, id, (isn[1], isn[0]), &config, target_dm, clock);
                let client = DatagramIo::new(client, c, rng.fork(stream + 1), net.disconnect);
                let target = DatagramIo::new(target, t, rng.fork(stream + 2), net.disconnect);
                (ConnIo::Datagram(Box::new(client)), ConnIo::Datagram(Box::new(target)))
            }
        }
    }

    /// The fault that may have killed this connection, if one struck this end.
    pub fn injected(&self) -> Option<&'static str> {
        match self {
            ConnIo::Pipe(io) => io.injected,
            ConnIo::Datagram(io) if io.resets > 0 => Some("reset"),
            ConnIo::Datagram(io) if io.end().counts().flaps > 0 => Some("link down"),
            ConnIo::Datagram(_) => None,
        }
    }

    /// Byte-stream faults injected at this end: short, would-block, delay, disconnect (for a
    /// datagram link: resets), flip.
    pub fn fault_counts(&self) -> [u64; 5] {
        match self {
            ConnIo::Pipe(io) => io.counts,
            ConnIo::Datagram(io) => [0, 0, 0, io.resets, 0],
        }
    }

    /// What the datagram link did (both directions: ask one end) and this end's stream.
    pub fn datagram_counts(&self) -> Option<(LinkCounts, Counters)> {
        match self {
            ConnIo::Pipe(_) => None,
            ConnIo::Datagram(io) => Some((io.end().counts(), io.counters())),
        }
    }

    /// Stop sending: the peer reads what was sent, then the end of the stream.
    pub fn shutdown(&mut self) {
        match self {
            ConnIo::Pipe(io) => io.inner().shutdown(),
            ConnIo::Datagram(io) => io.shutdown(),
        }
    }

    /// Tear the connection down.
    pub fn reset(&mut self) {
        match self {
            ConnIo::Pipe(io) => io.inner().reset(),
            ConnIo::Datagram(io) => io.reset(),
        }
    }

    /// Let the transport work on its own (a datagram stream's timers and acks); called every
    /// step. A pipe has nothing to do.
    pub fn pump(&mut self) {
        if let ConnIo::Datagram(io) = self {
            io.pump();
        }
    }
}

impl FrameIo for ConnIo {
    fn recv(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        match self {
            ConnIo::Pipe(io) => io.recv(bufs),
            ConnIo::Datagram(io) => io.recv(bufs),
        }
    }

    fn send(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            ConnIo::Pipe(io) => io.send(bufs),
            ConnIo::Datagram(io) => io.send(bufs),
        }
    }

    fn data_messages(&self) -> bool {
        matches!(self, ConnIo::Datagram(io) if io.data_messages())
    }

    fn send_data_messages(&mut self) -> bool {
        match self {
            ConnIo::Datagram(io) => io.send_data_messages(),
            ConnIo::Pipe(_) => false,
        }
    }

    fn recv_placing(
        &mut self,
        bufs: &mut [IoSliceMut<'_>],
        place: &mut dyn FnMut(&[u8]),
    ) -> io::Result<usize> {
        match self {
            ConnIo::Pipe(io) => io.recv(bufs),
            ConnIo::Datagram(io) => io.recv_placing(bufs, place),
        }
    }
}

/// The target's end as the worker's connection handling sees a stream: neither TCP (a TLS
/// listener's sniffing) nor Unix, without TLS.
impl server::drive::ConnStream for ConnIo {
    fn peer(&self) -> String {
        "sim".into()
    }

    fn is_unix(&self) -> bool {
        false
    }

    fn is_tcp(&self) -> bool {
        false
    }

    fn peek_first_byte(&self) -> io::Result<Option<u8>> {
        Ok(None)
    }

    fn start_tls(&mut self, _: std::sync::Arc<transport::tls::ServerTlsConfig>) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }

    fn tls_established(&self) -> bool {
        false
    }

    fn peer_principal(&self) -> Option<String> {
        None
    }

    fn close_tls(&mut self) {}
}
