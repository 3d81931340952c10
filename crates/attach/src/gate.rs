//! The write gate: aligned writes pass it together, a read-modify-write alone.
//!
//! A read-modify-write of a block must not interleave with another write to that block (the
//! kernel may run writes to the file in parallel, `FOPEN_PARALLEL_DIRECT_WRITES`). An aligned
//! write holds the gate shared from before it is queued until its completion arrives, which
//! is on an I/O thread, not the thread that entered: so a hold is a token ([`SharedHold`])
//! that travels with the request and is given back by whoever completes it, not a guard tied
//! to a thread. A read-modify-write holds the gate exclusive ([`ExclusiveHold`]): it claims
//! the gate, which turns new aligned writes away until it is done, then waits for the writes
//! in flight to drain.
//!
//! The common case costs one atomic add to enter and one atomic subtract to leave; the mutex
//! and condition variable are touched only while a read-modify-write claims the gate.

use std::sync::atomic::{AtomicU64, Ordering::Acquire, Ordering::Release};
use std::sync::{Condvar, Mutex, MutexGuard};

/// The top bit of [`WriteGate::state`]: a read-modify-write has claimed the gate.
const CLAIMED: u64 = 1 << 63;

#[derive(Debug, Default)]
pub(crate) struct WriteGate {
    /// Shared holds (the low bits) and the exclusive claim ([`CLAIMED`]).
    state: AtomicU64,
    /// Exclusive holders take turns here.
    turn: Mutex<()>,
    /// Where aligned writes wait out a claim, and a claimant waits for shared holds to end.
    lock: Mutex<()>,
    changed: Condvar,
}

/// A shared hold on the gate, carried by an aligned write until its completion; give it back
/// with [`WriteGate::leave_shared`].
#[must_use = "a shared hold must be given back with WriteGate::leave_shared"]
#[derive(Debug)]
pub(crate) struct SharedHold(());

/// A shared hold released when dropped, for a thread that waits for its write itself.
pub(crate) struct SharedGuard<'a> {
    gate: &'a WriteGate,
    hold: Option<SharedHold>,
}

/// The gate held exclusive; released when dropped.
pub(crate) struct ExclusiveHold<'a> {
    gate: &'a WriteGate,
    _turn: MutexGuard<'a, ()>,
}

impl WriteGate {
    /// Hold the gate shared, waiting while a read-modify-write holds or claims it.
    pub(crate) fn enter_shared(&self) -> SharedHold {
        loop {
            if self.state.fetch_add(1, Acquire) & CLAIMED == 0 {
                return SharedHold(());
            }
            // Claimed: step back (the claimant may be waiting for exactly this) and wait.
            self.release_one();
            let mut locked = self.lock();
            while self.state.load(Acquire) & CLAIMED != 0 {
                locked = self.changed.wait(locked).unwrap_or_else(|p| p.into_inner());
            }
        }
    }

    /// [`enter_shared`](Self::enter_shared), given back when the guard is dropped.
    pub(crate) fn shared(&self) -> SharedGuard<'_> {
        SharedGuard { gate: self, hold: Some(self.enter_shared()) }
    }

    /// Give a shared hold back (the write it was taken for has completed).
    pub(crate) fn leave_shared(&self, hold: SharedHold) {
        let SharedHold(()) = hold;
        self.release_one();
    }

    fn release_one(&self) {
        let before = self.state.fetch_sub(1, Release);
        debug_assert!(before & !CLAIMED > 0, "a shared hold given back twice");
        if before == CLAIMED | 1 {
            // The last shared hold while a claimant waits for none.
            let _locked = self.lock();
            self.changed.notify_all();
        }
    }

    /// Hold the gate exclusive: claim it, so that new aligned writes wait, and wait until the
    /// shared holds already out (writes in flight) have been given back.
    pub(crate) fn enter_exclusive(&self) -> ExclusiveHold<'_> {
        let turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        self.state.fetch_or(CLAIMED, Acquire);
        let mut locked = self.lock();
        while self.state.load(Acquire) != CLAIMED {
            locked = self.changed.wait(locked).unwrap_or_else(|p| p.into_inner());
        }
        drop(locked);
        ExclusiveHold { gate: self, _turn: turn }
    }

    /// The gate guards no data, so a panic while holding `lock` leaves nothing to repair.
    fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for SharedGuard<'_> {
    fn drop(&mut self) {
        if let Some(hold) = self.hold.take() {
            self.gate.leave_shared(hold);
        }
    }
}

impl Drop for ExclusiveHold<'_> {
    fn drop(&mut self) {
        self.gate.state.fetch_and(!CLAIMED, Release);
        let _locked = self.gate.lock();
        self.gate.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn shared_holds_do_not_wait_for_each_other() {
        let gate = WriteGate::default();
        let holds: Vec<_> = (0..5).map(|_| gate.enter_shared()).collect();
        assert_eq!(gate.state.load(SeqCst), 5);
        for h in holds {
            gate.leave_shared(h);
        }
        assert_eq!(gate.state.load(SeqCst), 0);
    }

    #[test]
    fn an_exclusive_hold_waits_for_writes_in_flight_and_holds_new_ones_back() {
        let gate = Arc::new(WriteGate::default());
        let in_flight = gate.enter_shared();
        let exclusive_held = Arc::new(AtomicBool::new(false));
        let claimant = {
            let (gate, held) = (gate.clone(), exclusive_held.clone());
            std::thread::spawn(move || {
                let hold = gate.enter_exclusive();
                held.store(true, SeqCst);
                std::thread::sleep(Duration::from_millis(50));
                held.store(false, SeqCst);
                drop(hold);
            })
        };
        // The claim shows, and the claimant still waits for the write in flight.
        while gate.state.load(SeqCst) & CLAIMED == 0 {
            std::thread::yield_now();
        }
        std::thread::sleep(Duration::from_millis(20));
        assert!(!exclusive_held.load(SeqCst), "exclusive while a write was in flight");
        // A new writer waits until the claimant is done.
        let writer = {
            let (gate, held) = (gate.clone(), exclusive_held.clone());
            std::thread::spawn(move || {
                let hold = gate.enter_shared();
                assert!(!held.load(SeqCst), "a shared hold granted during the exclusive one");
                gate.leave_shared(hold);
            })
        };
        gate.leave_shared(in_flight);
        claimant.join().unwrap();
        writer.join().unwrap();
        assert_eq!(gate.state.load(SeqCst), 0);
    }
}
