//! Front ends: one connection's protocol on the target, run to completion against a [`Sink`].
//!
//! A front end takes the bytes a connection received (in its [`FrameBuffer`]), admits and
//! parses them, executes requests on the exports through the engine, and appends every reply
//! to the connection's [`Sink`]. It never touches a socket, a poll loop or a clock: the server's
//! worker is its driver over TCP and Unix sockets, and the simulator drives the same code over
//! an in-memory pipe with faults. [`native`] speaks skiff's protocol (docs/PROTOCOL.md),
//! [`nbd`] the NBD front end (docs/NBD.md).

pub mod native;
pub mod nbd;
#[cfg(test)]
mod testing;

use std::ops::Range;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use backend::Batch;

use wire::{FrameBuffer, StatsReply, Status};

use crate::stats::{bump, OpCounters};
use crate::{Export, ExportTable, Io};

/// Where a front end's replies go, in order: the driver sends them.
pub trait Sink {
    /// Bytes queued and not yet handed to the driver's socket.
    fn len(&self) -> usize;

    /// Bytes still to go out, including any the sink holds apart from [`len`](Self::len)
    /// (read data it will send by address): what the backlog bound counts.
    fn queued_bytes(&self) -> usize {
        self.len()
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Append `bytes`.
    fn append(&mut self, bytes: &[u8]);

    /// Append `len` bytes to be filled in later (descriptor slots); returns where they are.
    fn reserve(&mut self, len: usize) -> Range<usize>;

    /// The queued bytes at `range`, which this sink has not yet sent.
    fn bytes_mut(&mut self, range: Range<usize>) -> &mut [u8];

    /// Remove the bytes of `gap`, closing it up.
    fn remove(&mut self, gap: Range<usize>);

    /// Drop everything queued from `len` on (an answer taken back).
    fn truncate(&mut self, len: usize);

    /// Append a validated read's data. On failure nothing is appended. The default reads into
    /// new space here; a sink that can send straight from a RAM export's memory overrides it.
    fn append_read(&mut self, export: &Export, io: &Io) -> Status {
        let range = self.reserve(io.length as usize);
        let start = range.start;
        let status = crate::execute(export, io, &[], self.bytes_mut(range));
        if !status.is_ok() {
            self.truncate(start);
        }
        status
    }
}

/// A plain growable sink, for tests, fuzzing and the simulator.
impl Sink for Vec<u8> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn append(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }

    fn reserve(&mut self, len: usize) -> Range<usize> {
        let start = Vec::len(self);
        self.resize(start + len, 0);
        start..start + len
    }

    fn bytes_mut(&mut self, range: Range<usize>) -> &mut [u8] {
        &mut self[range]
    }

    fn remove(&mut self, gap: Range<usize>) {
        self.drain(gap);
    }

    fn truncate(&mut self, len: usize) {
        Vec::truncate(self, len);
    }
}

/// What a front end needs from the target that runs it.
pub trait Host {
    fn exports(&self) -> &ExportTable;
    /// The largest READ or WRITE the target accepts.
    fn io_bytes_max(&self) -> u32;
    /// The target's counters, for a STATS request.
    fn stats_reply(&self) -> StatsReply;

    /// Nanoseconds on the host's monotonic clock, for the service-time histograms; `None`
    /// (the default) when the host does not measure service times. Front ends read it once
    /// per request ([`Laps`]), so a host that measures pays one clock read per request.
    fn now_ns(&self) -> Option<u64> {
        None
    }

    /// Milliseconds on the host's clock, for sealing and checking capability expiry. The
    /// default, for hosts without a clock, is always 0: capabilities then never expire.
    fn clock_ms(&self) -> u64 {
        0
    }

    /// Execute a volume request (docs/PROTOCOL.md, section 17) and say how it went; the
    /// reply is sent once the change is durable. A host that serves a flash array does it
    /// through [`crate::volumes::FlashVolumes`]; the default refuses, for a host without one.
    fn volume(&self, request: &wire::VolumeRequest) -> wire::VolumeReply {
        wire::VolumeReply::refused(request.op, Status::Unsupported, "this target serves no flash array")
    }
}

/// Service times of requests served one after another: each request's time runs from the end
/// of the one before it in the same batch (or from the batch's start), so a batch of `n`
/// requests costs `n + 1` clock reads, not `2n`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Laps {
    last_ns: Option<u64>,
}

impl Laps {
    pub(crate) fn start(host: &impl Host) -> Laps {
        Laps { last_ns: host.now_ns() }
    }

    /// The time since the last lap (or the start), or `None` when the host does not measure.
    pub(crate) fn lap(&mut self, host: &impl Host) -> Option<u64> {
        let last = self.last_ns?;
        let now = host.now_ns()?;
        self.last_ns = Some(now);
        Some(now.saturating_sub(last))
    }
}

/// Upper bounds of the caravan-size histogram buckets; the last bucket is unbounded.
pub const CARAVAN_BUCKETS: [u32; 7] = [1, 2, 4, 8, 16, 32, 64];

/// What front ends count, per worker (single writer, see [`crate::stats`]).
#[derive(Debug, Default)]
pub struct FrontStats {
    pub ops: OpCounters,
    pub caravans_received: AtomicU64,
    pub caravans_sent: AtomicU64,
    pub caravan_reqs_total: AtomicU64,
    /// Received caravans by size, bucketed by [`CARAVAN_BUCKETS`].
    pub caravan_hist: [AtomicU64; CARAVAN_BUCKETS.len() + 1],
    pub connections_closed_protocol_error: AtomicU64,
    /// Capabilities handed out on reads that asked for them.
    pub capabilities_sent: AtomicU64,
}

impl FrontStats {
    /// Counters for a target with `exports` exports, one row each ([`OpCounters::new`]).
    pub fn new(exports: usize) -> FrontStats {
        FrontStats::with_room(exports, 0)
    }

    /// [`new`](Self::new), with room for `room` dynamic exports ([`OpCounters::with_room`]).
    pub fn with_room(exports: usize, room: usize) -> FrontStats {
        FrontStats { ops: OpCounters::with_room(exports, room), ..FrontStats::default() }
    }

    pub(crate) fn record_caravan(&self, reqs: usize) {
        bump(&self.caravans_received, 1);
        bump(&self.caravan_reqs_total, reqs as u64);
        let bucket = CARAVAN_BUCKETS.iter().position(|&b| reqs as u32 <= b).unwrap_or(CARAVAN_BUCKETS.len());
        bump(&self.caravan_hist[bucket], 1);
    }
}

/// What a front end may touch of its connection.
pub struct Link<'a, S: ?Sized> {
    pub rx: &'a mut FrameBuffer,
    pub tx: &'a mut S,
    /// Set to stop reading: the driver closes the connection once the queued bytes are sent.
    pub closing: &'a mut bool,
    /// The peer, for logs.
    pub peer: &'a str,
    pub stats: &'a FrontStats,
    /// A front end takes no further request once more reply bytes than this are queued: the
    /// peer is not reading them. It leaves the rest in `rx`, and the driver calls it again
    /// once the peer has drained some (`usize::MAX`: no bound).
    pub backlog_max: usize,
    /// Whether requests may run now or wait for a device ([`Gate`]).
    pub gate: Gate<'a>,
    /// Where durability is started without waiting for it ([`crate::execute_later`]): a
    /// FLUSH or FUA request is carried out, its durability started on this batch, and the
    /// front end goes on with the requests after it. The driver seals the batch after the
    /// pass ([`Later::seal`]); when anything was started, it holds every reply queued (sends
    /// none) and reads nothing more until the wake, then sends them, or closes the connection
    /// without sending them if the batch failed.
    pub later: Later<'a>,
}

/// The batch durability is started on in one processing pass ([`Link::later`]), opened when
/// first needed.
pub struct Later<'a> {
    batch: Option<&'a Arc<Batch>>,
    open: bool,
}

impl<'a> Later<'a> {
    /// `None`: durability is waited for where it is asked (no driver batch, or a staged
    /// connection).
    pub fn new(batch: Option<&'a Arc<Batch>>) -> Later<'a> {
        Later { batch, open: false }
    }

    /// The batch, opened on first use in the pass.
    pub fn batch(&mut self) -> Option<&'a Arc<Batch>> {
        let batch = self.batch?;
        if !self.open {
            batch.open();
            self.open = true;
        }
        Some(batch)
    }

    /// Whether durability was started on the batch in this pass: it is open until the seal.
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// End the pass: what the replies queued must wait for.
    pub fn seal(&mut self) -> Sealed {
        match self.batch {
            Some(batch) if std::mem::take(&mut self.open) => {
                if batch.seal() {
                    Sealed::Wait
                } else if batch.failed() {
                    // Started and already ended, in failure: the replies must not go.
                    Sealed::Failed
                } else {
                    Sealed::Free
                }
            }
            _ => Sealed::Free,
        }
    }
}

/// Where the driver parks requests that would wait on a device (a flash volume's pool
/// misses). The native front end first starts what everything it received would wait for, on
/// a batch nobody waits for ([`Batch::detached`]); while any of that is still going, it asks
/// before each request whether it is [`ready`](Self::ready): the backends prepare that request
/// on this batch ([`backend::Backend::prepare`]), and when any of its reads are still going it
/// stops there, sets [`waiting`](Self::waiting) and leaves that request and the rest where
/// they are. So a connection answers the longest prefix of its requests whose pages are in.
/// The NBD front end [looks ahead](Link::look_ahead) over everything it received at once on
/// this batch instead. The driver calls the front end again once the batch wakes it, with
/// [`resumed`](Self::resumed) set.
pub struct Gate<'a> {
    /// `None`: execute as it comes.
    pub batch: Option<&'a Arc<Batch>>,
    /// Set by the driver when the batch's wake ended a wait for reads: the request that
    /// waited runs without being prepared again (so it waits at most once; a page taken from
    /// the pool meanwhile is read the ordinary way), unless the backend had cut the batch
    /// short. Cleared by the first [`ready`](Self::ready) or [`Link::look_ahead`].
    pub resumed: bool,
    /// Set by the front end: requests wait for the batch (above).
    pub waiting: bool,
    /// Set by the front end: it stopped before a request that waits for reads started on the
    /// batch [`Later`] holds open for durability. The request runs after that batch's wake,
    /// or, when everything had ended by the seal, as soon as the driver comes back.
    pub stopped: bool,
}

impl<'a> Gate<'a> {
    pub fn new(batch: Option<&'a Arc<Batch>>, resumed: bool) -> Gate<'a> {
        Gate { batch, resumed, waiting: false, stopped: false }
    }

    /// Whether the next request may run now: `prepare` lets the backends start, on the batch,
    /// what that one request would wait for. `false`: it waits, and the front end stops before
    /// it, leaving it and the rest unexecuted. Either the batch wakes the driver when the
    /// request's reads land ([`waiting`](Self::waiting)), or, when `later` started
    /// durability on the batch earlier in the pass, its reads joined that wait
    /// ([`stopped`](Self::stopped)).
    ///
    /// The rounds of [`Link::look_ahead`] apply: a batch cut short is prepared again once
    /// what it started has ended.
    pub fn ready(&mut self, later: &Later<'_>, mut prepare: impl FnMut(&Arc<Batch>)) -> bool {
        let Some(batch) = self.batch else { return true };
        if std::mem::take(&mut self.resumed) && !batch.was_cut_short() {
            return true;
        }
        if later.is_open() {
            // The batch is open for durability until the driver seals it: the request's reads
            // join it, and the request waits for the same wake as the replies before it.
            let before = batch.started();
            prepare(batch);
            self.stopped = batch.started() > before;
            return !self.stopped;
        }
        self.waiting = prepare_rounds(batch, || prepare(batch));
        !self.waiting
    }
}

/// Most reads one look-ahead starts over rounds that end before their seal
/// ([`Link::look_ahead`]): 16 MiB of pages at least (a device read may cover several neighbouring
/// pages), then the requests run and read the rest.
pub const LOOK_AHEAD_READS_MAX: usize = 4096;

/// What a pass's replies must wait for ([`Later::seal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sealed {
    /// Nothing, or durability that is done already: send them.
    Free,
    /// Durability still going: hold them until the batch wakes the driver, then check
    /// [`Batch::failed`].
    Wait,
    /// Durability that failed already: never send them; close the connection.
    Failed,
}

impl<'a, S: ?Sized> Link<'a, S> {
    /// Look ahead when the driver gave a batch and `may_wait` says a backend of this
    /// connection could use it: `prepare` lets the backends start, on the batch, what the
    /// requests received (the bytes it is given) would wait for. Returns whether they wait for it (the front end then
    /// executes nothing and leaves them in `rx`).
    ///
    /// A backend whose read queue was full starts only part and cuts the batch short. When
    /// everything it did start has ended before the seal (a fast device), nothing is waited
    /// for, yet the rest was never started: the look-ahead goes round again at once rather
    /// than leave those pages to be read on the driver's thread. A round that started nothing
    /// ends the look (the queue is full of others' reads; the requests read the rest), and so
    /// do [`LOOK_AHEAD_READS_MAX`] reads started in one look: rounds whose reads fail, or
    /// whose pages are evicted as fast as they land, would otherwise go round for ever.
    pub fn look_ahead(&mut self, may_wait: bool, mut prepare: impl FnMut(&[u8], &Arc<Batch>)) -> bool {
        let gate = &mut self.gate;
        let Some(batch) = gate.batch.filter(|_| may_wait) else { return false };
        if std::mem::take(&mut gate.resumed) && !batch.was_cut_short() {
            return false;
        }
        let rx = &*self.rx;
        gate.waiting = prepare_rounds(batch, || prepare(rx.unconsumed(), batch));
        gate.waiting
    }
}

/// Open `batch`, `prepare` on it and seal it, again while a backend cut it short and the
/// rounds start something (up to [`LOOK_AHEAD_READS_MAX`] reads): whether the driver must
/// wait for its wake.
fn prepare_rounds(batch: &Arc<Batch>, mut prepare: impl FnMut()) -> bool {
    let mut started = 0;
    loop {
        batch.open();
        prepare();
        if batch.seal() {
            return true;
        }
        started += batch.started();
        if !batch.was_cut_short() || batch.started() == 0 || started >= LOOK_AHEAD_READS_MAX {
            return false;
        }
    }
}

impl<S: Sink + ?Sized> Link<'_, S> {
    /// Whether the replies queued passed [`backlog_max`](Self::backlog_max): take no more
    /// requests now.
    pub fn backlogged(&self) -> bool {
        self.tx.queued_bytes() > self.backlog_max
    }
}

impl<S: ?Sized> Link<'_, S> {
    /// The peer broke the protocol: log why, count it, and close once queued bytes are sent.
    pub fn protocol_error(&mut self, reason: &str) {
        tracing::warn!(peer = %self.peer, reason, "closing connection: protocol error");
        bump(&self.stats.connections_closed_protocol_error, 1);
        *self.closing = true;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use backend::Wake;

    use super::*;

    struct Nobody;

    impl Wake for Nobody {
        fn wake(&self, _token: u64) {}
    }

    /// Run `f` on a link over empty buffers with `batch`.
    fn with_link<R>(batch: Option<&Arc<Batch>>, f: impl FnOnce(&mut Link<'_, Vec<u8>>) -> R) -> R {
        let (mut rx, mut tx, mut closing, stats) =
            (FrameBuffer::new(), Vec::<u8>::new(), false, FrontStats::default());
        let mut link = Link {
            rx: &mut rx,
            tx: &mut tx,
            closing: &mut closing,
            peer: "test",
            stats: &stats,
            backlog_max: usize::MAX,
            gate: Gate::new(batch, false),
            later: Later::new(None),
        };
        f(&mut link)
    }

    /// Drive `Link::look_ahead` with a `prepare` given each round's number and the batch;
    /// returns whether it parked and how many rounds ran.
    fn rounds(prepare: impl Fn(u32, &Arc<Batch>)) -> (bool, u32) {
        let batch = Arc::new(Batch::new(Arc::new(Nobody), 7));
        with_link(Some(&batch), |link| {
            let mut round = 0;
            let parked = link.look_ahead(true, |_, b| {
                prepare(round, b);
                round += 1;
            });
            assert_eq!(parked, link.gate.waiting);
            (parked, round)
        })
    }

    /// A read that ended before the seal: started and done at once.
    fn ended_at_once(b: &Batch) {
        b.add();
        b.done();
    }

    #[test]
    fn a_round_cut_short_whose_reads_all_ended_goes_round_again() {
        // Two rounds cut short by a full queue, each of whose reads landed before the seal
        // (a fast device), then a round that starts the rest: three rounds, no park.
        let (parked, n) = rounds(|round, b| {
            ended_at_once(b);
            if round < 2 {
                b.cut_short();
            }
        });
        assert_eq!((parked, n), (false, 3));
    }

    #[test]
    fn rounds_that_never_finish_the_look_end_after_a_bound() {
        // Every round's reads fail at once and must be started again (or are evicted as
        // they land): the look ends once it has started its bound of reads.
        let per_round = 16;
        let (parked, n) = rounds(|_, b| {
            for _ in 0..per_round {
                ended_at_once(b);
            }
            b.cut_short();
        });
        assert!(!parked);
        assert_eq!(n as usize, LOOK_AHEAD_READS_MAX.div_ceil(per_round));
    }

    #[test]
    fn a_round_with_reads_still_going_parks() {
        let held = Mutex::new(None);
        let (parked, n) = rounds(|_, b| {
            b.add();
            b.cut_short();
            *held.lock().unwrap() = Some(b.clone());
        });
        assert_eq!((parked, n), (true, 1), "the driver looks again on the wake, not now");
        held.lock().unwrap().take().unwrap().done();
    }

    #[test]
    fn a_round_cut_short_that_started_nothing_ends_the_look() {
        // The queue is full of other connections' reads: spinning would not free it.
        assert_eq!(rounds(|_, b| b.cut_short()), (false, 1));
        assert_eq!(rounds(|_, _| {}), (false, 1));
    }

    #[test]
    fn without_a_batch_or_a_backend_that_waits_nothing_is_prepared() {
        let batch = Arc::new(Batch::new(Arc::new(Nobody), 7));
        with_link(Some(&batch), |link| {
            assert!(!link.look_ahead(false, |_, _| panic!("prepared without a backend that waits")));
        });
        with_link(None, |link| assert!(!link.look_ahead(true, |_, _| panic!("prepared without a batch"))));
    }
}
