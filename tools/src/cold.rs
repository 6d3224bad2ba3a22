//! `kvtier bench --workload cold`: the S3 tier against a configured endpoint.
//!
//! * PUT and GET throughput through the engine (write-through stores; loads of keys held only in
//!   S3, GET straight into the block) next to a plain concurrent aws-sdk-s3 loop against the same
//!   bucket, same object size and concurrency, alternating round by round; medians and ratios.
//! * NVMe load latency (QD1 loads of local blocks) alone, then while an S3 GET stream runs at
//!   `max_concurrency` through the same engine: the cold reactor must not slow the NVMe path.
//!
//! Every loaded block is compared with what was stored. Objects are written under
//! `<prefix>/kvtier-bench-<run>/...` and deleted at the end.

use crate::jobs::{self, Jobs, KeyResult};
use crate::rng::Rng;
use crate::stats::{median, percentile};
use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::config::{S3Write, WriteAck};
use kvtier::{Config, Engine, JobKind, Key, Region};
use serde_json::json;

use crate::output::{self, CliError, CliResult, Human, Table};

/// What the cold bench needs from `kvtier bench`'s arguments.
pub(crate) struct ColdParams<'a> {
    pub scratch: &'a Path,
    /// Objects per round and direction.
    pub objects: u64,
    pub rounds: usize,
    /// Seconds of each latency phase.
    pub latency_seconds: f64,
    pub json: Option<&'a str>,
}

/// The block bytes for object `i` of round `r`: a cheap pattern with the indexes stamped in.
fn pattern(run: u64, r: u64, i: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut rng = Rng::new(run ^ (r << 40) ^ (i << 8));
    while v.len() < len {
        v.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    v.truncate(len);
    v
}

fn key_of(run: u64, r: u64, i: u64) -> Key {
    let mut hash = [0u8; 24];
    hash[..8].copy_from_slice(&run.to_be_bytes());
    hash[8..16].copy_from_slice(&r.to_be_bytes());
    hash[16..].copy_from_slice(&i.to_be_bytes());
    Key::vllm(&hash, 0).expect("24-byte hash")
}

/// The plain loop: aws-sdk-s3 on its own runtime, with the engine's endpoint, credentials and
/// concurrency.
struct Plain {
    rt: tokio::runtime::Runtime,
    client: aws_sdk_s3::Client,
    bucket: String,
    concurrency: usize,
}

impl Plain {
    fn new(s3: &kvtier::config::S3Config) -> CliResult<Plain> {
        use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region as AwsRegion};
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| CliError::runtime(format!("tokio runtime: {e}")))?;
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .region(AwsRegion::new(s3.region.clone()))
            .http_client(http);
        if let (Some(id), Some(secret)) = (&s3.access_key_id, &s3.secret_access_key) {
            loader = loader.credentials_provider(Credentials::new(
                id.expose(),
                secret.expose(),
                s3.session_token.as_ref().map(|t| t.expose().to_owned()),
                None,
                "kvtier-bench",
            ));
        }
        let sdk = rt.block_on(loader.load());
        let mut b = aws_sdk_s3::config::Builder::from(&sdk)
            .force_path_style(s3.force_path_style)
            .request_checksum_calculation(
                aws_sdk_s3::config::RequestChecksumCalculation::WhenRequired,
            )
            .response_checksum_validation(
                aws_sdk_s3::config::ResponseChecksumValidation::WhenRequired,
            );
        if let Some(e) = &s3.endpoint {
            b = b.endpoint_url(e);
        }
        Ok(Plain {
            rt,
            client: aws_sdk_s3::Client::from_conf(b.build()),
            bucket: s3.bucket.clone(),
            concurrency: s3.max_concurrency,
        })
    }

    /// Runs `op` on every item with `concurrency` in flight; returns seconds. The first error
    /// (a message) fails the whole run.
    fn each<T, F, Fut>(&self, items: Vec<T>, op: F) -> CliResult<f64>
    where
        T: Send + 'static,
        F: Fn(aws_sdk_s3::Client, String, T) -> Fut,
        Fut: std::future::Future<Output = Result<(), String>> + Send + 'static,
    {
        let started = Instant::now();
        self.rt.block_on(async {
            let sem = Arc::new(tokio::sync::Semaphore::new(self.concurrency));
            let mut set = tokio::task::JoinSet::new();
            for item in items {
                let permit = Arc::clone(&sem)
                    .acquire_owned()
                    .await
                    .map_err(|e| CliError::runtime(e.to_string()))?;
                let fut = op(self.client.clone(), self.bucket.clone(), item);
                set.spawn(async move {
                    let _permit = permit;
                    fut.await
                });
            }
            while let Some(r) = set.join_next().await {
                r.map_err(|e| CliError::runtime(e.to_string()))?
                    .map_err(CliError::runtime)?;
            }
            Ok::<(), CliError>(())
        })?;
        Ok(started.elapsed().as_secs_f64())
    }

    /// PUTs every `(name, body)`; returns seconds.
    fn put_all(&self, objects: Vec<(String, bytes::Bytes)>) -> CliResult<f64> {
        self.each(objects, |client, bucket, (name, body)| async move {
            client
                .put_object()
                .bucket(bucket)
                .key(&name)
                .body(body.into())
                .send()
                .await
                .map(|_| ())
                .map_err(|e| {
                    format!(
                        "plain PUT {name}: {}",
                        aws_sdk_s3::error::DisplayErrorContext(e)
                    )
                })
        })
    }

    /// GETs every name (body collected in memory) and checks its length and crc32c, as the
    /// engine side checks its loads; returns seconds.
    fn get_all(&self, names: Vec<(String, u32)>, len: usize) -> CliResult<f64> {
        self.each(names, move |client, bucket, (name, crc)| async move {
            let out = client
                .get_object()
                .bucket(bucket)
                .key(&name)
                .send()
                .await
                .map_err(|e| {
                    format!(
                        "plain GET {name}: {}",
                        aws_sdk_s3::error::DisplayErrorContext(e)
                    )
                })?;
            let body = out
                .body
                .collect()
                .await
                .map_err(|e| format!("plain GET {name}: {e}"))?
                .into_bytes();
            if body.len() == len && kvtier::checksum::crc32c(&body) == crc {
                Ok(())
            } else {
                Err(format!(
                    "plain GET {name}: {} bytes, wrong content",
                    body.len()
                ))
            }
        })
    }

    /// Deletes every name (best effort: the bench's own objects).
    fn delete_all(&self, names: Vec<String>) {
        let _ = self.each(names, |client, bucket, name| async move {
            let _ = client.delete_object().bucket(bucket).key(name).send().await;
            Ok(())
        });
    }
}

/// Runs jobs of one block each through `engine` ([`jobs::run_each`]), as many in flight as
/// `blocks` has; `prepare(job index, block)` fills a block before a store; `check(job index,
/// block)` verifies one after a load; a failed job stops the run. Returns seconds.
fn drive(
    engine: &Engine,
    kind: JobKind,
    keys: &[Key],
    blocks: &[u32],
    prepare: impl FnMut(usize, u32),
    mut check: impl FnMut(usize, u32) -> Result<(), String>,
) -> CliResult<f64> {
    jobs::run_each(engine, kind, keys, blocks, None, prepare, |i, block, r| {
        if !r.success {
            return Err(CliError::runtime(format!(
                "{kind:?} of object {i} failed: {:?}",
                r.failure()
            )));
        }
        check(i, block).map_err(CliError::runtime)
    })
}

struct Latency {
    nvme_us: Vec<u64>,
    s3_bytes: u64,
    seconds: f64,
}

/// The latency phase's two streams: QD1 loads of `local` keys (stream 0), and with `s3_keys`
/// loads of those (held only in S3) at `2 × depth` (stream 1), so the reactor has `depth` GETs
/// running. Every loaded block is checked.
struct LatencyJobs<'a> {
    region: &'a Region,
    block_bytes: usize,
    local: &'a [(Key, Vec<u8>)],
    s3_keys: &'a [(Key, u32)],
    streams: [(JobKind, usize); 2],
    /// Jobs submitted per stream; by block, which key index the job on it loads.
    next: [usize; 2],
    on_block: Vec<usize>,
    nvme_us: Vec<u64>,
    s3_bytes: u64,
}

impl Jobs for LatencyJobs<'_> {
    fn streams(&self) -> &[(JobKind, usize)] {
        &self.streams
    }

    fn next_key(&mut self, s: usize) -> Option<Key> {
        Some(if s == 0 {
            self.local[self.next[0] % self.local.len()].0
        } else {
            self.s3_keys[self.next[1] % self.s3_keys.len()].0
        })
    }

    fn prepare(&mut self, _: usize, _: u32) {}

    fn submitted(&mut self, s: usize, block: u32) {
        let n = if s == 0 {
            self.local.len()
        } else {
            self.s3_keys.len()
        };
        self.on_block[block as usize] = self.next[s] % n;
        self.next[s] += 1;
    }

    fn has_work(&self, _: usize) -> bool {
        true
    }

    fn done(&mut self, s: usize, block: u32, r: KeyResult<'_>) -> CliResult<()> {
        let r = r.job;
        if !r.success {
            return Err(CliError::runtime(format!(
                "load {} failed: {:?}",
                r.id,
                r.failure()
            )));
        }
        let idx = self.on_block[block as usize];
        let at = block as usize * self.block_bytes;
        if s == 1 {
            let (_, want) = self.s3_keys[idx];
            let crc = self
                .region
                .with_bytes(at, self.block_bytes, kvtier::checksum::crc32c);
            if crc != want {
                return Err(CliError::runtime(format!("S3 load {idx}: wrong bytes")));
            }
            self.s3_bytes += self.block_bytes as u64;
        } else {
            let want = &self.local[idx].1;
            if !self
                .region
                .with_bytes(at, self.block_bytes, |b| b == want.as_slice())
            {
                return Err(CliError::runtime("NVMe load: wrong bytes"));
            }
            self.nvme_us.push(r.elapsed.as_micros() as u64);
        }
        Ok(())
    }
}

/// QD1 loads of `local` keys for `seconds`; with `s3_keys`, also keeps `2 × depth` loads of
/// those (held only in S3) in flight, so the reactor has `depth` GETs running. Every loaded block
/// is checked. Blocks `0..=2 × depth` of the region are used.
fn latency_phase(
    engine: &Engine,
    region: &Region,
    block_bytes: usize,
    local: &[(Key, Vec<u8>)],
    s3_keys: &[(Key, u32)],
    depth: usize,
    seconds: f64,
) -> CliResult<Latency> {
    let started = Instant::now();
    let s3_depth = if s3_keys.is_empty() { 0 } else { 2 * depth };
    let blocks: Vec<u32> = (0..=s3_depth as u32).collect();
    let mut jobs = LatencyJobs {
        region,
        block_bytes,
        local,
        s3_keys,
        streams: [(JobKind::Load, 1), (JobKind::Load, s3_depth)],
        next: [0, 0],
        on_block: vec![0; blocks.len()],
        nvme_us: Vec::new(),
        s3_bytes: 0,
    };
    let limits = jobs::Limits {
        until: Some(started + Duration::from_secs_f64(seconds)),
        stall: None,
    };
    jobs::Driver::new(engine, &blocks, Duration::from_millis(50)).run(&mut jobs, limits)?;
    let mut nvme_us = jobs.nvme_us;
    nvme_us.sort_unstable();
    Ok(Latency {
        nvme_us,
        s3_bytes: jobs.s3_bytes,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// What the cold bench measured, for its report.
struct Measured {
    info: kvtier::EngineInfo,
    put_engine: Vec<f64>,
    put_plain: Vec<f64>,
    get_engine: Vec<f64>,
    get_plain: Vec<f64>,
    /// Process CPU seconds spent in each side's phases (engine threads and the driving thread,
    /// or the plain loop's runtime): [put engine, put plain, get engine, get plain].
    cpu: [f64; 4],
    /// The engine rounds' CPU by thread class: [PUT, GET].
    threads: [ThreadSecs; 2],
    alone: Latency,
    busy: Latency,
    put_stats: kvtier::S3Stats,
    get_stats: kvtier::S3Stats,
}

impl Measured {
    /// Median GiB/s over the rounds: PUT engine, PUT plain, GET engine, GET plain.
    fn medians(&self) -> [f64; 4] {
        [
            &self.put_engine,
            &self.put_plain,
            &self.get_engine,
            &self.get_plain,
        ]
        .map(|v| median(v.iter().copied()))
    }
}

/// One cold bench run: its objects' names and contents, and the plain SDK loop beside the
/// engine.
struct Cold<'a> {
    params: &'a ColdParams<'a>,
    /// Tags this run's object names and contents.
    run: u64,
    block_bytes: usize,
    /// The S3 tier's `max_concurrency`, also the plain loop's.
    depth: usize,
    plain: Plain,
    plain_prefix: String,
    /// Twice as many jobs as requests in flight, so the engine keeps `depth` requests busy
    /// while other jobs are in their NVMe half; its S3 concurrency is still `depth`.
    blocks: Vec<u32>,
    engine_names: Vec<String>,
    plain_names: Vec<String>,
}

pub(crate) fn run(params: &ColdParams<'_>, base: &Config, human: Human) -> CliResult<ExitCode> {
    let s3 = base.s3.clone().ok_or_else(|| {
        CliError::usage(
            "--workload cold needs an object store: --s3-endpoint URL --s3-bucket NAME (with \
             --s3-access-key/--s3-secret-key or the AWS default credentials), or an [s3] section \
             in --config",
        )
    })?;
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    let depth = s3.max_concurrency;
    let mut config = base.clone();
    config.region_blocks = (2 * depth as u64 + 2).max(16);
    let mut s3cfg = s3.clone();
    s3cfg.prefix = if s3.prefix.is_empty() {
        format!("kvtier-bench-{run:x}")
    } else {
        format!("{}/kvtier-bench-{run:x}", s3.prefix)
    };
    s3cfg.write = S3Write::Through;
    s3cfg.write_ack = WriteAck::Both;
    s3cfg.promote_on_load = false;
    config.s3 = Some(s3cfg.clone());
    config.validate()?;
    let mut cold = Cold {
        params,
        run,
        block_bytes: base.block_size as usize,
        depth,
        plain: Plain::new(&s3)?,
        plain_prefix: format!("{}/plain", s3cfg.prefix),
        blocks: (0..2 * depth as u32).collect(),
        engine_names: Vec::new(),
        plain_names: Vec::new(),
    };
    let region = kvtier::region::allocate(&config)?;
    let (info, put_engine, put_plain, (put_cpu, put_threads), put_stats) =
        cold.put_rounds(&config, &region)?;
    // GET: a second engine on an empty slab, so every key is held only in S3.
    for d in &mut config.devices {
        d.path = params.scratch.join("kvtier-cold-get.slab");
    }
    if let Some(s) = &mut config.s3 {
        s.write = S3Write::Off;
    }
    let engine = Engine::open(&config, Arc::clone(&region))?;
    let gets = cold.get_rounds(&engine, &region);
    let measured = gets.and_then(|(get_engine, get_plain, (get_cpu, get_threads), crcs)| {
        let (alone, busy) = cold.latencies(&engine, &region, &crcs)?;
        Ok(Measured {
            info,
            put_engine,
            put_plain,
            get_engine,
            get_plain,
            cpu: [put_cpu[0], put_cpu[1], get_cpu[0], get_cpu[1]],
            threads: [put_threads, get_threads],
            alone,
            busy,
            put_stats,
            get_stats: engine.stats().s3.unwrap_or_default(),
        })
    });
    engine.shutdown();
    drop(engine);
    let names = std::mem::take(&mut cold.engine_names)
        .into_iter()
        .chain(std::mem::take(&mut cold.plain_names))
        .collect();
    cold.plain.delete_all(names);
    cold.report(&s3, &measured?, human)?;
    Ok(ExitCode::SUCCESS)
}

impl Cold<'_> {
    fn gib(&self) -> f64 {
        output::gib(self.params.objects * self.block_bytes as u64)
    }

    /// PUT: the engine (write-through stores) and the plain loop, alternating, round by round.
    /// Returns the engine's description, the engine's and the loop's GiB/s per round, their
    /// CPU seconds and the engine's S3 counters.
    #[allow(clippy::type_complexity)]
    fn put_rounds(
        &mut self,
        config: &Config,
        region: &Arc<Region>,
    ) -> CliResult<(
        kvtier::EngineInfo,
        Vec<f64>,
        Vec<f64>,
        ([f64; 2], ThreadSecs),
        kvtier::S3Stats,
    )> {
        let (run, n_objects, block_bytes) = (self.run, self.params.objects, self.block_bytes);
        let engine = Engine::open(config, Arc::clone(region))?;
        let info = engine.info().clone();
        let (mut put_engine, mut put_plain, mut cpu) = (Vec::new(), Vec::new(), [0f64; 2]);
        let mut threads = ThreadSecs::default();
        for r in 0..self.params.rounds as u64 {
            let keys: Vec<Key> = (0..n_objects).map(|i| key_of(run, r, i)).collect();
            self.engine_names
                .extend(keys.iter().filter_map(|k| engine.s3_object_name(k)));
            // Made before the clock starts, as the plain loop's bodies are.
            let bodies: Vec<Vec<u8>> = (0..n_objects)
                .map(|i| pattern(run, r, i, block_bytes))
                .collect();
            let c0 = cpu_now();
            let t0 = ThreadSecs::now(&engine);
            let secs = drive(
                &engine,
                JobKind::Store,
                &keys,
                &self.blocks,
                |i, b| region.write(b as usize * block_bytes, &bodies[i]),
                |_, _| Ok(()),
            )?;
            cpu[0] += cpu_now() - c0;
            threads.add_since(&t0, &ThreadSecs::now(&engine));
            put_engine.push(self.gib() / secs);
            let objects: Vec<(String, bytes::Bytes)> = (0..n_objects)
                .map(|i| {
                    let name = format!("{}/{r}/{i}", self.plain_prefix);
                    self.plain_names.push(name.clone());
                    (name, bytes::Bytes::from(pattern(run, r, i, block_bytes)))
                })
                .collect();
            let c0 = cpu_now();
            let secs = self.plain.put_all(objects)?;
            cpu[1] += cpu_now() - c0;
            put_plain.push(self.gib() / secs);
        }
        let stats = engine.stats().s3.unwrap_or_default();
        engine.shutdown();
        Ok((info, put_engine, put_plain, (cpu, threads), stats))
    }

    /// GET: loads of keys held only in S3 through `engine`, and the plain loop's GETs,
    /// alternating; every loaded block is checked against the crc32c of what was stored.
    /// Returns both sides' GiB/s per round, their CPU seconds, and the crc32c of every object
    /// (by round).
    #[allow(clippy::type_complexity)]
    fn get_rounds(
        &self,
        engine: &Engine,
        region: &Region,
    ) -> CliResult<(Vec<f64>, Vec<f64>, ([f64; 2], ThreadSecs), Vec<Vec<u32>>)> {
        let (run, n_objects, block_bytes) = (self.run, self.params.objects, self.block_bytes);
        let crcs: Vec<Vec<u32>> = (0..self.params.rounds as u64)
            .map(|r| {
                (0..n_objects)
                    .map(|i| kvtier::checksum::crc32c(&pattern(run, r, i, block_bytes)))
                    .collect()
            })
            .collect();
        let (mut get_engine, mut get_plain, mut cpu) = (Vec::new(), Vec::new(), [0f64; 2]);
        let mut threads = ThreadSecs::default();
        for r in 0..self.params.rounds as u64 {
            let keys: Vec<Key> = (0..n_objects).map(|i| key_of(run, r, i)).collect();
            let want = &crcs[r as usize];
            let c0 = cpu_now();
            let t0 = ThreadSecs::now(engine);
            let secs = drive(
                engine,
                JobKind::Load,
                &keys,
                &self.blocks,
                |_, b| region.fill(b as usize * block_bytes, 4096, 0xee),
                |i, b| {
                    let crc = region.with_bytes(
                        b as usize * block_bytes,
                        block_bytes,
                        kvtier::checksum::crc32c,
                    );
                    if crc == want[i] {
                        Ok(())
                    } else {
                        Err(format!("object {i} of round {r}: loaded bytes differ"))
                    }
                },
            )?;
            cpu[0] += cpu_now() - c0;
            threads.add_since(&t0, &ThreadSecs::now(engine));
            get_engine.push(self.gib() / secs);
            let names: Vec<(String, u32)> = (0..n_objects)
                .map(|i| (format!("{}/{r}/{i}", self.plain_prefix), want[i as usize]))
                .collect();
            let c0 = cpu_now();
            let secs = self.plain.get_all(names, block_bytes)?;
            cpu[1] += cpu_now() - c0;
            get_plain.push(self.gib() / secs);
        }
        Ok((get_engine, get_plain, (cpu, threads), crcs))
    }

    /// NVMe load latency alone, then under an S3 GET stream through the same engine.
    fn latencies(
        &self,
        engine: &Engine,
        region: &Region,
        crcs: &[Vec<u32>],
    ) -> CliResult<(Latency, Latency)> {
        let (run, block_bytes) = (self.run, self.block_bytes);
        let local: Vec<(Key, Vec<u8>)> = (0..16u64)
            .map(|i| {
                (
                    key_of(run, u64::MAX, i),
                    pattern(run, u64::MAX, i, block_bytes),
                )
            })
            .collect();
        let local_keys: Vec<Key> = local.iter().map(|(k, _)| *k).collect();
        drive(
            engine,
            JobKind::Store,
            &local_keys,
            &[0],
            |i, b| region.write(b as usize * block_bytes, &local[i].1),
            |_, _| Ok(()),
        )?;
        let s3_keys: Vec<(Key, u32)> = (0..self.params.rounds as u64)
            .flat_map(|r| {
                (0..self.params.objects)
                    .map(move |i| (key_of(run, r, i), crcs[r as usize][i as usize]))
            })
            .collect();
        let (depth, half) = (self.depth, self.params.latency_seconds);
        let alone = latency_phase(engine, region, block_bytes, &local, &[], depth, half)?;
        let busy = latency_phase(engine, region, block_bytes, &local, &s3_keys, depth, half)?;
        Ok((alone, busy))
    }

    /// The report: the rates and latency tables, and the JSON document with `--json`.
    fn report(&self, s3: &kvtier::config::S3Config, m: &Measured, human: Human) -> CliResult<()> {
        human.print(&self.text(s3, m));
        if let Some(target) = self.params.json {
            output::write_json(target, &self.json(s3, m))?;
        }
        Ok(())
    }

    fn text(&self, s3: &kvtier::config::S3Config, m: &Measured) -> String {
        let (params, depth, n_objects, block_bytes) = (
            self.params,
            self.depth,
            self.params.objects,
            self.block_bytes,
        );
        let (info, cpu, alone, busy) = (&m.info, &m.cpu, &m.alone, &m.busy);
        let (put_engine, get_engine) = (&m.put_engine, &m.get_engine);
        let (put_stats, get_stats) = (&m.put_stats, &m.get_stats);
        let [pe, pp, ge, gp] = m.medians();
        let q = |l: &Latency, x| percentile(&l.nvme_us, x);
        let busy_s3 = output::gib(busy.s3_bytes) / busy.seconds;
        let mut text = String::new();
        let _ = writeln!(
            text,
            "S3: bucket {:?} at {}, objects of {}, max_concurrency {depth}, {n_objects} objects per round, \
             {} rounds (engine and plain aws-sdk-s3 loop alternate); reactor threads {} on cores {:?}\n",
            s3.bucket,
            s3.endpoint.as_deref().unwrap_or("AWS"),
            output::size(block_bytes as u64),
            params.rounds,
            info.s3.as_ref().map_or(0, |s| s.reactor_threads),
            info.s3.as_ref().map(|s| s.reactor_cores.clone()).unwrap_or_default(),
        );
        let total_gib = output::gib(n_objects * block_bytes as u64) * params.rounds as f64;
        let per_gib = |c: f64| format!("{:.2}", c / total_gib);
        let mut rates = Table::new(&[
            "op",
            "engine GiB/s",
            "plain SDK GiB/s",
            "ratio",
            "CPU s/GiB engine",
            "plain",
            "rounds (engine)",
        ]);
        let fmt_rounds = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.3}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        rates.row(vec![
            "PUT (write-through store)".into(),
            format!("{pe:.3}"),
            format!("{pp:.3}"),
            format!("{:.2}", pe / pp.max(f64::MIN_POSITIVE)),
            per_gib(cpu[0]),
            per_gib(cpu[1]),
            fmt_rounds(put_engine),
        ]);
        rates.row(vec![
            "GET (load of S3-only keys)".into(),
            format!("{ge:.3}"),
            format!("{gp:.3}"),
            format!("{:.2}", ge / gp.max(f64::MIN_POSITIVE)),
            per_gib(cpu[2]),
            per_gib(cpu[3]),
            fmt_rounds(get_engine),
        ]);
        text.push_str(&rates.to_string());
        for (op, t) in [("PUT", &m.threads[0]), ("GET", &m.threads[1])] {
            let t = t.per_gib(total_gib);
            let _ = writeln!(
                text,
                "engine {op} cpu s/GiB by thread: caller {:.3}, workers {:.3}, io_uring kernel \
                 threads {:.3}, S3 reactor {:.3}",
                t.caller, t.workers, t.io_kernel, t.s3_reactor
            );
        }
        let _ = writeln!(text);
        text.push_str(&latency_table(alone, busy));
        let _ = writeln!(
            text,
            "S3 GET stream during the busy phase: {busy_s3:.3} GiB/s; p99 ratio busy/alone {:.2}\n\
             S3 requests: PUT {} ({} retries, {} errors), GET {} ({} retries, {} errors), \
             GET latency p50 {} us p99 {} us",
            q(busy, 0.99) as f64 / q(alone, 0.99).max(1) as f64,
            put_stats.put.requests,
            put_stats.put.retries,
            put_stats.put.errors,
            get_stats.get.requests,
            get_stats.get.retries,
            get_stats.get.errors,
            get_stats.get.latency_us.quantile(0.5),
            get_stats.get.latency_us.quantile(0.99),
        );
        text
    }

    fn json(&self, s3: &kvtier::config::S3Config, m: &Measured) -> serde_json::Value {
        let (params, depth, n_objects, block_bytes) = (
            self.params,
            self.depth,
            self.params.objects,
            self.block_bytes,
        );
        let (cpu, alone, busy) = (&m.cpu, &m.alone, &m.busy);
        let (put_engine, put_plain, get_engine, get_plain) =
            (&m.put_engine, &m.put_plain, &m.get_engine, &m.get_plain);
        let [pe, pp, ge, gp] = m.medians();
        let q = |l: &Latency, x| percentile(&l.nvme_us, x);
        let busy_s3 = output::gib(busy.s3_bytes) / busy.seconds;
        let lat = |l: &Latency| {
            json!({"loads": l.nvme_us.len(), "p50_us": q(l, 0.5), "p99_us": q(l, 0.99),
                   "max_us": l.nvme_us.last().copied().unwrap_or(0)})
        };
        let total_gib = output::gib(n_objects * block_bytes as u64) * params.rounds as f64;
        json!({
            "workload": "cold",
            "bucket": s3.bucket,
            "endpoint": s3.endpoint,
            "object_bytes": block_bytes,
            "max_concurrency": depth,
            "objects_per_round": n_objects,
            "rounds": params.rounds,
            "put_gib_s": {"engine": pe, "plain_sdk": pp, "engine_rounds": put_engine, "plain_rounds": put_plain},
            "get_gib_s": {"engine": ge, "plain_sdk": gp, "engine_rounds": get_engine, "plain_rounds": get_plain},
            "cpu_seconds_per_gib": {"put_engine": cpu[0] / total_gib, "put_plain": cpu[1] / total_gib,
                                    "get_engine": cpu[2] / total_gib, "get_plain": cpu[3] / total_gib},
            "engine_cpu_s_per_gib_by_thread": {"put": m.threads[0].per_gib(total_gib),
                                               "get": m.threads[1].per_gib(total_gib)},
            "nvme_load_latency": {"alone": lat(alone), "during_s3": lat(busy), "s3_gib_s_during": busy_s3},
        })
    }
}

/// The NVMe load latencies at QD 1, alone and beside the S3 GET stream.
fn latency_table(alone: &Latency, busy: &Latency) -> String {
    let q = |l: &Latency, x| percentile(&l.nvme_us, x);
    let mut table = Table::new(&[
        "NVMe load latency (QD1)",
        "loads",
        "p50 us",
        "p99 us",
        "max us",
    ]);
    for (name, lat) in [("alone", alone), ("during S3 GET stream", busy)] {
        table.row(vec![
            name.into(),
            lat.nvme_us.len().to_string(),
            q(lat, 0.5).to_string(),
            q(lat, 0.99).to_string(),
            lat.nvme_us.last().copied().unwrap_or(0).to_string(),
        ]);
    }
    table.to_string()
}

/// Process CPU seconds so far.
/// CPU seconds of the engine's thread classes, as snapshots to subtract.
#[derive(Clone, Copy, Default)]
struct ThreadSecs {
    caller: f64,
    workers: f64,
    io_kernel: f64,
    s3_reactor: f64,
}

impl ThreadSecs {
    /// Now: this (the calling) thread, and the engine's classes from its stats.
    fn now(engine: &Engine) -> ThreadSecs {
        let s = engine.stats_with_threads();
        let t = s.thread_cpu.unwrap_or_default();
        ThreadSecs {
            caller: kvtier_sys::affinity::thread_cpu_time().as_secs_f64(),
            workers: s.worker_cpu_seconds,
            io_kernel: t.io_kernel_seconds,
            s3_reactor: t.s3_reactor_seconds,
        }
    }

    /// Adds what each class spent from `before` to `after`.
    fn add_since(&mut self, before: &ThreadSecs, after: &ThreadSecs) {
        let d = |a: f64, b: f64| (a - b).max(0.0);
        self.caller += d(after.caller, before.caller);
        self.workers += d(after.workers, before.workers);
        self.io_kernel += d(after.io_kernel, before.io_kernel);
        self.s3_reactor += d(after.s3_reactor, before.s3_reactor);
    }

    fn per_gib(&self, gib: f64) -> crate::bench::ThreadCpu {
        let per = |v: f64| if gib > 0.0 { v / gib } else { 0.0 };
        crate::bench::ThreadCpu {
            caller: per(self.caller),
            workers: per(self.workers),
            io_kernel: per(self.io_kernel),
            s3_reactor: per(self.s3_reactor),
        }
    }
}

fn cpu_now() -> f64 {
    kvtier_sys::affinity::process_cpu_time().as_secs_f64()
}
