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
    /// Nodes that lately failed as unreachable (connection lost, no answer), until when: picked
    /// only when no other candidate is left.
    suspect: HashMap<NodeId, Instant>,
    /// Which prefill/decode pairs are warm (`router.warm_pairs`).
    pub(crate) warm: super::warm::WarmPairs,
    /// `router.warm_pairs`: picks prefer warm pairs.
    warm_on: bool,
    /// What the `cost` prefill policy predicts from.
    pub(crate) cost: super::cost::CostModel,
}

impl RouterState {
    pub fn new(prefill: Box<dyn Policy>, decode: Box<dyn Policy>) -> Self {
        Self {
            prefill,
            decode,
            booked: HashMap::new(),
            stats: HashMap::new(),
            suspect: HashMap::new(),
            warm: super::warm::WarmPairs::default(),
            warm_on: false,
            cost: super::cost::CostModel::default(),
        }
    }

    /// With `on`, picks prefer warm pairs ([`Self::pick_for`]).
    pub fn warming_pairs(mut self, on: bool) -> Self {
        self.warm_on = on;
        self
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
            predicted_ttft_us: 0,
        }
    }

    /// The per-request state `role`'s policy keeps (`cache_aware`'s tree), if any.
    pub fn footprint(&self, role: Role) -> Option<crate::policy::Footprint> {
        match role {
            Role::Decode => self.decode.footprint(),
            _ => self.prefill.footprint(),
        }
    }

    /// Marks `id` unreachable until `until`: new picks avoid it while another candidate exists.
    pub fn suspect(&mut self, id: &NodeId, until: Instant) {
        self.suspect.insert(id.clone(), until);
    }

    /// Whether `id` is marked unreachable at `now`.
    pub fn is_suspect(&self, id: &NodeId, now: Instant) -> bool {
        self.suspect.get(id).is_some_and(|&t| now < t)
    }

    /// Picks a worker of `role` among `workers` minus `exclude` with that role's policy; the
    /// answer indexes `workers`. Nodes marked unreachable ([`Self::suspect`]) are left out while
    /// any other candidate remains.
    pub fn pick(
        &mut self,
        role: Role,
        workers: &[Worker],
        token_ids: &[u32],
        routing_key: Option<&str>,
        exclude: &[NodeId],
        now: Instant,
    ) -> Option<usize> {
        self.pick_for(role, workers, None, token_ids, routing_key, exclude, now)
    }

    /// [`Self::pick`], and with `router.warm_pairs` on, warm pairs first while any remains
    /// (after the unreachable nodes are left out): a decode node with no warm pair yet is left
    /// out (colocated workers need none), and so is a prefill node whose pair with `decode` is
    /// not warm.
    #[allow(clippy::too_many_arguments)]
    pub fn pick_for(
        &mut self,
        role: Role,
        workers: &[Worker],
        decode: Option<&Worker>,
        token_ids: &[u32],
        routing_key: Option<&str>,
        exclude: &[NodeId],
        now: Instant,
    ) -> Option<usize> {
        self.suspect.retain(|_, t| now < *t);
        let mut candidates: Vec<usize> = (0..workers.len())
            .filter(|&i| !exclude.contains(workers[i].id()))
            .collect();
        if candidates
            .iter()
            .any(|&i| !self.is_suspect(workers[i].id(), now))
        {
            candidates.retain(|&i| !self.is_suspect(workers[i].id(), now));
        }
        if self.warm_on {
            let warm = |w: &Worker| match (role, decode) {
                (Role::Decode, _) => {
                    crate::membership::is_colocated(w) || self.warm.has_warm_decode(w)
                }
                (_, Some(d)) => self.warm.is_warm(w, d),
                _ => true,
            };
            if candidates.iter().any(|&i| warm(&workers[i])) {
                candidates.retain(|&i| warm(&workers[i]));
            }
        }
        let by_cost = role == Role::Prefill && self.prefill.name() == "cost";
        let loads: Vec<WorkerLoad> = candidates
            .iter()
            .map(|&i| {
                let mut l = self.load_of(workers[i].id());
                if let (true, Some(d)) = (by_cost, decode) {
                    l.predicted_ttft_us =
                        self.cost.predict_us(&workers[i], d, token_ids.len(), now);
                }
                l
            })
            .collect();
        if loads.is_empty() {
            return None;
        }
        let ctx = PolicyContext {
            workers: &loads,
            token_ids,
            routing_key,
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
        self.cost.retain(present);
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
            assert_eq!(st.pick(Role::Decode, &ws, &[], None, &[], now), Some(1));
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
        assert_eq!(st.pick(Role::Decode, &ws, &[], None, &[], now), Some(0));
        // Excluding d0 leaves d1; excluding both leaves nothing.
        let ex = [NodeId::new("d0")];
        assert_eq!(st.pick(Role::Prefill, &ws, &[], None, &ex, now), Some(1));
        let ex = [NodeId::new("d0"), NodeId::new("d1")];
        assert_eq!(st.pick(Role::Prefill, &ws, &[], None, &ex, now), None);
    }

    #[test]
    fn unreachable_nodes_are_avoided_until_their_mark_ends_or_nothing_else_is_left() {
        let mut st = RouterState::new(
            Box::new(RoundRobinPolicy::default()),
            Box::new(RoundRobinPolicy::default()),
        );
        let ws = vec![
            FakeNode::new("p0").worker(Role::Prefill),
            FakeNode::new("p1").worker(Role::Prefill),
        ];
        let now = Instant::now();
        let until = now + std::time::Duration::from_secs(5);
        st.suspect(ws[0].id(), until);
        for _ in 0..6 {
            assert_eq!(st.pick(Role::Prefill, &ws, &[], None, &[], now), Some(1));
        }
        // The other one excluded: the suspect is still better than nothing.
        let ex = [NodeId::new("p1")];
        assert_eq!(st.pick(Role::Prefill, &ws, &[], None, &ex, now), Some(0));
        // The mark ends.
        let later = until;
        let picks: Vec<_> = (0..4)
            .filter_map(|_| st.pick(Role::Prefill, &ws, &[], None, &[], later))
            .collect();
        assert!(picks.contains(&0) && picks.contains(&1), "{picks:?}");
        assert!(!st.is_suspect(ws[0].id(), later));
    }
}
