//! The keys a worker holds, as callers see them: what `Engine::lookup` and `Engine::keys` read.
//!
//! The worker is the only writer (one insert per stored block, one removal per evicted or
//! dropped one); any number of caller threads read at the same time. A lock-free hash set
//! (`papaya`) takes no lock on either side, so a thread calling `lookup` in a loop never holds
//! up the worker's data path, and a worker publishing never makes a lookup wait. A key is
//! inserted before its store is reported, so a caller that saw the success also sees the key.

use crate::key::{Key, KeyBuildHasher};

#[derive(Default)]
pub(crate) struct PublishedKeys {
    set: papaya::HashSet<Key, KeyBuildHasher>,
}

impl PublishedKeys {
    pub fn insert(&self, key: Key) {
        self.set.pin().insert(key);
    }

    pub fn remove(&self, key: &Key) {
        self.set.pin().remove(key);
    }

    /// Publishes many keys under one guard (recovery, the scan at open).
    pub fn extend(&self, keys: impl IntoIterator<Item = Key>) {
        let set = self.set.pin();
        for key in keys {
            set.insert(key);
        }
    }

    pub fn contains(&self, key: &Key) -> bool {
        self.set.pin().contains(key)
    }

    /// Appends every key to `out` (a moment's view: concurrent changes may or may not show).
    pub fn collect_into(&self, out: &mut Vec<Key>) {
        let set = self.set.pin();
        out.reserve(set.len());
        out.extend(set.iter().copied());
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.set.pin().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    fn key(i: u32) -> Key {
        Key::new(&i.to_le_bytes()).expect("key")
    }

    #[test]
    fn insert_remove_contains() {
        let p = PublishedKeys::default();
        p.extend((0..100).map(key));
        p.remove(&key(7));
        p.insert(key(7));
        p.remove(&key(8));
        assert!(p.contains(&key(7)));
        assert!(!p.contains(&key(8)));
        assert_eq!(p.len(), 99);
        let mut all = Vec::new();
        p.collect_into(&mut all);
        all.sort_by_key(|k| k.as_bytes().to_vec());
        assert_eq!(all.len(), 99);
        assert!(!all.contains(&key(8)));
    }

    #[test]
    fn readers_see_every_key_published_before_they_look() {
        // One writer publishes keys in order and announces each; readers check that every
        // announced key is visible (the success-after-publish order callers rely on).
        let p = Arc::new(PublishedKeys::default());
        let announced = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (p, announced, stop) =
                    (Arc::clone(&p), Arc::clone(&announced), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut checked = 0u64;
                    while !stop.load(Ordering::Acquire) {
                        let n = announced.load(Ordering::Acquire);
                        if n > 0 {
                            assert!(
                                p.contains(&key(n - 1)),
                                "key {} announced but not seen",
                                n - 1
                            );
                            checked += 1;
                        }
                    }
                    checked
                })
            })
            .collect();
        for i in 0..20_000u32 {
            p.insert(key(i));
            announced.store(i + 1, Ordering::Release);
            // Churn on keys the readers never check: removals and growth meanwhile.
            p.insert(key(1_000_000 + i));
            if i % 2 == 0 {
                p.remove(&key(1_000_000 + i / 2));
            }
        }
        stop.store(true, Ordering::Release);
        for r in readers {
            r.join().expect("reader");
        }
        assert!((0..20_000).all(|i| p.contains(&key(i))));
        assert_eq!(p.len(), 20_000 + 10_000);
    }
}
