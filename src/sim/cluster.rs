//! A deterministic simulation of the engine: every worker stepped from the calling thread, on
//! [`SimStorage`] devices (slab) or on scratch directories through [`SimFiles`] (files layout),
//! with a seeded schedule (which worker moves next) and seeded faults,
//! so one seed replays a run exactly: the order of every I/O, completion, fault and result.
//!
//! [`Cluster`] admits jobs the way `Engine` does (validation, routing, all-or-nothing queue
//! room), but owns its workers instead of running them on threads: [`Cluster::step`] runs one
//! turn of one worker. [`Cluster::power_loss`] drops the workers with their I/O in flight and
//! lets the storage lose what was not durable; [`Cluster::open`] on the same storage recovers.
//! With a [`SimObjectStore`] the cluster has a cold tier too, stepped among the workers: loads
//! of keys no worker holds go to it, write-through stores upload after their NVMe half, evicted
//! blocks are demoted through the workers' staging slots, and a load a worker finds gone falls
//! back to it, all as the engine wires the S3 tier.
//! [`campaign`] is the seeded check that runs on it.

use std::sync::Arc;

use crate::clock::Clock;
use crate::cold::ColdTier;
use crate::config::{Config, Cores, Validated};
use crate::error::{Error, Result};
use crate::events::EventSink;
use crate::files::device::{FilesDevice, ScannedFile};
use crate::io::{Region, Storage};
use crate::job::sink::ChannelSink;
use crate::job::{Job, JobKind, JobResult, Shared};
use crate::node::build::{scanned_by_worker, Built, Layouts, WorkerPlan, WorkerSettings};
use crate::node::Node;
use crate::route::Router;
use crate::slab::layout::SlabDevice;
use crate::slab::prepare::prepare_slab;
use crate::tier::Lookup;
use crate::worker::{DemoteSink, Stopped};

use super::files::SimFiles;
use super::object_store::SimObjectStore;
use super::{Rng, SimStorage};

pub mod campaign;

/// A worker the cluster steps, whatever its layout.
trait Stepped {
    fn step(&mut self) -> bool;
    fn check_quiet(&self) -> std::result::Result<(), String>;
    fn stopped(&self) -> Option<Stopped>;
}

impl Stepped for Built {
    fn step(&mut self) -> bool {
        match self {
            Built::Slab(w) => w.step(),
            Built::Files(w) => w.step(),
        }
    }

    fn stopped(&self) -> Option<Stopped> {
        match self {
            Built::Slab(w) => w.stopped(),
            Built::Files(w) => w.stopped(),
        }
    }

    fn check_quiet(&self) -> std::result::Result<(), String> {
        match self {
            Built::Slab(w) => w.check_quiet(),
            Built::Files(w) => w.check_quiet(),
        }
    }
}

/// Workers on simulated devices (slab) or scratch directories (files), stepped by the caller.
pub struct Cluster {
    workers: Vec<Box<dyn Stepped>>,
    /// The engine's core, as `Engine` drives it: admission, lookups, removal, the stop.
    node: Node,
    /// The cluster's caller, the node's one client.
    caller: Arc<ChannelSink>,
    client: crate::node::Client,
    cold: Option<Arc<SimObjectStore>>,
    rng: Rng,
    /// The workers' clock: it moves [`STEP_TIME`] a turn, never with the wall clock, so a seed
    /// replays however loaded the machine is.
    clock: Clock,
    /// From [`Cluster::stop`] to [`Cluster::thaw`], a worker whose stop gave up on I/O past
    /// its deadline is not stepped: a real one never runs again.
    freezing: bool,
}

/// How far a [`Cluster::stop`] has got: workers whose `run` loop would have ended, by how.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StopProgress {
    /// Done with everything they held: their threads exit.
    pub exited: usize,
    /// I/O still in flight past its deadline: a real worker leaks itself and the region.
    pub gave_up: usize,
    /// Still running.
    pub running: usize,
}

/// How far the cluster's clock moves for each worker turn (or each round of [`Cluster::settle`]).
pub const STEP_TIME: std::time::Duration = std::time::Duration::from_micros(50);

/// Opens (formats or recovers) every device of `config` on `storage`.
fn open_devices(
    config: &Config,
    storage: &Arc<SimStorage>,
    block_bytes: u64,
) -> Result<Vec<SlabDevice>> {
    let mut devices = Vec::new();
    for (i, dcfg) in config.devices.iter().enumerate() {
        let info = storage.open_device(i, dcfg, config.direct_io)?;
        let (geometry, fresh) =
            prepare_slab(storage.as_ref(), i, &info, block_bytes, dcfg.overwrite)?;
        devices.push(SlabDevice {
            geometry,
            fresh,
            name: format!("devices[{i}] {}", info.path.display()),
            verify_always: config.verify_loads == crate::config::VerifyLoads::Always,
        });
    }
    Ok(devices)
}

/// Where the workers hand their demotions: the object store's sink, if it takes them.
fn demote_sink(cold: Option<&SimObjectStore>) -> Option<DemoteSink> {
    cold.and_then(SimObjectStore::demote_sink).map(|f| {
        let sink = DemoteSink::default();
        let _ = sink.set(f);
        sink
    })
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
        Cluster::open_with(config, region, storage, seed, None)
    }

    /// [`Cluster::open`] over several regions (a node serving clients in their own memory, as
    /// a daemon would): every worker registers each; region `i` is `RegionId` `i`, and clients
    /// of it are added with `node.register_client`.
    pub fn open_regions(
        config: &Config,
        regions: &[Arc<Region>],
        storage: &Arc<SimStorage>,
        seed: u64,
    ) -> Result<Cluster> {
        Cluster::open_slab(config, regions, storage, seed, None)
    }

    /// [`Cluster::open_regions`] with `cold` as the cold tier, which serves every region.
    pub fn open_regions_with(
        config: &Config,
        regions: &[Arc<Region>],
        storage: &Arc<SimStorage>,
        seed: u64,
        cold: Arc<SimObjectStore>,
    ) -> Result<Cluster> {
        Cluster::open_slab(config, regions, storage, seed, Some(cold))
    }

    /// [`Cluster::open`] with `cold` as the cold tier (connected to this cluster: a store
    /// reopened after a power loss is connected again).
    pub fn open_with(
        config: &Config,
        region: &Arc<Region>,
        storage: &Arc<SimStorage>,
        seed: u64,
        cold: Option<Arc<SimObjectStore>>,
    ) -> Result<Cluster> {
        Cluster::open_slab(config, std::slice::from_ref(region), storage, seed, cold)
    }

    /// Slab workers over `regions` on `storage`, with `cold` as the cold tier.
    fn open_slab(
        config: &Config,
        regions: &[Arc<Region>],
        storage: &Arc<SimStorage>,
        seed: u64,
        cold: Option<Arc<SimObjectStore>>,
    ) -> Result<Cluster> {
        let config = config.validate()?;
        let devices = open_devices(&config, storage, config.derived().block_bytes)?;
        Cluster::build(
            &config,
            regions,
            Arc::clone(storage) as Arc<dyn Storage>,
            (Layouts::Slab(Arc::new(devices)), Vec::new()),
            seed,
            cold,
        )
    }

    /// Files-layout workers on `config`'s directories (scanned as the engine scans them at
    /// open), their file operations run by `files`; `cold` as in [`Cluster::open_with`].
    pub fn open_files(
        config: &Config,
        region: &Arc<Region>,
        files: &Arc<SimFiles>,
        seed: u64,
        cold: Option<Arc<SimObjectStore>>,
    ) -> Result<Cluster> {
        Cluster::open_files_over(config, std::slice::from_ref(region), files, seed, cold)
    }

    /// [`Cluster::open_files`] over one or more regions, no cold tier (as
    /// [`Cluster::open_regions`] for the slab).
    pub fn open_files_regions(
        config: &Config,
        regions: &[Arc<Region>],
        files: &Arc<SimFiles>,
        seed: u64,
    ) -> Result<Cluster> {
        Cluster::open_files_over(config, regions, files, seed, None)
    }

    fn open_files_over(
        config: &Config,
        regions: &[Arc<Region>],
        files: &Arc<SimFiles>,
        seed: u64,
        cold: Option<Arc<SimObjectStore>>,
    ) -> Result<Cluster> {
        // Below the minimum capacity the engine accepts, so that eviction is frequent: checked
        // at the minimum, opened at the size asked for.
        let mut checked = config.clone();
        for d in &mut checked.devices {
            d.capacity_bytes = d
                .capacity_bytes
                .map(|c| c.max(crate::config::DEVICE_CAPACITY_MIN));
        }
        let checked = checked.validate()?;
        let block_bytes = checked.derived().block_bytes;
        let files_cfg = config
            .files
            .as_ref()
            .ok_or_else(|| Error::Worker("the files layout needs a [files] section".into()))?;
        let workers = match &config.cores {
            Cores::List(cores) => cores.len(),
            Cores::Auto => 1,
        };
        let mut devices = Vec::new();
        let mut scanned = Vec::new();
        for (i, dcfg) in config.devices.iter().enumerate() {
            let (dev, found, _) =
                FilesDevice::open(i, dcfg, files_cfg, block_bytes, config.direct_io)?;
            scanned.extend(found);
            devices.push(Arc::new(dev));
        }
        let layouts = Layouts::Files {
            devices,
            temp_seed: files.temp_seed(),
        };
        Cluster::build(
            &checked,
            regions,
            Arc::clone(files) as Arc<dyn Storage>,
            (layouts, scanned_by_worker(scanned, workers)),
            seed,
            cold,
        )
    }

    /// The cluster over `layouts` (with what the files layout's scan found, per worker).
    fn build(
        config: &Validated,
        regions: &[Arc<Region>],
        storage: Arc<dyn Storage>,
        (layouts, mut scanned): (Layouts, Vec<Vec<ScannedFile>>),
        seed: u64,
        cold: Option<Arc<SimObjectStore>>,
    ) -> Result<Cluster> {
        let block_bytes = config.derived().block_bytes;
        // The region's blocks as the engine sets them up: jobs lease them, the simulated
        // devices check the leases.
        let mut region_blocks = Vec::with_capacity(regions.len());
        for r in regions {
            region_blocks.push((
                Arc::clone(r),
                crate::engine::open::check_region(r, block_bytes)?,
            ));
        }
        let Cores::List(cores) = &config.cores else {
            return Err(Error::Worker("the simulation needs cores = [..]".into()));
        };
        let workers = cores.len();
        scanned.resize_with(workers, Vec::new);
        let shared = Shared::new(EventSink::new(false, 1, None));
        // Half the clusters play a caller that takes early results (vLLM 0.34's
        // deferred_release), half one that gets each result once its blocks are free.
        shared.early_results.store(
            crate::sim::Rng::new(seed ^ 0xEA51).below(2) == 1,
            std::sync::atomic::Ordering::Relaxed,
        );
        // Deadlines and the files layout's answer ages run on the cluster's clock, so a seed
        // replays (on the wall clock a files seed did not, under load).
        let clock = Clock::manual();
        let mut settings = WorkerSettings::new(config);
        // The engine's, without what needs a real ring (polling).
        settings.backend.sqpoll = false;
        settings.backend.sqpoll_idle_ms = 0;
        settings.backend.iopoll = false;
        let first_lookup = settings.first_lookup;
        let plan = WorkerPlan {
            workers,
            storage,
            regions: regions.to_vec(),
            shared: Arc::clone(&shared),
            layouts,
            settings,
            demote: demote_sink(cold.as_deref()),
            clock: clock.clone(),
        };
        let mut senders = Vec::new();
        let mut left_behind = Vec::new();
        let mut list: Vec<Box<dyn Stepped>> = Vec::new();
        for (id, scanned) in scanned.into_iter().enumerate() {
            let seat = plan.seat()?;
            let (worker, _) = plan
                .build(id, &seat.me, seat.rx.clone(), scanned)
                .map_err(|e| Error::Worker(format!("worker {id}: {e}")))?;
            list.push(Box::new(worker));
            senders.push((seat.tx, seat.me));
            left_behind.push(seat.rx);
        }
        let router = Arc::new(Router {
            workers: senders,
            queue_blocks_max: config.queue_blocks_max,
        });
        if let Some(c) = &cold {
            c.connect(Arc::clone(&shared), Arc::clone(&router));
        }
        let mut node = Node::new(
            shared,
            router,
            left_behind,
            region_blocks,
            config.jobs_in_flight_max,
            first_lookup,
        );
        if let Some(c) = &cold {
            node.attach_cold(Arc::clone(c) as Arc<dyn ColdTier>);
        }
        let caller = Arc::new(ChannelSink::default());
        let client = node.register_client(&(Arc::clone(&caller) as _), 0)?;
        Ok(Cluster {
            workers: list,
            node,
            caller,
            client,
            cold,
            rng: Rng::new(seed),
            clock,
            freezing: false,
        })
    }

    /// Admits a job through the engine's own admission (`node::Node::submit`): a malformed
    /// job is reported failed, a full queue or too many jobs in flight is
    /// `Error::Backpressure` with nothing queued, a stopped cluster `Error::Shutdown`.
    pub fn submit(&mut self, kind: JobKind, job: Job) -> Result<()> {
        self.node.submit(self.client, kind, job)
    }

    /// Answers a lookup through `Engine::lookup`'s own code (`node::Node::lookup`): the
    /// workers' published keys, the files layout's answers for keys not indexed (which its
    /// workers probe), then the cold tier for the rest (which may queue HEADs).
    pub fn lookup(&self, keys: &[crate::key::Key]) -> Vec<Lookup> {
        self.node.lookup(keys)
    }

    /// Marks `keys` used, as `Engine::touch` does (the workers take it on their next turns).
    pub fn touch(&self, keys: &[crate::key::Key]) {
        self.node.touch(keys);
    }

    /// Asks the workers to remove `keys`, as `Engine::remove` does; their answers
    /// (`(index in keys, removed)`) arrive on the receiver as the workers take their turns.
    pub fn remove(
        &self,
        keys: &[crate::key::Key],
    ) -> crossbeam_channel::Receiver<crate::worker::Removed> {
        let (tx, rx) = crossbeam_channel::unbounded();
        self.node.ask_remove(keys, &tx);
        rx
    }

    /// Runs one turn of one worker, or one step of the cold tier, drawn from the seed; true if
    /// it did anything.
    pub fn step(&mut self) -> bool {
        self.clock.advance(STEP_TIME);
        let n = self.workers.len() + usize::from(self.cold.is_some());
        let w = self.rng.below(n as u64) as usize;
        if w < self.workers.len() && self.freezes(w) {
            return false;
        }
        let moved = match self.workers.get_mut(w) {
            Some(worker) => worker.step(),
            None => self.cold.as_ref().is_some_and(|c| c.step()),
        };
        super::trace(&[5, w as u64, u64::from(moved)]);
        moved
    }

    /// Whether worker `w` is frozen: after a stop, a worker whose `run` loop gave up is not
    /// stepped (until [`Cluster::thaw`]). It stays given up while frozen: nothing it reads
    /// changes while it is not stepped.
    fn freezes(&self, w: usize) -> bool {
        self.freezing && self.workers[w].stopped() == Some(Stopped::GaveUp)
    }

    /// Lets the workers that gave up at the stop run again, so that their late completions
    /// arrive and the cluster can settle (a real one never runs again: this is for checking
    /// that nothing else was left behind).
    pub fn thaw(&mut self) {
        self.freezing = false;
    }

    /// Steps every worker in turn until nothing moves and no job is in flight, at most
    /// `max_steps` turns; false if work was left.
    pub fn settle(&mut self, max_steps: usize) -> bool {
        for _ in 0..max_steps {
            self.clock.advance(STEP_TIME);
            let mut any = false;
            for w in 0..self.workers.len() {
                if !self.freezes(w) {
                    let moved = self.workers[w].step();
                    super::trace(&[6, w as u64, u64::from(moved)]);
                    any |= moved;
                }
            }
            if let Some(cold) = &self.cold {
                any |= cold.step() || cold.queued() > 0;
            }
            if !any && self.jobs_in_flight() == 0 {
                return true;
            }
        }
        false
    }

    /// Starts a stop as `Engine::shutdown` does: the cold tier fails what it has queued, every
    /// worker is told to stop (queued jobs fail with `Shutdown`, I/O in flight runs on), and
    /// later submits fail with `Error::Shutdown`. Stepping goes on; [`Cluster::stop_progress`]
    /// says where each worker's thread would be.
    ///
    /// Unlike the S3 tier, the simulated object store still serves requests that arrive after
    /// its close (write-through uploads of stores that complete during the stop).
    pub fn stop(&mut self) {
        self.freezing = true;
        self.node.close();
    }

    /// Where the workers' `run` loops would be since [`Cluster::stop`].
    pub fn stop_progress(&self) -> StopProgress {
        let mut p = StopProgress::default();
        for w in &self.workers {
            match w.stopped() {
                Some(Stopped::Exited) => p.exited += 1,
                Some(Stopped::GaveUp) => p.gave_up += 1,
                None => p.running += 1,
            }
        }
        p
    }

    /// As `Engine::set_early_results`.
    pub fn set_early_results(&self, early: bool) {
        self.node.set_early_results(early);
    }

    /// As `Engine::shutdown` once its workers ended: fails the work that reached a worker
    /// after it stopped ([`crate::worker::fail_left_behind`]), then reports every result still
    /// waiting for a hung I/O to free its blocks, with its release unset.
    pub fn finish_stop(&self) {
        self.node.fail_left_behind();
        self.node.shared().report_held();
    }

    /// Jobs whose blocks came back after an I/O held them past the job's resolution.
    pub fn released_late(&self) -> u64 {
        self.node.shared().held.released_late()
    }

    pub fn jobs_in_flight(&self) -> usize {
        self.node.jobs_in_flight()
    }

    /// Moves every finished job's result into `out`.
    pub fn poll(&self, out: &mut Vec<JobResult>) {
        for r in self.caller.results().try_iter() {
            super::trace(&[7, r.id, r.failures.len() as u64]);
            for f in &r.failures {
                let reason = xxhash_rust::xxh3::xxh3_64(format!("{:?}", f.reason).as_bytes());
                super::trace(&[f.key_index as u64, reason]);
            }
            out.push(r);
        }
    }

    /// Checks, once settled, that nothing leaked: no op, pin, queue room, in-flight count or
    /// half-written slot left, and every published key indexed.
    pub fn check_quiet(&self) -> std::result::Result<(), String> {
        for (i, w) in self.workers.iter().enumerate() {
            w.check_quiet().map_err(|e| format!("worker {i}: {e}"))?;
        }
        match self.cold.as_ref().map(|c| c.queued()) {
            Some(n) if n > 0 => Err(format!("the object store has {n} requests left")),
            _ => Ok(()),
        }
    }

    /// Power goes out: the workers vanish with their I/O in flight (it never completes), and
    /// the storage loses what was not durable ([`SimStorage::power_loss`]).
    pub fn power_loss(self, storage: &SimStorage, seed: u64) -> super::PowerLoss {
        self.crash();
        storage.power_loss(seed)
    }

    /// The process dies: the workers vanish with their I/O in flight, and the cold tier's
    /// requests with them (see [`SimObjectStore::crash`]). The storage is the caller's to
    /// power off ([`SimStorage::power_loss`], [`SimFiles::power_loss`]).
    pub fn crash(self) {
        if let Some(cold) = &self.cold {
            cold.crash();
        }
        drop(self);
    }
}
