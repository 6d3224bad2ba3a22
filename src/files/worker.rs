//! The worker of the `files` layout: the same queues and priorities as the slab worker (loads
//! first, stores capped while loads wait, stores chunked), with each block a small state machine
//! of io_uring file operations, so a job's blocks are all in flight at once and the worker never
//! blocks its ring on a system call.
//!
//! ```text
//! load:  openat ─► read ─► (verify crc from xattr) ─► close        short or corrupt ─► unlink
//! store: reserve bytes ─► openat tmp (O_EXCL) [ENOENT: mkdirat <hh>_g<g> (and <hhh>), again]
//!        ─► fsetxattr crc ─► write (one write; chunks while loads wait)
//!        ─► [fdatasync] ─► close ─► renameat NOREPLACE (EEXIST = another writer won: success)
//! evict: unlink ─► release bytes
//! ```
//!
//! A load result is published when its read completes; the close follows as a trailing op. Keys
//! this worker has not indexed are still tried on load (another process may have published
//! them), and indexed when found. xattr get/set are synchronous inode-metadata calls on an fd
//! the ring opened. Invariants: a file a load is reading is never evicted by this worker; a
//! store's bytes are reserved in the shared usage counter before its temp file exists and
//! released if it fails; every temp file is closed and removed on every failure path.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Receiver;
use nix::fcntl::OFlag;

use crate::config::{SchedulerConfig, SyncMode};
use crate::files::device::{c_path, FilesDevice, ScannedFile};
use crate::files::mapper::FileMapper;
use crate::io::{BufRef, Completion, FileOp, IoBackend, IoClass, Region};
use crate::job::{JobKind, JobState, KeyFailure, Shared};
use crate::key::{Key, KeyMap};
use crate::shard::{
    region_crc, submit_or_sleep, Demote, Msg, OpTable, ShardShared, TableOp, WorkQueue, BUF_REGION,
    BUF_STAGING,
};
use crate::Errno;

const RENAME_NOREPLACE: u32 = 1;
/// Mode of the fan-out directories a store creates (before the umask), as `mkdir -p` does.
const DIR_MODE: u32 = 0o777;
/// Blocks evicted at once when a store finds the device full.
const EVICT_BATCH: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Writing,
    Valid,
}

#[derive(Clone, Copy)]
struct Entry {
    dev: u16,
    state: State,
    pins: u32,
    tick: u64,
    /// Whether its bytes are in the shared usage counter (written or scanned by kvtier).
    counted: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Open,
    Read,
    Close,
    OpenTmp,
    /// `mkdirat` of the temp file's directory `<hhh>/<hh>_g<g>` (first block there).
    MkdirLeaf,
    /// `mkdirat` of `<hhh>`, when the leaf's parent is missing too.
    MkdirParent,
    Write,
    Sync,
    CloseTmp,
    Rename,
    UnlinkTmp,
    Unlink,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Load,
    Store,
    /// Removing a block: an eviction, or a short/corrupt file found by a load.
    Remove,
}

struct Op {
    kind: Kind,
    step: Step,
    job: Option<Arc<JobState>>,
    item: u32,
    key: Option<Key>,
    dev: u16,
    block: u32,
    fd: i32,
    dest: PathBuf,
    tmp: PathBuf,
    crc: Option<u32>,
    /// Bytes per write of this store: the whole block, or `chunk_bytes` when loads were
    /// waiting as it started writing (so a load can overtake it). A new file is extended by
    /// each write, and extending O_DIRECT writes serialize in the file system: one write is
    /// cheapest when nothing waits.
    chunk_len: u64,
    chunks_total: u16,
    chunks_issued: u16,
    chunks_done: u16,
    failure: Option<(KeyFailure, String)>,
    /// Bytes reserved in (or, for a removal, to release from) the usage counter.
    bytes: u64,
    /// The key's outcome has been reported; the op only cleans up now.
    resolved: bool,
    mkdir_tried: bool,
    /// The leaf's parent `<hhh>` was made once already: a second ENOENT on the leaf (a
    /// dangling symlink at `<hhh>`, or a cleaner racing) fails the store instead of looping.
    mkdir_parent_tried: bool,
    retried: bool,
    /// The temp file exists on disk (created, not yet renamed or removed).
    tmp_exists: bool,
    /// A removal that first reads the file into this staging slot (demotion to S3).
    staging: Option<u32>,
    started: Instant,
}

impl Op {
    /// The directory a `MkdirLeaf` / `MkdirParent` step creates: the temp file's directory
    /// `<hhh>/<hh>_g<g>`, or its parent `<hhh>`.
    fn mkdir_target(&self) -> &Path {
        let leaf = self.tmp.parent().unwrap_or(&self.tmp);
        match self.step {
            Step::MkdirParent => leaf.parent().unwrap_or(leaf),
            _ => leaf,
        }
    }
}

impl TableOp for Op {
    fn clear(&mut self) {
        self.job = None;
    }
}

impl Op {
    fn empty() -> Op {
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
            chunk_len: 0,
            chunks_total: 0,
            chunks_issued: 0,
            chunks_done: 0,
            failure: None,
            bytes: 0,
            resolved: false,
            mkdir_tried: false,
            mkdir_parent_tried: false,
            retried: false,
            tmp_exists: false,
            staging: None,
            started: Instant::now(),
        }
    }
}

pub(crate) struct FilesParams {
    pub id: usize,
    pub backend: Box<dyn IoBackend>,
    pub region: Arc<Region>,
    pub rx: Receiver<Msg>,
    pub shared: Arc<Shared>,
    pub me: Arc<ShardShared>,
    pub sched: SchedulerConfig,
    pub block_bytes: u64,
    pub ring_entries: usize,
    pub devices: Vec<Arc<FilesDevice>>,
    /// `s3.write = "on_evict"`: evicted files are read into staging before they are removed.
    pub demote: Option<Demote>,
}

pub(crate) struct FilesWorker {
    id: usize,
    backend: Box<dyn IoBackend>,
    region: Arc<Region>,
    rx: Receiver<Msg>,
    shared: Arc<Shared>,
    me: Arc<ShardShared>,
    sched: SchedulerConfig,
    block_bytes: u64,
    chunk_bytes: u64,
    devs: Vec<Arc<FilesDevice>>,
    index: KeyMap<Entry>,
    /// LRU order: tick → key, oldest first.
    lru: BTreeMap<u64, Key>,
    tick: u64,
    ops: OpTable<Op>,
    loads: WorkQueue,
    stores: WorkQueue,
    /// Stores to try once more after evicting (ENOSPC).
    retry: VecDeque<(Arc<JobState>, usize)>,
    store_issuing: VecDeque<u32>,
    /// Ops whose next step could not be pushed (SQ full).
    stalled: VecDeque<u32>,
    loads_in_flight: usize,
    store_bytes_in_flight: u64,
    removals_in_flight: usize,
    stopping: bool,
    completions: Vec<Completion>,
    rng: u64,
    error_logs: u32,
    demote: Option<Demote>,
}

impl FilesWorker {
    pub fn new(p: FilesParams, scanned: Vec<ScannedFile>) -> FilesWorker {
        let chunk_floor = p.block_bytes.div_ceil(255).div_ceil(4096) * 4096;
        let chunk_bytes = p
            .sched
            .store_chunk_bytes
            .max(chunk_floor)
            .min(p.block_bytes);
        let capacity = p.ring_entries * 2 + p.sched.load_inflight_max + 64;
        let mut w = FilesWorker {
            id: p.id,
            backend: p.backend,
            region: p.region,
            rx: p.rx,
            shared: p.shared,
            me: p.me,
            sched: p.sched,
            block_bytes: p.block_bytes,
            chunk_bytes,
            devs: p.devices,
            index: KeyMap::default(),
            lru: BTreeMap::new(),
            tick: 0,
            ops: OpTable::new(capacity, Op::empty),
            loads: WorkQueue::default(),
            stores: WorkQueue::default(),
            retry: VecDeque::new(),
            store_issuing: VecDeque::new(),
            stalled: VecDeque::new(),
            loads_in_flight: 0,
            store_bytes_in_flight: 0,
            removals_in_flight: 0,
            stopping: false,
            completions: Vec::with_capacity(p.ring_entries * 2),
            rng: (u64::from(std::process::id()) << 32)
                ^ (p.id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(7, |d| d.as_nanos() as u64),
            error_logs: 0,
            demote: p.demote,
        };
        // Seed the LRU from file times: oldest first.
        let mut scanned = scanned;
        scanned.sort_by_key(|f| f.last_use_secs);
        let devices = w.devs.len();
        let mut published =
            w.me.published
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
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
            published.insert(f.key);
        }
        drop(published);
        let n = w.index.len() as u64;
        w.me.metrics.recovered_blocks.store(n, Ordering::Relaxed);
        w.me.metrics.blocks_stored.store(n, Ordering::Relaxed);
        w
    }

    /// Blocks in the index (after the scan at open).
    pub fn indexed(&self) -> u64 {
        self.index.len() as u64
    }

    pub fn describe(&self) -> String {
        self.backend.describe()
    }

    // ---------------------------------------------------------------------------------------
    // Ops table

    fn alloc(&mut self, kind: Kind) -> Option<u32> {
        self.ops.alloc(Op {
            kind,
            ..Op::empty()
        })
    }

    fn release(&mut self, idx: u32) {
        self.ops.release(idx);
    }

    /// Pushes the SQE for `idx`'s current step; on a full SQ parks the op in `stalled`.
    fn push_step(&mut self, idx: u32) {
        if !self.try_push_step(idx) {
            self.stalled.push_back(idx);
        }
    }

    fn try_push_step(&mut self, idx: u32) -> bool {
        let op = &self.ops[idx as usize];
        let dev = &self.devs[op.dev as usize];
        let direct = if dev.direct { O_DIRECT } else { 0 };
        let class = match op.kind {
            Kind::Load => IoClass::Load,
            Kind::Store | Kind::Remove => IoClass::Store,
        };
        let user_data = self.ops.user_data(idx, 0);
        let dest = c_path(&op.dest);
        let tmp = c_path(&op.tmp);
        let block_buf = match op.staging {
            Some(slot) => BufRef {
                region: BUF_STAGING,
                offset: slot as usize * self.block_bytes as usize,
                len: self.block_bytes as u32,
            },
            None => BufRef {
                region: BUF_REGION,
                offset: op.block as usize * self.block_bytes as usize,
                len: self.block_bytes as u32,
            },
        };
        let file_op = match op.step {
            Step::Open => FileOp::OpenAt {
                path: &dest,
                flags: O_RDONLY | O_CLOEXEC | direct,
                mode: 0,
            },
            Step::Read => FileOp::ReadFd {
                fd: op.fd,
                offset: 0,
                buf: block_buf,
            },
            Step::Close | Step::CloseTmp => FileOp::Close { fd: op.fd },
            Step::OpenTmp => FileOp::OpenAt {
                path: &tmp,
                flags: O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC | direct,
                mode: 0o644,
            },
            Step::Sync => FileOp::Fsync {
                fd: op.fd,
                data_only: true,
            },
            Step::Rename => FileOp::RenameAt {
                from: &tmp,
                to: &dest,
                flags: RENAME_NOREPLACE,
            },
            Step::UnlinkTmp => FileOp::UnlinkAt { path: &tmp },
            Step::Unlink => FileOp::UnlinkAt { path: &dest },
            Step::MkdirLeaf | Step::MkdirParent => {
                let dir = c_path(op.mkdir_target());
                let mkdir = FileOp::MkdirAt {
                    path: &dir,
                    mode: DIR_MODE,
                };
                return self.backend.push_file(user_data, &mkdir, class);
            }
            Step::Write => unreachable!("writes are pushed chunk by chunk"),
        };
        self.backend.push_file(user_data, &file_op, class)
    }

    fn push_stalled(&mut self) -> bool {
        let mut any = false;
        while let Some(&idx) = self.stalled.front() {
            if !self.try_push_step(idx) {
                break;
            }
            self.stalled.pop_front();
            any = true;
        }
        any
    }

    fn touch(&mut self, key: Key) {
        if let Some(e) = self.index.get_mut(&key) {
            self.lru.remove(&e.tick);
            self.tick += 1;
            e.tick = self.tick;
            self.lru.insert(self.tick, key);
        }
    }

    fn unindex(&mut self, key: &Key) -> Option<Entry> {
        let e = self.index.remove(key)?;
        self.lru.remove(&e.tick);
        if e.state == State::Valid {
            self.me
                .published
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(key);
            self.me
                .metrics
                .blocks_stored
                .fetch_sub(1, Ordering::Relaxed);
        }
        Some(e)
    }

    fn publish(&mut self, key: Key, dev: u16, counted: bool) {
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
                self.me
                    .metrics
                    .blocks_stored
                    .fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.lru.insert(tick, key);
        self.me
            .published
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key);
        self.me
            .metrics
            .blocks_stored
            .fetch_add(1, Ordering::Relaxed);
    }

    // ---------------------------------------------------------------------------------------
    // Main loop

    pub fn run(mut self) {
        loop {
            let mut progress = self.intake();
            progress |= self.reap();
            progress |= self.push_stalled();
            progress |= self.issue_loads();
            progress |= self.issue_stores();
            let m = &self.me.metrics;
            m.queued_loads
                .store(self.loads.blocks as u64, Ordering::Relaxed);
            m.queued_stores
                .store(self.stores.blocks as u64, Ordering::Relaxed);
            m.inflight_ops
                .store(self.backend.in_flight() as u64, Ordering::Relaxed);
            if self.stopping && self.idle() {
                break;
            }
            let returned = self.demote.as_ref().map(Demote::returned);
            let r = submit_or_sleep(self.backend.as_mut(), &self.me, &self.rx, progress, || {
                returned.is_some_and(|r| !r.is_empty())
            });
            if let Err(e) = r {
                self.log_error(&format!("submit failed: {e}"));
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    fn idle(&self) -> bool {
        self.loads.is_empty()
            && self.stores.is_empty()
            && self.retry.is_empty()
            && self.store_issuing.is_empty()
            && self.stalled.is_empty()
            && self.backend.in_flight() == 0
    }

    fn intake(&mut self) -> bool {
        let mut any = false;
        while let Ok(msg) = self.rx.try_recv() {
            any = true;
            match msg {
                Msg::Work(part) => {
                    if self.stopping {
                        for &item in &part.items {
                            self.me.queued_blocks.fetch_sub(1, Ordering::AcqRel);
                            part.job.fail(
                                &self.shared,
                                item as usize,
                                KeyFailure::Shutdown,
                                String::new(),
                            );
                        }
                        continue;
                    }
                    match part.job.kind {
                        JobKind::Load => self.loads.push(part),
                        JobKind::Store => self.stores.push(part),
                    }
                }
                Msg::Touch(keys) => {
                    for key in keys {
                        self.touch(key);
                    }
                }
                Msg::Stop => {
                    self.stopping = true;
                    let n = self.loads.cancel(&self.shared) + self.stores.cancel(&self.shared);
                    self.me.queued_blocks.fetch_sub(n, Ordering::AcqRel);
                    for (job, item) in self.retry.drain(..) {
                        job.fail(&self.shared, item, KeyFailure::Shutdown, String::new());
                    }
                }
            }
        }
        any
    }

    fn reap(&mut self) -> bool {
        let mut out = std::mem::take(&mut self.completions);
        out.clear();
        self.backend.complete(&mut out);
        let any = !out.is_empty();
        for c in &out {
            let (idx, chunk) = self.ops.decode(c.user_data);
            let step = self.ops[idx as usize].step;
            match step {
                Step::Open => self.on_open(idx, c.result),
                Step::Read => self.on_read(idx, c.result),
                Step::Close => self.on_close(idx),
                Step::OpenTmp => self.on_open_tmp(idx, c.result),
                Step::MkdirLeaf | Step::MkdirParent => self.on_mkdir(idx, c.result),
                Step::Write => self.on_write(idx, chunk, c.result),
                Step::Sync => self.on_sync(idx, c.result),
                Step::CloseTmp => self.on_close_tmp(idx, c.result),
                Step::Rename => self.on_rename(idx, c.result),
                Step::UnlinkTmp => self.on_unlink_tmp(idx),
                Step::Unlink => self.on_unlink(idx, c.result),
            }
        }
        self.completions = out;
        any
    }

    // ---------------------------------------------------------------------------------------
    // Loads

    fn issue_loads(&mut self) -> bool {
        let mut any = false;
        while self.loads_in_flight < self.sched.load_inflight_max {
            let Some((job, item)) = self.loads.peek() else {
                break;
            };
            let job = Arc::clone(job);
            let key = job.job.keys[item];
            let d = key.device(self.devs.len());
            let dest = self.devs[d].path_of(&key);
            let entry = self.index.get(&key).copied();
            if dest.is_none() || entry.is_some_and(|e| e.state == State::Writing) {
                self.loads.take(&self.me);
                let reason = if dest.is_none() {
                    KeyFailure::Miss
                } else {
                    KeyFailure::NotReady
                };
                self.me.metrics.loads_failed.fetch_add(1, Ordering::Relaxed);
                job.fail(&self.shared, item, reason, String::new());
                any = true;
                continue;
            }
            let Some(idx) = self.alloc(Kind::Load) else {
                break;
            };
            let op = &mut self.ops[idx as usize];
            op.step = Step::Open;
            op.job = Some(job);
            op.item = item as u32;
            op.key = Some(key);
            op.dev = d as u16;
            op.block = op.job.as_ref().map_or(0, |j| j.job.blocks[item]);
            op.dest = dest.unwrap_or_default();
            if !self.try_push_step(idx) {
                self.release(idx);
                break;
            }
            if let Some(e) = self.index.get_mut(&key) {
                e.pins += 1;
            }
            self.touch(key);
            self.loads_in_flight += 1;
            self.loads.take(&self.me);
            any = true;
        }
        any
    }

    fn on_open(&mut self, idx: u32, result: i32) {
        if self.ops[idx as usize].kind == Kind::Remove {
            self.on_demote_open(idx, result);
            return;
        }
        if result < 0 {
            let e = Errno::from_raw(-result);
            let key = self.ops[idx as usize].key.expect("load has a key");
            if e == Errno::ENOENT {
                // Gone (evicted by another process, or never stored): a miss, and forget it.
                self.me.metrics.load_misses.fetch_add(1, Ordering::Relaxed);
                if let Some(entry) = self.index.get(&key).copied() {
                    if entry.pins <= 1 {
                        let removed = self.unindex(&key);
                        if removed.is_some() {
                            self.shared.events.push(vec![key], true);
                        }
                    }
                }
                self.finish_load(idx, Err((KeyFailure::Miss, String::new())));
            } else {
                self.me.metrics.io_errors.fetch_add(1, Ordering::Relaxed);
                self.finish_load(idx, Err((KeyFailure::Io(e), format!("open: {}", e.desc()))));
            }
            self.end_load(idx);
            return;
        }
        let fd = result;
        let dev = Arc::clone(&self.devs[self.ops[idx as usize].dev as usize]);
        let crc = if dev.checksums {
            read_crc(fd, &dev)
        } else {
            None
        };
        let op = &mut self.ops[idx as usize];
        op.fd = fd;
        op.crc = crc;
        op.step = Step::Read;
        self.push_step(idx);
    }

    fn on_read(&mut self, idx: u32, result: i32) {
        if self.ops[idx as usize].kind == Kind::Remove {
            self.on_demote_read(idx, result);
            return;
        }
        let m = &self.me.metrics;
        m.read_ops.fetch_add(1, Ordering::Relaxed);
        let wanted = self.block_bytes as u32;
        let op = &self.ops[idx as usize];
        let (block, crc, key) = (op.block, op.crc, op.key.expect("load has a key"));
        let outcome = if result < 0 {
            m.io_errors.fetch_add(1, Ordering::Relaxed);
            let e = Errno::from_raw(-result);
            Err((KeyFailure::Io(e), format!("read: {}", e.desc())))
        } else if (result as u32) < wanted {
            // Stores are atomic (temp file + rename), so a short file is corrupt: drop it.
            m.io_errors.fetch_add(1, Ordering::Relaxed);
            Err((
                KeyFailure::ShortIo {
                    done: result as u32,
                    wanted,
                },
                "short file removed".into(),
            ))
        } else {
            m.bytes_read.fetch_add(u64::from(wanted), Ordering::Relaxed);
            match crc {
                Some(want) => {
                    let got = region_crc(
                        &self.region,
                        block as usize * wanted as usize,
                        wanted as usize,
                    );
                    if got == want {
                        Ok(())
                    } else {
                        m.checksum_failures.fetch_add(1, Ordering::Relaxed);
                        Err((
                            KeyFailure::Checksum,
                            format!("xattr crc {want:08x}, read {got:08x}; file removed"),
                        ))
                    }
                }
                None => Ok(()),
            }
        };
        let bad = matches!(
            outcome,
            Err((KeyFailure::ShortIo { .. } | KeyFailure::Checksum, _))
        );
        if outcome.is_ok() && !self.index.contains_key(&key) {
            // Published by another process since our scan: index it now.
            let dev = self.ops[idx as usize].dev;
            self.publish(key, dev, false);
            if let Some(e) = self.index.get_mut(&key) {
                e.pins = 1;
            }
        }
        self.finish_load(idx, outcome);
        if bad {
            // Remove the file after closing it; the removal is this op's trailing step.
            let entry = self.unindex(&key);
            self.shared.events.push(vec![key], true);
            let op = &mut self.ops[idx as usize];
            op.bytes = if entry.is_some_and(|e| e.counted) {
                self.block_bytes
            } else {
                0
            };
            op.kind = Kind::Remove;
            self.removals_in_flight += 1;
            self.loads_in_flight -= 1;
        }
        self.ops[idx as usize].step = Step::Close;
        self.push_step(idx);
    }

    fn on_close(&mut self, idx: u32) {
        if self.ops[idx as usize].kind == Kind::Remove {
            self.ops[idx as usize].step = Step::Unlink;
            self.push_step(idx);
            return;
        }
        self.end_load(idx);
    }

    /// Reports the key's outcome (once).
    fn finish_load(&mut self, idx: u32, outcome: Result<(), (KeyFailure, String)>) {
        let op = &mut self.ops[idx as usize];
        if op.resolved {
            return;
        }
        op.resolved = true;
        let job = op.job.clone().expect("load has a job");
        let item = op.item as usize;
        self.me
            .metrics
            .load_latency
            .record(op.started.elapsed().as_micros() as u64);
        match outcome {
            Ok(()) => {
                self.me.metrics.loads_ok.fetch_add(1, Ordering::Relaxed);
                job.succeed(&self.shared, item, self.block_bytes);
            }
            Err((KeyFailure::Miss, detail)) => {
                self.me.metrics.loads_failed.fetch_add(1, Ordering::Relaxed);
                self.shared.load_missed(&job, item, detail);
            }
            Err((reason, detail)) => {
                self.me.metrics.loads_failed.fetch_add(1, Ordering::Relaxed);
                job.fail(&self.shared, item, reason, detail);
            }
        }
    }

    /// Unpins and frees a finished load op.
    fn end_load(&mut self, idx: u32) {
        let key = self.ops[idx as usize].key;
        if let Some(e) = key.and_then(|k| self.index.get_mut(&k)) {
            e.pins = e.pins.saturating_sub(1);
        }
        self.loads_in_flight -= 1;
        self.release(idx);
    }

    // ---------------------------------------------------------------------------------------
    // Stores

    fn store_cap(&self) -> u64 {
        if self.loads_in_flight > 0 || !self.loads.is_empty() {
            self.sched.store_inflight_max_while_loading
        } else {
            self.sched.store_inflight_max
        }
    }

    fn issue_stores(&mut self) -> bool {
        let mut any = false;
        loop {
            let next_bytes = self
                .store_issuing
                .front()
                .map_or(self.chunk_bytes, |&i| self.ops[i as usize].chunk_len);
            if self.store_bytes_in_flight > 0
                && self.store_bytes_in_flight + next_bytes > self.store_cap()
            {
                break;
            }
            if let Some(&idx) = self.store_issuing.front() {
                if !self.issue_chunk(idx) {
                    break;
                }
                any = true;
                continue;
            }
            match self.start_store() {
                Start::Started | Start::Resolved => any = true,
                Start::Blocked => break,
            }
        }
        any
    }

    fn next_store(&self) -> Option<(Arc<JobState>, usize, bool)> {
        if let Some((job, item)) = self.retry.front() {
            return Some((Arc::clone(job), *item, true));
        }
        self.stores
            .peek()
            .map(|(job, item)| (Arc::clone(job), item, false))
    }

    fn take_store(&mut self, retried: bool) {
        if retried {
            self.retry.pop_front();
        } else {
            self.stores.take(&self.me);
        }
    }

    fn start_store(&mut self) -> Start {
        let Some((job, item, retried)) = self.next_store() else {
            return Start::Blocked;
        };
        if retried && self.removals_in_flight > 0 {
            // Retry an ENOSPC store only once the evictions it triggered have freed the space.
            return Start::Blocked;
        }
        let key = job.job.keys[item];
        if self.index.contains_key(&key) {
            self.take_store(retried);
            self.me
                .metrics
                .stores_skipped_present
                .fetch_add(1, Ordering::Relaxed);
            job.succeed(&self.shared, item, 0);
            return Start::Resolved;
        }
        let d = key.device(self.devs.len());
        let dev = Arc::clone(&self.devs[d]);
        let Some(dest) = dev.path_of(&key) else {
            self.take_store(retried);
            self.me
                .metrics
                .stores_failed
                .fetch_add(1, Ordering::Relaxed);
            job.fail(
                &self.shared,
                item,
                KeyFailure::InvalidJob,
                "a files-layout key is a block hash followed by a 4-byte group index".into(),
            );
            return Start::Resolved;
        };
        // Reserve the bytes before the temp file exists, so the bound holds across processes.
        if let Some(cap) = dev.capacity_bytes {
            let before = dev.usage.fetch_add(self.block_bytes);
            if before + self.block_bytes > cap {
                dev.usage.sub_saturating(self.block_bytes);
                if self.removals_in_flight > 0 {
                    return Start::Blocked;
                }
                if self.evict(d, EVICT_BATCH) > 0 || self.demotion_pending() {
                    return Start::Blocked;
                }
                self.take_store(retried);
                self.me
                    .metrics
                    .stores_failed
                    .fetch_add(1, Ordering::Relaxed);
                let detail = format!(
                    "{}: capacity_bytes {cap} reached ({before} bytes in use) and worker {} has no unpinned block to evict",
                    dev.data_dir.display(),
                    self.id
                );
                job.fail(&self.shared, item, KeyFailure::NoSpace, detail);
                return Start::Resolved;
            }
        }
        let reserved = if dev.capacity_bytes.is_some() {
            self.block_bytes
        } else {
            0
        };
        let Some(idx) = self.alloc(Kind::Store) else {
            dev.usage.sub_saturating(reserved);
            return Start::Blocked;
        };
        self.take_store(retried);
        let block = job.job.blocks[item];
        let crc = dev.checksums.then(|| {
            region_crc(
                &self.region,
                block as usize * self.block_bytes as usize,
                self.block_bytes as usize,
            )
        });
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let tmp = FileMapper::temp_path(&dest, self.rng >> 1);
        self.tick += 1;
        self.index.insert(
            key,
            Entry {
                dev: d as u16,
                state: State::Writing,
                pins: 0,
                tick: self.tick,
                counted: reserved > 0,
            },
        );
        let op = &mut self.ops[idx as usize];
        op.step = Step::OpenTmp;
        op.job = Some(job);
        op.item = item as u32;
        op.key = Some(key);
        op.dev = d as u16;
        op.block = block;
        op.dest = dest;
        op.tmp = tmp;
        op.crc = crc;
        op.bytes = reserved;
        op.retried = retried;
        self.push_step(idx);
        Start::Started
    }

    fn on_open_tmp(&mut self, idx: u32, result: i32) {
        if result == -(Errno::ENOENT as i32) && !self.ops[idx as usize].mkdir_tried {
            // First block under this <hhh>/<hh>_g<g> directory: create it (an io_uring mkdirat,
            // so the ring thread never blocks in the file system) and try again.
            let op = &mut self.ops[idx as usize];
            op.mkdir_tried = true;
            op.step = Step::MkdirLeaf;
            self.push_step(idx);
            return;
        }
        if result < 0 {
            let e = Errno::from_raw(-result);
            self.fail_store(
                idx,
                KeyFailure::Io(e),
                format!("creating the temp file: {}", e.desc()),
            );
            return;
        }
        let dev = Arc::clone(&self.devs[self.ops[idx as usize].dev as usize]);
        let op = &mut self.ops[idx as usize];
        op.fd = result;
        op.tmp_exists = true;
        if let Some(crc) = op.crc {
            if let Err(e) = kvtier_sys::file::fsetxattr(op.fd, &dev.xattr_name, &crc.to_le_bytes())
            {
                // No xattrs here: the block is still stored, without a checksum.
                op.crc = None;
                self.log_error(&format!(
                    "{}: cannot set {}: {}",
                    dev.data_dir.display(),
                    crate::files::device::CHECKSUM_XATTR,
                    e.desc()
                ));
            }
        }
        let loads_waiting = self.loads_in_flight > 0 || !self.loads.is_empty();
        let op = &mut self.ops[idx as usize];
        op.chunk_len = if loads_waiting {
            self.chunk_bytes
        } else {
            self.block_bytes
        };
        op.chunks_total = self.block_bytes.div_ceil(op.chunk_len) as u16;
        op.step = Step::Write;
        self.store_issuing.push_back(idx);
    }

    /// A directory for a store's temp file was made (or already existed: another writer).
    fn on_mkdir(&mut self, idx: u32, result: i32) {
        let step = self.ops[idx as usize].step;
        let next = match result {
            r if r >= 0 || r == -(Errno::EEXIST as i32) => {
                if step == Step::MkdirLeaf {
                    Step::OpenTmp
                } else {
                    Step::MkdirLeaf
                }
            }
            r if r == -(Errno::ENOENT as i32)
                && step == Step::MkdirLeaf
                && !self.ops[idx as usize].mkdir_parent_tried =>
            {
                self.ops[idx as usize].mkdir_parent_tried = true;
                Step::MkdirParent
            }
            r => {
                let e = Errno::from_raw(-r);
                let detail = format!(
                    "creating {}: {}",
                    self.ops[idx as usize].mkdir_target().display(),
                    e.desc()
                );
                self.fail_store(idx, KeyFailure::Io(e), detail);
                return;
            }
        };
        self.ops[idx as usize].step = next;
        self.push_step(idx);
    }

    fn issue_chunk(&mut self, idx: u32) -> bool {
        let op = &self.ops[idx as usize];
        let chunk = op.chunks_issued;
        let start = u64::from(chunk) * op.chunk_len;
        let len = op.chunk_len.min(self.block_bytes - start);
        let file_op = FileOp::WriteFd {
            fd: op.fd,
            offset: start,
            buf: BufRef {
                region: BUF_REGION,
                offset: op.block as usize * self.block_bytes as usize + start as usize,
                len: len as u32,
            },
        };
        if !self
            .backend
            .push_file(self.ops.user_data(idx, chunk), &file_op, IoClass::Store)
        {
            return false;
        }
        let op = &mut self.ops[idx as usize];
        op.chunks_issued += 1;
        self.store_bytes_in_flight += len;
        if op.chunks_issued == op.chunks_total {
            self.store_issuing.pop_front();
        }
        true
    }

    fn on_write(&mut self, idx: u32, chunk: u16, result: i32) {
        let chunk_len = self.ops[idx as usize].chunk_len;
        let start = u64::from(chunk) * chunk_len;
        let len = chunk_len.min(self.block_bytes - start);
        self.store_bytes_in_flight -= len;
        self.me.metrics.write_ops.fetch_add(1, Ordering::Relaxed);
        let failure = if result < 0 {
            let e = Errno::from_raw(-result);
            Some((KeyFailure::Io(e), format!("write: {}", e.desc())))
        } else if (result as u64) < len {
            Some((
                KeyFailure::ShortIo {
                    done: result as u32,
                    wanted: len as u32,
                },
                "short write".into(),
            ))
        } else {
            self.me
                .metrics
                .bytes_written
                .fetch_add(len, Ordering::Relaxed);
            None
        };
        let op = &mut self.ops[idx as usize];
        op.chunks_done += 1;
        if let Some(f) = failure {
            op.failure.get_or_insert(f);
            if op.chunks_issued < op.chunks_total {
                op.chunks_total = op.chunks_issued;
                self.store_issuing.retain(|&i| i != idx);
            }
        }
        let op = &self.ops[idx as usize];
        if op.chunks_done < op.chunks_total || op.chunks_issued < op.chunks_total {
            return;
        }
        if let Some((reason, detail)) = self.ops[idx as usize].failure.take() {
            self.me.metrics.io_errors.fetch_add(1, Ordering::Relaxed);
            self.fail_store(idx, reason, detail);
            return;
        }
        let sync = self.devs[self.ops[idx as usize].dev as usize].sync;
        self.ops[idx as usize].step = if sync == SyncMode::Data {
            Step::Sync
        } else {
            Step::CloseTmp
        };
        self.push_step(idx);
    }

    fn on_sync(&mut self, idx: u32, result: i32) {
        if result < 0 {
            let e = Errno::from_raw(-result);
            self.fail_store(idx, KeyFailure::Io(e), format!("fdatasync: {}", e.desc()));
            return;
        }
        self.ops[idx as usize].step = Step::CloseTmp;
        self.push_step(idx);
    }

    fn on_close_tmp(&mut self, idx: u32, result: i32) {
        self.ops[idx as usize].fd = -1;
        if let Some((reason, detail)) = self.ops[idx as usize].failure.clone() {
            // Closed after a failure: remove the temp file.
            let _ = (reason, detail);
            self.ops[idx as usize].step = Step::UnlinkTmp;
            self.push_step(idx);
            return;
        }
        if result < 0 {
            let e = Errno::from_raw(-result);
            self.fail_store(idx, KeyFailure::Io(e), format!("close: {}", e.desc()));
            return;
        }
        self.ops[idx as usize].step = Step::Rename;
        self.push_step(idx);
    }

    fn on_rename(&mut self, idx: u32, result: i32) {
        let op = &self.ops[idx as usize];
        let (key, dev) = (op.key.expect("store has a key"), op.dev);
        if result == -(Errno::EEXIST as i32) {
            // Another writer published the same key first: same content (keys are content
            // hashes), so this store succeeded; drop our copy and our reservation.
            let d = Arc::clone(&self.devs[dev as usize]);
            d.usage.sub_saturating(self.ops[idx as usize].bytes);
            self.ops[idx as usize].bytes = 0;
            self.publish(key, dev, false);
            self.succeed_store(idx, 0);
            self.ops[idx as usize].step = Step::UnlinkTmp;
            self.push_step(idx);
            return;
        }
        if result < 0 {
            let e = Errno::from_raw(-result);
            self.fail_store(idx, KeyFailure::Io(e), format!("rename: {}", e.desc()));
            return;
        }
        let counted = self.ops[idx as usize].bytes > 0;
        self.publish(key, dev, counted);
        let d = Arc::clone(&self.devs[dev as usize]);
        if d.sync == SyncMode::Data {
            if let Some(parent) = self.ops[idx as usize].dest.parent() {
                if let Err(e) = std::fs::File::open(parent).and_then(|f| f.sync_all()) {
                    self.log_error(&format!("fsync of {}: {e}", parent.display()));
                }
            }
        }
        self.succeed_store(idx, self.block_bytes);
        self.release(idx);
    }

    fn succeed_store(&mut self, idx: u32, bytes: u64) {
        let op = &mut self.ops[idx as usize];
        op.resolved = true;
        let job = op.job.clone().expect("store has a job");
        let item = op.item as usize;
        self.me
            .metrics
            .store_latency
            .record(op.started.elapsed().as_micros() as u64);
        self.me.metrics.stores_ok.fetch_add(1, Ordering::Relaxed);
        job.succeed(&self.shared, item, bytes);
    }

    /// Fails a store: releases its reservation and index entry, reports the key, then closes
    /// and removes the temp file as trailing steps. ENOSPC gets one retry after evicting.
    fn fail_store(&mut self, idx: u32, reason: KeyFailure, detail: String) {
        let op = &mut self.ops[idx as usize];
        let (key, d, reserved, retried) = (
            op.key.expect("store has a key"),
            op.dev as usize,
            op.bytes,
            op.retried,
        );
        op.bytes = 0;
        let job = op.job.clone().expect("store has a job");
        let item = op.item as usize;
        let had_fd = op.fd >= 0;
        let had_tmp = op.tmp_exists;
        op.resolved = true;
        self.devs[d].usage.sub_saturating(reserved);
        if self
            .index
            .get(&key)
            .is_some_and(|e| e.state == State::Writing)
        {
            self.index.remove(&key);
        }
        let enospc = matches!(
            reason,
            KeyFailure::Io(Errno::ENOSPC | Errno::EDQUOT | Errno::EFBIG)
        );
        if enospc && !retried && self.evict(d, EVICT_BATCH) > 0 {
            // Room may come from evicting: queue the block once more, ahead of new stores.
            self.retry.push_back((job, item));
        } else {
            self.me
                .metrics
                .stores_failed
                .fetch_add(1, Ordering::Relaxed);
            self.log_error(&format!(
                "store to {} failed: {detail}",
                self.devs[d].data_dir.display()
            ));
            job.fail(&self.shared, item, reason, detail);
        }
        let op = &mut self.ops[idx as usize];
        op.failure = Some((reason, String::new()));
        if had_fd {
            op.step = Step::CloseTmp;
            self.push_step(idx);
        } else if had_tmp {
            op.step = Step::UnlinkTmp;
            self.push_step(idx);
        } else {
            self.release(idx);
        }
    }

    fn on_unlink_tmp(&mut self, idx: u32) {
        self.release(idx);
    }

    // ---------------------------------------------------------------------------------------
    // Eviction and removal

    /// Starts removing up to `n` of this worker's least recently used unpinned blocks on device
    /// `d`; returns how many removals started.
    fn evict(&mut self, d: usize, n: usize) -> usize {
        let victims: Vec<Key> = self
            .lru
            .values()
            .filter(|k| {
                self.index
                    .get(k)
                    .is_some_and(|e| e.dev as usize == d && e.state == State::Valid && e.pins == 0)
            })
            .take(n)
            .copied()
            .collect();
        let mut started = 0;
        for key in victims {
            let Some(dest) = self.devs[d].path_of(&key) else {
                continue;
            };
            // With demotion, a victim is read into a staging slot first; with none free, wait
            // for one to come back rather than evict without demoting (the S3 tier gives them
            // back as soon as it has copied them, however slow the upload).
            let staging = match self.demote.as_mut() {
                None => None,
                Some(m) => match m.take_staging() {
                    Some(s) => Some(s),
                    None if m.will_free() => break,
                    None => {
                        self.me
                            .metrics
                            .demotions_dropped
                            .fetch_add(1, Ordering::Relaxed);
                        None
                    }
                },
            };
            let Some(idx) = self.alloc(Kind::Remove) else {
                if let (Some(s), Some(m)) = (staging, self.demote.as_mut()) {
                    m.put_back(s);
                }
                break;
            };
            let entry = self.unindex(&key);
            self.shared.events.push(vec![key], true);
            self.me.metrics.evictions.fetch_add(1, Ordering::Relaxed);
            let op = &mut self.ops[idx as usize];
            op.step = if staging.is_some() {
                Step::Open
            } else {
                Step::Unlink
            };
            op.staging = staging;
            op.key = Some(key);
            op.dev = d as u16;
            op.dest = dest;
            op.bytes = if entry.is_some_and(|e| e.counted) {
                self.block_bytes
            } else {
                0
            };
            op.resolved = true;
            if let Some(m) = self.demote.as_mut().filter(|_| staging.is_some()) {
                m.started();
            }
            self.removals_in_flight += 1;
            self.push_step(idx);
            started += 1;
        }
        started
    }

    /// Whether a demotion will free a staging slot (then a store waiting for space waits).
    fn demotion_pending(&self) -> bool {
        self.demote.as_ref().is_some_and(Demote::will_free)
    }

    /// A demotion opened the evicted file: read it (with its crc), or give the staging slot
    /// back and remove it anyway.
    fn on_demote_open(&mut self, idx: u32, result: i32) {
        if result < 0 {
            self.end_demotion(idx, None);
            self.ops[idx as usize].step = Step::Unlink;
            self.push_step(idx);
            return;
        }
        let dev = Arc::clone(&self.devs[self.ops[idx as usize].dev as usize]);
        let crc = if dev.checksums {
            read_crc(result, &dev)
        } else {
            None
        };
        let op = &mut self.ops[idx as usize];
        op.fd = result;
        op.crc = crc;
        op.step = Step::Read;
        self.push_step(idx);
    }

    /// The evicted file is in its staging slot: hand it to the S3 tier, close, remove.
    fn on_demote_read(&mut self, idx: u32, result: i32) {
        let op = &self.ops[idx as usize];
        let demoted = (result == self.block_bytes as i32)
            .then_some(op.key)
            .flatten()
            .map(|k| (k, op.crc));
        if demoted.is_none() {
            self.log_error(&format!(
                "reading evicted {} for demotion: {}",
                self.ops[idx as usize].dest.display(),
                if result < 0 {
                    Errno::from_raw(-result).desc().to_owned()
                } else {
                    format!("{result} bytes")
                }
            ));
        }
        self.end_demotion(idx, demoted);
        self.ops[idx as usize].step = Step::Close;
        self.push_step(idx);
    }

    fn end_demotion(&mut self, idx: u32, demoted: Option<(Key, Option<u32>)>) {
        let Some(staging) = self.ops[idx as usize].staging.take() else {
            return;
        };
        let block_bytes = self.block_bytes as usize;
        let me = Arc::clone(&self.me);
        let Some(m) = self.demote.as_mut() else {
            return;
        };
        let counter = if m.finished(staging, block_bytes, demoted, &me) {
            &self.me.metrics.demotions
        } else {
            &self.me.metrics.demotions_dropped
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn on_unlink(&mut self, idx: u32, result: i32) {
        let op = &self.ops[idx as usize];
        let d = op.dev as usize;
        // Only the process whose unlink succeeded gives the bytes back.
        if result == 0 {
            self.devs[d].usage.sub_saturating(op.bytes);
        } else if result != -(Errno::ENOENT as i32) {
            let e = Errno::from_raw(-result);
            let msg = format!("removing {}: {}", op.dest.display(), e.desc());
            self.log_error(&msg);
        }
        self.removals_in_flight -= 1;
        self.release(idx);
    }

    fn log_error(&mut self, msg: &str) {
        self.error_logs += 1;
        if self.error_logs <= 20 || self.error_logs % 1000 == 0 {
            tracing::error!(worker = self.id, count = self.error_logs, "{msg}");
        }
    }
}

enum Start {
    Started,
    Resolved,
    Blocked,
}

/// The block's crc32c from its xattr, if it has one.
fn read_crc(fd: i32, dev: &FilesDevice) -> Option<u32> {
    let mut buf = [0u8; 4];
    match kvtier_sys::file::fgetxattr(fd, &dev.xattr_name, &mut buf) {
        Ok(Some(4)) => Some(u32::from_le_bytes(buf)),
        _ => None,
    }
}

const O_RDONLY: i32 = OFlag::O_RDONLY.bits();
const O_WRONLY: i32 = OFlag::O_WRONLY.bits();
const O_CREAT: i32 = OFlag::O_CREAT.bits();
const O_EXCL: i32 = OFlag::O_EXCL.bits();
const O_CLOEXEC: i32 = OFlag::O_CLOEXEC.bits();
const O_DIRECT: i32 = OFlag::O_DIRECT.bits();
