//! One worker's queue to the simulated devices: requests are queued at `push`, given a due
//! round at `submit` (seeded delays), and executed at `complete`, in order or shuffled, with
//! the seeded faults of [`Faults`]. Data moves at completion time, so a reordered completion
//! is a reordered effect.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::io::{BlockQueue, Completion, EventFd, IoBackend, IoClass, IoKind, IoRequest, Region};

use super::Memory;
use crate::Errno;

use super::{Faults, LogEntry, Rng, State};

impl SimBackend {
    pub(super) fn new(
        state: Arc<State>,
        worker: usize,
        buffers: Vec<Arc<Region>>,
        wake: Arc<EventFd>,
        sq_entries: usize,
    ) -> SimBackend {
        SimBackend {
            rng: Rng::new(state.seed ^ (worker as u64).wrapping_mul(0xA24B_AED4_963E_E407)),
            state,
            worker,
            buffers,
            wake,
            queued: Vec::new(),
            pending: Vec::new(),
            fenced: None,
            round: 0,
            sq_entries,
        }
    }
}

struct Pending {
    req: IoRequest,
    due: u64,
}

pub(super) struct SimBackend {
    state: Arc<State>,
    worker: usize,
    buffers: Vec<Arc<Region>>,
    wake: Arc<EventFd>,
    rng: Rng,
    queued: Vec<IoRequest>,
    pending: Vec<Pending>,
    /// After a fence: the requests it stopped, answered ECANCELED at the next `complete`.
    fenced: Option<Vec<IoRequest>>,
    round: u64,
    sq_entries: usize,
}

impl SimBackend {
    fn faults(&self) -> Faults {
        *self
            .state
            .faults
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Performs the request's data movement and decides its result.
    fn execute(&mut self, req: &IoRequest) -> i32 {
        let f = self.faults();
        let len = req.buf.len();
        let mem = Memory::Claim(&req.buf);
        let dev = req.device as usize;
        let faulty = !(f.data_only && req.class == IoClass::Meta);
        if self.state.failing.load(Ordering::SeqCst) & (1u64 << dev) != 0 {
            return -(Errno::EIO as i32);
        }
        if req.kind == IoKind::Write {
            if self.state.crashed.load(Ordering::SeqCst) {
                return self.tear(req);
            }
            let left = self.state.writes_until_crash.load(Ordering::SeqCst);
            if left != u64::MAX {
                if left == 0 {
                    self.state.crashed.store(true, Ordering::SeqCst);
                    return self.tear(req);
                }
                self.state
                    .writes_until_crash
                    .store(left - 1, Ordering::SeqCst);
            }
        }
        if faulty {
            if self.rng.hit(f.eio_ppm) {
                return -(Errno::EIO as i32);
            }
            if req.kind == IoKind::Write && self.rng.hit(f.enospc_ppm) {
                return -(Errno::ENOSPC as i32);
            }
            if req.kind == IoKind::Write && self.rng.hit(f.torn_write_ppm) {
                return self.tear(req);
            }
            if len > 512 && self.rng.hit(f.short_ppm) {
                let short = (self.rng.below(len as u64 / 512) * 512) as usize;
                self.state.copy(dev, req.kind, req.offset, &mem, short);
                return i32::try_from(short).expect("I/O sizes fit i32");
            }
        }
        self.state.copy(dev, req.kind, req.offset, &mem, len);
        if faulty && req.kind == IoKind::Read && len > 0 && self.rng.hit(f.read_flip_ppm) {
            let at = self.rng.below(len as u64) as usize;
            let mut byte = [0u8];
            mem.fetch(at, &mut byte);
            byte[0] ^= 1 << self.rng.below(8);
            mem.land(at, &byte);
            self.state.read_flips.fetch_add(1, Ordering::SeqCst);
        }
        i32::try_from(len).expect("I/O sizes fit i32")
    }

    /// Lands a random prefix of a write (in 512-byte sectors) and fails it.
    fn tear(&mut self, req: &IoRequest) -> i32 {
        let sectors = req.buf.len() as u64 / 512;
        let landed = (self.rng.below(sectors + 1) * 512) as usize;
        self.state.copy(
            req.device as usize,
            IoKind::Write,
            req.offset,
            &Memory::Claim(&req.buf),
            landed,
        );
        -(Errno::EIO as i32)
    }
}

impl BlockQueue for SimBackend {
    fn push(&mut self, req: IoRequest) -> bool {
        if self.fenced.is_some() {
            return false;
        }
        if self.queued.len() + self.pending.len() >= self.sq_entries * 2 {
            return false;
        }
        if req.class == IoClass::Meta
            && req.kind == IoKind::Write
            && self.state.meta_refused.load(Ordering::SeqCst)
        {
            return false;
        }
        assert!(
            Arc::ptr_eq(&self.buffers[req.region as usize], req.buf.region()),
            "a claim on another buffer than the request's"
        );
        if self.state.log_enabled.load(Ordering::SeqCst) {
            self.state
                .log
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(LogEntry {
                    worker: self.worker,
                    kind: req.kind,
                    class: req.class,
                    device: req.device,
                    offset: req.offset,
                    len: req.bytes(),
                });
        }
        super::trace(&[
            1,
            self.worker as u64,
            req.user_data,
            req.kind as u64,
            u64::from(req.device),
            req.offset,
            u64::from(req.bytes()),
        ]);
        self.queued.push(req);
        true
    }
}

impl IoBackend for SimBackend {
    fn blocks(&mut self) -> Option<&mut dyn BlockQueue> {
        Some(self)
    }

    fn enters(&self) -> u64 {
        self.round
    }

    fn fence(&mut self) -> bool {
        if !self.state.fenceable.load(Ordering::SeqCst) {
            return false;
        }
        self.state.fences.fetch_add(1, Ordering::SeqCst);
        let stopped = self.fenced.get_or_insert_with(Vec::new);
        stopped.append(&mut self.queued);
        stopped.extend(self.pending.drain(..).map(|p| p.req));
        true
    }

    fn submit(&mut self, wait: bool) -> std::io::Result<()> {
        self.round += 1;
        let max_delay = u64::from(self.faults().max_delay_rounds);
        for req in self.queued.drain(..) {
            let delay = if max_delay == 0 {
                0
            } else {
                self.rng.below(max_delay + 1)
            };
            self.pending.push(Pending {
                req,
                due: self.round + delay,
            });
        }
        if !wait {
            return Ok(());
        }
        let hung = self.state.hung.load(Ordering::SeqCst);
        let all_hung = self
            .pending
            .iter()
            .all(|p| hung & (1u64 << p.req.device) != 0);
        if self.state.paused.load(Ordering::SeqCst) || all_hung {
            // Nothing can complete: sleep until woken (bounded, so pause can be lifted).
            self.wake
                .wait_timeout(Duration::from_millis(if self.pending.is_empty() {
                    100
                } else {
                    1
                }));
            return Ok(());
        }
        // Waiting: jump time to the earliest due completion.
        let earliest = self
            .pending
            .iter()
            .filter(|p| hung & (1u64 << p.req.device) == 0)
            .map(|p| p.due)
            .min()
            .unwrap_or(self.round);
        self.round = self.round.max(earliest);
        Ok(())
    }

    fn sim_wake(&mut self) -> bool {
        if self.wake.drain() > 0 || self.fenced.is_some() {
            return true;
        }
        if self.state.paused.load(Ordering::SeqCst) {
            return false;
        }
        // The wait returns with the earliest completion a device that is not hung will give.
        let hung = self.state.hung.load(Ordering::SeqCst);
        match self
            .pending
            .iter()
            .filter(|p| hung & (1u64 << p.req.device) == 0)
            .map(|p| p.due)
            .min()
        {
            Some(earliest) => {
                self.round = self.round.max(earliest);
                true
            }
            None => false,
        }
    }

    fn complete(&mut self, out: &mut Vec<Completion>) {
        if let Some(stopped) = &mut self.fenced {
            // Nothing of theirs was copied: the device stopped before it reached them.
            out.extend(stopped.drain(..).map(|req| Completion {
                user_data: req.user_data,
                result: -(Errno::ECANCELED as i32),
            }));
            return;
        }
        if self.state.paused.load(Ordering::SeqCst) {
            return;
        }
        let f = self.faults();
        let round = self.round;
        let hung = self.state.hung.load(Ordering::SeqCst);
        let (ready, rest): (Vec<Pending>, Vec<Pending>) = self
            .pending
            .drain(..)
            .partition(|p| p.due <= round && hung & (1u64 << p.req.device) == 0);
        self.pending = rest;
        let mut ready: Vec<IoRequest> = ready.into_iter().map(|p| p.req).collect();
        if f.reorder {
            for i in (1..ready.len()).rev() {
                let j = self.rng.below(i as u64 + 1) as usize;
                ready.swap(i, j);
            }
        }
        for req in ready {
            let result = self.execute(&req);
            super::trace(&[2, self.worker as u64, req.user_data, result as u64]);
            out.push(Completion {
                user_data: req.user_data,
                result,
            });
        }
    }

    fn in_flight(&self) -> usize {
        self.queued.len() + self.pending.len() + self.fenced.as_ref().map_or(0, Vec::len)
    }

    fn describe(&self) -> String {
        format!("sim (seed {})", self.state.seed)
    }
}
