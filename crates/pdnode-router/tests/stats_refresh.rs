//! The router's stats refresh asks every node side by side: nodes that do not answer cost one
//! call's timeout together, not one each, and the nodes that answer are in the policies' view
//! and the gauges. On tokio's paused clock, so the durations are exact, not timed.

use crate::common;

use common::fakes;
use pdnode_core::metrics as m;
use pdnode_router::Router;
use std::time::Duration;

#[tokio::test(start_paused = true)]
async fn hung_nodes_cost_one_timeout_together_and_the_others_are_counted() {
    let f = fakes(2, 6);
    for d in &f.decode[..5] {
        d.set(|b| b.stats_delay = Duration::from_secs(600));
    }
    let router = Router::new(f.deps.clone());
    let t0 = tokio::time::Instant::now();
    router.refresh_stats(Duration::from_secs(1)).await;
    let took = t0.elapsed();
    // One after the other, the five hung nodes would take 5 s.
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(2),
        "{took:?}"
    );
    let total = |id: &str| router.metrics().value(m::KV_BLOCKS_TOTAL, &[("node", id)]);
    // Fake nodes are named p0, p1 and d0 .. d5; d0 .. d4 hang.
    for id in ["p0", "p1", "d5"] {
        assert_eq!(total(id), Some(100.0), "{id} answered");
    }
    for id in ["d0", "d1", "d2", "d3", "d4"] {
        assert_eq!(total(id), None, "{id} did not answer");
    }
}

/// The refresh also exports the size of the cache_aware prefix tree (what the router keeps per
/// placed prompt), so its growth can be told from a leak.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefix_tree_size_is_a_gauge() {
    let f = fakes(2, 2);
    let mut deps = f.deps.clone();
    deps.config.prefill_policy = pdnode_core::config::PolicyName::CacheAware;
    let router = Router::new(deps);
    let gauge = |name, role| router.metrics().value(name, &[("role", role)]);
    router.refresh_stats(Duration::from_secs(5)).await;
    assert_eq!(gauge(m::ROUTER_PREFIX_TREE_TOKENS, "prefill"), Some(0.0));
    for k in 0..3u32 {
        let mut req = common::request_40_tokens();
        req.prompt_token_ids = (0..64).map(|i| k * 64 + i).collect();
        let mut g = router.generate(req).unwrap();
        while g.events.recv().await.is_some() {}
    }
    router.refresh_stats(Duration::from_secs(5)).await;
    // Three distinct 64-token prompts: 192 tokens, a node each under the root.
    assert_eq!(gauge(m::ROUTER_PREFIX_TREE_TOKENS, "prefill"), Some(192.0));
    assert!(
        gauge(m::ROUTER_PREFIX_TREE_NODES, "prefill").is_some_and(|n| n >= 4.0),
        "{:?}",
        gauge(m::ROUTER_PREFIX_TREE_NODES, "prefill")
    );
    // The decode side's policy (round_robin here) keeps nothing per request: no gauge.
    assert_eq!(gauge(m::ROUTER_PREFIX_TREE_TOKENS, "decode"), None);
}
