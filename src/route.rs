//! Routing: a key goes to the worker its hash names. [`Router`] sends work to the workers, for
//! the engine's admitted jobs and for internal jobs (promotions from the cold tier, the NVMe
//! half of write-through stores).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crossbeam_channel::Sender;

use crate::job::JobState;
use crate::key::Key;
use crate::worker::{send_parts, Msg, Removed, WorkerShared};

/// Sends work to the workers: the engine's admitted jobs and its own internal jobs (promotions
/// from S3, the NVMe half of write-through stores).
pub(crate) struct Router {
    pub workers: Vec<(Sender<Msg>, Arc<WorkerShared>)>,
    /// The per-worker bound on queued blocks, which internal jobs respect too.
    pub queue_blocks_max: usize,
}

impl Router {
    /// The positions of `keys` by the worker each routes to, with queue room reserved for
    /// them on every worker, all or nothing (see [`Router::reserve_or`]).
    pub fn reserve(&self, keys: &[Key]) -> Result<Vec<Vec<u32>>, (usize, usize, usize)> {
        let parts = items_by_worker(keys, self.workers.len());
        self.reserve_or(&parts).map(|()| parts)
    }

    /// Tells every worker to stop, waking it whether it sleeps or is about to (`Engine::shutdown`
    /// and the simulator's `Cluster::stop`).
    pub fn stop(&self) {
        for (tx, me) in &self.workers {
            let _ = tx.send(Msg::Stop);
            me.wake.notify();
        }
    }

    /// Sends every key of an internal job to its worker, if every worker has queue room for
    /// its part (`queue_blocks_max`, as for the caller's jobs); false, with nothing sent, if
    /// not. Internal jobs are admitted with the caller's job they serve, so they only count
    /// their queued blocks.
    #[cfg_attr(not(feature = "s3"), allow(dead_code))]
    pub fn try_dispatch(&self, job: &Arc<JobState>) -> bool {
        let Ok(parts) = self.reserve(&job.job.keys) else {
            return false;
        };
        send_parts(&self.workers, job, parts);
        true
    }

    /// Asks every worker that holds some of `keys` to remove them (`Engine::remove`); each
    /// answers on `reply` with `(index in keys, removed)`. Returns how many workers were asked.
    pub fn ask_remove(&self, keys: &[Key], reply: &Sender<Removed>) -> usize {
        let parts = items_by_worker(keys, self.workers.len());
        let mut asked = 0;
        for ((tx, me), items) in self.workers.iter().zip(parts) {
            if !items.is_empty() {
                let part = items.iter().map(|&i| (i, keys[i as usize])).collect();
                let _ = tx.send(Msg::Remove(part, reply.clone()));
                me.nudge();
                asked += 1;
            }
        }
        asked
    }

    /// Reserves queue room for `parts` on every worker, all or nothing; `Err` names the worker
    /// that was full: `(worker, queued before, adding)`.
    pub fn reserve_or(&self, parts: &[Vec<u32>]) -> Result<(), (usize, usize, usize)> {
        for (s, part) in parts.iter().enumerate() {
            let n = part.len();
            if n == 0 {
                continue;
            }
            let before = self.workers[s]
                .1
                .queued_blocks
                .fetch_add(n, Ordering::AcqRel);
            if before + n > self.queue_blocks_max {
                for (t, done) in parts.iter().enumerate().take(s + 1) {
                    if !done.is_empty() {
                        self.workers[t]
                            .1
                            .queued_blocks
                            .fetch_sub(done.len(), Ordering::AcqRel);
                    }
                }
                return Err((s, before, n));
            }
        }
        Ok(())
    }
}

/// The positions of `keys`, grouped by the worker each key routes to (in key order).
pub(crate) fn items_by_worker(keys: &[Key], workers: usize) -> Vec<Vec<u32>> {
    let mut parts: Vec<Vec<u32>> = vec![Vec::new(); workers];
    for (i, key) in keys.iter().enumerate() {
        parts[key.worker(workers)].push(i as u32);
    }
    parts
}
