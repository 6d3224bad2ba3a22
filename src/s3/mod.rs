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
mod permits;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::Semaphore;

use kvtier_sys::blocks::Lease;

use crate::cold::{ColdTier, DemoteFn};
use crate::config::{S3Config, S3Write, WriteAck};
use crate::error::{Error, Result};
use crate::files::mapper::{split_key, AgnosticOptIn, FileMapper};
use crate::job::{Job, JobFailure, JobKind, JobResult, JobState, KeyFailure, Shared};
use crate::key::Key;
use crate::metrics::S3Metrics;
use crate::metrics::S3Stats;
use crate::route::Router;
use crate::tier::{Lookup, Tier};
use crate::verdicts::{Verdict, Verdicts};
use crate::Region;

use client::{Failure, ObjectClient};
use permits::{Class, Permits};

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
    region: Arc<Region>,
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
        region: Arc<Region>,
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
            .thread_name("kvtier-s3")
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
            region,
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
                if crc.is_none_or(|c| crc32c::crc32c(&buf) == c) {
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

async fn build_client(cfg: &S3Config) -> aws_sdk_s3::Client {
    use aws_sdk_s3::config::{
        retry::RetryConfig, timeout::TimeoutConfig, BehaviorVersion, Credentials,
        Region as AwsRegion, RequestChecksumCalculation, ResponseChecksumValidation,
    };
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    let timeout = Duration::from_millis(cfg.timeout_ms);
    let mut loader = aws_config::defaults(BehaviorVersion::latest())
        .region(AwsRegion::new(cfg.region.clone()))
        .http_client(http)
        // kvtier retries itself (and counts the retries); one attempt per SDK call.
        .retry_config(RetryConfig::disabled())
        // The whole attempt (body included) is bounded by kvtier's own timeout around it, so
        // the error names `timeout_ms`; the SDK only bounds the connect.
        .timeout_config(TimeoutConfig::builder().connect_timeout(timeout).build());
    if let (Some(id), Some(secret)) = (&cfg.access_key_id, &cfg.secret_access_key) {
        loader = loader.credentials_provider(Credentials::new(
            id.expose(),
            secret.expose(),
            cfg.session_token.as_ref().map(|t| t.expose().to_owned()),
            None,
            "kvtier-config",
        ));
    }
    let sdk = loader.load().await;
    let mut b = aws_sdk_s3::config::Builder::from(&sdk)
        .force_path_style(cfg.force_path_style)
        // kvtier keeps its own crc32c in the object's metadata; the SDK's default trailing
        // checksums would need aws-chunked uploads that not every S3-compatible server takes.
        .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
        .response_checksum_validation(ResponseChecksumValidation::WhenRequired);
    if let Some(endpoint) = &cfg.endpoint {
        b = b.endpoint_url(endpoint);
    }
    aws_sdk_s3::Client::from_conf(b.build())
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

    async fn head_batch(self: Arc<Self>, batch: Vec<(Key, u64)>) {
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
                    me.lock_cache().resolve(key, generation, v);
                }
            });
        }
        while set.join_next().await.is_some() {}
    }

    async fn load_one(self: Arc<Self>, job: Arc<JobState>, index: usize) {
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
        let outcome = match self.permits.acquire(Class::Read).await {
            None => Err(Failure::Closed),
            Some(_permit) => {
                let into = match job.lease() {
                    Some(lease) => client::Landing::Lease(lease),
                    None => client::Landing::Region(&self.region),
                };
                self.client
                    .get_into(&name, into, block * self.block_bytes, self.block_bytes)
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
    fn promote(
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
        // reports, after the promotion).
        let state = Arc::new(
            JobState::internal(JobKind::Store, Job::new(0, vec![key], vec![block]), then)
                .borrowing_lease(parent.lease().cloned()),
        );
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

    fn copy_block(&self, block: u32) -> Bytes {
        let mut buf = vec![0u8; self.block_bytes];
        self.region
            .read(block as usize * self.block_bytes, &mut buf);
        Bytes::from(buf)
    }

    /// Uploads one block copy (a background upload: takes its own upload slot).
    async fn upload(
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
    async fn upload_job(
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
                copies.push((*key, self.copy_block(*block)));
            }
            let n_copied = copies.len();
            lease.release();
            self.shared.finish(nvme);
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
            set.spawn(async move {
                if me.lock_cache().get(&key) == Some(Verdict::Present) {
                    return (i, Ok(0));
                }
                // Copy only once a request slot is free, so copies in memory stay bounded.
                let Some(permit) = me.permits.acquire(Class::Write).await else {
                    return (i, Err((KeyFailure::Shutdown, String::new())));
                };
                let body = me.copy_block(block);
                (i, me.upload_with(permit, key, body).await)
            });
        }
        let mut failures: Vec<JobFailure> = nvme.failures.clone();
        let mut bytes = nvme.bytes;
        while let Some(joined) = set.join_next().await {
            let Ok((i, r)) = joined else { continue };
            match r {
                Ok(n) => bytes += n,
                // One failure per key: the NVMe half's, if it failed too, comes first.
                Err((reason, detail)) if !failures.iter().any(|f| f.key_index == i) => {
                    failures.push(JobFailure {
                        key_index: i,
                        reason,
                        detail,
                    });
                }
                Err(_) => {}
            }
        }
        failures.sort_by_key(|f| f.key_index);
        let total = keys.len();
        lease.release();
        self.shared.finish(JobResult {
            success: failures.is_empty(),
            succeeded_prefix: failures.first().map_or(total, |f| f.key_index),
            failures,
            bytes,
            elapsed: submitted.elapsed(),
            ..nvme
        });
    }

    /// Uploads one block copy while holding a request slot; records the verdict and the event.
    async fn upload_with(
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

fn failure_of(f: Failure, bucket: &str, name: &str) -> (KeyFailure, String) {
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
