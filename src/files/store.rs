//! Stores of the `files` layout, one io_uring step at a time:
//!
//! ```text
//! reserve bytes ─► openat2 tmp (O_EXCL, confined, file_mode) [ENOENT: openat2 <hhh> O_PATH
//!   (ENOENT: mkdirat <hhh>, again) ─► mkdirat <hh>_g<g> at it ─► close, again]
//!   ─► [fchmod if the umask took bits of file_mode] ─► fsetxattr crc (on the ring, 5.19+) ─► write (the worker's chunks) ─► [fdatasync] ─► close
//!   ─► renameat NOREPLACE (EEXIST = another writer won: success)
//!   ─► [sync = "data": openat dir ─► fsync ─► (report) ─► close]
//! ```
//!
//! At most `[files] stores_opening` stores per worker are between their start and their write
//! (the steps up to the xattr); the kernel runs those steps in io-wq in submission order, so
//! the bound keeps a store's next step from waiting behind every other store's first one.
//!
//! A store's bytes are reserved in the shared usage counter before its temp file exists and
//! released if it fails; every temp file is closed and removed on every failure path; ENOSPC
//! gets one retry after evicting.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvtier_sys::dir as confined;

use crate::config::SyncMode;
use crate::files::device::c_path;
use crate::files::mapper::FileMapper;
use crate::job::{JobState, KeyFailure};
use crate::metrics::ErrClass;
use crate::worker::shared::block_crc;
use crate::worker::{Context, Layout, Start};
use crate::Errno;

use super::layout::{FilesLayout, Kind, Op, Step, EVICT_BATCH};

impl FilesLayout {
    /// Reserves a block's bytes in device `d`'s shared usage counter (with a capacity bound;
    /// nothing without one), evicting when the bound is reached; `Err` says how the store's
    /// start ends instead (blocked until space is freed, or resolved: failed).
    fn reserve(
        &mut self,
        cx: &mut Context<Op>,
        job: &Arc<JobState>,
        item: usize,
        d: usize,
    ) -> Result<(), Start> {
        let dev = Arc::clone(&self.devs[d]);
        if let Some(cap) = dev.capacity_bytes {
            let before = match dev.usage.fetch_add(cx.block_bytes()) {
                Ok(before) => before,
                Err(e) => {
                    // The file system cannot serve the shared counter (a FUSE or network file
                    // system failing its reads): the store fails, the process lives.
                    let detail = format!(
                        "{}/.kvtier-usage: reserving {} bytes failed: {}",
                        dev.data_dir.display(),
                        cx.block_bytes(),
                        e.desc()
                    );
                    cx.store_failed(job, item, KeyFailure::Io(e), detail);
                    return Err(Start::Resolved);
                }
            };
            if before + cx.block_bytes() > cap {
                let bytes = cx.block_bytes();
                dev.unreserve(cx, bytes);
                if self.removals_in_flight > 0 {
                    return Err(Start::Blocked);
                }
                if self.evict(cx, d, EVICT_BATCH) > 0 || cx.demotion_will_free() {
                    return Err(Start::Blocked);
                }
                let detail = format!(
                    "{}: capacity_bytes {cap} reached ({before} bytes in use) and worker {} has no unpinned block to evict",
                    dev.data_dir.display(),
                    self.id
                );
                cx.store_failed(job, item, KeyFailure::NoSpace, detail);
                return Err(Start::Resolved);
            }
        }
        Ok(())
    }

    /// Starts a store: checks, reserves its bytes, opens its temp file.
    pub(super) fn begin_store(
        &mut self,
        cx: &mut Context<Op>,
        job: &Arc<JobState>,
        item: usize,
        retried: bool,
    ) -> Start {
        if retried && self.removals_in_flight > 0 {
            // Retry an ENOSPC store only once the evictions it triggered have freed the space.
            return Start::Blocked;
        }
        let key = job.job.keys[item];
        if self.index.contains(&key) {
            cx.store_present(job, item);
            return Start::Resolved;
        }
        let d = key.device(self.devs.len());
        let dev = Arc::clone(&self.devs[d]);
        if cx.device_failed(d) {
            // A block's directory is fixed by its key (vLLM's layout): no other device can
            // take it where other processes would look.
            let detail = format!(
                "devices[{d}] {} was marked failed after repeated timeouts",
                dev.data_dir.display()
            );
            cx.store_failed(job, item, KeyFailure::Io(Errno::EIO), detail);
            return Start::Resolved;
        }
        let Some(dest) = dev.path_of(&key) else {
            cx.store_failed(
                job,
                item,
                KeyFailure::InvalidJob,
                "a files-layout key is a block hash followed by a 4-byte group index".into(),
            );
            return Start::Resolved;
        };
        if self.stores_opening >= self.stores_opening_max {
            // The stores preparing get their writes out first.
            return Start::Blocked;
        }
        // Reserve the bytes before the temp file exists, so the bound holds across processes.
        if let Err(start) = self.reserve(cx, job, item, d) {
            return start;
        }
        let reserved = if dev.capacity_bytes.is_some() {
            cx.block_bytes()
        } else {
            0
        };
        let Some(idx) = Self::alloc(cx, Kind::Store) else {
            dev.unreserve(cx, reserved);
            return Start::Blocked;
        };
        self.stores_opening += 1;
        debug_assert!(self.stores_opening <= self.stores_opening_max);
        cx.ops[idx as usize].opening = true;
        let block = job.job.blocks[item];
        let crc = dev.checksums.then(|| {
            block_crc(
                job,
                cx.region_of(job),
                block as usize * cx.block_bytes() as usize,
                cx.block_bytes() as usize,
            )
        });
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let tmp = FileMapper::temp_path(&dest, self.rng >> 1);
        self.index.writing(key, d as u16, reserved > 0);
        let op = &mut cx.ops[idx as usize];
        op.begin(Step::OpenTmp);
        op.job = Some(Arc::clone(job));
        op.item = item as u32;
        op.key = Some(key);
        op.dev = d as u16;
        op.block = block;
        op.dest = dest;
        op.tmp = tmp;
        op.crc = crc;
        op.bytes = reserved;
        op.retried = retried;
        self.push_step(cx, idx);
        Start::Started
    }

    pub(super) fn on_open_tmp(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        if result == -(Errno::ENOENT as i32) && !cx.ops[idx as usize].mkdir_tried {
            // First block under this <hhh>/<hh>_g<g> directory: create it (io_uring ops, so
            // the ring thread never blocks in the file system) and try again.
            let op = &mut cx.ops[idx as usize];
            op.mkdir_tried = true;
            op.go(Step::OpenParent);
            self.push_step(cx, idx);
            return;
        }
        if result < 0 {
            let e = Errno::from_raw(-result);
            let detail = format!(
                "creating the temp file {}: {}",
                cx.ops[idx as usize].tmp.display(),
                Self::refused_or(cx, idx, e)
            );
            self.fail_store(cx, idx, KeyFailure::Io(e), detail);
            return;
        }
        let dev = Arc::clone(&self.devs[cx.ops[idx as usize].dev as usize]);
        let op = &mut cx.ops[idx as usize];
        op.fd = result;
        op.tmp_exists = true;
        if dev.chmod_files {
            // The umask took bits of `file_mode`: give them back (inode metadata, no I/O).
            if let Err(e) = confined::fchmod(op.fd, dev.file_mode) {
                let detail = format!("fchmod of the temp file: {}", e.desc());
                self.fail_store(cx, idx, KeyFailure::Io(e), detail);
                return;
            }
        }
        let on_ring = cx.backend().file_queue().xattr_ops();
        let op = &mut cx.ops[idx as usize];
        if op.crc.is_some() && on_ring {
            op.go(Step::SetXattr);
            self.push_step(cx, idx);
            return;
        }
        let set = op
            .crc
            .map(|crc| kvtier_sys::file::fsetxattr(op.fd, &dev.xattr_name, &crc.to_le_bytes()));
        if let Some(Err(e)) = set {
            self.crc_not_set(cx, idx, e);
        }
        cx.ops[idx as usize].go(Step::Write);
        self.prepared(cx, idx);
        cx.begin_writing(idx);
    }

    /// No xattrs here: the block is still stored, without a checksum (said once per store).
    fn crc_not_set(&self, cx: &mut Context<Op>, idx: u32, e: Errno) {
        cx.ops[idx as usize].crc = None;
        cx.log_error(&format!(
            "{}: cannot set {}: {}",
            self.devs[cx.ops[idx as usize].dev as usize]
                .data_dir
                .display(),
            crate::files::device::CHECKSUM_XATTR,
            e.desc()
        ));
    }

    /// The crc32c xattr was set on the ring, or could not be (the block is still stored,
    /// without a checksum): write the data.
    pub(super) fn on_set_xattr(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        if result < 0 {
            self.crc_not_set(cx, idx, Errno::from_raw(-result));
        }
        cx.ops[idx as usize].go(Step::Write);
        self.prepared(cx, idx);
        cx.begin_writing(idx);
    }

    /// The error text of op `idx`'s failed confined open or mkdir; a symlink in the way is
    /// counted.
    fn refused_or(cx: &Context<Op>, idx: u32, e: Errno) -> String {
        if matches!(e, Errno::ELOOP | Errno::EXDEV) {
            cx.metrics()
                .dev(cx.ops[idx as usize].dev as usize)
                .files_refused
                .fetch_add(1, Ordering::Relaxed);
        }
        crate::files::device::confined_error(e)
    }

    /// `<hhh>` was opened (`O_PATH`, confined) to make the leaf in it, or is missing too.
    pub(super) fn on_open_parent(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        let op = &mut cx.ops[idx as usize];
        if result >= 0 {
            op.fd = result;
            op.go(Step::MkdirLeaf);
        } else if result == -(Errno::ENOENT as i32) && !op.mkdir_parent_tried {
            op.mkdir_parent_tried = true;
            op.go(Step::MkdirParent);
        } else {
            let e = Errno::from_raw(-result);
            let detail = format!(
                "opening {}: {}",
                cx.ops[idx as usize].mkdir_target().display(),
                Self::refused_or(cx, idx, e)
            );
            self.fail_store(cx, idx, KeyFailure::Io(e), detail);
            return;
        }
        self.push_step(cx, idx);
    }

    /// A directory for a store's temp file was made (or already existed: another writer).
    pub(super) fn on_mkdir(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        let step = cx.ops[idx as usize].step;
        if result < 0 && result != -(Errno::EEXIST as i32) {
            // A failed MkdirLeaf leaves the parent's fd in `fd`: the failure path closes it.
            let e = Errno::from_raw(-result);
            let detail = format!(
                "creating {}: {}",
                cx.ops[idx as usize].mkdir_target().display(),
                e.desc()
            );
            self.fail_store(cx, idx, KeyFailure::Io(e), detail);
            return;
        }
        let dev = Arc::clone(&self.devs[cx.ops[idx as usize].dev as usize]);
        let op = &mut cx.ops[idx as usize];
        let target = op.mkdir_target().file_name().map(|n| c_path(Path::new(n)));
        let next = if step == Step::MkdirLeaf {
            let parent = std::mem::replace(&mut op.fd, -1);
            if result >= 0 && dev.chmod_dirs {
                if let Some(name) = &target {
                    let _ = confined::chmod_at(parent, name, dev.dir_mode);
                }
            }
            // An O_PATH descriptor: closing it does no I/O.
            let _ = nix::unistd::close(parent);
            Step::OpenTmp
        } else {
            if result >= 0 && dev.chmod_dirs {
                let _ = confined::chmod_at(dev.dir_fd(), &dev.rel(op.mkdir_target()), dev.dir_mode);
            }
            Step::OpenParent
        };
        cx.ops[idx as usize].go(next);
        self.push_step(cx, idx);
    }

    /// Every write of the block completed: sync (per config), close, rename; or clean up.
    pub(super) fn data_written(
        &mut self,
        cx: &mut Context<Op>,
        idx: u32,
        failure: Option<(KeyFailure, String)>,
    ) {
        if let Some((reason, detail)) = failure {
            // A write to a regular file comes back short when the file system is full (the
            // rest would fail with ENOSPC): evict and retry as for ENOSPC.
            let (reason, detail) = match reason {
                KeyFailure::ShortIo { done, wanted } => (
                    KeyFailure::Io(Errno::ENOSPC),
                    format!("short write ({done} of {wanted} bytes): the file system is full"),
                ),
                _ => (reason, detail),
            };
            self.fail_store(cx, idx, reason, detail);
            return;
        }
        let sync = self.devs[cx.ops[idx as usize].dev as usize].sync;
        cx.ops[idx as usize].go(if sync == SyncMode::Data {
            Step::Sync
        } else {
            Step::CloseTmp
        });
        self.push_step(cx, idx);
    }

    pub(super) fn on_sync(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        if result < 0 {
            let e = Errno::from_raw(-result);
            self.fail_store(
                cx,
                idx,
                KeyFailure::Io(e),
                format!("fdatasync: {}", e.desc()),
            );
            return;
        }
        cx.ops[idx as usize].go(Step::CloseTmp);
        self.push_step(cx, idx);
    }

    pub(super) fn on_close_tmp(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        cx.ops[idx as usize].fd = -1;
        if cx.ops[idx as usize].failed {
            // Closed after a failure: remove the temp file.
            cx.ops[idx as usize].go(Step::UnlinkTmp);
            self.push_step(cx, idx);
            return;
        }
        if result < 0 {
            let e = Errno::from_raw(-result);
            self.fail_store(cx, idx, KeyFailure::Io(e), format!("close: {}", e.desc()));
            return;
        }
        cx.ops[idx as usize].go(Step::Rename);
        self.push_step(cx, idx);
    }

    pub(super) fn on_rename(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        let op = &cx.ops[idx as usize];
        let (key, dev) = (op.key.expect("store has a key"), op.dev);
        if result == -(Errno::EEXIST as i32) {
            // Another writer published the same key first: same content (keys are content
            // hashes), so this store succeeded; drop our copy and our reservation.
            let d = Arc::clone(&self.devs[dev as usize]);
            let bytes = cx.ops[idx as usize].bytes;
            d.unreserve(cx, bytes);
            cx.ops[idx as usize].bytes = 0;
            self.publish(cx, key, dev, false);
            Self::succeed_store(cx, idx, 0);
            cx.ops[idx as usize].go(Step::UnlinkTmp);
            self.push_step(cx, idx);
            return;
        }
        if result < 0 {
            let e = Errno::from_raw(-result);
            self.fail_store(cx, idx, KeyFailure::Io(e), format!("rename: {}", e.desc()));
            return;
        }
        let counted = cx.ops[idx as usize].bytes > 0;
        self.publish(cx, key, dev, counted);
        if self.devs[dev as usize].sync == SyncMode::Data {
            // Make the new name durable before reporting: the directory's fsync, on the ring.
            cx.ops[idx as usize].go(Step::OpenDir);
            self.push_step(cx, idx);
            return;
        }
        Self::succeed_store(cx, idx, cx.block_bytes());
        self.release(cx, idx);
    }

    /// The directory steps of a `sync = "data"` store: open, fsync (then the store reports),
    /// close. A failure is logged and the store still reports success, as its data and name are
    /// in place (only their durability across a power loss is in doubt).
    pub(super) fn on_dir_step(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        let step = cx.ops[idx as usize].step;
        if result < 0 {
            let e = Errno::from_raw(-result);
            let dir = cx.ops[idx as usize].dest.parent().map(Path::to_path_buf);
            cx.log_error(&format!(
                "{} of the directory {}: {}",
                match step {
                    Step::OpenDir => "open",
                    Step::SyncDir => "fsync",
                    _ => "close",
                },
                dir.unwrap_or_default().display(),
                e.desc()
            ));
        }
        match step {
            Step::OpenDir if result >= 0 => {
                let op = &mut cx.ops[idx as usize];
                op.fd = result;
                op.go(Step::SyncDir);
                self.push_step(cx, idx);
            }
            Step::SyncDir => {
                Self::succeed_store(cx, idx, cx.block_bytes());
                cx.ops[idx as usize].go(Step::CloseDir);
                self.push_step(cx, idx);
            }
            // The directory could not be opened (logged), or it is closed: done.
            _ => {
                if step == Step::OpenDir {
                    Self::succeed_store(cx, idx, cx.block_bytes());
                }
                cx.ops[idx as usize].fd = -1;
                self.release(cx, idx);
            }
        }
    }

    fn succeed_store(cx: &mut Context<Op>, idx: u32, bytes: u64) {
        let op = &mut cx.ops[idx as usize];
        op.resolved = true;
        let job = op.job.clone().expect("store has a job");
        let item = op.item as usize;
        let (dev, took) = (op.dev as usize, op.started.elapsed());
        cx.metrics()
            .dev(dev)
            .store_latency
            .record(took.as_micros() as u64);
        cx.store_succeeded(&job, item, bytes);
    }

    /// Fails a store: releases its reservation and index entry, reports the key, then closes
    /// and removes the temp file as trailing steps. ENOSPC gets one retry after evicting.
    fn fail_store(
        &mut self,
        cx: &mut Context<Op>,
        idx: u32,
        reason: KeyFailure,
        mut detail: String,
    ) {
        // Every store failure names the device, the block and the step.
        detail.insert_str(0, &format!("{}: ", self.describe_op(cx, idx)));
        let op = &mut cx.ops[idx as usize];
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
        // A data write's I/O error was logged with the device's health when its chunk
        // completed; a full file system and every other step's failure are logged here.
        let no_space = matches!(reason, KeyFailure::Io(e) if ErrClass::of(e) == ErrClass::NoSpace);
        let logged = op.step == Step::Write && matches!(reason, KeyFailure::Io(_)) && !no_space;
        op.resolved = true;
        if let KeyFailure::Io(e) = reason {
            // A data write's error was counted when its chunk completed, a symlink in the way
            // as refused.
            if op.step != Step::Write && !matches!(e, Errno::ELOOP | Errno::EXDEV) {
                cx.metrics().dev(d).io_error(ErrClass::of(e));
            }
        }
        self.devs[d].unreserve(cx, reserved);
        self.index.abandon(&key);
        // Not a key its deadline failed already: its outcome is out, its blocks may be the
        // caller's again. Not after a stop either: the stop failed what was queued, and a
        // retry queued now would wait for removals a hung file system may never finish, its
        // job never reported (files campaign seed 2447).
        if no_space
            && !retried
            && !cx.stopping()
            && !job.is_resolved(item)
            && self.evict(cx, d, EVICT_BATCH) > 0
        {
            // Room may come from evicting: queue the block once more, ahead of new stores.
            cx.retry_store(job, item);
        } else {
            if !logged {
                cx.log_error(&detail);
            }
            cx.store_failed(&job, item, reason, detail);
        }
        let op = &mut cx.ops[idx as usize];
        op.failed = true;
        if had_fd {
            op.go(Step::CloseTmp);
            self.push_step(cx, idx);
        } else if had_tmp {
            op.go(Step::UnlinkTmp);
            self.push_step(cx, idx);
        } else {
            self.release(cx, idx);
        }
    }
}
