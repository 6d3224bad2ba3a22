//! The tier's writes on the reactor: copies of blocks leaving the region, PUTs with retries,
//! write-through jobs, and what a failed request means for the key.

use super::{permits, Class, Failure, Inner, UPLOAD_WARNINGS};
use crate::config::WriteAck;
use crate::job::{JobResult, KeyFailure};
use crate::key::Key;
use crate::tier::Tier;
use crate::verdicts::Verdict;
use bytes::Bytes;
use kvtier_sys::blocks::Lease;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Inner {
    /// A copy of block `block` of the store job holding `lease` (in its client's region).
    pub(super) fn copy_block(&self, lease: &Lease, block: u32) -> Bytes {
        lease.with_bytes(
            block as usize * self.block_bytes,
            self.block_bytes,
            Bytes::copy_from_slice,
        )
    }

    /// Uploads one block copy (a background upload: takes its own upload slot).
    pub(super) async fn upload(
        self: &Arc<Self>,
        key: Key,
        body: Bytes,
    ) -> std::result::Result<u64, (KeyFailure, String)> {
        let Some(permit) = self.permits.acquire(Class::Write).await else {
            return Err((KeyFailure::Shutdown, "the engine shut down".into()));
        };
        self.upload_with(permit, key, body).await
    }

    /// The write-through half of a store job, after its NVMe half reported `nvme`.
    pub(super) async fn upload_job(
        self: Arc<Self>,
        nvme: JobResult,
        keys: Vec<Key>,
        blocks: Vec<u32>,
        submitted: Instant,
        lease: Arc<Lease>,
    ) {
        if self.cfg.write_ack == WriteAck::Nvme {
            // Copy first, report, then upload in the background. The copies are bounded by
            // upload_queue_blocks; a block that finds the queue full is not uploaded (counted),
            // so a slow or dead endpoint never holds up NVMe store jobs.
            let mut copies = Vec::with_capacity(keys.len());
            for (key, block) in keys.iter().zip(&blocks) {
                let Ok(permit) = self.upload_queue.try_acquire() else {
                    continue;
                };
                permit.forget();
                copies.push((*key, self.copy_block(&lease, *block)));
            }
            let n_copied = copies.len();
            self.shared.release_then_deliver(&lease, nvme, None);
            for (key, body) in copies {
                let me = Arc::clone(&self);
                self.spawn(async move {
                    if let Err((_, detail)) = me.upload(key, body).await {
                        me.metrics
                            .background_upload_failures
                            .fetch_add(1, Ordering::Relaxed);
                        if let Some(suppressed) = UPLOAD_WARNINGS.admit() {
                            tracing::warn!(suppressed, "background upload failed: {detail}");
                        }
                    }
                    me.upload_queue.add_permits(1);
                });
            }
            if n_copied < keys.len() {
                self.metrics
                    .uploads_dropped
                    .fetch_add((keys.len() - n_copied) as u64, Ordering::Relaxed);
            }
            return;
        }
        let mut set = tokio::task::JoinSet::new();
        for (i, (key, block)) in keys.iter().copied().zip(blocks.iter().copied()).enumerate() {
            let me = Arc::clone(&self);
            let lease = Arc::clone(&lease);
            set.spawn(async move {
                if me.lock_cache().get(&key) == Some(Verdict::Present) {
                    return (i, Ok(0));
                }
                // Copy only once a request slot is free, so copies in memory stay bounded.
                let Some(permit) = me.permits.acquire(Class::Write).await else {
                    return (i, Err((KeyFailure::Shutdown, String::new())));
                };
                let body = me.copy_block(&lease, block);
                (i, me.upload_with(permit, key, body).await)
            });
        }
        let mut uploads = Vec::with_capacity(keys.len());
        while let Some(joined) = set.join_next().await {
            if let Ok(done) = joined {
                uploads.push(done);
            }
        }
        let result = JobResult {
            elapsed: submitted.elapsed(),
            ..nvme.with_uploads(uploads)
        };
        self.shared.release_then_deliver(&lease, result, None);
    }

    /// Uploads one block copy while holding a request slot; records the verdict and the event.
    pub(super) async fn upload_with(
        self: &Arc<Self>,
        permit: permits::Permit,
        key: Key,
        body: Bytes,
    ) -> std::result::Result<u64, (KeyFailure, String)> {
        let Some(name) = self.object_name(&key) else {
            return Err((
                KeyFailure::InvalidJob,
                "the key holds no block hash, so it has no object name".into(),
            ));
        };
        let len = body.len() as u64;
        let r = self.client.put(&name, body).await;
        drop(permit);
        match r {
            Ok(()) => {
                self.mark(key, Verdict::Present);
                self.shared.events.push_tier(vec![key], false, Tier::S3);
                Ok(len)
            }
            Err(f) => Err(failure_of(f, &self.client.bucket, &name)),
        }
    }
}

pub(super) fn failure_of(f: Failure, bucket: &str, name: &str) -> (KeyFailure, String) {
    match f {
        Failure::NotFound => (
            KeyFailure::Miss,
            format!("not stored locally, and s3://{bucket}/{name} does not exist"),
        ),
        Failure::Closed => (KeyFailure::Shutdown, String::new()),
        Failure::Size { got, want } => (
            KeyFailure::ShortIo {
                done: got.min(u64::from(u32::MAX)) as u32,
                wanted: want as u32,
            },
            format!("s3://{bucket}/{name} is {got} bytes, a block is {want}"),
        ),
        Failure::Checksum { object } => (
            KeyFailure::Checksum,
            format!("s3://{bucket}/{object}: bytes do not match the crc32c stored with them"),
        ),
        Failure::Failed(text) => (KeyFailure::Remote, text),
    }
}
