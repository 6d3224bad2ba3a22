//! The tools' job driver for one-block jobs: `kvtier get`/`put` (one job), the cold bench's
//! store and load passes and `kvtier inspect --verify` run their jobs through [`run_each`].
//! (`kvtier bench` and `fio-compare` keep phases of jobs at a queue depth with their own
//! latency accounting: [`crate::bench`]'s driver.)
//!
//! Invariant: a region block belongs to at most one job in flight. Blocks come from the given
//! pool and go back to it only when the job's result arrives, so no caller touches memory the
//! engine may be reading or writing. A full engine queue is answered by waiting for results,
//! never by spinning.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvtier::{Engine, Job, JobKind, JobResult, Key};

use crate::output::{CliError, CliResult};

/// How long one wait for results lasts before submitting again.
const WAIT: Duration = Duration::from_millis(20);

/// Runs one `kind` job of one block per key of `keys`, as many in flight as `blocks` has
/// blocks (each job takes a free one). `prepare(i, block)` runs before job `i` is submitted
/// (a store fills its block there); `done(i, block, result)` runs when its result arrives,
/// before the block is reused, and may stop the run with an error. Job ids are the key
/// indexes. With `stall`, a run that gets no result for that long fails. Returns the seconds
/// the run took.
pub(crate) fn run_each(
    engine: &Engine,
    kind: JobKind,
    keys: &[Key],
    blocks: &[u32],
    stall: Option<Duration>,
    mut prepare: impl FnMut(usize, u32),
    mut done: impl FnMut(usize, u32, &JobResult) -> CliResult<()>,
) -> CliResult<f64> {
    assert!(!blocks.is_empty(), "run_each needs at least one block");
    let started = Instant::now();
    let mut free: VecDeque<u32> = blocks.iter().copied().collect();
    let mut holder = vec![0u32; keys.len()];
    let (mut next, mut finished) = (0usize, 0usize);
    let mut last_result = Instant::now();
    let mut results = Vec::new();
    while finished < keys.len() {
        while next < keys.len() {
            let Some(block) = free.pop_front() else { break };
            prepare(next, block);
            let job = Job::new(next as u64, vec![keys[next]], vec![block]);
            let submitted = match kind {
                JobKind::Store => engine.submit_store(job),
                JobKind::Load => engine.submit_load(job),
            };
            match submitted {
                Ok(()) => {
                    holder[next] = block;
                    next += 1;
                }
                Err(kvtier::Error::Backpressure(_)) => {
                    free.push_front(block);
                    break;
                }
                Err(e) => {
                    return Err(CliError::from(e).context(format!("key {}", keys[next].to_hex())))
                }
            }
        }
        results.clear();
        if engine.wait_finished(&mut results, WAIT) > 0 {
            last_result = Instant::now();
        } else if let Some(limit) = stall.filter(|&s| last_result.elapsed() > s) {
            let key = keys[finished.min(keys.len() - 1)].to_hex();
            return Err(CliError::runtime(format!(
                "key {key}: no result after {} s",
                limit.as_secs()
            )));
        }
        for r in &results {
            let i = usize::try_from(r.id).expect("job ids are key indexes");
            done(i, holder[i], r)?;
            free.push_back(holder[i]);
            finished += 1;
        }
    }
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
    )?;
    Ok(out.expect("the one job's result arrived"))
}
