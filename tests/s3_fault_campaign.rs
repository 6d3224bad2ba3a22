//! The object-store fault campaign: a real S3 server process (s3s-fs, or any endpoint named by
//! `KVTIER_S3_ENDPOINT`, e.g. a Garage cluster) behind a fault-injecting proxy
//! (`common::proxy`), and an engine with a slab file and `write = "through"` in front of it.
//!
//! A seeded sequence of phases switches between passing, throttling bursts (`503 SlowDown` on
//! every other connection), server errors (`500` on all), a stall (connections accepted and never
//! answered), connections closed at once, the server killed, and its credentials rotated (the
//! engine's key answered 403). In every phase the same steps run, each a load of S3-only keys, a
//! write-through store and a load of NVMe keys submitted together, plus lookups. Checked after
//! every step: a load that succeeds holds exactly its keys' bytes; a job that fails says
//! `Remote` (or `Miss`), within the retry budget; every job is reported once; NVMe loads always
//! succeed, byte-exact, whatever the object store does; lookups never block. After the last
//! phase the store is healthy again and everything must come back: every S3 key loads, every
//! upload that was acknowledged is in the bucket byte-exact, and no object in the bucket holds
//! other bytes than its key's. Then damage (local server only): bit flips and truncations of
//! uploaded objects, read by a fresh engine: every damaged object is refused, the rest served.
//! Logs are captured at debug level and scanned for the secrets.
//!
//! CI: `cargo test -p kvtier --features sim --test s3_fault_campaign` (14 phases). The documented
//! run: `KVTIER_S3_PHASES=200 cargo test -p kvtier --features sim --test s3_fault_campaign --
//! --nocapture`. Another endpoint: `KVTIER_S3_ENDPOINT=http://127.0.0.1:3900
//! KVTIER_S3_BUCKET=kvtier KVTIER_S3_REGION=garage KVTIER_S3_ACCESS_KEY=.. KVTIER_S3_SECRET_KEY=..`
//! (the server-side phases, kill and rotated keys, then need the operator: they are skipped).

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::logs::Captured;
use common::proxy::{Fault, FaultProxy};
use common::s3::{S3Server, Sdk, ACCESS_KEY, BUCKET, SECRET_KEY};
use common::{content, env_u64, holds, key, put, region, scratch_dir, wait_results, BLOCK};
use kvtier::files::mapper::{FileMapper, KvCacheGroup, Namespace};
use kvtier::sim::Rng;
use kvtier::{Config, Engine, Job, JobResult, KeyFailure, Lookup, Region, Tier};

/// Per attempt; with `RETRIES` = 2 a request fails after 3 attempts and two backoffs.
const TIMEOUT_MS: u64 = 300;
const RETRIES: u64 = 2;
/// One request's retry budget: three attempts and two backoffs (≤ 50 ms and ≤ 100 ms).
const REQUEST_BUDGET_MS: u64 = 3 * TIMEOUT_MS + 150;
/// A job's bound: its request may first wait for a permit (`max_concurrency` = 8) held by the
/// lookups' HEADs (8 per step), each bounded by the same budget; then its own retries; then
/// scheduling slack (a debug build on two busy cores).
const BUDGET: Duration = Duration::from_millis(2 * REQUEST_BUDGET_MS + 1500);
/// S3-only keys seeded in the bucket before the campaign.
const SEEDED: u64 = 48;
const STEPS_PER_PHASE: u64 = 5;
const ROTATED_SECRET: &str = "kvtier-rotated-secret";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Pass,
    Throttled,
    ServerErrors,
    Stalled,
    Closed,
    Killed,
    RotatedKeys,
}

impl Phase {
    fn server_side(self) -> bool {
        matches!(self, Phase::Killed | Phase::RotatedKeys)
    }
}

/// Where the objects live: a private s3s-fs, or an endpoint from the environment.
struct Store {
    local: Option<S3Server>,
    endpoint: String,
    upstream: std::net::SocketAddr,
    bucket: String,
    region: String,
    access: String,
    secret: String,
}

impl Store {
    fn new() -> Store {
        if let Ok(endpoint) = std::env::var("KVTIER_S3_ENDPOINT") {
            let var = |n: &str| std::env::var(n).unwrap_or_else(|_| panic!("{n} is needed"));
            let hostport = endpoint.trim_start_matches("http://").trim_end_matches('/');
            let upstream = std::net::ToSocketAddrs::to_socket_addrs(hostport)
                .expect("KVTIER_S3_ENDPOINT host:port")
                .next()
                .expect("an address");
            return Store {
                local: None,
                endpoint,
                upstream,
                bucket: var("KVTIER_S3_BUCKET"),
                region: std::env::var("KVTIER_S3_REGION").unwrap_or_else(|_| "us-east-1".into()),
                access: var("KVTIER_S3_ACCESS_KEY"),
                secret: var("KVTIER_S3_SECRET_KEY"),
            };
        }
        let server = S3Server::start();
        Store {
            endpoint: server.endpoint(),
            upstream: server.addr(),
            local: Some(server),
            bucket: BUCKET.into(),
            region: "us-east-1".into(),
            access: ACCESS_KEY.into(),
            secret: SECRET_KEY.into(),
        }
    }

    fn sdk(&self) -> Sdk {
        Sdk::connect(
            &self.endpoint,
            &self.region,
            &self.access,
            &self.secret,
            &self.bucket,
        )
    }
}

fn namespace() -> Namespace {
    let mut ns = Namespace::new("test/model", "float16", 16, 1);
    ns.kv_cache_groups = vec![KvCacheGroup {
        tokens_per_block: 16,
        layer_names: vec!["layer.0".into()],
    }];
    ns
}

/// This run's object prefix: several runs can share an external bucket.
fn object_name(prefix: &str, id: u64) -> String {
    FileMapper::new(Path::new(prefix), &namespace())
        .key_path(key(id).as_bytes())
        .expect("vLLM-shaped key")
        .to_str()
        .expect("utf-8")
        .to_owned()
}

fn config(dir: &Path, store: &Store, endpoint: &str, prefix: &str, capacity_blocks: u64) -> Config {
    let text = format!(
        r#"
block_size = {BLOCK}
cores = [0]
region_blocks = 64
[[devices]]
path = "{dev}"
capacity_bytes = {cap}
[s3]
bucket = "{bucket}"
region = "{region}"
endpoint = "{endpoint}"
force_path_style = true
access_key_id = "{access}"
secret_access_key = "{secret}"
prefix = "{prefix}"
timeout_ms = {TIMEOUT_MS}
retries = {RETRIES}
lookup_ttl_ms = 200
write = "through"
promote_on_load = false
max_concurrency = 8
[s3.namespace]
model_name = "test/model"
dtype = "float16"
tokens_per_hash = 16
blocks_per_file = 1
[[s3.namespace.kv_cache_groups]]
tokens_per_block = 16
layer_names = ["layer.0"]
"#,
        dev = dir.join("slab").display(),
        cap = ((capacity_blocks + 1) * BLOCK + (1 << 20)).max(16 << 20),
        bucket = store.bucket,
        region = store.region,
        access = store.access,
        secret = store.secret,
    );
    Config::from_toml_str(&text).expect("campaign config")
}

#[derive(Default, Debug)]
struct Tally {
    steps: u64,
    s3_loads_ok: u64,
    s3_loads_failed: u64,
    stores_ok: u64,
    stores_upload_failed: u64,
    nvme_loads_ok: u64,
    max_s3_job: Duration,
    max_nvme_job: Duration,
    max_lookup_call: Duration,
}

struct Campaign {
    engine: Engine,
    region: Arc<Region>,
    rng: Rng,
    next_job: u64,
    next_store_id: u64,
    /// Keys on NVMe (stored by this engine; the slab holds them all: nothing is evicted).
    nvme: Vec<u64>,
    /// Uploads acknowledged (the store job succeeded): must be in the bucket, byte-exact.
    acked: Vec<u64>,
    /// Uploads that failed: absent from the bucket, or byte-exact (the server may have finished
    /// a PUT whose answer was lost).
    unacked: Vec<u64>,
    /// Every failure detail, for the secrets scan.
    details: Vec<String>,
    tally: BTreeMap<Phase, Tally>,
}

/// Region blocks: 0-1 the S3 load, 2 the store, 3-4 the NVMe load.
impl Campaign {
    fn job(&mut self) -> u64 {
        self.next_job += 1;
        self.next_job
    }

    /// Every S3 key loads again, byte-exact, once the store is healthy; returns how long that
    /// took.
    fn recover(&mut self) -> Duration {
        let recovered = Instant::now();
        for chunk in (0..SEEDED).collect::<Vec<_>>().chunks(2) {
            let j = self.job();
            for (b, _) in chunk.iter().enumerate() {
                self.region.fill(b * BLOCK as usize, BLOCK as usize, 0xee);
            }
            self.engine
                .submit_load(Job::new(
                    j,
                    chunk.iter().map(|&i| key(i)).collect(),
                    (0..chunk.len() as u32).collect(),
                ))
                .expect("submit");
            let r = wait_results(&self.engine, 1).pop().expect("result");
            assert!(r.success, "after the faults: {r:?}");
            for (b, &id) in chunk.iter().enumerate() {
                assert!(
                    holds(&self.region, b as u32, id),
                    "S3 key {id} wrong after the faults"
                );
            }
        }
        recovered.elapsed()
    }

    /// Two S3 keys (one if both picks agree), a new store id, and up to two NVMe keys.
    fn pick(&mut self) -> (Vec<u64>, u64, Vec<u64>) {
        let s3_ids = [self.rng.below(SEEDED), self.rng.below(SEEDED)];
        let s3_ids = if s3_ids[0] == s3_ids[1] {
            vec![s3_ids[0]]
        } else {
            s3_ids.to_vec()
        };
        let store_id = self.next_store_id;
        self.next_store_id += 1;
        let mut nvme_ids: Vec<u64> = Vec::new();
        for _ in 0..2.min(self.nvme.len()) {
            let id = self.nvme[self.rng.below(self.nvme.len() as u64) as usize];
            if !nvme_ids.contains(&id) {
                nvme_ids.push(id);
            }
        }
        (s3_ids, store_id, nvme_ids)
    }

    /// Four lookups of S3-only keys: they answer at once whatever the store does. Returns the
    /// longest call.
    fn lookups(&mut self, phase: Phase) -> Duration {
        let mut lookup_max = Duration::ZERO;
        for _ in 0..4 {
            let ids = [key(self.rng.below(SEEDED)), key(self.rng.below(SEEDED))];
            let l0 = Instant::now();
            let answers = self.engine.lookup(&ids);
            lookup_max = lookup_max.max(l0.elapsed());
            for a in answers {
                assert!(
                    matches!(a, Lookup::Pending | Lookup::Miss | Lookup::Hit(Tier::S3)),
                    "{phase:?}: lookup of an S3-only key answered {a:?}"
                );
            }
        }
        assert!(
            lookup_max < Duration::from_secs(1),
            "{phase:?}: a lookup call took {lookup_max:?}"
        );
        lookup_max
    }

    fn step(&mut self, phase: Phase) {
        let (s3_ids, store_id, nvme_ids) = self.pick();
        for b in 0..2 {
            self.region.fill(b * BLOCK as usize, BLOCK as usize, 0xee);
        }
        for b in 3..5 {
            self.region.fill(b * BLOCK as usize, BLOCK as usize, 0xee);
        }
        put(&self.region, 2, store_id);
        let (j_s3, j_store, j_nvme) = (self.job(), self.job(), self.job());
        let keys = |ids: &[u64]| ids.iter().map(|&i| key(i)).collect::<Vec<_>>();
        self.engine
            .submit_load(Job::new(
                j_s3,
                keys(&s3_ids),
                (0..s3_ids.len() as u32).collect(),
            ))
            .expect("submit the S3 load");
        self.engine
            .submit_store(Job::new(j_store, vec![key(store_id)], vec![2]))
            .expect("submit the store");
        if !nvme_ids.is_empty() {
            self.engine
                .submit_load(Job::new(
                    j_nvme,
                    keys(&nvme_ids),
                    (3..3 + nvme_ids.len() as u32).collect(),
                ))
                .expect("submit the NVMe load");
        }

        let lookup_max = self.lookups(phase);
        let jobs = 2 + usize::from(!nvme_ids.is_empty());
        let results: HashMap<u64, JobResult> = wait_results(&self.engine, jobs)
            .into_iter()
            .map(|r| (r.id, r))
            .collect();
        assert_eq!(
            results.len(),
            jobs,
            "{phase:?}: every job reported once: {results:?}"
        );
        let tally = self.tally.entry(phase).or_default();
        tally.steps += 1;
        tally.max_lookup_call = tally.max_lookup_call.max(lookup_max);
        self.check_s3_load(phase, &results[&j_s3], &s3_ids);
        self.check_store(phase, &results[&j_store], store_id);
        if let Some(r) = results.get(&j_nvme) {
            self.check_nvme_load(phase, r, &nvme_ids);
        }
    }

    fn check_s3_load(&mut self, phase: Phase, r: &JobResult, s3_ids: &[u64]) {
        let tally = self.tally.entry(phase).or_default();
        tally.max_s3_job = tally.max_s3_job.max(r.elapsed);
        assert!(
            r.elapsed < BUDGET,
            "{phase:?}: the S3 load took {:?} (budget {BUDGET:?}): {r:?}",
            r.elapsed
        );
        if r.success {
            tally.s3_loads_ok += 1;
            for (b, &id) in s3_ids.iter().enumerate() {
                assert!(
                    holds(&self.region, b as u32, id),
                    "{phase:?}: key {id} reported loaded from S3 with wrong bytes"
                );
            }
        } else {
            tally.s3_loads_failed += 1;
            assert_ne!(
                phase,
                Phase::Pass,
                "a load failed with the store healthy: {r:?}"
            );
            for f in &r.failures {
                assert!(matches!(f.reason, KeyFailure::Remote), "{phase:?}: {f:?}");
                self.details.push(f.detail.clone());
            }
            if phase == Phase::RotatedKeys {
                let d = &r.failures[0].detail;
                assert!(d.contains("403") && d.contains("credentials"), "{d}");
            }
        }
    }

    fn check_store(&mut self, phase: Phase, r: &JobResult, store_id: u64) {
        let tally = self.tally.entry(phase).or_default();
        assert!(
            r.elapsed < BUDGET,
            "{phase:?}: the store took {:?}",
            r.elapsed
        );
        if r.success {
            tally.stores_ok += 1;
            self.acked.push(store_id);
        } else {
            tally.stores_upload_failed += 1;
            assert_ne!(
                phase,
                Phase::Pass,
                "an upload failed with the store healthy: {r:?}"
            );
            let f = r.failure().expect("a failure");
            assert_eq!(
                f.reason,
                KeyFailure::Remote,
                "{phase:?}: NVMe must not fail: {f:?}"
            );
            self.details.push(f.detail.clone());
            self.unacked.push(store_id);
        }
        // The NVMe half of a write-through store happens whatever the upload does.
        assert_eq!(
            self.engine.lookup(&[key(store_id)]),
            vec![Lookup::Hit(Tier::Nvme)],
            "{phase:?}: store {store_id}"
        );
        self.nvme.push(store_id);
    }

    fn check_nvme_load(&mut self, phase: Phase, r: &JobResult, nvme_ids: &[u64]) {
        let tally = self.tally.entry(phase).or_default();
        assert!(r.success, "{phase:?}: an NVMe load failed: {r:?}");
        tally.nvme_loads_ok += 1;
        tally.max_nvme_job = tally.max_nvme_job.max(r.elapsed);
        for (b, &id) in nvme_ids.iter().enumerate() {
            assert!(
                holds(&self.region, 3 + b as u32, id),
                "{phase:?}: NVMe key {id} wrong"
            );
        }
    }
}

fn phases(rng: &mut Rng, n: u64, external: bool) -> Vec<Phase> {
    let faults = [
        Phase::Throttled,
        Phase::ServerErrors,
        Phase::Stalled,
        Phase::Closed,
        Phase::Killed,
        Phase::RotatedKeys,
    ];
    let faults: Vec<Phase> = faults
        .into_iter()
        .filter(|p| !(external && p.server_side()))
        .collect();
    // Every fault once (in a seeded order), then seeded picks; a pass phase between faults.
    let mut order = faults.clone();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    while (order.len() as u64) * 2 < n {
        order.push(faults[rng.below(faults.len() as u64) as usize]);
    }
    let mut out = Vec::new();
    for f in order.into_iter().take((n / 2).max(1) as usize) {
        out.push(Phase::Pass);
        out.push(f);
    }
    out.push(Phase::Pass);
    out
}

fn enter(phase: Phase, proxy: &FaultProxy, store: &mut Store) {
    match phase {
        Phase::Pass => proxy.set(Fault::Pass),
        Phase::Throttled => proxy.set(Fault::Status {
            status: 503,
            code: "SlowDown",
            every: 2,
        }),
        Phase::ServerErrors => proxy.set(Fault::Status {
            status: 500,
            code: "InternalError",
            every: 1,
        }),
        Phase::Stalled => proxy.set(Fault::Stall),
        Phase::Closed => proxy.set(Fault::Close),
        Phase::Killed => {
            proxy.set(Fault::Pass);
            store.local.as_mut().expect("local server").kill();
        }
        Phase::RotatedKeys => {
            proxy.set(Fault::Pass);
            let s = store.local.as_mut().expect("local server");
            s.kill();
            s.restart_with_keys(ACCESS_KEY, ROTATED_SECRET);
        }
    }
}

fn leave(phase: Phase, store: &mut Store) {
    if phase.server_side() {
        let s = store.local.as_mut().expect("local server");
        s.kill();
        s.restart();
    }
}

#[test]
fn object_store_faults_never_serve_wrong_bytes_hang_or_touch_nvme() {
    let logs = Captured::install();
    let mut store = Store::new();
    let external = store.local.is_none();
    let seed = env_u64("KVTIER_S3_SEED", 1);
    let n_phases = env_u64("KVTIER_S3_PHASES", 14);
    let mut rng = Rng::new(seed);
    let prefix = format!("campaign-{seed}-{}", std::process::id());
    let sdk = store.sdk();
    for id in 0..SEEDED {
        sdk.put(&object_name(&prefix, id), content(id, BLOCK as usize));
    }
    let proxy = FaultProxy::start(store.upstream);
    let plan = phases(&mut rng, n_phases, external);
    let stores_total = plan.len() as u64 * STEPS_PER_PHASE + 16;
    let dir = scratch_dir();
    let cfg = config(dir.path(), &store, &proxy.endpoint(), &prefix, stores_total);
    let region = region(64);
    let engine = Engine::open(&cfg, Arc::clone(&region)).expect("engine opens through the proxy");
    let mut c = Campaign {
        engine,
        region,
        rng,
        next_job: 0,
        next_store_id: 1_000_000,
        nvme: Vec::new(),
        acked: Vec::new(),
        unacked: Vec::new(),
        details: Vec::new(),
        tally: BTreeMap::new(),
    };
    // A few NVMe keys to load from the first step on.
    for _ in 0..4 {
        c.step(Phase::Pass);
    }

    let started = Instant::now();
    for &phase in &plan {
        enter(phase, &proxy, &mut store);
        for _ in 0..STEPS_PER_PHASE {
            c.step(phase);
        }
        let t = Instant::now();
        c.engine.drain();
        assert!(
            t.elapsed() < BUDGET,
            "{phase:?}: drain took {:?}",
            t.elapsed()
        );
        leave(phase, &mut store);
    }
    proxy.set(Fault::Pass);

    let recovery = c.recover();
    let mut extra = Vec::new();
    c.engine.drain();
    c.engine.poll_finished(&mut extra);
    assert!(
        extra.is_empty(),
        "results reported twice or late: {extra:?}"
    );

    let (unacked_present, listed) = check_bucket(&sdk, &prefix, &c);
    let s3 = c.engine.stats().s3.expect("s3 stats");
    c.engine.shutdown();

    // Damage (local server only): objects are files under the server's root.
    let damage = store
        .local
        .as_ref()
        .map(|server| damage_uploads(&store, server, &c.acked, &prefix));

    let faults = plan.iter().filter(|p| **p != Phase::Pass).count();
    let down = check_logs(&logs, &store, &c, faults);

    report(&Report {
        seed,
        phases: plan.len(),
        faults,
        started,
        external,
        store: &store,
        c: &c,
        unacked_present,
        listed,
        recovery,
        s3: &s3,
        down,
        proxy: &proxy,
    });
    if let Some((injected, detected, intact)) = damage {
        println!(
            "object damage: {injected} objects damaged, {detected} detected and not served, \
             {intact} intact served exact"
        );
    }
    let faulted: u64 = c
        .tally
        .iter()
        .filter(|(p, _)| **p != Phase::Pass)
        .map(|(_, t)| t.s3_loads_failed + t.stores_upload_failed)
        .sum();
    assert!(faulted > 0, "the faults reached the engine");
}

/// Flips a bit in a third of the acknowledged uploads and truncates another third (s3s-fs
/// keeps objects as files), then loads every one through a fresh engine on a fresh slab: the
/// damaged ones must fail (checksum or size), the rest come back exact. Returns (damaged,
/// detected, intact served).
fn damage_uploads(
    store: &Store,
    server: &S3Server,
    acked: &[u64],
    prefix: &str,
) -> (u64, u64, u64) {
    let mut damaged = HashSet::new();
    for (i, &id) in acked.iter().enumerate() {
        let file = server
            .root
            .path()
            .join(BUCKET)
            .join(object_name(prefix, id));
        let mut bytes = std::fs::read(&file).expect("object file");
        match i % 3 {
            0 => {
                let at = (id as usize * 7919) % bytes.len();
                bytes[at] ^= 1 << (id % 8);
            }
            1 => bytes.truncate(bytes.len() - 4096),
            _ => continue,
        }
        std::fs::write(&file, bytes).expect("rewrite object");
        damaged.insert(id);
    }
    let dir = scratch_dir();
    let cfg = config(dir.path(), store, &store.endpoint, prefix, 16);
    let region = region(64);
    let engine = Engine::open(&cfg, Arc::clone(&region)).expect("a fresh engine");
    let (mut detected, mut intact) = (0, 0);
    for (j, &id) in acked.iter().enumerate() {
        region.fill(0, BLOCK as usize, 0xee);
        engine
            .submit_load(Job::new(j as u64, vec![key(id)], vec![0]))
            .expect("submit");
        let r = wait_results(&engine, 1).pop().expect("result");
        if damaged.contains(&id) {
            let f = r
                .failure()
                .unwrap_or_else(|| panic!("damaged object {id} served"));
            assert!(
                matches!(f.reason, KeyFailure::Checksum | KeyFailure::ShortIo { .. }),
                "{f:?}"
            );
            detected += 1;
        } else {
            assert!(r.success, "intact object {id}: {r:?}");
            assert!(holds(&region, 0, id), "intact object {id} wrong");
            intact += 1;
        }
    }
    engine.shutdown();
    (damaged.len() as u64, detected, intact)
}

/// The bucket: acknowledged uploads exact; failed ones absent or exact; nothing else wrong.
/// Returns the failed uploads present, and the objects listed.
fn check_bucket(sdk: &Sdk, prefix: &str, c: &Campaign) -> (usize, usize) {
    let by_name: HashMap<String, u64> = (0..SEEDED)
        .chain(c.acked.iter().copied())
        .chain(c.unacked.iter().copied())
        .map(|id| (object_name(prefix, id), id))
        .collect();
    for &id in &c.acked {
        let got = sdk.get(&object_name(prefix, id));
        assert_eq!(
            got.as_deref(),
            Some(&content(id, BLOCK as usize)[..]),
            "acknowledged upload {id}"
        );
    }
    let mut unacked_present = 0;
    for &id in &c.unacked {
        if let Some(got) = sdk.get(&object_name(prefix, id)) {
            unacked_present += 1;
            assert_eq!(
                got,
                content(id, BLOCK as usize),
                "failed upload {id} left wrong bytes"
            );
        }
    }
    let listed: Vec<String> = sdk
        .list()
        .into_iter()
        .filter(|n| n.starts_with(&format!("{prefix}/")))
        .collect();
    for name in &listed {
        let id = by_name
            .get(name)
            .unwrap_or_else(|| panic!("an object nobody stored: {name}"));
        let got = sdk.get(name).expect("listed object");
        assert_eq!(got, content(*id, BLOCK as usize), "object {name}");
    }
    (unacked_present, listed.len())
}

/// The captured logs: secrets never (nor in any error), and one "stopped answering" line per
/// outage at most. Returns the outage lines.
fn check_logs(logs: &Captured, store: &Store, c: &Campaign, faults: usize) -> usize {
    let text = logs.text();
    for secret in [SECRET_KEY, ROTATED_SECRET, store.secret.as_str()] {
        assert!(!text.contains(secret), "a secret in the logs");
        for d in &c.details {
            assert!(!d.contains(secret), "a secret in an error: {d}");
        }
    }
    let down = text.matches("the object store stopped answering").count();
    assert!(
        down <= faults,
        "{down} outage lines for {faults} fault phases"
    );
    assert!(
        down >= 1 && text.contains("the object store answers again"),
        "the outage and the recovery are logged: {down}"
    );

    down
}

struct Report<'a> {
    seed: u64,
    phases: usize,
    faults: usize,
    started: Instant,
    external: bool,
    store: &'a Store,
    c: &'a Campaign,
    unacked_present: usize,
    listed: usize,
    recovery: Duration,
    s3: &'a kvtier::S3Stats,
    down: usize,
    proxy: &'a FaultProxy,
}

fn report(r: &Report<'_>) {
    let Report {
        seed,
        phases,
        faults,
        started,
        external,
        store,
        c,
        unacked_present,
        listed,
        recovery,
        s3,
        down,
        proxy,
    } = r;
    println!(
        "s3 fault campaign: seed {seed}, {} phases ({faults} faults), {:.1} s, endpoint {}",
        phases,
        started.elapsed().as_secs_f64(),
        if *external {
            &store.endpoint
        } else {
            "local s3s-fs"
        }
    );
    println!(
        "| phase | steps | S3 loads ok / failed | uploads acked / failed | NVMe loads ok | max S3 job ms | max NVMe job ms | max lookup call µs |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (p, t) in &c.tally {
        println!(
            "| {p:?} | {} | {} / {} | {} / {} | {} | {} | {:.1} | {} |",
            t.steps,
            t.s3_loads_ok,
            t.s3_loads_failed,
            t.stores_ok,
            t.stores_upload_failed,
            t.nvme_loads_ok,
            t.max_s3_job.as_millis(),
            t.max_nvme_job.as_secs_f64() * 1e3,
            t.max_lookup_call.as_micros()
        );
    }
    println!(
        "wrong bytes served: 0; acknowledged uploads {} all exact; failed uploads {} ({unacked_present} \
         present, exact); {} objects listed, all exact; recovery (all {SEEDED} S3 keys loaded) {} ms; \
         GET requests {} retries {} errors {}; PUT requests {} retries {} errors {}; outage log \
         lines {down}; proxy: {} connections, {} answered with an error, {} stalled, {} closed, \
         {} refused upstream; budget per job {} ms",
        c.acked.len(),
        c.unacked.len(),
        listed,
        recovery.as_millis(),
        s3.get.requests,
        s3.get.retries,
        s3.get.errors,
        s3.put.requests,
        s3.put.retries,
        s3.put.errors,
        proxy.counts.accepted.load(std::sync::atomic::Ordering::Relaxed),
        proxy
            .counts
            .answered_with_error
            .load(std::sync::atomic::Ordering::Relaxed),
        proxy.counts.stalled.load(std::sync::atomic::Ordering::Relaxed),
        proxy.counts.closed.load(std::sync::atomic::Ordering::Relaxed),
        proxy
            .counts
            .upstream_refused
            .load(std::sync::atomic::Ordering::Relaxed),
        BUDGET.as_millis()
    );
}
