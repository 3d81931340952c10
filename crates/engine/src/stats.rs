//! Per-worker request counters, per export.
//!
//! Each worker owns one [`OpCounters`] and is its only writer, so updates are plain relaxed
//! loads and stores (no locked read-modify-write); any thread may read them for a stats reply
//! or a metrics scrape. The table has one row per export, indexed by the export's index in the
//! [`ExportTable`](crate::ExportTable), so counting a request takes neither a lock nor a lookup
//! nor an allocation. The rows of the exports given at start-up are allocated with the table;
//! a dynamic export's row is allocated by the control path that adds the export
//! ([`OpCounters::add_row`]), before any worker can see the export, and published through a
//! `OnceLock` like the export itself. Rows are aligned to a cache line so two rows (and two
//! workers' tables) never share one.
//!
//! A row counts requests by opcode and status, payload bytes by opcode, and service times by
//! opcode in a histogram whose bucket bounds are powers of two of nanoseconds, so finding a
//! request's bucket is one leading-zero count. The service time itself is measured by the
//! front ends through [`Host::now_ns`](crate::front::Host::now_ns); this module only files it.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

use wire::{Opcode, Status};

/// Status counters per opcode: wire codes 0 to 23, and one slot for every other code.
pub const STATUS_SLOTS: usize = 25;

/// Service-time buckets: upper bounds of 2^8 ns (256 ns) to 2^30 ns (about 1.07 s), doubling,
/// then one unbounded bucket. 256 ns is below any request a backend serves; a second is far
/// above a healthy one, where only the count matters.
pub const SERVICE_BUCKETS: usize = 24;
const SERVICE_BUCKET_MIN_LOG2: u32 = 8;

/// The upper bound of service-time bucket `i` in nanoseconds; `None` for the last, unbounded
/// one.
pub fn service_bucket_bound_ns(i: usize) -> Option<u64> {
    (i + 1 < SERVICE_BUCKETS).then(|| 1u64 << (SERVICE_BUCKET_MIN_LOG2 + i as u32))
}

/// The bucket of a service time: the first whose bound is at least `ns`.
fn service_bucket(ns: u64) -> usize {
    // Bit length of ns - 1 is the log2 of the smallest power of two >= ns.
    let log2_ceil = 64 - ns.saturating_sub(1).leading_zeros();
    (log2_ceil.saturating_sub(SERVICE_BUCKET_MIN_LOG2) as usize).min(SERVICE_BUCKETS - 1)
}

/// The counter slot of a status.
pub fn status_slot(status: Status) -> usize {
    usize::from(status.to_u16()).min(STATUS_SLOTS - 1)
}

/// The status a counter slot stands for (the last slot stands for every unknown code).
pub fn slot_status(slot: usize) -> Status {
    Status::from_u16(slot.min(STATUS_SLOTS - 1) as u16)
}

/// A single-writer increment: the owner is the only thread that stores, so a load and a
/// store replace a locked read-modify-write. Shared with the target's own counters.
pub fn bump(counter: &AtomicU64, by: u64) {
    counter.store(counter.load(Relaxed) + by, Relaxed);
}

/// Service times of one opcode on one export.
#[derive(Debug, Default)]
pub struct ServiceTimes {
    buckets: [AtomicU64; SERVICE_BUCKETS],
    sum_ns: AtomicU64,
}

impl ServiceTimes {
    fn record(&self, ns: u64) {
        bump(&self.buckets[service_bucket(ns)], 1);
        bump(&self.sum_ns, ns);
    }

    /// Requests per bucket (not cumulative) and the sum of their service times.
    pub fn snapshot(&self) -> ([u64; SERVICE_BUCKETS], u64) {
        (self.buckets.each_ref().map(|b| b.load(Relaxed)), self.sum_ns.load(Relaxed))
    }
}

/// One worker's counters for one export.
#[derive(Debug, Default)]
#[repr(align(64))]
pub struct ExportOps {
    reqs: [[AtomicU64; STATUS_SLOTS]; Opcode::COUNT],
    bytes: [AtomicU64; Opcode::COUNT],
    service: [ServiceTimes; Opcode::COUNT],
}

impl ExportOps {
    /// Requests of `opcode` answered with the status of counter slot `slot`.
    pub fn reqs(&self, opcode: Opcode, slot: usize) -> u64 {
        self.reqs[opcode.index()][slot].load(Relaxed)
    }

    /// Requests of `opcode`, any status.
    pub fn reqs_any(&self, opcode: Opcode) -> u64 {
        self.reqs[opcode.index()].iter().map(|c| c.load(Relaxed)).sum()
    }

    /// Requests answered with something other than `Ok`, any opcode.
    pub fn errors(&self) -> u64 {
        self.reqs.iter().flat_map(|by_status| &by_status[1..]).map(|c| c.load(Relaxed)).sum()
    }

    /// Payload bytes of successful requests (reads and writes carry any).
    pub fn bytes(&self, opcode: Opcode) -> u64 {
        self.bytes[opcode.index()].load(Relaxed)
    }

    pub fn service(&self, opcode: Opcode) -> &ServiceTimes {
        &self.service[opcode.index()]
    }
}

/// One worker's request counters: a row per export, one for requests that named no export
/// open on their connection, and the requests refused before their opcode was known.
#[derive(Debug, Default)]
pub struct OpCounters {
    exports: Box<[ExportOps]>,
    /// Rows of the dynamic exports, by index past the fixed ones ([`add_row`](Self::add_row)).
    dynamic: Box<[OnceLock<Box<ExportOps>>]>,
    no_export: ExportOps,
    undecoded: [AtomicU64; STATUS_SLOTS],
}

impl OpCounters {
    /// Counters for a target with `exports` exports (allocated here, never on the data path).
    pub fn new(exports: usize) -> OpCounters {
        OpCounters::with_room(exports, 0)
    }

    /// [`new`](Self::new), with room for the rows of `room` dynamic exports.
    pub fn with_room(exports: usize, room: usize) -> OpCounters {
        OpCounters {
            exports: (0..exports).map(|_| ExportOps::default()).collect(),
            dynamic: (0..room).map(|_| OnceLock::new()).collect(),
            ..OpCounters::default()
        }
    }

    /// Make the row of dynamic export `index` (the control path, before the export is
    /// published). An index without room, or a fixed export's, is left alone.
    pub fn add_row(&self, index: u32) {
        if let Some(slot) = (index as usize).checked_sub(self.exports.len()).and_then(|j| self.dynamic.get(j))
        {
            slot.get_or_init(Box::default);
        }
    }

    /// Count one answered request on `export` (an index into the export table; `None` when the
    /// request named no export). Bytes count only for successful reads and writes.
    /// `service_ns`, when the host measures it, is how long the request took to serve.
    pub fn record(
        &self,
        export: Option<u32>,
        opcode: Opcode,
        length: u32,
        status: Status,
        service_ns: Option<u64>,
    ) {
        let row = export.and_then(|i| self.export(i)).unwrap_or(&self.no_export);
        let op = opcode.index();
        bump(&row.reqs[op][status_slot(status)], 1);
        if status.is_ok()
            && matches!(opcode, Opcode::Read | Opcode::Write | Opcode::DirectRead | Opcode::DirectWrite)
        {
            bump(&row.bytes[op], length.into());
        }
        if let Some(ns) = service_ns {
            row.service[op].record(ns);
        }
    }

    /// Count a request refused before its opcode was known.
    pub fn record_refused(&self, status: Status) {
        bump(&self.undecoded[status_slot(status)], 1);
    }

    /// The row of export `index`, if the table has one.
    #[inline]
    pub fn export(&self, index: u32) -> Option<&ExportOps> {
        let i = index as usize;
        match self.exports.get(i) {
            Some(row) => Some(row),
            None => self.dynamic.get(i - self.exports.len())?.get().map(|row| &**row),
        }
    }

    /// Requests that named no export open on their connection.
    pub fn no_export(&self) -> &ExportOps {
        &self.no_export
    }

    /// Requests refused before their opcode was known, with the status of counter slot `slot`.
    pub fn undecoded(&self, slot: usize) -> u64 {
        self.undecoded[slot].load(Relaxed)
    }

    fn rows(&self) -> impl Iterator<Item = &ExportOps> {
        let dynamic = self.dynamic.iter().filter_map(|r| r.get().map(|row| &**row));
        self.exports.iter().chain(dynamic).chain([&self.no_export])
    }

    /// Requests of `opcode`, any export and status.
    pub fn reqs(&self, opcode: Opcode) -> u64 {
        self.rows().map(|r| r.reqs_any(opcode)).sum()
    }

    pub fn bytes(&self, opcode: Opcode) -> u64 {
        self.rows().map(|r| r.bytes(opcode)).sum()
    }

    /// Requests answered with something other than `Ok`, including those refused before
    /// their opcode was known.
    pub fn errors(&self) -> u64 {
        let undecoded: u64 = self.undecoded.iter().map(|c| c.load(Relaxed)).sum();
        self.rows().map(ExportOps::errors).sum::<u64>() + undecoded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_times_land_in_the_first_bucket_whose_bound_holds_them() {
        assert_eq!(service_bucket(0), 0);
        assert_eq!(service_bucket(256), 0);
        assert_eq!(service_bucket(257), 1);
        assert_eq!(service_bucket(512), 1);
        assert_eq!(service_bucket(1 << 30), SERVICE_BUCKETS - 2);
        assert_eq!(service_bucket((1 << 30) + 1), SERVICE_BUCKETS - 1);
        assert_eq!(service_bucket(u64::MAX), SERVICE_BUCKETS - 1);
        for i in 0..SERVICE_BUCKETS - 1 {
            let bound = service_bucket_bound_ns(i).unwrap();
            assert_eq!((service_bucket(bound), service_bucket(bound + 1)), (i, i + 1));
        }
        assert_eq!(service_bucket_bound_ns(SERVICE_BUCKETS - 1), None);
    }

    #[test]
    fn requests_count_per_export_opcode_and_status() {
        let c = OpCounters::new(2);
        c.record(Some(1), Opcode::Read, 4096, Status::Ok, Some(1000));
        c.record(Some(1), Opcode::Read, 4096, Status::OutOfRange, None);
        c.record(Some(0), Opcode::Write, 512, Status::Ok, Some(3000));
        c.record(None, Opcode::Write, 512, Status::BadHandle, None);
        c.record(Some(7), Opcode::Flush, 0, Status::Ok, None);
        c.record_refused(Status::UnknownOpcode);
        assert_eq!((c.reqs(Opcode::Read), c.bytes(Opcode::Read), c.errors()), (2, 4096, 3));
        assert_eq!((c.reqs(Opcode::Write), c.bytes(Opcode::Write)), (2, 512));
        let vol = c.export(1).unwrap();
        assert_eq!(vol.reqs(Opcode::Read, status_slot(Status::OutOfRange)), 1);
        let (buckets, sum_ns) = vol.service(Opcode::Read).snapshot();
        assert_eq!((buckets.iter().sum::<u64>(), sum_ns), (1, 1000));
        assert_eq!(c.no_export().reqs_any(Opcode::Flush), 1, "an index past the table counts as no export");
        assert_eq!(c.undecoded(status_slot(Status::UnknownOpcode)), 1);
        assert_eq!(slot_status(status_slot(Status::Other(999))), Status::Other((STATUS_SLOTS - 1) as u16));
    }

    #[test]
    fn dynamic_rows_count_once_made() {
        let c = OpCounters::with_room(1, 2);
        c.record(Some(2), Opcode::Read, 512, Status::Ok, None);
        assert_eq!(c.no_export().reqs_any(Opcode::Read), 1, "no row yet: counted as no export");
        c.add_row(2);
        c.add_row(9);
        c.record(Some(2), Opcode::Read, 512, Status::Ok, None);
        assert_eq!(c.export(2).map(|r| r.reqs_any(Opcode::Read)), Some(1));
        assert!(c.export(1).is_none() && c.export(3).is_none());
        assert_eq!((c.reqs(Opcode::Read), c.bytes(Opcode::Read)), (2, 1024));
    }
}
