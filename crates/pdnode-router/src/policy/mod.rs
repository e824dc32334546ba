//! Worker selection policies: one trait, one file each, a factory from the config's
//! [`PolicyName`]. Policies see only a [`PolicyContext`] (candidates with their load, the
//! request's tokens, the time), take `&mut self`, and have no side effects outside themselves:
//! the router books load after the choice. Prefill and decode each get their own instance.

mod bucket;
mod cache_aware;
mod cost;
mod manual;
mod power_of_two;
mod radix;
mod random;
mod round_robin;

pub use bucket::BucketPolicy;
pub use cache_aware::CacheAwarePolicy;
pub use cost::CostPolicy;
pub use manual::ManualPolicy;
pub use power_of_two::PowerOfTwoPolicy;
pub use radix::RadixTree;
pub use random::RandomPolicy;
pub use round_robin::RoundRobinPolicy;

use pdnode_core::NodeId;
use pdnode_core::config::{PolicyName, RouterConfig};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

/// One candidate worker and what the router knows of its load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerLoad {
    pub id: NodeId,
    /// Requests running on the node (its last stats plus what the router booked since).
    pub running: u32,
    /// Requests waiting in the node's queue.
    pub queued: u32,
    pub kv_blocks_free: u64,
    pub kv_blocks_total: u64,
    /// The request's predicted time to first token on this worker, microseconds: set for the
    /// `cost` policy's prefill candidates (0 elsewhere).
    pub predicted_ttft_us: u64,
}

impl WorkerLoad {
    pub fn idle(id: impl Into<String>) -> Self {
        Self {
            id: NodeId::new(id),
            running: 0,
            queued: 0,
            kv_blocks_free: 0,
            kv_blocks_total: 0,
            predicted_ttft_us: 0,
        }
    }

    /// The scalar load the balancing rules compare: running + queued requests.
    pub fn load(&self) -> u64 {
        u64::from(self.running) + u64::from(self.queued)
    }
}

/// Everything a policy may look at for one decision.
#[derive(Debug, Clone, Copy)]
pub struct PolicyContext<'a> {
    /// The candidates, never empty when `select` is called; the answer indexes into it.
    pub workers: &'a [WorkerLoad],
    /// The request's prompt token ids.
    pub token_ids: &'a [u32],
    /// The request's routing key, for the sticky `manual` policy (others ignore it).
    pub routing_key: Option<&'a str>,
    pub now: Instant,
}

impl PolicyContext<'_> {
    /// Index of the least loaded worker (ties: more free KV blocks, then the first).
    pub fn least_loaded(&self) -> usize {
        let mut best = 0;
        for (i, w) in self.workers.iter().enumerate().skip(1) {
            let b = &self.workers[best];
            if (w.load(), std::cmp::Reverse(w.kv_blocks_free))
                < (b.load(), std::cmp::Reverse(b.kv_blocks_free))
            {
                best = i;
            }
        }
        best
    }
}

/// A worker selection policy.
pub trait Policy: Send {
    /// The configured name (as sglang-router spells it).
    fn name(&self) -> &'static str;
    /// Picks one of `ctx.workers`; `None` only when there is none.
    fn select(&mut self, ctx: &PolicyContext<'_>) -> Option<usize>;
    /// What the policy keeps per request it placed (`cache_aware`'s prefix tree); `None` for
    /// policies that keep nothing.
    fn footprint(&self) -> Option<Footprint> {
        None
    }
}

/// The size of a policy's per-request state: prompt tokens and tree nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    pub tokens: u64,
    pub nodes: u64,
}

/// Builds the policy `name` with its parameters from `cfg`. `seed` drives the randomized
/// policies; 0 draws one from the OS.
pub fn build_policy(name: PolicyName, cfg: &RouterConfig, seed: u64) -> Box<dyn Policy> {
    let rng = if seed == 0 {
        ChaCha8Rng::from_os_rng()
    } else {
        ChaCha8Rng::seed_from_u64(seed)
    };
    match name {
        PolicyName::Random => Box::new(RandomPolicy::new(rng)),
        PolicyName::RoundRobin => Box::new(RoundRobinPolicy::default()),
        PolicyName::PowerOfTwo => Box::new(PowerOfTwoPolicy::new(rng)),
        PolicyName::CacheAware => Box::new(CacheAwarePolicy::new(cfg.cache_aware.clone())),
        PolicyName::Bucket => Box::new(BucketPolicy::new(cfg.bucket.clone())),
        PolicyName::Manual => Box::new(ManualPolicy::new(&cfg.manual, rng)),
        PolicyName::Cost => Box::new(CostPolicy),
    }
}

#[cfg(test)]
pub(crate) mod test_util {
    use super::*;

    pub fn workers(loads: &[u32]) -> Vec<WorkerLoad> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &l)| WorkerLoad {
                running: l,
                ..WorkerLoad::idle(format!("w{i}"))
            })
            .collect()
    }

    pub fn ctx<'a>(workers: &'a [WorkerLoad], tokens: &'a [u32]) -> PolicyContext<'a> {
        PolicyContext {
            workers,
            token_ids: tokens,
            routing_key: None,
            now: Instant::now(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_util::*;
    use super::*;

    #[test]
    fn factory_builds_every_name_and_each_selects_within_range() {
        let cfg = RouterConfig::default();
        let ws = workers(&[3, 1, 2]);
        for name in [
            PolicyName::Random,
            PolicyName::RoundRobin,
            PolicyName::PowerOfTwo,
            PolicyName::CacheAware,
            PolicyName::Bucket,
            PolicyName::Manual,
            PolicyName::Cost,
        ] {
            let mut p = build_policy(name, &cfg, 7);
            let expected = serde_json::to_value(name).unwrap();
            assert_eq!(Some(p.name()), expected.as_str());
            for _ in 0..20 {
                let i = p.select(&ctx(&ws, &[1, 2, 3])).unwrap();
                assert!(i < ws.len());
            }
            assert_eq!(p.select(&ctx(&[], &[1])), None, "{name:?} on no workers");
        }
    }

    #[test]
    fn least_loaded_breaks_ties_by_free_blocks() {
        let mut ws = workers(&[2, 1, 1]);
        ws[2].kv_blocks_free = 10;
        assert_eq!(ctx(&ws, &[]).least_loaded(), 2);
    }
}
