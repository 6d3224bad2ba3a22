//! Ctrl-C and SIGTERM as a request to stop, so that an interrupted bench still shuts the engine
//! down, reports what it measured and removes its scratch directory (a 1 GiB slab by default).
//!
//! Invariant: [`install`] runs before any other thread is spawned, so every thread inherits the
//! blocked mask and the signals reach only the dedicated waiting thread — no signal handler
//! runs, hence no `unsafe`. The first signal sets a flag the bench polls between jobs; a second
//! one exits at once (status 130), for when the stop itself hangs.

use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::signal::{SigSet, Signal};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// Blocks SIGINT and SIGTERM in this thread (and so in threads it spawns later) and starts the
/// thread that waits for them. If that cannot be done the default behaviour (exit) is kept.
pub fn install() {
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    if let Err(e) = set.thread_block() {
        tracing::debug!(%e, "cannot block SIGINT/SIGTERM: an interrupt will kill the bench");
        return;
    }
    let waiter = std::thread::Builder::new()
        .name("kvtier-signals".into())
        .spawn(move || {
            while let Ok(signal) = set.wait() {
                if REQUESTED.swap(true, Ordering::SeqCst) {
                    eprintln!("\n{signal} again: exiting now; scratch files may be left behind");
                    std::process::exit(130);
                }
                eprintln!(
                    "\n{signal}: finishing the jobs in flight, then reporting (again to exit now)"
                );
            }
        });
    if let Err(e) = waiter {
        // Nobody would receive the blocked signals: restore them rather than ignore Ctrl-C.
        let _ = set.thread_unblock();
        tracing::debug!(%e, "cannot start the signal thread: an interrupt will kill the bench");
    }
}

/// True once SIGINT or SIGTERM arrived.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::Relaxed)
}
