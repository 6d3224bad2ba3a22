//! Byte-exact round trips: one block, many blocks in one job, many jobs in flight, several
//! workers and devices; on the simulated device and on a real file through io_uring. What would
//! break: routing, slot offsets, chunked stores, registered-buffer offsets, result accounting.

mod common;

use common::*;
use kvtier::sim::SimStorage;
use kvtier::{Job, JobKind, Lookup, Tier};

#[test]
fn one_block_round_trip_on_sim() {
    let seed = kvtier::sim::seed_from_env();
    let sim = SimStorage::new(seed, &[64 << 20]);
    let cfg = sim_config(1, 1);
    let region = region(8);
    let engine = open_sim(&cfg, &region, &sim);
    assert_eq!(engine.lookup(&[key(1)]), vec![Lookup::Miss]);
    let r = store(&engine, &region, 1, &[1]);
    assert!(r.success, "{r:?}");
    assert_eq!(r.kind, JobKind::Store);
    assert_eq!(r.bytes, BLOCK);
    assert_eq!(
        engine.lookup(&[key(1), key(2)]),
        vec![Lookup::Hit(Tier::Nvme), Lookup::Miss]
    );
    let r = load(&engine, &region, 2, &[1]);
    assert!(r.success, "{r:?}");
    assert_eq!(r.bytes, BLOCK);
    assert!(holds(&region, 0, 1), "loaded bytes differ");
    // A second store of the same key is a no-op success that moves nothing.
    let r = store(&engine, &region, 3, &[1]);
    assert!(r.success && r.bytes == 0, "{r:?}");
    assert_eq!(engine.stats().stores_skipped_present, 1);
}

#[test]
fn many_blocks_many_jobs_several_workers_and_devices() {
    let seed = kvtier::sim::seed_from_env();
    let sim = SimStorage::new(seed, &[64 << 20, 48 << 20]);
    let mut cfg = sim_config(2, 4);
    cfg.scheduler.store_chunk_bytes = 16 << 10; // 4 chunks per block
    let region = region(64);
    let engine = open_sim(&cfg, &region, &sim);
    assert_eq!(engine.workers(), 4);
    // 8 jobs of 8 blocks each, all in flight at once.
    for j in 0..8u64 {
        let ids: Vec<u64> = (j * 8..j * 8 + 8).collect();
        let blocks: Vec<u32> = (j as u32 * 8..j as u32 * 8 + 8).collect();
        for (&b, &id) in blocks.iter().zip(&ids) {
            put(&region, b, id);
        }
        engine
            .submit_store(Job::new(j, ids.iter().map(|&i| key(i)).collect(), blocks))
            .expect("submit");
    }
    let results = wait_results(&engine, 8);
    let mut ids: Vec<u64> = results.iter().map(|r| r.id).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        (0..8).collect::<Vec<_>>(),
        "each job reported exactly once"
    );
    assert!(
        results.iter().all(|r| r.success && r.bytes == 8 * BLOCK),
        "{results:?}"
    );
    // Load them back into shuffled blocks.
    region.fill(0, region.len(), 0);
    for j in 0..8u64 {
        let ids: Vec<u64> = (j * 8..j * 8 + 8).rev().collect();
        let blocks: Vec<u32> = (j as u32 * 8..j as u32 * 8 + 8).collect();
        engine
            .submit_load(Job::new(
                100 + j,
                ids.iter().map(|&i| key(i)).collect(),
                blocks,
            ))
            .expect("submit");
    }
    let results = wait_results(&engine, 8);
    assert!(results.iter().all(|r| r.success), "{results:?}");
    for j in 0..8u64 {
        for (n, id) in (j * 8..j * 8 + 8).rev().enumerate() {
            assert!(
                holds(&region, j as u32 * 8 + n as u32, id),
                "block for id {id}"
            );
        }
    }
    let s = engine.stats();
    assert_eq!(s.stores_ok, 64);
    assert_eq!(s.loads_ok, 64);
    assert_eq!(s.bytes_written, 64 * BLOCK);
    assert_eq!(
        s.write_ops, 64,
        "with no load waiting, each block is one write"
    );
    assert!(
        engine.poll_finished(&mut Vec::new()) == 0,
        "no duplicate results"
    );
}

#[test]
fn empty_job_and_malformed_jobs_are_reported() {
    let sim = SimStorage::new(1, &[32 << 20]);
    let cfg = sim_config(1, 1);
    let region = region(4);
    let engine = open_sim(&cfg, &region, &sim);
    engine
        .submit_store(Job::new(1, vec![], vec![]))
        .expect("submit");
    engine
        .submit_load(Job::new(2, vec![key(1)], vec![4]))
        .expect("submit"); // block 4 of 4
    engine
        .submit_store(Job::new(3, vec![key(1), key(2)], vec![0]))
        .expect("submit");
    let mut results = wait_results(&engine, 3);
    results.sort_by_key(|r| r.id);
    assert!(results[0].success && results[0].keys_total == 0);
    assert!(!results[1].success);
    let f = results[1].failure().expect("failure");
    assert_eq!(f.reason, kvtier::KeyFailure::InvalidJob);
    assert!(f.detail.contains("block id 4"), "{}", f.detail);
    assert!(!results[2].success);
    assert!(results[2]
        .failure()
        .expect("failure")
        .detail
        .contains("2 keys but 1 blocks"));
}

#[test]
fn real_file_round_trip_through_io_uring() {
    let dir = scratch_dir();
    let cfg = file_config(&dir.path().join("dev.slab"), 64 << 20, 2);
    let region = region(32);
    let engine = match kvtier::Engine::open(&cfg, std::sync::Arc::clone(&region)) {
        Ok(e) => e,
        Err(kvtier::Error::Ring(msg)) => {
            kvtier_sys::skip!("io_uring unavailable: {msg}");
            return;
        }
        Err(e) => panic!("open: {e}"),
    };
    let info = engine.info();
    assert!(info.devices[0].formatted);
    assert!(
        info.workers[0].backend.starts_with("io_uring"),
        "{:?}",
        info.workers
    );
    let ids: Vec<u64> = (0..32).collect();
    let r = store(&engine, &region, 1, &ids);
    assert!(r.success, "{r:?}");
    let r = load(&engine, &region, 2, &ids);
    assert!(r.success, "{r:?}");
    for (b, &id) in ids.iter().enumerate() {
        assert!(holds(&region, b as u32, id), "block {b}");
    }
}

#[test]
fn a_caller_owned_region_works_like_an_allocated_one() {
    // A GPU runtime or another process may own the region: the engine only needs a page-aligned
    // pointer and a length. Here the "foreign" memory is another Region's mapping, which
    // outlives the engine.
    let owner = region(8);
    // SAFETY: `owner` maps these bytes for the whole test and outlives `foreign` and the engine.
    let foreign = unsafe { kvtier::Region::from_raw_parts(owner.addr() as *mut u8, owner.len()) }
        .expect("page aligned");
    assert_eq!(foreign.backing(), kvtier::Backing::Foreign);
    let foreign = std::sync::Arc::new(foreign);
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[32 << 20]);
    let engine = open_sim(&sim_config(1, 1), &foreign, &sim);
    assert!(store(&engine, &foreign, 1, &[5, 6]).success);
    owner.fill(0, owner.len(), 0);
    assert!(load(&engine, &foreign, 2, &[5, 6]).success);
    assert!(
        holds(&owner, 0, 5) && holds(&owner, 1, 6),
        "bytes landed in the caller's memory"
    );
    drop(engine);
}

#[test]
fn the_engine_reports_how_much_of_the_region_is_in_huge_pages() {
    // `hugepages = "off"` maps 4 KiB pages (advised MADV_NOHUGEPAGE, so even where THP is
    // `always`): the engine reads /proc/self/smaps at open and says none of it is huge, for the
    // region it was given and for the same bytes given as a caller's ("foreign") region.
    let owner = region(8);
    assert_eq!(owner.backing(), kvtier::Backing::Pages4K);
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[32 << 20]);
    let engine = open_sim(&sim_config(1, 1), &owner, &sim);
    assert_eq!(engine.info().region_huge_percent, Some(0.0));
    drop(engine);
    // SAFETY: `owner` maps these bytes for the whole test and outlives `foreign` and the engine.
    let foreign = unsafe { kvtier::Region::from_raw_parts(owner.addr() as *mut u8, owner.len()) }
        .expect("page aligned");
    let foreign = std::sync::Arc::new(foreign);
    let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[32 << 20]);
    let engine = open_sim(&sim_config(1, 1), &foreign, &sim);
    assert_eq!(engine.info().region_huge_percent, Some(0.0));
    drop(engine);
    // hugetlb pages, where some are reserved, are huge whole.
    if let Ok(huge) =
        kvtier::region::allocate_blocks(2 << 20, 2, kvtier::config::HugePages::Required)
    {
        let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20]);
        let mut cfg = sim_config(1, 1);
        cfg.block_size = 2 << 20;
        let engine = open_sim(&cfg, &huge, &sim);
        assert_eq!(engine.info().region_huge_percent, Some(100.0));
    }
}

#[test]
fn hugepages_required_gives_hugetlb_or_says_how_to_reserve() {
    // With reserved hugetlb pages the region is backed by them and the engine round-trips
    // through it; without, the error names the command that reserves them.
    let block = 2u64 << 20;
    match kvtier::region::allocate_blocks(block, 4, kvtier::config::HugePages::Required) {
        Ok(region) => {
            assert_eq!(region.backing(), kvtier::Backing::HugeTlb2M);
            let sim = SimStorage::new(kvtier::sim::seed_from_env(), &[64 << 20]);
            let mut cfg = sim_config(1, 1);
            cfg.block_size = block;
            let engine = open_sim(&cfg, &region, &sim);
            let data: Vec<u8> = (0..block as usize).map(|i| (i % 251) as u8).collect();
            region.write(0, &data);
            engine
                .submit_store(Job::new(1, vec![key(1)], vec![0]))
                .expect("submit");
            assert!(wait_results(&engine, 1)[0].success);
            engine
                .submit_load(Job::new(2, vec![key(1)], vec![3]))
                .expect("submit");
            assert!(wait_results(&engine, 1)[0].success);
            let mut back = vec![0u8; block as usize];
            region.read(3 * block as usize, &mut back);
            assert!(
                back == data,
                "bytes differ after a round trip through hugetlb memory"
            );
        }
        Err(e) => {
            println!("no hugetlb pages reserved here: {e}");
            assert!(e.to_string().contains("/proc/sys/vm/nr_hugepages"), "{e}");
        }
    }
}
