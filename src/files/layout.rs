//! The `files` layout as a worker's [`Layout`]: each block a small state machine of io_uring
//! file operations, so a job's blocks are all in flight at once and the worker never blocks its
//! ring on a system call. The worker's scheduler is the slab's (loads first, stores capped while
//! loads wait, stores chunked). Here: the index and the `Layout` seam; the op is in
//! [`super::op`], how its steps become ring operations in [`super::steps`], the load
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

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::files::device::{FilesDevice, ScannedFile};
use crate::io::{FileOp, IoClass};
use crate::job::{JobState, KeyFailure};
use crate::key::Key;
use crate::worker::{own_key, region_buffer, Context, Layout, Start};

pub(crate) use super::index::{Entry, Index, State};
pub(crate) use super::op::{Kind, Op, Step};

pub(super) const RENAME_NOREPLACE: u32 = 1;
/// Blocks evicted at once when a store finds the device full.
pub(super) const EVICT_BATCH: usize = 4;

pub(crate) struct FilesLayout {
    pub(super) id: usize,
    pub(super) devs: Vec<Arc<FilesDevice>>,
    pub(super) index: Index,
    /// Ops whose next step could not be pushed (SQ full).
    pub(super) stalled: VecDeque<u32>,
    pub(super) removals_in_flight: usize,
    /// Stores preparing (begun, block write not yet issued), and their bound (`[files]
    /// stores_opening`).
    pub(super) stores_opening: usize,
    pub(super) stores_opening_max: usize,
    pub(super) rng: u64,
    /// Lookups' questions not started yet (key, generation), and probe ops in flight.
    pub(super) probes: VecDeque<(Key, u64)>,
    pub(super) probes_in_flight: usize,
}

impl FilesLayout {
    /// A seed for temp file names that another process writing the same directory (a
    /// restarted kvtier, a second one) does not draw: the pid and the time.
    pub fn temp_seed() -> u64 {
        (u64::from(std::process::id()) << 32)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(7, |d| d.as_nanos() as u64)
    }

    /// Worker `id`'s layout over `devices`, indexing the files the scan at open found for it;
    /// at most `stores_opening` stores preparing at once; `seed` draws its temp file names
    /// ([`FilesLayout::temp_seed`] in the engine, the simulator's seed there).
    pub fn new(
        id: usize,
        devices: Vec<Arc<FilesDevice>>,
        scanned: Vec<ScannedFile>,
        stores_opening: usize,
        me: &crate::worker::WorkerShared,
        seed: u64,
    ) -> FilesLayout {
        let mut w = FilesLayout {
            id,
            devs: devices,
            index: Index::default(),
            stalled: VecDeque::new(),
            removals_in_flight: 0,
            stores_opening: 0,
            stores_opening_max: stores_opening.max(1),
            probes: VecDeque::new(),
            probes_in_flight: 0,
            // Never zero: the generator (xorshift) would stay there.
            rng: (seed ^ (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1,
        };
        // Seed the LRU from file times: oldest first, ties by key (not by the directory's
        // listing order).
        let mut scanned = scanned;
        scanned.sort_by(|a, b| {
            (a.last_use_secs, a.key.as_bytes()).cmp(&(b.last_use_secs, b.key.as_bytes()))
        });
        let devices = w.devs.len();
        for f in scanned {
            let dev = f.key.device(devices) as u16;
            w.index.publish(f.key, dev, true);
        }
        let n = w.index.len() as u64;
        me.metrics.recovered_blocks.store(n, Ordering::Relaxed);
        for (_, e) in w.index.valid() {
            me.metrics
                .dev(e.dev as usize)
                .blocks_stored
                .fetch_add(1, Ordering::Relaxed);
        }
        w
    }

    /// Publishes every block the scan at open found (before the worker starts).
    pub fn publish_scanned(&self, cx: &mut Context<Op>) {
        for (key, _) in self.index.valid() {
            cx.publish_key(&key);
        }
    }

    /// Blocks in the index (after the scan at open).
    pub fn indexed(&self) -> u64 {
        self.index.len() as u64
    }

    // ---------------------------------------------------------------------------------------
    // Ops table

    pub(super) fn alloc(cx: &mut Context<Op>, kind: Kind) -> Option<u32> {
        cx.ops.alloc(Op {
            kind,
            ..Op::empty()
        })
    }

    pub(super) fn release(&mut self, cx: &mut Context<Op>, idx: u32) {
        if cx.ops[idx as usize].opening {
            self.stores_opening -= 1;
        }
        cx.release(idx);
    }

    /// Store `idx` is done preparing: its block write is issued next.
    pub(super) fn prepared(&mut self, cx: &mut Context<Op>, idx: u32) {
        let op = &mut cx.ops[idx as usize];
        if std::mem::replace(&mut op.opening, false) {
            self.stores_opening -= 1;
        }
    }

    pub(super) fn unindex(&mut self, cx: &mut Context<Op>, key: &Key) -> Option<Entry> {
        let e = self.index.remove(key)?;
        if e.state == State::Valid {
            cx.withdraw_key(key);
            cx.metrics()
                .dev(e.dev as usize)
                .blocks_stored
                .fetch_sub(1, Ordering::Relaxed);
        }
        Some(e)
    }

    pub(super) fn publish(&mut self, cx: &mut Context<Op>, key: Key, dev: u16, counted: bool) {
        if let Some(p) = self.index.publish(key, dev, counted) {
            if p.state == State::Valid {
                cx.metrics()
                    .dev(p.dev as usize)
                    .blocks_stored
                    .fetch_sub(1, Ordering::Relaxed);
            }
        }
        cx.publish_key(&key);
        cx.metrics()
            .dev(dev as usize)
            .blocks_stored
            .fetch_add(1, Ordering::Relaxed);
    }
}

impl Layout for FilesLayout {
    type Op = Op;

    fn start_load(&mut self, cx: &mut Context<Op>, job: &Arc<JobState>, item: usize) -> Start {
        let key = job.job.keys[item];
        let d = key.device(self.devs.len());
        if cx.device_failed(d) {
            cx.resolve_load(job, item, KeyFailure::Miss);
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
            cx.metrics().loads_failed.fetch_add(1, Ordering::Relaxed);
            cx.fail_item(job, item, reason);
            return Start::Resolved;
        };
        let mut op = Op {
            kind: Kind::Load,
            job: Some(Arc::clone(job)),
            item: item as u32,
            key: Some(key),
            dev: d as u16,
            block: job.job.blocks[item],
            dest,
            ..Op::empty()
        };
        op.begin(Step::Open);
        // A files load goes through several steps: its op lives until the last one.
        let Some((idx, _)) = cx.ops.alloc_load(op, false) else {
            return Start::Blocked;
        };
        if !self.try_push_step(cx, idx) {
            cx.ops.abandon(idx);
            return Start::Blocked;
        }
        cx.ops[idx as usize].pin = self.index.pin(&key);
        Start::Loading
    }

    fn start_store(
        &mut self,
        cx: &mut Context<Op>,
        job: &Arc<JobState>,
        item: usize,
        retried: bool,
    ) -> Start {
        self.begin_store(cx, job, item, retried)
    }

    fn push_chunk(
        &mut self,
        cx: &mut Context<Op>,
        idx: u32,
        chunk: u16,
        start: u64,
        len: u64,
    ) -> bool {
        let op = &cx.ops[idx as usize];
        let job = op.job.as_ref().expect("a store op has a job");
        let at = op.block as usize * cx.block_bytes() as usize + start as usize;
        let claim = cx.claim(job, at, len as usize, false);
        let buffer = region_buffer(job.region);
        let file_op = FileOp::WriteFd {
            fd: op.fd,
            offset: start,
            buf: claim.buf_ref(buffer),
        };
        let user_data = cx.ops.user_data(idx, chunk);
        cx.backend().file_queue().push_file(
            user_data,
            &file_op,
            Some((buffer, claim)),
            IoClass::Store,
        )
    }

    fn on_written(
        &mut self,
        cx: &mut Context<Op>,
        idx: u32,
        failure: Option<(KeyFailure, String)>,
    ) {
        self.data_written(cx, idx, failure);
    }

    fn on_ended(&mut self, _: &mut Context<Op>, _: Op, _: i32) {
        unreachable!("every files-layout op goes on after a completion (alloc_load: once false)")
    }

    fn on_complete(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        match cx.ops[idx as usize].step {
            Step::Open => self.on_open(cx, idx, result),
            Step::GetXattr => self.on_get_xattr(cx, idx, result),
            Step::SetXattr => self.on_set_xattr(cx, idx, result),
            Step::Read => self.on_read(cx, idx, result),
            Step::Close => self.on_close(cx, idx),
            Step::OpenTmp => self.on_open_tmp(cx, idx, result),
            Step::OpenParent => self.on_open_parent(cx, idx, result),
            Step::MkdirLeaf | Step::MkdirParent => self.on_mkdir(cx, idx, result),
            Step::Sync => self.on_sync(cx, idx, result),
            Step::CloseTmp => self.on_close_tmp(cx, idx, result),
            Step::Rename => self.on_rename(cx, idx, result),
            Step::UnlinkTmp => self.release(cx, idx),
            Step::Unlink => self.on_unlink(cx, idx, result),
            Step::OpenDir | Step::SyncDir | Step::CloseDir => self.on_dir_step(cx, idx, result),
            Step::Stat => self.on_stat(cx, idx, result),
            Step::Write => unreachable!("store writes are the worker's (LayoutOp::writing)"),
        }
    }

    fn touch(&mut self, key: Key) {
        self.index.touch(&key);
    }

    fn keys(&self) -> Vec<Key> {
        self.index.valid().map(|(k, _)| k).collect()
    }

    fn remove(&mut self, cx: &mut Context<Op>, key: Key) -> bool {
        self.remove_key(cx, key)
    }

    fn probe(&mut self, cx: &mut Context<Op>, keys: Vec<(Key, u64)>) {
        self.queue_probes(cx, keys);
    }

    fn unstall(&mut self, cx: &mut Context<Op>) -> bool {
        self.push_stalled(cx)
    }

    fn background(&mut self, cx: &mut Context<Op>) -> bool {
        self.start_probes(cx)
    }

    fn idle(&self) -> bool {
        self.stalled.is_empty() && self.probes_idle()
    }

    fn overdue_keys(&self, cx: &Context<Op>, idx: u32) -> Vec<(Arc<JobState>, usize, bool)> {
        let op = &cx.ops[idx as usize];
        match op.kind {
            // An op that reported its key (or handed it to a retry) only cleans up now: no key
            // waits on it, and its steps left (close, unlink) touch no region block.
            Kind::Load | Kind::Store if op.resolved => Vec::new(),
            Kind::Load | Kind::Store => own_key(op.job.as_ref(), op.item),
            // A corrupt block's removal carries its load's failure until the unlink is done.
            Kind::Remove if op.pending_failure.is_some() && !op.resolved => {
                own_key(op.job.as_ref(), op.item)
            }
            Kind::Remove | Kind::Probe => Vec::new(),
        }
    }

    fn device_failed(&mut self, cx: &mut Context<Op>, d: usize) {
        let keys = self.index.idle_on(d);
        for key in &keys {
            self.unindex(cx, key);
        }
        if !keys.is_empty() {
            cx.announce_removed(keys);
        }
    }

    fn describe_op(&self, cx: &Context<Op>, idx: u32) -> String {
        let op = &cx.ops[idx as usize];
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
    fn check_quiet(&self, _core: &Context<Op>) -> Result<(), String> {
        self.index.check()?;
        if self.removals_in_flight != 0 || self.index.any_pinned() || !self.probes_idle() {
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
