//! Where a job's result goes: the sink of the client that submitted it. A node serves any
//! number of clients (the `Engine` is one; a daemon has one per process it serves), each
//! registered once with a [`ResultSink`] of its own, and every caller's job carries its
//! client's id to its result. Sinks are found without a lock: the table is published through
//! an `ArcSwap` and only grows.

use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use crossbeam_channel::{Receiver, Sender};
use kvtier_sys::eventfd::EventFd;

use super::JobResult;

/// Which client of the node submitted a job (the index of its sink).
pub(crate) type ClientId = u32;

/// What receives a client's results, each exactly once. Called on whichever thread resolves
/// the job (a worker, the S3 reactor, a lease's last holder, the shutdown): it must not block.
pub(crate) trait ResultSink: Send + Sync {
    fn deliver(&self, result: JobResult);
}

/// The node's clients' sinks, by [`ClientId`].
pub(crate) struct Sinks {
    table: ArcSwap<Vec<Arc<dyn ResultSink>>>,
}

impl Default for Sinks {
    fn default() -> Sinks {
        Sinks {
            table: ArcSwap::from_pointee(Vec::new()),
        }
    }
}

impl Sinks {
    /// Adds a client; its jobs' results go to `sink` from now on.
    pub fn register(&self, sink: &Arc<dyn ResultSink>) -> ClientId {
        let mut id = 0;
        self.table.rcu(|t| {
            let mut t = Vec::clone(t);
            id = t.len();
            t.push(Arc::clone(sink));
            t
        });
        ClientId::try_from(id).expect("fewer than 2^32 clients")
    }

    /// Hands `result` to its client's sink.
    pub fn deliver(&self, result: JobResult) {
        let table = self.table.load();
        if let Some(sink) = table.get(result.client as usize) {
            sink.deliver(result);
        } else {
            // Admission only takes jobs of registered clients.
            debug_assert!(false, "a result for client {} unknown", result.client);
            tracing::error!(
                client = result.client,
                job = result.id,
                "a result for a client the node does not know was dropped"
            );
        }
    }
}

/// A client that takes its results from a channel (the `Engine`'s caller, the simulator's),
/// and, once asked for, an eventfd its own poll loop can wait on.
pub(crate) struct ChannelSink {
    tx: Sender<JobResult>,
    rx: Receiver<JobResult>,
    event: OnceLock<EventFd>,
}

impl Default for ChannelSink {
    fn default() -> ChannelSink {
        let (tx, rx) = crossbeam_channel::unbounded();
        ChannelSink {
            tx,
            rx,
            event: OnceLock::new(),
        }
    }
}

impl ChannelSink {
    /// Where the results arrive.
    pub fn results(&self) -> &Receiver<JobResult> {
        &self.rx
    }

    /// The eventfd written after every result from now on, created on the first call (a
    /// result already waiting writes it at once).
    pub fn event(&self) -> Result<&EventFd, kvtier_sys::Errno> {
        if self.event.get().is_none() {
            let event = EventFd::new()?;
            // Another thread may have set one first: then this one is dropped.
            if self.event.set(event).is_ok() && !self.rx.is_empty() {
                if let Some(event) = self.event.get() {
                    event.notify();
                }
            }
        }
        Ok(self.event.get().expect("set above"))
    }

    /// Resets the eventfd's counter; the notifications it held (0 without one).
    pub fn clear_event(&self) -> u64 {
        self.event.get().map_or(0, EventFd::drain)
    }
}

impl ResultSink for ChannelSink {
    fn deliver(&self, result: JobResult) {
        // The receiver lives as long as this sink; a closed channel cannot happen.
        let _ = self.tx.send(result);
        if let Some(event) = self.event.get() {
            event.notify();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::JobKind;
    use std::sync::Mutex;

    fn result(id: u64, client: ClientId) -> JobResult {
        JobResult {
            id,
            kind: JobKind::Load,
            success: true,
            keys_total: 0,
            succeeded_prefix: 0,
            failures: Vec::new(),
            bytes: 0,
            elapsed: std::time::Duration::ZERO,
            release: None,
            client,
        }
    }

    #[derive(Default)]
    struct Collect(Mutex<Vec<u64>>);

    impl ResultSink for Collect {
        fn deliver(&self, result: JobResult) {
            self.0.lock().expect("lock").push(result.id);
        }
    }

    #[test]
    fn each_result_reaches_its_clients_sink_only() {
        let sinks = Sinks::default();
        let a = Arc::new(Collect::default());
        let b = Arc::new(Collect::default());
        assert_eq!(sinks.register(&(Arc::clone(&a) as _)), 0);
        assert_eq!(sinks.register(&(Arc::clone(&b) as _)), 1);
        sinks.deliver(result(10, 1));
        sinks.deliver(result(11, 0));
        sinks.deliver(result(12, 1));
        assert_eq!(*a.0.lock().expect("lock"), vec![11]);
        assert_eq!(*b.0.lock().expect("lock"), vec![10, 12]);
    }

    #[test]
    fn a_channel_sink_queues_and_writes_its_eventfd() {
        let sink = ChannelSink::default();
        sink.deliver(result(1, 0));
        // Created after a result arrived: written at once, so a poll loop sees it.
        let event = sink.event().expect("eventfd");
        assert_eq!(event.drain(), 1);
        sink.deliver(result(2, 0));
        sink.deliver(result(3, 0));
        assert_eq!(sink.clear_event(), 2, "one notification per result");
        let ids: Vec<u64> = sink.results().try_iter().map(|r| r.id).collect();
        assert_eq!(ids, vec![1, 2, 3]);
        assert_eq!(sink.clear_event(), 0);
    }
}
