//! The operating-system layer of kvtier, and the only crate of the workspace with `unsafe` code.
//!
//! Everything here is a thin, safe wrapper over one kernel facility: pinned memory regions
//! ([`mem`]), `io_uring` rings with registered buffers and files ([`ring`]), `O_DIRECT` files and
//! block devices and their extended attributes ([`file`](mod@file)), CPU affinity and CPU-time clocks
//! ([`affinity`]), wake-up eventfds ([`eventfd`]), state shared between processes on one
//! directory ([`shared`]: a mapped counter and an `flock` lock file) and read-only probes of what
//! the machine supports ([`probe`]).
//!
//! Invariants kept across the crate: every `unsafe {}` block holds one operation and says which
//! invariant makes it sound; memory handed to the kernel for I/O stays mapped until the kernel
//! has returned every completion that may touch it ([`ring::Ring`]'s `Drop` drains before it
//! unregisters, and frees the path copies of file operations only after that); errors are
//! [`Errno`] or small error structs whose message says what failed and how to fix it.

#![deny(
    unsafe_op_in_unsafe_fn,
    clippy::undocumented_unsafe_blocks,
    clippy::missing_safety_doc
)]

pub use nix::errno::Errno;

pub mod affinity;
pub mod blocks;
pub mod dir;
pub mod eventfd;
pub mod fd;
pub mod file;
pub mod mem;
pub mod nvme;
pub mod pagemap;
pub mod probe;
pub mod ring;
pub mod shared;
pub mod smaps;
pub mod testing;
pub mod vfio;

/// Converts a `std::io::Error` from a syscall wrapper into the errno it carries (EIO if none).
pub(crate) fn errno_of(err: &std::io::Error) -> Errno {
    Errno::from_raw(err.raw_os_error().unwrap_or(libc::EIO))
}
