//! A deterministic simulation of the slab engine: every worker stepped from the calling thread,
//! on [`SimStorage`] devices, with a seeded schedule (which worker moves next) and seeded faults,
//! so one seed replays a run exactly: the order of every I/O, completion, fault and result.
//!
//! [`Cluster`] admits jobs the way `Engine` does (validation, routing, all-or-nothing queue
//! room), but owns its workers instead of running them on threads: [`Cluster::step`] runs one
//! turn of one worker. [`Cluster::power_loss`] drops the workers with their I/O in flight and
//! lets the storage lose what was not durable; [`Cluster::open`] on the same storage recovers.
//! [`campaign`] is the seeded check that runs on it.

use std::sync::Arc;

use crossbeam_channel::Receiver;

use crate::config::{Config, Cores};
use crate::error::{Error, Result};
use crate::events::EventSink;
use crate::io::{BackendSettings, EventFd, Region, Storage};
use crate::job::{Job, JobKind, JobResult, JobState, KeyFailure, Shared};
use crate::route::{items_by_worker, Router};
use crate::slab::layout::{DeviceSpec, SlabLayout};
use crate::slab::prepare::prepare_slab;
use crate::worker::{Scheduler, Worker, WorkerParams, WorkerShared};

use super::{Rng, SimStorage};

pub mod campaign;

/// Slab workers on simulated devices, stepped by the caller.
pub struct Cluster {
    workers: Vec<Worker<SlabLayout>>,
    router: Router,
    shared: Arc<Shared>,
    results: Receiver<JobResult>,
    region_blocks: u64,
    rng: Rng,
}

impl Cluster {
    /// Opens (formats or recovers) `config`'s devices on `storage` with `region`; `seed` draws
    /// the schedule. `config.cores` must be a list: its length is the number of workers.
    pub fn open(
        config: &Config,
        region: &Arc<Region>,
        storage: &Arc<SimStorage>,
        seed: u64,
    ) -> Result<Cluster> {
        let derived = config.validate()?;
        let block_bytes = derived.block_bytes;
        let Cores::List(cores) = &config.cores else {
            return Err(Error::Worker("the simulation needs cores = [..]".into()));
        };
        let workers = cores.len();
        let mut devices = Vec::new();
        for (i, dcfg) in config.devices.iter().enumerate() {
            let info = storage.open_device(i, dcfg, config.direct_io)?;
            let (geometry, fresh) =
                prepare_slab(storage.as_ref(), i, &info, block_bytes, dcfg.overwrite)?;
            devices.push(DeviceSpec {
                geometry,
                fresh,
                name: format!("devices[{i}] {}", info.path.display()),
                verify_always: config.verify_loads == crate::config::VerifyLoads::Always,
            });
        }
        let (shared, results) = Shared::new(EventSink::new(false, 1, None));
        let settings = BackendSettings {
            ring_entries: config.ring_entries,
            sqpoll: false,
            sqpoll_idle_ms: 0,
            iopoll: false,
            ioprio: config.scheduler.ioprio,
            piece_bytes: derived.piece_bytes,
            files_layout: false,
            wait_limit: std::time::Duration::from_secs(1),
        };
        let mut senders = Vec::new();
        let mut list = Vec::new();
        for id in 0..workers {
            let wake = Arc::new(
                EventFd::new().map_err(|e| Error::Worker(format!("eventfd: {}", e.desc())))?,
            );
            let me = Arc::new(WorkerShared::new(Arc::clone(&wake), devices.len()));
            let (tx, rx) = crossbeam_channel::unbounded();
            senders.push((tx, Arc::clone(&me)));
            let meta_len = crate::slab::table::meta_bytes(&devices, id, workers);
            let meta = Arc::new(
                Region::allocate(meta_len, kvtier_sys::mem::HugePages::Off)
                    .map_err(|e| Error::Memory(e.to_string()))?,
            );
            let backend = storage.backend(
                id,
                vec![Arc::clone(region), Arc::clone(&meta)],
                wake,
                &settings,
            )?;
            let params = WorkerParams {
                id,
                backend,
                region: Arc::clone(region),
                rx,
                shared: Arc::clone(&shared),
                me,
                sched: Scheduler::new(&config.scheduler, block_bytes, derived.store_chunk_bytes),
                ring_entries: config.ring_entries as usize,
                demote: None,
                // Deadlines run on the wall clock: far out of reach, so a seed replays.
                io_timeout: std::time::Duration::from_secs(3600),
            };
            let (worker, _) = SlabLayout::recovered_worker(params, workers, meta, &devices)
                .map_err(|e| Error::Worker(format!("worker {id}: {e}")))?;
            list.push(worker);
        }
        Ok(Cluster {
            workers: list,
            router: Router {
                shards: senders,
                queue_blocks_max: config.queue_blocks_max,
            },
            shared,
            results,
            region_blocks: region.len() as u64 / block_bytes,
            rng: Rng::new(seed),
        })
    }

    /// Admits a job as `Engine::submit_*` does: a malformed job is reported failed, a full queue
    /// is `Error::Backpressure` with nothing queued.
    pub fn submit(&mut self, kind: JobKind, job: Job) -> Result<()> {
        self.shared
            .jobs_in_flight
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        if job.keys.len() != job.blocks.len()
            || job
                .blocks
                .iter()
                .any(|&b| u64::from(b) >= self.region_blocks)
        {
            JobState::new(kind, job).fail_whole(
                &self.shared,
                0,
                KeyFailure::InvalidJob,
                "malformed".into(),
            );
            return Ok(());
        }
        let parts = items_by_worker(&job.keys, self.workers.len());
        if let Err((s, before, n)) = self.router.reserve_or(&parts) {
            self.shared
                .jobs_in_flight
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            return Err(Error::Backpressure(format!(
                "worker {s} has {before} blocks queued, this job adds {n}"
            )));
        }
        let state = Arc::new(JobState::new(kind, job));
        if state.job.keys.is_empty() {
            state.publish(&self.shared);
            return Ok(());
        }
        for (s, items) in parts.into_iter().enumerate() {
            if !items.is_empty() {
                self.router.send(s, &state, items);
            }
        }
        Ok(())
    }

    /// Runs one turn of one worker, drawn from the seed; true if it did anything.
    pub fn step(&mut self) -> bool {
        let w = self.rng.below(self.workers.len() as u64) as usize;
        self.workers[w].step()
    }

    /// Steps every worker in turn until nothing moves and no job is in flight, at most
    /// `max_steps` turns; false if work was left.
    pub fn settle(&mut self, max_steps: usize) -> bool {
        for _ in 0..max_steps {
            let mut any = false;
            for w in &mut self.workers {
                any |= w.step();
            }
            if !any && self.jobs_in_flight() == 0 {
                return true;
            }
        }
        false
    }

    pub fn jobs_in_flight(&self) -> usize {
        self.shared
            .jobs_in_flight
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Moves every finished job's result into `out`.
    pub fn poll(&self, out: &mut Vec<JobResult>) {
        out.extend(self.results.try_iter());
    }

    /// Checks, once settled, that nothing leaked: no op, pin, queue room, in-flight count or
    /// half-written slot left, and every published key indexed.
    pub fn check_quiet(&self) -> std::result::Result<(), String> {
        for (i, w) in self.workers.iter().enumerate() {
            w.check_quiet().map_err(|e| format!("worker {i}: {e}"))?;
        }
        Ok(())
    }

    /// Power goes out: the workers vanish with their I/O in flight (it never completes), and
    /// the storage loses what was not durable ([`SimStorage::power_loss`]).
    pub fn power_loss(self, storage: &SimStorage, seed: u64) -> super::PowerLoss {
        drop(self);
        storage.power_loss(seed)
    }
}
