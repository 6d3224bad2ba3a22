//! The slot table's pages as one worker writes them back: which pages changed, which are being
//! written, the stores each write acknowledges (group commit), and the entries that changed
//! while their page was on its way to the device. Pure state, no I/O and no clock of its own:
//! the slab layout (`slab::table`) decides when to write and does the writing; this owns the
//! rules and checks them.
//!
//! A page is *clean*, *dirty* (queued to be written, in the order it became dirty), or *in
//! flight* (the device reads it; it may be dirty again meanwhile and is queued again when its
//! write completes). Stores wait on the page holding their entry (`waiting`); a write takes
//! every store waiting then (`committing`), and acknowledges them when it completes. Entries
//! changed while the page is in flight are kept aside (`deferred`), since the device is reading
//! the page, and copied in when the write completes.

use std::collections::VecDeque;
use std::time::Instant;

use crate::slab::ENTRY_BYTES;

/// A page's address: device, page within the worker's range on it.
pub(crate) type PageId = (u16, u32);

/// An entry changed while its page was in flight: its byte offset in the meta buffer and its
/// bytes.
pub(crate) type Deferred = (usize, [u8; ENTRY_BYTES]);

#[derive(Debug)]
pub(crate) struct Page<A> {
    dirty: bool,
    /// Entries changed since the page was last written.
    dirty_entries: u16,
    in_flight: bool,
    /// Stores whose entries changed since the page was last written: acknowledged when the
    /// next write of the page completes.
    waiting: Vec<A>,
    /// When the oldest of `waiting` arrived: with no write of the page in flight, their
    /// deadline counts from here.
    waiting_since: Option<Instant>,
    /// Stores whose entries the write in flight carries.
    committing: Vec<A>,
    deferred: Vec<Deferred>,
}

impl<A> Default for Page<A> {
    fn default() -> Page<A> {
        Page {
            dirty: false,
            dirty_entries: 0,
            in_flight: false,
            waiting: Vec::new(),
            waiting_since: None,
            committing: Vec::new(),
            deferred: Vec::new(),
        }
    }
}

impl<A> Page<A> {
    pub fn waiting(&self) -> &[A] {
        &self.waiting
    }

    pub fn committing(&self) -> &[A] {
        &self.committing
    }

    /// What holds for every page, whatever its state.
    fn consistent(&self) -> bool {
        (self.in_flight || (self.committing.is_empty() && self.deferred.is_empty()))
            && (self.waiting.is_empty() == self.waiting_since.is_none())
            && (self.dirty || self.dirty_entries == 0)
    }
}

/// Every table page of one worker, on every device.
#[derive(Debug)]
pub(crate) struct TablePages<A> {
    devs: Vec<Vec<Page<A>>>,
    /// Dirty pages not in flight, in the order they became dirty.
    dirty: VecDeque<PageId>,
    in_flight: usize,
}

impl<A> TablePages<A> {
    /// `pages[d]` pages on device `d`, all clean.
    pub fn new(pages: &[usize]) -> TablePages<A> {
        TablePages {
            devs: pages
                .iter()
                .map(|&n| (0..n).map(|_| Page::default()).collect())
                .collect(),
            dirty: VecDeque::new(),
            in_flight: 0,
        }
    }

    pub fn page(&self, (d, page): PageId) -> &Page<A> {
        &self.devs[d as usize][page as usize]
    }

    fn page_mut(&mut self, (d, page): PageId) -> &mut Page<A> {
        &mut self.devs[d as usize][page as usize]
    }

    /// Page writes in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// No page waits to be written.
    pub fn all_written(&self) -> bool {
        self.dirty.is_empty()
    }

    /// Dirty pages not in flight, oldest first.
    pub fn queued(&self) -> &VecDeque<PageId> {
        &self.dirty
    }

    /// An entry of page `id` changed to `bytes`, at byte `at` of the meta buffer. True: the
    /// caller writes it into the meta buffer now; false: the page is in flight, and the entry
    /// is kept until its write completes ([`TablePages::written`] hands it back; a later change
    /// of the same entry replaces it).
    pub fn changed(&mut self, id: PageId, at: usize, bytes: [u8; ENTRY_BYTES]) -> bool {
        let p = self.page_mut(id);
        let now = !p.in_flight;
        if !now {
            match p.deferred.iter_mut().find(|(a, _)| *a == at) {
                Some(e) => e.1 = bytes,
                None => p.deferred.push((at, bytes)),
            }
        }
        p.dirty_entries = p.dirty_entries.saturating_add(1);
        if !p.dirty {
            p.dirty = true;
            if !p.in_flight {
                self.dirty.push_back(id);
            }
        }
        debug_assert!(self.page(id).consistent());
        now
    }

    /// `ack` waits for the next write of page `id` (whose entry it changed), from `now`.
    pub fn wait(&mut self, id: PageId, ack: A, now: Instant) {
        let p = self.page_mut(id);
        debug_assert!(p.dirty, "a store waits on a page its entry did not change");
        if p.waiting.is_empty() {
            p.waiting_since = Some(now);
        }
        p.waiting.push(ack);
    }

    /// The first queued page from position `from` of [`TablePages::queued`] that is due: it
    /// has stores waiting, or at least `batch` changed entries, or `quiet` (the worker is about
    /// to run out of work, or stopping: every dirty page is due). Its position, to start it.
    pub fn next_due(&self, from: usize, quiet: bool, batch: u16) -> Option<usize> {
        (from..self.dirty.len()).find(|&i| {
            let p = self.page(self.dirty[i]);
            quiet || !p.waiting.is_empty() || p.dirty_entries >= batch
        })
    }

    /// Starts the write of the queued page at position `i`: it is clean and in flight, and
    /// the write carries the stores waiting on it. Its address.
    pub fn start(&mut self, i: usize) -> PageId {
        let id = self.dirty.remove(i).expect("a queued page");
        let p = self.page_mut(id);
        debug_assert!(
            p.dirty && !p.in_flight,
            "a page queued must be dirty and not in flight"
        );
        p.dirty = false;
        p.dirty_entries = 0;
        p.in_flight = true;
        p.committing = std::mem::take(&mut p.waiting);
        p.waiting_since = None;
        self.in_flight += 1;
        debug_assert!(self.page(id).consistent());
        id
    }

    /// The write of page `id` completed (well or not): the stores it carried, and the entries
    /// changed meanwhile, for the caller to copy into the meta buffer. A page dirty again is
    /// queued again.
    pub fn written(&mut self, id: PageId) -> (Vec<A>, Vec<Deferred>) {
        let p = self.page_mut(id);
        debug_assert!(p.in_flight, "a write completed for a page not in flight");
        p.in_flight = false;
        let out = (
            std::mem::take(&mut p.committing),
            std::mem::take(&mut p.deferred),
        );
        let requeue = p.dirty;
        self.in_flight -= 1;
        if requeue {
            self.dirty.push_back(id);
        }
        debug_assert!(self.page(id).consistent());
        out
    }

    /// The queued pages (none in flight, so no write of theirs covers their stores' deadline)
    /// whose stores have waited longer than `limit` at `now`.
    pub fn overdue(&self, now: Instant, limit: std::time::Duration) -> Vec<PageId> {
        self.dirty
            .iter()
            .copied()
            .filter(|&id| {
                let p = self.page(id);
                !p.in_flight
                    && p.waiting_since
                        .is_some_and(|since| now.duration_since(since) > limit)
            })
            .collect()
    }

    /// Takes the stores waiting on page `id`; `keep` those that still wait (their clock
    /// restarts at `now`) and returns the rest.
    pub fn expire(&mut self, id: PageId, now: Instant, mut keep: impl FnMut(&A) -> bool) -> Vec<A> {
        let p = self.page_mut(id);
        let (still, gone): (Vec<A>, Vec<A>) = std::mem::take(&mut p.waiting)
            .into_iter()
            .partition(|a| keep(a));
        p.waiting_since = (!still.is_empty()).then_some(now);
        p.waiting = still;
        debug_assert!(self.page(id).consistent());
        gone
    }

    /// The first page with stores not acknowledged yet (waiting or committing), if any.
    #[cfg(any(test, feature = "sim"))]
    pub fn first_unacknowledged(&self) -> Option<PageId> {
        self.devs.iter().enumerate().find_map(|(d, pages)| {
            pages
                .iter()
                .position(|p| !p.waiting.is_empty() || !p.committing.is_empty())
                .map(|page| (d as u16, page as u32))
        })
    }

    /// Every page's invariants, and the queue's and the in-flight count's agreement with the
    /// pages: the whole state checked (tests, the simulator's quiet check).
    #[cfg(any(test, feature = "sim"))]
    pub fn check(&self) -> Result<(), String> {
        let mut in_flight = 0;
        for (d, pages) in self.devs.iter().enumerate() {
            for (page, p) in pages.iter().enumerate() {
                let id = (d as u16, page as u32);
                if !p.consistent() {
                    return Err(format!("page {id:?} is inconsistent"));
                }
                let queued = self.dirty.iter().filter(|&&q| q == id).count();
                if queued != usize::from(p.dirty && !p.in_flight) {
                    return Err(format!(
                        "page {id:?} (dirty {}, in flight {}) is queued {queued} times",
                        p.dirty, p.in_flight
                    ));
                }
                in_flight += usize::from(p.in_flight);
            }
        }
        if in_flight != self.in_flight {
            return Err(format!(
                "{in_flight} pages in flight, counted {}",
                self.in_flight
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn entry(b: u8) -> [u8; ENTRY_BYTES] {
        [b; ENTRY_BYTES]
    }

    #[test]
    fn a_changed_page_is_queued_once_and_written_with_its_stores() {
        let mut pages: TablePages<&str> = TablePages::new(&[2, 1]);
        let t0 = Instant::now();
        assert!(
            pages.changed((0, 1), 64, entry(1)),
            "not in flight: write it now"
        );
        assert!(pages.changed((0, 1), 128, entry(2)));
        pages.wait((0, 1), "store a", t0);
        assert_eq!(
            pages.queued().iter().copied().collect::<Vec<_>>(),
            vec![(0, 1)]
        );
        assert_eq!(
            pages.next_due(0, false, 32),
            Some(0),
            "a store waits: due at once"
        );
        let id = pages.start(0);
        assert_eq!(id, (0, 1));
        assert!(pages.all_written());
        assert_eq!(pages.in_flight(), 1);
        assert_eq!(pages.page(id).committing(), ["store a"]);
        let (acks, deferred) = pages.written(id);
        assert_eq!(acks, vec!["store a"]);
        assert!(deferred.is_empty());
        assert!(pages.all_written(), "nothing changed meanwhile: clean");
        assert_eq!(pages.in_flight(), 0);
        pages.check().expect("consistent");
    }

    /// Group commit: stores that arrive while their page is in flight share its next write,
    /// and their entries wait aside (the latest per entry) until the device has read the page.
    #[test]
    fn changes_while_in_flight_wait_for_the_next_write() {
        let mut pages: TablePages<u32> = TablePages::new(&[1]);
        let t0 = Instant::now();
        pages.changed((0, 0), 0, entry(1));
        pages.wait((0, 0), 1, t0);
        let id = pages.start(0);
        assert!(!pages.changed(id, 64, entry(2)), "in flight: keep it aside");
        assert!(
            !pages.changed(id, 64, entry(3)),
            "a later change replaces it"
        );
        assert!(!pages.changed(id, 128, entry(4)));
        pages.wait(id, 2, t0);
        pages.wait(id, 3, t0);
        assert!(
            pages.all_written(),
            "in flight: not queued while the device reads it"
        );
        assert_eq!(
            pages.page(id).committing(),
            [1],
            "only the store there at the start"
        );
        let (acks, deferred) = pages.written(id);
        assert_eq!(acks, vec![1]);
        assert_eq!(deferred, vec![(64, entry(3)), (128, entry(4))]);
        assert_eq!(pages.queued().len(), 1, "dirty again: queued again");
        let id = pages.start(pages.next_due(0, false, 32).expect("stores wait: due"));
        assert_eq!(pages.page(id).committing(), [2, 3]);
        let (acks, deferred) = pages.written(id);
        assert_eq!(acks, vec![2, 3]);
        assert!(deferred.is_empty());
        pages.check().expect("consistent");
    }

    #[test]
    fn a_page_without_stores_waits_for_a_batch_or_a_quiet_worker() {
        let mut pages: TablePages<()> = TablePages::new(&[1, 1]);
        pages.changed((1, 0), 0, entry(1));
        pages.changed((0, 0), 0, entry(1));
        pages.changed((0, 0), 64, entry(1));
        assert_eq!(
            pages.next_due(0, false, 3),
            None,
            "2 and 1 entries of a batch of 3"
        );
        pages.changed((0, 0), 128, entry(1));
        assert_eq!(
            pages.next_due(0, false, 3),
            Some(1),
            "the second queued has 3"
        );
        assert_eq!(
            pages.next_due(0, true, 3),
            Some(0),
            "quiet: every page is due"
        );
        assert_eq!(pages.start(1), (0, 0));
        assert_eq!(pages.start(0), (1, 0));
        assert_eq!(pages.in_flight(), 2);
        pages.check().expect("consistent");
    }

    #[test]
    fn stores_waiting_too_long_without_a_write_expire() {
        let mut pages: TablePages<u32> = TablePages::new(&[2]);
        let t0 = Instant::now();
        let limit = Duration::from_millis(100);
        pages.changed((0, 0), 0, entry(1));
        pages.wait((0, 0), 1, t0);
        pages.wait((0, 0), 2, t0);
        pages.changed((0, 1), 4096, entry(1));
        pages.wait((0, 1), 3, t0 + Duration::from_millis(90));
        let at = t0 + Duration::from_millis(150);
        assert_eq!(pages.overdue(at, limit), vec![(0, 0)]);
        // Store 2's data write is still in flight: it stays, its clock restarted.
        assert_eq!(pages.expire((0, 0), at, |&a| a == 2), vec![1]);
        assert_eq!(pages.page((0, 0)).waiting(), [2]);
        assert!(pages
            .overdue(at + Duration::from_millis(50), limit)
            .contains(&(0, 1)));
        assert!(!pages
            .overdue(at + Duration::from_millis(50), limit)
            .contains(&(0, 0)));
        // A page in flight is never overdue here: its write's own deadline covers it.
        let id = pages.start(0);
        assert!(!pages
            .overdue(at + Duration::from_secs(9), limit)
            .contains(&id));
        pages.check().expect("consistent");
    }

    #[test]
    fn the_check_names_a_page_out_of_step_with_the_queue() {
        let mut pages: TablePages<()> = TablePages::new(&[1]);
        pages.changed((0, 0), 0, entry(1));
        pages.dirty.push_back((0, 0));
        let err = pages.check().expect_err("queued twice");
        assert!(err.contains("queued 2 times"), "{err}");
        pages.dirty.pop_back();
        pages.in_flight = 1;
        let err = pages.check().expect_err("a count with nothing in flight");
        assert!(err.contains("0 pages in flight, counted 1"), "{err}");
    }
}
