//! The node's door: callers pass it to submit, a stop closes it. No lock on either side: one
//! atomic word holds the callers inside and a closed bit. A caller enters with one
//! `fetch_add` and leaves with one `fetch_sub`; [`Gate::close`] sets the bit and waits for
//! the callers already inside to leave (their submits never block), after which none is
//! inside and none gets in. One word of plain memory, so a daemon can keep it where its
//! clients map it.

use std::sync::atomic::{AtomicUsize, Ordering};

const CLOSED: usize = 1 << (usize::BITS - 1);

#[derive(Debug, Default)]
pub(crate) struct Gate {
    /// `CLOSED`, and the number of callers inside in the bits below it.
    word: AtomicUsize,
}

/// A caller inside the gate; it leaves when this is dropped.
#[must_use]
pub(crate) struct Inside<'a>(&'a Gate);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        // Release: what the caller did inside happens before a closer sees it gone.
        self.0.word.fetch_sub(1, Ordering::Release);
    }
}

impl Gate {
    /// Enters, or `None` once the gate is closed.
    pub fn enter(&self) -> Option<Inside<'_>> {
        // One read-modify-write on one word: either this entry comes before the close (which
        // then waits for it to leave) or after it (and sees the bit).
        let before = self.word.fetch_add(1, Ordering::AcqRel);
        debug_assert!(
            before & !CLOSED < CLOSED - 1,
            "callers inside overflow the gate"
        );
        if before & CLOSED != 0 {
            self.word.fetch_sub(1, Ordering::Release);
            return None;
        }
        Some(Inside(self))
    }

    pub fn is_open(&self) -> bool {
        self.word.load(Ordering::Acquire) & CLOSED == 0
    }

    /// Closes the gate and waits until no caller is inside. True for the call that closed it;
    /// a later call returns false at once (it does not wait).
    pub fn close(&self) -> bool {
        if self.word.fetch_or(CLOSED, Ordering::AcqRel) & CLOSED != 0 {
            return false;
        }
        let mut spins = 0u32;
        // Acquire: everything the callers did inside is visible once they are gone.
        while self.word.load(Ordering::Acquire) & !CLOSED != 0 {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        true
    }

    /// Callers inside now (for tests and checks).
    #[cfg(test)]
    fn inside(&self) -> usize {
        self.word.load(Ordering::Acquire) & !CLOSED
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    #[test]
    fn enters_until_closed_and_counts_who_is_inside() {
        let gate = Gate::default();
        assert!(gate.is_open());
        let a = gate.enter().expect("open");
        let b = gate.enter().expect("open");
        assert_eq!(gate.inside(), 2);
        drop(a);
        drop(b);
        assert_eq!(gate.inside(), 0);
        assert!(gate.close(), "the first close closes it");
        assert!(!gate.is_open());
        assert!(gate.enter().is_none(), "closed: nobody gets in");
        assert_eq!(gate.inside(), 0, "a refused entry leaves nothing behind");
        assert!(!gate.close(), "a second close says it was closed already");
    }

    #[test]
    fn close_waits_for_the_callers_inside() {
        let gate = Arc::new(Gate::default());
        let inside = gate.enter().expect("open");
        let closer = {
            let gate = Arc::clone(&gate);
            std::thread::spawn(move || gate.close())
        };
        // The closer sets the bit at once, then waits for `inside`.
        while gate.is_open() {
            std::thread::yield_now();
        }
        assert!(gate.enter().is_none());
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!closer.is_finished(), "close returned with a caller inside");
        drop(inside);
        assert!(closer.join().expect("closer"));
        assert_eq!(gate.inside(), 0);
    }

    /// Callers hammer the gate while it closes: every caller that got in finished its work
    /// before `close` returned, and none got in after.
    #[test]
    fn nothing_done_inside_after_close_returns() {
        let gate = Arc::new(Gate::default());
        let done = Arc::new(AtomicU64::new(0));
        let callers: Vec<_> = (0..4)
            .map(|_| {
                let (gate, done) = (Arc::clone(&gate), Arc::clone(&done));
                std::thread::spawn(move || {
                    let mut entered = 0u64;
                    while let Some(_inside) = gate.enter() {
                        entered += 1;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    entered
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert!(gate.close());
        let at_close = done.load(Ordering::Relaxed);
        let entered: u64 = callers.into_iter().map(|c| c.join().expect("caller")).sum();
        assert_eq!(
            done.load(Ordering::Relaxed),
            at_close,
            "work done after close"
        );
        assert_eq!(entered, at_close);
        assert!(entered > 0, "the callers never got in");
        assert_eq!(gate.inside(), 0);
    }
}
