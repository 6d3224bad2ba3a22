//! The slab's store path as a state machine, one scenario at a time, on a one-worker simulated
//! node ([`Cluster`]): when a store is acknowledged, and how entries share table-page writes.
//! The seeded campaigns check the same rules over random schedules; these pin each rule down
//! with the device's requests counted.

use std::sync::Arc;

use crate::config::{Config, Cores, DeviceConfig, HugePages};
use crate::io::{IoClass, IoKind, Region};
use crate::job::{Job, JobKind, KeyFailure};
use crate::key::Key;
use crate::sim::cluster::Cluster;
use crate::sim::scenario::{at, content, results, BLOCK};
use crate::sim::{LogEntry, SimStorage};

const REGION_BLOCKS: u64 = 8;

fn config() -> Config {
    Config {
        block_size: BLOCK,
        cores: Cores::List(vec![0]),
        devices: vec![DeviceConfig::new("sim0".to_string())],
        ..Config::default()
    }
}

fn open(storage: &Arc<SimStorage>, region: &Arc<Region>) -> Cluster {
    Cluster::open(&config(), region, storage, 7).expect("opens")
}

fn key(i: u8) -> Key {
    Key::new(&[b'k', i]).expect("a key")
}

/// Writes of `class` in `log`.
fn writes(log: &[LogEntry], class: IoClass) -> usize {
    log.iter()
        .filter(|e| e.kind == IoKind::Write && e.class == class)
        .count()
}

/// A store's data on the device is not enough: it is acknowledged only once the table page
/// holding its entry is written too, and then a reopened store (recovery from the table)
/// serves its bytes.
#[test]
fn a_store_is_acknowledged_only_once_its_entry_is_on_the_device() {
    let storage = SimStorage::new(7, &[(1 << 20) + 32 * BLOCK]);
    let region =
        crate::region::allocate_blocks(BLOCK, REGION_BLOCKS, HugePages::Off).expect("region");
    let mut cluster = open(&storage, &region);
    region.write(at(0), &content(1));
    storage.refuse_table_writes(true);
    storage.record(true);
    cluster
        .submit(JobKind::Store, Job::new(1, vec![key(1)], vec![0]))
        .expect("admitted");
    assert!(
        !cluster.settle(500),
        "the store cannot finish while its table page cannot be written"
    );
    assert!(results(&cluster).is_empty(), "no acknowledgement yet");
    let log = storage.take_log();
    assert_eq!(
        writes(&log, IoClass::Store),
        1,
        "the data write went out: {log:?}"
    );
    assert_eq!(writes(&log, IoClass::Meta), 0, "{log:?}");

    // The queue takes table writes again. (A real ring refuses a push only while its
    // submission queue is full, which the worker's next submit empties; here nothing is in
    // flight to wake the worker, so a second store does.)
    storage.refuse_table_writes(false);
    region.write(at(1), &content(2));
    cluster
        .submit(JobKind::Store, Job::new(2, vec![key(2)], vec![1]))
        .expect("admitted");
    assert!(cluster.settle(10_000));
    let done = results(&cluster);
    assert_eq!(done.len(), 2);
    assert!(done.iter().all(|r| r.success), "{done:?}");
    let log = storage.take_log();
    assert_eq!(writes(&log, IoClass::Store), 1, "{log:?}");
    assert_eq!(
        writes(&log, IoClass::Meta),
        2,
        "the stalled page goes out first; the second entry lands while it is in flight and \
         goes in the next write: {log:?}"
    );
    cluster.check_quiet().expect("nothing left in flight");
    cluster.crash();

    let mut cluster = open(&storage, &region);
    region.fill(at(3), BLOCK as usize, 0xEE);
    cluster
        .submit(JobKind::Load, Job::new(3, vec![key(1)], vec![3]))
        .expect("admitted");
    assert!(cluster.settle(10_000));
    let done = results(&cluster);
    assert!(
        done[0].success,
        "the reopened store serves the key: {done:?}"
    );
    region.with_bytes(at(3), BLOCK as usize, |b| {
        assert!(b == content(1).as_slice(), "the bytes stored");
    });
}

/// Group commit: a store's table page is written beside its data; entries that land in that
/// page while its write is in flight wait for it and share the next write of the page, and
/// none of those stores is acknowledged before that write completes.
#[test]
fn entries_changed_while_their_page_is_in_flight_share_its_next_write() {
    let storage = SimStorage::new(7, &[(1 << 20) + 32 * BLOCK]);
    let region =
        crate::region::allocate_blocks(BLOCK, REGION_BLOCKS, HugePages::Off).expect("region");
    let mut cluster = open(&storage, &region);
    let store = |cluster: &mut Cluster, i: u8| {
        region.write(at(u32::from(i)), &content(i));
        cluster
            .submit(
                JobKind::Store,
                Job::new(u64::from(i), vec![key(i)], vec![u32::from(i)]),
            )
            .expect("admitted");
        for _ in 0..50 {
            cluster.step();
        }
    };
    storage.pause(true);
    storage.record(true);
    store(&mut cluster, 0);
    let log = storage.take_log();
    assert_eq!(writes(&log, IoClass::Store), 1, "{log:?}");
    assert_eq!(
        writes(&log, IoClass::Meta),
        1,
        "the page beside the data: {log:?}"
    );
    store(&mut cluster, 1);
    store(&mut cluster, 2);
    let log = storage.take_log();
    assert_eq!(writes(&log, IoClass::Store), 2, "{log:?}");
    assert_eq!(
        writes(&log, IoClass::Meta),
        0,
        "the slots are neighbours: their page is in flight, so their entries wait: {log:?}"
    );
    assert!(
        results(&cluster).is_empty(),
        "nothing completes while paused"
    );

    storage.pause(false);
    assert!(cluster.settle(10_000));
    let done = results(&cluster);
    assert_eq!(done.len(), 3);
    assert!(done.iter().all(|r| r.success), "{done:?}");
    assert_eq!(
        writes(&storage.take_log(), IoClass::Meta),
        1,
        "the two entries that waited went out in one write"
    );
    cluster.check_quiet().expect("nothing left in flight");
}

/// Two entries for one key after a device failure: the key's home device (1) kept timing out,
/// was marked failed, and the key was stored again on device 0 with other bytes. Both entries
/// are on the devices when the store is reopened (a failed device's entries are not cleared:
/// it cannot be written). Recovery must keep the newer entry (the larger sequence number),
/// whichever device it reads first, and free the older one's slot properly.
#[test]
fn recovery_keeps_the_newer_of_two_entries_on_different_devices() {
    let size = (1 << 20) + 32 * BLOCK;
    let storage = SimStorage::new(7, &[size, size]);
    let region =
        crate::region::allocate_blocks(BLOCK, REGION_BLOCKS, HugePages::Off).expect("region");
    let mut config = config();
    config.devices = vec![
        DeviceConfig::new("sim0".to_string()),
        DeviceConfig::new("sim1".to_string()),
    ];
    config.io_timeout_ms = 200;
    let on_dev1: Vec<u8> = (0..=255u8)
        .filter(|&i| key(i).device(2) == 1)
        .take(3)
        .collect();
    assert_eq!(on_dev1.len(), 3);
    // The key is stored last of the three, so its first entry's sequence number is not 0.
    let k = on_dev1[2];
    let settle = |cluster: &mut Cluster| assert!(cluster.settle(100_000), "settles");
    let mut cluster = Cluster::open(&config, &region, &storage, 7).expect("opens");
    for (b, &i) in on_dev1.iter().enumerate() {
        region.write(at(b as u32), &content(i));
    }
    cluster
        .submit(
            JobKind::Store,
            Job::new(1, on_dev1.iter().map(|&i| key(i)).collect(), vec![0, 1, 2]),
        )
        .expect("admitted");
    settle(&mut cluster);
    assert!(results(&cluster)[0].success);

    // Device 1 stops answering: three loads time out, which marks it failed.
    storage.hang_device(1, true);
    cluster
        .submit(
            JobKind::Load,
            Job::new(2, on_dev1.iter().map(|&i| key(i)).collect(), vec![3, 4, 5]),
        )
        .expect("admitted");
    let mut done = Vec::new();
    for _ in 0..100_000 {
        cluster.step();
        done.extend(results(&cluster));
        if !done.is_empty() {
            break;
        }
    }
    assert!(
        done[0].failures.len() == 3
            && done[0]
                .failures
                .iter()
                .all(|f| f.reason == KeyFailure::Timeout),
        "{done:?}"
    );
    // The key again, with other bytes: it goes to device 0 now.
    let newer: Vec<u8> = content(k).iter().map(|b| !b).collect();
    region.write(at(6), &newer);
    cluster
        .submit(JobKind::Store, Job::new(3, vec![key(k)], vec![6]))
        .expect("admitted");
    storage.hang_device(1, false);
    settle(&mut cluster);
    let done = results(&cluster);
    assert!(done.iter().any(|r| r.id == 3 && r.success), "{done:?}");
    cluster.crash();

    let mut cluster = Cluster::open(&config, &region, &storage, 7).expect("reopens");
    region.fill(at(7), BLOCK as usize, 0xEE);
    cluster
        .submit(JobKind::Load, Job::new(4, vec![key(k)], vec![7]))
        .expect("admitted");
    settle(&mut cluster);
    let done = results(&cluster);
    assert!(done[0].success, "{done:?}");
    region.with_bytes(at(7), BLOCK as usize, |b| {
        assert!(
            b == newer.as_slice(),
            "the newer copy is served, not the older"
        );
    });
    cluster
        .check_quiet()
        .expect("the older entry's slot is free and on the free list");
}
