//! What a tier learnt of keys it does not hold in its index: present, absent, or being asked.
//! One bounded cache, used by the S3 tier (answers of HEADs) and by the files layout (answers
//! of a `statx` on the worker's ring for blocks another process may have published).
//!
//! Bounded: past `max` keys the oldest entry goes first. Each entry carries a generation, so
//! an answer that arrives after a newer state replaced its question is dropped.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::clock::Clock;
use crate::key::Key;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Asked; no answer yet.
    Pending,
    Present,
    Absent,
}

struct Entry {
    generation: u64,
    verdict: Verdict,
    at: Instant,
}

pub(crate) struct Verdicts {
    map: HashMap<Key, Entry>,
    order: VecDeque<(Key, u64)>,
    next_generation: u64,
    max: usize,
    ttl: Duration,
    /// What answers age on.
    clock: Clock,
}

impl Verdicts {
    /// At most `max` keys (at least 1), answers trusted for `ttl`.
    pub fn new(max: usize, ttl: Duration) -> Verdicts {
        Verdicts {
            map: HashMap::new(),
            order: VecDeque::new(),
            next_generation: 1,
            max: max.max(1),
            ttl,
            clock: Clock::default(),
        }
    }

    /// The same cache with answers aging on `clock` (the simulator's, or the monotonic one).
    #[must_use]
    pub fn with_clock(mut self, clock: Clock) -> Verdicts {
        self.clock = clock;
        self
    }

    /// Starts asking about `key`: records it pending and returns the question's generation.
    #[cfg_attr(not(feature = "s3"), allow(dead_code))] // the S3 tier's
    pub fn begin(&mut self, key: Key) -> u64 {
        self.set(key, Verdict::Pending)
    }

    /// Records `verdict` for `key` (whatever was there) and returns its generation.
    #[cfg_attr(not(feature = "s3"), allow(dead_code))] // the S3 tier's
    pub fn set(&mut self, key: Key, verdict: Verdict) -> u64 {
        self.set_then(key, verdict, |_| {})
    }

    /// [`Verdicts::set`], calling `dropped` with each key it drops to stay within `max`.
    pub fn set_then(&mut self, key: Key, verdict: Verdict, mut dropped: impl FnMut(Key)) -> u64 {
        let generation = self.next_generation;
        self.next_generation += 1;
        while self.map.len() >= self.max && !self.map.contains_key(&key) {
            let Some((old, g)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&old).is_some_and(|e| e.generation == g) {
                self.map.remove(&old);
                dropped(old);
            }
        }
        self.map.insert(
            key,
            Entry {
                generation,
                verdict,
                at: self.clock.now(),
            },
        );
        self.order.push_back((key, generation));
        if self.order.len() > 2 * self.max + 16 {
            let map = &self.map;
            self.order
                .retain(|(k, g)| map.get(k).is_some_and(|e| e.generation == *g));
        }
        generation
    }

    /// Asks about `key` again while its current verdict is still served (it counts as fresh
    /// until the new answer; a key not held is recorded absent meanwhile); returns the new
    /// question's generation. `dropped` as for [`Verdicts::set_then`].
    pub fn renew(&mut self, key: Key, dropped: impl FnMut(Key)) -> u64 {
        let verdict = self.map.get(&key).map_or(Verdict::Absent, |e| e.verdict);
        self.set_then(key, verdict, dropped)
    }

    /// Records the answer to question `generation` about `key`, unless a newer state replaced
    /// it.
    pub fn answer(&mut self, key: Key, generation: u64, verdict: Verdict) {
        if let Some(e) = self.map.get_mut(&key) {
            if e.generation == generation {
                e.verdict = verdict;
                e.at = self.clock.now();
            }
        }
    }

    /// Forgets `key` if question `generation` is still its latest state (the answer went
    /// somewhere better, such as the tier's own index).
    pub fn forget(&mut self, key: &Key, generation: u64) {
        if self
            .map
            .get(key)
            .is_some_and(|e| e.generation == generation)
        {
            self.map.remove(key);
        }
    }

    /// Whether question `generation` is still `key`'s latest state (not answered, replaced or
    /// dropped from the cache).
    pub fn current(&self, key: &Key, generation: u64) -> bool {
        self.map
            .get(key)
            .is_some_and(|e| e.generation == generation)
    }

    /// The fresh verdict for `key`, if any: a pending question, or an answer younger than the
    /// TTL.
    #[cfg_attr(not(feature = "s3"), allow(dead_code))] // the S3 tier's
    pub fn get(&self, key: &Key) -> Option<Verdict> {
        self.peek(key)
            .and_then(|(verdict, fresh)| fresh.then_some(verdict))
    }

    /// The verdict for `key` however old, and whether it is fresh (pending, or younger than
    /// the TTL).
    pub fn peek(&self, key: &Key) -> Option<(Verdict, bool)> {
        self.map.get(key).map(|e| {
            // The clock is read only for an answer held (most keys asked about are not).
            let fresh =
                e.verdict == Verdict::Pending || self.clock.now().duration_since(e.at) < self.ttl;
            (e.verdict, fresh)
        })
    }

    /// `key`'s verdict and when it was recorded, if held.
    pub fn entry(&self, key: &Key) -> Option<(Verdict, Instant)> {
        self.map.get(key).map(|e| (e.verdict, e.at))
    }

    /// Keys held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> Key {
        Key::new(&i.to_le_bytes()).expect("a short key")
    }

    #[test]
    fn answers_replace_their_own_question_only() {
        let mut v = Verdicts::new(8, Duration::from_mins(1));
        let first = v.begin(key(1));
        assert_eq!(v.get(&key(1)), Some(Verdict::Pending));
        let second = v.begin(key(1));
        v.answer(key(1), first, Verdict::Present);
        assert_eq!(v.get(&key(1)), Some(Verdict::Pending), "a stale answer");
        v.answer(key(1), second, Verdict::Absent);
        assert_eq!(v.get(&key(1)), Some(Verdict::Absent));
        assert!(v.current(&key(1), second) && !v.current(&key(1), first));
        v.forget(&key(1), first);
        assert_eq!(
            v.get(&key(1)),
            Some(Verdict::Absent),
            "forget of a stale question"
        );
        v.forget(&key(1), second);
        assert_eq!(v.get(&key(1)), None);
    }

    #[test]
    fn bounded_oldest_first() {
        let mut v = Verdicts::new(3, Duration::from_mins(1));
        for i in 0..5 {
            v.set(key(i), Verdict::Absent);
        }
        assert_eq!(v.len(), 3);
        assert_eq!(v.get(&key(0)), None);
        assert_eq!(v.get(&key(1)), None);
        assert_eq!(v.get(&key(4)), Some(Verdict::Absent));
        // Re-setting a held key does not evict another.
        v.set(key(2), Verdict::Present);
        assert_eq!(v.len(), 3);
        assert_eq!(v.get(&key(3)), Some(Verdict::Absent));
        for i in 0..1000 {
            v.set(key(i % 7), Verdict::Absent);
        }
        assert!(v.order.len() <= 2 * 3 + 16, "the order queue stays bounded");
    }

    #[test]
    fn answers_age_on_the_given_clock() {
        let clock = Clock::manual();
        let mut v = Verdicts::new(8, Duration::from_secs(1)).with_clock(clock.clone());
        let g = v.begin(key(1));
        clock.advance(Duration::from_secs(5));
        assert_eq!(
            v.get(&key(1)),
            Some(Verdict::Pending),
            "a question never goes stale"
        );
        v.answer(key(1), g, Verdict::Present);
        clock.advance(Duration::from_millis(999));
        assert_eq!(v.get(&key(1)), Some(Verdict::Present));
        clock.advance(Duration::from_millis(1));
        assert_eq!(v.get(&key(1)), None, "stale at the TTL");
        assert_eq!(v.peek(&key(1)), Some((Verdict::Present, false)));
        v.renew(key(1), |_| {});
        assert_eq!(
            v.get(&key(1)),
            Some(Verdict::Present),
            "renewed: fresh again"
        );
    }

    #[test]
    fn old_answers_are_stale_pending_never() {
        let mut v = Verdicts::new(8, Duration::ZERO);
        let g = v.begin(key(1));
        assert_eq!(v.get(&key(1)), Some(Verdict::Pending));
        v.answer(key(1), g, Verdict::Absent);
        assert_eq!(v.get(&key(1)), None);
        assert_eq!(v.peek(&key(1)), Some((Verdict::Absent, false)));
    }
}
