//! The S3 tier: any S3-compatible object store behind the NVMe tier.
//!
//! One cold reactor (a tokio runtime on its own threads, pinned to cores no NVMe worker uses
//! when there are any) runs every request. The engine and the workers never wait for it: they
//! hand it work with `spawn`, and its results come back through the same job states the NVMe
//! workers resolve. Work is bounded by the engine's admission (`jobs_in_flight_max`), by the
//! lookup cache's size (one HEAD per key at most) and by `upload_queue_blocks` (block copies
//! waiting for upload); requests in flight are bounded by `max_concurrency`, and a freed request
//! slot goes to a waiting GET or HEAD before any waiting PUT (see `permits`).
//!
//! Object names are vLLM's object-store tier's (`FileMapper` over the prefix), without its
//! double slash: `<prefix>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<g>/<hash>.bin`, or with no
//! prefix `<model>_...` (no leading slash). The prefix is used verbatim, so a bucket shared with
//! vLLM 0.33 (whose names are `<P>//<model>...` for its prefix `P`) works with kvtier's
//! `prefix = "<P>/"`.
//!
//! Object bytes are the block bytes. kvtier adds a crc32c as user metadata and verifies it on
//! GET when present.

mod client;
mod fetch;
mod permits;
mod upload;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::Semaphore;

use kvtier_sys::blocks::Lease;

use crate::cold::{ColdTier, DemoteFn};
use crate::config::{S3Config, S3Write};
use crate::error::{Error, Result};
use crate::files::mapper::{split_key, AgnosticOptIn, FileMapper};
use crate::job::{JobResult, JobState, KeyFailure, Shared};
use crate::key::Key;
use crate::metrics::S3Metrics;
use crate::metrics::S3Stats;
use crate::route::Router;
use crate::tier::{Lookup, Tier};
use crate::verdicts::{Verdict, Verdicts};

use client::{build_client, Failure, ObjectClient};
use permits::{Class, Permits};
use upload::failure_of;

/// Warnings that repeat for every request while the object store fails: at most 5 per 10 s
/// each (the metrics count every one).
static UPLOAD_WARNINGS: crate::logs::RateLimit =
    crate::logs::RateLimit::new(5, std::time::Duration::from_secs(10));
static LOOKUP_WARNINGS: crate::logs::RateLimit =
    crate::logs::RateLimit::new(5, std::time::Duration::from_secs(10));

/// The reactor threads' nice value when they share cores with NVMe workers.
const REACTOR_NICE: i32 = 5;

/// What `Engine::open` set up for the S3 tier.
#[derive(Clone, Debug)]
pub struct S3Summary {
    pub bucket: String,
    pub endpoint: String,
    pub prefix: String,
    /// Reactor threads and the cores they were pinned to (empty: unpinned, because the NVMe
    /// workers use every core).
    pub reactor_threads: usize,
    pub reactor_cores: Vec<usize>,
    /// How long the connectivity probe took.
    pub probe_seconds: f64,
}

/// Counts spawned tasks so shutdown can wait for them.
struct Outstanding {
    count: AtomicUsize,
    lock: Mutex<()>,
    zero: Condvar,
}

struct TaskGuard(Arc<Inner>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        let o = &self.0.outstanding;
        if o.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _g = o
                .lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            o.zero.notify_all();
        }
    }
}

struct Inner {
    client: ObjectClient,
    mapper: FileMapper,
    cfg: S3Config,
    block_bytes: usize,
    shared: Arc<Shared>,
    router: Arc<Router>,
    metrics: Arc<S3Metrics>,
    cache: Mutex<Verdicts>,
    /// Every request holds one of these while it runs; reads (GET, HEAD) get freed ones first.
    permits: Arc<Permits>,
    /// Block copies waiting for (or in) a background upload.
    upload_queue: Semaphore,
    closing: Arc<AtomicBool>,
    outstanding: Outstanding,
    handle: tokio::runtime::Handle,
}

/// The S3 tier as the engine holds it.
pub(crate) struct S3Tier {
    inner: Arc<Inner>,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    summary: S3Summary,
}

impl S3Tier {
    /// Starts the reactor, builds the client and probes the bucket.
    pub fn open(
        cfg: &S3Config,
        block_bytes: u64,
        shared: Arc<Shared>,
        router: Arc<Router>,
        worker_cores: &[usize],
    ) -> Result<S3Tier> {
        let started = Instant::now();
        let free: Vec<usize> = kvtier_sys::affinity::available_cores()
            .into_iter()
            .filter(|c| !worker_cores.contains(c))
            .collect();
        // Two threads: on cores no worker uses when there are any, else unpinned (on a machine
        // whose every core has a worker, the kernel shares them).
        let threads = 2;
        let cores: Vec<usize> = free.iter().copied().take(threads).collect();
        let pin = cores.clone();
        let next = Arc::new(AtomicUsize::new(0));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(crate::cold::REACTOR_THREAD)
            .enable_all()
            .on_thread_start(move || {
                if pin.is_empty() {
                    // Sharing cores with the NVMe workers: let them go first.
                    let _ = kvtier_sys::affinity::set_current_thread_nice(REACTOR_NICE);
                } else {
                    let i = next.fetch_add(1, Ordering::Relaxed) % pin.len();
                    let _ = kvtier_sys::affinity::pin_current_thread(pin[i]);
                }
            })
            .build()
            .map_err(|e| Error::S3(format!("starting the S3 reactor: {e}")))?;
        let handle = runtime.handle().clone();
        let metrics = Arc::new(S3Metrics::default());
        let closing = Arc::new(AtomicBool::new(false));
        let endpoint = cfg
            .endpoint
            .clone()
            .unwrap_or_else(|| format!("AWS S3 ({})", cfg.region));
        let client = runtime.block_on(build_client(cfg));
        let client = ObjectClient::new(
            client,
            cfg.bucket.clone(),
            endpoint.clone(),
            Duration::from_millis(cfg.timeout_ms),
            cfg.retries,
            Arc::clone(&metrics),
            Arc::clone(&closing),
        );
        let probe_name = join_prefix(&cfg.prefix, "__kvtier_probe__/connectivity_test");
        if let Err(cause) = runtime.block_on(client.probe(&probe_name)) {
            runtime.shutdown_timeout(Duration::from_secs(1));
            return Err(Error::S3(format!(
                "the connectivity probe (HEAD s3://{}/{probe_name}) failed; bucket {:?} at {endpoint}: {cause}",
                cfg.bucket, cfg.bucket
            )));
        }
        let mapper = FileMapper::with_opt_in(
            Path::new(&cfg.prefix),
            &cfg.namespace,
            AgnosticOptIn::Requested,
        );
        let inner = Arc::new(Inner {
            client,
            mapper,
            cfg: cfg.clone(),
            block_bytes: block_bytes as usize,
            shared,
            router,
            metrics,
            cache: Mutex::new(Verdicts::new(
                cfg.lookup_cache_max,
                Duration::from_millis(cfg.lookup_ttl_ms),
            )),
            permits: Permits::new(cfg.max_concurrency),
            upload_queue: Semaphore::new(cfg.upload_queue_blocks),
            closing,
            outstanding: Outstanding {
                count: AtomicUsize::new(0),
                lock: Mutex::new(()),
                zero: Condvar::new(),
            },
            handle,
        });
        let summary = S3Summary {
            bucket: cfg.bucket.clone(),
            endpoint,
            prefix: cfg.prefix.clone(),
            reactor_threads: threads,
            reactor_cores: cores,
            probe_seconds: started.elapsed().as_secs_f64(),
        };
        Ok(S3Tier {
            inner,
            runtime: Mutex::new(Some(runtime)),
            summary,
        })
    }

    pub fn summary(&self) -> &S3Summary {
        &self.summary
    }
}

impl ColdTier for S3Tier {
    /// The object name of `key` (`None` for keys too short to hold a block hash).
    fn object_name(&self, key: &Key) -> Option<String> {
        self.inner.object_name(key)
    }

    /// Answers for keys not held locally: `Hit(S3)` or `Miss` when known, else `Pending` while
    /// one HEAD per key (all of this call's unknown keys in one batch) runs on the reactor.
    fn lookup(&self, keys: &[Key]) -> Vec<Lookup> {
        let inner = &self.inner;
        let mut batch = Vec::new();
        let answers = {
            let mut cache = inner.lock_cache();
            keys.iter()
                .map(|k| match cache.get(k) {
                    Some(Verdict::Present) => Lookup::Hit(Tier::S3),
                    Some(Verdict::Absent) => Lookup::Miss,
                    Some(Verdict::Pending) => Lookup::Pending,
                    // No block hash, no object name: nothing to ask.
                    None if split_key(k.as_bytes()).is_none() => Lookup::Miss,
                    // Now pending: a repeat of `k` in this call finds it so and asks nothing.
                    None => {
                        batch.push((*k, cache.begin(*k)));
                        Lookup::Pending
                    }
                })
                .collect::<Vec<_>>()
        };
        for a in &answers {
            let counter = match a {
                Lookup::Hit(_) => &inner.metrics.lookup_hits,
                Lookup::Miss => &inner.metrics.lookup_misses,
                Lookup::Pending => &inner.metrics.lookup_pending,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        if !batch.is_empty() {
            let me = Arc::clone(inner);
            inner.spawn(async move { me.head_batch(batch).await });
        }
        answers
    }

    /// Loads `items` of `job` (keys not held locally) from the bucket into their blocks.
    fn load(&self, job: &Arc<JobState>, items: Vec<u32>) {
        for item in items {
            let me = Arc::clone(&self.inner);
            let job = Arc::clone(job);
            self.inner
                .spawn(async move { me.load_one(job, item as usize).await });
        }
    }

    /// For workers: a load whose key the NVMe tier no longer holds is loaded from the bucket.
    /// Holds the tier weakly (the tier holds the state the workers share).
    fn miss_fallback(&self) -> crate::job::MissFallback {
        let weak = Arc::downgrade(&self.inner);
        let shared = Arc::downgrade(&self.inner.shared);
        Box::new(
            move |job: &Arc<JobState>, index: usize| match weak.upgrade() {
                Some(inner) => {
                    let me = Arc::clone(&inner);
                    let job = Arc::clone(job);
                    inner.spawn(async move { me.load_one(job, index).await });
                }
                None => {
                    if let Some(shared) = shared.upgrade() {
                        job.fail(&shared, index, KeyFailure::Shutdown, String::new());
                    }
                }
            },
        )
    }

    /// A write-through store: `then` for the NVMe half, which uploads and reports the job.
    fn write_through(
        &self,
        keys: &[Key],
        blocks: &[u32],
        lease: &Arc<Lease>,
    ) -> Option<crate::job::Then> {
        if self.inner.cfg.write != S3Write::Through {
            return None;
        }
        let (keys, blocks) = (keys.to_vec(), blocks.to_vec());
        let me = Arc::clone(&self.inner);
        let lease = Arc::clone(lease);
        let submitted = Instant::now();
        Some(Box::new(move |nvme: JobResult| {
            let inner = Arc::clone(&me);
            me.spawn(async move {
                inner.upload_job(nvme, keys, blocks, submitted, lease).await;
            });
        }))
    }

    /// Where the NVMe workers hand evicted blocks (`write = "on_evict"`). Never blocks: the
    /// block is copied out of its staging slot on the reactor, then uploaded; with the upload
    /// queue full it is dropped and counted.
    fn demote_sink(&self) -> Option<DemoteFn> {
        if self.inner.cfg.write != S3Write::OnEvict {
            return None;
        }
        let inner = Arc::clone(&self.inner);
        Some(Box::new(move |d: crate::worker::Demotion| {
            let Ok(permit) = inner.upload_queue.try_acquire() else {
                inner
                    .metrics
                    .demotions_dropped
                    .fetch_add(1, Ordering::Relaxed);
                return;
            };
            permit.forget();
            let me = Arc::clone(&inner);
            inner.spawn(async move {
                let mut buf = vec![0u8; d.len];
                d.staging.read(d.offset, &mut buf);
                let (key, crc) = (d.key, d.crc);
                drop(d); // the staging slot is the worker's again
                if crc.is_none_or(|c| crate::checksum::crc32c(&buf) == c) {
                    match me.upload(key, Bytes::from(buf)).await {
                        Ok(_) => {
                            me.metrics.demotions.fetch_add(1, Ordering::Relaxed);
                        }
                        Err((_, detail)) => {
                            me.metrics
                                .background_upload_failures
                                .fetch_add(1, Ordering::Relaxed);
                            if let Some(suppressed) = UPLOAD_WARNINGS.admit() {
                                tracing::warn!(suppressed, "demotion upload failed: {detail}");
                            }
                        }
                    }
                } else {
                    me.metrics.demotions_dropped.fetch_add(1, Ordering::Relaxed);
                    if let Some(suppressed) = UPLOAD_WARNINGS.admit() {
                        tracing::warn!(
                            key = %key.to_hex(),
                            suppressed,
                            "an evicted block does not match its crc32c: not demoted"
                        );
                    }
                }
                me.upload_queue.add_permits(1);
            });
        }))
    }

    fn stats(&self) -> S3Stats {
        self.inner.metrics.snapshot()
    }

    /// Stops new requests and retries, and waits (bounded) for the tasks under way. Their jobs
    /// still report: queued requests fail with `Shutdown`, running ones end within the timeout.
    fn close(&self) {
        self.inner.closing.store(true, Ordering::Release);
        self.inner.permits.close();
        self.inner.upload_queue.close();
        self.wait_tasks();
    }

    /// After the workers stopped: waits for the last tasks and stops the reactor.
    fn stop(&self) {
        self.wait_tasks();
        let rt = self
            .runtime
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(rt) = rt {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

impl S3Tier {
    fn wait_tasks(&self) {
        let o = &self.inner.outstanding;
        // A running attempt ends within the timeout; one backoff may follow before the retry
        // loop sees `closing`.
        let deadline = Instant::now()
            + Duration::from_millis(self.inner.cfg.timeout_ms)
            + client::backoff_max()
            + Duration::from_secs(1);
        let mut guard = o
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while o.count.load(Ordering::Acquire) > 0 {
            let now = Instant::now();
            if now >= deadline {
                tracing::error!(
                    tasks = o.count.load(Ordering::Acquire),
                    "S3 requests still running at shutdown after the timeout; leaving them"
                );
                return;
            }
            guard = o
                .zero
                .wait_timeout(guard, (deadline - now).min(Duration::from_millis(50)))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for S3Tier {
    fn drop(&mut self) {
        self.close();
        self.stop();
    }
}

fn join_prefix(prefix: &str, rest: &str) -> String {
    if prefix.is_empty() {
        rest.to_owned()
    } else {
        format!("{prefix}/{rest}")
    }
}

impl Inner {
    fn lock_cache(&self) -> std::sync::MutexGuard<'_, Verdicts> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn spawn<F>(self: &Arc<Self>, fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.outstanding.count.fetch_add(1, Ordering::AcqRel);
        let guard = TaskGuard(Arc::clone(self));
        self.handle.spawn(async move {
            let _guard = guard;
            fut.await;
        });
    }

    fn object_name(&self, key: &Key) -> Option<String> {
        let (hash, group) = split_key(key.as_bytes())?;
        let name = self.mapper.object_name(hash, group);
        // The mapper joins root and name with '/': an empty prefix would give a leading slash.
        Some(match name.strip_prefix('/') {
            Some(rest) if self.cfg.prefix.is_empty() => rest.to_owned(),
            _ => name,
        })
    }

    fn mark(&self, key: Key, verdict: Verdict) {
        self.lock_cache().set(key, verdict);
    }
}
