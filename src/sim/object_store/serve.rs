//! How the simulated object store answers: the [`ColdTier`] calls that queue requests, and the
//! handlers [`SimObjectStore::step`] runs for them (HEAD, GET with promotion, PUT, the upload
//! half of a write-through job, demotion).

use std::sync::Arc;

use kvtier_sys::blocks::Lease;

use crate::cold::{ColdTier, DemoteFn};
use crate::config::{S3Write, WriteAck};
use crate::job::{Job, JobKind, JobResult, JobState, KeyFailure, MissFallback};
use crate::key::Key;
use crate::metrics::S3Stats;
use crate::tier::{Lookup, Tier};
use crate::verdicts::Verdict;
use crate::worker::Demotion;

use super::{Conn, Draw, Request, SimObjectStore, Upload, UPLOAD_QUEUE_MAX};

impl SimObjectStore {
    /// One PUT; `Err` with the failure the job reports. A timed-out PUT may have landed.
    pub(super) fn put(
        &self,
        key: Key,
        body: &[u8],
        draw: Draw,
    ) -> Result<u64, (KeyFailure, String)> {
        match draw {
            Draw::Ok => {
                self.land(key, body);
                let mut s = self.lock();
                s.acknowledged.insert(key.as_bytes().to_vec());
                s.verdicts.set(key, Verdict::Present);
                Ok(body.len() as u64)
            }
            Draw::Error => Err((
                KeyFailure::Remote,
                "PUT: 500 InternalError (simulated)".into(),
            )),
            Draw::Timeout => {
                if self.lock().rng.below(2) == 1 {
                    self.land(key, body);
                }
                Err((KeyFailure::Remote, "PUT: timed out (simulated)".into()))
            }
        }
    }

    pub(super) fn head(&self, key: Key, generation: u64, draw: Draw) {
        let mut s = self.lock();
        // As the S3 tier does (vLLM's rule): a failed lookup is a miss.
        let verdict = if draw == Draw::Ok && s.objects.contains_key(key.as_bytes()) {
            Verdict::Present
        } else {
            Verdict::Absent
        };
        s.verdicts.answer(key, generation, verdict);
    }

    pub(super) fn get(&self, job: &Arc<JobState>, index: usize, draw: Draw) {
        let conn = self.conn();
        let key = job.job.keys[index];
        let block = job.job.blocks[index];
        let object = self
            .lock()
            .objects
            .get(key.as_bytes())
            .map(|(_, b)| b.clone());
        let failure = match (draw, object) {
            (Draw::Error, _) => Some((KeyFailure::Remote, "GET: 500 InternalError (simulated)")),
            (Draw::Timeout, _) => Some((KeyFailure::Remote, "GET: timed out (simulated)")),
            (Draw::Ok, None) => Some((KeyFailure::Miss, "not stored locally, nor in the store")),
            (Draw::Ok, Some(body)) => {
                let at = block as usize * self.block_bytes;
                match job.lease() {
                    Some(lease) => {
                        lease.write(at, &body);
                        None
                    }
                    None => Some((
                        KeyFailure::InvalidJob,
                        "a load from the object store needs the job's lease on its blocks",
                    )),
                }
            }
        };
        if let Some((reason, detail)) = failure {
            // The livelock fix: a failed load makes the key a miss until asked again.
            self.lock().verdicts.set(key, Verdict::Absent);
            job.fail(&conn.shared, index, reason, detail.into());
            return;
        }
        {
            let mut s = self.lock();
            s.verdicts.set(key, Verdict::Present);
            s.counts.gets_served += 1;
        }
        let bytes = self.block_bytes as u64;
        if self.settings.promote_on_load {
            self.promote(&conn, job, index, key, block, bytes);
        } else {
            job.succeed(&conn.shared, index, bytes);
        }
    }

    /// Stores a block just loaded into NVMe under the load's lease; the load reports after it,
    /// or at once when the workers' queues are full.
    fn promote(
        &self,
        conn: &Arc<Conn>,
        parent: &Arc<JobState>,
        index: usize,
        key: Key,
        block: u32,
        bytes: u64,
    ) {
        let waiting = Arc::clone(parent);
        let shared = Arc::clone(&conn.shared);
        let then: crate::job::Then = Box::new(move |_: JobResult| {
            waiting.succeed(&shared, index, bytes);
        });
        let state = Arc::new(JobState::serving(
            parent,
            JobKind::Store,
            Job::new(0, vec![key], vec![block]),
            then,
        ));
        let sent = conn.router.try_dispatch(&state);
        let mut s = self.lock();
        if sent {
            s.counts.promotions += 1;
        } else {
            s.counts.promotions_skipped += 1;
            drop(s);
            parent.succeed(&conn.shared, index, bytes);
        }
    }

    pub(super) fn upload_job(&self, u: Upload) {
        let Upload {
            nvme,
            keys,
            blocks,
            lease,
        } = u;
        let conn = self.conn();
        let uploads: Vec<_> = keys
            .iter()
            .zip(&blocks)
            .enumerate()
            .map(|(i, (key, block))| {
                let draw = self.lock().draw();
                let body = self.read_block(&lease, *block);
                (i, self.put(*key, &body, draw))
            })
            .collect();
        conn.shared
            .release_then_deliver(&lease, nvme.with_uploads(uploads), None);
    }

    pub(super) fn demote(&self, d: Demotion, draw: Draw) {
        let mut body = vec![0u8; d.len];
        d.staging
            .with_bytes(d.offset, d.len, |b| body.copy_from_slice(b));
        let (key, crc) = (d.key, d.crc);
        drop(d); // the staging slot is the worker's again
        if crc.is_none_or(|c| crate::checksum::crc32c(&body) == c)
            && self.put(key, &body, draw).is_ok()
        {
            self.lock().counts.demotions += 1;
        }
    }
}

impl ColdTier for SimObjectStore {
    fn lookup(&self, keys: &[Key]) -> Vec<Lookup> {
        let mut asked = Vec::new();
        let answers = {
            let mut s = self.lock();
            keys.iter()
                .map(|k| match s.verdicts.get(k) {
                    Some(Verdict::Present) => Lookup::Hit(Tier::S3),
                    Some(Verdict::Absent) => Lookup::Miss,
                    Some(Verdict::Pending) => Lookup::Pending,
                    None => {
                        let generation = s.verdicts.begin(*k);
                        asked.push(Request::Head {
                            key: *k,
                            generation,
                        });
                        Lookup::Pending
                    }
                })
                .collect()
        };
        for req in asked {
            self.push(req);
        }
        answers
    }

    fn load(&self, job: &Arc<JobState>, items: Vec<u32>) {
        for index in items {
            self.push(Request::Get {
                job: Arc::clone(job),
                index: index as usize,
            });
        }
    }

    fn miss_fallback(&self) -> MissFallback {
        let me = self.me.clone();
        Box::new(move |job: &Arc<JobState>, index: usize| {
            if let Some(me) = me.upgrade() {
                me.push(Request::Get {
                    job: Arc::clone(job),
                    index,
                });
            }
        })
    }

    fn write_through(
        &self,
        keys: &[Key],
        blocks: &[u32],
        lease: &Arc<Lease>,
    ) -> Option<crate::job::Then> {
        if self.settings.write != S3Write::Through {
            return None;
        }
        let (keys, blocks) = (keys.to_vec(), blocks.to_vec());
        let lease = Arc::clone(lease);
        let me = self.me.clone();
        Some(Box::new(move |nvme: JobResult| {
            let Some(me) = me.upgrade() else { return };
            if me.settings.write_ack == WriteAck::Nvme {
                // Copy, report, upload in the background.
                for (key, block) in keys.iter().zip(&blocks) {
                    let waiting = me
                        .lock()
                        .queue
                        .iter()
                        .filter(|q| matches!(q.req, Request::Put { .. }))
                        .count();
                    if waiting >= UPLOAD_QUEUE_MAX {
                        me.lock().counts.copies_dropped += 1;
                        continue;
                    }
                    let body = me.read_block(&lease, *block);
                    me.push(Request::Put { key: *key, body });
                }
                me.conn().shared.release_then_deliver(&lease, nvme, None);
                return;
            }
            me.push(Request::UploadJob(Upload {
                nvme,
                keys,
                blocks,
                lease,
            }));
        }))
    }

    fn demote_sink(&self) -> Option<DemoteFn> {
        if self.settings.write != S3Write::OnEvict {
            return None;
        }
        let me = self.me.clone();
        Some(Box::new(move |d: Demotion| {
            if let Some(me) = me.upgrade() {
                me.push(Request::Demote(d));
            }
        }))
    }

    fn object_name(&self, key: &Key) -> Option<String> {
        Some(key.to_hex())
    }

    fn stats(&self) -> S3Stats {
        S3Stats::default()
    }

    /// Fails every request under way (`Shutdown`); background copies are dropped.
    fn close(&self) {
        let queue = std::mem::take(&mut self.lock().queue);
        let conn = self.conn();
        for q in queue {
            match q.req {
                Request::Get { job, index } => {
                    job.fail(&conn.shared, index, KeyFailure::Shutdown, String::new());
                }
                Request::UploadJob(u) => {
                    let shut =
                        (0..u.keys.len()).map(|i| (i, Err((KeyFailure::Shutdown, String::new()))));
                    conn.shared
                        .release_then_deliver(&u.lease, u.nvme.with_uploads(shut), None);
                }
                Request::Head { .. } | Request::Put { .. } | Request::Demote(_) => {}
            }
        }
    }

    fn stop(&self) {}
}
