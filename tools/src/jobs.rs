//! The tools' one job driver: streams of one-block jobs kept in flight on an engine, each job
//! on a region block of its own. `kvtier bench` and `fio-compare` run their phases through it
//! (a load and a store stream at the queue depth), the cold bench its passes and its latency
//! phase (an NVMe stream at depth 1 beside an S3 stream), `kvtier get`/`put` one job, and
//! `kvtier inspect --verify` one load per block ([`run_each`], [`run_one`]).
//!
//! Invariant: a region block belongs to at most one job in flight. Blocks come from the
//! driver's pool and go back to it only when the job's result arrives, so no caller touches
//! memory the engine may be reading or writing. A full engine queue stops a stream until
//! results arrive: the driver waits for them, never spins.

use std::time::{Duration, Instant};

use kvtier::{Engine, Job, JobKind, JobResult, Key};

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
    /// The job `next_key` offered is queued on `block`; the next offer moves on.
    fn submitted(&mut self, s: usize, block: u32);
    /// Whether stream `s` will offer more jobs: the run ends when none will and no job is in
    /// flight.
    fn has_work(&self, s: usize) -> bool;
    /// A job of stream `s` on `block` finished; an error stops the run.
    fn done(&mut self, s: usize, block: u32, r: &JobResult) -> CliResult<()>;
    /// Called after every wait for results (a progress display).
    fn tick(&mut self) {}
}

/// The longest wait for a result while every stream is full: how late an interrupt or a
/// stall is noticed then.
const IDLE_WAIT: Duration = Duration::from_millis(100);

/// Jobs in flight on one engine over a pool of region blocks.
pub(crate) struct Driver<'e> {
    engine: &'e Engine,
    /// Free blocks; the last one freed is used first (it is warm in cache).
    free: Vec<u32>,
    /// By block: the stream and sequence number of the job on it.
    on_block: Vec<Option<(usize, u64)>>,
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
    /// A driver over region blocks `blocks` that waits up to `wait` for results at a time.
    pub(crate) fn new(engine: &'e Engine, blocks: &[u32], wait: Duration) -> Driver<'e> {
        let len = blocks.iter().max().map_or(0, |&b| b as usize + 1);
        Driver {
            engine,
            free: blocks.iter().rev().copied().collect(),
            on_block: vec![None; len],
            next_seq: 0,
            results: Vec::with_capacity(blocks.len()),
            wait,
        }
    }

    /// Runs `jobs` until no stream has work (or `limits.until` passes, or an interrupt) and
    /// every job submitted has finished.
    pub(crate) fn run(&mut self, jobs: &mut dyn Jobs, limits: Limits) -> CliResult<()> {
        let streams = jobs.streams().to_vec();
        let mut in_flight = vec![0usize; streams.len()];
        assert!(
            streams.iter().map(|&(_, d)| d).sum::<usize>() <= self.free.len(),
            "the pool has a block for every job the streams may keep in flight"
        );
        let mut last_result = Instant::now();
        loop {
            let open = !interrupt::requested() && limits.until.is_none_or(|t| Instant::now() < t);
            if open {
                for (s, &(kind, depth)) in streams.iter().enumerate() {
                    while in_flight[s] < depth {
                        let Some(key) = jobs.next_key(s) else { break };
                        if !self.submit(jobs, s, kind, key)? {
                            break;
                        }
                        in_flight[s] += 1;
                    }
                }
            }
            let busy = in_flight.iter().any(|&n| n > 0);
            if !busy && (!open || !(0..streams.len()).any(|s| jobs.has_work(s))) {
                return Ok(());
            }
            // With every stream full (or out of work), nothing can happen before a result
            // arrives, and the wait ends at the first one: sleep long. A stream that wants to
            // submit and could not (backpressure, no key yet) polls at the short wait. A
            // short wait with nothing to do costs CPU per unit of time, not per job, and so
            // more per GiB the slower the device.
            let stuck =
                open && (0..streams.len()).any(|s| in_flight[s] < streams[s].1 && jobs.has_work(s));
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
                let block = (r.id & u64::from(u32::MAX)) as u32;
                let (s, seq) = self.on_block[block as usize].take().expect(
                    "each result is for a job this driver submitted and has not seen finish",
                );
                assert_eq!(seq, r.id >> 32, "the result is for the job on its block");
                in_flight[s] -= 1;
                let outcome = jobs.done(s, block, r);
                self.free.push(block);
                outcome?;
            }
            results.clear();
            self.results = results;
            jobs.tick();
        }
    }

    /// Submits stream `s`'s next job on a free block; `Ok(false)` on backpressure (nothing
    /// was queued and the block is free again).
    fn submit(
        &mut self,
        jobs: &mut dyn Jobs,
        s: usize,
        kind: JobKind,
        key: Key,
    ) -> CliResult<bool> {
        let block = self
            .free
            .pop()
            .expect("the pool has a block for every job in flight");
        jobs.prepare(s, block);
        let seq = self.next_seq;
        assert!(
            seq < 1 << 32,
            "job sequence numbers fit the id's upper half"
        );
        let job = Job::new((seq << 32) | u64::from(block), vec![key], vec![block]);
        let submitted = match kind {
            JobKind::Load => self.engine.submit_load(job),
            JobKind::Store => self.engine.submit_store(job),
        };
        match submitted {
            Ok(()) => {
                self.next_seq += 1;
                self.on_block[block as usize] = Some((s, seq));
                jobs.submitted(s, block);
                Ok(true)
            }
            Err(kvtier::Error::Backpressure(why)) => {
                tracing::debug!(%why, "backpressure: waiting for results before resubmitting");
                self.free.push(block);
                Ok(false)
            }
            Err(e) => {
                self.free.push(block);
                Err(CliError::from(e).context(format!("key {}", key.to_hex())))
            }
        }
    }
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

    fn done(&mut self, _: usize, block: u32, r: &JobResult) -> CliResult<()> {
        (self.done)(self.holder[block as usize], block, r)
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
