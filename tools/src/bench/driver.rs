//! The job driver: phases of store and load jobs kept at the queue depth on one engine, each
//! block from a free list, every result checked and tallied.

use super::*;
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stream {
    Load = 0,
    Store = 1,
}

impl Stream {
    pub(super) fn of(kind: JobKind) -> Stream {
        match kind {
            JobKind::Load => Stream::Load,
            JobKind::Store => Stream::Store,
        }
    }
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
    pub(super) bench_cpu_seconds: f64,
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
            verified_blocks: t.verified,
            corrupt_blocks: t.corrupt,
            missed_blocks: t.missed,
            failed_blocks: t.failed,
            block_size: config.block_size,
            queue_depth,
            bench_cpu_seconds: self.bench_cpu_seconds,
            lookup_skips: t.lookup_skips,
            cpu_scope: if shared_phase { "phase" } else { "workload" },
        }
    }
}

/// A job the bench has submitted and not yet seen finish; indexed by its region block.
#[derive(Clone, Copy)]
pub(super) struct InFlight {
    pub(super) kind: JobKind,
    pub(super) key: u64,
    pub(super) seq: u64,
}

pub(super) struct Bench<'e> {
    pub(super) engine: &'e Engine,
    pub(super) region: &'e Region,
    pub(super) data: Patterns,
    pub(super) block_bytes: usize,
    pub(super) queue_depth: usize,
    pub(super) free: Vec<u32>,
    pub(super) in_flight: Vec<Option<InFlight>>,
    pub(super) next_seq: u64,
    pub(super) results: Vec<JobResult>,
    pub(super) rng: Rng,
    /// Keys whose store succeeded, oldest first; loads pick among them.
    pub(super) pool: VecDeque<u64>,
    /// Bound on `pool`: more keys than slots cannot all be stored.
    pub(super) pool_max: usize,
    pub(super) next_store_key: u64,
    pub(super) show_progress: bool,
}

impl<'e> Bench<'e> {
    pub(super) fn new(
        engine: &'e Engine,
        region: &'e Region,
        block_bytes: usize,
        queue_depth: usize,
        region_blocks: u32,
        slots_total: usize,
        check: Check,
    ) -> Bench<'e> {
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
        Bench {
            engine,
            region,
            data,
            block_bytes,
            queue_depth,
            free: (0..region_blocks).rev().collect(),
            in_flight: vec![None; region_blocks as usize],
            next_seq: 0,
            results: Vec::with_capacity(2 * queue_depth),
            rng: Rng::new(SEED ^ 0x5eed),
            pool: VecDeque::with_capacity(slots_total.min(1 << 20)),
            pool_max: slots_total.max(1),
            next_store_key: 0,
            show_progress: std::io::stderr().is_terminal(),
        }
    }

    pub(super) fn run_phase(&mut self, phase: &Phase) -> CliResult<PhaseOutcome> {
        let bar = self.progress_bar(phase);
        let cpu_before = self.engine.stats().worker_cpu_seconds;
        let bench_before = thread_cpu_time();
        let start = Instant::now();
        let mut tallies = [Tally::default(), Tally::default()];
        let mut last_draw = start;
        loop {
            let open =
                !interrupt::requested() && phase.duration.is_none_or(|d| start.elapsed() < d);
            if open {
                self.submit_more(phase, &mut tallies)?;
            }
            let in_flight: usize = tallies.iter().map(|t| t.in_flight).sum();
            if in_flight == 0 && (!open || !self.has_work(phase)) {
                break;
            }
            self.engine.wait_finished(&mut self.results, WAIT);
            let mut results = std::mem::take(&mut self.results);
            for r in results.drain(..) {
                self.complete(&r, &mut tallies);
            }
            self.results = results;
            if last_draw.elapsed() >= PROGRESS_EVERY {
                last_draw = Instant::now();
                Bench::draw(&bar, phase, start, &tallies);
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        bar.finish_and_clear();
        Ok(PhaseOutcome {
            seconds,
            cpu_seconds: (self.engine.stats().worker_cpu_seconds - cpu_before).max(0.0),
            bench_cpu_seconds: thread_cpu_time().saturating_sub(bench_before).as_secs_f64(),
            tallies,
        })
    }

    pub(super) fn has_work(&self, phase: &Phase) -> bool {
        let stores = match phase.store {
            Some(StoreUntil::Key(end)) => self.next_store_key < end,
            Some(StoreUntil::Deadline) => true,
            None => false,
        };
        stores || (phase.load && !self.pool.is_empty())
    }

    /// Tops both streams up to the queue depth, loads first. Stops a stream at backpressure.
    pub(super) fn submit_more(&mut self, phase: &Phase, tallies: &mut [Tally; 2]) -> CliResult<()> {
        if phase.load {
            let tally = &mut tallies[Stream::Load as usize];
            while tally.in_flight < self.queue_depth {
                let Some(key) = self.pick_load_key(tally) else {
                    break;
                };
                let block = self
                    .free
                    .pop()
                    .expect("the region has a block per job in flight");
                self.data.poison(self.region, self.offset(block));
                if !self.submit(JobKind::Load, key, block)? {
                    self.free.push(block);
                    break;
                }
                tally.in_flight += 1;
            }
        }
        if let Some(until) = phase.store {
            let tally = &mut tallies[Stream::Store as usize];
            while tally.in_flight < self.queue_depth {
                if let StoreUntil::Key(end) = until {
                    if self.next_store_key >= end {
                        break;
                    }
                }
                let key = self.next_store_key;
                let block = self
                    .free
                    .pop()
                    .expect("the region has a block per job in flight");
                self.data.store_into(self.region, self.offset(block), key);
                if !self.submit(JobKind::Store, key, block)? {
                    self.free.push(block);
                    break;
                }
                self.next_store_key += 1;
                tally.in_flight += 1;
            }
        }
        Ok(())
    }

    /// A random stored key the index still holds; candidates it no longer holds leave the pool.
    pub(super) fn pick_load_key(&mut self, tally: &mut Tally) -> Option<u64> {
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

    /// `Ok(false)` on backpressure (nothing was queued).
    pub(super) fn submit(&mut self, kind: JobKind, key: u64, block: u32) -> CliResult<bool> {
        let seq = self.next_seq;
        assert!(
            seq < 1 << 32,
            "job sequence numbers fit the id's upper half"
        );
        let id = (seq << 32) | u64::from(block);
        let job = Job::new(id, vec![key_of(key)], vec![block]);
        let submitted = match kind {
            JobKind::Load => self.engine.submit_load(job),
            JobKind::Store => self.engine.submit_store(job),
        };
        match submitted {
            Ok(()) => {
                self.next_seq += 1;
                let slot = &mut self.in_flight[block as usize];
                assert!(slot.is_none(), "block {block} is already in flight");
                *slot = Some(InFlight { kind, key, seq });
                Ok(true)
            }
            Err(kvtier::Error::Backpressure(why)) => {
                tracing::debug!(%why, "backpressure: waiting for results before resubmitting");
                Ok(false)
            }
            Err(e) => Err(CliError::from(e).context("submitting a job")),
        }
    }

    pub(super) fn complete(&mut self, r: &JobResult, tallies: &mut [Tally; 2]) {
        let block = (r.id & u64::from(u32::MAX)) as u32;
        let job = self.in_flight[block as usize]
            .take()
            .expect("each result is for a job this bench submitted and has not seen finish");
        assert_eq!(
            job.seq,
            r.id >> 32,
            "result id matches the job in flight on its block"
        );
        let tally = &mut tallies[Stream::of(job.kind) as usize];
        tally.in_flight -= 1;
        let offset = self.offset(block);
        if r.success {
            tally.ok_blocks += 1;
            tally.bytes += r.bytes;
            tally.record_latency(r.elapsed.as_micros() as u64, &mut self.rng);
            match job.kind {
                JobKind::Load => match self.data.first_mismatch(self.region, offset, job.key) {
                    None => tally.verified += 1,
                    Some(at) => {
                        tally.corrupt += 1;
                        tracing::error!(
                            key = job.key,
                            block,
                            first_bad_byte = at,
                            "CORRUPT: loaded block differs from what was stored under this key"
                        );
                    }
                },
                JobKind::Store => {
                    self.pool.push_back(job.key);
                    if self.pool.len() > self.pool_max {
                        self.pool.pop_front();
                    }
                }
            }
        } else {
            let failure = r.failure();
            if job.kind == JobKind::Load && failure.is_some_and(|f| f.reason == KeyFailure::Miss) {
                tally.missed += 1;
            } else {
                tally.failed += 1;
                if tally.failed <= FAILURES_LOGGED_MAX {
                    tracing::warn!(
                        kind = ?job.kind,
                        key = job.key,
                        reason = failure.map_or_else(|| "unknown".into(), |f| f.reason.to_string()),
                        detail = failure.map_or("", |f| f.detail.as_str()),
                        "job failed"
                    );
                }
            }
        }
        self.free.push(block);
    }

    pub(super) fn offset(&self, block: u32) -> usize {
        block as usize * self.block_bytes
    }

    pub(super) fn progress_bar(&self, phase: &Phase) -> ProgressBar {
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

    pub(super) fn draw(bar: &ProgressBar, phase: &Phase, start: Instant, tallies: &[Tally; 2]) {
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
