//! `router.prefill_policy = "cost"`: the prefill node with the lowest predicted time to first
//! token for the picked decode node. Fake nodes (the router's own test doubles) that report a
//! slow hand-off from one prefill node; a real router.

use crate::common;

use pdnode_core::config::PolicyName;
use pdnode_core::{RequestId, SamplingParams};
use pdnode_router::testing::{FakeCall, FakeNode};
use pdnode_router::{GenEvent, GenRequest, Router};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

async fn run(r: &Arc<Router>) -> RequestId {
    let mut g = r
        .generate(GenRequest {
            prompt_token_ids: vec![u32::from(b'x'); 64],
            sampling: SamplingParams {
                max_tokens: 2,
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

fn prefills(n: &FakeNode) -> HashSet<RequestId> {
    n.calls()
        .iter()
        .filter_map(|c| match c {
            FakeCall::Prefill(r) => Some(*r),
            _ => None,
        })
        .collect()
}

/// Of `ids`, how many `n` prefilled.
fn share(n: &FakeNode, ids: &[RequestId]) -> usize {
    let on = prefills(n);
    ids.iter().filter(|i| on.contains(i)).count()
}

async fn split(policy: PolicyName) -> (usize, usize) {
    let f = common::fakes(2, 1);
    let mut deps = f.deps;
    deps.config.prefill_policy = policy;
    let router = Router::new(deps);
    let (p0, p1) = (&f.prefill[0], &f.prefill[1]);
    // p0's hand-offs to d0 take 40 ms after its prefill (a slow link); p1's 0.1 ms.
    p0.set(|b| {
        b.transfer_us = 40_000;
        b.prefill_delay = Duration::from_millis(2);
    });
    p1.set(|b| b.prefill_delay = Duration::from_millis(2));
    // A few requests to measure both nodes (unmeasured nodes are tried first).
    for _ in 0..4 {
        run(&router).await;
    }
    let mut ids = Vec::new();
    for _ in 0..20 {
        ids.push(run(&router).await);
    }
    (share(p0, &ids), share(p1, &ids))
}

#[tokio::test]
async fn cost_keeps_prompts_off_the_prefill_node_whose_hand_off_is_slow() {
    let (slow, fast) = split(PolicyName::Cost).await;
    assert_eq!((slow, fast), (0, 20), "cost: p0 {slow}, p1 {fast}");
    // The same requests under round_robin split evenly: the figures above are the policy's.
    let (slow, fast) = split(PolicyName::RoundRobin).await;
    assert_eq!((slow, fast), (10, 10), "round_robin: p0 {slow}, p1 {fast}");
}

#[tokio::test]
async fn cost_spreads_concurrent_prompts_by_the_tokens_in_flight() {
    // Equal nodes: the tokens this router has in flight on a node count against it, so
    // concurrent requests spread instead of piling onto the first one measured fast.
    let f = common::fakes(2, 1);
    let mut deps = f.deps;
    deps.config.prefill_policy = PolicyName::Cost;
    let router = Router::new(deps);
    for p in &f.prefill {
        p.set(|b| b.prefill_delay = Duration::from_millis(50));
    }
    for _ in 0..2 {
        run(&router).await;
    }
    let runs: Vec<_> = (0..8)
        .map(|_| {
            let r = router.clone();
            tokio::spawn(async move { run(&r).await })
        })
        .collect();
    let mut ids = Vec::new();
    for h in runs {
        ids.push(h.await.unwrap());
    }
    let (a, b) = (share(&f.prefill[0], &ids), share(&f.prefill[1], &ids));
    assert_eq!(a + b, 8);
    assert!(a >= 3 && b >= 3, "8 concurrent prompts split {a} / {b}");
}
