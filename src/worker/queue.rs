//! What a worker is sent ([`Msg`]) and its queues of blocks not yet started ([`WorkQueue`]).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::config::FirstLookup;
use crate::job::{JobState, KeyFailure, Shared};
use crate::key::Key;
use crate::worker::sched::Scheduler;
use crate::worker::shared::WorkerShared;

/// Work for one worker: the indexes of the job's keys that hash to it.
pub(crate) struct Part {
    pub job: Arc<JobState>,
    pub items: Vec<u32>,
}

/// Sends `job`'s items to the workers they route to (`parts[w]`: worker `w`'s, their queue room
/// reserved already; an empty part is not sent) and wakes each.
pub(crate) fn send_parts(
    workers: &[(crossbeam_channel::Sender<Msg>, Arc<WorkerShared>)],
    job: &Arc<JobState>,
    parts: Vec<Vec<u32>>,
) {
    for ((tx, me), items) in workers.iter().zip(parts) {
        if !items.is_empty() {
            let job = Arc::clone(job);
            // Cannot fail: the node holds a receiver of every channel until it is dropped, and
            // its stop fails whatever is left in them.
            let _ = tx.send(Msg::Work(Part { job, items }));
            me.nudge();
        }
    }
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

/// One worker's blocks of one kind (loads or stores) not yet started, in the order their parts
/// arrived: the front part's items from `cursor` on, then every later part's.
///
/// Invariants (checked in debug builds): no part is empty; `cursor` is inside the front part;
/// `blocks` is the count of items not yet taken.
#[derive(Default)]
pub(crate) struct WorkQueue {
    parts: VecDeque<Part>,
    cursor: usize,
    /// Blocks not yet taken (mirrors the metrics gauge).
    blocks: usize,
}

impl WorkQueue {
    /// Queues `part` behind the others. A part has at least one item (admission sends no empty
    /// part).
    pub fn push(&mut self, part: Part) {
        debug_assert!(!part.items.is_empty(), "an empty part is never queued");
        self.blocks += part.items.len();
        self.parts.push_back(part);
        self.debug_check();
    }

    /// The next block to start: its job and the key's index in it.
    pub fn peek(&self) -> Option<(&Arc<JobState>, usize)> {
        let part = self.parts.front()?;
        Some((&part.job, part.items[self.cursor] as usize))
    }

    /// Moves past the peeked item, which the worker has taken up, and gives back its queue room.
    pub fn take(&mut self, me: &WorkerShared) {
        debug_assert!(!self.parts.is_empty(), "take without a peeked item");
        me.queued_blocks.fetch_sub(1, Ordering::AcqRel);
        self.advance();
    }

    /// The loads' queue: takes the next block if `sched` lets one more load start, counting it
    /// in flight there. Its queue room stays reserved: the worker gives it back once the block
    /// started or was answered, or puts the block back ([`WorkQueue::put_back`]).
    pub fn take_load(&mut self, sched: &mut Scheduler) -> Option<(Arc<JobState>, usize)> {
        let part = self.parts.front()?;
        if !sched.start_load() {
            return None;
        }
        let next = (Arc::clone(&part.job), part.items[self.cursor] as usize);
        self.advance();
        Some(next)
    }

    /// Puts `item` of `job`, the block [`WorkQueue::take_load`] took last, back at the front:
    /// it could not start this turn.
    pub fn put_back(&mut self, job: Arc<JobState>, item: usize) {
        match self.parts.front() {
            Some(part)
                if self.cursor > 0
                    && Arc::ptr_eq(&part.job, &job)
                    && part.items[self.cursor - 1] as usize == item =>
            {
                self.cursor -= 1;
            }
            _ => {
                debug_assert_eq!(self.cursor, 0, "the block put back was the one taken last");
                self.parts.push_front(Part {
                    job,
                    items: vec![item as u32],
                });
            }
        }
        self.blocks += 1;
        self.debug_check();
    }

    /// Moves past the front item.
    fn advance(&mut self) {
        self.cursor += 1;
        self.blocks -= 1;
        if let Some(part) = self.parts.front() {
            if self.cursor >= part.items.len() {
                self.parts.pop_front();
                self.cursor = 0;
            }
        }
        self.debug_check();
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Blocks not yet taken.
    pub fn blocks(&self) -> usize {
        self.blocks
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

    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            debug_assert!(
                self.parts
                    .front()
                    .is_none_or(|p| self.cursor < p.items.len())
                    && (!self.parts.is_empty() || self.cursor == 0),
                "the cursor ({}) is inside the front part",
                self.cursor
            );
            let untaken: usize =
                self.parts.iter().map(|p| p.items.len()).sum::<usize>() - self.cursor;
            debug_assert_eq!(self.blocks, untaken, "blocks counts the items not taken");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::EventSink;
    use crate::job::{Job, JobKind, JobResult};
    use std::sync::Mutex;

    type Results = Arc<Mutex<Vec<JobResult>>>;

    fn key(i: u32) -> Key {
        Key::new(format!("k{i}").as_bytes()).expect("a key")
    }

    /// A load job `id` of `keys` keys whose result lands in `results`.
    fn job(id: u64, keys: u32, results: &Results) -> Arc<JobState> {
        let into = Arc::clone(results);
        let job = Job::new(id, (0..keys).map(key).collect(), (0..keys).collect());
        Arc::new(JobState::internal(
            JobKind::Load,
            job,
            Box::new(move |r| into.lock().expect("not poisoned").push(r)),
        ))
    }

    fn worker(queued: usize) -> WorkerShared {
        let wake = Arc::new(crate::io::EventFd::new().expect("an eventfd"));
        let me = WorkerShared::new(wake, 1);
        me.queued_blocks.store(queued, Ordering::Relaxed);
        me
    }

    /// Parts come out item by item in the order they were queued, each take giving back one
    /// block of queue room; the count of blocks follows.
    #[test]
    fn items_come_out_in_order_and_give_their_room_back() {
        let results = Results::default();
        let (a, b) = (job(1, 3, &results), job(2, 2, &results));
        let me = worker(4);
        let mut q = WorkQueue::default();
        assert!(q.peek().is_none() && q.is_empty());
        q.push(Part {
            job: Arc::clone(&a),
            items: vec![2, 0],
        });
        q.push(Part {
            job: Arc::clone(&b),
            items: vec![1, 0],
        });
        assert_eq!(q.blocks(), 4);
        let mut seen = Vec::new();
        while let Some((job, item)) = q.peek() {
            seen.push((job.job.id, item));
            q.take(&me);
        }
        assert_eq!(seen, [(1, 2), (1, 0), (2, 1), (2, 0)]);
        assert_eq!(q.blocks(), 0);
        assert!(q.is_empty());
        assert_eq!(me.queued_blocks.load(Ordering::Relaxed), 0);
        assert!(
            results.lock().expect("not poisoned").is_empty(),
            "nothing failed"
        );
    }

    /// Loads leave the queue only while the scheduler lets another start (each counted in
    /// flight as it leaves); a block put back comes out next, whether its part is still at the
    /// front or was its last item; a refused take leaves the queue as it was.
    #[test]
    fn loads_leave_while_the_scheduler_allows_and_come_back_in_front() {
        let results = Results::default();
        let (a, b) = (job(1, 2, &results), job(2, 1, &results));
        let cfg = crate::config::SchedulerConfig {
            load_inflight_max: 2,
            ..crate::config::SchedulerConfig::default()
        };
        let mut sched = Scheduler::new(&cfg, 1 << 20, 1 << 20);
        let mut q = WorkQueue::default();
        q.push(Part {
            job: Arc::clone(&a),
            items: vec![1, 0],
        });
        q.push(Part {
            job: Arc::clone(&b),
            items: vec![0],
        });
        let (j, item) = q.take_load(&mut sched).expect("room for a load");
        assert_eq!((j.job.id, item), (1, 1));
        assert_eq!(sched.loads_in_flight(), 1, "counted as it left");
        // It could not start: back in the queue, and no longer in flight (as the worker does).
        q.put_back(j, item);
        sched.load_ended();
        assert_eq!(q.blocks(), 3, "the block is queued again");
        let (j, item) = q.take_load(&mut sched).expect("room");
        assert_eq!(
            (j.job.id, item),
            (1, 1),
            "the block put back comes out first"
        );
        let (j, item) = q.take_load(&mut sched).expect("room");
        assert_eq!((j.job.id, item), (1, 0));
        assert!(
            q.take_load(&mut sched).is_none(),
            "two loads in flight: the cap"
        );
        assert_eq!(q.blocks(), 1, "a refused take leaves the block queued");
        assert_eq!(sched.loads_in_flight(), 2, "and counts nothing");
        // Job 1's part is gone from the queue; its last block comes back in a part of its own.
        q.put_back(j, item);
        sched.load_ended();
        assert_eq!(q.blocks(), 2);
        sched.load_ended();
        let taken: Vec<(u64, usize)> = std::iter::from_fn(|| q.take_load(&mut sched))
            .map(|(j, i)| (j.job.id, i))
            .collect();
        assert_eq!(taken, [(1, 0), (2, 0)]);
        assert!(q.is_empty() && q.blocks() == 0);
    }

    /// A cancel fails exactly the items not taken (the front part's from its cursor on, every
    /// later part's), with `Shutdown`, and leaves the queue empty; the items taken are not
    /// touched, so a job is reported once its taken items resolve.
    #[test]
    fn a_cancel_fails_only_what_was_not_taken() {
        let results = Results::default();
        let (a, b) = (job(1, 3, &results), job(2, 2, &results));
        let shared = Shared::new(EventSink::new(false, 1, None));
        let me = worker(5);
        let mut q = WorkQueue::default();
        q.push(Part {
            job: Arc::clone(&a),
            items: vec![0, 1, 2],
        });
        q.push(Part {
            job: Arc::clone(&b),
            items: vec![0, 1],
        });
        q.take(&me); // item 0 of job 1 started
        assert_eq!(q.cancel(&shared), 4);
        assert!(q.is_empty() && q.peek().is_none());
        assert_eq!(q.blocks(), 0);
        {
            let got = results.lock().expect("not poisoned");
            assert_eq!(
                got.len(),
                1,
                "job 2 is resolved whole; job 1 waits for item 0"
            );
            assert_eq!(got[0].id, 2);
            let failed: Vec<(usize, KeyFailure)> = got[0]
                .failures
                .iter()
                .map(|f| (f.key_index, f.reason))
                .collect();
            assert_eq!(
                failed,
                [(0, KeyFailure::Shutdown), (1, KeyFailure::Shutdown)]
            );
        }
        a.succeed(&shared, 0, 4096);
        let got = results.lock().expect("not poisoned");
        assert_eq!(got.len(), 2);
        let failed: Vec<usize> = got[1].failures.iter().map(|f| f.key_index).collect();
        assert_eq!(failed, [1, 2], "the taken item is not failed by the cancel");
        assert_eq!(got[1].succeeded_prefix, 1);
    }

    /// `fail_from` fails a part's items from an index on and says how many.
    #[test]
    fn a_part_fails_from_an_item_on() {
        let results = Results::default();
        let a = job(7, 4, &results);
        let shared = Shared::new(EventSink::new(false, 1, None));
        let part = Part {
            job: Arc::clone(&a),
            items: vec![3, 1, 0, 2],
        };
        a.succeed(&shared, 3, 1);
        a.succeed(&shared, 1, 1);
        assert_eq!(part.fail_from(2, &shared), 2);
        let got = results.lock().expect("not poisoned");
        let failed: Vec<usize> = got[0].failures.iter().map(|f| f.key_index).collect();
        assert_eq!(failed, [0, 2]);
    }
}
