//! The bench's phases on the tools' job driver ([`crate::jobs`]): a load and a store stream
//! kept at the queue depth on one engine, every result checked and tallied.

use super::*;
use crate::jobs::{self, Driver, Jobs, KeyResult};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stream {
    Load = 0,
    Store = 1,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum StoreUntil {
    /// Store keys up to this one (exclusive), then the phase ends when they have finished.
    Key(u64),
    /// Store new keys until the phase's deadline.
    Deadline,
}

pub(super) struct Phase {
    pub(super) label: &'static str,
    pub(super) load: bool,
    pub(super) store: Option<StoreUntil>,
    /// `None`: run until the store stream reaches its last key.
    pub(super) duration: Option<Duration>,
}

/// What one stream did during one phase.
#[derive(Default)]
pub(super) struct Tally {
    pub(super) in_flight: usize,
    pub(super) ok_blocks: u64,
    pub(super) bytes: u64,
    pub(super) verified: u64,
    pub(super) corrupt: u64,
    pub(super) missed: u64,
    pub(super) failed: u64,
    pub(super) lookup_skips: u64,
    pub(super) latencies_us: Vec<u64>,
    /// Latencies offered to `latencies_us`, kept or not.
    pub(super) latencies_seen: u64,
}

impl Tally {
    /// Reservoir sampling (Vitter's algorithm R) over every latency of the phase.
    pub(super) fn record_latency(&mut self, micros: u64, rng: &mut Rng) {
        self.latencies_seen += 1;
        if self.latencies_us.len() < LATENCY_SAMPLES_MAX {
            self.latencies_us.push(micros);
        } else {
            let slot = rng.next_u64() % self.latencies_seen;
            if let Some(kept) = self.latencies_us.get_mut(slot as usize) {
                *kept = micros;
            }
        }
    }
}

pub(super) struct PhaseOutcome {
    pub(super) seconds: f64,
    pub(super) cpu_seconds: f64,
    pub(super) io_kernel_cpu_seconds: f64,
    pub(super) s3_cpu_seconds: f64,
    pub(super) bench_cpu_seconds: f64,
    /// The workers' device operations, enters and sleeps over the phase.
    pub(super) worker_io: WorkerIo,
    pub(super) tallies: [Tally; 2],
}

impl PhaseOutcome {
    pub(super) fn row(
        &self,
        workload: &'static str,
        stream: Stream,
        config: &Config,
        queue_depth: u32,
        shared_phase: bool,
    ) -> WorkloadRow {
        let t = &self.tallies[stream as usize];
        let mut lat = t.latencies_us.clone();
        lat.sort_unstable();
        let phase_bytes: u64 = self.tallies.iter().map(|t| t.bytes).sum();
        let cpu_bytes = if shared_phase { phase_bytes } else { t.bytes };
        let per_s = |v: f64| {
            if self.seconds > 0.0 {
                v / self.seconds
            } else {
                0.0
            }
        };
        WorkloadRow {
            workload,
            bytes: t.bytes,
            seconds: self.seconds,
            gib_per_s: per_s(output::gib(t.bytes)),
            ops_per_s: per_s(t.ok_blocks as f64),
            p50_us: percentile(&lat, 0.50),
            p99_us: percentile(&lat, 0.99),
            p999_us: percentile(&lat, 0.999),
            cpu_seconds: self.cpu_seconds,
            cpu_s_per_gib: (cpu_bytes > 0).then(|| self.cpu_seconds / output::gib(cpu_bytes)),
            io_kernel_cpu_seconds: self.io_kernel_cpu_seconds,
            s3_cpu_seconds: self.s3_cpu_seconds,
            cpu_s_per_gib_by_thread: (cpu_bytes > 0).then(|| {
                let per = |s: f64| s / output::gib(cpu_bytes);
                ThreadCpu {
                    caller: per(self.bench_cpu_seconds),
                    workers: per(self.cpu_seconds),
                    io_kernel: per(self.io_kernel_cpu_seconds),
                    s3_reactor: per(self.s3_cpu_seconds),
                }
            }),
            verified_blocks: t.verified,
            corrupt_blocks: t.corrupt,
            missed_blocks: t.missed,
            failed_blocks: t.failed,
            block_size: config.block_size,
            queue_depth,
            bench_cpu_seconds: self.bench_cpu_seconds,
            worker_io: self.worker_io,
            lookup_skips: t.lookup_skips,
            cpu_scope: if shared_phase { "phase" } else { "workload" },
        }
    }
}

/// What the bench keeps between phases: the blocks' contents, the keys stored, the rng.
pub(super) struct Bench<'e> {
    pub(super) engine: &'e Engine,
    driver: Driver<'e>,
    state: State<'e>,
}

struct State<'e> {
    engine: &'e Engine,
    region: &'e Region,
    data: Patterns,
    block_bytes: usize,
    queue_depth: usize,
    /// By block: the key number of the job on it.
    key_on_block: Vec<u64>,
    rng: Rng,
    /// Keys whose store succeeded, oldest first; loads pick among them.
    pool: VecDeque<u64>,
    /// Bound on `pool`: more keys than slots cannot all be stored.
    pool_max: usize,
    next_store_key: u64,
    /// Store keys submitted and not finished.
    stores_in_flight: BTreeSet<u64>,
    /// Every key below this one has finished its store (lookup threads read it).
    finished_below: Arc<AtomicU64>,
    /// The key the load stream offered last.
    last_pick: u64,
    show_progress: bool,
}

/// One phase as the job driver runs it: stream 0 loads, stream 1 stores (each at the queue
/// depth, or absent from the phase with depth 0).
struct PhaseJobs<'a, 'e> {
    state: &'a mut State<'e>,
    phase: &'a Phase,
    streams: [(JobKind, usize); 2],
    tallies: [Tally; 2],
    bar: ProgressBar,
    start: Instant,
    last_draw: Instant,
}

impl<'e> Bench<'e> {
    pub(super) fn new(
        engine: &'e Engine,
        region: &'e Region,
        block_bytes: usize,
        depth: Depth,
        region_blocks: u32,
        slots_total: usize,
        check: Check,
    ) -> Bench<'e> {
        let queue_depth = depth.blocks as usize;
        assert!(
            region_blocks as usize >= 2 * queue_depth,
            "the region holds a block for every job of both streams"
        );
        let data = Patterns::new(block_bytes, check);
        if check == Check::Stamps {
            // Stamps-only stores write just the stamps: give every block real content once.
            for block in 0..region_blocks {
                region.write(block as usize * block_bytes, data.pattern(u64::from(block)));
            }
        }
        let blocks: Vec<u32> = (0..region_blocks).collect();
        Bench {
            engine,
            driver: Driver::with_blocks_per_job(engine, &blocks, WAIT, depth.per_job as usize),
            state: State {
                engine,
                region,
                data,
                block_bytes,
                queue_depth,
                key_on_block: vec![0; region_blocks as usize],
                rng: Rng::new(SEED ^ 0x5eed),
                pool: VecDeque::with_capacity(slots_total.min(1 << 20)),
                pool_max: slots_total.max(1),
                next_store_key: 0,
                stores_in_flight: BTreeSet::new(),
                finished_below: Arc::new(AtomicU64::new(0)),
                last_pick: 0,
                show_progress: std::io::stderr().is_terminal(),
            },
        }
    }

    /// Every key below the value has finished its store (succeeded or failed): lookups of
    /// those keys are hits unless the store failed or the block was evicted.
    pub(super) fn finished_below(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.state.finished_below)
    }

    pub(super) fn run_phase(&mut self, phase: &Phase) -> CliResult<PhaseOutcome> {
        let before = self.engine.stats_with_threads();
        let bench_before = thread_cpu_time();
        let start = Instant::now();
        let depth = self.state.queue_depth;
        let mut jobs = PhaseJobs {
            bar: self.state.progress_bar(phase),
            state: &mut self.state,
            phase,
            streams: [
                (JobKind::Load, if phase.load { depth } else { 0 }),
                (
                    JobKind::Store,
                    if phase.store.is_some() { depth } else { 0 },
                ),
            ],
            tallies: [Tally::default(), Tally::default()],
            start,
            last_draw: start,
        };
        let limits = jobs::Limits {
            until: phase.duration.map(|d| start + d),
            stall: None,
        };
        self.driver.run(&mut jobs, limits)?;
        let seconds = start.elapsed().as_secs_f64();
        jobs.bar.finish_and_clear();
        let after = self.engine.stats_with_threads();
        let delta = |f: fn(&kvtier::Stats) -> f64| (f(&after) - f(&before)).max(0.0);
        let count = |f: fn(&kvtier::Stats) -> u64| f(&after).saturating_sub(f(&before));
        Ok(PhaseOutcome {
            seconds,
            cpu_seconds: delta(|s| s.worker_cpu_seconds),
            io_kernel_cpu_seconds: delta(|s| s.thread_cpu.map_or(0.0, |t| t.io_kernel_seconds)),
            s3_cpu_seconds: delta(|s| s.thread_cpu.map_or(0.0, |t| t.s3_reactor_seconds)),
            bench_cpu_seconds: thread_cpu_time().saturating_sub(bench_before).as_secs_f64(),
            worker_io: WorkerIo {
                device_ops: count(|s| s.read_ops + s.write_ops + s.table_writes),
                enters: count(|s| s.submits),
                sleeps: count(|s| s.wakeups),
            },
            tallies: jobs.tallies,
        })
    }
}

impl Jobs for PhaseJobs<'_, '_> {
    fn streams(&self) -> &[(JobKind, usize)] {
        &self.streams
    }

    fn next_key(&mut self, s: usize) -> Option<Key> {
        let k = if s == Stream::Load as usize {
            self.state.pick_load_key(&mut self.tallies[s])?
        } else {
            if let Some(StoreUntil::Key(end)) = self.phase.store {
                if self.state.next_store_key >= end {
                    return None;
                }
            }
            self.state.next_store_key
        };
        Some(key_of(k))
    }

    fn prepare(&mut self, s: usize, block: u32) {
        let st = &mut *self.state;
        let offset = st.offset(block);
        if s == Stream::Load as usize {
            st.data.poison(st.region, offset);
        } else {
            st.data.store_into(st.region, offset, st.next_store_key);
        }
    }

    fn submitted(&mut self, s: usize, block: u32) {
        let st = &mut *self.state;
        st.key_on_block[block as usize] = if s == Stream::Load as usize {
            // The key `next_key` just picked: `pick_load_key` left it in `last_pick`.
            st.last_pick
        } else {
            st.stores_in_flight.insert(st.next_store_key);
            st.next_store_key += 1;
            st.next_store_key - 1
        };
        self.tallies[s].in_flight += 1;
    }

    fn has_work(&self, s: usize) -> bool {
        if s == Stream::Load as usize {
            self.phase.load && !self.state.pool.is_empty()
        } else {
            match self.phase.store {
                Some(StoreUntil::Key(end)) => self.state.next_store_key < end,
                Some(StoreUntil::Deadline) => true,
                None => false,
            }
        }
    }

    fn done(&mut self, s: usize, block: u32, r: KeyResult<'_>) -> CliResult<()> {
        let kind = self.streams[s].0;
        self.state.complete(kind, block, r, &mut self.tallies[s]);
        Ok(())
    }

    fn tick(&mut self) {
        if self.last_draw.elapsed() >= PROGRESS_EVERY {
            self.last_draw = Instant::now();
            State::draw(&self.bar, self.phase, self.start, &self.tallies);
        }
    }
}

impl State<'_> {
    /// A random stored key the index still holds; candidates it no longer holds leave the pool.
    fn pick_load_key(&mut self, tally: &mut Tally) -> Option<u64> {
        let key = self.pick(tally)?;
        self.last_pick = key;
        Some(key)
    }

    fn pick(&mut self, tally: &mut Tally) -> Option<u64> {
        for _ in 0..LOOKUP_TRIES {
            if self.pool.is_empty() {
                return None;
            }
            let i = (self.rng.next_u64() % self.pool.len() as u64) as usize;
            let key = self.pool[i];
            if self.engine.lookup(&[key_of(key)])[0] != Lookup::Miss {
                return Some(key);
            }
            self.pool.remove(i);
            tally.lookup_skips += 1;
        }
        // Give up filtering: load the newest key and count what happens.
        self.pool.back().copied()
    }

    fn complete(&mut self, kind: JobKind, block: u32, r: KeyResult<'_>, tally: &mut Tally) {
        let key = self.key_on_block[block as usize];
        tally.in_flight -= 1;
        if kind == JobKind::Store {
            self.stores_in_flight.remove(&key);
            let below = self
                .stores_in_flight
                .first()
                .copied()
                .unwrap_or(self.next_store_key);
            self.finished_below.store(below, Ordering::Release);
        }
        let offset = self.offset(block);
        if r.success() {
            tally.ok_blocks += 1;
            tally.bytes += r.bytes();
            tally.record_latency(r.job.elapsed.as_micros() as u64, &mut self.rng);
            match kind {
                JobKind::Load => match self.data.first_mismatch(self.region, offset, key) {
                    None => tally.verified += 1,
                    Some(at) => {
                        tally.corrupt += 1;
                        tracing::error!(
                            key,
                            block,
                            first_bad_byte = at,
                            "CORRUPT: loaded block differs from what was stored under this key"
                        );
                    }
                },
                JobKind::Store => {
                    self.pool.push_back(key);
                    if self.pool.len() > self.pool_max {
                        self.pool.pop_front();
                    }
                }
            }
        } else {
            let failure = r.failure();
            if kind == JobKind::Load && failure.is_some_and(|f| f.reason == KeyFailure::Miss) {
                tally.missed += 1;
            } else {
                tally.failed += 1;
                if tally.failed <= FAILURES_LOGGED_MAX {
                    tracing::warn!(
                        ?kind,
                        key,
                        reason = failure.map_or_else(|| "unknown".into(), |f| f.reason.to_string()),
                        detail = failure.map_or("", |f| f.detail.as_str()),
                        "job failed"
                    );
                }
            }
        }
    }

    fn offset(&self, block: u32) -> usize {
        block as usize * self.block_bytes
    }

    fn progress_bar(&self, phase: &Phase) -> ProgressBar {
        if !self.show_progress {
            return ProgressBar::hidden();
        }
        let (len, template) = match (phase.duration, phase.store) {
            (Some(d), _) => (
                d.as_millis() as u64,
                "{prefix:>10} [{bar:30}] {elapsed} {msg}",
            ),
            (None, Some(StoreUntil::Key(end))) => (
                end.saturating_sub(self.next_store_key),
                "{prefix:>10} [{bar:30}] {pos}/{len} {msg}",
            ),
            (None, _) => (0, "{prefix:>10} {msg}"),
        };
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(phase.label);
        bar
    }

    fn draw(bar: &ProgressBar, phase: &Phase, start: Instant, tallies: &[Tally; 2]) {
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        let rate = |t: &Tally| output::gib(t.bytes) / secs;
        let [load, store] = tallies;
        if phase.duration.is_some() {
            bar.set_position(start.elapsed().as_millis() as u64);
        } else {
            bar.set_position(store.ok_blocks + store.failed);
        }
        let mut msg = String::new();
        if phase.load {
            let _ = write!(msg, "load {:.2} GiB/s ", rate(load));
        }
        if phase.store.is_some() {
            let _ = write!(msg, "store {:.2} GiB/s", rate(store));
        }
        bar.set_message(msg);
    }
}

/// The 36-byte vLLM-shaped key (32-byte hash + group 0) of key number `k`.
pub(super) fn key_of(k: u64) -> Key {
    let mut state = k ^ SEED;
    let mut hash = [0u8; 32];
    for chunk in hash.chunks_exact_mut(8) {
        chunk.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
    }
    Key::vllm(&hash, 0).expect("a 32-byte hash and a group index fit in a key")
}
