//! The coordination module of RStore's applications (thesis 6.5; docs/RSTORE.md, RSort): a
//! sector of one-byte flags in a mapped segment, through which processes that share nothing
//! but a namespace tell each other a step is done, and wait for each other at a barrier.
//!
//! Each flag is one byte of the sector, set by a one-byte write. On a pool served at a
//! one-byte block (every `skiff serve --pool`) that write goes to the server as it is: atomic
//! on a RAM pool, and leaving the neighbouring flags alone, where a sector-granular
//! read-modify-write would undo another process's flag. Whoever sets a flag does so only once
//! what it announces is acknowledged, so a process that sees it set may read that whole.
//! Waiting is polling: the flags are read every so often until they are all set. This module
//! holds no layout of its own beyond the sector: which flag means what is the application's.

use std::time::Duration;

use initiator::{Error, Result};

use crate::segment::Segment;

/// Flags in one sector at most.
pub const FLAGS_MAX: usize = 512;

/// A flag's byte when set; clear is 0.
const SET: u8 = 1;

/// A sector of one-byte flags at byte `at` of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flags {
    at: u64,
}

impl Flags {
    pub const fn new(at: u64) -> Flags {
        Flags { at }
    }

    /// Clear every flag of the sector (one write of the whole sector): before a run, so that
    /// no flag of an earlier one counts.
    pub fn clear(&self, seg: &mut Segment) -> Result<()> {
        seg.write(self.at, &[0; FLAGS_MAX])
    }

    /// Set flag `i` with a one-byte write, once what it announces is acknowledged.
    pub fn set(&self, seg: &mut Segment, i: usize) -> Result<()> {
        seg.write(self.offset(i, 1)?, &[SET])
    }

    /// Whether each of flags `first..first + n` is set.
    pub fn read(&self, seg: &mut Segment, first: usize, n: usize) -> Result<Vec<bool>> {
        let mut flags = vec![0; n];
        seg.read(self.offset(first, n)?, &mut flags)?;
        Ok(flags.iter().map(|&f| f == SET).collect())
    }

    /// Wait until every one of flags `first..first + n` is set, reading them every `poll`:
    /// the barrier.
    pub fn wait_all(&self, seg: &mut Segment, first: usize, n: usize, poll: Duration) -> Result<()> {
        let at = self.offset(first, n)?;
        let mut flags = vec![0; n];
        loop {
            seg.read(at, &mut flags)?;
            if flags.iter().all(|&f| f == SET) {
                return Ok(());
            }
            std::thread::sleep(poll);
        }
    }

    /// The segment offset of flags `first..first + n`, which must lie in the sector.
    fn offset(&self, first: usize, n: usize) -> Result<u64> {
        if first.checked_add(n).is_none_or(|end| end > FLAGS_MAX) {
            return Err(Error::InvalidArgument("flags past the end of their sector"));
        }
        Ok(self.at + first as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_lie_in_their_sector() {
        let flags = Flags::new(1024);
        assert_eq!(flags.offset(0, 32).unwrap(), 1024);
        assert_eq!(flags.offset(32, 32).unwrap(), 1056);
        assert_eq!(flags.offset(0, FLAGS_MAX).unwrap(), 1024);
        for (first, n) in [(FLAGS_MAX, 1), (1, FLAGS_MAX), (usize::MAX, 2)] {
            assert!(matches!(flags.offset(first, n), Err(Error::InvalidArgument(_))), "{first} + {n}");
        }
    }
}
