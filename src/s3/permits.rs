//! Request slots for the object store, loads first: `max_concurrency` permits shared by every
//! request; a freed permit goes to a waiting GET or HEAD before any waiting PUT, in arrival
//! order within each class. Uploads may use every permit while no read waits (the pool is work
//! conserving), so a write-only stream runs at full concurrency and a read waits at most for
//! the next request to finish. Closing fails every waiter and every later acquire.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// GET and HEAD: someone is waiting for the answer.
    Read,
    /// PUT: write-through, background uploads, demotions.
    Write,
}

struct State {
    free: usize,
    reads: VecDeque<oneshot::Sender<()>>,
    writes: VecDeque<oneshot::Sender<()>>,
    closed: bool,
}

pub(crate) struct Permits {
    state: Mutex<State>,
}

/// One request slot; given back (to the next waiter) when dropped.
pub(crate) struct Permit(Arc<Permits>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.release();
    }
}

struct Waiting {
    rx: Option<oneshot::Receiver<()>>,
    pool: Arc<Permits>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if rx.try_recv().is_ok() {
                self.pool.release();
            }
        }
    }
}

impl Permits {
    pub fn new(total: usize) -> Arc<Permits> {
        Arc::new(Permits {
            state: Mutex::new(State {
                free: total,
                reads: VecDeque::new(),
                writes: VecDeque::new(),
                closed: false,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A slot, or `None` once closed.
    pub async fn acquire(self: &Arc<Self>, class: Class) -> Option<Permit> {
        let rx = {
            let mut s = self.lock();
            if s.closed {
                return None;
            }
            // A write also yields to reads already waiting (none can be while permits are
            // free, but the check keeps the order rule local).
            if s.free > 0 && (class == Class::Read || s.reads.is_empty()) {
                s.free -= 1;
                return Some(Permit(Arc::clone(self)));
            }
            let (tx, rx) = oneshot::channel();
            match class {
                Class::Read => s.reads.push_back(tx),
                Class::Write => s.writes.push_back(tx),
            }
            rx
        };
        // The permit is handed over by `release` (or the sender dropped by `close`). If this
        // future is dropped after the hand-over but before it saw it, the guard gives it back.
        let mut waiting = Waiting {
            rx: Some(rx),
            pool: Arc::clone(self),
        };
        let got = match waiting.rx.as_mut() {
            Some(rx) => rx.await,
            None => return None,
        };
        waiting.rx = None;
        got.ok().map(|()| Permit(Arc::clone(self)))
    }

    fn release(&self) {
        let mut s = self.lock();
        // Hand the slot to the first waiter still waiting, reads first; a waiter whose task
        // was dropped refuses it and the next one is tried.
        while let Some(tx) = s.reads.pop_front().or_else(|| s.writes.pop_front()) {
            if tx.send(()).is_ok() {
                return;
            }
        }
        s.free += 1;
    }

    /// Fails every waiter and every later acquire; permits held stay valid until dropped.
    pub fn close(&self) {
        let mut s = self.lock();
        s.closed = true;
        s.reads.clear();
        s.writes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    #[test]
    fn a_freed_permit_goes_to_a_waiting_read_before_earlier_writes() {
        rt().block_on(async {
            let p = Permits::new(1);
            let held = p.acquire(Class::Write).await.expect("free permit");
            let order = Arc::new(Mutex::new(Vec::new()));
            let mut tasks = Vec::new();
            for (name, class) in [
                ("w1", Class::Write),
                ("w2", Class::Write),
                ("r1", Class::Read),
            ] {
                let (p, order) = (Arc::clone(&p), Arc::clone(&order));
                tasks.push(tokio::spawn(async move {
                    let _permit = p.acquire(class).await.expect("permit");
                    order.lock().expect("lock").push(name);
                }));
                tokio::task::yield_now().await; // queue in this order
            }
            drop(held);
            for t in tasks {
                t.await.expect("task");
            }
            assert_eq!(*order.lock().expect("lock"), vec!["r1", "w1", "w2"]);
        });
    }

    #[test]
    fn writes_may_use_every_permit_and_close_fails_waiters() {
        rt().block_on(async {
            let p = Permits::new(3);
            let mut held = Vec::new();
            for _ in 0..3 {
                held.push(p.acquire(Class::Write).await.expect("work conserving"));
            }
            let waiter = {
                let p = Arc::clone(&p);
                tokio::spawn(async move { p.acquire(Class::Read).await.is_some() })
            };
            tokio::task::yield_now().await;
            p.close();
            assert!(!waiter.await.expect("task"), "a waiter fails at close");
            assert!(p.acquire(Class::Read).await.is_none());
            drop(held); // releasing after close is harmless
        });
    }

    #[test]
    fn a_cancelled_waiter_does_not_swallow_the_permit() {
        rt().block_on(async {
            let p = Permits::new(1);
            let held = p.acquire(Class::Read).await.expect("permit");
            let cancelled = {
                let p = Arc::clone(&p);
                tokio::spawn(async move { p.acquire(Class::Read).await.map(drop) })
            };
            tokio::task::yield_now().await;
            cancelled.abort();
            let _ = cancelled.await;
            drop(held);
            let again =
                tokio::time::timeout(std::time::Duration::from_secs(5), p.acquire(Class::Write))
                    .await
                    .expect("the permit came back");
            assert!(again.is_some());
        });
    }
}
