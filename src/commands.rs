//! NVMe requests cut into commands, for every queue that sends NVMe commands itself (io_uring
//! passthrough, [`crate::uring`]; the user-space VFIO driver, [`crate::vfio`]).
//!
//! A worker request for an NVMe device becomes one or more commands of at most the device's
//! transfer limit (neither the kernel's passthrough nor a controller splits them; a longer one
//! fails). All parts carry the request's `user_data` (unique among the worker's requests in
//! flight), and the request completes when its last part does: with its full length, or with
//! the first failure. A failure whose NVMe status allows a retry (no DNR bit) resubmits the
//! whole request, up to [`TRIES`] times: re-reading or re-writing a part that succeeded is
//! harmless. A part's result is the passthrough CQE's: 0, a positive NVMe status, or `-errno`.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::time::Duration;

use kvtier_sys::nvme::{CommandError, Geometry, Opcode, Outcome};

use crate::io::{Completion, IoBuf, IoKind, IoRequest};
use crate::logs::RateLimit;

/// Attempts per request when the device's status allows retrying.
pub(crate) const TRIES: u8 = 3;

/// Whether a part's outcome allows resubmitting: success, an NVMe status without Do Not Retry,
/// or EINTR/EAGAIN (a command aborted by a timeout or a controller reset, a busy queue).
fn retryable(outcome: Outcome) -> bool {
    match outcome {
        Outcome::Done => true,
        Outcome::Status(s) => s.retryable(),
        Outcome::Errno(e) => matches!(e, crate::Errno::EINTR | crate::Errno::EAGAIN),
    }
}

fn opcode(kind: IoKind) -> Opcode {
    match kind {
        IoKind::Read => Opcode::Read,
        IoKind::Write => Opcode::Write,
    }
}

/// Where commands go: an io_uring ring (passthrough) or a VFIO queue pair per device.
pub(crate) trait CommandQueue {
    /// Whether one more command may be pushed now.
    fn has_room(&self) -> bool;
    /// Queues one command on device `device`; false (nothing queued, `buf` dropped) if full.
    #[allow(clippy::too_many_arguments)]
    fn push_command(
        &mut self,
        user_data: u64,
        device: u16,
        op: Opcode,
        nsid: u32,
        slba: u64,
        lba_shift: u32,
        region: u16,
        buf: IoBuf,
    ) -> bool;
}

/// An NVMe device as the backend sees it.
#[derive(Clone, Debug)]
pub(crate) struct Device {
    pub path: PathBuf,
    pub geometry: Geometry,
}

/// A request in flight on an NVMe device.
struct Pending {
    req: IoRequest,
    /// Commands the request is cut into.
    parts: u32,
    /// Parts of this attempt pushed so far (the rest wait in `backlog` for queue room).
    pushed: u32,
    /// Parts of this attempt whose completion has not been reaped, pushed or not.
    left: u32,
    /// The first failure among the parts of this attempt.
    failed: Option<Outcome>,
    /// A part of this attempt failed with Do Not Retry: the request is not retried.
    final_failure: bool,
    tries: u8,
}

/// A backend's NVMe request bookkeeping (one per worker).
pub(crate) struct Commands {
    /// By device index; `None` for devices that take no NVMe commands (the block layer).
    devices: Vec<Option<Device>>,
    pending: HashMap<u64, Pending>,
    /// Parts pushed on the queue whose completion has not been reaped.
    pub parts_in_ring: usize,
    /// Requests with parts still to push, oldest first: a request cut into more commands than
    /// the submission queue has room for, and retries.
    backlog: VecDeque<u64>,
    log: RateLimit,
}

impl Commands {
    pub fn new(devices: Vec<Option<Device>>) -> Commands {
        Commands {
            devices,
            pending: HashMap::new(),
            parts_in_ring: 0,
            backlog: VecDeque::new(),
            log: RateLimit::new(10, Duration::from_secs(10)),
        }
    }

    pub fn any(&self) -> bool {
        self.devices.iter().any(Option::is_some)
    }

    pub fn owns(&self, device: u16) -> bool {
        self.devices
            .get(usize::from(device))
            .is_some_and(Option::is_some)
    }

    /// Requests in flight (pending, including those waiting for queue room).
    pub fn requests(&self) -> usize {
        self.pending.len()
    }

    /// Takes `req` (a request for an NVMe device) and pushes as many of its commands as the
    /// submission queue has room for (the rest go at the next [`Commands::flush`]);
    /// `false`, taking nothing, if the queue is full. The request's claim stays here until its
    /// completion is returned; each command carries a claim of its own on its part.
    pub fn push<Q: CommandQueue + ?Sized>(&mut self, ring: &mut Q, req: IoRequest) -> bool {
        if !ring.has_room() {
            return false;
        }
        let user_data = req.user_data;
        self.track(req);
        if !self.feed(ring, user_data) {
            self.backlog.push_back(user_data);
        }
        true
    }

    /// Records `req`, none of its parts pushed yet.
    fn track(&mut self, req: IoRequest) {
        let parts = self.part_count(&req);
        self.pending.insert(
            req.user_data,
            Pending {
                req,
                parts,
                pushed: 0,
                left: parts,
                failed: None,
                final_failure: false,
                tries: 1,
            },
        );
    }

    fn device(&self, req: &IoRequest) -> &Device {
        let Some(Some(dev)) = self.devices.get(usize::from(req.device)) else {
            unreachable!("passthrough I/O for device {} it does not own", req.device);
        };
        dev
    }

    /// Commands `req` is cut into; checks it is whole LBAs.
    fn part_count(&self, req: &IoRequest) -> u32 {
        let dev = self.device(req);
        let lba = u64::from(dev.geometry.lba_bytes());
        assert!(
            req.offset.is_multiple_of(lba) && u64::from(req.bytes()) % lba == 0,
            "I/O of {} bytes at {} on {} is not a multiple of its {lba}-byte LBA",
            req.bytes(),
            req.offset,
            dev.path.display()
        );
        req.bytes().div_ceil(dev.geometry.max_transfer_bytes)
    }

    /// (start LBA, claim) of command `i` of `req`; the claim's length gives its LBAs.
    fn part(&self, req: &IoRequest, i: u32) -> (u64, IoBuf) {
        let g = &self.device(req).geometry;
        let done = i * g.max_transfer_bytes;
        let len = (req.bytes() - done).min(g.max_transfer_bytes);
        (
            (req.offset + u64::from(done)) >> g.lba_shift,
            req.buf.part(done as usize, len as usize),
        )
    }

    /// Pushes the request's next parts while the queue has room; true once all are pushed.
    fn feed<Q: CommandQueue + ?Sized>(&mut self, ring: &mut Q, user_data: u64) -> bool {
        let Some(p) = self.pending.get(&user_data) else {
            return true;
        };
        let (mut next, parts) = (p.pushed, p.parts);
        let (device, region, op) = (p.req.device, p.req.region, opcode(p.req.kind));
        let (nsid, shift) = {
            let g = &self.device(&p.req).geometry;
            (g.nsid, g.lba_shift)
        };
        while next < parts {
            if !ring.has_room() {
                break;
            }
            let Some(p) = self.pending.get(&user_data) else {
                unreachable!("a request being fed is pending");
            };
            let (slba, buf) = self.part(&p.req, next);
            if !ring.push_command(user_data, device, op, nsid, slba, shift, region, buf) {
                break;
            }
            next += 1;
            self.parts_in_ring += 1;
        }
        if let Some(p) = self.pending.get_mut(&user_data) {
            p.pushed = next;
        }
        next == parts
    }

    /// Pushes the parts of backlogged requests (cut into many commands, or retried) while the
    /// queue has room; call before submitting.
    pub fn flush<Q: CommandQueue + ?Sized>(&mut self, ring: &mut Q) {
        while let Some(&user_data) = self.backlog.front() {
            if !self.feed(ring, user_data) {
                return;
            }
            self.backlog.pop_front();
        }
    }

    pub fn complete<Q: CommandQueue + ?Sized>(
        &mut self,
        ring: &mut Q,
        raw: &mut Vec<Completion>,
        out: &mut Vec<Completion>,
    ) {
        for c in raw.drain(..) {
            if let Some(done) = self.absorb(c) {
                out.push(done);
            }
        }
        self.flush(ring);
    }

    /// One completion off the queue: the request's completion once its last part is in (or the
    /// completion itself if it is not an NVMe part); `None` while parts are outstanding
    /// or when the request was queued for a retry.
    fn absorb(&mut self, c: Completion) -> Option<Completion> {
        let Some(p) = self.pending.get_mut(&c.user_data) else {
            return Some(c);
        };
        self.parts_in_ring -= 1;
        p.left -= 1;
        let outcome = Outcome::from_result(c.result);
        if outcome != Outcome::Done && p.failed.is_none() {
            p.failed = Some(outcome);
        }
        if !retryable(outcome) {
            p.final_failure = true;
        }
        if p.left > 0 {
            return None;
        }
        if p.failed.is_some() && !p.final_failure && p.tries < TRIES {
            p.tries += 1;
            p.failed = None;
            p.pushed = 0;
            p.left = p.parts;
            self.backlog.push_back(c.user_data);
            return None;
        }
        let p = self.pending.remove(&c.user_data)?;
        Some(self.finish(&p))
    }

    fn finish(&self, p: &Pending) -> Completion {
        let Some(failed) = p.failed else {
            return Completion {
                user_data: p.req.user_data,
                // Block-sized transfers: far below 2 GiB.
                result: i32::try_from(p.req.bytes()).unwrap_or(i32::MAX),
            };
        };
        let dev = self.device(&p.req);
        let shift = dev.geometry.lba_shift;
        let err = CommandError {
            device: dev.path.clone(),
            op: opcode(p.req.kind),
            slba: p.req.offset >> shift,
            lbas: p.req.bytes() >> shift,
            outcome: failed,
        };
        if let Some(suppressed) = self.log.admit() {
            tracing::error!(tries = p.tries, suppressed, "{err}");
        }
        Completion {
            user_data: p.req.user_data,
            result: -(err.errno() as i32),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::IoClass;
    use kvtier_sys::ring::Ring;

    fn passthrough(max_transfer_bytes: u32) -> Commands {
        let geometry = Geometry {
            nsid: 1,
            lba_shift: 12,
            lbas: 1 << 20,
            max_transfer_bytes,
            poll_queues: false,
            source: "test",
            controller: "/dev/nvme9".into(),
            block_device: "/dev/nvme9n1".into(),
        };
        Commands::new(vec![
            None,
            Some(Device {
                path: "/dev/ng9n1".into(),
                geometry,
            }),
        ])
    }

    /// A request for `len` bytes at byte 8 MiB of a region of its own.
    fn request(user_data: u64, kind: IoKind, offset: u64, len: u32) -> IoRequest {
        let region = std::sync::Arc::new(
            crate::Region::allocate((8 << 20) + len as usize, kvtier_sys::mem::HugePages::Off)
                .expect("region"),
        );
        region.guard_blocks(4096).expect("guard");
        request_in(&region, 8 << 20, user_data, kind, offset, len)
    }

    fn request_in(
        region: &std::sync::Arc<crate::Region>,
        at: usize,
        user_data: u64,
        kind: IoKind,
        offset: u64,
        len: u32,
    ) -> IoRequest {
        IoRequest {
            user_data,
            kind,
            device: 1,
            offset,
            region: 0,
            buf: region
                .checkout(at, len as usize, kind == IoKind::Read)
                .expect("free"),
            class: IoClass::Load,
        }
    }

    /// Pretends every part of `req` was pushed.
    fn pushed(p: &mut Commands, req: IoRequest) -> u32 {
        let user_data = req.user_data;
        p.track(req);
        let pending = p.pending.get_mut(&user_data).expect("tracked");
        pending.pushed = pending.parts;
        p.parts_in_ring += pending.parts as usize;
        pending.parts
    }

    /// As `flush` does for a request queued for a retry.
    fn resubmitted(p: &mut Commands, user_data: u64) {
        assert_eq!(p.backlog.pop_front(), Some(user_data));
        assert!(p.backlog.is_empty());
        let pending = p.pending.get_mut(&user_data).expect("pending");
        assert_eq!((pending.pushed, pending.left), (0, pending.parts));
        pending.pushed = pending.parts;
        p.parts_in_ring += pending.parts as usize;
    }

    fn cqe(user_data: u64, result: i32) -> (u64, i32) {
        (user_data, result)
    }

    fn absorb(p: &mut Commands, user_data: u64, result: i32) -> Option<(u64, i32)> {
        p.absorb(Completion { user_data, result })
            .map(|c| (c.user_data, c.result))
    }

    #[test]
    fn a_request_is_cut_at_the_transfer_limit() {
        let p = passthrough(512 << 10);
        assert!(p.owns(1) && !p.owns(0) && !p.owns(7));
        let req = request(5, IoKind::Read, 3 << 20, (1 << 20) + (4 << 10));
        assert_eq!(p.part_count(&req), 3);
        let got: Vec<(u64, u32, usize, u32)> = (0..3)
            .map(|i| p.part(&req, i))
            .map(|(slba, buf)| (slba, buf.len() as u32 >> 12, buf.offset(), buf.len() as u32))
            .collect();
        assert_eq!(
            got,
            vec![
                (768, 128, 8 << 20, 512 << 10),
                (768 + 128, 128, (8 << 20) + (512 << 10), 512 << 10),
                (768 + 256, 1, (8 << 20) + (1 << 20), 4 << 10),
            ]
        );
    }

    #[test]
    fn parts_fold_into_one_completion_and_other_completions_pass() {
        let mut p = passthrough(512 << 10);
        let req = request(42, IoKind::Write, 0, 1 << 20);
        assert_eq!(pushed(&mut p, req), 2);
        assert_eq!(p.requests(), 1);
        assert_eq!(
            absorb(&mut p, 7, 4096),
            Some(cqe(7, 4096)),
            "not an NVMe part"
        );
        assert_eq!(absorb(&mut p, 42, 0), None, "one part still out");
        assert_eq!(absorb(&mut p, 42, 0), Some(cqe(42, 1 << 20)));
        assert_eq!((p.requests(), p.parts_in_ring), (0, 0));
    }

    #[test]
    fn a_retryable_status_resubmits_and_do_not_retry_fails_at_once() {
        let mut p = passthrough(512 << 10);
        pushed(&mut p, request(9, IoKind::Read, 0, 1 << 20));
        // Namespace not ready, without DNR: the whole request goes again once both parts are in.
        assert_eq!(absorb(&mut p, 9, 0x0082), None);
        assert_eq!(absorb(&mut p, 9, 0), None);
        assert_eq!(
            p.requests(),
            1,
            "in flight while it waits to be resubmitted"
        );
        resubmitted(&mut p, 9);
        assert_eq!(absorb(&mut p, 9, 0), None);
        assert_eq!(absorb(&mut p, 9, 0), Some(cqe(9, 1 << 20)));
        // LBA out of range with DNR: no retry, EINVAL.
        pushed(&mut p, request(10, IoKind::Read, 0, 4096));
        assert_eq!(
            absorb(&mut p, 10, 0x4080),
            Some(cqe(10, -(crate::Errno::EINVAL as i32)))
        );
        assert!(p.backlog.is_empty());
        // EIO is not retried; EINTR (a command aborted by a reset) is.
        pushed(&mut p, request(11, IoKind::Write, 0, 4096));
        assert_eq!(absorb(&mut p, 11, -5), Some(cqe(11, -5)));
        pushed(&mut p, request(12, IoKind::Write, 0, 4096));
        assert_eq!(absorb(&mut p, 12, -(crate::Errno::EINTR as i32)), None);
        resubmitted(&mut p, 12);
        assert_eq!(absorb(&mut p, 12, 0), Some(cqe(12, 4096)));
        // A retryable first failure, then a Do Not Retry part: no retry.
        pushed(&mut p, request(13, IoKind::Read, 0, 1 << 20));
        assert_eq!(absorb(&mut p, 13, 0x0082), None);
        assert_eq!(
            absorb(&mut p, 13, 0x4002),
            Some(cqe(13, -(crate::Errno::EAGAIN as i32)))
        );
        assert!(p.backlog.is_empty());
        assert_eq!((p.requests(), p.parts_in_ring), (0, 0));
    }

    #[test]
    fn retries_stop_after_the_last_try() {
        let mut p = passthrough(1 << 20);
        pushed(&mut p, request(3, IoKind::Read, 0, 4096));
        for _ in 1..TRIES {
            assert_eq!(
                absorb(&mut p, 3, 0x0006),
                None,
                "internal error, no DNR: retried"
            );
            resubmitted(&mut p, 3);
        }
        assert_eq!(
            absorb(&mut p, 3, 0x0006),
            Some(cqe(3, -5)),
            "EIO after {TRIES} tries"
        );
        assert_eq!(p.requests(), 0);
    }

    /// A request of more commands than the submission queue holds goes in pieces, through a
    /// real ring; the commands target a regular file, which answers every `URING_CMD` with an
    /// errno, so the request ends, once, with that errno and nothing retried.
    #[test]
    fn a_request_longer_than_the_queue_is_fed_in_pieces() {
        use kvtier_sys::ring::RingConfig;
        let Ok(mut ring) = Ring::new(&RingConfig {
            entries: 4,
            big_entries: true,
            ..RingConfig::default()
        }) else {
            return kvtier_sys::skip!("io_uring unavailable");
        };
        let region = std::sync::Arc::new(
            crate::Region::allocate(64 << 10, kvtier_sys::mem::HugePages::Off).expect("region"),
        );
        region.guard_blocks(4096).expect("guard");
        ring.register_buffers(vec![std::sync::Arc::clone(&region)], 64 << 10)
            .expect("buffers");
        let dir = tempfile::tempdir().expect("dir");
        let file = kvtier_sys::file::DeviceFile::open(
            &dir.path().join("f"),
            kvtier_sys::file::OpenOptions {
                create: true,
                ..Default::default()
            },
        )
        .expect("file");
        ring.register_files(vec![std::sync::Arc::new(file)])
            .expect("files");
        let mut p = passthrough(4096);
        p.devices.swap(0, 1);
        let mut req = request_in(&region, 0, 77, IoKind::Read, 0, 32 << 10);
        req.device = 0;
        assert!(p.push(&mut ring, req));
        assert!(region.is_leased(0), "claimed until the request completes");
        assert_eq!(p.parts_in_ring, 4, "the queue holds four");
        assert_eq!(p.backlog.len(), 1);
        let mut raw = Vec::new();
        let mut out = Vec::new();
        for _ in 0..100 {
            if !out.is_empty() {
                break;
            }
            ring.submit(1).expect("submit");
            ring.complete(&mut raw);
            p.complete(&mut ring, &mut raw, &mut out);
        }
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].user_data, 77);
        assert!(out[0].result < 0, "{out:?}");
        assert_eq!((p.requests(), p.parts_in_ring, p.backlog.len()), (0, 0, 0));
        assert_eq!(ring.in_flight(), 0);
    }
}
