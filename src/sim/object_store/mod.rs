//! A simulated object store: a `ColdTier` that the simulator steps from its one thread, with
//! faults drawn from a seed, so the cold tier's schedule replays with the workers'.
//!
//! It plays the S3 tier's part in the engine, with the same contract: lookups answer from a
//! `Verdicts` cache and queue one HEAD per unknown key; a load of a key no worker holds (or
//! one a worker found gone, through `ColdTier::miss_fallback`) is a GET into the job's block,
//! optionally promoted into NVMe through the router (within `queue_blocks_max`, else served
//! from the store alone); a write-through store uploads after its NVMe half (`write_ack =
//! "both"`: the job reports after the uploads; `"nvme"`: copies first, reports, uploads in the
//! background); evicted blocks arrive as `Demotion`s and are checked against their crc32c
//! before upload.
//!
//! Faults, per request: an error (the key fails `Remote`), a timeout (fails `Remote` too; a
//! PUT that timed out may still have landed), a slow answer (the request waits up to
//! `max_delay_steps` of the store's steps, so answers come out of order), and lost objects (an
//! object the store held disappears, as with a lifecycle rule or an operator's delete). A
//! power loss ([`SimObjectStore::crash`]) drops every request under way; a PUT already sent may
//! or may not land.
//!
//! What the campaign checks against it: every object's bytes ([`SimObjectStore::object`],
//! [`SimObjectStore::check_each`]),
//! the keys whose upload the store acknowledged, and the objects it lost.

mod serve;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use kvtier_sys::blocks::Lease;

use crate::config::{S3Write, WriteAck};
use crate::job::{JobResult, JobState, Shared};
use crate::key::Key;
use crate::route::Router;
use crate::verdicts::{Verdict, Verdicts};
use crate::worker::Demotion;

use super::Rng;

/// Fault rates of the simulated object store, in parts per million of requests.
#[derive(Clone, Copy, Debug, Default)]
pub struct ObjectFaults {
    pub error_ppm: u32,
    pub timeout_ppm: u32,
    /// Per store step: one object the store holds disappears.
    pub lose_ppm: u32,
    /// A request waits up to this many store steps before it is answered.
    pub max_delay_steps: u32,
}

/// How the tier is configured (the `[s3]` settings the simulation varies).
#[derive(Clone, Copy, Debug)]
pub struct ObjectSettings {
    pub write: S3Write,
    pub write_ack: WriteAck,
    pub promote_on_load: bool,
}

/// Background copies (`write_ack = "nvme"`) waiting for their PUT, at most: past it a copy is
/// dropped and counted, as the S3 tier's `upload_queue_blocks` does, so a slow store never
/// holds up stores and its queue stays bounded.
pub const UPLOAD_QUEUE_MAX: usize = 16;

/// What the store did, for the campaign's report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ObjectCounts {
    pub gets_served: u64,
    pub puts_landed: u64,
    pub demotions: u64,
    pub promotions: u64,
    pub promotions_skipped: u64,
    pub errors: u64,
    pub timeouts: u64,
    pub lost: u64,
    pub copies_dropped: u64,
}

/// One request under way.
enum Request {
    Head {
        key: Key,
        generation: u64,
    },
    Get {
        job: Arc<JobState>,
        index: usize,
    },
    /// The upload half of a write-through store job (`write_ack = "both"`), reported after it.
    UploadJob(Upload),
    /// A background PUT of a copy (`write_ack = "nvme"`, or a demotion copied out).
    Put {
        key: Key,
        body: Vec<u8>,
    },
    /// An evicted block in its worker's staging slot.
    Demote(Demotion),
}

struct Upload {
    nvme: JobResult,
    keys: Vec<Key>,
    blocks: Vec<u32>,
    lease: Arc<Lease>,
}

struct Queued {
    /// The store step from which it may be answered.
    ready_at: u64,
    req: Request,
}

/// Where results go: the cluster this store serves (set again after a restart).
struct Conn {
    shared: Arc<Shared>,
    router: Arc<Router>,
}

struct State {
    rng: Rng,
    faults: ObjectFaults,
    /// Object bytes by key bytes (ordered, so a seed picks the same object to lose).
    objects: BTreeMap<Vec<u8>, (Key, Vec<u8>)>,
    /// Keys whose upload the store answered with success, and what it lost since.
    acknowledged: HashSet<Vec<u8>>,
    lost: HashSet<Vec<u8>>,
    verdicts: Verdicts,
    /// PUTs landed since [`SimObjectStore::take_landed`] last ran.
    landed: Vec<(Key, Vec<u8>)>,
    queue: Vec<Queued>,
    step: u64,
    counts: ObjectCounts,
}

/// The simulated object store; see the module docs.
pub struct SimObjectStore {
    me: Weak<SimObjectStore>,
    settings: ObjectSettings,
    block_bytes: usize,
    state: Mutex<State>,
    conn: Mutex<Option<Arc<Conn>>>,
}

/// How a request turned out, drawn before it runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Draw {
    Ok,
    Error,
    Timeout,
}

impl SimObjectStore {
    pub fn new(seed: u64, settings: ObjectSettings, block_bytes: usize) -> Arc<SimObjectStore> {
        Arc::new_cyclic(|me| SimObjectStore {
            me: me.clone(),
            settings,
            block_bytes,
            state: Mutex::new(State {
                rng: Rng::new(seed ^ 0x000B_1EC7),
                faults: ObjectFaults::default(),
                objects: BTreeMap::new(),
                acknowledged: HashSet::new(),
                lost: HashSet::new(),
                // Answers never age: the simulation runs on steps, not the wall clock.
                verdicts: Verdicts::new(1 << 16, Duration::from_secs(1 << 20)),
                landed: Vec::new(),
                queue: Vec::new(),
                step: 0,
                counts: ObjectCounts::default(),
            }),
            conn: Mutex::new(None),
        })
    }

    pub fn settings(&self) -> ObjectSettings {
        self.settings
    }

    pub fn set_faults(&self, faults: ObjectFaults) {
        self.lock().faults = faults;
    }

    /// Connects the store to the cluster it serves: where results and promotions go.
    pub(crate) fn connect(&self, shared: Arc<Shared>, router: Arc<Router>) {
        *self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(Arc::new(Conn { shared, router }));
    }

    fn conn(&self) -> Arc<Conn> {
        self.conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .expect("the simulated object store is connected before its first request")
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn push(&self, req: Request) {
        let mut s = self.lock();
        let delay = u64::from(s.faults.max_delay_steps);
        let ready_at = s.step + s.rng.below(delay + 1);
        s.queue.push(Queued { ready_at, req });
    }

    /// Requests under way.
    pub fn queued(&self) -> usize {
        self.lock().queue.len()
    }

    /// Answers one request whose delay has passed (drawn from the seed among them), and maybe
    /// loses an object; true if it answered one. Never holds its lock while reporting.
    pub fn step(&self) -> bool {
        let (req, draw) = {
            let mut guard = self.lock();
            let s = &mut *guard;
            s.step += 1;
            let lose = s.faults.lose_ppm;
            if s.rng.hit(lose) && !s.objects.is_empty() {
                let i = s.rng.below(s.objects.len() as u64) as usize;
                let name = s.objects.keys().nth(i).cloned().expect("i < len");
                let (key, _) = s.objects.remove(&name).expect("listed");
                s.lost.insert(name);
                s.verdicts.set(key, Verdict::Absent);
                s.counts.lost += 1;
            }
            let now = s.step;
            let ready: Vec<usize> = (0..s.queue.len())
                .filter(|&i| s.queue[i].ready_at <= now)
                .collect();
            if ready.is_empty() {
                return false;
            }
            let pick = ready[s.rng.below(ready.len() as u64) as usize];
            let req = s.queue.swap_remove(pick).req;
            let draw = s.draw();
            (req, draw)
        };
        match req {
            Request::Head { key, generation } => self.head(key, generation, draw),
            Request::Get { job, index } => self.get(&job, index, draw),
            Request::UploadJob(u) => self.upload_job(u),
            // A background PUT that fails is dropped (the S3 tier counts and logs it).
            Request::Put { key, body } => {
                let _ = self.put(key, &body, draw);
            }
            Request::Demote(d) => self.demote(d, draw),
        }
        true
    }

    /// Power is lost with requests under way: none of them reports (the process is gone); a
    /// PUT already under way lands or not, drawn from the seed. The objects stay.
    pub fn crash(&self) {
        let queue = std::mem::take(&mut self.lock().queue);
        for q in queue {
            match q.req {
                Request::Put { key, body } => {
                    if self.lock().rng.below(2) == 1 {
                        self.land(key, &body);
                    }
                }
                Request::UploadJob(u) => {
                    for (key, block) in u.keys.iter().zip(&u.blocks) {
                        if self.lock().rng.below(2) == 1 {
                            let body = self.read_block(&u.lease, *block);
                            self.land(*key, &body);
                        }
                    }
                }
                Request::Demote(_) | Request::Head { .. } | Request::Get { .. } => {}
            }
        }
        *self
            .conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        // A new process starts with an empty cache.
        self.lock().verdicts = Verdicts::new(1 << 16, Duration::from_secs(1 << 20));
    }

    /// Calls `f` with every object held (key, bytes), in name order, until it fails.
    pub fn check_each(
        &self,
        mut f: impl FnMut(&Key, &[u8]) -> Result<(), String>,
    ) -> Result<(), String> {
        self.lock().objects.values().try_for_each(|(k, b)| f(k, b))
    }

    /// The bytes of `key`'s object, if the store holds it.
    pub fn object(&self, key: &Key) -> Option<Vec<u8>> {
        self.lock()
            .objects
            .get(key.as_bytes())
            .map(|(_, b)| b.clone())
    }

    pub fn holds(&self, key: &Key) -> bool {
        self.lock().objects.contains_key(key.as_bytes())
    }

    /// The PUTs that landed since the last call: (key, bytes), in the order they landed.
    pub fn take_landed(&self) -> Vec<(Key, Vec<u8>)> {
        std::mem::take(&mut self.lock().landed)
    }

    /// Whether the store acknowledged an upload of `key`, and whether it lost the object since.
    pub fn acknowledged(&self, key: &Key) -> bool {
        self.lock().acknowledged.contains(key.as_bytes())
    }

    pub fn was_lost(&self, key: &Key) -> bool {
        self.lock().lost.contains(key.as_bytes())
    }

    pub fn counts(&self) -> ObjectCounts {
        self.lock().counts
    }

    /// A copy of block `block` of the store job holding `lease` (in its client's region).
    fn read_block(&self, lease: &Lease, block: u32) -> Vec<u8> {
        let at = block as usize * self.block_bytes;
        lease.with_bytes(at, self.block_bytes, <[u8]>::to_vec)
    }

    /// A PUT reached the store: the object is replaced.
    fn land(&self, key: Key, body: &[u8]) {
        let mut s = self.lock();
        let name = key.as_bytes().to_vec();
        s.lost.remove(&name);
        s.objects.insert(name, (key, body.to_vec()));
        s.landed.push((key, body.to_vec()));
        s.counts.puts_landed += 1;
    }
}

impl ObjectCounts {
    pub fn add(&mut self, o: &ObjectCounts) {
        self.gets_served += o.gets_served;
        self.puts_landed += o.puts_landed;
        self.demotions += o.demotions;
        self.promotions += o.promotions;
        self.promotions_skipped += o.promotions_skipped;
        self.errors += o.errors;
        self.timeouts += o.timeouts;
        self.lost += o.lost;
        self.copies_dropped += o.copies_dropped;
    }
}

impl State {
    fn draw(&mut self) -> Draw {
        let f = self.faults;
        if self.rng.hit(f.error_ppm) {
            self.counts.errors += 1;
            Draw::Error
        } else if self.rng.hit(f.timeout_ppm) {
            self.counts.timeouts += 1;
            Draw::Timeout
        } else {
            Draw::Ok
        }
    }
}
