//! The files layout on the simulator: a backend that runs a worker's file operations
//! ([`FileOp`]) on a real scratch directory, one blocking call each, at the moment it completes
//! them, with the same seeded delays, reordering and faults as the simulated device.
//!
//! Faults: EIO on any operation (on data I/O only, with `data_only`), ENOSPC on a write or a
//! creating open, short reads and writes, torn writes (a prefix lands, the write fails), reads
//! that deliver a flipped bit. `statx` runs as the ring runs it (a lookup's probe of a key not
//! indexed); the extended attributes are not offered on this backend
//! ([`FileOpQueue::xattr_ops`] is false: the layout makes those calls itself).
//!
//! Durability: with [`SimFiles::track_durability`] the backend journals which files hold data
//! written since their last sync and which renames happened since their directory's last
//! sync. [`SimFiles::power_loss`] then undoes some of those renames and keeps, truncates,
//! zeroes part of or removes each file not synced, drawn from a seed, as a file system may
//! after power loss (delayed allocation's empty files included). A descriptor this backend
//! opened and the layout never closed (its worker vanished) is closed there.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::CString;
use std::os::fd::{IntoRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kvtier_sys::fd as sys;

use crate::config::{DeviceConfig, DirectIo};
use crate::error::{Error, Result};
use crate::io::{
    BackendSettings, BlockQueue, Completion, EventFd, FileOp, FileOpQueue, IoBackend, IoBuf,
    IoClass, IoKind, OpenedDevice, Region, Storage,
};
use crate::Errno;

use super::{Faults, Rng, Strays};

/// What a power loss did to the directory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FilesLoss {
    pub renames_undone: u64,
    pub files_kept: u64,
    pub files_truncated: u64,
    pub files_zeroed: u64,
    pub files_removed: u64,
    pub descriptors_closed: u64,
}

/// The scratch directories' simulated storage: shared by every worker's backend.
pub struct SimFiles {
    state: Arc<State>,
}

struct State {
    seed: u64,
    faults: Mutex<Faults>,
    journal: Mutex<Journal>,
    read_flips: AtomicU64,
    strays: Strays,
    /// The directory's file system stopped answering: operations are accepted and none
    /// completes until it answers again.
    hung: AtomicBool,
    /// Renames into place so far: a published file's times are set from it
    /// ([`LOGICAL_EPOCH_SECS`] + the count), so a reopen orders files as the run stored them,
    /// not by the wall clock's seconds.
    renames: AtomicU64,
    /// Clusters opened on these directories so far (each draws temp names of its own).
    opens: AtomicU64,
}

impl State {
    /// Sets the times of a file just published at `path` from the count of publications so
    /// far (the simulation's clock for file times).
    fn stamp(&self, path: &Path) {
        let n = self.renames.fetch_add(1, Ordering::SeqCst);
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(LOGICAL_EPOCH_SECS + n);
        // Best effort: a file removed since (a fault, the neighbour) is simply not there.
        if let Ok(f) = std::fs::File::open(path) {
            let _ = f.set_times(std::fs::FileTimes::new().set_accessed(t).set_modified(t));
        }
    }
}

/// Where the simulated file times start: far after any wall clock, so a read's access-time
/// update (relatime: to now) never moves a file's last use past its logical one.
const LOGICAL_EPOCH_SECS: u64 = 4_000_000_000;

#[derive(Default)]
struct Journal {
    tracking: bool,
    /// Descriptors this backend handed out and not closed through it: which file each names.
    fds: HashMap<RawFd, ((u64, u64), PathBuf)>,
    /// Files holding data (or a name) written since their last sync, by current path.
    unsynced: BTreeSet<PathBuf>,
    /// Renames since their directory's last sync: new path, old path.
    renamed: BTreeMap<PathBuf, PathBuf>,
}

impl SimFiles {
    pub fn new(seed: u64) -> Arc<SimFiles> {
        Arc::new(SimFiles {
            state: Arc::new(State {
                seed,
                faults: Mutex::new(Faults::default()),
                journal: Mutex::new(Journal::default()),
                read_flips: AtomicU64::new(0),
                strays: Strays::default(),
                hung: AtomicBool::new(false),
                renames: AtomicU64::new(0),
                opens: AtomicU64::new(0),
            }),
        })
    }

    pub fn set_faults(&self, faults: Faults) {
        *self
            .state
            .faults
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = faults;
    }

    /// The seed of the temp file names of the next cluster opened on these directories: from
    /// the simulation's seed, different at every open (as a restarted process's pid and time
    /// are), so a replay draws the same names.
    pub fn temp_seed(&self) -> u64 {
        let opens = self.state.opens.fetch_add(1, Ordering::SeqCst) + 1;
        self.state.seed ^ opens.wrapping_mul(0xD6E8_FEB8_6659_FD93)
    }

    /// Reads delivered with a flipped bit so far.
    pub fn read_flips(&self) -> u64 {
        self.state.read_flips.load(Ordering::SeqCst)
    }

    /// Transfers that reached a region block no job held ([`SimStorage::take_strays`]).
    ///
    /// [`SimStorage::take_strays`]: super::SimStorage::take_strays
    pub fn take_strays(&self) -> Vec<String> {
        self.state.strays.take()
    }

    /// Makes the directory's file system stop answering (`true`: operations are accepted and
    /// never complete) or answer again (the held ones then complete).
    pub fn hang(&self, hung: bool) {
        self.state.hung.store(hung, Ordering::SeqCst);
    }

    /// Another process sharing the directory publishes `bytes` at `path` as vLLM's tier does
    /// (a temp file beside it, renamed into place; it syncs its own): the file lands whole and
    /// durably, whatever a power loss later does to this process's writes, and the path is no
    /// longer this process's to lose. Makes the directories. False, with nothing written, if a
    /// file is there already (vLLM leaves it).
    pub fn publish_external(&self, path: &Path, bytes: &[u8]) -> bool {
        let mut j = self.state.journal();
        if std::fs::symlink_metadata(path).is_ok() {
            return false;
        }
        let Some(dir) = path.parent() else {
            return false;
        };
        let temp = path.with_extension("neighbour");
        let done = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&temp, bytes))
            .and_then(|()| std::fs::rename(&temp, path));
        if done.is_ok() {
            self.state.stamp(path);
        }
        j.unsynced.remove(path);
        j.renamed.remove(path);
        done.is_ok()
    }

    /// Another process removes the block file at `path` (an operator, or a cleaner of the
    /// shared directory); true if there was one.
    pub fn remove_external(&self, path: &Path) -> bool {
        let mut j = self.state.journal();
        j.unsynced.remove(path);
        j.renamed.remove(path);
        std::fs::remove_file(path).is_ok()
    }

    /// Journals what is not durable from now on (see the module docs).
    pub fn track_durability(&self, on: bool) {
        let mut j = self.state.journal();
        j.tracking = on;
        j.unsynced.clear();
        j.renamed.clear();
    }

    /// Power goes out (the workers are gone): closes the descriptors they left open, then
    /// loses what was not durable, drawn from `seed`.
    pub fn power_loss(&self, seed: u64) -> FilesLoss {
        let mut rng = Rng::new(seed ^ 0xF11E_5F11_E5F1_1E5F);
        let mut loss = FilesLoss::default();
        let mut j = self.state.journal();
        let mut fds: Vec<_> = j.fds.drain().collect();
        fds.sort_unstable_by_key(|(fd, _)| *fd);
        for (fd, (id, _)) in fds {
            // Only a number that still names the file it was opened on (the layout may have
            // closed it itself, and the number been reused).
            if sys::identity(fd) == Ok(id) && sys::close(fd).is_ok() {
                loss.descriptors_closed += 1;
            }
        }
        for (to, from) in std::mem::take(&mut j.renamed).into_iter().rev() {
            if rng.below(2) == 1 && !from.exists() && std::fs::rename(&to, &from).is_ok() {
                loss.renames_undone += 1;
                if j.unsynced.remove(&to) {
                    j.unsynced.insert(from);
                }
            }
        }
        for path in std::mem::take(&mut j.unsynced) {
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if !meta.is_file() {
                continue;
            }
            let len = meta.len();
            match rng.below(4) {
                0 => loss.files_kept += 1,
                1 => {
                    let keep = rng.below(len / 512 + 1) * 512;
                    if truncate(&path, keep.min(len)) {
                        loss.files_truncated += 1;
                    }
                }
                2 if len >= 512 => {
                    let at = rng.below(len / 512) * 512;
                    if zero(&path, at, 512) {
                        loss.files_zeroed += 1;
                    }
                }
                _ => {
                    if std::fs::remove_file(&path).is_ok() {
                        loss.files_removed += 1;
                    }
                }
            }
        }
        loss
    }
}

fn truncate(path: &Path, len: u64) -> bool {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.set_len(len))
        .is_ok()
}

fn zero(path: &Path, at: u64, len: usize) -> bool {
    use std::os::unix::fs::FileExt;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.write_all_at(&vec![0u8; len], at))
        .is_ok()
}

impl State {
    fn journal(&self) -> MutexGuard<'_, Journal> {
        self.journal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn faults(&self) -> Faults {
        *self
            .faults
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Where `path` below the open directory `dir` is.
fn path_at(dir: RawFd, path: &std::ffi::CStr) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    let base = std::fs::read_link(format!("/proc/self/fd/{dir}")).unwrap_or_default();
    base.join(std::ffi::OsStr::from_bytes(path.to_bytes()))
}

impl Storage for SimFiles {
    fn supports_files(&self) -> bool {
        true
    }

    fn open_device(&self, _: usize, cfg: &DeviceConfig, _: DirectIo) -> Result<OpenedDevice> {
        Err(Error::device(
            &cfg.path,
            "the simulated files storage has directories, not slab devices",
        ))
    }

    fn read_sync(&self, _: usize, _: u64, _: &Region, _: usize, _: usize) -> Result<()> {
        Err(Error::Worker(
            "the simulated files storage has no slab devices".into(),
        ))
    }

    fn write_sync(&self, _: usize, _: u64, _: &Region, _: usize, _: usize) -> Result<()> {
        Err(Error::Worker(
            "the simulated files storage has no slab devices".into(),
        ))
    }

    fn backend(
        &self,
        worker: usize,
        buffers: Vec<Arc<Region>>,
        wake: Arc<EventFd>,
        settings: &BackendSettings,
    ) -> Result<Box<dyn IoBackend>> {
        Ok(Box::new(FilesBackend {
            wake,
            state: Arc::clone(&self.state),
            buffers,
            rng: Rng::new(self.state.seed ^ (worker as u64).wrapping_mul(0x9FB2_1C65_1E98_DF25)),
            queued: Vec::new(),
            pending: Vec::new(),
            values: HashMap::new(),
            round: 0,
            sq_entries: settings.ring_entries as usize,
        }))
    }
}

/// A file operation with its paths owned until it runs.
enum Op {
    Open {
        dir: RawFd,
        path: CString,
        flags: i32,
        mode: u32,
        confined: bool,
    },
    Read {
        fd: RawFd,
        offset: u64,
        buf: IoBuf,
    },
    Write {
        fd: RawFd,
        offset: u64,
        buf: IoBuf,
    },
    Close(RawFd),
    Rename {
        dir: RawFd,
        from: CString,
        to: CString,
        flags: u32,
    },
    Unlink {
        dir: RawFd,
        path: CString,
    },
    Sync {
        fd: RawFd,
        data_only: bool,
    },
    Mkdir {
        dir: RawFd,
        path: CString,
        mode: u32,
    },
    Stat {
        dir: RawFd,
        path: CString,
    },
    /// The xattr operations are not offered here.
    Unsupported,
}

impl Op {
    /// What the trace records of the op: its kind, the path it names (relative to its
    /// directory), offset and length; not descriptors, whose numbers other threads move.
    fn trace_words(&self) -> [u64; 3] {
        let path = |p: &CString| xxhash_rust::xxh3::xxh3_64(p.as_bytes());
        match self {
            Op::Open { path: p, flags, .. } => [10, path(p), *flags as u64],
            Op::Read { offset, buf, .. } => [11, *offset, buf.len() as u64],
            Op::Write { offset, buf, .. } => [12, *offset, buf.len() as u64],
            Op::Close(_) => [13, 0, 0],
            Op::Rename { from, to, .. } => [14, path(from), path(to)],
            Op::Unlink { path: p, .. } => [15, path(p), 0],
            Op::Sync { data_only, .. } => [16, u64::from(*data_only), 0],
            Op::Mkdir { path: p, .. } => [17, path(p), 0],
            Op::Stat { path: p, .. } => [19, path(p), 0],
            Op::Unsupported => [18, 0, 0],
        }
    }

    /// The op, with the claim on its buffer for a read or a write.
    fn of(op: &FileOp<'_>, claim: Option<IoBuf>) -> Op {
        match *op {
            FileOp::OpenAt {
                dir,
                path,
                flags,
                mode,
                confined,
            } => Op::Open {
                dir,
                path: path.to_owned(),
                flags,
                mode,
                confined,
            },
            FileOp::ReadFd { fd, offset, .. } => Op::Read {
                fd,
                offset,
                buf: claim.expect("a read comes with its claim"),
            },
            FileOp::WriteFd { fd, offset, .. } => Op::Write {
                fd,
                offset,
                buf: claim.expect("a write comes with its claim"),
            },
            FileOp::Close { fd } => Op::Close(fd),
            FileOp::RenameAt {
                dir,
                from,
                to,
                flags,
            } => Op::Rename {
                dir,
                from: from.to_owned(),
                to: to.to_owned(),
                flags,
            },
            FileOp::UnlinkAt { dir, path } => Op::Unlink {
                dir,
                path: path.to_owned(),
            },
            FileOp::Fsync { fd, data_only } => Op::Sync { fd, data_only },
            FileOp::MkdirAt { dir, path, mode } => Op::Mkdir {
                dir,
                path: path.to_owned(),
                mode,
            },
            FileOp::Statx { dir, path } => Op::Stat {
                dir,
                path: path.to_owned(),
            },
            FileOp::SetXattr { .. } | FileOp::GetXattr { .. } => Op::Unsupported,
        }
    }

    fn is_data(&self) -> bool {
        matches!(self, Op::Read { .. } | Op::Write { .. })
    }
}

struct Pending {
    user_data: u64,
    op: Op,
    due: u64,
}

struct FilesBackend {
    /// The worker's wake-up eventfd, which a parked worker's wait returns on.
    wake: Arc<EventFd>,
    state: Arc<State>,
    buffers: Vec<Arc<Region>>,
    rng: Rng,
    queued: Vec<(u64, Op)>,
    pending: Vec<Pending>,
    /// What a completed `statx` wrote, until the layout takes it.
    values: HashMap<u64, Box<[u8]>>,
    round: u64,
    sq_entries: usize,
}

fn neg(e: Errno) -> i32 {
    -(e as i32)
}

impl FilesBackend {
    /// Runs `op` (faults first) and returns its result as the ring would: a count, an fd, 0,
    /// or -errno.
    fn execute(&mut self, user_data: u64, op: &Op) -> i32 {
        let f = self.state.faults();
        let faulty = op.is_data() || !f.data_only;
        if faulty && self.rng.hit(f.eio_ppm) {
            return neg(Errno::EIO);
        }
        match op {
            Op::Open {
                dir,
                path,
                flags,
                mode,
                confined,
            } => {
                if faulty && flags & nix::libc::O_CREAT != 0 && self.rng.hit(f.enospc_ppm) {
                    return neg(Errno::ENOSPC);
                }
                let opened = if *confined {
                    kvtier_sys::dir::open_confined(*dir, path, *flags, *mode)
                        .map(IntoRawFd::into_raw_fd)
                } else {
                    sys::open_at(*dir, path, *flags, *mode)
                };
                match opened {
                    Ok(fd) => {
                        let full = path_at(*dir, path);
                        let mut j = self.state.journal();
                        if let Ok(id) = sys::identity(fd) {
                            j.fds.insert(fd, (id, full.clone()));
                        }
                        if j.tracking && flags & nix::libc::O_CREAT != 0 {
                            j.unsynced.insert(full);
                        }
                        fd
                    }
                    Err(e) => neg(e),
                }
            }
            Op::Read { fd, offset, buf } => self.read(*fd, *offset, buf, f),
            Op::Write { fd, offset, buf } => self.write(*fd, *offset, buf, f),
            Op::Close(fd) => {
                self.state.journal().fds.remove(fd);
                sys::close(*fd).map_or_else(neg, |()| 0)
            }
            Op::Rename {
                dir,
                from,
                to,
                flags,
            } => match sys::rename_at(*dir, from, to, *flags) {
                Ok(()) => {
                    let (from, to) = (path_at(*dir, from), path_at(*dir, to));
                    self.state.stamp(&to);
                    let mut j = self.state.journal();
                    if j.tracking {
                        if j.unsynced.remove(&from) {
                            j.unsynced.insert(to.clone());
                        }
                        j.renamed.insert(to, from);
                    }
                    0
                }
                Err(e) => neg(e),
            },
            Op::Unlink { dir, path } => match sys::unlink_at(*dir, path) {
                Ok(()) => {
                    let full = path_at(*dir, path);
                    let mut j = self.state.journal();
                    j.unsynced.remove(&full);
                    j.renamed.remove(&full);
                    0
                }
                Err(e) => neg(e),
            },
            Op::Sync { fd, data_only } => match sys::sync(*fd, *data_only) {
                Ok(()) => {
                    let mut j = self.state.journal();
                    if let Some((_, path)) = j.fds.get(fd).cloned() {
                        if path.is_dir() {
                            j.renamed
                                .retain(|to, _| to.parent() != Some(path.as_path()));
                        } else {
                            j.unsynced.remove(&path);
                        }
                    }
                    0
                }
                Err(e) => neg(e),
            },
            Op::Mkdir { dir, path, mode } => {
                sys::mkdir_at(*dir, path, *mode).map_or_else(neg, |()| 0)
            }
            Op::Stat { dir, path } => match sys::statx_at(*dir, path) {
                Ok(buf) => {
                    self.values.insert(user_data, buf);
                    0
                }
                Err(e) => neg(e),
            },
            Op::Unsupported => neg(Errno::EOPNOTSUPP),
        }
    }

    fn read(&mut self, fd: RawFd, offset: u64, buf: &IoBuf, f: Faults) -> i32 {
        let mut data = vec![0u8; buf.len()];
        let n = match sys::pread(fd, &mut data, offset) {
            Ok(n) => n,
            Err(e) => return neg(e),
        };
        let n = if n > 512 && self.rng.hit(f.short_ppm) {
            (self.rng.below(n as u64 / 512) * 512) as usize
        } else {
            n
        };
        if n > 0 && self.rng.hit(f.read_flip_ppm) {
            let at = self.rng.below(n as u64) as usize;
            data[at] ^= 1 << self.rng.below(8);
            self.state.read_flips.fetch_add(1, Ordering::SeqCst);
        }
        self.state
            .strays
            .check(buf.region(), buf.offset(), n, IoKind::Read, || {
                format!("fd {fd}")
            });
        buf.device_write(0, &data[..n]);
        i32::try_from(n).expect("I/O sizes fit i32")
    }

    fn write(&mut self, fd: RawFd, offset: u64, buf: &IoBuf, f: Faults) -> i32 {
        let mut data = vec![0u8; buf.len()];
        self.state.strays.check(
            buf.region(),
            buf.offset(),
            data.len(),
            IoKind::Write,
            || format!("fd {fd}"),
        );
        buf.device_read(0, &mut data);
        if self.rng.hit(f.enospc_ppm) {
            return neg(Errno::ENOSPC);
        }
        let sectors = data.len() as u64 / 512;
        let (land, result) = if self.rng.hit(f.torn_write_ppm) {
            ((self.rng.below(sectors + 1) * 512) as usize, None)
        } else if sectors > 1 && self.rng.hit(f.short_ppm) {
            let n = (self.rng.below(sectors) * 512) as usize;
            (n, Some(n))
        } else {
            (data.len(), Some(data.len()))
        };
        let written = match sys::pwrite(fd, &data[..land], offset) {
            Ok(n) => n,
            Err(e) => return neg(e),
        };
        let mut j = self.state.journal();
        if j.tracking {
            if let Some((_, path)) = j.fds.get(&fd).cloned() {
                j.unsynced.insert(path);
            }
        }
        match result {
            Some(_) => i32::try_from(written).expect("I/O sizes fit i32"),
            None => neg(Errno::EIO),
        }
    }
}

impl FileOpQueue for FilesBackend {
    fn push_file(
        &mut self,
        user_data: u64,
        op: &FileOp<'_>,
        buf: Option<(u16, IoBuf)>,
        class: IoClass,
    ) -> bool {
        let _ = class;
        if self.queued.len() + self.pending.len() >= self.sq_entries * 2 {
            return false;
        }
        if let Some((region, b)) = &buf {
            assert!(
                Arc::ptr_eq(&self.buffers[usize::from(*region)], b.region()),
                "a claim on another buffer than the op's"
            );
        }
        let op = Op::of(op, buf.map(|(_, b)| b));
        let [a, b, c] = op.trace_words();
        super::trace(&[4, user_data, a, b, c]);
        self.queued.push((user_data, op));
        true
    }

    fn take_file_value(&mut self, user_data: u64) -> Option<Box<[u8]>> {
        self.values.remove(&user_data)
    }
}

impl IoBackend for FilesBackend {
    fn blocks(&mut self) -> Option<&mut dyn BlockQueue> {
        None
    }

    fn files(&mut self) -> Option<&mut dyn FileOpQueue> {
        Some(self)
    }

    fn enters(&self) -> u64 {
        self.round
    }

    fn submit(&mut self, wait: bool) -> std::io::Result<()> {
        self.round += 1;
        let max_delay = u64::from(self.state.faults().max_delay_rounds);
        for (user_data, op) in self.queued.drain(..) {
            let delay = if max_delay == 0 {
                0
            } else {
                self.rng.below(max_delay + 1)
            };
            self.pending.push(Pending {
                user_data,
                op,
                due: self.round + delay,
            });
        }
        if wait {
            // Waiting: time jumps to the earliest due completion.
            if let Some(earliest) = self.pending.iter().map(|p| p.due).min() {
                self.round = self.round.max(earliest);
            }
        }
        Ok(())
    }

    fn sim_wake(&mut self) -> bool {
        if self.wake.drain() > 0 {
            return true;
        }
        if self.state.hung.load(Ordering::SeqCst) {
            return false;
        }
        // The wait returns with the earliest completion.
        match self.pending.iter().map(|p| p.due).min() {
            Some(earliest) => {
                self.round = self.round.max(earliest);
                true
            }
            None => false,
        }
    }

    fn complete(&mut self, out: &mut Vec<Completion>) {
        if self.state.hung.load(Ordering::SeqCst) {
            return;
        }
        let round = self.round;
        let (ready, rest): (Vec<Pending>, Vec<Pending>) =
            self.pending.drain(..).partition(|p| p.due <= round);
        self.pending = rest;
        let mut ready = ready;
        if self.state.faults().reorder {
            for i in (1..ready.len()).rev() {
                let j = self.rng.below(i as u64 + 1) as usize;
                ready.swap(i, j);
            }
        }
        for p in ready {
            let result = self.execute(p.user_data, &p.op);
            // An open's result is a descriptor, whose number other threads move: traced as
            // success only.
            let traced = if matches!(p.op, Op::Open { .. }) {
                result.min(0)
            } else {
                result
            };
            super::trace(&[3, p.user_data, traced as u64]);
            out.push(Completion {
                user_data: p.user_data,
                result,
            });
        }
    }

    fn in_flight(&self) -> usize {
        self.queued.len() + self.pending.len()
    }

    fn describe(&self) -> String {
        format!("sim files (seed {})", self.state.seed)
    }
}
