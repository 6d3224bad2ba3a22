//! The keys a worker holds, as callers see them: what `Engine::lookup` reads.
//!
//! An open-addressing table of 64-bit key fingerprints (each key's hash). The worker is the only
//! writer: it publishes a key with one atomic store into the table and removes it with another
//! ([`Publisher`]); callers probe with atomic loads ([`PublishedKeys::contains`]). The worker
//! takes no lock and allocates nothing to publish, so a thread calling `lookup` in a loop cannot
//! hold up its data path. When the table fills (or fills with removal marks) the worker builds a
//! fresh one and swaps it in; a caller takes a read lock only to pick up the current table, and
//! the worker takes the write lock only for that swap.
//!
//! A key is published before its store is reported, so a caller that saw the success also sees
//! the key. Two keys with the same 64-bit hash look alike: a lookup may answer "held" for a key
//! that is not (its load then misses and is reported as a miss, never as wrong bytes); with n
//! keys held the chance is about n / 2^64 per lookup.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::key::Key;

const EMPTY: u64 = 0;
/// A removed key: probes continue past it.
const GONE: u64 = 1;
const MIN_CAPACITY: usize = 1024;

struct Table {
    slots: Box<[AtomicU64]>,
    mask: usize,
}

impl Table {
    fn new(capacity: usize) -> Table {
        let capacity = capacity.next_power_of_two().max(MIN_CAPACITY);
        Table {
            slots: (0..capacity).map(|_| AtomicU64::new(EMPTY)).collect(),
            mask: capacity - 1,
        }
    }

    fn capacity(&self) -> usize {
        self.mask + 1
    }

    fn contains(&self, fp: u64) -> bool {
        let mut i = fp as usize & self.mask;
        for _ in 0..self.capacity() {
            match self.slots[i].load(Ordering::Acquire) {
                v if v == fp => return true,
                EMPTY => return false,
                _ => i = (i + 1) & self.mask,
            }
        }
        false
    }
}

/// The fingerprint of `key`: its hash, kept clear of the two marks.
fn fingerprint(key: &Key) -> u64 {
    key.hash64().max(GONE + 1)
}

/// The callers' side, shared with the worker's [`Publisher`].
pub(crate) struct PublishedKeys {
    current: RwLock<Arc<Table>>,
}

impl Default for PublishedKeys {
    fn default() -> Self {
        PublishedKeys {
            current: RwLock::new(Arc::new(Table::new(MIN_CAPACITY))),
        }
    }
}

impl PublishedKeys {
    fn table(&self) -> Arc<Table> {
        Arc::clone(
            &self
                .current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    pub fn contains(&self, key: &Key) -> bool {
        self.table().contains(fingerprint(key))
    }

    /// The current table, for many lookups at one lock acquisition.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot(self.table())
    }
}

/// The published keys at one moment ([`PublishedKeys::snapshot`]).
pub(crate) struct Snapshot(Arc<Table>);

impl Snapshot {
    pub fn contains(&self, key: &Key) -> bool {
        self.0.contains(fingerprint(key))
    }
}

/// The worker's side: the only writer of its [`PublishedKeys`].
pub(crate) struct Publisher {
    view: Arc<PublishedKeys>,
    table: Arc<Table>,
    live: usize,
    gone: usize,
}

impl Publisher {
    /// The only writer of `view`, which starts empty.
    pub fn new(view: Arc<PublishedKeys>) -> Publisher {
        let table = Arc::new(Table::new(MIN_CAPACITY));
        *view
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::clone(&table);
        Publisher {
            view,
            table,
            live: 0,
            gone: 0,
        }
    }

    /// Publishes `key` (a no-op if it is already published).
    pub fn insert(&mut self, key: &Key) {
        let fp = fingerprint(key);
        let t = &self.table;
        let mut i = fp as usize & t.mask;
        let mut reuse = None;
        loop {
            match t.slots[i].load(Ordering::Relaxed) {
                v if v == fp => return,
                GONE => {
                    reuse.get_or_insert(i);
                }
                EMPTY => break,
                _ => {}
            }
            i = (i + 1) & t.mask;
        }
        // The table is never full (see the rebuild below), so the probe found an empty slot.
        let place = match reuse {
            Some(r) => {
                self.gone -= 1;
                r
            }
            None => i,
        };
        t.slots[place].store(fp, Ordering::Release);
        self.live += 1;
        if (self.live + self.gone) * 4 >= t.capacity() * 3 {
            let grow = self.live * 2 >= t.capacity();
            let capacity = if grow { t.capacity() * 2 } else { t.capacity() };
            self.rebuild(capacity);
        }
    }

    /// Withdraws `key` (a no-op if it is not published).
    pub fn remove(&mut self, key: &Key) {
        let fp = fingerprint(key);
        let t = &self.table;
        let mut i = fp as usize & t.mask;
        for _ in 0..t.capacity() {
            match t.slots[i].load(Ordering::Relaxed) {
                v if v == fp => {
                    t.slots[i].store(GONE, Ordering::Release);
                    self.live -= 1;
                    self.gone += 1;
                    return;
                }
                EMPTY => return,
                _ => i = (i + 1) & t.mask,
            }
        }
    }

    #[cfg(any(test, feature = "sim"))]
    pub fn contains(&self, key: &Key) -> bool {
        self.table.contains(fingerprint(key))
    }

    /// Keys published (fingerprints; keys sharing a hash count once).
    #[cfg(any(test, feature = "sim"))]
    pub fn len(&self) -> usize {
        self.live
    }

    /// A fresh table of `capacity` holding the live fingerprints, swapped in for callers. Runs
    /// when the table is three quarters full of keys and removal marks: O(table) every
    /// O(table) changes.
    fn rebuild(&mut self, capacity: usize) {
        let fresh = Table::new(capacity);
        for v in self.table.slots.iter().map(|s| s.load(Ordering::Relaxed)) {
            if v > GONE {
                let mut i = v as usize & fresh.mask;
                while fresh.slots[i].load(Ordering::Relaxed) != EMPTY {
                    i = (i + 1) & fresh.mask;
                }
                fresh.slots[i].store(v, Ordering::Relaxed);
            }
        }
        self.gone = 0;
        self.table = Arc::new(fresh);
        *self
            .view
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::clone(&self.table);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn key(i: u32) -> Key {
        Key::new(&i.to_le_bytes()).expect("key")
    }

    /// A million keys through growth rebuilds: every one stays visible to callers, and a
    /// caller snapshot taken before a rebuild keeps answering. Prints the longest insert (the
    /// rebuild that doubles the table to 2^21 slots), the pause the worker takes; measured, not
    /// asserted (`cargo test --release -p kvtier --lib published -- --nocapture`).
    #[test]
    fn a_million_keys_survive_every_rebuild() {
        let view = Arc::new(PublishedKeys::default());
        let mut p = Publisher::new(Arc::clone(&view));
        let n = 1_000_000u32;
        let mut longest = std::time::Duration::ZERO;
        let early = view.snapshot();
        for i in 0..n {
            let t = std::time::Instant::now();
            p.insert(&key(i));
            longest = longest.max(t.elapsed());
        }
        assert!(early.contains(&key(0)), "an old snapshot still answers");
        let snap = view.snapshot();
        assert!((0..n).all(|i| snap.contains(&key(i))));
        assert!(!snap.contains(&key(n)));
        assert_eq!(p.len(), n as usize);
        eprintln!(
            "published: {n} keys, table of {} slots, longest insert (a rebuild) {:?}",
            snap.0.capacity(),
            longest
        );
    }

    #[test]
    fn insert_remove_contains() {
        let view = Arc::new(PublishedKeys::default());
        let mut p = Publisher::new(Arc::clone(&view));
        for i in 0..100 {
            p.insert(&key(i));
        }
        p.remove(&key(7));
        p.insert(&key(7));
        p.remove(&key(8));
        p.remove(&key(8));
        p.insert(&key(9));
        assert!(view.contains(&key(7)) && p.contains(&key(7)));
        assert!(!view.contains(&key(8)));
        assert_eq!(p.len(), 99);
        let snap = view.snapshot();
        let out: Vec<bool> = [key(1), key(8), key(1000)]
            .iter()
            .map(|k| snap.contains(k))
            .collect();
        assert_eq!(out, vec![true, false, false]);
    }

    #[test]
    fn churn_grows_and_purges_and_keeps_every_live_key() {
        let view = Arc::new(PublishedKeys::default());
        let mut p = Publisher::new(Arc::clone(&view));
        // A sliding window of 5000 live keys over 200 000: growth, then purges of removal marks.
        for i in 0..200_000u32 {
            p.insert(&key(i));
            if i >= 5000 {
                p.remove(&key(i - 5000));
            }
        }
        assert_eq!(p.len(), 5000);
        assert!((195_000..200_000).all(|i| view.contains(&key(i))));
        assert!((0..195_000).step_by(7).all(|i| !view.contains(&key(i))));
        assert!(
            view.table().capacity() <= 16_384,
            "purged, not grown without bound"
        );
    }

    #[test]
    fn readers_see_every_key_published_before_they_look() {
        // One writer publishes keys in order and announces each; readers check that every
        // announced key is visible (the success-after-publish order callers rely on), while
        // the writer churns other keys (removals, growth, rebuilds).
        let view = Arc::new(PublishedKeys::default());
        let mut p = Publisher::new(Arc::clone(&view));
        let announced = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (view, announced, stop) =
                    (Arc::clone(&view), Arc::clone(&announced), Arc::clone(&stop));
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        let n = announced.load(Ordering::Acquire);
                        if n > 0 {
                            assert!(
                                view.contains(&key(n - 1)),
                                "key {} announced, not seen",
                                n - 1
                            );
                        }
                    }
                })
            })
            .collect();
        for i in 0..20_000u32 {
            p.insert(&key(i));
            announced.store(i + 1, Ordering::Release);
            // Churn on keys the readers never check: removals and growth meanwhile.
            p.insert(&key(1_000_000 + i));
            if i % 2 == 0 {
                p.remove(&key(1_000_000 + i / 2));
            }
        }
        stop.store(true, Ordering::Release);
        for r in readers {
            r.join().expect("reader");
        }
        assert!((0..20_000).all(|i| view.contains(&key(i))));
        assert_eq!(p.len(), 20_000 + 10_000);
    }
}
