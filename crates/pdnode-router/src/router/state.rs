//! The router's synchronous decision state: the two policies, the last stats of each node and
//! the load the router booked on each node since. No I/O; unit-tested without a runtime.

use crate::membership::Worker;
use crate::node::NodeStats;
use crate::policy::{Policy, PolicyContext, WorkerLoad};
use pdnode_core::{NodeId, Role};
use std::collections::HashMap;
use std::time::Instant;

pub struct RouterState {
    prefill: Box<dyn Policy>,
    decode: Box<dyn Policy>,
    /// Requests the router has in flight on each node.
    booked: HashMap<NodeId, u32>,
    stats: HashMap<NodeId, NodeStats>,
}

impl RouterState {
    pub fn new(prefill: Box<dyn Policy>, decode: Box<dyn Policy>) -> Self {
        Self {
            prefill,
            decode,
            booked: HashMap::new(),
            stats: HashMap::new(),
        }
    }

    /// The load a policy sees for `id`: the larger of the node's own count and what the router
    /// booked (stats lag behind bookings; bookings miss other routers' requests).
    pub fn load_of(&self, id: &NodeId) -> WorkerLoad {
        let s = self.stats.get(id).cloned().unwrap_or_default();
        let booked = self.booked.get(id).copied().unwrap_or(0);
        WorkerLoad {
            id: id.clone(),
            running: s.running_requests.max(booked),
            queued: s.queued_requests,
            kv_blocks_free: s.kv_blocks_free,
            kv_blocks_total: s.kv_blocks_total,
        }
    }

    /// Picks a worker of `role` among `workers` minus `exclude` with that role's policy; the
    /// answer indexes `workers`.
    pub fn pick(
        &mut self,
        role: Role,
        workers: &[Worker],
        token_ids: &[u32],
        exclude: &[NodeId],
        now: Instant,
    ) -> Option<usize> {
        let candidates: Vec<usize> = (0..workers.len())
            .filter(|&i| !exclude.contains(workers[i].id()))
            .collect();
        let loads: Vec<WorkerLoad> = candidates
            .iter()
            .map(|&i| self.load_of(workers[i].id()))
            .collect();
        if loads.is_empty() {
            return None;
        }
        let ctx = PolicyContext {
            workers: &loads,
            token_ids,
            now,
        };
        let policy = if role == Role::Decode {
            &mut self.decode
        } else {
            &mut self.prefill
        };
        let k = policy.select(&ctx)?;
        candidates.get(k).copied()
    }

    pub fn book(&mut self, id: &NodeId) {
        *self.booked.entry(id.clone()).or_default() += 1;
    }

    pub fn release(&mut self, id: &NodeId) {
        if let Some(n) = self.booked.get_mut(id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.booked.remove(id);
            }
        }
    }

    pub fn booked(&self, id: &NodeId) -> u32 {
        self.booked.get(id).copied().unwrap_or(0)
    }

    pub fn set_stats(&mut self, id: NodeId, s: NodeStats) {
        self.stats.insert(id, s);
    }

    /// Forgets stats of nodes no longer present.
    pub fn retain_stats(&mut self, present: &[NodeId]) {
        self.stats.retain(|id, _| present.contains(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{PowerOfTwoPolicy, RoundRobinPolicy};
    use crate::testing::FakeNode;
    use rand::SeedableRng;

    #[test]
    fn bookings_steer_load_aware_choices_and_exclusions_hold() {
        let p2 = Box::new(PowerOfTwoPolicy::new(
            rand_chacha::ChaCha8Rng::seed_from_u64(3),
        ));
        let mut st = RouterState::new(Box::new(RoundRobinPolicy::default()), p2);
        let ws = vec![
            FakeNode::new("d0").worker(Role::Decode),
            FakeNode::new("d1").worker(Role::Decode),
        ];
        let now = Instant::now();
        st.book(ws[0].id());
        st.book(ws[0].id());
        for _ in 0..10 {
            assert_eq!(st.pick(Role::Decode, &ws, &[], &[], now), Some(1));
        }
        st.release(ws[0].id());
        st.release(ws[0].id());
        assert_eq!(st.booked(ws[0].id()), 0);
        // Stats say d1 is busy.
        st.set_stats(
            NodeId::new("d1"),
            NodeStats {
                queued_requests: 5,
                ..NodeStats::default()
            },
        );
        assert_eq!(st.pick(Role::Decode, &ws, &[], &[], now), Some(0));
        // Excluding d0 leaves d1; excluding both leaves nothing.
        let ex = [NodeId::new("d0")];
        assert_eq!(st.pick(Role::Prefill, &ws, &[], &ex, now), Some(1));
        let ex = [NodeId::new("d0"), NodeId::new("d1")];
        assert_eq!(st.pick(Role::Prefill, &ws, &[], &ex, now), None);
    }
}
