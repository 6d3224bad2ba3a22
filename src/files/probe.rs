//! Lookups of blocks this worker has not indexed: another process (kvtier or vLLM) sharing the
//! directory may have published them since the scan at open. The caller never makes a system
//! call for them: `Engine::lookup` answers Pending and sends the key here, where one `STATX`
//! on the ring (`AT_SYMLINK_NOFOLLOW`: a symlink at the block path is not a block) finds out.
//!
//! ```text
//! probe: statx <hhh>/<hh>_g<g>/<hash>.bin ─► regular file of one block: index + publish
//!                                         └► anything else, or an error: absent (TTL)
//! ```
//!
//! Probes are the worker's lowest priority: started after loads and stores, at most
//! [`PROBES_IN_FLIGHT`] at a time.

use std::sync::atomic::Ordering;

use crate::key::Key;
use crate::verdicts::Verdict;
use crate::worker::Context;
use kvtier_sys::ring::StatxInfo;

use super::layout::{FilesLayout, Kind, Op, Step};

/// Probe ops in flight per worker at most: they share the op table with loads and stores.
pub(super) const PROBES_IN_FLIGHT: usize = 32;

impl FilesLayout {
    /// Queues `keys` (each with its question's generation) and starts what it may.
    pub(super) fn queue_probes(&mut self, cx: &mut Context<Op>, keys: Vec<(Key, u64)>) {
        self.probes.extend(keys);
        self.start_probes(cx);
    }

    /// Starts queued probes while op room allows; true if any started or was answered.
    pub(super) fn start_probes(&mut self, cx: &mut Context<Op>) -> bool {
        let mut any = false;
        while cx.stopping() || self.probes_in_flight < PROBES_IN_FLIGHT {
            let Some(&(key, generation)) = self.probes.front() else {
                break;
            };
            let d = key.device(self.devs.len());
            let dest = self.devs[d].path_of(&key);
            let current = cx.unindexed().current(&key, generation);
            let start = match dest {
                // Stopping (no one waits for the answer), a key that is not a files-layout
                // key, or a failed device: absent without I/O.
                _ if !current => None,
                Some(dest) if !cx.stopping() && !cx.device_failed(d) => Some(dest),
                _ => {
                    cx.unindexed().answer(key, generation, Verdict::Absent);
                    None
                }
            };
            if let Some(dest) = start {
                if self.index.contains(&key) {
                    // Indexed since the question (stored or loaded here): published already.
                    cx.unindexed().forget(key, generation);
                } else {
                    let Some(idx) = Self::alloc(cx, Kind::Probe) else {
                        break;
                    };
                    let op = &mut cx.ops[idx as usize];
                    op.begin(Step::Stat);
                    op.key = Some(key);
                    op.dev = d as u16;
                    op.dest = dest;
                    op.generation = generation;
                    if !self.try_push_step(cx, idx) {
                        self.release(cx, idx);
                        break;
                    }
                    self.probes_in_flight += 1;
                }
            }
            // Answered, dropped (replaced or evicted from the cache since) or in flight: out
            // of the queue, whose bound the callers keep through this count.
            self.probes.pop_front();
            cx.question_taken();
            any = true;
        }
        any
    }

    /// The `statx` of probe `idx` completed.
    pub(super) fn on_stat(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        // Always taken, so the buffer does not stay behind in the ring.
        let user_data = cx.ops.user_data(idx, 0);
        let info = cx
            .backend()
            .file_queue()
            .take_file_value(user_data)
            .and_then(|buf| StatxInfo::parse(&buf));
        let op = &cx.ops[idx as usize];
        let (key, dev, generation) = (op.key.expect("a probe has a key"), op.dev, op.generation);
        let found =
            result == 0 && info.is_some_and(|i| i.is_regular() && i.size == cx.block_bytes());
        self.release(cx, idx);
        self.probes_in_flight -= 1;
        let m = cx.metrics().dev(dev as usize);
        if found {
            &m.probes_found
        } else {
            &m.probes_absent
        }
        .fetch_add(1, Ordering::Relaxed);
        if found {
            if !self.index.contains(&key) {
                // Published by another process: index it, as a load that finds it does.
                self.publish(cx, key, dev, false);
            }
            cx.unindexed().forget(key, generation);
        } else {
            cx.unindexed().answer(key, generation, Verdict::Absent);
        }
        self.start_probes(cx);
    }

    /// Nothing queued or in flight.
    pub(super) fn probes_idle(&self) -> bool {
        self.probes.is_empty() && self.probes_in_flight == 0
    }
}
