//! One worker: a thread pinned to one CPU core, owning one I/O queue (ring), the index entries of
//! the keys that hash to it and its share of every device. [`Worker`] holds everything the
//! layouts have in common — the run loop, intake, the queues, the [`Scheduler`], store chunking,
//! load and store reporting — and a [`Layout`] (the slab, or the files directory) decides what
//! a load or a store is on the device.
//!
//! ```text
//! engine ──Msg──► intake ─► loads / stores queues
//!                  turn:  reap CQEs ─► layout.on_complete, or the chunk accounting of a store
//!                         layout.unstall (ops that found the SQ full)
//!                         issue loads   ─► layout.start_load   (while the scheduler allows)
//!                         issue stores  ─► layout.start_store  ─► chunks ─► layout.push_chunk
//!                         layout.background (slot table pages)
//!                  submit, or sleep in the ring until a CQE or a nudge; layout.after_submit
//! ```
//!
//! Invariants: an op's memory (a region block, a table page, a staging slot) is not reused
//! before its completion is reaped; the worker exits only when no op is in flight; every key of
//! every part it took is reported exactly once.

mod context;
pub(crate) mod demote;
pub(crate) mod ops;
pub(crate) mod published;
pub(crate) mod queue;
pub(crate) mod sched;
pub(crate) mod shared;
pub(crate) mod unindexed;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use crate::clock::Clock;
use crate::io::{Completion, IoBackend, Region};
use crate::job::{JobKind, JobState, KeyFailure, Shared};
use crate::key::Key;
use crate::Errno;

pub(crate) use self::context::{io_outcome, Context};
use self::context::{FAILURE_WINDOW_DEADLINES, FAIL_AFTER_TIMEOUTS};
pub(crate) use demote::{Demote, DemoteSink, Demotion};
pub(crate) use ops::{OpTable, TableOp};
pub(crate) use published::Publisher;
pub(crate) use queue::{fail_left_behind, Msg, Part, Removed, WorkQueue};
pub(crate) use sched::{Chunks, Scheduler};
pub(crate) use shared::WorkerShared;
use shared::{awake, ready_to_sleep};
use unindexed::Unindexed;

use std::sync::atomic::Ordering;

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

/// Why a layout frees a stored key (slab slot, or file): for the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Removal {
    /// To make room.
    Evicted,
    /// The caller asked ([`crate::Engine::remove`]).
    Asked,
}

impl Removal {
    /// Counts one on device metrics `m` (`evictions` or `removals`).
    pub(crate) fn count(self, m: &crate::metrics::DeviceMetrics) {
        match self {
            Removal::Evicted => &m.evictions,
            Removal::Asked => &m.removals,
        }
        .fetch_add(1, Ordering::Relaxed);
    }
}

/// What starting a load or a store did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Start {
    /// I/O was queued for a store's key.
    Started,
    /// I/O was queued for a load's key as op `idx`: the worker counts one more load in flight
    /// until the op is released ([`Context::release`]) or its load ended ([`Context::end_load`]).
    Loading(u32),
    /// The key was answered without I/O (a miss, already stored, a clear failure).
    Resolved,
    /// No room now (ring, op table, space being freed): try again next turn.
    Blocked,
}

/// What a layout's op offers the worker.
pub(crate) trait LayoutOp: TableOp {
    /// The chunk plan of a store whose data write is under way; `None` for any other op or step.
    fn writing(&mut self) -> Option<&mut Chunks>;

    /// The device the op runs on.
    fn device(&self) -> usize;
}

/// What a device layout does; the worker does the rest. Every method runs on the worker thread
/// and must not block (I/O goes through `cx.backend()`).
pub(crate) trait Layout {
    type Op: LayoutOp;

    /// Starts loading `item` of `job` into its region block.
    fn start_load(&mut self, cx: &mut Context<Self::Op>, job: &Arc<JobState>, item: usize)
        -> Start;

    /// Starts storing `item` of `job`; `retried`: a second try after evicting (ENOSPC). A store
    /// that is ready to write its data calls [`Context::begin_writing`].
    fn start_store(
        &mut self,
        cx: &mut Context<Self::Op>,
        job: &Arc<JobState>,
        item: usize,
        retried: bool,
    ) -> Start;

    /// Pushes the write of bytes `start..start + len` of store `idx`'s block (chunk `chunk`);
    /// false if the submission queue is full.
    fn push_chunk(
        &mut self,
        cx: &mut Context<Self::Op>,
        idx: u32,
        chunk: u16,
        start: u64,
        len: u64,
    ) -> bool;

    /// Every chunk of store `idx` completed (`failure`: the first that failed, or the stop).
    fn on_written(
        &mut self,
        cx: &mut Context<Self::Op>,
        idx: u32,
        failure: Option<(KeyFailure, String)>,
    );

    /// A completion of any op that is not a store's data write.
    fn on_complete(&mut self, cx: &mut Context<Self::Op>, idx: u32, result: i32);

    /// The caller used `key`: keep it longer.
    fn touch(&mut self, key: Key);

    /// Every key stored (published) now.
    fn keys(&self) -> Vec<Key>;

    /// Removes `key` if it is stored and no I/O is reading it: unpublished and its slot or
    /// file freed as an eviction frees it (without demotion to the cold tier), a removed event
    /// sent. False when it is not stored here or busy.
    fn remove(&mut self, cx: &mut Context<Self::Op>, key: Key) -> bool;

    /// Finds out whether `keys` (not indexed here) are on the devices, and answers in
    /// `cx.unindexed` (each with its question's generation); a key found is indexed and
    /// published. Only the files layout is asked; by default every key is absent.
    fn probe(&mut self, cx: &mut Context<Self::Op>, keys: Vec<(Key, u64)>) {
        for (key, generation) in keys {
            cx.unindexed
                .answer(key, generation, crate::verdicts::Verdict::Absent);
            cx.me.probes_outstanding.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Pushes what earlier found the submission queue full; true if anything moved.
    fn unstall(&mut self, cx: &mut Context<Self::Op>) -> bool {
        let _ = cx;
        false
    }

    /// The layout's own work after loads and stores were issued (table pages); true if any.
    fn background(&mut self, cx: &mut Context<Self::Op>) -> bool {
        let _ = cx;
        false
    }

    /// Runs after each submit: work that must not delay the next I/O (checksums of finished
    /// stores).
    fn after_submit(&mut self, cx: &mut Context<Self::Op>) {
        let _ = cx;
    }

    /// Whether the layout has nothing left to do (the worker may exit when stopping).
    fn idle(&self) -> bool;

    /// Names op `idx` for an error message: the device (path) and the operation.
    fn describe_op(&self, cx: &Context<Self::Op>, idx: u32) -> String;

    /// Names device `d` for a log line (`devices[d]` and its path).
    fn device_name(&self, d: usize) -> String;

    /// The callers' keys that op `idx`, past its deadline, keeps waiting: each with whether the
    /// op may still move bytes of its region block (then the job's lease is held until the op
    /// completes). Empty for the layout's own I/O that no key waits on.
    fn overdue_keys(&self, cx: &Context<Self::Op>, idx: u32) -> Vec<(Arc<JobState>, usize, bool)>;

    /// Fails (`KeyFailure::Timeout`) what waited longer than `limit` with no op of its own to
    /// carry a deadline (the slab's stores whose table page write could not be queued); true
    /// if any key failed. Nothing by default.
    fn expire_waiting(
        &mut self,
        cx: &mut Context<Self::Op>,
        now: Instant,
        limit: Duration,
    ) -> bool {
        let _ = (cx, now, limit);
        false
    }

    /// Device `d` was marked failed (`cx.device_failed(d)` is true from now on): its keys
    /// become misses; new stores go elsewhere or fail.
    fn device_failed(&mut self, cx: &mut Context<Self::Op>, d: usize);

    /// For the simulator, once the worker is idle: what the layout would have leaked.
    #[cfg(any(test, feature = "sim"))]
    fn check_quiet(&self, cx: &Context<Self::Op>) -> Result<(), String>;
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
    /// A worker whose op table is filled with `make()` ops.
    pub fn new(p: WorkerParams, layout: L, make: impl FnMut() -> L::Op) -> Worker<L> {
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
                ops: OpTable::new(capacity, p.clock, make),
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
        let queued = c.me.queued_blocks.load(Ordering::Acquire);
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

    /// Stopping for longer than the deadline with I/O still in flight, and every op of it past
    /// its deadline, so the keys it served have been failed and their jobs reported. Ops
    /// started after the stop (the page writes that flush the slot table, say) have deadlines
    /// of their own: the stop waits for those too.
    fn hung_at_stop(&self) -> bool {
        let now = self.cx.ops.now();
        self.stop_at.is_some_and(|at| {
            now.duration_since(at) > self.cx.io_timeout + overdue_check_interval(self.cx.io_timeout)
        }) && self.cx.backend.in_flight() > 0
            && self.cx.ops.all_overdue()
    }

    /// Fails the keys of ops past their deadline (`KeyFailure::Timeout`); each such op keeps
    /// its job's lease until it completes. True if any key failed.
    fn expire_overdue(&mut self) -> bool {
        let now = self.cx.ops.now();
        if now < self.next_overdue_check {
            return false;
        }
        let limit = self.cx.io_timeout;
        self.next_overdue_check = now + overdue_check_interval(limit);
        let mut any = self.layout.expire_waiting(&mut self.cx, now, limit);
        for idx in self.cx.ops.take_overdue(now, limit) {
            let what = self.layout.describe_op(&self.cx, idx);
            let d = self.cx.ops[idx as usize].device();
            if self.cx.count_timeout(d) {
                tracing::error!(
                    worker = self.cx.id,
                    device = d,
                    "{what}: the device timed out {FAIL_AFTER_TIMEOUTS} times within {} ms and \
                     is marked failed: its keys are misses (served by the S3 tier when there is \
                     one) and new stores go to the other devices. Check it (dmesg, smartctl) and \
                     restart kvtier to use it again",
                    (limit * FAILURE_WINDOW_DEADLINES).as_millis()
                );
                self.layout.device_failed(&mut self.cx, d);
            }
            self.cx
                .me
                .metrics
                .dev(d)
                .io_timeouts
                .fetch_add(1, Ordering::Relaxed);
            let detail = format!(
                "{what}: no completion within io_timeout_ms = {}; the I/O is still in flight \
                 and the job's region blocks stay leased until the device answers",
                limit.as_millis()
            );
            self.cx.log_error(&detail);
            self.cancel(idx);
            for (job, item, hold) in self.layout.overdue_keys(&self.cx, idx) {
                if job.is_resolved(item) {
                    continue;
                }
                if hold {
                    self.cx.ops.hold(idx, &job);
                }
                let m = &self.cx.me.metrics;
                match job.kind {
                    JobKind::Load => m.loads_failed.fetch_add(1, Ordering::Relaxed),
                    JobKind::Store => m.stores_failed.fetch_add(1, Ordering::Relaxed),
                };
                job.fail(&self.cx.shared, item, KeyFailure::Timeout, detail.clone());
                any = true;
            }
        }
        any
    }

    /// Asks the device to cancel op `idx` (past its deadline): every chunk a store issued, or
    /// the op's one request. What a hung file system blocks in io_uring's kernel workers then
    /// completes early and gives its blocks back; I/O already on a device runs on.
    fn cancel(&mut self, idx: u32) {
        let chunks = self.cx.ops[idx as usize].writing().map_or(1, |c| c.issued);
        for chunk in 0..chunks {
            let user_data = self.cx.ops.user_data(idx, chunk);
            // No room in the queue: the op runs on to its own completion, as without a cancel.
            let _ = self.cx.backend.cancel(user_data);
        }
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

    fn intake(&mut self) -> bool {
        let mut any = false;
        while let Ok(msg) = self.rx.try_recv() {
            any = true;
            match msg {
                Msg::Work(part) => {
                    if self.cx.stopping {
                        self.cx.cancel_part(&part);
                        continue;
                    }
                    match part.job.kind {
                        JobKind::Load => self.cx.loads.push(part),
                        JobKind::Store => self.cx.stores.push(part),
                    }
                }
                Msg::Touch(keys) => {
                    for key in keys {
                        self.layout.touch(key);
                    }
                }
                Msg::Keys(reply) => {
                    let _ = reply.send(self.layout.keys());
                }
                Msg::Remove(keys, reply) => {
                    let removed = keys
                        .into_iter()
                        .map(|(i, key)| (i, self.layout.remove(&mut self.cx, key)))
                        .collect();
                    let _ = reply.send(removed);
                }
                Msg::Probe(keys, first) => {
                    let questions = self.cx.questions(keys, first);
                    self.layout.probe(&mut self.cx, questions);
                }
                Msg::Stop => self.stop(),
            }
        }
        any
    }

    /// Fails everything queued and not yet started; stores stop issuing chunks (and fail once
    /// the issued ones complete); I/O in flight runs to completion.
    fn stop(&mut self) {
        self.stop_at.get_or_insert_with(|| self.cx.ops.now());
        let issuing = self.cx.cancel_queued();
        for idx in issuing {
            let chunks = self.cx.ops[idx as usize]
                .writing()
                .expect("an issuing store is writing");
            chunks.fail(KeyFailure::Shutdown, String::new());
            chunks.cut();
            if chunks.finished() {
                let failure = chunks.failure.take();
                self.layout.on_written(&mut self.cx, idx, failure);
            }
        }
    }

    fn reap(&mut self) -> bool {
        let mut out = std::mem::take(&mut self.completions);
        out.clear();
        self.cx.backend.complete(&mut out);
        let any = !out.is_empty();
        for c in &out {
            let (idx, chunk) = self.cx.ops.decode(c.user_data);
            if self.cx.ops[idx as usize].writing().is_some() {
                self.on_chunk_done(idx, chunk, c.result);
            } else {
                self.layout.on_complete(&mut self.cx, idx, c.result);
            }
        }
        self.completions = out;
        any
    }

    fn issue_loads(&mut self) -> bool {
        let mut any = false;
        while self.cx.sched.may_start_load() {
            let Some((job, item)) = self.cx.loads.peek() else {
                break;
            };
            let job = Arc::clone(job);
            match self.layout.start_load(&mut self.cx, &job, item) {
                Start::Loading(idx) => self.cx.load_started(idx),
                Start::Started => unreachable!("a load started as a store"),
                Start::Resolved => {}
                Start::Blocked => break,
            }
            self.cx.loads.take(&self.cx.me);
            any = true;
        }
        any
    }

    fn issue_stores(&mut self) -> bool {
        let mut any = false;
        loop {
            let cx = &mut self.cx;
            let front = cx.store_issuing.front().copied();
            let next_bytes = match front {
                Some(idx) => cx.ops[idx as usize].writing().map_or(0, |c| c.len),
                None => cx.sched.chunk_bytes(),
            };
            if !cx.sched.may_issue_store(next_bytes, !cx.loads.is_empty()) {
                break;
            }
            if let Some(idx) = front {
                if !self.issue_chunk(idx) {
                    break;
                }
                any = true;
                continue;
            }
            let (job, item, retried) = match cx.retry.front() {
                Some((job, item)) => (Arc::clone(job), *item, true),
                None => match cx.stores.peek() {
                    Some((job, item)) => (Arc::clone(job), item, false),
                    None => break,
                },
            };
            match self.layout.start_store(&mut self.cx, &job, item, retried) {
                Start::Loading(_) => unreachable!("a store started as a load"),
                Start::Started | Start::Resolved => {
                    if retried {
                        self.cx.retry.pop_front();
                    } else {
                        self.cx.stores.take(&self.cx.me);
                    }
                    any = true;
                }
                Start::Blocked => break,
            }
        }
        any
    }

    /// Issues the next chunk of store `idx`; false if the ring is full.
    fn issue_chunk(&mut self, idx: u32) -> bool {
        let block_bytes = self.cx.block_bytes;
        let chunks = self.cx.ops[idx as usize]
            .writing()
            .expect("an issuing store is writing");
        let chunk = chunks.issued;
        let (start, len) = chunks.range(chunk, block_bytes);
        if !self.layout.push_chunk(&mut self.cx, idx, chunk, start, len) {
            return false;
        }
        let chunks = self.cx.ops[idx as usize]
            .writing()
            .expect("an issuing store is writing");
        chunks.issued += 1;
        let all = chunks.all_issued();
        self.cx.sched.store_issued(len);
        if all {
            let front = self.cx.store_issuing.pop_front();
            debug_assert_eq!(front, Some(idx));
        }
        true
    }

    fn on_chunk_done(&mut self, idx: u32, chunk: u16, result: i32) {
        // A device error names the op (a full file system is not one: the store evicts or
        // says so).
        let failing = (result < 0
            && crate::metrics::ErrClass::of(Errno::from_raw(-result))
                != crate::metrics::ErrClass::NoSpace)
            .then(|| self.layout.describe_op(&self.cx, idx));
        let cx = &mut self.cx;
        let block_bytes = cx.block_bytes;
        let d = cx.ops[idx as usize].device();
        let chunks = cx.ops[idx as usize].writing().expect("checked by reap");
        let (_, len) = chunks.range(chunk, block_bytes);
        chunks.done += 1;
        let m = cx.me.metrics.dev(d);
        m.write_ops.fetch_add(1, Ordering::Relaxed);
        match io_outcome(result, len) {
            Ok(()) => {
                m.bytes_written.fetch_add(len, Ordering::Relaxed);
                cx.device_ok(d, || self.layout.device_name(d));
            }
            Err(reason) => {
                m.count_result(result, len);
                let detail = match reason {
                    KeyFailure::Io(e) => format!("write: {}", e.desc()),
                    _ => "short write".to_owned(),
                };
                let logged = failing.map(|what| format!("{what}: {detail}"));
                chunks.fail(reason, detail);
                // Stop issuing the rest of a failed block.
                if chunks.cut() {
                    cx.store_issuing.retain(|&i| i != idx);
                }
                if let Some(line) = logged {
                    cx.device_error(d, &line);
                }
            }
        }
        cx.sched.store_done(len);
        let chunks = cx.ops[idx as usize].writing().expect("checked by reap");
        if chunks.finished() {
            let failure = chunks.failure.take();
            self.layout.on_written(&mut self.cx, idx, failure);
        }
    }
}
