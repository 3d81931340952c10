//! A global allocator that counts, for tests and benchmarks that prove a path allocates
//! nothing: install [`Counting`] as the `#[global_allocator]` of a test binary, run the path
//! once to warm it up, then compare [`Counting::allocations`] before and after running it
//! again. It forwards every call to the system allocator; counting costs one relaxed atomic
//! add per allocation while switched on and a relaxed load while off.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// The system allocator, counting allocations and reallocations (in all threads) while
/// switched on.
#[derive(Debug)]
pub struct Counting {
    on: AtomicBool,
    allocations: AtomicU64,
    bytes: AtomicU64,
    /// Allocations by size: `by_size[i]` counts those of `2^(i-1) + 1 ..= 2^i` bytes.
    by_size: [AtomicU64; 64],
}

impl Default for Counting {
    fn default() -> Counting {
        Counting::new()
    }
}

impl Counting {
    pub const fn new() -> Counting {
        Counting {
            on: AtomicBool::new(false),
            allocations: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            by_size: [const { AtomicU64::new(0) }; 64],
        }
    }

    /// Start or stop counting.
    pub fn count(&self, on: bool) {
        self.on.store(on, Relaxed);
    }

    /// Allocations and reallocations counted so far.
    pub fn allocations(&self) -> u64 {
        self.allocations.load(Relaxed)
    }

    /// Bytes those asked for.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Relaxed)
    }

    /// The sizes counted, as (largest size of a bucket, allocations in it), for a message that
    /// says what allocated.
    pub fn sizes(&self) -> Vec<(u64, u64)> {
        let buckets = self.by_size.iter().enumerate().map(|(i, n)| (1u64 << i.min(63), n.load(Relaxed)));
        buckets.filter(|&(_, n)| n > 0).collect()
    }

    fn note(&self, size: usize) {
        if self.on.load(Relaxed) {
            self.allocations.fetch_add(1, Relaxed);
            self.bytes.fetch_add(size as u64, Relaxed);
            let bucket = (usize::BITS - size.saturating_sub(1).leading_zeros()) as usize;
            self.by_size[bucket.min(63)].fetch_add(1, Relaxed);
        }
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// allocator's contract is exactly the system allocator's; counting touches only atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.note(layout.size());
        // SAFETY: forwarded as is; the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.note(layout.size());
        // SAFETY: forwarded as is.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is; `ptr` came from this allocator, which is `System`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.note(new_size);
        // SAFETY: forwarded as is; `ptr` came from `System` through this allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
