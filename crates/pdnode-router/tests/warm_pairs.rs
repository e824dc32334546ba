//! `router.warm_pairs`: a new prefill/decode pair gets a small request of the router's own
//! before it takes client traffic, while a warm pair is there to take it; with none warm a
//! request goes to a cold pair at once; a failed warm-up frees what it reserved and keeps the
//! pair out of client traffic. Fake nodes (the router's own test doubles), a real router.

use crate::common::{self, Harness};

use pdnode_core::metrics as m;
use pdnode_core::{NodeId, RequestId, Role, SamplingParams};
use pdnode_router::testing::{FakeCall, FakeNode};
use pdnode_router::{GenEvent, GenRequest, NodeError, Router};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

fn on(deps: &mut pdnode_router::RouterDeps) {
    deps.config.warm_pairs = true;
}

/// Runs one client request to its end; its request id.
async fn run(r: &Arc<Router>) -> RequestId {
    let mut g = r
        .generate(GenRequest {
            prompt_token_ids: b"hello world".iter().map(|&b| u32::from(b)).collect(),
            sampling: SamplingParams {
                max_tokens: 4,
                ..SamplingParams::default()
            },
            endpoint: "completions",
            routing_key: None,
            slo: Default::default(),
        })
        .expect("admitted");
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), g.events.recv())
            .await
            .expect("an event within 10 s");
        match ev {
            Some(GenEvent::Tokens { .. }) => {}
            Some(GenEvent::Done { .. }) => return g.request_id,
            Some(GenEvent::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without Done or Error"),
        }
    }
}

/// The request ids of `n`'s prefill calls.
fn prefills(n: &FakeNode) -> HashSet<RequestId> {
    n.calls()
        .iter()
        .filter_map(|c| match c {
            FakeCall::Prefill(r) => Some(*r),
            _ => None,
        })
        .collect()
}

async fn wait_warm(r: &Router, p: &str, d: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !r.is_pair_warm(&NodeId::new(p), &NodeId::new(d)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "pair ({p}, {d}) not warm within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn warmups(r: &Router, outcome: &str) -> f64 {
    r.metrics()
        .value(m::ROUTER_PAIR_WARMUPS_TOTAL, &[("outcome", outcome)])
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_new_prefill_node_takes_client_traffic_only_once_its_pair_is_warm() {
    let h = Harness::start_with(1, 1, on).await;
    let (p0, d0) = (&h.prefill[0], &h.decode[0]);
    // The stats loop warms the pair before any client request.
    wait_warm(&h.router, "p0", "d0").await;
    assert_eq!(
        prefills(p0).len(),
        1,
        "one warm-up prefill: {:?}",
        p0.calls()
    );
    assert_eq!(d0.count(|c| matches!(c, FakeCall::ReserveKv(_))), 1);
    assert!(
        d0.wait_for(Duration::from_secs(5), |c| c
            .iter()
            .any(|c| matches!(c, FakeCall::Decode(_))))
            .await,
        "the warm-up decodes on d0"
    );
    assert_eq!(warmups(&h.router, "ok"), 1.0);

    // p1 joins; its warm-up takes 400 ms. Client requests meanwhile stay on the warm pair.
    let p1 = FakeNode::new("p1");
    p1.set(|b| b.prefill_delay = Duration::from_millis(400));
    h.membership.add(p1.worker(Role::Prefill));
    let mut early = HashSet::new();
    for _ in 0..6 {
        early.insert(run(&h.router).await);
    }
    assert!(
        !h.router
            .is_pair_warm(&NodeId::new("p1"), &NodeId::new("d0")),
        "the requests above ran while p1's warm-up did (each takes ~0 ms, the warm-up 400 ms)"
    );
    let on_p1 = prefills(&p1);
    assert!(
        on_p1.is_disjoint(&early),
        "a client request reached the cold pair (p1, d0)"
    );
    assert_eq!(on_p1.len(), 1, "p1's warm-up alone: {:?}", p1.calls());

    // Warm now: round robin spreads client requests over both prefill nodes.
    wait_warm(&h.router, "p1", "d0").await;
    p1.set(|b| b.prefill_delay = Duration::ZERO);
    let mut late = HashSet::new();
    for _ in 0..6 {
        late.insert(run(&h.router).await);
    }
    let served_by_p1 = prefills(&p1).intersection(&late).count();
    assert!(
        served_by_p1 >= 2,
        "p1 took {served_by_p1} of 6 requests once warm"
    );
    assert_eq!(warmups(&h.router, "ok"), 2.0);
    for n in [p0, &p1, d0] {
        assert_eq!(n.kv_blocks_held(), 0, "KV left held");
    }
    h.stop().await;
}

#[tokio::test]
async fn with_no_warm_pair_a_request_goes_to_a_cold_pair_at_once() {
    // No stats loop (no server): nothing is warm when the request comes.
    let f = common::fakes(1, 1);
    let mut deps = f.deps;
    on(&mut deps);
    let router = Router::new(deps);
    assert!(!router.is_pair_warm(&NodeId::new("p0"), &NodeId::new("d0")));
    let id = run(&router).await;
    assert!(prefills(&f.prefill[0]).contains(&id));
    // Its hand-off made the pair warm.
    assert!(router.is_pair_warm(&NodeId::new("p0"), &NodeId::new("d0")));
}

#[tokio::test]
async fn a_failed_warm_up_frees_its_reservation_and_keeps_the_pair_out_of_traffic() {
    let h = Harness::start_with(1, 1, on).await;
    wait_warm(&h.router, "p0", "d0").await;
    let p1 = FakeNode::new("p1");
    p1.set(|b| {
        b.fail_prefill = Some(NodeError::new(
            pdnode_core::ErrorKind::Internal,
            "prefill broken",
        ))
    });
    h.membership.add(p1.worker(Role::Prefill));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while warmups(&h.router, "internal") < 1.0 {
        assert!(tokio::time::Instant::now() < deadline, "no failed warm-up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut ids = HashSet::new();
    for _ in 0..6 {
        ids.insert(run(&h.router).await);
    }
    assert!(prefills(&p1).is_disjoint(&ids));
    assert!(
        !h.router
            .is_pair_warm(&NodeId::new("p1"), &NodeId::new("d0"))
    );
    // The warm-up's reservation on d0 was aborted, with its capability.
    let d0 = &h.decode[0];
    assert!(
        d0.wait_for(Duration::from_secs(5), |c| c
            .iter()
            .any(|c| matches!(c, FakeCall::Abort(_))))
            .await,
        "d0 got the failed warm-up's abort: {:?}",
        d0.calls()
    );
    assert_eq!(d0.count(|c| matches!(c, FakeCall::AbortRefused(_))), 0);
    assert_eq!(d0.kv_blocks_held(), 0);
    h.stop().await;
}

#[tokio::test]
async fn with_warm_pairs_off_the_router_sends_no_request_of_its_own() {
    let h = Harness::start(1, 1).await;
    // Several stats refreshes (every 100 ms in these tests).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(prefills(&h.prefill[0]).is_empty());
    assert_eq!(
        h.decode[0].count(|c| matches!(c, FakeCall::ReserveKv(_))),
        0
    );
    assert_eq!(warmups(&h.router, "ok"), 0.0);
    h.stop().await;
}
