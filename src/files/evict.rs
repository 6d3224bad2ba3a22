//! Eviction of the `files` layout (LRU per worker, unlink, release the bytes) and demotion of
//! evicted files to the cold tier (`s3.write = "on_evict"`: open, read into a staging slot
//! with the xattr crc, hand over, close, unlink).

use std::sync::atomic::Ordering;

use crate::key::Key;
use crate::worker::{Context, Removal};
use crate::Errno;

use super::layout::{FilesLayout, Kind, Op, State, Step};

impl FilesLayout {
    pub(super) fn evict(&mut self, cx: &mut Context<Op>, d: usize, n: usize) -> usize {
        let victims = self.index.victims(d, n);
        let mut started = 0;
        for key in victims {
            let Some(dest) = self.devs[d].path_of(&key) else {
                continue;
            };
            // With demotion, a victim is read into a staging slot first; with none free, wait
            // for one to come back rather than evict without demoting (the S3 tier gives them
            // back as soon as it has copied them, however slow the upload).
            let staging = match cx.demote() {
                None => None,
                Some(m) => match m.take_staging() {
                    Some(s) => Some(s),
                    None if m.will_free() => break,
                    None => {
                        cx.metrics()
                            .demotions_dropped
                            .fetch_add(1, Ordering::Relaxed);
                        None
                    }
                },
            };
            let Some(idx) = Self::alloc(cx, Kind::Remove) else {
                if let (Some(s), Some(m)) = (staging, cx.demote()) {
                    m.put_back(s);
                }
                break;
            };
            self.start_removal(cx, idx, key, d, dest, staging, Removal::Evicted);
            started += 1;
        }
        started
    }

    /// Removes `key` now if it is stored here and no I/O reads it (the caller asked:
    /// [`crate::Engine::remove`]): unindexed and unpublished at once, its file unlinked like an
    /// evicted one's, never demoted. False when it is not stored, busy, or no op is free.
    pub(super) fn remove_key(&mut self, cx: &mut Context<Op>, key: Key) -> bool {
        let Some(e) = self.index.get(&key) else {
            return false;
        };
        if e.state != State::Valid || e.pins != 0 {
            return false;
        }
        let d = e.dev as usize;
        let Some(dest) = self.devs[d].path_of(&key) else {
            return false;
        };
        let Some(idx) = Self::alloc(cx, Kind::Remove) else {
            return false;
        };
        self.start_removal(cx, idx, key, d, dest, None, Removal::Asked);
        true
    }

    /// Starts op `idx` removing stored `key` (file `dest` on device `d`): unindexed and
    /// unpublished now, counted as `why` says, its file read into `staging` first (a demotion)
    /// or unlinked at once; the op ends by releasing the file's bytes.
    #[allow(clippy::too_many_arguments)]
    fn start_removal(
        &mut self,
        cx: &mut Context<Op>,
        idx: u32,
        key: Key,
        d: usize,
        dest: std::path::PathBuf,
        staging: Option<u32>,
        why: Removal,
    ) {
        let entry = self.unindex(cx, &key);
        cx.announce_removed(vec![key]);
        why.count(cx.metrics().dev(d));
        let block_bytes = cx.block_bytes();
        let op = &mut cx.ops[idx as usize];
        op.begin(if staging.is_some() {
            Step::Open
        } else {
            Step::Unlink
        });
        op.staging = staging;
        op.key = Some(key);
        op.dev = d as u16;
        op.dest = dest;
        op.bytes = if entry.is_some_and(|e| e.counted) {
            block_bytes
        } else {
            0
        };
        op.resolved = true;
        if let Some(m) = cx.demote().filter(|_| staging.is_some()) {
            m.started();
        }
        self.removals_in_flight += 1;
        self.push_step(cx, idx);
    }

    /// A demotion opened the evicted file: read it (with its crc), or give the staging slot
    /// back and remove it anyway.
    pub(super) fn on_demote_open(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        if result < 0 {
            Self::end_demotion(cx, idx, None);
            cx.ops[idx as usize].go(Step::Unlink);
            self.push_step(cx, idx);
            return;
        }
        self.start_read(cx, idx, result);
    }

    /// The evicted file is in its staging slot: hand it to the S3 tier, close, remove.
    pub(super) fn on_demote_read(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        let op = &cx.ops[idx as usize];
        let demoted = (result == cx.block_bytes() as i32)
            .then_some(op.key)
            .flatten()
            .map(|k| (k, op.crc));
        if demoted.is_none() {
            cx.log_error(&format!(
                "reading evicted {} for demotion: {}",
                cx.ops[idx as usize].dest.display(),
                if result < 0 {
                    Errno::from_raw(-result).desc().to_owned()
                } else {
                    format!("{result} bytes")
                }
            ));
        }
        Self::end_demotion(cx, idx, demoted);
        cx.ops[idx as usize].go(Step::Close);
        self.push_step(cx, idx);
    }

    fn end_demotion(cx: &mut Context<Op>, idx: u32, demoted: Option<(Key, Option<u32>)>) {
        let Some(staging) = cx.ops[idx as usize].staging.take() else {
            return;
        };
        let block_bytes = cx.block_bytes() as usize;
        let me = cx.worker_shared();
        let Some(m) = cx.demote() else {
            return;
        };
        let counter = if m.finished(staging, block_bytes, demoted, &me) {
            &cx.metrics().demotions
        } else {
            &cx.metrics().demotions_dropped
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn on_unlink(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        let op = &cx.ops[idx as usize];
        let d = op.dev as usize;
        // Only the process whose unlink succeeded gives the bytes back.
        if result == 0 {
            self.devs[d].unreserve(cx, op.bytes);
        } else if result != -(Errno::ENOENT as i32) {
            let e = Errno::from_raw(-result);
            let msg = format!("removing {}: {}", op.dest.display(), e.desc());
            cx.log_error(&msg);
        }
        self.removals_in_flight -= 1;
        if let Some(failure) = cx.ops[idx as usize].pending_failure.take() {
            // A corrupt block's load: its failure goes out now that the file is removed.
            Self::finish_load(cx, idx, Err(failure));
        }
        self.release(cx, idx);
    }
}
