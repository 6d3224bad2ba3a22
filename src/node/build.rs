//! Putting a worker together, written once for every front end: its channel and shared part
//! ([`WorkerPlan::seat`]), then its buffers, its backend and its layout, recovered from the
//! slab or with the files its directories' scan found ([`WorkerPlan::build`]). The engine
//! builds each worker on its own pinned thread (so its buffers are allocated on its core) and
//! runs it; the simulator builds them all on its thread and steps them.

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use crate::clock::Clock;
use crate::config::{FilesConfig, FirstLookup, Layout, SchedulerConfig, Validated};
use crate::files::device::{FilesDevice, ScannedFile};
use crate::files::layout::FilesLayout;
use crate::io::{BackendSettings, EventFd, Region, Storage};
use crate::job::Shared;
use crate::slab::layout::{SlabDevice, SlabLayout};
use crate::worker::{self, Msg, Scheduler, Worker, WorkerParams, WorkerShared};

/// The devices a node's workers run on.
pub(crate) enum Layouts {
    /// Slab devices, opened (formatted or checked).
    Slab(Arc<Vec<SlabDevice>>),
    /// `files` directories, opened and scanned.
    Files {
        devices: Vec<Arc<FilesDevice>>,
        /// The seed of the workers' temp file names (`FilesLayout::temp_seed` in the engine,
        /// the simulated files' seed in the simulator).
        temp_seed: u64,
    },
}

impl Layouts {
    fn devices(&self) -> usize {
        match self {
            Layouts::Slab(d) => d.len(),
            Layouts::Files { devices, .. } => devices.len(),
        }
    }
}

/// What a worker runs with that the validated config alone decides: derived once, the same for
/// every front end (the simulator turns off what needs a real ring).
#[derive(Clone, Debug)]
pub(crate) struct WorkerSettings {
    pub backend: BackendSettings,
    pub scheduler: SchedulerConfig,
    pub block_bytes: u64,
    pub store_chunk_bytes: u64,
    pub ring_entries: usize,
    /// `io_timeout_ms`.
    pub io_timeout: Duration,
    /// Staging slots per worker for demotion (`s3.write = "on_evict"`).
    pub staging_blocks: usize,
    /// The files layout: the answers kept for keys not indexed (at most, and for how long).
    pub lookup_cache: Option<(usize, Duration)>,
    /// The files layout's `first_lookup` (`None`: slab).
    pub first_lookup: Option<FirstLookup>,
    /// `[files] stores_opening`.
    pub stores_opening: usize,
}

impl WorkerSettings {
    /// From the validated `config` and its derived sizes.
    pub fn new(config: &Validated) -> WorkerSettings {
        let derived = config.derived();
        let files = config
            .files
            .as_ref()
            .filter(|_| derived.layout == Layout::Files);
        let io_timeout = Duration::from_millis(u64::from(config.io_timeout_ms));
        WorkerSettings {
            backend: BackendSettings {
                ring_entries: config.ring_entries,
                sqpoll: config.sqpoll,
                sqpoll_idle_ms: config.sqpoll_idle_ms,
                iopoll: config.iopoll,
                ioprio: config.scheduler.ioprio,
                piece_bytes: derived.piece_bytes,
                files_io_wq_workers: (derived.layout == Layout::Files)
                    .then(|| files.map_or(FilesConfig::DEFAULT_IO_WQ_WORKERS, |f| f.io_wq_workers)),
                wait_limit: worker::overdue_check_interval(io_timeout),
            },
            scheduler: config.scheduler.clone(),
            block_bytes: derived.block_bytes,
            store_chunk_bytes: derived.store_chunk_bytes,
            ring_entries: config.ring_entries as usize,
            io_timeout,
            staging_blocks: derived.staging_blocks,
            lookup_cache: config
                .files
                .as_ref()
                .map(|f| (f.lookup_cache_max, Duration::from_millis(f.lookup_ttl_ms))),
            first_lookup: files.map(|f| f.first_lookup),
            stores_opening: files.map_or(FilesConfig::DEFAULT_STORES_OPENING as usize, |f| {
                f.stores_opening as usize
            }),
        }
    }
}

/// What every worker of a node is built from: the same for each, taken once from the
/// validated config and the opened devices.
pub(crate) struct WorkerPlan {
    pub workers: usize,
    pub storage: Arc<dyn Storage>,
    /// The node's regions, by `RegionId` (region 0 the primary one).
    pub regions: Vec<Arc<Region>>,
    pub shared: Arc<Shared>,
    pub layouts: Layouts,
    pub settings: WorkerSettings,
    /// With `s3.write = "on_evict"`: where demotions go.
    pub demote: Option<worker::DemoteSink>,
    /// What deadlines and answer ages run on: the monotonic clock, or the simulator's.
    pub clock: Clock,
}

/// A worker as built, whichever its layout.
pub(crate) enum Built {
    Slab(Worker<SlabLayout>),
    Files(Worker<FilesLayout>),
}

impl Built {
    pub fn describe(&self) -> String {
        match self {
            Built::Slab(w) => w.describe(),
            Built::Files(w) => w.describe(),
        }
    }

    /// Runs the worker's loop on this thread until it stops.
    pub fn run(self) {
        match self {
            Built::Slab(w) => w.run(),
            Built::Files(w) => w.run(),
        }
    }
}

/// A worker's seat at the node: the sending side of its channel, a second receiver (for what
/// arrives after it stopped), and what other threads see of it.
pub(crate) struct Seat {
    pub tx: Sender<Msg>,
    pub rx: Receiver<Msg>,
    pub me: Arc<WorkerShared>,
}

impl WorkerPlan {
    /// A worker's channel and shared part (its wake-up eventfd, metrics per device, the files
    /// layout's answers for keys not indexed on the plan's clock).
    pub fn seat(&self) -> crate::Result<Seat> {
        let wake = Arc::new(
            EventFd::new().map_err(|e| crate::Error::Worker(format!("eventfd: {}", e.desc())))?,
        );
        let mut me = WorkerShared::new(wake, self.layouts.devices());
        if let Some((max, ttl)) = self.settings.lookup_cache {
            me = me.with_lookup_cache(max, ttl, self.clock.clone());
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        Ok(Seat {
            tx,
            rx,
            me: Arc::new(me),
        })
    }

    /// Builds worker `id` on its seat (`rx`: the worker's receiver): its slot-table copy
    /// (buffer 1), its demotion staging (buffer 2), its backend over the region and those, and
    /// its layout, the slab's recovered from its share of the devices' tables, the files
    /// layout's with `scanned` indexed and published. Also returns the blocks it recovered or
    /// indexed.
    pub fn build(
        &self,
        id: usize,
        me: &Arc<WorkerShared>,
        rx: Receiver<Msg>,
        scanned: Vec<ScannedFile>,
    ) -> Result<(Built, u64), String> {
        let slab: &[SlabDevice] = match &self.layouts {
            Layouts::Slab(d) => d,
            Layouts::Files { .. } => &[],
        };
        let meta_len = crate::slab::table::meta_bytes(slab, id, self.workers);
        let meta = worker_buffer(meta_len, crate::slab::TABLE_PAGE_BYTES, "slot table copy")?;
        let mut buffers = vec![Arc::clone(&self.regions[0]), Arc::clone(&meta)];
        let s = &self.settings;
        let demote = match &self.demote {
            None => None,
            Some(sink) => {
                let bytes = s.block_bytes as usize;
                let staging = worker_buffer(s.staging_blocks * bytes, bytes, "demotion staging")?;
                buffers.push(Arc::clone(&staging));
                Some(worker::Demote::new(
                    staging,
                    s.staging_blocks,
                    Arc::clone(sink),
                ))
            }
        };
        if self.regions.len() > 1 {
            // The other regions follow the staging buffer (`worker::region_buffer`): a page
            // holds its place where there is no demotion.
            if demote.is_none() {
                buffers.push(worker_buffer(4096, 4096, "staging placeholder")?);
            }
            buffers.extend(self.regions[1..].iter().cloned());
            debug_assert_eq!(
                buffers.len(),
                usize::from(worker::region_buffer((self.regions.len() - 1) as u16)) + 1
            );
        }
        let backend = self
            .storage
            .backend(id, buffers, Arc::clone(&me.wake), &s.backend)
            .map_err(|e| e.to_string())?;
        let params = WorkerParams {
            id,
            backend,
            regions: self.regions.clone(),
            rx,
            shared: Arc::clone(&self.shared),
            me: Arc::clone(me),
            sched: Scheduler::new(&s.scheduler, s.block_bytes, s.store_chunk_bytes),
            ring_entries: s.ring_entries,
            demote,
            io_timeout: s.io_timeout,
            clock: self.clock.clone(),
        };
        match &self.layouts {
            Layouts::Slab(devices) => {
                let (worker, recovered) =
                    SlabLayout::recovered_worker(params, self.workers, meta, devices)?;
                Ok((Built::Slab(worker), recovered))
            }
            Layouts::Files { devices, temp_seed } => {
                let layout = FilesLayout::new(
                    id,
                    devices.clone(),
                    scanned,
                    s.stores_opening,
                    me,
                    *temp_seed,
                );
                let indexed = layout.indexed();
                let mut worker = Worker::new(params, layout);
                let (layout, cx) = worker.parts();
                layout.publish_scanned(cx);
                Ok((Built::Files(worker), indexed))
            }
        }
    }
}

/// `scanned` (what the directories' scan found) grouped by the worker each key routes to.
pub(crate) fn scanned_by_worker(
    scanned: Vec<ScannedFile>,
    workers: usize,
) -> Vec<Vec<ScannedFile>> {
    let mut out: Vec<Vec<ScannedFile>> = vec![Vec::new(); workers];
    for f in scanned {
        out[f.key.worker(workers)].push(f);
    }
    out
}

/// One of a worker's own buffers (`what`: the slot-table copy, the demotion staging) of
/// `len` bytes, guarded in blocks of `unit` bytes: a transfer claims the blocks it moves
/// ([`Region::checkout`]), and the worker's copies keep off them meanwhile.
pub(crate) fn worker_buffer(
    len: usize,
    unit: usize,
    what: &str,
) -> std::result::Result<Arc<Region>, String> {
    let region = Region::allocate(len, kvtier_sys::mem::HugePages::Off)
        .map_err(|e| format!("allocating {len} bytes of {what}: {e}"))?;
    region.guard_blocks(unit).map_err(|e| {
        format!(
            "guarding the {what} in blocks of {unit} bytes: {}",
            e.desc()
        )
    })?;
    Ok(Arc::new(region))
}
