//! A files worker's index: the blocks it stores or is storing, their LRU order and their pins.
//!
//! An entry is [`State::Writing`] from the start of its store to the rename that makes the
//! file visible, then [`State::Valid`]. Only valid entries are in the LRU (a block being
//! written is nobody's eviction victim) and only valid entries are pinned (a load reads a file
//! that exists). A load holds a [`Pin`] on the entry it reads, not on the key: when the entry
//! is replaced meanwhile (its file found corrupt and removed, then the key stored again), the
//! old load's unpin leaves the new entry's count alone, so a file a load is reading is never
//! evicted by this worker.

use std::collections::BTreeMap;

use crate::key::{Key, KeyMap};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    Writing,
    Valid,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    pub dev: u16,
    pub state: State,
    pub pins: u32,
    /// Whether its bytes are in the shared usage counter (written or scanned by kvtier).
    pub counted: bool,
    /// Its place in the LRU (valid entries; the last use).
    tick: u64,
    /// When it was made: one number per entry for the life of the index, what a [`Pin`] names.
    born: u64,
}

/// A load's hold on one entry (not on its key): see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pin(u64);

#[derive(Default)]
pub(crate) struct Index {
    map: KeyMap<Entry>,
    /// Valid entries by last use, oldest first: tick → key.
    lru: BTreeMap<u64, Key>,
    tick: u64,
}

impl Index {
    pub fn get(&self, key: &Key) -> Option<&Entry> {
        self.map.get(key)
    }

    pub fn contains(&self, key: &Key) -> bool {
        self.map.contains_key(key)
    }

    /// Entries, writing ones included.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn valid(&self) -> impl Iterator<Item = (Key, &Entry)> + '_ {
        self.map
            .iter()
            .filter(|(_, e)| e.state == State::Valid)
            .map(|(k, e)| (*k, e))
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Indexes `key`, which is not indexed, as a store of it begins on device `dev`.
    pub fn writing(&mut self, key: Key, dev: u16, counted: bool) {
        let born = self.next_tick();
        let old = self.map.insert(
            key,
            Entry {
                dev,
                state: State::Writing,
                pins: 0,
                counted,
                tick: born,
                born,
            },
        );
        debug_assert!(
            old.is_none(),
            "{key:?} began a store while indexed: {old:?}"
        );
    }

    /// Forgets `key`'s store, which failed; true if it was being written (a valid entry, or
    /// none, is left as it is).
    pub fn abandon(&mut self, key: &Key) -> bool {
        if self.map.get(key).is_some_and(|e| e.state == State::Writing) {
            self.map.remove(key);
            true
        } else {
            false
        }
    }

    /// Makes `key` valid on device `dev` and its newest use: a store's rename, a file found at
    /// open or found by a load. Returns the entry it replaces, if any (its store's own writing
    /// entry, usually).
    pub fn publish(&mut self, key: Key, dev: u16, counted: bool) -> Option<Entry> {
        let tick = self.next_tick();
        let old = self.map.insert(
            key,
            Entry {
                dev,
                state: State::Valid,
                pins: 0,
                counted,
                tick,
                born: tick,
            },
        );
        if let Some(old) = old {
            self.leave_lru(&key, &old);
            debug_assert!(old.pins == 0, "{key:?} replaced while pinned: {old:?}");
        }
        self.lru.insert(tick, key);
        old
    }

    /// Unindexes `key`, whatever its state and pins (its file is gone, or going).
    pub fn remove(&mut self, key: &Key) -> Option<Entry> {
        let e = self.map.remove(key)?;
        self.leave_lru(key, &e);
        Some(e)
    }

    fn leave_lru(&mut self, key: &Key, e: &Entry) {
        let at = self.lru.remove(&e.tick);
        debug_assert_eq!(
            at.as_ref(),
            (e.state == State::Valid).then_some(key),
            "{key:?} ({e:?}) in the LRU as it should be"
        );
    }

    /// Makes valid `key` the newest use; a key being written or not indexed is left alone.
    pub fn touch(&mut self, key: &Key) {
        self.use_valid(key);
    }

    /// Pins valid `key` for a load that reads its file (a use: it becomes the newest);
    /// `None` when it is not indexed or being written.
    pub fn pin(&mut self, key: &Key) -> Option<Pin> {
        let e = self.use_valid(key)?;
        e.pins += 1;
        Some(Pin(e.born))
    }

    /// Valid `key`'s entry, moved to the newest place in the LRU.
    fn use_valid(&mut self, key: &Key) -> Option<&mut Entry> {
        let tick = self.tick + 1;
        let e = self.map.get_mut(key).filter(|e| e.state == State::Valid)?;
        let old = std::mem::replace(&mut e.tick, tick);
        self.tick = tick;
        let at = self.lru.remove(&old);
        debug_assert_eq!(at.as_ref(), Some(key), "a valid entry is in the LRU");
        self.lru.insert(tick, *key);
        Some(e)
    }

    /// Lets go of `pin` on `key`; false when the entry it named is gone (replaced or removed).
    pub fn unpin(&mut self, key: &Key, pin: Pin) -> bool {
        match self.map.get_mut(key).filter(|e| e.born == pin.0) {
            Some(e) => {
                debug_assert!(e.pins > 0, "{key:?} unpinned more often than pinned");
                e.pins -= 1;
                true
            }
            None => false,
        }
    }

    /// Whether `pin` still names `key`'s entry and is the only pin on it.
    pub fn pinned_only_by(&self, key: &Key, pin: Pin) -> bool {
        self.map
            .get(key)
            .is_some_and(|e| e.born == pin.0 && e.pins == 1)
    }

    /// Up to `n` eviction victims on device `d`, oldest use first: valid and not pinned.
    pub fn victims(&self, d: usize, n: usize) -> Vec<Key> {
        self.lru
            .values()
            .filter(|k| self.map.get(k).is_some_and(|e| idle_on(e, d)))
            .take(n)
            .copied()
            .collect()
    }

    /// Every valid, unpinned key on device `d`.
    pub fn idle_on(&self, d: usize) -> Vec<Key> {
        self.valid()
            .filter(|(_, e)| idle_on(e, d))
            .map(|(k, _)| k)
            .collect()
    }

    #[cfg(any(test, feature = "sim"))]
    pub fn any_pinned(&self) -> bool {
        self.map.values().any(|e| e.pins != 0)
    }

    /// The invariants, checked in full: the LRU holds exactly the valid entries, each at its
    /// own tick; entries being written hold no pins; no tick is ahead of the clock.
    #[cfg(any(test, feature = "sim"))]
    pub fn check(&self) -> Result<(), String> {
        let valid = self.valid().count();
        if self.lru.len() != valid {
            return Err(format!(
                "{} keys in the LRU, {valid} valid entries",
                self.lru.len()
            ));
        }
        for (tick, key) in &self.lru {
            match self.map.get(key) {
                Some(e) if e.tick == *tick && e.state == State::Valid => {}
                e => return Err(format!("LRU tick {tick} names {key:?}, indexed as {e:?}")),
            }
        }
        for (key, e) in &self.map {
            if e.state == State::Writing && e.pins != 0 {
                return Err(format!("{key:?} pinned while written: {e:?}"));
            }
            if e.tick > self.tick || e.born > self.tick {
                return Err(format!("{key:?} ahead of the clock {}: {e:?}", self.tick));
            }
        }
        Ok(())
    }
}

fn idle_on(e: &Entry, d: usize) -> bool {
    e.dev as usize == d && e.state == State::Valid && e.pins == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> Key {
        Key::new(s.as_bytes()).expect("a key")
    }

    /// A block being written is in no LRU and pins nothing; once published it is the newest
    /// use; touches reorder valid blocks only.
    #[test]
    fn only_valid_blocks_take_part_in_the_lru() {
        let mut ix = Index::default();
        let (a, b, c) = (key("a"), key("b"), key("c"));
        ix.publish(a, 0, true);
        ix.publish(b, 0, true);
        ix.writing(c, 0, true);
        assert_eq!(ix.victims(0, 8), [a, b]);
        assert!(ix.pin(&c).is_none(), "a block being written is not read");
        ix.touch(&c);
        ix.check().expect("consistent");
        ix.touch(&a);
        assert_eq!(ix.victims(0, 8), [b, a]);
        let old = ix.publish(c, 0, true).expect("replaces its writing entry");
        assert_eq!(old.state, State::Writing);
        assert_eq!(ix.victims(0, 8), [b, a, c]);
        assert_eq!(ix.victims(0, 2), [b, a]);
        assert!(ix.victims(1, 8).is_empty(), "another device");
        assert_eq!(ix.len(), 3);
        ix.check().expect("consistent");
    }

    /// A store that fails after a caller touched its key leaves nothing in the LRU (the touch
    /// used to put the writing key there, and the failed store left it behind).
    #[test]
    fn a_failed_store_leaves_nothing_behind() {
        let mut ix = Index::default();
        let a = key("a");
        ix.writing(a, 0, true);
        ix.touch(&a);
        assert!(ix.abandon(&a));
        assert!(!ix.contains(&a) && ix.lru.is_empty());
        ix.check().expect("consistent");
        ix.publish(a, 0, true);
        assert!(!ix.abandon(&a), "a valid block is not a failed store's");
        assert!(ix.contains(&a));
        ix.check().expect("consistent");
    }

    /// A pin names an entry, not a key: a load of a block that was dropped and stored again
    /// does not unpin the new block, which stays safe from eviction while its own load reads.
    #[test]
    fn a_pin_on_a_replaced_entry_leaves_the_new_one_alone() {
        let mut ix = Index::default();
        let a = key("a");
        ix.publish(a, 0, true);
        let old = ix.pin(&a).expect("valid");
        assert!(ix.pinned_only_by(&a, old));
        assert!(ix.victims(0, 8).is_empty(), "pinned");
        ix.remove(&a).expect("indexed");
        ix.writing(a, 0, true);
        ix.publish(a, 0, true);
        let new = ix.pin(&a).expect("valid");
        assert_ne!(old, new);
        assert!(!ix.pinned_only_by(&a, old));
        assert!(
            !ix.unpin(&a, old),
            "the old load's pin is gone with its entry"
        );
        assert_eq!(ix.get(&a).expect("indexed").pins, 1);
        assert!(ix.victims(0, 8).is_empty(), "still read by the new load");
        let again = ix.pin(&a).expect("valid");
        assert!(!ix.pinned_only_by(&a, new), "two loads read it");
        assert!(ix.unpin(&a, again));
        assert!(ix.unpin(&a, new));
        assert_eq!(ix.victims(0, 8), [a]);
        assert!(!ix.any_pinned());
        ix.check().expect("consistent");
    }

    #[test]
    fn idle_keys_of_a_device_skip_pinned_and_written_blocks() {
        let mut ix = Index::default();
        let (a, b, c, d) = (key("a"), key("b"), key("c"), key("d"));
        ix.publish(a, 0, true);
        ix.publish(b, 0, false);
        ix.publish(d, 1, true);
        ix.writing(c, 0, true);
        let _pin = ix.pin(&b).expect("valid");
        assert_eq!(ix.idle_on(0), [a]);
        assert_eq!(ix.idle_on(1), [d]);
        let mut valid: Vec<Key> = ix.valid().map(|(k, _)| k).collect();
        valid.sort_by(|x, y| x.as_bytes().cmp(y.as_bytes()));
        assert_eq!(valid, [a, b, d]);
        assert!(ix.any_pinned());
        let removed = ix.remove(&c).expect("indexed");
        assert_eq!(removed.state, State::Writing);
        ix.check().expect("consistent");
    }

    /// The full check finds a broken LRU (as a change that skipped it would leave).
    #[test]
    fn the_check_finds_an_lru_out_of_step() {
        let mut ix = Index::default();
        let a = key("a");
        ix.publish(a, 0, true);
        ix.lru.clear();
        assert!(ix
            .check()
            .expect_err("inconsistent")
            .contains("0 keys in the LRU, 1 valid"));
        // As many LRU places as valid entries, but one names the block being written.
        let mut ix = Index::default();
        let b = key("b");
        ix.publish(a, 0, true);
        ix.writing(b, 0, true);
        ix.lru.clear();
        ix.lru.insert(2, b);
        let err = ix.check().expect_err("inconsistent");
        assert!(
            err.contains("LRU tick 2 names") && err.contains("Writing"),
            "{err}"
        );
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "began a store while indexed")]
    fn beginning_a_store_of_an_indexed_key_is_a_bug() {
        let mut ix = Index::default();
        ix.publish(key("a"), 0, true);
        ix.writing(key("a"), 0, true);
    }
}
