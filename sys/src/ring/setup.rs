//! Building a ring: the setup flags tried best first (and dropped one at a time while the kernel
//! refuses them), and registering its buffers and files.

#[cfg(debug_assertions)]
use std::collections::HashMap;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

use io_uring::{cqueue, squeue, IoUring};

use super::queues::Queues;
use super::{
    PathStore, RegisterError, Ring, RingConfig, RingFeatures, MAX_BUFFERS, MAX_PIECE_BYTES,
};
use crate::file::DeviceFile;
use crate::mem::Region;
use crate::{errno_of, Errno};

/// Base setup flags tried in order, best first.
#[derive(Clone, Copy, Debug)]
pub(super) struct BaseFlags {
    pub(super) single_issuer: bool,
    pub(super) defer_taskrun: bool,
    pub(super) coop_taskrun: bool,
}

pub(super) const fn base(
    single_issuer: bool,
    defer_taskrun: bool,
    coop_taskrun: bool,
) -> BaseFlags {
    BaseFlags {
        single_issuer,
        defer_taskrun,
        coop_taskrun,
    }
}

/// Without SQPOLL: `SINGLE_ISSUER` (6.0) + `DEFER_TASKRUN` (6.1) + `COOP_TASKRUN` (5.19),
/// dropping one flag per step.
pub(super) const BASE_LADDER: [BaseFlags; 5] = [
    base(true, true, true),
    base(true, true, false),
    base(true, false, true),
    base(false, false, true),
    base(false, false, false),
];
/// With SQPOLL the task-run flags are refused by the kernel.
pub(super) const SQPOLL_LADDER: [BaseFlags; 2] =
    [base(true, false, false), base(false, false, false)];

impl Ring {
    /// Builds a ring. Must be called on the thread that will use it.
    ///
    /// Tries `SINGLE_ISSUER | DEFER_TASKRUN | COOP_TASKRUN` (with `TASKRUN_FLAG`, so that
    /// `submit(0)` also runs deferred completions) and drops flags one at a time while the kernel
    /// answers EINVAL. SQPOLL and IOPOLL are used only if requested; if the kernel refuses them
    /// they are dropped with a `warn!` naming what was dropped. [`Ring::features`] says what the
    /// ring got.
    pub fn new(cfg: &RingConfig) -> Result<Ring, Errno> {
        if cfg.entries == 0 {
            return Err(Errno::EINVAL);
        }
        let mut modes = vec![(cfg.sqpoll, cfg.iopoll)];
        for mode in [(cfg.sqpoll, false), (false, cfg.iopoll), (false, false)] {
            if !modes.contains(&mode) {
                modes.push(mode);
            }
        }
        let mut last = Errno::EINVAL;
        for (sqpoll, iopoll) in modes {
            let ladder: &[BaseFlags] = if sqpoll { &SQPOLL_LADDER } else { &BASE_LADDER };
            for &flags in ladder {
                match build(cfg, sqpoll, iopoll, flags) {
                    Ok(ring) => {
                        let features = RingFeatures {
                            single_issuer: flags.single_issuer,
                            defer_taskrun: flags.defer_taskrun,
                            coop_taskrun: flags.coop_taskrun,
                            sqpoll,
                            iopoll,
                        };
                        warn_dropped(cfg, features, last);
                        tracing::debug!(%features, entries = cfg.entries, "io_uring ring created");
                        return Ok(Ring::with(ring, features));
                    }
                    // EINVAL: a flag this kernel does not know. EPERM: SQPOLL without privilege
                    // on kernels before 5.11.
                    Err(e) if e == Errno::EINVAL || (sqpoll && e == Errno::EPERM) => last = e,
                    Err(e) => return Err(e),
                }
            }
        }
        Err(last)
    }

    fn with(ring: Queues, features: RingFeatures) -> Ring {
        let sink = NonNull::from(Box::leak(Box::new(0_u64)));
        let claims = super::Claims::with_capacity(ring.params().cq_entries() as usize);
        Ring {
            uring: ring,
            features,
            in_flight: 0,
            enters: 0,
            regions: Vec::new(),
            first_piece: Vec::new(),
            piece_bytes: 0,
            buffers_registered: false,
            files: Vec::new(),
            files_registered: false,
            eventfds: Vec::new(),
            sink,
            pushed: 0,
            paths: PathStore::default(),
            claims,
            #[cfg(debug_assertions)]
            live_user_data: HashMap::new(),
            _not_send: PhantomData,
        }
    }

    /// Registers every region as fixed buffers, each split into pieces of at most `piece_bytes`
    /// (at most 1 GiB; pass a multiple of the block size so that blocks never straddle pieces).
    /// The ring keeps the Arcs until it is dropped. Call at most once.
    pub fn register_buffers(
        &mut self,
        regions: Vec<Arc<Region>>,
        piece_bytes: usize,
    ) -> Result<(), RegisterError> {
        let invalid = |message: String| RegisterError {
            errno: Errno::EINVAL,
            message,
        };
        if self.buffers_registered {
            return Err(RegisterError {
                errno: Errno::EBUSY,
                message: "io_uring buffers are already registered on this ring; register all \
                          regions in one call"
                    .to_owned(),
            });
        }
        if piece_bytes == 0 || piece_bytes > MAX_PIECE_BYTES {
            return Err(invalid(format!(
                "buffer piece size {piece_bytes} bytes is out of range: must be \
                 1..={MAX_PIECE_BYTES}"
            )));
        }
        if regions.is_empty() || regions.len() > usize::from(u16::MAX) + 1 {
            return Err(invalid(format!(
                "cannot register {} regions: need 1..=65536",
                regions.len()
            )));
        }
        let mut iovecs: Vec<libc::iovec> = Vec::new();
        let mut first_piece = Vec::with_capacity(regions.len());
        let mut total_bytes = 0_usize;
        for region in &regions {
            first_piece.push(u16::try_from(iovecs.len()).unwrap_or(u16::MAX));
            total_bytes = total_bytes.saturating_add(region.len());
            let mut offset = 0;
            while offset < region.len() {
                let len = piece_bytes.min(region.len() - offset);
                iovecs.push(libc::iovec {
                    iov_base: region.range_ptr(offset, len).cast(),
                    iov_len: len,
                });
                offset += len;
            }
            if iovecs.len() > MAX_BUFFERS {
                return Err(invalid(format!(
                    "{total_bytes}+ bytes in pieces of {piece_bytes} bytes need more than \
                     {MAX_BUFFERS} registered buffers (the kernel limit); use larger pieces"
                )));
            }
        }
        let submitter = self.uring.submitter();
        // SAFETY: every iovec lies inside a Region (range_ptr checked it) that `self.regions`
        // keeps alive until Drop has drained all I/O and unregistered the buffers.
        let res = unsafe { submitter.register_buffers(&iovecs) };
        if let Err(e) = res {
            return Err(register_error(errno_of(&e), total_bytes, iovecs.len()));
        }
        tracing::debug!(
            regions = regions.len(),
            pieces = iovecs.len(),
            total_bytes,
            "io_uring buffers registered"
        );
        self.regions = regions;
        self.first_piece = first_piece;
        self.piece_bytes = piece_bytes;
        self.buffers_registered = true;
        Ok(())
    }

    /// Registers the files; index `i` in `push_read`/`push_write` is `files[i]`. The ring keeps
    /// the Arcs until it is dropped. Call at most once (EBUSY otherwise).
    pub fn register_files(&mut self, files: Vec<Arc<DeviceFile>>) -> Result<(), Errno> {
        if self.files_registered {
            return Err(Errno::EBUSY);
        }
        let fds: Vec<_> = files.iter().map(|f| f.raw_fd()).collect();
        self.uring
            .submitter()
            .register_files(&fds)
            .map_err(|e| errno_of(&e))?;
        self.files = files;
        self.files_registered = true;
        Ok(())
    }
}

/// Logs the requested setup flags that the kernel refused.
pub(super) fn warn_dropped(cfg: &RingConfig, got: RingFeatures, errno: Errno) {
    if cfg.sqpoll && !got.sqpoll {
        tracing::warn!(%errno, "io_uring: kernel refused SQPOLL; dropped it");
    }
    if cfg.iopoll && !got.iopoll {
        tracing::warn!(%errno, "io_uring: kernel refused IOPOLL; dropped it");
    }
}

pub(super) fn build(
    cfg: &RingConfig,
    sqpoll: bool,
    iopoll: bool,
    flags: BaseFlags,
) -> Result<Queues, Errno> {
    if cfg.big_entries {
        build_sized::<squeue::Entry128, cqueue::Entry32>(cfg, sqpoll, iopoll, flags)
            .map(Queues::Big)
    } else {
        build_sized(cfg, sqpoll, iopoll, flags).map(Queues::Small)
    }
}

pub(super) fn build_sized<S: squeue::EntryMarker, C: cqueue::EntryMarker>(
    cfg: &RingConfig,
    sqpoll: bool,
    iopoll: bool,
    flags: BaseFlags,
) -> Result<IoUring<S, C>, Errno> {
    let mut b = IoUring::<S, C>::builder();
    if flags.single_issuer {
        b.setup_single_issuer();
    }
    if flags.defer_taskrun {
        b.setup_defer_taskrun();
    }
    if flags.coop_taskrun {
        b.setup_coop_taskrun();
    }
    if flags.defer_taskrun || flags.coop_taskrun {
        // Lets `submit(0)` see pending task work and enter the kernel to post completions.
        b.setup_taskrun_flag();
    }
    if sqpoll {
        b.setup_sqpoll(cfg.sqpoll_idle_ms);
    }
    if iopoll {
        b.setup_iopoll();
    }
    b.build(cfg.entries).map_err(|e| errno_of(&e))
}

/// True if a ring with SQPOLL and/or IOPOLL can be built (it is closed at once).
pub(crate) fn setup_flag_supported(sqpoll: bool, iopoll: bool) -> bool {
    let cfg = RingConfig {
        entries: 8,
        sqpoll,
        sqpoll_idle_ms: 10,
        iopoll,
        big_entries: false,
    };
    build(&cfg, sqpoll, iopoll, base(false, false, false)).is_ok()
}

pub(super) fn register_error(errno: Errno, total_bytes: usize, pieces: usize) -> RegisterError {
    let what = format!("registering {total_bytes} bytes ({pieces} pieces) as io_uring buffers");
    let message = if errno == Errno::ENOMEM && !crate::probe::has_cap_ipc_lock() {
        let limit = crate::probe::memlock_limit()
            .map_or_else(|| "unlimited".to_owned(), |l| format!("{l} bytes"));
        format!(
            "{what} failed with ENOMEM: the pages are locked in memory and charged to \
             RLIMIT_MEMLOCK, which is {limit}; raise it (`ulimit -l unlimited`, or \
             LimitMEMLOCK=infinity in the systemd unit) or run with CAP_IPC_LOCK"
        )
    } else if errno == Errno::ENOMEM {
        format!(
            "{what} failed with ENOMEM: not enough memory to pin the pages; lower the DRAM size"
        )
    } else {
        format!("{what} failed: {errno} ({})", errno.desc())
    };
    RegisterError { errno, message }
}
