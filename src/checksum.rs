//! The block checksum: crc32c (CRC-32/ISCSI, the Castagnoli polynomial), as slot table entries,
//! the files layout's `user.kvtier.crc32c` xattr and the S3 tier's object metadata hold it.
//!
//! Computed with `crc_fast`, which picks the widest carry-less multiply the CPU has at run time
//! (VPCLMULQDQ on AVX-512, else PCLMULQDQ with the SSE 4.2 crc32 instruction, else a table).
//! On the development machine it runs at about 20 GiB/s over a block that is not in the cache
//! (a block the device just wrote or read) and 50 GiB/s over one that is, twice the `crc32c`
//! crate's 10 and 22 (docs/perf.md, "The checksum"). The values are the same: the tests below
//! check them against the `crc32c` crate.

/// crc32c of `data`.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// crc32c of data that arrives in pieces (an object's body as it streams in).
pub struct Crc32c(crc_fast::Digest);

impl Crc32c {
    pub fn new() -> Crc32c {
        Crc32c(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
    }

    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    /// crc32c of everything given to `update` so far.
    pub fn value(&self) -> u32 {
        self.0.finalize() as u32
    }
}

impl Default for Crc32c {
    fn default() -> Crc32c {
        Crc32c::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes that are not a repeating pattern the folding could get right by accident.
    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut rng = crate::sim::Rng::new(seed);
        (0..len).map(|_| rng.next_u64() as u8).collect()
    }

    #[test]
    fn matches_the_reference_crc32c_at_every_length_and_alignment() {
        assert_eq!(
            crc32c(b"123456789"),
            0xe306_9283,
            "the CRC-32/ISCSI check value"
        );
        assert_eq!(crc32c(&[]), 0);
        let buf = noise(3 * 4096 + 77, 1);
        // Every length up to past the SIMD loops' strides, at unaligned starts.
        for start in [0usize, 1, 7, 63] {
            for len in (0..1100).chain([4095, 4096, 4097, 8192, 3 * 4096]) {
                let d = &buf[start..start + len.min(buf.len() - start)];
                assert_eq!(
                    crc32c(d),
                    crc32c::crc32c(d),
                    "start {start} len {}",
                    d.len()
                );
            }
        }
        for (len, seed) in [(256usize << 10, 2u64), (2 << 20, 3), ((2 << 20) + 12, 4)] {
            let d = noise(len, seed);
            assert_eq!(crc32c(&d), crc32c::crc32c(&d), "len {len}");
        }
    }

    #[test]
    fn streamed_pieces_give_the_whole_buffers_crc() {
        let d = noise(1 << 20, 5);
        for piece in [1usize, 17, 4096, 65_537, 1 << 20] {
            let mut c = Crc32c::new();
            for chunk in d.chunks(piece) {
                c.update(chunk);
            }
            assert_eq!(c.value(), crc32c::crc32c(&d), "pieces of {piece}");
        }
        assert_eq!(Crc32c::new().value(), 0);
    }

    #[test]
    fn a_flipped_bit_changes_it() {
        let mut d = noise(256 << 10, 6);
        let before = crc32c(&d);
        d[123_456] ^= 0x08;
        assert_ne!(crc32c(&d), before);
    }
}
