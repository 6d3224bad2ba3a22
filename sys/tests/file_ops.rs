//! Real-kernel tests of `Ring::push_file_op`, the I/O of the one-file-per-block layout: write a
//! block to `<dest>_<rand>.tmp` (`O_CREAT|O_EXCL|O_WRONLY|O_DIRECT`), fdatasync, close, rename
//! with `RENAME_NOREPLACE`, then open, read and close it, all through the ring and many at once;
//! plus the errors the layout relies on (EEXIST, ENOENT), path copies outliving the caller's
//! `CString`, and the `SharedCounter`/`FileLock` state shared with a second process. Each test
//! skips with a message when the kernel or filesystem lacks what it needs; a failure means a
//! block was corrupted, a completion lost or duplicated, or a path freed under the kernel.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_sys::file::probe_o_direct;
use kvtier_sys::mem::{HugePages, Region};
use kvtier_sys::ring::{BufRef, Completion, FileOp, Ring, RingConfig, AT_FDCWD, RENAME_NOREPLACE};
use kvtier_sys::shared::{FileLock, SharedCounter};

const BLOCK: usize = 64 << 10;
const BLOCK_I32: i32 = 64 << 10;
const CREATE_TMP: i32 = libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_DIRECT;
const OPEN_READ: i32 = libc::O_RDONLY | libc::O_DIRECT;

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kvtier-sys-fileops-")
        .tempdir_in("/var/tmp")
        .expect("tempdir in /var/tmp")
}

/// A ring with file ops and one 1 MiB region registered in 256 KiB pieces, or None (skip).
fn setup(dir: &Path) -> Option<(Ring, Arc<Region>)> {
    if probe_o_direct(dir) != Ok(true) {
        kvtier_sys::skip!("{} refuses O_DIRECT", dir.display());
        return None;
    }
    let mut ring = match Ring::new(&RingConfig::default()) {
        Ok(ring) => ring,
        Err(e) => {
            kvtier_sys::skip!("io_uring unavailable: {e}");
            return None;
        }
    };
    if !ring.supports_file_ops() {
        kvtier_sys::skip!("kernel lacks the io_uring file opcodes (5.15+)");
        return None;
    }
    let region = Arc::new(Region::allocate(1 << 20, HugePages::Off).expect("allocate"));
    ring.register_buffers(vec![Arc::clone(&region)], 256 << 10)
        .expect("register_buffers");
    Some((ring, region))
}

fn cpath(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("path without NUL")
}

fn buf(offset: usize, len: usize) -> BufRef {
    BufRef {
        region: 0,
        offset,
        len: len as u32,
    }
}

fn wait_for(ring: &mut Ring, n: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while out.len() < n {
        assert!(Instant::now() < deadline, "completions lost: got {out:?}");
        ring.submit(1).expect("submit");
        ring.complete(&mut out);
    }
    out
}

/// An `openat` relative to the current directory, following symlinks.
fn open_cwd(path: &std::ffi::CStr, flags: i32, mode: u32) -> FileOp<'_> {
    FileOp::OpenAt {
        dir: AT_FDCWD,
        path,
        flags,
        mode,
        confined: false,
    }
}

/// A confined read-only open of `path` below `dir`.
fn open(dir: i32, path: &std::ffi::CStr) -> FileOp<'_> {
    FileOp::OpenAt {
        dir,
        path,
        flags: libc::O_RDONLY,
        mode: 0,
        confined: true,
    }
}

/// Pushes one op, waits for its completion and returns its result.
fn run(ring: &mut Ring, user_data: u64, op: &FileOp<'_>) -> i32 {
    // SAFETY: the test reads its region only after the completion is waited for below.
    unsafe { ring.push_file_io_raw(user_data, op, 0) }.expect("push_file_io");
    let done = wait_for(ring, 1);
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0].user_data, user_data);
    assert_eq!(ring.in_flight(), 0);
    done[0].result
}

#[test]
fn tmp_write_fsync_rename_then_read_round_trips_a_block() {
    let tmp = tempdir();
    let Some((mut ring, region)) = setup(tmp.path()) else {
        return;
    };
    let pattern: Vec<u8> = (0..BLOCK).map(|i| (i * 13 + i / 4096) as u8).collect();
    region.write(0, &pattern);
    let (tmp_path, dest) = (tmp.path().join("a.bin_123.tmp"), tmp.path().join("a.bin"));

    // The path lives only inside this block: the ring must have copied it, because the kernel
    // reads it at submit time, after the CString is freed and its heap memory reused below.
    {
        let path = cpath(&tmp_path);
        let op = open_cwd(&path, CREATE_TMP, 0o644);
        ring.push_file_op(1, &op, 0).expect("push open");
    }
    let junk: Vec<Vec<u8>> = (0..64)
        .map(|_| vec![b'#'; tmp_path.as_os_str().len() + 1])
        .collect();
    let done = wait_for(&mut ring, 1);
    drop(junk);
    assert_eq!(done[0].user_data, 1);
    let fd = done[0].result;
    assert!(fd >= 0, "openat failed: {fd}");
    assert!(
        tmp_path.exists(),
        "openat created another name than the one pushed"
    );

    let write = FileOp::WriteFd {
        fd,
        offset: 0,
        buf: buf(0, BLOCK),
    };
    assert_eq!(run(&mut ring, 2, &write), BLOCK_I32);
    let sync = FileOp::Fsync {
        fd,
        data_only: true,
    };
    assert_eq!(run(&mut ring, 3, &sync), 0);
    assert_eq!(run(&mut ring, 4, &FileOp::Close { fd }), 0);
    let (from, to) = (cpath(&tmp_path), cpath(&dest));
    let rename = FileOp::RenameAt {
        dir: AT_FDCWD,
        from: &from,
        to: &to,
        flags: RENAME_NOREPLACE,
    };
    assert_eq!(run(&mut ring, 5, &rename), 0);
    assert!(!tmp_path.exists() && dest.exists());
    assert_eq!(std::fs::metadata(&dest).expect("stat").len(), BLOCK as u64);

    let open = open_cwd(&to, OPEN_READ, 0);
    let fd = run(&mut ring, 6, &open);
    assert!(fd >= 0, "openat for reading failed: {fd}");
    let read = FileOp::ReadFd {
        fd,
        offset: 0,
        buf: buf(512 << 10, BLOCK),
    };
    assert_eq!(run(&mut ring, 7, &read), BLOCK_I32);
    assert_eq!(run(&mut ring, 8, &FileOp::Close { fd }), 0);
    let mut back = vec![0_u8; BLOCK];
    region.read(512 << 10, &mut back);
    assert!(back == pattern, "read-back differs from the written block");
    // The fd is closed: the ring's close really closed it.
    assert_eq!(run(&mut ring, 9, &FileOp::Close { fd }), -libc::EBADF);
}

// A confined open resolves relative to its directory fd and refuses a symlink at any
// component (ELOOP) and a path that climbs out (EXDEV); *at ops resolve relative to `dir`.
#[test]
fn confined_opens_refuse_symlinks_and_escapes() {
    use std::os::fd::AsRawFd;
    let tmp = tempdir();
    let Some((mut ring, _region)) = setup(tmp.path()) else {
        return;
    };
    std::fs::create_dir(tmp.path().join("d")).expect("mkdir");
    std::fs::write(tmp.path().join("d/f"), b"f").expect("write");
    std::os::unix::fs::symlink(tmp.path().join("d/f"), tmp.path().join("d/link")).expect("ln");
    std::os::unix::fs::symlink(tmp.path().join("d"), tmp.path().join("dlink")).expect("ln");
    let root = kvtier_sys::dir::open_root(tmp.path()).expect("root");
    let r = root.as_raw_fd();
    let fd = run(&mut ring, 1, &open(r, c"d/f"));
    assert!(fd >= 0, "confined open of a plain file: {fd}");
    assert_eq!(run(&mut ring, 2, &FileOp::Close { fd }), 0);
    assert_eq!(run(&mut ring, 3, &open(r, c"d/link")), -libc::ELOOP);
    assert_eq!(run(&mut ring, 4, &open(r, c"dlink/f")), -libc::ELOOP);
    assert_eq!(run(&mut ring, 5, &open(r, c"../x")), -libc::EXDEV);
    // Not confined, the same symlink is followed (what `confined` is for).
    let loose = FileOp::OpenAt {
        dir: root.as_raw_fd(),
        path: c"d/link",
        flags: libc::O_RDONLY,
        mode: 0,
        confined: false,
    };
    let fd = run(&mut ring, 6, &loose);
    assert!(fd >= 0, "{fd}");
    assert_eq!(run(&mut ring, 7, &FileOp::Close { fd }), 0);
    let mkdir = FileOp::MkdirAt {
        dir: root.as_raw_fd(),
        path: c"d/sub",
        mode: 0o700,
    };
    assert_eq!(run(&mut ring, 8, &mkdir), 0);
    assert!(tmp.path().join("d/sub").is_dir());
    let unlink = FileOp::UnlinkAt {
        dir: root.as_raw_fd(),
        path: c"d/link",
    };
    assert_eq!(run(&mut ring, 9, &unlink), 0);
    assert!(
        tmp.path().join("d/f").exists(),
        "unlink removed the link, not its target"
    );
}

#[test]
fn errors_the_layout_relies_on() {
    let tmp = tempdir();
    let Some((mut ring, _region)) = setup(tmp.path()) else {
        return;
    };
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::write(&a, b"a").expect("write a");
    std::fs::write(&b, b"b").expect("write b");
    let (ca, cb) = (cpath(&a), cpath(&b));

    // Another writer already published the block: NOREPLACE keeps its copy.
    let rename = FileOp::RenameAt {
        dir: AT_FDCWD,
        from: &ca,
        to: &cb,
        flags: RENAME_NOREPLACE,
    };
    assert_eq!(run(&mut ring, 1, &rename), -libc::EEXIST);
    assert_eq!(std::fs::read(&b).expect("read b"), b"b");
    assert!(a.exists());

    let missing = cpath(&tmp.path().join("missing"));
    let open = open_cwd(&missing, OPEN_READ, 0);
    assert_eq!(run(&mut ring, 2, &open), -libc::ENOENT);

    let dir = cpath(&tmp.path().join("sub"));
    let mkdir = FileOp::MkdirAt {
        dir: AT_FDCWD,
        path: &dir,
        mode: 0o755,
    };
    assert_eq!(run(&mut ring, 3, &mkdir), 0);
    assert!(tmp.path().join("sub").is_dir());
    assert_eq!(run(&mut ring, 4, &mkdir), -libc::EEXIST);

    let unlink = FileOp::UnlinkAt {
        dir: AT_FDCWD,
        path: &ca,
    };
    assert_eq!(run(&mut ring, 5, &unlink), 0);
    assert!(!a.exists());
    assert_eq!(run(&mut ring, 6, &unlink), -libc::ENOENT);

    let sync = FileOp::Fsync {
        fd: -1,
        data_only: false,
    };
    assert_eq!(run(&mut ring, 7, &sync), -libc::EBADF);
}

/// Pushes `ops[i]` with user_data `tag << 32 | i` for every i, all in flight at once, and
/// returns each result by index after checking that every op completed exactly once.
fn run_batch(ring: &mut Ring, tag: u64, ops: &[FileOp<'_>]) -> Vec<i32> {
    for (i, op) in ops.iter().enumerate() {
        // SAFETY: the test reads its region only after every completion is waited for below.
        unsafe { ring.push_file_io_raw(tag << 32 | i as u64, op, 0) }.expect("room in the SQ");
    }
    assert_eq!(ring.in_flight(), ops.len());
    let mut results = HashMap::new();
    for c in wait_for(ring, ops.len()) {
        assert_eq!(c.user_data >> 32, tag, "completion of another batch: {c:?}");
        let i = (c.user_data & 0xffff_ffff) as usize;
        assert!(i < ops.len(), "unknown user_data {c:?}");
        assert!(
            results.insert(i, c.result).is_none(),
            "completed twice: {c:?}"
        );
    }
    assert_eq!(ring.in_flight(), 0);
    (0..ops.len()).map(|i| results[&i]).collect()
}

#[test]
fn thirty_two_files_in_flight_each_complete_once() {
    const FILES: usize = 32;
    const SIZE: usize = 16 << 10;
    const SIZE_I32: i32 = 16 << 10;
    let tmp = tempdir();
    let Some((mut ring, region)) = setup(tmp.path()) else {
        return;
    };
    for i in 0..FILES {
        region.fill(i * SIZE, SIZE, i as u8 + 1);
    }
    let tmp_names: Vec<CString> = (0..FILES)
        .map(|i| cpath(&tmp.path().join(format!("b{i}.bin_{}.tmp", 1000 + i))))
        .collect();
    let names: Vec<CString> = (0..FILES)
        .map(|i| cpath(&tmp.path().join(format!("b{i}.bin"))))
        .collect();

    // Each path is a fresh CString dropped before the batch is submitted.
    for (i, name) in tmp_names.iter().enumerate() {
        let path = name.clone();
        let op = open_cwd(&path, CREATE_TMP, 0o644);
        ring.push_file_op(1 << 32 | i as u64, &op, 0)
            .expect("room in the SQ");
    }
    let mut fds = [-1; FILES];
    for c in wait_for(&mut ring, FILES) {
        let i = (c.user_data & 0xffff_ffff) as usize;
        assert!(fds[i] == -1, "completed twice: {c:?}");
        assert!(c.result >= 0, "openat {i} failed: {c:?}");
        fds[i] = c.result;
    }
    assert_eq!(ring.in_flight(), 0);

    let writes: Vec<FileOp<'_>> = (0..FILES)
        .map(|i| FileOp::WriteFd {
            fd: fds[i],
            offset: 0,
            buf: buf(i * SIZE, SIZE),
        })
        .collect();
    assert!(run_batch(&mut ring, 2, &writes)
        .iter()
        .all(|&r| r == SIZE_I32));
    let syncs: Vec<FileOp<'_>> = (0..FILES)
        .map(|i| FileOp::Fsync {
            fd: fds[i],
            data_only: i % 2 == 0,
        })
        .collect();
    assert!(run_batch(&mut ring, 3, &syncs).iter().all(|&r| r == 0));
    let closes: Vec<FileOp<'_>> = fds.iter().map(|&fd| FileOp::Close { fd }).collect();
    assert!(run_batch(&mut ring, 4, &closes).iter().all(|&r| r == 0));
    let renames: Vec<FileOp<'_>> = (0..FILES)
        .map(|i| FileOp::RenameAt {
            dir: AT_FDCWD,
            from: &tmp_names[i],
            to: &names[i],
            flags: RENAME_NOREPLACE,
        })
        .collect();
    assert!(run_batch(&mut ring, 5, &renames).iter().all(|&r| r == 0));

    let opens: Vec<FileOp<'_>> = names
        .iter()
        .map(|path| FileOp::OpenAt {
            dir: AT_FDCWD,
            confined: false,
            path,
            flags: OPEN_READ,
            mode: 0,
        })
        .collect();
    let fds = run_batch(&mut ring, 6, &opens);
    assert!(fds.iter().all(|&fd| fd >= 0), "{fds:?}");
    let reads: Vec<FileOp<'_>> = (0..FILES)
        .map(|i| FileOp::ReadFd {
            fd: fds[i],
            offset: 0,
            buf: buf((512 << 10) + i * SIZE, SIZE),
        })
        .collect();
    assert!(run_batch(&mut ring, 7, &reads)
        .iter()
        .all(|&r| r == SIZE_I32));
    let closes: Vec<FileOp<'_>> = fds.iter().map(|&fd| FileOp::Close { fd }).collect();
    assert!(run_batch(&mut ring, 8, &closes).iter().all(|&r| r == 0));
    for i in 0..FILES {
        let mut back = vec![0_u8; SIZE];
        region.read((512 << 10) + i * SIZE, &mut back);
        assert!(
            back.iter().all(|&b| b == i as u8 + 1),
            "file {i} read back wrong"
        );
    }
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .expect("read_dir")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

#[test]
fn dropped_ring_drains_queued_file_ops() {
    // A ring dropped with an unsubmitted file op: Drop submits it together with a cancel-all,
    // so it runs or ends -ECANCELED (mkdirat is punted to a kernel worker, where the cancel
    // usually catches it); either way the path copy must outlive the drain, and Drop must not
    // hang.
    let tmp = tempdir();
    let Some((mut ring, _region)) = setup(tmp.path()) else {
        return;
    };
    {
        let path = cpath(&tmp.path().join("made-by-drop"));
        let op = FileOp::MkdirAt {
            dir: AT_FDCWD,
            path: &path,
            mode: 0o755,
        };
        ring.push_file_op(1, &op, 0).expect("push");
    }
    assert_eq!(ring.in_flight(), 1);
    let t0 = Instant::now();
    drop(ring);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "drain took {:?}",
        t0.elapsed()
    );
    let made = tmp.path().join("made-by-drop").is_dir();
    println!(
        "queued mkdirat at drop: {}",
        if made { "ran" } else { "cancelled" }
    );
}

#[test]
#[should_panic(expected = "out of range")]
fn read_outside_the_region_panics() {
    let tmp = tempdir();
    let Some((mut ring, _region)) = setup(tmp.path()) else {
        panic!("out of range (skipped: no O_DIRECT or io_uring file ops)");
    };
    let op = FileOp::ReadFd {
        fd: 0,
        offset: 0,
        buf: buf((1 << 20) - 4096, 8192),
    };
    // SAFETY: the push panics before anything reaches the kernel.
    let _ = unsafe { ring.push_file_io_raw(1, &op, 0) };
}

/// Env var that turns `shared_state_child_process` from a no-op into the child's work; its value
/// is the directory holding the counter and lock files.
const CHILD_ENV: &str = "KVTIER_SYS_SHARED_CHILD_DIR";
const CHILD_ADDS: u64 = 100_000;

#[test]
fn shared_state_child_process() {
    // The child side of `shared_counter_and_lock_across_processes`; a no-op in a normal run.
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let dir = Path::new(&dir);
    let counter = SharedCounter::open(&dir.join("counter")).expect("child: open counter");
    for _ in 0..CHILD_ADDS {
        counter.fetch_add(1).expect("child: add");
    }
    let lock = FileLock::open(&dir.join("lock")).expect("child: open lock");
    assert_eq!(
        lock.try_exclusive(),
        Ok(false),
        "child alone while the parent lives"
    );
    assert_eq!(lock.try_shared(), Ok(true));
}

#[test]
fn shared_counter_and_lock_across_processes() {
    // A second process (this test binary re-run on `shared_state_child_process`) adds to the
    // counter while this one does, and must find the lock held shared by this process.
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let tmp = tempdir();
    let counter = SharedCounter::open(&tmp.path().join("counter")).expect("open counter");
    let lock = FileLock::open(&tmp.path().join("lock")).expect("open lock");
    assert_eq!(lock.try_exclusive(), Ok(true), "alone at start");
    lock.shared().expect("downgrade to shared");
    let exe = std::env::current_exe().expect("current_exe");
    let child = Command::new(exe)
        .args(["--exact", "shared_state_child_process", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(CHILD_ENV, tmp.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn child");
    // Wait until the child is adding, so that both processes add at the same time.
    let deadline = Instant::now() + Duration::from_secs(30);
    while counter.load() == Ok(0) && Instant::now() < deadline {
        std::thread::yield_now();
    }
    let mut parent_adds = 0_u64;
    while parent_adds < CHILD_ADDS {
        counter.fetch_add(1).expect("add");
        parent_adds += 1;
    }
    let out = child.wait_with_output().expect("wait for child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("test shared_state_child_process ... ok"),
        "child did not run the test: {stdout}"
    );
    assert_eq!(counter.load(), Ok(2 * CHILD_ADDS));
    // The child's shared lock died with it; ours is still held.
    let other = FileLock::open(&tmp.path().join("lock")).expect("open other");
    assert_eq!(other.try_exclusive(), Ok(false));
    drop(lock);
    assert_eq!(other.try_exclusive(), Ok(true));
}
