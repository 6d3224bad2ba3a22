//! The node: the engine's core, which every front end drives. It admits jobs, answers lookups,
//! asks for removals, touches and key lists, and stops, over the router, the workers' shared
//! state and the cold tier. [`crate::Engine`] is a front end that runs the workers on threads
//! and hands results to one caller; the simulator's `Cluster` is one that steps the workers
//! from its own thread. Neither admits, looks up or stops in code of its own.
//!
//! Each client registers a sink ([`Node::register_client`]) and its jobs' results leave
//! through it: the engine's caller has a channel and an eventfd, a daemon would have one per
//! process it serves.
//!
//! A node never blocks its callers: a submit passes the [`gate::Gate`] (one atomic word, no
//! lock), is admitted or refused with `Backpressure`, and is queued on its workers without
//! waiting. [`Node::close`] shuts the gate and waits only for submits already inside.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

use crate::cold::ColdTier;
use crate::config::FirstLookup;
use crate::error::{Error, Result};
use crate::io::Region;
use crate::job::sink::{ClientId, ResultSink};
use crate::job::{Job, JobKind, RegionId, Shared};
use crate::key::Key;
use crate::route::{items_by_worker, Router};
use crate::tier::Lookup;
use crate::worker::{self, Msg, Removed};

pub(crate) mod admit;
pub(crate) mod build;
pub(crate) mod gate;
pub(crate) mod lookup;

/// A registered client of the node, as its front end keeps it: its id (its results' sink) and
/// the region its blocks are in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Client {
    pub id: ClientId,
    pub region: RegionId,
}

/// What a node is made of: the parts its front end built (the workers' channels in the
/// router, the shared job state) and the limits from the validated config.
pub(crate) struct Node {
    shared: Arc<Shared>,
    router: Arc<Router>,
    /// A second receiver of each worker's channel, for the work that reaches a worker after it
    /// stopped ([`Node::fail_left_behind`]).
    left_behind: Vec<Receiver<Msg>>,
    /// The regions clients' blocks are in, by `RegionId`, with their block counts (every
    /// worker's backend has each registered).
    regions: Vec<(Arc<Region>, u64)>,
    jobs_in_flight_max: usize,
    /// The files layout: what the first lookup of a key no worker indexed answers (`None`:
    /// slab).
    first_lookup: Option<FirstLookup>,
    /// The cold tier, once attached.
    cold: Option<Arc<dyn ColdTier>>,
    gate: gate::Gate,
}

impl Node {
    /// A node over `router`'s workers. `left_behind[w]` receives from worker `w`'s channel.
    pub fn new(
        shared: Arc<Shared>,
        router: Arc<Router>,
        left_behind: Vec<Receiver<Msg>>,
        regions: Vec<(Arc<Region>, u64)>,
        jobs_in_flight_max: usize,
        first_lookup: Option<FirstLookup>,
    ) -> Node {
        debug_assert_eq!(left_behind.len(), router.workers.len());
        Node {
            shared,
            router,
            left_behind,
            regions,
            jobs_in_flight_max,
            first_lookup,
            cold: None,
            gate: gate::Gate::default(),
        }
    }

    /// Connects `cold` as the node's cold tier: loads of keys no worker holds go to it, and
    /// lookups ask it. It serves every region: it lands and copies a job's blocks through the
    /// job's lease, in the job's client's region.
    pub fn attach_cold(&mut self, cold: Arc<dyn ColdTier>) {
        let _ = self.shared.miss_fallback.set(cold.miss_fallback());
        self.cold = Some(cold);
    }

    pub fn cold(&self) -> Option<&Arc<dyn ColdTier>> {
        self.cold.as_ref()
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    pub fn workers(&self) -> usize {
        self.router.workers.len()
    }

    pub fn is_open(&self) -> bool {
        self.gate.is_open()
    }

    /// Adds a client whose blocks are in node region `region`: the results of the jobs it
    /// submits go to `sink`. Refused for a region the node does not have.
    pub fn register_client(&self, sink: &Arc<dyn ResultSink>, region: RegionId) -> Result<Client> {
        if usize::from(region) >= self.regions.len() {
            return Err(Error::Worker(format!(
                "region {region}: the node has {} region(s)",
                self.regions.len()
            )));
        }
        let id = self.shared.sinks.register(sink);
        Ok(Client { id, region })
    }

    /// Admits `client`'s job (see [`admit`]); `Error::Shutdown` once the node is closed.
    pub fn submit(&self, client: Client, kind: JobKind, job: Job) -> Result<()> {
        let Some(_inside) = self.gate.enter() else {
            return Err(Error::Shutdown);
        };
        self.admit(client, kind, job)
    }

    /// Answers from the workers' published keys, the files layout's answers for keys not
    /// indexed, then the cold tier (see [`lookup`]); counted in the engine's metrics.
    pub fn lookup(&self, keys: &[Key]) -> Vec<Lookup> {
        let out = self.answer(keys);
        self.count_lookups(&out);
        out
    }

    /// Asks every worker holding some of `keys` to remove them; each answers on `reply` with
    /// `(index in keys, removed)` between two turns of its loop. Returns how many were asked
    /// (none once closed).
    pub fn ask_remove(&self, keys: &[Key], reply: &Sender<Removed>) -> usize {
        if keys.is_empty() || !self.is_open() {
            return 0;
        }
        self.router.ask_remove(keys, reply)
    }

    /// Asks every worker for the keys it holds, answered on `reply`; how many were asked (none
    /// once closed).
    pub fn ask_keys(&self, reply: &Sender<Vec<Key>>) -> usize {
        if !self.is_open() {
            return 0;
        }
        for (tx, me) in &self.router.workers {
            let _ = tx.send(Msg::Keys(reply.clone()));
            me.nudge();
        }
        self.router.workers.len()
    }

    /// Marks `keys` recently used on their workers (keys not held are ignored); nothing once
    /// closed.
    pub fn touch(&self, keys: &[Key]) {
        if keys.is_empty() || !self.is_open() {
            return;
        }
        let parts = items_by_worker(keys, self.router.workers.len());
        for ((tx, me), items) in self.router.workers.iter().zip(parts) {
            if !items.is_empty() {
                let part = items.iter().map(|&i| keys[i as usize]).collect();
                // Cannot fail (see worker::send_parts); a worker that stopped drops it at its stop.
                let _ = tx.send(Msg::Touch(part));
                me.nudge();
            }
        }
    }

    /// Starts the stop: closes the gate (waiting for submits already inside, which never
    /// block), fails what the cold tier has queued, and tells every worker to stop (queued
    /// jobs fail with `Shutdown`, I/O in flight runs on). True for the call that closed it.
    pub fn close(&self) -> bool {
        if !self.gate.close() {
            return false;
        }
        if let Some(cold) = &self.cold {
            cold.close();
        }
        self.router.stop();
        true
    }

    /// Once the workers have ended: fails the work that reached a worker after it stopped, so
    /// every job is reported exactly once (the closed gate guarantees no submit is still
    /// queueing work).
    pub fn fail_left_behind(&self) {
        debug_assert!(!self.is_open(), "failing work left behind on an open node");
        for (rx, (_, me)) in self.left_behind.iter().zip(&self.router.workers) {
            worker::fail_left_behind(rx, me, &self.shared);
        }
    }

    /// Jobs submitted whose result has not been published yet.
    pub fn jobs_in_flight(&self) -> usize {
        self.shared.jobs_in_flight.load(Ordering::Acquire)
    }

    /// See `Engine::set_early_results`.
    pub fn set_early_results(&self, early: bool) {
        self.shared.early_results.store(early, Ordering::Relaxed);
    }
}
