//! The export table: every export a target serves, reached by index on the data path without
//! a lock, and by name when a connection opens one. It owns which exports exist and how one
//! stops existing; what an export is and how requests run on it are [`crate::Export`]'s and
//! the front ends'.
//!
//! **Two kinds of export.** The exports given at start-up (`--export`) are *fixed*: a plain
//! array, never changed, so reaching one by index is a bounds check and nothing more, as it was
//! before exports could come and go. The exports made while the target runs (flash volumes,
//! their snapshots and clones) are *dynamic*: they live in a second array of `room` slots,
//! allocated at start-up, each a [`OnceLock`] filled exactly once and in order. Publication is
//! the `OnceLock`'s own release store, so a worker that finds a slot filled sees the whole
//! export behind it; reaching a dynamic export by index costs a bounds check, one load of the
//! slot's state and one of its retirement flag, and never a lock. Index `i` names fixed export
//! `i`, and index `fixed + j` dynamic slot `j`.
//!
//! **Indexes are never reused.** A retired export keeps its slot for the life of the target,
//! so a handle (which names an index) can never come to mean another export than the one it
//! opened, and per-index counters never mix two exports' figures. The price is that a target
//! makes at most `room` dynamic exports in its life; it says so when it runs out, and a
//! restart (which re-exports the volumes that exist) starts afresh.
//!
//! **Retiring.** Each dynamic export counts the connections using it, as [`Lease`]s: a native
//! connection takes one when it first opens the export and an NBD connection when its
//! transmission starts on it, and drops it when the connection closes (the lease's `Drop`, so
//! no path that ends a connection can forget). [`ExportTable::retire`] refuses while leases are
//! out. Taking a lease and retiring are a Dekker pair on two sequentially consistent atomics: a
//! lease is counted and then checks that the export is live; retirement marks it closing and
//! then checks that no lease is counted. At least one of the two sees the other, so either the
//! retirement fails (`Busy`) or the lease does (`NotFound`): an export is never retired with a
//! connection on it. While it is closing, new leases fail and requests on existing handles go
//! on; once retired, [`ExportTable::get`] and [`ExportTable::find`] no longer see it, so a
//! request that named it would get `BadHandle` and an OPEN `NotFound` (there are none: no
//! connection holds it). A closing export that is not retired after all (the volume could not
//! be deleted) is live again when its [`Retiring`] guard drops.
//!
//! Writers (adding and retiring, on the control path) take one mutex among themselves; readers
//! never take it.

use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use wire::Status;

use crate::Export;

const LIVE: u8 = 0;
const CLOSING: u8 = 1;
const RETIRED: u8 = 2;

/// The connections on one dynamic export, and whether it is going.
#[derive(Debug, Default)]
struct Life {
    leases: AtomicU32,
    state: AtomicU8,
}

#[derive(Debug)]
struct Slot {
    export: Export,
    life: Arc<Life>,
}

/// The exports of one target: fixed ones from start-up, and room for dynamic ones added while
/// it runs (see the module docs).
#[derive(Debug, Default)]
pub struct ExportTable {
    fixed: Box<[Export]>,
    slots: Box<[OnceLock<Slot>]>,
    /// The next free slot; held by writers (adding, retiring) only.
    writer: Mutex<usize>,
}

/// A connection's hold on an export: while any is out, the export cannot be retired. Dropping
/// it lets go. Holds nothing for a fixed export, which is never retired.
#[derive(Debug)]
pub struct Lease(Option<Arc<Life>>);

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(life) = &self.0 {
            life.leases.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Why a dynamic export could not be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddError {
    #[error("an export named {0:?} exists already")]
    NameTaken(String),
    #[error("this target has made {0} exports while running, its most (indexes are never reused): restart it to make more")]
    Full(usize),
}

/// Why an export could not be retired.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RetireError {
    #[error("no such export")]
    NotFound,
    #[error("export {0:?} was given at start-up and cannot be retired")]
    Fixed(String),
    #[error("{0} connection(s) have it open")]
    InUse(u32),
}

/// An export on its way out: no new lease is granted on it. [`finish`](Self::finish) retires
/// it; dropping the guard without finishing makes it live again.
#[derive(Debug)]
pub struct Retiring<'a> {
    life: &'a Life,
    done: bool,
}

impl Retiring<'_> {
    /// Retire the export for good: from now on the table does not see it.
    pub fn finish(mut self) {
        self.life.state.store(RETIRED, Ordering::SeqCst);
        self.done = true;
    }
}

impl Drop for Retiring<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.life.state.store(LIVE, Ordering::SeqCst);
        }
    }
}

impl ExportTable {
    /// A table of fixed exports only.
    pub fn new(exports: Vec<Export>) -> ExportTable {
        ExportTable::with_room(exports, 0)
    }

    /// Fixed `exports`, and room for `room` dynamic ones over the target's life.
    pub fn with_room(exports: Vec<Export>, room: usize) -> ExportTable {
        ExportTable {
            fixed: exports.into_boxed_slice(),
            slots: (0..room).map(|_| OnceLock::new()).collect(),
            writer: Mutex::new(0),
        }
    }

    /// The export at `index`, unless it was retired. The data path's lookup: no lock.
    #[inline]
    pub fn get(&self, index: u32) -> Option<&Export> {
        let i = index as usize;
        match self.fixed.get(i) {
            Some(e) => Some(e),
            None => self.dynamic(i - self.fixed.len()),
        }
    }

    fn dynamic(&self, slot: usize) -> Option<&Export> {
        let s = self.slots.get(slot)?.get()?;
        (s.life.state.load(Ordering::Relaxed) != RETIRED).then_some(&s.export)
    }

    /// Every export not retired, with its index, fixed ones first, in the order added.
    pub fn entries(&self) -> impl Iterator<Item = (u32, &Export)> {
        let fixed = self.fixed.iter().enumerate().map(|(i, e)| (i as u32, e));
        let base = self.fixed.len();
        let dynamic = self
            .slots
            .iter()
            .map_while(OnceLock::get)
            .enumerate()
            .filter(|(_, s)| s.life.state.load(Ordering::Relaxed) != RETIRED)
            .map(move |(j, s)| ((base + j) as u32, &s.export));
        fixed.chain(dynamic)
    }

    /// Every export not retired.
    pub fn iter(&self) -> impl Iterator<Item = &Export> {
        self.entries().map(|(_, e)| e)
    }

    /// Index and export by name, among those not retired.
    pub fn find(&self, name: &str) -> Option<(u32, &Export)> {
        self.entries().find(|(_, e)| e.name == name)
    }

    /// Exports not retired.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `index` names a fixed export (given at start-up).
    pub fn is_fixed(&self, index: u32) -> bool {
        (index as usize) < self.fixed.len()
    }

    /// Indexes there can ever be: fixed exports and dynamic slots.
    pub fn capacity(&self) -> usize {
        self.fixed.len() + self.slots.len()
    }

    /// Exports given at start-up.
    pub fn fixed_len(&self) -> usize {
        self.fixed.len()
    }

    /// Dynamic exports that can still be added.
    pub fn room(&self) -> usize {
        self.slots.len() - *self.writer.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn infos(&self) -> Vec<wire::ExportInfo> {
        self.iter().map(Export::info).collect()
    }

    /// Hold export `index` for a connection: `NotFound` when it is retired or going.
    pub fn lease(&self, index: u32) -> Result<Lease, Status> {
        let i = index as usize;
        if i < self.fixed.len() {
            return Ok(Lease(None));
        }
        let slot = self.slots.get(i - self.fixed.len()).and_then(OnceLock::get).ok_or(Status::NotFound)?;
        slot.life.leases.fetch_add(1, Ordering::SeqCst);
        let lease = Lease(Some(slot.life.clone()));
        if slot.life.state.load(Ordering::SeqCst) != LIVE {
            return Err(Status::NotFound); // the lease drops here
        }
        Ok(lease)
    }

    /// Connections holding export `index` now (0 for a fixed export, which is not counted).
    pub fn leases(&self, index: u32) -> u32 {
        let i = index as usize;
        let slot = i.checked_sub(self.fixed.len()).and_then(|j| self.slots.get(j)).and_then(OnceLock::get);
        slot.map_or(0, |s| s.life.leases.load(Ordering::SeqCst))
    }

    /// Add a dynamic export, whose name no export of the table has. `before` runs with the
    /// index it will have, before any reader can see it (to make room for it elsewhere, such
    /// as its counters).
    pub fn add(&self, export: Export, before: impl FnOnce(u32)) -> Result<u32, AddError> {
        let mut next = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if self.find(&export.name).is_some() {
            return Err(AddError::NameTaken(export.name));
        }
        let Some(slot) = self.slots.get(*next) else { return Err(AddError::Full(self.slots.len())) };
        let index = (self.fixed.len() + *next) as u32;
        before(index);
        // Writers are serialised and `next` only grows, so the slot is empty.
        let _ = slot.set(Slot { export, life: Arc::default() });
        *next += 1;
        Ok(index)
    }

    /// Start retiring dynamic export `index`: refused while connections hold it.
    pub fn retire(&self, index: u32) -> Result<Retiring<'_>, RetireError> {
        let _writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let i = index as usize;
        if let Some(e) = self.fixed.get(i) {
            return Err(RetireError::Fixed(e.name.clone()));
        }
        let slot =
            self.slots.get(i - self.fixed.len()).and_then(OnceLock::get).ok_or(RetireError::NotFound)?;
        let life = &*slot.life;
        if life.state.load(Ordering::SeqCst) != LIVE {
            return Err(RetireError::NotFound);
        }
        // Checked once before marking, so that a busy export's own connections never see it
        // closing; and once after, for a lease taken in between (see the module docs).
        let busy = |life: &Life| match life.leases.load(Ordering::SeqCst) {
            0 => Ok(()),
            n => Err(RetireError::InUse(n)),
        };
        busy(life)?;
        life.state.store(CLOSING, Ordering::SeqCst);
        let guard = Retiring { life, done: false };
        busy(life)?; // the guard drops: live again
        Ok(guard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BackendSpec;

    fn ram(name: &str) -> Export {
        Export::open(name, &BackendSpec::Ram { size_bytes: 1 << 20 }, false).unwrap()
    }

    #[test]
    fn dynamic_exports_get_new_indexes_and_retire_out_of_sight() {
        let t = ExportTable::with_room(vec![ram("fixed")], 3);
        assert_eq!(t.add(ram("a"), |i| assert_eq!(i, 1)), Ok(1));
        assert_eq!(
            t.add(ram("fixed"), |_| panic!("no room made for a refused export")),
            Err(AddError::NameTaken("fixed".into()))
        );
        assert_eq!(t.add(ram("b"), |_| {}), Ok(2));
        assert_eq!(t.find("b").map(|(i, _)| i), Some(2));
        assert!(matches!(t.retire(0), Err(RetireError::Fixed(_))));

        t.retire(1).unwrap().finish();
        assert!(t.get(1).is_none() && t.find("a").is_none());
        assert_eq!(t.lease(1).err(), Some(Status::NotFound));
        assert_eq!(t.retire(1).err(), Some(RetireError::NotFound));
        // The name is free again, under a new index; the old one stays retired.
        assert_eq!(t.add(ram("a"), |_| {}), Ok(3));
        assert_eq!(t.find("a").map(|(i, _)| i), Some(3));
        assert_eq!(t.entries().map(|(i, _)| i).collect::<Vec<_>>(), [0, 2, 3]);
        assert_eq!(t.add(ram("c"), |_| {}), Err(AddError::Full(3)));
        assert_eq!((t.len(), t.capacity()), (3, 4));
    }

    #[test]
    fn an_export_with_connections_is_not_retired() {
        let t = ExportTable::with_room(vec![], 1);
        let i = t.add(ram("v"), |_| {}).unwrap();
        let lease = t.lease(i).unwrap();
        let again = t.lease(i).unwrap();
        assert_eq!(t.leases(i), 2);
        assert_eq!(t.retire(i).err(), Some(RetireError::InUse(2)));
        assert!(t.lease(i).is_ok(), "a refused retirement leaves it live");
        drop((lease, again));
        assert_eq!(t.leases(i), 0);
        let going = t.retire(i).unwrap();
        assert_eq!(t.lease(i).err(), Some(Status::NotFound), "no lease while it goes");
        assert_eq!(t.leases(i), 0, "the refused lease let go");
        assert!(t.get(i).is_some(), "requests go on until it is retired");
        drop(going);
        assert!(t.lease(i).is_ok(), "not retired after all: live again");
    }

    /// Leases taken on other threads while one retires: no lease is granted on a retired
    /// export, and none is left held.
    #[test]
    fn leases_and_retirement_race_safely() {
        for _ in 0..50 {
            let t = Arc::new(ExportTable::with_room(vec![], 1));
            let i = t.add(ram("v"), |_| {}).unwrap();
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let takers: Vec<_> = (0..2)
                .map(|_| {
                    let (t, stop) = (t.clone(), stop.clone());
                    std::thread::spawn(move || {
                        let mut after_retired = 0;
                        while !stop.load(Ordering::SeqCst) {
                            if let Ok(lease) = t.lease(i) {
                                if t.get(i).is_none() {
                                    after_retired += 1;
                                }
                                drop(lease);
                            }
                        }
                        after_retired
                    })
                })
                .collect();
            loop {
                match t.retire(i) {
                    Ok(going) => {
                        going.finish();
                        break;
                    }
                    Err(RetireError::InUse(_)) => std::thread::yield_now(),
                    Err(e) => panic!("{e}"),
                }
            }
            // The takers go on against the retired export for a moment, then stop. A taker
            // refused counts itself for an instant before it lets go (`lease`), so the count
            // is read once they have stopped: none may be left holding the export.
            for _ in 0..100 {
                std::thread::yield_now();
            }
            stop.store(true, Ordering::SeqCst);
            for taker in takers {
                assert_eq!(taker.join().unwrap(), 0, "a lease held on a retired export");
            }
            assert_eq!(t.leases(i), 0);
        }
    }
}
