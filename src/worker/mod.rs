//! One worker: a thread pinned to one CPU core, owning one I/O queue (ring), the index entries of
//! the keys that hash to it and its share of every device. [`Worker`] holds everything the
//! layouts have in common — the run loop, intake, the queues, the [`Scheduler`], store chunking,
//! load and store reporting — and a [`Layout`] (the slab, or the files directory) decides what
//! a load or a store is on the device ([`layout`]: the seam).
//!
//! This file is the loop; each phase of a turn has its own file, in the order a turn runs them:
//!
//! ```text
//! engine ──Msg──► intake.rs  ─► loads / stores queues (queue.rs)
//!                  turn:  reap.rs    CQEs ─► layout.on_complete, or the chunk accounting of a store
//!                         expire.rs  ops past io_timeout: keys failed, requests cancelled
//!                         layout.unstall (ops that found the SQ full)
//!                         issue.rs   loads  ─► layout.start_load   (while the scheduler allows)
//!                                    stores ─► layout.start_store  ─► chunks ─► layout.push_chunk
//!                         layout.background (slot table pages)
//!                  submit, or sleep in the ring until a CQE or a nudge; layout.after_submit
//! ```
//!
//! Invariants: an op's memory (a region block, a table page, a staging slot) is not reused
//! before its completion is reaped; the worker exits only when no op is in flight; every key of
//! every part it took is reported exactly once.

mod context;
pub(crate) mod demote;
mod expire;
mod intake;
mod issue;
mod layout;
pub(crate) mod ops;
pub(crate) mod published;
pub(crate) mod queue;
mod reap;
pub(crate) mod sched;
pub(crate) mod shared;
pub(crate) mod unindexed;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use crate::clock::Clock;
use crate::io::{Completion, IoBackend, Region};
use crate::job::{JobState, Shared};

pub(crate) use self::context::Context;
pub(crate) use demote::{Demote, DemoteSink, Demotion};
pub(crate) use layout::{Layout, LayoutOp, Removal, Start};
pub(crate) use ops::OpTable;
pub(crate) use published::Publisher;
pub(crate) use queue::{fail_left_behind, send_parts, Msg, Part, Removed, WorkQueue};
pub(crate) use sched::{Chunks, Scheduler};
pub(crate) use shared::WorkerShared;
use shared::{awake, ready_to_sleep};
use unindexed::Unindexed;

/// Buffer indexes in every backend: the primary region and this worker's table copy.
pub(crate) const BUF_REGION: u16 = 0;
pub(crate) const BUF_META: u16 = 1;
/// The demotion staging buffer (`s3.write = "on_evict"`; a placeholder page where a node has
/// more than one region and no demotion).
pub(crate) const BUF_STAGING: u16 = 2;

/// The buffer index of node region `region` in every backend: region 0 is `BUF_REGION`, the
/// others follow the staging buffer.
pub(crate) fn region_buffer(region: crate::job::RegionId) -> u16 {
    if region == 0 {
        BUF_REGION
    } else {
        BUF_STAGING + region
    }
}

/// Everything a worker is built from.
pub(crate) struct WorkerParams {
    pub id: usize,
    pub backend: Box<dyn IoBackend>,
    /// The node's regions, by `RegionId`.
    pub regions: Vec<Arc<Region>>,
    pub rx: Receiver<Msg>,
    pub shared: Arc<Shared>,
    pub me: Arc<WorkerShared>,
    pub sched: Scheduler,
    pub ring_entries: usize,
    pub demote: Option<Demote>,
    pub io_timeout: Duration,
    /// What deadlines run on: the monotonic clock, or the simulator's.
    pub clock: Clock,
}

pub(crate) struct Worker<L: Layout> {
    cx: Context<L::Op>,
    layout: L,
    rx: Receiver<Msg>,
    completions: Vec<Completion>,
    /// When to look for ops past their deadline next.
    next_overdue_check: Instant,
    /// When the stop arrived.
    stop_at: Option<Instant>,
    /// The backend fenced its device at a stop (the I/O past its deadline then fails).
    fenced: bool,
    #[cfg(any(test, feature = "sim"))]
    sim: SimLoop,
}

/// How one pass of a worker's loop ends ([`Worker::pass`]).
enum Pass {
    /// Submit, sleeping in the submit if `wait` (nothing moved and nothing is queued).
    Submit { wait: bool },
    /// Go round again at once (the device was just fenced).
    Again,
    /// Stopped and idle: the thread exits.
    Exit,
    /// Stopped with only I/O past its deadline left: the worker leaks itself.
    GiveUp,
}

/// What the simulator keeps of a stepped worker's loop: where it is parked in a wait, and how
/// its loop ended.
#[cfg(any(test, feature = "sim"))]
struct SimLoop {
    /// Parked in a pass's wait since then (on the worker's clock).
    parked_at: Option<Instant>,
    /// How long the ring's wait sleeps at most with I/O in flight (`BackendSettings::wait_limit`).
    wait_limit: Duration,
    outcome: Option<Stopped>,
}

/// For [`Layout::overdue_keys`]: the one key an op serves, whose block it may still move.
pub(crate) fn own_key(job: Option<&Arc<JobState>>, item: u32) -> Vec<(Arc<JobState>, usize, bool)> {
    job.map(|j| (Arc::clone(j), item as usize, true))
        .into_iter()
        .collect()
}

/// How often a worker looks for ops past their deadline: an eighth of it, 5 ms to 1 s.
pub(crate) fn overdue_check_interval(io_timeout: Duration) -> Duration {
    (io_timeout / 8).clamp(Duration::from_millis(5), Duration::from_secs(1))
}

/// Where a stopped worker's `run` loop ends (see [`Worker::stopped`], for the simulator).
#[cfg(any(test, feature = "sim"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// Everything it held is done: the thread exits.
    Exited,
    /// I/O still in flight past its deadline: the thread leaks itself, its ring and the
    /// region, so the device can never write freed memory.
    GaveUp,
}

impl<L: Layout> Worker<L> {
    pub fn new(p: WorkerParams, layout: L) -> Worker<L> {
        let capacity = p.sched.ops_capacity(p.ring_entries);
        let publisher = Publisher::new(Arc::clone(&p.me.published));
        let unindexed = Unindexed::new(&p.me.unindexed);
        let now = p.clock.now();
        Worker {
            cx: Context {
                id: p.id,
                backend: p.backend,
                regions: p.regions,
                shared: p.shared,
                me: p.me,
                ops: OpTable::new(capacity, p.clock),
                block_bytes: p.sched.block_bytes(),
                sched: p.sched,
                loads: WorkQueue::default(),
                stores: WorkQueue::default(),
                retry: VecDeque::new(),
                store_issuing: VecDeque::new(),
                stopping: false,
                demote: p.demote,
                publisher,
                unindexed,
                io_timeout: p.io_timeout,
                failed: 0,
                timeouts: Vec::new(),
                error_log: crate::logs::RateLimit::new(10, Duration::from_secs(10)),
            },
            layout,
            rx: p.rx,
            completions: Vec::with_capacity(p.ring_entries * 2),
            next_overdue_check: now,
            stop_at: None,
            fenced: false,
            #[cfg(any(test, feature = "sim"))]
            sim: SimLoop {
                parked_at: None,
                wait_limit: overdue_check_interval(p.io_timeout),
                outcome: None,
            },
        }
    }

    /// The layout and its context together (recovery runs on them before the loop starts).
    pub fn parts(&mut self) -> (&mut L, &mut Context<L::Op>) {
        (&mut self.layout, &mut self.cx)
    }

    pub fn describe(&self) -> String {
        self.cx.backend.describe()
    }

    /// Runs until stopped and idle, or stopped with only I/O that outlived its deadline left
    /// (then the worker is leaked, with its ring and the region, since the kernel may still
    /// write them). The simulator runs the same passes ([`Worker::step`]), one at a time.
    pub fn run(mut self) {
        loop {
            match self.pass() {
                Pass::Again => {}
                Pass::Exit => break,
                Pass::GiveUp => {
                    self.give_up();
                    std::mem::forget(self);
                    return;
                }
                Pass::Submit { wait } => {
                    let r = self.cx.backend.submit(wait);
                    self.finish_pass(wait, r);
                }
            }
        }
        self.cx.update_gauges();
    }

    /// One pass of the loop up to its submit: a turn, then the stop's checks, then whether
    /// to sleep in the submit (the sleeping flag set when it does).
    fn pass(&mut self) -> Pass {
        let progress = self.turn();
        self.cx.update_gauges();
        if self.cx.stopping && self.cx.idle() && self.layout.idle() {
            return Pass::Exit;
        }
        if self.hung_at_stop() && !self.fenced && self.cx.backend.fence() {
            // A device driven from user space can be stopped for good: its requests in
            // flight then fail, their memory goes back, and the worker ends normally.
            self.fenced = true;
            tracing::error!(
                worker = self.cx.id,
                in_flight = self.cx.backend.in_flight(),
                deadline_ms = self.cx.io_timeout.as_millis() as u64,
                "shutdown: I/O still in flight past its deadline; the device was fenced \
                 (controller disabled, DMA off) and that I/O fails"
            );
            return Pass::Again;
        }
        if self.hung_at_stop() {
            return Pass::GiveUp;
        }
        let returned = self.cx.demote.as_ref().map(Demote::returned);
        let wait = ready_to_sleep(&self.cx.me, &self.rx, progress, || {
            returned.is_some_and(|r| !r.is_empty())
        });
        Pass::Submit { wait }
    }

    /// After the pass's submit (and its sleep, when it slept).
    fn finish_pass(&mut self, waited: bool, r: std::io::Result<()>) {
        awake(self.cx.backend.as_ref(), &self.cx.me, waited);
        self.layout.after_submit(&mut self.cx);
        if let Err(e) = r {
            // The ring itself failed (not one I/O): nothing can be completed any more
            // without it, so log and keep reaping; a persistent failure is a bug.
            self.cx.log_error(&format!("submit failed: {e}"));
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// The stop gave up on I/O past its deadline: say so and count it (the shutdown report).
    fn give_up(&self) {
        tracing::error!(
            worker = self.cx.id,
            in_flight = self.cx.backend.in_flight(),
            deadline_ms = self.cx.io_timeout.as_millis() as u64,
            "shutdown: I/O still in flight past its deadline; this worker's ring and the \
             region stay allocated (leaked) so the device can never write freed memory. \
             Check the device (dmesg) before reusing it"
        );
        self.cx.give_up();
    }

    /// For the simulator, which steps every worker from one thread: one pass of [`Worker::run`]
    /// on the cluster's clock, its sleep included. A pass that would sleep submits and parks
    /// the worker; a parked worker wakes as the ring's wait would return (a completion, its
    /// eventfd written by a nudge, or the wait's limit on the clock with I/O still in flight)
    /// and then finishes that pass. A worker whose loop ended is not stepped again, except
    /// one that gave up, which runs on (for the checks after a stop; a real one never does).
    /// True if anything moved or is still in flight.
    #[cfg(any(test, feature = "sim"))]
    pub fn step(&mut self) -> bool {
        if self.sim.outcome == Some(Stopped::Exited) {
            return false;
        }
        if let Some(at) = self.sim.parked_at {
            let in_flight = self.cx.backend.in_flight() > 0;
            let limit = in_flight && self.cx.ops.now().duration_since(at) >= self.sim.wait_limit;
            if !self.cx.backend.sim_wake() && !limit {
                return in_flight;
            }
            self.sim.parked_at = None;
            self.finish_pass(true, Ok(()));
            return true;
        }
        let pass = self.pass();
        let wait = match pass {
            Pass::Again => return true,
            Pass::Exit => {
                self.sim.outcome = Some(Stopped::Exited);
                self.cx.update_gauges();
                return false;
            }
            Pass::GiveUp => {
                if self.sim.outcome.is_none() {
                    self.sim.outcome = Some(Stopped::GaveUp);
                    self.give_up();
                }
                false
            }
            Pass::Submit { wait } => wait,
        };
        let r = self.cx.backend.submit(false);
        assert!(r.is_ok(), "the simulated backend cannot fail a submit");
        if wait {
            self.sim.parked_at = Some(self.cx.ops.now());
            return self.cx.backend.in_flight() > 0;
        }
        self.finish_pass(false, r);
        true
    }

    /// For the simulator: where this worker's `run` loop ended, if it did: exited, or gave up
    /// (and runs on only for the simulator's checks).
    #[cfg(any(test, feature = "sim"))]
    pub fn stopped(&self) -> Option<Stopped> {
        self.sim.outcome
    }

    /// For the simulator, once idle: nothing leaked (ops, queue room, in-flight counts, and
    /// what the layout holds).
    #[cfg(any(test, feature = "sim"))]
    pub fn check_quiet(&self) -> Result<(), String> {
        let c = &self.cx;
        let live = c.ops.live();
        let queued =
            c.me.queued_blocks
                .load(std::sync::atomic::Ordering::Acquire);
        let checks = [
            (
                live == 0,
                format!(
                    "{live} ops still live ({})",
                    c.ops
                        .live_indexes()
                        .iter()
                        .take(4)
                        .map(|&i| self.layout.describe_op(c, i))
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            ),
            (
                queued == 0,
                format!("{queued} blocks of queue room not given back"),
            ),
            (
                c.sched.loads_in_flight() == 0,
                format!("{} loads counted in flight", c.sched.loads_in_flight()),
            ),
            (
                c.sched.store_bytes_in_flight() == 0,
                format!(
                    "{} store bytes counted in flight",
                    c.sched.store_bytes_in_flight()
                ),
            ),
            (c.idle(), "queues or in-flight I/O left".to_owned()),
        ];
        if let Some((_, why)) = checks.into_iter().find(|(ok, _)| !ok) {
            return Err(why);
        }
        if let Some(d) = &c.demote {
            d.check_quiet()?;
        }
        self.layout.check_quiet(c)
    }

    /// One turn of the loop without submitting or sleeping; true if anything moved.
    fn turn(&mut self) -> bool {
        let mut progress = self.intake();
        progress |= self.cx.demote.as_mut().is_some_and(Demote::reclaim);
        progress |= self.reap();
        progress |= self.expire_overdue();
        progress |= self.layout.unstall(&mut self.cx);
        progress |= self.issue_loads();
        progress |= self.issue_stores();
        progress |= self.layout.background(&mut self.cx);
        progress
    }
}
