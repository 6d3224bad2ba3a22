//! The cold tier: where keys the NVMe tier does not hold are looked up and loaded from, and
//! where stores go on (written through, or demoted on eviction). The engine and the workers see
//! only [`ColdTier`]; the S3 tier ([`crate::s3`]) implements it, on its own reactor.
//!
//! Every method returns at once: the work runs on the tier's threads, and its results come back
//! through the job it was given (`JobState::succeed`/`fail`), never by blocking the caller.

use std::sync::Arc;

use kvtier_sys::blocks::Lease;

use crate::job::{JobState, MissFallback, Then};
use crate::key::Key;
use crate::metrics::S3Stats;
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
