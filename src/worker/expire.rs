//! Deadlines on the worker thread: the keys of ops past `io_timeout` fail (`Timeout`), their
//! requests are cancelled where the device lets them be, and a device that keeps timing out
//! is marked failed; at a stop, whether only I/O past its deadline is left.

use std::sync::atomic::Ordering;

use crate::job::{JobKind, KeyFailure};

use super::context::{FAILURE_WINDOW_DEADLINES, FAIL_AFTER_TIMEOUTS};
use super::{overdue_check_interval, Layout, LayoutOp, Worker};

impl<L: Layout> Worker<L> {
    /// Stopping for longer than the deadline with I/O still in flight, and every op of it past
    /// its deadline, so the keys it served have been failed and their jobs reported. Ops
    /// started after the stop (the page writes that flush the slot table, say) have deadlines
    /// of their own: the stop waits for those too.
    pub(super) fn hung_at_stop(&self) -> bool {
        let now = self.cx.ops.now();
        self.stop_at.is_some_and(|at| {
            now.duration_since(at) > self.cx.io_timeout + overdue_check_interval(self.cx.io_timeout)
        }) && self.cx.backend.in_flight() > 0
            && self.cx.ops.all_overdue()
    }

    /// Fails the keys of ops past their deadline (`KeyFailure::Timeout`); each such op keeps
    /// its job's lease until it completes. True if any key failed.
    pub(super) fn expire_overdue(&mut self) -> bool {
        let now = self.cx.ops.now();
        if now < self.next_overdue_check {
            return false;
        }
        let limit = self.cx.io_timeout;
        self.next_overdue_check = now + overdue_check_interval(limit);
        let mut any = self.layout.expire_waiting(&mut self.cx, now, limit);
        for idx in self.cx.ops.take_overdue(now, limit) {
            let what = self.layout.describe_op(&self.cx, idx);
            let d = self.cx.ops[idx as usize].device();
            if self.cx.count_timeout(d) {
                tracing::error!(
                    worker = self.cx.id,
                    device = d,
                    "{what}: the device timed out {FAIL_AFTER_TIMEOUTS} times within {} ms and \
                     is marked failed: its keys are misses (served by the S3 tier when there is \
                     one) and new stores go to the other devices. Check it (dmesg, smartctl) and \
                     restart kvtier to use it again",
                    (limit * FAILURE_WINDOW_DEADLINES).as_millis()
                );
                self.layout.device_failed(&mut self.cx, d);
            }
            self.cx
                .me
                .metrics
                .dev(d)
                .io_timeouts
                .fetch_add(1, Ordering::Relaxed);
            let detail = format!(
                "{what}: no completion within io_timeout_ms = {}; the I/O is still in flight \
                 and the job's region blocks stay leased until the device answers",
                limit.as_millis()
            );
            self.cx.log_error(&detail);
            self.cancel(idx);
            for (job, item, hold) in self.layout.overdue_keys(&self.cx, idx) {
                if job.is_resolved(item) {
                    continue;
                }
                if hold {
                    self.cx.ops.hold(idx, &job);
                }
                let m = &self.cx.me.metrics;
                match job.kind {
                    JobKind::Load => m.loads_failed.fetch_add(1, Ordering::Relaxed),
                    JobKind::Store => m.stores_failed.fetch_add(1, Ordering::Relaxed),
                };
                job.fail(&self.cx.shared, item, KeyFailure::Timeout, detail.clone());
                any = true;
            }
        }
        any
    }

    /// Asks the device to cancel op `idx` (past its deadline): every chunk a store issued, or
    /// the op's one request. What a hung file system blocks in io_uring's kernel workers then
    /// completes early and gives its blocks back; I/O already on a device runs on.
    fn cancel(&mut self, idx: u32) {
        let chunks = self.cx.ops[idx as usize].writing().map_or(1, |c| c.issued);
        for chunk in 0..chunks {
            let user_data = self.cx.ops.user_data(idx, chunk);
            // No room in the queue: the op runs on to its own completion, as without a cancel.
            let _ = self.cx.backend.cancel(user_data);
        }
    }
}
