//! Completions on the worker thread: each is decoded to its op and handed to the layout (an
//! op that ends with it, such as a slab load, freed first and its load ended), or, for a store
//! writing its data in chunks, counted here until its last chunk is in.

use std::sync::atomic::Ordering;

use crate::job::KeyFailure;
use crate::Errno;

use super::ops::Completed;
use super::{Layout, LayoutOp, Worker};
use crate::io::io_outcome;

impl<L: Layout> Worker<L> {
    pub(super) fn reap(&mut self) -> bool {
        let mut out = std::mem::take(&mut self.completions);
        out.clear();
        self.cx.backend.complete(&mut out);
        let any = !out.is_empty();
        for c in &out {
            match self.cx.ops.complete(c.user_data) {
                Completed::Ended { op, load, holds } => {
                    if load {
                        self.cx.sched.load_ended();
                    }
                    self.layout.on_ended(&mut self.cx, op, c.result);
                    // Its job's blocks may go back now (an op past its deadline kept them).
                    drop(holds);
                }
                Completed::Live { idx, chunk } => {
                    if self.cx.ops[idx as usize].writing().is_some() {
                        self.on_chunk_done(idx, chunk, c.result);
                    } else {
                        self.layout.on_complete(&mut self.cx, idx, c.result);
                    }
                }
            }
        }
        self.completions = out;
        any
    }

    fn on_chunk_done(&mut self, idx: u32, chunk: u16, result: i32) {
        // A device error names the op (a full file system is not one: the store evicts or
        // says so).
        let failing = (result < 0
            && crate::metrics::ErrClass::of(Errno::from_raw(-result))
                != crate::metrics::ErrClass::NoSpace)
            .then(|| self.layout.describe_op(&self.cx, idx));
        let cx = &mut self.cx;
        let block_bytes = cx.block_bytes;
        let d = cx.ops[idx as usize].device();
        let chunks = cx.ops[idx as usize].writing().expect("checked by reap");
        let (_, len) = chunks.range(chunk, block_bytes);
        chunks.done += 1;
        let m = cx.me.metrics.dev(d);
        m.write_ops.fetch_add(1, Ordering::Relaxed);
        match io_outcome(result, len) {
            Ok(()) => {
                m.bytes_written.fetch_add(len, Ordering::Relaxed);
                cx.device_ok(d, || self.layout.device_name(d));
            }
            Err(reason) => {
                m.count_result(result, len);
                let detail = match reason {
                    KeyFailure::Io(e) => format!("write: {}", e.desc()),
                    _ => "short write".to_owned(),
                };
                let logged = failing.map(|what| format!("{what}: {detail}"));
                chunks.fail(reason, detail);
                // Stop issuing the rest of a failed block.
                if chunks.cut() {
                    cx.store_issuing.retain(|&i| i != idx);
                }
                if let Some(line) = logged {
                    cx.device_error(d, &line);
                }
            }
        }
        cx.sched.store_done(len);
        let chunks = cx.ops[idx as usize].writing().expect("checked by reap");
        if chunks.finished() {
            let failure = chunks.failure.take();
            self.layout.on_written(&mut self.cx, idx, failure);
        }
    }
}
