//! The file-system operations a ring runs for the one-file-per-block layout ([`FileOp`]), and
//! the ring-owned copies of what the kernel reads or writes for them (paths, `open_how`, xattr
//! values, `statx` buffers) until it is done with them (`PathStore`).

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::fd::RawFd;

use io_uring::{opcode, squeue, types};

use super::{BufRef, Ring, SqFull};
use crate::blocks::IoBuf;

/// `renameat2` flag: fail with EEXIST instead of replacing an existing target.
pub const RENAME_NOREPLACE: u32 = libc::RENAME_NOREPLACE;

/// A file-system operation for [`Ring::push_file_op`]. Paths are copied into ring-owned storage
/// at push time and freed when the completion is popped by [`Ring::complete`], so the caller's
/// `&CStr` need not outlive the push. Relative paths resolve against `dir`, a directory fd (or
/// [`AT_FDCWD`] for the current directory), when the kernel prepares the operation, i.e. at
/// submit time; `dir` must stay open until then.
///
/// A plain fd given to `ReadFd`, `WriteFd`, `Fsync` or `Close` must stay open, and keep naming
/// the same file, until the operation completes: that is the caller's job (the engine closes a
/// block's fd only after its last completion). A violation cannot corrupt memory: once
/// submitted the kernel holds its own file reference, and before that a closed fd fails with
/// EBADF, a reused fd number reaches the wrong file.
#[derive(Clone, Copy, Debug)]
pub enum FileOp<'a> {
    /// `openat2(dir, path, {flags | O_CLOEXEC, mode, resolve})`; the result is a plain fd (not
    /// a fixed/direct descriptor), owned by the caller, who closes it (e.g. with `Close`). With
    /// `confined`, `resolve` is [`RESOLVE_CONFINED`]: no symlink is followed anywhere in `path`
    /// (ELOOP) and `path` cannot leave `dir` (EXDEV).
    OpenAt {
        dir: RawFd,
        path: &'a CStr,
        flags: i32,
        mode: u32,
        confined: bool,
    },
    /// `READ_FIXED` of `buf.len` bytes at byte `offset` of plain fd `fd` into registered `buf`.
    ReadFd { fd: RawFd, offset: u64, buf: BufRef },
    /// `WRITE_FIXED` of registered `buf` to byte `offset` of plain fd `fd`.
    WriteFd { fd: RawFd, offset: u64, buf: BufRef },
    /// `close(fd)`.
    Close { fd: RawFd },
    /// `renameat2(dir, from, dir, to, flags)`, e.g. [`RENAME_NOREPLACE`].
    RenameAt {
        dir: RawFd,
        from: &'a CStr,
        to: &'a CStr,
        flags: u32,
    },
    /// `unlinkat(dir, path, 0)` (files only, not directories).
    UnlinkAt { dir: RawFd, path: &'a CStr },
    /// `fdatasync(fd)` if `data_only`, else `fsync(fd)`.
    Fsync { fd: RawFd, data_only: bool },
    /// `mkdirat(dir, path, mode)`.
    MkdirAt {
        dir: RawFd,
        path: &'a CStr,
        mode: u32,
    },
    /// `fsetxattr(fd, name, value, 0)` (create or replace); `name` and `value` are copied.
    /// Linux 5.19: check [`Ring::supports_xattr_ops`].
    SetXattr {
        fd: RawFd,
        name: &'a CStr,
        value: &'a [u8],
    },
    /// `fgetxattr(fd, name, buf, len)` into a buffer of `len` bytes the ring owns: the result
    /// is the value's length, or -errno (`ENODATA`: no such attribute, `ERANGE`: longer than
    /// `len`). Once the completion is popped, [`Ring::take_value`] hands the buffer over.
    /// Linux 5.19: check [`Ring::supports_xattr_ops`].
    GetXattr { fd: RawFd, name: &'a CStr, len: u32 },
    /// `statx(dir, path, AT_SYMLINK_NOFOLLOW, STATX_TYPE | STATX_SIZE)` into a buffer the ring
    /// owns: once the completion (0 or -errno) is popped, [`Ring::take_value`] hands it over
    /// and [`StatxInfo::parse`] reads it. A symlink at `path` itself is reported as one, never
    /// followed.
    Statx { dir: RawFd, path: &'a CStr },
}

/// What a [`FileOp::Statx`] learnt: the file's type bits (`S_IFMT` of `st_mode`) and size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatxInfo {
    pub mode: u32,
    pub size: u64,
}

impl StatxInfo {
    /// Bytes the kernel writes for a [`FileOp::Statx`].
    pub const BYTES: usize = std::mem::size_of::<libc::statx>();

    /// Reads the mode and size out of a [`FileOp::Statx`] buffer; `None` if it is too short.
    pub fn parse(buf: &[u8]) -> Option<StatxInfo> {
        if buf.len() < Self::BYTES {
            return None;
        }
        // SAFETY: `buf` holds at least size_of::<statx>() initialised bytes, `read_unaligned`
        // copies them whatever their alignment, and every bit pattern is a valid `statx`
        // (integers only).
        let st: libc::statx = unsafe { std::ptr::read_unaligned(buf.as_ptr().cast()) };
        Some(StatxInfo {
            mode: u32::from(st.stx_mode) & libc::S_IFMT,
            size: st.stx_size,
        })
    }

    /// Whether it is a regular file.
    pub fn is_regular(&self) -> bool {
        self.mode == libc::S_IFREG
    }
}

/// The current directory as the `dir` of a [`FileOp`].
pub const AT_FDCWD: RawFd = libc::AT_FDCWD;

/// The `resolve` flags of a confined [`FileOp::OpenAt`]: `RESOLVE_NO_SYMLINKS |
/// RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`.
pub const RESOLVE_CONFINED: u64 =
    libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;

/// Opcodes [`FileOp`] needs (`OpenAt2` arrived in 5.6, `UnlinkAt`/`RenameAt` in 5.11,
/// `MkDirAt` in 5.15, `Statx` in 5.6).
pub(super) const FILE_OPCODES: [u8; 9] = [
    opcode::OpenAt2::CODE,
    opcode::Statx::CODE,
    opcode::Close::CODE,
    opcode::RenameAt::CODE,
    opcode::UnlinkAt::CODE,
    opcode::MkDirAt::CODE,
    opcode::Fsync::CODE,
    opcode::ReadFixed::CODE,
    opcode::WriteFixed::CODE,
];

/// The path copies of one queued [`FileOp`].
#[derive(Debug)]
pub(super) struct OwnedPaths {
    /// Position of the op's SQE among all SQEs pushed on the ring ([`Ring::pushed`]).
    pub(super) seq: u64,
    /// The kernel reads these through raw pointers; a `CString`'s bytes live on the heap and do
    /// not move when the `CString` itself is moved.
    // Never read by Rust: only kept alive for the kernel.
    #[allow(dead_code)]
    pub(super) paths: Vec<CString>,
    /// The `open_how` of an `OpenAt`, read by the kernel at the same time as its path.
    #[allow(dead_code)]
    pub(super) how: Option<Box<types::OpenHow>>,
    /// A `SetXattr`'s value (read by the kernel) or a `GetXattr`'s or `Statx`'s buffer
    /// (written by the kernel before it posts the completion; handed to the caller then, see
    /// `values`).
    pub(super) value: Option<Value>,
}

/// The bytes an xattr or statx op's SQE points at.
#[derive(Debug)]
pub(super) struct Value {
    // Read by Rust only when `out` (after the completion).
    #[allow(dead_code)]
    pub(super) bytes: Box<[u8]>,
    /// A `GetXattr` or `Statx` buffer: moved to `PathStore::values` when its completion is
    /// popped.
    pub(super) out: bool,
}

/// Copies of the paths of queued [`FileOp`]s.
///
/// A copy is *retired* when a completion with its `user_data` is popped, and *freed* once it is
/// retired and the kernel has consumed its SQE (the kernel consumes SQEs in push order, so that
/// is `seq < consumed`). With unique `user_data` (the contract) the two coincide, except with
/// SQPOLL, whose kernel thread may post a CQE just before it publishes the new SQ head: then the
/// copy is freed at a later [`Ring::complete`] or in `Drop`. The second condition is what keeps
/// a contract violation sound: the completion of another operation with the same `user_data`
/// cannot free a path the kernel has not read yet; once the SQE is consumed the kernel has
/// copied the path into its own memory (`getname` when it prepares the request; the guarantee
/// that `IORING_FEAT_SUBMIT_STABLE`, 5.5, advertises).
#[derive(Debug, Default)]
pub(super) struct PathStore {
    /// Copies whose completion has not been popped, by `user_data` (oldest first).
    pub(super) live: HashMap<u64, Vec<OwnedPaths>>,
    /// Copies whose completion was popped but whose SQE the kernel had not consumed yet.
    pub(super) retired: Vec<OwnedPaths>,
    /// `GetXattr` buffers whose completion was popped (the kernel is done with them), by
    /// `user_data`, until [`Ring::take_value`].
    pub(super) values: HashMap<u64, Box<[u8]>>,
}

impl PathStore {
    pub(super) fn is_empty(&self) -> bool {
        self.live.is_empty() && self.retired.is_empty()
    }

    /// Number of operations whose path copies are held.
    pub(super) fn len(&self) -> usize {
        self.live.values().map(Vec::len).sum::<usize>() + self.retired.len()
    }

    pub(super) fn insert(&mut self, user_data: u64, owned: OwnedPaths) {
        self.live.entry(user_data).or_default().push(owned);
    }

    /// A completion with `user_data` was popped: retires the oldest copy queued with it.
    pub(super) fn retire(&mut self, user_data: u64) {
        let Some(queued) = self.live.get_mut(&user_data) else {
            return;
        };
        let mut oldest = queued.remove(0);
        if queued.is_empty() {
            self.live.remove(&user_data);
        }
        // The completion is posted after the kernel wrote a GetXattr's value: the buffer is
        // the caller's from now on.
        if let Some(Value { bytes, out: true }) = oldest.value.take() {
            self.values.insert(user_data, bytes);
        }
        self.retired.push(oldest);
    }

    /// Frees every retired copy whose SQE is among the first `consumed` SQEs of the ring.
    pub(super) fn release(&mut self, consumed: u64) {
        self.retired.retain(|owned| owned.seq >= consumed);
    }
}

impl Ring {
    /// Queues `op` with `user_data`, which must be unique among this ring's in-flight operations
    /// (asserted in debug builds). `ioprio` (see [`ioprio`](super::ioprio)) applies to
    /// `ReadFd`/`WriteFd` only: some kernels refuse a non-zero ioprio on the other opcodes.
    ///
    /// `Err(SqFull)` if the SQ has no room: nothing is queued and nothing kept. Buffer rules are
    /// those of [`Ring::push_read`]: panics if `buf` is empty, outside its region, straddles a
    /// registered piece or names an unregistered region. The result of the completion is that of
    /// the syscall (a new fd for `OpenAt`, bytes for `ReadFd`/`WriteFd`, 0 otherwise) or
    /// `-errno`. Check [`Ring::supports_file_ops`] first: on an older kernel the CQE carries
    /// -EINVAL.
    ///
    /// Panics on `ReadFd` and `WriteFd`: they move the caller's memory, and go through
    /// [`Ring::push_file_io`] with a transfer token.
    pub fn push_file_op(
        &mut self,
        user_data: u64,
        op: &FileOp<'_>,
        ioprio: u16,
    ) -> Result<(), SqFull> {
        assert!(
            !matches!(op, FileOp::ReadFd { .. } | FileOp::WriteFd { .. }),
            "push_file_op: {op:?} moves caller memory; push it with push_file_io and a token"
        );
        // SAFETY: no ReadFd or WriteFd (asserted): nothing of the caller's outlives the call.
        unsafe { self.push_file_io_raw(user_data, op, ioprio) }
    }

    /// Queues a `ReadFd` or `WriteFd` on the bytes `buf` claims, in the region registered as
    /// `region` (the op's `buf` must name exactly them); the ring keeps `buf` until it pops the
    /// completion, as [`Ring::push_read`] does. Panics on another operation, on a `ReadFd`
    /// with a claim only to read, or if the op's buffer is not the claim's.
    pub fn push_file_io(
        &mut self,
        user_data: u64,
        op: &FileOp<'_>,
        region: u16,
        buf: IoBuf,
        ioprio: u16,
    ) -> Result<(), SqFull> {
        let (named, writes_memory) = match *op {
            FileOp::ReadFd { buf, .. } => (buf, true),
            FileOp::WriteFd { buf, .. } => (buf, false),
            _ => panic!("push_file_io: {op:?} moves no caller memory; use push_file_op"),
        };
        assert!(
            !writes_memory || buf.device_writes(),
            "a read into bytes claimed only to be read"
        );
        let claimed = self.claimed(region, &buf);
        assert!(
            (named.region, named.offset, named.len)
                == (claimed.region, claimed.offset, claimed.len),
            "push_file_io: the op names {named:?}, the claim {claimed:?}"
        );
        // SAFETY: `buf` claims exactly the op's bytes for this transfer (checked): the region's
        // blocks are leased, and the lease's accessors refuse what the transfer may race with,
        // until the ring drops the claim with the completion.
        unsafe { self.push_file_io_raw(user_data, op, ioprio) }?;
        self.claims.keep(user_data, buf);
        Ok(())
    }

    /// [`Ring::push_file_op`] for any operation, `ReadFd` and `WriteFd` included.
    ///
    /// # Safety
    ///
    /// For `ReadFd` and `WriteFd`, the contract of [`Ring::push_read_raw`] and
    /// [`Ring::push_write_raw`] on their `buf`. The other operations carry no caller memory past the call (paths and
    /// values are copied) and have nothing to uphold.
    pub unsafe fn push_file_io_raw(
        &mut self,
        user_data: u64,
        op: &FileOp<'_>,
        ioprio: u16,
    ) -> Result<(), SqFull> {
        #[cfg(debug_assertions)]
        assert!(
            !self.live_user_data.contains_key(&user_data),
            "push_file_op: user_data {user_data:#x} is already in flight on this ring"
        );
        // A GetXattr's buffer is handed over when a completion with its user_data is popped:
        // with a second op of the same user_data in flight, that completion could be the other
        // op's while the kernel still writes the buffer. So an op that keeps memory (paths,
        // values) never shares its user_data with another such op, in release builds too.
        assert!(
            !self.paths.live.contains_key(&user_data),
            "push_file_op: user_data {user_data:#x} already has a file op in flight on this ring"
        );
        let mut paths = Vec::new();
        let mut how = None;
        let mut value = None;
        let entry = self
            .file_op_entry(op, ioprio, &mut paths, &mut how, &mut value)
            .user_data(user_data);
        let seq = self.pushed;
        // SAFETY: each path pointer in `entry` points into a CString of `paths`, and an xattr
        // value pointer into the boxed bytes of `value`; both are moved (heap bytes unmoved)
        // into `self.paths` right after a successful push and freed only once the completion
        // is popped and the SQE consumed, or after Drop has drained (a GetXattr buffer, which
        // the kernel writes before posting the completion, is handed to the caller only once
        // that completion is popped); a fixed buffer lies inside one registered piece of a
        // region this ring keeps alive until Drop has drained (checked by fixed_buf), and the
        // caller keeps other access off it until the completion (this fn's contract); a plain
        // fd closed early is EBADF, not memory.
        unsafe { self.push_entry(&entry) }?;
        if !paths.is_empty() || value.is_some() {
            self.paths.insert(
                user_data,
                OwnedPaths {
                    seq,
                    paths,
                    how,
                    value,
                },
            );
        }
        Ok(())
    }

    /// Whether the running kernel supports every opcode [`FileOp`] needs (`IORING_REGISTER_PROBE`:
    /// OpenAt2, Statx, Close, RenameAt, UnlinkAt, MkDirAt, Fsync, ReadFixed, WriteFixed; Linux
    /// 5.15+),
    /// except the xattr ops (see [`Ring::supports_xattr_ops`]).
    pub fn supports_file_ops(&self) -> bool {
        self.probe_opcodes()
            .is_ok_and(|probe| FILE_OPCODES.iter().all(|&code| probe.is_supported(code)))
    }

    /// Whether [`FileOp::SetXattr`] and [`FileOp::GetXattr`] run here (`FSETXATTR`,
    /// `FGETXATTR`: Linux 5.19+).
    pub fn supports_xattr_ops(&self) -> bool {
        self.probe_opcodes().is_ok_and(|probe| {
            probe.is_supported(opcode::FSetXattr::CODE)
                && probe.is_supported(opcode::FGetXattr::CODE)
        })
    }

    /// The buffer of a completed [`FileOp::GetXattr`] (its first `result` bytes are the value)
    /// or [`FileOp::Statx`] pushed with `user_data`, once its completion has been popped,
    /// whatever its result (take it, or it is kept until the ring is dropped); `None` before,
    /// or for another op.
    pub fn take_value(&mut self, user_data: u64) -> Option<Box<[u8]>> {
        self.paths.values.remove(&user_data)
    }

    /// Builds the SQE of `op` (without user_data), copying its paths into `paths` and an open's
    /// `open_how` into `how`.
    fn file_op_entry(
        &self,
        op: &FileOp<'_>,
        ioprio: u16,
        paths: &mut Vec<CString>,
        how: &mut Option<Box<types::OpenHow>>,
        value: &mut Option<Value>,
    ) -> squeue::Entry {
        let mut keep = |path: &CStr| {
            let owned = path.to_owned();
            let ptr = owned.as_ptr();
            paths.push(owned);
            ptr
        };
        match *op {
            FileOp::OpenAt {
                dir,
                path,
                flags,
                mode,
                confined,
            } => {
                let flags = flags | libc::O_CLOEXEC;
                // openat2 refuses a mode without O_CREAT / O_TMPFILE.
                let creates = flags & (libc::O_CREAT | libc::O_TMPFILE) != 0;
                let flags = u64::from(flags.cast_unsigned());
                let open_how = types::OpenHow::new()
                    .flags(flags)
                    .mode(if creates { u64::from(mode) } else { 0 })
                    .resolve(if confined { RESOLVE_CONFINED } else { 0 });
                let open_how: &types::OpenHow = how.insert(Box::new(open_how));
                opcode::OpenAt2::new(types::Fd(dir), keep(path), open_how).build()
            }
            FileOp::ReadFd { fd, offset, buf } => {
                let (ptr, index) = self.fixed_buf(buf);
                opcode::ReadFixed::new(types::Fd(fd), ptr, buf.len, index)
                    .offset(offset)
                    .ioprio(ioprio)
                    .build()
            }
            FileOp::WriteFd { fd, offset, buf } => {
                let (ptr, index) = self.fixed_buf(buf);
                opcode::WriteFixed::new(types::Fd(fd), ptr.cast_const(), buf.len, index)
                    .offset(offset)
                    .ioprio(ioprio)
                    .build()
            }
            FileOp::Close { fd } => opcode::Close::new(types::Fd(fd)).build(),
            FileOp::RenameAt {
                dir,
                from,
                to,
                flags,
            } => {
                let (from, to) = (keep(from), keep(to));
                opcode::RenameAt::new(types::Fd(dir), from, types::Fd(dir), to)
                    .flags(flags)
                    .build()
            }
            FileOp::UnlinkAt { dir, path } => {
                opcode::UnlinkAt::new(types::Fd(dir), keep(path)).build()
            }
            FileOp::Fsync { fd, data_only } => {
                let flags = if data_only {
                    types::FsyncFlags::DATASYNC
                } else {
                    types::FsyncFlags::empty()
                };
                opcode::Fsync::new(types::Fd(fd)).flags(flags).build()
            }
            FileOp::MkdirAt { dir, path, mode } => opcode::MkDirAt::new(types::Fd(dir), keep(path))
                .mode(mode)
                .build(),
            FileOp::SetXattr {
                fd,
                name,
                value: bytes,
            } => {
                let name = keep(name);
                let v = value.insert(Value {
                    bytes: bytes.into(),
                    out: false,
                });
                let len = u32::try_from(v.bytes.len()).expect("an xattr value fits u32");
                opcode::FSetXattr::new(types::Fd(fd), name, v.bytes.as_ptr().cast(), len).build()
            }
            FileOp::GetXattr { fd, name, len } => {
                let name = keep(name);
                let v = value.insert(Value {
                    bytes: vec![0u8; len as usize].into_boxed_slice(),
                    out: true,
                });
                opcode::FGetXattr::new(types::Fd(fd), name, v.bytes.as_mut_ptr().cast(), len)
                    .build()
            }
            FileOp::Statx { dir, path } => {
                let path = keep(path);
                let v = value.insert(Value {
                    bytes: vec![0u8; StatxInfo::BYTES].into_boxed_slice(),
                    out: true,
                });
                opcode::Statx::new(types::Fd(dir), path, v.bytes.as_mut_ptr().cast())
                    .flags(libc::AT_SYMLINK_NOFOLLOW)
                    .mask(libc::STATX_TYPE | libc::STATX_SIZE)
                    .build()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Bookkeeping of path copies: held while an operation is queued or in flight, freed when its
    //! completion is popped, never kept for a push refused with SqFull, and never freed by the
    //! completion of another operation with the same `user_data` before the kernel consumed the
    //! SQE. A failure here means a path could be freed under the kernel or leak.
    use super::*;
    use crate::ring::RingConfig;

    fn ring_with_file_ops(entries: u32) -> Option<Ring> {
        let cfg = RingConfig {
            entries,
            ..RingConfig::default()
        };
        match Ring::new(&cfg) {
            Ok(ring) if ring.supports_file_ops() => Some(ring),
            Ok(_) => {
                crate::skip!("kernel lacks the io_uring file opcodes");
                None
            }
            Err(e) => {
                crate::skip!("io_uring unavailable: {e}");
                None
            }
        }
    }

    fn missing_path(i: u32) -> CString {
        CString::new(format!(
            "/var/tmp/kvtier-sys-missing-{}-{i}",
            std::process::id()
        ))
        .expect("no NUL")
    }

    #[test]
    fn path_copy_lives_until_its_completion_is_popped() {
        let Some(mut ring) = ring_with_file_ops(8) else {
            return;
        };
        {
            let path = missing_path(1);
            ring.push_file_op(
                5,
                &FileOp::UnlinkAt {
                    dir: AT_FDCWD,
                    path: &path,
                },
                0,
            )
            .expect("push");
        }
        assert_eq!(ring.paths.len(), 1);
        let mut out = Vec::new();
        while out.is_empty() {
            ring.submit(1).expect("submit");
            ring.complete(&mut out);
        }
        assert_eq!((out[0].user_data, out[0].result), (5, -libc::ENOENT));
        assert_eq!(ring.paths.len(), 0, "{:?}", ring.paths);
        assert_eq!(ring.in_flight(), 0);
    }

    /// FSETXATTR copies name and value; FGETXATTR writes into a ring-owned buffer handed over
    /// once its completion is popped; an absent attribute is ENODATA, a short buffer ERANGE.
    #[test]
    fn xattrs_are_set_and_read_on_the_ring() {
        let Some(mut ring) = ring_with_file_ops(8) else {
            return;
        };
        if !ring.supports_xattr_ops() {
            return crate::skip!("no FSETXATTR/FGETXATTR (Linux 5.19+)");
        }
        let dir = tempfile::tempdir_in("/var/tmp").expect("dir");
        let file = std::fs::File::create(dir.path().join("f")).expect("file");
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        let run = |ring: &mut Ring, ud: u64, op: &FileOp<'_>| -> i32 {
            ring.push_file_op(ud, op, 0).expect("push");
            let mut out = Vec::new();
            while out.is_empty() {
                ring.submit(1).expect("submit");
                ring.complete(&mut out);
            }
            assert_eq!(out[0].user_data, ud);
            out[0].result
        };
        {
            let value = 0xdead_beef_u32.to_le_bytes();
            let name = c"user.kvtier.test".to_owned();
            let r = run(
                &mut ring,
                1,
                &FileOp::SetXattr {
                    fd,
                    name: &name,
                    value: &value,
                },
            );
            if r == -libc::EOPNOTSUPP {
                return crate::skip!("no user xattrs on /var/tmp");
            }
            assert_eq!(r, 0);
        }
        assert!(ring.take_value(1).is_none(), "a set hands nothing back");
        let get = |len| FileOp::GetXattr {
            fd,
            name: c"user.kvtier.test",
            len,
        };
        assert!(ring.take_value(2).is_none(), "nothing before the op");
        assert_eq!(run(&mut ring, 2, &get(8)), 4);
        let v = ring.take_value(2).expect("the buffer");
        assert_eq!(v.len(), 8);
        assert_eq!(v[..4], 0xdead_beef_u32.to_le_bytes());
        assert!(ring.take_value(2).is_none(), "handed over once");
        assert_eq!(run(&mut ring, 3, &get(2)), -libc::ERANGE);
        let absent = FileOp::GetXattr {
            fd,
            name: c"user.kvtier.absent",
            len: 4,
        };
        assert_eq!(run(&mut ring, 4, &absent), -libc::ENODATA);
        let _ = (ring.take_value(3), ring.take_value(4));
        assert_eq!(ring.paths.len(), 0, "{:?}", ring.paths);
        assert!(ring.paths.values.is_empty());
    }

    /// STATX reports type and size without following a final symlink; a missing path is
    /// ENOENT and its buffer is handed over too.
    #[test]
    fn statx_reports_type_and_size_on_the_ring() {
        let Some(mut ring) = ring_with_file_ops(8) else {
            return;
        };
        let dir = tempfile::tempdir_in("/var/tmp").expect("dir");
        std::fs::write(dir.path().join("f"), vec![7u8; 12_345]).expect("file");
        std::os::unix::fs::symlink("f", dir.path().join("l")).expect("symlink");
        std::fs::create_dir(dir.path().join("d")).expect("dir");
        let dfd = std::fs::File::open(dir.path()).expect("open dir");
        let at = std::os::fd::AsRawFd::as_raw_fd(&dfd);
        let mut run = |ud: u64, path: &CStr| -> (i32, Option<StatxInfo>) {
            ring.push_file_op(ud, &FileOp::Statx { dir: at, path }, 0)
                .expect("push");
            let mut out = Vec::new();
            while out.is_empty() {
                ring.submit(1).expect("submit");
                ring.complete(&mut out);
            }
            assert_eq!(out[0].user_data, ud);
            let buf = ring
                .take_value(ud)
                .expect("the buffer, whatever the result");
            assert_eq!(buf.len(), StatxInfo::BYTES);
            assert!(ring.take_value(ud).is_none(), "handed over once");
            (out[0].result, StatxInfo::parse(&buf))
        };
        let (r, f) = run(1, c"f");
        assert_eq!(r, 0);
        let f = f.expect("parsed");
        assert!(f.is_regular());
        assert_eq!(f.size, 12_345);
        let (r, l) = run(2, c"l");
        assert_eq!(r, 0);
        assert_eq!(l.expect("parsed").mode, libc::S_IFLNK, "not followed");
        let (r, d) = run(3, c"d");
        assert_eq!(r, 0);
        assert_eq!(d.expect("parsed").mode, libc::S_IFDIR);
        assert_eq!(run(4, c"absent").0, -libc::ENOENT);
        assert_eq!(run(5, c"f/below").0, -libc::ENOTDIR);
        assert!(StatxInfo::parse(&[0u8; 8]).is_none(), "short buffer");
        assert_eq!(ring.paths.len(), 0, "{:?}", ring.paths);
        assert!(ring.paths.values.is_empty());
    }

    #[test]
    fn refused_push_keeps_nothing() {
        let Some(mut ring) = ring_with_file_ops(2) else {
            return;
        };
        let path = missing_path(2);
        let op = FileOp::RenameAt {
            dir: AT_FDCWD,
            from: &path,
            to: &path,
            flags: RENAME_NOREPLACE,
        };
        ring.push_file_op(1, &op, 0).expect("room");
        ring.push_file_op(2, &op, 0).expect("room");
        assert!(ring.push_file_op(3, &op, 0).is_err());
        assert_eq!((ring.paths.len(), ring.in_flight()), (2, 2));
        // Dropped with both queued: Drop submits and drains them before freeing the copies.
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "already in flight")]
    fn duplicate_user_data_is_caught_in_debug_builds() {
        let Some(mut ring) = ring_with_file_ops(8) else {
            panic!("already in flight (skipped: no io_uring file ops)");
        };
        let path = missing_path(3);
        ring.push_file_op(
            9,
            &FileOp::UnlinkAt {
                dir: AT_FDCWD,
                path: &path,
            },
            0,
        )
        .expect("push");
        let _ = ring.push_file_op(
            9,
            &FileOp::UnlinkAt {
                dir: AT_FDCWD,
                path: &path,
            },
            0,
        );
    }

    #[test]
    fn path_store_frees_only_consumed_and_completed_copies() {
        let owned = |seq| OwnedPaths {
            seq,
            paths: vec![c"x".to_owned()],
            how: None,
            value: None,
        };
        let mut store = PathStore::default();
        store.insert(7, owned(3));
        store.insert(7, owned(4));
        store.insert(8, owned(5));
        // A completion of an op without paths (or an unknown user_data) frees nothing.
        store.retire(1);
        store.release(10);
        assert_eq!(store.len(), 3);
        // Completed but the SQE not consumed yet: kept.
        store.retire(7);
        store.release(3);
        assert_eq!(store.len(), 3);
        store.release(4);
        assert_eq!(store.len(), 2);
        store.retire(7);
        store.retire(8);
        store.release(6);
        assert!(store.is_empty(), "{store:?}");
    }
}
