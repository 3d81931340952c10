//! Test pieces shared by the front ends' tests: a volume whose pages must be read before
//! requests on them run, a host, and a wake counter.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use backend::{Backend, Batch, Wake};
use wire::{FrameBuffer, StatsReply};

use super::{FrontStats, Gate, Host, Later, Link, Sealed};
use crate::{BackendSpec, ExportTable};

/// One processing pass, as the server's driver runs it: `process` (the front end, and
/// whatever should happen before the seal) over a link whose gate and durability share
/// `batch`. Returns how the pass ended: whether it waits for reads, whether it stopped behind
/// durability, and what the seal said.
pub(crate) fn driver_pass(
    rx: &mut FrameBuffer,
    tx: &mut Vec<u8>,
    stats: &FrontStats,
    batch: &Arc<Batch>,
    resumed: bool,
    process: impl FnOnce(&mut Link<'_, Vec<u8>>),
) -> (bool, bool, Sealed) {
    let mut closing = false;
    let mut link = Link {
        rx,
        tx,
        closing: &mut closing,
        peer: "test",
        stats,
        backlog_max: usize::MAX,
        gate: Gate::new(Some(batch), resumed),
        later: Later::new(Some(batch)),
    };
    process(&mut link);
    let ended = (link.gate.waiting, link.gate.stopped, link.later.seal());
    assert!(!closing, "the pass closed the connection");
    ended
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
