//! The user-space NVMe driver over VFIO, on a real kernel and a real (emulated) controller. These
//! run where `KVTIER_VFIO_PCI` names an NVMe controller bound to `vfio-pci` whose namespace 1
//! may be destroyed: in CI, inside a QEMU guest with an emulated IOMMU
//! (`tools/guest/vfio-tests.sh`, which runs them with `--include-ignored`). Elsewhere they are
//! ignored; run by hand without the variable, each says so and returns.
//!
//! `KVTIER_NVME_LBA` gives the namespace's LBA size, `KVTIER_VFIO_MDTS_BYTES` the controller's
//! transfer limit, `KVTIER_VFIO_DISK_BYTES` the namespace's size, as the guest was started.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_sys::mem::{HugePages, Region};
use kvtier_sys::nvme::Opcode;
use kvtier_sys::vfio::nvme::{Controller, Failure, IoCompletion, IoQueue};

const BLOCK: usize = 1 << 20;

fn pci() -> Option<String> {
    let pci = std::env::var("KVTIER_VFIO_PCI").ok();
    if pci.is_none() {
        kvtier_sys::skip!(
            "set KVTIER_VFIO_PCI=DDDD:BB:DD.F (a disposable NVMe controller bound to vfio-pci); \
             tools/guest/vfio-tests.sh runs these in a QEMU guest"
        );
    }
    pci
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().map(|v| v.parse().expect(name))
}

fn region(blocks: usize) -> Arc<Region> {
    let r = Region::allocate(blocks * BLOCK, HugePages::Off).expect("region");
    r.guard_blocks(BLOCK).expect("block size");
    Arc::new(r)
}

/// A pattern that differs at every 8 bytes, from `seed`.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len / 8)
        .flat_map(|i| (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64).to_le_bytes())
        .collect()
}

fn wait_all(q: &mut IoQueue, n: usize) -> Vec<IoCompletion> {
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < n {
        q.reap(&mut out);
        assert!(
            start.elapsed() < Duration::from_mins(1),
            "{} of {n} completions",
            out.len()
        );
        std::thread::yield_now();
    }
    out
}

/// Moves `len` bytes at region offset `at` to or from LBA `slba`, cut at the transfer limit,
/// and checks every command succeeded.
fn transfer(
    ctrl: &Controller,
    q: &mut IoQueue,
    r: &Arc<Region>,
    op: Opcode,
    at: usize,
    len: usize,
    slba: u64,
) {
    let max = ctrl.info().max_transfer_bytes();
    let shift = ctrl.info().lba_shift;
    // One claim on the whole transfer, a part of it for each command (as the engine cuts a
    // block at the transfer limit).
    let whole = r.checkout(at, len, op == Opcode::Read).expect("claim");
    let mut done = 0;
    let mut n = 0;
    while done < len {
        let part = max.min(len - done);
        q.push(
            n,
            op,
            slba + (done >> shift) as u64,
            0,
            whole.part(done, part),
        )
        .expect("room");
        done += part;
        n += 1;
    }
    q.submit();
    for c in wait_all(q, n as usize) {
        assert_eq!(c.result, Ok(()), "command {} of {n}", c.user_data);
    }
}

#[test]
#[ignore = "needs an NVMe controller bound to vfio-pci (KVTIER_VFIO_PCI)"]
fn identify_says_what_the_guest_was_given() {
    let Some(pci) = pci() else { return };
    let ctrl = Controller::open(&pci, 1).expect("open");
    let info = ctrl.info();
    println!("{info:?}");
    assert_eq!(info.pci, pci);
    assert_eq!(info.vendor_id, 0x1b36, "QEMU's NVMe controller");
    assert!(info.max_queue_entries >= 64, "{info:?}");
    if let Some(lba) = env_usize("KVTIER_NVME_LBA") {
        assert_eq!(info.lba_bytes() as usize, lba);
    }
    if let Some(mdts) = env_usize("KVTIER_VFIO_MDTS_BYTES") {
        assert_eq!(info.mdts_bytes, mdts);
        assert_eq!(info.max_transfer_bytes(), mdts.min(2 << 20));
    }
    if let Some(bytes) = env_usize("KVTIER_VFIO_DISK_BYTES") {
        assert_eq!(info.size_bytes(), bytes as u64);
    }
    assert!(info.io_queues >= 1);
    assert!(ctrl.is_ready());
    assert_eq!(ctrl.bus_master(), Ok(true));
    // QEMU's controller offers Doorbell Buffer Config (since QEMU 7.1), and takes it.
    assert!(info.shadow_doorbells, "{info:?}");
    assert!(ctrl.shadow_doorbells_on());
}

#[test]
#[ignore = "needs an NVMe controller bound to vfio-pci (KVTIER_VFIO_PCI)"]
fn a_missing_namespace_is_refused_by_name() {
    let Some(pci) = pci() else { return };
    let err = Controller::open(&pci, 9).expect_err("namespace 9");
    // QEMU's controller reports 256 namespaces, of which only the first is active.
    assert!(
        err.contains("namespace 9 does not exist") || err.contains("namespace 9 is not active"),
        "{err}"
    );
}

#[test]
#[ignore = "needs an NVMe controller bound to vfio-pci (KVTIER_VFIO_PCI)"]
fn writes_read_back_byte_exact_across_the_transfer_limit() {
    let Some(pci) = pci() else { return };
    let ctrl = Controller::open(&pci, 1).expect("open");
    let r = region(8);
    assert_eq!(ctrl.map_region(&r), Ok(0));
    let mut q = ctrl.create_queue(64).expect("queue");
    let lba = ctrl.info().lba_bytes() as usize;
    // 256 KiB, 2 MiB (several commands wherever MDTS is below it) and one LBA at an odd offset
    // inside a page (PRP1 with an offset).
    for (i, (at, len, slba)) in [
        (0, 256 << 10, 0_u64),
        (BLOCK, 2 * BLOCK, 4096),
        (3 * BLOCK + lba, lba, 99),
    ]
    .into_iter()
    .enumerate()
    {
        let bytes = pattern(i as u64 + 1, len);
        r.write(at, &bytes);
        transfer(&ctrl, &mut q, &r, Opcode::Write, at, len, slba);
        r.fill(4 * BLOCK, len.next_multiple_of(BLOCK).min(4 * BLOCK), 0);
        transfer(&ctrl, &mut q, &r, Opcode::Read, 4 * BLOCK, len, slba);
        let mut back = vec![0; len];
        r.read(4 * BLOCK, &mut back);
        assert!(
            back == bytes,
            "transfer {i}: {len} bytes at LBA {slba} read back different"
        );
    }
    // A flush completes.
    q.push_flush(7).expect("room");
    q.submit();
    assert_eq!(
        wait_all(&mut q, 1)[0],
        IoCompletion {
            user_data: 7,
            result: Ok(())
        }
    );
}

#[test]
#[ignore = "needs an NVMe controller bound to vfio-pci (KVTIER_VFIO_PCI)"]
fn a_full_queue_refuses_and_one_doorbell_sends_a_batch() {
    let Some(pci) = pci() else { return };
    let ctrl = Controller::open(&pci, 1).expect("open");
    let r = region(2);
    ctrl.map_region(&r).expect("map");
    let mut q = ctrl.create_queue(8).expect("queue");
    let lba = ctrl.info().lba_bytes() as usize;
    // Depth 8: seven in flight, the eighth refused.
    for i in 0..7 {
        let buf = r.checkout(i * 4096, lba, false).expect("claim");
        q.push(i as u64, Opcode::Write, 1000 + i as u64, 0, buf)
            .expect("room");
    }
    let buf = r.checkout(BLOCK, lba, false).expect("claim");
    assert!(
        q.push(99, Opcode::Write, 0, 0, buf).is_err(),
        "an eighth command in a depth-8 queue"
    );
    assert_eq!(q.in_flight(), 7);
    assert!(q.submit(), "the doorbell rang");
    assert!(!q.submit(), "nothing new: no doorbell");
    let mut done: Vec<u64> = wait_all(&mut q, 7)
        .into_iter()
        .map(|c| {
            assert_eq!(c.result, Ok(()));
            c.user_data
        })
        .collect();
    done.sort_unstable();
    assert_eq!(done, (0..7).collect::<Vec<_>>());
    assert_eq!(q.in_flight(), 0);
    // One batch: at most one register write for its tail and one per reap that found
    // completions; with shadow doorbells (QEMU offers them) often fewer.
    assert!(
        q.register_writes() >= 1,
        "the controller heard of the batch"
    );
    println!(
        "shadow doorbells {}, register writes {}",
        ctrl.shadow_doorbells_on(),
        q.register_writes()
    );
    // The claims went with the completions: the bytes are the caller's again.
    r.fill(0, BLOCK, 1);
}

#[test]
#[ignore = "needs an NVMe controller bound to vfio-pci (KVTIER_VFIO_PCI)"]
fn queues_come_and_go_and_data_outlives_the_handle() {
    let Some(pci) = pci() else { return };
    let bytes = pattern(42, BLOCK);
    {
        let ctrl = Controller::open(&pci, 1).expect("open");
        let r = region(1);
        ctrl.map_region(&r).expect("map");
        for _ in 0..3 {
            let mut q = ctrl.create_queue(16).expect("queue");
            r.write(0, &bytes);
            transfer(&ctrl, &mut q, &r, Opcode::Write, 0, BLOCK, 1 << 14);
        }
        assert!(
            ctrl.mappings() >= 2,
            "the admin memory, the region and the queues' memory"
        );
    }
    // A second open resets the controller and reads what the first wrote.
    let ctrl = Controller::open(&pci, 1).expect("reopen");
    let r = region(1);
    ctrl.map_region(&r).expect("map");
    let mut q = ctrl.create_queue(16).expect("queue");
    transfer(&ctrl, &mut q, &r, Opcode::Read, 0, BLOCK, 1 << 14);
    let mut back = vec![0; BLOCK];
    r.read(0, &mut back);
    assert!(
        back == bytes,
        "the block written before the reopen read back different"
    );
}

#[test]
#[ignore = "needs an NVMe controller bound to vfio-pci (KVTIER_VFIO_PCI)"]
fn a_fence_stops_every_command_in_flight_before_the_bytes_go_back() {
    let Some(pci) = pci() else { return };
    let ctrl = Controller::open(&pci, 1).expect("open");
    let r = region(32);
    ctrl.map_region(&r).expect("map");
    let max = ctrl.info().max_transfer_bytes();
    let mut q = ctrl.create_queue(256).expect("queue");
    // The namespace's first 32 MiB hold a pattern.
    let lbas = |bytes: usize| (bytes >> ctrl.info().lba_shift) as u64;
    let bytes = pattern(7, 16 * BLOCK);
    r.write(0, &bytes);
    transfer(&ctrl, &mut q, &r, Opcode::Write, 0, 16 * BLOCK, 0);
    transfer(
        &ctrl,
        &mut q,
        &r,
        Opcode::Write,
        0,
        16 * BLOCK,
        lbas(16 * BLOCK),
    );
    // Reads of all of it into the whole region, as many commands as the queue takes, and the
    // fence right after the doorbell.
    r.fill(0, 32 * BLOCK, 0);
    let whole = r.checkout(0, 32 * BLOCK, true).expect("claim");
    let mut pushed = 0;
    let mut at = 0;
    while at < 32 * BLOCK {
        if q.push(pushed, Opcode::Read, lbas(at), 0, whole.part(at, max))
            .is_err()
        {
            break;
        }
        pushed += 1;
        at += max;
    }
    drop(whole);
    q.submit();
    ctrl.fence();
    assert!(ctrl.is_fenced());
    assert!(!ctrl.is_ready(), "CSTS.RDY after the fence");
    assert_eq!(
        ctrl.bus_master(),
        Ok(false),
        "bus mastering after the fence"
    );
    let mut out = Vec::new();
    q.reap(&mut out);
    assert_eq!(out.len() as u64, pushed, "every command answered");
    assert!(out.iter().all(|c| c.result == Err(Failure::Fenced)));
    assert_eq!(q.in_flight(), 0);
    // The bytes are the caller's again: a marker written now must stay, whatever the device
    // had left to do.
    r.fill(0, 32 * BLOCK, 0xa5);
    std::thread::sleep(Duration::from_millis(500));
    let mut back = vec![0; 32 * BLOCK];
    r.read(0, &mut back);
    let landed = back.iter().position(|&b| b != 0xa5);
    assert_eq!(landed, None, "a byte changed after the fence");
    // A fenced controller takes no more commands.
    let buf = r.checkout(0, max, true).expect("claim");
    assert!(q.push(0, Opcode::Read, 0, 0, buf).is_err());
    assert!(ctrl.create_queue(16).is_err());
}

/// Leaves 1 MiB of pattern at the namespace's last MiB and in `KVTIER_VFIO_PATTERN_OUT`, for
/// the guest script to read back through the kernel's driver after rebinding.
#[test]
#[ignore = "needs an NVMe controller bound to vfio-pci (KVTIER_VFIO_PCI)"]
fn leaves_a_pattern_for_the_kernel_driver() {
    let Some(pci) = pci() else { return };
    let ctrl = Controller::open(&pci, 1).expect("open");
    let r = region(1);
    ctrl.map_region(&r).expect("map");
    let mut q = ctrl.create_queue(16).expect("queue");
    let bytes = pattern(0xfeed, BLOCK);
    r.write(0, &bytes);
    let last = ctrl.info().lbas - (BLOCK as u64 >> ctrl.info().lba_shift);
    transfer(&ctrl, &mut q, &r, Opcode::Write, 0, BLOCK, last);
    if let Some(path) = std::env::var_os("KVTIER_VFIO_PATTERN_OUT") {
        std::fs::write(path, &bytes).expect("pattern file");
    }
}
