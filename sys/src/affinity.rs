//! CPU placement and CPU-time clocks for the thread-per-core workers.
//!
//! Workers pin themselves to one core each ([`pin_current_thread`]) out of the cores the
//! process may run on ([`available_cores`]); [`thread_cpu_time`] and [`process_cpu_time`] let
//! the engine report how busy its threads are. No state is kept here; every call is one syscall.

use std::time::Duration;

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::time::{clock_gettime, ClockId};
use nix::unistd::{getpid, Pid};

use crate::Errno;

/// Cores the process may run on (`sched_getaffinity` of the process's main thread), ascending.
/// Falls back to `0..available_parallelism` if the mask cannot be read.
pub fn available_cores() -> Vec<usize> {
    match sched_getaffinity(getpid()) {
        Ok(set) => (0..CpuSet::count())
            .filter(|&cpu| set.is_set(cpu).unwrap_or(false))
            .collect(),
        Err(errno) => {
            tracing::warn!(%errno, "sched_getaffinity failed; assuming all cores are available");
            let n = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
            (0..n).collect()
        }
    }
}

/// Pins the calling thread to `core`. `Err(EINVAL)` if `core` is out of range or not allowed.
pub fn pin_current_thread(core: usize) -> Result<(), Errno> {
    let mut set = CpuSet::new();
    set.set(core)?;
    // Pid 0 is the calling thread, not the process.
    sched_setaffinity(Pid::from_raw(0), &set)
}

/// Sets the calling thread's nice value (on Linux, `setpriority(PRIO_PROCESS, tid)` applies to
/// one thread). Raising it needs no privilege; it makes the thread yield to the NVMe workers
/// when they share a core.
pub fn set_current_thread_nice(nice: i32) -> Result<(), Errno> {
    let tid = nix::unistd::gettid().as_raw();
    // SAFETY: setpriority takes plain integers and touches no memory of ours.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    if r == 0 {
        Ok(())
    } else {
        Err(Errno::last())
    }
}

/// CPU time consumed by the calling thread (`CLOCK_THREAD_CPUTIME_ID`).
pub fn thread_cpu_time() -> Duration {
    cpu_time(ClockId::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time consumed by all threads of the process (`CLOCK_PROCESS_CPUTIME_ID`).
pub fn process_cpu_time() -> Duration {
    cpu_time(ClockId::CLOCK_PROCESS_CPUTIME_ID)
}

fn cpu_time(clock: ClockId) -> Duration {
    // These clocks cannot fail on Linux for the calling thread/process; zero is a safe report.
    clock_gettime(clock).map_or(Duration::ZERO, Duration::from)
}

#[cfg(test)]
mod tests {
    //! Pinning to an allowed core must succeed and be visible in the thread's mask; the CPU
    //! clocks must advance while the thread spins.
    use super::*;

    #[test]
    fn pin_and_clocks() {
        let cores = available_cores();
        assert!(!cores.is_empty());
        let last = *cores.last().expect("at least one core");
        std::thread::spawn(move || {
            pin_current_thread(last).expect("pin");
            let mine = sched_getaffinity(Pid::from_raw(0)).expect("getaffinity");
            assert!(mine.is_set(last).expect("in range"));
            let t0 = thread_cpu_time();
            let mut x = 0_u64;
            while thread_cpu_time().saturating_sub(t0) < Duration::from_millis(5) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            assert!(process_cpu_time() >= thread_cpu_time().saturating_sub(t0));
        })
        .join()
        .expect("pinned thread");
        assert_eq!(pin_current_thread(1 << 20), Err(Errno::EINVAL));
    }
}
