//! Real-kernel device handling: the buffered fallback on ramfs (which refuses O_DIRECT), the
//! refusal when direct I/O is required there, a raw block device through a loop device, and
//! clear errors for devices that cannot be used. Each test skips with a message when the
//! machine cannot provide what it needs (not root, no loop devices, no io_uring).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use kvtier::config::DirectIo;
use kvtier::Engine;

struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn mount_ramfs(dir: &Path) -> Option<Mount> {
    let point = dir.join("ramfs");
    std::fs::create_dir_all(&point).ok()?;
    let ok = Command::new("mount")
        .args(["-t", "ramfs", "ramfs"])
        .arg(&point)
        .status()
        .ok()?
        .success();
    if ok {
        Some(Mount(point))
    } else {
        None
    }
}

#[test]
fn ramfs_falls_back_to_buffered_io_when_auto() {
    let dir = scratch_dir();
    let Some(mount) = mount_ramfs(dir.path()) else {
        return kvtier_sys::skip!("cannot mount ramfs here (needs root)");
    };
    let mut cfg = file_config(&mount.0.join("dev.slab"), 32 << 20, 1);
    cfg.direct_io = DirectIo::Auto;
    let region = region(8);
    let Some(engine) = open_real(&cfg, &region) else {
        return;
    };
    assert!(!engine.info().devices[0].direct, "ramfs cannot do O_DIRECT");
    let ids: Vec<u64> = (0..8).collect();
    assert!(store(&engine, &region, 1, &ids).success);
    let r = load(&engine, &region, 2, &ids);
    assert!(r.success, "{r:?}");
    for (b, &id) in ids.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }
    drop(engine);
    // Required refuses it, and says what to do.
    cfg.direct_io = DirectIo::Required;
    let err = Engine::open(&cfg, region.clone()).err().expect("refused");
    let msg = err.to_string();
    assert!(
        msg.contains("O_DIRECT") && msg.contains("direct_io = \"auto\""),
        "{msg}"
    );
}

#[test]
fn raw_block_device_through_a_loop_device() {
    let dir = scratch_dir();
    let backing = dir.path().join("loop.img");
    let f = std::fs::File::create(&backing).expect("backing file");
    f.set_len(64 << 20).expect("size");
    drop(f);
    // Write it once so reads are real, like a used disk.
    std::fs::write(&backing, vec![0u8; 64 << 20]).expect("pre-write");
    let attached = match LoopDevice::attach(&backing, true) {
        Ok(d) => d,
        Err(why) => return kvtier_sys::skip!("{why}"),
    };
    let dev = attached.0.clone();
    let mut cfg = file_config(Path::new(&dev), 64 << 20, 2);
    cfg.devices[0].capacity_bytes = None;
    let region = region(16);
    let Some(engine) = open_real(&cfg, &region) else {
        return;
    };
    let info = &engine.info().devices[0];
    assert_eq!(info.kind, "block device");
    assert!(
        info.formatted,
        "an all-zero device is formatted without asking"
    );
    let ids: Vec<u64> = (0..16).collect();
    assert!(store(&engine, &region, 1, &ids).success);
    drop(engine);
    let engine = Engine::open(&cfg, region.clone()).expect("reopen");
    assert!(!engine.info().devices[0].formatted);
    let r = load(&engine, &region, 2, &ids);
    assert!(r.success, "{r:?}");
    for (b, &id) in ids.iter().enumerate() {
        assert!(holds(&region, b as u32, id));
    }
}

#[test]
fn unusable_devices_give_clear_errors() {
    let dir = scratch_dir();
    let region = region(4);
    // A file that does not exist and no capacity to create it with.
    let mut cfg = file_config(&dir.path().join("missing.slab"), 32 << 20, 1);
    cfg.devices[0].capacity_bytes = None;
    let msg = Engine::open(&cfg, region.clone())
        .err()
        .expect("refused")
        .to_string();
    assert!(
        msg.contains("devices[0].capacity_bytes") && msg.contains("missing.slab"),
        "{msg}"
    );
    // A directory is not a device.
    let mut cfg = file_config(dir.path(), 32 << 20, 1);
    cfg.devices[0].capacity_bytes = None;
    let msg = Engine::open(&cfg, region.clone())
        .err()
        .expect("refused")
        .to_string();
    assert!(
        msg.contains("not a regular file or a block device"),
        "{msg}"
    );
    // An existing file with someone else's data is not formatted without overwrite = true.
    let foreign = dir.path().join("foreign.bin");
    std::fs::write(&foreign, vec![0x5a; 32 << 20]).expect("write");
    let mut cfg = file_config(&foreign, 32 << 20, 1);
    cfg.devices[0].capacity_bytes = None;
    let msg = Engine::open(&cfg, region.clone())
        .err()
        .expect("refused")
        .to_string();
    assert!(msg.contains("overwrite = true"), "{msg}");
    assert_eq!(
        std::fs::read(&foreign).expect("read")[..4],
        [0x5a; 4],
        "left untouched"
    );
    // Too small for a single slot.
    let mut cfg = file_config(&dir.path().join("tiny.slab"), 16 << 20, 1);
    cfg.block_size = 32 << 20;
    let region = kvtier::region::allocate_blocks(32 << 20, 1, kvtier::config::HugePages::Off)
        .expect("region");
    let msg = Engine::open(&cfg, region)
        .err()
        .expect("refused")
        .to_string();
    assert!(msg.contains("too small"), "{msg}");
}

#[test]
fn bad_config_text_names_field_value_and_choices() {
    let text = "block_size = \"3 KiB\"\n[[devices]]\npath = \"/x\"\n";
    let msg = kvtier::Config::from_toml_str(text)
        .expect_err("invalid")
        .to_string();
    assert!(
        msg.contains("block_size") && msg.contains("3 KiB") && msg.contains("4096"),
        "{msg}"
    );
    let text = "direct_io = \"sometimes\"\n[[devices]]\npath = \"/x\"\n";
    let msg = kvtier::Config::from_toml_str(text)
        .expect_err("invalid")
        .to_string();
    assert!(
        msg.contains("direct_io") && msg.contains("sometimes") && msg.contains("auto"),
        "{msg}"
    );
    let text = "blok_size = 4096\n[[devices]]\npath = \"/x\"\n";
    let msg = kvtier::Config::from_toml_str(text)
        .expect_err("invalid")
        .to_string();
    assert!(msg.contains("blok_size"), "{msg}");
}

#[test]
fn sqpoll_and_iopoll_work_or_fall_back() {
    // Opt-in ring modes: where the kernel or the device cannot do them the engine falls back
    // (with a log line) instead of failing I/O. Either way, data round-trips.
    for (sqpoll, iopoll) in [(true, false), (false, true)] {
        let dir = scratch_dir();
        let mut cfg = file_config(&dir.path().join("dev.slab"), 32 << 20, 1);
        cfg.sqpoll = sqpoll;
        cfg.iopoll = iopoll;
        let region = region(4);
        let Some(engine) = open_real(&cfg, &region) else {
            return;
        };
        println!(
            "sqpoll={sqpoll} iopoll={iopoll}: {}",
            engine.info().workers[0].backend
        );
        assert!(store(&engine, &region, 1, &[1, 2]).success);
        let r = load(&engine, &region, 2, &[1, 2]);
        assert!(r.success, "sqpoll={sqpoll} iopoll={iopoll}: {r:?}");
        assert!(holds(&region, 0, 1) && holds(&region, 1, 2));
    }
}

/// Unmounts lazily: a device a leaked worker still holds open keeps the mount busy.
struct LazyMount(PathBuf);

impl Drop for LazyMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

struct Thaw(PathBuf);

impl Drop for Thaw {
    fn drop(&mut self) {
        let _ = Command::new("fsfreeze").arg("-u").arg(&self.0).status();
    }
}

fn run_ok(cmd: &mut Command) -> Result<(), String> {
    match cmd.output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "{cmd:?}: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("{cmd:?}: {e}")),
    }
}

// A real hung device: a loop device whose backing file sits on a frozen file system
// (`fsfreeze`), so its writes block in the kernel (and its reads queue behind them). Stores and
// then loads fail with a timeout naming the device and the operation (reported at the deadline:
// this engine takes early results), their blocks stay leased and their releases unset, and
// shutdown returns while the I/O is still stuck, saying so.
#[test]
fn a_device_that_stops_writing_times_out_stores_and_shutdown_returns() {
    let dir = scratch_dir();
    let outer_img = dir.path().join("outer.img");
    std::fs::write(&outer_img, vec![0u8; 96 << 20]).expect("outer image");
    let outer = match LoopDevice::attach(&outer_img, false) {
        Ok(d) => d,
        Err(why) => return kvtier_sys::skip!("{why}"),
    };
    let mnt = dir.path().join("mnt");
    std::fs::create_dir_all(&mnt).expect("mount point");
    if let Err(why) = run_ok(Command::new("mkfs.ext4").args(["-q", &outer.0])) {
        return kvtier_sys::skip!("{why}");
    }
    if let Err(why) = run_ok(Command::new("mount").arg(&outer.0).arg(&mnt)) {
        return kvtier_sys::skip!("{why}");
    }
    let _mounted = LazyMount(mnt.clone());
    let inner_img = mnt.join("inner.img");
    std::fs::write(&inner_img, vec![0u8; 48 << 20]).expect("inner image");
    let inner = match LoopDevice::attach(&inner_img, true) {
        Ok(d) => d,
        Err(why) => return kvtier_sys::skip!("{why}"),
    };
    let mut cfg = file_config(Path::new(&inner.0), 48 << 20, 1);
    cfg.devices[0].capacity_bytes = None;
    cfg.io_timeout_ms = 300;
    let region = region(16);
    let Some(engine) = open_real(&cfg, &region) else {
        return;
    };
    engine.set_early_results(true);
    let ids: Vec<u64> = (0..8).collect();
    assert!(store(&engine, &region, 1, &ids).success);
    if let Err(why) = run_ok(Command::new("fsfreeze").arg("-f").arg(&mnt)) {
        return kvtier_sys::skip!("{why}");
    }
    let _thaw = Thaw(mnt.clone());
    // One key: one timeout (three within ten deadlines mark the device failed).
    let r = store(&engine, &region, 2, &[100]);
    assert!(!r.success, "a store to a frozen device succeeded: {r:?}");
    for f in &r.failures {
        assert_eq!(f.reason, kvtier::KeyFailure::Timeout, "{f:?}");
        assert!(
            f.detail.contains(&inner.0) && f.detail.contains("store"),
            "{}",
            f.detail
        );
    }
    assert!(engine.stats().io_timeouts >= 1);
    // The stuck write may still read its block: it stays leased.
    assert!(
        region.is_leased(0),
        "the block of the stuck store was handed back"
    );
    assert!(!r.released(), "{r:?}");
    // The loop device serves its requests in order: reads queue behind the stuck writes and
    // time out too, each naming the device and the slot.
    let blocks: Vec<u32> = (8..16).collect();
    let r = load_into(&engine, 3, &ids, blocks.clone());
    assert_eq!(r.failures.len(), ids.len(), "{r:?}");
    for f in &r.failures {
        assert_eq!(f.reason, kvtier::KeyFailure::Timeout, "{f:?}");
        assert!(f.detail.contains("load (read of slot"), "{}", f.detail);
    }
    assert!(blocks.iter().all(|&b| region.is_leased(b)));
    let release = r
        .release
        .clone()
        .expect("an early result carries its release");
    assert!(!release.is_released());
    // That many timeouts marked the device failed: its keys are misses now, at once.
    assert_eq!(engine.stats().devices_failed, 1);
    let r = load_into(&engine, 4, &[0], vec![4]);
    assert_eq!(
        r.failure().map(|f| f.reason),
        Some(kvtier::KeyFailure::Miss),
        "{r:?}"
    );
    assert!(
        engine.stats().blocks_held_by_hung_io > blocks.len() as u64,
        "{:?}",
        engine.stats().blocks_held_by_hung_io
    );
    let engine = std::sync::Arc::new(engine);
    let e = std::sync::Arc::clone(&engine);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(e.shutdown());
    });
    let report = rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("shutdown waited for a device that never answers");
    assert!(
        !report.clean() && report.workers_gave_up == 1 && report.blocks_held > 0,
        "{report:?}"
    );
    assert!(!release.is_released() && blocks.iter().all(|&b| region.is_leased(b)));
    // Dropping the guards thaws the file system; the stuck writes then complete into the
    // leaked worker's memory, and the loop devices detach when the process exits.
}
