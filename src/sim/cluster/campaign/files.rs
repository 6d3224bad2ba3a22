//! The seeded campaign on the files layout: the same random jobs, lookups, faults, schedules
//! and checks as the slab's [`run`](super::run), on workers whose file operations run on a
//! scratch directory through [`SimFiles`], with an object store in half the runs. A power loss
//! undoes renames and keeps, truncates, zeroes or removes files not synced ([`SimFiles`]);
//! the directory is then scanned again by a new cluster, and every key ever stored is loaded
//! once: served exactly, or failed, never wrong.
//!
//! Half the runs share the directory with a [`Neighbour`] process (vLLM's tier) that publishes
//! and removes block files, and a third hang the directory's file system now and then (keys
//! fail by their deadline, their blocks stay leased until the late completions).
//!
//! Runs draw `sync = "none"` (vLLM's: nothing flushed) or `"data"`; without a sync nothing
//! but the crc32c kept in each file's xattr can tell a zeroed sector, so runs that lose power
//! with `sync = "none"` keep `checksums = true`.

use std::path::PathBuf;

use crate::config::{Config, DeviceConfig, DirectIo, FilesConfig, Layout, Namespace, SyncMode};
use crate::sim::files::SimFiles;
use crate::sim::object_store::{ObjectFaults, SimObjectStore};
use crate::sim::{Faults, Rng};

use super::REGION_BLOCKS;
use super::{
    config, faults, no_strays, object_faults, object_settings, Cluster, Report, Run, BLOCK,
};

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(seed: u64) -> Result<Scratch, String> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "kvtier-sim-files-{}-{seed}-{n}",
            std::process::id()
        ));
        std::fs::create_dir_all(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Scratch(path))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn files_config(rng: &mut Rng, dir: &std::path::Path, workers: usize, loses_power: bool) -> Config {
    let mut c = config(rng, workers, 1);
    c.direct_io = DirectIo::Off;
    let mut d = DeviceConfig::new(dir);
    d.layout = Layout::Files;
    // 16..64 blocks: eviction is frequent.
    d.capacity_bytes = Some((16 + rng.below(48)) * BLOCK);
    c.devices = vec![d];
    let mut files = FilesConfig::new(Namespace::new("sim/model", "bfloat16", 16, 1));
    files.sync = [SyncMode::None, SyncMode::Data][rng.below(2) as usize];
    files.checksums = rng.below(4) > 0 || (loses_power && files.sync == SyncMode::None);
    c.files = Some(files);
    c
}

/// One seeded run on the files layout; see the module docs.
pub fn files_run(seed: u64, steps: u64) -> Result<Report, String> {
    files_run_with(seed, steps, false)
}

/// [`files_run`] with removals among the actions (`Engine::remove`: files unlinked at once).
#[cfg(test)]
pub fn files_run_removing(seed: u64, steps: u64) -> Result<Report, String> {
    files_run_with(seed, steps, true)
}

fn files_run_with(seed: u64, steps: u64, removals: bool) -> Result<Report, String> {
    // The trace starts here: every step, request, completion and result of this run.
    let _ = crate::sim::take_trace();
    let mut rng = Rng::new(seed ^ 0xF1_1E5);
    let workers = 1 + rng.below(3) as usize;
    let loss_at = (rng.below(2) == 1).then(|| rng.below(steps));
    let scratch = Scratch::new(seed)?;
    let mut config = files_config(&mut rng, &scratch.0, workers, loss_at.is_some());
    let checksums = config.files.as_ref().is_some_and(|f| f.checksums);
    let files = SimFiles::new(seed);
    let mut neighbour = Neighbour::draw(seed, &scratch.0, &mut config);
    // A third of the runs hang the directory's file system now and then, as the slab runs
    // hang a device.
    let mut hangs = super::Hangs::draw(seed ^ 0xF1_1E5, &mut config);
    // Flipped reads only where a checksum can catch them: not in runs with a neighbour, whose
    // files (vLLM's) carry none, so kvtier serves them unverified, as vLLM does.
    let read_flip_ppm = if checksums && !neighbour.active() {
        [0, 0, 1 + rng.below(20_000) as u32][rng.below(3) as usize]
    } else {
        0
    };
    let region = crate::region::allocate_blocks(
        BLOCK,
        u64::from(REGION_BLOCKS),
        crate::config::HugePages::Off,
    )
    .map_err(|e| e.to_string())?;
    let cold = (rng.below(2) == 1)
        .then(|| SimObjectStore::new(seed, object_settings(&mut rng), BLOCK as usize));
    if let Some(c) = &cold {
        c.set_faults(object_faults(&mut rng));
    }
    let mut run = Run::new(seed, &region, cold.clone());
    run.removals = removals;
    let mut cluster = Cluster::open_files(&config, &region, &files, seed, cold.clone())
        .map_err(|e| e.to_string())?;
    files.set_faults(faults(&mut rng, read_flip_ppm));
    files.track_durability(true);
    for step in 0..steps {
        run.act(&mut cluster)?;
        no_strays(files.take_strays())?;
        neighbour.step(&files, &mut run);
        hangs.step(|_, on| files.hang(on), 1, &mut run.report);
        if loss_at == Some(step) {
            hangs.end(|_, on| files.hang(on));
            cluster.crash();
            let _ = files.power_loss(seed ^ step);
            run.forget_pending()?;
            cluster = Cluster::open_files(&config, &region, &files, seed ^ 0xAF7E, cold.clone())
                .map_err(|e| format!("reopening after the power loss: {e}"))?;
            run.report.after_loss_served += run.load_every_stored(&mut cluster)?;
            files.set_faults(faults(&mut rng, read_flip_ppm));
            files.track_durability(true);
        }
    }
    let ends_in_stop = super::ends_in_stop(seed);
    if ends_in_stop {
        run.stop(
            &mut cluster,
            &mut hangs,
            1,
            &|_, on| files.hang(on),
            &|| files.take_strays(),
        )?;
    }
    files.set_faults(Faults::default());
    hangs.end(|_, on| files.hang(on));
    if let Some(c) = &cold {
        c.set_faults(ObjectFaults::default());
    }
    run.settle(&mut cluster).map_err(|e| {
        let when = if ends_in_stop { " after the stop" } else { "" };
        format!("settling{when}: {e}")
    })?;
    no_strays(files.take_strays())?;
    if ends_in_stop {
        drop(cluster);
        cluster = Cluster::open_files(&config, &region, &files, seed ^ 0x5709, cold.clone())
            .map_err(|e| format!("reopening after the stop: {e}"))?;
        run.load_after_stop(&mut cluster, &|| files.take_strays())?;
    }
    run.report.read_flips = files.read_flips();
    if let Some(c) = &cold {
        run.report.cold_runs = 1;
        run.report.cold = c.counts();
    }
    drop(cluster);
    run.report.trace = crate::sim::take_trace();
    Ok(run.report)
}

/// Another process sharing the directory, as vLLM instances share it with kvtier (drawn from
/// its own stream, so a seed's other draws stay as they were; half the runs have one). Now and
/// then it publishes a key's block (exactly that key's bytes: keys name content), or removes
/// one; its runs also age the layout's answers about keys it has not indexed within a run
/// (`lookup_ttl_ms` of 1–20 ms), so a key the neighbour publishes turns from a miss into a hit.
/// The checks stay the campaign's: a hit only for a key stored or published, a load served
/// with exactly its key's bytes or failed.
struct Neighbour {
    rng: Rng,
    /// One chance in this many per step that it acts (0: no neighbour).
    every: u64,
    mapper: crate::files::mapper::FileMapper,
}

impl Neighbour {
    fn draw(seed: u64, dir: &std::path::Path, config: &mut Config) -> Neighbour {
        let mut rng = Rng::new(seed ^ 0x4E16_4B0E);
        let every = if rng.below(2) == 0 {
            10 + rng.below(60)
        } else {
            0
        };
        let files = config.files.as_mut().expect("a files run");
        if every > 0 {
            files.lookup_ttl_ms = [1, 5, 20][rng.below(3) as usize];
        }
        Neighbour {
            rng,
            every,
            mapper: crate::files::mapper::FileMapper::new(dir, &files.namespace),
        }
    }

    fn active(&self) -> bool {
        self.every > 0
    }

    fn step(&mut self, files: &SimFiles, run: &mut Run) {
        if self.every == 0 || self.rng.below(self.every) != 0 {
            return;
        }
        let k = self.rng.below(super::KEYS);
        let path = self
            .mapper
            .key_path(super::key(k).as_bytes())
            .expect("a key with a hash");
        if self.rng.below(4) == 0 {
            if files.remove_external(&path) {
                run.report.neighbour_removed += 1;
            }
        } else if files.publish_external(&path, &super::content(k)) {
            if run.named.insert(k) {
                run.external.insert(k);
            }
            run.report.neighbour_published += 1;
        }
    }
}

/// Runs `count` files-layout seeds from `first`; the first failure names its seed and how to
/// replay it.
pub fn files_seeds(first: u64, count: u64, steps: u64) -> Result<Report, String> {
    super::over_seeds(
        first,
        count,
        steps,
        files_run,
        "campaign::files::tests::replays_one_seed",
    )
}

#[cfg(test)]
mod tests {
    use super::super::env;
    use super::*;

    /// The files campaign with removals among its actions (`KVTIER_SIM_REMOVAL_SEEDS`,
    /// default 100).
    #[test]
    fn files_removal_campaign_finds_no_violation() {
        let first = env("KVTIER_SIM_FIRST", 1);
        let count = env("KVTIER_SIM_REMOVAL_SEEDS", 100);
        let steps = env("KVTIER_SIM_STEPS", 1500);
        let r = super::super::over_seeds(
            first,
            count,
            steps,
            files_run_removing,
            "campaign::files::tests::replays_one_removal_seed",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        eprintln!("files removal campaign: {count} seeds from {first}: {r:?}");
        assert!(
            r.keys_removed > 0 && r.keys_loaded > 0 && r.power_losses > 0,
            "{r:?}"
        );
    }

    /// `.bin` files under `dir`, at any depth.
    fn block_files(dir: &std::path::Path) -> usize {
        std::fs::read_dir(dir).map_or(0, |entries| {
            entries
                .flatten()
                .map(|e| {
                    let p = e.path();
                    if p.is_dir() {
                        block_files(&p)
                    } else {
                        usize::from(p.extension().is_some_and(|x| x == "bin"))
                    }
                })
                .sum()
        })
    }

    /// The files layout over two regions (a daemon's second process in its own memory): a
    /// client of region 1 stores block files from its blocks, the client of region 0 loads
    /// them byte-exact, and the other way round; a block id past region 1's size is refused
    /// naming it. The simulated files check every transfer against the leases of the region
    /// it lands in.
    #[test]
    fn files_clients_in_two_regions_share_one_node() {
        use std::sync::Arc;
        let mut rng = Rng::new(19);
        let scratch = Scratch::new(19).expect("a scratch directory");
        let mut config = files_config(&mut rng, &scratch.0, 1, false);
        config.devices[0].capacity_bytes = Some(64 * BLOCK);
        let region = |blocks: u64| {
            crate::region::allocate_blocks(BLOCK, blocks, crate::config::HugePages::Off)
                .expect("region")
        };
        let (r0, r1) = (region(u64::from(REGION_BLOCKS)), region(4));
        let files = SimFiles::new(19);
        let mut cluster =
            Cluster::open_files_regions(&config, &[Arc::clone(&r0), Arc::clone(&r1)], &files, 19)
                .expect("opens");
        super::super::exchange_between_regions(&mut cluster, &r0, &r1, 21, 50_000);
        assert_eq!(
            block_files(&scratch.0),
            4,
            "one block file per key, whichever region it came from"
        );
        assert_eq!(
            files.take_strays(),
            Vec::<String>::new(),
            "transfers outside the leases"
        );
    }

    /// Seeds beyond the default 300 that found bugs: 378 (the simulator's stop did not fail
    /// work that reached a stopped worker, as `Engine::shutdown` does) and 2447 (a store that
    /// failed with ENOSPC during a stop queued a retry that waited forever on a hung file
    /// system's unlinks: its job was never reported).
    #[test]
    fn files_seeds_that_found_bugs_pass() {
        for seed in [378, 2447] {
            let r = files_run(seed, 1500).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            assert!(r.stops == 1, "seed {seed}: {r:?}");
        }
    }

    /// Replays one seed of the files removal campaign (`KVTIER_SIM_SEED`).
    #[test]
    fn replays_one_removal_seed() {
        let seed = env("KVTIER_SIM_SEED", 7);
        let steps = env("KVTIER_SIM_STEPS", 1500);
        super::super::check_replay(seed, steps, files_run_removing);
    }

    /// `KVTIER_SIM_SEEDS=100000 cargo test --release -p kvtier --lib --features sim
    /// sim::cluster::campaign::files -- --nocapture` runs a hundred thousand.
    #[test]
    fn seeded_files_campaign_finds_no_violation() {
        let first = env("KVTIER_SIM_FIRST", 1);
        let count = env("KVTIER_SIM_SEEDS", 300);
        let steps = env("KVTIER_SIM_STEPS", 1500);
        let t = std::time::Instant::now();
        let r = files_seeds(first, count, steps).unwrap_or_else(|e| panic!("{e}"));
        eprintln!(
            "sim files campaign: {count} seeds from {first}, {steps} steps each, {:.1} s: {r:?}",
            t.elapsed().as_secs_f64()
        );
        assert!(
            r.stops > 0 && r.stops_gave_up > 0 && r.after_stop_served > 0,
            "runs stopped, some with the file system hung past the deadline, and reopened \
             directories served their keys: {r:?}"
        );
        assert!(
            r.keys_loaded > 0 && r.keys_stored > 0 && r.after_loss_served > 0,
            "the campaign moved data, also after power losses: {r:?}"
        );
        assert!(r.power_losses > 0, "some runs lost power: {r:?}");
        assert!(
            r.read_flips > 0 && r.checksum_failures > 0,
            "reads flipped bits and loads caught them: {r:?}"
        );
        assert!(
            r.cold_runs > 0 && r.cold.gets_served > 0 && r.cold.demotions > 0,
            "runs with an object store loaded from it and demoted to it: {r:?}"
        );
        assert!(
            r.hangs > 0 && r.timeouts > 0 && r.held_past_result > 0,
            "the directory hung, keys failed by their deadline, and their blocks stayed leased \
             past the result: {r:?}"
        );
        assert!(
            r.neighbour_published > 0 && r.neighbour_removed > 0 && r.neighbour_served > 0,
            "another process published and removed blocks, and loads served what it \
             published: {r:?}"
        );
        assert!(
            r.neighbour_looked_up > 0,
            "lookups found what another process published (the workers' statx probes): {r:?}"
        );
    }

    /// 23, found once the directory hung: a store that hit a full file system handed its key
    /// to a retry and cleaned up its temp file; that cleanup outlived its deadline, and the
    /// deadline failed the key the retry was still storing. The job reported, its blocks went
    /// back, and the retry's write then read a block no job held. A store or load op that
    /// reported its key (or handed it on) no longer answers for it at its deadline.
    ///
    /// 1510: a store's write completed after its deadline had failed the key, with ENOSPC,
    /// and the key was queued for a retry: the retry computed its checksum through a lease
    /// the job had released (a panic in the lease's check). A key with its outcome out is
    /// not retried.
    #[test]
    fn seeds_that_found_bugs_pass() {
        for seed in [23, 1510] {
            let r = files_run(seed, 1500).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            assert!(r.hangs > 0 && r.timeouts > 0, "seed {seed}: {r:?}");
        }
    }

    /// `KVTIER_SIM_SEED=<seed> cargo test -p kvtier --lib --features sim
    /// sim::cluster::campaign::files::tests::replays_one_seed -- --nocapture` replays one.
    #[test]
    fn replays_one_seed() {
        let seed = env("KVTIER_SIM_SEED", 7);
        let steps = env("KVTIER_SIM_STEPS", 1500);
        super::super::check_replay(seed, steps, files_run);
    }
}
