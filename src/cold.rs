//! The cold tier: where keys the NVMe tier does not hold are looked up and loaded from, and
//! where stores go on (written through, or demoted on eviction). The engine and the workers see
//! only [`ColdTier`]; the S3 tier ([`crate::s3`]) implements it, on its own reactor.
//!
//! Every method returns at once: the work runs on the tier's threads, and its results come back
//! through the job it was given (`JobState::succeed`/`fail`), never by blocking the caller.

use std::sync::Arc;

use kvtier_sys::blocks::Lease;

use crate::job::{Job, JobKind, JobState, MissFallback, Then};
use crate::key::Key;
use crate::metrics::S3Stats;
use crate::route::Router;

/// The name of a cold tier's reactor threads (the S3 tier's), which is how
/// `ThreadCpu::s3_reactor_seconds` is found; here, so that builds without the S3 tier know it too.
pub(crate) const REACTOR_THREAD: &str = "kvtier-s3";
use crate::tier::Lookup;
use crate::worker::Demotion;

/// Where workers hand demoted blocks (`s3.write = "on_evict"`).
pub(crate) type DemoteFn = Box<dyn Fn(Demotion) + Send + Sync>;

pub(crate) trait ColdTier: Send + Sync {
    /// Answers for keys the NVMe tier does not hold: `Hit(S3)`, `Miss`, or `Pending` while it
    /// finds out.
    fn lookup(&self, keys: &[Key]) -> Vec<Lookup>;

    /// Loads `items` of `job` into their region blocks; each key reports through `job`.
    fn load(&self, job: &Arc<JobState>, items: Vec<u32>);

    /// What a worker calls for a load whose key turned out to be gone from NVMe.
    fn miss_fallback(&self) -> MissFallback;

    /// For a store job: the continuation of its NVMe half, when this tier writes through
    /// (`None` otherwise: the job reports when NVMe is done). The continuation holds `lease`
    /// (the job's blocks) until it has read them, and releases it before it reports.
    fn write_through(&self, keys: &[Key], blocks: &[u32], lease: &Arc<Lease>) -> Option<Then>;

    /// Where workers hand evicted blocks, when this tier takes them on eviction.
    fn demote_sink(&self) -> Option<DemoteFn>;

    /// The tier's name for `key` (an object name), if it has one.
    fn object_name(&self, key: &Key) -> Option<String>;

    fn stats(&self) -> S3Stats;

    /// Stops new requests; waits (bounded) for those under way, whose jobs still report.
    fn close(&self);

    /// After the workers stopped: waits for the last tasks and stops the tier's threads.
    fn stop(&self);
}

/// The state of an admitted job: a store that `cold` writes through reports after its upload
/// (which holds `lease` until it has read the blocks); any other job holds `lease` until it
/// reports. The engine and the simulator admit jobs through this.
pub(crate) fn admitted(
    cold: Option<&dyn ColdTier>,
    kind: JobKind,
    job: Job,
    lease: Arc<Lease>,
) -> JobState {
    if let (JobKind::Store, Some(cold)) = (kind, cold) {
        if let Some(then) = cold.write_through(&job.keys, &job.blocks, &lease) {
            return JobState::internal(kind, job, then).borrowing_lease(Some(lease));
        }
    }
    JobState::new(kind, job).with_lease(lease)
}

/// Sends the keys of load `state` that `local` says the NVMe tier does not hold to `cold`,
/// taking them out of `parts` (the job's items by worker, their queue room reserved) and giving
/// their queue room back.
pub(crate) fn load_remote(
    cold: &dyn ColdTier,
    router: &Router,
    state: &Arc<JobState>,
    parts: &mut [Vec<u32>],
    local: impl Fn(&Key) -> bool,
) {
    let mut remote = Vec::new();
    for (s, items) in parts.iter_mut().enumerate() {
        let before = items.len();
        items.retain(|&i| {
            let here = local(&state.job.keys[i as usize]);
            if !here {
                remote.push(i);
            }
            here
        });
        let moved = before - items.len();
        if moved > 0 {
            router.workers[s]
                .1
                .queued_blocks
                .fetch_sub(moved, std::sync::atomic::Ordering::AcqRel);
        }
    }
    if !remote.is_empty() {
        cold.load(state, remote);
    }
}
