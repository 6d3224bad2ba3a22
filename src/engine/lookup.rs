//! What the engine answers about keys without moving data: lookups, the stored keys, removals
//! and touches, all through its [`crate::node::Node`].

use super::{Engine, Lookup};
use crate::key::Key;
use std::time::Duration;

impl Engine {
    /// Answers from the in-memory index: a key is a hit once its store completed. With the
    /// files layout, a key not indexed is answered from what its worker learnt by `statx`
    /// (`files.first_lookup` says what the first lookup answers). With an S3 tier, a key absent
    /// locally is [`Lookup::Pending`] until a HEAD answers (one per key, shared by concurrent
    /// lookups), then `Hit(Tier::S3)` or `Miss`, cached (bounded by `s3.lookup_cache_max`,
    /// trusted for `s3.lookup_ttl_ms`). A failed load from S3 makes its keys `Miss`. Never a
    /// system call or a wait on the caller's thread.
    pub fn lookup(&self, keys: &[Key]) -> Vec<Lookup> {
        self.node.lookup(keys)
    }

    /// The object name `key` has in the S3 tier (`None` without one, or for a key too short to
    /// hold a block hash).
    pub fn s3_object_name(&self, key: &Key) -> Option<String> {
        self.node.cold().and_then(|t| t.object_name(key))
    }

    /// Every key currently stored (completed stores, not yet evicted), in no particular order.
    ///
    /// Asks every worker (each answers between two turns of its loop); empty after shutdown.
    pub fn keys(&self) -> Vec<Key> {
        let mut out = Vec::new();
        let (tx, rx) = crossbeam_channel::unbounded();
        let asked = self.node.ask_keys(&tx);
        drop(tx);
        for _ in 0..asked {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(keys) => out.extend(keys),
                Err(_) => break,
            }
        }
        out
    }

    /// Removes `keys` from the store (the NVMe tier; a cold tier's copy stays): each is
    /// unpublished and its slot or file freed as an eviction frees it (never demoted), with a
    /// removed event; per key, whether it was. A key is not removed when it is not stored, or
    /// an I/O is reading it (a load, a demotion; ask again after it), or a store of it has not
    /// finished. Waits for each worker to answer between two turns of its loop (at most
    /// 10 s, then the keys it holds count as not removed); after shutdown nothing is removed.
    pub fn remove(&self, keys: &[Key]) -> Vec<bool> {
        let mut out = vec![false; keys.len()];
        let (tx, rx) = crossbeam_channel::unbounded();
        let asked = self.node.ask_remove(keys, &tx);
        drop(tx);
        for _ in 0..asked {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(answers) => {
                    for (i, removed) in answers {
                        out[i as usize] = removed;
                    }
                }
                Err(_) => break,
            }
        }
        out
    }

    /// Marks `keys` recently used, so eviction (CLOCK for the slab, LRU for the files
    /// layout) keeps them longer: for blocks the caller served from its own cache. Keys not
    /// held are ignored. Never blocks; after shutdown it does nothing.
    pub fn touch(&self, keys: &[Key]) {
        self.node.touch(keys);
    }
}
