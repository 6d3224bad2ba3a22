//! A worker thread's start: pinning, buffers, ring, recovery of its share, then its loop.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

use crate::files::device::{FilesDevice, ScannedFile};
use crate::files::layout::FilesLayout;
use crate::io::{BackendSettings, Region, Storage};
use crate::job::Shared;
use crate::slab::layout::{DeviceSpec, SlabLayout};
use crate::worker::{self, Msg, Scheduler, Worker, WorkerParams, WorkerShared};

use super::WorkerSummary;

pub(super) struct WorkerCtx {
    pub(super) id: usize,
    pub(super) workers: usize,
    pub(super) core: Option<usize>,
    pub(super) storage: Arc<dyn Storage>,
    pub(super) region: Arc<Region>,
    pub(super) devices: Arc<Vec<DeviceSpec>>,
    pub(super) files_devices: Arc<Vec<Arc<FilesDevice>>>,
    /// `[files] stores_opening` (files layout only).
    pub(super) files_stores_opening: usize,
    pub(super) scanned: Vec<ScannedFile>,
    pub(super) shared: Arc<Shared>,
    pub(super) me: Arc<WorkerShared>,
    pub(super) rx: Receiver<Msg>,
    pub(super) settings: BackendSettings,
    pub(super) sched: Scheduler,
    pub(super) ring_entries: usize,
    pub(super) io_timeout: std::time::Duration,
    pub(super) staging_blocks: usize,
    pub(super) ready: Sender<(usize, std::result::Result<WorkerSummary, String>)>,
    /// Set with `s3.write = "on_evict"` on the slab layout.
    pub(super) demote_sink: Option<worker::DemoteSink>,
}

/// The body of worker thread `ctx.id`: pin, allocate its buffers, build its ring, recover its
/// share of the devices, report ready (or why not), run until stopped.
pub(super) fn worker_main(ctx: WorkerCtx) {
    let id = ctx.id;
    ctx.me
        .tid
        .store(nix::unistd::gettid().as_raw(), Ordering::Release);
    let pinned = match ctx.core {
        Some(core) => match kvtier_sys::affinity::pin_current_thread(core) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(worker = id, core, "could not pin worker: {}", e.desc());
                false
            }
        },
        None => false,
    };
    let (meta, demote) = match buffers(&ctx) {
        Ok(b) => b,
        Err(e) => {
            let _ = ctx.ready.send((id, Err(e)));
            return;
        }
    };
    let mut buffers = vec![Arc::clone(&ctx.region), Arc::clone(&meta)];
    if let Some(d) = &demote {
        buffers.push(Arc::clone(&d.staging));
    }
    let backend = match ctx
        .storage
        .backend(id, buffers, Arc::clone(&ctx.me.wake), &ctx.settings)
    {
        Ok(b) => b,
        Err(e) => {
            let _ = ctx.ready.send((id, Err(e.to_string())));
            return;
        }
    };
    let params = WorkerParams {
        id,
        backend,
        region: ctx.region,
        rx: ctx.rx,
        shared: ctx.shared,
        me: Arc::clone(&ctx.me),
        sched: ctx.sched,
        ring_entries: ctx.ring_entries,
        demote,
        io_timeout: ctx.io_timeout,
        clock: crate::clock::Clock::default(),
    };
    let summary = |backend: String, recovered_blocks: u64| WorkerSummary {
        core: ctx.core,
        pinned,
        backend,
        recovered_blocks,
    };
    if !ctx.files_devices.is_empty() {
        let layout = FilesLayout::new(
            id,
            ctx.files_devices.iter().cloned().collect(),
            ctx.scanned,
            ctx.files_stores_opening,
            &ctx.me,
            FilesLayout::temp_seed(),
        );
        let indexed = layout.indexed();
        let mut worker = Worker::new(params, layout, crate::files::layout::Op::empty);
        let (layout, core) = worker.parts();
        layout.publish_scanned(core);
        let _ = ctx
            .ready
            .send((id, Ok(summary(worker.describe(), indexed))));
        drop(ctx.ready);
        worker.run();
        return;
    }
    let worker = match SlabLayout::recovered_worker(params, ctx.workers, meta, &ctx.devices) {
        Ok((worker, recovered)) => {
            let _ = ctx
                .ready
                .send((id, Ok(summary(worker.describe(), recovered))));
            worker
        }
        Err(e) => {
            let _ = ctx.ready.send((id, Err(e)));
            return;
        }
    };
    drop(ctx.ready);
    worker.run();
}

/// The worker's slot-table copy (buffer 1) and, with demotion, its staging slots (buffer 2).
fn buffers(ctx: &WorkerCtx) -> std::result::Result<(Arc<Region>, Option<worker::Demote>), String> {
    let meta_len = crate::slab::table::meta_bytes(&ctx.devices, ctx.id, ctx.workers);
    let meta = worker_buffer(meta_len, crate::slab::TABLE_PAGE_BYTES, "slot table copy")?;
    let demote = match &ctx.demote_sink {
        None => None,
        Some(sink) => {
            let block_bytes = ctx.sched.block_bytes() as usize;
            let staging = worker_buffer(
                ctx.staging_blocks * block_bytes,
                block_bytes,
                "demotion staging",
            )?;
            Some(worker::Demote::new(
                staging,
                ctx.staging_blocks,
                Arc::clone(sink),
            ))
        }
    };
    Ok((meta, demote))
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
