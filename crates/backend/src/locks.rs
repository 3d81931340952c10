//! Block locks: what keeps a read-modify-write of a block from losing a write beside it.
//!
//! A write that covers a 4 KiB block only in part has to read the block, patch it and write
//! it back (`O_DIRECT` moves whole blocks). Another write landing in that block between the
//! read and the write-back would be undone, bytes it never touched included: so a patch holds
//! its partial blocks *exclusively*, and every write holds the blocks it covers whole *shared*
//! (many writers may overwrite whole blocks at once; none may do so under a patch). Reads take
//! nothing: a read that overlaps a concurrent write may see either, as on any disk.
//!
//! Blocks map onto [`STRIPES`] locks by index (block `b` on stripe `b % STRIPES`), so the table
//! is fixed at start-up whatever the volume's size; neighbouring blocks fall on different
//! stripes. A request takes its stripes in ascending order, each once (exclusive if any of
//! its blocks there is partial), so two requests can never wait for each other in a cycle.
//! An aligned write of one block takes one shared lock, two uncontended mutex round trips.

use std::sync::{Condvar, Mutex, MutexGuard};

/// Locks in the table.
pub const STRIPES: usize = 64;

/// The block size patches work in.
pub const BLOCK: u64 = rt::mem::ALIGN_BYTES as u64;

/// One stripe: any number of shared holders or one exclusive one. A patch waiting for its
/// stripe holds new shared holders back, so a stream of whole-block writes cannot starve it.
#[derive(Default)]
struct Stripe {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    shared: u32,
    exclusive: bool,
    exclusive_waiting: u32,
    /// Threads asleep on `changed`: a release wakes them only if there are any.
    sleepers: u32,
}

impl Stripe {
    fn state(&self) -> MutexGuard<'_, State> {
        // The state is a few counters updated whole under the lock: a panic elsewhere
        // cannot leave it half-changed.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, mut g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        g.sleepers += 1;
        let mut g = self.changed.wait(g).unwrap_or_else(|e| e.into_inner());
        g.sleepers -= 1;
        g
    }

    fn lock(&self, exclusive: bool) {
        let mut g = self.state();
        if exclusive {
            g.exclusive_waiting += 1;
            while g.exclusive || g.shared > 0 {
                g = self.wait(g);
            }
            g.exclusive_waiting -= 1;
            g.exclusive = true;
        } else {
            while g.exclusive || g.exclusive_waiting > 0 {
                g = self.wait(g);
            }
            g.shared += 1;
        }
    }

    fn unlock(&self, exclusive: bool) {
        let mut g = self.state();
        if exclusive {
            g.exclusive = false;
        } else {
            g.shared -= 1;
        }
        if g.sleepers > 0 && !g.exclusive && g.shared == 0 {
            self.changed.notify_all();
        }
    }
}

pub struct BlockLocks {
    stripes: [Stripe; STRIPES],
}

impl std::fmt::Debug for BlockLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockLocks").field("stripes", &STRIPES).finish()
    }
}

impl Default for BlockLocks {
    fn default() -> Self {
        BlockLocks { stripes: std::array::from_fn(|_| Stripe::default()) }
    }
}

/// The stripes a write holds until it is dropped, as bit masks (stripe `s` is bit `s`).
pub struct Held<'a> {
    locks: &'a BlockLocks,
    shared: u64,
    exclusive: u64,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        for s in stripes_in(self.exclusive | self.shared) {
            self.locks.stripes[s].unlock(self.exclusive & 1 << s != 0);
        }
    }
}

/// The stripes whose bits are set in `mask`, lowest first.
fn stripes_in(mut mask: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let s = mask.trailing_zeros() as usize;
        mask &= mask.checked_sub(1)?;
        Some(s)
    })
}

impl BlockLocks {
    /// Lock the blocks a write of `len` bytes at `offset` touches (`len` > 0): exclusively
    /// those it covers in part, shared those it covers whole.
    pub fn write(&self, offset: u64, len: u64) -> Held<'_> {
        debug_assert!(len > 0);
        let end = offset + len;
        let (first, last) = (offset / BLOCK, (end - 1) / BLOCK);
        let stripe = |block: u64| 1u64 << (block % STRIPES as u64);
        let mut exclusive = 0u64;
        if !offset.is_multiple_of(BLOCK) {
            exclusive |= stripe(first);
        }
        if !end.is_multiple_of(BLOCK) {
            exclusive |= stripe(last);
        }
        let touched = if last - first + 1 >= STRIPES as u64 {
            u64::MAX
        } else {
            (first..=last).fold(0u64, |m, b| m | stripe(b))
        };
        let shared = touched & !exclusive;
        for s in stripes_in(touched) {
            self.stripes[s].lock(exclusive & 1 << s != 0);
        }
        Held { locks: self, shared, exclusive }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_come_out_of_a_mask_lowest_first() {
        assert_eq!(stripes_in(0).count(), 0);
        assert_eq!(stripes_in(1 << 5 | 1 << 63 | 1).collect::<Vec<_>>(), [0, 5, 63]);
        assert_eq!(stripes_in(u64::MAX).count(), 64);
    }

    #[test]
    fn partial_blocks_are_exclusive_and_whole_ones_shared() {
        let locks = BlockLocks::default();
        // One aligned block: one shared guard, nothing exclusive.
        let held = locks.write(BLOCK * 5, BLOCK);
        assert_eq!((held.shared, held.exclusive), (1 << 5, 0));
        drop(held);
        // Inside one block: exclusive.
        let held = locks.write(BLOCK * 5 + 7, 10);
        assert_eq!((held.shared, held.exclusive), (0, 1 << 5));
        drop(held);
        // Head and tail partial, whole blocks between.
        let held = locks.write(BLOCK + 100, 3 * BLOCK);
        assert_eq!((held.shared, held.exclusive), (1 << 2 | 1 << 3, 1 << 1 | 1 << 4));
        drop(held);
        // Blocks 63 and 64 wrap onto stripes 63 and 0.
        let held = locks.write(63 * BLOCK + 1, BLOCK);
        assert_eq!((held.shared, held.exclusive), (0, 1 << 63 | 1));
        drop(held);
        // A write of more blocks than stripes holds them all.
        let held = locks.write(0, 100 * BLOCK);
        assert_eq!((held.shared, held.exclusive), (u64::MAX, 0));
    }

    #[test]
    fn a_patch_waits_for_a_whole_block_write_of_the_same_block() {
        let locks = std::sync::Arc::new(BlockLocks::default());
        let whole = locks.write(0, BLOCK);
        let patched = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let t = {
            let (locks, patched) = (locks.clone(), patched.clone());
            std::thread::spawn(move || {
                let _held = locks.write(10, 10);
                patched.store(true, std::sync::atomic::Ordering::SeqCst);
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !patched.load(std::sync::atomic::Ordering::SeqCst),
            "the patch ran under a whole-block write"
        );
        drop(whole);
        t.join().unwrap();
        assert!(patched.load(std::sync::atomic::Ordering::SeqCst));
    }
}
