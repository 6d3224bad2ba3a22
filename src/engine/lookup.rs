//! What the engine answers about keys without moving data: lookups (the workers' published
//! tables, the files layout's answers for keys not indexed, the cold tier), the stored keys,
//! and touches.

use super::{Engine, Lookup, Tier};
use crate::cold::ColdTier;
use crate::config::FirstLookup;
use crate::key::Key;
use crate::metrics;
use crate::route::{items_by_worker, Router};
use crate::verdicts::Verdict;
use crate::worker::shared::PROBES_OUTSTANDING_MAX;
use crate::worker::Msg;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// What a lookup reads, written once: `Engine::lookup` and the simulator's `Cluster::lookup`
/// both answer through it.
pub(crate) struct Lookups<'a> {
    pub router: &'a Router,
    /// The files layout: what a key no worker indexed answers first.
    pub first_lookup: Option<FirstLookup>,
    pub cold: Option<&'a dyn ColdTier>,
    /// Not shut down: workers may be asked (after shutdown none answers).
    pub open: bool,
}

impl Lookups<'_> {
    /// See [`Engine::lookup`].
    pub fn answer(&self, keys: &[Key]) -> Vec<Lookup> {
        let handles = &self.router.workers;
        let workers = handles.len();
        let held: Vec<_> = handles
            .iter()
            .map(|(_, me)| me.published.snapshot())
            .collect();
        let mut out: Vec<Lookup> = keys
            .iter()
            .map(|k| {
                if held[k.worker(workers)].contains(k) {
                    Lookup::Hit(Tier::Nvme)
                } else {
                    Lookup::Miss
                }
            })
            .collect();
        drop(held);
        if let Some(first) = self.first_lookup {
            self.ask_unindexed(keys, &mut out, first);
        }
        if let Some(cold) = self.cold {
            // Keys a probe is still asking about are asked of the cold tier at the same time
            // (their answer stays Pending), so the next lookup has both answers.
            let (missing, ask): (Vec<usize>, Vec<Key>) = keys
                .iter()
                .zip(&out)
                .enumerate()
                .filter(|(_, (_, l))| matches!(l, Lookup::Miss | Lookup::Pending))
                .map(|(i, (k, _))| (i, *k))
                .unzip();
            if !ask.is_empty() {
                for (i, remote) in missing.into_iter().zip(cold.lookup(&ask)) {
                    if out[i] == Lookup::Miss {
                        out[i] = remote;
                    }
                }
            }
        }
        out
    }

    /// The files layout: answers for keys its workers have not indexed (`out` is `Miss` for
    /// them), which another process sharing the directory may have published. Known answers
    /// come from each worker's `unindexed` cache; a key asked for the first time is `first`
    /// (a miss, or Pending) while its worker `statx`es the block path on its ring; an answer
    /// older than `files.lookup_ttl_ms` is still served while the worker asks again. No system
    /// call here.
    fn ask_unindexed(&self, keys: &[Key], out: &mut [Lookup], first: FirstLookup) {
        let handles = &self.router.workers;
        let workers = handles.len();
        let mut asks: Vec<Vec<(Key, u64)>> = vec![Vec::new(); workers];
        for (k, l) in keys.iter().zip(out.iter_mut()) {
            if *l != Lookup::Miss {
                continue;
            }
            let s = k.worker(workers);
            let me = &handles[s].1;
            // Past the bound of outstanding questions a key is answered from what is known,
            // or as a miss, without asking (the worker's queue stays bounded).
            let may_ask = self.open
                && me.probes_outstanding.load(Ordering::Acquire) + asks[s].len()
                    < PROBES_OUTSTANDING_MAX;
            let mut answers = me.unindexed();
            let (answer, ask) = match answers.peek(k) {
                Some((Verdict::Pending, _)) => (Lookup::Pending, false),
                Some((Verdict::Present, fresh)) => (Lookup::Hit(Tier::Nvme), !fresh),
                Some((Verdict::Absent, fresh)) => (Lookup::Miss, !fresh),
                None if may_ask && first == FirstLookup::Pending => (Lookup::Pending, true),
                None => (Lookup::Miss, true),
            };
            *l = answer;
            if ask && may_ask {
                // Pending, or an absent answer served until the probe's (a first miss is
                // recorded absent, so it is asked once per TTL too).
                let generation = if answer == Lookup::Pending {
                    answers.begin(*k)
                } else {
                    answers.renew(*k)
                };
                asks[s].push((*k, generation));
            }
        }
        for ((tx, me), ask) in handles.iter().zip(asks) {
            if !ask.is_empty() {
                me.probes_outstanding.fetch_add(ask.len(), Ordering::AcqRel);
                if tx.send(Msg::Probe(ask)).is_ok() {
                    me.nudge();
                }
            }
        }
    }
}

impl Engine {
    /// Answers from the in-memory index: a key is a hit once its store completed. With the
    /// files layout, a key not indexed is answered from what its worker learnt by `statx`
    /// (`files.first_lookup` says what the first lookup answers). With an S3 tier, a key absent
    /// locally is [`Lookup::Pending`] until a HEAD answers (one per key, shared by concurrent
    /// lookups), then `Hit(Tier::S3)` or `Miss`, cached (bounded by `s3.lookup_cache_max`,
    /// trusted for `s3.lookup_ttl_ms`). A failed load from S3 makes its keys `Miss`. Never a
    /// system call or a wait on the caller's thread.
    pub fn lookup(&self, keys: &[Key]) -> Vec<Lookup> {
        let out = Lookups {
            router: &self.router,
            first_lookup: self.first_lookup,
            cold: self.cold.as_deref(),
            open: !self.shut.load(Ordering::Acquire),
        }
        .answer(keys);
        self.count_lookups(&out);
        out
    }

    pub(super) fn count_lookups(&self, answers: &[Lookup]) {
        let mut n = [0u64; 4];
        for l in answers {
            n[match l {
                Lookup::Hit(Tier::Nvme) => metrics::LOOKUP_HIT_NVME,
                Lookup::Hit(Tier::S3) => metrics::LOOKUP_HIT_S3,
                Lookup::Miss => metrics::LOOKUP_MISS,
                Lookup::Pending => metrics::LOOKUP_PENDING,
            }] += 1;
        }
        for (i, c) in n.into_iter().enumerate() {
            if c > 0 {
                self.shared.metrics.lookups.add(i, c);
            }
        }
    }

    /// The object name `key` has in the S3 tier (`None` without one, or for a key too short to
    /// hold a block hash).
    pub fn s3_object_name(&self, key: &Key) -> Option<String> {
        self.cold.as_ref().and_then(|t| t.object_name(key))
    }

    /// Every key currently stored (completed stores, not yet evicted), in no particular order.
    ///
    /// Asks every worker (each answers between two turns of its loop); empty after shutdown.
    pub fn keys(&self) -> Vec<Key> {
        let mut out = Vec::new();
        if self.shut.load(Ordering::Acquire) {
            return out;
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        for h in &self.workers {
            let _ = h.tx.send(Msg::Keys(tx.clone()));
            h.shared.nudge();
        }
        drop(tx);
        for _ in 0..self.workers.len() {
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
        if keys.is_empty() || self.shut.load(Ordering::Acquire) {
            return out;
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let asked = self.router.ask_remove(keys, &tx);
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
        if keys.is_empty() || self.shut.load(Ordering::Acquire) {
            return;
        }
        let parts = items_by_worker(keys, self.workers.len());
        for (h, items) in self.workers.iter().zip(parts) {
            if !items.is_empty() {
                let part = items.iter().map(|&i| keys[i as usize]).collect();
                // Cannot fail (see Router::send); a worker that stopped drops it at shutdown.
                let _ = h.tx.send(Msg::Touch(part));
                h.shared.nudge();
            }
        }
    }
}
