//! The files layout's rules one scenario at a time, on a one-worker simulated node
//! ([`Cluster`]) over a scratch directory: which blocks eviction takes (the least recently
//! used, touches counted), and what a load of a block whose store is still running gets. The
//! seeded campaigns check the same rules over random schedules; these pin each one down.

use std::path::PathBuf;
use std::sync::Arc;

use crate::config::{
    Config, Cores, DeviceConfig, DirectIo, FilesConfig, HugePages, Layout, Namespace,
};
use crate::io::Region;
use crate::job::{Job, JobKind, JobResult, KeyFailure};
use crate::key::Key;
use crate::sim::cluster::Cluster;
use crate::sim::files::SimFiles;
use crate::sim::scenario::{at, content, results, BLOCK};

const REGION_BLOCKS: u64 = 16;

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let path = std::env::temp_dir().join(format!(
            "kvtier-files-scenario-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("scratch directory");
        Scratch(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One worker, one directory holding at most `capacity` blocks.
fn config(dir: &std::path::Path, capacity: u64) -> Config {
    let mut d = DeviceConfig::new(dir);
    d.layout = Layout::Files;
    d.capacity_bytes = Some(capacity * BLOCK);
    Config {
        block_size: BLOCK,
        cores: Cores::List(vec![0]),
        devices: vec![d],
        direct_io: DirectIo::Off,
        files: Some(FilesConfig::new(Namespace::new(
            "sim/model",
            "bfloat16",
            16,
            1,
        ))),
        ..Config::default()
    }
}

/// A one-worker node over a fresh scratch directory of 8 blocks: the directory (removed when
/// dropped), its simulated file system, the region and the node.
fn node(name: &str) -> (Scratch, Arc<SimFiles>, Arc<Region>, Cluster) {
    let scratch = Scratch::new(name);
    let files = SimFiles::new(11);
    let region =
        crate::region::allocate_blocks(BLOCK, REGION_BLOCKS, HugePages::Off).expect("region");
    let cluster =
        Cluster::open_files(&config(&scratch.0, 8), &region, &files, 11, None).expect("opens");
    (scratch, files, region, cluster)
}

/// Submits a store of key 1 (job 1, from block 1) with the file system hung, so that it stays
/// in flight.
fn store_on_a_hung_file_system(cluster: &mut Cluster, region: &Region, files: &SimFiles) {
    region.write(at(1), &content(1));
    files.hang(true);
    cluster
        .submit(JobKind::Store, Job::new(1, vec![key(1)], vec![1]))
        .expect("admitted");
}

fn key(i: u8) -> Key {
    Key::vllm(&[i; 32], 0).expect("a 32-byte hash")
}

/// Stores key `i` from region block `block` as job `i` and waits for its result.
fn store(cluster: &mut Cluster, region: &Region, i: u8, block: u32) -> JobResult {
    region.write(at(block), &content(i));
    cluster
        .submit(
            JobKind::Store,
            Job::new(u64::from(i), vec![key(i)], vec![block]),
        )
        .expect("admitted");
    assert!(cluster.settle(10_000), "the store of key {i} finishes");
    let mut done = results(cluster);
    assert_eq!(done.len(), 1, "{done:?}");
    done.remove(0)
}

/// Loads key `i` into region block `block` (cleared first) as job `id`: its failure, or `None`
/// with the bytes checked.
fn load(cluster: &mut Cluster, region: &Region, id: u64, i: u8, block: u32) -> Option<KeyFailure> {
    region.fill(at(block), BLOCK as usize, 0xEE);
    cluster
        .submit(JobKind::Load, Job::new(id, vec![key(i)], vec![block]))
        .expect("admitted");
    assert!(cluster.settle(10_000), "the load of key {i} finishes");
    let done = results(cluster);
    assert_eq!(done.len(), 1, "{done:?}");
    if let Some(f) = done[0].failures.first() {
        return Some(f.reason);
    }
    region.with_bytes(at(block), BLOCK as usize, |b| {
        assert!(b == content(i).as_slice(), "key {i} loads its own bytes");
    });
    None
}

/// A directory full of blocks makes room for a new store by evicting the least recently used
/// ones (four at a time): a block touched since it was stored, or loaded, is newer than the
/// blocks stored after it and outlives them.
#[test]
fn eviction_takes_the_least_recently_used_touches_and_loads_counted() {
    let (_scratch, _files, region, mut cluster) = node("lru");
    for i in 1..=8 {
        assert!(store(&mut cluster, &region, i, u32::from(i)).success);
    }
    // Key 1 touched, key 2 loaded: now the two most recent uses.
    cluster.touch(&[key(1)]);
    assert!(cluster.settle(10_000));
    assert_eq!(load(&mut cluster, &region, 100, 2, 15), None);
    // The ninth block does not fit: the four oldest uses go (3, 4, 5, 6).
    let r = store(&mut cluster, &region, 9, 9);
    assert!(r.success, "{r:?}");
    for i in [3, 4, 5, 6] {
        assert_eq!(
            load(&mut cluster, &region, 200 + u64::from(i), i, 15),
            Some(KeyFailure::Miss),
            "key {i} was among the oldest uses"
        );
    }
    for i in [1, 2, 7, 8, 9] {
        assert_eq!(
            load(&mut cluster, &region, 300 + u64::from(i), i, 15),
            None,
            "key {i} is kept"
        );
    }
    cluster.check_quiet().expect("nothing left in flight");
}

/// A load of a key whose store has not renamed its file into place fails `NotReady` (never
/// the half-written file, never an old copy), a touch of it changes nothing, and once the store
/// is done the key loads its bytes.
#[test]
fn a_block_being_stored_is_not_ready_until_its_rename() {
    let (_scratch, files, region, mut cluster) = node("writing");
    store_on_a_hung_file_system(&mut cluster, &region, &files);
    assert!(
        !cluster.settle(50),
        "the store waits on the hung file system"
    );
    cluster.touch(&[key(1)]);
    region.fill(at(2), BLOCK as usize, 0xEE);
    cluster
        .submit(JobKind::Load, Job::new(2, vec![key(1)], vec![2]))
        .expect("admitted");
    assert!(!cluster.settle(50));
    let done = results(&cluster);
    assert_eq!(done.len(), 1, "only the load is answered: {done:?}");
    assert_eq!(done[0].id, 2);
    assert_eq!(done[0].failures[0].reason, KeyFailure::NotReady);
    region.with_bytes(at(2), BLOCK as usize, |b| {
        assert!(
            b.iter().all(|&x| x == 0xEE),
            "nothing was written into the block"
        );
    });
    files.hang(false);
    assert!(cluster.settle(10_000));
    let done = results(&cluster);
    assert!(
        done.len() == 1 && done[0].id == 1 && done[0].success,
        "{done:?}"
    );
    assert_eq!(load(&mut cluster, &region, 3, 1, 3), None);
    cluster
        .check_quiet()
        .expect("the index is consistent, nothing in flight");
}

/// A key touched while its store runs, whose store then fails (the file system full and
/// nothing to evict), leaves nothing behind in the index: no LRU place, no entry, and the key
/// can be stored again.
#[test]
fn a_store_touched_and_then_failed_leaves_nothing_behind() {
    let (_scratch, files, region, mut cluster) = node("failed");
    store_on_a_hung_file_system(&mut cluster, &region, &files);
    assert!(!cluster.settle(50));
    cluster.touch(&[key(1)]);
    assert!(!cluster.settle(50));
    // Every creating open now fails with ENOSPC: the temp file cannot be made.
    files.set_faults(crate::sim::Faults {
        enospc_ppm: 1_000_000,
        ..crate::sim::Faults::default()
    });
    files.hang(false);
    assert!(cluster.settle(10_000));
    let done = results(&cluster);
    assert_eq!(done.len(), 1, "{done:?}");
    assert!(!done[0].success, "the store failed: {done:?}");
    cluster
        .check_quiet()
        .expect("no LRU place or entry left by the failed store");
    files.set_faults(crate::sim::Faults::default());
    assert!(store(&mut cluster, &region, 1, 1).success);
    assert_eq!(load(&mut cluster, &region, 5, 1, 2), None);
    cluster.check_quiet().expect("consistent");
}
