//! Opening an engine: check the region, open (format or recover) the devices, start one worker
//! per core and wait until each has recovered its share, then connect the cold tier.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::config::{Config, Derived, Layout, Validated, VerifyLoads};
use crate::error::{Error, Result};
use crate::events::EventSink;
use crate::files::device::{FilesDevice, ScannedFile};
use crate::io::{Region, Storage};
use crate::job::Shared;
use crate::node::build::{scanned_by_worker, Layouts, WorkerPlan, WorkerSettings};
use crate::route::Router;
use crate::slab::layout::SlabDevice;
use crate::slab::prepare::prepare_slab;
use crate::slab::Geometry;
use crate::worker::{self, WorkerShared};
use kvtier_sys::mem::Backing;

use super::start::{worker_main, WorkerCtx};
use super::stats::StatsSource;
use super::{DeviceSummary, Engine, EngineInfo, WorkerSummary};
use crate::metrics::serve::MetricsServer;
use crate::node::Node;

/// The devices as opened: slab devices for the workers, or `files` directories with what their
/// scan found.
struct Opened {
    slab: Vec<SlabDevice>,
    files: Vec<Arc<FilesDevice>>,
    scanned: Vec<ScannedFile>,
    summaries: Vec<DeviceSummary>,
}

/// A worker as started: its channel (and a second receiver of it, for what arrives after it
/// stopped) and what other threads see of it.
struct WorkerHandle {
    tx: crossbeam_channel::Sender<crate::worker::Msg>,
    rx: crossbeam_channel::Receiver<crate::worker::Msg>,
    shared: Arc<WorkerShared>,
}

/// The workers as started.
struct Started {
    handles: Vec<WorkerHandle>,
    threads: Vec<JoinHandle<()>>,
    summaries: Vec<WorkerSummary>,
    /// The first worker that failed to start, if any (the others are running).
    error: Option<Error>,
}

impl Engine {
    /// Opens the engine on any [`Storage`] (the simulated one in tests).
    #[allow(clippy::needless_pass_by_value)] // ownership is the natural API; clones go to workers
    pub fn open_with(
        config: &Config,
        region: Arc<Region>,
        storage: Arc<dyn Storage>,
    ) -> Result<Engine> {
        let started = std::time::Instant::now();
        let config = config.validate()?;
        let derived = config.derived();
        let region_blocks = check_region(&region, derived.block_bytes)?;
        let mut devices = open_devices(&config, storage.as_ref())?;
        let cores = config.cores.workers();
        let shared = Shared::new(EventSink::new(
            config.events.enabled,
            config.events.max,
            config.events.locality,
        ));
        let demote_sink: Option<worker::DemoteSink> = derived
            .demote_on_evict
            .then(|| Arc::new(std::sync::OnceLock::new()));
        let device_summaries = std::mem::take(&mut devices.summaries);
        let settings = WorkerSettings::new(&config);
        let workers = start_workers(
            &settings,
            derived,
            &cores,
            devices,
            &storage,
            &region,
            &shared,
            demote_sink.as_ref(),
        )?;
        // After the workers registered the region with their rings, which faulted in (and
        // pinned) every page: what backs it now is what every block's I/O will use.
        let region_huge_percent = region_pages(&region, derived.block_bytes);
        let router = Arc::new(Router {
            workers: workers
                .handles
                .iter()
                .map(|h| (h.tx.clone(), Arc::clone(&h.shared)))
                .collect(),
            queue_blocks_max: config.queue_blocks_max,
        });
        let node = Node::new(
            Arc::clone(&shared),
            Arc::clone(&router),
            workers.handles.into_iter().map(|h| h.rx).collect(),
            vec![(Arc::clone(&region), region_blocks)],
            config.jobs_in_flight_max,
            settings.first_lookup,
        );
        let caller = Arc::new(crate::job::sink::ChannelSink::default());
        let client = node.register_client(&(Arc::clone(&caller) as _), 0)?;
        let mut engine = Engine {
            node,
            caller,
            client,
            storage: Arc::clone(&storage),
            block_bytes: derived.block_bytes,
            stats: Arc::new(StatsSource::new(
                &router,
                &cores,
                &shared,
                &config.devices,
                derived,
            )),
            metrics_server: Mutex::new(None),
            shutting_down: Mutex::new(()),
            threads: Mutex::new(workers.threads),
            info: EngineInfo {
                block_bytes: derived.block_bytes,
                region_blocks,
                region_backing: region.backing().as_str(),
                region_huge_percent,
                devices: device_summaries,
                workers: workers.summaries,
                #[cfg(feature = "s3")]
                s3: None,
                open_seconds: 0.0,
            },
        };
        if let Some(e) = workers.error {
            engine.shutdown();
            return Err(e);
        }
        if let Err(e) = engine.open_cold(&config, &cores, shared, router, demote_sink) {
            engine.shutdown();
            return Err(e);
        }
        if let Some(addr) = config.metrics.listen {
            match MetricsServer::start(addr, Arc::clone(&engine.stats) as _) {
                Ok(server) => engine.metrics_server = Mutex::new(Some(server)),
                Err(e) => {
                    engine.shutdown();
                    return Err(e);
                }
            }
        }
        engine.info.open_seconds = started.elapsed().as_secs_f64();
        engine.log_ready();
        Ok(engine)
    }

    /// Opens the `[s3]` tier, if configured, and connects it.
    #[allow(clippy::needless_pass_by_value)] // moved into the tier with the s3 feature
    #[cfg_attr(not(feature = "s3"), allow(clippy::unused_self))]
    fn open_cold(
        &mut self,
        config: &Config,
        cores: &[Option<usize>],
        shared: Arc<Shared>,
        router: Arc<Router>,
        demote_sink: Option<worker::DemoteSink>,
    ) -> Result<()> {
        let Some(s3) = &config.s3 else {
            return Ok(());
        };
        #[cfg(feature = "s3")]
        {
            let worker_cores: Vec<usize> = cores.iter().flatten().copied().collect();
            let tier =
                crate::s3::S3Tier::open(s3, self.block_bytes, shared, router, &worker_cores)?;
            self.info.s3 = Some(tier.summary().clone());
            self.attach_cold(Arc::new(tier), demote_sink.as_ref());
            Ok(())
        }
        #[cfg(not(feature = "s3"))]
        {
            let _ = (s3, cores, shared, router, demote_sink);
            Err(Error::S3(
                "this kvtier was built without the `s3` feature; rebuild with it or remove the [s3] section".into(),
            ))
        }
    }

    fn log_ready(&self) {
        let stats = self.stats();
        let unroutable = stats.unroutable_entries;
        if stats.torn_entries > 0 {
            // One line after a crash: what recovery found and that nothing is to be done.
            tracing::warn!(
                recovered = stats.recovered_blocks,
                torn = stats.torn_entries,
                "recovered after an unclean stop (crash, kill or power loss): slot-table entries \
                 torn by it were dropped, their blocks are misses and are stored again by the \
                 next store; every recovered block is checksummed before it is served. Nothing \
                 to do"
            );
        }
        if unroutable > 0 {
            tracing::warn!(
                blocks = unroutable,
                "dropped stored blocks whose keys now route to another worker (cores \
                 changed since they were written)"
            );
        }
        for (i, d) in self.info.devices.iter().enumerate() {
            tracing::info!(
                device = i,
                path = %d.path.display(),
                kind = d.kind,
                direct = d.direct,
                slots = d.geometry.slot_count,
                formatted = d.formatted,
                "device ready"
            );
        }
    }
}

/// The share of the region's resident bytes mapped by huge pages (`None` if it cannot be read
/// or none of the region is resident).
/// Warns when a region that was meant to have them, or that the caller gave, is mostly 4 KiB
/// pages: every block then moves as one segment per 4 KiB page.
fn region_pages(region: &Region, block_bytes: u64) -> Option<f64> {
    let mapped = match kvtier_sys::smaps::huge_mapped(region.addr(), region.len()) {
        Ok(m) => m,
        Err(e) => {
            tracing::debug!(error = %e, "cannot tell the region's page sizes: not reported");
            return None;
        }
    };
    let percent = mapped.percent()?;
    let backing = region.backing();
    let meant_huge = matches!(backing, Backing::Foreign | Backing::Thp);
    if meant_huge && percent < 50.0 && block_bytes > 4096 {
        tracing::warn!(
            backing = backing.as_str(),
            huge_percent = format!("{percent:.0}"),
            region_bytes = region.len(),
            "the primary region is mostly 4 KiB pages: each block moves as one segment per 4 KiB \
             page (on the test machine's disk, stores ran at about half the rate of stores from \
             huge pages). For vLLM's region in /dev/shm: `mount -o remount,huge=within_size \
             /dev/shm` before vLLM starts; for memory you map: MAP_HUGETLB or \
             madvise(MADV_HUGEPAGE) before first touch (README, \"Huge pages for vLLM's CPU buffer\")"
        );
    }
    Some(percent)
}

/// The region's block count, after checking it fits the engine and guarding its blocks.
pub(crate) fn check_region(region: &Region, block_bytes: u64) -> Result<u64> {
    if (region.len() as u64) < block_bytes {
        return Err(Error::Memory(format!(
            "the region is {} bytes, smaller than one block of {block_bytes}",
            region.len()
        )));
    }
    let region_blocks = region.len() as u64 / block_bytes;
    if region_blocks > u64::from(u32::MAX) {
        return Err(Error::Memory(format!(
            "{region_blocks} blocks: at most 2^32-1"
        )));
    }
    region.guard_blocks(block_bytes as usize).map_err(|e| {
        Error::Memory(format!(
            "guarding the region in blocks of {block_bytes} bytes: {} (is it in use by an \
             engine with another block_size?)",
            e.desc()
        ))
    })?;
    Ok(region_blocks)
}

/// Opens every device: formats or checks slab headers, or scans `files` directories.
fn open_devices(config: &Validated, storage: &dyn Storage) -> Result<Opened> {
    let derived = config.derived();
    let block_bytes = derived.block_bytes;
    let mut out = Opened {
        slab: Vec::new(),
        files: Vec::new(),
        scanned: Vec::new(),
        summaries: Vec::with_capacity(config.devices.len()),
    };
    if derived.layout == Layout::Files && !storage.supports_files() {
        return Err(Error::Worker(
            "this storage backend cannot run the files layout (the simulated device is slab-only)"
                .into(),
        ));
    }
    for (i, dcfg) in config.devices.iter().enumerate() {
        if derived.layout == Layout::Files {
            let files_cfg = config.files.as_ref().ok_or_else(|| {
                Error::from(crate::config::ConfigError::Invalid {
                    field: "files".into(),
                    value: "(missing)".into(),
                    expected: "a [files] section for layout = \"files\"".into(),
                })
            })?;
            let (dev, found, report) =
                FilesDevice::open(i, dcfg, files_cfg, block_bytes, config.direct_io)?;
            out.summaries.push(DeviceSummary {
                path: dev.data_dir.clone(),
                kind: "directory",
                direct: dev.direct,
                size_bytes: dcfg.capacity_bytes.unwrap_or(0),
                geometry: Geometry {
                    block_bytes,
                    slot_bytes: block_bytes,
                    slot_count: dcfg.capacity_bytes.map_or(0, |c| c / block_bytes),
                    table_offset: 0,
                    data_offset: 0,
                },
                formatted: false,
                files: Some(report),
            });
            out.scanned.extend(found);
            out.files.push(Arc::new(dev));
            continue;
        }
        let info = storage.open_device(i, dcfg, config.direct_io)?;
        let (geometry, formatted) = prepare_slab(storage, i, &info, block_bytes, dcfg.overwrite)?;
        out.summaries.push(DeviceSummary {
            path: info.path.clone(),
            kind: info.kind,
            direct: info.direct,
            size_bytes: info.size_bytes,
            geometry,
            formatted,
            files: None,
        });
        out.slab.push(SlabDevice {
            geometry,
            fresh: formatted,
            name: format!("devices[{i}] {}", info.path.display()),
            verify_always: config.verify_loads == VerifyLoads::Always,
        });
    }
    Ok(out)
}

/// Spawns one worker per core and waits until every one has recovered its share (or failed).
#[allow(clippy::too_many_arguments)] // the pieces open_with just built, each handed on once
fn start_workers(
    settings: &WorkerSettings,
    derived: &Derived,
    cores: &[Option<usize>],
    devices: Opened,
    storage: &Arc<dyn Storage>,
    region: &Arc<Region>,
    shared: &Arc<Shared>,
    demote_sink: Option<&worker::DemoteSink>,
) -> Result<Started> {
    let workers = cores.len();
    let mut scanned = scanned_by_worker(devices.scanned, workers);
    let plan = Arc::new(WorkerPlan {
        workers,
        storage: Arc::clone(storage),
        regions: vec![Arc::clone(region)],
        shared: Arc::clone(shared),
        layouts: if derived.layout == Layout::Files {
            Layouts::Files {
                devices: devices.files,
                temp_seed: crate::files::layout::FilesLayout::temp_seed(),
            }
        } else {
            Layouts::Slab(Arc::new(devices.slab))
        },
        settings: settings.clone(),
        demote: demote_sink.cloned(),
        clock: crate::clock::Clock::default(),
    });
    let mut handles = Vec::with_capacity(workers);
    let mut threads = Vec::with_capacity(workers);
    let (ready_tx, ready_rx) = crossbeam_channel::unbounded();
    for (id, core) in cores.iter().copied().enumerate() {
        let seat = plan.seat()?;
        handles.push(WorkerHandle {
            tx: seat.tx,
            rx: seat.rx.clone(),
            shared: Arc::clone(&seat.me),
        });
        let ctx = WorkerCtx {
            id,
            core,
            plan: Arc::clone(&plan),
            scanned: std::mem::take(&mut scanned[id]),
            me: seat.me,
            rx: seat.rx,
            ready: ready_tx.clone(),
        };
        let handle = std::thread::Builder::new()
            .name(format!("kvtier-w{id}"))
            .spawn(move || worker_main(ctx))
            .map_err(|e| Error::Worker(format!("spawning worker {id}: {e}")))?;
        threads.push(handle);
    }
    drop(ready_tx);
    let mut summaries = vec![None; workers];
    let mut error = None;
    for _ in 0..workers {
        match ready_rx.recv() {
            Ok((id, Ok(w))) => summaries[id] = Some(w),
            Ok((id, Err(e))) => {
                error.get_or_insert(Error::Worker(format!("worker {id}: {e}")));
            }
            Err(_) => {
                error.get_or_insert(Error::Worker("a worker died while starting".into()));
                break;
            }
        }
    }
    Ok(Started {
        handles,
        threads,
        summaries: summaries.into_iter().flatten().collect(),
        error,
    })
}
