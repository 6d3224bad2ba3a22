//! SIGKILL campaign on the real binary and the real kernel: a child process (this test binary,
//! re-entered through `kill_child_entry`) stores and loads blocks on a real device, and is
//! killed with SIGKILL at a random moment — while opening, recovering, storing or loading. After
//! each kill the device is reopened here and every key ever submitted for a store is loaded: it
//! must come back byte-exact or be absent, never wrong. On the files layout a key whose store
//! was acknowledged must come back (a SIGKILL is not a power loss: what reached the kernel
//! survives); on a slab the most recent acknowledged stores of a table page may be forgotten
//! (their entries are written in batches) and are counted as lost. The files layout must also
//! leave no temp file and no drift in the shared usage counter after the next open.
//!
//! Targets: a slab file, a raw loop device (root only; skipped with a message otherwise), a
//! files directory, and one files directory shared by two processes killed independently.
//! Children store fresh keys all the time (so a kill often lands with writes in flight) and
//! load the ones acknowledged so far; the device is reset (recreated, or zeroed) whenever the
//! keys since the last reset reach [`RESET_AFTER`], so it never fills and nothing is evicted:
//! an acknowledged key that is absent is lost, not evicted. `KVTIER_KILLS` sets the kills per
//! target (default 50, what CI runs); `KVTIER_KILL_SEED` the seed. Each target prints one line:
//! kills, kills before the first acknowledged store, keys checked, lost, wrong, damage detected.
#![allow(clippy::field_reassign_with_default)]

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kvtier::config::{Cores, DeviceConfig, FilesConfig, Layout};
use kvtier::files::mapper::{FileMapper, KvCacheGroup, Namespace};
use kvtier::sim::Rng;
use kvtier::{Config, Engine, KeyFailure};

/// The device's capacity, in blocks: 64 MiB.
const CAPACITY_BLOCKS: u64 = 1024;
/// Keys submitted since the last reset after which the device is reset: with what one round
/// can add (at most about 400 ms / PAUSE x BATCH), well below the capacity of either worker's
/// share of the slab.
const RESET_AFTER: usize = 300;
const BATCH: usize = 4;
/// A child's pause between batches, so a round stays small and kills land at any moment.
const PAUSE: Duration = Duration::from_millis(3);
const REGION_BLOCKS: u64 = 16;
const CHILD_ENV: &str = "KVTIER_KILL_CHILD";
/// A child that outlives this long, or its parent, exits by itself.
const CHILD_LIFETIME: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Slab,
    Files,
}

fn namespace() -> Namespace {
    let mut ns = Namespace::new("kill/campaign", "float16", 16, 1);
    ns.kv_cache_groups = vec![KvCacheGroup {
        tokens_per_block: 16,
        layer_names: vec!["layer.0".into()],
    }];
    ns
}

fn config(kind: Kind, path: &Path) -> Config {
    let mut c = Config::default();
    c.block_size = BLOCK;
    c.cores = Cores::List(vec![0, 1]);
    let mut d = DeviceConfig::new(path);
    match kind {
        Kind::Slab => {
            // A loop device has its size; a slab file is created with it.
            let is_file = !path.starts_with("/dev");
            d.capacity_bytes = is_file.then_some(CAPACITY_BLOCKS * BLOCK);
        }
        Kind::Files => {
            d.layout = Layout::Files;
            d.capacity_bytes = Some(CAPACITY_BLOCKS * BLOCK);
            let mut files = FilesConfig::new(namespace());
            // The reopening process is alone: every temp file is a killed writer's.
            files.temp_grace_secs = 0;
            c.files = Some(files);
        }
    }
    c.devices = vec![d];
    c
}

fn log_path(logs: &Path, what: &str, who: u32) -> PathBuf {
    logs.join(format!("{what}-{who}"))
}

fn read_ids(path: &Path) -> Vec<u64> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        // A line cut by the kill has no newline and may be partial: only whole lines count.
        .filter_map(|l| l.parse().ok())
        .collect()
}

/// Reads ids from every `what-*` log in `logs`.
fn all_ids(logs: &Path, what: &str) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    for e in std::fs::read_dir(logs).expect("logs").flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&format!("{what}-")) {
            out.extend(read_ids(&e.path()));
        }
    }
    out
}

fn append(file: &mut std::fs::File, ids: &[u64]) {
    let mut text = String::new();
    for id in ids {
        text.push_str(&id.to_string());
        text.push('\n');
    }
    file.write_all(text.as_bytes()).expect("log");
}

/// The child: stores and loads until killed (or orphaned, or past its lifetime).
#[test]
fn kill_child_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.splitn(5, ':');
    let kind = match parts.next() {
        Some("files") => Kind::Files,
        _ => Kind::Slab,
    };
    let who: u32 = parts.next().and_then(|s| s.parse().ok()).expect("who");
    let round: u64 = parts.next().and_then(|s| s.parse().ok()).expect("round");
    let logs = PathBuf::from(parts.next().expect("logs"));
    let path = PathBuf::from(parts.next().expect("device path"));
    let parent = nix::unistd::getppid();
    let born = Instant::now();
    let cfg = config(kind, &path);
    let region = region(REGION_BLOCKS);
    let engine = Engine::open(&cfg, region.clone()).expect("child open");
    let opts = || {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .clone()
    };
    let mut attempted = opts()
        .open(log_path(&logs, "attempted", who))
        .expect("attempted log");
    let mut acked = opts()
        .open(log_path(&logs, "acked", who))
        .expect("acked log");
    let mut wrong = opts()
        .open(log_path(&logs, "wrong", who))
        .expect("wrong log");
    let mut known: Vec<u64> = all_ids(&logs, "acked").into_iter().collect();
    let mut rng = Rng::new(base_seed() ^ round << 8 ^ u64::from(who));
    let mut job = u64::from(who) << 40;
    // Fresh ids of this round and writer: every store writes.
    let mut next = round << 24 | u64::from(who) << 20;
    while nix::unistd::getppid() == parent && born.elapsed() < CHILD_LIFETIME {
        job += 1;
        let load = !known.is_empty() && rng.below(10) < 3;
        let ids: Vec<u64> = if load {
            (0..BATCH)
                .map(|_| known[rng.below(known.len() as u64) as usize])
                .collect::<BTreeSet<u64>>()
                .into_iter()
                .collect()
        } else {
            next += BATCH as u64;
            (next - BATCH as u64..next).collect()
        };
        if load {
            let r = common::load(&engine, &region, job, &ids);
            let bad: Vec<u64> = (0..r.succeeded_prefix)
                .filter(|&i| !holds(&region, i as u32, ids[i]))
                .map(|i| ids[i])
                .collect();
            append(&mut wrong, &bad);
        } else {
            append(&mut attempted, &ids);
            let r = store(&engine, &region, job, &ids);
            if r.success {
                append(&mut acked, &ids);
                known.extend_from_slice(&ids);
            }
        }
        std::thread::sleep(PAUSE);
    }
}

/// What one reopen-and-check found.
#[derive(Default, Debug)]
struct Tally {
    kills: u64,
    /// Rounds killed before any store of theirs was acknowledged (start-up, recovery, first
    /// store in flight).
    early: u64,
    checked: u64,
    resets: u64,
    lost: u64,
    wrong: u64,
    damaged: u64,
}

fn spawn_child(kind: Kind, who: u32, round: u64, logs: &Path, path: &Path) -> Child {
    let exe = std::env::current_exe().expect("test binary");
    let kind = if kind == Kind::Files { "files" } else { "slab" };
    Command::new(exe)
        .args(["--exact", "kill_child_entry", "--test-threads=1"])
        .env(
            CHILD_ENV,
            format!("{kind}:{who}:{round}:{}:{}", logs.display(), path.display()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the child")
}

/// Reopens `path`, loads every key submitted for a store since the last reset and counts what
/// came back; returns how many keys that was.
fn check(kind: Kind, path: &Path, logs: &Path, tally: &mut Tally) -> usize {
    let cfg = config(kind, path);
    let region = region(REGION_BLOCKS);
    let engine = open_real(&cfg, &region).expect("reopen after the kill");
    let attempted: Vec<u64> = all_ids(logs, "attempted").into_iter().collect();
    let acked = all_ids(logs, "acked");
    for (n, ids) in attempted.chunks(REGION_BLOCKS as usize).enumerate() {
        let r = load(&engine, &region, n as u64, ids);
        tally.checked += ids.len() as u64;
        for (i, &id) in ids.iter().enumerate() {
            match r.failures.iter().find(|f| f.key_index == i) {
                None => tally.wrong += u64::from(!holds(&region, i as u32, id)),
                Some(f) => {
                    if f.reason != KeyFailure::Miss {
                        // Detected and not served (a checksum, a short file, a torn entry).
                        tally.damaged += 1;
                    }
                    if acked.contains(&id) {
                        tally.lost += 1;
                        println!("lost acknowledged key {id}: {f:?}");
                    }
                }
            }
        }
    }
    if kind == Kind::Files {
        let m = FileMapper::new(path, &namespace());
        let (bytes, temps) = disk_bytes(&m.data_dir());
        assert_eq!(temps, 0, "temp files survived the reopen");
        let usage = std::fs::read(m.data_dir().join(".kvtier-usage")).expect("usage counter");
        let counted = u64::from_le_bytes(usage[..8].try_into().expect("8 bytes"));
        assert_eq!(counted, bytes, "usage counter drift after the reopen");
    }
    engine.shutdown();
    attempted.len()
}

/// Empties the device: a new slab file, an empty directory, or a zeroed loop device; then one
/// open (not under fire) creates or formats it.
fn reset(kind: Kind, path: &Path) -> bool {
    if path.starts_with("/dev") {
        let zeros = vec![0u8; (CAPACITY_BLOCKS * BLOCK) as usize];
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .and_then(|mut f| f.write_all(&zeros).and_then(|()| f.sync_all()))
            .expect("zero the loop device");
    } else if kind == Kind::Files {
        let _ = std::fs::remove_dir_all(path);
    } else {
        let _ = std::fs::remove_file(path);
    }
    let region = region(REGION_BLOCKS);
    let Some(engine) = open_real(&config(kind, path), &region) else {
        return false;
    };
    engine.shutdown();
    true
}

fn clear_logs(logs: &Path) {
    for e in std::fs::read_dir(logs).expect("logs").flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("attempted-") || name.starts_with("acked-") {
            std::fs::remove_file(e.path()).expect("remove a log");
        }
    }
}

/// Bytes of `.bin` files and the number of `.tmp` files below `dir`.
fn disk_bytes(dir: &Path) -> (u64, usize) {
    let (mut bytes, mut temps) = (0, 0);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "bin") {
                bytes += e.metadata().map_or(0, |m| m.len());
            } else if p.extension().is_some_and(|x| x == "tmp") {
                temps += 1;
            }
        }
    }
    (bytes, temps)
}

fn kills() -> u64 {
    env_u64("KVTIER_KILLS", 50)
}

fn base_seed() -> u64 {
    env_u64("KVTIER_KILL_SEED", 0x005E_ED0F_C1A5)
}

/// Runs the campaign on `path` with `writers` children per round; returns the tally.
fn campaign(name: &str, kind: Kind, path: &Path, writers: u32) -> Tally {
    let logs = scratch_dir();
    if !reset(kind, path) {
        return Tally::default();
    }
    let mut rng = Rng::new(base_seed() ^ name.len() as u64);
    let mut tally = Tally::default();
    let started = Instant::now();
    let mut round = 0;
    while tally.kills < kills() {
        round += 1;
        let acked_before = all_ids(logs.path(), "acked").len();
        let mut children: Vec<(Child, Duration)> = (0..writers)
            .map(|who| {
                let child = spawn_child(kind, who, round, logs.path(), path);
                // From just after the spawn (the child may still be starting or recovering)
                // to well into its stores.
                (child, Duration::from_millis(rng.below(400)))
            })
            .collect();
        children.sort_by_key(|(_, after)| *after);
        let t0 = Instant::now();
        for (child, after) in &mut children {
            if let Some(left) = after.checked_sub(t0.elapsed()) {
                std::thread::sleep(left);
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("a child exited by itself before its kill: {status}");
            }
            child.kill().expect("SIGKILL");
            child.wait().expect("reap");
            tally.kills += 1;
        }
        tally.early += u64::from(all_ids(logs.path(), "acked").len() == acked_before);
        if check(kind, path, logs.path(), &mut tally) >= RESET_AFTER {
            clear_logs(logs.path());
            assert!(reset(kind, path), "the device reopened above");
            tally.resets += 1;
        }
    }
    tally.wrong += all_ids(logs.path(), "wrong").len() as u64;
    println!(
        "kill campaign {name}: {} kills ({} before a first acknowledged store), {} keys \
         checked, {} acknowledged keys lost, {} wrong, {} damaged blocks detected (not served), \
         {} resets, {:.1} s",
        tally.kills,
        tally.early,
        tally.checked,
        tally.lost,
        tally.wrong,
        tally.damaged,
        tally.resets,
        started.elapsed().as_secs_f64()
    );
    assert_eq!(tally.wrong, 0, "wrong bytes served: {tally:?}");
    assert_eq!(
        tally.lost, 0,
        "acknowledged stores lost to a SIGKILL: {tally:?}"
    );
    assert!(tally.checked > 0, "nothing was checked: {tally:?}");
    tally
}

#[test]
fn sigkill_campaign_slab_file() {
    let dir = scratch_dir();
    campaign("slab file", Kind::Slab, &dir.path().join("slab"), 1);
}

#[test]
fn sigkill_campaign_files_directory() {
    let dir = scratch_dir();
    campaign("files directory", Kind::Files, &dir.path().join("files"), 1);
}

#[test]
fn sigkill_campaign_two_processes_share_a_files_directory() {
    let dir = scratch_dir();
    campaign(
        "files directory, two processes",
        Kind::Files,
        &dir.path().join("files"),
        2,
    );
}

#[test]
fn sigkill_campaign_raw_loop_device() {
    let dir = scratch_dir();
    let backing = dir.path().join("loop.img");
    // Written once, so reads are real, like a used disk.
    std::fs::write(&backing, vec![0u8; (CAPACITY_BLOCKS * BLOCK) as usize]).expect("backing file");
    let dev = match LoopDevice::attach(&backing, true) {
        Ok(d) => d,
        Err(why) => return kvtier_sys::skip!("{why}"),
    };
    campaign("raw loop device", Kind::Slab, dev.path(), 1);
}
