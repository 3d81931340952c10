//! Per-worker request counters.
//!
//! Each worker owns one [`OpCounters`] and is its only writer, so updates are plain relaxed
//! loads and stores (no locked read-modify-write); any thread may read them for a stats reply.
//! The struct is aligned to a cache line so two workers' counters never share one.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use wire::{Opcode, Status};

#[derive(Debug, Default)]
#[repr(align(64))]
pub struct OpCounters {
    reqs: [AtomicU64; 5],
    bytes: [AtomicU64; 5],
    errors: AtomicU64,
}

/// A single-writer increment: the owner is the only thread that stores, so a load and a
/// store replace a locked read-modify-write. Shared with the target's own counters.
pub fn bump(counter: &AtomicU64, by: u64) {
    counter.store(counter.load(Relaxed) + by, Relaxed);
}

impl OpCounters {
    /// Count one completed request. Bytes count only for successful reads and writes.
    pub fn record(&self, opcode: Opcode, length: u32, status: Status) {
        let i = opcode.index();
        bump(&self.reqs[i], 1);
        if status.is_ok() {
            if matches!(opcode, Opcode::Read | Opcode::Write) {
                bump(&self.bytes[i], length.into());
            }
        } else {
            bump(&self.errors, 1);
        }
    }

    /// Count a request refused before its opcode was known.
    pub fn record_refused(&self) {
        bump(&self.errors, 1);
    }

    pub fn reqs(&self, opcode: Opcode) -> u64 {
        self.reqs[opcode.index()].load(Relaxed)
    }

    pub fn bytes(&self, opcode: Opcode) -> u64 {
        self.bytes[opcode.index()].load(Relaxed)
    }

    pub fn errors(&self) -> u64 {
        self.errors.load(Relaxed)
    }
}
