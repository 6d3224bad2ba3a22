//! Logging helpers: a rate limit for warnings that can repeat (a dead device or endpoint fails
//! every request), which says how many lines it suppressed, and a health line that is logged
//! once when something stops answering and once when it answers again.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
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
#[cfg_attr(not(feature = "s3"), allow(dead_code))] // the S3 tier's
pub(crate) struct Health {
    threshold: u32,
    failures: AtomicU32,
    down: AtomicBool,
}

#[cfg_attr(not(feature = "s3"), allow(dead_code))]
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

/// Devices with a health state (device indexes at or above it are not tracked).
pub(crate) const TRACKED_DEVICES: usize = 64;

/// Per device, engine-wide (workers share it): whether its last I/O failed. The first error
/// after a success is logged, one line naming the device and the operation; later ones are
/// only counted (`kvtier_device_errors_total`) until an I/O on the device succeeds again, which
/// is logged once too. A device that fails every request logs two lines, not one per request or
/// per worker; one that fails now and then logs a line per episode, within the worker's rate
/// limit.
pub(crate) struct DeviceHealth {
    failing: [AtomicBool; TRACKED_DEVICES],
    errors: [AtomicU64; TRACKED_DEVICES],
}

impl Default for DeviceHealth {
    fn default() -> DeviceHealth {
        DeviceHealth {
            failing: std::array::from_fn(|_| AtomicBool::new(false)),
            errors: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl DeviceHealth {
    /// An I/O error on device `d`; true if it starts an episode (log it now).
    pub fn error(&self, d: usize) -> bool {
        let (Some(f), Some(n)) = (self.failing.get(d), self.errors.get(d)) else {
            return false;
        };
        n.fetch_add(1, Ordering::Relaxed);
        !f.swap(true, Ordering::Relaxed)
    }

    /// A successful I/O on device `d`: `Some(errors in the episode)` if one just ended (log
    /// the recovery now). One relaxed load when the device is healthy.
    pub fn ok(&self, d: usize) -> Option<u64> {
        let f = self.failing.get(d)?;
        if !f.load(Ordering::Relaxed) || !f.swap(false, Ordering::Relaxed) {
            return None;
        }
        Some(self.errors[d].swap(0, Ordering::Relaxed))
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
