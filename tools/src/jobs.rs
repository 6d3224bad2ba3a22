//! The tools' one job driver: streams of jobs kept in flight on an engine, each key of a job
//! on a region block of its own. Jobs are of one block unless the driver is built with more
//! ([`Driver::with_blocks_per_job`]: `--blocks-per-job` of `kvtier bench` and `fio-compare`, as
//! vLLM's tier submits one job per transfer). `kvtier bench` and `fio-compare` run their phases
//! through it (a load and a store stream at the queue depth, counted in blocks), the cold bench
//! its passes and its latency phase (an NVMe stream at depth 1 beside an S3 stream), `kvtier
//! get`/`put` one job, and `kvtier inspect --verify` one load per block ([`run_each`],
//! [`run_one`]).
//!
//! Invariant: a region block belongs to at most one job in flight. Blocks come from the
//! driver's pool (in groups of the job size) and go back to it only when the job's result
//! arrives, so no caller touches memory the engine may be reading or writing. A full engine
//! queue stops a stream until results arrive: the driver waits for them, never spins; a job it
//! could not queue is kept and offered again (its keys are taken).

use std::time::{Duration, Instant};

use kvtier::{Engine, Job, JobFailure, JobKind, JobResult, Key};

use crate::interrupt;
use crate::output::{CliError, CliResult};

/// What a run's streams are: where each job's key comes from, what its block holds before it
/// is submitted, and what happens with its result. Stream `s` is `0..streams().len()`; lower
/// streams are topped up first.
pub(crate) trait Jobs {
    /// Each stream's job kind and how many of its jobs may be in flight at once.
    fn streams(&self) -> &[(JobKind, usize)];
    /// The key of stream `s`'s next job, or `None` if it has none to offer now.
    fn next_key(&mut self, s: usize) -> Option<Key>;
    /// Fills (a store) or poisons (a load) `block` for the job about to be submitted.
    fn prepare(&mut self, s: usize, block: u32);
    /// The key `next_key` offered is taken, on `block`; the next offer moves on. A key is
    /// taken when its job is made, before the engine queues the job (which the driver retries
    /// after backpressure until it does).
    fn submitted(&mut self, s: usize, block: u32);
    /// Whether stream `s` will offer more jobs: the run ends when none will and no job is in
    /// flight.
    fn has_work(&self, s: usize) -> bool;
    /// The key of stream `s` on `block` finished (its share of its job's result); an error
    /// stops the run.
    fn done(&mut self, s: usize, block: u32, r: KeyResult<'_>) -> CliResult<()>;
    /// Called after every wait for results (a progress display).
    fn tick(&mut self) {}
}

/// One key's share of its job's result: the key at `index` of `job`.
#[derive(Clone, Copy)]
pub(crate) struct KeyResult<'r> {
    pub job: &'r JobResult,
    pub index: usize,
}

impl KeyResult<'_> {
    /// Why this key failed, if it did.
    pub(crate) fn failure(&self) -> Option<&JobFailure> {
        if self.job.success {
            return None;
        }
        self.job.failures.iter().find(|f| f.key_index == self.index)
    }

    pub(crate) fn success(&self) -> bool {
        self.failure().is_none()
    }

    /// The bytes this key moved: its share of the job's (every key is one block).
    pub(crate) fn bytes(&self) -> u64 {
        if !self.success() {
            return 0;
        }
        let ok = self
            .job
            .keys_total
            .saturating_sub(self.job.failures.len())
            .max(1);
        self.job.bytes / ok as u64
    }
}

/// The longest wait for a result while every stream is full: how late an interrupt or a
/// stall is noticed then.
const IDLE_WAIT: Duration = Duration::from_millis(100);

/// Jobs in flight on one engine over a pool of region blocks.
pub(crate) struct Driver<'e> {
    engine: &'e Engine,
    /// Blocks a job's keys go to: group `g` is `groups[g * per_job..][..per_job]`.
    groups: Vec<u32>,
    per_job: usize,
    /// Free groups; the last one freed is used first (it is warm in cache).
    free: Vec<u32>,
    /// By group: the stream, sequence number and key count of the job on it.
    on_group: Vec<Option<(usize, u64, usize)>>,
    /// By stream: a job of several keys made and not yet queued (backpressure), its group and
    /// keys.
    pending: Vec<Option<(u32, Vec<Key>)>>,
    next_seq: u64,
    results: Vec<JobResult>,
    wait: Duration,
}

/// When a run stops submitting.
#[derive(Clone, Copy, Default)]
pub(crate) struct Limits {
    /// No job is submitted after this; the run then waits for those in flight.
    pub until: Option<Instant>,
    /// A run that gets no result for this long fails.
    pub stall: Option<Duration>,
}

impl<'e> Driver<'e> {
    /// A driver of one-block jobs over region blocks `blocks` that waits up to `wait` for
    /// results at a time.
    pub(crate) fn new(engine: &'e Engine, blocks: &[u32], wait: Duration) -> Driver<'e> {
        Driver::with_blocks_per_job(engine, blocks, wait, 1)
    }

    /// A driver of jobs of up to `per_job` keys (one per block), over groups of that many of
    /// `blocks` (the blocks left over when `blocks` is not a multiple go unused).
    pub(crate) fn with_blocks_per_job(
        engine: &'e Engine,
        blocks: &[u32],
        wait: Duration,
        per_job: usize,
    ) -> Driver<'e> {
        assert!(per_job >= 1, "a job has at least one block");
        let groups: Vec<u32> = blocks[..blocks.len() / per_job * per_job].to_vec();
        let count = groups.len() / per_job;
        Driver {
            engine,
            groups,
            per_job,
            free: (0..count as u32).rev().collect(),
            on_group: vec![None; count],
            pending: Vec::new(),
            next_seq: 0,
            results: Vec::with_capacity(count),
            wait,
        }
    }

    fn group(&self, g: u32) -> &[u32] {
        &self.groups[g as usize * self.per_job..][..self.per_job]
    }

    /// Runs `jobs` until no stream has work (or `limits.until` passes, or an interrupt) and
    /// every job submitted has finished. A stream's depth counts blocks (keys) in flight.
    pub(crate) fn run(&mut self, jobs: &mut dyn Jobs, limits: Limits) -> CliResult<()> {
        let streams = jobs.streams().to_vec();
        let mut in_flight = vec![0usize; streams.len()];
        assert!(
            streams
                .iter()
                .map(|&(_, d)| d.div_ceil(self.per_job))
                .sum::<usize>()
                <= self.free.len(),
            "the pool has a group of blocks for every job the streams may keep in flight"
        );
        self.pending = vec![None; streams.len()];
        let mut last_result = Instant::now();
        loop {
            let open = !interrupt::requested() && limits.until.is_none_or(|t| Instant::now() < t);
            for (s, &(kind, depth)) in streams.iter().enumerate() {
                // A job already made is queued even once the run closes: its keys are taken.
                while self.pending[s].is_some() || (open && in_flight[s] < depth) {
                    match self.submit(jobs, s, kind, depth - in_flight[s].min(depth))? {
                        Queued::Keys(n) => in_flight[s] += n,
                        Queued::Nothing => break,
                    }
                }
            }
            let busy = in_flight.iter().any(|&n| n > 0) || self.pending.iter().any(Option::is_some);
            if !busy && (!open || !(0..streams.len()).any(|s| jobs.has_work(s))) {
                return Ok(());
            }
            // With every stream full (or out of work), nothing can happen before a result
            // arrives, and the wait ends at the first one: sleep long. A stream that wants to
            // submit and could not (backpressure, no key yet) polls at the short wait. A
            // short wait with nothing to do costs CPU per unit of time, not per job, and so
            // more per GiB the slower the device.
            let stuck = self.pending.iter().any(Option::is_some)
                || (open
                    && (0..streams.len()).any(|s| in_flight[s] < streams[s].1 && jobs.has_work(s)));
            let wait = if stuck { self.wait } else { IDLE_WAIT };
            self.results.clear();
            if self.engine.wait_finished(&mut self.results, wait) > 0 {
                last_result = Instant::now();
            } else if let Some(limit) = limits.stall.filter(|&l| busy && last_result.elapsed() > l)
            {
                return Err(CliError::runtime(format!(
                    "no job finished for {} s",
                    limit.as_secs()
                )));
            }
            let mut results = std::mem::take(&mut self.results);
            for r in &results {
                let g = (r.id & u64::from(u32::MAX)) as u32;
                let (s, seq, keys) = self.on_group[g as usize].take().expect(
                    "each result is for a job this driver submitted and has not seen finish",
                );
                assert_eq!(seq, r.id >> 32, "the result is for the job on its blocks");
                assert_eq!(keys, r.keys_total, "the result covers the job's keys");
                in_flight[s] -= keys;
                let mut outcome = Ok(());
                for index in 0..keys {
                    let block = self.group(g)[index];
                    let o = jobs.done(s, block, KeyResult { job: r, index });
                    outcome = outcome.and(o);
                }
                self.free.push(g);
                outcome?;
            }
            results.clear();
            self.results = results;
            jobs.tick();
        }
    }

    /// Queues stream `s`'s pending job, or makes one of up to `room` keys on a free group and
    /// queues it. `Nothing` when no key was offered, or on backpressure (the job then stays
    /// pending, its keys taken, and is offered again after the next results).
    fn submit(
        &mut self,
        jobs: &mut dyn Jobs,
        s: usize,
        kind: JobKind,
        room: usize,
    ) -> CliResult<Queued> {
        let made = match self.pending[s].take() {
            Some(p) => Some(p),
            None => self.make_job(jobs, s, room),
        };
        let Some((g, keys)) = made else {
            return Ok(Queued::Nothing);
        };
        let seq = self.next_seq;
        assert!(
            seq < 1 << 32,
            "job sequence numbers fit the id's upper half"
        );
        let blocks = self.group(g)[..keys.len()].to_vec();
        let n = keys.len();
        let first = keys[0];
        let job = Job::new((seq << 32) | u64::from(g), keys.clone(), blocks);
        let submitted = match kind {
            JobKind::Load => self.engine.submit_load(job),
            JobKind::Store => self.engine.submit_store(job),
        };
        match submitted {
            Ok(()) => {
                self.next_seq += 1;
                self.on_group[g as usize] = Some((s, seq, n));
                Ok(Queued::Keys(n))
            }
            Err(kvtier::Error::Backpressure(why)) => {
                tracing::debug!(%why, "backpressure: waiting for results before resubmitting");
                self.pending[s] = Some((g, keys));
                Ok(Queued::Nothing)
            }
            Err(e) => {
                self.free.push(g);
                Err(CliError::from(e).context(format!("key {}", first.to_hex())))
            }
        }
    }

    /// A job of up to `room` (and the job size) of stream `s`'s keys on a free group, each
    /// key's block prepared and the key taken ([`Jobs::submitted`]); `None` when no group is
    /// free or no key is offered.
    fn make_job(&mut self, jobs: &mut dyn Jobs, s: usize, room: usize) -> Option<(u32, Vec<Key>)> {
        let g = self.free.pop()?;
        let want = room.min(self.per_job);
        let mut keys = Vec::with_capacity(want);
        while keys.len() < want {
            let Some(key) = jobs.next_key(s) else { break };
            let block = self.group(g)[keys.len()];
            jobs.prepare(s, block);
            keys.push(key);
            jobs.submitted(s, block);
        }
        if keys.is_empty() {
            self.free.push(g);
            return None;
        }
        Some((g, keys))
    }
}

/// What [`Driver::submit`] queued.
enum Queued {
    Nothing,
    Keys(usize),
}

/// One job per key, in key order, through [`run_each`]'s callbacks.
struct Each<'k, P, D> {
    kinds: [(JobKind, usize); 1],
    keys: &'k [Key],
    next: usize,
    /// By block: the index of the key whose job is on it.
    holder: Vec<usize>,
    prepare: P,
    done: D,
}

impl<P, D> Jobs for Each<'_, P, D>
where
    P: FnMut(usize, u32),
    D: FnMut(usize, u32, &JobResult) -> CliResult<()>,
{
    fn streams(&self) -> &[(JobKind, usize)] {
        &self.kinds
    }

    fn next_key(&mut self, _: usize) -> Option<Key> {
        self.keys.get(self.next).copied()
    }

    fn prepare(&mut self, _: usize, block: u32) {
        (self.prepare)(self.next, block);
    }

    fn submitted(&mut self, _: usize, block: u32) {
        self.holder[block as usize] = self.next;
        self.next += 1;
    }

    fn has_work(&self, _: usize) -> bool {
        self.next < self.keys.len()
    }

    fn done(&mut self, _: usize, block: u32, r: KeyResult<'_>) -> CliResult<()> {
        (self.done)(self.holder[block as usize], block, r.job)
    }
}

/// Runs one `kind` job of one block per key of `keys`, as many in flight as `blocks` has
/// blocks (each job takes a free one). `prepare(i, block)` runs before job `i` is submitted
/// (a store fills its block there); `done(i, block, result)` runs when its result arrives,
/// before the block is reused, and may stop the run with an error. With `stall`, a run that
/// gets no result for that long fails. Returns the seconds the run took.
pub(crate) fn run_each(
    engine: &Engine,
    kind: JobKind,
    keys: &[Key],
    blocks: &[u32],
    stall: Option<Duration>,
    prepare: impl FnMut(usize, u32),
    done: impl FnMut(usize, u32, &JobResult) -> CliResult<()>,
) -> CliResult<f64> {
    assert!(!blocks.is_empty(), "run_each needs at least one block");
    let started = Instant::now();
    let mut each = Each {
        kinds: [(kind, blocks.len())],
        keys,
        next: 0,
        holder: vec![0; blocks.iter().max().map_or(0, |&b| b as usize + 1)],
        prepare,
        done,
    };
    Driver::new(engine, blocks, Duration::from_millis(20))
        .run(&mut each, Limits { until: None, stall })?;
    Ok(started.elapsed().as_secs_f64())
}

/// Runs one `kind` job of `key` on region block 0 and returns its result (`stall`: how long
/// without one is an error).
pub(crate) fn run_one(
    engine: &Engine,
    kind: JobKind,
    key: Key,
    stall: Duration,
) -> CliResult<JobResult> {
    let mut out = None;
    run_each(
        engine,
        kind,
        &[key],
        &[0],
        Some(stall),
        |_, _| {},
        |_, _, r| {
            out = Some(r.clone());
            Ok(())
        },
    )
    .map_err(|e| e.context(format!("key {}", key.to_hex())))?;
    Ok(out.expect("the one job's result arrived"))
}
