//! The tier's reads on the reactor: batched HEADs for lookups, GETs for loads (checked
//! against the object's crc32c), and the promotion of a loaded block into NVMe.

use super::{failure_of, Class, Failure, Inner, LOOKUP_WARNINGS};
use crate::job::{Job, JobKind, JobResult, JobState, KeyFailure};
use crate::key::Key;
use crate::verdicts::Verdict;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Inner {
    pub(super) async fn head_batch(self: Arc<Self>, batch: Vec<(Key, u64)>) {
        let mut set = tokio::task::JoinSet::new();
        for (key, generation) in batch {
            let me = Arc::clone(&self);
            set.spawn(async move {
                let verdict = match me.permits.acquire(Class::Read).await {
                    None => None,
                    Some(_permit) => match me.object_name(&key) {
                        None => Some(Verdict::Absent),
                        // vLLM: a failed lookup is a miss.
                        Some(name) => Some(match me.client.head(&name).await {
                            Ok(true) => Verdict::Present,
                            Ok(false) => Verdict::Absent,
                            Err(f) => {
                                if !matches!(f, Failure::Closed) {
                                    if let Some(suppressed) = LOOKUP_WARNINGS.admit() {
                                        tracing::warn!(
                                            suppressed,
                                            "S3 lookup failed, answering miss: {f:?}"
                                        );
                                    }
                                }
                                Verdict::Absent
                            }
                        }),
                    },
                };
                if let Some(v) = verdict {
                    me.lock_cache().answer(key, generation, v);
                }
            });
        }
        while set.join_next().await.is_some() {}
    }

    pub(super) async fn load_one(self: Arc<Self>, job: Arc<JobState>, index: usize) {
        let key = job.job.keys[index];
        let block = job.job.blocks[index] as usize;
        let shared = &self.shared;
        let Some(name) = self.object_name(&key) else {
            job.fail(
                shared,
                index,
                KeyFailure::Miss,
                "not stored locally, and the key holds no block hash for an object name".into(),
            );
            return;
        };
        let Some(lease) = job.lease() else {
            // Every admitted job leases its blocks: a load without a lease has nowhere safe to
            // land its bytes.
            job.fail(
                shared,
                index,
                KeyFailure::InvalidJob,
                "a load from the object store needs the job's lease on its blocks".into(),
            );
            return;
        };
        let outcome = match self.permits.acquire(Class::Read).await {
            None => Err(Failure::Closed),
            Some(_permit) => {
                self.client
                    .get_into(&name, lease, block * self.block_bytes, self.block_bytes)
                    .await
            }
        };
        match outcome {
            Ok(bytes) => {
                self.mark(key, Verdict::Present);
                if self.cfg.promote_on_load && !self.closing.load(Ordering::Acquire) {
                    self.promote(&job, index, key, block as u32, bytes);
                } else {
                    job.succeed(shared, index, bytes);
                }
            }
            Err(f) => {
                // vLLM's livelock fix: a failed load makes the key a miss until asked again.
                self.mark(key, Verdict::Absent);
                let (reason, detail) = failure_of(f, &self.client.bucket, &name);
                job.fail(shared, index, reason, detail);
            }
        }
    }

    /// Stores a block just loaded from S3 into NVMe; the load reports when that store is done
    /// (it reads the caller's block, which is the caller's again once the load reports).
    pub(super) fn promote(
        self: Arc<Self>,
        parent: &Arc<JobState>,
        index: usize,
        key: Key,
        block: u32,
        bytes: u64,
    ) {
        let me = Arc::clone(&self);
        let waiting = Arc::clone(parent);
        let then: crate::job::Then = Box::new(move |r: JobResult| {
            let counter = if r.success {
                &me.metrics.promotions
            } else {
                &me.metrics.promotions_failed
            };
            counter.fetch_add(1, Ordering::Relaxed);
            waiting.succeed(&me.shared, index, bytes);
        });
        // The promotion reads the block under the load's lease (released when the load
        // reports, after the promotion), in the load's region.
        let state = Arc::new(JobState::serving(
            parent,
            JobKind::Store,
            Job::new(0, vec![key], vec![block]),
            then,
        ));
        if !self.router.try_dispatch(&state) {
            // The workers' queues are full: serve the load from the object store alone rather
            // than queue past `queue_blocks_max`.
            // The internal job was never sent, so its `then` never runs.
            self.metrics
                .promotions_skipped
                .fetch_add(1, Ordering::Relaxed);
            parent.succeed(&self.shared, index, bytes);
        }
    }
}
