//! Test pieces shared by the front ends' tests: a rig that drives a connection pass by pass as
//! the server does, a volume whose pages must be read before requests on them run, a host, and
//! a wake counter.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use backend::{Backend, Batch, Wake};
use wire::{FrameBuffer, StatsReply};

use super::{FrontStats, Gate, Host, Later, Link, Sealed};
use crate::{BackendSpec, ExportTable};

/// A front end as [`Rig`] drives it.
pub(crate) trait Front {
    fn process(&mut self, link: &mut Link<'_, Vec<u8>>, host: &TestHost);
}

impl Front for super::native::NativeConn {
    fn process(&mut self, link: &mut Link<'_, Vec<u8>>, host: &TestHost) {
        super::native::NativeConn::process(self, link, host);
    }
}

impl Front for super::nbd::NbdConn {
    fn process(&mut self, link: &mut Link<'_, Vec<u8>>, host: &TestHost) {
        super::nbd::NbdConn::process(self, link, host);
    }
}

/// A connection of front end `C` to one export, "vol", over a [`Cold`] volume, driven pass by
/// pass as the server's driver does: its gate and its durability share one batch, whose wakes
/// are counted.
pub(crate) struct Rig<C> {
    pub(crate) conn: C,
    pub(crate) host: TestHost,
    pub(crate) cold: Arc<Cold>,
    pub(crate) rx: FrameBuffer,
    pub(crate) tx: Vec<u8>,
    pub(crate) stats: FrontStats,
    woken: Arc<Woken>,
    batch: Arc<Batch>,
}

impl<C: Front> Rig<C> {
    /// The connection `conn` makes for the host, over a volume whose pages at `cold` offsets
    /// must be read first; its handshake is the caller's.
    pub(crate) fn over(cold: &[u64], conn: impl FnOnce(&TestHost) -> C) -> Rig<C> {
        let cold = Cold::new(cold);
        let host =
            TestHost { exports: ExportTable::new(vec![crate::Export::new("vol", cold.clone(), false)]) };
        let woken = Arc::new(Woken::default());
        Rig {
            conn: conn(&host),
            host,
            cold,
            rx: FrameBuffer::new(),
            tx: Vec::new(),
            stats: FrontStats::default(),
            batch: Arc::new(Batch::new(woken.clone(), 9)),
            woken,
        }
    }

    /// One processing pass, with `between` run after the front end and before the seal; the
    /// replies stay queued in `tx`. Returns how the pass ended: whether it waits for reads,
    /// whether it stopped behind durability, and what the seal said.
    pub(crate) fn run(&mut self, resumed: bool, between: impl FnOnce(&Cold)) -> (bool, bool, Sealed) {
        let mut closing = false;
        let mut link = Link {
            rx: &mut self.rx,
            tx: &mut self.tx,
            closing: &mut closing,
            peer: "test",
            stats: &self.stats,
            backlog_max: usize::MAX,
            gate: Gate::new(Some(&self.batch), resumed),
            later: Later::new(Some(&self.batch)),
        };
        self.conn.process(&mut link, &self.host);
        between(&self.cold);
        let ended = (link.gate.waiting, link.gate.stopped, link.later.seal());
        assert!(!closing, "the pass closed the connection");
        ended
    }

    /// Wakes of the batch so far.
    pub(crate) fn woken(&self) -> u32 {
        *self.woken.0.lock().unwrap()
    }
}

/// A RAM volume whose pages at `cold` offsets must be read first: preparing a request on
/// one adds to the batch, which [`land`](Cold::land) ends.
pub(crate) struct Cold {
    pub(crate) ram: Arc<dyn Backend>,
    pub(crate) cold: Mutex<BTreeSet<u64>>,
    /// The batches waiting for each cold offset's read.
    pub(crate) going: Mutex<Vec<(u64, Arc<Batch>)>>,
    /// Every offset prepared, in order.
    prepared: Mutex<Vec<u64>>,
    /// Durability started on batches (FLUSH and FUA), not done yet.
    syncing: Mutex<Vec<Arc<Batch>>>,
}

impl Cold {
    pub(crate) fn new(cold: &[u64]) -> Arc<Cold> {
        let ram = backend::open(&BackendSpec::Ram { size_bytes: 1 << 20 }, false).unwrap();
        // Every byte says where it lies, so a reply with another request's data shows.
        let pattern: Vec<u8> = (0..1u32 << 20).map(|i| (i / 4096 * 7 + i % 251) as u8).collect();
        ram.write_at(&pattern, 0, false).unwrap();
        Arc::new(Cold {
            ram,
            cold: Mutex::new(cold.iter().copied().collect()),
            going: Mutex::default(),
            prepared: Mutex::default(),
            syncing: Mutex::default(),
        })
    }

    /// The read of the page at `offset` lands.
    pub(crate) fn land(&self, offset: u64) {
        self.cold.lock().unwrap().remove(&offset);
        let mut going = self.going.lock().unwrap();
        let (landed, left) = going.drain(..).partition::<Vec<_>, _>(|(o, _)| *o == offset);
        *going = left;
        drop(going);
        landed.into_iter().for_each(|(_, b)| b.done());
    }

    pub(crate) fn synced(&self) {
        std::mem::take(&mut *self.syncing.lock().unwrap()).into_iter().for_each(|b| b.done());
    }

    pub(crate) fn prepared(&self) -> Vec<u64> {
        std::mem::take(&mut *self.prepared.lock().unwrap())
    }
}

impl Backend for Cold {
    fn kind(&self) -> &'static str {
        "cold"
    }
    fn size_bytes(&self) -> u64 {
        self.ram.size_bytes()
    }
    fn block_size(&self) -> u32 {
        self.ram.block_size()
    }
    fn is_read_only(&self) -> bool {
        false
    }
    fn capabilities(&self) -> backend::Capabilities {
        backend::Capabilities::ALL
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> backend::Result<()> {
        assert!(!self.cold.lock().unwrap().contains(&offset), "a read ran before its page landed");
        self.ram.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> backend::Result<()> {
        self.ram.write_at(buf, offset, fua)
    }
    fn flush(&self) -> backend::Result<()> {
        Ok(())
    }
    fn trim(&self, offset: u64, len: u64) -> backend::Result<()> {
        self.ram.trim(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> backend::Result<()> {
        self.ram.write_zeroes(offset, len, fua)
    }
    fn prepare(&self, offset: u64, _len: u64, _write: bool, batch: &Arc<Batch>) {
        self.prepared.lock().unwrap().push(offset);
        if self.cold.lock().unwrap().contains(&offset) {
            batch.add();
            self.going.lock().unwrap().push((offset, batch.clone()));
        }
    }
    fn may_wait(&self) -> bool {
        true
    }
    fn syncs_later(&self) -> bool {
        true
    }
    fn sync_later(&self, batch: &Arc<Batch>) {
        batch.add();
        self.syncing.lock().unwrap().push(batch.clone());
    }
}

pub(crate) struct TestHost {
    pub(crate) exports: ExportTable,
}

impl Host for TestHost {
    fn exports(&self) -> &ExportTable {
        &self.exports
    }
    fn io_bytes_max(&self) -> u32 {
        1 << 16
    }
    fn stats_reply(&self) -> StatsReply {
        StatsReply { entries: Vec::new() }
    }
}

#[derive(Default)]
pub(crate) struct Woken(pub(crate) Mutex<u32>);

impl Wake for Woken {
    fn wake(&self, _token: u64) {
        *self.0.lock().unwrap() += 1;
    }
}
