//! Real-kernel tests of `Ring`: fixed-buffer `O_DIRECT` writes and reads through registered
//! files, eventfd wake-ups, queue-full back-pressure, and dropping a ring with I/O in flight.
//! Each test skips with a message when the kernel or filesystem lacks what it needs; a failure
//! means data was corrupted, a completion was lost, or memory was released under the kernel.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_sys::eventfd::EventFd;
use kvtier_sys::file::{probe_o_direct, DeviceFile, OpenOptions};
use kvtier_sys::mem::{HugePages, Region};
use kvtier_sys::ring::{ioprio, BufRef, Completion, IoprioClass, Ring, RingConfig};
use kvtier_sys::Errno;

const BLOCK: usize = 64 << 10;
const BLOCK_I32: i32 = 64 << 10;

fn ring_or_skip() -> Option<Ring> {
    match Ring::new(&RingConfig::default()) {
        Ok(r) => Some(r),
        Err(e) => {
            kvtier_sys::skip!("io_uring unavailable: {e}");
            None
        }
    }
}

/// A ring with one 1 MiB region (registered in 256 KiB pieces) and one 4 MiB `O_DIRECT` file.
fn setup(dir: &Path) -> Option<(Ring, Arc<Region>, Arc<DeviceFile>)> {
    if probe_o_direct(dir) != Ok(true) {
        kvtier_sys::skip!("{} refuses O_DIRECT", dir.display());
        return None;
    }
    let mut ring = ring_or_skip()?;
    let region = Arc::new(Region::allocate(1 << 20, HugePages::Off).expect("allocate"));
    ring.register_buffers(vec![Arc::clone(&region)], 256 << 10)
        .expect("register_buffers");
    let opts = OpenOptions {
        create: true,
        direct: true,
        read_only: false,
    };
    let file = Arc::new(DeviceFile::open(&dir.join("dev"), opts).expect("open"));
    file.fallocate(4 << 20).expect("fallocate");
    ring.register_files(vec![Arc::clone(&file)])
        .expect("register_files");
    Some((ring, region, file))
}

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kvtier-sys-ring-")
        .tempdir_in("/var/tmp")
        .expect("tempdir in /var/tmp")
}

fn wait_for(ring: &mut Ring, n: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while out.len() < n {
        assert!(Instant::now() < deadline, "completions lost: got {out:?}");
        ring.submit(1).expect("submit");
        ring.complete(&mut out);
    }
    out
}

#[test]
fn features_report_single_issuer() {
    let Some(ring) = ring_or_skip() else { return };
    let f = ring.features();
    println!("ring features: {f} ({f:?})");
    assert!(f.single_issuer, "Linux 6.0+ supports SINGLE_ISSUER: {f:?}");
    assert!(!f.sqpoll && !f.iopoll);
}

#[test]
fn fixed_write_then_read_round_trips_a_block() {
    let dir = tempdir();
    let Some((mut ring, region, _file)) = setup(dir.path()) else {
        return;
    };
    let pattern: Vec<u8> = (0..BLOCK).map(|i| (i * 7 + i / 4096) as u8).collect();
    region.write(0, &pattern);
    let be = ioprio(IoprioClass::Be, 4);
    let src = BufRef {
        region: 0,
        offset: 0,
        len: BLOCK as u32,
    };
    // SAFETY: the test touches its region only after the completions are waited for.
    unsafe { ring.push_write_raw(1, 0, 3 * BLOCK as u64, src, be) }.expect("push_write");
    assert_eq!(ring.in_flight(), 1);
    assert_eq!(ring.submit(1), Ok(1));
    let done = wait_for(&mut ring, 1);
    assert_eq!((done[0].user_data, done[0].result), (1, BLOCK_I32));
    assert_eq!(ring.in_flight(), 0);

    let dst = BufRef {
        region: 0,
        offset: 512 << 10,
        len: BLOCK as u32,
    };
    // SAFETY: the test touches its region only after the completions are waited for.
    unsafe { ring.push_read_raw(2, 0, 3 * BLOCK as u64, dst, 0) }.expect("push_read");
    let done = wait_for(&mut ring, 1);
    assert_eq!((done[0].user_data, done[0].result), (2, BLOCK_I32));
    let mut back = vec![0_u8; BLOCK];
    region.read(512 << 10, &mut back);
    assert!(back == pattern, "read-back differs from the written block");
}

#[test]
#[should_panic(expected = "straddles")]
fn buffer_straddling_pieces_panics() {
    let dir = tempdir();
    let Some((mut ring, _region, _file)) = setup(dir.path()) else {
        panic!("straddles (skipped: no O_DIRECT or io_uring)");
    };
    let buf = BufRef {
        region: 0,
        offset: (256 << 10) - 4096,
        len: 8192,
    };
    // SAFETY: the push panics before anything reaches the kernel.
    let _ = unsafe { ring.push_read_raw(1, 0, 0, buf, 0) };
}

#[test]
fn second_register_buffers_is_refused() {
    let dir = tempdir();
    let Some((mut ring, region, _file)) = setup(dir.path()) else {
        return;
    };
    let err = ring
        .register_buffers(vec![region], 4096)
        .expect_err("second registration");
    assert_eq!(err.errno, Errno::EBUSY);
    println!("{err}");
}

#[test]
fn eventfd_read_completes_after_notify() {
    let Some(mut ring) = ring_or_skip() else {
        return;
    };
    let efd = Arc::new(EventFd::new().expect("eventfd"));
    ring.push_eventfd_read(77, &efd).expect("push");
    ring.submit(0).expect("submit");
    let mut out = Vec::new();
    ring.complete(&mut out);
    assert!(
        out.is_empty(),
        "eventfd read finished before notify: {out:?}"
    );
    assert_eq!(ring.in_flight(), 1);
    let notifier = Arc::clone(&efd);
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        notifier.notify();
    });
    let done = wait_for(&mut ring, 1);
    t.join().expect("notifier thread");
    assert_eq!((done[0].user_data, done[0].result), (77, 8));
    assert_eq!(ring.in_flight(), 0);
}

// An op that would wait forever (an eventfd nobody writes) is cancelled: its own CQE arrives
// with -ECANCELED and the cancel's completion is not handed out (the caller never sees a
// user_data it did not push).
#[test]
fn a_cancelled_op_completes_with_its_own_cqe_only() {
    let Some(mut ring) = ring_or_skip() else {
        return;
    };
    let efd = Arc::new(EventFd::new().expect("eventfd"));
    ring.push_eventfd_read(78, &efd).expect("push");
    ring.submit(0).expect("submit");
    ring.push_cancel(78).expect("push cancel");
    assert_eq!(ring.in_flight(), 2);
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while ring.in_flight() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "cancel never completed: {out:?}"
        );
        ring.submit(1).expect("submit");
        ring.complete(&mut out);
    }
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(
        (out[0].user_data, out[0].result),
        (78, -(kvtier_sys::Errno::ECANCELED as i32))
    );
}

#[test]
fn full_submission_queue_is_reported() {
    let cfg = RingConfig {
        entries: 4,
        ..RingConfig::default()
    };
    let Ok(mut ring) = Ring::new(&cfg) else {
        kvtier_sys::skip!("io_uring unavailable");
        return;
    };
    let efd = Arc::new(EventFd::new().expect("eventfd"));
    assert_eq!(ring.sq_space_left(), 4);
    for i in 0..4 {
        ring.push_eventfd_read(i, &efd).expect("room");
    }
    assert_eq!(ring.sq_space_left(), 0);
    assert!(ring.push_eventfd_read(9, &efd).is_err());
    assert_eq!(ring.in_flight(), 4);
    ring.submit(0).expect("submit");
    assert_eq!(ring.sq_space_left(), 4);
    // Dropped with four reads pending that no one will ever notify: Drop must cancel them.
}

#[test]
fn drop_with_io_in_flight_drains_first() {
    let dir = tempdir();
    let Some((mut ring, region, _file)) = setup(dir.path()) else {
        return;
    };
    let efd = Arc::new(EventFd::new().expect("eventfd"));
    region.fill(0, 1 << 20, 0x5A);
    for i in 0..8_u64 {
        let buf = BufRef {
            region: 0,
            offset: (i as usize % 4) * BLOCK,
            len: BLOCK as u32,
        };
        // SAFETY: the kernel only reads the region, which the test no longer writes.
        unsafe { ring.push_write_raw(i, 0, i * BLOCK as u64, buf, 0) }.expect("push");
    }
    ring.push_eventfd_read(100, &efd)
        .expect("push eventfd read");
    ring.submit(0).expect("submit");
    // Two more queued but never submitted.
    let buf = BufRef {
        region: 0,
        offset: 0,
        len: 4096,
    };
    // SAFETY: the test no longer touches the region; the ring's drop waits for the kernel.
    unsafe { ring.push_read_raw(200, 0, 0, buf, 0) }.expect("push");
    ring.push_eventfd_read(201, &efd).expect("push");
    assert_eq!(ring.in_flight(), 11);
    let t0 = Instant::now();
    drop(ring);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "drain took {:?}",
        t0.elapsed()
    );
    // The region is still ours and intact.
    assert_eq!(Arc::strong_count(&region), 1);
    let mut b = [0_u8; 1];
    region.read(4096, &mut b);
}

// The bound on the ring's kernel workers is recorded: setting it returns the previous one, so
// a second call returns the first call's value; the unbounded workers' limit is untouched.
#[test]
fn io_wq_bound_is_set_and_reported() {
    let Some(mut ring) = ring_or_skip() else {
        return;
    };
    match ring.set_io_wq_bounded(32) {
        Ok(default) => assert!(default >= 1, "the kernel's default bound is {default}"),
        Err(e) => {
            kvtier_sys::skip!("IORING_REGISTER_IOWQ_MAX_WORKERS refused: {e}");
            return;
        }
    }
    assert_eq!(ring.set_io_wq_bounded(5), Ok(32));
    assert_eq!(ring.set_io_wq_bounded(5), Ok(5));
}

#[test]
fn ioprio_values() {
    assert_eq!(ioprio(IoprioClass::None, 0), 0);
    assert_eq!(ioprio(IoprioClass::Be, 4), (2 << 13) | 4);
    assert_eq!(ioprio(IoprioClass::Idle, 0), 3 << 13);
    assert_eq!(ioprio(IoprioClass::Rt, 7), (1 << 13) | 7);
}

#[test]
fn registering_64_mib_works_or_explains_memlock() {
    // Without CAP_IPC_LOCK and with the default 8 MiB RLIMIT_MEMLOCK this fails with ENOMEM;
    // the error must then say how to fix it instead of just "out of memory".
    let Some(mut ring) = ring_or_skip() else {
        return;
    };
    let region = Arc::new(Region::allocate(64 << 20, HugePages::Auto).expect("allocate 64 MiB"));
    println!("64 MiB region backed by {}", region.backing());
    match ring.register_buffers(vec![region], 16 << 20) {
        Ok(()) => {}
        Err(e) if e.errno == Errno::ENOMEM => {
            println!("{e}");
            let msg = e.to_string();
            assert!(
                msg.contains("CAP_IPC_LOCK") || msg.contains("lower the DRAM size"),
                "{msg}"
            );
        }
        Err(e) => panic!("register_buffers(64 MiB): {e}"),
    }
}

#[test]
fn sqpoll_ring_round_trips_or_falls_back() {
    let dir = tempdir();
    if probe_o_direct(dir.path()) != Ok(true) {
        kvtier_sys::skip!("no O_DIRECT in /var/tmp");
        return;
    }
    let cfg = RingConfig {
        entries: 8,
        sqpoll: true,
        sqpoll_idle_ms: 10,
        iopoll: false,
        big_entries: false,
    };
    let Ok(mut ring) = Ring::new(&cfg) else {
        kvtier_sys::skip!("io_uring unavailable");
        return;
    };
    println!("requested sqpoll, got {}", ring.features());
    let region = Arc::new(Region::allocate(2 * BLOCK, HugePages::Off).expect("allocate"));
    ring.register_buffers(vec![Arc::clone(&region)], BLOCK)
        .expect("register_buffers");
    let opts = OpenOptions {
        create: true,
        direct: true,
        read_only: false,
    };
    let file = Arc::new(DeviceFile::open(&dir.path().join("dev"), opts).expect("open"));
    file.fallocate(BLOCK as u64).expect("fallocate");
    ring.register_files(vec![file]).expect("register_files");
    region.fill(0, BLOCK, 0xC3);
    let block = |i: usize| BufRef {
        region: 0,
        offset: i * BLOCK,
        len: BLOCK as u32,
    };
    // SAFETY: the test touches its region only after the completions are waited for.
    unsafe { ring.push_write_raw(1, 0, 0, block(0), 0) }.expect("push_write");
    assert_eq!(wait_for(&mut ring, 1)[0].result, BLOCK_I32);
    // SAFETY: the test touches its region only after the completions are waited for.
    unsafe { ring.push_read_raw(2, 0, 0, block(1), 0) }.expect("push_read");
    assert_eq!(wait_for(&mut ring, 1)[0].result, BLOCK_I32);
    let mut back = vec![0_u8; BLOCK];
    region.read(BLOCK, &mut back);
    assert!(back.iter().all(|&b| b == 0xC3));
}

/// A read pushed with a claim keeps its block leased until its completion is popped, even after
/// the job that owned the lease let go of it (a deadline reported it): the caller cannot write
/// the block, nor lease it to another job, while the kernel may still land bytes there. A
/// write's claim keeps writers off the bytes the kernel reads.
#[test]
fn a_claimed_read_keeps_its_block_until_the_completion_is_popped() {
    let dir = tempdir();
    let Some((mut ring, region, _file)) = setup(dir.path()) else {
        return;
    };
    region.guard_blocks(BLOCK).expect("guard");
    region.fill(0, BLOCK, 0x5A);
    let store = Arc::new(region.lease(&[0], false).expect("free"));
    let src = store.checkout(0, BLOCK, false).expect("held");
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = ring.push_read(
            9,
            0,
            0,
            0,
            store.checkout(0, BLOCK, false).expect("held"),
            0,
        );
    }));
    assert!(read.is_err(), "a read into bytes claimed only to be read");
    ring.push_write(1, 0, 0, 0, src, 0).expect("push_write");
    store.release();
    assert!(region.is_leased(0), "the write still reads the block");
    assert_eq!(wait_for(&mut ring, 1)[0].result, BLOCK_I32);
    assert!(!region.is_leased(0), "the popped completion let it go");

    let load = Arc::new(region.lease(&[1], true).expect("free"));
    let dst = load.checkout(BLOCK, BLOCK, true).expect("held");
    ring.push_read(2, 0, 0, 0, dst, 0).expect("push_read");
    // The job is reported before the read lands: its holder lets go.
    load.release();
    assert!(region.is_leased(1));
    let write = std::panic::catch_unwind(|| region.fill(BLOCK, 16, 0));
    assert!(write.is_err(), "the caller cannot write under the kernel");
    assert!(
        region.lease(&[1], false).is_err(),
        "nor lend it to another job"
    );
    assert_eq!(wait_for(&mut ring, 1)[0].result, BLOCK_I32);
    assert!(!region.is_leased(1));
    let mut back = vec![0_u8; BLOCK];
    region.read(BLOCK, &mut back);
    assert!(back.iter().all(|&b| b == 0x5A), "the read landed");
}
