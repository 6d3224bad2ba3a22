//! How each step of a files-layout op becomes one file operation on the worker's ring, and
//! what happens when the submission queue is full (the op waits in `stalled`).

use std::path::Path;

use nix::fcntl::OFlag;

use crate::files::device::c_path;
use crate::io::{FileOp, IoBuf, IoClass};
use crate::worker::{region_buffer, Context, BUF_STAGING};

use super::layout::{FilesLayout, RENAME_NOREPLACE};
use super::op::{Kind, Op, Step};

impl FilesLayout {
    /// Pushes the SQE for `idx`'s current step; on a full SQ parks the op in `stalled`.
    pub(super) fn push_step(&mut self, cx: &mut Context<Op>, idx: u32) {
        if !self.try_push_step(cx, idx) {
            self.stalled.push_back(idx);
        }
    }

    pub(super) fn try_push_step(&mut self, cx: &mut Context<Op>, idx: u32) -> bool {
        let op = &cx.ops[idx as usize];
        let dev = &self.devs[op.dev as usize];
        let direct = if dev.direct { O_DIRECT } else { 0 };
        let class = match op.kind {
            Kind::Load => IoClass::Load,
            Kind::Store | Kind::Remove => IoClass::Store,
            Kind::Probe => IoClass::Meta,
        };
        let user_data = cx.ops.user_data(idx, 0);
        let at = dev.dir_fd();
        let dest = dev.rel(&op.dest);
        let tmp = dev.rel(&op.tmp);
        let claim = (op.step == Step::Read).then(|| Self::claim_read(cx, idx));
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
                buf: claim
                    .as_ref()
                    .map(|(region, c)| c.buf_ref(*region))
                    .expect("claimed above"),
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
                return self.push_dir_step(cx, idx, class);
            }
            Step::Write => unreachable!("writes are pushed chunk by chunk"),
        };
        cx.backend()
            .file_queue()
            .push_file(user_data, &file_op, claim, class)
    }

    /// The one step that moves block bytes: the read of a load (into the job's block) or of a
    /// demotion (into its staging slot), claimed for the transfer.
    fn claim_read(cx: &Context<Op>, idx: u32) -> (u16, IoBuf) {
        let op = &cx.ops[idx as usize];
        let bytes = cx.block_bytes() as usize;
        if let Some(slot) = op.staging {
            let claim = cx
                .demoting()
                .and_then(|m| m.staging.checkout(slot as usize * bytes, bytes, true).ok())
                .expect("a staging slot taken for a read is the worker's, unclaimed");
            return (BUF_STAGING, claim);
        }
        let job = op.job.as_ref().expect("a load op has a job");
        (
            region_buffer(job.region),
            cx.claim_block(job, op.block, true),
        )
    }

    /// The directory steps of `idx`: opening the block's directory (to fsync it) or `<hhh>`,
    /// and making `<hhh>` or the leaf.
    fn push_dir_step(&self, cx: &mut Context<Op>, idx: u32, class: IoClass) -> bool {
        let op = &cx.ops[idx as usize];
        let dev = &self.devs[op.dev as usize];
        let at = dev.dir_fd();
        let user_data = cx.ops.user_data(idx, 0);
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
        cx.backend()
            .file_queue()
            .push_file(user_data, &file_op, None, class)
    }

    pub(super) fn push_stalled(&mut self, cx: &mut Context<Op>) -> bool {
        let mut any = false;
        while let Some(&idx) = self.stalled.front() {
            if !self.try_push_step(cx, idx) {
                break;
            }
            self.stalled.pop_front();
            any = true;
        }
        any
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
