//! Block contents: a pure function of the key number, so every load is checked.

use super::{Check, Region, Rng, PATTERNS, POISON_STRIDE_BYTES, SEED};
/// Block contents: `content(k)` is pattern `k % PATTERNS` with `k` (u64 LE) stamped in its
/// first and last 8 bytes. Patterns live in ordinary memory, generated once. With
/// [`Check::Stamps`] only the stamps are written and checked.
pub(super) struct Patterns {
    pub(super) block_bytes: usize,
    pub(super) contents: Vec<Vec<u8>>,
    pub(super) check: Check,
}

impl Patterns {
    pub(super) fn new(block_bytes: usize, check: Check) -> Patterns {
        assert!(
            block_bytes >= POISON_STRIDE_BYTES,
            "blocks are at least one page"
        );
        let mut rng = Rng::new(SEED);
        let patterns = (0..PATTERNS)
            .map(|_| {
                let mut block = vec![0u8; block_bytes];
                for chunk in block.chunks_mut(8) {
                    let word = rng.next_u64().to_le_bytes();
                    chunk.copy_from_slice(&word[..chunk.len()]);
                }
                block
            })
            .collect();
        Patterns {
            block_bytes,
            contents: patterns,
            check,
        }
    }

    pub(super) fn pattern(&self, k: u64) -> &[u8] {
        &self.contents[(k % PATTERNS) as usize]
    }

    pub(super) fn store_into(&self, region: &Region, offset: usize, k: u64) {
        let stamp = k.to_le_bytes();
        if self.check == Check::Full {
            region.write(offset, self.pattern(k));
        }
        region.write(offset, &stamp);
        region.write(offset + self.block_bytes - stamp.len(), &stamp);
    }

    /// Overwrites the start of every page of the block, so a load that leaves any page
    /// unwritten (or writes nothing) cannot pass verification on stale content.
    pub(super) fn poison(&self, region: &Region, offset: usize) {
        if self.check == Check::Stamps {
            region.fill(offset, 8, 0xFF);
            region.fill(offset + self.block_bytes - 8, 8, 0xFF);
            return;
        }
        for page in (0..self.block_bytes).step_by(POISON_STRIDE_BYTES) {
            region.fill(offset + page, 8, 0xFF);
        }
    }

    /// `None` if the block holds exactly `content(k)`, else the first differing byte.
    pub(super) fn first_mismatch(&self, region: &Region, offset: usize, k: u64) -> Option<usize> {
        let stamp = k.to_le_bytes();
        let pattern = self.pattern(k);
        let n = self.block_bytes;
        region.with_bytes(offset, n, |got| {
            let tail = n - stamp.len();
            let stamps_ok = got[..8] == stamp && got[tail..] == stamp;
            if stamps_ok && (self.check == Check::Stamps || got[8..tail] == pattern[8..tail]) {
                return None;
            }
            if self.check == Check::Stamps {
                return (0..8)
                    .find(|&i| got[i] != stamp[i])
                    .or_else(|| (tail..n).find(|&i| got[i] != stamp[i - tail]));
            }
            (0..n).find(|&i| {
                let want = if i < 8 {
                    stamp[i]
                } else if i >= tail {
                    stamp[i - tail]
                } else {
                    pattern[i]
                };
                got[i] != want
            })
        })
    }
}
