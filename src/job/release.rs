//! When a job's region blocks are the caller's again.
//!
//! The boundary rule: a block named by a job is the caller's again only when no I/O of kvtier
//! can reach it any more (every I/O on it completed and its completion was reaped). Until then
//! the job's [`Lease`] holds it, whatever was reported. Most jobs reach that point when their
//! last key resolves. A job one of whose I/O outlived its deadline (or a store whose write was
//! still running when its key failed) does not: the I/O holds the lease until the device
//! answers, which may be never.
//!
//! Such a job's result waits for its blocks by default: it is reported once they are free,
//! with [`JobResult::release`] `None`, so a caller who knows nothing of this rule is never
//! harmed. A caller that opts in ([`Engine::set_early_results`](crate::Engine::set_early_results),
//! e.g. vLLM 0.34 with its `deferred_release`) gets the result when the job resolves, carrying
//! a [`Release`] that is set when the blocks are free. `Engine::shutdown` reports every result
//! still waiting, each with its unset `Release`: such blocks stay leased (and counted in
//! `kvtier_blocks_held_by_hung_io`) for as long as the I/O may run.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{JobId, JobResult, Then};

/// Set once no I/O of kvtier can reach a job's region blocks any more: from then on they are
/// the caller's. Cheap to clone; every clone sees the same signal.
#[derive(Clone)]
pub struct Release(Arc<Signal>);

struct Signal {
    job: JobId,
    blocks: usize,
    set: Mutex<bool>,
    cv: Condvar,
}

impl Release {
    fn new(job: JobId, blocks: usize) -> Release {
        Release(Arc::new(Signal {
            job,
            blocks,
            set: Mutex::new(false),
            cv: Condvar::new(),
        }))
    }

    /// The job whose blocks this is about.
    pub fn job_id(&self) -> JobId {
        self.0.job
    }

    /// How many distinct region blocks the job named.
    pub fn blocks(&self) -> usize {
        self.0.blocks
    }

    /// Whether the blocks are the caller's again.
    pub fn is_released(&self) -> bool {
        *self.0.set.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until the blocks are the caller's again, or `timeout` passes (`None`: no
    /// limit); returns [`Release::is_released`].
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        let end = timeout.map(|t| Instant::now() + t);
        let mut set = self.0.set.lock().unwrap_or_else(PoisonError::into_inner);
        while !*set {
            match end {
                None => set = self.0.cv.wait(set).unwrap_or_else(PoisonError::into_inner),
                Some(end) => {
                    let now = Instant::now();
                    if now >= end {
                        break;
                    }
                    set = self
                        .0
                        .cv
                        .wait_timeout(set, end - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
        }
        *set
    }

    fn set(&self) {
        *self.0.set.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.0.cv.notify_all();
    }
}

impl std::fmt::Debug for Release {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Release")
            .field("job", &self.0.job)
            .field("blocks", &self.0.blocks)
            .field("released", &self.is_released())
            .finish()
    }
}

/// One job whose blocks an I/O still holds after it resolved.
struct Entry {
    /// The result, while it waits for the blocks (`None` once reported: early, or by a
    /// shutdown).
    waiting: Option<(JobResult, Option<Then>)>,
    release: Release,
}

/// The jobs whose blocks an I/O still holds after they resolved (see the module docs).
#[derive(Default)]
pub(crate) struct Held {
    entries: Mutex<(u64, HashMap<u64, Entry>)>,
    /// Results waiting for their blocks (not yet reported).
    waiting: AtomicUsize,
    /// Blocks of every entry (reported or not): `kvtier_blocks_held_by_hung_io`.
    blocks: AtomicU64,
    /// Jobs whose blocks came back after an I/O held them past their result's resolution.
    released_late: AtomicU64,
}

/// What to do with a job once its lease holds no I/O any more.
pub(crate) enum Park {
    /// Report the result then (`release` `None`).
    Wait(JobResult, Option<Then>),
    /// The result is reported now with the returned release; set it then.
    Early,
}

impl Held {
    /// Records a job whose blocks (`blocks` of them) are held; returns its ticket and release.
    pub fn park(&self, park: Park, job: JobId, blocks: usize) -> (u64, Release) {
        let release = Release::new(job, blocks);
        let waiting = match park {
            Park::Wait(r, then) => {
                self.waiting.fetch_add(1, Ordering::AcqRel);
                Some((r, then))
            }
            Park::Early => None,
        };
        self.blocks.fetch_add(blocks as u64, Ordering::Relaxed);
        let mut e = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let ticket = e.0;
        e.0 += 1;
        e.1.insert(
            ticket,
            Entry {
                waiting,
                release: release.clone(),
            },
        );
        (ticket, release)
    }

    /// The blocks of `ticket` are free: the result that waited for them, if it did.
    pub fn freed(&self, ticket: u64) -> Option<(JobResult, Option<Then>)> {
        let entry = self
            .entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .1
            .remove(&ticket)
            .expect("a lease's blocks are freed once");
        self.blocks
            .fetch_sub(entry.release.blocks() as u64, Ordering::Relaxed);
        self.released_late.fetch_add(1, Ordering::Relaxed);
        // Set before the waiting result is handed over: whoever reads it finds it free.
        entry.release.set();
        let waiting = entry.waiting;
        if waiting.is_some() {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
        }
        waiting
    }

    /// Takes every result still waiting, each with its (unset) release: a shutdown reports
    /// them. The entries stay, so a hold dropped later still sets the release.
    pub fn take_waiting(&self) -> Vec<(JobResult, Option<Then>)> {
        let mut e = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out = Vec::new();
        for (&ticket, entry) in &mut e.1 {
            if let Some((mut r, then)) = entry.waiting.take() {
                r.release = Some(entry.release.clone());
                out.push((ticket, r, then));
            }
        }
        self.waiting.fetch_sub(out.len(), Ordering::AcqRel);
        // In the order they were parked (tickets count up), not the map's: the simulator's
        // trace of a stop replays in another process too.
        out.sort_unstable_by_key(|(ticket, ..)| *ticket);
        out.into_iter().map(|(_, r, then)| (r, then)).collect()
    }

    /// Results not reported yet because an I/O holds their blocks.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Region blocks of resolved jobs that an I/O still holds.
    pub fn blocks(&self) -> u64 {
        self.blocks.load(Ordering::Relaxed)
    }

    /// Jobs held, reported or not.
    pub fn jobs(&self) -> usize {
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .1
            .len()
    }

    pub fn released_late(&self) -> u64 {
        self.released_late.load(Ordering::Relaxed)
    }
}

/// What `Engine::shutdown` could not stop: workers that gave up waiting for I/O past its
/// deadline (their rings and the region stay allocated), their ops still in flight, and the
/// region blocks those ops may still reach (their jobs' results were reported with an unset
/// [`Release`]). All zero after a clean stop.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    pub workers_gave_up: usize,
    pub ops_in_flight: usize,
    pub jobs_held: usize,
    pub blocks_held: u64,
}

impl ShutdownReport {
    /// True if nothing of kvtier can touch the region any more.
    pub fn clean(&self) -> bool {
        self.workers_gave_up == 0 && self.ops_in_flight == 0 && self.blocks_held == 0
    }
}
