//! Failure isolation across devices, with the log it leaves: two simulated devices, two workers;
//! one device answers every request with EIO for a while. Its keys fail with `Io(EIO)` and a
//! detail naming the device and the operation, the other device's keys load and store
//! byte-exact throughout, the errors are counted on the failing device only, and the log holds
//! one line for the whole episode (not one per request or per worker) and one when the device
//! works again, which says how many errors the episode had. Its own test binary: it captures
//! every log line of the process.

mod common;

use common::logs::Captured;
use common::{holds, key, load, open_sim, region, sim_config, store};
use kvtier::sim::SimStorage;
use kvtier::{Errno, KeyFailure};

#[test]
fn a_failing_device_leaves_the_other_working_and_logs_one_line_per_episode() {
    let logs = Captured::install();
    let sim = SimStorage::new(11, &[64 << 20, 64 << 20]);
    let cfg = sim_config(2, 2);
    let region = region(64);
    let engine = open_sim(&cfg, &region, &sim);
    let ids: Vec<u64> = (0..32).collect();
    assert!(store(&engine, &region, 1, &ids).success);
    let dev0: Vec<u64> = ids
        .iter()
        .copied()
        .filter(|&i| key(i).device(2) == 0)
        .collect();
    assert!(!dev0.is_empty() && dev0.len() < ids.len());

    sim.fail_device(0, true);
    let mut job = 10;
    let mut fresh = 1000u64;
    for _ in 0..20 {
        job += 1;
        let r = load(&engine, &region, job, &ids);
        let failed: Vec<u64> = r.failures.iter().map(|f| ids[f.key_index]).collect();
        assert_eq!(failed, dev0, "exactly device 0's keys fail");
        for f in &r.failures {
            assert_eq!(f.reason, KeyFailure::Io(Errno::EIO), "{f:?}");
            assert!(
                f.detail.contains("sim0") && f.detail.contains("read of slot"),
                "the detail names the device and the operation: {}",
                f.detail
            );
        }
        for (b, &id) in ids.iter().enumerate() {
            if key(id).device(2) == 1 {
                assert!(holds(&region, b as u32, id), "device 1 key {id}");
            }
        }
        // Stores: device 1's land and load back; device 0's fail.
        let batch: Vec<u64> = (fresh..fresh + 8).collect();
        fresh += 8;
        job += 1;
        let r = store(&engine, &region, job, &batch);
        for f in &r.failures {
            assert_eq!(key(batch[f.key_index]).device(2), 0, "{f:?}");
            assert_eq!(f.reason, KeyFailure::Io(Errno::EIO), "{f:?}");
        }
        let on1: Vec<u64> = batch
            .iter()
            .copied()
            .filter(|&i| key(i).device(2) == 1)
            .collect();
        job += 1;
        assert!(load(&engine, &region, job, &on1).success);
        for (b, &id) in on1.iter().enumerate() {
            assert!(holds(&region, b as u32, id));
        }
    }
    let s = engine.stats();
    let errors = s.devices[0].io_errors();
    assert!(errors >= 20 * dev0.len() as u64, "{:?}", s.devices[0]);
    assert_eq!(s.devices[1].io_errors(), 0);
    let episode = logs.lines_with("Further I/O errors on this device");
    assert_eq!(episode.len(), 1, "one line for the episode: {episode:#?}");
    assert!(episode[0].contains("sim0"), "{}", episode[0]);
    let about_sim1: Vec<String> = logs
        .lines_with("sim1")
        .into_iter()
        .filter(|l| l.contains(" ERROR ") || l.contains(" WARN "))
        .collect();
    assert!(about_sim1.is_empty(), "{about_sim1:#?}");

    sim.fail_device(0, false);
    job += 1;
    assert!(
        store(&engine, &region, job, &dev0).success,
        "device 0 works again"
    );
    job += 1;
    assert!(load(&engine, &region, job, &dev0).success);
    for (b, &id) in dev0.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }
    let back = logs.lines_with("I/O succeeds again");
    assert_eq!(back.len(), 1, "{back:#?}");
    assert!(
        back[0].contains("sim0") && back[0].contains(&format!("after {errors} errors")),
        "the recovery line counts the episode's {errors} errors: {}",
        back[0]
    );
    assert_eq!(
        logs.lines_with("Further I/O errors on this device").len(),
        1,
        "no new episode"
    );
    engine.shutdown();
}
