//! Stored/removed events for the inference server's KV-event stream (vLLM's `OffloadingEvent`).
//!
//! The buffer is bounded (`events.max`): when the caller does not drain it, the oldest events are
//! dropped and counted, so a forgotten `take_events` cannot grow memory without limit.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use crate::config::Locality;
use crate::key::Key;
use crate::tier::Tier;

/// Where the event's blocks live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Medium {
    /// vLLM's `STORAGE` medium: the NVMe tier and the S3 tier both report it (see `tier`).
    Storage,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub keys: Vec<Key>,
    pub medium: Medium,
    /// Which of kvtier's tiers the blocks were stored in or removed from.
    pub tier: Tier,
    pub removed: bool,
    pub locality: Option<Locality>,
}

pub(crate) struct EventSink {
    enabled: bool,
    max: usize,
    locality: Option<Locality>,
    buf: Mutex<VecDeque<Event>>,
    dropped: AtomicU64,
}

impl EventSink {
    pub fn new(enabled: bool, max: usize, locality: Option<Locality>) -> EventSink {
        EventSink {
            enabled,
            max,
            locality,
            buf: Mutex::new(VecDeque::new()),
            dropped: AtomicU64::new(0),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn push(&self, keys: Vec<Key>, removed: bool) {
        self.push_tier(keys, removed, Tier::Nvme);
    }

    pub fn push_tier(&self, keys: Vec<Key>, removed: bool, tier: Tier) {
        if !self.enabled || keys.is_empty() {
            return;
        }
        let mut buf = self
            .buf
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while buf.len() >= self.max {
            buf.pop_front();
            self.dropped.fetch_add(1, Relaxed);
        }
        buf.push_back(Event {
            keys,
            medium: Medium::Storage,
            tier,
            removed,
            locality: self.locality,
        });
    }

    pub fn take(&self) -> Vec<Event> {
        let mut buf = self
            .buf
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        buf.drain(..).collect()
    }

    pub fn dropped(&self) -> u64 {
        self.dropped.load(Relaxed)
    }
}
