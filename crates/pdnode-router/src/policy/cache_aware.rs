//! `cache_aware`: sglang-router's cache-aware policy over token ids.
//!
//! - When load is unbalanced, i.e. `max - min > balance_abs_threshold` **and**
//!   `max > min * balance_rel_threshold` (load = running + queued requests), route to the least
//!   loaded worker (shortest queue).
//! - Otherwise find the worker whose recent prompts share the longest prefix with this one (a
//!   [`RadixTree`] over token ids); if the match covers more than `cache_threshold` of the prompt,
//!   route there, else to the worker whose tree is smallest (most free cache).
//! - Either way the prompt is recorded under the chosen worker. Every `eviction_interval_secs`
//!   each worker's tree is trimmed to `max_tree_size` tokens (LRU) and workers that left are
//!   dropped.

use super::{Policy, PolicyContext, RadixTree};
use pdnode_core::config::CacheAwareParams;
use std::collections::HashSet;
use std::time::{Duration, Instant};

pub struct CacheAwarePolicy {
    params: CacheAwareParams,
    tree: RadixTree,
    tick: u64,
    last_eviction: Option<Instant>,
}

impl CacheAwarePolicy {
    pub fn new(params: CacheAwareParams) -> Self {
        Self {
            params,
            tree: RadixTree::new(),
            tick: 0,
            last_eviction: None,
        }
    }

    /// The tree, for tests and introspection.
    pub fn tree(&self) -> &RadixTree {
        &self.tree
    }

    fn maybe_evict(&mut self, ctx: &PolicyContext<'_>) {
        let interval = Duration::from_secs(self.params.eviction_interval_secs);
        let due = match self.last_eviction {
            None => {
                self.last_eviction = Some(ctx.now);
                false
            }
            Some(t) => ctx.now.saturating_duration_since(t) >= interval,
        };
        if !due {
            return;
        }
        self.last_eviction = Some(ctx.now);
        let present: HashSet<&str> = ctx.workers.iter().map(|w| w.id.as_str()).collect();
        for tenant in self.tree.tenants() {
            if present.contains(tenant.as_str()) {
                self.tree.evict_tenant(&tenant, self.params.max_tree_size);
            } else {
                self.tree.remove_tenant(&tenant);
            }
        }
    }

    fn is_imbalanced(&self, ctx: &PolicyContext<'_>) -> bool {
        let loads = ctx.workers.iter().map(|w| w.load());
        let (Some(max), Some(min)) = (loads.clone().max(), loads.min()) else {
            return false;
        };
        max - min > u64::from(self.params.balance_abs_threshold)
            && (max as f64) > (min as f64) * f64::from(self.params.balance_rel_threshold)
    }
}

impl Policy for CacheAwarePolicy {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn select(&mut self, ctx: &PolicyContext<'_>) -> Option<usize> {
        if ctx.workers.is_empty() {
            return None;
        }
        self.maybe_evict(ctx);
        let chosen = if self.is_imbalanced(ctx) {
            ctx.least_loaded()
        } else {
            let present: HashSet<&str> = ctx.workers.iter().map(|w| w.id.as_str()).collect();
            let (matched, tenant) = self
                .tree
                .longest_match(ctx.token_ids, |t| present.contains(t));
            let rate = if ctx.token_ids.is_empty() {
                0.0
            } else {
                matched as f64 / ctx.token_ids.len() as f64
            };
            let cached = tenant
                .filter(|_| rate > f64::from(self.params.cache_threshold))
                .and_then(|t| ctx.workers.iter().position(|w| w.id.as_str() == t));
            match cached {
                Some(i) => i,
                None => {
                    // The smallest tree; ties by load, then order.
                    (0..ctx.workers.len())
                        .min_by_key(|&i| {
                            let w = &ctx.workers[i];
                            (self.tree.tenant_size(w.id.as_str()), w.load(), i)
                        })
                        .unwrap_or(0)
                }
            }
        };
        self.tick += 1;
        self.tree
            .insert(ctx.token_ids, ctx.workers[chosen].id.as_str(), self.tick);
        Some(chosen)
    }

    fn footprint(&self) -> Option<super::Footprint> {
        Some(super::Footprint {
            tokens: self
                .tree
                .tenants()
                .iter()
                .map(|t| self.tree.tenant_size(t))
                .sum(),
            nodes: self.tree.node_count() as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::*;

    fn params() -> CacheAwareParams {
        CacheAwareParams {
            cache_threshold: 0.5,
            balance_abs_threshold: 4,
            balance_rel_threshold: 2.0,
            max_tree_size: 1000,
            eviction_interval_secs: 60,
        }
    }

    #[test]
    fn shared_prefix_sticks_to_one_worker_and_new_prefixes_spread() {
        let mut p = CacheAwarePolicy::new(params());
        let ws = workers(&[0, 0, 0]);
        let first = p.select(&ctx(&ws, &[1, 2, 3, 4, 5, 6])).unwrap();
        // Same long prefix: same worker.
        for tail in 0..5 {
            let i = p.select(&ctx(&ws, &[1, 2, 3, 4, 5, 100 + tail])).unwrap();
            assert_eq!(i, first);
        }
        // Unrelated prompts go to the smallest trees, i.e. to the other workers.
        let a = p.select(&ctx(&ws, &[50, 51, 52])).unwrap();
        let b = p.select(&ctx(&ws, &[60, 61, 62])).unwrap();
        assert_ne!(a, first);
        assert_ne!(b, first);
        assert_ne!(a, b);
    }

    #[test]
    fn low_match_ratio_does_not_route_by_cache() {
        let mut p = CacheAwarePolicy::new(params());
        let ws = workers(&[0, 0]);
        let first = p.select(&ctx(&ws, &[1, 2, 3, 4])).unwrap();
        // 1 of 4 tokens match: 0.25 < 0.5 -> the other (smaller) tree.
        let second = p.select(&ctx(&ws, &[1, 9, 9, 9])).unwrap();
        assert_ne!(first, second);
    }

    #[test]
    fn imbalance_switches_to_shortest_queue() {
        let mut p = CacheAwarePolicy::new(params());
        let balanced = workers(&[0, 1]);
        let first = p.select(&ctx(&balanced, &[7, 7, 7, 7])).unwrap();
        assert_eq!(first, 0);
        // Worker 0 now far busier: abs 10 > 4 and 10 > 0 * 2.
        let skewed = workers(&[10, 0]);
        assert_eq!(p.select(&ctx(&skewed, &[7, 7, 7, 7])).unwrap(), 1);
        // Abs difference above, relative below: 14 vs 8 (14 < 16) -> still by cache, i.e. to
        // worker 1 (the latest to see the prefix) although it is the busier one.
        let mild = workers(&[8, 14]);
        assert_eq!(p.select(&ctx(&mild, &[7, 7, 7, 7])).unwrap(), 1);
    }

    #[test]
    fn eviction_trims_trees_and_forgets_departed_workers() {
        let mut prm = params();
        prm.max_tree_size = 4;
        prm.eviction_interval_secs = 1;
        let mut p = CacheAwarePolicy::new(prm);
        let ws = workers(&[0]);
        let t0 = Instant::now();
        for k in 0..5u32 {
            let toks = [k * 10, k * 10 + 1, k * 10 + 2];
            let c = PolicyContext {
                workers: &ws,
                token_ids: &toks,
                routing_key: None,
                now: t0,
            };
            p.select(&c).unwrap();
        }
        assert_eq!(p.tree().tenant_size("w0"), 15);
        let later = PolicyContext {
            workers: &ws,
            token_ids: &[99],
            routing_key: None,
            now: t0 + Duration::from_secs(2),
        };
        let before = p.footprint().unwrap();
        assert_eq!(before.tokens, 15);
        p.select(&later).unwrap();
        assert!(p.tree().tenant_size("w0") <= 4 + 1);
        // The footprint (the router's gauges) follows the trim: tokens and nodes both shrink.
        let after = p.footprint().unwrap();
        assert!(after.tokens <= 5, "{after:?}");
        assert!(after.nodes < before.nodes, "{before:?} -> {after:?}");
        // w0 leaves; after the next interval its tree is gone.
        let others = workers(&[0, 0]).split_off(1);
        let c = PolicyContext {
            workers: &others,
            token_ids: &[5],
            routing_key: None,
            now: t0 + Duration::from_secs(4),
        };
        p.select(&c).unwrap();
        assert_eq!(p.tree().tenant_size("w0"), 0);
    }
}
