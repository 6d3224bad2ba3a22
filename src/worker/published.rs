//! The keys a worker holds, as callers see them: what `Engine::lookup` reads.
//!
//! An open-addressing table of 64-bit key fingerprints (each key's hash). The worker is the only
//! writer: it publishes a key with one atomic store into the table and removes it with another
//! ([`Publisher`]); callers probe with atomic loads ([`PublishedKeys::contains`]). The worker
//! takes no lock and allocates nothing to publish, so a thread calling `lookup` in a loop cannot
//! hold up its data path.
//!
//! When the table is three quarters full of keys and removal marks, the worker starts a fresh
//! one (twice the size while growing, the same size to purge removal marks) and moves the old
//! table's keys over a slice at a time: [`MIGRATE_STEP`] old slots per publish or removal, so no
//! change pauses the worker for more than one slice. Meanwhile callers read both tables (new
//! keys go to the new one, a removal marks both), and a key is in at least one of them from its
//! publication to its removal. The current pair is published through an `ArcSwap`: a caller
//! picks it up without a lock and without touching its reference count (a hazard slot of its
//! own thread, `arc_swap`'s debt list), and the worker swaps it at the start and the end of a
//! rebuild; an old pair is freed when the last caller that picked it up lets go.
//!
//! A key is published before its store is reported, so a caller that saw the success also sees
//! the key. Two keys with the same 64-bit hash look alike: a lookup may answer "held" for a key
//! that is not (its load then misses and is reported as a miss, never as wrong bytes); with n
//! keys held the chance is about n / 2^64 per lookup.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};

use crate::key::Key;

const EMPTY: u64 = 0;
/// A removed key: probes continue past it.
const GONE: u64 = 1;
const MIN_CAPACITY: usize = 1024;
/// Old slots moved to the new table per change while a rebuild is under way. A rebuild of a
/// table of C slots ends after C / 256 changes, well before the new table can fill.
const MIGRATE_STEP: usize = 256;

struct Table {
    slots: Box<[AtomicU64]>,
    /// A word per slot where the table carries one per key (`Publisher::set`); empty where it
    /// holds keys alone.
    values: Box<[AtomicU64]>,
    mask: usize,
}

impl Table {
    fn new(capacity: usize, valued: bool) -> Table {
        let capacity = capacity.next_power_of_two().max(MIN_CAPACITY);
        let words = |n: usize| (0..n).map(|_| AtomicU64::new(0)).collect();
        Table {
            slots: words(capacity),
            values: words(if valued { capacity } else { 0 }),
            mask: capacity - 1,
        }
    }

    fn capacity(&self) -> usize {
        self.mask + 1
    }

    fn valued(&self) -> bool {
        !self.values.is_empty()
    }

    /// The slot holding `fp`, if any.
    fn find(&self, fp: u64) -> Option<usize> {
        let mut i = fp as usize & self.mask;
        for _ in 0..self.capacity() {
            match self.slots[i].load(Ordering::Acquire) {
                v if v == fp => return Some(i),
                EMPTY => return None,
                _ => i = (i + 1) & self.mask,
            }
        }
        None
    }

    fn contains(&self, fp: u64) -> bool {
        self.find(fp).is_some()
    }

    /// `fp`'s word. The slot is read again after the word: a slot emptied (and perhaps
    /// reused by another key) meanwhile answers `None`, as a read just after the removal would
    /// (the writer stores a new key's word before its fingerprint).
    fn value(&self, fp: u64) -> Option<u64> {
        let i = self.find(fp)?;
        let value = self.values[i].load(Ordering::Acquire);
        (self.slots[i].load(Ordering::Acquire) == fp).then_some(value)
    }

    /// Writer only: stores `fp` (with `value`, in a valued table) unless it is there, in the
    /// first removal mark of its probe sequence or else the empty slot that ends it, in one
    /// pass. `None` if it was there (its word replaced by `value`), else whether an empty slot
    /// was used. The table is never full (the rebuild sees to it).
    fn insert(&self, fp: u64, value: u64) -> Option<bool> {
        let mut i = fp as usize & self.mask;
        let mut reuse = None;
        loop {
            match self.slots[i].load(Ordering::Relaxed) {
                v if v == fp => {
                    self.put_value(i, value);
                    return None;
                }
                GONE => {
                    reuse.get_or_insert(i);
                }
                EMPTY => break,
                _ => {}
            }
            i = (i + 1) & self.mask;
        }
        let at = reuse.unwrap_or(i);
        self.put_value(at, value);
        self.slots[at].store(fp, Ordering::Release);
        Some(reuse.is_none())
    }

    fn put_value(&self, i: usize, value: u64) {
        if self.valued() {
            self.values[i].store(value, Ordering::Release);
        }
    }

    /// Writer only: replaces `fp`'s word; true if `fp` is here.
    fn update(&self, fp: u64, value: u64) -> bool {
        self.find(fp).is_some_and(|i| {
            self.put_value(i, value);
            true
        })
    }

    /// Writer only: marks `fp` removed; true if it was there.
    fn take(&self, fp: u64) -> bool {
        self.find(fp).is_some_and(|i| {
            self.slots[i].store(GONE, Ordering::Release);
            true
        })
    }
}

/// The fingerprint of `key`: its hash, kept clear of the two marks.
fn fingerprint(key: &Key) -> u64 {
    key.hash64().max(GONE + 1)
}

/// What callers read: the table new keys go to, and during a rebuild the one it replaces.
struct Tables {
    new: Arc<Table>,
    old: Option<Arc<Table>>,
}

impl Tables {
    fn contains(&self, fp: u64) -> bool {
        self.new.contains(fp) || self.old.as_ref().is_some_and(|o| o.contains(fp))
    }

    /// A key moved to the new table is in both, with the same word.
    fn value(&self, fp: u64) -> Option<u64> {
        self.new
            .value(fp)
            .or_else(|| self.old.as_ref().and_then(|o| o.value(fp)))
    }
}

/// The callers' side, shared with the worker's [`Publisher`].
pub(crate) struct PublishedKeys {
    current: ArcSwap<Tables>,
    /// Whether each key carries a word ([`PublishedKeys::valued`]).
    valued: bool,
}

impl Default for PublishedKeys {
    fn default() -> Self {
        PublishedKeys::with_words(false)
    }
}

impl PublishedKeys {
    /// Keys, each with a word its [`Publisher`] sets ([`Publisher::set`]) and callers read
    /// ([`PublishedKeys::value`]).
    pub fn valued() -> PublishedKeys {
        PublishedKeys::with_words(true)
    }

    fn with_words(valued: bool) -> PublishedKeys {
        PublishedKeys {
            current: ArcSwap::from_pointee(Tables {
                new: Arc::new(Table::new(MIN_CAPACITY, valued)),
                old: None,
            }),
            valued,
        }
    }

    fn set(&self, tables: Tables) {
        self.current.store(Arc::new(tables));
    }

    pub fn contains(&self, key: &Key) -> bool {
        self.current.load().contains(fingerprint(key))
    }

    /// `key`'s word (a valued table), if `key` is published.
    pub fn value(&self, key: &Key) -> Option<u64> {
        debug_assert!(self.valued, "a table of keys alone carries no words");
        self.current.load().value(fingerprint(key))
    }

    /// The current tables, for many lookups at one pick-up.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot(self.current.load())
    }
}

/// The published keys at one moment ([`PublishedKeys::snapshot`]); hold it briefly (a lookup's
/// length): it keeps the tables it saw alive.
pub(crate) struct Snapshot(Guard<Arc<Tables>>);

impl Snapshot {
    /// Inlined into a lookup's loop over its keys (a call per key costs a lookup of 1000 hits
    /// about a tenth of its time).
    #[inline]
    pub fn contains(&self, key: &Key) -> bool {
        self.0.contains(fingerprint(key))
    }

    /// `key`'s word (a valued table), if `key` is published.
    pub fn value(&self, key: &Key) -> Option<u64> {
        self.0.value(fingerprint(key))
    }

    /// Slots of the table new keys go to.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.0.new.capacity()
    }

    /// Whether a rebuild was under way.
    #[cfg(test)]
    fn rebuilding(&self) -> bool {
        self.0.old.is_some()
    }
}

/// The worker's side: the only writer of its [`PublishedKeys`].
pub(crate) struct Publisher {
    view: Arc<PublishedKeys>,
    table: Arc<Table>,
    /// During a rebuild: the table being emptied into `table`, and its next slot to move.
    old: Option<(Arc<Table>, usize)>,
    /// Keys published (in `table` or still in `old`).
    live: usize,
    /// Slots of `table` that are not empty (keys and removal marks).
    used: usize,
}

impl Publisher {
    /// The only writer of `view`, which starts empty.
    pub fn new(view: Arc<PublishedKeys>) -> Publisher {
        let table = Arc::new(Table::new(MIN_CAPACITY, view.valued));
        view.set(Tables {
            new: Arc::clone(&table),
            old: None,
        });
        Publisher {
            view,
            table,
            old: None,
            live: 0,
            used: 0,
        }
    }

    /// Publishes `key` (a no-op if it is already published).
    pub fn insert(&mut self, key: &Key) {
        self.put(fingerprint(key), 0);
    }

    /// Publishes `key` with `value` as its word (a valued table), or replaces the word of a
    /// key published. Callers read a key's word whole, the one before or the one after.
    pub fn set(&mut self, key: &Key, value: u64) {
        debug_assert!(self.view.valued, "a table of keys alone carries no words");
        self.put(fingerprint(key), value);
    }

    fn put(&mut self, fp: u64, value: u64) {
        // A key not moved yet is still published in the old table (and only there, or in both
        // with the same word once moved).
        if let Some((o, _)) = &self.old {
            if o.update(fp, value) {
                self.table.update(fp, value);
                return;
            }
        }
        match self.table.insert(fp, value) {
            None => return,
            Some(empty) => self.used += usize::from(empty),
        }
        self.live += 1;
        self.migrate();
        if self.used * 4 >= self.table.capacity() * 3 {
            // A rebuild still under way (it cannot be, by MIGRATE_STEP) ends first.
            while self.old.is_some() {
                self.migrate();
            }
            let grow = self.live * 2 >= self.table.capacity();
            let capacity = self.table.capacity() * if grow { 2 } else { 1 };
            self.start_rebuild(capacity);
        }
    }

    /// Withdraws `key` (a no-op if it is not published).
    pub fn remove(&mut self, key: &Key) {
        let fp = fingerprint(key);
        // A moved key is in both tables until the old one is retired.
        let in_new = self.table.take(fp);
        let in_old = self.old.as_ref().is_some_and(|(o, _)| o.take(fp));
        if in_new || in_old {
            self.live -= 1;
        }
        self.migrate();
    }

    #[cfg(any(test, feature = "sim"))]
    pub fn contains(&self, key: &Key) -> bool {
        let fp = fingerprint(key);
        self.table.contains(fp) || self.old.as_ref().is_some_and(|(o, _)| o.contains(fp))
    }

    /// Keys published (fingerprints; keys sharing a hash count once).
    #[cfg(any(test, feature = "sim"))]
    pub fn len(&self) -> usize {
        self.live
    }

    /// Starts moving every key to a fresh table of `capacity`; callers see both from now on.
    fn start_rebuild(&mut self, capacity: usize) {
        let old = std::mem::replace(
            &mut self.table,
            Arc::new(Table::new(capacity, self.view.valued)),
        );
        self.used = 0;
        self.view.set(Tables {
            new: Arc::clone(&self.table),
            old: Some(Arc::clone(&old)),
        });
        self.old = Some((old, 0));
    }

    /// Moves the next [`MIGRATE_STEP`] slots of the old table; retires it after its last.
    fn migrate(&mut self) {
        let Some((old, next)) = self.old.as_mut() else {
            return;
        };
        let end = (*next + MIGRATE_STEP).min(old.capacity());
        for i in *next..end {
            let v = old.slots[i].load(Ordering::Relaxed);
            let value = old.values.get(i).map_or(0, |w| w.load(Ordering::Relaxed));
            if v > GONE && self.table.insert(v, value) == Some(true) {
                self.used += 1;
            }
        }
        *next = end;
        if end == old.capacity() {
            self.old = None;
            self.view.set(Tables {
                new: Arc::clone(&self.table),
                old: None,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn key(i: u32) -> Key {
        Key::new(&i.to_le_bytes()).expect("key")
    }

    /// A million keys through growth rebuilds: every one stays visible to callers, during a
    /// rebuild too, and a caller snapshot taken before a rebuild keeps answering. Prints the
    /// longest insert (the pause a change takes: a slice of a rebuild, or allocating the fresh
    /// table of 2^21 slots); measured, not asserted (`cargo test --release -p kvtier --lib published -- --nocapture`).
    #[test]
    fn a_million_keys_survive_every_rebuild() {
        let view = Arc::new(PublishedKeys::default());
        let mut p = Publisher::new(Arc::clone(&view));
        let n = 1_000_000u32;
        let mut longest = std::time::Duration::ZERO;
        let early = view.snapshot();
        let mut seen_rebuilding = 0u32;
        for i in 0..n {
            let t = std::time::Instant::now();
            p.insert(&key(i));
            longest = longest.max(t.elapsed());
            let snap = view.snapshot();
            if snap.rebuilding() {
                seen_rebuilding += 1;
                // Keys not moved yet are read from the old table.
                assert!(snap.contains(&key(i / 2)) && snap.contains(&key(i)));
            }
        }
        assert!(
            seen_rebuilding > 0,
            "rebuilds ran in steps, callers reading both tables"
        );
        assert!(early.contains(&key(0)), "an old snapshot still answers");
        let snap = view.snapshot();
        assert!((0..n).all(|i| snap.contains(&key(i))));
        assert!(!snap.contains(&key(n)));
        assert_eq!(p.len(), n as usize);
        eprintln!(
            "published: {n} keys, table of {} slots, longest insert {:?}",
            snap.capacity(),
            longest
        );
    }

    #[test]
    fn words_follow_their_keys_through_rebuilds() {
        // Key i is set to 3i, key i/2 replaced by 3(i/2)+1 at every third i (while it may sit
        // in the old table, the new one or both), every fifth key i removed after its set.
        let view = Arc::new(PublishedKeys::valued());
        let mut p = Publisher::new(Arc::clone(&view));
        let n = 50_000u32;
        let mut checked_rebuilding = 0;
        for i in 1..n {
            p.set(&key(i), u64::from(i) * 3);
            assert_eq!(view.value(&key(i)), Some(u64::from(i) * 3));
            if i % 3 == 0 {
                let j = i / 2;
                p.set(&key(j), u64::from(j) * 3 + 1);
                assert_eq!(view.value(&key(j)), Some(u64::from(j) * 3 + 1), "key {j}");
                if view.snapshot().rebuilding() {
                    checked_rebuilding += 1;
                }
            }
            if i % 5 == 0 {
                p.remove(&key(i));
                assert_eq!(view.value(&key(i)), None);
            }
        }
        assert!(checked_rebuilding > 0, "replaced during rebuilds");
        for j in 1..n {
            let replaced = [2 * j, 2 * j + 1].iter().any(|&i| i < n && i % 3 == 0);
            let want = if replaced {
                Some(u64::from(j) * 3 + 1)
            } else if j % 5 == 0 {
                None
            } else {
                Some(u64::from(j) * 3)
            };
            assert_eq!(view.value(&key(j)), want, "key {j}");
        }
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
            view.snapshot().capacity() <= 16_384,
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
