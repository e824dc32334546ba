//! The router's stats refresh asks every node side by side: nodes that do not answer cost one
//! call's timeout together, not one each, and the nodes that answer are in the policies' view
//! and the gauges. On tokio's paused clock, so the durations are exact, not timed.

mod common;

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
