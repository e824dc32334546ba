//! Placement latency per router policy with many candidates, at three depths of what the
//! router does per request:
//!
//! - `select`: the policy alone (`Policy::select` over `WorkerLoad`s);
//! - `pick`: `RouterState::pick`, the router's decision (each candidate's load looked up from
//!   its stats and bookings, then the policy);
//! - `request`: what a request pays before its two picks as well: the candidates from the
//!   membership (`CardMembership::workers` for prefill, decode and colocated nodes, as the
//!   router's flow asks, over a registry view of that many cards per role), then a prefill
//!   and a decode pick.
//!
//! Each figure is one call timed alone (`Instant` around it), after a warm-up that also fills
//! the cache-aware trees.

use pdnode_core::config::{PolicyName, RouterConfig};
use pdnode_core::{NodeCard, NodeId, Role};
use pdnode_registry::{MembershipEvent, MembershipView, Snapshot};
use pdnode_router::grpc_client::CardMembership;
use pdnode_router::policy::{PolicyContext, WorkerLoad, build_policy};
use pdnode_router::router::RouterState;
use pdnode_router::testing::FakeNode;
use pdnode_router::{Membership, NodeStats, Worker};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use std::time::Instant;

pub const POLICIES: [PolicyName; 6] = [
    PolicyName::RoundRobin,
    PolicyName::Random,
    PolicyName::PowerOfTwo,
    PolicyName::CacheAware,
    PolicyName::Bucket,
    PolicyName::Manual,
];

#[derive(clap::Args, Debug, Clone)]
pub struct PlacementArgs {
    /// Candidates of each role.
    #[arg(long, default_value_t = 1000)]
    pub candidates: usize,
    /// Timed calls per policy and depth.
    #[arg(long, default_value_t = 20000)]
    pub iters: usize,
    /// Untimed calls first (they also grow the cache-aware trees).
    #[arg(long, default_value_t = 2000)]
    pub warmup: usize,
    /// Prompt length, tokens.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
}

/// p50 / p99 / max of one policy at one depth, nanoseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct PlaceRow {
    pub policy: &'static str,
    pub depth: &'static str,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

fn policy_name(p: PolicyName) -> &'static str {
    match p {
        PolicyName::Random => "random",
        PolicyName::RoundRobin => "round_robin",
        PolicyName::PowerOfTwo => "power_of_two",
        PolicyName::CacheAware => "cache_aware",
        PolicyName::Bucket => "bucket",
        PolicyName::Manual => "manual",
        PolicyName::Cost => "cost",
    }
}

/// Prompts that share one of 64 system prefixes (3/4 of the prompt) and end in their own tail.
struct Prompts {
    rng: ChaCha8Rng,
    prefixes: Vec<Vec<u32>>,
    len: usize,
}

impl Prompts {
    fn new(len: usize) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(18);
        let plen = len * 3 / 4;
        let prefixes = (0..64)
            .map(|_| (0..plen).map(|_| rng.random_range(0..32000)).collect())
            .collect();
        Self { rng, prefixes, len }
    }

    fn next(&mut self) -> Vec<u32> {
        let mut p = self.prefixes[self.rng.random_range(0..self.prefixes.len())].clone();
        while p.len() < self.len {
            p.push(self.rng.random_range(0..32000));
        }
        p
    }
}

fn stats(rng: &mut ChaCha8Rng) -> NodeStats {
    let total = 4096;
    NodeStats {
        running_requests: rng.random_range(0..64),
        queued_requests: rng.random_range(0..8),
        max_running_requests: 64,
        kv_blocks_free: rng.random_range(0..total),
        kv_blocks_total: total,
        ..NodeStats::default()
    }
}

fn percentiles(mut ns: Vec<u64>) -> (u64, u64, u64) {
    if ns.is_empty() {
        return (0, 0, 0);
    }
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99), ns[ns.len() - 1])
}

/// Times `iters` calls of `f` after `warmup` untimed ones.
fn time(warmup: usize, iters: usize, mut f: impl FnMut() -> bool) -> Option<(u64, u64, u64)> {
    for _ in 0..warmup {
        if !f() {
            return None;
        }
    }
    let mut ns = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        let ok = f();
        ns.push(t.elapsed().as_nanos() as u64);
        if !ok {
            return None;
        }
    }
    Some(percentiles(ns))
}

/// Cards of `n` prefill and `n` decode nodes.
pub fn cards(n: usize) -> Vec<NodeCard> {
    (0..2 * n)
        .map(|i| crate::registrar::card("bench", i))
        .collect()
}

/// Measures every policy at every depth. Must run inside a tokio runtime (the membership's
/// gRPC clients are made lazily, without connecting).
pub fn measure(a: &PlacementArgs) -> Vec<PlaceRow> {
    let n = a.candidates.max(1);
    let cfg = RouterConfig::default();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut prompts = Prompts::new(a.prompt_tokens.max(1));
    let loads: Vec<WorkerLoad> = (0..n)
        .map(|i| {
            let s = stats(&mut rng);
            WorkerLoad {
                id: NodeId::new(format!("node-{i}")),
                running: s.running_requests,
                queued: s.queued_requests,
                kv_blocks_free: s.kv_blocks_free,
                kv_blocks_total: s.kv_blocks_total,
                predicted_ttft_us: 0,
            }
        })
        .collect();
    let fakes: Vec<Arc<FakeNode>> = (0..n)
        .map(|i| FakeNode::new(&format!("node-{i}")))
        .collect();
    let workers: Vec<Worker> = fakes.iter().map(|f| f.worker(Role::Prefill)).collect();
    let mut view = MembershipView::new();
    view.apply(&MembershipEvent::Snapshot(Snapshot {
        cards: cards(n),
        revision: 1,
    }));
    let view = Arc::new(view);
    let v = view.clone();
    // What `pdnode start` gives a router: cards from the registry's view, a client per card.
    let membership = CardMembership::new(move |r| v.serving(r).cloned().collect());
    let mut rows = Vec::new();
    let mut key = 0u64;
    for name in POLICIES {
        let p = policy_name(name);
        let mut push = |depth, r: Option<(u64, u64, u64)>| {
            if let Some((p50_ns, p99_ns, max_ns)) = r {
                rows.push(PlaceRow {
                    policy: p,
                    depth,
                    p50_ns,
                    p99_ns,
                    max_ns,
                });
            }
        };
        let mut policy = build_policy(name, &cfg, 42);
        let r = time(a.warmup, a.iters, || {
            let tokens = prompts.next();
            key += 1;
            let k = format!("key-{}", key % 4096);
            let ctx = PolicyContext {
                workers: &loads,
                token_ids: &tokens,
                routing_key: Some(&k),
                now: Instant::now(),
            };
            policy.select(&ctx).is_some_and(|i| i < n)
        });
        push("select", r);

        let mut st = RouterState::new(build_policy(name, &cfg, 42), build_policy(name, &cfg, 43));
        for w in &workers {
            st.set_stats(w.id().clone(), stats(&mut rng));
        }
        let r = time(a.warmup, a.iters, || {
            let tokens = prompts.next();
            key += 1;
            let k = format!("key-{}", key % 4096);
            st.pick(
                Role::Prefill,
                &workers,
                &tokens,
                Some(&k),
                &[],
                Instant::now(),
            )
            .is_some_and(|i| i < n)
        });
        push("pick", r);

        let mut st = RouterState::new(build_policy(name, &cfg, 42), build_policy(name, &cfg, 43));
        let r = time(a.warmup / 4, (a.iters / 4).max(1), || {
            let tokens = prompts.next();
            key += 1;
            let k = format!("key-{}", key % 4096);
            let now = Instant::now();
            let prefills = membership.workers(Role::Prefill);
            let decodes = membership.workers(Role::Decode);
            let colocated = membership.workers(Role::All);
            let pp = st.pick(Role::Prefill, &prefills, &tokens, Some(&k), &[], now);
            let dp = st.pick(Role::Decode, &decodes, &tokens, Some(&k), &[], now);
            pp.is_some() && dp.is_some() && colocated.len() <= decodes.len()
        });
        push("request", r);
    }
    rows
}

pub fn table(rows: &[PlaceRow], candidates: usize) -> String {
    let us = |ns: u64| format!("{:.1}", ns as f64 / 1000.0);
    let mut s = format!(
        "placement with {candidates} candidates per role (µs per call)\n\
         | policy | depth | p50 | p99 | max | p99 < 20 µs |\n|---|---|---|---|---|---|\n"
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            r.policy,
            r.depth,
            us(r.p50_ns),
            us(r.p99_ns),
            us(r.max_ns),
            if r.p99_ns < 20_000 { "yes" } else { "no" }
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_known_sample() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentiles(v), (51, 99, 100));
        assert_eq!(percentiles(Vec::new()), (0, 0, 0));
    }

    #[tokio::test]
    async fn every_policy_places_at_every_depth() {
        let rows = measure(&PlacementArgs {
            candidates: 20,
            iters: 40,
            warmup: 4,
            prompt_tokens: 32,
        });
        assert_eq!(rows.len(), POLICIES.len() * 3, "{rows:?}");
        for r in &rows {
            assert!(r.p50_ns <= r.p99_ns && r.p99_ns <= r.max_ns, "{r:?}");
            assert!(r.max_ns > 0, "{r:?}");
        }
    }
}
