//! The time a worker's deadlines and cached answers run on: the monotonic clock, or, in the
//! simulator, a clock that moves only when the simulation moves it, so that a seed replays the
//! same way however loaded the machine running it is.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A cheap handle: the monotonic clock (the default), or a shared manual one.
#[derive(Clone, Default)]
pub(crate) struct Clock(Option<Arc<Manual>>);

struct Manual {
    start: Instant,
    /// Nanoseconds the clock was moved past `start`.
    moved: AtomicU64,
}

impl Clock {
    pub fn now(&self) -> Instant {
        match &self.0 {
            None => Instant::now(),
            Some(m) => m.start + Duration::from_nanos(m.moved.load(Ordering::Acquire)),
        }
    }

    /// A clock that stands still until [`Clock::advance`]; its clones share it.
    #[cfg(any(test, feature = "sim"))]
    pub fn manual() -> Clock {
        Clock(Some(Arc::new(Manual {
            start: Instant::now(),
            moved: AtomicU64::new(0),
        })))
    }

    /// Moves a manual clock forward by `by` (the monotonic clock is not moved: a no-op).
    #[cfg(any(test, feature = "sim"))]
    pub fn advance(&self, by: Duration) {
        if let Some(m) = &self.0 {
            let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
            m.moved.fetch_add(nanos, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_advanced_and_its_clones_share_it() {
        let clock = Clock::manual();
        let other = clock.clone();
        let t0 = clock.now();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(clock.now(), t0, "stood still while time passed");
        other.advance(Duration::from_millis(1500));
        assert_eq!(clock.now().duration_since(t0), Duration::from_millis(1500));
        let real = Clock::default();
        let r0 = real.now();
        std::thread::sleep(Duration::from_millis(2));
        assert!(real.now() > r0, "the default follows the monotonic clock");
    }
}
