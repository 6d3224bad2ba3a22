//! Wake-up events: an `eventfd(2)` counter that one thread bumps and another sleeps on.
//!
//! A worker sleeping in its ring keeps an 8-byte read of its [`EventFd`] queued
//! (`Ring::push_eventfd_read`); any thread calls [`EventFd::notify`] to wake it. The descriptor
//! is non-blocking and close-on-exec, owned by the `EventFd` and open for its whole life.
//! Notifications coalesce: many `notify` calls before a read wake the reader once.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::Errno;

/// An eventfd counter (`EFD_CLOEXEC | EFD_NONBLOCK`). Send + Sync.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// Creates a counter starting at 0.
    pub fn new() -> Result<EventFd, Errno> {
        // SAFETY: eventfd takes no pointers; it returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(Errno::last());
        }
        // SAFETY: `fd` was just returned by eventfd, is open, and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(EventFd { fd })
    }

    /// Adds 1 to the counter, waking a reader. A saturated counter (EAGAIN) is already a
    /// pending wake-up, so that error is ignored.
    pub fn notify(&self) {
        loop {
            match nix::unistd::write(&self.fd, &1_u64.to_ne_bytes()) {
                Err(Errno::EINTR) => {}
                Ok(_) | Err(Errno::EAGAIN) => return,
                Err(errno) => {
                    // Only EBADF/EINVAL are possible, and the fd is owned: a broken invariant.
                    tracing::error!(%errno, "eventfd write failed");
                    return;
                }
            }
        }
    }

    /// Reads and resets the counter without blocking; 0 if nothing was pending.
    pub fn drain(&self) -> u64 {
        let mut buf = [0_u8; 8];
        loop {
            match nix::unistd::read(self.fd.as_raw_fd(), &mut buf) {
                Ok(8) => return u64::from_ne_bytes(buf),
                Err(Errno::EINTR) => {}
                // EAGAIN: counter is zero. A short read cannot happen on an eventfd.
                Ok(_) | Err(_) => return 0,
            }
        }
    }

    /// Waits up to `timeout` for a notification, then drains it. True if it was signalled.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // Round up so a sub-millisecond timeout still sleeps instead of spinning.
            let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is one live pollfd and the count passed is 1.
            let n = unsafe { libc::poll(&raw mut pfd, 1, ms) };
            if n > 0 {
                // Another thread may have drained it between poll and read.
                return self.drain() > 0;
            }
            if n == 0 || Errno::last() != Errno::EINTR || left.is_zero() {
                return false;
            }
        }
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    //! Notifications coalesce, drain resets, and `wait_timeout` both times out and wakes on a
    //! notify from another thread.
    use super::*;
    use std::sync::Arc;

    #[test]
    fn notify_drain_wait() {
        let e = Arc::new(EventFd::new().expect("eventfd"));
        assert_eq!(e.drain(), 0);
        e.notify();
        e.notify();
        assert_eq!(e.drain(), 2);
        let t0 = Instant::now();
        assert!(!e.wait_timeout(Duration::from_millis(20)));
        assert!(t0.elapsed() >= Duration::from_millis(20));
        let e2 = Arc::clone(&e);
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            e2.notify();
        });
        assert!(e.wait_timeout(Duration::from_secs(10)));
        h.join().expect("notifier");
        assert_eq!(e.drain(), 0);
    }
}
