//! A worker's slab index: the slot that holds each key it stores, or is storing.
//!
//! A key is pointed at its slot when its store starts (so a second store of it finds it
//! present) and unpointed when the slot stops holding it (eviction, removal, a failed write, a
//! failed device). Published keys (what lookups see) are a subset: a key is published once its
//! slot is valid. Only the place a key points at may unpoint it: a copy unindexed earlier (its
//! device was marked failed) must not unpoint the newer copy stored elsewhere since.

use crate::key::{Key, KeyMap};

/// A slot: device index and slot within the worker's share of that device.
pub(crate) type Place = (u16, u32);

#[derive(Debug, Default)]
pub(crate) struct Index {
    map: KeyMap<Place>,
}

impl Index {
    pub fn with_capacity(n: usize) -> Index {
        let mut map = KeyMap::default();
        map.reserve(n);
        Index { map }
    }

    /// The slot `key` points at.
    pub fn get(&self, key: &Key) -> Option<Place> {
        self.map.get(key).copied()
    }

    pub fn contains(&self, key: &Key) -> bool {
        self.map.contains_key(key)
    }

    /// Points `key`, which points nowhere, at `place`.
    pub fn point(&mut self, key: Key, place: Place) {
        let old = self.map.insert(key, place);
        debug_assert!(
            old.is_none(),
            "{key:?} pointed at {place:?} while it pointed at {old:?}"
        );
    }

    /// Unpoints `key` if it points at `place`; true if it did.
    pub fn unpoint(&mut self, key: &Key, place: Place) -> bool {
        if self.get(key) == Some(place) {
            self.map.remove(key);
            true
        } else {
            false
        }
    }

    #[cfg(any(test, feature = "sim"))]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = (Key, Place)> + '_ {
        self.map.iter().map(|(k, &p)| (*k, p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> Key {
        Key::new(s.as_bytes()).expect("a key")
    }

    /// Only the place a key points at unpoints it: a stale copy's place leaves the newer one.
    #[test]
    fn only_the_current_place_unpoints_a_key() {
        let mut index = Index::with_capacity(4);
        let k = key("a");
        index.point(k, (0, 7));
        assert_eq!(index.get(&k), Some((0, 7)));
        assert!(!index.unpoint(&k, (1, 7)), "another device's slot");
        assert!(!index.unpoint(&k, (0, 8)), "another slot");
        assert!(index.contains(&k));
        assert!(index.unpoint(&k, (0, 7)));
        assert!(!index.contains(&k) && index.get(&k).is_none());
        assert!(!index.unpoint(&k, (0, 7)), "once");
        index.point(k, (1, 2));
        assert_eq!(index.iter().collect::<Vec<_>>(), [(k, (1, 2))]);
        assert_eq!(index.len(), 1);
    }

    /// Pointing a key that points somewhere already would lose track of a slot: a bug, caught in
    /// debug builds.
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "while it pointed at")]
    fn pointing_a_pointed_key_again_is_a_bug() {
        let mut index = Index::default();
        index.point(key("a"), (0, 1));
        index.point(key("a"), (0, 2));
    }
}
