//! Keys and routing.
//!
//! A key is an opaque byte string of at most [`MAX_KEY_BYTES`] bytes (vLLM's offload keys are 36:
//! a 32-byte block hash and a 4-byte big-endian group index). The key's 64-bit xxh3 hash is
//! computed once, at construction, and then serves both routing (which worker, which device) and
//! the index's hash table, so nothing on the data path hashes a key twice.

use std::fmt;
use std::hash::{BuildHasherDefault, Hash, Hasher};

use crate::error::Error;

/// The longest key accepted. The slot table stores keys inline, so this bounds its entry size.
pub const MAX_KEY_BYTES: usize = 64;

/// An offload key: up to [`MAX_KEY_BYTES`] arbitrary bytes, with its hash.
#[derive(Clone, Copy)]
pub struct Key {
    hash: u64,
    len: u8,
    bytes: [u8; MAX_KEY_BYTES],
}

impl Key {
    /// Builds a key from bytes; empty keys and keys over [`MAX_KEY_BYTES`] are rejected.
    pub fn new(bytes: &[u8]) -> Result<Key, Error> {
        if bytes.is_empty() || bytes.len() > MAX_KEY_BYTES {
            return Err(Error::InvalidKey(format!(
                "key of {} bytes: keys are 1..={MAX_KEY_BYTES} bytes",
                bytes.len()
            )));
        }
        let mut inline = [0u8; MAX_KEY_BYTES];
        inline[..bytes.len()].copy_from_slice(bytes);
        Ok(Key {
            hash: xxhash_rust::xxh3::xxh3_64(bytes),
            len: bytes.len() as u8,
            bytes: inline,
        })
    }

    /// A vLLM offload key: the block hash followed by the group index as 4 big-endian bytes.
    pub fn vllm(block_hash: &[u8], group: u32) -> Result<Key, Error> {
        let mut buf = [0u8; MAX_KEY_BYTES];
        if block_hash.len() + 4 > MAX_KEY_BYTES {
            return Err(Error::InvalidKey(format!(
                "block hash of {} bytes: at most {} bytes",
                block_hash.len(),
                MAX_KEY_BYTES - 4
            )));
        }
        buf[..block_hash.len()].copy_from_slice(block_hash);
        buf[block_hash.len()..block_hash.len() + 4].copy_from_slice(&group.to_be_bytes());
        Key::new(&buf[..block_hash.len() + 4])
    }

    /// Parses a key from hex (as printed by `kvtier inspect`).
    pub fn from_hex(hex: &str) -> Result<Key, Error> {
        let hex = hex.trim();
        if !hex.len().is_multiple_of(2) || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Error::InvalidKey(format!(
                "`{hex}` is not an even-length hex string"
            )));
        }
        let mut buf = Vec::with_capacity(hex.len() / 2);
        for pair in hex.as_bytes().chunks(2) {
            let s = std::str::from_utf8(pair).map_err(|e| Error::InvalidKey(e.to_string()))?;
            buf.push(u8::from_str_radix(s, 16).map_err(|e| Error::InvalidKey(e.to_string()))?);
        }
        Key::new(&buf)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The key's 64-bit hash (xxh3 of its bytes).
    pub fn hash64(&self) -> u64 {
        self.hash
    }

    pub fn to_hex(&self) -> String {
        use fmt::Write;
        let mut s = String::with_capacity(self.len() * 2);
        for b in self.as_bytes() {
            let _ = write!(s, "{b:02x}");
        }
        s
    }

    /// The worker that owns this key, out of `workers`.
    pub fn worker(&self, workers: usize) -> usize {
        fast_range(self.hash, workers)
    }

    /// The device this key lives on, out of `devices`; independent of the worker choice.
    pub fn device(&self, devices: usize) -> usize {
        fast_range(
            self.hash
                .rotate_left(32)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15),
            devices,
        )
    }
}

/// Maps a uniform 64-bit hash onto `0..n` without a division (Lemire's multiply-shift).
fn fast_range(hash: u64, n: usize) -> usize {
    ((u128::from(hash) * n as u128) >> 64) as usize
}

impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        self.hash == other.hash && self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.to_hex())
    }
}

/// A hasher for tables keyed by [`Key`]: the key already carries a good 64-bit hash.
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached if something other than a Key is hashed; stay correct anyway.
        self.0 = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.0);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub type KeyBuildHasher = BuildHasherDefault<KeyHasher>;
pub type KeyMap<V> = std::collections::HashMap<Key, V, KeyBuildHasher>;
pub type KeySet = std::collections::HashSet<Key, KeyBuildHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_limits_and_hex_round_trip() {
        assert!(Key::new(&[]).is_err());
        assert!(Key::new(&[7u8; MAX_KEY_BYTES + 1]).is_err());
        let k = Key::new(&[0xab, 0x01, 0xff]).expect("valid key");
        assert_eq!(k.to_hex(), "ab01ff");
        assert_eq!(Key::from_hex("AB01ff").expect("hex"), k);
        assert!(Key::from_hex("abc").is_err());
        assert!(Key::from_hex("zz").is_err());
    }

    #[test]
    fn vllm_key_appends_big_endian_group() {
        let k = Key::vllm(&[1u8; 32], 0x0102_0304).expect("valid");
        assert_eq!(k.len(), 36);
        assert_eq!(&k.as_bytes()[32..], &[1, 2, 3, 4]);
    }

    #[test]
    fn routing_is_in_range_and_spreads() {
        let mut per_worker = [0usize; 4];
        let mut per_dev = [0usize; 3];
        for i in 0u32..4000 {
            let k = Key::new(&i.to_le_bytes()).expect("key");
            per_worker[k.worker(4)] += 1;
            per_dev[k.device(3)] += 1;
        }
        assert!(per_worker.iter().all(|&n| n > 800), "{per_worker:?}");
        assert!(per_dev.iter().all(|&n| n > 1100), "{per_dev:?}");
    }
}
