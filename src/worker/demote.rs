//! Demotion staging (`s3.write = "on_evict"`): an evicted block is read into one of a few
//! staging slots before its NVMe space is reused, and handed to the cold tier from there.

use std::sync::Arc;

use crate::io::Region;
use crate::key::Key;
use crate::worker::shared::WorkerShared;

/// An evicted block read into a staging slot, handed to the S3 tier for upload. Dropping it
/// gives the staging slot back to its worker.
#[cfg_attr(not(feature = "s3"), allow(dead_code))]
pub(crate) struct Demotion {
    pub key: Key,
    pub staging: Arc<Region>,
    pub offset: usize,
    pub len: usize,
    /// The crc32c kept with the block (slot table, or the files layout's xattr): checked before
    /// the upload, so a block corrupted on NVMe is never demoted. `None`: nothing to check.
    pub crc: Option<u32>,
    slot: u32,
    give_back: crossbeam_channel::Sender<u32>,
    /// The worker, woken when the slot comes back (a store may be waiting for it).
    worker: Arc<WorkerShared>,
}

impl Drop for Demotion {
    fn drop(&mut self) {
        let _ = self.give_back.send(self.slot);
        self.worker.nudge();
    }
}

/// Where a worker hands demotions; set once the S3 tier is open.
pub(crate) type DemoteSink = Arc<std::sync::OnceLock<Box<dyn Fn(Demotion) + Send + Sync>>>;

/// A worker's demotion state: evicted blocks are read into staging slots before their NVMe
/// slot is reused.
pub(crate) struct Demote {
    pub staging: Arc<Region>,
    pub sink: DemoteSink,
    free: Vec<u32>,
    returned: crossbeam_channel::Receiver<u32>,
    give_back: crossbeam_channel::Sender<u32>,
    in_flight: usize,
    /// Staging slots handed to the S3 tier and not taken back yet.
    handed: usize,
    /// Staging slots in all (the simulator's leak check reads it).
    #[cfg_attr(not(any(test, feature = "sim")), allow(dead_code))]
    total: usize,
}

impl Demote {
    pub fn new(staging: Arc<Region>, staging_blocks: usize, sink: DemoteSink) -> Demote {
        let (give_back, returned) = crossbeam_channel::unbounded();
        Demote {
            staging,
            sink,
            free: (0..staging_blocks as u32).rev().collect(),
            returned,
            give_back,
            in_flight: 0,
            handed: 0,
            total: staging_blocks,
        }
    }

    pub(crate) fn take_staging(&mut self) -> Option<u32> {
        self.free.pop().or_else(|| {
            let s = self.returned.try_recv().ok()?;
            self.handed -= 1;
            Some(s)
        })
    }

    /// Takes back the staging slots the S3 tier gave back since the last turn; true if any
    /// came. Every turn does, so a slot given back never stays in the channel, where the
    /// worker's sleep check would see work and keep it from sleeping (a worker with a slot
    /// back and no store needing one spun instead of sleeping; found when the simulator began
    /// running the real loop).
    pub(crate) fn reclaim(&mut self) -> bool {
        let mut any = false;
        while let Ok(s) = self.returned.try_recv() {
            self.handed -= 1;
            self.free.push(s);
            any = true;
        }
        any
    }

    /// A staging slot taken but not used.
    pub(crate) fn put_back(&mut self, staging: u32) {
        self.free.push(staging);
    }

    /// A read into `staging` started.
    pub(crate) fn started(&mut self) {
        self.in_flight += 1;
    }

    /// The read into `staging` ended: hands the block to the S3 tier (`Some(key)`), or takes the
    /// staging slot back (`None`: the read failed, or the block must not be demoted).
    pub(crate) fn finished(
        &mut self,
        staging: u32,
        block_bytes: usize,
        demoted: Option<(Key, Option<u32>)>,
        worker: &Arc<WorkerShared>,
    ) -> bool {
        self.in_flight -= 1;
        if let (Some((key, crc)), Some(sink)) = (demoted, self.sink.get()) {
            self.handed += 1;
            sink(Demotion {
                key,
                staging: Arc::clone(&self.staging),
                offset: staging as usize * block_bytes,
                len: block_bytes,
                crc,
                slot: staging,
                give_back: self.give_back.clone(),
                worker: Arc::clone(worker),
            });
            true
        } else {
            self.free.push(staging);
            false
        }
    }

    /// For the simulator, once idle: no read into a staging slot in flight, and every slot
    /// handed to the cold tier given back.
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn check_quiet(&self) -> Result<(), String> {
        let back = self.free.len() + self.returned.len();
        if self.in_flight > 0 || back != self.total {
            return Err(format!(
                "demotion staging: {} reads in flight, {back} of {} slots back",
                self.in_flight, self.total
            ));
        }
        Ok(())
    }

    /// The staging slots' receiver, for the worker's sleep check.
    pub(crate) fn returned(&self) -> &crossbeam_channel::Receiver<u32> {
        &self.returned
    }

    /// Whether a staging slot will become free without this worker doing anything: read in
    /// flight, or handed to the S3 tier and not given back yet (it gives each back right after
    /// copying it out). Slots already given back do not count: `handed` only drops when one is
    /// taken from the channel, and a store waiting on them would wait forever (a worker whose
    /// device share had no victim to evict blocked its stores for good; found by the
    /// simulator, seed 202).
    pub(crate) fn will_free(&self) -> bool {
        self.in_flight > 0 || self.handed > self.returned.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Demotions the cold tier has not copied out yet: dropping one gives its slot back.
    type Held = Arc<std::sync::Mutex<Vec<Demotion>>>;

    /// Two staging slots of 4 KiB whose sink keeps every demotion in `Held`, and their worker
    /// with its wake-up eventfd.
    fn two_slots() -> (Demote, Held, Arc<WorkerShared>, Arc<crate::io::EventFd>) {
        let staging =
            Arc::new(Region::allocate(2 * 4096, kvtier_sys::mem::HugePages::Off).expect("8 KiB"));
        let sink = DemoteSink::default();
        let held: Held = Arc::default();
        let into = Arc::clone(&held);
        let _ = sink.set(Box::new(move |d| {
            into.lock().expect("not poisoned").push(d);
        }));
        let wake = Arc::new(crate::io::EventFd::new().expect("an eventfd"));
        let worker = Arc::new(WorkerShared::new(Arc::clone(&wake), 1));
        (Demote::new(staging, 2, sink), held, worker, wake)
    }

    /// A staging slot handed to the cold tier and given back (the tier copied it out) is no
    /// longer one to wait for, before and after the worker takes it from the channel. Counting
    /// it (the `handed` count only drops when a slot is taken) left a store that found no victim
    /// to evict waiting forever: the simulator's seed 202.
    #[test]
    fn a_staging_slot_given_back_is_not_waited_for() {
        let (mut m, held, worker, _) = two_slots();
        let key = Key::new(b"k").expect("a key");

        let a = m.take_staging().expect("a slot");
        m.started();
        assert!(m.will_free(), "a read into a staging slot is in flight");
        assert!(m.finished(a, 4096, Some((key, None)), &worker));
        assert!(m.will_free(), "the slot is with the cold tier");
        assert!(m.check_quiet().is_err());

        held.lock().expect("not poisoned").clear(); // the tier copied the block out: the slot comes back
        assert!(!m.will_free(), "nothing is out any more");
        m.check_quiet().expect("quiet");
        let mut got = vec![
            m.take_staging().expect("a slot"),
            m.take_staging().expect("a slot"),
        ];
        got.sort_unstable();
        assert_eq!(got, vec![0, 1]);
        assert!(m.take_staging().is_none());
        assert!(!m.will_free());
    }

    /// A slot the cold tier gave back is taken back at the worker's next turn, leaving the
    /// channel empty: the sleep check reads a non-empty channel as work to do, and a slot left
    /// there kept the worker from ever sleeping.
    #[test]
    fn a_turn_takes_back_the_slots_given_back() {
        let (mut m, held, worker, wake) = two_slots();
        let key = Key::new(b"k").expect("a key");
        assert!(!m.reclaim(), "nothing was handed out");
        let a = m.take_staging().expect("a slot");
        m.started();
        assert!(m.finished(a, 4096, Some((key, None)), &worker));
        assert!(!m.reclaim(), "the slot is still with the cold tier");
        worker
            .sleeping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        held.lock().expect("not poisoned").clear();
        assert_eq!(
            wake.drain(),
            1,
            "giving a slot back wakes its sleeping worker"
        );
        assert_eq!(m.returned().len(), 1);
        assert!(m.reclaim(), "the turn takes it back");
        assert!(
            m.returned().is_empty(),
            "nothing left to keep the worker awake"
        );
        assert!(!m.will_free());
        m.check_quiet().expect("quiet");
        let mut got = vec![
            m.take_staging().expect("a slot"),
            m.take_staging().expect("a slot"),
        ];
        got.sort_unstable();
        assert_eq!(got, vec![0, 1]);
    }
}
