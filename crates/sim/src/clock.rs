//! Virtual time, in microseconds. Nothing in the simulation reads a real clock: the run loop
//! advances this one, and every component that needs the time holds a handle to it.

use std::cell::Cell;
use std::rc::Rc;

/// A shared, single-threaded virtual clock.
#[derive(Debug, Clone, Default)]
pub struct Clock(Rc<Cell<u64>>);

impl Clock {
    pub fn new() -> Clock {
        Clock::default()
    }

    pub fn now_us(&self) -> u64 {
        self.0.get()
    }

    pub fn advance(&self, us: u64) {
        self.0.set(self.0.get() + us);
    }
}
