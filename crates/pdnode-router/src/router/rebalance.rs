//! Rebalancing decode nodes by moving streams (`[router.rebalance]`; docs/runtime-semantics.md,
//! "Live decode migration"): every `interval_ms`, when the decode node running the most
//! requests runs at least `min_gap` more than the one running the fewest (by this router's
//! view: node stats and its own bookings), one of this router's streams on the busiest node is
//! asked to move to the idlest. The stream moves as a drained node's do (`flow.rs`: park, push,
//! continue), at most one per interval, so the view catches up between moves.

use super::Router;
use crate::membership::Worker;
use crate::membership::{candidates, is_colocated};
use parking_lot::Mutex;
use pdnode_core::{NodeId, RequestId, Role};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// One stream's mailbox: where the rebalancer asks it to go.
#[derive(Default)]
pub(crate) struct MoveAsk {
    to: Mutex<Option<Worker>>,
    pub(crate) notify: Notify,
    /// The stream is being moved now: not a candidate.
    moving: std::sync::atomic::AtomicBool,
}

impl MoveAsk {
    /// The destination asked for, once.
    pub(crate) fn take(&self) -> Option<Worker> {
        self.to.lock().take()
    }
}

/// This router's streams by decode node, and when the last move was asked.
#[derive(Default)]
pub(crate) struct Streams {
    on: Mutex<HashMap<RequestId, (NodeId, Arc<MoveAsk>)>>,
    last_move: Mutex<Option<Instant>>,
}

/// A stream's registration; removed when dropped.
pub(crate) struct StreamEntry<'a> {
    streams: &'a Streams,
    id: RequestId,
    pub(crate) ask: Arc<MoveAsk>,
}

impl StreamEntry<'_> {
    /// Whether the stream is being moved (parked, or on its way to another node).
    pub(crate) fn set_moving(&self, on: bool) {
        self.ask
            .moving
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The stream now runs on `node`.
    pub(crate) fn moved_to(&self, node: &NodeId) {
        if let Some(e) = self.streams.on.lock().get_mut(&self.id) {
            e.0 = node.clone();
        }
    }
}

impl Drop for StreamEntry<'_> {
    fn drop(&mut self) {
        self.streams.on.lock().remove(&self.id);
    }
}

impl Streams {
    pub(crate) fn register(&self, id: RequestId, node: &NodeId) -> StreamEntry<'_> {
        let ask = Arc::new(MoveAsk::default());
        self.on.lock().insert(id, (node.clone(), ask.clone()));
        StreamEntry {
            streams: self,
            id,
            ask,
        }
    }
}

impl Router {
    /// One rebalancing look (the stats loop calls it after each refresh): asks one stream to
    /// move when the decode nodes' running requests differ by `router.rebalance.min_gap` or
    /// more and the last move is `interval_ms` old. Returns the stream asked and where to.
    pub fn rebalance_now(&self) -> Option<(RequestId, NodeId)> {
        let cfg = &self.deps.config.rebalance;
        if cfg.min_gap == 0 {
            return None;
        }
        let now = Instant::now();
        {
            let last = self.streams.last_move.lock();
            if last.is_some_and(|t| now.duration_since(t) < Duration::from_millis(cfg.interval_ms))
            {
                return None;
            }
        }
        let (_, decodes) = candidates(self.deps.membership.as_ref());
        let decodes: Vec<Worker> = decodes
            .into_iter()
            .filter(|w| w.card.role == Role::Decode && !is_colocated(w))
            .collect();
        let (busiest, idlest) = {
            let st = self.state.lock();
            // a node judged unreachable lately is neither asked to give nor to take a stream
            let decodes: Vec<&Worker> = decodes
                .iter()
                .filter(|w| !st.is_suspect(w.id(), now))
                .collect();
            let load = |w: &&Worker| st.load_of(w.id()).running;
            let busiest = decodes.iter().max_by_key(|w| load(w))?;
            let idlest = decodes.iter().min_by_key(|w| load(w))?;
            if load(busiest) < load(idlest) + cfg.min_gap {
                return None;
            }
            ((*busiest).clone(), (*idlest).clone())
        };
        let (id, ask) = {
            let on = self.streams.on.lock();
            let (id, (_, ask)) = on.iter().find(|(_, (n, a))| {
                n == busiest.id() && !a.moving.load(std::sync::atomic::Ordering::Relaxed)
            })?;
            (*id, ask.clone())
        };
        *ask.to.lock() = Some(idlest.clone());
        ask.notify.notify_one();
        *self.streams.last_move.lock() = Some(now);
        tracing::info!(request = %id, from = %busiest.id(), to = %idlest.id(), "rebalancing: moving a stream");
        Some((id, idlest.id().clone()))
    }
}
