//! The files layout's answers for keys a worker has not indexed (another process sharing the
//! directory may have published them): present, absent, or being asked (a `statx` on the
//! worker's ring finds out, `files/probe.rs`).
//!
//! The worker alone records them ([`Unindexed`], its own: no lock) and publishes each change
//! in a [`PublishedKeys`] table whose word per key is the verdict and the time it was recorded;
//! callers read them through [`UnindexedView`] with atomic loads (a lookup takes no lock and
//! writes nothing). A caller that wants a key asked about sends it to the worker
//! (`Msg::Probe`), which decides whether a question goes out ([`Unindexed::question`]): one
//! per key until its answer, however many lookups asked meanwhile.
//!
//! Two keys with the same 64-bit hash share one published word: a lookup may read the other
//! key's verdict (a hit answered for a key not held loads as a miss; an absent answer sends a
//! load to the cold tier); with n keys recorded the chance is about n / 2^64 per lookup.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::Clock;
use crate::config::FirstLookup;
use crate::key::Key;
use crate::verdicts::{Verdict, Verdicts};
use crate::worker::published::{PublishedKeys, Publisher, Snapshot};

/// The low bits of a published word: the verdict; the others, nanoseconds since `base`.
const VERDICT_BITS: u32 = 2;

fn encode(verdict: Verdict, at: Instant, base: Instant) -> u64 {
    let nanos = u64::try_from(at.saturating_duration_since(base).as_nanos())
        .unwrap_or(u64::MAX)
        .min(u64::MAX >> VERDICT_BITS);
    let code = match verdict {
        Verdict::Pending => 1,
        Verdict::Present => 2,
        Verdict::Absent => 3,
    };
    (nanos << VERDICT_BITS) | code
}

fn decode(word: u64, base: Instant) -> Option<(Verdict, Instant)> {
    let verdict = match word & ((1 << VERDICT_BITS) - 1) {
        1 => Verdict::Pending,
        2 => Verdict::Present,
        3 => Verdict::Absent,
        _ => return None,
    };
    Some((verdict, base + Duration::from_nanos(word >> VERDICT_BITS)))
}

/// What callers read of a worker's answers: no lock, nothing written.
pub(crate) struct UnindexedView {
    keys: Arc<PublishedKeys>,
    /// Keys recorded at most (the oldest go first).
    max: usize,
    /// How long an answer is trusted.
    ttl: Duration,
    clock: Clock,
    /// What published times count from.
    base: Instant,
}

impl UnindexedView {
    /// At most `max` keys (at least 1), answers trusted for `ttl` on `clock`.
    pub fn new(max: usize, ttl: Duration, clock: Clock) -> UnindexedView {
        UnindexedView {
            keys: Arc::new(PublishedKeys::valued()),
            max: max.max(1),
            ttl,
            base: clock.now(),
            clock,
        }
    }

    /// The verdict for `key` however old, and whether it is fresh (pending, or younger than
    /// the TTL); as [`Verdicts::peek`] answers on the worker.
    pub fn peek(&self, key: &Key) -> Option<(Verdict, bool)> {
        self.fresh(self.keys.value(key)?, self.clock.now())
    }

    /// The answers at one moment, for many keys: one pick-up of the table, one reading of the
    /// clock.
    pub fn read(&self) -> Answers<'_> {
        Answers {
            view: self,
            table: self.keys.snapshot(),
            now: self.clock.now(),
        }
    }

    fn fresh(&self, word: u64, now: Instant) -> Option<(Verdict, bool)> {
        let (verdict, at) = decode(word, self.base)?;
        let fresh = verdict == Verdict::Pending || now.saturating_duration_since(at) < self.ttl;
        Some((verdict, fresh))
    }
}

/// A worker's answers at one moment ([`UnindexedView::read`]); hold it briefly (a lookup's
/// length).
pub(crate) struct Answers<'a> {
    view: &'a UnindexedView,
    table: Snapshot,
    now: Instant,
}

impl Answers<'_> {
    /// As [`UnindexedView::peek`].
    pub fn peek(&self, key: &Key) -> Option<(Verdict, bool)> {
        self.view.fresh(self.table.value(key)?, self.now)
    }
}

/// The worker's side: the only writer of its [`UnindexedView`].
pub(crate) struct Unindexed {
    verdicts: Verdicts,
    publisher: Publisher,
    base: Instant,
}

impl Unindexed {
    /// The only writer of `view`, which starts empty.
    pub fn new(view: &UnindexedView) -> Unindexed {
        Unindexed {
            verdicts: Verdicts::new(view.max, view.ttl).with_clock(view.clock.clone()),
            publisher: Publisher::new(Arc::clone(&view.keys)),
            base: view.base,
        }
    }

    /// A lookup asked about `key`: the generation of a question to put to the device, or
    /// `None` where one is out already or an answer is fresh (asked by an earlier lookup). A
    /// key asked about for the first time is recorded pending (`first` = pending) or absent
    /// until its answer; a stale answer is served, as fresh, until the new one.
    pub fn question(&mut self, key: Key, first: FirstLookup) -> Option<u64> {
        let publisher = &mut self.publisher;
        let dropped = |k: Key| publisher.remove(&k);
        let generation = match self.verdicts.peek(&key) {
            Some((Verdict::Pending, _) | (_, true)) => return None,
            None if first == FirstLookup::Pending => {
                self.verdicts.set_then(key, Verdict::Pending, dropped)
            }
            Some((_, false)) | None => self.verdicts.renew(key, dropped),
        };
        self.show(key);
        Some(generation)
    }

    /// Whether question `generation` is still `key`'s latest (not answered, replaced or
    /// dropped to stay within the bound).
    pub fn current(&self, key: &Key, generation: u64) -> bool {
        self.verdicts.current(key, generation)
    }

    /// Records the answer to question `generation` about `key`, unless a newer state replaced
    /// it.
    pub fn answer(&mut self, key: Key, generation: u64, verdict: Verdict) {
        self.verdicts.answer(key, generation, verdict);
        self.show(key);
    }

    /// Forgets `key` if question `generation` is still its latest state (found: the key is in
    /// the worker's index and published there).
    pub fn forget(&mut self, key: Key, generation: u64) {
        self.verdicts.forget(&key, generation);
        self.show(key);
    }

    /// Makes callers see `key` as the worker holds it.
    fn show(&mut self, key: Key) {
        match self.verdicts.entry(&key) {
            Some((verdict, at)) => self.publisher.set(&key, encode(verdict, at, self.base)),
            None => self.publisher.remove(&key),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn key(i: u32) -> Key {
        Key::new(&i.to_le_bytes()).expect("a short key")
    }

    fn pair(max: usize, ttl: Duration) -> (Clock, Arc<UnindexedView>, Unindexed) {
        let clock = Clock::manual();
        let view = Arc::new(UnindexedView::new(max, ttl, clock.clone()));
        let worker = Unindexed::new(&view);
        (clock, view, worker)
    }

    #[test]
    fn callers_see_each_state_the_worker_records() {
        let (clock, view, mut w) = pair(8, Duration::from_secs(1));
        assert_eq!(view.peek(&key(1)), None);
        let g = w
            .question(key(1), FirstLookup::Pending)
            .expect("a first question");
        assert_eq!(view.peek(&key(1)), Some((Verdict::Pending, true)));
        clock.advance(Duration::from_secs(5));
        assert_eq!(
            view.peek(&key(1)),
            Some((Verdict::Pending, true)),
            "a question never goes stale"
        );
        w.answer(key(1), g, Verdict::Absent);
        assert_eq!(view.peek(&key(1)), Some((Verdict::Absent, true)));
        clock.advance(Duration::from_millis(999));
        assert_eq!(view.peek(&key(1)), Some((Verdict::Absent, true)));
        clock.advance(Duration::from_millis(1));
        assert_eq!(
            view.peek(&key(1)),
            Some((Verdict::Absent, false)),
            "stale at the TTL"
        );
        let again = w
            .question(key(1), FirstLookup::Pending)
            .expect("a stale answer is asked again");
        assert_eq!(
            view.peek(&key(1)),
            Some((Verdict::Absent, true)),
            "served as fresh while asked again"
        );
        w.forget(key(1), again);
        assert_eq!(view.peek(&key(1)), None, "found: forgotten");
    }

    #[test]
    fn one_question_per_key_until_its_answer() {
        let (clock, view, mut w) = pair(8, Duration::from_secs(1));
        let g = w.question(key(1), FirstLookup::Pending).expect("asked");
        assert_eq!(w.question(key(1), FirstLookup::Pending), None, "pending");
        w.answer(key(1), g, Verdict::Present);
        assert_eq!(w.question(key(1), FirstLookup::Pending), None, "fresh");
        assert_eq!(view.peek(&key(1)), Some((Verdict::Present, true)));
        clock.advance(Duration::from_secs(2));
        let newer = w.question(key(1), FirstLookup::Pending).expect("stale");
        // The answer to the old question does not replace the newer state.
        w.answer(key(1), g, Verdict::Absent);
        assert_eq!(view.peek(&key(1)), Some((Verdict::Present, true)));
        w.answer(key(1), newer, Verdict::Absent);
        assert_eq!(view.peek(&key(1)), Some((Verdict::Absent, true)));
        let g2 = w.question(key(2), FirstLookup::Miss).expect("asked");
        assert_eq!(
            view.peek(&key(2)),
            Some((Verdict::Absent, true)),
            "first lookups answer miss: recorded absent, never pending"
        );
        assert!(w.current(&key(2), g2) && !w.current(&key(2), g2 + 1));
    }

    #[test]
    fn keys_dropped_by_the_bound_are_withdrawn() {
        let (_, view, mut w) = pair(3, Duration::from_secs(1));
        for i in 0..5 {
            w.question(key(i), FirstLookup::Pending).expect("asked");
        }
        assert_eq!(view.peek(&key(0)), None);
        assert_eq!(view.peek(&key(1)), None);
        assert!((2..5).all(|i| view.peek(&key(i)) == Some((Verdict::Pending, true))));
    }

    #[test]
    fn readers_never_see_another_keys_verdict() {
        // The worker records odd keys present and even keys absent, in a bounded cache whose
        // drops reuse slots all the time; readers check every verdict they see against its
        // key's parity.
        let (_, view, mut w) = pair(512, Duration::from_hours(1));
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|r| {
                let (view, stop) = (Arc::clone(&view), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut seen = 0u64;
                    let mut i = r;
                    while !stop.load(Ordering::Acquire) {
                        i = (i + 7) % 40_000;
                        if let Some((v, _)) = view.peek(&key(i)) {
                            let want = if i % 2 == 1 {
                                Verdict::Present
                            } else {
                                Verdict::Absent
                            };
                            assert!(v == want || v == Verdict::Pending, "key {i}: {v:?}");
                            seen += 1;
                        }
                    }
                    seen
                })
            })
            .collect();
        for round in 0..5u32 {
            for i in 0..40_000u32 {
                let g = w
                    .question(key(i), FirstLookup::Pending)
                    .unwrap_or_else(|| panic!("round {round}, key {i}: dropped, asked again"));
                let v = if i % 2 == 1 {
                    Verdict::Present
                } else {
                    Verdict::Absent
                };
                w.answer(key(i), g, v);
            }
        }
        stop.store(true, Ordering::Release);
        let seen: u64 = readers.into_iter().map(|r| r.join().expect("reader")).sum();
        assert!(
            (39_488..40_000).all(|i| view.peek(&key(i)).is_some()),
            "the last 512 held"
        );
        assert!((0..39_488)
            .step_by(13)
            .all(|i| view.peek(&key(i)).is_none()));
        eprintln!("readers checked {seen} verdicts");
    }
}
