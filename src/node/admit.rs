//! Admission: a job is checked, leased, counted against `jobs_in_flight_max`, and queued on
//! its workers all or nothing within `queue_blocks_max` (keys no worker holds go to the cold
//! tier), without blocking.

use super::Client;
use super::Node;
use crate::cold;
use crate::error::{Error, Result};
use crate::job::RegionId;
use crate::job::{Job, JobKind, JobState, KeyFailure};
use crate::key::Key;
use crate::verdicts::Verdict;
use crate::worker::send_parts;
use kvtier_sys::blocks::Lease;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Node {
    /// Admits `job`: a malformed one is reported failed (`Ok`), a full queue or too many jobs
    /// in flight is [`Error::Backpressure`] with nothing queued.
    pub(super) fn admit(&self, client: Client, kind: JobKind, job: Job) -> Result<()> {
        let prev = self.shared.jobs_in_flight.fetch_add(1, Ordering::AcqRel);
        if prev >= self.jobs_in_flight_max {
            self.shared.jobs_in_flight.fetch_sub(1, Ordering::AcqRel);
            self.shared
                .metrics
                .refused_jobs_in_flight
                .fetch_add(1, Ordering::Relaxed);
            return Err(Error::Backpressure(format!(
                "{prev} jobs in flight (jobs_in_flight_max = {})",
                self.jobs_in_flight_max
            )));
        }
        if matches!(kind, JobKind::Store) {
            // Until it finishes (Shared::finish), or is refused below.
            self.shared
                .store_jobs_in_flight
                .fetch_add(1, Ordering::Relaxed);
        }
        if let Some((index, detail)) = self.invalid(client.region, &job) {
            self.refuse(client, kind, job, index, detail);
            return Ok(());
        }
        let Some((lease, job)) = self.lease(client, kind, job) else {
            return Ok(());
        };
        // Reserve queue room on every worker first, so a job is queued whole or not at all.
        let mut parts = match self.router.reserve(&job.keys) {
            Ok(parts) => parts,
            Err(full) => return Err(self.refuse_full(kind, full)),
        };
        let state = Arc::new(
            cold::admitted(self.cold.as_deref(), kind, job, lease)
                .for_client(client.id, client.region),
        );
        if state.job.keys.is_empty() {
            state.report(&self.shared);
            return Ok(());
        }
        if let (JobKind::Load, Some(cold)) = (kind, self.cold.as_deref()) {
            // Keys not held locally are loaded from the bucket; their queue room is returned.
            cold::load_remote(cold, &self.router, &state, &mut parts, |k| self.is_local(k));
        }
        send_parts(&self.router.workers, &state, parts);
        Ok(())
    }

    /// Undoes the counts of a job refused because worker `s`'s queue was full (`before` blocks
    /// queued, the job adding `n`): the `Backpressure` error that says so.
    fn refuse_full(&self, kind: JobKind, (s, before, n): (usize, usize, usize)) -> Error {
        self.shared.jobs_in_flight.fetch_sub(1, Ordering::AcqRel);
        if matches!(kind, JobKind::Store) {
            self.shared
                .store_jobs_in_flight
                .fetch_sub(1, Ordering::Relaxed);
        }
        self.shared
            .metrics
            .refused_queue_blocks
            .fetch_add(1, Ordering::Relaxed);
        self.notify_if_idle();
        Error::Backpressure(format!(
            "worker {s} has {before} blocks queued, this job adds {n} (queue_blocks_max = {})",
            self.router.queue_blocks_max
        ))
    }

    /// Leases the job's blocks: shared for a store (the device reads them), exclusive for a
    /// load. `None` when the job was refused and reported failed instead.
    fn lease(&self, client: Client, kind: JobKind, job: Job) -> Option<(Arc<Lease>, Job)> {
        let region = &self.regions[usize::from(client.region)].0;
        match region.lease(&job.blocks, matches!(kind, JobKind::Load)) {
            // The lease holds each block once: fewer than the job names means a repeat, which
            // a load cannot have (two keys would land in one block).
            Ok(lease) if matches!(kind, JobKind::Load) && lease.len() < job.blocks.len() => {
                drop(lease);
                let mut seen = std::collections::HashSet::new();
                let i = job
                    .blocks
                    .iter()
                    .position(|b| !seen.insert(*b))
                    .unwrap_or(0);
                let detail = format!(
                    "block id {} appears twice (again at position {i}): a load writes each \
                     block once",
                    job.blocks[i]
                );
                self.refuse(client, kind, job, i, detail);
                None
            }
            Ok(lease) => Some((Arc::new(lease), job)),
            Err(busy) => {
                let index = job
                    .blocks
                    .iter()
                    .position(|&b| b == busy.block)
                    .unwrap_or(0);
                self.refuse(client, kind, job, index, busy.to_string());
                None
            }
        }
    }

    /// Reports `client`'s malformed job failed (`InvalidJob` from key `index`, for `detail`)
    /// to that client's sink: the one way admission refuses a job it took.
    fn refuse(&self, client: Client, kind: JobKind, job: Job, index: usize, detail: String) {
        JobState::new(kind, job)
            .for_client(client.id, client.region)
            .fail_whole(&self.shared, index, KeyFailure::InvalidJob, detail);
    }

    /// Whether a load of `key` goes to its NVMe worker (else to the cold tier): stored here, or,
    /// with the files layout, not known to be absent by a fresh answer (another process may
    /// have published it; the worker's open finds out, and a miss there still falls back to the
    /// cold tier).
    fn is_local(&self, key: &Key) -> bool {
        let me = &self.router.workers[key.worker(self.router.workers.len())].1;
        me.published.contains(key)
            || (self.first_lookup.is_some()
                && me.unindexed.peek(key) != Some((Verdict::Absent, true)))
    }

    fn invalid(&self, region: RegionId, job: &Job) -> Option<(usize, String)> {
        let blocks = self.regions[usize::from(region)].1;
        if job.keys.len() != job.blocks.len() {
            return Some((
                0,
                format!("{} keys but {} blocks", job.keys.len(), job.blocks.len()),
            ));
        }
        job.blocks
            .iter()
            .position(|&b| u64::from(b) >= blocks)
            .map(|i| {
                (
                    0,
                    format!(
                        "block id {} at position {i} is out of range: the region has {} blocks",
                        job.blocks[i], blocks
                    ),
                )
            })
    }

    fn notify_if_idle(&self) {
        if self.shared.jobs_in_flight.load(Ordering::Acquire) == 0 {
            let _g = self
                .shared
                .idle_lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.shared.idle.notify_all();
        }
    }
}
