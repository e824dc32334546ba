//! `router.local_prefill` (conditional disaggregation): which requests a decode node prefills
//! itself. Fake nodes (the router's own test doubles, named as such) record every call; a real
//! router decides.

use crate::common;

use pdnode_core::metrics as m;
use pdnode_core::{ErrorKind, RequestId, SamplingParams};
use pdnode_router::testing::{FakeCall, FakeNode};
use pdnode_router::{GenEvent, GenRequest, NodeError, Router};
use std::sync::Arc;
use std::time::Duration;

async fn run(r: &Arc<Router>, prompt_len: usize) -> RequestId {
    let mut g = r
        .generate(GenRequest {
            prompt_token_ids: vec![u32::from(b'x'); prompt_len],
            sampling: SamplingParams {
                max_tokens: 4,
                ..SamplingParams::default()
            },
            endpoint: "completions",
            routing_key: None,
            slo: Default::default(),
        })
        .expect("admitted");
    let mut tokens = 0;
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(10), g.events.recv())
            .await
            .expect("an event within 10 s");
        match ev {
            Some(GenEvent::Tokens { token_ids, .. }) => tokens += token_ids.len(),
            Some(GenEvent::Done { .. }) => {
                assert_eq!(tokens, 4, "the whole output");
                return g.request_id;
            }
            Some(GenEvent::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without Done or Error"),
        }
    }
}

/// How many of `n`'s calls are `Prefill`s.
fn prefills(n: &FakeNode) -> usize {
    n.count(|c| matches!(c, FakeCall::Prefill(_)))
}

fn here(r: &Router, reason: &str) -> f64 {
    r.metrics()
        .value(m::ROUTER_LOCAL_PREFILLS_TOTAL, &[("reason", reason)])
        .unwrap_or(0.0)
}

#[tokio::test]
async fn short_prompts_are_prefilled_on_their_decode_node_and_long_ones_are_not() {
    let f = common::fakes(1, 1);
    let mut deps = f.deps;
    deps.config.local_prefill.max_prompt_tokens = 16;
    let router = Router::new(deps);
    let (p0, d0) = (&f.prefill[0], &f.decode[0]);
    for len in [1, 8, 16] {
        run(&router, len).await;
    }
    assert_eq!(prefills(p0), 0, "p0: {:?}", p0.calls());
    // D got all three calls of each request: reserve, prefill, decode.
    assert_eq!(prefills(d0), 3, "d0: {:?}", d0.calls());
    assert_eq!(d0.count(|c| matches!(c, FakeCall::Decode(_))), 3);
    assert_eq!(here(&router, "short"), 3.0);
    run(&router, 17).await;
    assert_eq!(
        prefills(p0),
        1,
        "a 17-token prompt goes to the prefill node"
    );
    assert_eq!(prefills(d0), 3);
    assert_eq!(here(&router, "short"), 3.0);
    // The hand-off metric counts only p0's real hand-off.
    let handoffs = router
        .metrics()
        .value(
            m::TRANSFER_HANDOFFS_TOTAL,
            &[("node", "p0"), ("outcome", "ok")],
        )
        .unwrap_or(0.0);
    assert_eq!(handoffs, 1.0);
}

#[tokio::test]
async fn off_by_default() {
    let f = common::fakes(1, 1);
    let router = Router::new(f.deps);
    run(&router, 1).await;
    assert_eq!(prefills(&f.prefill[0]), 1);
    assert_eq!(prefills(&f.decode[0]), 0);
}

#[tokio::test]
async fn busy_prefill_nodes_send_requests_to_a_decode_node_with_room() {
    let f = common::fakes(1, 1);
    let mut deps = f.deps;
    deps.config.local_prefill.prefill_busy_requests = 2;
    let router = Router::new(deps);
    let (p0, d0) = (&f.prefill[0], &f.decode[0]);
    p0.set(|b| b.prefill_delay = Duration::from_millis(800));
    // Two requests make p0 busy (two in flight, booked by the router) ...
    let a = tokio::spawn({
        let r = router.clone();
        async move { run(&r, 64).await }
    });
    let b = tokio::spawn({
        let r = router.clone();
        async move { run(&r, 64).await }
    });
    assert!(
        p0.wait_for(Duration::from_secs(5), |c| c
            .iter()
            .filter(|c| matches!(c, FakeCall::Prefill(_)))
            .count()
            == 2)
            .await,
        "{:?}",
        p0.calls()
    );
    // ... so the third goes to d0 itself, and is served before the two.
    run(&router, 64).await;
    assert_eq!(prefills(d0), 1, "d0: {:?}", d0.calls());
    assert_eq!(here(&router, "busy"), 1.0);
    assert!(!a.is_finished() || !b.is_finished(), "p0 was still busy");
    a.await.unwrap();
    b.await.unwrap();
    // Idle again: back to the prefill node.
    run(&router, 64).await;
    assert_eq!(prefills(p0), 3);
    assert_eq!(prefills(d0), 1);

    // A decode node with requests queued has no room: the request waits for p0 instead.
    d0.set(|b| b.stats.queued_requests = 3);
    router.refresh_stats(Duration::from_secs(2)).await;
    p0.set(|b| b.prefill_delay = Duration::from_millis(300));
    let a = tokio::spawn({
        let r = router.clone();
        async move { run(&r, 64).await }
    });
    let b = tokio::spawn({
        let r = router.clone();
        async move { run(&r, 64).await }
    });
    assert!(
        p0.wait_for(Duration::from_secs(5), |c| c
            .iter()
            .filter(|c| matches!(c, FakeCall::Prefill(_)))
            .count()
            == 5)
            .await
    );
    run(&router, 64).await;
    a.await.unwrap();
    b.await.unwrap();
    assert_eq!(prefills(p0), 6);
    assert_eq!(prefills(d0), 1);
}

#[tokio::test]
async fn a_failed_prefill_node_leaves_the_retry_to_the_decode_node() {
    let f = common::fakes(1, 1);
    let mut deps = f.deps;
    deps.config.local_prefill.prefill_busy_requests = 1;
    let router = Router::new(deps);
    let (p0, d0) = (&f.prefill[0], &f.decode[0]);
    p0.set(|b| b.fail_prefill = Some(NodeError::new(ErrorKind::Unavailable, "p0 is gone")));
    // The first attempt fails on p0; with no other prefill node the retry prefills on d0.
    run(&router, 32).await;
    assert_eq!(prefills(p0), 1);
    assert_eq!(prefills(d0), 1, "d0: {:?}", d0.calls());
    assert_eq!(here(&router, "busy"), 1.0);
}

#[tokio::test]
async fn with_no_prefill_node_decode_nodes_serve_what_local_prefill_allows() {
    // Short prompts only: a short one is served by d0, a long one is refused at admission.
    let f = common::fakes(0, 1);
    let mut deps = f.deps;
    deps.config.local_prefill.max_prompt_tokens = 16;
    let router = Router::new(deps);
    assert_eq!(router.usable_nodes(), (0, 1));
    run(&router, 16).await;
    assert_eq!(prefills(&f.decode[0]), 1);
    let refused = router
        .generate(GenRequest {
            prompt_token_ids: vec![u32::from(b'x'); 17],
            sampling: SamplingParams::default(),
            endpoint: "completions",
            routing_key: None,
            slo: Default::default(),
        })
        .err()
        .expect("a long prompt needs a prefill node");
    assert!(
        matches!(
            refused,
            pdnode_router::RouterError::NoNode {
                role: pdnode_core::Role::Prefill
            }
        ),
        "{refused}"
    );
    // The busy rule: decode nodes prefill anything when no prefill node is left.
    let f = common::fakes(0, 1);
    let mut deps = f.deps;
    deps.config.local_prefill.prefill_busy_requests = 4;
    let router = Router::new(deps);
    assert_eq!(router.usable_nodes(), (1, 1));
    run(&router, 200).await;
    assert_eq!(prefills(&f.decode[0]), 1);
    assert_eq!(here(&router, "busy"), 1.0);
}
