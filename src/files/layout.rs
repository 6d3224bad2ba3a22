//! The `files` layout as a worker's [`Layout`]: each block a small state machine of io_uring
//! file operations, so a job's blocks are all in flight at once and the worker never blocks its
//! ring on a system call. The worker's scheduler is the slab's (loads first, stores capped while
//! loads wait, stores chunked). Here: the op table, the index and the `Layout` seam; the load
//! steps are in [`super::load`], stores in [`super::store`], eviction and demotion in
//! [`super::evict`], lookups' probes in [`super::probe`].
//!
//! ```text
//! load:  openat2 ─► fgetxattr crc ─► read ─► (verify crc) ─► close   short or corrupt ─► unlink
//! store: reserve bytes ─► openat2 tmp (O_EXCL)
//!          [ENOENT: openat2 <hhh> O_PATH (ENOENT: mkdirat <hhh>) ─► mkdirat <hh>_g<g> at it]
//!        ─► fsetxattr crc ─► write (one write; chunks while loads wait)
//!        ─► [fdatasync] ─► close ─► renameat NOREPLACE (EEXIST = another writer won: success)
//! evict: unlink ─► release bytes
//! ```
//!
//! Every path is relative to the device's open data directory and every open is `openat2`
//! with `RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH`: a symlink planted anywhere below the configured
//! root, or a FIFO, socket, device node or directory at a block path, fails the key with
//! [`KeyFailure::Refused`] (loads; counted in `files_refused`) and is never read or followed.
//! Renames, unlinks and mkdirs never follow a final symlink; the directories they resolve were
//! opened or created confined just before (a swap of a directory for a symlink in between needs
//! write access to the tree, which `dir_mode` 0700 gives to no one else).
//!
//! A load result is published when its read completes; the close follows as a trailing op. Keys
//! this worker has not indexed are still tried on load (another process may have published
//! them), and indexed when found. The crc32c xattr is read and set on the ring too
//! (`FGETXATTR`/`FSETXATTR`, Linux 5.19+; on older kernels they are synchronous calls on an fd
//! the ring opened, inode metadata without data I/O). Invariants: a file a load is reading is never evicted by this worker; a
//! store's bytes are reserved in the shared usage counter before its temp file exists and
//! released if it fails; every temp file is closed and removed on every failure path.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use nix::fcntl::OFlag;

use crate::files::device::{c_path, FilesDevice, ScannedFile};
use crate::io::{BufRef, FileOp, IoClass};
use crate::job::{JobState, KeyFailure};
use crate::key::{Key, KeyMap};
use crate::worker::{
    own_key, Chunks, Core, Layout, LayoutOp, Start, TableOp, BUF_REGION, BUF_STAGING,
};

pub(super) const RENAME_NOREPLACE: u32 = 1;
/// Blocks evicted at once when a store finds the device full.
pub(super) const EVICT_BATCH: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    Writing,
    Valid,
}

#[derive(Clone, Copy)]
pub(crate) struct Entry {
    pub dev: u16,
    pub state: State,
    pub pins: u32,
    pub tick: u64,
    /// Whether its bytes are in the shared usage counter (written or scanned by kvtier).
    pub counted: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    Open,
    /// `fgetxattr` of the block's crc32c on the ring (5.19+; else a call after the open).
    GetXattr,
    Read,
    Close,
    OpenTmp,
    /// A confined `O_PATH` open of `<hhh>`, the parent of the temp file's directory, when the
    /// temp file's directory is missing (first block there); its fd is the op's `fd` until
    /// `MkdirLeaf` completes.
    OpenParent,
    /// `mkdirat(<hhh> fd, "<hh>_g<g>")`.
    MkdirLeaf,
    /// `mkdirat` of `<hhh>` below the data directory, when it is missing too.
    MkdirParent,
    /// `fsetxattr` of the block's crc32c on the ring (5.19+; else a call after the open).
    SetXattr,
    Write,
    Sync,
    CloseTmp,
    Rename,
    UnlinkTmp,
    Unlink,
    /// `sync = "data"`: after the rename, the directory is opened, fsynced (the new name is
    /// durable; the store reports then) and closed, all on the ring.
    OpenDir,
    SyncDir,
    CloseDir,
    /// A probe's `statx` of the block path (see [`super::probe`]).
    Stat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Load,
    Store,
    /// Removing a block: an eviction, or a short/corrupt file found by a load.
    Remove,
    /// Finding out whether a block not indexed here exists (a lookup's question).
    Probe,
}

pub(crate) struct Op {
    pub kind: Kind,
    pub step: Step,
    pub job: Option<Arc<JobState>>,
    pub item: u32,
    pub key: Option<Key>,
    pub dev: u16,
    pub block: u32,
    pub fd: i32,
    pub dest: PathBuf,
    pub tmp: PathBuf,
    pub crc: Option<u32>,
    /// The writes of a store: the whole block, or chunks when loads were waiting as it started
    /// writing (so a load can overtake it). A new file is extended by each write, and
    /// extending O_DIRECT writes serialize in the file system: one write is cheapest when
    /// nothing waits.
    pub chunks: Chunks,
    /// The store failed: after closing, its temp file is removed.
    pub failed: bool,
    /// Bytes reserved in (or, for a removal, to release from) the usage counter.
    pub bytes: u64,
    /// The key's outcome has been reported; the op only cleans up now.
    pub resolved: bool,
    pub mkdir_tried: bool,
    /// The leaf's parent `<hhh>` was made once already: a second ENOENT on the leaf (a
    /// dangling symlink at `<hhh>`, or a cleaner racing) fails the store instead of looping.
    pub mkdir_parent_tried: bool,
    pub retried: bool,
    /// The temp file exists on disk (created, not yet renamed or removed).
    pub tmp_exists: bool,
    /// A removal that first reads the file into this staging slot (demotion to S3).
    pub staging: Option<u32>,
    pub started: Instant,
    /// A probe: the generation of its question in `WorkerShared::unindexed`.
    pub generation: u64,
}

impl Op {
    /// The temp file's directory `<data>/<hhh>/<hh>_g<g>`.
    pub fn leaf_dir(&self) -> &Path {
        self.tmp.parent().unwrap_or(&self.tmp)
    }

    /// The directory a `MkdirLeaf` / `MkdirParent` / `OpenParent` step creates or opens: the
    /// leaf, or its parent `<hhh>`.
    pub fn mkdir_target(&self) -> &Path {
        let leaf = self.leaf_dir();
        match self.step {
            Step::MkdirParent | Step::OpenParent => leaf.parent().unwrap_or(leaf),
            _ => leaf,
        }
    }
}

impl TableOp for Op {
    fn clear(&mut self) {
        self.job = None;
    }
}

impl LayoutOp for Op {
    fn writing(&mut self) -> Option<&mut Chunks> {
        (self.step == Step::Write).then_some(&mut self.chunks)
    }

    fn device(&self) -> usize {
        self.dev as usize
    }
}

impl Op {
    pub fn empty() -> Op {
        Op {
            kind: Kind::Load,
            step: Step::Open,
            job: None,
            item: 0,
            key: None,
            dev: 0,
            block: 0,
            fd: -1,
            dest: PathBuf::new(),
            tmp: PathBuf::new(),
            crc: None,
            chunks: Chunks::default(),
            failed: false,
            bytes: 0,
            resolved: false,
            mkdir_tried: false,
            mkdir_parent_tried: false,
            retried: false,
            tmp_exists: false,
            staging: None,
            started: Instant::now(),
            generation: 0,
        }
    }
}

pub(crate) struct FilesLayout {
    pub(super) id: usize,
    pub(super) devs: Vec<Arc<FilesDevice>>,
    pub(super) index: KeyMap<Entry>,
    /// LRU order: tick → key, oldest first.
    pub(super) lru: BTreeMap<u64, Key>,
    pub(super) tick: u64,
    /// Ops whose next step could not be pushed (SQ full).
    pub(super) stalled: VecDeque<u32>,
    pub(super) removals_in_flight: usize,
    pub(super) rng: u64,
    /// Lookups' questions not started yet (key, generation), and probe ops in flight.
    pub(super) probes: VecDeque<(Key, u64)>,
    pub(super) probes_in_flight: usize,
}

impl FilesLayout {
    /// Worker `id`'s layout over `devices`, indexing the files the scan at open found for it.
    pub fn new(
        id: usize,
        devices: Vec<Arc<FilesDevice>>,
        scanned: Vec<ScannedFile>,
        me: &crate::worker::WorkerShared,
    ) -> FilesLayout {
        let mut w = FilesLayout {
            id,
            devs: devices,
            index: KeyMap::default(),
            lru: BTreeMap::new(),
            tick: 0,
            stalled: VecDeque::new(),
            removals_in_flight: 0,
            probes: VecDeque::new(),
            probes_in_flight: 0,
            rng: (u64::from(std::process::id()) << 32)
                ^ (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(7, |d| d.as_nanos() as u64),
        };
        // Seed the LRU from file times: oldest first.
        let mut scanned = scanned;
        scanned.sort_by_key(|f| f.last_use_secs);
        let devices = w.devs.len();
        for f in scanned {
            let dev = f.key.device(devices) as u16;
            w.tick += 1;
            w.index.insert(
                f.key,
                Entry {
                    dev,
                    state: State::Valid,
                    pins: 0,
                    tick: w.tick,
                    counted: true,
                },
            );
            w.lru.insert(w.tick, f.key);
        }
        let n = w.index.len() as u64;
        me.metrics.recovered_blocks.store(n, Ordering::Relaxed);
        for e in w.index.values() {
            me.metrics
                .dev(e.dev as usize)
                .blocks_stored
                .fetch_add(1, Ordering::Relaxed);
        }
        w
    }

    /// Publishes every block the scan at open found (before the worker starts).
    pub fn publish_scanned(&self, core: &mut Core<Op>) {
        for key in self.index.keys() {
            core.publisher.insert(key);
        }
    }

    /// Blocks in the index (after the scan at open).
    pub fn indexed(&self) -> u64 {
        self.index.len() as u64
    }

    // ---------------------------------------------------------------------------------------
    // Ops table

    pub(super) fn alloc(core: &mut Core<Op>, kind: Kind) -> Option<u32> {
        core.ops.alloc(Op {
            kind,
            ..Op::empty()
        })
    }

    pub(super) fn release(core: &mut Core<Op>, idx: u32) {
        core.ops.release(idx);
    }

    /// Pushes the SQE for `idx`'s current step; on a full SQ parks the op in `stalled`.
    pub(super) fn push_step(&mut self, core: &mut Core<Op>, idx: u32) {
        if !self.try_push_step(core, idx) {
            self.stalled.push_back(idx);
        }
    }

    pub(super) fn try_push_step(&mut self, core: &mut Core<Op>, idx: u32) -> bool {
        let op = &core.ops[idx as usize];
        let dev = &self.devs[op.dev as usize];
        let direct = if dev.direct { O_DIRECT } else { 0 };
        let class = match op.kind {
            Kind::Load => IoClass::Load,
            Kind::Store | Kind::Remove => IoClass::Store,
            Kind::Probe => IoClass::Meta,
        };
        let user_data = core.ops.user_data(idx, 0);
        let at = dev.dir_fd();
        let dest = dev.rel(&op.dest);
        let tmp = dev.rel(&op.tmp);
        let block_buf = match op.staging {
            Some(slot) => BufRef {
                region: BUF_STAGING,
                offset: slot as usize * core.block_bytes as usize,
                len: core.block_bytes as u32,
            },
            None => BufRef {
                region: BUF_REGION,
                offset: op.block as usize * core.block_bytes as usize,
                len: core.block_bytes as u32,
            },
        };
        let crc_bytes = op.crc.unwrap_or(0).to_le_bytes();
        let file_op = match op.step {
            Step::GetXattr => FileOp::GetXattr {
                fd: op.fd,
                name: &dev.xattr_name,
                len: 4,
            },
            Step::SetXattr => FileOp::SetXattr {
                fd: op.fd,
                name: &dev.xattr_name,
                value: &crc_bytes,
            },
            // O_NONBLOCK: a FIFO planted at the path must not block the ring (it is refused
            // once open); no effect on a regular file.
            Step::Open => FileOp::OpenAt {
                dir: at,
                path: &dest,
                flags: O_RDONLY | O_NONBLOCK | O_NOCTTY | direct,
                mode: 0,
                confined: true,
            },
            Step::Read => FileOp::ReadFd {
                fd: op.fd,
                offset: 0,
                buf: block_buf,
            },
            Step::Close | Step::CloseTmp | Step::CloseDir => FileOp::Close { fd: op.fd },
            Step::SyncDir => FileOp::Fsync {
                fd: op.fd,
                data_only: false,
            },
            Step::OpenTmp => FileOp::OpenAt {
                dir: at,
                path: &tmp,
                flags: O_CREAT | O_EXCL | O_WRONLY | direct,
                mode: dev.file_mode,
                confined: true,
            },
            Step::Sync => FileOp::Fsync {
                fd: op.fd,
                data_only: true,
            },
            // Both names are in the leaf directory the temp file was created in (confined).
            Step::Rename => FileOp::RenameAt {
                dir: at,
                from: &tmp,
                to: &dest,
                flags: RENAME_NOREPLACE,
            },
            Step::UnlinkTmp => FileOp::UnlinkAt {
                dir: at,
                path: &tmp,
            },
            Step::Unlink => FileOp::UnlinkAt {
                dir: at,
                path: &dest,
            },
            Step::Stat => FileOp::Statx {
                dir: at,
                path: &dest,
            },
            Step::OpenDir | Step::OpenParent | Step::MkdirParent | Step::MkdirLeaf => {
                return self.push_dir_step(core, idx, class);
            }
            Step::Write => unreachable!("writes are pushed chunk by chunk"),
        };
        core.backend.push_file(user_data, &file_op, class)
    }

    /// The directory steps of `idx`: opening the block's directory (to fsync it) or `<hhh>`,
    /// and making `<hhh>` or the leaf.
    fn push_dir_step(&self, core: &mut Core<Op>, idx: u32, class: IoClass) -> bool {
        let op = &core.ops[idx as usize];
        let dev = &self.devs[op.dev as usize];
        let at = dev.dir_fd();
        let user_data = core.ops.user_data(idx, 0);
        let parent = || dev.rel(op.leaf_dir().parent().unwrap_or(&op.tmp));
        // Opens are confined; `<hhh>` is made below the data directory (one component:
        // mkdirat never follows a final symlink), the leaf `<hh>_g<g>` below the `<hhh>` the
        // confined `OpenParent` opened: no component is resolved through a symlink.
        let (dir, path, open_flags) = match op.step {
            Step::OpenDir => (
                at,
                dev.rel(op.dest.parent().unwrap_or(&op.dest)),
                Some(O_RDONLY | O_DIRECTORY),
            ),
            Step::OpenParent => (at, parent(), Some(O_PATH | O_DIRECTORY)),
            Step::MkdirParent => (at, parent(), None),
            Step::MkdirLeaf => (
                op.fd,
                c_path(Path::new(op.leaf_dir().file_name().unwrap_or_default())),
                None,
            ),
            _ => unreachable!("not a directory step"),
        };
        let file_op = match open_flags {
            Some(flags) => FileOp::OpenAt {
                dir,
                path: &path,
                flags,
                mode: 0,
                confined: true,
            },
            None => FileOp::MkdirAt {
                dir,
                path: &path,
                mode: dev.dir_mode,
            },
        };
        core.backend.push_file(user_data, &file_op, class)
    }

    fn push_stalled(&mut self, core: &mut Core<Op>) -> bool {
        let mut any = false;
        while let Some(&idx) = self.stalled.front() {
            if !self.try_push_step(core, idx) {
                break;
            }
            self.stalled.pop_front();
            any = true;
        }
        any
    }

    fn touch_key(&mut self, key: Key) {
        if let Some(e) = self.index.get_mut(&key) {
            self.lru.remove(&e.tick);
            self.tick += 1;
            e.tick = self.tick;
            self.lru.insert(self.tick, key);
        }
    }

    pub(super) fn unindex(&mut self, core: &mut Core<Op>, key: &Key) -> Option<Entry> {
        let e = self.index.remove(key)?;
        self.lru.remove(&e.tick);
        if e.state == State::Valid {
            core.publisher.remove(key);
            core.me
                .metrics
                .dev(e.dev as usize)
                .blocks_stored
                .fetch_sub(1, Ordering::Relaxed);
        }
        Some(e)
    }

    pub(super) fn publish(&mut self, core: &mut Core<Op>, key: Key, dev: u16, counted: bool) {
        self.tick += 1;
        let tick = self.tick;
        let prev = self.index.insert(
            key,
            Entry {
                dev,
                state: State::Valid,
                pins: 0,
                tick,
                counted,
            },
        );
        if let Some(p) = prev {
            self.lru.remove(&p.tick);
            if p.state == State::Valid {
                core.me
                    .metrics
                    .dev(p.dev as usize)
                    .blocks_stored
                    .fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.lru.insert(tick, key);
        core.publisher.insert(&key);
        core.me
            .metrics
            .dev(dev as usize)
            .blocks_stored
            .fetch_add(1, Ordering::Relaxed);
    }
}

impl Layout for FilesLayout {
    type Op = Op;

    fn start_load(&mut self, core: &mut Core<Op>, job: &Arc<JobState>, item: usize) -> Start {
        let key = job.job.keys[item];
        let d = key.device(self.devs.len());
        if core.device_failed(d) {
            core.resolve_load(job, item, KeyFailure::Miss);
            return Start::Resolved;
        }
        let dest = self.devs[d].path_of(&key);
        let entry = self.index.get(&key).copied();
        let Some(dest) = dest.filter(|_| !entry.is_some_and(|e| e.state == State::Writing)) else {
            // Not a files-layout key (nothing to look for), or its store is still running.
            let reason = if entry.is_some() {
                KeyFailure::NotReady
            } else {
                KeyFailure::Miss
            };
            core.me.metrics.loads_failed.fetch_add(1, Ordering::Relaxed);
            job.fail(&core.shared, item, reason, String::new());
            return Start::Resolved;
        };
        let Some(idx) = Self::alloc(core, Kind::Load) else {
            return Start::Blocked;
        };
        let op = &mut core.ops[idx as usize];
        op.step = Step::Open;
        op.job = Some(Arc::clone(job));
        op.item = item as u32;
        op.key = Some(key);
        op.dev = d as u16;
        op.block = job.job.blocks[item];
        op.dest = dest;
        if !self.try_push_step(core, idx) {
            Self::release(core, idx);
            return Start::Blocked;
        }
        if let Some(e) = self.index.get_mut(&key) {
            e.pins += 1;
        }
        self.touch_key(key);
        Start::Started
    }

    fn start_store(
        &mut self,
        core: &mut Core<Op>,
        job: &Arc<JobState>,
        item: usize,
        retried: bool,
    ) -> Start {
        self.begin_store(core, job, item, retried)
    }

    fn push_chunk(
        &mut self,
        core: &mut Core<Op>,
        idx: u32,
        chunk: u16,
        start: u64,
        len: u64,
    ) -> bool {
        let op = &core.ops[idx as usize];
        let file_op = FileOp::WriteFd {
            fd: op.fd,
            offset: start,
            buf: BufRef {
                region: BUF_REGION,
                offset: op.block as usize * core.block_bytes as usize + start as usize,
                len: len as u32,
            },
        };
        core.backend
            .push_file(core.ops.user_data(idx, chunk), &file_op, IoClass::Store)
    }

    fn on_written(&mut self, core: &mut Core<Op>, idx: u32, failure: Option<(KeyFailure, String)>) {
        self.data_written(core, idx, failure);
    }

    fn on_complete(&mut self, core: &mut Core<Op>, idx: u32, result: i32) {
        match core.ops[idx as usize].step {
            Step::Open => self.on_open(core, idx, result),
            Step::GetXattr => self.on_get_xattr(core, idx, result),
            Step::SetXattr => self.on_set_xattr(core, idx, result),
            Step::Read => self.on_read(core, idx, result),
            Step::Close => self.on_close(core, idx),
            Step::OpenTmp => self.on_open_tmp(core, idx, result),
            Step::OpenParent => self.on_open_parent(core, idx, result),
            Step::MkdirLeaf | Step::MkdirParent => self.on_mkdir(core, idx, result),
            Step::Sync => self.on_sync(core, idx, result),
            Step::CloseTmp => self.on_close_tmp(core, idx, result),
            Step::Rename => self.on_rename(core, idx, result),
            Step::UnlinkTmp => Self::release(core, idx),
            Step::Unlink => self.on_unlink(core, idx, result),
            Step::OpenDir | Step::SyncDir | Step::CloseDir => self.on_dir_step(core, idx, result),
            Step::Stat => self.on_stat(core, idx, result),
            Step::Write => unreachable!("store writes are the worker's (LayoutOp::writing)"),
        }
    }

    fn touch(&mut self, key: Key) {
        self.touch_key(key);
    }

    fn keys(&self) -> Vec<Key> {
        self.index
            .iter()
            .filter(|(_, e)| e.state == State::Valid)
            .map(|(k, _)| *k)
            .collect()
    }

    fn probe(&mut self, core: &mut Core<Op>, keys: Vec<(Key, u64)>) {
        self.queue_probes(core, keys);
    }

    fn unstall(&mut self, core: &mut Core<Op>) -> bool {
        self.push_stalled(core)
    }

    fn background(&mut self, core: &mut Core<Op>) -> bool {
        self.start_probes(core)
    }

    fn idle(&self) -> bool {
        self.stalled.is_empty() && self.probes_idle()
    }

    fn overdue_keys(&self, core: &Core<Op>, idx: u32) -> Vec<(Arc<JobState>, usize, bool)> {
        let op = &core.ops[idx as usize];
        match op.kind {
            Kind::Load | Kind::Store => own_key(op.job.as_ref(), op.item),
            Kind::Remove | Kind::Probe => Vec::new(),
        }
    }

    fn device_failed(&mut self, core: &mut Core<Op>, d: usize) {
        let keys: Vec<Key> = self
            .index
            .iter()
            .filter(|(_, e)| e.dev as usize == d && e.state == State::Valid && e.pins == 0)
            .map(|(k, _)| *k)
            .collect();
        for key in &keys {
            self.unindex(core, key);
        }
        if !keys.is_empty() {
            core.shared.events.push(keys, true);
        }
    }

    fn describe_op(&self, core: &Core<Op>, idx: u32) -> String {
        let op = &core.ops[idx as usize];
        let what = match op.kind {
            Kind::Load => "load",
            Kind::Store => "store",
            Kind::Remove => "removal",
            Kind::Probe => "lookup",
        };
        format!(
            "devices[{}] {}: {what} of {} (at step {:?})",
            op.dev,
            self.devs[op.dev as usize].data_dir.display(),
            op.dest.display(),
            op.step
        )
    }

    fn device_name(&self, d: usize) -> String {
        format!("devices[{d}] {}", self.devs[d].data_dir.display())
    }

    #[cfg(any(test, feature = "sim"))]
    fn check_quiet(&self, _core: &Core<Op>) -> Result<(), String> {
        if self.removals_in_flight != 0
            || self.index.values().any(|e| e.pins != 0)
            || !self.probes_idle()
        {
            return Err(format!(
                "{} removals in flight, pins left, or {} probes queued and {} in flight",
                self.removals_in_flight,
                self.probes.len(),
                self.probes_in_flight
            ));
        }
        Ok(())
    }
}

const O_RDONLY: i32 = OFlag::O_RDONLY.bits();
const O_WRONLY: i32 = OFlag::O_WRONLY.bits();
const O_CREAT: i32 = OFlag::O_CREAT.bits();
const O_EXCL: i32 = OFlag::O_EXCL.bits();
const O_DIRECT: i32 = OFlag::O_DIRECT.bits();
const O_DIRECTORY: i32 = OFlag::O_DIRECTORY.bits();
const O_NONBLOCK: i32 = OFlag::O_NONBLOCK.bits();
const O_NOCTTY: i32 = OFlag::O_NOCTTY.bits();
const O_PATH: i32 = OFlag::O_PATH.bits();
