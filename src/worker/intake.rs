//! What reaches a worker through its channel, taken at the start of each turn: work parts
//! queued as loads or stores (failed at once after a stop), touches, key lists, removals,
//! lookups' questions, and the stop itself.

use crate::job::{JobKind, KeyFailure};

use super::{Layout, LayoutOp, Msg, Worker};

impl<L: Layout> Worker<L> {
    pub(super) fn intake(&mut self) -> bool {
        let mut any = false;
        while let Ok(msg) = self.rx.try_recv() {
            any = true;
            match msg {
                Msg::Work(part) => {
                    if self.cx.stopping {
                        self.cx.cancel_part(&part);
                        continue;
                    }
                    match part.job.kind {
                        JobKind::Load => self.cx.loads.push(part),
                        JobKind::Store => self.cx.stores.push(part),
                    }
                }
                Msg::Touch(keys) => {
                    for key in keys {
                        self.layout.touch(key);
                    }
                }
                Msg::Keys(reply) => {
                    let _ = reply.send(self.layout.keys());
                }
                Msg::Remove(keys, reply) => {
                    let removed = keys
                        .into_iter()
                        .map(|(i, key)| (i, self.layout.remove(&mut self.cx, key)))
                        .collect();
                    let _ = reply.send(removed);
                }
                Msg::Probe(keys, first) => {
                    let questions = self.cx.questions(keys, first);
                    self.layout.probe(&mut self.cx, questions);
                }
                Msg::Stop => self.stop(),
            }
        }
        any
    }

    /// Fails everything queued and not yet started; stores stop issuing chunks (and fail once
    /// the issued ones complete); I/O in flight runs to completion.
    fn stop(&mut self) {
        self.stop_at.get_or_insert_with(|| self.cx.ops.now());
        let issuing = self.cx.cancel_queued();
        for idx in issuing {
            let chunks = self.cx.ops[idx as usize]
                .writing()
                .expect("an issuing store is writing");
            chunks.fail(KeyFailure::Shutdown, String::new());
            chunks.cut();
            if chunks.finished() {
                let failure = chunks.failure.take();
                self.layout.on_written(&mut self.cx, idx, failure);
            }
        }
    }
}
