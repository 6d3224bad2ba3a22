//! A worker thread's start: pinning, then the worker built on its core (`node::build`), then
//! its loop.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

use crate::files::device::ScannedFile;
use crate::node::build::WorkerPlan;
use crate::worker::{Msg, WorkerShared};

use super::WorkerSummary;

pub(super) struct WorkerCtx {
    pub(super) id: usize,
    pub(super) core: Option<usize>,
    pub(super) plan: Arc<WorkerPlan>,
    pub(super) scanned: Vec<ScannedFile>,
    pub(super) me: Arc<WorkerShared>,
    pub(super) rx: Receiver<Msg>,
    pub(super) ready: Sender<(usize, std::result::Result<WorkerSummary, String>)>,
}

/// The body of worker thread `ctx.id`: pin, build the worker (its buffers, ring, and its
/// share of the devices recovered), report ready (or why not), run until stopped.
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
    match ctx.plan.build(id, &ctx.me, ctx.rx, ctx.scanned) {
        Ok((worker, recovered_blocks)) => {
            let summary = WorkerSummary {
                core: ctx.core,
                pinned,
                backend: worker.describe(),
                recovered_blocks,
            };
            let _ = ctx.ready.send((id, Ok(summary)));
            drop(ctx.ready);
            drop(ctx.plan);
            worker.run();
        }
        Err(e) => {
            let _ = ctx.ready.send((id, Err(e)));
        }
    }
}
