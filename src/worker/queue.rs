//! What a worker is sent ([`Msg`]) and its queues of blocks not yet started ([`WorkQueue`]).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::config::FirstLookup;
use crate::job::{JobState, KeyFailure, Shared};
use crate::key::Key;
use crate::worker::shared::WorkerShared;

/// Work for one worker: the indexes of the job's keys that hash to it.
pub(crate) struct Part {
    pub job: Arc<JobState>,
    pub items: Vec<u32>,
}

impl Part {
    /// Fails the items from `from` on with `KeyFailure::Shutdown`; returns how many (the
    /// caller gives their queue room back).
    pub fn fail_from(&self, from: usize, shared: &Shared) -> usize {
        for &item in &self.items[from..] {
            self.job
                .fail(shared, item as usize, KeyFailure::Shutdown, String::new());
        }
        self.items.len() - from
    }
}

pub(crate) enum Msg {
    Work(Part),
    /// Mark these keys recently used (the caller served them from its own cache).
    Touch(Vec<Key>),
    /// Send back every key stored (`Engine::keys`).
    Keys(crossbeam_channel::Sender<Vec<Key>>),
    /// Remove these keys (each with its index in the caller's list) and answer which were
    /// (`Engine::remove`).
    Remove(Vec<(u32, Key)>, crossbeam_channel::Sender<Removed>),
    /// The files layout: lookups asked whether these keys' block files exist (another process
    /// may have published them); the worker puts a question to the device for each not asked
    /// already, recorded as `FirstLookup` says until its answer ([`Context::questions`]).
    ///
    /// [`Context::questions`]: crate::worker::Context::questions
    Probe(Vec<Key>, FirstLookup),
    Stop,
}

/// The end of a stop, once worker `me` has stopped taking messages: work that reached its
/// channel afterwards (promotions and write-through halves the S3 tier started as the stop
/// began) is failed, so every job is reported exactly once; removals are answered "not
/// removed". `Engine::shutdown` and the simulator's `Cluster::finish_stop` both run it.
pub(crate) fn fail_left_behind(
    rx: &crossbeam_channel::Receiver<Msg>,
    me: &WorkerShared,
    shared: &crate::job::Shared,
) {
    while let Ok(msg) = rx.try_recv() {
        match msg {
            Msg::Work(part) => {
                me.queued_blocks
                    .fetch_sub(part.items.len(), Ordering::AcqRel);
                part.fail_from(0, shared);
            }
            Msg::Remove(keys, reply) => {
                let _ = reply.send(keys.into_iter().map(|(i, _)| (i, false)).collect());
            }
            Msg::Touch(_) | Msg::Keys(_) | Msg::Probe(..) | Msg::Stop => {}
        }
    }
}

/// A worker's answer to [`Msg::Remove`]: each key's index in the caller's list, and whether
/// it was removed.
pub(crate) type Removed = Vec<(u32, bool)>;

#[derive(Default)]
pub(crate) struct WorkQueue {
    pub parts: VecDeque<Part>,
    pub cursor: usize,
    /// Blocks not yet taken (mirrors the metrics gauge).
    pub blocks: usize,
}

impl WorkQueue {
    pub fn push(&mut self, part: Part) {
        self.blocks += part.items.len();
        self.parts.push_back(part);
    }

    pub fn peek(&self) -> Option<(&Arc<JobState>, usize)> {
        let part = self.parts.front()?;
        Some((&part.job, part.items[self.cursor] as usize))
    }

    /// Moves past the peeked item, which the worker has taken up, and gives back its queue room.
    pub fn take(&mut self, me: &WorkerShared) {
        me.queued_blocks.fetch_sub(1, Ordering::AcqRel);
        self.cursor += 1;
        self.blocks -= 1;
        if let Some(part) = self.parts.front() {
            if self.cursor >= part.items.len() {
                self.parts.pop_front();
                self.cursor = 0;
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Fails every block not yet taken with `KeyFailure::Shutdown`; returns how many.
    pub fn cancel(&mut self, shared: &Shared) -> usize {
        let cursor = self.cursor;
        let parts: Vec<Part> = self.parts.drain(..).collect();
        self.cursor = 0;
        self.blocks = 0;
        parts
            .iter()
            .enumerate()
            .map(|(i, part)| part.fail_from(if i == 0 { cursor } else { 0 }, shared))
            .sum()
    }
}
