//! The engine handle: opens devices, starts one pinned worker per configured core, routes jobs
//! to workers by key hash and collects their results.
//!
//! Every method takes `&self` and never blocks on I/O (except `drain` and `shutdown`, whose job
//! is to wait). Admission is bounded twice: by `jobs_in_flight_max` jobs and by
//! `queue_blocks_max` queued blocks per worker; either limit turns a submission into an explicit
//! [`Error::Backpressure`](crate::Error::Backpressure) with nothing queued.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::cold::ColdTier;
use crate::config::Config;
use crate::error::Result;
use crate::events::Event;
use crate::files::device::ScanReport;
use crate::io::Region;
use crate::job::release::ShutdownReport;
use crate::job::sink::ChannelSink;
use crate::job::{Job, JobKind, JobResult, Shared};
use crate::metrics::Stats;
use crate::slab::Geometry;
use crate::worker::{self};

pub(crate) mod lookup;
pub(crate) mod open;
pub(crate) mod start;
pub(crate) mod stats;

pub use crate::tier::{Lookup, Tier};

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
    /// Percent of the region's resident bytes mapped by huge pages once registered (sampled by
    /// `kvtier_sys::smaps::huge_mapped`; `None` if that failed or nothing was resident).
    pub region_huge_percent: Option<f64>,
    pub devices: Vec<DeviceSummary>,
    pub workers: Vec<WorkerSummary>,
    /// The S3 tier, when configured.
    #[cfg(feature = "s3")]
    pub s3: Option<crate::s3::S3Summary>,
    pub open_seconds: f64,
}

pub struct Engine {
    /// The core every front end drives: admission, lookups, removal, the stop.
    node: crate::node::Node,
    /// Read when the S3 tier opens.
    #[cfg_attr(not(feature = "s3"), allow(dead_code))]
    block_bytes: u64,
    /// What opened the devices; told when the workers have stopped (VFIO fences there).
    storage: Arc<dyn crate::io::Storage>,
    /// Every counter, for `stats` and the metrics endpoint.
    stats: Arc<stats::StatsSource>,
    /// `[metrics] listen`: stopped at shutdown.
    metrics_server: Mutex<Option<crate::metrics::serve::MetricsServer>>,
    /// The engine's caller, the node's one client: its results arrive here.
    caller: Arc<ChannelSink>,
    client: crate::node::Client,
    /// Held for the whole of `shutdown`, so a second, concurrent call returns only once the
    /// first has joined every worker (the caller may free the region when it returns).
    shutting_down: Mutex<()>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    info: EngineInfo,
}

impl Engine {
    /// Opens the engine on the kernel's devices (io_uring, O_DIRECT per config), or on NVMe
    /// controllers driven from user space when the devices are `kind = "vfio"`.
    pub fn open(config: &Config, region: Arc<Region>) -> Result<Engine> {
        let vfio = config
            .devices
            .iter()
            .any(|d| d.kind == crate::config::DeviceKind::Vfio);
        let storage: Arc<dyn crate::io::Storage> = if vfio {
            Arc::new(crate::vfio::VfioStorage::default())
        } else {
            Arc::new(crate::uring::KernelStorage::default())
        };
        Engine::open_with(config, region, storage)
    }

    /// Connects the cold tier: workers hand it their misses and (with `on_evict`) demotions.
    #[cfg_attr(not(feature = "s3"), allow(dead_code))]
    fn attach_cold(&mut self, tier: Arc<dyn ColdTier>, demote: Option<&worker::DemoteSink>) {
        self.node.attach_cold(Arc::clone(&tier));
        if let (Some(sink), Some(f)) = (demote, tier.demote_sink()) {
            let _ = sink.set(f);
        }
        let _ = self.stats.cold.set(tier);
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Queues a store job. Never blocks: a full queue is
    /// [`Error::Backpressure`](crate::Error::Backpressure). A malformed job (lengths differ,
    /// block id out of range) is accepted and reported failed.
    pub fn submit_store(&self, job: Job) -> Result<()> {
        self.node.submit(self.client, JobKind::Store, job)
    }

    /// Queues a load job; see [`Engine::submit_store`].
    pub fn submit_load(&self, job: Job) -> Result<()> {
        self.node.submit(self.client, JobKind::Load, job)
    }

    /// Moves every finished job's result into `out`; returns how many. Each job appears once.
    pub fn poll_finished(&self, out: &mut Vec<JobResult>) -> usize {
        let before = out.len();
        out.extend(self.caller.results().try_iter());
        out.len() - before
    }

    /// Blocks until a result is available or `timeout` passes.
    pub fn wait_finished(&self, out: &mut Vec<JobResult>, timeout: Duration) -> usize {
        match self.caller.results().recv_timeout(timeout) {
            Ok(r) => {
                out.push(r);
                1 + self.poll_finished(out)
            }
            Err(_) => 0,
        }
    }

    /// An eventfd (non-blocking, close-on-exec, owned by the engine and open until it is
    /// dropped) that becomes readable whenever a result is published: for callers that wait in
    /// their own `poll`/`epoll` loop instead of [`Engine::wait_finished`]. Notifications
    /// coalesce; read (or [`Engine::clear_result_fd`]) before [`Engine::poll_finished`], so a
    /// result published after the poll wakes the loop again. Created on the first call.
    pub fn result_fd(&self) -> Result<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        let event = self.caller.event().map_err(|errno| {
            crate::Error::Worker(format!("creating the result eventfd: {errno}"))
        })?;
        Ok(event.as_fd())
    }

    /// Resets [`Engine::result_fd`]'s counter; returns the notifications it held (0 without
    /// one, or if none was pending).
    pub fn clear_result_fd(&self) -> u64 {
        self.caller.clear_event()
    }

    /// Jobs submitted whose result has not been published yet.
    pub fn jobs_in_flight(&self) -> usize {
        self.node.jobs_in_flight()
    }

    /// How results report a job whose region blocks an I/O still holds after the job resolved
    /// (an I/O past its deadline): `false` (the default) reports it once the blocks are free;
    /// `true` reports it when it resolves, with [`JobResult::release`] set to a
    /// [`Release`](crate::Release) to wait on. Either way the blocks are the caller's only
    /// once [`JobResult::released`] is true. Applies to jobs resolving from now on.
    pub fn set_early_results(&self, early: bool) {
        self.node.set_early_results(early);
    }

    /// Blocks until every submitted job has resolved. Afterwards no I/O touches the region until
    /// the next submit, except the blocks of jobs whose I/O outlived its deadline: those jobs
    /// are reported (and their blocks free) once the device answers, or by `shutdown`; results
    /// wait in `poll_finished`.
    pub fn drain(&self) {
        self.wait_until(|s| s.jobs_unresolved() == 0);
    }

    /// Waits on the idle condition (notified as jobs finish; polled every 20 ms, since a
    /// release or a parked result may change it without a notification) until `done`.
    fn wait_until(&self, done: impl Fn(&Shared) -> bool) {
        let mut guard = self
            .node
            .shared()
            .idle_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while !done(self.node.shared()) {
            guard = self
                .node
                .shared()
                .idle
                .wait_timeout(guard, Duration::from_millis(20))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Blocks until every submitted job is reported and its blocks are free: [`Engine::drain`],
    /// then the I/O past its deadline too. Waits for as long as a hung device does (forever if
    /// it never answers): for a caller that must not go on while any I/O could still reach the
    /// region (vLLM's `drain_jobs`).
    pub fn drain_released(&self) {
        self.wait_until(|s| s.jobs_in_flight.load(Ordering::Acquire) == 0 && s.held.jobs() == 0);
    }

    /// Stops the engine: queued jobs fail with
    /// [`KeyFailure::Shutdown`](crate::KeyFailure::Shutdown), I/O in flight completes, table
    /// writes are flushed, workers exit. Idempotent, also from several threads at once: every
    /// call returns only after the workers have stopped touching the region. Later submits fail
    /// with [`Error::Shutdown`](crate::Error::Shutdown). Results stay available to
    /// `poll_finished`.
    ///
    /// A worker whose I/O outlives its deadline by the stop gives up waiting (its ring and the
    /// region stay allocated, since the device may still write them): every job is still
    /// reported, those whose blocks the I/O may reach with an unset
    /// [`JobResult::release`]. The report says what could not be stopped; the caller must
    /// keep the region's memory (never free or reuse it) unless it is
    /// [`clean`](ShutdownReport::clean).
    pub fn shutdown(&self) -> ShutdownReport {
        let _serial = self
            .shutting_down
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !self.node.close() {
            return self.shutdown_report();
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
        // is reported exactly once.
        self.node.fail_left_behind();
        // Devices that do DMA on their own are fenced before the caller may free the region.
        self.storage.shutdown();
        // Write-through jobs whose NVMe half just ended report from the reactor: let them.
        if let Some(cold) = self.node.cold() {
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
        // Every job is reported by now; those whose blocks a hung I/O holds say so.
        self.node.shared().report_held();
        let report = self.shutdown_report();
        if !report.clean() {
            tracing::error!(
                workers_gave_up = report.workers_gave_up,
                ops_in_flight = report.ops_in_flight,
                jobs_held = report.jobs_held,
                blocks_held = report.blocks_held,
                "shutdown: I/O past its deadline may still reach region blocks; they stay \
                 leased and the region must stay allocated"
            );
        }
        report
    }

    /// What shutdown could not stop (see [`Engine::shutdown`]).
    fn shutdown_report(&self) -> ShutdownReport {
        let s = self.node.shared();
        ShutdownReport {
            workers_gave_up: s.workers_gave_up.load(Ordering::Acquire),
            ops_in_flight: s.ops_given_up.load(Ordering::Acquire),
            jobs_held: s.held.jobs(),
            blocks_held: s.held.blocks(),
        }
    }

    /// Stored and removed events since the last call (empty unless `events.enabled`).
    pub fn take_events(&self) -> Vec<Event> {
        self.node.shared().events.take()
    }

    /// Every counter now: sums, and their breakdown by device, worker, job and lookup.
    pub fn stats(&self) -> Stats {
        self.stats.stats()
    }

    /// Every counter now in the Prometheus text format (version 0.0.4): what `GET /metrics`
    /// serves (`[metrics] listen`). Families are listed in [`crate::metrics::render`].
    pub fn metrics_text(&self) -> String {
        crate::metrics::render::render(
            self.stats.stats_with_threads(),
            crate::metrics::render::Format::Prometheus,
        )
    }

    /// [`Engine::stats`] with [`Stats::thread_cpu`] set: the CPU of io_uring's kernel threads
    /// and the S3 reactor, read from `/proc/self/task` (a system call or two per thread of the
    /// process, so not for every step of an inference loop).
    pub fn stats_with_threads(&self) -> Stats {
        self.stats.stats_with_threads()
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
        self.node.workers()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
