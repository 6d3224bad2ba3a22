//! The engine handle: opens devices, starts one pinned worker per configured core, routes jobs
//! to workers by key hash and collects their results.
//!
//! Every method takes `&self` and never blocks on I/O (except `drain` and `shutdown`, whose job
//! is to wait). Admission is bounded twice: by `jobs_in_flight_max` jobs and by
//! `queue_blocks_max` queued blocks per worker; either limit turns a submission into an explicit
//! [`Error::Backpressure`] with nothing queued.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use kvtier_sys::blocks::Lease;

use crate::cold::ColdTier;
use crate::config::{Config, FirstLookup};
use crate::error::{Error, Result};
use crate::events::Event;
use crate::files::device::ScanReport;
use crate::io::Region;
use crate::job::{Job, JobKind, JobResult, JobState, KeyFailure, Shared};
use crate::key::Key;
use crate::metrics::Stats;
use crate::route::{items_by_worker, Router};
use crate::slab::Geometry;
use crate::verdicts::Verdict;
use crate::worker::shared::PROBES_OUTSTANDING_MAX;
use crate::worker::{self, Msg, WorkerShared};

mod open;
mod start;
pub(crate) mod stats;

pub use crate::tier::{Lookup, Tier};
pub(crate) use stats::StatsSource;

/// One device as opened.
#[derive(Clone, Debug)]
pub struct DeviceSummary {
    pub path: PathBuf,
    pub kind: &'static str,
    pub direct: bool,
    pub size_bytes: u64,
    pub geometry: Geometry,
    /// True if it was formatted at this open (nothing to recover).
    pub formatted: bool,
    /// For a `files` device: what the scan at open found.
    pub files: Option<ScanReport>,
}

/// One worker as started.
#[derive(Clone, Debug)]
pub struct WorkerSummary {
    pub core: Option<usize>,
    pub pinned: bool,
    pub backend: String,
    pub recovered_blocks: u64,
}

/// What `Engine::open` set up.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub block_bytes: u64,
    pub region_blocks: u64,
    pub region_backing: &'static str,
    pub devices: Vec<DeviceSummary>,
    pub workers: Vec<WorkerSummary>,
    /// The S3 tier, when configured.
    #[cfg(feature = "s3")]
    pub s3: Option<crate::s3::S3Summary>,
    pub open_seconds: f64,
}

struct ShardHandle {
    tx: Sender<Msg>,
    /// A second receiver, to fail work that arrives after the worker stopped.
    rx: Receiver<Msg>,
    shared: Arc<WorkerShared>,
}

pub struct Engine {
    region: Arc<Region>,
    region_blocks: u64,
    block_bytes: u64,
    /// The files layout: what the first lookup of a key not indexed answers (`None`: slab).
    first_lookup: Option<FirstLookup>,
    queue_blocks_max: usize,
    jobs_in_flight_max: usize,
    shared: Arc<Shared>,
    shards: Vec<ShardHandle>,
    router: Arc<Router>,
    /// The cold tier (`[s3]`), when configured.
    cold: Option<Arc<dyn ColdTier>>,
    /// Every counter, for `stats` and the metrics endpoint.
    stats: Arc<stats::StatsSource>,
    /// `[metrics] listen`: stopped at shutdown.
    metrics_server: Mutex<Option<crate::metrics::serve::MetricsServer>>,
    results: Receiver<JobResult>,
    shut: AtomicBool,
    /// Held shared by every submit and exclusively by shutdown while it sets `shut`.
    gate: RwLock<()>,
    /// Held for the whole of `shutdown`, so a second, concurrent call returns only once the
    /// first has joined every worker (the caller may free the region when it returns).
    shutting_down: Mutex<()>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    info: EngineInfo,
}

impl Engine {
    /// Opens the engine on the kernel's devices (io_uring, O_DIRECT per config).
    pub fn open(config: &Config, region: Arc<Region>) -> Result<Engine> {
        Engine::open_with(
            config,
            region,
            Arc::new(crate::uring::KernelStorage::default()),
        )
    }

    /// Connects the cold tier: workers hand it their misses and (with `on_evict`) demotions.
    #[cfg_attr(not(feature = "s3"), allow(dead_code))]
    fn attach_cold(&mut self, tier: Arc<dyn ColdTier>, demote: Option<&worker::DemoteSink>) {
        if let (Some(sink), Some(f)) = (demote, tier.demote_sink()) {
            let _ = sink.set(f);
        }
        let _ = self.shared.miss_fallback.set(tier.miss_fallback());
        let _ = self.stats.cold.set(Arc::clone(&tier));
        self.cold = Some(tier);
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Queues a store job. Never blocks: a full queue is [`Error::Backpressure`]. A malformed
    /// job (lengths differ, block id out of range) is accepted and reported failed.
    pub fn submit_store(&self, job: Job) -> Result<()> {
        self.submit(JobKind::Store, job)
    }

    /// Queues a load job; see [`Engine::submit_store`].
    pub fn submit_load(&self, job: Job) -> Result<()> {
        self.submit(JobKind::Load, job)
    }

    fn submit(&self, kind: JobKind, job: Job) -> Result<()> {
        let _gate = self
            .gate
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.shut.load(Ordering::Acquire) {
            return Err(Error::Shutdown);
        }
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
        if kind == JobKind::Store {
            // Until it finishes (Shared::finish), or is refused below.
            self.shared
                .store_jobs_in_flight
                .fetch_add(1, Ordering::Relaxed);
        }
        if let Some((index, detail)) = self.invalid(&job) {
            let state = JobState::new(kind, job);
            state.fail_whole(&self.shared, index, KeyFailure::InvalidJob, detail);
            return Ok(());
        }
        let Some((lease, job)) = self.lease(kind, job) else {
            return Ok(());
        };
        let workers = self.shards.len();
        let mut parts = items_by_worker(&job.keys, workers);
        // Reserve queue room on every worker first, so a job is queued whole or not at all.
        if let Err((s, before, n)) = self.router.reserve_or(&parts) {
            self.shared.jobs_in_flight.fetch_sub(1, Ordering::AcqRel);
            if kind == JobKind::Store {
                self.shared
                    .store_jobs_in_flight
                    .fetch_sub(1, Ordering::Relaxed);
            }
            self.shared
                .metrics
                .refused_queue_blocks
                .fetch_add(1, Ordering::Relaxed);
            self.notify_if_idle();
            return Err(Error::Backpressure(format!(
                "worker {s} has {before} blocks queued, this job adds {n} (queue_blocks_max = {})",
                self.queue_blocks_max
            )));
        }
        let state = Arc::new(self.job_state(kind, job, lease));
        if state.job.keys.is_empty() {
            state.publish(&self.shared);
            return Ok(());
        }
        if let (JobKind::Load, Some(cold)) = (kind, &self.cold) {
            // Keys not held locally are loaded from the bucket; their queue room is returned.
            let mut remote = Vec::new();
            for (s, items) in parts.iter_mut().enumerate() {
                let before = items.len();
                items.retain(|&i| {
                    let local = self.is_local(&state.job.keys[i as usize]);
                    if !local {
                        remote.push(i);
                    }
                    local
                });
                let moved = before - items.len();
                if moved > 0 {
                    self.shards[s]
                        .shared
                        .queued_blocks
                        .fetch_sub(moved, Ordering::AcqRel);
                }
            }
            if !remote.is_empty() {
                cold.load(&state, remote);
            }
        }
        for (s, items) in parts.into_iter().enumerate() {
            if !items.is_empty() {
                self.router.send(s, &state, items);
            }
        }
        Ok(())
    }

    /// Leases the job's blocks: shared for a store (the device reads them), exclusive for a
    /// load. `None` when the job was refused and reported failed instead.
    fn lease(&self, kind: JobKind, job: Job) -> Option<(Arc<Lease>, Job)> {
        match self.region.lease(&job.blocks, kind == JobKind::Load) {
            // The lease holds each block once: fewer than the job names means a repeat, which
            // a load cannot have (two keys would land in one block).
            Ok(lease) if kind == JobKind::Load && lease.len() < job.blocks.len() => {
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
                JobState::new(kind, job).fail_whole(
                    &self.shared,
                    i,
                    KeyFailure::InvalidJob,
                    detail,
                );
                None
            }
            Ok(lease) => Some((Arc::new(lease), job)),
            Err(busy) => {
                let index = job
                    .blocks
                    .iter()
                    .position(|&b| b == busy.block)
                    .unwrap_or(0);
                let state = JobState::new(kind, job);
                state.fail_whole(
                    &self.shared,
                    index,
                    KeyFailure::InvalidJob,
                    busy.to_string(),
                );
                None
            }
        }
    }

    /// The state of an admitted job: write-through stores report after their upload.
    fn job_state(&self, kind: JobKind, job: Job, lease: Arc<Lease>) -> JobState {
        if let (JobKind::Store, Some(cold)) = (kind, &self.cold) {
            if let Some(then) = cold.write_through(&job.keys, &job.blocks, &lease) {
                // The upload releases the lease once it has read the blocks.
                return JobState::internal(kind, job, then).borrowing_lease(Some(lease));
            }
        }
        JobState::new(kind, job).with_lease(lease)
    }

    /// Whether a load of `key` goes to its NVMe worker (else to the cold tier): stored here, or,
    /// with the files layout, not known to be absent (another process may have published it;
    /// the worker's open finds out, and a miss there still falls back to the cold tier).
    fn is_local(&self, key: &Key) -> bool {
        let me = &self.shards[key.shard(self.shards.len())].shared;
        me.published.contains(key)
            || (self.first_lookup.is_some()
                && !matches!(me.unindexed().peek(key), Some((Verdict::Absent, _))))
    }

    fn invalid(&self, job: &Job) -> Option<(usize, String)> {
        if job.keys.len() != job.blocks.len() {
            return Some((
                0,
                format!("{} keys but {} blocks", job.keys.len(), job.blocks.len()),
            ));
        }
        job.blocks
            .iter()
            .position(|&b| u64::from(b) >= self.region_blocks)
            .map(|i| {
                (
                    0,
                    format!(
                        "block id {} at position {i} is out of range: the region has {} blocks",
                        job.blocks[i], self.region_blocks
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

    /// Moves every finished job's result into `out`; returns how many. Each job appears once.
    pub fn poll_finished(&self, out: &mut Vec<JobResult>) -> usize {
        let before = out.len();
        out.extend(self.results.try_iter());
        out.len() - before
    }

    /// Blocks until a result is available or `timeout` passes.
    pub fn wait_finished(&self, out: &mut Vec<JobResult>, timeout: Duration) -> usize {
        match self.results.recv_timeout(timeout) {
            Ok(r) => {
                out.push(r);
                1 + self.poll_finished(out)
            }
            Err(_) => 0,
        }
    }

    /// Answers from the in-memory index: a key is a hit once its store completed. With an S3
    /// tier, a key absent locally is [`Lookup::Pending`] until a HEAD answers (one per key,
    /// shared by concurrent lookups), then `Hit(Tier::S3)` or `Miss`, cached (bounded by
    /// `s3.lookup_cache_max`, trusted for `s3.lookup_ttl_ms`). A failed load from S3 makes its
    /// keys `Miss`.
    pub fn lookup(&self, keys: &[Key]) -> Vec<Lookup> {
        let workers = self.shards.len();
        let held: Vec<_> = self
            .shards
            .iter()
            .map(|h| h.shared.published.snapshot())
            .collect();
        let mut out: Vec<Lookup> = keys
            .iter()
            .map(|k| {
                if held[k.shard(workers)].contains(k) {
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
        if let Some(cold) = &self.cold {
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
        self.count_lookups(&out);
        out
    }

    /// The files layout: answers for keys its workers have not indexed (`out` is `Miss` for
    /// them), which another process sharing the directory may have published. Known answers
    /// come from each worker's `unindexed` cache; a key asked for the first time is `first`
    /// (a miss, or Pending) while its worker `statx`es the block path on its ring; an answer
    /// older than `files.lookup_ttl_ms` is still served while the worker asks again. No system
    /// call here.
    fn ask_unindexed(&self, keys: &[Key], out: &mut [Lookup], first: FirstLookup) {
        let workers = self.shards.len();
        // After shutdown no worker answers.
        let open = !self.shut.load(Ordering::Acquire);
        let mut asks: Vec<Vec<(Key, u64)>> = vec![Vec::new(); workers];
        for (k, l) in keys.iter().zip(out.iter_mut()) {
            if *l != Lookup::Miss {
                continue;
            }
            let s = k.shard(workers);
            let me = &self.shards[s].shared;
            // Past the bound of outstanding questions a key is answered from what is known,
            // or as a miss, without asking (the worker's queue stays bounded).
            let may_ask = open
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
        for (s, ask) in asks.into_iter().enumerate() {
            if !ask.is_empty() {
                let h = &self.shards[s];
                h.shared
                    .probes_outstanding
                    .fetch_add(ask.len(), Ordering::AcqRel);
                if h.tx.send(Msg::Probe(ask)).is_ok() {
                    h.shared.nudge();
                }
            }
        }
    }

    fn count_lookups(&self, answers: &[Lookup]) {
        let mut n = [0u64; 4];
        for l in answers {
            n[match l {
                Lookup::Hit(Tier::Nvme) => 0,
                Lookup::Hit(Tier::S3) => 1,
                Lookup::Miss => 2,
                Lookup::Pending => 3,
            }] += 1;
        }
        let m = &self.shared.metrics;
        for (count, c) in [
            &m.lookup_hit_nvme,
            &m.lookup_hit_s3,
            &m.lookup_miss,
            &m.lookup_pending,
        ]
        .into_iter()
        .zip(n)
        {
            if c > 0 {
                count.fetch_add(c, Ordering::Relaxed);
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
        for h in &self.shards {
            let _ = h.tx.send(Msg::Keys(tx.clone()));
            h.shared.nudge();
        }
        drop(tx);
        for _ in 0..self.shards.len() {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(keys) => out.extend(keys),
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
        let parts = items_by_worker(keys, self.shards.len());
        for (h, items) in self.shards.iter().zip(parts) {
            if !items.is_empty() {
                let part = items.iter().map(|&i| keys[i as usize]).collect();
                // Cannot fail (see Router::send); a worker that stopped drops it at shutdown.
                let _ = h.tx.send(Msg::Touch(part));
                h.shared.nudge();
            }
        }
    }

    /// Jobs submitted whose result has not been published yet.
    pub fn jobs_in_flight(&self) -> usize {
        self.shared.jobs_in_flight.load(Ordering::Acquire)
    }

    /// Blocks until every submitted job has completed or failed. Afterwards no I/O touches the
    /// region until the next submit; results wait in `poll_finished`.
    pub fn drain(&self) {
        let mut guard = self
            .shared
            .idle_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while self.shared.jobs_in_flight.load(Ordering::Acquire) > 0 {
            guard = self
                .shared
                .idle
                .wait_timeout(guard, Duration::from_millis(50))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Stops the engine: queued jobs fail with [`KeyFailure::Shutdown`], I/O in flight completes,
    /// table writes are flushed, workers exit. Idempotent, also from several threads at once:
    /// every call returns only after the workers have stopped touching the region. Later
    /// submits fail with [`Error::Shutdown`]. Results stay available to `poll_finished`.
    pub fn shutdown(&self) {
        let _serial = self
            .shutting_down
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        {
            let _gate = self
                .gate
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if self.shut.swap(true, Ordering::AcqRel) {
                return;
            }
        }
        // S3 first: queued requests fail, running ones end within the timeout; promotions they
        // start still reach running workers.
        if let Some(cold) = &self.cold {
            cold.close();
        }
        for h in &self.shards {
            let _ = h.tx.send(Msg::Stop);
            h.shared.wake.notify();
        }
        let threads: Vec<JoinHandle<()>> = self
            .threads
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain(..)
            .collect();
        for t in threads {
            if t.join().is_err() {
                tracing::error!("a kvtier worker panicked");
            }
        }
        // Work that reached a channel after its worker stopped is failed here, so every job
        // is reported exactly once. The submit gate guarantees no submit is still running.
        for h in &self.shards {
            while let Ok(msg) = h.rx.try_recv() {
                if let Msg::Work(part) = msg {
                    h.shared
                        .queued_blocks
                        .fetch_sub(part.items.len(), Ordering::AcqRel);
                    part.fail_from(0, &self.shared);
                }
            }
        }
        // Write-through jobs whose NVMe half just ended report from the reactor: let them.
        if let Some(cold) = &self.cold {
            cold.stop();
        }
        let server = self
            .metrics_server
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(server) = server {
            server.stop();
        }
    }

    /// Stored and removed events since the last call (empty unless `events.enabled`).
    pub fn take_events(&self) -> Vec<Event> {
        self.shared.events.take()
    }

    /// Every counter now: sums, and their breakdown by device, worker, job and lookup.
    pub fn stats(&self) -> Stats {
        self.stats.stats()
    }

    /// Every counter now in the Prometheus text format (version 0.0.4): what `GET /metrics`
    /// serves (`[metrics] listen`). Families are listed in [`crate::metrics::render`].
    pub fn metrics_text(&self) -> String {
        crate::metrics::render::render(self.stats(), crate::metrics::render::Format::Prometheus)
    }

    /// The address the metrics endpoint listens on (the port chosen when `listen` had port 0);
    /// `None` without `[metrics] listen`, or after shutdown.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics_server
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(crate::metrics::serve::MetricsServer::addr)
    }

    pub fn workers(&self) -> usize {
        self.shards.len()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}
