//! A worker's slots on one device: their metadata, the free list and the CLOCK hand, with the
//! invariants that tie them (a slot is on the free list exactly when it is free; a pinned slot
//! is never freed or chosen as a victim) checked where they can break.

use std::ops::{Index, IndexMut};

use super::layout::{SlotMeta, SlotState, FREE_SLOT};

pub(super) struct Slots {
    meta: Vec<SlotMeta>,
    /// Free slots, taken from the end (the lowest slot first on a fresh device).
    free: Vec<u32>,
    /// CLOCK's hand: the slot examined last.
    hand: usize,
}

impl Slots {
    /// `n` free slots.
    pub fn new(n: usize) -> Slots {
        Slots {
            meta: vec![FREE_SLOT; n],
            free: (0..n as u32).rev().collect(),
            hand: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.meta.len()
    }

    pub fn is_empty(&self) -> bool {
        self.meta.is_empty()
    }

    /// For the simulator's leak check.
    #[cfg(any(test, feature = "sim"))]
    pub fn iter(&self) -> impl Iterator<Item = &SlotMeta> {
        self.meta.iter()
    }

    /// A free slot, off the free list (the caller fills it in).
    pub fn take_free(&mut self) -> Option<u32> {
        let s = self.free.pop()?;
        debug_assert!(
            self.meta[s as usize].state == SlotState::Free,
            "slot {s} on the free list is {:?}",
            self.meta[s as usize].state
        );
        Some(s)
    }

    /// Frees slot `local`: its metadata cleared, back on the free list. Never a pinned slot
    /// (a read of it is in flight) nor one already free.
    pub fn free(&mut self, local: u32) {
        let s = &mut self.meta[local as usize];
        debug_assert!(s.pins == 0, "slot {local} freed with {} pins", s.pins);
        debug_assert!(s.state != SlotState::Free, "slot {local} freed twice");
        *s = FREE_SLOT;
        self.free.push(local);
    }

    /// One more read of slot `local` in flight, if it holds a block that can be read (valid);
    /// the read is a use (CLOCK's reference bit). False, with nothing changed, for a slot whose
    /// block is still being written or is going away.
    pub fn pin_valid(&mut self, local: u32) -> bool {
        let s = &mut self.meta[local as usize];
        if !matches!(s.state, SlotState::Valid) {
            return false;
        }
        s.pins += 1;
        s.referenced = true;
        true
    }

    /// One more read of slot `local` in flight.
    pub fn pin(&mut self, local: u32) {
        let s = &mut self.meta[local as usize];
        debug_assert!(
            matches!(s.state, SlotState::Valid | SlotState::Doomed),
            "pinning a {:?} slot {local}",
            s.state
        );
        s.pins += 1;
    }

    /// One read of slot `local` ended. A slot doomed meanwhile is freed by its last unpin,
    /// whichever read that is; true if it was.
    pub fn unpin(&mut self, local: u32) -> bool {
        let s = &mut self.meta[local as usize];
        debug_assert!(s.pins > 0, "unpinning slot {local} with no pin");
        s.pins -= 1;
        if s.pins == 0 && matches!(s.state, SlotState::Doomed) {
            self.free(local);
            return true;
        }
        false
    }

    /// A load's read of slot `local` ended: unpins it (see [`Slots::unpin`]) and returns the
    /// slot as the read found it (its checksum, whether it was verified).
    pub fn end_read(&mut self, local: u32) -> SlotMeta {
        let found = self.meta[local as usize];
        self.unpin(local);
        found
    }

    /// CLOCK: the first valid, unpinned slot past the hand whose reference bit is clear,
    /// clearing the bits it passes (a second chance). `None` if every valid slot is pinned.
    pub fn clock_victim(&mut self) -> Option<u32> {
        let n = self.meta.len();
        for _ in 0..2 * n {
            self.hand = (self.hand + 1) % n;
            let s = &mut self.meta[self.hand];
            if s.state != SlotState::Valid || s.pins > 0 {
                continue;
            }
            if s.referenced {
                s.referenced = false;
                continue;
            }
            return Some(self.hand as u32);
        }
        None
    }

    /// After recovery filled the metadata in: the free list is every free slot again.
    pub fn rebuild_free_list(&mut self) {
        let meta = &self.meta;
        self.free = (0..meta.len() as u32)
            .rev()
            .filter(|&s| meta[s as usize].state == SlotState::Free)
            .collect();
    }

    /// The invariants, for the simulator's checks and the tests: the free list holds each
    /// free slot once and nothing else.
    #[cfg(any(test, feature = "sim"))]
    pub fn check(&self) -> Result<(), String> {
        let mut listed = vec![false; self.meta.len()];
        for &s in &self.free {
            let Some(seen) = listed.get_mut(s as usize) else {
                return Err(format!("slot {s} on the free list is out of range"));
            };
            if std::mem::replace(seen, true) {
                return Err(format!("slot {s} is on the free list twice"));
            }
            if self.meta[s as usize].state != SlotState::Free {
                return Err(format!(
                    "slot {s} on the free list is {:?}",
                    self.meta[s as usize].state
                ));
            }
        }
        let free = self
            .meta
            .iter()
            .filter(|s| s.state == SlotState::Free)
            .count();
        if free != self.free.len() {
            return Err(format!(
                "{free} free slots but {} on the free list",
                self.free.len()
            ));
        }
        Ok(())
    }
}

impl Index<usize> for Slots {
    type Output = SlotMeta;

    fn index(&self, local: usize) -> &SlotMeta {
        &self.meta[local]
    }
}

impl IndexMut<usize> for Slots {
    fn index_mut(&mut self, local: usize) -> &mut SlotMeta {
        &mut self.meta[local]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Key;

    fn fill(slots: &mut Slots, n: u64) -> Vec<u32> {
        (0..n)
            .map(|i| {
                let s = slots.take_free().expect("a free slot");
                slots[s as usize] = SlotMeta {
                    state: SlotState::Valid,
                    key: Some(Key::new(&i.to_le_bytes()).expect("a key")),
                    ..FREE_SLOT
                };
                s
            })
            .collect()
    }

    #[test]
    fn a_fresh_device_hands_out_its_lowest_slots_first_and_each_once() {
        let mut slots = Slots::new(4);
        assert_eq!(fill(&mut slots, 4), vec![0, 1, 2, 3]);
        assert_eq!(slots.take_free(), None);
        slots.check().expect("consistent");
        slots.free(2);
        assert_eq!(slots.take_free(), Some(2));
        assert_eq!(slots.take_free(), None);
    }

    #[test]
    fn clock_gives_referenced_slots_a_second_chance_and_skips_pinned_ones() {
        let mut slots = Slots::new(4);
        fill(&mut slots, 4);
        slots[1].referenced = true;
        slots.pin(2);
        // The hand starts at 0 and moves first: 1 is referenced (cleared, passed), 2 is
        // pinned, 3 is the victim.
        assert_eq!(slots.clock_victim(), Some(3));
        assert!(!slots[1].referenced, "its second chance is used up");
        slots.free(3);
        // Next: 0 (after the wrap).
        assert_eq!(slots.clock_victim(), Some(0));
        slots.free(0);
        // 1 is next now that its bit is clear; 2 stays pinned.
        assert_eq!(slots.clock_victim(), Some(1));
        slots.free(1);
        assert_eq!(slots.clock_victim(), None, "only a pinned slot is left");
        assert!(!slots.unpin(2), "a valid slot stays at its last unpin");
        assert_eq!(slots.clock_victim(), Some(2));
        slots.check().expect("consistent");
    }

    #[test]
    fn a_doomed_slot_is_freed_by_its_last_unpin() {
        let mut slots = Slots::new(2);
        fill(&mut slots, 2);
        slots.pin(0);
        slots.pin(0);
        slots[0].state = SlotState::Doomed;
        assert_eq!(
            slots.clock_victim(),
            Some(1),
            "a doomed slot is never a victim"
        );
        assert!(!slots.unpin(0));
        assert_eq!(slots.take_free(), None);
        assert!(slots.unpin(0), "the last read frees it");
        assert_eq!(slots[0].state, SlotState::Free);
        assert_eq!(slots.take_free(), Some(0));
    }

    #[test]
    fn recovery_rebuilds_the_free_list_from_the_slots_and_check_finds_a_broken_one() {
        let mut slots = Slots::new(5);
        for s in [0, 3] {
            slots[s] = SlotMeta {
                state: SlotState::Valid,
                ..FREE_SLOT
            };
        }
        // The metadata says 0 and 3 hold blocks; the list (all five) says otherwise.
        assert!(slots.check().is_err());
        slots.rebuild_free_list();
        slots.check().expect("consistent");
        assert_eq!(slots.take_free(), Some(1));
        assert_eq!(slots.take_free(), Some(2));
        assert_eq!(slots.take_free(), Some(4));
        assert_eq!(slots.take_free(), None);
        slots.free.push(0);
        let broken = slots.check().expect_err("a valid slot on the free list");
        assert!(broken.contains("slot 0"), "{broken}");
    }
}
