//! Loads of the `files` layout, one io_uring step at a time:
//!
//! ```text
//! openat2 (confined, O_NONBLOCK) ─► [refused: symlink, FIFO, socket, directory, too long]
//!   ─► fgetxattr crc (on the ring, 5.19+) ─► read ─► (verify crc) ─► close
//!   short or corrupt ─► close ─► unlink (the block is dropped)
//! ```
//!
//! A load result is published when its read completes; the close follows as a trailing op.
//! Keys this worker has not indexed are still tried (another process may have published them)
//! and indexed when found.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvtier_sys::dir::{self as confined, NodeKind};

use crate::files::device::FilesDevice;
use crate::io::io_outcome;
use crate::job::KeyFailure;
use crate::metrics::ErrClass;
use crate::worker::shared::block_crc;
use crate::worker::{Context, Layout};
use crate::Errno;

use super::layout::{FilesLayout, Kind, Op, Step};

impl FilesLayout {
    pub(super) fn on_open(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        let refused = self.refusal(cx, idx, result);
        if cx.ops[idx as usize].kind == Kind::Remove {
            let result = if refused.is_some() {
                -(Errno::ELOOP as i32)
            } else {
                result
            };
            self.on_demote_open(cx, idx, result);
            return;
        }
        if let Some(why) = refused {
            cx.metrics()
                .dev(cx.ops[idx as usize].dev as usize)
                .files_refused
                .fetch_add(1, Ordering::Relaxed);
            cx.log_error(&why);
            self.forget(cx, idx);
            Self::finish_load(cx, idx, Err((KeyFailure::Refused, why)));
            self.end_load(cx, idx);
            return;
        }
        if result < 0 {
            let e = Errno::from_raw(-result);
            if e == Errno::ENOENT {
                // Gone (evicted by another process, or never stored): a miss, and forget it.
                cx.metrics().load_misses.fetch_add(1, Ordering::Relaxed);
                self.forget(cx, idx);
                Self::finish_load(cx, idx, Err((KeyFailure::Miss, String::new())));
            } else {
                let d = cx.ops[idx as usize].dev as usize;
                cx.metrics().dev(d).io_error(ErrClass::of(e));
                let what = self.describe_op(cx, idx);
                cx.device_error(d, &format!("{what}: open: {}", e.desc()));
                Self::finish_load(
                    cx,
                    idx,
                    Err((KeyFailure::Io(e), format!("open: {}", e.desc()))),
                );
            }
            self.end_load(cx, idx);
            return;
        }
        self.start_read(cx, idx, result);
    }

    /// Op `idx` opened its block file as `fd` (a load, or a demotion's read): the crc32c
    /// xattr on the ring when the kernel can (then the read, in `on_get_xattr`), else by a
    /// call here; then the read.
    pub(super) fn start_read(&mut self, cx: &mut Context<Op>, idx: u32, fd: i32) {
        let dev = Arc::clone(&self.devs[cx.ops[idx as usize].dev as usize]);
        let on_ring = dev.checksums && cx.backend().file_queue().xattr_ops();
        let crc = if dev.checksums && !on_ring {
            read_crc(fd, &dev)
        } else {
            None
        };
        let op = &mut cx.ops[idx as usize];
        op.fd = fd;
        op.crc = crc;
        op.go(if on_ring { Step::GetXattr } else { Step::Read });
        self.push_step(cx, idx);
    }

    /// The block's crc32c xattr was read on the ring (4 bytes), or it has none: read the data.
    pub(super) fn on_get_xattr(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        // Always taken, so the buffer does not stay behind in the ring.
        let user_data = cx.ops.user_data(idx, 0);
        let value = cx.backend().file_queue().take_file_value(user_data);
        let crc = match (result, value) {
            (4, Some(v)) if v.len() >= 4 => Some(u32::from_le_bytes([v[0], v[1], v[2], v[3]])),
            _ => None,
        };
        let op = &mut cx.ops[idx as usize];
        op.crc = crc;
        op.go(Step::Read);
        self.push_step(cx, idx);
    }

    /// Load `idx` found its file gone or refused: unindexes the entry it pinned unless other
    /// loads still read it (they opened the file before it went). An entry that is not the one
    /// it pinned (a store of the key begun or finished since) is left alone, as is a key it
    /// did not find indexed.
    pub(super) fn forget(&mut self, cx: &mut Context<Op>, idx: u32) {
        let op = &cx.ops[idx as usize];
        let Some((key, pin)) = op.key.zip(op.pin) else {
            return;
        };
        if self.index.pinned_only_by(&key, pin) && self.unindex(cx, &key).is_some() {
            cx.announce_removed(vec![key]);
        }
    }

    /// Why the node an `Open` step reached (or failed to reach) must not be read: a symlink on
    /// the way (the confined open's ELOOP/EXDEV), or something other than a regular file (an
    /// open fd of it is closed here). `None` for a regular file and for ordinary errors.
    pub(super) fn refusal(&self, cx: &Context<Op>, idx: u32, result: i32) -> Option<String> {
        let op = &cx.ops[idx as usize];
        let dev = &self.devs[op.dev as usize];
        let kind = if result >= 0 {
            match confined::fd_stat(result) {
                // Longer than a block: not a block file (the scan leaves such files alone too).
                Ok((NodeKind::Regular, size)) if size > cx.block_bytes() => {
                    let _ = nix::unistd::close(result);
                    return Some(format!(
                        "{} is {size} bytes, longer than a block ({} bytes): not a block file, \
                         refused and left alone",
                        op.dest.display(),
                        cx.block_bytes()
                    ));
                }
                Ok((NodeKind::Regular, _)) | Err(_) => return None,
                Ok((kind, _)) => {
                    // Not a file kvtier reads; a plain close of what was opened O_NONBLOCK.
                    let _ = nix::unistd::close(result);
                    kind
                }
            }
        } else {
            match Errno::from_raw(-result) {
                Errno::ENOENT | Errno::EACCES | Errno::EPERM | Errno::EMFILE | Errno::ENFILE => {
                    return None
                }
                Errno::ELOOP | Errno::EXDEV => NodeKind::Symlink,
                // ENXIO (a socket), EISDIR/EINVAL (a directory with O_DIRECT), ...: look.
                _ => match confined::kind_at(dev.dir_fd(), &dev.rel(&op.dest)) {
                    Ok((kind, _)) if kind != NodeKind::Regular => kind,
                    _ => return None,
                },
            }
        };
        Some(if kind == NodeKind::Symlink {
            format!(
                "{}: a symlink is at or above this block path; kvtier never follows symlinks \
                 below the configured root: refused",
                op.dest.display()
            )
        } else {
            format!(
                "{} is {}, not a regular file: refused",
                op.dest.display(),
                kind.describe()
            )
        })
    }

    pub(super) fn on_read(&mut self, cx: &mut Context<Op>, idx: u32, result: i32) {
        if cx.ops[idx as usize].kind == Kind::Remove {
            self.on_demote_read(cx, idx, result);
            return;
        }
        let m = cx.metrics().dev(cx.ops[idx as usize].dev as usize);
        m.read_ops.fetch_add(1, Ordering::Relaxed);
        let wanted = cx.block_bytes() as u32;
        let op = &cx.ops[idx as usize];
        let (block, crc, key) = (op.block, op.crc, op.key.expect("load has a key"));
        let d = op.dev as usize;
        let outcome = if let Err(reason) = io_outcome(result, u64::from(wanted)) {
            m.count_result(result, u64::from(wanted));
            Err(match reason {
                KeyFailure::Io(e) => {
                    let what = self.describe_op(cx, idx);
                    cx.device_error(d, &format!("{what}: read: {}", e.desc()));
                    (reason, format!("read: {}", e.desc()))
                }
                // Stores are atomic (temp file + rename), so a short file is corrupt: drop it.
                _ => (reason, "short file removed".into()),
            })
        } else {
            m.bytes_read.fetch_add(u64::from(wanted), Ordering::Relaxed);
            cx.device_ok(d, || self.device_name(d));
            match crc {
                Some(want) => {
                    let job = op.job.as_ref().expect("load has a job");
                    let got = block_crc(
                        job,
                        cx.region_of(job),
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
        if outcome.is_ok() && !self.index.contains(&key) {
            // Published by another process since our scan: index it now, pinned by this load.
            let dev = cx.ops[idx as usize].dev;
            self.publish(cx, key, dev, false);
            cx.ops[idx as usize].pin = self.index.pin(&key);
        }
        if bad {
            // Reported once the file is gone (`on_unlink`); the index forgets it now.
            cx.ops[idx as usize].pending_failure = outcome.err();
        } else {
            Self::finish_load(cx, idx, outcome);
        }
        if bad {
            // Remove the file after closing it; the removal is this op's trailing step.
            // Whatever entry the key has: the file at its path is the one being removed.
            let entry = self.unindex(cx, &key);
            cx.announce_removed(vec![key]);
            let block_bytes = cx.block_bytes();
            let op = &mut cx.ops[idx as usize];
            op.pin = None;
            op.bytes = if entry.is_some_and(|e| e.counted) {
                block_bytes
            } else {
                0
            };
            op.kind = Kind::Remove;
            self.removals_in_flight += 1;
            cx.end_load(idx);
        }
        cx.ops[idx as usize].go(Step::Close);
        self.push_step(cx, idx);
    }

    pub(super) fn on_close(&mut self, cx: &mut Context<Op>, idx: u32) {
        if cx.ops[idx as usize].kind == Kind::Remove {
            cx.ops[idx as usize].go(Step::Unlink);
            self.push_step(cx, idx);
            return;
        }
        self.end_load(cx, idx);
    }

    /// Reports the key's outcome (once).
    pub(super) fn finish_load(
        cx: &mut Context<Op>,
        idx: u32,
        outcome: Result<(), (KeyFailure, String)>,
    ) {
        let op = &mut cx.ops[idx as usize];
        if op.resolved {
            return;
        }
        op.resolved = true;
        let job = op.job.clone().expect("load has a job");
        let (item, dev, started) = (op.item as usize, op.dev as usize, op.started);
        cx.report_load(&job, item, dev, started, outcome);
    }

    /// Unpins and frees a finished load op.
    pub(super) fn end_load(&mut self, cx: &mut Context<Op>, idx: u32) {
        let op = &mut cx.ops[idx as usize];
        if let Some((key, pin)) = op.key.zip(op.pin.take()) {
            self.index.unpin(&key, pin);
        }
        self.release(cx, idx);
    }
}

/// The block's crc32c from its xattr, if it has one.
pub(super) fn read_crc(fd: i32, dev: &FilesDevice) -> Option<u32> {
    let mut buf = [0u8; 4];
    match kvtier_sys::file::fgetxattr(fd, &dev.xattr_name, &mut buf) {
        Ok(Some(4)) => Some(u32::from_le_bytes(buf)),
        _ => None,
    }
}
