//! What one block checksum costs a thread that sleeps between blocks, as a worker does while
//! the device is slow: the same crc32c over the same 8 blocks in rotation (a queue depth 8
//! store stream's working set), with the thread asleep for a gap before each block. Only the
//! checksum is timed (the thread's CPU time around it), so the sleep's own system calls are
//! not counted. On the development machine (a virtual machine) a 2 MiB block's checksum costs
//! about 2.3 times as much after 8 ms asleep as back to back, and a 256 KiB block's about 5
//! times (docs/perf.md, "What rises when the device slows"): CPU per GiB that grows as the
//! device slows, with no I/O and no kvtier code involved.
//!
//! `cargo bench --bench crc_after_idle` prints the table; under `cargo test --all-targets` it
//! runs a few blocks per gap, to keep building and working.

use std::hint::black_box;
use std::time::Duration;

use kvtier_sys::affinity::thread_cpu_time;

const BLOCKS: usize = 8;
const GAPS_US: [u64; 4] = [0, 100, 1000, 8000];

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    println!("block      gap   crc µs/block (median of blocks)   crc s/GiB   blocks");
    for bs in [256usize << 10, 2 << 20] {
        let pool: Vec<u8> = (0..bs * BLOCKS).map(|i| (i * 131 % 251) as u8).collect();
        for gap_us in GAPS_US {
            // About 2 s of gaps, or 4 GiB of checksums back to back; a few in test mode.
            let n = match (bench, gap_us) {
                (false, _) => BLOCKS,
                (true, 0) => (4usize << 30) / bs,
                (true, g) => (2_000_000 / g as usize).max(BLOCKS),
            };
            let mut times = Vec::with_capacity(n);
            for i in 0..n {
                if gap_us > 0 {
                    std::thread::sleep(Duration::from_micros(gap_us));
                }
                let block = &pool[(i % BLOCKS) * bs..][..bs];
                let t0 = thread_cpu_time();
                black_box(kvtier::checksum::crc32c(black_box(block)));
                times.push(thread_cpu_time().saturating_sub(t0).as_secs_f64());
            }
            let total: f64 = times.iter().sum();
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            let per_gib = total / (n * bs) as f64 * f64::from(1u32 << 30);
            println!(
                "{:>4} KiB {:>5} µs {:>14.1} {:>30.3} {:>8}",
                bs >> 10,
                gap_us,
                median * 1e6,
                per_gib,
                n
            );
        }
    }
}
