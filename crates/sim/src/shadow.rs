//! The model the simulation checks against: what every block of the volume may hold.
//!
//! Every write gets a fresh generation, and its data is a pattern of (seed, block, generation),
//! so any block's bytes say which write they came from. A block holds one known generation
//! after an acknowledged write; after a write whose outcome is unknown (it failed, or the
//! connection died with it in flight) it may hold any of several, until a read shows which.
//! Generation 0 is all zeroes: the fresh volume, and what write-zeroes leaves.

use crate::rng::mix;

/// The simulated volume's block: the unit of every request and of the model.
pub const BLOCK_BYTES: usize = 512;

#[derive(Debug)]
pub struct Shadow {
    seed: u64,
    /// For each block, the generations it may hold (one when it is known).
    blocks: Vec<Vec<u32>>,
    next_gen: u32,
}

impl Shadow {
    pub fn new(seed: u64, blocks: usize) -> Shadow {
        Shadow { seed, blocks: vec![vec![0]; blocks], next_gen: 1 }
    }

    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// A generation no write has used.
    pub fn new_gen(&mut self) -> u32 {
        self.next_gen += 1;
        self.next_gen - 1
    }

    /// Generation `gen`'s bytes for `block`.
    pub fn fill(&self, block: usize, gen: u32, out: &mut [u8]) {
        if gen == 0 {
            out.fill(0);
            return;
        }
        let base = mix(self.seed ^ (block as u64) << 32 ^ u64::from(gen));
        for (i, word) in out.chunks_mut(8).enumerate() {
            word.copy_from_slice(&mix(base.wrapping_add(i as u64)).to_le_bytes()[..word.len()]);
        }
    }

    /// The data of a write of generation `gen` to `count` blocks from `first`.
    pub fn data(&self, first: usize, count: usize, gen: u32) -> Vec<u8> {
        let mut v = vec![0; count * BLOCK_BYTES];
        for (i, chunk) in v.chunks_mut(BLOCK_BYTES).enumerate() {
            self.fill(first + i, gen, chunk);
        }
        v
    }

    /// A write (or write-zeroes, `gen` 0) was acknowledged: the blocks hold it.
    pub fn acknowledged(&mut self, first: usize, count: usize, gen: u32) {
        for b in &mut self.blocks[first..first + count] {
            b.clear();
            b.push(gen);
        }
    }

    /// A write's outcome is unknown: the blocks may hold it or what they held before.
    pub fn maybe(&mut self, first: usize, count: usize, gen: u32) {
        for b in &mut self.blocks[first..first + count] {
            if !b.contains(&gen) {
                b.push(gen);
            }
        }
    }

    /// Check `data` read from `first` on: every block must hold one of its possible
    /// generations, which then becomes the known one.
    pub fn check_read(&mut self, first: usize, data: &[u8]) -> Result<(), String> {
        let mut want = [0u8; BLOCK_BYTES];
        for (i, got) in data.chunks(BLOCK_BYTES).enumerate() {
            let block = first + i;
            let found = self.blocks[block].iter().copied().find(|&gen| {
                self.fill(block, gen, &mut want);
                want[..] == *got
            });
            match found {
                Some(gen) => self.acknowledged(block, 1, gen),
                None => {
                    return Err(format!(
                    "block {block} holds data of no write it could hold (possible generations {:?}, read {})",
                    self.blocks[block],
                    describe(self, block, got)
                ))
                }
            }
        }
        Ok(())
    }
}

/// Which block and generation `got` came from, if it is any pattern of this run at all.
fn describe(shadow: &Shadow, block: usize, got: &[u8]) -> String {
    let mut want = [0u8; BLOCK_BYTES];
    for b in 0..shadow.blocks.len() {
        for gen in 0..shadow.next_gen {
            shadow.fill(b, gen, &mut want);
            if want[..] == *got {
                return if b == block {
                    format!("generation {gen} of this block")
                } else {
                    format!("generation {gen} of block {b}")
                };
            }
        }
    }
    "bytes no write produced".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uncertain_blocks_accept_either_and_then_know() {
        let mut s = Shadow::new(9, 4);
        let g = s.new_gen();
        let data = s.data(1, 2, g);
        s.maybe(1, 2, g);
        assert!(s.check_read(1, &data[..BLOCK_BYTES]).is_ok(), "the new data");
        assert!(s.check_read(2, &[0; BLOCK_BYTES]).is_ok(), "or the old");
        // Now known: block 2 is zeroes, so the new data there is wrong.
        let err = s.check_read(2, &data[BLOCK_BYTES..]).unwrap_err();
        assert!(err.contains("generation 1 of this block"), "{err}");
        let err = s.check_read(0, &data[..BLOCK_BYTES]).unwrap_err();
        assert!(err.contains("of block 1"), "{err}");
    }
}
