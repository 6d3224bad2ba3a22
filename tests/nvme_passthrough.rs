//! NVMe passthrough on a real kernel: the slab on the raw LBAs of `/dev/ngXnY`, through
//! `URING_CMD` with fixed buffers. These run where `KVTIER_NVME_DEVICE` names an NVMe generic
//! device whose contents may be destroyed: in CI, inside a QEMU guest with an emulated NVMe
//! controller (`tools/guest/nvme-tests.sh`, which runs them with `--include-ignored`). Elsewhere
//! they are ignored, so the suite's summary counts them as skipped; run by hand without the
//! variable, each says so and returns.
//!
//! `KVTIER_NVME_POLLED=1` says the guest's driver has poll queues, so `iopoll = true` must give
//! a polled ring; without it `iopoll = true` must still work (completions by interrupt).

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvtier::config::{Cores, DeviceConfig, DeviceKind};
use kvtier::{Config, Engine, Job, JobResult, Key, KeyFailure, Region};
use kvtier_sys::nvme::{Namespace, Opcode, Outcome};
use kvtier_sys::ring::{Ring, RingConfig};

use common::{content, env_u64, wait_results};

/// Larger than QEMU's default transfer limit (MDTS 7: 512 KiB), so every block is several
/// commands.
const BLOCK: u64 = 1 << 20;

fn device() -> Option<PathBuf> {
    let path = std::env::var_os("KVTIER_NVME_DEVICE").map(PathBuf::from);
    if path.is_none() {
        kvtier_sys::skip!(
            "set KVTIER_NVME_DEVICE=/dev/ngXnY (a disposable namespace) to run; \
             tools/guest/nvme-tests.sh runs these in a QEMU guest"
        );
    }
    path
}

fn config(path: &PathBuf, iopoll: bool) -> Config {
    let mut d = DeviceConfig::new(path);
    d.overwrite = true;
    Config {
        block_size: BLOCK,
        cores: Cores::List(vec![0]),
        iopoll,
        devices: vec![d],
        ..Config::default()
    }
}

fn region(blocks: u64) -> Arc<Region> {
    kvtier::region::allocate_blocks(BLOCK, blocks, kvtier::config::HugePages::Off).expect("region")
}

fn key(id: u64) -> Key {
    Key::vllm(&id.to_be_bytes().repeat(4), 0).expect("key")
}

fn put(region: &Region, block: u32, id: u64) {
    region.write(
        block as usize * BLOCK as usize,
        &content(id, BLOCK as usize),
    );
}

fn holds(region: &Region, block: u32, id: u64) -> bool {
    let mut got = vec![0_u8; BLOCK as usize];
    region.read(block as usize * BLOCK as usize, &mut got);
    got == content(id, BLOCK as usize)
}

fn store(engine: &Engine, region: &Region, job: u64, ids: &[u64]) -> JobResult {
    let blocks: Vec<u32> = (0..ids.len() as u32).collect();
    for (&b, &id) in blocks.iter().zip(ids) {
        put(region, b, id);
    }
    let keys = ids.iter().map(|&i| key(i)).collect();
    engine
        .submit_store(Job::new(job, keys, blocks))
        .expect("submit store");
    wait_results(engine, 1).pop().expect("a result")
}

fn load(engine: &Engine, region: &Region, job: u64, ids: &[u64]) -> JobResult {
    let blocks: Vec<u32> = (0..ids.len() as u32).collect();
    for &b in &blocks {
        region.fill(b as usize * BLOCK as usize, BLOCK as usize, 0xee);
    }
    let keys = ids.iter().map(|&i| key(i)).collect();
    engine
        .submit_load(Job::new(job, keys, blocks))
        .expect("submit load");
    wait_results(engine, 1).pop().expect("a result")
}

fn round_trip(path: &PathBuf, iopoll: bool) {
    let region = region(16);
    let engine = Engine::open(&config(path, iopoll), Arc::clone(&region)).expect("open");
    let info = engine.info();
    assert_eq!(info.devices[0].kind, "nvme passthrough", "{info:?}");
    let backend = &info.workers[0].backend;
    assert!(backend.contains("SQE128|CQE32"), "{backend}");
    let polled = env_u64("KVTIER_NVME_POLLED", 0) == 1;
    assert_eq!(
        backend.contains("IOPOLL"),
        iopoll,
        "iopoll = {iopoll} (driver poll queues: {polled}): {backend}"
    );
    println!(
        "{}: {backend}, geometry {:?}",
        path.display(),
        info.devices[0].geometry
    );
    for round in 0..3_u64 {
        let ids: Vec<u64> = (round * 16..round * 16 + 16).collect();
        let r = store(&engine, &region, round * 2, &ids);
        assert!(r.success, "store: {r:?}");
        let r = load(&engine, &region, round * 2 + 1, &ids);
        assert!(r.success, "load: {r:?}");
        for (b, &id) in ids.iter().enumerate() {
            assert!(holds(&region, b as u32, id), "block {b} (key {id}) differs");
        }
    }
    let stats = engine.stats();
    assert_eq!(stats.loads_failed + stats.stores_failed, 0, "{stats:?}");
    engine.shutdown();
}

#[test]
#[ignore = "needs KVTIER_NVME_DEVICE=/dev/ngXnY: tools/guest/nvme-tests.sh runs it in a QEMU guest"]
fn byte_exact_round_trips_by_interrupt() {
    let Some(path) = device() else { return };
    round_trip(&path, false);
}

#[test]
#[ignore = "needs KVTIER_NVME_DEVICE=/dev/ngXnY: tools/guest/nvme-tests.sh runs it in a QEMU guest"]
fn byte_exact_round_trips_polled() {
    let Some(path) = device() else { return };
    round_trip(&path, true);
}

#[test]
#[ignore = "needs KVTIER_NVME_DEVICE=/dev/ngXnY: tools/guest/nvme-tests.sh runs it in a QEMU guest"]
fn geometry_and_transfers_larger_than_the_limit() {
    let Some(path) = device() else { return };
    let ns = Namespace::open(&path).expect("namespace");
    let g = ns.geometry().clone();
    println!("{g:?}");
    let want_lba = env_u64("KVTIER_NVME_LBA", 0);
    if want_lba != 0 {
        assert_eq!(u64::from(g.lba_bytes()), want_lba, "{g:?}");
    }
    assert!(g.max_transfer_bytes >= g.lba_bytes(), "{g:?}");
    assert_eq!(g.max_transfer_bytes % g.lba_bytes(), 0, "{g:?}");
    // A transfer of several limits, not a multiple of it, through the ioctl path.
    let len = (g.max_transfer_bytes as usize * 5 / 2).next_multiple_of(g.lba_bytes() as usize);
    let buf = Region::allocate(len * 2, kvtier_sys::mem::HugePages::Off).expect("buffer");
    let pattern = content(7, len);
    buf.write(0, &pattern);
    let at = u64::from(g.lba_bytes()) * 3;
    ns.write_sync(at, &buf, 0, len).expect("write");
    ns.read_sync(at, &buf, len, len).expect("read");
    let mut back = vec![0_u8; len];
    buf.read(len, &mut back);
    assert!(back == pattern, "read back differs");
}

#[test]
#[ignore = "needs KVTIER_NVME_DEVICE=/dev/ngXnY: tools/guest/nvme-tests.sh runs it in a QEMU guest"]
fn an_out_of_range_lba_is_a_named_error() {
    let Some(path) = device() else { return };
    let ns = Namespace::open(&path).expect("namespace");
    let g = ns.geometry().clone();
    let buf = Arc::new(Region::allocate(1 << 20, kvtier_sys::mem::HugePages::Off).expect("buf"));
    buf.guard_blocks(g.lba_bytes() as usize).expect("guard");
    let err = ns
        .read_sync(g.size_bytes(), &buf, 0, g.lba_bytes() as usize)
        .expect_err("reading past the end");
    let text = err.to_string();
    assert!(
        text.contains("LBA out of range") || text.contains("Invalid argument"),
        "{text}"
    );
    assert!(
        text.contains("read of LBAs") && text.contains(&path.display().to_string()),
        "{text}"
    );
    // The same through the ring: the CQE carries the NVMe status.
    let mut ring = Ring::new(&RingConfig {
        entries: 8,
        big_entries: true,
        ..RingConfig::default()
    })
    .expect("ring");
    ring.register_buffers(vec![Arc::clone(&buf)], 1 << 20)
        .expect("buffers");
    ring.register_files(vec![Arc::clone(ns.file())])
        .expect("files");
    let lba = g.lba_bytes() as usize;
    let claim = |at: usize| buf.checkout(at, lba, true).expect("a free LBA-sized block");
    ring.push_nvme(1, 0, Opcode::Read, g.nsid, g.lbas, g.lba_shift, 0, claim(0))
        .expect("push");
    ring.push_nvme(2, 0, Opcode::Read, g.nsid, 0, g.lba_shift, 0, claim(lba))
        .expect("push");
    assert!(buf.is_leased(0) && buf.is_leased(1), "claimed until reaped");
    ring.submit(2).expect("submit");
    let mut out = Vec::new();
    while out.len() < 2 {
        ring.submit(1).expect("wait");
        ring.complete(&mut out);
    }
    out.sort_by_key(|c| c.user_data);
    match Outcome::from_result(out[0].result) {
        Outcome::Status(s) => {
            assert_eq!(s.text(), "LBA out of range", "{s}");
            assert!(!s.retryable(), "{s}");
        }
        other => panic!("expected an NVMe status, got {other:?}"),
    }
    assert_eq!(Outcome::from_result(out[1].result), Outcome::Done);
    assert!(
        !buf.is_leased(0) && !buf.is_leased(1),
        "the completions let them go"
    );
}

#[test]
#[ignore = "needs KVTIER_NVME_DEVICE=/dev/ngXnY: tools/guest/nvme-tests.sh runs it in a QEMU guest"]
fn recovery_after_reopen_and_a_corrupt_slot_is_never_served() {
    let Some(path) = device() else { return };
    let region = region(8);
    let ids: Vec<u64> = (1000..1008).collect();
    {
        let engine = Engine::open(&config(&path, false), Arc::clone(&region)).expect("open");
        assert!(store(&engine, &region, 1, &ids).success);
        engine.shutdown();
    }
    // Damage one stored block on the raw LBAs: find the slot holding key 1003's bytes.
    let ns = Namespace::open(&path).expect("namespace");
    let page = Region::allocate(BLOCK as usize, kvtier_sys::mem::HugePages::Off).expect("page");
    ns.read_sync(0, &page, 0, kvtier::slab::HEADER_BYTES as usize)
        .expect("header");
    let geometry = match page.with_bytes(
        0,
        kvtier::slab::HEADER_BYTES as usize,
        kvtier::slab::Header::decode,
    ) {
        kvtier::slab::HeaderRead::Valid(h) => h.geometry,
        other => panic!("no header: {other:?}"),
    };
    let victim = content(1003, BLOCK as usize);
    let lba = u64::from(ns.geometry().lba_bytes()) as usize;
    let mut damaged = false;
    for slot in 0..geometry.slot_count {
        let at = geometry.data_offset + slot * geometry.slot_bytes;
        ns.read_sync(at, &page, 0, lba).expect("slot");
        let mut first = vec![0_u8; lba];
        page.read(0, &mut first);
        if first == victim[..lba] {
            first[lba / 2] ^= 0x40;
            page.write(0, &first);
            ns.write_sync(at, &page, 0, lba).expect("damage");
            damaged = true;
            break;
        }
    }
    assert!(damaged, "key 1003's slot was not found on the device");
    let engine = Engine::open(&config(&path, false), Arc::clone(&region)).expect("reopen");
    assert!(
        engine.info().workers[0].recovered_blocks >= 8,
        "{:?}",
        engine.info()
    );
    let r = load(&engine, &region, 2, &ids);
    assert!(!r.success, "a damaged block was served: {r:?}");
    let failed: Vec<(u64, KeyFailure)> = r
        .failures
        .iter()
        .map(|f| (ids[f.key_index], f.reason))
        .collect();
    assert_eq!(failed, vec![(1003, KeyFailure::Checksum)], "{r:?}");
    for (b, &id) in ids.iter().enumerate() {
        if id != 1003 {
            assert!(
                holds(&region, b as u32, id),
                "key {id} differs after reopen"
            );
        }
    }
    engine.shutdown();
}

#[test]
#[ignore = "needs KVTIER_NVME_DEVICE=/dev/ngXnY: tools/guest/nvme-tests.sh runs it in a QEMU guest"]
fn shutdown_with_io_in_flight_loses_nothing_acknowledged() {
    let Some(path) = device() else { return };
    let region = region(64);
    let ids: Vec<u64> = (5000..5064).collect();
    let engine = Engine::open(&config(&path, true), Arc::clone(&region)).expect("open");
    for (b, &id) in ids.iter().enumerate() {
        put(&region, b as u32, id);
    }
    for (j, chunk) in ids.chunks(8).enumerate() {
        let keys = chunk.iter().map(|&i| key(i)).collect();
        let blocks = (j as u32 * 8..j as u32 * 8 + chunk.len() as u32).collect();
        engine
            .submit_store(Job::new(j as u64, keys, blocks))
            .expect("submit");
    }
    assert!(
        common::shutdown_returns(engine, Duration::from_mins(1)),
        "shutdown with passthrough I/O in flight did not return"
    );
    // Whatever was acknowledged or not, a reopen serves every key exactly or not at all.
    let region = self::region(64);
    let engine = Engine::open(&config(&path, false), Arc::clone(&region)).expect("reopen");
    let blocks: Vec<u32> = (0..64).collect();
    let keys = ids.iter().map(|&i| key(i)).collect();
    engine
        .submit_load(Job::new(100, keys, blocks))
        .expect("load");
    let r = wait_results(&engine, 1).pop().expect("result");
    let mut served = 0;
    for (b, &id) in ids.iter().enumerate() {
        if r.failures.iter().any(|f| f.key_index == b) {
            continue;
        }
        assert!(
            holds(&region, b as u32, id),
            "key {id} was served with wrong bytes"
        );
        served += 1;
    }
    println!("after shutdown with stores in flight: {served} of 64 keys served, all exact");
    for f in &r.failures {
        assert_eq!(f.reason, KeyFailure::Miss, "{r:?}");
    }
    engine.shutdown();
}

#[test]
#[ignore = "needs KVTIER_NVME_DEVICE=/dev/ngXnY: tools/guest/nvme-tests.sh runs it in a QEMU guest"]
fn kind_block_and_kind_nvme_pick_the_path_and_share_the_layout() {
    let Some(path) = device() else { return };
    let region = region(4);
    let mut cfg = config(&path, false);
    cfg.devices[0].kind = DeviceKind::Block;
    let engine = Engine::open(&cfg, Arc::clone(&region)).expect("open through the block layer");
    assert_eq!(engine.info().devices[0].kind, "block device");
    let ids = [1, 2, 3, 4];
    assert!(store(&engine, &region, 1, &ids).success);
    assert!(load(&engine, &region, 2, &ids).success);
    for (b, &id) in ids.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }
    engine.shutdown();
    // And the passthrough engine reads what the block layer wrote: one on-device layout. Here
    // through kind = "nvme" on the block device's path, which uses its generic device.
    let block = Namespace::open(&path)
        .expect("namespace")
        .geometry()
        .block_device
        .clone();
    let mut cfg = config(&block, false);
    cfg.devices[0].kind = DeviceKind::Nvme;
    let engine = Engine::open(&cfg, Arc::clone(&region)).expect("open");
    assert_eq!(engine.info().devices[0].kind, "nvme passthrough");
    assert!(load(&engine, &region, 3, &ids).success);
    for (b, &id) in ids.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }
    engine.shutdown();
}

/// Without permission on `/dev/ngXnY` the engine falls back to the block device. Runs the
/// check below in a child process as an unprivileged user (the test binary runs itself).
#[test]
#[ignore = "needs KVTIER_NVME_DEVICE=/dev/ngXnY: tools/guest/nvme-tests.sh runs it in a QEMU guest"]
fn without_permission_it_falls_back_to_the_block_device() {
    let Some(path) = device() else { return };
    if std::env::var_os("KVTIER_NVME_CHILD").is_some() {
        let region = region(2);
        let engine = Engine::open(&config(&path, false), Arc::clone(&region))
            .expect("open falls back to the block device");
        assert_eq!(engine.info().devices[0].kind, "block device");
        let ids = [77, 78];
        assert!(store(&engine, &region, 1, &ids).success);
        assert!(load(&engine, &region, 2, &ids).success);
        assert!(holds(&region, 0, 77) && holds(&region, 1, 78));
        engine.shutdown();
        return;
    }
    // /proc/self belongs to the process's effective user.
    if std::fs::metadata("/proc/self").map_or(1, |m| m.uid()) != 0 {
        return kvtier_sys::skip!("needs root to run the child as another user");
    }
    let ns = Namespace::open(&path).expect("namespace");
    let block = ns.geometry().block_device.clone();
    drop(ns);
    // The generic device stays root-only; the block device is opened to everyone, as a
    // deployment might grant a service user a disk group.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod ng");
    std::fs::set_permissions(&block, std::fs::Permissions::from_mode(0o666)).expect("chmod blk");
    let out = std::process::Command::new(std::env::current_exe().expect("exe"))
        .args([
            "--exact",
            "without_permission_it_falls_back_to_the_block_device",
            "--include-ignored",
            "--nocapture",
        ])
        .env("KVTIER_NVME_CHILD", "1")
        .uid(65534)
        .gid(65534)
        .output()
        .expect("child runs");
    std::fs::set_permissions(&block, std::fs::Permissions::from_mode(0o660)).expect("chmod back");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child failed: {text}");
    assert!(text.contains("1 passed"), "{text}");
}
