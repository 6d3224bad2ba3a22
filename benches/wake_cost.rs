//! What one sleep and wake-up costs the thread that sleeps: a thread blocks in `poll(2)` on an
//! eventfd (as a worker sleeps in the kernel until a completion or a submitter's nudge) and another
//! thread, on another core, writes it after a gap. Only the sleeper's CPU time is counted,
//! over all its wake-ups, so the figure is what each sleep adds to a worker's CPU beyond the
//! work it wakes for. A `kvtier bench` or `fio-compare` row's worker sleeps per I/O (and
//! fio's context switches per I/O) times this cost is the part of CPU per GiB that depends
//! on how often the threads sleep, not on the bytes. On the development machine (a virtual
//! machine whose guest never polls before it halts) a wake-up costs the sleeper 6–15 µs,
//! more the longer it slept (docs/perf.md, "Load CPU per GiB: the sleeps").
//!
//! `cargo bench --bench wake_cost` prints the table; under `cargo test --all-targets` it runs
//! a few wake-ups per gap, to keep building and working.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvtier_sys::affinity::{available_cores, pin_current_thread, thread_cpu_time};
use kvtier_sys::eventfd::EventFd;

const GAPS_US: [u64; 6] = [10, 50, 100, 200, 500, 1000];

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let cores = available_cores();
    let (sleeper_core, waker_core) = match cores.as_slice() {
        [a, b, ..] => (Some(*a), Some(*b)),
        _ => (None, None),
    };
    println!("gap µs   sleeper cpu µs per wake-up   wake-ups");
    for gap_us in GAPS_US {
        // About 1.5 s per gap; a few wake-ups in test mode.
        let wakes = if bench {
            (1_500_000 / (gap_us + 60)).max(100) as usize
        } else {
            8
        };
        let (per_wake, woken) = run(gap_us, wakes, sleeper_core, waker_core);
        println!("{gap_us:>6} {:>28.2} {woken:>10}", per_wake * 1e6);
    }
}

/// Writes the eventfd `wakes` times, `gap_us` apart; returns the sleeper's CPU seconds per
/// wake-up and how many wake-ups it had (writes that land while it is awake coalesce).
fn run(
    gap_us: u64,
    wakes: usize,
    sleeper_core: Option<usize>,
    waker_core: Option<usize>,
) -> (f64, u64) {
    let event = Arc::new(EventFd::new().expect("an eventfd"));
    let done = Arc::new(AtomicBool::new(false));
    let sleeper = {
        let (event, done) = (Arc::clone(&event), Arc::clone(&done));
        std::thread::spawn(move || {
            if let Some(c) = sleeper_core {
                let _ = pin_current_thread(c);
            }
            let mut woken = 0u64;
            let start = thread_cpu_time();
            while !done.load(Ordering::Acquire) {
                event.wait_timeout(Duration::from_secs(5));
                woken += 1;
            }
            let cpu = thread_cpu_time().saturating_sub(start).as_secs_f64();
            (cpu / woken.max(1) as f64, woken)
        })
    };
    if let Some(c) = waker_core {
        let _ = pin_current_thread(c);
    }
    for _ in 0..wakes {
        std::thread::sleep(Duration::from_micros(gap_us));
        event.notify();
    }
    done.store(true, Ordering::Release);
    event.notify();
    sleeper.join().expect("the sleeper thread")
}
