//! Starting I/O on the worker thread: queued loads first (while the scheduler allows), then
//! stores (retries ahead of new ones) and the chunks of stores already writing, each through
//! the layout; a key a layout answers without I/O leaves its queue here too.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Layout, LayoutOp, Start, Worker};

impl<L: Layout> Worker<L> {
    /// Starts queued loads while the scheduler lets more be in flight. Each is counted in
    /// flight as it leaves the queue ([`WorkQueue::take_load`]); one the layout answers without
    /// I/O, or cannot start this turn, is ended at once (and the latter put back).
    ///
    /// [`WorkQueue::take_load`]: super::WorkQueue::take_load
    pub(super) fn issue_loads(&mut self) -> bool {
        let mut any = false;
        while let Some((job, item)) = self.cx.loads.take_load(&mut self.cx.sched) {
            match self.layout.start_load(&mut self.cx, &job, item) {
                Start::Loading => {}
                Start::Started => unreachable!("a load started as a store"),
                Start::Resolved => self.cx.sched.load_ended(),
                Start::Blocked => {
                    self.cx.sched.load_ended();
                    self.cx.loads.put_back(job, item);
                    break;
                }
            }
            // Started or answered: its queue room is given back.
            self.cx.me.queued_blocks.fetch_sub(1, Ordering::AcqRel);
            any = true;
        }
        any
    }

    pub(super) fn issue_stores(&mut self) -> bool {
        let mut any = false;
        loop {
            let cx = &mut self.cx;
            let front = cx.store_issuing.front().copied();
            let next_bytes = match front {
                Some(idx) => cx.ops[idx as usize].writing().map_or(0, |c| c.len),
                None => cx.sched.chunk_bytes(),
            };
            if !cx.sched.may_issue_store(next_bytes, !cx.loads.is_empty()) {
                break;
            }
            if let Some(idx) = front {
                if !self.issue_chunk(idx) {
                    break;
                }
                any = true;
                continue;
            }
            let (job, item, retried) = match cx.retry.front() {
                Some((job, item)) => (Arc::clone(job), *item, true),
                None => match cx.stores.peek() {
                    Some((job, item)) => (Arc::clone(job), item, false),
                    None => break,
                },
            };
            match self.layout.start_store(&mut self.cx, &job, item, retried) {
                Start::Loading => unreachable!("a store started as a load"),
                Start::Started | Start::Resolved => {
                    if retried {
                        self.cx.retry.pop_front();
                    } else {
                        self.cx.stores.take(&self.cx.me);
                    }
                    any = true;
                }
                Start::Blocked => break,
            }
        }
        any
    }

    /// Issues the next chunk of store `idx`; false if the ring is full.
    fn issue_chunk(&mut self, idx: u32) -> bool {
        let block_bytes = self.cx.block_bytes;
        let chunks = self.cx.ops[idx as usize]
            .writing()
            .expect("an issuing store is writing");
        let chunk = chunks.issued;
        let (start, len) = chunks.range(chunk, block_bytes);
        if !self.layout.push_chunk(&mut self.cx, idx, chunk, start, len) {
            return false;
        }
        let chunks = self.cx.ops[idx as usize]
            .writing()
            .expect("an issuing store is writing");
        chunks.issued += 1;
        let all = chunks.all_issued();
        self.cx.sched.store_issued(len);
        if all {
            let front = self.cx.store_issuing.pop_front();
            debug_assert_eq!(front, Some(idx));
        }
        true
    }
}
