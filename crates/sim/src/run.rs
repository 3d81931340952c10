//! One seeded run: an initiator connection (`proto::client::Connection`, the code a lane
//! drives: handshakes, silence, reconnection, and the session) and a target front end, stepped
//! on one thread over a faulty in-memory pipe and a faulty backend, every read checked against
//! the [`Shadow`].
//!
//! Each step advances the virtual clock a little, lets the initiator submit new requests
//! (never two in flight on the same block, the one ordering a block device leaves to its
//! user), honours the connection's deadlines, carries out what it asks of the transport (open
//! one, drop one), moves bytes both ways, and checks every completion: read data against the
//! model, statuses against the faults that could explain them. A transport that dies (a
//! disconnect, a flipped header bit caught by the CRC) must have died of an injected fault.
//! Half the seeds (chosen by the seed) run without reconnection: the connection closes for
//! good and fails every request in flight. The other half resume: the connection parks its
//! requests, opens a new transport when its policy says, and re-sends them once the export is
//! open again, so no request may fail for a lost transport (only for a connection closed for
//! good on a broken frame). At the end every request must have completed and the volume, read
//! directly from the backend, must hold every acknowledged write.

use std::collections::BTreeMap;
use std::io::{self, IoSlice};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use backend::{Backend, Batch, Wake};
use engine::{BackendSpec, Export, ExportTable};
use proto::batch::BatchConfig;
use proto::caravan::Doorbell;
#[cfg(feature = "mutations")]
use proto::client::Mutation as ClientMutation;
use proto::client::{
    Batching, ClientSession, Closed, Completion, ConnectionConfig, Event, Opening, ReconnectConfig,
    SessionConfig, Submission, SubmitError, DIRECT_OFF,
};
#[cfg(feature = "mutations")]
use server::drive::Mutation as TargetMutation;
use server::drive::{Protocol, Serviced, Target, TargetConn, TargetSettings};
use transport::FrameIo;
use wire::{FrameBuffer, Limits, Opcode, ReqFlags, Status};

/// The initiator's connection, as a lane runs it.
type ClientLink = proto::client::Connection<Vec<u8>>;

use crate::clock::Clock;
use crate::datagram::{add_counters, LinkCounts};
use crate::disk::{DiskFaults, FaultyBackend};
use crate::faults::NetFaults;
use crate::link::{ConnIo, LinkKind};
use crate::rng::Rng;
use crate::shadow::{Shadow, BLOCK_BYTES};

/// Blocks in the simulated volume.
const VOLUME_BLOCKS: usize = 256;
/// Most blocks one request covers.
const REQUEST_BLOCKS_MAX: usize = 8;
/// Steps before a run that has not finished counts as stuck.
const STEPS_MAX: u64 = 400_000;
/// Calls of each kind (send, receive) one side makes per step, at most.
const CALLS_PER_STEP: usize = 8;
/// Response bytes the target queues before it stops reading, as the server does.
const TX_BACKLOG_MAX: usize = 1 << 20;
/// The client connection's silence timeout and handshake bound, in virtual µs: far beyond
/// any delay the faults inject, so a connection that declares silence is wrong.
const SILENCE_US: u64 = 500_000;
/// A reconnection's transport fails to open (one in this many millionths), with network faults on.
const CONNECT_FAILS_PER_MILLION: u32 = 100_000;

/// A bug to plant, to show that the simulation catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Planted {
    None,
    /// Client: the first two completions of a caravan get each other's tag.
    #[cfg(feature = "mutations")]
    SwapTags,
    /// Client: a failed connection drops unsent requests instead of failing them.
    #[cfg(feature = "mutations")]
    ForgetUnsent,
    /// Client: the doorbell's delay bound is never honoured.
    #[cfg(feature = "mutations")]
    IgnoreDeadline,
    /// Client: on a lost connection, writes already sent are completed OK instead of re-sent.
    #[cfg(feature = "mutations")]
    AckSentWrites,
    /// Target: a write is acknowledged before it reaches the backend.
    #[cfg(feature = "mutations")]
    AckBeforeBackend,
    /// Client: the first two segments of a data message land in each other's buffers (only
    /// over the datagram link, where data messages run; not in [`Planted::ALL`], which the
    /// byte-pipe suite plants).
    #[cfg(feature = "mutations")]
    SwapSegments,
    /// Client connection: a reconnection skips OPEN and sends the parked requests under the
    /// lost connection's export handle.
    #[cfg(feature = "mutations")]
    ReopenWithoutOpen,
    /// Client connection: an attempt to reconnect that failed is never followed by another.
    #[cfg(feature = "mutations")]
    NoRetry,
    /// Target connection: a batch's wake does not take up the requests that waited in the
    /// connection's buffer for device work.
    #[cfg(feature = "mutations")]
    ForgetHeldOnWake,
    /// Target connection: a pass that stopped before a request whose reads joined a FLUSH's
    /// or FUA's batch, all of it done by the seal, does not come back for what it left.
    #[cfg(feature = "mutations")]
    ForgetStoppedOnFreeSeal,
}

impl Planted {
    #[cfg(feature = "mutations")]
    pub const ALL: [Planted; 9] = [
        Planted::SwapTags,
        Planted::ForgetUnsent,
        Planted::IgnoreDeadline,
        Planted::AckSentWrites,
        Planted::AckBeforeBackend,
        Planted::ReopenWithoutOpen,
        Planted::NoRetry,
        Planted::ForgetHeldOnWake,
        Planted::ForgetStoppedOnFreeSeal,
    ];

    /// The client connection's or session's bug this plants ([`ClientMutation::None`] for a
    /// bug elsewhere).
    #[cfg(feature = "mutations")]
    fn client(self) -> ClientMutation {
        match self {
            Planted::SwapTags => ClientMutation::SwapTags,
            Planted::ForgetUnsent => ClientMutation::ForgetUnsent,
            Planted::IgnoreDeadline => ClientMutation::IgnoreDeadline,
            Planted::AckSentWrites => ClientMutation::AckSentWrites,
            Planted::SwapSegments => ClientMutation::SwapSegments,
            Planted::ReopenWithoutOpen => ClientMutation::ReopenWithoutOpen,
            Planted::NoRetry => ClientMutation::NoRetry,
            Planted::None
            | Planted::AckBeforeBackend
            | Planted::ForgetHeldOnWake
            | Planted::ForgetStoppedOnFreeSeal => ClientMutation::None,
        }
    }

    /// The target connection's bug this plants, if it is one of the target's.
    #[cfg(feature = "mutations")]
    fn target(self) -> Option<TargetMutation> {
        match self {
            Planted::AckBeforeBackend => Some(TargetMutation::AckBeforeBackend),
            Planted::ForgetHeldOnWake => Some(TargetMutation::ForgetHeldOnWake),
            Planted::ForgetStoppedOnFreeSeal => Some(TargetMutation::ForgetStoppedOnFreeSeal),
            _ => None,
        }
    }
}

/// What one run does.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub seed: u64,
    /// Requests to issue.
    pub ops: usize,
    pub net: NetFaults,
    pub disk: DiskFaults,
    pub planted: Planted,
    /// The byte pipe (TCP), or a datagram link under reliable streams (raw Ethernet).
    pub link: LinkKind,
}

/// What a run did, when it passed.
#[derive(Debug, Default, Clone, Copy)]
pub struct Report {
    pub ops_ok: u64,
    pub ops_failed: u64,
    pub connections: u32,
    pub steps: u64,
    pub virtual_us: u64,
    /// Network faults injected: short, would-block bursts, delays, disconnects, flips.
    pub net_faults: [u64; 5],
    pub disk_errors: u64,
    /// Requests whose device work the target's front end waited for (parked), summed.
    pub parks: u64,
    /// FLUSH and FUA requests whose replies waited for durability started without waiting
    /// (`Backend::sync_later`), and connections closed because it failed.
    pub syncs_later: u64,
    pub sync_failures: u64,
    /// What the initiator's sessions did, summed over connections: caravans sent, completion
    /// caravans received, read bytes placed directly and copied.
    pub caravans_sent: u64,
    pub completion_caravans: u64,
    pub read_bytes_placed: u64,
    pub read_bytes_copied: u64,
    /// Read data that came in data messages (datagram links that agreed to them).
    pub read_bytes_in_messages: u64,
    /// Connections the target closed with a GOAWAY (a flipped header bit it caught).
    pub goaways: u64,
    /// Seeds that resumed their session across connections, and the reattaches they made.
    pub resuming_runs: u64,
    /// Seeds whose connections authenticated with a key (HELLO, AUTH, AUTH_REPLY).
    pub authenticated_runs: u64,
    pub reattaches: u64,
    /// With a datagram link: what the link did, and the reliable streams' counters (both
    /// ends, every connection).
    pub link: LinkCounts,
    pub streams: dgram::reliable::Counters,
}

impl Report {
    /// Add another run's figures to these (a summary over seeds).
    pub fn add(&mut self, r: &Report) {
        self.ops_ok += r.ops_ok;
        self.ops_failed += r.ops_failed;
        self.connections += r.connections;
        self.steps += r.steps;
        self.virtual_us += r.virtual_us;
        for (t, n) in self.net_faults.iter_mut().zip(r.net_faults) {
            *t += n;
        }
        self.disk_errors += r.disk_errors;
        self.parks += r.parks;
        self.syncs_later += r.syncs_later;
        self.sync_failures += r.sync_failures;
        self.caravans_sent += r.caravans_sent;
        self.completion_caravans += r.completion_caravans;
        self.read_bytes_placed += r.read_bytes_placed;
        self.read_bytes_copied += r.read_bytes_copied;
        self.read_bytes_in_messages += r.read_bytes_in_messages;
        self.goaways += r.goaways;
        self.resuming_runs += r.resuming_runs;
        self.authenticated_runs += r.authenticated_runs;
        self.reattaches += r.reattaches;
        self.link.add(&r.link);
        add_counters(&mut self.streams, &r.streams);
    }
}

/// Why a run failed.
#[derive(Debug, Clone)]
pub struct Failure {
    pub seed: u64,
    pub step: u64,
    pub virtual_us: u64,
    pub message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "seed {} failed at step {} ({} µs): {}",
            self.seed, self.step, self.virtual_us, self.message
        )
    }
}

/// Run one seed.
pub fn run(opts: &Options) -> Result<Report, Failure> {
    let mut sim = Sim::new(opts);
    let result = sim.run();
    result.map_err(|message| Failure {
        seed: opts.seed,
        step: sim.step,
        virtual_us: sim.clock.now_us(),
        message,
    })
}

/// One request the initiator has submitted.
#[derive(Debug, Clone, Copy)]
struct Op {
    opcode: Opcode,
    first: usize,
    count: usize,
    /// The generation a write carries (0 for write-zeroes).
    gen: u32,
    /// The transport it was submitted on (the latest, if none was up), and the client
    /// connection ([`Connection`]) that carries it.
    connection: u32,
    client: u32,
}

/// The initiator: the handshake of a new connection, or the connection itself
/// ([`proto::client::Connection`], the lane's own logic: its session, handshakes on later
/// transports, silence and reconnection).
enum Client {
    /// No connection: a new one starts at `reconnect_at_us` (the start, or the last one closed
    /// for good).
    Idle,
    /// The first handshake of connection `id`, on the current transport.
    Opening { id: u32, opening: Box<Opening> },
    /// Connection `id`, up on the current transport or reconnecting.
    Up { id: u32, link: Box<ClientLink>, was_up: bool },
}

/// A transport: the pipe or datagram link between the two ends, and the target's end of it.
struct Connection {
    id: u32,
    client_io: ConnIo,
    client_rx: FrameBuffer,
    /// The target's end: the worker's own connection handling (`server::drive`) over the
    /// link's target end.
    target: TargetConn<ConnIo>,
    /// The target closed its end (it failed, or said all it had to).
    target_closed: bool,
    /// The target's replies wait until then (a slow backend).
    target_gate_us: u64,
    /// It closed because durability it waited for failed, without sending the replies that
    /// waited.
    target_sync_failed: bool,
}

/// Connections whose parked requests may go on, by id.
#[derive(Default)]
struct Woken(std::sync::Mutex<Vec<u64>>);

impl Wake for Woken {
    fn wake(&self, token: u64) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(token);
    }
}

impl Woken {
    /// Whether connection `id` was woken (once).
    fn take(&self, id: u32) -> bool {
        let mut woken = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let before = woken.len();
        woken.retain(|&t| t != u64::from(id));
        woken.len() != before
    }
}

struct Sim {
    opts: Options,
    clock: Clock,
    rng: Rng,
    shadow: Shadow,
    /// The target: one worker's shared state over the faulty volume.
    target: Target,
    faulty: Arc<FaultyBackend>,
    volume: Arc<dyn Backend>,
    /// What every client connection of the run is (the key, the reconnection policy, ...).
    link_config: ConnectionConfig,
    latency_us: u64,
    pipe_bytes: usize,
    /// The current transport, if one is up.
    conn: Option<Connection>,
    connections: u32,
    client: Client,
    /// Client connections opened, and those closed for good (their requests may fail).
    clients: u32,
    closed_clients: Vec<u32>,
    reconnect_at_us: u64,
    /// Resume sessions across connections (seeded), and the session waiting for the next one.
    resuming: bool,
    /// Authenticate every connection with a key (seeded).
    authenticating: bool,
    /// Wakes of the target's parked requests (`Connection::target_batch`).
    woken: Arc<Woken>,
    ops: BTreeMap<u64, Op>,
    busy: Vec<bool>,
    issued: usize,
    next_user_data: u64,
    done: Vec<Completion<Vec<u8>>>,
    step: u64,
    report: Report,
    /// (virtual µs, user_data, op, what happened) for every request event, so that a failure
    /// can tell the story of the block it is about.
    history: Vec<(u64, u64, Op, &'static str)>,
}

impl Sim {
    fn new(opts: &Options) -> Sim {
        let mut rng = Rng::new(opts.seed);
        let clock = Clock::new();
        let spec = BackendSpec::Ram { size_bytes: (VOLUME_BLOCKS * BLOCK_BYTES) as u64 };
        let volume = Export::open("sim", &spec, false).expect("a small RAM volume").backend;
        let faulty = Arc::new(FaultyBackend::new(volume.clone(), rng.fork(1), opts.disk));
        let offered = Limits {
            queue_depth: rng.range(4, 256) as u32,
            caravan_reqs_max: rng.range(1, 64) as u32,
            caravan_bytes_max: rng.pick(&[4096, 16384, 2 << 20]),
            io_bytes_max: rng.pick(&[2048, 4096]),
        };
        let exports = ExportTable::new(vec![Export::new("sim", faulty.clone(), false)]);
        let batching = match rng.below(3) {
            0 => Batching::Off,
            1 => Batching::Static,
            _ => Batching::Adaptive(BatchConfig {
                interval_us: rng.range(200, 2000),
                ..BatchConfig::default()
            }),
        };
        let session_config = SessionConfig {
            doorbell: Doorbell {
                aggregation_reqs: rng.range(1, 16) as u32,
                aggregation_bytes: rng.pick(&[4096, 16384, 65536]),
                delay_us: rng.range(0, 300),
            },
            batching,
            direct_min_bytes: rng.pick(&[DIRECT_OFF, 0, 2048]),
            directory_entries: 0,
        };
        let proposed = Limits {
            queue_depth: rng.range(1, 64) as u32,
            caravan_reqs_max: rng.range(0, 16) as u32,
            caravan_bytes_max: rng.pick(&[0, 8192]),
            io_bytes_max: 0,
        };
        let resuming = rng.below(2) == 1;
        let authenticating = rng.below(2) == 1;
        let key = authenticating.then(|| {
            let secret = rng.next_u64().to_le_bytes().repeat(2);
            Arc::new(proto::auth::Key::new("sim", &secret).expect("a 16-byte key"))
        });
        let reconnect = if resuming {
            // Attempts at once after a loss, then up to this far apart; never giving up, and
            // never failing what waits: a resuming run fails nothing for a lost connection.
            ReconnectConfig {
                reconnect_delay_us: rng.range(100, 5_000),
                ctrl_loss_timeout_us: u64::MAX / 4,
                fast_io_fail_timeout_us: None,
            }
        } else {
            ReconnectConfig::OFF
        };
        let link_config = ConnectionConfig {
            export: "sim".into(),
            proposed,
            features: 0,
            key,
            grants: Arc::new([]),
            session: session_config,
            reconnect,
            timeout_us: SILENCE_US,
            attempt_timeout_us: SILENCE_US,
        };
        let settings = TargetSettings {
            limits: offered,
            open_handles_max: 16,
            keys: link_config.key.iter().map(|key| proto::auth::Key::clone(key)).collect(),
            tx_backlog_bytes_max: TX_BACKLOG_MAX,
            reads_per_pass: CALLS_PER_STEP,
        };
        let target = Target::new(settings, exports).expect("a target over one small volume");
        Sim {
            opts: *opts,
            shadow: Shadow::new(opts.seed, VOLUME_BLOCKS),
            target,
            faulty,
            volume,
            link_config,
            latency_us: rng.range(1, 50),
            pipe_bytes: rng.pick(&[700, 4096, 65536, 1 << 20]),
            conn: None,
            connections: 0,
            client: Client::Idle,
            clients: 0,
            closed_clients: Vec::new(),
            reconnect_at_us: 0,
            resuming,
            authenticating,
            woken: Arc::new(Woken::default()),
            ops: BTreeMap::new(),
            busy: vec![false; VOLUME_BLOCKS],
            issued: 0,
            next_user_data: 1,
            done: Vec::new(),
            step: 0,
            report: Report::default(),
            history: Vec::new(),
            rng,
            clock,
        }
    }

    fn run(&mut self) -> Result<Report, String> {
        while self.step < STEPS_MAX {
            self.step += 1;
            let tick = self.rng.range(1, 30);
            self.clock.advance(tick);
            if matches!(self.client, Client::Idle) {
                if self.finished() {
                    break;
                }
                if self.clock.now_us() >= self.reconnect_at_us {
                    self.connect();
                }
                continue;
            }
            if let Some(conn) = self.conn.as_mut() {
                // A datagram link's timers and acks run whether or not the sides move bytes.
                // Every other step on average the initiator's datagrams wait for its receive
                // instead, which takes them in with a reader there (data messages placed on
                // arrival, stream bytes straight into the frame buffer), as a lane does.
                if self.rng.below(2) == 0 {
                    conn.client_io.pump();
                }
                conn.target.stream_mut().pump();
            }
            self.client_step()?;
            if self.conn.is_some() {
                self.target_step();
            }
            if self.finished() {
                break;
            }
        }
        if !self.finished() {
            return Err(format!(
                "stuck: {} of {} requests issued, {} still in flight after {} steps",
                self.issued,
                self.opts.ops,
                self.ops.len(),
                self.step
            ));
        }
        self.check_volume()?;
        if let Some(conn) = self.conn.take() {
            self.count_transport(&conn);
        }
        if let Client::Up { link, .. } = std::mem::replace(&mut self.client, Client::Idle) {
            self.count_session(&link);
        }
        self.report.steps = self.step;
        self.report.virtual_us = self.clock.now_us();
        self.report.connections = self.connections;
        self.report.resuming_runs = u64::from(self.resuming);
        self.report.authenticated_runs = u64::from(self.authenticating);
        self.report.disk_errors = self.faulty.errors.load(Relaxed);
        self.report.goaways = self.target.protocol_errors();
        self.report.parks = self.faulty.parks.load(Relaxed);
        self.report.syncs_later = self.faulty.syncs_later.load(Relaxed);
        Ok(self.report)
    }

    fn finished(&self) -> bool {
        self.issued == self.opts.ops && self.ops.is_empty()
    }

    /// Start a client connection: a transport, and the first handshake on it.
    fn connect(&mut self) {
        self.clients += 1;
        self.open_transport();
        let nonce = self.nonce();
        let data_messages = self.conn.as_ref().is_some_and(|c| c.client_io.data_messages());
        let opening = Opening::new(&self.link_config, data_messages, nonce);
        self.client = Client::Opening { id: self.clients, opening: Box::new(opening) };
    }

    /// This side's random contribution to a key's proof.
    fn nonce(&mut self) -> [u8; wire::control::NONCE_LEN] {
        std::array::from_fn(|_| self.rng.below(256) as u8)
    }

    /// A new transport, and the target's connection at its far end.
    fn open_transport(&mut self) {
        self.connections += 1;
        let id = self.connections;
        let (client_io, target_io) = ConnIo::pair(
            self.opts.link,
            &self.clock,
            &mut self.rng,
            id,
            self.latency_us,
            self.pipe_bytes,
            self.opts.net,
        );
        let mut target = self.target.accept(target_io, Protocol::Native).expect("the target admits it");
        // Requests that wait for device work (the faulty disk's `park`) and replies that wait
        // for durability park on a batch, as on a target with asynchronous flash reads; its
        // wake names the connection's id in `woken`.
        target.set_batch(Arc::new(Batch::new(self.woken.clone(), u64::from(id))));
        #[cfg(feature = "mutations")]
        if let Some(mutation) = self.opts.planted.target() {
            target.plant(mutation);
        }
        self.conn = Some(Connection {
            id,
            client_io,
            client_rx: FrameBuffer::new(),
            target,
            target_closed: false,
            target_gate_us: 0,
            target_sync_failed: false,
        });
    }

    /// The initiator's turn: submit, honour the connection's deadlines, carry out what it asks
    /// of the transport, move bytes, and check every completion.
    fn client_step(&mut self) -> Result<(), String> {
        let now = self.clock.now_us();
        let mut client = std::mem::replace(&mut self.client, Client::Idle);
        let turn = self.client_turn(&mut client, now);
        self.client = client;
        turn?;
        self.check_completions()
    }

    fn client_turn(&mut self, client: &mut Client, now: u64) -> Result<(), String> {
        if let Client::Up { id, link, .. } = client {
            let id = *id;
            self.issue(link.session_mut(), id, now);
            if self.rng.chance(5_000) {
                link.session_mut().commit();
            }
            let timers = link.handle_timeout(now);
            if link.is_up() {
                if let Some(due) = link.session().poll_timeout().filter(|&due| due <= now) {
                    return Err(format!("the open caravan was due at {due} µs and still waits at {now} µs"));
                }
            }
            self.settle(client, timers, now)?;
        }
        if self.conn.is_some() && !matches!(client, Client::Idle) {
            if let Err(reason) = self.client_io(client, now) {
                self.transport_lost(client, &reason, now)?;
            }
        }
        if let Client::Up { link, .. } = client {
            link.session_mut().take_completions(&mut self.done);
        }
        Ok(())
    }

    /// After a call into the connection: carry out what it asks of the transport, and if it
    /// closed for good (`result`), check why and start afresh.
    fn settle(&mut self, client: &mut Client, result: Result<(), Closed>, now: u64) -> Result<(), String> {
        let Client::Up { id, link, was_up } = client else {
            return Ok(());
        };
        let id = *id;
        while let Some(event) = link.poll_event() {
            match event {
                Event::Disconnect => self.transport_ended("the connection closed it")?,
                Event::Connect
                    if self.opts.net != NetFaults::NONE && self.rng.chance(CONNECT_FAILS_PER_MILLION) =>
                {
                    link.handle_transport_failed(now);
                }
                Event::Connect => {
                    self.open_transport();
                    let data_messages = self.conn.as_ref().is_some_and(|c| c.client_io.data_messages());
                    let nonce = self.nonce();
                    link.handle_transport_up(now, data_messages, nonce);
                }
            }
        }
        if link.is_up() && !*was_up {
            self.report.reattaches += 1;
        }
        *was_up = link.is_up();
        let Err(why) = result else {
            return Ok(());
        };
        // Closed for good: only a broken frame (a flipped bit) or, without reconnection, a
        // lost transport may do that, and the transport's end was checked for its fault above.
        match why {
            Closed::Protocol(_) | Closed::Transport => {}
            Closed::Silent | Closed::GaveUp => {
                return Err(format!("client connection {id} closed for good: {why:?}"));
            }
        }
        if !link.is_closed() {
            return Err(format!("client connection {id} said {why:?} and is not closed"));
        }
        link.session_mut().take_completions(&mut self.done);
        self.closed_clients.push(id);
        self.check_completions()?;
        if let Some((user_data, op)) = self.ops.iter().find(|(_, op)| op.client == id) {
            return Err(format!(
                "request {user_data} ({op:?}) never completed although its connection closed ({why:?})"
            ));
        }
        let Client::Up { link, .. } = std::mem::replace(client, Client::Idle) else {
            unreachable!("matched above")
        };
        self.count_session(&link);
        self.reconnect_at_us = now + self.rng.range(50, 500);
        Ok(())
    }

    /// The transport failed under the client (`reason`): a first handshake starts afresh
    /// later; a connection decides (reconnect, or close for good).
    fn transport_lost(&mut self, client: &mut Client, reason: &str, now: u64) -> Result<(), String> {
        match client {
            Client::Idle => Ok(()),
            Client::Opening { .. } => {
                self.transport_ended(reason)?;
                *client = Client::Idle;
                self.reconnect_at_us = now + self.rng.range(50, 500);
                Ok(())
            }
            Client::Up { link, .. } => {
                let result = if link.handle_transport_lost(now) { Ok(()) } else { Err(Closed::Transport) };
                if !link.has_transport() {
                    // Whatever the connection decides, this transport is over.
                    self.transport_ended(reason)?;
                }
                self.settle(client, result, now)
            }
        }
    }

    /// Submit new requests while the queue has room (and a coin says so), never two in flight
    /// on one block.
    fn issue(&mut self, session: &mut ClientSession<Vec<u8>>, client: u32, now: u64) {
        let connection = self.connections;
        let Sim { rng, shadow, ops, busy, issued, next_user_data, history, .. } = self;
        let ops_max = self.opts.ops;
        let blocks_max = (session.limits().io_bytes_max as usize / BLOCK_BYTES).clamp(1, REQUEST_BLOCKS_MAX);
        while *issued < ops_max && session.in_flight() < session.queue_depth() && rng.chance(600_000) {
            let opcode = match rng.below(100) {
                0..45 => Opcode::Read,
                45..88 => Opcode::Write,
                88..94 => Opcode::WriteZeroes,
                _ => Opcode::Flush,
            };
            let (first, count) = if opcode == Opcode::Flush {
                (0, 0)
            } else {
                let count = rng.range(1, blocks_max as u64) as usize;
                let first = rng.below((shadow.blocks() - count + 1) as u64) as usize;
                if busy[first..first + count].iter().any(|&b| b) {
                    return;
                }
                (first, count)
            };
            let gen = if opcode == Opcode::Write { shadow.new_gen() } else { 0 };
            let buf = match opcode {
                Opcode::Read => Some(vec![0xA5; count * BLOCK_BYTES]),
                Opcode::Write => Some(shadow.data(first, count, gen)),
                _ => None,
            };
            let mut flags = ReqFlags::empty();
            if opcode.is_mutating() && rng.chance(200_000) {
                flags = flags | ReqFlags::FUA;
            }
            if rng.chance(50_000) {
                flags = flags | ReqFlags::NO_DELAY;
            }
            let user_data = *next_user_data;
            let sub = Submission {
                opcode,
                flags,
                offset: (first * BLOCK_BYTES) as u64,
                length: count * BLOCK_BYTES,
                buf,
                user_data,
            };
            match session.submit(now, sub) {
                Ok(()) => {}
                Err(r) if matches!(r.error, SubmitError::QueueFull(_) | SubmitError::Closed) => return,
                Err(r) => panic!("the simulation built a request the session refused: {:?}", r.error),
            }
            *next_user_data += 1;
            *issued += 1;
            busy[first..first + count].fill(true);
            let op = Op { opcode, first, count, gen, connection, client };
            history.push((now, user_data, op, "submitted"));
            ops.insert(user_data, op);
        }
    }

    /// The target's turn, as a worker's pass for this connection: resume it if its batch
    /// landed, read and execute, and send what the slow backend has let go.
    fn target_step(&mut self) {
        let now = self.clock.now_us();
        let conn = self.conn.as_mut().expect("a connection");
        if conn.target_closed {
            return;
        }
        self.faulty.land_some();
        if self.woken.take(conn.id) {
            conn.target.resume();
        }
        let serviced = conn.target.service(&self.target);
        let slow = self.faulty.take_delay_us();
        conn.target_gate_us = conn.target_gate_us.max(now + slow);
        let stays =
            serviced != Serviced::Closed && (now < conn.target_gate_us || conn.target.flush(&self.target));
        if !stays {
            // As a worker drops it: the peer reads what was sent, then the end.
            conn.target_sync_failed = conn.target.durability_failed();
            conn.target.stream_mut().shutdown();
            conn.target_closed = true;
        }
    }

    /// The transport is over (the client's connection closed it, or it failed under the
    /// client): it must have died of an injected fault (or the target's failed durability).
    fn transport_ended(&mut self, reason: &str) -> Result<(), String> {
        let Some(mut conn) = self.conn.take() else {
            return Ok(());
        };
        self.count_transport(&conn);
        let fault = conn.client_io.injected().or(conn.target.stream().injected());
        self.report.sync_failures += u64::from(conn.target_sync_failed);
        if fault.is_none() && !conn.target_sync_failed {
            return Err(format!("connection {} failed without an injected fault: {reason}", conn.id));
        }
        conn.client_io.reset();
        Ok(())
    }

    /// Add what a transport did to the report.
    fn count_transport(&mut self, conn: &Connection) {
        let r = &mut self.report;
        for io in [&conn.client_io, conn.target.stream()] {
            for (sum, n) in r.net_faults.iter_mut().zip(io.fault_counts()) {
                *sum += n;
            }
            if let Some((_, stream)) = io.datagram_counts() {
                add_counters(&mut r.streams, &stream);
            }
        }
        if let Some((link, _)) = conn.client_io.datagram_counts() {
            r.link.add(&link);
        }
    }

    /// Add what a client connection's session did, over all its transports, to the report.
    fn count_session(&mut self, link: &ClientLink) {
        let r = &mut self.report;
        let st = link.session().stats();
        r.caravans_sent += st.caravans_sent;
        r.completion_caravans += st.completion_caravans;
        r.read_bytes_placed += st.read_bytes_placed;
        r.read_bytes_copied += st.read_bytes_copied;
        r.read_bytes_in_messages += st.read_bytes_in_messages;
    }

    /// Check every completion against the request it answers and the model.
    fn check_completions(&mut self) -> Result<(), String> {
        let disk_faults = self.opts.disk != DiskFaults::NONE;
        for c in std::mem::take(&mut self.done) {
            let op = self
                .ops
                .remove(&c.user_data)
                .ok_or_else(|| format!("completion for request {}, which is not in flight", c.user_data))?;
            self.busy[op.first..op.first + op.count].fill(false);
            let what = if c.status.is_ok() { "completed ok" } else { "failed" };
            self.history.push((self.clock.now_us(), c.user_data, op, what));
            if c.opcode != op.opcode {
                return Err(format!("request {} ({op:?}) completed as a {:?}", c.user_data, c.opcode));
            }
            if c.status.is_ok() {
                self.report.ops_ok += 1;
                match op.opcode {
                    Opcode::Read => {
                        let data = c.buf.as_deref().unwrap_or_default();
                        if data.len() != op.count * BLOCK_BYTES {
                            return Err(format!("read {} came back with {} bytes", c.user_data, data.len()));
                        }
                        self.shadow.check_read(op.first, data).map_err(|e| {
                            format!("read {} ({op:?}): {e}{}", c.user_data, self.story(op.first, op.count))
                        })?;
                    }
                    Opcode::Write | Opcode::WriteZeroes => {
                        self.shadow.acknowledged(op.first, op.count, op.gen)
                    }
                    _ => {}
                }
                continue;
            }
            self.report.ops_failed += 1;
            // An I/O error is what a failed connection gives every request, and what a
            // failing disk gives; running out of space only a failing disk.
            let explained = match c.status {
                // A connection fails its requests only when it closes for good: on a broken
                // frame, or on any loss without reconnection. A resuming one fails nothing for
                // a lost transport.
                Status::IoError => disk_faults || self.closed_clients.contains(&op.client),
                Status::NoSpace => disk_faults,
                _ => false,
            };
            if !explained {
                return Err(format!("request {} ({op:?}) failed with {}", c.user_data, c.status));
            }
            if matches!(op.opcode, Opcode::Write | Opcode::WriteZeroes) {
                self.shadow.maybe(op.first, op.count, op.gen);
            }
        }
        Ok(())
    }

    /// Every event of the requests that touched blocks `first..first + count`, oldest first.
    fn story(&self, first: usize, count: usize) -> String {
        let mut out = String::from("\n  requests on these blocks:");
        for (at, user_data, op, what) in &self.history {
            if op.count > 0 && op.first < first + count && first < op.first + op.count {
                out += &format!(
                    "\n    {at:>8} µs  #{user_data} {:?} blocks {}..{} gen {} (connection {}): {what}",
                    op.opcode,
                    op.first,
                    op.first + op.count,
                    op.gen,
                    op.connection
                );
            }
        }
        out
    }

    /// At the end, read the whole volume straight from the backend: every block must hold
    /// what the model allows, so no acknowledged write was lost.
    fn check_volume(&mut self) -> Result<(), String> {
        let mut data = vec![0u8; VOLUME_BLOCKS * BLOCK_BYTES];
        self.volume.read_at(&mut data, 0).map_err(|e| format!("reading the volume back: {e}"))?;
        self.shadow.check_read(0, &data).map_err(|e| format!("final check of the volume: {e}"))
    }
}

impl Sim {
    /// Move the initiator's bytes: handshake frames or caravans out, replies in, each handed
    /// to the handshake or the connection. Returns why the transport failed, if it did.
    fn client_io(&mut self, client: &mut Client, now: u64) -> Result<(), String> {
        self.client_send(client, now)?;
        for _ in 0..CALLS_PER_STEP {
            let Some(conn) = self.conn.as_mut() else { return Ok(()) };
            let got = match client {
                Client::Up { link, .. } if link.is_up() => {
                    let session = link.session_mut();
                    let io = &mut conn.client_io;
                    if session.data_messages() && now.is_multiple_of(4) {
                        // As a lane waiting for room to send: a receive without a placer,
                        // which must stop at a data message rather than lose it.
                        io.fill(&mut conn.client_rx)
                    } else if session.data_messages() {
                        session.receive_placing(&mut conn.client_rx, |iov, place| io.recv_placing(iov, place))
                    } else {
                        session.receive_with(&mut conn.client_rx, |iov| io.recv(iov))
                    }
                }
                _ => conn.client_io.fill(&mut conn.client_rx),
            };
            match got {
                Ok(0) => return Err("the target closed the connection".into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(format!("receive: {e}")),
            }
            self.client_handle(client, now)?;
            self.client_send(client, now)?;
        }
        Ok(())
    }

    /// Send what the client has to send: handshake frames, then caravans.
    fn client_send(&mut self, client: &mut Client, now: u64) -> Result<(), String> {
        for _ in 0..CALLS_PER_STEP {
            let Some(conn) = self.conn.as_mut() else { return Ok(()) };
            let sent = match client {
                Client::Idle => return Ok(()),
                Client::Opening { opening, .. } => {
                    if opening.poll_transmit().is_empty() {
                        return Ok(());
                    }
                    let sent = conn.client_io.send(&[IoSlice::new(opening.poll_transmit())]);
                    if let Ok(n) = sent {
                        opening.handle_sent(n);
                    }
                    sent
                }
                Client::Up { link, .. } => {
                    if !link.has_transmit() {
                        return Ok(());
                    }
                    let mut iov = [IoSlice::new(&[]); 16];
                    let n = link.poll_transmit(&mut iov);
                    let sent = conn.client_io.send(&iov[..n]);
                    if let Ok(n) = sent {
                        link.handle_sent(now, n);
                    }
                    sent
                }
            };
            match sent {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(format!("send: {e}")),
            }
        }
        Ok(())
    }

    /// Hand what the client received to the first handshake (which, done, makes the
    /// connection) or to the connection.
    fn client_handle(&mut self, client: &mut Client, now: u64) -> Result<(), String> {
        let Some(conn) = self.conn.as_mut() else { return Ok(()) };
        match client {
            Client::Idle => Ok(()),
            Client::Opening { id, opening } => {
                let Some(opened) =
                    opening.handle_rx(&mut conn.client_rx).map_err(|e| format!("handshake: {e}"))?
                else {
                    return Ok(());
                };
                let id = *id;
                let mut link: Box<ClientLink> =
                    Box::new(ClientLink::new(self.link_config.clone(), opened, now));
                #[cfg(feature = "mutations")]
                link.set_mutation(self.opts.planted.client());
                // The handshake's leftovers (none: the target says nothing unasked) go to it.
                let handled = link.handle_rx(now, &mut conn.client_rx).map(|_| ());
                *client = Client::Up { id, link, was_up: true };
                self.settle(client, handled, now)
            }
            Client::Up { link, .. } => {
                let handled = link.handle_rx(now, &mut conn.client_rx).map(|_| ());
                self.settle(client, handled, now)
            }
        }
    }
}
