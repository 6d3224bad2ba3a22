//! Lookups, answered without moving data and without a system call or a lock on the caller:
//! the workers' published tables, the files layout's answers for keys not indexed (which its
//! workers probe), then the cold tier.

use super::Node;
use crate::config::FirstLookup;
use crate::key::Key;
use crate::metrics;
use crate::tier::{Lookup, Tier};
use crate::verdicts::Verdict;
use crate::worker::shared::PROBES_OUTSTANDING_MAX;
use crate::worker::unindexed::Answers;
use crate::worker::Msg;
use std::sync::atomic::Ordering;

impl Node {
    /// See `Engine::lookup`.
    pub(super) fn answer(&self, keys: &[Key]) -> Vec<Lookup> {
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
        if let Some(cold) = self.cold.as_deref() {
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
        let mut asks: Vec<Vec<Key>> = vec![Vec::new(); workers];
        let mut answers: Vec<Option<Answers<'_>>> = handles.iter().map(|_| None).collect();
        for (k, l) in keys.iter().zip(out.iter_mut()) {
            if *l != Lookup::Miss {
                continue;
            }
            let s = k.worker(workers);
            let me = &handles[s].1;
            // Past the bound of outstanding questions a key is answered from what is known,
            // or as a miss, without asking (the worker's queue stays bounded).
            let may_ask = self.is_open()
                && me.probes_outstanding.load(Ordering::Acquire) + asks[s].len()
                    < PROBES_OUTSTANDING_MAX;
            let known = answers[s].get_or_insert_with(|| me.unindexed.read());
            let (answer, ask) = match known.peek(k) {
                Some((Verdict::Pending, _)) => (Lookup::Pending, false),
                Some((Verdict::Present, fresh)) => (Lookup::Hit(Tier::Nvme), !fresh),
                Some((Verdict::Absent, fresh)) => (Lookup::Miss, !fresh),
                None if may_ask && first == FirstLookup::Pending => (Lookup::Pending, true),
                None => (Lookup::Miss, true),
            };
            *l = answer;
            if ask && may_ask {
                // The worker records the question (pending, or the answer served until the
                // new one; a first miss is recorded absent, so it is asked once per TTL too)
                // and asks once however many lookups sent the key meanwhile.
                asks[s].push(*k);
            }
        }
        drop(answers);
        for ((tx, me), ask) in handles.iter().zip(asks) {
            if !ask.is_empty() {
                me.probes_outstanding.fetch_add(ask.len(), Ordering::AcqRel);
                if tx.send(Msg::Probe(ask, first)).is_ok() {
                    me.nudge();
                }
            }
        }
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
}
