//! The verification pattern: every 8-byte word of a block is a function of the seed, the
//! block's offset and the block's write generation, so a read can tell whether it got the
//! right block, the latest write of it, and every byte intact.

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn base(seed: u64, offset: u64, generation: u32) -> u64 {
    splitmix64(seed ^ splitmix64(offset ^ (u64::from(generation) << 48)))
}

/// Fill `buf` (a multiple of 8 bytes) with the pattern for `offset` at `generation`.
pub fn fill(buf: &mut [u8], seed: u64, offset: u64, generation: u32) {
    let b = base(seed, offset, generation);
    for (i, word) in buf.chunks_exact_mut(8).enumerate() {
        word.copy_from_slice(&splitmix64(b.wrapping_add(i as u64)).to_le_bytes());
    }
}

/// The first byte offset where `buf` differs from the pattern, if any.
pub fn first_mismatch(buf: &[u8], seed: u64, offset: u64, generation: u32) -> Option<usize> {
    let b = base(seed, offset, generation);
    buf.chunks_exact(8).enumerate().find_map(|(i, word)| {
        let want = splitmix64(b.wrapping_add(i as u64)).to_le_bytes();
        word.iter().zip(want).position(|(g, w)| *g != w).map(|p| i * 8 + p)
    })
}

/// A small fast generator for offsets and op choices (no external crate needed).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(splitmix64(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64(self.0)
    }

    /// Uniform in `0..n` (n > 0), by multiply-shift: no modulo bias worth measuring.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_detects_wrong_block_generation_and_bytes() {
        let mut buf = vec![0u8; 4096];
        fill(&mut buf, 7, 8192, 3);
        assert_eq!(first_mismatch(&buf, 7, 8192, 3), None);
        assert!(first_mismatch(&buf, 7, 4096, 3).is_some(), "other offset");
        assert!(first_mismatch(&buf, 7, 8192, 4).is_some(), "other generation");
        assert!(first_mismatch(&buf, 8, 8192, 3).is_some(), "other seed");
        buf[1234] ^= 1;
        assert_eq!(first_mismatch(&buf, 7, 8192, 3), Some(1234));
        assert!(first_mismatch(&[0u8; 512], 7, 0, 0).is_some(), "zeroes are not a pattern");
    }

    #[test]
    fn rng_stays_in_range() {
        let mut r = Rng::new(1);
        let mut seen = [false; 10];
        for _ in 0..1000 {
            let v = r.below(10);
            seen[v as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
