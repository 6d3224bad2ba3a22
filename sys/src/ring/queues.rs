//! The two shapes of `io_uring` a [`super::Ring`] can have: 64-byte SQEs with 16-byte CQEs (every
//! ordinary operation), or 128-byte SQEs with 32-byte CQEs (`SQE128 | CQE32`), which NVMe
//! passthrough commands (`URING_CMD` with an 80-byte command) need. Ordinary operations fit in
//! the big shape too, so a ring that serves a passthrough device serves every device; the small
//! shape stays the default because the kernel copies half as much per operation.

use io_uring::{cqueue, squeue, types, IoUring, Probe, Submitter};

use super::Completion;
use crate::{errno_of, Errno};

/// An `io_uring` of either entry size.
pub(super) enum Queues {
    Small(IoUring),
    Big(IoUring<squeue::Entry128, cqueue::Entry32>),
}

impl Queues {
    pub fn is_big(&self) -> bool {
        matches!(self, Queues::Big(_))
    }

    pub fn submitter(&self) -> Submitter<'_> {
        match self {
            Queues::Small(u) => u.submitter(),
            Queues::Big(u) => u.submitter(),
        }
    }

    pub fn params(&self) -> &io_uring::Parameters {
        match self {
            Queues::Small(u) => u.params(),
            Queues::Big(u) => u.params(),
        }
    }

    pub fn submit_and_wait(&self, want: usize) -> std::io::Result<usize> {
        match self {
            Queues::Small(u) => u.submit_and_wait(want),
            Queues::Big(u) => u.submit_and_wait(want),
        }
    }

    pub fn submit_with_args(
        &self,
        want: usize,
        args: &types::SubmitArgs<'_, '_>,
    ) -> std::io::Result<usize> {
        self.submitter().submit_with_args(want, args)
    }

    /// Entries queued but not yet consumed by the kernel, and the queue's capacity.
    pub fn sq_len_capacity(&self) -> (usize, usize) {
        // SAFETY: submission queue handles are only created inside `&mut self` methods of
        // `Ring` and dropped before they return, so none exists while `&self` is held here.
        unsafe {
            match self {
                Queues::Small(u) => {
                    let sq = u.submission_shared();
                    (sq.len(), sq.capacity())
                }
                Queues::Big(u) => {
                    let sq = u.submission_shared();
                    (sq.len(), sq.capacity())
                }
            }
        }
    }

    /// Pushes a 64-byte entry (widened to 128 bytes on a big ring).
    ///
    /// # Safety
    /// The memory the entry names must stay valid until its completion is reaped.
    pub unsafe fn push(&mut self, entry: &squeue::Entry) -> Result<(), ()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            match self {
                Queues::Small(u) => u.submission().push(entry).map_err(|_| ()),
                Queues::Big(u) => u
                    .submission()
                    .push(&squeue::Entry128::from(entry.clone()))
                    .map_err(|_| ()),
            }
        }
    }

    /// Pushes a 128-byte entry. Panics on a small ring (a caller bug: the ring was built
    /// without `big_entries` for a passthrough device).
    ///
    /// # Safety
    /// The memory the entry names must stay valid until its completion is reaped.
    pub unsafe fn push_big(&mut self, entry: &squeue::Entry128) -> Result<(), ()> {
        match self {
            Queues::Small(_) => {
                panic!("a 128-byte SQE was pushed on a ring built with 64-byte entries")
            }
            // SAFETY: forwarded from the caller.
            Queues::Big(u) => unsafe { u.submission().push(entry).map_err(|_| ()) },
        }
    }

    /// Appends every available completion to `out`.
    pub fn drain_completions(&mut self, out: &mut Vec<Completion>) {
        match self {
            Queues::Small(u) => out.extend(u.completion().map(|c| Completion {
                user_data: c.user_data(),
                result: c.result(),
            })),
            Queues::Big(u) => out.extend(u.completion().map(|c| Completion {
                user_data: c.user_data(),
                result: c.result(),
            })),
        }
    }

    pub fn register_probe(&self, probe: &mut Probe) -> Result<(), Errno> {
        self.submitter()
            .register_probe(probe)
            .map_err(|e| errno_of(&e))
    }
}
