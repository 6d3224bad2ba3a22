//! Logging helpers: a rate limit for warnings that can repeat (a dead device or endpoint fails
//! every request), which says how many lines it suppressed, and a health line that is logged
//! once when something stops answering and once when it answers again.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most `burst` lines per `window`; a line let through after some were held back carries
/// their count (`suppressed = n`).
pub(crate) struct RateLimit {
    burst: u32,
    window: Duration,
    state: Mutex<Window>,
}

struct Window {
    start: Option<Instant>,
    shown: u32,
    suppressed: u64,
}

impl RateLimit {
    pub const fn new(burst: u32, window: Duration) -> RateLimit {
        RateLimit {
            burst,
            window,
            state: Mutex::new(Window {
                start: None,
                shown: 0,
                suppressed: 0,
            }),
        }
    }

    /// `Some(lines suppressed since the last one shown)` when this line should be logged.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut w = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if w.start.is_none_or(|s| now.duration_since(s) >= self.window) {
            w.start = Some(now);
            w.shown = 0;
        }
        if w.shown < self.burst {
            w.shown += 1;
            Some(std::mem::take(&mut w.suppressed))
        } else {
            w.suppressed += 1;
            None
        }
    }
}

/// Whether a peer (the object store) is answering: `failure` counts consecutive failed
/// operations and says when they reach the threshold (log "stopped answering" then, once);
/// `success` says when it answers again after that (log the recovery, once).
pub(crate) struct Health {
    threshold: u32,
    failures: AtomicU32,
    down: AtomicBool,
}

impl Health {
    pub const fn new(threshold: u32) -> Health {
        Health {
            threshold,
            failures: AtomicU32::new(0),
            down: AtomicBool::new(false),
        }
    }

    /// A failed operation; true if this one marks the peer down (log it now).
    pub fn failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        n >= self.threshold && !self.down.swap(true, Ordering::Relaxed)
    }

    /// A successful operation; true if the peer was down (log the recovery now).
    pub fn success(&self) -> bool {
        self.failures.store(0, Ordering::Relaxed);
        self.down.load(Ordering::Relaxed) && self.down.swap(false, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limit_lets_a_burst_through_then_counts_what_it_held_back() {
        let r = RateLimit::new(2, Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(r.admit_at(t0), Some(0));
        assert_eq!(r.admit_at(t0), Some(0));
        assert_eq!(r.admit_at(t0 + Duration::from_secs(1)), None);
        assert_eq!(r.admit_at(t0 + Duration::from_secs(2)), None);
        // A new window: the next line says two were suppressed, and only that line.
        assert_eq!(r.admit_at(t0 + Duration::from_secs(10)), Some(2));
        assert_eq!(r.admit_at(t0 + Duration::from_secs(10)), Some(0));
        assert_eq!(r.admit_at(t0 + Duration::from_secs(11)), None);
    }

    #[test]
    fn health_reports_down_once_and_up_once() {
        let h = Health::new(3);
        assert!(!h.success(), "up and answering: nothing to say");
        assert!(!h.failure());
        assert!(!h.failure());
        assert!(h.failure(), "the third failure in a row: down");
        assert!(!h.failure(), "said once");
        assert!(h.success(), "answering again");
        assert!(!h.success());
        assert!(!h.failure() && !h.failure(), "the count restarted");
    }
}
