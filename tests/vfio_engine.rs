//! The engine on an NVMe controller driven from user space through VFIO: the slab on namespace
//! 1's LBAs, as on passthrough. These run where `KVTIER_VFIO_PCI` names an NVMe controller
//! bound to `vfio-pci` whose namespace 1 may be destroyed: in CI, inside a QEMU guest with an
//! emulated IOMMU (`tools/guest/vfio-tests.sh`, which runs them with `--include-ignored`).
//! Elsewhere they are ignored; run by hand without the variable, each says so and returns.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::config::{Cores, DeviceConfig};
use kvtier::{Config, Engine, Region};
use kvtier_sys::vfio::nvme::Controller;

use common::content;

/// Larger than QEMU's default transfer limit (MDTS 7: 512 KiB), so every block is several
/// commands.
const BLOCK: u64 = 1 << 20;
const CHILD_ENV: &str = "KVTIER_VFIO_KILL_CHILD";

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

fn config(pci: &str) -> Config {
    let mut d = DeviceConfig::vfio(pci, 1);
    d.overwrite = true;
    // The namespace's first 64 MiB: the guest script keeps a pattern in its last MiB.
    d.capacity_bytes = Some(64 << 20);
    Config {
        block_size: BLOCK,
        cores: Cores::List(vec![0]),
        devices: vec![d],
        ..Config::default()
    }
}

fn region(blocks: u64) -> Arc<Region> {
    kvtier::region::allocate_blocks(BLOCK, blocks, kvtier::config::HugePages::Off).expect("region")
}

/// `common`'s helpers write 64 KiB blocks; these tests use 1 MiB ones.
fn put(region: &Region, block: u32, id: u64) {
    region.write(
        block as usize * BLOCK as usize,
        &content(id, BLOCK as usize),
    );
}

fn store_big(engine: &Engine, region: &Region, job: u64, ids: &[u64]) -> kvtier::JobResult {
    for (b, &id) in ids.iter().enumerate() {
        put(region, b as u32, id);
    }
    let keys = ids.iter().map(|&i| common::key(i)).collect();
    let blocks = (0..ids.len() as u32).collect();
    engine
        .submit_store(kvtier::Job::new(job, keys, blocks))
        .expect("submit store");
    common::wait_results(engine, 1).pop().expect("a result")
}

fn holds_big(region: &Region, block: u32, id: u64) -> bool {
    let mut got = vec![0_u8; BLOCK as usize];
    region.read(block as usize * BLOCK as usize, &mut got);
    got == content(id, BLOCK as usize)
}

fn load_big(engine: &Engine, region: &Region, job: u64, ids: &[u64]) -> kvtier::JobResult {
    for b in 0..ids.len() {
        region.fill(b * BLOCK as usize, BLOCK as usize, 0xee);
    }
    common::load_into(engine, job, ids, (0..ids.len() as u32).collect())
}

#[test]
#[ignore = "needs an NVMe controller bound to vfio-pci (KVTIER_VFIO_PCI)"]
fn the_slab_round_trips_byte_exact_and_recovers_on_a_vfio_controller() {
    let Some(pci) = pci() else { return };
    let region = region(16);
    let engine = Engine::open(&config(&pci), Arc::clone(&region)).expect("open");
    let info = engine.info();
    assert_eq!(info.devices[0].kind, "nvme vfio", "{info:?}");
    let backend = &info.workers[0].backend;
    assert!(
        backend.starts_with("vfio [") && backend.contains(&pci),
        "{backend}"
    );
    println!("{backend}, geometry {:?}", info.devices[0].geometry);
    for round in 0..3_u64 {
        let ids: Vec<u64> = (round * 16..round * 16 + 16).collect();
        let r = store_big(&engine, &region, round * 2, &ids);
        assert!(r.success, "store: {r:?}");
        let r = load_big(&engine, &region, round * 2 + 1, &ids);
        assert!(r.success, "load: {r:?}");
        for (b, &id) in ids.iter().enumerate() {
            assert!(
                holds_big(&region, b as u32, id),
                "block {b} (key {id}) differs"
            );
        }
    }
    let stats = engine.stats();
    assert_eq!(stats.loads_failed + stats.stores_failed, 0, "{stats:?}");
    assert!(engine.shutdown().clean());
    drop(engine);
    // Reopened: recovered from the slot table on the namespace.
    let engine = Engine::open(&config(&pci), Arc::clone(&region)).expect("reopen");
    let ids: Vec<u64> = (32..48).collect();
    let r = load_big(&engine, &region, 100, &ids);
    assert!(r.success, "load after reopen: {r:?}");
    for (b, &id) in ids.iter().enumerate() {
        assert!(
            holds_big(&region, b as u32, id),
            "block {b} (key {id}) after reopen"
        );
    }
    assert!(engine.shutdown().clean());
    // Shutdown gave the controller back: this process can take it again at once.
    let ctrl = Controller::open(&pci, 1).expect("the controller after shutdown");
    assert!(ctrl.is_ready());
}

/// Stores keys 1000..1016, prints that they are acknowledged, then rewrites keys 2000..2016
/// in a loop until killed: 32 keys in 63 slots, so nothing acknowledged is evicted.
#[test]
#[ignore = "run by a_sigkill_loses_no_acknowledged_store"]
fn kill_child_entry() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let pci = std::env::var("KVTIER_VFIO_PCI").expect("pci");
    let region = region(16);
    let engine = Engine::open(&config(&pci), Arc::clone(&region)).expect("open");
    let ids: Vec<u64> = (1000..1016).collect();
    let r = store_big(&engine, &region, 1, &ids);
    assert!(r.success, "{r:?}");
    println!("acknowledged");
    let others: Vec<u64> = (2000..2016).collect();
    for job in 2.. {
        let _ = store_big(&engine, &region, job, &others);
    }
}

#[test]
#[ignore = "needs an NVMe controller bound to vfio-pci (KVTIER_VFIO_PCI)"]
fn a_sigkill_loses_no_acknowledged_store() {
    let Some(pci) = pci() else { return };
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "kill_child_entry",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env("KVTIER_VFIO_PCI", &pci)
        .stdout(Stdio::piped())
        .spawn()
        .expect("child");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let start = Instant::now();
    loop {
        let line = lines.next().expect("child output").expect("line");
        if line.contains("acknowledged") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_mins(2),
            "child never acknowledged"
        );
    }
    // Mid-store, with commands in flight on the controller.
    std::thread::sleep(Duration::from_millis(300));
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    let region = region(16);
    let engine = Engine::open(&config(&pci), Arc::clone(&region)).expect("reopen after SIGKILL");
    let ids: Vec<u64> = (1000..1016).collect();
    let r = load_big(&engine, &region, 7, &ids);
    assert!(r.success, "acknowledged keys after SIGKILL: {r:?}");
    for (b, &id) in ids.iter().enumerate() {
        assert!(holds_big(&region, b as u32, id), "key {id} after SIGKILL");
    }
    assert!(engine.shutdown().clean());
}
